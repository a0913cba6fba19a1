// CPU backend: a small persistent thread pool for the ops' outer loops.
//
// cpu_parallel_for(n, work, f) splits [0, n) into one contiguous chunk per thread and calls
// f(begin, end) on each (the calling thread runs the first chunk). Each index is visited by
// exactly one call, so an op that writes only the outputs of its own indices computes the
// same bits with any number of threads. It runs f(0, n) inline when `work` (a cost estimate,
// e.g. multiply-adds) is below kParallelMinWork, when called from inside a parallel region,
// or while another thread is using the pool. The first exception thrown by f is rethrown.
//
// Threads: FP8RL_CPU_THREADS when set (1 = serial), else std::thread::hardware_concurrency().
#pragma once
#include <cstdint>
#include <functional>

namespace fp8rl::cpu {

constexpr int64_t kParallelMinWork = int64_t(1) << 18;

int cpu_num_threads();
void cpu_parallel_for(int64_t n, int64_t work, const std::function<void(int64_t begin, int64_t end)>& f);

}  // namespace fp8rl::cpu
