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

constexpr int kMaxSamples = 1 << 16;  // --n: samples (generate) or prompts (eval)

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
  if (a.has("chat")) {
    const std::string tok_dir = std::filesystem::path(tok_path).parent_path().string();
    if (std::optional<ChatJinja> tpl = ChatJinja::load(tok_dir.empty() ? "." : tok_dir))
      prompt = tpl->render_prompt(prompt, "", ChatJinja::Vars{});  // the model's own template
    else
      prompt = ChatTemplate::for_tokenizer(tok).render_prompt(prompt);
  }
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
  sp.temperature = static_cast<float>(a.get_float("temperature", 1.0, 0.0, 1e6));
  sp.top_p = static_cast<float>(a.get_float("top-p", 1.0, 0.0, 1.0));
  sp.top_k = a.get_int("top-k", 0, 0);
  sp.seed = static_cast<uint64_t>(a.get_int64("seed", 0, 0, INT64_MAX));
  if (tok.eos_id() >= 0) sp.stop_ids = {tok.eos_id()};
  // A vocabulary padded past the tokenizer's: the extra ids are never sampled.
  sp.valid_vocab = std::min<int64_t>(tok.vocab_size(), w.config.vocab_size);
  if (w.config.vocab_size != tok.vocab_size())
    std::fprintf(stderr, "vocabulary: the model has %d ids, its tokenizer %d; %s\n", w.config.vocab_size,
                 tok.vocab_size(),
                 w.config.vocab_size > tok.vocab_size() ? "the extra ids are padding and are never sampled"
                                                        : "a prompt id past the model's cannot be scored");
  // Sizes against their real bounds before anything is allocated: positions stop at the
  // model's max_position_embeddings, and the KV pool holds n whole sequences.
  const int64_t max_pos = w.config.max_position_embeddings, prompt_len = static_cast<int64_t>(ids.size());
  for (int32_t id : ids)
    if (id >= w.config.vocab_size)
      FP8RL_FAIL("--prompt encodes to token id ", id, " but the model's vocab_size is ", w.config.vocab_size, ": ",
                 tok_path, " is not this model's tokenizer (pass --tokenizer)");
  if (prompt_len >= max_pos)
    FP8RL_FAIL("--prompt is ", prompt_len, " tokens; the model's max_position_embeddings is ", max_pos);
  sp.max_new_tokens = a.get_int("max-new-tokens", static_cast<int>(std::min<int64_t>(64, max_pos - prompt_len)), 1,
                                static_cast<int>(max_pos - prompt_len));
  const int n = a.get_int("n", 1, 1, kMaxSamples);
  const int64_t pages64 = n * ceil_div(prompt_len + sp.max_new_tokens, 16) + 1;
  FP8RL_CHECK(pages64 < INT32_MAX, "internal: KV pool of ", pages64, " pages");
  const int pages = static_cast<int>(pages64);
  RolloutEngine engine(*be, w, prec, pages);
  for (const RolloutSample& s : engine.generate({{ids, n}}, sp)) {
    double mean = 0;
    for (float l : s.logp) mean += l;
    mean /= std::max<size_t>(1, s.logp.size());
    std::vector<int32_t> out = s.tokens;
    if (!out.empty() && out.back() == tok.eos_id()) out.pop_back();
    std::printf("--- sample %d (%zu tokens, %s, mean logp %.4f)\n%s\n", s.index, s.tokens.size(),
                finish_reason_name(s.finish), mean, tok.decode_lossy(out, /*skip_special=*/true).c_str());
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
  session_set_model(s, w.config.vocab_size, stderr);
  const int n = a.get_int("n", c.val_size, 1, kMaxSamples);
  const int64_t pages = int64_t(n) * ceil_div(512 + int64_t(c.rollout.max_new_tokens), 16) + 1;  // 64-bit
  if (pages > INT32_MAX)
    FP8RL_FAIL("--n ", n, " x rollout.max_new_tokens ", c.rollout.max_new_tokens, " needs a KV pool of ", pages,
               " pages; lower --n or rollout.max_new_tokens");
  RolloutEngine engine(*s.backend, w, recipe.generator, static_cast<int>(pages));
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
