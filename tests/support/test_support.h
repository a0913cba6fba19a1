// Helpers every test binary shares: tensor values and relative errors, a scoped environment
// variable, running the fp8rl binary, a per-process scratch directory.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/fs.h"
#include "core/tensor.h"

namespace fp8rl::test {

// The values of a host tensor (F32, BF16, F16, F64, E4M3 or I32) as double.
inline std::vector<double> values(const Tensor& t) {
  std::vector<double> v(t.numel());
  if (t.dtype() == DType::F64) {
    for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.data<double>()[i];
  } else if (t.dtype() == DType::I32) {
    for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.data<int32_t>()[i];
  } else {
    const std::vector<float> f = to_float_vector(t);
    for (size_t i = 0; i < f.size(); ++i) v[i] = f[i];
  }
  return v;
}

// max |a - b| / max |b|; infinity when either holds a NaN or an infinity (an unwritten, poisoned
// output fails), or when the sizes differ.
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    d = std::max(d, std::fabs(a[i] - b[i]));
    m = std::max(m, std::fabs(b[i]));
  }
  return d / std::max(m, 1e-300);
}
inline double rel_err(const Tensor& a, const Tensor& b) { return rel_err(values(a), values(b)); }

// Sets an environment variable for a scope (restores the old value, or unsets it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) ::setenv(name_.c_str(), old_.c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

#ifdef FP8RL_BINARY
// Runs FP8RL_BINARY with `args` (each single-quoted), stdin from /dev/null, `env` ("A=1 B=2",
// may be empty) in front; returns its exit status (-1 when it did not exit normally, e.g. a
// crash) and its stdout+stderr in `output`. `log_dir` holds the log file.
inline int run_binary_in(const std::string& log_dir, const std::vector<std::string>& args, std::string& output,
                         const std::string& env = "") {
  static int counter = 0;
  const std::string log = log_dir + "/cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".log";
  std::string cmd = env + (env.empty() ? "" : " ") + "'" + FP8RL_BINARY + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " > '" + log + "' 2>&1 < /dev/null";
  const int rc = std::system(cmd.c_str());
  output = std::filesystem::exists(log) ? read_file(log) : "";
  std::error_code ec;
  std::filesystem::remove(log, ec);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}
#endif

// Runs a shell command line, stderr merged into stdout: its output; *status is what pclose says.
inline std::string run_shell(const std::string& line, int* status) {
  FILE* f = popen((line + " 2>&1").c_str(), "r");
  std::string text;
  if (!f) return text;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) text += buf;
  *status = pclose(f);
  return text;
}

// The cache directory (FP8RL_CACHE_DIR: the tiny model's tokenizer and SFT starting policy) of
// a test process whose scratch directory is `root`: root/cache, or FP8RL_TEST_CACHE_DIR when set.
// ctest sets that one (CMakeLists.txt): one cache for the test processes of a ctest run (16
// GoogleTest shards, or one process per test), emptied by the run's first entry, so that each
// starting policy is trained once per run rather than once per process (a 200-step SFT costs
// ~15 s under ASan). Entries appear by an atomic rename (rl/grpo_loop.cpp: ensure_demo_policy),
// so processes may share it; a test that needs an empty or private cache makes its own.
inline std::string test_cache_dir(const std::string& root) {
  const char* shared = std::getenv("FP8RL_TEST_CACHE_DIR");
  const std::string dir = shared && *shared ? std::string(shared) : root + "/cache";
  std::filesystem::create_directories(dir);
  return dir;
}

// A per-process scratch directory (removed at exit); FP8RL_CACHE_DIR points to its cache
// (test_cache_dir), for the test process and for the fp8rl processes it starts. One for the
// whole test binary.
class Scratch {
 public:
  static const std::string& root() { return instance().root_; }
  static const std::string& cache() { return instance().cache_; }

 private:
  static Scratch& instance() {
    static Scratch s;
    return s;
  }
  Scratch() {
    root_ = (std::filesystem::temp_directory_path() / ("fp8rl_tests_" + std::to_string(::getpid()))).string();
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
    cache_ = test_cache_dir(root_);
    ::setenv("FP8RL_CACHE_DIR", cache_.c_str(), 1);
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  std::string root_, cache_;
};

// Scratch::root()/name, emptied.
inline std::string fresh_dir(const std::string& name) {
  const std::string d = Scratch::root() + "/" + name;
  std::filesystem::remove_all(d);
  return d;
}

}  // namespace fp8rl::test
