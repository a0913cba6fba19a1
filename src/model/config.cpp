// ModelConfig from a Hugging Face config.json (llama, qwen2, qwen3, qwen3_moe; transformers 4.x
// and 5.x spellings). See model/config.h.
//
// Defaults for absent optional keys follow transformers' config classes (e.g. qwen3's
// head_dim defaults to 128, not hidden_size / num_heads). Required keys (the sizes) have no
// default: a config without them is an error, as is any key of the wrong JSON type or any
// feature fp8rl does not implement (other rope types, sliding windows, o_proj/MLP biases).
#include "model/config.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_input.h"

namespace fp8rl {

using nlohmann::json;

constexpr size_t kMaxConfigJsonBytes = size_t(16) << 20;  // real config.json files are a few KB

namespace {

// Reads typed keys of one JSON object; every error names the key and the file.
struct Reader {
  const json& j;
  std::string origin;  // "path/config.json" or "path/config.json: rope_parameters"

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  [[noreturn]] void fail_type(const char* key, const char* want) const {
    FP8RL_FAIL(origin, ": key '", key, "' must be ", want, ", got ", json_brief(j.at(key)));
  }

  int get_int(const char* key) const {
    if (!has(key)) FP8RL_FAIL(origin, ": required key '", key, "' is missing");
    const json& v = j.at(key);
    if (!v.is_number_integer()) fail_type(key, "an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT32_MAX)) fail_type(key, "an integer that fits 32 bits");
    const int64_t x = v.get<int64_t>();
    if (x < INT32_MIN || x > INT32_MAX) fail_type(key, "an integer that fits 32 bits");
    return static_cast<int>(x);
  }
  int get_int(const char* key, int dflt) const { return has(key) ? get_int(key) : dflt; }

  double get_number(const char* key, double dflt) const {
    if (!has(key)) return dflt;
    const json& v = j.at(key);
    if (!v.is_number()) fail_type(key, "a number");
    return v.get<double>();
  }
  double get_number(const char* key) const {
    if (!has(key)) FP8RL_FAIL(origin, ": required key '", key, "' is missing");
    return get_number(key, 0.0);
  }

  bool get_bool(const char* key, bool dflt) const {
    if (!has(key)) return dflt;
    if (!j.at(key).is_boolean()) fail_type(key, "true or false");
    return j.at(key).get<bool>();
  }

  std::string get_string(const char* key, const std::string& dflt) const {
    if (!has(key)) return dflt;
    if (!j.at(key).is_string()) fail_type(key, "a string");
    return j.at(key).get<std::string>();
  }

  // A token id: absent/null -> -1, an integer, or a list of integers (all kept in `all`).
  int get_token_id(const char* key, std::vector<int>* all) const {
    if (!has(key)) return -1;
    const json& v = j.at(key);
    std::vector<int> ids;
    if (v.is_number_integer()) {
      ids.push_back(get_int(key));
    } else if (v.is_array()) {
      for (const json& e : v) {
        if (!e.is_number_integer() || (e.is_number_unsigned() && e.get<uint64_t>() > uint64_t(INT32_MAX)) ||
            e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)
          fail_type(key, "a token id or a list of token ids");
        ids.push_back(static_cast<int>(e.get<int64_t>()));
      }
    } else {
      fail_type(key, "a token id or a list of token ids");
    }
    if (all) *all = ids;
    return ids.empty() ? -1 : ids.front();
  }
};

// The RoPE settings, from rope_scaling (4.x; wins when present, as in transformers 5) or
// rope_parameters (5.x), with rope_theta at top level (4.x) or inside the dict (5.x).
void parse_rope(const json& j, const std::string& origin, ModelConfig& c) {
  Reader top{j, origin};
  c.rope_theta = static_cast<float>(top.get_number("rope_theta", 10000.0));
  if (top.has("partial_rotary_factor") && top.get_number("partial_rotary_factor") != 1.0)
    FP8RL_FAIL(origin, ": partial_rotary_factor != 1 is not supported");
  const char* dict_key = top.has("rope_scaling") ? "rope_scaling" : top.has("rope_parameters") ? "rope_parameters" : nullptr;
  if (!dict_key) return;
  const json& d = j.at(dict_key);
  if (!d.is_object()) top.fail_type(dict_key, "an object");
  Reader r{d, origin + ": " + dict_key};
  if (d.contains("full_attention") || d.contains("sliding_attention"))
    FP8RL_FAIL(r.origin, ": per-layer-type RoPE parameters are not supported");
  c.rope_theta = static_cast<float>(r.get_number("rope_theta", c.rope_theta));
  c.rope_type = r.has("rope_type") ? r.get_string("rope_type", "") : r.get_string("type", "default");
  if (r.has("partial_rotary_factor") && r.get_number("partial_rotary_factor") != 1.0)
    FP8RL_FAIL(r.origin, ": partial_rotary_factor != 1 is not supported");
  if (c.rope_type == "default") return;
  if (c.rope_type != "llama3")
    FP8RL_FAIL(r.origin, ": rope_type '", c.rope_type, "' is not supported (supported: default, llama3)");
  c.rope_factor = static_cast<float>(r.get_number("factor"));
  c.rope_low_freq_factor = static_cast<float>(r.get_number("low_freq_factor"));
  c.rope_high_freq_factor = static_cast<float>(r.get_number("high_freq_factor"));
  // transformers falls back to max_position_embeddings when this is absent.
  c.rope_original_max_position = r.get_int("original_max_position_embeddings", c.max_position_embeddings);
}

// The qwen3_moe keys (Qwen3MoeConfig defaults for the absent ones). transformers 5 stores the
// expert count as num_local_experts (num_experts is its alias), 4.x as num_experts.
void parse_moe(const json& j, const std::string& origin, ModelConfig& c) {
  Reader r{j, origin};
  if (r.has("num_experts") && r.has("num_local_experts") && r.get_int("num_experts") != r.get_int("num_local_experts"))
    FP8RL_FAIL(origin, ": num_experts (", r.get_int("num_experts"), ") and num_local_experts (",
               r.get_int("num_local_experts"), ") disagree");
  c.num_experts = r.has("num_local_experts") ? r.get_int("num_local_experts") : r.get_int("num_experts", 128);
  c.num_experts_per_tok = r.get_int("num_experts_per_tok", 8);
  c.moe_intermediate_size = r.get_int("moe_intermediate_size", 768);
  c.norm_topk_prob = r.get_bool("norm_topk_prob", false);
  c.decoder_sparse_step = r.get_int("decoder_sparse_step", 1);
  if (r.has("mlp_only_layers")) {
    const json& v = j.at("mlp_only_layers");
    if (!v.is_array()) r.fail_type("mlp_only_layers", "a list of layer indices");
    for (const json& e : v) {
      if (!e.is_number_integer()) r.fail_type("mlp_only_layers", "a list of layer indices");
      c.mlp_only_layers.push_back(static_cast<int>(e.get<int64_t>()));
    }
  }
  // Variants of other MoE families that a qwen3_moe config might carry: refuse, never ignore.
  for (const char* key : {"shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"})
    if (r.has(key) && r.get_number(key) != 0)
      FP8RL_FAIL(origin, ": '", key, "' (shared experts) is not part of qwen3_moe and is not supported");
  if (r.has("moe_layer_freq") || r.has("first_k_dense_replace"))
    FP8RL_FAIL(origin, ": moe_layer_freq / first_k_dense_replace are DeepSeek keys; qwen3_moe uses "
               "decoder_sparse_step and mlp_only_layers");
}

// deepseek_v3 (DeepSeek-V3, Moonlight): the MoE keys (DeepseekV3Config defaults for absent ones;
// 5.x may spell n_routed_experts num_local_experts) and the MLA sizes. Only the routing this
// code implements is accepted: topk_method noaux_tc with scoring_func sigmoid.
void parse_deepseek(const json& j, const std::string& origin, ModelConfig& c) {
  Reader r{j, origin};
  c.num_experts = r.has("num_local_experts") ? r.get_int("num_local_experts") : r.get_int("n_routed_experts", 256);
  c.num_experts_per_tok = r.get_int("num_experts_per_tok", 8);
  c.moe_intermediate_size = r.get_int("moe_intermediate_size", 2048);
  c.norm_topk_prob = r.get_bool("norm_topk_prob", true);
  c.moe_router = "sigmoid";
  c.n_group = r.get_int("n_group", 8);
  c.topk_group = r.get_int("topk_group", 4);
  c.routed_scaling_factor = static_cast<float>(r.get_number("routed_scaling_factor", 2.5));
  c.n_shared_experts = r.get_int("n_shared_experts", 1);
  c.first_k_dense_replace = r.get_int("first_k_dense_replace", 3);
  c.moe_layer_freq = r.get_int("moe_layer_freq", 1);
  const std::string method = r.get_string("topk_method", "noaux_tc"), scoring = r.get_string("scoring_func", "sigmoid");
  if (method != "noaux_tc" || scoring != "sigmoid")
    FP8RL_FAIL(origin, ": topk_method '", method, "' with scoring_func '", scoring, "' is not supported (only "
               "noaux_tc with sigmoid, DeepSeek-V3's)");
  c.q_lora_rank = r.get_int("q_lora_rank", 0);  // null: no q compression
  c.kv_lora_rank = r.get_int("kv_lora_rank", 512);
  c.qk_nope_head_dim = r.get_int("qk_nope_head_dim", 128);
  c.qk_rope_head_dim = r.get_int("qk_rope_head_dim", 64);
  c.v_head_dim = r.get_int("v_head_dim", 128);
  c.rope_interleave = r.get_bool("rope_interleave", true);
  // The rotary part of a head: RoPE's head_dim is qk_rope_head_dim.
  c.head_dim = c.qk_rope_head_dim;
  if (r.get_int("num_nextn_predict_layers", 0) > 0)
    std::fprintf(stderr, "%s: num_nextn_predict_layers (multi-token prediction) is ignored\n", origin.c_str());
}

// The shortest decimal that reads back as `x` (1e-6f is written 1e-06, not 9.99999997e-07).
double short_decimal(float x) {
  char buf[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, static_cast<double>(x));
    if (std::strtof(buf, nullptr) == x) break;
  }
  return std::strtod(buf, nullptr);
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

ModelConfig model_config_from_json(const std::string& json_text, const std::string& origin) {
  const json j = json_parse_limited(json_text, origin, {kMaxConfigJsonBytes, 32});
  if (!j.is_object()) FP8RL_FAIL(origin, ": must be a JSON object");
  Reader r{j, origin};
  ModelConfig c;
  if (!r.has("model_type")) FP8RL_FAIL(origin, ": required key 'model_type' is missing");
  c.model_type = r.get_string("model_type", "");
  const bool llama = c.model_type == "llama", qwen2 = c.model_type == "qwen2", qwen3 = c.model_type == "qwen3";
  const bool qwen3_moe = c.model_type == "qwen3_moe";
  const bool deepseek_v3 = c.model_type == "deepseek_v3";
  if (c.model_type == "deepseek_v2" || c.model_type == "qwen2_moe" ||
      c.model_type == "mixtral" || c.model_type == "qwen3_next" || c.model_type == "olmoe")
    FP8RL_FAIL(origin, ": model_type '", c.model_type, "' (a mixture-of-experts family) is not supported yet "
               "(supported: llama, qwen2, qwen3, qwen3_moe; deepseek_v3 with MLA)");
  if (!llama && !qwen2 && !qwen3 && !qwen3_moe && !deepseek_v3)
    FP8RL_FAIL(origin, ": model_type '", c.model_type, "' is not supported (supported: llama, qwen2, qwen3, qwen3_moe)");

  c.vocab_size = r.get_int("vocab_size");
  c.hidden_size = r.get_int("hidden_size");
  c.intermediate_size = r.get_int("intermediate_size");
  c.num_layers = r.get_int("num_hidden_layers");
  c.num_heads = r.get_int("num_attention_heads");
  c.num_kv_heads = r.get_int("num_key_value_heads", c.num_heads);
  if (c.num_heads <= 0) FP8RL_FAIL(origin, ": num_attention_heads must be positive, got ", c.num_heads);
  // Qwen3Config defaults head_dim to 128; Qwen3MoeConfig has no such default (the attention
  // then uses hidden_size / num_heads).
  c.head_dim = r.get_int("head_dim", qwen3 ? 128 : c.hidden_size / c.num_heads);
  c.rms_norm_eps = static_cast<float>(r.get_number("rms_norm_eps", 1e-6));
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  c.max_position_embeddings = r.get_int("max_position_embeddings", llama ? 2048 : 32768);
  c.bos_token_id = r.get_token_id("bos_token_id", nullptr);
  c.eos_token_id = r.get_token_id("eos_token_id", &c.eos_token_ids);
  // 5.x writes "dtype"; 4.x "torch_dtype".
  c.torch_dtype = r.has("dtype") ? r.get_string("dtype", "") : r.get_string("torch_dtype", "float32");

  // Biases: qwen2 always has q/k/v biases and no o_proj bias. In llama and qwen3
  // attention_bias adds biases to q, k, v *and* o_proj, which fp8rl does not implement.
  if (qwen2) {
    c.attention_bias = true;
  } else if (r.get_bool("attention_bias", false)) {
    FP8RL_FAIL(origin, ": attention_bias = true (", c.model_type, " then has an o_proj bias) is not supported");
  }
  if (r.get_bool("mlp_bias", false)) FP8RL_FAIL(origin, ": mlp_bias = true is not supported");
  c.qk_norm = qwen3 || qwen3_moe;
  if (qwen3_moe) parse_moe(j, origin, c);
  if (deepseek_v3) parse_deepseek(j, origin, c);
  const std::string act = r.get_string("hidden_act", "silu");
  if (act != "silu") FP8RL_FAIL(origin, ": hidden_act '", act, "' is not supported (only silu)");

  // Sliding-window attention (qwen2/qwen3): only the disabled form is accepted.
  if (r.get_bool("use_sliding_window", false))
    FP8RL_FAIL(origin, ": use_sliding_window = true is not supported (full attention only)");
  if (r.has("layer_types")) {
    const json& lt = j.at("layer_types");
    if (!lt.is_array()) r.fail_type("layer_types", "a list of strings");
    for (const json& t : lt) {
      if (!t.is_string()) r.fail_type("layer_types", "a list of strings");
      if (t.get<std::string>() != "full_attention")
        FP8RL_FAIL(origin, ": layer_types contains '", t.get<std::string>(), "'; only full_attention is supported");
    }
  }
  parse_rope(j, origin, c);
  try {
    c.validate();
  } catch (const Error& e) {
    FP8RL_FAIL(origin, ": ", e.what());
  }
  return c;
}

ModelConfig model_config_load(const std::string& path) {
  const std::string file = is_dir(path) ? path + "/config.json" : path;
  if (!std::ifstream(file, std::ios::binary).good())
    FP8RL_FAIL("cannot read model config ", file, " (is it an HF checkpoint directory?)");
  return model_config_from_json(read_file_limited(file, kMaxConfigJsonBytes, "config.json"), file);
}

void ModelConfig::validate() const {
  FP8RL_CHECK(model_type == "llama" || model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen3_moe" ||
                  model_type == "deepseek_v3",
              "model_type '", model_type, "' is not supported");
  FP8RL_CHECK(vocab_size > 0, "vocab_size must be positive");
  FP8RL_CHECK(hidden_size > 0, "hidden_size must be positive");
  FP8RL_CHECK(intermediate_size > 0, "intermediate_size must be positive");
  FP8RL_CHECK(num_layers > 0, "num_hidden_layers must be positive");
  FP8RL_CHECK(num_heads > 0, "num_attention_heads must be positive");
  FP8RL_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_key_value_heads (", num_kv_heads,
              ") must be positive and divide num_attention_heads (", num_heads, ")");
  FP8RL_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim (", head_dim, ") must be positive and even");
  FP8RL_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0, "rms_norm_eps must be positive");
  FP8RL_CHECK(max_position_embeddings > 0, "max_position_embeddings must be positive");
  // Upper bounds far above any real model (Llama 3.1 405B: hidden 16384, 126 layers; vocabularies
  // < 300k): a value past them is a broken config.json, refused before anything is sized by it.
  FP8RL_CHECK(vocab_size <= (1 << 24) && hidden_size <= (1 << 16) && intermediate_size <= (1 << 20) &&
                  num_layers <= 1024 && num_heads <= 1024 && head_dim <= 1024 && max_position_embeddings <= (1 << 28),
              "a dimension is beyond any supported model (vocab_size ", vocab_size, " <= 2^24, hidden_size ",
              hidden_size, " <= 65536, intermediate_size ", intermediate_size, " <= 2^20, num_hidden_layers ",
              num_layers, " <= 1024, num_attention_heads ", num_heads, " and head_dim ", head_dim,
              " <= 1024, max_position_embeddings ", max_position_embeddings, " <= 2^28)");
  FP8RL_CHECK(std::isfinite(rope_theta) && rope_theta > 1.0f, "rope_theta (", rope_theta, ") must be > 1");
  FP8RL_CHECK(rope_type == "default" || rope_type == "llama3", "rope_type '", rope_type,
              "' is not supported (default, llama3)");
  if (rope_type == "llama3") {
    FP8RL_CHECK(std::isfinite(rope_factor) && rope_factor > 0, "rope factor must be positive");
    FP8RL_CHECK(rope_low_freq_factor > 0 && rope_high_freq_factor > rope_low_freq_factor,
                "llama3 rope needs 0 < low_freq_factor < high_freq_factor, got ", rope_low_freq_factor, ", ",
                rope_high_freq_factor);
    FP8RL_CHECK(rope_original_max_position > 0, "original_max_position_embeddings must be positive");
  }
  FP8RL_CHECK(bos_token_id >= -1 && eos_token_id >= -1, "token ids must be >= 0 (or -1 for none)");
  const bool moe_type = model_type == "qwen3_moe" || model_type == "deepseek_v3";
  FP8RL_CHECK(moe_type == is_moe(), moe_type ? "num_experts (deepseek_v3: n_routed_experts) must be positive for " +
                                                   model_type
                                             : "num_experts is set but " + model_type + " is not a mixture of experts");
  FP8RL_CHECK((model_type == "deepseek_v3") == is_mla(), "MLA sizes (kv_lora_rank) belong to deepseek_v3 only");
  if (is_moe()) {
    FP8RL_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts, "num_experts_per_tok (",
                num_experts_per_tok, ") must be in [1, num_experts = ", num_experts, "]");
    FP8RL_CHECK(moe_intermediate_size > 0, "moe_intermediate_size must be positive");
    FP8RL_CHECK(decoder_sparse_step >= 1, "decoder_sparse_step (", decoder_sparse_step, ") must be >= 1");
    for (int l : mlp_only_layers)
      FP8RL_CHECK(l >= 0 && l < num_layers, "mlp_only_layers lists layer ", l, ", outside [0, num_hidden_layers = ",
                  num_layers, ")");
    FP8RL_CHECK(moe_router == "softmax" || moe_router == "sigmoid", "moe router '", moe_router, "' is unknown");
    FP8RL_CHECK(n_group >= 1 && num_experts % n_group == 0, "n_group (", n_group, ") must divide the ", num_experts,
                " routed experts");
    FP8RL_CHECK(topk_group >= 1 && topk_group <= n_group, "topk_group (", topk_group, ") must be in [1, n_group = ",
                n_group, "]");
    FP8RL_CHECK(num_experts_per_tok <= topk_group * (num_experts / n_group), "num_experts_per_tok (",
                num_experts_per_tok, ") exceeds the experts of the topk_group kept groups");
    FP8RL_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0,
                "routed_scaling_factor must be positive");
    FP8RL_CHECK(n_shared_experts >= 0 && first_k_dense_replace >= 0 && moe_layer_freq >= 1,
                "n_shared_experts and first_k_dense_replace must be >= 0, moe_layer_freq >= 1");
  }
  if (is_mla())
    FP8RL_CHECK(qk_nope_head_dim > 0 && qk_rope_head_dim > 0 && qk_rope_head_dim % 2 == 0 && v_head_dim > 0 &&
                    q_lora_rank >= 0,
                "MLA sizes must be positive (qk_rope_head_dim even; q_lora_rank 0 = none)");
}

bool ModelConfig::layer_is_moe(int layer) const {
  if (!is_moe()) return false;
  if (model_type == "deepseek_v3") return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  for (int l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

// inv_freq[i] = 1 / theta^(2i / hd), in FP32 as transformers computes it: the exponent
// (2i) / hd is an FP32 division, the power is rounded to FP32, and so is the reciprocal.
// llama3 then rescales per wavelength (all operands FP32, Python scalars rounded to FP32):
//   wavelen = 2*pi / f;  wavelen < orig/high: f;  wavelen > orig/low: f / factor;
//   otherwise s = (orig / wavelen - low) / (high - low), f' = (1 - s) * f / factor + s * f.
// torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar; so do we (it changes
// wavelen by an ulp). One known difference remains: torch's FP32 pow is SLEEF's (<= 1 ulp,
// not correctly rounded, and for tails scalar libm), ours is correctly rounded, so a few
// inv_freq values differ from transformers' by 1 ulp (measured with torch 2.15 on x86: 14 of
// 1344 values over 40 theta/head_dim/rope_type combinations; the fixtures record HF's values).
float ModelConfig::softmax_scale() const {
  // MLA: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (yarn's mscale factor would multiply it;
  // yarn rope scaling is refused by the config parser).
  const int d = is_mla() ? qk_head_dim() : head_dim;
  return 1.0f / std::sqrt(static_cast<float>(d));
}

RopeParams ModelConfig::rope_params() const {
  validate();
  RopeParams p;
  p.interleaved = is_mla() && rope_interleave;  // DeepSeek's rope_interleave (pairs 2i, 2i + 1)
  const int half = head_dim / 2;
  p.inv_freq.resize(half);
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float pw = static_cast<float>(std::pow(static_cast<double>(rope_theta), static_cast<double>(e)));
    p.inv_freq[i] = 1.0f / pw;
  }
  if (rope_type == "llama3") {
    const double orig = rope_original_max_position;
    const float low_wavelen = static_cast<float>(orig / rope_low_freq_factor);
    const float high_wavelen = static_cast<float>(orig / rope_high_freq_factor);
    const float two_pi = static_cast<float>(2.0 * M_PI);
    const float origf = static_cast<float>(orig);
    const float range = static_cast<float>(static_cast<double>(rope_high_freq_factor) - rope_low_freq_factor);
    for (float& f : p.inv_freq) {
      const float wavelen = (1.0f / f) * two_pi;
      const float scaled = wavelen > low_wavelen ? f / rope_factor : f;
      const float s = ((1.0f / wavelen) * origf - rope_low_freq_factor) / range;
      const float smoothed = (1.0f - s) * scaled / rope_factor + s * scaled;
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      f = medium ? smoothed : scaled;
    }
  }
  p.attention_scaling = 1.0f;
  return p;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t d = hidden_size, f = intermediate_size, v = vocab_size, hd = head_dim;
  const int64_t q = int64_t(num_heads) * hd, kv = int64_t(num_kv_heads) * hd;
  int64_t layers = 0;
  for (int l = 0; l < num_layers; ++l) {
    int64_t layer = 2 * d;  // input and post-attention RMSNorm
    if (is_mla()) {          // q (or q_a, q_a_norm, q_b), kv_a_proj_with_mqa, kv_a_layernorm, kv_b, o
      const int64_t H = num_heads, qk = qk_nope_head_dim + qk_rope_head_dim, r = q_lora_rank;
      layer += r > 0 ? d * r + r + r * H * qk : d * H * qk;
      layer += d * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank + int64_t(kv_lora_rank) * H * (qk_nope_head_dim + v_head_dim);
      layer += H * v_head_dim * d;
    } else {
      layer += d * q + 2 * d * kv + q * d;  // q, k, v, o
    }
    if (layer_is_moe(l)) {
      layer += int64_t(num_experts) * (d + 3 * d * moe_intermediate_size);  // router, experts
      layer += 3 * d * int64_t(n_shared_experts) * moe_intermediate_size;    // shared experts
      if (moe_router == "sigmoid") layer += num_experts;                      // e_score_correction_bias
    } else {
      layer += 3 * d * f;  // gate, up, down
    }
    if (attention_bias) layer += q + 2 * kv;
    if (qk_norm) layer += 2 * hd;
    layers += layer;
  }
  return v * d + layers + d + (tie_word_embeddings ? 0 : v * d);
}

std::string model_config_to_json(const ModelConfig& c) {
  c.validate();
  const bool deepseek = c.model_type == "deepseek_v3";
  FP8RL_CHECK(deepseek || (c.moe_router == "softmax" && c.n_shared_experts == 0), "a qwen3_moe config.json cannot "
              "carry sigmoid routing or shared experts (DeepSeek features on a test model)");
  FP8RL_CHECK(!deepseek || (c.moe_router == "sigmoid" && c.mlp_only_layers.empty() && c.decoder_sparse_step == 1),
              "a deepseek_v3 config.json carries sigmoid routing and first_k_dense_replace / moe_layer_freq, not "
              "qwen3_moe's softmax routing, mlp_only_layers or decoder_sparse_step (a mixed test model)");
  const char* arch = c.model_type == "llama"         ? "LlamaForCausalLM"
                     : c.model_type == "qwen2"       ? "Qwen2ForCausalLM"
                     : c.model_type == "qwen3_moe"   ? "Qwen3MoeForCausalLM"
                     : deepseek                      ? "DeepseekV3ForCausalLM"
                                                     : "Qwen3ForCausalLM";
  json j;
  j["architectures"] = {arch};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = short_decimal(c.rms_norm_eps);
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["max_position_embeddings"] = c.max_position_embeddings;
  if (c.model_type != "qwen2") j["attention_bias"] = false;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() > 1) {
    j["eos_token_id"] = c.eos_token_ids;
  } else if (c.eos_token_id >= 0) {
    j["eos_token_id"] = c.eos_token_id;
  }
  // 4.x reads torch_dtype, rope_theta and rope_scaling; 5.x reads all three too (rope_scaling
  // and rope_theta are converted into its rope_parameters), so the 4.x spelling serves both.
  j["torch_dtype"] = c.torch_dtype;
  j["rope_theta"] = short_decimal(c.rope_theta);
  if (c.rope_type == "llama3") {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", short_decimal(c.rope_factor)},
                         {"low_freq_factor", short_decimal(c.rope_low_freq_factor)},
                         {"high_freq_factor", short_decimal(c.rope_high_freq_factor)},
                         {"original_max_position_embeddings", c.rope_original_max_position}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  if (c.model_type != "llama" && !deepseek) j["use_sliding_window"] = false;
  if (deepseek) {  // DeepseekV3Config's keys (4.x and 5.x read the same names; rope as above)
    j["n_routed_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["n_group"] = c.n_group;
    j["topk_group"] = c.topk_group;
    j["routed_scaling_factor"] = short_decimal(c.routed_scaling_factor);
    j["n_shared_experts"] = c.n_shared_experts;
    j["first_k_dense_replace"] = c.first_k_dense_replace;
    j["moe_layer_freq"] = c.moe_layer_freq;
    j["topk_method"] = "noaux_tc";
    j["scoring_func"] = "sigmoid";
    j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
    j["kv_lora_rank"] = c.kv_lora_rank;
    j["qk_nope_head_dim"] = c.qk_nope_head_dim;
    j["qk_rope_head_dim"] = c.qk_rope_head_dim;
    j["qk_head_dim"] = c.qk_head_dim();
    j["v_head_dim"] = c.v_head_dim;
    j["rope_interleave"] = c.rope_interleave;
  } else if (c.is_moe()) {  // both spellings: 4.x reads num_experts, 5.x num_local_experts
    j["num_experts"] = c.num_experts;
    j["num_local_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  return j.dump(2) + "\n";
}

}  // namespace fp8rl
