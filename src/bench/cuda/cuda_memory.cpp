// bench/cuda_memory.h: the CUDA runtime calls behind it.
#include "bench/cuda_memory.h"

#include <cuda_runtime.h>

namespace fp8rl {

int64_t bench_cuda_free_bytes() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return -1;
  return static_cast<int64_t>(free_b);
}

int bench_cuda_current_device() {
  int dev = 0;
  return cudaGetDevice(&dev) == cudaSuccess ? dev : -1;
}

bool bench_cuda_set_device(int device) { return cudaSetDevice(device) == cudaSuccess; }

}  // namespace fp8rl
