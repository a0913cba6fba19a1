// The block quantizer's device arithmetic, bit-exact with quant/quant.cpp (see quant_kernels.cu):
// one copy shared by the quantization kernels and the fused producers (fused_kernels.cu).
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

namespace fp8rl::cuda {

__device__ __forceinline__ float pow2_round_up(float s) {
  uint32_t u = __float_as_uint(s);
  const uint32_t man = u & 0x7fffffu, exp = u >> 23;  // s > 0 here
  if (man == 0) return s;
  if (exp > 0) return __uint_as_float((exp + 1) << 23);
  // Subnormal: the next power of two above m * 2^-149 is 2^(p+1) * 2^-149 (p = top bit of m),
  // which is 1 << (p + 1) as bits (the smallest normal when p + 1 == 23).
  const int p = 31 - __clz(man);
  if ((man & (man - 1)) == 0) return s;
  return __uint_as_float(1u << (p + 1));
}

__device__ __forceinline__ float quant_scale(float amax, bool pow2) {
  if (amax == 0.0f) return 1.0f;
  float s = amax / 448.0f;
  if (s == 0.0f) s = __uint_as_float(1u);  // underflow: the smallest positive float, as quant.cpp
  if (pow2) s = pow2_round_up(s);
  return s;
}

__device__ __forceinline__ uint8_t e4m3_encode(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_decode(uint8_t q) {
  __nv_fp8_e4m3 f;
  f.__x = q;
  return static_cast<float>(f);
}

// load8 (common.cuh): 8 consecutive elements as floats, one 16-byte load (BF16) or two (F32).
// e4m3(v[i] / s) for 8 values, packed little-endian into two words.
__device__ __forceinline__ uint2 encode8(const float v[8], float s) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i / 4] |= static_cast<uint32_t>(e4m3_encode(v[i] / s)) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

}  // namespace fp8rl::cuda
