// Mixture-of-experts (qwen3_moe): config parsing in transformers 4.x and 5.x spellings and its
// errors, the moe_* ops of the CPU backend (routing, its backward, permute / un-permute), the
// MoE block against simpler equivalent models, checkpoint round trips (per-expert and fused
// expert tensors), FP64 finite-difference gradients (router frozen and trained), FP8 experts,
// and generation through the paged forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "io/safetensors.h"
#include "test_model_util.h"

namespace fp8rl {
namespace {

using nlohmann::json;
using test::values_f64;

// Qwen3-30B-A3B's config.json (transformers 4.51 spelling).
const char* kQwen3Moe4x = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
  "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
  "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": true,
  "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
  "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936})";

// The same model as transformers 5 writes it (num_local_experts, rope_parameters, dtype).
std::string qwen3_moe_5x() {
  json j = json::parse(kQwen3Moe4x);
  j.erase("num_experts");
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j.erase("torch_dtype");
  j["num_local_experts"] = 128;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  j["dtype"] = "bfloat16";
  j["transformers_version"] = "5.17.0";
  return j.dump();
}

std::string edit(const std::string& text, const std::string& key, const json& value) {
  json j = json::parse(text);
  if (value.is_null()) j.erase(key);
  else j[key] = value;
  return j.dump();
}

void expect_error(const std::string& text, std::initializer_list<const char*> needles) {
  try {
    model_config_from_json(text, "m/config.json");
    ADD_FAILURE() << "no error for " << text;
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

TEST(MoeConfig, Qwen3MoeBothSpellings) {
  for (const std::string& text : {std::string(kQwen3Moe4x), qwen3_moe_5x()}) {
    const ModelConfig c = model_config_from_json(text);
    EXPECT_EQ(c.model_type, "qwen3_moe");
    EXPECT_TRUE(c.is_moe());
    EXPECT_TRUE(c.qk_norm);
    EXPECT_EQ(c.num_experts, 128);
    EXPECT_EQ(c.num_experts_per_tok, 8);
    EXPECT_EQ(c.moe_intermediate_size, 768);
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
    for (int l = 0; l < c.num_layers; ++l) EXPECT_TRUE(c.layer_is_moe(l)) << l;
    EXPECT_EQ(c.num_parameters(), 30532122624);  // Qwen3-30B-A3B's published total
  }
}

TEST(MoeConfig, DefaultsSparseStepAndMlpOnlyLayers) {
  // Absent keys: Qwen3MoeConfig's defaults; no head_dim key -> hidden / heads (HF's attention).
  json j = json::parse(kQwen3Moe4x);
  for (const char* k : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "decoder_sparse_step", "mlp_only_layers", "head_dim"})
    j.erase(k);
  ModelConfig c = model_config_from_json(j.dump());
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.head_dim, 2048 / 32);
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  c = model_config_from_json(j.dump());
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_TRUE(c.layer_is_moe(1));
  EXPECT_FALSE(c.layer_is_moe(2));
  EXPECT_FALSE(c.layer_is_moe(3));  // listed
  EXPECT_TRUE(c.layer_is_moe(5));
  // Dense layers count a dense MLP of intermediate_size.
  ModelConfig all = model_config_from_json(kQwen3Moe4x);
  EXPECT_LT(c.num_parameters(), all.num_parameters());
}

TEST(MoeConfig, UnsupportedVariantsAreClearErrors) {
  const std::string t = kQwen3Moe4x;
  expect_error(edit(t, "model_type", "qwen2_moe"), {"qwen2_moe", "mixture-of-experts", "not supported"});
  expect_error(edit(t, "model_type", "mixtral"), {"mixtral", "not supported"});
  expect_error(edit(t, "shared_expert_intermediate_size", 512), {"shared_expert_intermediate_size", "shared"});
  expect_error(edit(t, "n_shared_experts", 2), {"n_shared_experts"});
  expect_error(edit(t, "first_k_dense_replace", 1), {"first_k_dense_replace"});
  expect_error(edit(t, "num_experts_per_tok", 129), {"num_experts_per_tok"});
  expect_error(edit(t, "num_experts_per_tok", 0), {"num_experts_per_tok"});
  expect_error(edit(t, "num_experts", 0), {"num_experts"});
  expect_error(edit(t, "mlp_only_layers", json{48}), {"mlp_only_layers", "48"});
  expect_error(edit(t, "mlp_only_layers", 3), {"mlp_only_layers", "list"});
  expect_error(edit(t, "decoder_sparse_step", 0), {"decoder_sparse_step"});
  expect_error(edit(t, "num_local_experts", 64), {"num_experts", "num_local_experts", "disagree"});
  expect_error(edit(t, "moe_intermediate_size", -1), {"moe_intermediate_size"});
  expect_error(edit(t, "use_sliding_window", true), {"use_sliding_window"});
}

TEST(MoeConfig, RoundTripThroughJson) {
  json j = json::parse(kQwen3Moe4x);
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {0, 5};
  j["norm_topk_prob"] = false;
  const ModelConfig c = model_config_from_json(j.dump());
  const ModelConfig r = model_config_from_json(model_config_to_json(c));
  EXPECT_EQ(r.model_type, "qwen3_moe");
  EXPECT_EQ(r.num_experts, c.num_experts);
  EXPECT_EQ(r.num_experts_per_tok, c.num_experts_per_tok);
  EXPECT_EQ(r.moe_intermediate_size, c.moe_intermediate_size);
  EXPECT_EQ(r.norm_topk_prob, c.norm_topk_prob);
  EXPECT_EQ(r.decoder_sparse_step, c.decoder_sparse_step);
  EXPECT_EQ(r.mlp_only_layers, c.mlp_only_layers);
  EXPECT_EQ(r.num_parameters(), c.num_parameters());
  EXPECT_NE(model_config_to_json(c).find("Qwen3MoeForCausalLM"), std::string::npos);
}

// ---- ops --------------------------------------------------------------------------------------

Tensor host_f64(const std::vector<double>& v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::F64);
  std::copy(v.begin(), v.end(), t.data<double>());
  return t;
}
Tensor host_i32(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

TEST(MoeOps, RouteSoftmaxTopKAndTies) {
  auto be = make_cpu_backend();
  // Row 0: distinct logits; row 1: a tie between experts 1 and 3 (the lower id first).
  const std::vector<double> z = {0.1, 2.0, -1.0, 1.0, 0.5, 1.0, 0.0, 1.0};
  Tensor logits = host_f64(z, {2, 4}), experts = Tensor::empty({2, 2}, DType::I32);
  Tensor w = Tensor::zeros({2, 2}, DType::F64);
  for (bool renorm : {false, true}) {
    be->moe_route_softmax(logits, 2, renorm, experts, w);
    const int32_t* e = experts.data<int32_t>();
    EXPECT_EQ(e[0], 1);
    EXPECT_EQ(e[1], 3);
    EXPECT_EQ(e[2], 1);
    EXPECT_EQ(e[3], 3);
    double s0 = 0;
    for (int i = 0; i < 4; ++i) s0 += std::exp(z[i]);
    const double p1 = std::exp(2.0) / s0, p3 = std::exp(1.0) / s0;
    const double* wv = w.data<double>();
    EXPECT_NEAR(wv[0], renorm ? p1 / (p1 + p3) : p1, 1e-15);
    EXPECT_NEAR(wv[1], renorm ? p3 / (p1 + p3) : p3, 1e-15);
    if (renorm) {
      EXPECT_NEAR(wv[2] + wv[3], 1.0, 1e-15);
    }
  }
  Tensor bad = Tensor::empty({2, 5}, DType::I32);
  EXPECT_THROW(be->moe_route_softmax(logits, 5, true, bad, w), Error);
}

TEST(MoeOps, RouteSoftmaxBackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const int64_t T = 3, E = 5, k = 3;
  std::vector<double> z(T * E), c(T * k);
  for (int64_t i = 0; i < T * E; ++i) z[i] = std::sin(1.7 * i + 0.3) * 2.0;
  for (int64_t i = 0; i < T * k; ++i) c[i] = std::cos(0.9 * i + 0.1);
  for (bool renorm : {false, true}) {
    Tensor experts = Tensor::empty({T, k}, DType::I32), w = Tensor::zeros({T, k}, DType::F64);
    Tensor logits = host_f64(z, {T, E});
    be->moe_route_softmax(logits, k, renorm, experts, w);
    Tensor dz = Tensor::zeros({T, E}, DType::F64);
    be->moe_route_softmax_backward(logits, experts, renorm, host_f64(c, {T, k}), dz);
    auto loss = [&](const std::vector<double>& zz) {  // the same selection (no tie is crossed)
      Tensor ex2 = Tensor::empty({T, k}, DType::I32), w2 = Tensor::zeros({T, k}, DType::F64);
      be->moe_route_softmax(host_f64(zz, {T, E}), k, renorm, ex2, w2);
      double L = 0;
      for (int64_t i = 0; i < T * k; ++i) L += c[i] * w2.data<double>()[i];
      return L;
    };
    for (int64_t i = 0; i < T * E; ++i) {
      std::vector<double> zp = z, zm = z;
      zp[i] += 1e-6;
      zm[i] -= 1e-6;
      const double fd = (loss(zp) - loss(zm)) / 2e-6;
      EXPECT_NEAR(dz.data<double>()[i], fd, 1e-8) << "renorm " << renorm << " i " << i;
    }
  }
}

// permute and un-permute are each other's transposes: <unpermute(y), x> = <y, permute(x)>.
TEST(MoeOps, PermuteAndUnpermuteAreAdjoint) {
  auto be = make_cpu_backend();
  const int64_t T = 4, k = 2, D = 3, R = T * k;
  const std::vector<int32_t> row_slot = {5, 0, 3, 7, 1, 6, 2, 4};  // any permutation of the slots
  std::vector<int32_t> slot_row(R);
  for (int64_t r = 0; r < R; ++r) slot_row[row_slot[r]] = static_cast<int32_t>(r);
  std::vector<double> x(T * D), y(R * D), wv(R);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7 * i);
  for (size_t i = 0; i < y.size(); ++i) y[i] = std::cos(1.1 * i);
  for (size_t i = 0; i < wv.size(); ++i) wv[i] = 0.2 + 0.1 * i;
  const Tensor w = host_f64(wv, {R});
  Tensor px = Tensor::zeros({R, D}, DType::F64), uy = Tensor::zeros({T, D}, DType::F64);
  be->moe_permute(host_f64(x, {T, D}), host_i32(row_slot), k, &w, px);
  be->moe_unpermute(host_f64(y, {R, D}), host_i32(slot_row), &w, uy);
  double a = 0, b = 0;
  for (int64_t i = 0; i < T * D; ++i) a += uy.data<double>()[i] * x[i];
  for (int64_t i = 0; i < R * D; ++i) b += px.data<double>()[i] * y[i];
  EXPECT_NEAR(a, b, 1e-12);
  // Unweighted permute is a plain row gather.
  be->moe_permute(host_f64(x, {T, D}), host_i32(row_slot), k, nullptr, px);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(px.data<double>()[r * D + d], x[(row_slot[r] / k) * D + d]);
  // The weights' gradient of the un-permute.
  Tensor dw = Tensor::zeros({R}, DType::F64);
  be->moe_unpermute_backward_weights(host_f64(x, {T, D}), host_f64(y, {R, D}), host_i32(slot_row), dw);
  for (int64_t s = 0; s < R; ++s) {
    double want = 0;
    for (int64_t d = 0; d < D; ++d) want += x[(s / k) * D + d] * y[slot_row[s] * D + d];
    EXPECT_NEAR(dw.data<double>()[s], want, 1e-14);
  }
  Tensor bad = host_i32({0, 1, 2, 3, 4, 5, 6, 8});
  EXPECT_THROW(be->moe_unpermute(host_f64(y, {R, D}), bad, &w, uy), Error);
}

// ---- the block --------------------------------------------------------------------------------

ModelWeights tiny_moe(DType dtype, uint64_t seed, int layers = 3, int experts = 4, int top_k = 2,
                      bool norm_topk = true) {
  ModelConfig c = model_config_tiny("qwen3_moe", 48, /*hidden=*/64, layers, /*heads=*/4, /*kv_heads=*/2,
                                    /*intermediate=*/96);
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.moe_intermediate_size = 40;
  c.norm_topk_prob = norm_topk;
  c.validate();
  RandomInit init;
  init.seed = seed;
  init.std = 0.15f;
  init.norm_jitter = 0.2f;
  ModelWeights w = model_weights_random(c, init, dtype);
  return w;
}

std::vector<double> score(Backend& be, const ModelWeights& w, const ForwardBatch& b, LinearMode mode = LinearMode::FP32) {
  EnginePrecision p;
  p.linear = mode;
  return values_f64(be, model_forward_logprobs(be, w, p, b, ForwardOptions{}).logp);
}

TEST(MoeModel, TinyConfigShape) {
  const ModelWeights w = tiny_moe(DType::F32, 1);
  ASSERT_EQ(w.layers.size(), 3u);
  EXPECT_FALSE(w.layers[0].is_moe());  // mlp_only_layers = {0}
  EXPECT_TRUE(w.layers[0].gate.w.defined());
  for (int l : {1, 2}) {
    EXPECT_TRUE(w.layers[l].is_moe());
    EXPECT_FALSE(w.layers[l].gate.w.defined());
    EXPECT_EQ(w.layers[l].router.w.shape(), Shape({4, 64}));
    EXPECT_EQ(w.layers[l].experts[3].down.w.shape(), Shape({64, 40}));
  }
  EXPECT_EQ(model_count_parameters(w), w.config.num_parameters());
  int linears = 0;
  ModelWeights m = w;
  model_for_each_linear(m, [&](const std::string& name, int, LinearWeight&) {
    ++linears;
    EXPECT_EQ(name.find("mlp.gate."), std::string::npos) << "the router is not a block linear";
  });
  EXPECT_EQ(linears, 7 + 2 * (4 + 3 * 4));
}

// With k = E and no renormalization the MoE MLP is sum_e p_e expert_e(x); with identical
// experts and renormalized weights it is the dense MLP of the same weights, exactly.
TEST(MoeModel, IdenticalExpertsEqualTheDenseModel) {
  auto be = make_cpu_backend();
  ModelWeights moe = tiny_moe(DType::F64, 3, /*layers=*/2, /*experts=*/3, /*top_k=*/2, /*norm=*/true);
  ModelConfig dc = moe.config;
  dc.model_type = "qwen3";
  dc.num_experts = dc.num_experts_per_tok = dc.moe_intermediate_size = 0;
  dc.norm_topk_prob = false;
  dc.intermediate_size = moe.config.moe_intermediate_size;
  ModelWeights dense = moe;
  dense.config = dc;
  for (size_t l = 0; l < moe.layers.size(); ++l) {
    LayerWeights& L = moe.layers[l];
    ASSERT_TRUE(L.is_moe());
    L.experts.assign(3, L.experts[0]);
    LayerWeights& D = dense.layers[l];
    D.router = LinearWeight{};
    D.experts.clear();
    D.gate = L.experts[0].gate;
    D.up = L.experts[0].up;
    D.down = L.experts[0].down;
  }
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({7, 5}, 48, 2));
  const std::vector<double> a = score(*be, moe, b), d = score(*be, dense, b);
  for (size_t t = 0; t < a.size(); ++t) EXPECT_NEAR(a[t], d[t], 1e-12) << t;
}

// The MoE block against a per-token evaluation written here with plain loops (the routing
// from the HF definition), on the first block's MLP input.
TEST(MoeModel, BlockMatchesPerTokenLoop) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F64, 5, /*layers=*/2, /*experts=*/6, /*top_k=*/3, /*norm=*/false);
  ASSERT_TRUE(w.config.layer_is_moe(1));
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({9, 4}, 48, 8));
  Activations acts;
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  model_forward_logprobs(*be, w, p, b, ForwardOptions{}, &acts);
  const LayerActivations& a = acts.layers[1];
  const LayerWeights& L = w.layers[1];
  const int64_t T = b.num_tokens(), D = 64, E = 6, k = 3, Fe = 40;
  const std::vector<double> xn = values_f64(*be, a.xn_mlp), out = values_f64(*be, a.proj);
  const std::vector<double> wr = values_f64(*be, L.router.w);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> z(E), pe(E);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t d = 0; d < D; ++d) z[e] += wr[e * D + d] * xn[t * D + d];
    double m = *std::max_element(z.begin(), z.end()), s = 0;
    for (int64_t e = 0; e < E; ++e) s += (pe[e] = std::exp(z[e] - m));
    std::vector<int> idx(E);
    for (int e = 0; e < E; ++e) idx[e] = e;
    std::sort(idx.begin(), idx.end(), [&](int i, int j) { return pe[i] > pe[j]; });
    std::vector<double> y(D, 0.0);
    for (int j = 0; j < k; ++j) {
      const ExpertWeights& ex = L.experts[idx[j]];
      const std::vector<double> g = values_f64(*be, ex.gate.w), u = values_f64(*be, ex.up.w),
                                dn = values_f64(*be, ex.down.w);
      std::vector<double> h(Fe);
      for (int64_t f = 0; f < Fe; ++f) {
        double gv = 0, uv = 0;
        for (int64_t d = 0; d < D; ++d) gv += g[f * D + d] * xn[t * D + d], uv += u[f * D + d] * xn[t * D + d];
        h[f] = gv / (1 + std::exp(-gv)) * uv;
      }
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t f = 0; f < Fe; ++f) acc += dn[d * Fe + f] * h[f];
        y[d] += pe[idx[j]] / s * acc;
      }
    }
    for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(out[t * D + d], y[d], 1e-12) << t << "," << d;
  }
}

// ---- checkpoints ------------------------------------------------------------------------------

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const char* tag)
      : path(std::filesystem::temp_directory_path() / (std::string(tag) + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

TEST(MoeCheckpoint, SaveLoadRoundTripAndFusedExperts) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F32, 9);
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({8, 6}, 48, 4));
  const std::vector<double> want = score(*be, w, b);
  TempDir dir("fp8rl_moe_ckpt_");
  model_weights_save(w, dir.path.string());
  const ModelWeights r = model_weights_load(dir.path.string());
  EXPECT_EQ(r.config.num_experts, 4);
  EXPECT_EQ(r.config.mlp_only_layers, std::vector<int>{0});
  EXPECT_EQ(score(*be, r, b), want);

  // The fused layout (transformers 5 in memory): gate_up_proj [E, 2 Fe, D], down_proj [E, D, Fe].
  std::vector<std::pair<std::string, Tensor>> tensors;
  model_for_each_parameter(w, [&](const std::string& n, const Tensor& t) {
    if (n.find(".mlp.experts.") == std::string::npos) tensors.push_back({n, t});
  });
  const int64_t E = 4, Fe = 40, D = 64;
  for (int l : {1, 2}) {
    Tensor gu = Tensor::empty({E, 2 * Fe, D}, DType::F32), dn = Tensor::empty({E, D, Fe}, DType::F32);
    for (int64_t e = 0; e < E; ++e) {
      const ExpertWeights& ex = w.layers[l].experts[e];
      std::copy_n(ex.gate.w.data<float>(), Fe * D, gu.data<float>() + e * 2 * Fe * D);
      std::copy_n(ex.up.w.data<float>(), Fe * D, gu.data<float>() + e * 2 * Fe * D + Fe * D);
      std::copy_n(ex.down.w.data<float>(), D * Fe, dn.data<float>() + e * D * Fe);
    }
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
    tensors.push_back({p + "gate_up_proj", gu});
    tensors.push_back({p + "down_proj", dn});
  }
  safetensors_write((dir.path / "model.safetensors").string(), tensors, {{"format", "pt"}});
  EXPECT_EQ(score(*be, model_weights_load(dir.path.string()), b), want);

  // A missing expert tensor is named.
  tensors.pop_back();
  safetensors_write((dir.path / "model.safetensors").string(), tensors, {{"format", "pt"}});
  try {
    model_weights_load(dir.path.string());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.2.mlp.experts"), std::string::npos) << e.what();
  }
}

TEST(MoeCheckpoint, Fp8BlockSaveQuantizesExpertsNotTheRouter) {
  const ModelWeights w = tiny_moe(DType::F32, 10);
  TempDir dir("fp8rl_moe_fp8_");
  SaveOptions so;
  so.fp8_block = true;
  model_weights_save(w, dir.path.string(), so);
  const CheckpointReader ck = CheckpointReader::open(dir.path.string());
  EXPECT_TRUE(ck.is_quantized("model.layers.1.mlp.experts.2.up_proj.weight"));
  EXPECT_FALSE(ck.is_quantized("model.layers.1.mlp.gate.weight"));
  EXPECT_NE(ck.entry("model.layers.1.mlp.gate.weight").dtype, DType::E4M3);
  const ModelWeights r = model_weights_load(dir.path.string(), DType::F32, /*keep_fp8=*/true);
  EXPECT_TRUE(r.layers[1].experts[2].up.wq.defined());
  std::ifstream cf(dir.path / "config.json");
  const json cj = json::parse(cf);
  const auto kept = cj["quantization_config"]["modules_to_not_convert"].get<std::vector<std::string>>();
  EXPECT_NE(std::find(kept.begin(), kept.end(), "model.layers.1.mlp.gate"), kept.end()) << "routers are not FP8";
}

// ---- gradients --------------------------------------------------------------------------------

double loss(Backend& be, const ModelWeights& w, const ForwardBatch& batch, const std::vector<double>& c) {
  const std::vector<double> logp = score(be, w, batch);
  double L = 0.0;
  for (size_t t = 0; t < logp.size(); ++t) L += c[t] * logp[t];
  return L;
}

struct MoeGradCase {
  bool router_grad;
  bool deepseek;  // sigmoid grouped routing + bias + shared experts (DeepSeek-V3's MoE on qwen3 attention)
};
class MoeGradTest : public ::testing::TestWithParam<MoeGradCase> {};

// A tiny model with DeepSeek-V3's MoE block: 8 experts in 4 groups, 2 groups kept, top-3,
// routed_scaling_factor 2.5, e_score_correction_bias, one shared expert.
ModelWeights tiny_deepseek_moe(DType dtype, uint64_t seed) {
  ModelConfig c = model_config_tiny("qwen3_moe", 48, 64, 3, 4, 2, 96);
  c.num_experts = 8;
  c.num_experts_per_tok = 3;
  c.moe_intermediate_size = 24;
  c.moe_router = "sigmoid";
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.5f;
  c.n_shared_experts = 1;
  c.validate();
  RandomInit init;
  init.seed = seed;
  init.std = 0.15f;
  init.norm_jitter = 0.2f;
  return model_weights_random(c, init, dtype);
}

// Central differences in FP64 for every parameter tensor (the largest entry and 3 more each).
// The routing of each perturbed forward stays the same (h = 1e-5 crosses no top-k tie here),
// so the loss is smooth in every weight. router_grad off: the router's gradient is zero and
// every other gradient is still exact (the routing weights' path into the input is kept).
TEST_P(MoeGradTest, BackwardMatchesFiniteDifferencesFp64) {
  const bool router_grad = GetParam().router_grad, deepseek = GetParam().deepseek;
  auto be = make_cpu_backend();
  ModelWeights w = deepseek ? tiny_deepseek_moe(DType::F64, 22) : tiny_moe(DType::F64, 21);
  const ForwardBatch batch = forward_batch_from_sequences(test::token_sequences({6, 5}, 48, 3));
  const int64_t T = batch.num_tokens();
  std::vector<double> c(T);
  for (int64_t t = 0; t < T; ++t) c[t] = 0.5 + 0.37 * std::sin(1.3 * t + 0.2);
  EnginePrecision fp32;
  fp32.linear = LinearMode::FP32;
  Activations acts;
  model_forward_logprobs(*be, w, fp32, batch, ForwardOptions{}, &acts);
  ModelWeights g = model_grads_alloc(*be, w, DType::F64);
  BackwardOptions bo;
  bo.router_grad = router_grad;
  model_backward(*be, w, fp32, acts, be->to_device(host_f64(c, {T})), g, bo);

  std::vector<std::pair<std::string, Tensor>> grads;
  model_for_each_parameter(g, [&](const std::string& n, Tensor& t) { grads.push_back({n, t}); });
  size_t gi = 0;
  int checked = 0, routers = 0, biases = 0, unrouted = 0;
  double worst = 0;
  model_for_each_parameter(w, [&](const std::string& name, Tensor& p) {
    ASSERT_EQ(grads[gi].first, name);
    const std::vector<double> an = values_f64(*be, grads[gi++].second);
    const bool router = name.find(".mlp.gate.weight") != std::string::npos;
    double gmax = 0;
    size_t imax = 0;
    for (size_t i = 0; i < an.size(); ++i)
      if (std::fabs(an[i]) > gmax) gmax = std::fabs(an[i]), imax = i;
    if (name.find("e_score_correction_bias") != std::string::npos) {
      EXPECT_EQ(gmax, 0.0) << name << ": the correction bias only selects";
      ++biases;
      return;
    }
    if (router && !router_grad) {
      EXPECT_EQ(gmax, 0.0) << name << ": a frozen router has no gradient";
      ++routers;
      return;
    }
    double* data = p.data<double>();
    if (gmax == 0.0 && name.find(".mlp.experts.") != std::string::npos) {  // an expert no token chose
      const double orig = data[0];
      data[0] = orig + 1e-3;
      const double lp = loss(*be, w, batch, c);
      data[0] = orig;
      EXPECT_EQ(lp, loss(*be, w, batch, c)) << name << ": an unrouted expert must not affect the loss";
      ++unrouted;
      return;
    }
    ASSERT_GT(gmax, 0.0) << name << ": gradient is identically zero";
    for (size_t i : {imax, an.size() / 3, (2 * an.size()) / 3 + 1, an.size() - 1}) {
      i = std::min(i, an.size() - 1);
      const double orig = data[i], h = 1e-5 * std::max(1.0, std::fabs(orig));
      data[i] = orig + h;
      const double lp = loss(*be, w, batch, c);
      data[i] = orig - h;
      const double lm = loss(*be, w, batch, c);
      data[i] = orig;
      const double fd = (lp - lm) / (2 * h);
      const double rel = std::fabs(fd - an[i]) / std::max({std::fabs(fd), std::fabs(an[i]), 1e-3 * gmax});
      EXPECT_LT(rel, 1e-5) << name << "[" << i << "]: finite difference " << fd << ", backward " << an[i];
      worst = std::max(worst, rel);
      ++checked;
    }
    if (router) ++routers;
  });
  EXPECT_EQ(routers, 2);
  EXPECT_EQ(biases, deepseek ? 2 : 0);
  // embed, lm_head, final norm; layer 0 (dense): 7 linears + 4 norms; layers 1-2: 4 linears +
  // 4 norms + E experts * 3 (+ the router) (+ 3 shared-expert linears).
  const int E = w.config.num_experts;
  const int tensors = 3 + 11 + 2 * (8 + 3 * E + (router_grad ? 1 : 0) + (deepseek ? 3 : 0));
  EXPECT_EQ(checked, 4 * (tensors - unrouted));
  EXPECT_LE(unrouted, 3 * E / 2) << "most experts should get tokens";
  RecordProperty("worst_relative_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Router, MoeGradTest,
                         ::testing::Values(MoeGradCase{false, false}, MoeGradCase{true, false},
                                           MoeGradCase{false, true}, MoeGradCase{true, true}),
                         [](const auto& info) {
                           return std::string(info.param.deepseek ? "DeepSeekRouting" : "Softmax") +
                                  (info.param.router_grad ? "Trained" : "Frozen");
                         });

// FP8 experts (128x128-block linears like every linear; the router stays FP32): the router's
// logits are the FP32 product even in FP8_BLOCK; gradients track FP32 as the dense models' do
// (1 - cos within 2 * 16^2 of BF16's: E4M3 keeps 3 mantissa bits, BF16 7); scores stay within
// 4x of the dense qwen3 tiny model's FP8 error (routing flips of near-tied experts add to it).
TEST(MoeModel, Fp8ExpertsTrackFp32) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F32, 13);
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({9, 7}, 48, 6));
  const int64_t T = b.num_tokens();
  Tensor dl = Tensor::empty({T}, DType::F32);
  for (int64_t t = 0; t < T; ++t) dl.data<float>()[t] = 1.0f;
  auto grads_under = [&](LinearMode mode) {
    EnginePrecision p;
    p.linear = mode;
    Activations acts;
    model_forward_logprobs(*be, w, p, b, ForwardOptions{}, &acts);
    if (mode == LinearMode::FP8_BLOCK) {
      const LayerActivations& a = acts.layers[1];
      Tensor z = Tensor::zeros(a.router_logits.shape(), DType::F32);
      be->linear(a.router_x, w.layers[1].router, LinearSpec{LinearMode::FP32, false}, z);
      EXPECT_EQ(values_f64(*be, z), values_f64(*be, a.router_logits)) << "the router must stay FP32";
      Tensor ge = Tensor::zeros(a.moe_gate.shape(), DType::F32);
      const int64_t r1 = a.moe_offsets[1];
      if (r1 > 0) {
        Tensor g1 = ge.slice_rows(0, r1);
        be->linear(a.moe_x.slice_rows(0, r1), w.layers[1].experts[0].gate, LinearSpec{LinearMode::FP32, false}, g1);
        EXPECT_NE(values_f64(*be, g1), values_f64(*be, a.moe_gate.slice_rows(0, r1))) << "experts must be FP8";
      }
    }
    ModelWeights g = model_grads_alloc(*be, w);
    model_backward(*be, w, p, acts, dl, g);
    std::vector<double> all;
    model_for_each_parameter(g, [&](const std::string&, Tensor& t) {
      for (double v : values_f64(*be, t)) all.push_back(v);
    });
    return all;
  };
  const std::vector<double> ref = grads_under(LinearMode::FP32);
  auto one_minus_cos = [&](const std::vector<double>& x) {
    double dot = 0, na = 0, nb = 0;
    for (size_t i = 0; i < ref.size(); ++i) dot += ref[i] * x[i], na += ref[i] * ref[i], nb += x[i] * x[i];
    return 1.0 - dot / std::sqrt(na * nb);
  };
  const double e_bf16 = one_minus_cos(grads_under(LinearMode::BF16));
  const double e_fp8 = one_minus_cos(grads_under(LinearMode::FP8_BLOCK));
  EXPECT_GT(e_bf16, 0.0);
  EXPECT_GT(e_fp8, e_bf16);
  EXPECT_LT(e_fp8, 2 * 256 * e_bf16);
  auto mad = [&](const ModelWeights& m) {
    const std::vector<double> s32 = score(*be, m, b), s8 = score(*be, m, b, LinearMode::FP8_BLOCK);
    double e = 0;
    for (size_t t = 0; t < s32.size(); ++t) e += std::fabs(s32[t] - s8[t]) / s32.size();
    return e;
  };
  const double moe_mad = mad(w), dense_mad = mad(test::tiny_model("qwen3", DType::F32, 13));
  EXPECT_GT(moe_mad, 0.0);
  EXPECT_LT(moe_mad, 4 * dense_mad);
  RecordProperty("fp8_mean_abs_logprob_diff", std::to_string(moe_mad) + " (dense qwen3: " + std::to_string(dense_mad) + ")");
}

// FP8 experts: the SwiGLU backward's FP8 copies of dgate and dup feeding the grouped dgrads
// (BackwardOptions::fused_dy_fp8, the default) leave every gradient bitwise the unfused run's,
// whose grouped dgrads quantize dy themselves; pow2 scales too.
TEST(MoeModel, Fp8FusedExpertDyLeavesGradientsBitwise) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F32, 17);
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({9, 7}, 48, 6));
  const int64_t T = b.num_tokens();
  Tensor dl = Tensor::empty({T}, DType::F32);
  for (int64_t t = 0; t < T; ++t) dl.data<float>()[t] = 0.5f + 0.25f * static_cast<float>(t % 3);
  for (bool pow2 : {false, true}) {
    EnginePrecision p;
    p.linear = LinearMode::FP8_BLOCK;
    p.pow2_scales = pow2;
    auto grads = [&](bool fused) {
      Activations acts;
      model_forward_logprobs(*be, w, p, b, ForwardOptions{}, &acts);
      ModelWeights g = model_grads_alloc(*be, w);
      BackwardOptions bo;
      bo.fused_dy_fp8 = fused;
      model_backward(*be, w, p, acts, dl, g, bo);
      std::vector<std::pair<std::string, std::vector<double>>> all;
      model_for_each_parameter(g, [&](const std::string& n, Tensor& t) { all.emplace_back(n, values_f64(*be, t)); });
      return all;
    };
    const auto unfused = grads(false), fused = grads(true);
    ASSERT_EQ(unfused.size(), fused.size());
    double norm = 0;
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_EQ(unfused[i].second, fused[i].second) << unfused[i].first << (pow2 ? " pow2" : "");
      for (double v : fused[i].second) norm += v * v;
    }
    EXPECT_GT(norm, 0.0);
  }
}

// ---- generation -------------------------------------------------------------------------------

// The paged forward (prefill of a whole sequence) gives the scoring forward's log-probs.
TEST(MoeModel, PagedForwardMatchesScoring) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F32, 17);
  const std::vector<int32_t> ids = test::token_sequences({11}, 48, 9)[0];
  const int64_t T = static_cast<int64_t>(ids.size());
  const std::vector<double> want = score(*be, w, forward_batch_from_sequences({ids}));
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  KvCache cache = model_alloc_kv_cache(*be, w.config, 4, 16, DType::F32);
  PagedBatch pb;
  std::vector<int32_t> pos(T), slots(T), seq(T, 0), rows(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = slots[t] = rows[t] = static_cast<int32_t>(t);
  pb.token_seq = host_i32(seq);
  pb.token_pos = host_i32(pos);
  pb.slots = host_i32(slots);
  pb.page_table = Tensor::empty({1, 1}, DType::I32);
  pb.page_table.data<int32_t>()[0] = 0;
  pb.max_pos = static_cast<int>(T);
  Tensor logits = Tensor::zeros({T, 48}, DType::F32);
  model_forward_paged(*be, w, p, cache, host_i32(ids), pb, host_i32(rows), logits);
  for (int64_t t = 0; t + 1 < T; ++t) {
    const float* z = logits.data<float>() + t * 48;
    double m = *std::max_element(z, z + 48), s = 0;
    for (int v = 0; v < 48; ++v) s += std::exp(z[v] - m);
    EXPECT_NEAR(z[ids[t + 1]] - m - std::log(s), want[t], 2e-5) << t;
  }
}

}  // namespace
}  // namespace fp8rl

namespace fp8rl {
namespace {

// ---- fixtures -----------------------------------------------------------------------------------
// moe_reference_np.json: the numpy reference (scripts/fixtures/make_moe_fixtures_numpy.py);
// moe_reference.json: transformers' (scripts/fixtures/make_moe_fixtures.py, torch 2.15 +
// transformers 5.24 on the CPU: Qwen3MoeForCausalLM x 2 with fp32/fp8/fp8_pow2 references, and
// DeepseekV3ForCausalLM x 2, MLA, fp32 only: MoeDeepseekFixture below). Both committed; each
// is skipped, with a message, when absent.

struct MoeFixtureCase {
  const char* file;
  const char* reference;  // key in "logprobs"
  LinearMode mode;
  double max_mean_abs_diff;
};

class MoeFixtureTest : public ::testing::TestWithParam<MoeFixtureCase> {};

TEST_P(MoeFixtureTest, LogprobsMatchReference) {
  const MoeFixtureCase& fc = GetParam();
  const std::string dir = std::string(FP8RL_TEST_DATA) + "/fixtures";
  std::ifstream f(dir + "/" + fc.file);
  if (!f)
    GTEST_SKIP() << dir << "/" << fc.file << " is missing: generate it with "
                 << (std::string(fc.file) == "moe_reference.json"
                         ? "`python3 scripts/fixtures/make_moe_fixtures.py tests/data/fixtures` (torch + transformers 5, "
                           "on the GPU machine)"
                         : "`python3 scripts/fixtures/make_moe_fixtures_numpy.py tests/data/fixtures` (numpy)")
                 << " and commit it";
  const json ref = json::parse(f);
  auto be = make_cpu_backend();
  int models = 0;
  for (const auto& [name, m] : ref["models"].items()) {
    const auto seqs = m["sequences"].get<std::vector<std::vector<int32_t>>>();
    if (m.value("architecture", std::string("Qwen3MoeForCausalLM")) != "Qwen3MoeForCausalLM") continue;  // MLA: below
    if (!m["logprobs"].contains(fc.reference)) continue;
    const auto want = m["logprobs"][fc.reference].get<std::vector<std::vector<double>>>();
    const ModelWeights w = model_weights_load(dir + "/" + m["dir"].get<std::string>(), DType::F32);
    ASSERT_TRUE(w.config.is_moe()) << name;
    const ForwardBatch batch = forward_batch_from_sequences(seqs);
    const std::vector<double> got = score(*be, w, batch, fc.mode);
    double sum = 0, worst = 0;
    size_t n = 0;
    for (size_t s = 0; s < seqs.size(); ++s)
      for (size_t t = 0; t + 1 < seqs[s].size(); ++t) {
        const double d = std::fabs(got[batch.cu_seqlens[s] + t] - want[s][t]);
        sum += d, worst = std::max(worst, d), ++n;
      }
    EXPECT_LT(sum / n, fc.max_mean_abs_diff) << name << " " << fc.reference << ": worst " << worst;
    std::printf("  %s %-5s mean |diff| %.3e  worst %.3e  over %zu tokens\n", name.c_str(), fc.reference, sum / n,
                worst, n);
    ++models;
  }
  EXPECT_GT(models, 0) << fc.file << " has no model with '" << fc.reference << "' log-probs";
}

INSTANTIATE_TEST_SUITE_P(
    Qwen3Moe, MoeFixtureTest,
    ::testing::Values(MoeFixtureCase{"moe_reference_np.json", "fp32", LinearMode::FP32, 2e-4},
                      MoeFixtureCase{"moe_reference_np.json", "fp8", LinearMode::FP8_BLOCK, 1e-2},
                      MoeFixtureCase{"moe_reference.json", "fp32", LinearMode::FP32, 2e-4},    // measured <= 5.9e-7
                      MoeFixtureCase{"moe_reference.json", "fp8", LinearMode::FP8_BLOCK, 1e-3}),  // <= 3.3e-7
    [](const auto& info) {
      return std::string(std::string(info.param.file) == "moe_reference.json" ? "hf_" : "numpy_") +
             info.param.reference;
    });

// DeepSeek-V3 checkpoints made by transformers (MLA with and without q compression, grouped
// sigmoid routing with a non-zero e_score_correction_bias, shared experts, first_k_dense_replace).
// fp8rl parses their config as transformers does and scores them with its MLA attention
// (< 2e-4 mean |diff| against transformers' fp32 log-probs).
std::vector<std::pair<std::string, json>> deepseek_fixtures(std::string& dir) {
  dir = std::string(FP8RL_TEST_DATA) + "/fixtures";
  std::ifstream f(dir + "/moe_reference.json");
  std::vector<std::pair<std::string, json>> out;
  if (!f) return out;
  const json ref = json::parse(f);
  for (const auto& [name, m] : ref["models"].items())
    if (m.value("architecture", std::string()) == "DeepseekV3ForCausalLM") out.push_back({name, m});
  return out;
}

TEST(MoeDeepseekFixture, ConfigReadAsTransformersReadsIt) {
  std::string dir;
  const auto models = deepseek_fixtures(dir);
  if (models.empty()) GTEST_SKIP() << dir << "/moe_reference.json has no DeepSeek-V3 model";
  ASSERT_EQ(models.size(), 2u);
  for (const auto& [name, m] : models) {
    const json& hf = m["config"];
    const ModelConfig c = model_config_from_json(read_file(dir + "/" + m["dir"].get<std::string>() + "/config.json"));
    EXPECT_EQ(c.model_type, "deepseek_v3") << name;
    EXPECT_EQ(c.moe_router, "sigmoid") << name;
    EXPECT_EQ(c.num_experts, hf["n_routed_experts"].get<int>()) << name;
    EXPECT_EQ(c.num_experts_per_tok, hf["num_experts_per_tok"].get<int>()) << name;
    EXPECT_EQ(c.moe_intermediate_size, hf["moe_intermediate_size"].get<int>()) << name;
    EXPECT_EQ(c.n_group, hf["n_group"].get<int>()) << name;
    EXPECT_EQ(c.topk_group, hf["topk_group"].get<int>()) << name;
    EXPECT_EQ(c.n_shared_experts, hf["n_shared_experts"].get<int>()) << name;
    EXPECT_FLOAT_EQ(c.routed_scaling_factor, hf["routed_scaling_factor"].get<float>()) << name;
    EXPECT_EQ(c.norm_topk_prob, hf["norm_topk_prob"].get<bool>()) << name;
    EXPECT_EQ(c.q_lora_rank, hf["q_lora_rank"].is_null() ? 0 : hf["q_lora_rank"].get<int>()) << name;
    EXPECT_EQ(c.kv_lora_rank, hf["kv_lora_rank"].get<int>()) << name;
    EXPECT_EQ(c.qk_nope_head_dim, hf["qk_nope_head_dim"].get<int>()) << name;
    EXPECT_EQ(c.qk_rope_head_dim, hf["qk_rope_head_dim"].get<int>()) << name;
    EXPECT_EQ(c.v_head_dim, hf["v_head_dim"].get<int>()) << name;
    EXPECT_EQ(c.rope_interleave, hf["rope_interleave"].get<bool>()) << name;
    EXPECT_TRUE(c.is_mla()) << name;
    const int k = hf["first_k_dense_replace"].get<int>();
    for (int l = 0; l < c.num_layers; ++l) EXPECT_EQ(c.layer_is_moe(l), l >= k) << name << " layer " << l;
  }
}

TEST(MoeDeepseekFixture, LogprobsMatchTransformersFp32) {
  std::string dir;
  const auto models = deepseek_fixtures(dir);
  if (models.empty()) GTEST_SKIP() << dir << "/moe_reference.json has no DeepSeek-V3 model";
  auto be = make_cpu_backend();
  for (const auto& [name, m] : models) {
    const ModelWeights w = model_weights_load(dir + "/" + m["dir"].get<std::string>(), DType::F32);
    ASSERT_TRUE(w.config.is_mla()) << name;
    const auto seqs = m["sequences"].get<std::vector<std::vector<int32_t>>>();
    const auto want = m["logprobs"]["fp32"].get<std::vector<std::vector<double>>>();
    const ForwardBatch batch = forward_batch_from_sequences(seqs);
    const std::vector<double> got = score(*be, w, batch, LinearMode::FP32);
    double sum = 0, worst = 0;
    size_t n = 0;
    for (size_t s = 0; s < seqs.size(); ++s)
      for (size_t t = 0; t + 1 < seqs[s].size(); ++t) {
        const double d = std::fabs(got[batch.cu_seqlens[s] + t] - want[s][t]);
        sum += d, worst = std::max(worst, d), ++n;
      }
    EXPECT_LT(sum / n, 2e-4) << name << ": worst " << worst;
    std::printf("  %s fp32 mean |diff| %.3e  worst %.3e  over %zu tokens\n", name.c_str(), sum / n, worst, n);
  }
}

// Saving an MLA model: the transformers-made checkpoints loaded and saved again hold the same
// tensor names (transformers' DeepseekV3 names), a config.json read back as the same config,
// and score the same bit for bit (F32). The FP8 block format quantizes the linears that block
// (experts, shared experts) and keeps the MLA projections whose widths do not (all of them in
// these tiny models; kv_a_proj_with_mqa in Moonlight) BF16, listed as not converted.
TEST(MoeDeepseekFixture, SaveLoadRoundTripWithTransformersNames) {
  std::string dir;
  const auto models = deepseek_fixtures(dir);
  if (models.empty()) GTEST_SKIP() << dir << "/moe_reference.json has no DeepSeek-V3 model";
  auto be = make_cpu_backend();
  for (const auto& [name, m] : models) {
    const std::string src = dir + "/" + m["dir"].get<std::string>();
    const ModelWeights w = model_weights_load(src, DType::F32);
    const ForwardBatch b = forward_batch_from_sequences(m["sequences"].get<std::vector<std::vector<int32_t>>>());
    const std::vector<double> want = score(*be, w, b);
    TempDir out("fp8rl_mla_ckpt_");
    SaveOptions so;
    so.dtype = DType::F32;
    model_weights_save(w, out.path.string(), so);
    std::vector<std::string> a = SafetensorsFile::open(src + "/model.safetensors").tensor_names();
    std::vector<std::string> r = SafetensorsFile::open((out.path / "model.safetensors").string()).tensor_names();
    std::sort(a.begin(), a.end());
    std::sort(r.begin(), r.end());
    EXPECT_EQ(r, a) << name;
    const ModelWeights back = model_weights_load(out.path.string(), DType::F32);
    ModelConfig saved = w.config;
    saved.torch_dtype = "float32";  // the stored dtype
    EXPECT_EQ(model_config_to_json(back.config), model_config_to_json(saved)) << name;
    EXPECT_EQ(back.config.q_lora_rank, w.config.q_lora_rank) << name;
    EXPECT_EQ(back.config.rope_interleave, w.config.rope_interleave) << name;
    EXPECT_EQ(back.config.first_k_dense_replace, w.config.first_k_dense_replace) << name;
    EXPECT_EQ(score(*be, back, b), want) << name;
    std::ifstream cf(out.path / "config.json");
    const json cj = json::parse(cf);
    EXPECT_EQ(cj["architectures"][0], "DeepseekV3ForCausalLM") << name;
    for (const char* key : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                            "n_group", "topk_group", "n_shared_experts", "first_k_dense_replace", "q_lora_rank"})
      EXPECT_EQ(cj[key], m["config"][key]) << name << " " << key;

    TempDir fp8("fp8rl_mla_fp8_");
    SaveOptions fo;
    fo.fp8_block = true;
    model_weights_save(w, fp8.path.string(), fo);
    const CheckpointReader ck = CheckpointReader::open(fp8.path.string());
    EXPECT_TRUE(ck.is_quantized("model.layers.1.mlp.experts.0.up_proj.weight")) << name;
    EXPECT_FALSE(ck.is_quantized("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")) << name;
    std::ifstream ff(fp8.path / "config.json");
    const auto kept = json::parse(ff)["quantization_config"]["modules_to_not_convert"].get<std::vector<std::string>>();
    EXPECT_NE(std::find(kept.begin(), kept.end(), "model.layers.1.self_attn.kv_a_proj_with_mqa"), kept.end()) << name;
    const ModelWeights q = model_weights_load(fp8.path.string(), DType::F32);
    EXPECT_EQ(q.config.kv_lora_rank, w.config.kv_lora_rank) << name;
  }
}

}  // namespace
}  // namespace fp8rl

#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

// The rollout engine generates with a tiny MoE (paged prefill + decode through the same MoE
// block), its sampled logp is the trainer's score (FP32; and FP8 generator vs FP8 trainer), a
// trainer step moves the experts and keeps a frozen router as it was, and a refit carries the
// new weights to the generator.
TEST(MoeRollout, GenerateScoreStepRefit) {
  auto be = make_cpu_backend();
  for (LinearMode mode : {LinearMode::FP32, LinearMode::FP8_BLOCK}) {
    EnginePrecision prec;
    prec.linear = mode;
    prec.kv_cache = DType::F32;
    Trainer trainer(*be, model_weights_to_device(*be, tiny_moe(DType::F32, 41), DType::F32), prec, TrainerOptions{});
    RolloutEngine engine(*be, trainer.master(), prec, /*kv_pages=*/32, /*page_size=*/4, /*max_batch=*/8);
    const auto prompts = test::token_sequences({5, 3, 8}, 48, 23);
    const std::vector<RolloutRequest> reqs = {{prompts[0], 2}, {prompts[1], 2}, {prompts[2], 1}};
    SamplingParams sp;
    sp.temperature = 1.0f;
    sp.max_new_tokens = 6;
    sp.seed = 5;
    const std::vector<RolloutSample> out = engine.generate(reqs, sp);
    ASSERT_EQ(out.size(), 5u);
    std::vector<TrainSequence> seqs;
    std::vector<float> logp_gen;
    for (const RolloutSample& s : out) {
      TrainSequence t{reqs[s.request].prompt, static_cast<int>(reqs[s.request].prompt.size())};
      t.ids.insert(t.ids.end(), s.tokens.begin(), s.tokens.end());
      seqs.push_back(t);
      logp_gen.insert(logp_gen.end(), s.logp.begin(), s.logp.end());
    }
    const ScoreResult sr = trainer.score(seqs, 1.0f, false, false);
    ASSERT_EQ(sr.logp.size(), logp_gen.size());
    double max_diff = 0;
    for (size_t i = 0; i < logp_gen.size(); ++i)
      max_diff = std::max(max_diff, std::abs(static_cast<double>(sr.logp[i]) - logp_gen[i]));
    EXPECT_LE(max_diff, 1e-4) << "generator vs trainer, linear mode " << static_cast<int>(mode);

    // One step of "maximize the sampled log-probs": experts move, the frozen router does not.
    const std::vector<float> router_before = to_float_vector(be->to_host(trainer.master().layers[1].router.w));
    const std::vector<float> expert_before = to_float_vector(be->to_host(trainer.master().layers[1].experts[0].up.w));
    TokenLossFn loss = [](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
      double l = 0;
      for (size_t i = 0; i < lp.size(); ++i) l -= lp[i], grad[i] = -1.0f / lp.size();
      return l / lp.size();
    };
    const StepResult st = trainer.step(seqs, 1.0f, loss, 1e-2f);
    EXPECT_TRUE(st.applied);
    const ModelWeights& m = static_cast<const Trainer&>(trainer).master();
    EXPECT_EQ(to_float_vector(be->to_host(m.layers[1].router.w)), router_before);
    EXPECT_NE(to_float_vector(be->to_host(m.layers[1].experts[0].up.w)), expert_before);
    engine.refit(m, nullptr);
    const std::vector<RolloutSample> after = engine.generate(reqs, sp);
    EXPECT_EQ(after.size(), 5u);
  }
}

}  // namespace
}  // namespace fp8rl

namespace fp8rl {
namespace {

// ---- DeepSeek-V3 / Moonlight: config and routing ------------------------------------------------

// Moonlight-16B-A3B's config.json (transformers 4 spelling).
const char* kMoonlight = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
  "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
  "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
  "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446,
  "kv_lora_rank": 512, "q_lora_rank": null, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
  "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": true,
  "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": true, "hidden_act": "silu",
  "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "bos_token_id": 163584,
  "eos_token_id": 163585, "tie_word_embeddings": false, "rope_theta": 50000.0, "rope_scaling": null,
  "attention_bias": false, "attention_dropout": 0.0, "torch_dtype": "bfloat16"})";

TEST(MoeDeepseek, MoonlightConfigBothSpellings) {
  json j5 = json::parse(kMoonlight);
  j5.erase("n_routed_experts");
  j5.erase("rope_theta");
  j5.erase("rope_scaling");
  j5["num_local_experts"] = 64;
  j5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 50000.0}};
  for (const std::string& text : {std::string(kMoonlight), j5.dump()}) {
    const ModelConfig c = model_config_from_json(text);
    EXPECT_EQ(c.model_type, "deepseek_v3");
    EXPECT_EQ(c.num_experts, 64);
    EXPECT_EQ(c.num_experts_per_tok, 6);
    EXPECT_EQ(c.moe_router, "sigmoid");
    EXPECT_EQ(c.n_group, 1);
    EXPECT_EQ(c.topk_group, 1);
    EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.446f);
    EXPECT_EQ(c.n_shared_experts, 2);
    EXPECT_TRUE(c.is_mla());
    EXPECT_EQ(c.q_lora_rank, 0);
    EXPECT_EQ(c.kv_lora_rank, 512);
    EXPECT_EQ(c.head_dim, 64);  // RoPE runs on the qk_rope_head_dim part
    EXPECT_EQ(c.rope_params().inv_freq.size(), 32u);
    EXPECT_FALSE(c.layer_is_moe(0));  // first_k_dense_replace
    for (int l = 1; l < 27; ++l) EXPECT_TRUE(c.layer_is_moe(l)) << l;
    // "16B" total, counting MLA, 26 MoE layers of 64 + 2 shared experts and one dense layer.
    EXPECT_GT(c.num_parameters(), 15.5e9);
    EXPECT_LT(c.num_parameters(), 16.5e9);
  }
}

TEST(MoeDeepseek, UnsupportedVariantsAreClearErrorsAndMlaCachesTheLatent) {
  const std::string t = kMoonlight;
  expect_error(edit(t, "topk_method", "greedy"), {"topk_method", "greedy", "noaux_tc"});
  expect_error(edit(t, "scoring_func", "softmax"), {"scoring_func", "softmax"});
  expect_error(edit(t, "n_group", 3), {"n_group"});
  expect_error(edit(edit(t, "n_group", 8), "topk_group", 9), {"topk_group"});
  expect_error(edit(t, "rope_scaling", json{{"type", "yarn"}, {"factor", 40}}), {"yarn"});  // DeepSeek-V3's rope
  // Written back, the config reads as the same config (saving MLA models).
  EXPECT_EQ(model_config_to_json(model_config_from_json(model_config_to_json(model_config_from_json(t)))),
            model_config_to_json(model_config_from_json(t)));
  // MLA generation caches the latent: one row of 512 + 64 per token and layer, V = its first 512.
  const KvCache cache = model_alloc_kv_cache(*make_cpu_backend(), model_config_from_json(t), 4, 16, DType::BF16);
  EXPECT_EQ(cache.num_kv_heads, 1);
  EXPECT_EQ(cache.head_dim, 576);
  EXPECT_EQ(cache.latent_v_dim, 512);
}

// 8 experts in 4 groups {0,1} {2,3} {4,5} {6,7}; s = sigmoid(z) = .9 .1 .6 .6 .95 .05 .3 .3 and a
// bias of .5 on expert 6: c = .9 .1 .6 .6 .95 .05 .8 .3, group scores 1.0 1.2 1.0 1.1, the 2 kept
// groups are 1 and 3 (expert 4's .95 is dropped with its group), top-3 of the kept: 6 (.8), 2, 3
// (tie: lower id first); weights = uncorrected s .3 .6 .6, renormalized / 1.5, times 2.5.
TEST(MoeOps, RouteSigmoidGroupedTopK) {
  auto be = make_cpu_backend();
  const std::vector<double> s = {0.9, 0.1, 0.6, 0.6, 0.95, 0.05, 0.3, 0.3};
  std::vector<double> z;
  for (double v : s) z.push_back(std::log(v / (1 - v)));
  const Tensor logits = host_f64(z, {1, 8});
  const Tensor bias = host_f64({0, 0, 0, 0, 0, 0, 0.5, 0}, {8});
  Tensor experts = Tensor::empty({1, 3}, DType::I32), w = Tensor::zeros({1, 3}, DType::F64);
  be->moe_route_sigmoid(logits, &bias, 3, 4, 2, true, 2.5f, experts, w);
  EXPECT_EQ(experts.data<int32_t>()[0], 6);
  EXPECT_EQ(experts.data<int32_t>()[1], 2);
  EXPECT_EQ(experts.data<int32_t>()[2], 3);
  EXPECT_NEAR(w.data<double>()[0], 0.5, 1e-12);
  EXPECT_NEAR(w.data<double>()[1], 1.0, 1e-12);
  EXPECT_NEAR(w.data<double>()[2], 1.0, 1e-12);
  // One group, no bias, no renormalization: plain top-k of the sigmoid, weights s * scaling.
  be->moe_route_sigmoid(logits, nullptr, 3, 1, 1, false, 1.0f, experts, w);
  EXPECT_EQ(experts.data<int32_t>()[0], 4);
  EXPECT_EQ(experts.data<int32_t>()[1], 0);
  EXPECT_EQ(experts.data<int32_t>()[2], 2);
  EXPECT_NEAR(w.data<double>()[0], 0.95, 1e-12);
  EXPECT_THROW(be->moe_route_sigmoid(logits, nullptr, 3, 3, 1, true, 1.0f, experts, w), Error);  // 3 does not divide 8
  EXPECT_THROW(be->moe_route_sigmoid(logits, nullptr, 3, 4, 1, true, 1.0f, experts, w), Error);  // 3 > 1 group of 2
}

TEST(MoeOps, RouteSigmoidBackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const int64_t T = 3, E = 8, k = 3;
  std::vector<double> z(T * E), c(T * k), bv(E);
  for (int64_t i = 0; i < T * E; ++i) z[i] = std::sin(1.3 * i + 0.4) * 2.0;
  for (int64_t i = 0; i < T * k; ++i) c[i] = std::cos(0.7 * i + 0.2);
  for (int64_t e = 0; e < E; ++e) bv[e] = 0.1 * std::sin(e);
  const Tensor bias = host_f64(bv, {E});
  for (bool renorm : {false, true}) {
    Tensor experts = Tensor::empty({T, k}, DType::I32), w = Tensor::zeros({T, k}, DType::F64);
    be->moe_route_sigmoid(host_f64(z, {T, E}), &bias, k, 4, 2, renorm, 2.5f, experts, w);
    Tensor dz = Tensor::zeros({T, E}, DType::F64);
    be->moe_route_sigmoid_backward(host_f64(z, {T, E}), experts, renorm, 2.5f, host_f64(c, {T, k}), dz);
    auto loss = [&](const std::vector<double>& zz) {
      Tensor e2 = Tensor::empty({T, k}, DType::I32), w2 = Tensor::zeros({T, k}, DType::F64);
      be->moe_route_sigmoid(host_f64(zz, {T, E}), &bias, k, 4, 2, renorm, 2.5f, e2, w2);
      double L = 0;
      for (int64_t i = 0; i < T * k; ++i) L += c[i] * w2.data<double>()[i];
      return L;
    };
    for (int64_t i = 0; i < T * E; ++i) {
      std::vector<double> zp = z, zm = z;
      zp[i] += 1e-6;
      zm[i] -= 1e-6;
      EXPECT_NEAR(dz.data<double>()[i], (loss(zp) - loss(zm)) / 2e-6, 1e-8) << "renorm " << renorm << " i " << i;
    }
  }
}

TEST(MoeDeepseek, SharedExpertsAndBiasHaveHfNames) {
  const ModelWeights w = tiny_deepseek_moe(DType::F32, 3);
  std::vector<std::string> names;
  model_for_each_parameter(w, [&](const std::string& n, const Tensor&) { names.push_back(n); });
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  EXPECT_TRUE(has("model.layers.1.mlp.shared_experts.gate_proj.weight"));
  EXPECT_TRUE(has("model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_TRUE(has("model.layers.0.mlp.gate_proj.weight"));  // the dense layer keeps its names
  EXPECT_FALSE(has("model.layers.1.mlp.gate_proj.weight"));
  EXPECT_EQ(model_count_parameters(w), w.config.num_parameters());
}

}  // namespace
}  // namespace fp8rl

#include "rl/memory_plan.h"

namespace fp8rl {
namespace {

// The memory plan counts every expert: Qwen3-30B-A3B's generator weights are ~2 bytes per
// parameter in BF16 (the FP32 router aside) and ~1 byte (+ scales) in FP8.
TEST(MoeMemoryPlan, GeneratorWeightsCountEveryExpert) {
  const ModelConfig c = model_config_from_json(kQwen3Moe4x);
  const double P = static_cast<double>(c.num_parameters());
  EnginePrecision bf16, fp8;
  bf16.linear = LinearMode::BF16;
  fp8.linear = LinearMode::FP8_BLOCK;
  const double b16 = static_cast<double>(memory_plan_generator_bytes(c, bf16, DType::BF16));
  const double b8 = static_cast<double>(memory_plan_generator_bytes(c, fp8, DType::BF16));
  EXPECT_NEAR(b16 / (2 * P), 1.0, 2e-3);
  const double linears = 48.0 * (128 * 3 * 2048 * 768 + 2 * 4096 * 2048 + 2 * 512 * 2048);  // experts, q/k/v/o
  EXPECT_NEAR(b8, b16 - linears, 1e-3 * b16);  // every FP8 linear at 1 byte instead of 2 (+ scales)
  EXPECT_GT(memory_plan_block_bytes_per_token(c, DType::BF16), 0);
}

}  // namespace
}  // namespace fp8rl
