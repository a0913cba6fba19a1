// The memory plan: its arithmetic on a small shape (numbers worked out by hand below), and its
// generator / KV / master-weight lines against what the CPU backend really allocates.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <unistd.h>

#include "core/error.h"
#include "model/shapes.h"
#include "model/weights.h"
#include "rl/memory_plan.h"
#include "rollout/rollout.h"
#include "support/test_support.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

using test::run_shell;

// V 1000, D 64, F 128, 2 layers, 4 query / 2 KV heads of 16, q/k-norm, tied (Qwen3-like).
ModelConfig small_shape() {
  ModelConfig c = model_config_tiny("qwen3", 1000, 64, 2, 4, 2, 128);
  c.head_dim = 16;
  c.validate();
  return c;
}

int64_t find(const std::vector<MemoryPlanLine>& lines, const std::string& prefix) {
  for (const auto& l : lines)
    if (l.name.rfind(prefix, 0) == 0) return l.bytes;
  ADD_FAILURE() << "no line starting with " << prefix;
  return -1;
}

TEST(MemoryPlan, SmallShapeByHand) {
  MemoryPlanInput in;
  in.model = small_shape();
  in.generator.linear = LinearMode::FP8_BLOCK;
  in.generator.kv_cache = DType::E4M3;
  in.act_dtype = DType::BF16;
  in.kv_pages = 10;
  in.page_size = 16;
  in.micro_batch_tokens = 100;
  in.generation_batch = 8;
  const MemoryPlan p = memory_plan_compute(in);
  // Parameters: per layer q 64x64 + k,v 2 x 32x64 + o 64x64 + 3 x 64x128 + 2 norms x 64
  // + q/k-norm 2 x 16 = 4096 + 4096 + 4096 + 24576 + 128 + 32 = 37024;
  // embed 64000 (tied) + 2 x 37024 + final norm 64 = 138112.
  EXPECT_EQ(p.parameters, 138112);
  EXPECT_EQ(find(p.resident, "master weights"), 4 * 138112);
  EXPECT_EQ(find(p.resident, "gradients"), 4 * 138112);
  EXPECT_EQ(find(p.resident, "Adam"), 8 * 138112);
  // Generator: embed 64000 x 2 B + final norm 128 B; per layer norms (64 + 64 + 16 + 16) x 2 B
  // = 320 B; linears 1 B/elem + 4 B per 128x128 block (each has one block here):
  // 4100 + 2052 + 2052 + 4100 + 8196 + 8196 + 8196 = 36892. Total 128128 + 2 x 37212 = 202552.
  EXPECT_EQ(find(p.resident, "generator weights"), 202552);
  // KV: K and V x 2 layers x 160 slots x 2 heads x 16 x 1 B = 20480, + scales 2 x 2 x 2 x 4 B = 32.
  EXPECT_EQ(find(p.resident, "KV pool"), 20512);
  // The trainer's per-step compute copies (BF16 trainer, BF16 activations): BF16 copies of every
  // linear and of the tied embedding, as the generator's BF16 weights count them.
  EXPECT_EQ(find(p.resident, "trainer compute copies"), memory_plan_generator_bytes(in.model, in.trainer, DType::BF16));
  EXPECT_EQ(p.resident.size(), 6u);  // no reference policy
  // Saved activations per token and block: 5 x 64 + 3 x 128 + 2 x 64 + 2 x 32 + (64 + 32 raw q, k)
  // = 992 BF16 values = 1984 B, + F32 stats (2 rstd + 4 lse + 4 q_rstd + 2 k_rstd) = 48 B -> 2032 B.
  EXPECT_EQ(memory_plan_block_bytes_per_token(in.model, DType::BF16), 2032);
  // Head: x_final, hidden 2 x 64 x 2 B + rstd, lse 8 B + 3 I32 ids = 276 B. 100 tokens x (2 x 2032 + 276).
  EXPECT_EQ(memory_plan_head_bytes_per_token(in.model, DType::BF16), 276);
  EXPECT_EQ(find(p.transient, "saved activations"), 434000);
  // Logits: 100 tokens x 1000 x 4 B (below the chunk cap); decode: 8 x 1000 x 2 B (the head's BF16
  // output, read by the sampler as it is; F32 in the consistent mode).
  EXPECT_EQ(find(p.transient, "lm_head logits"), 400000);
  EXPECT_EQ(find(p.transient, "decode logits"), 16000);
  {
    MemoryPlanInput cs = in;
    cs.generator.consistent = true;
    EXPECT_EQ(find(memory_plan_compute(cs).transient, "decode logits"), 32000);
  }
  // Recomputation keeps the 2 block inputs (2 x 64 x 2 B) + one block + the head per token.
  EXPECT_EQ(p.activations_recompute_bytes, 100 * (256 + 2032 + 276));
  // The flash attention backward's F32 work: delta per (token, q head) and, with GQA (4 q / 2 kv
  // heads here), dk and dv partials per q head: 100 x 4 x 4 B + 2 x 100 x 64 x 4 B.
  EXPECT_EQ(find(p.transient, "attention backward scratch"), 1600 + 51200);
  EXPECT_EQ(p.peak_bytes(), p.resident_bytes() + 434000 + find(p.transient, "backward scratch of one block") +
                                find(p.transient, "attention backward scratch") + 400000 + 16000);

  // train.recompute: block saves the block inputs + one block + the head instead.
  {
    MemoryPlanInput r = in;
    r.recompute = true;
    const MemoryPlan pr = memory_plan_compute(r);
    EXPECT_EQ(find(pr.transient, "saved activations"), p.activations_recompute_bytes);
    EXPECT_LT(pr.peak_bytes(), p.peak_bytes());
  }
  // An FP8 trainer also keeps each FP8 linear's W^T for the dgrad (LinearWeight::wqt): as large
  // as the linear's 128x128 cache, 36892 B per FP8 block (above); a BF16 first block has none.
  {
    MemoryPlanInput f = in;
    f.trainer.linear = LinearMode::FP8_BLOCK;
    const MemoryPlan pf = memory_plan_compute(f);
    EXPECT_EQ(find(pf.resident, "trainer FP8 dgrad weights"), 2 * 36892);
    EXPECT_EQ(pf.resident.size(), 7u);
    f.trainer.bf16_first_layers = 1;
    EXPECT_EQ(find(memory_plan_compute(f).resident, "trainer FP8 dgrad weights"), 36892);
    for (const auto& l : p.resident) EXPECT_EQ(l.name.find("W^T"), std::string::npos) << "a BF16 trainer: " << l.name;
    // train.dgrad_weight_cache: off: no copies; the dgrad transposes into one scratch buffer as
    // large as the largest FP8 linear's W^T (gate, up, down: 8196 B).
    f.trainer.bf16_first_layers = 0;
    f.dgrad_weight_cache = false;
    const MemoryPlan off = memory_plan_compute(f);
    for (const auto& l : off.resident) EXPECT_NE(l.name.rfind("trainer FP8 dgrad weights", 0), 0u) << l.name;
    EXPECT_EQ(find(off.resident, "trainer dgrad W^T scratch"), 8196);
    EXPECT_EQ(off.resident.size(), 7u);
    EXPECT_EQ(pf.peak_bytes() - off.peak_bytes(), 2 * 36892 - 8196);
    for (const auto& l : pf.resident) EXPECT_NE(l.name.rfind("trainer dgrad W^T scratch", 0), 0u) << l.name;
  }
  // The frozen reference policy holds only its weights in the trainer's compute dtypes.
  in.reference_policy = true;
  in.trainer.linear = LinearMode::BF16;
  EXPECT_EQ(find(memory_plan_compute(in).resident, "reference policy"), 2 * 138112);
  in.generator.linear = LinearMode::BF16;  // every generator tensor BF16: 2 B x parameters
  EXPECT_EQ(find(memory_plan_compute(in).resident, "generator weights"), 2 * 138112);
  const std::string text = memory_plan_format(p, in.model, int64_t(1) << 30);
  EXPECT_NE(text.find("fits in 1.00 GiB"), std::string::npos) << text;
  EXPECT_NE(memory_plan_format(p, in.model, 1000).find("DOES NOT FIT"), std::string::npos);
}

int64_t tensor_bytes(const Tensor& t) { return t.defined() ? int64_t(t.nbytes()) : 0; }

int64_t linear_bytes(const LinearWeight& l) {
  return tensor_bytes(l.w) + tensor_bytes(l.wq.data) + tensor_bytes(l.wq.scales) + tensor_bytes(l.bias);
}

// The plan's generator and KV lines equal what RolloutEngine allocates (CPU: F32 activations),
// for FP8 and BF16 generators, with BF16 first/last layers and an untied qwen2 shape.
TEST(MemoryPlan, MatchesTheEnginesAllocations) {
  auto be = make_backend("cpu");
  for (const std::string family : {"qwen3", "qwen2"}) {
    ModelConfig c = model_config_tiny(family, 300, 128, 3, 4, 2, 256);
    RandomInit init;
    init.seed = 5;
    ModelWeights host = model_weights_random(c, init, DType::F32);
    ModelWeights dev = model_weights_to_device(*be, host, DType::F32);
    for (LinearMode mode : {LinearMode::FP8_BLOCK, LinearMode::BF16}) {
      EnginePrecision gen;
      gen.linear = mode;
      gen.bf16_first_layers = 1;
      gen.kv_cache = mode == LinearMode::FP8_BLOCK ? DType::E4M3 : DType::BF16;
      RolloutEngine engine(*be, dev, gen, 7, 16, 4);
      const ModelWeights& g = engine.weights();
      int64_t got = tensor_bytes(g.embed) + tensor_bytes(g.final_norm) +
                    (c.tie_word_embeddings ? 0 : tensor_bytes(g.lm_head));
      for (const LayerWeights& l : g.layers) {
        got += tensor_bytes(l.attn_norm) + tensor_bytes(l.mlp_norm) + tensor_bytes(l.q_norm) + tensor_bytes(l.k_norm);
        for (const LinearWeight* w : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) got += linear_bytes(*w);
      }
      EXPECT_EQ(memory_plan_generator_bytes(c, gen, be->act_dtype()), got) << family;
      int64_t kv = tensor_bytes(engine.kv_cache().k_scale) + tensor_bytes(engine.kv_cache().v_scale);
      for (const Tensor& t : engine.kv_cache().k) kv += tensor_bytes(t);
      for (const Tensor& t : engine.kv_cache().v) kv += tensor_bytes(t);
      MemoryPlanInput in;
      in.model = c;
      in.generator = gen;
      in.act_dtype = be->act_dtype();
      in.kv_pages = 7;
      EXPECT_EQ(find(memory_plan_compute(in).resident, "KV pool"), kv) << family;
      EXPECT_EQ(find(memory_plan_compute(in).resident, "master weights"), 4 * model_count_parameters(host));
    }
  }
}

// The KV pool of `fp8rl train`: pages for the sequences decoded at once (at most 256) of up to
// 256 prompt + max_new_tokens tokens (capped at 2048), plus one.
TEST(MemoryPlan, KvPoolPages) {
  RunConfig c;
  c.rollout.prompts_per_step = 2;
  c.rollout.generations_per_prompt = 4;
  c.val_size = 4;
  c.rollout.max_new_tokens = 40;
  EXPECT_EQ(memory_plan_kv_pages(c), 8 * 19 + 1);  // 296 tokens = 19 pages of 16
  c.rollout.prompts_per_step = 64;                  // GSM8K: 2048 samples, 1319 validation
  c.rollout.generations_per_prompt = 32;
  c.val_size = 1319;
  c.rollout.max_new_tokens = 1024;
  EXPECT_EQ(memory_plan_kv_pages(c), 256 * 80 + 1);  // 1280 tokens = 80 pages; 256 at once
  c.rollout.max_new_tokens = 4000;
  EXPECT_EQ(memory_plan_kv_pages(c), 256 * 128 + 1);  // capped at 2048 tokens
}

TEST(MemoryPlan, ShapesAndErrors) {
  const ModelConfig q = model_shape("qwen3-1.7b");
  EXPECT_GT(q.num_parameters(), 1500000000);  // Qwen3-1.7B: ~1.72B with tied embeddings
  EXPECT_LT(q.num_parameters(), 1800000000);
  const ModelConfig l = model_shape("llama-3.2-1b");
  EXPECT_GT(l.num_parameters(), 1200000000);  // Llama-3.2-1B: ~1.24B
  EXPECT_LT(l.num_parameters(), 1300000000);
  EXPECT_THROW(model_shape("gpt-5"), Error);
  MemoryPlanInput bad;
  bad.model = small_shape();
  bad.micro_batch_tokens = 0;
  EXPECT_THROW(memory_plan_compute(bad), Error);
}

// The start-up check (issue 11): BF16 at the Qwen3-1.7B shape with micro_batch_tokens 32768
// plans a ~119 GiB peak, above 100 GiB of free memory. It is refused with a message naming the knobs, and the
// micro_batch_tokens it names does fit; memory.allow_overcommit turns the refusal into a warning;
// an unknown free memory (the CPU backend) checks nothing.
TEST(MemoryCheck, RefusesWhatCannotFitAndNamesTheKnob) {
  RunConfig c;
  c.precision.recipe = "bf16";
  c.train.micro_batch_tokens = 32768;
  c.rollout.prompts_per_step = 16;
  c.rollout.generations_per_prompt = 16;
  c.rollout.max_new_tokens = 512;
  const ModelConfig m = model_shape("qwen3-1.7b");
  const int64_t free_bytes = 100ll << 30;  // an H200 with 39 GiB already taken
  const int64_t peak = memory_plan_compute(memory_plan_input(c, m, DType::BF16)).peak_bytes();
  ASSERT_GT(peak, free_bytes);
  std::string msg;
  try {
    memory_plan_check(c, m, DType::BF16, free_bytes);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("exceeds the device's free memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("memory.allow_overcommit"), std::string::npos) << msg;
  const size_t at = msg.find("train.micro_batch_tokens <= ");
  ASSERT_NE(at, std::string::npos) << msg;
  const int64_t suggested = std::stoll(msg.substr(at + 28));
  EXPECT_GT(suggested, 0);
  EXPECT_LT(suggested, 32768);
  RunConfig fixed = c;
  fixed.train.micro_batch_tokens = suggested;
  EXPECT_LE(memory_plan_compute(memory_plan_input(fixed, m, DType::BF16)).peak_bytes(), free_bytes);
  EXPECT_NE(memory_plan_check(fixed, m, DType::BF16, free_bytes).find("fits"), std::string::npos);
  // Proceeding anyway: a warning, no throw.
  RunConfig over = c;
  over.memory.allow_overcommit = true;
  std::string warn;
  EXPECT_NO_THROW(warn = memory_plan_check(over, m, DType::BF16, free_bytes));
  EXPECT_NE(warn.find("warning"), std::string::npos) << warn;
  // Unknown free memory: skipped.
  EXPECT_NE(memory_plan_check(c, m, DType::BF16, -1).find("skipped"), std::string::npos);
}

// The KV-pool knobs: a plan over by less than the KV pool is fixed by smaller rollouts, and a
// reference policy by kl_beta = 0; each suggestion is checked with the plan.
TEST(MemoryCheck, NamesRolloutSizesAndKlBeta) {
  RunConfig c;
  c.precision.recipe = "bf16";
  c.train.micro_batch_tokens = 1;  // activations negligible: only the resident part matters
  c.train.kl_beta = 0.05;
  c.rollout.prompts_per_step = 16;
  c.rollout.generations_per_prompt = 16;
  c.rollout.max_new_tokens = 2048;
  const ModelConfig m = model_shape("qwen3-0.6b");
  const MemoryPlan p = memory_plan_compute(memory_plan_input(c, m, DType::BF16));
  const int64_t free_bytes = p.peak_bytes() - (64ll << 20);  // 64 MiB short
  std::string msg;
  try {
    memory_plan_check(c, m, DType::BF16, free_bytes);
  } catch (const Error& e) {
    msg = e.what();
  }
  ASSERT_FALSE(msg.empty());
  EXPECT_NE(msg.find("rollout.prompts_per_step x rollout.generations_per_prompt and val_size <= "), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rollout.max_new_tokens <= "), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.kl_beta: 0"), std::string::npos) << msg;
  const size_t at = msg.find("val_size <= ");
  const int s = std::stoi(msg.substr(at + 12));
  RunConfig fixed = c;
  fixed.rollout.prompts_per_step = s;
  fixed.rollout.generations_per_prompt = 1;
  fixed.val_size = s;
  EXPECT_LE(memory_plan_compute(memory_plan_input(fixed, m, DType::BF16)).peak_bytes(), free_bytes);
  // memory.free_gib overrides what the device reports.
  RunConfig g = c;
  g.memory.free_gib = 2.5;
  EXPECT_EQ(memory_plan_free_bytes(g, 123), int64_t(2.5 * double(1ll << 30)));
  EXPECT_EQ(memory_plan_free_bytes(c, 123), 123);
  EXPECT_EQ(memory_plan_free_bytes(c, -1), -1);
}

// `fp8rl sft` is planned with its own KV pool (the validation engine's) and no reference policy;
// its knobs are train.micro_batch_tokens and val_size, not the rollout sizes or kl_beta.
TEST(MemoryCheck, SftPlansItsOwnPoolAndKnobs) {
  RunConfig c;
  c.precision.recipe = "bf16";
  c.train.kl_beta = 0.05;
  c.val_size = 200;
  const ModelConfig m = model_shape("qwen3-0.6b");
  const MemoryPlanInput sft = memory_plan_input(c, m, DType::BF16, /*sft=*/true);
  EXPECT_EQ(sft.kv_pages, memory_plan_sft_kv_pages(c));
  EXPECT_FALSE(sft.reference_policy);
  EXPECT_LT(memory_plan_compute(sft).peak_bytes(), memory_plan_compute(memory_plan_input(c, m, DType::BF16)).peak_bytes());
  c.train.micro_batch_tokens = 1;
  const int64_t free_bytes = memory_plan_compute(memory_plan_input(c, m, DType::BF16, true)).peak_bytes() - (1 << 20);
  std::string msg;
  try {
    memory_plan_check(c, m, DType::BF16, free_bytes, /*sft=*/true);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("val_size <= "), std::string::npos) << msg;
  EXPECT_EQ(msg.find("rollout."), std::string::npos) << msg;
  EXPECT_EQ(msg.find("kl_beta"), std::string::npos) << msg;
}

// End to end on the CPU with an injected free memory: `fp8rl sft` and `fp8rl train` stop before
// any work (no run directory is made) with the message, and exit non-zero.
TEST(MemoryCheck, TrainAndSftRefuseBeforeAnyWork) {
  const std::string root = ::testing::TempDir() + "fp8rl_memcheck_" + std::to_string(::getpid());
  const std::string out = root + "/run";
  for (const char* cmd : {"sft", "train"}) {  // train: the demo's SFT starting policy is refused first
    std::string line = "FP8RL_CACHE_DIR='" + root + "/cache' '" + FP8RL_BINARY + "' " + cmd +
                       " memory.free_gib=0.00001 out=" + out + " 2>&1";
    FILE* f = popen(line.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string text;
    char buf[512];
    while (fgets(buf, sizeof buf, f)) text += buf;
    const int status = pclose(f);
    EXPECT_NE(status, 0) << cmd << ": " << text;
    EXPECT_NE(text.find("exceeds the device's free memory"), std::string::npos) << cmd << ": " << text;
    EXPECT_NE(text.find("Nothing was run"), std::string::npos) << cmd << ": " << text;
    EXPECT_FALSE(std::filesystem::exists(out)) << cmd << " created its run directory";
  }
  std::filesystem::remove_all(root);
}

// The lean optimizer's lines: BF16 gradients 2 B/param, BF16 moments 2 + 2 B/param, and (BF16
// gradients) the F32 copy of the largest gradient an op accumulates through.
TEST(MemoryPlan, LeanOptimizerCountsTwoBytesPerValue) {
  MemoryPlanInput in;
  in.model = small_shape();
  in.kv_pages = 10;
  in.micro_batch_tokens = 100;
  in.generation_batch = 8;
  const MemoryPlan full = memory_plan_compute(in);
  in.grad_dtype = DType::BF16;
  in.moment_dtype = DType::BF16;
  const MemoryPlan lean = memory_plan_compute(in);
  const int64_t N = 138112;
  EXPECT_EQ(find(lean.resident, "master weights"), 4 * N);  // the master stays F32
  EXPECT_EQ(find(lean.resident, "gradients (BF16)"), 2 * N);
  EXPECT_EQ(find(lean.resident, "Adam moments m, v (BF16)"), 4 * N);
  EXPECT_EQ(find(full.resident, "gradients (F32)"), 4 * N);
  EXPECT_EQ(find(full.resident, "Adam moments m, v (F32)"), 8 * N);
  // The largest tensor is the embedding, 1000 x 64.
  EXPECT_EQ(find(lean.transient, "F32 copy of one BF16 gradient"), 4 * 64000);
  EXPECT_EQ(full.resident_bytes() - lean.resident_bytes(), 6 * N);
  EXPECT_EQ(full.peak_bytes() - lean.peak_bytes(), 6 * N - 4 * 64000);
  // From the config keys.
  RunConfig c;
  c.train.grad_dtype = "bf16";
  c.train.optimizer_state_dtype = "bf16";
  const MemoryPlanInput ci = memory_plan_input(c, small_shape(), DType::BF16);
  EXPECT_EQ(ci.grad_dtype, DType::BF16);
  EXPECT_EQ(ci.moment_dtype, DType::BF16);
  const std::string text = memory_plan_format(memory_plan_compute(ci), small_shape());
  EXPECT_NE(text.find("train.optimizer_state_dtype"), std::string::npos) << text;
  EXPECT_NE(text.find("ZeRO-1"), std::string::npos) << text;  // says what it does not count
}

// train.recompute: auto picks block exactly when the plan does not fit without it, and says so;
// with the free memory unknown it keeps none.
TEST(MemoryCheck, RecomputeAutoChoosesBlockOnlyWhenNeeded) {
  RunConfig c;
  c.precision.recipe = "bf16";
  c.train.micro_batch_tokens = 32768;
  c.train.recompute = "auto";
  const ModelConfig m = model_shape("qwen3-1.7b");
  RunConfig none = c, block = c;
  none.train.recompute = "none";
  block.train.recompute = "block";
  const int64_t p_none = memory_plan_compute(memory_plan_input(none, m, DType::BF16)).peak_bytes();
  const int64_t p_block = memory_plan_compute(memory_plan_input(block, m, DType::BF16)).peak_bytes();
  ASSERT_LT(p_block, p_none);
  EXPECT_EQ(memory_plan_input(c, m, DType::BF16).recompute, false);  // auto counts as none until resolved
  MemoryChoice ch = memory_plan_choose(c, m, DType::BF16, p_none);
  EXPECT_EQ(ch.recompute, "none");
  EXPECT_NE(ch.lines.find("train.recompute: auto -> none"), std::string::npos) << ch.lines;
  ch = memory_plan_choose(c, m, DType::BF16, p_none - 1);
  EXPECT_EQ(ch.recompute, "block");
  EXPECT_NE(ch.lines.find("train.recompute: auto -> block"), std::string::npos) << ch.lines;
  // A BF16 trainer has no W^T cache to drop first.
  EXPECT_NE(ch.lines.find("train.dgrad_weight_cache: auto -> on (nothing to keep"), std::string::npos) << ch.lines;
  ch = memory_plan_choose(c, m, DType::BF16, -1);
  EXPECT_EQ(ch.recompute, "none");
  EXPECT_NE(ch.lines.find("unknown"), std::string::npos) << ch.lines;
  EXPECT_EQ(memory_plan_choose(none, m, DType::BF16, 1).recompute, "none");  // as configured
  EXPECT_EQ(memory_plan_choose(block, m, DType::BF16, -1).recompute, "block");
  // The start-up check resolves it first: fits with block between the two peaks, says why.
  const std::string ok = memory_plan_check(c, m, DType::BF16, (p_none + p_block) / 2);
  EXPECT_NE(ok.find("auto -> block"), std::string::npos) << ok;
  EXPECT_NE(ok.find("fits"), std::string::npos) << ok;
  // Below block's peak it still refuses, naming the other knobs (not block again).
  try {
    memory_plan_check(c, m, DType::BF16, p_block - (1ll << 30));
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("auto -> block"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("- train.recompute: block"), std::string::npos) << msg;
  }
}

int64_t peak_with(RunConfig c, const ModelConfig& m, const char* recompute, const char* cache) {
  c.train.recompute = recompute;
  c.train.dgrad_weight_cache = cache;
  return memory_plan_compute(memory_plan_input(c, m, DType::BF16)).peak_bytes();
}

// train.dgrad_weight_cache: auto keeps the FP8 dgrad's W^T copies when the plan fits with them,
// drops them before train.recompute: auto turns on recomputation (a plan that fits only without
// them gets no recomputation), and brings them back when recomputation alone fits; a plan that
// needs both gets both. `on` never drops them, and its refusal names the knob first.
TEST(MemoryCheck, DgradCacheAutoDropsItBeforeRecomputation) {
  RunConfig c;
  c.precision.recipe = "fp8_e2e";
  c.train.micro_batch_tokens = 32768;
  c.train.recompute = "auto";
  c.train.dgrad_weight_cache = "auto";
  const ModelConfig m = model_shape("qwen3-1.7b");
  EXPECT_TRUE(memory_plan_input(c, m, DType::BF16).dgrad_weight_cache);  // auto counts as on until resolved
  const int64_t none_on = peak_with(c, m, "none", "on"), none_off = peak_with(c, m, "none", "off");
  const int64_t block_on = peak_with(c, m, "block", "on"), block_off = peak_with(c, m, "block", "off");
  ASSERT_LT(none_off, none_on);
  ASSERT_LT(block_on, none_off);  // recomputation saves more than the cache holds
  ASSERT_LT(block_off, block_on);
  auto choose = [&](const RunConfig& t, int64_t free_bytes) {
    const MemoryChoice ch = memory_plan_choose(t, m, DType::BF16, free_bytes);
    return ch.recompute + "," + ch.dgrad_weight_cache;
  };
  EXPECT_EQ(choose(c, none_on), "none,on");     // fits as it is
  EXPECT_EQ(choose(c, none_off), "none,off");   // fits only without the cache: no recomputation
  EXPECT_EQ(choose(c, block_on), "block,on");   // recomputation alone fits: the cache stays
  EXPECT_EQ(choose(c, block_off), "block,off");  // needs both
  EXPECT_EQ(choose(c, block_off - 1), "block,off");  // nothing fits: the least memory, refused below
  EXPECT_EQ(choose(c, -1), "none,on");          // free memory unknown
  // The lines say which and why, the cache's first.
  MemoryChoice ch = memory_plan_choose(c, m, DType::BF16, none_off);
  EXPECT_EQ(ch.lines.find("train.dgrad_weight_cache: auto -> off (with the FP8 dgrad's W^T copies"), 0u) << ch.lines;
  EXPECT_NE(ch.lines.find("train.recompute: auto -> none (the plan's peak without recomputation"), std::string::npos)
      << ch.lines;
  EXPECT_NE(ch.lines.find("without the W^T cache"), std::string::npos) << ch.lines;
  for (const auto& l : memory_plan_compute(memory_plan_input_chosen(c, m, DType::BF16, ch)).resident)
    EXPECT_NE(l.name.rfind("trainer FP8 dgrad weights", 0), 0u) << "dropped, yet counted: " << l.name;
  EXPECT_EQ(memory_plan_compute(memory_plan_input_chosen(c, m, DType::BF16, ch)).peak_bytes(), none_off);
  const std::string fits = memory_plan_check(c, m, DType::BF16, none_off);
  EXPECT_NE(fits.find("auto -> off"), std::string::npos) << fits;
  EXPECT_NE(fits.find("memory check: peak"), std::string::npos) << fits;
  ch = memory_plan_choose(c, m, DType::BF16, none_on);
  EXPECT_NE(ch.lines.find("train.dgrad_weight_cache: auto -> on (the plan's peak with"), std::string::npos) << ch.lines;
  ch = memory_plan_choose(c, m, DType::BF16, block_off);
  EXPECT_NE(ch.lines.find("train.recompute: auto -> block (without recomputation the plan's peak even without the "
                          "W^T cache"), std::string::npos) << ch.lines;
  ch = memory_plan_choose(c, m, DType::BF16, -1);
  EXPECT_NE(ch.lines.find("train.dgrad_weight_cache: auto -> on (the device's free memory is unknown"),
            std::string::npos) << ch.lines;
  // Nothing fits: refused with both autos resolved, not naming the cache as a knob.
  try {
    memory_plan_check(c, m, DType::BF16, block_off - (1ll << 30));
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("train.dgrad_weight_cache: auto -> off"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("- train.dgrad_weight_cache: off"), std::string::npos) << msg;
  }

  // on: never dropped; recompute: auto turns on recomputation instead.
  RunConfig on = c;
  on.train.dgrad_weight_cache = "on";
  EXPECT_EQ(choose(on, none_off), "block,on");
  EXPECT_EQ(choose(on, 1), "block,on");
  EXPECT_EQ(memory_plan_choose(on, m, DType::BF16, none_off).lines.find("dgrad_weight_cache"), std::string::npos);
  on.train.recompute = "none";
  EXPECT_EQ(choose(on, none_off), "none,on");
  try {
    memory_plan_check(on, m, DType::BF16, none_off);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    const std::string msg = e.what();
    const size_t knob = msg.find("\n  - train.dgrad_weight_cache: off (drops the FP8 dgrad's W^T copies");
    ASSERT_NE(knob, std::string::npos) << msg;
    EXPECT_EQ(knob, msg.find("\n  - ")) << "the cheapest knob first: " << msg;
    EXPECT_NE(msg.find("memory.allow_overcommit"), std::string::npos) << msg;
  }
  RunConfig over = on;
  over.memory.allow_overcommit = true;
  EXPECT_NE(memory_plan_check(over, m, DType::BF16, none_off).find("warning"), std::string::npos);
  // off: as configured, whatever the memory.
  RunConfig off = c;
  off.train.dgrad_weight_cache = "off";
  EXPECT_EQ(choose(off, int64_t(1) << 50), "none,off");
  EXPECT_EQ(choose(off, block_on), "block,off");
  EXPECT_EQ(memory_plan_input(off, m, DType::BF16).dgrad_weight_cache, false);
}

// The plan's W^T line is what the Trainer holds (CPU backend): its wqt copies with the cache,
// none without.
TEST(MemoryPlan, DgradCacheLineIsTheTrainersCopies) {
  auto be = make_backend("cpu");
  ModelConfig c = model_config_tiny("qwen3", 300, 128, 3, 4, 2, 256);
  RandomInit init;
  init.seed = 9;
  const ModelWeights host = model_weights_random(c, init, DType::F32);
  EnginePrecision prec;
  prec.linear = LinearMode::FP8_BLOCK;
  prec.bf16_first_layers = 1;
  MemoryPlanInput in;
  in.model = c;
  in.trainer = prec;
  in.act_dtype = be->act_dtype();
  for (bool cache : {true, false}) {
    TrainerOptions opt;
    opt.dgrad_weight_cache = cache;
    Trainer t(*be, model_weights_to_device(*be, host, DType::F32), prec, opt);
    t.score({TrainSequence{{1, 2, 3, 4, 5, 6}, 2}}, 1.0f, false, false);  // builds the compute weights
    in.dgrad_weight_cache = cache;
    const MemoryPlan p = memory_plan_compute(in);
    if (cache) {
      EXPECT_GT(t.dgrad_weight_cache_bytes(), 0);
      EXPECT_EQ(find(p.resident, "trainer FP8 dgrad weights (W^T)"), t.dgrad_weight_cache_bytes());
    } else {
      EXPECT_EQ(t.dgrad_weight_cache_bytes(), 0);
      for (const auto& l : p.resident) EXPECT_NE(l.name.rfind("trainer FP8 dgrad weights", 0), 0u) << l.name;
    }
  }
}

// `fp8rl plan` and `bench rl-step --plan-only` at Llama-3.1-8B on a 139 GiB H200 (fp8_e2e, 16 x
// 16 x 1024 new tokens, kl_beta 0.01, F32 gradients, BF16 moments, 4k micro-batches): short with
// the W^T cache, it fits without; auto drops it and says so, on is refused naming the knob.
TEST(MemoryCheck, DgradCacheAtLlama8B) {
  int st = 0;
  const std::string plan = std::string("'") + FP8RL_BINARY +
                           "' plan --shape llama-3.1-8b device=cuda rollout.prompts_per_step=16 "
                           "rollout.generations_per_prompt=16 rollout.max_new_tokens=1024 train.kl_beta=0.01 "
                           "train.recompute=auto train.optimizer_state_dtype=bf16 train.micro_batch_tokens=4096";
  std::string text = run_shell(plan, &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("train.dgrad_weight_cache: auto -> off"), std::string::npos) << text;
  EXPECT_NE(text.find("trainer dgrad W^T scratch"), std::string::npos) << text;
  EXPECT_EQ(text.find("would refuse"), std::string::npos) << text;
  text = run_shell(plan + " train.dgrad_weight_cache=on", &st);
  EXPECT_NE(text.find("fp8rl train would refuse this run"), std::string::npos) << text;
  EXPECT_NE(text.find("- train.dgrad_weight_cache: off"), std::string::npos) << text;
  const std::string bench = std::string("'") + FP8RL_BINARY +
                            "' bench rl-step --device cuda --plan-only --free-gib 139 --model llama-3.1-8b "
                            "--recipes fp8_e2e --prompts 16 --samples 16 --max-new-tokens 1024 --kl-beta 0.01 "
                            "--recompute auto --grad-dtype fp32 --optimizer-state-dtype bf16 "
                            "--micro-batch-tokens 4096";
  text = run_shell(bench, &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("(recompute block, dgrad W^T cache off)"), std::string::npos) << text;
  EXPECT_NE(text.find("fp8_e2e: fits"), std::string::npos) << text;
  text = run_shell(bench + " --dgrad-weight-cache on", &st);
  EXPECT_NE(st, 0) << text;
  EXPECT_NE(text.find("would be refused"), std::string::npos) << text;
  EXPECT_NE(text.find("--dgrad-weight-cache off (or auto)"), std::string::npos) << text;
  text = run_shell(bench + " --dgrad-weight-cache maybe", &st);
  EXPECT_NE(st, 0) << text;
  EXPECT_NE(text.find("--dgrad-weight-cache must be auto, on or off"), std::string::npos) << text;
}

// bench rl-step's --micro-batch-tokens auto (the default): the largest power-of-two micro-batch
// from 16384 at which every recipe fits, the same for all recipes — 16384 on an H200's 139 GiB at
// the 1.7B shape, 8192 on an H100's ~78.6 GiB free (where bf16 at 16384 needs 85.3 GiB; the
// session-31 H100 run refused it); an explicit value is kept.
TEST(MemoryCheck, BenchMicroBatchAutoFitsEveryRecipe) {
  int st = 0;
  const std::string bench = std::string("'") + FP8RL_BINARY +
                            "' bench rl-step --device cuda --plan-only --recipes bf16,fp8_e2e --free-gib ";
  std::string text = run_shell(bench + "139", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("micro-batch 16384 tokens (auto)"), std::string::npos) << text;
  text = run_shell(bench + "78.6", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("micro-batch 8192 tokens (auto)"), std::string::npos) << text;
  EXPECT_EQ(text.find("would be refused"), std::string::npos) << text;
  text = run_shell(bench + "78.6 --micro-batch-tokens 16384", &st);
  EXPECT_NE(text.find("micro-batch 16384 tokens,"), std::string::npos) << text;
  EXPECT_NE(text.find("bf16: would be refused"), std::string::npos) << text;
  // The 3% reserve: the 6-layer Qwen3-30B-A3B cut's bf16 plan (~77.9 GiB at 16384 tokens) fits an
  // H100's 78.63 GiB free but not 97% of it, so 8192 (its 16384 ran out of memory in session 32);
  // the H200 keeps 16384.
  const std::string moe = std::string("'") + FP8RL_BINARY +
                          "' bench rl-step --device cuda --plan-only --model qwen3-30b-a3b --layers 6 "
                          "--max-new-tokens 256 --grad-dtype bf16 --optimizer-state-dtype bf16 --recipes bf16,fp8_e2e "
                          "--free-gib ";
  text = run_shell(moe + "78.63", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("micro-batch 8192 tokens (auto)"), std::string::npos) << text;
  text = run_shell(moe + "139", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("micro-batch 16384 tokens (auto)"), std::string::npos) << text;
}

// The lean optimizer is among the knobs a refusal names, each checked with the plan.
TEST(MemoryCheck, NamesTheLeanOptimizerKnobs) {
  RunConfig c;
  c.precision.recipe = "bf16";
  c.train.recompute = "block";
  const ModelConfig m = model_shape("qwen3-8b");
  RunConfig lean = c;
  lean.train.optimizer_state_dtype = "bf16";
  const int64_t p = memory_plan_compute(memory_plan_input(c, m, DType::BF16)).peak_bytes();
  const int64_t pl = memory_plan_compute(memory_plan_input(lean, m, DType::BF16)).peak_bytes();
  ASSERT_LT(pl, p);
  try {
    memory_plan_check(c, m, DType::BF16, (p + pl) / 2);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("train.optimizer_state_dtype: bf16"), std::string::npos) << msg;
  }
}

// `fp8rl plan` and the start of `fp8rl sft` say what train.recompute: auto chose and why.
TEST(MemoryCheck, RecomputeAutoIsSaidAtStart) {
  int st = 0;
  const std::string plan = std::string("'") + FP8RL_BINARY + "' plan --shape qwen3-1.7b device=cuda precision.recipe=bf16 "
                           "train.micro_batch_tokens=32768 train.recompute=auto";
  std::string text = run_shell(plan + " --device-gib 40", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("train.recompute: auto -> block"), std::string::npos) << text;
  EXPECT_NE(text.find("(train.recompute: block)"), std::string::npos) << text;  // the plan counted it
  text = run_shell(plan + " --device-gib 139", &st);
  EXPECT_NE(text.find("train.recompute: auto -> none"), std::string::npos) << text;
  const std::string root = ::testing::TempDir() + "fp8rl_recompute_auto_" + std::to_string(::getpid());
  text = run_shell("FP8RL_CACHE_DIR='" + root + "/cache' '" + FP8RL_BINARY + "' sft sft.steps=1 sft.batch_size=2 "
                     "val_size=2 model.tiny.hidden_size=32 model.tiny.num_layers=1 model.tiny.num_heads=2 "
                     "model.tiny.num_kv_heads=1 model.tiny.head_dim=16 model.tiny.intermediate_size=64 "
                     "train.recompute=auto memory.free_gib=100 out=" + root + "/run", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("train.recompute: auto -> none (the plan's peak without recomputation"), std::string::npos)
      << text;
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace fp8rl

namespace fp8rl {
namespace {

// MLA (deepseek_v3): the KV pool is the latent cache, one row of kv_lora_rank + qk_rope_head_dim
// per token and layer and no V pool, as the engine allocates it. At Moonlight-16B-A3B's shape
// (27 layers, 16 heads, latent 512 + rope 64) an E4M3 pool holds 27 x 576 = 15552 B per token,
// where expanded per-head K (192) and V (128) would take 27 x 16 x 320 = 138240 B (8.9x).
TEST(MemoryPlan, CountsTheMlaLatentCache) {
  const char* moonlight = R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
    "n_routed_experts": 64, "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": null,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": true, "scoring_func": "sigmoid", "hidden_act": "silu", "rms_norm_eps": 1e-05,
    "tie_word_embeddings": false, "rope_theta": 50000.0, "rope_scaling": null})";
  MemoryPlanInput in;
  in.model = model_config_from_json(moonlight);
  in.generator.kv_cache = DType::E4M3;
  in.kv_pages = 1000;
  in.page_size = 16;
  const int64_t scales = 2 * 27 * 1 * 4;  // k_scale, v_scale [layers, 1]
  EXPECT_EQ(find(memory_plan_compute(in).resident, "KV pool"), 16000 * 27 * 576 + scales);

  // A tiny MLA model: the plan's bytes are the engine's cache, tensor for tensor.
  ModelConfig c = model_config_tiny("qwen3_moe", 48, 64, 2, 4, 4, 96);
  c.model_type = "deepseek_v3";
  c.qk_norm = false;
  c.tie_word_embeddings = false;
  c.mlp_only_layers = {0, 1};
  c.kv_lora_rank = 20;
  c.qk_nope_head_dim = 12;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 10;
  c.head_dim = 8;
  c.validate();
  RandomInit init;
  auto be = make_backend("cpu");
  const ModelWeights dev = model_weights_to_device(*be, model_weights_random(c, init, DType::F32), DType::F32);
  for (DType kv_dtype : {DType::E4M3, DType::BF16}) {
    EnginePrecision gen;
    gen.kv_cache = kv_dtype;
    RolloutEngine engine(*be, dev, gen, 7, 16, 4);
    int64_t kv = tensor_bytes(engine.kv_cache().k_scale) + tensor_bytes(engine.kv_cache().v_scale);
    for (const Tensor& t : engine.kv_cache().k) kv += tensor_bytes(t);
    EXPECT_TRUE(engine.kv_cache().v.empty());
    MemoryPlanInput tin;
    tin.model = c;
    tin.generator = gen;
    tin.act_dtype = be->act_dtype();
    tin.kv_pages = 7;
    EXPECT_EQ(find(memory_plan_compute(tin).resident, "KV pool"), kv);
    EXPECT_EQ(kv, 2 * 7 * 16 * 28 * int64_t(dtype_size(kv_dtype)) + 2 * 2 * 4);
  }
}

}  // namespace
}  // namespace fp8rl
