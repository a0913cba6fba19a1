// InterruptNote: a signal during a Hold waits for it to end and is then reported with the note
// set inside the Hold (the checkpoint race of Workflow.InterruptNamesTheLastCheckpoint, made
// deterministic).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "rl/interrupt.h"

namespace fp8rl {
namespace {

// Runs body in a child whose stderr goes to a pipe; returns {exit status, stderr}.
template <class F>
std::pair<int, std::string> in_child(F&& body) {
  int fd[2];
  EXPECT_EQ(::pipe(fd), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd[1], STDERR_FILENO);
    ::close(fd[0]);
    body();
    ::_exit(0);
  }
  ::close(fd[1]);
  std::string out;
  char buf[256];
  for (ssize_t n; (n = ::read(fd[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(Interrupt, SignalDuringAHoldIsReportedWithTheNoteSetInside) {
  const auto [code, err] = in_child([] {
    InterruptNote note("old note");
    {
      const InterruptNote::Hold hold;
      ::raise(SIGINT);  // pending: the process goes on
      note.set("new note");
    }
    ::_exit(3);  // not reached: the pending signal ends the process when the Hold ends
  });
  EXPECT_EQ(code, 128 + SIGINT);
  EXPECT_NE(err.find("new note"), std::string::npos) << err;
  EXPECT_EQ(err.find("old note"), std::string::npos) << err;
}

TEST(Interrupt, SignalOutsideAHoldEndsTheProcessAtOnce) {
  const auto [code, err] = in_child([] {
    InterruptNote note("the note");
    ::raise(SIGTERM);
    ::_exit(3);
  });
  EXPECT_EQ(code, 128 + SIGTERM);
  EXPECT_NE(err.find("the note"), std::string::npos) << err;
}

}  // namespace
}  // namespace fp8rl
