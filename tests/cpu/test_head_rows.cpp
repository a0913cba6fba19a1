// The lm_head over the response tokens alone (ForwardOptions::head_rows, what the trainer runs):
// on the CPU every row's head is computed on its own, so the log-probs and every gradient are bit
// for bit those of the head over the whole batch with the other rows' dlogp zero.
#include <gtest/gtest.h>

#include <string>

#include "model/transformer.h"
#include "support/head_rows_util.h"
#include "support/recompute_util.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

using namespace test;

TEST(HeadRows, HeadOverTheResponseRowsGivesTheWholeHeadsBits) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  for (const char* family : {"llama", "qwen2", "qwen3"})
    for (const char* preset : {"fp32", "bf16", "fp8_e2e"}) {
      SCOPED_TRACE(std::string(family) + " " + preset);
      const ModelWeights w = model_weights_to_device(*be, recompute_model(family), DType::F32);
      const EnginePrecision prec = PrecisionRecipe::preset(preset).trainer;
      const ForwardBatch batch = forward_batch_from_sequences(recompute_sequences(20));
      const std::vector<int64_t> rows = head_rows_of(batch, 4);
      ASSERT_EQ(rows.size(), size_t{9 + 3 + 16});
      std::vector<double> full, sub;
      ModelWeights grads[2];
      head_rows_run_twice(*be, w, prec, batch, rows, full, sub, grads);
      ASSERT_FALSE(HasFatalFailure());
      EXPECT_EQ(full, sub);
      std::vector<std::pair<std::string, Tensor>> g0, g1;
      model_for_each_parameter(grads[0], [&](const std::string& n, const Tensor& t) { g0.emplace_back(n, t); });
      model_for_each_parameter(grads[1], [&](const std::string& n, const Tensor& t) { g1.emplace_back(n, t); });
      ASSERT_EQ(g0.size(), g1.size());
      for (size_t i = 0; i < g0.size(); ++i) EXPECT_TRUE(bitwise_equal(*be, g0[i].second, g1[i].second)) << g0[i].first;
    }
}

TEST(HeadRows, RowsWithoutATargetOrOutOfOrderAreRefused) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, recompute_model("qwen3"), DType::F32);
  const EnginePrecision prec = PrecisionRecipe::preset("bf16").trainer;
  const ForwardBatch batch = forward_batch_from_sequences(recompute_sequences(20));
  for (const std::vector<int64_t>& rows : {std::vector<int64_t>{12}, std::vector<int64_t>{3, 2},
                                           std::vector<int64_t>{40}, std::vector<int64_t>{-1}}) {
    ForwardOptions fo;
    fo.head_rows = &rows;
    EXPECT_THROW(model_forward_logprobs(*be, w, prec, batch, fo), Error) << rows[0];  // 12: sequence 0's last
  }
  // No rows at all (responses of no tokens): nothing reaches the head, the gradient is the zero.
  const std::vector<int64_t> none;
  Activations acts;
  ForwardOptions fo;
  fo.head_rows = &none;
  const LogprobResult lr = model_forward_logprobs(*be, w, prec, batch, fo, &acts);
  EXPECT_EQ(lr.logp.numel(), 0);
  ModelWeights g = model_grads_alloc(*be, w, DType::F32);
  model_grads_zero(*be, g);
  model_backward(*be, w, prec, acts, be->to_device(Tensor::empty({0}, DType::F32)), g);
  model_for_each_parameter(g, [&](const std::string& n, const Tensor& t) {
    const Tensor h = be->to_host(t);
    for (int64_t i = 0; i < h.numel(); ++i) ASSERT_EQ(h.data<float>()[i], 0.0f) << n;
  });
}

}  // namespace
}  // namespace fp8rl
