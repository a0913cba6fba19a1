#include "rl/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "io/safetensors.h"

namespace fp8rl {

namespace fs = std::filesystem;

std::string checkpoint_save(Backend& be, const Trainer& trainer, const TrainerState& state,
                            const std::string& checkpoints_dir, const std::string& tokenizer_json) {
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

  model_weights_save(model_weights_to_host(be, trainer.master(), DType::F32), tmp_dir);
  safetensors_write(tmp_dir + "/optimizer.safetensors", trainer.optimizer_state(), {{"format", "fp8rl-adamw"}});
  if (!tokenizer_json.empty()) write_file_atomic(tmp_dir + "/tokenizer.json", read_file(tokenizer_json));
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
