// The consistent mode (precision.consistent; docs/design.md "The consistent mode"): the recipe
// and config keys and what they refuse, the row-invariance of the CPU's forward ops, the
// generator's logp_gen op (logprobs_of_logits of its head's logits) against token_logprobs, and
// the generator's log-probs against the trainer's scoring of the same tokens on the same weights:
// bit for bit, on ragged batches, for the bf16 and fp8_e2e (E4M3 KV cache) recipes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"
#include "model/transformer.h"
#include "rl/config.h"
#include "support/consistent_util.h"
#include "support/random_tensor.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

using test::ConsistentRun;
using test::ConsistentShape;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(Consistent, RecipeSpecAndConfigKey) {
  const PrecisionRecipe e2e = PrecisionRecipe::parse("fp8_e2e:consistent=on");
  EXPECT_TRUE(e2e.consistent());
  EXPECT_TRUE(e2e.generator.consistent && e2e.trainer.consistent);
  EXPECT_EQ(e2e.trainer.kv_cache, DType::E4M3);  // attends through an E4M3 cache
  EXPECT_EQ(PrecisionRecipe::parse("bf16:consistent=on").trainer.kv_cache, DType::BF16);
  EXPECT_EQ(PrecisionRecipe::parse("fp32:consistent=on").trainer.kv_cache, DType::F32);
  EXPECT_EQ(PrecisionRecipe::parse("fp8_e2e:kv=bf16+consistent=on").trainer.kv_cache, DType::BF16);
  EXPECT_FALSE(PrecisionRecipe::parse("fp8_e2e").consistent());
  EXPECT_FALSE(PrecisionRecipe::parse("fp8_e2e:consistent=off").consistent());
  EXPECT_TRUE(e2e.generator.consistent_linears && e2e.trainer.consistent_linears);
  // attn: the consistent mode but the linears on the fast kernels.
  const PrecisionRecipe attn = PrecisionRecipe::parse("fp8_e2e:consistent=attn");
  EXPECT_TRUE(attn.consistent());
  EXPECT_EQ(attn.trainer.kv_cache, DType::E4M3);
  EXPECT_FALSE(attn.generator.consistent_linears || attn.trainer.consistent_linears);
  EXPECT_TRUE(has(error_of([] { PrecisionRecipe::parse("fp8_e2e:attn=fp8+consistent=on"); }), "attn=off"));
  EXPECT_TRUE(has(error_of([] { PrecisionRecipe::parse("fp8_e2e:tkv=bf16+consistent=on"); }), "drop tkv"));
  EXPECT_TRUE(has(error_of([] { PrecisionRecipe::parse("fp8_e2e:consistent=yes"); }), "on, off, attn or flash"));
  // flash: the consistent mode with the generator's attention in the trainer's flash order.
  const PrecisionRecipe flash = PrecisionRecipe::parse("fp8_e2e:pow2=on+consistent=flash");
  EXPECT_TRUE(flash.consistent() && flash.generator.consistent_flash && flash.trainer.consistent_flash);
  EXPECT_FALSE(flash.generator.consistent_linears || flash.trainer.consistent_linears);
  EXPECT_FALSE(attn.generator.consistent_flash || e2e.generator.consistent_flash);
  // logits=fast: a consistent mode with each engine's own head.
  EXPECT_TRUE(attn.generator.exact_logits() && attn.trainer.exact_logits());
  const PrecisionRecipe fast = PrecisionRecipe::parse("fp8_e2e:pow2=on+consistent=attn+logits=fast");
  EXPECT_TRUE(fast.consistent() && !fast.generator.exact_logits() && !fast.trainer.exact_logits());
  EXPECT_FALSE(PrecisionRecipe::parse("fp8_e2e").generator.exact_logits());
  EXPECT_TRUE(has(error_of([] { PrecisionRecipe::parse("fp8_e2e:logits=fast"); }), "add consistent="));
  EXPECT_TRUE(has(error_of([] { PrecisionRecipe::parse("fp8_e2e:consistent=on+logits=no"); }), "exact or fast"));

  RunConfig c;
  config_apply_override(c, "precision.consistent=true");  // a boolean reads as on / off
  EXPECT_EQ(c.precision.consistent, "on");
  config_validate(c);
  const PrecisionRecipe r = config_precision_recipe(c.precision);
  EXPECT_TRUE(r.consistent());
  EXPECT_TRUE(r.trainer.consistent_linears && !r.trainer.consistent_flash);
  EXPECT_TRUE(has(r.name, "consistent"));
  // attn and flash, as bench rl-step's specs: the fast linears, so power-of-two scales are required.
  for (const char* mode : {"attn", "flash"}) {
    RunConfig m;
    config_apply_override(m, std::string("precision.consistent=") + mode);
    EXPECT_TRUE(has(error_of([&] { config_validate(m); }), "precision.pow2_scales=true")) << mode;
    config_apply_override(m, "precision.pow2_scales=true");
    config_validate(m);
    const PrecisionRecipe rm = config_precision_recipe(m.precision);
    const PrecisionRecipe spec = PrecisionRecipe::parse(std::string("fp8_e2e:pow2=on+consistent=") + mode);
    for (const auto& [e, es] : {std::pair{&rm.generator, &spec.generator}, std::pair{&rm.trainer, &spec.trainer}}) {
      EXPECT_TRUE(e->consistent && !e->consistent_linears && e->pow2_scales) << mode;
      EXPECT_EQ(e->consistent_flash, es->consistent_flash) << mode;
      EXPECT_EQ(e->kv_cache, es->kv_cache) << mode;
    }
    EXPECT_TRUE(has(rm.name, std::string("consistent=") + mode));
    config_apply_override(m, "precision.recipe=bf16");  // no FP8 products to agree
    EXPECT_TRUE(has(error_of([&] { config_validate(m); }), "fp8_e2e recipe")) << mode;
  }
  {
    RunConfig f;
    config_apply_override(f, "precision.consistent_logits=false");
    EXPECT_TRUE(has(error_of([&] { config_validate(f); }), "precision.consistent (on, attn or flash)"));
    config_apply_override(f, "precision.consistent=on");
    config_validate(f);
    const PrecisionRecipe rf = config_precision_recipe(f.precision);
    EXPECT_TRUE(rf.consistent() && !rf.generator.exact_logits() && !rf.trainer.exact_logits());
    EXPECT_TRUE(has(rf.name, "logits=fast"));
  }
  RunConfig off;
  config_apply_override(off, "precision.consistent=false");
  EXPECT_EQ(off.precision.consistent, "off");
  EXPECT_FALSE(config_precision_recipe(off.precision).consistent());
  EXPECT_TRUE(has(error_of([&] { config_apply_override(off, "precision.consistent=yes"); }), "off, on, attn, flash"));
  RunConfig bad = c;
  config_apply_override(bad, "precision.fp8_attention=true");
  EXPECT_TRUE(has(error_of([&] { config_validate(bad); }), "precision.fp8_attention=false"));
  bad = c;
  config_apply_override(bad, "precision.trainer_kv_rounding=off");
  EXPECT_TRUE(has(error_of([&] { config_validate(bad); }), "trainer_kv_rounding at auto"));
  // Models it does not serve are refused at construction, saying what to change.
  const ModelConfig moe = model_config_tiny("qwen3_moe", 64);
  EXPECT_TRUE(has(error_of([&] { model_check_consistent(moe, r.trainer); }), "precision.consistent off"));
  EXPECT_NO_THROW(model_check_consistent(model_config_tiny("qwen3", 64), r.trainer));
}

// Each forward op of the CPU reference computes a row independently of the batch (one double
// dot product per output in a fixed order; per-row norms and log-softmax): rows computed inside
// batches of other sizes (odd and even, other row tiles) are the same bits.
TEST(Consistent, CpuForwardOpsAreRowInvariant) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t M = 37, K = 300, N = 140;
  const Tensor x = test::random_tensor({M, K}, 3, DType::F32), w = test::random_tensor({N, K}, 4, DType::F32, 0.05);
  LinearWeight W;
  W.w = w;
  W.bias = test::random_tensor({N}, 5, DType::F32);
  auto rows_equal = [](const Tensor& full, const Tensor& part, int64_t r0) {
    const size_t row = full.nbytes() / static_cast<size_t>(full.dim(0));
    return std::memcmp(static_cast<const char*>(full.raw()) + r0 * row, part.raw(), part.nbytes()) == 0;
  };
  const std::vector<std::pair<int64_t, int64_t>> parts = {{0, 1}, {1, 1}, {36, 1}, {3, 10}, {4, 17}, {10, 27}};
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK}) {
    LinearSpec spec{mode, false};
    spec.consistent = true;
    Tensor full = be->alloc({M, N}, DType::F32);
    be->linear(x, W, spec, full);
    for (auto [r0, m] : parts) {
      Tensor part = be->alloc({m, N}, DType::F32);
      be->linear(x.slice_rows(r0, r0 + m), W, spec, part);
      EXPECT_TRUE(rows_equal(full, part, r0)) << linear_mode_name(mode) << " rows " << r0 << "+" << m;
    }
  }
  // token_logprobs over several vocabulary chunks, and rmsnorm.
  const int64_t V = 4500, D = 64;
  const Tensor h = test::random_tensor({M, D}, 6, DType::F32), head = test::random_tensor({V, D}, 7, DType::F32, 0.2);
  std::vector<int32_t> tg(M);
  for (int64_t i = 0; i < M; ++i) tg[i] = static_cast<int32_t>((i * 613) % V);
  const Tensor targets = test::i32_tensor(tg);
  LinearSpec fp32{LinearMode::FP32, false};
  fp32.consistent = true;
  Tensor logp = be->alloc({M}, DType::F32), lse = be->alloc({M}, DType::F32), ent = be->alloc({M}, DType::F32);
  be->token_logprobs(h, head, targets, 0.8f, fp32, logp, lse, &ent);
  Tensor normed = be->alloc({M, D}, DType::F32), wn = test::random_tensor({D}, 8, DType::F32);
  be->rmsnorm(h, wn, 1e-6f, normed, nullptr);
  for (auto [r0, m] : parts) {
    Tensor lp = be->alloc({m}, DType::F32), ls = be->alloc({m}, DType::F32), en = be->alloc({m}, DType::F32);
    be->token_logprobs(h.slice_rows(r0, r0 + m), head, targets.slice_rows(r0, r0 + m), 0.8f, fp32, lp, ls, &en);
    EXPECT_TRUE(rows_equal(logp, lp, r0) && rows_equal(lse, ls, r0) && rows_equal(ent, en, r0)) << r0 << "+" << m;
    Tensor nm = be->alloc({m, D}, DType::F32);
    be->rmsnorm(h.slice_rows(r0, r0 + m), wn, 1e-6f, nm, nullptr);
    EXPECT_TRUE(rows_equal(normed, nm, r0)) << "rmsnorm " << r0 << "+" << m;
  }
}

// The consistent generator's logp_gen without a second lm_head GEMM: logprobs_of_logits over the
// head's chunked logits (model_consistent_logits, what model_forward_paged writes and the
// sampler reads) is token_logprobs with the consistent spec, bit for bit, as the engine's
// model_sampled_logprobs is: F32 and BF16 hidden rows (the FP32 and the BF16 head), V = 9000
// (three vocabulary chunks, the last partial), temperatures 0.8 and 1, a batch and a row alone.
TEST(Consistent, LogprobsOfLogitsIsTokenLogprobsBitwise) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t R = 13, D = 96, V = 9000;
  ASSERT_GT(V, 2 * kConsistentVocabChunk);
  ASSERT_NE(V % kConsistentVocabChunk, 0);
  std::vector<int32_t> tg(R);
  for (int64_t i = 0; i < R; ++i) tg[i] = static_cast<int32_t>((i * 2311 + 17) % V);
  tg[0] = 0;
  tg[1] = static_cast<int32_t>(kConsistentVocabChunk);  // the first id of the second chunk
  tg[2] = static_cast<int32_t>(V - 1);
  const Tensor targets = test::i32_tensor(tg);
  auto same = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  for (DType act : {DType::F32, DType::BF16}) {
    const Tensor hidden = test::random_tensor({R, D}, 41, act), head = test::random_tensor({V, D}, 42, act, 0.2);
    Tensor logits = be->alloc({R, V}, DType::F32);
    model_consistent_logits(*be, hidden, head, logits);
    LinearSpec spec{act == DType::BF16 ? LinearMode::BF16 : LinearMode::FP32, false};
    spec.consistent = true;
    for (float temp : {0.8f, 1.0f}) {
      for (auto [r0, m] : {std::pair<int64_t, int64_t>{0, R}, {6, 1}}) {
        SCOPED_TRACE(std::string(dtype_name(act)) + " temperature " + std::to_string(temp) + " rows " +
                     std::to_string(r0) + "+" + std::to_string(m));
        const Tensor lg = logits.slice_rows(r0, r0 + m), tr = targets.slice_rows(r0, r0 + m);
        Tensor logp = be->alloc({m}, DType::F32), lse = be->alloc({m}, DType::F32);
        Tensor tl_logp = be->alloc({m}, DType::F32), tl_lse = be->alloc({m}, DType::F32);
        Tensor gen_logp = be->alloc({m}, DType::F32);
        be->logprobs_of_logits(lg, tr, temp, logp, lse);
        be->token_logprobs(hidden.slice_rows(r0, r0 + m), head, tr, temp, spec, tl_logp, tl_lse, nullptr);
        model_sampled_logprobs(*be, lg, tr, temp, gen_logp);
        EXPECT_TRUE(same(logp, tl_logp)) << "logp differs from token_logprobs'";
        EXPECT_TRUE(same(lse, tl_lse)) << "lse differs from token_logprobs'";
        EXPECT_TRUE(same(gen_logp, tl_logp)) << "model_sampled_logprobs differs from token_logprobs'";
        EXPECT_TRUE(std::isfinite(logp.data<float>()[0]) && logp.data<float>()[0] < 0.0f);
      }
    }
  }
  // A target outside the vocabulary is refused, naming the op (as token_logprobs refuses it).
  Tensor logits = be->alloc({1, V}, DType::F32), logp = be->alloc({1}, DType::F32), lse = be->alloc({1}, DType::F32);
  EXPECT_TRUE(has(
      error_of([&] { be->logprobs_of_logits(logits, test::i32_tensor({static_cast<int32_t>(V)}), 1.0f, logp, lse); }),
      "logprobs_of_logits: target 9000"));
  EXPECT_TRUE(has(error_of([&] { be->logprobs_of_logits(logits, test::i32_tensor({-1}), 1.0f, logp, lse); }),
                  "outside the vocabulary"));
}

struct RecipeCase {
  const char* recipe;
  const char* family;
};

class ConsistentRecipe : public testing::TestWithParam<RecipeCase> {};

// The generator's logp_gen and the trainer's logp_old of the same tokens on the same weights:
// the same bits, so token_mult_prob_error is exactly 1 and gen_kl exactly 0; the frozen
// reference scores the same bits too (no KL at equal weights), and the optimizer step's forward
// (logp_new) as well, so the first PPO ratio is exactly 1. The step's gradient stays the usual
// one (its norm within 2% of the non-consistent trainer's: the attention backward takes the
// paged attention's output and lse).
TEST_P(ConsistentRecipe, GeneratorAndTrainerAgreeBitForBit) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  ConsistentShape sh;
  sh.family = GetParam().family;
  const std::string spec = std::string(GetParam().recipe) + ":consistent=on";
  const ConsistentRun r = test::consistent_run(*be, sh, spec);
  ASSERT_EQ(r.sequences, 7u);
  ASSERT_GT(r.logp_gen.size(), 50u);
  EXPECT_GT(r.stats.prefix_shared_tokens, 0) << "prompt pages shared between samples";
  EXPECT_GT(r.stats.waves, 1) << "more samples than one batch holds";
  EXPECT_TRUE(test::same_bits(r.logp_old, r.logp_gen))
      << spec << ": max |logp_old - logp_gen| = " << test::max_abs_diff(r.logp_old, r.logp_gen);
  EXPECT_EQ(r.mismatch.token_mult_prob_error, 1.0);
  EXPECT_EQ(r.mismatch.gen_kl_error, 0.0);
  EXPECT_TRUE(test::same_bits(r.logp_ref, r.logp_old)) << "the frozen reference scores what the trainer scores";
  EXPECT_TRUE(test::same_bits(r.logp_new, r.logp_old)) << "the training forward scores what scoring scores";
  const ConsistentRun plain = test::consistent_run(*be, sh, GetParam().recipe);
  ASSERT_TRUE(std::isfinite(r.grad_norm) && std::isfinite(plain.grad_norm));
  EXPECT_LT(std::fabs(r.grad_norm - plain.grad_norm), 0.02 * plain.grad_norm)
      << "consistent " << r.grad_norm << " vs usual " << plain.grad_norm;
  // The same tokens were sampled: the consistent mode changes no logit of the generator on the
  // CPU (its linears and attention were already row-invariant; the logits are the same products).
  EXPECT_EQ(plain.logp_gen.size(), r.logp_gen.size());
  if (std::string(GetParam().recipe) == "bf16") {
    // Without it the BF16 recipe's trainer attends over F32 k/v where the generator's cache held
    // BF16: the engines differ (the check above can fail).
    EXPECT_GT(plain.mismatch.token_mult_prob_error, 1.0);
    EXPECT_FALSE(test::same_bits(plain.logp_old, plain.logp_gen));
  }
}

// consistent=flash on the CPU (whose attention_paged and attention already agree row for row):
// the trainer on its usual attention with the KV rounding, the generator's paged batches flagged
// flash_order; the two engines agree bit for bit, and with the BF16 cache the trainer's k and v
// are the cache's (trainer.kv_cache follows the generator's).
TEST(Consistent, FlashOrderAgreesBitForBitOnTheCpu) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  ConsistentShape sh;
  for (const char* spec : {"fp8_e2e:consistent=flash", "bf16:consistent=flash"}) {
    const ConsistentRun r = test::consistent_run(*be, sh, spec);
    ASSERT_GT(r.logp_gen.size(), 50u);
    EXPECT_TRUE(test::same_bits(r.logp_old, r.logp_gen))
        << spec << ": max |logp_old - logp_gen| = " << test::max_abs_diff(r.logp_old, r.logp_gen);
    EXPECT_EQ(r.mismatch.token_mult_prob_error, 1.0) << spec;
    EXPECT_TRUE(test::same_bits(r.logp_new, r.logp_old)) << spec;
  }
}

// logits=fast: the consistent mode with each engine's own head (the generator's sampler reduction
// over its logits, the trainer's usual token_logprobs chunks). The engines still agree up to the
// final hidden state, so the log-probs differ only by the head's own summation orders: far below
// any quantizer's step, and the same tokens are sampled as with the exact head.
TEST(Consistent, FastLogitsDifferOnlyByTheHeadsRounding) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  ConsistentShape sh;
  const ConsistentRun exact = test::consistent_run(*be, sh, "fp8_e2e:consistent=on");
  const ConsistentRun fast = test::consistent_run(*be, sh, "fp8_e2e:consistent=on+logits=fast");
  ASSERT_GT(fast.logp_gen.size(), 50u);
  ASSERT_EQ(fast.logp_gen.size(), exact.logp_gen.size());
  EXPECT_LT(test::max_abs_diff(fast.logp_old, fast.logp_gen), 1e-4);
  EXPECT_LT(std::fabs(fast.mismatch.token_mult_prob_error - 1.0), 1e-5);
  EXPECT_LT(test::max_abs_diff(fast.logp_old, exact.logp_old), 1e-4) << "the trainer's head, exact vs fast";
}

INSTANTIATE_TEST_SUITE_P(Recipes, ConsistentRecipe,
                         testing::Values(RecipeCase{"bf16", "qwen3"}, RecipeCase{"fp8_e2e", "qwen3"},
                                         RecipeCase{"fp8_e2e", "qwen2"}, RecipeCase{"fp32", "llama"}),
                         [](const testing::TestParamInfo<RecipeCase>& i) {
                           return std::string(i.param.recipe) + "_" + i.param.family;
                         });

}  // namespace
}  // namespace fp8rl
