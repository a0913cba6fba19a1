// The own sm_90a FP8 block GEMM (fp8_gemm_sm90.cu) against an FP64 host product of the same
// quantized operands, against cuBLASLt's block-scaled kernel, and for the properties the
// consistent mode relies on: deterministic, and each row's result independent of the other rows.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/gemm.h"
#include "core/dtype.h"
#include "quant/quant.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

Tensor random_matrix(int64_t r, int64_t c, uint32_t seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(r * c));
  // Rows of different magnitudes and a few outliers: the scales differ per block.
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j)
      v[static_cast<size_t>(i * c + j)] =
          nd(rng) * std::exp2(spread * static_cast<float>((i * 7 + j / 128) % 5) - spread * 2.0f) *
          ((i + j) % 97 == 0 ? 20.0f : 1.0f);
  return from_float_vector(v, {r, c}, DType::F32);
}

struct Operands {
  QuantTensor ha, hb;  // host
  QuantTensor da, db;  // device copies (A scales row-major [M][kb])
  Tensor da_kb;        // A scales [kb][M]
};

Operands make_operands(cuda::CudaBackend& be, int64_t M, int64_t N, int64_t K, uint32_t seed) {
  Operands o;
  o.ha = quantize_1x128(random_matrix(M, K, seed, 1.5f), false);
  o.hb = quantize_128x128(random_matrix(N, K, seed + 1, 1.0f), false);
  o.da = o.ha, o.db = o.hb;
  o.da.data = be.to_device(o.ha.data), o.da.scales = be.to_device(o.ha.scales);
  o.db.data = be.to_device(o.hb.data), o.db.scales = be.to_device(o.hb.scales);
  const int64_t kb = ceil_div(K, kQuantBlock);
  std::vector<float> t(static_cast<size_t>(kb * M));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < kb; ++b) t[static_cast<size_t>(b * M + m)] = o.ha.scales.data<float>()[m * kb + b];
  o.da_kb = be.to_device(from_float_vector(t, {kb, M}, DType::F32));
  return o;
}

// C[m, n] = sum_k (qa sa)(qb sb) in FP64, and the sum of |terms| (the error scale).
void host_product(const Operands& o, int64_t m, int64_t n, double* value, double* magnitude) {
  const int64_t K = o.ha.cols(), kb = ceil_div(K, kQuantBlock);
  const uint8_t* qa = o.ha.data.data<uint8_t>();
  const uint8_t* qb = o.hb.data.data<uint8_t>();
  double s = 0, a = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double x = static_cast<double>(e4m3_to_float(qa[m * K + k])) * o.ha.scales.data<float>()[m * kb + k / 128];
    const double w =
        static_cast<double>(e4m3_to_float(qb[n * K + k])) * o.hb.scales.data<float>()[(n / 128) * kb + k / 128];
    s += x * w;
    a += std::fabs(x * w);
  }
  *value = s, *magnitude = a;
}

// A device tensor filled with 0xFF bytes (NaN in BF16 and F32): an output the kernel must overwrite
// (the allocator hands back the block the previous run freed, which holds its result).
Tensor poisoned(cuda::CudaBackend& be, const std::vector<int64_t>& shape, DType dt) {
  Tensor c = be.alloc(shape, dt);
  be.synchronize();  // the pool's allocation is ordered on the backend's stream
  EXPECT_EQ(cudaMemset(c.raw(), 0xFF, c.nbytes()), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return c;
}

Tensor run_own(cuda::CudaBackend& be, const Operands& o, int64_t M, int64_t N, int64_t K, DType out, bool kb_major,
               int splits) {
  Tensor c = poisoned(be, {M, N}, out);
  be.gemm().gemm_fp8_own(M, N, K, o.da.data.data<uint8_t>(),
                         kb_major ? o.da_kb.data<float>() : o.da.scales.data<float>(), kb_major,
                         o.db.data.data<uint8_t>(), o.db.scales.data<float>(), c.raw(), out, 1.0f, 0.0f, splits);
  be.synchronize();
  return be.to_host(c);
}

float host_value(const Tensor& c, int64_t i) {
  return c.dtype() == DType::F32 ? c.data<float>()[i] : bf16_to_float(c.data<uint16_t>()[i]);
}

// Rows [r0, r0 + m) of a host matrix, as a new host tensor.
Tensor host_rows(const Tensor& t, int64_t r0, int64_t m) {
  Tensor out = Tensor::empty({m, t.dim(1)}, t.dtype());
  const size_t row = t.nbytes() / static_cast<size_t>(t.dim(0));
  std::memcpy(out.raw(), static_cast<const uint8_t*>(t.raw()) + static_cast<size_t>(r0) * row,
              static_cast<size_t>(m) * row);
  return out;
}

// Row r of a host QuantTensor (1x128 blocks) as a one-row QuantTensor.
QuantTensor host_rows_quant(const QuantTensor& q, int64_t r) {
  QuantTensor o = q;
  o.data = host_rows(q.data, r, 1);
  o.scales = host_rows(q.scales, r, 1);
  return o;
}

struct Shape {
  int64_t M, N, K;
};

// Hopper's FP8 MMA adds the products of a K block with fewer bits than FP32 (measured on the
// H200: ~1e-4 of sum |terms| within one 128-block; DeepSeek-V3's report gives ~14 bits), which
// is why both kernels promote to FP32 every 128 K. So the bound against the exact FP64 product
// is 2^-11 of sum |terms|, and the own kernel must be as close as cuBLASLt's within 25%.
constexpr double kMmaBound = 1.0 / 2048.0;

Tensor run_cublaslt(cuda::CudaBackend& be, const Operands& o, int64_t M, int64_t N, int64_t K) {
  Tensor c = be.alloc({M, N}, DType::F32);
  be.gemm().set_fp8_kernel("cublaslt");
  be.gemm().gemm_fp8(M, N, K, o.da.data.data<uint8_t>(), o.da.scales.data<float>(), o.db.data.data<uint8_t>(),
                     o.db.scales.data<float>(), kQuantBlock, c.raw(), DType::F32, 1.0f, 0.0f);
  be.gemm().set_fp8_kernel("cublaslt");
  be.synchronize();
  return be.to_host(c);
}

// The largest |C - exact| / sum |terms| over a grid of sampled elements.
double max_error(const Operands& o, const Tensor& c, int64_t M, int64_t N) {
  double worst = 0;
  for (int64_t m = 0; m < M; m += std::max<int64_t>(1, M / 9))
    for (int64_t n = 0; n < N; n += std::max<int64_t>(1, N / 37) | 1) {
      double v, mag;
      host_product(o, m, n, &v, &mag);
      worst = std::max(worst, std::fabs(c.data<float>()[m * N + n] - v) / (mag + 1e-30));
    }
  return worst;
}

TEST(CudaFp8Gemm, MatchesTheHostProductAtEveryShapeAndSplit) {
  cuda::CudaBackend be(0, DType::BF16);
  // Ragged M (1, 5, 77, 200, 1000), partial N and K blocks (208, 336, 640), the 1.7B decode and
  // trainer widths, and split-K forced on shapes with few tiles.
  const Shape shapes[] = {{1, 128, 128},    {5, 2048, 2048},   {77, 384, 640},     {200, 208, 336},
                          {64, 4096, 2048}, {256, 2048, 6144}, {1000, 1536, 1024}, {129, 12288, 2048}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K);
    const Operands o = make_operands(be, s.M, s.N, s.K, static_cast<uint32_t>(s.M * 31 + s.N + s.K));
    // cuBLASLt's block mode takes K in multiples of 128 only: elsewhere the bound alone.
    const double lt =
        s.K % kQuantBlock == 0 ? max_error(o, run_cublaslt(be, o, s.M, s.N, s.K), s.M, s.N) : kMmaBound / 1.25;
    const int kb = static_cast<int>(ceil_div(s.K, kQuantBlock));
    for (int splits : {1, 3, kb}) {
      for (bool kb_major : {false, true}) {
        SCOPED_TRACE(testing::Message() << "splits=" << splits << " kb_major=" << kb_major);
        const double own = max_error(o, run_own(be, o, s.M, s.N, s.K, DType::F32, kb_major, splits), s.M, s.N);
        EXPECT_LT(own, kMmaBound);
        EXPECT_LE(own, 1.25 * lt + 1e-6) << "cuBLASLt's error " << lt;
        setenv("FP8RL_FP8_GEMM_BN", "64", 1);  // 64-column tiles (decode M; M > 256 keeps 128)
        const double own64 = max_error(o, run_own(be, o, s.M, s.N, s.K, DType::F32, kb_major, splits), s.M, s.N);
        unsetenv("FP8RL_FP8_GEMM_BN");
        EXPECT_LT(own64, kMmaBound) << "64-column tiles";
        if (splits == 1 && !kb_major)
          std::printf("[ fp8 gemm ] M=%lld N=%lld K=%lld: max |C - exact| / sum|terms|: own %.2e, cuBLASLt %.2e\n",
                      static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K), own, lt);
      }
    }
    // BF16 output: the F32 result rounded once.
    const Tensor c32 = run_own(be, o, s.M, s.N, s.K, DType::F32, false, 1);
    const Tensor c16 = run_own(be, o, s.M, s.N, s.K, DType::BF16, false, 1);
    for (int64_t i = 0; i < s.M * s.N; i += 13)
      ASSERT_EQ(c16.data<uint16_t>()[i], bf16_from_float(c32.data<float>()[i])) << "element " << i;
  }
}

TEST(CudaFp8Gemm, AgreesWithCublasLtAtTrainerShapes) {
  cuda::CudaBackend be(0, DType::BF16);
  for (const Shape& s :
       {Shape{16384, 2048, 2048}, Shape{4096, 12288, 2048}, Shape{16384, 2048, 6144}, Shape{48, 1024, 2048}}) {
    SCOPED_TRACE(testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K);
    const Operands o = make_operands(be, s.M, s.N, s.K, static_cast<uint32_t>(s.M + s.N * 3 + s.K));
    const double own = max_error(o, run_own(be, o, s.M, s.N, s.K, DType::F32, false, 0), s.M, s.N);
    const double lt = max_error(o, run_cublaslt(be, o, s.M, s.N, s.K), s.M, s.N);
    EXPECT_LT(own, kMmaBound);
    EXPECT_LE(own, 1.25 * lt + 1e-6) << "cuBLASLt's error " << lt;
    std::printf("[ fp8 gemm ] M=%lld N=%lld K=%lld: max |C - exact| / sum|terms|: own %.2e, cuBLASLt %.2e\n",
                static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K), own, lt);
  }
}

// GemmEngine's tuned cuBLASLt configurations (decode and prefill sizes): each product's output is
// bitwise the heuristic's configuration's — on the operands it was tuned on and on others after
// it — for the block-scaled FP8 products and BF16 (FP8RL_LT_TUNE=all), at the 1.7B decode shapes
// and a small one.
TEST(CudaGemmTuning, TunedConfigurationsGiveTheHeuristicsBits) {
  cuda::CudaBackend be(0, DType::BF16);
  cuda::GemmEngine& g = be.gemm();
  g.set_fp8_kernel("cublaslt");
  const cuda::GemmEngine::TuneStats before = g.tune_stats();
  int shapes = 0;
  for (const Shape& s : {Shape{256, 4096, 2048}, Shape{256, 2048, 2048}, Shape{256, 2048, 6144},
                         Shape{128, 12288, 2048}, Shape{48, 1024, 256}}) {
    SCOPED_TRACE(testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K);
    for (uint32_t seed : {11u, 12u}) {  // seed 11 tunes; 12 runs the tuned configuration
      const Operands o = make_operands(be, s.M, s.N, s.K, seed + static_cast<uint32_t>(s.N));
      // BF16 operands: the dequantized values (any BF16 values do).
      const Tensor ab = be.to_device(from_float_vector(to_float_vector(dequantize(o.ha)), {s.M, s.K}, DType::BF16));
      const Tensor bb = be.to_device(from_float_vector(to_float_vector(dequantize(o.hb)), {s.N, s.K}, DType::BF16));
      Tensor c8[2] = {be.alloc({s.M, s.N}, DType::BF16), be.alloc({s.M, s.N}, DType::BF16)};
      Tensor c16[2] = {be.alloc({s.M, s.N}, DType::BF16), be.alloc({s.M, s.N}, DType::BF16)};
      for (int tuned = 0; tuned < 2; ++tuned) {
        g.set_tune(tuned == 1 ? cuda::GemmEngine::Tune::All : cuda::GemmEngine::Tune::Off);
        g.gemm_fp8(s.M, s.N, s.K, o.da.data.data<uint8_t>(), o.da.scales.data<float>(), o.db.data.data<uint8_t>(),
                   o.db.scales.data<float>(), kQuantBlock, c8[tuned].raw(), DType::BF16, 1.0f, 0.0f);
        g.gemm(false, true, s.M, s.N, s.K, ab.raw(), bb.raw(), DType::BF16, c16[tuned].raw(), DType::BF16, 1.0f, 0.0f);
      }
      g.set_tune(cuda::GemmEngine::Tune::Fp8);
      const Tensor h8[2] = {be.to_host(c8[0]), be.to_host(c8[1])}, h16[2] = {be.to_host(c16[0]), be.to_host(c16[1])};
      EXPECT_EQ(std::memcmp(h8[0].raw(), h8[1].raw(), h8[0].nbytes()), 0) << "FP8, seed " << seed;
      EXPECT_EQ(std::memcmp(h16[0].raw(), h16[1].raw(), h16[0].nbytes()), 0) << "BF16, seed " << seed;
    }
    shapes += 2;  // one FP8 and one BF16 product per shape
  }
  const cuda::GemmEngine::TuneStats after = g.tune_stats();
  EXPECT_EQ(after.products - before.products, shapes) << "each product tuned once";
  std::printf("[ gemm tune ] %lld products tuned, %lld on another configuration than the heuristic's, %.0f ms\n",
              static_cast<long long>(after.products - before.products),
              static_cast<long long>(after.changed - before.changed), after.ms - before.ms);
}

TEST(CudaFp8Gemm, RowsDoNotDependOnTheOtherRowsAndRunsRepeat) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t M = 600, N = 2048, K = 2048;
  const Operands o = make_operands(be, M, N, K, 7);
  for (int splits : {1, 4}) {
    const Tensor full = run_own(be, o, M, N, K, DType::BF16, false, splits);
    const Tensor again = run_own(be, o, M, N, K, DType::BF16, false, splits);
    ASSERT_EQ(std::memcmp(full.raw(), again.raw(), full.nbytes()), 0) << "two runs differ, splits=" << splits;
    // Rows [r0, r0 + m) as their own product (fewer tiles, BM 64 for m <= 64): the same bits.
    for (const auto& [r0, m] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {37, 5}, {100, 64}, {333, 200}}) {
      Operands sub = o;
      sub.da.data = be.to_device(host_rows(o.ha.data, r0, m));
      sub.da.scales = be.to_device(host_rows(o.ha.scales, r0, m));
      const Tensor part = run_own(be, sub, m, N, K, DType::BF16, false, splits);
      ASSERT_EQ(std::memcmp(part.raw(), full.data<uint16_t>() + r0 * N, part.nbytes()), 0)
          << "rows " << r0 << "+" << m << " differ from the full product, splits=" << splits;
    }
  }
}

// One launch over every group's rows (the mixture-of-experts layout: rows sorted by expert, one
// B per expert) gives bitwise the per-group dense products at one split, empty and one-row
// groups included, and matches the FP64 host product of each group. Seven groups: the tile
// table after seven maps and pointers starts 8 bytes past a 16-byte boundary unless aligned.
// keep_maps (the maps uploaded once and reused) gives the same bits on its first and second call.
TEST(CudaFp8Gemm, GroupedIsBitwiseThePerGroupProducts) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t N = 384, K = 640, kb = ceil_div(K, kQuantBlock);
  const std::vector<int64_t> rows = {0, 1, 77, 130, 300, 64, 19};
  std::vector<int64_t> offsets = {0};
  for (int64_t r : rows) offsets.push_back(offsets.back() + r);
  const int64_t R = offsets.back();
  const QuantTensor ha = quantize_1x128(random_matrix(R, K, 41, 1.5f), false);
  QuantTensor da = ha;
  da.data = be.to_device(ha.data), da.scales = be.to_device(ha.scales);
  std::vector<QuantTensor> hb, db;
  std::vector<const uint8_t*> bp;
  std::vector<const float*> sp;
  for (size_t g = 0; g < rows.size(); ++g) {
    hb.push_back(quantize_128x128(random_matrix(N, K, 50 + static_cast<uint32_t>(g), 1.0f), false));
    QuantTensor d = hb.back();
    d.data = be.to_device(d.data), d.scales = be.to_device(d.scales);
    db.push_back(d);
    bp.push_back(db.back().data.data<uint8_t>());
    sp.push_back(db.back().scales.data<float>());
  }
  for (int bm : {0, 64, 128}) {
    SCOPED_TRACE(testing::Message() << "block_m=" << bm);
    Tensor cg = be.alloc({R, N}, DType::F32);
    be.gemm().gemm_fp8_grouped(offsets, N, K, da.data.data<uint8_t>(), da.scales.data<float>(), false, bp, sp, cg.raw(),
                               DType::F32, 1.0f, 0.0f, bm);
    Tensor cd = be.alloc({R, N}, DType::F32);
    for (size_t g = 0; g < rows.size(); ++g) {
      if (rows[g] == 0) continue;
      const int64_t r0 = offsets[g];
      be.gemm().gemm_fp8_own(rows[g], N, K, da.data.data<uint8_t>() + r0 * K, da.scales.data<float>() + r0 * kb, false,
                             bp[g], sp[g], static_cast<float*>(cd.raw()) + r0 * N, DType::F32, 1.0f, 0.0f, 1,
                             bm == 0 ? 0 : bm);
    }
    be.synchronize();
    const Tensor hg = be.to_host(cg), hd = be.to_host(cd);
    for (int call = 0; call < 2; ++call) {
      Tensor ck = be.alloc({R, N}, DType::F32);
      be.gemm().gemm_fp8_grouped(offsets, N, K, da.data.data<uint8_t>(), da.scales.data<float>(), false, bp, sp,
                                 ck.raw(), DType::F32, 1.0f, 0.0f, bm, /*keep_maps=*/true);
      const Tensor hk = be.to_host(ck);
      EXPECT_EQ(std::memcmp(hk.raw(), hg.raw(), hg.nbytes()), 0) << "keep_maps call " << call << " differs";
    }
    if (bm != 0) {
      EXPECT_EQ(std::memcmp(hg.raw(), hd.raw(), hg.nbytes()), 0) << "grouped differs from the per-group products";
    }
    // Against the FP64 product, beside cuBLASLt's block-scaled kernel on the same groups (the
    // MMA's own accumulation error: this grid samples ~20x more elements than max_error, so its
    // worst case is the tail of the same distribution, and the bound is cuBLASLt's, as above).
    double worst = 0, worst_lt = 0;
    for (size_t g = 0; g < rows.size(); ++g) {
      if (rows[g] == 0) continue;
      const int64_t r0 = offsets[g];
      Tensor cl = be.alloc({rows[g], N}, DType::F32);
      be.gemm().set_fp8_kernel("cublaslt");
      be.gemm().gemm_fp8(rows[g], N, K, da.data.data<uint8_t>() + r0 * K, da.scales.data<float>() + r0 * kb, bp[g],
                         sp[g], kQuantBlock, cl.raw(), DType::F32, 1.0f, 0.0f);
      be.synchronize();
      const Tensor hl = be.to_host(cl);
      for (int64_t r = r0; r < offsets[g + 1]; r += 7)
        for (int64_t n = 0; n < N; n += 5) {
          Operands o;
          o.ha = host_rows_quant(ha, r);
          o.hb = hb[g];
          double v, mag;
          host_product(o, 0, n, &v, &mag);
          worst = std::max(worst, std::fabs(hg.data<float>()[r * N + n] - v) / (mag + 1e-30));
          worst_lt = std::max(worst_lt, std::fabs(hl.data<float>()[(r - r0) * N + n] - v) / (mag + 1e-30));
        }
    }
    std::printf("[ fp8 gemm ] grouped, block_m=%d: max |C - exact| / sum|terms|: own %.2e, cuBLASLt %.2e\n", bm, worst,
                worst_lt);
    EXPECT_LE(worst, 1.25 * worst_lt + 1e-6) << "cuBLASLt's error " << worst_lt;
  }
}

// Every variant of the own kernel computes every tile alike: bitwise the C of one CTA per tile.
// The variants: the persistent grid (the default: at most as many CTAs as fit, each walking its
// share of the tiles with the stage ring running on across them) or one CTA per tile
// (FP8RL_FP8_GEMM_GRID=tile); clusters of 1x1, 2x1, 1x2 and 2x2 CTAs sharing their A and B tiles
// by multicast (FP8RL_FP8_GEMM_CLUSTER); the scales read from global memory or staged in shared
// memory (FP8RL_FP8_GEMM_SCALES); one or two CTAs per SM for 64-row tiles
// (FP8RL_FP8_GEMM_OCCUPANCY). Checked for decode and trainer shapes, tile counts that the cluster
// does not divide, split-K, both tile orders (M <= 256: row blocks fastest), BF16 and F32 output,
// beta, both A-scale layouts, and the grouped product (whose clusters share only A).
TEST(CudaFp8Gemm, EveryGridAndClusterIsBitwiseOneCtaPerTile) {
  cuda::CudaBackend be(0, DType::BF16);
  // A variant: the grid (null: persistent), the cluster shape, where the consumers read the scales.
  struct Variant {
    const char* grid;
    const char* cluster;
    const char* scales;
    const char* occupancy = "1";
    const char* band = "0";
    const char* store = "direct";
    const char* bn = "128";
    const char* pipe = "drain";
    const char* bm = "128";
  };
  auto with = [](const Variant& v, auto&& fn) {
    if (v.grid) setenv("FP8RL_FP8_GEMM_GRID", v.grid, 1);
    else unsetenv("FP8RL_FP8_GEMM_GRID");
    setenv("FP8RL_FP8_GEMM_CLUSTER", v.cluster, 1);
    setenv("FP8RL_FP8_GEMM_SCALES", v.scales, 1);
    setenv("FP8RL_FP8_GEMM_OCCUPANCY", v.occupancy, 1);
    setenv("FP8RL_FP8_GEMM_BAND", v.band, 1);
    setenv("FP8RL_FP8_GEMM_STORE", v.store, 1);
    setenv("FP8RL_FP8_GEMM_BN", v.bn, 1);
    setenv("FP8RL_FP8_GEMM_PIPE", v.pipe, 1);
    setenv("FP8RL_FP8_GEMM_BM", v.bm, 1);
    auto r = fn();
    unsetenv("FP8RL_FP8_GEMM_GRID");
    unsetenv("FP8RL_FP8_GEMM_CLUSTER");
    unsetenv("FP8RL_FP8_GEMM_SCALES");
    unsetenv("FP8RL_FP8_GEMM_OCCUPANCY");
    unsetenv("FP8RL_FP8_GEMM_BAND");
    unsetenv("FP8RL_FP8_GEMM_STORE");
    unsetenv("FP8RL_FP8_GEMM_BN");
    unsetenv("FP8RL_FP8_GEMM_PIPE");
    unsetenv("FP8RL_FP8_GEMM_BM");
    return r;
  };
  std::vector<Variant> variants;
  for (const char* grid : {static_cast<const char*>(nullptr), "tile"})
    for (const char* cluster : {"1x1", "2x1", "1x2", "2x2"})
      for (const char* scales : {"global", "smem"}) {
        variants.push_back({grid, cluster, scales});
        if (cluster[2] == '1') variants.push_back({grid, cluster, scales, "2"});  // 1x1 and 2x1 at two CTAs per SM
      }
  // The tile order in bands of tile columns (3 does not divide the column counts: a narrower last band).
  for (const char* band : {"3", "8"}) {
    variants.push_back({nullptr, "1x1", "smem", "1", band});
    variants.push_back({nullptr, "2x1", "global", "2", band});
    variants.push_back({nullptr, "1x2", "smem", "1", band});
  }
  // The epilogue through shared memory and TMA stores (global scales), every grid, cluster and
  // ring (64-row tiles: 8 stages at one CTA per SM, 3 at two).
  for (const char* grid : {static_cast<const char*>(nullptr), "tile"})
    for (const char* cluster : {"1x1", "2x1", "1x2", "2x2"})
      for (const char* occupancy : {"1", "2"}) variants.push_back({grid, cluster, "global", occupancy, "0", "tma"});
  // 64-column tiles beside the 64-row ones (M <= 256; larger M keeps 128 columns), each ring and
  // store: the m64n64 wgmma gives every element the bits of the m64n128 one.
  for (const char* grid : {static_cast<const char*>(nullptr), "tile"})
    for (const char* occupancy : {"1", "2"})
      for (const char* store : {"direct", "tma"})
        variants.push_back({grid, "1x1", "global", occupancy, "0", store, "64"});
  // The overlapped K loop (the next block's MMAs in flight during each promotion; K-block counts
  // per tile of 1 to 4 mod 4 through the shapes' K and splits): 128-row tiles with the producer
  // warpgroup, 64-row tiles at one CTA per SM (the occupancy asked is overridden), each store and
  // column count.
  for (const char* grid : {static_cast<const char*>(nullptr), "tile"})
    for (const char* store : {"direct", "tma"})
      for (const char* bn : {"128", "64"}) variants.push_back({grid, "1x1", "global", "2", "0", store, bn, "overlap"});
  // 192-row tiles (three consumer warpgroups) where 64-row ones are not taken, each grid and store.
  for (const char* grid : {static_cast<const char*>(nullptr), "tile"})
    for (const char* store : {"direct", "tma"})
      variants.push_back({grid, "1x1", "global", "1", "0", store, "128", "drain", "192"});
  const Variant one_cta{"tile", "1x1", "global"};
  auto name = [](const Variant& v) {
    return std::string("grid ") + (v.grid ? v.grid : "persistent") + ", cluster " + v.cluster + ", scales " + v.scales +
           ", CTAs per SM " + v.occupancy + ", band " + v.band + ", store " + v.store + ", columns " + v.bn +
           ", pipe " + v.pipe + ", rows " + v.bm;
  };
  // N = 144 and 528: a last column tile of 16 columns (its second 64-column store box wholly past N).
  const Shape shapes[] = {{5, 2048, 2048}, {64, 4096, 2048},   {256, 12288, 2048}, {256, 2048, 6144},
                          {130, 640, 384}, {1000, 1536, 1024}, {4096, 2048, 2048}, {77, 384, 640},
                          {200, 528, 384}, {70, 144, 256}};
  for (const Shape& s : shapes) {
    const Operands o = make_operands(be, s.M, s.N, s.K, static_cast<uint32_t>(s.M * 5 + s.N + 3 * s.K));
    for (int splits : {1, 3})
      for (DType out : {DType::BF16, DType::F32}) {
        auto run = [&] { return run_own(be, o, s.M, s.N, s.K, out, false, splits); };
        const Tensor ref = with(one_cta, run);
        for (const Variant& v : variants) {
          SCOPED_TRACE(testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K << " splits=" << splits
                                          << " out=" << dtype_name(out) << " " << name(v));
          const Tensor c = with(v, run);
          ASSERT_EQ(std::memcmp(c.raw(), ref.raw(), c.nbytes()), 0) << "differs from one CTA per tile";
        }
      }
    // beta = 1 over a prior C (the dgrad accumulation), BF16; A's scales in the [kb][M] layout.
    // At one split (the kernel applies beta) and at 3 (the reduction kernel does).
    for (int splits : {1, 3}) {
      auto accumulate = [&] {
        Tensor c = be.to_device(
            from_float_vector(std::vector<float>(static_cast<size_t>(s.M * s.N), 0.25f), {s.M, s.N}, DType::BF16));
        be.gemm().gemm_fp8_own(s.M, s.N, s.K, o.da.data.data<uint8_t>(), o.da_kb.data<float>(), true,
                               o.db.data.data<uint8_t>(), o.db.scales.data<float>(), c.raw(), DType::BF16, 0.5f, 1.0f,
                               splits);
        be.synchronize();
        return be.to_host(c);
      };
      const Tensor ref = with(one_cta, accumulate);
      for (const Variant& v : variants) {
        const Tensor c = with(v, accumulate);
        ASSERT_EQ(std::memcmp(c.raw(), ref.raw(), c.nbytes()), 0)
            << "beta = 1, splits " << splits << ", " << name(v) << ": differs";
      }
    }
  }
  // The grouped product: 40 groups of 0..300 rows (more tiles than SMs); 5 column tiles, so a
  // 1x2 cluster has a tile past the last.
  const int64_t N = 640, K = 1024;
  std::vector<int64_t> offsets = {0};
  for (int g = 0; g < 40; ++g) offsets.push_back(offsets.back() + (g * 37) % 301);
  const int64_t R = offsets.back();
  const QuantTensor ha = quantize_1x128(random_matrix(R, K, 61, 1.5f), false);
  QuantTensor da = ha;
  da.data = be.to_device(ha.data), da.scales = be.to_device(ha.scales);
  std::vector<QuantTensor> db;
  std::vector<const uint8_t*> bp;
  std::vector<const float*> sp;
  for (int g = 0; g < 40; ++g) {
    QuantTensor d = quantize_128x128(random_matrix(N, K, 70 + static_cast<uint32_t>(g), 1.0f), false);
    d.data = be.to_device(d.data), d.scales = be.to_device(d.scales);
    db.push_back(d);
  }
  for (const QuantTensor& d : db) bp.push_back(d.data.data<uint8_t>()), sp.push_back(d.scales.data<float>());
  for (int bm : {64, 128, 192}) {
    auto grouped = [&] {
      Tensor c = poisoned(be, {R, N}, DType::BF16);
      be.gemm().gemm_fp8_grouped(offsets, N, K, da.data.data<uint8_t>(), da.scales.data<float>(), false, bp, sp,
                                 c.raw(), DType::BF16, 1.0f, 0.0f, bm);
      be.synchronize();
      return be.to_host(c);
    };
    const Tensor ref = with(one_cta, grouped);
    for (const Variant& v : variants) {
      const Tensor c = with(v, grouped);
      ASSERT_EQ(std::memcmp(c.raw(), ref.raw(), c.nbytes()), 0)
          << "grouped, block_m=" << bm << ", " << name(v) << ": differs";
    }
  }
}

// ---- The BF16 mode of the own kernel (fp8_gemm.h: ab = BF16) and the device tile table ----

// Sets the environment variables of `env` (name, value) around fn, unsetting them after.
template <class F>
auto with_env(const std::vector<std::pair<const char*, const char*>>& env, F&& fn) {
  for (const auto& [k, v] : env) setenv(k, v, 1);
  auto r = fn();
  for (const auto& [k, v] : env) unsetenv(k);
  return r;
}

// A BF16 host matrix: random_matrix's values rounded to BF16, and those values as floats.
struct Bf16Matrix {
  Tensor host;                // BF16 [r, c]
  std::vector<float> values;  // [r, c]
};
Bf16Matrix random_bf16(int64_t r, int64_t c, uint32_t seed, float spread) {
  Bf16Matrix m;
  m.host = from_float_vector(to_float_vector(random_matrix(r, c, seed, spread)), {r, c}, DType::BF16);
  m.values = to_float_vector(m.host);
  return m;
}

// sum_k a[m, k] b[n, k] in FP64 (the BF16 products are exact in it), and the sum of |terms|.
void host_bf16_product(const Bf16Matrix& a, const Bf16Matrix& b, int64_t K, int64_t m, int64_t n, double* value,
                       double* magnitude) {
  double s = 0, mag = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double t = static_cast<double>(a.values[m * K + k]) * b.values[n * K + k];
    s += t;
    mag += std::fabs(t);
  }
  *value = s, *magnitude = mag;
}

// Indices of [0, count) checked against the host: the first and last three, both sides of every
// tile boundary (tile: 64 rows or 128 columns), and every stride-th.
std::vector<int64_t> sampled(int64_t count, int64_t tile, int64_t stride) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < count; ++i)
    if (i < 3 || i >= count - 3 || i % tile == 0 || i % tile == tile - 1 || i % stride == 0) v.push_back(i);
  return v;
}

// The prior C of the beta = 1 runs: multiples of 1/4 in [-0.75, 0.75], exact in BF16 and F32.
float prior_value(int64_t i) { return 0.25f * static_cast<float>(i % 7 - 3); }
Tensor prior_c(cuda::CudaBackend& be, int64_t M, int64_t N, DType dt) {
  std::vector<float> v(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M * N; ++i) v[static_cast<size_t>(i)] = prior_value(i);
  return be.to_device(from_float_vector(v, {M, N}, dt));
}

// The BF16 own product: C = alpha A B^T (+ C, the prior, when beta = 1), F32 accumulation.
Tensor run_bf16_own(cuda::CudaBackend& be, const Tensor& a, const Tensor& b, int64_t M, int64_t N, int64_t K, DType out,
                    float beta, int splits, int block_m = 0) {
  Tensor c = beta != 0.0f ? prior_c(be, M, N, out) : poisoned(be, {M, N}, out);
  be.gemm().gemm_bf16_own(M, N, K, a.raw(), b.raw(), c.raw(), out, beta != 0.0f ? 0.5f : 1.0f, beta, splits, block_m);
  be.synchronize();
  return be.to_host(c);
}

// G BF16 weights [N, K] on the device (seeds seed, seed + 1, ...) and their pointers: the B
// operands of the grouped tests.
struct GroupWeights {
  std::vector<Tensor> w;
  std::vector<const void*> ptr;
};
GroupWeights bf16_group_weights(cuda::CudaBackend& be, int64_t G, int64_t N, int64_t K, uint32_t seed) {
  GroupWeights gw;
  for (int64_t g = 0; g < G; ++g)
    gw.w.push_back(be.to_device(random_bf16(N, K, seed + static_cast<uint32_t>(g), 1.0f).host));
  for (const Tensor& t : gw.w) gw.ptr.push_back(t.raw());
  return gw;
}

// The BF16 mode against the FP64 product of the same BF16 operands, at M, N and K with partial
// tiles and K blocks (K = 136: 272 bytes a row, two full 64-element stages and a 16-byte one),
// one and three K splits, BF16 and F32 output, beta 0 and 1. The bound:
// - accumulation: the products are exact in FP32; the sum runs as K / 16 wgmma k16 steps, each
//   adding 16 products to the running FP32 value (then the splits' partials, summed by the
//   reduction kernel). If each step loses at most 2 ulps (2^-22) of a value no larger than
//   sum |terms| (rounding or truncating once), K = 2048's 128 steps and 2 more adds lose at most
//   1.02 x 2^-15 sum |terms|, in any order of the sum. The bound, 2^-13 sum |terms| (scaled by
//   alpha), leaves a factor of four for what the hardware does inside a step (not documented);
//   a lost or misplaced k16 step of random signs is an error of about 4 / K of it (2^-9 at
//   K = 2048), and beside a BF16 output about 4 / sqrt(K) of |exact|, both far outside.
// - output: BF16 rounds the FP32 result once (half an ulp: 2^-9 of it), bounded by 2^-8 |exact|
//   with the accumulation's error; F32 output and beta's FMA add a few FP32 ulps: 2^-20 |exact|.
// Every element of a beta = 0 output is also checked to be written (the output starts as NaN).
TEST(CudaFp8Gemm, Bf16OwnMatchesTheHostProduct) {
  cuda::CudaBackend be(0, DType::BF16);
  double worst = 0;  // the largest |C - exact| / (alpha sum |terms|) of the F32 outputs
  for (int64_t M : {5, 64, 256, 1000})
    for (int64_t N : {144, 640, 2048})
      for (int64_t K : {136, 1024, 2048}) {
        SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " K=" << K);
        const uint32_t seed = static_cast<uint32_t>(M * 3 + N * 7 + K);
        const Bf16Matrix a = random_bf16(M, K, seed, 1.5f), b = random_bf16(N, K, seed + 1, 1.0f);
        const Tensor da = be.to_device(a.host), db = be.to_device(b.host);
        const std::vector<int64_t> rows = sampled(M, 64, 37), cols = sampled(N, 128, 53);
        std::vector<double> exact(rows.size() * cols.size()), mag(exact.size());
        for (size_t i = 0; i < rows.size(); ++i)
          for (size_t j = 0; j < cols.size(); ++j)
            host_bf16_product(a, b, K, rows[i], cols[j], &exact[i * cols.size() + j], &mag[i * cols.size() + j]);
        for (int splits : {1, 3})
          for (DType out : {DType::BF16, DType::F32})
            for (float beta : {0.0f, 1.0f}) {
              SCOPED_TRACE(testing::Message() << "splits=" << splits << " out=" << dtype_name(out) << " beta=" << beta);
              const Tensor c = run_bf16_own(be, da, db, M, N, K, out, beta, splits);
              const double alpha = beta != 0.0f ? 0.5 : 1.0;
              int bad = 0;
              for (size_t i = 0; i < rows.size(); ++i)
                for (size_t j = 0; j < cols.size(); ++j) {
                  const int64_t e = rows[i] * N + cols[j];
                  const double want = alpha * exact[i * cols.size() + j] + beta * prior_value(e);
                  const double got = host_value(c, e), scale = alpha * mag[i * cols.size() + j];
                  const double tol =
                      (out == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -20)) * std::fabs(want) +
                      std::ldexp(1.0, -13) * scale + 1e-30;
                  if (out == DType::F32) worst = std::max(worst, std::fabs(got - want) / (scale + 1e-30));
                  if (!(std::fabs(got - want) <= tol) && bad++ < 5)
                    ADD_FAILURE() << "C[" << rows[i] << ", " << cols[j] << "] = " << got << ", exact " << want
                                  << ", tolerance " << tol;
                }
              EXPECT_EQ(bad, 0) << "elements outside the bound";
              if (beta == 0.0f) {
                int64_t unwritten = 0;
                for (int64_t e = 0; e < M * N; ++e) unwritten += !std::isfinite(host_value(c, e));
                EXPECT_EQ(unwritten, 0) << "elements left unwritten (NaN)";
              }
            }
      }
  std::printf("[ bf16 gemm ] max |C - exact| / sum|terms| (F32 C): %.2e (bound %.2e)\n", worst, std::ldexp(1.0, -13));
}

// The BF16 mode's variants compute every tile alike: bitwise the C of one CTA per tile with the
// direct stores, for the persistent grid (with enough tiles that its CTAs walk several) and one
// CTA per tile, each epilogue (the TMA store applies to BF16 C at beta 0, one split), 64- and
// 128-row tiles (block_m: each row's MMAs are the same), split-K, BF16 and F32 output, beta.
TEST(CudaFp8Gemm, Bf16EveryGridIsBitwiseOneCtaPerTile) {
  cuda::CudaBackend be(0, DType::BF16);
  using Env = std::vector<std::pair<const char*, const char*>>;
  const Env one_cta = {{"FP8RL_FP8_GEMM_GRID", "tile"}, {"FP8RL_FP8_GEMM_STORE", "direct"}};
  const std::vector<Env> variants = {{},
                                     {{"FP8RL_FP8_GEMM_STORE", "direct"}},
                                     {{"FP8RL_FP8_GEMM_GRID", "tile"}},
                                     {{"FP8RL_FP8_GEMM_GRID", "tile"}, {"FP8RL_FP8_GEMM_STORE", "tma"}}};
  const Shape shapes[] = {{5, 2048, 1024}, {256, 12288, 1024}, {200, 640, 136}, {1000, 144, 2048}, {4096, 2048, 1024}};
  for (const Shape& s : shapes) {
    const Bf16Matrix a = random_bf16(s.M, s.K, static_cast<uint32_t>(s.M + s.N + s.K), 1.5f);
    const Bf16Matrix b = random_bf16(s.N, s.K, static_cast<uint32_t>(s.M + s.N + s.K + 1), 1.0f);
    const Tensor da = be.to_device(a.host), db = be.to_device(b.host);
    for (int splits : {1, 3})
      for (DType out : {DType::BF16, DType::F32})
        for (float beta : {0.0f, 1.0f}) {
          SCOPED_TRACE(testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K << " splits=" << splits
                                          << " out=" << dtype_name(out) << " beta=" << beta);
          const Tensor ref =
              with_env(one_cta, [&] { return run_bf16_own(be, da, db, s.M, s.N, s.K, out, beta, splits); });
          for (int block_m : {0, 64, 128})
            for (size_t v = 0; v < variants.size(); ++v) {
              const Tensor c = with_env(
                  variants[v], [&] { return run_bf16_own(be, da, db, s.M, s.N, s.K, out, beta, splits, block_m); });
              ASSERT_EQ(std::memcmp(c.raw(), ref.raw(), c.nbytes()), 0)
                  << "block_m " << block_m << ", variant " << v << ": differs from one CTA per tile";
            }
        }
  }
}

// The groups of the grouped tests: 40 groups of 0..300 rows (an empty one included; more tiles
// than SMs); shift rotates the sizes among the groups (the same rows, split differently).
std::vector<int64_t> grouped_offsets(int shift) {
  std::vector<int64_t> offsets = {0};
  for (int g = 0; g < 40; ++g) offsets.push_back(offsets.back() + ((g + shift) % 40 * 37) % 301);
  return offsets;
}

// The tile table fp8_gemm.h describes, for offsets and block_m: {group, first row, group's end, 0}.
std::vector<int32_t> host_tile_table(const std::vector<int64_t>& offsets, int block_m) {
  std::vector<int32_t> t;
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; r += block_m)
      t.insert(t.end(), {static_cast<int32_t>(g), static_cast<int32_t>(r), static_cast<int32_t>(offsets[g + 1]), 0});
  return t;
}

// A device tile table of capacity max_tiles: `table`'s entries (in reverse order when `reversed`:
// the order of the tiles does not matter), then out-of-range garbage that the kernel must never
// read (a group far past the last, rows far past R), and the count.
struct DeviceTable {
  Tensor tiles, count;  // I32 [max_tiles, 4], I32 [1]
  int64_t max_tiles = 0;
};
DeviceTable device_table(cuda::CudaBackend& be, const std::vector<int32_t>& table, int64_t max_tiles, bool reversed) {
  const int64_t n = static_cast<int64_t>(table.size()) / 4;
  Tensor t = Tensor::empty({max_tiles, 4}, DType::I32), c = Tensor::empty({1}, DType::I32);
  for (int64_t i = 0; i < max_tiles; ++i)
    for (int j = 0; j < 4; ++j)
      t.data<int32_t>()[i * 4 + j] = i < n ? table[static_cast<size_t>((reversed ? n - 1 - i : i) * 4 + j)]
                                           : (j == 0   ? 1 << 29
                                              : j == 3 ? -1
                                                       : (1 << 30) + 7 * j);
  c.data<int32_t>()[0] = static_cast<int32_t>(n);
  DeviceTable d;
  d.tiles = be.to_device(t), d.count = be.to_device(c), d.max_tiles = max_tiles;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(d.tiles.raw()) % 16, 0u) << "the table must be 16-byte aligned";
  return d;
}

// The grouped BF16 product (one launch over every group's rows) is bitwise the per-group dense
// BF16 products at one split and the same block_m: a tile's rows past its group are loaded but
// not stored, and each row's MMAs are those of the dense kernel.
TEST(CudaFp8Gemm, Bf16GroupedIsBitwiseThePerGroupProducts) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t N = 640, K = 1000;  // K: 2000 bytes a row, a partial last stage
  const std::vector<int64_t> offsets = grouped_offsets(0);
  const int64_t R = offsets.back(), G = static_cast<int64_t>(offsets.size()) - 1;
  const Tensor da = be.to_device(random_bf16(R, K, 81, 1.5f).host);
  const GroupWeights w = bf16_group_weights(be, G, N, K, 90);
  const std::vector<const void*>& bp = w.ptr;
  for (int bm : {64, 128})
    for (DType out : {DType::BF16, DType::F32})
      for (bool keep_maps : {false, true}) {
        SCOPED_TRACE(testing::Message() << "block_m=" << bm << " out=" << dtype_name(out)
                                        << " keep_maps=" << keep_maps);
        Tensor cg = poisoned(be, {R, N}, out);
        be.gemm().gemm_bf16_grouped(offsets, N, K, da.raw(), bp, cg.raw(), out, 1.0f, 0.0f, bm, keep_maps);
        Tensor cd = poisoned(be, {R, N}, out);
        const size_t esz = dtype_size(out);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r0 = offsets[g], m = offsets[g + 1] - r0;
          if (m == 0) continue;
          be.gemm().gemm_bf16_own(m, N, K, static_cast<const uint16_t*>(da.raw()) + r0 * K, bp[g],
                                  static_cast<uint8_t*>(cd.raw()) + r0 * N * esz, out, 1.0f, 0.0f, /*splits=*/1, bm);
        }
        be.synchronize();
        const Tensor hg = be.to_host(cg), hd = be.to_host(cd);
        EXPECT_EQ(std::memcmp(hg.raw(), hd.raw(), hg.nbytes()), 0) << "grouped differs from the per-group products";
      }
}

// The K-grouped BF16 product (the experts' weight gradients dW_g = dY_g^T X_g, fp8_gemm.h) from
// the padded transposes CudaBackend::grouped_wgrad_own builds: each group's C is bitwise the dense
// BF16 product of its own transposed rows (K = its rows rounded up to 8: the same zeros past them;
// the same block_m, 128 or 64, one split, beta 1 on the same prior C), within the BF16 mode's
// bound of the FP64 sum, and an empty group's C is left as it was. 40 groups of 0..300 rows,
// partial last tiles along M and N.
TEST(CudaFp8Gemm, Bf16KGroupedIsBitwiseThePerGroupProducts) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t M = 600, N = 1008;  // C_g [M, N]: dY's columns by X's (partial last tiles both ways)
  const std::vector<int64_t> offsets = grouped_offsets(3);
  const int64_t R = offsets.back(), G = static_cast<int64_t>(offsets.size()) - 1;
  const Bf16Matrix dy = random_bf16(R, M, 71, 1.5f), x = random_bf16(R, N, 72, 1.0f);
  std::vector<int64_t> k_off{0};
  for (int64_t g = 0; g < G; ++g)
    k_off.push_back(k_off.back() + ceil_div(offsets[g + 1] - offsets[g], int64_t{64}) * 64);
  const int64_t Kp = k_off.back();
  std::vector<float> at(static_cast<size_t>(M * Kp), 0.0f), bt(static_cast<size_t>(N * Kp), 0.0f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      const int64_t col = k_off[g] + r - offsets[g];
      for (int64_t m = 0; m < M; ++m) at[static_cast<size_t>(m * Kp + col)] = dy.values[static_cast<size_t>(r * M + m)];
      for (int64_t n = 0; n < N; ++n) bt[static_cast<size_t>(n * Kp + col)] = x.values[static_cast<size_t>(r * N + n)];
    }
  const Tensor dat = be.to_device(from_float_vector(at, {M, Kp}, DType::BF16));
  const Tensor dbt = be.to_device(from_float_vector(bt, {N, Kp}, DType::BF16));
  const std::vector<int64_t> rows_checked = sampled(M, 128, 41), cols_checked = sampled(N, 128, 59);
  for (int bm : {128, 64})
    for (DType out : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(testing::Message() << "block_m=" << bm << " out=" << dtype_name(out));
      std::vector<Tensor> cg;
      std::vector<void*> cp;
      for (int64_t g = 0; g < G; ++g) cg.push_back(prior_c(be, M, N, out)), cp.push_back(cg.back().raw());
      be.gemm().gemm_bf16_kgrouped(M, N, Kp, dat.raw(), dbt.raw(), k_off, cp, out, 1.0f, 1.0f, bm);
      be.synchronize();
      const Tensor prior = be.to_host(prior_c(be, M, N, out));
      int bad = 0;
      for (int64_t g = 0; g < G; ++g) {
        SCOPED_TRACE(testing::Message() << "group " << g);
        const Tensor got = be.to_host(cg[static_cast<size_t>(g)]);
        const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
        if (rows == 0) {
          EXPECT_EQ(std::memcmp(got.raw(), prior.raw(), got.nbytes()), 0) << "an empty group's C changed";
          continue;
        }
        const int64_t kg = ceil_div(rows, int64_t{8}) * 8;
        std::vector<float> ag(static_cast<size_t>(M * kg)), bg(static_cast<size_t>(N * kg));
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < kg; ++k)
            ag[static_cast<size_t>(m * kg + k)] = at[static_cast<size_t>(m * Kp + k_off[g] + k)];
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < kg; ++k)
            bg[static_cast<size_t>(n * kg + k)] = bt[static_cast<size_t>(n * Kp + k_off[g] + k)];
        const Tensor da = be.to_device(from_float_vector(ag, {M, kg}, DType::BF16));
        const Tensor db = be.to_device(from_float_vector(bg, {N, kg}, DType::BF16));
        Tensor cd = prior_c(be, M, N, out);
        be.gemm().gemm_bf16_own(M, N, kg, da.raw(), db.raw(), cd.raw(), out, 1.0f, 1.0f, /*splits=*/1, /*block_m=*/bm);
        be.synchronize();
        const Tensor want_bits = be.to_host(cd);
        EXPECT_EQ(std::memcmp(got.raw(), want_bits.raw(), got.nbytes()), 0) << "differs from the dense product";
        for (int64_t m : rows_checked)
          for (int64_t n : cols_checked) {
            double s = 0, mag = 0;
            for (int64_t r = r0; r < r0 + rows; ++r) {
              const double t = static_cast<double>(dy.values[static_cast<size_t>(r * M + m)]) *
                               x.values[static_cast<size_t>(r * N + n)];
              s += t, mag += std::fabs(t);
            }
            const double want = s + prior_value(m * N + n), v = host_value(got, m * N + n);
            const double tol = (out == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -20)) * std::fabs(want) +
                               std::ldexp(1.0, -13) * mag + 1e-30;
            if (!(std::fabs(v - want) <= tol) && bad++ < 5)
              ADD_FAILURE() << "C_" << g << "[" << m << ", " << n << "] = " << v << ", exact " << want << ", tolerance "
                            << tol;
          }
      }
      EXPECT_EQ(bad, 0) << "elements outside the bound";
    }
}

// The device tile table (fp8_gemm.h): the grouped products, E4M3 and BF16, with the table and its
// count on the device give bitwise the host-offsets form's C: at capacity = count, with garbage
// past the count (capacity count + 50), with the tiles in reverse order, with one CTA per
// tile (a grid for the capacity: CTAs with no valid tile), for every block_m and both outputs.
// A count of 0 leaves C as it was. And in a CUDA graph: captured once, replayed for two row
// splits among the groups (only the table and count on the device change).
TEST(CudaFp8Gemm, DeviceTileTableIsBitwiseTheHostOffsets) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t N = 640, K = 1024;
  const std::vector<int64_t> offsets = grouped_offsets(0), offsets2 = grouped_offsets(11);
  const int64_t R = offsets.back(), G = static_cast<int64_t>(offsets.size()) - 1;
  ASSERT_EQ(offsets2.back(), R);  // the same rows (the group sizes rotated)
  // E4M3 operands (A 1x128-scaled, each group's B 128x128) and BF16 ones.
  const QuantTensor ha = quantize_1x128(random_matrix(R, K, 61, 1.5f), false);
  QuantTensor qa = ha;
  qa.data = be.to_device(ha.data), qa.scales = be.to_device(ha.scales);
  std::vector<QuantTensor> qb;
  std::vector<const uint8_t*> bp8;
  std::vector<const float*> sp8;
  for (int64_t g = 0; g < G; ++g) {
    QuantTensor d = quantize_128x128(random_matrix(N, K, 70 + static_cast<uint32_t>(g), 1.0f), false);
    d.data = be.to_device(d.data), d.scales = be.to_device(d.scales);
    qb.push_back(d);
  }
  for (const QuantTensor& d : qb) bp8.push_back(d.data.data<uint8_t>()), sp8.push_back(d.scales.data<float>());
  const Tensor a16 = be.to_device(random_bf16(R, K, 62, 1.5f).host);
  std::vector<Tensor> b16;
  std::vector<const void*> bp16;
  for (int64_t g = 0; g < G; ++g)
    b16.push_back(be.to_device(random_bf16(N, K, 170 + static_cast<uint32_t>(g), 1.0f).host));
  for (const Tensor& t : b16) bp16.push_back(t.raw());
  cuda::GemmEngine& gemm = be.gemm();
  // The host form and the device form over a table (device_call: into c), each into a poisoned C.
  auto host_form = [&](bool bf16, const std::vector<int64_t>& offs, int bm, DType out) {
    Tensor c = poisoned(be, {R, N}, out);
    if (bf16) gemm.gemm_bf16_grouped(offs, N, K, a16.raw(), bp16, c.raw(), out, 1.0f, 0.0f, bm);
    else
      gemm.gemm_fp8_grouped(offs, N, K, qa.data.data<uint8_t>(), qa.scales.data<float>(), false, bp8, sp8, c.raw(), out,
                            1.0f, 0.0f, bm);
    be.synchronize();
    return be.to_host(c);
  };
  auto device_call = [&](bool bf16, const DeviceTable& t, int bm, DType out, void* c) {
    const int4* tiles = static_cast<const int4*>(t.tiles.raw());
    const int* count = static_cast<const int*>(t.count.raw());
    if (bf16)
      gemm.gemm_bf16_grouped_device(tiles, count, t.max_tiles, R, bm, N, K, a16.raw(), bp16, c, out, 1.0f, 0.0f);
    else
      gemm.gemm_fp8_grouped_device(tiles, count, t.max_tiles, R, bm, N, K, qa.data.data<uint8_t>(),
                                   qa.scales.data<float>(), false, bp8, sp8, c, out, 1.0f, 0.0f);
  };
  auto device_form = [&](bool bf16, const DeviceTable& t, int bm, DType out) {
    Tensor c = poisoned(be, {R, N}, out);
    device_call(bf16, t, bm, out, c.raw());
    be.synchronize();
    return be.to_host(c);
  };
  for (bool bf16 : {false, true})
    for (int bm : {64, 128, 192}) {
      if (bf16 && bm == 192) continue;  // the BF16 mode has 64- and 128-row tiles
      const std::vector<int32_t> table = host_tile_table(offsets, bm);
      const int64_t n = static_cast<int64_t>(table.size()) / 4;
      const DeviceTable exact = device_table(be, table, n, false), padded = device_table(be, table, n + 50, false);
      const DeviceTable reversed = device_table(be, table, n + 50, true);
      for (DType out : {DType::BF16, DType::F32}) {
        SCOPED_TRACE(testing::Message() << (bf16 ? "BF16" : "E4M3") << " block_m=" << bm << " out=" << dtype_name(out));
        const Tensor ref = host_form(bf16, offsets, bm, out);
        EXPECT_EQ(std::memcmp(device_form(bf16, exact, bm, out).raw(), ref.raw(), ref.nbytes()), 0)
            << "capacity = count";
        EXPECT_EQ(std::memcmp(device_form(bf16, padded, bm, out).raw(), ref.raw(), ref.nbytes()), 0)
            << "garbage past the count";
        EXPECT_EQ(std::memcmp(device_form(bf16, reversed, bm, out).raw(), ref.raw(), ref.nbytes()), 0)
            << "the tiles in reverse order";
        const Tensor tile =
            with_env({{"FP8RL_FP8_GEMM_GRID", "tile"}}, [&] { return device_form(bf16, padded, bm, out); });
        EXPECT_EQ(std::memcmp(tile.raw(), ref.raw(), ref.nbytes()), 0) << "one CTA per tile, garbage past the count";
      }
      // A count of 0: nothing written (the poison stays, bit for bit).
      const DeviceTable none = device_table(be, {}, 8, false);
      const Tensor untouched = poisoned(be, {R, N}, DType::BF16);
      const Tensor before = be.to_host(untouched);
      device_call(bf16, none, bm, DType::BF16, untouched.raw());
      be.synchronize();
      EXPECT_EQ(std::memcmp(be.to_host(untouched).raw(), before.raw(), before.nbytes()), 0) << "count 0 wrote C";
    }
  // One captured graph per operand type, replayed for two row splits: the table (capacity for
  // either) and the count are rewritten on the device between replays, the graph is not.
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "graph, BF16" : "graph, E4M3");
    const int bm = 64;
    const std::vector<int32_t> t1 = host_tile_table(offsets, bm), t2 = host_tile_table(offsets2, bm);
    const int64_t cap = static_cast<int64_t>(std::max(t1.size(), t2.size())) / 4 + 8;
    DeviceTable table = device_table(be, t1, cap, false);
    Tensor c = poisoned(be, {R, N}, DType::BF16);
    device_call(bf16, table, bm, DType::BF16, c.raw());  // outside the capture: the maps' first upload
    be.synchronize();
    cudaStream_t s = be.stream();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
    device_call(bf16, table, bm, DType::BF16, c.raw());
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int split = 0; split < 2; ++split) {
      const DeviceTable next = device_table(be, split == 0 ? t1 : t2, cap, false);
      be.synchronize();  // its upload is done
      ASSERT_EQ(cudaMemcpyAsync(table.tiles.raw(), next.tiles.raw(), table.tiles.nbytes(), cudaMemcpyDeviceToDevice, s),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(table.count.raw(), next.count.raw(), 4, cudaMemcpyDeviceToDevice, s), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(c.raw(), 0xFF, c.nbytes(), s), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      const Tensor ref = host_form(bf16, split == 0 ? offsets : offsets2, bm, DType::BF16);
      EXPECT_EQ(std::memcmp(be.to_host(c).raw(), ref.raw(), ref.nbytes()), 0) << "replay for row split " << split;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// A CUDA graph of fn's work on stream s (relaxed capture), instantiated; destroyed with the object.
struct Captured {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  template <typename F>
  Captured(cudaStream_t s, F&& fn) {
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
    fn();
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  }
  ~Captured() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

// The kept grouped maps' bound frees only the sets no device-form call used: a CUDA graph
// recorded around a device-form product (an MoE decode step) holds its maps, and replays the same
// C after the cache has overflowed many times with host-form weight sets (each overflow frees the
// host sets, whose memory the next sets' maps may reuse: had the graph's maps been freed too, the
// replay would read another set's maps).
TEST(CudaFp8Gemm, GraphHeldMapsSurviveTheKeptMapsBound) {
  cuda::CudaBackend be(0, DType::BF16);
  be.gemm().set_kept_maps_limit(3);
  const int64_t N = 256, K = 256;
  const std::vector<int64_t> offsets = grouped_offsets(5);
  const int64_t R = offsets.back(), G = static_cast<int64_t>(offsets.size()) - 1;
  const Tensor a = be.to_device(random_bf16(R, K, 301, 1.5f).host);
  const GroupWeights w = bf16_group_weights(be, G, N, K, 310);
  const std::vector<const void*>& bp = w.ptr;
  const int bm = 64;
  const std::vector<int32_t> table = host_tile_table(offsets, bm);
  const DeviceTable dt = device_table(be, table, static_cast<int64_t>(table.size()) / 4 + 4, false);
  Tensor c = poisoned(be, {R, N}, DType::BF16);
  auto device_call = [&] {
    be.gemm().gemm_bf16_grouped_device(reinterpret_cast<const int4*>(dt.tiles.raw()), dt.count.data<int32_t>(),
                                       dt.max_tiles, R, bm, N, K, a.raw(), bp, c.raw(), DType::BF16, 1.0f, 0.0f);
  };
  device_call();  // outside the capture: the maps' first upload (pinned)
  be.synchronize();
  const Tensor ref = be.to_host(c);
  cudaStream_t s = be.stream();
  const Captured graph(s, device_call);
  ASSERT_NE(graph.exec, nullptr);
  // Host-form products over fresh weight sets (other weights, the same shapes): the cache passes
  // its bound of 3 several times over.
  for (int round = 0; round < 12; ++round) {
    const GroupWeights other = bf16_group_weights(be, G, N, K, 500 + static_cast<uint32_t>(round * 64));
    Tensor scratch = poisoned(be, {R, N}, DType::BF16);
    be.gemm().gemm_bf16_grouped(offsets, N, K, a.raw(), other.ptr, scratch.raw(), DType::BF16, 1.0f, 0.0f, bm,
                                /*keep_maps=*/true);
    be.synchronize();
  }
  // Round 11 ends with the pinned set and two host sets (rounds 10 and 11); without eviction, 13.
  EXPECT_LE(be.gemm().kept_grouped_map_sets(), 3u) << "the bound freed nothing";
  ASSERT_EQ(cudaMemsetAsync(c.raw(), 0xFF, c.nbytes(), s), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(graph.exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(std::memcmp(be.to_host(c).raw(), ref.raw(), ref.nbytes()), 0) << "the graph's replay after the evictions";
}

// Waits up to `seconds` for the GEMM engine's stream: a kernel that deadlocks (a barrier that never
// completes) ends the run with a message instead of hanging it. The process exits: a hung kernel
// cannot be stopped, and nothing after it on the device would finish.
void finish_or_exit(cuda::CudaBackend& be, const std::string& what, double seconds = 60.0) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(be.gemm().stream());
    if (e != cudaErrorNotReady) {
      ASSERT_EQ(e, cudaSuccess) << what;
      return;
    }
    if (std::chrono::steady_clock::now() - start > std::chrono::duration<double>(seconds)) {
      std::fprintf(stderr, "[ fp8 gemm ] %s: not done after %.0f s (a deadlocked kernel); exiting\n", what.c_str(),
                   seconds);
      std::fflush(stderr);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Dense products in 192-row tiles (three consumer warpgroups beside a producer warpgroup) give
// every element the bits of 128-row tiles: block_m 192 asked for, and through FP8RL_FP8_GEMM_BM=192
// (fp8_gemm_sm90_config's choice, as bench-gemm and the trainer take it), with the persistent grid
// and one CTA per tile, the TMA-store and direct epilogues, one and three splits, BF16 and F32
// output, each 192-row run repeated (the three warpgroups' epilogues race on their store buffers
// and named barriers if they share one). Small shapes, short K (many tiles per CTA with fewer K
// blocks than stages: the warpgroups drift apart between epilogues), and partial last tiles:
// M = 257 (a last tile of 65 rows: one row in its second warpgroup, none in its third), 3000 (120:
// the third idle), N = 144 (a last column tile of 16: its second store box wholly past N).
TEST(CudaFp8Gemm, Dense192RowTilesAreBitwise128RowTiles) {
  cuda::CudaBackend be(0, DType::BF16);
  EXPECT_EQ(with_env({{"FP8RL_FP8_GEMM_BM", "192"}},
                     [] { return cuda::fp8_gemm_sm90_config(8192, 4096, 2048, 132).block_m; }),
            192);
  const Shape shapes[] = {{257, 384, 640},   {384, 144, 256},   {1000, 1536, 1024},
                          {4096, 2048, 256}, {3000, 4096, 128}, {600, 2048, 2048}};
  using Env = std::vector<std::pair<const char*, const char*>>;
  const Env variants[] = {{},
                          {{"FP8RL_FP8_GEMM_STORE", "direct"}},
                          {{"FP8RL_FP8_GEMM_GRID", "tile"}},
                          {{"FP8RL_FP8_GEMM_GRID", "tile"}, {"FP8RL_FP8_GEMM_STORE", "direct"}}};
  for (const Shape& s : shapes) {
    const Operands o = make_operands(be, s.M, s.N, s.K, static_cast<uint32_t>(3 * s.M + s.N + 7 * s.K));
    for (int splits : {1, 3})
      for (DType out : {DType::BF16, DType::F32}) {
        const std::string where = "M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) +
                                  " K=" + std::to_string(s.K) + " splits=" + std::to_string(splits) +
                                  " out=" + dtype_name(out);
        SCOPED_TRACE(where);
        auto run = [&](int block_m) {
          Tensor c = poisoned(be, {s.M, s.N}, out);
          be.gemm().gemm_fp8_own(s.M, s.N, s.K, o.da.data.data<uint8_t>(), o.da.scales.data<float>(), false,
                                 o.db.data.data<uint8_t>(), o.db.scales.data<float>(), c.raw(), out, 1.0f, 0.0f, splits,
                                 block_m);
          finish_or_exit(be, where + " block_m=" + std::to_string(block_m));
          be.synchronize();
          return be.to_host(c);
        };
        const Tensor ref = run(128);
        for (size_t v = 0; v < std::size(variants); ++v) {
          for (int rep = 0; rep < 2; ++rep) {
            const Tensor c = with_env(variants[v], [&] { return run(192); });
            ASSERT_EQ(std::memcmp(c.raw(), ref.raw(), c.nbytes()), 0)
                << "block_m 192, variant " << v << ", run " << rep << ": differs from 128-row tiles";
          }
          // The default block_m under FP8RL_FP8_GEMM_BM=192 (every shape here has M > 256: 192-row tiles).
          Env env = variants[v];
          env.push_back({"FP8RL_FP8_GEMM_BM", "192"});
          const Tensor c = with_env(env, [&] { return run(0); });
          ASSERT_EQ(std::memcmp(c.raw(), ref.raw(), c.nbytes()), 0)
              << "FP8RL_FP8_GEMM_BM=192, variant " << v << ": differs from 128-row tiles";
        }
      }
  }
}

// Stream-K (FP8RL_FP8_GEMM_STREAMK=1, decode-sized M): the tiles' K blocks shared out evenly
// among the CTAs, a cut tile summed by the piece that finishes last. Every result finite and
// within the MMA bound of the exact product and as close as cuBLASLt's, at the SMs' CTA count and
// at other CTA counts (FP8RL_FP8_GEMM_SK_CTAS; long K over few tiles cuts a tile into ~25-35
// pieces, where a sum in arrival order would differ between runs); each run repeated bitwise (the
// tile counters left zero, the sum in K order whichever piece finishes last); BF16 output the F32
// result rounded once; alpha applied once to the sum; beta = 1 adds the old F32 output once; a
// captured graph replays the eager bits. The 1.7B decode products (q|k|v, o, gate|up, down at
// M = 256), ragged M, partial N and K blocks, 64-row tiles (M <= 64), a K of one block.
TEST(CudaFp8Gemm, StreamKMatchesTheHostProductAndRepeats) {
  cuda::CudaBackend be(0, DType::BF16);
  ASSERT_EQ(std::getenv("FP8RL_FP8_GEMM_SPLITS"), nullptr) << "a fixed split count bypasses stream-K";
  const Shape shapes[] = {{256, 4096, 2048}, {256, 2048, 2048}, {256, 12288, 2048}, {256, 2048, 6144},
                          {200, 208, 336},   {5, 384, 640},     {129, 1536, 1024},  {64, 256, 128},
                          {64, 256, 4096},   {200, 256, 6144}};
  const test::ScopedEnv on("FP8RL_FP8_GEMM_STREAMK", "1");
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K);
    const Operands o = make_operands(be, s.M, s.N, s.K, static_cast<uint32_t>(s.M * 37 + s.N + s.K));
    const double lt =
        s.K % kQuantBlock == 0 ? max_error(o, run_cublaslt(be, o, s.M, s.N, s.K), s.M, s.N) : kMmaBound / 1.25;
    auto own = [&](Tensor& c, DType out, bool kb_major, float alpha, float beta) {
      be.gemm().gemm_fp8_own(s.M, s.N, s.K, o.da.data.data<uint8_t>(),
                             kb_major ? o.da_kb.data<float>() : o.da.scales.data<float>(), kb_major,
                             o.db.data.data<uint8_t>(), o.db.scales.data<float>(), c.raw(), out, alpha, beta, 0);
      finish_or_exit(be, "stream-K");  // a stage walk the producer and consumers disagree on hangs
      return be.to_host(c);
    };
    for (const char* ctas : {"", "3", "7", "50"}) {
      SCOPED_TRACE(testing::Message() << "FP8RL_FP8_GEMM_SK_CTAS=" << ctas);
      std::unique_ptr<test::ScopedEnv> sk_ctas;
      if (*ctas) sk_ctas = std::make_unique<test::ScopedEnv>("FP8RL_FP8_GEMM_SK_CTAS", ctas);
      for (bool kb_major : {false, true}) {
        Tensor d1 = poisoned(be, {s.M, s.N}, DType::F32), d2 = poisoned(be, {s.M, s.N}, DType::F32);
        const Tensor c1 = own(d1, DType::F32, kb_major, 1.0f, 0.0f);
        const Tensor c2 = own(d2, DType::F32, kb_major, 1.0f, 0.0f);
        for (int64_t i = 0; i < s.M * s.N; ++i)  // every tile stored (the poison is NaN)
          ASSERT_TRUE(std::isfinite(c1.data<float>()[i])) << "element " << i << " never stored";
        ASSERT_EQ(std::memcmp(c1.raw(), c2.raw(), c1.nbytes()), 0) << "a repeat differs, kb_major " << kb_major;
        const double err = max_error(o, c1, s.M, s.N);
        EXPECT_LT(err, kMmaBound) << "kb_major " << kb_major;
        EXPECT_LE(err, 1.25 * lt + 1e-6) << "cuBLASLt's error " << lt;
      }
      Tensor d32 = poisoned(be, {s.M, s.N}, DType::F32), d16 = poisoned(be, {s.M, s.N}, DType::BF16);
      Tensor d3 = poisoned(be, {s.M, s.N}, DType::F32);
      const Tensor c32 = own(d32, DType::F32, false, 1.0f, 0.0f);
      const Tensor c16 = own(d16, DType::BF16, false, 1.0f, 0.0f);
      const Tensor c3 = own(d3, DType::F32, false, 3.0f, 0.0f);
      for (int64_t i = 0; i < s.M * s.N; i += 7) {
        ASSERT_EQ(c16.data<uint16_t>()[i], bf16_from_float(c32.data<float>()[i])) << "element " << i;
        ASSERT_EQ(c3.data<float>()[i], c32.data<float>()[i] * 3.0f) << "alpha 3, element " << i;
      }
      // beta = 1 into an F32 output holding `old`: old + the product, added once.
      std::vector<float> old(static_cast<size_t>(s.M * s.N));
      for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<float>(static_cast<int64_t>(i % 101) - 50) / 64.0f;
      Tensor c = be.to_device(from_float_vector(old, {s.M, s.N}, DType::F32));
      const Tensor cb = own(c, DType::F32, false, 1.0f, 1.0f);
      for (int64_t i = 0; i < s.M * s.N; i += 5)
        ASSERT_EQ(cb.data<float>()[i], old[static_cast<size_t>(i)] + c32.data<float>()[i]) << "beta 1, element " << i;
    }
    // A captured graph's replays give the eager bits (the counters are zero again after each).
    Tensor cg = poisoned(be, {s.M, s.N}, DType::BF16);
    auto call = [&] {
      be.gemm().gemm_fp8_own(s.M, s.N, s.K, o.da.data.data<uint8_t>(), o.da.scales.data<float>(), false,
                             o.db.data.data<uint8_t>(), o.db.scales.data<float>(), cg.raw(), DType::BF16, 1.0f, 0.0f,
                             0);
    };
    call();  // eager: the stream-K buffers exist before the capture
    finish_or_exit(be, "stream-K");
    const Tensor ref = be.to_host(cg);
    cudaStream_t st = be.stream();
    const Captured graph(st, call);
    ASSERT_NE(graph.exec, nullptr);
    for (int rep = 0; rep < 3; ++rep) {
      ASSERT_EQ(cudaMemsetAsync(cg.raw(), 0xFF, cg.nbytes(), st), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(graph.exec, st), cudaSuccess);
      finish_or_exit(be, "stream-K graph replay");
      EXPECT_EQ(std::memcmp(be.to_host(cg).raw(), ref.raw(), ref.nbytes()), 0) << "replay " << rep;
    }
  }
}

// ---- Per-row B scales (Fp8GemmArgs::b_scales_rows: the FP8 wgrad on the own kernel) ----

// The FP8 wgrad's operands as CudaBackend::linear_backward makes them: dY [T, M] and X [T, N]
// (BF16; M the layer's outputs, N its inputs, T the tokens) quantized transposed on the device,
// 1x128 along tokens, into A = dY^T [M, K] and B = X^T [N, K] with K = T rounded up to 128 (the
// padding columns zeros). The scales in both layouts: row-major [rows][K/128] (the quantizer's
// default, as cuBLASLt's path and the host product read them) and K-block-major [K/128][rows]
// (gemm_layout: the own kernel's per-row B layout). db128: B quantized in 128x128 blocks instead,
// and its scales repeated per row, K-block-major (db128_rows): the per-row mode on those is the
// 128x128 mode's product.
struct WgradOperands {
  int64_t M = 0, N = 0, K = 0;
  QuantTensor ha, hb;   // host copies (row-major scales)
  QuantTensor da, db;   // device, row-major scales
  Tensor da_kb, db_kb;  // device scales [K/128][M] and [K/128][N] (gemm_layout)
  QuantTensor db128;    // device, B in 128x128 blocks
  Tensor db128_rows;    // device: db128's scales per row, [K/128][N]
};

WgradOperands make_wgrad_operands(cuda::CudaBackend& be, int64_t M, int64_t N, int64_t T, uint32_t seed) {
  WgradOperands o;
  o.M = M, o.N = N, o.K = ceil_div(T, int64_t{kQuantBlock}) * kQuantBlock;
  const Tensor dy = be.to_device(random_bf16(T, M, seed, 1.5f).host);
  const Tensor x = be.to_device(random_bf16(T, N, seed + 1, 1.0f).host);
  o.da = be.alloc_quant(M, o.K, 1, kQuantBlock, false);
  o.db = be.alloc_quant(N, o.K, 1, kQuantBlock, false);
  QuantTensor akb = be.alloc_quant(M, o.K, 1, kQuantBlock, false), bkb = be.alloc_quant(N, o.K, 1, kQuantBlock, false);
  o.db128 = be.alloc_quant(N, o.K, kQuantBlock, kQuantBlock, false);
  be.quantize_async(dy, true, o.da, /*pad_cols=*/true);
  be.quantize_async(x, true, o.db, /*pad_cols=*/true);
  be.quantize_async(dy, true, akb, /*pad_cols=*/true, /*gemm_layout=*/true);
  be.quantize_async(x, true, bkb, /*pad_cols=*/true, /*gemm_layout=*/true);
  be.quantize_async(x, true, o.db128, /*pad_cols=*/true);
  be.synchronize();
  o.ha = o.da, o.hb = o.db;
  o.ha.data = be.to_host(o.da.data), o.ha.scales = be.to_host(o.da.scales);
  o.hb.data = be.to_host(o.db.data), o.hb.scales = be.to_host(o.db.scales);
  // The K-block-major quantization: the same codes, and the same scales transposed.
  const int64_t kb = o.K / kQuantBlock;
  auto same_values = [&](const QuantTensor& q, const QuantTensor& h, int64_t rows, const char* what) {
    const Tensor codes = be.to_host(q.data), scales = be.to_host(q.scales);
    EXPECT_EQ(std::memcmp(codes.raw(), h.data.raw(), codes.nbytes()), 0) << what << ": gemm_layout changed the codes";
    int64_t moved = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < kb; ++b)
        moved += scales.data<float>()[b * rows + r] != h.scales.data<float>()[r * kb + b];
    EXPECT_EQ(moved, 0) << what << ": K-block-major scales that are not the row-major ones transposed";
  };
  same_values(akb, o.ha, M, "dY^T");
  same_values(bkb, o.hb, N, "X^T");
  o.da_kb = akb.scales, o.db_kb = bkb.scales;
  const Tensor s128 = be.to_host(o.db128.scales);  // [ceil(N/128)][kb]
  std::vector<float> rows128(static_cast<size_t>(kb * N));
  for (int64_t b = 0; b < kb; ++b)
    for (int64_t n = 0; n < N; ++n)
      rows128[static_cast<size_t>(b * N + n)] = s128.data<float>()[(n / kQuantBlock) * kb + b];
  o.db128_rows = be.to_device(from_float_vector(rows128, {kb, N}, DType::F32));
  return o;
}

// Row r of a host E4M3 tensor [rows, K] with 1x128 scales [rows][K/128], dequantized.
std::vector<double> dequantized_row(const QuantTensor& q, int64_t r) {
  const int64_t K = q.cols(), kb = ceil_div(K, int64_t{kQuantBlock});
  std::vector<double> v(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k)
    v[static_cast<size_t>(k)] = static_cast<double>(e4m3_to_float(q.data.data<uint8_t>()[r * K + k])) *
                                q.scales.data<float>()[r * kb + k / kQuantBlock];
  return v;
}

// The exact products of the dequantized operands (FP64) at rows x cols of C, and their sums of
// |terms| (the error scale).
struct ExactGrid {
  std::vector<int64_t> rows, cols;
  std::vector<double> value, magnitude;  // [rows.size()][cols.size()]
};
ExactGrid exact_grid(const WgradOperands& o) {
  ExactGrid e;
  e.rows = sampled(o.M, 128, 37), e.cols = sampled(o.N, 128, 53);
  std::vector<std::vector<double>> b;
  for (int64_t n : e.cols) b.push_back(dequantized_row(o.hb, n));
  for (int64_t m : e.rows) {
    const std::vector<double> a = dequantized_row(o.ha, m);
    for (const std::vector<double>& bn : b) {
      double s = 0, mag = 0;
      for (size_t k = 0; k < a.size(); ++k) s += a[k] * bn[k], mag += std::fabs(a[k] * bn[k]);
      e.value.push_back(s), e.magnitude.push_back(mag);
    }
  }
  return e;
}

// The largest |C - exact| / sum |terms| over the grid (F32 C [M, N] on the host).
double grid_error(const ExactGrid& e, const Tensor& c, int64_t N) {
  double worst = 0;
  for (size_t i = 0; i < e.rows.size(); ++i)
    for (size_t j = 0; j < e.cols.size(); ++j) {
      const size_t at = i * e.cols.size() + j;
      const double got = c.data<float>()[e.rows[i] * N + e.cols[j]];
      worst = std::max(worst, std::fabs(got - e.value[at]) / (e.magnitude[at] + 1e-30));
    }
  return worst;
}

// The own kernel's per-row B product C = alpha A B^T + beta C on the operands (A's scales
// K-block-major or row-major; B's per-row scales b_rows, K-block-major), into `c` (on the device;
// its prior values are the beta term); returns C on the host once the kernel finished.
Tensor run_own_rows(cuda::CudaBackend& be, const WgradOperands& o, Tensor& c, bool a_kb_major, const Tensor& b_rows,
                    float alpha, float beta, int splits) {
  be.gemm().gemm_fp8_own_b_rows(
      o.M, o.N, o.K, o.da.data.data<uint8_t>(), a_kb_major ? o.da_kb.data<float>() : o.da.scales.data<float>(),
      a_kb_major, o.db.data.data<uint8_t>(), b_rows.data<float>(), c.raw(), c.dtype(), alpha, beta, splits);
  finish_or_exit(be, "per-row B scales");  // a stage whose transaction bytes the producer miscounted hangs
  return be.to_host(c);
}

// Per-row B scales (FP8RL_FP8_WGRAD_GEMM=own's kernel) on the FP8 wgrad's operands quantized on
// the device: every element written and finite, within the MMA bound of the exact product of the
// dequantized operands and as close as cuBLASLt's VEC128 x VEC128 product on the same operands
// (within 25%), at the splits the engine chooses and at 1 and 3; a repeat bitwise; A's scales in
// either layout the same bits; beta = 1 adds the prior F32 C once (the wgrad accumulates into dW);
// alpha applied once; BF16 output the F32 result rounded once; and B's 128x128 quantization with
// its scales repeated per row gives bitwise the 128x128 mode's C (every column's scale equal to its
// block's: the same promotion, element for element). Through GemmEngine::gemm_fp8 (1x128 B, the
// wgrad's call) with FP8RL_FP8_WGRAD_GEMM's choice set to own: bitwise the direct call, with the
// scales row-major (laid out by the engine) or K-block-major. Shapes: the wgrad of a 2048-output,
// 6144-input linear over 8192 tokens; partial tiles in M and N (a last column tile of 16); tokens
// padded to 128 (600 -> 640); K of 3 blocks and of 40 (few tiles: the engine splits K); dY's rows
// of 300 elements (not a multiple of 8: the quantizer's element-wise transposed kernel).
TEST(CudaFp8Gemm, PerRowBScalesMatchTheHostProductAndCublasLt) {
  cuda::CudaBackend be(0, DType::BF16);
  ASSERT_EQ(std::getenv("FP8RL_FP8_GEMM_SPLITS"), nullptr) << "a fixed split count changes the engine's routing";
  struct WgradShape {
    int64_t M, N, T;  // C [M, N] = dY^T X over T tokens
  };
  const WgradShape shapes[] = {
      {2048, 6144, 8192}, {300, 528, 600}, {1000, 1040, 384}, {136, 256, 5000}, {1024, 1024, 2048}};
  cuda::GemmEngine& g = be.gemm();
  for (const WgradShape& s : shapes) {
    const std::string where = "M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) + " T=" + std::to_string(s.T);
    SCOPED_TRACE(where);
    const WgradOperands o = make_wgrad_operands(be, s.M, s.N, s.T, static_cast<uint32_t>(s.M + 3 * s.N + s.T));
    const int64_t M = o.M, N = o.N, K = o.K;
    const ExactGrid exact = exact_grid(o);
    // cuBLASLt's VEC128 x VEC128 product (row-major scales, laid out by the engine).
    g.set_fp8_wgrad_kernel("cublaslt");
    Tensor dl = poisoned(be, {M, N}, DType::F32);
    g.gemm_fp8(M, N, K, o.da.data.data<uint8_t>(), o.da.scales.data<float>(), o.db.data.data<uint8_t>(),
               o.db.scales.data<float>(), 1, dl.raw(), DType::F32, 1.0f, 0.0f);
    be.synchronize();
    const double lt = grid_error(exact, be.to_host(dl), N);
    Tensor c0 = poisoned(be, {M, N}, DType::F32);
    const Tensor own = run_own_rows(be, o, c0, true, o.db_kb, 1.0f, 0.0f, 0);
    for (int splits : {0, 1, 3}) {
      SCOPED_TRACE(testing::Message() << "splits=" << splits << " (0: the engine's)");
      for (bool a_kb_major : {true, false}) {
        Tensor d1 = poisoned(be, {M, N}, DType::F32), d2 = poisoned(be, {M, N}, DType::F32);
        const Tensor c1 = run_own_rows(be, o, d1, a_kb_major, o.db_kb, 1.0f, 0.0f, splits);
        const Tensor c2 = run_own_rows(be, o, d2, a_kb_major, o.db_kb, 1.0f, 0.0f, splits);
        int64_t unwritten = 0;
        for (int64_t i = 0; i < M * N; ++i) unwritten += !std::isfinite(c1.data<float>()[i]);
        ASSERT_EQ(unwritten, 0) << "elements never stored (the poison is NaN), A scales kb-major " << a_kb_major;
        ASSERT_EQ(std::memcmp(c1.raw(), c2.raw(), c1.nbytes()), 0) << "a repeat differs";
        if (splits == 0) {
          ASSERT_EQ(std::memcmp(c1.raw(), own.raw(), c1.nbytes()), 0) << "A's scale layout changed the bits";
        }
        const double err = grid_error(exact, c1, N);
        EXPECT_LT(err, kMmaBound) << "A scales kb-major " << a_kb_major;
        EXPECT_LE(err, 1.25 * lt + 1e-6) << "cuBLASLt's error " << lt;
        if (splits == 0 && a_kb_major)
          std::printf("[ fp8 gemm ] per-row B, %s: max |C - exact| / sum|terms|: own %.2e, cuBLASLt %.2e\n",
                      where.c_str(), err, lt);
      }
      // The 128x128 quantization of B, its scales repeated per row: the 128x128 mode's bits.
      const int sp = splits == 0 ? 2 : splits;  // the 128x128 call takes an explicit count
      Tensor dr = poisoned(be, {M, N}, DType::F32), db = poisoned(be, {M, N}, DType::F32);
      be.gemm().gemm_fp8_own_b_rows(M, N, K, o.da.data.data<uint8_t>(), o.da_kb.data<float>(), true,
                                    o.db128.data.data<uint8_t>(), o.db128_rows.data<float>(), dr.raw(), DType::F32,
                                    1.0f, 0.0f, sp);
      be.gemm().gemm_fp8_own(M, N, K, o.da.data.data<uint8_t>(), o.da_kb.data<float>(), true,
                             o.db128.data.data<uint8_t>(), o.db128.scales.data<float>(), db.raw(), DType::F32, 1.0f,
                             0.0f, sp, /*block_m=*/128);
      finish_or_exit(be, "per-row B scales against 128x128 blocks");
      const Tensor hr = be.to_host(dr), hb = be.to_host(db);
      ASSERT_EQ(std::memcmp(hr.raw(), hb.raw(), hr.nbytes()), 0)
          << "per-row scales equal within each 128-row block differ from the 128x128 mode, splits " << sp;
    }
    // beta = 1 over a prior F32 C (the wgrad's accumulation into dW): prior + C, added once; alpha
    // once; BF16 output: the F32 result rounded once.
    Tensor dp = prior_c(be, M, N, DType::F32);
    const Tensor cb = run_own_rows(be, o, dp, true, o.db_kb, 1.0f, 1.0f, 0);
    Tensor dh = poisoned(be, {M, N}, DType::F32), d16 = poisoned(be, {M, N}, DType::BF16);
    const Tensor ch = run_own_rows(be, o, dh, true, o.db_kb, 0.5f, 0.0f, 0);
    const Tensor c16 = run_own_rows(be, o, d16, true, o.db_kb, 1.0f, 0.0f, 0);
    for (int64_t i = 0; i < M * N; i += 3) {
      ASSERT_EQ(cb.data<float>()[i], prior_value(i) + own.data<float>()[i]) << "beta 1, element " << i;
      ASSERT_EQ(ch.data<float>()[i], 0.5f * own.data<float>()[i]) << "alpha 0.5, element " << i;
      ASSERT_EQ(c16.data<uint16_t>()[i], bf16_from_float(own.data<float>()[i])) << "BF16, element " << i;
    }
    // The engine's routing: 1x128 B on the own kernel once its wgrad choice is own, the scales
    // row-major (B's laid out by the engine) or already K-block-major: the direct call's bits.
    g.set_fp8_wgrad_kernel("own");
    ASSERT_TRUE(g.fp8_wgrad_own(M, N, K));
    for (bool laid : {false, true}) {
      const int64_t own0 = g.own_products();
      Tensor dg = poisoned(be, {M, N}, DType::F32);
      g.gemm_fp8(M, N, K, o.da.data.data<uint8_t>(), laid ? o.da_kb.data<float>() : o.da.scales.data<float>(),
                 o.db.data.data<uint8_t>(), laid ? o.db_kb.data<float>() : o.db.scales.data<float>(), 1, dg.raw(),
                 DType::F32, 1.0f, 0.0f, /*a_scales_laid=*/laid, /*row_invariant=*/false, /*b_scales_laid=*/laid);
      finish_or_exit(be, "gemm_fp8 with 1x128 B on the own kernel");
      EXPECT_EQ(g.own_products(), own0 + 1) << "laid " << laid << ": not counted as an own product";
      const Tensor hg = be.to_host(dg);
      ASSERT_EQ(std::memcmp(hg.raw(), own.raw(), hg.nbytes()), 0) << "gemm_fp8's routing, scales laid " << laid;
    }
    g.set_fp8_wgrad_kernel("cublaslt");
  }
}

// linear_backward's FP8 weight gradient with FP8RL_FP8_WGRAD_GEMM=own (its quantizations then
// write the K-block-major scales the own kernel reads) against the default cuBLASLt path on the
// same dY and X: dW accumulated onto the same prior, every element of the two within twice the MMA
// bound of each other (each is within kMmaBound of the exact quantized product: the test above),
// scaled by sum_t |dY[t, n] X[t, k]| (an FP32 GEMM of the absolute values; quantization changes
// each factor by at most 2^-4 of it, hence 3 x kMmaBound); a scale read from the wrong row, column
// or K block is an error of the order of |dW|, 2^-3 to 2^-5 of that sum at these token counts. dX
// bitwise (the switch is the wgrad's alone), and the product counted as the own kernel's.
// FP8RL_FP8_WGRAD_GEMM is read when the engine is made: own there, cublaslt by default, and other
// values refused.
TEST(CudaFp8Gemm, LinearBackwardWgradOnTheOwnKernelMatchesCublasLt) {
  {
    const test::ScopedEnv own("FP8RL_FP8_WGRAD_GEMM", "own");
    cuda::CudaBackend be(0, DType::BF16);
    EXPECT_TRUE(be.gemm().fp8_wgrad_own(2048, 1024, 4096));
    EXPECT_FALSE(be.gemm().fp8_wgrad_own(2048, 1000, 4096)) << "N % 16 != 0: cuBLASLt (or the caller's fallback)";
  }
  cuda::CudaBackend be(0, DType::BF16);
  EXPECT_FALSE(be.gemm().fp8_wgrad_own(2048, 1024, 4096)) << "cublaslt is the default";
  EXPECT_THROW(be.gemm().set_fp8_wgrad_kernel("auto"), Error);
  be.gemm().set_fp8_kernel("cublaslt");  // the dgrad on cuBLASLt whatever FP8RL_FP8_GEMM says: not counted
  struct Case {
    int64_t T, N, K;  // dY [T, N], X [T, K], W [N, K]
  };
  const LinearSpec spec{LinearMode::FP8_BLOCK, false};
  for (const Case& c : {Case{1000, 384, 640}, Case{4096, 2048, 1024}, Case{136, 256, 272}}) {
    const std::string where = "T=" + std::to_string(c.T) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
    SCOPED_TRACE(where);
    const uint32_t seed = static_cast<uint32_t>(c.T + 5 * c.N + c.K);
    const Bf16Matrix dyh = random_bf16(c.T, c.N, seed, 1.5f), xh = random_bf16(c.T, c.K, seed + 1, 1.0f);
    const Tensor dy = be.to_device(dyh.host), x = be.to_device(xh.host);
    LinearWeight W;
    W.w = be.to_device(random_matrix(c.N, c.K, seed + 2, 0.5f));
    Tensor dw[2], dx[2];
    int64_t own_products[2];
    for (int run = 0; run < 2; ++run) {  // 0: cuBLASLt, 1: the own kernel
      be.gemm().set_fp8_wgrad_kernel(run == 0 ? "cublaslt" : "own");
      dw[run] = prior_c(be, c.N, c.K, DType::F32);
      dx[run] = poisoned(be, {c.T, c.K}, DType::BF16);
      const int64_t before = be.gemm().own_products();
      be.linear_backward(dy, x, W, spec, &dx[run], &dw[run], nullptr);
      finish_or_exit(be, "linear_backward");
      own_products[run] = be.gemm().own_products() - before;
    }
    be.gemm().set_fp8_wgrad_kernel("cublaslt");
    EXPECT_EQ(own_products[0], 0) << "the default's wgrad ran on the own kernel";
    EXPECT_EQ(own_products[1], 1) << "FP8RL_FP8_WGRAD_GEMM=own's wgrad did not run on the own kernel";
    const Tensor x0 = be.to_host(dx[0]), x1 = be.to_host(dx[1]);
    EXPECT_EQ(std::memcmp(x0.raw(), x1.raw(), x0.nbytes()), 0) << "dX changed with the wgrad's kernel";
    // sum_t |dY[t, n]| |X[t, k]| for every element of dW: |dY|^T |X| as an FP32 GEMM.
    std::vector<float> ady(dyh.values.size()), ax(xh.values.size());
    for (size_t i = 0; i < ady.size(); ++i) ady[i] = std::fabs(dyh.values[i]);
    for (size_t i = 0; i < ax.size(); ++i) ax[i] = std::fabs(xh.values[i]);
    const Tensor dady = be.to_device(from_float_vector(ady, {c.T, c.N}, DType::F32));
    const Tensor dax = be.to_device(from_float_vector(ax, {c.T, c.K}, DType::F32));
    Tensor dmag = be.alloc({c.N, c.K}, DType::F32);
    be.gemm().gemm(true, false, c.N, c.K, c.T, dady.raw(), dax.raw(), DType::F32, dmag.raw(), DType::F32, 1.0f, 0.0f);
    be.synchronize();
    const Tensor mag = be.to_host(dmag);
    // Every element of the increments dW - prior; beside the bound, DeepGEMM's similarity
    // 1 - 2 sum(xy) / sum(x^2 + y^2) and the largest difference relative to the largest |increment|.
    const Tensor w0 = be.to_host(dw[0]), w1 = be.to_host(dw[1]);
    double xy = 0, sq = 0, dmax = 0, vmax = 0;
    int bad = 0;
    for (int64_t i = 0; i < c.N * c.K; ++i) {
      const double a = static_cast<double>(w0.data<float>()[i]) - prior_value(i);
      const double b = static_cast<double>(w1.data<float>()[i]) - prior_value(i);
      ASSERT_TRUE(std::isfinite(b)) << "dW[" << i << "]";
      xy += a * b, sq += a * a + b * b;
      dmax = std::max(dmax, std::fabs(a - b)), vmax = std::max(vmax, std::fabs(a));
      // The bound, plus an FP32 rounding of each sum with the prior.
      const double tol = 3.0 * kMmaBound * mag.data<float>()[i] + std::ldexp(std::fabs(a) + 1.0, -22);
      if (!(std::fabs(a - b) <= tol) && bad++ < 5)
        ADD_FAILURE() << "dW[" << i / c.K << ", " << i % c.K << "]: own " << b << ", cuBLASLt " << a << ", tolerance "
                      << tol;
    }
    EXPECT_EQ(bad, 0) << "elements of dW outside the bound";
    const double diff = 1.0 - 2.0 * xy / sq;
    std::printf(
        "[ fp8 gemm ] linear_backward wgrad own vs cuBLASLt, %s: 1 - 2xy/(x^2+y^2) %.2e, max |diff| / max "
        "|dW| %.2e\n",
        where.c_str(), diff, dmax / vmax);
  }
}
}  // namespace
}  // namespace fp8rl
