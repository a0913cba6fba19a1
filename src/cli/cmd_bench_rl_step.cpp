// fp8rl bench rl-step: whole GRPO steps of a random-weight model of a named shape, as the RL
// loop runs them (ragged batches), for several precision recipes in one run — the judge of every
// optimization (issue #13).
//
//   fp8rl bench rl-step [--device cpu|cuda] [--model qwen3-1.7b] [--layers N]
//                       [--recipes bf16,fp8_gen,fp8_e2e] [--prompts 16] [--samples 16]
//                       [--prompt-len 160] [--max-new-tokens 512] [--kl-beta 0] [--optimizer-steps 1]
//                       [--micro-batch-tokens auto|N] [--recompute none|block|auto]
//                       [--dgrad-weight-cache auto|on|off]
//                       [--grad-dtype fp32|bf16] [--optimizer-state-dtype fp32|bf16]
//                       [--free-gib G] [--allow-overcommit] [--plan-only] [--routing-replay]
//                       [--old-logprobs auto|score] [--steps 2] [--warmup 1] [--seed 1] [--json PATH]
//
// Per recipe: a fresh trainer (FP32 master of random weights, the same for every recipe), an
// optional frozen reference policy (--kl-beta > 0), a generator and its KV pool; then --warmup
// untimed and --steps timed GRPO steps. Each step: generation of P prompts x G samples (prompts
// of random ids, lengths uniform in [prompt_len / 2, prompt_len]; each response ends at a length
// drawn from a seeded distribution — a fifth run to max_new_tokens, the rest uniform in
// [max_new_tokens / 8, max_new_tokens] — so every batch is ragged), random 0/1 rewards, the
// trainer's scoring (logp_old, entropy, q/k/v amax with an E4M3 cache; --old-logprobs auto, the
// default as in train.old_logprobs: only the sequences after the first mini-batch, whose scores
// come from its own optimizer step's forward, timed in "training"), the reference's scoring,
// the update (train/grpo_update.h, the loop's own), KV-scale calibration + refit. Per phase the
// median seconds over the timed steps, tokens/s, the mismatch metrics, peak device memory and
// the backend's slow-path counters (FP8 GEMM fallbacks must be 0). Table + JSON. Mixture-of-
// experts shapes also record the generator's routing and report the trainer's agreement with it
// and the mismatch split by it; --routing-replay makes the trainer replay it (train.routing_replay).
// Before a recipe allocates anything its memory plan (rl/memory_plan.h, this exact setup) is
// checked against the device's free memory (--free-gib: against G GiB instead; the CPU backend
// reports none, so nothing is checked there without it): a recipe that cannot fit is refused
// with the shortfall and the flags that alone would make it fit, and the others still run
// (--allow-overcommit runs it anyway). --recompute auto: block only when the plan does not fit
// without it, as train.recompute: auto; --dgrad-weight-cache auto (the default): the FP8
// trainer's W^T copies kept unless the plan does not fit with them, dropped before --recompute
// auto turns on recomputation, as train.dgrad_weight_cache: auto.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/fs.h"
#include "model/shapes.h"
#include "rl/memory_plan.h"
#include "rl/metrics.h"
#include "rollout/rollout.h"
#include "bench/rollout_bench.h"
#include "train/grpo_update.h"

namespace fp8rl::cli {
namespace {

constexpr const char* kUsage =
    "usage: fp8rl bench rl-step [--device cpu|cuda] [--model SHAPE] [--layers N] [--recipes LIST]\n"
    "                           [--prompts P] [--samples G] [--prompt-len N] [--max-new-tokens N]\n"
    "                           [--kl-beta B] [--temperature T] [--recompute none|block|auto] [--optimizer-steps N]\n"
    "                           [--dgrad-weight-cache auto|on|off]\n"
    "                           [--micro-batch-tokens auto|N] [--grad-dtype fp32|bf16]\n"
    "                           [--optimizer-state-dtype fp32|bf16]\n"
    "                           [--free-gib G] [--allow-overcommit] [--plan-only] [--routing-replay]\n"
    "                           [--old-logprobs auto|score] [--steps N] [--warmup N] [--seed N] [--json PATH]\n"
    "Times whole GRPO steps (generation, scoring, reference, training, refit + calibration) of a\n"
    "random-weight model with ragged response lengths, for each recipe (default bf16,fp8_gen,fp8_e2e).\n"
    "A recipe is a preset with optional overrides, PRESET[:key=value[+key=value]]: gen / train (linear\n"
    "fp32|bf16|fp8), kv (f32|bf16|e4m3), tkv (bf16|e4m3: the trainer rounds k/v as the E4M3 cache),\n"
    "attn (fp8|off), pow2 (on|off), first / last (BF16 blocks), wgrad (fp8|bf16: an FP8 trainer's\n"
    "weight gradients), consistent (on|off|attn|flash: precision.consistent, the trainer scoring with\n"
    "the generator's kernels: mult_prob_error exactly 1; attn: all of it but the linears, which stay on\n"
    "the fast kernels (with pow2=on measured exact); flash: as attn, but the generator's attention runs\n"
    "in the trainer's flash-attention order); e.g. --recipes bf16,fp8_e2e:kv=bf16,fp8_e2e isolates the\n"
    "E4M3 KV cache's share of the mismatch, fp8_e2e,fp8_e2e:wgrad=bf16 times BF16 wgrad,\n"
    "fp8_e2e,fp8_e2e:consistent=on the consistent mode's mismatch and step time.\n"
    "Shapes: qwen3-0.6b, qwen3-1.7b (default), qwen3-8b, llama-3.2-1b, llama-3.1-8b, qwen3-30b-a3b,\n"
    "moonlight-16b-a3b; tiny, tiny-moe, tiny-mla (CPU smoke). --layers N: the shape's first N blocks.\n"
    "Each recipe's memory plan is checked first against the device's free memory (--free-gib G: against G GiB):\n"
    "a recipe that cannot fit is refused with its shortfall and the flags that would make it fit, the others\n"
    "run (--allow-overcommit: run it anyway). --recompute auto: block only where the plan needs it.\n"
    "--micro-batch-tokens auto (default): the largest of 16384, 8192, ... at which every recipe's plan fits in 97%\n"
    "of the free memory, so all recipes compare at one micro-batch on any card (16384 when the free memory is\n"
    "unknown).\n"
    "--dgrad-weight-cache (train.dgrad_weight_cache): an FP8 trainer keeps each FP8 linear's W^T quantization for\n"
    "the dgrad (on), or the dgrad transposes W per call (off: less memory, slower); auto (default): on unless the\n"
    "plan does not fit with it, dropped before --recompute auto turns on recomputation.\n"
    "--plan-only: print each recipe's plan and check against --free-gib, run nothing and open no device\n"
    "(--device cuda --plan-only --free-gib 139 plans an H200 run on any build).\n"
    "--grad-dtype / --optimizer-state-dtype bf16: the lean optimizer (train.grad_dtype, train.optimizer_state_dtype).\n"
    "MoE shapes: the routing agreement of the trainer with the generator, and the mismatch over the tokens routed\n"
    "alike / differently; --routing-replay: the trainer replays the generator's routing (train.routing_replay).\n"
    "--old-logprobs (train.old_logprobs): auto (default) scores the first mini-batch in its own optimizer step's\n"
    "forward (timed in training; one optimizer step: no scoring phase); score: a scoring pass over every sequence.\n";

using Clock = std::chrono::steady_clock;

const char* const kPhases[] = {"generation", "scoring", "reference", "training", "refit_calibration", "step"};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median of the finite values (NaN: a step with nothing to measure, e.g. no token routed
// differently); NaN when none.
double median_finite(const std::vector<double>& v) {
  std::vector<double> f;
  for (double x : v)
    if (std::isfinite(x)) f.push_back(x);
  return f.empty() ? std::nan("") : median(f);
}

struct BenchSetup {
  ModelConfig model;
  int P = 16, G = 16, prompt_len = 160, max_new = 512, optimizer_steps = 1, steps = 2, warmup = 1;
  int64_t micro_batch_tokens = 16384;
  bool micro_batch_auto = false;  // --micro-batch-tokens auto (the default): bench_auto_micro_batch
  double kl_beta = 0;
  double temperature = 1.0;
  std::string recompute = "none";  // none | block | auto (decided per recipe by the plan)
  std::string dgrad_weight_cache = "auto";  // auto | on | off (auto: decided per recipe by the plan)
  DType grad_dtype = DType::F32, moment_dtype = DType::F32;
  int64_t free_bytes = -1;  // what each recipe's plan is checked against (< 0: unknown, no check)
  bool allow_overcommit = false;
  bool routing_replay = false;  // MoE: the trainer replays the generator's routing
  bool old_from_forward = true;  // --old-logprobs auto: the first mini-batch scored by its own step's forward
  uint64_t seed = 1;
};

struct RecipeResult {
  std::string recipe;
  std::map<std::string, std::vector<double>> seconds;  // phase -> per timed step
  std::vector<double> gen_tokens, train_tokens, mult_prob_error, gen_kl_error, entropy;
  // Generation's host time outside the waits for sampled tokens (RolloutStats: loop - wait; with
  // graph-replayed decode steps, time the device has nothing queued), and its iterations, per
  // timed step.
  std::vector<double> gen_host_seconds, gen_forwards;
  // Generation's iterations by kind (RolloutStats::iter_kind: decode steps by batch size, and
  // prefill), per timed step: wall seconds and count.
  std::vector<std::array<double, RolloutStats::kIterKinds>> gen_iter_seconds, gen_iter_steps;
  // MoE: per timed step, the routing agreement and the mismatch over tokens routed alike / not
  std::vector<double> routing_agreement, router_agreement, mult_prob_error_agreed, mult_prob_error_differs;
  MemoryStats mem;
  int64_t plan_peak = 0;  // the memory plan's peak for this recipe's setup (rl/memory_plan.h)
  bool recompute = false;  // block recomputation (--recompute, auto resolved)
  bool dgrad_weight_cache = true;  // the FP8 trainer's W^T copies (--dgrad-weight-cache, auto resolved)
  BackendCounters counters;
  std::string refused;  // non-empty: the plan did not fit, nothing was run (why)
};

// The KV pool: every sequence of a step at once (up to 256), each of prompt_len + max_new tokens.
int64_t bench_kv_pages(const BenchSetup& s) {
  const int64_t seq_pages = ceil_div(static_cast<int64_t>(s.prompt_len + s.max_new), 16);
  return std::min(256, s.P * s.G) * seq_pages + 1;
}

// The memory plan of exactly this setup: what bench_recipe allocates.
MemoryPlanInput bench_plan_input(const BenchSetup& s, const PrecisionRecipe& recipe, DType act, bool recompute,
                                 bool dgrad_weight_cache) {
  MemoryPlanInput in;
  in.model = s.model;
  in.generator = recipe.generator;
  in.trainer = recipe.trainer;
  in.act_dtype = act;
  in.reference_policy = s.kl_beta > 0;
  in.kv_pages = bench_kv_pages(s);
  in.micro_batch_tokens = s.micro_batch_tokens;
  in.recompute = recompute;
  in.dgrad_weight_cache = dgrad_weight_cache;
  in.grad_dtype = s.grad_dtype;
  in.moment_dtype = s.moment_dtype;
  in.generation_batch = std::min(256, s.P * s.G);
  return in;
}

std::string gib_text(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(1ll << 30));
  return buf;
}

// The recipe's plan against the free memory: decides --recompute and --dgrad-weight-cache auto
// (memory_plan_resolve_trainer, as `fp8rl train`), and returns why the recipe cannot run (""
// when it fits, the free memory is unknown, or --allow-overcommit).
std::string bench_check_memory(const BenchSetup& s, const std::string& name, const PrecisionRecipe& recipe, DType act,
                               bool& recompute, bool& cache) {
  const TrainerMemoryChoice choice = memory_plan_resolve_trainer(bench_plan_input(s, recipe, act, false, true),
                                                                 s.recompute, s.dgrad_weight_cache, s.free_bytes);
  recompute = choice.recompute;
  cache = choice.dgrad_weight_cache;
  if (s.free_bytes < 0) return "";
  auto peak = [&](const BenchSetup& t, bool rc, bool w) {
    return memory_plan_compute(bench_plan_input(t, recipe, act, rc, w)).peak_bytes();
  };
  const int64_t p = peak(s, recompute, cache);
  if (p <= s.free_bytes) return "";
  std::string why = "the memory plan's peak, " + gib_text(p) + ", exceeds the " + gib_text(s.free_bytes) +
                    " free by " + gib_text(p - s.free_bytes);
  std::vector<std::string> fixes;
  if (cache && peak(s, recompute, false) < p && peak(s, recompute, false) <= s.free_bytes)
    fixes.push_back("--dgrad-weight-cache off (or auto)");
  if (!recompute && peak(s, true, cache) <= s.free_bytes) fixes.push_back("--recompute block (or auto)");
  BenchSetup t = s;
  t.moment_dtype = DType::BF16;
  if (s.moment_dtype != DType::BF16 && peak(t, recompute, cache) <= s.free_bytes)
    fixes.push_back("--optimizer-state-dtype bf16");
  t = s;
  t.grad_dtype = DType::BF16;
  if (s.grad_dtype != DType::BF16 && peak(t, recompute, cache) <= s.free_bytes) fixes.push_back("--grad-dtype bf16");
  t = s;
  t.kl_beta = 0;
  if (s.kl_beta > 0 && peak(t, recompute, cache) <= s.free_bytes) fixes.push_back("--kl-beta 0");
  for (int64_t mb = s.micro_batch_tokens / 2; mb >= 256; mb /= 2) {
    t = s;
    t.micro_batch_tokens = mb;
    if (peak(t, recompute, cache) <= s.free_bytes) {
      fixes.push_back("--micro-batch-tokens " + std::to_string(mb));
      break;
    }
  }
  why += fixes.empty() ? "; no single flag makes it fit (combine --dgrad-weight-cache off, --recompute block, "
                         "--optimizer-state-dtype bf16, --grad-dtype bf16, smaller --micro-batch-tokens / --samples / "
                         "--max-new-tokens)"
                       : "; any one of these makes it fit: ";
  for (size_t i = 0; i < fixes.size(); ++i) why += (i ? ", " : "") + fixes[i];
  if (s.allow_overcommit) {
    std::printf("  %s: warning: %s; --allow-overcommit: running anyway\n", name.c_str(), why.c_str());
    return "";
  }
  return why;
}

// --micro-batch-tokens auto: the largest of 16384, 8192, ... tokens (not below one sequence's
// prompt + new tokens, nor 256) at which every recipe's plan fits 97% of the free memory (with its
// --recompute / --dgrad-weight-cache choices), so the recipes compare at one micro-batch on any
// card (16384 on an H200 at the 1.7B and MoE shapes, 8192 for the 1.7B's bf16 on an H100); 16384
// when the free memory is unknown, with --allow-overcommit, or when none fits (the recipes are
// then refused with the usual message).
int64_t bench_auto_micro_batch(const BenchSetup& s, const std::vector<std::string>& recipes, DType act) {
  constexpr int64_t kLargest = 16384;
  if (s.free_bytes < 0 || s.allow_overcommit) return kLargest;
  // A margin of 3% of the free memory: measured peaks run up to 1.9% above the plan (bench rl-step,
  // sessions 31-32), and a micro-batch chosen at the plan's edge ran out of memory in the next
  // step's generation (the 6-layer Qwen3-MoE bf16 step on an H100, session 32).
  BenchSetup m = s;
  m.free_bytes = s.free_bytes - s.free_bytes / 100 * 3;
  // Not below one whole sequence: the trainer runs a longer sequence alone, as a larger batch than
  // the plan would count.
  const int64_t smallest = std::max<int64_t>(256, s.prompt_len + s.max_new);
  for (int64_t mb = kLargest; mb >= smallest; mb /= 2) {
    BenchSetup t = m;
    t.micro_batch_tokens = mb;
    bool all = true;
    for (const std::string& r : recipes) {
      bool recompute = false, cache = false;
      all = all && bench_check_memory(t, r, PrecisionRecipe::parse(r), act, recompute, cache).empty();
    }
    if (all) return mb;
  }
  return kLargest;
}

// Step `step`'s requests: prompts of random ids and forced response lengths, seeded by step.
std::vector<RolloutRequest> bench_requests(const BenchSetup& s, int step) {
  std::mt19937_64 rng(s.seed * 1000003ull + static_cast<uint64_t>(step));
  std::uniform_int_distribution<int32_t> tok(0, s.model.vocab_size - 1);
  std::uniform_int_distribution<int> plen(std::max(1, s.prompt_len / 2), s.prompt_len);
  std::uniform_int_distribution<int> rlen(std::max(1, s.max_new / 8), s.max_new);
  std::bernoulli_distribution capped(0.2);
  std::vector<RolloutRequest> reqs(s.P);
  for (RolloutRequest& r : reqs) {
    r.prompt.resize(plen(rng));
    for (int32_t& t : r.prompt) t = tok(rng);
    r.n = s.G;
    for (int j = 0; j < s.G; ++j) r.stop_after.push_back(capped(rng) ? s.max_new : rlen(rng));
  }
  return reqs;
}

RecipeResult bench_recipe(Backend& be, const BenchSetup& s, const std::string& recipe_name) {
  RecipeResult res;
  res.recipe = recipe_name;
  const PrecisionRecipe recipe = PrecisionRecipe::parse(recipe_name);
  const bool fp8_kv = recipe.generator.kv_cache == DType::E4M3;
  res.refused = bench_check_memory(s, recipe_name, recipe, be.act_dtype(), res.recompute, res.dgrad_weight_cache);
  res.plan_peak =
      memory_plan_compute(bench_plan_input(s, recipe, be.act_dtype(), res.recompute, res.dgrad_weight_cache))
          .peak_bytes();
  if (!res.refused.empty()) {
    std::printf("  %-8s refused, nothing run: %s\n", recipe_name.c_str(), res.refused.c_str());
    std::fflush(stdout);
    return res;
  }
  if (s.recompute == "auto")
    std::printf("  %-8s --recompute auto -> %s\n", recipe_name.c_str(), res.recompute ? "block" : "none");
  if (s.dgrad_weight_cache == "auto" && recipe.trainer.linear == LinearMode::FP8_BLOCK)
    std::printf("  %-8s --dgrad-weight-cache auto -> %s\n", recipe_name.c_str(), res.dgrad_weight_cache ? "on" : "off");
  be.synchronize();
  be.reset_peak_memory_stats();
  const BackendCounters c0 = be.counters();
  TrainerOptions topt;
  topt.micro_batch_tokens = s.micro_batch_tokens;
  topt.recompute = res.recompute;
  topt.dgrad_weight_cache = res.dgrad_weight_cache;
  topt.grad_dtype = s.grad_dtype;
  topt.moment_dtype = s.moment_dtype;
  topt.routing_replay = s.routing_replay;
  Trainer trainer(be, bench_random_weights(be, s.model, DType::F32, s.seed), recipe.trainer, topt);
  std::unique_ptr<Trainer> reference;
  if (s.kl_beta > 0) {
    TrainerOptions frozen = topt;
    frozen.frozen = true;
    reference = std::make_unique<Trainer>(be, bench_random_weights(be, s.model, DType::F32, s.seed), recipe.trainer,
                                          frozen);
  }
  RolloutEngine engine(be, trainer.master(), recipe.generator, static_cast<int>(bench_kv_pages(s)), 16, 256);
  GrpoLossOptions lopt;
  lopt.is_mode = IsMode::TIS;
  lopt.kl_beta = s.kl_beta;
  SamplingParams sp;
  sp.temperature = static_cast<float>(s.temperature);
  sp.max_new_tokens = s.max_new;
  sp.record_routing = s.model.is_moe();
  std::mt19937_64 reward_rng(s.seed ^ 0x5eedull);

  for (int step = 0; step < s.warmup + s.steps; ++step) {
    const bool timed = step >= s.warmup;
    std::map<std::string, double> t;
    auto phase = [&](const char* name, const std::function<void()>& f) {
      be.synchronize();
      const auto t0 = Clock::now();
      f();
      be.synchronize();
      t[name] = std::chrono::duration<double>(Clock::now() - t0).count();
    };
    const auto t_step = Clock::now();
    const std::vector<RolloutRequest> reqs = bench_requests(s, step);
    sp.seed = s.seed + static_cast<uint64_t>(step);
    std::vector<RolloutSample> samples;
    const bool last = step + 1 == s.warmup + s.steps;  // FP8RL_CUDA_PROFILE=1: the last step's tables
    be.profile_report("", false);
    const BackendCounters k_gen0 = be.counters();  // the step's new GEMM shapes per phase (printed below)
    phase("generation", [&] { samples = engine.generate(reqs, sp); });
    const BackendCounters k_gen1 = be.counters();
    be.profile_report(recipe_name + " generation", last);

    GrpoRollout ro;
    ro.offsets = {0};
    std::vector<float> rewards;
    int64_t train_tokens = 0;
    for (const RolloutSample& r : samples) {
      TrainSequence ts;
      ts.ids = reqs[r.request].prompt;
      ts.prompt_len = static_cast<int>(ts.ids.size());
      ts.ids.insert(ts.ids.end(), r.tokens.begin(), r.tokens.end());
      ts.routing = r.routing;  // MoE: the generator's experts
      train_tokens += static_cast<int64_t>(ts.ids.size());
      ro.seqs.push_back(std::move(ts));
      ro.logp_gen.insert(ro.logp_gen.end(), r.logp.begin(), r.logp.end());
      ro.offsets.push_back(ro.offsets.back() + static_cast<int64_t>(r.tokens.size()));
      rewards.push_back(static_cast<float>(reward_rng() & 1));
    }
    ro.advantages = grpo_compute_advantages(rewards, s.G, AdvantageBaseline::GroupNorm);
    ScoreResult old;
    if (fp8_kv) {
      const KvScales used = engine.kv_scales();  // the scales this rollout was generated with
      trainer.set_kv_rounding(used.k, used.v);
      if (reference) reference->set_kv_rounding(used.k, used.v);  // no KL from the rounding alone
    }
    // --old-logprobs auto: the first mini-batch's sequences [0, from) are scored by their own
    // optimizer step's forward (as the loop does, train.old_logprobs: auto).
    const size_t from =
        s.old_from_forward ? grpo_mini_batch_range(GrpoShard{}, ro.seqs.size(), s.optimizer_steps, 0).second : 0;
    phase("scoring", [&] {
      if (from < ro.seqs.size()) {
        const std::vector<TrainSequence> rest(ro.seqs.begin() + static_cast<std::ptrdiff_t>(from), ro.seqs.end());
        old = trainer.score(rest, sp.temperature, /*entropy=*/true, fp8_kv);
      }
    });
    if (s.old_from_forward) {
      ro.logp_old.assign(static_cast<size_t>(ro.offsets[from]), std::nanf(""));  // not read
      ro.first_logp_old_from_forward = true;
      ro.first_score = ScoreRequest{/*entropy=*/true, /*record_amax=*/fp8_kv};
    }
    ro.logp_old.insert(ro.logp_old.end(), old.logp.begin(), old.logp.end());
    phase("reference", [&] {
      if (reference) ro.logp_ref = reference->score(ro.seqs, sp.temperature, false, false).logp;
    });
    GrpoUpdateResult up;
    phase("training", [&] {
      up = grpo_update(trainer, ro, lopt, s.optimizer_steps, sp.temperature, [](int64_t) { return 1e-6; },
                       [](const StepResult& r) { return r.applied; });
    });
    if (s.old_from_forward) {
      FP8RL_CHECK(up.first_scored_complete, "bench rl-step: the first optimizer step's forward met a non-finite value");
      score_results_append(up.first_scored, old);
      old = std::move(up.first_scored);
    }
    const MismatchMetrics mm = metrics_compute_mismatch(old.logp, ro.logp_gen);
    RoutingMetrics rm;
    if (s.model.is_moe())
      rm = metrics_compute_routing(old.logp, ro.logp_gen, old.routing_agreed, old.routing.pairs, old.routing.agreed,
                                   old.routing.router_agreed);
    be.profile_report(recipe_name + " scoring + reference + training", last);
    const BackendCounters k_train1 = be.counters();
    phase("refit_calibration", [&] {
      KvScales scales;
      if (fp8_kv) scales = kv_scales_calibrate(old.k_amax, old.v_amax, 0.999f, 1.05f, recipe.generator.pow2_scales);
      engine.refit(trainer.master(), fp8_kv ? &scales : nullptr);
    });
    t["step"] = std::chrono::duration<double>(Clock::now() - t_step).count();
    const RolloutStats& gs = engine.last_stats();
    std::printf("  %-8s step %d%s: gen %.2f s (host %.3f s over %d forwards), score %.2f s, ref %.2f s, "
                "train %.2f s, refit %.3f s, step %.2f s; %lld new tokens, mult_prob_error %.4f",
                recipe_name.c_str(), step, timed ? "" : " (warm-up)", t["generation"],
                gs.loop_seconds - gs.wait_seconds, gs.decode_steps, t["scoring"], t["reference"], t["training"],
                t["refit_calibration"], t["step"], static_cast<long long>(gs.generated_tokens),
                mm.token_mult_prob_error);
    if (s.model.is_moe())
      std::printf(", routing agreement %.4f (router %.4f), mult_prob_error routed alike %.4f / not %.4f",
                  rm.agreement, rm.router_agreement, rm.agreed.token_mult_prob_error, rm.differs.token_mult_prob_error);
    // New GEMM shapes met in this step (host work inside the timed phases): cuBLASLt heuristic
    // queries and configuration tunings, in generation and in the trainer.
    std::printf("; new GEMM shapes: generation %lld heuristic queries (%.0f ms) + %lld tuned (%.0f ms), trainer "
                "%lld (%.0f ms) + %lld tuned (%.0f ms)\n",
                static_cast<long long>(k_gen1.gemm_heuristics - k_gen0.gemm_heuristics),
                k_gen1.gemm_heuristic_ms - k_gen0.gemm_heuristic_ms,
                static_cast<long long>(k_gen1.gemm_tuned - k_gen0.gemm_tuned), k_gen1.gemm_tune_ms - k_gen0.gemm_tune_ms,
                static_cast<long long>(k_train1.gemm_heuristics - k_gen1.gemm_heuristics),
                k_train1.gemm_heuristic_ms - k_gen1.gemm_heuristic_ms,
                static_cast<long long>(k_train1.gemm_tuned - k_gen1.gemm_tuned),
                k_train1.gemm_tune_ms - k_gen1.gemm_tune_ms);
    std::fflush(stdout);
    if (!timed) continue;
    for (const char* p : kPhases) res.seconds[p].push_back(t[p]);
    res.gen_tokens.push_back(static_cast<double>(gs.generated_tokens));
    res.gen_host_seconds.push_back(gs.loop_seconds - gs.wait_seconds);
    res.gen_forwards.push_back(gs.decode_steps);
    std::array<double, RolloutStats::kIterKinds> is{}, in{};
    for (int k = 0; k < RolloutStats::kIterKinds; ++k) is[k] = gs.iter_seconds[k], in[k] = gs.iter_steps[k];
    res.gen_iter_seconds.push_back(is);
    res.gen_iter_steps.push_back(in);
    res.train_tokens.push_back(static_cast<double>(train_tokens));
    res.mult_prob_error.push_back(mm.token_mult_prob_error);
    res.gen_kl_error.push_back(mm.gen_kl_error);
    if (s.model.is_moe()) {
      res.routing_agreement.push_back(rm.agreement);
      res.router_agreement.push_back(rm.router_agreement);
      res.mult_prob_error_agreed.push_back(rm.agreed.token_mult_prob_error);
      res.mult_prob_error_differs.push_back(rm.differs.token_mult_prob_error);
    }
    double ent = 0;
    for (float e : old.entropy) ent += e;
    res.entropy.push_back(old.entropy.empty() ? 0.0 : ent / static_cast<double>(old.entropy.size()));
  }
  be.synchronize();
  res.mem = be.memory_stats();
  const BackendCounters c1 = be.counters();
  res.counters.fp8_gemm_fallbacks = c1.fp8_gemm_fallbacks - c0.fp8_gemm_fallbacks;
  res.counters.fp8_gemm_tails = c1.fp8_gemm_tails - c0.fp8_gemm_tails;
  res.counters.fp8_gemm_own = c1.fp8_gemm_own - c0.fp8_gemm_own;
  res.counters.grouped_loops = c1.grouped_loops - c0.grouped_loops;
  res.counters.paged_runs_off = c1.paged_runs_off - c0.paged_runs_off;
  res.counters.concat_products = c1.concat_products - c0.concat_products;
  res.counters.gemm_tuned = c1.gemm_tuned - c0.gemm_tuned;
  res.counters.gemm_tuned_changed = c1.gemm_tuned_changed - c0.gemm_tuned_changed;
  res.counters.gemm_tune_ms = c1.gemm_tune_ms - c0.gemm_tune_ms;
  res.counters.gemm_heuristics = c1.gemm_heuristics - c0.gemm_heuristics;
  res.counters.gemm_heuristic_ms = c1.gemm_heuristic_ms - c0.gemm_heuristic_ms;
  return res;
}

// --plan-only: each recipe's memory plan of this exact setup and the check bench_recipe would
// make, printed; nothing is allocated or run (e.g. to find the --layers cut of a shape that fits
// one device: `--device cuda --free-gib 139 --plan-only`, which opens no device, so a CPU-only
// build plans a CUDA run with its BF16 activations).
int bench_plan_only(const BenchSetup& s, const std::vector<std::string>& recipes, DType act) {
  int fit = 0;
  for (const std::string& name : recipes) {
    const PrecisionRecipe recipe = PrecisionRecipe::parse(name);
    bool recompute = false, cache = true;
    const std::string why = bench_check_memory(s, name, recipe, act, recompute, cache);
    const MemoryPlan plan = memory_plan_compute(bench_plan_input(s, recipe, act, recompute, cache));
    std::printf("\n%s (recompute %s, dgrad W^T cache %s):\n%s", name.c_str(), recompute ? "block" : "none",
                recipe.trainer.linear != LinearMode::FP8_BLOCK ? "none (no FP8 trainer linears)" : cache ? "on" : "off",
                memory_plan_format(plan, s.model, s.free_bytes > 0 ? s.free_bytes : 0).c_str());
    if (s.free_bytes < 0) std::printf("%s: free memory unknown (no check; --free-gib G checks against G GiB)\n", name.c_str());
    else if (why.empty()) std::printf("%s: fits (peak %s of %s)\n", name.c_str(), gib_text(plan.peak_bytes()).c_str(),
                                      gib_text(s.free_bytes).c_str());
    else std::printf("%s: would be refused: %s\n", name.c_str(), why.c_str());
    fit += why.empty();
  }
  return fit > 0 ? 0 : 1;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

int run_bench(const std::vector<std::string>& argv) {
  const Args args(argv,
                  {"device", "model", "layers", "recipes", "prompts", "samples", "prompt-len", "max-new-tokens",
                   "kl-beta", "temperature", "recompute", "dgrad-weight-cache", "optimizer-steps", "micro-batch-tokens", "grad-dtype",
                   "optimizer-state-dtype", "free-gib", "steps", "warmup", "seed", "json"},
                  {"help", "allow-overcommit", "plan-only", "routing-replay"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  FP8RL_CHECK(args.positional().empty(), "unexpected argument '", args.positional().front(), "'\n", kUsage);
  BenchSetup s;
  const std::string shape = args.get("model", "qwen3-1.7b");
  s.model = model_shape(shape);
  if (args.has("layers")) s.model = model_shape_cut(s.model, args.get_int("layers", s.model.num_layers, 1));
  s.P = args.get_int("prompts", 16, 1);
  s.G = args.get_int("samples", 16, 1);
  s.prompt_len = args.get_int("prompt-len", 160, 1);
  s.max_new = args.get_int("max-new-tokens", 512, 1);
  s.optimizer_steps = args.get_int("optimizer-steps", 1, 1);
  const std::string old_lp = args.get("old-logprobs", "auto");
  FP8RL_CHECK(old_lp == "auto" || old_lp == "score", "--old-logprobs must be auto or score, got '", old_lp, "'");
  s.old_from_forward = old_lp == "auto";
  const std::string mbt = args.get("micro-batch-tokens", "auto");
  s.micro_batch_auto = mbt == "auto";
  if (!s.micro_batch_auto) s.micro_batch_tokens = args.get_int("micro-batch-tokens", 16384, 1);
  s.steps = args.get_int("steps", 2, 1);
  s.warmup = args.get_int("warmup", 1, 0);
  s.seed = static_cast<uint64_t>(args.get_int("seed", 1, 0));
  s.kl_beta = args.get_float("kl-beta", 0.0, 0.0, 1e6);
  s.temperature = args.get_float("temperature", 1.0, 0.01, 100.0);
  s.recompute = args.get("recompute", "none");
  FP8RL_CHECK(s.recompute == "none" || s.recompute == "block" || s.recompute == "auto",
              "--recompute must be none, block or auto, got '", s.recompute, "'");
  s.dgrad_weight_cache = args.get("dgrad-weight-cache", "auto");
  FP8RL_CHECK(s.dgrad_weight_cache == "auto" || s.dgrad_weight_cache == "on" || s.dgrad_weight_cache == "off",
              "--dgrad-weight-cache must be auto, on or off, got '", s.dgrad_weight_cache, "'");
  auto dtype_flag = [&](const char* flag) {
    const std::string v = args.get(flag, "fp32");
    FP8RL_CHECK(v == "fp32" || v == "bf16", "--", flag, " must be fp32 or bf16, got '", v, "'");
    return v == "bf16" ? DType::BF16 : DType::F32;
  };
  s.grad_dtype = dtype_flag("grad-dtype");
  s.moment_dtype = dtype_flag("optimizer-state-dtype");
  s.allow_overcommit = args.has("allow-overcommit");
  s.routing_replay = args.has("routing-replay");
  const double free_gib = args.get_float("free-gib", 0.0, 0.0, 1e6);
  FP8RL_CHECK(s.prompt_len + s.max_new <= s.model.max_position_embeddings, "--prompt-len + --max-new-tokens (",
              s.prompt_len + s.max_new, ") exceeds the shape's max_position_embeddings (",
              s.model.max_position_embeddings, ")");
  const std::vector<std::string> recipes = split_list(args.get("recipes", "bf16,fp8_gen,fp8_e2e"));
  FP8RL_CHECK(!recipes.empty(), "--recipes lists no recipe");
  for (const std::string& r : recipes) (void)PrecisionRecipe::parse(r);  // unknown names fail before any work

  const std::string device = args.get("device", "cpu");
  if (args.has("plan-only")) {  // no backend: a CPU-only build plans a CUDA run (BF16 activations)
    s.free_bytes = free_gib > 0 ? static_cast<int64_t>(free_gib * double(1ll << 30)) : -1;
    if (s.micro_batch_auto)
      s.micro_batch_tokens = bench_auto_micro_batch(s, recipes, device == "cuda" ? DType::BF16 : DType::F32);
    std::printf("bench rl-step --plan-only: device %s, model %s (%d layers), %d prompts x %d samples, prompt <= %d, "
                "new tokens <= %d, kl_beta %g, micro-batch %lld tokens%s, recompute %s, dgrad W^T cache %s, gradients "
                "%s, Adam moments %s\n",
                device.c_str(), shape.c_str(), s.model.num_layers, s.P, s.G, s.prompt_len, s.max_new, s.kl_beta,
                static_cast<long long>(s.micro_batch_tokens), s.micro_batch_auto ? " (auto)" : "", s.recompute.c_str(),
                s.dgrad_weight_cache.c_str(), dtype_name(s.grad_dtype), dtype_name(s.moment_dtype));
    return bench_plan_only(s, recipes, device == "cuda" ? DType::BF16 : DType::F32);
  }
  std::unique_ptr<Backend> backend = make_backend(device);
  Backend& be = *backend;
  s.free_bytes = free_gib > 0 ? static_cast<int64_t>(free_gib * double(1ll << 30)) : be.free_device_bytes();
  if (s.micro_batch_auto) s.micro_batch_tokens = bench_auto_micro_batch(s, recipes, be.act_dtype());
  std::printf("bench rl-step: device %s, model %s (%d layers, hidden %d, vocab %d), %d prompts x %d samples, prompt "
              "<= %d, new tokens <= %d (ragged), kl_beta %g, %d optimizer step(s) (logp_old %s), micro-batch %lld tokens%s, %d "
              "warm-up + %d timed steps per recipe; recompute %s, dgrad W^T cache %s, gradients %s, Adam moments "
              "%s; %s\n",
              be.name().c_str(), shape.c_str(), s.model.num_layers, s.model.hidden_size, s.model.vocab_size, s.P, s.G,
              s.prompt_len, s.max_new, s.kl_beta, s.optimizer_steps,
              s.old_from_forward ? "of the first mini-batch from its forward" : "scored",
              static_cast<long long>(s.micro_batch_tokens), s.micro_batch_auto ? " (auto)" : "",
              s.warmup, s.steps, s.recompute.c_str(), s.dgrad_weight_cache.c_str(), dtype_name(s.grad_dtype),
              dtype_name(s.moment_dtype),
              s.free_bytes < 0 ? "free memory unknown (no memory check)"
                               : ("plans checked against " + gib_text(s.free_bytes) + " free").c_str());
  std::fflush(stdout);
  std::vector<RecipeResult> results, refused;
  for (const std::string& r : recipes) {
    RecipeResult res = bench_recipe(be, s, r);
    (res.refused.empty() ? results : refused).push_back(std::move(res));
  }

  nlohmann::json j;
  j["device"] = be.name();
  j["model"] = shape;
  j["layers"] = s.model.num_layers;
  j["prompts"] = s.P;
  j["samples"] = s.G;
  j["prompt_len"] = s.prompt_len;
  j["max_new_tokens"] = s.max_new;
  j["kl_beta"] = s.kl_beta;
  j["optimizer_steps"] = s.optimizer_steps;
  j["old_logprobs"] = s.old_from_forward ? "auto" : "score";
  j["micro_batch_tokens"] = s.micro_batch_tokens;
  j["micro_batch_auto"] = s.micro_batch_auto;
  j["recompute"] = s.recompute;
  j["dgrad_weight_cache"] = s.dgrad_weight_cache;
  j["grad_dtype"] = dtype_name(s.grad_dtype);
  j["optimizer_state_dtype"] = dtype_name(s.moment_dtype);
  j["free_bytes"] = s.free_bytes;
  j["steps"] = s.steps;
  j["routing_replay"] = s.routing_replay;
  for (const RecipeResult& r : refused) {
    j["refused"][r.recipe] = {{"plan_peak_bytes", r.plan_peak}, {"why", r.refused}};
    std::printf("%s: refused by the memory plan (nothing run): %s\n", r.recipe.c_str(), r.refused.c_str());
  }
  if (results.empty()) {
    if (args.has("json")) write_file_atomic(args.get("json"), j.dump(2) + "\n");
    std::printf("no recipe fits: nothing was run\n");
    return 1;
  }
  const RecipeResult& base = results.front();
  int w = 12;  // column width: the longest recipe spec
  for (const RecipeResult& r : results) w = std::max(w, static_cast<int>(r.recipe.size()));
  std::printf("\n%-18s", "phase (median s)");
  for (const RecipeResult& r : results) std::printf(" %*s", w, r.recipe.c_str());
  for (size_t i = 1; i < results.size(); ++i) std::printf(" %9s", (results[i].recipe + "x").substr(0, 9).c_str());
  std::printf("   (x: speed-up vs %s)\n", base.recipe.c_str());
  auto row = [&](const std::string& name, const std::function<double(const RecipeResult&)>& f) {
    std::printf("%-18s", name.c_str());
    for (const RecipeResult& r : results) std::printf(" %*.3f", w, f(r));
    for (size_t i = 1; i < results.size(); ++i) std::printf(" %8.2fx", f(base) / std::max(1e-12, f(results[i])));
    std::printf("\n");
  };
  for (const char* p : kPhases) row(p, [&](const RecipeResult& r) { return median(r.seconds.at(p)); });
  row("scoring+training", [](const RecipeResult& r) {
    return median(r.seconds.at("scoring")) + median(r.seconds.at("reference")) + median(r.seconds.at("training"));
  });
  // Generation by iteration kind: where its time goes as the ragged batch drains (the FP8 gain of
  // a decode step by its batch size), the kinds any recipe ran; then their step counts.
  auto iter_median = [](const std::vector<std::array<double, RolloutStats::kIterKinds>>& v, int k) {
    std::vector<double> x;
    for (const auto& a : v) x.push_back(a[static_cast<size_t>(k)]);
    return median(x);
  };
  std::vector<int> kinds;
  for (int k = 0; k < RolloutStats::kIterKinds; ++k)
    for (const RecipeResult& r : results)
      if (iter_median(r.gen_iter_steps, k) > 0) {
        kinds.push_back(k);
        break;
      }
  for (int k : kinds)
    row(std::string("gen ") + RolloutStats::iter_kind_name(k) + " s",
        [&](const RecipeResult& r) { return iter_median(r.gen_iter_seconds, k); });
  std::printf("%-18s", "gen steps by kind");
  for (const RecipeResult& r : results) {
    std::string t;
    for (int k : kinds)
      t += (t.empty() ? "" : "/") + std::to_string(static_cast<long long>(iter_median(r.gen_iter_steps, k)));
    std::printf(" %*s", w, t.c_str());
  }
  std::printf("\n%-18s", "gen tokens/s");
  for (const RecipeResult& r : results)
    std::printf(" %*.0f", w, median(r.gen_tokens) / std::max(1e-12, median(r.seconds.at("generation"))));
  std::printf("\n%-18s", "gen host s");
  for (const RecipeResult& r : results) std::printf(" %*.3f", w, median(r.gen_host_seconds));
  std::printf("\n%-18s", "gen forwards");
  for (const RecipeResult& r : results) std::printf(" %*.0f", w, median(r.gen_forwards));
  std::printf("\n%-18s", "mult_prob_error");
  for (const RecipeResult& r : results) std::printf(" %*.4f", w, median(r.mult_prob_error));
  std::printf("\n%-18s", "gen_kl_error");
  for (const RecipeResult& r : results) std::printf(" %*.2e", w, median(r.gen_kl_error));
  if (s.model.is_moe()) {
    std::printf("\n%-18s", "routing agreement");
    for (const RecipeResult& r : results) std::printf(" %*.4f", w, median_finite(r.routing_agreement));
    std::printf("\n%-18s", "router agreement");
    for (const RecipeResult& r : results) std::printf(" %*.4f", w, median_finite(r.router_agreement));
    std::printf("\n%-18s", "mult_err alike");
    for (const RecipeResult& r : results) std::printf(" %*.4f", w, median_finite(r.mult_prob_error_agreed));
    std::printf("\n%-18s", "mult_err differ");
    for (const RecipeResult& r : results) std::printf(" %*.4f", w, median_finite(r.mult_prob_error_differs));
  }
  std::printf("\n%-18s", "entropy nats/tok");
  for (const RecipeResult& r : results) std::printf(" %*.3f", w, median(r.entropy));
  std::printf("\n%-18s", "peak GiB");
  for (const RecipeResult& r : results) std::printf(" %*.2f", w, r.mem.peak_used_bytes / double(1ll << 30));
  std::printf("\n%-18s", "plan peak GiB");
  for (const RecipeResult& r : results) std::printf(" %*.2f", w, r.plan_peak / double(1ll << 30));
  std::printf("\n%-18s", "peak / plan");
  for (const RecipeResult& r : results)
    std::printf(" %*.3f", w, static_cast<double>(r.mem.peak_used_bytes) / std::max<double>(1.0, r.plan_peak));
  std::printf("\n%-18s", "fp8 fallbacks");
  for (const RecipeResult& r : results) std::printf(" %*lld", w, static_cast<long long>(r.counters.fp8_gemm_fallbacks));
  std::printf("\n%-18s", "fp8 row tails");
  for (const RecipeResult& r : results) std::printf(" %*lld", w, static_cast<long long>(r.counters.fp8_gemm_tails));
  std::printf("\n%-18s", "fp8 own-kernel");
  for (const RecipeResult& r : results) std::printf(" %*lld", w, static_cast<long long>(r.counters.fp8_gemm_own));
  std::printf("\n%-18s", "concat products");
  for (const RecipeResult& r : results) std::printf(" %*lld", w, static_cast<long long>(r.counters.concat_products));
  std::printf("\n%-18s", "grouped loops");
  for (const RecipeResult& r : results) std::printf(" %*lld", w, static_cast<long long>(r.counters.grouped_loops));
  std::printf("\n%-18s", "paged runs off");
  for (const RecipeResult& r : results) std::printf(" %*lld", w, static_cast<long long>(r.counters.paged_runs_off));
  std::printf("\n%-18s", "gemm tuned/chg/ms");
  for (const RecipeResult& r : results) {
    const std::string t = std::to_string(r.counters.gemm_tuned) + "/" + std::to_string(r.counters.gemm_tuned_changed) +
                          "/" + std::to_string(static_cast<long long>(r.counters.gemm_tune_ms));
    std::printf(" %*s", w, t.c_str());
  }
  std::printf("\n%-18s", "lt heuristics/ms");
  for (const RecipeResult& r : results) {
    const std::string t = std::to_string(r.counters.gemm_heuristics) + "/" +
                          std::to_string(static_cast<long long>(r.counters.gemm_heuristic_ms));
    std::printf(" %*s", w, t.c_str());
  }
  std::printf("\n");
  for (const RecipeResult& r : results) {
    nlohmann::json jr;
    for (const char* p : kPhases) jr["seconds"][p] = {{"median", median(r.seconds.at(p))}, {"all", r.seconds.at(p)}};
    jr["generated_tokens"] = r.gen_tokens;
    jr["train_tokens"] = r.train_tokens;
    jr["generation_tokens_per_s"] = median(r.gen_tokens) / std::max(1e-12, median(r.seconds.at("generation")));
    jr["generation_host_seconds"] = r.gen_host_seconds;  // host time outside waits (RolloutStats)
    jr["generation_forwards"] = r.gen_forwards;
    for (int k = 0; k < RolloutStats::kIterKinds; ++k) {  // per timed step
      nlohmann::json sec = nlohmann::json::array(), n = nlohmann::json::array();
      for (size_t i = 0; i < r.gen_iter_seconds.size(); ++i) {
        sec.push_back(r.gen_iter_seconds[i][static_cast<size_t>(k)]);
        n.push_back(r.gen_iter_steps[i][static_cast<size_t>(k)]);
      }
      jr["generation_iterations"][RolloutStats::iter_kind_name(k)] = {{"seconds", sec}, {"steps", n}};
    }
    jr["token_mult_prob_error"] = r.mult_prob_error;
    jr["gen_kl_error"] = r.gen_kl_error;
    jr["entropy_per_token"] = r.entropy;  // the trainer's scoring, mean over response tokens
    if (s.model.is_moe()) {
      jr["routing_agreement"] = r.routing_agreement;
      jr["router_topk_agreement"] = r.router_agreement;
      jr["token_mult_prob_error_routing_agreed"] = r.mult_prob_error_agreed;
      jr["token_mult_prob_error_routing_differs"] = r.mult_prob_error_differs;
    }
    jr["peak_used_bytes"] = r.mem.peak_used_bytes;
    jr["peak_reserved_bytes"] = r.mem.peak_reserved_bytes;
    jr["plan_peak_bytes"] = r.plan_peak;
    jr["recompute"] = r.recompute ? "block" : "none";
    jr["dgrad_weight_cache"] = r.dgrad_weight_cache ? "on" : "off";
    jr["fp8_gemm_fallbacks"] = r.counters.fp8_gemm_fallbacks;
    jr["fp8_gemm_tails"] = r.counters.fp8_gemm_tails;
    jr["fp8_gemm_own"] = r.counters.fp8_gemm_own;
    jr["grouped_loops"] = r.counters.grouped_loops;
    jr["paged_runs_off"] = r.counters.paged_runs_off;
    jr["concat_products"] = r.counters.concat_products;
    jr["gemm_tuned"] = {{"products", r.counters.gemm_tuned},
                        {"changed", r.counters.gemm_tuned_changed},
                        {"ms", r.counters.gemm_tune_ms}};
    jr["gemm_heuristics"] = {{"queries", r.counters.gemm_heuristics}, {"ms", r.counters.gemm_heuristic_ms}};
    j["recipes"][r.recipe] = jr;
  }
  if (args.has("json")) {
    write_file_atomic(args.get("json"), j.dump(2) + "\n");
    std::printf("wrote %s\n", args.get("json").c_str());
  }
  return 0;
}

const Register kRegister{"bench-rl-step",
                         "time whole GRPO steps of a random model, ragged batches, several recipes (--device cpu|cuda)",
                         run_bench};

}  // namespace
}  // namespace fp8rl::cli
