// CPU backend: model ops against naive references, backward ops against FP64 finite
// differences, FP8 linear against its error bound and against an explicit composition.
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "test_cpu_ops_util.h"

namespace fp8rl {
namespace {

using test::dot_loss;
using test::expect_grad;
using test::i32_tensor;
using test::random_tensor;
using test::rel_err;
using test::values;

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

class CpuOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
};

// ---- linear ----------------------------------------------------------------------------------

TEST_F(CpuOps, LinearFp32MatchesNaive) {
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

TEST_F(CpuOps, LinearBf16RoundsOperands) {
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

TEST_F(CpuOps, LinearFp32BackwardMatchesFiniteDifferences) {
  const int64_t M = 4, N = 5, K = 6;
  Tensor x = random_tensor({M, K}, 6);
  LinearWeight W;
  W.w = random_tensor({N, K}, 7);
  W.bias = random_tensor({N}, 8);
  const Tensor R = random_tensor({M, N}, 9);
  const LinearSpec spec{LinearMode::FP32, false};
  Tensor out = be->alloc({M, N}, DType::F64);
  auto loss = [&] {
    be->linear(x, W, spec, out);
    return dot_loss(out, R);
  };
  Tensor dx = be->alloc({M, K}, DType::F64), dw = be->alloc({N, K}, DType::F64), db = be->alloc({N}, DType::F64);
  be->fill(dw, 0.5f);  // accumulated: the check subtracts this
  be->linear_backward(R, x, W, spec, &dx, &dw, &db);
  std::vector<double> gw = values(dw);
  for (double& e : gw) e -= 0.5;
  expect_grad(x, values(dx), loss, "dx");
  expect_grad(W.w, gw, loss, "dw");
  expect_grad(W.bias, values(db), loss, "dbias");
}

// Worst-case bound of one dequantized operand element: E4M3 keeps 3 mantissa bits, so the
// rounding of v = x / s is at most half an ulp = 2^-4 |v| in the normal range and 2^-10 in the
// subnormal range (|v| < 2^-6); the float roundings of x / s and q * s add 2^-24 each.
double operand_bound(double x, double s) {
  return std::max(std::ldexp(std::fabs(x), -4), std::ldexp(s, -10)) * (1 + 1e-6) + std::ldexp(std::fabs(x), -22);
}

TEST_F(CpuOps, LinearFp8ForwardWithinE4M3Bound) {
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

TEST_F(CpuOps, LinearFp8UsesWqWhenGiven) {
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

TEST_F(CpuOps, LinearFp8BackwardUsesWqWhenGiven) {
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

TEST_F(CpuOps, LinearFp8BackwardIsQuantizeDequantizeComposition) {
  const int64_t M = 200, N = 136, K = 260;
  const Tensor x = random_tensor({M, K}, 15, DType::F32);
  const Tensor dy = random_tensor({M, N}, 16, DType::F32, 1e-3);
  LinearWeight W;
  W.w = random_tensor({N, K}, 17, DType::F32, 0.05);
  Tensor dx = be->alloc({M, K}, DType::F32), dw = be->alloc({N, K}, DType::F32);
  be->linear_backward(dy, x, W, {LinearMode::FP8_BLOCK, false}, &dx, &dw, nullptr);
  // dgrad: dY 1x128 along N times W's 128x128 quantization transposed.
  const std::vector<double> a = values(dequantize(quantize_1x128(dy, false)));                          // [M, N]
  const std::vector<double> b = values(dequantize(transpose_128x128(quantize_128x128(W.w, false))));    // [K, N]
  EXPECT_LT(rel_err(values(dx), naive_nt(a, b, M, K, N)), 1e-6);
  // wgrad: dY^T and X^T, both 1x128 along tokens.
  const std::vector<double> c = values(dequantize(quantize_1x128_tokens(dy, false)));  // [N, M]
  const std::vector<double> d = values(dequantize(quantize_1x128_tokens(x, false)));   // [K, M]
  EXPECT_LT(rel_err(values(dw), naive_nt(c, d, N, K, M)), 1e-6);
  // Not the unquantized product.
  EXPECT_GT(rel_err(values(dx), naive_nt(values(dy), transposed(values(W.w), N, K), M, K, N)), 1e-4);
}

// ---- RMSNorm, RoPE, SwiGLU -------------------------------------------------------------------

TEST_F(CpuOps, RmsnormMatchesNaiveAndFiniteDifferences) {
  const int64_t R = 5, D = 8;
  const float eps = 1e-5f;
  {
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
  Tensor x = random_tensor({R, D}, 22), w = random_tensor({D}, 23);
  const Tensor Rt = random_tensor({R, D}, 24);
  Tensor out = be->alloc({R, D}, DType::F64), rstd = be->alloc({R}, DType::F64);
  auto loss = [&] {
    be->rmsnorm(x, w, eps, out, nullptr);
    return dot_loss(out, Rt);
  };
  be->rmsnorm(x, w, eps, out, &rstd);
  Tensor dx = be->alloc({R, D}, DType::F64), dw = be->alloc({D}, DType::F64);
  be->rmsnorm_backward(Rt, x, w, rstd, dx, dw);
  expect_grad(x, values(dx), loss, "rmsnorm dx");
  expect_grad(w, values(dw), loss, "rmsnorm dw");
}

TEST_F(CpuOps, RopeForwardInverseAndBackward) {
  const int64_t T = 6, H = 3, hd = 8;
  RopeParams rp;
  for (int i = 0; i < hd / 2; ++i) rp.inv_freq.push_back(std::pow(10000.0f, -2.0f * i / hd));
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
  // With attention_scaling != 1, inverse is the backward: check it by finite differences.
  rp.attention_scaling = 1.3f;
  Tensor xi = random_tensor({T, H, hd}, 31);
  const Tensor R = random_tensor({T, H, hd}, 32);
  Tensor tmp = be->alloc({T, H, hd}, DType::F64);
  auto loss = [&] {
    be->copy(xi, tmp);
    be->rope(tmp, pos, rp, false);
    return dot_loss(tmp, R);
  };
  Tensor g = be->alloc({T, H, hd}, DType::F64);
  be->copy(R, g);
  be->rope(g, pos, rp, true);
  expect_grad(xi, values(g), loss, "rope backward");
}

TEST_F(CpuOps, SwigluMatchesNaiveAndFiniteDifferences) {
  const int64_t T = 4, F = 7;
  Tensor g = random_tensor({T, F}, 40, DType::F64, 2.0), u = random_tensor({T, F}, 41);
  Tensor out = be->alloc({T, F}, DType::F64);
  be->swiglu(g, u, out);
  std::vector<double> ref(T * F);
  const std::vector<double> gv = values(g), uv = values(u);
  for (int64_t i = 0; i < T * F; ++i) ref[i] = gv[i] / (1 + std::exp(-gv[i])) * uv[i];
  EXPECT_LT(rel_err(values(out), ref), 1e-14);
  const Tensor R = random_tensor({T, F}, 42);
  auto loss = [&] {
    be->swiglu(g, u, out);
    return dot_loss(out, R);
  };
  Tensor dg = be->alloc({T, F}, DType::F64), du = be->alloc({T, F}, DType::F64);
  be->swiglu_backward(R, g, u, dg, du);
  expect_grad(g, values(dg), loss, "swiglu dgate");
  expect_grad(u, values(du), loss, "swiglu dup");
}

// ---- attention -------------------------------------------------------------------------------

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

TEST_F(CpuOps, AttentionGqaPackedMatchesNaiveAndFiniteDifferences) {
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

  const Tensor R = random_tensor({T, Hq, hd}, 53);
  Tensor o2 = be->alloc({T, Hq, hd}, DType::F64), l2 = be->alloc({Hq, T}, DType::F64);
  auto loss = [&] {
    be->attention(q, k, v, cu, scale, o2, l2);
    return dot_loss(o2, R);
  };
  Tensor dq = be->alloc({T, Hq, hd}, DType::F64), dk = be->alloc({T, Hkv, hd}, DType::F64),
         dv = be->alloc({T, Hkv, hd}, DType::F64);
  be->attention_backward(R, q, k, v, out, lse, cu, scale, dq, dk, dv);
  expect_grad(q, values(dq), loss, "attention dq");
  expect_grad(k, values(dk), loss, "attention dk");
  expect_grad(v, values(dv), loss, "attention dv");
}

TEST_F(CpuOps, AttentionRejectsBadSeqlens) {
  const Tensor q = random_tensor({4, 2, 4}, 1), k = random_tensor({4, 1, 4}, 2);
  Tensor out = be->alloc({4, 2, 4}, DType::F64), lse = be->alloc({2, 4}, DType::F64);
  EXPECT_THROW(be->attention(q, k, k, {0, 3}, 1.0f, out, lse), Error);
  EXPECT_THROW(be->attention(q, k, k, {0, 3, 2, 4}, 1.0f, out, lse), Error);
  const Tensor k3 = random_tensor({4, 3, 4}, 2);
  EXPECT_THROW(be->attention(q, k3, k3, {0, 4}, 1.0f, out, lse), Error);
}

// ---- token_logprobs --------------------------------------------------------------------------

TEST_F(CpuOps, TokenLogprobsMatchesNaiveAcrossChunks) {
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
      double mx = -1e300;
      for (int64_t j = 0; j < V; ++j) mx = std::max(mx, z[t * V + j] / temp);
      double s = 0;
      for (int64_t j = 0; j < V; ++j) s += std::exp(z[t * V + j] / temp - mx);
      const double l = mx + std::log(s);
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

TEST_F(CpuOps, TokenLogprobsBackwardMatchesFiniteDifferences) {
  const int64_t T = 4, D = 12, V = 2100;
  const float temp = 0.8f;
  Tensor hidden = random_tensor({T, D}, 70), lm = random_tensor({V, D}, 71, DType::F64, 0.5);
  const Tensor tgt = i32_tensor({5, 2099, 2050, 17});
  const Tensor dlogp = random_tensor({T}, 72);
  const LinearSpec spec{LinearMode::FP32, false};
  Tensor logp = be->alloc({T}, DType::F64), lse = be->alloc({T}, DType::F64);
  auto loss = [&] {
    be->token_logprobs(hidden, lm, tgt, temp, spec, logp, lse, nullptr);
    return dot_loss(logp, dlogp);
  };
  loss();
  Tensor dh = be->alloc({T, D}, DType::F64), dlm = be->alloc({V, D}, DType::F64);
  be->token_logprobs_backward(hidden, lm, tgt, temp, spec, lse, dlogp, dh, &dlm);
  expect_grad(hidden, values(dh), loss, "token_logprobs dhidden");
  // lm_head: the target rows (large gradients) and a spread of others, in both chunks.
  std::vector<int64_t> which;
  for (int64_t row : {5, 17, 2050, 2099, 0, 700, 2047, 2048})
    for (int64_t c = 0; c < D; ++c) which.push_back(row * D + c);
  expect_grad(lm, values(dlm), loss, "token_logprobs dlm_head", which);
}

TEST_F(CpuOps, TokenLogprobsRejectsBadTargets) {
  const Tensor hidden = random_tensor({2, 4}, 1), lm = random_tensor({10, 4}, 2);
  Tensor logp = be->alloc({2}, DType::F64), lse = be->alloc({2}, DType::F64);
  EXPECT_THROW(be->token_logprobs(hidden, lm, i32_tensor({1, 10}), 1.0f, {}, logp, lse, nullptr), Error);
  EXPECT_THROW(be->token_logprobs(hidden, lm, i32_tensor({1, -1}), 1.0f, {}, logp, lse, nullptr), Error);
  EXPECT_THROW(be->token_logprobs(hidden, lm, i32_tensor({1, 2}), 0.0f, {}, logp, lse, nullptr), Error);
}

}  // namespace
}  // namespace fp8rl
