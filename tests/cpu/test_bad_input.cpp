// Issue 20: bad input never crashes, never allocates what it should refuse, never loses a run.
// Each test is one class of the probe's failures: deep or huge JSON/YAML, size-like values
// beyond their real bound, numbers read loosely, non-finite training that never reached the
// skip/count/abort path, and checkpoint state that could rewind or corrupt a run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "io/json_input.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/weights.h"
#include "rl/checkpoint.h"
#include "rl/config.h"
#include "rl/loop.h"
#include "rl/session.h"
#include "tasks/task.h"
#include "support/test_support.h"
#include "test_model_util.h"
#include "tokenizer/tokenizer.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kData = FP8RL_TEST_DATA;

// A per-process scratch directory (removed at exit); FP8RL_CACHE_DIR points to its cache
// (test::test_cache_dir: shared by the processes of a ctest run).
const std::string& scratch() {
  struct S {
    std::string root;
    S() {
      root = (fs::temp_directory_path() / ("fp8rl_test_bad_input_" + std::to_string(::getpid()))).string();
      fs::remove_all(root);
      fs::create_directories(root);
      ::setenv("FP8RL_CACHE_DIR", test::test_cache_dir(root).c_str(), 1);
    }
    ~S() {
      std::error_code ec;
      fs::remove_all(root, ec);
    }
  };
  static S s;
  return s.root;
}

std::string fresh_dir(const std::string& name) {
  const std::string d = scratch() + "/" + name;
  fs::remove_all(d);
  return d;
}

// The message of the Error `f` throws ("" and a test failure when it throws nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no fp8rl::Error thrown";
  return "";
}

std::string nested_arrays(size_t depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

std::string tokenizer_text() { return read_file(kData + "/tokenizers/tiny/tokenizer.json"); }

// ---- JSON and YAML: depth and size limits applied while parsing -----------------------------

// ~100k-200k levels used to overflow the stack in the copies and dump()s that walk the tree.
TEST(BadInputJson, DeepNestingIsRefusedWhileParsingInEveryInput) {
  const std::string deep = nested_arrays(200000);
  const std::string tok = tokenizer_text();
  for (const char* key : {"normalizer", "pre_tokenizer", "decoder", "added_tokens"}) {
    SCOPED_TRACE(key);
    json j = json::parse(tok);
    std::string text = j.dump();
    // Splice the deep value in as text (building it as a json value would itself recurse).
    j[key] = "@DEEP@";
    text = j.dump();
    text.replace(text.find("\"@DEEP@\""), 8, deep);
    const std::string msg = error_of([&] { Tokenizer::from_json(text, "", "deep.json"); });
    EXPECT_NE(msg.find("nested more than"), std::string::npos) << msg.substr(0, 300);
    EXPECT_NE(msg.find("deep.json"), std::string::npos) << msg.substr(0, 300);
  }
  {
    json j = json::parse(tok);
    j["model"]["merges"][0] = "@DEEP@";
    std::string text = j.dump();
    text.replace(text.find("\"@DEEP@\""), 8, deep);
    EXPECT_NE(error_of([&] { Tokenizer::from_json(text, "", "deep.json"); }).find("nested more than"),
              std::string::npos);
  }
  const std::string cfg = "{\"model_type\": \"qwen3\", \"rope_scaling\": " + deep + "}";
  EXPECT_NE(error_of([&] { model_config_from_json(cfg, "config.json"); }).find("nested more than"),
            std::string::npos);
  // A safetensors header whose shape nests deeply.
  const std::string header = "{\"w\": {\"dtype\": \"F32\", \"shape\": " + deep + ", \"data_offsets\": [0, 4]}}";
  std::string file(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  file += header + "abcd";
  const std::string msg = error_of([&] {
    safetensors_parse_header(reinterpret_cast<const uint8_t*>(file.data()), file.size(), "deep.safetensors");
  });
  EXPECT_NE(msg.find("nested more than"), std::string::npos) << msg.substr(0, 300);
}

TEST(BadInputJson, ErrorsDescribeLargeValuesInsteadOfDumpingThem) {
  std::string big = "[";
  for (int i = 0; i < 200000; ++i) big += (i ? "," : "") + std::to_string(i);
  big += "]";
  const std::string cfg = "{\"model_type\": \"qwen3\", \"vocab_size\": 32, \"hidden_size\": " + big + "}";
  const std::string msg = error_of([&] { model_config_from_json(cfg, "config.json"); });
  EXPECT_NE(msg.find("hidden_size"), std::string::npos) << msg.substr(0, 300);
  EXPECT_NE(msg.find("an array of 200000 elements"), std::string::npos) << msg.substr(0, 300);
  EXPECT_LT(msg.size(), 400u);
  EXPECT_EQ(json_brief(json::parse("[1, 2, 3]")), "[1,2,3]");
  EXPECT_NE(json_brief(json(std::string(10000, 'x'))).find("(10000 bytes)"), std::string::npos);
}

TEST(BadInputJson, SizeLimitsAreCheckedBeforeReading) {
  EXPECT_NE(error_of([&] { json_parse_limited(std::string(2000, ' ') + "{}", "x.json", {1000, 8}); })
                .find("more than the"),
            std::string::npos);
  const std::string dir = fresh_dir("big_tokenizer");
  fs::create_directories(dir);
  {
    std::ofstream f(dir + "/tokenizer.json", std::ios::binary);
    f.seekp((std::streamoff(257) << 20) - 1);  // sparse: 257 MiB of nothing
    f.put('\0');
  }
  const std::string msg = error_of([&] { Tokenizer::load(dir); });
  EXPECT_NE(msg.find("limit"), std::string::npos) << msg;
}

// Vocabulary ids must be integers in range: 4294967596 used to wrap to 300, 300.9 to truncate
// to 300, and 268435455 to allocate a table of 2^28 tokens before failing.
TEST(BadInputJson, TokenIdsAreExactIntegersNearTheTokenCount) {
  const std::string tok = tokenizer_text();
  for (const std::string bad : {"4294967596", "300.9", "268435455", "-1", "\"7\""}) {
    SCOPED_TRACE(bad);
    json j = json::parse(tok);
    j["model"]["vocab"]["@ID@"] = 0;
    std::string text = j.dump();
    text.replace(text.find("\"@ID@\":0"), 8, "\"@ID@\":" + bad);
    const std::string msg = error_of([&] { Tokenizer::from_json(text, "", "ids.json"); });
    EXPECT_NE(msg.find("must be an integer in [0, "), std::string::npos) << msg;
    EXPECT_NE(msg.find("@ID@"), std::string::npos) << msg;
  }
  json j = json::parse(tok);
  j["added_tokens"] = json::array({{{"content", "<big>"}, {"id", 300.9}, {"special", true}}});
  EXPECT_NE(error_of([&] { Tokenizer::from_json(j.dump(), "", "ids.json"); }).find("must be an integer"),
            std::string::npos);
}

TEST(BadInputYaml, UnclosedQuoteAndDeepNestingAreErrors) {
  RunConfig c;
  for (const std::string text : {"out: \"runs/x\n", "train:\n  lr: \"1e-3\nsteps: 3\n", "out: 'abc\n"}) {
    SCOPED_TRACE(text);
    const std::string msg = error_of([&] { config_apply_yaml(c, text, "bad.yaml"); });
    EXPECT_NE(msg.find("bad.yaml"), std::string::npos) << msg;
  }
  std::string deep = "train:\n";
  for (int i = 0; i < 12; ++i) deep += std::string(2 * (i + 1), ' ') + "k" + std::to_string(i) + ":\n";
  deep += std::string(26, ' ') + "x: 1\n";
  EXPECT_NE(error_of([&] { config_apply_yaml(c, deep, "deep.yaml"); }).find("nested more than"), std::string::npos);
  EXPECT_NE(error_of([&] { config_apply_yaml(c, "steps: " + nested_arrays(100000) + "\n", "deep.yaml"); })
                .find("deep.yaml"),
            std::string::npos);
  // A closed string still reads, with or without a final newline.
  config_apply_yaml(c, "out: \"runs/x\"\n", "ok.yaml");
  EXPECT_EQ(c.out, "runs/x");
  config_apply_yaml(c, "out: 'runs/y'", "ok.yaml");
  EXPECT_EQ(c.out, "runs/y");
}

// ---- size-like values against their real bounds ---------------------------------------------

TEST(BadInputConfig, SizesAreRefusedBeforeAllocation) {
  struct Case {
    std::vector<std::string> overrides;
    const char* key;
  };
  const std::vector<Case> cases = {
      {{"rollout.generations_per_prompt=1000000000"}, "rollout.generations_per_prompt"},
      {{"rollout.prompts_per_step=65536", "rollout.generations_per_prompt=65536"}, "rollout.generations_per_prompt"},
      {{"rollout.max_new_tokens=2147483647"}, "rollout.max_new_tokens"},
      {{"rollout.max_new_tokens=100000"}, "rollout.max_new_tokens"},  // the tiny model's positions stop at 512
      {{"rollout.max_new_tokens=512"}, "rollout.max_new_tokens"},
      {{"model.tiny.hidden_size=1000000000"}, "model.tiny.hidden_size"},
      {{"model.tiny.num_layers=1000", "model.tiny.hidden_size=65536", "model.tiny.intermediate_size=262144"},
       "model.tiny"},
      {{"train.micro_batch_tokens=1000000000000000"}, "train.micro_batch_tokens"},
      {{"sft.batch_size=2000000000"}, "sft.batch_size"},
      {{"train.adam_eps=1e-50"}, "train.adam_eps"},
      {{"train.lr=1e39"}, "train.lr"},
      {{"max_consecutive_bad_steps=0"}, "max_consecutive_bad_steps"},
      {{"task.arithmetic.max_operands=1000000000"}, "task.arithmetic.max_operands"},
      {{"checkpoint_max_abs_weight=-1"}, "checkpoint_max_abs_weight"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.overrides.back());
    const std::string msg = error_of([&] { config_load("", c.overrides); });
    EXPECT_NE(msg.find(c.key), std::string::npos) << msg;
    EXPECT_EQ(msg.find("(-"), std::string::npos) << "a negative count (int overflow) in: " << msg;
  }
  EXPECT_NO_THROW(config_load("", {"rollout.max_new_tokens=500"}));
}

// A config.json with an absurd dimension is refused where it is read, and a tokenizer whose ids
// pass the model's vocabulary is refused before a run starts.
TEST(BadInputConfig, ModelDimensionsAndTokenizerAreCheckedAgainstTheirBounds) {
  json j = json::parse(read_file(kData + "/fixtures/qwen3/config.json"));
  j["hidden_size"] = 1000000000;
  const std::string msg = error_of([&] { model_config_from_json(j.dump(), "big/config.json"); });
  EXPECT_NE(msg.find("big/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hidden_size 1000000000"), std::string::npos) << msg;
  j["hidden_size"] = 4294967296 + 64;  // 2^32 + 64 must not wrap to 64
  EXPECT_NE(error_of([&] { model_config_from_json(j.dump(), "big/config.json"); }).find("32 bits"),
            std::string::npos);
  Session s;
  s.tokenizer_json = kData + "/tokenizers/small/tokenizer.json";
  s.tokenizer = Tokenizer::load(s.tokenizer_json);  // ids up to 399
  const ModelConfig qwen2 = model_config_load(kData + "/fixtures/qwen2");  // vocab 320
  EXPECT_NE(error_of([&] { session_check_model(s, qwen2); }).find("do not belong together"), std::string::npos);
  EXPECT_NO_THROW(session_check_model(s, model_config_load(kData + "/fixtures/qwen3")));  // vocab 448
}

TEST(BadInputConfig, NumbersAreParsedStrictly) {
  for (const std::string o : {"rollout.max_new_tokens=3.7", "rollout.max_new_tokens=4294967301",
                              "rollout.max_new_tokens=12abc", "train.lr=1e-3x", "seed=18446744073709551621",
                              "rollout.max_new_tokens=+-5"}) {
    SCOPED_TRACE(o);
    const std::string msg = error_of([&] { config_load("", {o}); });
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("sto"), std::string::npos) << msg;
  }
}

// A 10 MB prompt used to cost 26 s and 7.6 GB before failing; a one-line file's error lacked its name.
TEST(BadInputData, JsonlLinesAndTinyFilesAreRefusedWithTheirName) {
  const std::string dir = fresh_dir("jsonl");
  fs::create_directories(dir);
  const std::string big = dir + "/big.jsonl";
  write_file_atomic(big, "{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"" + std::string(10 << 20, 'x') +
                             "\", \"answer\": \"1\"}\n");
  JsonlConfig cfg;
  cfg.name = "jsonl";
  cfg.train_path = big;
  std::string msg = error_of([&] { task_make_jsonl(cfg); });
  EXPECT_NE(msg.find(big + ":2"), std::string::npos) << msg.substr(0, 300);
  EXPECT_NE(msg.find("longer than"), std::string::npos) << msg.substr(0, 300);
  EXPECT_LT(msg.size(), 400u);
  const std::string one = dir + "/one.jsonl";
  write_file_atomic(one, "{\"prompt\": \"a\", \"answer\": \"1\"}\n");
  cfg.train_path = one;
  msg = error_of([&] { task_make_jsonl(cfg); });
  EXPECT_NE(msg.find(one), std::string::npos) << msg;
  const std::string deep = dir + "/deep.jsonl";
  write_file_atomic(deep, "{\"prompt\": " + nested_arrays(100000) + "}\n");
  cfg.train_path = deep;
  msg = error_of([&] { task_make_jsonl(cfg); });
  EXPECT_NE(msg.find(deep + ":1"), std::string::npos) << msg.substr(0, 300);
}

// "PCRE2 error -47" used to come with no file.
TEST(BadInputData, RegexFailuresNameTheTokenizer) {
  json j = json::parse(tokenizer_text());
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         json::array({{{"type", "Split"}, {"pattern", {{"Regex", "(a|a)+$"}}}, {"behavior", "Isolated"}},
                                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  const Tokenizer t = Tokenizer::from_json(j.dump(), "", "backtrack/tokenizer.json");
  const std::string msg = error_of([&] { t.encode(std::string(40, 'a') + "!", false); });
  EXPECT_NE(msg.find("backtrack/tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pre_tokenizer regex"), std::string::npos) << msg;
}

std::string long_prompt_jsonl(const std::string& name) {
  const std::string path = scratch() + "/" + name + ".jsonl";
  std::string text;
  for (int i = 0; i < 20; ++i) {
    std::string prompt;
    for (int k = 0; k < 40; ++k) prompt += std::to_string((i * 7919 + k * 104729) % 9973) + " ";
    text += "{\"prompt\": \"" + prompt + "\", \"answer\": \"1\", \"solution\": \"1\"}\n";
  }
  write_file_atomic(path, text);
  return path;
}

// Prompts are checked against the model's positions before a rollout (with max_new_tokens),
// and SFT sequences before training (sft used to train past max_position_embeddings).
TEST(BadInputData, SequencesMustFitTheModelPositions) {
  scratch();
  const std::string path = long_prompt_jsonl("long_prompts");
  std::vector<std::string> o = {"task.name=jsonl", "task.jsonl.path=" + path, "task.jsonl.solution_field=solution",
                                "model.tiny.max_position_embeddings=32", "rollout.max_new_tokens=6",
                                "out=" + fresh_dir("long_sft"), "sft.steps=2", "sft.batch_size=2",
                                "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
                                "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "val_every=0"};
  const RunConfig c = config_load("", o);
  const std::string msg = error_of([&] { sft_run(c); });
  EXPECT_NE(msg.find("max_position_embeddings (32)"), std::string::npos) << msg;
  Session s = session_open(c, test::test_cache_dir(scratch()));
  TaskItem it = s.train_item(0);
  EXPECT_GT(s.prompt_ids(it).size(), 26u);  // unchecked without a model
  s.max_positions = 32;
  s.max_new_tokens = 6;
  const std::string pmsg = error_of([&] { s.prompt_ids(it); });
  EXPECT_NE(pmsg.find("rollout.max_new_tokens=6"), std::string::npos) << pmsg;
  EXPECT_NE(pmsg.find("max_position_embeddings (32)"), std::string::npos) << pmsg;
}

// ---- the CLI: strict numbers, values against the model's real bounds -------------------------

TEST(BadInputCli, FlagsAreStrictNumbersWithinTheirBounds) {
  const std::string model = kData + "/fixtures/qwen3", tok = kData + "/tokenizers/tiny/tokenizer.json";
  struct Case {
    std::vector<std::string> args;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {{"--n", "-1"}, "--n must be an integer in [1, "},
      {{"--n", "100000000"}, "--n must be an integer in [1, "},
      {{"--n", "3.7"}, "--n: '3.7' is not an integer"},
      {{"--n", "abc"}, "--n: 'abc' is not an integer"},
      {{"--n", "+-2"}, "--n: '+-2' is not an integer"},
      {{"--seed", "18446744073709551621"}, "--seed must be an integer"},
      {{"--temperature", "warm"}, "--temperature: 'warm' is not a number"},
      {{"--top-k", "4294967301"}, "--top-k must be an integer"},
      {{"--max-new-tokens", "100000"}, "--max-new-tokens must be an integer in [1, "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args[0] + " " + c.args[1]);
    std::vector<std::string> args = {"generate", "--model", model, "--tokenizer", tok, "--prompt", "1+1"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    std::string out;
    EXPECT_EQ(test::run_binary_in(scratch(), args, out), 1) << out;
    EXPECT_NE(out.find(c.expect), std::string::npos) << out;
    for (const char* internal : {"stoi", "stof", "stoull", "KV pool", "out of host memory"})
      EXPECT_EQ(out.find(internal), std::string::npos) << out;
  }
}

// 60k ids on a model with 256 positions used to run 20 s and take 867 MB. (30k here: one
// argument of a command line holds at most 128 KiB.)
TEST(BadInputCli, LogprobsRefusesMoreIdsThanPositions) {
  std::string ids;
  for (int i = 0; i < 30000; ++i) ids += std::to_string(i % 10) + " ";
  std::string out;
  EXPECT_EQ(test::run_binary_in(scratch(), {"logprobs", "--model", kData + "/fixtures/qwen3", "--ids", ids}, out), 1);
  EXPECT_NE(out.find("max_position_embeddings (256)"), std::string::npos) << out.substr(0, 400);
}

// ---- non-finite training: skipped, counted, aborted with the likely cause -------------------

std::vector<TrainSequence> sequences() {
  std::vector<TrainSequence> out;
  for (auto& ids : test::token_sequences({8, 6}, 48, 77)) out.push_back({ids, 2});
  return out;
}

constexpr auto nll = test::mean_nll;

// On the FP8 path the activation quantizer refuses a non-finite input: in a training step that
// is a skipped update (weights and moments untouched), not an abort.
TEST(BadInputNonFinite, NonFiniteActivationInAnFp8StepSkipsTheUpdate) {
  auto be = make_cpu_backend();
  EnginePrecision fp8;
  fp8.linear = LinearMode::FP8_BLOCK;
  Trainer t(*be, model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 5), DType::F32), fp8,
            TrainerOptions{});
  ASSERT_TRUE(t.step(sequences(), 1.0f, nll, 1e-2f).applied);
  // A finite but huge weight: its product overflows FP32, the next block's input is NaN.
  Tensor& w = t.master().layers[0].down.w;
  Tensor h = be->to_host(w);
  for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = 3e38f;
  be->copy(h, w);
  const int64_t opt_step = t.optimizer_step();
  const auto moments = t.optimizer_state();
  StepResult r;
  ASSERT_NO_THROW(r = t.step(sequences(), 1.0f, nll, 1e-2f));
  EXPECT_FALSE(r.applied);
  EXPECT_NE(r.skip_reason.find("non-finite"), std::string::npos) << r.skip_reason;
  EXPECT_EQ(t.optimizer_step(), opt_step);
  const auto after = t.optimizer_state();
  for (size_t i = 0; i < moments.size(); ++i)
    EXPECT_EQ(to_float_vector(moments[i].second), to_float_vector(after[i].second)) << moments[i].first;
  EXPECT_EQ(to_float_vector(be->to_host(t.master().layers[0].down.w))[0], 3e38f);
  BadStepGuard guard(2, "hint");
  EXPECT_FALSE(guard.record(r, 1));
  EXPECT_NE(error_of([&] { guard.record(r, 2); }).find("max_consecutive_bad_steps=2"), std::string::npos);
}

std::vector<std::string> tiny_run(int steps) {
  return {"model.tiny.hidden_size=32",  "model.tiny.num_layers=1",      "model.tiny.num_heads=2",
          "model.tiny.num_kv_heads=1",  "model.tiny.head_dim=16",       "model.tiny.intermediate_size=64",
          "rollout.prompts_per_step=2", "rollout.generations_per_prompt=2", "rollout.max_new_tokens=6",
          "val_every=0",                "val_size=4",                   "sft.steps=4",
          "sft.batch_size=4",           "train.optimizer_steps_per_rollout=1", "precision.recipe=fp8_e2e",
          "steps=" + std::to_string(steps)};
}

// lr 1e30 used to abort at step 1-2 with "cannot quantize activation ... is -nan"; now the
// bad steps are skipped and counted, and max_consecutive_bad_steps stops the run naming lr and eps.
TEST(BadInputNonFinite, ExplodingLearningRateReachesTheBadStepGuard) {
  scratch();
  std::vector<std::string> o = tiny_run(6);
  o.push_back("train.lr=1e30");
  o.push_back("max_consecutive_bad_steps=2");
  o.push_back("out=" + fresh_dir("lr_1e30"));
  const RunConfig c = config_load("", o);
  const std::string msg = error_of([&] { grpo_run(c, false); });
  EXPECT_NE(msg.find("consecutive"), std::string::npos) << msg;
  EXPECT_NE(msg.find("max_consecutive_bad_steps=2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.lr=1e+30"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.adam_eps"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(c.out + "/checkpoints/latest")) << "an exploded run saved a checkpoint";
}

// lr 3e38 and kl_beta 1e38 used to abort with internal messages ("logp_new[0] is not finite"):
// now a run either trains through (the update clipped, the loss finite) or the guard stops it.
TEST(BadInputNonFinite, ExtremeSettingsNeverEndInAnInternalMessage) {
  scratch();
  for (const std::string setting : {"train.lr=3e38", "train.kl_beta=1e38"}) {
    SCOPED_TRACE(setting);
    std::vector<std::string> o = tiny_run(4);
    o.push_back(setting);
    o.push_back("out=" + fresh_dir("extreme"));
    const RunConfig c = config_load("", o);
    try {
      EXPECT_EQ(grpo_run(c, false), 0);
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("max_consecutive_bad_steps="), std::string::npos) << msg;
      EXPECT_EQ(msg.find("check failed"), std::string::npos) << msg;
    }
  }
}

TEST(BadInputNonFinite, ExplodedOrNonFiniteWeightsAreNeverSavedOrLoaded) {
  auto be = make_cpu_backend();
  Trainer t(*be, model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 6), DType::F32),
            EnginePrecision{}, TrainerOptions{});
  const std::string dir = fresh_dir("exploded");
  TrainerState st;
  st.step = 1;
  const std::string good = checkpoint_save(*be, t, st, dir, "", 1e5);
  Tensor& w = t.master().layers[1].up.w;
  Tensor h = be->to_host(w);
  h.data<float>()[3] = 3e27f;
  be->copy(h, w);
  st.step = 2;
  const std::string msg = error_of([&] { checkpoint_save(*be, t, st, dir, "", 1e5); });
  EXPECT_NE(msg.find("checkpoint_max_abs_weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << msg;
  EXPECT_EQ(checkpoint_latest(dir), good);
  EXPECT_NO_THROW(checkpoint_save(*be, t, st, dir, "", 0));  // 0 = no bound

  // A NaN written into a model directory is refused at load, naming the tensor.
  ModelWeights host = test::tiny_model("qwen3", DType::F32, 7);
  host.layers[0].o.w.data<float>()[5] = std::nanf("");
  const std::string mdir = fresh_dir("nan_model");
  fs::create_directories(mdir);
  model_weights_save(host, mdir);
  const std::string lmsg = error_of([&] { model_weights_load(mdir, DType::F32); });
  EXPECT_NE(lmsg.find("model.layers.0.self_attn.o_proj.weight"), std::string::npos) << lmsg;
  EXPECT_NE(lmsg.find("non-finite"), std::string::npos) << lmsg;
}

// ---- checkpoint state validated on resume --------------------------------------------------

std::string saved_checkpoint(const std::string& name, int64_t step) {
  auto be = make_cpu_backend();
  Trainer t(*be, model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 8), DType::F32),
            EnginePrecision{}, TrainerOptions{});
  TrainerState st;
  st.step = step;
  return checkpoint_save(*be, t, st, fresh_dir(name), "");
}

void edit_state(const std::string& ckpt, const std::function<void(json&)>& f) {
  json j = json::parse(read_file(ckpt + "/trainer_state.json"));
  f(j);
  write_file_atomic(ckpt + "/trainer_state.json", j.dump(2));
}

TEST(BadInputCheckpoint, StateStepMustBeNonNegativeAndMatchItsDirectory) {
  const std::string ck = saved_checkpoint("state_step", 3);
  EXPECT_EQ(checkpoint_read_state(ck).step, 3);
  edit_state(ck, [](json& j) { j["step"] = -5; });
  EXPECT_NE(error_of([&] { checkpoint_read_state(ck); }).find("'step'"), std::string::npos);
  edit_state(ck, [](json& j) { j["step"] = 1; });
  EXPECT_NE(error_of([&] { checkpoint_read_state(ck); }).find("checkpoint of step 3"), std::string::npos);
  edit_state(ck, [](json& j) { j["step"] = 3.5; });
  EXPECT_NE(error_of([&] { checkpoint_read_state(ck); }).find("'step'"), std::string::npos);
  edit_state(ck, [](json& j) {
    j["step"] = 3;
    j["optimizer_step"] = -1;
  });
  EXPECT_NE(error_of([&] { checkpoint_read_state(ck); }).find("'optimizer_step'"), std::string::npos);
}

TEST(BadInputCheckpoint, LatestMustNameADirectoryInsideTheRun) {
  const std::string ck = saved_checkpoint("latest_run/checkpoints", 2);
  const std::string dir = fs::path(ck).parent_path().string();
  EXPECT_EQ(checkpoint_latest(dir), ck);
  // Elsewhere: a complete checkpoint outside the run.
  const std::string outside = saved_checkpoint("latest_other", 7);
  for (const std::string& name : std::vector<std::string>{outside, "../../latest_other/step_000007", "step_000002/../step_000002", "latest"}) {
    SCOPED_TRACE(name);
    write_file_atomic(dir + "/latest", name + "\n");
    EXPECT_NE(error_of([&] { checkpoint_latest(dir); }).find("latest"), std::string::npos);
  }
  fs::create_directory_symlink(outside, dir + "/step_000009");
  write_file_atomic(dir + "/latest", "step_000009\n");
  EXPECT_NE(error_of([&] { checkpoint_latest(dir); }).find("not a directory inside"), std::string::npos);
}

TEST(BadInputCheckpoint, FlippedBytesFailTheChecksum) {
  const std::string ck = saved_checkpoint("flipped", 1);
  const TrainerState st = checkpoint_read_state(ck);
  ASSERT_GE(st.files.size(), 3u);  // config.json, model.safetensors, optimizer.safetensors
  EXPECT_NO_THROW(checkpoint_verify_files(ck, st));
  std::string bytes = read_file(ck + "/model.safetensors");
  bytes[bytes.size() - 3] ^= 0x10;  // one bit of one weight
  write_file_atomic(ck + "/model.safetensors", bytes);
  const std::string msg = error_of([&] { checkpoint_verify_files(ck, checkpoint_read_state(ck)); });
  EXPECT_NE(msg.find("model.safetensors does not match its checksum"), std::string::npos) << msg;
}

// A step=-5 state used to train steps -4..4 over the run's checkpoints; a metrics.jsonl that
// does not reach the checkpoint's step means the files do not belong together.
TEST(BadInputCheckpoint, ResumeRefusesStateThatDisagreesWithTheRun) {
  scratch();
  const std::string out = fresh_dir("resume_check");
  std::vector<std::string> o = tiny_run(2);
  o.push_back("checkpoint_every=1");
  o.push_back("out=" + out);
  ASSERT_EQ(grpo_run(config_load("", o), false), 0);
  const std::string ck = out + "/checkpoints/step_000002";
  o.back() = "out=" + out;
  o[o.size() - 3] = "steps=3";
  const RunConfig c3 = config_load("", o);
  const std::string metrics = read_file(out + "/metrics.jsonl");
  write_file_atomic(out + "/metrics.jsonl", metrics.substr(0, metrics.find('\n') + 1));  // step 1 only
  const std::string msg = error_of([&] { grpo_run(c3, true); });
  EXPECT_NE(msg.find("ends at step 1"), std::string::npos) << msg;
  write_file_atomic(out + "/metrics.jsonl", metrics);
  edit_state(ck, [](json& j) { j["step"] = -5; });
  EXPECT_NE(error_of([&] { grpo_run(c3, true); }).find("trainer_state.json"), std::string::npos);
  EXPECT_FALSE(fs::exists(out + "/checkpoints/step_-00004"));
  EXPECT_TRUE(fs::exists(out + "/checkpoints/step_000001/model.safetensors"));
}

// A kill -9 during the demo's first SFT left DIR.run behind, and every later `fp8rl train`
// failed with "choose another out=DIR".
TEST(BadInputCheckpoint, KilledDemoCacheBuildDoesNotPoisonTheCache) {
  const std::string cache = scratch() + "/cache_demo";  // its own cache: one demo policy in it
  fs::create_directories(cache);
  const std::string saved_cache = std::getenv("FP8RL_CACHE_DIR");
  ::setenv("FP8RL_CACHE_DIR", cache.c_str(), 1);
  std::vector<std::string> o = tiny_run(1);
  o.push_back("out=" + fresh_dir("demo_a"));
  ASSERT_EQ(grpo_run(config_load("", o), false), 0);
  std::string policy;
  for (const auto& e : fs::directory_iterator(cache)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("demo_policy_", 0) == 0 && n.find('.') == std::string::npos) policy = e.path().string();
  }
  ASSERT_FALSE(policy.empty());
  for (const auto& e : fs::directory_iterator(cache))
    EXPECT_EQ(e.path().filename().string().find(".run"), std::string::npos) << "the SFT scratch run was left behind";
  // As if killed mid-SFT: no cache entry, a half-done SFT run directory of a process that no
  // longer exists (pids never reach 10^9), a half-copied entry (an older fp8rl's name); and the
  // scratch run of a live process (this one's parent), which must be left alone.
  fs::remove_all(policy);
  const std::string dead_run = policy + ".run.999999999", live_run = policy + ".run." + std::to_string(::getppid());
  fs::create_directories(dead_run + "/checkpoints");
  write_file_atomic(dead_run + "/metrics.jsonl", "{\"step\": 1}\n");
  fs::create_directories(policy + ".tmp");
  fs::create_directories(live_run);
  o.back() = "out=" + fresh_dir("demo_b");
  ASSERT_EQ(grpo_run(config_load("", o), false), 0);
  EXPECT_TRUE(fs::exists(policy + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(policy + ".tmp"));
  EXPECT_FALSE(fs::exists(dead_run));
  EXPECT_TRUE(fs::exists(live_run)) << "a live run's scratch directory was removed";
  fs::remove_all(live_run);
  ::setenv("FP8RL_CACHE_DIR", saved_cache.c_str(), 1);
}

}  // namespace
}  // namespace fp8rl
