// Tensor-core flash attention (FlashAttention-2 structure) for BF16 activations, head_dim 64
// or 128: causal GQA over packed sequences. mma.sync m16n8k16 (BF16 in, FP32 accumulate) on
// operands staged in shared memory; the softmax, the rescaling and the masks run in FP32 on
// the accumulator registers.
//   forward:  one block per (64-query tile, q head); 4 warps x 16 query rows; loop over the
//             64-key tiles up to the diagonal with an online softmax; writes out and lse.
//   backward: delta = rowsum(dout * out); dq: one block per (64-query tile, q head), P and dP
//             recomputed from lse; dk/dv: one block per (64-key tile, kv head), looping over the
//             heads of the group and the query tiles at or after the key tile. No atomics.
// Tiles never cross a sequence: they start at the sequence's first token (host tile lists).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "quant/quant.h"  // ceil_div

namespace fp8rl::cuda {

namespace {

constexpr int kTile = kFlashTile;  // queries (forward, dq) or keys (dk/dv) per block
constexpr int kWarpsF = 4;         // 16 rows per warp
constexpr int kThreadsF = kWarpsF * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- warp-level mma.sync helpers -----------------------------------------------------------
// Fragments of mma.m16n8k16.row.col (PTX ISA): with g = lane / 4, c = lane % 4,
//   A (16x16, row-major): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//   B (16x8):            b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]
//   C (16x8, FP32):      c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1]
// Shared tiles are BF16 row-major with a padded leading dimension (a multiple of 8 elements).

__device__ __forceinline__ uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A rows r0..r0+15, columns k0..k0+15 of a row-major [rows][ld] tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* s, int ld, int r0, int k0, int g, int c) {
  const bf16* p = s + (r0 + g) * ld + k0 + 2 * c;
  a[0] = lds32(p);
  a[1] = lds32(p + 8 * ld);
  a[2] = lds32(p + 8);
  a[3] = lds32(p + 8 * ld + 8);
}
// B (k0..k0+15) x (n0..n0+7) read from a tile stored as [n][k] (row n holds B's column n).
__device__ __forceinline__ void load_b(uint32_t (&b)[2], const bf16* s, int ld, int n0, int k0, int g, int c) {
  const bf16* p = s + (n0 + g) * ld + k0 + 2 * c;
  b[0] = lds32(p);
  b[1] = lds32(p + 8);
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Two FP32 values as a BF16 pair (lo at the lower column), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(bf16_bits_from_float(lo)) | (static_cast<uint32_t>(bf16_bits_from_float(hi)) << 16);
}
// The A fragment (16 rows x 16 columns kk*16..) from C-layout accumulators x[2kk], x[2kk+1].
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&x0)[4], const float (&x1)[4]) {
  a[0] = pack_bf16(x0[0], x0[1]);
  a[1] = pack_bf16(x0[2], x0[3]);
  a[2] = pack_bf16(x1[0], x1[1]);
  a[3] = pack_bf16(x1[2], x1[3]);
}

// acc[nt] (C layout, ND tiles of 8 columns) += P Bt^T: P is the [16, kTile] score block held as
// C-layout accumulators p[kTile / 8] (rounded to BF16 A fragments), Bt a [ND*8, ld] shared tile.
template <int ND>
__device__ __forceinline__ void mma_scores_times(float (&acc)[ND][4], const float (&p)[kTile / 8][4],
                                                 const bf16* Bt, int ld, int g, int c) {
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    uint32_t a[4];
    a_from_c(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
    for (int nt = 0; nt < ND; ++nt) {
      uint32_t b[2];
      load_b(b, Bt, ld, nt * 8, kk * 16, g, c);
      mma_bf16(acc[nt], a, b);
    }
  }
}

// Rows row0 .. row0 + NR - 1 of a [*, stride] BF16 global array (columns 0..D-1 of each row at
// src + row * stride) into a row-major shared tile [NR][ld]; rows >= row_end are zero. With
// dst_t, also the transpose [D][ld_t]. 16-byte loads (the caller checks the alignment).
// Without a transpose a warp reads whole rows (coalesced); with one, a warp takes one 8-column
// chunk of 32 consecutive rows, so that its transposed 2-byte stores hit consecutive addresses
// (an 8-way bank conflict otherwise).
template <int NR, int D>
__device__ __forceinline__ void load_tile(const bf16* src, int64_t stride, int64_t row0, int64_t row_end, bf16* dst,
                                          int ld, bf16* dst_t, int ld_t) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < NR * kChunks; i += kThreadsF) {
    const int r = dst_t ? i % NR : i / kChunks, ch = dst_t ? i / NR : i % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row0 + r < row_end) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride + ch * 8);
    if (dst) *reinterpret_cast<uint4*>(dst + r * ld + ch * 8) = v;
    if (dst_t) {
      const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
      for (int j = 0; j < 8; ++j) dst_t[(ch * 8 + j) * ld_t + r] = e[j];
    }
  }
}

// Tile descriptor (host lists): first row of the tile, first and one-past-last token of its
// sequence.
struct TileDesc {
  int32_t row0, seq_start, seq_end, pad;
};

// ---- forward ----------------------------------------------------------------------------------
template <int D>
struct FwdSmem {
  static constexpr int kLd = D + 8, kLdT = kTile + 8;
  static constexpr int kQ = 0, kK = kQ + kTile * kLd, kVt = kK + kTile * kLd, kTotal = kVt + D * kLdT;
  static constexpr size_t kBytes = static_cast<size_t>(kTotal) * sizeof(bf16);
};

// q [T, Hq, D], k/v [T, Hkv, D], out [T, Hq, D] BF16; lse F32 [Hq, T].
template <int D>
__global__ void __launch_bounds__(kThreadsF) flash_fwd_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                               const TileDesc* tiles, int Hq, int Hkv, int64_t T_,
                                                               float scale, bf16* out, float* lse) {
  using S = FwdSmem<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16 *sQ = sm + S::kQ, *sK = sm + S::kK, *sVt = sm + S::kVt;
  const TileDesc td = tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (Hq / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t q0 = td.row0, seq_start = td.seq_start, seq_end = td.seq_end;
  const int64_t qstride = static_cast<int64_t>(Hq) * D, kstride = static_cast<int64_t>(Hkv) * D;

  load_tile<kTile, D>(q + h * D, qstride, q0, seq_end, sQ, S::kLd, nullptr, 0);

  constexpr int kNd = D / 8;  // n-tiles over head_dim
  float o[kNd][4];
#pragma unroll
  for (int i = 0; i < kNd; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = scale * kLog2e;
  const int64_t qrow0 = q0 + warp * 16 + g;  // this thread's rows: qrow0, qrow0 + 8
  const int64_t q_last = (q0 + kTile < seq_end ? q0 + kTile : seq_end) - 1;

  for (int64_t k0 = seq_start; k0 <= q_last; k0 += kTile) {
    __syncthreads();  // previous tile's readers are done
    load_tile<kTile, D>(k + hk * D, kstride, k0, seq_end, sK, S::kLd, nullptr, 0);
    load_tile<kTile, D>(v + hk * D, kstride, k0, seq_end, nullptr, 0, sVt, S::kLdT);
    __syncthreads();

    float s[kTile / 8][4];
#pragma unroll
    for (int i = 0; i < kTile / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sQ, S::kLd, warp * 16, kk * 16, g, c);
#pragma unroll
      for (int nt = 0; nt < kTile / 8; ++nt) {
        uint32_t b[2];
        load_b(b, sK, S::kLd, nt * 8, kk * 16, g, c);
        mma_bf16(s[nt], a, b);
      }
    }
    // Scale to log2 units, causal mask (keys past the row; only the diagonal tile has any).
    const bool diag = k0 + kTile - 1 > q0;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * sl2;
        if (diag) {
          const int64_t key = k0 + nt * 8 + 2 * c + (e & 1), row = qrow0 + (e >> 1) * 8;
          if (key > row) x = -INFINITY;
        }
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float corr[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mn = fmaxf(m[r], mx[r]);
      base[r] = mn == -INFINITY ? 0.0f : mn;
      corr[r] = exp2f(m[r] - base[r]);  // 0 on the first tile (m = -inf)
      m[r] = mn;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[nt][e] - base[e >> 1]);
        s[nt][e] = p;
        l[e >> 1] += p;
      }
#pragma unroll
    for (int i = 0; i < kNd; ++i) {
      o[i][0] *= corr[0];
      o[i][1] *= corr[0];
      o[i][2] *= corr[1];
      o[i][3] *= corr[1];
    }
    // O += P V (P as BF16 A fragments straight from the score registers).
    mma_scores_times(o, s, sVt, S::kLdT, g, c);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = qrow0 + 8 * r;
    if (row >= seq_end) continue;
    const float inv = 1.0f / l[r];
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + row * qstride + h * D);
#pragma unroll
    for (int nt = 0; nt < kNd; ++nt) dst[nt * 4 + c] = pack_bf16(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
    if (c == 0) lse[static_cast<int64_t>(h) * T_ + row] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// ---- backward ---------------------------------------------------------------------------------
// delta[t * Hq + h] = sum_d dout * out (FP32), one warp per (t, h).
template <int D>
__global__ void flash_delta_kernel(const bf16* dout, const bf16* out, int64_t rows, float* delta) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= rows) return;
  float s = 0.0f;
  for (int d = lane * 2; d < D; d += 64) {
    const uint32_t a = *reinterpret_cast<const uint32_t*>(dout + w * D + d);
    const uint32_t b = *reinterpret_cast<const uint32_t*>(out + w * D + d);
    s += bf16_bits_to_float(a & 0xffffu) * bf16_bits_to_float(b & 0xffffu) +
         bf16_bits_to_float(a >> 16) * bf16_bits_to_float(b >> 16);
  }
  s = warp_sum(s);
  if (lane == 0) delta[w] = s;
}

template <int D>
struct DqSmem {
  static constexpr int kLd = D + 8, kLdT = kTile + 8;
  static constexpr int kQ = 0, kG = kQ + kTile * kLd, kK = kG + kTile * kLd, kV = kK + kTile * kLd,
                       kKt = kV + kTile * kLd, kTotal = kKt + D * kLdT;
  static constexpr size_t kBytes = static_cast<size_t>(kTotal) * sizeof(bf16);
};

// dq[t, h] = scale * sum_j p_tj (dp_tj - delta_t) k_j over the keys j <= t of t's sequence.
template <int D>
__global__ void __launch_bounds__(kThreadsF) flash_dq_kernel(const bf16* dout, const bf16* q, const bf16* k,
                                                              const bf16* v, const float* lse, const float* delta,
                                                              const TileDesc* tiles, int Hq, int Hkv, int64_t T_,
                                                              float scale, bf16* dq) {
  using S = DqSmem<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16 *sQ = sm + S::kQ, *sG = sm + S::kG, *sK = sm + S::kK, *sV = sm + S::kV, *sKt = sm + S::kKt;
  const TileDesc td = tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (Hq / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t q0 = td.row0, seq_start = td.seq_start, seq_end = td.seq_end;
  const int64_t qstride = static_cast<int64_t>(Hq) * D, kstride = static_cast<int64_t>(Hkv) * D;

  load_tile<kTile, D>(q + h * D, qstride, q0, seq_end, sQ, S::kLd, nullptr, 0);
  load_tile<kTile, D>(dout + h * D, qstride, q0, seq_end, sG, S::kLd, nullptr, 0);
  const int64_t qrow0 = q0 + warp * 16 + g;
  float L2[2], Dl[2];  // lse in log2 units and delta of this thread's two rows (0 for rows past the end)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = qrow0 + 8 * r;
    const bool ok = row < seq_end;
    L2[r] = ok ? lse[static_cast<int64_t>(h) * T_ + row] * kLog2e : 0.0f;
    Dl[r] = ok ? delta[row * Hq + h] : 0.0f;
  }

  constexpr int kNd = D / 8;
  float acc[kNd][4];
#pragma unroll
  for (int i = 0; i < kNd; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  const float sl2 = scale * kLog2e;
  const int64_t q_last = (q0 + kTile < seq_end ? q0 + kTile : seq_end) - 1;

  for (int64_t k0 = seq_start; k0 <= q_last; k0 += kTile) {
    __syncthreads();
    load_tile<kTile, D>(k + hk * D, kstride, k0, seq_end, sK, S::kLd, sKt, S::kLdT);
    load_tile<kTile, D>(v + hk * D, kstride, k0, seq_end, sV, S::kLd, nullptr, 0);
    __syncthreads();

    float s[kTile / 8][4], dp[kTile / 8][4];
#pragma unroll
    for (int i = 0; i < kTile / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ag[4];
      load_a(aq, sQ, S::kLd, warp * 16, kk * 16, g, c);
      load_a(ag, sG, S::kLd, warp * 16, kk * 16, g, c);
#pragma unroll
      for (int nt = 0; nt < kTile / 8; ++nt) {
        uint32_t b[2];
        load_b(b, sK, S::kLd, nt * 8, kk * 16, g, c);
        mma_bf16(s[nt], aq, b);
        load_b(b, sV, S::kLd, nt * 8, kk * 16, g, c);
        mma_bf16(dp[nt], ag, b);
      }
    }
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
    mma_scores_times(acc, s, sKt, S::kLdT, g, c);
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

// Query rows per inner step of the dk/dv kernel (fewer for head_dim 128: register pressure).
template <int D>
constexpr int kDkvRows = D <= 64 ? 64 : 32;

template <int D>
struct DkvSmem {
  static constexpr int kBq = kDkvRows<D>;
  static constexpr int kLd = D + 8, kLdT = kBq + 8;
  static constexpr int kK = 0, kV = kK + kTile * kLd, kQ = kV + kTile * kLd, kG = kQ + kBq * kLd,
                       kQt = kG + kBq * kLd, kGt = kQt + D * kLdT, kTotal = kGt + D * kLdT;
  static constexpr size_t kBytes = static_cast<size_t>(kTotal) * sizeof(bf16) + 2 * kBq * sizeof(float);
};

// dv[j, hk] = sum_{h in group, t >= j} p_tj dout_t ; dk[j, hk] = scale * sum p_tj (dp_tj - delta_t) q_t.
template <int D>
__global__ void __launch_bounds__(kThreadsF) flash_dkv_kernel(const bf16* dout, const bf16* q, const bf16* k,
                                                               const bf16* v, const float* lse, const float* delta,
                                                               const TileDesc* tiles, int Hq, int Hkv, int64_t T_,
                                                               float scale, bf16* dk, bf16* dv) {
  using S = DkvSmem<D>;
  constexpr int kBq = S::kBq;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16 *sK = sm + S::kK, *sV = sm + S::kV, *sQ = sm + S::kQ, *sG = sm + S::kG, *sQt = sm + S::kQt,
       *sGt = sm + S::kGt;
  float* sL = reinterpret_cast<float*>(sm + S::kTotal);  // [kBq] lse * log2e
  float* sD = sL + kBq;                                    // [kBq] delta
  const TileDesc td = tiles[blockIdx.x];
  const int hk = blockIdx.y, group = Hq / Hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t k0 = td.row0, seq_end = td.seq_end;
  const int64_t qstride = static_cast<int64_t>(Hq) * D, kstride = static_cast<int64_t>(Hkv) * D;

  load_tile<kTile, D>(k + hk * D, kstride, k0, seq_end, sK, S::kLd, nullptr, 0);
  load_tile<kTile, D>(v + hk * D, kstride, k0, seq_end, sV, S::kLd, nullptr, 0);

  constexpr int kNd = D / 8, kNq = kBq / 8;
  float adk[kNd][4], adv[kNd][4];
#pragma unroll
  for (int i = 0; i < kNd; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) adk[i][e] = adv[i][e] = 0.0f;
  const float sl2 = scale * kLog2e;
  const int64_t krow0 = k0 + warp * 16 + g;  // this thread's keys: krow0, krow0 + 8

  for (int hg = 0; hg < group; ++hg) {
    const int h = hk * group + hg;
    for (int64_t t0 = k0; t0 < seq_end; t0 += kBq) {
      __syncthreads();
      load_tile<kBq, D>(q + h * D, qstride, t0, seq_end, sQ, S::kLd, sQt, S::kLdT);
      load_tile<kBq, D>(dout + h * D, qstride, t0, seq_end, sG, S::kLd, sGt, S::kLdT);
      for (int i = threadIdx.x; i < kBq; i += kThreadsF) {
        const int64_t t = t0 + i;
        sL[i] = t < seq_end ? lse[static_cast<int64_t>(h) * T_ + t] * kLog2e : 0.0f;
        sD[i] = t < seq_end ? delta[t * Hq + h] : 0.0f;
      }
      __syncthreads();

      // Transposed scores: st[key][query] = k . q, dpt[key][query] = v . dout.
      float st[kNq][4], dpt[kNq][4];
#pragma unroll
      for (int i = 0; i < kNq; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ak[4], av[4];
        load_a(ak, sK, S::kLd, warp * 16, kk * 16, g, c);
        load_a(av, sV, S::kLd, warp * 16, kk * 16, g, c);
#pragma unroll
        for (int nt = 0; nt < kNq; ++nt) {
          uint32_t b[2];
          load_b(b, sQ, S::kLd, nt * 8, kk * 16, g, c);
          mma_bf16(st[nt], ak, b);
          load_b(b, sG, S::kLd, nt * 8, kk * 16, g, c);
          mma_bf16(dpt[nt], av, b);
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNq; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + 2 * c + (e & 1);
          const int64_t key = krow0 + 8 * (e >> 1), t = t0 + col;
          float p = exp2f(st[nt][e] * sl2 - sL[col]);
          if (key > t || t >= seq_end) p = 0.0f;
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - sD[col]);
        }
#pragma unroll
      for (int kk = 0; kk < kBq / 16; ++kk) {
        uint32_t ap[4], as[4];
        a_from_c(ap, st[2 * kk], st[2 * kk + 1]);
        a_from_c(as, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
        for (int nt = 0; nt < kNd; ++nt) {
          uint32_t b[2];
          load_b(b, sGt, S::kLdT, nt * 8, kk * 16, g, c);
          mma_bf16(adv[nt], ap, b);
          load_b(b, sQt, S::kLdT, nt * 8, kk * 16, g, c);
          mma_bf16(adk[nt], as, b);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = krow0 + 8 * r;
    if (key >= seq_end) continue;
    uint32_t* pk = reinterpret_cast<uint32_t*>(dk + key * kstride + hk * D);
    uint32_t* pv = reinterpret_cast<uint32_t*>(dv + key * kstride + hk * D);
#pragma unroll
    for (int nt = 0; nt < kNd; ++nt) {
      pk[nt * 4 + c] = pack_bf16(adk[nt][2 * r] * scale, adk[nt][2 * r + 1] * scale);
      pv[nt * 4 + c] = pack_bf16(adv[nt][2 * r], adv[nt][2 * r + 1]);
    }
  }
}

template <class K>
void set_smem(K kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "raising the flash attention kernel's shared memory limit");
}

template <int D>
void flash_fwd(const bf16* q, const bf16* k, const bf16* v, const TileDesc* tiles, int num_tiles, int64_t T_, int Hq,
               int Hkv, float scale, bf16* out, float* lse, cudaStream_t stream) {
  const size_t bytes = FwdSmem<D>::kBytes;
  set_smem(flash_fwd_kernel<D>, bytes);
  flash_fwd_kernel<D><<<dim3(num_tiles, Hq), kThreadsF, bytes, stream>>>(q, k, v, tiles, Hq, Hkv, T_, scale, out, lse);
  CUDA_CHECK_LAUNCH("flash_fwd_kernel");
}

template <int D>
void flash_bwd(const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
               const TileDesc* tiles_q, const TileDesc* tiles_k, int num_tiles, int64_t T_, int Hq, int Hkv,
               float scale, bf16* dq, bf16* dk, bf16* dv, float* delta, cudaStream_t stream) {
  const int64_t rows = T_ * Hq;
  flash_delta_kernel<D><<<static_cast<unsigned>(ceil_div(rows, 8)), 256, 0, stream>>>(dout, out, rows, delta);
  CUDA_CHECK_LAUNCH("flash_delta_kernel");
  set_smem(flash_dq_kernel<D>, DqSmem<D>::kBytes);
  flash_dq_kernel<D><<<dim3(num_tiles, Hq), kThreadsF, DqSmem<D>::kBytes, stream>>>(dout, q, k, v, lse, delta, tiles_q,
                                                                                    Hq, Hkv, T_, scale, dq);
  CUDA_CHECK_LAUNCH("flash_dq_kernel");
  set_smem(flash_dkv_kernel<D>, DkvSmem<D>::kBytes);
  flash_dkv_kernel<D><<<dim3(num_tiles, Hkv), kThreadsF, DkvSmem<D>::kBytes, stream>>>(
      dout, q, k, v, lse, delta, tiles_k, Hq, Hkv, T_, scale, dk, dv);
  CUDA_CHECK_LAUNCH("flash_dkv_kernel");
}

}  // namespace

bool flash_attention_supported(DType dt, int hd) { return dt == DType::BF16 && (hd == 64 || hd == 128); }

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
                            int64_t T_, int Hq, int Hkv, int hd, float scale, void* out, float* lse,
                            cudaStream_t stream) {
  if (T_ == 0 || num_tiles == 0) return;
  const void* ptrs[] = {q, k, v, out};
  check_flash_args(ptrs, 4, Hq, Hkv, num_tiles);
  const auto* td = reinterpret_cast<const TileDesc*>(tiles);
  auto cq = static_cast<const bf16*>(q), ck = static_cast<const bf16*>(k), cv = static_cast<const bf16*>(v);
  if (hd == 64) flash_fwd<64>(cq, ck, cv, td, num_tiles, T_, Hq, Hkv, scale, static_cast<bf16*>(out), lse, stream);
  else if (hd == 128) flash_fwd<128>(cq, ck, cv, td, num_tiles, T_, Hq, Hkv, scale, static_cast<bf16*>(out), lse, stream);
  else FP8RL_FAIL("flash attention: head_dim must be 64 or 128, got ", hd);
}

void launch_flash_attention_backward(const void* dout, const void* q, const void* k, const void* v, const void* out,
                                     const float* lse, const int32_t* tiles, int num_tiles, int64_t T_, int Hq,
                                     int Hkv, int hd, float scale, void* dq, void* dk, void* dv, float* delta,
                                     cudaStream_t stream) {
  if (T_ == 0 || num_tiles == 0) return;
  const void* ptrs[] = {dout, q, k, v, out, dq, dk, dv};
  check_flash_args(ptrs, 8, Hq, Hkv, num_tiles);
  const auto* tq = reinterpret_cast<const TileDesc*>(tiles);
  const TileDesc* tk = tq + num_tiles;
  auto g = static_cast<const bf16*>(dout), cq = static_cast<const bf16*>(q), ck = static_cast<const bf16*>(k),
       cv = static_cast<const bf16*>(v), co = static_cast<const bf16*>(out);
  auto pq = static_cast<bf16*>(dq), pk = static_cast<bf16*>(dk), pv = static_cast<bf16*>(dv);
  if (hd == 64) flash_bwd<64>(g, cq, ck, cv, co, lse, tq, tk, num_tiles, T_, Hq, Hkv, scale, pq, pk, pv, delta, stream);
  else if (hd == 128) flash_bwd<128>(g, cq, ck, cv, co, lse, tq, tk, num_tiles, T_, Hq, Hkv, scale, pq, pk, pv, delta, stream);
  else FP8RL_FAIL("flash attention: head_dim must be 64 or 128, got ", hd);
}

}  // namespace fp8rl::cuda
