#include "rl/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"

namespace fp8rl {

MismatchMetrics metrics_compute_mismatch(std::span<const float> logp_old, std::span<const float> logp_gen,
                                         std::span<const uint8_t> token_mask) {
  FP8RL_CHECK(logp_old.size() == logp_gen.size(), "logp_old has ", logp_old.size(), " tokens, logp_gen ",
              logp_gen.size());
  FP8RL_CHECK(token_mask.empty() || token_mask.size() == logp_old.size(), "token_mask has ", token_mask.size(),
              " entries for ", logp_old.size(), " tokens");
  MismatchMetrics m;
  double mult = 0, gen_kl = 0, pol_kl = 0;
  for (size_t t = 0; t < logp_old.size(); ++t) {
    if (!token_mask.empty() && token_mask[t] == 0) continue;
    if (!std::isfinite(logp_old[t]) || !std::isfinite(logp_gen[t]))
      FP8RL_FAIL_NONFINITE("log-prob of token ", t, " is not finite (old ", logp_old[t], ", gen ", logp_gen[t],
                 "): one engine diverged");
    const double log_r = static_cast<double>(logp_old[t]) - logp_gen[t];  // log(train / gen)
    mult += std::exp(std::fabs(log_r));
    gen_kl += std::expm1(log_r) - log_r;    // r - 1 - log r
    pol_kl += std::expm1(-log_r) + log_r;   // 1/r - 1 + log r
    m.max_abs_logp_diff = std::max(m.max_abs_logp_diff, std::fabs(log_r));
    ++m.tokens;
  }
  const double n = static_cast<double>(m.tokens);
  m.token_mult_prob_error = m.tokens ? mult / n : std::nan("");
  m.gen_kl_error = m.tokens ? gen_kl / n : std::nan("");
  m.policy_kl_error = m.tokens ? pol_kl / n : std::nan("");
  return m;
}

RoutingMetrics metrics_compute_routing(std::span<const float> logp_old, std::span<const float> logp_gen,
                                       std::span<const uint8_t> agreed, int64_t pairs, int64_t pairs_agreed,
                                       int64_t pairs_router_agreed) {
  FP8RL_CHECK(agreed.size() == logp_old.size(), "routing agreement: ", agreed.size(), " token flags for ",
              logp_old.size(), " tokens");
  FP8RL_CHECK(pairs >= 0 && pairs_agreed >= 0 && pairs_agreed <= pairs && pairs_router_agreed >= 0 &&
                  pairs_router_agreed <= pairs,
              "routing agreement: counts ", pairs_agreed, ", ", pairs_router_agreed, " of ", pairs, " pairs");
  RoutingMetrics r;
  const double nan = std::nan("");
  r.agreement = pairs ? static_cast<double>(pairs_agreed) / static_cast<double>(pairs) : nan;
  r.router_agreement = pairs ? static_cast<double>(pairs_router_agreed) / static_cast<double>(pairs) : nan;
  std::vector<uint8_t> differs(agreed.size());
  int64_t n_agreed = 0;
  for (size_t t = 0; t < agreed.size(); ++t) {
    n_agreed += agreed[t] != 0;
    differs[t] = agreed[t] == 0;
  }
  r.agreed_token_fraction = agreed.empty() ? nan : static_cast<double>(n_agreed) / static_cast<double>(agreed.size());
  r.agreed = metrics_compute_mismatch(logp_old, logp_gen, agreed);
  r.differs = metrics_compute_mismatch(logp_old, logp_gen, differs);
  return r;
}

double metrics_masked_mean(std::span<const float> values, std::span<const uint8_t> token_mask) {
  FP8RL_CHECK(token_mask.empty() || token_mask.size() == values.size(), "token_mask has ", token_mask.size(),
              " entries for ", values.size(), " values");
  double sum = 0;
  int64_t n = 0;
  for (size_t t = 0; t < values.size(); ++t) {
    if (!token_mask.empty() && token_mask[t] == 0) continue;
    FP8RL_CHECK(std::isfinite(values[t]), "value ", t, " is not finite (", values[t], ")");
    sum += values[t];
    ++n;
  }
  return n ? sum / static_cast<double>(n) : std::nan("");
}

LengthStats metrics_length_stats(std::span<const int64_t> lengths, int64_t max_new_tokens) {
  LengthStats s;
  s.count = static_cast<int64_t>(lengths.size());
  if (lengths.empty()) {
    s.mean = s.std = s.capped_fraction = std::nan("");
    return s;
  }
  double sum = 0;
  int64_t capped = 0;
  s.min = s.max = lengths[0];
  for (int64_t l : lengths) {
    FP8RL_CHECK(l >= 0, "negative response length ", l);
    sum += static_cast<double>(l);
    s.min = std::min(s.min, l);
    s.max = std::max(s.max, l);
    if (max_new_tokens > 0 && l >= max_new_tokens) ++capped;
  }
  s.mean = sum / static_cast<double>(s.count);
  double ss = 0;
  for (int64_t l : lengths) ss += (static_cast<double>(l) - s.mean) * (static_cast<double>(l) - s.mean);
  s.std = std::sqrt(ss / static_cast<double>(s.count));
  s.capped_fraction = static_cast<double>(capped) / static_cast<double>(s.count);
  return s;
}

double metrics_mean(std::span<const float> values) { return metrics_masked_mean(values, {}); }

double metrics_accuracy(std::span<const uint8_t> correct) {
  if (correct.empty()) return std::nan("");
  int64_t k = 0;
  for (uint8_t c : correct) k += c != 0;
  return static_cast<double>(k) / static_cast<double>(correct.size());
}

std::optional<std::string> NoSignalWatch::record(int64_t step, std::span<const float> rewards, int group,
                                                 double grad_norm) {
  bool flat = group > 0 && !rewards.empty() && grad_norm == 0.0;
  float lo = rewards.empty() ? 0.f : rewards[0], hi = lo;
  for (size_t i = 0; flat && i < rewards.size(); ++i) {
    if (rewards[i] != rewards[i - i % static_cast<size_t>(group)]) flat = false;
    lo = std::min(lo, rewards[i]);
    hi = std::max(hi, rewards[i]);
  }
  if (!flat) {
    streak_ = 0;
    return std::nullopt;
  }
  if (streak_++ == 0) first_ = step;
  if (streak_ != steps_) return std::nullopt;
  char buf[512];
  if (lo == hi)
    std::snprintf(buf, sizeof buf,
                  "warning: steps %lld-%lld learned nothing: every reward was %g and the gradient norm 0 (GRPO "
                  "learns only from differences within a group). Check the reward function (task.reward.*) "
                  "against a few responses, or make the task easier / the policy better (SFT first).",
                  static_cast<long long>(first_), static_cast<long long>(step), static_cast<double>(lo));
  else
    std::snprintf(buf, sizeof buf,
                  "warning: steps %lld-%lld learned nothing: within every group all rewards were equal (values "
                  "%g..%g) and the gradient norm 0. Raise rollout.temperature or "
                  "rollout.generations_per_prompt for more varied answers, or check the reward function.",
                  static_cast<long long>(first_), static_cast<long long>(step), static_cast<double>(lo),
                  static_cast<double>(hi));
  return std::string(buf);
}

}  // namespace fp8rl
