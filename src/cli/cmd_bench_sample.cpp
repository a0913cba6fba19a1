// fp8rl bench sample: the sampler alone at a decode step's shape (issue 14). Times
// Backend::sample_rows — the Gumbel-max draw (plain temperature), greedy, and top-k / top-p
// rows (the radix kernel) — and the inverse-CDF sample() on the same random F32 logits
// [rows, vocab], reports milliseconds per call (median of --reps after warm-up) and the rate
// at which the logits are read, against the time of one read at --peak-bw.
//
//   fp8rl bench sample [--device cuda|cpu] [--rows 256] [--vocab 151936] [--valid-vocab 151669]
//                      [--reps 20] [--peak-bw 4.8e12] [--json PATH]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/fs.h"

namespace fp8rl::cli {
namespace {

constexpr const char* kUsage =
    "usage: fp8rl bench sample [--device cuda|cpu] [--rows N] [--vocab N] [--valid-vocab N] [--reps N]\n"
    "                          [--peak-bw B/s] [--json PATH]\n"
    "The sampler alone on random F32 logits [rows, vocab] (defaults: cuda, the Qwen3 RL decode step:\n"
    "256 rows, vocab 151936, valid_vocab 151669): sample_rows with plain temperature (Gumbel-max),\n"
    "greedy, top-k 50 and top-p 0.9 rows, and the inverse-CDF sample(); ms per call (median) and the\n"
    "logits' read rate against one read at --peak-bw (4.8e12, H200).\n";

double median_ms(Backend& be, int reps, const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    be.synchronize();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int run_bench_sample(const std::vector<std::string>& argv) {
  const Args args(argv, {"device", "rows", "vocab", "valid-vocab", "reps", "peak-bw", "json"}, {"help"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  FP8RL_CHECK(args.positional().empty(), "unexpected argument '", args.positional().front(), "'\n", kUsage);
  const std::string device = args.get("device", "cuda");
  const int64_t B = args.get_int("rows", 256, 1), V = args.get_int("vocab", 151936, 1);
  const int64_t Vv = args.get_int64("valid-vocab", std::min<int64_t>(V, 151669), 0, V);
  const int reps = args.get_int("reps", 20, 1);
  const double peak_bw = args.get_float("peak-bw", 4.8e12, 1.0, 1e15);
  std::unique_ptr<Backend> be = make_backend(device);

  // Logits like a language model's: N(0, 3) with one clear favourite per row.
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  Tensor host = Tensor::empty({B, V}, DType::F32);
  float* x = host.data<float>();
  for (int64_t i = 0; i < B * V; ++i) x[i] = nd(gen);
  for (int64_t b = 0; b < B; ++b) x[b * V + (b * 7919) % std::max<int64_t>(Vv, 1)] += 15.0f;
  const Tensor logits = be->to_device(host);
  Tensor tokens = be->alloc({B}, DType::I32), logp = be->alloc({B}, DType::F32);

  auto rows_of = [&](float temperature, int top_k, float top_p) {
    std::vector<SampleRow> rows(B);
    for (int64_t b = 0; b < B; ++b) {
      rows[b].temperature = temperature, rows[b].top_k = top_k, rows[b].top_p = top_p, rows[b].uniform = 0.5f;
      rows[b].key_lo = static_cast<uint32_t>(b), rows[b].counter = 1000;
    }
    Tensor t = Tensor::empty({B, 8}, DType::I32);
    std::memcpy(t.raw(), rows.data(), rows.size() * sizeof(SampleRow));
    return be->to_device(t);
  };
  const double read_ms = static_cast<double>(B) * V * sizeof(float) / peak_bw * 1e3;
  std::printf("bench sample: %s, %lld rows x %lld ids (valid %lld): one read of the F32 logits = %.1f MB, %.4f ms "
              "at %.0f GB/s\n",
              be->name().c_str(), static_cast<long long>(B), static_cast<long long>(V), static_cast<long long>(Vv),
              static_cast<double>(B) * V * 4 / 1e6, read_ms, peak_bw / 1e9);
  std::printf("%-28s %10s %10s %8s\n", "sampler", "ms", "GB/s", "x read");
  nlohmann::json out = {{"device", device}, {"rows", B}, {"vocab", V}, {"valid_vocab", Vv}, {"reps", reps},
                        {"peak_bw_Bps", peak_bw}, {"read_ms", read_ms}};
  out["samplers"] = nlohmann::json::array();
  auto report = [&](const std::string& name, double ms) {
    const double gbps = static_cast<double>(B) * V * 4 / (ms * 1e-3) / 1e9;
    std::printf("%-28s %10.4f %10.0f %8.1f\n", name.c_str(), ms, gbps, ms / read_ms);
    out["samplers"].push_back({{"name", name}, {"ms", ms}, {"logits_GBps", gbps}, {"x_read", ms / read_ms}});
  };
  struct Case {
    const char* name;
    float temperature;
    int top_k;
    float top_p;
  };
  for (const Case& c : {Case{"sample_rows gumbel T=1", 1.0f, 0, 1.0f}, Case{"sample_rows gumbel T=0.7", 0.7f, 0, 1.0f},
                        Case{"sample_rows greedy", 0.0f, 0, 1.0f}, Case{"sample_rows top-k 50", 1.0f, 50, 1.0f},
                        Case{"sample_rows top-p 0.9", 1.0f, 0, 0.9f}}) {
    const Tensor rows = rows_of(c.temperature, c.top_k, c.top_p);
    const bool truncation = c.top_k > 0 || c.top_p < 1.0f;
    report(c.name, median_ms(*be, reps, [&] { be->sample_rows(logits, rows, truncation, tokens, logp, Vv); }));
  }
  const std::vector<float> temp(B, 1.0f), top_p(B, 1.0f), u(B, 0.5f);
  const std::vector<int> top_k(B, 0);
  report("sample (inverse CDF) T=1",
         median_ms(*be, reps, [&] { be->sample(logits, temp, top_p, top_k, u, tokens, logp, Vv); }));
  if (args.has("json")) {
    write_file_atomic(args.get("json"), out.dump(2) + "\n");
    std::printf("wrote %s\n", args.get("json").c_str());
  }
  return 0;
}

const Register kRegister{"bench-sample", "the sampler alone at a decode step's shape (also: fp8rl bench sample)",
                         run_bench_sample};

}  // namespace
}  // namespace fp8rl::cli
