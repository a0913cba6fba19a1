// Tokenizer: golden ids against the reference HF tokenizer, round trips, special tokens,
// malformed / unsupported tokenizer.json files.
#include <gtest/gtest.h>
#include <utf8proc.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>

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
const std::string kTokData = std::string(FP8RL_TEST_DATA) + "/tokenizers";

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

Golden read_golden(const std::string& inp_path, const std::string& out_path) {
  Golden g;
  const std::string inp = slurp(inp_path);
  const std::string sep = "\n__ggml_vocab_test__\n";
  size_t pos = 0;
  while (pos < inp.size()) {
    const size_t end = inp.find(sep, pos);
    EXPECT_NE(end, std::string::npos) << "golden.inp must end with a separator line";
    if (end == std::string::npos) break;
    g.texts.push_back(inp.substr(pos, end - pos));
    pos = end + sep.size();
  }
  std::istringstream out(slurp(out_path));
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

std::string nfc(const std::string& s) {
  utf8proc_uint8_t* out = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
  std::string r(reinterpret_cast<char*>(out));
  std::free(out);
  return r;
}

const Tokenizer& qwen() {
  static const Tokenizer t = Tokenizer::load(kQwen);
  return t;
}

void expect_golden(const Tokenizer& tok, const std::string& inp, const std::string& out,
                   size_t min_cases, bool round_trip = true) {
  const Golden g = read_golden(inp, out);
  ASSERT_EQ(g.texts.size(), g.ids.size());
  ASSERT_GE(g.texts.size(), min_cases);
  int failures = 0;
  for (size_t i = 0; i < g.texts.size(); ++i) {
    const std::vector<int32_t> ids = tok.encode(g.texts[i]);
    EXPECT_EQ(ids, g.ids[i]) << "case " << i << ": '" << g.texts[i] << "'";
    failures += ids != g.ids[i];
    if (round_trip) {
      EXPECT_EQ(tok.decode(ids), nfc(g.texts[i])) << "round trip of case " << i;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Tokenizer, QwenGoldenAllCases) {
  expect_golden(qwen(), kQwen + "/golden.inp", kQwen + "/golden.out", 46);
}

}  // namespace
}  // namespace fp8rl

namespace fp8rl {
namespace {

using nlohmann::json;

TEST(Tokenizer, TinyHandWrittenGolden) {
  // Ids from the HF `tokenizers` package (tests/data/tokenizers/make_tiny.py).
  expect_golden(Tokenizer::load(kTokData + "/tiny"), kTokData + "/golden.inp",
                kTokData + "/tiny/golden.out", 20);
  expect_golden(Tokenizer::load(kTokData + "/tiny_gpt2/tokenizer.json"), kTokData + "/golden.inp",
                kTokData + "/tiny_gpt2/golden.out", 20, /*round_trip=*/false);  // adds a prefix space
}

TEST(Tokenizer, MergeSpellingsGiveSameIds) {
  json j = json::parse(slurp(kTokData + "/tiny/tokenizer.json"));
  json& merges = j["model"]["merges"];
  ASSERT_GT(merges.size(), 10u);
  for (size_t i = 0; i < merges.size(); i += 2) {  // every other merge as ["a", "b"]
    const std::string s = merges[i].get<std::string>();
    const size_t sp = s.find(' ');
    merges[i] = json::array({s.substr(0, sp), s.substr(sp + 1)});
  }
  const Tokenizer mixed = Tokenizer::from_json(j.dump());
  const Tokenizer plain = Tokenizer::load(kTokData + "/tiny");
  const std::string text = " hello  world\n\nthe answer is 12.\n#### 12 testing café";
  EXPECT_EQ(mixed.encode(text), plain.encode(text));
  EXPECT_GT(plain.encode(text).size(), 5u);
}

// The NFC normalizer composes: text and its NFC form give the same ids (and so
// decode(encode(s)) == NFC(s); the round trip is exact for NFC text).
TEST(Tokenizer, NormalizesToNfc) {
  EXPECT_EQ(qwen().encode("cafe\xCC\x81 Ame\xCC\x81lie"), qwen().encode("caf\xC3\xA9 Am\xC3\xA9lie"));
  EXPECT_EQ(qwen().decode(qwen().encode("e\xCC\x81")), "\xC3\xA9");
}

// Random valid NFC UTF-8: ASCII, Latin, CJK, emoji, combining marks, whitespace, specials.
std::string random_text(std::mt19937& rng, size_t n_chars) {
  static const std::vector<std::string> pieces = {
      "a", "Z", "7", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "é", "ß", "日本",
      "\xF0\x9F\x98\x80", "\xE2\x80\xAF", "\xC2\xA0", "$1,000", "-3.5", "<|im_start|>", "<|im_end|>",
      "<think>", "<|", "|>", "####", "\\boxed{42}", "\xE1\x9E\x80", "\xD0\xBF"};
  std::string s;
  for (size_t i = 0; i < n_chars; ++i) s += pieces[rng() % pieces.size()];
  return s;
}

TEST(Tokenizer, RoundTripRandomText) {
  std::mt19937 rng(1234);
  const Tokenizer tiny = Tokenizer::load(kTokData + "/tiny");
  for (int it = 0; it < 200; ++it) {
    const std::string s = random_text(rng, rng() % 60);
    for (const Tokenizer* t : {&qwen(), &tiny}) {
      EXPECT_EQ(t->decode(t->encode(s)), s);
      EXPECT_EQ(t->decode(t->encode(s, /*allow_special=*/false)), s);
    }
  }
  // Every single byte value that forms valid UTF-8 on its own, and long runs (heap merge path).
  for (int b = 0; b < 128; ++b) {
    const std::string s(1, char(b));
    EXPECT_EQ(qwen().decode(qwen().encode(s)), s);
  }
  const std::string run(300, ' '), digits(500, '9'), word(200, 'a');
  for (const std::string& s : {run, digits, word, run + word + run}) {
    EXPECT_EQ(qwen().decode(qwen().encode(s)), s);
    EXPECT_EQ(tiny.decode(tiny.encode(s)), s);
  }
}

TEST(Tokenizer, SpecialTokens) {
  const Tokenizer& t = qwen();
  const int32_t im_start = t.token_to_id("<|im_start|>"), im_end = t.token_to_id("<|im_end|>");
  ASSERT_GE(im_start, 0);
  ASSERT_GE(im_end, 0);
  EXPECT_TRUE(t.is_special(im_start));
  EXPECT_EQ(t.eos_id(), im_end);  // tokenizer_config.json: eos_token <|im_end|>
  EXPECT_EQ(t.pad_id(), t.token_to_id("<|endoftext|>"));
  EXPECT_EQ(t.bos_id(), -1);
  const std::string text = "<|im_start|>user\nhi<|im_end|>";
  const std::vector<int32_t> with = t.encode(text);
  ASSERT_EQ(with.front(), im_start);
  ASSERT_EQ(with.back(), im_end);
  // allow_special=false: the markers are plain text, split by BPE.
  const std::vector<int32_t> without = t.encode(text, false);
  EXPECT_EQ(std::count(without.begin(), without.end(), im_start), 0);
  EXPECT_GT(without.size(), with.size());
  EXPECT_EQ(t.decode(without), text);
  // <think> is an added but non-special token: matched either way, not skipped in decode.
  const int32_t think = t.token_to_id("<think>");
  ASSERT_GE(think, 0);
  EXPECT_FALSE(t.is_special(think));
  EXPECT_EQ(t.encode("<think>", false), std::vector<int32_t>{think});
  EXPECT_EQ(t.decode(t.encode("<|im_start|>a<think>b<|im_end|>"), /*skip_special=*/true), "a<think>b");
  // Longest match wins; a prefix of a special token is plain text.
  EXPECT_EQ(t.decode(t.encode("<|im_start")), "<|im_start");
  const std::vector<int32_t> partial = t.encode("<|im_start");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), im_start), 0);
}

TEST(Tokenizer, BadInputIsAnError) {
  const Tokenizer& t = qwen();
  for (const std::string& bad : {std::string("\xFF"), std::string("ab\xC3"), std::string("\xC0\xAF"),
                                 std::string("\xED\xA0\x80"), std::string("x\x80y")})
    EXPECT_THROW(t.encode(bad), Error) << bad.size();
  EXPECT_THROW(t.decode(std::vector<int32_t>{-1}), Error);
  EXPECT_THROW(t.decode(std::vector<int32_t>{t.vocab_size()}), Error);
  EXPECT_THROW(t.id_to_token(1 << 30), Error);
  EXPECT_EQ(t.token_to_id("no such token, surely"), -1);
  EXPECT_THROW(Tokenizer::load("/nonexistent/dir"), Error);
}

// Each mutation of a valid tokenizer.json must be refused with a message naming the problem.
TEST(Tokenizer, MalformedOrUnsupportedJsonCorpus) {
  const std::string good = slurp(kTokData + "/tiny/tokenizer.json");
  ASSERT_NO_THROW(Tokenizer::from_json(good));
  struct Case {
    std::string name, expect;
    std::function<void(json&)> mutate;
  };
  const std::vector<Case> cases = {
      {"normalizer", "Lowercase", [](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }},
      {"pre_tokenizer", "Whitespace", [](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }},
      {"no ByteLevel", "ByteLevel",
       [](json& j) { j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0]; }},
      {"Split behavior", "MergedWithNext",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext"; }},
      {"bad regex", "PCRE2",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }},
      {"model type", "WordPiece", [](json& j) { j["model"]["type"] = "WordPiece"; }},
      {"byte_fallback", "byte_fallback", [](json& j) { j["model"]["byte_fallback"] = true; }},
      {"dropout", "dropout", [](json& j) { j["model"]["dropout"] = 0.1; }},
      {"suffix", "end_of_word_suffix", [](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }},
      {"decoder", "Metaspace", [](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }},
      {"merge not in vocab", "merge #0", [](json& j) { j["model"]["merges"][0] = "qqq zzz"; }},
      {"merge spelling", "merge #1", [](json& j) { j["model"]["merges"][1] = "abc"; }},
      {"merge array", "merge #2", [](json& j) { j["model"]["merges"][2] = json::array({"a"}); }},
      {"vocab id", "must be an integer in [0, ", [](json& j) { j["model"]["vocab"]["the"] = -5; }},
      {"vocab type", "must be an integer", [](json& j) { j["model"]["vocab"]["the"] = "x"; }},
      {"duplicate id", "two tokens", [](json& j) { j["model"]["vocab"]["zzzz"] = 0; }},
      {"single_word", "single_word", [](json& j) { j["added_tokens"][0]["single_word"] = true; }},
      {"no model", "model", [](json& j) { j.erase("model"); }},
  };
  for (const Case& c : cases) {
    json j = json::parse(good);
    c.mutate(j);
    try {
      Tokenizer::from_json(j.dump(), {}, "case");
      ADD_FAILURE() << c.name << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << c.name << ": " << e.what();
    }
  }
  for (const std::string& text : {std::string(""), std::string("{"), std::string("[1,2]"),
                                  good.substr(0, good.size() / 2), std::string("null")})
    EXPECT_THROW(Tokenizer::from_json(text), Error) << text.substr(0, 20);
}

}  // namespace
}  // namespace fp8rl

#include "tokenizer/bpe.h"

namespace fp8rl {
namespace {

// The heap merge path (long words) and the scan path (short words) agree.
TEST(Bpe, HeapAndScanMergeAgree) {
  bpe::MergeTable m;
  std::mt19937 rng(5);
  int32_t next_id = 8;
  for (int32_t r = 0; r < 40; ++r) {  // random merges over an 8-symbol alphabet and their results
    const int32_t a = int32_t(rng() % next_id), b = int32_t(rng() % next_id);
    m.insert(a, b, r, next_id++);
  }
  for (int it = 0; it < 300; ++it) {
    std::vector<int32_t> w(1 + rng() % 120);
    for (int32_t& x : w) x = int32_t(rng() % 8);
    std::vector<int32_t> a = w, b = w;
    bpe::merge_word(a, m, /*heap_threshold=*/1 << 20);
    bpe::merge_word(b, m, /*heap_threshold=*/0);
    EXPECT_EQ(a, b);
    EXPECT_LT(a.size(), w.size() + 1);
  }
}

// `fp8rl tokenize`: all of stdin byte for byte (final newline kept), exact decode, errors.
struct CliRun {
  int rc;
  std::string out;
};
CliRun run_cli(const std::string& args, const std::string& stdin_bytes) {
  const std::string in = std::filesystem::temp_directory_path() / "fp8rl_tok_in";
  std::ofstream(in, std::ios::binary) << stdin_bytes;
  const std::string cmd = std::string(FP8RL_BINARY) + " tokenize " + args + " < " + in + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

TEST(TokenizeCli, EncodeDecodeContract) {
  const std::string dir = kTokData + "/tiny";
  const Tokenizer tok = Tokenizer::load(dir);
  const std::string text = "the answer\n\n#### 12<|im_end|>\n";
  const CliRun enc = run_cli("--tokenizer " + dir, text);
  ASSERT_EQ(enc.rc, 0);
  std::string expect;
  for (int32_t id : tok.encode(text)) expect += (expect.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(enc.out, expect + "\n");
  const CliRun dec = run_cli("--tokenizer " + dir + "/tokenizer.json --decode", enc.out);
  ASSERT_EQ(dec.rc, 0);
  EXPECT_EQ(dec.out, text);  // exact, final newline included, nothing added
  EXPECT_EQ(run_cli("--tokenizer " + dir, "").out, "\n");
  EXPECT_NE(run_cli("--tokenizer " + dir, "ab\xFF").rc, 0);
  EXPECT_NE(run_cli("--tokenizer " + dir + " --decode", "1 2 999999").rc, 0);
  EXPECT_NE(run_cli("--tokenizer " + dir + " --decode", "1 x").rc, 0);
  EXPECT_NE(run_cli("--tokenizer /nonexistent", "a").rc, 0);
  EXPECT_NE(run_cli("--tokenizer " + kTokData + "/golden.inp", "a").rc, 0);  // not JSON
}

}  // namespace
}  // namespace fp8rl
