// The one family of CUDA / cuBLAS error checks. Every failure throws fp8rl::Error with the
// failing expression, file:line, the library's error string and what was being done.
//   CUDA_CHECK(cudaMemcpyAsync(...), "copying the logits to the host");
//   CUBLAS_CHECK(cublasLtMatmul(...), "FP8 block GEMM ", m, "x", n, "x", k);
//   CUDA_CHECK_LAUNCH("rmsnorm_kernel");   // after a <<<...>>> launch
// The trailing arguments (what was being done) are required.
// Out-of-memory errors come from cuda_malloc (below), which says how much was asked for and
// what to reduce.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "core/error.h"

namespace fp8rl::cuda {

const char* cublas_status_string(cublasStatus_t s);

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* expr, const char* file, int line,
                                   const std::string& doing);
[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* expr, const char* file, int line,
                                     const std::string& doing);

// cudaMalloc that throws a clear out-of-memory error ("asked for X GiB, Y GiB free of Z; reduce
// the batch, the sequence length or the KV pages"). `what` names the buffer.
void* cuda_malloc(size_t bytes, const char* what);
// The error of a failed device allocation of `bytes` for `what` through `api` (cudaMalloc,
// cudaMallocFromPoolAsync): out of memory says so with the free/total device memory and what
// to reduce; other errors name the CUDA error. Clears the (non-sticky) error first.
[[noreturn]] void throw_alloc_error(cudaError_t e, size_t bytes, const std::string& what, const char* api);
// Whether `stream` is capturing a CUDA graph (work that synchronizes or sets attributes waits then).
bool stream_capturing(cudaStream_t stream);

}  // namespace fp8rl::cuda

#define CUDA_CHECK(expr, ...)                                                                \
  do {                                                                                       \
    const cudaError_t _e = (expr);                                                           \
    if (_e != cudaSuccess)                                                                   \
      ::fp8rl::cuda::throw_cuda_error(_e, #expr, __FILE__, __LINE__,                         \
                                      ::fp8rl::detail::concat(__VA_ARGS__)); \
  } while (0)

#define CUBLAS_CHECK(expr, ...)                                                                \
  do {                                                                                         \
    const cublasStatus_t _s = (expr);                                                          \
    if (_s != CUBLAS_STATUS_SUCCESS)                                                           \
      ::fp8rl::cuda::throw_cublas_error(_s, #expr, __FILE__, __LINE__,                         \
                                        ::fp8rl::detail::concat(__VA_ARGS__)); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here (execution errors surface
// at the next synchronizing call, which is checked too).
#define CUDA_CHECK_LAUNCH(name) CUDA_CHECK(cudaGetLastError(), "launching ", name)
