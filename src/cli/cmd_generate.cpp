// fp8rl generate: sample answers to a prompt from a checkpoint with the rollout engine.
// fp8rl eval: greedy accuracy of a checkpoint on a task's held-out split.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "rl/config.h"
#include "rl/session.h"
#include "rollout/rollout.h"
#include "tokenizer/chat_template.h"

namespace fp8rl::cli {
namespace {

constexpr const char* kGenerateUsage =
    "usage: fp8rl generate --model DIR --prompt TEXT [--chat] [--n N] [--max-new-tokens N]\n"
    "                      [--temperature T] [--top-p P] [--top-k K] [--seed S]\n"
    "                      [--precision fp32|bf16|fp8] [--kv-cache f32|bf16|e4m3] [--device cpu|cuda]\n"
    "Samples N answers (default 1; temperature 0 = greedy) and prints each with its mean logp.\n";

int run_generate(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "prompt", "n", "max-new-tokens", "temperature", "top-p", "top-k", "seed", "precision",
                "kv-cache", "device", "tokenizer"},
         {"chat", "help"});
  if (a.has("help")) {
    std::fputs(kGenerateUsage, stdout);
    return 0;
  }
  const std::string dir = a.require("model");
  if (!std::filesystem::is_directory(dir))
    FP8RL_FAIL("--model '", dir, "' ", std::filesystem::exists(dir) ? "is not a directory" : "does not exist",
               " (a Hugging Face model directory: config.json, *.safetensors, tokenizer.json)");
  const std::string tok_path = a.get("tokenizer", dir + "/tokenizer.json");
  FP8RL_CHECK(std::filesystem::exists(tok_path), "no tokenizer at ", tok_path, "; pass --tokenizer PATH");
  Tokenizer tok = Tokenizer::load(tok_path);
  std::string prompt = a.require("prompt");
  if (a.has("chat")) prompt = ChatTemplate::for_tokenizer(tok).render_prompt(prompt);
  const std::vector<int32_t> ids = tok.encode(prompt, /*allow_special=*/a.has("chat"));
  FP8RL_CHECK(!ids.empty(), "--prompt is empty");

  EnginePrecision prec;
  prec.linear = linear_mode_from_name(a.get("precision", "bf16"));
  prec.kv_cache = dtype_from_name(a.get("kv-cache", prec.linear == LinearMode::FP8_BLOCK ? "e4m3" : "bf16"));
  std::unique_ptr<Backend> be = make_backend(a.get("device", "cpu"));
  ModelWeights w = model_weights_to_device(*be, model_weights_load(dir, DType::F32), DType::F32);
  if (tok.vocab_size() > w.config.vocab_size)
    FP8RL_FAIL("the tokenizer (", tok_path, ") has ", tok.vocab_size(), " ids but the model in '", dir, "' only ",
               w.config.vocab_size, ": they do not belong together; pass the model's own --tokenizer");
  SamplingParams sp;
  sp.temperature = std::stof(a.get("temperature", "1.0"));
  sp.top_p = std::stof(a.get("top-p", "1.0"));
  sp.top_k = std::stoi(a.get("top-k", "0"));
  sp.max_new_tokens = std::stoi(a.get("max-new-tokens", "64"));
  sp.seed = std::stoull(a.get("seed", "0"));
  if (tok.eos_id() >= 0) sp.stop_ids = {tok.eos_id()};
  const int n = std::stoi(a.get("n", "1"));
  const int pages = n * static_cast<int>(ceil_div(static_cast<int64_t>(ids.size()) + sp.max_new_tokens, 16)) + 1;
  RolloutEngine engine(*be, w, prec, pages);
  for (const RolloutSample& s : engine.generate({{ids, n}}, sp)) {
    double mean = 0;
    for (float l : s.logp) mean += l;
    mean /= std::max<size_t>(1, s.logp.size());
    std::vector<int32_t> out = s.tokens;
    if (!out.empty() && out.back() == tok.eos_id()) out.pop_back();
    std::printf("--- sample %d (%zu tokens, %s, mean logp %.4f)\n%s\n", s.index, s.tokens.size(),
                finish_reason_name(s.finish), mean, tok.decode(out, /*skip_special=*/true).c_str());
  }
  return 0;
}

int run_eval(const std::vector<std::string>& argv) {
  Args a(argv, {"config", "model", "n"}, {"help"}, /*config_overrides=*/true);
  if (a.has("help")) {
    std::puts("usage: fp8rl eval --model DIR [--config FILE] [--n N] [key.sub=value ...]\n"
              "Greedy accuracy of DIR on the task's validation split (task.* keys as in train); prints JSON.");
    return 0;
  }
  std::vector<std::string> overrides = a.positional();
  overrides.push_back("model.path=" + a.require("model"));
  RunConfig c = config_load(a.get("config"), overrides);
  Session s = session_open(c, cache_dir());
  const PrecisionRecipe recipe = config_precision_recipe(c.precision);
  ModelWeights w = model_weights_to_device(*s.backend, model_weights_load(c.model.path, DType::F32), DType::F32);
  const int n = std::stoi(a.get("n", std::to_string(c.val_size)));
  RolloutEngine engine(*s.backend, w, recipe.generator,
                       n * static_cast<int>(ceil_div(512 + c.rollout.max_new_tokens, 16)) + 1);
  ValResult v = validate(s, engine, n, c.rollout.max_new_tokens);
  nlohmann::json j{{"task", c.task.name}, {"n", n}, {"accuracy", v.accuracy}, {"reward_mean", v.reward_mean},
                   {"seconds", v.seconds}, {"recipe", recipe.name}};
  std::puts(j.dump().c_str());
  return 0;
}

Register reg_generate{"generate", "sample answers to a prompt from a checkpoint", run_generate};
Register reg_eval{"eval", "greedy accuracy of a checkpoint on a task's validation split", run_eval};

}  // namespace
}  // namespace fp8rl::cli
