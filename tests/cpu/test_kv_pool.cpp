// The KV pool sized from what the memory plan leaves (rollout.gpu_memory_utilization, as vLLM's;
// rollout.max_num_seqs), the start-up refusal at the 8B shapes, `fp8rl plan` saying what
// `fp8rl train` would refuse, and `fp8rl bench rl-step` refusing a recipe whose plan does not
// fit. The free memory is faked with memory.free_gib / --free-gib (the CPU backend reports none).
#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "model/shapes.h"
#include "rl/memory_plan.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

using test::run_shell;

constexpr int64_t kGiB = int64_t(1) << 30;

int64_t peak_of(const RunConfig& c, const ModelConfig& m, const MemoryChoice& ch) {
  return memory_plan_compute(memory_plan_input_chosen(c, m, DType::BF16, ch)).peak_bytes();
}

std::string gib2(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(kGiB));
  return buf;
}

// The message of memory_plan_check's refusal at BF16 activations (a failure if it accepts).
std::string refusal_of(const RunConfig& c, const ModelConfig& m, int64_t free_bytes) {
  try {
    memory_plan_check(c, m, DType::BF16, free_bytes);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A GRPO run at the Qwen3-0.6B shape (BF16 activations, as on CUDA).
RunConfig grpo_config() {
  RunConfig c;
  c.rollout.prompts_per_step = 16;
  c.rollout.generations_per_prompt = 16;
  c.rollout.max_new_tokens = 512;
  c.train.kl_beta = 0.01;
  return c;
}

// gpu_memory_utilization 0 (the default): the pool sized from the rollout shape, whatever the
// free memory; the CPU demo's pool is unchanged.
TEST(KvPool, OffByDefaultSizedFromTheRolloutShape) {
  const RunConfig demo;
  EXPECT_EQ(demo.rollout.gpu_memory_utilization, 0);
  EXPECT_EQ(demo.rollout.max_num_seqs, kRolloutMaxBatch);
  const ModelConfig m = model_shape("qwen3-0.6b");
  for (int64_t free_bytes : {int64_t(-1), 100 * kGiB}) {
    const MemoryChoice ch = memory_plan_choose(grpo_config(), m, DType::BF16, free_bytes);
    EXPECT_EQ(ch.kv_pages, memory_plan_kv_pages(grpo_config()));
    EXPECT_TRUE(ch.kv_note.empty());
    EXPECT_EQ(ch.lines.find("gpu_memory_utilization"), std::string::npos) << ch.lines;
  }
  EXPECT_EQ(memory_plan_kv_pages(demo), 200 * 19 + 1);  // val_size 200 sequences of 296 tokens
}

// With a fraction: the pool takes exactly what the rest of the plan leaves of fraction x free
// (one page more would not fit), says so, and the start-up check passes against that budget.
TEST(KvPool, TakesWhatThePlanLeavesOfTheFraction) {
  RunConfig c = grpo_config();
  c.rollout.gpu_memory_utilization = 0.9;
  const ModelConfig m = model_shape("qwen3-0.6b");
  const int64_t free_bytes = 60 * kGiB;
  const int64_t budget = memory_plan_budget_bytes(c, free_bytes);
  EXPECT_EQ(budget, static_cast<int64_t>(0.9 * double(free_bytes)));
  const MemoryChoice ch = memory_plan_choose(c, m, DType::BF16, free_bytes);
  const int64_t need = memory_plan_kv_pages(c);
  EXPECT_GT(ch.kv_pages, need);
  EXPECT_LT(ch.kv_pages, memory_plan_kv_pages_max(c, m));
  EXPECT_LE(peak_of(c, m, ch), budget);
  MemoryChoice more = ch;
  more.kv_pages += 1;
  EXPECT_GT(peak_of(c, m, more), budget);
  EXPECT_NE(ch.lines.find("rollout.gpu_memory_utilization 0.90: KV pool " + std::to_string(ch.kv_pages) + " pages"),
            std::string::npos)
      << ch.lines;
  EXPECT_NE(ch.lines.find("rollout.max_num_seqs = 256"), std::string::npos) << ch.lines;
  const std::string text = memory_plan_format(memory_plan_compute(memory_plan_input_chosen(c, m, DType::BF16, ch)), m);
  EXPECT_NE(text.find(std::to_string(ch.kv_pages) + " pages x 16 tokens"), std::string::npos) << text;
  EXPECT_NE(text.find("what gpu_memory_utilization 0.90 leaves"), std::string::npos) << text;
  const std::string ok = memory_plan_check(c, m, DType::BF16, free_bytes);
  EXPECT_NE(ok.find("fits in " + gib2(budget) + " (rollout.gpu_memory_utilization 0.90"), std::string::npos) << ok;
  // The page bytes: K and V x 28 layers x 16 tokens x 8 heads x 128 x 1 B (E4M3).
  EXPECT_EQ(memory_plan_kv_page_bytes(m, DType::E4M3), 2 * 28 * 16 * 8 * 128);
  // fp8rl sft has no rollout: its validation pool, checked against all the free memory.
  const MemoryChoice sft = memory_plan_choose(c, m, DType::BF16, free_bytes, /*sft=*/true);
  EXPECT_EQ(sft.kv_pages, memory_plan_sft_kv_pages(c));
  EXPECT_EQ(memory_plan_budget_bytes(c, free_bytes, /*sft=*/true), free_bytes);
}

// Never more than the engine can use: max_num_seqs sequences of max_position_embeddings tokens.
TEST(KvPool, CappedAtWhatTheEngineCanUse) {
  RunConfig c = grpo_config();
  c.rollout.gpu_memory_utilization = 1.0;
  c.rollout.max_new_tokens = 64;
  const ModelConfig m = model_shape("tiny");  // 8192 positions
  const MemoryChoice ch = memory_plan_choose(c, m, DType::BF16, 100 * kGiB);
  EXPECT_EQ(ch.kv_pages, memory_plan_kv_pages_max(c, m));
  EXPECT_EQ(ch.kv_pages, 256 * (8192 / 16) + 1);
  EXPECT_NE(ch.lines.find("the most the engine can use"), std::string::npos) << ch.lines;
  // More sequences at once: rollout.max_num_seqs raises both the cap and the least pool, and
  // the plan's decode logits.
  c.rollout.max_num_seqs = 512;
  EXPECT_EQ(memory_plan_kv_pages(c), 256 * ((256 + 64 + 15) / 16) + 1);  // P x G = 256 sequences
  c.rollout.prompts_per_step = 64;
  EXPECT_EQ(memory_plan_kv_pages(c), 512 * ((256 + 64 + 15) / 16) + 1);
  EXPECT_EQ(memory_plan_kv_pages_max(c, m), 512 * (8192 / 16) + 1);
  EXPECT_EQ(memory_plan_input(c, m, DType::BF16).generation_batch, 512);
  // Unknown free memory: the shape-sized pool, and it says why.
  const MemoryChoice unknown = memory_plan_choose(c, m, DType::BF16, -1);
  EXPECT_EQ(unknown.kv_pages, memory_plan_kv_pages(c));
  EXPECT_NE(unknown.lines.find("free memory is unknown"), std::string::npos) << unknown.lines;
}

// Never less than the shape-sized pool: when the fraction leaves less, the pool keeps that size
// and the check refuses, naming the fraction that would fit (and the other knobs).
TEST(KvPool, NeverBelowTheRolloutsNeedRefusedNamingTheFraction) {
  RunConfig c = grpo_config();
  c.rollout.gpu_memory_utilization = 0.5;
  const ModelConfig m = model_shape("qwen3-0.6b");
  RunConfig off = c;
  off.rollout.gpu_memory_utilization = 0;
  const int64_t need_peak = memory_plan_compute(memory_plan_input(off, m, DType::BF16)).peak_bytes();
  const int64_t free_bytes = need_peak + need_peak / 4;  // fits all of it, not half of it
  const MemoryChoice ch = memory_plan_choose(c, m, DType::BF16, free_bytes);
  EXPECT_EQ(ch.kv_pages, memory_plan_kv_pages(c));
  EXPECT_NE(ch.lines.find("below the " + std::to_string(ch.kv_pages) + " the rollout needs"), std::string::npos)
      << ch.lines;
  const std::string msg = refusal_of(c, m, free_bytes);
  EXPECT_NE(msg.find("(rollout.gpu_memory_utilization 0.50 of the device's"), std::string::npos) << msg;
  const size_t at = msg.find("rollout.gpu_memory_utilization >= ");
  ASSERT_NE(at, std::string::npos) << msg;
  RunConfig fixed = c;
  fixed.rollout.gpu_memory_utilization = std::stod(msg.substr(at + 34));
  EXPECT_GT(fixed.rollout.gpu_memory_utilization, 0.5);
  EXPECT_NE(memory_plan_check(fixed, m, DType::BF16, free_bytes).find("fits"), std::string::npos);
  EXPECT_NE(memory_plan_check(off, m, DType::BF16, free_bytes).find("fits"), std::string::npos);
}

// Llama-3.1-8B, 16 prompts x 16 samples x 1024 new tokens, kl_beta 0.01, with everything the
// lean plan offers (recompute auto, BF16 gradients and moments) on a 139 GiB H200: fp8_e2e fits,
// bf16 is refused with its exact shortfall (the plan's peak minus the free memory).
TEST(KvPool, Llama8BBf16IsRefusedWithItsShortfall) {
  RunConfig c = grpo_config();
  c.rollout.max_new_tokens = 1024;
  c.train.recompute = "auto";
  c.train.grad_dtype = "bf16";
  c.train.optimizer_state_dtype = "bf16";
  const ModelConfig m = model_shape("llama-3.1-8b");
  const int64_t free_bytes = 139 * kGiB;
  c.precision.recipe = "fp8_e2e";
  EXPECT_NE(memory_plan_check(c, m, DType::BF16, free_bytes).find("fits"), std::string::npos);
  c.precision.recipe = "bf16";
  const MemoryChoice ch = memory_plan_choose(c, m, DType::BF16, free_bytes);
  EXPECT_EQ(ch.recompute, "block");
  const int64_t peak = peak_of(c, m, ch);
  ASSERT_GT(peak, free_bytes);
  const std::string msg = refusal_of(c, m, free_bytes);
  EXPECT_NE(msg.find("the memory plan's peak, " + gib2(peak) + ", exceeds the device's free memory, 139.00 GiB, by " +
                     gib2(peak - free_bytes)),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("memory.allow_overcommit"), std::string::npos) << msg;
}

// `fp8rl plan --shape llama-3.1-8b` takes the shape's positions (1024 new tokens are fine), and
// prints what `fp8rl train` would refuse, with the shortfall and the knobs.
TEST(KvPool, PlanSaysWhatTrainWouldRefuse) {
  int st = 0;
  const std::string base = std::string("'") + FP8RL_BINARY +
                           "' plan --shape llama-3.1-8b device=cuda "
                           "rollout.prompts_per_step=16 rollout.generations_per_prompt=16 rollout.max_new_tokens=1024 "
                           "train.kl_beta=0.01 train.recompute=auto train.grad_dtype=bf16 "
                           "train.optimizer_state_dtype=bf16";
  std::string text = run_shell(base + " precision.recipe=bf16", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("fp8rl train would refuse this run: the memory plan's peak"), std::string::npos) << text;
  EXPECT_NE(text.find("exceeds the device's free memory, 139.00 GiB, by "), std::string::npos) << text;
  // fp8_e2e fits in 0.95 of the device (its peak with the shape's pool: 131.67 GiB, the trainer's
  // 6.5 GiB of FP8 W^T copies included; the pool takes what the fraction leaves).
  text = run_shell(base + " precision.recipe=fp8_e2e rollout.gpu_memory_utilization=0.95", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("fits in 132.05 GiB"), std::string::npos) << text;
  EXPECT_NE(text.find("rollout.gpu_memory_utilization 0.95: KV pool"), std::string::npos) << text;
  EXPECT_EQ(text.find("would refuse"), std::string::npos) << text;
  text = run_shell(std::string("'") + FP8RL_BINARY + "' plan --shape qwen3-8b device=cuda", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("memory plan: qwen3"), std::string::npos) << text;
}

// `fp8rl train` on the CPU with a faked free memory and a fraction: the pool it builds is the
// chosen one (the plan printed at start shows it), before any step.
TEST(KvPool, TrainBuildsTheChosenPool) {
  const std::string root = ::testing::TempDir() + "fp8rl_kvpool_" + std::to_string(::getpid());
  int st = 0;
  const std::string text = run_shell(
      "FP8RL_CACHE_DIR='" + root + "/cache' '" + FP8RL_BINARY +
          "' train steps=1 val_every=0 sft.steps=2 "
          "sft.batch_size=2 rollout.prompts_per_step=2 rollout.generations_per_prompt=2 rollout.max_new_tokens=8 "
          "model.tiny.hidden_size=32 model.tiny.num_layers=1 model.tiny.num_heads=2 model.tiny.num_kv_heads=1 "
          "model.tiny.head_dim=16 model.tiny.intermediate_size=64 memory.free_gib=0.5 "
          "rollout.gpu_memory_utilization=0.1 rollout.max_num_seqs=4 out=" +
          root + "/run",
      &st);
  EXPECT_EQ(st, 0) << text;
  const std::string said = "rollout.gpu_memory_utilization 0.10: KV pool ";
  const size_t at = text.find(said);
  ASSERT_NE(at, std::string::npos) << text;
  const long long pages = std::stoll(text.substr(at + said.size()));
  EXPECT_GT(pages, 4 * 17 + 1) << text;  // above the shape-sized pool (4 sequences of 264 tokens)
  EXPECT_NE(text.find(std::to_string(pages) + " pages x 16 tokens"), std::string::npos) << text;
  std::filesystem::remove_all(root);
}

// `fp8rl bench rl-step` checks each recipe's plan first: the one that does not fit is refused
// (shortfall, nothing run), the other runs; when none fits it exits non-zero.
TEST(KvPool, BenchRlStepRefusesARecipeThatCannotFit) {
  const std::string json = ::testing::TempDir() + "fp8rl_bench_refuse_" + std::to_string(::getpid()) + ".json";
  const std::string base = std::string("'") + FP8RL_BINARY +
                           "' bench rl-step --model tiny --prompts 2 --samples 2 "
                           "--prompt-len 8 --max-new-tokens 8 --steps 1 --warmup 0 --micro-batch-tokens 256 "
                           "--recipes fp8_e2e,fp32 --json '" +
                           json + "'";
  int st = 0;
  std::string text = run_shell(base + " --free-gib 100", &st);
  ASSERT_EQ(st, 0) << text;
  nlohmann::json j = nlohmann::json::parse(std::ifstream(json));
  const int64_t p8 = j["recipes"]["fp8_e2e"]["plan_peak_bytes"], p32 = j["recipes"]["fp32"]["plan_peak_bytes"];
  ASSERT_LT(p8, p32);
  const double between = double(p8 + p32) / 2 / double(kGiB);
  text = run_shell(base + " --free-gib " + std::to_string(between), &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("fp32: refused by the memory plan (nothing run): the memory plan's peak"), std::string::npos)
      << text;
  j = nlohmann::json::parse(std::ifstream(json));
  EXPECT_TRUE(j["recipes"].contains("fp8_e2e"));
  EXPECT_FALSE(j["recipes"].contains("fp32"));
  EXPECT_TRUE(j["refused"].contains("fp32"));
  text = run_shell(base + " --free-gib " + std::to_string(between) + " --allow-overcommit", &st);
  EXPECT_EQ(st, 0) << text;
  EXPECT_NE(text.find("--allow-overcommit: running anyway"), std::string::npos) << text;
  text = run_shell(base + " --free-gib 0.000001", &st);
  EXPECT_NE(st, 0) << text;
  EXPECT_NE(text.find("no recipe fits: nothing was run"), std::string::npos) << text;
  std::filesystem::remove(json);
}

}  // namespace
}  // namespace fp8rl
