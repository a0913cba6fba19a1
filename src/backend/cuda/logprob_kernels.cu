// Fused log-probabilities over vocabulary chunks: the backend computes raw logits for a chunk
// of the vocabulary with a GEMM, and these kernels fold the chunk into a per-token online
// log-sum-exp (m = running max, s = sum exp(l - m), e = sum exp(l - m) * l for the entropy),
// pick the target's logit, and, in the backward, turn the chunk's logits into dlogits in place.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void logprob_init_kernel(float* m, float* s, float* e, float* tgt, int64_t T) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    m[i] = -INFINITY;
    s[i] = 0.0f;
    e[i] = 0.0f;
    tgt[i] = NAN;  // must be set by the chunk holding the target
  }
}

// Folds one chunk of a row (its Vc logits at row, vocabulary ids v0 ..) into the row's online
// state (m_old, s, e): the chunk's max, the new max, and the chunk's sums of exp(l - m_new) and of
// exp(l - m_new) * l, each block-reduced; every thread returns them, thread 0 then updates the
// state. The one definition of the fold: the chunked launches (logprob_chunk_kernel) and the
// one-launch fold of a row's chunks (logprob_rows_kernel) compute the same bits. Explicit
// roundings (fmaf, __fmul_rn) so that no contraction choice differs between the two kernels.
struct ChunkFold {
  float m_new, cs, ce;
};
__device__ __forceinline__ ChunkFold fold_chunk(const float* row, int64_t Vc, float inv_temp, float m_old, float* red) {
  float cmax = -INFINITY;
  for (int64_t j = threadIdx.x; j < Vc; j += blockDim.x) cmax = fmaxf(cmax, __fmul_rn(row[j], inv_temp));
  cmax = block_max(cmax, red);
  ChunkFold f;
  f.m_new = fmaxf(m_old, cmax);
  float cs = 0.0f, ce = 0.0f;
  for (int64_t j = threadIdx.x; j < Vc; j += blockDim.x) {
    const float l = __fmul_rn(row[j], inv_temp);
    const float p = expf(__fsub_rn(l, f.m_new));
    cs = __fadd_rn(cs, p);
    ce = fmaf(p, l, ce);
  }
  f.cs = block_sum(cs, red);
  f.ce = block_sum(ce, red);
  return f;
}
// Thread 0's state update after a fold (corr: 0 on the first chunk, m_old = -inf), and the target's
// logit when the chunk holds it.
__device__ __forceinline__ void fold_update(const ChunkFold& f, float m_old, float& m, float& s, float& e) {
  const float corr = expf(__fsub_rn(m_old, f.m_new));
  s = fmaf(s, corr, f.cs);
  e = fmaf(e, corr, f.ce);
  m = f.m_new;
}

// One block per token row; row t's Vc logits at logits + t * ld.
__global__ void logprob_chunk_kernel(const float* logits, int64_t ld, int64_t Vc, int64_t v0, int64_t V,
                                     float inv_temp, const int32_t* targets, float* m, float* s, float* e, float* tgt,
                                     int* bad) {
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const float* row = logits + t * ld;
  const float m_old = m[t];
  const ChunkFold f = fold_chunk(row, Vc, inv_temp, m_old, red);
  if (threadIdx.x == 0) {
    fold_update(f, m_old, m[t], s[t], e[t]);
    const int32_t y = targets[t];
    if (y < 0 || y >= V) atomicExch(bad, 1);
    else if (y >= v0 && y < v0 + Vc) tgt[t] = __fmul_rn(row[y - v0], inv_temp);
  }
}

// Every chunk of a row in one launch (the consistent generator's logp_gen over its [R, V] logits):
// one block per row folds its chunks [v0, v0 + chunk) in order, each as logprob_chunk_kernel
// does, so the state is the bits of the chunked launches (one launch instead of one per chunk).
__global__ void logprob_rows_kernel(const float* logits, int64_t V, int64_t chunk, float inv_temp,
                                    const int32_t* targets, float* m, float* s, float* e, float* tgt, int* bad) {
  __shared__ float red[32];
  __shared__ float m_sh;
  const int64_t t = blockIdx.x;
  const float* row = logits + t * V;
  float ms = m[t], ss = s[t], es = e[t];  // thread 0's copy of the state
  if (threadIdx.x == 0) m_sh = ms;
  __syncthreads();
  for (int64_t v0 = 0; v0 < V; v0 += chunk) {
    const int64_t Vc = chunk < V - v0 ? chunk : V - v0;
    const float m_old = m_sh;
    const ChunkFold f = fold_chunk(row + v0, Vc, inv_temp, m_old, red);
    if (threadIdx.x == 0) {
      fold_update(f, m_old, ms, ss, es);
      m_sh = ms;
    }
    __syncthreads();  // m_sh for the next chunk (fold_chunk's reductions sync before reusing red)
  }
  if (threadIdx.x == 0) {
    m[t] = ms, s[t] = ss, e[t] = es;
    const int32_t y = targets[t];
    if (y < 0 || y >= V) atomicExch(bad, 1);
    else tgt[t] = __fmul_rn(row[y], inv_temp);
  }
}

__global__ void logprob_finish_kernel(const float* m, const float* s, const float* e, const float* tgt, int64_t T,
                                      float* logp, float* lse, float* entropy) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float z = m[i] + logf(s[i]);
    lse[i] = z;
    logp[i] = tgt[i] - z;
    if (entropy) entropy[i] = z - e[i] / s[i];
  }
}

// dlogits = dlogp[t] * (onehot - softmax) * inv_temp, written in place (F32) or to a BF16 copy for
// the BF16 GEMMs that consume it (the rounding their operand conversion would apply).
template <typename TO>
__global__ void logprob_grad_kernel(const float* logits, int64_t T, int64_t Vc, int64_t v0, float inv_temp,
                                    const int32_t* targets, const float* lse, const float* dlogp, TO* out) {
  const int64_t n = T * Vc;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / Vc, j = i % Vc;
    const float p = expf(logits[i] * inv_temp - lse[t]);
    const float onehot = (targets[t] == v0 + j) ? 1.0f : 0.0f;
    store_f(out, i, dlogp[t] * (onehot - p) * inv_temp);
  }
}

// The same, one row per blockIdx.y and four consecutive elements per thread (Vc % 4 == 0: 16-byte
// loads, 8-byte BF16 stores, no 64-bit index division per element).
template <typename TO>
__global__ void logprob_grad_rows4_kernel(const float* __restrict__ logits, int64_t Vc, int64_t v0, float inv_temp,
                                          const int32_t* __restrict__ targets, const float* __restrict__ lse,
                                          const float* __restrict__ dlogp, TO* out) {
  const int64_t t = blockIdx.y;
  const int64_t j = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 4;
  if (j >= Vc) return;
  const float l = lse[t], d = dlogp[t];
  const int64_t tgt = static_cast<int64_t>(targets[t]) - v0;
  const float4 x = *reinterpret_cast<const float4*>(logits + t * Vc + j);
  const float xs[4] = {x.x, x.y, x.z, x.w};
  float g[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float p = expf(xs[i] * inv_temp - l);
    const float onehot = j + i == tgt ? 1.0f : 0.0f;
    g[i] = d * (onehot - p) * inv_temp;
  }
  if constexpr (sizeof(TO) == 2) {
    const uint32_t lo = static_cast<uint32_t>(bf16_bits_from_float(g[0])) |
                        (static_cast<uint32_t>(bf16_bits_from_float(g[1])) << 16);
    const uint32_t hi = static_cast<uint32_t>(bf16_bits_from_float(g[2])) |
                        (static_cast<uint32_t>(bf16_bits_from_float(g[3])) << 16);
    *reinterpret_cast<uint2*>(reinterpret_cast<uint16_t*>(out) + t * Vc + j) = make_uint2(lo, hi);
  } else {
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + t * Vc + j) = make_float4(g[0], g[1], g[2], g[3]);
  }
}

}  // namespace

void launch_logprob_init(float* m, float* s, float* e, float* tgt, int64_t T, cudaStream_t stream) {
  if (T == 0) return;
  logprob_init_kernel<<<grid_for(T, 256), 256, 0, stream>>>(m, s, e, tgt, T);
  CUDA_CHECK_LAUNCH("logprob_init_kernel");
}

void launch_logprob_chunk(const float* logits, int64_t ld, int64_t T, int64_t Vc, int64_t v0, int64_t V,
                          float inv_temp, const int32_t* targets, float* m, float* s, float* e, float* tgt,
                          int* bad_flag, cudaStream_t stream) {
  if (T == 0 || Vc == 0) return;
  logprob_chunk_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(logits, ld, Vc, v0, V, inv_temp, targets, m,
                                                                         s, e, tgt, bad_flag);
  CUDA_CHECK_LAUNCH("logprob_chunk_kernel");
}

void launch_logprob_rows(const float* logits, int64_t R, int64_t V, int64_t chunk, float inv_temp,
                         const int32_t* targets, float* m, float* s, float* e, float* tgt, int* bad_flag,
                         cudaStream_t stream) {
  if (R == 0 || V == 0) return;
  logprob_rows_kernel<<<static_cast<unsigned>(R), kThreads, 0, stream>>>(logits, V, chunk, inv_temp, targets, m, s, e,
                                                                        tgt, bad_flag);
  CUDA_CHECK_LAUNCH("logprob_rows_kernel");
}

void launch_logprob_finish(const float* m, const float* s, const float* e, const float* tgt, int64_t T, float* logp,
                           float* lse, float* entropy, cudaStream_t stream) {
  if (T == 0) return;
  logprob_finish_kernel<<<grid_for(T, 256), 256, 0, stream>>>(m, s, e, tgt, T, logp, lse, entropy);
  CUDA_CHECK_LAUNCH("logprob_finish_kernel");
}

void launch_logprob_grad_chunk(float* logits, int64_t T, int64_t Vc, int64_t v0, float inv_temp,
                               const int32_t* targets, const float* lse, const float* dlogp, cudaStream_t stream,
                               void* out_bf16) {
  if (T * Vc == 0) return;
  bf16* o16 = static_cast<bf16*>(out_bf16);
  if (Vc % 4 == 0 && T <= 65535) {  // grid.y's limit
    const dim3 grid(static_cast<unsigned>((Vc / 4 + 255) / 256), static_cast<unsigned>(T));
    if (o16)
      logprob_grad_rows4_kernel<<<grid, 256, 0, stream>>>(logits, Vc, v0, inv_temp, targets, lse, dlogp, o16);
    else
      logprob_grad_rows4_kernel<<<grid, 256, 0, stream>>>(logits, Vc, v0, inv_temp, targets, lse, dlogp, logits);
    CUDA_CHECK_LAUNCH("logprob_grad_rows4_kernel");
    return;
  }
  if (o16)
    logprob_grad_kernel<<<grid_for(T * Vc, 256), 256, 0, stream>>>(logits, T, Vc, v0, inv_temp, targets, lse, dlogp,
                                                                   o16);
  else
    logprob_grad_kernel<<<grid_for(T * Vc, 256), 256, 0, stream>>>(logits, T, Vc, v0, inv_temp, targets, lse, dlogp,
                                                                   logits);
  CUDA_CHECK_LAUNCH("logprob_grad_kernel");
}

}  // namespace fp8rl::cuda
