// The one registry of named model shapes (HF config values of real checkpoints), used wherever a
// shape is named instead of loaded: `fp8rl plan --shape`, `bench generate --model`,
// `bench rl-step --model`. Random weights of these shapes: bench/rollout_bench.h.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace fp8rl {

// "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3.2-1b" (alias "1b"), "llama-3.1-8b" (alias
// "8b"), the mixtures of experts "qwen3-30b-a3b" (Qwen3-MoE) and "moonlight-16b-a3b"
// (DeepSeek-V3: MLA, sigmoid routing, shared experts), or the CPU smoke shapes "tiny" (a 2-layer
// llama), "tiny-moe" (a 3-layer Qwen3-MoE) and "tiny-mla" (a 3-layer DeepSeek-V3), all with
// 128-wide dimensions: whole FP8 blocks, as on the real shapes. Throws naming the known shapes on
// anything else.
ModelConfig model_shape(const std::string& name);
std::vector<std::string> model_shape_names();
// The first `layers` blocks of a shape (`--layers N` of the benches and `fp8rl plan`): the
// layer rules are kept (first_k_dense_replace, mlp_only_layers below N), so a cut MoE keeps its
// dense first layers. Throws unless 1 <= layers <= config.num_layers.
ModelConfig model_shape_cut(ModelConfig config, int layers);

}  // namespace fp8rl
