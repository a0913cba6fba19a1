// Loading tokenizer.json and the encode/decode pipeline:
//   added tokens -> normalizer -> pre-tokenizer pieces -> (cached) BPE per piece.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/tokenizer.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "io/json_input.h"
#include "tokenizer/bpe.h"
#include "tokenizer/utf8.h"

namespace fp8rl {

using json = nlohmann::json;

namespace {

// GPT-2's pre-tokenizer regex, used by ByteLevel when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr size_t kCacheCapacity = 1 << 18;  // words; further misses are not cached

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using WordCache = std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>;

struct Regex {
  pcre2_code* code = nullptr;
  std::string origin;  // the tokenizer.json it came from, for match-time errors
  explicit Regex(const std::string& pattern, bool literal, const std::string& origin_) : origin(origin_) {
    int err = 0;
    PCRE2_SIZE off = 0;
    const uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err,
                         &off, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      FP8RL_FAIL(origin, ": pre_tokenizer regex does not compile under PCRE2 at offset ", off, ": ",
                 reinterpret_cast<char*>(msg), " (pattern: ", pattern, ")");
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if unavailable
  }
  ~Regex() { pcre2_code_free(code); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
};

// Per-thread PCRE2 match state (match data and a JIT stack large enough for long runs).
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(8, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState s;
  return s;
}

struct PreStep {
  enum Kind { kSplit, kByteLevel } kind = kSplit;
  std::shared_ptr<Regex> regex;  // Split's pattern, or ByteLevel's GPT-2 regex when use_regex
  bool isolated = true;          // Split: Isolated keeps matches; Removed drops them
  bool add_prefix_space = false;
};

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false;
};

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }


// HF Split "Isolated" on one piece: matches and the gaps between them, none empty.
void split_piece(const Regex& re, std::string_view piece, bool isolated,
                 std::vector<std::string_view>& out) {
  MatchState& ms = match_state();
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(piece.data());
  size_t start = 0, prev_end = 0;
  while (start <= piece.size()) {
    const int rc = pcre2_match(re.code, subj, piece.size(), start, PCRE2_NO_UTF_CHECK, ms.data,
                               ms.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      FP8RL_FAIL(re.origin, ": the pre_tokenizer regex failed on a piece of ", piece.size(), " bytes: ",
                 reinterpret_cast<char*>(msg), " (PCRE2 error ", rc,
                 "); the pattern backtracks too much for this input: simplify the regex in tokenizer.json");
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.data);
    const size_t b = ov[0], e = ov[1];
    if (b == e) {  // empty match: not a piece; step one char
      if (b >= piece.size()) break;
      start = b + utf8_seq_len(static_cast<unsigned char>(piece[b]));
      continue;
    }
    if (b > prev_end) out.push_back(piece.substr(prev_end, b - prev_end));
    if (isolated) out.push_back(piece.substr(b, e - b));
    prev_end = start = e;
  }
  if (prev_end < piece.size()) out.push_back(piece.substr(prev_end));
}

}  // namespace

const char* const bpe::kSmallPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string_view> bpe::split_regex(const std::string& pattern, std::string_view text) {
  FP8RL_CHECK(utf8_is_valid(text), "split_regex: text is not valid UTF-8");
  const Regex re(pattern, false, "split_regex");
  std::vector<std::string_view> out;
  split_piece(re, text, true, out);
  return out;
}

// Input limits (docs/design.md "What is validated where").
constexpr size_t kMaxTokenizerJsonBytes = size_t(256) << 20;  // the largest real ones are ~35 MB
constexpr size_t kMaxJsonConfigBytes = size_t(16) << 20;      // tokenizer_config.json
constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;       // 16.7M; real vocabularies are < 300k
constexpr int64_t kTokenIdSlack = 65536;                      // ids may exceed the token count by this

struct Tokenizer::Impl {
  std::string origin;
  int64_t num_tokens = 0;  // vocab entries + added tokens in the file
  int32_t max_id = 0;      // the largest id accepted (min(kMaxTokenId, num_tokens + kTokenIdSlack))
  std::vector<int> normalizers;  // utf8proc option sets, applied in order
  std::vector<PreStep> pre;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab;  // incl. added
  std::vector<std::string> id_token;  // spelling per id ("" where no token)
  std::vector<std::string> id_bytes;  // decoded bytes per id
  std::vector<uint8_t> id_flags;      // 1 = exists, 2 = special
  std::array<int32_t, 256> byte_ids{};
  bpe::MergeTable merges;
  bool ignore_merges = false;
  std::vector<AddedToken> added;
  std::array<std::vector<int>, 256> added_by_byte;  // indices into `added`, longest first
  int32_t eos = -1, bos = -1, pad = -1;
  std::string chat_template;

  mutable std::mutex cache_mutex;
  mutable WordCache cache;

  void encode_segment(std::string_view seg, std::vector<int32_t>& out, WordCache* cache) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out, WordCache* cache) const;
};

// ---- loading -----------------------------------------------------------------------

namespace {

void parse_normalizer(const json& j, Tokenizer::Impl& t) {
  if (j.is_null()) return;
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const json& n : j.at("normalizers")) parse_normalizer(n, t);
  } else if (type == "NFC") {
    t.normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  } else if (type == "NFD") {
    t.normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  } else if (type == "NFKC") {
    t.normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  } else if (type == "NFKD") {
    t.normalizers.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  } else {
    FP8RL_FAIL(t.origin, ": unsupported normalizer type '", type,
               "' (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

void parse_pre_tokenizer(const json& j, Tokenizer::Impl& t) {
  if (j.is_null()) return;
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const json& p : j.at("pretokenizers")) parse_pre_tokenizer(p, t);
  } else if (type == "Split") {
    PreStep s;
    const json& pat = j.at("pattern");
    if (pat.contains("Regex"))
      s.regex = std::make_shared<Regex>(pat.at("Regex").get<std::string>(), false, t.origin);
    else if (pat.contains("String"))
      s.regex = std::make_shared<Regex>(pat.at("String").get<std::string>(), true, t.origin);
    else
      FP8RL_FAIL(t.origin, ": Split pattern must be {\"Regex\": ...} or {\"String\": ...}");
    const std::string behavior = j.at("behavior").get<std::string>();
    if (behavior == "Removed") s.isolated = false;
    else FP8RL_CHECK(behavior == "Isolated", t.origin, ": unsupported Split behavior '", behavior,
                     "' (supported: Isolated, Removed)");
    FP8RL_CHECK(!j.value("invert", false), t.origin, ": unsupported Split key invert=true");
    t.pre.push_back(std::move(s));
  } else if (type == "ByteLevel") {
    PreStep s;
    s.kind = PreStep::kByteLevel;
    s.add_prefix_space = j.value("add_prefix_space", false);
    if (j.value("use_regex", true)) s.regex = std::make_shared<Regex>(kGpt2Pattern, false, t.origin);
    t.pre.push_back(std::move(s));
  } else {
    FP8RL_FAIL(t.origin, ": unsupported pre_tokenizer type '", type,
               "' (supported: Split, ByteLevel, Sequence)");
  }
}

void check_decoder(const json& j, const std::string& origin) {
  FP8RL_CHECK(!j.is_null(), origin, ": decoder is null; only the ByteLevel decoder is supported");
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const json& d : j.at("decoders")) check_decoder(d, origin);
    return;
  }
  FP8RL_CHECK(type == "ByteLevel", origin, ": unsupported decoder type '", type,
              "' (supported: ByteLevel)");
}

// Token ids are dense in real tokenizers (0..N-1 plus a few added tokens): an id far beyond the
// number of tokens would only allocate a huge id table, so it is refused. t.max_id is set from
// the file's token count before any id is read.
int32_t read_token_id(const json& v, const Tokenizer::Impl& t, const std::string& spelling) {
  return static_cast<int32_t>(json_get_int(v, 0, t.max_id, t.origin + ": the id of token '" + spelling +
                                                               "' (this tokenizer has " +
                                                               std::to_string(t.num_tokens) + " tokens)"));
}

void set_token(Tokenizer::Impl& t, int32_t id, const std::string& spelling, const std::string& bytes) {
  FP8RL_CHECK(id >= 0 && id <= t.max_id, t.origin, ": token id ", id, " of '", spelling,
              "' is out of range [0, ", t.max_id, "]");
  if (size_t(id) >= t.id_token.size()) {
    t.id_token.resize(id + 1);
    t.id_bytes.resize(id + 1);
    t.id_flags.resize(id + 1, 0);
  }
  t.id_token[id] = spelling;
  t.id_bytes[id] = bytes;
  t.id_flags[id] |= 1;
}

std::string byte_level_decode(std::string_view token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const size_t len = utf8_seq_len(static_cast<unsigned char>(token[i]));
    int32_t cp = -1;
    utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(token.data() + i),
                     utf8proc_ssize_t(std::min(len, token.size() - i)), &cp);
    const int b = cp >= 0 ? bpe::char_to_byte(uint32_t(cp)) : -1;
    if (b >= 0) out += char(b);
    else out.append(token.substr(i, len));  // not a byte-level char: keep its UTF-8
    i += len;
  }
  return out;
}

void parse_model(const json& m, Tokenizer::Impl& t) {
  const std::string type = m.value("type", "BPE");
  FP8RL_CHECK(type == "BPE", t.origin, ": unsupported model type '", type, "' (supported: BPE)");
  for (auto& [key, val] : m.items()) {
    const bool ok =
        key == "type" || key == "vocab" || key == "merges" || key == "unk_token" ||
        key == "fuse_unk" || key == "ignore_merges" ||
        (key == "dropout" && (val.is_null() || (val.is_number() && val.get<double>() == 0.0))) ||
        ((key == "continuing_subword_prefix" || key == "end_of_word_suffix") &&
         (val.is_null() || val.get<std::string>().empty())) ||
        (key == "byte_fallback" && !val.get<bool>());
    FP8RL_CHECK(ok, t.origin, ": unsupported BPE model key '", key, "' = ", json_brief(val),
                " (only plain byte-level BPE is supported)");
  }
  t.ignore_merges = m.value("ignore_merges", false);
  for (auto& [tok, id] : m.at("vocab").items()) {
    const int32_t i = read_token_id(id, t, tok);
    FP8RL_CHECK(t.vocab.emplace(tok, i).second, t.origin, ": duplicate vocab token ", tok);
    FP8RL_CHECK(size_t(i) >= t.id_flags.size() || !(t.id_flags[i] & 1), t.origin,
                ": vocab id ", i, " is given to two tokens");
    set_token(t, i, tok, byte_level_decode(tok));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = t.vocab.find(bpe::byte_to_char(uint8_t(b)));
    t.byte_ids[b] = it == t.vocab.end() ? -1 : it->second;
  }
  const json& merges = m.at("merges");
  t.merges.reserve(merges.size());
  int32_t rank = 0;
  for (const json& mj : merges) {
    std::string a, b;
    if (mj.is_string()) {
      const std::string s = mj.get<std::string>();
      const size_t sp = s.find(' ');
      FP8RL_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, t.origin,
                  ": merge #", rank, " '", s, "' is not two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      FP8RL_CHECK(mj.is_array() && mj.size() == 2, t.origin, ": merge #", rank,
                  " must be \"a b\" or [\"a\", \"b\"], got ", json_brief(mj));
      a = mj[0].get<std::string>();
      b = mj[1].get<std::string>();
    }
    auto ia = t.vocab.find(a), ib = t.vocab.find(b), iab = t.vocab.find(a + b);
    FP8RL_CHECK(ia != t.vocab.end() && ib != t.vocab.end() && iab != t.vocab.end(), t.origin,
                ": merge #", rank, " (", a, ", ", b, ") uses a token missing from the vocab");
    t.merges.insert(ia->second, ib->second, rank, iab->second);
    ++rank;
  }
}

void parse_added(const json& arr, Tokenizer::Impl& t) {
  if (arr.is_null()) return;
  for (const json& a : arr) {
    AddedToken tok;
    tok.content = a.at("content").get<std::string>();
    tok.id = read_token_id(a.at("id"), t, tok.content);
    tok.special = a.value("special", false);
    tok.lstrip = a.value("lstrip", false);
    tok.rstrip = a.value("rstrip", false);
    FP8RL_CHECK(!a.value("single_word", false), t.origin, ": added token '", tok.content,
                "': unsupported key single_word=true");
    FP8RL_CHECK(!tok.content.empty() && utf8_is_valid(tok.content), t.origin, ": added token id ",
                tok.id, " has empty or invalid UTF-8 content");
    set_token(t, tok.id, tok.content, tok.content);
    if (tok.special) t.id_flags[tok.id] |= 2;
    t.vocab[tok.content] = tok.id;
    t.added.push_back(tok);
  }
  for (size_t i = 0; i < t.added.size(); ++i)
    t.added_by_byte[static_cast<unsigned char>(t.added[i].content[0])].push_back(int(i));
  for (auto& v : t.added_by_byte)
    std::stable_sort(v.begin(), v.end(), [&](int x, int y) {
      return t.added[x].content.size() > t.added[y].content.size();
    });
}

int32_t config_token(const json& cfg, const char* key, const Tokenizer::Impl& t) {
  if (!cfg.contains(key) || cfg[key].is_null()) return -1;
  const json& v = cfg[key];
  const std::string s = v.is_string() ? v.get<std::string>() : v.at("content").get<std::string>();
  auto it = t.vocab.find(s);
  FP8RL_CHECK(it != t.vocab.end(), t.origin, ": tokenizer_config.json ", key, " '", s,
              "' is not a token of tokenizer.json");
  return it->second;
}

void parse_config(std::string_view text, Tokenizer::Impl& t) {
  if (!text.empty()) {
    const json cfg = json_parse_limited(text, t.origin + " (tokenizer_config.json)");
    t.eos = config_token(cfg, "eos_token", t);
    t.bos = config_token(cfg, "bos_token", t);
    t.pad = config_token(cfg, "pad_token", t);
    if (cfg.contains("chat_template")) {
      const json& ct = cfg["chat_template"];
      if (ct.is_string()) {
        t.chat_template = ct.get<std::string>();
      } else if (ct.is_array() && !ct.empty()) {  // [{name, template}]: take "default"
        t.chat_template = ct[0].at("template").get<std::string>();
        for (const json& e : ct)
          if (e.value("name", "") == "default") t.chat_template = e.at("template").get<std::string>();
      }
    }
  }
  if (t.eos < 0) {  // no config: the usual end-of-turn / end-of-text tokens, in this order
    for (const char* s : {"<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"}) {
      auto it = t.vocab.find(s);
      if (it != t.vocab.end()) {
        t.eos = it->second;
        break;
      }
    }
  }
}

const Tokenizer::Impl& checked(const std::shared_ptr<const Tokenizer::Impl>& p) {
  FP8RL_CHECK(p, "Tokenizer used before Tokenizer::load / from_json");
  return *p;
}

}  // namespace

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& origin) {
  auto t = std::make_shared<Impl>();
  t->origin = origin;
  try {
    const json j = json_parse_limited(tokenizer_json, origin, {kMaxTokenizerJsonBytes, 64});
    FP8RL_CHECK(j.is_object(), origin, ": tokenizer.json must be a JSON object");
    FP8RL_CHECK(j.contains("model") && j["model"].is_object() && j["model"].contains("vocab") &&
                    j["model"]["vocab"].is_object(),
                origin, ": tokenizer.json has no 'model' with a 'vocab' object");
    const json& added = j.contains("added_tokens") ? j["added_tokens"] : json();
    t->num_tokens = static_cast<int64_t>(j["model"]["vocab"].size() + (added.is_array() ? added.size() : 0));
    t->max_id = static_cast<int32_t>(std::min<int64_t>(kMaxTokenId, t->num_tokens + kTokenIdSlack));
    parse_normalizer(j.value("normalizer", json()), *t);
    parse_pre_tokenizer(j.value("pre_tokenizer", json()), *t);
    const bool byte_level = std::any_of(t->pre.begin(), t->pre.end(),
                                        [](const PreStep& s) { return s.kind == PreStep::kByteLevel; });
    FP8RL_CHECK(byte_level, origin, ": pre_tokenizer has no ByteLevel step; only byte-level BPE "
                "(GPT-2 / Llama 3 / Qwen family) is supported");
    check_decoder(j.value("decoder", json()), origin);
    parse_model(j.at("model"), *t);
    parse_added(j.value("added_tokens", json()), *t);
    parse_config(config_json, *t);
  } catch (const json::exception& e) {
    FP8RL_FAIL(origin, ": malformed tokenizer.json/tokenizer_config.json: ", e.what());
  }
  Tokenizer tok;
  tok.impl_ = std::move(t);
  return tok;
}

Tokenizer Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  FP8RL_CHECK(fs::is_regular_file(p), "no tokenizer.json at '", path,
              "': pass a tokenizer.json file or a directory holding one");
  const fs::path cfg = p.parent_path() / "tokenizer_config.json";
  const std::string cfg_text =
      fs::is_regular_file(cfg) ? read_file_limited(cfg, kMaxJsonConfigBytes, "tokenizer_config.json") : std::string();
  return from_json(read_file_limited(p, kMaxTokenizerJsonBytes, "tokenizer.json"), cfg_text, p.string());
}

// ---- encoding ------------------------------------------------------------------------

void Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& out,
                                  WordCache* c) const {
  if (word.empty()) return;
  if (c) {
    auto it = c->find(word);
    if (it != c->end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  bool done = false;
  if (ignore_merges) {
    auto it = vocab.find(bpe::bytes_to_byte_level(word));
    if (it != vocab.end()) {
      ids.push_back(it->second);
      done = true;
    }
  }
  if (!done) {
    ids.reserve(word.size());
    for (unsigned char b : word) {
      FP8RL_CHECK(byte_ids[b] >= 0, origin, ": byte 0x", std::hex, int(b),
                  " has no token in the vocab (not a complete byte-level vocab)");
      ids.push_back(byte_ids[b]);
    }
    bpe::merge_word(ids, merges);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (c && c->size() < kCacheCapacity) c->emplace(std::string(word), std::move(ids));
}

void Tokenizer::Impl::encode_segment(std::string_view seg, std::vector<int32_t>& out,
                                     WordCache* c) const {
  // Normalize (skipped for pure-ASCII text, which every normal form leaves unchanged).
  std::string normalized;
  if (!normalizers.empty() &&
      std::any_of(seg.begin(), seg.end(), [](char ch) { return static_cast<unsigned char>(ch) >= 0x80; })) {
    normalized.assign(seg);
    for (int opts : normalizers) {
      utf8proc_uint8_t* dst = nullptr;
      const utf8proc_ssize_t n =
          utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(normalized.data()),
                       utf8proc_ssize_t(normalized.size()), &dst, utf8proc_option_t(opts));
      FP8RL_CHECK(n >= 0, "unicode normalization failed: ", utf8proc_errmsg(n));
      normalized.assign(reinterpret_cast<char*>(dst), size_t(n));
      std::free(dst);
    }
    seg = normalized;
  }
  // Pre-tokenize: each step splits every piece of the previous step.
  std::vector<std::string_view> pieces{seg}, next;
  std::vector<std::unique_ptr<std::string>> arena;  // pieces with a prefix space added
  for (const PreStep& step : pre) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.kind == PreStep::kByteLevel && step.add_prefix_space && !piece.empty() && piece[0] != ' ') {
        arena.push_back(std::make_unique<std::string>(" " + std::string(piece)));
        piece = *arena.back();
      }
      if (!step.regex) {
        next.push_back(piece);
        continue;
      }
      split_piece(*step.regex, piece, step.isolated, next);
    }
    std::swap(pieces, next);
  }
  for (std::string_view w : pieces) encode_word(w, out, c);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  const Impl& t = checked(impl_);
  const size_t bad = utf8_find_invalid(text);
  FP8RL_CHECK(bad == std::string_view::npos, "input text is not valid UTF-8 (byte offset ", bad,
              "); the tokenizer only encodes UTF-8 text");
  std::unique_lock<std::mutex> lock(t.cache_mutex, std::try_to_lock);
  WordCache* cache = lock.owns_lock() ? &t.cache : nullptr;  // busy: encode without the cache
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  size_t seg_start = 0, i = 0;
  while (i < text.size()) {
    const auto& cands = t.added_by_byte[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (int k : cands) {
      const AddedToken& a = t.added[k];
      if ((allow_special || !a.special) && text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;  // candidates are sorted longest first
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t seg_end = i, next = i + hit->content.size();
    if (hit->lstrip)
      while (seg_end > seg_start && is_ascii_space(text[seg_end - 1])) --seg_end;
    if (hit->rstrip)
      while (next < text.size() && is_ascii_space(text[next])) ++next;
    t.encode_segment(text.substr(seg_start, seg_end - seg_start), out, cache);
    out.push_back(hit->id);
    seg_start = i = next;
  }
  t.encode_segment(text.substr(seg_start), out, cache);
  return out;
}

// ---- decoding and lookups ----------------------------------------------------------------

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& t = checked(impl_);
  std::string out;
  for (int32_t id : ids) {
    FP8RL_CHECK(id >= 0 && size_t(id) < t.id_flags.size() && (t.id_flags[id] & 1),
                "cannot decode token id ", id, ": not in the vocabulary (size ", t.id_flags.size(), ")");
    if (skip_special && (t.id_flags[id] & 2)) continue;
    out += t.id_bytes[id];
  }
  return out;
}

std::string Tokenizer::decode_lossy(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& t = checked(impl_);
  std::string out;
  for (int32_t id : ids) {
    if (!(id >= 0 && size_t(id) < t.id_flags.size() && (t.id_flags[id] & 1))) {
      out += "\xEF\xBF\xBD";  // U+FFFD REPLACEMENT CHARACTER
      continue;
    }
    if (skip_special && (t.id_flags[id] & 2)) continue;
    out += t.id_bytes[id];
  }
  return out;
}

bool Tokenizer::can_decode(int32_t id) const {
  const Impl& t = checked(impl_);
  return id >= 0 && size_t(id) < t.id_flags.size() && (t.id_flags[id] & 1);
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = checked(impl_).vocab.find(token);
  return it == checked(impl_).vocab.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  FP8RL_CHECK(id >= 0 && size_t(id) < checked(impl_).id_flags.size() && (checked(impl_).id_flags[id] & 1),
              "token id ", id, " is not in the vocabulary");
  return checked(impl_).id_token[id];
}

int32_t Tokenizer::vocab_size() const { return int32_t(checked(impl_).id_flags.size()); }
bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < checked(impl_).id_flags.size() && (checked(impl_).id_flags[id] & 2);
}
int32_t Tokenizer::eos_id() const { return checked(impl_).eos; }
int32_t Tokenizer::bos_id() const { return checked(impl_).bos; }
int32_t Tokenizer::pad_id() const { return checked(impl_).pad; }
const std::string& Tokenizer::chat_template_text() const { return checked(impl_).chat_template; }

}  // namespace fp8rl
