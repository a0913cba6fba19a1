// Tokenizer: golden ids against the reference HF tokenizer, round trips, special tokens,
// malformed / unsupported tokenizer.json files.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl {
namespace {

// FP8RL_SHARED_DATA is <repo>/../shared/data; a worktree elsewhere sets the environment
// variable FP8RL_SHARED_DATA to override it.
std::string shared_data() {
  const char* env = std::getenv("FP8RL_SHARED_DATA");
  return env && *env ? env : FP8RL_SHARED_DATA;
}
const std::string kQwen = shared_data() + "/tokenizers/qwen3";
const std::string kTiny = std::string(FP8RL_TEST_DATA) + "/tokenizers/tiny";

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// golden.inp: strings each followed by "\n__ggml_vocab_test__\n" (llama.cpp's format: the
// file starts with the first string and ends with a separator). golden.out: one line of
// space-separated ids per string.
struct Golden {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
};

Golden read_golden(const std::string& dir) {
  Golden g;
  const std::string inp = slurp(dir + "/golden.inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  size_t pos = 0;
  while (pos < inp.size()) {
    const size_t end = inp.find(sep, pos);
    EXPECT_NE(end, std::string::npos) << "golden.inp must end with a separator line";
    if (end == std::string::npos) break;
    g.texts.push_back(inp.substr(pos, end - pos));
    pos = end + sep.size();
  }
  std::istringstream out(slurp(dir + "/golden.out"));
  std::string line;
  while (std::getline(out, line)) {
    std::istringstream ls(line);
    std::vector<int32_t> row;
    int32_t v;
    while (ls >> v) row.push_back(v);
    g.ids.push_back(row);
  }
  return g;
}

const Tokenizer& qwen() {
  static const Tokenizer t = Tokenizer::load(kQwen);
  return t;
}

void expect_golden(const Tokenizer& tok, const std::string& dir, size_t min_cases) {
  const Golden g = read_golden(dir);
  ASSERT_EQ(g.texts.size(), g.ids.size());
  ASSERT_GE(g.texts.size(), min_cases);
  int failures = 0;
  for (size_t i = 0; i < g.texts.size(); ++i) {
    const std::vector<int32_t> ids = tok.encode(g.texts[i]);
    EXPECT_EQ(ids, g.ids[i]) << "case " << i << ": '" << g.texts[i] << "'";
    failures += ids != g.ids[i];
    EXPECT_EQ(tok.decode(ids), g.texts[i]) << "round trip of case " << i;
  }
  EXPECT_EQ(failures, 0);
}

TEST(Tokenizer, QwenGoldenAllCases) { expect_golden(qwen(), kQwen, 46); }

}  // namespace
}  // namespace fp8rl
