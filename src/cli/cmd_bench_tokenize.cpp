// fp8rl bench-tokenize --tokenizer PATH --file F [--repeat N]
// Encodes the whole file (single thread, fresh tokenizer so the word cache starts cold) and
// prints one JSON line: {"bytes","tokens","seconds","mb_per_s","tokens_per_s"}. With
// --repeat N the best of N runs is reported (each run on a freshly loaded tokenizer).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl::cli {
namespace {

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"tokenizer", "file", "repeat"}, {"help"});
  if (args.has("help")) {
    std::printf("usage: fp8rl bench tokenize --tokenizer PATH --file TEXT [--repeat N]\n"
                "  Times single-thread encoding of TEXT (best of N loads + encodes); prints JSON.\n");
    return 0;
  }
  const std::string file = args.require("file");
  std::ifstream f(file, std::ios::binary);
  FP8RL_CHECK(f.good(), "cannot open --file ", file);
  std::ostringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  const int repeat = args.get_int("repeat", 1, 1);
  double best = 1e30;
  size_t tokens = 0;
  for (int r = 0; r < repeat; ++r) {
    const Tokenizer tok = Tokenizer::load(args.require("tokenizer"));
    const auto t0 = std::chrono::steady_clock::now();
    tokens = tok.encode(text).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  nlohmann::json j = {{"bytes", text.size()},
                      {"tokens", tokens},
                      {"seconds", best},
                      {"mb_per_s", double(text.size()) / 1e6 / best},
                      {"tokens_per_s", double(tokens) / best}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

Register reg{"bench-tokenize", "time single-thread encoding of a text file (JSON result)", run};

}  // namespace
}  // namespace fp8rl::cli
