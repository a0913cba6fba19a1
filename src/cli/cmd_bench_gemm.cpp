// fp8rl bench-gemm: TFLOP/s of our BF16 and FP8 block-scaled GEMMs (cuBLASLt) at Llama-3.1-8B
// linear shapes, forward / dgrad / wgrad, plus the quantization kernels in GB/s next to a
// device-to-device copy measured in the same run (bench/gemm_bench.h, in the CUDA library).
// Prints a table; --json PATH writes the numbers.
#include <algorithm>
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

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "reps", "warmup", "device"}, {"help", "quick", "quant-only"});
  if (args.has("help")) {
    std::printf("fp8rl bench-gemm [--json PATH] [--reps N] [--warmup N] [--device cuda:N] [--quick] [--quant-only]\n");
    return 0;
  }
  GemmBenchOptions opt;
  opt.reps = args.get_int("reps", 20, 1), opt.warmup = args.get_int("warmup", 5, 0);
  const std::string device = args.get("device", "cuda:0");
  FP8RL_CHECK(device.rfind("cuda", 0) == 0, "bench-gemm needs a CUDA device, got ", device);
  opt.device = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
  opt.quick = args.has("quick");
  opt.quant_only = args.has("quant-only");
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
  Args args(argv, {"json", "reps", "warmup", "device"}, {"help", "quick", "quant-only"});
  if (args.has("help")) {
    std::printf(
        "fp8rl bench-gemm [--json PATH] [--reps N] [--warmup N] [--device cuda:N] [--quick] [--quant-only]\n"
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
