// `fp8rl bench-gemm`'s body: TFLOP/s of our BF16 and FP8 block-scaled GEMMs (cuBLASLt) at
// Llama-3.1-8B linear shapes, forward / dgrad / wgrad, plus the quantization kernels in GB/s next
// to a device-to-device copy measured in the same run. A plain C++ header: the CLI includes no
// CUDA header. Defined in the CUDA library (src/bench/cuda/gemm_bench.cpp), so only in builds
// with FP8RL_HAVE_CUDA.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

namespace fp8rl {

struct GemmBenchOptions {
  int device = 0;  // CUDA device index
  int reps = 20, warmup = 5;
  bool quick = false;       // the M = 8192 GEMMs only
  bool quant_only = false;  // the memory-bound kernels alone, no GEMMs
  // --shapes: forward products C[M, N] = A[M, K] W[N, K]^T of these {M, N, K} only (nothing
  // else: for a profiler's view of one kernel); --grouped-only: the grouped expert products only.
  std::vector<std::array<int64_t, 3>> shapes;
  bool grouped_only = false;
  bool algos = false;       // --algos: also time every cuBLASLt heuristic candidate of each product
  bool lt_search = false;   // --lt-search: also time every configuration of cuBLASLt's first algorithm
  bool fast_accum = false;  // --fast-accum: also time cuBLASLt's FP8 products with fast accumulation
};

// Prints the tables to stdout and returns the numbers (device, copy, quant[], gemm[]).
nlohmann::json bench_gemm_run(const GemmBenchOptions& options);

}  // namespace fp8rl
