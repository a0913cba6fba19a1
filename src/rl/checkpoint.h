// Checkpoints: a Hugging Face model directory that transformers loads as it is, plus the
// trainer state needed to resume exactly.
//   DIR/checkpoints/step_000012/
//     config.json, model.safetensors, tokenizer.json   the policy (HF layout, FP32)
//     optimizer.safetensors                             AdamW moments (<param>.exp_avg[_sq])
//     trainer_state.json                                step, optimizer step, KV scales, seed
//   DIR/checkpoints/latest                              name of the newest complete checkpoint
// A checkpoint is written into step_N.tmp and renamed when complete; `latest` is replaced
// atomically after that: a crash leaves the previous checkpoint intact. A model with a
// non-finite value is never saved.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {

struct TrainerState {
  int64_t step = 0;            // RL (or SFT) steps completed
  int64_t optimizer_step = 0;  // AdamW steps taken
  uint64_t seed = 0;
  KvScales kv_scales;          // the generator's current KV scales (empty when not FP8 KV)
};

// Writes a checkpoint of `trainer` under `dir` (the step directory is created); copies
// `tokenizer_json` (a path, may be empty) beside the model. Returns the checkpoint path.
std::string checkpoint_save(Backend& backend, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const std::string& tokenizer_json);

// checkpoint.keep_last: removes all but the newest `keep_last` step_N checkpoints (0 = keep
// all), never the one `latest` names. Each is first renamed to step_N.pruned (atomic: a crash
// leaves a complete checkpoint or a .pruned leftover, never a half-deleted step_N), then
// deleted; leftovers of an earlier crash are deleted too. Returns the pruned paths.
std::vector<std::string> checkpoint_prune(const std::string& checkpoints_dir, int keep_last);

// The newest complete checkpoint under `checkpoints_dir`, if any.
std::optional<std::string> checkpoint_latest(const std::string& checkpoints_dir);

// Reads trainer_state.json of a checkpoint directory.
TrainerState checkpoint_read_state(const std::string& checkpoint_dir);

// Restores the optimizer moments and step into `trainer` (whose master weights were loaded from
// the same checkpoint with model_weights_load).
void checkpoint_load_optimizer(Backend& backend, Trainer& trainer, const std::string& checkpoint_dir,
                               const TrainerState& state);

}  // namespace fp8rl
