#include "core/precision.h"

#include <sstream>

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
    r.trainer.kv_cache = DType::E4M3;  // the trainer attends over the values the E4M3 cache held
  } else if (name == "fp8_e2e") {
    r.generator.linear = r.trainer.linear = LinearMode::FP8_BLOCK;
    r.generator.kv_cache = DType::E4M3;
    r.trainer.kv_cache = DType::E4M3;
    // Measured on the H200 (docs/benchmarks.md, session 4): the BF16 weight gradient is faster
    // than the FP8 one at the 1B-1.7B shapes (its two transposed requantizations cost more
    // than the GEMM saves).
    r.trainer.wgrad = LinearMode::BF16;
  } else {
    FP8RL_FAIL("unknown precision recipe '", name, "' (expected fp32, bf16, fp8_gen or fp8_e2e)");
  }
  return r;
}

void PrecisionRecipe::set_consistent(bool on) {
  generator.consistent = trainer.consistent = on;
  if (!on) return;
  FP8RL_CHECK(!generator.fp8_attention, "precision: the consistent mode does not take FP8 attention (the trainer's "
              "attention backward has no FP8 form): turn precision.fp8_attention off (recipe spec: attn=off)");
  trainer.kv_cache = generator.kv_cache;  // the trainer attends through a cache of the generator's dtype
}

void PrecisionRecipe::set_consistent_mode(const std::string& mode) {
  FP8RL_CHECK(mode == "off" || mode == "on" || mode == "attn" || mode == "flash",
              "precision: the consistent mode must be off, on, attn or flash, got '", mode, "'");
  set_consistent(mode != "off");
  for (EnginePrecision* e : {&generator, &trainer}) {
    e->consistent_linears = mode != "attn" && mode != "flash";
    e->consistent_flash = mode == "flash";
  }
}

PrecisionRecipe PrecisionRecipe::parse(const std::string& spec) {
  const size_t colon = spec.find(':');
  PrecisionRecipe r = preset(spec.substr(0, colon));
  r.name = spec;
  if (colon == std::string::npos) return r;
  std::stringstream ss(spec.substr(colon + 1));
  std::string item;
  bool tkv_set = false;
  std::string consistent = "off";
  while (std::getline(ss, item, '+')) {
    const size_t eq = item.find('=');
    FP8RL_CHECK(eq != std::string::npos, "recipe '", spec, "': override '", item, "' is not key=value");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    auto on_off = [&]() {
      FP8RL_CHECK(v == "on" || v == "off", "recipe '", spec, "': ", k, " must be on or off, got '", v, "'");
      return v == "on";
    };
    if (k == "gen") {
      r.generator.linear = linear_mode_from_name(v);
    } else if (k == "train") {
      r.trainer.linear = linear_mode_from_name(v);
    } else if (k == "kv") {
      FP8RL_CHECK(v == "f32" || v == "bf16" || v == "e4m3", "recipe '", spec, "': kv must be f32, bf16 or e4m3");
      r.generator.kv_cache = v == "f32" ? DType::F32 : v == "bf16" ? DType::BF16 : DType::E4M3;
    } else if (k == "tkv") {
      FP8RL_CHECK(v == "bf16" || v == "e4m3", "recipe '", spec, "': tkv must be bf16 or e4m3");
      r.trainer.kv_cache = v == "e4m3" ? DType::E4M3 : DType::BF16;
      tkv_set = true;
    } else if (k == "attn") {
      FP8RL_CHECK(v == "fp8" || v == "off", "recipe '", spec, "': attn must be fp8 or off");
      r.generator.fp8_attention = v == "fp8";
    } else if (k == "pow2") {
      r.generator.pow2_scales = r.trainer.pow2_scales = on_off();
    } else if (k == "first" || k == "last") {
      const int n = std::stoi(v);
      FP8RL_CHECK(n >= 0, "recipe '", spec, "': ", k, " must be >= 0");
      (k == "first" ? r.generator.bf16_first_layers : r.generator.bf16_last_layers) = n;
      (k == "first" ? r.trainer.bf16_first_layers : r.trainer.bf16_last_layers) = n;
    } else if (k == "wgrad") {
      FP8RL_CHECK(v == "fp8" || v == "bf16", "recipe '", spec, "': wgrad must be fp8 or bf16");
      r.trainer.wgrad = linear_mode_from_name(v);
    } else if (k == "logits") {
      FP8RL_CHECK(v == "exact" || v == "fast", "recipe '", spec, "': logits must be exact or fast, got '", v, "'");
      r.generator.consistent_logits = r.trainer.consistent_logits = v == "exact";
    } else if (k == "consistent") {
      FP8RL_CHECK(v == "on" || v == "off" || v == "attn" || v == "flash", "recipe '", spec,
                  "': consistent must be on, off, attn or flash, got '", v, "'");
      consistent = v;
    } else {
      FP8RL_FAIL("recipe '", spec, "': unknown override '", k,
                 "' (gen, train, kv, tkv, attn, pow2, first, last, wgrad, consistent, logits)");
    }
  }
  FP8RL_CHECK(!r.generator.fp8_attention || r.generator.kv_cache == DType::E4M3, "recipe '", spec,
              "': attn=fp8 needs kv=e4m3");
  FP8RL_CHECK(!tkv_set || r.trainer.kv_cache != DType::E4M3 || r.generator.kv_cache == DType::E4M3, "recipe '",
              spec, "': tkv=e4m3 rounds as the generator's E4M3 cache does and needs kv=e4m3");
  if (r.generator.kv_cache != DType::E4M3) r.trainer.kv_cache = DType::BF16;  // no E4M3 cache to round as
  FP8RL_CHECK(consistent == "off" || !tkv_set, "recipe '", spec, "': consistent=on decides how the trainer reads "
              "k and v (through a cache of the generator's KV dtype): drop tkv");
  r.set_consistent_mode(consistent);
  FP8RL_CHECK(consistent != "off" || r.generator.consistent_logits, "recipe '", spec,
              "': logits=fast relaxes a consistent mode's head: add consistent=on, attn or flash");
  return r;
}

}  // namespace fp8rl
