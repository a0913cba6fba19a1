#include "rl/interrupt.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace fp8rl {

namespace {

// Two buffers: set() fills the one not in use, then publishes it, so a signal arriving during
// set() still finds a complete note.
char g_notes[2][4096];
std::atomic<int> g_current{-1};
std::atomic<int> g_hold{0}, g_pending{0};  // lock-free: safe in the handler
struct sigaction g_old_int, g_old_term;

void on_signal(int sig) {
  if (g_hold.load() > 0) {  // inside a Hold: handled when it ends
    g_pending.store(sig);
    return;
  }
  const int i = g_current.load();
  if (i >= 0) {
    const char* p = g_notes[i];
    size_t n = std::strlen(p);
    while (n > 0) {
      const ssize_t w = ::write(STDERR_FILENO, p, n);
      if (w <= 0) break;
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  ::_exit(128 + sig);
}

}  // namespace

InterruptNote::InterruptNote(const std::string& note) {
  set(note);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &g_old_int);
  ::sigaction(SIGTERM, &sa, &g_old_term);
}

InterruptNote::~InterruptNote() {
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  g_current.store(-1);
}

InterruptNote::Hold::Hold() { g_hold.fetch_add(1); }

InterruptNote::Hold::~Hold() {
  if (g_hold.fetch_sub(1) != 1) return;
  const int sig = g_pending.exchange(0);
  if (sig != 0) on_signal(sig);  // a signal after the store above is handled as usual
}

void InterruptNote::set(const std::string& note) {
  const int next = g_current.load() == 0 ? 1 : 0;
  // "\r\033[K" first: the note replaces a progress bar that may be on the line.
  std::string text = (::isatty(STDERR_FILENO) ? "\r\033[K\n" : "\n") + note + "\n";
  if (text.size() >= sizeof g_notes[next]) text.resize(sizeof g_notes[next] - 1);
  std::memcpy(g_notes[next], text.c_str(), text.size() + 1);
  g_current.store(next);
}

}  // namespace fp8rl
