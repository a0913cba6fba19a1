// The Gumbel-max draw of Backend::sample_rows, written once for the host (the CPU reference,
// cpu_sample.cpp) and the device (sample_gumbel_kernels.cu), so that both pick the same token
// from the same logits bit for bit.
//
// Row b draws token = argmax_{i < valid_vocab} score_i, ties to the lowest id, with
//   score_i = fl(logit_i * inv_t) + g_i,   inv_t = fl(1 / temperature),
//   g_i     = gumbel_from_bits(philox4x32_10({i / 4, counter, kGumbelDomain, 0}, {key_lo, key_hi})[i % 4]),
// every step an IEEE-754 binary32 operation rounded to nearest (no contraction: each product
// that meets a sum is an explicit fmaf). Then P(token = i) = softmax(logit * inv_t)_i, up to
// the 32-bit resolution of the uniform (g <= kGumbelMax: a token more than ~23 nats below the
// best score is never drawn; at most V * 1.2e-10 of mass, 2e-5 at V = 152k) and the ~1e-7
// relative error of the logarithms below.
//
// Only integer arithmetic, int -> float conversion (exact: values < 2^24, or IEEE round to
// nearest), +, -, *, / and fmaf: the same bits on any IEEE machine. Not std::log: libm and
// CUDA's logf differ in the last bits.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP8RL_HD __host__ __device__ __forceinline__
#else
#define FP8RL_HD inline
#endif

namespace fp8rl {

// One row of Backend::sample_rows' parameters, as the device reads them (32 bytes: I32 [8]).
struct SampleRow {
  float temperature = 1.0f;  // >= 0; 0 = greedy (the lowest-id argmax, logp = 0)
  float top_p = 1.0f;        // (0, 1]; < 1: the inverse-CDF draw with `uniform`
  int32_t top_k = 0;         // >= 0 (0 = all); > 0: the inverse-CDF draw with `uniform`
  float uniform = 0.0f;      // [0, 1): the inverse-CDF draw's uniform (rows with top-k / top-p)
  uint32_t key_lo = 0;       // Philox key of the Gumbel draw: the sequence (and the run's seed)
  uint32_t key_hi = 0;
  uint32_t counter = 0;      // the Gumbel draw's step: the position of the token being drawn
  uint32_t reserved = 0;     // 0
};
static_assert(sizeof(SampleRow) == 32, "SampleRow is I32 [8] on the device");

// A row takes the Gumbel-max draw (or greedy) unless it truncates: top_k > 0 or top_p < 1.
FP8RL_HD bool sample_row_truncates(const SampleRow& r) {
  return r.temperature != 0.0f && (r.top_k != 0 || r.top_p < 1.0f);
}

namespace sampling {

constexpr uint32_t kGumbelDomain = 0x47554d42u;  // "GUMB": the third counter word
// An upper bound of gumbel_from_bits over all 2^32 inputs (the largest is ~22.87).
constexpr float kGumbelMax = 23.0f;

FP8RL_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FP8RL_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FP8RL_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FP8RL_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
FP8RL_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}
FP8RL_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
FP8RL_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}
FP8RL_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}
// u32 -> float, IEEE round to nearest even (the host's conversion goes through int64: exact).
FP8RL_HD float u32_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint2float_rn(u);
#else
  return static_cast<float>(static_cast<int64_t>(u));
#endif
}

// Philox4x32-10 (Salmon et al., SC'11: Random123's constants; tests check its published
// known-answer vectors).
struct Philox4 {
  uint32_t v[4];
};
FP8RL_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = mulhi32(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = mulhi32(kM1, c2), lo1 = kM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
    k0 += kW0, k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// log(1 + f) for f in [sqrt(1/2) - 1, sqrt(2) - 1]: 2 atanh(t), t = f / (2 + f), |t| <= 0.1716,
// as 2t (1 + t^2/3 + t^4/5 + t^6/7 + t^8/9) (truncation error < 2e-9 relative).
FP8RL_HD float log1p_core(float f) {
  const float t = div_rn(f, add_rn(2.0f, f));
  const float t2 = mul_rn(t, t);
  float p = 0x1.c71c72p-4f;  // 1/9 (float constants in hex: no rounding left to a parser)
  p = fma_rn(p, t2, 0x1.24924ap-3f);
  p = fma_rn(p, t2, 0x1.99999ap-3f);
  p = fma_rn(p, t2, 0x1.555556p-2f);
  p = fma_rn(p, t2, 1.0f);
  return mul_rn(add_rn(t, t), p);
}

// x = (1 + f) 2^e for a finite normal x > 0, with 1 + f in [sqrt(1/2), sqrt(2)) (f exact).
struct LogParts {
  float f;
  int e;
};
FP8RL_HD LogParts log_reduce(float x) {
  const uint32_t u = float_bits(x);
  int e = static_cast<int>(u >> 23) - 127;
  uint32_t mb = (u & 0x007FFFFFu) | 0x3F800000u;  // m in [1, 2)
  if (mb > 0x3FB504F3u) {                          // m > sqrt(2): halve it
    mb -= 0x00800000u;
    e += 1;
  }
  return LogParts{sub_rn(bits_float(mb), 1.0f), e};
}

// e ln2 + log1p(f), e ln2 in two parts (ln2_hi has 16 significant bits: e * ln2_hi is exact
// for |e| < 256; e = 0 adds nothing: fmaf(0, c, y) = y).
FP8RL_HD float log_join(LogParts p) {
  constexpr float kLn2Hi = 0x1.62e4p-1f;     // 0.693145751953125 (0x3F317200)
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;  // ln2 - kLn2Hi, rounded
  const float ef = static_cast<float>(p.e);
  return fma_rn(ef, kLn2Hi, fma_rn(ef, kLn2Lo, log1p_core(p.f)));
}

// log(x) for a finite normal x > 0.
FP8RL_HD float log_pos(float x) { return log_join(log_reduce(x)); }

// E = -log(U) > 0, an Exp(1) variate, from 32 random bits h: U = (h + 1/2) 2^-32 in (0, 1).
// U near 1 (E small: the large tail of the Gumbel draw) keeps its full relative precision
// through the complement S = 1 - U = (~h + 1/2) 2^-32: E = -log1p(-S) for S < 0.29; else
// E = -log(U) with U rounded from h directly (>= 2^-33: the log is finite). Both branches end
// in the one log1p_core (a warp that takes both evaluates it once).
FP8RL_HD float exponential_from_bits(uint32_t h) {
  const float s = fma_rn(u32_to_float(~h), 0x1.0p-32f, 0x1.0p-33f);
  LogParts p{-s, 0};
  if (!(s < 0x1.28f5c2p-2f)) p = log_reduce(fma_rn(u32_to_float(h), 0x1.0p-32f, 0x1.0p-33f));  // 0.29f
  return -log_join(p);
}

// g = -log(E) = -log(-log(U)): a standard Gumbel variate, in [-3.13, 22.88].
FP8RL_HD float gumbel_from_bits(uint32_t h) { return -log_pos(exponential_from_bits(h)); }

// The Gumbel noise of token `id` of a row.
FP8RL_HD float gumbel_noise(uint32_t key_lo, uint32_t key_hi, uint32_t counter, uint32_t id) {
  const Philox4 r = philox4x32_10(id >> 2, counter, kGumbelDomain, 0u, key_lo, key_hi);
  return gumbel_from_bits(r.v[id & 3u]);
}

// The score of a logit: fl(fl(logit * inv_t) + g).
FP8RL_HD float gumbel_score(float logit, float inv_t, float g) { return add_rn(mul_rn(logit, inv_t), g); }

// A filter on the random bits before the two logarithms (the Gumbel-max kernel's cost at a flat
// distribution, where no group's largest logit is far enough below the best score to skip its
// Philox call). With xmax = fl(max logit * inv_t) over a group and `bound` a score some id already
// has, gumbel_skip_threshold returns T such that an id of the group whose bits h give
// s = fl((~h + 1/2) 2^-32) > T (gumbel_skippable) scores strictly below `bound`, so it can be
// left out of the argmax without changing the draw. Why: s is S = 1 - U up to one rounding, and
// E = -log(U) = -log1p(-S) >= S, so g = -log(E) <= -log(S) < G - m when S > exp(-(G - m)), with
// G = bound - xmax; the margin m (0.01 + |bound| 2^-18: far above the logarithms' ~1e-6 absolute
// error in g, the roundings of s, G and the score, and the exp's relative error, whose host and
// device versions differ in the last bits) leaves every skipped score below bound after
// rounding. Returns +inf (nothing skipped) unless G > m. tests/cpu/test_cpu_sample_gumbel.cpp
// checks the claim on random bits, bounds and logits.
FP8RL_HD float gumbel_skip_threshold(float bound, float xmax) {
  const float m = 0.01f + std::fabs(bound) * 0x1.0p-18f;
  const float g = sub_rn(bound, xmax);
  if (!(g > m)) return INFINITY;  // also a NaN / infinite bound or xmax
  return expf(-(g - m));
}
FP8RL_HD bool gumbel_skippable(uint32_t h, float threshold) {
  return fma_rn(u32_to_float(~h), 0x1.0p-32f, 0x1.0p-33f) > threshold;
}

}  // namespace sampling
}  // namespace fp8rl
