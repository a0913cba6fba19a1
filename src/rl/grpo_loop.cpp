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
#include <signal.h>
#include <unistd.h>
#include <cerrno>
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

// Removes what killed runs left of their cache build beside `dir`: its scratch directories
// `dir.run.<pid>` and `dir.tmp.<pid>` whose process no longer exists (and those of older fp8rl
// versions, without a pid). A live run's are left alone.
void remove_dead_scratch(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(dir).parent_path();
  const std::string base = fs::path(dir).filename().string();
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) return;
  std::vector<fs::path> dead;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string n = e.path().filename().string();
    for (const char* kind : {".run", ".tmp"}) {
      const std::string stem = base + kind;
      if (n == stem) dead.push_back(e.path());
      if (n.size() <= stem.size() + 1 || n.compare(0, stem.size() + 1, stem + ".") != 0) continue;
      const std::string digits = n.substr(stem.size() + 1);
      if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      const pid_t pid = static_cast<pid_t>(std::stol(digits));
      if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) dead.push_back(e.path());
    }
  }
  for (const fs::path& p : dead) fs::remove_all(p, ec);
}

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
    k.train.routing_replay = d.routing_replay;
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
  // Atomic: the SFT run and the copy live in scratch directories of this process (two runs
  // started together from one cache each train their own; a killed run's are removed by the
  // next build, remove_dead_scratch) and `dir` appears by one rename, complete or not at all.
  namespace fs = std::filesystem;
  remove_dead_scratch(dir);
  const std::string pid = std::to_string(::getpid());
  s.out = dir + ".run." + pid;
  s.precision.recipe = "bf16";
  fs::remove_all(s.out);
  const std::string ckpt = sft_run(s, /*print_plan=*/false);
  const std::string tmp = dir + ".tmp." + pid;
  fs::remove_all(tmp);
  fs::create_directories(fs::path(dir).parent_path());
  fs::copy(ckpt, tmp, fs::copy_options::recursive);
  fs::remove_all(s.out);
  if (fs::exists(dir + "/model.safetensors")) {
    fs::remove_all(tmp);  // a run started beside this one cached the same policy first
    return dir;
  }
  fs::remove_all(dir);  // a directory without model.safetensors (not ours, or from an older fp8rl)
  std::error_code ec;
  fs::rename(tmp, dir, ec);
  if (ec) {  // another run renamed its copy in between: the same policy, keep that one
    fs::remove_all(tmp);
    if (!fs::exists(dir + "/model.safetensors"))
      FP8RL_FAIL("cannot cache the starting policy in '", dir, "': ", ec.message(),
                 " (is the cache directory writable? FP8RL_CACHE_DIR moves it)");
  }
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
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer())
      last = std::max(last, j["step"].get<int64_t>());
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

std::string resume_hint(const std::string& out) { return "continue with: fp8rl train --out " + out + " --resume"; }

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

// ---- the run: what it holds from start to end ---------------------------------------------

struct GrpoRun {
  RunConfig c;
  std::unique_ptr<Communicator> comm;
  int rank = 0, W = 1;
  bool lead = true;            // rank 0: writes the run directory, validates, prints
  int P = 0, G = 0;            // prompts per step, generations per prompt
  int p_begin = 0, p_end = 0;  // this rank's prompts of each step
  Session s;
  RunDir run;
  PrecisionRecipe recipe;
  GrpoLossOptions loss_opt;
  int mini_batches = 1;
  LrSchedule lr_sched;
  bool fp8_kv = false;
  float temperature = 1;
  std::optional<std::string> ckpt;  // the checkpoint resumed from
  TrainerState state;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<Trainer> reference;  // frozen initial policy for the k3 KL term
  std::unique_ptr<RolloutEngine> engine;
  MemoryChoice memory;            // train.recompute, dgrad_weight_cache (auto resolved), the KV pool: start-up check
  std::optional<MetricsLog> log;  // rank 0
  std::optional<std::pair<int64_t, double>> first_val, last_val;  // (step, accuracy), for the summary
  int64_t generated_tokens = 0, steps_run = 0;
  double generation_s = 0;
  double slowest_step_s = 0;  // with validation: what one more step may cost
};

// One step's data, handed from phase to phase.
struct GrpoStep {
  int64_t step = 0;
  bool final_step = false;
  StepMetrics m;
  Clock::time_point t_start;
  double time_reward_s = 0, grad_norm = 0, generated = 0;
  std::vector<TaskItem> items;  // this rank's prompts
  std::vector<RolloutRequest> reqs;
  std::vector<RolloutSample> samples;
  std::vector<float> rewards;                                  // [P x G], for the no-signal watch
  std::vector<std::pair<std::string, double>> reward_metrics;  // a Python reward's extra keys
  std::vector<TrainSequence> seqs;                             // prompt + response per sample
  std::vector<float> logp_gen;                                 // the generator's logprobs, concatenated over samples
  std::vector<int64_t> offsets{0};                             // where each sample's tokens start in logp_gen
  std::vector<float> advantages;
  ScoreResult old;  // logp_old, entropy (+ q/k/v amax); all sequences once step_optimize has run
  // train.old_logprobs auto: the first mini-batch is scored by its own optimizer step's forward
  // (step_optimize); step_score scores this rank's sequences from old_from on.
  bool own_first = false;
  size_t old_from = 0;
  bool old_complete = true;  // false: that forward stopped on a non-finite value (scores partial)
  std::vector<float> logp_ref;
  bool diverged = false;  // generation, scoring or the refit met a NaN/Inf: the step is skipped
};

// ---- setup ------------------------------------------------------------------------------

// The job's ranks (one without launcher variables), opened first: NCCL picks the GPU. The
// demo's starting policy is trained (rank 0) or found (the others).
void setup_ranks(GrpoRun& r, const RunConfig& config_in) {
  r.c = config_in;
  RunConfig& c = r.c;
  const bool on_cuda = c.device.rfind("cuda", 0) == 0;
  r.comm = dist_open(dist_env_read(), on_cuda ? DeviceKind::CUDA : DeviceKind::CPU);
  r.rank = r.comm->rank(), r.W = r.comm->world_size();
  r.lead = r.rank == 0;
  r.P = c.rollout.prompts_per_step, r.G = c.rollout.generations_per_prompt;
  const int P = r.P, W = r.W;
  if (P < W)
    FP8RL_FAIL("rollout.prompts_per_step=", P, " is below the number of ranks (", W,
               "); every rank needs whole "
               "prompt groups: raise rollout.prompts_per_step to at least ",
               W, " or launch fewer ranks");
  r.p_begin = P * r.rank / W, r.p_end = P * (r.rank + 1) / W;
  if (W > 1 && r.lead)
    std::printf("data parallel: %d ranks (%s), %d-%d prompts of %d per rank%s\n", W, r.comm->name().c_str(), P / W,
                (P + W - 1) / W, P, c.train.shard_optimizer ? "; AdamW moments sharded (ZeRO-1)" : "");
  if (c.model.path.empty()) {
    if (r.lead) c.model.path = ensure_demo_policy(c);
    r.comm->barrier();  // rank 0 trains and caches the starting policy once; the others find it
    if (!r.lead) c.model.path = ensure_demo_policy(c);
    if (c.tokenizer.path.empty()) c.tokenizer.path = c.model.path + "/tokenizer.json";
  }
}

// The session (backend, task, tokenizer), the memory check, the run directory and the recipe.
void setup_session(GrpoRun& r, bool resume) {
  RunConfig& c = r.c;
  // Several ranks on `device: cuda`: each takes GPU LOCAL_RANK (the one NCCL selected).
  RunConfig c_session = c;
  if (r.W > 1 && c.device == "cuda") c_session.device = "cuda:" + std::to_string(r.comm->local_rank());
  r.s = session_open(c_session, cache_dir());
  r.memory = session_check_memory(r.s);  // refused here, before any work, when the plan cannot fit
  if (r.lead) {
    r.run = run_dir_create(c.out, resume);
    run_dir_save_config(r.run, c);  // train.recompute, train.dgrad_weight_cache as given (auto stays auto)
  } else {
    r.run.path = c.out;
  }
  c.train.recompute = r.memory.recompute;
  c.train.dgrad_weight_cache = r.memory.dgrad_weight_cache;
  r.comm->barrier();  // the run directory exists (and a refused one stopped every rank)
  r.recipe = config_precision_recipe(c.precision);
  r.loss_opt = config_grpo_options(c.train);
  r.mini_batches = std::max(1, c.train.optimizer_steps_per_rollout);
  r.lr_sched = config_lr_schedule(c.train, static_cast<int64_t>(c.steps) * r.mini_batches);
  r.fp8_kv = r.recipe.generator.kv_cache == DType::E4M3;
  r.temperature = static_cast<float>(c.rollout.temperature);
}

// Policy: the latest checkpoint when resuming, else the starting policy; the trainer, the
// reference policy (kl_beta > 0) and the rollout engine.
void setup_models(GrpoRun& r, bool resume) {
  const RunConfig& c = r.c;
  Backend& be = *r.s.backend;
  r.ckpt = resume ? checkpoint_latest(r.run.checkpoints_dir()) : std::nullopt;
  r.state.seed = static_cast<uint64_t>(c.seed);
  if (r.ckpt) {
    // Validated before anything is loaded: the state itself, every file's checksum, and the
    // run's metrics.jsonl, which must reach the checkpoint's step (lines after it are dropped).
    r.state = checkpoint_read_state(*r.ckpt);
    checkpoint_verify_files(*r.ckpt, r.state);
    const int64_t logged = metrics_last_step(r.run.metrics_path());
    if (logged < r.state.step)
      FP8RL_FAIL("cannot resume: ", *r.ckpt, " is the checkpoint of step ", r.state.step, " but ", r.run.metrics_path(),
                 logged < 0 ? std::string(" has no step lines") : " ends at step " + std::to_string(logged),
                 "; the run directory's files do not belong together (resume from a matching checkpoint "
                 "by fixing checkpoints/latest, or start a new run)");
  }
  ModelWeights host = r.ckpt ? checkpoint_load_policy(*r.ckpt) : session_initial_policy(r.s);
  session_set_model(r.s, host.config.vocab_size);
  check_positions(c, host.config);
  session_check_model(r.s, host.config);
  r.s.max_positions = host.config.max_position_embeddings;
  r.s.max_new_tokens = c.rollout.max_new_tokens;
  const MemoryPlan plan = memory_plan_compute(memory_plan_input_chosen(c, host.config, be.act_dtype(), r.memory));
  if (r.lead) {
    std::printf("policy: %s, %lld parameters; recipe %s (generator %s%s, trainer %s); device %s\n",
                host.config.model_type.c_str(), static_cast<long long>(model_count_parameters(host)),
                r.recipe.name.c_str(), linear_mode_name(r.recipe.generator.linear), r.fp8_kv ? " + FP8 KV" : "",
                linear_mode_name(r.recipe.trainer.linear), be.name().c_str());
    std::fputs(memory_plan_format(plan, host.config).c_str(), stdout);
    if (c.train.routing_replay)
      std::printf(host.config.is_moe()
                      ? "routing replay: the trainer uses the generator's experts (train.routing_replay)\n"
                      : "train.routing_replay: the model has no mixture-of-experts layers; nothing to replay\n");
  }
  std::fflush(stdout);
  memory_plan_check_host(plan, c.device);
  r.trainer = std::make_unique<Trainer>(be, model_weights_to_device(be, host, DType::F32), r.recipe.trainer,
                                        trainer_options(c));
  if (r.W > 1) r.trainer->set_communicator(r.comm.get(), c.train.shard_optimizer);  // gradients summed over the ranks
  if (c.train.kl_beta > 0) {
    ModelWeights ref = session_initial_policy(r.s);
    TrainerOptions frozen = trainer_options(c);
    frozen.frozen = true;  // weights only, in the trainer's compute dtypes
    r.reference = std::make_unique<Trainer>(be, model_weights_to_device(be, ref, DType::F32), r.recipe.trainer, frozen);
  }
  r.engine = std::make_unique<RolloutEngine>(be, r.trainer->master(), r.recipe.generator,
                                             static_cast<int>(r.memory.kv_pages), 16, c.rollout.max_num_seqs);
  if (r.ckpt) {
    checkpoint_load_optimizer(be, *r.trainer, *r.ckpt, r.state);
    if (r.fp8_kv && !r.state.kv_scales.k.empty()) r.engine->refit(r.trainer->master(), &r.state.kv_scales);
    if (r.lead) std::printf("resumed from %s at step %lld\n", r.ckpt->c_str(), static_cast<long long>(r.state.step));
  }
  if (resume && r.lead) metrics_truncate_after(r.run.metrics_path(), r.ckpt ? r.state.step : -1);
}

// Initial KV scales: the E4M3 cache must not start at scale 1. Calibrate from the trainer's
// forward over the first step's prompts, as every later step does over its whole batch.
// Every rank scores all P prompts (cheap): the same scales everywhere, no communication.
void setup_initial_kv_scales(GrpoRun& r) {
  std::vector<TrainSequence> calib;
  for (int p = 0; p < r.P; ++p) {
    TrainSequence t;
    t.ids = r.s.prompt_ids(r.s.train_item(p));
    t.prompt_len = static_cast<int>(t.ids.size());
    calib.push_back(std::move(t));
  }
  ScoreResult sc = r.trainer->score(calib, r.temperature, /*entropy=*/false, /*record_amax=*/true);
  r.state.kv_scales = kv_scales_calibrate(sc.k_amax, sc.v_amax, static_cast<float>(r.c.precision.kv_calib_percentile),
                                          static_cast<float>(r.c.precision.kv_calib_margin), r.c.precision.pow2_scales);
  r.engine->refit(r.trainer->master(), &r.state.kv_scales);
}

// metrics.jsonl (+ TensorBoard) on rank 0.
void setup_log(GrpoRun& r) {
  if (!r.lead) return;
  r.log.emplace(r.run.path);
  if (r.c.logger.tensorboard) {
    r.log->enable_tensorboard(r.run.path + "/tensorboard");
    std::printf("tensorboard: %s/tensorboard (tensorboard --logdir %s)\n", r.run.path.c_str(), r.run.path.c_str());
  }
}

// Step 0's validation (a fresh run, rank 0): the starting point of the validation curve.
void validate_start(GrpoRun& r) {
  ValResult v = validate(r.s, *r.engine, r.c.val_size, r.c.rollout.max_new_tokens);
  StepMetrics m;
  m.step = 0;
  m.val_accuracy = v.accuracy;
  r.first_val = {0, v.accuracy};
  m.extra.push_back({"val_reward_mean", v.reward_mean});
  m.extra.push_back({"time_validation_s", v.seconds});
  r.log->write(m, r.c.steps);
  print_example(v);
}

// ---- the phases of one step ---------------------------------------------------------------

// Prompts and rollout (this rank's prompts): samples with the generator's logprobs.
void step_rollout(GrpoRun& r, GrpoStep& d) {
  const RunConfig& c = r.c;
  for (int p = r.p_begin; p < r.p_end; ++p) {
    d.items.push_back(r.s.train_item((d.step - 1) * r.P + p));
    d.reqs.push_back({r.s.prompt_ids(d.items.back()), r.G});
  }
  SamplingParams sp;
  sp.temperature = r.temperature;
  sp.top_p = static_cast<float>(c.rollout.top_p);
  sp.top_k = c.rollout.top_k;
  sp.max_new_tokens = c.rollout.max_new_tokens;
  sp.stop_ids = r.s.stop_ids;
  sp.valid_vocab = r.s.sampling_vocab;
  sp.seed = mix(static_cast<uint64_t>(c.seed), static_cast<uint64_t>(d.step));
  sp.first_request = r.p_begin;
  // MoE: the generator's experts per token, for the routing-agreement metrics and routing replay
  sp.record_routing = r.engine->weights().config.is_moe();
  auto t0 = Clock::now();
  {
    Progress bar("step " + std::to_string(d.step) + " generate", static_cast<int64_t>(r.P) * r.G * sp.max_new_tokens,
                 stderr);
    sp.on_progress = [&](int64_t done, int64_t) { bar.update(done); };
    d.samples = r.engine->generate(d.reqs, sp);
    bar.finish_quietly();
  }
  d.m.time_generation_s = seconds_since(t0);
  d.generated = static_cast<double>(r.engine->last_stats().generated_tokens);
}

// Rewards and advantages (whole groups); the training sequences; reward and length metrics.
void step_rewards(GrpoRun& r, GrpoStep& d) {
  Communicator& comm = *r.comm;
  std::vector<uint8_t> correct;
  std::vector<int64_t> lengths;
  auto t0 = Clock::now();
  std::vector<const TaskItem*> sample_items;
  std::vector<std::string> texts;
  for (const RolloutSample& rs : d.samples) {
    sample_items.push_back(&d.items[rs.request]);
    texts.push_back(r.s.response_text(rs.tokens));
  }
  std::vector<double> rws;
  try {
    rws = r.s.rewards(sample_items, texts, &d.reward_metrics);
  } catch (const Error& e) {
    // Keep the failing batch for reproduction; metrics and checkpoints so far are on disk.
    std::string dump;
    for (const nlohmann::json& j : r.s.reward_samples(sample_items, texts))
      dump += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    const std::string path = r.run.path + "/reward_failure.jsonl";
    write_file_atomic(path, dump);
    FP8RL_FAIL(e.message(), "\nstep ", d.step, ": the batch's ", texts.size(), " samples are in ", path,
               "; metrics.jsonl holds every finished step");
  }
  for (size_t i = 0; i < d.samples.size(); ++i) {
    RolloutSample& rs = d.samples[i];
    const double rw = rws[i];
    d.rewards.push_back(static_cast<float>(rw));
    correct.push_back(rw >= 0.5);
    lengths.push_back(static_cast<int64_t>(rs.tokens.size()));
    TrainSequence ts;
    ts.ids = d.reqs[rs.request].prompt;
    ts.prompt_len = static_cast<int>(ts.ids.size());
    ts.ids.insert(ts.ids.end(), rs.tokens.begin(), rs.tokens.end());
    ts.routing = std::move(rs.routing);  // MoE: the generator's experts of prompt + response
    d.seqs.push_back(std::move(ts));
    d.logp_gen.insert(d.logp_gen.end(), rs.logp.begin(), rs.logp.end());
    d.offsets.push_back(d.offsets.back() + static_cast<int64_t>(rs.tokens.size()));
  }
  d.time_reward_s = seconds_since(t0);
  d.advantages = grpo_compute_advantages(d.rewards, r.G, r.c.train.baseline);  // whole groups
  d.m.reward_mean = metrics_mean(dist_all_gather_v(comm, d.rewards));
  d.m.accuracy = metrics_accuracy(dist_all_gather_v(comm, correct));
  LengthStats ls = metrics_length_stats(dist_all_gather_v(comm, lengths), r.c.rollout.max_new_tokens);
  step_metrics_set_lengths(d.m, ls);
}

// This rank's share of the step's global batch (whole prompt groups, rank order).
GrpoShard step_shard(const GrpoRun& r) {
  GrpoShard shard;
  shard.comm = r.comm.get();
  shard.first = static_cast<int64_t>(r.p_begin) * r.G;
  shard.global_seqs = static_cast<int64_t>(r.P) * r.G;
  return shard;
}

// The generator/trainer mismatch (and MoE routing) metrics of d.old against logp_gen.
void step_mismatch_metrics(GrpoRun& r, GrpoStep& d, const std::vector<float>& logp_gen) {
  Communicator& comm = *r.comm;
  MismatchMetrics mm = metrics_compute_mismatch(dist_all_gather_v(comm, d.old.logp), dist_all_gather_v(comm, logp_gen));
  step_metrics_set_mismatch(d.m, mm);
  d.m.entropy_mean = metrics_masked_mean(dist_all_gather_v(comm, d.old.entropy));
  if (r.engine->weights().config.is_moe()) {  // the trainer's routing against the generator's
    int64_t n[] = {d.old.routing.pairs, d.old.routing.agreed, d.old.routing.router_agreed};
    comm.all_reduce(n, std::size(n), ReduceOp::Sum);
    const RoutingMetrics rm =
        metrics_compute_routing(dist_all_gather_v(comm, d.old.logp), dist_all_gather_v(comm, logp_gen),
                                dist_all_gather_v(comm, d.old.routing_agreed), n[0], n[1], n[2]);
    step_metrics_set_routing(d.m, rm);
  }
}

// Trainer scoring: logp_old (+ q/k/v amax for the KV scales), the reference's logprobs, and the
// generator/trainer mismatch. With train.old_logprobs auto the first mini-batch's sequences are
// left to their optimizer step's forward (step_optimize completes d.old and the metrics).
void step_score(GrpoRun& r, GrpoStep& d) {
  auto t0 = Clock::now();
  if (r.fp8_kv) {  // a recipe whose trainer rounds k/v as the cache does uses this rollout's scales
    const KvScales used = r.engine->kv_scales();
    r.trainer->set_kv_rounding(used.k, used.v);
    // The KL reference rounds the same way, so that rounding alone adds no KL at equal weights.
    if (r.reference) r.reference->set_kv_rounding(used.k, used.v);
  }
  d.own_first = r.c.train.old_logprobs == "auto";
  d.old_from = d.own_first ? grpo_mini_batch_range(step_shard(r), d.seqs.size(), r.mini_batches, 0).second : 0;
  if (d.old_from < d.seqs.size()) {
    const std::vector<TrainSequence> rest(d.seqs.begin() + static_cast<std::ptrdiff_t>(d.old_from), d.seqs.end());
    d.old = r.trainer->score(rest, r.temperature, /*entropy=*/true, /*record_amax=*/r.fp8_kv);
  }
  if (r.reference) d.logp_ref = r.reference->score(d.seqs, r.temperature, false, false).logp;
  d.m.time_logprob_s = seconds_since(t0);
  if (!d.own_first) step_mismatch_metrics(r, d, d.logp_gen);
}

// d.old of the sequences [0, d.old_from) scored by the first optimizer step's forward, then the
// rest's (sequence order), and the mismatch metrics over all of them.
void step_merge_first_scores(GrpoRun& r, GrpoStep& d, ScoreResult&& first, bool complete,
                             const std::vector<float>& logp_gen) {
  score_results_append(first, d.old);
  d.old = std::move(first);
  // Every rank learns whether some rank's first forward stopped early (the metrics are collective).
  int64_t incomplete = complete ? 0 : 1;
  r.comm->all_reduce(&incomplete, 1, ReduceOp::Sum);
  d.old_complete = incomplete == 0;
  if (d.old_complete) step_mismatch_metrics(r, d, logp_gen);
}

// Optimizer steps over mini-batches of whole sequences (GRPO loss + IS correction [+ k3 KL]).
void step_optimize(GrpoRun& r, GrpoStep& d, BadStepGuard& bad_steps) {
  auto t0 = Clock::now();
  GrpoRollout ro;
  ro.seqs = std::move(d.seqs);
  ro.offsets = std::move(d.offsets);
  ro.advantages = d.advantages;
  ro.logp_gen = std::move(d.logp_gen);
  if (d.own_first) {  // the first mini-batch's tokens: from its own forward (not read here)
    ro.logp_old.assign(static_cast<size_t>(ro.offsets[d.old_from]), std::nanf(""));
    ro.first_logp_old_from_forward = true;
    ro.first_score = ScoreRequest{/*entropy=*/true, /*record_amax=*/r.fp8_kv};
  }
  ro.logp_old.insert(ro.logp_old.end(), d.old.logp.begin(), d.old.logp.end());
  ro.logp_ref = std::move(d.logp_ref);
  const GrpoShard shard = step_shard(r);  // this rank's sequences of the global batch (one rank: all of them)
  Progress train_bar("step " + std::to_string(d.step) + " train", r.mini_batches, stderr);
  int optimizer_steps_done = 0;
  const int64_t step = d.step;
  GrpoUpdateResult up = grpo_update(
      *r.trainer, ro, r.loss_opt, r.mini_batches, r.temperature,
      [&](int64_t opt_step) { return lr_schedule_at(r.lr_sched, opt_step); },
      [&](const StepResult& sr) {
        train_bar.update(++optimizer_steps_done);
        return bad_steps.record(sr, step);
      },
      shard);
  train_bar.finish_quietly();
  if (d.own_first) step_merge_first_scores(r, d, std::move(up.first_scored), up.first_scored_complete, ro.logp_gen);
  grpo_stats_all_reduce(*r.comm, up.stats);
  const double loss = up.loss, gnorm = up.grad_norm;  // global: the trainer reduced them
  d.grad_norm = gnorm;
  const int applied = up.applied;
  const GrpoStats& stats = up.stats;
  d.m.lr = up.lr;
  d.m.time_train_s = seconds_since(t0);
  d.m.loss = loss;
  d.m.grad_norm = gnorm;
  step_metrics_set_loss_stats(d.m, stats);
  d.m.extra.push_back({"skipped_optimizer_steps", static_cast<double>(r.mini_batches - applied)});
}

// KV-scale calibration (every rank's amax) and the refit of the generator.
void step_refit(GrpoRun& r, GrpoStep& d) {
  auto t0 = Clock::now();
  KvScales scales;
  if (r.fp8_kv && !d.old_complete) {
    // The first optimizer step (whose forward scored its mini-batch) met a non-finite value: its
    // amax may be partial or non-finite, so the scales stay those this rollout used.
    scales = r.engine->kv_scales();
    d.m.extra.push_back({"kv_scales_kept", 1.0});
  } else if (r.fp8_kv) {
    scales = kv_scales_calibrate(amax_all_gather(*r.comm, d.old.k_amax), amax_all_gather(*r.comm, d.old.v_amax),
                                 static_cast<float>(r.c.precision.kv_calib_percentile),
                                 static_cast<float>(r.c.precision.kv_calib_margin), r.c.precision.pow2_scales);
    d.m.extra.push_back({"kv_scale_k_mean", metrics_mean(scales.k)});
    d.m.extra.push_back({"kv_scale_v_mean", metrics_mean(scales.v)});
  }
  d.m.time_calibration_s = seconds_since(t0);
  t0 = Clock::now();
  r.engine->refit(r.trainer->master(), r.fp8_kv ? &scales : nullptr);
  r.s.backend->synchronize();
  d.m.time_refit_s = seconds_since(t0);
  r.state.kv_scales = scales;
}

// The policy produced NaN/Inf outside an optimizer step (sampling, scoring, the refit): nothing
// of this step is used; it counts as a skipped step, and max_consecutive_bad_steps of them in a
// row stop the run with the likely cause.
void step_skip_diverged(GrpoRun& r, GrpoStep& d, BadStepGuard& bad_steps, const NonFiniteError& e) {
  std::string msg = e.what();
  if (const size_t tag = msg.rfind(" ["); tag != std::string::npos) msg.resize(tag);
  StepResult sr;
  sr.loss = sr.grad_norm = std::nan("");
  sr.skip_reason = "non-finite values in generation or scoring: " + msg;
  d.diverged = true;
  bad_steps.record(sr, d.step);
  bool logged = false;
  for (auto& [k, v] : d.m.extra) logged |= k == "skipped_optimizer_steps";
  if (!logged) d.m.extra.push_back({"skipped_optimizer_steps", static_cast<double>(r.mini_batches)});
  d.m.extra.push_back({"skipped_step", 1.0});
}

// The step's timings and throughput over the ranks (phase times: the slowest rank's;
// throughput: the job's). Timing without validation: what the step costs.
void step_reduce_timings(GrpoRun& r, GrpoStep& d) {
  StepMetrics& m = d.m;
  double times[] = {m.time_generation_s, m.time_logprob_s, m.time_train_s, d.time_reward_s, seconds_since(d.t_start)};
  r.comm->all_reduce(times, std::size(times), ReduceOp::Max);
  r.comm->all_reduce(&d.generated, 1, ReduceOp::Sum);
  m.time_generation_s = times[0], m.time_logprob_s = times[1], m.time_train_s = times[2];
  m.generation_tokens_per_s = d.generated / std::max(1e-9, m.time_generation_s);
  r.generated_tokens += static_cast<int64_t>(d.generated);
  r.generation_s += m.time_generation_s;
  const double step_s = times[4];
  m.extra.push_back({"time_reward_s", times[3]});
  for (const auto& kv : d.reward_metrics) m.extra.push_back(kv);
  m.extra.push_back({"time_step_excl_val_s", step_s});
  m.extra.push_back({"time_refit_calib_fraction", (m.time_refit_s + m.time_calibration_s) / std::max(1e-9, step_s)});
}

// Validation (rank 0, every val_every steps and at the last).
void step_validate(GrpoRun& r, GrpoStep& d) {
  const RunConfig& c = r.c;
  if (d.diverged || c.val_every <= 0 || !(d.step % c.val_every == 0 || d.final_step) || !r.lead) return;
  ValResult v = validate(r.s, *r.engine, c.val_size, c.rollout.max_new_tokens);
  d.m.val_accuracy = v.accuracy;
  r.last_val = {d.step, v.accuracy};
  d.m.extra.push_back({"val_reward_mean", v.reward_mean});
  d.m.extra.push_back({"time_validation_s", v.seconds});
}

// The metrics line (rank 0) and the no-signal watch.
void step_log(GrpoRun& r, GrpoStep& d, NoSignalWatch& no_signal) {
  d.m.time_step_s = seconds_since(d.t_start);
  r.slowest_step_s = std::max(r.slowest_step_s, d.m.time_step_s);
  if (r.lead) r.log->write(d.m, r.c.steps);
  ++r.steps_run;
  if (!d.diverged && r.lead)
    if (auto warn = no_signal.record(d.step, d.rewards, r.G, d.grad_norm)) console_line(stderr, "%s", warn->c_str());
}

// The checkpoint (every checkpoint_every steps and at the last; rank 0 writes it) and the pruning.
void step_checkpoint(GrpoRun& r, GrpoStep& d, InterruptNote& interrupt_note) {
  const RunConfig& c = r.c;
  const bool save = (c.checkpoint_every > 0 && d.step % c.checkpoint_every == 0) || d.final_step;
  if (save) r.trainer->gather_optimizer_state();  // ZeRO-1: the moments to rank 0 (every rank)
  if (!save || !r.lead) return;
  {
    // A Ctrl-C between the checkpoint becoming `latest` and the note naming it would report the
    // previous one (seen under load in CI): the signal waits for both.
    const InterruptNote::Hold hold;
    const std::string saved = checkpoint_save(*r.s.backend, *r.trainer, r.state, r.run.checkpoints_dir(),
                                              checkpoint_options(c, r.s.tokenizer_json));
    interrupt_note.set("interrupted; the last checkpoint is " + saved + " (step " + std::to_string(d.step) +
                       "): " + resume_hint(c.out));
  }
  for (const std::string& p : checkpoint_prune(r.run.checkpoints_dir(), c.checkpoint.keep_last))
    console_line(stdout, "checkpoint.keep_last=%d: removed %s", c.checkpoint.keep_last, p.c_str());
}

// time_budget_s: a step that leaves no time for another (at the slowest step's pace) is the
// last: it validates and checkpoints like step `steps`. A step slower than predicted can still
// overrun; then the run stops here, before starting one that would not finish. With several
// ranks, rank 0's clock decides for all. Returns false to stop before `step`; sets final_step.
bool step_fits_budget(GrpoRun& r, int64_t step, Clock::time_point t_run, bool& final_step) {
  const RunConfig& c = r.c;
  int budget[2] = {
      c.time_budget_s > 0 && step > r.state.step + 1 && seconds_since(t_run) + r.slowest_step_s > c.time_budget_s,
      step == c.steps || (c.time_budget_s > 0 && seconds_since(t_run) + 2 * r.slowest_step_s > c.time_budget_s)};
  if (r.W > 1 && c.time_budget_s > 0) r.comm->broadcast(budget, sizeof budget, 0);
  if (budget[0]) {
    if (r.lead)
      std::printf("time budget: %.0f s of %.0f s used after step %lld of %d; stopping\n", seconds_since(t_run),
                  c.time_budget_s, static_cast<long long>(step - 1), c.steps);
    return false;
  }
  final_step = budget[1];
  if (final_step && step < c.steps && r.lead)
    std::printf("time budget: step %lld is the last that fits in %.0f s\n", static_cast<long long>(step),
                c.time_budget_s);
  return true;
}

// The run's summary lines: the validation curve's ends and the throughput.
void print_summary(GrpoRun& r, Clock::time_point t_run) {
  if (r.first_val && r.last_val)
    std::printf("validation accuracy: %.3f at step %lld -> %.3f at step %lld (%+.1f points)\n", r.first_val->second,
                static_cast<long long>(r.first_val->first), r.last_val->second,
                static_cast<long long>(r.last_val->first), 100.0 * (r.last_val->second - r.first_val->second));
  r.comm->barrier();  // every rank ends after rank 0 has written the last checkpoint
  if (r.lead) {
    const double total_s = seconds_since(t_run);
    std::printf("done in %s (setup included): %lld steps, %lld tokens generated at %.0f tokens/s; %s (metrics: %s)\n",
                format_duration(total_s).c_str(), static_cast<long long>(r.steps_run),
                static_cast<long long>(r.generated_tokens), r.generated_tokens / std::max(1e-9, r.generation_s),
                r.run.path.c_str(), r.run.metrics_path().c_str());
  }
}

}  // namespace

int grpo_run(const RunConfig& config_in, bool resume) {
  const auto t_run = Clock::now();  // time_budget_s counts from here (setup and step-0 validation included)
  GrpoRun r;
  setup_ranks(r, config_in);
  setup_session(r, resume);
  setup_models(r, resume);
  if (r.fp8_kv && !r.ckpt) setup_initial_kv_scales(r);
  setup_log(r);
  const RunConfig& c = r.c;
  InterruptNote interrupt_note(r.ckpt ? "interrupted; the last checkpoint is " + *r.ckpt + ": " + resume_hint(c.out)
                                      : "interrupted before the first checkpoint of " + c.out +
                                            " (nothing to resume; checkpoint_every=N saves every N steps)");
  if (!r.ckpt && c.val_every > 0 && r.lead) validate_start(r);

  BadStepGuard bad_steps(c.max_consecutive_bad_steps, bad_step_hint(c, "train.lr", c.train.lr));
  NoSignalWatch no_signal(3);
  Progress run_bar("run", c.steps, stderr);
  run_bar.update(r.state.step);
  for (int64_t step = r.state.step + 1; step <= c.steps; ++step) {
    GrpoStep d;
    if (!step_fits_budget(r, step, t_run, d.final_step)) break;
    d.step = d.m.step = step;
    d.t_start = Clock::now();
    try {
      step_rollout(r, d);              // prompts -> samples + logp_gen
      step_rewards(r, d);              // rewards -> advantages
      step_score(r, d);                // logp_old, entropy, amax; mismatch metrics
      step_optimize(r, d, bad_steps);  // optimizer steps on mini-batches
      step_refit(r, d);                // KV-scale calibration + refit
    } catch (const NonFiniteError& e) {
      step_skip_diverged(r, d, bad_steps, e);
    }
    r.state.step = step;
    r.state.optimizer_step = r.trainer->optimizer_step();
    step_reduce_timings(r, d);
    step_validate(r, d);
    step_log(r, d, no_signal);
    step_checkpoint(r, d, interrupt_note);
    run_bar.update(step);
    if (d.final_step) break;
  }
  run_bar.finish_quietly();
  print_summary(r, t_run);
  return 0;
}

}  // namespace fp8rl
