#include "core/precision.h"

#include "core/error.h"

namespace fp8rl {

const char* linear_mode_name(LinearMode m) {
  switch (m) {
    case LinearMode::FP32: return "fp32";
    case LinearMode::BF16: return "bf16";
    case LinearMode::FP8_BLOCK: return "fp8";
  }
  return "?";
}

LinearMode linear_mode_from_name(const std::string& s) {
  if (s == "fp32" || s == "f32") return LinearMode::FP32;
  if (s == "bf16") return LinearMode::BF16;
  if (s == "fp8" || s == "fp8_block") return LinearMode::FP8_BLOCK;
  FP8RL_FAIL("unknown linear precision '", s, "' (expected fp32, bf16 or fp8)");
}

PrecisionRecipe PrecisionRecipe::preset(const std::string& name) {
  PrecisionRecipe r;
  r.name = name;
  if (name == "fp32") {
    r.generator.linear = r.trainer.linear = LinearMode::FP32;
    r.generator.kv_cache = DType::F32;
  } else if (name == "bf16") {
    r.generator.linear = r.trainer.linear = LinearMode::BF16;
    r.generator.kv_cache = DType::BF16;
  } else if (name == "fp8_gen") {
    r.generator.linear = LinearMode::FP8_BLOCK;
    r.generator.kv_cache = DType::E4M3;
    r.trainer.linear = LinearMode::BF16;
  } else if (name == "fp8_e2e") {
    r.generator.linear = r.trainer.linear = LinearMode::FP8_BLOCK;
    r.generator.kv_cache = DType::E4M3;
  } else {
    FP8RL_FAIL("unknown precision recipe '", name, "' (expected fp32, bf16, fp8_gen or fp8_e2e)");
  }
  return r;
}

}  // namespace fp8rl
