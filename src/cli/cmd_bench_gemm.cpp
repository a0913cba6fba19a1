// fp8rl bench-gemm: TFLOP/s of our BF16 and FP8 block-scaled GEMMs (cuBLASLt) at Llama-3.1-8B
// linear shapes, forward / dgrad / wgrad, plus the quantization kernels in GB/s next to a
// device-to-device copy measured in the same run (bench/gemm_bench.h, in the CUDA library).
// Prints a table; --json PATH writes the numbers.
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
#include "bench/gemm_bench.h"  // a plain C++ header: the body lives in the CUDA library
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

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "reps", "warmup", "device", "shapes"},
            {"help", "quick", "quant-only", "grouped-only", "algos", "lt-search"});
  if (args.has("help")) {
    std::printf(
        "fp8rl bench-gemm [--json PATH] [--reps N] [--warmup N] [--device cuda:N] [--quick] [--quant-only]\n"
        "                 [--shapes MxNxK,...] [--grouped-only] [--algos] [--lt-search]\n"
        "  --shapes: only the forward products C[M, N] = A[M, K] W[N, K]^T of these sizes (e.g. for ncu)\n"
        "  --algos:  also time each of cuBLASLt's heuristic candidates (up to 16) for every product, BF16 and FP8\n"
        "  --lt-search: also time every configuration (tile, stages, split-K, cluster) cuBLASLt accepts of its\n"
        "             first algorithm for every product, BF16 and FP8\n");
    return 0;
  }
  GemmBenchOptions opt;
  opt.reps = args.get_int("reps", 20, 1), opt.warmup = args.get_int("warmup", 5, 0);
  const std::string device = args.get("device", "cuda:0");
  FP8RL_CHECK(device.rfind("cuda", 0) == 0, "bench-gemm needs a CUDA device, got ", device);
  opt.device = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
  opt.quick = args.has("quick");
  opt.quant_only = args.has("quant-only");
  opt.grouped_only = args.has("grouped-only");
  opt.algos = args.has("algos");
  opt.lt_search = args.has("lt-search");
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
  Args args(argv, {"json", "reps", "warmup", "device", "shapes"},
            {"help", "quick", "quant-only", "grouped-only", "algos", "lt-search"});
  if (args.has("help")) {
    std::printf(
        "fp8rl bench-gemm [--json PATH] [--reps N] [--warmup N] [--device cuda:N] [--quick] [--quant-only]\n"
        "                 [--shapes MxNxK,...] [--grouped-only] [--algos] [--lt-search]\n"
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
