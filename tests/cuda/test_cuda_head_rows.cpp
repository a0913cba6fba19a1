// The lm_head over the response tokens alone (ForwardOptions::head_rows) on the GPU, as
// tests/cpu/test_head_rows.cpp checks it on the CPU. The head's GEMMs then run at another M than
// the whole batch's, and cuBLASLt may pick another algorithm for it (another summation order), so
// the comparison is by a tolerance of the activation dtype's rounding: F32 activations (the exact
// path) to 1e-5 of each gradient's norm, BF16 (the default) to 1e-2; a wrong row gather or scatter
// moves the lm_head's and every block's gradient by their whole size.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../cpu/test_model_util.h"
#include "backend/backend.h"
#include "model/transformer.h"
#include "support/head_rows_util.h"
#include "support/recompute_util.h"

namespace fp8rl {
namespace {

using namespace test;

TEST(CudaHeadRows, HeadOverTheResponseRowsAgreesWithTheWholeHead) {
  for (const DType act : {DType::F32, DType::BF16}) {
    std::unique_ptr<Backend> be = make_cuda_backend(0, act);
    const double tol = act == DType::F32 ? 1e-5 : 1e-2;
    for (const char* family : {"llama", "qwen2", "qwen3"})
      for (const char* preset : {"bf16", "fp8_e2e"}) {
        SCOPED_TRACE(std::string(family) + " " + preset + " activations " + dtype_name(act));
        const ModelWeights w = model_weights_to_device(*be, recompute_model(family), DType::F32);
        const EnginePrecision prec = PrecisionRecipe::preset(preset).trainer;
        const ForwardBatch batch = forward_batch_from_sequences(recompute_sequences(28));
        const std::vector<int64_t> rows = head_rows_of(batch, 4);
        std::vector<double> full, sub;
        ModelWeights grads[2];
        head_rows_run_twice(*be, w, prec, batch, rows, full, sub, grads);
        ASSERT_FALSE(HasFatalFailure());
        ASSERT_EQ(full.size(), sub.size());
        for (size_t i = 0; i < full.size(); ++i) EXPECT_NEAR(full[i], sub[i], tol * (1 + std::fabs(full[i]))) << i;
        std::vector<std::pair<std::string, Tensor>> g0, g1;
        model_for_each_parameter(grads[0], [&](const std::string& n, const Tensor& t) { g0.emplace_back(n, t); });
        model_for_each_parameter(grads[1], [&](const std::string& n, const Tensor& t) { g1.emplace_back(n, t); });
        ASSERT_EQ(g0.size(), g1.size());
        for (size_t i = 0; i < g0.size(); ++i) {
          const std::vector<double> a = values_f64(*be, g0[i].second), b = values_f64(*be, g1[i].second);
          double diff = 0, norm = 0;
          for (size_t j = 0; j < a.size(); ++j) diff += (a[j] - b[j]) * (a[j] - b[j]), norm += a[j] * a[j];
          EXPECT_GT(norm, 0) << g0[i].first << " has no gradient";
          EXPECT_LE(std::sqrt(diff), tol * std::sqrt(norm)) << g0[i].first;
        }
      }
  }
}

}  // namespace
}  // namespace fp8rl
