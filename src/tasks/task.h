// Tasks: prompts with reference answers and a verifier that turns a response into a reward.
//
// Every task is deterministic by seed and has train and validation splits that never
// share a prompt. Each item has a prompt, the reference answer the verifier needs, and a
// worked solution (for SFT) that ends in a final-answer line the verifier accepts.
//   gsm8k       shared/data/gsm8k: train.jsonl (shuffled by seed) / test.jsonl
//   arithmetic  procedural multi-step arithmetic with difficulty knobs (expressions or word problems)
//   countdown   reach a target from given numbers, each used EXACTLY once
//   jsonl       user datasets: JSONL (or, with Python, parquet / HF save_to_disk directories) with
//               configurable prompt/answer/solution fields; nested fields as "a.b" (DAPO's
//               reward_model.ground_truth); a prompt that is a chat (a list of {role, content})
//               uses its last user message
// Final answers are read from the last \boxed{...}, else the last "#### ...", else (math
// tasks only) the last number in the response; see tasks/answer.h.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace fp8rl {

enum class Split { kTrain, kValidation };

struct TaskItem {
  std::string prompt;    // the user message (no chat template applied)
  std::string answer;    // the reference the verifier compares with
  std::string solution;  // worked solution for SFT, ending in "#### <answer>" or \boxed{...}
  std::string fields_json;  // dataset tasks: the whole row as a JSON object (for Python rewards)
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  virtual size_t size(Split split) const = 0;
  // Throws if index >= size(split). Same (seed, split, index) -> same item, always.
  virtual TaskItem item(Split split, size_t index) const = 0;
  // 1.0 if `response` reaches the reference answer, else 0.0. Never throws on any response
  // (empty, invalid UTF-8, huge numbers, malformed expressions all give 0).
  virtual double reward(std::string_view response, const std::string& answer) const = 0;
};

struct ArithmeticConfig {
  uint64_t seed = 0;
  int min_operands = 2, max_operands = 4;  // numbers in the expression
  int digits = 2;                          // each operand has 1..digits digits
  std::string operators = "+-*";           // any of "+-*/"; '/' only where exact
  bool parentheses = true;                 // false: only expressions needing none
  // story: a word problem instead of an expression ("Ava has 35 apples. Ava buys 12 more. ...
  // How many apples does Ava have now?"), computed left to right, one sentence and one
  // "35 + 12 = 47" per step in the worked solution (GSM8K style). Operands as above except
  // multipliers and divisors (2..9); every intermediate value is a whole number in
  // [0, 10^(digits + 1)) (2 digits: at most 999).
  bool story = false;
  size_t train_size = 100000, validation_size = 500;
};

struct CountdownConfig {
  uint64_t seed = 0;
  int numbers = 4;          // how many given numbers (2..6)
  int max_number = 25;      // given numbers are in [1, max_number]
  int max_target = 200;     // targets are in [1, max_target]
  size_t train_size = 100000, validation_size = 500;
};

struct JsonlConfig {
  std::string train_path;
  std::string validation_path;     // empty: hold out validation_fraction of train_path
  double validation_fraction = 0.05;
  std::string prompt_field = "prompt", answer_field = "answer";
  std::string solution_field;      // optional; empty: no worked solutions
  bool answer_after_hashes = false;  // the answer field is a solution ending "#### n" (GSM8K)
  std::string instruction;         // appended to every prompt after a newline, if not empty
  std::string prompt_template;     // "" = prompt_field; else {field} / {a.b} replaced by the row's
                                   // values ({{ and }} are literal braces)
  uint64_t seed = 0;               // shuffles the train split
  std::string name = "jsonl";
};

// Default instruction for math prompts; SFT solutions end in this format.
inline constexpr const char* kMathInstruction =
    "Solve step by step, then give the final answer on its own line as \"#### <number>\".";

std::unique_ptr<Task> task_make_gsm8k(const std::string& gsm8k_dir, uint64_t seed = 0);
std::unique_ptr<Task> task_make_arithmetic(const ArithmeticConfig& cfg);
std::unique_ptr<Task> task_make_countdown(const CountdownConfig& cfg);
std::unique_ptr<Task> task_make_jsonl(const JsonlConfig& cfg);

}  // namespace fp8rl
