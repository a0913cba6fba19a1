// The block quantizer's device helpers, shared by the quantization kernels and the fused
// producers (fused_kernels.cu). The scale rule and the E4M3 codec are quant/fp8_rule.h's.
#pragma once
#include <cstdint>

#include "quant/fp8_rule.h"

namespace fp8rl::cuda {

// load8 (common.cuh): 8 consecutive elements as floats, one 16-byte load (BF16) or two (F32).
// e4m3(v[i] / s) for 8 values, packed little-endian into two words.
__device__ __forceinline__ uint2 encode8(const float v[8], float s) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i / 4] |= static_cast<uint32_t>(fp8_e4m3_encode(v[i] / s)) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

}  // namespace fp8rl::cuda
