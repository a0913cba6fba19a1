// The GRPO objective on host vectors: group advantages, and the clipped surrogate with the
// generator/trainer mismatch correction (importance sampling) and an optional k3 KL term.
// Pure functions, FP64 inside, no model: the trainer runs the model forward to get logp_new,
// calls grpo_loss, and feeds grad_logp_new to the model backward (recipe.md section 5).
#pragma once
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace fp8rl {

// ---- advantages ------------------------------------------------------------------------
enum class AdvantageBaseline {
  GroupNorm,    // A_i = (r_i - mean(r)) / (std(r) + eps), std = SAMPLE std (divides by G - 1),
                // as torch.std does in the reference implementations; G = 1 gives A = 0.
  LeaveOneOut,  // A_i = r_i - mean_{j != i}(r_j) = G / (G - 1) * (r_i - mean(r)), no std division;
                // G = 1 gives A = 0.
};
const char* advantage_baseline_name(AdvantageBaseline b);
AdvantageBaseline advantage_baseline_from_name(const std::string& s);  // group_norm | leave_one_out

// rewards: [num_prompts * group_size], group-major (the G samples of prompt p are
// rewards[p*G .. p*G + G)). Returns the advantages in the same layout. Throws on a size that
// is not a multiple of group_size or a non-finite reward. A group whose rewards are all equal
// gets A = 0 (no learning signal) in both modes.
std::vector<float> grpo_compute_advantages(std::span<const float> rewards, int group_size,
                                           AdvantageBaseline baseline, double eps = 1e-6);

// ---- loss --------------------------------------------------------------------------------
enum class LossAggregation {
  Token,     // sum over all valid tokens of the batch / number of valid tokens of the batch
  Sequence,  // mean over each sequence's valid tokens, then mean over the sequences
};
const char* loss_aggregation_name(LossAggregation a);
LossAggregation loss_aggregation_from_name(const std::string& s);  // token | sequence

// The importance weight w = exp(logp_old - logp_gen) multiplies the surrogate of each token
// (it carries no gradient). Tokens or sequences that a mode masks get weight 0; they stay in
// the normalizer (masking is "weight 0", so the normalizer never depends on the mode).
enum class IsMode {
  None,     // w = 1
  IS,       // w
  TIS,      // min(w, tis_cap)
  Icepop,   // w if icepop_low <= w <= icepop_high, else 0 (per token)
  SeqMask,  // sequence kept iff seq_mask_low <= exp(mean_t log w_t) <= seq_mask_high (its valid
            // tokens); kept sequences use the plain w per token, dropped ones 0
};
const char* is_mode_name(IsMode m);
IsMode is_mode_from_name(const std::string& s);  // none | is | tis | icepop | seq_mask

struct GrpoLossOptions {
  double ratio_clip_low = 0.2;   // ratio clipped to [1 - low, 1 + high]
  double ratio_clip_high = 0.2;
  LossAggregation aggregation = LossAggregation::Token;
  IsMode is_mode = IsMode::None;
  double tis_cap = 2.0;
  double icepop_low = 0.5, icepop_high = 5.0;
  double seq_mask_low = 0.999, seq_mask_high = 1.002;
  // KL penalty to a reference policy, k3 estimator per token (not IS-weighted, not masked by
  // the IS mode): beta * (exp(ref - new) - (ref - new) - 1). 0 disables it (logp_ref unused).
  double kl_beta = 0.0;
};
// Throws on negative clips, tis_cap <= 0, empty or inverted [low, high] bands, kl_beta < 0.
void grpo_validate_options(const GrpoLossOptions& o);

// A batch (or a micro-batch) of whole sequences, their response tokens packed end to end:
// sequence i owns tokens [seq_offsets[i], seq_offsets[i+1]). A sequence is never split across
// micro-batches (sequence aggregation and seq_mask need all of its tokens).
struct GrpoBatch {
  std::span<const int64_t> seq_offsets;  // [num_seqs + 1], seq_offsets[0] = 0, non-decreasing
  std::span<const float> advantages;     // [num_seqs]
  std::span<const float> logp_new;       // [tokens] trainer, current weights (differentiated)
  std::span<const float> logp_old;       // [tokens] trainer, weights before this GRPO step
  std::span<const float> logp_gen;       // [tokens] generator at sampling; empty allowed iff is_mode == None
  std::span<const float> logp_ref;       // [tokens] reference policy; empty allowed iff kl_beta == 0
  std::span<const uint8_t> token_mask;   // [tokens] 1 = counts, 0 = ignored; empty = all count
};

// Statistics, kept as sums so that micro-batches merge exactly.
struct GrpoStats {
  int64_t tokens = 0;          // valid tokens
  int64_t seqs = 0;            // sequences with at least one valid token
  int64_t clipped = 0;         // valid tokens where the clipped branch won (zero gradient)
  int64_t is_tokens = 0;       // valid tokens with a logp_gen (the IS statistics cover these)
  double is_weight_sum = 0;    // raw w = exp(logp_old - logp_gen), before truncation/masking
  double is_weight_min = std::numeric_limits<double>::infinity();
  double is_weight_max = -std::numeric_limits<double>::infinity();
  int64_t truncated = 0;       // tis: tokens with w > tis_cap
  int64_t masked_tokens = 0;   // icepop / seq_mask: valid tokens given weight 0
  int64_t masked_seqs = 0;     // seq_mask: sequences dropped
  double kl_sum = 0;           // sum of k3(ref, new) over valid tokens (when kl_beta != 0)
  void merge(const GrpoStats& o);
  // Fractions and means; NaN when there is nothing to average (JSON null).
  double clip_fraction() const;
  double is_weight_mean() const;
  double truncated_fraction() const;
  double masked_fraction() const;      // of tokens
  double masked_seq_fraction() const;  // of sequences
  double kl_mean() const;
};

struct GrpoLossResult {
  double loss = 0;                   // this batch's share of the (whole-batch) loss
  std::vector<float> grad_logp_new;  // [tokens] dloss / dlogp_new (0 on invalid tokens)
  GrpoStats stats;
};

// The normalizer of one (micro-)batch: its valid tokens (Token) or its sequences with at least
// one valid token (Sequence). Sum it over the micro-batches of one optimizer step.
double grpo_loss_normalizer(const GrpoBatch& b, LossAggregation aggregation);

// Per valid token t of sequence i:
//   ratio = exp(logp_new - logp_old)
//   s_t   = -min(ratio * A_i, clip(ratio, 1 - low, 1 + high) * A_i)
//   c_t   = w_t * s_t + kl_beta * k3_t                     (w_t from is_mode, see IsMode)
// loss = sum_t c_t / normalizer (Token) or sum_i (sum_{t in i} c_t / n_i) / normalizer
// (Sequence). `normalizer` = grpo_loss_normalizer summed over the optimizer step's
// micro-batches; 0 means "this batch is the whole step". Summing `loss` and concatenating the
// gradients over the micro-batches gives the whole step's. Throws on inconsistent sizes or
// non-finite inputs (naming the token).
GrpoLossResult grpo_loss(const GrpoBatch& b, const GrpoLossOptions& o, double normalizer = 0);

}  // namespace fp8rl
