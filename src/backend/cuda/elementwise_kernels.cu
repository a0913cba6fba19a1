// Element-wise kernels and reductions: fill, dtype conversion, add, scale, sum of squares,
// non-finite detection, bias add and bias gradient. Grid-stride loops; FP32 math.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "quant/quant.h"

namespace fp8rl::cuda {

namespace {

#define GRID_STRIDE(i, n)                                                                          \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Element access for every float dtype the backend stores (code 0 F32, 1 BF16, 2 F16).
__device__ __forceinline__ float load_any(const void* p, int t, int64_t i) {
  if (t == 0) return static_cast<const float*>(p)[i];
  if (t == 1) return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}
__device__ __forceinline__ void store_any(void* p, int t, int64_t i, float v) {
  if (t == 0) {
    static_cast<float*>(p)[i] = v;
  } else if (t == 1) {
    static_cast<uint16_t*>(p)[i] = bf16_bits_from_float(v);
  } else {
    uint16_t h;
    if (isnan(v)) {
      h = static_cast<uint16_t>(((__float_as_uint(v) >> 16) & 0x8000u) | 0x7e00u);
    } else {
      __half hv = __float2half_rn(v);
      h = *reinterpret_cast<uint16_t*>(&hv);
    }
    static_cast<uint16_t*>(p)[i] = h;
  }
}
int code(DType t) {
  switch (t) {
    case DType::F32: return 0;
    case DType::BF16: return 1;
    case DType::F16: return 2;
    default: FP8RL_FAIL("expected a float dtype (F32, BF16, F16), got ", dtype_name(t));
  }
}

__global__ void fill_kernel(void* p, int t, int64_t n, float v) {
  GRID_STRIDE(i, n) store_any(p, t, i, v);
}
__global__ void fill_i32_kernel(int32_t* p, int64_t n, int32_t v) {
  GRID_STRIDE(i, n) p[i] = v;
}
__global__ void convert_kernel(const void* s, int st, void* d, int dt, int64_t n) {
  GRID_STRIDE(i, n) store_any(d, dt, i, load_any(s, st, i));
}
__global__ void add_kernel(const void* a, int at, const void* b, int bt, void* o, int ot, int64_t n) {
  GRID_STRIDE(i, n) store_any(o, ot, i, load_any(a, at, i) + load_any(b, bt, i));
}
// F32 <-> BF16, 8 elements per access (vec8_ok): the same per-element rounding as convert_kernel.
template <class S, class D>
__global__ void convert_vec_kernel(const S* s, D* d, int64_t n8) {
  GRID_STRIDE(i, n8) {
    float x[8];
    load8(s + 8 * i, x);
    store8(d + 8 * i, x);
  }
}
// F32 -> BF16 over many tensors per launch (each n % 8 == 0, 16-byte aligned): a CTA converts
// a chunk of one tensor, 8 elements per access, each as convert_vec_kernel rounds it.
constexpr int kConvertMax = 128;
constexpr int64_t kConvertChunk = 256 * 8 * 4;
// The tensor and the element range [begin, end) of this CTA in a multi-tensor launch
// (launch_multi_tensor below: a CTA per kConvertChunk elements of one tensor).
struct TensorChunk {
  int t;
  int64_t begin, end;
};
template <class L>
__device__ __forceinline__ TensorChunk tensor_chunk(const L& launch) {
  const int t = multi_tensor_of(launch.chunk_start, launch.count, static_cast<int>(blockIdx.x));
  const int64_t begin = static_cast<int64_t>(blockIdx.x - launch.chunk_start[t]) * kConvertChunk;
  return {t, begin, min(launch.n[t], begin + kConvertChunk)};
}
struct ConvertLaunch {
  int count;
  int chunk_start[kConvertMax + 1];
  const float* src[kConvertMax];
  bf16* dst[kConvertMax];
  int64_t n[kConvertMax];
};
__global__ void __launch_bounds__(256) convert_many_kernel(const __grid_constant__ ConvertLaunch L) {
  const TensorChunk c = tensor_chunk(L);
  for (int64_t i = c.begin + threadIdx.x * 8; i < c.end; i += 256 * 8) {
    float x[8];
    load8(L.src[c.t] + i, x);
    store8(L.dst[c.t] + i, x);
  }
}
// dst[i] += float(src[i]) (F32 += BF16) over many tensors per launch, chunked as convert_many:
// the F32 gradients' sum of products staged in BF16 (the grouped weight gradient). Tensors that
// are not 16-byte aligned with n % 8 == 0 take one element per access (the same sums).
constexpr int kAccumulateMax = 64;
struct AccumulateLaunch {
  int count;
  int chunk_start[kAccumulateMax + 1];
  const bf16* src[kAccumulateMax];
  float* dst[kAccumulateMax];
  int64_t n[kAccumulateMax];
  bool vec[kAccumulateMax];
};
__global__ void __launch_bounds__(256) accumulate_many_kernel(const __grid_constant__ AccumulateLaunch L) {
  const TensorChunk c = tensor_chunk(L);
  if (L.vec[c.t]) {
    for (int64_t i = c.begin + threadIdx.x * 8; i < c.end; i += 256 * 8) {
      float a[8], d[8];
      load8(L.src[c.t] + i, a);
      load8(L.dst[c.t] + i, d);
#pragma unroll
      for (int k = 0; k < 8; ++k) d[k] += a[k];
      store8(L.dst[c.t] + i, d);
    }
  } else {
    for (int64_t i = c.begin + threadIdx.x; i < c.end; i += 256)
      L.dst[c.t][i] += bf16_bits_to_float(reinterpret_cast<const uint16_t*>(L.src[c.t])[i]);
  }
}
// One dtype throughout, 8 elements per access (vec8_ok): the same per-element sum.
template <class T>
__global__ void add_vec_kernel(const T* a, const T* b, T* o, int64_t n8) {
  GRID_STRIDE(i, n8) {
    float x[8], y[8];
    load8(a + 8 * i, x);
    load8(b + 8 * i, y);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] += y[k];
    store8(o + 8 * i, x);
  }
}
__global__ void scale_kernel(void* x, int t, int64_t n, float s) {
  GRID_STRIDE(i, n) store_any(x, t, i, load_any(x, t, i) * s);
}
// Deterministic sums of squares, many tensors per launch: tensor i is cut into chunks of
// kSumChunk elements, one CTA each (each thread's elements in order, then its warps' sums in warp
// order) into partials[chunk]; then one CTA per tensor adds its chunks' partials in a fixed
// order. No atomics, so a gradient norm is the same double on every run, and a tensor's sum does
// not depend on the tensors launched beside it (sum_squares_total is bitwise the loop).
constexpr int kSumThreads = 256, kSumMaxTensors = 64;
constexpr int64_t kSumChunk = kSumThreads * 32;
__device__ __forceinline__ double block_sum_ordered_d(double v) {
  __shared__ double warps[kSumThreads / 32];
  v = warp_sum_d(v);
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kSumThreads / 32; ++w) s += warps[w];
  return s;  // thread 0's
}
struct SumSquaresLaunch {
  int count;
  int chunk_start[kSumMaxTensors + 1];  // CTA (and partial) range of tensor t
  const void* x[kSumMaxTensors];
  int64_t n[kSumMaxTensors];
  int dtype[kSumMaxTensors];
};
__global__ void __launch_bounds__(kSumThreads) sum_squares_chunks_kernel(const __grid_constant__ SumSquaresLaunch L,
                                                                         double* partials) {
  const int t = multi_tensor_of(L.chunk_start, L.count, static_cast<int>(blockIdx.x));
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.chunk_start[t]) * kSumChunk;
  const int64_t end = min(L.n[t], begin + kSumChunk);
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kSumThreads) {
    const double v = load_any(L.x[t], L.dtype[t], i);
    acc += v * v;
  }
  acc = block_sum_ordered_d(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
__global__ void __launch_bounds__(kSumThreads) sum_partials_kernel(const __grid_constant__ SumSquaresLaunch L,
                                                                   const double* partials, double* out) {
  const int t = blockIdx.x;
  double acc = 0.0;
  for (int i = L.chunk_start[t] + threadIdx.x; i < L.chunk_start[t + 1]; i += kSumThreads) acc += partials[i];
  acc = block_sum_ordered_d(acc);
  if (threadIdx.x == 0) out[t] = acc;
}
// The block's max of m (256 threads), then one atomicMax into *out per block: every warp's atomic
// on the one address had serialized at the L2 (2,048 blocks x 8 warps per call: 22 us per q / k / v
// of an 8k-token micro-batch, against ~5-10 us of reads; docs/benchmarks.md session 19).
__device__ __forceinline__ void amax_block_commit(uint32_t m, uint32_t* out) {
  __shared__ uint32_t w[8];
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) w[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < 8; ++i) m = max(m, w[i]);
    atomicMax(out, m);
  }
}
// max |x| as the bits of a non-negative float (they order like the values; NaN bits exceed +inf's).
// Blocks of 256 threads (amax_block_commit).
__global__ void __launch_bounds__(256) amax_kernel(const void* x, int t, int64_t n, uint32_t* out) {
  uint32_t m = 0;
  GRID_STRIDE(i, n) m = max(m, __float_as_uint(load_any(x, t, i)) & 0x7fffffffu);
  amax_block_commit(m, out);
}
// The same over BF16 x in 16-byte chunks: a BF16 value's bits are its float's top 16, so
// |x|'s float bits are (b & 0x7fff) << 16 — no conversion.
__global__ void __launch_bounds__(256) amax_bf16x8_kernel(const uint4* x, int64_t n8, uint32_t* out) {
  uint32_t m = 0;
  GRID_STRIDE(i, n8) {
    const uint4 v = x[i];
    for (uint32_t w : {v.x, v.y, v.z, v.w}) m = max(m, max((w & 0x7fffu) << 16, w & 0x7fff0000u));
  }
  amax_block_commit(m, out);
}
__global__ void nonfinite_kernel(const void* x, int t, int64_t n, int* flag) {
  bool bad = false;
  GRID_STRIDE(i, n) bad |= !isfinite(load_any(x, t, i));
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) atomicExch(flag, 1);
}
__global__ void add_bias_kernel(void* o, int ot, const void* b, int bt, int64_t rows, int64_t cols) {
  GRID_STRIDE(i, rows * cols) store_any(o, ot, i, load_any(o, ot, i) + load_any(b, bt, i % cols));
}
// Column sums: block (32 x 8) covers 32 columns and chunk blockIdx.y of the rows (every
// gridDim.y-th group of 8); its per-column sum, in a fixed order, goes to out[blockIdx.y][c].
__global__ void bias_grad_kernel(const void* dy, int t, int64_t rows, int64_t cols, float* out) {
  __shared__ float part[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.0f;
  if (c < cols)
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += 8LL * gridDim.y)
      acc += load_any(dy, t, r * cols + c);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) s += part[j][threadIdx.x];
    out[blockIdx.y * cols + c] = s;
  }
}
// out[c] += part[0][c] + part[1][c] + ... (chunk order).
__global__ void add_column_partials_kernel(const float* part, int64_t chunks, int64_t cols, float* out) {
  GRID_STRIDE(c, cols) {
    float s = 0.0f;
    for (int64_t y = 0; y < chunks; ++y) s += part[y * cols + c];
    out[c] += s;
  }
}

// out[c] += the sum of part[0 .. chunks)[c]: thread (x, y) of a (32 x Y) block adds chunks y,
// y + Y, ... of column 32 b + x in order, then row y = 0 adds the Y sums in order.
template <int Y>
__global__ void sum_column_partials_kernel(const float* part, int64_t chunks, int64_t cols, float* out) {
  __shared__ float sy[Y][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.0f;
  if (c < cols) {
#pragma unroll 8
    for (int64_t y = threadIdx.y; y < chunks; y += Y) acc += part[y * cols + c];
  }
  sy[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < Y; ++j) sum += sy[j][threadIdx.x];
    out[c] += sum;
  }
}

}  // namespace

void launch_sum_column_partials(const float* part, int64_t chunks, int64_t cols, float* out, cudaStream_t stream) {
  if (cols == 0) return;
  const unsigned blocks = static_cast<unsigned>(ceil_div(cols, 32));
  if (cols <= 1024)  // few columns: more threads per column
    sum_column_partials_kernel<32><<<blocks, dim3(32, 32), 0, stream>>>(part, chunks, cols, out);
  else
    sum_column_partials_kernel<8><<<blocks, dim3(32, 8), 0, stream>>>(part, chunks, cols, out);
  CUDA_CHECK_LAUNCH("sum_column_partials_kernel");
}

void launch_fill(void* p, DType dtype, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  if (dtype == DType::I32) {
    fill_i32_kernel<<<grid_for(n, 256), 256, 0, stream>>>(static_cast<int32_t*>(p), n, static_cast<int32_t>(value));
  } else if (dtype == DType::E4M3 || dtype == DType::U8) {
    FP8RL_CHECK(value == 0.0f, "fill of ", dtype_name(dtype), " supports only 0");
    CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n), stream), "zero-filling a byte tensor");
    return;
  } else if (value == 0.0f && !std::signbit(value)) {
    // +0 is all zero bits in F32, BF16 and F16: a memset (the per-step gradient zeroing of
    // thousands of expert tensors ran the element kernel at ~10% of HBM bandwidth).
    CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * dtype_size(dtype), stream), "zero-filling a tensor");
    return;
  } else {
    fill_kernel<<<grid_for(n, 256), 256, 0, stream>>>(p, code(dtype), n, value);
  }
  CUDA_CHECK_LAUNCH("fill_kernel");
}

void launch_convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (sdt == DType::F32 && ddt == DType::BF16 && vec8_ok(n, {src, dst}))
    convert_vec_kernel<<<grid_for(n / 8, 256), 256, 0, stream>>>(static_cast<const float*>(src),
                                                                 static_cast<bf16*>(dst), n / 8);
  else if (sdt == DType::BF16 && ddt == DType::F32 && vec8_ok(n, {src, dst}))
    convert_vec_kernel<<<grid_for(n / 8, 256), 256, 0, stream>>>(static_cast<const bf16*>(src),
                                                                 static_cast<float*>(dst), n / 8);
  else
    convert_kernel<<<grid_for(n, 256), 256, 0, stream>>>(src, code(sdt), dst, code(ddt), n);
  CUDA_CHECK_LAUNCH("convert_kernel");
}

namespace {
// Launches kernel over tensors of n[i] elements, as many per launch as the launch struct L holds
// (kMax) and 2^30 CTAs allow: a CTA per kConvertChunk elements of one tensor; set(L, k, i) puts
// tensor i into slot k. Empty tensors are skipped.
template <class L, int kMax, class Set, class Kernel>
void launch_multi_tensor(const std::vector<int64_t>& n, Set set, Kernel kernel, const char* name, cudaStream_t stream) {
  for (size_t first = 0; first < n.size();) {
    L launch{};
    int64_t ctas = 0;
    size_t i = first;
    for (; i < n.size() && launch.count < kMax; ++i) {
      if (n[i] == 0) continue;
      const int64_t c = (n[i] + kConvertChunk - 1) / kConvertChunk;
      if (launch.count > 0 && ctas + c > (1LL << 30)) break;
      const int k = launch.count++;
      launch.chunk_start[k] = static_cast<int>(ctas);
      launch.n[k] = n[i];
      set(launch, k, i);
      ctas += c;
    }
    first = i;
    if (launch.count == 0) continue;
    launch.chunk_start[launch.count] = static_cast<int>(ctas);
    kernel<<<static_cast<unsigned>(ctas), 256, 0, stream>>>(launch);
    CUDA_CHECK_LAUNCH(name);
  }
}
}  // namespace

void launch_convert_many_f32_bf16(const std::vector<const float*>& src, const std::vector<void*>& dst,
                                  const std::vector<int64_t>& n, cudaStream_t stream) {
  launch_multi_tensor<ConvertLaunch, kConvertMax>(
      n, [&](ConvertLaunch& L, int k, size_t i) { L.src[k] = src[i], L.dst[k] = static_cast<bf16*>(dst[i]); },
      convert_many_kernel, "convert_many_kernel", stream);
}

void launch_accumulate_many_bf16_f32(const std::vector<const void*>& src, const std::vector<float*>& dst,
                                     const std::vector<int64_t>& n, cudaStream_t stream) {
  launch_multi_tensor<AccumulateLaunch, kAccumulateMax>(
      n,
      [&](AccumulateLaunch& L, int k, size_t i) {
        L.src[k] = static_cast<const bf16*>(src[i]), L.dst[k] = dst[i];
        L.vec[k] = vec8_ok(n[i], {src[i], dst[i]});
      },
      accumulate_many_kernel, "accumulate_many_kernel", stream);
}

void launch_add(const void* a, DType adt, const void* b, DType bdt, void* out, DType odt, int64_t n,
                cudaStream_t stream) {
  if (n == 0) return;
  if (adt == bdt && bdt == odt && (odt == DType::F32 || odt == DType::BF16) && vec8_ok(n, {a, b, out})) {
    FP8RL_DISPATCH_FLOAT(odt, "add", {
      add_vec_kernel<T><<<grid_for(n / 8, 256), 256, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                                  static_cast<T*>(out), n / 8);
    });
    CUDA_CHECK_LAUNCH("add_vec_kernel");
    return;
  }
  add_kernel<<<grid_for(n, 256), 256, 0, stream>>>(a, code(adt), b, code(bdt), out, code(odt), n);
  CUDA_CHECK_LAUNCH("add_kernel");
}

void launch_scale(void* x, DType dtype, int64_t n, float s, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, code(dtype), n, s);
  CUDA_CHECK_LAUNCH("scale_kernel");
}

int64_t sum_squares_partials(const std::vector<int64_t>& ns) {
  int64_t chunks = 0;
  for (int64_t n : ns) chunks += (n + kSumChunk - 1) / kSumChunk;
  return chunks;
}

void launch_sum_squares_many(const std::vector<const void*>& xs, const std::vector<DType>& dtypes,
                             const std::vector<int64_t>& ns, double* out, double* partials, cudaStream_t stream) {
  for (size_t first = 0; first < xs.size();) {
    SumSquaresLaunch L{};
    int64_t ctas = 0;
    const size_t end = std::min(xs.size(), first + kSumMaxTensors);
    for (size_t i = first; i < end; ++i) {
      const int k = L.count++;
      L.chunk_start[k] = static_cast<int>(ctas);
      L.x[k] = xs[i], L.n[k] = ns[i], L.dtype[k] = code(dtypes[i]);
      ctas += (ns[i] + kSumChunk - 1) / kSumChunk;  // an empty tensor: no chunk, its sum 0
    }
    FP8RL_CHECK(ctas < (1LL << 31), "sum_squares: too many elements in one launch");
    L.chunk_start[L.count] = static_cast<int>(ctas);
    if (ctas > 0) {
      sum_squares_chunks_kernel<<<static_cast<unsigned>(ctas), kSumThreads, 0, stream>>>(L, partials);
      CUDA_CHECK_LAUNCH("sum_squares_chunks_kernel");
    }
    sum_partials_kernel<<<static_cast<unsigned>(L.count), kSumThreads, 0, stream>>>(L, partials, out + first);
    CUDA_CHECK_LAUNCH("sum_partials_kernel");
    partials += ctas;
    first = end;
  }
}

void launch_amax(const void* x, DType dtype, int64_t n, uint32_t* out, cudaStream_t stream) {
  if (n == 0) return;
  if (dtype == DType::BF16 && n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0)
    amax_bf16x8_kernel<<<grid_for(n / 8, 256, 2048), 256, 0, stream>>>(static_cast<const uint4*>(x), n / 8, out);
  else
    amax_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(x, code(dtype), n, out);
  CUDA_CHECK_LAUNCH("amax_kernel");
}

void launch_flag_nonfinite(const void* x, DType dtype, int64_t n, int* flag, cudaStream_t stream) {
  if (n == 0) return;
  nonfinite_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(x, code(dtype), n, flag);
  CUDA_CHECK_LAUNCH("nonfinite_kernel");
}

// Row r of src [rows, sum of the outputs' row bytes] is the outputs' rows r side by side: each
// V-byte chunk goes to the output whose byte range holds it (every range a multiple of V).
template <int V>
__global__ void split_cols_kernel(const unsigned char* src, int64_t rows, SplitColsArgs a) {
  const int64_t row_chunks = a.end[a.n - 1] / V, n = rows * row_chunks;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r, b;
    divmod_index(i, row_chunks, r, b);
    b *= V;  // byte offset in the row
    int o = 0;
    while (b >= a.end[o]) ++o;
    const int64_t b0 = o == 0 ? 0 : a.end[o - 1], width = a.end[o] - b0;
    unsigned char* dst = static_cast<unsigned char*>(a.out[o]) + r * width + (b - b0);
    const unsigned char* from = src + r * a.end[a.n - 1] + b;
    if constexpr (V == 16) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(from);
    else if constexpr (V == 4) *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(from);
    else *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(from);
  }
}

void launch_split_cols(const void* src, int64_t rows, const SplitColsArgs& a, cudaStream_t stream) {
  const int64_t row_bytes = a.end[a.n - 1];
  if (rows == 0 || row_bytes == 0) return;
  bool v16 = reinterpret_cast<uintptr_t>(src) % 16 == 0, v4 = reinterpret_cast<uintptr_t>(src) % 4 == 0;
  for (int o = 0; o < a.n; ++o) {
    const int64_t w = a.end[o] - (o == 0 ? 0 : a.end[o - 1]);
    v16 = v16 && w % 16 == 0 && reinterpret_cast<uintptr_t>(a.out[o]) % 16 == 0;
    v4 = v4 && w % 4 == 0 && reinterpret_cast<uintptr_t>(a.out[o]) % 4 == 0;
  }
  const auto* s = static_cast<const unsigned char*>(src);
  if (v16) split_cols_kernel<16><<<grid_for(rows * row_bytes / 16, 256), 256, 0, stream>>>(s, rows, a);
  else if (v4) split_cols_kernel<4><<<grid_for(rows * row_bytes / 4, 256), 256, 0, stream>>>(s, rows, a);
  else split_cols_kernel<2><<<grid_for(rows * row_bytes / 2, 256), 256, 0, stream>>>(s, rows, a);
  CUDA_CHECK_LAUNCH("split_cols_kernel");
}

void launch_add_bias(void* out, DType odt, const void* bias, DType bdt, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  if (rows * cols == 0) return;
  add_bias_kernel<<<grid_for(rows * cols, 256), 256, 0, stream>>>(out, code(odt), bias, code(bdt), rows, cols);
  CUDA_CHECK_LAUNCH("add_bias_kernel");
}

int64_t column_sum_chunks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(ceil_div(rows, 8), 64)); }

void launch_add_column_partials(const float* part, int64_t chunks, int64_t cols, float* out, cudaStream_t stream) {
  if (cols == 0) return;
  add_column_partials_kernel<<<grid_for(cols, 256), 256, 0, stream>>>(part, chunks, cols, out);
  CUDA_CHECK_LAUNCH("add_column_partials_kernel");
}

void launch_bias_grad(const void* dy, DType dt, int64_t rows, int64_t cols, float* dbias, float* part,
                      cudaStream_t stream) {
  if (rows * cols == 0) return;
  const int64_t chunks = column_sum_chunks(rows);
  dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(chunks));
  bias_grad_kernel<<<grid, dim3(32, 8), 0, stream>>>(dy, code(dt), rows, cols, part);
  CUDA_CHECK_LAUNCH("bias_grad_kernel");
  launch_add_column_partials(part, chunks, cols, dbias, stream);
}

}  // namespace fp8rl::cuda
