#include "train/grpo_update.h"

#include <algorithm>

#include "core/error.h"
#include "dist/comm.h"

namespace fp8rl {

std::pair<size_t, size_t> grpo_mini_batch_range(const GrpoShard& shard, size_t local_seqs, int mini_batches, int mb) {
  const int64_t n = static_cast<int64_t>(local_seqs);
  const int64_t N = shard.global_seqs < 0 ? n : shard.global_seqs;
  mini_batches = std::max(1, mini_batches);
  const int64_t ga = N * mb / mini_batches, gb = N * (mb + 1) / mini_batches;
  return {static_cast<size_t>(std::clamp(ga - shard.first, int64_t{0}, n)),
          static_cast<size_t>(std::clamp(gb - shard.first, int64_t{0}, n))};
}

GrpoUpdateResult grpo_update(Trainer& trainer, const GrpoRollout& r, const GrpoLossOptions& options,
                             int mini_batches, float temperature, const std::function<double(int64_t)>& lr_at,
                             const std::function<bool(const StepResult&)>& on_step, const GrpoShard& shard) {
  GrpoUpdateResult out;
  const int64_t n = static_cast<int64_t>(r.seqs.size());
  const int64_t N = shard.global_seqs < 0 ? n : shard.global_seqs;
  const bool dp = shard.comm && shard.comm->world_size() > 1;
  FP8RL_CHECK(shard.first >= 0 && shard.first + n <= N, "GRPO shard: sequences [", shard.first, ", ",
              shard.first + n, ") of a global batch of ", N);
  mini_batches = std::max(1, mini_batches);
  for (int mb = 0; mb < mini_batches; ++mb) {
    // The global mini-batch [ga, gb), and this rank's part of it [a, b) (local indices).
    const int64_t ga = N * mb / mini_batches, gb = N * (mb + 1) / mini_batches;
    if (ga == gb) continue;
    const std::pair<size_t, size_t> range = grpo_mini_batch_range(shard, static_cast<size_t>(n), mini_batches, mb);
    const size_t a = range.first, b = range.second;
    // The first mini-batch's logp_old: its own forward's log-probs (the loss's logp_new, before
    // any update of this rollout).
    const bool own_old = r.first_logp_old_from_forward && mb == 0;
    const std::vector<TrainSequence> part(r.seqs.begin() + a, r.seqs.begin() + b);
    std::vector<int64_t> offs;  // this mini-batch's response-token offsets, from 0
    for (size_t i = a; i <= b; ++i) offs.push_back(r.offsets[i] - r.offsets[a]);
    const int64_t t_begin = r.offsets[a];
    GrpoBatch whole;
    whole.seq_offsets = offs;
    double norm = grpo_loss_normalizer(whole, options.aggregation);
    if (dp) shard.comm->all_reduce(&norm, 1, ReduceOp::Sum);  // the global token (or sequence) count
    out.lr = lr_at(trainer.optimizer_step());
    const TokenLossFn loss = [&](size_t f, size_t e, const std::vector<float>& lp_new, std::vector<float>& grad) {
      std::vector<int64_t> so;  // the micro-batch's offsets, from 0
      for (size_t i = f; i <= e; ++i) so.push_back(offs[i] - offs[f]);
      const int64_t tb = t_begin + offs[f], te = t_begin + offs[e];
      GrpoBatch gb;
      gb.seq_offsets = so;
      gb.advantages = std::span<const float>(r.advantages).subspan(a + f, e - f);
      gb.logp_new = lp_new;
      gb.logp_old =
          own_old ? std::span<const float>(lp_new) : std::span<const float>(r.logp_old).subspan(tb, te - tb);
      gb.logp_gen = std::span<const float>(r.logp_gen).subspan(tb, te - tb);
      if (!r.logp_ref.empty()) gb.logp_ref = std::span<const float>(r.logp_ref).subspan(tb, te - tb);
      GrpoLossResult res = grpo_loss(gb, options, norm);
      grad = std::move(res.grad_logp_new);
      out.stats.merge(res.stats);
      return res.loss;
    };
    const StepResult sr = own_old ? trainer.step(part, temperature, loss, static_cast<float>(out.lr), &r.first_score,
                                                 &out.first_scored)
                                  : trainer.step(part, temperature, loss, static_cast<float>(out.lr));
    // A step that was not applied met a non-finite value (in its forward, loss or gradient): its
    // scores may be partial or hold that value.
    if (own_old)
      out.first_scored_complete = sr.applied && out.first_scored.logp.size() == static_cast<size_t>(offs.back());
    out.loss += sr.loss;
    out.grad_norm = std::max(out.grad_norm, sr.grad_norm);
    ++out.steps;
    out.applied += on_step(sr) ? 1 : 0;
  }
  return out;
}

}  // namespace fp8rl
