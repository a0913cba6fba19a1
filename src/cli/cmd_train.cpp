// fp8rl train / fp8rl sft: [--config FILE] [--out DIR] [--resume] [key.sub=value ...]
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "rl/checkpoint.h"
#include "rl/config.h"
#include "rl/loop.h"
#include "rl/run_dir.h"

namespace fp8rl::cli {

namespace {

// --out DIR, else the last out=DIR override, else the default.
std::string out_dir(const Args& a) {
  std::string out = RunConfig{}.out;
  for (const std::string& p : a.positional())
    if (p.rfind("out=", 0) == 0) out = p.substr(4);
  return a.has("out") ? a.get("out") : out;
}

RunConfig load(const Args& a) {
  std::vector<std::string> overrides = a.positional();
  if (a.has("out")) overrides.push_back("out=" + a.get("out"));
  return config_load(a.get("config"), overrides);
}

// --resume: the run's own config.yaml with the command line on top (printed as a diff).
RunConfig load_for_resume(const Args& a) {
  const std::string out = out_dir(a);
  if (a.has("config"))
    FP8RL_FAIL("--resume continues ", out, " with its own config (", out, "/config.yaml); drop --config ",
               a.get("config"), " and give any changes as key=value");
  std::vector<std::string> overrides;
  for (const std::string& p : a.positional())
    if (p.rfind("out=", 0) != 0) overrides.push_back(p);
  std::vector<std::string> changes;
  RunConfig c = run_dir_resume_config(out, overrides, &changes);
  std::printf("resume: %s/config.yaml%s\n", out.c_str(), changes.empty() ? " (unchanged)" : " with changes:");
  for (const std::string& ch : changes) std::printf("  %s\n", ch.c_str());
  return c;
}

const char* kUsage =
    "usage: fp8rl %s [--config FILE] [--out DIR]%s [key.sub=value ...]\n"
    "  With no arguments: the CPU demo (configs/demo_cpu.yaml). Keys: see configs/*.yaml, given as\n"
    "  key=value, --key=value or --key value; an unknown key is an error that names the nearest one.\n"
    "  Relative paths in a config file are relative to that file's folder.\n";

int run_train(const std::vector<std::string>& argv) {
  Args a(argv, {"config", "out"}, {"resume", "help", "print-config"}, /*config_overrides=*/true);
  if (a.has("help")) {
    std::printf(kUsage, "train", " [--resume] [--print-config]");
    std::printf("  --resume: continue DIR from its latest checkpoint with DIR/config.yaml (key=value on top).\n");
    return 0;
  }
  const bool resume = a.has("resume");
  RunConfig c = resume ? load_for_resume(a) : load(a);
  if (a.has("print-config")) {
    std::fputs(config_to_yaml(c).c_str(), stdout);
    return 0;
  }
  if (resume) {
    if (const auto ckpt = checkpoint_latest(c.out + "/checkpoints")) {
      const TrainerState st = checkpoint_read_state(*ckpt);
      if (st.step >= c.steps) {
        std::printf("run %s is finished: its latest checkpoint (%s) is step %lld of steps=%d; nothing to do.\n"
                    "To train further: fp8rl train --out %s --resume steps=N (N > %lld)\n",
                    c.out.c_str(), ckpt->c_str(), static_cast<long long>(st.step), c.steps, c.out.c_str(),
                    static_cast<long long>(st.step));
        return 0;
      }
    }
  }
  return grpo_run(c, resume);
}

int run_sft(const std::vector<std::string>& argv) {
  Args a(argv, {"config", "out"}, {"help"}, /*config_overrides=*/true);
  if (a.has("help")) {
    std::printf(kUsage, "sft", "");
    return 0;
  }
  RunConfig c = load(a);
  const std::string ckpt = sft_run(c);
  std::printf("sft done: %s\n", ckpt.c_str());
  return 0;
}

Register reg_train{"train", "GRPO post-training (no arguments: the CPU demo)", run_train};
Register reg_sft{"sft", "supervised fine-tuning on a task's worked solutions", run_sft};

}  // namespace
}  // namespace fp8rl::cli
