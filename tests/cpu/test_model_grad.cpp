// model_backward against central finite differences in FP64, for every parameter tensor of a
// tiny random model of each family (qwen3: q/k-norm + tied embeddings; qwen2: q/k/v biases;
// llama: llama3 rope scaling).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "test_model_util.h"

namespace fp8rl {
namespace {

using test::tiny_model;
using test::values_f64;

struct GradCase {
  const char* family;
};

class ModelGradTest : public ::testing::TestWithParam<GradCase> {};

// L(w) = sum_t c[t] * logp[t] (the targetless last tokens excluded by the model itself).
double loss(Backend& be, const ModelWeights& w, const ForwardBatch& batch, const std::vector<double>& c) {
  EnginePrecision fp32;
  fp32.linear = LinearMode::FP32;
  const LogprobResult r = model_forward_logprobs(be, w, fp32, batch, ForwardOptions{});
  const std::vector<double> logp = values_f64(be, r.logp);
  double L = 0.0;
  for (size_t t = 0; t < logp.size(); ++t) L += c[t] * logp[t];
  return L;
}

TEST_P(ModelGradTest, BackwardMatchesFiniteDifferencesFp64) {
  auto be = make_cpu_backend();
  ModelWeights w = model_weights_to_device(*be, tiny_model(GetParam().family, DType::F64, 7), DType::F64);
  const ModelConfig& cfg = w.config;
  const ForwardBatch batch = forward_batch_from_sequences(test::token_sequences({6, 4}, cfg.vocab_size, 3));
  const int64_t T = batch.num_tokens();
  std::vector<double> c(T);
  for (int64_t t = 0; t < T; ++t) c[t] = 0.5 + 0.37 * std::sin(1.3 * t + 0.2);

  // Analytic gradient.
  EnginePrecision fp32;
  fp32.linear = LinearMode::FP32;
  Activations acts;
  model_forward_logprobs(*be, w, fp32, batch, ForwardOptions{}, &acts);
  Tensor dlogp = Tensor::empty({T}, DType::F64);
  for (int64_t t = 0; t < T; ++t) dlogp.data<double>()[t] = c[t];
  ModelWeights g = model_grads_alloc(*be, w, DType::F64);
  model_backward(*be, w, fp32, acts, be->to_device(dlogp), g);

  // The gradient tensors by name.
  std::vector<std::pair<std::string, Tensor>> grads;
  model_for_each_parameter(g, [&](const std::string& n, Tensor& t) { grads.push_back({n, t}); });

  int checked = 0;
  double worst = 0.0;
  std::string worst_name;
  size_t gi = 0;
  model_for_each_parameter(w, [&](const std::string& name, Tensor& p) {
    ASSERT_LT(gi, grads.size());
    ASSERT_EQ(grads[gi].first, name);
    const std::vector<double> an = values_f64(*be, grads[gi].second);
    ++gi;
    ASSERT_EQ(static_cast<int64_t>(an.size()), p.numel());
    double gmax = 0.0;
    size_t imax = 0;
    for (size_t i = 0; i < an.size(); ++i)
      if (std::fabs(an[i]) > gmax) gmax = std::fabs(an[i]), imax = i;
    ASSERT_GT(gmax, 0.0) << name << ": gradient is identically zero";
    // The largest entry plus 3 spread-out ones.
    std::vector<size_t> idx = {imax, an.size() / 3, (2 * an.size()) / 3 + 1, an.size() - 1};
    double* data = p.data<double>();
    for (size_t i : idx) {
      i = std::min(i, an.size() - 1);
      const double orig = data[i];
      const double h = 1e-5 * std::max(1.0, std::fabs(orig));
      data[i] = orig + h;
      const double lp = loss(*be, w, batch, c);
      data[i] = orig - h;
      const double lm = loss(*be, w, batch, c);
      data[i] = orig;
      const double fd = (lp - lm) / (2 * h);
      // Relative to the entry, floored at 1e-3 of the tensor's largest gradient.
      const double denom = std::max(std::max(std::fabs(fd), std::fabs(an[i])), 1e-3 * gmax);
      const double rel = std::fabs(fd - an[i]) / denom;
      EXPECT_LT(rel, 1e-5) << name << "[" << i << "]: finite difference " << fd << ", backward " << an[i];
      if (rel > worst) worst = rel, worst_name = name;
      ++checked;
    }
  });
  EXPECT_EQ(gi, grads.size());
  // Every parameter tensor of the family was checked: embedding, 2 layers, final norm, (lm_head).
  const int per_layer = 9 + (cfg.attention_bias ? 3 : 0) + (cfg.qk_norm ? 2 : 0);
  EXPECT_EQ(checked, 4 * (1 + 2 * per_layer + 1 + (cfg.tie_word_embeddings ? 0 : 1)));
  RecordProperty("worst_relative_error", std::to_string(worst) + " (" + worst_name + ")");
}

INSTANTIATE_TEST_SUITE_P(Families, ModelGradTest,
                         ::testing::Values(GradCase{"qwen3"}, GradCase{"qwen2"}, GradCase{"llama"}),
                         [](const auto& info) { return std::string(info.param.family); });

// In BF16 and FP8 modes the backward produces gradients close to the FP32 ones, with an error
// that scales with the format: E4M3 keeps 3 mantissa bits, BF16 7, so FP8 rounding errors are
// ~16x larger and 1 - cos(g_fp8, g_fp32) should be within ~16^2 of BF16's (factor 2 margin).
TEST(ModelGrad, LowPrecisionBackwardTracksFp32) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, tiny_model("qwen3", DType::F32, 11), DType::F32);
  const ForwardBatch batch = forward_batch_from_sequences(test::token_sequences({9, 5}, w.config.vocab_size, 5));
  const int64_t T = batch.num_tokens();
  Tensor dlogp = Tensor::empty({T}, DType::F32);
  for (int64_t t = 0; t < T; ++t) dlogp.data<float>()[t] = 1.0f;
  auto grads_under = [&](LinearMode mode) {
    EnginePrecision p;
    p.linear = mode;
    Activations acts;
    model_forward_logprobs(*be, w, p, batch, ForwardOptions{}, &acts);
    ModelWeights g = model_grads_alloc(*be, w);
    model_backward(*be, w, p, acts, be->to_device(dlogp), g);
    std::vector<double> all;
    model_for_each_parameter(g, [&](const std::string&, Tensor& t) {
      for (double v : values_f64(*be, t)) all.push_back(v);
    });
    return all;
  };
  const std::vector<double> ref = grads_under(LinearMode::FP32);
  auto one_minus_cos = [&](const std::vector<double>& b) {
    double dot = 0, na = 0, nb = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(std::isfinite(b[i])) << i;
      dot += ref[i] * b[i], na += ref[i] * ref[i], nb += b[i] * b[i];
    }
    return 1.0 - dot / std::sqrt(na * nb);
  };
  const double e_bf16 = one_minus_cos(grads_under(LinearMode::BF16));
  const double e_fp8 = one_minus_cos(grads_under(LinearMode::FP8_BLOCK));
  EXPECT_GT(e_bf16, 0.0);  // the precision was applied
  EXPECT_LT(e_bf16, 1e-3);
  EXPECT_GT(e_fp8, e_bf16);
  EXPECT_LT(e_fp8, 2 * 256 * e_bf16);
  EXPECT_LT(e_fp8, 0.05);
}

}  // namespace
}  // namespace fp8rl
