// fp8rl bench-gemm: TFLOP/s of our BF16 and FP8 block-scaled GEMMs (cuBLASLt) at Llama-3.1-8B
// linear shapes, forward / dgrad / wgrad, plus the quantization kernels in GB/s next to a
// device-to-device copy measured in the same run (bench/gemm_bench.h, in the CUDA library).
// Prints a table; --json PATH writes the numbers. --mma-probe runs only the wgmma throughput probe
// (bench/cuda/mma_probe.h): the tensor rate of each issue pattern of our FP8 GEMM, MMAs alone.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"

#ifdef FP8RL_HAVE_CUDA
#include "bench/cuda/mma_probe.h"  // plain C++ headers: the bodies live in the CUDA library
#include "bench/gemm_bench.h"
#endif

namespace fp8rl::cli {
namespace {

#ifdef FP8RL_HAVE_CUDA

// "MxNxK,MxNxK": positive sizes, or a user error naming the bad item.
std::vector<std::array<int64_t, 3>> parse_shapes(const std::string& text) {
  std::vector<std::array<int64_t, 3>> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t end = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, end - pos);
    std::array<int64_t, 3> v{};
    size_t at = 0;
    bool ok = !item.empty();
    for (int i = 0; i < 3 && ok; ++i) {
      size_t used = 0;
      try {
        v[i] = std::stoll(item.substr(at), &used);
      } catch (const std::exception&) {
        ok = false;
        break;
      }
      at += used;
      ok = v[i] > 0 && (i == 2 ? at == item.size() : at < item.size() && item[at] == 'x');
      ++at;
    }
    FP8RL_CHECK(ok, "bench-gemm --shapes: '", item, "' is not MxNxK with positive sizes (e.g. 256x2048x2048)");
    out.push_back(v);
    pos = end + 1;
  }
  return out;
}

// --mma-probe: one line per pattern (`mma_probe <name> <TFLOP/s> <ms> check=<ok|FAILED|n/a> <note>`)
// after the device's line; --json PATH writes the same numbers.
int run_mma_probe_lines(int device, int iters, const Args& args) {
  const cuda::MmaProbeReport r = cuda::run_mma_probe(device, iters);
  std::printf(
      "mma_probe device: %s, %d SMs at %.0f MHz (cudaDevAttrClockRate): dense FP8 peak %.1f TFLOP/s "
      "(SMs x clock x 8192 FLOP/clk/SM); %d K blocks of 128 per warpgroup\n",
      r.device.c_str(), r.sms, r.clock_khz / 1e3, r.peak_tflops, r.iters);
  nlohmann::json rows = nlohmann::json::array();
  for (const cuda::MmaProbeResult& p : r.results) {
    const char* check = !p.checked ? "n/a" : p.checked_ok ? "ok" : "FAILED";
    std::printf("mma_probe %s %.1f %.3f check=%s %s\n", p.name.c_str(), p.tflops, p.ms, check, p.note.c_str());
    rows.push_back({{"name", p.name}, {"tflops", p.tflops}, {"ms", p.ms}, {"check", check}, {"note", p.note}});
  }
  if (args.has("json")) {
    const nlohmann::json out = {{"device", r.device},           {"sms", r.sms},     {"clock_khz", r.clock_khz},
                                {"peak_tflops", r.peak_tflops}, {"iters", r.iters}, {"mma_probe", rows}};
    std::ofstream f(args.get("json"));
    FP8RL_CHECK(f.good(), "cannot write ", args.get("json"));
    f << out.dump(2) << "\n";
  }
  return 0;
}

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "reps", "warmup", "device", "shapes", "mma-iters"},
            {"help", "quick", "quant-only", "grouped-only", "algos", "lt-search", "mma-probe", "fast-accum"});
  if (args.has("help")) {
    std::printf(
        "fp8rl bench-gemm [--json PATH] [--reps N] [--warmup N] [--device cuda:N] [--quick] [--quant-only]\n"
        "                 [--shapes MxNxK,...] [--grouped-only] [--algos] [--lt-search] [--fast-accum] [--mma-probe "
        "[--mma-iters N]]\n"
        "  --shapes: only the forward products C[M, N] = A[M, K] W[N, K]^T of these sizes (e.g. for ncu)\n"
        "  --algos:  also time each of cuBLASLt's heuristic candidates (up to 16) for every product, BF16 and FP8\n"
        "  --lt-search: also time every configuration (tile, stages, split-K, cluster) cuBLASLt accepts of its\n"
        "             first algorithm for every product, BF16 and FP8\n"
        "  --fast-accum: also time cuBLASLt's FP8 products with CUBLASLT_MATMUL_DESC_FAST_ACCUM and compare outputs\n"
        "  --mma-probe: only the wgmma throughput probe: TFLOP/s of each E4M3 wgmma issue pattern of our FP8 GEMM\n"
        "             (2 / 3 warpgroups, n128 / n256, promotion, wait_group 1, A in registers, the barrier ring)\n"
        "             on shared-memory tiles filled once, and fed by a TMA ring from L2-resident operands (tiles of\n"
        "             64 / 128 / 192 rows x 128 / 256 columns), against the dense FP8 peak; --mma-iters: K blocks of\n"
        "             128 per warpgroup (TMA patterns: per CTA) per launch (default 16384)\n");
    return 0;
  }
  const std::string device = args.get("device", "cuda:0");
  FP8RL_CHECK(device.rfind("cuda", 0) == 0, "bench-gemm needs a CUDA device, got ", device);
  const int device_index = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
  if (args.has("mma-probe"))
    return run_mma_probe_lines(device_index, args.get_int("mma-iters", 16384, 1, 1 << 24), args);
  GemmBenchOptions opt;
  opt.reps = args.get_int("reps", 20, 1), opt.warmup = args.get_int("warmup", 5, 0);
  opt.device = device_index;
  opt.quick = args.has("quick");
  opt.quant_only = args.has("quant-only");
  opt.grouped_only = args.has("grouped-only");
  opt.algos = args.has("algos");
  opt.lt_search = args.has("lt-search");
  opt.fast_accum = args.has("fast-accum");
  if (args.has("shapes")) opt.shapes = parse_shapes(args.get("shapes"));
  const nlohmann::json out = bench_gemm_run(opt);
  if (args.has("json")) {
    std::ofstream f(args.get("json"));
    FP8RL_CHECK(f.good(), "cannot write ", args.get("json"));
    f << out.dump(2) << "\n";
  }
  return 0;
}

#else

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "reps", "warmup", "device", "shapes", "mma-iters"},
            {"help", "quick", "quant-only", "grouped-only", "algos", "lt-search", "mma-probe", "fast-accum"});
  if (args.has("help")) {
    std::printf(
        "fp8rl bench-gemm [--json PATH] [--reps N] [--warmup N] [--device cuda:N] [--quick] [--quant-only]\n"
        "                 [--shapes MxNxK,...] [--grouped-only] [--algos] [--lt-search] [--fast-accum] [--mma-probe "
        "[--mma-iters N]]\n"
        "  (needs the CUDA backend; this build has none)\n");
    return 0;
  }
  FP8RL_FAIL(
      "bench-gemm needs the CUDA backend; this fp8rl was built without CUDA (rebuild with -DFP8RL_CUDA=ON on a "
      "machine with nvcc)");
}

#endif

Register reg{"bench-gemm", "time our BF16 / FP8 block GEMMs and quantizers on the GPU", run};

}  // namespace
}  // namespace fp8rl::cli
