// AdamW with BF16 moments (the precision-aware optimizer): one thread per element, the rule of
// backend/adamw_rule.h shared with the CPU reference (bitwise equal). The F32-moment AdamW
// kernel is in model_kernels.cu.
#include "backend/adamw_rule.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

// (Elements i of the pointers given are elements first + i of the tensor: their rounding bits.)
template <class G>
__global__ void adamw_bf16_moments_kernel(float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n, AdamWScalars s,
                                          bool stochastic, uint64_t key, int64_t step, int64_t first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float w = p[i];
    uint16_t mi = m[i], vi = v[i];
    const uint32_t bits = stochastic ? adamw_rounding_bits(key, step, first + i) : 0u;
    adamw_bf16_moments_step(w, load_f(g, i), mi, vi, s, stochastic, bits);
    p[i] = w;
    m[i] = mi;
    v[i] = vi;
  }
}

// The same rule, 8 elements per thread in 16-byte accesses (param 2 x float4, m and v one uint4
// each, the gradient one or two): the scalar kernel's 2-byte moment accesses left the step at
// ~17% of HBM bandwidth on the MoE experts (session 11 profile). Elements [8 * n8, n) are the
// scalar kernel's. Every element's arithmetic is the scalar one's: bitwise the same.
template <class G>
__global__ void adamw_bf16_moments_x8_kernel(float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n8, AdamWScalars s,
                                             bool stochastic, uint64_t key, int64_t step) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < n8;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i0 = 8 * c;
    float w[8], gv[8];
    *reinterpret_cast<float4*>(w) = reinterpret_cast<const float4*>(p + i0)[0];
    *reinterpret_cast<float4*>(w + 4) = reinterpret_cast<const float4*>(p + i0)[1];
    load8(g + i0, gv);
    uint16_t mi[8], vi[8];
    *reinterpret_cast<uint4*>(mi) = *reinterpret_cast<const uint4*>(m + i0);
    *reinterpret_cast<uint4*>(vi) = *reinterpret_cast<const uint4*>(v + i0);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t bits = stochastic ? adamw_rounding_bits(key, step, i0 + k) : 0u;
      adamw_bf16_moments_step(w[k], gv[k], mi[k], vi[k], s, stochastic, bits);
    }
    reinterpret_cast<float4*>(p + i0)[0] = *reinterpret_cast<const float4*>(w);
    reinterpret_cast<float4*>(p + i0)[1] = *reinterpret_cast<const float4*>(w + 4);
    *reinterpret_cast<uint4*>(m + i0) = *reinterpret_cast<const uint4*>(mi);
    *reinterpret_cast<uint4*>(v + i0) = *reinterpret_cast<const uint4*>(vi);
  }
}

bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }

}  // namespace

void launch_adamw_bf16_moments(float* p, const void* g, DType g_dtype, uint16_t* m, uint16_t* v, int64_t n,
                               const AdamWScalars& s, bool stochastic, uint64_t key, int64_t step,
                               cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v);
  const int64_t n8 = vec ? n / 8 : 0, done = 8 * n8;
  FP8RL_DISPATCH_FLOAT(g_dtype, "adamw grad", {
    const T* gt = static_cast<const T*>(g);
    if (n8 > 0)
      adamw_bf16_moments_x8_kernel<T><<<grid_for(n8, 256), 256, 0, stream>>>(p, gt, m, v, n8, s, stochastic, key, step);
    if (done < n)  // the tail (or everything, unaligned), at its own offsets: the same element indices
      adamw_bf16_moments_kernel<T><<<grid_for(n - done, 256), 256, 0, stream>>>(
          p + done, gt + done, m + done, v + done, n - done, s, stochastic, key, step, done);
  });
  CUDA_CHECK_LAUNCH("adamw_bf16_moments_kernel");
}

}  // namespace fp8rl::cuda
