#include "rl/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "io/safetensors.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl {

namespace fs = std::filesystem;

namespace {

// tokenizer_config.json / chat_template.jinja / generation_config.json for a checkpoint whose
// sources have none (the demo's own tokenizer): eos (and bos) as the tokenizer and config.json
// have them, ChatML when the tokenizer has its tokens (what the built-in fallback renders).
void write_missing_side_files(const std::string& dir, const ModelConfig& mc, const std::string& tokenizer_json) {
  if (!fs::exists(dir + "/tokenizer_config.json") && !tokenizer_json.empty()) {
    const Tokenizer tok = Tokenizer::load(tokenizer_json);
    nlohmann::ordered_json j;
    j["tokenizer_class"] = "PreTrainedTokenizerFast";
    j["bos_token"] = tok.bos_id() >= 0 ? nlohmann::ordered_json(tok.id_to_token(tok.bos_id())) : nullptr;
    j["eos_token"] = tok.eos_id() >= 0 ? nlohmann::ordered_json(tok.id_to_token(tok.eos_id())) : nullptr;
    j["pad_token"] = tok.pad_id() >= 0 ? nlohmann::ordered_json(tok.id_to_token(tok.pad_id())) : nullptr;
    j["model_max_length"] = mc.max_position_embeddings;
    write_file_atomic(dir + "/tokenizer_config.json", j.dump(2) + "\n");
    if (!fs::exists(dir + "/chat_template.jinja") && tok.token_to_id("<|im_start|>") >= 0 &&
        tok.token_to_id("<|im_end|>") >= 0)
      write_file_atomic(dir + "/chat_template.jinja",
                        "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
                        "}}{%- endif %}\n");
  }
  if (!fs::exists(dir + "/generation_config.json")) {
    nlohmann::ordered_json g;
    if (mc.bos_token_id >= 0) g["bos_token_id"] = mc.bos_token_id;
    if (mc.eos_token_ids.size() > 1) g["eos_token_id"] = mc.eos_token_ids;
    else if (mc.eos_token_id >= 0) g["eos_token_id"] = mc.eos_token_id;
    write_file_atomic(dir + "/generation_config.json", g.dump(2) + "\n");
  }
}

}  // namespace

CheckpointOptions checkpoint_options(const RunConfig& c, const std::string& tokenizer_json) {
  CheckpointOptions o;
  o.tokenizer_json = tokenizer_json;
  o.model_dir = c.model.path;
  o.model.dtype = c.checkpoint.dtype == "f32" ? DType::F32 : DType::BF16;
  o.model.fp8_block = c.checkpoint.format == "fp8-block";
  o.model.max_shard_gb = c.checkpoint.max_shard_gb;
  const EnginePrecision g = config_precision_recipe(c.precision).generator;
  o.model.pow2_scales = g.pow2_scales;
  o.model.bf16_first_layers = g.bf16_first_layers;
  o.model.bf16_last_layers = g.bf16_last_layers;
  return o;
}

std::string checkpoint_save(Backend& be, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const std::string& tokenizer_json) {
  CheckpointOptions o;
  o.tokenizer_json = tokenizer_json;
  return checkpoint_save(be, trainer, state, checkpoints_dir, o);
}

std::string checkpoint_save(Backend& be, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const CheckpointOptions& opt) {
  // Never save a broken model.
  model_for_each_parameter(trainer.master(), [&](const std::string& name, const Tensor& t) {
    FP8RL_CHECK(be.all_finite(t), "refusing to save a checkpoint: parameter ", name,
                " has non-finite values (the previous checkpoint is kept)");
  });
  make_dirs(checkpoints_dir);
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld", static_cast<long long>(state.step));
  const std::string final_dir = checkpoints_dir + "/" + name;
  const std::string tmp_dir = final_dir + ".tmp";
  fs::remove_all(tmp_dir);
  make_dirs(tmp_dir);

  const ModelWeights master = model_weights_to_host(be, trainer.master(), DType::F32);
  model_weights_save(master, tmp_dir, opt.model);
  std::vector<std::pair<std::string, Tensor>> opt_state = trainer.optimizer_state();
  if (opt.model.dtype != DType::F32 || opt.model.fp8_block)
    model_for_each_parameter(master, [&](const std::string& n, const Tensor& t) { opt_state.push_back({"master." + n, t}); });
  safetensors_write(tmp_dir + "/optimizer.safetensors", opt_state, {{"format", "fp8rl-adamw"}});
  // Tokenizer and generation files: the starting model's, then the tokenizer directory's.
  if (!opt.model_dir.empty() && fs::is_directory(opt.model_dir)) model_copy_side_files(opt.model_dir, tmp_dir);
  if (!opt.tokenizer_json.empty()) {
    const std::string tok_dir = fs::path(opt.tokenizer_json).parent_path().string();
    if (fs::path(opt.tokenizer_json).filename() == "tokenizer.json" && !tok_dir.empty())
      model_copy_side_files(tok_dir, tmp_dir);
    write_file_atomic(tmp_dir + "/tokenizer.json", read_file(opt.tokenizer_json));
  }
  write_missing_side_files(tmp_dir, master.config, opt.tokenizer_json);
  nlohmann::json j;
  j["step"] = state.step;
  j["optimizer_step"] = state.optimizer_step;
  j["seed"] = state.seed;
  j["kv_scales"] = {{"k", state.kv_scales.k}, {"v", state.kv_scales.v}};
  write_file_atomic(tmp_dir + "/trainer_state.json", j.dump(2) + "\n");

  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  write_file_atomic(checkpoints_dir + "/latest", std::string(name) + "\n");
  return final_dir;
}

ModelWeights checkpoint_load_policy(const std::string& dir) {
  ModelWeights w = model_weights_load(dir, DType::F32);
  const std::string opt_path = dir + "/optimizer.safetensors";
  if (!fs::exists(opt_path)) return w;
  const SafetensorsFile f = SafetensorsFile::open(opt_path);
  model_for_each_parameter(w, [&](const std::string& n, Tensor& t) {
    if (!f.contains("master." + n)) return;
    const Tensor m = f.get("master." + n);
    FP8RL_CHECK(m.dtype() == DType::F32 && m.shape() == t.shape() && t.dtype() == DType::F32, opt_path, ": master.",
                n, " is ", m.str(), ", expected F32 ", shape_str(t.shape()), "; the checkpoint is damaged");
    std::memcpy(t.raw(), m.raw(), t.nbytes());  // in place: a tied lm_head stays tied
  });
  return w;
}

std::optional<std::string> checkpoint_latest(const std::string& checkpoints_dir) {
  const std::string latest = checkpoints_dir + "/latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::string name = read_file(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  const std::string dir = checkpoints_dir + "/" + name;
  FP8RL_CHECK(fs::exists(dir + "/trainer_state.json"), checkpoints_dir, "/latest names ", name,
              " but that checkpoint is incomplete or missing; remove the 'latest' file to start over");
  return dir;
}

TrainerState checkpoint_read_state(const std::string& dir) {
  const std::string path = dir + "/trainer_state.json";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
    TrainerState s;
    s.step = j.at("step").get<int64_t>();
    s.optimizer_step = j.at("optimizer_step").get<int64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    s.kv_scales.k = j.at("kv_scales").at("k").get<std::vector<float>>();
    s.kv_scales.v = j.at("kv_scales").at("v").get<std::vector<float>>();
    return s;
  } catch (const nlohmann::json::exception& e) {
    FP8RL_FAIL(path, ": malformed trainer state (", e.what(), "); the checkpoint is damaged");
  }
}

void checkpoint_load_optimizer(Backend& be, Trainer& trainer, const std::string& dir, const TrainerState& state) {
  SafetensorsFile f = SafetensorsFile::open(dir + "/optimizer.safetensors");
  trainer.load_optimizer_state([&](const std::string& n) {
    FP8RL_CHECK(f.contains(n), dir, "/optimizer.safetensors lacks ", n, "; the checkpoint does not match the model");
    return f.get(n);
  }, state.optimizer_step);
}

}  // namespace fp8rl
