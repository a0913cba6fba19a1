// Running the fp8rl binary from a test: exit status and everything it printed.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/fs.h"

namespace fp8rl::test {

// Runs FP8RL_BINARY with `args` (each single-quoted); returns its exit status (-1 when it did not
// exit normally, e.g. a crash) and its stdout+stderr in `output`. `log_dir` holds the log file.
inline int run_binary_in(const std::string& log_dir, const std::vector<std::string>& args, std::string& output) {
  static int counter = 0;
  const std::string log =
      log_dir + "/cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".log";
  std::string cmd = std::string("'") + FP8RL_BINARY + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " > '" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  output = std::filesystem::exists(log) ? read_file(log) : "";
  std::error_code ec;
  std::filesystem::remove(log, ec);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace fp8rl::test
