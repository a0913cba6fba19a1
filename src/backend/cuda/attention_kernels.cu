// Attention kernels, first pass: correct and simple, flash-style in that no T x T score matrix
// is ever stored. One warp per (query token, head); each lane holds head_dim / 32 elements of q
// and of the output accumulator; keys are visited one by one with an online softmax.
//   packed causal GQA forward (+ lse) and backward (dq per query; dk/dv per key),
//   KV-cache writes (E4M3 bit-exact with the CPU codec) and paged attention over the cache.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/quant.cuh"
#include "quant/fp8_rule.h"
#include "quant/quant.h"

namespace fp8rl::cuda {

namespace {

constexpr int kWarps = 4;  // warps per block

template <int EPL, class T>
__device__ __forceinline__ void load_vec(const T* p, int hd, int lane, float (&v)[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int d = lane + 32 * i;
    v[i] = d < hd ? load_f(p, d) : 0.0f;
  }
}
template <int EPL, class T>
__device__ __forceinline__ float dot_vec(const T* p, int hd, int lane, const float (&q)[EPL]) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) s += q[i] * load_f(p, d);
  }
  return warp_sum(s);
}

template <int EPL, class T>
__global__ void attention_fwd_kernel(const T* q, const T* k, const T* v, const int32_t* seq_start, int64_t T_, int Hq,
                                     int Hkv, int hd, int hdv, float scale, T* out, float* lse) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= T_ * Hq) return;
  const int64_t t = w / Hq;
  const int h = static_cast<int>(w % Hq), hk = h / (Hq / Hkv);
  float qv[EPL], acc[EPL];
  load_vec<EPL>(q + (t * Hq + h) * hd, hd, lane, qv);
#pragma unroll
  for (int i = 0; i < EPL; ++i) acc[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = seq_start[t]; j <= t; ++j) {
    const float s = dot_vec<EPL>(k + (j * Hkv + hk) * hd, hd, lane, qv) * scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), p = expf(s - mn);
    l = l * corr + p;
    const T* vp = v + (j * Hkv + hk) * hdv;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < hdv ? p * load_f(vp, d) : 0.0f);
    }
    m = mn;
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hdv) store_f(out, (t * Hq + h) * hdv + d, acc[i] / l);
  }
  if (lane == 0) lse[static_cast<int64_t>(h) * T_ + t] = m + logf(l);
}

// delta[t, h] = sum_d dout * out.
template <class T>
__global__ void attention_delta_kernel(const T* dout, const T* out, int64_t rows, int hd, float* delta) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= rows) return;
  float s = 0.0f;
  for (int d = lane; d < hd; d += 32) s += load_f(dout, w * hd + d) * load_f(out, w * hd + d);
  s = warp_sum(s);
  if (lane == 0) delta[w] = s;
}

// dq[t, h] = scale * sum_j p_tj (dp_tj - delta_t) k_j,  p = exp(s - lse), dp = dout_t . v_j.
template <int EPL, class T>
__global__ void attention_dq_kernel(const T* dout, const T* q, const T* k, const T* v, const float* lse,
                                    const float* delta, const int32_t* seq_start, int64_t T_, int Hq, int Hkv, int hd,
                                    int hdv, float scale, T* dq) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= T_ * Hq) return;
  const int64_t t = w / Hq;
  const int h = static_cast<int>(w % Hq), hk = h / (Hq / Hkv);
  float qv[EPL], gv[EPL], acc[EPL];
  load_vec<EPL>(q + (t * Hq + h) * hd, hd, lane, qv);
  load_vec<EPL>(dout + (t * Hq + h) * hdv, hdv, lane, gv);
#pragma unroll
  for (int i = 0; i < EPL; ++i) acc[i] = 0.0f;
  const float L = lse[static_cast<int64_t>(h) * T_ + t], D = delta[t * Hq + h];
  for (int64_t j = seq_start[t]; j <= t; ++j) {
    const T* kp = k + (j * Hkv + hk) * hd;
    const float p = expf(dot_vec<EPL>(kp, hd, lane, qv) * scale - L);
    const float dp = dot_vec<EPL>(v + (j * Hkv + hk) * hdv, hdv, lane, gv);
    const float ds = p * (dp - D) * scale;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) acc[i] += ds * load_f(kp, d);
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) store_f(dq, (t * Hq + h) * hd + d, acc[i]);
  }
}

// dk[j, hk], dv[j, hk]: sums over the heads of the group and the queries t >= j of the sequence.
template <int EPL, class T>
__global__ void attention_dkv_kernel(const T* dout, const T* q, const T* k, const T* v, const float* lse,
                                     const float* delta, const int32_t* seq_end, int64_t T_, int Hq, int Hkv, int hd,
                                     int hdv, float scale, T* dk, T* dv) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= T_ * Hkv) return;
  const int64_t j = w / Hkv;
  const int hk = static_cast<int>(w % Hkv), group = Hq / Hkv;
  float kv[EPL], vv[EPL], ak[EPL], av[EPL];
  load_vec<EPL>(k + (j * Hkv + hk) * hd, hd, lane, kv);
  load_vec<EPL>(v + (j * Hkv + hk) * hdv, hdv, lane, vv);
#pragma unroll
  for (int i = 0; i < EPL; ++i) ak[i] = av[i] = 0.0f;
  const int64_t end = seq_end[j];
  for (int hg = 0; hg < group; ++hg) {
    const int h = hk * group + hg;
    for (int64_t t = j; t < end; ++t) {
      const T* qp = q + (t * Hq + h) * hd;
      const T* gp = dout + (t * Hq + h) * hdv;
      const float p = expf(dot_vec<EPL>(qp, hd, lane, kv) * scale - lse[static_cast<int64_t>(h) * T_ + t]);
      const float dp = dot_vec<EPL>(gp, hdv, lane, vv);
      const float ds = p * (dp - delta[t * Hq + h]) * scale;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hdv) av[i] += p * load_f(gp, d);
        if (d < hd) ak[i] += ds * load_f(qp, d);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) store_f(dk, (j * Hkv + hk) * hd + d, ak[i]);
    if (d < hdv) store_f(dv, (j * Hkv + hk) * hdv + d, av[i]);
  }
}

// ---- KV cache -----------------------------------------------------------------------------
template <class TS, class TP>
__global__ void kv_write_kernel(const TS* k, const TS* v, const int32_t* slots, int64_t T_, int Hkv, int hd, TP* kp,
                                TP* vp, const float* ks, const float* vs) {
  const int64_t n = T_ * Hkv * hd;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / (static_cast<int64_t>(Hkv) * hd), rem = i % (static_cast<int64_t>(Hkv) * hd);
    const int hk = static_cast<int>(rem / hd);
    const int64_t dst = static_cast<int64_t>(slots[t]) * Hkv * hd + rem;
    if constexpr (std::is_same_v<TP, uint8_t>) {
      kp[dst] = fp8_e4m3_encode(load_f(k, i) / ks[hk]);
      if (vp) vp[dst] = fp8_e4m3_encode(load_f(v, i) / vs[hk]);
    } else {
      store_f(kp, dst, load_f(k, i));
      if (vp) store_f(vp, dst, load_f(v, i));
    }
  }
}

// x [n / (H hd), H, hd] in place: e4m3(x / s[h]) * s[h] (kv_write's quantization, pool_load's
// dequantization), rounded to T.
template <class T>
__global__ void kv_round_kernel(T* x, int64_t n, int H, int hd, KvRoundScales s) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float sc = s.v[(i / hd) % H];
    store_f(x, i, fp8_e4m3_round(load_f(x, i) / sc) * sc);
  }
}
// ---- emulated: begin (kv cache)
// kv_write, 8 elements per thread (hd % 8 == 0; k, v and the pools 16-byte aligned: the 8 share a
// token and a head): 16-byte loads; E4M3 codes by encode8 (quant.cuh: fp8_rule.h's Fp8Divisor
// quotients, paired conversions; the codes bitwise kv_write_kernel's), one 8-byte store per
// chunk, or a 16-byte store into a BF16 / F32 pool. The token and head by 32-bit divisions
// (divmod_index). The cache slot index is in chunks of 8: slot * Hkv * hd8 + the chunk's offset.
template <class TS, class TP>
__global__ void kv_write8_kernel(const TS* k, const TS* v, const int32_t* slots, int64_t n8, int Hkv, int hd8, TP* kp,
                                 TP* vp, const float* ks, const float* vs) {
  const int64_t row8 = static_cast<int64_t>(Hkv) * hd8;  // chunks per token
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n8;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t t, rem, hk, col;
    divmod_index(j, row8, t, rem);
    divmod_index(rem, hd8, hk, col);
    const int64_t dst = 8 * (static_cast<int64_t>(slots[t]) * row8 + rem);
    float x[8];
    load8(k + 8 * j, x);
    if constexpr (std::is_same_v<TP, uint8_t>) {
      *reinterpret_cast<uint2*>(kp + dst) = encode8(x, Fp8Divisor(ks[hk]));
    } else {
      store8(kp + dst, x);
    }
    if (vp) {
      load8(v + 8 * j, x);
      if constexpr (std::is_same_v<TP, uint8_t>) {
        *reinterpret_cast<uint2*>(vp + dst) = encode8(x, Fp8Divisor(vs[hk]));
      } else {
        store8(vp + dst, x);
      }
    }
  }
}

// kv_round_kernel, 8 elements per thread (hd % 8 == 0 and x 16-byte aligned: the 8 share a head):
// the quotients by fp8_rule.h's Fp8Divisor (E4M3 codes bitwise the division's), the codes and
// their values in pairs, the head by 32-bit index divisions (divmod_index).
template <class T>
__global__ void kv_round8_kernel(T* x, int64_t n8, int H, int hd8, KvRoundScales s) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n8;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t row, col, tok, h;
    divmod_index(j, hd8, row, col);  // row = token * H + head
    divmod_index(row, H, tok, h);
    const Fp8Divisor d(s.v[h]);
    float v[8], q[8];
    load8(x + 8 * j, v);
    d.quotients<8>(v, q);
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const uint32_t two = __nv_cvt_float2_to_fp8x2(make_float2(q[e], q[e + 1]), __NV_SATFINITE, __NV_E4M3);
      const float2 r = fp8_e4m3x2_to_float2(two);  // e4m3_round of each, exact
      v[e] = r.x * d.scale();
      v[e + 1] = r.y * d.scale();
    }
    store8(x + 8 * j, v);
  }
}
// ---- emulated: end (kv cache)

template <class TP>
__device__ __forceinline__ float pool_load(const TP* p, int64_t i, float s) {
  if constexpr (std::is_same_v<TP, uint8_t>) return fp8_e4m3_decode(p[i]) * s;
  else return load_f(p, i);
}

template <int EPL, class TQ, class TP>
__global__ void attention_paged_kernel(const TQ* q, const int32_t* token_seq, const int32_t* token_pos,
                                       const int32_t* page_table, int max_pages, int64_t T_, int Hq, int Hkv, int hd,
                                       int hdv, int v_row, int page_size, const TP* kpool, const TP* vpool,
                                       const float* ks, const float* vs, float scale, bool fp8_q, TQ* out,
                                       float* lse) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= T_ * Hq) return;
  const int64_t t = w / Hq;
  const int h = static_cast<int>(w % Hq), hk = h / (Hq / Hkv);
  float qv[EPL], acc[EPL];
  load_vec<EPL>(q + (t * Hq + h) * hd, hd, lane, qv);
  if (fp8_q) {  // per (token, head) E4M3 quantization of q, FP32 scale quant_scale_from_amax(amax, false)
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) amax = fmaxf(amax, fabsf(qv[i]));
    amax = warp_max(amax);
    const float s = fp8_scale_from_amax(amax, false);
#pragma unroll
    for (int i = 0; i < EPL; ++i) qv[i] = fp8_e4m3_round(qv[i] / s) * s;
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) acc[i] = 0.0f;
  const float ksc = ks ? ks[hk] : 1.0f, vsc = vs ? vs[hk] : 1.0f;
  const int32_t seq = token_seq[t], pos = token_pos[t];
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j <= pos; ++j) {
    const int64_t page = page_table[static_cast<int64_t>(seq) * max_pages + j / page_size];
    const int64_t row = (page * page_size + j % page_size) * Hkv + hk;
    const int64_t base = row * hd, vbase = row * v_row;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) s += qv[i] * pool_load(kpool, base + d, ksc);
    }
    s = warp_sum(s) * scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), p = expf(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < hdv ? p * pool_load(vpool, vbase + d, vsc) : 0.0f);
    }
    m = mn;
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hdv) store_f(out, (t * Hq + h) * hdv + d, acc[i] / l);
  }
  if (lse && lane == 0) lse[h * T_ + t] = m + logf(l);
}

// EPL (elements per lane) = ceil(hd / 32) rounded up to 1, 2, 4 or 8 (hd <= 256).
#define FP8RL_DISPATCH_EPL(hd, ...)                                                   \
  do {                                                                                \
    FP8RL_CHECK((hd) > 0 && (hd) <= 256, "attention: head_dim must be in [1, 256], got ", (hd)); \
    if ((hd) <= 32) { constexpr int EPL = 1; __VA_ARGS__; }                           \
    else if ((hd) <= 64) { constexpr int EPL = 2; __VA_ARGS__; }                      \
    else if ((hd) <= 128) { constexpr int EPL = 4; __VA_ARGS__; }                     \
    else { constexpr int EPL = 8; __VA_ARGS__; }                                      \
  } while (0)

// The paged kernel also serves MLA's latent rows (kvr + r = 576 in DeepSeek-V3 / Moonlight).
#define FP8RL_DISPATCH_EPL_WIDE(hd, ...)                                              \
  do {                                                                                \
    FP8RL_CHECK((hd) > 0 && (hd) <= kPagedSimpleMaxDim, "paged attention: head widths must be in [1, ", \
                kPagedSimpleMaxDim, "], got ", (hd));                                 \
    if ((hd) <= 256) { FP8RL_DISPATCH_EPL(hd, __VA_ARGS__); }                         \
    else if ((hd) <= 512) { constexpr int EPL = 16; __VA_ARGS__; }                    \
    else { constexpr int EPL = 24; __VA_ARGS__; }                                     \
  } while (0)

unsigned warp_grid(int64_t warps) { return static_cast<unsigned>(ceil_div(warps, kWarps)); }

}  // namespace

void launch_attention(const void* q, const void* k, const void* v, DType dt, const int32_t* seq_start, int64_t T_,
                      int Hq, int Hkv, int hd, int hdv, float scale, void* out, float* lse, cudaStream_t stream) {
  if (T_ == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "attention", {
    FP8RL_DISPATCH_EPL(std::max(hd, hdv), {
      attention_fwd_kernel<EPL, T><<<warp_grid(T_ * Hq), kWarps * 32, 0, stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), seq_start, T_, Hq, Hkv, hd,
          hdv, scale, static_cast<T*>(out), lse);
    });
  });
  CUDA_CHECK_LAUNCH("attention_fwd_kernel");
}

void launch_attention_backward(const void* dout, const void* q, const void* k, const void* v, const void* out,
                               DType dt, const float* lse, const int32_t* seq_start, const int32_t* seq_end,
                               int64_t T_, int Hq, int Hkv, int hd, int hdv, float scale, void* dq, void* dk, void* dv,
                               float* delta, cudaStream_t stream) {
  if (T_ == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "attention_backward", {
    attention_delta_kernel<T><<<warp_grid(T_ * Hq), kWarps * 32, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), T_ * Hq, hdv, delta);
    CUDA_CHECK_LAUNCH("attention_delta_kernel");
    FP8RL_DISPATCH_EPL(std::max(hd, hdv), {
      attention_dq_kernel<EPL, T><<<warp_grid(T_ * Hq), kWarps * 32, 0, stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
          lse, delta, seq_start, T_, Hq, Hkv, hd, hdv, scale, static_cast<T*>(dq));
      CUDA_CHECK_LAUNCH("attention_dq_kernel");
      attention_dkv_kernel<EPL, T><<<warp_grid(T_ * Hkv), kWarps * 32, 0, stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
          lse, delta, seq_end, T_, Hq, Hkv, hd, hdv, scale, static_cast<T*>(dk), static_cast<T*>(dv));
      CUDA_CHECK_LAUNCH("attention_dkv_kernel");
    });
  });
}

void launch_kv_round(void* x, DType dt, int64_t T_, int H, int hd, const KvRoundScales& s, cudaStream_t stream) {
  const int64_t n = T_ * H * hd;
  if (n == 0) return;
  const bool vec = hd % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  FP8RL_DISPATCH_FLOAT(dt, "kv_round", {
    if (vec)
      kv_round8_kernel<T><<<grid_for(n / 8, 256), 256, 0, stream>>>(static_cast<T*>(x), n / 8, H, hd / 8, s);
    else
      kv_round_kernel<T><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<T*>(x), n, H, hd, s);
  });
  CUDA_CHECK_LAUNCH("kv_round_kernel");
}

void launch_kv_write(const void* k, const void* v, DType src_dt, const int32_t* slots, int64_t T_, int Hkv, int hd,
                     void* kpool, void* vpool, DType pool_dt, const float* k_scale, const float* v_scale,
                     cudaStream_t stream) {
  const int64_t n = T_ * Hkv * hd;
  if (n == 0) return;
  const auto a16 = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = hd % 8 == 0 && a16(k) && a16(v) && a16(kpool) && a16(vpool);
  FP8RL_DISPATCH_FLOAT(src_dt, "kv_write source", {
    using TS = T;
    if (vec && pool_dt == DType::E4M3) {
      kv_write8_kernel<TS, uint8_t><<<grid_for(n / 8, 256), 256, 0, stream>>>(
          static_cast<const TS*>(k), static_cast<const TS*>(v), slots, n / 8, Hkv, hd / 8,
          static_cast<uint8_t*>(kpool), static_cast<uint8_t*>(vpool), k_scale, v_scale);
    } else if (vec) {
      FP8RL_DISPATCH_FLOAT(pool_dt, "KV cache", {
        kv_write8_kernel<TS, T><<<grid_for(n / 8, 256), 256, 0, stream>>>(
            static_cast<const TS*>(k), static_cast<const TS*>(v), slots, n / 8, Hkv, hd / 8, static_cast<T*>(kpool),
            static_cast<T*>(vpool), k_scale, v_scale);
      });
    } else if (pool_dt == DType::E4M3) {
      kv_write_kernel<TS, uint8_t><<<grid_for(n, 256), 256, 0, stream>>>(
          static_cast<const TS*>(k), static_cast<const TS*>(v), slots, T_, Hkv, hd, static_cast<uint8_t*>(kpool),
          static_cast<uint8_t*>(vpool), k_scale, v_scale);
    } else {
      FP8RL_DISPATCH_FLOAT(pool_dt, "KV cache", {
        kv_write_kernel<TS, T><<<grid_for(n, 256), 256, 0, stream>>>(
            static_cast<const TS*>(k), static_cast<const TS*>(v), slots, T_, Hkv, hd, static_cast<T*>(kpool),
            static_cast<T*>(vpool), k_scale, v_scale);
      });
    }
  });
  CUDA_CHECK_LAUNCH("kv_write_kernel");
}

void launch_attention_paged(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                            const int32_t* page_table, int max_pages, int64_t T_, int Hq, int Hkv, int hd, int hdv,
                            int v_row, int page_size, const void* kpool, const void* vpool, DType pool_dt,
                            const float* k_scale, const float* v_scale, float scale, bool fp8_q, void* out,
                            cudaStream_t stream, float* lse) {
  if (T_ == 0) return;
  FP8RL_DISPATCH_FLOAT(qdt, "attention_paged q", {
    using TQ = T;
    FP8RL_DISPATCH_EPL_WIDE(std::max(hd, hdv), {
      if (pool_dt == DType::E4M3) {
        attention_paged_kernel<EPL, TQ, uint8_t><<<warp_grid(T_ * Hq), kWarps * 32, 0, stream>>>(
            static_cast<const TQ*>(q), token_seq, token_pos, page_table, max_pages, T_, Hq, Hkv, hd, hdv, v_row,
            page_size, static_cast<const uint8_t*>(kpool), static_cast<const uint8_t*>(vpool), k_scale, v_scale, scale, fp8_q,
            static_cast<TQ*>(out), lse);
      } else {
        FP8RL_DISPATCH_FLOAT(pool_dt, "KV cache", {
          attention_paged_kernel<EPL, TQ, T><<<warp_grid(T_ * Hq), kWarps * 32, 0, stream>>>(
              static_cast<const TQ*>(q), token_seq, token_pos, page_table, max_pages, T_, Hq, Hkv, hd, hdv, v_row,
              page_size, static_cast<const T*>(kpool), static_cast<const T*>(vpool), nullptr, nullptr, scale, fp8_q,
              static_cast<TQ*>(out), lse);
        });
      }
    });
  });
  CUDA_CHECK_LAUNCH("attention_paged_kernel");
}

}  // namespace fp8rl::cuda
