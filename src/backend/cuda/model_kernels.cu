// Model ops: embedding (+ backward), RMSNorm (+ backward), RoPE, SwiGLU (+ backward), AdamW.
// Simple kernels (one block or one thread per row / element); FP32 math.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/quant.cuh"
#include "quant/quant.h"

namespace fp8rl::cuda {

namespace {

template <class TT, class TO>
__global__ void embedding_kernel(const int32_t* ids, const TT* table, int64_t V, int64_t D, TO* out, int* bad) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  if (id < 0 || id >= V) {
    if (threadIdx.x == 0) atomicExch(bad, 1);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) store_f(out, t * D + d, 0.0f);
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) store_f(out, t * D + d, load_f(table, id * D + d));
}


// One block per row. The rounding of the CPU reference (cpu_layers.cpp) and of HF's float32
// forward, step by step: var = mean(x^2) rounded once to float (the squares summed in double, so
// that the block's summation order does not show), r = 1 / sqrt(var + eps) in float, y = (x * r)
// * w with both products rounded to float. With F32 activations the output is the CPU's bit for
// bit: it feeds the FP8 quantizers, where one ulp flips codes at E4M3 midpoints (design.md).
template <class TX, class TW, class TO>
__global__ void rmsnorm_kernel(const TX* x, const TW* w, int64_t D, float eps, TO* out, float* rstd) {
  __shared__ double red[32];
  const int64_t r = blockIdx.x;
  double ss = 0.0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const double v = load_f(x, r * D + d);
    ss += v * v;
  }
  ss = block_sum_d(ss, red);  // in double (blockDim.x a multiple of 32)
  const float var = static_cast<float>(ss / static_cast<double>(D));
  const float rs = 1.0f / sqrtf(var + eps);
  if (rstd && threadIdx.x == 0) rstd[r] = rs;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) store_f(out, r * D + d, load_f(x, r * D + d) * rs * load_f(w, d));
}

// The same with 8 elements per access (D % 8 == 0, 16-byte aligned rows): the row is read twice,
// the second time from cache; the same roundings as above (the double sum hides the order).
template <class TX, class TW, class TO>
__global__ void rmsnorm_vec_kernel(const TX* x, const TW* w, int64_t D, float eps, TO* out, float* rstd) {
  __shared__ double red[32];
  const int64_t r = blockIdx.x;
  const TX* xr = x + r * D;
  double ss = 0.0;
  for (int64_t d = threadIdx.x * 8; d < D; d += blockDim.x * 8) {
    float v[8];
    load8(xr + d, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += static_cast<double>(v[i]) * v[i];
  }
  ss = block_sum_d(ss, red);
  const float var = static_cast<float>(ss / static_cast<double>(D));
  const float rs = 1.0f / sqrtf(var + eps);
  if (rstd && threadIdx.x == 0) rstd[r] = rs;
  for (int64_t d = threadIdx.x * 8; d < D; d += blockDim.x * 8) {
    float v[8], wv[8];
    load8(xr + d, v);
    load8(w + d, wv);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * rs * wv[i];
    store8(out + r * D + d, v);
  }
}

// Rows of D <= 256 (q/k-norm over head_dim): one warp per row, kRmsRowsPerBlock rows per block,
// no block barrier. For such D the vec kernel runs one warp too (rmsnorm_row_threads), whose
// block_sum_d is this warp_sum_d plus exact zeros, so the results are the same bits.
constexpr int kRmsRowsPerBlock = 8;
// 1 / sqrt(mean of squares + eps) of a row held by one warp, from each lane's FP64 partial sum of
// squares (rmsnorm_warp_kernel and rmsnorm_rope_kernel: one definition, so the same bits).
__device__ __forceinline__ float rms_inverse_from_sum(double ss, int64_t D, float eps) {
  const float var = static_cast<float>(ss / static_cast<double>(D));
  return 1.0f / sqrtf(var + eps);
}
__device__ __forceinline__ float warp_rms_inverse(double partial, int64_t D, float eps) {
  return rms_inverse_from_sum(warp_sum_d(partial), D, eps);
}
template <class TX, class TW, class TO>
__global__ void rmsnorm_warp_kernel(const TX* x, const TW* w, int64_t R, int64_t D, float eps, TO* out, float* rstd) {
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRmsRowsPerBlock + threadIdx.y;
  if (r >= R) return;
  const TX* xr = x + r * D;
  double ss = 0.0;
  for (int64_t d = lane * 8; d < D; d += 32 * 8) {
    float v[8];
    load8(xr + d, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += static_cast<double>(v[i]) * v[i];
  }
  const float rs = warp_rms_inverse(ss, D, eps);
  if (rstd && lane == 0) rstd[r] = rs;
  for (int64_t d = lane * 8; d < D; d += 32 * 8) {
    float v[8], wv[8];
    load8(xr + d, v);
    load8(w + d, wv);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * rs * wv[i];
    store8(out + r * D + d, v);
  }
}

// One chunk of 8 of a row of the RMSNorm backward: its dout, weight and input values, their share
// of sum(g w x), and dx = rs g w - x c (c = rs^3 sum / D): one copy for the kernels below.
template <class TG, class TX, class TW>
__device__ __forceinline__ float rms_bwd_load8(const TG* g, const TX* x, const TW* w, int64_t row, int64_t d,
                                               float dot, float gv[8], float wv[8], float xv[8]) {
  load8(g + row + d, gv);
  load8(w + d, wv);
  load8(x + row + d, xv);
#pragma unroll
  for (int i = 0; i < 8; ++i) dot += gv[i] * wv[i] * xv[i];
  return dot;
}
template <class TO>
__device__ __forceinline__ void rms_bwd_store8(TO* dx, float rs, float c, float gv[8], const float wv[8],
                                               const float xv[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) gv[i] = rs * gv[i] * wv[i] - xv[i] * c;
  store8(dx, gv);
}

// NCH > 0: D <= 8 NCH blockDim.x, and a thread's (at most NCH) chunks of g, w, x stay in
// registers between the two passes instead of being read again; the same arithmetic in the same
// order as NCH = 0, which reads them twice (any D).
template <class TG, class TX, class TW, class TO, int NCH>
__global__ void rmsnorm_backward_vec_kernel(const TG* g, const TX* x, const TW* w, const float* rstd, int64_t D,
                                            TO* dx) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  float dot = 0.0f;
  if constexpr (NCH > 0) {
    float gv[NCH][8], wv[NCH][8], xv[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int64_t d = threadIdx.x * 8 + static_cast<int64_t>(k) * blockDim.x * 8;
      if (d < D) dot = rms_bwd_load8(g, x, w, r * D, d, dot, gv[k], wv[k], xv[k]);
    }
    dot = block_sum(dot, red);
    const float c = rs * rs * rs * dot / static_cast<float>(D);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int64_t d = threadIdx.x * 8 + static_cast<int64_t>(k) * blockDim.x * 8;
      if (d < D) rms_bwd_store8(dx + r * D + d, rs, c, gv[k], wv[k], xv[k]);
    }
  } else {
    float gv[8], wv[8], xv[8];
    for (int64_t d = threadIdx.x * 8; d < D; d += blockDim.x * 8) dot = rms_bwd_load8(g, x, w, r * D, d, dot, gv, wv, xv);
    dot = block_sum(dot, red);
    const float c = rs * rs * rs * dot / static_cast<float>(D);
    for (int64_t d = threadIdx.x * 8; d < D; d += blockDim.x * 8) {
      rms_bwd_load8(g, x, w, r * D, d, 0.0f, gv, wv, xv);  // read again (its partial sum unused)
      rms_bwd_store8(dx + r * D + d, rs, c, gv, wv, xv);
    }
  }
}

// The backward for rows of D <= 256, one warp per row (see rmsnorm_warp_kernel). "+ 0.0f"
// reproduces block_sum's second stage, which adds exact zeros (and so turns a -0 sum into +0).
template <class TG, class TX, class TW, class TO>
__global__ void rmsnorm_backward_warp_kernel(const TG* g, const TX* x, const TW* w, const float* rstd, int64_t R,
                                             int64_t D, TO* dx) {
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRmsRowsPerBlock + threadIdx.y;
  if (r >= R) return;
  const float rs = rstd[r];
  float dot = 0.0f;
  float gv[8], wv[8], xv[8];
  for (int64_t d = lane * 8; d < D; d += 32 * 8) dot = rms_bwd_load8(g, x, w, r * D, d, dot, gv, wv, xv);
  dot = warp_sum(dot) + 0.0f;
  const float c = rs * rs * rs * dot / static_cast<float>(D);
  for (int64_t d = lane * 8; d < D; d += 32 * 8) {
    rms_bwd_load8(g, x, w, r * D, d, 0.0f, gv, wv, xv);
    rms_bwd_store8(dx + r * D + d, rs, c, gv, wv, xv);
  }
}

// The fused backward: dx (the arithmetic of the kernels above) and the weight gradient's partial
// sums in one pass over g and x. CTA b takes the rows [b rows, (b + 1) rows) in row order and
// keeps each column's sum of g x rstd in registers, written to part[b] (launch_sum_column_partials
// then adds the CTAs' rows in a fixed order: the same bits every run).
// D <= 8 NCH blockDim.x, one block_sum per row, as rmsnorm_backward_vec_kernel<NCH>. Each row's g
// and x are loaded while the row before is reduced (their loads in flight across its barriers).
template <class TG, class TX, class TW, class TO, int NCH>
__global__ void rmsnorm_backward_dw_vec_kernel(const TG* g, const TX* x, const TW* w, const float* rstd, int64_t R,
                                               int64_t D, int64_t rows, TO* dx, float* part) {
  __shared__ float red[32];
  float acc[NCH][8], wv[NCH][8], gn[NCH][8], xn[NCH][8];
  int64_t dk[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    dk[k] = threadIdx.x * 8 + static_cast<int64_t>(k) * blockDim.x * 8;
    if (dk[k] < D) load8(w + dk[k], wv[k]);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[k][i] = 0.0f;
  }
  auto load_row = [&](int64_t r) {
#pragma unroll
    for (int k = 0; k < NCH; ++k)
      if (dk[k] < D) load8(g + r * D + dk[k], gn[k]), load8(x + r * D + dk[k], xn[k]);
  };
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows, r1 = r0 + rows < R ? r0 + rows : R;
  if (r0 < r1) load_row(r0);
  for (int64_t r = r0; r < r1; ++r) {
    float gv[NCH][8], xv[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; ++k)
#pragma unroll
      for (int i = 0; i < 8; ++i) gv[k][i] = gn[k][i], xv[k][i] = xn[k][i];
    if (r + 1 < r1) load_row(r + 1);
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < NCH; ++k)
      if (dk[k] < D) {
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += gv[k][i] * wv[k][i] * xv[k][i];
      }
    dot = block_sum(dot, red);
    const float c = rs * rs * rs * dot / static_cast<float>(D);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      if (dk[k] >= D) continue;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[k][i] += gv[k][i] * xv[k][i] * rs;
      rms_bwd_store8(dx + r * D + dk[k], rs, c, gv[k], wv[k], xv[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < NCH; ++k)
    if (dk[k] < D) store8(part + static_cast<int64_t>(blockIdx.x) * D + dk[k], acc[k]);
}
// D <= 256: warp y of the CTA takes rows r0 + y, r0 + y + 8, ... (a warp per row, as
// rmsnorm_backward_warp_kernel, the next row's loads issued before this one's reduction); the 8
// warps' column sums are added in warp order at the end.
template <class TG, class TX, class TW, class TO>
__global__ void rmsnorm_backward_dw_warp_kernel(const TG* g, const TX* x, const TW* w, const float* rstd, int64_t R,
                                                int64_t D, int64_t rows, TO* dx, float* part) {
  __shared__ float sacc[kRmsRowsPerBlock][256];
  const int lane = static_cast<int>(threadIdx.x), wy = static_cast<int>(threadIdx.y);
  const int64_t d = lane * 8;
  const bool on = d < D;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, wv[8], gn[8], xn[8];
  if (on) load8(w + d, wv);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows, r1 = r0 + rows < R ? r0 + rows : R;
  if (on && r0 + wy < r1) load8(g + (r0 + wy) * D + d, gn), load8(x + (r0 + wy) * D + d, xn);
  for (int64_t r = r0 + wy; r < r1; r += kRmsRowsPerBlock) {  // uniform per warp
    float gv[8], xv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) gv[i] = gn[i], xv[i] = xn[i];
    if (on && r + kRmsRowsPerBlock < r1)
      load8(g + (r + kRmsRowsPerBlock) * D + d, gn), load8(x + (r + kRmsRowsPerBlock) * D + d, xn);
    const float rs = rstd[r];
    float dot = 0.0f;
    if (on) {
#pragma unroll
      for (int i = 0; i < 8; ++i) dot += gv[i] * wv[i] * xv[i];
    }
    dot = warp_sum(dot) + 0.0f;
    const float c = rs * rs * rs * dot / static_cast<float>(D);
    if (on) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += gv[i] * xv[i] * rs;
      rms_bwd_store8(dx + r * D + d, rs, c, gv, wv, xv);
    }
  }
  if (on) {
#pragma unroll
    for (int i = 0; i < 8; ++i) sacc[wy][d + i] = acc[i];
  }
  __syncthreads();
  for (int64_t col = wy * 32 + lane; col < D; col += 32 * kRmsRowsPerBlock) {
    float sum = 0.0f;
#pragma unroll
    for (int y = 0; y < kRmsRowsPerBlock; ++y) sum += sacc[y][col];
    part[static_cast<int64_t>(blockIdx.x) * D + col] = sum;
  }
}
// The fused backward's CTAs (partial rows) for R rows, and the rows each takes.
constexpr int64_t kRmsBwdCtas = 528;  // four per SM on 132 SMs
int64_t rms_bwd_rows_per_cta(int64_t R) { return ceil_div(R, kRmsBwdCtas); }

// dx = rs * (w * g) - x * rs^3 / D * sum(w * g * x).
template <class TG, class TX, class TW, class TO>
__global__ void rmsnorm_backward_kernel(const TG* g, const TX* x, const TW* w, const float* rstd, int64_t D, TO* dx) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  float dot = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    dot += load_f(g, r * D + d) * load_f(w, d) * load_f(x, r * D + d);
  dot = block_sum(dot, red);
  const float c = rs * rs * rs * dot / static_cast<float>(D);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    store_f(dx, r * D + d, rs * load_f(g, r * D + d) * load_f(w, d) - load_f(x, r * D + d) * c);
}

// dw[d] += sum_r g[r, d] * x[r, d] * rstd[r]; block (32 x 8) per 32 columns x row chunk
// blockIdx.y, whose per-column sum goes to out[blockIdx.y][d] (launch_add_column_partials adds
// the chunks in order: no atomics, the same bits every run).
template <class TG, class TX>
__global__ void rmsnorm_dw_kernel(const TG* g, const TX* x, const float* rstd, int64_t R, int64_t D, float* out) {
  __shared__ float part[8][33];
  const int64_t d = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.0f;
  if (d < D)
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < R; r += 8LL * gridDim.y)
      acc += load_f(g, r * D + d) * load_f(x, r * D + d) * rstd[r];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) s += part[j][threadIdx.x];
    out[blockIdx.y * D + d] = s;
  }
}

// One block per token (grid-stride): thread (j, hc) computes the token's angle j once and rotates
// the pair (j, j + half) of heads hc, hc + HC, ... (at most kRopeHeadsPerThread): the heads share
// the angle, so cosf/sinf run once per (token, j, hc) instead of per element, the loads of a
// thread's heads are issued before its stores, and no index needs a 64-bit division. The
// arithmetic of each element is that of one thread per pair.
constexpr int kRopeHeadsPerThread = 8;
// The angle's cos and sin of pair j at position p (scaled by attention_scaling; negated sin for
// the inverse) and the rotation of a pair: one copy for rope_kernel and rmsnorm_rope_kernel. The
// rotation spells its roundings out (one product rounded, then one FMA): the compiler contracts
// a * b + c * d per kernel as it likes, which would let the two kernels differ in the last bit.
__device__ __forceinline__ void rope_cos_sin(int32_t p, float inv_freq, float att, bool inverse, float& c, float& s) {
  const float angle = static_cast<float>(p) * inv_freq;
  c = cosf(angle) * att;
  s = sinf(angle) * att;
  if (inverse) s = -s;
}
__device__ __forceinline__ float rope_first(float x1, float x2, float c, float s) {
  return __fmaf_rn(x1, c, -__fmul_rn(x2, s));
}
__device__ __forceinline__ float rope_second(float x1, float x2, float c, float s) {
  return __fmaf_rn(x1, s, __fmul_rn(x2, c));
}
template <class T>
__global__ void rope_kernel(T* x, int64_t T_, int H, int hd, const int32_t* pos, RopeTable tab, float att,
                            bool inverse, bool interleaved) {
  const int half = hd / 2, j = static_cast<int>(threadIdx.x), hc = static_cast<int>(threadIdx.y);
  // Pair j: dims (j, j + half) (rotate_half), or (2j, 2j + 1) (DeepSeek's rope_interleave).
  const int i1 = interleaved ? 2 * j : j, i2 = interleaved ? 2 * j + 1 : j + half;
  const int HC = static_cast<int>(blockDim.y);
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    float c, s;
    rope_cos_sin(pos[t], tab.inv_freq[j], att, inverse, c, s);
    float x1[kRopeHeadsPerThread], x2[kRopeHeadsPerThread];
#pragma unroll
    for (int k = 0; k < kRopeHeadsPerThread; ++k) {
      const int h = hc + k * HC;
      if (h < H) {
        const int64_t base = (t * H + h) * hd;
        x1[k] = load_f(x, base + i1);
        x2[k] = load_f(x, base + i2);
      }
    }
#pragma unroll
    for (int k = 0; k < kRopeHeadsPerThread; ++k) {
      const int h = hc + k * HC;
      if (h < H) {
        const int64_t base = (t * H + h) * hd;
        store_f(x, base + i1, rope_first(x1[k], x2[k], c, s));
        store_f(x, base + i2, rope_second(x1[k], x2[k], c, s));
      }
    }
  }
}

// Qwen3's q/k-norm and RoPE in one pass: rmsnorm_warp_kernel's rows r = (t, h) of hd <= 256
// dims, the normalized values rounded to T as the two-op path stores them, then rotated in
// registers with rope_kernel's arithmetic. The same bits as rmsnorm then rope, without the round
// trip of q and k through memory.
// A row takes L = kRopeRowLanes(hd) lanes of a warp (lane l of its group holds dims [8l, 8l + 8);
// 32 / L rows per warp, so no lane idles at hd = 128); its sum of squares is the butterfly over
// the group, which is rmsnorm_warp_kernel's full-warp butterfly without its first levels (those
// add the idle lanes' exact zeros), so the same double. The rotate_half partner of a lane's dims
// is lane +- hd / 16 of the same group (a shuffle); interleaved pairs are within a lane. The
// angles' cos and sin depend on the token and the pair only: the block computes them once per
// token it covers into shared memory (rope_cos_sin, so the values rope_kernel uses), instead of
// once per element (the kernel was bound by cosf / sinf: 82% SM, 6% DRAM on the H200).
constexpr int kRopeRowsWarps = 8;  // warps per block
__host__ __device__ constexpr int rope_row_lanes(int hd) { return hd <= 16 ? 2 : hd <= 32 ? 4 : hd <= 64 ? 8 : hd <= 128 ? 16 : 32; }
// Tokens a block of rows_per_block consecutive (token, head) rows can touch.
__host__ __device__ constexpr int rope_block_tokens(int rows_per_block, int H) {
  return (rows_per_block - 1) / H + 2 < rows_per_block ? (rows_per_block - 1) / H + 2 : rows_per_block;
}
// The rows of one launch: R = T * H rows of hd (row r = (t, h) at x + r * hd, i.e. [T, H, hd]).
// Heads h < hq are normed with wq and rotated into out_q [T, hq, hd] (rstd_q [T * hq]), the next
// hk with wk into out_k [T, hk, hd] (rstd_k), the remaining H - hq - hk copied unchanged into out_v
// [T, H - hq - hk, hd]. rmsnorm_rope is hq = H, hk = 0; the decode step's q|k|v product is one
// launch over its concatenated [T, Hq + 2 Hkv, hd] rows (qkv_norm_rope). kv.slots (qkv_norm_rope
// with a KV destination): the k and v rows are also written into the paged cache as
// kv_write8_kernel writes them — the values as stored in out_k / out_v, E4M3 codes of each over
// its head's scale (kv.e4m3) or those values (a pool of T).
template <class T, class TW>
struct NormRopeRows {
  const T* x;
  int H, hq, hk;
  const TW *wq, *wk;
  T *out_q, *out_k, *out_v;
  float *rstd_q, *rstd_k;
  QkvCacheWrite kv;
};
template <class T, class TW>
__global__ void __launch_bounds__(kRopeRowsWarps * 32)
    rmsnorm_rope_kernel(NormRopeRows<T, TW> a, int64_t R, int hd, float eps, const int32_t* pos, RopeTable tab,
                        float att, bool interleaved) {
  extern __shared__ float rope_cs[];  // [tokens][half] cos, then [tokens][half] sin
  const int H = a.H;
  const int L = rope_row_lanes(hd), rows_per_warp = 32 / L, rows_per_block = kRopeRowsWarps * rows_per_warp;
  const int half = hd / 2, ntok = rope_block_tokens(rows_per_block, H);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block, t0 = r0 / H;
  const int64_t T_ = R / H;
  float* cs_c = rope_cs;
  float* cs_s = rope_cs + ntok * half;
  const int tid = threadIdx.y * 32 + threadIdx.x;
  for (int i = tid; i < ntok * half; i += kRopeRowsWarps * 32) {
    const int tl = i / half, j = i % half;
    if (t0 + tl < T_) rope_cos_sin(pos[t0 + tl], tab.inv_freq[j], att, false, cs_c[i], cs_s[i]);
  }
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x), sub = lane % L, group = lane - sub;
  const int64_t r = r0 + static_cast<int64_t>(threadIdx.y) * rows_per_warp + lane / L;
  const int d0 = sub * 8;
  const bool in = d0 < hd && r < R;  // every lane stays for the shuffles below
  // The row's token and head, and where it goes: 0 = q, 1 = k (normed and rotated), 2 = copied.
  const int64_t t = r / H;
  const int h = static_cast<int>(r - t * H);
  const int seg = h < a.hq ? 0 : h < a.hq + a.hk ? 1 : 2;
  float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  double ss = 0.0;
  if (in) {
    load8(a.x + r * hd + d0, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += static_cast<double>(v[i]) * v[i];
  }
  for (int o = L / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  // The cache row of head hh of token t (kv_write8_kernel's destination and encoding).
  auto cache_write = [&](void* pool, const float* scale, int hh, const float (&x)[8]) {
    const int64_t dst = (static_cast<int64_t>(a.kv.slots[t]) * a.hk + hh) * hd + d0;
    if (a.kv.e4m3) *reinterpret_cast<uint2*>(static_cast<uint8_t*>(pool) + dst) = encode8(x, Fp8Divisor(scale[hh]));
    else store8(static_cast<T*>(pool) + dst, x);
  };
  // v (seg 2): the product's values as they are. Its lanes stay for the shuffles (values unused).
  if (seg == 2 && in) {
    store8(a.out_v + (t * (H - a.hq - a.hk) + h - a.hq - a.hk) * hd + d0, v);
    if (a.kv.slots) cache_write(a.kv.vpool, a.kv.v_scale, h - a.hq - a.hk, v);
  }
  const int64_t orow = seg == 0 ? t * a.hq + h : t * a.hk + h - a.hq;
  T* out = seg == 0 ? a.out_q : a.out_k;
  const TW* w = seg == 0 ? a.wq : a.wk;
  float* rstd = seg == 0 ? a.rstd_q : a.rstd_k;
  const float rs = rms_inverse_from_sum(ss, hd, eps);
  if (rstd && in && seg != 2 && sub == 0) rstd[orow] = rs;
  if (in && seg != 2) {
    float wv[8];
    load8(w + d0, wv);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * rs * wv[i];
    round8_as(out, v);  // as the two-op path stores the normalized values
  }
  const bool first = d0 < half;  // rotate_half: this lane holds x1 of its pairs, else x2
  const int partner = group + (!in || interleaved ? sub : first ? sub + half / 8 : sub - half / 8);
  float p[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = __shfl_sync(0xffffffffu, v[i], partner);
  if (seg == 2) return;
  if (!in) return;
  const int tl = static_cast<int>(t - t0);
  const float* c_row = cs_c + tl * half;
  const float* s_row = cs_s + tl * half;
  float y[8];
  if (interleaved) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int j = (d0 + i) / 2;
      y[i] = rope_first(v[i], v[i + 1], c_row[j], s_row[j]);
      y[i + 1] = rope_second(v[i], v[i + 1], c_row[j], s_row[j]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int j = first ? d0 + i : d0 + i - half;
      y[i] = first ? rope_first(v[i], p[i], c_row[j], s_row[j]) : rope_second(p[i], v[i], c_row[j], s_row[j]);
    }
  }
  if (seg == 1 && a.kv.slots) {  // y as stored, then into the cache
    store8_rounded(out + orow * hd + d0, y);
    cache_write(a.kv.kpool, a.kv.k_scale, h - a.hq, y);
  } else {
    store8(out + orow * hd + d0, y);
  }
}

template <class T>
__global__ void swiglu_kernel(const T* g, const T* u, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    store_f(out, i, swiglu_value(load_f(g, i), load_f(u, i)));
  }
}

// 8 elements per thread and iteration (n % 8 == 0, aligned): the same per-element math.
template <class T>
__global__ void swiglu_vec_kernel(const T* g, const T* u, T* out, int64_t n8) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float gv[8], uv[8];
    load8(g + 8 * i, gv);
    load8(u + 8 * i, uv);
#pragma unroll
    for (int k = 0; k < 8; ++k) gv[k] = swiglu_value(gv[k], uv[k]);
    store8(out + 8 * i, gv);
  }
}

template <class T>
__global__ void swiglu_backward_vec_kernel(const T* dout, const T* g, const T* u, T* dg, T* du, int64_t n8) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float gv[8], uv[8], d[8], dgv[8], duv[8];
    load8(g + 8 * i, gv);
    load8(u + 8 * i, uv);
    load8(dout + 8 * i, d);
#pragma unroll
    for (int k = 0; k < 8; ++k) swiglu_backward_value(d[k], gv[k], uv[k], dgv[k], duv[k]);
    store8(du + 8 * i, duv);
    store8(dg + 8 * i, dgv);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* dout, const T* g, const T* u, T* dg, T* du, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float dgv, duv;
    swiglu_backward_value(load_f(dout, i), load_f(g, i), load_f(u, i), dgv, duv);
    store_f(du, i, duv);
    store_f(dg, i, dgv);
  }
}

// Threads of a row-per-block vectorized kernel: one 8-element chunk each, 32..256.
int vec_row_threads(int64_t D) { return rmsnorm_row_threads(D); }

}  // namespace

void launch_embedding(const int32_t* ids, int64_t ntok, const void* table, DType tdt, int64_t V, int64_t D, void* out,
                      DType odt, int* bad_flag, cudaStream_t stream) {
  if (ntok == 0) return;
  FP8RL_DISPATCH_FLOAT(tdt, "embedding table", {
    using TT = T;
    FP8RL_DISPATCH_FLOAT(odt, "embedding output", {
      embedding_kernel<TT, T><<<static_cast<unsigned>(ntok), 256, 0, stream>>>(
          ids, static_cast<const TT*>(table), V, D, static_cast<T*>(out), bad_flag);
    });
  });
  CUDA_CHECK_LAUNCH("embedding_kernel");
}

void launch_rmsnorm(const void* x, DType xdt, const void* w, DType wdt, int64_t R, int64_t D, float eps, void* out,
                    DType odt, float* rstd, cudaStream_t stream) {
  if (R == 0) return;
  FP8RL_CHECK(xdt == odt, "rmsnorm: x and out must have the same dtype");
  FP8RL_DISPATCH_FLOAT(wdt, "rmsnorm weight", {
    using TW = T;
    FP8RL_DISPATCH_FLOAT(xdt, "rmsnorm input", {
      if (vec8_ok(D, {x, w, out}) && D <= 256) {
        const dim3 block(32, kRmsRowsPerBlock);
        rmsnorm_warp_kernel<T, TW, T><<<static_cast<unsigned>(ceil_div(R, kRmsRowsPerBlock)), block, 0, stream>>>(
            static_cast<const T*>(x), static_cast<const TW*>(w), R, D, eps, static_cast<T*>(out), rstd);
      } else if (vec8_ok(D, {x, w, out})) {
        rmsnorm_vec_kernel<T, TW, T><<<static_cast<unsigned>(R), vec_row_threads(D), 0, stream>>>(
            static_cast<const T*>(x), static_cast<const TW*>(w), D, eps, static_cast<T*>(out), rstd);
      } else {
        rmsnorm_kernel<T, TW, T><<<static_cast<unsigned>(R), 256, 0, stream>>>(
            static_cast<const T*>(x), static_cast<const TW*>(w), D, eps, static_cast<T*>(out), rstd);
      }
    });
  });
  CUDA_CHECK_LAUNCH("rmsnorm_kernel");
}

int64_t rmsnorm_backward_partial_rows(int64_t R) {
  return std::max(column_sum_chunks(R), R > 0 ? ceil_div(R, rms_bwd_rows_per_cta(R)) : int64_t{1});
}

void launch_rmsnorm_backward(const void* dout, DType gdt, const void* x, DType xdt, const void* w, DType wdt,
                             const float* rstd, int64_t R, int64_t D, void* dx, DType dxdt, float* dw, float* dw_part,
                             cudaStream_t stream) {
  if (R == 0) return;
  FP8RL_CHECK(gdt == xdt && xdt == dxdt, "rmsnorm_backward: dout, x and dx must have the same dtype");
  FP8RL_DISPATCH_FLOAT(wdt, "rmsnorm weight", {
    using TW = T;
    FP8RL_DISPATCH_FLOAT(xdt, "rmsnorm input", {
      const bool vec = vec8_ok(D, {dout, x, w, dx});
      const int threads = vec_row_threads(D);
      const int64_t nch = ceil_div(D, 8 * static_cast<int64_t>(threads));  // chunks per thread
      if (vec && (D <= 256 || nch <= 2)) {  // the fused pass: dx and the dw partials
        const int64_t rows = rms_bwd_rows_per_cta(R), ctas = ceil_div(R, rows);
        if (D <= 256) {
          rmsnorm_backward_dw_warp_kernel<T, T, TW, T>
              <<<static_cast<unsigned>(ctas), dim3(32, kRmsRowsPerBlock), 0, stream>>>(
                  static_cast<const T*>(dout), static_cast<const T*>(x), static_cast<const TW*>(w), rstd, R, D, rows,
                  static_cast<T*>(dx), dw_part);
        } else {
          const auto kernel = nch == 1 ? rmsnorm_backward_dw_vec_kernel<T, T, TW, T, 1>
                                       : rmsnorm_backward_dw_vec_kernel<T, T, TW, T, 2>;
          kernel<<<static_cast<unsigned>(ctas), threads, 0, stream>>>(
              static_cast<const T*>(dout), static_cast<const T*>(x), static_cast<const TW*>(w), rstd, R, D, rows,
              static_cast<T*>(dx), dw_part);
        }
        CUDA_CHECK_LAUNCH("rmsnorm_backward_dw_kernel");
        launch_sum_column_partials(dw_part, ctas, D, dw, stream);
        return;
      }
      if (vec && D <= 256) {
        const dim3 block(32, kRmsRowsPerBlock);
        rmsnorm_backward_warp_kernel<T, T, TW, T>
            <<<static_cast<unsigned>(ceil_div(R, kRmsRowsPerBlock)), block, 0, stream>>>(
                static_cast<const T*>(dout), static_cast<const T*>(x), static_cast<const TW*>(w), rstd, R, D,
                static_cast<T*>(dx));
      } else if (vec) {
        const auto kernel = nch == 1   ? rmsnorm_backward_vec_kernel<T, T, TW, T, 1>
                            : nch == 2 ? rmsnorm_backward_vec_kernel<T, T, TW, T, 2>
                                       : rmsnorm_backward_vec_kernel<T, T, TW, T, 0>;
        kernel<<<static_cast<unsigned>(R), threads, 0, stream>>>(static_cast<const T*>(dout), static_cast<const T*>(x),
                                                                 static_cast<const TW*>(w), rstd, D,
                                                                 static_cast<T*>(dx));
      } else {
        rmsnorm_backward_kernel<T, T, TW, T><<<static_cast<unsigned>(R), 256, 0, stream>>>(
            static_cast<const T*>(dout), static_cast<const T*>(x), static_cast<const TW*>(w), rstd, D,
            static_cast<T*>(dx));
      }
      CUDA_CHECK_LAUNCH("rmsnorm_backward_kernel");
      const int64_t chunks = column_sum_chunks(R);
      dim3 grid(static_cast<unsigned>(ceil_div(D, 32)), static_cast<unsigned>(chunks));
      rmsnorm_dw_kernel<T, T><<<grid, dim3(32, 8), 0, stream>>>(static_cast<const T*>(dout),
                                                                static_cast<const T*>(x), rstd, R, D, dw_part);
      CUDA_CHECK_LAUNCH("rmsnorm_dw_kernel");
      launch_add_column_partials(dw_part, chunks, D, dw, stream);
    });
  });
}

void launch_rope(void* x, DType dt, int64_t T_, int64_t H, int64_t hd, const int32_t* pos, const RopeTable& tab,
                 float attention_scaling, bool inverse, bool interleaved, cudaStream_t stream) {
  const int64_t n = T_ * H * (hd / 2);
  if (n == 0) return;
  const int half = static_cast<int>(hd / 2);
  FP8RL_CHECK(half >= 1 && half <= kMaxRopeHalf, "rope: head_dim ", hd, " out of range");
  const int heads = static_cast<int>(H);
  // Head groups per block: enough threads (~256) per token, at most kRopeHeadsPerThread heads each.
  int hc = std::max(1, std::min(heads, 256 / half));
  hc = std::max(hc, static_cast<int>(ceil_div(heads, kRopeHeadsPerThread)));
  FP8RL_CHECK(static_cast<int64_t>(half) * hc <= 1024, "rope: ", H, " heads of head_dim ", hd,
              " exceed one block's threads");
  const dim3 block(static_cast<unsigned>(half), static_cast<unsigned>(hc));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(T_, 65535LL * 16));
  FP8RL_DISPATCH_FLOAT(dt, "rope", {
    rope_kernel<T><<<grid, block, 0, stream>>>(static_cast<T*>(x), T_, heads, static_cast<int>(hd), pos, tab,
                                               attention_scaling, inverse, interleaved);
  });
  CUDA_CHECK_LAUNCH("rope_kernel");
}

// out [R, F] = swiglu over rows of g and u ld elements apart: 8 elements per thread where the rows
// allow (F, ld multiples of 8, 16-byte aligned), else one; swiglu_value, as every swiglu kernel.
template <class T, int V>
__global__ void swiglu_rows_kernel(const T* g, const T* u, int64_t ld, T* out, int64_t R, int64_t F) {
  const int64_t per_row = F / V;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < R * per_row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r, c;
    divmod_index(i, per_row, r, c);
    c *= V;
    if constexpr (V == 8) {
      float gv[8], uv[8];
      load8(g + r * ld + c, gv);
      load8(u + r * ld + c, uv);
#pragma unroll
      for (int k = 0; k < 8; ++k) gv[k] = swiglu_value(gv[k], uv[k]);
      store8(out + r * F + c, gv);
    } else {
      store_f(out, r * F + c, swiglu_value(load_f(g, r * ld + c), load_f(u, r * ld + c)));
    }
  }
}

void launch_swiglu_rows(const void* g, const void* u, int64_t ld, void* out, DType dt, int64_t R, int64_t F,
                        cudaStream_t stream) {
  if (R == 0 || F == 0) return;
  const bool v8 = vec8_ok(F, {g, u, out}) && ld % 8 == 0;
  FP8RL_DISPATCH_FLOAT(dt, "swiglu", {
    if (v8)
      swiglu_rows_kernel<T, 8><<<grid_for(R * F / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(g), static_cast<const T*>(u), ld, static_cast<T*>(out), R, F);
    else
      swiglu_rows_kernel<T, 1><<<grid_for(R * F, 256), 256, 0, stream>>>(
          static_cast<const T*>(g), static_cast<const T*>(u), ld, static_cast<T*>(out), R, F);
  });
  CUDA_CHECK_LAUNCH("swiglu_rows_kernel");
}

namespace {
template <class T, class TW>
void launch_norm_rope_rows(const NormRopeRows<T, TW>& a, int64_t T_, int64_t hd, float eps, const int32_t* pos,
                           const RopeTable& tab, float attention_scaling, bool interleaved, cudaStream_t stream) {
  const int64_t R = T_ * a.H;
  const int rows_per_block = kRopeRowsWarps * (32 / rope_row_lanes(static_cast<int>(hd)));
  const size_t smem = sizeof(float) * 2 * static_cast<size_t>(hd / 2) *
                      static_cast<size_t>(rope_block_tokens(rows_per_block, a.H));
  rmsnorm_rope_kernel<T, TW><<<static_cast<unsigned>(ceil_div(R, rows_per_block)), dim3(32, kRopeRowsWarps), smem,
                               stream>>>(a, R, static_cast<int>(hd), eps, pos, tab, attention_scaling, interleaved);
  CUDA_CHECK_LAUNCH("rmsnorm_rope_kernel");
}
bool norm_rope_fits(int64_t hd) { return hd <= 256 && hd % 16 == 0 && hd / 2 <= kMaxRopeHalf; }
}  // namespace

bool launch_rmsnorm_rope(const void* x, DType dt, const void* w, DType wdt, int64_t T_, int64_t H, int64_t hd,
                         float eps, void* out, float* rstd, const int32_t* pos, const RopeTable& tab,
                         float attention_scaling, bool interleaved, cudaStream_t stream) {
  if (!norm_rope_fits(hd) || !vec8_ok(hd, {x, w, out})) return false;
  if (T_ * H == 0) return true;
  FP8RL_DISPATCH_FLOAT(wdt, "rmsnorm_rope weight", {
    using TW = T;
    FP8RL_DISPATCH_FLOAT(dt, "rmsnorm_rope input", {
      NormRopeRows<T, TW> a{static_cast<const T*>(x), static_cast<int>(H), static_cast<int>(H), 0,
                            static_cast<const TW*>(w), nullptr, static_cast<T*>(out), nullptr, nullptr, rstd,
                            nullptr, QkvCacheWrite{}};
      launch_norm_rope_rows(a, T_, hd, eps, pos, tab, attention_scaling, interleaved, stream);
    });
  });
  return true;
}

bool launch_qkv_norm_rope(const void* qkv, DType dt, const void* wq, const void* wk, DType wdt, int64_t T_,
                          int64_t Hq, int64_t Hkv, int64_t hd, float eps, void* q, void* k, void* v, float* q_rstd,
                          float* k_rstd, const int32_t* pos, const RopeTable& tab, float attention_scaling,
                          bool interleaved, cudaStream_t stream, QkvCacheWrite kv, DType pool_dt) {
  if (!norm_rope_fits(hd) || !vec8_ok(hd, {qkv, wq, wk, q, k, v})) return false;
  kv.e4m3 = pool_dt == DType::E4M3;
  if (kv.slots && ((!kv.e4m3 && pool_dt != dt) || reinterpret_cast<uintptr_t>(kv.kpool) % 16 != 0 ||
                   reinterpret_cast<uintptr_t>(kv.vpool) % 16 != 0))
    return false;
  if (T_ == 0) return true;
  FP8RL_DISPATCH_FLOAT(wdt, "qkv_norm_rope weight", {
    using TW = T;
    FP8RL_DISPATCH_FLOAT(dt, "qkv_norm_rope input", {
      NormRopeRows<T, TW> a{static_cast<const T*>(qkv), static_cast<int>(Hq + 2 * Hkv), static_cast<int>(Hq),
                            static_cast<int>(Hkv), static_cast<const TW*>(wq), static_cast<const TW*>(wk),
                            static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), q_rstd, k_rstd, kv};
      launch_norm_rope_rows(a, T_, hd, eps, pos, tab, attention_scaling, interleaved, stream);
    });
  });
  return true;
}

void launch_swiglu(const void* g, const void* u, void* out, DType dt, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "swiglu", {
    if (vec8_ok(n, {g, u, out})) {
      swiglu_vec_kernel<T><<<grid_for(n / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(out), n / 8);
    } else {
      swiglu_kernel<T><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const T*>(g), static_cast<const T*>(u),
                                                             static_cast<T*>(out), n);
    }
  });
  CUDA_CHECK_LAUNCH("swiglu_kernel");
}

void launch_swiglu_backward(const void* dout, const void* g, const void* u, void* dg, void* du, DType dt, int64_t n,
                            cudaStream_t stream) {
  if (n == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "swiglu_backward", {
    if (vec8_ok(n, {dout, g, u, dg, du})) {
      swiglu_backward_vec_kernel<T><<<grid_for(n / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(dg),
          static_cast<T*>(du), n / 8);
    } else {
      swiglu_backward_kernel<T><<<grid_for(n, 256), 256, 0, stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(dg),
          static_cast<T*>(du), n);
    }
  });
  CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

}  // namespace fp8rl::cuda
