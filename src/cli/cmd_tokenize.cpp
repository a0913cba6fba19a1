// fp8rl tokenize --tokenizer PATH [--decode]
//   encode: reads ALL of stdin byte for byte (nothing stripped) as UTF-8 and prints the ids
//           space-separated on one line (no BOS added; special tokens in the text are matched).
//   decode: reads whitespace-separated ids from stdin and prints their bytes exactly.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl::cli {
namespace {

std::string read_stdin() {
  std::string s;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, stdin)) > 0) s.append(buf, n);
  FP8RL_CHECK(!std::ferror(stdin), "failed to read stdin");
  return s;
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    FP8RL_CHECK(used == word.size() && v >= 0 && v <= INT32_MAX, "'", word,
                "' is not a token id: --decode reads non-negative integers separated by spaces");
    ids.push_back(int32_t(v));
  }
  return ids;
}

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"tokenizer"}, {"decode", "skip-special", "help"});
  if (args.has("help")) {
    std::fprintf(stderr,
                 "usage: fp8rl tokenize --tokenizer PATH [--decode [--skip-special]] < input\n"
                 "  PATH: tokenizer.json or a directory holding one\n"
                 "  encode: stdin (all bytes, UTF-8) -> ids on one line\n"
                 "  --decode: ids on stdin -> text, printed exactly\n");
    return 0;
  }
  FP8RL_CHECK(args.positional().empty(), "unexpected argument '", args.positional()[0], "'");
  const Tokenizer tok = Tokenizer::load(args.require("tokenizer"));
  const std::string input = read_stdin();
  if (args.has("decode")) {
    const std::string text = tok.decode(parse_ids(input), args.has("skip-special"));
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else {
    FP8RL_CHECK(!args.has("skip-special"), "--skip-special only applies with --decode");
    const std::vector<int32_t> ids = tok.encode(input);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
  }
  FP8RL_CHECK(std::fflush(stdout) == 0, "failed to write stdout");
  return 0;
}

Register reg{"tokenize", "text <-> token ids with a tokenizer.json", run};

}  // namespace
}  // namespace fp8rl::cli
