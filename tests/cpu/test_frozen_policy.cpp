// The frozen reference policy (TrainerOptions::frozen): it scores exactly as a full Trainer of
// the same weights does, holds no master weights, gradients or moments, and refuses to train.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/error.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

ModelWeights frozen_test_model() {
  ModelConfig c = model_config_tiny("qwen3", /*vocab=*/64, /*hidden=*/128, /*layers=*/2, /*heads=*/4,
                                    /*kv_heads=*/2, /*intermediate=*/256);
  RandomInit init;
  init.seed = 11;
  init.std = 0.08f;
  return model_weights_random(c, init, DType::F32);
}

std::vector<TrainSequence> frozen_test_batch() {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, 63);
  std::vector<TrainSequence> seqs(5);
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].ids.resize(9 + 3 * i);
    for (int32_t& t : seqs[i].ids) t = tok(rng);
    seqs[i].prompt_len = 4;
  }
  return seqs;
}

TEST(FrozenPolicy, ScoresBitwiseLikeAFullTrainerAndCannotTrain) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const ModelWeights host = frozen_test_model();
  const std::vector<TrainSequence> seqs = frozen_test_batch();
  for (const char* preset : {"fp32", "bf16", "fp8_e2e"}) {
    SCOPED_TRACE(preset);
    const EnginePrecision prec = PrecisionRecipe::preset(preset).trainer;
    TrainerOptions opt;
    opt.micro_batch_tokens = 24;  // several micro-batches
    Trainer full(*be, model_weights_to_device(*be, host, DType::F32), prec, opt);
    opt.frozen = true;
    Trainer frozen(*be, model_weights_to_device(*be, host, DType::F32), prec, opt);
    const ScoreResult a = full.score(seqs, 1.0f, /*entropy=*/true, /*record_amax=*/true);
    const ScoreResult b = frozen.score(seqs, 1.0f, /*entropy=*/true, /*record_amax=*/true);
    ASSERT_EQ(a.logp.size(), b.logp.size());
    EXPECT_EQ(std::memcmp(a.logp.data(), b.logp.data(), a.logp.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(a.entropy.data(), b.entropy.data(), a.entropy.size() * sizeof(float)), 0);
    EXPECT_EQ(a.k_amax, b.k_amax);
    const Trainer& cf = frozen;
    EXPECT_FALSE(cf.master().embed.defined()) << "the F32 master is released";
    EXPECT_THROW(frozen.master(), Error);
    const TokenLossFn loss = [](size_t, size_t, const std::vector<float>&, std::vector<float>&) { return 0.0; };
    EXPECT_THROW(frozen.step(seqs, 1.0f, loss, 1e-3f), Error);
  }
}

}  // namespace
}  // namespace fp8rl
