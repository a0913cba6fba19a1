// fp8rl train / fp8rl sft: [--config FILE] [--out DIR] [--resume] [key.sub=value ...]
#include <cstdio>

#include "cli/commands.h"
#include "rl/config.h"
#include "rl/loop.h"

namespace fp8rl::cli {

namespace {

RunConfig load(const Args& a) {
  std::vector<std::string> overrides = a.positional();
  if (a.has("out")) overrides.push_back("out=" + a.get("out"));
  return config_load(a.get("config"), overrides);
}

const char* kUsage =
    "usage: fp8rl %s [--config FILE] [--out DIR]%s [key.sub=value ...]\n"
    "  With no arguments: the CPU demo (configs/demo_cpu.yaml). Keys: see configs/*.yaml;\n"
    "  an unknown key is an error that names the nearest valid one.\n";

int run_train(const std::vector<std::string>& argv) {
  Args a(argv, {"config", "out"}, {"resume", "help", "print-config"});
  if (a.has("help")) {
    std::printf(kUsage, "train", " [--resume] [--print-config]");
    return 0;
  }
  RunConfig c = load(a);
  if (a.has("print-config")) {
    std::fputs(config_to_yaml(c).c_str(), stdout);
    return 0;
  }
  return grpo_run(c, a.has("resume"));
}

int run_sft(const std::vector<std::string>& argv) {
  Args a(argv, {"config", "out"}, {"help"});
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
