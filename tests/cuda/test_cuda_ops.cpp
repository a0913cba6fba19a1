// Parity of every CUDA op with the CPU reference backend, on fresh random inputs (never zeros),
// including ragged shapes (rows not a multiple of 128, a single row). Tolerances by class:
//   bitwise: quantize (every block shape, transpose, pow2), dtype conversion, KV-cache writes;
//   GEMMs: FP32 1e-5, BF16 (same rounded operands) 1e-4 relative to the CPU result; FP8 block:
//          DeepGEMM's 1 - 2 sum(xy) / sum(x^2 + y^2) < 1e-3 against the CPU FP8 result;
//   other F32 ops 1e-5 (1e-4 where a long reduction feeds an exp), BF16 activations 1e-2.
// Every output is poisoned (NaN) before the op, so an unwritten element fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "quant/quant.h"

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

Tensor rnd(const Shape& shape, uint32_t seed, DType dtype = DType::F32, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) x = nd(gen);
  return from_float_vector(v, shape, dtype);
}

// Random values with a wide dynamic range: each row scaled by 10^U(-6, 3), to reach E4M3
// subnormals, saturation neighbourhoods and both pow2 branches.
Tensor rnd_wide(int64_t r, int64_t c, uint32_t seed, DType dtype) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ue(-6.0f, 3.0f);
  std::vector<float> v(r * c);
  for (int64_t i = 0; i < r; ++i) {
    const float s = std::pow(10.0f, ue(gen));
    for (int64_t j = 0; j < c; ++j) v[i * c + j] = nd(gen) * s;
  }
  if (r > 2)  // one all-zero row: its 1x128 blocks take the amax == 0 rule
    for (int64_t j = 0; j < c; ++j) v[1 * c + j] = 0.0f;
  return from_float_vector(v, {r, c}, dtype);
}

Tensor poisoned(const Shape& s, DType d) {
  Tensor t = G().alloc(s, d);
  G().fill(t, NAN);
  return t;
}
Tensor dev(const Tensor& h) { return G().to_device(h); }
Tensor host(const Tensor& d) { return G().to_host(d); }

std::vector<double> vals(const Tensor& t) {
  Tensor h = t.device() == DeviceKind::CUDA ? host(t) : t;
  std::vector<double> v(h.numel());
  if (h.dtype() == DType::F64) {
    for (int64_t i = 0; i < h.numel(); ++i) v[i] = h.data<double>()[i];
  } else if (h.dtype() == DType::I32) {
    for (int64_t i = 0; i < h.numel(); ++i) v[i] = h.data<int32_t>()[i];
  } else {
    const std::vector<float> f = to_float_vector(h);
    for (size_t i = 0; i < f.size(); ++i) v[i] = f[i];
  }
  return v;
}

// max |a - b| / max |b| (NaN anywhere -> infinity).
double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = vals(a), y = vals(b);
  EXPECT_EQ(x.size(), y.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i])) return INFINITY;
    d = std::max(d, std::fabs(x[i] - y[i]));
    m = std::max(m, std::fabs(y[i]));
  }
  return d / std::max(m, 1e-30);
}

// DeepGEMM's similarity metric: 1 - 2 sum(xy) / sum(x^2 + y^2).
double deepgemm_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = vals(a), y = vals(b);
  double xy = 0, xx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    xy += x[i] * y[i];
    xx += x[i] * x[i] + y[i] * y[i];
  }
  return 1.0 - 2.0 * xy / xx;
}

bool bytes_equal(const Tensor& a, const Tensor& b) {
  Tensor x = a.device() == DeviceKind::CUDA ? host(a) : a;
  Tensor y = b.device() == DeviceKind::CUDA ? host(b) : b;
  return x.nbytes() == y.nbytes() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

int64_t first_diff(const Tensor& a, const Tensor& b) {
  Tensor x = host(a);
  const uint8_t* p = static_cast<const uint8_t*>(x.raw());
  const uint8_t* q = static_cast<const uint8_t*>(b.raw());
  for (size_t i = 0; i < x.nbytes(); ++i)
    if (p[i] != q[i]) return static_cast<int64_t>(i);
  return -1;
}

Tensor to_f32_host(const Tensor& t) {
  const std::vector<double> v = vals(t);
  std::vector<float> f(v.begin(), v.end());
  return from_float_vector(f, t.shape(), DType::F32);
}

// ---- memory ----------------------------------------------------------------------------------

TEST(CudaMemory, CopyRoundTripAndFill) {
  Tensor h = rnd({37, 129}, 1);
  Tensor d = dev(h);
  Tensor d2 = poisoned(h.shape(), DType::F32);
  G().copy(d, d2);
  EXPECT_TRUE(bytes_equal(d2, h));
  G().fill(d2, 2.5f);
  for (double v : vals(d2)) ASSERT_EQ(v, 2.5);
}

TEST(CudaMemory, ConvertIsBitExact) {
  Tensor h = rnd_wide(33, 300, 2, DType::F32);
  Tensor bf = poisoned(h.shape(), DType::BF16);
  G().convert(dev(h), bf);
  EXPECT_TRUE(bytes_equal(bf, from_float_vector(to_float_vector(h), h.shape(), DType::BF16)));
  Tensor back = poisoned(h.shape(), DType::F32);
  G().convert(bf, back);
  EXPECT_TRUE(bytes_equal(back, from_float_vector(to_float_vector(host(bf)), h.shape(), DType::F32)));
}

TEST(CudaMemory, OutOfMemorySaysWhatToReduce) {
  try {
    G().alloc({int64_t(1) << 40}, DType::F32);  // 4 TiB
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of GPU memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("reduce"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("F32[1099511627776]"), std::string::npos) << e.what();  // names it
  }
  // The backend still works afterwards.
  Tensor d = dev(rnd({3, 5}, 3));
  EXPECT_EQ(vals(d).size(), 15u);
}

// Stream-ordered pool (device_memory.h): freed memory is reused without growing the pool, the
// statistics follow, and FP8RL_CUDA_ALLOC=plain falls back to cudaMalloc.
TEST(CudaMemory, PoolReusesFreedMemoryAndReportsStats) {
  auto be = make_cuda_backend(0);
  const int64_t n = 16 << 20;  // 64 MiB of F32
  MemoryStats s0 = be->memory_stats();
  {
    Tensor a = be->alloc({n}, DType::F32);
    be->fill(a, 1.0f);
    const MemoryStats s1 = be->memory_stats();
    EXPECT_EQ(s1.used_bytes - s0.used_bytes, n * 4);
    EXPECT_GE(s1.reserved_bytes, s1.used_bytes);
    EXPECT_GE(s1.peak_used_bytes, s1.used_bytes);
  }
  const MemoryStats s2 = be->memory_stats();
  EXPECT_EQ(s2.used_bytes, s0.used_bytes);
  EXPECT_GE(s2.reserved_bytes, n * 4) << "freed memory must stay in the pool";
  for (int i = 0; i < 10; ++i) {
    Tensor b = be->alloc({n}, DType::F32);
    be->fill(b, static_cast<float>(i));
  }
  const MemoryStats s3 = be->memory_stats();
  EXPECT_EQ(s3.reserved_bytes, s2.reserved_bytes) << "the pool grew instead of reusing its free block";
  EXPECT_EQ(s3.peak_used_bytes, s0.used_bytes + n * 4);
  be->reset_peak_memory_stats();
  EXPECT_EQ(be->memory_stats().peak_used_bytes, be->memory_stats().used_bytes);

  ::setenv("FP8RL_CUDA_ALLOC", "plain", 1);
  auto plain = make_cuda_backend(0);
  ::setenv("FP8RL_CUDA_ALLOC", "pooled?", 1);
  EXPECT_THROW(make_cuda_backend(0), Error);
  ::unsetenv("FP8RL_CUDA_ALLOC");
  Tensor p = plain->alloc({1000}, DType::F32);
  plain->fill(p, 3.0f);
  EXPECT_EQ(plain->memory_stats().used_bytes, 4000);
  EXPECT_EQ(plain->memory_stats().reserved_bytes, 4000);
  EXPECT_EQ(vals(plain->to_host(p))[999], 3.0);
}

// A tensor may outlive its backend: the release must not touch a destroyed stream.
TEST(CudaMemory, TensorOutlivesItsBackend) {
  Tensor keep, keep_plain;
  {
    auto be = make_cuda_backend(0);
    keep = be->alloc({4096}, DType::F32);
    be->fill(keep, 7.0f);
    Tensor scratch = be->alloc({1 << 20}, DType::BF16);  // freed before the backend
    be->fill(scratch, 1.0f);
  }
  {
    ::setenv("FP8RL_CUDA_ALLOC", "plain", 1);
    auto be = make_cuda_backend(0);
    ::unsetenv("FP8RL_CUDA_ALLOC");
    keep_plain = be->alloc({64}, DType::F32);
    be->fill(keep_plain, 5.0f);
  }
  EXPECT_EQ(vals(keep)[4095], 7.0);  // read through another backend
  EXPECT_EQ(vals(keep_plain)[63], 5.0);
  keep = Tensor();
  keep_plain = Tensor();
  G().synchronize();
}

// ---- quantization: bitwise -------------------------------------------------------------------

struct QCase {
  int64_t r, c;
};

TEST(CudaQuant, BitwiseEqualToReferenceEveryBlockShape) {
  // Widths that are multiples of 8 take the vectorized kernels, the others the element-wise
  // ones; {200, 136} and {130, 264} transposed give output rows not 16-byte aligned (mixed
  // 16-byte and byte stores) and partial tiles.
  const QCase shapes[] = {{1, 128},   {1, 300},   {7, 128},    {130, 257},  {256, 512},
                          {3, 1000},  {200, 129}, {200, 136},  {130, 264},  {384, 256}};
  uint32_t seed = 10;
  for (const QCase& s : shapes)
    for (DType dt : {DType::F32, DType::BF16})
      for (bool transpose : {false, true})
        for (int br : {1, 128})
          for (bool pow2 : {false, true}) {
            SCOPED_TRACE(::testing::Message() << s.r << "x" << s.c << " " << dtype_name(dt) << " T=" << transpose
                                              << " blocks " << br << "x128 pow2=" << pow2);
            Tensor x = rnd_wide(s.r, s.c, seed++, dt);
            const int64_t R = transpose ? s.c : s.r, Cc = transpose ? s.r : s.c;
            QuantTensor ref = quant_alloc(R, Cc, br, 128, pow2);
            quantize_blocks_into(x, transpose, ref);
            QuantTensor q = G().alloc_quant(R, Cc, br, 128, pow2);
            G().fill(q.scales, NAN);
            G().quantize(dev(x), transpose, q);
            EXPECT_TRUE(bytes_equal(q.scales, ref.scales)) << "first differing scale byte " << first_diff(q.scales, ref.scales);
            EXPECT_TRUE(bytes_equal(q.data, ref.data)) << "first differing data byte " << first_diff(q.data, ref.data);
          }
}

TEST(CudaQuant, NonFiniteInputIsAnError) {
  for (float bad : {NAN, INFINITY}) {
    Tensor x = rnd({5, 256}, 3);
    x.data<float>()[3 * 256 + 17] = bad;
    QuantTensor q = G().alloc_quant(5, 256, 1, 128, false);
    EXPECT_THROW(G().quantize(dev(x), false, q), Error);
    QuantTensor qt = G().alloc_quant(256, 5, 128, 128, false);
    EXPECT_THROW(G().quantize(dev(x), true, qt), Error);
  }
}

// ---- linear layers ---------------------------------------------------------------------------

struct GemmCase {
  int64_t M, N, K;
};
// cuBLASLt FP8 block path: M, N % 16 and K % 128; the rest fall back (dequantize + FP32 GEMM).
const GemmCase kGemmCases[] = {{1, 256, 128},  {16, 256, 512},  {130, 384, 256}, {256, 512, 384},
                               {128, 640, 1024}, {64, 128, 200}, {48, 256, 128}};

LinearWeight host_weight(int64_t N, int64_t K, uint32_t seed, bool bias) {
  LinearWeight W;
  W.w = rnd({N, K}, seed, DType::F32, 0.05f);
  if (bias) W.bias = rnd({N}, seed + 1);
  return W;
}
LinearWeight dev_weight(const LinearWeight& h) {
  LinearWeight W;
  W.w = dev(h.w);
  if (h.bias.defined()) W.bias = dev(h.bias);
  return W;
}

void expect_linear_close(const Tensor& got, const Tensor& ref, LinearMode mode, const std::string& what) {
  if (mode == LinearMode::FP8_BLOCK) {
    const double d = deepgemm_diff(got, ref);
    EXPECT_LT(d, 1e-3) << what << " (DeepGEMM diff; max rel err " << rel_err(got, ref) << ")";
    EXPECT_LT(rel_err(got, ref), 2e-2) << what;
  } else {
    const double tol = got.dtype() == DType::BF16 ? 1e-2 : (mode == LinearMode::FP32 ? 1e-5 : 1e-4);
    EXPECT_LT(rel_err(got, ref), tol) << what;
  }
}

TEST(CudaLinear, ForwardMatchesCpuEveryMode) {
  uint32_t seed = 100;
  for (const GemmCase& g : kGemmCases)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK})
      for (DType odt : {DType::F32, DType::BF16}) {
        if (mode == LinearMode::FP32 && odt == DType::BF16) continue;
        const std::string what = ::testing::PrintToString(g.M) + "x" + std::to_string(g.N) + "x" +
                                 std::to_string(g.K) + " " + linear_mode_name(mode) + " out " + dtype_name(odt);
        SCOPED_TRACE(what);
        LinearSpec spec{mode, (seed % 2) == 1};
        Tensor x = rnd({g.M, g.K}, seed++);
        const bool bias = (seed % 3) == 0;
        LinearWeight Wh = host_weight(g.N, g.K, seed++, bias);
        Tensor ref = Tensor::empty({g.M, g.N}, DType::F32);
        C().linear(x, Wh, spec, ref);
        Tensor out = poisoned({g.M, g.N}, odt);
        G().linear(dev(x), dev_weight(Wh), spec, out);
        expect_linear_close(out, ref, mode, what);
      }
}

TEST(CudaLinear, PrequantizedWeightGivesTheSameResult) {
  for (const GemmCase& g : {GemmCase{256, 512, 384}, GemmCase{130, 384, 256}}) {
    LinearSpec spec{LinearMode::FP8_BLOCK, false};
    Tensor x = rnd({g.M, g.K}, 7);
    LinearWeight Wh = host_weight(g.N, g.K, 8, false);
    LinearWeight Wd = dev_weight(Wh);
    Wd.wq = G().alloc_quant(g.N, g.K, 128, 128, false);
    G().quantize(Wd.w, false, Wd.wq);
    Wd.w = Tensor();
    Tensor ref = Tensor::empty({g.M, g.N}, DType::F32);
    C().linear(x, Wh, spec, ref);
    Tensor out = poisoned({g.M, g.N}, DType::F32);
    G().linear(dev(x), Wd, spec, out);
    expect_linear_close(out, ref, LinearMode::FP8_BLOCK, "prequantized");
  }
}

// dgrad with a pre-quantized weight (the trainer's cache, the generator's wq) takes W.wq
// transposed instead of requantizing W.w: bitwise the same dx, with or without w.
TEST(CudaLinear, BackwardWithPrequantizedWeightIsBitwiseTheSame) {
  for (const GemmCase& g : {GemmCase{256, 512, 384}, GemmCase{130, 200, 260}, GemmCase{64, 384, 128}})
    for (bool pow2 : {false, true}) {
      const std::string what = std::to_string(g.M) + "x" + std::to_string(g.N) + "x" + std::to_string(g.K) +
                               (pow2 ? " pow2" : "");
      SCOPED_TRACE(what);
      const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
      Tensor x = rnd({g.M, g.K}, 40), dy = rnd({g.M, g.N}, 41);
      LinearWeight Wh = host_weight(g.N, g.K, 42, false);
      LinearWeight Wd = dev_weight(Wh);
      Tensor dx_w = poisoned({g.M, g.K}, DType::F32);
      G().linear_backward(dev(dy), dev(x), Wd, spec, &dx_w, nullptr, nullptr);
      LinearWeight both = Wd;
      both.wq = G().alloc_quant(g.N, g.K, 128, 128, pow2);
      G().quantize(Wd.w, false, both.wq);
      Tensor dx_both = poisoned({g.M, g.K}, DType::F32);
      G().linear_backward(dev(dy), dev(x), both, spec, &dx_both, nullptr, nullptr);
      EXPECT_TRUE(bytes_equal(dx_both, dx_w)) << what;
      LinearWeight only_q;
      only_q.wq = both.wq;
      Tensor dx_q = poisoned({g.M, g.K}, DType::F32);
      G().linear_backward(dev(dy), dev(x), only_q, spec, &dx_q, nullptr, nullptr);
      EXPECT_TRUE(bytes_equal(dx_q, dx_w)) << what;
      Tensor ref = Tensor::empty({g.M, g.K}, DType::F32);
      C().linear_backward(dy, x, Wh, spec, &ref, nullptr, nullptr);
      expect_linear_close(dx_q, ref, LinearMode::FP8_BLOCK, what);
      // The spec's pow2 must match the cached weight's.
      EXPECT_THROW(G().linear_backward(dev(dy), dev(x), only_q, {LinearMode::FP8_BLOCK, !pow2}, &dx_q, nullptr,
                                       nullptr),
                   Error);
    }
}

TEST(CudaLinear, BackwardMatchesCpuEveryMode) {
  uint32_t seed = 300;
  const GemmCase cases[] = {{128, 256, 384}, {48, 256, 128}, {130, 200, 384}, {256, 128, 512}, {1, 128, 256}};
  for (const GemmCase& g : cases)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK}) {
      const std::string what = std::to_string(g.M) + "x" + std::to_string(g.N) + "x" + std::to_string(g.K) + " " +
                               linear_mode_name(mode);
      SCOPED_TRACE(what);
      LinearSpec spec{mode, (seed % 2) == 0};
      Tensor x = rnd({g.M, g.K}, seed++), dy = rnd({g.M, g.N}, seed++);
      LinearWeight Wh = host_weight(g.N, g.K, seed++, true);
      Tensor dw0 = rnd({g.N, g.K}, seed++, DType::F32, 0.1f), db0 = rnd({g.N}, seed++);
      Tensor rdx = Tensor::empty({g.M, g.K}, DType::F32);
      Tensor rdw = to_f32_host(dw0), rdb = to_f32_host(db0);
      C().linear_backward(dy, x, Wh, spec, &rdx, &rdw, &rdb);
      Tensor gdx = poisoned({g.M, g.K}, DType::F32), gdw = dev(dw0), gdb = dev(db0);
      G().linear_backward(dev(dy), dev(x), dev_weight(Wh), spec, &gdx, &gdw, &gdb);
      expect_linear_close(gdx, rdx, mode, what + " dx");
      expect_linear_close(gdw, rdw, mode, what + " dw");
      EXPECT_LT(rel_err(gdb, rdb), 1e-5) << what << " dbias";
    }
}

// The trainer's micro-batches have ragged token counts: every FP8 product must stay on the
// tensor cores (rows M % 16 != 0 as a padded tail product; the wgrad's token contraction padded
// to a multiple of 128), match the CPU reference, and count no fallback.
TEST(CudaLinear, RaggedTokenCountsStayOnTensorCores) {
  uint32_t seed = 900;
  const GemmCase cases[] = {{1, 256, 384}, {15, 256, 384}, {17, 512, 256}, {1000, 512, 1024}, {4099, 256, 384}};
  for (const GemmCase& g : cases)
    for (bool pow2 : {false, true}) {
      const std::string what = std::to_string(g.M) + "x" + std::to_string(g.N) + "x" + std::to_string(g.K) +
                               (pow2 ? " pow2" : "");
      SCOPED_TRACE(what);
      const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
      const BackendCounters c0 = G().counters();
      Tensor x = rnd({g.M, g.K}, seed++), dy = rnd({g.M, g.N}, seed++);
      LinearWeight Wh = host_weight(g.N, g.K, seed++, false);
      Tensor ref = Tensor::empty({g.M, g.N}, DType::F32);
      C().linear(x, Wh, spec, ref);
      Tensor out = poisoned({g.M, g.N}, DType::BF16);
      G().linear(dev(x), dev_weight(Wh), spec, out);
      expect_linear_close(out, ref, LinearMode::FP8_BLOCK, what + " forward");
      Tensor dw0 = rnd({g.N, g.K}, seed++, DType::F32, 0.1f);
      Tensor rdx = Tensor::empty({g.M, g.K}, DType::F32), rdw = to_f32_host(dw0);
      C().linear_backward(dy, x, Wh, spec, &rdx, &rdw, nullptr);
      Tensor gdx = poisoned({g.M, g.K}, DType::F32), gdw = dev(dw0);
      G().linear_backward(dev(dy), dev(x), dev_weight(Wh), spec, &gdx, &gdw, nullptr);
      expect_linear_close(gdx, rdx, LinearMode::FP8_BLOCK, what + " dx");
      expect_linear_close(gdw, rdw, LinearMode::FP8_BLOCK, what + " dw");
      const BackendCounters c1 = G().counters();
      EXPECT_EQ(c1.fp8_gemm_fallbacks, c0.fp8_gemm_fallbacks) << what;
      // Forward and dgrad: M <= 64 runs on the own kernel (any M), larger M on cuBLASLt, whose last
      // M % 16 rows are a padded second product.
      if (g.M <= cuda::GemmEngine::kOwnMaxM) {
        EXPECT_EQ(c1.fp8_gemm_own - c0.fp8_gemm_own, 2) << what << " (forward and dgrad)";
      } else if (g.M % 16 != 0) {
        EXPECT_EQ(c1.fp8_gemm_tails - c0.fp8_gemm_tails, 2) << what << " (forward and dgrad)";
      }
    }
}

// Scales written straight into cuBLASLt's VEC128 layout [ceil(C/128)][R] are the transpose of
// the standard [R][ceil(C/128)] grid, bitwise; the data is unchanged.
TEST(CudaQuant, GemmLayoutScalesAreTheTransposedGrid) {
  for (int64_t R : {16, 64, 256})
    for (int64_t C : {128, 384, 2048, 100})
      for (DType dt : {DType::F32, DType::BF16}) {
        Tensor x = dev(rnd_wide(R, C, static_cast<uint32_t>(R + C), dt));
        QuantTensor plain = G().alloc_quant(R, C, 1, 128, true), laid = G().alloc_quant(R, C, 1, 128, true);
        auto* cuda = dynamic_cast<cuda::CudaBackend*>(&G());
        ASSERT_NE(cuda, nullptr);
        cuda->quantize_async(x, false, plain);
        cuda->quantize_async(x, false, laid, false, /*gemm_layout=*/true);
        EXPECT_TRUE(bytes_equal(plain.data, laid.data)) << R << "x" << C;
        const Tensor sp = host(plain.scales), sl = host(laid.scales);
        const int64_t kb = (C + 127) / 128;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t b = 0; b < kb; ++b)
            ASSERT_EQ(std::memcmp(&sp.data<float>()[r * kb + b], &sl.data<float>()[b * R + r], 4), 0)
                << R << "x" << C << " row " << r << " block " << b;
      }
}

// A transposed quantization into a row stride padded to a multiple of 128 (the wgrad operands):
// the real columns bitwise equal the unpadded quantization, the padding is zeros.
TEST(CudaQuant, PaddedTransposeIsTheUnpaddedOnePlusZeros) {
  for (int64_t M : {1, 100, 129, 300})
    for (DType dt : {DType::F32, DType::BF16}) {
      const int64_t K = 256, Mp = (M + 127) / 128 * 128;
      Tensor x = dev(rnd_wide(M, K, static_cast<uint32_t>(M), dt));
      QuantTensor plain = G().alloc_quant(K, M, 1, 128, false), padded = G().alloc_quant(K, Mp, 1, 128, false);
      G().fill(padded.data, 0.0f);
      auto* cuda = dynamic_cast<cuda::CudaBackend*>(&G());
      ASSERT_NE(cuda, nullptr);
      cuda->quantize_async(x, true, plain);
      Tensor poison = host(padded.data);
      std::memset(poison.raw(), 0x5a, poison.nbytes());
      G().copy(poison, padded.data);
      cuda->quantize_async(x, true, padded, /*pad_cols=*/true);
      const Tensor hp = host(plain.data), hq = host(padded.data);
      for (int64_t r = 0; r < K; ++r) {
        ASSERT_EQ(std::memcmp(hq.data<uint8_t>() + r * Mp, hp.data<uint8_t>() + r * M, M), 0) << "row " << r;
        for (int64_t c = M; c < Mp; ++c) ASSERT_EQ(hq.data<uint8_t>()[r * Mp + c], 0) << "row " << r << " col " << c;
      }
      EXPECT_TRUE(bytes_equal(padded.scales, plain.scales)) << "M " << M;
    }
}

// ---- element-wise and layers ----------------------------------------------------------------

TEST(CudaOps, ElementwiseAndReductions) {
  Tensor a = rnd({77, 65}, 20), b = rnd({77, 65}, 21);
  Tensor ref = Tensor::empty(a.shape(), DType::F32);
  C().add(a, b, ref);
  Tensor out = poisoned(a.shape(), DType::F32);
  G().add(dev(a), dev(b), out);
  EXPECT_LT(rel_err(out, ref), 1e-7);
  Tensor s = dev(a);
  G().scale(s, 0.37f);
  Tensor sr = to_f32_host(a);
  C().scale(sr, 0.37f);
  EXPECT_LT(rel_err(s, sr), 1e-7);
  const double ss = G().sum_squares(dev(a)), sref = C().sum_squares(a);
  EXPECT_NEAR(ss, sref, 1e-9 * sref);
  EXPECT_TRUE(G().all_finite(dev(a)));
  Tensor bad = to_f32_host(a);
  bad.data<float>()[1234] = NAN;
  EXPECT_FALSE(G().all_finite(dev(bad)));
  bad.data<float>()[1234] = -INFINITY;
  EXPECT_FALSE(G().all_finite(dev(bad)));
}

TEST(CudaOps, AmaxIsADeviceReductionEqualToTheHostOne) {
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1) << 20}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " n " << n);
      Tensor x = rnd({n}, 25 + static_cast<uint32_t>(n), dt, 3.0f);
      const float want = C().amax(x);
      EXPECT_GT(want, 0.0f);
      EXPECT_EQ(G().amax(dev(x)), want);  // max is exact: bitwise equal
    }
  Tensor x = rnd({5000}, 26);
  x.data<float>()[4321] = -1e30f;
  EXPECT_EQ(G().amax(dev(x)), 1e30f);
  x.data<float>()[17] = NAN;
  EXPECT_TRUE(std::isnan(G().amax(dev(x))));
}

TEST(CudaOps, EmbeddingForwardBackward) {
  const int64_t V = 300, D = 96;
  Tensor table = rnd({V, D}, 30);
  std::vector<float> idsf;
  std::vector<int32_t> ids = {5, 299, 0, 5, 17, 42, 5};
  Tensor idh = Tensor::empty({7}, DType::I32);
  std::memcpy(idh.raw(), ids.data(), 28);
  Tensor ref = Tensor::empty({7, D}, DType::F32);
  C().embedding(idh, table, ref);
  Tensor out = poisoned({7, D}, DType::F32);
  G().embedding(dev(idh), dev(table), out);
  EXPECT_EQ(rel_err(out, ref), 0.0);
  Tensor dout = rnd({7, D}, 31), dt0 = rnd({V, D}, 32);
  Tensor rdt = to_f32_host(dt0), gdt = dev(dt0);
  C().embedding_backward(idh, dout, rdt);
  G().embedding_backward(dev(idh), dev(dout), gdt);
  EXPECT_LT(rel_err(gdt, rdt), 1e-6);
  Tensor good_ids = dev(idh);
  idh.data<int32_t>()[3] = 300;
  // Device-side data errors surface at the next synchronizing call, once, and name the op.
  Tensor bad_ids = dev(idh);
  G().embedding(bad_ids, dev(table), out);
  try {
    G().synchronize();
    ADD_FAILURE() << "an out-of-range id was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embedding"), std::string::npos) << e.what();
  }
  G().synchronize();  // reported once: the backend is usable again
  G().embedding(good_ids, dev(table), out);
  EXPECT_NO_THROW(G().synchronize());
}

TEST(CudaOps, RmsnormForwardBackward) {
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t R : {int64_t(1), int64_t(131)}) {
      const int64_t D = 320;
      Tensor x = rnd({R, D}, 40, dt), w = rnd({D}, 41), g = rnd({R, D}, 42, dt);
      Tensor ro = Tensor::empty({R, D}, dt), rr = Tensor::empty({R}, DType::F32);
      C().rmsnorm(x, w, 1e-6f, ro, &rr);
      Tensor go = poisoned({R, D}, dt), gr = poisoned({R}, DType::F32);
      G().rmsnorm(dev(x), dev(w), 1e-6f, go, &gr);
      const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
      EXPECT_LT(rel_err(go, ro), tol);
      EXPECT_LT(rel_err(gr, rr), 1e-5);
      Tensor dw0 = rnd({D}, 43);
      Tensor rdx = Tensor::empty({R, D}, dt), rdw = to_f32_host(dw0);
      C().rmsnorm_backward(g, x, w, rr, rdx, rdw);
      Tensor gdx = poisoned({R, D}, dt), gdw = dev(dw0);
      G().rmsnorm_backward(dev(g), dev(x), dev(w), gr, gdx, gdw);
      EXPECT_LT(rel_err(gdx, rdx), dt == DType::F32 ? 1e-5 : 2e-2);
      EXPECT_LT(rel_err(gdw, rdw), dt == DType::F32 ? 1e-5 : 1e-2);
    }
}

TEST(CudaOps, RopeForwardAndInverse) {
  const int64_t T = 19, H = 3, hd = 64;
  RopeParams rp;
  for (int i = 0; i < hd / 2; ++i) rp.inv_freq.push_back(std::pow(10000.0f, -2.0f * i / hd));
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>((t * 397) % 4000);
  Tensor ph = Tensor::empty({T}, DType::I32);
  std::memcpy(ph.raw(), pos.data(), T * 4);
  for (bool inverse : {false, true}) {
    Tensor x = rnd({T, H, hd}, 50 + inverse);
    Tensor r = to_f32_host(x), g = dev(x);
    C().rope(r, ph, rp, inverse);
    G().rope(g, dev(ph), rp, inverse);
    EXPECT_LT(rel_err(g, r), 1e-5);
  }
}

// The kernels for q/k-norm and RoPE at the model's head shapes: RMSNorm over rows of D <= 256 (one
// warp per row) and RoPE with several heads per thread, against the CPU.
TEST(CudaOps, HeadNormAndRopeAtModelShapes) {
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t D : {int64_t(128), int64_t(64), int64_t(40), int64_t(256)})
      for (int64_t R : {int64_t(1), int64_t(9), int64_t(4099)}) {
        SCOPED_TRACE(std::to_string(R) + " rows of " + std::to_string(D));
        Tensor x = rnd({R, D}, 60, dt), w = rnd({D}, 61), g = rnd({R, D}, 62, dt);
        Tensor ro = Tensor::empty({R, D}, dt), rr = Tensor::empty({R}, DType::F32);
        C().rmsnorm(x, w, 1e-6f, ro, &rr);
        Tensor go = poisoned({R, D}, dt), gr = poisoned({R}, DType::F32);
        G().rmsnorm(dev(x), dev(w), 1e-6f, go, &gr);
        EXPECT_LT(rel_err(go, ro), dt == DType::F32 ? 1e-6 : 1e-2);
        EXPECT_LT(rel_err(gr, rr), 1e-6);
        Tensor rdx = Tensor::empty({R, D}, dt), rdw = Tensor::zeros({D}, DType::F32);
        C().rmsnorm_backward(g, x, w, rr, rdx, rdw);
        Tensor gdx = poisoned({R, D}, dt), gdw = dev(Tensor::zeros({D}, DType::F32));
        G().rmsnorm_backward(dev(g), dev(x), dev(w), gr, gdx, gdw);
        EXPECT_LT(rel_err(gdx, rdx), dt == DType::F32 ? 1e-5 : 2e-2);
        EXPECT_LT(rel_err(gdw, rdw), dt == DType::F32 ? 1e-5 : 1e-2);
      }
  struct RopeCase { int64_t T, H, hd; };
  for (const RopeCase rc : {RopeCase{37, 16, 128}, RopeCase{300, 8, 128}, RopeCase{5, 32, 64}, RopeCase{3, 1, 64}}) {
    SCOPED_TRACE(std::to_string(rc.T) + " x " + std::to_string(rc.H) + " x " + std::to_string(rc.hd));
    RopeParams rp;
    for (int i = 0; i < rc.hd / 2; ++i) rp.inv_freq.push_back(std::pow(1000000.0f, -2.0f * i / rc.hd));
    std::vector<int32_t> pos(rc.T);
    for (int64_t t = 0; t < rc.T; ++t) pos[t] = static_cast<int32_t>((t * 397) % 4000);
    Tensor ph = Tensor::empty({rc.T}, DType::I32);
    std::memcpy(ph.raw(), pos.data(), rc.T * 4);
    for (DType dt : {DType::F32, DType::BF16})
      for (bool inverse : {false, true}) {
        Tensor x = rnd({rc.T, rc.H, rc.hd}, 70 + inverse, dt);
        Tensor r = to_f32_host(x), gx = poisoned({rc.T, rc.H, rc.hd}, dt);
        G().copy(dev(x), gx);
        C().rope(r, ph, rp, inverse);
        G().rope(gx, dev(ph), rp, inverse);
        EXPECT_LT(rel_err(gx, r), dt == DType::F32 ? 1e-5 : 1e-2) << (inverse ? "inverse" : "forward");
      }
  }
}

TEST(CudaOps, SwigluForwardBackward) {
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor g = rnd({33, 200}, 60, dt, 3.0f), u = rnd({33, 200}, 61, dt), d = rnd({33, 200}, 62, dt);
    Tensor ro = Tensor::empty(g.shape(), dt);
    C().swiglu(g, u, ro);
    Tensor go = poisoned(g.shape(), dt);
    G().swiglu(dev(g), dev(u), go);
    const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
    EXPECT_LT(rel_err(go, ro), tol);
    Tensor rdg = Tensor::empty(g.shape(), dt), rdu = Tensor::empty(g.shape(), dt);
    C().swiglu_backward(d, g, u, rdg, rdu);
    Tensor gdg = poisoned(g.shape(), dt), gdu = poisoned(g.shape(), dt);
    G().swiglu_backward(dev(d), dev(g), dev(u), gdg, gdu);
    EXPECT_LT(rel_err(gdg, rdg), tol);
    EXPECT_LT(rel_err(gdu, rdu), tol);
  }
}

// MoE routing (F32 logits; the selection must agree exactly away from ties, weights 1e-5),
// the permute / un-permute (F32 1e-5, BF16 1e-2) and the weights' gradient.
TEST(CudaOps, MoeRoutingPermuteUnpermute) {
  const int64_t T = 37, E = 12, k = 3, D = 72, R = T * k;
  Tensor logits = rnd({T, E}, 90, DType::F32, 2.0f), dw = rnd({T, k}, 91);
  for (bool renorm : {false, true}) {
    Tensor re = Tensor::empty({T, k}, DType::I32), rw = Tensor::empty({T, k}, DType::F32);
    C().moe_route_softmax(logits, static_cast<int>(k), renorm, re, rw);
    Tensor ge = G().alloc({T, k}, DType::I32), gw = poisoned({T, k}, DType::F32);
    G().moe_route_softmax(dev(logits), static_cast<int>(k), renorm, ge, gw);
    EXPECT_TRUE(bytes_equal(ge, re)) << "renorm " << renorm;
    EXPECT_LT(rel_err(gw, rw), 1e-5);
    Tensor rdz = Tensor::empty({T, E}, DType::F32), gdz = poisoned({T, E}, DType::F32);
    C().moe_route_softmax_backward(logits, re, renorm, dw, rdz);
    G().moe_route_softmax_backward(dev(logits), dev(re), renorm, dev(dw), gdz);
    EXPECT_LT(rel_err(gdz, rdz), 1e-5);
  }
  // DeepSeek-V3 routing: 12 experts in 4 groups, 2 kept, with a correction bias.
  const Tensor bias = rnd({E}, 96, DType::F32, 0.1f);
  for (bool renorm : {false, true}) {
    Tensor re = Tensor::empty({T, k}, DType::I32), rw = Tensor::empty({T, k}, DType::F32);
    C().moe_route_sigmoid(logits, &bias, static_cast<int>(k), 4, 2, renorm, 2.5f, re, rw);
    Tensor ge = G().alloc({T, k}, DType::I32), gw = poisoned({T, k}, DType::F32);
    const Tensor gb = dev(bias);
    G().moe_route_sigmoid(dev(logits), &gb, static_cast<int>(k), 4, 2, renorm, 2.5f, ge, gw);
    EXPECT_TRUE(bytes_equal(ge, re)) << "sigmoid renorm " << renorm;
    EXPECT_LT(rel_err(gw, rw), 1e-5);
    Tensor rdz = Tensor::empty({T, E}, DType::F32), gdz = poisoned({T, E}, DType::F32);
    C().moe_route_sigmoid_backward(logits, re, renorm, 2.5f, dw, rdz);
    G().moe_route_sigmoid_backward(dev(logits), dev(re), renorm, 2.5f, dev(dw), gdz);
    EXPECT_LT(rel_err(gdz, rdz), 1e-5);
  }
  // A permutation of the slots (sorted by a pseudo expert id) and its inverse.
  std::vector<int32_t> row_slot(R), slot_row(R);
  for (int64_t i = 0; i < R; ++i) row_slot[i] = static_cast<int32_t>((i * 7 + 3) % R);
  for (int64_t r = 0; r < R; ++r) slot_row[row_slot[r]] = static_cast<int32_t>(r);
  Tensor rs = Tensor::empty({R}, DType::I32), sr = Tensor::empty({R}, DType::I32);
  std::copy(row_slot.begin(), row_slot.end(), rs.data<int32_t>());
  std::copy(slot_row.begin(), slot_row.end(), sr.data<int32_t>());
  const Tensor w = rnd({R}, 92);
  const Tensor gwt = dev(w);
  for (DType dt : {DType::F32, DType::BF16}) {
    const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
    const Tensor x = rnd({T, D}, 93, dt), y = rnd({R, D}, 94, dt);
    for (const Tensor* wp : {static_cast<const Tensor*>(nullptr), &w}) {
      Tensor rp = Tensor::empty({R, D}, dt), gp = poisoned({R, D}, dt);
      C().moe_permute(x, rs, static_cast<int>(k), wp, rp);
      G().moe_permute(dev(x), dev(rs), static_cast<int>(k), wp ? &gwt : nullptr, gp);
      EXPECT_LT(rel_err(gp, rp), tol);
      Tensor ru = Tensor::empty({T, D}, dt), gu = poisoned({T, D}, dt);
      C().moe_unpermute(y, sr, wp, ru);
      G().moe_unpermute(dev(y), dev(sr), wp ? &gwt : nullptr, gu);
      EXPECT_LT(rel_err(gu, ru), tol);
    }
    Tensor rg = Tensor::empty({R}, DType::F32), gg = poisoned({R}, DType::F32);
    C().moe_unpermute_backward_weights(x, y, sr, rg);
    G().moe_unpermute_backward_weights(dev(x), dev(y), dev(sr), gg);
    EXPECT_LT(rel_err(gg, rg), dt == DType::F32 ? 1e-5 : 1e-3);
  }
  // An out-of-range index is an error (raised at the next synchronizing call at the latest).
  Tensor bad = Tensor::empty({R}, DType::I32);
  std::copy(slot_row.begin(), slot_row.end(), bad.data<int32_t>());
  bad.data<int32_t>()[5] = static_cast<int32_t>(R);
  Tensor gu = poisoned({T, D}, DType::F32);
  EXPECT_THROW(
      {
        G().moe_unpermute(dev(rnd({R, D}, 95)), dev(bad), nullptr, gu);
        G().synchronize();
      },
      Error);
}

TEST(CudaOps, AdamW) {
  AdamWParams p;
  p.lr = 1e-2f;
  p.weight_decay = 0.01f;
  p.step = 3;
  Tensor w = rnd({1000}, 70), g = rnd({1000}, 71), m = rnd({1000}, 72, DType::F32, 0.1f);
  Tensor v = rnd({1000}, 73);
  for (int64_t i = 0; i < 1000; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
  Tensor rw = to_f32_host(w), rm = to_f32_host(m), rv = to_f32_host(v);
  C().adamw(rw, g, rm, rv, p);
  Tensor gw = dev(w), gm = dev(m), gv = dev(v);
  G().adamw(gw, dev(g), gm, gv, p);
  EXPECT_LT(rel_err(gw, rw), 1e-6);
  EXPECT_LT(rel_err(gm, rm), 1e-6);
  EXPECT_LT(rel_err(gv, rv), 1e-6);
}

// ---- attention --------------------------------------------------------------------------------

TEST(CudaAttention, ForwardBackwardRaggedGqa) {
  struct Case {
    int Hq, Hkv, hd;
    std::vector<int32_t> cu;
  };
  const Case cases[] = {{4, 2, 64, {0, 1, 17, 50}}, {2, 2, 128, {0, 40, 41}}, {6, 1, 80, {0, 23}}};
  uint32_t seed = 80;
  for (const Case& c : cases)
    for (DType dt : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(::testing::Message() << "Hq " << c.Hq << " Hkv " << c.Hkv << " hd " << c.hd << " "
                                        << dtype_name(dt));
      const int64_t T = c.cu.back();
      const float sc = 1.0f / std::sqrt(static_cast<float>(c.hd));
      Tensor q = rnd({T, c.Hq, c.hd}, seed++, dt), k = rnd({T, c.Hkv, c.hd}, seed++, dt);
      Tensor v = rnd({T, c.Hkv, c.hd}, seed++, dt), dout = rnd({T, c.Hq, c.hd}, seed++, dt);
      Tensor ro = Tensor::empty(q.shape(), dt), rl = Tensor::empty({c.Hq, T}, DType::F32);
      C().attention(q, k, v, c.cu, sc, ro, rl);
      Tensor go = poisoned(q.shape(), dt), gl = poisoned({c.Hq, T}, DType::F32);
      G().attention(dev(q), dev(k), dev(v), c.cu, sc, go, gl);
      const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
      EXPECT_LT(rel_err(go, ro), tol);
      EXPECT_LT(rel_err(gl, rl), 1e-5);
      Tensor rdq = Tensor::empty(q.shape(), dt), rdk = Tensor::empty(k.shape(), dt), rdv = Tensor::empty(k.shape(), dt);
      C().attention_backward(dout, q, k, v, ro, rl, c.cu, sc, rdq, rdk, rdv);
      Tensor gdq = poisoned(q.shape(), dt), gdk = poisoned(k.shape(), dt), gdv = poisoned(k.shape(), dt);
      G().attention_backward(dev(dout), dev(q), dev(k), dev(v), dev(ro), dev(rl), c.cu, sc, gdq, gdk, gdv);
      const double btol = dt == DType::F32 ? 1e-4 : 3e-2;
      EXPECT_LT(rel_err(gdq, rdq), btol);
      EXPECT_LT(rel_err(gdk, rdk), btol);
      EXPECT_LT(rel_err(gdv, rdv), btol);
    }
}

// The tensor-core flash path (BF16 activations, head_dim 64 / 128): packed ragged sequences
// (lengths 1, 17, 64, 130, 300: partial, exact and multi-tile 64-token tiles, tiles starting
// off a multiple of 64), GQA ratio 4, against the CPU op on the same BF16 inputs and against
// the simple CUDA kernels (FP8RL_CUDA_ATTENTION=simple). BF16 class: P and dS are rounded to
// BF16 before their tensor-core products, so 1e-2 forward and 3e-2 backward; lse 1e-5 (the
// scores are exact BF16 products accumulated in FP32).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

TEST(CudaAttention, FlashBf16RaggedGqaMatchesCpuAndSimple) {
  const std::vector<int32_t> cu = {0, 1, 18, 82, 212, 512};
  const int Hq = 8, Hkv = 2;
  const int64_t T = cu.back();
  const DType dt = DType::BF16;
  uint32_t seed = 300;
  for (int hd : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "hd " << hd);
    const float sc = 1.0f / std::sqrt(static_cast<float>(hd));
    // q scaled by 2: sharper softmax rows, so a masking or rescaling error shows.
    Tensor q = rnd({T, Hq, hd}, seed++, dt, 2.0f), k = rnd({T, Hkv, hd}, seed++, dt);
    Tensor v = rnd({T, Hkv, hd}, seed++, dt), dout = rnd({T, Hq, hd}, seed++, dt);
    Tensor ro = Tensor::empty(q.shape(), dt), rl = Tensor::empty({Hq, T}, DType::F32);
    C().attention(q, k, v, cu, sc, ro, rl);
    Tensor rdq = Tensor::empty(q.shape(), dt), rdk = Tensor::empty(k.shape(), dt), rdv = Tensor::empty(k.shape(), dt);
    C().attention_backward(dout, q, k, v, ro, rl, cu, sc, rdq, rdk, rdv);

    Tensor dq_ = dev(q), dk_ = dev(k), dv_ = dev(v), dg_ = dev(dout), dro = dev(ro), drl = dev(rl);
    struct Out {
      Tensor o, l, dq, dk, dv;
    };
    auto run = [&](const char* mode) {
      ScopedEnv env_mode("FP8RL_CUDA_ATTENTION", mode);
      Out r{poisoned(q.shape(), dt), poisoned({Hq, T}, DType::F32), poisoned(q.shape(), dt), poisoned(k.shape(), dt),
            poisoned(k.shape(), dt)};
      G().attention(dq_, dk_, dv_, cu, sc, r.o, r.l);
      // Backward from the CPU's out / lse, so that both paths see identical inputs.
      G().attention_backward(dg_, dq_, dk_, dv_, dro, drl, cu, sc, r.dq, r.dk, r.dv);
      return r;
    };
    const Out f = run("flash"), s = run("simple");
    for (const Out* o : {&f, &s}) {
      SCOPED_TRACE(o == &f ? "flash" : "simple");
      EXPECT_LT(rel_err(o->o, ro), 1e-2);
      EXPECT_LT(rel_err(o->l, rl), 1e-5);
      EXPECT_LT(rel_err(o->dq, rdq), 3e-2);
      EXPECT_LT(rel_err(o->dk, rdk), 3e-2);
      EXPECT_LT(rel_err(o->dv, rdv), 3e-2);
    }
    EXPECT_LT(rel_err(f.o, s.o), 1e-2);
    EXPECT_LT(rel_err(f.dq, s.dq), 3e-2);
    EXPECT_LT(rel_err(f.dk, s.dk), 3e-2);
    EXPECT_LT(rel_err(f.dv, s.dv), 3e-2);
    std::printf("  flash hd %d: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e (simple: out %.2e dq %.2e dk %.2e dv %.2e)\n",
                hd, rel_err(f.o, ro), rel_err(f.l, rl), rel_err(f.dq, rdq), rel_err(f.dk, rdk), rel_err(f.dv, rdv),
                rel_err(s.o, ro), rel_err(s.dq, rdq), rel_err(s.dk, rdk), rel_err(s.dv, rdv));
  }
}

// ---- fused log-probabilities ---------------------------------------------------------------

TEST(CudaLogprobs, ForwardBackwardMatchCpu) {
  const int64_t T = 37, D = 256, V = 3000;
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16}) {
    SCOPED_TRACE(linear_mode_name(mode));
    LinearSpec spec{mode, false};
    Tensor h = rnd({T, D}, 90), W = rnd({V, D}, 91, DType::F32, 0.1f), dl = rnd({T}, 92);
    std::vector<int32_t> tg(T);
    for (int64_t t = 0; t < T; ++t) tg[t] = static_cast<int32_t>((t * 977 + 5) % V);
    Tensor th = Tensor::empty({T}, DType::I32);
    std::memcpy(th.raw(), tg.data(), T * 4);
    const float temp = 0.7f;
    Tensor rl = Tensor::empty({T}, DType::F32), rz = Tensor::empty({T}, DType::F32), re = Tensor::empty({T}, DType::F32);
    C().token_logprobs(h, W, th, temp, spec, rl, rz, &re);
    Tensor gl = poisoned({T}, DType::F32), gz = poisoned({T}, DType::F32), ge = poisoned({T}, DType::F32);
    G().token_logprobs(dev(h), dev(W), dev(th), temp, spec, gl, gz, &ge);
    EXPECT_LT(rel_err(gl, rl), 1e-4);
    EXPECT_LT(rel_err(gz, rz), 1e-5);
    EXPECT_LT(rel_err(ge, re), 1e-4);
    Tensor dW0 = rnd({V, D}, 93, DType::F32, 0.01f);
    Tensor rdh = Tensor::empty({T, D}, DType::F32), rdW = to_f32_host(dW0);
    C().token_logprobs_backward(h, W, th, temp, spec, rz, dl, rdh, &rdW);
    Tensor gdh = poisoned({T, D}, DType::F32), gdW = dev(dW0);
    G().token_logprobs_backward(dev(h), dev(W), dev(th), temp, spec, gz, dev(dl), gdh, &gdW);
    EXPECT_LT(rel_err(gdh, rdh), 1e-4);
    EXPECT_LT(rel_err(gdW, rdW), 1e-4);
  }
}

// ---- generation: KV cache, paged attention, sampling -----------------------------------------

TEST(CudaGeneration, KvWriteBitwiseAndPagedAttention) {
  const int L = 2, pages = 12, ps = 4, Hkv = 2, hd = 64, Hq = 4;
  // Two sequences: lengths 9 and 6, pages scattered.
  const std::vector<std::vector<int32_t>> page_lists = {{7, 2, 9}, {0, 11}};
  const std::vector<int32_t> lens = {9, 6};
  std::vector<int32_t> seq, pos, slots;
  for (int b = 0; b < 2; ++b)
    for (int p = 0; p < lens[b]; ++p) {
      seq.push_back(b);
      pos.push_back(p);
      slots.push_back(page_lists[b][p / ps] * ps + p % ps);
    }
  const int64_t T = static_cast<int64_t>(seq.size());
  auto i32 = [](const std::vector<int32_t>& v, const Shape& s) {
    Tensor t = Tensor::empty(s, DType::I32);
    std::memcpy(t.raw(), v.data(), v.size() * 4);
    return t;
  };
  std::vector<int32_t> table = {7, 2, 9, 0, 11, -1};
  PagedBatch hb{i32(seq, {T}), i32(pos, {T}), i32(slots, {T}), i32(table, {2, 3}), 9};
  PagedBatch db{dev(hb.token_seq), dev(hb.token_pos), dev(hb.slots), dev(hb.page_table), 9};
  for (DType kdt : {DType::F32, DType::BF16, DType::E4M3})
    for (bool fp8q : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(kdt) << " fp8_attention " << fp8q);
      KvCache hc = C().alloc_kv_cache(L, pages, ps, Hkv, hd, kdt);
      KvCache gc = G().alloc_kv_cache(L, pages, ps, Hkv, hd, kdt);
      Tensor ks = rnd({L, Hkv}, 100), vs = rnd({L, Hkv}, 101);
      for (int64_t i = 0; i < L * Hkv; ++i) {
        ks.data<float>()[i] = 0.01f + std::fabs(ks.data<float>()[i]) * 0.02f;
        vs.data<float>()[i] = 0.01f + std::fabs(vs.data<float>()[i]) * 0.02f;
      }
      C().copy(ks, hc.k_scale);
      C().copy(vs, hc.v_scale);
      G().copy(ks, gc.k_scale);
      G().copy(vs, gc.v_scale);
      for (int l = 0; l < L; ++l) {  // zero the pools so untouched slots compare equal
        C().fill(hc.k[l], 0.0f); C().fill(hc.v[l], 0.0f);
        G().fill(gc.k[l], 0.0f); G().fill(gc.v[l], 0.0f);
      }
      const int layer = 1;
      Tensor k = rnd({T, Hkv, hd}, 102, DType::F32, 2.0f), v = rnd({T, Hkv, hd}, 103, DType::F32, 2.0f);
      C().kv_write(hc, layer, k, v, hb);
      G().kv_write(gc, layer, dev(k), dev(v), db);
      EXPECT_TRUE(bytes_equal(gc.k[layer], hc.k[layer]));
      EXPECT_TRUE(bytes_equal(gc.v[layer], hc.v[layer]));
      Tensor q = rnd({T, Hq, hd}, 104);
      const float sc = 1.0f / 8.0f;
      Tensor ro = Tensor::empty(q.shape(), DType::F32);
      C().attention_paged(hc, layer, q, hb, sc, fp8q, ro);
      Tensor go = poisoned(q.shape(), DType::F32);
      G().attention_paged(gc, layer, dev(q), db, sc, fp8q, go);
      EXPECT_LT(rel_err(go, ro), 1e-5);
    }
}

// The GPU sampler (no sort: radix search on order keys) draws the CPU reference's token for the
// same uniforms: greedy, plain, top-k, top-p, both, on continuous logits (well separated) and
// on integer logits (many exact ties: the lower id comes first), several vocabulary sizes.
TEST(CudaGeneration, SampleMatchesCpu) {
  for (int64_t V : {int64_t(1000), int64_t(1), int64_t(50000)}) {
    const int64_t B = 12;
    SCOPED_TRACE(::testing::Message() << "V " << V);
    Tensor lg = rnd({B, V}, 110 + static_cast<uint32_t>(V), DType::F32, 3.0f);
    for (int64_t j = 0; j < V; ++j) {  // rows 8..11: integer logits, many exact ties
      for (int64_t b = 8; b < 12; ++b) lg.data<float>()[b * V + j] = std::round(lg.data<float>()[b * V + j]);
    }
    if (V > 10) lg.data<float>()[5 * V + 7] = -INFINITY;  // a masked token
    const std::vector<float> temp = {0.0f, 1.0f, 0.7f, 1.0f, 1.3f, 1.0f, 0.5f, 2.0f, 1.0f, 1.0f, 0.0f, 0.8f};
    const std::vector<float> top_p = {1.0f, 1.0f, 0.9f, 0.5f, 0.95f, 1.0f, 0.3f, 1.0f, 1.0f, 0.6f, 1.0f, 0.9f};
    const std::vector<int> top_k = {0, 0, 50, 0, 10, 1, 0, 3, 0, 0, 0, 20};
    std::mt19937 gen(5);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int draw = 0; draw < 4; ++draw) {
      std::vector<float> u(B);
      for (float& x : u) x = std::min(ud(gen), 0.99999f);
      if (draw == 0) u[1] = 0.0f;
      Tensor rt = Tensor::empty({B}, DType::I32), rp = Tensor::empty({B}, DType::F32);
      C().sample(lg, temp, top_p, top_k, u, rt, rp);
      Tensor gt = G().alloc({B}, DType::I32), gp = poisoned({B}, DType::F32);
      G().fill(gt, -1.0f);
      G().sample(dev(lg), temp, top_p, top_k, u, gt, gp);
      const std::vector<double> a = vals(gt), r = vals(rt), pa = vals(gp), pr = vals(rp);
      for (int64_t b = 0; b < B; ++b) {
        EXPECT_EQ(a[b], r[b]) << "row " << b << " draw " << draw << " u " << u[b];
        EXPECT_NEAR(pa[b], pr[b], 1e-5 * std::max(1.0, std::fabs(pr[b]))) << "row " << b;
      }
    }
  }
  Tensor bad = rnd({2, 100}, 120);
  bad.data<float>()[150] = NAN;
  Tensor gt = G().alloc({2}, DType::I32), gp = G().alloc({2}, DType::F32);
  EXPECT_THROW(G().sample(dev(bad), {1.0f, 1.0f}, {1.0f, 1.0f}, {0, 0}, {0.5f, 0.5f}, gt, gp), Error);
  EXPECT_THROW(G().sample(dev(rnd({2, 100}, 121)), {1.0f, 1.0f}, {1.0f, 1.0f}, {0, 0}, {0.5f, 1.0f}, gt, gp), Error);
}

// A padded vocabulary (Qwen: 151936 rows, 151669 tokenizer ids): with valid_vocab the GPU
// sampler draws only among the first Vv ids of each row (the padding holds the largest logits
// and -inf: never drawn) the CPU reference's token, which is the token of sampling the first Vv
// columns alone; logp, normalized over all V ids, matches the CPU's. NaN in the padding is an
// error (it is read for logp).
TEST(CudaGeneration, SamplePaddedVocabMatchesCpu) {
  const int64_t B = 16, V = 151936, Vv = 151669;
  Tensor lg = rnd({B, V}, 140, DType::F32, 3.0f);
  Tensor cut = Tensor::empty({B, Vv}, DType::F32);
  float* x = lg.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < V; ++j) {
      float& e = x[b * V + j];
      if (b % 4 == 1) e = bf16_round(e);  // ties
      if (j >= Vv) e = (j - Vv) % 3 == 0 ? 12.0f + e : ((j - Vv) % 3 == 1 ? -INFINITY : e);
      else cut.data<float>()[b * Vv + j] = e;
    }
  }
  std::vector<float> temp(B), top_p(B);
  std::vector<int> top_k(B);
  const float temps[] = {1.0f, 0.7f, 1.0f, 0.0f};
  const float tps[] = {1.0f, 0.9f, 0.5f, 1.0f};
  const int tks[] = {0, 0, 40, 1000};
  for (int64_t b = 0; b < B; ++b) {
    temp[b] = temps[b % 4];
    top_p[b] = tps[(b / 4) % 4];
    top_k[b] = tks[(b / 2) % 4];
  }
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  const Tensor dlg = dev(lg);
  for (int draw = 0; draw < 2; ++draw) {
    std::vector<float> u(B);
    for (float& e : u) e = std::min(ud(gen), 0.99999f);
    u[0] = 0.0f;
    u[2] = 0.99999f;
    Tensor rt = Tensor::empty({B}, DType::I32), rp = Tensor::empty({B}, DType::F32);
    C().sample(lg, temp, top_p, top_k, u, rt, rp, Vv);
    Tensor ct = Tensor::empty({B}, DType::I32), cp = Tensor::empty({B}, DType::F32);
    C().sample(cut, temp, top_p, top_k, u, ct, cp);
    Tensor gt = G().alloc({B}, DType::I32), gp = poisoned({B}, DType::F32);
    G().fill(gt, -1.0f);
    G().sample(dlg, temp, top_p, top_k, u, gt, gp, Vv);
    const std::vector<double> a = vals(gt), r = vals(rt), c = vals(ct), pa = vals(gp), pr = vals(rp), pc = vals(cp);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_LT(a[b], Vv) << "row " << b;
      EXPECT_EQ(r[b], c[b]) << "row " << b;
      if (temp[b] > 0) {
        EXPECT_LT(pr[b], pc[b] - 1.0) << "row " << b << ": the padding carries most of the mass";
      }
      EXPECT_EQ(a[b], r[b]) << "row " << b << " draw " << draw << " u " << u[b];
      EXPECT_NEAR(pa[b], pr[b], 1e-5 * std::max(1.0, std::fabs(pr[b]))) << "row " << b;
    }
  }
  Tensor gt = G().alloc({B}, DType::I32), gp = G().alloc({B}, DType::F32);
  EXPECT_THROW(G().sample(dlg, temp, top_p, top_k, std::vector<float>(B, 0.5f), gt, gp, V + 1), Error);
  lg.data<float>()[3 * V + Vv + 5] = NAN;
  EXPECT_THROW(G().sample(dev(lg), temp, top_p, top_k, std::vector<float>(B, 0.5f), gt, gp, Vv), Error);
}

// A Llama-3 sized vocabulary: the digit search over 128256 keys, rows of bf16-rounded logits
// (many exact ties), a masked half, top-k and top-p, greedy, uniforms at 0 and near 1.
TEST(CudaGeneration, SampleLargeVocabMatchesCpu) {
  const int64_t B = 64, V = 128256;
  Tensor lg = rnd({B, V}, 130, DType::F32, 4.0f);
  float* x = lg.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < V; ++j) {
      float& e = x[b * V + j];
      if (b % 4 == 1) e = bf16_round(e);  // ties
      if (b % 8 == 2 && j % 2 == 0) e = -INFINITY;                      // masked
      if (b % 8 == 3) e *= 3.0f;                                          // peaked
    }
  }
  std::vector<float> temp(B), top_p(B);
  std::vector<int> top_k(B);
  const float temps[] = {1.0f, 0.7f, 1.0f, 1.3f, 0.0f, 1.0f, 0.6f, 1.0f};
  const float tps[] = {1.0f, 1.0f, 0.9f, 0.95f, 1.0f, 0.5f, 1.0f, 0.8f};
  const int tks[] = {0, 0, 0, 40, 0, 0, 1000, 7};
  for (int64_t b = 0; b < B; ++b) {
    temp[b] = temps[b % 8];
    top_p[b] = tps[(b / 8) % 8];
    top_k[b] = tks[(b / 3) % 8];
  }
  std::mt19937 gen(9);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  const Tensor dlg = dev(lg);
  for (int draw = 0; draw < 3; ++draw) {
    std::vector<float> u(B);
    for (float& e : u) e = std::min(ud(gen), 0.99999f);
    u[0] = 0.0f;
    u[1] = 0.99999f;
    Tensor rt = Tensor::empty({B}, DType::I32), rp = Tensor::empty({B}, DType::F32);
    C().sample(lg, temp, top_p, top_k, u, rt, rp);
    Tensor gt = G().alloc({B}, DType::I32), gp = poisoned({B}, DType::F32);
    G().fill(gt, -1.0f);
    G().sample(dlg, temp, top_p, top_k, u, gt, gp);
    const std::vector<double> a = vals(gt), r = vals(rt), pa = vals(gp), pr = vals(rp);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(a[b], r[b]) << "row " << b << " draw " << draw << " u " << u[b];
      EXPECT_NEAR(pa[b], pr[b], 1e-5 * std::max(1.0, std::fabs(pr[b]))) << "row " << b;
    }
  }
}

}  // namespace
}  // namespace fp8rl
