// The fused producers of FP8 linear inputs (rmsnorm_fp8, add_rmsnorm, swiglu_fp8; backend.h,
// Fp8View) and of the FP8 dgrads' dY (add_fp8, swiglu_backward_fp8) on the GPU, bitwise:
//   - against the GPU's unfused ops (rmsnorm / add / swiglu, then quantize): output, rstd, codes
//     and scales (the FP8 recipe's values are those of before the fusion);
//   - the codes and scales against the CPU reference quantizer applied to the GPU's own output;
//   - the output against the CPU op within the usual tolerance (F32 1e-5, BF16 1e-2);
//   - linears given the view (cuBLASLt-layout or row-major scales, tensor cores or the
//     dequantize path) against the same linears without it; the dgrad given dy's view and the
//     cached W^T (LinearWeight::wqt) against the dgrad that quantizes and transposes itself.
// And the BF16 wgrad of FP8 linears against the CPU reference. Widths cover partial last
// blocks (D % 128 != 0), a single block, and D % 8 != 0 (the unfused fallback); rows cover
// R % 16 == 0 (scales in cuBLASLt's layout) and ragged counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../cpu/test_model_util.h"
#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "quant/quant.h"
#include "support/recompute_util.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

struct Env {
  std::unique_ptr<Backend> gpu = make_cuda_backend(0);                 // BF16 activations
  std::unique_ptr<Backend> exact = make_cuda_backend(0, DType::F32);   // the exact path
  std::unique_ptr<Backend> cpu = make_cpu_backend();
};
Env& env() {
  static Env e;
  return e;
}
Backend& G() { return *env().gpu; }
Backend& C() { return *env().cpu; }

Tensor rnd(const Shape& shape, uint32_t seed, DType dtype = DType::F32, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) x = nd(gen);
  return from_float_vector(v, shape, dtype);
}

Tensor poisoned(Backend& be, const Shape& s, DType d) {
  Tensor t = be.alloc(s, d);
  if (d == DType::E4M3) return t;
  be.fill(t, NAN);
  return t;
}

std::vector<uint8_t> bytes(Backend& be, const Tensor& t) {
  const Tensor h = t.device() == DeviceKind::CUDA ? be.to_host(t) : t;
  const uint8_t* p = static_cast<const uint8_t*>(h.raw());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

// The view's scales as the row-major [R][nb] grid, whatever its layout.
std::vector<float> row_major_scales(Backend& be, const Fp8View& v) {
  const Tensor s = be.to_host(v.q.scales);
  const int64_t R = v.q.rows(), nb = (v.q.cols() + 127) / 128;
  std::vector<float> out(R * nb);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b)
      out[r * nb + b] = s.data<float>()[v.scales_gemm_layout ? b * R + r : r * nb + b];
  return out;
}

std::vector<float> floats(const Tensor& t) { return std::vector<float>(t.data<float>(), t.data<float>() + t.numel()); }

// max |a - b| / max |b| (NaN anywhere -> infinity) of a device tensor against a host one.
double rel_err(Backend& be, const Tensor& a, const Tensor& b) { return test::rel_err(be.to_host(a), b); }

// The view equals, bitwise: the GPU's unfused quantization `ref` (row-major scales) and the CPU
// reference quantizer applied to the GPU's output `out`.
void expect_view_bitwise(Backend& be, const Fp8View& v, const Tensor& out, const QuantTensor& ref, bool pow2,
                         const std::string& what) {
  ASSERT_TRUE(v.defined()) << what;
  EXPECT_EQ(v.source, out.raw()) << what;
  EXPECT_EQ(bytes(be, v.q.data), bytes(be, ref.data)) << what << ": codes differ from the unfused GPU quantizer";
  EXPECT_EQ(row_major_scales(be, v), floats(be.to_host(ref.scales))) << what << ": scales differ from the unfused GPU quantizer";
  const int64_t D = out.dim(-1);
  const Tensor oh = be.to_host(out);
  const QuantTensor cref = quantize_1x128(oh.reshape({oh.numel() / D, D}), pow2);
  EXPECT_EQ(bytes(be, v.q.data), bytes(be, cref.data)) << what << ": codes differ from the CPU quantizer";
  EXPECT_EQ(row_major_scales(be, v), floats(cref.scales)) << what << ": scales differ from the CPU quantizer";
}

struct Shape2 {
  int64_t R, D;
};
const Shape2 kShapes[] = {{1, 2048}, {16, 2048}, {131, 320}, {64, 200}, {48, 128}, {16, 72}, {7, 100}, {32, 4096}};

TEST(CudaFused, RmsnormFp8IsRmsnormThenQuantizeBitwise) {
  uint32_t seed = 100;
  for (Backend* be : {&G(), env().exact.get()})
    for (const Shape2& s : kShapes)
      for (DType dt : {DType::BF16, DType::F32})
        for (DType wdt : {DType::F32, DType::BF16})
          for (bool pow2 : {false, true}) {
            const std::string what = be->name() + " act " + dtype_name(be->act_dtype()) + " " + std::to_string(s.R) +
                                     "x" + std::to_string(s.D) + " " + dtype_name(dt) + " w " + dtype_name(wdt) +
                                     (pow2 ? " pow2" : "");
            SCOPED_TRACE(what);
            const Tensor xh = rnd({s.R, s.D}, seed++, dt, 4.0f), wh = rnd({s.D}, seed++, wdt);
            const Tensor x = be->to_device(xh), w = be->to_device(wh);
            Tensor out = poisoned(*be, {s.R, s.D}, dt), rstd = poisoned(*be, {s.R}, DType::F32);
            Fp8View v = be->alloc_fp8_view(s.R, s.D, pow2);
            be->rmsnorm_fp8(x, w, 1e-6f, out, &rstd, v);
            // The unfused GPU ops.
            Tensor out_ref = poisoned(*be, {s.R, s.D}, dt), rstd_ref = poisoned(*be, {s.R}, DType::F32);
            be->rmsnorm(x, w, 1e-6f, out_ref, &rstd_ref);
            QuantTensor ref = be->alloc_quant(s.R, s.D, 1, 128, pow2);
            be->quantize(out_ref, false, ref);
            EXPECT_EQ(bytes(*be, out), bytes(*be, out_ref));
            EXPECT_EQ(bytes(*be, rstd), bytes(*be, rstd_ref));
            expect_view_bitwise(*be, v, out, ref, pow2, what);
            const bool laid = be->act_dtype() == DType::BF16 && s.R % 16 == 0 && s.D % 128 == 0;
            EXPECT_EQ(v.scales_gemm_layout, laid);
            // Against the CPU op.
            Tensor co = Tensor::empty({s.R, s.D}, dt), cr = Tensor::empty({s.R}, DType::F32);
            C().rmsnorm(xh, wh, 1e-6f, co, &cr);
            EXPECT_LT(rel_err(*be, out, co), dt == DType::F32 ? 1e-5 : 1e-2);
          }
}

TEST(CudaFused, AddRmsnormIsAddThenRmsnormThenQuantizeBitwise) {
  uint32_t seed = 300;
  for (const Shape2& s : kShapes)
    for (DType dt : {DType::BF16, DType::F32})
      for (int with_view = 0; with_view < 2; ++with_view)
        for (int alias = 0; alias < 2; ++alias) {
          const std::string what = std::to_string(s.R) + "x" + std::to_string(s.D) + " " + dtype_name(dt) +
                                   (with_view ? " fp8" : "") + (alias ? " sum=a" : "");
          SCOPED_TRACE(what);
          const Tensor a = G().to_device(rnd({s.R, s.D}, seed++, dt, 3.0f)), b = G().to_device(rnd({s.R, s.D}, seed++, dt));
          const Tensor w = G().to_device(rnd({s.D}, seed++));
          Tensor sum = poisoned(G(), {s.R, s.D}, dt), out = poisoned(G(), {s.R, s.D}, dt);
          Tensor rstd = poisoned(G(), {s.R}, DType::F32);
          Tensor a_in = a;
          if (alias) {  // the residual stream updated in place
            a_in = G().alloc({s.R, s.D}, dt);
            G().copy(a, a_in);
            sum = a_in;
          }
          Fp8View v = G().alloc_fp8_view(s.R, s.D, false);
          G().add_rmsnorm(a_in, b, sum, w, 1e-5f, out, &rstd, with_view ? &v : nullptr);
          Tensor sum_ref = poisoned(G(), {s.R, s.D}, dt), out_ref = poisoned(G(), {s.R, s.D}, dt);
          Tensor rstd_ref = poisoned(G(), {s.R}, DType::F32);
          G().add(a, b, sum_ref);
          G().rmsnorm(sum_ref, w, 1e-5f, out_ref, &rstd_ref);
          EXPECT_EQ(bytes(G(), sum), bytes(G(), sum_ref));
          EXPECT_EQ(bytes(G(), out), bytes(G(), out_ref));
          EXPECT_EQ(bytes(G(), rstd), bytes(G(), rstd_ref));
          if (with_view) {
            QuantTensor ref = G().alloc_quant(s.R, s.D, 1, 128, false);
            G().quantize(out_ref, false, ref);
            expect_view_bitwise(G(), v, out, ref, false, what);
          }
        }
}

TEST(CudaFused, SwigluFp8IsSwigluThenQuantizeBitwise) {
  uint32_t seed = 500;
  const Shape2 shapes[] = {{1, 6144}, {16, 384}, {131, 200}, {33, 100}, {64, 72}, {256, 6144}};
  for (const Shape2& s : shapes)
    for (DType dt : {DType::BF16, DType::F32})
      for (bool pow2 : {false, true}) {
        const std::string what = std::to_string(s.R) + "x" + std::to_string(s.D) + " " + dtype_name(dt) +
                                 (pow2 ? " pow2" : "");
        SCOPED_TRACE(what);
        const Tensor gh = rnd({s.R, s.D}, seed++, dt, 3.0f), uh = rnd({s.R, s.D}, seed++, dt);
        const Tensor g = G().to_device(gh), u = G().to_device(uh);
        Tensor out = poisoned(G(), {s.R, s.D}, dt);
        Fp8View v = G().alloc_fp8_view(s.R, s.D, pow2);
        G().swiglu_fp8(g, u, out, v);
        Tensor out_ref = poisoned(G(), {s.R, s.D}, dt);
        G().swiglu(g, u, out_ref);
        QuantTensor ref = G().alloc_quant(s.R, s.D, 1, 128, pow2);
        G().quantize(out_ref, false, ref);
        EXPECT_EQ(bytes(G(), out), bytes(G(), out_ref));
        expect_view_bitwise(G(), v, out, ref, pow2, what);
        Tensor co = Tensor::empty({s.R, s.D}, dt);
        C().swiglu(gh, uh, co);
        EXPECT_LT(rel_err(G(), out, co), dt == DType::F32 ? 1e-5 : 1e-2);
      }
}

TEST(CudaFused, AddFp8IsAddThenQuantizeBitwise) {
  uint32_t seed = 530;
  for (Backend* be : {&G(), env().exact.get()})
    for (const Shape2& s : kShapes)
      for (DType dt : {DType::BF16, DType::F32})
        for (int alias = 0; alias < 2; ++alias) {
          const bool pow2 = (seed & 1) != 0;
          const std::string what = be->name() + " act " + dtype_name(be->act_dtype()) + " " + std::to_string(s.R) +
                                   "x" + std::to_string(s.D) + " " + dtype_name(dt) + (pow2 ? " pow2" : "") +
                                   (alias ? " out=a" : "");
          SCOPED_TRACE(what);
          const Tensor ah = rnd({s.R, s.D}, seed++, dt, 3.0f), bh = rnd({s.R, s.D}, seed++, dt);
          const Tensor a = be->to_device(ah), b = be->to_device(bh);
          Tensor out = poisoned(*be, {s.R, s.D}, dt);
          const Tensor* a_in = &a;
          if (alias) {  // the residual gradient updated in place
            be->copy(a, out);
            a_in = &out;
          }
          Fp8View v = be->alloc_fp8_view(s.R, s.D, pow2);
          be->add_fp8(*a_in, b, out, v);
          Tensor out_ref = poisoned(*be, {s.R, s.D}, dt);
          be->add(a, b, out_ref);
          QuantTensor ref = be->alloc_quant(s.R, s.D, 1, 128, pow2);
          be->quantize(out_ref, false, ref);
          EXPECT_EQ(bytes(*be, out), bytes(*be, out_ref));
          expect_view_bitwise(*be, v, out, ref, pow2, what);
          EXPECT_EQ(v.scales_gemm_layout, be->act_dtype() == DType::BF16 && s.R % 16 == 0 && s.D % 128 == 0);
        }
  // Mixed dtypes take the unfused pair.
  const Tensor a = G().to_device(rnd({16, 256}, 1, DType::F32)), b = G().to_device(rnd({16, 256}, 2, DType::BF16));
  Tensor out = poisoned(G(), {16, 256}, DType::BF16), out_ref = poisoned(G(), {16, 256}, DType::BF16);
  Fp8View v = G().alloc_fp8_view(16, 256, false);
  G().add_fp8(a, b, out, v);
  G().add(a, b, out_ref);
  QuantTensor ref = G().alloc_quant(16, 256, 1, 128, false);
  G().quantize(out_ref, false, ref);
  EXPECT_EQ(bytes(G(), out), bytes(G(), out_ref));
  expect_view_bitwise(G(), v, out, ref, false, "mixed dtypes");
}

TEST(CudaFused, SwigluBackwardFp8IsSwigluBackwardThenQuantizeBitwise) {
  uint32_t seed = 550;
  const Shape2 shapes[] = {{1, 6144}, {16, 384}, {131, 200}, {33, 100}, {64, 72}, {256, 6144}, {4096, 6144}};
  for (Backend* be : {&G(), env().exact.get()})
    for (const Shape2& s : shapes)
      for (DType dt : {DType::BF16, DType::F32})
        for (bool pow2 : {false, true}) {
          const std::string what = be->name() + " act " + dtype_name(be->act_dtype()) + " " + std::to_string(s.R) +
                                   "x" + std::to_string(s.D) + " " + dtype_name(dt) + (pow2 ? " pow2" : "");
          SCOPED_TRACE(what);
          const Tensor dh = rnd({s.R, s.D}, seed++, dt), gh = rnd({s.R, s.D}, seed++, dt, 3.0f);
          const Tensor uh = rnd({s.R, s.D}, seed++, dt);
          const Tensor d = be->to_device(dh), g = be->to_device(gh), u = be->to_device(uh);
          Tensor dg = poisoned(*be, {s.R, s.D}, dt), du = poisoned(*be, {s.R, s.D}, dt);
          Fp8View vg = be->alloc_fp8_view(s.R, s.D, pow2), vu = be->alloc_fp8_view(s.R, s.D, pow2);
          be->swiglu_backward_fp8(d, g, u, dg, du, vg, vu);
          // The unfused GPU ops.
          Tensor dg_ref = poisoned(*be, {s.R, s.D}, dt), du_ref = poisoned(*be, {s.R, s.D}, dt);
          be->swiglu_backward(d, g, u, dg_ref, du_ref);
          QuantTensor rg = be->alloc_quant(s.R, s.D, 1, 128, pow2), ru = be->alloc_quant(s.R, s.D, 1, 128, pow2);
          be->quantize(dg_ref, false, rg);
          be->quantize(du_ref, false, ru);
          EXPECT_EQ(bytes(*be, dg), bytes(*be, dg_ref));
          EXPECT_EQ(bytes(*be, du), bytes(*be, du_ref));
          expect_view_bitwise(*be, vg, dg, rg, pow2, what + " dgate");
          expect_view_bitwise(*be, vu, du, ru, pow2, what + " dup");
          const bool laid = be->act_dtype() == DType::BF16 && s.R % 16 == 0 && s.D % 128 == 0;
          EXPECT_EQ(vg.scales_gemm_layout, laid);
          EXPECT_EQ(vu.scales_gemm_layout, laid);
          // Against the CPU op.
          Tensor cg = Tensor::empty({s.R, s.D}, dt), cu = Tensor::empty({s.R, s.D}, dt);
          C().swiglu_backward(dh, gh, uh, cg, cu);
          EXPECT_LT(rel_err(*be, dg, cg), dt == DType::F32 ? 1e-5 : 1e-2);
          EXPECT_LT(rel_err(*be, du, cu), dt == DType::F32 ? 1e-5 : 1e-2);
        }
}

TEST(CudaFused, NonFiniteOutputIsAnError) {
  const int64_t R = 16, D = 256;
  std::vector<float> xv(R * D, 1.0f);
  xv[5 * D + 7] = INFINITY;
  const Tensor x = G().to_device(from_float_vector(xv, {R, D}, DType::BF16));
  const Tensor w = G().to_device(rnd({D}, 7));
  Tensor out = G().alloc({R, D}, DType::BF16);
  Fp8View v = G().alloc_fp8_view(R, D, false);
  EXPECT_THROW(
      {
        G().rmsnorm_fp8(x, w, 1e-6f, out, nullptr, v);
        G().synchronize();
      },
      Error);
  Tensor g = G().to_device(from_float_vector(xv, {R, D}, DType::BF16)), u = G().to_device(rnd({R, D}, 8, DType::BF16));
  EXPECT_THROW(
      {
        G().swiglu_fp8(g, u, out, v);
        G().synchronize();
      },
      Error);
  Tensor dg = G().alloc({R, D}, DType::BF16), du = G().alloc({R, D}, DType::BF16);
  Fp8View vu = G().alloc_fp8_view(R, D, false);
  EXPECT_THROW(
      {
        G().swiglu_backward_fp8(g, u, u, dg, du, v, vu);  // dout holds an inf
        G().synchronize();
      },
      Error);
}

// Linears given the producer's view compute bitwise what they compute without it: tensor cores
// with cuBLASLt-layout scales (M % 16 == 0) or row-major ones (ragged M, a tail product), and
// shapes that fall back to dequantize (N % 16 != 0, K % 128 != 0), where a cuBLASLt-layout view
// is requantized.
TEST(CudaFused, LinearWithViewIsBitwiseLinearWithout) {
  struct Case {
    int64_t M, N, K;
  };
  const Case cases[] = {{16, 256, 512}, {17, 256, 512}, {256, 384, 2048}, {1, 128, 128}, {32, 120, 256}, {32, 128, 200}};
  uint32_t seed = 700;
  for (Backend* be : {&G(), env().exact.get()})
    for (const Case& c : cases)
      for (bool pow2 : {false, true})
        for (int prequant = 0; prequant < 2; ++prequant) {
          const std::string what = be->name() + " act " + dtype_name(be->act_dtype()) + " " + std::to_string(c.M) +
                                   "x" + std::to_string(c.N) + "x" + std::to_string(c.K) + (pow2 ? " pow2" : "") +
                                   (prequant ? " wq" : "");
          SCOPED_TRACE(what);
          const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
          const DType act = be->act_dtype();
          const Tensor x = be->to_device(rnd({c.M, c.K}, seed++, act, 2.0f)), nw = be->to_device(rnd({c.K}, seed++));
          LinearWeight W1, W2;
          W1.w = be->to_device(rnd({c.N, c.K}, seed++, DType::F32, 0.05f));
          W2.w = be->to_device(rnd({c.N, c.K}, seed++, DType::F32, 0.05f));
          W2.bias = be->to_device(rnd({c.N}, seed++));
          if (prequant) {
            for (LinearWeight* W : {&W1, &W2}) {
              W->wq = be->alloc_quant(c.N, c.K, 128, 128, pow2);
              be->quantize(W->w, false, W->wq);
            }
          }
          Tensor xn = be->alloc({c.M, c.K}, act);
          Fp8View v = be->alloc_fp8_view(c.M, c.K, pow2);
          be->rmsnorm_fp8(x, nw, 1e-6f, xn, nullptr, v);
          Tensor a1 = poisoned(*be, {c.M, c.N}, act), a2 = poisoned(*be, {c.M, c.N}, act);
          Tensor b1 = poisoned(*be, {c.M, c.N}, act), b2 = poisoned(*be, {c.M, c.N}, act);
          be->linear_shared_input(xn, {&W1, &W2}, spec, {&a1, &a2});
          be->linear_shared_input(xn, {&W1, &W2}, spec, {&b1, &b2}, &v);
          EXPECT_EQ(bytes(*be, a1), bytes(*be, b1));
          EXPECT_EQ(bytes(*be, a2), bytes(*be, b2));
          Tensor c1 = poisoned(*be, {c.M, c.N}, act), d1 = poisoned(*be, {c.M, c.N}, act);
          be->linear(xn, W1, spec, c1);
          be->linear(xn, W1, spec, d1, &v);
          EXPECT_EQ(bytes(*be, c1), bytes(*be, d1));
          EXPECT_EQ(bytes(*be, a1), bytes(*be, c1));
          // A view of another tensor is refused.
          Tensor other = be->alloc({c.M, c.K}, act);
          be->copy(xn, other);
          EXPECT_THROW(be->linear(other, W1, spec, d1, &v), Error);
        }
}

// The FP8 dgrad given dy's view (swiglu_backward_fp8) and/or the cached W^T (wqt) computes
// bitwise the dx of quantizing dy and transposing W itself: tensor cores with cuBLASLt-layout
// scales (M % 16 == 0), row-major ones (ragged M: a tail product), the dequantize fallback with a
// row-major view (N % 128 != 0) and with a cuBLASLt-layout view, requantized (K % 16 != 0); the
// gate projection's shape at 256 tokens. The weight gradient does not read them.
TEST(CudaFused, LinearBackwardWithViewAndWqtIsBitwiseWithout) {
  struct Case {
    int64_t M, N, K;  // dy [M, N], W [N, K]
  };
  const Case cases[] = {{16, 256, 512}, {17, 256, 512}, {256, 6144, 2048}, {32, 200, 256}, {32, 256, 120}};
  uint32_t seed = 800;
  for (Backend* be : {&G(), env().exact.get()})
    for (const Case& c : cases)
      for (bool pow2 : {false, true})
        for (LinearMode wgrad : {LinearMode::BF16, LinearMode::FP8_BLOCK}) {
          const std::string what = be->name() + " act " + dtype_name(be->act_dtype()) + " " + std::to_string(c.M) +
                                   "x" + std::to_string(c.N) + "x" + std::to_string(c.K) + (pow2 ? " pow2" : "") +
                                   " wgrad " + linear_mode_name(wgrad);
          SCOPED_TRACE(what);
          const LinearSpec spec{LinearMode::FP8_BLOCK, pow2, wgrad};
          const DType act = be->act_dtype();
          const Tensor d = be->to_device(rnd({c.M, c.N}, seed++, act)), g = be->to_device(rnd({c.M, c.N}, seed++, act, 3.0f));
          const Tensor u = be->to_device(rnd({c.M, c.N}, seed++, act)), x = be->to_device(rnd({c.M, c.K}, seed++, act));
          Tensor dy = be->alloc({c.M, c.N}, act), dy2 = be->alloc({c.M, c.N}, act);
          Fp8View v = be->alloc_fp8_view(c.M, c.N, pow2), v2 = be->alloc_fp8_view(c.M, c.N, pow2);
          be->swiglu_backward_fp8(d, g, u, dy, dy2, v, v2);
          LinearWeight W;
          W.w = be->to_device(rnd({c.N, c.K}, seed++, DType::F32, 0.05f));
          LinearWeight cached = W;  // the trainer's: wq and its transpose
          cached.wq = be->alloc_quant(c.N, c.K, 128, 128, pow2);
          be->quantize(W.w, false, cached.wq);
          cached.wqt = be->alloc_quant(c.K, c.N, 128, 128, pow2);
          be->quantize(W.w, true, cached.wqt);
          auto dgrad = [&](const LinearWeight& w, const Fp8View* view) {
            Tensor dx = poisoned(*be, {c.M, c.K}, act), dw = be->alloc({c.N, c.K}, DType::F32);
            be->fill(dw, 0.0f);
            be->linear_backward(dy, x, w, spec, &dx, &dw, nullptr, view);
            return std::make_pair(bytes(*be, dx), bytes(*be, dw));
          };
          const auto ref = dgrad(W, nullptr);
          EXPECT_TRUE(dgrad(W, &v) == ref) << "view";
          EXPECT_TRUE(dgrad(cached, nullptr) == ref) << "wqt";
          EXPECT_TRUE(dgrad(cached, &v) == ref) << "view + wqt";
          LinearWeight only_q = cached;  // wq and wqt alone (no w)
          only_q.w = Tensor();
          EXPECT_TRUE(dgrad(only_q, &v) == ref) << "view + wq + wqt, no w";
          // wqt is wq's exact transpose, and the CPU quantizer's.
          const QuantTensor t = transpose_128x128(quantize_128x128(be->to_host(W.w), pow2));
          EXPECT_EQ(bytes(*be, cached.wqt.data), bytes(*be, t.data));
          EXPECT_EQ(bytes(*be, cached.wqt.scales), bytes(*be, t.scales));
          Tensor dx = be->alloc({c.M, c.K}, act);
          EXPECT_THROW(be->linear_backward(dy, x, W, spec, &dx, nullptr, nullptr, &v2), Error);  // dup's view
        }
}

// Through the model on the GPU: the FP8 dgrads fed by their dY's producers (the SwiGLU backward,
// the residual adds) and the trainer's cached W^T give the gradients of each linear_backward quantizing dy and W^T itself
// (BackwardOptions::fused_dy_fp8 false, weights without wq / wqt): bitwise for every parameter
// (GEMMs and what feeds them are deterministic, and since session 17 so are the column sums of
// the norm weights and biases and the embedding's sorted row sums: no atomics). A
// batch of 48 tokens (views in cuBLASLt's layout) and of 47 (row-major, tail products), both
// activation dtypes, fp8_e2e's BF16 wgrad and the FP8 one. qwen3_moe: the experts' grouped
// dgrads fed by swiglu_backward_fp8's copies against the same cached weights unfused (without
// wq the experts' products would run per expert on cuBLASLt, another kernel).
TEST(CudaFused, ModelGradientsWithFusedDyAndCachedWtAreUnchanged) {
  for (Backend* be : {&G(), env().exact.get()})
    for (const char* family : {"qwen3", "qwen2", "qwen3_moe"})
      for (int32_t last : {28, 27})
        for (LinearMode wgrad : {LinearMode::BF16, LinearMode::FP8_BLOCK}) {
          SCOPED_TRACE(std::string(family) + " act " + dtype_name(be->act_dtype()) + " tokens " +
                       std::to_string(20 + last) + " wgrad " + linear_mode_name(wgrad));
          EnginePrecision prec = PrecisionRecipe::preset("fp8_e2e").trainer;
          prec.wgrad = wgrad;
          const ModelWeights w = model_weights_to_device(*be, test::recompute_model(family), DType::F32);
          ModelWeights cached = w;  // as Trainer::compute_weights: wq and wqt of every FP8 linear
          int fp8_linears = 0;
          model_for_each_linear(cached, [&](const std::string& name, int layer, LinearWeight& lw) {
            if (model_linear_mode(w.config, prec, name, layer, lw) != LinearMode::FP8_BLOCK) return;
            const int64_t N = lw.w.dim(0), K = lw.w.dim(1);
            lw.wq = be->alloc_quant(N, K, kQuantBlock, kQuantBlock, prec.pow2_scales);
            be->quantize(lw.w, false, lw.wq);
            lw.wqt = be->alloc_quant(K, N, kQuantBlock, kQuantBlock, prec.pow2_scales);
            be->quantize(lw.w, true, lw.wqt);
            ++fp8_linears;
          });
          const bool moe = std::string(family) == "qwen3_moe";
          int expected = 0;  // q, k, v, o and the MLP's three, or every expert's three in a sparse block
          for (int l = 0; l < w.config.num_layers; ++l)
            expected += 4 + 3 * (w.config.layer_is_moe(l) ? static_cast<int>(w.config.num_experts) : 1);
          EXPECT_EQ(fp8_linears, expected);
          const ForwardBatch batch = forward_batch_from_sequences(test::recompute_sequences(last));
          const int64_t T = batch.num_tokens();
          std::vector<float> dl(T);
          for (int64_t t = 0; t < T; ++t) dl[t] = 0.01f * static_cast<float>((t * 7) % 11) - 0.05f;
          auto grads = [&](const ModelWeights& weights, bool fused) {
            Activations acts;
            model_forward_logprobs(*be, weights, prec, batch, ForwardOptions{}, &acts);
            ModelWeights g = model_grads_alloc(*be, w, DType::F32);
            model_grads_zero(*be, g);
            BackwardOptions bo;
            bo.fused_dy_fp8 = fused;
            model_backward(*be, weights, prec, acts, be->to_device(from_float_vector(dl, {T})), g, bo);
            std::vector<std::pair<std::string, Tensor>> out;
            model_for_each_parameter(g, [&](const std::string& n, const Tensor& t) { out.emplace_back(n, t); });
            return out;
          };
          const auto before = grads(moe ? cached : w, false), now = grads(cached, true);
          ASSERT_EQ(before.size(), now.size());
          for (size_t i = 0; i < before.size(); ++i)
            EXPECT_TRUE(test::bitwise_equal(*be, before[i].second, now[i].second)) << before[i].first;
        }
}

// precision.trainer_wgrad = bf16: dx stays the FP8 dgrad (bitwise the fp8-wgrad run's), dw is
// the BF16 GEMM of dY and X (the CPU's BF16 wgrad within the BF16 GEMM tolerance).
TEST(CudaFused, Bf16WgradMatchesCpu) {
  struct Case {
    int64_t M, N, K;
  };
  const Case cases[] = {{16, 256, 512}, {1000, 512, 1024}, {17, 128, 256}};
  uint32_t seed = 900;
  for (const Case& c : cases) {
    const std::string what = std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K);
    SCOPED_TRACE(what);
    const LinearSpec fp8{LinearMode::FP8_BLOCK, false}, mixed{LinearMode::FP8_BLOCK, false, LinearMode::BF16};
    const Tensor xh = rnd({c.M, c.K}, seed++, DType::BF16), dyh = rnd({c.M, c.N}, seed++, DType::BF16);
    LinearWeight Wh;
    Wh.w = rnd({c.N, c.K}, seed++, DType::F32, 0.05f);
    LinearWeight W;
    W.w = G().to_device(Wh.w);
    const Tensor x = G().to_device(xh), dy = G().to_device(dyh);
    Tensor dx8 = poisoned(G(), {c.M, c.K}, DType::BF16), dxm = poisoned(G(), {c.M, c.K}, DType::BF16);
    Tensor dw8 = G().alloc({c.N, c.K}, DType::F32), dwm = G().alloc({c.N, c.K}, DType::F32);
    G().fill(dw8, 0.0f);
    G().fill(dwm, 0.0f);
    G().linear_backward(dy, x, W, fp8, &dx8, &dw8, nullptr);
    G().linear_backward(dy, x, W, mixed, &dxm, &dwm, nullptr);
    EXPECT_EQ(bytes(G(), dx8), bytes(G(), dxm));
    Tensor rdx = Tensor::empty({c.M, c.K}, DType::F32), rdw = Tensor::zeros({c.N, c.K}, DType::F32);
    C().linear_backward(dyh, xh, Wh, mixed, &rdx, &rdw, nullptr);
    EXPECT_LT(rel_err(G(), dwm, rdw), 1e-4) << what << " dw";
  }
}

}  // namespace
}  // namespace fp8rl
