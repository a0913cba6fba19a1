#include "core/error.h"

#include <cstdlib>
#include <cstring>

namespace fp8rl::detail {

namespace {
std::string location(const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return std::string(base ? base + 1 : file) + ":" + std::to_string(line);
}
}  // namespace

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg) {
  throw Error(msg, "", location(file, line));
}

[[noreturn]] void throw_check(const char* file, int line, const char* expression, const std::string& msg) {
  throw Error(msg, expression, location(file, line));
}

[[noreturn]] void throw_nonfinite(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  throw NonFiniteError(msg + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

}  // namespace fp8rl::detail

namespace fp8rl {

std::string error_user_text(const std::exception& e) {
  const Error* err = dynamic_cast<const Error*>(&e);
  if (!err) return e.what();
  const char* debug = std::getenv("FP8RL_DEBUG");
  if (debug && *debug && std::strcmp(debug, "0") != 0) return err->what();
  return err->message();
}

}  // namespace fp8rl
