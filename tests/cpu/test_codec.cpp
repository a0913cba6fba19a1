// The E4M3 / BF16 codecs (core/dtype.h): properties, hand-picked ties, and the exhaustive
// table produced by torch on the GPU machine when it is committed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "core/dtype.h"

namespace fp8rl {
namespace {

bool is_nan_code(uint8_t q) { return (q & 0x7f) == 0x7f; }

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

TEST(Codec, EveryE4M3CodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t q = static_cast<uint8_t>(c);
    const float v = e4m3_to_float(q);
    if (is_nan_code(q)) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
      continue;
    }
    EXPECT_EQ(e4m3_from_float(v), q) << "code " << c << " value " << v;
  }
}

TEST(Codec, E4M3DecodeIsMonotonicAndKnownValues) {
  // Positive codes 0x00..0x7e increase strictly; the negative ones mirror them.
  for (int c = 1; c <= 0x7e; ++c) EXPECT_LT(e4m3_to_float(c - 1), e4m3_to_float(c)) << c;
  for (int c = 0; c <= 0x7e; ++c) EXPECT_EQ(e4m3_to_float(0x80 | c), -e4m3_to_float(c)) << c;
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x39), 1.125f);
}

// The decode table (built at compile time) is the format's definition, bit for bit: sign,
// 4 exponent bits of bias 7, 3 mantissa bits, subnormals at e = 0, NaN at S.1111.111.
TEST(Codec, E4M3DecodeTableIsTheDefinition) {
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 0xf, m = c & 7;
    float want = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if (c & 0x80) want = -want;
    const float got = e4m3_to_float(static_cast<uint8_t>(c));
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;
      continue;
    }
    EXPECT_EQ(bits_of(got), bits_of(want)) << "code " << c << ": " << got << " vs " << want;
  }
}

// e4m3_from_float (integer rounding on the bits) is the readable by-binade definition, bit for
// bit: at every float exponent, both signs, every top-4 mantissa pattern with the 19 bits below in
// the classes that decide a rounding (exact tie, just above or below it, the binade's ends);
// every 2^-6-subnormal-range float whose low bits are 0 (the ties of a * 512); and 2^24 random
// bit patterns.
TEST(Codec, E4M3EncodeIsItsReferenceBitForBit) {
  int64_t checked = 0, bad = 0;
  auto check = [&](uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    const int got = e4m3_from_float(x), want = e4m3_from_float_reference(x);
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << std::hex << "bits 0x" << u << " (" << x << "): 0x" << got << ", the reference 0x" << want;
    ++checked;
  };
  const uint32_t low[] = {0, 1, 2, 0x3ffff, 0x40000, 0x40001, 0x7fffe, 0x7ffff};
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t e = 0; e < 256; ++e)
      for (uint32_t top = 0; top < 16; ++top)  // mantissa bits 22..19
        for (uint32_t l : low) check(sign | e << 23 | top << 19 | l);
  for (uint32_t u = 0; u < 0x3c800000u; u += 1u << 12) check(u);
  uint64_t z = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < (1 << 24); ++i) {
    z += 0x9e3779b97f4a7c15ull;
    uint64_t y = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    y = (y ^ (y >> 27)) * 0x94d049bb133111ebull;
    check(static_cast<uint32_t>(y ^ (y >> 31)));
  }
  EXPECT_EQ(bad, 0) << "of " << checked;
  EXPECT_GT(checked, (1 << 24) + 240000);
}

TEST(Codec, E4M3EncodeIsMonotonic) {
  // Non-decreasing over a fine sweep of [-500, 500] (codes compared by decoded value).
  float prev = -std::numeric_limits<float>::infinity();
  for (int i = -50000; i <= 50000; ++i) {
    const float x = i * 0.01f;
    const float r = e4m3_round(x);
    EXPECT_GE(r, prev) << x;
    prev = r;
  }
}

TEST(Codec, E4M3Saturates) {
  EXPECT_EQ(e4m3_from_float(448.0f), 0x7e);
  EXPECT_EQ(e4m3_from_float(463.99f), 0x7e);
  EXPECT_EQ(e4m3_from_float(464.0f), 0x7e);
  EXPECT_EQ(e4m3_from_float(1e30f), 0x7e);
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(e4m3_from_float(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(e4m3_from_float(-1000.0f), 0xfe);
}

TEST(Codec, E4M3TiesToEven) {
  const float sub = std::ldexp(1.0f, -9);
  struct Case { float x; float want; };
  const Case cases[] = {
      {1.0625f, 1.0f},           // between 1.0 (m=0) and 1.125 (m=1): even is m=0
      {1.1875f, 1.25f},          // between 1.125 (m=1) and 1.25 (m=2)
      {1.9375f, 2.0f},           // between 1.875 (m=7) and 2.0 (next binade, m=0)
      {17.0f, 16.0f},            // quantum 2 in [16, 32): 17 between 16 (m=0) and 18 (m=1)
      {19.0f, 20.0f},            // between 18 (m=1) and 20 (m=2)
      {432.0f, 448.0f},          // between 416 (m=5) and 448 (m=6)
      {400.0f, 384.0f},          // between 384 (m=4) and 416 (m=5)
      {0.5f * sub, 0.0f},        // between 0 and the smallest subnormal
      {1.5f * sub, 2 * sub},     // between m=1 and m=2 subnormals
      {2.5f * sub, 2 * sub},     // between m=2 and m=3
      {7.5f * sub, 8 * sub},     // between the largest subnormal and the smallest normal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(e4m3_round(c.x), c.want) << c.x;
    EXPECT_EQ(e4m3_round(-c.x), -c.want) << -c.x;
    // Just off the midpoint rounds to the nearer neighbour.
    const float up = std::nextafter(c.x, 1e9f), down = std::nextafter(c.x, 0.0f);
    EXPECT_GE(e4m3_round(up), c.want);
    EXPECT_LE(e4m3_round(down), c.want);
    EXPECT_NE(e4m3_round(up), e4m3_round(down)) << "midpoint " << c.x;
  }
}

TEST(Codec, E4M3ZerosSubnormalsAndNaN) {
  EXPECT_EQ(e4m3_from_float(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(1e-30f), 0x00);   // underflows to +0
  EXPECT_EQ(e4m3_from_float(-1e-30f), 0x80);  // keeps its sign
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(e4m3_from_float(3 * std::ldexp(1.0f, -9)), 0x03);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(e4m3_from_float(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
}

TEST(Codec, E4M3RoundingErrorIsAtMostHalfUlp) {
  // Any x in range: |e4m3(x) - x| <= half the spacing of the binade (2^-10 below 2^-6).
  for (int i = 1; i < 200000; ++i) {
    const float x = std::ldexp(static_cast<float>(i), -12) * 1.0009765625f;
    if (x > 448.0f) break;
    int e;
    std::frexp(x, &e);
    const float half_ulp = x < std::ldexp(1.0f, -6) ? std::ldexp(1.0f, -10) : std::ldexp(1.0f, e - 1 - 4);
    EXPECT_LE(std::fabs(e4m3_round(x) - x), half_ulp) << x;
  }
}

TEST(Codec, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3f80);
  EXPECT_EQ(bf16_from_float(bits_float(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(bf16_from_float(bits_float(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(bf16_from_float(bits_float(0x3f808001u)), 0x3f81);
  EXPECT_EQ(bf16_from_float(bits_float(0x7f7fffffu)), 0x7f80);  // overflow to inf
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every finite BF16 value round-trips
    const float v = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    EXPECT_EQ(bf16_from_float(v), h);
  }
}

TEST(Codec, F16RoundTripsAndRounds) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    EXPECT_EQ(f16_from_float(v), h);
  }
  EXPECT_EQ(f16_from_float(65520.0f), 0x7c00);
  EXPECT_EQ(f16_from_float(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(f16_from_float(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
}

// The exhaustive torch tables, written by scripts/fixtures/make_fixtures.py on the GPU machine:
//   e4m3_from_bf16.bin  65536 bytes: byte i = torch's float8_e4m3fn code of the BF16 bit pattern i,
//                       the value clamped to [-448, 448] first (torch's cast does not saturate;
//                       NaN stays NaN);
//   e4m3_to_f32.bin     256 float32 little-endian: the value of E4M3 code c (torch's decode).
TEST(Codec, E4M3MatchesTorchTable) {
  const std::string dir = std::string(FP8RL_TEST_DATA) + "/fixtures/";
  std::ifstream f(dir + "e4m3_from_bf16.bin", std::ios::binary), g(dir + "e4m3_to_f32.bin", std::ios::binary);
  if (!f || !g) GTEST_SKIP() << "no " << dir << "e4m3_*.bin (generate them with scripts/fixtures/make_fixtures.py on a GPU machine)";
  std::vector<uint8_t> codes(65536);
  std::vector<float> decoded(256);
  f.read(reinterpret_cast<char*>(codes.data()), 65536);
  g.read(reinterpret_cast<char*>(decoded.data()), 256 * 4);
  ASSERT_TRUE(f.good() && g.good()) << dir << "e4m3_*.bin are shorter than 65536 / 1024 bytes";
  int mismatches = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint8_t got = e4m3_from_float(bf16_to_float(static_cast<uint16_t>(h)));
    const uint8_t want = codes[h];
    const bool ok = (is_nan_code(got) && is_nan_code(want)) || got == want;
    if (!ok && ++mismatches <= 10)
      ADD_FAILURE() << "bf16 0x" << std::hex << h << ": torch 0x" << int(want) << ", fp8rl 0x" << int(got);
  }
  EXPECT_EQ(mismatches, 0);
  for (int c = 0; c < 256; ++c) {
    const float got = e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(decoded[c])) EXPECT_TRUE(std::isnan(got)) << c;
    else EXPECT_EQ(float_bits(got), float_bits(decoded[c])) << "code " << c;
  }
}

}  // namespace
}  // namespace fp8rl
