// The reference block quantizer (quant/quant.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/error.h"
#include "quant/fp8_rule.h"
#include "quant/quant.h"

namespace fp8rl {
namespace {

// Random [r, c] F32 tensor whose rows span several orders of magnitude (so that blocks get
// different scales and elements land in E4M3's subnormal range after scaling).
Tensor random_tensor(int64_t r, int64_t c, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ex(-6.0f, 6.0f);
  std::vector<float> v(r * c);
  for (int64_t i = 0; i < r; ++i) {
    const float row_scale = std::exp2(ex(gen));
    for (int64_t j = 0; j < c; ++j) v[i * c + j] = nd(gen) * row_scale * std::exp2(ex(gen) / 2);
  }
  return from_float_vector(v, {r, c});
}

float at(const Tensor& t, int64_t i, int64_t j) { return t.data<float>()[i * t.dim(1) + j]; }
uint8_t code(const QuantTensor& q, int64_t i, int64_t j) { return q.data.data<uint8_t>()[i * q.cols() + j]; }
float scale(const QuantTensor& q, int64_t i, int64_t j) {
  return q.scales.data<float>()[(i / q.block_rows) * q.scales.dim(1) + j / q.block_cols];
}

// Independent recomputation of a block's amax over the logical tensor L = x or x^T.
float block_amax(const Tensor& x, bool transpose, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  double m = 0;
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = j0; j < j1; ++j) m = std::max(m, std::fabs(double(transpose ? at(x, j, i) : at(x, i, j))));
  return static_cast<float>(m);
}

// Checks scales and per-element error bounds of q against x (q describes x or x^T).
void check_quantization(const Tensor& x, bool transpose, const QuantTensor& q) {
  const int64_t R = q.rows(), C = q.cols();
  ASSERT_EQ(R, transpose ? x.dim(1) : x.dim(0));
  ASSERT_EQ(C, transpose ? x.dim(0) : x.dim(1));
  ASSERT_EQ(q.scales.dim(0), (R + q.block_rows - 1) / q.block_rows);
  ASSERT_EQ(q.scales.dim(1), (C + q.block_cols - 1) / q.block_cols);
  const Tensor deq = dequantize(q);
  for (int64_t bi = 0; bi < q.scales.dim(0); ++bi) {
    for (int64_t bj = 0; bj < q.scales.dim(1); ++bj) {
      const int64_t i0 = bi * q.block_rows, i1 = std::min(R, i0 + q.block_rows);
      const int64_t j0 = bj * q.block_cols, j1 = std::min(C, j0 + q.block_cols);
      const float amax = block_amax(x, transpose, i0, i1, j0, j1);
      const float s = q.scales.data<float>()[bi * q.scales.dim(1) + bj];
      ASSERT_GT(amax, 0.0f);
      const double plain = double(amax) / 448.0;  // independent: double, then compare
      if (!q.pow2) {
        EXPECT_EQ(s, amax / 448.0f);
        EXPECT_LE(std::fabs(s - plain), plain * 6e-8);  // within one float rounding
      } else {
        int e;
        EXPECT_EQ(std::frexp(s, &e), 0.5f) << "pow2 scale " << s << " is not a power of two";
        EXPECT_GE(s, amax / 448.0f);
        EXPECT_LT(s, 2 * (amax / 448.0f));
      }
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          const float xv = transpose ? at(x, j, i) : at(x, i, j);
          const float d = at(deq, i, j);
          // v = x / s (one float rounding) then E4M3 rounding of v: half an E4M3 ulp of the
          // binade of |v| (2^-10 in the subnormal range, |v| < 2^-6), then d = q * s (one
          // float rounding). |x - d| <= s * half_ulp(v) + 2^-24 (|x| + |d|) (plus slack 2^-24).
          const double v = std::min(std::fabs(double(xv) / s), 448.0);
          double half_ulp;
          if (v < std::ldexp(1.0, -6)) half_ulp = std::ldexp(1.0, -10);
          else {
            int e;
            std::frexp(v, &e);  // v in [2^(e-1), 2^e)
            half_ulp = std::ldexp(1.0, e - 1 - 4);
          }
          const double bound = s * half_ulp * (1 + 1e-6) + std::ldexp(1.0, -23) * (std::fabs(xv) + std::fabs(d));
          EXPECT_LE(std::fabs(double(xv) - d), bound) << "element [" << i << ", " << j << "]";
          if (!q.pow2 && std::fabs(xv) == amax) {
            EXPECT_EQ(std::fabs(e4m3_to_float(code(q, i, j))), 448.0f);
          }
          EXPECT_EQ(std::signbit(e4m3_to_float(code(q, i, j))), std::signbit(xv));
        }
      }
    }
  }
}

TEST(Quant, ScaleRule) {
  EXPECT_EQ(quant_scale_from_amax(0.0f, false), 1.0f);
  EXPECT_EQ(quant_scale_from_amax(0.0f, true), 1.0f);
  EXPECT_EQ(quant_scale_from_amax(448.0f, false), 1.0f);
  EXPECT_EQ(quant_scale_from_amax(448.0f, true), 1.0f);     // power of two stays
  EXPECT_EQ(quant_scale_from_amax(449.0f, true), 2.0f);     // rounded up
  EXPECT_EQ(quant_scale_from_amax(3.5f, true), 0.0078125f); // 3.5/448 = 2^-7 exactly
  EXPECT_EQ(quant_scale_from_amax(3.6f, true), 0.015625f);
  EXPECT_EQ(quant_scale_from_amax(1.0f, false), 1.0f / 448.0f);
  EXPECT_GT(quant_scale_from_amax(std::numeric_limits<float>::denorm_min(), false), 0.0f);
  EXPECT_THROW(quant_scale_from_amax(std::numeric_limits<float>::infinity(), false), Error);
  EXPECT_THROW(quant_scale_from_amax(std::numeric_limits<float>::quiet_NaN(), true), Error);
  // Subnormal plain scales round up to powers of two too.
  const float tiny = quant_scale_from_amax(1e-41f, true);
  int e;
  EXPECT_EQ(std::frexp(tiny, &e), 0.5f);
  EXPECT_GE(tiny, 1e-41f / 448.0f);
}

// fp8_rule.h's bit-level pow2 rounding (host and device share it) against frexp / ldexp, on every
// subnormal scale and on every 251st normal one (an exhaustive run over all finite amax agreed).
TEST(Quant, ScaleRulePow2Bits) {
  const auto by_frexp = [](float s) {
    int e = 0;
    return std::frexp(s, &e) == 0.5f ? s : std::ldexp(1.0f, e);
  };
  for (uint32_t u = 1; u < 0x7f800000u; u += u < 0x800000u ? 1u : 251u) {
    const float s = fp8_bits_float(u);
    ASSERT_EQ(fp8_float_bits(fp8_pow2_round_up(s)), fp8_float_bits(by_frexp(s))) << "s bits " << u;
  }
  EXPECT_EQ(fp8_scale_from_amax(1e-44f, false), std::numeric_limits<float>::denorm_min());  // underflow
  EXPECT_EQ(fp8_scale_from_amax(448.0f * 3.0f, true), 4.0f);
}

TEST(Quant, Blocks1x128AndPadding) {
  for (int64_t cols : {1, 127, 128, 129, 300}) {
    for (bool pow2 : {false, true}) {
      const Tensor x = random_tensor(5, cols, 11 + cols);
      const QuantTensor q = quantize_1x128(x, pow2);
      EXPECT_EQ(q.block_rows, 1);
      EXPECT_EQ(q.block_cols, 128);
      check_quantization(x, false, q);
    }
  }
}

TEST(Quant, Blocks128x128AndPadding) {
  for (int64_t n : {1, 127, 129, 300}) {
    for (bool pow2 : {false, true}) {
      const Tensor w = random_tensor(n, 300 - n / 2, 7 * n);
      const QuantTensor q = quantize_128x128(w, pow2);
      check_quantization(w, false, q);
    }
  }
}

TEST(Quant, OddBlockShapeAndBf16AndF64Inputs) {
  const Tensor x = random_tensor(37, 53, 5);
  QuantTensor q = quant_alloc(37, 53, 4, 16, false);
  quantize_blocks_into(x, false, q);
  check_quantization(x, false, q);
  // BF16 input: identical to quantizing the same values held in F32.
  const Tensor xb = from_float_vector(to_float_vector(x), x.shape(), DType::BF16);
  const Tensor xbf = from_float_vector(to_float_vector(xb), x.shape());
  const QuantTensor a = quantize_1x128(xb, false), b = quantize_1x128(xbf, false);
  EXPECT_EQ(0, std::memcmp(a.data.raw(), b.data.raw(), a.data.nbytes()));
  EXPECT_EQ(0, std::memcmp(a.scales.raw(), b.scales.raw(), a.scales.nbytes()));
  // F64 input holding float values: identical to F32.
  const Tensor xd = from_float_vector(to_float_vector(x), x.shape(), DType::F64);
  const QuantTensor c = quantize_128x128(xd, true), d = quantize_128x128(x, true);
  EXPECT_EQ(0, std::memcmp(c.data.raw(), d.data.raw(), c.data.nbytes()));
  EXPECT_EQ(0, std::memcmp(c.scales.raw(), d.scales.raw(), c.scales.nbytes()));
}

// The transposed 128x128 quantization of W equals quantizing W^T.
TEST(Quant, Transpose128x128IsExact) {
  for (bool pow2 : {false, true}) {
    const Tensor w = random_tensor(200, 300, 3);
    std::vector<float> wt(300 * 200);
    for (int i = 0; i < 200; ++i)
      for (int j = 0; j < 300; ++j) wt[j * 200 + i] = at(w, i, j);
    const QuantTensor t = transpose_128x128(quantize_128x128(w, pow2));
    const QuantTensor r = quantize_128x128(from_float_vector(wt, {300, 200}), pow2);
    ASSERT_EQ(t.data.shape(), r.data.shape());
    ASSERT_EQ(t.scales.shape(), r.scales.shape());
    EXPECT_EQ(0, std::memcmp(t.data.raw(), r.data.raw(), t.data.nbytes()));
    EXPECT_EQ(0, std::memcmp(t.scales.raw(), r.scales.raw(), t.scales.nbytes()));
  }
}

// 1x128 along tokens equals quantize_1x128 of the transposed tensor.
TEST(Quant, AlongTokensEqualsTransposedQuantization) {
  const Tensor x = random_tensor(300, 129, 9);  // [tokens, K]
  std::vector<float> xt(129 * 300);
  for (int i = 0; i < 300; ++i)
    for (int j = 0; j < 129; ++j) xt[j * 300 + i] = at(x, i, j);
  const QuantTensor a = quantize_1x128_tokens(x, false);
  const QuantTensor b = quantize_1x128(from_float_vector(xt, {129, 300}), false);
  ASSERT_EQ(a.data.shape(), (Shape{129, 300}));
  EXPECT_EQ(0, std::memcmp(a.data.raw(), b.data.raw(), a.data.nbytes()));
  EXPECT_EQ(0, std::memcmp(a.scales.raw(), b.scales.raw(), a.scales.nbytes()));
  check_quantization(x, true, a);
}

TEST(Quant, ZeroBlockHasScaleOne) {
  std::vector<float> v(2 * 256, 0.0f);
  for (int j = 128; j < 256; ++j) v[j] = 0.5f * (j - 190);  // second block of row 0 non-zero
  const QuantTensor q = quantize_1x128(from_float_vector(v, {2, 256}), false);
  EXPECT_EQ(scale(q, 0, 0), 1.0f);
  EXPECT_EQ(scale(q, 1, 0), 1.0f);
  EXPECT_EQ(scale(q, 1, 200), 1.0f);
  EXPECT_EQ(scale(q, 0, 200), 0.5f * 65 / 448.0f);
  for (int j = 0; j < 128; ++j) EXPECT_EQ(code(q, 0, j), 0);
}

TEST(Quant, ElementsAreQuantizedWithTheFloatFormula) {
  const Tensor x = random_tensor(3, 260, 21);
  for (bool pow2 : {false, true}) {
    const QuantTensor q = quantize_1x128(x, pow2);
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 260; ++j) ASSERT_EQ(code(q, i, j), e4m3_from_float(at(x, i, j) / scale(q, i, j)));
  }
}

TEST(Quant, NonFiniteInputIsAnError) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> v(4 * 200, 1.0f);
    v[2 * 200 + 150] = bad;
    const Tensor x = from_float_vector(v, {4, 200});
    try {
      quantize_1x128(x, false);
      FAIL() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("[2, 150]"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("activation"), std::string::npos) << e.what();
    }
    EXPECT_THROW(quantize_128x128(x, true), Error);
    EXPECT_THROW(quantize_1x128_tokens(x, false), Error);
  }
  // F64 beyond float range is non-finite as float.
  const Tensor big = from_float_vector(std::vector<float>(8, 1.0f), {2, 4}, DType::F64);
  big.data<double>()[3] = 1e300;
  EXPECT_THROW(quantize_1x128(big, false), Error);
}

TEST(Quant, RejectsMismatchedOutput) {
  const Tensor x = random_tensor(4, 8, 1);
  QuantTensor q = quant_alloc(4, 9, 1, 128, false);
  EXPECT_THROW(quantize_blocks_into(x, false, q), Error);
  QuantTensor t = quant_alloc(4, 8, 1, 128, false);
  EXPECT_THROW(quantize_blocks_into(x, true, t), Error);
}

}  // namespace
}  // namespace fp8rl
