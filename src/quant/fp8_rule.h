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
