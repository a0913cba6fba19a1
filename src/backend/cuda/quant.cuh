// The block quantizer's device helpers, shared by the quantization kernels and the fused
// producers (fused_kernels.cu). The scale rule and the E4M3 codec are quant/fp8_rule.h's.
// The code between the "emulated" markers also runs on the host (tests/cuda/eltwise_emu).
#pragma once
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "quant/fp8_rule.h"

namespace fp8rl::cuda {

// ---- emulated: begin (row blocks)
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

// The 1 x 128 row quantizer and the element-wise kernels that write an FP8 copy run 8 threads per
// (row, 128-column block), 16 columns each, so a thread's fixed work (its block's index, the amax
// exchange, the scale and its reciprocal) is spread over 16 elements. A thread's two chunks of 8
// lie 64 columns apart (lane l: columns 8 l .. and 64 + 8 l .. of its block), so each 16-byte
// access of the 8 lanes covers 128 contiguous bytes of BF16 (one chunk of every lane) — with 16
// consecutive columns per lane, each access touched every other 16 bytes and the element-wise
// kernels with an FP8 copy ran at ~62% of the bandwidth their BF16 twins reach (session 19).
// Which columns a lane holds changes no result: the block's amax is a max, each code its own
// element's.
constexpr int kRowBlockLanes = 8;
struct RowBlock {
  int64_t r, blk, nb;  // row, column block, blocks per row
  int64_t col[2];      // chunk k's first column: blk * 128 + 64 k + 8 sub
  int sub;             // lane within the block's 8
  unsigned mask;       // the block's lanes
  bool in[2];          // chunk k (columns col[k] .. col[k] + 8) lies in the row (C % 8 == 0)
};
// False for the threads past R * nb blocks (whole groups of 8 leave together: blockDim is a
// multiple of 8).
__device__ __forceinline__ bool row_block(int64_t R, int64_t C, RowBlock& h) {
  h.nb = (C + 127) / 128;
  const int64_t gid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kRowBlockLanes;
  h.sub = static_cast<int>(threadIdx.x % kRowBlockLanes);
  h.mask = 0xffu << (threadIdx.x & 24);
  if (gid >= R * h.nb) return false;
  divmod_index(gid, h.nb, h.r, h.blk);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    h.col[k] = h.blk * 128 + 64 * k + 8 * h.sub;
    h.in[k] = h.col[k] < C;
  }
  return true;
}
// Host: the threads of a row-block launch over R rows of width C.
inline int64_t row_block_threads(int64_t R, int64_t C) { return R * ((C + 127) / 128) * kRowBlockLanes; }

// The amax and finiteness of 8 values as stored (store8_rounded left them rounded to T, as the
// quantizer reads them), folded into amax / finite.
__device__ __forceinline__ void stored_amax8(const float v[8], float& amax, bool& finite) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    finite &= isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
}

// The block's amax over its 8 lanes, its scale (lane 0 writes it; [R][nb], or cuBLASLt's VEC128
// [nb][R] with gemm_layout) and this lane's E4M3 codes of v[0..16) into row h.r of q (width C):
// one 8-byte store per chunk in the row (the 8 lanes' stores of a chunk: 64 contiguous bytes).
__device__ __forceinline__ void row_block_quantize(const RowBlock& h, const float v[16], float amax, int64_t R,
                                                   int64_t C, bool pow2, uint8_t* q, float* scales, bool gemm_layout) {
#pragma unroll
  for (int o = kRowBlockLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(h.mask, amax, o));
  const float s = fp8_scale_from_amax(amax, pow2);
  if (h.sub == 0) scales[gemm_layout ? h.blk * R + h.r : h.r * h.nb + h.blk] = s;
  const Fp8Divisor d(s);
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (h.in[k]) *reinterpret_cast<uint2*>(q + h.r * C + h.col[k]) = encode8(v + 8 * k, d);
}
// ---- emulated: end (row blocks)

}  // namespace fp8rl::cuda
