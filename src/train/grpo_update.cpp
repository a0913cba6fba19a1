#include "train/grpo_update.h"

#include <algorithm>

namespace fp8rl {

GrpoUpdateResult grpo_update(Trainer& trainer, const GrpoRollout& r, const GrpoLossOptions& options,
                             int mini_batches, float temperature, const std::function<double(int64_t)>& lr_at,
                             const std::function<bool(const StepResult&)>& on_step) {
  GrpoUpdateResult out;
  const size_t n = r.seqs.size();
  mini_batches = std::max(1, mini_batches);
  for (int mb = 0; mb < mini_batches; ++mb) {
    const size_t a = n * mb / mini_batches, b = n * (mb + 1) / mini_batches;
    if (a == b) continue;
    const std::vector<TrainSequence> part(r.seqs.begin() + a, r.seqs.begin() + b);
    std::vector<int64_t> offs;  // this mini-batch's response-token offsets, from 0
    for (size_t i = a; i <= b; ++i) offs.push_back(r.offsets[i] - r.offsets[a]);
    const int64_t t_begin = r.offsets[a];
    GrpoBatch whole;
    whole.seq_offsets = offs;
    const double norm = grpo_loss_normalizer(whole, options.aggregation);
    out.lr = lr_at(trainer.optimizer_step());
    const TokenLossFn loss = [&](size_t f, size_t e, const std::vector<float>& lp_new, std::vector<float>& grad) {
      std::vector<int64_t> so;  // the micro-batch's offsets, from 0
      for (size_t i = f; i <= e; ++i) so.push_back(offs[i] - offs[f]);
      const int64_t tb = t_begin + offs[f], te = t_begin + offs[e];
      GrpoBatch gb;
      gb.seq_offsets = so;
      gb.advantages = std::span<const float>(r.advantages).subspan(a + f, e - f);
      gb.logp_new = lp_new;
      gb.logp_old = std::span<const float>(r.logp_old).subspan(tb, te - tb);
      gb.logp_gen = std::span<const float>(r.logp_gen).subspan(tb, te - tb);
      if (!r.logp_ref.empty()) gb.logp_ref = std::span<const float>(r.logp_ref).subspan(tb, te - tb);
      GrpoLossResult res = grpo_loss(gb, options, norm);
      grad = std::move(res.grad_logp_new);
      out.stats.merge(res.stats);
      return res.loss;
    };
    const StepResult sr = trainer.step(part, temperature, loss, static_cast<float>(out.lr));
    out.loss += sr.loss;
    out.grad_norm = std::max(out.grad_norm, sr.grad_norm);
    ++out.steps;
    out.applied += on_step(sr) ? 1 : 0;
  }
  return out;
}

}  // namespace fp8rl
