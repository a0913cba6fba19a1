// The FP8 rule in one place, for host and device code (recipe.md section 2, quant/quant.h):
//   - the scale from a block's amax: s = amax / 448 (one IEEE float division, never a multiply
//     by 1 / 448); amax == 0 gives 1; a division that underflows to 0 gives 2^-149; pow2 rounds
//     s up to a power of two (a power of two stays);
//   - on the device, the E4M3 codec over CUDA's conversions: encode rounds to nearest even and
//     saturates to +-448, decode is exact. The host codec is core/dtype.cpp's software
//     e4m3_from_float / e4m3_to_float, the table-checked reference these are tested against.
// quant_scale_from_amax (quant.cpp) is fp8_scale_from_amax plus its checks of the input (finite,
// >= 0); device code calls fp8_scale_from_amax directly, on an amax it knows to be finite.
// Plain C++ sees only the FP8RL_QUANT_HD functions (a name of its own: backend/sampling.h has
// FP8RL_HD, with __forceinline__).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"  // kE4M3Max

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define FP8RL_QUANT_HD __host__ __device__
#else
#define FP8RL_QUANT_HD
#endif

namespace fp8rl {

FP8RL_QUANT_HD inline uint32_t fp8_float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

FP8RL_QUANT_HD inline float fp8_bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// The least power of two >= s, for a finite s > 0; exact (bits only).
FP8RL_QUANT_HD inline float fp8_pow2_round_up(float s) {
  const uint32_t u = fp8_float_bits(s);
  const uint32_t man = u & 0x7fffffu, exp = u >> 23;
  if (man == 0) return s;                                       // a normal power of two
  if (exp > 0) return fp8_bits_float((exp + 1) << 23);          // 2^(e + 1)
  // Subnormal man * 2^-149: the least power of two >= man, as bits (2^23 is the smallest normal).
  uint32_t m = man - 1;
  m |= m >> 1;
  m |= m >> 2;
  m |= m >> 4;
  m |= m >> 8;
  m |= m >> 16;
  return fp8_bits_float(m + 1);
}

// The one scale rule, for a finite amax >= 0 (quant_scale_from_amax checks that on the host).
FP8RL_QUANT_HD inline float fp8_scale_from_amax(float amax, bool pow2) {
  if (amax == 0.0f) return 1.0f;
  float s = amax / kE4M3Max;
  if (s == 0.0f) s = fp8_bits_float(1u);  // underflow: the smallest positive float, 2^-149
  if (pow2) s = fp8_pow2_round_up(s);
  return s;
}

// Round-to-nearest products and FMAs that no compiler contracts or reassociates.
FP8RL_QUANT_HD inline float fp8_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;  // baseline x86-64 has no FMA to contract into (CMakeLists.txt), and nothing is added here
#endif
}
FP8RL_QUANT_HD inline float fp8_fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The quantizer's quotients x / s for one block's scale s without a division per element (an
// IEEE division is a ~10-instruction sequence with a range check and a slow-path branch, the
// largest per-element cost of the GPU's FP8 producers): r = 1 / s once, correctly rounded; per
// element q0 = x r, the remainder x - q0 s (exact in an FMA) and q = q0 + rem r, Markstein's
// correction — the sequence CUDA's own division runs after its reciprocal. For s in [2^-64, 2^64]
// and 2^-11 <= |x / s| < 2^32 its result is x / s bit for bit in every case checked (none
// differed): all 2^23 significands of x against the 400 significands of s whose reciprocals
// round worst and 2e11 random pairs (offline, docs/benchmarks.md session 17), the 4 worst and
// random pairs in the suite (tests/cpu/test_fp8_divisor.cpp); where |x / s| < 2^-11 it is within
// a few ulps of x / s with x's sign, and E4M3 encodes both as that signed zero. So e4m3(quotient)
// == e4m3(x / s). Other scales, and a call's N values when one of them has |x r| >= 2^32
// (non-finite input included), take the division.
class Fp8Divisor {
 public:
  FP8RL_QUANT_HD explicit Fp8Divisor(float s) : s_(s), r_(1.0f / s), fast_(s >= 0x1p-64f && s <= 0x1p64f) {}
  FP8RL_QUANT_HD float scale() const { return s_; }

  // q[i] = x[i] / s (in the sense above) for N values.
  template <int N>
  FP8RL_QUANT_HD void quotients(const float* x, float* q) const {
    bool slow = !fast_;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int i = 0; i < N; ++i) {
      q[i] = fp8_mul_rn(x[i], r_);
      slow |= !(fp8_abs(q[i]) < 0x1p32f);
    }
    if (slow) {
      for (int i = 0; i < N; ++i) q[i] = x[i] / s_;
      return;
    }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int i = 0; i < N; ++i) {
      const float rem = fp8_fma_rn(-q[i], s_, x[i]);
      q[i] = fp8_with_sign_of(fp8_fma_rn(rem, r_, q[i]), x[i]);  // x = -0 gives -0, as x / s
    }
  }
  FP8RL_QUANT_HD float operator()(float x) const {
    float q;
    quotients<1>(&x, &q);
    return q;
  }

 private:
  FP8RL_QUANT_HD static float fp8_abs(float x) {
#ifdef __CUDA_ARCH__
    return fabsf(x);  // an operand modifier of the comparison
#else
    return std::fabs(x);
#endif
  }
  FP8RL_QUANT_HD static float fp8_with_sign_of(float x, float sign) {
#ifdef __CUDA_ARCH__
    return copysignf(x, sign);  // one LOP3
#else
    return std::copysign(x, sign);
#endif
  }
  float s_, r_;
  bool fast_;
};

#ifdef __CUDACC__
// e4m3_from_float(v): round to nearest even, saturating to +-448.
__device__ __forceinline__ uint8_t fp8_e4m3_encode(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// e4m3_to_float(q), exact.
__device__ __forceinline__ float fp8_e4m3_decode(uint8_t q) {
  __nv_fp8_e4m3 f;
  f.__x = q;
  return static_cast<float>(f);
}

// e4m3_round(x) = e4m3_to_float(e4m3_from_float(x)).
__device__ __forceinline__ float fp8_e4m3_round(float x) { return fp8_e4m3_decode(fp8_e4m3_encode(x)); }

// Two E4M3 bytes (the first in the low byte of `two`) to floats, exact: one paired conversion
// through FP16 (every E4M3 value is an FP16 value).
__device__ __forceinline__ float2 fp8_e4m3x2_to_float2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  __half2 hh;
  hh = h;
  return __half22float2(hh);
}
#endif

}  // namespace fp8rl
