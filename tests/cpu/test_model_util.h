// Helpers shared by the model tests (tests/cpu/test_model*.cpp).
#pragma once
#include <cmath>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "model/transformer.h"
#include "model/weights.h"

namespace fp8rl::test {

// Values of any float tensor (device or host) as double.
inline std::vector<double> values_f64(Backend& be, const Tensor& t) {
  const Tensor h = t.device() == DeviceKind::CPU ? t : be.to_host(t);
  std::vector<double> v(h.numel());
  if (h.dtype() == DType::F64) {
    for (int64_t i = 0; i < h.numel(); ++i) v[i] = h.data<double>()[i];
  } else {
    const std::vector<float> f = to_float_vector(h);
    for (size_t i = 0; i < f.size(); ++i) v[i] = f[i];
  }
  return v;
}

// A small family model with non-trivial weights (larger than HF's init so that attention and
// the output distribution are far from uniform).
inline ModelWeights tiny_model(const std::string& family, DType dtype, uint64_t seed, int vocab = 48) {
  const ModelConfig c = model_config_tiny(family, vocab, /*hidden=*/64, /*layers=*/2, /*heads=*/4,
                                          /*kv_heads=*/2, /*intermediate=*/96);
  RandomInit init;
  init.seed = seed;
  init.std = 0.15f;
  init.bias_std = 0.1f;
  init.norm_jitter = 0.2f;
  return model_weights_random(c, init, dtype);
}

// Deterministic pseudo-random token sequences of the given lengths.
// A TokenLossFn: the mean negative log-likelihood of the micro-batch's response tokens.
inline double mean_nll(size_t, size_t, const std::vector<float>& logp, std::vector<float>& grad) {
  double l = 0;
  for (size_t i = 0; i < logp.size(); ++i) {
    l -= logp[i];
    grad[i] = -1.0f / static_cast<float>(logp.size());
  }
  return l / static_cast<double>(logp.size());
}

inline std::vector<std::vector<int32_t>> token_sequences(const std::vector<int>& lengths, int vocab, uint32_t seed) {
  std::vector<std::vector<int32_t>> seqs;
  uint32_t s = seed * 2654435761u + 12345u;
  for (int n : lengths) {
    std::vector<int32_t> q;
    for (int i = 0; i < n; ++i) {
      s = s * 1664525u + 1013904223u;
      q.push_back(static_cast<int32_t>((s >> 8) % static_cast<uint32_t>(vocab)));
    }
    seqs.push_back(q);
  }
  return seqs;
}

}  // namespace fp8rl::test
