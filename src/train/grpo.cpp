#include "train/grpo.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace fp8rl {

// ---- names ---------------------------------------------------------------------------------
const char* advantage_baseline_name(AdvantageBaseline b) {
  return b == AdvantageBaseline::LeaveOneOut ? "leave_one_out" : "group_norm";
}
AdvantageBaseline advantage_baseline_from_name(const std::string& s) {
  if (s == "group_norm") return AdvantageBaseline::GroupNorm;
  if (s == "leave_one_out") return AdvantageBaseline::LeaveOneOut;
  FP8RL_FAIL("unknown advantage baseline '", s, "' (expected group_norm or leave_one_out)");
}
const char* loss_aggregation_name(LossAggregation a) {
  return a == LossAggregation::Sequence ? "sequence" : "token";
}
LossAggregation loss_aggregation_from_name(const std::string& s) {
  if (s == "token") return LossAggregation::Token;
  if (s == "sequence") return LossAggregation::Sequence;
  FP8RL_FAIL("unknown loss aggregation '", s, "' (expected token or sequence)");
}
const char* is_mode_name(IsMode m) {
  switch (m) {
    case IsMode::None: return "none";
    case IsMode::IS: return "is";
    case IsMode::TIS: return "tis";
    case IsMode::Icepop: return "icepop";
    case IsMode::SeqMask: return "seq_mask";
  }
  return "?";
}
IsMode is_mode_from_name(const std::string& s) {
  if (s == "none") return IsMode::None;
  if (s == "is") return IsMode::IS;
  if (s == "tis") return IsMode::TIS;
  if (s == "icepop") return IsMode::Icepop;
  if (s == "seq_mask") return IsMode::SeqMask;
  FP8RL_FAIL("unknown importance sampling mode '", s, "' (expected none, is, tis, icepop or seq_mask)");
}

// ---- advantages ----------------------------------------------------------------------------
std::vector<float> grpo_compute_advantages(std::span<const float> rewards, int group_size,
                                           AdvantageBaseline baseline, double eps) {
  FP8RL_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
  FP8RL_CHECK(rewards.size() % static_cast<size_t>(group_size) == 0, "rewards (", rewards.size(),
              ") are not a whole number of groups of ", group_size);
  FP8RL_CHECK(eps >= 0, "eps must be >= 0");
  std::vector<float> adv(rewards.size(), 0.0f);
  const size_t g = static_cast<size_t>(group_size);
  for (size_t start = 0; start < rewards.size(); start += g) {
    double sum = 0, lo = rewards[start], hi = rewards[start];
    for (size_t i = start; i < start + g; ++i) {
      FP8RL_CHECK(std::isfinite(rewards[i]), "reward ", i, " is not finite (", rewards[i], "): fix the verifier");
      sum += rewards[i];
      lo = std::min<double>(lo, rewards[i]);
      hi = std::max<double>(hi, rewards[i]);
    }
    if (g == 1 || lo == hi) continue;  // no signal: all zero
    const double mean = sum / static_cast<double>(g);
    if (baseline == AdvantageBaseline::LeaveOneOut) {
      for (size_t i = start; i < start + g; ++i)
        adv[i] = static_cast<float>(rewards[i] - (sum - rewards[i]) / static_cast<double>(g - 1));
    } else {
      double ss = 0;
      for (size_t i = start; i < start + g; ++i) ss += (rewards[i] - mean) * (rewards[i] - mean);
      const double sd = std::sqrt(ss / static_cast<double>(g - 1));
      for (size_t i = start; i < start + g; ++i)
        adv[i] = static_cast<float>((rewards[i] - mean) / (sd + eps));
    }
  }
  return adv;
}

// ---- statistics ----------------------------------------------------------------------------
void GrpoStats::merge(const GrpoStats& o) {
  tokens += o.tokens;
  seqs += o.seqs;
  clipped += o.clipped;
  is_tokens += o.is_tokens;
  is_weight_sum += o.is_weight_sum;
  is_weight_min = std::min(is_weight_min, o.is_weight_min);
  is_weight_max = std::max(is_weight_max, o.is_weight_max);
  truncated += o.truncated;
  masked_tokens += o.masked_tokens;
  masked_seqs += o.masked_seqs;
  kl_sum += o.kl_sum;
}

static double ratio_or_nan(double num, int64_t den) {
  return den > 0 ? num / static_cast<double>(den) : std::nan("");
}
double GrpoStats::clip_fraction() const { return ratio_or_nan(static_cast<double>(clipped), tokens); }
double GrpoStats::is_weight_mean() const { return ratio_or_nan(is_weight_sum, is_tokens); }
double GrpoStats::truncated_fraction() const { return ratio_or_nan(static_cast<double>(truncated), tokens); }
double GrpoStats::masked_fraction() const { return ratio_or_nan(static_cast<double>(masked_tokens), tokens); }
double GrpoStats::masked_seq_fraction() const { return ratio_or_nan(static_cast<double>(masked_seqs), seqs); }
double GrpoStats::kl_mean() const { return ratio_or_nan(kl_sum, tokens); }

// ---- loss ----------------------------------------------------------------------------------
void grpo_validate_options(const GrpoLossOptions& o) {
  FP8RL_CHECK(o.ratio_clip_low >= 0 && o.ratio_clip_low < 1, "ratio_clip_low must be in [0, 1), got ", o.ratio_clip_low);
  FP8RL_CHECK(o.ratio_clip_high >= 0, "ratio_clip_high must be >= 0, got ", o.ratio_clip_high);
  FP8RL_CHECK(o.tis_cap > 0, "tis_cap must be > 0, got ", o.tis_cap);
  FP8RL_CHECK(o.icepop_low >= 0 && o.icepop_low < o.icepop_high, "icepop band must satisfy 0 <= low < high, got [",
              o.icepop_low, ", ", o.icepop_high, "]");
  FP8RL_CHECK(o.seq_mask_low > 0 && o.seq_mask_low < o.seq_mask_high,
              "seq_mask band must satisfy 0 < low < high, got [", o.seq_mask_low, ", ", o.seq_mask_high, "]");
  FP8RL_CHECK(o.kl_beta >= 0 && std::isfinite(o.kl_beta), "kl_beta must be finite and >= 0, got ", o.kl_beta);
}

namespace {

void check_batch(const GrpoBatch& b, const GrpoLossOptions& o) {
  FP8RL_CHECK(!b.seq_offsets.empty(), "seq_offsets needs num_seqs + 1 entries (at least {0})");
  FP8RL_CHECK(b.seq_offsets[0] == 0, "seq_offsets[0] must be 0");
  const size_t num_seqs = b.seq_offsets.size() - 1;
  for (size_t i = 0; i < num_seqs; ++i)
    FP8RL_CHECK(b.seq_offsets[i] <= b.seq_offsets[i + 1], "seq_offsets decrease at sequence ", i);
  const size_t n = static_cast<size_t>(b.seq_offsets.back());
  FP8RL_CHECK(b.advantages.size() == num_seqs, "advantages: ", b.advantages.size(), " values for ", num_seqs, " sequences");
  FP8RL_CHECK(b.logp_new.size() == n, "logp_new: ", b.logp_new.size(), " values for ", n, " tokens");
  FP8RL_CHECK(b.logp_old.size() == n, "logp_old: ", b.logp_old.size(), " values for ", n, " tokens");
  FP8RL_CHECK(b.logp_gen.size() == n || (b.logp_gen.empty() && o.is_mode == IsMode::None),
              "logp_gen: ", b.logp_gen.size(), " values for ", n, " tokens (is_mode ", is_mode_name(o.is_mode),
              " needs the generator's log-probs)");
  FP8RL_CHECK(b.logp_ref.size() == n || (b.logp_ref.empty() && o.kl_beta == 0),
              "logp_ref: ", b.logp_ref.size(), " values for ", n, " tokens (kl_beta > 0 needs the reference log-probs)");
  FP8RL_CHECK(b.token_mask.empty() || b.token_mask.size() == n, "token_mask: ", b.token_mask.size(), " values for ", n,
              " tokens");
  for (size_t i = 0; i < num_seqs; ++i)
    FP8RL_CHECK(std::isfinite(b.advantages[i]), "advantage of sequence ", i, " is not finite");
}

bool valid(const GrpoBatch& b, size_t t) { return b.token_mask.empty() || b.token_mask[t] != 0; }

void check_finite(const char* what, std::span<const float> v, size_t t) {
  if (!v.empty() && !std::isfinite(v[t]))
    FP8RL_FAIL_NONFINITE(what, "[", t, "] is not finite (", v[t], "): the engine producing it diverged");
}

}  // namespace

double grpo_loss_normalizer(const GrpoBatch& b, LossAggregation aggregation) {
  FP8RL_CHECK(!b.seq_offsets.empty(), "seq_offsets needs num_seqs + 1 entries (at least {0})");
  double count = 0;
  for (size_t i = 0; i + 1 < b.seq_offsets.size(); ++i) {
    int64_t n_valid = 0;
    for (int64_t t = b.seq_offsets[i]; t < b.seq_offsets[i + 1]; ++t) n_valid += valid(b, static_cast<size_t>(t));
    count += aggregation == LossAggregation::Token ? static_cast<double>(n_valid) : (n_valid > 0 ? 1.0 : 0.0);
  }
  return count;
}

GrpoLossResult grpo_loss(const GrpoBatch& b, const GrpoLossOptions& o, double normalizer) {
  grpo_validate_options(o);
  check_batch(b, o);
  if (normalizer == 0) normalizer = grpo_loss_normalizer(b, o.aggregation);
  FP8RL_CHECK(normalizer >= 0 && std::isfinite(normalizer), "loss normalizer must be finite and >= 0, got ", normalizer);

  GrpoLossResult res;
  res.grad_logp_new.assign(b.logp_new.size(), 0.0f);
  GrpoStats& st = res.stats;
  const double lo = 1.0 - o.ratio_clip_low, hi = 1.0 + o.ratio_clip_high;
  const bool have_gen = !b.logp_gen.empty(), use_kl = o.kl_beta != 0;
  double total = 0;

  for (size_t i = 0; i + 1 < b.seq_offsets.size(); ++i) {
    const size_t t0 = static_cast<size_t>(b.seq_offsets[i]), t1 = static_cast<size_t>(b.seq_offsets[i + 1]);
    int64_t n_valid = 0;
    double log_w_sum = 0;
    for (size_t t = t0; t < t1; ++t) {
      if (!valid(b, t)) continue;
      check_finite("logp_new", b.logp_new, t);
      check_finite("logp_old", b.logp_old, t);
      check_finite("logp_gen", b.logp_gen, t);
      if (use_kl) check_finite("logp_ref", b.logp_ref, t);
      ++n_valid;
      if (have_gen) log_w_sum += static_cast<double>(b.logp_old[t]) - b.logp_gen[t];
    }
    if (n_valid == 0) continue;
    ++st.seqs;
    bool seq_kept = true;
    if (o.is_mode == IsMode::SeqMask) {
      const double geo = std::exp(log_w_sum / static_cast<double>(n_valid));
      seq_kept = geo >= o.seq_mask_low && geo <= o.seq_mask_high;
      if (!seq_kept) ++st.masked_seqs;
    }
    // d loss / d c_t for the tokens of this sequence
    const double scale = o.aggregation == LossAggregation::Token
                             ? 1.0 / normalizer
                             : 1.0 / (static_cast<double>(n_valid) * normalizer);
    const double a = b.advantages[i];
    double seq_sum = 0;
    for (size_t t = t0; t < t1; ++t) {
      if (!valid(b, t)) continue;
      ++st.tokens;
      // importance weight (no gradient)
      double w = 1.0;
      if (have_gen) {
        const double raw = std::exp(static_cast<double>(b.logp_old[t]) - b.logp_gen[t]);
        ++st.is_tokens;
        st.is_weight_sum += raw;
        st.is_weight_min = std::min(st.is_weight_min, raw);
        st.is_weight_max = std::max(st.is_weight_max, raw);
        switch (o.is_mode) {
          case IsMode::None: w = 1.0; break;
          case IsMode::IS: w = raw; break;
          case IsMode::TIS:
            w = std::min(raw, o.tis_cap);
            if (raw > o.tis_cap) ++st.truncated;
            break;
          case IsMode::Icepop:
            w = (raw >= o.icepop_low && raw <= o.icepop_high) ? raw : 0.0;
            if (w == 0.0) ++st.masked_tokens;
            break;
          case IsMode::SeqMask:
            w = seq_kept ? raw : 0.0;
            if (!seq_kept) ++st.masked_tokens;
            break;
        }
      }
      // clipped surrogate
      const double ratio = std::exp(static_cast<double>(b.logp_new[t]) - b.logp_old[t]);
      double surr = 0, dsurr = 0;
      if (a != 0) {
        const double unclipped = ratio * a, clipped = std::clamp(ratio, lo, hi) * a;
        if (unclipped <= clipped) {
          surr = -unclipped;
          dsurr = -unclipped;  // d(-ratio * A)/dlogp_new = -ratio * A
        } else {
          surr = -clipped;  // clip is flat here: no gradient
          ++st.clipped;
        }
      }
      double c = w == 0.0 ? 0.0 : w * surr;
      double dc = w == 0.0 ? 0.0 : w * dsurr;
      if (use_kl) {
        const double d = static_cast<double>(b.logp_ref[t]) - b.logp_new[t];
        const double ed = std::exp(d);
        const double k3 = ed - d - 1.0;
        st.kl_sum += k3;
        c += o.kl_beta * k3;
        dc += o.kl_beta * (1.0 - ed);  // d k3 / d logp_new
      }
      seq_sum += c;
      res.grad_logp_new[t] = static_cast<float>(dc * scale);
    }
    total += seq_sum * scale;
  }
  res.loss = total;
  return res;
}

}  // namespace fp8rl
