// fp8rl: one command, many subcommands (src/cli/cmd_*.cpp).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "core/suggest.h"
#include "rl/config.h"
#include "dist/comm.h"

namespace fp8rl::cli {

std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}

Args::Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
           const std::vector<std::string>& switches, bool config_overrides) {
  auto in = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  auto is_key = [&](const std::string& s) { return config_overrides && config_has_key(s); };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "-h") {
      values_.push_back({"help", "1"});
      continue;
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      // name=value with a flag's name is that flag (one grammar: --out DIR, --out=DIR, out=DIR).
      const size_t eq = a.find('=');
      if (eq != std::string::npos && eq > 0 && in(flags, a.substr(0, eq)) && !is_key(a.substr(0, eq))) {
        values_.push_back({a.substr(0, eq), a.substr(eq + 1)});
        continue;
      }
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
      if (inline_value) FP8RL_FAIL("--", name, " takes no value");
      values_.push_back({name, "1"});
    } else if (in(flags, name)) {
      if (!inline_value) {
        if (i + 1 >= argv.size()) FP8RL_FAIL("--", name, " needs a value");
        value = argv[++i];
      }
      values_.push_back({name, value});
    } else if (is_key(name)) {
      // A config key as a flag: --train.lr=1e-4 or --train.lr 1e-4 == train.lr=1e-4.
      if (!inline_value) {
        if (i + 1 >= argv.size()) FP8RL_FAIL("--", name, " needs a value (e.g. --", name, "=VALUE)");
        value = argv[++i];
      }
      positional_.push_back(name + "=" + value);
    } else {
      std::vector<std::string> known;
      std::string list;
      for (auto& f : flags) known.push_back(f), list += " --" + f;
      for (auto& f : switches) known.push_back(f), list += " --" + f;
      std::string near = suggest_nearest(name, known);
      if (near.empty() && config_overrides) {
        const std::string key = config_nearest_key(name);
        if (!key.empty() && edit_distance(name, key) <= std::max<size_t>(2, name.size() / 3)) near = key;
      }
      if (!near.empty()) FP8RL_FAIL("unknown option --", name, " (did you mean --", near, "?)");
      FP8RL_FAIL("unknown option --", name, " (options:", list,
                 config_overrides ? "; and any config key as --key=value or key=value)" : ")");
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
  if (!has(name)) FP8RL_FAIL("missing required option --", name, " (see --help)");
  return get(name);
}

// Strict numbers: the whole text must be the number (no "3.7" for an integer, no trailing
// garbage, no silent wrap of 2^32+5), and it must lie in [lo, hi]; messages name the flag.
int64_t Args::get_int64(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
  if (!has(name)) return fallback;
  const std::string s = get(name);
  int64_t v = 0;
  const char* b = s.data() + (s.size() > 1 && s[0] == '+' && s[1] != '-');  // "+5", not "+-5"
  const auto [p, ec] = std::from_chars(b, s.data() + s.size(), v);
  if (ec == std::errc::result_out_of_range)
    FP8RL_FAIL("--", name, " must be an integer in [", lo, ", ", hi, "], got ", s);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size())
    FP8RL_FAIL("--", name, ": '", s, "' is not an integer");
  if (v < lo || v > hi) FP8RL_FAIL("--", name, " must be an integer in [", lo, ", ", hi, "], got ", s);
  return v;
}

int Args::get_int(const std::string& name, int fallback, int lo, int hi) const {
  return static_cast<int>(get_int64(name, fallback, lo, hi));
}

double Args::get_float(const std::string& name, double fallback, double lo, double hi) const {
  if (!has(name)) return fallback;
  const std::string s = get(name);
  double v = 0;
  const char* b = s.data() + (s.size() > 1 && s[0] == '+' && s[1] != '-');  // "+5", not "+-5"
  const auto [p, ec] = std::from_chars(b, s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size() || !std::isfinite(v))
    FP8RL_FAIL("--", name, ": '", s, "' is not a number");
  if (v < lo || v > hi) FP8RL_FAIL("--", name, " must be in [", lo, ", ", hi, "], got ", s);
  return v;
}

}  // namespace fp8rl::cli

// Set by CMake from `git describe` at configure time; "unknown" outside a git checkout.
#ifndef FP8RL_GIT_COMMIT
#define FP8RL_GIT_COMMIT "unknown"
#endif

static void print_version() {
  std::printf("fp8rl %s (%s", FP8RL_GIT_COMMIT,
#ifdef FP8RL_HAVE_CUDA
              "CUDA backend"
#else
              "no CUDA: CPU backend only"
#endif
  );
#ifdef FP8RL_HAVE_PYTHON
  std::printf(", Python rewards");
#endif
#ifdef FP8RL_HAVE_LIBPNG
  std::printf(", libpng");
#endif
  std::printf(")\n");
}

static void print_usage() {
  std::fprintf(stderr, "usage: fp8rl <command> [options]\n\ncommands:\n");
  auto cmds = fp8rl::cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  for (auto& c : cmds) std::fprintf(stderr, "  %-18s %s\n", c.name.c_str(), c.help.c_str());
  std::fprintf(stderr, "\n'fp8rl <command> --help' for a command's options; 'fp8rl --version' for the build.\n"
                       "Errors show where they were raised with FP8RL_DEBUG=1.\n");
}

int main(int argc, char** argv) {
  // Line-buffered even into a file or pipe: `tail -f` sees each step, and a run stopped by
  // Ctrl-C (which exits from the signal handler, rl/interrupt.h) loses no printed line.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  if (std::string(argv[1]) == "--version" || std::string(argv[1]) == "version") {
    print_version();
    return 0;
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
      std::fprintf(stderr, "%sfp8rl %s: error: %s\n", fp8rl::dist_log_prefix().c_str(), name.c_str(),
                   fp8rl::error_user_text(e).c_str());
      std::fflush(stderr);
      fp8rl::dist_abort_job(1);  // MPI: stop the other ranks (TCP: they see this rank's sockets close)
      return 1;
    }
  }
  std::vector<std::string> names;
  for (auto& c : fp8rl::cli::registry()) names.push_back(c.name);
  const std::string near = fp8rl::suggest_nearest(name, names);
  if (!near.empty()) {
    std::fprintf(stderr, "fp8rl: unknown command '%s' (did you mean '%s'?)\n", name.c_str(), near.c_str());
    return 2;
  }
  std::fprintf(stderr, "fp8rl: unknown command '%s'\n\n", name.c_str());
  print_usage();
  return 2;
}
