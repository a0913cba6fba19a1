// Block recomputation (ForwardOptions::recompute, train.recompute: block): the backward reruns
// each block's forward from its saved input, so the gradients and the trained weights are bit for
// bit those of the run that saved every activation, and the saved set is the block inputs only.
#include <gtest/gtest.h>

#include "model/transformer.h"
#include "support/recompute_util.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

using namespace test;  // the shared body: tests/support/recompute_util.h

TEST(Recompute, BlockRecomputationGivesBitwiseTheSameGradients) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  for (const char* family : {"llama", "qwen3"})
    for (const char* preset : {"fp32", "bf16", "fp8_e2e"}) {
      SCOPED_TRACE(std::string(family) + " " + preset);
      const ModelWeights w = model_weights_to_device(*be, recompute_model(family), DType::F32);
      const EnginePrecision prec = PrecisionRecipe::preset(preset).trainer;
      const ForwardBatch batch = forward_batch_from_sequences(recompute_sequences(20));
      ModelWeights grads[2];
      Tensor logp[2];
      recompute_run_twice(*be, w, prec, batch, logp, grads);
      ASSERT_FALSE(HasFatalFailure());
      EXPECT_TRUE(bitwise_equal(*be, logp[0], logp[1]));
      std::vector<Tensor> g0, g1;
      std::vector<std::string> names;
      model_for_each_parameter(grads[0], [&](const std::string& n, const Tensor& t) {
        names.push_back(n);
        g0.push_back(t);
      });
      model_for_each_parameter(grads[1], [&](const std::string&, const Tensor& t) { g1.push_back(t); });
      ASSERT_EQ(g0.size(), g1.size());
      for (size_t i = 0; i < g0.size(); ++i) EXPECT_TRUE(bitwise_equal(*be, g0[i], g1[i])) << names[i];
    }
}

TEST(Recompute, TrainerStepWithRecomputationTrainsTheSameWeights) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::vector<TrainSequence> seqs;
  for (const auto& ids : recompute_sequences(20)) seqs.push_back({ids, 3});
  const TokenLossFn loss = [](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
    double l = 0;
    for (size_t i = 0; i < lp.size(); ++i) {
      l -= lp[i] / static_cast<double>(lp.size());
      grad[i] = -1.0f / static_cast<float>(lp.size());
    }
    return l;
  };
  const EnginePrecision prec = PrecisionRecipe::preset("fp8_e2e").trainer;
  TrainerOptions opt;
  opt.micro_batch_tokens = 24;  // several micro-batches
  Trainer plain(*be, model_weights_to_device(*be, recompute_model("qwen3"), DType::F32), prec, opt);
  opt.recompute = true;
  Trainer recomputed(*be, model_weights_to_device(*be, recompute_model("qwen3"), DType::F32), prec, opt);
  for (int step = 0; step < 2; ++step) {
    const StepResult a = plain.step(seqs, 1.0f, loss, 1e-3f), b = recomputed.step(seqs, 1.0f, loss, 1e-3f);
    ASSERT_TRUE(a.applied && b.applied);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
  }
  const Trainer& p = plain;
  const Trainer& r = recomputed;
  std::vector<Tensor> w0, w1;
  model_for_each_parameter(p.master(), [&](const std::string&, const Tensor& t) { w0.push_back(t); });
  model_for_each_parameter(r.master(), [&](const std::string&, const Tensor& t) { w1.push_back(t); });
  ASSERT_EQ(w0.size(), w1.size());
  for (size_t i = 0; i < w0.size(); ++i) EXPECT_TRUE(bitwise_equal(*be, w0[i], w1[i])) << i;
}

}  // namespace
}  // namespace fp8rl
