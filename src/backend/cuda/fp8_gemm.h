// The own block-scaled FP8 GEMM for Hopper (fp8_gemm_sm90.cu): C[M, N] = alpha * A B^T + beta * C
// with A E4M3 [M, K] (1x128 scales along K) and B E4M3 [N, K] (128x128 scales), FP32
// accumulation promoted every 128 K, BF16 or F32 output. Any M; N and K multiples of 16.
// Deterministic, and row-invariant at a fixed split count (see the .cu file).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace fp8rl::cuda {

struct Fp8GemmArgs {
  int64_t M = 0, N = 0, K = 0;
  const uint8_t* a = nullptr;        // [M, K]
  const float* a_scales = nullptr;   // [M][ceil(K/128)], or [ceil(K/128)][M] when a_scales_kb_major
  bool a_scales_kb_major = false;
  const uint8_t* b = nullptr;        // [N, K]
  const float* b_scales = nullptr;   // [ceil(N/128)][ceil(K/128)]
  void* c = nullptr;                 // [M, N]
  DType c_dtype = DType::BF16;
  float alpha = 1.0f, beta = 0.0f;
  int splits = 1;                    // K splits (fp8_gemm_sm90_splits); > 1 needs the workspace
  int block_m = 0;                   // rows per CTA: 64 or 128 (0: 64 for M <= 64, else 128)
  float* workspace = nullptr;        // fp8_gemm_sm90_workspace_floats(M, N, splits) floats
};

bool fp8_gemm_sm90_supported(int64_t M, int64_t N, int64_t K);
// The split count that fills the SMs for a shape (1 for shapes with enough tiles).
int fp8_gemm_sm90_splits(int64_t M, int64_t N, int64_t K, int sm_count);
int64_t fp8_gemm_sm90_workspace_floats(int64_t M, int64_t N, int splits);
void fp8_gemm_sm90(const Fp8GemmArgs& args, cudaStream_t stream);

}  // namespace fp8rl::cuda
