// The CUDA backend's own machinery, beside the op table (tests/ops/op_table.h, run against the
// CPU by test_cuda_op_table.cpp, holds every op's parity test): device memory (the pool, out of
// memory, tensors outliving their backend) and the quantizer's GPU-only layouts (scales in
// cuBLASLt's VEC128 layout, transposes padded for the wgrad GEMM).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/op_table.h"
#include "quant/quant.h"

namespace fp8rl {
namespace {

using test::rnd;
using test::rnd_wide;

Backend& G() {
  static std::unique_ptr<Backend> gpu = make_cuda_backend(0);
  return *gpu;
}
Tensor dev(const Tensor& h) { return G().to_device(h); }
Tensor host(const Tensor& d) { return G().to_host(d); }
std::vector<double> vals(const Tensor& t) { return test::values(t.device() == DeviceKind::CUDA ? host(t) : t); }

bool bytes_equal(const Tensor& a, const Tensor& b) {
  Tensor x = a.device() == DeviceKind::CUDA ? host(a) : a;
  Tensor y = b.device() == DeviceKind::CUDA ? host(b) : b;
  return x.nbytes() == y.nbytes() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// ---- memory ----------------------------------------------------------------------------------

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

// ---- quantization: GPU-only layouts -----------------------------------------------------

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

// ---- column sums: the norm weight and bias gradients ------------------------------------

// rmsnorm_backward's dw and linear_backward's dbias sum over rows in per-chunk partials added in
// a fixed order (no atomics): two runs give the same bits, at row counts that use 1 and 64 chunks,
// and at the q/k-norm and hidden widths of the fused RMSNorm backward (a warp per row, a block per
// row; hundreds of partial rows), each within 1e-5 of a double-precision sum (every row counts
// once).
TEST(CudaColumnSums, NormWeightAndBiasGradientsAreTheSameBitsEveryRun) {
  const std::pair<int64_t, int64_t> shapes[] = {{5, 384}, {1000, 384}, {4099, 128}, {600, 2048}};
  for (const auto& [R, D] : shapes) {
    const Tensor x = rnd({R, D}, 31, DType::BF16), dout = rnd({R, D}, 32, DType::BF16);
    const Tensor w = rnd({D}, 33);
    Tensor rstd = rnd({R}, 34);
    for (int64_t r = 0; r < R; ++r) rstd.data<float>()[r] = std::fabs(rstd.data<float>()[r]) + 0.5f;
    std::vector<Tensor> dws, dbs;
    for (int run = 0; run < 2; ++run) {
      Tensor dw = G().alloc({D}, DType::F32), dx = G().alloc({R, D}, DType::BF16);
      G().fill(dw, 0.0f);
      G().rmsnorm_backward(dev(dout), dev(x), dev(w), dev(rstd), dx, dw);
      dws.push_back(host(dw));
      LinearWeight W;
      W.w = dev(rnd({D, D}, 35, DType::F32, 0.05f));
      Tensor db = G().alloc({D}, DType::F32);
      G().fill(db, 0.0f);
      G().linear_backward(dev(dout), dev(x), W, LinearSpec{LinearMode::BF16, false}, nullptr, nullptr, &db);
      dbs.push_back(host(db));
    }
    EXPECT_TRUE(bytes_equal(dws[0], dws[1])) << "rmsnorm dw, " << R << " x " << D;
    EXPECT_TRUE(bytes_equal(dbs[0], dbs[1])) << "dbias, " << R << " x " << D;
    const std::vector<float> xs = to_float_vector(x), gs = to_float_vector(dout), rs = to_float_vector(rstd);
    for (int64_t d = 0; d < D; ++d) {
      double sw = 0, sb = 0, mag = 0, magw = 0;
      for (int64_t r = 0; r < R; ++r) {
        sw += double(gs[r * D + d]) * xs[r * D + d] * rs[r];
        sb += gs[r * D + d];
        mag += std::fabs(double(gs[r * D + d]));
        magw += std::fabs(double(gs[r * D + d]) * xs[r * D + d] * rs[r]);
      }
      ASSERT_NEAR(dbs[0].data<float>()[d], sb, 1e-5 * (1 + mag)) << "dbias column " << d << ", " << R << " x " << D;
      ASSERT_NEAR(dws[0].data<float>()[d], sw, 1e-5 * (1 + magw)) << "dw column " << d << ", " << R << " x " << D;
    }
  }
}

// ---- BF16 rounding: the vectorized stores' paired conversion -----------------------------

// F32 -> BF16 through the 8-element kernels (cvt.rn.bf16x2.f32, with bf16_bits_from_float for
// groups of 8 holding a NaN): every value's bits are the host's bf16_from_float, NaN payloads and
// signs, infinities and the values that round up to them included (the op table's convert rows
// check finite values only).
TEST(CudaConvert, Bf16BitsOfNanInfinityAndOverflowAreTheCpus) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {inf, -inf, 3.4028235e38f, -3.4028235e38f, 3.3961776e38f, 1.0f, -0.0f, 1e-40f};
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u, 0x7fbfffffu, 0x7fffffffu}) {
    float f;
    std::memcpy(&f, &nan, 4);
    v.push_back(f);  // NaNs among finite values: their group of 8 takes the bit-level rule
    v.push_back(static_cast<float>(v.size()) * 0.37f);
  }
  while (v.size() % 8 != 0) v.push_back(-2.5f);
  Tensor x = Tensor::empty({static_cast<int64_t>(v.size())}, DType::F32);
  std::memcpy(x.raw(), v.data(), v.size() * 4);
  Tensor y = G().alloc({x.numel()}, DType::BF16);
  G().convert(dev(x), y);
  const Tensor h = host(y);
  for (size_t i = 0; i < v.size(); ++i)
    EXPECT_EQ(reinterpret_cast<const uint16_t*>(h.raw())[i], bf16_from_float(v[i])) << "element " << i;
}

}  // namespace
}  // namespace fp8rl
