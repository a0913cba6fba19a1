// Device-side helpers shared by the CUDA kernels: element loads/stores as FP32 for the
// activation dtypes (F32, BF16), the bit-exact BF16 codec (same as core/dtype.cpp), warp and
// block reductions, and the dtype dispatch used by the launchers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/dtype.h"
#include "core/error.h"

namespace fp8rl::cuda {

using bf16 = __nv_bfloat16;

// BF16 round-to-nearest-even with the NaN rule of bf16_from_float (dtype.cpp): bit-exact.
__device__ __forceinline__ uint16_t bf16_bits_from_float(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

__device__ __forceinline__ float load_f(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const bf16* p, int64_t i) {
  return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
}
__device__ __forceinline__ void store_f(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(bf16* p, int64_t i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = bf16_bits_from_float(v);
}

// 8 consecutive elements as floats, and back (bit-exact BF16 rounding): one 16-byte access for
// BF16, two for F32. p must be 16-byte aligned (vec8_ok).
__device__ __forceinline__ void load8(const bf16* p, float v[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load8(const float* p, float v[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
// 8 floats as BF16 bits packed in pairs (w[i] = v[2i] | v[2i + 1] << 16), each as
// bf16_bits_from_float rounds it: four cvt.rn.bf16x2.f32 (the same round to nearest even, FP32
// subnormals kept, overflow to infinity); the instruction writes a canonical NaN, so 8 values
// holding a NaN take bf16_bits_from_float itself (which keeps the NaN's sign and payload).
__device__ __forceinline__ void bf16_pack8(const float v[8], uint32_t w[4]) {
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 8; ++i) nan |= isnan(v[i]);
  if (nan) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(bf16_bits_from_float(v[2 * i])) |
             (static_cast<uint32_t>(bf16_bits_from_float(v[2 * i + 1])) << 16);
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // .x (low half) from the first
    w[i] = *reinterpret_cast<const uint32_t*>(&p);
  }
}
__device__ __forceinline__ void store8(bf16* p, const float v[8]) {
  uint32_t w[4];
  bf16_pack8(v, w);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void store8(float* p, const float v[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
// v[0..8) rounded as a T stores them (BF16: bf16_pack8's pairs, so nearest even as store_f /
// store8; F32: unchanged); w: the BF16 words.
__device__ __forceinline__ void round8_as(const bf16*, float v[8], uint32_t w[4]) {
  bf16_pack8(v, w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void round8_as(const bf16* p, float v[8]) {
  uint32_t w[4];
  round8_as(p, v, w);
}
__device__ __forceinline__ void round8_as(const float*, float*) {}
// store8 that also leaves v holding the stored values (v rounded to T once, for a quantizer that
// reads the stored output).
__device__ __forceinline__ void store8_rounded(bf16* p, float v[8]) {
  uint32_t w[4];
  round8_as(p, v, w);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void store8_rounded(float* p, float v[8]) { store8(p, v); }

// SwiGLU's per-element value silu(g) * u = (g * sigmoid(g)) * u in FP32: one copy for the
// swiglu kernels and the fused swiglu -> FP8 producer.
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * (1.0f / (1.0f + expf(-g))) * u; }
// Its backward per element in FP32 (du = d silu(g), dg = d u silu'(g)): one copy for the
// swiglu_backward kernels and the fused swiglu_backward -> FP8 producer.
__device__ __forceinline__ void swiglu_backward_value(float d, float g, float u, float& dg, float& du) {
  const float sg = 1.0f / (1.0f + expf(-g));
  du = d * g * sg;
  dg = d * u * sg * (1.0f + g * (1.0f - sg));
}

// Host: the block size of the one-block-per-row vectorized RMSNorm kernels (8 elements per
// thread and pass, a multiple of 32 in [32, 256]); the fused RMSNorm -> FP8 kernel uses the same,
// so its double sum of squares is added in the same order.
inline int rmsnorm_row_threads(int64_t D) {
  const int64_t t = (D / 8 + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : t > 256 ? 256 : t);
}

// q = n / d and n - q d for a non-negative n and a positive d: in 32 bits when both fit (a 64-bit
// division is a ~70-instruction subroutine, which bounded the element-wise FP8 producers that
// divide a thread index by the blocks per row), else in 64.
__device__ __forceinline__ void divmod_index(int64_t n, int64_t d, int64_t& q, int64_t& r) {
  if (n <= 0x7fffffff && d <= 0x7fffffff) {
    const uint32_t qq = static_cast<uint32_t>(n) / static_cast<uint32_t>(d);
    q = qq;
    r = n - static_cast<int64_t>(qq) * d;
  } else {
    q = n / d;
    r = n - q * d;
  }
}

// Host: whether tensors of n elements at these addresses can take the load8/store8 kernels.
inline bool vec8_ok(int64_t n, std::initializer_list<const void*> ptrs) {
  if (n % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum / max over a block of blockDim.x threads (a multiple of 32, at most 1024). `shared` holds
// 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nw ? shared[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ double block_sum_d(double v, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum_d(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nw ? shared[lane] : 0.0;
  return warp_sum_d(v);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nw ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// Multi-tensor launches (the optimizer step, the weight copies): tensor t of a launch owns the
// CTAs [start[t], start[t + 1]); the tensor of CTA b, by binary search over the count entries.
__device__ __forceinline__ int multi_tensor_of(const int* start, int count, int b) {
  int lo = 0, hi = count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (start[mid] <= b) lo = mid;
    else hi = mid;
  }
  return lo;
}

// The tensor-core primitives the attention kernels share (flash_attention.cu, paged_attention.cu,
// mla_decode.cu; their host emulations shim them under each kernel's own wrapper names).
// d += A B, mma.sync m16n8k16, FP32 accumulate, operands in the PTX fragment layouts (g = lane / 4,
// c = lane % 4): d {rows g, g + 8 x columns 2c, 2c + 1}, A {a0..a3}, B {b0, b1}. F16: FP16 inputs,
// else BF16.
template <bool F16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// ldmatrix .x4 (Trans: .trans) from shared memory: lane l gives the address of row l % 8 of 8x8
// matrix l / 8; r[j] is this lane's 32-bit piece of matrix j (row g, columns 2c, 2c + 1; .trans:
// rows 2c, 2c + 1 of column g).
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
}

inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535LL * 16) {
  int64_t g = (n + threads - 1) / threads;
  if (g < 1) g = 1;
  return static_cast<unsigned>(g < cap ? g : cap);
}

// The two E4M3 codes in the low (lo) or high (hi) half of w as an FP16 pair, the lower byte in
// the low half: exact (every E4M3 value is an FP16 value), one cvt.rn.f16x2.e4m3x2 on sm_90. The
// paged and MLA decode kernels read E4M3 KV rows through it.
__device__ __forceinline__ uint32_t e4m3x2_lo_f16x2(uint32_t w) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(w));
  return r;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_f16x2(uint32_t w) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(w));
  return r;
}
// Byte i of the result = byte (sel >> 4 i) & 7 of the pair b:a (prmt without the sign mode);
// named so that the host emulations (tests/cuda/flash_emu/emu.h) can stand in for it.
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) { return __byte_perm(a, b, sel); }

}  // namespace fp8rl::cuda

// Runs the body with `T` = float or bf16 according to a DType (F32/BF16 only).
#define FP8RL_DISPATCH_FLOAT(dtype, what, ...)                                               \
  do {                                                                                       \
    if ((dtype) == ::fp8rl::DType::F32) {                                                    \
      using T = float;                                                                       \
      __VA_ARGS__;                                                                           \
    } else if ((dtype) == ::fp8rl::DType::BF16) {                                            \
      using T = ::fp8rl::cuda::bf16;                                                         \
      __VA_ARGS__;                                                                           \
    } else {                                                                                 \
      FP8RL_FAIL(what, ": the CUDA backend supports F32 and BF16 here, got ",                \
                 ::fp8rl::dtype_name(dtype));                                                \
    }                                                                                        \
  } while (0)
