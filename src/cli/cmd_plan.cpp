// fp8rl plan [--config FILE] [--shape NAME] [--layers N] [--device-gib G] [key.sub=value ...]
//   Prints the device-memory plan of a GRPO run (rl/memory_plan.h) without running anything:
//   the model from --shape (model/shapes.h: qwen3-0.6b, qwen3-1.7b, qwen3-8b, llama-3.2-1b,
//   llama-3.1-8b, qwen3-30b-a3b, moonlight-16b-a3b, tiny, tiny-moe, tiny-mla; --layers N: the first N
//   blocks), else model.path's
//   config.json, else the tiny model (its vocabulary from model.tiny.vocab_size or the tokenizer).
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "model/shapes.h"
#include "rl/config.h"
#include "rl/memory_plan.h"
#include "rl/session.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl::cli {
namespace {

double parse_gib(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !(v >= 0 && v <= 1e6)) FP8RL_FAIL("--device-gib ", text, " is not a size in GiB (e.g. 139)");
  return v;
}

ModelConfig plan_model(const RunConfig& c, const std::string& shape) {
  if (!shape.empty()) return model_shape(shape);
  if (!c.model.path.empty()) return model_config_load(c.model.path);
  int vocab = c.model.tiny.vocab_size;
  if (vocab <= 0) {
    FP8RL_CHECK(!c.tokenizer.path.empty(), "plan: the tiny model's vocabulary is unknown: set model.tiny.vocab_size, "
                "tokenizer.path, model.path or --shape");
    const std::string p = std::filesystem::is_directory(c.tokenizer.path) ? c.tokenizer.path + "/tokenizer.json"
                                                                         : c.tokenizer.path;
    vocab = Tokenizer::load(p).vocab_size();
  }
  return session_tiny_model_config(c.model.tiny, vocab, 0);
}

int run(const std::vector<std::string>& argv) {
  Args a(argv, {"config", "shape", "layers", "device-gib"}, {"help"}, /*config_overrides=*/true);
  if (a.has("help")) {
    std::string shapes;
    for (const std::string& n : model_shape_names()) shapes += (shapes.empty() ? "" : "|") + n;
    std::printf("usage: fp8rl plan [--config FILE] [--shape %s] [--layers N] [--device-gib G]"
                " [key.sub=value ...]\n"
                "  The device-memory plan of `fp8rl train` with this config (rollout sizes, micro_batch_tokens,\n"
                "  precision.recipe, kl_beta), for the config's model or a named shape (--layers N: its first N\n"
                "  blocks, as the benches' --layers). --device-gib: memory of\n"
                "  the device to check against (default 139 with device=cuda, none on the CPU); train.recompute=auto,\n"
                "  train.dgrad_weight_cache=auto and the KV pool of rollout.gpu_memory_utilization are decided\n"
                "  against it.\n"
                "  train.optimizer_state_dtype=bf16 / train.grad_dtype=bf16: the lean optimizer.\n", shapes.c_str());
    return 0;
  }
  // A named shape stands for the model: the config is validated against its positions, not the
  // tiny model's (rollout.max_new_tokens=1024 is fine for llama-3.1-8b).
  std::vector<std::string> overrides = a.positional();
  if (a.has("shape"))
    overrides.insert(overrides.begin(), "model.tiny.max_position_embeddings=" +
                                            std::to_string(model_shape(a.get("shape")).max_position_embeddings));
  RunConfig c = config_load(a.get("config"), overrides);
  ModelConfig model = plan_model(c, a.get("shape"));
  if (a.has("layers")) model = model_shape_cut(model, a.get_int("layers", model.num_layers, 1));
  const bool cuda = c.device == "cuda";
  const double gib = parse_gib(a.get("device-gib", cuda ? "139" : "0"));
  const DType act = cuda ? DType::BF16 : DType::F32;
  const int64_t device_bytes = static_cast<int64_t>(gib * double(1ll << 30));
  // train.recompute and train.dgrad_weight_cache: auto and the KV pool (rollout.
  // gpu_memory_utilization), decided against the device's memory as `fp8rl train` decides them
  // against its free memory (unknown: none, on, the shape-sized pool).
  const MemoryChoice choice = memory_plan_choose(c, model, act, device_bytes > 0 ? device_bytes : -1);
  const MemoryPlan plan = memory_plan_compute(memory_plan_input_chosen(c, model, act, choice));
  const int64_t budget = memory_plan_budget_bytes(c, device_bytes);
  std::fputs(memory_plan_format(plan, model, budget).c_str(), stdout);
  if (budget != device_bytes && device_bytes > 0)
    std::printf("  (checked against rollout.gpu_memory_utilization %.2f of the %.2f GiB device)\n",
                c.rollout.gpu_memory_utilization, gib);
  std::fputs(choice.lines.c_str(), stdout);
  if (device_bytes > 0 && plan.peak_bytes() > budget) {  // what `fp8rl train` would say, with its knobs
    RunConfig strict = c;
    strict.memory.allow_overcommit = true;  // the refusal's text as a warning, not an exception
    std::string text = memory_plan_check(strict, model, act, device_bytes);
    if (text.rfind("warning: " + choice.lines, 0) == 0) text = "warning: " + text.substr(9 + choice.lines.size());
    const size_t at = text.find("warning: ");
    if (at != std::string::npos) text = text.substr(at + 9);
    const size_t tail = text.find("\nmemory.allow_overcommit is set");
    if (tail != std::string::npos) text = text.substr(0, tail + 1);
    std::printf("fp8rl train would refuse this run: %s", text.c_str());
  }
  return 0;
}

Register reg{"plan", "device-memory plan of a GRPO run (any model shape) without running it", run};

}  // namespace
}  // namespace fp8rl::cli
