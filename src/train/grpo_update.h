// One GRPO update over a rollout: the optimizer steps over mini-batches of whole sequences
// (GRPO loss + IS correction [+ k3 KL], recipe section 5). Shared by `fp8rl train`
// (rl/grpo_loop.cpp) and `fp8rl bench rl-step`, so the benchmark times the loop's own update.
#pragma once
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "train/grpo.h"
#include "train/trainer.h"

namespace fp8rl {

// What the update reads from one rollout, response tokens packed in sequence order.
struct GrpoRollout {
  std::vector<TrainSequence> seqs;   // prompt + response ids
  std::vector<int64_t> offsets;      // [seqs + 1] response-token offsets into the arrays below
  std::vector<float> advantages;     // [seqs]
  std::vector<float> logp_gen;       // [tokens] generator numerics, at sampling
  std::vector<float> logp_old;       // [tokens] trainer numerics, before the update
  std::vector<float> logp_ref;       // [tokens] reference policy; empty without the KL term
  // The first mini-batch's logp_old from its own optimizer step's forward instead of a scoring
  // pass (nothing is updated before that step, so that forward's log-probs are the rollout
  // weights' own; train.old_logprobs: auto): logp_old's values for that mini-batch's tokens are
  // not read, and the update returns the forward's scores (GrpoUpdateResult::first_scored, what
  // Trainer::score gives with `first_score`).
  bool first_logp_old_from_forward = false;
  ScoreRequest first_score;
  int64_t tokens() const { return offsets.empty() ? 0 : offsets.back(); }
};

struct GrpoUpdateResult {
  double loss = 0;       // summed over the optimizer steps
  double grad_norm = 0;  // the largest before clipping
  double lr = 0;         // of the last optimizer step
  int steps = 0, applied = 0;
  GrpoStats stats;
  // With GrpoRollout::first_logp_old_from_forward: this rank's sequences of the first mini-batch
  // scored by that step's forward; complete false when that step was not applied (a non-finite
  // value in its forward, loss or gradient: the scores may be partial or hold it).
  ScoreResult first_scored;
  bool first_scored_complete = false;
};

// Data parallelism: this rank holds sequences [first, first + seqs) of a global batch of
// `global_seqs` (whole prompt groups per rank, rank order). Mini-batches are cut from the
// global batch — the same sequences as on one rank — so a rank's share of one may be empty;
// normalizers are summed over the ranks and the trainer (Trainer::set_communicator) sums the
// gradients. The default: one rank.
struct GrpoShard {
  Communicator* comm = nullptr;  // nullptr: one rank
  int64_t first = 0;
  int64_t global_seqs = -1;  // -1: the rollout's own sequence count
};

// This rank's sequences [a, b) (local indices, possibly empty) of mini-batch `mb` of
// `mini_batches` over the global batch, for a rank holding `local_seqs` sequences.
std::pair<size_t, size_t> grpo_mini_batch_range(const GrpoShard& shard, size_t local_seqs, int mini_batches, int mb);

// `mini_batches` optimizer steps, each over a contiguous share of the sequences, normalized by
// its whole mini-batch. lr_at(optimizer step) gives each step's learning rate; on_step(result)
// sees every optimizer step's outcome and returns whether it was applied (fault accounting:
// BadStepGuard::record, which may throw to abort).
GrpoUpdateResult grpo_update(Trainer& trainer, const GrpoRollout& rollout, const GrpoLossOptions& options,
                             int mini_batches, float temperature, const std::function<double(int64_t)>& lr_at,
                             const std::function<bool(const StepResult&)>& on_step, const GrpoShard& shard = {});

}  // namespace fp8rl
