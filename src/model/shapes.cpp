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

}  // namespace

std::vector<std::string> model_shape_names() {
  return {"qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3.2-1b", "llama-3.1-8b", "tiny"};
}

ModelConfig model_shape(const std::string& name) {
  ModelConfig c;
  if (name == "qwen3-0.6b") c = qwen3(1024, 3072, 28, 16, true);
  else if (name == "qwen3-1.7b") c = qwen3(2048, 6144, 28, 16, true);
  else if (name == "qwen3-8b") c = qwen3(4096, 12288, 36, 32, false);
  else if (name == "llama-3.2-1b" || name == "1b") c = llama(false);
  else if (name == "llama-3.1-8b" || name == "8b") c = llama(true);
  else if (name == "tiny") {
    c = model_config_tiny("llama", 512, 128, 2, 4, 2, 256);
    c.max_position_embeddings = 8192;
  } else {
    std::string known;
    for (const std::string& n : model_shape_names()) known += (known.empty() ? "" : ", ") + n;
    FP8RL_FAIL("unknown model shape '", name, "' (known: ", known, ")");
  }
  c.validate();
  return c;
}

}  // namespace fp8rl
