// fp8_rule.h's Fp8Divisor: the quantizer's quotients x / s without a division per element (the
// GPU kernels' form; the CPU reference divides). Checked here on the host, with the same
// arithmetic the device runs (IEEE products and FMAs, a correctly rounded reciprocal):
//   - bitwise x / s for every x significand against the scale significands whose reciprocals
//     round worst (Markstein's correction is hardest there), and random pairs over the domain;
//   - the E4M3 code of every quotient equals that of x / s for any float x and scale (zeros,
//     subnormals, non-finite input, quotients past 448, scales outside the fast domain).
// docs/benchmarks.md (session 17) records the larger offline sweep behind the claim in fp8_rule.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "quant/fp8_rule.h"

namespace fp8rl {
namespace {

float from_bits(uint32_t u) { return fp8_bits_float(u); }
uint32_t bits(float x) { return fp8_float_bits(x); }

// The n significands m of s = 1.m whose reciprocals 1 / s (as the divisor computes it) are
// farthest from the true ones, in ulps: the scales where q0 = x r starts farthest from x / s.
std::vector<uint32_t> worst_reciprocal_significands(int n) {
  std::vector<std::pair<double, uint32_t>> err;  // the candidates past 0.4999 ulp (a few thousand)
  for (uint32_t m = 0; m < (1u << 23); ++m) {
    const float s = from_bits(0x3f800000u | m);
    const float r = 1.0f / s;
    const double ulp = std::ldexp(1.0, std::ilogb(r) - 23);
    const double e = std::fabs(static_cast<double>(r) - 1.0 / static_cast<double>(s)) / ulp;
    if (e > 0.4999) err.emplace_back(e, m);
  }
  EXPECT_GE(err.size(), static_cast<size_t>(n));
  n = std::min<int>(n, static_cast<int>(err.size()));
  std::partial_sort(err.begin(), err.begin() + n, err.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<uint32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(err[i].second);
  return out;
}

// A quotient through the 8-wide form (the kernels' encode8), element i of a group of 8 whose
// other members are harmless: the fast path's per-group test then depends on x alone.
float quotient8(const Fp8Divisor& d, float x, int i) {
  float in[8] = {0.5f, -0.25f, 0.0f, 1.0f, -1.0f, 0.125f, 2.0f, -3.0f}, out[8];
  for (float& v : in) v *= d.scale();
  in[i] = x;
  d.quotients<8>(in, out);
  return out[i];
}

// Every x significand (x in [1, 2): by scaling, every binade) against the 4 scale significands
// whose reciprocals round worst, plus the all-ones and smallest ones: x / s bit for bit (the
// offline sweep of docs/benchmarks.md, session 17, covered the worst 400).
TEST(Fp8Divisor, EveryXAgainstTheHardestScales) {
  std::vector<uint32_t> ms = worst_reciprocal_significands(4);
  for (uint32_t m : {0x7fffffu, 0x000001u}) ms.push_back(m);
  int64_t checked = 0;
  for (uint32_t m : ms) {
    for (int e : {-40, 0, 37}) {  // the scale's binade does not matter inside [2^-64, 2^64]
      const float s = std::ldexp(from_bits(0x3f800000u | m), e);
      const Fp8Divisor d(s);
      int bad = 0;
      for (uint32_t u = 0x3f800000u; u < 0x40000000u; u += (e == 0 ? 1 : 61)) {
        const float x = std::ldexp(from_bits(u), e);  // x / s in (1/2, 2)
        const float q = d(x), ref = x / s;
        if (bits(q) != bits(ref) && bad++ < 3)
          ADD_FAILURE() << std::hexfloat << "s " << s << " x " << x << ": " << q << " vs " << ref;
        ++checked;
      }
      ASSERT_EQ(bad, 0) << std::hexfloat << "s " << s;
    }
  }
  EXPECT_GT(checked, int64_t{6} * (1 << 23));
}

// Random scales over the fast domain and x over every quotient binade E4M3 can tell apart
// (2^-11 .. 448), both signs, single and 8-wide: x / s bit for bit.
TEST(Fp8Divisor, RandomPairsAreTheDivision) {
  std::mt19937 gen(17);
  std::uniform_int_distribution<uint32_t> man(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> se(-64, 63), qe(-11, 8), lane(0, 7);
  for (int i = 0; i < 2000000; ++i) {
    const float s = std::ldexp(from_bits(0x3f800000u | man(gen)), se(gen));
    const Fp8Divisor d(s);
    float x = std::ldexp(from_bits(0x3f800000u | man(gen)), qe(gen)) * s;
    if (i & 1) x = -x;
    if (!std::isfinite(x) || x == 0.0f) continue;
    const float ref = x / s;
    ASSERT_EQ(bits(d(x)), bits(ref)) << std::hexfloat << "s " << s << " x " << x;
    ASSERT_EQ(bits(quotient8(d, x, lane(gen))), bits(ref)) << std::hexfloat << "s " << s << " x " << x;
  }
}

// The codes of any float x by any positive scale equal the division's: signed zeros, x / s below
// E4M3's resolution or in FP32's subnormal range, past 448 or overflowing, non-finite x, and
// scales outside [2^-64, 2^64] (the division itself) or at its edges.
TEST(Fp8Divisor, CodesEqualTheDivisionsEverywhere) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> scales = {1.0f,   0x1p-64f, 0x1p64f, 0x1.fffffep-65f, 0x1.000002p64f,  0x1p-149f,  0x1p-126f,
                               3e-39f, 1e-30f,   1e30f,   3e38f,           448.0f / 448.0f, 0.0078125f, 1.0f / 448.0f};
  std::mt19937 gen(5);
  std::uniform_int_distribution<uint32_t> any(0, 0x7f7fffffu);
  for (int i = 0; i < 200; ++i) scales.push_back(from_bits(any(gen)));  // any positive finite scale
  std::vector<float> xs = {0.0f, -0.0f, inf, -inf, nan, -nan, 0x1p-149f, -0x1p-149f, 0x1p-126f, 3.4e38f, -3.4e38f};
  for (int i = 0; i < 400; ++i) xs.push_back(from_bits(any(gen) | (i & 1 ? 0x80000000u : 0u)));
  for (float s : scales) {
    if (!(s > 0.0f)) continue;
    const Fp8Divisor d(s);
    std::vector<float> xx = xs;
    for (float k : {1.0f, 0.5f, 448.0f, 464.0f, 0x1p-10f, 0x1p-11f, 0x1.8p-10f, 1e-20f})
      for (float sign : {1.0f, -1.0f}) xx.push_back(sign * k * s);  // E4M3 rounding edges, as quotients
    for (float x : xx) {
      const float ref = x / s;
      for (int lane : {0, 5}) {
        const float q = lane ? quotient8(d, x, lane) : d(x);
        ASSERT_EQ(e4m3_from_float(q), e4m3_from_float(ref)) << std::hexfloat << "s " << s << " x " << x;
        if (std::isnan(ref)) continue;
        if (s >= 0x1p-64f && s <= 0x1p64f && std::fabs(ref) >= 0x1p-11f && std::fabs(ref) < 0x1p32f) {
          ASSERT_EQ(bits(q), bits(ref)) << std::hexfloat << "s " << s << " x " << x;
        }
        EXPECT_EQ(std::signbit(q), std::signbit(ref)) << std::hexfloat << "s " << s << " x " << x;
      }
    }
  }
}

}  // namespace
}  // namespace fp8rl
