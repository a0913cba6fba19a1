// ModelConfig: llama (llama3 RoPE), qwen2 (biases), qwen3 (q/k norm, explicit head_dim) in
// transformers 4.x and 5.x spellings, inv_freq, and the error cases.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

namespace fp8rl {
namespace {

using nlohmann::json;

// Llama 3.1 8B shapes, 4.x spelling.
const char* kLlama4x = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "max_position_embeddings": 131072, "tie_word_embeddings": false,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "torch_dtype": "bfloat16", "transformers_version": "4.43.0"})";

// The same model as transformers 5.x writes it.
const char* kLlama5x = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "head_dim": 128, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
  "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
  "dtype": "bfloat16", "transformers_version": "5.0.0"})";

// Qwen2.5-0.5B shapes, 4.x spelling.
const char* kQwen2 = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
  "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true,
  "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
  "rope_theta": 1000000.0, "rope_scaling": null,
  "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 21,
  "torch_dtype": "bfloat16"})";

// Qwen3-0.6B shapes (head_dim 128 != 1024 / 16), 5.x spelling.
const char* kQwen3 = R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
  "head_dim": 128, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
  "tie_word_embeddings": true, "attention_bias": false, "hidden_act": "silu",
  "bos_token_id": 151643, "eos_token_id": 151645,
  "use_sliding_window": false, "sliding_window": null, "max_window_layers": 28,
  "layer_types": ["full_attention", "full_attention"],
  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
  "dtype": "bfloat16"})";

// Replaces (or with a null value, removes) one top-level key of a config text.
std::string edit(const char* text, const std::string& key, const json& value) {
  json j = json::parse(text);
  if (value.is_null()) {
    j.erase(key);
  } else {
    j[key] = value;
  }
  return j.dump();
}

// Expects an fp8rl::Error whose message mentions every one of `needles`.
void expect_error(const std::string& text, std::initializer_list<const char*> needles) {
  try {
    model_config_from_json(text, "models/x/config.json");
    ADD_FAILURE() << "no error for " << text;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("models/x/config.json"), std::string::npos) << msg;
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

TEST(ModelConfig, Llama4xAnd5xSpellingsAgree) {
  for (const char* text : {kLlama4x, kLlama5x}) {
    ModelConfig c = model_config_from_json(text);
    EXPECT_EQ(c.model_type, "llama");
    EXPECT_EQ(c.vocab_size, 128256);
    EXPECT_EQ(c.hidden_size, 4096);
    EXPECT_EQ(c.intermediate_size, 14336);
    EXPECT_EQ(c.num_layers, 32);
    EXPECT_EQ(c.num_heads, 32);
    EXPECT_EQ(c.num_kv_heads, 8);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_FALSE(c.attention_bias);
    EXPECT_FALSE(c.qk_norm);
    EXPECT_EQ(c.bos_token_id, 128000);
    EXPECT_EQ(c.eos_token_id, 128001);
    EXPECT_EQ(c.eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
    EXPECT_EQ(c.torch_dtype, "bfloat16");
    EXPECT_EQ(c.rope_theta, 500000.0f);
    EXPECT_EQ(c.rope_type, "llama3");
    EXPECT_EQ(c.rope_factor, 8.0f);
    EXPECT_EQ(c.rope_low_freq_factor, 1.0f);
    EXPECT_EQ(c.rope_high_freq_factor, 4.0f);
    EXPECT_EQ(c.rope_original_max_position, 8192);
  }
  // Llama 3.1 8B has 8.03 B parameters.
  EXPECT_EQ(model_config_from_json(kLlama4x).num_parameters(), 8030261248LL);
}

TEST(ModelConfig, Qwen2HasBiases) {
  ModelConfig c = model_config_from_json(kQwen2);
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.rope_type, "default");
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{151643}));
  // Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings).
  EXPECT_EQ(c.num_parameters(), 494032768LL);
}

TEST(ModelConfig, Qwen3HasQkNormAndExplicitHeadDim) {
  ModelConfig c = model_config_from_json(kQwen3);
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_NE(c.head_dim, c.hidden_size / c.num_heads);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  // Qwen3-0.6B: 596,049,920 parameters (tied embeddings).
  EXPECT_EQ(c.num_parameters(), 596049920LL);
  // qwen3 without head_dim: transformers' default is 128, not hidden / heads.
  EXPECT_EQ(model_config_from_json(edit(kQwen3, "head_dim", nullptr)).head_dim, 128);
  // 4.x spelling of the same.
  std::string t4 = edit(edit(kQwen3, "rope_parameters", nullptr).c_str(), "rope_theta", 1000000.0);
  t4 = edit(edit(t4.c_str(), "dtype", nullptr).c_str(), "torch_dtype", "float32");
  ModelConfig c4 = model_config_from_json(t4);
  EXPECT_EQ(c4.rope_theta, 1e6f);
  EXPECT_EQ(c4.torch_dtype, "float32");
}

TEST(ModelConfig, DefaultsForOptionalKeys) {
  json j = json::parse(kLlama4x);
  for (const char* k : {"num_key_value_heads", "rope_theta", "rope_scaling", "torch_dtype", "bos_token_id",
                        "eos_token_id", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"})
    j.erase(k);
  ModelConfig c = model_config_from_json(j.dump());
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.rope_type, "default");
  EXPECT_EQ(c.torch_dtype, "float32");
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, -1);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  // llama3 without original_max_position_embeddings falls back to max_position_embeddings.
  json k = json::parse(kLlama5x);
  k["rope_parameters"].erase("original_max_position_embeddings");
  EXPECT_EQ(model_config_from_json(k.dump()).rope_original_max_position, 131072);
  // 4.x's older "type" key.
  json o = json::parse(kLlama4x);
  o["rope_scaling"].erase("rope_type");
  o["rope_scaling"]["type"] = "llama3";
  EXPECT_EQ(model_config_from_json(o.dump()).rope_type, "llama3");
}

TEST(ModelConfig, DefaultInvFreq) {
  ModelConfig c = model_config_from_json(kQwen3);
  RopeParams p = c.rope_params();
  ASSERT_EQ(p.inv_freq.size(), 64u);
  EXPECT_EQ(p.attention_scaling, 1.0f);
  EXPECT_EQ(p.inv_freq[0], 1.0f);
  for (int i = 0; i < 64; ++i) {
    const double want = std::pow(1e6, -2.0 * i / 128.0);
    EXPECT_NEAR(p.inv_freq[i], want, want * 1e-6) << i;
  }
}

// llama3 scaling, checked piecewise against its definition in double precision.
TEST(ModelConfig, Llama3InvFreq) {
  ModelConfig c = model_config_from_json(kLlama5x);
  ModelConfig plain = c;
  plain.rope_type = "default";
  const std::vector<float> base = plain.rope_params().inv_freq, scaled = c.rope_params().inv_freq;
  ASSERT_EQ(scaled.size(), 64u);
  int high = 0, low = 0, medium = 0;
  for (int i = 0; i < 64; ++i) {
    const double f = base[i], wavelen = 2 * M_PI / f;
    double want;
    if (wavelen < 8192.0 / 4.0) {
      want = f, ++high;
    } else if (wavelen > 8192.0 / 1.0) {
      want = f / 8.0, ++low;
    } else {
      const double s = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1 - s) * f / 8.0 + s * f, ++medium;
    }
    EXPECT_NEAR(scaled[i], want, want * 1e-6) << i;
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
}

TEST(ModelConfig, UnsupportedAndMalformedAreErrors) {
  expect_error(edit(kLlama4x, "model_type", "mistral"), {"model_type", "mistral"});
  expect_error(edit(kLlama4x, "model_type", nullptr), {"model_type"});
  expect_error(edit(kLlama4x, "hidden_size", nullptr), {"hidden_size"});
  expect_error(edit(kLlama4x, "vocab_size", nullptr), {"vocab_size"});
  expect_error(edit(kLlama4x, "num_hidden_layers", nullptr), {"num_hidden_layers"});
  expect_error(edit(kLlama4x, "hidden_size", "4096"), {"hidden_size", "integer"});
  expect_error(edit(kLlama4x, "hidden_size", 4096.5), {"hidden_size", "integer"});
  expect_error(edit(kLlama4x, "rms_norm_eps", "small"), {"rms_norm_eps", "number"});
  expect_error(edit(kLlama4x, "tie_word_embeddings", 1), {"tie_word_embeddings"});
  expect_error(edit(kLlama4x, "torch_dtype", 16), {"torch_dtype"});
  expect_error(edit(kLlama4x, "eos_token_id", "x"), {"eos_token_id"});
  expect_error(edit(kLlama4x, "num_key_value_heads", 5), {"num_key_value_heads"});
  expect_error(edit(kLlama4x, "num_attention_heads", 0), {"num_attention_heads"});
  expect_error(edit(kLlama4x, "hidden_act", "gelu"), {"hidden_act"});
  expect_error(edit(kLlama4x, "attention_bias", true), {"attention_bias"});
  expect_error(edit(kLlama4x, "mlp_bias", true), {"mlp_bias"});
  expect_error(edit(kLlama4x, "rope_scaling", json{{"rope_type", "yarn"}, {"factor", 4.0}}), {"rope_scaling", "yarn"});
  expect_error(edit(kLlama4x, "rope_scaling", json{{"type", "dynamic"}, {"factor", 2.0}}), {"dynamic"});
  expect_error(edit(kLlama4x, "rope_scaling", json{{"type", "linear"}, {"factor", 2.0}}), {"linear"});
  expect_error(edit(kLlama4x, "rope_scaling", json{{"rope_type", "llama3"}, {"low_freq_factor", 1.0}}), {"factor"});
  expect_error(edit(kLlama4x, "rope_scaling", "llama3"), {"rope_scaling", "object"});
  expect_error(edit(kLlama4x, "rope_theta", "big"), {"rope_theta"});
  expect_error(edit(kLlama5x, "rope_parameters", json{{"rope_type", "yarn"}, {"rope_theta", 1e6}}),
               {"rope_parameters", "yarn"});
  expect_error(edit(kQwen3, "rope_parameters", json{{"full_attention", {{"rope_type", "default"}}}}),
               {"rope_parameters"});
  expect_error(edit(kQwen2, "use_sliding_window", true), {"use_sliding_window"});
  expect_error(edit(kQwen3, "layer_types", json{"full_attention", "sliding_attention"}), {"layer_types"});
  expect_error(edit(kQwen3, "head_dim", 127), {"head_dim"});
  expect_error(edit(kQwen3, "partial_rotary_factor", 0.5), {"partial_rotary_factor"});
  expect_error("{\"model_type\": ", {"JSON"});
  expect_error("[1, 2]", {"object"});
}

TEST(ModelConfig, LoadFromDirectoryAndRoundTripThroughJson) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_cfg_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* text : {kLlama4x, kQwen2, kQwen3}) {
    const ModelConfig c = model_config_from_json(text);
    std::ofstream(dir / "config.json") << model_config_to_json(c);
    const ModelConfig r = model_config_load(dir.string());
    EXPECT_EQ(r.model_type, c.model_type);
    EXPECT_EQ(r.head_dim, c.head_dim);
    EXPECT_EQ(r.num_kv_heads, c.num_kv_heads);
    EXPECT_EQ(r.attention_bias, c.attention_bias);
    EXPECT_EQ(r.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(r.eos_token_ids, c.eos_token_ids);
    EXPECT_EQ(r.rope_type, c.rope_type);
    EXPECT_EQ(r.rope_params().inv_freq, c.rope_params().inv_freq);
    EXPECT_EQ(r.num_parameters(), c.num_parameters());
  }
  EXPECT_THROW(model_config_load((dir / "missing").string()), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fp8rl
