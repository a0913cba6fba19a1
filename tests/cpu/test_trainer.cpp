// The trainer's FP8 weight cache (train/trainer.h): a step with the cache is bitwise the step
// without it (the ops quantizing the FP32 master in every call), the cache is requantized once
// per optimizer step (not per micro-batch or op), and writes through master() are seen.
#include <gtest/gtest.h>

#include <map>

#include <algorithm>
#include <cmath>

#include "test_model_util.h"
#include "train/grpo_update.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

constexpr auto nll = test::mean_nll;

std::vector<TrainSequence> sequences(int vocab) {
  std::vector<TrainSequence> out;
  for (const auto& ids : test::token_sequences({9, 7, 11, 6}, vocab, 5)) out.push_back({ids, 3});
  return out;
}

// A tiny Qwen3-MoE config (4 experts, top-2) of `layers` blocks.
ModelConfig tiny_moe_config(int layers) {
  ModelConfig c = model_config_tiny("qwen3_moe", 48, 64, layers, 4, 2, 96);
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 40;
  c.validate();
  return c;
}

ModelWeights tiny_moe(int layers, uint32_t seed) {
  RandomInit init;
  init.seed = seed;
  init.std = 0.15f;
  return model_weights_random(tiny_moe_config(layers), init, DType::F32);
}

std::map<std::string, std::vector<float>> params(Backend& be, const Trainer& t) {
  std::map<std::string, std::vector<float>> out;
  model_for_each_parameter(t.master(), [&](const std::string& n, const Tensor& x) {
    out[n] = to_float_vector(be.to_host(x));
  });
  return out;
}

Trainer make_trainer(Backend& be, const EnginePrecision& prec, bool cache) {
  TrainerOptions opt;
  opt.micro_batch_tokens = 20;  // 2 micro-batches of the 4 sequences
  opt.cache_fp8_weights = cache;
  return Trainer(be, model_weights_to_device(be, test::tiny_model("qwen2", DType::F32, 71), DType::F32), prec, opt);
}

EnginePrecision fp8(bool pow2, int bf16_first) {
  EnginePrecision p;
  p.linear = LinearMode::FP8_BLOCK;
  p.pow2_scales = pow2;
  p.bf16_first_layers = bf16_first;
  return p;
}

TEST(TrainerFp8Cache, StepsAreBitwiseThoseWithoutTheCache) {
  auto be = make_cpu_backend();
  const auto seqs = sequences(48);
  for (const EnginePrecision& prec : {fp8(true, 0), fp8(false, 1)}) {
    SCOPED_TRACE(prec.pow2_scales ? "pow2, all blocks FP8" : "no pow2, first block BF16");
    Trainer cached = make_trainer(*be, prec, true), plain = make_trainer(*be, prec, false);
    for (int s = 1; s <= 3; ++s) {
      const StepResult a = cached.step(seqs, 1.0f, nll, 2e-2f), b = plain.step(seqs, 1.0f, nll, 2e-2f);
      ASSERT_TRUE(a.applied && b.applied);
      EXPECT_EQ(a.loss, b.loss) << "step " << s;
      EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << s;
      EXPECT_TRUE(params(*be, cached) == params(*be, plain)) << "step " << s << ": the weights differ";
      // Once per optimizer step (both micro-batches' forward and dgrad read it), none without the cache.
      EXPECT_EQ(cached.weight_cache_refreshes(), s);
      EXPECT_EQ(plain.weight_cache_refreshes(), 0);
    }
    // The cache after the last optimizer step is fresh: scoring equals the uncached scoring.
    const ScoreResult a = cached.score(seqs, 1.0f, true, false), b = plain.score(seqs, 1.0f, true, false);
    EXPECT_EQ(a.logp, b.logp);
    EXPECT_EQ(a.entropy, b.entropy);
    EXPECT_EQ(cached.weight_cache_refreshes(), 4);
    cached.score(seqs, 1.0f, false, false);  // nothing changed: no requantization
    EXPECT_EQ(cached.weight_cache_refreshes(), 4);
    // And the weights are really quantized: the FP32 trainer scores differently.
    Trainer fp32 = make_trainer(*be, EnginePrecision{LinearMode::FP32}, true);
    EXPECT_NE(fp32.score(seqs, 1.0f, false, false).logp,
              make_trainer(*be, prec, true).score(seqs, 1.0f, false, false).logp);
  }
}

std::map<std::string, std::vector<float>> gradients(Backend& be, const Trainer& t) {
  std::map<std::string, std::vector<float>> out;
  model_for_each_parameter(t.gradients(), [&](const std::string& n, const Tensor& x) {
    out[n] = to_float_vector(be.to_host(x));
  });
  return out;
}

// Without the dgrad's W^T copies (TrainerOptions::dgrad_weight_cache false, train.dgrad_weight_cache
// off) the dgrad transposes wq per call: the same gradients and weights bit for bit, and no wqt
// held. Dense and mixture-of-experts (the grouped expert dgrad) models.
TEST(TrainerFp8Cache, DgradWithoutTheWtCacheIsBitwiseTheSame) {
  auto be = make_cpu_backend();
  const auto seqs = sequences(48);
  const ModelWeights moe = tiny_moe(2, 17);
  const ModelWeights dense = test::tiny_model("qwen2", DType::F32, 71);
  for (const ModelWeights* host : {&dense, &moe}) {
    for (const EnginePrecision& prec : {fp8(true, 0), fp8(false, 1)}) {
      SCOPED_TRACE(host->config.model_type + (prec.pow2_scales ? ", pow2, all blocks FP8" : ", first block BF16"));
      TrainerOptions opt;
      opt.micro_batch_tokens = 20;
      Trainer cached(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
      opt.dgrad_weight_cache = false;
      Trainer plain(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
      for (int s = 1; s <= 2; ++s) {
        const StepResult a = cached.step(seqs, 1.0f, nll, 2e-2f), b = plain.step(seqs, 1.0f, nll, 2e-2f);
        ASSERT_TRUE(a.applied && b.applied);
        EXPECT_EQ(a.loss, b.loss) << "step " << s;
        EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << s;
        EXPECT_TRUE(gradients(*be, cached) == gradients(*be, plain)) << "step " << s << ": the gradients differ";
        EXPECT_TRUE(params(*be, cached) == params(*be, plain)) << "step " << s << ": the weights differ";
        EXPECT_EQ(plain.weight_cache_refreshes(), cached.weight_cache_refreshes());  // wq is still cached
      }
      EXPECT_GT(cached.dgrad_weight_cache_bytes(), 0);
      EXPECT_EQ(plain.dgrad_weight_cache_bytes(), 0);
      EXPECT_EQ(cached.score(seqs, 1.0f, true, false).logp, plain.score(seqs, 1.0f, true, false).logp);
    }
  }
}

TEST(TrainerFp8Cache, WritesThroughMasterAreSeen) {
  auto be = make_cpu_backend();
  const auto seqs = sequences(48);
  Trainer cached = make_trainer(*be, fp8(true, 0), true), plain = make_trainer(*be, fp8(true, 0), false);
  ASSERT_TRUE(cached.step(seqs, 1.0f, nll, 2e-2f).applied);
  ASSERT_TRUE(plain.step(seqs, 1.0f, nll, 2e-2f).applied);
  const std::vector<float> before = cached.score(seqs, 1.0f, false, false).logp;
  // In place, and by replacing the tensor.
  be->scale(cached.master().layers[1].up.w, 1.5f);
  be->scale(plain.master().layers[1].up.w, 1.5f);
  Tensor q = be->to_device(be->to_host(cached.master().layers[0].q.w));
  be->scale(q, -0.5f);
  cached.master().layers[0].q.w = q;
  plain.master().layers[0].q.w = be->to_device(be->to_host(q));
  const std::vector<float> after = cached.score(seqs, 1.0f, false, false).logp;
  EXPECT_NE(after, before);
  EXPECT_EQ(after, plain.score(seqs, 1.0f, false, false).logp);
  const StepResult a = cached.step(seqs, 1.0f, nll, 2e-2f), b = plain.step(seqs, 1.0f, nll, 2e-2f);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_TRUE(params(*be, cached) == params(*be, plain));
}

// Micro-batches padded to a multiple of 16 tokens (TrainerOptions::pad_tokens_to, what CUDA's
// row_granule() asks for) score and train exactly as unpadded ones: the padding rows repeat real
// rows and get no gradient. Lengths 9 + 7 + 11 | 6 at 32 tokens per micro-batch: padded to 32
// (one padding sequence of 5) and 16 (two: 6 + 4, the first sequence is shorter than the pad).
// Dense and MoE, FP8 (BF16 wgrad, the recipes' default) and FP32 linears; the q/k/v amax the KV
// calibration reads too. With the FP8 wgrad the padding rows enter its 128-token blocks (they
// can raise the last block's scale): the forward stays exact, the gradients close.
TEST(TrainerPadding, PaddedMicroBatchesAreTheUnpaddedOnes) {
  auto be = make_cpu_backend();
  const auto seqs = sequences(48);
  const ModelWeights moe = tiny_moe(2, 23);
  const ModelWeights dense = test::tiny_model("qwen2", DType::F32, 71);
  for (const ModelWeights* host : {&dense, &moe})
    for (EnginePrecision prec : {fp8(false, 0), EnginePrecision{LinearMode::FP32}}) {
      if (prec.linear == LinearMode::FP8_BLOCK) prec.wgrad = LinearMode::BF16;
      SCOPED_TRACE(host->config.model_type + (prec.linear == LinearMode::FP8_BLOCK ? ", FP8" : ", FP32"));
      TrainerOptions opt;
      opt.micro_batch_tokens = 32;
      opt.pad_tokens_to = 1;
      Trainer plain(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
      opt.pad_tokens_to = 16;
      Trainer padded(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
      const ScoreResult sa = padded.score(seqs, 1.0f, true, true), sb = plain.score(seqs, 1.0f, true, true);
      EXPECT_EQ(sa.logp, sb.logp);
      EXPECT_EQ(sa.entropy, sb.entropy);
      EXPECT_EQ(sa.q_amax, sb.q_amax);
      EXPECT_EQ(sa.k_amax, sb.k_amax);
      EXPECT_EQ(sa.v_amax, sb.v_amax);
      for (int s = 1; s <= 2; ++s) {
        const StepResult a = padded.step(seqs, 1.0f, nll, 2e-2f), b = plain.step(seqs, 1.0f, nll, 2e-2f);
        ASSERT_TRUE(a.applied && b.applied);
        EXPECT_EQ(a.loss, b.loss) << "step " << s;
        EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << s;
        EXPECT_TRUE(gradients(*be, padded) == gradients(*be, plain)) << "step " << s << ": the gradients differ";
        EXPECT_TRUE(params(*be, padded) == params(*be, plain)) << "step " << s << ": the weights differ";
      }
      // The padding ran: per score(), 5 rows after 9 + 7 + 11 and 10 after 6; per step() the same.
      EXPECT_EQ(plain.padding_tokens(), 0);
      EXPECT_EQ(padded.padding_tokens(), 3 * 15);
      // A padded micro-batch stays within micro_batch_tokens: at 20 the padded trainer packs
      // 9 + 7 (16) | 11 (-> 16) | 6 (-> 16), where 11 + 6 = 17 would pad to 32; the plain one
      // 16 | 17. Scoring is row by row, so the log-probs stay the same.
      opt.micro_batch_tokens = 20;
      Trainer padded20(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
      opt.pad_tokens_to = 1;
      Trainer plain20(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
      EXPECT_EQ(padded20.score(seqs, 1.0f, false, false).logp, plain20.score(seqs, 1.0f, false, false).logp);
      EXPECT_EQ(padded20.padding_tokens(), 5 + 10);  // 16 -> 16, 11 -> 16, 6 -> 16
      if (prec.linear != LinearMode::FP8_BLOCK) continue;
      // The FP8 wgrad: the same loss (the forward), gradients within the quantizer's step.
      EnginePrecision fw = prec;
      fw.wgrad = LinearMode::FP8_BLOCK;
      opt.micro_batch_tokens = 32;
      Trainer plain_fw(*be, model_weights_to_device(*be, *host, DType::F32), fw, opt);
      opt.pad_tokens_to = 16;
      Trainer padded_fw(*be, model_weights_to_device(*be, *host, DType::F32), fw, opt);
      const StepResult a = padded_fw.step(seqs, 1.0f, nll, 2e-2f), b = plain_fw.step(seqs, 1.0f, nll, 2e-2f);
      EXPECT_EQ(a.loss, b.loss);
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 0.02 * b.grad_norm);
    }
}

// Under MoE routing replay the padding rows take the routing of the rows they copy, so they stay
// copies in every block: the q/k/v amax (the KV calibration) and the loss are the unpadded ones.
// Records that differ from the router's own choice, 3 blocks, several seeds.
TEST(TrainerPadding, ReplayedRoutingPaddingRowsCopyTheirRows) {
  auto be = make_cpu_backend();
  const int64_t Lm = model_num_moe_layers(tiny_moe_config(3));
  for (uint32_t seed : {23u, 24u, 25u, 26u}) {
    SCOPED_TRACE(seed);
    const ModelWeights host = tiny_moe(3, seed);
    std::vector<TrainSequence> seqs;
    for (const auto& ids : test::token_sequences({9, 7, 11, 6}, 48, 5 + seed)) {
      TrainSequence s{ids, 3};
      for (size_t p = 0; p < ids.size(); ++p)
        for (int64_t m = 0; m < Lm; ++m) {
          s.routing.push_back(static_cast<int16_t>((p + m + seed + 1) % 4));
          s.routing.push_back(static_cast<int16_t>((p + m + seed + 3) % 4));
        }
      seqs.push_back(s);
    }
    TrainerOptions opt;
    opt.micro_batch_tokens = 32;
    opt.routing_replay = true;
    opt.pad_tokens_to = 1;
    Trainer plain(*be, model_weights_to_device(*be, host, DType::F32), EnginePrecision{LinearMode::FP32}, opt);
    opt.pad_tokens_to = 16;
    Trainer padded(*be, model_weights_to_device(*be, host, DType::F32), EnginePrecision{LinearMode::FP32}, opt);
    const ScoreResult sa = padded.score(seqs, 1.0f, false, true), sb = plain.score(seqs, 1.0f, false, true);
    EXPECT_EQ(sa.logp, sb.logp);
    EXPECT_EQ(sa.q_amax, sb.q_amax);
    EXPECT_EQ(sa.k_amax, sb.k_amax);
    EXPECT_EQ(sa.v_amax, sb.v_amax);
    EXPECT_GT(padded.padding_tokens(), 0);
    const StepResult a = padded.step(seqs, 1.0f, nll, 2e-2f), b = plain.step(seqs, 1.0f, nll, 2e-2f);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
  }
}

// A lone sequence under a micro_batch_tokens that is not a multiple of the granule is not padded
// past it (the memory plan's bound): 17 tokens at 20 stay 17, and a micro-batch of 5 pads to 16.
TEST(TrainerPadding, NeverPastMicroBatchTokens) {
  auto be = make_cpu_backend();
  std::vector<TrainSequence> seqs;
  for (const auto& ids : test::token_sequences({17, 5}, 48, 3)) seqs.push_back({ids, 3});
  TrainerOptions opt;
  opt.micro_batch_tokens = 20;
  opt.pad_tokens_to = 16;
  Trainer t(*be, model_weights_to_device(*be, test::tiny_model("qwen2", DType::F32, 71), DType::F32),
            EnginePrecision{LinearMode::FP32}, opt);
  t.score(seqs, 1.0f, false, false);
  EXPECT_EQ(t.padding_tokens(), 11);  // 17 alone (32 > 20: unpadded) | 5 -> 16
}

// train.old_logprobs auto: the first mini-batch's logp_old comes from its own optimizer step's
// forward instead of a scoring pass. That forward runs on the rollout's weights, so the update is
// the scored update bit for bit (loss, statistics, every weight after each optimizer step), and
// the scores it hands back (logp, entropy, q/k/v amax) are score()'s for those sequences — dense
// and MoE, FP32 and FP8 linears, one optimizer step per rollout (no scoring pass at all) and two
// (the second mini-batch scored first).
TEST(OldLogprobsFromForward, IsTheScoredUpdateBitwise) {
  auto be = make_cpu_backend();
  std::vector<TrainSequence> seqs;
  for (const auto& ids : test::token_sequences({9, 7, 11, 6, 8, 10}, 48, 17)) seqs.push_back({ids, 3});
  const ModelWeights moe = tiny_moe(2, 29);
  const ModelWeights dense = test::tiny_model("qwen2", DType::F32, 73);
  GrpoLossOptions lopt;
  lopt.is_mode = IsMode::TIS;
  for (const ModelWeights* host : {&dense, &moe})
    for (const EnginePrecision& prec : {fp8(false, 0), EnginePrecision{LinearMode::FP32}})
      for (int mini_batches : {1, 2}) {
        SCOPED_TRACE(host->config.model_type + (prec.linear == LinearMode::FP8_BLOCK ? ", FP8" : ", FP32") + ", " +
                     std::to_string(mini_batches) + " mini-batch(es)");
        TrainerOptions opt;
        opt.micro_batch_tokens = 20;  // several micro-batches per mini-batch
        Trainer scored(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
        Trainer own(*be, model_weights_to_device(*be, *host, DType::F32), prec, opt);
        GrpoRollout ro;
        ro.seqs = seqs;
        ro.offsets = {0};
        for (const TrainSequence& t : seqs) ro.offsets.push_back(ro.offsets.back() + t.response_len());
        ro.advantages = {1.0f, -0.5f, 0.25f, -1.0f, 0.75f, -0.25f};
        const ScoreResult all = scored.score(seqs, 1.0f, /*entropy=*/true, /*record_amax=*/true);
        ro.logp_gen = all.logp;
        for (size_t i = 0; i < ro.logp_gen.size(); ++i) ro.logp_gen[i] += 0.05f * static_cast<float>(i % 5) - 0.1f;
        GrpoRollout ro_scored = ro, ro_own = ro;
        ro_scored.logp_old = all.logp;
        const size_t from = grpo_mini_batch_range(GrpoShard{}, seqs.size(), mini_batches, 0).second;
        ro_own.logp_old.assign(static_cast<size_t>(ro.offsets[from]), std::nanf(""));  // must not be read
        const std::vector<TrainSequence> rest(seqs.begin() + static_cast<std::ptrdiff_t>(from), seqs.end());
        if (!rest.empty()) {
          const std::vector<float> lp = own.score(rest, 1.0f, false, false).logp;
          ro_own.logp_old.insert(ro_own.logp_old.end(), lp.begin(), lp.end());
        }
        ro_own.first_logp_old_from_forward = true;
        ro_own.first_score = ScoreRequest{true, true};
        std::vector<std::map<std::string, std::vector<float>>> wa, wb;
        const GrpoUpdateResult a = grpo_update(
            scored, ro_scored, lopt, mini_batches, 1.0f, [](int64_t) { return 2e-2; },
            [&](const StepResult& r) {
              wa.push_back(params(*be, scored));
              return r.applied;
            });
        const GrpoUpdateResult b = grpo_update(
            own, ro_own, lopt, mini_batches, 1.0f, [](int64_t) { return 2e-2; },
            [&](const StepResult& r) {
              wb.push_back(params(*be, own));
              return r.applied;
            });
        ASSERT_EQ(a.applied, mini_batches);
        ASSERT_EQ(b.applied, mini_batches);
        EXPECT_EQ(a.loss, b.loss);
        EXPECT_EQ(a.grad_norm, b.grad_norm);
        EXPECT_EQ(a.stats.clipped, b.stats.clipped);
        EXPECT_EQ(a.stats.truncated, b.stats.truncated);
        EXPECT_EQ(a.stats.is_weight_sum, b.stats.is_weight_sum);
        ASSERT_EQ(wa.size(), wb.size());
        for (size_t i = 0; i < wa.size(); ++i) EXPECT_TRUE(wa[i] == wb[i]) << "the weights after optimizer step " << i;
        // The first mini-batch's scores from its forward: score()'s (before any update).
        ASSERT_TRUE(b.first_scored_complete);
        const int64_t n0 = ro.offsets[from];
        ASSERT_EQ(b.first_scored.logp.size(), static_cast<size_t>(n0));
        EXPECT_TRUE(std::equal(b.first_scored.logp.begin(), b.first_scored.logp.end(), all.logp.begin()));
        EXPECT_TRUE(std::equal(b.first_scored.entropy.begin(), b.first_scored.entropy.end(), all.entropy.begin()));
        EXPECT_FALSE(b.first_scored.k_amax.empty());
        if (from == seqs.size()) {  // one mini-batch: the same micro-batches as score()'s
          EXPECT_EQ(b.first_scored.q_amax, all.q_amax);
          EXPECT_EQ(b.first_scored.k_amax, all.k_amax);
          EXPECT_EQ(b.first_scored.v_amax, all.v_amax);
        }
      }
}

// A first optimizer step that meets a non-finite value (here a NaN weight: the loss refuses the
// NaN log-probs) is skipped, and its scores are reported incomplete, so the loop neither logs
// their metrics nor calibrates KV scales from them.
TEST(OldLogprobsFromForward, ASkippedFirstStepReportsItsScoresIncomplete) {
  auto be = make_cpu_backend();
  std::vector<TrainSequence> seqs;
  for (const auto& ids : test::token_sequences({9, 7, 11, 6}, 48, 19)) seqs.push_back({ids, 3});
  ModelWeights host = test::tiny_model("qwen2", DType::F32, 75);
  host.layers[0].o.w.data<float>()[5] = std::nanf("");
  TrainerOptions opt;
  opt.micro_batch_tokens = 4096;  // one micro-batch: every score is written before the loss refuses them
  Trainer t(*be, model_weights_to_device(*be, host, DType::F32), EnginePrecision{LinearMode::FP32}, opt);
  GrpoRollout ro;
  ro.seqs = seqs;
  ro.offsets = {0};
  for (const TrainSequence& s : seqs) ro.offsets.push_back(ro.offsets.back() + s.response_len());
  ro.advantages = {1.0f, -1.0f, 0.5f, -0.5f};
  ro.logp_gen.assign(static_cast<size_t>(ro.tokens()), -1.0f);
  ro.first_logp_old_from_forward = true;
  ro.first_score = ScoreRequest{true, true};
  const GrpoUpdateResult up = grpo_update(t, ro, GrpoLossOptions{}, 1, 1.0f, [](int64_t) { return 1e-2; },
                                          [](const StepResult& r) { return r.applied; });
  EXPECT_EQ(up.applied, 0);
  EXPECT_EQ(up.first_scored.logp.size(), static_cast<size_t>(ro.tokens()));  // all written, NaN among them
  EXPECT_FALSE(up.first_scored_complete);
}

}  // namespace
}  // namespace fp8rl
