#include "rl/checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/fs.h"
#include "io/json_input.h"
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

constexpr const char* kStateFile = "trainer_state.json";

// Largest |value| of a host tensor (F32 master weights), and whether all are finite.
void scan_weights(const Tensor& h, double& max_abs, bool& finite) {
  const std::vector<float> v = to_float_vector(h);
  for (float x : v) {
    if (!std::isfinite(x)) finite = false;
    else max_abs = std::max(max_abs, static_cast<double>(std::fabs(x)));
  }
}

// "step_000012" -> 12; -1 for any other name (a path, "..", a name with a sign or suffix).
int64_t step_of_dir_name(const std::string& name) {
  if (name.size() < 11 || name.size() > 24 || name.rfind("step_", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
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
  o.max_abs_weight = c.checkpoint_max_abs_weight;
  return o;
}

uint32_t checkpoint_file_crc32(const std::string& path, uint64_t* bytes) {
  std::ifstream in(path, std::ios::binary);
  FP8RL_CHECK(in.good(), "cannot read ", path);
  std::vector<char> buf(size_t(1) << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t total = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize got = in.gcount();
    if (got <= 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(got));
    total += static_cast<uint64_t>(got);
  }
  FP8RL_CHECK(!in.bad(), "error reading ", path);
  if (bytes) *bytes = total;
  return static_cast<uint32_t>(crc);
}

std::string checkpoint_save(Backend& be, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const std::string& tokenizer_json,
                            double max_abs_weight) {
  CheckpointOptions o;
  o.tokenizer_json = tokenizer_json;
  o.max_abs_weight = max_abs_weight;
  return checkpoint_save(be, trainer, state, checkpoints_dir, o);
}

std::string checkpoint_save(Backend& be, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const CheckpointOptions& opt) {
  FP8RL_CHECK(state.step >= 0 && state.optimizer_step >= 0, "checkpoint step must be >= 0, got ", state.step);
  // Never save a broken model: non-finite, or (max_abs_weight > 0) exploded.
  const ModelWeights master = model_weights_to_host(be, trainer.master(), DType::F32);
  std::string worst;
  double worst_abs = 0;
  model_for_each_parameter(master, [&](const std::string& name, const Tensor& t) {
    double max_abs = 0;
    bool finite = true;
    scan_weights(t, max_abs, finite);
    if (!finite)
      FP8RL_FAIL("refusing to save a checkpoint: parameter ", name,
                 " has non-finite values (the previous checkpoint is kept)");
    if (max_abs > worst_abs) worst_abs = max_abs, worst = name;
  });
  if (opt.max_abs_weight > 0 && worst_abs > opt.max_abs_weight)
    FP8RL_FAIL("refusing to save a checkpoint at step ", state.step, ": parameter ", worst, " holds a weight of ",
               worst_abs, ", beyond checkpoint_max_abs_weight=", opt.max_abs_weight,
               " (the run exploded: lower train.lr / sft.lr; the previous checkpoint is kept)");
  make_dirs(checkpoints_dir);
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld", static_cast<long long>(state.step));
  const std::string final_dir = checkpoints_dir + "/" + name;
  const std::string tmp_dir = final_dir + ".tmp";
  fs::remove_all(tmp_dir);
  make_dirs(tmp_dir);

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
  // A CRC-32 (zlib) of every file beside it, verified when the checkpoint is resumed.
  nlohmann::json files = nlohmann::json::object();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp_dir))
    if (e.is_regular_file() && e.path().filename() != kStateFile) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const std::string& f : names) {
    uint64_t bytes = 0;
    const uint32_t crc = checkpoint_file_crc32(tmp_dir + "/" + f, &bytes);
    files[f] = {{"bytes", bytes}, {"crc32", crc}};
  }
  j["files"] = files;
  write_file_atomic(tmp_dir + "/" + kStateFile, j.dump(2) + "\n");

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

std::vector<std::string> checkpoint_prune(const std::string& checkpoints_dir, int keep_last) {
  std::vector<std::string> pruned;
  if (keep_last <= 0 || !fs::is_directory(checkpoints_dir)) return pruned;
  std::string latest;
  if (fs::exists(checkpoints_dir + "/latest")) {
    latest = read_file(checkpoints_dir + "/latest");
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  }
  std::vector<std::string> steps, leftovers;
  for (const auto& e : fs::directory_iterator(checkpoints_dir)) {
    if (!e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0) continue;
    if (name.size() > 7 && name.compare(name.size() - 7, 7, ".pruned") == 0) leftovers.push_back(e.path().string());
    else if (name.find('.') == std::string::npos) steps.push_back(name);
  }
  std::sort(steps.begin(), steps.end());  // zero-padded: name order is step order
  const size_t keep = static_cast<size_t>(keep_last);
  for (size_t i = 0; i + keep < steps.size(); ++i) {
    if (steps[i] == latest) continue;
    const std::string dir = checkpoints_dir + "/" + steps[i];
    fs::rename(dir, dir + ".pruned");
    leftovers.push_back(dir + ".pruned");
    pruned.push_back(dir);
  }
  for (const std::string& d : leftovers) fs::remove_all(d);
  return pruned;
}

std::optional<std::string> checkpoint_latest(const std::string& checkpoints_dir) {
  const std::string latest = checkpoints_dir + "/latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::string name = read_file_limited(latest, 4096, "checkpoints/latest file");
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
  // `latest` names a directory of this run: step_N, nothing else (no path, no "..", no link out).
  if (step_of_dir_name(name) < 0)
    FP8RL_FAIL(latest, " must name a checkpoint directory of this run (step_NNNNNN), got '",
               name.substr(0, 100), "'; fix or remove the 'latest' file");
  const std::string dir = checkpoints_dir + "/" + name;
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(dir, ec), root = fs::weakly_canonical(checkpoints_dir, ec);
  if (ec || real.parent_path() != root)
    FP8RL_FAIL(latest, " names ", name, ", which is not a directory inside ", checkpoints_dir,
               " (a symbolic link out of the run?); fix or remove the 'latest' file");
  FP8RL_CHECK(fs::exists(dir + "/" + kStateFile), checkpoints_dir, "/latest names ", name,
              " but that checkpoint is incomplete or missing; remove the 'latest' file to start over");
  return dir;
}

TrainerState checkpoint_read_state(const std::string& dir) {
  const std::string path = dir + "/" + kStateFile;
  const nlohmann::json j = json_parse_limited(read_file_limited(path, size_t(16) << 20, kStateFile), path,
                                              {size_t(16) << 20, 8});
  auto damaged = [&](const std::string& what) -> TrainerState {
    FP8RL_FAIL(path, ": ", what, "; the checkpoint is damaged or was edited (resume from another one, or start over)");
  };
  TrainerState s;
  try {
    if (!j.is_object()) return damaged("not a JSON object");
    s.step = json_get_int(j.at("step"), 0, INT64_MAX >> 1, "'step'");
    s.optimizer_step = json_get_int(j.at("optimizer_step"), 0, INT64_MAX >> 1, "'optimizer_step'");
    s.seed = j.at("seed").get<uint64_t>();
    s.kv_scales.k = j.at("kv_scales").at("k").get<std::vector<float>>();
    s.kv_scales.v = j.at("kv_scales").at("v").get<std::vector<float>>();
    if (j.contains("files")) {
      for (const auto& [f, e] : j.at("files").items())
        s.files.push_back({f, static_cast<uint64_t>(json_get_int(e.at("bytes"), 0, INT64_MAX, "file size")),
                           static_cast<uint32_t>(json_get_int(e.at("crc32"), 0, UINT32_MAX, "crc32"))});
    }
  } catch (const nlohmann::json::exception& e) {
    return damaged(std::string("malformed trainer state (") + e.what() + ")");
  } catch (const Error& e) {
    return damaged(e.message());
  }
  for (const auto* v : {&s.kv_scales.k, &s.kv_scales.v})
    for (float x : *v)
      if (!(std::isfinite(x) && x > 0)) return damaged("a KV scale is not a finite positive number");
  const int64_t dir_step = step_of_dir_name(fs::path(dir).filename().string());
  if (dir_step >= 0 && dir_step != s.step)
    return damaged("'step' is " + std::to_string(s.step) + " but the directory is the checkpoint of step " +
                   std::to_string(dir_step));
  return s;
}

void checkpoint_verify_files(const std::string& dir, const TrainerState& state) {
  if (state.files.empty()) {
    std::fprintf(stderr, "note: %s has no file checksums (written by an older fp8rl); not verified\n", dir.c_str());
    return;
  }
  for (const auto& f : state.files) {
    const std::string path = dir + "/" + f.name;
    FP8RL_CHECK(f.name.find('/') == std::string::npos && f.name != ".." && fs::is_regular_file(path), dir, "/",
                kStateFile, " lists '", f.name, "', which is not a file of the checkpoint; the checkpoint is damaged");
    uint64_t bytes = 0;
    const uint32_t crc = checkpoint_file_crc32(path, &bytes);
    if (bytes != f.bytes || crc != f.crc32)
      FP8RL_FAIL(path, " does not match its checksum in ", kStateFile, " (", bytes, " bytes, crc32 ", crc,
                 "; expected ", f.bytes, " bytes, crc32 ", f.crc32,
                 "): the file was changed or corrupted; resume from another checkpoint or start over");
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
