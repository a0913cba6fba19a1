// One family of error checks. Every failure throws fp8rl::Error with what was being
// done, where (file:line), and, when known, what the caller should do about it.
//
// what() is the whole record (the failed expression, the message, [file:line]): what tests and
// logs see. message() is the message alone: what a user sees (cli/main.cpp prints it, and the
// expression and location only when FP8RL_DEBUG=1), so user-facing checks read as sentences.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace fp8rl {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message), message_(message) {}
  // `expression`: the failed check ("" for FP8RL_FAIL); `location`: "file.cpp:123".
  Error(const std::string& message, const std::string& expression, const std::string& location)
      : std::runtime_error((expression.empty() ? "" : "check failed: " + expression + ": ") + message +
                           (location.empty() ? "" : " [" + location + "]")),
        message_(message), expression_(expression), location_(location) {}
  const std::string& message() const { return message_; }
  const std::string& expression() const { return expression_; }
  const std::string& location() const { return location_; }

 private:
  std::string message_, expression_, location_;
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
[[noreturn]] void throw_check(const char* file, int line, const char* expression, const std::string& msg);
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// The text a user sees for an exception: Error::message() (plus the expression and file:line
// when FP8RL_DEBUG=1 is set in the environment), else what().
std::string error_user_text(const std::exception& e);

}  // namespace fp8rl

// FP8RL_CHECK(cond, "what is wrong", " and what to do"): throws fp8rl::Error with file:line.
#define FP8RL_CHECK(cond, ...)                                                                   \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      ::fp8rl::detail::throw_check(__FILE__, __LINE__, #cond, ::fp8rl::detail::concat(__VA_ARGS__)); \
  } while (0)

// FP8RL_FAIL("message", ...): unconditional error (user-facing messages, no expression).
#define FP8RL_FAIL(...) \
  ::fp8rl::detail::throw_error(__FILE__, __LINE__, ::fp8rl::detail::concat(__VA_ARGS__))

// FP8RL_FAIL_NONFINITE("message", ...): throws NonFiniteError (a NaN/Inf in computed data).
#define FP8RL_FAIL_NONFINITE(...) \
  ::fp8rl::detail::throw_nonfinite(__FILE__, __LINE__, ::fp8rl::detail::concat(__VA_ARGS__))
