// Block-scaled E4M3 quantization on the GPU, bit-exact with quant/quant.cpp:
//   s = amax / 448 (IEEE division; nvcc's default -prec-div=true, no fast-math), amax 0 -> 1,
//   pow2: s rounded *up* to a power of two by exponent manipulation;
//   q = __nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, __NV_E4M3)  (RNE, saturate to +-448).
// Non-finite input raises a device flag that the host checks after the launch (an error,
// never quantized). Also here: dequantization and the cuBLASLt scale-layout kernels.
#include <cuda_fp8.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "quant/quant.h"

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

// ---- fast path: 1 x 128 blocks along the last dim, no transpose -------------------------------
// One warp per (row, 128-column block); each lane holds 4 consecutive elements.
template <class T>
__global__ void quant_rows_1x128_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, bool pow2,
                                        uint8_t* __restrict__ q, float* __restrict__ scales, int* bad) {
  const int64_t nb = (cols + 127) / 128;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= rows * nb) return;
  const int64_t r = warp / nb, b = warp % nb;
  const int64_t c0 = b * 128 + lane * 4;
  float v[4];
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = c0 + i;
    v[i] = c < cols ? load_f(x, r * cols + c) : 0.0f;
    finite &= isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  if (!finite) atomicExch(bad, 1);
  amax = warp_max(amax);
  const float s = quant_scale(amax, pow2);
  if (lane == 0) scales[r * nb + b] = s;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = c0 + i;
    if (c < cols) q[r * cols + c] = e4m3_encode(v[i] / s);
  }
}

// ---- general path: a 128 x 128 tile of the logical (possibly transposed) tensor per block ----
// L = transpose ? x^T : x, shape [R, C]. Blocks are 1 x 128 (block_rows == 1) or 128 x 128.
constexpr int kTile = 128;
constexpr int kTileThreads = 256;

template <class T>
__global__ void quant_tile_kernel(const T* __restrict__ x, int64_t R, int64_t C, bool transpose,
                                  int block_rows, bool pow2, uint8_t* __restrict__ q,
                                  float* __restrict__ scales, int* bad) {
  extern __shared__ float tile[];  // [kTile][kTile + 1]
  __shared__ float row_scale[kTile];
  __shared__ float red[32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int t = threadIdx.x;
  bool finite = true;
  // Load, coalesced along x's last dim. x is [R, C] (no transpose) or [C, R] (transpose).
  for (int i = t; i < kTile * kTile; i += kTileThreads) {
    const int a = i / kTile, b = i % kTile;  // b runs along x's last dim
    float v = 0.0f;
    if (!transpose) {
      const int64_t r = r0 + a, c = c0 + b;
      if (r < R && c < C) v = load_f(x, r * C + c);
      finite &= isfinite(v);
      tile[a * (kTile + 1) + b] = v;
    } else {
      const int64_t c = c0 + a, r = r0 + b;  // x[c][r] = L[r][c]
      if (r < R && c < C) v = load_f(x, c * R + r);
      finite &= isfinite(v);
      tile[b * (kTile + 1) + a] = v;
    }
  }
  if (!finite) atomicExch(bad, 1);
  __syncthreads();
  const int64_t ncb = (C + kTile - 1) / kTile;
  if (block_rows == 1) {
    const int warp = t >> 5, lane = t & 31;
    for (int a = warp; a < kTile; a += kTileThreads / 32) {
      float m = 0.0f;
      for (int b = lane; b < kTile; b += 32) m = fmaxf(m, fabsf(tile[a * (kTile + 1) + b]));
      m = warp_max(m);
      const float s = quant_scale(m, pow2);
      if (lane == 0) {
        row_scale[a] = s;
        if (r0 + a < R) scales[(r0 + a) * ncb + blockIdx.x] = s;
      }
    }
  } else {
    float m = 0.0f;
    for (int i = t; i < kTile * kTile; i += kTileThreads) m = fmaxf(m, fabsf(tile[(i / kTile) * (kTile + 1) + i % kTile]));
    m = block_max(m, red);
    const float s = quant_scale(m, pow2);
    if (t < kTile) row_scale[t] = s;
    if (t == 0) scales[static_cast<int64_t>(blockIdx.y) * ncb + blockIdx.x] = s;
  }
  __syncthreads();
  for (int i = t; i < kTile * kTile; i += kTileThreads) {
    const int a = i / kTile, b = i % kTile;
    const int64_t r = r0 + a, c = c0 + b;
    if (r < R && c < C) q[r * C + c] = e4m3_encode(tile[a * (kTile + 1) + b] / row_scale[a]);
  }
}

void launch_quantize(const void* x, DType x_dtype, int64_t x_rows, int64_t x_cols, bool transpose,
                     int block_rows, int block_cols, bool pow2, uint8_t* q, float* scales, int* bad_flag,
                     cudaStream_t stream) {
  FP8RL_CHECK(block_cols == kQuantBlock && (block_rows == 1 || block_rows == kQuantBlock),
              "the CUDA quantizer supports 1x128 and 128x128 blocks, got ", block_rows, "x", block_cols);
  if (x_rows == 0 || x_cols == 0) return;
  const int64_t R = transpose ? x_cols : x_rows, C = transpose ? x_rows : x_cols;
  FP8RL_DISPATCH_FLOAT(x_dtype, "quantize", {
    const T* xp = static_cast<const T*>(x);
    if (!transpose && block_rows == 1) {
      const int64_t warps = R * ceil_div(C, 128);
      const int threads = 256;
      quant_rows_1x128_kernel<T><<<static_cast<unsigned>(ceil_div(warps * 32, threads)), threads, 0, stream>>>(
          xp, R, C, pow2, q, scales, bad_flag);
      CUDA_CHECK_LAUNCH("quant_rows_1x128_kernel");
    } else {
      const size_t smem = kTile * (kTile + 1) * sizeof(float);
      static bool attr_set = false;  // one device per process in this pass
      if (!attr_set) {
        CUDA_CHECK(cudaFuncSetAttribute(quant_tile_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)), "raising the quantizer's shared memory limit");
        CUDA_CHECK(cudaFuncSetAttribute(quant_tile_kernel<bf16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)), "raising the quantizer's shared memory limit");
        attr_set = true;
      }
      dim3 grid(static_cast<unsigned>(ceil_div(C, kTile)), static_cast<unsigned>(ceil_div(R, kTile)));
      quant_tile_kernel<T><<<grid, kTileThreads, smem, stream>>>(xp, R, C, transpose, block_rows, pow2, q,
                                                                 scales, bad_flag);
      CUDA_CHECK_LAUNCH("quant_tile_kernel");
    }
  });
}

// ---- dequantize: out[r, c] = q[r, c] * scales[r / br, c / bc] --------------------------------
template <class T>
__global__ void dequant_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t R,
                               int64_t C, int br, int bc, T* __restrict__ out) {
  const int64_t ncb = (C + bc - 1) / bc;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    store_f(out, i, e4m3_decode(q[i]) * scales[(r / br) * ncb + c / bc]);
  }
}

void launch_dequantize(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, int block_rows,
                       int block_cols, void* out, DType out_dtype, cudaStream_t stream) {
  if (rows * cols == 0) return;
  FP8RL_DISPATCH_FLOAT(out_dtype, "dequantize", {
    dequant_kernel<T><<<grid_for(rows * cols, 256), 256, 0, stream>>>(q, scales, rows, cols, block_rows,
                                                                       block_cols, static_cast<T*>(out));
    CUDA_CHECK_LAUNCH("dequant_kernel");
  });
}

// ---- cuBLASLt scale layouts (see gemm.h) -------------------------------------------------------
// VEC128: row-major [rows, nb] -> [nb][ld] (ld >= rows; padding 1).
__global__ void scales_vec128_kernel(const float* __restrict__ s, int64_t rows, int64_t nb, int64_t ld,
                                     float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nb * ld;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / ld, r = i % ld;
    out[i] = r < rows ? s[r * nb + b] : 1.0f;
  }
}
// BLK128x128: row-major [rb, cb] -> [rb][ld] (ld >= cb; padding 1).
__global__ void scales_blk_kernel(const float* __restrict__ s, int64_t rb, int64_t cb, int64_t ld,
                                  float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rb * ld;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / ld, c = i % ld;
    out[i] = c < cb ? s[r * cb + c] : 1.0f;
  }
}

void launch_scales_vec128(const float* s, int64_t rows, int64_t nb, int64_t ld, float* out, cudaStream_t stream) {
  scales_vec128_kernel<<<grid_for(nb * ld, 256), 256, 0, stream>>>(s, rows, nb, ld, out);
  CUDA_CHECK_LAUNCH("scales_vec128_kernel");
}
void launch_scales_blk(const float* s, int64_t rb, int64_t cb, int64_t ld, float* out, cudaStream_t stream) {
  scales_blk_kernel<<<grid_for(rb * ld, 256), 256, 0, stream>>>(s, rb, cb, ld, out);
  CUDA_CHECK_LAUNCH("scales_blk_kernel");
}

}  // namespace fp8rl::cuda
