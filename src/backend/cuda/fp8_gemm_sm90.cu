// An own block-scaled FP8 GEMM for Hopper (sm_90a): C[M, N] = alpha * A B^T (+ beta * C) with
// A E4M3 [M, K] in 1x128 blocks along K (activations, dY) and B E4M3 [N, K] in 128x128 blocks
// (weights, W^T), the recipe's forward and dgrad products. DeepGEMM's structure, written here:
//
// - A CTA computes BM x 128 tiles of C (BM = 64 or 128: one or two consumer warpgroups of 64
//   rows), each over a range of K blocks (all of them, or a split of them: split-K for the decode
//   shapes, whose few tiles would leave most SMs idle). A persistent grid: at most as many CTAs
//   as fit at once (one per SM; two for 64-row tiles, FP8RL_FP8_GEMM_OCCUPANCY=1: one), each
//   walking every gridDim-th tile with its stage ring running on from one tile into the
//   next, so no tile waits for a launch, a pipeline fill or the previous tile's epilogue.
//   FP8RL_FP8_GEMM_GRID=tile launches one CTA per tile instead (the same arithmetic, bitwise;
//   3-10% slower on the H200, 11-17% on the grouped expert product: bench-gemm times both).
// - A producer warp streams A and B tiles of 128 K-bytes through a ring of shared-memory stages
//   with TMA (128-byte swizzle, zero fill past M, N and K) and mbarriers.
// - Per K block each consumer warpgroup issues four wgmma m64n128k32 (FP32 accumulators in the
//   tensor cores), waits for them, and promotes: acc_total += acc_block * (sa[row] * sb), with
//   the 1x128 scale of its row and the 128x128 scale of the tile's weight block. Promoting every
//   128 K keeps the sum in true FP32 (Hopper's FP8 MMA accumulates with fewer bits).
// - Optional (environment, read at each call): clusters sharing A and B tiles by TMA multicast
//   (FP8RL_FP8_GEMM_CLUSTER), the scales staged in shared memory by the producer instead of
//   read by the consumers from global memory (FP8RL_FP8_GEMM_SCALES=smem).
// - Per-row B scales (Fp8GemmArgs::b_scales_rows: the FP8 wgrad, whose B is X^T quantized 1x128
//   along tokens): one scale per B row and K block, [kb][N]. The producer copies the tile's 128
//   column scales of each K block into a 512-byte slot of the stage (a bulk copy counted in the
//   stage's barrier), and the consumers promote with acc_total += acc_block * (sa[row] * sb[col]),
//   reading the scales of their columns from the slot before they release the stage. 128-row
//   tiles with the overlapped K loop only (kBRows).
// - Splits write FP32 partials that a second kernel sums in split order: no atomics, so every
//   result is deterministic, and each output element's arithmetic depends only on its own row
//   of A, its column of B, K and the split count — never on M or on the other rows (the row
//   invariance the consistent mode needs; the split count is the caller's choice).
//
// Any M (no padding), N and K multiples of 16 (TMA's 16-byte row strides); partial blocks of N
// and K are read as zeros.
//
// The BF16 mode (kBf16: A and B BF16, no scales) runs on the same structure: TMA maps over the
// operands' bytes (a 128-byte stage holds 64 elements), four wgmma m64n128k16 per stage into one
// FP32 accumulator set over all of the tile's K, no promotion, the same epilogues and splits.
// The grouped product's tile table may also come from the device (Fp8GroupedArgs::device_tiles):
// the kernel then reads its count (kTileCount, and every BF16 instance).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/sm90.cuh"
#include "backend/cuda/stream_k.h"
#include "quant/quant.h"

namespace fp8rl::cuda {

PFN_cuTensorMapEncodeTiled_v12000 sm90::tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q),
               "looking up cuTensorMapEncodeTiled");
    FP8RL_CHECK(q == cudaDriverEntryPointSuccess && f, "the CUDA driver has no cuTensorMapEncodeTiled (needs 12.0+)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

namespace {

using namespace sm90;  // the Hopper wrappers (sm90.cuh)

constexpr int kBK = 128;  // K bytes per stage = one scale block
constexpr int kBN = 128;  // the wide tile's columns = the weight scale block: one B scale per tile and K block
// A tile of kBNt columns (128, or 64: FP8RL_FP8_GEMM_BN=64, "narrow tiles" for the decode
// products whose 128-column tiles leave most SMs idle) takes the B scale of scale block
// n_tile * kBNt / 128 of its columns.

// The tile's wgmma over 32 K bytes: m64 x kBNt.
template <int kBNt>
__device__ __forceinline__ void wgmma_tile(float (&d)[kBNt / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (kBNt == 128) wgmma_m64n128k32_e4m3(d, desc_a, desc_b, accumulate);
  else wgmma_m64n64k32_e4m3(d, desc_a, desc_b, accumulate);
}

// A 1-D bulk copy (TMA without a tensor map) of `bytes` (a multiple of 16) from global to shared
// memory, both 16-byte aligned, completing on the mbarrier as transaction bytes (the per-row B
// scales' stage slots, kBRows).
__device__ __forceinline__ void bulk_load_1d(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

struct GemmParams {
  int64_t M, N, K;
  int kblocks;       // ceil(K / 128)
  int kb_per_split;  // K blocks per split
  const float* sa;   // A scales: element (m, kb) at sa[m * sa_m + kb * sa_k]
  int64_t sa_m, sa_k;
  const float* sb;  // B scales [ceil(N / 128)][kblocks], or [kblocks][N] (kBRows: per row)
  void* c;          // [M, N] BF16 or F32 (splits == 1), else F32 partials [splits][M][N]
  bool c_bf16;
  float alpha, beta;
  bool partials;
  int n_tiles, m_tiles, splits;  // the tiles: n_tiles x m_tiles x splits (tile_of)
  bool m_fastest;                // the tile order (tile_of)
  int group_n = 0;               // n fastest: in bands of group_n tile columns (0: one band)
  // The cluster: cm x cn CTAs (fp8_gemm_kernel's kCM, kCN) own the cm x cn tiles of one cluster
  // tile; ct_m, ct_n: the cluster tiles along M and N (m_tiles / cm, n_tiles / cn, rounded up).
  int ct_m = 0, ct_n = 0;
  // Grouped (fp8_gemm_sm90_grouped): per m tile (tile_of) {group, first row, end row, 0}; each group's
  // B through its own tensor map (global memory) and scales. Null for the dense product.
  const int4* tiles = nullptr;
  const CUtensorMap* b_maps = nullptr;
  const float* const* sb_groups = nullptr;
  // Grouped with a device-side table (Fp8GroupedArgs::device_tiles): its count of valid entries,
  // read by the kernel (instances with kTileCount or kBf16); m_tiles is then the table's capacity
  // (the grid's size), and group_n 0. Null: all m_tiles.
  const int* tile_count = nullptr;
  // K-grouped (fp8_gemm_sm90_kgrouped, BF16): split s is group entry s, {group, first K block, K
  // blocks, 0}: the tiles of entry s cover all of C_g = c_groups[group] over those K blocks.
  const int4* k_groups = nullptr;
  void* const* c_groups = nullptr;
  // Stream-K (fp8_gemm_kernel's kStreamK; one split, no cluster): the tiles' K blocks cut evenly
  // among the grid's CTAs (stream_k.h). A cut tile's pieces leave FP32 partial tiles in
  // sk_partials (slot stream_k::slot, a consumer thread's 64 values contiguous) and count on the
  // tile's sk_counters entry; the piece that counts last sums the partials in K order and stores
  // the tile, and sets the counter back to zero for the next launch.
  float* sk_partials = nullptr;
  int* sk_counters = nullptr;
};

// One output tile: its B tile, its rows [m_base, m_base + BM) of which those below m_end are
// its own (a grouped tile ends with its group), its B and scales, its K blocks [kb0, kb0 + nk).
struct Tile {
  int n_tile, kb0, nk, split;
  int64_t m_base, m_end;
  const CUtensorMap* map_b;
  const float* sb_base;
};

// Tile t of the product, for the CTA at (ci, cj) of a cm x cn cluster (t counts cluster tiles;
// 1 x 1: plain tiles). n fastest (the tiles that share an A row block run together), or m fastest
// where p.m_fastest (few row blocks: those that share a B tile run together, so each weight tile
// is read from HBM once); the splits outermost. A cluster's CTAs get tiles (m, n) with m = cm *
// cluster m + ci and n = cn * cluster n + cj; tiles past the last (when cm or cn does not divide
// the count) still load their share of the cluster's operands, but store nothing.
template <int kCM, int kCN, bool kKGrouped = false>
__device__ __forceinline__ Tile tile_of(const GemmParams& p, int64_t t, const CUtensorMap* tm_b, int bm, int ci,
                                        int cj) {
  Tile tl;
  const int64_t mt = kCM == 1 ? p.m_tiles : p.ct_m;
  const int nt = kCN == 1 ? p.n_tiles : p.ct_n;
  int64_t m_tile;
  if (p.m_fastest) {
    m_tile = t % mt;
    t /= mt;
    tl.n_tile = static_cast<int>(t % nt);
    tl.split = static_cast<int>(t / nt);
  } else if (p.group_n > 0 && nt > p.group_n) {
    // Bands of group_n tile columns, each walked row by row: the CTAs running at once share a few
    // A row blocks and a few B tiles (an L2 working set of a band, not of all of B).
    const int64_t mn = mt * nt, r = t % mn;
    tl.split = static_cast<int>(t / mn);
    const int64_t band = r / (int64_t{p.group_n} * mt), in = r % (int64_t{p.group_n} * mt);
    const int64_t rest = nt - band * p.group_n, width = rest < p.group_n ? rest : p.group_n;
    tl.n_tile = static_cast<int>(band * p.group_n + in % width);
    m_tile = in / width;
  } else {
    tl.n_tile = static_cast<int>(t % nt);
    t /= nt;
    m_tile = t % mt;
    tl.split = static_cast<int>(t / mt);
  }
  m_tile = m_tile * kCM + ci;
  tl.n_tile = tl.n_tile * kCN + cj;
  tl.kb0 = tl.split * p.kb_per_split;
  tl.nk = min(p.kb_per_split, p.kblocks - tl.kb0);
  if constexpr (kKGrouped) {  // the split is the group entry: its K range
    const int4 e = p.k_groups[tl.split];
    tl.kb0 = e.y, tl.nk = e.z;
  }
  tl.m_base = m_tile * bm, tl.m_end = p.M;
  tl.map_b = tm_b;
  tl.sb_base = p.sb;
  if (p.tiles) {  // grouped: kCM == 1, so m_tile is one of the table's
    const int4 g = p.tiles[m_tile];
    tl.m_base = g.y, tl.m_end = g.z;
    tl.map_b = p.b_maps + g.x;
    tl.sb_base = p.sb_groups[g.x];
  }
  return tl;
}

// Two floats as BF16 (round to nearest even; NaN becomes the canonical NaN), v0 in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float v0, float v1) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(v1), "f"(v0));
  return r;
}

// The epilogue of one consumer thread: its two rows of the tile, alpha / beta applied, BF16 or
// F32, or the split's F32 partials. The common case (BF16, beta = 0, a tile inside N) is a
// separate loop of one multiply pair, one conversion and one store per column pair: the general
// code's per-element checks had made the epilogue a quarter of the kernel's instructions
// (ncu source counters, docs/benchmarks.md session 10).
template <int kBNt>
__device__ __forceinline__ void store_tile(const GemmParams& p, const float (&total)[kBNt / 2], const Tile& tl,
                                           int64_t row0, int64_t row1, int lane) {
  const int64_t col_base = static_cast<int64_t>(tl.n_tile) * kBNt + 2 * (lane % 4);
  const bool cols_in = (static_cast<int64_t>(tl.n_tile) + 1) * kBNt <= p.N;
  if (p.c_bf16 && !p.partials && p.beta == 0.0f && cols_in) {
    const float alpha = p.alpha;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = half ? row1 : row0;
      if (row >= tl.m_end) continue;
      uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.c) + row * p.N + col_base);
#pragma unroll
      for (int i = 0; i < kBNt / 8; ++i)
        out[4 * i] = pack_bf16x2(total[4 * i + 2 * half] * alpha, total[4 * i + 2 * half + 1] * alpha);
    }
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = half ? row1 : row0;
    if (row >= tl.m_end) continue;
#pragma unroll
    for (int i = 0; i < kBNt / 8; ++i) {
      const int64_t col = col_base + 8 * i;
      if (col >= p.N) continue;  // N is even: col + 1 < N as well
      float v0 = total[4 * i + 2 * half], v1 = total[4 * i + 2 * half + 1];
      if (p.partials) {
        float* out = static_cast<float*>(p.c) + (static_cast<int64_t>(tl.split) * p.M + row) * p.N + col;
        *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
        continue;
      }
      v0 *= p.alpha, v1 *= p.alpha;
      if (p.c_bf16) {
        uint16_t* out = static_cast<uint16_t*>(p.c) + row * p.N + col;
        if (p.beta != 0.0f) {
          const uint32_t old = *reinterpret_cast<const uint32_t*>(out);
          v0 = fmaf(p.beta, bf16_bits_to_float(static_cast<uint16_t>(old & 0xffffu)), v0);
          v1 = fmaf(p.beta, bf16_bits_to_float(static_cast<uint16_t>(old >> 16)), v1);
        }
        *reinterpret_cast<uint32_t*>(out) = pack_bf16x2(v0, v1);
      } else {
        float* out = static_cast<float*>(p.c) + row * p.N + col;
        if (p.beta != 0.0f) {
          const float2 old = *reinterpret_cast<const float2*>(out);
          v0 = fmaf(p.beta, old.x, v0);
          v1 = fmaf(p.beta, old.y, v1);
        }
        *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
      }
    }
  }
}

// The epilogue through shared memory (kTmaStore): a consumer warpgroup writes its 64 x 128 BF16
// rows as two 64 x 64 boxes in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8):
// the 8 rows a warp writes at once fall in different banks), then one thread stores both boxes
// with TMA and the warpgroup goes on to its next tile while the store drains. Rows past M and
// columns past N are clipped by the tensor map. The buffer is reused once the previous tile's
// store has read it. Same values as store_tile's fast path (one multiply, one conversion each).
template <int kBNt>
__device__ __forceinline__ void store_tile_tma(const GemmParams& p, const float (&total)[kBNt / 2], const Tile& tl,
                                               int wg, int tid, uint8_t* buf, const CUtensorMap* tm_c) {
  const int warp = tid / 32, lane = tid % 32;
  if (tid == 0) bulk_wait_read();
  warpgroup_sync(wg);
  const float alpha = p.alpha;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + lane / 4 + 8 * half;  // r % 8 == lane / 4
#pragma unroll
    for (int i = 0; i < kBNt / 8; ++i) {
      uint8_t* dst = buf + (i / 8) * 8192 + r * 128 + (((i % 8) ^ (lane / 4)) * 16) + 4 * (lane % 4);
      *reinterpret_cast<uint32_t*>(dst) =
          pack_bf16x2(total[4 * i + 2 * half] * alpha, total[4 * i + 2 * half + 1] * alpha);
    }
  }
  fence_proxy_async();
  warpgroup_sync(wg);
  if (tid == 0) {
    const int col = tl.n_tile * kBNt, row = static_cast<int>(tl.m_base) + wg * 64;
    tma_store_2d(tm_c, buf, col, row);
    if (kBNt == 128 && col + 64 < p.N) tma_store_2d(tm_c, buf + 8192, col + 64, row);  // not a box wholly past N
    bulk_commit();
  }
}

// The overlapped K loop (FP8RL_FP8_GEMM_PIPE=overlap; no cluster, global scales): a consumer
// warpgroup issues K block j + 1's wgmma before it promotes block j (wait_group 1), with two
// accumulator sets, so the promotion's FMAs run while the tensor cores work on the next block
// instead of after a full drain (bench-gemm --mma-probe, session 30: 73% of the tensor peak with
// the drain per block, 96% overlapped, on shared-memory tiles). The tile's K blocks run in chunks
// of up to kOverlapChunk, each fully unrolled and drained at its end: ptxas 13.0 serializes every
// wgmma of a kernel where one is in flight across a loop's back edge. Each block's MMAs, its
// scales and the order of the promotions are those of the drained loop: bitwise the same C.
constexpr int kOverlapChunk = 4;
template <int kStages>
struct OverlapCtx {
  const uint8_t* sm_a;  // this warpgroup's rows of stage 0's A tile
  const uint8_t* sm_b;
  int tile_a, tile_b;  // bytes per stage
  uint64_t* full;
  uint64_t* empty;
  const float* sa;
  int64_t sa_m, sa_k;
  const float* sb;  // the tile's B scales by K block
  int64_t row0, row1;
  bool in0, in1;
  int lane;
  const float* sb_rows = nullptr;  // kBRows: stage 0's slot of the tile's column scales (kBNt floats a stage)
};

// Blocks kb .. kb + kN - 1 of the tile, stage uses g .. g + kN - 1: block j into acc (j even) or
// acc2 (odd); after issuing j, wait until only j is in flight, release j - 1's stage and promote it.
// kBRows (per-row B scales): s0 and s1 hold A's row scales alone, and block j's promotion takes
// each column's B scale from its stage's slot, sa[row] * sb[col] per element (the product the
// 128x128 mode forms once per row: with every column's scale equal to the block's, the same bits),
// before the stage is released. Its A scales are loaded as block j is issued, not all at the
// chunk's start: the per-column products leave no room for eight scales beside the two
// accumulator sets and the totals (ptxas 13.0 spilled the totals; loaded one block ahead, 230 of
// the consumers' 232 registers).
template <int kN, int kBNt, int kStages, bool kBRows = false>
__device__ __forceinline__ void overlap_chunk(const OverlapCtx<kStages>& c, float (&total)[kBNt / 2],
                                              float (&acc)[kBNt / 2], float (&acc2)[kBNt / 2], int g, int kb) {
  float s0[kN], s1[kN];
  auto a_scales = [&](int j) {  // kBRows: A's row scales of block j
    s0[j] = c.in0 ? __ldg(c.sa + c.row0 * c.sa_m + (kb + j) * c.sa_k) : 0.0f;
    s1[j] = c.in1 ? __ldg(c.sa + c.row1 * c.sa_m + (kb + j) * c.sa_k) : 0.0f;
  };
  if constexpr (!kBRows) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {  // the scales first: their loads overlap the waits below
      const float sbv = __ldg(c.sb + kb + j);
      s0[j] = c.in0 ? __ldg(c.sa + c.row0 * c.sa_m + (kb + j) * c.sa_k) * sbv : 0.0f;
      s1[j] = c.in1 ? __ldg(c.sa + c.row1 * c.sa_m + (kb + j) * c.sa_k) * sbv : 0.0f;
    }
  }
  auto issue = [&](float(&d)[kBNt / 2], int j) {
    if constexpr (kBRows) a_scales(j);  // used one block later, by finish(d, j)
    const int s = (g + j) % kStages;
    mbar_wait(&c.full[s], ((g + j) / kStages) & 1);
    const uint64_t da = sw128_desc(c.sm_a + s * c.tile_a), db = sw128_desc(c.sm_b + s * c.tile_b);
    fence_acc(d);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k) wgmma_tile<kBNt>(d, da + 2 * k, db + 2 * k, k > 0);
    wgmma_commit();
  };
  auto finish = [&](float(&d)[kBNt / 2], int j) {
    fence_acc(d);
    if constexpr (kBRows) {
      // Fragment of m64nN: d[4 i + e] is row (e < 2 ? row0 : row1), column 8 i + 2 (lane % 4) + e % 2,
      // so each thread reads 2 adjacent column scales per i (the 4 threads of a row: 32 bytes).
      const float* sbc = c.sb_rows + ((g + j) % kStages) * kBNt + 2 * (c.lane % 4);
#pragma unroll
      for (int i = 0; i < kBNt / 8; ++i) {
        const float2 b = *reinterpret_cast<const float2*>(sbc + 8 * i);
        total[4 * i] = fmaf(d[4 * i], s0[j] * b.x, total[4 * i]);
        total[4 * i + 1] = fmaf(d[4 * i + 1], s0[j] * b.y, total[4 * i + 1]);
        total[4 * i + 2] = fmaf(d[4 * i + 2], s1[j] * b.x, total[4 * i + 2]);
        total[4 * i + 3] = fmaf(d[4 * i + 3], s1[j] * b.y, total[4 * i + 3]);
      }
      __syncwarp();  // every lane's slot reads are done before the warp releases the stage
      if (c.lane == 0) mbar_arrive(&c.empty[(g + j) % kStages]);
    } else {
      if (c.lane == 0) mbar_arrive(&c.empty[(g + j) % kStages]);
#pragma unroll
      for (int i = 0; i < kBNt / 2; ++i) total[i] = fmaf(d[i], (i & 2) ? s1[j] : s0[j], total[i]);
    }
  };
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    if (j % 2 == 0) issue(acc, j);
    else issue(acc2, j);
    if (j > 0) {
      wgmma_wait<1>();
      if ((j - 1) % 2 == 0) finish(acc, j - 1);
      else finish(acc2, j - 1);
    }
  }
  wgmma_wait<0>();
  if ((kN - 1) % 2 == 0) finish(acc, kN - 1);
  else finish(acc2, kN - 1);
}

// Registers. The overlapped loop's two accumulator sets beside the totals are 192 registers per
// consumer thread; ptxas gives a warp of a CTA of 2 consumer warpgroups + a producer warp (9
// warps, 3 on some SM sub-partition) 168 at most. So that instance has a producer warpgroup that
// gives registers back (setmaxnreg.dec to producer_regs) for the consumers to take
// (setmaxnreg.inc to consumer_regs): 2 x 232 + 40 = 3 x 168, the pool of 384 threads. The
// 192-row tiles' three consumer warpgroups (64 totals + 64 accumulators each) beside a producer
// warp would get 120: there too a producer warpgroup, 3 x 160 + 32 = 4 x 128. The 64-row tiles'
// overlapped instance runs one CTA per SM (8 stages), where a thread may hold 255.
constexpr bool producer_warpgroup(int consumers, bool overlap) { return consumers > 2 || (overlap && consumers > 1); }
constexpr int consumer_regs(int consumers) { return consumers > 2 ? 160 : 232; }
constexpr int producer_regs(int consumers) { return consumers > 2 ? 32 : 40; }
// The threads of a CTA (the consumer warpgroups and one producer warp or warpgroup), the
// TMA-store epilogue's buffer, and the CTAs that fit on an SM: two where the stage ring and the
// buffer leave room for a second (64-row tiles: 4 stages, or 3 beside the buffer), so two
// independent pipelines share each SM's tensor cores.
constexpr int gemm_threads(int consumers, bool overlap = false) {
  return 128 * consumers + (producer_warpgroup(consumers, overlap) ? 128 : 32);
}
// Which instances of the overlapped loop exist (the others would spill): two consumers (the
// producer warpgroup), or one at one CTA per SM.
constexpr bool overlap_instance(int consumers, int stages) { return consumers > 1 || stages == 8; }
__host__ __device__ constexpr int gemm_store_bytes(int consumers, bool tma_store) {
  return tma_store ? consumers * 16384 : 0;
}
constexpr int gemm_ctas_per_sm(int consumers, int stages, bool tma_store, int bn = kBN) {
  return stages * (64 * consumers + bn) * kBK + gemm_store_bytes(consumers, tma_store) <= 100 * 1024 ? 2 : 1;
}

// A named barrier of the consumer warpgroups alone (id 4; warpgroup_sync takes 1-3).
template <int kConsumers>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 4, %0;" ::"n"(128 * kConsumers) : "memory");
}

// Stream-K's end of a cut tile t in one CTA (kStreamK): the piece's FP32 totals (before alpha)
// go to its partial slot, and the tile's counter counts the piece. false: another piece is still
// to count, which stores the tile. true: this piece counted last, and `total` is now the tile's
// sum, the pieces' partials added in K order (first_cta's, then each next CTA's): the same bits
// whichever piece finishes last. The counter is set back to zero for the next launch (every
// piece of this launch has counted). Each consumer thread writes and reads only its own 64
// values of a slot (the same fragment in every CTA).
template <int kConsumers, int kAcc>
__device__ __forceinline__ bool stream_k_fixup(const GemmParams& p, float (&total)[kAcc], int64_t units, int64_t t,
                                               int wg, int tid, int* flag) {
  namespace sk = stream_k;
  const int ctas = static_cast<int>(gridDim.x), kb = p.kblocks;
  constexpr int64_t kSlotFloats = int64_t{128} * kConsumers * kAcc;
  const int64_t at = (int64_t{wg} * 128 + tid) * kAcc;
  auto slot_of = [&](int cta) {
    return reinterpret_cast<float4*>(p.sk_partials + sk::slot(units, ctas, kb, cta, t) * kSlotFloats + at);
  };
  float4* mine = slot_of(static_cast<int>(blockIdx.x));
#pragma unroll
  for (int i = 0; i < kAcc / 4; ++i)
    __stcg(mine + i, make_float4(total[4 * i], total[4 * i + 1], total[4 * i + 2], total[4 * i + 3]));
  // The consumers' stores happen before thread 0's fence (the barrier), which releases them at
  // GPU scope before its count; the last piece's thread 0 fences after its count (acquire), and
  // the barrier orders every consumer's loads after that.
  consumers_sync<kConsumers>();
  const int lo = sk::first_cta(units, ctas, kb, t), hi = sk::last_cta(units, ctas, kb, t);
  if (wg == 0 && tid == 0) {
    __threadfence();
    const int last = atomicAdd(p.sk_counters + t, 1) == hi - lo;
    if (last) p.sk_counters[t] = 0;
    __threadfence();
    *flag = last;
  }
  consumers_sync<kConsumers>();
  if (!*reinterpret_cast<volatile int*>(flag)) return false;
  if (lo != static_cast<int>(blockIdx.x)) {  // else `total` holds the first piece already (the usual case)
    const float4* first = slot_of(lo);
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      const float4 v = __ldcg(first + i);
      total[4 * i] = v.x, total[4 * i + 1] = v.y, total[4 * i + 2] = v.z, total[4 * i + 3] = v.w;
    }
  }
  for (int j = lo + 1; j <= hi; ++j) {
    const float4* src = slot_of(j);
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      const float4 v = __ldcg(src + i);
      total[4 * i] += v.x, total[4 * i + 1] += v.y, total[4 * i + 2] += v.z, total[4 * i + 3] += v.w;
    }
  }
  return true;
}

// kConsumers warpgroups of 64 rows each (BM = 64 kConsumers) plus one producer warp, in
// clusters of kCM x kCN CTAs (1 x 1: no cluster). In a cluster, the kCN CTAs of one tile row
// share its A tile and the kCM CTAs of one tile column its B tile: each CTA loads a 1 / kCN slice
// of its A tile and a 1 / kCM slice of its B tile and multicasts each to the CTAs that share it,
// so every operand byte leaves L2 once per cluster instead of once per CTA (measured: 1-3%
// faster at 2x1, docs/benchmarks.md session 9). With kSmemScales the producer warp also copies
// each stage's scales (its A tile's row scales, its B block's scale) into shared memory beside
// the tiles (cp.async, completing on the stage's barrier), so the consumers' loop has no global
// load. The arithmetic of every tile is unchanged: bitwise the same results in every variant.
// kBf16: the BF16 mode (A and B BF16, no scales; see the consumers' loop), on the same ring,
// tile walk and epilogues. kTileCount: an E4M3 instance that may run a device tile table
// (p.tile_count; the BF16 instances all may). The other E4M3 instances do not read a count: the
// read in every instance changed the register counts of 20 of the 50 E4M3 instances (by -3 to
// +11, ptxas 13.0 -v) and made the 192-row one spill. kBRows: per-row B scales (p.sb [kblocks][N]),
// a 512-byte slot per stage filled by the producer's bulk copy (see overlap_chunk).
template <int kConsumers, int kStages, int kCM, int kCN, bool kSmemScales, bool kTmaStore, int kBNt, bool kOverlap,
          bool kBf16 = false, bool kTileCount = false, bool kKGrouped = false, bool kStreamK = false,
          bool kBRows = false>
__global__ void __launch_bounds__(gemm_threads(kConsumers, kOverlap),
                                  gemm_ctas_per_sm(kConsumers, kStages, kTmaStore, kBNt))
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                    const __grid_constant__ CUtensorMap tm_c, GemmParams p) {
  static_assert(kBNt == 128 || (kBNt == 64 && kCM == 1 && kCN == 1 && !kSmemScales),
                "narrow (64-column) tiles: no cluster, global scales");
  static_assert(!kOverlap || (kCM == 1 && kCN == 1 && !kSmemScales && overlap_instance(kConsumers, kStages)),
                "the overlapped K loop: no cluster, global scales, an instance that does not spill");
  static_assert(!kBf16 || (kCM == 1 && kCN == 1 && !kSmemScales && kBNt == 128 && !kOverlap && kConsumers <= 2),
                "the BF16 mode: no cluster, no scales, 128-column tiles, the drained loop, 64 or 128 rows");
  static_assert(!kTileCount || (kCM == 1 && kCN == 1 && !kSmemScales && kBNt == 128),
                "a device tile table: the grouped product's default variant (no cluster, global scales)");
  static_assert(!kKGrouped || (kBf16 && !kTmaStore), "K-grouped: the BF16 mode, direct stores (per-group outputs)");
  static_assert(
      !kStreamK || (kCM == 1 && kCN == 1 && !kSmemScales && !kBf16 && !kTileCount && !kKGrouped && kBNt == 128),
      "stream-K: the dense E4M3 product, no cluster, global scales, 128-column tiles");
  static_assert(!kBRows || (kConsumers == 2 && kOverlap && kCM == 1 && kCN == 1 && !kSmemScales && !kTmaStore &&
                            !kBf16 && !kTileCount && !kKGrouped && !kStreamK && kBNt == 128),
                "per-row B scales: the dense E4M3 product's 128-row tiles, the overlapped loop, direct stores");
  static_assert(kConsumers <= 3, "warpgroup_sync has named barriers for three consumer warpgroups");
  constexpr bool kCountRead = kBf16 || kTileCount;
  constexpr bool kProducerWg = producer_warpgroup(kConsumers, kOverlap);
  constexpr int kBM = 64 * kConsumers;
  constexpr int kTileA = kBM * kBK, kTileB = kBNt * kBK;
  constexpr int kCluster = kCM * kCN;
  constexpr int kSliceA = kTileA / kCN, kSliceB = kTileB / kCM;  // bytes each CTA loads
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // 1024-byte alignment for the swizzled tiles (the same offset in every CTA of a cluster).
  // Offset from smem_raw (not a rounded generic address), so the compiler still knows these are
  // shared-memory pointers: the scale reads compile to LDS.
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* sm_a = smem;
  uint8_t* sm_b = smem + kStages * kTileA;
  uint8_t* sm_c = sm_b + kStages * kTileB;  // kTmaStore: 16 KB per consumer warpgroup (1024-aligned)
  uint64_t* full = reinterpret_cast<uint64_t*>(sm_c + gemm_store_bytes(kConsumers, kTmaStore));
  uint64_t* empty = full + kStages;
  // kSmemScales: per stage kBM row scales of A, then B's block scale (a 16-byte multiple).
  constexpr int kScaleStride = kBM + 4;
  float* sm_scales = reinterpret_cast<float*>(empty + kStages);
  int* sk_flag = reinterpret_cast<int*>(empty + kStages);  // kStreamK (no smem scales): the last piece's flag
  // kBRows (no smem scales, no stream-K): per stage the tile's kBNt column scales of its K block,
  // 16-byte aligned (the barriers before them are 16 kStages bytes from a 1024-byte boundary).
  float* sm_b_rows = reinterpret_cast<float*>(empty + kStages);

  // This CTA's place in its cluster: tile row ci, tile column cj.
  const int rank = kCluster == 1 ? 0 : static_cast<int>(cluster_rank());
  const int ci = rank % kCM, cj = rank / kCM;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      // The producer's expect_tx arrive (+ one cp.async arrive per producer lane: the scales).
      mbar_init(&full[s], kSmemScales ? 33 : 1);
      // A stage may be refilled once every consumer warp of every CTA it feeds (its tile row and
      // column of the cluster: kCM + kCN - 1 CTAs, itself included) has released it.
      mbar_init(&empty[s], kConsumers * 4 * (kCM + kCN - 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (kCluster > 1) cluster_sync();  // every CTA's barriers exist before any multicast
  else __syncthreads();

  // The CTA's tiles: cluster tile blockIdx.x / kCluster, then every (gridDim.x / kCluster)-th (one
  // each when the grid has a CTA per tile; persistent otherwise). The producer and the consumers
  // walk the same tiles and count the stage uses `g` across them, so the ring runs on from one
  // tile into the next: the next tile's loads overlap this tile's last MMAs and its epilogue.
  const int64_t first = blockIdx.x / kCluster, step = gridDim.x / kCluster;
  int64_t tiles = static_cast<int64_t>(kCN == 1 ? p.n_tiles : p.ct_n) * (kCM == 1 ? p.m_tiles : p.ct_m) * p.splits;
  if constexpr (kCountRead) {
    // A device tile table: its count of valid entries, read once by every thread (the producer
    // and the consumers walk the same tiles; the count does not change while the kernel runs)
    // and kept within the capacity p.m_tiles. The tiles are then count x n_tiles (one split, no
    // cluster), and tile_of's tile t < tiles has m = t / n_tiles < count: its n-fastest order
    // without bands (p.group_n = 0) takes m modulo the capacity, which leaves it as it is.
    if (p.tile_count) tiles = static_cast<int64_t>(p.n_tiles) * min(max(*p.tile_count, 0), p.m_tiles);
  }
  // The tiles this CTA walks: [t_begin, t_end) in steps of t_step; with stream-K its unit range's
  // tiles, each over the K blocks of the range (sk.kb0, sk.nk), in place of the tile's own.
  int64_t t_begin = first, t_end = tiles, t_step = step, sk_units = 0;
  stream_k::Range sk{};
  if constexpr (kStreamK) {
    sk_units = tiles * p.kblocks;
    sk = stream_k::range(sk_units, static_cast<int>(gridDim.x), p.kblocks, static_cast<int>(blockIdx.x));
    t_begin = sk.tile_begin(), t_end = sk.tile_end(), t_step = 1;
  }
  if (wg == kConsumers) {  // the producer warp: one thread issues every tile load (all, with the scales)
    if constexpr (kProducerWg) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(producer_regs(kConsumers)));
    if (kSmemScales ? tid < 32 : tid == 0) {
      const int lane = tid;
      // The CTAs of this tile row (they share A) and of this tile column (they share B).
      uint16_t row_mask = 0, col_mask = 0;
      for (int j = 0; j < kCN; ++j) row_mask |= static_cast<uint16_t>(1u << (ci + kCM * j));
      for (int i = 0; i < kCM; ++i) col_mask |= static_cast<uint16_t>(1u << (i + kCM * cj));
      int g = 0;
      for (int64_t t = t_begin; t < t_end; t += t_step) {
        Tile tl = tile_of<kCM, kCN, kKGrouped>(p, t, &tm_b, kBM, ci, cj);
        if constexpr (kStreamK) tl.kb0 = sk.kb0(t), tl.nk = sk.nk(t);
        for (int it = 0; it < tl.nk; ++it, ++g) {
          const int s = g % kStages;
          mbar_wait(&empty[s], ((g / kStages) & 1) ^ 1);
          if constexpr (kSmemScales) {
            // Rows past the tile's own (past M, or its group's end) read as zero; a cluster's tile
            // past the last column takes the last column's scale (it stores nothing).
            const int kb = tl.kb0 + it;
            float* dst = sm_scales + s * kScaleStride;
            for (int r = lane; r < kBM; r += 32) {
              const int64_t row = tl.m_base + r;
              const bool in = row < tl.m_end;
              cp_async_4(dst + r, in ? p.sa + row * p.sa_m + kb * p.sa_k : p.sa, in ? 4 : 0);
            }
            if (lane == 0) {
              const int n = tl.n_tile < p.n_tiles ? tl.n_tile : p.n_tiles - 1;
              cp_async_4(dst + kBM, tl.sb_base + static_cast<int64_t>(n) * kBNt / kBN * p.kblocks + kb, 4);
            }
            cp_async_mbar_arrive(&full[s]);
            if (lane != 0) continue;
          }
          if constexpr (kBRows) {
            // The tile's column scales of this K block, b_scales[kb][n0 .. n0 + cols): a last tile
            // of fewer columns copies those alone (cols is a multiple of 16: N is); the slot's other
            // floats keep older scales, which multiply only the zero-filled columns past N (never
            // stored).
            const int64_t n0 = static_cast<int64_t>(tl.n_tile) * kBNt;
            const uint32_t bytes = static_cast<uint32_t>(min(int64_t{kBNt}, p.N - n0)) * 4;
            mbar_expect_tx(&full[s], kTileA + kTileB + bytes);
            bulk_load_1d(sm_b_rows + s * kBNt, p.sb + static_cast<int64_t>(tl.kb0 + it) * p.N + n0, bytes, &full[s]);
          } else {
            mbar_expect_tx(&full[s], kTileA + kTileB);
          }
          const int k = (tl.kb0 + it) * kBK;
          if constexpr (kCN == 1) {
            tma_load_2d(sm_a + s * kTileA, &tm_a, &full[s], k, static_cast<int>(tl.m_base));
          } else {  // slice cj of the A tile (kBM / kCN rows), to the tile row
            tma_load_2d_multicast(sm_a + s * kTileA + cj * kSliceA, &tm_a, &full[s], k,
                                  static_cast<int>(tl.m_base) + cj * (kBM / kCN), row_mask);
          }
          if constexpr (kCM == 1) {
            tma_load_2d(sm_b + s * kTileB, tl.map_b, &full[s], k, tl.n_tile * kBNt);
          } else {  // slice ci of the B tile (kBNt / kCM rows), to the tile column
            tma_load_2d_multicast(sm_b + s * kTileB + ci * kSliceB, tl.map_b, &full[s], k,
                                  tl.n_tile * kBNt + ci * (kBNt / kCM), col_mask);
          }
        }
      }
      // No lane leaves with its scale copies in flight.
      if constexpr (kSmemScales) asm volatile("cp.async.wait_all;" ::: "memory");
    }
  } else {
    if constexpr (kProducerWg) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(consumer_regs(kConsumers)));
    const int warp = tid / 32, lane = tid % 32;
    int g = 0;
    for (int64_t t = t_begin; t < t_end; t += t_step) {
      Tile tl = tile_of<kCM, kCN, kKGrouped>(p, t, &tm_b, kBM, ci, cj);
      if constexpr (kStreamK) tl.kb0 = sk.kb0(t), tl.nk = sk.nk(t);
      // A consumer warpgroup: rows [m_base + wg * 64, + 64) of the tile.
      const int64_t row0 = tl.m_base + wg * 64 + warp * 16 + lane / 4, row1 = row0 + 8;
      const bool in0 = row0 < tl.m_end, in1 = row1 < tl.m_end;
      constexpr int kAcc = kBNt / 2;  // m64 x kBNt FP32 accumulators over the warpgroup's 128 threads
      float total[kAcc], acc[kAcc];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) total[i] = 0.0f;
      const bool n_in = tl.n_tile < p.n_tiles;  // a cluster's tile past the last column: stores nothing
      const float* sb = tl.sb_base + static_cast<int64_t>(n_in ? tl.n_tile : p.n_tiles - 1) * kBNt / kBN * p.kblocks;
      if constexpr (kOverlap) {
        const OverlapCtx<kStages> c{sm_a + wg * 64 * kBK,
                                    sm_b,
                                    kTileA,
                                    kTileB,
                                    full,
                                    empty,
                                    p.sa,
                                    p.sa_m,
                                    p.sa_k,
                                    sb,
                                    row0,
                                    row1,
                                    in0,
                                    in1,
                                    lane,
                                    kBRows ? sm_b_rows : nullptr};
        float acc2[kAcc];
        for (int it = 0; it < tl.nk;) {
          const int n = min(kOverlapChunk, tl.nk - it), kb = tl.kb0 + it;
          if (n == 4) overlap_chunk<4, kBNt, kStages, kBRows>(c, total, acc, acc2, g, kb);
          else if (n == 3) overlap_chunk<3, kBNt, kStages, kBRows>(c, total, acc, acc2, g, kb);
          else if (n == 2) overlap_chunk<2, kBNt, kStages, kBRows>(c, total, acc, acc2, g, kb);
          else overlap_chunk<1, kBNt, kStages, kBRows>(c, total, acc, acc2, g, kb);
          it += n, g += n;
        }
      }
      if constexpr (kBf16) {
        // BF16: no scales, so no promotion: the MMAs accumulate straight into the totals over all
        // of the tile's K (its split's), one FP32 accumulator set. A stage's 128 bytes are 64
        // elements: four m64n128k16 steps of 32 bytes (desc + 2, as the E4M3 k32 steps). The totals
        // are zeroed above (as for E4M3), so every MMA accumulates (scale-d 1, a constant): no
        // per-MMA predicate on the tile's first K block. Drained per stage (its MMAs waited for
        // before the stage is released): without a promotion there is nothing to overlap but the
        // next stage's MMAs, and a wgmma in flight across the loop's back edge makes ptxas
        // serialize them all (see overlap_chunk).
        for (int it = 0; it < tl.nk; ++it, ++g) {
          const int s = g % kStages;
          mbar_wait(&full[s], (g / kStages) & 1);
          const uint64_t da = sw128_desc(sm_a + s * kTileA + wg * 64 * kBK), db = sw128_desc(sm_b + s * kTileB);
          fence_acc(total);
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < kBK / 32; ++k) wgmma_m64n128k16_bf16(total, da + 2 * k, db + 2 * k, 1);
          wgmma_commit();
          fence_acc(total);
          wgmma_wait_all();
          fence_acc(total);
          if (lane == 0) mbar_arrive(&empty[s]);
        }
      }
      for (int it = 0; it < (kOverlap || kBf16 ? 0 : tl.nk); ++it, ++g) {
        const int s = g % kStages, kb = tl.kb0 + it;
        // The scales of this K block, loaded while the tiles arrive (unconditionally for B: a
        // predicated load here costs ~15% at large M, session 9).
        float s0, s1;
        if constexpr (!kSmemScales) {
          const float sbv = __ldg(sb + kb);
          s0 = in0 ? __ldg(p.sa + row0 * p.sa_m + kb * p.sa_k) * sbv : 0.0f;
          s1 = in1 ? __ldg(p.sa + row1 * p.sa_m + kb * p.sa_k) * sbv : 0.0f;
        }
        mbar_wait(&full[s], (g / kStages) & 1);
        if constexpr (kSmemScales) {
          const float* sc = sm_scales + s * kScaleStride;
          const int r0 = wg * 64 + warp * 16 + lane / 4;
          const float sbv = sc[kBM];
          s0 = sc[r0] * sbv, s1 = sc[r0 + 8] * sbv;
        }
        const uint64_t da = sw128_desc(sm_a + s * kTileA + wg * 64 * kBK), db = sw128_desc(sm_b + s * kTileB);
        fence_acc(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBK / 32; ++k) wgmma_tile<kBNt>(acc, da + 2 * k, db + 2 * k, k > 0);
        wgmma_commit();
        fence_acc(acc);
        wgmma_wait_all();
        fence_acc(acc);
        if (lane == 0) {
          if constexpr (kCluster == 1) {
            mbar_arrive(&empty[s]);
          } else {
#pragma unroll
            for (int r = 0; r < kCluster; ++r)
              if (r % kCM == ci || r / kCM == cj) mbar_arrive_cluster(&empty[s], static_cast<uint32_t>(r));
          }
        }
        // Fragment of m64nN (FP32): acc[4 i + j] is row (j < 2 ? row0 : row1), column 8 i + 2 (lane % 4) + j % 2.
#pragma unroll
        for (int i = 0; i < kAcc; ++i) total[i] = fmaf(acc[i], (i & 2) ? s1 : s0, total[i]);
      }
      if constexpr (kStreamK) {  // a cut tile: stored by the piece that counts last
        if (tl.nk < p.kblocks && !stream_k_fixup<kConsumers, kAcc>(p, total, sk_units, t, wg, tid, sk_flag)) continue;
      }
      if (n_in) {
        // TMA stores (the instance runs only where its epilogue applies: tma_store_applies) where
        // the warpgroup's rows are its own up to M (a grouped tile ending inside its 64 rows
        // would overwrite the next group's): uniform across the warpgroup.
        bool tma = false;
        if constexpr (kTmaStore)
          tma = tl.m_base + wg * 64 < tl.m_end && (!p.tiles || tl.m_base + (wg + 1) * 64 <= tl.m_end);
        if constexpr (kKGrouped) {  // the entry's group's own output
          GemmParams q = p;
          q.c = p.c_groups[p.k_groups[tl.split].x];
          store_tile<kBNt>(q, total, tl, row0, row1, lane);
        } else if (tma) {
          store_tile_tma<kBNt>(p, total, tl, wg, tid, sm_c + wg * 16384, &tm_c);
        } else {
          store_tile<kBNt>(p, total, tl, row0, row1, lane);
        }
      }
    }
    if constexpr (kTmaStore)
      if (tid == 0) bulk_wait();  // the stores are done before the CTA (and its shared memory) ends
  }
  // No CTA leaves while another may still multicast into it or arrive on its barriers.
  if constexpr (kCluster > 1) cluster_sync();
}

// C = alpha * (sum of the splits' partials, in split order) + beta * C.
template <typename T>
__global__ void fp8_gemm_reduce_kernel(const float* __restrict__ parts, int splits, int64_t MN, float alpha, float beta,
                                       T* __restrict__ c) {
  const int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 4;
  if (i >= MN) return;  // MN is a multiple of 4 (N is of 16)
  float4 s = *reinterpret_cast<const float4*>(parts + i);
  for (int k = 1; k < splits; ++k) {
    const float4 v = *reinterpret_cast<const float4*>(parts + k * MN + i);
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  float o[4] = {s.x * alpha, s.y * alpha, s.z * alpha, s.w * alpha};
  for (int j = 0; j < 4; ++j) {
    if (beta != 0.0f) o[j] = fmaf(beta, load_f(c, i + j), o[j]);
    store_f(c, i + j, o[j]);
  }
}

// [rows, K] bytes, K-major, boxes of box_rows x 128 bytes, 128-byte swizzle, zeros out of bounds.
CUtensorMap tensor_map(const uint8_t* base, int64_t rows, int64_t K, int box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(base), dims,
                                          strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP8RL_CHECK(r == CUDA_SUCCESS, "FP8 GEMM: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ") for [", rows,
              ", ", K, "]");
  return m;
}

// The kernel variant. The cluster shape (CTAs along M x along N): FP8RL_FP8_GEMM_CLUSTER=CMxCN
// (read at each call; 1x1, 2x1, 1x2 or 2x2), else the default; where the consumers read the
// scales: FP8RL_FP8_GEMM_SCALES=global (the default) or smem; the 64-row tiles' CTAs per SM:
// FP8RL_FP8_GEMM_OCCUPANCY=2 (the default: 4 stages each) or 1 (8 stages); the tile order:
// FP8RL_FP8_GEMM_BAND. Measured (bench-gemm, session 10): two CTAs per SM are 10-20% faster at
// decode M; the smem scales were 0-4% faster than global before the lean epilogue and are 13%
// slower after it at M = 8192 (their 4-byte cp.async copies queue behind the epilogue's stores:
// ncu shows the consumers' full-barrier wait doubled); bands of 4-16 columns change nothing. The
// grouped product shares only A (its tiles along M belong to different experts' weights). The
// epilogue: FP8RL_FP8_GEMM_STORE=tma (the default with global scales) or direct. Measured
// (bench-gemm, session 11): the TMA store is 6-11% faster on dense products at M = 8192, 0-11%
// at M = 256, and 14-36% on the grouped products (0.59x -> 0.67x and 0.53x -> 0.70x of cuBLASLt's
// dense TF/s), where the direct stores' drain was the largest share.
// The consumers' K loop: FP8RL_FP8_GEMM_PIPE=drain (each block's MMAs waited for, then promoted),
// overlap (overlap_chunk: the next block's MMAs in flight during each promotion; 1x1 clusters and
// global scales only) or auto (the default: overlap for 128-row tiles, drain for 64-row ones).
// Same bits either way. Measured (bench-gemm, session 31, H200): 128-row tiles at M = 8192
// 832 -> 1018 TF/s (0.68x -> 0.84x of cuBLASLt), the grouped expert products 0.69x -> 0.80x
// (gate/up) and 0.69x -> 0.77x (down) of cuBLASLt's dense TF/s.
}  // namespace

// FP8RL_FP8_GEMM_BN (read at each call): 64 or 128 (the default) columns per tile for the dense
// product's 64-row tiles.
int fp8_gemm_block_n() {
  const char* e = std::getenv("FP8RL_FP8_GEMM_BN");
  if (!e) return kBN;
  const std::string v(e);
  FP8RL_CHECK(v == "64" || v == "128", "FP8RL_FP8_GEMM_BN must be 64 or 128, got '", v, "'");
  return v == "64" ? 64 : kBN;
}

// FP8RL_FP8_GEMM_BM (read at each call): the rows of the tiles of products that do not take 64-row
// ones, 128 (the default) or 192.
int fp8_gemm_large_block_m() {
  const char* e = std::getenv("FP8RL_FP8_GEMM_BM");
  if (!e) return 128;
  const std::string v(e);
  FP8RL_CHECK(v == "128" || v == "192", "FP8RL_FP8_GEMM_BM must be 128 or 192, got '", v, "'");
  return v == "192" ? 192 : 128;
}

namespace {

struct KernelVariant {
  int cm = 1, cn = 1;
  bool smem_scales = false;  // FP8RL_FP8_GEMM_SCALES=smem: the producer stages the scales in shared memory
  int ctas_per_sm = 2;       // FP8RL_FP8_GEMM_OCCUPANCY=1: 64-row tiles with 8 stages, one CTA per SM
  int band = 0;              // FP8RL_FP8_GEMM_BAND=n: the n-fastest tile order in bands of n tile columns
  bool tma_store = true;     // FP8RL_FP8_GEMM_STORE=direct: the epilogue's registers stored straight to global
  int bn = kBN;              // FP8RL_FP8_GEMM_BN=64: 64-column tiles (64-row tiles only; no cluster, global scales)
  // FP8RL_FP8_GEMM_PIPE: the overlapped K loop (no cluster, global scales) for 128-row tiles (auto,
  // the default), every tile (overlap; 64-row tiles then at one CTA per SM) or none (drain).
  bool overlap = true, overlap_small = false;
};
KernelVariant kernel_variant(int64_t m_tiles, int64_t n_tiles, bool grouped) {
  // The default is 1x1. Measured (bench-gemm, session 9): 2x1 is 1-3% faster on dense products
  // of 128-row tiles and no faster at decode M; the grouped product gains ~1% from 1x2; 2x2 is
  // slower. Halving the L2 reads gains so little because the kernel is not L2-bound
  // (docs/benchmarks.md).
  KernelVariant c;
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_CLUSTER")) {
    const std::string v(e);
    FP8RL_CHECK(v == "1x1" || v == "2x1" || v == "1x2" || v == "2x2",
                "FP8RL_FP8_GEMM_CLUSTER must be 1x1, 2x1, 1x2 or 2x2, got '", v, "'");
    c.cm = v[0] - '0', c.cn = v[2] - '0';
  }
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_SCALES")) {
    const std::string v(e);
    FP8RL_CHECK(v == "global" || v == "smem", "FP8RL_FP8_GEMM_SCALES must be global or smem, got '", v, "'");
    c.smem_scales = v == "smem";
  }
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_OCCUPANCY")) {
    const std::string v(e);
    FP8RL_CHECK(v == "1" || v == "2", "FP8RL_FP8_GEMM_OCCUPANCY must be 1 or 2, got '", v, "'");
    c.ctas_per_sm = v[0] - '0';
  }
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_BAND")) {
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    FP8RL_CHECK(end != e && *end == 0 && v >= 0 && v <= 4096,
                "FP8RL_FP8_GEMM_BAND must be a tile-column count (0: no bands), got '", e, "'");
    c.band = static_cast<int>(v);
  }
  // The store buffer and the scale copies do not both fit beside the 6-stage ring: smem scales
  // take the direct stores unless the TMA store is asked for too, which is an error.
  if (c.smem_scales) c.tma_store = false;
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_STORE")) {
    const std::string v(e);
    FP8RL_CHECK(v == "direct" || v == "tma", "FP8RL_FP8_GEMM_STORE must be direct or tma, got '", v, "'");
    c.tma_store = v == "tma";
    FP8RL_CHECK(!(c.tma_store && c.smem_scales),
                "FP8RL_FP8_GEMM_STORE=tma needs FP8RL_FP8_GEMM_SCALES=global (both do not fit in shared memory)");
  }
  std::string pipe = "auto";
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_PIPE")) pipe = e;
  FP8RL_CHECK(pipe == "auto" || pipe == "drain" || pipe == "overlap",
              "FP8RL_FP8_GEMM_PIPE must be auto, drain or overlap, got '", pipe, "'");
  c.overlap = pipe != "drain";
  c.overlap_small = pipe == "overlap";
  if (pipe == "overlap") {
    FP8RL_CHECK(!c.smem_scales, "FP8RL_FP8_GEMM_PIPE=overlap needs FP8RL_FP8_GEMM_SCALES=global");
    FP8RL_CHECK(c.cm == 1 && c.cn == 1, "FP8RL_FP8_GEMM_PIPE=overlap needs FP8RL_FP8_GEMM_CLUSTER=1x1");
  } else if (c.smem_scales || c.cm != 1 || c.cn != 1) {
    c.overlap = false;  // auto: the variants the overlapped loop is not built for keep the drained one
  }
  if (grouped) c.cm = 1;
  if (m_tiles < 2) c.cm = 1;
  if (n_tiles < 2) c.cn = 1;
  if (!grouped) c.bn = fp8_gemm_block_n();
  if (c.bn == 64) c.cm = c.cn = 1, c.smem_scales = false;
  return c;
}

int sm_count() {
  static const int sms = [] {
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev), "querying the device");
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "querying the SM count");
    return n;
  }();
  return sms;
}

// Stream-K's CTAs: all that fit at once (`fit`), or FP8RL_FP8_GEMM_SK_CTAS (read at each call;
// at most `fit`): the tests cut tiles into many pieces with few CTAs.
int stream_k_ctas(int fit) {
  const char* e = std::getenv("FP8RL_FP8_GEMM_SK_CTAS");
  if (!e) return fit;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  FP8RL_CHECK(end != e && *end == 0 && v > 0, "FP8RL_FP8_GEMM_SK_CTAS must be a positive CTA count, got '", e, "'");
  return static_cast<int>(std::min<long>(v, fit));
}

// Launches the kernel over `tiles` cluster tiles: at most as many clusters as fit on the device
// at once, each walking its share of the tiles, or with FP8RL_FP8_GEMM_GRID=tile (read at each
// call) one cluster per cluster tile. With a device tile table (p.tile_count), p.m_tiles is its
// capacity: the grid is sized for a full table and its CTAs past the count's tiles do nothing.
template <int kConsumers, int kStages, int kCM, int kCN, bool kSmemScales, bool kTmaStore, int kBNt, bool kOverlap,
          bool kBf16 = false, bool kTileCount = false, bool kKGrouped = false, bool kStreamK = false,
          bool kBRows = false>
void launch_cluster(const CUtensorMap& ta, const CUtensorMap& tb, const CUtensorMap& tc, GemmParams p,
                    cudaStream_t stream) {
  constexpr int kSmem = kStages * (64 * kConsumers + kBNt) * kBK + gemm_store_bytes(kConsumers, kTmaStore) +
                        2 * kStages * 8 + (kSmemScales ? kStages * (64 * kConsumers + 4) * 4 : 0) +
                        (kStreamK ? 16 : 0) + (kBRows ? kStages * kBNt * 4 : 0) + 1024;
  constexpr int kCluster = kCM * kCN;
  auto* kernel = fp8_gemm_kernel<kConsumers, kStages, kCM, kCN, kSmemScales, kTmaStore, kBNt, kOverlap, kBf16,
                                 kTileCount, kKGrouped, kStreamK, kBRows>;
  p.ct_m = static_cast<int>(ceil_div(int64_t{p.m_tiles}, int64_t{kCM}));
  p.ct_n = static_cast<int>(ceil_div(int64_t{p.n_tiles}, int64_t{kCN}));
  const int64_t tiles = static_cast<int64_t>(p.ct_m) * p.ct_n * p.splits;
  FP8RL_CHECK(tiles * kCluster < (int64_t{1} << 31), "FP8 GEMM: ", tiles, " tiles are more than one launch takes");
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(gemm_threads(kConsumers, kOverlap));
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  static const int max_clusters = [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
               "FP8 GEMM: setting the shared memory size");
    if constexpr (producer_warpgroup(kConsumers, kOverlap)) {
      // setmaxnreg.inc waits until the CTA's pool holds the registers: a smaller build would hang.
      cudaFuncAttributes fa{};
      CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel), "FP8 GEMM: the kernel's attributes");
      constexpr int kWant = kConsumers * consumer_regs(kConsumers) + producer_regs(kConsumers);
      FP8RL_CHECK(fa.numRegs * (kConsumers + 1) >= kWant, "FP8 GEMM: built with ", fa.numRegs,
                  " registers per thread, too few for setmaxnreg to give the consumers ", consumer_regs(kConsumers));
    }
    if (kCluster == 1) {
      int per_sm = 0;
      CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, gemm_threads(kConsumers, kOverlap), kSmem),
          "FP8 GEMM: querying the CTAs that fit");
      FP8RL_CHECK(per_sm > 0, "FP8 GEMM: no CTA of ", kSmem, " shared-memory bytes fits on this device");
      return per_sm * sm_count();
    }
    cudaLaunchConfig_t q = cfg;
    q.gridDim = dim3(static_cast<unsigned>(sm_count() / kCluster * kCluster));
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &q), "FP8 GEMM: querying the clusters that fit");
    FP8RL_CHECK(n > 0, "FP8 GEMM: no cluster of ", kCluster, " CTAs fits on this device");
    if (std::getenv("FP8RL_FP8_GEMM_DEBUG"))
      std::fprintf(stderr, "[fp8 gemm] %d consumers, cluster %dx%d: %d clusters fit\n", kConsumers, kCM, kCN, n);
    return n;
  }();
  const char* e = std::getenv("FP8RL_FP8_GEMM_GRID");
  int64_t clusters = e && std::string(e) == "tile" ? tiles : std::min<int64_t>(tiles, max_clusters);
  if constexpr (kStreamK) clusters = std::min<int64_t>(tiles * p.kblocks, stream_k_ctas(max_clusters));
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  if (kCluster == 1) cfg.numAttrs = 0;  // a plain launch
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ta, tb, tc, p), "FP8 GEMM kernel launch");
}

// The cluster shape's instance.
template <int kConsumers, int kStages, bool kSmemScales, bool kTmaStore>
void launch_clusters(const CUtensorMap& ta, const CUtensorMap& tb, const CUtensorMap& tc, const GemmParams& p,
                     KernelVariant c, cudaStream_t stream) {
  if constexpr (kConsumers == 3) {  // launch_variant: no cluster, global scales, drained
    if constexpr (!kSmemScales) launch_cluster<3, kStages, 1, 1, false, kTmaStore, kBN, false>(ta, tb, tc, p, stream);
    else FP8RL_CHECK(false, "FP8 GEMM: 192-row tiles are built for global scales only");
  } else if (c.bn == 64) {  // kernel_variant: no cluster, global scales
    if constexpr (kConsumers == 1 && !kSmemScales) {
      if constexpr (overlap_instance(kConsumers, kStages))
        if (c.overlap)
          return launch_cluster<kConsumers, kStages, 1, 1, false, kTmaStore, 64, true>(ta, tb, tc, p, stream);
      FP8RL_CHECK(!c.overlap, "FP8 GEMM: the overlapped K loop has no instance for this ring");
      launch_cluster<kConsumers, kStages, 1, 1, false, kTmaStore, 64, false>(ta, tb, tc, p, stream);
    } else {
      FP8RL_CHECK(false, "FP8 GEMM: 64-column tiles are built for 64-row tiles with global scales only");
    }
  } else if (c.overlap) {  // kernel_variant: no cluster, global scales
    if constexpr (!kSmemScales && overlap_instance(kConsumers, kStages))
      launch_cluster<kConsumers, kStages, 1, 1, false, kTmaStore, kBN, true>(ta, tb, tc, p, stream);
    else FP8RL_CHECK(false, "FP8 GEMM: the overlapped K loop has no instance for this ring or scale place");
  } else if (c.cm == 1 && c.cn == 1) {
    launch_cluster<kConsumers, kStages, 1, 1, kSmemScales, kTmaStore, kBN, false>(ta, tb, tc, p, stream);
  } else if (c.cm == 2 && c.cn == 1) {
    launch_cluster<kConsumers, kStages, 2, 1, kSmemScales, kTmaStore, kBN, false>(ta, tb, tc, p, stream);
  } else if (c.cm == 1 && c.cn == 2) {
    launch_cluster<kConsumers, kStages, 1, 2, kSmemScales, kTmaStore, kBN, false>(ta, tb, tc, p, stream);
  } else {
    launch_cluster<kConsumers, kStages, 2, 2, kSmemScales, kTmaStore, kBN, false>(ta, tb, tc, p, stream);
  }
}

// The output [M, N] BF16 as 64 x 64 boxes in the 128-byte swizzle (the TMA-store epilogue's map).
CUtensorMap output_map(const GemmParams& p) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.N), static_cast<cuuint64_t>(p.M)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.N) * 2};
  const cuuint32_t box[2] = {64, 64};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, p.c, dims, strides, box, elem,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP8RL_CHECK(r == CUDA_SUCCESS, "FP8 GEMM: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ") for the [", p.M,
              ", ", p.N, "] output");
  return m;
}

// The kernel for rows per CTA (64 kConsumers) and the cluster shape, with A's tensor map (box
// rows: the slice each CTA loads) made here; B's map (dense product) likewise, or none (grouped:
// each group's map is in p, made with the same box).
template <int kConsumers, int kStages>
void launch(const uint8_t* a, int64_t rows, const uint8_t* b, int64_t N, int64_t K, const GemmParams& p,
            KernelVariant c, cudaStream_t stream) {
  constexpr int kBM = 64 * kConsumers;
  const CUtensorMap ta = tensor_map(a, rows, K, kBM / c.cn);
  const CUtensorMap tb = b ? tensor_map(b, N, K, c.bn / c.cm) : ta;
  // Instances: the 3-stage ring only with the TMA store (two CTAs per SM beside its buffer), the
  // 4-stage ring of 64-row tiles only without it; 192-row tiles: 4 stages, either store.
  if constexpr (kStages != 4 || kConsumers == 3) {
    if (c.tma_store) {
      launch_clusters<kConsumers, kStages, false, true>(ta, tb, output_map(p), p, c, stream);
      return;
    }
  }
  if constexpr (kStages != 3) {
    FP8RL_CHECK(kStages != 4 || kConsumers == 3 || !c.tma_store,
                "FP8 GEMM: the 4-stage ring has no TMA-store instance");
    if (c.smem_scales) launch_clusters<kConsumers, kStages, true, false>(ta, tb, ta, p, c, stream);
    else launch_clusters<kConsumers, kStages, false, false>(ta, tb, ta, p, c, stream);
  } else {
    FP8RL_CHECK(false, "FP8 GEMM: the 3-stage ring exists only with the TMA store");
  }
}

// Whether the TMA-store epilogue applies to the product: BF16 output, no split partials, beta = 0,
// a 16-byte-aligned C (the tensor map's base). Elsewhere the variant runs the direct stores (so
// its 3-stage ring is never timed with them).
bool tma_store_applies(const GemmParams& p) {
  return p.c_bf16 && !p.partials && p.beta == 0.0f && reinterpret_cast<uintptr_t>(p.c) % 16 == 0;
}

// The instance for the row block (64, 128 or 192 rows) and the variant's CTAs per SM and store.
void launch_variant(int bm, const uint8_t* a, int64_t rows, const uint8_t* b, int64_t N, int64_t K, const GemmParams& p,
                    KernelVariant c, cudaStream_t stream) {
  const bool small = bm == 64;
  if (!tma_store_applies(p)) c.tma_store = false;
  if (bm == 192) {  // three consumer warpgroups: 4 stages, drained (the cluster and scale switches do not apply)
    c.smem_scales = false, c.cm = c.cn = 1, c.overlap = false;
    launch<3, 4>(a, rows, b, N, K, p, c, stream);
    return;
  }
  FP8RL_CHECK(small || c.bn == kBN, "FP8 GEMM: 64-column tiles need 64-row tiles");
  // 64-row tiles: overlapped only when asked (their instance runs one CTA per SM, overlap_instance;
  // bench-gemm, session 31 on the H200: 8-15% slower than two drained CTAs per SM at M = 8192 and on
  // the grouped products, mixed at decode M).
  if (small) c.overlap = c.overlap && c.overlap_small;
  if (small && c.overlap) c.ctas_per_sm = 1;
  if (small && c.ctas_per_sm == 2 && c.tma_store) launch<1, 3>(a, rows, b, N, K, p, c, stream);
  else if (small && c.ctas_per_sm == 2) launch<1, 4>(a, rows, b, N, K, p, c, stream);
  else if (small) launch<1, 8>(a, rows, b, N, K, p, c, stream);
  else launch<2, 6>(a, rows, b, N, K, p, c, stream);
}

// The BF16 mode's instances: no cluster, no scales, 128-column tiles, the drained loop; 64-row
// tiles at two CTAs per SM (4 stages, or 3 beside the TMA store's buffer: the E4M3 rings) or
// 128-row tiles (6 stages), either epilogue (the TMA store where tma_store_applies). Its tensor
// maps are the E4M3 ones over bytes: [rows, 2K] bytes in boxes of 128 bytes (64 elements).
void launch_bf16(int bm, const uint8_t* a, int64_t rows, const uint8_t* b, int64_t N, int64_t K, const GemmParams& p,
                 bool tma_store, cudaStream_t stream) {
  tma_store = tma_store && tma_store_applies(p);
  const CUtensorMap ta = tensor_map(a, rows, 2 * K, bm);
  const CUtensorMap tb = b ? tensor_map(b, N, 2 * K, kBN) : ta;
  const CUtensorMap tc = tma_store ? output_map(p) : ta;
  if (bm == 64 && tma_store) launch_cluster<1, 3, 1, 1, false, true, kBN, false, true>(ta, tb, tc, p, stream);
  else if (bm == 64) launch_cluster<1, 4, 1, 1, false, false, kBN, false, true>(ta, tb, tc, p, stream);
  else if (tma_store) launch_cluster<2, 6, 1, 1, false, true, kBN, false, true>(ta, tb, tc, p, stream);
  else launch_cluster<2, 6, 1, 1, false, false, kBN, false, true>(ta, tb, tc, p, stream);
}

// The E4M3 instances for a device tile table (kTileCount): the grouped product's default variant
// (no cluster, global scales, 64-row tiles at two CTAs per SM, the overlapped loop for 128-row
// tiles), either epilogue. FP8RL_FP8_GEMM_CLUSTER, _SCALES, _OCCUPANCY, _PIPE and _BAND do not
// apply to it (every variant gives the same bits); _STORE and _GRID do.
void launch_tile_count(int bm, const uint8_t* a, int64_t rows, int64_t K, const GemmParams& p, bool tma_store,
                       cudaStream_t stream) {
  tma_store = tma_store && tma_store_applies(p);
  const CUtensorMap ta = tensor_map(a, rows, K, bm);  // B: each group's map, in p
  const CUtensorMap tc = tma_store ? output_map(p) : ta;
  if (bm == 64 && tma_store) launch_cluster<1, 3, 1, 1, false, true, kBN, false, false, true>(ta, ta, tc, p, stream);
  else if (bm == 64) launch_cluster<1, 4, 1, 1, false, false, kBN, false, false, true>(ta, ta, tc, p, stream);
  else if (bm == 128 && tma_store)
    launch_cluster<2, 6, 1, 1, false, true, kBN, true, false, true>(ta, ta, tc, p, stream);
  else if (bm == 128) launch_cluster<2, 6, 1, 1, false, false, kBN, true, false, true>(ta, ta, tc, p, stream);
  else if (tma_store) launch_cluster<3, 4, 1, 1, false, true, kBN, false, false, true>(ta, ta, tc, p, stream);
  else launch_cluster<3, 4, 1, 1, false, false, kBN, false, false, true>(ta, ta, tc, p, stream);
}

// The instance for per-row B scales (Fp8GemmArgs::b_scales_rows): 128-row tiles of two consumer
// warpgroups beside a producer warpgroup, 6 stages, the overlapped K loop, no cluster, global A
// scales, direct stores. The TMA-store epilogue's 32 KB buffer, the 6-stage ring and the stages'
// 3 KB of column scales do not fit in 227 KB together; the wgrad this mode serves writes F32 with
// beta = 1, which the TMA store does not take anyway.
void launch_b_rows(const uint8_t* a, int64_t M, const uint8_t* b, int64_t N, int64_t K, const GemmParams& p,
                   cudaStream_t stream) {
  const CUtensorMap ta = tensor_map(a, M, K, 128);
  const CUtensorMap tb = tensor_map(b, N, K, kBN);
  launch_cluster<2, 6, 1, 1, false, false, kBN, true, false, false, false, false, true>(ta, tb, ta, p, stream);
}

// The K bytes of a row of an operand: K for E4M3, 2K for BF16.
int64_t k_bytes(int64_t K, DType ab) { return ab == DType::BF16 ? 2 * K : K; }

// The K splits of a product of block_m-row tiles beyond decode M: only where the tiles leave most
// SMs idle (at most half of them busy), at least two K blocks per split.
int large_m_splits(int64_t M, int64_t N, int64_t kblocks, int block_m, int sm_count) {
  const int64_t tiles = ceil_div(M, int64_t{block_m}) * ceil_div(N, int64_t{kBN});
  if (tiles * 2 <= sm_count && kblocks >= 4)
    return static_cast<int>(std::min<int64_t>(ceil_div(int64_t{sm_count}, tiles), kblocks / 2));
  return 1;
}

}  // namespace

bool fp8_gemm_sm90_supported(int64_t M, int64_t N, int64_t K, DType ab) {
  // TMA's 16-byte row strides: K % 16 for E4M3, K % 8 for BF16 (2 bytes an element).
  const int64_t k_granule = ab == DType::BF16 ? 8 : 16;
  return (ab == DType::E4M3 || ab == DType::BF16) && M > 0 && N > 0 && K > 0 && N % 16 == 0 && K % k_granule == 0 &&
         M < (int64_t{1} << 31) && N < (int64_t{1} << 31);
}

Fp8GemmConfig fp8_gemm_sm90_config(int64_t M, int64_t N, int64_t K, int sm_count, DType ab) {
  const bool bf16_ab = ab == DType::BF16;
  const int64_t kblocks = ceil_div(k_bytes(K, ab), int64_t{kBK});
  int64_t n_tiles = ceil_div(N, int64_t{kBN});
  Fp8GemmConfig c;
  if (M <= 256) {
    c.block_m = 64;
    const int bn = bf16_ab ? kBN : fp8_gemm_block_n();
    n_tiles = ceil_div(N, int64_t{bn});
    const int64_t tiles = ceil_div(M, int64_t{64}) * n_tiles;
    // 64-column tiles: no split once the tiles fill half the SMs (a split's reduction kernel costs
    // ~4 us in a decode graph, as much as the narrow tiles save).
    if (bn == 64 && 2 * tiles >= sm_count) return c;
    // About two CTAs per SM (one fits at a time: the other's loads hide the first's tail),
    // at least two K blocks per split.
    c.splits = static_cast<int>(
        std::clamp<int64_t>(ceil_div(2 * int64_t{sm_count}, tiles), 1, std::max<int64_t>(1, kblocks / 2)));
    return c;
  }
  // Rows per tile beyond decode M: 128, or 192 (FP8RL_FP8_GEMM_BM; BF16: 128 only).
  c.block_m = bf16_ab ? 128 : fp8_gemm_large_block_m();
  c.splits = large_m_splits(M, N, kblocks, c.block_m, sm_count);
  return c;
}

Fp8GemmConfig fp8_gemm_sm90_b_rows_config(int64_t M, int64_t N, int64_t K, int sm_count) {
  Fp8GemmConfig c;
  c.block_m = 128;
  c.splits = large_m_splits(M, N, ceil_div(K, int64_t{kBK}), c.block_m, sm_count);
  return c;
}

bool fp8_gemm_sm90_preferred(int64_t M, int64_t N, int64_t K) {
  if (!fp8_gemm_sm90_supported(M, N, K) || M > 256) return false;
  const int bn = fp8_gemm_block_n();
  // 64-column tiles (FP8RL_FP8_GEMM_BN=64): up to two per SM of 132 in one wave.
  return ceil_div(M, int64_t{64}) * ceil_div(N, int64_t{bn}) <= (bn == 64 ? 264 : 64);
}

int64_t fp8_gemm_sm90_workspace_floats(int64_t M, int64_t N, int splits) { return splits > 1 ? splits * M * N : 0; }

bool fp8_gemm_sm90_stream_k() {
  const char* e = std::getenv("FP8RL_FP8_GEMM_STREAMK");
  if (!e) return false;
  const std::string v(e);
  FP8RL_CHECK(v == "0" || v == "1", "FP8RL_FP8_GEMM_STREAMK must be 0 or 1, got '", v, "'");
  return v == "1";
}

// The stream-K instance (two consumer warpgroups, the overlapped loop) runs one CTA per SM; two
// slots per CTA, sized for two CTAs per SM as a bound.
int64_t fp8_gemm_sm90_stream_k_floats() { return int64_t{2} * 2 * sm_count() * 128 * kBN; }

// Counted in 64-row tiles: enough for either tile height.
int64_t fp8_gemm_sm90_stream_k_tiles(int64_t M, int64_t N) {
  return ceil_div(M, int64_t{64}) * ceil_div(N, int64_t{kBN});
}

namespace {

// The stream-K product (Fp8GemmArgs::stream_k): 128 x 128 tiles (two consumer warpgroups), or
// 64 x 128 where M <= 64 (one: no MMA rows past M), no cluster, global scales, the overlapped K
// loop at one CTA per SM, either epilogue.
void launch_stream_k(const Fp8GemmArgs& a, GemmParams p, cudaStream_t stream) {
  FP8RL_CHECK(a.block_m == 0 || a.block_m == 64 || a.block_m == 128,
              "FP8 GEMM (sm90): stream-K takes 64- or 128-row tiles, got block_m ", a.block_m);
  FP8RL_CHECK(a.sk_partials && a.sk_counters, "FP8 GEMM (sm90): stream-K needs sk_partials and sk_counters");
  const int bm = a.block_m ? a.block_m : a.M <= 64 ? 64 : 128;
  p.partials = false;
  p.c = a.c;
  p.kb_per_split = p.kblocks;
  p.m_tiles = static_cast<int>(ceil_div(a.M, int64_t{bm}));
  p.n_tiles = static_cast<int>(ceil_div(a.N, int64_t{kBN}));
  p.splits = 1;
  p.m_fastest = a.M <= 256;  // the row blocks of one weight tile together (they share its B tile)
  p.group_n = 0;
  p.sk_partials = a.sk_partials, p.sk_counters = a.sk_counters;
  const CUtensorMap ta = tensor_map(a.a, a.M, a.K, bm);
  const CUtensorMap tb = tensor_map(a.b, a.N, a.K, kBN);
  const bool tma = kernel_variant(p.m_tiles, p.n_tiles, false).tma_store && tma_store_applies(p);
  const CUtensorMap tc = tma ? output_map(p) : ta;
  if (bm == 64 && tma)
    launch_cluster<1, 8, 1, 1, false, true, kBN, true, false, false, false, true>(ta, tb, tc, p, stream);
  else if (bm == 64)
    launch_cluster<1, 8, 1, 1, false, false, kBN, true, false, false, false, true>(ta, tb, tc, p, stream);
  else if (tma) launch_cluster<2, 6, 1, 1, false, true, kBN, true, false, false, false, true>(ta, tb, tc, p, stream);
  else launch_cluster<2, 6, 1, 1, false, false, kBN, true, false, false, false, true>(ta, tb, tc, p, stream);
}

}  // namespace

void fp8_gemm_sm90(const Fp8GemmArgs& a, cudaStream_t stream) {
  const bool bf16_ab = a.ab == DType::BF16;
  FP8RL_CHECK(a.ab == DType::E4M3 || bf16_ab, "own GEMM (sm90): operands must be E4M3 or BF16, got ", dtype_name(a.ab));
  if (bf16_ab) {
    FP8RL_CHECK(fp8_gemm_sm90_supported(a.M, a.N, a.K, a.ab),
                "BF16 GEMM (sm90): needs N a multiple of 16 and K of 8, got M=", a.M, " N=", a.N, " K=", a.K);
    FP8RL_CHECK(!a.a_scales && !a.b_scales, "BF16 GEMM (sm90): BF16 operands take no scales (pass null)");
    FP8RL_CHECK(a.block_m == 0 || a.block_m == 64 || a.block_m == 128, "BF16 GEMM (sm90): block_m must be 64 or 128");
    FP8RL_CHECK(a.block_n == 0 || a.block_n == kBN, "BF16 GEMM (sm90): block_n must be 128 (128-column tiles only)");
  } else {
    FP8RL_CHECK(fp8_gemm_sm90_supported(a.M, a.N, a.K), "FP8 GEMM (sm90): needs N and K multiples of 16, got M=", a.M,
                " N=", a.N, " K=", a.K);
  }
  const char* what = bf16_ab ? "BF16 GEMM (sm90)" : "FP8 GEMM (sm90)";
  FP8RL_CHECK(a.c_dtype == DType::BF16 || a.c_dtype == DType::F32, what, ": output must be BF16 or F32");
  const int kblocks = static_cast<int>(ceil_div(k_bytes(a.K, a.ab), int64_t{kBK}));
  GemmParams p;  // the operands, scales and epilogue (the tiles and splits below)
  p.M = a.M, p.N = a.N, p.K = a.K;
  p.kblocks = kblocks;
  p.sa = a.a_scales;
  p.sa_m = a.a_scales_kb_major ? 1 : kblocks;
  p.sa_k = a.a_scales_kb_major ? a.M : 1;
  p.sb = a.b_scales;
  p.c_bf16 = a.c_dtype == DType::BF16;
  p.alpha = a.alpha, p.beta = a.beta;
  if (a.b_scales_rows) {
    FP8RL_CHECK(!bf16_ab, "BF16 GEMM (sm90): BF16 operands take no scales (b_scales_rows is for E4M3)");
    FP8RL_CHECK(!a.stream_k, "FP8 GEMM (sm90): per-row B scales (b_scales_rows) have no stream-K instance");
    FP8RL_CHECK(a.block_m == 0 || a.block_m == 128, "FP8 GEMM (sm90): per-row B scales (b_scales_rows) run ",
                "128-row tiles only, got block_m ", a.block_m);
    FP8RL_CHECK(a.block_n == 0 || a.block_n == kBN, "FP8 GEMM (sm90): per-row B scales (b_scales_rows) run ",
                "128-column tiles only, got block_n ", a.block_n);
    FP8RL_CHECK(a.a_scales && a.b_scales && reinterpret_cast<uintptr_t>(a.b_scales) % 16 == 0 && a.N % 4 == 0,
                "FP8 GEMM (sm90): per-row B scales (b_scales_rows) need both scale pointers, b_scales 16-byte ",
                "aligned and N a multiple of 4 (the stages' bulk copies), got N=", a.N);
  }
  if (a.stream_k) {
    FP8RL_CHECK(!bf16_ab, "BF16 GEMM (sm90): stream-K is built for E4M3 operands only");
    launch_stream_k(a, p, stream);
    return;
  }
  const int splits = std::max(1, std::min(a.splits, kblocks));
  const int kb_per_split = static_cast<int>(ceil_div(int64_t{kblocks}, int64_t{splits}));
  const int used_splits = static_cast<int>(ceil_div(int64_t{kblocks}, int64_t{kb_per_split}));
  FP8RL_CHECK(used_splits == 1 || a.workspace, what, ": split-K needs a workspace");
  p.kb_per_split = kb_per_split;
  p.partials = used_splits > 1;
  p.c = p.partials ? static_cast<void*>(a.workspace) : a.c;
  FP8RL_CHECK(a.block_m == 0 || a.block_m == 64 || a.block_m == 128 || a.block_m == 192,
              "FP8 GEMM (sm90): block_m must be 64, 128 or 192");
  // Per-row B scales: 128-row tiles at any M (checked above).
  const bool small = !a.b_scales_rows && (a.block_m ? a.block_m == 64 : a.M <= 256);
  const int bm = a.b_scales_rows ? 128 : small ? 64 : a.block_m ? a.block_m : bf16_ab ? 128 : fp8_gemm_large_block_m();
  const int m_tiles = static_cast<int>(ceil_div(a.M, int64_t{bm}));
  KernelVariant cl = kernel_variant(m_tiles, ceil_div(a.N, int64_t{kBN}), false);
  FP8RL_CHECK(a.block_n == 0 || a.block_n == 64 || a.block_n == kBN, "FP8 GEMM (sm90): block_n must be 64 or 128");
  if (small && a.block_n) {
    cl.bn = a.block_n;
    if (cl.bn == 64) cl.cm = cl.cn = 1, cl.smem_scales = false;
  }
  if (!small || bf16_ab) cl.bn = kBN;  // 64-column tiles only beside 64-row ones, and E4M3 ones
  const int n_tiles = static_cast<int>(ceil_div(a.N, int64_t{cl.bn}));
  p.n_tiles = n_tiles, p.m_tiles = m_tiles, p.splits = used_splits;
  p.m_fastest = a.M <= 256;  // decode-sized: the few row blocks of one weight tile together
  p.group_n = cl.band;
  if (bf16_ab) launch_bf16(bm, a.a, a.M, a.b, a.N, a.K, p, cl.tma_store, stream);
  else if (a.b_scales_rows) launch_b_rows(a.a, a.M, a.b, a.N, a.K, p, stream);
  else launch_variant(bm, a.a, a.M, a.b, a.N, a.K, p, cl, stream);
  if (p.partials) {
    const int64_t mn = a.M * a.N, threads = 256, blocks = ceil_div(ceil_div(mn, int64_t{4}), threads);
    if (p.c_bf16)
      fp8_gemm_reduce_kernel<<<blocks, threads, 0, stream>>>(a.workspace, used_splits, mn, a.alpha, a.beta,
                                                             static_cast<bf16*>(a.c));
    else
      fp8_gemm_reduce_kernel<<<blocks, threads, 0, stream>>>(a.workspace, used_splits, mn, a.alpha, a.beta,
                                                             static_cast<float*>(a.c));
    CUDA_CHECK(cudaGetLastError(), "FP8 GEMM split-K reduction launch");
  }
}

size_t fp8_gemm_sm90_grouped_meta_bytes(int groups, int64_t rows, int block_m) {
  const int64_t bm = block_m > 0 ? block_m : 64;  // the most tiles any block_m gives
  const int64_t tiles = ceil_div(rows, bm) + groups;
  return static_cast<size_t>(groups) * (sizeof(CUtensorMap) + sizeof(float*)) + 16 + static_cast<size_t>(tiles) * 16 +
         64;
}

std::vector<unsigned char> fp8_gemm_sm90_grouped_maps(const std::vector<const uint8_t*>& b,
                                                      const std::vector<const float*>& b_scales, int64_t N, int64_t K,
                                                      DType ab) {
  const bool bf16_ab = ab == DType::BF16;
  const size_t G = b.size(), maps_bytes = G * sizeof(CUtensorMap);
  FP8RL_CHECK(b_scales.size() == G || (bf16_ab && b_scales.empty()), "grouped FP8 GEMM: ", G, " groups need ", G,
              " scale tensors, got ", b_scales.size());
  std::vector<unsigned char> host(maps_bytes + G * 8);
  for (size_t g = 0; g < G; ++g) {
    const CUtensorMap m = tensor_map(b[g], N, k_bytes(K, ab), kBN);
    std::memcpy(host.data() + g * sizeof(CUtensorMap), &m, sizeof m);
    const float* sp = b_scales.empty() ? nullptr : b_scales[g];
    FP8RL_CHECK(!bf16_ab || !sp, "grouped BF16 GEMM: BF16 operands take no scales (pass none or null)");
    std::memcpy(host.data() + maps_bytes + g * 8, &sp, 8);
  }
  return host;
}

namespace {

// The grouped product's launch over a tile table in device memory of m_tiles entries (with
// `count`, a device int: its first *count), each group's B through its map in `maps`.
void grouped_launch(const Fp8GroupedArgs& a, int64_t R, int G, int bm, const int4* tiles, const int* count,
                    int64_t m_tiles, const uint8_t* maps, cudaStream_t stream) {
  const int kblocks = static_cast<int>(ceil_div(k_bytes(a.K, a.ab), int64_t{kBK}));
  GemmParams p;
  p.M = R, p.N = a.N, p.K = a.K;
  p.kblocks = kblocks, p.kb_per_split = kblocks;
  p.sa = a.a_scales;
  p.sa_m = a.a_scales_kb_major ? 1 : kblocks;
  p.sa_k = a.a_scales_kb_major ? R : 1;
  p.sb = nullptr;
  p.partials = false;
  p.c = a.c;
  p.c_bf16 = a.c_dtype == DType::BF16;
  p.alpha = a.alpha, p.beta = a.beta;
  p.b_maps = reinterpret_cast<const CUtensorMap*>(maps);
  p.sb_groups = reinterpret_cast<const float* const*>(maps + static_cast<size_t>(G) * sizeof(CUtensorMap));
  p.tiles = tiles;
  p.tile_count = count;
  const int n_tiles = static_cast<int>(ceil_div(a.N, int64_t{kBN}));
  p.n_tiles = n_tiles, p.m_tiles = static_cast<int>(m_tiles), p.splits = 1;
  p.m_fastest = false;  // a group's row blocks share its B: n fastest within each
  const KernelVariant cl = kernel_variant(p.m_tiles, n_tiles, true);  // cm = 1: the B maps' box is kBN rows
  p.group_n = count ? 0 : cl.band;  // a device table: no bands (the kernel's tile count, kCountRead)
  if (a.ab == DType::BF16) launch_bf16(bm, a.a, R, nullptr, a.N, a.K, p, cl.tma_store, stream);
  else if (count) launch_tile_count(bm, a.a, R, a.K, p, cl.tma_store, stream);
  else launch_variant(bm, a.a, R, nullptr, a.N, a.K, p, cl, stream);
}

// The grouped product over the caller's device tile table: nothing uploaded and nothing read
// back (the kernel reads the count), so it may be captured in a CUDA graph.
void grouped_device(const Fp8GroupedArgs& a, const char* what, cudaStream_t stream) {
  const bool bf16_ab = a.ab == DType::BF16;
  FP8RL_CHECK(a.offsets.empty(), what, ": give host offsets or a device tile table, not both");
  FP8RL_CHECK(a.device_tiles && a.device_tile_count, what, ": a device tile table needs device_tiles and ",
              "device_tile_count");
  FP8RL_CHECK(reinterpret_cast<uintptr_t>(a.device_tiles) % 16 == 0, what, ": device_tiles must be 16-byte aligned");
  FP8RL_CHECK(a.maps && reinterpret_cast<uintptr_t>(a.maps) % 64 == 0, what, ": a device tile table needs the ",
              "groups' maps already on the device (args.maps, 64-byte aligned: fp8_gemm_sm90_grouped_maps' bytes)");
  FP8RL_CHECK(a.groups > 0 && a.rows >= 0 && a.max_tiles >= 0, what, ": a device tile table needs groups > 0, ",
              "rows >= 0 and max_tiles >= 0, got ", a.groups, ", ", a.rows, " and ", a.max_tiles);
  FP8RL_CHECK(a.block_m == 64 || a.block_m == 128 || (a.block_m == 192 && !bf16_ab), what,
              ": a device tile table needs the block_m it was built for (64, 128", bf16_ab ? "" : " or 192", "), got ",
              a.block_m);
  if (a.rows == 0 || a.max_tiles == 0) return;
  FP8RL_CHECK(fp8_gemm_sm90_supported(a.rows, a.N, a.K, a.ab), what, " (sm90): needs N a multiple of 16 and K of ",
              bf16_ab ? 8 : 16, ", got N=", a.N, " K=", a.K);
  FP8RL_CHECK(a.max_tiles < (int64_t{1} << 31), what, ": max_tiles ", a.max_tiles, " is more than a launch takes");
  grouped_launch(a, a.rows, a.groups, a.block_m, a.device_tiles, a.device_tile_count, a.max_tiles,
                 static_cast<const uint8_t*>(a.maps), stream);
}

}  // namespace

// The grouped product: one launch, the m tiles over every group's row tiles (a table built here,
// or the caller's on the device), each tile reading its group's B through the group's tensor
// map. A tile's rows past its group's end are loaded (they belong to the next group or are zero
// fill) but neither scaled nor stored, so every row's arithmetic is that of the dense kernel at
// one split: bitwise the same result.
void fp8_gemm_sm90_grouped(const Fp8GroupedArgs& a, cudaStream_t stream) {
  const bool bf16_ab = a.ab == DType::BF16;
  FP8RL_CHECK(a.ab == DType::E4M3 || bf16_ab, "grouped GEMM (sm90): operands must be E4M3 or BF16, got ",
              dtype_name(a.ab));
  const char* what = bf16_ab ? "grouped BF16 GEMM" : "grouped FP8 GEMM";
  if (bf16_ab) {
    bool scales = a.a_scales != nullptr;
    for (const float* sp : a.b_scales) scales = scales || sp;
    FP8RL_CHECK(!scales, what, ": BF16 operands take no scales (pass null a_scales and no b_scales)");
  }
  FP8RL_CHECK(a.c_dtype == DType::BF16 || a.c_dtype == DType::F32, what, ": output must be BF16 or F32");
  if (a.device_tiles || a.device_tile_count) return grouped_device(a, what, stream);
  const int G = static_cast<int>(a.b.size());
  FP8RL_CHECK(G > 0 && a.offsets.size() == static_cast<size_t>(G) + 1 &&
                  (a.b_scales.size() == a.b.size() || (bf16_ab && a.b_scales.empty())),
              what, ": ", G, " groups need ", G + 1, " row offsets and ", G, " scale tensors, got ", a.offsets.size(),
              " and ", a.b_scales.size());
  const int64_t R = a.offsets.back();
  FP8RL_CHECK(a.offsets.front() == 0 && R >= 0, what, ": row offsets must start at 0");
  for (int g = 0; g < G; ++g) FP8RL_CHECK(a.offsets[g + 1] >= a.offsets[g], what, ": row offsets must not decrease");
  if (R == 0) return;
  FP8RL_CHECK(fp8_gemm_sm90_supported(R, a.N, a.K, a.ab), what, " (sm90): needs N a multiple of 16 and K of ",
              bf16_ab ? 8 : 16, ", got N=", a.N, " K=", a.K);
  FP8RL_CHECK(a.block_m == 0 || a.block_m == 64 || a.block_m == 128 || (a.block_m == 192 && !bf16_ab), what,
              ": block_m must be 64, 128", bf16_ab ? "" : " or 192");
  int nonempty = 0;
  for (int g = 0; g < G; ++g) nonempty += a.offsets[g + 1] > a.offsets[g];
  int bm = a.block_m;
  if (bm == 0) bm = R / std::max(1, nonempty) <= 96 ? 64 : bf16_ab ? 128 : fp8_gemm_large_block_m();
  // Host staging of the metadata: the maps (64-byte aligned), the scale pointers, the tiles.
  std::vector<int4> tiles;
  for (int g = 0; g < G; ++g)
    for (int64_t r = a.offsets[g]; r < a.offsets[g + 1]; r += bm)
      tiles.push_back(make_int4(g, static_cast<int>(r), static_cast<int>(a.offsets[g + 1]), 0));
  const size_t maps_bytes = static_cast<size_t>(G) * sizeof(CUtensorMap), ptr_bytes = static_cast<size_t>(G) * 8;
  const size_t tiles_bytes = tiles.size() * sizeof(int4);
  const size_t need = (a.maps ? 0 : maps_bytes + ptr_bytes + 15) + tiles_bytes;
  FP8RL_CHECK(a.device_meta && need + 64 <= a.device_meta_bytes, what, ": the metadata needs ", need + 64,
              " bytes of device scratch, got ", a.device_meta_bytes);
  FP8RL_CHECK(reinterpret_cast<uintptr_t>(a.maps) % 64 == 0, what, ": the maps must be 64-byte aligned");
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(a.device_meta) + 63) & ~uintptr_t(63));
  std::vector<unsigned char> host;
  if (!a.maps) host = fp8_gemm_sm90_grouped_maps(a.b, a.b_scales, a.N, a.K, a.ab);
  const size_t tiles_at = (host.size() + 15) & ~size_t{15};  // int4 rows: 16-byte aligned
  host.resize(tiles_at + tiles_bytes);
  std::memcpy(host.data() + tiles_at, tiles.data(), tiles_bytes);
  if (!a.uploads || !a.uploads->upload(host.data(), base, host.size(), stream))
    CUDA_CHECK(cudaMemcpyAsync(base, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
               "uploading the grouped FP8 GEMM's tile table");
  const uint8_t* maps = a.maps ? static_cast<const uint8_t*>(a.maps) : base;
  grouped_launch(a, R, G, bm, reinterpret_cast<const int4*>(base + tiles_at), nullptr,
                 static_cast<int64_t>(tiles.size()), maps, stream);
}

size_t fp8_gemm_sm90_kgrouped_meta_bytes(int groups) {
  return static_cast<size_t>(std::max(groups, 0)) * (sizeof(int4) + sizeof(void*)) + 64;
}

// The K-grouped product: the group entries are the launch's splits (tile_of<..., kKGrouped>), so
// the tiles of entry s are its group's whole C over its K blocks; the BF16 instances of 128-row
// tiles (6 stages, one CTA per SM) or 64-row tiles (4 stages, two CTAs per SM: one CTA's
// read-modify-write epilogue runs beside the other's MMAs), direct stores into each group's
// output.
void fp8_gemm_sm90_kgrouped(const Fp8KGroupedArgs& a, cudaStream_t stream) {
  const char* what = "K-grouped BF16 GEMM (sm90)";
  const int G = static_cast<int>(a.c.size());
  FP8RL_CHECK(G > 0 && a.k_offsets.size() == static_cast<size_t>(G) + 1, what, ": ", G, " groups need ", G + 1,
              " K offsets, got ", a.k_offsets.size());
  FP8RL_CHECK(a.c_dtype == DType::BF16 || a.c_dtype == DType::F32, what, ": output must be BF16 or F32");
  FP8RL_CHECK(a.M > 0 && a.N > 0 && a.N % 16 == 0 && a.K > 0 && a.K % 64 == 0 && a.M < (int64_t{1} << 31) &&
                  a.N < (int64_t{1} << 31),
              what, ": needs M > 0, N a multiple of 16 and K of 64, got M=", a.M, " N=", a.N, " K=", a.K);
  FP8RL_CHECK(a.k_offsets.front() == 0 && a.k_offsets.back() <= a.K, what, ": K offsets must run from 0 to at most ",
              a.K, ", got ", a.k_offsets.front(), " .. ", a.k_offsets.back());
  std::vector<int4> entries;
  for (int g = 0; g < G; ++g) {
    const int64_t k0 = a.k_offsets[g], k1 = a.k_offsets[g + 1];
    FP8RL_CHECK(k1 >= k0 && k0 % 64 == 0 && k1 % 64 == 0, what, ": group ", g, "'s K range [", k0, ", ", k1,
                ") must be ordered and in multiples of 64");
    if (k1 > k0 && a.c[g])
      entries.push_back(make_int4(g, static_cast<int>(k0 / 64), static_cast<int>((k1 - k0) / 64), 0));
    else
      FP8RL_CHECK(!a.c[g] || a.beta == 1.0f, what, ": group ", g, " has no K range, so its output is left as it is, ",
                  "which needs beta 1 (got ", a.beta, ")");
  }
  if (entries.empty()) return;
  FP8RL_CHECK(a.block_m == 64 || a.block_m == 128, what, ": block_m must be 64 or 128, got ", a.block_m);
  const int m_tiles = static_cast<int>(ceil_div(a.M, int64_t{a.block_m})),
            n_tiles = static_cast<int>(ceil_div(a.N, int64_t{kBN}));
  FP8RL_CHECK(static_cast<int64_t>(entries.size()) * m_tiles * n_tiles < (int64_t{1} << 31), what, ": too many tiles");
  const size_t entries_bytes = entries.size() * sizeof(int4), ptr_bytes = static_cast<size_t>(G) * sizeof(void*);
  FP8RL_CHECK(a.device_meta && entries_bytes + ptr_bytes + 64 <= a.device_meta_bytes, what, ": the group table needs ",
              entries_bytes + ptr_bytes + 64, " bytes of device scratch, got ", a.device_meta_bytes);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(a.device_meta) + 63) & ~uintptr_t(63));
  std::vector<unsigned char> host(entries_bytes + ptr_bytes);
  std::memcpy(host.data(), entries.data(), entries_bytes);
  std::memcpy(host.data() + entries_bytes, a.c.data(), ptr_bytes);
  if (!a.uploads || !a.uploads->upload(host.data(), base, host.size(), stream))
    CUDA_CHECK(cudaMemcpyAsync(base, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
               "uploading the K-grouped GEMM's group table");
  GemmParams p;
  p.M = a.M, p.N = a.N, p.K = a.K;
  p.kblocks = static_cast<int>(ceil_div(2 * a.K, int64_t{kBK})), p.kb_per_split = p.kblocks;
  p.sa = nullptr, p.sa_m = 0, p.sa_k = 0, p.sb = nullptr;
  p.partials = false;
  p.c = nullptr;  // each entry's group's output (c_groups)
  p.c_bf16 = a.c_dtype == DType::BF16;
  p.alpha = a.alpha, p.beta = a.beta;
  p.k_groups = reinterpret_cast<const int4*>(base);
  p.c_groups = reinterpret_cast<void* const*>(base + entries_bytes);
  p.n_tiles = n_tiles, p.m_tiles = m_tiles, p.splits = static_cast<int>(entries.size());
  p.m_fastest = false, p.group_n = 0;
  const CUtensorMap ta = tensor_map(static_cast<const uint8_t*>(a.a), a.M, 2 * a.K, a.block_m);
  const CUtensorMap tb = tensor_map(static_cast<const uint8_t*>(a.b), a.N, 2 * a.K, kBN);
  if (a.block_m == 64) launch_cluster<1, 4, 1, 1, false, false, kBN, false, true, false, true>(ta, tb, ta, p, stream);
  else launch_cluster<2, 6, 1, 1, false, false, kBN, false, true, false, true>(ta, tb, ta, p, stream);
}

}  // namespace fp8rl::cuda
