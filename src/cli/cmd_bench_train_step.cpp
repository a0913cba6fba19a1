// fp8rl bench-train-step: times the three phases of a GRPO step on a random-weight model.
//
//   fp8rl bench-train-step [--device cpu|cuda] [--precision bf16|fp8|fp32] [--wgrad auto|fp8|bf16] [--hidden 64] [--layers 2]
//                          [--heads 4] [--kv-heads 2] [--head-dim 16] [--ffn 192] [--vocab 384]
//                          [--model SHAPE] [--micro-batch-tokens 4096] [--grad-dtype fp32|bf16] [--plan-only]
//                          [--seqs 64] [--seq-len 40] [--prompt-len 16] [--repeats 5] [--json PATH]
//
// The defaults are the CPU demo's shape (configs/demo_cpu.yaml). --model takes a named shape of
// model/shapes.h instead (qwen3-30b-a3b, moonlight-16b-a3b, tiny-moe, ...; --layers N cuts it,
// the other size flags are refused with it), built with bench_random_weights directly on the
// device (the F32 master). The memory plan of the setup (rl/memory_plan.h) is printed, and the
// FP8 GEMM fallback counters are reported (must be 0 on the FP8 path). Phases, each timed after one
// warm-up run, median of --repeats:
//   score     Trainer::score of --seqs sequences of --seq-len tokens (logp + entropy [+ amax])
//   train     one Trainer::step: forward + backward + AdamW, loss = -mean logp of every token
//             after the first (the lm_head over the whole sequence, as the causal-LM loss of the
//             PyTorch peer, scripts/bench_train_step_torch.py; --prompt-len sizes generate only)
//   generate  RolloutEngine::generate of --seqs sequences: prompt --prompt-len tokens, then
//             seq-len - prompt-len new tokens (no stop token, so every sequence runs to the end)
// --precision picks the recipe preset: fp32, bf16, or fp8 (= fp8_e2e: FP8 linears in both
// engines, E4M3 KV cache); --wgrad fp8|bf16 overrides the preset (fp8_e2e: BF16 weight gradients)
// (precision.trainer_wgrad). The backend is synchronized before each clock read, so the same
// program times the CUDA backend. Prints a table; --json also writes the figures.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/fs.h"
#include "bench/rollout_bench.h"
#include "model/shapes.h"
#include "model/weights.h"
#include "rl/memory_plan.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl::cli {
namespace {

constexpr const char* kUsage =
    "usage: fp8rl bench-train-step [--device cpu|cuda] [--precision bf16|fp8|fp32] [--wgrad auto|fp8|bf16]\n"
    "                              [--hidden N] [--layers N] [--heads N] [--kv-heads N] [--head-dim N] [--ffn N] [--vocab N] [--seqs N]\n"
    "                              [--seq-len N] [--prompt-len N] [--repeats N] [--json PATH]\n"
    "                              [--model SHAPE [--layers N]] [--micro-batch-tokens N] [--grad-dtype fp32|bf16] [--plan-only]\n"
    "Times the trainer's scoring forward, one training step and generation on a random-weight model\n"
    "(defaults: the CPU demo shape, 64 sequences of 16 prompt + 24 response tokens, bf16). --model: a\n"
    "named shape (qwen3-30b-a3b, moonlight-16b-a3b, llama-3.2-1b, tiny-moe, ...) instead of the size flags,\n"
    "--layers N its first N blocks. --plan-only: print the memory plan of the setup and run nothing.\n";

using Clock = std::chrono::steady_clock;

struct Phase {
  std::string name;
  double tokens = 0;  // tokens one run processes (generate: new tokens)
  std::vector<double> ms, cpu_ms;  // wall-clock and process CPU time (all threads) per run
  MemoryStats mem;                 // device memory peaks over the phase (CUDA; zeros on the CPU)
  static double median(std::vector<double> s) {
    std::sort(s.begin(), s.end());
    const size_t n = s.size();
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
};

// Runs f once to warm up, then `repeats` times, each timed between two synchronizations. With
// FP8RL_CUDA_PROFILE the op table of the timed repeats alone is printed per phase (the set-up's
// weight uploads and the warm-up dropped).
void time_phase(Backend& be, Phase& p, int repeats, const std::function<void()>& f) {
  be.reset_peak_memory_stats();
  f();
  be.synchronize();
  be.profile_report("", /*print=*/false);
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    const std::clock_t c0 = std::clock();
    f();
    be.synchronize();
    p.ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    p.cpu_ms.push_back(1000.0 * double(std::clock() - c0) / CLOCKS_PER_SEC);
  }
  be.profile_report(p.name + " (" + std::to_string(repeats) + (repeats == 1 ? " run)" : " runs)"), /*print=*/true);
  p.mem = be.memory_stats();
}

int run_bench(const std::vector<std::string>& argv) {
  const Args args(argv,
                  {"device", "precision", "wgrad", "hidden", "layers", "heads", "kv-heads", "head-dim", "ffn", "vocab", "seqs",
                   "seq-len", "prompt-len", "repeats", "json", "model", "micro-batch-tokens", "grad-dtype"},
                  {"help", "plan-only"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  FP8RL_CHECK(args.positional().empty(), "unexpected argument '", args.positional().front(), "'\n", kUsage);
  const std::string device = args.get("device", "cpu");
  const std::string prec_name = args.get("precision", "bf16");
  FP8RL_CHECK(prec_name == "bf16" || prec_name == "fp8" || prec_name == "fp32", "--precision must be bf16, fp8 or ",
              "fp32, got '", prec_name, "'");
  const std::string wgrad = args.get("wgrad", "auto");
  FP8RL_CHECK(wgrad == "auto" || wgrad == "fp8" || wgrad == "bf16", "--wgrad must be auto, fp8 or bf16, got '",
              wgrad, "'");
  const PrecisionRecipe recipe = PrecisionRecipe::parse((prec_name == "fp8" ? "fp8_e2e" : prec_name) +
                                                        (wgrad != "auto" ? ":wgrad=" + wgrad : ""));
  const std::string shape = args.get("model", "");
  if (!shape.empty())
    for (const char* f : {"hidden", "heads", "kv-heads", "head-dim", "ffn", "vocab"})
      FP8RL_CHECK(!args.has(f), "--", f, " sets a size of the default model; with --model ", shape,
                  " the shape's sizes are used (only --layers cuts it)");
  const int hidden = args.get_int("hidden", 64, 1), layers = args.get_int("layers", 2, 1);
  const int heads = args.get_int("heads", 4, 1), kv_heads = args.get_int("kv-heads", 2, 1);
  const int head_dim = args.get_int("head-dim", 16, 2), ffn = args.get_int("ffn", 192, 1);
  const int nseq = args.get_int("seqs", 64, 1);
  const int seq_len = args.get_int("seq-len", 40, 2), repeats = args.get_int("repeats", 5, 1);
  const int prompt_len = args.get_int("prompt-len", std::min(16, seq_len - 1), 1);
  FP8RL_CHECK(prompt_len < seq_len, "--prompt-len ", prompt_len, " must be shorter than --seq-len ", seq_len);
  const int new_tokens = seq_len - prompt_len;

  // The model: the demo's Qwen3-style tiny model with random weights (session_initial_policy),
  // or a named shape.
  ModelConfig mc;
  if (shape.empty()) {
    mc = model_config_tiny("qwen3", args.get_int("vocab", 384, 2), hidden, layers, heads, kv_heads, ffn);
    mc.head_dim = head_dim;
    mc.max_position_embeddings = std::max(512, seq_len);
    mc.validate();
  } else {
    mc = model_shape(shape);
    if (args.has("layers")) mc = model_shape_cut(mc, layers);
    FP8RL_CHECK(seq_len <= mc.max_position_embeddings, "--seq-len ", seq_len, " exceeds ", shape, "'s ",
                mc.max_position_embeddings, " positions");
  }
  const int vocab = mc.vocab_size;
  TrainerOptions topt;
  topt.micro_batch_tokens = args.get_int64("micro-batch-tokens", topt.micro_batch_tokens, 1, int64_t(1) << 40);
  const std::string grad_dtype = args.get("grad-dtype", "fp32");
  FP8RL_CHECK(grad_dtype == "fp32" || grad_dtype == "bf16", "--grad-dtype must be fp32 or bf16, got '", grad_dtype,
              "'");
  topt.grad_dtype = grad_dtype == "bf16" ? DType::BF16 : DType::F32;

  const int pages = nseq * ((seq_len + 15) / 16) + 1;
  // The memory plan of this setup (no reference policy; the engine's pool of `pages`), with the
  // activation dtype of --device (CUDA: BF16).
  MemoryPlanInput plan_in;
  plan_in.model = mc;
  plan_in.generator = recipe.generator;
  plan_in.trainer = recipe.trainer;
  plan_in.act_dtype = device == "cuda" ? DType::BF16 : DType::F32;
  plan_in.kv_pages = pages;
  plan_in.micro_batch_tokens = topt.micro_batch_tokens;
  plan_in.grad_dtype = topt.grad_dtype;
  plan_in.generation_batch = std::max(nseq, 1);
  const MemoryPlan plan = memory_plan_compute(plan_in);
  const int64_t plan_peak = plan.peak_bytes();
  if (args.has("plan-only")) {  // no device is opened: a CPU-only build plans a CUDA run
    std::printf("bench-train-step --plan-only: device %s, precision %s (recipe %s), %d seqs x %d tokens\n%s",
                device.c_str(), prec_name.c_str(), recipe.name.c_str(), nseq, seq_len,
                memory_plan_format(plan, mc, 0).c_str());
    return 0;
  }
  std::unique_ptr<Backend> backend = make_backend(device);
  Backend& be = *backend;
  ModelWeights master = shape.empty()
                            ? model_weights_to_device(be, model_weights_random(mc, RandomInit{}, DType::F32), DType::F32)
                            : bench_random_weights(be, mc, DType::F32, /*seed=*/1);
  Trainer trainer(be, std::move(master), recipe.trainer, topt);
  RolloutEngine engine(be, trainer.master(), recipe.generator, pages, 16, std::max(nseq, 1));

  // Random token sequences (ids avoid nothing: the model is random anyway).
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  std::vector<TrainSequence> seqs(nseq);
  std::vector<RolloutRequest> reqs(nseq);
  for (int i = 0; i < nseq; ++i) {
    for (int t = 0; t < seq_len; ++t) seqs[i].ids.push_back(tok(rng));
    seqs[i].prompt_len = 1;  // the trainer's head over every position (ForwardOptions::head_rows)
    reqs[i].prompt.assign(seqs[i].ids.begin(), seqs[i].ids.begin() + prompt_len);
    reqs[i].n = 1;
  }
  const bool fp8_kv = recipe.generator.kv_cache == DType::E4M3;
  const TokenLossFn loss = [](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
    double l = 0;
    const float n = static_cast<float>(std::max<size_t>(lp.size(), 1));
    for (size_t i = 0; i < lp.size(); ++i) {
      l -= lp[i] / n;
      grad[i] = -1.0f / n;
    }
    return l;
  };
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.max_new_tokens = new_tokens;
  sp.seed = 7;

  const double total_tokens = double(nseq) * seq_len;
  Phase score{"score", total_tokens, {}, {}, {}}, train{"train_step", total_tokens, {}, {}, {}},
      gen{"generate", double(nseq) * new_tokens, {}, {}, {}};
  char moe[128] = "";
  if (mc.is_moe())
    std::snprintf(moe, sizeof moe, " E=%d top-%d Fe=%d shared %d%s", mc.num_experts, mc.num_experts_per_tok,
                  mc.moe_intermediate_size, mc.n_shared_experts, mc.is_mla() ? " MLA" : "");
  std::printf("bench-train-step: device %s, precision %s (recipe %s), model %s D=%d L=%d H=%d/%d hd=%d F=%d V=%d%s, "
              "%d seqs x %d tokens (prompt %d), micro-batch %lld tokens, %d repeats; memory plan peak %.2f GiB\n",
              be.name().c_str(), prec_name.c_str(), recipe.name.c_str(), shape.empty() ? "tiny-qwen3" : shape.c_str(),
              mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size, vocab,
              moe, nseq, seq_len, prompt_len, static_cast<long long>(topt.micro_batch_tokens), repeats,
              plan_peak / double(1ll << 30));
  std::fflush(stdout);
  const BackendCounters c0 = be.counters();
  time_phase(be, score, repeats, [&] { trainer.score(seqs, 1.0f, /*entropy=*/true, /*record_amax=*/fp8_kv); });
  time_phase(be, train, repeats, [&] { trainer.step(seqs, 1.0f, loss, 1e-4f); });
  time_phase(be, gen, repeats, [&] {
    engine.generate(reqs, sp);
    FP8RL_CHECK(engine.last_stats().generated_tokens == int64_t(nseq) * new_tokens, "generation produced ",
                engine.last_stats().generated_tokens, " tokens, expected ", int64_t(nseq) * new_tokens);
  });

  const BackendCounters c1 = be.counters();
  nlohmann::json j;
  j["device"] = be.name();
  j["precision"] = prec_name;
  j["recipe"] = recipe.name;
  j["wgrad"] = wgrad;
  j["model"] = {{"hidden", mc.hidden_size}, {"layers", mc.num_layers}, {"heads", mc.num_heads},
                {"kv_heads", mc.num_kv_heads}, {"head_dim", mc.head_dim}, {"ffn", mc.intermediate_size},
                {"vocab", vocab}};
  if (!shape.empty()) j["model"]["name"] = shape;
  if (mc.is_moe())
    j["model"]["moe"] = {{"experts", mc.num_experts}, {"top_k", mc.num_experts_per_tok},
                         {"expert_ffn", mc.moe_intermediate_size}, {"shared_experts", mc.n_shared_experts},
                         {"router", mc.moe_router}, {"mla", mc.is_mla()}};
  j["micro_batch_tokens"] = topt.micro_batch_tokens;
  j["plan_peak_bytes"] = plan_peak;
  j["fp8_gemm_fallbacks"] = c1.fp8_gemm_fallbacks - c0.fp8_gemm_fallbacks;
  j["fp8_gemm_tails"] = c1.fp8_gemm_tails - c0.fp8_gemm_tails;
  j["fp8_gemm_own"] = c1.fp8_gemm_own - c0.fp8_gemm_own;
  j["grouped_loops"] = c1.grouped_loops - c0.grouped_loops;
  j["seqs"] = nseq;
  j["seq_len"] = seq_len;
  j["prompt_len"] = prompt_len;
  j["repeats"] = repeats;
  // cpu ms: process CPU time of all threads (on a shared machine the wall time also counts
  // waiting for a core; on an idle one wall < cpu when the threads overlap).
  // peak GiB: device memory in use at the phase's peak (tensors + scratch; the pool reserves
  // "reserved" of it); both include what was allocated before the phase and still lives.
  std::printf("%-12s %11s %11s %11s %13s %10s %10s\n", "phase", "median ms", "min ms", "cpu ms", "tokens/s",
              "peak GiB", "resv GiB");
  for (const Phase* p : {&score, &train, &gen}) {
    const double med = Phase::median(p->ms), mn = *std::min_element(p->ms.begin(), p->ms.end());
    const double cpu = Phase::median(p->cpu_ms);
    const double tps = p->tokens / (med / 1000.0);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::printf("%-12s %11.1f %11.1f %11.1f %13.0f %10.2f %10.2f\n", p->name.c_str(), med, mn, cpu, tps,
                p->mem.peak_used_bytes / gib, p->mem.peak_reserved_bytes / gib);
    j["phases"][p->name] = {{"median_ms", med}, {"min_ms", mn},         {"cpu_ms_median", cpu}, {"tokens", p->tokens},
                            {"tokens_per_s", tps}, {"ms", p->ms}, {"cpu_ms", p->cpu_ms},
                            {"peak_used_bytes", p->mem.peak_used_bytes},
                            {"peak_reserved_bytes", p->mem.peak_reserved_bytes}};
  }
  std::printf("fp8 fallbacks %lld, row tails %lld, own-kernel %lld, grouped loops %lld\n",
              static_cast<long long>(c1.fp8_gemm_fallbacks - c0.fp8_gemm_fallbacks),
              static_cast<long long>(c1.fp8_gemm_tails - c0.fp8_gemm_tails),
              static_cast<long long>(c1.fp8_gemm_own - c0.fp8_gemm_own),
              static_cast<long long>(c1.grouped_loops - c0.grouped_loops));
  j["threads_env"] = std::getenv("FP8RL_CPU_THREADS") ? std::getenv("FP8RL_CPU_THREADS") : "";
  if (args.has("json")) {
    write_file_atomic(args.get("json"), j.dump(2) + "\n");
    std::printf("wrote %s\n", args.get("json").c_str());
  }
  return 0;
}

const Register kRegister{"bench-train-step",
                         "time scoring, one training step and generation on a random model (--device cpu|cuda)",
                         run_bench};

}  // namespace
}  // namespace fp8rl::cli
