// Tensor-core flash attention (FlashAttention-2 structure) for BF16 activations, head_dim 64
// or 128, or q/k heads of 192 over v heads of 128 (MLA: DeepSeek-V3 / Moonlight's
// qk_nope + qk_rope = 128 + 64 and v_head_dim 128): causal GQA over packed sequences. mma.sync m16n8k16 (BF16 in, FP32 accumulate) on
// operands staged in shared memory by cp.async (two stages: the next tile is in flight while the
// current one is used) and read with ldmatrix (.trans for the operands stored [k][n], so no tile
// is ever transposed in memory); the softmax, the rescaling and the masks run in FP32 on the
// accumulator registers.
//   forward:  one block per (64-query tile, q head); 4 warps x 16 query rows; loop over the
//             64-key tiles up to the diagonal with an online softmax; writes out and lse.
//   backward: delta = rowsum(dout * out); dq: one block per (64-query tile, q head), P and dP
//             recomputed from lse; dk/dv: one block per (64-key tile, q head) over the query
//             tiles at or after the key tile; with GQA its F32 partials are summed over each
//             group by a last small kernel (in head order). No atomics.
// Tiles never cross a sequence: they start at the sequence's first token (host tile lists).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "quant/fp8_rule.h"  // fp8_e4m3x2_to_float2 (the decode kernel's E4M3 keys and values)
#include "quant/quant.h"      // ceil_div

namespace fp8rl::cuda {

namespace {

constexpr int kTile = kFlashTile;  // queries (forward, dq) or keys (dk/dv) per block
constexpr int kWarpsF = 4;         // 16 rows per warp
constexpr int kThreadsF = kWarpsF * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- PTX helpers (tests/cuda/flash_emu/emu.h has host versions of everything in this section) --
// Fragments of mma.m16n8k16.row.col (PTX ISA): with g = lane / 4, c = lane % 4,
//   A (16x16, row-major): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//   B (16x8):            b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]
//   C (16x8, FP32):      c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1]
// ldmatrix.x4: lane l gives the address of row l % 8 of 8x8 matrix l / 8; r[j] is this lane's 32-bit
// piece of matrix j: row g, columns 2c, 2c+1 (.trans: rows 2c, 2c+1 of column g).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) { ldmatrix_x4<false>(r, p); }
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) { ldmatrix_x4<true>(r, p); }
// Asynchronous global -> shared copies; src_bytes 0 zero-fills the destination (src not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most one committed group (the newest) is still in flight.
__device__ __forceinline__ void cp_async_wait_all_but_newest() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}
// Waits until every committed group of this thread has landed.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Two FP32 values as a BF16 pair (lo at the lower column), round to nearest even: one
// cvt.rn.bf16x2.f32, bitwise bf16_bits_from_float for every non-NaN value (a NaN becomes the
// canonical one; the software form's six instructions a value were, with the NaN test of
// store8's, the largest share of the flash-order decode's instructions: session 24's profile).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 8 values as BF16 by pack_bf16 into p (16-byte aligned): store8 without its NaN test, for
// values that are finite by construction (cached codes times a scale).
__device__ __forceinline__ void store8_finite(bf16* p, const float v[8]) {
  *reinterpret_cast<uint4*>(p) =
      make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}
// ---- end of PTX helpers

// Shared tiles are BF16 row-major with a padded leading dimension ld = width + 8: ldmatrix's
// eight row addresses of a phase then fall in distinct banks.

// A (rows r0..r0+15, columns k0..k0+15) of a row-major [rows][ld] tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* s, int ld, int r0, int k0, int lane) {
  ldsm_x4(a, s + (r0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}
// B fragments of the two n-tiles n0..n0+7 (b[0]) and n0+8..n0+15 (b[1]) over k0..k0+15, from a
// tile stored [n][k] (row n holds B's column n: K for Q K^T).
__device__ __forceinline__ void load_b2(uint32_t (&b)[2][2], const bf16* s, int ld, int n0, int k0, int lane) {
  const int j = lane >> 3;
  uint32_t r[4];
  ldsm_x4(r, s + (n0 + (j >> 1) * 8 + (lane & 7)) * ld + k0 + (j & 1) * 8);
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
// The same from a tile stored [k][n] (V for P V): ldmatrix.trans.
__device__ __forceinline__ void load_b2_t(uint32_t (&b)[2][2], const bf16* s, int ld, int n0, int k0, int lane) {
  const int j = lane >> 3;
  uint32_t r[4];
  ldsm_x4_t(r, s + (k0 + (j & 1) * 8 + (lane & 7)) * ld + n0 + (j >> 1) * 8);
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
// The A fragment (16 rows x 16 columns kk*16..) from C-layout accumulators x[2kk], x[2kk+1].
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&x0)[4], const float (&x1)[4]) {
  a[0] = pack_bf16(x0[0], x0[1]);
  a[1] = pack_bf16(x0[2], x0[3]);
  a[2] = pack_bf16(x1[0], x1[1]);
  a[3] = pack_bf16(x1[2], x1[3]);
}

// acc (16 x A's n-tiles of 8, C layout) += A B with A held in registers (16 rows x NK * 8
// columns: C-layout accumulators, rounded to BF16 fragments) and B an [NK * 8][ld] tile stored
// [k][n] (ldmatrix.trans).
template <int ND, int NK>
__device__ __forceinline__ void mma_regs_times(float (&acc)[ND][4], const float (&p)[NK][4], const bf16* B, int ld,
                                               int lane) {
#pragma unroll
  for (int kk = 0; kk < NK / 2; ++kk) {
    uint32_t a[4];
    a_from_c(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
    for (int np = 0; np < ND / 2; ++np) {
      uint32_t b[2][2];
      load_b2_t(b, B, ld, np * 16, kk * 16, lane);
      mma_bf16(acc[2 * np], a, b[0]);
      mma_bf16(acc[2 * np + 1], a, b[1]);
    }
  }
}
// acc (16 x NN * 8) += A B^T with A rows r0.. of a row-major [*][ld_a] tile and B an [NN * 8][ld_b]
// tile stored [n][k] (row n holds B^T's row n), both D wide: Q K^T, dO V^T and their transposes.
template <int NN, int D>
__device__ __forceinline__ void mma_tile_times_t(float (&acc)[NN][4], const bf16* A, int ld_a, int r0, const bf16* B,
                                                 int ld_b, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a(a, A, ld_a, r0, kk * 16, lane);
#pragma unroll
    for (int np = 0; np < NN / 2; ++np) {
      uint32_t b[2][2];
      load_b2(b, B, ld_b, np * 16, kk * 16, lane);
      mma_bf16(acc[2 * np], a, b[0]);
      mma_bf16(acc[2 * np + 1], a, b[1]);
    }
  }
}
template <int N>
__device__ __forceinline__ void zero(float (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.0f;
}

// Issues the copies of rows row0 .. row0 + NR - 1 of a [*, stride] BF16 global array (columns
// 0..D-1 of each row at src + row * stride) into a row-major shared tile [NR][ld]; rows >= row_end
// are zero-filled. 16-byte pieces (the caller checks the alignment), a warp's 32 consecutive
// pieces cover whole rows.
template <int NR, int D>
__device__ __forceinline__ void load_tile_async(const bf16* src, int64_t stride, int64_t row0, int64_t row_end,
                                                bf16* dst, int ld) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < NR * kChunks; i += kThreadsF) {
    const int r = i / kChunks, ch = i % kChunks;
    const bool ok = row0 + r < row_end;
    cp_async16(dst + r * ld + ch * 8, ok ? src + (row0 + r) * stride + ch * 8 : src, ok);
  }
}

// Tile descriptor (host lists): first row of the tile, first and one-past-last token of its
// sequence.
struct TileDesc {
  int32_t row0, seq_start, seq_end, pad;
};

// ---- forward ----------------------------------------------------------------------------------
// Shared memory: the query tile and two stages of the key and value tiles (the next pair is in
// flight while the current one is used). D: the q / k head width, DV: v's (and the output's).
template <int D, int DV = D>
struct FwdSmem {
  static constexpr int kLd = D + 8, kLdV = DV + 8, kT = kTile * kLd, kTV = kTile * kLdV;
  static constexpr int kQ = 0, kKV = kT, kStage = kT + kTV;  // stage s: K at kKV + s kStage, V kT after it
  static constexpr int kTotal = kKV + 2 * kStage;
  static constexpr size_t kBytes = static_cast<size_t>(kTotal) * sizeof(bf16);
};

// The online softmax's steps for a thread's two rows (g and g + 8 of a 16-row MMA tile; c = lane & 3),
// shared by fwd_tile and flash_decode_kernel (whose warps each run them over a quarter of a tile's
// columns), so that both compute every element with the same operations in the same order (the
// products and roundings pinned with __fmul_rn / __fsub_rn / __fadd_rn: no contraction that could
// differ between the two kernels).
//
// Scores s of N column tiles (8 keys each, the first key `key0`) to log2 units, keys past a row's
// last key (last[0], last[1]) to -inf where `mask`; mx: the thread's row maxima over them.
template <int N>
__device__ __forceinline__ void scores_to_log2(float (&s)[N][4], float sl2, bool mask, int64_t key0,
                                               const int64_t (&last)[2], int c, float (&mx)[2]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = __fmul_rn(s[nt][e], sl2);
      if (mask && key0 + nt * 8 + 2 * c + (e & 1) > last[e >> 1]) x = -INFINITY;
      s[nt][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
}
// x over the row's quad of lanes (max or sum, as `op`).
template <class Op>
__device__ __forceinline__ void quad_reduce(float (&x)[2], Op op) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    x[r] = op(x[r], __shfl_xor_sync(0xffffffffu, x[r], 1));
    x[r] = op(x[r], __shfl_xor_sync(0xffffffffu, x[r], 2));
  }
}
// The rows' running maxima m after a tile whose maxima are mx: the base the tile's probabilities
// are taken against, the factor corr that rescales what came before, l rescaled.
__device__ __forceinline__ void online_max(float (&m)[2], float (&l)[2], const float (&mx)[2], float (&base)[2],
                                           float (&corr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float mn = fmaxf(m[r], mx[r]);
    base[r] = mn == -INFINITY ? 0.0f : mn;
    corr[r] = exp2f(__fsub_rn(m[r], base[r]));  // 0 on the first tile (m = -inf)
    m[r] = mn;
    l[r] = __fmul_rn(l[r], corr[r]);
  }
}
__device__ __forceinline__ float prob(float x, float base) { return exp2f(__fsub_rn(x, base)); }
// l += the probabilities, column tile by column tile (the order both kernels keep).
template <int N>
__device__ __forceinline__ void add_probs(const float (&p)[N][4], float (&l)[2]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) l[e >> 1] = __fadd_rn(l[e >> 1], p[nt][e]);
}
template <int N>
__device__ __forceinline__ void rescale(float (&o)[N][4], const float (&corr)[2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    o[i][0] = __fmul_rn(o[i][0], corr[0]);
    o[i][1] = __fmul_rn(o[i][1], corr[0]);
    o[i][2] = __fmul_rn(o[i][2], corr[1]);
    o[i][3] = __fmul_rn(o[i][3], corr[1]);
  }
}
// The tile-merge order (FP8RL_FLASH_ORDER=merge; fwd_tile_merge): each key tile's softmax is taken
// against the tile's own row maxima mt (base bt: 0 where a row has no key in the tile), its l and
// P V summed from zero (lt, ot), and the tile merged into the running (m, l, o) by two FP32
// scalings and one add per element. No accumulator is carried from tile to tile through an MMA,
// so a tile's (mt, lt, ot) depends on that tile alone: a decode may compute tiles in any order or
// at once and merge them in key order, with the forward's bits.
__device__ __forceinline__ void tile_base(const float (&mt)[2], float (&bt)[2]) {
  bt[0] = mt[0] == -INFINITY ? 0.0f : mt[0];
  bt[1] = mt[1] == -INFINITY ? 0.0f : mt[1];
}
template <int N>
__device__ __forceinline__ void merge_tile(float (&m)[2], float (&l)[2], float (&o)[N][4], const float (&mt)[2],
                                           const float (&bt)[2], const float (&lt)[2], const float (&ot)[N][4]) {
  float a[2], b[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float mn = fmaxf(m[r], mt[r]), bn = mn == -INFINITY ? 0.0f : mn;
    a[r] = exp2f(__fsub_rn(m[r], bn));  // 0 before the first tile (m = -inf)
    b[r] = exp2f(__fsub_rn(bt[r], bn));
    m[r] = mn;
    l[r] = __fadd_rn(__fmul_rn(l[r], a[r]), __fmul_rn(lt[r], b[r]));
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = __fadd_rn(__fmul_rn(o[i][e], a[e >> 1]), __fmul_rn(ot[i][e], b[e >> 1]));
}

// Row r's N output column tiles as BF16 o * inv into d32 (the row's first of them as 32-bit pairs).
template <int N>
__device__ __forceinline__ void store_row(const float (&o)[N][4], int r, float inv, uint32_t* d32, int c) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
    d32[nt * 4 + c] = pack_bf16(__fmul_rn(o[nt][2 * r], inv), __fmul_rn(o[nt][2 * r + 1], inv));
}

// One key tile of the forward's online softmax for a warp's 16 query rows (sQ rows r0..r0+15):
// s = Q K^T over the tile (sK [kTile][ld], stored [key][d]), scaled to log2 units, and where
// `mask`, keys past a row's last key (last[0], last[1]: this thread's rows g and g + 8; key k0 +
// j is the tile's j-th) to -inf; then m, l and o rescaled and O += P V (sV [kTile][ldv]).
template <int D, int DV = D>
__device__ __forceinline__ void fwd_tile(const bf16* sQ, int ld, int r0, const bf16* sK, const bf16* sV, int ldv,
                                         int64_t k0, bool mask, const int64_t (&last)[2], float sl2,
                                         float (&o)[DV / 8][4], float (&m)[2], float (&l)[2], int lane) {
  float s[kTile / 8][4];
  zero(s);
  mma_tile_times_t<kTile / 8, D>(s, sQ, ld, r0, sK, ld, lane);
  float mx[2] = {-INFINITY, -INFINITY};
  scores_to_log2(s, sl2, mask, k0, last, lane & 3, mx);
  quad_reduce(mx, [](float a, float b) { return fmaxf(a, b); });
  float corr[2], base[2];
  online_max(m, l, mx, base, corr);
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = prob(s[nt][e], base[e >> 1]);
  add_probs(s, l);
  rescale(o, corr);
  // O += P V (P as BF16 A fragments straight from the score registers).
  mma_regs_times(o, s, sV, ldv, lane);
}

// fwd_tile in the tile-merge order (tile_base / merge_tile above).
template <int D, int DV = D>
__device__ __forceinline__ void fwd_tile_merge(const bf16* sQ, int ld, int r0, const bf16* sK, const bf16* sV,
                                               int ldv, int64_t k0, bool mask, const int64_t (&last)[2], float sl2,
                                               float (&o)[DV / 8][4], float (&m)[2], float (&l)[2], int lane) {
  float s[kTile / 8][4];
  zero(s);
  mma_tile_times_t<kTile / 8, D>(s, sQ, ld, r0, sK, ld, lane);
  float mt[2] = {-INFINITY, -INFINITY};
  scores_to_log2(s, sl2, mask, k0, last, lane & 3, mt);
  quad_reduce(mt, [](float a, float b) { return fmaxf(a, b); });
  float bt[2];
  tile_base(mt, bt);
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = prob(s[nt][e], bt[e >> 1]);
  float lt[2] = {0.0f, 0.0f};
  add_probs(s, lt);
  float ot[DV / 8][4];
  zero(ot);
  mma_regs_times(ot, s, sV, ldv, lane);
  merge_tile(m, l, o, mt, bt, lt, ot);
}

// The forward's end for this thread's two rows: l summed over the quad, and row r's output (when
// dst[r]) as BF16 o / l and its natural log-sum-exp (when lse_dst[r], by lane c == 0).
template <int D>
__device__ __forceinline__ void fwd_finish(const float (&o)[D / 8][4], const float (&m)[2], float (&l)[2],
                                           bf16* const (&dst)[2], float* const (&lse_dst)[2], int lane) {
  const int c = lane & 3;
  quad_reduce(l, [](float a, float b) { return __fadd_rn(a, b); });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!dst[r]) continue;
    store_row(o, r, 1.0f / l[r], reinterpret_cast<uint32_t*>(dst[r]), c);
    if (c == 0 && lse_dst[r]) *lse_dst[r] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, DV], out [T, Hq, DV] BF16; lse F32 [Hq, T]. kMerge: the
// tile-merge order.
template <int D, bool kMerge = false, int DV = D>
__global__ void __launch_bounds__(kThreadsF) flash_fwd_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                               const TileDesc* tiles, int Hq, int Hkv, int64_t T_,
                                                               float scale, bf16* out, float* lse) {
  using S = FwdSmem<D, DV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16* sQ = sm + S::kQ;
  const TileDesc td = tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (Hq / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int64_t q0 = td.row0, seq_start = td.seq_start, seq_end = td.seq_end;
  const int64_t qstride = static_cast<int64_t>(Hq) * D, kstride = static_cast<int64_t>(Hkv) * D;
  const int64_t vstride = static_cast<int64_t>(Hkv) * DV, ostride = static_cast<int64_t>(Hq) * DV;
  const int64_t q_last = (q0 + kTile < seq_end ? q0 + kTile : seq_end) - 1;

  load_tile_async<kTile, D>(q + h * D, qstride, q0, seq_end, sQ, S::kLd);
  load_tile_async<kTile, D>(k + hk * D, kstride, seq_start, seq_end, sm + S::kKV, S::kLd);
  load_tile_async<kTile, DV>(v + hk * DV, vstride, seq_start, seq_end, sm + S::kKV + S::kT, S::kLdV);
  cp_async_commit();

  constexpr int kNd = DV / 8;  // n-tiles over the output's head_dim
  float o[kNd][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = scale * kLog2e;
  const int64_t qrow0 = q0 + warp * 16 + g;  // this thread's rows: qrow0, qrow0 + 8
  const int64_t last[2] = {qrow0, qrow0 + 8};  // causal: a row's keys end at itself

  int stage = 0;
  for (int64_t k0 = seq_start; k0 <= q_last; k0 += kTile, stage ^= 1) {
    if (k0 + kTile <= q_last) {  // prefetch the next key/value tiles into the other stage
      bf16* nk = sm + S::kKV + (stage ^ 1) * S::kStage;
      load_tile_async<kTile, D>(k + hk * D, kstride, k0 + kTile, seq_end, nk, S::kLd);
      load_tile_async<kTile, DV>(v + hk * DV, vstride, k0 + kTile, seq_end, nk + S::kT, S::kLdV);
    }
    cp_async_commit();
    cp_async_wait_all_but_newest();
    __syncthreads();
    const bf16* sK = sm + S::kKV + stage * S::kStage;
    // Causal mask on the diagonal tile only (keys past the row).
    if constexpr (kMerge)
      fwd_tile_merge<D, DV>(sQ, S::kLd, warp * 16, sK, sK + S::kT, S::kLdV, k0, k0 + kTile - 1 > q0, last, sl2, o, m,
                            l, lane);
    else
      fwd_tile<D, DV>(sQ, S::kLd, warp * 16, sK, sK + S::kT, S::kLdV, k0, k0 + kTile - 1 > q0, last, sl2, o, m, l,
                      lane);
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }
  bf16* dst[2];
  float* lse_dst[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = qrow0 + 8 * r;
    dst[r] = row < seq_end ? out + row * ostride + h * DV : nullptr;
    lse_dst[r] = row < seq_end ? lse + static_cast<int64_t>(h) * T_ + row : nullptr;
  }
  fwd_finish<DV>(o, m, l, dst, lse_dst, lane);
}

// ---- decode over the paged KV cache in the forward's order ----------------------------------
// A CTA of four warps serves one (query token, KV head): the token's group of G <= 16 query heads
// are the rows of one 16-row MMA tile, run over the key tiles of kTile positions from the
// sequence's position 0 up to the token's, read from the paged cache into the forward's shared
// layout — E4M3: each code's value times the layer's scale rounded to BF16 (what kv_round gives the
// trainer's k and v), BF16 pools as stored — positions past the token as zeros, and the last tile
// masked past the token. Each element is computed as fwd_tile / fwd_finish compute it for that
// query row: the same MMA fragments accumulated in the same order, the same max, the same
// roundings, the same summation order of l. So each head's output is bitwise flash_fwd_kernel's for
// that query row over the same (rounded) keys and values (the generator's half of the consistent
// mode's `flash` attention). The cache holds the token's own k/v (kv_write first), as for
// attention_paged.
//
// The warps share each tile: warp w computes the scores of keys 16w .. 16w + 15 (two of fwd_tile's
// eight 8-key column tiles, with the same k-loop over the head dimension), its rows' maxima meet in
// shared memory (a max is exact in any order), each warp turns its scores into probabilities and
// leaves them in shared memory, and then every thread reads back the whole tile's probabilities in
// fwd_tile's register layout: l sums them in fwd_tile's order, the P fragments are fwd_tile's, and
// warp w accumulates a quarter of the output columns (head_dim 128: columns 32w .. 32w + 31, four
// of the sixteen 8-column tiles; 64: two of eight), with the same k-loop over keys. The pool
// bytes are staged by cp.async (zero-filled past the token), keys and values as separate groups,
// each fetched for the next tile as soon as this tile's copy of it is converted into the one BF16
// tile (keys, then values), from pages read out of the page table a tile earlier. ~42 KB of shared
// memory at head_dim 128 over E4M3: five CTAs, twenty warps per SM.
constexpr int kDecWarps = 4;
// A decode CTA's (token, KV head): blockIdx.x = t * Hkv + hk; the group G, the token's position
// and its sequence's row of the page table.
struct DecCta {
  int64_t t;
  int hk, G, pos;
  const int32_t* pages;
};
__device__ __forceinline__ DecCta dec_cta(const int32_t* token_seq, const int32_t* token_pos,
                                          const int32_t* page_table, int max_pages, int Hq, int Hkv) {
  const int64_t w = blockIdx.x;
  DecCta d;
  d.t = w / Hkv;
  d.hk = static_cast<int>(w % Hkv);
  d.G = Hq / Hkv;
  d.pos = token_pos[d.t];
  d.pages = page_table + static_cast<int64_t>(token_seq[d.t]) * max_pages;
  return d;
}
// The decode CTAs' query rows: head hk * G + i of token t in row i of sQ [16][ld], zeros below G.
template <int D>
__device__ __forceinline__ void load_query_rows(const bf16* q, int64_t t, int Hq, int hk, int G, bf16* sQ, int ld,
                                                int tid) {
  constexpr int kQChunks = D / 8;  // 16-byte chunks of a BF16 row
  for (int i = tid; i < 16 * kQChunks; i += kDecWarps * 32) {
    const int r = i / kQChunks, ch = i % kQChunks;
    uint4 u = make_uint4(0, 0, 0, 0);
    if (r < G) u = *reinterpret_cast<const uint4*>(q + (t * Hq + hk * G + r) * D + ch * 8);
    *reinterpret_cast<uint4*>(sQ + r * ld + ch * 8) = u;
  }
}
// fold_pow2 with power-of-two scales (pow2_scales): kv_round's values are the codes' values
// times 2^k exactly, and a power of two passes exactly through every product, sum and rounding
// (the values stay far from FP32's subnormal range), so the tile takes the codes' values and the
// scales move to the score multiplier (keys) and to 1 / l (values). GPU-tested bitwise both ways;
// measured no faster in session 21's one-warp form, kept off by default. Whether x is such a scale:
__device__ __forceinline__ bool foldable_pow2(float x) {
  const uint32_t b = __float_as_uint(x), e = b >> 23;
  return (b & 0x807fffffu) == 0 && e >= 127 - 60 && e <= 127 + 60;
}
template <int D, bool kE4m3>
struct DecSmem {
  static constexpr int kLd = D + 8;
  static constexpr int kRowBytes = D * (kE4m3 ? 1 : 2);  // one position's keys (or values) in the pool
  static constexpr int kChunks = kRowBytes / 16;         // 16-byte pieces of a position's row
  // byte offsets: the query rows and the tile (BF16), the probabilities [kTile / 8][4][32] and the
  // warps' row maxima [kDecWarps][16] (F32), then the staging area (keys, then values)
  static constexpr size_t kQ = 0, kT = kQ + 16 * kLd * 2, kP = kT + kTile * kLd * 2, kMx = kP + kTile / 8 * 4 * 32 * 4,
                          kStage = kMx + kDecWarps * 16 * 4, kBytes = kStage + 2 * static_cast<size_t>(kTile) * kRowBytes;
  static_assert(kStage % 16 == 0 && kT % 16 == 0, "16-byte aligned parts");
};

// kMerge: the tile-merge order (fwd_tile_merge's): each tile's probabilities against its own
// maxima, its l and P V from zero, merged into (m, l, o) by merge_tile.
template <int D, bool kE4m3, bool kMerge = false>
__global__ void __launch_bounds__(kDecWarps * 32) flash_decode_kernel(
    const bf16* q, const int32_t* token_seq, const int32_t* token_pos, const int32_t* page_table, int max_pages,
    int64_t T_, int Hq, int Hkv, int page_size, const void* kpool, const void* vpool, const float* k_scale,
    const float* v_scale, float scale, int fold_pow2, bf16* out) {
  using S = DecSmem<D, kE4m3>;
  constexpr int kNT = kTile / 8;              // fwd_tile's key column tiles (8 keys each)
  constexpr int kNTw = kNT / kDecWarps;       // ... of one warp
  constexpr int kND = D / 8;                  // output column tiles (8 columns each)
  constexpr int kNDw = kND / kDecWarps;       // ... of one warp
  constexpr int kThreads = kDecWarps * 32;
  static_assert(kNTw % 2 == 0 && kNDw % 2 == 0, "whole 16-column pairs per warp");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const DecCta cta = dec_cta(token_seq, token_pos, page_table, max_pages, Hq, Hkv);
  const int64_t t = cta.t;
  const int hk = cta.hk, G = cta.G, pos = cta.pos;
  const int32_t* pages = cta.pages;
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw + S::kQ);
  bf16* sT = reinterpret_cast<bf16*>(smem_raw + S::kT);  // the tile's keys, then its values
  float* sP = reinterpret_cast<float*>(smem_raw + S::kP);
  float* sMx = reinterpret_cast<float*>(smem_raw + S::kMx);
  unsigned char* stage = smem_raw + S::kStage;
  // Positions are int (a context is far below 2^31); a power-of-two page size (16 by default)
  // divides by a shift.
  const int ps_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
  // This thread's 16-byte pieces of a tile (i = tid + n kThreads: position i / kChunks, piece
  // i % kChunks) and the cache pages of their positions, read from the page table a tile ahead of
  // the copies that use them: a page-table read is a global load the copy's address depends on, so
  // read at copy time it put its latency in front of every tile's copies.
  constexpr int kPer = kTile * S::kChunks / kThreads;
  static_assert(kTile * S::kChunks % kThreads == 0, "whole pieces per thread");
  auto page_of = [&](int p) { return ps_shift >= 0 ? p >> ps_shift : p / page_size; };
  auto load_pages = [&](int k0, int(&pg)[kPer]) {
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int p = k0 + (tid + n * kThreads) / S::kChunks;
      pg[n] = p <= pos ? pages[page_of(p)] : 0;
    }
  };
  // The pool bytes (which = 0: keys, 1: values) of positions k0 .. k0 + kTile - 1 into their
  // staging half (zeros past pos), as one cp.async group; pg: their pages (load_pages).
  auto fetch = [&](int k0, int which, const int(&pg)[kPer]) {
    const auto* pool = static_cast<const unsigned char*>(which ? vpool : kpool);
    unsigned char* dst = stage + which * kTile * S::kRowBytes;
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int i = tid + n * kThreads, j = i / S::kChunks, ch = i % S::kChunks;
      const int p = k0 + j;
      const bool ok = p <= pos;
      int64_t at = 0;
      if (ok) {
        const int64_t slot = static_cast<int64_t>(pg[n]) * page_size + (p - page_of(p) * page_size);
        at = (slot * Hkv + hk) * S::kRowBytes + ch * 16;
      }
      cp_async16(dst + j * S::kRowBytes + ch * 16, pool + at, ok);
    }
    cp_async_commit();
  };
  // Staging half `which` into the BF16 tile: E4M3 as code * scale rounded to BF16 (kv_round's
  // values; with `fold`, the codes' values), BF16 as stored.
  auto convert = [&](int which, float sc, bool fold) {
    const unsigned char* src0 = stage + which * kTile * S::kRowBytes;
    for (int i = tid; i < kTile * S::kChunks; i += kThreads) {
      const int j = i / S::kChunks, ch = i % S::kChunks;
      const unsigned char* src = src0 + j * S::kRowBytes + ch * 16;
      bf16* dst = sT + j * S::kLd + ch * (kE4m3 ? 16 : 8);
      if constexpr (kE4m3) {
        const uint4 c16 = *reinterpret_cast<const uint4*>(src);
        const uint32_t wd[4] = {c16.x, c16.y, c16.z, c16.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x[8];
#pragma unroll
          for (int e = 0; e < 8; e += 2) {
            const float2 f = fp8_e4m3x2_to_float2(wd[2 * h + e / 4] >> (8 * (e % 4)));
            x[e] = fold ? f.x : f.x * sc;  // rounded to BF16 by the store
            x[e + 1] = fold ? f.y : f.y * sc;
          }
          store8_finite(dst + 8 * h, x);
        }
      } else {
        (void)sc, (void)fold;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);  // BF16 as stored
      }
    }
  };
  int pg[kPer];  // the pages of the next tile to fetch
  load_pages(0, pg);
  fetch(0, 0, pg);
  fetch(0, 1, pg);
  load_pages(kTile, pg);
  load_query_rows<D>(q, t, Hq, hk, G, sQ, S::kLd, tid);
  const float ks = kE4m3 ? k_scale[hk] : 1.0f, vs = kE4m3 ? v_scale[hk] : 1.0f;
  const bool fold = kE4m3 && fold_pow2 && foldable_pow2(ks) && foldable_pow2(vs);
  const float sl2 = fold ? __fmul_rn(scale * kLog2e, ks) : scale * kLog2e;
  float o[kNDw][4];  // this warp's output column tiles
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int64_t last[2] = {pos, pos};
  for (int k0 = 0; k0 <= pos; k0 += kTile) {
    const bool more = k0 + kTile <= pos, mask = k0 + kTile - 1 >= pos;
    cp_async_wait_all_but_newest();  // this thread's copies of the keys (the values' group may be in flight)
    __syncthreads();                 // every key byte landed; the last tile's reads of sT and sP are done
    convert(0, ks, fold);
    __syncthreads();  // the key tile is written; the key staging half is free
    if (more) fetch(k0 + kTile, 0, pg);
    else cp_async_commit();  // an empty group, so the waits count alike
    // Scores of this warp's keys (fwd_tile's column tiles warp * kNTw ..): Q K^T, scaled, masked.
    float sw[kNTw][4];
    zero(sw);
    mma_tile_times_t<kNTw, D>(sw, sQ, S::kLd, 0, sT + warp * kNTw * 8 * S::kLd, S::kLd, lane);  // its keys' rows
    float mx[2] = {-INFINITY, -INFINITY};
    scores_to_log2(sw, sl2, mask, k0 + warp * kNTw * 8, last, c, mx);
    quad_reduce(mx, [](float a, float b) { return fmaxf(a, b); });
    if (c == 0) sMx[warp * 16 + g] = mx[0], sMx[warp * 16 + g + 8] = mx[1];
    cp_async_wait_all_but_newest();  // this thread's copies of the values
    __syncthreads();                 // the warps' maxima, every value byte; the key tile's reads are done
    // The rows' maxima over the whole tile, then m, l and the output rescaled, as in fwd_tile.
    float t_mx[2], corr[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      t_mx[r] = sMx[g + 8 * r];
#pragma unroll
      for (int ow = 1; ow < kDecWarps; ++ow) t_mx[r] = fmaxf(t_mx[r], sMx[ow * 16 + g + 8 * r]);
    }
    if constexpr (kMerge) tile_base(t_mx, base);
    else online_max(m, l, t_mx, base, corr);
    // This warp's probabilities into sP, in fwd_tile's register layout [column tile][e][lane].
#pragma unroll
    for (int nt = 0; nt < kNTw; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sP[((warp * kNTw + nt) * 4 + e) * 32 + lane] = prob(sw[nt][e], base[e >> 1]);
    if constexpr (!kMerge) rescale(o, corr);
    convert(1, vs, fold);
    __syncthreads();  // the probabilities and the value tile are written; the value staging half is free
    if (more) fetch(k0 + kTile, 1, pg);
    else cp_async_commit();
    load_pages(k0 + 2 * kTile, pg);  // for the next tile's fetches, while this one's P V runs
    // The whole tile's probabilities in fwd_tile's registers: l in its order, then O += P V over
    // this warp's output column tiles (fwd_tile's k-loop over the keys).
    float p[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[nt][e] = sP[(nt * 4 + e) * 32 + lane];
    if constexpr (kMerge) {
      float lt[2] = {0.0f, 0.0f}, ot[kNDw][4];
      add_probs(p, lt);
      zero(ot);
      mma_regs_times(ot, p, sT + warp * kNDw * 8, S::kLd, lane);
      merge_tile(m, l, o, t_mx, base, lt, ot);
    } else {
      add_probs(p, l);
      mma_regs_times(o, p, sT + warp * kNDw * 8, S::kLd, lane);  // its output columns of the values
    }
  }
  // fwd_finish for this warp's columns: l summed over the quad, o / l as BF16.
  quad_reduce(l, [](float a, float b) { return __fadd_rn(a, b); });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (g + 8 * r >= G) continue;
    const float inv = fold ? __fmul_rn(1.0f / l[r], vs) : 1.0f / l[r];
    store_row(o, r, inv, reinterpret_cast<uint32_t*>(out + (t * Hq + hk * G + g + 8 * r) * D) + warp * kNDw * 4, c);
  }
}

// ---- decode in the tile-merge order, the tiles in parallel (E4M3 pools) -------------------------
// With the tile-merge order a tile's (mt, lt, ot) depends on that tile alone, so the four warps of
// a (token, KV head) CTA take a tile each (tiles w, w + 4, ...): each stages its tile's key and
// value codes by cp.async into its own part of shared memory, builds the MMA B fragments straight
// from the codes (code * scale rounded to BF16: the values the forward's ldmatrix reads from the
// trainer's kv_round-ed keys and values) and runs fwd_tile_merge's arithmetic over the whole
// tile — the same k-loops, the same fragments, so the same (mt, lt, ot) bits; then it issues the
// copies of its next tile into the stage (so they fly while the CTA merges) and leaves ot's rows
// of real heads (the first G of the 16 MMA rows), lt and mt in shared memory. After each round of
// four tiles the threads of those rows merge them in key order (merge_tile's steps; thread i
// holds row i / 8's output columns (i % 8) D / 8 .. and its l part i % 8 < 4; a row's bits never
// depend on another row's), and at the end l is summed over the four parts as quad_reduce pairs
// them. A token's serial chain is ceil(tiles / 4) rounds instead of one step per tile.
//
// The staged rows are swizzled (tile_off: 16-byte piece q of row j at q ^ swz(j)), so that the
// fragment loads — 8 rows x 4 lanes for the keys, 4 row pairs x 8 lanes for the values — fall in
// distinct banks; unswizzled, rows of 128 bytes put a key fragment's eight rows in one bank.
// ~70 KB of shared memory at head_dim 128 and group 2: three CTAs per SM.
__device__ __forceinline__ uint32_t e4m3_pair_bf16(uint32_t two, float sc) {
  const float2 f = fp8_e4m3x2_to_float2(two);  // the low byte is the lower column
  return pack_bf16(f.x * sc, f.y * sc);
}
// Byte b of staged row j (rows of D E4M3 codes): its 16-byte piece moved by the row's swizzle, the
// rows of one 128-byte line (D / 16 pieces each, 128 / D rows) counted as one.
template <int D>
__device__ __forceinline__ int tile_off(int j, int b) {
  constexpr int kPieces = D / 16, kRowsPerLine = 128 / D;
  const int swz = (j / kRowsPerLine) % kPieces;
  return j * D + ((((b >> 4) ^ swz) << 4) | (b & 15));
}
// load_b2's fragments (Q K^T: B stored [key][d]) from a staged tile of E4M3 rows.
template <int D>
__device__ __forceinline__ void load_b2_e4m3(uint32_t (&b)[2][2], const unsigned char* s, int n0, int k0, float sc,
                                             int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = n0 + 8 * j + g;
    b[j][0] = e4m3_pair_bf16(*reinterpret_cast<const uint16_t*>(s + tile_off<D>(r, k0 + 2 * c)), sc);
    b[j][1] = e4m3_pair_bf16(*reinterpret_cast<const uint16_t*>(s + tile_off<D>(r, k0 + 2 * c + 8)), sc);
  }
}
// load_b2_t's fragments (P V: B stored [key][d], read as [k][n]) from staged E4M3 rows: two keys'
// codes of one column per register.
template <int D>
__device__ __forceinline__ void load_b2_t_e4m3(uint32_t (&b)[2][2], const unsigned char* s, int n0, int k0, float sc,
                                               int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = k0 + 8 * i + 2 * c, col = n0 + 8 * j + g;
      b[j][i] = e4m3_pair_bf16(static_cast<uint32_t>(s[tile_off<D>(r, col)]) |
                                   (static_cast<uint32_t>(s[tile_off<D>(r + 1, col)]) << 8),
                               sc);
    }
}
template <int D>
struct DecTilesSmem {
  static constexpr int kLd = D + 8, kRowBytes = D, kChunks = D / 16, kPartLd = D + 8;
  // byte offsets: the query rows (BF16), each warp's stage (its tile's key codes, then its value
  // codes), the warps' lt [4][16][4] and mt [4][16], the final l parts [16][4], then each warp's
  // P V partial [G][kPartLd] F32 (its rows of real heads; the row stride spreads a column's rows
  // over banks)
  static constexpr size_t kWarpBytes = 2 * static_cast<size_t>(kTile) * kRowBytes;
  static constexpr size_t kQ = 0, kStage = kQ + 16 * kLd * 2, kLt = kStage + kDecWarps * kWarpBytes,
                          kMt = kLt + kDecWarps * 16 * 4 * 4, kL = kMt + kDecWarps * 16 * 4, kPart = kL + 16 * 4 * 4;
  static constexpr size_t bytes(int G) { return kPart + static_cast<size_t>(kDecWarps) * G * kPartLd * 4; }
  static_assert(kStage % 16 == 0 && kPart % 16 == 0, "16-byte aligned parts");
};

template <int D>
__global__ void __launch_bounds__(kDecWarps * 32, 3) flash_decode_tiles_kernel(
    const bf16* q, const int32_t* token_seq, const int32_t* token_pos, const int32_t* page_table, int max_pages,
    int64_t T_, int Hq, int Hkv, int page_size, const void* kpool, const void* vpool, const float* k_scale,
    const float* v_scale, float scale, int fold_pow2, bf16* out) {
  using S = DecTilesSmem<D>;
  constexpr int kNT = kTile / 8, kND = D / 8, kCols = D / 8;  // kCols: a merging thread's output columns
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const DecCta cta = dec_cta(token_seq, token_pos, page_table, max_pages, Hq, Hkv);
  const int64_t t = cta.t;
  const int hk = cta.hk, G = cta.G, pos = cta.pos;
  const int32_t* pages = cta.pages;
  (void)T_;
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw + S::kQ);
  unsigned char* stage = smem_raw + S::kStage + warp * S::kWarpBytes;
  float* sLt = reinterpret_cast<float*>(smem_raw + S::kLt);
  float* sMt = reinterpret_cast<float*>(smem_raw + S::kMt);
  float* sL = reinterpret_cast<float*>(smem_raw + S::kL);
  float* sPart = reinterpret_cast<float*>(smem_raw + S::kPart);  // [warp][G][kPartLd]
  const int n_tiles = pos / kTile + 1;
  // The key and value codes of `tile` into this warp's stage (swizzled rows, zeros past pos), as
  // one cp.async group.
  auto issue = [&](int tile) {
    const int k0 = tile * kTile;
    for (int i = lane; i < kTile * S::kChunks; i += 32) {
      const int j = i / S::kChunks, ch = i % S::kChunks, p = k0 + j;
      const bool ok = p <= pos;
      int64_t at = 0;
      if (ok) {
        const int pg = pages[p / page_size];
        const int64_t slot = static_cast<int64_t>(pg) * page_size + p % page_size;
        at = (slot * Hkv + hk) * S::kRowBytes + ch * 16;
      }
      const int off = tile_off<D>(j, ch * 16);
      cp_async16(stage + off, static_cast<const unsigned char*>(kpool) + at, ok);
      cp_async16(stage + kTile * S::kRowBytes + off, static_cast<const unsigned char*>(vpool) + at, ok);
    }
    cp_async_commit();
  };
  if (warp < n_tiles) issue(warp);
  load_query_rows<D>(q, t, Hq, hk, G, sQ, S::kLd, tid);
  const float ks = k_scale[hk], vs = v_scale[hk];
  const bool fold = fold_pow2 && foldable_pow2(ks) && foldable_pow2(vs);
  const float sl2 = fold ? __fmul_rn(scale * kLog2e, ks) : scale * kLog2e;
  const float ksc = fold ? 1.0f : ks, vsc = fold ? 1.0f : vs;
  const int mr = tid >> 3, mj = tid & 7;  // the merge's row and part
  float mo[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) mo[i] = 0.0f;
  float mm = -INFINITY, ml = 0.0f;
  const int64_t last[2] = {pos, pos};
  __syncthreads();  // the query rows
  for (int r0 = 0; r0 < n_tiles; r0 += kDecWarps) {
    const int tile = r0 + warp;
    if (tile < n_tiles) {
      const int k0 = tile * kTile;
      cp_async_wait_all();
      __syncwarp();  // every lane's codes landed
      float s[kNT][4];
      zero(s);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {  // mma_tile_times_t's loops
        uint32_t a[4];
        load_a(a, sQ, S::kLd, 0, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t b[2][2];
          load_b2_e4m3<D>(b, stage, np * 16, kk * 16, ksc, lane);
          mma_bf16(s[2 * np], a, b[0]);
          mma_bf16(s[2 * np + 1], a, b[1]);
        }
      }
      float mt[2] = {-INFINITY, -INFINITY};
      scores_to_log2(s, sl2, k0 + kTile - 1 >= pos, k0, last, c, mt);
      quad_reduce(mt, [](float x, float y) { return fmaxf(x, y); });
      float bt[2];
      tile_base(mt, bt);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = prob(s[nt][e], bt[e >> 1]);
      float lt[2] = {0.0f, 0.0f};
      add_probs(s, lt);
      float ot[kND][4];
      zero(ot);
#pragma unroll
      for (int kk = 0; kk < kNT / 2; ++kk) {  // mma_regs_times' loops
        uint32_t a[4];
        a_from_c(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < kND / 2; ++np) {
          uint32_t b[2][2];
          load_b2_t_e4m3<D>(b, stage + kTile * S::kRowBytes, np * 16, kk * 16, vsc, lane);
          mma_bf16(ot[2 * np], a, b[0]);
          mma_bf16(ot[2 * np + 1], a, b[1]);
        }
      }
      __syncwarp();  // every lane's reads of the codes are done: the stage takes the next tile's
      if (tile + kDecWarps < n_tiles) issue(tile + kDecWarps);
      float* po = sPart + warp * G * S::kPartLd;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h;
        if (row >= G) continue;
#pragma unroll
        for (int nt = 0; nt < kND; ++nt)
          *reinterpret_cast<float2*>(po + row * S::kPartLd + nt * 8 + 2 * c) = make_float2(ot[nt][2 * h], ot[nt][2 * h + 1]);
      }
      sLt[(warp * 16 + g) * 4 + c] = lt[0];
      sLt[(warp * 16 + g + 8) * 4 + c] = lt[1];
      if (c == 0) sMt[warp * 16 + g] = mt[0], sMt[warp * 16 + g + 8] = mt[1];
    }
    __syncthreads();  // the round's partials
    if (mr < G)
      for (int v = 0; v < kDecWarps && r0 + v < n_tiles; ++v) {  // merge_tile's steps, in key order
        const float mt = sMt[v * 16 + mr], bt = mt == -INFINITY ? 0.0f : mt;
        const float mn = fmaxf(mm, mt), bn = mn == -INFINITY ? 0.0f : mn;
        const float a = exp2f(__fsub_rn(mm, bn)), b = exp2f(__fsub_rn(bt, bn));
        mm = mn;
        if (mj < 4) ml = __fadd_rn(__fmul_rn(ml, a), __fmul_rn(sLt[(v * 16 + mr) * 4 + mj], b));
        const float* po = sPart + (v * G + mr) * S::kPartLd + mj * kCols;
#pragma unroll
        for (int i = 0; i < kCols; ++i) mo[i] = __fadd_rn(__fmul_rn(mo[i], a), __fmul_rn(po[i], b));
      }
    __syncthreads();  // the partials are read before the next round writes them
  }
  if (mj < 4) sL[mr * 4 + mj] = ml;
  __syncthreads();
  if (mr < G) {  // fwd_finish: l over the four parts as quad_reduce pairs them, o / l as BF16
    const float* lr = sL + mr * 4;
    const float l = __fadd_rn(__fadd_rn(lr[0], lr[1]), __fadd_rn(lr[2], lr[3]));
    const float inv = fold ? __fmul_rn(1.0f / l, vs) : 1.0f / l;
    uint32_t* d32 = reinterpret_cast<uint32_t*>(out + (t * Hq + hk * G + mr) * D + mj * kCols);
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) d32[i] = pack_bf16(__fmul_rn(mo[2 * i], inv), __fmul_rn(mo[2 * i + 1], inv));
  }
}

// ---- backward ---------------------------------------------------------------------------------
// delta[h * T + t] = sum_d dout * out (FP32), one warp per (t, h); [Hq, T] like lse, so that a
// query tile's values are contiguous. D: the output's head width (v's).
template <int D>
__global__ void flash_delta_kernel(const bf16* dout, const bf16* out, int64_t T_, int Hq, float* delta) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= T_ * Hq) return;
  float s = 0.0f;
  for (int d = lane * 2; d < D; d += 64) {
    const uint32_t a = *reinterpret_cast<const uint32_t*>(dout + w * D + d);
    const uint32_t b = *reinterpret_cast<const uint32_t*>(out + w * D + d);
    s += bf16_bits_to_float(a & 0xffffu) * bf16_bits_to_float(b & 0xffffu) +
         bf16_bits_to_float(a >> 16) * bf16_bits_to_float(b >> 16);
  }
  s = warp_sum(s);
  if (lane == 0) delta[(w % Hq) * T_ + w / Hq] = s;
}

// Shared memory of the dq kernel: the query and dout tiles, two stages of the key and value tiles
// (q and k rows D wide, dout and v rows DV wide).
template <int D, int DV = D>
struct DqSmem {
  static constexpr int kLd = D + 8, kLdV = DV + 8, kT = kTile * kLd, kTV = kTile * kLdV;
  static constexpr int kQ = 0, kG = kT, kKV = kT + kTV, kStage = kT + kTV;  // stage s: K at kKV + s kStage, V after
  static constexpr int kTotal = kKV + 2 * kStage;
  static constexpr size_t kBytes = static_cast<size_t>(kTotal) * sizeof(bf16);
};

// dq[t, h] = scale * sum_j p_tj (dp_tj - delta_t) k_j over the keys j <= t of t's sequence
// (q, k, dq [T, H*, D]; dout, v [T, H*, DV]).
template <int D, int DV = D>
__global__ void __launch_bounds__(kThreadsF) flash_dq_kernel(const bf16* dout, const bf16* q, const bf16* k,
                                                              const bf16* v, const float* lse, const float* delta,
                                                              const TileDesc* tiles, int Hq, int Hkv, int64_t T_,
                                                              float scale, bf16* dq) {
  using S = DqSmem<D, DV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16 *sQ = sm + S::kQ, *sG = sm + S::kG;
  const TileDesc td = tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (Hq / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t q0 = td.row0, seq_start = td.seq_start, seq_end = td.seq_end;
  const int64_t qstride = static_cast<int64_t>(Hq) * D, kstride = static_cast<int64_t>(Hkv) * D;
  const int64_t gstride = static_cast<int64_t>(Hq) * DV, vstride = static_cast<int64_t>(Hkv) * DV;
  const int64_t q_last = (q0 + kTile < seq_end ? q0 + kTile : seq_end) - 1;

  load_tile_async<kTile, D>(q + h * D, qstride, q0, seq_end, sQ, S::kLd);
  load_tile_async<kTile, DV>(dout + h * DV, gstride, q0, seq_end, sG, S::kLdV);
  load_tile_async<kTile, D>(k + hk * D, kstride, seq_start, seq_end, sm + S::kKV, S::kLd);
  load_tile_async<kTile, DV>(v + hk * DV, vstride, seq_start, seq_end, sm + S::kKV + S::kT, S::kLdV);
  cp_async_commit();
  const int64_t qrow0 = q0 + warp * 16 + g;
  float L2[2], Dl[2];  // lse in log2 units and delta of this thread's two rows (0 for rows past the end)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = qrow0 + 8 * r;
    const bool ok = row < seq_end;
    L2[r] = ok ? lse[static_cast<int64_t>(h) * T_ + row] * kLog2e : 0.0f;
    Dl[r] = ok ? delta[static_cast<int64_t>(h) * T_ + row] : 0.0f;
  }

  constexpr int kNd = D / 8;
  float acc[kNd][4];
  zero(acc);
  const float sl2 = scale * kLog2e;

  int stage = 0;
  for (int64_t k0 = seq_start; k0 <= q_last; k0 += kTile, stage ^= 1) {
    if (k0 + kTile <= q_last) {
      bf16* nk = sm + S::kKV + (stage ^ 1) * S::kStage;
      load_tile_async<kTile, D>(k + hk * D, kstride, k0 + kTile, seq_end, nk, S::kLd);
      load_tile_async<kTile, DV>(v + hk * DV, vstride, k0 + kTile, seq_end, nk + S::kT, S::kLdV);
    }
    cp_async_commit();
    cp_async_wait_all_but_newest();
    __syncthreads();
    const bf16* sK = sm + S::kKV + stage * S::kStage;
    const bf16* sV = sK + S::kT;

    float s[kTile / 8][4], dp[kTile / 8][4];
    zero(s);
    zero(dp);
    mma_tile_times_t<kTile / 8, D>(s, sQ, S::kLd, warp * 16, sK, S::kLd, lane);
    mma_tile_times_t<kTile / 8, DV>(dp, sG, S::kLdV, warp * 16, sV, S::kLdV, lane);
    // ds = p * (dp - delta) with p = exp(s * scale - lse), 0 past the diagonal or the sequence.
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int64_t key = k0 + nt * 8 + 2 * c + (e & 1), row = qrow0 + 8 * r;
        float p = exp2f(s[nt][e] * sl2 - L2[r]);
        if (key > row || row >= seq_end) p = 0.0f;
        s[nt][e] = p * (dp[nt][e] - Dl[r]);
      }
    mma_regs_times(acc, s, sK, S::kLd, lane);  // dq += ds K (K stored [key][d])
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = qrow0 + 8 * r;
    if (row >= seq_end) continue;
    uint32_t* dst = reinterpret_cast<uint32_t*>(dq + row * qstride + h * D);
#pragma unroll
    for (int nt = 0; nt < kNd; ++nt) dst[nt * 4 + c] = pack_bf16(acc[nt][2 * r] * scale, acc[nt][2 * r + 1] * scale);
  }
}

// Query rows per inner step of the dk/dv kernel (fewer for wider heads: register pressure).
template <int D>
constexpr int kDkvRows = D <= 64 ? 64 : D <= 128 ? 32 : 16;

// Shared memory of the dk/dv kernel: the key and value tiles, two stages of the query and dout
// tiles with their lse (F32) and delta (q and k rows D wide, dout and v rows DV wide).
template <int D, int DV = D>
struct DkvSmem {
  static constexpr int kBq = kDkvRows<D>;
  static constexpr int kLd = D + 8, kLdV = DV + 8, kT = kTile * kLd, kTq = kBq * kLd, kTg = kBq * kLdV;
  static constexpr int kK = 0, kV = kT, kQG = kT + kTile * kLdV;
  static constexpr int kStage = kTq + kTg;  // stage s: Q at kQG + s kStage, dout kTq after it
  static constexpr int kTotal = kQG + 2 * kStage;
  static constexpr size_t kBytes = static_cast<size_t>(kTotal) * sizeof(bf16) + 4 * kBq * sizeof(float);
};

// One block per (64-key tile, q head h): dv_h[j] = sum_{t >= j} p_tj dout_t and
// dk_h[j] = sum_t p_tj (dp_tj - delta_t) q_t (unscaled). Without GQA (one q head per kv head)
// they are the results: dk = scale * dk_h, dv = dv_h in BF16. With GQA the F32 partials of every
// q head go to part_k [T, Hq, D] / part_v [T, Hq, DV] and flash_dkv_reduce_kernel sums each group.
template <int D, int DV = D>
__global__ void __launch_bounds__(kThreadsF) flash_dkv_kernel(const bf16* dout, const bf16* q, const bf16* k,
                                                               const bf16* v, const float* lse, const float* delta,
                                                               const TileDesc* tiles, int Hq, int Hkv, int64_t T_,
                                                               float scale, bf16* dk, bf16* dv, float* part_k,
                                                               float* part_v) {
  using S = DkvSmem<D, DV>;
  constexpr int kBq = S::kBq;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16 *sK = sm + S::kK, *sV = sm + S::kV;
  float* sLD = reinterpret_cast<float*>(sm + S::kTotal);  // stage s: lse at sLD + 2 s kBq, delta after it
  const TileDesc td = tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (Hq / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t k0 = td.row0, seq_end = td.seq_end;
  const int64_t qstride = static_cast<int64_t>(Hq) * D, kstride = static_cast<int64_t>(Hkv) * D;
  const int64_t gstride = static_cast<int64_t>(Hq) * DV, vstride = static_cast<int64_t>(Hkv) * DV;
  const float* lse_h = lse + static_cast<int64_t>(h) * T_;
  const float* delta_h = delta + static_cast<int64_t>(h) * T_;

  // Stage st's query-side tiles: rows t0 .. t0 + kBq - 1.
  auto load_stage = [&](int st, int64_t t0) {
    bf16* sq = sm + S::kQG + st * S::kStage;
    load_tile_async<kBq, D>(q + h * D, qstride, t0, seq_end, sq, S::kLd);
    load_tile_async<kBq, DV>(dout + h * DV, gstride, t0, seq_end, sq + S::kTq, S::kLdV);
    const int i = threadIdx.x;
    if (i < 2 * kBq) {
      const int64_t t = t0 + i % kBq;
      const bool ok = t < seq_end;
      cp_async4(sLD + 2 * st * kBq + i, (i < kBq ? lse_h : delta_h) + (ok ? t : 0), ok);
    }
  };
  load_tile_async<kTile, D>(k + hk * D, kstride, k0, seq_end, sK, S::kLd);
  load_tile_async<kTile, DV>(v + hk * DV, vstride, k0, seq_end, sV, S::kLdV);
  load_stage(0, k0);
  cp_async_commit();

  constexpr int kNd = D / 8, kNdv = DV / 8, kNq = kBq / 8;
  float adk[kNd][4], adv[kNdv][4];
  zero(adk);
  zero(adv);
  const float sl2 = scale * kLog2e;
  const int64_t krow0 = k0 + warp * 16 + g;  // this thread's keys: krow0, krow0 + 8

  int stage = 0;
  for (int64_t t0 = k0; t0 < seq_end; t0 += kBq, stage ^= 1) {
    if (t0 + kBq < seq_end) load_stage(stage ^ 1, t0 + kBq);
    cp_async_commit();
    cp_async_wait_all_but_newest();
    __syncthreads();
    const bf16* sQ = sm + S::kQG + stage * S::kStage;
    const bf16* sG = sQ + S::kTq;
    const float* sL = sLD + 2 * stage * kBq;
    const float* sD = sL + kBq;

    // Transposed scores: st[key][query] = k . q, dpt[key][query] = v . dout.
    float st[kNq][4], dpt[kNq][4];
    zero(st);
    zero(dpt);
    mma_tile_times_t<kNq, D>(st, sK, S::kLd, warp * 16, sQ, S::kLd, lane);
    mma_tile_times_t<kNq, DV>(dpt, sV, S::kLdV, warp * 16, sG, S::kLdV, lane);
#pragma unroll
    for (int nt = 0; nt < kNq; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * c + (e & 1);
        const int64_t key = krow0 + 8 * (e >> 1), t = t0 + col;
        float p = exp2f(st[nt][e] * sl2 - sL[col] * kLog2e);
        if (key > t || t >= seq_end) p = 0.0f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - sD[col]);
      }
    mma_regs_times(adv, st, sG, S::kLdV, lane);  // dv += p^T dout
    mma_regs_times(adk, dpt, sQ, S::kLd, lane);  // dk += ds^T q
    __syncthreads();
  }
  const bool grouped = Hq != Hkv;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = krow0 + 8 * r;
    if (key >= seq_end) continue;
    if (grouped) {
      float2* pk = reinterpret_cast<float2*>(part_k + (key * Hq + h) * D);
      float2* pv = reinterpret_cast<float2*>(part_v + (key * Hq + h) * DV);
#pragma unroll
      for (int nt = 0; nt < kNd; ++nt) pk[nt * 4 + c] = make_float2(adk[nt][2 * r], adk[nt][2 * r + 1]);
#pragma unroll
      for (int nt = 0; nt < kNdv; ++nt) pv[nt * 4 + c] = make_float2(adv[nt][2 * r], adv[nt][2 * r + 1]);
    } else {
      uint32_t* pk = reinterpret_cast<uint32_t*>(dk + key * kstride + hk * D);
      uint32_t* pv = reinterpret_cast<uint32_t*>(dv + key * vstride + hk * DV);
#pragma unroll
      for (int nt = 0; nt < kNd; ++nt) pk[nt * 4 + c] = pack_bf16(adk[nt][2 * r] * scale, adk[nt][2 * r + 1] * scale);
#pragma unroll
      for (int nt = 0; nt < kNdv; ++nt) pv[nt * 4 + c] = pack_bf16(adv[nt][2 * r], adv[nt][2 * r + 1]);
    }
  }
}

// dk[t, hk] = scale * sum_{h in hk's group} part_k[t, h] (D wide), dv likewise (unscaled, DV
// wide), in head order; four consecutive elements of one (t, hk) of dk, then of dv, per thread.
__global__ void flash_dkv_reduce_kernel(const float* part_k, const float* part_v, int64_t T_, int Hq, int Hkv, int D,
                                        int DV, float scale, bf16* dk, bf16* dv) {
  const int group = Hq / Hkv, quads = (D + DV) / 4;
  const int64_t n = T_ * Hkv * quads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / quads;  // t * Hkv + hk
    int d = static_cast<int>(i % quads) * 4;
    const bool is_v = d >= D;
    if (is_v) d -= D;
    const int W = is_v ? DV : D;
    const float* part = is_v ? part_v : part_k;
    const float f = is_v ? 1.0f : scale;
    const int64_t t = row / Hkv, hk = row % Hkv;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int hg = 0; hg < group; ++hg) {
      const float4 a = *reinterpret_cast<const float4*>(part + (t * Hq + hk * group + hg) * W + d);
      sum[0] += a.x, sum[1] += a.y, sum[2] += a.z, sum[3] += a.w;
    }
    uint32_t* p = reinterpret_cast<uint32_t*>((is_v ? dv : dk) + row * W + d);
    p[0] = pack_bf16(sum[0] * f, sum[1] * f);
    p[1] = pack_bf16(sum[2] * f, sum[3] * f);
  }
}

template <class K>
void set_smem(K kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "raising the flash attention kernel's shared memory limit");
}

// FP8RL_FLASH_ORDER=merge (read per call, for experiments and the tests' A/B): the forward and the
// flash-order decode in the tile-merge order (merge_tile) instead of the online softmax's.
// merge_coop: the same order with E4M3 pools on the cooperative decode (flash_decode_kernel<..., true>)
// instead of the tile-parallel one (flash_decode_tiles_kernel): the same bits, for timing A/B.
enum class FlashOrder { kOnline, kMerge, kMergeCoop };
FlashOrder flash_order() {
  const char* e = std::getenv("FP8RL_FLASH_ORDER");
  const std::string v = e ? e : "";
  return v == "merge" ? FlashOrder::kMerge : v == "merge_coop" ? FlashOrder::kMergeCoop : FlashOrder::kOnline;
}

template <int D, int DV = D>
void flash_fwd(const bf16* q, const bf16* k, const bf16* v, const TileDesc* tiles, int num_tiles, int64_t T_, int Hq,
               int Hkv, float scale, bf16* out, float* lse, cudaStream_t stream) {
  const size_t bytes = FwdSmem<D, DV>::kBytes;
  auto run = [&](auto kern) {
    set_smem(kern, bytes);
    kern<<<dim3(num_tiles, Hq), kThreadsF, bytes, stream>>>(q, k, v, tiles, Hq, Hkv, T_, scale, out, lse);
  };
  if (flash_order() != FlashOrder::kOnline) run(flash_fwd_kernel<D, true, DV>);
  else run(flash_fwd_kernel<D, false, DV>);
  CUDA_CHECK_LAUNCH("flash_fwd_kernel");
}

// The F32 work area of the backward: delta [Hq, T], then with GQA the dk / dv partials [T, Hq, D]
// and [T, Hq, DV].
int64_t delta_floats(int64_t T_, int Hq) { return (T_ * Hq + 3) / 4 * 4; }

template <int D, int DV = D>
void flash_bwd(const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
               const TileDesc* tiles_q, const TileDesc* tiles_k, int num_tiles, int64_t T_, int Hq, int Hkv,
               float scale, bf16* dq, bf16* dk, bf16* dv, float* work, cudaStream_t stream) {
  const int64_t rows = T_ * Hq;
  float* delta = work;
  float* part_k = work + delta_floats(T_, Hq);
  float* part_v = part_k + rows * D;
  flash_delta_kernel<DV><<<static_cast<unsigned>(ceil_div(rows, 8)), 256, 0, stream>>>(dout, out, T_, Hq, delta);
  CUDA_CHECK_LAUNCH("flash_delta_kernel");
  set_smem(flash_dq_kernel<D, DV>, DqSmem<D, DV>::kBytes);
  flash_dq_kernel<D, DV><<<dim3(num_tiles, Hq), kThreadsF, DqSmem<D, DV>::kBytes, stream>>>(
      dout, q, k, v, lse, delta, tiles_q, Hq, Hkv, T_, scale, dq);
  CUDA_CHECK_LAUNCH("flash_dq_kernel");
  set_smem(flash_dkv_kernel<D, DV>, DkvSmem<D, DV>::kBytes);
  flash_dkv_kernel<D, DV><<<dim3(num_tiles, Hq), kThreadsF, DkvSmem<D, DV>::kBytes, stream>>>(
      dout, q, k, v, lse, delta, tiles_k, Hq, Hkv, T_, scale, dk, dv, part_k, part_v);
  CUDA_CHECK_LAUNCH("flash_dkv_kernel");
  if (Hq != Hkv) {
    const int64_t n = T_ * Hkv * (D + DV) / 4;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 8192));
    flash_dkv_reduce_kernel<<<blocks, 256, 0, stream>>>(part_k, part_v, T_, Hq, Hkv, D, DV, scale, dk, dv);
    CUDA_CHECK_LAUNCH("flash_dkv_reduce_kernel");
  }
}

}  // namespace

bool flash_attention_supported(DType dt, int hd, int hdv) {
  return dt == DType::BF16 && ((hd == hdv && (hd == 64 || hd == 128)) || (hd == 192 && hdv == 128));
}

int64_t flash_attention_backward_work(int64_t T, int Hq, int Hkv, int hd, int hdv) {
  return delta_floats(T, Hq) + (Hq != Hkv ? T * Hq * (hd + hdv) : 0);
}

std::vector<int32_t> flash_attention_tiles(const std::vector<int32_t>& cu_seqlens) {
  std::vector<TileDesc> q_tiles;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b)
    for (int32_t r = cu_seqlens[b]; r < cu_seqlens[b + 1]; r += kTile)
      q_tiles.push_back({r, cu_seqlens[b], cu_seqlens[b + 1], 0});
  // Longest blocks first. Query tiles (forward, dq) work up to their diagonal; key tiles
  // (dk/dv) from theirs to the end of the sequence.
  std::vector<TileDesc> k_tiles = q_tiles;
  std::stable_sort(q_tiles.begin(), q_tiles.end(),
                   [](const TileDesc& a, const TileDesc& b) { return a.row0 - a.seq_start > b.row0 - b.seq_start; });
  std::stable_sort(k_tiles.begin(), k_tiles.end(),
                   [](const TileDesc& a, const TileDesc& b) { return a.seq_end - a.row0 > b.seq_end - b.row0; });
  std::vector<int32_t> out;
  out.reserve(8 * q_tiles.size());
  for (const auto* list : {&q_tiles, &k_tiles})
    for (const TileDesc& t : *list) out.insert(out.end(), {t.row0, t.seq_start, t.seq_end, t.pad});
  return out;
}

namespace {
void check_flash_args(const void* const* ptrs, int n, int Hq, int Hkv, int num_tiles) {
  for (int i = 0; i < n; ++i)
    FP8RL_CHECK(reinterpret_cast<uintptr_t>(ptrs[i]) % 16 == 0,
                "flash attention: tensors must be 16-byte aligned (use FP8RL_CUDA_ATTENTION=simple for views)");
  FP8RL_CHECK(Hq <= 65535 && Hkv <= 65535 && num_tiles >= 0, "flash attention: too many heads (", Hq, ")");
}
}  // namespace

void launch_flash_attention(const void* q, const void* k, const void* v, const int32_t* tiles, int num_tiles,
                            int64_t T_, int Hq, int Hkv, int hd, int hdv, float scale, void* out, float* lse,
                            cudaStream_t stream) {
  if (T_ == 0 || num_tiles == 0) return;
  const void* ptrs[] = {q, k, v, out};
  check_flash_args(ptrs, 4, Hq, Hkv, num_tiles);
  const auto* td = reinterpret_cast<const TileDesc*>(tiles);
  auto cq = static_cast<const bf16*>(q), ck = static_cast<const bf16*>(k), cv = static_cast<const bf16*>(v);
  FP8RL_CHECK(flash_attention_supported(DType::BF16, hd, hdv), "flash attention: head dims (", hd, ", ", hdv,
              ") must be (64, 64), (128, 128) or (192, 128)");
  bf16* o = static_cast<bf16*>(out);
  if (hd == 64) flash_fwd<64>(cq, ck, cv, td, num_tiles, T_, Hq, Hkv, scale, o, lse, stream);
  else if (hd == 128) flash_fwd<128>(cq, ck, cv, td, num_tiles, T_, Hq, Hkv, scale, o, lse, stream);
  else flash_fwd<192, 128>(cq, ck, cv, td, num_tiles, T_, Hq, Hkv, scale, o, lse, stream);
}

void launch_flash_attention_backward(const void* dout, const void* q, const void* k, const void* v, const void* out,
                                     const float* lse, const int32_t* tiles, int num_tiles, int64_t T_, int Hq,
                                     int Hkv, int hd, int hdv, float scale, void* dq, void* dk, void* dv, float* work,
                                     cudaStream_t stream) {
  if (T_ == 0 || num_tiles == 0) return;
  const void* ptrs[] = {dout, q, k, v, out, dq, dk, dv};
  check_flash_args(ptrs, 8, Hq, Hkv, num_tiles);
  const auto* tq = reinterpret_cast<const TileDesc*>(tiles);
  const TileDesc* tk = tq + num_tiles;
  auto g = static_cast<const bf16*>(dout), cq = static_cast<const bf16*>(q), ck = static_cast<const bf16*>(k),
       cv = static_cast<const bf16*>(v), co = static_cast<const bf16*>(out);
  auto pq = static_cast<bf16*>(dq), pk = static_cast<bf16*>(dk), pv = static_cast<bf16*>(dv);
  FP8RL_CHECK(flash_attention_supported(DType::BF16, hd, hdv), "flash attention: head dims (", hd, ", ", hdv,
              ") must be (64, 64), (128, 128) or (192, 128)");
  if (hd == 64) flash_bwd<64>(g, cq, ck, cv, co, lse, tq, tk, num_tiles, T_, Hq, Hkv, scale, pq, pk, pv, work, stream);
  else if (hd == 128) flash_bwd<128>(g, cq, ck, cv, co, lse, tq, tk, num_tiles, T_, Hq, Hkv, scale, pq, pk, pv, work, stream);
  else flash_bwd<192, 128>(g, cq, ck, cv, co, lse, tq, tk, num_tiles, T_, Hq, Hkv, scale, pq, pk, pv, work, stream);
}

bool flash_decode_supported(int hd, int group, DType pool_dt, DType qdt) {
  return qdt == DType::BF16 && (hd == 64 || hd == 128) && group >= 1 && group <= 16 &&
         (pool_dt == DType::BF16 || pool_dt == DType::E4M3);
}

void launch_flash_decode(const void* q, const int32_t* token_seq, const int32_t* token_pos, const int32_t* page_table,
                         int max_pages, int64_t T_, int Hq, int Hkv, int hd, int page_size, const void* kpool,
                         const void* vpool, DType pool_dt, const float* k_scale, const float* v_scale, float scale,
                         void* out, cudaStream_t stream) {
  if (T_ == 0) return;
  FP8RL_CHECK(Hkv > 0 && Hq % Hkv == 0 && flash_decode_supported(hd, Hq / Hkv, pool_dt, DType::BF16),
              "flash-order decode attention: unsupported case: pool ", dtype_name(pool_dt), ", head_dim ", hd,
              ", group ", Hq / std::max(Hkv, 1), " (needs a BF16 or E4M3 pool, head_dim 64 or 128, group <= 16)");
  FP8RL_CHECK(page_size > 0 && max_pages > 0, "flash-order decode attention: page size ", page_size, " and ",
              max_pages, " pages per sequence must be positive");
  const void* ptrs[] = {q, kpool, vpool, out};
  check_flash_args(ptrs, 4, Hq, Hkv, 0);
  const int64_t warps = T_ * Hkv;
  FP8RL_CHECK(warps < (int64_t(1) << 31), "flash-order decode attention: T * Hkv = ", warps, " too large");
  const unsigned grid = static_cast<unsigned>(warps);
  // The shared-memory opt-in once per kernel variant and device (the first call may precede a
  // graph capture of the decode step; the setting is the function's, not the stream's).
  static std::once_flag opted[10][64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev), "flash-order decode attention: cudaGetDevice");
  // Power-of-two E4M3 scales (precision.pow2_scales calibrates the KV scales so) are folded into
  // the score multiplier and 1 / l, bitwise the unfolded arithmetic (GPU-tested both ways);
  // FP8RL_FLASH_DECODE_FOLD=0 turns that off (read per call, for the tests' and a bench's A/B).
  const char* fe = std::getenv("FP8RL_FLASH_DECODE_FOLD");
  const int fold = fe && std::string(fe) == "0" ? 0 : 1;
  auto run = [&](auto kern, size_t bytes, int variant, size_t opt_in = 0) {
    std::call_once(opted[variant][dev >= 0 && dev < 64 ? dev : 0], [&] { set_smem(kern, std::max(bytes, opt_in)); });
    kern<<<grid, kDecWarps * 32, bytes, stream>>>(static_cast<const bf16*>(q), token_seq, token_pos, page_table, max_pages, T_, Hq,
                                      Hkv, page_size, kpool, vpool, k_scale, v_scale, scale, fold,
                                      static_cast<bf16*>(out));
  };
  const bool e4m3 = pool_dt == DType::E4M3;
  const FlashOrder order = flash_order();
  if (e4m3 && order == FlashOrder::kMerge) {
    // shared memory by the group (the partials' rows), opted in once for the largest (16)
    hd == 64 ? run(flash_decode_tiles_kernel<64>, DecTilesSmem<64>::bytes(Hq / Hkv), 8, DecTilesSmem<64>::bytes(16))
             : run(flash_decode_tiles_kernel<128>, DecTilesSmem<128>::bytes(Hq / Hkv), 9, DecTilesSmem<128>::bytes(16));
  } else if (order != FlashOrder::kOnline) {
    if (hd == 64)
      e4m3 ? run(flash_decode_kernel<64, true, true>, DecSmem<64, true>::kBytes, 4)
           : run(flash_decode_kernel<64, false, true>, DecSmem<64, false>::kBytes, 5);
    else
      e4m3 ? run(flash_decode_kernel<128, true, true>, DecSmem<128, true>::kBytes, 6)
           : run(flash_decode_kernel<128, false, true>, DecSmem<128, false>::kBytes, 7);
  } else if (hd == 64) {
    e4m3 ? run(flash_decode_kernel<64, true>, DecSmem<64, true>::kBytes, 0)
         : run(flash_decode_kernel<64, false>, DecSmem<64, false>::kBytes, 1);
  } else {
    e4m3 ? run(flash_decode_kernel<128, true>, DecSmem<128, true>::kBytes, 2)
         : run(flash_decode_kernel<128, false>, DecSmem<128, false>::kBytes, 3);
  }
  CUDA_CHECK_LAUNCH("flash_decode_kernel");
}

}  // namespace fp8rl::cuda
