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

  // While a Hold lives, a signal is kept pending instead of ending the process; when the Hold
  // ends, a pending signal is handled with the note set by then. Around writing a checkpoint and
  // updating the note, so the note never names an older checkpoint than the one on disk.
  class Hold {
   public:
    Hold();
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
  };
};

}  // namespace fp8rl
