// Fused producers of FP8 linear inputs (backend.h, Fp8View): RMSNorm (optionally after the
// residual add) and SwiGLU that write their output and its 1x128 E4M3 copy in one pass, and for
// the FP8 dgrads' dY the residual gradient's add and the SwiGLU backward (dgate and dup), the
// scales in row-major or cuBLASLt's VEC128 layout. Each is bitwise its unfused form followed by
// the quantizer: the same per-element FP32 math as model_kernels.cu / elementwise_kernels.cu
// (swiglu_value, swiglu_backward_value; the RMSNorm's double sum of squares over the same
// threads in the same order),
// the output rounded to its dtype before its amax and its codes are taken (the quantizer reads
// the stored output), and the scale and codes of quant.cuh. Vectorized only (8 elements per
// access; the element-wise ones on quant.cuh's row blocks, 16 columns per thread); the backend
// runs the unfused ops for any other shape. The "emulated" region also runs on the host
// (tests/cuda/eltwise_emu).
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/quant.cuh"
#include "quant/quant.h"

namespace fp8rl::cuda {

namespace {

// amax over the 16 threads of a half-warp holding one 128-column block (every thread of the
// warp calls it), then the block's scale.
__device__ __forceinline__ float half_warp_scale(float amax, bool pow2) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return fp8_scale_from_amax(amax, pow2);
}

// One block of rmsnorm_row_threads(D) threads per row; thread t holds columns d = t * 8 + k *
// blockDim.x * 8 (as rmsnorm_vec_kernel), so 16 consecutive threads hold one 128-column block.
// kAdd: the row is sum = a + b (stored, rounded), else x = a. kQuant: out's E4M3 copy into q
// [R, D] and scales ([R][nb], or [nb][R] with gemm_layout); non-finite outputs set *bad.
template <class T, class TW, bool kAdd, bool kQuant>
__global__ void rmsnorm_fused_kernel(const T* a, const T* b, T* sum, const TW* __restrict__ w, int64_t R,
                                     int64_t D, float eps, T* __restrict__ out, float* __restrict__ rstd, bool pow2,
                                     uint8_t* __restrict__ q, float* __restrict__ scales, bool gemm_layout,
                                     int* bad) {
  __shared__ double red[32];
  const int64_t r = blockIdx.x;
  const int step = blockDim.x * 8;
  double ss = 0.0;
  for (int64_t d = threadIdx.x * 8; d < D; d += step) {
    float v[8];
    load8(a + r * D + d, v);
    if constexpr (kAdd) {
      float u[8];
      load8(b + r * D + d, u);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = v[i] + u[i];
      // sum may alias a: this thread read a[d..d+8) above; v: the stored sum, which the norm reads
      store8_rounded(sum + r * D + d, v);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += static_cast<double>(v[i]) * v[i];
  }
  ss = block_sum_d(ss, red);
  const float var = static_cast<float>(ss / static_cast<double>(D));
  const float rs = 1.0f / sqrtf(var + eps);
  if (rstd && threadIdx.x == 0) rstd[r] = rs;
  const T* xr = (kAdd ? static_cast<const T*>(sum) : a) + r * D;  // this thread's own writes, if kAdd
  const int64_t nb = (D + 127) / 128;
  bool finite = true;
  // Every thread runs every pass (kQuant shuffles across the half-warp); out-of-range ones idle.
  for (int64_t base = 0; base < D; base += step) {
    const int64_t d = base + threadIdx.x * 8;
    const bool in = d < D;
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (in) {
      float wv[8];
      load8(xr + d, v);
      load8(w + d, wv);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = v[i] * rs * wv[i];
      store8_rounded(out + r * D + d, v);  // v: the stored output, which the quantizer reads
    }
    if constexpr (kQuant) {
      float amax = 0.0f;
      if (in) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          finite &= isfinite(v[i]);
          amax = fmaxf(amax, fabsf(v[i]));
        }
      }
      const float s = half_warp_scale(amax, pow2);
      if (in) {
        const int64_t blk = d / 128;  // base is a multiple of 256: a half-warp is one block
        if ((threadIdx.x & 15) == 0) scales[gemm_layout ? blk * R + r : r * nb + blk] = s;
        *reinterpret_cast<uint2*>(q + r * D + d) = encode8(v, Fp8Divisor(s));
      }
    }
  }
  if (kQuant && !finite) atomicExch(bad, 1);
}

// ---- emulated: begin (element-wise producers)
// The element-wise producers: quant.cuh's row blocks (8 threads per (row, 128-column block), 16
// columns each as two chunks of 8), each chunk computed, stored (rounded to T) and folded into
// the block's amax, then row_block_quantize.

// out = swiglu(gate, up) and its E4M3 copy.
template <class T>
__global__ void swiglu_fp8_kernel(const T* __restrict__ g, const T* __restrict__ u, int64_t ld, T* __restrict__ out,
                                  int64_t R, int64_t F, bool pow2, uint8_t* __restrict__ q,
                                  float* __restrict__ scales, bool gemm_layout, int* bad) {
  RowBlock h;
  if (!row_block(R, F, h)) return;
  float v[16] = {};
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (!h.in[k]) continue;
    float* vk = v + 8 * k;
    float uv[8];
    load8(g + h.r * ld + h.col[k], vk);
    load8(u + h.r * ld + h.col[k], uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) vk[i] = swiglu_value(vk[i], uv[i]);
    store8_rounded(out + h.r * F + h.col[k], vk);
    stored_amax8(vk, amax, finite);
  }
  if (!finite) atomicExch(bad, 1);
  row_block_quantize(h, v, amax, R, F, pow2, q, scales, gemm_layout);
}

// out = a + b (the residual stream's gradient) and its E4M3 copy; a thread reads its elements
// of a before writing them, so out may alias a.
template <class T>
__global__ void add_fp8_kernel(const T* a, const T* __restrict__ b, T* out, int64_t R, int64_t D, bool pow2,
                               uint8_t* __restrict__ q, float* __restrict__ scales, bool gemm_layout, int* bad) {
  RowBlock h;
  if (!row_block(R, D, h)) return;
  float v[16] = {};
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (!h.in[k]) continue;
    float* vk = v + 8 * k;
    float w[8];
    load8(a + h.r * D + h.col[k], vk);
    load8(b + h.r * D + h.col[k], w);
#pragma unroll
    for (int i = 0; i < 8; ++i) vk[i] += w[i];  // as add_vec_kernel
    store8_rounded(out + h.r * D + h.col[k], vk);
    stored_amax8(vk, amax, finite);
  }
  if (!finite) atomicExch(bad, 1);
  row_block_quantize(h, v, amax, R, D, pow2, q, scales, gemm_layout);
}

// The backward: dg, du = swiglu_backward(d, g, u) and both E4M3 copies.
template <class T>
__global__ void swiglu_backward_fp8_kernel(const T* __restrict__ d, const T* __restrict__ g, const T* __restrict__ u,
                                           T* __restrict__ dg, T* __restrict__ du, int64_t R, int64_t F, bool pow2,
                                           uint8_t* __restrict__ qg, float* __restrict__ sg, uint8_t* __restrict__ qu,
                                           float* __restrict__ su, bool gemm_layout, int* bad) {
  RowBlock h;
  if (!row_block(R, F, h)) return;
  float a[16] = {}, b[16] = {};  // dgate, dup
  float amax_g = 0.0f, amax_u = 0.0f;
  bool finite = true;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (!h.in[k]) continue;
    const int64_t off = h.r * F + h.col[k];
    float dv[8], gv[8], uv[8];
    load8(d + off, dv);
    load8(g + off, gv);
    load8(u + off, uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) swiglu_backward_value(dv[i], gv[i], uv[i], a[8 * k + i], b[8 * k + i]);
    store8_rounded(dg + off, a + 8 * k);
    store8_rounded(du + off, b + 8 * k);
    stored_amax8(a + 8 * k, amax_g, finite);
    stored_amax8(b + 8 * k, amax_u, finite);
  }
  if (!finite) atomicExch(bad, 1);
  row_block_quantize(h, a, amax_g, R, F, pow2, qg, sg, gemm_layout);
  row_block_quantize(h, b, amax_u, R, F, pow2, qu, su, gemm_layout);
}
// ---- emulated: end (element-wise producers)

}  // namespace

bool launch_rmsnorm_fused(const void* a, const void* b, void* sum, DType dt, const void* w, DType wdt, int64_t R,
                          int64_t D, float eps, void* out, float* rstd, bool pow2, uint8_t* q, float* scales,
                          bool gemm_layout, int* bad_flag, cudaStream_t stream) {
  const bool add = b != nullptr, quant = q != nullptr;
  if (!vec8_ok(D, {a, w, out}) || (add && !vec8_ok(D, {b, sum})) || (quant && !vec8_ok(D, {q}))) return false;
  if (R == 0) return true;
  const unsigned grid = static_cast<unsigned>(R);
  const int threads = rmsnorm_row_threads(D);
  FP8RL_DISPATCH_FLOAT(wdt, "rmsnorm weight", {
    using TW = T;
    FP8RL_DISPATCH_FLOAT(dt, "rmsnorm input", {
      const T* ap = static_cast<const T*>(a);
      const T* bp = static_cast<const T*>(b);
      T* sp = static_cast<T*>(sum);
      const TW* wp = static_cast<const TW*>(w);
      T* op = static_cast<T*>(out);
      if (add && quant) {
        rmsnorm_fused_kernel<T, TW, true, true><<<grid, threads, 0, stream>>>(ap, bp, sp, wp, R, D, eps, op, rstd,
                                                                           pow2, q, scales, gemm_layout, bad_flag);
      } else if (add) {
        rmsnorm_fused_kernel<T, TW, true, false><<<grid, threads, 0, stream>>>(ap, bp, sp, wp, R, D, eps, op, rstd,
                                                                            pow2, q, scales, gemm_layout, bad_flag);
      } else if (quant) {
        rmsnorm_fused_kernel<T, TW, false, true><<<grid, threads, 0, stream>>>(ap, bp, sp, wp, R, D, eps, op, rstd,
                                                                            pow2, q, scales, gemm_layout, bad_flag);
      } else {
        rmsnorm_fused_kernel<T, TW, false, false><<<grid, threads, 0, stream>>>(ap, bp, sp, wp, R, D, eps, op, rstd,
                                                                             pow2, q, scales, gemm_layout, bad_flag);
      }
    });
  });
  CUDA_CHECK_LAUNCH("rmsnorm_fused_kernel");
  return true;
}

bool launch_swiglu_fp8(const void* g, const void* u, int64_t ld, void* out, DType dt, int64_t R, int64_t F, bool pow2,
                       uint8_t* q, float* scales, bool gemm_layout, int* bad_flag, cudaStream_t stream) {
  if (!vec8_ok(F, {g, u, out, q}) || ld % 8 != 0) return false;
  if (R == 0) return true;
  const int64_t threads_total = row_block_threads(R, F);
  FP8RL_DISPATCH_FLOAT(dt, "swiglu", {
    swiglu_fp8_kernel<T><<<static_cast<unsigned>(ceil_div(threads_total, 256)), 256, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(u), ld, static_cast<T*>(out), R, F, pow2, q, scales,
        gemm_layout, bad_flag);
  });
  CUDA_CHECK_LAUNCH("swiglu_fp8_kernel");
  return true;
}

bool launch_add_fp8(const void* a, const void* b, void* out, DType dt, int64_t R, int64_t D, bool pow2, uint8_t* q,
                    float* scales, bool gemm_layout, int* bad_flag, cudaStream_t stream) {
  if (!vec8_ok(D, {a, b, out, q})) return false;
  if (R == 0) return true;
  const int64_t threads_total = row_block_threads(R, D);
  FP8RL_DISPATCH_FLOAT(dt, "add", {
    add_fp8_kernel<T><<<static_cast<unsigned>(ceil_div(threads_total, 256)), 256, 0, stream>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), R, D, pow2, q, scales, gemm_layout,
        bad_flag);
  });
  CUDA_CHECK_LAUNCH("add_fp8_kernel");
  return true;
}

bool launch_swiglu_backward_fp8(const void* dout, const void* g, const void* u, void* dg, void* du, DType dt, int64_t R,
                                int64_t F, bool pow2, uint8_t* qg, float* sg, uint8_t* qu, float* su, bool gemm_layout,
                                int* bad_flag, cudaStream_t stream) {
  if (!vec8_ok(F, {dout, g, u, dg, du, qg, qu})) return false;
  if (R == 0) return true;
  const int64_t threads_total = row_block_threads(R, F);
  FP8RL_DISPATCH_FLOAT(dt, "swiglu_backward", {
    swiglu_backward_fp8_kernel<T><<<static_cast<unsigned>(ceil_div(threads_total, 256)), 256, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(dg),
        static_cast<T*>(du), R, F, pow2, qg, sg, qu, su, gemm_layout, bad_flag);
  });
  CUDA_CHECK_LAUNCH("swiglu_backward_fp8_kernel");
  return true;
}

}  // namespace fp8rl::cuda
