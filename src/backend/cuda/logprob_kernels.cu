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
// The fold's two passes over a chunk, each block-reduced (every thread returns the result): the
// chunk's max of l = logit * inv_temp, and its sums of exp(l - m_new) and exp(l - m_new) * l.
__device__ __forceinline__ float chunk_max(const float* row, int64_t Vc, float inv_temp, float* red) {
  float cmax = -INFINITY;
  for (int64_t j = threadIdx.x; j < Vc; j += blockDim.x) cmax = fmaxf(cmax, __fmul_rn(row[j], inv_temp));
  return block_max(cmax, red);
}
__device__ __forceinline__ void chunk_sums(const float* row, int64_t Vc, float inv_temp, float m_new, float* red,
                                           float& cs_out, float& ce_out) {
  float cs = 0.0f, ce = 0.0f;
  for (int64_t j = threadIdx.x; j < Vc; j += blockDim.x) {
    const float l = __fmul_rn(row[j], inv_temp);
    const float p = expf(__fsub_rn(l, m_new));
    cs = __fadd_rn(cs, p);
    ce = fmaf(p, l, ce);
  }
  cs_out = block_sum(cs, red);
  ce_out = block_sum(ce, red);
}
__device__ __forceinline__ ChunkFold fold_chunk(const float* row, int64_t Vc, float inv_temp, float m_old, float* red) {
  ChunkFold f;
  f.m_new = fmaxf(m_old, chunk_max(row, Vc, inv_temp, red));
  chunk_sums(row, Vc, inv_temp, f.m_new, red, f.cs, f.ce);
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

// Every chunk of every row (the consistent generator's logp_gen over its [R, V] logits), the
// fold of logprob_chunk_kernel over the chunks [v0, v0 + chunk) in order, split so that the
// chunks run in parallel: the running max after chunk c is fmaxf(m_init, cmax_0, .., cmax_c) in
// that order, known once every chunk's max is, so each chunk's sums (its second pass) need only
// that prefix; the serial part left is fold_update's three FMAs per chunk. Same functions, same
// block shape, same order of operations: the bits of the chunked launches.
// (1) grid (chunks, R): the max of each chunk -> part[r][c].cmax
struct ChunkPart {
  float cmax, m_new, cs, ce;
};
__global__ void logprob_rows_max_kernel(const float* logits, int64_t V, int64_t chunk, float inv_temp,
                                        ChunkPart* part) {
  __shared__ float red[32];
  const int64_t c = blockIdx.x, t = blockIdx.y, v0 = c * chunk;
  const int64_t Vc = chunk < V - v0 ? chunk : V - v0;
  const float cmax = chunk_max(logits + t * V + v0, Vc, inv_temp, red);
  if (threadIdx.x == 0) part[t * gridDim.x + c].cmax = cmax;
}
// (2) grid (chunks, R): the running max after the chunk, and its sums.
__global__ void logprob_rows_sums_kernel(const float* logits, int64_t V, int64_t chunk, float inv_temp,
                                         const float* m_init, ChunkPart* part) {
  __shared__ float red[32];
  __shared__ float m_sh;
  const int64_t c = blockIdx.x, t = blockIdx.y, v0 = c * chunk;
  const int64_t Vc = chunk < V - v0 ? chunk : V - v0;
  ChunkPart* p = part + t * gridDim.x;
  if (threadIdx.x == 0) {
    float m = m_init[t];
    for (int64_t k = 0; k <= c; ++k) m = fmaxf(m, p[k].cmax);
    m_sh = m;
  }
  __syncthreads();
  const float m_new = m_sh;
  float cs, ce;
  chunk_sums(logits + t * V + v0, Vc, inv_temp, m_new, red, cs, ce);
  if (threadIdx.x == 0) p[c].m_new = m_new, p[c].cs = cs, p[c].ce = ce;
}
// (3) a thread per row: fold_update over the chunks in order, and the target's logit.
__global__ void logprob_rows_merge_kernel(const float* logits, int64_t R, int64_t V, int64_t nc, float inv_temp,
                                          const ChunkPart* part, const int32_t* targets, float* m, float* s, float* e,
                                          float* tgt, int* bad) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= R) return;
  float ms = m[t], ss = s[t], es = e[t];
  for (int64_t c = 0; c < nc; ++c) {
    const ChunkPart& p = part[t * nc + c];
    fold_update(ChunkFold{p.m_new, p.cs, p.ce}, ms, ms, ss, es);
  }
  m[t] = ms, s[t] = ss, e[t] = es;
  const int32_t y = targets[t];
  if (y < 0 || y >= V) atomicExch(bad, 1);
  else tgt[t] = __fmul_rn(logits[t * V + y], inv_temp);
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

int64_t logprob_rows_scratch_bytes(int64_t R, int64_t V, int64_t chunk) {
  return R * ((V + chunk - 1) / chunk) * static_cast<int64_t>(sizeof(ChunkPart));
}

void launch_logprob_rows(const float* logits, int64_t R, int64_t V, int64_t chunk, float inv_temp,
                         const int32_t* targets, float* m, float* s, float* e, float* tgt, int* bad_flag,
                         void* scratch, cudaStream_t stream) {
  if (R == 0 || V == 0) return;
  const int64_t nc = (V + chunk - 1) / chunk;
  FP8RL_CHECK(R <= 65535 && nc <= 65535, "launch_logprob_rows: ", R, " rows of ", nc, " chunks exceed the grid");
  ChunkPart* part = static_cast<ChunkPart*>(scratch);
  const dim3 grid(static_cast<unsigned>(nc), static_cast<unsigned>(R));
  logprob_rows_max_kernel<<<grid, kThreads, 0, stream>>>(logits, V, chunk, inv_temp, part);
  CUDA_CHECK_LAUNCH("logprob_rows_max_kernel");
  logprob_rows_sums_kernel<<<grid, kThreads, 0, stream>>>(logits, V, chunk, inv_temp, m, part);
  CUDA_CHECK_LAUNCH("logprob_rows_sums_kernel");
  logprob_rows_merge_kernel<<<grid_for(R, 128), 128, 0, stream>>>(logits, R, V, nc, inv_temp, part, targets, m, s, e,
                                                                  tgt, bad_flag);
  CUDA_CHECK_LAUNCH("logprob_rows_merge_kernel");
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
