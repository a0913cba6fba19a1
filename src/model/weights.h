// ModelWeights: the parameters of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder as one struct of
// named tensors, mapped one to one onto Hugging Face tensor names (weights.cpp, visit_slots).
//
// Shapes use D = hidden_size, F = intermediate_size, V = vocab_size, Hq / Hkv = query / KV
// heads, hd = head_dim, E = num_experts, Fe = moe_intermediate_size. A linear weight is [out_features, in_features] as in HF (Y = X W^T).
// The same struct holds gradients (model_grads_alloc): every tensor then is the gradient of
// the parameter of the same name, F32 or F64.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/precision.h"
#include "model/config.h"

namespace fp8rl {

// One SwiGLU expert of a mixture-of-experts MLP: model.layers.{i}.mlp.experts.{e}.*
struct ExpertWeights {
  LinearWeight gate;  // [Fe, D]  gate_proj
  LinearWeight up;    // [Fe, D]  up_proj
  LinearWeight down;  // [D, Fe]  down_proj
};

struct LayerWeights {
  Tensor attn_norm;        // [D]          model.layers.{i}.input_layernorm.weight
  LinearWeight q;          // [Hq*hd, D]   self_attn.q_proj (+ bias [Hq*hd] when attention_bias)
  LinearWeight k;          // [Hkv*hd, D]  self_attn.k_proj (+ bias [Hkv*hd])
  LinearWeight v;          // [Hkv*hd, D]  self_attn.v_proj (+ bias [Hkv*hd])
  LinearWeight o;          // [D, Hq*hd]   self_attn.o_proj (never a bias)
  Tensor q_norm, k_norm;   // [hd]         self_attn.q_norm / k_norm (qwen3 only)
  // MLA attention (deepseek_v3, config.is_mla(); H heads, qk = qk_nope + qk_rope, r = qk_rope,
  // dv = v_head_dim, kvr = kv_lora_rank, qr = q_lora_rank). k and v are undefined; q is
  // self_attn.q_proj [H*qk, D] without q compression (qr = 0), else undefined and
  // q_a [qr, D] (q_a_proj) -> q_a_norm [qr] (q_a_layernorm) -> q_b [H*qk, qr] (q_b_proj);
  // kv_a [kvr + r, D] (kv_a_proj_with_mqa: the latent, then the shared rotary key),
  // kv_a_norm [kvr] (kv_a_layernorm), kv_b [H*(qk_nope + dv), kvr] (kv_b_proj: per head k_nope
  // then v); o [D, H*dv].
  LinearWeight q_a, q_b, kv_a, kv_b;
  Tensor q_a_norm, kv_a_norm;
  Tensor mlp_norm;         // [D]          post_attention_layernorm.weight
  LinearWeight gate;       // [F, D]       mlp.gate_proj   (dense MLP; undefined in an MoE layer)
  LinearWeight up;         // [F, D]       mlp.up_proj
  LinearWeight down;       // [D, F]       mlp.down_proj
  // Mixture-of-experts MLP (config.layer_is_moe(i); empty / undefined otherwise). The router
  // is never FP8: it runs in FP32 (model/transformer.h).
  // In an MoE layer gate/up/down, when defined, are the always-on shared experts
  // (mlp.shared_experts.*, width n_shared_experts * Fe; DeepSeek-V3 routing).
  LinearWeight router;                 // [E, D]  mlp.gate (no bias)
  Tensor router_bias;                  // [E]     mlp.gate.e_score_correction_bias (sigmoid routing;
                                       //         selection only: its gradient is zero)
  std::vector<ExpertWeights> experts;  // [E]     mlp.experts.{e}
  bool is_moe() const { return !experts.empty(); }
};

struct ModelWeights {
  ModelConfig config;
  Tensor embed;                      // [V, D]  model.embed_tokens.weight
  std::vector<LayerWeights> layers;  // [num_layers]
  Tensor final_norm;                 // [D]     model.norm.weight
  Tensor lm_head;                    // [V, D]  lm_head.weight; tied: the same tensor as embed
};

// ---- construction ------------------------------------------------------------------------

// A small config for models trained from scratch (tests, the RL demo). `family` is "llama"
// (llama3 rope scaling), "qwen2" (q/k/v biases), "qwen3" (q/k-norm, tied embeddings) or
// "qwen3_moe" (q/k-norm, 4 experts of width hidden_size, top-2 renormalized, untied, every layer
// sparse except layer 0 when num_layers > 2).
ModelConfig model_config_tiny(const std::string& family, int vocab_size, int hidden_size = 64,
                              int num_layers = 2, int num_heads = 4, int num_kv_heads = 2,
                              int intermediate_size = 0 /* 0: 3 * hidden_size */);

struct RandomInit {
  uint64_t seed = 0;
  float std = 0.02f;         // linears and embedding ~ N(0, std^2)
  float bias_std = 0.0f;     // q/k/v biases ~ N(0, bias_std^2) (HF initializes them to 0)
  float norm_jitter = 0.0f;  // norm weights = 1 + N(0, norm_jitter^2) (1 exactly when 0)
};
// Seeded random weights on the host, every tensor of `dtype` (F32, BF16 or F64).
ModelWeights model_weights_random(const ModelConfig& config, const RandomInit& init, DType dtype = DType::F32);

// Loads a checkpoint directory (config.json + model.safetensors or sharded
// model-0000x-of-0000y.safetensors with model.safetensors.index.json) onto the host. Stored
// F32 / BF16 / F16 tensors are converted to `dtype` (F32, BF16 or F64). F8_E4M3 linear weights
// with a `weight_scale_inv` (128x128 blocks) are dequantized into `w`, and with keep_fp8 also
// kept as the pre-quantized `wq`.
ModelWeights model_weights_load(const std::string& dir, DType dtype = DType::F32, bool keep_fp8 = false);

// How model_weights_save writes a checkpoint.
struct SaveOptions {
  // Stored dtype of every tensor not written as FP8: F32 or BF16. config.json's "torch_dtype"
  // says it (transformers then loads the tensors as they are).
  DType dtype = DType::F32;
  // FP8 block format (DeepSeek-V3 / Qwen3-FP8 layout, what transformers' FineGrainedFP8 and
  // vLLM load): the 7 linears of every block outside bf16_first/last_layers are written as
  // F8_E4M3 [out, in] + "<name>.weight_scale_inv" F32 [ceil(out/128), ceil(in/128)] (the
  // dequantization multipliers of the reference 128x128 quantizer), and config.json gets a
  // "quantization_config" (quant_method fp8, e4m3, dynamic activations, 128x128 blocks; the
  // kept linears listed in modules_to_not_convert / ignored_layers).
  bool fp8_block = false;
  bool pow2_scales = false;
  int bf16_first_layers = 0, bf16_last_layers = 0;
  // Above this many bytes of tensors, model-0000i-of-0000n.safetensors shards (each at most
  // this size unless one tensor is larger) and model.safetensors.index.json; <= 0: one file.
  double max_shard_gb = 5;
};

// Writes config.json and the safetensors (HF layout, host tensors only; lm_head.weight omitted
// when tied) as `opt` says. Every file is written atomically (temporary file, then rename); a
// model*.safetensors or index left in `dir` by an earlier save is removed first. Creates the
// directory if needed.
void model_weights_save(const ModelWeights& weights, const std::string& dir, const SaveOptions& opt = {});

// Issue 17. transformers' dequantize=True load of the FP8 block format (Fp8Dequantize in
// integrations/finegrained_fp8.py, 5.17 through 5.24; also what it falls back to by itself on a
// CPU or a GPU below compute capability 8.9) takes the block of a weight_scale_inv grid
// [gr, gc] on an [out, in] weight to be out/gr x in/gc, not the weight_block_size 128 x 128
// that the format, DeepSeek-V3, vLLM and transformers' own FP8Linear use. It reads [out, in]
// right when each dimension is a multiple of 128 or at most 128 (one block); otherwise it
// uses wrong scales for some rows or columns (160 rows, 2 scale rows: blocks of 80) or refuses
// the weight when the grid does not divide it (576 rows, 5 scale rows). Returns "" when the
// shape is read right, else what happens to it.
std::string hf_dequantize_block_misread(int64_t out, int64_t in);
// The FP8 linears model_weights_save(weights, dir, opt) writes that transformers' dequantize=True
// load misreads: "<module> [out, in] scales [gr, gc]: <what happens>", in save order. Empty when
// !opt.fp8_block, and for every real checkpoint whose widths are multiples of 128.
std::vector<std::string> model_fp8_hf_dequantize_misreads(const ModelWeights& weights, const SaveOptions& opt);

// The files of a HF model directory beside its weights that a checkpoint must carry for
// transformers and serving stacks to behave as with the original (tokenizer.json,
// tokenizer_config.json, special_tokens_map.json, chat_template.jinja, generation_config.json,
// and the slow tokenizers' vocabulary files). Copies those `from_dir` has; returns their names.
std::vector<std::string> model_copy_side_files(const std::string& from_dir, const std::string& to_dir);

// A copy on `backend`'s device with every float tensor converted to `dtype`; wq kept as is.
// Tied embeddings stay shared.
ModelWeights model_weights_to_device(Backend& backend, const ModelWeights& weights, DType dtype);
// A host copy (for saving), float tensors in `dtype`.
ModelWeights model_weights_to_host(Backend& backend, const ModelWeights& weights, DType dtype);

// Gradients (and Adam moments): a zero-filled ModelWeights of the same structure on `backend`
// (F32, BF16 or F64);
// linears get `w` (and `bias` where the weight has one), never `wq`; tied lm_head shares embed.
// With `arena` non-null every tensor is a view into one buffer, returned there (zeroing all is
// then one fill: model_grads_zero with that arena).
ModelWeights model_grads_alloc(Backend& backend, const ModelWeights& weights, DType dtype = DType::F32,
                               Tensor* arena = nullptr);
void model_grads_zero(Backend& backend, ModelWeights& grads, Tensor* arena = nullptr);

// ---- names and iteration -----------------------------------------------------------------

// Calls fn(hf_name, tensor) for every defined parameter tensor, in a fixed order (embedding,
// layers in order, final norm, lm_head). A tied lm_head is visited once, as the embedding.
// LinearWeight contributes its `w` ("<name>.weight") and `bias` ("<name>.bias"), not `wq`.
void model_for_each_parameter(ModelWeights& weights, const std::function<void(const std::string&, Tensor&)>& fn);
void model_for_each_parameter(const ModelWeights& weights,
                              const std::function<void(const std::string&, const Tensor&)>& fn);
// Calls fn(hf_prefix, layer, weight) for the linears of every block that follow the block's
// precision (linear_for_layer): q, k, v, o, then the dense gate, up, down
// ("model.layers.3.mlp.up_proj") or every expert's ("model.layers.3.mlp.experts.5.up_proj").
// The MoE router is not one of them (it stays high precision).
void model_for_each_linear(ModelWeights& weights,
                           const std::function<void(const std::string&, int, LinearWeight&)>& fn);
int64_t model_count_parameters(const ModelWeights& weights);

// The mode of block linear `name` (as model_for_each_linear names it) of `layer`: the block's
// precision.linear_for_layer, except that in an MLA model (deepseek_v3) an attention projection
// (self_attn.*) whose out or in features are not multiples of 128 stays BF16 where the block is
// FP8: its 128x128 weight blocks would be partial (Moonlight's / DeepSeek-V3's
// kv_a_proj_with_mqa, 576 = kv_lora_rank 512 + qk_rope_head_dim 64 rows: its last block row
// holds only the rotary key; transformers refuses such a grid in an FP8 export, and the CUDA
// FP8 GEMM wants K % 128 == 0). The model, the trainer's weight cache and the FP8 save use it.
bool mla_projection_kept_bf16(const ModelConfig& config, int64_t out_features, int64_t in_features);
LinearMode model_linear_mode(const ModelConfig& config, const EnginePrecision& precision, const std::string& name,
                             int layer, const LinearWeight& w);
// The linears model_linear_mode keeps BF16 under this (FP8) precision, "name [out, in]" (empty
// for every model but MLA ones with such widths). Printed at start by the trainer.
std::vector<std::string> model_bf16_kept_linears(const ModelWeights& weights, const EnginePrecision& precision);

// Host helper: a float tensor (F32/BF16/F16/E4M3/F64) converted to `dtype` (F32/BF16/F16/F64).
Tensor tensor_convert_host(const Tensor& t, DType dtype);

}  // namespace fp8rl
