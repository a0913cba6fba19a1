#include "core/error.h"

#include <cstring>

namespace fp8rl::detail {

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  throw Error(msg + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

[[noreturn]] void throw_nonfinite(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  throw NonFiniteError(msg + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

}  // namespace fp8rl::detail
