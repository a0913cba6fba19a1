// JSON from users (tokenizer.json, config.json, safetensors headers, trainer_state.json, JSONL
// lines): parsed with a size limit and a nesting-depth limit checked while parsing, so that no
// input can exhaust the stack (nlohmann's copies, dump() and our own walks recurse per level)
// or memory before it is refused. Errors name the input and say what the limit is.
#pragma once
#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace fp8rl {

struct JsonLimits {
  size_t max_bytes = size_t(64) << 20;  // the whole text
  int max_depth = 64;                   // nested arrays/objects; real files use < 10
};

// Parses `text` (`origin` names it in errors: "DIR/config.json"). Throws fp8rl::Error on
// malformed JSON, on text longer than limits.max_bytes, and as soon as the nesting passes
// limits.max_depth. `on_key(depth, key)` (optional) sees every object key as it is parsed.
nlohmann::json json_parse_limited(std::string_view text, const std::string& origin, const JsonLimits& limits = {},
                                  const std::function<void(int, const std::string&)>& on_key = nullptr);

// A short description of a value for error messages, never a dump of a large or deep one:
// numbers, booleans, null and short strings as JSON; longer strings cut; arrays and objects as
// "an array of N elements" / "an object with N keys" (or their compact text when short and flat).
std::string json_brief(const nlohmann::json& v, size_t max_chars = 80);

// The file's bytes, refusing files larger than `max_bytes` before reading them (`what` names
// the kind of file in the error: "tokenizer.json").
std::string read_file_limited(const std::string& path, size_t max_bytes, const char* what);

// Checked integer access for user JSON: `v` must be an integer (not 300.9, not a string) in
// [lo, hi] (unsigned values above INT64_MAX are out of range, never wrapped). `what` names it.
int64_t json_get_int(const nlohmann::json& v, int64_t lo, int64_t hi, const std::string& what);

}  // namespace fp8rl
