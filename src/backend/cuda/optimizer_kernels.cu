// AdamW on the GPU, many tensors per launch (the optimizer step over every parameter: the MoE
// trainer's thousands of expert matrices cost a launch per 64 tensors, not per tensor). Each
// element's arithmetic is backend/adamw_rule.h's: BF16 moments bitwise the CPU reference, F32
// moments by adamw_f32_moments_step (the CPU computes those in double). An element keeps its index
// within its own tensor (the stochastic rounding bits), so a tensor's result does not depend on
// which launch or chunk it falls in: one launch of many tensors is bitwise one launch per tensor.
#include "backend/adamw_rule.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

constexpr int kAdamWThreads = 256;
constexpr int64_t kAdamWChunk = kAdamWThreads * 8 * 4;  // elements per CTA: 4 passes of 8 per thread
constexpr int kAdamWMaxTensors = 64;                    // per launch (the parameters stay < 4 KB)

struct AdamWLaunch {
  int count;
  int chunk_start[kAdamWMaxTensors + 1];  // CTA range of tensor t: [chunk_start[t], chunk_start[t + 1])
  float* p[kAdamWMaxTensors];
  const void* g[kAdamWMaxTensors];
  void* m[kAdamWMaxTensors];
  void* v[kAdamWMaxTensors];
  int64_t n[kAdamWMaxTensors];
  uint64_t key[kAdamWMaxTensors];
  float decay[kAdamWMaxTensors];
  bool vec[kAdamWMaxTensors];  // every pointer 16-byte aligned: 8-element accesses
};

// Moments: BF16 bits (uint16_t) or F32.
__device__ __forceinline__ void load8m(const uint16_t* p, uint16_t v[8]) {
  *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void store8m(uint16_t* p, const uint16_t v[8]) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
}
__device__ __forceinline__ void load8m(const float* p, float v[8]) { load8(p, v); }
__device__ __forceinline__ void store8m(float* p, const float v[8]) { store8(p, v); }

__device__ __forceinline__ void step1(float& w, float g, uint16_t& m, uint16_t& v, const AdamWScalars& s,
                                      bool stochastic, uint64_t key, int64_t step, int64_t i) {
  const uint32_t bits = stochastic ? adamw_rounding_bits(key, step, i) : 0u;
  adamw_bf16_moments_step(w, g, m, v, s, stochastic, bits);
}
__device__ __forceinline__ void step1(float& w, float g, float& m, float& v, const AdamWScalars& s, bool, uint64_t,
                                      int64_t, int64_t) {
  adamw_f32_moments_step(w, g, m, v, s);
}

template <class G, class M>
__global__ void __launch_bounds__(kAdamWThreads) adamw_many_kernel(const __grid_constant__ AdamWLaunch L,
                                                                   AdamWScalars s, bool stochastic, int64_t step) {
  const int t = multi_tensor_of(L.chunk_start, L.count, static_cast<int>(blockIdx.x));
  const int64_t n = L.n[t];
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.chunk_start[t]) * kAdamWChunk;
  const int64_t end = min(n, begin + kAdamWChunk);
  float* p = L.p[t];
  const G* g = static_cast<const G*>(L.g[t]);
  M* m = static_cast<M*>(L.m[t]);
  M* v = static_cast<M*>(L.v[t]);
  s.decay = L.decay[t];
  const uint64_t key = L.key[t];
  int64_t scalar_from = begin;
  if (L.vec[t]) {
    for (int64_t i0 = begin + threadIdx.x * 8; i0 + 8 <= end; i0 += kAdamWThreads * 8) {
      float w[8], gv[8];
      M mi[8], vi[8];
      load8(p + i0, w);
      load8(g + i0, gv);
      load8m(m + i0, mi);
      load8m(v + i0, vi);
#pragma unroll
      for (int k = 0; k < 8; ++k) step1(w[k], gv[k], mi[k], vi[k], s, stochastic, key, step, i0 + k);
      store8(p + i0, w);
      store8m(m + i0, mi);
      store8m(v + i0, vi);
    }
    scalar_from = begin + (end - begin) / 8 * 8;  // the last partial group of 8 (a tensor's tail)
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += kAdamWThreads) {
    float w = p[i];
    M mi = m[i], vi = v[i];
    step1(w, load_f(g, i), mi, vi, s, stochastic, key, step, i);
    p[i] = w;
    m[i] = mi;
    v[i] = vi;
  }
}

bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }

template <class M>
void launch_chunked(const std::vector<AdamWTensor>& ts, DType g_dtype, const AdamWScalars& s, bool stochastic,
                    int64_t step, cudaStream_t stream) {
  for (size_t first = 0; first < ts.size();) {
    AdamWLaunch L{};
    int64_t ctas = 0;
    size_t i = first;
    for (; i < ts.size() && L.count < kAdamWMaxTensors; ++i) {
      const AdamWTensor& a = ts[i];
      if (a.n == 0) continue;
      const int64_t c = (a.n + kAdamWChunk - 1) / kAdamWChunk;
      if (L.count > 0 && ctas + c > (1LL << 30)) break;  // the grid's x dimension (int CTA indices)
      const int k = L.count++;
      L.chunk_start[k] = static_cast<int>(ctas);
      L.p[k] = a.p, L.g[k] = a.g, L.m[k] = a.m, L.v[k] = a.v, L.n[k] = a.n;
      L.key[k] = a.key, L.decay[k] = a.decay;
      L.vec[k] = aligned16(a.p) && aligned16(a.g) && aligned16(a.m) && aligned16(a.v);
      ctas += c;
    }
    first = i;
    if (L.count == 0) continue;
    L.chunk_start[L.count] = static_cast<int>(ctas);
    FP8RL_DISPATCH_FLOAT(g_dtype, "adamw grad", {
      adamw_many_kernel<T, M><<<static_cast<unsigned>(ctas), kAdamWThreads, 0, stream>>>(L, s, stochastic, step);
    });
    CUDA_CHECK_LAUNCH("adamw_many_kernel");
  }
}

}  // namespace

void launch_adamw_many(const std::vector<AdamWTensor>& ts, DType g_dtype, DType m_dtype, const AdamWScalars& s,
                       bool stochastic, int64_t step, cudaStream_t stream) {
  FP8RL_CHECK(m_dtype == DType::BF16 || m_dtype == DType::F32, "adamw moments must be F32 or BF16, got ",
              dtype_name(m_dtype));
  if (m_dtype == DType::BF16) launch_chunked<uint16_t>(ts, g_dtype, s, stochastic, step, stream);
  else launch_chunked<float>(ts, g_dtype, s, false, step, stream);
}

}  // namespace fp8rl::cuda
