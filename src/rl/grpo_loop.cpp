// One GRPO step (docs/design.md "One RL step"):
//   prompts -> rollout (generator numerics, logp_gen) -> rewards -> advantages
//   -> trainer scoring (logp_old, entropy, q/k/v amax) -> mismatch metrics
//   -> optimizer steps on mini-batches (GRPO loss + IS correction [+ k3 KL])
//   -> KV-scale calibration + refit -> metrics, validation, checkpoint.
//
// Data parallel (docs/design.md "Several GPUs and several nodes"): with W ranks (dist/comm.h),
// rank r generates, scores and trains on prompts [P*r/W, P*(r+1)/W) of the step's P — whole
// groups, so advantages stay per group — sampling them as one rank would (first_request).
// Mini-batches are cut from the global batch, normalized by its global token count, and the
// trainer sums the gradients over the ranks before clipping and AdamW; every rank holds the
// full optimizer state and refits its own generator. KV scales come from every rank's amax,
// metrics from every rank's samples. Rank 0 alone writes the run directory and validates.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "rl/checkpoint.h"
#include "rl/interrupt.h"
#include "rl/loop.h"
#include "rl/memory_plan.h"
#include "rl/metrics.h"
#include "rl/metrics_log.h"
#include "rl/run_dir.h"
#include "rl/session.h"
#include "rollout/rollout.h"
#include "train/grpo_update.h"
#include "train/trainer.h"

namespace fp8rl {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The sampling seed of step b of a run seeded a.
uint64_t mix(uint64_t a, uint64_t b) { return splitmix64_mix(a * kSplitMix64Gamma ^ (b + 0x632be59bd9b4e019ull)); }

// The starting policy of the demo: SFT of the tiny model, cached by config.
std::string ensure_demo_policy(const RunConfig& c) {
  RunConfig s = c;
  s.model.path.clear();
  const std::string key = std::to_string(std::hash<std::string>{}(config_to_yaml([&] {
    RunConfig k = s;  // only what shapes the starting policy
    k.out.clear();
    k.steps = 0;
    k.rollout = RolloutSection{};
    // GRPO-only optimizer keys (SFT uses sft.lr and the rest of train.*).
    const TrainSection d{};
    k.train.is = d.is;
    k.train.lr = d.lr;
    k.train.optimizer_steps_per_rollout = d.optimizer_steps_per_rollout;
    k.train.shard_optimizer = d.shard_optimizer;
    k.train.ratio_clip_low = d.ratio_clip_low;
    k.train.ratio_clip_high = d.ratio_clip_high;
    k.train.loss_aggregation = d.loss_aggregation;
    k.train.baseline = d.baseline;
    k.train.kl_beta = d.kl_beta;
    k.precision = PrecisionSection{};
    k.val_every = 0;
    k.val_size = 0;
    k.checkpoint_every = 0;
    k.memory = MemorySection{};
    k.checkpoint_max_abs_weight = RunConfig{}.checkpoint_max_abs_weight;
    return k;
  }())));
  const std::string dir = cache_dir() + "/demo_policy_" + key;
  if (std::filesystem::exists(dir + "/model.safetensors")) {
    std::printf("starting policy: %s (cached SFT of the tiny model)\n", dir.c_str());
    return dir;
  }
  std::printf("starting policy: not cached; training it with SFT (%d steps) into %s\n", s.sft.steps, dir.c_str());
  // Atomic: the SFT run and the copy live in scratch directories (left over by a killed run,
  // they are simply replaced) and `dir` appears by one rename, complete or not at all.
  namespace fs = std::filesystem;
  s.out = dir + ".run";
  s.precision.recipe = "bf16";
  fs::remove_all(s.out);
  const std::string ckpt = sft_run(s, /*print_plan=*/false);
  const std::string tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(fs::path(dir).parent_path());
  fs::copy(ckpt, tmp, fs::copy_options::recursive);
  fs::remove_all(dir);  // a directory without model.safetensors (not ours, or from an older fp8rl)
  fs::rename(tmp, dir);
  fs::remove_all(s.out);
  return dir;
}

// The step of the last complete line of metrics.jsonl (-1: none or no file).
int64_t metrics_last_step(const std::string& path) {
  if (!std::filesystem::exists(path)) return -1;
  std::istringstream in(read_file(path));
  int64_t last = -1;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line.size() > (size_t(1) << 20)) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer()) last = std::max(last, j["step"].get<int64_t>());
  }
  return last;
}

// Prompt and response share the model's positions: max_new_tokens must leave room for a prompt.
void check_positions(const RunConfig& c, const ModelConfig& m) {
  if (c.rollout.max_new_tokens >= m.max_position_embeddings)
    FP8RL_FAIL("config: rollout.max_new_tokens (", c.rollout.max_new_tokens, ") must be below the model's ",
               "max_position_embeddings (", m.max_position_embeddings, "): prompt and response share its positions");
}

// On resume: metrics.jsonl keeps only the steps the checkpoint includes. Lines logged after it
// (a crash between a step's log line and its checkpoint) and a torn last line are dropped, so
// that the resumed run's lines are not duplicates.
void metrics_truncate_after(const std::string& path, int64_t last_step) {
  if (!std::filesystem::exists(path)) return;
  std::istringstream in(read_file(path));
  std::string kept;
  int dropped = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= last_step) {
      kept += line + "\n";
    } else {
      ++dropped;
    }
  }
  if (dropped == 0) return;
  std::printf("resume: dropped %d metrics line(s) after step %lld from %s\n", dropped,
              static_cast<long long>(last_step), path.c_str());
  write_file_atomic(path, kept);
}

// The validation example, prompt and response apart (a response may start mid-line).
void print_example(const ValResult& v) {
  auto indent = [](std::string s) {
    for (size_t p = s.find('\n'); p != std::string::npos; p = s.find('\n', p + 1)) s.insert(p + 1, "    | ");
    return s;
  };
  console_line(stdout, "  example prompt:   %s", indent(v.example_prompt).c_str());
  console_line(stdout, "  example response: %s", indent(v.example_response).c_str());
}

std::string resume_hint(const std::string& out) {
  return "continue with: fp8rl train --out " + out + " --resume";
}

// ---- data parallel: every rank's share, combined -----------------------------------------

void grpo_stats_all_reduce(Communicator& comm, GrpoStats& s) {
  if (comm.world_size() == 1) return;
  int64_t n[] = {s.tokens, s.seqs, s.clipped, s.is_tokens, s.truncated, s.masked_tokens, s.masked_seqs};
  double sum[] = {s.is_weight_sum, s.kl_sum}, lo = s.is_weight_min, hi = s.is_weight_max;
  comm.all_reduce(n, std::size(n), ReduceOp::Sum);
  comm.all_reduce(sum, std::size(sum), ReduceOp::Sum);
  comm.all_reduce(&lo, 1, ReduceOp::Min);
  comm.all_reduce(&hi, 1, ReduceOp::Max);
  s.tokens = n[0], s.seqs = n[1], s.clipped = n[2], s.is_tokens = n[3], s.truncated = n[4];
  s.masked_tokens = n[5], s.masked_seqs = n[6];
  s.is_weight_sum = sum[0], s.kl_sum = sum[1], s.is_weight_min = lo, s.is_weight_max = hi;
}

// Every rank's per-micro-batch amax ([micro-batch][layer]), concatenated: the KV scales are
// calibrated over the whole global batch (with the default percentile: the max over ranks).
std::vector<std::vector<float>> amax_all_gather(Communicator& comm, const std::vector<std::vector<float>>& local) {
  if (comm.world_size() == 1) return local;
  const size_t L = local.empty() ? 0 : local[0].size();
  std::vector<float> flat;
  for (const auto& mb : local) flat.insert(flat.end(), mb.begin(), mb.end());
  int64_t layers = static_cast<int64_t>(L), most = layers;
  comm.all_reduce(&most, 1, ReduceOp::Max);
  FP8RL_CHECK(layers == 0 || layers == most, "ranks disagree on the number of layers (", layers, " vs ", most, ")");
  const std::vector<float> all = dist_all_gather_v(comm, flat);
  std::vector<std::vector<float>> out;
  for (size_t i = 0; most > 0 && i < all.size(); i += static_cast<size_t>(most))
    out.emplace_back(all.begin() + i, all.begin() + i + most);
  return out;
}

}  // namespace

int grpo_run(const RunConfig& config_in, bool resume) {
  const auto t_run = Clock::now();  // time_budget_s counts from here (setup and step-0 validation included)
  RunConfig c = config_in;
  // The job's ranks (one without launcher variables); opened first: NCCL picks the GPU.
  const bool on_cuda = c.device.rfind("cuda", 0) == 0;
  std::unique_ptr<Communicator> comm = dist_open(dist_env_read(), on_cuda ? DeviceKind::CUDA : DeviceKind::CPU);
  const int rank = comm->rank(), W = comm->world_size();
  const bool lead = rank == 0;  // writes the run directory, validates, prints
  const int P = c.rollout.prompts_per_step, G = c.rollout.generations_per_prompt;
  if (P < W)
    FP8RL_FAIL("rollout.prompts_per_step=", P, " is below the number of ranks (", W, "); every rank needs whole "
               "prompt groups: raise rollout.prompts_per_step to at least ", W, " or launch fewer ranks");
  const int p_begin = P * rank / W, p_end = P * (rank + 1) / W;  // this rank's prompts of each step
  if (W > 1 && lead)
    std::printf("data parallel: %d ranks (%s), %d-%d prompts of %d per rank%s\n", W, comm->name().c_str(), P / W,
                (P + W - 1) / W, P, c.train.shard_optimizer ? "; AdamW moments sharded (ZeRO-1)" : "");
  if (c.model.path.empty()) {
    if (lead) c.model.path = ensure_demo_policy(c);
    comm->barrier();  // rank 0 trains and caches the starting policy once; the others find it
    if (!lead) c.model.path = ensure_demo_policy(c);
    if (c.tokenizer.path.empty()) c.tokenizer.path = c.model.path + "/tokenizer.json";
  }
  // Several ranks on `device: cuda`: each takes GPU LOCAL_RANK (the one NCCL selected).
  RunConfig c_session = c;
  if (W > 1 && c.device == "cuda") c_session.device = "cuda:" + std::to_string(comm->local_rank());
  Session s = session_open(c_session, cache_dir());
  const std::string recompute = session_check_memory(s);  // refused here, before any work, when the plan cannot fit
  Backend& be = *s.backend;
  RunDir run;
  if (lead) {
    run = run_dir_create(c.out, resume);
    run_dir_save_config(run, c);  // train.recompute as given (auto stays auto)
  } else {
    run.path = c.out;
  }
  c.train.recompute = recompute;
  comm->barrier();  // the run directory exists (and a refused one stopped every rank)
  const PrecisionRecipe recipe = config_precision_recipe(c.precision);
  const GrpoLossOptions loss_opt = config_grpo_options(c.train);
  const int mini_batches = std::max(1, c.train.optimizer_steps_per_rollout);
  const LrSchedule lr_sched = config_lr_schedule(c.train, static_cast<int64_t>(c.steps) * mini_batches);
  const bool fp8_kv = recipe.generator.kv_cache == DType::E4M3;
  const float temperature = static_cast<float>(c.rollout.temperature);

  // Policy: the latest checkpoint when resuming, else the starting policy.
  std::optional<std::string> ckpt = resume ? checkpoint_latest(run.checkpoints_dir()) : std::nullopt;
  TrainerState state;
  state.seed = static_cast<uint64_t>(c.seed);
  if (ckpt) {
    // Validated before anything is loaded: the state itself, every file's checksum, and the
    // run's metrics.jsonl, which must reach the checkpoint's step (lines after it are dropped).
    state = checkpoint_read_state(*ckpt);
    checkpoint_verify_files(*ckpt, state);
    const int64_t logged = metrics_last_step(run.metrics_path());
    if (logged < state.step)
      FP8RL_FAIL("cannot resume: ", *ckpt, " is the checkpoint of step ", state.step, " but ", run.metrics_path(),
                 logged < 0 ? std::string(" has no step lines") : " ends at step " + std::to_string(logged),
                 "; the run directory's files do not belong together (resume from a matching checkpoint "
                 "by fixing checkpoints/latest, or start a new run)");
  }
  ModelWeights host = ckpt ? checkpoint_load_policy(*ckpt) : session_initial_policy(s);
  session_set_model(s, host.config.vocab_size);
  check_positions(c, host.config);
  session_check_model(s, host.config);
  s.max_positions = host.config.max_position_embeddings;
  s.max_new_tokens = c.rollout.max_new_tokens;
  const MemoryPlan plan = memory_plan_compute(memory_plan_input(c, host.config, be.act_dtype()));
  if (lead) {
    std::printf("policy: %s, %lld parameters; recipe %s (generator %s%s, trainer %s); device %s\n",
                host.config.model_type.c_str(), static_cast<long long>(model_count_parameters(host)),
                recipe.name.c_str(), linear_mode_name(recipe.generator.linear), fp8_kv ? " + FP8 KV" : "",
                linear_mode_name(recipe.trainer.linear), be.name().c_str());
    std::fputs(memory_plan_format(plan, host.config).c_str(), stdout);
  }
  std::fflush(stdout);
  memory_plan_check_host(plan, c.device);
  Trainer trainer(be, model_weights_to_device(be, host, DType::F32), recipe.trainer, trainer_options(c));
  if (W > 1) trainer.set_communicator(comm.get(), c.train.shard_optimizer);  // gradients summed over the ranks
  std::unique_ptr<Trainer> reference;  // frozen initial policy for the k3 KL term
  if (c.train.kl_beta > 0) {
    ModelWeights ref = session_initial_policy(s);
    TrainerOptions frozen = trainer_options(c);
    frozen.frozen = true;  // weights only, in the trainer's compute dtypes
    reference = std::make_unique<Trainer>(be, model_weights_to_device(be, ref, DType::F32), recipe.trainer, frozen);
  }
  RolloutEngine engine(be, trainer.master(), recipe.generator, static_cast<int>(memory_plan_kv_pages(c)), 16,
                       kRolloutMaxBatch);
  if (ckpt) {
    checkpoint_load_optimizer(be, trainer, *ckpt, state);
    if (fp8_kv && !state.kv_scales.k.empty()) engine.refit(trainer.master(), &state.kv_scales);
    if (lead) std::printf("resumed from %s at step %lld\n", ckpt->c_str(), static_cast<long long>(state.step));
  }

  if (resume && lead) metrics_truncate_after(run.metrics_path(), ckpt ? state.step : -1);
  if (fp8_kv && !ckpt) {
    // Initial KV scales: the E4M3 cache must not start at scale 1. Calibrate from the trainer's
    // forward over the first step's prompts, as every later step does over its whole batch.
    // Every rank scores all P prompts (cheap): the same scales everywhere, no communication.
    std::vector<TrainSequence> calib;
    for (int p = 0; p < P; ++p) {
      TrainSequence t;
      t.ids = s.prompt_ids(s.train_item(p));
      t.prompt_len = static_cast<int>(t.ids.size());
      calib.push_back(std::move(t));
    }
    ScoreResult sc = trainer.score(calib, temperature, /*entropy=*/false, /*record_amax=*/true);
    state.kv_scales = kv_scales_calibrate(sc.k_amax, sc.v_amax, static_cast<float>(c.precision.kv_calib_percentile),
                                          static_cast<float>(c.precision.kv_calib_margin));
    engine.refit(trainer.master(), &state.kv_scales);
  }
  std::optional<MetricsLog> log;
  if (lead) {
    log.emplace(run.path);
    if (c.logger.tensorboard) {
      log->enable_tensorboard(run.path + "/tensorboard");
      std::printf("tensorboard: %s/tensorboard (tensorboard --logdir %s)\n", run.path.c_str(), run.path.c_str());
    }
  }
  InterruptNote interrupt_note(ckpt ? "interrupted; the last checkpoint is " + *ckpt + ": " + resume_hint(c.out)
                                    : "interrupted before the first checkpoint of " + c.out +
                                          " (nothing to resume; checkpoint_every=N saves every N steps)");
  std::optional<std::pair<int64_t, double>> first_val, last_val;  // (step, accuracy), for the summary
  if (!ckpt && c.val_every > 0 && lead) {
    ValResult v = validate(s, engine, c.val_size, c.rollout.max_new_tokens);
    StepMetrics m;
    m.step = 0;
    m.val_accuracy = v.accuracy;
    first_val = {0, v.accuracy};
    m.extra.push_back({"val_reward_mean", v.reward_mean});
    m.extra.push_back({"time_validation_s", v.seconds});
    log->write(m, c.steps);
    print_example(v);
  }

  BadStepGuard bad_steps(c.max_consecutive_bad_steps, bad_step_hint(c, "train.lr", c.train.lr));
  NoSignalWatch no_signal(3);
  Progress run_bar("run", c.steps, stderr);
  run_bar.update(state.step);
  int64_t generated_tokens = 0, steps_run = 0;
  double generation_s = 0;
  double slowest_step_s = 0;  // with validation: what one more step may cost
  for (int64_t step = state.step + 1; step <= c.steps; ++step) {
    // time_budget_s: a step that leaves no time for another (at the slowest step's pace) is the
    // last: it validates and checkpoints like step `steps`. A step slower than predicted can
    // still overrun; then the run stops here, before starting one that would not finish.
    // With several ranks, rank 0's clock decides for all.
    int budget[2] = {c.time_budget_s > 0 && step > state.step + 1 && seconds_since(t_run) + slowest_step_s > c.time_budget_s,
                     step == c.steps || (c.time_budget_s > 0 && seconds_since(t_run) + 2 * slowest_step_s > c.time_budget_s)};
    if (W > 1 && c.time_budget_s > 0) comm->broadcast(budget, sizeof budget, 0);
    if (budget[0]) {
      if (lead)
        std::printf("time budget: %.0f s of %.0f s used after step %lld of %d; stopping\n", seconds_since(t_run),
                    c.time_budget_s, static_cast<long long>(step - 1), c.steps);
      break;
    }
    const bool final_step = budget[1];
    if (final_step && step < c.steps && lead)
      std::printf("time budget: step %lld is the last that fits in %.0f s\n", static_cast<long long>(step), c.time_budget_s);
    StepMetrics m;
    m.step = step;
    const auto t_step = Clock::now();
    double time_reward_s = 0, step_grad_norm = 0, step_generated = 0;
    std::vector<float> rewards;                                    // [P x G], for the no-signal watch
    std::vector<std::pair<std::string, double>> reward_metrics;  // a Python reward's extra keys
    bool diverged = false;  // generation, scoring or the refit met a NaN/Inf: the step is skipped
    try {  // phases 1-5 (not re-indented, to keep the diff small)

    // 1. Prompts and rollout (this rank's prompts).
    std::vector<TaskItem> items;
    std::vector<RolloutRequest> reqs;
    for (int p = p_begin; p < p_end; ++p) {
      items.push_back(s.train_item((step - 1) * P + p));
      reqs.push_back({s.prompt_ids(items.back()), G});
    }
    SamplingParams sp;
    sp.temperature = temperature;
    sp.top_p = static_cast<float>(c.rollout.top_p);
    sp.top_k = c.rollout.top_k;
    sp.max_new_tokens = c.rollout.max_new_tokens;
    sp.stop_ids = s.stop_ids;
    sp.valid_vocab = s.sampling_vocab;
    sp.seed = mix(static_cast<uint64_t>(c.seed), static_cast<uint64_t>(step));
    sp.first_request = p_begin;
    auto t0 = Clock::now();
    std::vector<RolloutSample> samples;
    {
      Progress bar("step " + std::to_string(step) + " generate", static_cast<int64_t>(P) * G * sp.max_new_tokens,
                   stderr);
      sp.on_progress = [&](int64_t done, int64_t) { bar.update(done); };
      samples = engine.generate(reqs, sp);
      bar.finish_quietly();
    }
    m.time_generation_s = seconds_since(t0);
    step_generated = static_cast<double>(engine.last_stats().generated_tokens);

    // 2. Rewards and advantages.
    std::vector<uint8_t> correct;
    std::vector<int64_t> lengths;
    std::vector<TrainSequence> seqs;
    std::vector<float> logp_gen;
    std::vector<int64_t> offsets{0};
    t0 = Clock::now();
    std::vector<const TaskItem*> sample_items;
    std::vector<std::string> texts;
    for (const RolloutSample& r : samples) {
      sample_items.push_back(&items[r.request]);
      texts.push_back(s.response_text(r.tokens));
    }
    std::vector<double> rws;
    try {
      rws = s.rewards(sample_items, texts, &reward_metrics);
    } catch (const Error& e) {
      // Keep the failing batch for reproduction; metrics and checkpoints so far are on disk.
      std::string dump;
      for (const nlohmann::json& j : s.reward_samples(sample_items, texts))
        dump += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
      const std::string path = run.path + "/reward_failure.jsonl";
      write_file_atomic(path, dump);
      FP8RL_FAIL(e.message(), "\nstep ", step, ": the batch's ", texts.size(), " samples are in ", path,
                 "; metrics.jsonl holds every finished step");
    }
    for (size_t i = 0; i < samples.size(); ++i) {
      const RolloutSample& r = samples[i];
      const double rw = rws[i];
      rewards.push_back(static_cast<float>(rw));
      correct.push_back(rw >= 0.5);
      lengths.push_back(static_cast<int64_t>(r.tokens.size()));
      TrainSequence ts;
      ts.ids = reqs[r.request].prompt;
      ts.prompt_len = static_cast<int>(ts.ids.size());
      ts.ids.insert(ts.ids.end(), r.tokens.begin(), r.tokens.end());
      seqs.push_back(std::move(ts));
      logp_gen.insert(logp_gen.end(), r.logp.begin(), r.logp.end());
      offsets.push_back(offsets.back() + static_cast<int64_t>(r.tokens.size()));
    }
    time_reward_s = seconds_since(t0);
    const std::vector<float> adv = grpo_compute_advantages(rewards, G, c.train.baseline);  // whole groups
    m.reward_mean = metrics_mean(dist_all_gather_v(*comm, rewards));
    m.accuracy = metrics_accuracy(dist_all_gather_v(*comm, correct));
    LengthStats ls = metrics_length_stats(dist_all_gather_v(*comm, lengths), c.rollout.max_new_tokens);
    step_metrics_set_lengths(m, ls);

    // 3. Trainer scoring: logp_old (+ q/k/v amax for the KV scales).
    t0 = Clock::now();
    if (fp8_kv) {  // a recipe whose trainer rounds k/v as the cache does uses this rollout's scales
      const KvScales used = engine.kv_scales();
      trainer.set_kv_rounding(used.k, used.v);
    }
    ScoreResult old = trainer.score(seqs, temperature, /*entropy=*/true, /*record_amax=*/fp8_kv);
    std::vector<float> logp_ref;
    if (reference) logp_ref = reference->score(seqs, temperature, false, false).logp;
    m.time_logprob_s = seconds_since(t0);
    MismatchMetrics mm = metrics_compute_mismatch(dist_all_gather_v(*comm, old.logp), dist_all_gather_v(*comm, logp_gen));
    step_metrics_set_mismatch(m, mm);
    m.entropy_mean = metrics_masked_mean(dist_all_gather_v(*comm, old.entropy));

    // 4. Optimizer steps over mini-batches of whole sequences.
    t0 = Clock::now();
    GrpoRollout ro;
    ro.seqs = std::move(seqs);
    ro.offsets = std::move(offsets);
    ro.advantages = adv;
    ro.logp_gen = std::move(logp_gen);
    ro.logp_old = old.logp;
    ro.logp_ref = std::move(logp_ref);
    GrpoShard shard;  // this rank's sequences of the global batch (one rank: all of them)
    shard.comm = comm.get();
    shard.first = static_cast<int64_t>(p_begin) * G;
    shard.global_seqs = static_cast<int64_t>(P) * G;
    Progress train_bar("step " + std::to_string(step) + " train", mini_batches, stderr);
    int optimizer_steps_done = 0;
    GrpoUpdateResult up = grpo_update(
        trainer, ro, loss_opt, mini_batches, temperature,
        [&](int64_t opt_step) { return lr_schedule_at(lr_sched, opt_step); },
        [&](const StepResult& sr) {
          train_bar.update(++optimizer_steps_done);
          return bad_steps.record(sr, step);
        },
        shard);
    train_bar.finish_quietly();
    grpo_stats_all_reduce(*comm, up.stats);
    const double loss = up.loss, gnorm = up.grad_norm;  // global: the trainer reduced them
    step_grad_norm = gnorm;
    const int applied = up.applied;
    const GrpoStats& stats = up.stats;
    m.lr = up.lr;
    m.time_train_s = seconds_since(t0);
    m.loss = loss;
    m.grad_norm = gnorm;
    step_metrics_set_loss_stats(m, stats);
    m.extra.push_back({"skipped_optimizer_steps", static_cast<double>(mini_batches - applied)});

    // 5. KV-scale calibration and refit.
    t0 = Clock::now();
    KvScales scales;
    if (fp8_kv) {
      scales = kv_scales_calibrate(amax_all_gather(*comm, old.k_amax), amax_all_gather(*comm, old.v_amax),
                                   static_cast<float>(c.precision.kv_calib_percentile),
                                   static_cast<float>(c.precision.kv_calib_margin));
      m.extra.push_back({"kv_scale_k_mean", metrics_mean(scales.k)});
      m.extra.push_back({"kv_scale_v_mean", metrics_mean(scales.v)});
    }
    m.time_calibration_s = seconds_since(t0);
    t0 = Clock::now();
    engine.refit(trainer.master(), fp8_kv ? &scales : nullptr);
    be.synchronize();
    m.time_refit_s = seconds_since(t0);
    state.kv_scales = scales;
    } catch (const NonFiniteError& e) {
      // The policy produced NaN/Inf outside an optimizer step (sampling, scoring, the refit):
      // nothing of this step is used; it counts as a skipped step, and max_consecutive_bad_steps
      // of them in a row stop the run with the likely cause.
      std::string msg = e.what();
      if (const size_t tag = msg.rfind(" ["); tag != std::string::npos) msg.resize(tag);
      StepResult sr;
      sr.loss = sr.grad_norm = std::nan("");
      sr.skip_reason = "non-finite values in generation or scoring: " + msg;
      diverged = true;
      bad_steps.record(sr, step);
      bool logged = false;
      for (auto& [k, v] : m.extra) logged |= k == "skipped_optimizer_steps";
      if (!logged) m.extra.push_back({"skipped_optimizer_steps", static_cast<double>(mini_batches)});
      m.extra.push_back({"skipped_step", 1.0});
    }
    state.step = step;
    state.optimizer_step = trainer.optimizer_step();

    // 6. Validation, metrics, checkpoint. Timing without validation: what the step costs.
    // Several ranks: phase times are the slowest rank's, throughput the job's.
    double times[] = {m.time_generation_s, m.time_logprob_s, m.time_train_s, time_reward_s, seconds_since(t_step)};
    comm->all_reduce(times, std::size(times), ReduceOp::Max);
    comm->all_reduce(&step_generated, 1, ReduceOp::Sum);
    m.time_generation_s = times[0], m.time_logprob_s = times[1], m.time_train_s = times[2];
    m.generation_tokens_per_s = step_generated / std::max(1e-9, m.time_generation_s);
    generated_tokens += static_cast<int64_t>(step_generated);
    generation_s += m.time_generation_s;
    const double step_s = times[4];
    m.extra.push_back({"time_reward_s", times[3]});
    for (const auto& kv : reward_metrics) m.extra.push_back(kv);
    m.extra.push_back({"time_step_excl_val_s", step_s});
    m.extra.push_back({"time_refit_calib_fraction", (m.time_refit_s + m.time_calibration_s) / std::max(1e-9, step_s)});
    if (!diverged && c.val_every > 0 && (step % c.val_every == 0 || final_step) && lead) {
      ValResult v = validate(s, engine, c.val_size, c.rollout.max_new_tokens);
      m.val_accuracy = v.accuracy;
      last_val = {step, v.accuracy};
      m.extra.push_back({"val_reward_mean", v.reward_mean});
      m.extra.push_back({"time_validation_s", v.seconds});
    }
    m.time_step_s = seconds_since(t_step);
    slowest_step_s = std::max(slowest_step_s, m.time_step_s);
    if (lead) log->write(m, c.steps);
    ++steps_run;
    if (!diverged && lead)
      if (auto warn = no_signal.record(step, rewards, G, step_grad_norm)) console_line(stderr, "%s", warn->c_str());
    const bool save = (c.checkpoint_every > 0 && step % c.checkpoint_every == 0) || final_step;
    if (save) trainer.gather_optimizer_state();  // ZeRO-1: the moments to rank 0 (every rank)
    if (save && lead) {
      const std::string saved = checkpoint_save(be, trainer, state, run.checkpoints_dir(),
                                                  checkpoint_options(c, s.tokenizer_json));
      interrupt_note.set("interrupted; the last checkpoint is " + saved + " (step " + std::to_string(step) + "): " +
                         resume_hint(c.out));
      for (const std::string& p : checkpoint_prune(run.checkpoints_dir(), c.checkpoint.keep_last))
        console_line(stdout, "checkpoint.keep_last=%d: removed %s", c.checkpoint.keep_last, p.c_str());
    }
    run_bar.update(step);
    if (final_step) break;
  }
  run_bar.finish_quietly();
  if (first_val && last_val)
    std::printf("validation accuracy: %.3f at step %lld -> %.3f at step %lld (%+.1f points)\n", first_val->second,
                static_cast<long long>(first_val->first), last_val->second, static_cast<long long>(last_val->first),
                100.0 * (last_val->second - first_val->second));
  comm->barrier();  // every rank ends after rank 0 has written the last checkpoint
  if (lead) {
    const double total_s = seconds_since(t_run);
    std::printf("done in %s (setup included): %lld steps, %lld tokens generated at %.0f tokens/s; %s (metrics: %s)\n",
                format_duration(total_s).c_str(), static_cast<long long>(steps_run),
                static_cast<long long>(generated_tokens), generated_tokens / std::max(1e-9, generation_s),
                run.path.c_str(), run.metrics_path().c_str());
  }
  return 0;
}

}  // namespace fp8rl
