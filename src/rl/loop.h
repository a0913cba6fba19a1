// The two training programs: `fp8rl sft` (teacher forcing on worked solutions) and `fp8rl train`
// (GRPO with the generator/trainer mismatch correction, refit and KV-scale recalibration).
#pragma once
#include <string>

#include "rl/config.h"

namespace fp8rl {

// Runs SFT from the config's starting policy; writes config.yaml, metrics.jsonl and a final
// HF checkpoint under config.out. Returns the final checkpoint directory.
// print_plan: print the memory plan (the demo's warm-up SFT leaves it to the GRPO run).
std::string sft_run(const RunConfig& config, bool print_plan = true);

// Runs GRPO. When model.path is empty (the tiny demo model) the starting policy is trained by
// SFT first and cached (cache_dir()). resume: continue from config.out's latest checkpoint.
// Returns the process exit code.
int grpo_run(const RunConfig& config, bool resume);

}  // namespace fp8rl
