// The trainer's E4M3 KV rounding (trainer kv_cache e4m3): Backend::kv_round is the value an E4M3
// cache hands the attention, and a trainer that rounds k/v with the rollout's scales scores the
// generator's tokens with the generator's own log-probs on the exact (FP32) path, while one that
// does not differs by the KV quantization error.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "quant/quant.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

TEST(KvRounding, OpIsTheCacheRoundTrip) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t T = 5, H = 3, hd = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  Tensor host = Tensor::empty({T, H, hd}, DType::F32);
  for (int64_t i = 0; i < host.numel(); ++i) host.data<float>()[i] = nd(rng) * (i % 7 == 0 ? 40.0f : 1.0f);
  const std::vector<float> scales = {0.01f, 0.05f, 1.0f / 3.0f};
  Tensor x = be->to_device(host);
  be->kv_round(x, scales);
  const Tensor out = be->to_host(x);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < hd; ++c) {
        const int64_t i = (t * H + h) * hd + c;
        const float s = scales[static_cast<size_t>(h)];
        const float want = e4m3_to_float(e4m3_from_float(host.data<float>()[i] / s)) * s;
        ASSERT_EQ(out.data<float>()[i], want) << "element " << i;
      }
  EXPECT_THROW(be->kv_round(x, {1.0f, 1.0f}), Error);          // one scale per head
  EXPECT_THROW(be->kv_round(x, {1.0f, 0.0f, 1.0f}), Error);    // scales > 0
}

// FP32 linears in both engines, an E4M3 KV cache with calibrated scales: with rounding the
// trainer's scoring equals the generator's log-probs to float reordering; without, it does not.
TEST(KvRounding, TrainerScoresWhatTheE4m3GeneratorSampled) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const ModelConfig c = model_config_tiny("qwen3", /*vocab=*/64, /*hidden=*/64, /*layers=*/2, /*heads=*/4,
                                          /*kv_heads=*/2, /*intermediate=*/128);
  RandomInit init;
  init.seed = 21;
  init.std = 0.15f;
  const ModelWeights host = model_weights_random(c, init, DType::F32);
  PrecisionRecipe recipe = PrecisionRecipe::parse("fp32:kv=e4m3+tkv=e4m3");
  Trainer rounding(*be, model_weights_to_device(*be, host, DType::F32), recipe.trainer, TrainerOptions{});
  EnginePrecision plain_prec = recipe.trainer;
  plain_prec.kv_cache = DType::BF16;  // the trainer does not round
  Trainer plain(*be, model_weights_to_device(*be, host, DType::F32), plain_prec, TrainerOptions{});
  RolloutEngine engine(*be, rounding.master(), recipe.generator, /*kv_pages=*/32, /*page_size=*/16, /*max_batch=*/8);

  const std::vector<RolloutRequest> reqs = {{{1, 5, 9, 2, 7}, 3}, {{4, 4, 8}, 2}};
  std::vector<TrainSequence> calib;
  for (const RolloutRequest& r : reqs) calib.push_back({r.prompt, static_cast<int>(r.prompt.size())});
  // Scales from the trainer's amax of the prompts (as the loop calibrates), installed by refit.
  const ScoreResult cs = rounding.score(calib, 1.0f, false, /*record_amax=*/true);
  const KvScales scales = kv_scales_calibrate(cs.k_amax, cs.v_amax);
  engine.refit(rounding.master(), &scales);

  SamplingParams sp;
  sp.max_new_tokens = 12;
  sp.seed = 5;
  const std::vector<RolloutSample> samples = engine.generate(reqs, sp);
  std::vector<TrainSequence> seqs;
  std::vector<float> logp_gen;
  for (const RolloutSample& s : samples) {
    TrainSequence ts{reqs[s.request].prompt, static_cast<int>(reqs[s.request].prompt.size())};
    ts.ids.insert(ts.ids.end(), s.tokens.begin(), s.tokens.end());
    seqs.push_back(ts);
    logp_gen.insert(logp_gen.end(), s.logp.begin(), s.logp.end());
  }
  const KvScales used = engine.kv_scales();
  rounding.set_kv_rounding(used.k, used.v);
  plain.set_kv_rounding(used.k, used.v);  // ignored: its recipe does not round
  EXPECT_TRUE(rounding.kv_rounding());
  EXPECT_FALSE(plain.kv_rounding());
  const std::vector<float> a = rounding.score(seqs, 1.0f, false, false).logp;
  const std::vector<float> b = plain.score(seqs, 1.0f, false, false).logp;
  ASSERT_EQ(a.size(), logp_gen.size());
  ASSERT_EQ(b.size(), logp_gen.size());
  double max_rounded = 0, mean_plain = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_rounded = std::max(max_rounded, std::fabs(static_cast<double>(a[i]) - logp_gen[i]));
    mean_plain += std::fabs(static_cast<double>(b[i]) - logp_gen[i]);
  }
  mean_plain /= static_cast<double>(b.size());
  EXPECT_LT(max_rounded, 2e-5) << "the rounding trainer must score the generator's own log-probs";
  EXPECT_GT(mean_plain, 20 * std::max(max_rounded, 1e-7)) << "without rounding the KV quantization shows";

  // A frozen KL reference of the same weights, rounding with the same scales, scores bit for bit
  // what the rounding trainer scores (so the rounding adds no KL at equal weights).
  TrainerOptions frozen_opt;
  frozen_opt.frozen = true;
  Trainer reference(*be, model_weights_to_device(*be, host, DType::F32), recipe.trainer, frozen_opt);
  reference.set_kv_rounding(used.k, used.v);
  EXPECT_TRUE(reference.kv_rounding());
  EXPECT_EQ(reference.score(seqs, 1.0f, false, false).logp, a);
}

}  // namespace
}  // namespace fp8rl
