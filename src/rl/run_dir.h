// The run directory: everything one `fp8rl train` / `fp8rl sft` run leaves behind.
//   DIR/config.yaml          the resolved config (config_to_yaml), loadable with --config
//   DIR/metrics.jsonl        one JSON object per step (rl/metrics_log.h)
//   DIR/checkpoints/step_N/  checkpoints (layout: io/)
#pragma once
#include <cstdint>
#include <string>

#include "rl/config.h"

namespace fp8rl {

struct RunDir {
  std::string path;
  std::string config_path() const { return path + "/config.yaml"; }
  std::string metrics_path() const { return path + "/metrics.jsonl"; }
  std::string checkpoints_dir() const { return path + "/checkpoints"; }
  // DIR/checkpoints/step_000012 (zero-padded so that names sort by step)
  std::string checkpoint_path(int64_t step) const;
};

// Creates DIR and DIR/checkpoints. A directory that already holds a run (a metrics.jsonl) is
// refused unless `resume` (a new run must not append to an old run's metrics).
RunDir run_dir_create(const std::string& path, bool resume = false);

// Writes DIR/config.yaml atomically (core/fs.h write_file_atomic).
void run_dir_save_config(const RunDir& dir, const RunConfig& config);

// The config `fp8rl train --out DIR --resume [key=value ...]` continues with: DIR/config.yaml
// (the run's own), out=DIR, then `overrides` on top, validated. `changes` (optional) receives
// config_diff(saved, result). Throws when DIR holds no run config.
RunConfig run_dir_resume_config(const std::string& dir, const std::vector<std::string>& overrides,
                                std::vector<std::string>* changes = nullptr);

}  // namespace fp8rl
