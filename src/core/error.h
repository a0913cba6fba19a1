// One family of error checks. Every failure throws fp8rl::Error with what was being
// done, where (file:line), and, when known, what the caller should do about it.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace fp8rl {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A non-finite value (NaN, Inf) met in data the computation produced: activations, logits,
// losses, gradients. A training step that meets one skips its update (train/trainer.h
// BadStepGuard); anywhere else it is an Error like any other.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
[[noreturn]] void throw_nonfinite(const char* file, int line, const std::string& msg);
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace fp8rl

// FP8RL_CHECK(cond, "what is wrong", " and what to do"): throws fp8rl::Error with file:line.
#define FP8RL_CHECK(cond, ...)                                                          \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::fp8rl::detail::throw_error(__FILE__, __LINE__,                                  \
                                   ::fp8rl::detail::concat("check failed: " #cond ": ", \
                                                           __VA_ARGS__));               \
  } while (0)

// FP8RL_FAIL("message", ...): unconditional error (user-facing messages, no expression).
#define FP8RL_FAIL(...) \
  ::fp8rl::detail::throw_error(__FILE__, __LINE__, ::fp8rl::detail::concat(__VA_ARGS__))

// FP8RL_FAIL_NONFINITE("message", ...): throws NonFiniteError (a NaN/Inf in computed data).
#define FP8RL_FAIL_NONFINITE(...) \
  ::fp8rl::detail::throw_nonfinite(__FILE__, __LINE__, ::fp8rl::detail::concat(__VA_ARGS__))
