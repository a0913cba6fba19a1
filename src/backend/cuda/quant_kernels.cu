// Block-scaled E4M3 quantization on the GPU, bit-exact with quant/quant.cpp:
//   s = fp8_scale_from_amax(amax, pow2) and q = fp8_e4m3_encode(x / s), quant/fp8_rule.h's
//   (the quotients by its Fp8Divisor, which E4M3 encodes as the IEEE division's).
// Non-finite input raises a device flag that the host checks after the launch (an error,
// never quantized). Also here: dequantization and the cuBLASLt scale-layout kernels.
// Two families: element-wise kernels (any shape) and vectorized ones (16-byte loads, 8- or
// 16-byte stores, warp-shuffle / register-tile amax) for rows of whole 16-byte chunks; the
// parity tests run both (odd widths take the first) against quant/quant.cpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/quant.cuh"
#include "quant/quant.h"

namespace fp8rl::cuda {

// ---- fast path: 1 x 128 blocks along the last dim, no transpose -------------------------------
// One warp per (row, 128-column block); each lane holds 4 consecutive elements.
template <class T>
__global__ void quant_rows_1x128_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, bool pow2,
                                        uint8_t* __restrict__ q, float* __restrict__ scales, bool gemm_layout,
                                        int* bad) {
  const int64_t nb = (cols + 127) / 128;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= rows * nb) return;
  int64_t r, b;
  divmod_index(warp, nb, r, b);
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
  const float s = fp8_scale_from_amax(amax, pow2);
  if (lane == 0) scales[gemm_layout ? b * rows + r : r * nb + b] = s;
  float qv[4];
  Fp8Divisor(s).quotients<4>(v, qv);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = c0 + i;
    if (c < cols) q[r * cols + c] = fp8_e4m3_encode(qv[i]);
  }
}

// ---- general path: a 128 x 128 tile of the logical (possibly transposed) tensor per block ----
// L = transpose ? x^T : x, shape [R, C]. Blocks are 1 x 128 (block_rows == 1) or 128 x 128.
// kb_major (1 x 128 blocks): the scales written [ceil(C/128)][R] instead of [R][ceil(C/128)].
constexpr int kTile = 128;
constexpr int kTileThreads = 256;

template <class T>
__global__ void quant_tile_kernel(const T* __restrict__ x, int64_t R, int64_t C, bool transpose,
                                  int block_rows, bool pow2, uint8_t* __restrict__ q, int64_t ldq,
                                  float* __restrict__ scales, bool kb_major, int* bad) {
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
      const float s = fp8_scale_from_amax(m, pow2);
      if (lane == 0) {
        row_scale[a] = s;
        if (r0 + a < R) scales[kb_major ? blockIdx.x * R + r0 + a : (r0 + a) * ncb + blockIdx.x] = s;
      }
    }
  } else {
    float m = 0.0f;
    for (int i = t; i < kTile * kTile; i += kTileThreads) m = fmaxf(m, fabsf(tile[(i / kTile) * (kTile + 1) + i % kTile]));
    m = block_max(m, red);
    const float s = fp8_scale_from_amax(m, pow2);
    if (t < kTile) row_scale[t] = s;
    if (t == 0) scales[static_cast<int64_t>(blockIdx.y) * ncb + blockIdx.x] = s;
  }
  __syncthreads();
  for (int i = t; i < kTile * kTile; i += kTileThreads) {
    const int a = i / kTile, b = i % kTile;
    const int64_t r = r0 + a, c = c0 + b;
    // Columns [C, ldq) of the padded layout hold zeros (the tile is zero there).
    if (r < R && c < ldq) q[r * ldq + c] = fp8_e4m3_encode(tile[a * (kTile + 1) + b] / row_scale[a]);
  }
}

// ---- vectorized paths (16-byte loads; taken when x's last dim is a multiple of 8 and the
// pointers are 16-byte aligned). Same arithmetic as above, element for element: bit-exact.

// ---- emulated: begin (row quantizer)
// 1 x 128 along the last dim: quant.cuh's row blocks (8 threads per (row, 128-column block), two
// chunks of 8 elements each).
template <class T>
__global__ void quant_rows_vec_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, bool pow2,
                                      uint8_t* __restrict__ q, float* __restrict__ scales, bool gemm_layout,
                                      int* bad) {
  RowBlock h;
  if (!row_block(rows, cols, h)) return;
  float v[16] = {};
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (!h.in[k]) continue;
    load8(x + h.r * cols + h.col[k], v + 8 * k);
    stored_amax8(v + 8 * k, amax, finite);
  }
  if (!finite) atomicExch(bad, 1);
  row_block_quantize(h, v, amax, rows, cols, pow2, q, scales, gemm_layout);
}
// ---- emulated: end (row quantizer)

// 128 x 128 blocks, no transpose: one 256-thread block per tile, the tile held in registers
// (8 chunks of 8 per thread), one block-wide amax, then 8-byte stores.
template <class T>
__global__ void quant_blk_vec_kernel(const T* __restrict__ x, int64_t R, int64_t C, bool pow2,
                                     uint8_t* __restrict__ q, float* __restrict__ scales, int* bad) {
  __shared__ float red[32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 128, c0 = static_cast<int64_t>(blockIdx.x) * 128;
  float v[8][8];
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int k = threadIdx.x + 256 * j;  // chunk k: tile row k / 16, columns (k % 16) * 8 ..
    const int64_t r = r0 + k / 16, c = c0 + (k % 16) * 8;
    if (r < R && c < C) {
      load8(x + r * C + c, v[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        finite &= isfinite(v[j][i]);
        amax = fmaxf(amax, fabsf(v[j][i]));
      }
    }
  }
  if (!finite) atomicExch(bad, 1);
  amax = block_max(amax, red);
  const float s = fp8_scale_from_amax(amax, pow2);
  if (threadIdx.x == 0) scales[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = s;
  const Fp8Divisor div(s);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int k = threadIdx.x + 256 * j;
    const int64_t r = r0 + k / 16, c = c0 + (k % 16) * 8;
    if (r < R && c < C) *reinterpret_cast<uint2*>(q + r * C + c) = encode8(v[j], div);
  }
}

// Transposed (L = x^T, x [C, R]), 1 x 128 or 128 x 128 blocks: a 128 x 128 tile of x staged in
// shared memory as F32 (row stride 132: float4-aligned rows, conflict-free column reads), then
// each thread encodes 16 consecutive elements of one L row and stores them as 16 bytes.
constexpr int kVecTileLd = 132;
// Row rr of the transpose of a tile staged as [128][kVecTileLd]: this thread's chunks of 16
// columns ch = half + 2 j (j < 4), at columns c0 + ch * 16 of `row` (ld bytes wide; nothing is
// written past ld), encoded with scale div.scale(); 16-byte stores where aligned and whole.
__device__ __forceinline__ void encode_staged_row_t(const float* tile_t, int rr, int half, const Fp8Divisor& div,
                                                    uint8_t* row,
                                                    int64_t c0, int64_t ld) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int ch = half + 2 * j;
    const int64_t c = c0 + ch * 16;
    if (c >= ld) break;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = tile_t[(ch * 16 + i) * kVecTileLd + rr];
    uint8_t* dst = row + c;
    if (c + 16 <= ld && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      const uint2 lo = encode8(v, div), hi = encode8(v + 8, div);
      *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else {
      for (int i = 0; i < 16 && c + i < ld; ++i) dst[i] = fp8_e4m3_encode(div(v[i]));
    }
  }
}
// kb_major (1 x 128 blocks): the scales written [ceil(C/128)][R] instead of [R][ceil(C/128)].
template <class T>
__global__ void quant_tile_t_vec_kernel(const T* __restrict__ x, int64_t R, int64_t C, int block_rows, bool pow2,
                                        uint8_t* __restrict__ q, int64_t ldq, float* __restrict__ scales,
                                        bool kb_major, int* bad) {
  extern __shared__ float tile_t[];  // [128 (c)][kVecTileLd (r)]
  __shared__ float red[32];
  __shared__ float part[2][128];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 128, c0 = static_cast<int64_t>(blockIdx.x) * 128;
  const int t = threadIdx.x;
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int k = t + 256 * j;  // chunk k: tile row (x row) k / 16, x columns (k % 16) * 8 ..
    const int a = k / 16, b = (k % 16) * 8;
    const int64_t c = c0 + a, r = r0 + b;
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (c < C && r < R) {
      load8(x + c * R + r, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        finite &= isfinite(v[i]);
        amax = fmaxf(amax, fabsf(v[i]));
      }
    }
    float4* dst = reinterpret_cast<float4*>(tile_t + a * kVecTileLd + b);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  if (!finite) atomicExch(bad, 1);
  // Thread t encodes L row rr = t % 128, chunks of 16 columns ch = t / 128 + 2 j (j < 4).
  const int rr = t % 128, half = t / 128;
  const int64_t ncb = (C + 127) / 128;
  float s;
  if (block_rows == 1) {
    __syncthreads();
    float m = 0.0f;
    for (int a = half * 64; a < half * 64 + 64; ++a) m = fmaxf(m, fabsf(tile_t[a * kVecTileLd + rr]));
    part[half][rr] = m;
    __syncthreads();
    s = fp8_scale_from_amax(fmaxf(part[0][rr], part[1][rr]), pow2);
    if (half == 0 && r0 + rr < R) scales[kb_major ? blockIdx.x * R + r0 + rr : (r0 + rr) * ncb + blockIdx.x] = s;
  } else {
    amax = block_max(amax, red);  // synchronizes: the tile is complete
    s = fp8_scale_from_amax(amax, pow2);
    if (t == 0) scales[static_cast<int64_t>(blockIdx.y) * ncb + blockIdx.x] = s;
  }
  const int64_t r = r0 + rr;
  if (r >= R) return;
  // Columns [C, ldq) of a padded layout get zeros (the tile is zero there).
  encode_staged_row_t(tile_t, rr, half, Fp8Divisor(s), q + r * ldq, c0, ldq);
}

void launch_quantize(const void* x, DType x_dtype, int64_t x_rows, int64_t x_cols, bool transpose,
                     int block_rows, int block_cols, bool pow2, uint8_t* q, float* scales, int* bad_flag,
                     cudaStream_t stream, int64_t q_ld, bool gemm_layout) {
  FP8RL_CHECK(block_cols == kQuantBlock && (block_rows == 1 || block_rows == kQuantBlock),
              "the CUDA quantizer supports 1x128 and 128x128 blocks, got ", block_rows, "x", block_cols);
  if (x_rows == 0 || x_cols == 0) return;
  const int64_t R = transpose ? x_cols : x_rows, C = transpose ? x_rows : x_cols;
  const int64_t ldq = q_ld == 0 ? C : q_ld;
  FP8RL_CHECK(ldq == C || (transpose && ldq > C && ldq <= ceil_div(C, kQuantBlock) * kQuantBlock),
              "quantize: a padded row stride (", ldq, " for ", C, " columns) is supported for transposed outputs, ",
              "up to the next multiple of 128");
  FP8RL_CHECK(!gemm_layout || block_rows == 1, "quantize: scales in cuBLASLt's VEC128 layout ([ceil(C/128)][R]) ",
              "are for 1x128 blocks");
  // The vectorized kernels need x's rows to be whole 16-byte chunks (last dim % 8) and aligned
  // pointers; anything else takes the element-wise kernels (same results).
  const bool vec = x_cols % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(q) & 15) == 0;
  FP8RL_DISPATCH_FLOAT(x_dtype, "quantize", {
    const T* xp = static_cast<const T*>(x);
    if (vec && !transpose && block_rows == 1) {
      const int64_t threads_total = row_block_threads(R, C);
      quant_rows_vec_kernel<T><<<static_cast<unsigned>(ceil_div(threads_total, 256)), 256, 0, stream>>>(
          xp, R, C, pow2, q, scales, gemm_layout, bad_flag);
      CUDA_CHECK_LAUNCH("quant_rows_vec_kernel");
    } else if (vec && !transpose) {
      dim3 grid(static_cast<unsigned>(ceil_div(C, kTile)), static_cast<unsigned>(ceil_div(R, kTile)));
      quant_blk_vec_kernel<T><<<grid, 256, 0, stream>>>(xp, R, C, pow2, q, scales, bad_flag);
      CUDA_CHECK_LAUNCH("quant_blk_vec_kernel");
    } else if (vec) {
      const size_t smem = kTile * kVecTileLd * sizeof(float);
      static bool attr_set_t = false;  // one device per process in this pass
      if (!attr_set_t) {
        CUDA_CHECK(cudaFuncSetAttribute(quant_tile_t_vec_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)), "raising the quantizer's shared memory limit");
        CUDA_CHECK(cudaFuncSetAttribute(quant_tile_t_vec_kernel<bf16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)), "raising the quantizer's shared memory limit");
        attr_set_t = true;
      }
      dim3 grid(static_cast<unsigned>(ceil_div(C, kTile)), static_cast<unsigned>(ceil_div(R, kTile)));
      quant_tile_t_vec_kernel<T><<<grid, 256, smem, stream>>>(xp, R, C, block_rows, pow2, q, ldq, scales,
                                                                gemm_layout, bad_flag);
      CUDA_CHECK_LAUNCH("quant_tile_t_vec_kernel");
    } else if (!transpose && block_rows == 1) {
      const int64_t warps = R * ceil_div(C, 128);
      const int threads = 256;
      quant_rows_1x128_kernel<T><<<static_cast<unsigned>(ceil_div(warps * 32, threads)), threads, 0, stream>>>(
          xp, R, C, pow2, q, scales, gemm_layout, bad_flag);
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
                                                                 ldq, scales, gemm_layout, bad_flag);
      CUDA_CHECK_LAUNCH("quant_tile_kernel");
    }
  });
}

// ---- the trainer's weight copies: W and W^T from one read, many weights per launch -------------
// CTA = one 128 x 128 tile of one weight w [N, K]. The tile is loaded as quant_blk_vec_kernel
// loads it (8 chunks of 8 per thread), its amax is the block's for q and for qt alike (the same
// elements), the codes go to q as quant_blk_vec_kernel writes them, and through shared memory
// (staged as quant_tile_t_vec_kernel stages it) to qt as that kernel writes them: bitwise both.
constexpr int kWeightQuantMax = 48;  // weights per launch (the parameters stay < 4 KB)
struct WeightQuantLaunch {
  int count;
  int tile_start[kWeightQuantMax + 1];  // CTA range of weight j: [tile_start[j], tile_start[j + 1])
  const void* w[kWeightQuantMax];
  int N[kWeightQuantMax], K[kWeightQuantMax];
  uint8_t* q[kWeightQuantMax];
  float* qs[kWeightQuantMax];
  uint8_t* qt[kWeightQuantMax];
  float* qts[kWeightQuantMax];
};

template <class T>
__global__ void __launch_bounds__(256) quant_weights_kernel(const __grid_constant__ WeightQuantLaunch L, bool pow2,
                                                            int* bad) {
  extern __shared__ float tile_t[];  // [128 (w row)][kVecTileLd (w column)]
  __shared__ float red[32];
  const int j = multi_tensor_of(L.tile_start, L.count, static_cast<int>(blockIdx.x));
  const int64_t R = L.N[j], C = L.K[j];  // w [R, C]
  const int64_t ncb = (C + 127) / 128, nrb = (R + 127) / 128;
  const int64_t tile = blockIdx.x - L.tile_start[j], by = tile / ncb, bx = tile % ncb;
  const int64_t r0 = by * 128, c0 = bx * 128;
  const T* x = static_cast<const T*>(L.w[j]);
  uint8_t* qt = L.qt[j];
  const int t = threadIdx.x;
  float v[8][8];
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int k = t + 256 * jj;  // chunk k: tile row k / 16, columns (k % 16) * 8 ..
    const int a = k / 16, b = (k % 16) * 8;
    const int64_t r = r0 + a, c = c0 + b;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[jj][i] = 0.0f;
    if (r < R && c < C) {
      load8(x + r * C + c, v[jj]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        finite &= isfinite(v[jj][i]);
        amax = fmaxf(amax, fabsf(v[jj][i]));
      }
    }
    if (qt) {
      float4* dst = reinterpret_cast<float4*>(tile_t + a * kVecTileLd + b);
      dst[0] = make_float4(v[jj][0], v[jj][1], v[jj][2], v[jj][3]);
      dst[1] = make_float4(v[jj][4], v[jj][5], v[jj][6], v[jj][7]);
    }
  }
  if (!finite) atomicExch(bad, 1);
  amax = block_max(amax, red);  // synchronizes: the staged tile is complete
  const float s = fp8_scale_from_amax(amax, pow2);
  const Fp8Divisor div(s);
  if (t == 0) {
    L.qs[j][by * ncb + bx] = s;
    if (qt) L.qts[j][bx * nrb + by] = s;
  }
  uint8_t* q = L.q[j];
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int k = t + 256 * jj;
    const int64_t r = r0 + k / 16, c = c0 + (k % 16) * 8;
    if (r < R && c < C) *reinterpret_cast<uint2*>(q + r * C + c) = encode8(v[jj], div);
  }
  if (!qt) return;
  // qt [C, R]: thread t encodes its row cc = t % 128 (a column of w), chunks of 16 columns (rows
  // of w) ch = t / 128 + 2 i, as quant_tile_t_vec_kernel with block_rows 128.
  const int cc = t % 128, half = t / 128;
  const int64_t orow = c0 + cc;
  if (orow >= C) return;
  encode_staged_row_t(tile_t, cc, half, div, qt + orow * R, r0, R);
}

void launch_quantize_weights(const std::vector<WeightQuantTensor>& ws, DType w_dtype, bool pow2, int* bad_flag,
                             cudaStream_t stream) {
  const size_t smem = kTile * kVecTileLd * sizeof(float);
  static bool attr_set = false;  // one device per process in this pass
  if (!attr_set) {
    CUDA_CHECK(cudaFuncSetAttribute(quant_weights_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)), "raising the weight quantizer's shared memory limit");
    CUDA_CHECK(cudaFuncSetAttribute(quant_weights_kernel<bf16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)), "raising the weight quantizer's shared memory limit");
    attr_set = true;
  }
  for (size_t first = 0; first < ws.size();) {
    WeightQuantLaunch L{};
    int64_t ctas = 0;
    bool any_t = false;
    size_t i = first;
    for (; i < ws.size() && L.count < kWeightQuantMax; ++i) {
      const WeightQuantTensor& a = ws[i];
      FP8RL_CHECK(a.K % 8 == 0 && (reinterpret_cast<uintptr_t>(a.w) & 15) == 0 &&
                      (reinterpret_cast<uintptr_t>(a.q) & 15) == 0 && a.N < (1LL << 31) && a.K < (1LL << 31),
                  "launch_quantize_weights: weight rows must be whole, aligned 16-byte chunks");
      if (a.N == 0 || a.K == 0) continue;
      const int64_t tiles = ceil_div(a.N, kTile) * ceil_div(a.K, kTile);
      if (L.count > 0 && ctas + tiles > (1LL << 30)) break;
      const int k = L.count++;
      L.tile_start[k] = static_cast<int>(ctas);
      L.w[k] = a.w, L.N[k] = static_cast<int>(a.N), L.K[k] = static_cast<int>(a.K);
      L.q[k] = a.q, L.qs[k] = a.qs, L.qt[k] = a.qt, L.qts[k] = a.qts;
      any_t |= a.qt != nullptr;
      ctas += tiles;
    }
    first = i;
    if (L.count == 0) continue;
    L.tile_start[L.count] = static_cast<int>(ctas);
    FP8RL_DISPATCH_FLOAT(w_dtype, "quantize_weights", {
      quant_weights_kernel<T><<<static_cast<unsigned>(ctas), 256, any_t ? smem : 0, stream>>>(L, pow2, bad_flag);
    });
    CUDA_CHECK_LAUNCH("quant_weights_kernel");
  }
}

// ---- dequantize: out[r, c] = q[r, c] * scales[r / br, c / bc] --------------------------------
template <class T>
__global__ void dequant_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t R,
                               int64_t C, int br, int bc, T* __restrict__ out) {
  const int64_t ncb = (C + bc - 1) / bc;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    store_f(out, i, fp8_e4m3_decode(q[i]) * scales[(r / br) * ncb + c / bc]);
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

// ---- exact transpose of a square-block quantization ---------------------------------------------
// q [R, C] -> qt [C, R] (bytes), scales [ceil(R/b), ceil(C/b)] -> [ceil(C/b), ceil(R/b)]: the
// quantization of x^T with b x b blocks is this (same blocks, same amax, same codes).
constexpr int kTransTile = 32;
__global__ void transpose_u8_kernel(const uint8_t* __restrict__ q, int64_t R, int64_t C, uint8_t* __restrict__ qt) {
  __shared__ uint8_t tile[kTransTile][kTransTile + 4];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTransTile, c0 = static_cast<int64_t>(blockIdx.x) * kTransTile;
  for (int i = threadIdx.y; i < kTransTile; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[i][threadIdx.x] = q[r * C + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTransTile; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;  // qt[c, r] = q[r, c]
    if (r < R && c < C) qt[c * R + r] = tile[threadIdx.x][i];
  }
}
__global__ void transpose_f32_kernel(const float* __restrict__ s, int64_t R, int64_t C, float* __restrict__ st) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i / R, r = i % R;  // st[c, r] = s[r, c]
    st[i] = s[r * C + c];
  }
}

void launch_transpose_quant(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, int block,
                            uint8_t* qt, float* scales_t, cudaStream_t stream) {
  if (rows * cols == 0) return;
  FP8RL_CHECK(ceil_div(rows, kTransTile) <= 65535, "transpose_quant: ", rows, " rows exceed the grid");
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kTransTile)), static_cast<unsigned>(ceil_div(rows, kTransTile)));
  transpose_u8_kernel<<<grid, dim3(kTransTile, 8), 0, stream>>>(q, rows, cols, qt);
  CUDA_CHECK_LAUNCH("transpose_u8_kernel");
  const int64_t sr = ceil_div(rows, block), sc = ceil_div(cols, block);
  transpose_f32_kernel<<<grid_for(sr * sc, 256), 256, 0, stream>>>(scales, sr, sc, scales_t);
  CUDA_CHECK_LAUNCH("transpose_f32_kernel");
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
