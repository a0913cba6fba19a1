// What `fp8rl train` and `fp8rl sft` set up the same way: the backend, the tokenizer, the task,
// the starting policy, and how a task item becomes token ids.
#pragma once
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/weights.h"
#include "rl/config.h"
#include "rl/memory_plan.h"
#include "tasks/python_bridge.h"
#include "tasks/task.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "train/trainer.h"

namespace fp8rl {

struct Session {
  RunConfig config;
  std::unique_ptr<Backend> backend;
  Tokenizer tokenizer;
  std::string tokenizer_json;      // path of the tokenizer.json in use (copied into checkpoints)
  std::unique_ptr<Task> task;
  std::unique_ptr<PythonReward> python_reward;  // task.reward.python, when set
  int32_t eos_id = -1;
  // Generation stops after any of these: eos_id, then the eos_token_id(s) of the model's
  // generation_config.json (e.g. Qwen's <|im_end|> and <|endoftext|>).
  std::vector<int32_t> stop_ids;
  // With tokenizer.chat_template: the model's Jinja template (null when its directory has none,
  // then a built-in family formats prompts) and its extra variables (chat_template_kwargs).
  std::shared_ptr<const ChatJinja> chat_jinja;
  ChatJinja::Vars chat_vars;
  // Ids the samplers may draw (SamplingParams::valid_vocab; 0 = all): set by session_set_model.
  int64_t sampling_vocab = 0;
  // Set once the model is known (0 = unchecked): prompt_ids() refuses a prompt that leaves
  // fewer than max_new_tokens of the model's max_position_embeddings for the response.
  int64_t max_positions = 0;
  int64_t max_new_tokens = 0;

  // Item i of the training split, wrapping around when i passes its size (epochs).
  TaskItem train_item(int64_t i) const { return task->item(Split::kTrain, static_cast<size_t>(i) % task->size(Split::kTrain)); }
  std::vector<int32_t> prompt_ids(const TaskItem& item) const;    // prompt (chat-templated if asked)
  std::vector<int32_t> solution_ids(const TaskItem& item) const;  // worked solution + EOS (SFT target)
  std::string response_text(const std::vector<int32_t>& tokens) const;  // up to the first stop id
  // The reward of each response (responses[i] answers *items[i]): the task's verifier, or
  // task.reward.python called once for the whole batch; `metrics` (optional) receives the
  // Python function's extra keys (batch means, named reward/<key>).
  std::vector<double> rewards(const std::vector<const TaskItem*>& items, const std::vector<std::string>& responses,
                              std::vector<std::pair<std::string, double>>* metrics = nullptr) const;
  // The dicts a Python reward receives: the row's fields, then prompt, response, answer.
  std::vector<nlohmann::json> reward_samples(const std::vector<const TaskItem*>& items,
                                             const std::vector<std::string>& responses) const;
};

// Backend, task and tokenizer from the config. With a tiny model and no tokenizer path, the
// small byte-level tokenizer is trained on the task's text and cached under `cache_dir`.
Session session_open(const RunConfig& config, const std::string& cache_dir);

// The starting policy on the host (F32): model.path (an fp8rl checkpoint: its F32 master), or
// a tiny random model (seeded).
// Records the policy's vocabulary size against the tokenizer's: sampling_vocab becomes the
// tokenizer's size (at most the model's), and when they differ one line says so on stdout (a
// padded vocabulary, e.g. Qwen's 151936 rows over 151669 ids: the extra ids are never sampled)
// or on stderr (a tokenizer larger than the model: prompts with those ids cannot be scored).
// Returns sampling_vocab. Call once at start. `note` receives the padding line (stdout; `fp8rl
// eval`, whose stdout is JSON, passes stderr).
int64_t session_set_model(Session& s, int64_t model_vocab, std::FILE* note = stdout);

// The policy's config without loading its weights: model.path's config.json, or the tiny model's.
ModelConfig session_model_config(const Session& s);

// The start-up memory check (rl/memory_plan.h memory_plan_check) for this session's model and
// backend, printed to stdout; throws, before any work, when the plan cannot fit. sft: the plan
// of `fp8rl sft` (memory_plan_input's sft). Returns how the run must use the device
// (memory_plan_choose): train.recompute ("none" or "block") and train.dgrad_weight_cache ("on"
// or "off"), `auto` resolved by the plan, and the KV pool (rollout.gpu_memory_utilization).
MemoryChoice session_check_memory(const Session& s, bool sft = false);

// The starting policy on the host (F32): model.path, or a tiny random model (seeded).
ModelWeights session_initial_policy(const Session& s);

// The Qwen3-shaped config of the tiny model (model.tiny.*) over the tokenizer's vocabulary
// (model.tiny.vocab_size only sizes the small built-in tokenizer).
ModelConfig session_tiny_model_config(const TinyModelConfig& t, int vocab_size, int32_t eos_id);

// The trainer's optimizer settings from train.* (SFT and GRPO share them; SFT swaps the lr).
TrainerOptions trainer_options(const RunConfig& config);
// The tokenizer must fit the model: every id it can produce is a row of the embedding.
void session_check_model(const Session& s, const ModelConfig& model);
// What BadStepGuard tells the user when non-finite steps stop a run: the likely causes with
// their current values (`lr_key`=`lr`: train.lr or sft.lr; train.adam_eps; train.kl_beta).
std::string bad_step_hint(const RunConfig& config, const char* lr_key, double lr);

// Task from its config section (tasks/task.h); `seed` seeds procedural tasks and shuffles.
std::unique_ptr<Task> task_create(const TaskSection& section, uint64_t seed);

// The directory where fp8rl caches what it builds for itself (the demo's tokenizer and starting
// policy): $FP8RL_CACHE_DIR, else $XDG_CACHE_HOME/fp8rl, else ~/.cache/fp8rl, else ./.cache/fp8rl.
std::string cache_dir();

// Greedy validation: accuracy (fraction of rewards >= 0.5) of `policy`'s answers on `n`
// held-out items.
struct ValResult {
  double accuracy = 0, reward_mean = 0, seconds = 0;
  std::string example;  // one prompt + response, for the console
  std::string example_prompt, example_response;  // the same, apart
};
class RolloutEngine;
ValResult validate(const Session& s, RolloutEngine& engine, int n, int max_new_tokens);

}  // namespace fp8rl
