// Tensor-core paged decode attention over MLA's latent KV cache (DeepSeek-V3 / Moonlight
// "absorbed" attention), FlashMLA-style: every cached position holds ONE row of kMlaRow = 576
// values ([c | k_rope], kv_lora_rank 512 + qk_rope_head_dim 64) shared by all H query heads; K is
// the whole row and V its first kMlaV = 512 values. Semantics of attention_paged_kernel
// (attention_kernels.cu) with num_kv_heads = 1: token t (sequence token_seq[t]) at position
// token_pos[t] attends to positions 0..pos; s_j = scale q[t, h] . K_j, p = softmax(s) (FP32,
// online), out[t, h] = sum_j p_j V_j, lse[h * T + t] = m + log(l) (natural) when asked.
//
// Why: the simple kernel runs one warp per (token, head) and re-reads every 576-wide row for each
// of the H heads. Here one CTA serves a block of kMlaHeads = 16 heads of a token: the heads are
// the 16 M rows of mma.sync m16n8k16, each 64-position tile of rows is read from memory once per
// head block (H = 16: once per token) into shared memory, and both products run on tensor cores.
//
// Grid: T * ceil(H / 16) CTAs (the head blocks of a token adjacent: their tiles are L2 hits),
// kMlaWarps = 4 warps. Per 64-position tile (cp.async, two buffers: tile k + 1 in flight while
// tile k is used):
//   S[16 x 64] = Q[16 x 576] K^T: warp w computes the 16 positions 16w .. 16w + 15 over all 576
//     dims (2 n-blocks x 36 k-steps, two accumulator chains per n-block); Q's A fragments come
//     from shared memory (ldmatrix), K's B fragments from the tile.
//   Online softmax (FP32, base 2): row maxima exchanged through shared memory (every warp then
//     holds the same running max), P = 2^(s - m), each thread sums its own positions' P.
//   P's A fragments: warp w's S accumulators are exactly the A fragment of k-step w of P V (no
//     shuffles); each warp stores its fragment, every warp reads all four.
//   O[16 x 512] += P[16 x 64] V[64 x 512]: warp w owns the 128 output dims 128w .. 128w + 127
//     (16 n8-blocks x 4 FP32 accumulators = 64 registers per thread).
// Three __syncthreads per tile: tile landed / buffers free, the row maxima, the P fragments.
//
// Pools: BF16 rows are BF16 MMA operands as they are (q BF16 exact, P rounded to BF16 as in
// FlashAttention). E4M3 rows use FP16 MMAs: the codes are converted exactly to FP16
// (cvt.rn.f16x2.e4m3x2, every E4M3 value is an FP16 value) while building the fragments, k_scale
// is NOT applied per element but to the FP32 scores and the output (the same scale for K and V:
// exact algebra, no rounding of code * scale to 8 bits); q is scaled per head by a power of two
// so its amax lies in [2^14, 2^15) and rounded to FP16 (exact: BF16 has 8 significant bits, FP16
// 11; only elements below amax * 2^-28 lose bits), P is FP16 (11 bits). The power of two, k_scale
// and softmax_scale * log2(e) scale the FP32 scores.
//
// Shared memory: q [16][576] 16-bit (18 KB), two tiles [64][576] of the pool's type (BF16 144 KB:
// one CTA per SM; E4M3 72 KB: two), P fragments, page slots, row statistics. Swizzles (16-byte
// chunk q of row r): BF16 tiles and q at chunk q ^ (r & 7) (1152-byte rows: ldmatrix's 8 rows in
// 8 bank groups); E4M3 tiles at q ^ ((r >> 1) & 3) (576-byte rows, see mla_e4m3_chunk).
// Fragment dims for E4M3 (reads of 16 bytes): thread (g, c) = (lane / 4, lane % 4) reads the 16
// codes 64 ci + 16 c .. of K row g: its k-slots of QK^T step 4 ci + kk are those dims 4 kk + e,
// and q is stored in shared memory in that permutation (mla_qslot) so ldmatrix gives matching A
// fragments; for P V it reads 16 codes of V rows 2c, 2c + 1, 2c + 8, 2c + 9 at chunk mla_vchunk(g)
// of its warp's 8, so output column g of n-block nt is dim 128 w + 16 mla_vchunk(g) + nt.
//
// The code between the "emulated" markers is also compiled for the host by
// tests/cuda/mla_emu/run.sh (with its own versions of the device primitives above them).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>
#include <mutex>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

// ---- device primitives (the host emulation supplies its own) --------------------------------
__device__ __forceinline__ unsigned char* mla_dyn_smem() {
  extern __shared__ __align__(16) unsigned char mla_smem[];
  return mla_smem;
}
__device__ __forceinline__ uint32_t mla_saddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// cp.async of 16 bytes into shared memory; !valid writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void mla_cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(mla_saddr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void mla_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until every committed group of this thread has landed.
__device__ __forceinline__ void mla_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// ldmatrix .x4 / .x4.trans (common.cuh's ldmatrix_x4, under the names the emulation shims).
__device__ __forceinline__ void mla_ldsm_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4<false>(r, p); }
__device__ __forceinline__ void mla_ldsm_x4_t(uint32_t (&r)[4], const void* p) { ldmatrix_x4<true>(r, p); }
__device__ __forceinline__ uint4 mla_lds16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint4 mla_ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void mla_stg16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
// d += A B, m16n8k16 (common.cuh's mma_m16n8k16, under the name the emulation shims).
template <bool F16>
__device__ __forceinline__ void mla_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_m16n8k16<F16>(d, a, b0, b1);
}
// Two floats as an FP16 (F16) or BF16 pair, lo in the low half, round to nearest even.
template <bool F16>
__device__ __forceinline__ uint32_t mla_pack2(float lo, float hi) {
  if constexpr (F16) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// ---- emulated: begin ------------------------------------------------------------------------
constexpr int kMlaHeads = 16;   // heads per CTA: the MMA rows
constexpr int kMlaTile = 64;    // positions per tile
constexpr int kMlaWarps = 4;    // warp w: S columns 16w.., output dims 128w..
constexpr int kMlaThreads = 32 * kMlaWarps;
constexpr int kMlaKSteps = kMlaRow / 16;  // QK^T k-steps: 36
constexpr int kMlaNTiles = kMlaV / (8 * kMlaWarps);  // P V n-blocks per warp: 16
static_assert(kMlaRow == 576 && kMlaV == 512 && kMlaTile == 16 * kMlaWarps, "the tiling assumes these widths");

struct MlaArgs {
  const void* q;              // [T, H, 576] BF16
  const int32_t* token_seq;   // [T]
  const int32_t* token_pos;   // [T]
  const int32_t* page_table;  // [B, max_pages]
  const void* pool;           // [num_pages, page_size, 576] BF16 or E4M3
  const float* k_scale;       // [1] (E4M3), else null
  void* out;                  // [T, H, 512] BF16
  float* lse;                 // [H, T] natural, or null
  int64_t T;
  int H, max_pages, page_size;
  float scale_log2;  // softmax_scale * log2(e)
};

template <class TP>
struct MlaCfg {
  static constexpr bool kF16 = sizeof(TP) == 1;  // E4M3 pools: FP16 MMAs; BF16 pools: BF16 MMAs
  static constexpr int kRowBytes = kMlaRow * static_cast<int>(sizeof(TP));  // 1152 or 576
  static constexpr int kRowChunks = kRowBytes / 16;                         // 72 or 36
  static constexpr int kTileBytes = kMlaTile * kRowBytes;                   // 72 KB or 36 KB
  static constexpr int kQBytes = kMlaHeads * kMlaRow * 2;                   // 18 KB, 16-bit q
  // The copy of a tile: kCpg consecutive chunks of a row per group of kCpg threads (128 or 64
  // contiguous bytes), kRpp rows per pass, kPasses passes, kChunksPer chunks per (thread, row).
  static constexpr int kCpg = kF16 ? 4 : 8;
  static constexpr int kRpp = kMlaThreads / kCpg;
  static constexpr int kPasses = kMlaTile / kRpp;
  static constexpr int kChunksPer = kRowChunks / kCpg;
  // Dynamic shared memory layout (bytes).
  static constexpr int kOffQ = 0;
  static constexpr int kOffKV = kOffQ + kQBytes;                      // 2 tiles
  static constexpr int kOffP = kOffKV + 2 * kTileBytes;               // [4 k-steps][32 lanes] uint4
  static constexpr int kOffSlot = kOffP + kMlaWarps * 32 * 16;        // int [2][64]
  static constexpr int kOffMax = kOffSlot + 2 * kMlaTile * 4;         // float [4 warps][16 rows]
  static constexpr int kOffL = kOffMax + kMlaWarps * kMlaHeads * 4;   // float [4 warps][16 rows]
  static constexpr int kOffKq = kOffL + kMlaWarps * kMlaHeads * 4;    // float [16] score scales
  static constexpr int kSmemBytes = kOffKq + kMlaHeads * 4;
  static constexpr int kMinBlocks = kSmemBytes * 2 <= 227 * 1024 ? 2 : 1;
  static_assert(kRowChunks % kCpg == 0 && kMlaTile % kRpp == 0, "tile copy");
};

// Physical 16-byte chunk of chunk q of row r: BF16 tiles and q (1152-byte rows, 72 chunks)
// XOR r % 8 inside aligned groups of 8: ldmatrix's 8 rows at one chunk hit 8 bank groups.
__device__ __forceinline__ int mla_bf16_chunk(int r, int q) { return q ^ (r & 7); }
// E4M3 tiles (576-byte rows, 36 chunks: even rows start at bank 0, odd rows at bank 16) XOR
// (r / 2) % 4 inside aligned groups of 4: conflict-free for the K reads (8 lanes: rows g, g + 1,
// 4 consecutive chunks each) and the V reads (8 lanes: rows 2c, c = 0..3, chunks
// mla_vchunk(g) for g = 2i, 2i + 1, which lie in different groups of 4).
__device__ __forceinline__ int mla_e4m3_chunk(int r, int q) { return q ^ ((r >> 1) & 3); }
// E4M3 P V: the chunk (of its warp's 8) whose 16 dims thread group g holds as output column g.
__device__ __forceinline__ int mla_vchunk(int g) { return (g >> 1) + 4 * (g & 1); }
// E4M3 QK^T: the position (k index of the A operand) at which q's dim d is stored: thread c's
// k-slots of step 4 ci + kk are dims 64 ci + 16 c + 4 kk + e (e = 0, 1: slots 2c, 2c + 1; e = 2, 3:
// slots 2c + 8, 2c + 9), the dims of its 16-byte K read.
__device__ __forceinline__ int mla_qslot(int d) {
  const int ci = d >> 6, c = (d >> 4) & 3, kk = (d >> 2) & 3, e = d & 3;
  return 16 * (4 * ci + kk) + 2 * c + (e & 1) + 8 * (e >> 1);
}

// grid T * ceil(H / 16) (head block fastest), block kMlaThreads, dynamic shared memory
// MlaCfg<TP>::kSmemBytes.
template <class TP>
__global__ void __launch_bounds__(kMlaThreads, MlaCfg<TP>::kMinBlocks) mla_decode_kernel(const MlaArgs a) {
  using Cfg = MlaCfg<TP>;
  constexpr bool F16 = Cfg::kF16;
  constexpr int RB = Cfg::kRowBytes;
  unsigned char* smem = mla_dyn_smem();
  unsigned char* s_q = smem + Cfg::kOffQ;
  unsigned char* s_kv = smem + Cfg::kOffKV;
  uint4* s_p = reinterpret_cast<uint4*>(smem + Cfg::kOffP);
  int* s_slot = reinterpret_cast<int*>(smem + Cfg::kOffSlot);
  float* s_max = reinterpret_cast<float*>(smem + Cfg::kOffMax);
  float* s_l = reinterpret_cast<float*>(smem + Cfg::kOffL);
  float* s_kq = reinterpret_cast<float*>(smem + Cfg::kOffKq);

  const int nhb = (a.H + kMlaHeads - 1) / kMlaHeads;
  const int64_t t = static_cast<int64_t>(blockIdx.x) / nhb;
  const int h0 = (static_cast<int>(blockIdx.x) - static_cast<int>(t) * nhb) * kMlaHeads;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int len = a.token_pos[t] + 1;  // positions 0 .. pos
  const int ntiles = (len + kMlaTile - 1) / kMlaTile;
  const int32_t* table = a.page_table + static_cast<int64_t>(a.token_seq[t]) * a.max_pages;
  const unsigned char* pool = static_cast<const unsigned char*>(a.pool);
  const int ps = a.page_size;
  // The cache slot of position j in the page of `entry`, and of position j; -1 past the token's
  // positions (its rows are zero-filled).
  auto slot_at = [&](int j, int entry) -> int { return j < len ? entry * ps + j % ps : -1; };
  auto slot_of = [&](int j) -> int { return slot_at(j, j < len ? table[j / ps] : 0); };
  // Copies tile kt into buffer kt % 2 from the slots in s_slot[kt % 2]: thread group tid / kCpg,
  // kCpg consecutive chunks of a row at a time; zero rows past the positions (P = 0 there and
  // 0 * V must not meet a NaN of stale memory).
  auto issue = [&](int kt) {
    unsigned char* dst = s_kv + (kt & 1) * Cfg::kTileBytes;
    const int* slots = s_slot + (kt & 1) * kMlaTile;
    const int q0 = tid % Cfg::kCpg, rr = tid / Cfg::kCpg;
#pragma unroll
    for (int pass = 0; pass < Cfg::kPasses; ++pass) {
      const int r = pass * Cfg::kRpp + rr, sl = slots[r];
      const unsigned char* src = pool + (sl >= 0 ? static_cast<int64_t>(sl) * RB : 0);
#pragma unroll
      for (int i = 0; i < Cfg::kChunksPer; ++i) {
        const int q = q0 + Cfg::kCpg * i;
        const int pq = F16 ? mla_e4m3_chunk(r, q) : mla_bf16_chunk(r, q);
        mla_cp_async16(dst + r * RB + pq * 16, src + q * 16, sl >= 0);
      }
    }
  };

  if (tid < kMlaTile) {
    s_slot[tid] = slot_of(tid);
    s_slot[kMlaTile + tid] = slot_of(kMlaTile + tid);
  }
  __syncthreads();
  issue(0);
  mla_cp_async_commit();

  // q rows (warp w: rows w, w + 4, ..; rows past H zero) into s_q as 16-bit MMA inputs, and the
  // score scale of each row. BF16 pools: q as it is. E4M3: q 2^(15 - e) in FP16 (amax = m 2^e,
  // m in [0.5, 1): amax 2^(15 - e) in [2^14, 2^15)), stored at mla_qslot positions.
  {
    const float ksc = F16 ? a.k_scale[0] : 1.0f;
    for (int r = warp; r < kMlaHeads; r += kMlaWarps) {
      const bool in = h0 + r < a.H;
      const unsigned char* qrow =
          static_cast<const unsigned char*>(a.q) + (in ? (t * a.H + h0 + r) * (kMlaRow * 2) : 0);
      uint4 w[3];  // chunks lane, lane + 32, lane + 64 (< 72) of 8 values
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        const int q = lane + 32 * i;
        w[i] = in && q < kMlaRow / 8 ? mla_ldg16(qrow + q * 16) : make_uint4(0, 0, 0, 0);
        const uint32_t u[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          amax = fmaxf(amax, fmaxf(fabsf(bf16_bits_to_float(static_cast<uint16_t>(u[j]))),
                                   fabsf(bf16_bits_to_float(static_cast<uint16_t>(u[j] >> 16)))));
      }
      float fs = 1.0f;
      int e = 0;
      if constexpr (F16) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (amax > 0.0f) {
          frexpf(amax, &e);
          fs = ldexpf(1.0f, e - 15);
        }
      }
      unsigned char* srow = s_q + r * (kMlaRow * 2);
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        const int q = lane + 32 * i;
        if (q >= kMlaRow / 8) continue;
        if constexpr (!F16) {
          *reinterpret_cast<uint4*>(srow + mla_bf16_chunk(r, q) * 16) = w[i];
        } else {
          const uint32_t u[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // dims 8q + 2j, + 1: one pair of k-slots
            const float lo = ldexpf(bf16_bits_to_float(static_cast<uint16_t>(u[j])), 15 - e);
            const float hi = ldexpf(bf16_bits_to_float(static_cast<uint16_t>(u[j] >> 16)), 15 - e);
            const int x = mla_qslot(8 * q + 2 * j);  // even; x + 1 holds dim 8q + 2j + 1
            *reinterpret_cast<uint32_t*>(srow + mla_bf16_chunk(r, x >> 3) * 16 + (x & 7) * 2) = mla_pack2<true>(lo, hi);
          }
        }
      }
      if (lane == 0) s_kq[r] = fs * a.scale_log2 * ksc;
    }
  }
  __syncthreads();
  const float kq[2] = {s_kq[g], s_kq[g + 8]};  // score scales of rows g, g + 8

  // Per-lane shared-memory offsets of the fragment reads (ldmatrix: lane l addresses row l % 8 of
  // matrix l / 8). The chunk XOR touches only the low 3 bits, so a k-step's chunk is
  // 8 (step / 4) + ((2 (step % 4) + half) ^ swizzle): 4 offsets per lane.
  const int li = lane & 7, lj = lane >> 3;
  // q A fragment of step ks: rows li + 8 (lj & 1), chunk 2 ks + (lj >> 1).
  const unsigned char* qa_base = s_q + (li + 8 * (lj & 1)) * (kMlaRow * 2);
  int qa_off[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) qa_off[i] = ((2 * i + (lj >> 1)) ^ li) * 16;

  float o[kMlaNTiles][4];  // O rows g, g + 8: BF16 dims 128 warp + 8 nt + 2c + e; E4M3 see the header
#pragma unroll
  for (int nt = 0; nt < kMlaNTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running max of rows g, g + 8 (base 2; the same in every warp)
  float l[2] = {0.0f, 0.0f};            // this thread's share of the denominators

  for (int k = 0; k < ntiles; ++k) {
    mla_cp_async_wait_all();
    __syncthreads();  // tile k landed (every thread's copies); every warp is done with tile k - 1
    if (k + 1 < ntiles) {
      issue(k + 1);
      mla_cp_async_commit();
    }
    // The slots of tile k + 2 (into s_slot[k % 2], whose tile k was issued before the barrier):
    // the page-table entry loaded now, the slot made of it and stored at the end of the iteration
    // (a slot computed here would wait for the load at once: a warp issues in order).
    const bool slot_next = tid < kMlaTile && k + 2 < ntiles;
    const int nj = (k + 2) * kMlaTile + tid;
    int nentry = 0;
    if (slot_next && nj < len) nentry = table[nj / ps];
    const unsigned char* tile = s_kv + (k & 1) * Cfg::kTileBytes;

    // S = Q K^T for positions 16 warp + 8 nb + 2c + (i & 1), rows g + 8 (i >> 1): two chains per
    // n-block (even / odd k-steps) for the MMA latency.
    float sacc[2][2][4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int par = 0; par < 2; ++par) sacc[nb][par][0] = sacc[nb][par][1] = sacc[nb][par][2] = sacc[nb][par][3] = 0.0f;
    if constexpr (!F16) {
      // K B fragments by ldmatrix: matrix lj = (n-block lj >> 1, k half lj & 1), row li.
      const unsigned char* kb_base = tile + (16 * warp + 8 * (lj >> 1) + li) * RB;
      int kb_off[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) kb_off[i] = ((2 * i + (lj & 1)) ^ li) * 16;
#pragma unroll
      for (int ks = 0; ks < kMlaKSteps; ++ks) {
        uint32_t qa[4], kb[4];
        mla_ldsm_x4(qa, qa_base + (ks >> 2) * 128 + qa_off[ks & 3]);
        mla_ldsm_x4(kb, kb_base + (ks >> 2) * 128 + kb_off[ks & 3]);
        mla_mma<false>(sacc[0][ks & 1], qa, kb[0], kb[1]);
        mla_mma<false>(sacc[1][ks & 1], qa, kb[2], kb[3]);
      }
    } else {
      // 16 codes (dims 64 ci + 16 c ..) of K rows 16 warp + g and + 8 per 4 k-steps.
      const unsigned char* k0 = tile + (16 * warp + g) * RB + (c ^ ((g >> 1) & 3)) * 16;
#pragma unroll
      for (int ci = 0; ci < kMlaKSteps / 4; ++ci) {
        const uint4 w0 = mla_lds16(k0 + ci * 64), w1 = mla_lds16(k0 + 8 * RB + ci * 64);
        const uint32_t u0[4] = {w0.x, w0.y, w0.z, w0.w}, u1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int ks = 4 * ci + kk;
          uint32_t qa[4];
          mla_ldsm_x4(qa, qa_base + (ks >> 2) * 128 + qa_off[ks & 3]);
          mla_mma<true>(sacc[0][kk & 1], qa, e4m3x2_lo_f16x2(u0[kk]), e4m3x2_hi_f16x2(u0[kk]));
          mla_mma<true>(sacc[1][kk & 1], qa, e4m3x2_lo_f16x2(u1[kk]), e4m3x2_hi_f16x2(u1[kk]));
        }
      }
    }
    // Scores (base-2 logits), -inf past the positions; the tile's row maxima over the 4 threads
    // of a row, then over the warps.
    float sc[2][4], mx[2] = {-INFINITY, -INFINITY};
    const int jb = k * kMlaTile + 16 * warp + 2 * c;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float s = (sacc[nb][0][i] + sacc[nb][1][i]) * kq[i >> 1];
        sc[nb][i] = jb + 8 * nb + (i & 1) < len ? s : -INFINITY;
        mx[i >> 1] = fmaxf(mx[i >> 1], sc[nb][i]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (c == 0) s_max[warp * kMlaHeads + g] = mx[0], s_max[warp * kMlaHeads + g + 8] = mx[1];
    __syncthreads();
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tm = s_max[g + 8 * r];
#pragma unroll
      for (int w = 1; w < kMlaWarps; ++w) tm = fmaxf(tm, s_max[w * kMlaHeads + g + 8 * r]);
      const float mn = fmaxf(m[r], tm);  // finite: position k * 64 is one of the token's
      corr[r] = exp2f(m[r] - mn);        // 0 on the first tile (m = -inf)
      m[r] = mn;
      l[r] *= corr[r];
    }
    float p[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        p[nb][i] = exp2f(sc[nb][i] - m[i >> 1]);
        l[i >> 1] += p[nb][i];
      }
    // P as the A fragment of P V k-step `warp` (positions 16 warp ..): a0 rows g / positions 2c,
    // 2c + 1 (n-block 0), a1 rows g + 8, a2 / a3 the same of n-block 1 (positions 8 + 2c ..).
    s_p[warp * 32 + lane] = make_uint4(mla_pack2<F16>(p[0][0], p[0][1]), mla_pack2<F16>(p[0][2], p[0][3]),
                                       mla_pack2<F16>(p[1][0], p[1][1]), mla_pack2<F16>(p[1][2], p[1][3]));
#pragma unroll
    for (int nt = 0; nt < kMlaNTiles; ++nt) {
      o[nt][0] *= corr[0], o[nt][1] *= corr[0];
      o[nt][2] *= corr[1], o[nt][3] *= corr[1];
    }
    __syncthreads();

    // O += P V over the tile's 4 k-steps of 16 positions.
#pragma unroll
    for (int kp = 0; kp < kMlaWarps; ++kp) {
      const uint4 pv = s_p[kp * 32 + lane];
      const uint32_t pa[4] = {pv.x, pv.y, pv.z, pv.w};
      if constexpr (!F16) {
        // V B fragments by ldmatrix.trans: matrix lj = (position half lj & 1, n-block pair half
        // lj >> 1), rows 16 kp + 8 (lj & 1) + li, chunk 16 warp + 2 np + (lj >> 1).
        const unsigned char* vb = tile + (16 * kp + 8 * (lj & 1) + li) * RB + 16 * warp * 16;
#pragma unroll
        for (int np = 0; np < kMlaNTiles / 2; ++np) {
          uint32_t vr[4];
          mla_ldsm_x4_t(vr, vb + (np >> 2) * 128 + ((2 * (np & 3) + (lj >> 1)) ^ li) * 16);
          mla_mma<false>(o[2 * np], pa, vr[0], vr[1]);
          mla_mma<false>(o[2 * np + 1], pa, vr[2], vr[3]);
        }
      } else {
        // V rows 2c, 2c + 1, 2c + 8, 2c + 9 of k-step kp, chunk 8 warp + mla_vchunk(g) (XOR c:
        // mla_e4m3_chunk of those rows); byte pairs of two rows interleaved by prmt, then FP16.
        const unsigned char* vb = tile + (16 * kp + 2 * c) * RB + ((8 * warp + mla_vchunk(g)) ^ c) * 16;
        uint32_t w[4][4];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const uint4 u = mla_lds16(vb + ((rr & 1) + 8 * (rr >> 1)) * RB);
          w[rr][0] = u.x, w[rr][1] = u.y, w[rr][2] = u.z, w[rr][3] = u.w;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // codes 4j .. 4j + 3 of the chunk: n-blocks 4j + e
          const uint32_t x0 = byte_perm(w[0][j], w[1][j], 0x5140), y0 = byte_perm(w[0][j], w[1][j], 0x7362);
          const uint32_t x1 = byte_perm(w[2][j], w[3][j], 0x5140), y1 = byte_perm(w[2][j], w[3][j], 0x7362);
          mla_mma<true>(o[4 * j], pa, e4m3x2_lo_f16x2(x0), e4m3x2_lo_f16x2(x1));
          mla_mma<true>(o[4 * j + 1], pa, e4m3x2_hi_f16x2(x0), e4m3x2_hi_f16x2(x1));
          mla_mma<true>(o[4 * j + 2], pa, e4m3x2_lo_f16x2(y0), e4m3x2_lo_f16x2(y1));
          mla_mma<true>(o[4 * j + 3], pa, e4m3x2_hi_f16x2(y0), e4m3x2_hi_f16x2(y1));
        }
      }
    }
    if (slot_next) s_slot[(k & 1) * kMlaTile + tid] = slot_at(nj, nentry);
  }

  // Epilogue: the denominators over the 4 threads of a row and the warps; out = O / l (E4M3:
  // times k_scale, V's scale), BF16 round to nearest even; lse = (m + log2 l) ln 2.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  if (c == 0) s_l[warp * kMlaHeads + g] = l[0], s_l[warp * kMlaHeads + g + 8] = l[1];
  __syncthreads();
  const float vsc = F16 ? a.k_scale[0] : 1.0f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r, h = h0 + row;
    if (h >= a.H) continue;
    float den = 0.0f;
#pragma unroll
    for (int w = 0; w < kMlaWarps; ++w) den += s_l[w * kMlaHeads + row];
    const float f = vsc / den;
    unsigned char* orow = static_cast<unsigned char*>(a.out) + ((t * a.H) + h) * (kMlaV * 2) + 128 * warp * 2;
    if constexpr (!F16) {
#pragma unroll
      for (int nt = 0; nt < kMlaNTiles; ++nt)
        *reinterpret_cast<uint32_t*>(orow + (8 * nt + 2 * c) * 2) =
            mla_pack2<false>(o[nt][2 * r] * f, o[nt][2 * r + 1] * f);
    } else {
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // column 2c + e: the 16 dims of chunk mla_vchunk(2c + e)
        unsigned char* dst = orow + mla_vchunk(2 * c + e) * 32;
#pragma unroll
        for (int hlf = 0; hlf < 2; ++hlf) {
          const int n0 = 8 * hlf;
          mla_stg16(dst + hlf * 16,
                    make_uint4(mla_pack2<false>(o[n0][2 * r + e] * f, o[n0 + 1][2 * r + e] * f),
                               mla_pack2<false>(o[n0 + 2][2 * r + e] * f, o[n0 + 3][2 * r + e] * f),
                               mla_pack2<false>(o[n0 + 4][2 * r + e] * f, o[n0 + 5][2 * r + e] * f),
                               mla_pack2<false>(o[n0 + 6][2 * r + e] * f, o[n0 + 7][2 * r + e] * f)));
        }
      }
    }
    if (a.lse && warp == 0 && c == 0) a.lse[static_cast<int64_t>(h) * a.T + t] = (m[r] + log2f(den)) * 0.6931471805599453f;
  }
}
// ---- emulated: end --------------------------------------------------------------------------

template <class TP>
void launch_mla(const MlaArgs& a, int64_t T, cudaStream_t stream) {
  using Cfg = MlaCfg<TP>;
  static std::once_flag opted[64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev), "mla decode: cudaGetDevice");
  std::call_once(opted[dev >= 0 && dev < 64 ? dev : 0], [&] {
    CUDA_CHECK(cudaFuncSetAttribute(mla_decode_kernel<TP>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
               "mla decode: shared memory opt-in of ", Cfg::kSmemBytes, " bytes");
  });
  const int64_t blocks = T * ((a.H + kMlaHeads - 1) / kMlaHeads);
  mla_decode_kernel<TP><<<static_cast<unsigned>(blocks), kMlaThreads, Cfg::kSmemBytes, stream>>>(a);
  CUDA_CHECK_LAUNCH("mla_decode_kernel");
}

}  // namespace

bool launch_mla_decode(const void* q, const int32_t* token_seq, const int32_t* token_pos, const int32_t* page_table,
                       int max_pages, int64_t T, int H, int page_size, const void* pool, DType pool_dtype,
                       const float* k_scale, float softmax_scale, void* out, float* lse, cudaStream_t stream) {
  auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (T < 0 || H <= 0 || page_size <= 0 || max_pages <= 0) return false;
  if (pool_dtype != DType::BF16 && pool_dtype != DType::E4M3) return false;
  if (pool_dtype == DType::E4M3 && k_scale == nullptr) return false;
  if (!q || !out || !pool || !token_seq || !token_pos || !page_table) return false;
  if (!a16(q) || !a16(out) || !a16(pool)) return false;  // 16-byte loads, stores and cp.async
  if (T * ((H + kMlaHeads - 1) / kMlaHeads) > INT_MAX) return false;
  if (T == 0) return true;
  MlaArgs a;
  a.q = q;
  a.token_seq = token_seq;
  a.token_pos = token_pos;
  a.page_table = page_table;
  a.pool = pool;
  a.k_scale = pool_dtype == DType::E4M3 ? k_scale : nullptr;
  a.out = out;
  a.lse = lse;
  a.T = T;
  a.H = H;
  a.max_pages = max_pages;
  a.page_size = page_size;
  a.scale_log2 = softmax_scale * 1.4426950408889634f;
  if (pool_dtype == DType::E4M3) launch_mla<uint8_t>(a, T, stream);
  else launch_mla<bf16>(a, T, stream);
  return true;
}

}  // namespace fp8rl::cuda
