// Timing helper of the GPU benches (tests/cuda): CUDA events on the backend's stream.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <algorithm>
#include <functional>
#include <vector>

namespace fp8rl::test {

// Times one kernel: median over 7 repeats of 20 calls (alternating the two layers, so the L2
// never holds the next call's bytes) after 3 warm-up calls; microseconds per call.
inline double time_calls(const std::function<void(int layer)>& call, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) call(i & 1);
  cudaEvent_t e0, e1;
  EXPECT_EQ(cudaEventCreate(&e0), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&e1), cudaSuccess);
  std::vector<double> us;
  for (int r = 0; r < 7; ++r) {
    EXPECT_EQ(cudaEventRecord(e0, stream), cudaSuccess);
    for (int i = 0; i < 20; ++i) call(i & 1);
    EXPECT_EQ(cudaEventRecord(e1, stream), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(e1), cudaSuccess);
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, e0, e1), cudaSuccess);
    us.push_back(1000.0 * ms / 20);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace fp8rl::test
