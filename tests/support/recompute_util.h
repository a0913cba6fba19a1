// The block-recomputation check's common body (tests/cpu/test_recompute.cpp on the CPU,
// tests/cuda/test_cuda_recompute.cpp on the GPU): a tiny 3-layer model, a ragged batch, and the
// scoring forward + backward run twice, saving every activation and recomputing each block from
// its saved input. Each test compares the two runs by its backend's rule.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/transformer.h"

namespace fp8rl::test {

// family "qwen3_moe": 4 experts, top 2, expert width 128 (the grouped FP8 kernels' blocks).
inline ModelWeights recompute_model(const std::string& family) {
  ModelConfig c = model_config_tiny(family, /*vocab=*/64, /*hidden=*/128, /*layers=*/3, /*heads=*/4,
                                    /*kv_heads=*/2, /*intermediate=*/256);
  if (family == "qwen3_moe") {
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 128;
    c.validate();
  }
  RandomInit init;
  init.seed = 21;
  init.std = 0.08f;
  return model_weights_random(c, init, DType::F32);
}

// Three sequences of 13, 7 and `last` tokens (seeded ids below 64).
inline std::vector<std::vector<int32_t>> recompute_sequences(int32_t last) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int32_t> tok(0, 63);
  std::vector<std::vector<int32_t>> seqs = {std::vector<int32_t>(13), std::vector<int32_t>(7),
                                            std::vector<int32_t>(last)};
  for (auto& s : seqs)
    for (int32_t& t : s) t = tok(rng);
  return seqs;
}

inline bool bitwise_equal(Backend& be, const Tensor& a, const Tensor& b) {
  const Tensor ha = be.to_host(a), hb = be.to_host(b);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

// logp[r] and grads[r] of `batch` under `prec`, r = 0 saving every activation, r = 1 with block
// recomputation (checked to save only the block inputs); a fixed dlogp.
inline void recompute_run_twice(Backend& be, const ModelWeights& w, const EnginePrecision& prec,
                                const ForwardBatch& batch, Tensor logp[2], ModelWeights grads[2]) {
  const int64_t T = batch.num_tokens();
  std::vector<float> dl(T);
  for (int64_t t = 0; t < T; ++t) dl[t] = 0.01f * static_cast<float>((t * 7) % 11) - 0.05f;
  for (int r = 0; r < 2; ++r) {
    Activations acts;
    ForwardOptions fo;
    fo.recompute = r == 1;
    logp[r] = model_forward_logprobs(be, w, prec, batch, fo, &acts).logp;
    ASSERT_EQ(acts.recompute, r == 1);
    if (r == 1)
      for (const LayerActivations& a : acts.layers) {
        EXPECT_TRUE(a.x.defined());
        EXPECT_FALSE(a.xn_attn.defined()) << "only the block input is saved";
      }
    grads[r] = model_grads_alloc(be, w, DType::F32);
    model_grads_zero(be, grads[r]);
    model_backward(be, w, prec, acts, be.to_device(from_float_vector(dl, {T})), grads[r]);
  }
}

}  // namespace fp8rl::test
