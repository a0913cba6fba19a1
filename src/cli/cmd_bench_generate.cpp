// fp8rl bench generate: rollout throughput of the RolloutEngine on a random-weight Llama
// (issue #6), per precision recipe, against the memory-bandwidth roofline of decoding.
//
//   fp8rl bench generate [--device cuda|cpu] [--model 8b|1b|tiny|SHAPE] [--layers N] [--prompts 256] [--prompt-len 512]
//                        [--gen-len 1024] [--recipes bf16,fp8_linear,fp8_kv,fp8_attn] [--kv-fraction 0.85]
//                        [--warmup 1] [--seed 1] [--peak-bw 4.8e12] [--json PATH]
//
// Per recipe, on a fresh backend (so that each recipe's memory is measured alone):
//   1. BF16 random weights (F32 on the CPU) on the device: the master the engine copies from;
//   2. the engine: generator copy in the recipe's numerics + a KV pool of
//      min(pages the workload needs, kv-fraction x free memory after the weights); then the
//      master is freed;
//   3. --warmup untimed runs of 2 new tokens; a timed prefill-only run (1 new token); the timed
//      full run (gen-len new tokens, no stop ids: every sequence runs to the end).
//   decode time = full - prefill-only. The roofline (bench/rollout_bench.h) over the decode
//   steps at --peak-bw and at the device-to-device copy bandwidth measured first.
// GPU memory per component from cudaMemGetInfo before/after each phase; the activations' peak
// from a thread sampling it every 2 ms during the runs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/fs.h"
#include "model/shapes.h"
#include "rl/memory_plan.h"
#include "rollout/rollout.h"
#include "bench/rollout_bench.h"

#ifdef FP8RL_HAVE_CUDA
#include "bench/cuda_memory.h"  // a plain C++ header over cudaMemGetInfo
#endif

namespace fp8rl::cli {
namespace {

constexpr const char* kUsage =
    "usage: fp8rl bench generate [--device cuda|cpu] [--model SHAPE] [--layers N] [--prompts N] [--prompt-len N]\n"
    "                            [--gen-len N] [--recipes LIST] [--kv-fraction F] [--warmup N] [--seed N]\n"
    "                            [--peak-bw B/s] [--json PATH]\n"
    "Rollout throughput of the engine on a random-weight Llama (defaults: cuda, 8b, 256 prompts of 512\n"
    "random ids, 1024 new tokens each, EOS ignored, temperature 1) per recipe: bf16 (BF16 everything),\n"
    "fp8_linear (FP8 128x128 linears, BF16 KV), fp8_kv (+ E4M3 KV), fp8_attn (+ FP8 attention);\n"
    "output tokens/s, prefill/decode split, decode roofline at --peak-bw (4.8e12, H200) and at the\n"
    "measured copy bandwidth, GPU memory per component. --kv-fraction: the KV pool's share of the GPU\n"
    "memory free after the weights (capped at what the workload needs). SHAPE: any of model/shapes.h (8b, 1b,\n"
    "qwen3-30b-a3b, moonlight-16b-a3b, tiny, tiny-moe, tiny-mla, ...); --layers N: its first N blocks.\n";

using Clock = std::chrono::steady_clock;
constexpr int kPageSize = 16;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double real_flag(const Args& a, const std::string& name, double fallback, double lo, double hi) {
  const std::string s = a.get(name, "");
  if (s.empty()) return fallback;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  FP8RL_CHECK(used == s.size() && used > 0, "--", name, ": '", s, "' is not a number");
  FP8RL_CHECK(v > lo && v <= hi, "--", name, " must be in (", lo, ", ", hi, "], got ", v);
  return v;
}

// The four recipes as generator precisions.
EnginePrecision recipe_precision(const std::string& name) {
  EnginePrecision p;  // bf16: BF16 linears, BF16 KV
  if (name == "bf16") return p;
  p.linear = LinearMode::FP8_BLOCK;
  if (name == "fp8_linear") return p;
  p.kv_cache = DType::E4M3;
  if (name == "fp8_kv") return p;
  p.fp8_attention = true;
  if (name == "fp8_attn") return p;
  FP8RL_FAIL("unknown recipe '", name, "' (expected bf16, fp8_linear, fp8_kv or fp8_attn)");
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// ---- GPU memory (cudaMemGetInfo; -1 where unknown) ------------------------------------------

int64_t device_free_bytes(const Backend& be) {
#ifdef FP8RL_HAVE_CUDA
  if (be.device() == DeviceKind::CUDA) return bench_cuda_free_bytes();
#endif
  return -1;
}

// Samples the device's free memory every 2 ms on its own thread; min_free() is the lowest seen.
class FreeMemorySampler {
 public:
  explicit FreeMemorySampler(const Backend& be) : min_free_(device_free_bytes(be)) {
#ifdef FP8RL_HAVE_CUDA
    if (be.device() != DeviceKind::CUDA || min_free_ < 0) return;
    const int dev = bench_cuda_current_device();
    if (dev < 0) return;
    thread_ = std::thread([this, dev] {
      bench_cuda_set_device(dev);
      while (!stop_.load()) {
        const int64_t f = bench_cuda_free_bytes();
        if (f >= 0 && f < min_free_.load()) min_free_.store(f);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
#endif
  }
  ~FreeMemorySampler() { stop(); }
  int64_t stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    return min_free_.load();
  }

 private:
  std::atomic<int64_t> min_free_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

nlohmann::json bytes_or_null(int64_t b) { return b < 0 ? nlohmann::json() : nlohmann::json(b); }

// Device-to-device copy bandwidth (bytes read + written per second), best of 5 after a warm-up.
double copy_bandwidth(Backend& be) {
  const int64_t n = be.device() == DeviceKind::CUDA ? (int64_t(1) << 29) : (int64_t(1) << 24);  // BF16 elements
  Tensor a = be.alloc({n}, DType::BF16), b = be.alloc({n}, DType::BF16);
  be.fill(a, 0.5f);
  be.copy(a, b);
  be.synchronize();
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = Clock::now();
    be.copy(a, b);
    be.synchronize();
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * static_cast<double>(a.nbytes()) / best;
}

struct Workload {
  int prompts = 0, prompt_len = 0, gen_len = 0, warmup = 0;
  uint64_t seed = 1;
  double kv_fraction = 0.85, peak_bw = 4.8e12, copy_bw = 0;
};

nlohmann::json run_recipe(const std::string& device, const std::string& recipe, const ModelConfig& mc,
                          const Workload& w, const std::vector<RolloutRequest>& reqs) {
  const EnginePrecision prec = recipe_precision(recipe);
  std::unique_ptr<Backend> backend = make_backend(device);
  Backend& be = *backend;
  nlohmann::json j, mem;
  j["recipe"] = recipe;
  j["precision"] = {{"linear", linear_mode_name(prec.linear)}, {"kv_cache", dtype_name(prec.kv_cache)},
                    {"fp8_attention", prec.fp8_attention}};

  // 1. The master weights.
  const int64_t free0 = device_free_bytes(be);
  auto t0 = Clock::now();
  ModelWeights master = bench_random_weights(be, mc, be.act_dtype(), w.seed);
  j["weights_build_s"] = seconds_since(t0);
  const int64_t free1 = device_free_bytes(be);
  const int64_t master_bytes = bench_weights_bytes(master);

  // 2. The engine (the master is still held while it copies).
  const int64_t gen_bytes_est = memory_plan_generator_bytes(mc, prec, be.act_dtype());
  const int64_t kv_tok = bench_kv_bytes_per_token(mc, prec.kv_cache);
  const int64_t page_bytes = kv_tok * kPageSize;
  const int pages_per_seq = static_cast<int>(ceil_div(w.prompt_len + w.gen_len, kPageSize));
  const int64_t pages_needed = int64_t(w.prompts) * pages_per_seq;
  int64_t pages = pages_needed;
  if (free1 >= 0) {
    const double free_after_weights = static_cast<double>(free1 - gen_bytes_est);
    const int64_t cap = static_cast<int64_t>(w.kv_fraction * std::max(0.0, free_after_weights) / page_bytes);
    FP8RL_CHECK(cap >= pages_per_seq, "recipe ", recipe, ": the KV pool fits ", cap, " pages of ", page_bytes,
                " bytes but one sequence needs ", pages_per_seq, " (", free_after_weights / kGiB,
                " GiB free after the weights); lower --prompt-len/--gen-len or use a smaller --model");
    pages = std::min(pages, cap);
  }
  FP8RL_CHECK(pages <= 0x7fffffff, "KV pool of ", pages, " pages is too large");
  t0 = Clock::now();
  RolloutEngine engine(be, master, prec, static_cast<int>(pages), kPageSize, w.prompts);
  be.synchronize();
  j["engine_build_s"] = seconds_since(t0);
  const int64_t free2 = device_free_bytes(be);
  master = ModelWeights{};  // the engine keeps its own copy
  const int64_t free3 = device_free_bytes(be);
  const int64_t gen_bytes = bench_weights_bytes(engine.weights());
  int64_t kv_pool_bytes = 0;
  for (const Tensor& t : engine.kv_cache().k) kv_pool_bytes += static_cast<int64_t>(t.nbytes());
  for (const Tensor& t : engine.kv_cache().v) kv_pool_bytes += static_cast<int64_t>(t.nbytes());
  const int concurrency = static_cast<int>(std::min<int64_t>(w.prompts, pages / pages_per_seq));
  std::fprintf(stderr, "  %s: weights %.1f s, engine %.1f s (generator %.2f GiB, KV pool %lld pages = %.2f GiB, %d "
               "sequences at once)\n", recipe.c_str(), j["weights_build_s"].get<double>(),
               j["engine_build_s"].get<double>(), gen_bytes / kGiB, static_cast<long long>(pages),
               kv_pool_bytes / kGiB, concurrency);

  // 3. The runs.
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.seed = w.seed;
  FreeMemorySampler sampler(be);
  auto timed = [&](int new_tokens) {
    sp.max_new_tokens = new_tokens;
    const auto t = Clock::now();
    engine.generate(reqs, sp);
    be.synchronize();
    const double s = seconds_since(t);
    const int64_t want = int64_t(w.prompts) * new_tokens;
    FP8RL_CHECK(engine.last_stats().generated_tokens == want, "recipe ", recipe, ": generation produced ",
                engine.last_stats().generated_tokens, " tokens, expected ", want);
    return s;
  };
  for (int i = 0; i < w.warmup; ++i) timed(std::min(2, w.gen_len));
  const double prefill_s = timed(1);
  std::fprintf(stderr, "  %s: prefill-only %.3f s\n", recipe.c_str(), prefill_s);
  const double wall_s = timed(w.gen_len);
  const RolloutStats stats = engine.last_stats();
  const int64_t min_free = sampler.stop();
  // Decode = full - prefill-only; not measurable when noise makes it vanish (tiny CPU runs).
  const bool has_decode = wall_s > prefill_s;
  const double decode_s = wall_s - prefill_s;
  auto per_decode_s = [&](double x) { return has_decode ? nlohmann::json(x / decode_s) : nlohmann::json(); };

  // Roofline over the decode steps.
  const bool tied = mc.tie_word_embeddings;
  const double embed_bytes = static_cast<double>(engine.weights().embed.nbytes());
  const double row_bytes = static_cast<double>(mc.hidden_size * dtype_size(engine.weights().embed.dtype()));
  const DecodeRoofline rl = bench_decode_roofline(static_cast<double>(gen_bytes) - (tied ? 0.0 : embed_bytes),
                                                  row_bytes, static_cast<double>(kv_tok), w.prompts, w.prompt_len,
                                                  w.gen_len, concurrency);
  const double out_tokens = double(w.prompts) * w.gen_len, dec_tokens = double(w.prompts) * (w.gen_len - 1);
  j["wall_s"] = wall_s;
  j["prefill_s"] = prefill_s;
  j["decode_s"] = has_decode ? nlohmann::json(decode_s) : nlohmann::json();
  j["output_tokens"] = out_tokens;
  j["tokens_per_s"] = out_tokens / wall_s;
  j["prefill_tokens_per_s"] = double(w.prompts) * w.prompt_len / prefill_s;
  j["decode_tokens_per_s"] = per_decode_s(dec_tokens);
  j["engine"] = {{"forwards", stats.decode_steps}, {"waves", stats.waves}, {"concurrency", concurrency}};
  const double rl_peak = rl.seconds(w.peak_bw), rl_copy = w.copy_bw > 0 ? rl.seconds(w.copy_bw) : 0.0;
  j["roofline"] = {{"decode_steps", rl.steps},
                   {"weight_bytes", rl.weight_bytes},
                   {"kv_bytes", rl.kv_bytes},
                   {"peak_bw_Bps", w.peak_bw},
                   {"time_s_peak", rl_peak},
                   {"fraction_peak", per_decode_s(rl_peak)},
                   {"copy_bw_Bps", w.copy_bw},
                   {"time_s_copy", rl_copy},
                   {"fraction_copy", per_decode_s(rl_copy)}};
  mem["generator_weights_bytes"] = gen_bytes;
  mem["generator_weights_bytes_expected"] = gen_bytes_est;
  mem["master_weights_bytes"] = master_bytes;
  mem["kv_pool_bytes"] = kv_pool_bytes;
  mem["kv_pool_pages"] = pages;
  mem["kv_pages_needed"] = pages_needed;
  mem["kv_bytes_per_token"] = kv_tok;
  // Measured (cudaMemGetInfo deltas; null on the CPU).
  const bool measured = free0 >= 0;
  mem["measured_master_bytes"] = measured ? nlohmann::json(free0 - free1) : nlohmann::json();
  mem["measured_generator_weights_bytes"] = measured ? nlohmann::json(free1 - free2 - kv_pool_bytes) : nlohmann::json();
  mem["measured_kv_pool_bytes"] = measured ? nlohmann::json(kv_pool_bytes) : nlohmann::json();
  mem["measured_activations_peak_bytes"] = measured ? nlohmann::json(free3 - min_free) : nlohmann::json();
  mem["free_before_bytes"] = bytes_or_null(free0);
  mem["free_during_run_min_bytes"] = bytes_or_null(min_free);
  j["memory"] = mem;
  return j;
}

// One row of the table (columns as in the header printed by run_bench_generate).
void print_row(const std::string& r, const nlohmann::json& j) {
  const auto& m = j["memory"];
  auto cell = [](const nlohmann::json& v, double mult, const char* fmt, int width) {
    char buf[64];
    if (v.is_null()) std::snprintf(buf, sizeof buf, "%*s", width, "-");
    else std::snprintf(buf, sizeof buf, fmt, width, v.get<double>() * mult);
    return std::string(buf);
  };
  std::printf("%-11s %8.2f %10.0f %9.3f %s %s %9.3f %s%% %s%% %8.2f %7.2f %s\n", r.c_str(), j["wall_s"].get<double>(),
              j["tokens_per_s"].get<double>(), j["prefill_s"].get<double>(), cell(j["decode_s"], 1, "%*.2f", 9).c_str(),
              cell(j["decode_tokens_per_s"], 1, "%*.0f", 10).c_str(), j["roofline"]["time_s_peak"].get<double>(),
              cell(j["roofline"]["fraction_peak"], 100, "%*.1f", 6).c_str(),
              cell(j["roofline"]["fraction_copy"], 100, "%*.1f", 6).c_str(),
              m["generator_weights_bytes"].get<double>() / kGiB, m["kv_pool_bytes"].get<double>() / kGiB,
              cell(m["measured_activations_peak_bytes"], 1 / kGiB, "%*.2f", 7).c_str());
}

int run_bench_generate(const std::vector<std::string>& argv) {
  const Args args(argv,
                  {"device", "model", "layers", "prompts", "prompt-len", "gen-len", "recipes", "kv-fraction", "warmup",
                   "seed", "peak-bw", "json"},
                  {"help"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  FP8RL_CHECK(args.positional().empty(), "unexpected argument '", args.positional().front(), "'\n", kUsage);
  const std::string device = args.get("device", "cuda"), model = args.get("model", "8b");
  Workload w;
  w.prompts = args.get_int("prompts", 256, 1);
  w.prompt_len = args.get_int("prompt-len", 512, 1);
  w.gen_len = args.get_int("gen-len", 1024, 2);
  w.warmup = args.get_int("warmup", 1, 0);
  w.seed = static_cast<uint64_t>(args.get_int("seed", 1, 0));
  w.kv_fraction = real_flag(args, "kv-fraction", 0.85, 0.0, 1.0);
  w.peak_bw = real_flag(args, "peak-bw", 4.8e12, 0.0, 1e15);
  const std::vector<std::string> recipes = split_list(args.get("recipes", "bf16,fp8_linear,fp8_kv,fp8_attn"));
  FP8RL_CHECK(!recipes.empty(), "--recipes is empty (expected a comma-separated list)");
  for (auto& r : recipes) recipe_precision(r);  // reject unknown names before any work
  ModelConfig mc = model_shape(model);
  if (args.has("layers")) mc = model_shape_cut(mc, args.get_int("layers", mc.num_layers, 1));
  FP8RL_CHECK(w.prompt_len + w.gen_len <= mc.max_position_embeddings, "--prompt-len + --gen-len = ",
              w.prompt_len + w.gen_len, " exceeds the model's ", mc.max_position_embeddings, " positions");

  // The workload: random prompt ids (the model is random too).
  std::vector<RolloutRequest> reqs(w.prompts);
  std::mt19937_64 rng(w.seed);
  std::uniform_int_distribution<int32_t> tok(0, mc.vocab_size - 1);
  for (auto& r : reqs)
    for (int t = 0; t < w.prompt_len; ++t) r.prompt.push_back(tok(rng));

  {
    std::unique_ptr<Backend> be = make_backend(device);
    w.copy_bw = copy_bandwidth(*be);
    std::printf("bench generate: %s, model %s (D=%d L=%d H=%d/%d hd=%d F=%d V=%d %s), %d prompts x %d tokens + %d "
                "new, warmup %d; copy bandwidth %.0f GB/s, peak %.0f GB/s\n",
                be->name().c_str(), model.c_str(), mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads,
                mc.head_dim, mc.intermediate_size, mc.vocab_size, mc.tie_word_embeddings ? "tied" : "untied",
                w.prompts, w.prompt_len, w.gen_len, w.warmup, w.copy_bw / 1e9, w.peak_bw / 1e9);
  }
  nlohmann::json out;
  out["device"] = device;
  out["model"] = {{"name", model},           {"hidden", mc.hidden_size},   {"layers", mc.num_layers},
                  {"heads", mc.num_heads},   {"kv_heads", mc.num_kv_heads}, {"head_dim", mc.head_dim},
                  {"ffn", mc.intermediate_size}, {"vocab", mc.vocab_size}, {"tied", mc.tie_word_embeddings}};
  if (mc.is_moe())
    out["model"]["moe"] = {{"experts", mc.num_experts}, {"top_k", mc.num_experts_per_tok},
                           {"expert_ffn", mc.moe_intermediate_size}, {"shared_experts", mc.n_shared_experts},
                           {"router", mc.moe_router}};
  if (mc.is_mla()) out["model"]["mla"] = {{"kv_lora_rank", mc.kv_lora_rank}, {"q_lora_rank", mc.q_lora_rank}};
  out["workload"] = {{"prompts", w.prompts}, {"prompt_len", w.prompt_len}, {"gen_len", w.gen_len},
                     {"warmup", w.warmup},   {"seed", w.seed},             {"temperature", 1.0},
                     {"kv_fraction", w.kv_fraction}, {"page_size", kPageSize}};
  out["copy_bw_Bps"] = w.copy_bw;
  out["peak_bw_Bps"] = w.peak_bw;
  out["recipes"] = nlohmann::json::array();

  std::printf("%-11s %8s %10s %9s %9s %10s %9s %7s %7s %8s %7s %7s\n", "recipe", "wall s", "tok/s", "prefill s",
              "decode s", "dec tok/s", "roofl s", "%peak", "%copy", "wts GiB", "KV GiB", "act GiB");
  // A recipe that fails is recorded and the others still run; the JSON is rewritten after every
  // recipe so that a run cut short by a time limit keeps what it measured.
  int failed = 0;
  for (const std::string& r : recipes) {
    std::fflush(stdout);
    nlohmann::json j;
    try {
      j = run_recipe(device, r, mc, w, reqs);
    } catch (const std::exception& e) {
      std::printf("%-11s failed: %s\n", r.c_str(), e.what());
      out["recipes"].push_back({{"recipe", r}, {"error", e.what()}});
      failed++;
      continue;
    }
    print_row(r, j);
    out["recipes"].push_back(std::move(j));
    if (args.has("json")) write_file_atomic(args.get("json"), out.dump(2) + "\n");
  }
  if (args.has("json")) {
    write_file_atomic(args.get("json"), out.dump(2) + "\n");
    std::printf("wrote %s\n", args.get("json").c_str());
  }
  return failed ? 1 : 0;
}

const Register kRegister{"bench-generate",
                         "rollout tokens/s and decode roofline on a random 8B/1B Llama (also: fp8rl bench generate)",
                         run_bench_generate};

}  // namespace
}  // namespace fp8rl::cli
