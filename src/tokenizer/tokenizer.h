// Tokenizer: HF `tokenizer.json` byte-level BPE (GPT-2 / Llama 3 / Qwen family).
//
// Supported (anything else is refused at load with the unsupported type/key named):
//   normalizer     null, NFC, NFD, NFKC, NFKD (utf8proc), Sequence of these
//   pre_tokenizer  Split (Regex or String pattern; behavior Isolated or Removed; invert
//                  false), ByteLevel (add_prefix_space, use_regex), Sequence of these
//   model          BPE with merges spelled "a b" or ["a","b"]; ignore_merges; no dropout,
//                  no continuing_subword_prefix/end_of_word_suffix, no byte_fallback
//   decoder        ByteLevel (or null); post_processor is ignored (no BOS is ever added)
//   added_tokens   matched before the normalizer and BPE, leftmost-longest; `special`
//                  tokens only when encode(..., allow_special=true); lstrip/rstrip honored
// Regexes run on PCRE2 (JIT, UTF + UCP). Encode requires valid UTF-8. decode() returns the
// raw bytes of the tokens: decode(encode(s)) == s for every valid UTF-8 s; a slice of ids
// that cuts a multi-byte char yields the partial bytes (no U+FFFD replacement).
// A Tokenizer is cheap to copy (shared immutable state) and safe to use from many threads.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl {

class Tokenizer {
 public:
  // `path`: a tokenizer.json file or a directory holding one. A tokenizer_config.json
  // next to it, if any, supplies eos/bos/pad tokens and the chat template text.
  static Tokenizer load(const std::string& path);
  // From the text of a tokenizer.json (and optionally of tokenizer_config.json);
  // `origin` names the source in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             const std::string& origin = "<memory>");

  // Token ids of UTF-8 `text` (throws on invalid UTF-8). No BOS/EOS is added.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;
  // Bytes of the tokens, concatenated. Throws on an id that names no token.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  // decode() that never throws: an id the tokenizer has no token for (negative, past its size,
  // or a hole in its ids; e.g. a padded model vocabulary's extra rows) becomes U+FFFD. For
  // text made in the middle of a run (rewards, validation, `fp8rl generate`).
  std::string decode_lossy(std::span<const int32_t> ids, bool skip_special = false) const;
  bool can_decode(int32_t id) const;  // decode() accepts id

  int32_t token_to_id(std::string_view token) const;  // -1 if absent
  std::string id_to_token(int32_t id) const;          // vocab spelling; throws if absent
  int32_t vocab_size() const;                         // 1 + the largest id
  bool is_special(int32_t id) const;                  // an added token marked special

  int32_t eos_id() const;  // from tokenizer_config.json, else a known end token; -1 if none
  int32_t bos_id() const;  // -1 if none
  int32_t pad_id() const;  // -1 if none (callers may fall back to eos)
  const std::string& chat_template_text() const;  // tokenizer_config.json's, or empty

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace fp8rl
