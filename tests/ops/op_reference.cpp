// The CPU reference's specification, attached to the op table (op_table.h): each op's naive
// references (the formula written out on small inputs, in FP64 where the op takes it: linear
// against a naive product and the E4M3 error bound, RMSNorm, RoPE as HF writes it, SwiGLU, GQA
// attention over packed sequences, the chunked log-softmax (fused with the lm_head, and over given
// logits), AdamW in its textbook form, KV writes as the E4M3 formula, sampling by its
// frequencies) and its FP64 finite-difference gradient checks. The CPU runner
// (tests/cpu/test_op_table.cpp) runs them with the first row of their op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "core/dtype.h"
#include "ops/op_table.h"
#include "quant/quant.h"
#include "support/random_tensor.h"

namespace fp8rl::test {
namespace {

// Naive C[M, N] = A[M, K] B[N, K]^T in double.
std::vector<double> naive_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t N,
                             int64_t K) {
  std::vector<double> c(M * N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t k = 0; k < K; ++k) c[i * N + j] += a[i * K + k] * b[j * K + k];
  return c;
}

std::vector<double> transposed(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  return t;
}

// Worst-case bound of one dequantized operand element: E4M3 keeps 3 mantissa bits, so the
// rounding of v = x / s is at most half an ulp = 2^-4 |v| in the normal range and 2^-10 in the
// subnormal range (|v| < 2^-6); the float roundings of x / s and q * s add 2^-24 each.
double operand_bound(double x, double s) {
  return std::max(std::ldexp(std::fabs(x), -4), std::ldexp(s, -10)) * (1 + 1e-6) + std::ldexp(std::fabs(x), -22);
}

// Independent naive attention of one sequence: explicit score matrix, softmax, product.
void naive_attention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                     int64_t s0, int64_t s1, int64_t Hq, int64_t Hkv, int64_t hd, double scale,
                     std::vector<double>& out, std::vector<double>& lse, int64_t T) {
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t kh = h * Hkv / Hq;
    for (int64_t i = s0; i < s1; ++i) {
      std::vector<double> s;
      for (int64_t j = s0; j <= i; ++j) {
        double d = 0;
        for (int64_t c = 0; c < hd; ++c) d += q[(i * Hq + h) * hd + c] * k[(j * Hkv + kh) * hd + c];
        s.push_back(d * scale);
      }
      double z = 0;
      for (double e : s) z += std::exp(e);
      lse[h * T + i] = std::log(z);
      for (int64_t c = 0; c < hd; ++c) {
        double o = 0;
        for (int64_t j = s0; j <= i; ++j) o += std::exp(s[j - s0]) / z * v[(j * Hkv + kh) * hd + c];
        out[(i * Hq + h) * hd + c] = o;
      }
    }
  }
}

// Two sequences (lengths 7 and 5) in scattered pages of size 4; their prefill as one batch.
struct PagedSetup {
  int64_t T = 12, Hq = 4, Hkv = 2, hd = 8;
  std::vector<int32_t> cu = {0, 7, 12};
  PagedBatch batch;
  PagedSetup() {
    const std::vector<std::vector<int32_t>> pages = {{5, 1}, {0, 3}};  // sequence -> pages
    std::vector<int32_t> seq, pos, slots;
    for (int b = 0; b < 2; ++b)
      for (int32_t p = 0; p < cu[b + 1] - cu[b]; ++p) {
        seq.push_back(b);
        pos.push_back(p);
        slots.push_back(pages[b][p / 4] * 4 + p % 4);
      }
    batch.token_seq = i32_tensor(seq);
    batch.token_pos = i32_tensor(pos);
    batch.slots = i32_tensor(slots);
    batch.page_table = i32_tensor({5, 1, 0, 3}).reshape({2, 2});
    batch.max_pos = 7;
  }
};

// ---- linear ----------------------------------------------------------------------------------

void linear_fp32_matches_naive(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t M = 7, N = 9, K = 13;
  const Tensor x = random_tensor({M, K}, 1, DType::F32);
  LinearWeight W;
  W.w = random_tensor({N, K}, 2, DType::F32);
  W.bias = random_tensor({N}, 3, DType::F32);
  Tensor out = be->alloc({M, N}, DType::F32);
  be->linear(x, W, {LinearMode::FP32, false}, out);
  std::vector<double> ref = naive_nt(values(x), values(W.w), M, N, K);
  const std::vector<double> b = values(W.bias);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) ref[i * N + j] += b[j];
  EXPECT_LT(rel_err(values(out), ref), 1e-6);
}

void linear_bf16_rounds_operands(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t M = 5, N = 6, K = 40;
  const Tensor x = random_tensor({M, K}, 4, DType::F32);
  LinearWeight W;
  W.w = random_tensor({N, K}, 5, DType::F32);
  Tensor out = be->alloc({M, N}, DType::F32);
  be->linear(x, W, {LinearMode::BF16, false}, out);
  std::vector<double> xr = values(x), wr = values(W.w);
  for (double& e : xr) e = bf16_round(static_cast<float>(e));
  for (double& e : wr) e = bf16_round(static_cast<float>(e));
  const std::vector<double> ref = naive_nt(xr, wr, M, N, K);
  EXPECT_LT(rel_err(values(out), ref), 1e-6);
  // And it differs from the FP32 product (the rounding really happened).
  EXPECT_GT(rel_err(naive_nt(values(x), values(W.w), M, N, K), ref), 1e-5);
}

void linear_fp8_forward_within_e4_m3_bound(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t M = 9, N = 140, K = 300;  // partial blocks in N and K
  for (bool pow2 : {false, true}) {
    const Tensor x = random_tensor({M, K}, 10, DType::F32);
    LinearWeight W;
    W.w = random_tensor({N, K}, 11, DType::F32, 0.05);
    Tensor y8 = be->alloc({M, N}, DType::F32);
    be->linear(x, W, {LinearMode::FP8_BLOCK, pow2}, y8);
    const QuantTensor qx = quantize_1x128(x, pow2), qw = quantize_128x128(W.w, pow2);
    const std::vector<double> xv = values(x), wv = values(W.w), y = values(y8);
    const std::vector<double> exact = naive_nt(xv, wv, M, N, K);
    double err2 = 0, ref2 = 0;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double bound = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double sx = qx.scales.data<float>()[i * qx.scales.dim(1) + k / 128];
          const double sw = qw.scales.data<float>()[(j / 128) * qw.scales.dim(1) + k / 128];
          const double ex = operand_bound(xv[i * K + k], sx), ew = operand_bound(wv[j * K + k], sw);
          bound += ex * std::fabs(wv[j * K + k]) + std::fabs(xv[i * K + k]) * ew + ex * ew;
        }
        bound += std::ldexp(std::fabs(exact[i * N + j]) + bound, -23);  // output rounding to F32
        EXPECT_LE(std::fabs(y[i * N + j] - exact[i * N + j]), bound) << i << ", " << j;
        err2 += (y[i * N + j] - exact[i * N + j]) * (y[i * N + j] - exact[i * N + j]);
        ref2 += exact[i * N + j] * exact[i * N + j];
      }
    }
    // Really quantized (not silently FP32), and no worse than the per-element bound 2^-3.
    EXPECT_GT(std::sqrt(err2 / ref2), 1e-4);
    EXPECT_LT(std::sqrt(err2 / ref2), 0.125);
  }
}

void linear_fp8_uses_wq_when_given(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t M = 3, N = 130, K = 129;
  const Tensor x = random_tensor({M, K}, 12, DType::F32);
  LinearWeight W;
  W.w = random_tensor({N, K}, 13, DType::F32);
  const LinearSpec spec{LinearMode::FP8_BLOCK, true};
  Tensor a = be->alloc({M, N}, DType::F32), b = be->alloc({M, N}, DType::F32), c = be->alloc({M, N}, DType::F32);
  be->linear(x, W, spec, a);
  LinearWeight Wq;
  Wq.wq = quantize_128x128(W.w, true);
  be->linear(x, Wq, spec, b);
  EXPECT_EQ(values(a), values(b));
  // A wq that differs from w wins over w in the forward.
  W.wq = quantize_128x128(random_tensor({N, K}, 14, DType::F32), true);
  be->linear(x, W, spec, c);
  EXPECT_NE(values(a), values(c));
  // pow2 mismatch between wq and the spec is an error.
  EXPECT_THROW(be->linear(x, W, {LinearMode::FP8_BLOCK, false}, c), Error);
}

void linear_fp8_backward_uses_wq_when_given(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t M = 5, N = 130, K = 200;
  const Tensor x = random_tensor({M, K}, 18, DType::F32), dy = random_tensor({M, N}, 19, DType::F32);
  LinearWeight W;
  W.w = random_tensor({N, K}, 20, DType::F32);
  const LinearSpec spec{LinearMode::FP8_BLOCK, true};
  auto grads = [&](const LinearWeight& w, std::vector<double>& gx, std::vector<double>& gw) {
    Tensor dx = be->alloc({M, K}, DType::F32), dw = Tensor::zeros({N, K}, DType::F32);
    be->linear_backward(dy, x, w, spec, &dx, &dw, nullptr);
    gx = values(dx);
    gw = values(dw);
  };
  std::vector<double> dx_w, dw_w, dx_both, dw_both, dx_q, dw_q, dx_other, dw_other;
  grads(W, dx_w, dw_w);
  // The trainer's cache: w and wq = quantize_128x128(w): bitwise the w-only result.
  LinearWeight both = W;
  both.wq = quantize_128x128(W.w, true);
  grads(both, dx_both, dw_both);
  EXPECT_EQ(dx_both, dx_w);
  EXPECT_EQ(dw_both, dw_w);
  LinearWeight only_q;
  only_q.wq = both.wq;
  grads(only_q, dx_q, dw_q);
  EXPECT_EQ(dx_q, dx_w);
  EXPECT_EQ(dw_q, dw_w);
  // A wq that differs from w wins in dgrad too (w is not read); wgrad does not involve W.
  LinearWeight other = W;
  other.wq = quantize_128x128(random_tensor({N, K}, 21, DType::F32), true);
  grads(other, dx_other, dw_other);
  EXPECT_NE(dx_other, dx_w);
  EXPECT_EQ(dw_other, dw_w);
  Tensor dx = be->alloc({M, K}, DType::F32);
  EXPECT_THROW(be->linear_backward(dy, x, other, {LinearMode::FP8_BLOCK, false}, &dx, nullptr, nullptr), Error);
}

void linear_fp8_backward_is_quantize_dequantize_composition(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t M = 200, N = 136, K = 260;
  const Tensor x = random_tensor({M, K}, 15, DType::F32);
  const Tensor dy = random_tensor({M, N}, 16, DType::F32, 1e-3);
  LinearWeight W;
  W.w = random_tensor({N, K}, 17, DType::F32, 0.05);
  Tensor dx = be->alloc({M, K}, DType::F32), dw = be->alloc({N, K}, DType::F32);
  be->linear_backward(dy, x, W, {LinearMode::FP8_BLOCK, false}, &dx, &dw, nullptr);
  // dgrad: dY 1x128 along N times W's 128x128 quantization transposed.
  const std::vector<double> a = values(dequantize(quantize_1x128(dy, false)));                        // [M, N]
  const std::vector<double> b = values(dequantize(transpose_128x128(quantize_128x128(W.w, false))));  // [K, N]
  EXPECT_LT(rel_err(values(dx), naive_nt(a, b, M, K, N)), 1e-6);
  // wgrad: dY^T and X^T, both 1x128 along tokens.
  const std::vector<double> c = values(dequantize(quantize_1x128_tokens(dy, false)));  // [N, M]
  const std::vector<double> d = values(dequantize(quantize_1x128_tokens(x, false)));   // [K, M]
  EXPECT_LT(rel_err(values(dw), naive_nt(c, d, N, K, M)), 1e-6);
  // Not the unquantized product.
  EXPECT_GT(rel_err(values(dx), naive_nt(values(dy), transposed(values(W.w), N, K), M, K, N)), 1e-4);
}

void linear_references(OpCase& fwd, OpCase& bwd) {
  fwd.references.push_back({"LinearFp32MatchesNaive", linear_fp32_matches_naive});
  fwd.references.push_back({"LinearBf16RoundsOperands", linear_bf16_rounds_operands});
  fwd.references.push_back({"LinearFp8ForwardWithinE4M3Bound", linear_fp8_forward_within_e4_m3_bound});
  fwd.references.push_back({"LinearFp8UsesWqWhenGiven", linear_fp8_uses_wq_when_given});
  bwd.references.push_back({"LinearFp8BackwardUsesWqWhenGiven", linear_fp8_backward_uses_wq_when_given});
  bwd.references.push_back(
      {"LinearFp8BackwardIsQuantizeDequantizeComposition", linear_fp8_backward_is_quantize_dequantize_composition});
  // dx, dw (accumulated into 0.5: the gradient is what was added) and dbias of an FP32 linear.
  const int64_t M = 4, N = 5, K = 6;
  const LinearSpec spec{LinearMode::FP32, false};
  bwd.grad.inputs = [=] {
    return Tensors{{"x", random_tensor({M, K}, 6)},
                   {"w", random_tensor({N, K}, 7)},
                   {"bias", random_tensor({N}, 8)},
                   {"R", random_tensor({M, N}, 9)}};
  };
  auto weight = [](OpRun& r) {
    LinearWeight W;
    W.w = r["w"];
    W.bias = r["bias"];
    return W;
  };
  bwd.grad.forward = [=](OpRun& r) { r.be.linear(r["x"], weight(r), spec, r.output("out", {M, N}, DType::F64)); };
  bwd.grad.loss = {{"out", "R"}};
  bwd.grad.backward = [=](OpRun& r) {
    Tensor& dx = r.output("dx", {M, K}, DType::F64);
    Tensor& dw = r.output("dw_acc", {N, K}, DType::F64);
    Tensor& db = r.output("dbias", {N}, DType::F64);
    r.be.fill(dw, 0.5f);  // accumulated: subtracted below
    r.be.fill(db, 0.0f);  // accumulated
    r.be.linear_backward(r["R"], r["x"], weight(r), spec, &dx, &dw, &db);
    std::vector<double> gw = values(dw);
    for (double& e : gw) e -= 0.5;
    r.out["dw"] = Tensor::empty({N, K}, DType::F64);
    std::copy(gw.begin(), gw.end(), r.out["dw"].data<double>());
  };
  bwd.grad.wrt = {{"x", "dx"}, {"w", "dw"}, {"bias", "dbias"}};
}

// ---- RMSNorm, RoPE, SwiGLU -------------------------------------------------------------------

void rmsnorm_matches_naive(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t R = 5, D = 8;
  const float eps = 1e-5f;
  const Tensor x = random_tensor({R, D}, 20, DType::F32), w = random_tensor({D}, 21, DType::F32);
  Tensor out = be->alloc({R, D}, DType::F32), rstd = be->alloc({R}, DType::F32);
  be->rmsnorm(x, w, eps, out, &rstd);
  const std::vector<double> xv = values(x), wv = values(w);
  std::vector<double> ref(R * D);
  for (int64_t i = 0; i < R; ++i) {
    double ms = 0;
    for (int64_t j = 0; j < D; ++j) ms += xv[i * D + j] * xv[i * D + j] / D;
    for (int64_t j = 0; j < D; ++j) ref[i * D + j] = wv[j] * xv[i * D + j] / std::sqrt(ms + eps);
  }
  EXPECT_LT(rel_err(values(out), ref), 1e-6);
}

void rmsnorm_references(OpCase& c) {
  c.references.push_back({"RmsnormMatchesNaive", rmsnorm_matches_naive});
  const int64_t R = 5, D = 8;
  const float eps = 1e-5f;
  c.grad.inputs = [=] {
    return Tensors{{"x", random_tensor({R, D}, 22)}, {"w", random_tensor({D}, 23)}, {"Rt", random_tensor({R, D}, 24)}};
  };
  c.grad.forward = [=](OpRun& r) { r.be.rmsnorm(r["x"], r["w"], eps, r.output("out", {R, D}, DType::F64), nullptr); };
  c.grad.loss = {{"out", "Rt"}};
  c.grad.backward = [=](OpRun& r) {
    Tensor& rstd = r.output("rstd", {R}, DType::F64);
    r.be.rmsnorm(r["x"], r["w"], eps, r.output("out", {R, D}, DType::F64), &rstd);
    Tensor& dw = r.output("dw", {D}, DType::F64);
    r.be.fill(dw, 0.0f);  // accumulated
    r.be.rmsnorm_backward(r["Rt"], r["x"], r["w"], rstd, r.output("dx", {R, D}, DType::F64), dw);
  };
  c.grad.wrt = {{"x", "dx"}, {"w", "dw"}};
}

RopeParams rope_test_params(int64_t hd) {
  RopeParams rp;
  for (int i = 0; i < hd / 2; ++i) rp.inv_freq.push_back(std::pow(10000.0f, -2.0f * i / hd));
  return rp;
}

void rope_forward_and_inverse(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t T = 6, H = 3, hd = 8;
  const RopeParams rp = rope_test_params(hd);
  const Tensor pos = i32_tensor({0, 1, 5, 17, 300, 4000});
  const Tensor x0 = random_tensor({T, H, hd}, 30);
  // Forward against the HF formula written out.
  Tensor x = be->alloc({T, H, hd}, DType::F64);
  be->copy(x0, x);
  be->rope(x, pos, rp, false);
  const std::vector<double> a = values(x0), y = values(x);
  std::vector<double> ref(a.size());
  const int32_t* p = pos.data<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < hd; ++i) {
        const int64_t f = i % (hd / 2);
        const float ang = static_cast<float>(p[t]) * rp.inv_freq[f];
        const double c = static_cast<float>(std::cos(double(ang))), s = static_cast<float>(std::sin(double(ang)));
        const double* row = a.data() + (t * H + h) * hd;
        const double rot = i < hd / 2 ? -row[i + hd / 2] : row[i - hd / 2];
        ref[(t * H + h) * hd + i] = row[i] * c + rot * s;
      }
  EXPECT_LT(rel_err(y, ref), 1e-12);
  // inverse(forward(x)) == x with attention_scaling 1, up to c^2 + s^2 = 1 with c, s rounded
  // to float (each off by <= 2^-24 relative): |c^2 + s^2 - 1| <= 2^-22.
  be->rope(x, pos, rp, true);
  EXPECT_LT(rel_err(values(x), a), std::ldexp(1.0, -22));
}

void rope_references(OpCase& c) {
  c.references.push_back({"RopeForwardAndInverse", rope_forward_and_inverse});
  // With attention_scaling != 1, inverse is the backward: check it by finite differences.
  const int64_t T = 6, H = 3, hd = 8;
  RopeParams rp = rope_test_params(hd);
  rp.attention_scaling = 1.3f;
  c.grad.inputs = [=] {
    return Tensors{{"x", random_tensor({T, H, hd}, 31)},
                   {"R", random_tensor({T, H, hd}, 32)},
                   {"pos", i32_tensor({0, 1, 5, 17, 300, 4000})}};
  };
  c.grad.forward = [=](OpRun& r) { r.be.rope(r.updated("y", "x"), r["pos"], rp, false); };
  c.grad.loss = {{"y", "R"}};
  c.grad.backward = [=](OpRun& r) { r.be.rope(r.updated("dx", "R"), r["pos"], rp, true); };
  c.grad.wrt = {{"x", "dx"}};
}

void swiglu_matches_naive(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t T = 4, F = 7;
  Tensor g = random_tensor({T, F}, 40, DType::F64, 2.0), u = random_tensor({T, F}, 41);
  Tensor out = be->alloc({T, F}, DType::F64);
  be->swiglu(g, u, out);
  std::vector<double> ref(T * F);
  const std::vector<double> gv = values(g), uv = values(u);
  for (int64_t i = 0; i < T * F; ++i) ref[i] = gv[i] / (1 + std::exp(-gv[i])) * uv[i];
  EXPECT_LT(rel_err(values(out), ref), 1e-14);
}

void swiglu_references(OpCase& c) {
  c.references.push_back({"SwigluMatchesNaive", swiglu_matches_naive});
  const int64_t T = 4, F = 7;
  c.grad.inputs = [=] {
    return Tensors{{"g", random_tensor({T, F}, 40, DType::F64, 2.0)},
                   {"u", random_tensor({T, F}, 41)},
                   {"R", random_tensor({T, F}, 42)}};
  };
  c.grad.forward = [=](OpRun& r) { r.be.swiglu(r["g"], r["u"], r.output("out", {T, F}, DType::F64)); };
  c.grad.loss = {{"out", "R"}};
  c.grad.backward = [=](OpRun& r) {
    r.be.swiglu_backward(r["R"], r["g"], r["u"], r.output("dgate", {T, F}, DType::F64),
                         r.output("dup", {T, F}, DType::F64));
  };
  c.grad.wrt = {{"g", "dgate"}, {"u", "dup"}};
}

// ---- attention -------------------------------------------------------------------------------

void attention_gqa_packed_matches_naive(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t T = 8, Hq = 4, Hkv = 2, hd = 4;
  const std::vector<int32_t> cu = {0, 5, 8};  // two sequences, lengths 5 and 3
  const float scale = 0.5f;
  Tensor q = random_tensor({T, Hq, hd}, 50), k = random_tensor({T, Hkv, hd}, 51), v = random_tensor({T, Hkv, hd}, 52);
  Tensor out = be->alloc({T, Hq, hd}, DType::F64), lse = be->alloc({Hq, T}, DType::F64);
  be->attention(q, k, v, cu, scale, out, lse);
  std::vector<double> ro(T * Hq * hd), rl(Hq * T);
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    naive_attention(values(q), values(k), values(v), cu[b], cu[b + 1], Hq, Hkv, hd, scale, ro, rl, T);
  EXPECT_LT(rel_err(values(out), ro), 1e-13);
  EXPECT_LT(rel_err(values(lse), rl), 1e-13);
}

void attention_references(OpCase& c) {
  c.references.push_back({"AttentionGqaPackedMatchesNaive", attention_gqa_packed_matches_naive});
  const int64_t T = 8, Hq = 4, Hkv = 2, hd = 4;
  const std::vector<int32_t> cu = {0, 5, 8};  // two sequences, lengths 5 and 3
  const float scale = 0.5f;
  c.grad.inputs = [=] {
    return Tensors{{"q", random_tensor({T, Hq, hd}, 50)},
                   {"k", random_tensor({T, Hkv, hd}, 51)},
                   {"v", random_tensor({T, Hkv, hd}, 52)},
                   {"R", random_tensor({T, Hq, hd}, 53)}};
  };
  auto forward = [=](OpRun& r) {
    r.be.attention(r["q"], r["k"], r["v"], cu, scale, r.output("out", {T, Hq, hd}, DType::F64),
                   r.output("lse", {Hq, T}, DType::F64));
  };
  c.grad.forward = forward;
  c.grad.loss = {{"out", "R"}};
  c.grad.backward = [=](OpRun& r) {
    forward(r);
    r.be.attention_backward(r["R"], r["q"], r["k"], r["v"], r.out.at("out"), r.out.at("lse"), cu, scale,
                            r.output("dq", {T, Hq, hd}, DType::F64), r.output("dk", {T, Hkv, hd}, DType::F64),
                            r.output("dv", {T, Hkv, hd}, DType::F64));
  };
  c.grad.wrt = {{"q", "dq"}, {"k", "dk"}, {"v", "dv"}};
}

// ---- token_logprobs --------------------------------------------------------------------------

// log sum_j exp(z_j / temp) over a row of V logits, written out in double (max-shifted).
double naive_lse(const double* z, int64_t V, float temp) {
  double mx = -1e300;
  for (int64_t j = 0; j < V; ++j) mx = std::max(mx, z[j] / temp);
  double s = 0;
  for (int64_t j = 0; j < V; ++j) s += std::exp(z[j] / temp - mx);
  return mx + std::log(s);
}

void token_logprobs_matches_naive_across_chunks(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t T = 5, D = 16, V = 2500;  // more than one vocabulary chunk
  const float temp = 0.7f;
  const Tensor hidden = random_tensor({T, D}, 60, DType::F32), lm = random_tensor({V, D}, 61, DType::F32);
  const Tensor tgt = i32_tensor({3, 2499, 2048, 0, 1000});
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16}) {
    Tensor logp = be->alloc({T}, DType::F32), lse = be->alloc({T}, DType::F32), ent = be->alloc({T}, DType::F32);
    be->token_logprobs(hidden, lm, tgt, temp, {mode, false}, logp, lse, &ent);
    std::vector<double> h = values(hidden), w = values(lm);
    if (mode == LinearMode::BF16) {
      for (double& e : h) e = bf16_round(static_cast<float>(e));
      for (double& e : w) e = bf16_round(static_cast<float>(e));
    }
    const std::vector<double> z = naive_nt(h, w, T, V, D);
    for (int64_t t = 0; t < T; ++t) {
      const double l = naive_lse(z.data() + t * V, V, temp);
      double H = 0;
      for (int64_t j = 0; j < V; ++j) {
        const double lp = z[t * V + j] / temp - l;
        H -= std::exp(lp) * lp;
      }
      EXPECT_NEAR(values(lse)[t], l, 1e-6 * std::fabs(l));
      EXPECT_NEAR(values(logp)[t], z[t * V + tgt.data<int32_t>()[t]] / temp - l, 1e-6 * std::fabs(l));
      EXPECT_NEAR(values(ent)[t], H, 1e-6 * std::fabs(H));
    }
  }
}

void logprob_references(OpCase& c) {
  c.references.push_back({"TokenLogprobsMatchesNaiveAcrossChunks", token_logprobs_matches_naive_across_chunks});
  const int64_t T = 4, D = 12, V = 2100;
  const float temp = 0.8f;
  const LinearSpec spec{LinearMode::FP32, false};
  c.grad.inputs = [=] {
    return Tensors{{"hidden", random_tensor({T, D}, 70)},
                   {"lm", random_tensor({V, D}, 71, DType::F64, 0.5)},
                   {"tgt", i32_tensor({5, 2099, 2050, 17})},
                   {"dlogp", random_tensor({T}, 72)}};
  };
  auto forward = [=](OpRun& r) {
    r.be.token_logprobs(r["hidden"], r["lm"], r["tgt"], temp, spec, r.output("logp", {T}, DType::F64),
                        r.output("lse", {T}, DType::F64), nullptr);
  };
  c.grad.forward = forward;
  c.grad.loss = {{"logp", "dlogp"}};
  c.grad.backward = [=](OpRun& r) {
    forward(r);
    Tensor& dlm = r.output("dlm", {V, D}, DType::F64);
    r.be.fill(dlm, 0.0f);  // accumulated
    r.be.token_logprobs_backward(r["hidden"], r["lm"], r["tgt"], temp, spec, r.out.at("lse"), r["dlogp"],
                                 r.output("dh", {T, D}, DType::F64), &dlm);
  };
  // lm_head: the target rows (large gradients) and a spread of others, in both chunks.
  std::vector<int64_t> which;
  for (int64_t row : {5, 17, 2050, 2099, 0, 700, 2047, 2048})
    for (int64_t col = 0; col < D; ++col) which.push_back(row * D + col);
  c.grad.wrt = {{"hidden", "dh"}, {"lm", "dlm", which}};
}

// ---- logprobs_of_logits ----------------------------------------------------------------------

// The log-softmax of given logits at the targets, written out: lse = log sum_v exp(z_v / temp),
// logp = z_target / temp - lse, in double over F64 logits of three vocabulary chunks (the
// chunked online reduction agrees to double rounding).
void logprobs_of_logits_matches_naive(Backend& cpu) {
  const int64_t R = 4, V = 2 * kConsistentVocabChunk + 808;
  const Tensor logits = random_tensor({R, V}, 62, DType::F64, 4.0);
  const Tensor tgt = i32_tensor({0, static_cast<int32_t>(kConsistentVocabChunk), static_cast<int32_t>(V - 1), 5000});
  const std::vector<double> z = values(logits);
  for (float temp : {0.8f, 1.0f}) {
    Tensor logp = cpu.alloc({R}, DType::F64), lse = cpu.alloc({R}, DType::F64);
    cpu.logprobs_of_logits(logits, tgt, temp, logp, lse);
    for (int64_t t = 0; t < R; ++t) {
      const double l = naive_lse(z.data() + t * V, V, temp);
      EXPECT_NEAR(values(lse)[t], l, 1e-12 * std::fabs(l)) << "row " << t << " temperature " << temp;
      EXPECT_NEAR(values(logp)[t], z[t * V + tgt.data<int32_t>()[t]] / temp - l, 1e-12 * std::fabs(l))
          << "row " << t << " temperature " << temp;
    }
  }
}

void logprobs_of_logits_references(OpCase& c) {
  c.references.push_back({"LogprobsOfLogitsMatchesNaive", logprobs_of_logits_matches_naive});
}

// ---- element-wise, embedding, AdamW ----------------------------------------------------------

void elementwise_ops(Backend& cpu) {
  Backend* const be = &cpu;
  const Tensor a = random_tensor({3, 5}, 1, DType::F32), b = random_tensor({3, 5}, 2, DType::F32);
  Tensor out = be->alloc({3, 5}, DType::F32);
  be->add(a, b, out);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(out.data<float>()[i], a.data<float>()[i] + b.data<float>()[i]);
  be->scale(out, 0.5f);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(out.data<float>()[i], (a.data<float>()[i] + b.data<float>()[i]) * 0.5f);
  double ss = 0;
  for (int i = 0; i < 15; ++i) ss += double(a.data<float>()[i]) * a.data<float>()[i];
  EXPECT_DOUBLE_EQ(be->sum_squares(a), ss);
  EXPECT_TRUE(be->all_finite(a));
  Tensor c = be->alloc({3, 5}, DType::F32);
  be->copy(a, c);
  c.data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(be->all_finite(c));
  be->fill(c, 2.5f);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(c.data<float>()[i], 2.5f);
  // convert F32 -> BF16 -> F32 equals bf16_round; F32 -> F64 -> F32 is exact; F16 rounds.
  Tensor h = be->alloc({3, 5}, DType::BF16), back = be->alloc({3, 5}, DType::F32), d = be->alloc({3, 5}, DType::F64),
         f16 = be->alloc({3, 5}, DType::F16);
  be->convert(a, h);
  be->convert(h, back);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(back.data<float>()[i], bf16_round(a.data<float>()[i]));
  be->convert(a, d);
  be->convert(d, back);
  EXPECT_EQ(values(back), values(a));
  be->convert(a, f16);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(f16.data<uint16_t>()[i], f16_from_float(a.data<float>()[i]));
  EXPECT_THROW(be->copy(a, h), Error);
  Tensor wrong = be->alloc({4, 5}, DType::F32);
  EXPECT_THROW(be->add(a, b, wrong), Error);
}

void memory_references(OpCase& c) { c.references.push_back({"ElementwiseOps", elementwise_ops}); }

void embedding_forward_backward(Backend& cpu) {
  Backend* const be = &cpu;
  const Tensor table = random_tensor({10, 4}, 3, DType::BF16);
  const Tensor ids = i32_tensor({3, 9, 3, 0});
  Tensor out = be->alloc({4, 4}, DType::F32);
  be->embedding(ids, table, out);
  const std::vector<double> tv = values(table), ov = values(out);
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(ov[t * 4 + c], tv[ids.data<int32_t>()[t] * 4 + c]);
  const Tensor dout = random_tensor({4, 4}, 4, DType::F32);
  Tensor dtable = be->alloc({10, 4}, DType::F32);
  be->fill(dtable, 1.0f);
  be->embedding_backward(ids, dout, dtable);
  const std::vector<double> g = values(dout), dt = values(dtable);
  for (int c = 0; c < 4; ++c) {
    EXPECT_FLOAT_EQ(dt[3 * 4 + c], 1.0 + g[0 * 4 + c] + g[2 * 4 + c]);  // id 3 twice
    EXPECT_FLOAT_EQ(dt[9 * 4 + c], 1.0 + g[1 * 4 + c]);
    EXPECT_FLOAT_EQ(dt[5 * 4 + c], 1.0);
  }
  EXPECT_THROW(be->embedding(i32_tensor({10}), table, out), Error);
  Tensor out1 = be->alloc({1, 4}, DType::F32);
  EXPECT_THROW(be->embedding(i32_tensor({-1}), table, out1), Error);
}

void embedding_references(OpCase& c) {
  c.references.push_back({"EmbeddingForwardBackward", embedding_forward_backward});
}

// Adam as usually written: m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t),
// p -= lr (m_hat / (sqrt(v_hat) + eps)) after p *= 1 - lr wd.
void adamw_matches_textbook_form(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t n = 50;
  Tensor p = random_tensor({n}, 5, DType::F32);
  Tensor m = be->alloc({n}, DType::F32), v = be->alloc({n}, DType::F32);
  std::vector<double> rp = values(p), rm(n, 0.0), rv(n, 0.0);
  AdamWParams ap;
  ap.lr = 1e-2f;
  ap.weight_decay = 0.1f;
  for (int step = 1; step <= 3; ++step) {
    const Tensor g = random_tensor({n}, 100 + step, DType::F32);
    ap.step = step;
    be->adamw(p, g, m, v, ap);
    const std::vector<double> gv = values(g);
    for (int64_t i = 0; i < n; ++i) {
      rp[i] *= 1 - double(ap.lr) * ap.weight_decay;
      rm[i] = ap.beta1 * rm[i] + (1 - double(ap.beta1)) * gv[i];
      rv[i] = ap.beta2 * rv[i] + (1 - double(ap.beta2)) * gv[i] * gv[i];
      const double mh = rm[i] / (1 - std::pow(double(ap.beta1), step));
      const double vh = rv[i] / (1 - std::pow(double(ap.beta2), step));
      rp[i] -= ap.lr * mh / (std::sqrt(vh) + ap.eps);
    }
  }
  EXPECT_LT(rel_err(values(p), rp), 1e-6);
  EXPECT_LT(rel_err(values(m), rm), 1e-6);
  EXPECT_LT(rel_err(values(v), rv), 1e-6);
}

void adamw_references(OpCase& c) { c.references.push_back({"AdamwMatchesTextbookForm", adamw_matches_textbook_form}); }

// ---- paged KV cache --------------------------------------------------------------------------

void paged_attention_equals_packed_attention_f32(Backend& cpu) {
  Backend* const be = &cpu;
  PagedSetup s;
  const Tensor q = random_tensor({s.T, s.Hq, s.hd}, 10, DType::F32),
               k = random_tensor({s.T, s.Hkv, s.hd}, 11, DType::F32),
               v = random_tensor({s.T, s.Hkv, s.hd}, 12, DType::F32);
  KvCache cache = be->alloc_kv_cache(2, 6, 4, s.Hkv, s.hd, DType::F32);
  be->kv_write(cache, 1, k, v, s.batch);
  Tensor paged = be->alloc(q.shape(), DType::F32), packed = be->alloc(q.shape(), DType::F32),
         lse = be->alloc({s.Hq, s.T}, DType::F32);
  Tensor paged_lse = be->alloc({s.Hq, s.T}, DType::F32);
  be->attention_paged(cache, 1, q, s.batch, 0.35f, false, paged, &paged_lse);
  be->attention(q, k, v, s.cu, 0.35f, packed, lse);
  EXPECT_LT(rel_err(values(paged), values(packed)), 1e-6);
  // Its lse is attention()'s, so attention_backward takes the paged out and lse (the consistent
  // mode's trainer) and gives attention's gradients.
  EXPECT_LT(rel_err(values(paged_lse), values(lse)), 1e-6);
  {
    const Tensor dout = random_tensor({s.T, s.Hq, s.hd}, 13, DType::F32);
    Tensor dq = be->alloc(q.shape(), DType::F32), dk = be->alloc(k.shape(), DType::F32),
           dv = be->alloc(v.shape(), DType::F32), dq2 = be->alloc(q.shape(), DType::F32),
           dk2 = be->alloc(k.shape(), DType::F32), dv2 = be->alloc(v.shape(), DType::F32);
    be->attention_backward(dout, q, k, v, packed, lse, s.cu, 0.35f, dq, dk, dv);
    be->attention_backward(dout, q, k, v, paged, paged_lse, s.cu, 0.35f, dq2, dk2, dv2);
    EXPECT_LT(rel_err(values(dq2), values(dq)), 1e-5);
    EXPECT_LT(rel_err(values(dk2), values(dk)), 1e-5);
    EXPECT_LT(rel_err(values(dv2), values(dv)), 1e-5);
  }
  // A decode step of sequence 0 at position 6 only (one query) gives the same row.
  PagedBatch one = s.batch;
  one.token_seq = i32_tensor({0});
  one.token_pos = i32_tensor({6});
  one.slots = i32_tensor({s.batch.slots.data<int32_t>()[6]});
  Tensor q6 = q.slice_rows(6, 7), o6 = be->alloc(q6.shape(), DType::F32);
  be->attention_paged(cache, 1, q6, one, 0.35f, false, o6);
  EXPECT_LT(rel_err(values(o6), values(packed.slice_rows(6, 7))), 1e-6);
  // Bad pages and slots are errors.
  PagedBatch bad = s.batch;
  bad.slots = i32_tensor(std::vector<int32_t>(s.T, 24));
  EXPECT_THROW(be->kv_write(cache, 1, k, v, bad), Error);
  EXPECT_THROW(be->kv_write(cache, 2, k, v, s.batch), Error);
}

void e4_m3_kv_write_is_the_formula_and_paged_attention_reads_it(Backend& cpu) {
  Backend* const be = &cpu;
  PagedSetup s;
  const Tensor q = random_tensor({s.T, s.Hq, s.hd}, 20, DType::F32),
               k = random_tensor({s.T, s.Hkv, s.hd}, 21, DType::F32),
               v = random_tensor({s.T, s.Hkv, s.hd}, 22, DType::F32, 3.0);
  KvCache cache = be->alloc_kv_cache(1, 6, 4, s.Hkv, s.hd, DType::E4M3);
  const float ks[2] = {0.01f, 0.007f}, vs[2] = {0.02f, 0.03f};
  for (int h = 0; h < 2; ++h) {
    cache.k_scale.data<float>()[h] = ks[h];
    cache.v_scale.data<float>()[h] = vs[h];
  }
  be->kv_write(cache, 0, k, v, s.batch);
  // Bitwise: code = e4m3_from_float(x / scale); dequantized copies for the packed reference.
  std::vector<float> kd(k.numel()), vd(v.numel());
  for (int64_t t = 0; t < s.T; ++t) {
    const int32_t slot = s.batch.slots.data<int32_t>()[t];
    for (int64_t h = 0; h < s.Hkv; ++h)
      for (int64_t c = 0; c < s.hd; ++c) {
        const int64_t src = (t * s.Hkv + h) * s.hd + c, dst = (slot * s.Hkv + h) * s.hd + c;
        const uint8_t qk = e4m3_from_float(k.data<float>()[src] / ks[h]);
        const uint8_t qv = e4m3_from_float(v.data<float>()[src] / vs[h]);
        ASSERT_EQ(cache.k[0].data<uint8_t>()[dst], qk);
        ASSERT_EQ(cache.v[0].data<uint8_t>()[dst], qv);
        kd[src] = e4m3_to_float(qk) * ks[h];
        vd[src] = e4m3_to_float(qv) * vs[h];
      }
  }
  const Tensor kdt = from_float_vector(kd, k.shape()), vdt = from_float_vector(vd, v.shape());
  Tensor paged = be->alloc(q.shape(), DType::F32), packed = be->alloc(q.shape(), DType::F32),
         lse = be->alloc({s.Hq, s.T}, DType::F32);
  be->attention_paged(cache, 0, q, s.batch, 0.35f, false, paged);
  be->attention(q, kdt, vdt, s.cu, 0.35f, packed, lse);
  EXPECT_LT(rel_err(values(paged), values(packed)), 1e-6);
  // FP8 attention: q quantized per token and head with amax / 448.
  std::vector<float> qd(q.numel());
  for (int64_t r = 0; r < s.T * s.Hq; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < s.hd; ++c) amax = std::max(amax, std::fabs(q.data<float>()[r * s.hd + c]));
    const float sc = amax / 448.0f;
    for (int64_t c = 0; c < s.hd; ++c) qd[r * s.hd + c] = e4m3_round(q.data<float>()[r * s.hd + c] / sc) * sc;
  }
  be->attention_paged(cache, 0, q, s.batch, 0.35f, true, paged);
  be->attention(from_float_vector(qd, q.shape()), kdt, vdt, s.cu, 0.35f, packed, lse);
  EXPECT_LT(rel_err(values(paged), values(packed)), 1e-6);
  // BF16 cache stores bf16_from_float(x).
  KvCache cb = be->alloc_kv_cache(1, 6, 4, s.Hkv, s.hd, DType::BF16);
  be->kv_write(cb, 0, k, v, s.batch);
  const int32_t slot3 = s.batch.slots.data<int32_t>()[3];
  EXPECT_EQ(cb.k[0].data<uint16_t>()[slot3 * s.Hkv * s.hd + 5], bf16_from_float(k.data<float>()[3 * s.Hkv * s.hd + 5]));
}

void paged_references(OpCase& c) {
  c.references.push_back({"PagedAttentionEqualsPackedAttentionF32", paged_attention_equals_packed_attention_f32});
  c.references.push_back(
      {"E4M3KvWriteIsTheFormulaAndPagedAttentionReadsIt", e4_m3_kv_write_is_the_formula_and_paged_attention_reads_it});
}

// ---- sampling --------------------------------------------------------------------------------

void sample_greedy_and_top_k1_are_argmax(Backend& cpu) {
  Backend* const be = &cpu;
  const int64_t B = 4, V = 50;
  const Tensor logits = random_tensor({B, V}, 30, DType::F32, 3.0);
  Tensor tok = be->alloc({B}, DType::I32), lp = be->alloc({B}, DType::F32);
  auto argmax = [&](int64_t b) {
    const float* r = logits.data<float>() + b * V;
    return static_cast<int32_t>(std::max_element(r, r + V) - r);
  };
  be->sample(logits, {0, 0, 0, 0}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0.1f, 0.5f, 0.9f, 0.99f}, tok, lp);
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(tok.data<int32_t>()[b], argmax(b));
  be->sample(logits, {1, 0.7f, 1.5f, 1}, {1, 1, 0.5f, 1}, {1, 1, 1, 1}, {0.0f, 0.5f, 0.9f, 0.999f}, tok, lp);
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(tok.data<int32_t>()[b], argmax(b));
  // logp is the log-prob under softmax(logits / T) before truncation.
  const float* r = logits.data<float>() + 3 * V;
  double z = 0;
  for (int64_t j = 0; j < V; ++j) z += std::exp(double(r[j]));
  EXPECT_NEAR(lp.data<float>()[3], r[argmax(3)] - std::log(z), 1e-5);
  EXPECT_THROW(be->sample(logits, {1, 1, 1, 1}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0, 0, 0, 1.0f}, tok, lp), Error);
}

// Frequencies of many draws against the probabilities: Pearson chi-square with V-1 = 5
// degrees of freedom; P(chi2_5 > 33.4) = 3.2e-6, the bound chosen before running.
void sample_frequencies_follow_softmax(Backend& cpu) {
  Backend* const be = &cpu;
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f, 0.0f};
  const int64_t V = 6, N = 20000;
  const float temp = 0.8f;
  for (int top_k : {0, 3}) {
    // Expected probabilities: softmax(row / temp) restricted to the top_k largest.
    std::vector<double> p(V);
    double z = 0;
    for (int64_t j = 0; j < V; ++j) z += (p[j] = std::exp(row[j] / temp));
    std::vector<float> sorted = row;
    std::sort(sorted.rbegin(), sorted.rend());
    double kept = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (top_k && row[j] < sorted[top_k - 1]) p[j] = 0;
      kept += p[j];
    }
    for (double& e : p) e /= kept;
    std::vector<float> lg;
    for (int64_t i = 0; i < N; ++i) lg.insert(lg.end(), row.begin(), row.end());
    std::mt19937 gen(77 + top_k);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    std::vector<float> u(N);
    for (float& e : u) e = std::min(ud(gen), 0.99999994f);
    Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
    be->sample(from_float_vector(lg, {N, V}), std::vector<float>(N, temp), std::vector<float>(N, 1.0f),
               std::vector<int>(N, top_k), u, tok, lp);
    std::vector<int64_t> count(V, 0);
    for (int64_t i = 0; i < N; ++i) ++count[tok.data<int32_t>()[i]];
    double chi2 = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (p[j] == 0) {
        EXPECT_EQ(count[j], 0) << "token " << j << " is outside the top-" << top_k;
        continue;
      }
      chi2 += (count[j] - N * p[j]) * (count[j] - N * p[j]) / (N * p[j]);
    }
    EXPECT_LT(chi2, 33.4) << "top_k " << top_k;
    // logp of the drawn tokens is that of the untruncated tempered softmax.
    EXPECT_NEAR(lp.data<float>()[0], row[tok.data<int32_t>()[0]] / temp - std::log(z), 1e-5);
  }
}

void sample_top_pkeeps_the_smallest_nucleus(Backend& cpu) {
  Backend* const be = &cpu;
  // Probabilities 0.5, 0.25, 0.15, 0.1 (ids 2, 0, 3, 1).
  const std::vector<float> row = {std::log(0.25f), std::log(0.1f), std::log(0.5f), std::log(0.15f)};
  Tensor tok = be->alloc({1}, DType::I32), lp = be->alloc({1}, DType::F32);
  const Tensor lg = from_float_vector(row, {1, 4});
  auto last_kept = [&](float top_p) {  // a uniform just below 1 draws the last kept token
    be->sample(lg, {1.0f}, {top_p}, {0}, {0.9999f}, tok, lp);
    return tok.data<int32_t>()[0];
  };
  EXPECT_EQ(last_kept(0.3f), 2);  // {0.5}
  EXPECT_EQ(last_kept(0.5f - 1e-3f), 2);
  EXPECT_EQ(last_kept(0.6f), 0);   // {0.5, 0.25}
  EXPECT_EQ(last_kept(0.8f), 3);   // {0.5, 0.25, 0.15}
  EXPECT_EQ(last_kept(0.95f), 1);  // all
  EXPECT_EQ(last_kept(1.0f), 1);
  // Within the nucleus {0.5, 0.25} the draw is by renormalized mass: u < 2/3 gives id 2.
  be->sample(lg, {1.0f}, {0.6f}, {0}, {0.66f}, tok, lp);
  EXPECT_EQ(tok.data<int32_t>()[0], 2);
  be->sample(lg, {1.0f}, {0.6f}, {0}, {0.67f}, tok, lp);
  EXPECT_EQ(tok.data<int32_t>()[0], 0);
  EXPECT_NEAR(lp.data<float>()[0], std::log(0.25), 1e-6);
}

void sample_references(OpCase& c) {
  c.references.push_back({"SampleGreedyAndTopK1AreArgmax", sample_greedy_and_top_k1_are_argmax});
  c.references.push_back({"SampleFrequenciesFollowSoftmax", sample_frequencies_follow_softmax});
  c.references.push_back({"SampleTopPKeepsTheSmallestNucleus", sample_top_pkeeps_the_smallest_nucleus});
}

// The first row of the table that calls `op` (its op string, exactly).
OpCase& first_row(std::vector<OpCase>& t, const std::string& op) {
  for (OpCase& c : t)
    if (c.op == op) return c;
  throw Error("op table: no row '" + op + "' to attach the CPU references to");
}

}  // namespace

void attach_references(std::vector<OpCase>& t) {
  memory_references(first_row(t, "add + scale + sum_squares + all_finite"));
  embedding_references(first_row(t, "embedding + embedding_backward"));
  linear_references(first_row(t, "linear"), first_row(t, "linear_backward"));
  rmsnorm_references(first_row(t, "rmsnorm + rmsnorm_backward"));
  rope_references(first_row(t, "rope"));
  swiglu_references(first_row(t, "swiglu + swiglu_backward"));
  adamw_references(first_row(t, "adamw"));
  attention_references(first_row(t, "attention + attention_backward"));
  logprob_references(first_row(t, "token_logprobs + backward"));
  logprobs_of_logits_references(first_row(t, "logprobs_of_logits + token_logprobs"));
  paged_references(first_row(t, "kv_write + attention_paged"));
  sample_references(first_row(t, "sample"));
}

}  // namespace fp8rl::test
