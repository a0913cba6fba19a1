// The block quantizer's device helpers, shared by the quantization kernels and the fused
// producers (fused_kernels.cu). The scale rule and the E4M3 codec are quant/fp8_rule.h's.
#pragma once
#include <cstdint>

#include "quant/fp8_rule.h"

namespace fp8rl::cuda {

// load8 (common.cuh): 8 consecutive elements as floats, one 16-byte load (BF16) or two (F32).
// e4m3(v[i] / s) for 8 values of a block with scale s = d.scale(), packed little-endian into two
// words: the quotients by fp8_rule.h's Fp8Divisor (no division per element), one paired
// conversion per two values (cvt.rn.satfinite.e4m3x2 converts each of its two inputs as
// fp8_e4m3_encode does, the first into the low byte), so half the conversions and none of the
// byte shifts of the single form.
__device__ __forceinline__ uint2 encode8(const float v[8], const Fp8Divisor& d) {
  float q[8];
  d.quotients<8>(v, q);
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * i], q[4 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * i + 2], q[4 * i + 3]), __NV_SATFINITE, __NV_E4M3);
    w[i] = lo | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

}  // namespace fp8rl::cuda
