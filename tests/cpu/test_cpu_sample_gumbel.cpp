// The Gumbel-max sampler (Backend::sample_rows, backend/sampling.h) on the CPU reference:
// Philox's known answers, the logarithm and the Gumbel variates, draw frequencies against
// softmax(logits / T) (Pearson chi-square over many keys, T = 1 and 0.7), valid_vocab masking,
// greedy, logp, and mixed batches (top-k / top-p rows take sample()'s inverse-CDF draw).
// Chi-square bounds are the 1e-6 upper quantiles of chi2 with V - 1 degrees of freedom, chosen
// before running; every draw is deterministic (fixed keys), so the tests cannot flake.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/sampling.h"
#include "core/error.h"

namespace fp8rl {
namespace {

using sampling::Philox4;

Tensor logits_tensor(const std::vector<float>& v, int64_t B, int64_t V) {
  Tensor t = Tensor::empty({B, V}, DType::F32);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

Tensor rows_tensor(const std::vector<SampleRow>& rows) {
  Tensor t = Tensor::empty({static_cast<int64_t>(rows.size()), 8}, DType::I32);
  std::memcpy(t.raw(), rows.data(), rows.size() * sizeof(SampleRow));
  return t;
}

SampleRow plain_row(float temperature, uint64_t key, uint32_t counter) {
  SampleRow r;
  r.temperature = temperature;
  r.key_lo = static_cast<uint32_t>(key);
  r.key_hi = static_cast<uint32_t>(key >> 32);
  r.counter = counter;
  return r;
}

// softmax(row / T) in double.
std::vector<double> softmax(const std::vector<float>& row, double T) {
  double mx = -INFINITY, z = 0;
  for (float l : row) mx = std::max(mx, l / T);
  std::vector<double> p(row.size());
  for (size_t j = 0; j < row.size(); ++j) z += (p[j] = std::exp(row[j] / T - mx));
  for (double& e : p) e /= z;
  return p;
}

double chi_square(const std::vector<int64_t>& count, const std::vector<double>& p, int64_t n) {
  double chi2 = 0;
  for (size_t j = 0; j < p.size(); ++j) chi2 += (count[j] - n * p[j]) * (count[j] - n * p[j]) / (n * p[j]);
  return chi2;
}

TEST(SampleGumbel, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32 with 10 rounds.
  const Philox4 a = sampling::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(a.v[0], 0x6627e8d5u);
  EXPECT_EQ(a.v[1], 0xe169c58du);
  EXPECT_EQ(a.v[2], 0xbc57ac4cu);
  EXPECT_EQ(a.v[3], 0x9b00dbd8u);
  const Philox4 b = sampling::philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(b.v[0], 0x408f276du);
  EXPECT_EQ(b.v[1], 0x41c83b0eu);
  EXPECT_EQ(b.v[2], 0xa20bc7c6u);
  EXPECT_EQ(b.v[3], 0x6d5451fdu);
  const Philox4 c = sampling::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u,
                                            0x299f31d0u);
  EXPECT_EQ(c.v[0], 0xd16cfe09u);
  EXPECT_EQ(c.v[1], 0x94fdccebu);
  EXPECT_EQ(c.v[2], 0x5001e420u);
  EXPECT_EQ(c.v[3], 0x24126ea1u);
}

TEST(SampleGumbel, LogIsAccurate) {
  std::mt19937 gen(5);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = 0x00800000u + gen() % (0x7f000000u);  // finite normal positive floats
    float x;
    std::memcpy(&x, &bits, sizeof x);
    const double ref = std::log(static_cast<double>(x));
    const double err = std::fabs(sampling::log_pos(x) - ref) / std::max(std::fabs(ref), 1.0);
    worst = std::max(worst, err);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(sampling::log_pos(1.0f), 0.0f);
  // The exponential variate keeps its relative precision in both tails.
  for (uint32_t h : {0u, 1u, 12345u, 0x7fffffffu, 0x80000000u, 0xfffffff0u, 0xffffffffu}) {
    const double u = (static_cast<double>(h) + 0.5) / 4294967296.0;  // -log(u), u near 1 from 1 - u
    const double want = u > 0.5 ? -std::log1p(-((static_cast<double>(~h) + 0.5) / 4294967296.0)) : -std::log(u);
    EXPECT_NEAR(sampling::exponential_from_bits(h) / want, 1.0, 1e-6) << "h " << h;
  }
  EXPECT_LE(sampling::gumbel_from_bits(0xffffffffu), sampling::kGumbelMax);
}

// The Gumbel variates: 20 bins equiprobable under the Gumbel CDF exp(-exp(-g)).
TEST(SampleGumbel, NoiseIsGumbel) {
  const int kBins = 20;
  const int64_t n = 400000;
  std::vector<double> edge(kBins - 1);
  for (int i = 1; i < kBins; ++i) edge[i - 1] = -std::log(-std::log(static_cast<double>(i) / kBins));
  std::vector<int64_t> count(kBins, 0);
  double mean = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float g = sampling::gumbel_noise(0x1234u, 0x5678u, 7u, static_cast<uint32_t>(i));
    mean += g;
    ++count[std::upper_bound(edge.begin(), edge.end(), static_cast<double>(g)) - edge.begin()];
  }
  EXPECT_NEAR(mean / n, 0.5772156649, 0.01);
  EXPECT_LT(chi_square(count, std::vector<double>(kBins, 1.0 / kBins), n), 63.7);  // 19 dof
}

// Draw frequencies over many keys against softmax(logits / T), T = 1 and 0.7.
TEST(SampleGumbel, FrequenciesFollowSoftmax) {
  auto be = make_cpu_backend();
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f, 0.0f, 2.2f, -0.3f,
                                  0.8f, 1.1f, -2.0f, 0.1f, 1.9f, 0.4f, -0.7f, 1.3f};
  const int64_t V = static_cast<int64_t>(row.size()), N = 60000;
  for (float T : {1.0f, 0.7f}) {
    std::vector<float> lg;
    std::vector<SampleRow> rows;
    for (int64_t i = 0; i < N; ++i) {
      lg.insert(lg.end(), row.begin(), row.end());
      rows.push_back(plain_row(T, 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1), 3u));
    }
    Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
    be->sample_rows(logits_tensor(lg, N, V), rows_tensor(rows), false, tok, lp);
    std::vector<int64_t> count(V, 0);
    for (int64_t i = 0; i < N; ++i) ++count[tok.data<int32_t>()[i]];
    // The draw uses z = logit * fl(1/T): its softmax (equal to softmax(logit / T) to ~1e-7).
    const std::vector<double> p = softmax(row, 1.0 / static_cast<double>(1.0f / T));
    EXPECT_LT(chi_square(count, p, N), 56.5) << "T " << T;  // 15 dof
    // logp: the drawn token's log-prob under softmax(logits / T).
    const std::vector<double> q = softmax(row, T);
    for (int64_t i = 0; i < 50; ++i) {
      const int32_t t = tok.data<int32_t>()[i];
      EXPECT_NEAR(lp.data<float>()[i], std::log(q[t]), 1e-6);
    }
  }
  // The same counter over many positions of one key draws from the same distribution too.
  std::vector<float> lg;
  std::vector<SampleRow> rows;
  for (int64_t i = 0; i < N; ++i) {
    lg.insert(lg.end(), row.begin(), row.end());
    rows.push_back(plain_row(1.0f, 42u, static_cast<uint32_t>(i)));
  }
  Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
  be->sample_rows(logits_tensor(lg, N, V), rows_tensor(rows), false, tok, lp);
  std::vector<int64_t> count(V, 0);
  for (int64_t i = 0; i < N; ++i) ++count[tok.data<int32_t>()[i]];
  EXPECT_LT(chi_square(count, softmax(row, 1.0), N), 56.5);
}

// A wide row (V = 4096, a long tail) with its ids grouped into 32 bins of equal expected mass.
TEST(SampleGumbel, WideRowFrequencies) {
  auto be = make_cpu_backend();
  const int64_t V = 4096, N = 4000;
  std::mt19937 gen(11);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> row(V);
  for (float& l : row) l = nd(gen);
  const std::vector<double> p = softmax(row, 1.0);
  std::vector<float> lg;
  std::vector<SampleRow> rows;
  for (int64_t i = 0; i < N; ++i) {
    lg.insert(lg.end(), row.begin(), row.end());
    rows.push_back(plain_row(1.0f, 1000u + static_cast<uint64_t>(i), 0u));
  }
  Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
  be->sample_rows(logits_tensor(lg, N, V), rows_tensor(rows), false, tok, lp);
  // Bins of consecutive ids, cut where the cumulative mass passes k/32.
  const int kBins = 32;
  std::vector<int> bin(V);
  std::vector<double> pb(kBins, 0.0);
  double cum = 0;
  for (int64_t j = 0; j < V; ++j) {
    const int k = std::min(kBins - 1, static_cast<int>(cum * kBins));
    bin[j] = k;
    pb[k] += p[j];
    cum += p[j];
  }
  std::vector<int64_t> count(kBins, 0);
  for (int64_t i = 0; i < N; ++i) ++count[bin[tok.data<int32_t>()[i]]];
  EXPECT_LT(chi_square(count, pb, N), 83.6);  // 31 dof
}

TEST(SampleGumbel, ValidVocabMasksAndLogpIsOverAllIds) {
  auto be = make_cpu_backend();
  const int64_t V = 40, Vv = 30, N = 2000;
  std::vector<float> row(V);
  for (int64_t j = 0; j < V; ++j) row[j] = j < Vv ? 0.1f * static_cast<float>(j % 7) : 3.0f;  // padding: the largest
  std::vector<float> lg;
  std::vector<SampleRow> rows;
  for (int64_t i = 0; i < N; ++i) {
    lg.insert(lg.end(), row.begin(), row.end());
    rows.push_back(plain_row(i % 2 ? 1.0f : 0.7f, 77u + static_cast<uint64_t>(i), 5u));
  }
  Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
  be->sample_rows(logits_tensor(lg, N, V), rows_tensor(rows), false, tok, lp, Vv);
  for (int64_t i = 0; i < N; ++i) {
    const int32_t t = tok.data<int32_t>()[i];
    ASSERT_LT(t, Vv) << "row " << i;
    const std::vector<double> q = softmax(row, i % 2 ? 1.0 : 0.7);  // over all V ids
    EXPECT_NEAR(lp.data<float>()[i], std::log(q[t]), 1e-6);
  }
  // Greedy is masked too.
  Tensor g1 = be->alloc({1}, DType::I32), l1 = be->alloc({1}, DType::F32);
  be->sample_rows(logits_tensor(row, 1, V), rows_tensor({plain_row(0.0f, 1, 1)}), false, g1, l1, Vv);
  EXPECT_EQ(g1.data<int32_t>()[0], 6);  // 0.6 at ids 6, 13, 20, 27: the lowest
  EXPECT_EQ(l1.data<float>()[0], 0.0f);
}

TEST(SampleGumbel, GreedyIsTheLowestArgmax) {
  auto be = make_cpu_backend();
  const std::vector<float> row = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, -INFINITY};
  Tensor tok = be->alloc({2}, DType::I32), lp = be->alloc({2}, DType::F32);
  std::vector<float> lg = row;
  lg.insert(lg.end(), row.begin(), row.end());
  be->sample_rows(logits_tensor(lg, 2, 6), rows_tensor({plain_row(0.0f, 1, 2), plain_row(0.0f, 3, 4)}), false, tok,
                  lp);
  EXPECT_EQ(tok.data<int32_t>()[0], 1);
  EXPECT_EQ(tok.data<int32_t>()[1], 1);
  EXPECT_EQ(lp.data<float>()[0], 0.0f);
}

// A -inf logit is never drawn; a dominant logit always is; the same key and counter draw the
// same token; the draw is the argmax of sampling.h's scores (restated here).
TEST(SampleGumbel, DrawIsTheScoreArgmax) {
  auto be = make_cpu_backend();
  const int64_t V = 300, N = 64;
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> lg(N * V);
  for (float& l : lg) l = nd(gen);
  for (int64_t i = 0; i < N; ++i) lg[i * V + 17] = -INFINITY;
  std::vector<SampleRow> rows;
  for (int64_t i = 0; i < N; ++i) rows.push_back(plain_row(0.9f, 0xabcdef0123ull + i, static_cast<uint32_t>(100 + i)));
  Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
  be->sample_rows(logits_tensor(lg, N, V), rows_tensor(rows), false, tok, lp);
  Tensor tok2 = be->alloc({N}, DType::I32), lp2 = be->alloc({N}, DType::F32);
  be->sample_rows(logits_tensor(lg, N, V), rows_tensor(rows), false, tok2, lp2);
  const float inv_t = 1.0f / 0.9f;
  for (int64_t i = 0; i < N; ++i) {
    float best = -INFINITY;
    int32_t arg = -1;
    for (int64_t j = 0; j < V; ++j) {
      const float g = sampling::gumbel_noise(rows[i].key_lo, rows[i].key_hi, rows[i].counter, static_cast<uint32_t>(j));
      const float s = sampling::gumbel_score(lg[i * V + j], inv_t, g);
      if (s > best) best = s, arg = static_cast<int32_t>(j);
    }
    EXPECT_EQ(tok.data<int32_t>()[i], arg);
    EXPECT_NE(tok.data<int32_t>()[i], 17);
    EXPECT_EQ(tok2.data<int32_t>()[i], tok.data<int32_t>()[i]);
    EXPECT_EQ(lp2.data<float>()[i], lp.data<float>()[i]);
  }
  std::vector<float> dom(V, 0.0f);
  dom[123] = 60.0f;
  Tensor t1 = be->alloc({1}, DType::I32), l1 = be->alloc({1}, DType::F32);
  be->sample_rows(logits_tensor(dom, 1, V), rows_tensor({plain_row(1.0f, 9, 9)}), false, t1, l1);
  EXPECT_EQ(t1.data<int32_t>()[0], 123);
}

// Mixed batch: truncating rows draw as sample() does with the same uniform; plain rows by
// Gumbel-max; a truncating row without `truncation` and bad parameters are errors.
TEST(SampleGumbel, MixedBatchKeepsTheInverseCdfRows) {
  auto be = make_cpu_backend();
  const int64_t V = 64, B = 6;
  std::mt19937 gen(8);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> lg(B * V);
  for (float& l : lg) l = nd(gen);
  std::vector<SampleRow> rows(B);
  rows[0] = plain_row(1.0f, 5, 6);
  rows[1].temperature = 0.8f, rows[1].top_k = 5, rows[1].uniform = 0.3f;
  rows[2].temperature = 1.2f, rows[2].top_p = 0.9f, rows[2].uniform = 0.7f;
  rows[3] = plain_row(0.0f, 1, 1);
  rows[4].temperature = 1.0f, rows[4].top_k = 3, rows[4].top_p = 0.5f, rows[4].uniform = 0.99f;
  rows[5] = plain_row(0.6f, 7, 8);
  Tensor tok = be->alloc({B}, DType::I32), lp = be->alloc({B}, DType::F32);
  const Tensor logits = logits_tensor(lg, B, V);
  be->sample_rows(logits, rows_tensor(rows), true, tok, lp, 60);
  std::vector<float> temp, top_p, u;
  std::vector<int> top_k;
  for (const SampleRow& r : rows) temp.push_back(r.temperature), top_p.push_back(r.top_p), top_k.push_back(r.top_k),
      u.push_back(r.uniform);
  Tensor rt = be->alloc({B}, DType::I32), rp = be->alloc({B}, DType::F32);
  be->sample(logits, temp, top_p, top_k, u, rt, rp, 60);
  for (int64_t b : {1, 2, 3, 4}) {
    EXPECT_EQ(tok.data<int32_t>()[b], rt.data<int32_t>()[b]) << "row " << b;
    EXPECT_EQ(lp.data<float>()[b], rp.data<float>()[b]) << "row " << b;
  }
  for (int64_t b : {0, 5}) EXPECT_LT(tok.data<int32_t>()[b], 60);
  EXPECT_THROW(be->sample_rows(logits, rows_tensor(rows), false, tok, lp), Error);
  std::vector<SampleRow> bad = rows;
  bad[0].temperature = -1.0f;
  EXPECT_THROW(be->sample_rows(logits, rows_tensor(bad), true, tok, lp), Error);
  bad = rows;
  bad[1].uniform = 1.0f;
  EXPECT_THROW(be->sample_rows(logits, rows_tensor(bad), true, tok, lp), Error);
  std::vector<float> nan_lg = lg;
  nan_lg[5 * V + 3] = NAN;
  EXPECT_THROW(be->sample_rows(logits_tensor(nan_lg, B, V), rows_tensor(rows), true, tok, lp), Error);
  EXPECT_THROW(be->sample_rows(logits, rows_tensor(rows), true, tok, lp, V + 1), Error);
}

// sampling::gumbel_skippable's claim (the GPU kernel leaves such ids out of the argmax): an id
// whose bits pass the filter for a bound scores strictly below that bound, at any logit <= the
// group's largest. Random bits and, above all, bits around the threshold (where the margin
// decides), gaps G = bound - xmax from just above the margin to past kGumbelMax, logits from 1
// to 1e5 (where a score's own rounding is large), four temperatures. And the filter pays: at
// G = 12 nearly every random id is skipped.
TEST(SampleGumbel, SkipFilterIsSound) {
  std::mt19937 gen(21);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits;
  int64_t checked = 0, skipped = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const float inv_t = std::array<float, 4>{0.5f, 1.0f, 1.0f / 0.7f, 3.0f}[trial % 4];
    const float scale = std::pow(10.0f, static_cast<float>(trial % 6));  // 1 .. 1e5
    const float dmax = (unit(gen) * 2.0f - 1.0f) * scale;
    const float xmax = sampling::mul_rn(dmax, inv_t);
    const float gap = trial % 5 == 0 ? unit(gen) * 0.05f : unit(gen) * 25.0f;
    const float bound = sampling::add_rn(xmax, gap);
    const float thr = sampling::gumbel_skip_threshold(bound, xmax);
    if (!(thr < INFINITY)) continue;
    // The bits whose s sits at the threshold, and their neighbours.
    const double at = std::min(4294967295.0, std::max(0.0, static_cast<double>(thr) * 4294967296.0 - 0.5));
    const uint32_t h_at = ~static_cast<uint32_t>(at);
    std::vector<uint32_t> hs;
    for (int k = -300; k <= 300; ++k) hs.push_back(h_at + static_cast<uint32_t>(k * (1 + trial % 97)));
    for (int k = 0; k < 300; ++k) hs.push_back(bits(gen));
    for (uint32_t h : hs) {
      if (!sampling::gumbel_skippable(h, thr)) continue;
      const float g = sampling::gumbel_from_bits(h);
      for (float l : {dmax, sampling::sub_rn(dmax, std::fabs(dmax) * 1e-3f + 1e-3f)}) {
        ASSERT_LT(sampling::gumbel_score(l, inv_t, g), bound)
            << "bits " << h << " skipped at bound " << bound << " (xmax " << xmax << ", threshold " << thr
            << ") but score " << sampling::gumbel_score(l, inv_t, g);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100000);
  for (int i = 0; i < 100000; ++i) skipped += sampling::gumbel_skippable(bits(gen), sampling::gumbel_skip_threshold(22.0f, 10.0f));
  EXPECT_GT(skipped, 99900);  // P(g > 12 - m) ~ 6e-6
  // Nothing is skipped without a real gap (or without a bound yet).
  EXPECT_EQ(sampling::gumbel_skip_threshold(10.0f, 10.0f), INFINITY);
  EXPECT_EQ(sampling::gumbel_skip_threshold(-INFINITY, 3.0f), INFINITY);
  EXPECT_FALSE(sampling::gumbel_skippable(0u, INFINITY));
}

}  // namespace
}  // namespace fp8rl
