// What `fp8rl train` and `fp8rl sft` set up the same way: the backend, the tokenizer, the task,
// the starting policy, and how a task item becomes token ids.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/weights.h"
#include "rl/config.h"
#include "tasks/python_bridge.h"
#include "tasks/task.h"
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

  // Item i of the training split, wrapping around when i passes its size (epochs).
  TaskItem train_item(int64_t i) const { return task->item(Split::kTrain, static_cast<size_t>(i) % task->size(Split::kTrain)); }
  std::vector<int32_t> prompt_ids(const TaskItem& item) const;    // prompt (chat-templated if asked)
  std::vector<int32_t> solution_ids(const TaskItem& item) const;  // worked solution + EOS (SFT target)
  std::string response_text(const std::vector<int32_t>& tokens) const;  // up to the first EOS
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

// The starting policy on the host (F32): model.path, or a tiny random model (seeded).
ModelWeights session_initial_policy(const Session& s);

// The Qwen3-shaped config of the tiny model (model.tiny.*) over the tokenizer's vocabulary
// (model.tiny.vocab_size only sizes the small built-in tokenizer).
ModelConfig session_tiny_model_config(const TinyModelConfig& t, int vocab_size, int32_t eos_id);

// The trainer's optimizer settings from train.* (SFT and GRPO share them; SFT swaps the lr).
TrainerOptions trainer_options(const RunConfig& config);

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
