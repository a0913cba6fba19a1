// ModelWeights: HF names, random init, checkpoint load/save, device copies, gradients.
#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <unistd.h>

#include "core/error.h"
#include "core/rng.h"
#include "io/safetensors.h"

namespace fp8rl {

namespace {

// The linears of a block with their HF prefixes, in a fixed order (q, k, v, o, the MLA
// projections, gate, up, down); a block defines the ones its attention and MLP have.
struct LinearRef {
  const char* name;
  LinearWeight LayerWeights::*member;
};
constexpr LinearRef kLinears[] = {
    {"self_attn.q_proj", &LayerWeights::q}, {"self_attn.k_proj", &LayerWeights::k},
    {"self_attn.v_proj", &LayerWeights::v}, {"self_attn.o_proj", &LayerWeights::o},
    {"self_attn.q_a_proj", &LayerWeights::q_a}, {"self_attn.q_b_proj", &LayerWeights::q_b},  // MLA
    {"self_attn.kv_a_proj_with_mqa", &LayerWeights::kv_a}, {"self_attn.kv_b_proj", &LayerWeights::kv_b},
    {"mlp.gate_proj", &LayerWeights::gate}, {"mlp.up_proj", &LayerWeights::up},
    {"mlp.down_proj", &LayerWeights::down},
};

std::string layer_prefix(int i) { return "model.layers." + std::to_string(i) + "."; }

// fn(name relative to the layer prefix, linear) for every linear of block L that follows the
// block's precision: the 7 of kLinears (the dense MLP's undefined in an MoE layer), then every
// expert's gate, up, down. Not the router.
// An MoE layer's dense gate/up/down are its shared experts (DeepSeek: mlp.shared_experts.*).
std::string linear_name(const LayerWeights& L, const char* name) {
  const std::string n = name;
  if (L.is_moe() && n.rfind("mlp.", 0) == 0) return "mlp.shared_experts." + n.substr(4);
  return n;
}

template <class Layer, class Fn>
void for_each_block_linear(Layer& L, Fn fn) {
  for (const LinearRef& r : kLinears) fn(linear_name(L, r.name), L.*(r.member));
  for (size_t e = 0; e < L.experts.size(); ++e) {
    const std::string p = "mlp.experts." + std::to_string(e) + ".";
    fn(p + "gate_proj", L.experts[e].gate);
    fn(p + "up_proj", L.experts[e].up);
    fn(p + "down_proj", L.experts[e].down);
  }
}
bool linear_defined(const LinearWeight& w) { return w.w.defined() || w.wq.defined(); }

// Every parameter tensor slot with its HF name (defined or not). Tied lm_head excluded.
void visit_slots(ModelWeights& w, const std::function<void(const std::string&, Tensor&)>& fn) {
  fn("model.embed_tokens.weight", w.embed);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = layer_prefix(static_cast<int>(i));
    fn(p + "input_layernorm.weight", l.attn_norm);
    for (const LinearRef& r : kLinears) {
      LinearWeight& lin = l.*(r.member);
      fn(p + linear_name(l, r.name) + ".weight", lin.w);
      fn(p + linear_name(l, r.name) + ".bias", lin.bias);
    }
    fn(p + "self_attn.q_norm.weight", l.q_norm);
    fn(p + "self_attn.k_norm.weight", l.k_norm);
    fn(p + "self_attn.q_a_layernorm.weight", l.q_a_norm);
    fn(p + "self_attn.kv_a_layernorm.weight", l.kv_a_norm);
    fn(p + "post_attention_layernorm.weight", l.mlp_norm);
    fn(p + "mlp.gate.weight", l.router.w);
    fn(p + "mlp.gate.e_score_correction_bias", l.router_bias);
    for (size_t e = 0; e < l.experts.size(); ++e) {
      const std::string pe = p + "mlp.experts." + std::to_string(e) + ".";
      fn(pe + "gate_proj.weight", l.experts[e].gate.w);
      fn(pe + "up_proj.weight", l.experts[e].up.w);
      fn(pe + "down_proj.weight", l.experts[e].down.w);
    }
  }
  fn("model.norm.weight", w.final_norm);
  if (!w.config.tie_word_embeddings) fn("lm_head.weight", w.lm_head);
}

// splitmix64 (core/rng.h) + Box-Muller: a small, seeded, platform-independent normal generator.
class Normal {
 public:
  explicit Normal(uint64_t seed) : bits_(seed * kSplitMix64Gamma + 0x1234567ull) {}
  double next() {
    const double u1 = (static_cast<double>(bits_.next() >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(bits_.next() >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  SplitMix64 bits_;
};

Tensor random_tensor(const Shape& shape, DType dtype, Normal& rng, double mean, double std) {
  Tensor t = Tensor::empty(shape, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = mean + std * rng.next();
  return tensor_convert_host(t, dtype);
}

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::F64 || t == DType::E4M3;
}

}  // namespace

// ---- host conversion -------------------------------------------------------------------------

Tensor tensor_convert_host(const Tensor& t, DType dtype) {
  FP8RL_CHECK(t.device() == DeviceKind::CPU, "tensor_convert_host needs a CPU tensor, got ", t.str());
  FP8RL_CHECK(is_float(t.dtype()), "cannot convert ", t.str(), " to ", dtype_name(dtype), ": not a float tensor");
  FP8RL_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16 || dtype == DType::F64,
              "conversion target must be F32, BF16, F16 or F64, got ", dtype_name(dtype));
  if (t.dtype() == DType::F64 && dtype == DType::F64) {
    Tensor r = Tensor::empty(t.shape(), dtype);
    if (t.nbytes()) std::copy_n(t.data<double>(), t.numel(), r.data<double>());
    return r;
  }
  if (t.dtype() == DType::F64) {  // F64 -> narrower: round once, from the double
    Tensor r = Tensor::empty(t.shape(), dtype);
    const double* s = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float f = static_cast<float>(s[i]);
      if (dtype == DType::F32) r.data<float>()[i] = f;
      else if (dtype == DType::BF16) r.data<uint16_t>()[i] = bf16_from_float(f);
      else r.data<uint16_t>()[i] = f16_from_float(f);
    }
    return r;
  }
  // Every other source is exactly representable in F32 (and in F64).
  return from_float_vector(to_float_vector(t), t.shape(), dtype);
}

// ---- configs and random init -------------------------------------------------------------------

ModelConfig model_config_tiny(const std::string& family, int vocab_size, int hidden_size, int num_layers,
                              int num_heads, int num_kv_heads, int intermediate_size) {
  FP8RL_CHECK(family == "llama" || family == "qwen2" || family == "qwen3" || family == "qwen3_moe",
              "unknown model family '", family, "' (expected llama, qwen2, qwen3 or qwen3_moe)");
  FP8RL_CHECK(num_heads > 0 && hidden_size % num_heads == 0, "hidden_size ", hidden_size,
              " must be a multiple of num_heads ", num_heads);
  ModelConfig c;
  c.model_type = family;
  c.vocab_size = vocab_size;
  c.hidden_size = hidden_size;
  c.intermediate_size = intermediate_size > 0 ? intermediate_size : 3 * hidden_size;
  c.num_layers = num_layers;
  c.num_heads = num_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = hidden_size / num_heads;
  c.rms_norm_eps = 1e-6f;
  c.max_position_embeddings = 4096;
  c.torch_dtype = "float32";
  if (family == "llama") {
    // llama3 rope scaling with a short original context, so that all three frequency bands
    // (kept, interpolated, scaled) occur even with a tiny head_dim.
    c.rope_theta = 10000.0f;
    c.rope_type = "llama3";
    c.rope_factor = 8.0f;
    c.rope_low_freq_factor = 1.0f;
    c.rope_high_freq_factor = 4.0f;
    c.rope_original_max_position = 32;
  } else if (family == "qwen2") {
    c.rope_theta = 1000000.0f;
    c.attention_bias = true;
  } else if (family == "qwen3") {  // q/k-norm, tied embeddings, head_dim independent of hidden_size / heads
    c.rope_theta = 1000000.0f;
    c.qk_norm = true;
    c.tie_word_embeddings = true;
    c.head_dim = 2 * hidden_size / num_heads;
  } else {  // qwen3_moe: q/k-norm, 4 experts top-2 (renormalized), a dense first layer when L > 2
    c.rope_theta = 1000000.0f;
    c.qk_norm = true;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = hidden_size;
    c.norm_topk_prob = true;
    if (num_layers > 2) c.mlp_only_layers = {0};
  }
  c.validate();
  return c;
}

ModelWeights model_weights_random(const ModelConfig& c, const RandomInit& init, DType dtype) {
  c.validate();
  Normal rng(init.seed);
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  auto lin = [&](int64_t n, int64_t k, bool bias) {
    LinearWeight w;
    w.w = random_tensor({n, k}, dtype, rng, 0.0, init.std);
    if (bias) w.bias = random_tensor({n}, dtype, rng, 0.0, init.bias_std);
    return w;
  };
  auto norm = [&](int64_t n) { return random_tensor({n}, dtype, rng, 1.0, init.norm_jitter); };

  ModelWeights w;
  w.config = c;
  w.embed = random_tensor({V, D}, dtype, rng, 0.0, init.std);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights L;
    L.attn_norm = norm(D);
    if (c.is_mla()) {
      const int64_t qk = c.qk_head_dim(), kvr = c.kv_lora_rank, r = c.qk_rope_head_dim, qr = c.q_lora_rank;
      if (qr > 0) {
        L.q_a = lin(qr, D, c.attention_bias);
        L.q_a_norm = norm(qr);
        L.q_b = lin(Hq * qk, qr, false);
      } else {
        L.q = lin(Hq * qk, D, false);
      }
      L.kv_a = lin(kvr + r, D, c.attention_bias);
      L.kv_a_norm = norm(kvr);
      L.kv_b = lin(Hq * (c.qk_nope_head_dim + c.v_head_dim), kvr, false);
      L.o = lin(D, Hq * c.v_head_dim, c.attention_bias);
    } else {
      L.q = lin(Hq * hd, D, c.attention_bias);
      L.k = lin(Hkv * hd, D, c.attention_bias);
      L.v = lin(Hkv * hd, D, c.attention_bias);
      L.o = lin(D, Hq * hd, c.attention_bias && c.model_type != "qwen2");  // HF: qwen2 never has an o bias
    }
    if (c.qk_norm) {
      L.q_norm = norm(hd);
      L.k_norm = norm(hd);
    }
    L.mlp_norm = norm(D);
    if (c.layer_is_moe(l)) {
      const int64_t Fe = c.moe_intermediate_size;
      L.router = lin(c.num_experts, D, false);
      if (c.moe_router == "sigmoid") L.router_bias = random_tensor({c.num_experts}, dtype, rng, 0.0, init.std);
      L.experts.resize(c.num_experts);
      for (ExpertWeights& e : L.experts) {
        e.gate = lin(Fe, D, false);
        e.up = lin(Fe, D, false);
        e.down = lin(D, Fe, false);
      }
      if (c.n_shared_experts > 0) {  // always-on shared experts: one SwiGLU of n_shared * Fe
        const int64_t Fs = int64_t(c.n_shared_experts) * Fe;
        L.gate = lin(Fs, D, false);
        L.up = lin(Fs, D, false);
        L.down = lin(D, Fs, false);
      }
    } else {
      L.gate = lin(F, D, false);
      L.up = lin(F, D, false);
      L.down = lin(D, F, false);
    }
    w.layers.push_back(std::move(L));
  }
  w.final_norm = norm(D);
  w.lm_head = c.tie_word_embeddings ? w.embed : random_tensor({V, D}, dtype, rng, 0.0, init.std);
  return w;
}

// ---- checkpoints -------------------------------------------------------------------------------

namespace {
// A loaded weight with a NaN or Inf is refused at load, naming the tensor (not at the first
// sampling step that meets it).
void check_loaded_finite(const Tensor& t, const std::string& dir, const std::string& name) {
  int64_t bad = -1;
  const int64_t n = t.numel();
  if (t.dtype() == DType::F32) {
    const float* p = t.data<float>();
    for (int64_t i = 0; i < n && bad < 0; ++i) if (!std::isfinite(p[i])) bad = i;
  } else if (t.dtype() == DType::F64) {
    const double* p = t.data<double>();
    for (int64_t i = 0; i < n && bad < 0; ++i) if (!std::isfinite(p[i])) bad = i;
  } else if (t.dtype() == DType::BF16) {
    const uint16_t* p = t.data<uint16_t>();
    for (int64_t i = 0; i < n && bad < 0; ++i) if ((p[i] & 0x7f80u) == 0x7f80u) bad = i;
  } else if (t.dtype() == DType::F16) {
    const uint16_t* p = t.data<uint16_t>();
    for (int64_t i = 0; i < n && bad < 0; ++i) if ((p[i] & 0x7c00u) == 0x7c00u) bad = i;
  }
  if (bad >= 0)
    FP8RL_FAIL(dir, ": tensor '", name, "' holds a non-finite value (NaN or Inf) at element ", bad,
               "; the checkpoint is damaged or was saved from a diverged run");
}
}  // namespace

ModelWeights model_weights_load(const std::string& dir, DType dtype, bool keep_fp8) {
  FP8RL_CHECK(std::filesystem::is_directory(dir), "model directory '", dir, "' does not exist (expected a "
              "Hugging Face checkpoint: config.json + *.safetensors)");
  const ModelConfig c = model_config_load(dir);
  c.validate();
  const CheckpointReader ck = CheckpointReader::open(dir);
  std::set<std::string> used;

  auto load = [&](const std::string& name, const Shape& shape) {
    FP8RL_CHECK(ck.contains(name), dir, ": missing tensor '", name, "' (", c.model_type,
                " with this config.json needs it)");
    const SafetensorsEntry& e = ck.entry(name);
    FP8RL_CHECK(e.shape == shape, dir, ": tensor '", name, "' has shape ", shape_str(e.shape), ", expected ",
                shape_str(shape), " from config.json");
    FP8RL_CHECK(e.dtype != DType::E4M3, dir, ": '", name, "' is F8_E4M3 without a block scale; only the 7 "
                "linears of each block may be FP8 (with weight_scale_inv)");
    used.insert(name);
    Tensor t = tensor_convert_host(ck.get(name), dtype);
    check_loaded_finite(t, dir, name);
    return t;
  };
  auto load_linear = [&](const std::string& prefix, int64_t n, int64_t k) {
    LinearWeight lw;
    const std::string wn = prefix + ".weight";
    if (ck.is_quantized(wn)) {
      FP8RL_CHECK(ck.entry(wn).shape == Shape({n, k}), dir, ": tensor '", wn, "' has shape ",
                  shape_str(ck.entry(wn).shape), ", expected ", shape_str({n, k}));
      QuantTensor q = ck.get_quant(wn);
      lw.w = tensor_convert_host(dequantize(q), dtype);
      check_loaded_finite(lw.w, dir, wn);
      if (keep_fp8) lw.wq = q;
      used.insert(wn);
      used.insert(wn + "_scale_inv");
    } else {
      lw.w = load(wn, {n, k});
    }
    if (ck.contains(prefix + ".bias")) lw.bias = load(prefix + ".bias", {n});
    return lw;
  };

  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  // A mixture-of-experts MLP: the router mlp.gate.weight [E, D] and the experts, stored per
  // expert (mlp.experts.{e}.{gate,up,down}_proj.weight: the original checkpoints, transformers
  // 4) or fused (mlp.experts.gate_up_proj [E, 2 Fe, D], gate rows first, and
  // mlp.experts.down_proj [E, D, Fe]: transformers 5's in-memory layout, if a file has it).
  auto load_moe = [&](const std::string& p, LayerWeights& L) {
    const int64_t E = c.num_experts, Fe = c.moe_intermediate_size;
    L.router.w = load(p + "mlp.gate.weight", {E, D});
    FP8RL_CHECK(!ck.contains(p + "mlp.gate.bias") && !ck.contains(p + "mlp.e_score_correction_bias"), dir,
                ": layer ", p, " has a router bias / mlp.e_score_correction_bias, which ", c.model_type,
                " routers do not have");
    FP8RL_CHECK(!ck.contains(p + "mlp.shared_expert.gate_proj.weight"), dir, ": ", p,
                "mlp has a Qwen2-MoE style shared_expert, which ", c.model_type, " does not have (not supported)");
    if (c.moe_router == "sigmoid") {  // DeepSeek-V3: the score-correction bias and the shared experts
      L.router_bias = load(p + "mlp.gate.e_score_correction_bias", {E});
      if (c.n_shared_experts > 0) {
        const int64_t Fs = int64_t(c.n_shared_experts) * Fe;
        L.gate = load_linear(p + "mlp.shared_experts.gate_proj", Fs, D);
        L.up = load_linear(p + "mlp.shared_experts.up_proj", Fs, D);
        L.down = load_linear(p + "mlp.shared_experts.down_proj", D, Fs);
      }
    } else {
      FP8RL_CHECK(!ck.contains(p + "mlp.gate.e_score_correction_bias") &&
                      !ck.contains(p + "mlp.shared_experts.gate_proj.weight"),
                  dir, ": ", p, "mlp has an e_score_correction_bias / shared experts, which ", c.model_type,
                  " does not have (not supported)");
    }
    L.experts.resize(E);
    if (ck.contains(p + "mlp.experts.gate_up_proj")) {
      const Tensor gu = tensor_convert_host(load(p + "mlp.experts.gate_up_proj", {E, 2 * Fe, D}), DType::F64);
      const Tensor dn = tensor_convert_host(load(p + "mlp.experts.down_proj", {E, D, Fe}), DType::F64);
      auto rows = [&](const Tensor& t, int64_t first, int64_t n, int64_t cols) {
        Tensor r = Tensor::empty({n, cols}, DType::F64);
        std::copy_n(t.data<double>() + first * cols, n * cols, r.data<double>());
        return tensor_convert_host(r, dtype);
      };
      for (int64_t e = 0; e < E; ++e) {
        L.experts[e].gate.w = rows(gu, e * 2 * Fe, Fe, D);
        L.experts[e].up.w = rows(gu, e * 2 * Fe + Fe, Fe, D);
        L.experts[e].down.w = rows(dn, e * D, D, Fe);
      }
      return;
    }
    for (int64_t e = 0; e < E; ++e) {
      const std::string pe = p + "mlp.experts." + std::to_string(e) + ".";
      L.experts[e].gate = load_linear(pe + "gate_proj", Fe, D);
      L.experts[e].up = load_linear(pe + "up_proj", Fe, D);
      L.experts[e].down = load_linear(pe + "down_proj", D, Fe);
    }
  };
  ModelWeights w;
  w.config = c;
  w.embed = load("model.embed_tokens.weight", {V, D});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    LayerWeights L;
    L.attn_norm = load(p + "input_layernorm.weight", {D});
    if (c.is_mla()) {  // DeepseekV3Attention's projections (weights.h, LayerWeights)
      const int64_t qk = c.qk_head_dim(), kvr = c.kv_lora_rank, r = c.qk_rope_head_dim, qr = c.q_lora_rank;
      if (qr > 0) {
        L.q_a = load_linear(p + "self_attn.q_a_proj", qr, D);
        L.q_a_norm = load(p + "self_attn.q_a_layernorm.weight", {qr});
        L.q_b = load_linear(p + "self_attn.q_b_proj", Hq * qk, qr);
      } else {
        L.q = load_linear(p + "self_attn.q_proj", Hq * qk, D);
      }
      L.kv_a = load_linear(p + "self_attn.kv_a_proj_with_mqa", kvr + r, D);
      L.kv_a_norm = load(p + "self_attn.kv_a_layernorm.weight", {kvr});
      L.kv_b = load_linear(p + "self_attn.kv_b_proj", Hq * (c.qk_nope_head_dim + c.v_head_dim), kvr);
      L.o = load_linear(p + "self_attn.o_proj", D, Hq * c.v_head_dim);
      FP8RL_CHECK(!L.q.bias.defined() && !L.q_b.bias.defined() && !L.kv_b.bias.defined(), dir, ": layer ", l,
                  " has a q_proj / q_b_proj / kv_b_proj bias, which DeepseekV3Attention never has");
    } else {
      L.q = load_linear(p + "self_attn.q_proj", Hq * hd, D);
      L.k = load_linear(p + "self_attn.k_proj", Hkv * hd, D);
      L.v = load_linear(p + "self_attn.v_proj", Hkv * hd, D);
      L.o = load_linear(p + "self_attn.o_proj", D, Hq * hd);
    }
    if (c.attention_bias && !c.is_mla())
      FP8RL_CHECK(L.q.bias.defined() && L.k.bias.defined() && L.v.bias.defined(), dir, ": layer ", l,
                  " lacks q/k/v_proj.bias although config.json implies attention biases");
    if (c.qk_norm) {
      L.q_norm = load(p + "self_attn.q_norm.weight", {hd});
      L.k_norm = load(p + "self_attn.k_norm.weight", {hd});
    }
    L.mlp_norm = load(p + "post_attention_layernorm.weight", {D});
    if (c.layer_is_moe(l)) {
      load_moe(p, L);
    } else {
      L.gate = load_linear(p + "mlp.gate_proj", F, D);
      L.up = load_linear(p + "mlp.up_proj", F, D);
      L.down = load_linear(p + "mlp.down_proj", D, F);
    }
    w.layers.push_back(std::move(L));
  }
  w.final_norm = load("model.norm.weight", {D});
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed;
    if (ck.contains("lm_head.weight")) used.insert("lm_head.weight");  // a stored copy of the tie
  } else {
    w.lm_head = load("lm_head.weight", {V, D});
  }

  // Anything left over would be silently ignored: refuse it (rotary inv_freq buffers excepted).
  for (const std::string& name : ck.tensor_names()) {
    if (used.count(name)) continue;
    if (name.size() >= 8 && name.compare(name.size() - 8, 8, "inv_freq") == 0) continue;
    FP8RL_FAIL(dir, ": unexpected tensor '", name, "' for a ", c.model_type, " model (", c.num_layers,
               " layers); fp8rl does not know what to do with it");
  }
  return w;
}

// ---- device copies and gradients ---------------------------------------------------------------

namespace {

// A copy of `w` where each defined float parameter tensor is replaced by make(tensor); wq (and
// wqt) replaced by make_quant(wq). Keeps the tie.
ModelWeights map_weights(const ModelWeights& w, const std::function<Tensor(const Tensor&)>& make,
                         const std::function<QuantTensor(const QuantTensor&)>& make_quant) {
  ModelWeights r = w;  // copies the structure (tensors still shared), then replaces each
  visit_slots(r, [&](const std::string&, Tensor& t) {
    if (t.defined()) t = make(t);
  });
  for (auto& L : r.layers)
    for_each_block_linear(L, [&](const std::string&, LinearWeight& lw) {
      if (lw.wq.defined()) lw.wq = make_quant(lw.wq);
      if (lw.wqt.defined()) lw.wqt = make_quant(lw.wqt);
    });
  r.lm_head = w.config.tie_word_embeddings ? r.embed : r.lm_head;
  return r;
}

}  // namespace

ModelWeights model_weights_to_device(Backend& be, const ModelWeights& w, DType dtype) {
  return map_weights(
      w,
      [&](const Tensor& t) {
        const Tensor h = t.device() == DeviceKind::CPU ? t : be.to_host(t);
        return be.to_device(h.dtype() == dtype ? h : tensor_convert_host(h, dtype));
      },
      [&](const QuantTensor& q) {
        QuantTensor d = q;
        d.data = be.to_device(q.data.device() == DeviceKind::CPU ? q.data : be.to_host(q.data));
        d.scales = be.to_device(q.scales.device() == DeviceKind::CPU ? q.scales : be.to_host(q.scales));
        return d;
      });
}

ModelWeights model_weights_to_host(Backend& be, const ModelWeights& w, DType dtype) {
  return map_weights(
      w,
      [&](const Tensor& t) {
        const Tensor h = t.device() == DeviceKind::CPU ? t : be.to_host(t);
        return tensor_convert_host(h, dtype);  // always a copy: the result owns its memory
      },
      [&](const QuantTensor& q) {
        QuantTensor h = q;
        h.data = q.data.device() == DeviceKind::CPU ? q.data : be.to_host(q.data);
        h.scales = q.scales.device() == DeviceKind::CPU ? q.scales : be.to_host(q.scales);
        return h;
      });
}

ModelWeights model_grads_alloc(Backend& be, const ModelWeights& w, DType dtype, Tensor* arena) {
  FP8RL_CHECK(dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16,
              "gradients (and optimizer moments) must be F32, BF16 or F64, got ", dtype_name(dtype));
  // With an arena: every tensor a view into one buffer (each starting on a 256-byte boundary),
  // so zeroing all of them is one fill of the arena. Pass 1 lays the views out, pass 2 makes them.
  constexpr int64_t kAlign = 256;
  const int64_t align_elems = kAlign / static_cast<int64_t>(dtype_size(dtype));
  int64_t total = 0;
  Tensor flat;
  auto make = [&](const Shape& shape) {
    const int64_t n = shape_numel(shape), at = total;
    total += (n + align_elems - 1) / align_elems * align_elems;
    if (!arena) {
      Tensor z = be.alloc(shape, dtype);
      be.fill(z, 0.0f);
      return z;
    }
    if (!flat.defined()) return Tensor{};  // pass 1: sizes only
    return Tensor(flat.storage(), flat.offset_bytes() + static_cast<size_t>(at) * dtype_size(dtype), shape, dtype);
  };
  ModelWeights g;
  for (int pass = arena ? 0 : 1; pass < 2; ++pass) {
    if (arena && pass == 1) {
      flat = be.alloc({std::max<int64_t>(total, 1)}, dtype);
      be.fill(flat, 0.0f);
      total = 0;
    }
    g = map_weights(w, [&](const Tensor& t) { return make(t.shape()); }, [](const QuantTensor&) { return QuantTensor{}; });
    // A linear held only as FP8 (no `w`) still needs a weight gradient of its logical shape.
    for (size_t i = 0; i < w.layers.size(); ++i) {
      std::vector<const LinearWeight*> src;
      for_each_block_linear(w.layers[i], [&](const std::string&, const LinearWeight& lw) { src.push_back(&lw); });
      size_t j = 0;
      for_each_block_linear(g.layers[i], [&](const std::string&, LinearWeight& lg) {
        const LinearWeight& lw = *src[j++];
        if (!lw.w.defined() && linear_defined(lw)) lg.w = make({lw.out_features(), lw.in_features()});
      });
    }
  }
  if (arena) *arena = flat;
  return g;
}

void model_grads_zero(Backend& be, ModelWeights& g, Tensor* arena) {
  if (arena && arena->defined()) {
    be.fill(*arena, 0.0f);  // the arena's views: every gradient at once
    return;
  }
  model_for_each_parameter(g, [&](const std::string&, Tensor& t) { be.fill(t, 0.0f); });
}

// ---- iteration ---------------------------------------------------------------------------------

void model_for_each_parameter(ModelWeights& w, const std::function<void(const std::string&, Tensor&)>& fn) {
  visit_slots(w, [&](const std::string& name, Tensor& t) {
    if (t.defined()) fn(name, t);
  });
}

void model_for_each_parameter(const ModelWeights& w,
                              const std::function<void(const std::string&, const Tensor&)>& fn) {
  // visit_slots only reads through the reference here; the tensors are not modified.
  visit_slots(const_cast<ModelWeights&>(w), [&](const std::string& name, Tensor& t) {
    if (t.defined()) fn(name, t);
  });
}

void model_for_each_linear(ModelWeights& w, const std::function<void(const std::string&, int, LinearWeight&)>& fn) {
  for (size_t i = 0; i < w.layers.size(); ++i)
    for_each_block_linear(w.layers[i], [&](const std::string& name, LinearWeight& lw) {
      if (linear_defined(lw)) fn(layer_prefix(static_cast<int>(i)) + name, static_cast<int>(i), lw);
    });
}

bool mla_projection_kept_bf16(const ModelConfig& c, int64_t out, int64_t in) {
  return c.is_mla() && (out % kQuantBlock != 0 || in % kQuantBlock != 0);
}

LinearMode model_linear_mode(const ModelConfig& c, const EnginePrecision& p, const std::string& name, int layer,
                             const LinearWeight& w) {
  const LinearMode mode = p.linear_for_layer(layer, c.num_layers);
  if (mode == LinearMode::FP8_BLOCK && name.find(".self_attn.") != std::string::npos &&
      mla_projection_kept_bf16(c, w.out_features(), w.in_features()))
    return LinearMode::BF16;
  return mode;
}

std::vector<std::string> model_bf16_kept_linears(const ModelWeights& w, const EnginePrecision& p) {
  std::vector<std::string> out;
  model_for_each_linear(const_cast<ModelWeights&>(w), [&](const std::string& name, int layer, LinearWeight& lw) {
    if (p.linear_for_layer(layer, w.config.num_layers) == LinearMode::FP8_BLOCK &&
        model_linear_mode(w.config, p, name, layer, lw) == LinearMode::BF16)
      out.push_back(name + " [" + std::to_string(lw.out_features()) + ", " + std::to_string(lw.in_features()) + "]");
  });
  return out;
}

int64_t model_count_parameters(const ModelWeights& w) {
  int64_t n = 0;
  model_for_each_parameter(w, [&](const std::string&, const Tensor& t) { n += t.numel(); });
  return n;
}

}  // namespace fp8rl
