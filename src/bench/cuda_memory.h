// The CUDA runtime's own view of device memory, for the benchmarks that measure memory per
// component (`bench generate`): cudaMemGetInfo as it is, without the backend's cache
// (Backend::free_device_bytes adds what the cache holds unused). A plain C++ header; defined in
// the CUDA library (src/bench/cuda/cuda_memory.cpp), so only in builds with FP8RL_HAVE_CUDA.
#pragma once
#include <cstdint>

namespace fp8rl {

int64_t bench_cuda_free_bytes();         // cudaMemGetInfo's free bytes on the current device; -1 on failure
int bench_cuda_current_device();         // the calling thread's device; -1 on failure
bool bench_cuda_set_device(int device);  // for the calling thread; false on failure

}  // namespace fp8rl
