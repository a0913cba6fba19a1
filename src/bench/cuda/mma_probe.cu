// The wgmma throughput probe (bench/cuda/mma_probe.h): how much of sm_90's dense FP8 tensor rate
// an issue pattern of E4M3 wgmma reaches by itself. Our block-scaled GEMM (fp8_gemm_sm90.cu)
// runs at ~35% tensor-pipe activity, and its loads, epilogue and promotion each explain only a
// little of the gap; so here the MMAs run alone. Each CTA fills shared memory once (A and B tiles
// in the 128-byte swizzle TMA writes, from a deterministic pattern of small E4M3 codes) and then
// loops over `iters` K blocks of 128 bytes, each K block the pattern's wgmma on the same tiles:
// no TMA, no global loads, no epilogue inside the loop. The grid is one wave: SMs x the
// pattern's CTAs per SM (padding the shared memory pins that count). Per pattern: a warm-up
// launch, a timed launch (CUDA events), the SM clock measured in CTA 0 during the loop, and the
// accumulators of one K block of CTA 0 compared with a host FP32 product of the same bytes.
//
// The patterns (kPatterns: one templated kernel, its switches per pattern):
//   ss_n128_wait0                  2 warpgroups, per K block: fence, 4 x m64n128k32 (A and B in
//                                  shared memory), commit, wait_group 0. Our GEMM's MMAs alone.
//   ss_n128_wait0_promote          + the FP32 promotion (64 FMAs with a scale from shared memory)
//                                  after each wait, as our GEMM does.
//   ss_n128_wait1_promote          two accumulator sets: block b + 1's wgmma issued before block
//                                  b's promotion (wait_group 1), so the FMAs overlap the MMAs;
//                                  drained every 8 K blocks (ptxas, see the kernel).
//   ss_n256_wait0_promote          m64n256k32 (BN = 256): half the wgmma per FLOP, twice the
//                                  registers (128 accumulators + 128 totals: spills).
//   ss_n256_wait0                  the same without promotion (fits in registers).
//   ss_n128_3wg_promote            3 warpgroups (BM = 192): a third warpgroup to cover each one's
//                                  wait + promotion bubble.
//   ss_n128_1wg_2cta_promote       1 warpgroup per CTA, 2 CTAs per SM (our 64-row tiles).
//   rs_n128_wait0_promote          A from registers (loaded once), B from shared memory.
//   ss_n128_wait0_promote_barrier  ss_n128_wait0_promote plus our ring's handshake without data: a
//                                  producer warp waits on "empty" and arrives on "full" per K
//                                  block, the consumers wait on "full" and arrive on "empty".
//
// The TMA-fed patterns (mma_probe_tma_kernel) put the operand delivery back: a producer warp (one
// of its threads) streams A and B tiles of 128 K bytes per stage with TMA through a ring of stages
// (full / empty mbarriers as in our GEMM) from global buffers small enough to stay in L2 (A and
// B: kTmaRows x kTmaK bytes each, 16 MB in all). Each CTA walks tiles (m, n) of a virtual product
// over them (tile t = blockIdx.x + j * gridDim.x, m = t % m_tiles, n = t / m_tiles % n_tiles) and
// all kTmaK / 128 K blocks of each, `iters` K blocks in all; the consumers wait_group 0 and
// promote as ss_n128_wait0_promote does, no epilogue. Set beside the shared-memory pattern of the
// same shape, the gap is what feeding the tiles from L2 costs.
//   tma_bm128_bn128_2wg            2 warpgroups, 128 x 128 tiles, 6 stages, 1 CTA per SM: our GEMM's
//                                  128-row tile.
//   tma_bm64_bn128_1wg_2cta        1 warpgroup, 64 x 128 tiles, 4 stages, 2 CTAs per SM: our 64-row
//                                  tiles.
//   tma_bm128_bn256_2wg_halves     2 warpgroups, 128 x 256 tiles (B as two 128-row TMA boxes), 4
//                                  stages: per K block each half's 4 m64n128k32, wait 0 and
//                                  promotion, one set of 64 accumulators for both halves (half the
//                                  A bytes per FLOP of the 128-column tile); a producer warpgroup
//                                  and setmaxnreg give the consumers the 64 + 128 registers.
//   tma_bm192_bn128_3wg            3 warpgroups, 192 x 128 tiles, 5 stages; a producer warpgroup and
//                                  setmaxnreg as above (128 registers per thread otherwise).
#include "bench/cuda/mma_probe.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/sm90.cuh"
#include "core/dtype.h"
#include "core/error.h"

namespace fp8rl::cuda {

namespace {

using namespace sm90;  // the wrappers our GEMM uses (sm90.cuh): the probe issues the same instructions

constexpr int kBK = 128;           // K bytes per block: one scale block of our GEMM, 4 wgmma of k32
constexpr int kStages = 6;         // the barrier ring of the handshake pattern (our 128-row GEMM's)
constexpr int kScaleBlocks = 16;   // K blocks of scales the promotion cycles through (a power of 2)
constexpr int kOverlapBlocks = 8;  // K blocks per drain of the overlap pattern (iters: a multiple)
constexpr uint32_t kSaltB = 0x40000u;

// The switches of one pattern.
struct ProbePattern {
  const char* name;
  int wgs;          // consumer warpgroups, 64 rows of A each
  int n;            // wgmma columns: 128 or 256 (the B tile's rows)
  bool promote;     // total = fma(acc, scale, total) after each K block
  bool overlap;     // two accumulator sets, wait_group 1 (needs promote)
  bool reg_a;       // A from registers (the RS form), n = 128 only
  bool ring;        // a producer warp and full / empty mbarriers per K block
  int ctas_per_sm;  // CTAs resident per SM
  bool tma;         // fed by TMA through a ring of `stages` (mma_probe_tma_kernel); needs promote
  int stages;       // the ring's stages (ring or tma)
  int regs;         // tma: 0, or the consumers' registers after setmaxnreg (the producer then a warpgroup)
};

// The patterns, in the order they run (the kernel's template argument is an index here).
// clang-format off
constexpr ProbePattern kPatterns[] = {
    // name                            wgs  n    promote overlap reg_a  ring   ctas/SM tma    stages   regs
    {"ss_n128_wait0",                  2,   128, false,  false,  false, false, 1,      false, kStages, 0},
    {"ss_n128_wait0_promote",          2,   128, true,   false,  false, false, 1,      false, kStages, 0},
    {"ss_n128_wait1_promote",          2,   128, true,   true,   false, false, 1,      false, kStages, 0},
    {"ss_n256_wait0_promote",          2,   256, true,   false,  false, false, 1,      false, kStages, 0},
    {"ss_n256_wait0",                  2,   256, false,  false,  false, false, 1,      false, kStages, 0},
    {"ss_n128_3wg_promote",            3,   128, true,   false,  false, false, 1,      false, kStages, 0},
    {"ss_n128_1wg_2cta_promote",       1,   128, true,   false,  false, false, 2,      false, kStages, 0},
    {"rs_n128_wait0_promote",          2,   128, true,   false,  true,  false, 1,      false, kStages, 0},
    {"ss_n128_wait0_promote_barrier",  2,   128, true,   false,  false, true,  1,      false, kStages, 0},
    // n = 256 with tma: two 128-column halves, each its own wgmma group (see the kernel).
    {"tma_bm128_bn128_2wg",            2,   128, true,   false,  false, false, 1,      true,  6,       0},
    {"tma_bm64_bn128_1wg_2cta",        1,   128, true,   false,  false, false, 2,      true,  4,       0},
    {"tma_bm128_bn256_2wg_halves",     2,   256, true,   false,  false, false, 1,      true,  4,       232},
    {"tma_bm192_bn128_3wg",            3,   128, true,   false,  false, false, 1,      true,  5,       160},
};
// clang-format on
constexpr int kPatternCount = static_cast<int>(sizeof kPatterns / sizeof kPatterns[0]);

constexpr int probe_threads(ProbePattern p) { return 128 * p.wgs + (p.tma && p.regs ? 128 : p.ring || p.tma ? 32 : 0); }
// setmaxnreg: ptxas sizes a CTA's registers in whole warpgroups (4 warps), so a producer warp
// beside 2 (3) consumer warpgroups leaves each thread 168 (128) registers (ptxas 13.0: 288 and
// 416 threads), too few for the 128 totals + 64 accumulators of the two-halves pattern (the
// 64 + 64 of 3 warpgroups: both spilled). With a producer warpgroup instead, it gives registers
// back (setmaxnreg.dec) and the consumers take them (setmaxnreg.inc) out of the CTA's pool:
// threads x the launch's registers per thread, the most __launch_bounds__ allows (ptxas reports
// it; the host checks it).
constexpr int probe_launch_regs(ProbePattern p) { return 65536 / probe_threads(p) / 8 * 8; }
constexpr int probe_producer_regs(ProbePattern p) {
  return std::min(probe_launch_regs(p) * (p.wgs + 1) - p.wgs * p.regs, 256) / 8 * 8;
}
// The tiles (one set, or one per stage of a TMA ring), the scales, the barriers, the alignment.
constexpr int probe_smem_bytes(ProbePattern p) {
  return (p.tma ? p.stages : 1) * (64 * p.wgs + p.n) * kBK + kScaleBlocks * 64 * p.wgs * 4 + 2 * p.stages * 8 + 1024;
}

// The TMA patterns' operands in global memory: A and B each [kTmaRows][kTmaK] E4M3 bytes (8 MB,
// both resident in the 50 MB L2), A[r][k] = probe_code(r * kTmaK + k), B's the same plus kSaltTmaB.
constexpr int kTmaRows = 4096;
constexpr int kTmaK = 2048;
constexpr int kTmaKBlocks = kTmaK / kBK;  // K blocks per tile
constexpr uint32_t kSaltTmaB = 0x10000000u;

// The operand bytes: E4M3 codes of +-{0.5, 1, 1.5, 2} picked by an integer hash of the element's
// index (A: row * 128 + k; B: kSaltB + column * 128 + k). Products are multiples of 1/4 up to 4,
// so a 128-term dot product is exact in far fewer bits than the MMA's accumulator keeps.
__host__ __device__ inline uint8_t probe_code(uint32_t i) {
  uint32_t h = i * 0x9E3779B1u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  const uint32_t mag = h & 3u;
  const uint8_t code = mag == 0 ? 0x30 : mag == 1 ? 0x38 : mag == 2 ? 0x3C : 0x40;  // 0.5, 1, 1.5, 2
  return static_cast<uint8_t>(code | ((h >> 2) & 1u) << 7);
}

// Byte k of row `row` of a K-major tile of 128-byte rows in the 128-byte swizzle (TMA's
// CU_TENSOR_MAP_SWIZZLE_128B, as our GEMM loads it): 8-row atoms of 1024 bytes, the 16-byte
// chunk c of row r stored at chunk c ^ (r % 8).
__device__ __forceinline__ int sw128_offset(int row, int k) {
  return (row / 8) * 1024 + (row % 8) * 128 + (((k / 16) ^ (row % 8)) * 16) + k % 16;
}

// The accumulator operands of the wgmma below, eight at a time.
#define PROBE_ACC8(b)                                                                                         \
  "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), "+f"(d[(b) + 5]), \
      "+f"(d[(b) + 6]), "+f"(d[(b) + 7])

// D[64 x 256] (+)= A[64 x 32] B[32 x 256]: the same with 128 accumulators per thread.
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1;\n"
      "}\n"
      : PROBE_ACC8(0), PROBE_ACC8(8), PROBE_ACC8(16), PROBE_ACC8(24), PROBE_ACC8(32), PROBE_ACC8(40), PROBE_ACC8(48),
        PROBE_ACC8(56), PROBE_ACC8(64), PROBE_ACC8(72), PROBE_ACC8(80), PROBE_ACC8(88), PROBE_ACC8(96), PROBE_ACC8(104),
        PROBE_ACC8(112), PROBE_ACC8(120)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 128] (+)= A[64 x 32] B[32 x 128] with A from registers: per thread four .b32 of four E4M3
// each, in mma.m16n8k32's A layout within its warp's 16 rows (the RS form; E4M3 allows no
// transpose, so both operands are K-major).
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : PROBE_ACC8(0), PROBE_ACC8(8), PROBE_ACC8(16), PROBE_ACC8(24), PROBE_ACC8(32), PROBE_ACC8(40), PROBE_ACC8(48),
        PROBE_ACC8(56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

#undef PROBE_ACC8

struct ProbeArgs {
  int iters;                 // K blocks per warpgroup (a multiple of kOverlapBlocks)
  float* check;              // [64 wgs][n]: CTA 0's accumulators of one K block
  float* sink;               // [grid * threads]: a sum per thread, so no result is dead code
  unsigned long long* time;  // {SM clocks, globaltimer ns} of CTA 0's loop
};

// One K block of 4 wgmma (k32 each) into acc, committed as one group; not waited for.
template <int kN, bool kRegA>
__device__ __forceinline__ void issue_block(float (&acc)[kN / 2], uint64_t da, uint64_t db,
                                            const uint32_t (&ra)[kBK / 32][4]) {
  fence_acc(acc);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBK / 32; ++k) {
    if constexpr (kRegA) wgmma_rs_n128(acc, ra[k], db + 2 * k, k > 0);
    else if constexpr (kN == 128) wgmma_m64n128k32_e4m3(acc, da + 2 * k, db + 2 * k, k > 0);
    else wgmma_ss_n256(acc, da + 2 * k, db + 2 * k, k > 0);
  }
  wgmma_commit();
}

// Our GEMM's promotion: acc[4 i + j] belongs to row (j < 2 ? row0 : row1), scaled by its row's scale.
template <int N>
__device__ __forceinline__ void promote(float (&total)[N], const float (&acc)[N], float s0, float s1) {
#pragma unroll
  for (int i = 0; i < N; ++i) total[i] = fmaf(acc[i], (i & 2) ? s1 : s0, total[i]);
}

// Pattern kPatterns[kId]: fill, then args.iters K blocks per warpgroup.
template <int kId>
__global__ void __launch_bounds__(probe_threads(kPatterns[kId]), kPatterns[kId].ctas_per_sm)
    mma_probe_kernel(ProbeArgs args) {
  constexpr ProbePattern P = kPatterns[kId];
  static_assert(P.n == 128 || P.n == 256, "wgmma columns: 128 or 256");
  static_assert(!P.reg_a || P.n == 128, "the RS pattern is built for n = 128");
  static_assert(!P.overlap || (P.promote && !P.ring), "the overlap pattern promotes and has no ring");
  constexpr int kBM = 64 * P.wgs;
  constexpr int kAcc = P.n / 2;  // FP32 accumulators per thread of a m64 x n wgmma
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* sm_a = smem;                                                       // [kBM][128], swizzled
  uint8_t* sm_b = sm_a + kBM * kBK;                                           // [n][128], swizzled
  float* scales = reinterpret_cast<float*>(sm_b + P.n * kBK);                 // [kScaleBlocks][kBM]
  uint64_t* full = reinterpret_cast<uint64_t*>(scales + kScaleBlocks * kBM);  // [kStages]
  uint64_t* empty = full + kStages;                                           // [kStages]

  // Fill: the same bytes in every CTA; scales of 1 (promotion's cost, not its values, matters).
  for (int i = threadIdx.x; i < kBM * kBK; i += blockDim.x) sm_a[sw128_offset(i / kBK, i % kBK)] = probe_code(i);
  for (int i = threadIdx.x; i < P.n * kBK; i += blockDim.x)
    sm_b[sw128_offset(i / kBK, i % kBK)] = probe_code(kSaltB + i);
  for (int i = threadIdx.x; i < kScaleBlocks * kBM; i += blockDim.x) scales[i] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the wgmma (async proxy) reads these
  if (P.ring && threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);           // the producer's arrive
      mbar_init(&empty[s], 4 * P.wgs);  // lane 0 of every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  if (wg == P.wgs) {  // the ring's producer warp: one thread re-arms "full" once a stage is released
    if constexpr (P.ring) {
      if (lane == 0)
        for (int g = 0; g < args.iters; ++g) {
          const int s = g % kStages;
          mbar_wait(&empty[s], ((g / kStages) & 1) ^ 1);
          mbar_arrive(&full[s]);
        }
    }
    return;
  }

  unsigned long long clock0 = 0, ns0 = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    clock0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));
  }
  const uint64_t da = sw128_desc(sm_a + wg * 64 * kBK), db = sw128_desc(sm_b);
  const int r0 = wg * 64 + warp * 16 + lane / 4;  // this thread's rows r0 and r0 + 8 of the CTA's A
  // The RS pattern's A: per k-step, rows r0 / r0 + 8 x bytes 4 (lane % 4) (+ 16) of the step's 32.
  uint32_t ra[kBK / 32][4] = {};
  if constexpr (P.reg_a) {
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k)
#pragma unroll
      for (int h = 0; h < 4; ++h)
        ra[k][h] = *reinterpret_cast<const uint32_t*>(
            sm_a + sw128_offset(r0 + (h & 1) * 8, 32 * k + (h >> 1) * 16 + 4 * (lane % 4)));
  }

  // The accumulators are not initialized: each K block's first wgmma overwrites them (scale-d
  // 0). Zeroing them would put moves into acc2 between the first wgmma and its wait, which ptxas
  // answers by serializing every wgmma of the overlap pattern.
  float acc[kAcc], acc2[P.overlap ? kAcc : 1], total[P.promote ? kAcc : 1];
#pragma unroll
  for (int i = 0; i < (P.promote ? kAcc : 1); ++i) total[i] = 0.0f;
  auto scale = [&](int b, int row) { return scales[(b & (kScaleBlocks - 1)) * kBM + row]; };

  if constexpr (P.overlap) {
    // Block b in acc (even b) or acc2 (odd b): issue b + 1, wait until only it is in flight
    // (wait_group 1), promote b while b + 1 runs on the tensor cores, issue b + 2, and so on,
    // draining (wait_group 0) every kOverlapBlocks blocks. With a wgmma still in flight across
    // the loop's back edge (one block per iteration, or a pair), ptxas 13.0 serialized every
    // wgmma of the kernel (C7514: accumulators read inside a pipeline stage). So the loop body is
    // kOverlapBlocks blocks, fully unrolled, and nothing is in flight when it loops.
    for (int b = 0; b < args.iters; b += kOverlapBlocks) {
      issue_block<P.n, P.reg_a>(acc, da, db, ra);
#pragma unroll
      for (int j = 0; j < kOverlapBlocks; j += 2) {
        issue_block<P.n, P.reg_a>(acc2, da, db, ra);
        wgmma_wait<1>();
        fence_acc(acc);
        promote(total, acc, scale(b + j, r0), scale(b + j, r0 + 8));
        if (j + 2 < kOverlapBlocks) {
          issue_block<P.n, P.reg_a>(acc, da, db, ra);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        fence_acc(acc2);
        promote(total, acc2, scale(b + j + 1, r0), scale(b + j + 1, r0 + 8));
      }
    }
  } else {
    for (int b = 0; b < args.iters; ++b) {
      const int s = b % kStages;
      float s0 = 0.0f, s1 = 0.0f;
      if constexpr (P.promote) s0 = scale(b, r0), s1 = scale(b, r0 + 8);
      if constexpr (P.ring) mbar_wait(&full[s], (b / kStages) & 1);
      issue_block<P.n, P.reg_a>(acc, da, db, ra);
      fence_acc(acc);
      wgmma_wait<0>();
      fence_acc(acc);
      if constexpr (P.ring)
        if (lane == 0) mbar_arrive(&empty[s]);
      if constexpr (P.promote) promote(total, acc, s0, s1);
    }
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long ns1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
    args.time[0] = clock64() - clock0;
    args.time[1] = ns1 - ns0;
  }
  // CTA 0's last K block of acc: the product of its A rows and B, the same in every K block.
  if (blockIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int row = r0 + ((i & 2) ? 8 : 0), col = 8 * (i / 4) + 2 * (lane % 4) + (i & 1);
      args.check[row * P.n + col] = acc[i];
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sum += P.promote ? total[i] : acc[i];
  args.sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// total[kOff + i] += acc[i] * its row's scale: the promotion of one 128-column half of a wider tile.
template <int kOff, int N, int M>
__device__ __forceinline__ void promote_at(float (&total)[N], const float (&acc)[M], float s0, float s1) {
#pragma unroll
  for (int i = 0; i < M; ++i) total[kOff + i] = fmaf(acc[i], (i & 2) ? s1 : s0, total[kOff + i]);
}

// The TMA-fed pattern kPatterns[kId]: a producer warp streams the tiles of args.iters K blocks
// (tile j of the CTA, K block kb: its g = j * kTmaKBlocks + kb-th) through the ring; the consumer
// warpgroups run each K block's wgmma, wait_group 0 and promote. The producer and the consumers
// count the stage uses g over the same sequence, as our GEMM does.
template <int kId>
__global__ void __launch_bounds__(probe_threads(kPatterns[kId]), kPatterns[kId].ctas_per_sm)
    mma_probe_tma_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                         ProbeArgs args) {
  constexpr ProbePattern P = kPatterns[kId];
  static_assert(P.tma && P.promote && !P.overlap && !P.reg_a && !P.ring, "a TMA pattern promotes, nothing else");
  static_assert(P.n == 128 || P.n == 256, "B tiles of one or two 128-row halves");
  constexpr int kBM = 64 * P.wgs, kS = P.stages;
  constexpr int kTileA = kBM * kBK, kTileB = P.n * kBK;  // bytes per stage (1024-byte multiples)
  constexpr int kHalves = P.n / 128;                     // B's TMA boxes and wgmma groups per K block
  constexpr int kMTiles = kTmaRows / kBM, kNTiles = kTmaRows / P.n;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* sm_a = smem;                                                       // [kS][kBM][128], swizzled
  uint8_t* sm_b = sm_a + kS * kTileA;                                         // [kS][n][128], swizzled
  float* scales = reinterpret_cast<float*>(sm_b + kS * kTileB);               // [kScaleBlocks][kBM]
  uint64_t* full = reinterpret_cast<uint64_t*>(scales + kScaleBlocks * kBM);  // [kS]
  uint64_t* empty = full + kS;                                                // [kS]

  for (int i = threadIdx.x; i < kScaleBlocks * kBM; i += blockDim.x) scales[i] = 1.0f;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      mbar_init(&full[s], 1);           // the producer's expect_tx arrive
      mbar_init(&empty[s], 4 * P.wgs);  // lane 0 of every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  if (wg == P.wgs) {  // the producer warp (warpgroup): one thread issues every load
    if constexpr (P.regs != 0) {
      static_assert(probe_producer_regs(P) >= 24, "setmaxnreg: the consumers ask for more than the pool holds");
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(probe_producer_regs(P)));
    }
    if (tid == 0)
      for (int g = 0; g < args.iters; ++g) {
        const int s = g % kS;
        mbar_wait(&empty[s], ((g / kS) & 1) ^ 1);
        mbar_expect_tx(&full[s], kTileA + kTileB);
        const int t = static_cast<int>(blockIdx.x) + g / kTmaKBlocks * static_cast<int>(gridDim.x);
        const int k = g % kTmaKBlocks * kBK;
        tma_load_2d(sm_a + s * kTileA, &tm_a, &full[s], k, t % kMTiles * kBM);
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
          tma_load_2d(sm_b + s * kTileB + h * 128 * kBK, &tm_b, &full[s], k, t / kMTiles % kNTiles * P.n + h * 128);
      }
    // The consumers wait for every stage this thread fills, so the CTA outlives its loads.
    return;
  }

  if constexpr (P.regs != 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(P.regs));
  unsigned long long clock0 = 0, ns0 = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    clock0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));
  }
  const int r0 = wg * 64 + warp * 16 + lane / 4;  // this thread's rows r0 and r0 + 8 of the tile
  const uint32_t no_ra[kBK / 32][4] = {};         // issue_block's register A (unused: SS form)
  // acc is not initialized: each half's first wgmma overwrites it (see mma_probe_kernel).
  float acc[64], total[P.n / 2];
#pragma unroll
  for (int i = 0; i < P.n / 2; ++i) total[i] = 0.0f;
  auto scale = [&](int b, int row) { return scales[(b & (kScaleBlocks - 1)) * kBM + row]; };

  for (int g = 0; g < args.iters; ++g) {
    const int s = g % kS;
    const float s0 = scale(g, r0), s1 = scale(g, r0 + 8);
    mbar_wait(&full[s], (g / kS) & 1);
    const uint64_t da = sw128_desc(sm_a + s * kTileA + wg * 64 * kBK);
    // Half kH of B (rows 128 kH of the stage's tile): 4 x m64n128k32, wait 0, promotion into
    // total[64 kH ..]; the stage goes back to the producer after the last half's wait.
    auto half = [&](auto h) {
      constexpr int kH = decltype(h)::value;
      issue_block<128, false>(acc, da, sw128_desc(sm_b + s * kTileB + kH * 128 * kBK), no_ra);
      fence_acc(acc);
      wgmma_wait<0>();
      fence_acc(acc);
      if (kH == kHalves - 1 && lane == 0) mbar_arrive(&empty[s]);
      // CTA 0's first K block of its first tile (rows and columns from 0, K bytes 0..127).
      if (g == 0 && blockIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          const int row = r0 + ((i & 2) ? 8 : 0), col = kH * 128 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1);
          args.check[row * P.n + col] = acc[i];
        }
      }
      promote_at<kH * 64>(total, acc, s0, s1);
    };
    half(std::integral_constant<int, 0>{});
    if constexpr (kHalves == 2) half(std::integral_constant<int, 1>{});
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long ns1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
    args.time[0] = clock64() - clock0;
    args.time[1] = ns1 - ns0;
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < P.n / 2; ++i) sum += total[i];
  args.sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// The TMA operands' bytes: p[i] = probe_code(salt + i).
__global__ void probe_fill_kernel(uint8_t* p, uint32_t n, uint32_t salt) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = probe_code(salt + i);
}

// ---- host ------------------------------------------------------------------------------------

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DevicePtr = std::unique_ptr<void, DeviceFree>;

struct ProbeDevice {
  int sms = 0, smem_per_sm = 0, smem_optin = 0, smem_reserved = 0;
};

// The host reference of CTA 0's accumulators [rows][n] (rows = 64 wgs): the FP32 dot products of
// the decoded E4M3 bytes (row m of A: codes m * ld + k; column c of B: salt_b + c * ld + k, k <
// 128). Each value must match within 1e-3 of the sum of its terms' magnitudes (exact arithmetic
// gives 0; a wrong layout or descriptor gives errors of the terms' own size).
bool probe_check(const std::vector<float>& got, int rows, int n, int ld, uint32_t salt_b, std::string& why) {
  int bad = 0;
  for (int m = 0; m < rows; ++m)
    for (int c = 0; c < n; ++c) {
      double ref = 0, mag = 0;
      for (int k = 0; k < kBK; ++k) {
        const double t = static_cast<double>(e4m3_to_float(probe_code(static_cast<uint32_t>(m * ld + k)))) *
                         e4m3_to_float(probe_code(salt_b + static_cast<uint32_t>(c * ld + k)));
        ref += t, mag += std::fabs(t);
      }
      const float v = got[static_cast<size_t>(m) * n + c];
      if (!(std::fabs(v - ref) <= 1e-3 * mag)) {
        if (bad == 0) {
          char buf[160];
          std::snprintf(buf, sizeof buf, "first at row %d col %d: got %g, expected %g", m, c, v, ref);
          why = buf;
        }
        ++bad;
      }
    }
  if (bad) why = std::to_string(bad) + " of " + std::to_string(rows * n) + " values differ, " + why;
  return bad == 0;
}

// A TMA operand [kTmaRows][kTmaK] bytes, K-major: boxes of box_rows x 128 bytes in the 128-byte
// swizzle (our GEMM's tensor maps).
CUtensorMap probe_tensor_map(const uint8_t* base, int box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kTmaK), static_cast<cuuint64_t>(kTmaRows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kTmaK)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(base), dims,
                                          strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP8RL_CHECK(r == CUDA_SUCCESS, "mma probe: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ") for boxes of ",
              box_rows, " rows");
  return m;
}

// The TMA patterns' operands (device memory, filled once).
struct TmaOperands {
  const uint8_t* a = nullptr;  // [kTmaRows][kTmaK]
  const uint8_t* b = nullptr;  // [kTmaRows][kTmaK]
};

template <int kId>
MmaProbeResult probe_run(const ProbeDevice& dev, int iters, double peak_tflops, const ProbeArgs& buffers,
                         const TmaOperands& ops) {
  constexpr ProbePattern P = kPatterns[kId];
  const char* name = P.name;
  auto* kernel = [] {
    if constexpr (P.tma) return mma_probe_tma_kernel<kId>;
    else return mma_probe_kernel<kId>;
  }();
  constexpr int kThreads = probe_threads(P);
  // Shared memory: the tiles, padded so that no more than ctas_per_sm CTAs fit on an SM (more
  // warpgroups per SM would hide the very bubbles a pattern measures).
  const int pinned = (dev.smem_per_sm / P.ctas_per_sm - dev.smem_reserved) / 128 * 128;
  const int smem = std::max(probe_smem_bytes(P), std::min(pinned, dev.smem_optin));
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "mma probe: setting the shared memory of ", name);
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem), "mma probe: the CTAs of ",
             name, " that fit");
  FP8RL_CHECK(per_sm > 0, "mma probe: no CTA of ", name, " (", kThreads, " threads, ", smem,
              " bytes of shared memory) fits on this device");
  cudaFuncAttributes fa{};
  CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel), "mma probe: the attributes of ", name);
  // setmaxnreg.inc waits until the CTA's pool has the registers: a smaller launch would hang.
  if constexpr (P.regs != 0)
    FP8RL_CHECK(fa.numRegs * (P.wgs + 1) >= P.wgs * P.regs + probe_producer_regs(P), "mma probe: ", name,
                " was built with ", fa.numRegs, " registers per thread, too few for setmaxnreg to give the consumers ",
                P.regs);

  const int ctas = std::min(per_sm, P.ctas_per_sm), grid = dev.sms * ctas;
  ProbeArgs a = buffers;
  a.iters = iters;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0), "creating an event");
  CUDA_CHECK(cudaEventCreate(&e1), "creating an event");
  // The TMA patterns' maps: A in boxes of the tile's rows, B in 128-row boxes (one per half).
  CUtensorMap tm_a{}, tm_b{};
  if constexpr (P.tma) tm_a = probe_tensor_map(ops.a, 64 * P.wgs), tm_b = probe_tensor_map(ops.b, 128);
  auto launch = [&] {
    if constexpr (kPatterns[kId].tma) kernel<<<grid, kThreads, smem>>>(tm_a, tm_b, a);
    else kernel<<<grid, kThreads, smem>>>(a);
    CUDA_CHECK_LAUNCH(name);
  };
  launch();  // warm-up
  CUDA_CHECK(cudaEventRecord(e0), "recording an event");
  launch();
  CUDA_CHECK(cudaEventRecord(e1), "recording an event");
  CUDA_CHECK(cudaEventSynchronize(e1), "running the mma probe's ", name);
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1), "reading an event");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);

  MmaProbeResult r;
  r.name = name;
  r.ms = ms;
  const double flops = 2.0 * grid * P.wgs * static_cast<double>(iters) * 64 * P.n * kBK;
  r.tflops = flops / (ms * 1e-3) / 1e12;

  const int rows = 64 * P.wgs;
  std::vector<float> got(static_cast<size_t>(rows) * P.n);
  unsigned long long t[2] = {0, 0};
  CUDA_CHECK(cudaMemcpy(got.data(), a.check, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
             "copying the mma probe's accumulators");
  CUDA_CHECK(cudaMemcpy(t, a.time, sizeof t, cudaMemcpyDeviceToHost), "copying the mma probe's clocks");
  std::string why;
  r.checked = true;
  r.checked_ok =
      P.tma ? probe_check(got, rows, P.n, kTmaK, kSaltTmaB, why) : probe_check(got, rows, P.n, kBK, kSaltB, why);

  // The SM clock CTA 0 saw during its loop, and the share of the peak at that clock.
  const double mhz = t[1] > 0 ? static_cast<double>(t[0]) / static_cast<double>(t[1]) * 1e3 : 0.0;
  const double peak_now = dev.sms * mhz * 1e6 * 8192 / 1e12;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "ctas/sm=%d wg/cta=%d threads=%d regs=%d local=%dB smem=%dKB%s clock=%.0fMHz of_peak=%.1f%% "
                "of_peak_at_clock=%.1f%%",
                ctas, P.wgs, kThreads, fa.numRegs, static_cast<int>(fa.localSizeBytes), smem / 1024,
                P.tma ? (" stages=" + std::to_string(P.stages)).c_str() : "", mhz, 100.0 * r.tflops / peak_tflops,
                peak_now > 0 ? 100.0 * r.tflops / peak_now : 0.0);
  r.note = buf;
  if (ctas < P.ctas_per_sm) r.note += " (only " + std::to_string(ctas) + " CTAs/SM fit)";
  if (!r.checked_ok) r.note += " check: " + why;
  return r;
}

}  // namespace

MmaProbeReport run_mma_probe(int device, int iters) {
  FP8RL_CHECK(iters > 0, "bench-gemm --mma-iters must be positive, got ", iters);
  CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "querying device ", device);
  FP8RL_CHECK(prop.major == 9, "the mma probe needs an sm_90 (Hopper) GPU; device ", device, " is ", prop.name, " (sm_",
              prop.major, prop.minor, ")");
  ProbeDevice dev;
  int clock_khz = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&dev.sms, cudaDevAttrMultiProcessorCount, device), "querying the SMs");
  CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device), "querying the SM clock");
  CUDA_CHECK(cudaDeviceGetAttribute(&dev.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
             "querying the shared memory per SM");
  CUDA_CHECK(cudaDeviceGetAttribute(&dev.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "querying the shared memory per CTA");
  CUDA_CHECK(cudaDeviceGetAttribute(&dev.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device),
             "querying the reserved shared memory per CTA");

  MmaProbeReport report;
  report.device = prop.name;
  report.sms = dev.sms;
  report.clock_khz = clock_khz;
  // sm_90's dense FP8 tensor rate: 8192 FLOP per clock per SM (one m64n256k32 wgmma, 2^20 FLOP,
  // every 128 clocks; twice the BF16 rate of 4096).
  report.peak_tflops = static_cast<double>(dev.sms) * clock_khz * 1e3 * 8192 / 1e12;
  report.iters = (iters + kOverlapBlocks - 1) / kOverlapBlocks * kOverlapBlocks;  // the overlap pattern's unit

  constexpr int kMaxThreads = [] {  // threads per SM, the most of any pattern
    int m = 0;
    for (const ProbePattern& p : kPatterns) m = std::max(m, probe_threads(p) * p.ctas_per_sm);
    return m;
  }();
  const size_t sink_floats = static_cast<size_t>(dev.sms) * kMaxThreads;
  DevicePtr check(cuda_malloc(192 * 256 * sizeof(float), "the mma probe's accumulators"));
  DevicePtr sink(cuda_malloc(sink_floats * sizeof(float), "the mma probe's sink"));
  DevicePtr time(cuda_malloc(2 * sizeof(unsigned long long), "the mma probe's clocks"));
  ProbeArgs buffers{0, static_cast<float*>(check.get()), static_cast<float*>(sink.get()),
                    static_cast<unsigned long long*>(time.get())};
  // The TMA patterns' operands, filled once on the device.
  constexpr uint32_t kTmaBytes = static_cast<uint32_t>(kTmaRows) * kTmaK;
  DevicePtr tma_a(cuda_malloc(kTmaBytes, "the mma probe's A operand"));
  DevicePtr tma_b(cuda_malloc(kTmaBytes, "the mma probe's B operand"));
  probe_fill_kernel<<<dev.sms * 4, 256>>>(static_cast<uint8_t*>(tma_a.get()), kTmaBytes, 0);
  CUDA_CHECK_LAUNCH("mma probe: filling A");
  probe_fill_kernel<<<dev.sms * 4, 256>>>(static_cast<uint8_t*>(tma_b.get()), kTmaBytes, kSaltTmaB);
  CUDA_CHECK_LAUNCH("mma probe: filling B");
  const TmaOperands ops{static_cast<const uint8_t*>(tma_a.get()), static_cast<const uint8_t*>(tma_b.get())};

  [&]<int... kIds>(std::integer_sequence<int, kIds...>) {
    (report.results.push_back(probe_run<kIds>(dev, report.iters, report.peak_tflops, buffers, ops)), ...);
  }
  (std::make_integer_sequence<int, kPatternCount>{});
  return report;
}

}  // namespace fp8rl::cuda
