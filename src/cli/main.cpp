// fp8rl: one command, many subcommands (src/cli/cmd_*.cpp).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "dist/comm.h"

namespace fp8rl::cli {

std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}

Args::Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
           const std::vector<std::string>& switches) {
  auto in = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (in(switches, name)) {
      FP8RL_CHECK(!inline_value, "--", name, " takes no value");
      values_.push_back({name, "1"});
    } else if (in(flags, name)) {
      if (!inline_value) {
        FP8RL_CHECK(i + 1 < argv.size(), "--", name, " needs a value");
        value = argv[++i];
      }
      values_.push_back({name, value});
    } else {
      std::string known;
      for (auto& f : flags) known += " --" + f;
      for (auto& f : switches) known += " --" + f;
      FP8RL_FAIL("unknown option --", name, " (known:", known, ")");
    }
  }
}

bool Args::has(const std::string& name) const {
  for (auto& kv : values_) if (kv.first == name) return true;
  return false;
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  for (auto it = values_.rbegin(); it != values_.rend(); ++it) if (it->first == name) return it->second;
  return fallback;
}

std::string Args::require(const std::string& name) const {
  FP8RL_CHECK(has(name), "missing required option --", name);
  return get(name);
}

int Args::get_int(const std::string& name, int fallback, int lo) const {
  const std::string s = get(name, std::to_string(fallback));
  size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  FP8RL_CHECK(used == s.size() && used > 0, "--", name, ": '", s, "' is not an integer");
  FP8RL_CHECK(v >= lo, "--", name, " must be >= ", lo, ", got ", v);
  return v;
}

}  // namespace fp8rl::cli

static void print_usage() {
  std::fprintf(stderr, "usage: fp8rl <command> [options]\n\ncommands:\n");
  auto cmds = fp8rl::cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  for (auto& c : cmds) std::fprintf(stderr, "  %-18s %s\n", c.name.c_str(), c.help.c_str());
  std::fprintf(stderr, "\n'fp8rl <command> --help' for a command's options.\n");
}

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  for (auto& c : fp8rl::cli::registry()) {
    if (c.name != name) continue;
    try {
      return c.run(args);
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "%sfp8rl %s: error: out of host memory; reduce the batch or model size\n",
                   fp8rl::dist_log_prefix().c_str(), name.c_str());
      fp8rl::dist_abort_job(1);
      return 1;
    } catch (const std::exception& e) {
      // Several ranks: "[rank 1/4] fp8rl train: error: ..." (dist/comm.h).
      std::fprintf(stderr, "%sfp8rl %s: error: %s\n", fp8rl::dist_log_prefix().c_str(), name.c_str(), e.what());
      std::fflush(stderr);
      fp8rl::dist_abort_job(1);  // MPI: stop the other ranks (TCP: they see this rank's sockets close)
      return 1;
    }
  }
  std::fprintf(stderr, "fp8rl: unknown command '%s'\n\n", name.c_str());
  print_usage();
  return 2;
}
