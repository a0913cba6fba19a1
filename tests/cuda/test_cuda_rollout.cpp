// The rollout engine on the GPU: decode steps replayed from CUDA graphs give the samples that
// direct forwards give (same seeds), for the BF16 and the FP8 generator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/weights.h"
#include "model/shapes.h"
#include "rollout/rollout.h"

namespace fp8rl {
namespace {

TEST(CudaRollout, GraphReplaysGiveTheDirectSamples) {
  auto be = make_cuda_backend(0);
  ModelConfig mc = model_config_tiny("qwen3", 512, /*hidden=*/256, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2,
                                     /*intermediate=*/512);
  RandomInit init;
  init.seed = 5;
  init.std = 0.15f;
  const ModelWeights master = model_weights_to_device(*be, model_weights_random(mc, init, DType::F32), DType::F32);
  // bf16: prompts of several lengths, samples that stop early: the batch shrinks through the
  // buckets. fp8_e2e: 16 sequences that never stop, so the direct forwards also have 16 rows
  // and take cuBLASLt's FP8 GEMMs as the replays do (with fewer rows, or rows not a multiple of
  // 16, the direct path takes the exact dequantized GEMM instead: different numerics).
  for (const char* recipe : {"bf16", "fp8_e2e"}) {
    const bool fp8 = std::string(recipe) == "fp8_e2e";
    std::vector<RolloutRequest> reqs;
    for (int i = 0; i < (fp8 ? 4 : 7); ++i) {
      RolloutRequest r;
      for (int j = 0; j < 5 + 3 * i; ++j) r.prompt.push_back((i * 37 + j * 11) % 500 + 1);
      r.n = fp8 ? 4 : 1 + i % 3;
      reqs.push_back(r);
    }
    SamplingParams sp;
    sp.temperature = 1.0f;
    sp.max_new_tokens = 40;
    sp.seed = 99;
    if (!fp8) sp.stop_ids = {7, 8, 9, 10, 11};
    const EnginePrecision prec = PrecisionRecipe::preset(recipe).generator;
    SchedulerOptions with, without;
    without.cuda_graphs = false;
    RolloutEngine a(*be, master, prec, 64, 16, 256, with), b(*be, master, prec, 64, 16, 256, without);
    const auto ga = a.generate(reqs, sp);
    const auto gb = b.generate(reqs, sp);
    if (a.last_stats().graph_steps == 0) GTEST_SKIP() << "no CUDA graphs in this build (FP8RL_CUDA_GRAPHS=0?)";
    EXPECT_GT(a.last_stats().graph_steps, 20) << recipe;  // every decode step after the prefill
    EXPECT_EQ(b.last_stats().graph_steps, 0) << recipe;
    ASSERT_EQ(ga.size(), gb.size());
    // Padding changes the GEMMs' row count, which may change BF16 roundings: allow rare flips
    // of a sampled token, but the shared prefix must agree closely in log-probability.
    int identical = 0;
    double worst = 0.0;
    for (size_t i = 0; i < ga.size(); ++i) {
      identical += ga[i].tokens == gb[i].tokens;
      for (size_t t = 0; t < std::min(ga[i].tokens.size(), gb[i].tokens.size()); ++t) {
        if (ga[i].tokens[t] != gb[i].tokens[t]) break;
        worst = std::max(worst, std::fabs(static_cast<double>(ga[i].logp[t]) - gb[i].logp[t]));
      }
    }
    EXPECT_GE(identical, static_cast<int>(ga.size()) - 2) << recipe;
    EXPECT_LT(worst, 2e-2) << recipe;
    std::printf("  rollout graphs %s: %d graph steps of %d forwards, %d/%zu samples identical, max |dlogp| %.2e\n",
                recipe, a.last_stats().graph_steps, a.last_stats().decode_steps, identical, ga.size(), worst);
  }
}

// A mixture-of-experts model (tiny-moe: a dense block, then two of 8 experts top-2) decodes from
// CUDA graphs too: its blocks sort their experts' rows on the device (moe_plan) and keep the
// routing record there. The replays give the direct forwards' samples and routing record (the
// direct path plans on the device as well; padding only changes the GEMMs' row counts).
TEST(CudaRollout, MoeGraphReplaysGiveTheDirectSamplesAndRouting) {
  auto be = make_cuda_backend(0);
  const ModelConfig mc = model_shape("tiny-moe");
  RandomInit init;
  init.seed = 6;
  init.std = 0.15f;
  const ModelWeights master = model_weights_to_device(*be, model_weights_random(mc, init, DType::F32), DType::F32);
  for (const char* recipe : {"bf16", "fp8_e2e"}) {
    std::vector<RolloutRequest> reqs;
    for (int i = 0; i < 4; ++i) {
      RolloutRequest r;
      for (int j = 0; j < 5 + 3 * i; ++j) r.prompt.push_back((i * 37 + j * 11) % 500 + 1);
      r.n = 4;
      reqs.push_back(r);
    }
    SamplingParams sp;
    sp.temperature = 1.0f;
    sp.max_new_tokens = 40;
    sp.seed = 17;
    sp.record_routing = true;
    const EnginePrecision prec = PrecisionRecipe::preset(recipe).generator;
    SchedulerOptions with, without;
    without.cuda_graphs = false;
    RolloutEngine a(*be, master, prec, 64, 16, 256, with), b(*be, master, prec, 64, 16, 256, without);
    const auto ga = a.generate(reqs, sp);
    const auto gb = b.generate(reqs, sp);
    if (a.last_stats().graph_steps == 0) {
      const char* e = std::getenv("FP8RL_CUDA_GRAPHS");
      if (e && std::string(e) == "0") GTEST_SKIP() << "CUDA graphs off (FP8RL_CUDA_GRAPHS=0)";
      FAIL() << recipe << ": the MoE decode replayed no CUDA graph";
    }
    EXPECT_GT(a.last_stats().graph_steps, 20) << recipe;
    EXPECT_EQ(b.last_stats().graph_steps, 0) << recipe;
    ASSERT_EQ(ga.size(), gb.size());
    int identical = 0;
    int64_t same = 0, compared = 0;
    for (size_t i = 0; i < ga.size(); ++i) {
      ASSERT_FALSE(ga[i].routing.empty()) << recipe << ": sample " << i << " has no routing record";
      if (ga[i].tokens != gb[i].tokens) continue;
      ++identical;
      ASSERT_EQ(ga[i].routing.size(), gb[i].routing.size()) << recipe << ": sample " << i;
      for (size_t e = 0; e < ga[i].routing.size(); ++e) {
        same += ga[i].routing[e] == gb[i].routing[e];
        ++compared;
      }
    }
    EXPECT_GE(identical, static_cast<int>(ga.size()) - 2) << recipe;
    ASSERT_GT(compared, 0) << recipe;
    // The router's FP32 logits over BF16 / FP8 activations: a near tie may flip with the padded
    // row count, rarely.
    EXPECT_GE(static_cast<double>(same) / compared, 0.99) << recipe;
    std::printf("  moe rollout graphs %s: %d graph steps of %d forwards, %d/%zu samples identical, routing %lld/%lld "
                "equal\n",
                recipe, a.last_stats().graph_steps, a.last_stats().decode_steps, identical, ga.size(),
                static_cast<long long>(same), static_cast<long long>(compared));
  }
}

}  // namespace
}  // namespace fp8rl
