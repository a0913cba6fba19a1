// Block-scaled FP8 (DeepSeek-V3 style), recipe.md section 2. This file is the reference
// quantizer: the CUDA kernels must reproduce it bit for bit.
//
// A quantized tensor is one value: E4M3 data in the logical layout [rows, cols] plus one
// FP32 dequantization scale per block of block_rows x block_cols elements:
//   1 x 128   activations X[M,K] and output gradients dY[M,N], blocks along the last dim
//   128 x 128 weights W[N,K]
// "1x128 along tokens" (wgrad operands) is the 1 x 128 quantization of the *transposed*
// tensor (X^T[K,M]): quantize_blocks(..., transpose=true). A block that runs past the end of
// a dimension is padded: its scale covers the real elements only.
#pragma once
#include "core/tensor.h"

namespace fp8rl {

struct QuantTensor {
  Tensor data;    // E4M3 [rows, cols]
  Tensor scales;  // F32  [ceil(rows / block_rows), ceil(cols / block_cols)], dequant multipliers
  int block_rows = 1;
  int block_cols = 128;
  bool pow2 = false;

  bool defined() const { return data.defined(); }
  int64_t rows() const { return data.dim(0); }
  int64_t cols() const { return data.dim(1); }
};

constexpr int kQuantBlock = 128;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The one scale rule: s = amax / 448 (one float division); amax == 0 gives 1; a division that
// underflows to 0 gives the smallest positive float 2^-149; pow2 rounds s up to a power of 2
// (a power of two stays); the rule is fp8_rule.h's fp8_scale_from_amax, the one copy host and
// device share. Throws on a non-finite amax (non-finite input is an error, never quantized).
// Quantized value q = e4m3_from_float(v / s) (float division, v the element as float: BF16
// exact, F64 rounded to float first); dequantized e4m3_to_float(q) * s.
float quant_scale_from_amax(float amax, bool pow2);

// Allocates an empty CPU QuantTensor of logical shape [rows, cols].
QuantTensor quant_alloc(int64_t rows, int64_t cols, int block_rows, int block_cols, bool pow2);

// Quantizes x (F32, BF16 or F64, [r, c], CPU) into `out`, whose data is [r, c] or, with transpose,
// [c, r] (out describes x^T then). out's blocks and pow2 say how; its buffers are reused
// (refit writes in place). `what` names the tensor in error messages.
void quantize_blocks_into(const Tensor& x, bool transpose, QuantTensor& out, const char* what = "tensor");

// Convenience forms (allocate the result).
QuantTensor quantize_1x128(const Tensor& x, bool pow2);             // [M,K] -> blocks 1x128 along K
QuantTensor quantize_1x128_tokens(const Tensor& x, bool pow2);      // [M,K] -> X^T [K,M], 1x128 along M
QuantTensor quantize_128x128(const Tensor& w, bool pow2);           // [N,K] -> blocks 128x128
// Exact transpose of a 128x128-quantized tensor: data and scale grid transposed.
QuantTensor transpose_128x128(const QuantTensor& q);
// Dequantized values as F32 [rows, cols].
Tensor dequantize(const QuantTensor& q);

}  // namespace fp8rl
