// Tasks: determinism by seed, disjoint splits, worked solutions the verifier accepts,
// GSM8K loading, JSONL errors with line numbers.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unordered_set>

#include "core/error.h"
#include "tasks/task.h"

namespace fp8rl {
namespace {

std::string shared_data() {
  const char* env = std::getenv("FP8RL_SHARED_DATA");
  return env && *env ? env : FP8RL_SHARED_DATA;
}

void expect_task_contract(const Task& t, size_t n_check) {
  std::unordered_set<std::string> val;
  for (size_t i = 0; i < t.size(Split::kValidation); ++i) val.insert(t.item(Split::kValidation, i).prompt);
  ASSERT_GT(val.size(), 0u);
  const size_t n = std::min(n_check, t.size(Split::kTrain));
  for (size_t i = 0; i < n; ++i) {
    const TaskItem it = t.item(Split::kTrain, i);
    EXPECT_EQ(val.count(it.prompt), 0u) << t.name() << " train item " << i << " is in validation";
    EXPECT_FALSE(it.prompt.empty());
    EXPECT_FALSE(it.answer.empty());
    ASSERT_FALSE(it.solution.empty());
    EXPECT_EQ(t.reward(it.solution, it.answer), 1.0) << t.name() << " item " << i << ":\n" << it.solution;
    EXPECT_EQ(t.reward("", it.answer), 0.0);
  }
  for (size_t i = 0; i < std::min<size_t>(50, t.size(Split::kValidation)); ++i) {
    const TaskItem it = t.item(Split::kValidation, i);
    EXPECT_EQ(t.reward(it.solution, it.answer), 1.0) << it.solution;
  }
  EXPECT_THROW(t.item(Split::kValidation, t.size(Split::kValidation)), Error);
}

TEST(Tasks, ArithmeticContractAndKnobs) {
  ArithmeticConfig c;
  c.seed = 7;
  c.train_size = 3000;
  c.validation_size = 300;
  c.operators = "+-*/";
  auto t = task_make_arithmetic(c);
  expect_task_contract(*t, 3000);
  // Deterministic by seed; a different seed gives different items.
  auto same = task_make_arithmetic(c);
  c.seed = 8;
  auto other = task_make_arithmetic(c);
  int differ = 0;
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(t->item(Split::kTrain, i).prompt, same->item(Split::kTrain, i).prompt);
    EXPECT_EQ(t->item(Split::kTrain, i).solution, same->item(Split::kTrain, i).solution);
    differ += t->item(Split::kTrain, i).prompt != other->item(Split::kTrain, i).prompt;
  }
  EXPECT_GT(differ, 15);
  // No parentheses, 3 operands, 1 digit: small space, still disjoint (rejection works).
  ArithmeticConfig small;
  small.min_operands = small.max_operands = 3;
  small.digits = 1;
  small.parentheses = false;
  small.train_size = 2000;
  small.validation_size = 200;
  auto s = task_make_arithmetic(small);
  expect_task_contract(*s, 2000);
  for (size_t i = 0; i < 200; ++i) EXPECT_EQ(s->item(Split::kTrain, i).prompt.find('('), std::string::npos);
  // The worked solution shows one operation per line and ends in the answer.
  const TaskItem it = t->item(Split::kTrain, 0);
  EXPECT_NE(it.solution.find("\n= "), std::string::npos);
  EXPECT_EQ(it.solution.substr(it.solution.rfind('\n') + 1), "#### " + it.answer);
}

// Word problems: the contract, GSM8K-style worked steps ("35 + 12 = 47") whose chain reaches the
// answer, whole numbers in [0, 999] throughout (2 digits), and the operand-count knob.
TEST(Tasks, ArithmeticStoryProblems) {
  ArithmeticConfig c;
  c.seed = 11;
  c.story = true;
  c.min_operands = 3;
  c.max_operands = 4;
  c.digits = 2;
  c.operators = "+-*/";
  c.train_size = 2000;
  c.validation_size = 200;
  auto t = task_make_arithmetic(c);
  EXPECT_EQ(t->name(), "arithmetic_story");
  expect_task_contract(*t, 2000);
  std::unordered_set<char> ops_seen;
  for (size_t i = 0; i < 300; ++i) {
    const TaskItem it = t->item(Split::kTrain, i);
    EXPECT_NE(it.prompt.find("How many"), std::string::npos) << it.prompt;
    EXPECT_NE(it.prompt.find(kMathInstruction), std::string::npos);
    // Re-run the chain of "a op b = c" lines: each starts from the previous result.
    long long value = -1;
    int steps = 0;
    size_t at = 0;
    while ((at = it.solution.find(" = ", at)) != std::string::npos) {
      const size_t line = it.solution.rfind('\n', at) + 1;
      long long a = 0, b = 0, r = 0;
      char op = 0;
      const size_t has = it.solution.find(" has ", line);
      ASSERT_NE(has, std::string::npos) << it.solution;
      ASSERT_EQ(std::sscanf(it.solution.c_str() + has + 5, "%lld %c %lld = %lld", &a, &op, &b, &r), 4) << it.solution;
      if (value >= 0) {
        EXPECT_EQ(a, value) << it.solution;
      }
      const long long want = op == '+' ? a + b : op == '-' ? a - b : op == '*' ? a * b : (b ? a / b : -1);
      EXPECT_EQ(r, want) << it.solution;
      if (op == '/') {
        EXPECT_EQ(a % b, 0) << it.solution;
      }
      EXPECT_GE(r, 0) << it.solution;
      EXPECT_LE(r, 999) << it.solution;  // below 10^(digits + 1)
      ops_seen.insert(op);
      value = r;
      ++steps;
      at += 3;
    }
    EXPECT_GE(steps, 2) << it.solution;
    EXPECT_LE(steps, 3) << it.solution;
    EXPECT_EQ(std::to_string(value), it.answer) << it.solution;
    EXPECT_EQ(it.solution.substr(it.solution.rfind('\n') + 1), "#### " + it.answer);
  }
  EXPECT_EQ(ops_seen.size(), 4u);
  // Same seed, same problems; the expression style is unchanged by the new knob.
  EXPECT_EQ(task_make_arithmetic(c)->item(Split::kTrain, 5).solution, t->item(Split::kTrain, 5).solution);
  c.story = false;
  EXPECT_EQ(task_make_arithmetic(c)->item(Split::kTrain, 5).prompt.rfind("What is ", 0), 0u);
}

TEST(Tasks, CountdownContract) {
  CountdownConfig c;
  c.seed = 3;
  c.train_size = 2000;
  c.validation_size = 200;
  auto t = task_make_countdown(c);
  expect_task_contract(*t, 2000);
  EXPECT_EQ(t->item(Split::kTrain, 5).answer, task_make_countdown(c)->item(Split::kTrain, 5).answer);
}

TEST(Tasks, Gsm8kSplitsAndSolutions) {
  auto t = task_make_gsm8k(shared_data() + "/gsm8k", 1);
  EXPECT_EQ(t->size(Split::kValidation), 1319u);
  EXPECT_GT(t->size(Split::kTrain), 7400u);
  expect_task_contract(*t, t->size(Split::kTrain));
  const TaskItem it = t->item(Split::kTrain, 0);
  EXPECT_EQ(it.solution.find("<<"), std::string::npos);  // calculator annotations removed
  // Shuffled by seed, deterministically.
  auto again = task_make_gsm8k(shared_data() + "/gsm8k", 1), other = task_make_gsm8k(shared_data() + "/gsm8k", 2);
  EXPECT_EQ(again->item(Split::kTrain, 0).prompt, it.prompt);
  EXPECT_NE(other->item(Split::kTrain, 0).prompt, it.prompt);
}

std::string write_temp(const std::string& name, const std::string& text) {
  const auto p = std::filesystem::temp_directory_path() / ("fp8rl_test_" + name);
  std::ofstream(p, std::ios::binary) << text;
  return p.string();
}

TEST(Tasks, JsonlUserDataset) {
  std::string text;
  for (int i = 0; i < 40; ++i)
    text += "{\"q\": \"what is " + std::to_string(i) + " + 1?\", \"a\": " + std::to_string(i + 1) +
            ", \"s\": \"" + std::to_string(i) + " + 1 = " + std::to_string(i + 1) + "\\n#### " +
            std::to_string(i + 1) + "\"}\n\n";
  JsonlConfig c;
  c.train_path = write_temp("ok.jsonl", text);
  c.prompt_field = "q";
  c.answer_field = "a";
  c.solution_field = "s";
  c.validation_fraction = 0.25;
  auto t = task_make_jsonl(c);
  EXPECT_EQ(t->size(Split::kValidation), 10u);
  EXPECT_EQ(t->size(Split::kTrain), 30u);
  expect_task_contract(*t, 30);

  auto expect_error = [&](const std::string& body, const std::string& what) {
    JsonlConfig bad = c;
    bad.train_path = write_temp("bad.jsonl", body);
    try {
      task_make_jsonl(bad);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const std::string good = "{\"q\": \"x\", \"a\": \"1\", \"s\": \"#### 1\"}\n";
  expect_error(good + good + "{\"q\": \"y\", \"a\": 2\n", "bad.jsonl:3: not valid JSON");
  expect_error(good + "\n{\"a\": \"1\", \"s\": \"\"}\n", "bad.jsonl:3: missing field \"q\"");
  expect_error(good + "[1, 2]\n", "bad.jsonl:2: each line must be a JSON object");
  expect_error(good + "{\"q\": 5, \"a\": \"1\", \"s\": \"\"}\n", "bad.jsonl:2: field \"q\" must be a string");
  expect_error(good + "{\"q\": \"\xFF\", \"a\": \"1\", \"s\": \"\"}\n", "bad.jsonl:2: line is not valid UTF-8");
  expect_error("", "no items");
}

}  // namespace
}  // namespace fp8rl
