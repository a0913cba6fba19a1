// AdamW with BF16 moments: the one copy of its numerical rule, shared by the CPU reference
// (cpu_backend.cpp) and the CUDA kernel (cuda/optimizer_kernels.cu), so the two agree bit for
// bit. The precision-aware optimizer of TransformerEngine / Megatron-LM
// (--use-precision-aware-optimizer, --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16): the master
// weight stays FP32, m and v are stored in BF16, every operation is FP32.
//
// Per element, with the scalars of adamw_scalars (computed once per tensor on the host, in double,
// rounded once to FP32) and g = g_raw * grad_scale:
//   m' = fma(b1, m, (1 - b1) g)              v' = fma(b2, v, (1 - b2) (g g))
//   w  = fma(w, decay, -((step_size m') / (sqrt(v') / bc2_sqrt + eps)))
//   m, v stored as bf16(m'), bf16(v'): round to nearest even, or stochastically (below).
// The update uses the FP32 m', v' (not their BF16 roundings); the next step reads the stored
// BF16 values. Every multiply-add is an explicit fma and no other product feeds a sum, so no
// compiler can contract a different expression on either side (the device side also uses the
// _rn intrinsics, which are never contracted); sqrt and division are IEEE correctly rounded on
// both.
//
// Stochastic rounding (train.optimizer_state_rounding: stochastic): bf16 = the high 16 bits of
// float_bits(x) + r, r uniform in [0, 2^16) — rounds up with probability equal to the
// truncated fraction, so E[bf16(x)] = x. r comes from a counter-based hash of (key, step,
// element) (SplitMix64's finalizer): no generator state, the same bits on the CPU and the GPU,
// and a resumed run draws the same bits as an uninterrupted one (the step is checkpointed).
// Why offer it: with b2 = 0.999 a step changes v by (1 - b2) = 1e-3 of its size at most when g^2
// is below v, under half a BF16 ulp (2^-9 = 2e-3): to nearest, v can then never decay and stops
// following the gradients after a few hundred steps; stochastic rounding follows them in
// expectation.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define FP8RL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FP8RL_HOST_DEVICE inline
#endif

namespace fp8rl {

struct AdamWScalars {
  float grad_scale;  // multiplies g first (the clipping factor)
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float decay;      // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

// Host: from the op's parameters (each in double, rounded once).
inline AdamWScalars adamw_scalars(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                                  float grad_scale) {
  AdamWScalars s;
  s.grad_scale = grad_scale;
  s.beta1 = beta1;
  s.one_minus_beta1 = static_cast<float>(1.0 - double(beta1));
  s.beta2 = beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - double(beta2));
  s.eps = eps;
  s.decay = static_cast<float>(1.0 - double(lr) * double(weight_decay));
  s.step_size = static_cast<float>(double(lr) / (1.0 - std::pow(double(beta1), double(step))));
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double(beta2), double(step))));
  return s;
}

FP8RL_HOST_DEVICE float adamw_mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FP8RL_HOST_DEVICE float adamw_add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FP8RL_HOST_DEVICE float adamw_fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);  // correctly rounded, in hardware or in libm
#endif
}

FP8RL_HOST_DEVICE float adamw_div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FP8RL_HOST_DEVICE float adamw_sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

FP8RL_HOST_DEVICE uint32_t adamw_float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

FP8RL_HOST_DEVICE float adamw_bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

FP8RL_HOST_DEVICE float adamw_bf16_to_float(uint16_t h) { return adamw_bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even (NaN kept quiet with its sign): bitwise bf16_from_float (core/dtype.cpp).
FP8RL_HOST_DEVICE uint16_t adamw_bf16_nearest(float x) {
  uint32_t u = adamw_float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic: r16 in [0, 2^16). Infinities and NaN are kept (no carry into them); a finite value
// may round up to infinity only when it lies above the largest BF16, as to nearest would.
FP8RL_HOST_DEVICE uint16_t adamw_bf16_stochastic(float x, uint32_t r16) {
  const uint32_t u = adamw_float_bits(x);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return adamw_bf16_nearest(x);
  return static_cast<uint16_t>((u + (r16 & 0xffffu)) >> 16);
}

// 32 random bits for element i of the tensor keyed `key` at optimizer step `step`: m takes the low
// 16, v the high 16.
FP8RL_HOST_DEVICE uint32_t adamw_rounding_bits(uint64_t key, int64_t step, int64_t i) {
  uint64_t z = key ^ (static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ull) ^
               (static_cast<uint64_t>(i) * 0xd1b54a32d192ed03ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 32);
}

// One element: w (FP32 master) updated in place, m and v (BF16 bits) read and written.
FP8RL_HOST_DEVICE void adamw_bf16_moments_step(float& w, float g_raw, uint16_t& m, uint16_t& v, const AdamWScalars& s,
                                               bool stochastic, uint32_t bits) {
  const float g = adamw_mul_rn(g_raw, s.grad_scale);
  const float mf = adamw_fma_rn(s.beta1, adamw_bf16_to_float(m), adamw_mul_rn(s.one_minus_beta1, g));
  const float vf = adamw_fma_rn(s.beta2, adamw_bf16_to_float(v), adamw_mul_rn(s.one_minus_beta2, adamw_mul_rn(g, g)));
  const float denom = adamw_add_rn(adamw_div_rn(adamw_sqrt_rn(vf), s.bc2_sqrt), s.eps);
  w = adamw_fma_rn(w, s.decay, -adamw_div_rn(adamw_mul_rn(s.step_size, mf), denom));
  m = stochastic ? adamw_bf16_stochastic(mf, bits & 0xffffu) : adamw_bf16_nearest(mf);
  v = stochastic ? adamw_bf16_stochastic(vf, bits >> 16) : adamw_bf16_nearest(vf);
}

// The same step with F32 moments (CUDA's F32-moment AdamW; the CPU reference computes those in
// double): m and v stay FP32, no rounding beyond each operation's own.
FP8RL_HOST_DEVICE void adamw_f32_moments_step(float& w, float g_raw, float& m, float& v, const AdamWScalars& s) {
  const float g = adamw_mul_rn(g_raw, s.grad_scale);
  m = adamw_fma_rn(s.beta1, m, adamw_mul_rn(s.one_minus_beta1, g));
  v = adamw_fma_rn(s.beta2, v, adamw_mul_rn(s.one_minus_beta2, adamw_mul_rn(g, g)));
  const float denom = adamw_add_rn(adamw_div_rn(adamw_sqrt_rn(v), s.bc2_sqrt), s.eps);
  w = adamw_fma_rn(w, s.decay, -adamw_div_rn(adamw_mul_rn(s.step_size, m), denom));
}

}  // namespace fp8rl
