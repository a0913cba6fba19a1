// Issue 18, bring your own reward / dataset: the \boxed{} answer normalization, JSONL field
// mapping (nested keys, prompt templates, chat prompts) with errors naming file, row and field,
// and, when this fp8rl embeds Python, task.reward.python and parquet / HF save_to_disk datasets
// driving the tiny GRPO run (tests skip with a message when Python or pyarrow is missing).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "rl/config.h"
#include "rl/loop.h"
#include "tasks/answer.h"
#include "tasks/python_bridge.h"
#include "tasks/task.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

using test::Scratch;

std::string write(const std::string& name, const std::string& text) {
  const std::string p = Scratch::root() + "/" + name;
  write_file_atomic(p, text);
  return p;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

// ---- \boxed{} ---------------------------------------------------------------------------------

TEST(BoxedAnswer, NormalizesTrickyCases) {
  struct Case {
    const char* response;
    const char* reference;
    bool equal;
  } cases[] = {
      {"so the answer is \\boxed{\\frac{3}{4}}", "0.75", true},
      {"\\boxed{\\dfrac{3}{4}}", "3/4", true},
      {"\\boxed{\\frac34}", "0.75", true},
      {"\\boxed{\\frac{-3}{4}}", "-0.75", true},
      {"\\boxed{\\text{5 cm}}", "5", true},
      {"\\boxed{5\\text{ meters}}", "5", true},
      {"\\boxed{12 dollars}", "12", true},
      {"\\boxed{\\$1,000}", "1000", true},
      {"\\boxed{1{,}000{,}000}", "1000000", true},
      {"\\boxed{1\\,000}", "1000", true},
      {"\\boxed{$42$}", "42", true},
      {"\\boxed{45^\\circ}", "45", true},
      {"\\boxed{45^{\\circ}}", "45", true},
      {"\\boxed{20\\%}", "20", true},
      {"\\boxed{x = 7}", "7", true},
      {"\\boxed{\\left(2\\right)}", "(2)", true},
      {"first \\boxed{3} then \\boxed{4}", "4", true},
      {"\\boxed{\\textbf{B}}", "B", true},
      {"\\fbox{9}", "9", true},
      {"\\boxed{1,00}", "100", false},     // not a thousands grouping
      {"\\boxed{5 cm}", "6", false},
      {"\\boxed{\\frac{3}{4}}", "4/3", false},
      {"\\boxed{x^2 + 1}", "x^2 + 1", true},  // non-numeric: compared as normalized text
      {"no box here: 5", "5", false},
  };
  for (const Case& c : cases) {
    const auto got = answer_extract_boxed(c.response);
    const bool eq = got && answer_equal_normalized(*got, c.reference);
    EXPECT_EQ(eq, c.equal) << c.response << " vs " << c.reference << " (extracted: " << (got ? *got : "none") << ")";
  }
  EXPECT_FALSE(answer_extract_boxed("\\boxed{unclosed"));
  EXPECT_EQ(answer_normalize("\\text{(A)}"), "(A)");
}

// ---- datasets: field mapping ---------------------------------------------------------------------

TEST(DatasetMapping, NestedKeysTemplatesAndChatPrompts) {
  std::string text;
  for (int i = 0; i < 20; ++i)
    text += "{\"problem\": \"p" + std::to_string(i) + "\", \"reward_model\": {\"ground_truth\": \"" +
            std::to_string(i) + "\"}, \"chat\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", "
            "\"content\": \"u" + std::to_string(i) + "\"}]}\n";
  JsonlConfig c;
  c.train_path = write("dapo.jsonl", text);
  c.answer_field = "reward_model.ground_truth";
  c.prompt_template = "Solve: {problem} (put it in \\boxed{}; id {reward_model.ground_truth}) {{literal}}";
  auto t = task_make_jsonl(c);
  const TaskItem it = t->item(Split::kTrain, 0);
  const std::string gt = nlohmann::json::parse(it.fields_json)["reward_model"]["ground_truth"];
  EXPECT_EQ(it.answer, gt);
  EXPECT_EQ(it.prompt, "Solve: p" + gt + " (put it in \\boxed{}; id " + gt + ") {literal}");
  EXPECT_EQ(t->reward("\\boxed{" + gt + "}", it.answer), 1.0);
  c.prompt_template.clear();
  c.prompt_field = "chat";
  EXPECT_EQ(task_make_jsonl(c)->item(Split::kTrain, 0).prompt[0], 'u');  // the last user message

  // Errors name the file, the line and the field, and list what the row has.
  c.prompt_field = "question";
  std::string msg = error_of([&] { task_make_jsonl(c); });
  EXPECT_TRUE(has(msg, "dapo.jsonl:1: missing field \"question\" (the row has: chat, problem, reward_model)")) << msg;
  c.prompt_field = "problem";
  c.answer_field = "reward_model.truth";
  msg = error_of([&] { task_make_jsonl(c); });
  EXPECT_TRUE(has(msg, "dapo.jsonl:1: missing field \"reward_model.truth\"")) << msg;
  c.answer_field = "answer";
  c.prompt_template = "{problme}";
  msg = error_of([&] { task_make_jsonl(c); });
  EXPECT_TRUE(has(msg, "prompt_template names {problme}")) << msg;
  c.train_path = Scratch::root() + "/missing.jsonl";
  msg = error_of([&] { task_make_jsonl(c); });
  EXPECT_TRUE(has(msg, "missing.jsonl' does not exist")) << msg;
}

// ---- Python -------------------------------------------------------------------------------------

bool embedded_python_has(const std::string& module) {
  if (!python_available()) return false;
  // The interpreter the tests start is the one CMake embedded (python3 on the PATH at configure time).
  return std::system(("python3 -c 'import " + module + "' > /dev/null 2>&1").c_str()) == 0;
}

#define REQUIRE_PYTHON()                                                                                     \
  if (!python_available())                                                                                   \
    GTEST_SKIP() << "this fp8rl was built without Python (python3-dev + pybind11-dev; FP8RL_PYTHON=ON)"

TEST(PythonReward, ScoresBatchesAndReportsErrors) {
  if (!python_available()) {
    std::string msg = error_of([] { PythonReward r("x:y"); });
    EXPECT_TRUE(has(msg, "built without")) << msg;
    GTEST_SKIP() << "this fp8rl was built without Python (python3-dev + pybind11-dev; FP8RL_PYTHON=ON)";
  }
  const std::string file = write("rewards.py",
                                 "def score(samples):\n"
                                 "    return [1.0 if s['response'].strip() == s['answer'] else 0.0 for s in samples]\n"
                                 "def detailed(samples):\n"
                                 "    return [{'reward': float(len(s['response'])), 'length': len(s['response']),\n"
                                 "             'note': 'text is not a metric'} for s in samples]\n"
                                 "def broken(samples):\n"
                                 "    return [1.0 / (len(s['response']) - 3) for s in samples]\n"
                                 "def short(samples):\n"
                                 "    return [0.0]\n"
                                 "def nan(samples):\n"
                                 "    return [float('nan') for s in samples]\n");
  std::vector<nlohmann::json> batch = {{{"prompt", "a"}, {"response", "7"}, {"answer", "7"}, {"extra", 1}},
                                       {{"prompt", "b"}, {"response", "abc"}, {"answer", "5"}}};
  PythonReward r(file + ":score");
  EXPECT_EQ(r.score(batch).rewards, (std::vector<double>{1.0, 0.0}));
  // A byte-level tokenizer can decode a partial UTF-8 sequence: the text reaches Python with U+FFFD.
  std::vector<nlohmann::json> torn = {{{"prompt", "a"}, {"response", "7\xBF"}, {"answer", "7"}}};
  EXPECT_EQ(r.score(torn).rewards, (std::vector<double>{0.0}));
  const PythonRewardResult d = PythonReward(file + ":detailed").score(batch);
  EXPECT_EQ(d.rewards, (std::vector<double>{1.0, 3.0}));
  ASSERT_EQ(d.metrics.size(), 1u);
  EXPECT_EQ(d.metrics[0].first, "length");
  EXPECT_DOUBLE_EQ(d.metrics[0].second, 2.0);

  std::string msg = error_of([&] { PythonReward(file + ":broken").score(batch); });
  EXPECT_TRUE(has(msg, "Traceback")) << msg;
  EXPECT_TRUE(has(msg, "ZeroDivisionError")) << msg;
  EXPECT_TRUE(has(msg, "rewards.py\", line 7")) << msg;
  EXPECT_TRUE(has(msg, "sample that fails on its own is #1")) << msg;
  EXPECT_TRUE(has(msg, "\"response\":\"abc\"")) << msg;
  msg = error_of([&] { PythonReward(file + ":short").score(batch); });
  EXPECT_TRUE(has(msg, "returned 1 values for 2 samples")) << msg;
  msg = error_of([&] { PythonReward(file + ":nan").score(batch); });
  EXPECT_TRUE(has(msg, "non-finite")) << msg;
  msg = error_of([&] { PythonReward(file + ":nothere"); });
  EXPECT_TRUE(has(msg, "has no function 'nothere' (it defines: broken, detailed, nan, score, short)")) << msg;
  msg = error_of([&] { PythonReward("no_such_module_fp8rl:score"); });
  EXPECT_TRUE(has(msg, "cannot import module 'no_such_module_fp8rl'")) << msg;
  EXPECT_TRUE(has(msg, "PYTHONPATH")) << msg;
}

// The tiny GRPO run of tests/cpu/test_rl_loop.cpp.
std::vector<std::string> tiny_overrides(int steps) {
  return {"model.tiny.hidden_size=32",  "model.tiny.num_layers=1",   "model.tiny.num_heads=2",
          "model.tiny.num_kv_heads=1",  "model.tiny.head_dim=16",    "model.tiny.intermediate_size=64",
          "rollout.prompts_per_step=2", "rollout.generations_per_prompt=4", "rollout.max_new_tokens=6",
          "val_every=2",                "val_size=4",                "sft.steps=20", "sft.lr=1e-2",
          "sft.batch_size=4",           "train.optimizer_steps_per_rollout=2", "train.lr=1e-3",
          "precision.recipe=bf16",      "steps=" + std::to_string(steps)};
}

// Parquet and HF save_to_disk rows written by pyarrow (a problem / solution / answer dataset
// in the OpenMathInstruct-2 shape).
void write_tables(const std::string& parquet, const std::string& hf_dir) {
  const std::string script = write("make_tables.py",
                                   "import json, os, sys\n"
                                   "import pyarrow as pa, pyarrow.parquet as pq\n"
                                   "rows = [{'problem': f'pick {i}', 'expected_answer': str(1 + i % 2),\n"
                                   "         'generated_solution': str(1 + i % 2), 'meta': {'id': i}} for i in range(64)]\n"
                                   "t = pa.Table.from_pylist(rows)\n"
                                   "pq.write_table(t, sys.argv[1])\n"
                                   "os.makedirs(sys.argv[2], exist_ok=True)\n"
                                   "with pa.OSFile(os.path.join(sys.argv[2], 'data-00000-of-00001.arrow'), 'wb') as f:\n"
                                   "    with pa.ipc.new_stream(f, t.schema) as w: w.write_table(t)\n"
                                   "json.dump({'_data_files': [{'filename': 'data-00000-of-00001.arrow'}]},\n"
                                   "          open(os.path.join(sys.argv[2], 'state.json'), 'w'))\n");
  ASSERT_EQ(std::system(("python3 '" + script + "' '" + parquet + "' '" + hf_dir + "'").c_str()), 0);
}

TEST(PythonDataset, ParquetAndHfDatasetAndPythonRewardDriveTheTinyRun) {
  REQUIRE_PYTHON();
  if (!embedded_python_has("pyarrow")) GTEST_SKIP() << "pyarrow is not installed (pip install pyarrow)";
  const std::string parquet = Scratch::root() + "/train.parquet", hf = Scratch::root() + "/hf_train";
  write_tables(parquet, hf);
  const std::vector<nlohmann::json> rows = python_read_table(parquet);
  ASSERT_EQ(rows.size(), 64u);
  EXPECT_EQ(rows[3]["problem"], "pick 3");
  EXPECT_EQ(rows[3]["meta"]["id"], 3);
  EXPECT_EQ(python_read_table(hf), rows);
  fs::create_directories(Scratch::root() + "/empty_dir");
  std::string msg = error_of([&] { python_read_table(Scratch::root() + "/empty_dir"); });
  EXPECT_TRUE(has(msg, "holds no parquet files")) << msg;

  const std::string reward = write("my_reward.py",
                                   "def score(samples):\n"
                                   "    out = []\n"
                                   "    for s in samples:\n"
                                   "        ok = s['response'].strip() == s['expected_answer']\n"
                                   "        out.append({'reward': 1.0 if ok else 0.0, 'has_id': float(s['meta']['id'] >= 0)})\n"
                                   "    return out\n");
  for (const std::string& data : {parquet, hf}) {
    std::vector<std::string> o = tiny_overrides(2);
    const std::string out = Scratch::root() + "/run_" + fs::path(data).filename().string();
    for (const std::string& k : std::vector<std::string>{"task.name=jsonl", "task.jsonl.path=" + data, "task.jsonl.prompt_field=problem",
                                 "task.jsonl.answer_field=expected_answer",
                                 "task.jsonl.solution_field=generated_solution", "task.reward.python=" + reward + ":score",
                                 "out=" + out})
      o.push_back(k);
    ASSERT_EQ(grpo_run(config_load("", o), false), 0);
    std::ifstream f(out + "/metrics.jsonl");
    int steps = 0;
    for (std::string line; std::getline(f, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j["step"] == 0) continue;
      ++steps;
      EXPECT_DOUBLE_EQ(j["reward/has_id"].get<double>(), 1.0) << line;
      EXPECT_TRUE(j["time_reward_s"].is_number());
      EXPECT_TRUE(j["reward_mean"].is_number());
    }
    EXPECT_EQ(steps, 2);
  }

  // A reward that raises stops the run: traceback, the sample, and the batch kept on disk.
  const std::string bad = write("bad_reward.py", "def score(samples):\n    return [s['no_such_field'] for s in samples]\n");
  std::vector<std::string> o = tiny_overrides(2);
  const std::string out = Scratch::root() + "/run_bad";
  for (const std::string& k : std::vector<std::string>{"task.name=jsonl", "task.jsonl.path=" + parquet, "task.jsonl.prompt_field=problem",
                               "task.jsonl.answer_field=expected_answer", "task.jsonl.solution_field=generated_solution",
                               "task.reward.python=" + bad + ":score", "val_every=0", "out=" + out})
    o.push_back(k);
  msg = error_of([&] { grpo_run(config_load("", o), false); });
  EXPECT_TRUE(has(msg, "KeyError: 'no_such_field'")) << msg;
  EXPECT_TRUE(has(msg, "sample that fails on its own is #0")) << msg;
  EXPECT_TRUE(has(msg, "reward_failure.jsonl")) << msg;
  EXPECT_TRUE(fs::exists(out + "/reward_failure.jsonl"));
}

}  // namespace
}  // namespace fp8rl
