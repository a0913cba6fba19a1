// AdamW with BF16 moments (the precision-aware optimizer): one thread per element, the rule of
// backend/adamw_rule.h shared with the CPU reference (bitwise equal). The F32-moment AdamW
// kernel is in model_kernels.cu.
#include "backend/adamw_rule.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

template <class G>
__global__ void adamw_bf16_moments_kernel(float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n, AdamWScalars s,
                                          bool stochastic, uint64_t key, int64_t step) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float w = p[i];
    uint16_t mi = m[i], vi = v[i];
    const uint32_t bits = stochastic ? adamw_rounding_bits(key, step, i) : 0u;
    adamw_bf16_moments_step(w, load_f(g, i), mi, vi, s, stochastic, bits);
    p[i] = w;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void launch_adamw_bf16_moments(float* p, const void* g, DType g_dtype, uint16_t* m, uint16_t* v, int64_t n,
                               const AdamWScalars& s, bool stochastic, uint64_t key, int64_t step,
                               cudaStream_t stream) {
  if (n == 0) return;
  FP8RL_DISPATCH_FLOAT(g_dtype, "adamw grad", {
    adamw_bf16_moments_kernel<T><<<grid_for(n, 256), 256, 0, stream>>>(p, static_cast<const T*>(g), m, v, n, s,
                                                                        stochastic, key, step);
  });
  CUDA_CHECK_LAUNCH("adamw_bf16_moments_kernel");
}

}  // namespace fp8rl::cuda
