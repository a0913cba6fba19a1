// `fp8rl sft`: teacher forcing on the task's worked solutions (prompt tokens are context, the
// loss is the mean negative log-likelihood of the solution tokens and the EOS).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include "core/error.h"
#include "rl/checkpoint.h"
#include "rl/loop.h"
#include "rl/memory_plan.h"
#include "rl/metrics_log.h"
#include "rl/run_dir.h"
#include "rl/session.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {

std::string sft_run(const RunConfig& c_in, bool print_plan) {
  using Clock = std::chrono::steady_clock;
  RunConfig c = c_in;
  Session s = session_open(c, cache_dir());
  const MemoryChoice memory = session_check_memory(s, /*sft=*/true);  // refused here, before any work
  Backend& be = *s.backend;
  RunDir run = run_dir_create(c.out, /*resume=*/false);
  run_dir_save_config(run, c);  // train.recompute, train.dgrad_weight_cache as given (auto stays auto)
  c.train.recompute = memory.recompute;
  c.train.dgrad_weight_cache = memory.dgrad_weight_cache;
  const PrecisionRecipe recipe = config_precision_recipe(c.precision);
  ModelWeights host = session_initial_policy(s);
  session_set_model(s, host.config.vocab_size);
  session_check_model(s, host.config);
  std::printf("sft: %s, %lld parameters, trainer %s, %d steps x %d sequences\n", host.config.model_type.c_str(),
              static_cast<long long>(model_count_parameters(host)), linear_mode_name(recipe.trainer.linear),
              c.sft.steps, c.sft.batch_size);
  const MemoryPlan plan = memory_plan_compute(memory_plan_input(c, host.config, be.act_dtype(), /*sft=*/true));
  if (print_plan) std::fputs(memory_plan_format(plan, host.config).c_str(), stdout);
  std::fflush(stdout);
  memory_plan_check_host(plan, c.device);
  // SFT teaches worked solutions: a task without them would train on nothing but EOS.
  {
    const size_t n = std::min<size_t>(s.task->size(Split::kTrain), 64);
    size_t with = 0;
    for (size_t i = 0; i < n; ++i) with += !s.task->item(Split::kTrain, i).solution.empty();
    if (with == 0)
      FP8RL_FAIL("sft: task ", s.task->name(), " has no worked solutions to train on",
                 c.task.name == "jsonl" ? " (task.jsonl.solution_field is empty or names an empty field)" : "",
                 ". The tiny demo model starts from SFT: set task.jsonl.solution_field, or start from a "
                 "pretrained model (model.path=DIR)");
  }
  Trainer trainer(be, model_weights_to_device(be, host, DType::F32), recipe.trainer, trainer_options(c));
  // GSM8K train solutions mixed into every batch (sft.mix_gsm8k_*), read in order, wrapping.
  std::unique_ptr<Task> mix;
  int mix_per_batch = 0;
  int64_t mix_next = 0, mix_skipped = 0;
  if (c.sft.mix_gsm8k_fraction > 0) {
    mix = task_make_gsm8k(c.sft.mix_gsm8k_path, static_cast<uint64_t>(c.task.seed ? c.task.seed : c.seed));
    mix_per_batch = static_cast<int>(c.sft.mix_gsm8k_fraction * c.sft.batch_size + 0.5);
    std::printf("sft: %d of %d sequences per batch from %s (GSM8K train, %zu items)\n", mix_per_batch,
                c.sft.batch_size, c.sft.mix_gsm8k_path.c_str(), mix->size(Split::kTrain));
  }
  // Every sequence must fit the model's positions; the task's own items are an error (the data
  // or the model is wrong), mixed-in GSM8K solutions that do not fit are skipped.
  const int64_t max_pos = host.config.max_position_embeddings;
  const int64_t mix_limit = c.sft.max_seq_tokens > 0 ? std::min<int64_t>(c.sft.max_seq_tokens, max_pos) : max_pos;
  auto make_sequence = [&](const TaskItem& it) {
    TrainSequence t;
    t.ids = s.prompt_ids(it);
    t.prompt_len = static_cast<int>(t.ids.size());
    std::vector<int32_t> sol = s.solution_ids(it);
    t.ids.insert(t.ids.end(), sol.begin(), sol.end());
    return t;
  };
  const auto t_run = Clock::now();
  double slowest_step_s = 0;
  int64_t steps_done = 0;
  TrainSection ts = c.train;
  ts.lr = c.sft.lr;
  const LrSchedule sched = config_lr_schedule(ts, c.sft.steps);
  MetricsLog log(run.path);
  if (c.logger.tensorboard) log.enable_tensorboard(run.path + "/tensorboard");
  Progress progress("sft", c.sft.steps);
  BadStepGuard bad_steps(c.max_consecutive_bad_steps, bad_step_hint(c, "sft.lr", c.sft.lr));
  for (int64_t step = 1; step <= c.sft.steps; ++step) {
    const auto t0 = Clock::now();
    const double elapsed = std::chrono::duration<double>(t0 - t_run).count();
    if (c.time_budget_s > 0 && step > 1 && elapsed + slowest_step_s > c.time_budget_s) {
      console_line(stderr, "sft: time budget %.0f s reached after step %lld of %d; saving", c.time_budget_s,
                   static_cast<long long>(step - 1), c.sft.steps);
      break;
    }
    std::vector<TrainSequence> seqs;
    int64_t tokens = 0;
    const int own = c.sft.batch_size - mix_per_batch;
    for (int i = 0; i < own; ++i) {
      seqs.push_back(make_sequence(s.train_item((step - 1) * own + i)));
      if (static_cast<int64_t>(seqs.back().ids.size()) > max_pos)
        FP8RL_FAIL("sft: training item ", (step - 1) * own + i, " of task ", c.task.name, " is ",
                   seqs.back().ids.size(), " tokens (prompt + solution), more than the model's max_position_embeddings (",
                   max_pos, "); shorten the data or use a model with more positions");
    }
    for (int i = 0; i < mix_per_batch; ++i) {
      for (int tries = 0;; ++tries) {
        FP8RL_CHECK(tries < 1000, "sft: no GSM8K solution fits ", mix_limit, " tokens (sft.max_seq_tokens=",
                    c.sft.max_seq_tokens, ", max_position_embeddings ", max_pos, "); raise sft.max_seq_tokens (0 = no limit)");
        TrainSequence t = make_sequence(mix->item(Split::kTrain, static_cast<size_t>(mix_next++) % mix->size(Split::kTrain)));
        if (static_cast<int64_t>(t.ids.size()) > mix_limit) {
          ++mix_skipped;
          continue;
        }
        seqs.push_back(std::move(t));
        break;
      }
    }
    for (const TrainSequence& t : seqs) tokens += t.response_len();
    const double lr = lr_schedule_at(sched, step - 1);
    StepResult r = trainer.step(seqs, 1.0f, [&](size_t, size_t, const std::vector<float>& lp, std::vector<float>& g) {
      double l = 0;
      for (size_t i = 0; i < lp.size(); ++i) {
        l -= lp[i];
        g[i] = -1.0f / static_cast<float>(tokens);
      }
      return l / static_cast<double>(tokens);
    }, static_cast<float>(lr));
    steps_done = step;
    slowest_step_s = std::max(slowest_step_s, std::chrono::duration<double>(Clock::now() - t0).count());
    if (!bad_steps.record(r, step)) continue;
    StepMetrics m;
    m.step = step;
    m.loss = r.loss;
    m.grad_norm = r.grad_norm;
    m.lr = lr;
    m.time_train_s = std::chrono::duration<double>(Clock::now() - t0).count();
    m.extra.push_back({"tokens", static_cast<double>(tokens)});
    const bool last = step == c.sft.steps ||
                      (c.time_budget_s > 0 && std::chrono::duration<double>(Clock::now() - t_run).count() +
                                                      2 * slowest_step_s > c.time_budget_s);
    if (c.val_every > 0 && (last || step % std::max(1, c.sft.steps / 5) == 0)) {
      RolloutEngine engine(be, trainer.master(), recipe.generator, static_cast<int>(memory_plan_sft_kv_pages(c)));
      ValResult v = validate(s, engine, c.val_size, c.rollout.max_new_tokens);
      m.val_accuracy = v.accuracy;
    }
    if (last || step % 20 == 0) log.write(m, c.sft.steps);
    progress.update(step);
    if (last && step < c.sft.steps)
      console_line(stderr, "sft: step %lld is the last that fits in time_budget_s=%.0f s",
                   static_cast<long long>(step), c.time_budget_s);
    if (last) break;
  }
  progress.finish();
  if (mix_skipped) std::printf("sft: skipped %lld GSM8K solutions longer than %lld tokens\n",
                               static_cast<long long>(mix_skipped), static_cast<long long>(mix_limit));
  TrainerState st;
  st.step = steps_done;
  st.optimizer_step = trainer.optimizer_step();
  st.seed = static_cast<uint64_t>(c.seed);
  return checkpoint_save(be, trainer, st, run.checkpoints_dir(), checkpoint_options(c, s.tokenizer_json));
}

}  // namespace fp8rl
