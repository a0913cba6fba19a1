// The consistent mode's end-to-end check, shared by the CPU test (tests/cpu/test_consistent.cpp)
// and the GPU one (tests/cuda/test_cuda_consistent.cpp): a tiny random model, a rollout of
// ragged batches through the real engine (several prompts, several samples each, responses cut
// at seeded lengths, a small token budget so prompts are prefilled in chunks and mixed with
// decode steps, prompt pages shared between samples, more samples than the batch holds, E4M3 KV
// scales calibrated from the trainer's amax and installed by refit), then the trainer's scoring
// (micro-batches that group the sequences differently), the frozen reference's scoring and one
// optimizer step whose forward log-probs are recorded.
#pragma once
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "rl/metrics.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl::test {

struct ConsistentShape {
  std::string family = "qwen3";
  int vocab = 4500, hidden = 256, layers = 2, heads = 4, kv_heads = 2, intermediate = 384;
  bool long_sequence = false;  // one more request whose sequence passes 1024 positions (CUDA's invariant chunk)
};

struct ConsistentRun {
  std::vector<float> logp_gen, logp_old, logp_ref, logp_new;
  MismatchMetrics mismatch;
  double grad_norm = 0;
  RolloutStats stats;
  size_t sequences = 0;
};

inline ConsistentRun consistent_run(Backend& be, const ConsistentShape& sh, const std::string& recipe_spec) {
  const ModelConfig c =
      model_config_tiny(sh.family, sh.vocab, sh.hidden, sh.layers, sh.heads, sh.kv_heads, sh.intermediate);
  RandomInit init;
  init.seed = 17;
  init.std = 0.08f;
  init.bias_std = 0.05f;
  init.norm_jitter = 0.1f;
  const ModelWeights host = model_weights_random(c, init, DType::F32);
  const PrecisionRecipe recipe = PrecisionRecipe::parse(recipe_spec);
  TrainerOptions topt;
  topt.micro_batch_tokens = 60;  // micro-batches of 1-3 sequences: other groupings than the rollout's
  Trainer trainer(be, model_weights_to_device(be, host, DType::F32), recipe.trainer, topt);
  TrainerOptions fopt = topt;
  fopt.frozen = true;
  Trainer reference(be, model_weights_to_device(be, host, DType::F32), recipe.trainer, fopt);
  SchedulerOptions so;
  so.max_batch_tokens = 24;  // chunked prefill, decode tokens mixed with prefill chunks
  RolloutEngine engine(be, trainer.master(), recipe.generator, /*kv_pages=*/sh.long_sequence ? 112 : 24,
                       /*page_size=*/16, /*max_batch=*/4, so);

  std::vector<RolloutRequest> reqs = {{{1, 5, 9, 2, 7}, 3, {20, 4, 11}},
                                      {std::vector<int32_t>(17, 3), 2, {13, 20}},
                                      {std::vector<int32_t>(33, 8), 2, {1, 17}}};
  for (int i = 0; i < 33; ++i) reqs[2].prompt[static_cast<size_t>(i)] = (i * 37 + 11) % sh.vocab;
  for (int i = 0; i < 17; ++i) reqs[1].prompt[static_cast<size_t>(i)] = (i * 101 + 3) % sh.vocab;
  SamplingParams sp;
  sp.max_new_tokens = 20;
  if (sh.long_sequence) {
    RolloutRequest r;
    r.prompt.resize(1000);
    for (size_t i = 0; i < r.prompt.size(); ++i) r.prompt[i] = static_cast<int32_t>((i * 53 + 7) % sh.vocab);
    r.n = 2;
    sp.max_new_tokens = 40;
    r.stop_after = {40, 23};
    reqs.push_back(r);
  }
  // KV scales from the trainer's amax over the prompts, installed by refit (as the loop does).
  std::vector<TrainSequence> prompts;
  for (const RolloutRequest& r : reqs) prompts.push_back({r.prompt, static_cast<int>(r.prompt.size())});
  const bool e4m3 = recipe.generator.kv_cache == DType::E4M3;
  if (e4m3) {
    const ScoreResult cs = trainer.score(prompts, 1.0f, false, /*record_amax=*/true);
    const KvScales scales = kv_scales_calibrate(cs.k_amax, cs.v_amax, 0.999f, 1.05f, recipe.generator.pow2_scales);
    engine.refit(trainer.master(), &scales);
  }
  sp.temperature = 1.0f;
  sp.seed = 5;
  const std::vector<RolloutSample> samples = engine.generate(reqs, sp);
  ConsistentRun out;
  out.stats = engine.last_stats();
  std::vector<TrainSequence> seqs;
  for (const RolloutSample& s : samples) {
    TrainSequence ts{reqs[s.request].prompt, static_cast<int>(reqs[s.request].prompt.size())};
    ts.ids.insert(ts.ids.end(), s.tokens.begin(), s.tokens.end());
    seqs.push_back(ts);
    out.logp_gen.insert(out.logp_gen.end(), s.logp.begin(), s.logp.end());
  }
  out.sequences = seqs.size();
  if (e4m3) {
    const KvScales used = engine.kv_scales();
    trainer.set_kv_rounding(used.k, used.v);
    reference.set_kv_rounding(used.k, used.v);
  }
  out.logp_old = trainer.score(seqs, sp.temperature, /*entropy=*/true, /*record_amax=*/e4m3).logp;
  out.logp_ref = reference.score(seqs, sp.temperature, false, false).logp;
  out.mismatch = metrics_compute_mismatch(out.logp_old, out.logp_gen);
  // One optimizer step of a token-level loss: its forward's log-probs (logp_new) are recorded.
  const double n = static_cast<double>(out.logp_gen.size());
  const StepResult st = trainer.step(
      seqs, sp.temperature,
      [&](size_t, size_t, const std::vector<float>& logp_new, std::vector<float>& grad) {
        out.logp_new.insert(out.logp_new.end(), logp_new.begin(), logp_new.end());
        double loss = 0;
        for (size_t i = 0; i < logp_new.size(); ++i) {
          const double adv = (i % 3 == 0) ? 1.0 : -0.5;
          grad[i] = static_cast<float>(-adv / n);
          loss -= adv * logp_new[i] / n;
        }
        return loss;
      },
      1e-4f);
  out.grad_norm = st.applied ? st.grad_norm : std::nan("");
  return out;
}

// Whether two log-prob arrays hold the same bits.
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The largest |a - b| (diagnostics).
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::fmax(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

}  // namespace fp8rl::test
