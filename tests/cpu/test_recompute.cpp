// Block recomputation (ForwardOptions::recompute, train.recompute: block): the backward reruns
// each block's forward from its saved input, so the gradients and the trained weights are bit for
// bit those of the run that saved every activation, and the saved set is the block inputs only.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "model/transformer.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

ModelWeights recompute_model(const std::string& family) {
  ModelConfig c = model_config_tiny(family, /*vocab=*/64, /*hidden=*/128, /*layers=*/3, /*heads=*/4,
                                    /*kv_heads=*/2, /*intermediate=*/256);
  RandomInit init;
  init.seed = 21;
  init.std = 0.08f;
  return model_weights_random(c, init, DType::F32);
}

std::vector<std::vector<int32_t>> recompute_sequences() {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int32_t> tok(0, 63);
  std::vector<std::vector<int32_t>> seqs = {std::vector<int32_t>(13), std::vector<int32_t>(7), std::vector<int32_t>(20)};
  for (auto& s : seqs)
    for (int32_t& t : s) t = tok(rng);
  return seqs;
}

bool bitwise_equal(Backend& be, const Tensor& a, const Tensor& b) {
  const Tensor ha = be.to_host(a), hb = be.to_host(b);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

TEST(Recompute, BlockRecomputationGivesBitwiseTheSameGradients) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  for (const char* family : {"llama", "qwen3"})
    for (const char* preset : {"fp32", "bf16", "fp8_e2e"}) {
      SCOPED_TRACE(std::string(family) + " " + preset);
      const ModelWeights w = model_weights_to_device(*be, recompute_model(family), DType::F32);
      const EnginePrecision prec = PrecisionRecipe::preset(preset).trainer;
      const ForwardBatch batch = forward_batch_from_sequences(recompute_sequences());
      const int64_t T = batch.num_tokens();
      std::vector<float> dl(T);
      for (int64_t t = 0; t < T; ++t) dl[t] = 0.01f * static_cast<float>((t * 7) % 11) - 0.05f;
      ModelWeights grads[2];
      Tensor logp[2];
      for (int r = 0; r < 2; ++r) {
        Activations acts;
        ForwardOptions fo;
        fo.recompute = r == 1;
        logp[r] = model_forward_logprobs(*be, w, prec, batch, fo, &acts).logp;
        ASSERT_EQ(acts.recompute, r == 1);
        if (r == 1)
          for (const LayerActivations& a : acts.layers) {
            EXPECT_TRUE(a.x.defined());
            EXPECT_FALSE(a.xn_attn.defined()) << "only the block input is saved";
          }
        grads[r] = model_grads_alloc(*be, w, DType::F32);
        model_grads_zero(*be, grads[r]);
        model_backward(*be, w, prec, acts, be->to_device(from_float_vector(dl, {T})), grads[r]);
      }
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
  for (const auto& ids : recompute_sequences()) seqs.push_back({ids, 3});
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
