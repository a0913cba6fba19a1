#include "backend/cuda/cuda_check.h"

#include <cstdio>

namespace fp8rl::cuda {

const char* cublas_status_string(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (bad argument or layout)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (feature needs a newer GPU)";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (no kernel for this shape/type/layout)";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}

void throw_cuda_error(cudaError_t e, const char* expr, const char* file, int line, const std::string& doing) {
  std::string hint;
  if (e == cudaErrorMemoryAllocation)
    hint = "; out of GPU memory: reduce the batch, the sequence length or the KV-cache pages";
  else if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
    hint = "; no usable GPU: check nvidia-smi, or use --device cpu";
  else if (e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure)
    hint = "; a kernel faulted (the CUDA context is now unusable): rerun under compute-sanitizer";
  detail::throw_error(file, line,
                      detail::concat("CUDA error while ", doing.empty() ? std::string("calling CUDA") : doing,
                                     ": ", expr, " returned ", cudaGetErrorName(e), " (",
                                     cudaGetErrorString(e), ")", hint));
}

void throw_cublas_error(cublasStatus_t s, const char* expr, const char* file, int line, const std::string& doing) {
  detail::throw_error(file, line,
                      detail::concat("cuBLAS error while ", doing.empty() ? std::string("calling cuBLAS") : doing,
                                     ": ", expr, " returned ", cublas_status_string(s)));
}

void* cuda_malloc(size_t bytes, const char* what) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaSuccess) return p;
  throw_alloc_error(e, bytes, what, "cudaMalloc");
}

void throw_alloc_error(cudaError_t e, size_t bytes, const std::string& what, const char* api) {
  cudaGetLastError();  // clear the (non-sticky) allocation error
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  char buf[256];
  std::snprintf(buf, sizeof buf, "asked for %.3f GiB, %.3f GiB free of %.3f GiB", bytes / gib, free_b / gib,
                total_b / gib);
  if (e == cudaErrorMemoryAllocation)
    FP8RL_FAIL("out of GPU memory allocating ", what, ": ", buf,
               "; reduce the batch size, the sequence length, the number of KV-cache pages or the model size");
  FP8RL_FAIL(api, " of ", what, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), "), ", buf);
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &status), "querying the stream's capture state");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace fp8rl::cuda
