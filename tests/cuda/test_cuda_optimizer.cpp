// The lean optimizer on the GPU (issue 15) against the CPU reference:
//   AdamW with BF16 moments: bitwise (master weights and both moments; backend/adamw_rule.h is
//   the one rule both compile), to nearest and stochastic, F32 and BF16 gradients, a clipping
//   factor (grad_scale), ragged sizes;
//   AdamW with F32 moments and BF16 gradients: as the F32 kernel (a BF16 gradient is read exactly);
//   BF16 weight gradients (train.grad_dtype: bf16): the F32 op on the widened gradient, rounded
//   once to BF16: bitwise where the op accumulates through an F32 copy (the FP32 and FP8 wgrads,
//   the column sums — rmsnorm dw, bias: per-chunk partials added in order — and the embedding
//   rows, summed in token order after a sort by id: no F32 kernel uses atomics); where a BF16
//   wgrad GEMM adds into the BF16 gradient itself (the linears' BF16 wgrad, the lm_head's chunks:
//   the same FP32 sum plus the old value, rounded once, perhaps summed in another order; split-K
//   partials only in FP32, GemmEngine's preference), within one BF16 ulp plus the FP32
//   summation-order bound of the terms' magnitudes (check_bf16_grad).
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace fp8rl {
namespace {

struct Env {
  std::unique_ptr<Backend> gpu = make_cuda_backend(0);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
};
Env& env() {
  static Env e;
  return e;
}
Backend& G() { return *env().gpu; }
Backend& C() { return *env().cpu; }

Tensor rnd(const Shape& shape, uint32_t seed, DType dtype = DType::F32, float scale = 1.0f, bool square = false) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) {
    x = nd(gen);
    if (square) x *= x;
  }
  return from_float_vector(v, shape, dtype);
}

Tensor dev(const Tensor& h) { return G().to_device(h); }
Tensor host(const Tensor& t) { return t.device() == DeviceKind::CUDA ? G().to_host(t) : t; }

bool bytes_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = host(a), y = host(b);
  return x.dtype() == y.dtype() && x.nbytes() == y.nbytes() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// The number of elements whose bytes differ (for the failure message).
int64_t differing(const Tensor& a, const Tensor& b) {
  const Tensor x = host(a), y = host(b);
  const size_t es = dtype_size(x.dtype());
  int64_t n = 0;
  for (int64_t i = 0; i < x.numel(); ++i)
    n += std::memcmp(static_cast<const char*>(x.raw()) + i * es, static_cast<const char*>(y.raw()) + i * es, es) != 0;
  return n;
}

TEST(CudaOptimizer, AdamwBf16MomentsBitwiseEqualsCpu) {
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(100003)})
    for (bool sr : {false, true})
      for (DType gd : {DType::F32, DType::BF16})
        for (int64_t step : {int64_t(1), int64_t(5), int64_t(1000)}) {
          SCOPED_TRACE(::testing::Message() << "n " << n << " sr " << sr << " grad " << dtype_name(gd) << " step " << step);
          AdamWParams p;
          p.lr = 1e-3f;
          p.weight_decay = 0.01f;
          p.step = step;
          p.grad_scale = step == 5 ? 0.37f : 1.0f;
          p.stochastic_rounding = sr;
          p.rounding_key = 0x6f7074696d000000ull + uint64_t(n);
          const uint32_t s = static_cast<uint32_t>(n + step);
          Tensor w = rnd({n}, s, DType::F32), g = rnd({n}, s + 1, gd, 0.1f);
          Tensor m = rnd({n}, s + 2, DType::BF16, 0.05f), v = rnd({n}, s + 3, DType::BF16, 0.05f, /*square=*/true);
          Tensor gw = dev(w), gm = dev(m), gv = dev(v);
          C().adamw(w, g, m, v, p);
          G().adamw(gw, dev(g), gm, gv, p);
          EXPECT_TRUE(bytes_equal(gw, w)) << differing(gw, w) << " master weights differ";
          EXPECT_TRUE(bytes_equal(gm, m)) << differing(gm, m) << " exp_avg differ";
          EXPECT_TRUE(bytes_equal(gv, v)) << differing(gv, v) << " exp_avg_sq differ";
        }
}

TEST(CudaOptimizer, AdamwF32MomentsTakeBf16GradientsExactly) {
  const int64_t n = 5000;
  AdamWParams p;
  p.lr = 1e-2f;
  p.step = 3;
  const Tensor g16 = rnd({n}, 1, DType::BF16, 0.1f), g32 = from_float_vector(to_float_vector(g16), {n});
  const Tensor w = rnd({n}, 2), m = rnd({n}, 3, DType::F32, 0.1f), v = rnd({n}, 4, DType::F32, 0.1f, true);
  Tensor a = dev(w), am = dev(m), av = dev(v), b = dev(w), bm = dev(m), bv = dev(v);
  G().adamw(a, dev(g16), am, av, p);
  G().adamw(b, dev(g32), bm, bv, p);
  EXPECT_TRUE(bytes_equal(a, b) && bytes_equal(am, bm) && bytes_equal(av, bv));
}

// One BF16 ulp at |v| (the spacing of BF16 values of v's binade; the smallest normal's below it).
double bf16_ulp(double v) {
  int e = 0;
  std::frexp(std::max(std::fabs(v), 0x1p-126), &e);  // |v| = f 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - 8);
}

// Sum over t of |a[t, i]| |b[t, j]| for A [M, I], B [M, J] (host values as double): the scale of
// a GEMM's dW[i, j] = sum_t a[t, i] b[t, j] against which its summation order is bounded.
std::vector<double> abs_products(const std::vector<float>& a, const std::vector<float>& b, int64_t M, int64_t I,
                                 int64_t J) {
  std::vector<double> out(static_cast<size_t>(I * J), 0.0);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double ai = std::fabs(a[t * I + i]);
      if (ai == 0.0) continue;
      double* row = out.data() + i * J;
      for (int64_t j = 0; j < J; ++j) row[j] += ai * std::fabs(b[t * J + j]);
    }
  return out;
}

// An op into a BF16 gradient == the op into the F32 widening of it, then rounded (both on the GPU).
// Without `sum_abs`: bitwise. With it (a BF16 GEMM of `depth` terms per element adding into the BF16
// gradient itself, beta = 1): cuBLASLt's BF16-output epilogue rounds the FP32 product P to BF16
// before it adds the old value g0 (session 35, H100: the head case's direct results are
// bf16(bf16(P) + g0), up to 2 BF16 ulps of the result and once 0 against 5.8e-5 from
// bf16(P + g0), where only the summation order separates the two P; the one-pass algorithms
// without split-K gave the same bits), as PyTorch's BF16 .grad accumulation rounds each
// micro-batch's gradient before the add. So element i may differ from the F32 copy's by one BF16
// ulp of the larger, half a BF16 ulp of |P| (P from the F32 copy: its result minus g0), and twice
// the FP32 summation-order bound depth 2^-24 sum_abs[i] (sum_abs: the sum of the terms'
// magnitudes). A bound, not a count of ulps: near a cancelling sum's zero the ulps are tiny.
// Printed besides: how many elements are exactly either rounding model's value.
void check_bf16_grad(const char* what, const Tensor& start, const std::function<void(Tensor&)>& op,
                     const std::vector<double>* sum_abs = nullptr, int64_t depth = 0,
                     const std::vector<double>* exact_sum = nullptr) {
  SCOPED_TRACE(what);
  Tensor g16 = dev(from_float_vector(to_float_vector(start), start.shape(), DType::BF16));
  Tensor g32 = G().alloc(start.shape(), DType::F32);
  G().convert(g16, g32);
  op(g16);
  op(g32);
  Tensor want = G().alloc(start.shape(), DType::BF16);
  G().convert(g32, want);
  if (!sum_abs) {
    EXPECT_TRUE(bytes_equal(g16, want)) << differing(g16, want) << " elements differ";
    return;
  }
  const std::vector<float> a = to_float_vector(host(g16)), b = to_float_vector(host(want));
  const std::vector<float> c32 = to_float_vector(host(g32));  // P + g0 in FP32 (the F32 copy)
  ASSERT_EQ(sum_abs->size(), a.size());
  const std::vector<float> g0 = to_float_vector(from_float_vector(to_float_vector(start), start.shape(), DType::BF16));
  auto bf16 = [](double v) { return double(bf16_round(static_cast<float>(v))); };  // via FP32, as the GPU
  int64_t bad = 0, worst = -1, once = 0, twice = 0;
  double worst_ratio = 0.0;
  std::set<int64_t> bad_rows, bad_cols;  // where the failures lie (a tile of the GEMM's output?)
  const int64_t cols = start.dim(start.ndim() - 1);
  for (size_t i = 0; i < a.size(); ++i) {
    const double p = double(c32[i]) - double(g0[i]);  // the product, up to one FP32 rounding
    once += double(a[i]) == bf16(double(c32[i]));
    twice += double(a[i]) == bf16(bf16(p) + double(g0[i]));
    const double d = std::fabs(double(a[i]) - double(b[i]));
    const double bound = bf16_ulp(std::max(std::fabs(double(a[i])), std::fabs(double(b[i])))) +
                         0.5 * bf16_ulp(std::fabs(p) * (1.0 + 0x1p-20)) +
                         2.0 * double(depth) * 0x1p-24 * (*sum_abs)[i];
    if (d / bound > worst_ratio) worst_ratio = d / bound, worst = static_cast<int64_t>(i);
    if (d <= bound) continue;
    const int64_t row = static_cast<int64_t>(i) / cols, col = static_cast<int64_t>(i) % cols;
    bad_rows.insert(row), bad_cols.insert(col);
    if (++bad <= 8)  // the first few, against the host's double sum when given
      std::printf("  past the bound at %zu (row %lld, column %lld): start %.8g, direct BF16 %.8g, through F32 %.8g, "
                  "host double %.8g\n",
                  i, static_cast<long long>(row), static_cast<long long>(col), g0[i], a[i], b[i],
                  exact_sum ? g0[i] + (*exact_sum)[i] : NAN);
  }
  std::printf("  %s: %lld of %zu elements are bf16(P + g0), %lld bf16(bf16(P) + g0)\n", what,
              static_cast<long long>(once), a.size(), static_cast<long long>(twice));
  if (bad)
    std::printf("  %lld elements past the bound in rows %lld .. %lld (%zu rows), columns %lld .. %lld (%zu)\n",
                static_cast<long long>(bad), static_cast<long long>(*bad_rows.begin()),
                static_cast<long long>(*bad_rows.rbegin()), bad_rows.size(), static_cast<long long>(*bad_cols.begin()),
                static_cast<long long>(*bad_cols.rbegin()), bad_cols.size());
  EXPECT_EQ(bad, 0) << "elements past the bound; worst at " << worst << ": " << a[worst] << " vs " << b[worst]
                    << " (sum of |terms| " << (*sum_abs)[worst] << ", " << worst_ratio << " x the bound)";
}

TEST(CudaOptimizer, Bf16GradientsAccumulateThroughF32Once) {
  const int64_t M = 200, N = 256, K = 384;
  const Tensor x = dev(rnd({M, K}, 11, DType::BF16)), dy = dev(rnd({M, N}, 12, DType::BF16));
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK}) {
    LinearWeight W;
    W.w = dev(rnd({N, K}, 13, DType::F32, 0.05f));
    LinearSpec spec;
    spec.mode = mode;
    const Tensor xa = mode == LinearMode::FP32 ? dev(rnd({M, K}, 11)) : x;
    const Tensor dya = mode == LinearMode::FP32 ? dev(rnd({M, N}, 12)) : dy;
    // The BF16 wgrad (BF16 mode, and fp8_e2e's BF16 wgrad of FP8 linears) adds into the BF16 gradient:
    // its FP32 sum plus the old value rounded once, the GEMM's summation order possibly another than
    // for an F32 output: one BF16 ulp. The FP32 and FP8 wgrads go through the F32 copy: bitwise.
    const bool direct = mode == LinearMode::BF16;
    const std::vector<double> sabs = abs_products(to_float_vector(host(dy)), to_float_vector(host(x)), M, N, K);
    check_bf16_grad(
        linear_mode_name(mode), rnd({N, K}, 14, DType::F32, 0.01f),
        [&](Tensor& dw) { G().linear_backward(dya, xa, W, spec, nullptr, &dw, nullptr); }, direct ? &sabs : nullptr,
        M);
    if (mode == LinearMode::FP8_BLOCK) {  // the recipe's BF16 wgrad of an FP8 linear: direct too
      LinearSpec bw = spec;
      bw.wgrad = LinearMode::BF16;
      check_bf16_grad(
          "fp8 with BF16 wgrad", rnd({N, K}, 14, DType::F32, 0.01f),
          [&](Tensor& dw) { G().linear_backward(dya, xa, W, bw, nullptr, &dw, nullptr); }, &sabs, M);
    }
    check_bf16_grad("linear dbias", rnd({N}, 15, DType::F32, 0.01f),
                    [&](Tensor& db) { G().linear_backward(dya, xa, W, spec, nullptr, nullptr, &db); });
  }
  {  // a long token sum into a small gradient (where cuBLASLt may split K): still one ulp
    const int64_t Ml = 8192, Nl = 128, Kl = 128;
    LinearWeight W;
    W.w = dev(rnd({Nl, Kl}, 31, DType::F32, 0.05f));
    LinearSpec spec;
    spec.mode = LinearMode::BF16;
    const Tensor xl = dev(rnd({Ml, Kl}, 32, DType::BF16)), dyl = dev(rnd({Ml, Nl}, 33, DType::BF16));
    const std::vector<double> sabs = abs_products(to_float_vector(host(dyl)), to_float_vector(host(xl)), Ml, Nl, Kl);
    check_bf16_grad(
        "bf16 wgrad, 8192 tokens into 128 x 128", rnd({Nl, Kl}, 34, DType::F32, 0.01f),
        [&](Tensor& dw) { G().linear_backward(dyl, xl, W, spec, nullptr, &dw, nullptr); }, &sabs, Ml);
  }
  const Tensor w = dev(rnd({K}, 16)), rstd = dev(rnd({M}, 17, DType::F32, 1.0f, true));
  const Tensor dout = dev(rnd({M, K}, 19, DType::BF16));
  check_bf16_grad("rmsnorm dw", rnd({K}, 18, DType::F32, 0.01f), [&](Tensor& dw) {
    Tensor dx = G().alloc({M, K}, DType::BF16);
    G().rmsnorm_backward(dout, x, w, rstd, dx, dw);
  });
  std::vector<int32_t> ids(M);
  for (int64_t t = 0; t < M; ++t) ids[t] = static_cast<int32_t>((t * 7) % 50);  // repeated rows
  Tensor hid = Tensor::empty({M}, DType::I32);
  std::memcpy(hid.raw(), ids.data(), ids.size() * 4);
  const Tensor gid = dev(hid);
  const Tensor demb = dev(rnd({M, K}, 21, DType::BF16));
  check_bf16_grad("embedding dtable", rnd({64, K}, 20, DType::F32, 0.01f),
                  [&](Tensor& dt) { G().embedding_backward(gid, demb, dt); });
  // The lm_head's gradient (tied: the embedding's), chunk by chunk through linear_backward.
  const int64_t V = 1000;
  const Tensor lm = dev(rnd({V, K}, 22, DType::F32, 0.05f));
  std::vector<int32_t> tg(M);
  for (int64_t t = 0; t < M; ++t) tg[t] = static_cast<int32_t>((t * 13) % V);
  Tensor htg = Tensor::empty({M}, DType::I32);
  std::memcpy(htg.raw(), tg.data(), tg.size() * 4);
  const Tensor targets = dev(htg), dlogp = dev(rnd({M}, 23));
  LinearSpec spec;
  spec.mode = LinearMode::BF16;
  Tensor logp = G().alloc({M}, DType::F32), lse2 = G().alloc({M}, DType::F32);
  G().token_logprobs(x, lm, targets, 1.0f, spec, logp, lse2, nullptr);
  // The terms of dlm_head[v, k] are dlogits[t, v] x[t, k], dlogits[t, v] = dlogp[t] (onehot -
  // softmax): their magnitudes from a host softmax over the BF16-rounded operands.
  std::vector<double> sabs, exact(static_cast<size_t>(V * K), 0.0);
  {
    const std::vector<float> xs = to_float_vector(host(x)), dl = to_float_vector(host(dlogp));
    const std::vector<float> lw = to_float_vector(from_float_vector(to_float_vector(host(lm)), {V, K}, DType::BF16));
    std::vector<float> adl(static_cast<size_t>(M * V)), sdl(static_cast<size_t>(M * V));
    std::vector<double> z(static_cast<size_t>(V));
    for (int64_t t = 0; t < M; ++t) {
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k) acc += double(xs[t * K + k]) * double(lw[v * K + k]);
        z[v] = acc, mx = std::max(mx, acc);
      }
      double se = 0.0;
      for (int64_t v = 0; v < V; ++v) se += std::exp(z[v] - mx);
      for (int64_t v = 0; v < V; ++v) {
        const double p = std::exp(z[v] - mx) / se, onehot = v == tg[t] ? 1.0 : 0.0;
        adl[t * V + v] = static_cast<float>(std::fabs(dl[t]) * (onehot + p));
        sdl[t * V + v] = static_cast<float>(double(dl[t]) * (onehot - p));
      }
    }
    sabs = abs_products(adl, xs, M, V, K);
    for (int64_t t = 0; t < M; ++t)  // the signed sum, for the diagnostics
      for (int64_t v = 0; v < V; ++v)
        for (int64_t k = 0; k < K; ++k) exact[v * K + k] += double(sdl[t * V + v]) * double(xs[t * K + k]);
  }
  // An F32 head (the general path, chunk by chunk), then a BF16 one (every recipe's: the fused
  // backward's BF16-gradient path).
  const Tensor lm16 = dev(from_float_vector(to_float_vector(host(lm)), {V, K}, DType::BF16));
  for (const auto& [what, head] : {std::pair<const char*, const Tensor*>{"token_logprobs dlm_head", &lm},
                                   {"token_logprobs dlm_head, BF16 head (fused path)", &lm16}})
    check_bf16_grad(
        what, rnd({V, K}, 24, DType::F32, 0.01f),
        [&](Tensor& dl) {
          Tensor dh = G().alloc({M, K}, DType::BF16);
          G().token_logprobs_backward(x, *head, targets, 1.0f, spec, lse2, dlogp, dh, &dl);
        },
        &sabs, M, &exact);
}

}  // namespace
}  // namespace fp8rl
