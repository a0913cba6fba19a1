#include "rl/run_dir.h"

#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/fs.h"

namespace fp8rl {

std::string RunDir::checkpoint_path(int64_t step) const {
  FP8RL_CHECK(step >= 0, "checkpoint step must be >= 0, got ", step);
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld", static_cast<long long>(step));
  return checkpoints_dir() + "/" + name;
}

RunDir run_dir_create(const std::string& path, bool resume) {
  FP8RL_CHECK(!path.empty(), "run directory path is empty (set out=DIR)");
  RunDir d{path};
  if (!resume && std::filesystem::exists(d.metrics_path()))
    FP8RL_FAIL("run directory '", path, "' already holds a run (", d.metrics_path(),
               "); choose another out=DIR or remove it");
  make_dirs(path);
  make_dirs(d.checkpoints_dir());
  return d;
}

void run_dir_save_config(const RunDir& dir, const RunConfig& config) {
  write_file_atomic(dir.config_path(), config_to_yaml(config));
}

RunConfig run_dir_resume_config(const std::string& path, const std::vector<std::string>& overrides,
                                std::vector<std::string>* changes) {
  const RunDir d{path};
  if (!std::filesystem::exists(d.config_path()))
    FP8RL_FAIL("nothing to resume in '", path, "': it has no config.yaml (not a run directory, or the run never "
               "started); start it without --resume");
  RunConfig saved;
  // Saved configs hold absolute paths (config_load); older ones were relative to the directory
  // the run was started from, which is the best guess here too.
  config_apply_yaml(saved, read_file(d.config_path()), d.config_path());
  saved.out = path;
  RunConfig c = saved;
  for (const std::string& o : overrides) config_apply_override(c, o);
  config_validate(c);
  if (changes) *changes = config_diff(saved, c);
  return c;
}

}  // namespace fp8rl
