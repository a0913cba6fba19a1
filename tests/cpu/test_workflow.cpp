// Issue 18, the command line as a user meets it: errors without source locations, one grammar
// for config keys (--key=value, --key value, key=value), did-you-mean for flags and commands,
// --version, --help everywhere, config paths relative to the config file, --resume from the
// run's own config (printed as a diff; a finished run says so), checkpoint.keep_last,
// the "nothing is learned" warning, SFT without worked solutions, Ctrl-C naming the last
// checkpoint, TensorBoard event files (read back by the tensorboard package when installed),
// and the progress display.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "core/suggest.h"
#include "io/tensorboard.h"
#include "rl/checkpoint.h"
#include "rl/config.h"
#include "rl/loop.h"
#include "rl/metrics.h"
#include "rl/metrics_log.h"
#include "rl/run_dir.h"
#include "test_model_util.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

using test::Scratch;

using test::fresh_dir;

std::string quote(const std::string& s) { return "'" + s + "'"; }

// Runs fp8rl with `args`; stdout and stderr together in `out`. Returns the exit code.
int run_fp8rl(const std::vector<std::string>& args, std::string& out, const std::string& env = "") {
  return test::run_binary_in(Scratch::root(), args, out, env);
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The tiny run of tests/cpu/test_rl_loop.cpp: seconds on one core.
std::vector<std::string> tiny_overrides(int steps) {
  return {"model.tiny.hidden_size=32",  "model.tiny.num_layers=1",   "model.tiny.num_heads=2",
          "model.tiny.num_kv_heads=1",  "model.tiny.head_dim=16",    "model.tiny.intermediate_size=64",
          "rollout.prompts_per_step=2", "rollout.generations_per_prompt=2", "rollout.max_new_tokens=6",
          "val_every=0",                "val_size=4",                "sft.steps=4",
          "sft.batch_size=4",           "train.optimizer_steps_per_rollout=2", "train.lr=1e-3",
          "precision.recipe=bf16",      "steps=" + std::to_string(steps)};
}

// ---- errors ---------------------------------------------------------------------------------

TEST(Workflow, UserErrorsHaveNoSourceLocationUnlessDebug) {
  try {
    FP8RL_CHECK(1 + 1 == 3, "the sum is wrong; fix the adder");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "the sum is wrong; fix the adder");
    EXPECT_TRUE(has(e.what(), "check failed: 1 + 1 == 3")) << e.what();
    EXPECT_TRUE(has(e.what(), "test_workflow.cpp:")) << e.what();
    ::unsetenv("FP8RL_DEBUG");
    EXPECT_EQ(error_user_text(e), "the sum is wrong; fix the adder");
    ::setenv("FP8RL_DEBUG", "1", 1);
    EXPECT_EQ(error_user_text(e), e.what());
    ::unsetenv("FP8RL_DEBUG");
  }
  std::string out;
  EXPECT_EQ(run_fp8rl({"train", "model.path=/nonexistent/model"}, out), 1);
  EXPECT_TRUE(has(out, "model.path '/nonexistent/model' does not exist")) << out;
  EXPECT_FALSE(has(out, ".cpp:")) << out;
  EXPECT_FALSE(has(out, "check failed")) << out;
  EXPECT_EQ(run_fp8rl({"train", "model.path=/nonexistent/model"}, out, "FP8RL_DEBUG=1"), 1);
  EXPECT_TRUE(has(out, "session.cpp:")) << out;
}

// A tokenizer that does not belong to the model: said so, not an out-of-vocabulary id later.
TEST(Workflow, TokenizerModelMismatchIsNamed) {
  const std::string dir = fresh_dir("mismatch_model");
  model_weights_save(test::tiny_model("qwen3", DType::F32, 5, /*vocab=*/48), dir);
  const char* env = std::getenv("FP8RL_SHARED_DATA");
  const std::string tok = std::string(env && *env ? env : FP8RL_SHARED_DATA) + "/tokenizers/qwen3/tokenizer.json";
  if (!fs::exists(tok)) GTEST_SKIP() << tok << " is missing";
  std::string out;
  EXPECT_EQ(run_fp8rl({"generate", "--model", dir, "--tokenizer", tok, "--prompt", "hi"}, out), 1);
  EXPECT_TRUE(has(out, "they do not belong together")) << out;
  EXPECT_EQ(run_fp8rl({"train", "model.path=" + dir, "tokenizer.path=" + tok, "out=" + fresh_dir("mm_run")}, out), 1);
  EXPECT_TRUE(has(out, "they do not belong together")) << out;
  EXPECT_EQ(run_fp8rl({"train", "model.path=" + dir, "out=" + fresh_dir("mm_run2")}, out), 1);
  EXPECT_TRUE(has(out, "has no tokenizer.json; set tokenizer.path")) << out;
}

TEST(Workflow, SuggestNearest) {
  EXPECT_EQ(suggest_nearest("trian", {"train", "sft", "plot"}), "train");
  EXPECT_EQ(suggest_nearest("xyzzy", {"train", "sft", "plot"}), "");
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
}

// ---- the command line -------------------------------------------------------------------------

TEST(Workflow, OneGrammarForConfigKeys) {
  Scratch::root();
  std::string out;
  for (const std::vector<std::string>& form : {std::vector<std::string>{"--steps=7"}, {"--steps", "7"}, {"steps=7"}}) {
    std::vector<std::string> args = {"train", "--print-config"};
    args.insert(args.end(), form.begin(), form.end());
    ASSERT_EQ(run_fp8rl(args, out), 0) << out;
    EXPECT_TRUE(has(out, "\nsteps: 7 ")) << form[0] << "\n" << out;
  }
  ASSERT_EQ(run_fp8rl({"train", "--print-config", "--train.lr=0.5", "--out=/tmp/x_run"}, out), 0) << out;
  EXPECT_TRUE(has(out, "lr: 0.5 ")) << out;
  EXPECT_TRUE(has(out, "out: \"/tmp/x_run\"")) << out;
  // Key aliases users bring from other tools.
  ASSERT_EQ(run_fp8rl({"train", "--print-config", "--task.jsonl.prompt_key=problem", "task.jsonl.answer_key=gt"}, out), 0)
      << out;
  EXPECT_TRUE(has(out, "prompt_field: \"problem\"")) << out;
  EXPECT_TRUE(has(out, "answer_field: \"gt\"")) << out;
  EXPECT_EQ(run_fp8rl({"train", "--stesp=2"}, out), 1);
  EXPECT_TRUE(has(out, "did you mean --steps?")) << out;
  EXPECT_EQ(run_fp8rl({"train", "--resum"}, out), 1);
  EXPECT_TRUE(has(out, "did you mean --resume?")) << out;
  EXPECT_EQ(run_fp8rl({"trian"}, out), 2);
  EXPECT_TRUE(has(out, "did you mean 'train'?")) << out;
  EXPECT_EQ(run_fp8rl({"--version"}, out), 0);
  EXPECT_TRUE(has(out, "fp8rl ")) << out;
  EXPECT_TRUE(has(out, "CUDA")) << out;  // "CUDA backend" or "no CUDA: CPU backend only"
}

TEST(Workflow, EverySubcommandHasHelp) {
  for (const char* cmd : {"train", "sft", "eval", "generate", "logprobs", "tokenize", "plot", "plan", "bench",
                          "bench-generate", "bench-sample", "bench-train-step", "bench-gemm", "bench-tokenize"}) {
    std::string out;
    EXPECT_EQ(run_fp8rl({cmd, "--help"}, out), 0) << cmd << ": " << out;
    EXPECT_TRUE(has(out, "usage") || has(out, "fp8rl")) << cmd << ": " << out;
  }
  std::string out;
  EXPECT_EQ(run_fp8rl({"bench", "tokenize", "--help"}, out), 0) << out;
}

// ---- config paths and diffs --------------------------------------------------------------------

TEST(Workflow, ConfigPathsResolveAgainstTheConfigFolder) {
  const std::string dir = fresh_dir("cfg_paths");
  make_dirs(dir + "/sub");
  write_file_atomic(dir + "/sub/run.yaml",
                    "task:\n  name: jsonl\n  jsonl:\n    path: data/train.jsonl\n  reward:\n    python: "
                    "\"rewards.py:score\"\ntokenizer:\n  path: /abs/tok\n");
  const RunConfig c = config_load(dir + "/sub/run.yaml");
  EXPECT_EQ(c.task.jsonl.path, fs::path(dir + "/sub/data/train.jsonl").lexically_normal().string());
  EXPECT_EQ(c.task.reward.python, fs::path(dir + "/sub/rewards.py").lexically_normal().string() + ":score");
  EXPECT_EQ(c.tokenizer.path, "/abs/tok");
  // On the command line: against the current directory; a module name stays as it is.
  const RunConfig o = config_load("", {"task.jsonl.path=x.jsonl", "task.reward.python=my_rewards:score"});
  EXPECT_EQ(o.task.jsonl.path, (fs::current_path() / "x.jsonl").string());
  EXPECT_EQ(o.task.reward.python, "my_rewards:score");
  // The shipped GPU config names data beside the checkout, from its own folder.
  const RunConfig g = config_load(std::string(FP8RL_SOURCE_DIR) + "/configs/gsm8k_gpu.yaml");
  EXPECT_EQ(g.task.gsm8k.path, fs::path(std::string(FP8RL_SOURCE_DIR) + "/../shared/data/gsm8k").lexically_normal().string());
}

TEST(Workflow, ResumeTakesTheRunsConfigWithOverridesOnTop) {
  const std::string run = fresh_dir("resume_cfg");
  make_dirs(run);
  RunConfig saved = config_load("", {"steps=6", "train.lr=1e-3", "out=" + run});
  write_file_atomic(run + "/config.yaml", config_to_yaml(saved));
  std::vector<std::string> changes;
  const RunConfig c = run_dir_resume_config(run, {"steps=20"}, &changes);
  EXPECT_EQ(c.steps, 20);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);  // from the run, not the built-in default
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0], "steps: 6 -> 20");
  EXPECT_THROW(run_dir_resume_config(fresh_dir("no_run"), {}), Error);
}

// ---- checkpoints, warnings, SFT ----------------------------------------------------------------

TEST(Workflow, KeepLastPrunesOldCheckpoints) {
  const std::string dir = fresh_dir("prune");
  for (int s = 1; s <= 5; ++s) {
    char name[32];
    std::snprintf(name, sizeof name, "/step_%06d", s);
    make_dirs(dir + name);
    write_file_atomic(dir + name + "/trainer_state.json", "{}");
  }
  make_dirs(dir + "/step_000000.pruned");  // a leftover of a crash mid-prune
  write_file_atomic(dir + "/latest", "step_000005\n");
  EXPECT_TRUE(checkpoint_prune(dir, 0).empty());
  const auto pruned = checkpoint_prune(dir, 2);
  EXPECT_EQ(pruned.size(), 3u);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "step_000004", "step_000005"}));
}

TEST(Workflow, NoSignalWatchWarnsAfterKFlatSteps) {
  NoSignalWatch w(3);
  const std::vector<float> zeros(8, 0.f), mixed = {0, 1, 0, 0, 1, 1, 1, 1};
  EXPECT_FALSE(w.record(1, zeros, 4, 0.0));
  EXPECT_FALSE(w.record(2, zeros, 4, 0.0));
  const auto msg = w.record(3, zeros, 4, 0.0);
  ASSERT_TRUE(msg);
  EXPECT_TRUE(has(*msg, "steps 1-3 learned nothing")) << *msg;
  EXPECT_TRUE(has(*msg, "every reward was 0")) << *msg;
  EXPECT_FALSE(w.record(4, zeros, 4, 0.0));  // once per streak
  EXPECT_FALSE(w.record(5, mixed, 4, 0.3));
  const std::vector<float> flat_groups = {1, 1, 1, 1, 0, 0, 0, 0};  // each group equal, not all equal
  EXPECT_FALSE(w.record(6, flat_groups, 4, 0.0));
  EXPECT_FALSE(w.record(7, flat_groups, 4, 0.0));
  const auto m2 = w.record(8, flat_groups, 4, 0.0);
  ASSERT_TRUE(m2);
  EXPECT_TRUE(has(*m2, "within every group")) << *m2;
}

TEST(Workflow, WarmupSftRefusesATaskWithoutSolutions) {
  Scratch::root();
  const std::string data = Scratch::root() + "/nosol.jsonl";
  std::string text;
  for (int i = 0; i < 40; ++i) text += "{\"prompt\": \"q" + std::to_string(i) + "\", \"answer\": \"1\"}\n";
  write_file_atomic(data, text);
  std::vector<std::string> o = tiny_overrides(1);
  o.push_back("task.name=jsonl");
  o.push_back("task.jsonl.path=" + data);
  o.push_back("out=" + fresh_dir("nosol_run"));
  try {
    grpo_run(config_load("", o), false);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.message(), "no worked solutions")) << e.message();
    EXPECT_TRUE(has(e.message(), "task.jsonl.solution_field")) << e.message();
  }
}

// ---- TensorBoard ------------------------------------------------------------------------------

TEST(Workflow, Crc32cAndRecordFraming) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(reinterpret_cast<const uint8_t*>(check.data()), check.size()), 0xE3069283u);  // RFC 3720 check
  const std::string rec = tfrecord_frame("abc");
  ASSERT_EQ(rec.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(rec.substr(12, 3), "abc");
  uint64_t len = 0;
  std::memcpy(&len, rec.data(), 8);
  EXPECT_EQ(len, 3u);
}

bool python_has(const std::string& module) {
  const std::string cmd = "python3 -c 'import " + module + "' > /dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

// One tiny run through the binary: TensorBoard events, keep_last, Ctrl-C-free resume paths.
TEST(Workflow, TrainRunTensorBoardKeepLastAndResume) {
  Scratch::root();
  const std::string run = fresh_dir("tb_run");
  std::vector<std::string> args = {"train", "--out", run, "logger.tensorboard=true", "checkpoint_every=1",
                                   "checkpoint.keep_last=2"};
  for (const std::string& o : tiny_overrides(3)) args.push_back(o);
  std::string out;
  ASSERT_EQ(run_fp8rl(args, out), 0) << out;
  EXPECT_TRUE(has(out, "legend: ")) << out;
  EXPECT_TRUE(has(out, "done in ")) << out;
  EXPECT_TRUE(has(out, "tokens/s")) << out;
  // keep_last=2: only the two newest checkpoints remain.
  EXPECT_FALSE(fs::exists(run + "/checkpoints/step_000001"));
  EXPECT_TRUE(fs::exists(run + "/checkpoints/step_000002"));
  EXPECT_TRUE(fs::exists(run + "/checkpoints/step_000003"));

  // Resuming a finished run says so and does nothing.
  ASSERT_EQ(run_fp8rl({"train", "--out", run, "--resume"}, out), 0) << out;
  EXPECT_TRUE(has(out, "is finished")) << out;
  // Resuming with more steps: the run's config (not the defaults) plus the change, as a diff.
  ASSERT_EQ(run_fp8rl({"train", "--out", run, "--resume", "steps=4"}, out), 0) << out;
  EXPECT_TRUE(has(out, "steps: 3 -> 4")) << out;
  const RunConfig after = config_load(run + "/config.yaml");
  EXPECT_EQ(after.steps, 4);
  EXPECT_EQ(after.model.tiny.hidden_size, 32);  // the run's, not the default 64
  EXPECT_TRUE(after.logger.tensorboard);

  ASSERT_TRUE(fs::is_directory(run + "/tensorboard"));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(run + "/tensorboard"))
    files += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_EQ(files, 2u);  // the first run and the resumed one
  if (!python_has("tensorboard")) {
    GTEST_SKIP() << "python3 with the tensorboard package is not installed (pip install tensorboard); "
                    "the event files were written but not read back";
  }
  const std::string script = Scratch::root() + "/read_tb.py", json = Scratch::root() + "/tb.json";
  write_file_atomic(script,
                    "import json, sys\n"
                    "from tensorboard.backend.event_processing import event_accumulator as ea\n"
                    "acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})\n"
                    "acc.Reload()\n"
                    "out = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}\n"
                    "json.dump(out, open(sys.argv[2], 'w'))\n");
  const std::string cmd = "python3 " + quote(script) + " " + quote(run + "/tensorboard") + " " + quote(json);
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const nlohmann::json tb = nlohmann::json::parse(read_file(json));
  ASSERT_TRUE(tb.contains("reward_mean")) << tb.dump();
  ASSERT_TRUE(tb.contains("loss"));
  std::ifstream metrics(run + "/metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t step = j["step"];
    for (const char* k : {"reward_mean", "loss", "grad_norm"}) {
      if (!j[k].is_number()) continue;
      bool found = false;
      for (const auto& pt : tb[k])
        if (pt[0].get<int64_t>() == step) {
          EXPECT_FLOAT_EQ(pt[1].get<float>(), j[k].get<float>()) << k << " step " << step;
          found = true;
        }
      EXPECT_TRUE(found) << k << " step " << step;
    }
    ++lines;
  }
  EXPECT_EQ(lines, 4);
}

// Ctrl-C: the message names the last checkpoint and how to resume; exit code 130.
TEST(Workflow, InterruptNamesTheLastCheckpoint) {
  Scratch::root();
  const std::string run = fresh_dir("sigint_run"), log = Scratch::root() + "/sigint.log";
  std::vector<std::string> args = {FP8RL_BINARY, "train", "--out", run, "checkpoint_every=1"};
  for (const std::string& o : tiny_overrides(100000)) args.push_back(o);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    std::freopen("/dev/null", "w", stdout);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(FP8RL_BINARY, argv.data());
    ::_exit(127);
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (!fs::exists(run + "/checkpoints/latest") && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(pid, SIGINT);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  const std::string err = read_file(log);
  EXPECT_TRUE(has(err, "interrupted; the last checkpoint is " + run + "/checkpoints/step_")) << err;
  EXPECT_TRUE(has(err, "fp8rl train --out " + run + " --resume")) << err;
}

// ---- console ----------------------------------------------------------------------------------

TEST(Workflow, ProgressShowsEtaAndStaysPlainOffTerminal) {
  EXPECT_EQ(format_duration(12.34), "12.3s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(3720), "1h02m");
  EXPECT_EQ(Progress::format_tail(0, 10, 1.0), "0/10 1.0s");
  EXPECT_EQ(Progress::format_tail(5, 10, 10.0), "5/10 10.0s ETA 10.0s");
  const std::string path = Scratch::root() + "/progress.txt";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    Progress p("gen", 4, f, /*tty=*/0, /*line_interval_s=*/0.0);
    p.update(2);
    p.update(4);
    p.finish();
    std::fclose(f);
  }
  const std::string text = read_file(path);
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  EXPECT_EQ(text.find('\033'), std::string::npos) << text;
  EXPECT_TRUE(has(text, "gen: 2/4")) << text;
  EXPECT_TRUE(has(text, "gen: 4/4")) << text;
  EXPECT_TRUE(has(metrics_console_legend(), "mult_err = token_mult_prob_error"));
}

}  // namespace
}  // namespace fp8rl
