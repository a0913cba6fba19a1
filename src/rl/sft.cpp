// `fp8rl sft`: teacher forcing on the task's worked solutions (prompt tokens are context, the
// loss is the mean negative log-likelihood of the solution tokens and the EOS).
#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "rl/checkpoint.h"
#include "rl/loop.h"
#include "rl/metrics_log.h"
#include "rl/run_dir.h"
#include "rl/session.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {

std::string sft_run(const RunConfig& c) {
  using Clock = std::chrono::steady_clock;
  Session s = session_open(c, cache_dir());
  Backend& be = *s.backend;
  RunDir run = run_dir_create(c.out, /*resume=*/false);
  run_dir_save_config(run, c);
  const PrecisionRecipe recipe = config_precision_recipe(c.precision);
  ModelWeights host = session_initial_policy(s);
  std::printf("sft: %s, %lld parameters, trainer %s, %d steps x %d sequences\n", host.config.model_type.c_str(),
              static_cast<long long>(model_count_parameters(host)), linear_mode_name(recipe.trainer.linear),
              c.sft.steps, c.sft.batch_size);
  Trainer trainer(be, model_weights_to_device(be, host, DType::F32), recipe.trainer, trainer_options(c));
  TrainSection ts = c.train;
  ts.lr = c.sft.lr;
  const LrSchedule sched = config_lr_schedule(ts, c.sft.steps);
  MetricsLog log(run.path);
  Progress progress("sft", c.sft.steps);
  BadStepGuard bad_steps(c.max_consecutive_bad_steps, "Lower sft.lr.");
  for (int64_t step = 1; step <= c.sft.steps; ++step) {
    const auto t0 = Clock::now();
    std::vector<TrainSequence> seqs;
    int64_t tokens = 0;
    for (int i = 0; i < c.sft.batch_size; ++i) {
      TaskItem it = s.train_item((step - 1) * c.sft.batch_size + i);
      TrainSequence t;
      t.ids = s.prompt_ids(it);
      t.prompt_len = static_cast<int>(t.ids.size());
      std::vector<int32_t> sol = s.solution_ids(it);
      t.ids.insert(t.ids.end(), sol.begin(), sol.end());
      tokens += t.response_len();
      seqs.push_back(std::move(t));
    }
    const double lr = lr_schedule_at(sched, step - 1);
    StepResult r = trainer.step(seqs, 1.0f, [&](size_t, size_t, const std::vector<float>& lp, std::vector<float>& g) {
      double l = 0;
      for (size_t i = 0; i < lp.size(); ++i) {
        l -= lp[i];
        g[i] = -1.0f / static_cast<float>(tokens);
      }
      return l / static_cast<double>(tokens);
    }, static_cast<float>(lr));
    if (!bad_steps.record(r, step)) continue;
    StepMetrics m;
    m.step = step;
    m.loss = r.loss;
    m.grad_norm = r.grad_norm;
    m.lr = lr;
    m.time_train_s = std::chrono::duration<double>(Clock::now() - t0).count();
    m.extra.push_back({"tokens", static_cast<double>(tokens)});
    const bool last = step == c.sft.steps;
    if (c.val_every > 0 && (last || step % std::max(1, c.sft.steps / 5) == 0)) {
      RolloutEngine engine(be, trainer.master(), recipe.generator, c.val_size * 8 + 8);
      ValResult v = validate(s, engine, c.val_size, c.rollout.max_new_tokens);
      m.val_accuracy = v.accuracy;
      progress.update(step);
      std::fprintf(stderr, "\n");
    }
    if (last || step % 20 == 0) log.write(m, c.sft.steps);
    progress.update(step);
  }
  progress.finish();
  TrainerState st;
  st.step = c.sft.steps;
  st.optimizer_step = trainer.optimizer_step();
  st.seed = static_cast<uint64_t>(c.seed);
  return checkpoint_save(be, trainer, st, run.checkpoints_dir(), s.tokenizer_json);
}

}  // namespace fp8rl
