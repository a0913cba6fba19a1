// The one registry of named model shapes (HF config values of real checkpoints), used wherever a
// shape is named instead of loaded: `fp8rl plan --shape`, `bench generate --model`,
// `bench rl-step --model`. Random weights of these shapes: bench/rollout_bench.h.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace fp8rl {

// "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3.2-1b" (alias "1b"), "llama-3.1-8b" (alias
// "8b"), or "tiny" (a 2-layer llama with 128-wide dimensions for CPU smoke runs: whole FP8
// blocks, as on the real shapes). Throws naming the known shapes on anything else.
ModelConfig model_shape(const std::string& name);
std::vector<std::string> model_shape_names();

}  // namespace fp8rl
