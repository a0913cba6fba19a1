// Ctrl-C (SIGINT) or SIGTERM during a run: instead of dying silently, print what can be resumed
// ("interrupted; the last checkpoint is RUN/checkpoints/step_000012: continue with
// fp8rl train --out RUN --resume") and exit with 128 + the signal number. The note is kept
// up to date by the loop after every checkpoint; the handler only writes the prepared bytes
// (async-signal-safe).
#pragma once
#include <string>

namespace fp8rl {

class InterruptNote {
 public:
  explicit InterruptNote(const std::string& note);  // installs the handlers
  ~InterruptNote();                                 // restores the previous handlers
  InterruptNote(const InterruptNote&) = delete;
  InterruptNote& operator=(const InterruptNote&) = delete;
  void set(const std::string& note);
};

}  // namespace fp8rl
