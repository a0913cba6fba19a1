// The reference block quantizer (recipe.md section 2). Every rule below is the specification
// the CUDA kernels reproduce bit for bit, so the arithmetic is deliberately plain:
//   - values are read as float (BF16 exactly; F64 rounded to nearest float first);
//   - amax = max |v| over the block's real elements (fabsf / fmaxf: exact, order-free);
//   - s = amax / 448 as one IEEE float division; amax == 0 gives s = 1; if the division
//     underflows to 0 (amax < 448 * 2^-150) s is the smallest positive float 2^-149;
//   - pow2: s is rounded up to the next power of two (exact, on the float's bits; s already a
//     power of two stays);
//   (the scale rule itself is quant/fp8_rule.h's fp8_scale_from_amax, shared with the device);
//   - q = e4m3_from_float(v / s), v / s one IEEE float division (never v * (1 / s));
//   - dequantized value = e4m3_to_float(q) * s, one float multiplication.
#include "quant/quant.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "quant/fp8_rule.h"

namespace fp8rl {

float quant_scale_from_amax(float amax, bool pow2) {
  if (!std::isfinite(amax))
    FP8RL_FAIL_NONFINITE("quantization amax must be finite, got ", amax,
                         " (non-finite values cannot be quantized: look for an overflow upstream)");
  FP8RL_CHECK(amax >= 0.0f, "quantization amax must be >= 0, got ", amax);
  return fp8_scale_from_amax(amax, pow2);  // fp8_rule.h: the copy the CUDA kernels use too
}

QuantTensor quant_alloc(int64_t rows, int64_t cols, int block_rows, int block_cols, bool pow2) {
  FP8RL_CHECK(rows >= 0 && cols >= 0 && block_rows > 0 && block_cols > 0, "bad quantized shape [",
              rows, ", ", cols, "] with blocks ", block_rows, "x", block_cols);
  QuantTensor q;
  q.block_rows = block_rows;
  q.block_cols = block_cols;
  q.pow2 = pow2;
  q.data = Tensor::empty({rows, cols}, DType::E4M3);
  q.scales = Tensor::empty({ceil_div(rows, block_rows), ceil_div(cols, block_cols)}, DType::F32);
  return q;
}

namespace {

// Element (i, j) of x [r, c] as float.
float read_as_float(const Tensor& x, int64_t index) {
  switch (x.dtype()) {
    case DType::F32: return x.data<float>()[index];
    case DType::BF16: return bf16_to_float(x.data<uint16_t>()[index]);
    case DType::F64: return static_cast<float>(x.data<double>()[index]);
    default: FP8RL_FAIL("quantize: input must be F32, BF16 or F64, got ", x.str());
  }
}

}  // namespace

void quantize_blocks_into(const Tensor& x, bool transpose, QuantTensor& out, const char* what) {
  FP8RL_CHECK(x.device() == DeviceKind::CPU, "the reference quantizer needs a CPU tensor, got ",
              what, " ", x.str());
  FP8RL_CHECK(x.ndim() == 2, "quantize: ", what, " must be 2-D [rows, cols], got ", x.str());
  FP8RL_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16 || x.dtype() == DType::F64,
              "quantize: ", what, " must be F32, BF16 or F64, got ", x.str());
  const int64_t xr = x.dim(0), xc = x.dim(1);
  const int64_t R = transpose ? xc : xr;  // logical (output) shape [R, C]
  const int64_t C = transpose ? xr : xc;
  const int br = out.block_rows, bc = out.block_cols;
  FP8RL_CHECK(br > 0 && bc > 0, "quantize: bad block shape ", br, "x", bc);
  check_dtype(out.data, DType::E4M3, "quantized data");
  check_shape(out.data, {R, C}, "quantized data");
  check_dtype(out.scales, DType::F32, "quantization scales");
  check_shape(out.scales, {ceil_div(R, br), ceil_div(C, bc)}, "quantization scales");
  FP8RL_CHECK(out.data.device() == DeviceKind::CPU && out.scales.device() == DeviceKind::CPU,
              "the reference quantizer writes CPU tensors only");

  // Logical element (i, j) of the quantized tensor is x[i, j], or x[j, i] with transpose.
  auto index_of = [&](int64_t i, int64_t j) { return transpose ? j * xc + i : i * xc + j; };
  uint8_t* q = out.data.data<uint8_t>();
  float* scales = out.scales.data<float>();
  const int64_t nbr = ceil_div(R, br), nbc = ceil_div(C, bc);
  for (int64_t bi = 0; bi < nbr; ++bi) {
    for (int64_t bj = 0; bj < nbc; ++bj) {
      const int64_t i0 = bi * br, i1 = std::min<int64_t>(R, i0 + br);
      const int64_t j0 = bj * bc, j1 = std::min<int64_t>(C, j0 + bc);
      float amax = 0.0f;
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t idx = index_of(i, j);
          const float v = read_as_float(x, idx);
          if (!std::isfinite(v)) {
            FP8RL_FAIL_NONFINITE("cannot quantize ", what, " ", x.str(), ": element [", idx / xc, ", ",
                       idx % xc, "] is ", v,
                       " (non-finite; an overflow or NaN upstream, or an F64 value beyond float range)");
          }
          amax = std::fmax(amax, std::fabs(v));
        }
      }
      const float s = quant_scale_from_amax(amax, out.pow2);
      scales[bi * nbc + bj] = s;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = j0; j < j1; ++j) q[i * C + j] = e4m3_from_float(read_as_float(x, index_of(i, j)) / s);
    }
  }
}

QuantTensor quantize_1x128(const Tensor& x, bool pow2) {
  FP8RL_CHECK(x.ndim() == 2, "quantize_1x128 needs a 2-D tensor, got ", x.str());
  QuantTensor q = quant_alloc(x.dim(0), x.dim(1), 1, kQuantBlock, pow2);
  quantize_blocks_into(x, false, q, "activation");
  return q;
}

QuantTensor quantize_1x128_tokens(const Tensor& x, bool pow2) {
  FP8RL_CHECK(x.ndim() == 2, "quantize_1x128_tokens needs a 2-D tensor, got ", x.str());
  QuantTensor q = quant_alloc(x.dim(1), x.dim(0), 1, kQuantBlock, pow2);
  quantize_blocks_into(x, true, q, "activation (along tokens)");
  return q;
}

QuantTensor quantize_128x128(const Tensor& w, bool pow2) {
  FP8RL_CHECK(w.ndim() == 2, "quantize_128x128 needs a 2-D tensor, got ", w.str());
  QuantTensor q = quant_alloc(w.dim(0), w.dim(1), kQuantBlock, kQuantBlock, pow2);
  quantize_blocks_into(w, false, q, "weight");
  return q;
}

QuantTensor transpose_128x128(const QuantTensor& q) {
  FP8RL_CHECK(q.defined() && q.block_rows == kQuantBlock && q.block_cols == kQuantBlock,
              "transpose_128x128 needs a 128x128-block quantized tensor, got blocks ", q.block_rows,
              "x", q.block_cols);
  FP8RL_CHECK(q.data.device() == DeviceKind::CPU, "transpose_128x128 is the CPU reference");
  const int64_t R = q.rows(), C = q.cols();
  QuantTensor t = quant_alloc(C, R, kQuantBlock, kQuantBlock, q.pow2);
  const uint8_t* src = q.data.data<uint8_t>();
  uint8_t* dst = t.data.data<uint8_t>();
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) dst[j * R + i] = src[i * C + j];
  const int64_t sr = q.scales.dim(0), sc = q.scales.dim(1);
  for (int64_t i = 0; i < sr; ++i)
    for (int64_t j = 0; j < sc; ++j) t.scales.data<float>()[j * sr + i] = q.scales.data<float>()[i * sc + j];
  return t;
}

Tensor dequantize(const QuantTensor& q) {
  FP8RL_CHECK(q.defined() && q.data.device() == DeviceKind::CPU, "dequantize needs a CPU QuantTensor");
  const int64_t R = q.rows(), C = q.cols();
  const int64_t nbc = q.scales.dim(1);
  Tensor out = Tensor::empty({R, C}, DType::F32);
  const uint8_t* src = q.data.data<uint8_t>();
  const float* scales = q.scales.data<float>();
  float* dst = out.data<float>();
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j)
      dst[i * C + j] = e4m3_to_float(src[i * C + j]) * scales[(i / q.block_rows) * nbc + j / q.block_cols];
  return out;
}

}  // namespace fp8rl
