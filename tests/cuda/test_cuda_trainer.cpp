// The trainer on CUDA with ragged micro-batches (issue 13: no silent slow paths): its FP8
// products take the tensor cores with no tail product, because the micro-batches are padded to
// the backend's row granule (TrainerOptions::pad_tokens_to, Backend::row_granule); without the
// padding the same sequences do pay tail products (so the test can fail), and the padded scores
// and steps agree with the unpadded ones to the FP8 class's tolerance (on the CPU they are the
// same bits: tests/cpu/test_trainer.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "../cpu/test_model_util.h"
#include "model/config.h"
#include "model/weights.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

constexpr auto nll = test::mean_nll;

TEST(CudaTrainer, RaggedMicroBatchesPayNoFp8TailProduct) {
  auto be = make_cuda_backend(0, DType::BF16);
  ASSERT_EQ(be->row_granule(), 16);
  const ModelConfig mc = model_config_tiny("qwen3", 512, /*hidden=*/256, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2,
                                           /*intermediate=*/512);
  RandomInit init;
  init.seed = 41;
  init.std = 0.08f;
  const ModelWeights host = model_weights_random(mc, init, DType::F32);
  // 137 + 129 + 151 | 145 tokens at 512 per micro-batch: 417 and 145, neither a multiple of 16
  // (the first above 256 rows, where the FP8 products are cuBLASLt's; the second on the own
  // kernel, which takes any M: GemmEngine's auto choice).
  std::vector<TrainSequence> seqs;
  for (const auto& ids : test::token_sequences({137, 129, 151, 145}, 512, 9)) seqs.push_back({ids, 8});
  EnginePrecision prec;
  prec.linear = LinearMode::FP8_BLOCK;
  prec.wgrad = LinearMode::BF16;
  TrainerOptions opt;
  opt.micro_batch_tokens = 512;
  Trainer padded(*be, model_weights_to_device(*be, host, DType::F32), prec, opt);
  opt.pad_tokens_to = 1;
  Trainer plain(*be, model_weights_to_device(*be, host, DType::F32), prec, opt);

  const BackendCounters c0 = be->counters();
  const ScoreResult sa = padded.score(seqs, 1.0f, false, true);
  const StepResult a = padded.step(seqs, 1.0f, nll, 1e-3f);
  const BackendCounters c1 = be->counters();
  EXPECT_EQ(c1.fp8_gemm_tails - c0.fp8_gemm_tails, 0) << "a padded micro-batch paid an FP8 tail product";
  EXPECT_EQ(c1.fp8_gemm_fallbacks - c0.fp8_gemm_fallbacks, 0);
  EXPECT_EQ(padded.padding_tokens(), 2 * ((432 - 417) + (160 - 145)));

  const ScoreResult sb = plain.score(seqs, 1.0f, false, true);
  const StepResult b = plain.step(seqs, 1.0f, nll, 1e-3f);
  const BackendCounters c2 = be->counters();
  EXPECT_GT(c2.fp8_gemm_tails - c1.fp8_gemm_tails, 0) << "the unpadded ragged micro-batches should pay tails";

  ASSERT_TRUE(a.applied && b.applied);
  ASSERT_EQ(sa.logp.size(), sb.logp.size());
  double worst = 0;
  for (size_t i = 0; i < sa.logp.size(); ++i) worst = std::max(worst, std::fabs(double(sa.logp[i]) - sb.logp[i]));
  EXPECT_LT(worst, 2e-2) << "padded and unpadded scores differ beyond the FP8 / BF16 class";
  EXPECT_NEAR(a.loss, b.loss, 1e-2 * std::fabs(b.loss));
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 2e-2 * b.grad_norm);
}

}  // namespace
}  // namespace fp8rl
