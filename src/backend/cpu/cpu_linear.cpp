// CPU backend: linear layers (FP32 / BF16 / FP8 block-scaled) and the fused lm_head log-probs.
//
// A GEMM here is: build the effective operands (the exact values the GEMM multiplies: plain,
// BF16-rounded, or FP8 quantized-then-dequantized), multiply them in double, round once into
// the output dtype. For FP8 this equals a per-block FP32-accumulated GEMM up to the
// accumulation order (dequantized products are exact in double up to 2^-53).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {
namespace {

constexpr int64_t kVocabChunk = 2048;  // token_logprobs vocabulary chunk (a multiple of 128)

// In 32 x 32 tiles, so that both the reads and the writes stay in cache.
std::vector<double> transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 32;
  std::vector<double> t(a.size());
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile)
      for (int64_t i = i0; i < std::min(rows, i0 + kTile); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + kTile); ++j) t[j * rows + i] = a[i * cols + j];
  return t;
}

// quantize_1x128 (quant/quant.h) with the rows split across threads: a 1 x 128 block never
// spans two rows and each is quantized by the same reference code, so the result is bitwise
// that of quantize_1x128.
QuantTensor quantize_rows_1x128(const Tensor& x, bool pow2) {
  FP8RL_CHECK(x.ndim() == 2, "quantize_1x128 needs a 2-D tensor, got ", x.str());
  QuantTensor q = quant_alloc(x.dim(0), x.dim(1), 1, kQuantBlock, pow2);
  cpu_parallel_for(x.dim(0), x.numel() * 32, [&](int64_t r0, int64_t r1) {
    QuantTensor part = q;
    part.data = q.data.slice_rows(r0, r1);
    part.scales = q.scales.slice_rows(r0, r1);
    quantize_blocks_into(x.slice_rows(r0, r1), false, part, "activation");
  });
  return q;
}

// quantize_1x128_tokens(x) = quantize_1x128 of an exact copy of x^T [K, M] (same dtype, so the
// quantizer reads the same values): bitwise equal, and its rows parallelize.
QuantTensor quantize_tokens_1x128(const Tensor& x, bool pow2) {
  FP8RL_CHECK(x.ndim() == 2, "quantize_1x128_tokens needs a 2-D tensor, got ", x.str());
  const int64_t M = x.dim(0), K = x.dim(1);
  const size_t es = dtype_size(x.dtype());
  Tensor xt = Tensor::empty({K, M}, x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(xt.raw());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < K; ++j) std::memcpy(dst + (j * M + i) * es, src + (i * K + j) * es, es);
  return quantize_rows_1x128(xt, pow2);
}

void round_operand(std::vector<double>& v, LinearMode mode) {
  if (mode == LinearMode::BF16)
    for (double& e : v) e = bf16_round(static_cast<float>(e));
}

// x [..., cols] as [rows, cols] (the contract checked the last dimension).
Tensor as_2d(const Tensor& x, int64_t cols) { return x.reshape({cols ? x.numel() / cols : 0, cols}); }

// x [M, K] as the wgrad operand x^T [K, M] (FP8: 1x128 along tokens, requantized).
std::vector<double> linear_operand_tokens(const Tensor& x, LinearMode mode, bool pow2) {
  if (mode == LinearMode::FP8_BLOCK) return dequantize_exact(quantize_tokens_1x128(x, pow2));
  std::vector<double> v = transpose(load(x, "linear operand"), x.dim(0), x.dim(1));
  round_operand(v, mode);
  return v;
}

// W^T [K, N], the dgrad weight operand (FP8: W's 128x128 quantization transposed exactly).
// FP8 uses W.wqt when defined (that transpose, cached), else W.wq when defined (the forward's
// quantized weight) transposed, else quantizes W.w.
std::vector<double> linear_operand_weight_t(const LinearWeight& W, LinearMode mode, bool pow2) {
  if (mode == LinearMode::FP8_BLOCK) {
    if (W.wqt.defined()) return dequantize_exact(W.wqt);
    const QuantTensor wq = W.wq.defined() ? W.wq : quantize_128x128(W.w, pow2);
    return dequantize_exact(transpose_128x128(wq));
  }
  return transpose(linear_operand_weight(W, mode, pow2), W.out_features(), W.in_features());
}

Tensor tensor_f64(const std::vector<double>& v, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::F64);
  store(v, t, "temporary");
  return t;
}

// Gradients of Y[M, N] = X[M, K] W[N, K]^T given dY (values), in `spec` numerics:
// dx [M, K] = dY W, dw [N, K] = dY^T X (nullptr: not computed). dy_fp8: dY's 1x128
// quantization from its producer (FP8 only), the values linear_operand_act would make.
void linear_grads(const Tensor& dy2, const Tensor& x2, const LinearWeight& W, const LinearSpec& spec,
                  const Fp8View* dy_fp8, std::vector<double>* dx, std::vector<double>* dw) {
  const int64_t M = dy2.dim(0), N = dy2.dim(1), K = x2.dim(1);
  if (dx) {
    const std::vector<double> a =
        dy_fp8 ? dequantize_exact(dy_fp8->q) : linear_operand_act(dy2, spec.mode, spec.pow2_scales);  // [M, N]
    const std::vector<double> b = linear_operand_weight_t(W, spec.mode, spec.pow2_scales);  // [K, N]
    *dx = matmul_nt(a, b, M, K, N);
  }
  if (dw) {
    // FP8 linears: wgrad in FP8 (requantized along tokens) or, with spec.wgrad == BF16, in BF16
    // (the contracts refuse any other wgrad).
    const LinearMode wm = spec.mode == LinearMode::FP8_BLOCK ? spec.wgrad : spec.mode;
    const std::vector<double> a = linear_operand_tokens(dy2, wm, spec.pow2_scales);  // [N, M]
    const std::vector<double> b = linear_operand_tokens(x2, wm, spec.pow2_scales);   // [K, M]
    *dw = matmul_nt(a, b, N, K, M);
  }
}

}  // namespace

std::vector<double> dequantize_exact(const QuantTensor& q) {
  check_cpu(q.data, "quantized data");
  const int64_t R = q.rows(), C = q.cols(), nbc = q.scales.dim(1);
  std::vector<double> v(R * C);
  const uint8_t* d = q.data.data<uint8_t>();
  const float* s = q.scales.data<float>();
  cpu_parallel_for(R, R * C * 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t j = 0; j < C; ++j)
        v[i * C + j] = double(e4m3_to_float(d[i * C + j])) * s[(i / q.block_rows) * nbc + j / q.block_cols];
  });
  return v;
}

std::vector<double> linear_operand_act(const Tensor& x, LinearMode mode, bool pow2) {
  if (mode == LinearMode::FP8_BLOCK) return dequantize_exact(quantize_rows_1x128(x, pow2));
  std::vector<double> v = load(x, "linear input");
  round_operand(v, mode);
  return v;
}

std::vector<double> linear_operand_weight(const LinearWeight& W, LinearMode mode, bool pow2) {
  if (mode == LinearMode::FP8_BLOCK) {
    if (W.wq.defined()) return dequantize_exact(W.wq);
    return dequantize_exact(quantize_128x128(W.w, pow2));
  }
  std::vector<double> v = load(W.w, "linear weight");
  round_operand(v, mode);
  return v;
}

// ---- linear --------------------------------------------------------------------------------

void CpuBackend::linear_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                             const Fp8View* x_fp8) {
  const int64_t N = W.out_features(), K = W.in_features();
  const Tensor x2 = as_2d(x, K);
  const int64_t M = x2.dim(0);
  const bool view = x_fp8 != nullptr;  // FP8_BLOCK only (the contract drops it otherwise)
  // The CPU's own limit: it reads the view's scales row-major (a CPU producer writes no other).
  if (view)
    FP8RL_CHECK(!x_fp8->scales_gemm_layout, "linear: the CPU backend takes FP8 views with row-major scales");
  // With a view: its values are the quantization linear_operand_act would make (the producer's contract).
  const std::vector<double> a = view ? dequantize_exact(x_fp8->q) : linear_operand_act(x2, spec.mode, spec.pow2_scales);
  const std::vector<double> b = linear_operand_weight(W, spec.mode, spec.pow2_scales);
  std::vector<double> y = matmul_nt(a, b, M, N, K);
  if (W.bias.defined()) {
    const std::vector<double> bias = load(W.bias, "linear bias");
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) y[i * N + j] += bias[j];
  }
  store(y, out, "linear output");
}

void CpuBackend::linear_backward_impl(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                                      Tensor* dx, Tensor* dw, Tensor* dbias, const Fp8View* dy_fp8) {
  const int64_t N = W.out_features(), K = W.in_features();
  const Tensor x2 = as_2d(x, K);
  const Tensor dy2 = as_2d(dy, N);
  const int64_t M = x2.dim(0);
  // The CPU's own limit, as linear's: it reads the view's scales row-major.
  if (dy_fp8)
    FP8RL_CHECK(!dy_fp8->scales_gemm_layout, "linear_backward: the CPU backend takes FP8 views with row-major scales");
  std::vector<double> gx, gw;
  linear_grads(dy2, x2, W, spec, dy_fp8, dx ? &gx : nullptr, dw ? &gw : nullptr);
  if (dx) store(gx, *dx, "linear dx");
  if (dw) accumulate(gw, *dw, "linear dw");
  if (dbias) {
    const std::vector<double> g = load(dy2, "linear dy");
    std::vector<double> gb(N, 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) gb[j] += g[i * N + j];
    accumulate(gb, *dbias, "linear dbias");
  }
}

// ---- fused lm_head + log-softmax -------------------------------------------------------------

namespace {

struct LogitsChunk {
  int64_t v0, n;
  std::vector<double> z;  // [T, n] logits / temperature
};

// Calls f(chunk) for each vocabulary chunk of logits = hidden lm_head^T / temperature. With
// spec.consistent the chunks are kConsistentVocabChunk wide and each raw logit is rounded to F32
// first: exactly what linear over that chunk writes into an F32 output (the consistent
// generator's logits, which logprobs_of_logits reads).
template <class F>
void for_each_logits_chunk(const Tensor& hidden, const Tensor& lm_head, float temperature,
                           const LinearSpec& spec, const std::vector<double>& h_eff, F&& f) {
  const int64_t T = hidden.dim(0), D = hidden.dim(1), V = lm_head.dim(0);
  const int64_t width = spec.consistent ? kConsistentVocabChunk : kVocabChunk;
  for (int64_t v0 = 0; v0 < V; v0 += width) {
    const int64_t n = std::min(width, V - v0);
    LinearWeight Wc;
    Wc.w = lm_head.slice_rows(v0, v0 + n);
    LogitsChunk c{v0, n, matmul_nt(h_eff, linear_operand_weight(Wc, spec.mode, spec.pow2_scales), T, n, D)};
    if (spec.consistent)
      for (double& e : c.z) e = static_cast<float>(e);
    for (double& e : c.z) e /= temperature;
    f(c);
  }
}

// Data the contract cannot see without reading it: each target inside the vocabulary [0, V).
void check_targets(int64_t V, const std::vector<int32_t>& targets, const char* op) {
  for (size_t t = 0; t < targets.size(); ++t)
    FP8RL_CHECK(targets[t] >= 0 && targets[t] < V, op, ": target ", targets[t], " of token ", t,
                " is outside the vocabulary [0, ", V, ")");
}

// The log-softmax reduction of token_logprobs and logprobs_of_logits, one copy: per row an
// online log-sum-exp over the vocabulary chunks folded in order (running max m, S = sum e^(z-m),
// Z = sum e^(z-m) z for the entropy) and the target's z. The chunks and their order fix the
// result: both ops fold the same chunks for the same bits.
class RowLogSoftmax {
 public:
  explicit RowLogSoftmax(const std::vector<int32_t>& targets)
      : tgt_(targets), m_(targets.size(), -INFINITY), S_(targets.size(), 0.0), Z_(targets.size(), 0.0),
        zt_(targets.size(), 0.0) {}

  // Folds in the chunk of vocabulary ids [v0, v0 + n): its tempered logits z, row t's n values
  // at z + t * ld.
  void fold(const double* z0, int64_t ld, int64_t v0, int64_t n) {
    const int64_t T = static_cast<int64_t>(tgt_.size());
    cpu_parallel_for(T, T * n * 16, [&](int64_t t0, int64_t t1) {  // ~16 flops per exp
      for (int64_t t = t0; t < t1; ++t) {
        const double* z = z0 + t * ld;
        const double cm = *std::max_element(z, z + n);
        if (cm > m_[t]) {
          const double r = std::exp(m_[t] - cm);  // 0 on the first chunk
          S_[t] *= r;
          Z_[t] *= r;
          m_[t] = cm;
        }
        for (int64_t j = 0; j < n; ++j) {
          const double e = std::exp(z[j] - m_[t]);
          S_[t] += e;
          Z_[t] += e * z[j];
        }
        if (tgt_[t] >= v0 && tgt_[t] < v0 + n) zt_[t] = z[tgt_[t] - v0];
      }
    });
  }

  // logp = z_target - lse, lse = m + log S, entropy (when non-null) = lse - Z / S.
  void finish(Tensor& logp, Tensor& lse, Tensor* entropy, const std::string& op) const {
    const size_t T = tgt_.size();
    std::vector<double> vlse(T), vlogp(T), vent(T);
    for (size_t t = 0; t < T; ++t) {
      vlse[t] = m_[t] + std::log(S_[t]);
      vlogp[t] = zt_[t] - vlse[t];
      vent[t] = vlse[t] - Z_[t] / S_[t];  // H = -sum p log p = lse - E_p[z]
    }
    store(vlogp, logp, (op + " logp").c_str());
    store(vlse, lse, (op + " lse").c_str());
    if (entropy) store(vent, *entropy, (op + " entropy").c_str());
  }

 private:
  const std::vector<int32_t>& tgt_;
  std::vector<double> m_, S_, Z_, zt_;
};

}  // namespace

void CpuBackend::token_logprobs_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                     float temperature, const LinearSpec& spec, Tensor& logp, Tensor& lse,
                                     Tensor* entropy) {
  const std::vector<int32_t> tgt = load_i32(targets, "token_logprobs targets");
  check_targets(lm_head.dim(0), tgt, "token_logprobs");
  RowLogSoftmax rows(tgt);
  const std::vector<double> h_eff = linear_operand_act(hidden, spec.mode, spec.pow2_scales);
  for_each_logits_chunk(hidden, lm_head, temperature, spec, h_eff,
                        [&](const LogitsChunk& c) { rows.fold(c.z.data(), c.n, c.v0, c.n); });
  rows.finish(logp, lse, entropy, "token_logprobs");
}

void CpuBackend::logprobs_of_logits_impl(const Tensor& logits, const Tensor& targets, float temperature,
                                         Tensor& logp, Tensor& lse) {
  const std::vector<int32_t> tgt = load_i32(targets, "logprobs_of_logits targets");
  const int64_t V = logits.dim(1);
  check_targets(V, tgt, "logprobs_of_logits");
  std::vector<double> z = load(logits, "logprobs_of_logits logits");  // [R, V]
  for (double& e : z) e /= temperature;  // as for_each_logits_chunk tempers its chunks
  RowLogSoftmax rows(tgt);
  for (int64_t v0 = 0; v0 < V; v0 += kConsistentVocabChunk)
    rows.fold(z.data() + v0, V, v0, std::min(kConsistentVocabChunk, V - v0));
  rows.finish(logp, lse, nullptr, "logprobs_of_logits");
}

// d logp[t] / d z[t, v] = [v == target] - p[t, v]; z = raw / temperature. The raw-logit
// gradient goes through the lm_head GEMM's backward in `spec` numerics (as linear_backward).
void CpuBackend::token_logprobs_backward_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                              float temperature, const LinearSpec& spec, const Tensor& lse,
                                              const Tensor& dlogp, Tensor& dhidden, Tensor* dlm_head) {
  const std::vector<int32_t> tgt = load_i32(targets, "token_logprobs targets");
  check_targets(lm_head.dim(0), tgt, "token_logprobs");
  const int64_t T = hidden.dim(0), D = hidden.dim(1);
  const std::vector<double> vlse = load(lse, "token_logprobs lse"), g = load(dlogp, "token_logprobs dlogp");
  const std::vector<double> h_eff = linear_operand_act(hidden, spec.mode, spec.pow2_scales);
  std::vector<double> dh(T * D, 0.0);
  for_each_logits_chunk(hidden, lm_head, temperature, spec, h_eff, [&](const LogitsChunk& c) {
    std::vector<double> draw(T * c.n);  // gradient of the raw (untempered) logits [T, n]
    cpu_parallel_for(T, T * c.n * 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t j = 0; j < c.n; ++j) {
          const double p = std::exp(c.z[t * c.n + j] - vlse[t]);
          const double onehot = (tgt[t] == c.v0 + j) ? 1.0 : 0.0;
          draw[t * c.n + j] = g[t] * (onehot - p) / temperature;
        }
      }
    });
    LinearWeight Wc;
    Wc.w = lm_head.slice_rows(c.v0, c.v0 + c.n);
    std::vector<double> gx, gw;
    linear_grads(tensor_f64(draw, {T, c.n}), hidden, Wc, spec, nullptr, &gx, dlm_head ? &gw : nullptr);
    for (int64_t i = 0; i < T * D; ++i) dh[i] += gx[i];
    if (dlm_head) {
      Tensor rows = dlm_head->slice_rows(c.v0, c.v0 + c.n);
      accumulate(gw, rows, "token_logprobs dlm_head");
    }
  });
  store(dh, dhidden, "token_logprobs dhidden");
}

}  // namespace cpu
}  // namespace fp8rl
