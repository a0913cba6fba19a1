// Checkpoints: a Hugging Face model directory that transformers loads as it is, plus the
// trainer state needed to resume exactly.
//   DIR/checkpoints/step_000012/
//     config.json, model.safetensors                    the policy (HF layout; checkpoint.dtype,
//                                                       BF16 by default; checkpoint.format fp8-block:
//                                                       FP8 linears; sharded above max_shard_gb)
//     tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
//     generation_config.json                            copied from the starting model / tokenizer
//                                                       (written for the demo's own tokenizer)
//     optimizer.safetensors                             AdamW moments (<param>.exp_avg[_sq]) and,
//                                                       when the model files are not F32, the F32
//                                                       master (master.<param>) for exact resume
//     trainer_state.json                                step, optimizer step, KV scales, seed
//   DIR/checkpoints/latest                              name of the newest complete checkpoint
// A checkpoint is written into step_N.tmp and renamed when complete; `latest` is replaced
// atomically after that: a crash leaves the previous checkpoint intact. A model with a
// non-finite value (or, with a bound, an exploded one) is never saved. trainer_state.json holds
// a CRC-32 of every other file, verified on resume.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/weights.h"
#include "rl/config.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {

struct CheckpointFile {
  std::string name;  // a file of the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;  // zlib's CRC-32 of its bytes
};

struct TrainerState {
  int64_t step = 0;            // RL (or SFT) steps completed
  int64_t optimizer_step = 0;  // AdamW steps taken
  uint64_t seed = 0;
  KvScales kv_scales;          // the generator's current KV scales (empty when not FP8 KV)
  std::vector<CheckpointFile> files;  // read back from trainer_state.json (written by checkpoint_save)
};

struct CheckpointOptions {
  SaveOptions model{DType::BF16};  // how the model files are written (weights.h)
  std::string tokenizer_json;      // copied as tokenizer.json (may be empty), with the tokenizer
                                   // files of its directory
  std::string model_dir;           // the starting model: its tokenizer/generation files are copied
  double max_abs_weight = 0;       // > 0: refuse weights larger in magnitude (an exploded run)
};
// From the run config (checkpoint.*; the FP8 format follows the generator's recipe: pow2 scales,
// BF16 first/last layers).
CheckpointOptions checkpoint_options(const RunConfig& config, const std::string& tokenizer_json);

// Writes a checkpoint of `trainer` under `dir` (the step directory is created). Returns the
// checkpoint path. Refused (throws, the previous checkpoint stays `latest`) when a weight is
// non-finite or, with max_abs_weight > 0, larger in magnitude (an exploded run). The second form
// uses the default options (BF16 model files) and copies `tokenizer_json` (may be empty).
std::string checkpoint_save(Backend& backend, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const CheckpointOptions& opt);
std::string checkpoint_save(Backend& backend, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const std::string& tokenizer_json,
                            double max_abs_weight = 0);

// The policy of a checkpoint as the F32 master it was saved from: the model files, with the
// master.<param> tensors of optimizer.safetensors (when present) in place of their values.
ModelWeights checkpoint_load_policy(const std::string& checkpoint_dir);

// checkpoint.keep_last: removes all but the newest `keep_last` step_N checkpoints (0 = keep
// all), never the one `latest` names. Each is first renamed to step_N.pruned (atomic: a crash
// leaves a complete checkpoint or a .pruned leftover, never a half-deleted step_N), then
// deleted; leftovers of an earlier crash are deleted too. Returns the pruned paths.
std::vector<std::string> checkpoint_prune(const std::string& checkpoints_dir, int keep_last);

// The newest complete checkpoint under `checkpoints_dir`, if any. `latest` must name a step_N
// directory inside checkpoints_dir (no path, no "..", no link out of the run).
std::optional<std::string> checkpoint_latest(const std::string& checkpoints_dir);

// Reads and validates trainer_state.json of a checkpoint directory: steps >= 0 and integers,
// `step` equal to the directory's step_N, KV scales finite and positive. Throws naming the file.
TrainerState checkpoint_read_state(const std::string& checkpoint_dir);

// Checks every file listed in the state against its size and CRC-32 (a flipped byte in the
// weights is refused before they are loaded). States without checksums (older runs) pass with a note.
void checkpoint_verify_files(const std::string& checkpoint_dir, const TrainerState& state);

// zlib CRC-32 of a file, streamed; `bytes` gets its size.
uint32_t checkpoint_file_crc32(const std::string& path, uint64_t* bytes = nullptr);

// Restores the optimizer moments and step into `trainer` (whose master weights were loaded from
// the same checkpoint with model_weights_load).
void checkpoint_load_optimizer(Backend& backend, Trainer& trainer, const std::string& checkpoint_dir,
                               const TrainerState& state);

}  // namespace fp8rl
