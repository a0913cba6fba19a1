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

// A per-process scratch directory (removed at exit); FP8RL_CACHE_DIR points into it, for the
// test process and for the fp8rl processes it starts. One for the whole test binary.
class Scratch {
 public:
  static const std::string& root() {
    static Scratch s;
    return s.root_;
  }

 private:
  Scratch() {
    root_ = (std::filesystem::temp_directory_path() / ("fp8rl_tests_" + std::to_string(::getpid()))).string();
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ + "/cache");
    ::setenv("FP8RL_CACHE_DIR", (root_ + "/cache").c_str(), 1);
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  std::string root_;
};

// Scratch::root()/name, emptied.
inline std::string fresh_dir(const std::string& name) {
  const std::string d = Scratch::root() + "/" + name;
  std::filesystem::remove_all(d);
  return d;
}

}  // namespace fp8rl::test
