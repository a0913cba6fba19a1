#include "io/json_input.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace fp8rl {

using nlohmann::json;

namespace {
std::string size_text(size_t bytes) {
  std::ostringstream os;
  if (bytes >= (size_t(1) << 20))
    os << bytes / double(size_t(1) << 20) << " MiB";
  else
    os << bytes << " bytes";
  return os.str();
}
}  // namespace

json json_parse_limited(std::string_view text, const std::string& origin, const JsonLimits& limits,
                        const std::function<void(int, const std::string&)>& on_key) {
  if (text.size() > limits.max_bytes)
    FP8RL_FAIL(origin, ": ", size_text(text.size()), " of JSON is more than the ", size_text(limits.max_bytes),
               " this input may have");
  // The callback runs inside nlohmann's iterative parser before each value is built: a value
  // nested too deep is refused before anything recursive ever sees it.
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if ((ev == json::parse_event_t::object_start || ev == json::parse_event_t::array_start) &&
        depth >= limits.max_depth)
      FP8RL_FAIL(origin, ": JSON nested more than ", limits.max_depth,
                 " levels deep (arrays/objects inside each other); this is not a valid file of its kind");
    if (on_key && ev == json::parse_event_t::key) on_key(depth, parsed.get<std::string>());
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    FP8RL_FAIL(origin, ": not valid JSON: ", e.what());
  }
}

std::string json_brief(const json& v, size_t max_chars) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s.size() <= max_chars) return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
    return json(s.substr(0, max_chars)).dump(-1, ' ', false, json::error_handler_t::replace) + "... (" +
           std::to_string(s.size()) + " bytes)";
  }
  if (v.is_array() || v.is_object()) {
    bool flat = v.size() <= 8;
    for (const json& e : v)
      if (e.is_structured() || (e.is_string() && e.get_ref<const std::string&>().size() > 16)) flat = false;
    if (flat) {
      std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
      if (s.size() <= max_chars) return s;
    }
    return v.is_array() ? "an array of " + std::to_string(v.size()) + " elements"
                        : "an object with " + std::to_string(v.size()) + " keys";
  }
  return v.dump();
}

std::string read_file_limited(const std::string& path, size_t max_bytes, const char* what) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) FP8RL_FAIL("cannot read ", what, " ", path, ": ", ec.message());
  if (size > max_bytes)
    FP8RL_FAIL(path, ": ", size_text(size), " is more than any ", what, " should be (limit ", size_text(max_bytes),
               "); is this the right file?");
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) FP8RL_FAIL("cannot read ", what, " ", path);
  std::string s(size, '\0');
  in.read(s.data(), static_cast<std::streamsize>(size));
  if (static_cast<uint64_t>(in.gcount()) != size) FP8RL_FAIL("cannot read ", what, " ", path, " (short read)");
  return s;
}

int64_t json_get_int(const json& v, int64_t lo, int64_t hi, const std::string& what) {
  auto fail = [&]() -> int64_t {
    FP8RL_FAIL(what, " must be an integer in [", lo, ", ", hi, "], got ", json_brief(v));
  };
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return fail();
    const int64_t x = static_cast<int64_t>(u);
    return x < lo || x > hi ? fail() : x;
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    return x < lo || x > hi ? fail() : x;
  }
  return fail();
}

}  // namespace fp8rl
