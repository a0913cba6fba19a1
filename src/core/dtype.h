// Element types and the bit-exact scalar codecs of the formats fp8rl uses.
//
// E4M3 is OCP float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; max finite 448;
// no infinities; NaN = 0x7F / 0xFF. Encoding from float rounds to nearest even and
// saturates to +-448 (CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); NaN
// stays NaN. BF16 encoding rounds to nearest even; NaN stays (quiet) NaN.
// These functions are the specification: the CUDA kernels must match them bit for bit.
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include <string>

namespace fp8rl {

// F64 exists for the CPU backend's gradient checks (finite differences in FP64).
enum class DType : uint8_t { F32, BF16, F16, E4M3, I32, I64, U8, F64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // the safetensors spelling ("F32", "BF16", "F8_E4M3", ...)
// Parses "f64", "f32"/"F32"/"float32", "bf16", "f16", "e4m3"/"F8_E4M3", "i32", "i64", "u8"; throws otherwise.
DType dtype_from_name(const std::string& name);

constexpr float kE4M3Max = 448.0f;

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---- BF16 ----
uint16_t bf16_from_float(float x);  // round to nearest even; NaN -> quiet NaN with sign kept
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
inline float bf16_round(float x) { return bf16_to_float(bf16_from_float(x)); }

// ---- F16 (IEEE half) ----
float f16_to_float(uint16_t h);
uint16_t f16_from_float(float x);  // round to nearest even, overflow -> inf

// ---- E4M3 ----
uint8_t e4m3_from_float(float x);  // RNE, saturate to +-448, NaN -> 0x7F|sign
// The same rounding written out by binade (frexp / ldexp / nearbyint): the readable definition
// e4m3_from_float is tested against (tests/cpu/test_codec.cpp), bit for bit.
uint8_t e4m3_from_float_reference(float x);
// The 256 values (+-0, subnormals m * 2^-9, normals (1 + m/8) * 2^(e-7), NaN at 0x7F / 0xFF),
// computed at compile time from the format's definition (dtype.cpp).
extern const std::array<float, 256> kE4M3Values;
inline float e4m3_to_float(uint8_t q) { return kE4M3Values[q]; }  // exact
inline float e4m3_round(float x) { return e4m3_to_float(e4m3_from_float(x)); }

}  // namespace fp8rl
