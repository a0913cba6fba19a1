// fp8rl plan [--config FILE] [--shape NAME] [--device-gib G] [key.sub=value ...]
//   Prints the device-memory plan of a GRPO run (rl/memory_plan.h) without running anything:
//   the model from --shape (qwen3-0.6b, qwen3-1.7b, llama-3.2-1b), else model.path's
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
  Args a(argv, {"config", "shape", "device-gib"}, {"help"}, /*config_overrides=*/true);
  if (a.has("help")) {
    std::printf("usage: fp8rl plan [--config FILE] [--shape qwen3-0.6b|qwen3-1.7b|llama-3.2-1b] [--device-gib G]"
                " [key.sub=value ...]\n"
                "  The device-memory plan of `fp8rl train` with this config (rollout sizes, micro_batch_tokens,\n"
                "  precision.recipe, kl_beta), for the config's model or a named shape. --device-gib: memory of\n"
                "  the device to check against (default 139 with device=cuda, none on the CPU); train.recompute=auto\n"
                "  is decided against it. train.optimizer_state_dtype=bf16 / train.grad_dtype=bf16: the lean optimizer.\n");
    return 0;
  }
  RunConfig c = config_load(a.get("config"), a.positional());
  const ModelConfig model = plan_model(c, a.get("shape"));
  const bool cuda = c.device == "cuda";
  const double gib = parse_gib(a.get("device-gib", cuda ? "139" : "0"));
  const DType act = cuda ? DType::BF16 : DType::F32;
  const int64_t device_bytes = static_cast<int64_t>(gib * double(1ll << 30));
  std::string why;  // train.recompute: auto, decided against the device's memory (none when unknown)
  c.train.recompute = memory_plan_resolve_recompute(c, model, act, device_bytes > 0 ? device_bytes : -1, false, &why);
  const MemoryPlan plan = memory_plan_compute(memory_plan_input(c, model, act));
  std::fputs(memory_plan_format(plan, model, device_bytes).c_str(), stdout);
  std::fputs(why.c_str(), stdout);
  return 0;
}

Register reg{"plan", "device-memory plan of a GRPO run (any model shape) without running it", run};

}  // namespace
}  // namespace fp8rl::cli
