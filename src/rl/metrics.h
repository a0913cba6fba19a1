// Per-step RL metrics computed from host vectors: the generator/trainer mismatch (names as in
// the reference system, recipe.md section 5), entropy, response lengths, reward, accuracy.
// Every mean of nothing is NaN, which the metrics log writes as JSON null.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace fp8rl {

struct MismatchMetrics {
  // mean over valid tokens of exp(|logp_old - logp_gen|); 1.0 = engines agree (flag > 1.05)
  double token_mult_prob_error = 0;
  // KL(generator || trainer), estimated with k3 on tokens sampled from the generator:
  //   r = pi_train(x) / pi_gen(x) = exp(logp_old - logp_gen),  k3 = r - 1 - log r  (>= 0)
  // E_{x ~ gen}[k3] = sum_x gen(x) (train(x)/gen(x) - 1) - E_gen[log r] = KL(gen || train),
  // unbiased because the tokens were sampled by the generator. Healthy: < 1e-3.
  double gen_kl_error = 0;
  // KL(trainer || generator) with the same tokens, k3 with r' = 1/r (the reference system's
  // policy_kl_error; biased since the tokens come from the generator; logged for diagnosis).
  double policy_kl_error = 0;
  double max_abs_logp_diff = 0;  // max over valid tokens of |logp_old - logp_gen|
  int64_t tokens = 0;
};

// logp_old: [tokens] trainer log-probs before the update; logp_gen: [tokens] the generator's;
// token_mask: [tokens] (1 = valid) or empty for all valid. Throws on size mismatch or
// non-finite values on valid tokens.
MismatchMetrics metrics_compute_mismatch(std::span<const float> logp_old, std::span<const float> logp_gen,
                                         std::span<const uint8_t> token_mask = {});

// Mixture-of-experts models: the trainer's routing against the generator's (Trainer::score's
// RoutingAgreement counts and per-token flags), and the mismatch split by it.
struct RoutingMetrics {
  double agreement = 0;         // fraction of (scored position, MoE layer) pairs whose expert sets agree
  double router_agreement = 0;  // the same for the trainer router's own top-k (differs under replay)
  double agreed_token_fraction = 0;  // response tokens whose routing agreed in every MoE layer
  MismatchMetrics agreed, differs;   // metrics_compute_mismatch over those tokens / the others
};
// logp_old, logp_gen, agreed: [tokens] (agreed 1/0 per token); pairs >= agreed, router_agreed.
// NaN fractions (and empty groups' metrics) when there is nothing to count.
RoutingMetrics metrics_compute_routing(std::span<const float> logp_old, std::span<const float> logp_gen,
                                       std::span<const uint8_t> agreed, int64_t pairs, int64_t pairs_agreed,
                                       int64_t pairs_router_agreed);

// Mean of `values` over the valid tokens (e.g. per-token entropy); NaN when none.
double metrics_masked_mean(std::span<const float> values, std::span<const uint8_t> token_mask = {});

struct LengthStats {
  double mean = 0, std = 0;  // population std
  int64_t min = 0, max = 0;
  double capped_fraction = 0;  // responses with length >= max_new_tokens (hit the cap)
  int64_t count = 0;
};
// lengths: [responses] generated tokens per response. max_new_tokens <= 0: no cap check (0).
LengthStats metrics_length_stats(std::span<const int64_t> lengths, int64_t max_new_tokens);

// Watches for runs that learn nothing: a step where every GRPO group's rewards are equal (so
// every advantage is 0) and the gradient norm is 0. After `steps` such steps in a row, record()
// returns a warning (once per streak) that says what the rewards were and what to check.
class NoSignalWatch {
 public:
  explicit NoSignalWatch(int steps = 3) : steps_(steps) {}
  // rewards: [prompts * group] in group order.
  std::optional<std::string> record(int64_t step, std::span<const float> rewards, int group, double grad_norm);

 private:
  int steps_;
  int64_t streak_ = 0, first_ = 0;
};

double metrics_mean(std::span<const float> values);       // NaN when empty; throws on non-finite
double metrics_accuracy(std::span<const uint8_t> correct);  // fraction of nonzero; NaN when empty

}  // namespace fp8rl
