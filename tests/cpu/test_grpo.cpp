// GRPO loss tests: a 2-sequence, 5-token worked example whose branches (clipped or not,
// truncated, masked) were chosen and worked out by hand; the expected values below are
// written as the closed-form per-token formulas, not computed by the code under test.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "train/grpo.h"

using namespace fp8rl;

namespace {

// ---- the worked example ------------------------------------------------------------------
// seq 0: A = +1.0, tokens 0..1;  seq 1: A = -0.5, tokens 2..4. Clip 0.2/0.2 -> [0.8, 1.2].
//  t  new   old   gen   ratio=e^(new-old)        branch                       w=e^(old-gen)
//  0  -1.0  -1.1  -1.2  e^0.1  = 1.105 (inside) unclipped: s=-A r, ds=-A r    e^0.1 = 1.105
//  1  -0.5  -0.8  -0.7  e^0.3  = 1.350 (>1.2)   clipped (A>0): s=-1.2 A, ds=0 e^-0.1 = 0.905
//  2  -2.0  -1.6  -2.5  e^-0.4 = 0.670 (<0.8)   clipped (A<0): s=-0.8 A, ds=0 e^0.9 = 2.460 (>tis cap 2)
//  3  -0.3  -0.4  -0.4  e^0.1  = 1.105 (inside) unclipped                    1
//  4  -3.0  -3.5  -1.5  e^0.5  = 1.649 (>1.2)   unclipped (A<0: r A < 1.2 A)  e^-2 = 0.135 (<icepop 0.5)
// seq_mask geometric means: seq 0 exp((0.1 - 0.1)/2) = 1 (kept, in [0.999, 1.002]);
// seq 1 exp((0.9 + 0 - 2)/3) = 0.693 (dropped).
const std::vector<float> kNew = {-1.0f, -0.5f, -2.0f, -0.3f, -3.0f};
const std::vector<float> kOld = {-1.1f, -0.8f, -1.6f, -0.4f, -3.5f};
const std::vector<float> kGen = {-1.2f, -0.7f, -2.5f, -0.4f, -1.5f};
const std::vector<float> kRef = {-1.05f, -0.6f, -2.2f, -0.3f, -2.8f};
const std::vector<float> kAdv = {1.0f, -0.5f};
const std::vector<int64_t> kOffsets = {0, 2, 5};

// Exact per-token quantities from the float inputs (so the only tolerance is FP64 rounding).
double r(int t) { return std::exp(static_cast<double>(kNew[t]) - kOld[t]); }
double w(int t) { return std::exp(static_cast<double>(kOld[t]) - kGen[t]); }
const double A0 = 1.0, A1 = -0.5;
// surrogate s_t and ds_t/dlogp_new, by the branches of the table above
double s(int t) {
  switch (t) {
    case 0: return -A0 * r(0);
    case 1: return -1.2 * A0;
    case 2: return -0.8 * A1;
    case 3: return -A1 * r(3);
    default: return -A1 * r(4);
  }
}
double ds(int t) {
  switch (t) {
    case 0: return -A0 * r(0);
    case 3: return -A1 * r(3);
    case 4: return -A1 * r(4);
    default: return 0.0;  // clipped
  }
}

GrpoBatch example_batch(bool with_ref = false) {
  GrpoBatch b;
  b.seq_offsets = kOffsets;
  b.advantages = kAdv;
  b.logp_new = kNew;
  b.logp_old = kOld;
  b.logp_gen = kGen;
  if (with_ref) b.logp_ref = kRef;
  return b;
}

constexpr double kTol = 1e-12;

void expect_grad(const GrpoLossResult& res, const std::vector<double>& expected) {
  ASSERT_EQ(res.grad_logp_new.size(), expected.size());
  for (size_t t = 0; t < expected.size(); ++t)
    EXPECT_NEAR(res.grad_logp_new[t], expected[t], 1e-7 * std::max(1.0, std::fabs(expected[t]))) << "token " << t;
}

}  // namespace

TEST(GrpoAdvantages, GroupNormUsesSampleStd) {
  // group 0: {1, 0, 0, 1}: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.577350269
  // group 1: all equal -> 0; group 2: {0, 0, 0, 2}: mean 0.5, sample std sqrt((3*0.25+2.25)/3) = 1
  const std::vector<float> rewards = {1, 0, 0, 1, 0.7f, 0.7f, 0.7f, 0.7f, 0, 0, 0, 2};
  const auto a = grpo_compute_advantages(rewards, 4, AdvantageBaseline::GroupNorm, 1e-6);
  const double sd0 = std::sqrt(1.0 / 3.0);
  EXPECT_NEAR(a[0], 0.5 / (sd0 + 1e-6), 1e-6);  // 0.866024
  EXPECT_NEAR(a[1], -0.5 / (sd0 + 1e-6), 1e-6);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[i], 0.0f);
  EXPECT_NEAR(a[8], -0.5 / (1.0 + 1e-6), 1e-6);
  EXPECT_NEAR(a[11], 1.5 / (1.0 + 1e-6), 1e-6);
}

TEST(GrpoAdvantages, LeaveOneOut) {
  // A_i = r_i - mean of the others: {1,0,0,1} -> 1 - 1/3, 0 - 2/3, ...; {0,0,0,2} -> -2/3, 2
  const std::vector<float> rewards = {1, 0, 0, 1, 0, 0, 0, 2};
  const auto a = grpo_compute_advantages(rewards, 4, AdvantageBaseline::LeaveOneOut);
  EXPECT_NEAR(a[0], 2.0 / 3.0, 1e-7);
  EXPECT_NEAR(a[1], -2.0 / 3.0, 1e-7);
  EXPECT_NEAR(a[4], -2.0 / 3.0, 1e-7);
  EXPECT_NEAR(a[7], 2.0, 1e-7);
}

TEST(GrpoAdvantages, RejectsBadInput) {
  const std::vector<float> rewards = {1, 0, 0};
  EXPECT_THROW(grpo_compute_advantages(rewards, 2, AdvantageBaseline::GroupNorm), Error);
  const std::vector<float> nan_r = {1, NAN};
  EXPECT_THROW(grpo_compute_advantages(nan_r, 2, AdvantageBaseline::GroupNorm), Error);
  const std::vector<float> single = {3, 5};
  const auto a = grpo_compute_advantages(single, 1, AdvantageBaseline::LeaveOneOut);
  EXPECT_EQ(a[0], 0.0f);  // a group of one has no baseline
}

TEST(GrpoLoss, NoCorrectionTokenMean) {
  GrpoLossOptions o;
  const auto res = grpo_loss(example_batch(), o);
  EXPECT_NEAR(res.loss, (s(0) + s(1) + s(2) + s(3) + s(4)) / 5, kTol);
  expect_grad(res, {ds(0) / 5, 0, 0, ds(3) / 5, ds(4) / 5});
  EXPECT_EQ(res.stats.tokens, 5);
  EXPECT_EQ(res.stats.clipped, 2);  // tokens 1 and 2
  EXPECT_DOUBLE_EQ(res.stats.clip_fraction(), 0.4);
  // The IS statistics are logged even when no correction is applied.
  EXPECT_NEAR(res.stats.is_weight_mean(), (w(0) + w(1) + w(2) + w(3) + w(4)) / 5, kTol);
  EXPECT_NEAR(res.stats.is_weight_min, w(4), kTol);
  EXPECT_NEAR(res.stats.is_weight_max, w(2), kTol);
}

TEST(GrpoLoss, PlainImportanceSampling) {
  GrpoLossOptions o;
  o.is_mode = IsMode::IS;
  const auto res = grpo_loss(example_batch(), o);
  double sum = 0;
  for (int t = 0; t < 5; ++t) sum += w(t) * s(t);
  EXPECT_NEAR(res.loss, sum / 5, kTol);
  expect_grad(res, {w(0) * ds(0) / 5, 0, 0, w(3) * ds(3) / 5, w(4) * ds(4) / 5});
  EXPECT_EQ(res.stats.truncated, 0);
  EXPECT_EQ(res.stats.masked_tokens, 0);
}

TEST(GrpoLoss, TruncatedImportanceSampling) {
  GrpoLossOptions o;
  o.is_mode = IsMode::TIS;
  o.tis_cap = 2.0;  // only w(2) = 2.46 exceeds it
  const auto res = grpo_loss(example_batch(), o);
  EXPECT_NEAR(res.loss, (w(0) * s(0) + w(1) * s(1) + 2.0 * s(2) + w(3) * s(3) + w(4) * s(4)) / 5, kTol);
  expect_grad(res, {w(0) * ds(0) / 5, 0, 0, w(3) * ds(3) / 5, w(4) * ds(4) / 5});
  EXPECT_EQ(res.stats.truncated, 1);
  EXPECT_DOUBLE_EQ(res.stats.truncated_fraction(), 0.2);
}

TEST(GrpoLoss, Icepop) {
  GrpoLossOptions o;
  o.is_mode = IsMode::Icepop;  // [0.5, 5]: token 4 (w = 0.135) is masked
  const auto res = grpo_loss(example_batch(), o);
  EXPECT_NEAR(res.loss, (w(0) * s(0) + w(1) * s(1) + w(2) * s(2) + w(3) * s(3)) / 5, kTol);
  expect_grad(res, {w(0) * ds(0) / 5, 0, 0, w(3) * ds(3) / 5, 0});
  EXPECT_EQ(res.stats.masked_tokens, 1);
  EXPECT_DOUBLE_EQ(res.stats.masked_fraction(), 0.2);
}

TEST(GrpoLoss, SequenceMask) {
  GrpoLossOptions o;
  o.is_mode = IsMode::SeqMask;  // [0.999, 1.002]: seq 0 kept (geo mean 1), seq 1 dropped (0.693)
  const auto res = grpo_loss(example_batch(), o);
  // kept sequences use the plain per-token weight; the dropped one still counts in the mean
  EXPECT_NEAR(res.loss, (w(0) * s(0) + w(1) * s(1)) / 5, kTol);
  expect_grad(res, {w(0) * ds(0) / 5, 0, 0, 0, 0});
  EXPECT_EQ(res.stats.masked_seqs, 1);
  EXPECT_EQ(res.stats.masked_tokens, 3);
  EXPECT_DOUBLE_EQ(res.stats.masked_seq_fraction(), 0.5);
  // A band wide enough for both keeps everything: identical to plain IS.
  o.seq_mask_low = 0.5;
  o.seq_mask_high = 1.5;
  GrpoLossOptions is;
  is.is_mode = IsMode::IS;
  EXPECT_NEAR(grpo_loss(example_batch(), o).loss, grpo_loss(example_batch(), is).loss, kTol);
}

TEST(GrpoLoss, SequenceAggregation) {
  GrpoLossOptions o;
  o.aggregation = LossAggregation::Sequence;
  const auto res = grpo_loss(example_batch(), o);
  // mean over each sequence, then over the 2 sequences
  EXPECT_NEAR(res.loss, ((s(0) + s(1)) / 2 + (s(2) + s(3) + s(4)) / 3) / 2, kTol);
  expect_grad(res, {ds(0) / 4, 0, 0, ds(3) / 6, ds(4) / 6});
  // with TIS on top
  o.is_mode = IsMode::TIS;
  const auto tis = grpo_loss(example_batch(), o);
  EXPECT_NEAR(tis.loss, ((w(0) * s(0) + w(1) * s(1)) / 2 + (2.0 * s(2) + w(3) * s(3) + w(4) * s(4)) / 3) / 2, kTol);
}

TEST(GrpoLoss, KlPenaltyK3) {
  GrpoLossOptions o;
  o.kl_beta = 0.1;
  const auto res = grpo_loss(example_batch(true), o);
  // d = ref - new = {-0.05, -0.1, -0.2, 0, 0.2}; k3 = e^d - d - 1; dk3/dnew = 1 - e^d
  double sum = 0, kl = 0;
  std::vector<double> g(5);
  for (int t = 0; t < 5; ++t) {
    const double d = static_cast<double>(kRef[t]) - kNew[t];
    const double k3 = std::exp(d) - d - 1;
    sum += s(t) + 0.1 * k3;
    kl += k3;
    g[t] = (ds(t) + 0.1 * (1 - std::exp(d))) / 5;
  }
  EXPECT_NEAR(res.loss, sum / 5, kTol);
  expect_grad(res, g);
  EXPECT_NEAR(res.stats.kl_mean(), kl / 5, kTol);
  // hand value of the k3 mean: (0.0012294 + 0.0048374 + 0.0187308 + 0 + 0.0214028) / 5
  EXPECT_NEAR(res.stats.kl_mean(), 0.00924008, 1e-6);
  // the reference log-probs are required when beta > 0
  EXPECT_THROW(grpo_loss(example_batch(false), o), Error);
}

TEST(GrpoLoss, TokenMaskExcludesTokens) {
  // Masking token 4 out must equal the 4-token batch without it.
  const std::vector<uint8_t> mask = {1, 1, 1, 1, 0};
  GrpoBatch b = example_batch();
  b.token_mask = mask;
  GrpoLossOptions o;
  const auto res = grpo_loss(b, o);
  EXPECT_NEAR(res.loss, (s(0) + s(1) + s(2) + s(3)) / 4, kTol);
  expect_grad(res, {ds(0) / 4, 0, 0, ds(3) / 4, 0});
  EXPECT_EQ(res.stats.tokens, 4);
}

TEST(GrpoLoss, MicroBatchesAddUpToTheWholeBatch) {
  for (auto agg : {LossAggregation::Token, LossAggregation::Sequence}) {
    GrpoLossOptions o;
    o.aggregation = agg;
    o.is_mode = IsMode::TIS;
    o.kl_beta = 0.05;
    const auto whole = grpo_loss(example_batch(true), o);
    // split: sequence 0 alone, sequence 1 alone, with the whole batch's normalizer
    const std::vector<int64_t> off0 = {0, 2}, off1 = {0, 3};
    GrpoBatch b0, b1;
    b0.seq_offsets = off0;
    b0.advantages = std::span(kAdv).subspan(0, 1);
    b0.logp_new = std::span(kNew).subspan(0, 2);
    b0.logp_old = std::span(kOld).subspan(0, 2);
    b0.logp_gen = std::span(kGen).subspan(0, 2);
    b0.logp_ref = std::span(kRef).subspan(0, 2);
    b1.seq_offsets = off1;
    b1.advantages = std::span(kAdv).subspan(1, 1);
    b1.logp_new = std::span(kNew).subspan(2, 3);
    b1.logp_old = std::span(kOld).subspan(2, 3);
    b1.logp_gen = std::span(kGen).subspan(2, 3);
    b1.logp_ref = std::span(kRef).subspan(2, 3);
    const double norm = grpo_loss_normalizer(b0, agg) + grpo_loss_normalizer(b1, agg);
    EXPECT_EQ(norm, agg == LossAggregation::Token ? 5.0 : 2.0);
    const auto r0 = grpo_loss(b0, o, norm), r1 = grpo_loss(b1, o, norm);
    EXPECT_NEAR(r0.loss + r1.loss, whole.loss, kTol);
    for (int t = 0; t < 2; ++t) EXPECT_EQ(r0.grad_logp_new[t], whole.grad_logp_new[t]);
    for (int t = 0; t < 3; ++t) EXPECT_EQ(r1.grad_logp_new[t], whole.grad_logp_new[2 + t]);
    GrpoStats merged = r0.stats;
    merged.merge(r1.stats);
    EXPECT_EQ(merged.tokens, whole.stats.tokens);
    EXPECT_EQ(merged.clipped, whole.stats.clipped);
    EXPECT_EQ(merged.truncated, whole.stats.truncated);
    EXPECT_EQ(merged.is_weight_max, whole.stats.is_weight_max);
    EXPECT_NEAR(merged.kl_sum, whole.stats.kl_sum, kTol);
  }
}

TEST(GrpoLoss, GradientMatchesFiniteDifferences) {
  // Random batch, every mode and both aggregations, with KL: central differences of the loss
  // with respect to each logp_new (tokens within 1e-2 of a clip boundary are skipped: kink).
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::vector<int64_t> offsets = {0, 3, 4, 9, 13};
  const int n = 13;
  std::vector<float> lnew(n), lold(n), lgen(n), lref(n), adv = {0.8f, -1.3f, 0.4f, -0.2f};
  for (int t = 0; t < n; ++t) {
    lold[t] = -1.5f + 0.5f * nd(rng);
    lnew[t] = lold[t] + 0.25f * nd(rng);
    lgen[t] = lold[t] + 0.3f * nd(rng);
    lref[t] = lold[t] + 0.3f * nd(rng);
  }
  for (auto agg : {LossAggregation::Token, LossAggregation::Sequence}) {
    for (auto mode : {IsMode::None, IsMode::IS, IsMode::TIS, IsMode::Icepop, IsMode::SeqMask}) {
      GrpoLossOptions o;
      o.aggregation = agg;
      o.is_mode = mode;
      o.tis_cap = 1.2;
      o.icepop_low = 0.8;
      o.icepop_high = 1.25;
      o.seq_mask_low = 0.8;
      o.seq_mask_high = 1.1;
      o.kl_beta = 0.2;
      GrpoBatch b;
      b.seq_offsets = offsets;
      b.advantages = adv;
      b.logp_new = lnew;
      b.logp_old = lold;
      b.logp_gen = lgen;
      b.logp_ref = lref;
      const auto res = grpo_loss(b, o);
      int checked = 0, nonzero = 0;
      for (int t = 0; t < n; ++t) {
        const double ratio = std::exp(static_cast<double>(lnew[t]) - lold[t]);
        if (std::fabs(ratio - 0.8) < 1e-2 || std::fabs(ratio - 1.2) < 1e-2) continue;
        std::vector<float> plus = lnew, minus = lnew;
        plus[t] = lnew[t] + 1e-3f;
        minus[t] = lnew[t] - 1e-3f;
        const double h2 = static_cast<double>(plus[t]) - minus[t];  // the step actually taken
        b.logp_new = plus;
        const double lp = grpo_loss(b, o).loss;
        b.logp_new = minus;
        const double lm = grpo_loss(b, o).loss;
        b.logp_new = lnew;
        const double fd = (lp - lm) / h2;
        EXPECT_NEAR(res.grad_logp_new[t], fd, 1e-6) << "token " << t << " mode " << is_mode_name(mode) << " agg "
                                                    << loss_aggregation_name(agg);
        ++checked;
        nonzero += std::fabs(fd) > 1e-4;
      }
      EXPECT_GE(checked, 10);
      EXPECT_GE(nonzero, 5);  // the check is not vacuous
    }
  }
}

TEST(GrpoLoss, RejectsBadInput) {
  GrpoLossOptions o;
  o.is_mode = IsMode::TIS;
  GrpoBatch b = example_batch();
  b.logp_gen = {};
  EXPECT_THROW(grpo_loss(b, o), Error);  // TIS needs logp_gen
  b = example_batch();
  std::vector<float> bad = kNew;
  bad[3] = NAN;
  b.logp_new = bad;
  try {
    grpo_loss(b, o);
    FAIL() << "a NaN log-prob must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logp_new[3]"), std::string::npos) << e.what();
  }
  b = example_batch();
  const std::vector<int64_t> off = {0, 2, 6};
  b.seq_offsets = off;
  EXPECT_THROW(grpo_loss(b, o), Error);  // offsets past the tokens
  o.icepop_low = 2;
  o.icepop_high = 1;
  EXPECT_THROW(grpo_validate_options(o), Error);
  EXPECT_THROW(is_mode_from_name("icepopp"), Error);
}
