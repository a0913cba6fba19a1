// Subcommand registry: each src/cli/cmd_<name>.cpp registers one subcommand with
//   static fp8rl::cli::Register reg{"name", "one-line help", run_function};
#pragma once
#include <climits>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fp8rl::cli {

// argv excludes the program and subcommand names. Returns the process exit code.
using CommandFn = std::function<int(const std::vector<std::string>& args)>;

struct Command {
  std::string name;
  std::string help;
  CommandFn run;
};

std::vector<Command>& registry();

struct Register {
  Register(std::string name, std::string help, CommandFn fn) {
    registry().push_back({std::move(name), std::move(help), std::move(fn)});
  }
};

// Tiny flag parser shared by subcommands: --key value, --key=value, key=value (for a flag's
// name), --flag, -h (= --help), and bare positional words. With `config_overrides`, a config
// key given as --key=value or --key value becomes the positional override key=value (so
// `--steps=2`, `--steps 2` and `steps=2` are one thing). Unknown flags are errors that name the
// nearest flag (or config key).
class Args {
 public:
  // `flags`: names taking a value; `switches`: names without a value.
  Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
       const std::vector<std::string>& switches, bool config_overrides = false);
  bool has(const std::string& name) const;
  std::string get(const std::string& name, const std::string& fallback = "") const;
  std::string require(const std::string& name) const;  // throws "missing --name"
  // --name as an integer in [lo, hi] (fallback when absent); a malformed value (3.7, 12x, a
  // number beyond the type) or one out of range throws a message naming the flag.
  int get_int(const std::string& name, int fallback, int lo, int hi = INT_MAX) const;
  int64_t get_int64(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const;
  // --name as a finite number in [lo, hi] (fallback when absent).
  double get_float(const std::string& name, double fallback, double lo, double hi) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::vector<std::pair<std::string, std::string>> values_;
  std::vector<std::string> positional_;
};

}  // namespace fp8rl::cli
