// Mixture-of-experts kernels: softmax top-k routing and its backward, the permute (row gather,
// optionally weighted), the weighted un-permute (a fixed-order sum of each token's k rows: no
// atomics, deterministic) and the routing weights' gradient. One warp per token for the routing,
// grid-stride loops elsewhere; FP32 math.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/quant.cuh"
#include "quant/quant.h"

namespace fp8rl::cuda {

namespace {

// The routing kernels run one warp per token (kRouteWarps tokens per 128-thread block): lane l
// holds experts l, l + 32, ... (E <= kRouteMaxExperts), so a token's E logits are read coalesced
// and its reductions are warp shuffles. (The first form, one thread per token, walked the top-k
// serially over global memory: ~275 us per call at 256 tokens x 128 experts, a quarter of a
// Qwen3-30B-A3B decode step.)
constexpr int kRouteWarps = 4;
constexpr int kRouteMaxExperts = 1024;  // 32 per lane: the taken set of a lane is one 32-bit mask

// Row z [E] of the logits: its max m and sum_e exp(z_e - m) s (the softmax's normalizer), the
// same on every lane: each lane sums its experts in order, then the xor tree (each level adds a
// pair in both lanes, a commutative add: every lane ends with the same bits).
__device__ void warp_softmax_max_sum(const float* z, int E, int lane, float& m, float& s) {
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, z[e]);
  m = warp_max(mx);
  float acc = 0.0f;
  for (int e = lane; e < E; e += 32) acc += expf(z[e] - m);
  s = warp_sum(acc);
}

// The weights of the k experts ex of one token: softmax probabilities p = exp(z - m) / s,
// divided by their sum (slot order) when renormalized. The one formula of the routing kernel
// and the replay kernel (bitwise equal weights for the same experts).
__device__ void softmax_weights_of(const float* z, float m, float s, const int32_t* ex, int k, bool renorm, float* w) {
  float sel = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float p = expf(z[ex[j]] - m) / s;
    w[j] = p;
    sel += p;
  }
  if (renorm)
    for (int j = 0; j < k; ++j) w[j] /= sel;
}

// The top k of value(e) over e in [0, E), descending, ties to the lower expert id (the order of
// a serial scan that replaces its best only on a strictly larger value; a NaN value ranks as
// -inf, so the order stays total and every lane agrees), into ex[0..k) (lane 0 writes). Each round: the lane's best untaken expert, then a shuffle tree whose pairwise choice
// is symmetric (value, then id), so every lane agrees on the winner; its lane marks it taken.
template <class Value>
__device__ void warp_top_k(int E, int k, int lane, Value value, int32_t* ex) {
  uint32_t taken = 0;
  for (int j = 0; j < k; ++j) {
    float bv = 0.0f;
    int be = -1;
    for (int i = 0, e = lane; e < E; ++i, e += 32) {
      if (taken >> i & 1u) continue;
      const float x = value(e), v = x != x ? -INFINITY : x;
      if (be < 0 || v > bv) bv = v, be = e;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
    }
    if (be >= 0 && (be & 31) == lane) taken |= 1u << (be >> 5);
    if (lane == 0) ex[j] = be;
  }
}

// Token t: the k largest logits in descending order (ties: the lower expert id), their
// softmax probabilities (optionally renormalized). Ordering by logit = ordering by probability.
__global__ void moe_route_softmax_kernel(const float* logits, int64_t T, int E, int k, bool renorm,
                                         int32_t* experts, float* weights) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouteWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const float* z = logits + t * E;
  float m, s;
  warp_softmax_max_sum(z, E, lane, m, s);
  warp_top_k(E, k, lane, [&](int e) { return z[e]; }, experts + t * k);
  __syncwarp();
  if (lane == 0) softmax_weights_of(z, m, s, experts + t * k, k, renorm, weights + t * k);
}

// Routing replay: the weights of given experts (each in [0, E), else *bad = 1 and the token's
// weights 0).
__global__ void moe_route_softmax_weights_kernel(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                                 bool renorm, float* weights, int* bad) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouteWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const int32_t* ex = experts + t * k;
  for (int j = 0; j < k; ++j)
    if (ex[j] < 0 || ex[j] >= E) {
      if (lane == 0) {
        *bad = 1;
        for (int i = 0; i < k; ++i) weights[t * k + i] = 0.0f;
      }
      return;
    }
  const float* z = logits + t * E;
  float m, s;
  warp_softmax_max_sum(z, E, lane, m, s);
  if (lane == 0) softmax_weights_of(z, m, s, ex, k, renorm, weights + t * k);
}

// dz_e = p_e (g_e - sum_j ds_j s_j) with s_j = p[e_j], ds_j = dw_j or (dw_j - sum_i dw_i w_i) / S.
// Every lane computes the k-term sums (the same serial order, the same bits); lane l writes its
// experts' dz.
__global__ void moe_route_softmax_backward_kernel(const float* logits, const int32_t* experts, const float* dw,
                                                  int64_t T, int E, int k, bool renorm, float* dlogits) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouteWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const float* z = logits + t * E;
  float* dz = dlogits + t * E;
  const int32_t* ex = experts + t * k;
  float m, s;
  warp_softmax_max_sum(z, E, lane, m, s);
  float S = 0.0f, dot = 0.0f;
  for (int j = 0; j < k; ++j) S += expf(z[ex[j]] - m) / s;
  for (int j = 0; j < k; ++j) dot += dw[t * k + j] * (expf(z[ex[j]] - m) / s) / S;
  float c = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float sj = expf(z[ex[j]] - m) / s;
    const float dsj = renorm ? (dw[t * k + j] - dot) / S : dw[t * k + j];
    c += dsj * sj;
  }
  for (int e = lane; e < E; e += 32) {
    float v = -(expf(z[e] - m) / s) * c;
    for (int j = 0; j < k; ++j)
      if (ex[j] == e) {
        const float sj = expf(z[e] - m) / s;
        v += sj * (renorm ? (dw[t * k + j] - dot) / S : dw[t * k + j]);
      }
    dz[e] = v;
  }
}

// The weights of the k experts ex of one token under sigmoid scoring: s = sigmoid(z) of each,
// divided by (their sum (slot order) + 1e-20) when renormalized, times scaling. Shared by the
// routing and the replay kernels (bitwise equal weights for the same experts).
__device__ void sigmoid_weights_of(const float* z, const int32_t* ex, int k, bool renorm, float scaling, float* w) {
  float sel = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float s = 1.0f / (1.0f + expf(-z[ex[j]]));
    w[j] = s;
    sel += s;
  }
  for (int j = 0; j < k; ++j) w[j] = (renorm ? w[j] / (sel + 1e-20f) : w[j]) * scaling;
}

// DeepSeek-V3 routing for token t (see backend.h moe_route_sigmoid), one warp per token: the
// choices c = sigmoid(z) + bias in shared memory, lane g scores group g (its two largest c, in
// the serial scan's order: the sum of the same two values), each group kept when fewer than
// topk_group groups beat it (ties: the lower group), then the top k of the masked choices.
constexpr int kMaxGroups = 64;
__global__ void moe_route_sigmoid_kernel(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                                         int topk_group, bool renorm, float scaling, int32_t* experts, float* weights) {
  __shared__ float choice_s[kRouteWarps][kRouteMaxExperts];
  __shared__ float group_s[kRouteWarps][kMaxGroups];
  __shared__ bool kept_s[kRouteWarps][kMaxGroups];
  const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouteWarps) + w;
  if (t >= T) return;
  const float* z = logits + t * E;
  float* ch = choice_s[w];
  for (int e = lane; e < E; e += 32) ch[e] = 1.0f / (1.0f + expf(-z[e])) + (bias ? bias[e] : 0.0f);
  __syncwarp();
  const int G = E / n_group;
  for (int g = lane; g < n_group; g += 32) {
    float m1 = -INFINITY, m2 = -INFINITY;
    for (int e = g * G; e < (g + 1) * G; ++e) {
      const float c = ch[e];
      if (c > m1) m2 = m1, m1 = c;
      else if (c > m2) m2 = c;
    }
    group_s[w][g] = G == 1 ? m1 : m1 + m2;
  }
  __syncwarp();
  for (int g = lane; g < n_group; g += 32) {
    int better = 0;
    for (int h = 0; h < n_group; ++h) better += group_s[w][h] > group_s[w][g] || (group_s[w][h] == group_s[w][g] && h < g);
    kept_s[w][g] = better < topk_group;
  }
  __syncwarp();
  warp_top_k(E, k, lane, [&](int e) { return kept_s[w][e / G] ? ch[e] : 0.0f; }, experts + t * k);
  __syncwarp();
  if (lane == 0) sigmoid_weights_of(z, experts + t * k, k, renorm, scaling, weights + t * k);
}

// Routing replay: the weights of given experts (each in [0, E), else *bad = 1 and the token's
// weights 0). One thread per token (no reduction over E).
__global__ void moe_route_sigmoid_weights_kernel(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                                 bool renorm, float scaling, float* weights, int* bad) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const int32_t* ex = experts + t * k;
  for (int j = 0; j < k; ++j)
    if (ex[j] < 0 || ex[j] >= E) {
      *bad = 1;
      for (int i = 0; i < k; ++i) weights[t * k + i] = 0.0f;
      return;
    }
  sigmoid_weights_of(logits + t * E, ex, k, renorm, scaling, weights + t * k);
}

// One warp per token: lane l writes its experts' dz (0, plus the selected expert's term).
__global__ void moe_route_sigmoid_backward_kernel(const float* logits, const int32_t* experts, const float* dw,
                                                  int64_t T, int E, int k, bool renorm, float scaling, float* dlogits) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouteWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const float* z = logits + t * E;
  float* dz = dlogits + t * E;
  const int32_t* ex = experts + t * k;
  float S = 1e-20f, dot = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float s = 1.0f / (1.0f + expf(-z[ex[j]]));
    S += s;
    dot += dw[t * k + j] * s;
  }
  for (int e = lane; e < E; e += 32) {
    float v = 0.0f;
    for (int j = 0; j < k; ++j)
      if (ex[j] == e) {
        const float s = 1.0f / (1.0f + expf(-z[e]));
        const float ds = renorm ? scaling / S * (dw[t * k + j] - dot / S) : scaling * dw[t * k + j];
        v += ds * s * (1.0f - s);
      }
    dz[e] = v;
  }
}

template <class T>
__global__ void moe_permute_kernel(const T* x, const int32_t* row_slot, const float* w, int64_t R, int64_t D, int k,
                                   int64_t slots, T* out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * D;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / D, d = i % D;
    const int32_t s = row_slot[r];
    if (s < 0 || s >= slots) {
      *bad = 1;
      continue;
    }
    const float v = load_f(x, (s / k) * D + d);
    store_f(out, i, w ? v * w[s] : v);
  }
}

// The same, 8 columns per thread in 16-byte accesses (D % 8 == 0, aligned rows): each element's
// arithmetic is the scalar kernel's (bitwise the same). The scalar one's per-element divisions
// and 2-byte accesses left it at ~1/5 of HBM bandwidth on the MoE train step.
template <class T>
__global__ void moe_permute_vec_kernel(const T* x, const int32_t* row_slot, const float* w, int64_t R, int64_t D8,
                                       int k, int64_t slots, T* out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * D8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / D8, d = (i % D8) * 8;
    const int32_t s = row_slot[r];
    if (s < 0 || s >= slots) {
      *bad = 1;
      continue;
    }
    float v[8];
    load8(x + (s / k) * D8 * 8 + d, v);
    if (w) {
      const float ws = w[s];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = v[e] * ws;
    }
    store8(out + r * D8 * 8 + d, v);
  }
}

// moe_permute_vec_kernel's rows (each element's arithmetic the same) with their FP8 copy: a group
// of 8 lanes per 128-column block of an output row (quant.cuh's row blocks), the values rounded
// to T as stored, then quantized (the down dgrad's dY in the experts' backward).
template <class T>
__global__ void moe_permute_quant_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_slot,
                                         const float* __restrict__ w, int64_t R, int64_t D, int k, int64_t slots,
                                         T* __restrict__ out, bool pow2, uint8_t* __restrict__ q,
                                         float* __restrict__ scales, bool gemm_layout, int* bad) {
  RowBlock h;
  if (!row_block(R, D, h)) return;
  const int32_t s = row_slot[h.r];
  if (s < 0 || s >= slots) {  // the block's 8 lanes leave together
    if (h.sub == 0) *bad = 1;
    return;
  }
  const float ws = w ? w[s] : 1.0f;
  const T* src = x + static_cast<int64_t>(s / k) * D;
  float v[16] = {};
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    if (!h.in[c]) continue;
    float* vc = v + 8 * c;
    load8(src + h.col[c], vc);
    if (w) {
#pragma unroll
      for (int e = 0; e < 8; ++e) vc[e] = vc[e] * ws;
    }
    store8_rounded(out + h.r * D + h.col[c], vc);
    stored_amax8(vc, amax, finite);
  }
  if (!finite) atomicExch(bad, 1);
  row_block_quantize(h, v, amax, R, D, pow2, q, scales, gemm_layout);
}

// The experts' FP8 input gathered from x's 1x128 copy: row r of q is row row_slot[r] / k of xq,
// 16 bytes per thread (D % 16 == 0, 16-byte aligned rows); the thread at the start of each
// 128-column block copies its scale too. Scales block-major ([nb][rows]) or row-major
// ([rows][nb]), each side as its flag says.
__global__ void moe_permute_fp8_kernel(const uint8_t* __restrict__ xq, const float* __restrict__ xs, bool xs_kb,
                                       int64_t T, const int32_t* __restrict__ row_slot, int64_t R, int64_t D16, int k,
                                       uint8_t* __restrict__ q, float* __restrict__ s, bool s_kb, int* bad) {
  const int64_t nb = (D16 * 16 + 127) / 128;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * D16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / D16, c = i % D16;
    const int32_t slot = row_slot[r];
    if (slot < 0 || slot >= T * k) {
      *bad = 1;
      continue;
    }
    const int64_t t = slot / k;
    reinterpret_cast<uint4*>(q + r * D16 * 16)[c] = reinterpret_cast<const uint4*>(xq + t * D16 * 16)[c];
    if (c % 8 == 0) {
      const int64_t b = c / 8;
      s[s_kb ? b * R + r : r * nb + b] = xs[xs_kb ? b * T + t : t * nb + b];
    }
  }
}

template <class T>
__global__ void moe_unpermute_kernel(const T* y, const int32_t* slot_row, const float* w, int64_t T_, int64_t D,
                                     int k, int64_t R, T* out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T_ * D;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, d = i % D;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = slot_row[t * k + j];
      if (r < 0 || r >= R) {
        *bad = 1;
        continue;
      }
      const float v = load_f(y, r * D + d);
      acc = w ? fmaf(w[t * k + j], v, acc) : acc + v;
    }
    store_f(out, i, acc);
  }
}

// The same, 8 columns per thread in 16-byte accesses (D % 8 == 0, aligned rows): each element's
// sum the scalar kernel's (bitwise). The scalar kernel's 2-byte accesses and per-element index
// divisions run far below HBM bandwidth (the permute's twin measured ~1/5 of it).
template <class T>
__global__ void moe_unpermute_vec_kernel(const T* __restrict__ y, const int32_t* __restrict__ slot_row,
                                         const float* __restrict__ w, int64_t T_, int64_t D8, int k, int64_t R,
                                         T* __restrict__ out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T_ * D8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / D8, d = (i % D8) * 8;
    float acc[8] = {};
    for (int j = 0; j < k; ++j) {
      const int32_t r = slot_row[t * k + j];
      if (r < 0 || r >= R) {
        *bad = 1;
        continue;
      }
      float v[8];
      load8(y + r * D8 * 8 + d, v);
      if (w) {
        const float wj = w[t * k + j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(wj, v[e], acc[e]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = acc[e] + v[e];
      }
    }
    store8(out + t * D8 * 8 + d, acc);
  }
}

// One warp per slot: dw[s] = dot(dout[s / k], y[slot_row[s]]), each lane's terms fused in order
// (8 columns per 16-byte access where vec8), then the warp's sum: deterministic.
template <class T>
__global__ void moe_weight_grad_kernel(const T* dout, const T* y, const int32_t* slot_row, int64_t S, int64_t D,
                                       int k, int64_t R, bool vec8, float* dw, int* bad) {
  const int64_t s = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (s >= S) return;
  const int32_t r = slot_row[s];
  if (r < 0 || r >= R) {
    if (lane == 0) *bad = 1;
    return;
  }
  float acc = 0.0f;
  const T *a = dout + (s / k) * D, *b = y + r * D;
  if (vec8) {  // 8 columns per lane and step (16-byte accesses), then the lanes' sums
    for (int64_t d = 8 * lane; d < D; d += 256) {
      float u[8], v[8];
      load8(a + d, u);
      load8(b + d, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(u[e], v[e], acc);
    }
  } else {
    for (int64_t d = lane; d < D; d += 32) acc = fmaf(load_f(a, d), load_f(b, d), acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) dw[s] = acc;
}

unsigned route_grid(int64_t T) { return static_cast<unsigned>((T + kRouteWarps - 1) / kRouteWarps); }

void check_route_experts(int E, const char* op) {
  FP8RL_CHECK(E <= kRouteMaxExperts, op, ": at most ", kRouteMaxExperts, " experts on the GPU, got ", E,
              " (this model runs on the CPU backend only)");
}

// One 64 x 64 tile per CTA of 256 threads: src rows [x, x + y) x columns [c0, c0 + 64) read as
// 8-byte runs of 4 elements into shared memory (rows past y as zeros), then written transposed
// as 8-byte runs of 4 rows: every global access is a contiguous 128-byte run per 16 threads (one
// line for the writes; the reads' runs are 16-byte aligned only).
__global__ void transpose_row_blocks_bf16_kernel(const uint16_t* __restrict__ src, int64_t cols,
                                                 const int2* __restrict__ blocks, int64_t ld,
                                                 uint16_t* __restrict__ dst) {
  __shared__ __align__(8) uint16_t tile[64][64 + 4];  // 68: a row's 8-byte runs stay 8-byte aligned
  const int2 blk = blocks[blockIdx.x];
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * 64;
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {
    const int r = i / 16, q = i % 16;
    const int64_t c = c0 + 4 * q;
    uint2 v = make_uint2(0u, 0u);
    if (r < blk.y && c < cols) v = *reinterpret_cast<const uint2*>(src + (static_cast<int64_t>(blk.x) + r) * cols + c);
    *reinterpret_cast<uint2*>(&tile[r][4 * q]) = v;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {
    const int c = i / 16, q = i % 16;
    if (c0 + c >= cols) continue;
    const uint32_t lo = tile[4 * q][c] | (static_cast<uint32_t>(tile[4 * q + 1][c]) << 16);
    const uint32_t hi = tile[4 * q + 2][c] | (static_cast<uint32_t>(tile[4 * q + 3][c]) << 16);
    *reinterpret_cast<uint2*>(dst + (c0 + c) * ld + static_cast<int64_t>(blockIdx.x) * 64 + 4 * q) = make_uint2(lo, hi);
  }
}

}  // namespace

void launch_moe_route_softmax(const float* logits, int64_t T, int E, int k, bool renorm, int32_t* experts,
                              float* weights, cudaStream_t stream) {
  if (T == 0) return;
  check_route_experts(E, "moe_route_softmax");
  moe_route_softmax_kernel<<<route_grid(T), 32 * kRouteWarps, 0, stream>>>(logits, T, E, k, renorm, experts, weights);
  CUDA_CHECK_LAUNCH("moe_route_softmax_kernel");
}

void launch_moe_route_softmax_backward(const float* logits, const int32_t* experts, const float* dweights, int64_t T,
                                       int E, int k, bool renorm, float* dlogits, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_softmax_backward_kernel<<<route_grid(T), 32 * kRouteWarps, 0, stream>>>(logits, experts, dweights, T, E,
                                                                                   k, renorm, dlogits);
  CUDA_CHECK_LAUNCH("moe_route_softmax_backward_kernel");
}

void launch_moe_route_sigmoid(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                              int topk_group, bool renorm, float scaling, int32_t* experts, float* weights,
                              cudaStream_t stream) {
  if (T == 0) return;
  FP8RL_CHECK(n_group <= kMaxGroups, "moe_route_sigmoid: at most ", kMaxGroups, " groups on the GPU, got ", n_group);
  check_route_experts(E, "moe_route_sigmoid");
  moe_route_sigmoid_kernel<<<route_grid(T), 32 * kRouteWarps, 0, stream>>>(logits, bias, T, E, k, n_group, topk_group,
                                                                          renorm, scaling, experts, weights);
  CUDA_CHECK_LAUNCH("moe_route_sigmoid_kernel");
}

void launch_moe_route_sigmoid_backward(const float* logits, const int32_t* experts, const float* dweights, int64_t T,
                                       int E, int k, bool renorm, float scaling, float* dlogits, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_sigmoid_backward_kernel<<<route_grid(T), 32 * kRouteWarps, 0, stream>>>(logits, experts, dweights, T, E,
                                                                                   k, renorm, scaling, dlogits);
  CUDA_CHECK_LAUNCH("moe_route_sigmoid_backward_kernel");
}

void launch_moe_route_softmax_weights(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                      bool renorm, float* weights, int* bad_flag, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_softmax_weights_kernel<<<route_grid(T), 32 * kRouteWarps, 0, stream>>>(logits, experts, T, E, k, renorm,
                                                                                  weights, bad_flag);
  CUDA_CHECK_LAUNCH("moe_route_softmax_weights_kernel");
}

void launch_moe_route_sigmoid_weights(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                      bool renorm, float scaling, float* weights, int* bad_flag, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_sigmoid_weights_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, experts, T, E, k, renorm, scaling,
                                                                         weights, bad_flag);
  CUDA_CHECK_LAUNCH("moe_route_sigmoid_weights_kernel");
}

void launch_moe_permute(const void* x, DType dt, const int32_t* row_slot, const float* weights, int64_t R, int64_t D,
                        int k, int64_t slots, void* out, int* bad_flag, cudaStream_t stream) {
  if (R * D == 0) return;
  if (vec8_ok(D, {x, out})) {
    FP8RL_DISPATCH_FLOAT(dt, "moe_permute", {
      moe_permute_vec_kernel<T><<<grid_for(R * D / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(x), row_slot, weights, R, D / 8, k, slots, static_cast<T*>(out), bad_flag);
    });
    CUDA_CHECK_LAUNCH("moe_permute_vec_kernel");
    return;
  }
  FP8RL_DISPATCH_FLOAT(dt, "moe_permute", {
    moe_permute_kernel<T><<<grid_for(R * D, 256), 256, 0, stream>>>(static_cast<const T*>(x), row_slot, weights, R, D,
                                                                    k, slots, static_cast<T*>(out), bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_permute_kernel");
}

bool launch_moe_permute_quant(const void* x, DType dt, const int32_t* row_slot, const float* weights, int64_t tokens,
                              int64_t R, int64_t D, int k, void* out, bool pow2, uint8_t* q, float* scales,
                              bool gemm_layout, int* bad_flag, cudaStream_t stream) {
  if (!vec8_ok(D, {x, out, q})) return false;
  if (R == 0) return true;
  const int64_t threads_total = row_block_threads(R, D), slots = tokens * k;
  FP8RL_DISPATCH_FLOAT(dt, "moe_permute_fp8", {
    moe_permute_quant_kernel<T><<<static_cast<unsigned>(ceil_div(threads_total, 256)), 256, 0, stream>>>(
        static_cast<const T*>(x), row_slot, weights, R, D, k, slots, static_cast<T*>(out), pow2, q, scales,
        gemm_layout, bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_permute_quant_kernel");
  return true;
}

bool launch_moe_permute_fp8(const uint8_t* xq, const float* xs, bool xs_kb, int64_t T, const int32_t* row_slot,
                            int64_t R, int64_t D, int k, uint8_t* q, float* s, bool s_kb, int* bad_flag,
                            cudaStream_t stream) {
  if (D % 16 != 0 || reinterpret_cast<uintptr_t>(xq) % 16 != 0 || reinterpret_cast<uintptr_t>(q) % 16 != 0)
    return false;
  if (R * D == 0) return true;
  moe_permute_fp8_kernel<<<grid_for(R * D / 16, 256), 256, 0, stream>>>(xq, xs, xs_kb, T, row_slot, R, D / 16, k, q, s,
                                                                        s_kb, bad_flag);
  CUDA_CHECK_LAUNCH("moe_permute_fp8_kernel");
  return true;
}

void launch_moe_unpermute(const void* y, DType dt, const int32_t* slot_row, const float* weights, int64_t T_,
                          int64_t D, int k, int64_t R, void* out, int* bad_flag, cudaStream_t stream) {
  if (T_ * D == 0) return;
  if (vec8_ok(D, {y, out})) {
    FP8RL_DISPATCH_FLOAT(dt, "moe_unpermute", {
      moe_unpermute_vec_kernel<T><<<grid_for(T_ * D / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(y), slot_row, weights, T_, D / 8, k, R, static_cast<T*>(out), bad_flag);
    });
    CUDA_CHECK_LAUNCH("moe_unpermute_vec_kernel");
    return;
  }
  FP8RL_DISPATCH_FLOAT(dt, "moe_unpermute", {
    moe_unpermute_kernel<T><<<grid_for(T_ * D, 256), 256, 0, stream>>>(static_cast<const T*>(y), slot_row, weights, T_,
                                                                       D, k, R, static_cast<T*>(out), bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_unpermute_kernel");
}

void launch_moe_weight_grad(const void* dout, const void* y, DType dt, const int32_t* slot_row, int64_t S, int64_t D,
                            int k, int64_t R, float* dweights, int* bad_flag, cudaStream_t stream) {
  if (S == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "moe_unpermute_backward_weights", {
    moe_weight_grad_kernel<T><<<grid_for(S * 32, 256), 256, 0, stream>>>(static_cast<const T*>(dout),
                                                                        static_cast<const T*>(y), slot_row, S, D, k, R,
                                                                        vec8_ok(D, {dout, y}), dweights, bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_weight_grad_kernel");
}

namespace {

// moe_plan (backend.h) in one CTA of kPlanThreads: the per-expert counts (shared-memory atomics:
// integer adds, any order gives the same counts), their exclusive scan (offsets), then the slots
// placed in chunks of kPlanThreads, one thread per slot: within a chunk the warps go one after
// another (a barrier between), each warp ranking its lanes of one expert with __match_any_sync
// and its leader advancing that expert's next row — so the rows of an expert are its slots in slot
// order, the host sort's (moe_sort_slots). Then each expert's tiles. A decode step's 256 tokens x 8
// experts take two chunks. An expert id outside [0, E) raises the flag and is left out.
constexpr int kPlanThreads = 1024;
__global__ void __launch_bounds__(kPlanThreads) moe_plan_kernel(const int32_t* __restrict__ ex, int64_t R, int E,
                                                                int bm, int32_t* __restrict__ offsets,
                                                                int32_t* __restrict__ row_slot,
                                                                int32_t* __restrict__ slot_row, int4* __restrict__ tiles,
                                                                int max_tiles, int32_t* __restrict__ tile_count,
                                                                int* bad_flag) {
  __shared__ int next[kPlanThreads];   // per expert: its count, then its next row
  __shared__ int tbase[kPlanThreads];  // per expert: its first tile
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int e = tid; e < E; e += kPlanThreads) next[e] = 0;
  __syncthreads();
  for (int64_t s = tid; s < R; s += kPlanThreads) {
    const int e = ex[s];
    if (e >= 0 && e < E) atomicAdd(&next[e], 1);
    else *bad_flag = 1;
  }
  __syncthreads();
  if (tid == 0) {  // the scans (E <= 1024: serial is a few microseconds)
    int row = 0, tile = 0;
    for (int e = 0; e < E; ++e) {
      const int n = next[e];
      offsets[e] = row;
      next[e] = row;
      tbase[e] = tile;
      row += n;
      tile += (n + bm - 1) / bm;
    }
    offsets[E] = row;
    *tile_count = tile;
  }
  __syncthreads();
  for (int e = tid; e < E; e += kPlanThreads) {  // the tiles (the rows from the scan, before placement moves next)
    const int r0 = next[e], r1 = e + 1 < E ? next[e + 1] : offsets[E];
    int t = tbase[e];
    for (int r = r0; r < r1; r += bm) tiles[t++] = make_int4(e, r, r1, 0);
  }
  for (int t = *tile_count + tid; t < max_tiles; t += kPlanThreads) tiles[t] = make_int4(0, 0, 0, 0);  // empty tiles
  __syncthreads();
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t c0 = 0; c0 < R; c0 += kPlanThreads) {
    const int64_t s = c0 + tid;
    int e = s < R ? ex[s] : -1;
    if (e >= E) e = -1;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      if (warp == w) {
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0) {
          const int r = next[e] + __popc(peers & lt);
          row_slot[r] = static_cast<int32_t>(s);
          slot_row[s] = r;
        }
        __syncwarp();
        if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
      }
      __syncthreads();
    }
  }
}

}  // namespace

void launch_transpose_row_blocks_bf16(const void* src, int64_t cols, const int2* blocks, int64_t nblocks, int64_t ld,
                                      void* dst, cudaStream_t stream) {
  FP8RL_CHECK(cols % 8 == 0 && ld % 64 == 0 && nblocks < (int64_t{1} << 31) && ceil_div(cols, int64_t{64}) < 65536,
              "transpose_row_blocks_bf16: needs cols a multiple of 8 and ld of 64, got ", cols, " and ", ld);
  FP8RL_CHECK(reinterpret_cast<uintptr_t>(src) % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0 &&
                  nblocks * 64 <= ld,
              "transpose_row_blocks_bf16: src and dst must be 8-byte aligned and ld at least 64 x blocks");
  if (nblocks == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>(nblocks), static_cast<unsigned>(ceil_div(cols, int64_t{64})));
  transpose_row_blocks_bf16_kernel<<<grid, 256, 0, stream>>>(static_cast<const uint16_t*>(src), cols, blocks, ld,
                                                             static_cast<uint16_t*>(dst));
  CUDA_CHECK_LAUNCH("transpose_row_blocks_bf16_kernel");
}

void launch_moe_plan(const int32_t* experts, int64_t R, int E, int block_m, int32_t* offsets, int32_t* row_slot,
                     int32_t* slot_row, int32_t* tiles, int64_t max_tiles, int32_t* tile_count, int* bad_flag,
                     cudaStream_t stream) {
  moe_plan_kernel<<<1, kPlanThreads, 0, stream>>>(experts, R, E, block_m, offsets, row_slot, slot_row,
                                                  reinterpret_cast<int4*>(tiles), static_cast<int>(max_tiles),
                                                  tile_count, bad_flag);
  CUDA_CHECK_LAUNCH("moe_plan_kernel");
}

}  // namespace fp8rl::cuda
