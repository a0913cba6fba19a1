#include "rl/session.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "rl/checkpoint.h"
#include "rl/memory_plan.h"
#include "rollout/rollout.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/train_small.h"

namespace fp8rl {

namespace fs = std::filesystem;

std::string cache_dir() {
  if (const char* d = std::getenv("FP8RL_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return std::string(d) + "/fp8rl";
  if (const char* d = std::getenv("HOME"); d && *d) return std::string(d) + "/.cache/fp8rl";
  return ".cache/fp8rl";
}

namespace {

// The small tokenizer of the tiny model: trained on the task's own text (prompts and worked
// solutions of the training split), cached by that text so that runs on the same data agree on
// ids and runs on other data (another jsonl file, other task knobs) get their own.
std::string small_tokenizer_path(const Session& s, const std::string& cache) {
  const TaskSection& t = s.config.task;
  std::vector<std::string> corpus;
  std::string all;
  for (int64_t i = 0; i < 2000; ++i) {
    TaskItem it = s.train_item(i);
    corpus.push_back(it.prompt);
    corpus.push_back(it.solution);
    all += it.prompt + '\0' + it.solution + '\0';
  }
  const int vocab = s.config.model.tiny.vocab_size > 0 ? s.config.model.tiny.vocab_size : 384;
  const std::string dir = cache + "/tokenizers";
  const std::string path = dir + "/" + t.name + "_v" + std::to_string(vocab) + "_" +
                           std::to_string(std::hash<std::string>{}(all)) + ".json";
  if (fs::exists(path)) return path;
  make_dirs(dir);
  write_file_atomic(path, tokenizer_train_small(corpus, vocab));
  return path;
}

}  // namespace

Session session_open(const RunConfig& c, const std::string& cache) {
  Session s;
  s.config = c;
  s.backend = make_backend(c.device);
  s.task = task_create(c.task, c.task.seed ? c.task.seed : c.seed);
  if (!c.tokenizer.path.empty()) {
    s.tokenizer_json = fs::is_directory(c.tokenizer.path) ? c.tokenizer.path + "/tokenizer.json" : c.tokenizer.path;
  } else if (!c.model.path.empty()) {
    if (!fs::is_directory(c.model.path))
      FP8RL_FAIL("model.path '", c.model.path, "' ", fs::exists(c.model.path) ? "is not a directory" : "does not exist",
                 ": it must be a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)");
    s.tokenizer_json = c.model.path + "/tokenizer.json";
    if (!fs::exists(s.tokenizer_json))
      FP8RL_FAIL("model.path '", c.model.path, "' has no tokenizer.json; set tokenizer.path to the model's tokenizer");
  } else {
    s.tokenizer_json = small_tokenizer_path(s, cache);
  }
  if (!fs::exists(s.tokenizer_json))
    FP8RL_FAIL("tokenizer.path: '", s.tokenizer_json, "' does not exist (a tokenizer.json file or its directory)");
  s.tokenizer = Tokenizer::load(s.tokenizer_json);
  if (c.tokenizer.chat_template) {
    const std::string dir = fs::path(s.tokenizer_json).parent_path().string();
    if (std::optional<ChatJinja> t = ChatJinja::load(dir.empty() ? "." : dir))
      s.chat_jinja = std::make_shared<const ChatJinja>(std::move(*t));
    if (!c.tokenizer.chat_template_kwargs.empty())
      s.chat_vars.kwargs = nlohmann::ordered_json::parse(c.tokenizer.chat_template_kwargs);
    s.chat_vars.add_generation_prompt = true;
  }
  s.eos_id = s.tokenizer.eos_id();
  if (!c.task.reward.python.empty()) {
    s.python_reward = std::make_unique<PythonReward>(c.task.reward.python);
    std::printf("reward: %s (Python, once per batch)\n", c.task.reward.python.c_str());
  }
  FP8RL_CHECK(s.eos_id >= 0, s.tokenizer_json, " defines no end-of-sequence token; fp8rl needs one to stop generation");
  s.stop_ids = {s.eos_id};
  const std::string gen_cfg = c.model.path + "/generation_config.json";
  if (!c.model.path.empty() && fs::exists(gen_cfg)) {
    nlohmann::json g;
    try {
      g = nlohmann::json::parse(read_file(gen_cfg));
    } catch (const nlohmann::json::exception& e) {
      throw Error(gen_cfg + " is not valid JSON: " + e.what());
    }
    std::vector<int32_t> ids;
    if (g.contains("eos_token_id") && g["eos_token_id"].is_number_integer()) ids.push_back(g["eos_token_id"].get<int32_t>());
    if (g.contains("eos_token_id") && g["eos_token_id"].is_array())
      for (const auto& e : g["eos_token_id"])
        if (e.is_number_integer()) ids.push_back(e.get<int32_t>());
    for (int32_t id : ids)
      if (id >= 0 && id < s.tokenizer.vocab_size() && std::find(s.stop_ids.begin(), s.stop_ids.end(), id) == s.stop_ids.end())
        s.stop_ids.push_back(id);
  }
  return s;
}

std::vector<int32_t> Session::prompt_ids(const TaskItem& item) const {
  if (config.tokenizer.chat_template && chat_jinja)
    return tokenizer.encode(chat_jinja->render_prompt(item.prompt, "", chat_vars));
  std::vector<int32_t> ids;
  if (config.tokenizer.chat_template) {
    ChatTemplate tpl = ChatTemplate::for_tokenizer(tokenizer);
    ids = tokenizer.encode(tpl.render_prompt(item.prompt));
  } else {
    ids = tokenizer.encode(item.prompt, /*allow_special=*/false);
  }
  if (max_positions > 0 && static_cast<int64_t>(ids.size()) + max_new_tokens > max_positions)
    FP8RL_FAIL("task ", config.task.name, ": a prompt of ", ids.size(), " tokens (\"",
               item.prompt.substr(0, 60), item.prompt.size() > 60 ? "...\"" : "\"", ") plus rollout.max_new_tokens=",
               max_new_tokens, " exceeds the model's max_position_embeddings (", max_positions,
               "); shorten the prompts or lower rollout.max_new_tokens");
  return ids;
}

std::vector<int32_t> Session::solution_ids(const TaskItem& item) const {
  std::vector<int32_t> ids = tokenizer.encode(item.solution, /*allow_special=*/false);
  ids.push_back(eos_id);
  return ids;
}

std::vector<nlohmann::json> Session::reward_samples(const std::vector<const TaskItem*>& items,
                                                    const std::vector<std::string>& responses) const {
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < items.size(); ++i) {
    nlohmann::json j = items[i]->fields_json.empty() ? nlohmann::json::object()
                                                     : nlohmann::json::parse(items[i]->fields_json);
    j["prompt"] = items[i]->prompt;
    j["response"] = responses[i];
    j["answer"] = items[i]->answer;
    out.push_back(std::move(j));
  }
  return out;
}

std::vector<double> Session::rewards(const std::vector<const TaskItem*>& items, const std::vector<std::string>& responses,
                                     std::vector<std::pair<std::string, double>>* metrics) const {
  FP8RL_CHECK(items.size() == responses.size(), "rewards: ", items.size(), " items for ", responses.size(), " responses");
  if (!python_reward) {
    std::vector<double> r;
    for (size_t i = 0; i < items.size(); ++i) r.push_back(task->reward(responses[i], items[i]->answer));
    return r;
  }
  PythonRewardResult pr = python_reward->score(reward_samples(items, responses));
  if (metrics)
    for (auto& [k, v] : pr.metrics) metrics->push_back({"reward/" + k, v});
  return pr.rewards;
}

std::string Session::response_text(const std::vector<int32_t>& tokens) const {
  std::vector<int32_t> t;
  for (int32_t id : tokens) {
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) break;
    t.push_back(id);
  }
  return tokenizer.decode_lossy(t, /*skip_special=*/true);  // never throws mid-run
}

int64_t session_set_model(Session& s, int64_t model_vocab, std::FILE* note) {
  const int64_t tok_vocab = s.tokenizer.vocab_size();
  s.sampling_vocab = std::min(tok_vocab, model_vocab);
  if (model_vocab > tok_vocab) {
    std::fprintf(note, "vocabulary: the model has %lld ids, its tokenizer %lld; ids %lld..%lld are padding and are "
                "never sampled\n",
                static_cast<long long>(model_vocab), static_cast<long long>(tok_vocab),
                static_cast<long long>(tok_vocab), static_cast<long long>(model_vocab - 1));
  } else if (model_vocab < tok_vocab) {
    std::fprintf(stderr,
                 "warning: the tokenizer has %lld ids but the model only %lld; a prompt holding an id >= %lld "
                 "cannot be scored\n",
                 static_cast<long long>(tok_vocab), static_cast<long long>(model_vocab),
                 static_cast<long long>(model_vocab));
  }
  return s.sampling_vocab;
}

ModelConfig session_tiny_model_config(const TinyModelConfig& t, int vocab_size, int32_t eos_id) {
  ModelConfig mc = model_config_tiny("qwen3", vocab_size, t.hidden_size,
                                     t.num_layers, t.num_heads, t.num_kv_heads, t.intermediate_size);
  mc.head_dim = t.head_dim;
  mc.qk_norm = t.qk_norm;
  mc.max_position_embeddings = t.max_position_embeddings;
  mc.rope_theta = static_cast<float>(t.rope_theta);
  mc.eos_token_id = eos_id;
  mc.eos_token_ids = {eos_id};
  if (t.num_experts > 0) {  // the same model with a Qwen3-MoE MLP in every block
    mc.model_type = "qwen3_moe";
    mc.num_experts = t.num_experts;
    mc.num_experts_per_tok = t.num_experts_per_tok;
    mc.moe_intermediate_size = t.moe_intermediate_size;
    mc.norm_topk_prob = true;
  }
  mc.validate();
  return mc;
}

ModelConfig session_model_config(const Session& s) {
  const RunConfig& c = s.config;
  if (!c.model.path.empty()) return model_config_load(c.model.path);
  return session_tiny_model_config(c.model.tiny, s.tokenizer.vocab_size(), s.eos_id);
}

MemoryChoice session_check_memory(const Session& s, bool sft) {
  Backend& be = *s.backend;
  const int64_t free_bytes = memory_plan_free_bytes(s.config, be.free_device_bytes());
  const ModelConfig model = session_model_config(s);
  std::fputs(memory_plan_check(s.config, model, be.act_dtype(), free_bytes, sft).c_str(), stdout);
  return memory_plan_choose(s.config, model, be.act_dtype(), free_bytes, sft);
}

ModelWeights session_initial_policy(const Session& s) {
  const RunConfig& c = s.config;
  if (!c.model.path.empty()) {
    // An fp8rl checkpoint (e.g. the demo's cached SFT policy) starts from its F32 master, not
    // from the BF16 rounding in its model files; any other HF directory loads as it is.
    ModelWeights w = checkpoint_load_policy(c.model.path);
    if (s.tokenizer.vocab_size() > w.config.vocab_size)
      FP8RL_FAIL("the tokenizer (", s.tokenizer_json, ") has ", s.tokenizer.vocab_size(), " ids but the model in '",
                 c.model.path, "' only ", w.config.vocab_size,
                 " (config.json vocab_size): they do not belong together; set tokenizer.path to the model's own "
                 "tokenizer");
    return w;
  }
  ModelConfig mc = session_tiny_model_config(c.model.tiny, s.tokenizer.vocab_size(), s.eos_id);
  RandomInit init;
  init.seed = static_cast<uint64_t>(c.seed);
  init.std = static_cast<float>(c.model.tiny.init_std);
  return model_weights_random(mc, init, DType::F32);
}

ValResult validate(const Session& s, RolloutEngine& engine, int n, int max_new_tokens) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<RolloutRequest> reqs;
  std::vector<TaskItem> items;
  n = std::min<int>(n, static_cast<int>(s.task->size(Split::kValidation)));
  for (int i = 0; i < n; ++i) {
    items.push_back(s.task->item(Split::kValidation, i));
    reqs.push_back({s.prompt_ids(items.back()), 1});
  }
  SamplingParams sp;
  sp.temperature = 0.0f;  // greedy
  sp.max_new_tokens = max_new_tokens;
  sp.valid_vocab = s.sampling_vocab;
  sp.stop_ids = s.stop_ids;
  std::vector<RolloutSample> out = engine.generate(reqs, sp);
  ValResult r;
  n = static_cast<int>(out.size());
  int correct = 0;
  double reward = 0;
  std::vector<const TaskItem*> item_of;
  std::vector<std::string> texts;
  for (size_t i = 0; i < out.size(); ++i) {
    item_of.push_back(&items[i]);
    texts.push_back(s.response_text(out[i].tokens));
  }
  const std::vector<double> rws = s.rewards(item_of, texts);
  for (size_t i = 0; i < out.size(); ++i) {
    const std::string& text = texts[i];
    const double rw = rws[i];
    reward += rw;
    correct += rw >= 0.5;
    if (i == 0) {
      r.example = items[i].prompt + text;
      r.example_prompt = items[i].prompt;
      r.example_response = text;
    }
  }
  r.accuracy = n ? static_cast<double>(correct) / n : 0.0;
  r.reward_mean = n ? reward / n : 0.0;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace fp8rl

namespace fp8rl {

void session_check_model(const Session& s, const ModelConfig& m) {
  if (s.tokenizer.vocab_size() > m.vocab_size)
    FP8RL_FAIL("the tokenizer ", s.tokenizer_json, " has ids up to ", s.tokenizer.vocab_size() - 1,
               " but the model's vocab_size is ", m.vocab_size,
               ": they do not belong together (set tokenizer.path to the model's own tokenizer)");
}

std::string bad_step_hint(const RunConfig& c, const char* lr_key, double lr) {
  std::ostringstream os;
  os << "Likely causes: the learning rate is too high (" << lr_key << "=" << lr << ") or the Adam epsilon too "
     << "small (train.adam_eps=" << c.train.adam_eps << "; 1e-8 is usual)";
  if (c.train.kl_beta > 0) os << ", or train.kl_beta=" << c.train.kl_beta << " is too large";
  os << "; also check the data and the starting model.";
  return os.str();
}

TrainerOptions trainer_options(const RunConfig& c) {
  TrainerOptions o;
  o.grad_clip = static_cast<float>(c.train.grad_clip);
  o.weight_decay = static_cast<float>(c.train.weight_decay);
  o.beta1 = static_cast<float>(c.train.adam_beta1);
  o.beta2 = static_cast<float>(c.train.adam_beta2);
  o.eps = static_cast<float>(c.train.adam_eps);
  o.micro_batch_tokens = c.train.micro_batch_tokens;
  o.recompute = c.train.recompute == "block";  // "auto" is resolved by session_check_memory
  o.dgrad_weight_cache = c.train.dgrad_weight_cache != "off";  // ... as is this one
  o.grad_dtype = c.train.grad_dtype == "bf16" ? DType::BF16 : DType::F32;
  o.moment_dtype = c.train.optimizer_state_dtype == "bf16" ? DType::BF16 : DType::F32;
  o.stochastic_rounding = c.train.optimizer_state_rounding == "stochastic";
  o.routing_replay = c.train.routing_replay;
  return o;
}

std::unique_ptr<Task> task_create(const TaskSection& t, uint64_t seed) {
  if (t.name == "arithmetic") {
    ArithmeticConfig a;
    a.seed = seed;
    a.min_operands = t.arithmetic.min_operands;
    a.max_operands = t.arithmetic.max_operands;
    a.digits = t.arithmetic.digits;
    a.operators = t.arithmetic.operators;
    a.parentheses = t.arithmetic.parentheses;
    a.story = t.arithmetic.style == "story";
    return task_make_arithmetic(a);
  }
  if (t.name == "countdown") {
    CountdownConfig cd;
    cd.seed = seed;
    cd.numbers = t.countdown.numbers;
    cd.max_number = t.countdown.max_number;
    cd.max_target = t.countdown.max_target;
    return task_make_countdown(cd);
  }
  if (t.name == "gsm8k") return task_make_gsm8k(t.gsm8k.path, seed);
  if (t.name == "jsonl") {
    JsonlConfig j;
    j.train_path = t.jsonl.path;
    j.validation_path = t.jsonl.validation_path;
    j.validation_fraction = t.jsonl.validation_fraction;
    j.prompt_field = t.jsonl.prompt_field;
    j.answer_field = t.jsonl.answer_field;
    j.solution_field = t.jsonl.solution_field;
    j.instruction = t.jsonl.instruction;
    j.prompt_template = t.jsonl.prompt_template;
    j.seed = seed;
    return task_make_jsonl(j);
  }
  FP8RL_FAIL("unknown task.name '", t.name, "' (expected arithmetic, countdown, gsm8k or jsonl)");
}

}  // namespace fp8rl
