// fp8rl bench <what> [options]: one entry point for the benchmarks, as issue #6 spells them
// (`fp8rl bench generate`). Dispatches to the subcommand registered as "bench-<what>"
// (bench-generate, bench-sample, bench-gemm, bench-train-step, bench-tokenize), which keep working under
// their dashed names.
#include <algorithm>
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"

namespace fp8rl::cli {
namespace {

std::vector<std::string> bench_names() {
  std::vector<std::string> names;
  for (auto& c : registry())
    if (c.name.rfind("bench-", 0) == 0) names.push_back(c.name.substr(6));
  std::sort(names.begin(), names.end());
  return names;
}

int run_bench_dispatch(const std::vector<std::string>& argv) {
  std::string known;
  for (auto& n : bench_names()) known += " " + n;
  if (argv.empty() || argv[0] == "--help" || argv[0] == "-h") {
    std::printf("usage: fp8rl bench <benchmark> [options]; benchmarks:%s\n"
                "'fp8rl bench <benchmark> --help' for its options.\n",
                known.c_str());
    return argv.empty() ? 2 : 0;
  }
  const std::string target = "bench-" + argv[0];
  // Copy the function out: running it must not depend on the registry staying put.
  CommandFn fn;
  for (auto& c : registry())
    if (c.name == target) fn = c.run;
  if (!fn) FP8RL_FAIL("unknown benchmark '", argv[0], "' (known:", known, ")");
  return fn(std::vector<std::string>(argv.begin() + 1, argv.end()));
}

const Register kRegister{"bench", "benchmarks: bench rl-step | generate | sample | gemm | train-step | tokenize", run_bench_dispatch};

}  // namespace
}  // namespace fp8rl::cli
