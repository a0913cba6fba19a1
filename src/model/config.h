// ModelConfig: what fp8rl needs of a Hugging Face config.json (llama, qwen2, qwen3, qwen3_moe).
#pragma once
#include <string>
#include <vector>

#include "backend/backend.h"

namespace fp8rl {

struct ModelConfig {
  std::string model_type;         // "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "deepseek_v3" (MLA)
  int vocab_size = 0;
  int hidden_size = 0;            // D
  int intermediate_size = 0;      // F
  int num_layers = 0;             // num_hidden_layers
  int num_heads = 0;              // Hq
  int num_kv_heads = 0;           // Hkv (num_key_value_heads; defaults to num_heads)
  int head_dim = 0;               // hd (explicit head_dim, else hidden_size / num_heads)
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  bool attention_bias = false;    // q/k/v biases (qwen2: true; llama: attention_bias key)
  bool qk_norm = false;           // per-head RMSNorm on q and k before RoPE (qwen3)
  int max_position_embeddings = 0;
  int bos_token_id = -1, eos_token_id = -1;  // -1 when absent (first of a list)
  std::vector<int> eos_token_ids;            // all EOS ids when the config lists several
  std::string torch_dtype = "float32";       // torch_dtype (4.x) or dtype (5.x)
  // RoPE: rope_theta and rope_scaling (4.x) or rope_parameters (5.x); rope_type "default"
  // or "llama3" (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
  float rope_theta = 10000.0f;
  std::string rope_type = "default";
  float rope_factor = 1.0f, rope_low_freq_factor = 1.0f, rope_high_freq_factor = 4.0f;
  int rope_original_max_position = 8192;

  // Mixture of experts (qwen3_moe): the MLP of a sparse layer is a router [E, D] and E SwiGLU
  // experts of width moe_intermediate_size, k of them per token; the other ("mlp_only") layers
  // keep a dense MLP of intermediate_size. num_experts == 0: a dense model.
  int num_experts = 0;             // E: num_experts (4.x) / num_local_experts (5.x)
  int num_experts_per_tok = 0;     // k
  int moe_intermediate_size = 0;   // Fe
  bool norm_topk_prob = false;     // renormalize the k routing weights to sum to 1
  int decoder_sparse_step = 1;     // layer l is sparse when (l + 1) % step == 0 ...
  std::vector<int> mlp_only_layers;  // ... and l is not listed here

  // DeepSeek-V3 / Moonlight (deepseek_v3): sigmoid routing with a score-correction bias, grouped
  // top-k, routed_scaling_factor, always-on shared experts, the first layers dense. Parsed and
  // validated; the MLA attention below scores, trains and generates (latent cache) on both backends.
  std::string moe_router = "softmax";  // "softmax" (qwen3_moe) | "sigmoid" (deepseek_v3 noaux_tc)
  int n_group = 1, topk_group = 1;     // expert groups; groups kept per token
  float routed_scaling_factor = 1.0f;  // multiplies the routing weights
  int n_shared_experts = 0;            // shared MLP of n_shared * moe_intermediate_size, always on
  int first_k_dense_replace = 0;       // layers [0, k) dense
  int moe_layer_freq = 1;              // then layer l sparse when l % freq == 0
  // MLA attention (deepseek_v3): q_lora_rank 0 = no q compression (null in the config).
  int q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = true;

  bool is_moe() const { return num_experts > 0; }
  bool is_mla() const { return kv_lora_rank > 0; }
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }  // MLA q/k head width
  // The attention's softmax scale: 1/sqrt(head_dim), MLA 1/sqrt(qk_head_dim()).
  float softmax_scale() const;
  // Whether block `layer` has a mixture-of-experts MLP (HF's Qwen3MoeDecoderLayer rule).
  bool layer_is_moe(int layer) const;

  // inv_freq [head_dim / 2] exactly as HF computes it (FP32), llama3 scaling applied.
  RopeParams rope_params() const;
  // Throws a clear error naming the key for anything unsupported or inconsistent.
  void validate() const;
  int64_t num_parameters() const;
};

// Parses a config.json text / file (both transformers 4.x and 5.x spellings).
ModelConfig model_config_from_json(const std::string& json_text, const std::string& origin = "config.json");
ModelConfig model_config_load(const std::string& path);  // a file or a checkpoint directory
// Writes a config.json that transformers 4.x and 5.x both load.
std::string model_config_to_json(const ModelConfig& c);

}  // namespace fp8rl
