#include "model/shapes.h"

#include "core/error.h"
#include "model/weights.h"

namespace fp8rl {

namespace {

ModelConfig qwen3(int hidden, int ffn, int layers, int heads, bool tied) {
  ModelConfig c;
  c.model_type = "qwen3";
  c.vocab_size = 151936;
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.qk_norm = true;
  c.rms_norm_eps = 1e-6f;
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = 40960;
  c.rope_theta = 1000000.0f;
  c.bos_token_id = 151643;
  c.eos_token_id = 151645;
  c.eos_token_ids = {151645};
  c.torch_dtype = "bfloat16";
  return c;
}

ModelConfig llama(bool big) {
  ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = 128256;
  c.hidden_size = big ? 4096 : 2048;
  c.intermediate_size = big ? 14336 : 8192;
  c.num_layers = big ? 32 : 16;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = big ? 128 : 64;
  c.rms_norm_eps = 1e-5f;
  c.tie_word_embeddings = !big;
  c.max_position_embeddings = 131072;
  c.bos_token_id = 128000;
  c.eos_token_id = 128001;
  c.eos_token_ids = {128001};
  c.torch_dtype = "bfloat16";
  c.rope_theta = 500000.0f;
  c.rope_type = "llama3";
  c.rope_factor = big ? 8.0f : 32.0f;
  c.rope_low_freq_factor = 1.0f;
  c.rope_high_freq_factor = 4.0f;
  c.rope_original_max_position = 8192;
  return c;
}

// Qwen/Qwen3-30B-A3B's config.json (Qwen3MoeForCausalLM): 48 layers, all sparse (mlp_only_layers
// [], decoder_sparse_step 1), 128 experts top-8 of width 768, renormalized; intermediate_size 6144
// is in the config but unused (no dense layer); head_dim 128 explicit (32 x 128 = 4096 != hidden).
ModelConfig qwen3_30b_a3b() {
  ModelConfig c = qwen3(2048, 6144, 48, 32, /*tied=*/false);
  c.model_type = "qwen3_moe";
  c.num_kv_heads = 4;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 768;
  c.norm_topk_prob = true;
  return c;
}

// moonshotai/Moonlight-16B-A3B's config.json (DeepseekV3ForCausalLM, transformers 4.x spelling):
// MLA without q compression (q_lora_rank null), kv_lora_rank 512, qk_nope 128 + qk_rope 64,
// v_head_dim 128; layer 0 dense (first_k_dense_replace 1, intermediate_size 11264), layers 1-26
// 64 routed experts top-6 of width 1408 + 2 shared (one always-on MLP of 2 x 1408), n_group 1,
// topk_group 1, sigmoid scores with e_score_correction_bias (noaux_tc), norm_topk_prob true,
// routed_scaling_factor 2.446; vocab 163840, untied. Less certain (from a copy of the config.json,
// not the hub file itself): rms_norm_eps 1e-5, rope_theta 50000, max_position_embeddings 8192,
// bos 163584, eos 163586, rope_interleave absent (DeepseekV3Config's default, true). None of them
// changes a benchmark's FLOPs or bytes.
ModelConfig moonlight_16b_a3b() {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.vocab_size = 163840;
  c.hidden_size = 2048;
  c.intermediate_size = 11264;
  c.num_layers = 27;
  c.num_heads = 16;
  c.num_kv_heads = 16;
  c.rms_norm_eps = 1e-5f;
  c.tie_word_embeddings = false;
  c.max_position_embeddings = 8192;
  c.rope_theta = 50000.0f;
  c.bos_token_id = 163584;
  c.eos_token_id = 163586;
  c.eos_token_ids = {163586};
  c.torch_dtype = "bfloat16";
  c.num_experts = 64;
  c.num_experts_per_tok = 6;
  c.moe_intermediate_size = 1408;
  c.norm_topk_prob = true;
  c.moe_router = "sigmoid";
  c.n_group = 1;
  c.topk_group = 1;
  c.routed_scaling_factor = 2.446f;
  c.n_shared_experts = 2;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.q_lora_rank = 0;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.rope_interleave = true;
  c.head_dim = c.qk_rope_head_dim;  // RoPE's head_dim, as model_config_from_json sets it
  return c;
}

}  // namespace

std::vector<std::string> model_shape_names() {
  return {"qwen3-0.6b",     "qwen3-1.7b",        "qwen3-8b", "llama-3.2-1b", "llama-3.1-8b",
          "qwen3-30b-a3b",  "moonlight-16b-a3b", "tiny",     "tiny-moe",     "tiny-mla"};
}

ModelConfig model_shape(const std::string& name) {
  ModelConfig c;
  if (name == "qwen3-0.6b") c = qwen3(1024, 3072, 28, 16, true);
  else if (name == "qwen3-1.7b") c = qwen3(2048, 6144, 28, 16, true);
  else if (name == "qwen3-8b") c = qwen3(4096, 12288, 36, 32, false);
  else if (name == "llama-3.2-1b" || name == "1b") c = llama(false);
  else if (name == "llama-3.1-8b" || name == "8b") c = llama(true);
  else if (name == "qwen3-30b-a3b") c = qwen3_30b_a3b();
  else if (name == "moonlight-16b-a3b") c = moonlight_16b_a3b();
  else if (name == "tiny") {
    c = model_config_tiny("llama", 512, 128, 2, 4, 2, 256);
    c.max_position_embeddings = 8192;
  } else if (name == "tiny-moe") {
    // Qwen3-MoE in small: layer 0 dense, layers 1-2 sparse with 8 experts top-2 (renormalized);
    // every linear a whole number of 128x128 blocks, as on the real shapes.
    c = model_config_tiny("qwen3_moe", 512, 128, 3, 4, 2, 256);
    c.num_experts = 8;
    c.moe_intermediate_size = 128;
    c.max_position_embeddings = 8192;
  } else if (name == "tiny-mla") {
    // DeepSeek-V3 / Moonlight in small: MLA (no q compression, kv_lora_rank 128, qk 64 + 64,
    // v 64), layer 0 dense, layers 1-2 with 8 sigmoid-routed experts top-2 in 2 groups (1 kept)
    // + 1 shared expert. kv_a_proj_with_mqa is 128 + 64 = 192 rows: BF16, as Moonlight's 576.
    c = moonlight_16b_a3b();
    c.vocab_size = 512;
    c.hidden_size = 128;
    c.intermediate_size = 256;
    c.num_layers = 3;
    c.num_heads = c.num_kv_heads = 2;
    c.rms_norm_eps = 1e-6f;
    c.rope_theta = 10000.0f;
    c.bos_token_id = c.eos_token_id = -1;
    c.eos_token_ids.clear();
    c.torch_dtype = "float32";
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 128;
    c.n_group = 2;
    c.topk_group = 1;
    c.routed_scaling_factor = 2.5f;
    c.n_shared_experts = 1;
    c.kv_lora_rank = 128;
    c.qk_nope_head_dim = c.qk_rope_head_dim = c.v_head_dim = 64;
    c.head_dim = c.qk_rope_head_dim;
  } else {
    std::string known;
    for (const std::string& n : model_shape_names()) known += (known.empty() ? "" : ", ") + n;
    FP8RL_FAIL("unknown model shape '", name, "' (known: ", known, ")");
  }
  c.validate();
  return c;
}

ModelConfig model_shape_cut(ModelConfig c, int layers) {
  FP8RL_CHECK(layers >= 1, "--layers must be >= 1, got ", layers);
  FP8RL_CHECK(layers <= c.num_layers, "--layers ", layers, " exceeds the shape's ", c.num_layers, " layers");
  c.num_layers = layers;
  std::vector<int> kept;
  for (int l : c.mlp_only_layers)
    if (l < layers) kept.push_back(l);
  c.mlp_only_layers = kept;
  c.validate();
  return c;
}

}  // namespace fp8rl
