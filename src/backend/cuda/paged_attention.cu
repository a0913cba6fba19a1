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
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/sm90.cuh"
#include "quant/fp8_rule.h"

namespace fp8rl::cuda {

namespace {

// ---- device primitives (the host emulation supplies its own) --------------------------------
__device__ __forceinline__ uint4 paged_ld16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint2 paged_ld8(const void* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
// e4m3(x) (fp8_rule.h's codec: round to nearest even, saturating): the fused output quantizer.
__device__ __forceinline__ uint8_t paged_e4m3_code(float x) { return fp8_e4m3_encode(x); }
// For the tensor-core kernel (paged_mma_kernel below):
// cp.async of 16 bytes into shared memory; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void paged_cp_async16(void* smem_dst, const void* src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void paged_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void paged_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// d = A * B + c, m16n8k16, FP32 accumulate; A rows 8..15 are zero (a1 = a3 = 0), so only d0, d1
// (row groupID) are returned: A {a0, a2}, B {b0, b1} in the PTX fragment layouts. F16: the
// inputs are FP16, else BF16.
template <bool F16>
__device__ __forceinline__ void paged_mma(float& d0, float& d1, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  float d2, d3;  // row groupID + 8: zero, discarded
  const uint32_t z = 0;
  if constexpr (F16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%11};\n"
        : "+f"(d0), "+f"(d1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%11};\n"
        : "+f"(d0), "+f"(d1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f));
  }
}
// FP16 bits of x, round to nearest even (exact where x is an FP16 value).
__device__ __forceinline__ uint16_t paged_f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ uint32_t paged_pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t paged_pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint4 paged_lds16(const unsigned char* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint2 paged_lds8(const unsigned char* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ int paged_shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ int paged_shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ unsigned char* paged_dyn_smem() {
  extern __shared__ __align__(16) unsigned char paged_smem[];
  return paged_smem;
}
// For the transposed tensor-core kernel (paged_mmat_kernel below):
// The full m16n8k16, FP32 accumulate: d {rows g, g + 8 x columns 2c, 2c + 1} += A {a0..a3} B {b0, b1}
// in the PTX fragment layouts (g = lane / 4, c = lane % 4). F16: FP16 inputs, else BF16.
template <bool F16>
__device__ __forceinline__ void paged_mma4(float (&d)[4], const uint32_t (&x)[4], uint32_t b0, uint32_t b1) {
  mma_m16n8k16<F16>(d, x, b0, b1);  // common.cuh
}
// The 8 x 8 matrix of 16-bit values whose row lane / 4 holds columns 2 (lane % 4), + 1 in x
// (low half first), transposed, in the same layout.
__device__ __forceinline__ uint32_t paged_movm_t(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
// 2^x, results below 2^-126 flushed to zero (2^-inf = 0): one MUFU.EX2.
__device__ __forceinline__ float paged_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ bool paged_any(bool p) { return __any_sync(0xffffffffu, p); }
// x, opaque to the compiler: a per-lane constant stays in a register instead of being rebuilt
// from the lane id inside the loop.
__device__ __forceinline__ uint32_t paged_keep(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}
__device__ __forceinline__ uint64_t paged_keep(uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}
// Shared-memory addresses (32-bit, of the shared window) for cp.async destinations.
using paged_saddr_t = uint32_t;
__device__ __forceinline__ paged_saddr_t paged_saddr(const void* p) {
  return static_cast<paged_saddr_t>(__cvta_generic_to_shared(p));
}
// 16 bytes from src, or 16 zero bytes (src not read) where `zero`.
__device__ __forceinline__ void paged_cp_async16z(paged_saddr_t dst, const void* src, bool zero) {
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(dst),
      "l"(src), "r"(static_cast<int>(zero))
      : "memory");
}

// For the TMA copies of the transposed kernel (paged_mmat_kernel, COPY 2): an mbarrier per ring
// stage (shared addresses), armed with the stage's byte count by the lane that issues its copies,
// and one 3-D box of a pool's tensor map ({row bytes, KV head, cache slot}: 16 slots x 128 bytes
// of one head, 128-byte swizzle) landing on it.
__device__ __forceinline__ void paged_mbar_init(paged_saddr_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
// Orders this thread's shared-memory accesses before later async-proxy (TMA) ones: after the
// barriers' initialization, and after a lane's last reads of a stage that TMA will refill.
__device__ __forceinline__ void paged_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void paged_mbar_expect_tx(paged_saddr_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Until the phase of `parity` has completed (every armed byte landed).
__device__ __forceinline__ void paged_mbar_wait(paged_saddr_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void paged_tma_rows(paged_saddr_t dst, const CUtensorMap* map, paged_saddr_t bar, int c0,
                                               int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// ---- emulated: begin ------------------------------------------------------------------------
constexpr int kPagedWarps = 4;     // warps per CTA
constexpr int kPagedUnroll = 2;    // row steps whose loads are issued together
constexpr int kPagedSubPages = 256;  // page-table entries staged in shared memory at a time

__device__ __forceinline__ int paged_imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int paged_imax(int a, int b) { return a > b ? a : b; }

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
  void* out;                   // [T, Hq, hd], q's dtype; written directly when splits == 1 and !partials
  float* part_o;               // [T, Hq, splits, hd] normalized partial outputs (splits > 1 or partials)
  float* part_lse;             // [T, Hq, splits] their base-2 log-sum-exp (splits > 1 or partials)
  int max_pages, Hq, Hkv, group, page_size, splits, chunk;
  float scale_log2;            // softmax_scale * log2(e)
  bool q_bf16, fp8_q;
  int ps_shift = -1;           // log2(page_size) when it is a power of two, else -1 (paged_mma_kernel)
  // Partials even with one split (the combine kernel then writes out and the lse): a token's out
  // is the same bits either way (the combine of one partial is that partial: 2^0 = 1, x / 1 = x).
  bool partials = false;
  // The output's 1x128 E4M3 copy (hd 128: one block per (token, head) row), written with out by
  // the tensor-core kernels' one-split epilogue and by the combine (the o projection's input,
  // bitwise quantize(out)): codes [T, Hq, hd], scales row-major [T * Hq] or, with out_q_gemm,
  // [Hq][T] (cuBLASLt's VEC128 layout); a non-finite output sets *out_q_bad.
  uint8_t* out_q = nullptr;
  float* out_qs = nullptr;
  int64_t out_q_rows = 0;  // T
  bool out_q_gemm = false, out_q_pow2 = false;
  int* out_q_bad = nullptr;
  // The pools' tensor maps for the TMA copies (paged_mmat_kernel, COPY 2; paged_pool_tma_map):
  // kpool, vpool as {row bytes, Hkv, cache slots}, boxes of 128 bytes x 1 head x 16 slots.
  CUtensorMap kmap{}, vmap{};  // valid only in the kernels whose PagedArgs is __grid_constant__
  // Query runs (the transposed tensor-core kernel's multi-query form, paged_mmat_kernel<..., MQ>):
  // {first token, count} per CTA row of the grid, count <= kMmaRows / group consecutive tokens of
  // one sequence at consecutive positions, whose group x count (token, head) pairs are the MMA
  // columns: the run's K/V tiles are read once for all of them. Null: one token per CTA row.
  const int32_t* qruns = nullptr;
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

// The fused output quantizer of one (token, head) row of 128 values held 4 per lane by a warp
// (lane l: dims l + 32 j), each already rounded as out stores it: the row's amax over the warp,
// its scale and codes (quant.cuh's rule: e4m3(v / s), s = fp8_scale_from_amax(amax)).
__device__ __forceinline__ void paged_quantize_row(const PagedArgs& a, int64_t row, const float (&v)[4], int lane) {
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    finite = finite && isfinite(v[j]);
    amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = fp8_scale_from_amax(amax, a.out_q_pow2);
#pragma unroll
  for (int j = 0; j < 4; ++j) a.out_q[row * 128 + lane + 32 * j] = paged_e4m3_code(v[j] / s);
  if (lane == 0) a.out_qs[a.out_q_gemm ? (row % a.Hq) * a.out_q_rows + row / a.Hq : row] = s;
  if (!finite) *a.out_q_bad = 1;  // every writer writes 1
}
// The value out holds for v (BF16 q: the tensor-core kernels' out is BF16).
__device__ __forceinline__ float paged_stored(bool bf, float v) {
  return bf ? bf16_bits_to_float(bf16_bits_from_float(v)) : v;
}


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
      const float2 lo = fp8_e4m3x2_to_float2(r.w[i]), hi = fp8_e4m3x2_to_float2(r.w[i] >> 16);
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
    if (a.splits == 1 && !a.partials) {
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
      const float s = fp8_scale_from_amax(amax, false);
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = fp8_e4m3_round(x[i] / s) * s;
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
      const float s = fp8_scale_from_amax(amax, false);
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = fp8_e4m3_round(x[i] / s) * s;
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

// Element d of a row's split combine: its n partials (rows p0 .. p0 + n of part_o) weighted by
// 2^(lse_s - mx), over den. One definition for the combine's two paths.
__device__ __forceinline__ float paged_combined(const float* part_o, const float* lse, int n, float mx, float den,
                                                int64_t p0, int hd, int d) {
  float num = 0.0f;
  for (int s = 0; s < n; ++s) num += exp2f(lse[s] - mx) * part_o[(p0 + s) * hd + d];
  return num / den;
}

// One warp per (token, q head): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over the
// splits that hold positions of the token; lse_out (when non-null, [Hq, T]) = the natural
// log-sum-exp of the token's scores, (M + log2(sum_s 2^(lse_s - M))) ln 2.
__global__ void __launch_bounds__(32 * kPagedWarps)
    paged_combine_kernel(const float* part_o, const float* part_lse, const int32_t* token_pos, int64_t rows, int Hq,
                         int hd, int splits, int chunk, bool out_bf16, void* out, float* lse_out = nullptr,
                         PagedArgs qa = PagedArgs{}) {
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
  if (lse_out && lane == 0) {
    const int64_t T = rows / Hq;
    lse_out[(w % Hq) * T + w / Hq] = (mx + log2f(den)) * 0.6931471805599453f;
  }
  if (qa.out_q && hd == 128) {  // with the output's E4M3 copy (PagedArgs::out_q): the same values
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float o = paged_combined(part_o, lse, n, mx, den, w * splits, hd, lane + 32 * j);
      paged_store_out(out, out_bf16, w * hd + lane + 32 * j, o);
      v[j] = paged_stored(out_bf16, o);
    }
    paged_quantize_row(qa, w, v, lane);
    return;
  }
  for (int d = lane; d < hd; d += 32)
    paged_store_out(out, out_bf16, w * hd + d, paged_combined(part_o, lse, n, mx, den, w * splits, hd, d));
}
// ---- the tensor-core decode kernel (the default for BF16 q over BF16 / E4M3 pools) ----------
// Same grid, split plan contract, partials and combine as the kernels above: one CTA of 4 warps
// per (token, KV head, split), every K/V row of the chunk read once for the whole query-head
// group. Why tensor cores: per position a KV head's K and V rows are 2 * hd elements and take
// 4 * group * hd FLOPs; on CUDA cores that is group FMAs per element plus the E4M3 decode, which
// for E4M3 at 4 TB/s (4e12 elements/s) and group 4 is most of the FP32 issue rate (the tiled
// kernel's E4M3 calls run at ~45% of HBM bandwidth). mma.sync m16n8k16 does a 16 x 8 x 16 block
// in one instruction, leaving the CUDA cores the E4M3 -> FP16 conversions (one per 2 elements),
// the softmax and the cp.async issue: far below their rate, so the kernel is bound by HBM.
//
// Layout (FlashAttention-2 style, heads as MMA rows): S[16 heads, 8 positions] = Q K^T with the
// group's heads in rows 0..group-1 (rows 8..15 zero and never stored), then
// O[16 heads, 8 dims] += P[heads, 16 positions] V[16 positions, 8 dims]; the S accumulators of
// two 8-position tiles are the A fragment of P V as they are (no shuffles). BF16 pools: BF16
// MMAs (q BF16 exactly, P rounded to BF16 as in FlashAttention). E4M3 pools: FP16 MMAs: K and V
// E4M3 -> FP16 exactly (cvt.rn.f16x2.e4m3x2), q (BF16) scaled per (token, head) by a power of two
// so its amax is in [2^14, 2^15) and rounded to FP16 (exact: BF16 has 8 significant bits, FP16
// 11; only elements below amax * 2^-28 lose bits), P in FP16; the power of two, k_scale and
// softmax_scale * log2(e) scale the FP32 scores, v_scale the output. fp8_attention: q is the
// E4M3 value e4m3(q / s) (exact in BF16 and FP16) and s joins the score scale. The softmax is
// FP32 with online rescaling per 16-position tile.
//
// Pipeline: each warp streams its own tiles of 16 positions (tiles warp, warp + 4, ...) through
// a ring of kStages shared-memory stages (K tile then V tile), filled by 16-byte cp.async with
// zero fill past the chunk's end; the page-table entry of each row is loaded one tile ahead. The
// reads are conflict-free for hd 128 (XOR swizzles of the 16-byte chunks, kswz / vswz) and need
// no __syncthreads: a warp only waits for its own groups (cp.async.wait_group + __syncwarp).
// Fragment dims: thread (g = lane / 4, c = lane % 4) reads 16-byte K chunks 4i + c of rows g and
// 8 + g, and its k-slots of QK^T step kk are the dims paged_kdim(c, kk, e) (the reduction is
// over all dims, so q's fragments take the same permutation); for P V it reads the V dims
// paged_vdim(g, nt) of rows 2c, 2c+1, 2c+8, 2c+9 (pairs of positions interleaved with prmt), and
// holds the output dims paged_vdim(2c + e, nt).
constexpr int kMmaWarps = 4;
constexpr int kMmaTile = 16;  // positions per tile (one k-step of P V)
constexpr int kMmaRows = 8;   // MMA rows that hold heads (group <= 8)
constexpr int kMmaRunBlocks = 2;  // query runs (paged_mmat_kernel's MQ form): at most 2 blocks of kMmaRows columns

template <int HD, class TP>
struct PagedMmaCfg {
  static constexpr bool kF16 = sizeof(TP) == 1;  // E4M3 pools: FP16 MMAs; BF16 pools: BF16 MMAs
  static constexpr int kElt = static_cast<int>(sizeof(TP));
  static constexpr int kRowBytes = HD * kElt;       // a K or V row of one KV head
  static constexpr int kCpr = kRowBytes / 16;       // 16-byte chunks per row: 16, 8 or 4
  static constexpr int kChunkDims = 16 / kElt;      // dims per chunk: 8 or 16
  static constexpr int kMpc = kChunkDims / 4;       // QK^T k-steps per chunk: 2 or 4
  static constexpr int kKChunks = kCpr / 4;         // K chunks a thread reads per row
  static constexpr int kKSteps = HD / 16;           // QK^T k-steps (MMAs per 8 positions)
  static constexpr int kNTiles = HD / 8;            // P V MMAs per tile (8 dims each)
  static constexpr int kVDims = HD / 8;             // V dims a thread reads per row
  static constexpr int kTileBytes = kMmaTile * kRowBytes;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile, then V tile
  static constexpr int kStages = kStageBytes >= 8192 ? 3 : kStageBytes >= 4096 ? 4 : 6;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kSmemBytes = kMmaWarps * kWarpBytes;  // dynamic shared memory
  // CTAs per SM the shared memory allows (228 KB per SM): 2 (BF16 hd 128), 3, or 4 (E4M3 hd 64).
  static constexpr int kMinBlocks = kSmemBytes > 75 * 1024 ? 2 : kSmemBytes > 56 * 1024 ? 3 : 4;
  static_assert(kCpr >= 4 && kCpr <= 16 && kKChunks * kMpc == kKSteps, "head_dim 64 or 128");
  static_assert(kSmemBytes >= kMmaWarps * kMmaRows * HD * 4, "the epilogue reuses the stages");
  static_assert(kVDims * 8 == HD && kNTiles * 8 == HD, "P V tiles");
};

// XOR swizzles of a row's 16-byte chunk index: K (rows g and g + 1 read by one quarter-warp) and
// V (rows 2c, c = 0..3, read by one quarter-warp). 64-byte rows (E4M3 hd 64) are not swizzled.
template <int CPR>
__device__ __forceinline__ int paged_kswz(int r) {
  return CPR >= 8 ? (r & 1) << 2 : 0;
}
template <int CPR>
__device__ __forceinline__ int paged_vswz(int r) {
  return CPR >= 8 ? ((r >> 1) & 3) << 1 : 0;
}
// The head dim at k-slot e (0, 1: b0 lo/hi; 2, 3: b1 lo/hi) of QK^T step kk for threads c.
template <class Cfg>
__device__ __forceinline__ int paged_kdim(int c, int kk, int e) {
  return Cfg::kChunkDims * (4 * (kk / Cfg::kMpc) + c) + 4 * (kk % Cfg::kMpc) + e;
}
// The head dim of column n (0..7) of P V n-tile nt.
template <class Cfg>
__device__ __forceinline__ int paged_vdim(int n, int nt) {
  if constexpr (Cfg::kF16) return Cfg::kVDims * n + nt;  // E4M3: a thread's kVDims contiguous bytes
  else return 8 * (n + 8 * (nt >> 3)) + (nt & 7);        // BF16: 16-byte chunks n, n + 8
}

// The tensor-core kernels' epilogue after their warps' streams are in shared memory (s_o
// [NW][kMmaRows][HD] outputs, s_m / s_l per warp and head; a warp without tiles holds -inf, 0):
// the warps merged by log-sum-exp, times v_scale, written as the output (one split, no partials)
// or as this split's normalized partial output and base-2 log-sum-exp.
// Element (h, d) of the warps' merge by log-sum-exp, times v_scale; mx and den: the row's
// merged max and denominator. One definition for the epilogue's two thread mappings.
// The merge itself, over the streams w = 0 .. NW - 1 in order (m_of, l_of, o_of: stream w's running
// max, denominator and output element), in two parts: a row's max, factors and denominator, then
// each element's value. The shared-memory epilogue and the wide query runs (paged_wide_kernel,
// whose streams are in registers, each row's part taken once for its elements) share the one
// arithmetic.
template <int NW, class MOf, class LOf>
__device__ __forceinline__ void paged_merge_row(const MOf& m_of, const LOf& l_of, float (&f)[NW], float& mx,
                                                float& den) {
  mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_of(w));
  den = 0.0f;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    f[w] = paged_rescale(m_of(w), mx);
    den += l_of(w) * f[w];
  }
}
template <int NW, class OOf>
__device__ __forceinline__ float paged_merge_value(const OOf& o_of, const float (&f)[NW], float den, float vsc) {
  float num = 0.0f;
#pragma unroll
  for (int w = 0; w < NW; ++w) num += o_of(w) * f[w];
  return num / den * vsc;
}
template <int HD, int NW, int COLS = kMmaRows>
__device__ __forceinline__ float paged_mma_merged(const float* s_o, const float (*s_m)[COLS],
                                                  const float (*s_l)[COLS], int h, int d, float vsc, float& mx,
                                                  float& den) {
  float f[NW];
  paged_merge_row<NW>([&](int w) { return s_m[w][h]; }, [&](int w) { return s_l[w][h]; }, f, mx, den);
  return paged_merge_value<NW>([&](int w) { return s_o[(w * COLS + h) * HD + d]; }, f, den, vsc);
}

template <int HD, int NW, int COLS = kMmaRows, class RowOf>
__device__ __forceinline__ void paged_mma_merge_warps(const PagedArgs& a, const float* s_o,
                                                      const float (*s_m)[COLS], const float (*s_l)[COLS],
                                                      int ncols, const RowOf& row_of, int split, int hk) {
  const float vsc = a.v_scale ? a.v_scale[hk] : 1.0f;
  if constexpr (HD == 128) {
    if (a.out_q && a.splits == 1 && !a.partials) {
      // One warp per head row (the same per-element arithmetic as below), then its quantization.
      const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
      for (int h = warp; h < ncols; h += NW) {
        const int64_t r = row_of(h);
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int d = lane + 32 * j;
          float mx, den;
          const float ov = paged_mma_merged<HD, NW, COLS>(s_o, s_m, s_l, h, d, vsc, mx, den);
          paged_store_out(a.out, true, r * HD + d, ov);
          v[j] = paged_stored(true, ov);
        }
        paged_quantize_row(a, r, v, lane);
      }
      return;
    }
  }
  for (int i = static_cast<int>(threadIdx.x); i < ncols * HD; i += 32 * NW) {
    const int h = i / HD, d = i % HD;
    const int64_t r = row_of(h);
    if (r < 0) continue;  // a run's token without positions in this split
    float mx, den;
    const float ov = paged_mma_merged<HD, NW, COLS>(s_o, s_m, s_l, h, d, vsc, mx, den);
    if (a.splits == 1 && !a.partials) {
      paged_store_out(a.out, true, r * HD + d, ov);
    } else {
      const int64_t row = r * a.splits + split;
      a.part_o[row * HD + d] = ov;
      if (d == 0) a.part_lse[row] = mx + log2f(den);
    }
  }
}

// grid (T * Hkv, splits), block 32 * kMmaWarps, dynamic shared memory Cfg::kSmemBytes. q BF16.
template <int HD, class TP>
__global__ void __launch_bounds__(32 * kMmaWarps, PagedMmaCfg<HD, TP>::kMinBlocks) paged_mma_kernel(const PagedArgs a) {
  using Cfg = PagedMmaCfg<HD, TP>;
  constexpr int NW = kMmaWarps, S = Cfg::kStages, CPR = Cfg::kCpr, RB = Cfg::kRowBytes;
  __shared__ __align__(16) uint16_t s_q[kMmaRows][HD];  // q rows as MMA inputs (BF16 or FP16 bits)
  __shared__ float s_kq[kMmaRows];                      // score scale per head row
  __shared__ float s_m[NW][kMmaRows], s_l[NW][kMmaRows];
  unsigned char* smem = paged_dyn_smem();

  const int t = static_cast<int>(blockIdx.x) / a.Hkv, hk = static_cast<int>(blockIdx.x) % a.Hkv;
  const int split = static_cast<int>(blockIdx.y);
  const int len = a.token_pos[t] + 1;
  const int j0 = split * a.chunk;  // a multiple of kMmaTile (paged_mma_split)
  if (j0 >= len) return;           // uniform per CTA
  const int j1 = split == a.splits - 1 ? len : paged_imin(len, j0 + a.chunk);
  const int ntiles = (j1 - j0 + kMmaTile - 1) / kMmaTile;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, c = lane & 3, G = a.group;
  const int64_t head0 = static_cast<int64_t>(t) * a.Hq + static_cast<int64_t>(hk) * G;
  const int32_t* table = a.page_table + static_cast<int64_t>(a.token_seq[t]) * a.max_pages;
  const unsigned char* kpool = static_cast<const unsigned char*>(a.kpool) + static_cast<int64_t>(hk) * RB;
  const unsigned char* vpool = static_cast<const unsigned char*>(a.vpool) + static_cast<int64_t>(hk) * RB;
  const int64_t slot_bytes = static_cast<int64_t>(a.Hkv) * RB;  // bytes between cache slots
  unsigned char* wbuf = smem + warp * Cfg::kWarpBytes;           // this warp's stages
  const int nk = warp < ntiles ? (ntiles - warp + NW - 1) / NW : 0;  // its tiles: warp + NW * k

  // The cache slot of row lane % 16 of tile ti (positions j0 + 16 ti ...), -1 past the chunk.
  auto slot_of = [&](int ti) -> int {
    const int j = j0 + ti * kMmaTile + (lane & 15);
    if (j >= j1) return -1;
    int pi, off;
    if (a.ps_shift >= 0) pi = j >> a.ps_shift, off = j & (a.page_size - 1);
    else pi = j / a.page_size, off = j - pi * a.page_size;
    return table[pi] * a.page_size + off;
  };
  // Loads this warp's tile kt (< nk) into stage kt % S; `mine` is the slot of row lane % 16.
  auto issue = [&](int kt, int mine) {
    unsigned char* sk = wbuf + (kt % S) * Cfg::kStageBytes;
    unsigned char* sv = sk + Cfg::kTileBytes;
#pragma unroll
    for (int i = 0; i < kMmaTile * CPR / 32; ++i) {
      const int idx = i * 32 + lane, r = idx / CPR, q = idx % CPR;
      const int sl = paged_shfl(mine, r);
      const int64_t off = sl >= 0 ? static_cast<int64_t>(sl) * slot_bytes + q * 16 : 0;
      const int nb = sl >= 0 ? 16 : 0;  // rows past the chunk: zeros (P = 0 there, no NaN)
      paged_cp_async16(sk + r * RB + ((q ^ paged_kswz<CPR>(r)) << 4), kpool + off, nb);
      paged_cp_async16(sv + r * RB + ((q ^ paged_vswz<CPR>(r)) << 4), vpool + off, nb);
    }
  };
  // The first S - 1 tiles: their page-table entries loaded together, then one commit group per
  // tile (empty past nk: the group count is the tile count); the next tile's slot is loaded one
  // tile ahead of its issue.
  {
    int pre[S - 1];
#pragma unroll
    for (int st = 0; st < S - 1; ++st) pre[st] = st < nk ? slot_of(warp + NW * st) : -1;
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
      if (st < nk) issue(st, pre[st]);
      paged_cp_async_commit();
    }
  }
  int slot_next = S - 1 < nk ? slot_of(warp + NW * (S - 1)) : -1;

  // q rows of the group (one warp per row; rows >= group are zero) as MMA inputs, and their
  // score scales: fp8_attention s, or the FP16 power of two, times k_scale * scale * log2(e).
  const float ksc = a.k_scale ? a.k_scale[hk] : 1.0f;
  for (int h = warp; h < kMmaRows; h += NW) {
    constexpr int kPer = HD / 32;
    float x[kPer];
    const uint16_t* qrow = static_cast<const uint16_t*>(a.q) + (head0 + h) * HD;
#pragma unroll
    for (int i = 0; i < kPer; ++i) x[i] = h < G ? bf16_bits_to_float(qrow[lane + 32 * i]) : 0.0f;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) amax = fmaxf(amax, fabsf(x[i]));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float fs = 1.0f;
    if (a.fp8_q) {  // s = quant_scale_from_amax(amax, pow2 = false); the MMA takes e4m3(q / s)
      const float sq = fp8_scale_from_amax(amax, false);
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = fp8_e4m3_round(x[i] / sq);
      fs = sq;
    } else if (Cfg::kF16 && amax > 0.0f) {
      int e;
      frexpf(amax, &e);  // amax = m 2^e, m in [0.5, 1): amax 2^(15 - e) in [2^14, 2^15)
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = ldexpf(x[i], 15 - e);
      fs = ldexpf(1.0f, e - 15);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) s_q[h][lane + 32 * i] = Cfg::kF16 ? paged_f16_bits(x[i]) : bf16_bits_from_float(x[i]);
    if (lane == 0) s_kq[h] = fs * a.scale_log2 * ksc;
  }
  __syncthreads();
  uint32_t qa[Cfg::kKSteps][2];  // A fragments of q (row g), k-slots as paged_kdim
#pragma unroll
  for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
    qa[kk][0] = uint32_t(s_q[g][paged_kdim<Cfg>(c, kk, 0)]) | (uint32_t(s_q[g][paged_kdim<Cfg>(c, kk, 1)]) << 16);
    qa[kk][1] = uint32_t(s_q[g][paged_kdim<Cfg>(c, kk, 2)]) | (uint32_t(s_q[g][paged_kdim<Cfg>(c, kk, 3)]) << 16);
  }
  const float kq = s_kq[g];

  float o[Cfg::kNTiles][2];  // O[head g][dims paged_vdim(2c + e, nt)]
#pragma unroll
  for (int nt = 0; nt < Cfg::kNTiles; ++nt) o[nt][0] = o[nt][1] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // m: uniform over the 4 threads of row g; l: this thread's positions
  for (int k = 0; k < nk; ++k) {
    paged_cp_async_wait<S - 2>();  // tile k has landed (this thread's copies) ...
    __syncwarp();                  // ... and every lane's; stage (k - 1) % S is free
    if (const int kt = k + S - 1; kt < nk) {
      issue(kt, slot_next);
      slot_next = kt + 1 < nk ? slot_of(warp + NW * (kt + 1)) : -1;
    }
    paged_cp_async_commit();
    const unsigned char* sk = wbuf + (k % S) * Cfg::kStageBytes;
    const unsigned char* sv = sk + Cfg::kTileBytes;
    const int base = j0 + (warp + NW * k) * kMmaTile;

    // Scores of head g at positions base + 8 nt + 2c + e (base-2 logits), -inf past the chunk.
    float sc[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float d0 = 0.0f, d1 = 0.0f;
      const int r = nt * 8 + g;  // the K row this thread feeds (column g of B)
#pragma unroll
      for (int i = 0; i < Cfg::kKChunks; ++i) {
        const uint4 w = paged_lds16(sk + r * RB + (((4 * i + c) ^ paged_kswz<CPR>(r)) << 4));
        const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
        if constexpr (Cfg::kF16) {
#pragma unroll
          for (int j = 0; j < 4; ++j)
            paged_mma<true>(d0, d1, qa[4 * i + j][0], qa[4 * i + j][1], e4m3x2_lo_f16x2(ww[j]),
                            e4m3x2_hi_f16x2(ww[j]));
        } else {
          paged_mma<false>(d0, d1, qa[2 * i][0], qa[2 * i][1], ww[0], ww[1]);
          paged_mma<false>(d0, d1, qa[2 * i + 1][0], qa[2 * i + 1][1], ww[2], ww[3]);
        }
      }
      sc[nt][0] = base + nt * 8 + 2 * c < j1 ? d0 * kq : -INFINITY;
      sc[nt][1] = base + nt * 8 + 2 * c + 1 < j1 ? d1 * kq : -INFINITY;
    }
    // Online softmax (FP32) over the tile: row max over the 4 threads of the row.
    float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);     // finite: position base is in the chunk
    const float corr = exp2f(m - mn);  // 0 on the first tile (m = -inf)
    float p[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) p[nt][e] = exp2f(sc[nt][e] - mn);
    l = l * corr + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
    m = mn;
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTiles; ++nt) o[nt][0] *= corr, o[nt][1] *= corr;
    // P as the A fragment of P V: k-slots 2c, 2c + 1 = positions 2c + e, slots 2c + 8.. = 8 + 2c + e.
    const uint32_t pa0 = Cfg::kF16 ? paged_pack_f16x2(p[0][0], p[0][1]) : paged_pack_bf16x2(p[0][0], p[0][1]);
    const uint32_t pa2 = Cfg::kF16 ? paged_pack_f16x2(p[1][0], p[1][1]) : paged_pack_bf16x2(p[1][0], p[1][1]);

    // O += P V: B fragments from V rows 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1), column g.
    if constexpr (Cfg::kF16) {
      constexpr int VB = Cfg::kVDims;  // bytes of a row this thread reads: 16 (hd 128) or 8
      const int ch = (VB * g) >> 4, sub = (VB * g) & 15;
      auto vrow = [&](int r) { return sv + r * RB + (((ch ^ paged_vswz<CPR>(r)) << 4) | sub); };
      uint32_t w[4][VB / 4];  // rows 2c, 2c + 1, 2c + 8, 2c + 9
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) {
        const int r = 2 * c + (rr & 1) + 8 * (rr >> 1);
        if constexpr (VB == 16) {
          const uint4 u = paged_lds16(vrow(r));
          w[rr][0] = u.x, w[rr][1] = u.y, w[rr][2] = u.z, w[rr][3] = u.w;
        } else {
          const uint2 u = paged_lds8(vrow(r));
          w[rr][0] = u.x, w[rr][1] = u.y;
        }
      }
#pragma unroll
      for (int j = 0; j < VB / 4; ++j) {  // dims 4j .. 4j + 3 of this thread's: n-tiles 4j + e
        const uint32_t x0 = byte_perm(w[0][j], w[1][j], 0x5140), y0 = byte_perm(w[0][j], w[1][j], 0x7362);
        const uint32_t x1 = byte_perm(w[2][j], w[3][j], 0x5140), y1 = byte_perm(w[2][j], w[3][j], 0x7362);
        paged_mma<true>(o[4 * j][0], o[4 * j][1], pa0, pa2, e4m3x2_lo_f16x2(x0), e4m3x2_lo_f16x2(x1));
        paged_mma<true>(o[4 * j + 1][0], o[4 * j + 1][1], pa0, pa2, e4m3x2_hi_f16x2(x0), e4m3x2_hi_f16x2(x1));
        paged_mma<true>(o[4 * j + 2][0], o[4 * j + 2][1], pa0, pa2, e4m3x2_lo_f16x2(y0), e4m3x2_lo_f16x2(y1));
        paged_mma<true>(o[4 * j + 3][0], o[4 * j + 3][1], pa0, pa2, e4m3x2_hi_f16x2(y0), e4m3x2_hi_f16x2(y1));
      }
    } else {
#pragma unroll
      for (int h = 0; h < HD / 64; ++h) {  // 16-byte chunk g + 8h: n-tiles 8h .. 8h + 7
        const int q = g + 8 * h;
        uint32_t w[4][4];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int r = 2 * c + (rr & 1) + 8 * (rr >> 1);
          const uint4 u = paged_lds16(sv + r * RB + ((q ^ paged_vswz<CPR>(r)) << 4));
          w[rr][0] = u.x, w[rr][1] = u.y, w[rr][2] = u.z, w[rr][3] = u.w;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint32_t sel = (e & 1) ? 0x7632 : 0x5410;
          paged_mma<false>(o[8 * h + e][0], o[8 * h + e][1], pa0, pa2, byte_perm(w[0][e >> 1], w[1][e >> 1], sel),
                           byte_perm(w[2][e >> 1], w[3][e >> 1], sel));
        }
      }
    }
  }

  // Epilogue: the warps' streams merged by log-sum-exp through shared memory (the stages).
  paged_cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with its stages
  float* s_o = reinterpret_cast<float*>(smem);  // [NW][kMmaRows][HD]
  if (g < G) {
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) s_o[(warp * kMmaRows + g) * HD + paged_vdim<Cfg>(2 * c + e, nt)] = o[nt][e];
    if (c == 0) s_m[warp][g] = m, s_l[warp][g] = l;  // a warp without tiles: -inf, 0
  }
  __syncthreads();
  paged_mma_merge_warps<HD, NW>(a, s_o, s_m, s_l, G, [&](int h) { return head0 + h; }, split, hk);
}

// ---- the transposed tensor-core decode kernel (variants 1.., FP8RL_PAGED_VARIANT; kernels.h) --
// Same grid, split plan, partials, epilogue and numerics as paged_mma_kernel (FP32 scores and
// softmax, P rounded to the MMA input type, the same q scaling), with positions and head dims as
// the MMA rows instead of the heads, so no MMA operand is half zeros:
//   S^T[16 positions, 8 heads] = K[16 positions, 16 dims] Q^T[16 dims, 8 heads]         hd / 16 MMAs
//   O^T[16 dims, 8 heads]     += V^T[16 dims, 16 positions] P^T[16 positions, 8 heads]  hd / 16 MMAs
// per 16-position tile: half the MMAs of the kernel above, and no zero halves of operands for the
// compiler to rebuild in registers every tile (the kernel above spends more instructions on those
// moves than on its MMAs). P^T is S^T's exponentials transposed by two movmatrix per tile. Thread
// (g, c) holds the scores of positions g, g + 8 for heads 2c, 2c + 1 and the O^T rows (head dims)
// paged_tdim(g, mt, 0 / 1) of those heads. The shared-memory reads are the kernel above's (same
// swizzles, same bytes per thread). Also: each lane copies one row of a tile (row lane / 2, the
// 32-byte sectors 2i + lane % 2: no shuffles, one 64-bit address per tile), its page-table entry
// loaded two tiles ahead; q is loaded and converted in registers (no shared memory, no barrier
// before the loop); exp2 is one MUFU.EX2 (ex2.approx.ftz: values below 2^-126 are 0, far below
// the FP16 / BF16 rounding of P); the O rescale runs only when some head's running max rose by
// more than LAZY (base-2 logits; a warp vote): LAZY 0 rescales exactly when a max changed (the
// kernel above's values, whose rescale by exp2(0) = 1 is a no-op); LAZY > 0 keeps m behind the
// true max by at most LAZY, so P <= 2^LAZY (far from FP16's 65504) and l, O are relative to that
// m, which the merges take as it is.
// The ring's alignment: 256 bytes (the cp.async destinations are XORs below bit 8), 1024 for the
// TMA copies (the 128-byte swizzle's pattern repeats every 8 rows of 128 bytes).
constexpr int paged_ring_align(int copy) { return copy == 2 ? 1024 : 256; }
template <int HD, class TP, int S, int COPY = 0>
struct PagedTCfg : PagedMmaCfg<HD, TP> {
  using Base = PagedMmaCfg<HD, TP>;
  static constexpr int kWarpBytes = S * Base::kStageBytes;
  static constexpr int kAlign = paged_ring_align(COPY);
  static constexpr int kSmemBytes = kMmaWarps * kWarpBytes + kAlign;  // + the ring's alignment
  static constexpr int kMinBlocks = kSmemBytes > 75 * 1024 ? 2 : kSmemBytes > 56 * 1024 ? 3 : 4;
  static constexpr int kMTiles = HD / 16;  // P V MMAs per tile (16 dims each)
  static_assert(S >= 2, "a ring of at least two stages");
  static_assert(kMmaWarps * kWarpBytes >= kMmaWarps * kMmaRows * HD * 4, "the epilogue reuses the stages");
};
// The head dim of O^T row g (h = 0) or g + 8 (h = 1) of P V m-tile mt, for threads g.
template <class Cfg>
__device__ __forceinline__ int paged_tdim(int g, int mt, int h) {
  if constexpr (Cfg::kF16) return Cfg::kVDims * g + 4 * (mt >> 1) + 2 * (mt & 1) + h;  // bytes kVDims g ..
  else return 8 * (g + 8 * (mt >> 2)) + 2 * (mt & 3) + h;                              // chunks g, g + 8
}

// The TMA copies' layout (paged_mmat_kernel, COPY 2): chunk q (16 bytes) of tile row r at this
// byte of a K or V tile: rows of 128 bytes (a 256-byte BF16 row as two halves, each its own box
// of 16 rows), chunk q % 8 at (q % 8) ^ (r % 8) (TMA's 128-byte swizzle from a 1024-byte
// boundary); and the tile row that MMA row g reads.
__device__ __forceinline__ int paged_tma_off(int r, int q) {
  return (q >> 3) * (kMmaTile * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4);
}
__device__ __forceinline__ int paged_tma_row(int g) { return g ^ ((g & 1) << 2); }

// grid (T * Hkv, splits), block 32 * kMmaWarps, dynamic shared memory Cfg::kSmemBytes. q BF16,
// 16-byte aligned.
//
// MQ > 0 (the multi-query form; grid (runs * Hkv, splits)): a CTA serves a run of a.qruns, count
// consecutive tokens of one sequence, as the count x group columns of MQ blocks of 8 MMA columns
// (column h: token first + h / group, its head h % group of the KV head's group; a warp runs
// each block's MMAs on the same K / V fragments), so the run's K/V tiles are read once for all of
// them (the consistent mode's scoring: every token of a sequence is a query). Each
// column computes bitwise what the one-token CTA computes for it: a column's arithmetic never
// involves another column's values (MMA columns are independent, the softmax state is per
// column); the tiles and their order, warp by warp, are the chunk's, as in the one-token CTA;
// positions past the column's own token (its len, or its chunk end) are -inf scores, P = 0
// there, so l and O are unchanged (x 1, + 0: exact) and m as well; the lazy rescale's vote is
// taken over the columns of one token (the one-token CTA's vote is over its token's heads: its
// padding columns, whose q is zero, raise their max only on the first tile, where the real ones do);
// a column whose warp has seen none of its positions keeps m = -inf, l = 0, O = 0, as a warp
// without tiles does. Two conditions: the cached V rows of the run's positions are finite (P = 0
// times a non-finite V would be NaN where the one-token CTA never reads that row; the cache holds
// what kv_write stored from finite activations), and the runs are well formed (count x group <=
// MQ x kMmaRows, consecutive positions of one sequence, every token once: the caller builds them;
// the launcher checks only the bound on count). A block never splits a token's columns (8 is a
// multiple of the group), so each block's votes are the one-block form's.
// Two column blocks keep Q^T's fragments in shared memory (paged_mmat_q_smem: the same values,
// read per tile instead of held), so that they fit three CTAs per SM (at most 168 registers a
// thread; held in registers they took 197, two CTAs per SM, and ran slower than one block:
// session 18).
// Q^T's B fragments of one block of 8 MMA columns for thread (g, c): column g's q row `qrow`
// (zeros where !qin), k-slots as paged_kdim, scaled as in paged_mma_kernel (fp8_q: e4m3(q / s);
// FP16 MMAs: by the power of two that puts the row's amax in [2^14, 2^15)); and the score scales
// kq0, kq1 of this thread's columns 2c, 2c + 1. The one-token / query-run kernel and the wide
// query runs share it.
// The loads of paged_mmat_q_block, apart: thread (g, c)'s 16-byte words of column g's q row (zeros
// where !qin), so that a kernel can issue them before it waits for anything else.
template <class Cfg>
struct PagedQWords {
  uint4 w[Cfg::kKChunks][Cfg::kChunkDims / 8];
};
template <class Cfg>
__device__ __forceinline__ void paged_mmat_q_load(const uint16_t* qrow, bool qin, int c, PagedQWords<Cfg>& q) {
  constexpr int CD = Cfg::kChunkDims;
#pragma unroll
  for (int i = 0; i < Cfg::kKChunks; ++i)
#pragma unroll
    for (int u = 0; u < CD / 8; ++u)
      q.w[i][u] = qin ? paged_ld16(qrow + CD * (4 * i + c) + 8 * u) : make_uint4(0, 0, 0, 0);
}
template <class Cfg>
__device__ __forceinline__ void paged_mmat_q_block(const PagedArgs& a, const PagedQWords<Cfg>& q, float ksc, int c,
                                                   uint32_t (&qf)[Cfg::kKSteps][2], float& kq0, float& kq1) {
  constexpr int CD = Cfg::kChunkDims, KC = Cfg::kKChunks;
  constexpr bool F16 = Cfg::kF16;
  float x[KC][CD];  // dims CD (4i + c) .. + CD - 1 of column g's head
#pragma unroll
  for (int i = 0; i < KC; ++i)
#pragma unroll
    for (int u = 0; u < CD / 8; ++u) {
      const uint4 w = q.w[i][u];
      const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[i][8 * u + 2 * e] = bf16_bits_to_float(static_cast<uint16_t>(ww[e] & 0xffffu));
        x[i][8 * u + 2 * e + 1] = bf16_bits_to_float(static_cast<uint16_t>(ww[e] >> 16));
      }
    }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < KC; ++i)
#pragma unroll
    for (int d = 0; d < CD; ++d) amax = fmaxf(amax, fabsf(x[i][d]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  float fs = 1.0f;
  if (a.fp8_q) {  // s = quant_scale_from_amax(amax, pow2 = false); the MMA takes e4m3(q / s)
    const float sq = fp8_scale_from_amax(amax, false);
#pragma unroll
    for (int i = 0; i < KC; ++i)
#pragma unroll
      for (int d = 0; d < CD; ++d) x[i][d] = fp8_e4m3_round(x[i][d] / sq);
    fs = sq;
  } else if (F16 && amax > 0.0f) {
    // amax = f 2^e, f in [0.5, 1): q 2^(15 - e) has its amax in [2^14, 2^15), exactly as
    // paged_mma_kernel's frexpf / ldexpf (the power of two capped at 2^126: amax < 2^-111)
    const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 126;
    const int sh = e < -111 ? 126 : 15 - e;
    const float up = __uint_as_float(static_cast<uint32_t>(sh + 127) << 23);
#pragma unroll
    for (int i = 0; i < KC; ++i)
#pragma unroll
      for (int d = 0; d < CD; ++d) x[i][d] *= up;
    fs = __uint_as_float(static_cast<uint32_t>(127 - sh) << 23);
  }
#pragma unroll
  for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
    const int i = kk / Cfg::kMpc, d = 4 * (kk % Cfg::kMpc);
    qf[kk][0] = F16 ? paged_pack_f16x2(x[i][d], x[i][d + 1]) : paged_pack_bf16x2(x[i][d], x[i][d + 1]);
    qf[kk][1] = F16 ? paged_pack_f16x2(x[i][d + 2], x[i][d + 3]) : paged_pack_bf16x2(x[i][d + 2], x[i][d + 3]);
  }
  const float kqh = fs * a.scale_log2 * ksc;  // column g's
  kq0 = __uint_as_float(static_cast<uint32_t>(paged_shfl(static_cast<int>(__float_as_uint(kqh)), 8 * c)));
  kq1 = __uint_as_float(static_cast<uint32_t>(paged_shfl(static_cast<int>(__float_as_uint(kqh)), 8 * c + 4)));
}
template <class Cfg>
__device__ __forceinline__ void paged_mmat_q_block(const PagedArgs& a, const uint16_t* qrow, bool qin, float ksc,
                                                   int c, uint32_t (&qf)[Cfg::kKSteps][2], float& kq0, float& kq1) {
  PagedQWords<Cfg> q;
  paged_mmat_q_load<Cfg>(qrow, qin, c, q);
  paged_mmat_q_block<Cfg>(a, q, ksc, c, qf, kq0, kq1);
}
template <int MQ>
constexpr bool paged_mmat_q_smem() {
  return MQ >= 2;
}
template <int HD, class TP, int S, int MQ, int COPY>
constexpr int paged_mmat_min_blocks() {
  using Cfg = PagedTCfg<HD, TP, S, COPY>;
  return MQ >= 2 && Cfg::kMinBlocks > 3 ? 3 : Cfg::kMinBlocks;
}
template <int HD, class TP, int S, int LAZY, int COPY, int MQ = 0>
__global__ void __launch_bounds__(32 * kMmaWarps, paged_mmat_min_blocks<HD, TP, S, MQ, COPY>())
    paged_mmat_kernel(const __grid_constant__ PagedArgs a) {
  using Cfg = PagedTCfg<HD, TP, S, COPY>;
  constexpr int NW = kMmaWarps, CPR = Cfg::kCpr, RB = Cfg::kRowBytes, TB = Cfg::kTileBytes, SB = Cfg::kStageBytes;
  constexpr bool F16 = Cfg::kF16;
  constexpr int NB = MQ > 0 ? MQ : 1, COLS = NB * kMmaRows;  // MMA column blocks of 8, columns
  static_assert(NW * Cfg::kWarpBytes >= NW * COLS * HD * 4, "the epilogue's s_o fits in the stages");
  // TMA copies (COPY 2): rows of 128 bytes in the stage (a 256-byte BF16 row is two halves, each
  // its own 16 x 128-byte box), the 128-byte swizzle, an mbarrier per stage.
  constexpr bool kTma = COPY == 2;
  static_assert(!kTma || (HD == 128 && MQ == 0), "the TMA copies serve head_dim 128, one token per CTA");
  constexpr int RS = kTma ? 128 : RB;                  // bytes between a stage's rows
  constexpr int HS = kTma ? kMmaTile * 128 : 128;      // BF16 V: bytes from chunk q to q + 8 of a row
  __shared__ uint64_t s_bar[kTma ? NW * S : 1];  // 8-byte aligned, as an mbarrier must be
  __shared__ float s_m[NW][COLS], s_l[NW][COLS];
  // Q^T's fragments in shared memory (paged_mmat_q_smem): [block][k-step][register][lane], as every
  // warp holds them (the warps' copies are the same values).
  constexpr bool kQSmem = paged_mmat_q_smem<MQ>();
  __shared__ uint32_t s_qb[kQSmem ? NB * Cfg::kKSteps * 2 * 32 : 1];
  unsigned char* smem = paged_dyn_smem();

  const int hk = static_cast<int>(blockIdx.x) % a.Hkv;
  // The CTA's tokens: t (one) or the run t .. t + cnt - 1 (MQ).
  int t, cnt = 1;
  if constexpr (MQ) {
    t = a.qruns[2 * (static_cast<int>(blockIdx.x) / a.Hkv)];
    cnt = a.qruns[2 * (static_cast<int>(blockIdx.x) / a.Hkv) + 1];
  } else {
    t = static_cast<int>(blockIdx.x) / a.Hkv;
  }
  const int split = static_cast<int>(blockIdx.y);
  const int j0 = split * a.chunk;  // a multiple of kMmaTile (paged_mma_split)
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, c = lane & 3, G = a.group;
  const int64_t head0 = static_cast<int64_t>(t) * a.Hq + static_cast<int64_t>(hk) * G;
  // The output row (token, q head) of MMA column h: head0 + h for one token.
  auto col_row = [&](int h) -> int64_t {
    if constexpr (MQ) return static_cast<int64_t>(t + h / G) * a.Hq + static_cast<int64_t>(hk) * G + h % G;
    else return head0 + h;
  };
  const int ncols = cnt * G;  // the MMA columns that hold (token, head) pairs
  const int32_t* table = a.page_table + static_cast<int64_t>(a.token_seq[t]) * a.max_pages;
  // The row of a tile whose slot this lane loads (TMA: the tile's first; its 16 slots are
  // consecutive, page_size being a multiple of 16).
  const int own = COPY == 0 ? lane & 15 : COPY == 1 ? lane >> 1 : 0;
  // Row `own` of this warp's tile k: its position, the page-table entry of its page (the index
  // clamped to the row, so it can be read before the sequence's length is known), and the cache
  // slot that entry gives it (-1 past the chunk). Loads and their uses are kept apart (a warp
  // issues in order: a use waits for its load, and every instruction after it waits too).
  // Session 35's ncu source counters (E4M3, H100): a multiply right after each tile's entry load
  // stalled every warp a loaded memory latency per tile (15% of the stall samples), and the
  // prologue's chain of dependent loads (sequence, entry, slot, next slot, next-but-one slot, q)
  // another ~30%; with the loads two tiles ahead of their uses the wait moved to the move that
  // passes an entry on one tile later (10%: a loaded latency is longer than a tile).
  // Pages of a multiple of 16 slots hold a tile whole (one entry per tile): lane L holds the
  // entry of the warp's tile 32 w + L of window w (ecur: the window of the tile to be issued,
  // enext: the next, loaded a whole window ahead), and a tile's entry is a shuffle. Other page
  // sizes: each lane's row's own entry, loaded S + 1 tiles (the prologue) or two tiles ahead.
  auto pos_of = [&](int k) { return j0 + (warp + NW * k) * kMmaTile + own; };
  auto page_of = [&](int j) {
    return paged_imin(a.ps_shift >= 0 ? j >> a.ps_shift : j / a.page_size, a.max_pages - 1);
  };
  auto entry_of = [&](int k) -> int { return table[page_of(pos_of(k))]; };
  const bool tile_pages = (a.page_size & (kMmaTile - 1)) == 0;
  auto tile_entry = [&](int k) -> int { return table[page_of(j0 + (warp + NW * k) * kMmaTile)]; };
  int ecur = 0, enext = 0;
  int pre[S + 1] = {};  // the entries of tiles 0 .. S (other page sizes)
  if (tile_pages) {
    ecur = tile_entry(lane), enext = tile_entry(32 + lane);
  } else {
#pragma unroll
    for (int st = 0; st <= S; ++st) pre[st] = entry_of(st);
  }
  // One token's CTA: its q words now too, before anything waits (their use is after the first
  // tiles' copies).
  constexpr int NQ = NB == 1 ? 1 : 0;
  PagedQWords<Cfg> qw[NQ > 0 ? NQ : 1];
  if constexpr (NQ > 0) {
    const bool qin = g < ncols;
    paged_mmat_q_load<Cfg>(static_cast<const uint16_t*>(a.q) + (qin ? col_row(g) : 0) * HD, qin, c, qw[0]);
  }
  const float ksc = a.k_scale ? a.k_scale[hk] : 1.0f;
  int len = a.token_pos[t] + 1;  // MQ: the run's longest
  if constexpr (MQ)
    for (int i = 1; i < cnt; ++i) len = paged_imax(len, a.token_pos[t + i] + 1);
  if (j0 >= len) return;  // uniform per CTA
  const int j1 = split == a.splits - 1 ? len : paged_imin(len, j0 + a.chunk);
  const int ntiles = (j1 - j0 + kMmaTile - 1) / kMmaTile;
  // The chunk end of this thread's score columns 8b + 2c, 8b + 2c + 1 of block b (MQ: their
  // tokens'; j0 for a column without a token: every position masked).
  int j1c0[NB], j1c1[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) j1c0[b] = j1c1[b] = j1;
  if constexpr (MQ) {
    auto col_j1 = [&](int h) {
      if (h >= ncols) return j0;
      const int ln = a.token_pos[t + h / G] + 1;
      return split == a.splits - 1 ? ln : paged_imin(ln, j0 + a.chunk);
    };
#pragma unroll
    for (int b = 0; b < NB; ++b) j1c0[b] = col_j1(8 * b + 2 * c), j1c1[b] = col_j1(8 * b + 2 * c + 1);
  }
  // The slot of position j in the page of `entry` (-1 past the chunk); of row `own` of tile k.
  auto slot_at = [&](int j, int entry) -> int {
    if (j >= j1) return -1;
    return entry * a.page_size + (a.ps_shift >= 0 ? j & (a.page_size - 1) : j % a.page_size);
  };
  auto slot_of = [&](int k, int entry) { return slot_at(pos_of(k), entry); };
  const unsigned char* kpool = static_cast<const unsigned char*>(a.kpool) + static_cast<int64_t>(hk) * RB;
  const unsigned char* vpool = static_cast<const unsigned char*>(a.vpool) + static_cast<int64_t>(hk) * RB;
  const uint32_t slot_bytes = static_cast<uint32_t>(a.Hkv) * RB;  // bytes between cache slots
  // The warps' rings, from a kAlign-byte boundary (the copy destinations below are XORs; TMA's
  // swizzle pattern starts at a 1024-byte boundary).
  const paged_saddr_t sbase = paged_saddr(smem);
  const int pad = static_cast<int>((Cfg::kAlign - (sbase & (Cfg::kAlign - 1u))) & (Cfg::kAlign - 1u));
  unsigned char* ring = smem + pad;
  const unsigned char* wbuf = ring + warp * Cfg::kWarpBytes;  // this warp's stages
  const paged_saddr_t wsa = sbase + static_cast<paged_saddr_t>(pad + warp * Cfg::kWarpBytes);
  const int nk = warp < ntiles ? (ntiles - warp + NW - 1) / NW : 0;  // its tiles: warp + NW * k

  // Copies, two ways (COPY): 0 (lines): instruction i of a tile's K (V) copy brings rows
  // RPI i .. RPI i + RPI - 1 whole, CPR lanes per row (full 128-byte lines per instruction, as
  // paged_mma_kernel), lane: row r0 + RPI i, chunk cq; the rows' slots come by shuffles from the
  // lanes that own them (lane l: row l % 16). 1 (rows): lane l brings row l / 2 of the tile,
  // chunks 2i + l % 2 (one 32-byte sector of a row per instruction), and owns that row's slot (no
  // shuffles, one address per tile). Either way chunk q of row r lands at q ^ kswz(r) (K),
  // q ^ vswz(r) (V): for lines the K swizzle is the same for all of a lane's rows (RPI is even)
  // and the V one repeats every VP instructions; for rows they flip bits of i only (chunk 2i + cb
  // at koff ^ 32i, voff ^ 32i from a 256-byte aligned stage).
  constexpr int RPI = 32 / CPR, NI = kMmaTile / RPI;  // lines: rows per instruction, instructions per tile
  constexpr int VP = CPR < 8 ? 1 : RPI == 4 ? 2 : 4;  // lines: period of the V swizzle over i
  const int r0 = COPY == 0 ? lane / CPR : lane >> 1, cq = COPY == 0 ? lane % CPR : lane & 1;
  const paged_saddr_t koff =
      paged_keep(wsa + static_cast<paged_saddr_t>(r0 * RB + ((COPY == 0 ? cq ^ paged_kswz<CPR>(r0) : cq) << 4) +
                                                  (COPY == 0 ? 0 : paged_kswz<CPR>(r0) << 4)));
  const paged_saddr_t voff = paged_keep(
      wsa + static_cast<paged_saddr_t>(TB + r0 * RB + (cq << 4) + (COPY == 0 ? 0 : paged_vswz<CPR>(r0) << 4)));
  uint32_t vx[VP];  // lines: the V swizzle of instruction i's row (byte offset XOR), i % VP
#pragma unroll
  for (int p = 0; p < VP; ++p)
    vx[p] = COPY == 0 ? paged_keep(static_cast<uint32_t>(paged_vswz<CPR>(r0 + RPI * p) << 4)) : 0u;
  // + slot * slot_bytes (+ 32 i: rows): this lane's bytes of a row
  const uint64_t kcopy = paged_keep(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(kpool + 16 * cq)));
  const uint64_t vcopy = paged_keep(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(vpool + 16 * cq)));
  auto src_of = [](uint64_t base, uint32_t slot, uint32_t sb) {
    return reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(base + static_cast<uint64_t>(slot) * sb));
  };
  // TMA: the stages' mbarriers (this warp's S), armed and issued by lane 0.
  const paged_saddr_t wbar = paged_saddr(&s_bar[0]) + static_cast<paged_saddr_t>(kTma ? warp * S * 8 : 0);
  if constexpr (kTma) {
    if (lane == 0) {
#pragma unroll
      for (int st = 0; st < S; ++st) paged_mbar_init(wbar + 8 * st);
      paged_fence_proxy_async();
    }
    __syncwarp();
  }
  // Loads a tile into the stage at byte `stage` of the ring; mine: the slot of row `own`.
  // Rows past the chunk (slot -1) are zeros (P = 0 there, no NaN); TMA copies them from the
  // cache as they are (their page is the sequence's), and the reads mask them (K: -inf scores;
  // V: zeros in registers).
  auto issue = [&](int stage, int mine) {
    const paged_saddr_t dk = koff + static_cast<paged_saddr_t>(stage), dv = voff + static_cast<paged_saddr_t>(stage);
    if constexpr (kTma) {
      if (lane == 0) {
        const paged_saddr_t bar = wbar + static_cast<paged_saddr_t>(8 * (stage / SB));
        const paged_saddr_t dst = wsa + static_cast<paged_saddr_t>(stage);
        paged_mbar_expect_tx(bar, 2 * TB);
#pragma unroll
        for (int h = 0; h < RB / 128; ++h) {
          paged_tma_rows(dst + h * HS, &a.kmap, bar, 128 * h, hk, mine);
          paged_tma_rows(dst + TB + h * HS, &a.vmap, bar, 128 * h, hk, mine);
        }
      }
    } else if constexpr (COPY == 0) {
      paged_saddr_t dvx[VP];  // (dv + RPI i RB) ^ vx = (dv ^ vx) + RPI i RB: the XOR is below bit 7
#pragma unroll
      for (int p = 0; p < VP; ++p) dvx[p] = dv ^ vx[p];
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int sl = paged_shfl(mine, r0 + RPI * i);
        const uint32_t su = sl >= 0 ? static_cast<uint32_t>(sl) : 0u;
        paged_cp_async16z(dk + static_cast<paged_saddr_t>(RPI * i * RB), src_of(kcopy, su, slot_bytes), sl < 0);
        paged_cp_async16z(dvx[i % VP] + static_cast<paged_saddr_t>(RPI * i * RB), src_of(vcopy, su, slot_bytes),
                          sl < 0);
      }
    } else {
      const uint32_t su = mine >= 0 ? static_cast<uint32_t>(mine) : 0u;
      const unsigned char* ks = src_of(kcopy, su, slot_bytes);
      const unsigned char* vs = src_of(vcopy, su, slot_bytes);
#pragma unroll
      for (int i = 0; i < CPR / 2; ++i) {
        paged_cp_async16z(dk ^ static_cast<paged_saddr_t>(32 * i), ks + 32 * i, mine < 0);
        paged_cp_async16z(dv ^ static_cast<paged_saddr_t>(32 * i), vs + 32 * i, mine < 0);
      }
    }
  };
  // The first S - 1 tiles (one commit group each, empty past nk: the group count is the tile
  // count); the slots of the next two are loaded ahead.
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < nk) issue(st * SB, slot_of(st, tile_pages ? paged_shfl(ecur, st) : pre[st]));
    if constexpr (!kTma) paged_cp_async_commit();
  }
  int entry_n1 = pre[S - 1], entry_n2 = pre[S];  // other page sizes: tiles k + S - 1 and k + S at tile k
  // The entry of tile kn = k + S - 1, issued at tile k (kn rises by one per tile).
  auto entry_next = [&](int kn) -> int {
    if (tile_pages) {
      if ((kn & 31) == 0) ecur = enext, enext = tile_entry(kn + 32 + lane);  // a new window
      return paged_shfl(ecur, kn & 31);
    }
    const int e = entry_n1;
    entry_n1 = entry_n2;
    entry_n2 = entry_of(kn + 2);
    return e;
  };

  // Q^T's B fragments (head g, k-slots as paged_kdim; zero for g >= group), from q in registers,
  // scaled as in paged_mma_kernel; the score scales of this thread's heads 2c, 2c + 1 (MQ: block
  // b's columns 8b + g and 8b + 2c, 8b + 2c + 1).
  uint32_t qb[kQSmem ? 1 : NB][Cfg::kKSteps][2];  // held in registers without kQSmem
  auto q_slot = [&](int b, int kk, int r) { return ((b * Cfg::kKSteps + kk) * 2 + r) * 32 + lane; };
  auto q_put = [&](int b, int kk, int r, uint32_t v) {
    if constexpr (kQSmem) {
      if (warp == 0) s_qb[q_slot(b, kk, r)] = v;
    } else {
      qb[b][kk][r] = v;
    }
  };
  auto q_frag = [&](int b, int kk, int r) -> uint32_t {
    if constexpr (kQSmem) return s_qb[q_slot(b, kk, r)];
    else return qb[b][kk][r];
  };
  float kq0[NB], kq1[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    uint32_t qf[Cfg::kKSteps][2];
    if constexpr (NQ > 0) {  // loaded above
      paged_mmat_q_block<Cfg>(a, qw[0], ksc, c, qf, kq0[b], kq1[b]);
    } else {
      const bool qin = 8 * b + g < ncols;  // a column of a (token, head); else zeros
      const uint16_t* qrow = static_cast<const uint16_t*>(a.q) + (qin ? col_row(8 * b + g) : 0) * HD;
      paged_mmat_q_block<Cfg>(a, qrow, qin, ksc, c, qf, kq0[b], kq1[b]);
    }
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) q_put(b, kk, 0, qf[kk][0]), q_put(b, kk, 1, qf[kk][1]);
  }
  if constexpr (kQSmem) __syncthreads();  // warp 0's fragments are in s_qb (every CTA thread is here)

  // O^T of block b: dims paged_tdim(g, mt, 0) (o[b][mt][0..1]), (g, mt, 1) ([2..3]) x heads 2c, 2c + 1
  float o[NB][Cfg::kMTiles][4];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) o[b][mt][0] = o[b][mt][1] = o[b][mt][2] = o[b][mt][3] = 0.0f;
  float m0[NB], m1[NB];  // heads 2c, 2c + 1: uniform over the 8 threads of column c
  float l0[NB], l1[NB];  // this thread's positions
#pragma unroll
  for (int b = 0; b < NB; ++b) m0[b] = m1[b] = -INFINITY, l0[b] = l1[b] = 0.0f;
  // Read offsets in a stage: K rows g (+ 8 RB: g + 8), chunks 4i + c swizzled; V row 2c (+ RB,
  // 8 RB, 9 RB: rows 2c + 1, 2c + 8, 2c + 9, which share its swizzle).
  // TMA: MMA row g (and g + 8) is the tile's row pg = g ^ 4 for odd g (and pg + 8), so that the
  // 128-byte swizzle leaves the K reads conflict-free (a quarter-warp's rows g = 2m, 2m + 1 put
  // chunks c at c ^ pg: 0..3 and 4..7); the positions follow: S^T's row g is position pg, P V's
  // k-slots 2c, 2c + 1 are V rows 2c (= pg(2c)) and pv1 = pg(2c + 1), whose chunk g is
  // conflict-free as well (rows 0, 2, 4, 6 and 5, 7, 1, 3 against g = 0, 1).
  const int pg = kTma ? paged_tma_row(g) : g, pv1 = kTma ? paged_tma_row(2 * c + 1) : 2 * c + 1;
  uint32_t kro[Cfg::kKChunks];
#pragma unroll
  for (int i = 0; i < Cfg::kKChunks; ++i)
    kro[i] = paged_keep(static_cast<uint32_t>(kTma ? paged_tma_off(pg, 4 * i + c)
                                                   : g * RB + (((4 * i + c) ^ paged_kswz<CPR>(g)) << 4)));
  constexpr int VQ = F16 ? Cfg::kVDims / 16 : 1;  // TMA: V chunk g * VQ (E4M3 hd 128: bytes 16 g ..)
  const uint32_t vro = paged_keep(static_cast<uint32_t>(
      kTma  ? TB + paged_tma_off(2 * c, VQ * g)
      : F16 ? TB + 2 * c * RB + ((((Cfg::kVDims * g) >> 4) ^ paged_vswz<CPR>(2 * c)) << 4) + ((Cfg::kVDims * g) & 15)
            : TB + 2 * c * RB + ((g ^ paged_vswz<CPR>(2 * c)) << 4)));
  const uint32_t vro1 = kTma ? paged_keep(static_cast<uint32_t>(TB + paged_tma_off(pv1, VQ * g))) : vro + RB;
  // TMA: rows past the chunk are the cache's bytes, not zeros: V's are zeroed in registers on the
  // chunk's last tile (K's give -inf scores). Row of V word set rr (2c, pv1, 2c + 8, pv1 + 8).
  auto vrow_of = [&](int rr) { return (rr & 1 ? pv1 : 2 * c) + 8 * (rr >> 1); };
  uint32_t phase = 0;  // TMA: the parity of the current stage's mbarrier phase
  int cur = 0, prev = (S - 1) * SB;  // the stages of tiles k and k - 1 (where tile k + S - 1 goes)
  for (int k = 0; k < nk; ++k) {
    if constexpr (kTma) {
      paged_mbar_wait(wbar + static_cast<paged_saddr_t>(8 * (cur / SB)), phase);  // tile k has landed
    } else {
      paged_cp_async_wait<S - 2>();  // tile k has landed (this thread's copies) ...
    }
    __syncwarp();  // ... and every lane's; stage (k - 1) % S is free (every lane is past tile k - 1)
    if (k + S - 1 < nk) issue(prev, slot_of(k + S - 1, entry_next(k + S - 1)));
    if constexpr (!kTma) paged_cp_async_commit();
    const unsigned char* st = wbuf + cur;
    prev = cur;
    cur = cur + SB == S * SB ? 0 : cur + SB;
    if (cur == 0) phase ^= 1u;
    const int base = j0 + (warp + NW * k) * kMmaTile;
    const bool vmask = kTma && base + kMmaTile > j1;  // TMA: rows past the chunk to zero

    // S^T = K Q^T: K rows g and g + 8 as A (their 16-byte chunks 4i + c), two accumulator chains
    // per column block (the A fragments converted once for all blocks).
    float sa[NB][4], sb[NB][4];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int r = 0; r < 4; ++r) sa[b][r] = sb[b][r] = 0.0f;
#pragma unroll
    for (int i = 0; i < Cfg::kKChunks; ++i) {
      const uint4 u0 = paged_lds16(st + kro[i]), u1 = paged_lds16(st + kro[i] + 8 * RS);
      const uint32_t w0[4] = {u0.x, u0.y, u0.z, u0.w}, w1[4] = {u1.x, u1.y, u1.z, u1.w};
      if constexpr (F16) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t x[4] = {e4m3x2_lo_f16x2(w0[j]), e4m3x2_lo_f16x2(w1[j]),
                                 e4m3x2_hi_f16x2(w0[j]), e4m3x2_hi_f16x2(w1[j])};
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            if (j & 1) paged_mma4<true>(sb[b], x, q_frag(b, 4 * i + j, 0), q_frag(b, 4 * i + j, 1));
            else paged_mma4<true>(sa[b], x, q_frag(b, 4 * i + j, 0), q_frag(b, 4 * i + j, 1));
          }
        }
      } else {
        const uint32_t x0[4] = {w0[0], w1[0], w0[1], w1[1]}, x1[4] = {w0[2], w1[2], w0[3], w1[3]};
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          paged_mma4<false>(sa[b], x0, q_frag(b, 2 * i, 0), q_frag(b, 2 * i, 1));
          paged_mma4<false>(sb[b], x1, q_frag(b, 2 * i + 1, 0), q_frag(b, 2 * i + 1, 1));
        }
      }
    }
    uint32_t b0[NB], b1[NB];  // P^T of each block: the B fragments of P V
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      // Base-2 logits of positions base + g (x0*) and base + g + 8 (x1*), -inf past the chunk (of
      // the column's token).
      const float x00 = base + pg < j1c0[b] ? (sa[b][0] + sb[b][0]) * kq0[b] : -INFINITY;
      const float x01 = base + pg < j1c1[b] ? (sa[b][1] + sb[b][1]) * kq1[b] : -INFINITY;
      const float x10 = base + pg + 8 < j1c0[b] ? (sa[b][2] + sb[b][2]) * kq0[b] : -INFINITY;
      const float x11 = base + pg + 8 < j1c1[b] ? (sa[b][3] + sb[b][3]) * kq1[b] : -INFINITY;
      float mx0 = fmaxf(x00, x10), mx1 = fmaxf(x01, x11);
  #pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, sh));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, sh));
      }
      // finite where the column's token has a position in the tile (one token: position base does)
      const bool up0 = LAZY == 0 ? mx0 > m0[b] : mx0 > m0[b] + static_cast<float>(LAZY);
      const bool up1 = LAZY == 0 ? mx1 > m1[b] : mx1 > m1[b] + static_cast<float>(LAZY);
      bool rescale, r0 = true, r1 = true;  // the warp's vote; MQ: each column's token's vote
      if constexpr (MQ) {
        // OR over the columns of one token: the 8 threads of this thread's columns (lanes 4g' + c),
        // and the threads of the token's other column pairs (group 4: c ^ 1; group 8: all).
        int v = G >= 2 ? (up0 || up1 ? 3 : 0) : (up0 ? 1 : 0) | (up1 ? 2 : 0);
  #pragma unroll
        for (int sh = 4; sh < 32; sh <<= 1) v |= paged_shfl_xor(v, sh);
        if (G >= 4) v |= paged_shfl_xor(v, 1);
        if (G >= 8) v |= paged_shfl_xor(v, 2);
        r0 = (v & 1) != 0, r1 = (v & 2) != 0;
        rescale = paged_any(r0 || r1);
      } else {
        rescale = paged_any(up0 || up1);
      }
      if (rescale) {
        const float n0 = r0 ? fmaxf(m0[b], mx0) : m0[b], n1 = r1 ? fmaxf(m1[b], mx1) : m1[b];
        // 0 on the column's first tile (m = -inf); 1 (no change) for a column whose token did not vote
        const float c0 = r0 ? paged_ex2(m0[b] - n0) : 1.0f, c1 = r1 ? paged_ex2(m1[b] - n1) : 1.0f;
        m0[b] = n0, m1[b] = n1, l0[b] *= c0, l1[b] *= c1;
  #pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
          o[b][mt][0] *= c0, o[b][mt][1] *= c1, o[b][mt][2] *= c0, o[b][mt][3] *= c1;
      }
      // MQ: a column still at m = -inf has only -inf scores so far (P = 0, not 2^NaN).
      const float e0 = MQ && m0[b] == -INFINITY ? 0.0f : m0[b], e1 = MQ && m1[b] == -INFINITY ? 0.0f : m1[b];
      const float p00 = paged_ex2(x00 - e0), p01 = paged_ex2(x01 - e1);
      const float p10 = paged_ex2(x10 - e0), p11 = paged_ex2(x11 - e1);
      l0[b] += p00 + p10;
      l1[b] += p01 + p11;
      // P^T as the B fragment of P V: (positions 2c, 2c + 1 | 2c + 8, 2c + 9) x head g.
      b0[b] = paged_movm_t(F16 ? paged_pack_f16x2(p00, p01) : paged_pack_bf16x2(p00, p01));
      b1[b] = paged_movm_t(F16 ? paged_pack_f16x2(p10, p11) : paged_pack_bf16x2(p10, p11));
    }

    // O^T += V^T P^T: A fragments from V rows 2c, 2c + 1 (k-slots 2c, 2c + 1) and 2c + 8, 2c + 9.
    if constexpr (F16) {
      constexpr int VB = Cfg::kVDims;  // bytes of a row this thread reads: 16 (hd 128) or 8
      uint32_t w[4][VB / 4];           // rows 2c, 2c + 1, 2c + 8, 2c + 9
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) {
        const unsigned char* vp = st + (rr & 1 ? vro1 : vro) + 8 * RS * (rr >> 1);
        if constexpr (VB == 16) {
          const uint4 u = paged_lds16(vp);
          w[rr][0] = u.x, w[rr][1] = u.y, w[rr][2] = u.z, w[rr][3] = u.w;
        } else {
          const uint2 u = paged_lds8(vp);
          w[rr][0] = u.x, w[rr][1] = u.y;
        }
        if (vmask && base + vrow_of(rr) >= j1) {
#pragma unroll
          for (int j = 0; j < VB / 4; ++j) w[rr][j] = 0;
        }
      }
#pragma unroll
      for (int j = 0; j < VB / 4; ++j) {  // this thread's dims 4j .. 4j + 3: m-tiles 2j, 2j + 1
        const uint32_t x0 = byte_perm(w[0][j], w[1][j], 0x5140), y0 = byte_perm(w[0][j], w[1][j], 0x7362);
        const uint32_t x1 = byte_perm(w[2][j], w[3][j], 0x5140), y1 = byte_perm(w[2][j], w[3][j], 0x7362);
        const uint32_t ax[4] = {e4m3x2_lo_f16x2(x0), e4m3x2_hi_f16x2(x0), e4m3x2_lo_f16x2(x1),
                                e4m3x2_hi_f16x2(x1)};
        const uint32_t ay[4] = {e4m3x2_lo_f16x2(y0), e4m3x2_hi_f16x2(y0), e4m3x2_lo_f16x2(y1),
                                e4m3x2_hi_f16x2(y1)};
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          paged_mma4<true>(o[b][2 * j], ax, b0[b], b1[b]);
          paged_mma4<true>(o[b][2 * j + 1], ay, b0[b], b1[b]);
        }
      }
    } else {
#pragma unroll
      for (int h = 0; h < HD / 64; ++h) {  // 16-byte chunk g + 8h ((g + 8h) ^ 2c = (g ^ 2c) + 8h): m-tiles 4h ..
        uint32_t w[4][4];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const uint4 u = paged_lds16(st + (rr & 1 ? vro1 : vro) + 8 * RS * (rr >> 1) + HS * h);
          w[rr][0] = u.x, w[rr][1] = u.y, w[rr][2] = u.z, w[rr][3] = u.w;
          if (vmask && base + vrow_of(rr) >= j1) w[rr][0] = w[rr][1] = w[rr][2] = w[rr][3] = 0;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t ax[4] = {byte_perm(w[0][e], w[1][e], 0x5410), byte_perm(w[0][e], w[1][e], 0x7632),
                                  byte_perm(w[2][e], w[3][e], 0x5410), byte_perm(w[2][e], w[3][e], 0x7632)};
#pragma unroll
          for (int b = 0; b < NB; ++b) paged_mma4<false>(o[b][4 * h + e], ax, b0[b], b1[b]);
        }
      }
    }
    // TMA: this lane's reads of the stage ordered before the refill that lane 0 issues into it at
    // the next iteration, after __syncwarp (ordinary loads, then an async-proxy write of the same
    // bytes: the PTX memory model's proxy fence).
    if (kTma && k + S < nk) paged_fence_proxy_async();
  }

  // Epilogue: the warps' streams merged by log-sum-exp through shared memory (the stages).
  paged_cp_async_wait<0>();
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int sh = 4; sh < 32; sh <<= 1) {
      l0[b] += __shfl_xor_sync(0xffffffffu, l0[b], sh);
      l1[b] += __shfl_xor_sync(0xffffffffu, l1[b], sh);
    }
  __syncthreads();  // every warp is done with its stages
  float* s_o = reinterpret_cast<float*>(ring);  // [NW][COLS][HD]
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const int h0 = 8 * b + 2 * c, h1 = h0 + 1;
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int d = paged_tdim<Cfg>(g, mt, hh);
        if (h0 < ncols) s_o[(warp * COLS + h0) * HD + d] = o[b][mt][2 * hh];
        if (h1 < ncols) s_o[(warp * COLS + h1) * HD + d] = o[b][mt][2 * hh + 1];
      }
    if (g == 0)  // -inf, 0: no tiles
      s_m[warp][h0] = m0[b], s_m[warp][h1] = m1[b], s_l[warp][h0] = l0[b], s_l[warp][h1] = l1[b];
  }
  __syncthreads();
  // MQ: a run's token without positions in this split writes nothing (the combine does not read it).
  paged_mma_merge_warps<HD, NW, COLS>(
      a, s_o, s_m, s_l, ncols,
      [&](int h) -> int64_t { return !MQ || a.token_pos[t + h / G] + 1 > j0 ? col_row(h) : int64_t{-1}; }, split, hk);
}

// ---- wide query runs (paged_wide_kernel): the consistent trainer's attention ----------------
// The query-run form above converts each K / V tile once per warp for 8 MMA columns (4 tokens at
// the 1.7B group) and re-reads the run's whole prefix per CTA. Here a CTA of kWideWarps warps
// serves a run of up to kWideWarps x 8 / group consecutive tokens of one sequence (warp w: tokens
// w x 8 / group ..., one block of 8 MMA columns, as a one-block run), so each tile is read and
// converted once for 64 columns. What a column's bits depend on is the decode CTA's plan: its
// chunk's 16-position tiles dealt to kMmaWarps warps (warp p: tiles p, p + 4, ...), each warp's
// own (m, l, O^T) with the lazy rescale voted per token, the warps merged in order. The wide CTA
// replays that with the decode warps as passes: every warp keeps the four (m, l, O^T) of its
// columns in registers and folds tile k into state k % 4, in the order of the tiles (each pass's
// tiles in its own order: the same sequence of operations per state as the decode warp's), then
// merges the four states in registers with the epilogue's arithmetic (paged_merge_row / _value). A
// stage holds four tiles (one per pass: 64 positions), copied by the whole CTA (one row of a
// tile per 32 W / 64 threads) and converted once, by the whole CTA, into the MMA's A fragments in
// (fragment, lane) order — the same registers the one-block kernel builds per warp from the same
// swizzled stage, so the same MMA operands in the same k-slots and the same accumulation chains:
// every column bitwise paged_mmat_kernel<..., MQ = 1>'s, hence the one-token CTA's. A warp skips
// the tiles past its own tokens' ends (they would be masked no-ops, as in the one-block kernel,
// whose runs end there).
// A run is kWideWarps blocks of 8 columns (64 columns); a CTA of W warps serves W of its blocks:
// 8 (the default), or 4 (FP8RL_WIDE_CTA_WARPS=4: two CTAs per run and per SM; measured slower on
// the H100, 373 against 359 us: session 25).
constexpr int kWideWarps = 8;
template <int HD, class TP>
struct PagedWideCfg : PagedMmaCfg<HD, TP> {
  using Base = PagedMmaCfg<HD, TP>;
  static constexpr int kMTiles = HD / 16;                         // P V m-tiles (16 head dims each)
  static constexpr int kFrags = Base::kKSteps + kMTiles;          // a tile's A fragments: K steps, V m-tiles
  static constexpr int kTileFragBytes = kFrags * 32 * 16;         // (fragment, lane) order, 16 bytes each
  static constexpr int kGroupTiles = kMmaWarps;                   // tiles per stage: one per pass
  static constexpr int kRawBytes = kGroupTiles * Base::kStageBytes;   // a stage of raw tiles (K, V each)
  static constexpr int kFragBytes = kGroupTiles * kTileFragBytes;     // a buffer of converted tiles
  static constexpr int kStages = 3;
  static constexpr int kSmemBytes = kStages * kRawBytes + 2 * kFragBytes + 256;  // + alignment to 256 bytes
  static_assert(Base::kCpr % 4 == 0, "up to four threads per row copy whole 16-byte chunks");
};
__device__ __forceinline__ uint32_t paged_lds4(const unsigned char* p) { return *reinterpret_cast<const uint32_t*>(p); }

// grid (runs * kWideWarps / W * Hkv, splits), block 32 * W, dynamic shared memory
// PagedWideCfg::kSmemBytes; a.qruns: runs of consecutive tokens of one sequence at consecutive
// positions (count <= kWideWarps * 8 / group; group 1, 2, 4 or 8); q BF16, 16-byte aligned; no
// fused FP8 output.
template <int HD, class TP, int LAZY, int W>
__global__ void __launch_bounds__(32 * W, W == kWideWarps ? 1 : 2) paged_wide_kernel(const PagedArgs a) {
  using Cfg = PagedWideCfg<HD, TP>;
  constexpr int NP = kMmaWarps, S = Cfg::kStages, PARTS = kWideWarps / W;
  constexpr int TPR = 32 * W / (Cfg::kGroupTiles * kMmaTile);  // copying threads per row of a stage
  static_assert(kWideWarps % W == 0 && TPR >= 1 && TPR <= 4 && Cfg::kCpr % TPR == 0, "copy mapping");
  constexpr int CPR = Cfg::kCpr, RB = Cfg::kRowBytes, TB = Cfg::kTileBytes, SB = Cfg::kStageBytes;
  constexpr int KS = Cfg::kKSteps, MT = Cfg::kMTiles, TFB = Cfg::kTileFragBytes;
  constexpr int RAW = Cfg::kRawBytes, FRAG = Cfg::kFragBytes, GT = NP * kMmaTile;
  constexpr bool F16 = Cfg::kF16;
  unsigned char* smem = paged_dyn_smem();
  const paged_saddr_t sbase = paged_saddr(smem);
  const int pad = static_cast<int>((256u - (sbase & 255u)) & 255u);
  unsigned char* raw = smem + pad;       // S stages of NP raw tiles
  unsigned char* frag = raw + S * RAW;   // two buffers of NP converted tiles
  const paged_saddr_t raw_sa = sbase + static_cast<paged_saddr_t>(pad);

  const int hk = static_cast<int>(blockIdx.x) % a.Hkv, cta = static_cast<int>(blockIdx.x) / a.Hkv;
  const int run = cta / PARTS, part = cta % PARTS;  // this CTA: the run's blocks part W .. part W + W - 1
  const int split = static_cast<int>(blockIdx.y), j0 = split * a.chunk;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int G = a.group, per = kMmaRows / G;  // tokens per warp
  const int rt0 = a.qruns[2 * run], n_run = a.qruns[2 * run + 1];
  const int t0 = rt0 + part * W * per, n_cta = paged_imin(n_run - part * W * per, W * per);  // the CTA's tokens
  if (n_cta <= 0) return;  // uniform per CTA
  const int t = t0 + warp * per, cnt = paged_imax(0, paged_imin(per, n_cta - warp * per));
  const int ncols = cnt * G;
  // The positions are consecutive: the CTA's last token is its longest.
  const int len = a.token_pos[t0 + n_cta - 1] + 1;
  if (j0 >= len) return;  // uniform per CTA
  const bool last = split == a.splits - 1;
  const int j1 = last ? len : paged_imin(len, j0 + a.chunk);
  const int ngroups = (j1 - j0 + GT - 1) / GT;
  // This warp's end (j0: no positions here) and its columns' (chunk ends of their tokens).
  auto tok_j1 = [&](int tok) {
    const int ln = a.token_pos[tok] + 1;
    return ln <= j0 ? j0 : last ? ln : paged_imin(ln, j0 + a.chunk);
  };
  const int j1w = cnt > 0 ? tok_j1(t + cnt - 1) : j0;
  const int j1c0 = 2 * c < ncols ? tok_j1(t + 2 * c / G) : j0;
  const int j1c1 = 2 * c + 1 < ncols ? tok_j1(t + (2 * c + 1) / G) : j0;

  // Copies: thread tid brings row tid / TPR of a stage (tile (tid / TPR) / 16, its row
  // (tid / TPR) % 16; the position j0 + GT u + tid / TPR of stage group u), chunks tid % TPR +
  // TPR i of its K and V rows, to the one-block kernel's swizzled places; rows past j1 are zeros.
  const int32_t* table = a.page_table + static_cast<int64_t>(a.token_seq[t0]) * a.max_pages;
  const int crow = tid / TPR, csub = tid % TPR, ctile = crow >> 4, cr = crow & 15;
  auto slot_of = [&](int u) -> int {
    const int j = j0 + GT * u + crow;
    if (j >= j1) return -1;
    int pi, off;
    if (a.ps_shift >= 0) pi = j >> a.ps_shift, off = j & (a.page_size - 1);
    else pi = j / a.page_size, off = j - pi * a.page_size;
    return table[pi] * a.page_size + off;
  };
  const unsigned char* kpool = static_cast<const unsigned char*>(a.kpool) + static_cast<int64_t>(hk) * RB;
  const unsigned char* vpool = static_cast<const unsigned char*>(a.vpool) + static_cast<int64_t>(hk) * RB;
  const int64_t slot_bytes = static_cast<int64_t>(a.Hkv) * RB;
  auto issue = [&](int stage, int slot) {  // stage: 0 .. S - 1
    const paged_saddr_t row = raw_sa + static_cast<paged_saddr_t>(stage * RAW + ctile * SB + cr * RB);
    const int64_t src = static_cast<int64_t>(slot >= 0 ? slot : 0) * slot_bytes;
#pragma unroll
    for (int i = 0; i < CPR / TPR; ++i) {
      const int q = csub + TPR * i;
      paged_cp_async16z(row + static_cast<paged_saddr_t>((q ^ paged_kswz<CPR>(cr)) << 4), kpool + src + 16 * q,
                        slot < 0);
      paged_cp_async16z(row + static_cast<paged_saddr_t>(TB + ((q ^ paged_vswz<CPR>(cr)) << 4)), vpool + src + 16 * q,
                        slot < 0);
    }
  };
  // The conversion of a stage's tiles into A fragments (fragment f of tile p for lane `lane`),
  // from the tile's K / V rows exactly as paged_mmat_kernel's warp reads them (kro, vro there, the
  // same 16-byte reads of the swizzled rows), in tasks of a warp: K chunk i (rows g, g + 8: the
  // kMpc k-steps 4i / kMpc ..), or a part of the V rows 2c, 2c + 1, 2c + 8, 2c + 9 (FP16: half of
  // this thread's kVDims bytes, m-tiles in pairs; BF16: 16-byte chunk g + 8h, m-tiles 4h ..).
  constexpr int KT = Cfg::kKChunks, VT = F16 ? 2 : HD / 64, TT = KT + VT;  // tasks per tile
  constexpr int JW = Cfg::kVDims / 8;  // FP16: 4-byte words of a V row per half (2 at hd 128, 1 at hd 64)
  const uint32_t vro = static_cast<uint32_t>(
      F16 ? TB + 2 * c * RB + ((((Cfg::kVDims * g) >> 4) ^ paged_vswz<CPR>(2 * c)) << 4) + ((Cfg::kVDims * g) & 15)
          : TB + 2 * c * RB + ((g ^ paged_vswz<CPR>(2 * c)) << 4));
  auto convert = [&](const unsigned char* st, unsigned char* fb) {
    for (int x = warp; x < NP * TT; x += W) {
      const int p = x / TT, task = x % TT;
      const unsigned char* tile = st + p * SB;
      unsigned char* out = fb + p * TFB + lane * 16;  // + 512 f: fragment f
      auto put = [&](int f, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
        *reinterpret_cast<uint4*>(out + f * 32 * 16) = make_uint4(r0, r1, r2, r3);
      };
      if (task < KT) {  // S^T = K Q^T: K rows g, g + 8, chunk 4 task + c
        const unsigned char* k0 = tile + g * RB + (((4 * task + c) ^ paged_kswz<CPR>(g)) << 4);
        const uint4 u0 = paged_lds16(k0), u1 = paged_lds16(k0 + 8 * RB);
        const uint32_t w0[4] = {u0.x, u0.y, u0.z, u0.w}, w1[4] = {u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int j = 0; j < Cfg::kMpc; ++j) {
          if constexpr (F16)
            put(task * Cfg::kMpc + j, e4m3x2_lo_f16x2(w0[j]), e4m3x2_lo_f16x2(w1[j]),
                e4m3x2_hi_f16x2(w0[j]), e4m3x2_hi_f16x2(w1[j]));
          else
            put(task * Cfg::kMpc + j, w0[2 * j], w1[2 * j], w0[2 * j + 1], w1[2 * j + 1]);
        }
      } else if constexpr (F16) {  // O^T += V^T P^T: words JW v .. of the thread's V bytes, m-tiles 2j, 2j + 1
        const int v = task - KT;
        uint32_t w[4][JW];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const unsigned char* vp = tile + vro + ((rr & 1) + 8 * (rr >> 1)) * RB + 4 * JW * v;
          if constexpr (JW == 2) {
            const uint2 u = paged_lds8(vp);
            w[rr][0] = u.x, w[rr][JW - 1] = u.y;
          } else {
            w[rr][0] = paged_lds4(vp);
          }
        }
#pragma unroll
        for (int jj = 0; jj < JW; ++jj) {
          const int j = JW * v + jj;
          const uint32_t x0 = byte_perm(w[0][jj], w[1][jj], 0x5140), y0 = byte_perm(w[0][jj], w[1][jj], 0x7362);
          const uint32_t x1 = byte_perm(w[2][jj], w[3][jj], 0x5140), y1 = byte_perm(w[2][jj], w[3][jj], 0x7362);
          put(KS + 2 * j, e4m3x2_lo_f16x2(x0), e4m3x2_hi_f16x2(x0), e4m3x2_lo_f16x2(x1),
              e4m3x2_hi_f16x2(x1));
          put(KS + 2 * j + 1, e4m3x2_lo_f16x2(y0), e4m3x2_hi_f16x2(y0), e4m3x2_lo_f16x2(y1),
              e4m3x2_hi_f16x2(y1));
        }
      } else {  // BF16: chunk g + 8h of the four rows, m-tiles 4h + e
        const int h = task - KT;
        uint32_t w[4][4];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const uint4 u = paged_lds16(tile + vro + ((rr & 1) + 8 * (rr >> 1)) * RB + 128 * h);
          w[rr][0] = u.x, w[rr][1] = u.y, w[rr][2] = u.z, w[rr][3] = u.w;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
          put(KS + 4 * h + e, byte_perm(w[0][e], w[1][e], 0x5410), byte_perm(w[0][e], w[1][e], 0x7632),
              byte_perm(w[2][e], w[3][e], 0x5410), byte_perm(w[2][e], w[3][e], 0x7632));
      }
    }
  };

  // The first S stage groups in flight (one commit group each, empty past ngroups).
  int slot_next = slot_of(0);
#pragma unroll
  for (int u = 0; u < S; ++u) {
    if (u < ngroups) issue(u, slot_next);
    slot_next = slot_of(u + 1);
    paged_cp_async_commit();
  }

  // Q^T's B fragments and the score scales of this warp's block (paged_mmat_kernel's, MQ = 1).
  const float ksc = a.k_scale ? a.k_scale[hk] : 1.0f;
  uint32_t qb[KS][2];
  float kq0, kq1;
  {
    const bool qin = g < ncols;
    const int64_t qr = qin ? static_cast<int64_t>(t + g / G) * a.Hq + static_cast<int64_t>(hk) * G + g % G : 0;
    paged_mmat_q_block<Cfg>(a, static_cast<const uint16_t*>(a.q) + qr * HD, qin, ksc, c, qb, kq0, kq1);
  }

  // The four passes' states: O^T (dims paged_tdim(g, mt, 0 / 1) x columns 2c, 2c + 1), m, l.
  float o[NP][MT][4], m0[NP], m1[NP], l0[NP], l1[NP];
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    m0[p] = m1[p] = -INFINITY, l0[p] = l1[p] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[p][mt][0] = o[p][mt][1] = o[p][mt][2] = o[p][mt][3] = 0.0f;
  }

  paged_cp_async_wait<S - 1>();  // group 0 has landed (this thread's copies) ...
  __syncthreads();               // ... and every thread's
  convert(raw, frag);
  for (int u = 0; u < ngroups; ++u) {
    paged_cp_async_wait<S - 2>();  // group u + 1 has landed
    __syncthreads();  // group u's fragments written, group u - 1's read, stage u % S converted
    if (u + S < ngroups) issue(u % S, slot_next);
    slot_next = slot_of(u + S + 1);
    paged_cp_async_commit();
    if (u + 1 < ngroups) convert(raw + ((u + 1) % S) * RAW, frag + ((u + 1) & 1) * FRAG);
    const unsigned char* fb = frag + (u & 1) * FRAG;
#pragma unroll
    for (int p = 0; p < NP; ++p) {  // tile 4u + p: pass p
      const int base = j0 + GT * u + kMmaTile * p;
      if (base >= j1w) break;  // past this warp's tokens (uniform per warp)
      const unsigned char* tf = fb + p * TFB + lane * 16;
      float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const uint4 u4 = paged_lds16(tf + kk * 32 * 16);
        const uint32_t xk[4] = {u4.x, u4.y, u4.z, u4.w};
        if (kk & 1) paged_mma4<F16>(sb, xk, qb[kk][0], qb[kk][1]);
        else paged_mma4<F16>(sa, xk, qb[kk][0], qb[kk][1]);
      }
      const float x00 = base + g < j1c0 ? (sa[0] + sb[0]) * kq0 : -INFINITY;
      const float x01 = base + g < j1c1 ? (sa[1] + sb[1]) * kq1 : -INFINITY;
      const float x10 = base + g + 8 < j1c0 ? (sa[2] + sb[2]) * kq0 : -INFINITY;
      const float x11 = base + g + 8 < j1c1 ? (sa[3] + sb[3]) * kq1 : -INFINITY;
      float mx0 = fmaxf(x00, x10), mx1 = fmaxf(x01, x11);
#pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, sh));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, sh));
      }
      const bool up0 = LAZY == 0 ? mx0 > m0[p] : mx0 > m0[p] + static_cast<float>(LAZY);
      const bool up1 = LAZY == 0 ? mx1 > m1[p] : mx1 > m1[p] + static_cast<float>(LAZY);
      // The vote of each column's token (paged_mmat_kernel's MQ form).
      int v = G >= 2 ? (up0 || up1 ? 3 : 0) : (up0 ? 1 : 0) | (up1 ? 2 : 0);
#pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) v |= paged_shfl_xor(v, sh);
      if (G >= 4) v |= paged_shfl_xor(v, 1);
      if (G >= 8) v |= paged_shfl_xor(v, 2);
      const bool r0 = (v & 1) != 0, r1 = (v & 2) != 0;
      if (paged_any(r0 || r1)) {
        const float n0 = r0 ? fmaxf(m0[p], mx0) : m0[p], n1 = r1 ? fmaxf(m1[p], mx1) : m1[p];
        const float c0 = r0 ? paged_ex2(m0[p] - n0) : 1.0f, c1 = r1 ? paged_ex2(m1[p] - n1) : 1.0f;
        m0[p] = n0, m1[p] = n1, l0[p] *= c0, l1[p] *= c1;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          o[p][mt][0] *= c0, o[p][mt][1] *= c1, o[p][mt][2] *= c0, o[p][mt][3] *= c1;
      }
      const float e0 = m0[p] == -INFINITY ? 0.0f : m0[p], e1 = m1[p] == -INFINITY ? 0.0f : m1[p];
      const float p00 = paged_ex2(x00 - e0), p01 = paged_ex2(x01 - e1);
      const float p10 = paged_ex2(x10 - e0), p11 = paged_ex2(x11 - e1);
      l0[p] += p00 + p10;
      l1[p] += p01 + p11;
      const uint32_t b0 = paged_movm_t(F16 ? paged_pack_f16x2(p00, p01) : paged_pack_bf16x2(p00, p01));
      const uint32_t b1 = paged_movm_t(F16 ? paged_pack_f16x2(p10, p11) : paged_pack_bf16x2(p10, p11));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 u4 = paged_lds16(tf + (KS + mt) * 32 * 16);
        const uint32_t xv[4] = {u4.x, u4.y, u4.z, u4.w};
        paged_mma4<F16>(o[p][mt], xv, b0, b1);
      }
    }
  }
  paged_cp_async_wait<0>();

  // Epilogue: each pass's l summed over its 8 threads, the passes merged in order in registers,
  // written as the output (one split, no partials) or this split's partial and lse.
#pragma unroll
  for (int p = 0; p < NP; ++p)
#pragma unroll
    for (int sh = 4; sh < 32; sh <<= 1) {
      l0[p] += __shfl_xor_sync(0xffffffffu, l0[p], sh);
      l1[p] += __shfl_xor_sync(0xffffffffu, l1[p], sh);
    }
  const float vsc = a.v_scale ? a.v_scale[hk] : 1.0f;
#pragma unroll
  for (int hc = 0; hc < 2; ++hc) {
    const int h = 2 * c + hc;
    if (h >= ncols || (hc ? j1c1 : j1c0) <= j0) continue;  // no (token, head), or no positions in this split
    const int64_t r = static_cast<int64_t>(t + h / G) * a.Hq + static_cast<int64_t>(hk) * G + h % G;
    float ov[MT][2], f[NP], mx, den;
    paged_merge_row<NP>([&](int p) { return hc ? m1[p] : m0[p]; }, [&](int p) { return hc ? l1[p] : l0[p]; }, f, mx,
                        den);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        ov[mt][hh] = paged_merge_value<NP>([&](int p) { return o[p][mt][2 * hh + hc]; }, f, den, vsc);
    if (a.splits == 1 && !a.partials) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) paged_store_out(a.out, true, r * HD + paged_tdim<Cfg>(g, mt, hh), ov[mt][hh]);
    } else {
      // The partial row: m-tiles 2q, 2q + 1 hold 4 consecutive head dims (paged_tdim), one float4.
      const int64_t row = r * a.splits + split;
      float* po = a.part_o + row * HD;
#pragma unroll
      for (int q = 0; q < MT / 2; ++q) {
        const int d = F16 ? Cfg::kVDims * g + 4 * q : 8 * g + 64 * (q >> 1) + 4 * (q & 1);
        *reinterpret_cast<float4*>(po + d) = make_float4(ov[2 * q][0], ov[2 * q][1], ov[2 * q + 1][0], ov[2 * q + 1][1]);
      }
      if (g == 0) a.part_lse[row] = mx + log2f(den);  // the column's (every element's mx, den)
    }
  }
}

// The split plan of paged_mma_kernel for `slots` resident CTAs (SMs x CTAs per SM): chunks are
// whole tiles; the number of splits minimizes waves x (chunk + a per-CTA overhead of
// kMmaCtaOverhead positions), where waves = ceil(T * Hkv * splits / slots), preferring fewer
// splits unless more are 3% faster, with at least kMmaWarps tiles per split. Many sequences (T * Hkv >= 2 waves) keep one split; B = 16 x
// 8 heads at 4096 positions on 264 slots takes 2 (256 CTAs, one wave of 2048 positions each).
constexpr int kMmaCtaOverhead = 96;
inline PagedSplit paged_mma_split(int64_t T, int Hkv, int max_pos, int slots, int forced) {
  const int64_t len = max_pos > 1 ? max_pos : 1, ctas = T * Hkv > 1 ? T * Hkv : 1;
  const int64_t tiles = (len + kMmaTile - 1) / kMmaTile;
  const int64_t sl = slots > 1 ? slots : 1;
  int64_t best = 1;
  if (forced > 0) {
    const int64_t fcap = tiles < kPagedMaxSplits ? tiles : kPagedMaxSplits;
    best = forced < fcap ? forced : fcap;
  } else {
    // at least a tile per warp in every split
    const int64_t per = tiles / kMmaWarps > 1 ? tiles / kMmaWarps : 1, cap = per < kPagedMaxSplits ? per : kPagedMaxSplits;
    double best_cost = 0.0;
    for (int64_t s = 1; s <= cap; ++s) {
      const int64_t ct = (tiles + s - 1) / s, se = (tiles + ct - 1) / ct;  // tiles per chunk, splits used
      if (se != s) continue;
      const double cost = double((ctas * s + sl - 1) / sl) * double(ct * kMmaTile + kMmaCtaOverhead);
      if (s == 1 || cost < 0.97 * best_cost) best = s, best_cost = cost;
    }
  }
  PagedSplit p;
  const int64_t ct = (tiles + best - 1) / best;
  p.chunk = static_cast<int>(ct * kMmaTile);
  p.splits = static_cast<int>((tiles + ct - 1) / ct);  // no split without positions
  return p;
}

// The consistent mode's plan (PagedBatch::batch_invariant): chunks of kPagedInvariantChunk
// positions whatever the batch, as many splits as the longest token needs. A token's CTAs cover
// [s * chunk, min(len, (s + 1) * chunk)) for s < ceil(len / chunk), and the combine merges
// exactly those in order: its result depends on its position alone (T, max_pos and the other
// tokens change only how many CTAs exit at once).
inline PagedSplit paged_invariant_split(int max_pos, int chunk = kPagedInvariantChunk) {
  PagedSplit p;
  p.chunk = chunk;
  p.splits = (max_pos > 1 ? max_pos + chunk - 1 : chunk) / chunk;
  return p;
}
// The variants of the tensor-core decode kernel (FP8RL_PAGED_VARIANT, kernels.h): 0 is
// paged_mma_kernel; v >= 1 is paged_mmat_kernel with LAZY paged_t_lazy(v), copies
// paged_t_copy<HD>(v) and, for E4M3 pools at hd 128, paged_t_stages(v) stages per warp (4 KB each:
// 4 -> 3 CTAs per SM, 3 -> 4 CTAs and at most 128 registers, 6 -> 2 CTAs); other pools and hd 64
// keep paged_mma_kernel's stage counts. Variant 6 (t-tma) is the default's with TMA copies at
// head_dim 128 (issue 14: one lane issues a tile's boxes instead of every lane its cp.async);
// elsewhere (hd 64, a page size that is not a multiple of 16) it runs the default.
constexpr int kMmaVariants = 7;
constexpr int kMmaTmaVariant = 6;
// The default: t-lazy-s3, the fastest at every DecodeBench shape and pool on the H200 (session
// 6: Qwen3-1.7B B=256 E4M3 62.0 us against orig's 79.2, BF16 108.9 against 114.2; the rl-step
// generation ran with it, through FP8RL_PAGED_VARIANT, docs/benchmarks.md).
constexpr int kMmaDefaultVariant = 3;
// The plain decode's default (no batch invariance): the consistent mode's decode and its query
// runs (paged_mmat_kernel's MQ form, the wide kernel) stay on kMmaDefaultVariant, whose
// arithmetic the runs reproduce bit for bit (paged_attention_mma_invariant_variant).
constexpr int kMmaDecodeVariant = kMmaDefaultVariant;
constexpr int paged_t_lazy(int v) { return v == 1 ? 0 : 8; }
template <int HD>
constexpr int paged_t_copy(int v) {
  return v == 5 ? 1 : v == kMmaTmaVariant && HD == 128 ? 2 : 0;
}
template <int HD, class TP>
constexpr int paged_t_stages(int v) {
  if constexpr (HD == 128 && sizeof(TP) == 1) return v == 3 || v == kMmaTmaVariant ? 3 : v == 4 ? 6 : 4;
  else return PagedMmaCfg<HD, TP>::kStages;
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

// Variant V of the tensor-core kernel (paged_t_*): its function and dynamic shared memory.
template <int HD, class TP, int V>
struct MmaVariant {
  static constexpr int kStages = paged_t_stages<HD, TP>(V);
  static constexpr int kCopy = paged_t_copy<HD>(V);
  static constexpr int kSmemBytes =
      V == 0 ? PagedMmaCfg<HD, TP>::kSmemBytes : PagedTCfg<HD, TP, kStages, kCopy>::kSmemBytes;
  static auto fn() {
    if constexpr (V == 0) return paged_mma_kernel<HD, TP>;
    else return paged_mmat_kernel<HD, TP, kStages, paged_t_lazy(V), kCopy>;
  }
};

// A variant's shared-memory opt-in and its CTAs per SM (occupancy), once per instantiation and
// device.
template <int HD, class TP, int V>
int mma_blocks_per_sm() {
  using Var = MmaVariant<HD, TP, V>;
  constexpr int kDevices = 64;
  static std::atomic<int> cached[kDevices];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev), "paged attention: cudaGetDevice");
  const int i = dev >= 0 && dev < kDevices ? dev : 0;
  int n = cached[i].load(std::memory_order_relaxed);
  if (n > 0) return n;
  CUDA_CHECK(cudaFuncSetAttribute(Var::fn(), cudaFuncAttributeMaxDynamicSharedMemorySize, Var::kSmemBytes),
             "paged attention: shared memory opt-in of ", Var::kSmemBytes, " bytes (hd ", HD, ", variant ", V, ")");
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Var::fn(), 32 * kMmaWarps, Var::kSmemBytes),
             "paged attention: occupancy query");
  FP8RL_CHECK(n >= 1, "paged attention: the tensor-core kernel (hd ", HD, ", variant ", V, ", ", Var::kSmemBytes,
              " bytes of shared memory) cannot run on this device; FP8RL_CUDA_ATTENTION=tiled avoids it");
  cached[i].store(n, std::memory_order_relaxed);
  return n;
}

template <int HD, class TP, int V>
void launch_mma(const PagedArgs& a, int64_t T, cudaStream_t stream) {
  using Var = MmaVariant<HD, TP, V>;
  mma_blocks_per_sm<HD, TP, V>();  // the shared-memory opt-in precedes the first launch
  const dim3 grid(static_cast<unsigned>(T * a.Hkv), static_cast<unsigned>(a.splits));
  Var::fn()<<<grid, 32 * kMmaWarps, Var::kSmemBytes, stream>>>(a);
}

// The multi-query form of the default variant (paged_mmat_kernel<..., MQ = NB>: NB blocks of 8
// MMA columns) over `runs` query runs (a.qruns).
template <int HD, class TP, int NB>
void launch_mma_runs(const PagedArgs& a, int64_t runs, cudaStream_t stream) {
  constexpr int V = kMmaDefaultVariant;
  using Var = MmaVariant<HD, TP, V>;
  const auto fn = paged_mmat_kernel<HD, TP, Var::kStages, paged_t_lazy(V), Var::kCopy, NB>;
  static std::once_flag opted[64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev), "paged attention: cudaGetDevice");
  std::call_once(opted[dev >= 0 && dev < 64 ? dev : 0], [&] {
    CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, Var::kSmemBytes),
               "paged attention: shared memory opt-in of ", Var::kSmemBytes, " bytes (multi-query, hd ", HD, ")");
  });
  const dim3 grid(static_cast<unsigned>(runs * a.Hkv), static_cast<unsigned>(a.splits));
  fn<<<grid, 32 * kMmaWarps, Var::kSmemBytes, stream>>>(a);
}

// The wide query runs (paged_wide_kernel: kWideWarps blocks of 8 MMA columns per CTA, each tile
// converted once for all) over `runs` query runs (a.qruns), with the default variant's LAZY.
template <int HD, class TP, int W>
void launch_wide_runs_w(const PagedArgs& a, int64_t runs, cudaStream_t stream) {
  using Cfg = PagedWideCfg<HD, TP>;
  const auto fn = paged_wide_kernel<HD, TP, paged_t_lazy(kMmaDefaultVariant), W>;
  static std::once_flag opted[64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev), "paged attention: cudaGetDevice");
  std::call_once(opted[dev >= 0 && dev < 64 ? dev : 0], [&] {
    CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
               "paged attention: shared memory opt-in of ", Cfg::kSmemBytes, " bytes (wide query runs, hd ", HD, ")");
  });
  const dim3 grid(static_cast<unsigned>(runs * (kWideWarps / W) * a.Hkv), static_cast<unsigned>(a.splits));
  fn<<<grid, 32 * W, Cfg::kSmemBytes, stream>>>(a);
}
// FP8RL_WIDE_CTA_WARPS=4 (read at each call): CTAs of 4 warps, two per run (same bits).
template <int HD, class TP>
void launch_wide_runs(const PagedArgs& a, int64_t runs, cudaStream_t stream) {
  const char* e = std::getenv("FP8RL_WIDE_CTA_WARPS");
  const int w = e && *e ? std::atoi(e) : kWideWarps;
  FP8RL_CHECK(w == 4 || w == 8, "FP8RL_WIDE_CTA_WARPS must be 4 or 8, got '", e ? e : "",
              "'; unset it for the default (", kWideWarps, ")");
  if (w == 4) launch_wide_runs_w<HD, TP, 4>(a, runs, stream);
  else launch_wide_runs_w<HD, TP, kWideWarps>(a, runs, stream);
}

// f(std::integral_constant<int, v>) for the variant v (0 <= v < kMmaVariants).
template <class F>
auto with_variant(int v, const F& f) {
  static_assert(kMmaVariants == 7, "one case per variant");
  switch (v) {
    case 0: return f(std::integral_constant<int, 0>());
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    default: return f(std::integral_constant<int, 6>());
  }
}

const char* const kMmaVariantNames[kMmaVariants] = {"orig",      "t-exact",     "t-lazy", "t-lazy-s3",
                                                    "t-lazy-s6", "t-lazy-rows", "t-tma"};

}  // namespace

int paged_attention_mma_variants() { return kMmaVariants; }

const char* paged_attention_mma_variant_name(int v) { return v >= 0 && v < kMmaVariants ? kMmaVariantNames[v] : "?"; }

int paged_attention_mma_variant_env() {
  const char* e = std::getenv("FP8RL_PAGED_VARIANT");
  if (!e || !*e) return kMmaDecodeVariant;
  const std::string s = e;
  for (int v = 0; v < kMmaVariants; ++v)
    if (s == kMmaVariantNames[v] || s == std::to_string(v)) return v;
  std::string names;
  for (int v = 0; v < kMmaVariants; ++v) names += std::string(v ? ", " : "") + kMmaVariantNames[v];
  FP8RL_FAIL("FP8RL_PAGED_VARIANT=", s, ": expected 0 .. ", kMmaVariants - 1, " or one of ", names);
  return kMmaDecodeVariant;
}

int paged_attention_mma_invariant_variant() {
  const char* e = std::getenv("FP8RL_PAGED_VARIANT");
  return e && *e ? paged_attention_mma_variant_env() : kMmaDefaultVariant;
}

namespace {
int resolve_variant(int variant) {
  const int v = variant < 0 ? paged_attention_mma_variant_env() : variant;
  FP8RL_CHECK(v < kMmaVariants, "paged attention (tensor cores): variant ", v, " (0 .. ", kMmaVariants - 1, ")");
  return v;
}
}  // namespace

bool paged_attention_mma_supported(int hd, int group, DType pool_dt, DType qdt, const void* kpool,
                                   const void* vpool) {
  return (hd == 64 || hd == 128) && group >= 1 && group <= kMmaRows && qdt == DType::BF16 &&
         (pool_dt == DType::BF16 || pool_dt == DType::E4M3) && reinterpret_cast<uintptr_t>(kpool) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(vpool) % 16 == 0;
}

int paged_attention_mma_blocks_per_sm(int hd, DType pool_dt, int variant) {
  FP8RL_CHECK((hd == 64 || hd == 128) && (pool_dt == DType::BF16 || pool_dt == DType::E4M3),
              "paged attention (tensor cores): unsupported head_dim ", hd, " / pool ", dtype_name(pool_dt));
  return with_variant(resolve_variant(variant), [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    if (pool_dt == DType::E4M3)
      return hd == 64 ? mma_blocks_per_sm<64, uint8_t, V>() : mma_blocks_per_sm<128, uint8_t, V>();
    return hd == 64 ? mma_blocks_per_sm<64, bf16, V>() : mma_blocks_per_sm<128, bf16, V>();
  });
}

PagedSplit paged_attention_mma_split(int64_t T, int Hkv, int hd, DType pool_dt, int max_pos, int sm_count, int forced,
                                     int variant) {
  return paged_mma_split(T, Hkv, max_pos, sm_count * paged_attention_mma_blocks_per_sm(hd, pool_dt, variant), forced);
}

// FP8RL_PAGED_INVARIANT_CHUNK=N (a multiple of 16; read once per process, so the generator and
// the trainer of a run share it): the consistent mode's chunk instead of kPagedInvariantChunk —
// an experiment on what the fixed split costs each engine (one chunk per token = no split and
// no combine up to N positions, fewer CTAs per long token in a small batch).
PagedSplit paged_attention_invariant_split(int max_pos) {
  static const int chunk = [] {
    const char* e = std::getenv("FP8RL_PAGED_INVARIANT_CHUNK");
    const int n = e ? std::atoi(e) : 0;
    return n >= kMmaTile && n % kMmaTile == 0 ? n : kPagedInvariantChunk;
  }();
  return paged_invariant_split(max_pos, chunk);
}

bool paged_attention_runs_apply(int group, int variant, bool out_fp8) {
  return resolve_variant(variant) == kMmaDefaultVariant && !out_fp8 &&
         (group == 1 || group == 2 || group == 4 || group == 8);
}
int paged_attention_run_tokens(int group) {
  return group >= 1 && group <= kMmaRows ? kWideWarps * kMmaRows / group : 1;
}

// The TMA copies' tensor map of a pool [pages, page_size, Hkv, row_bytes]: bytes as {row_bytes,
// Hkv, cache slots}, boxes of 128 bytes x 1 head x 16 slots, 128-byte swizzle. `slots` (pages x
// page_size; 0: unknown, then the largest an int32 slot can name) bounds the boxes: a page-table
// entry past the pool reads zeros instead of other memory. L2 promotion: 256 bytes (a 128-byte
// E4M3 row pulls the next head's, which the next CTA of the token reads), or what
// FP8RL_PAGED_TMA_L2 says (128, 256 or none; read at each call, an experiment for DecodeBench).
// Cached per (pool, Hkv, row bytes, slots, promotion): encoding costs host time, and the decode
// calls repeat them every step.
static CUtensorMap paged_pool_tma_map(const void* pool, int Hkv, int row_bytes, int64_t slots) {
  const char* e = std::getenv("FP8RL_PAGED_TMA_L2");
  const std::string l2 = e && *e ? e : "256";
  FP8RL_CHECK(l2 == "128" || l2 == "256" || l2 == "none", "FP8RL_PAGED_TMA_L2=", l2,
              ": expected 128, 256 or none; unset it for the default (256)");
  const CUtensorMapL2promotion promo = l2 == "128"   ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                       : l2 == "256" ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                                     : CU_TENSOR_MAP_L2_PROMOTION_NONE;
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int64_t, int>, CUtensorMap> cache;
  const auto key = std::make_tuple(pool, Hkv, row_bytes, slots, static_cast<int>(promo));
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  CUtensorMap m;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(Hkv),
                              static_cast<cuuint64_t>(slots > 0 ? slots : int64_t{1} << 31)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(Hkv) * row_bytes};
  const cuuint32_t box[3] = {128, 1, kMmaTile};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = sm90::tensor_map_encoder()(
      &m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(pool), dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP8RL_CHECK(r == CUDA_SUCCESS, "paged attention: cuTensorMapEncodeTiled failed (", static_cast<int>(r),
              ") for a pool of ", Hkv, " heads x ", row_bytes, " bytes");
  cache.emplace(key, m);
  return m;
}

// The kernels' arguments from a launcher's (the tensor-core and the CUDA-core launchers alike).
static PagedArgs paged_args(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                            const int32_t* page_table, int max_pages, int Hq, int Hkv, int page_size,
                            const void* kpool, const void* vpool, const float* k_scale, const float* v_scale,
                            float scale, bool fp8_q, const PagedSplit& split, float* part_o, float* part_lse,
                            void* out) {
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
  return a;
}

void launch_paged_attention_mma(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                                const int32_t* page_table, int max_pages, int64_t T, int Hq, int Hkv, int hd,
                                int page_size, const void* kpool, const void* vpool, DType pool_dt,
                                const float* k_scale, const float* v_scale, float scale, bool fp8_q,
                                const PagedSplit& split, float* part_o, float* part_lse, void* out, cudaStream_t stream,
                                int variant, float* lse_out, const PagedOutFp8* out_fp8, const int32_t* qruns,
                                int64_t nruns, int run_tokens, int64_t pool_slots) {
  if (T == 0) return;
  FP8RL_CHECK(!out_fp8 || hd == 128, "paged attention: the fused output quantizer needs head_dim 128, got ", hd);
  int v = resolve_variant(variant);
  if (reinterpret_cast<uintptr_t>(q) % 16 != 0) v = 0;  // the transposed kernel loads q 16 bytes at a time
  // TMA copies bring a tile's 16 positions as consecutive slots of one page.
  if (v == kMmaTmaVariant && page_size % kMmaTile != 0) v = kMmaDefaultVariant;
  FP8RL_CHECK(Hkv > 0 && Hq % Hkv == 0 && paged_attention_mma_supported(hd, Hq / Hkv, pool_dt, qdt, kpool, vpool),
              "paged attention (tensor cores): unsupported case: q ", dtype_name(qdt), ", pool ", dtype_name(pool_dt),
              ", head_dim ", hd, ", group ", Hq / std::max(Hkv, 1),
              " (needs BF16 q, a BF16/E4M3 pool, head_dim 64/128, group <= 8, 16-byte aligned pools)");
  FP8RL_CHECK(page_size >= 1, "paged attention: page_size ", page_size);
  FP8RL_CHECK(split.splits >= 1 && split.chunk >= kMmaTile && split.chunk % kMmaTile == 0 &&
                  ((split.splits == 1 && !lse_out) || (part_o && part_lse)),
              "paged attention (tensor cores): bad split plan (", split.splits, " x ", split.chunk,
              "; chunks must be multiples of ", kMmaTile, ": use paged_attention_mma_split)");
  FP8RL_CHECK(T * Hkv < (int64_t(1) << 31), "paged attention: T * Hkv = ", T * Hkv, " exceeds the grid");
  PagedArgs a = paged_args(q, qdt, token_seq, token_pos, page_table, max_pages, Hq, Hkv, page_size, kpool, vpool,
                           k_scale, v_scale, scale, fp8_q, split, part_o, part_lse, out);
  a.ps_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(page_size)) : -1;
  a.partials = lse_out != nullptr;
  if (v == kMmaTmaVariant && hd == 128) {
    const int rb = hd * (pool_dt == DType::E4M3 ? 1 : 2);
    a.kmap = paged_pool_tma_map(kpool, Hkv, rb, pool_slots);
    a.vmap = paged_pool_tma_map(vpool, Hkv, rb, pool_slots);
  }
  if (out_fp8) {
    a.out_q = out_fp8->q;
    a.out_qs = out_fp8->scales;
    a.out_q_rows = T;
    a.out_q_gemm = out_fp8->gemm_layout;
    a.out_q_pow2 = out_fp8->pow2;
    a.out_q_bad = out_fp8->bad;
  }
  if (qruns && paged_attention_runs_apply(Hq / Hkv, v, out_fp8 != nullptr)) {
    FP8RL_CHECK(nruns * Hkv < (int64_t(1) << 31), "paged attention: runs * Hkv = ", nruns * Hkv, " exceeds the grid");
    const int cols = run_tokens * (Hq / Hkv);
    FP8RL_CHECK(run_tokens >= 1 && cols <= kWideWarps * kMmaRows, "paged attention: query runs of ", run_tokens,
                " tokens x group ", Hq / Hkv, " exceed the kernels' ", kWideWarps * kMmaRows, " MMA columns");
    a.qruns = qruns;
    // One block of 8 columns when the runs fit it, two up to 16 columns (each K / V tile read once
    // for both), else the wide CTAs (a block per warp, each tile converted once for all).
    auto launch = [&](auto nb) {
      constexpr int NB = decltype(nb)::value;
      if (pool_dt == DType::E4M3) {
        if (hd == 64) launch_mma_runs<64, uint8_t, NB>(a, nruns, stream);
        else launch_mma_runs<128, uint8_t, NB>(a, nruns, stream);
      } else {
        if (hd == 64) launch_mma_runs<64, bf16, NB>(a, nruns, stream);
        else launch_mma_runs<128, bf16, NB>(a, nruns, stream);
      }
    };
    if (cols <= kMmaRows) {
      launch(std::integral_constant<int, 1>());
    } else if (cols <= kMmaRunBlocks * kMmaRows) {
      launch(std::integral_constant<int, kMmaRunBlocks>());
    } else {
      if (pool_dt == DType::E4M3) {
        if (hd == 64) launch_wide_runs<64, uint8_t>(a, nruns, stream);
        else launch_wide_runs<128, uint8_t>(a, nruns, stream);
      } else {
        if (hd == 64) launch_wide_runs<64, bf16>(a, nruns, stream);
        else launch_wide_runs<128, bf16>(a, nruns, stream);
      }
    }
  } else {
    with_variant(v, [&](auto vc) {
      constexpr int V = decltype(vc)::value;
      if (pool_dt == DType::E4M3) {
        if (hd == 64) launch_mma<64, uint8_t, V>(a, T, stream);
        else launch_mma<128, uint8_t, V>(a, T, stream);
      } else {
        if (hd == 64) launch_mma<64, bf16, V>(a, T, stream);
        else launch_mma<128, bf16, V>(a, T, stream);
      }
    });
  }
  CUDA_CHECK_LAUNCH(v == 0 ? "paged_mma_kernel" : "paged_mmat_kernel");
  if (split.splits > 1 || lse_out) {
    const int64_t rows = T * Hq;
    paged_combine_kernel<<<static_cast<unsigned>((rows + kPagedWarps - 1) / kPagedWarps), 32 * kPagedWarps, 0,
                           stream>>>(part_o, part_lse, token_pos, rows, Hq, hd, split.splits, split.chunk, true, out,
                                     lse_out, a);
    CUDA_CHECK_LAUNCH("paged_combine_kernel");
  }
}

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
                            float* part_lse, void* out, cudaStream_t stream, bool grouped, float* lse_out) {
  if (T == 0) return;
  FP8RL_CHECK(qdt == DType::F32 || qdt == DType::BF16, "paged attention: q must be F32 or BF16, got ",
              dtype_name(qdt));
  FP8RL_CHECK(paged_attention_supported(hd, Hq / Hkv, pool_dt, kpool, vpool) && Hq % Hkv == 0,
              "paged attention kernel: unsupported head_dim ", hd, " / group ", Hq / Hkv,
              " (the backend falls back to the simple kernel for these)");
  FP8RL_CHECK(split.splits >= 1 && split.chunk >= 1 && ((split.splits == 1 && !lse_out) || (part_o && part_lse)),
              "paged attention: bad split plan (", split.splits, " x ", split.chunk, ")");
  FP8RL_CHECK(T * Hkv < (int64_t(1) << 31), "paged attention: T * Hkv = ", T * Hkv, " exceeds the grid");
  PagedArgs a = paged_args(q, qdt, token_seq, token_pos, page_table, max_pages, Hq, Hkv, page_size, kpool, vpool,
                           k_scale, v_scale, scale, fp8_q, split, part_o, part_lse, out);
  a.partials = lse_out != nullptr;
  if (hd == 64) launch_pool<64>(a, grouped, pool_dt, T, stream);
  else launch_pool<128>(a, grouped, pool_dt, T, stream);
  CUDA_CHECK_LAUNCH(grouped ? "paged_attention_kernel" : "paged_tiled_kernel");
  if (split.splits > 1 || lse_out) {
    const int64_t rows = T * Hq;
    paged_combine_kernel<<<static_cast<unsigned>((rows + kPagedWarps - 1) / kPagedWarps), 32 * kPagedWarps, 0,
                           stream>>>(part_o, part_lse, token_pos, rows, Hq, hd, split.splits, split.chunk,
                                     a.q_bf16, out, lse_out);
    CUDA_CHECK_LAUNCH("paged_combine_kernel");
  }
}

}  // namespace fp8rl::cuda
