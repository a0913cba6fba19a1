// Block recomputation on the GPU (train.recompute: block; issue 15), as tests/cpu/test_recompute.cpp
// checks it on the CPU: model_backward reruns each block's forward from its saved input with the
// same kernels on the same inputs, so the gradients are those of the backward that saved every
// activation.
//
// What "equal" means on CUDA, by how each gradient is produced:
//   - bitwise: the scoring forward's logp, and the gradient of every linear (q/k/v/o, MLP, an
//     untied lm_head): GEMMs (cuBLASLt, the dequantized FP8 fallback) and everything upstream of
//     them (RMSNorm dx, attention backward, SwiGLU, RoPE) are deterministic: each output element
//     is written by one thread in a fixed order;
//   - bitwise as well: the RMSNorm weights and the biases (per-chunk partial sums added in chunk
//     order) and the embedding (its rows summed in token order after a sort by id): no atomics
//     since session 17, so every gradient is the same bits run to run.
// The batch is ragged (13 + 7 + 28 = 48 tokens: a multiple of 16, so FP8 linears with K % 128 == 0
// take cuBLASLt's block-scaled tensor-core path and down (K = 256) too), on both GPU backends
// (F32 activations: the exact path; BF16: the default), for the fp32, bf16 and fp8_e2e trainers,
// for a Llama (tied), a Qwen2 (q/k/v biases, untied) and a Qwen3 (q/k-norm) model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../cpu/test_model_util.h"
#include "backend/backend.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "support/recompute_util.h"

namespace fp8rl {
namespace {

using test::bitwise_equal;
using test::recompute_model;
using test::recompute_run_twice;
using test::recompute_sequences;
using test::values_f64;

TEST(CudaRecompute, BlockRecomputationGivesTheSameGradients) {
  for (const DType act : {DType::F32, DType::BF16}) {
    std::unique_ptr<Backend> be = make_cuda_backend(0, act);
    for (const char* family : {"llama", "qwen2", "qwen3"})
      for (const char* preset : {"fp32", "bf16", "fp8_e2e"}) {
        SCOPED_TRACE(std::string(family) + " " + preset + " activations " + dtype_name(act));
        const ModelWeights w = model_weights_to_device(*be, recompute_model(family), DType::F32);
        const EnginePrecision prec = PrecisionRecipe::preset(preset).trainer;
        const ForwardBatch batch = forward_batch_from_sequences(recompute_sequences(28));
        ASSERT_EQ(batch.num_tokens() % 16, 0);
        ModelWeights grads[2];
        Tensor logp[2];
        recompute_run_twice(*be, w, prec, batch, logp, grads);
        ASSERT_FALSE(HasFatalFailure());
        EXPECT_TRUE(bitwise_equal(*be, logp[0], logp[1])) << "the scoring forward";
        std::vector<std::pair<std::string, Tensor>> g0, g1;
        model_for_each_parameter(grads[0], [&](const std::string& n, const Tensor& t) { g0.emplace_back(n, t); });
        model_for_each_parameter(grads[1], [&](const std::string& n, const Tensor& t) { g1.emplace_back(n, t); });
        ASSERT_EQ(g0.size(), g1.size());
        for (size_t i = 0; i < g0.size(); ++i) {
          const std::string& name = g0[i].first;
          ASSERT_EQ(name, g1[i].first);
          EXPECT_TRUE(bitwise_equal(*be, g0[i].second, g1[i].second)) << name;
          const bool summed = name.find("norm") != std::string::npos ||
                              name.find("embed_tokens") != std::string::npos ||
                              (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0);
          if (summed) {  // the former atomics' tensors: equal bits must not be two empty gradients
            double amax = 0;
            for (double v : values_f64(*be, g0[i].second)) amax = std::max(amax, std::fabs(v));
            EXPECT_GT(amax, 0) << name << " has no gradient";
          }
        }
      }
  }
}

}  // namespace
}  // namespace fp8rl
