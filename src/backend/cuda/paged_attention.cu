// Paged decode/prefill attention over the KV cache (backend.h attention_paged), flash-decoding
// style. One CTA of 4 warps serves one (token, KV head, split): all `group` = Hq / Hkv query
// heads that share the KV head, so every K/V row is read once per group. The positions
// 0..pos of the token are cut into `splits` chunks (one per blockIdx.y); each CTA streams its
// chunk with 16-byte loads of K/V rows (NHD pool [num_pages, page_size, Hkv, hd]) and an FP32
// online softmax, then either writes the output (one split) or a normalized partial output plus
// its log-sum-exp (base 2) that paged_combine_kernel merges.
//
// Lanes: a row of hd elements is read by kLpr lanes, kVec elements each (16-byte loads; 8 bytes
// where the group's q and accumulator registers would otherwise double the register count and
// halve occupancy: E4M3 with 4+ heads, BF16 with 8), so a warp reads kRpw rows per step. Each
// (warp, row group) is an independent softmax stream over every (4 * kRpw)-th row; the streams
// are merged with log-sum-exp at the end (shuffles inside the warp, shared memory across warps).
// q (FP8-quantized per (token, head) when asked, exactly as the CPU reference) is pre-scaled by
// softmax_scale * log2(e) * k_scale, so scores are base-2 logits; v_scale is applied at the end.
//
// The code between the "emulated" markers is also compiled for the host by
// tests/cuda/paged_emu/run.sh (with its own versions of the device primitives above them).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

// ---- device primitives (the host emulation supplies its own) --------------------------------
__device__ __forceinline__ uint4 paged_ld16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint2 paged_ld8(const void* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
// Two E4M3 bytes (the first in the low byte) to floats, exact.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  __half2 hh;
  hh = h;
  return __half22float2(hh);
}
// e4m3_to_float(e4m3_from_float(x)): round to nearest even, saturating to +-448.
__device__ __forceinline__ float e4m3_round(float x) {
  __nv_fp8_e4m3 f;
  f.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return static_cast<float>(f);
}

// ---- emulated: begin ------------------------------------------------------------------------
constexpr int kPagedWarps = 4;     // warps per CTA
constexpr int kPagedUnroll = 2;    // row steps whose loads are issued together
constexpr int kPagedSubPages = 256;  // page-table entries staged in shared memory at a time

__device__ __forceinline__ int paged_imin(int a, int b) { return a < b ? a : b; }

template <int HD, class TP, int GM>
struct PagedCfg {
  static constexpr int kElt = static_cast<int>(sizeof(TP));
  // Elements per lane per row: q and the accumulator take 2 * GM * kVec registers, kept <= 64
  // (ptxas: 128 -> 255 registers otherwise), within 8- to 16-byte loads.
  static constexpr int kMaxVec = 16 / kElt, kMinVec = 8 / kElt, kWant = 32 / GM;
  static constexpr int kVec = kWant > kMaxVec ? kMaxVec : kWant < kMinVec ? kMinVec : kWant;
  static constexpr int kLpr = HD / kVec;                                  // lanes per row
  static constexpr int kRpw = 32 / kLpr;                                  // rows per warp step
  static_assert(kLpr >= 1 && kLpr <= 32 && 32 % kLpr == 0, "head_dim / vector width must divide a warp");
  static_assert((kVec * kElt) % 8 == 0, "loads are 8 or 16 bytes");
};

struct PagedArgs {
  const void* q;               // [T, Hq, hd], F32 or BF16 (q_bf16)
  const int32_t* token_seq;    // [T]
  const int32_t* token_pos;    // [T]
  const int32_t* page_table;   // [B, max_pages]
  const void* kpool;           // [num_pages, page_size, Hkv, hd]
  const void* vpool;           // [num_pages, page_size, Hkv, hd]
  const float* k_scale;        // [Hkv] of the layer (E4M3 pools), else null
  const float* v_scale;        // [Hkv] of the layer (E4M3 pools), else null
  void* out;                   // [T, Hq, hd], q's dtype; written directly when splits == 1
  float* part_o;               // [T, Hq, splits, hd] normalized partial outputs (splits > 1)
  float* part_lse;             // [T, Hq, splits] their base-2 log-sum-exp (splits > 1)
  int max_pages, Hq, Hkv, group, page_size, splits, chunk;
  float scale_log2;            // softmax_scale * log2(e)
  bool q_bf16, fp8_q;
};

__device__ __forceinline__ float paged_load_q(const void* q, bool bf, int64_t i) {
  return bf ? bf16_bits_to_float(reinterpret_cast<const uint16_t*>(q)[i]) : reinterpret_cast<const float*>(q)[i];
}
__device__ __forceinline__ void paged_store_out(void* out, bool bf, int64_t i, float v) {
  if (bf) reinterpret_cast<uint16_t*>(out)[i] = bf16_bits_from_float(v);
  else reinterpret_cast<float*>(out)[i] = v;
}
// exp2(m - mn), 0 for an empty stream (m = -inf).
__device__ __forceinline__ float paged_rescale(float m, float mn) { return m == -INFINITY ? 0.0f : exp2f(m - mn); }

// A lane's kVec elements of a pool row: loaded as raw words (8 or 16 bytes), decoded to floats
// where they are used (E4M3 without its scale), which keeps few registers live.
template <class TP, int VEC>
struct PagedRow {
  static constexpr int kWords = VEC * static_cast<int>(sizeof(TP)) / 4;
  uint32_t w[kWords];
};
template <class TP, int VEC>
__device__ __forceinline__ void paged_load_row(const TP* p, PagedRow<TP, VEC>& r) {
  if constexpr (PagedRow<TP, VEC>::kWords == 4) {
    const uint4 u = paged_ld16(p);
    r.w[0] = u.x, r.w[1] = u.y, r.w[2] = u.z, r.w[3] = u.w;
  } else {
    const uint2 u = paged_ld8(p);
    r.w[0] = u.x, r.w[1] = u.y;
  }
}
template <class TP, int VEC>
__device__ __forceinline__ void paged_zero_row(PagedRow<TP, VEC>& r) {
#pragma unroll
  for (int i = 0; i < PagedRow<TP, VEC>::kWords; ++i) r.w[i] = 0;  // 0 is +0.0 in every pool dtype
}
template <class TP, int VEC>
__device__ __forceinline__ void paged_decode_row(const PagedRow<TP, VEC>& r, float (&x)[VEC]) {
#pragma unroll
  for (int i = 0; i < PagedRow<TP, VEC>::kWords; ++i) {
    if constexpr (sizeof(TP) == 4) {
      x[i] = __uint_as_float(r.w[i]);
    } else if constexpr (sizeof(TP) == 2) {
      x[2 * i] = bf16_bits_to_float(static_cast<uint16_t>(r.w[i] & 0xffffu));
      x[2 * i + 1] = bf16_bits_to_float(static_cast<uint16_t>(r.w[i] >> 16));
    } else {
      const float2 lo = e4m3x2_to_float2(r.w[i]), hi = e4m3x2_to_float2(r.w[i] >> 16);
      x[4 * i] = lo.x, x[4 * i + 1] = lo.y, x[4 * i + 2] = hi.x, x[4 * i + 3] = hi.y;
    }
  }
}

// The epilogue both kernels share: each warp's streams (already merged inside the warp: lanes
// with rg == 0 hold them) go to shared memory, the NW warps are merged by log-sum-exp (a warp
// without positions has m = -inf, l = 0; the chunk is not empty, so some warp has l >= 1), and
// the result, times v_scale, is written as the output (one split) or as this split's normalized
// partial output and base-2 log-sum-exp.
template <int HD, int GM, int VEC, int NW>
__device__ __forceinline__ void paged_merge_warps_and_store(const PagedArgs& a, const float (&acc)[GM][VEC],
                                                            const float (&m)[GM], const float (&l)[GM],
                                                            float (&s_acc)[NW][GM][HD], float (&s_m)[NW][GM],
                                                            float (&s_l)[NW][GM], int warp, int rg, int li, int hk,
                                                            int64_t head0, int split) {
  if (rg == 0) {
#pragma unroll
    for (int h = 0; h < GM; ++h) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) s_acc[warp][h][li * VEC + v] = acc[h][v];
      if (li == 0) s_m[warp][h] = m[h], s_l[warp][h] = l[h];
    }
  }
  __syncthreads();
  const int g = a.group;
  const float vsc = a.v_scale ? a.v_scale[hk] : 1.0f;
  for (int i = static_cast<int>(threadIdx.x); i < g * HD; i += 32 * NW) {
    const int h = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, s_m[w][h]);
    float den = 0.0f, num = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = paged_rescale(s_m[w][h], mx);
      den += s_l[w][h] * f;
      num += s_acc[w][h][d] * f;
    }
    const float o = num / den * vsc;
    if (a.splits == 1) {
      paged_store_out(a.out, a.q_bf16, (head0 + h) * HD + d, o);
    } else {
      const int64_t row = (head0 + h) * a.splits + split;
      a.part_o[row * HD + d] = o;
      if (d == 0) a.part_lse[row] = mx + log2f(den);
    }
  }
}

// grid (T * Hkv, splits), block 32 * kPagedWarps. GM: group size rounded up (1, 2, 4 or 8).
template <int HD, class TP, int GM>
__global__ void __launch_bounds__(32 * kPagedWarps) paged_attention_kernel(const PagedArgs a) {
  using Cfg = PagedCfg<HD, TP, GM>;
  constexpr int VEC = Cfg::kVec, LPR = Cfg::kLpr, RPW = Cfg::kRpw, NW = kPagedWarps;
  __shared__ __align__(16) float s_q[GM][HD];
  __shared__ __align__(16) float s_acc[NW][GM][HD];
  __shared__ float s_m[NW][GM], s_l[NW][GM];
  __shared__ int32_t s_page[kPagedSubPages];

  const int t = static_cast<int>(blockIdx.x) / a.Hkv, hk = static_cast<int>(blockIdx.x) % a.Hkv;
  const int split = static_cast<int>(blockIdx.y);
  const int len = a.token_pos[t] + 1;
  const int j0 = split * a.chunk;
  if (j0 >= len) return;  // this token's positions end before this split (uniform per CTA)
  const int j1 = split == a.splits - 1 ? len : paged_imin(len, j0 + a.chunk);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int rg = lane / LPR, li = lane % LPR, g = a.group;
  const int64_t head0 = static_cast<int64_t>(t) * a.Hq + static_cast<int64_t>(hk) * g;  // first q row

  // q rows of the group into shared memory, one warp per head (FP8-quantized when asked).
  for (int h = warp; h < GM; h += NW) {
    constexpr int kPer = HD / 32;
    float x[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) x[i] = h < g ? paged_load_q(a.q, a.q_bf16, (head0 + h) * HD + lane + 32 * i) : 0.0f;
    if (a.fp8_q) {  // s = quant_scale_from_amax(amax, pow2 = false); q = e4m3(q / s) * s
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) amax = fmaxf(amax, fabsf(x[i]));
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      float s = amax == 0.0f ? 1.0f : amax / 448.0f;
      if (s == 0.0f) s = __uint_as_float(1u);
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = e4m3_round(x[i] / s) * s;
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) s_q[h][lane + 32 * i] = x[i];
  }
  __syncthreads();
  const float kq = a.scale_log2 * (a.k_scale ? a.k_scale[hk] : 1.0f);
  float qr[GM][VEC], acc[GM][VEC], m[GM], l[GM];
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      qr[h][v] = s_q[h][li * VEC + v] * kq;
      acc[h][v] = 0.0f;
    }
  }

  const int ps = a.page_size;
  const int32_t* table = a.page_table + static_cast<int64_t>(a.token_seq[t]) * a.max_pages;
  const TP* kpool = static_cast<const TP*>(a.kpool);
  const TP* vpool = static_cast<const TP*>(a.vpool);
  const int sub = (kPagedSubPages - 1) * ps;  // positions per staged page list (any alignment)
  for (int sj0 = j0; sj0 < j1; sj0 += sub) {
    const int sj1 = paged_imin(j1, sj0 + sub), p0 = sj0 / ps, np = (sj1 - 1) / ps - p0 + 1;
    __syncthreads();  // the previous page list is no longer read
    for (int i = static_cast<int>(threadIdx.x); i < np; i += 32 * NW) s_page[i] = table[p0 + i];
    __syncthreads();
    const int n = sj1 - sj0;
    // Rows r = it * (NW * RPW * U) + u * (NW * RPW) + warp * RPW + rg, for u < U.
    for (int b0 = warp * RPW; b0 < n; b0 += NW * RPW * kPagedUnroll) {
      PagedRow<TP, VEC> kr[kPagedUnroll], vr[kPagedUnroll];
      bool ok[kPagedUnroll];
#pragma unroll
      for (int u = 0; u < kPagedUnroll; ++u) {
        const int j = sj0 + b0 + u * NW * RPW + rg;
        ok[u] = j < sj1;
        if (ok[u]) {
          const int64_t page = s_page[j / ps - p0];
          const int64_t off = ((page * ps + j % ps) * a.Hkv + hk) * HD + li * VEC;
          paged_load_row(kpool + off, kr[u]);
          paged_load_row(vpool + off, vr[u]);
        } else {
          paged_zero_row(kr[u]);
          paged_zero_row(vr[u]);
        }
      }
      float s[kPagedUnroll][GM];
#pragma unroll
      for (int u = 0; u < kPagedUnroll; ++u) {
        float kx[VEC];
        paged_decode_row(kr[u], kx);
#pragma unroll
        for (int h = 0; h < GM; ++h) {
          float d = 0.0f;
#pragma unroll
          for (int v = 0; v < VEC; ++v) d += qr[h][v] * kx[v];
#pragma unroll
          for (int o = LPR / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
          s[u][h] = d;
        }
      }
      // Softmax update per head; V is decoded once per row and used by every head.
      float corr[GM], p[kPagedUnroll][GM];
#pragma unroll
      for (int h = 0; h < GM; ++h) {
        float mn = m[h];
#pragma unroll
        for (int u = 0; u < kPagedUnroll; ++u)
          if (ok[u]) mn = fmaxf(mn, s[u][h]);
        // mn = -inf: no row for this stream in this step (corr 1 and p 0: nothing changes).
        corr[h] = mn == -INFINITY ? 1.0f : paged_rescale(m[h], mn);
        l[h] *= corr[h];
#pragma unroll
        for (int u = 0; u < kPagedUnroll; ++u) {
          p[u][h] = ok[u] ? exp2f(s[u][h] - mn) : 0.0f;
          l[h] += p[u][h];
        }
        m[h] = mn;
      }
#pragma unroll
      for (int h = 0; h < GM; ++h)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[h][v] *= corr[h];
#pragma unroll
      for (int u = 0; u < kPagedUnroll; ++u) {
        float vx[VEC];
        paged_decode_row(vr[u], vx);
#pragma unroll
        for (int h = 0; h < GM; ++h)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[h][v] += p[u][h] * vx[v];
      }
    }
  }

  // Merge the row groups of the warp (lanes li + k * LPR hold the same elements).
#pragma unroll
  for (int o = LPR; o < 32; o <<= 1)
#pragma unroll
    for (int h = 0; h < GM; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], o), lo = __shfl_xor_sync(0xffffffffu, l[h], o);
      const float mn = fmaxf(m[h], mo), fa = paged_rescale(m[h], mn), fb = paged_rescale(mo, mn);
      l[h] = l[h] * fa + lo * fb;
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[h][v] = acc[h][v] * fa + __shfl_xor_sync(0xffffffffu, acc[h][v], o) * fb;
      m[h] = mn;
    }
  paged_merge_warps_and_store<HD, GM, VEC, NW>(a, acc, m, l, s_acc, s_m, s_l, warp, rg, li, hk, head0, split);
}

// The tiled kernel (the default): same grid, split plan, partials and epilogue as the grouped
// kernel above, but each warp streams tiles of 32 positions with lanes over positions for
// QK^T: lane i reads the whole K row of position base + i (HD * elt bytes, 16-byte loads; rows
// larger than 128 bytes in pieces of 128) and computes its scores for all GM heads against q in
// shared memory (broadcast reads), so no per-position shuffle reductions. The warp's running max
// is updated once per tile (5 shuffles per head); the row sums stay per lane until the end. P
// goes to shared memory and PV runs with lanes over head dims (LPR lanes per V row, RPW rows
// per load, as above). The V loads of a tile's first piece are issued before its QK^T (group
// <= 4, BF16/E4M3), so a warp keeps up to 8 KB of K and V in flight. Each warp is one softmax
// stream. 3 CTAs per SM (168 registers): the group-4 cases do not spill there, at 4 they do.
template <int HD, class TP>
struct PagedTileCfg {
  static constexpr int kElt = static_cast<int>(sizeof(TP));
  static constexpr int kRowLoads = HD * kElt / 16;                          // 16-byte loads per K row
  static constexpr int kPieceLoads = kRowLoads < 8 ? kRowLoads : 8;         // ... per piece (<= 128 B)
  static constexpr int kPieces = kRowLoads / kPieceLoads;
  static constexpr int kPerLoad = 16 / kElt;                                // elements per 16-byte load
  static_assert(kRowLoads % kPieceLoads == 0, "K row pieces");
};

template <int HD, class TP, int GM>
__global__ void __launch_bounds__(32 * kPagedWarps, 3) paged_tiled_kernel(const PagedArgs a) {
  using Cfg = PagedCfg<HD, TP, GM>;
  using TCfg = PagedTileCfg<HD, TP>;
  constexpr int VEC = Cfg::kVec, LPR = Cfg::kLpr, RPW = Cfg::kRpw, NW = kPagedWarps;
  constexpr int KPL = TCfg::kPieceLoads, KPE = TCfg::kPerLoad;
  constexpr int kVLoads = 32 / RPW;                          // V row loads per lane per tile
  constexpr int kVWords = PagedRow<TP, VEC>::kWords;
  constexpr int kVPiece = kVLoads * kVWords > 32 ? 32 / kVWords : kVLoads;  // <= 32 words in flight
  static_assert(kVLoads % kVPiece == 0, "V pieces");
  // V loads in flight during QK^T where the registers allow it (ptxas, 168 registers: spills
  // for 8 heads or F32 pools otherwise); else they are issued after the softmax.
  constexpr bool kVEarly = GM <= 2 || (GM == 4 && sizeof(TP) < 4);
  __shared__ __align__(16) float s_q[GM][HD];
  __shared__ __align__(16) float s_acc[NW][GM][HD];
  __shared__ __align__(16) float s_p[NW][32][GM];
  __shared__ float s_m[NW][GM], s_l[NW][GM];
  __shared__ int32_t s_page[kPagedSubPages];

  const int t = static_cast<int>(blockIdx.x) / a.Hkv, hk = static_cast<int>(blockIdx.x) % a.Hkv;
  const int split = static_cast<int>(blockIdx.y);
  const int len = a.token_pos[t] + 1;
  const int j0 = split * a.chunk;
  if (j0 >= len) return;  // uniform per CTA
  const int j1 = split == a.splits - 1 ? len : paged_imin(len, j0 + a.chunk);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int rg = lane / LPR, li = lane % LPR, g = a.group;
  const int64_t head0 = static_cast<int64_t>(t) * a.Hq + static_cast<int64_t>(hk) * g;
  const float kq = a.scale_log2 * (a.k_scale ? a.k_scale[hk] : 1.0f);

  // q rows of the group into shared memory, pre-scaled by kq (FP8-quantized first when asked).
  for (int h = warp; h < GM; h += NW) {
    constexpr int kPer = HD / 32;
    float x[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) x[i] = h < g ? paged_load_q(a.q, a.q_bf16, (head0 + h) * HD + lane + 32 * i) : 0.0f;
    if (a.fp8_q) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) amax = fmaxf(amax, fabsf(x[i]));
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      float s = amax == 0.0f ? 1.0f : amax / 448.0f;
      if (s == 0.0f) s = __uint_as_float(1u);
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = e4m3_round(x[i] / s) * s;
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) s_q[h][lane + 32 * i] = x[i] * kq;
  }

  float acc[GM][VEC], m[GM], l[GM];  // m: warp-uniform; l: this lane's positions; acc: its dims
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[h][v] = 0.0f;
  }
  const int ps = a.page_size;
  const int32_t* table = a.page_table + static_cast<int64_t>(a.token_seq[t]) * a.max_pages;
  const TP* kpool = static_cast<const TP*>(a.kpool);
  const TP* vpool = static_cast<const TP*>(a.vpool);
  const int64_t rstride = static_cast<int64_t>(a.Hkv) * HD;  // elements between positions of a page
  const int sub = (kPagedSubPages - 1) * ps;
  for (int sj0 = j0; sj0 < j1; sj0 += sub) {
    const int sj1 = paged_imin(j1, sj0 + sub), p0 = sj0 / ps, np = (sj1 - 1) / ps - p0 + 1;
    __syncthreads();  // the previous page list is no longer read (first pass: s_q is written)
    for (int i = static_cast<int>(threadIdx.x); i < np; i += 32 * NW) s_page[i] = table[p0 + i];
    __syncthreads();
    auto row_of = [&](int j) -> int64_t {
      const int64_t page = s_page[j / ps - p0];
      return (page * ps + j % ps) * rstride + static_cast<int64_t>(hk) * HD;
    };
    for (int base = sj0 + warp * 32; base < sj1; base += NW * 32) {
      // Issue: the first K piece of this lane's position and the first V piece of the tile.
      const int jk = base + lane;
      const bool kok = jk < sj1;
      const TP* krow = kpool + (kok ? row_of(jk) : 0);
      uint4 kw[KPL];
#pragma unroll
      for (int i = 0; i < KPL; ++i) kw[i] = kok ? paged_ld16(krow + i * KPE) : make_uint4(0, 0, 0, 0);
      PagedRow<TP, VEC> vr[kVPiece];
      auto load_v = [&](int piece) {
#pragma unroll
        for (int i = 0; i < kVPiece; ++i) {
          const int j = base + (piece * kVPiece + i) * RPW + rg;
          if (j < sj1) paged_load_row(vpool + row_of(j) + li * VEC, vr[i]);
          else paged_zero_row(vr[i]);
        }
      };
      if constexpr (kVEarly) load_v(0);
      // Scores of this lane's position for every head (base-2 logits).
      float s[GM];
#pragma unroll
      for (int h = 0; h < GM; ++h) s[h] = 0.0f;
#pragma unroll
      for (int pc = 0; pc < TCfg::kPieces; ++pc) {
        if (pc > 0) {
#pragma unroll
          for (int i = 0; i < KPL; ++i)
            kw[i] = kok ? paged_ld16(krow + (pc * KPL + i) * KPE) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
          PagedRow<TP, KPE> r;
          r.w[0] = kw[i].x, r.w[1] = kw[i].y, r.w[2] = kw[i].z, r.w[3] = kw[i].w;
          float kx[KPE];
          paged_decode_row(r, kx);
          const int d0 = (pc * KPL + i) * KPE;
#pragma unroll
          for (int h = 0; h < GM; ++h)
#pragma unroll
            for (int e = 0; e < KPE; ++e) s[h] += s_q[h][d0 + e] * kx[e];
        }
      }
      // Online softmax, once per tile: warp max per head, p of this lane's position to s_p.
      float corr[GM];
#pragma unroll
      for (int h = 0; h < GM; ++h) {
        float mx = kok ? s[h] : -INFINITY;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float mn = fmaxf(m[h], mx);  // finite: lane 0's position is in the tile
        corr[h] = paged_rescale(m[h], mn);
        const float p = kok ? exp2f(s[h] - mn) : 0.0f;
        l[h] = l[h] * corr[h] + p;
        m[h] = mn;
        s_p[warp][lane][h] = p;
      }
      if constexpr (!kVEarly) load_v(0);
      __syncwarp();
#pragma unroll
      for (int h = 0; h < GM; ++h)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[h][v] *= corr[h];
#pragma unroll
      for (int pc = 0; pc < kVLoads / kVPiece; ++pc) {
        if (pc > 0) load_v(pc);
#pragma unroll
        for (int i = 0; i < kVPiece; ++i) {
          const int r = (pc * kVPiece + i) * RPW + rg;  // row of the tile (p = 0 past the end)
          float vx[VEC];
          paged_decode_row(vr[i], vx);
#pragma unroll
          for (int h = 0; h < GM; ++h) {
            const float p = s_p[warp][r][h];
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[h][v] += p * vx[v];
          }
        }
      }
      __syncwarp();  // s_p is read before the next tile writes it
    }
  }

  // Merge the row groups of the warp (same m: plain sums) and the lanes' row sums.
#pragma unroll
  for (int h = 0; h < GM; ++h) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], o);
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[h][v] += __shfl_xor_sync(0xffffffffu, acc[h][v], o);
  }
  paged_merge_warps_and_store<HD, GM, VEC, NW>(a, acc, m, l, s_acc, s_m, s_l, warp, rg, li, hk, head0, split);
}

// One warp per (token, q head): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over the
// splits that hold positions of the token.
__global__ void __launch_bounds__(32 * kPagedWarps)
    paged_combine_kernel(const float* part_o, const float* part_lse, const int32_t* token_pos, int64_t rows, int Hq,
                         int hd, int splits, int chunk, bool out_bf16, void* out) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kPagedWarps + (threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (w >= rows) return;
  const int len = token_pos[w / Hq] + 1;
  const int n = paged_imin(splits, (len + chunk - 1) / chunk);
  const float* lse = part_lse + w * splits;
  float mx = -INFINITY;
  for (int s = 0; s < n; ++s) mx = fmaxf(mx, lse[s]);
  float den = 0.0f;
  for (int s = 0; s < n; ++s) den += exp2f(lse[s] - mx);
  for (int d = lane; d < hd; d += 32) {
    float num = 0.0f;
    for (int s = 0; s < n; ++s) num += exp2f(lse[s] - mx) * part_o[(w * splits + s) * hd + d];
    paged_store_out(out, out_bf16, w * hd + d, num / den);
  }
}
// ---- emulated: end --------------------------------------------------------------------------

template <int HD, class TP, int GM>
void launch_one(const PagedArgs& a, bool grouped, const dim3& grid, cudaStream_t stream) {
  if (grouped) paged_attention_kernel<HD, TP, GM><<<grid, 32 * kPagedWarps, 0, stream>>>(a);
  else paged_tiled_kernel<HD, TP, GM><<<grid, 32 * kPagedWarps, 0, stream>>>(a);
}

template <int HD, class TP>
void launch_group(const PagedArgs& a, bool grouped, int64_t T, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T * a.Hkv), static_cast<unsigned>(a.splits));
  if (a.group == 1) launch_one<HD, TP, 1>(a, grouped, grid, stream);
  else if (a.group == 2) launch_one<HD, TP, 2>(a, grouped, grid, stream);
  else if (a.group <= 4) launch_one<HD, TP, 4>(a, grouped, grid, stream);
  else launch_one<HD, TP, 8>(a, grouped, grid, stream);
}

template <int HD>
void launch_pool(const PagedArgs& a, bool grouped, DType pool_dt, int64_t T, cudaStream_t stream) {
  if (pool_dt == DType::E4M3) launch_group<HD, uint8_t>(a, grouped, T, stream);
  else if (pool_dt == DType::BF16) launch_group<HD, bf16>(a, grouped, T, stream);
  else launch_group<HD, float>(a, grouped, T, stream);
}

}  // namespace

bool paged_attention_supported(int hd, int group, DType pool_dt, const void* kpool, const void* vpool) {
  const bool pool_ok = pool_dt == DType::F32 || pool_dt == DType::BF16 || pool_dt == DType::E4M3;
  return (hd == 64 || hd == 128) && group >= 1 && group <= kPagedMaxGroup && pool_ok &&
         reinterpret_cast<uintptr_t>(kpool) % 16 == 0 && reinterpret_cast<uintptr_t>(vpool) % 16 == 0;
}

PagedSplit paged_attention_split(int64_t T, int Hkv, int max_pos, int sm_count, int forced) {
  const int64_t len = std::max(max_pos, 1), ctas = std::max<int64_t>(T * Hkv, 1);
  int64_t splits = forced > 0 ? forced
                              : std::min<int64_t>((int64_t(sm_count) * kPagedTargetCtasPerSm + ctas - 1) / ctas,
                                                  (len + kPagedMinChunk - 1) / kPagedMinChunk);
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(len, kPagedMaxSplits));
  PagedSplit p;
  p.chunk = static_cast<int>((len + splits - 1) / splits);
  p.splits = static_cast<int>((len + p.chunk - 1) / p.chunk);  // no split left without positions
  return p;
}

void launch_paged_attention(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                            const int32_t* page_table, int max_pages, int64_t T, int Hq, int Hkv, int hd,
                            int page_size, const void* kpool, const void* vpool, DType pool_dt, const float* k_scale,
                            const float* v_scale, float scale, bool fp8_q, const PagedSplit& split, float* part_o,
                            float* part_lse, void* out, cudaStream_t stream, bool grouped) {
  if (T == 0) return;
  FP8RL_CHECK(qdt == DType::F32 || qdt == DType::BF16, "paged attention: q must be F32 or BF16, got ",
              dtype_name(qdt));
  FP8RL_CHECK(paged_attention_supported(hd, Hq / Hkv, pool_dt, kpool, vpool) && Hq % Hkv == 0,
              "paged attention kernel: unsupported head_dim ", hd, " / group ", Hq / Hkv,
              " (the backend falls back to the simple kernel for these)");
  FP8RL_CHECK(split.splits >= 1 && split.chunk >= 1 && (split.splits == 1 || (part_o && part_lse)),
              "paged attention: bad split plan (", split.splits, " x ", split.chunk, ")");
  FP8RL_CHECK(T * Hkv < (int64_t(1) << 31), "paged attention: T * Hkv = ", T * Hkv, " exceeds the grid");
  PagedArgs a;
  a.q = q;
  a.token_seq = token_seq;
  a.token_pos = token_pos;
  a.page_table = page_table;
  a.kpool = kpool;
  a.vpool = vpool;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.out = out;
  a.part_o = part_o;
  a.part_lse = part_lse;
  a.max_pages = max_pages;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.group = Hq / Hkv;
  a.page_size = page_size;
  a.splits = split.splits;
  a.chunk = split.chunk;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.q_bf16 = qdt == DType::BF16;
  a.fp8_q = fp8_q;
  if (hd == 64) launch_pool<64>(a, grouped, pool_dt, T, stream);
  else launch_pool<128>(a, grouped, pool_dt, T, stream);
  CUDA_CHECK_LAUNCH(grouped ? "paged_attention_kernel" : "paged_tiled_kernel");
  if (split.splits > 1) {
    const int64_t rows = T * Hq;
    paged_combine_kernel<<<static_cast<unsigned>((rows + kPagedWarps - 1) / kPagedWarps), 32 * kPagedWarps, 0,
                           stream>>>(part_o, part_lse, token_pos, rows, Hq, hd, split.splits, split.chunk,
                                     a.q_bf16, out);
    CUDA_CHECK_LAUNCH("paged_combine_kernel");
  }
}

}  // namespace fp8rl::cuda
