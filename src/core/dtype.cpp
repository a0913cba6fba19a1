#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace fp8rl {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::E4M3: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::F64: return 8;
  }
  FP8RL_FAIL("unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::E4M3: return "F8_E4M3";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::F64: return "F64";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), ::tolower);
  if (n == "f64" || n == "float64" || n == "double") return DType::F64;
  if (n == "f32" || n == "float32" || n == "fp32" || n == "float") return DType::F32;
  if (n == "bf16" || n == "bfloat16") return DType::BF16;
  if (n == "f16" || n == "float16" || n == "fp16" || n == "half") return DType::F16;
  if (n == "e4m3" || n == "f8_e4m3" || n == "float8_e4m3fn" || n == "fp8") return DType::E4M3;
  if (n == "i32" || n == "int32") return DType::I32;
  if (n == "i64" || n == "int64") return DType::I64;
  if (n == "u8" || n == "uint8") return DType::U8;
  FP8RL_FAIL("unknown dtype '", name, "' (expected one of f32, bf16, f16, e4m3, i32, i64, u8)");
}

uint16_t bf16_from_float(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even (overflows correctly into inf)
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(man), -24);  // subnormal or zero: exact
    return (sign ? -mag : mag);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f16_from_float(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(x);
  if (std::isnan(x)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds to inf
  if (a < 6.103515625e-05f) {                // subnormal range: multiples of 2^-24
    const float q = std::nearbyint(a * 16777216.0f);  // default rounding mode is RNE
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t au = float_bits(a);
  const uint32_t lsb = (au >> 13) & 1u;
  au += 0xfffu + lsb;
  return sign | static_cast<uint16_t>(((au >> 13) - (112u << 10)) & 0x7fffu);
}

// E4M3 codes: exponent field e in [0, 15], mantissa m in [0, 7].
//   e == 0: subnormal, value m * 2^-9.   e >= 1: (1 + m/8) * 2^(e-7).
//   e == 15 && m == 7 is NaN, so the largest finite is e=15, m=6: 1.75 * 2^8 = 448.
namespace {

// The value of E4M3 code q by the format's definition: m * 2^-9 (e = 0), (8 + m) * 2^(e - 10)
// otherwise, NaN for e = 15, m = 7; the sign applied last (-0 for 0x80). Powers of two by
// repeated halving or doubling, exact in float, so the table is built at compile time.
constexpr float e4m3_value(uint8_t q) {
  const int e = (q >> 3) & 0xf, m = q & 0x7;
  float v = std::numeric_limits<float>::quiet_NaN();
  if (!(e == 15 && m == 7)) {
    v = static_cast<float>(e == 0 ? m : 8 + m);
    for (int k = e == 0 ? -9 : e - 10; k < 0; ++k) v *= 0.5f;
    for (int k = e == 0 ? -9 : e - 10; k > 0; --k) v *= 2.0f;
  }
  return (q & 0x80) ? -v : v;
}

constexpr std::array<float, 256> e4m3_values() {
  std::array<float, 256> t{};
  for (int q = 0; q < 256; ++q) t[static_cast<size_t>(q)] = e4m3_value(static_cast<uint8_t>(q));
  return t;
}

}  // namespace

constinit const std::array<float, 256> kE4M3Values = e4m3_values();
static_assert(e4m3_value(0x7E) == 448.0f && e4m3_value(0x01) == 0.001953125f && e4m3_value(0x08) == 0.015625f &&
              e4m3_value(0x38) == 1.0f && e4m3_value(0xB8) == -1.0f && e4m3_value(0x77) == 240.0f);

uint8_t e4m3_from_float_reference(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (std::isnan(x)) return sign | 0x7f;
  const float a = std::fabs(x);
  if (a >= kE4M3Max) return sign | 0x7e;  // saturate (also +-inf)
  // Quantum of the binade that holds a: below 2^-6 the subnormal quantum 2^-9.
  int exp2;
  std::frexp(a, &exp2);  // a = f * 2^exp2, f in [0.5, 1)
  const int e_unbiased = std::max(exp2 - 1, -6);
  const float quantum = std::ldexp(1.0f, e_unbiased - 3);
  // a / quantum is exact (power-of-two scaling, no underflow here); round half to even.
  const float steps = std::nearbyint(a / quantum);
  const float r = steps * quantum;  // exact; may carry into the next binade (fine)
  if (r > kE4M3Max) return sign | 0x7e;  // cannot happen below 448, kept for safety
  // Encode r exactly.
  if (r == 0.0f) return sign;
  int e2;
  const float f = std::frexp(r, &e2);  // r = f * 2^e2
  int e = e2 - 1 + 7;                  // biased exponent for normal numbers
  if (e <= 0) {                        // subnormal: r = m * 2^-9
    return sign | static_cast<uint8_t>(std::ldexp(r, 9));
  }
  const int m = static_cast<int>((f * 2.0f - 1.0f) * 8.0f);
  return sign | static_cast<uint8_t>((e << 3) | m);
}

// The same rule on the bits (every quantizer's inner loop): NaN and |x| >= 448 first; below
// 2^-6 the quantum is 2^-9, so the code is a * 512 rounded (nearbyint: half to even; 8 is the
// smallest normal's code); above, the float's exponent and top 3 mantissa bits are the code's
// once rebiased (127 -> 7), the 20 dropped bits rounded half to even by one integer add whose
// carry may step into the next binade, as the rounding does.
uint8_t e4m3_from_float(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 = 1.75 * 2^8, +-inf included
  if (a < 0x3c800000u) return sign | static_cast<uint8_t>(std::nearbyint(bits_float(a) * 512.0f));  // < 2^-6
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  return sign | static_cast<uint8_t>((r >> 20) - ((127u - 7u) << 3));
}

}  // namespace fp8rl
