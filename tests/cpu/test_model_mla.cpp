// MLA attention (DeepSeek-V3 / Moonlight, model_type deepseek_v3) on the CPU backend: the ops
// it adds (copy_cols, interleaved RoPE, attention with v_head_dim != qk head dim), the block
// against a per-token loop written from HF's DeepseekV3Attention, FP64 finite-difference
// gradients of tiny MLA models (with and without q compression, both RoPE layouts), the FP8
// recipe's BF16-kept projections, a trainer step, and generation over the latent cache (the
// absorbed attention) against the expanded scoring, on the tiny models and the transformers
// fixtures, whose scoring tests are in test_model_moe.cpp (MoeDeepseekFixture).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "test_model_util.h"
#include "rollout/rollout.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

using test::values_f64;

Tensor host_f64(const std::vector<double>& v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::F64);
  std::copy(v.begin(), v.end(), t.data<double>());
  return t;
}

// A tiny DeepSeek-V3: 4 heads, qk_nope 12 + qk_rope 8, v_head_dim 10 (so v's head differs from
// q/k's 20), kv_lora_rank 20, q_lora_rank 16 or none; layer 0 dense, then MoE layers of 6
// experts in 2 groups (1 kept), top-2, one shared expert.
ModelConfig tiny_mla_config(bool q_lora, bool interleave, int layers = 3) {
  ModelConfig c = model_config_tiny("qwen3_moe", 48, /*hidden=*/64, layers, /*heads=*/4, /*kv_heads=*/4, 96);
  c.model_type = "deepseek_v3";
  c.qk_norm = false;
  c.tie_word_embeddings = false;
  c.mlp_only_layers.clear();
  c.num_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 24;
  c.norm_topk_prob = true;
  c.moe_router = "sigmoid";
  c.n_group = 2;
  c.topk_group = 1;
  c.routed_scaling_factor = 1.5f;
  c.n_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.q_lora_rank = q_lora ? 16 : 0;
  c.kv_lora_rank = 20;
  c.qk_nope_head_dim = 12;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 10;
  c.rope_interleave = interleave;
  c.head_dim = c.qk_rope_head_dim;
  c.rope_theta = 10000.0f;
  c.validate();
  return c;
}

ModelWeights tiny_mla(DType dtype, uint64_t seed, bool q_lora, bool interleave = true, int layers = 3) {
  RandomInit init;
  init.seed = seed;
  init.std = 0.15f;
  init.norm_jitter = 0.2f;
  return model_weights_random(tiny_mla_config(q_lora, interleave, layers), init, dtype);
}

std::vector<double> score(Backend& be, const ModelWeights& w, const ForwardBatch& b,
                          LinearMode mode = LinearMode::FP32) {
  EnginePrecision p;
  p.linear = mode;
  return values_f64(be, model_forward_logprobs(be, w, p, b, ForwardOptions{}).logp);
}

TEST(MlaOps, CopyColsSlicesAndJoins) {
  auto be = make_cpu_backend();
  Tensor src = host_f64({0, 1, 2, 3, 4, 5, 6, 7}, {2, 4});
  Tensor dst = Tensor::zeros({2, 3}, DType::F64);
  be->copy_cols(src, 1, dst, 1, 2);
  EXPECT_EQ(values_f64(*be, dst), (std::vector<double>{0, 1, 2, 0, 5, 6}));
  EXPECT_THROW(be->copy_cols(src, 3, dst, 0, 2), Error);  // past src's columns
  Tensor other = Tensor::zeros({3, 3}, DType::F64);
  EXPECT_THROW(be->copy_cols(src, 0, other, 0, 1), Error);  // different row counts
}

// Interleaved RoPE rotates (2i, 2i + 1); it equals the rotate_half form on de-interleaved dims.
TEST(MlaOps, InterleavedRopeIsRotateHalfOnDeinterleavedDims) {
  auto be = make_cpu_backend();
  const int64_t T = 3, H = 2, hd = 8;
  std::vector<double> x(T * H * hd), xd(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7 * i + 0.1);
  for (int64_t r = 0; r < T * H; ++r)
    for (int64_t i = 0; i < hd / 2; ++i) {
      xd[r * hd + i] = x[r * hd + 2 * i];
      xd[r * hd + hd / 2 + i] = x[r * hd + 2 * i + 1];
    }
  RopeParams rp;
  rp.inv_freq = {1.0f, 0.3f, 0.1f, 0.01f};
  Tensor pos = Tensor::empty({T}, DType::I32);
  for (int64_t t = 0; t < T; ++t) pos.data<int32_t>()[t] = static_cast<int32_t>(5 * t + 1);
  Tensor a = host_f64(x, {T, H, hd}), b = host_f64(xd, {T, H, hd});
  rp.interleaved = true;
  be->rope(a, pos, rp, false);
  rp.interleaved = false;
  be->rope(b, pos, rp, false);
  const std::vector<double> va = values_f64(*be, a), vb = values_f64(*be, b);
  for (int64_t r = 0; r < T * H; ++r)
    for (int64_t i = 0; i < hd / 2; ++i) {
      EXPECT_DOUBLE_EQ(va[r * hd + 2 * i], vb[r * hd + i]);
      EXPECT_DOUBLE_EQ(va[r * hd + 2 * i + 1], vb[r * hd + hd / 2 + i]);
    }
  rp.interleaved = true;
  be->rope(a, pos, rp, true);  // the inverse brings x back
  const std::vector<double> back = values_f64(*be, a);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 1e-6);
}

// Attention with v's head (dv) narrower than q/k's: each output column is the softmax-weighted
// v column, exactly as attention over v zero-padded to hd, sliced.
TEST(MlaOps, AttentionWithNarrowerValueHeads) {
  auto be = make_cpu_backend();
  const int64_t T = 5, H = 2, hd = 6, dv = 4;
  std::vector<double> q(T * H * hd), k(T * H * hd), v(T * H * dv), vp(T * H * hd, 0.0);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.3 * i), k[i] = std::cos(0.7 * i + 0.2);
  for (int64_t r = 0; r < T * H; ++r)
    for (int64_t c = 0; c < dv; ++c) vp[r * hd + c] = v[r * dv + c] = std::sin(1.1 * (r * dv + c) + 0.5);
  const std::vector<int32_t> cu = {0, 3, 5};
  Tensor out = Tensor::zeros({T, H, dv}, DType::F64), outp = Tensor::zeros({T, H, hd}, DType::F64);
  Tensor lse = Tensor::zeros({H, T}, DType::F64), lsep = Tensor::zeros({H, T}, DType::F64);
  be->attention(host_f64(q, {T, H, hd}), host_f64(k, {T, H, hd}), host_f64(v, {T, H, dv}), cu, 0.4f, out, lse);
  be->attention(host_f64(q, {T, H, hd}), host_f64(k, {T, H, hd}), host_f64(vp, {T, H, hd}), cu, 0.4f, outp, lsep);
  const std::vector<double> o = values_f64(*be, out), op = values_f64(*be, outp);
  for (int64_t r = 0; r < T * H; ++r)
    for (int64_t c = 0; c < dv; ++c) EXPECT_NEAR(o[r * dv + c], op[r * hd + c], 1e-14);
  EXPECT_EQ(values_f64(*be, lse), values_f64(*be, lsep));
}

TEST(MlaModel, ShapesNamesAndParameterCount) {
  for (bool q_lora : {false, true}) {
    const ModelWeights w = tiny_mla(DType::F32, 1, q_lora);
    EXPECT_EQ(model_count_parameters(w), w.config.num_parameters()) << q_lora;
    std::vector<std::string> names;
    model_for_each_parameter(w, [&](const std::string& n, const Tensor&) {
      if (n.rfind("model.layers.1.self_attn.", 0) == 0) names.push_back(n.substr(25));
    });
    const std::vector<std::string> want =
        q_lora ? std::vector<std::string>{"o_proj.weight", "q_a_proj.weight", "q_b_proj.weight",
                                          "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                                          "q_a_layernorm.weight", "kv_a_layernorm.weight"}
               : std::vector<std::string>{"q_proj.weight", "o_proj.weight", "kv_a_proj_with_mqa.weight",
                                          "kv_b_proj.weight", "kv_a_layernorm.weight"};
    EXPECT_EQ(names, want) << q_lora;
    EXPECT_EQ(w.layers[1].kv_a.w.shape(), Shape({20 + 8, 64}));
    EXPECT_EQ(w.layers[1].kv_b.w.shape(), Shape({4 * (12 + 10), 20}));
    EXPECT_EQ(w.layers[1].o.w.shape(), Shape({64, 4 * 10}));
  }
}

// The attention of block 0 against a per-token loop from HF's DeepseekV3Attention.forward
// (q split, latent norm, kv_b expansion, RoPE in HF's de-interleaved output layout, softmax
// scale 1/sqrt(qk_head_dim)), on the block's saved input xn_attn: its o_proj output a.proj.
TEST(MlaModel, BlockMatchesPerTokenLoop) {
  auto be = make_cpu_backend();
  for (bool q_lora : {false, true}) {
    const ModelWeights w = tiny_mla(DType::F64, 7, q_lora, /*interleave=*/true, /*layers=*/1);
    const ModelConfig& c = w.config;
    const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({6}, 48, 9));
    EnginePrecision p;
    p.linear = LinearMode::FP32;
    Activations acts;
    model_forward_logprobs(*be, w, p, b, ForwardOptions{}, &acts);
    const LayerActivations& a = acts.layers[0];
    const LayerWeights& L = w.layers[0];
    const int64_t T = b.num_tokens(), D = 64, H = 4, nope = 12, r = 8, qk = 20, dv = 10, kvr = 20, qr = 16;
    // o_proj's output: x_mid - x (a.proj is reused by the MLP).
    const std::vector<double> xn = values_f64(*be, a.xn_attn), xm = values_f64(*be, a.x_mid), x0 = values_f64(*be, a.x);
    std::vector<double> got(xm.size());
    for (size_t i = 0; i < xm.size(); ++i) got[i] = xm[i] - x0[i];
    auto mat = [&](const LinearWeight& lw) { return values_f64(*be, lw.w); };
    auto matvec = [](const std::vector<double>& W, const double* x, int64_t n, int64_t k) {
      std::vector<double> y(n, 0.0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) y[i] += W[i * k + j] * x[j];
      return y;
    };
    auto rmsnorm = [](std::vector<double> x, const std::vector<double>& g, double eps) {
      double ss = 0;
      for (double v : x) ss += v * v;
      const double rs = 1.0 / std::sqrt(ss / x.size() + eps);
      for (size_t i = 0; i < x.size(); ++i) x[i] = x[i] * rs * g[i];
      return x;
    };
    const std::vector<float> inv = c.rope_params().inv_freq;
    auto rope_hf = [&](const double* x, int64_t pos) {  // apply_rotary_pos_emb_interleave
      std::vector<double> y(r);
      for (int64_t i = 0; i < r / 2; ++i) {
        const float ang = static_cast<float>(pos) * inv[i];
        const double cs = static_cast<float>(std::cos(double(ang))), sn = static_cast<float>(std::sin(double(ang)));
        y[i] = x[2 * i] * cs - x[2 * i + 1] * sn;
        y[r / 2 + i] = x[2 * i + 1] * cs + x[2 * i] * sn;
      }
      return y;
    };
    std::vector<std::vector<double>> Q(T), K(T), V(T);  // [H * qk], [H * qk], [H * dv]
    for (int64_t t = 0; t < T; ++t) {
      const double* x = xn.data() + t * D;
      std::vector<double> q;
      if (q_lora) {
        const std::vector<double> qa = rmsnorm(matvec(mat(L.q_a), x, qr, D), values_f64(*be, L.q_a_norm), 1e-6);
        q = matvec(mat(L.q_b), qa.data(), H * qk, qr);
      } else {
        q = matvec(mat(L.q), x, H * qk, D);
      }
      const std::vector<double> kva = matvec(mat(L.kv_a), x, kvr + r, D);
      const std::vector<double> lat =
          rmsnorm(std::vector<double>(kva.begin(), kva.begin() + kvr), values_f64(*be, L.kv_a_norm), 1e-6);
      const std::vector<double> kr = rope_hf(kva.data() + kvr, b.positions[t]);
      const std::vector<double> kvb = matvec(mat(L.kv_b), lat.data(), H * (nope + dv), kvr);
      Q[t].resize(H * qk), K[t].resize(H * qk), V[t].resize(H * dv);
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<double> qr_ = rope_hf(q.data() + h * qk + nope, b.positions[t]);
        for (int64_t i = 0; i < nope; ++i) Q[t][h * qk + i] = q[h * qk + i], K[t][h * qk + i] = kvb[h * (nope + dv) + i];
        for (int64_t i = 0; i < r; ++i) Q[t][h * qk + nope + i] = qr_[i], K[t][h * qk + nope + i] = kr[i];
        for (int64_t i = 0; i < dv; ++i) V[t][h * dv + i] = kvb[h * (nope + dv) + nope + i];
      }
    }
    const std::vector<double> wo = mat(L.o);
    const double scale = 1.0 / std::sqrt(double(qk));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> att(H * dv, 0.0);
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> s(t + 1);
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < qk; ++i) d += Q[t][h * qk + i] * K[j][h * qk + i];
          m = std::max(m, s[j] = d * scale);
        }
        for (double& e : s) sum += (e = std::exp(e - m));
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t i = 0; i < dv; ++i) att[h * dv + i] += s[j] / sum * V[j][h * dv + i];
      }
      const std::vector<double> y = matvec(wo, att.data(), D, H * dv);
      for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(got[t * D + d], y[d], 1e-6) << q_lora << " " << t << "," << d;
    }
  }
}

double loss(Backend& be, const ModelWeights& w, const ForwardBatch& batch, const std::vector<double>& c) {
  const std::vector<double> lp = score(be, w, batch);
  double l = 0;
  for (size_t t = 0; t < lp.size(); ++t) l += c[t] * lp[t];
  return l;
}

struct MlaGradCase {
  bool q_lora, interleave;
};
class MlaGradTest : public ::testing::TestWithParam<MlaGradCase> {};

// Central differences in FP64 for every parameter tensor (the largest entry and 3 more each);
// the router frozen (its gradient zero), routing unchanged by the perturbations.
TEST_P(MlaGradTest, BackwardMatchesFiniteDifferencesFp64) {
  auto be = make_cpu_backend();
  ModelWeights w = tiny_mla(DType::F64, 31, GetParam().q_lora, GetParam().interleave);
  const ForwardBatch batch = forward_batch_from_sequences(test::token_sequences({6, 5}, 48, 3));
  const int64_t T = batch.num_tokens();
  std::vector<double> c(T);
  for (int64_t t = 0; t < T; ++t) c[t] = 0.5 + 0.37 * std::sin(1.3 * t + 0.2);
  EnginePrecision fp32;
  fp32.linear = LinearMode::FP32;
  Activations acts;
  model_forward_logprobs(*be, w, fp32, batch, ForwardOptions{}, &acts);
  ModelWeights g = model_grads_alloc(*be, w, DType::F64);
  model_backward(*be, w, fp32, acts, be->to_device(host_f64(c, {T})), g);

  std::vector<std::pair<std::string, Tensor>> grads;
  model_for_each_parameter(g, [&](const std::string& n, Tensor& t) { grads.push_back({n, t}); });
  size_t gi = 0;
  int checked = 0, mla_tensors = 0;
  double worst = 0;
  model_for_each_parameter(w, [&](const std::string& name, Tensor& p) {
    ASSERT_EQ(grads[gi].first, name);
    const std::vector<double> an = values_f64(*be, grads[gi++].second);
    double gmax = 0;
    size_t imax = 0;
    for (size_t i = 0; i < an.size(); ++i)
      if (std::fabs(an[i]) > gmax) gmax = std::fabs(an[i]), imax = i;
    if (name.find(".mlp.gate.") != std::string::npos) {  // frozen router, selection-only bias
      EXPECT_EQ(gmax, 0.0) << name;
      return;
    }
    double* data = p.data<double>();
    if (gmax == 0.0 && name.find(".mlp.experts.") != std::string::npos) return;  // an expert no token chose
    ASSERT_GT(gmax, 0.0) << name << ": gradient is identically zero";
    if (name.find(".self_attn.") != std::string::npos) ++mla_tensors;
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
  });
  // q (or q_a, q_a_norm, q_b), kv_a, kv_a_norm, kv_b, o in each of the 3 layers.
  EXPECT_EQ(mla_tensors, 3 * (GetParam().q_lora ? 7 : 5));
  EXPECT_GT(checked, 4 * 3 * 5);
  RecordProperty("worst_relative_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Mla, MlaGradTest,
                         ::testing::Values(MlaGradCase{false, true}, MlaGradCase{true, true},
                                           MlaGradCase{true, false}),
                         [](const auto& info) {
                           return std::string(info.param.q_lora ? "QLora" : "QProj") +
                                  (info.param.interleave ? "Interleaved" : "RotateHalf");
                         });

// Block recomputation runs the MLA block again: the same gradients bit for bit.
TEST(MlaModel, RecomputeGivesTheSameGradients) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_mla(DType::F32, 5, true);
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({7, 4}, 48, 2));
  Tensor dl = Tensor::empty({b.num_tokens()}, DType::F32);
  for (int64_t t = 0; t < b.num_tokens(); ++t) dl.data<float>()[t] = 0.1f * static_cast<float>(t % 5) - 0.2f;
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  std::vector<std::vector<double>> out[2];
  for (int rc = 0; rc < 2; ++rc) {
    ForwardOptions fo;
    fo.recompute = rc == 1;
    Activations acts;
    model_forward_logprobs(*be, w, p, b, fo, &acts);
    ModelWeights g = model_grads_alloc(*be, w);
    model_backward(*be, w, p, acts, dl, g);
    model_for_each_parameter(g, [&](const std::string&, const Tensor& t) { out[rc].push_back(values_f64(*be, t)); });
  }
  EXPECT_EQ(out[0], out[1]);
}

// FP8 recipe: the MLA projections whose widths are not multiples of 128 stay BF16 (listed);
// the tiny model's are all such, so its MLA projections run BF16 and its MLP FP8.
TEST(MlaModel, Fp8KeepsUnblockableProjectionsBf16) {
  EnginePrecision fp8;
  fp8.linear = LinearMode::FP8_BLOCK;
  const ModelWeights w = tiny_mla(DType::F32, 3, true);
  const std::vector<std::string> kept = model_bf16_kept_linears(w, fp8);
  EXPECT_EQ(kept.size(), 3u * 5u);
  EXPECT_NE(std::find(kept.begin(), kept.end(), "model.layers.0.self_attn.kv_a_proj_with_mqa [28, 64]"), kept.end());
  for (const std::string& k : kept) EXPECT_NE(k.find(".self_attn."), std::string::npos) << k;
  EnginePrecision bf16;
  bf16.linear = LinearMode::BF16;
  EXPECT_TRUE(model_bf16_kept_linears(w, bf16).empty());
  // Moonlight's widths: only kv_a_proj_with_mqa (576 rows) is kept.
  ModelConfig m = w.config;
  m.hidden_size = 2048;
  m.num_heads = m.num_kv_heads = 16;
  m.qk_nope_head_dim = 128;
  m.qk_rope_head_dim = 64;
  m.v_head_dim = 128;
  m.kv_lora_rank = 512;
  EXPECT_TRUE(mla_projection_kept_bf16(m, 512 + 64, 2048));
  EXPECT_FALSE(mla_projection_kept_bf16(m, 16 * 192, 2048));      // q_proj
  EXPECT_FALSE(mla_projection_kept_bf16(m, 16 * 256, 512));       // kv_b_proj
  EXPECT_FALSE(mla_projection_kept_bf16(m, 2048, 16 * 128));      // o_proj
  EXPECT_FALSE(mla_projection_kept_bf16(model_config_tiny("qwen3", 48), 40, 64));  // not MLA: no exception

  // The FP8 forward runs and tracks FP32 (the MLP's linears are FP8).
  auto be = make_cpu_backend();
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({9, 7}, 48, 6));
  const std::vector<double> a = score(*be, w, b), q = score(*be, w, b, LinearMode::FP8_BLOCK),
                            h = score(*be, w, b, LinearMode::BF16);
  double sum = 0, sum16 = 0;
  for (size_t t = 0; t < a.size(); ++t) sum += std::fabs(a[t] - q[t]), sum16 += std::fabs(a[t] - h[t]);
  std::printf("  fp8 vs fp32 mean |diff| %.3e, bf16 vs fp32 %.3e\n", sum / a.size(), sum16 / a.size());
  // E4M3 keeps 3 mantissa bits to BF16's 7: the FP8 MLP's error is above the all-BF16 run's
  // and within 32x of it (16x per operand rounding).
  EXPECT_GT(sum, sum16);
  EXPECT_LT(sum, 32 * sum16);
}

// A trainer step on an MLA model (FP32 and FP8) moves the MLA weights.
TEST(MlaModel, TrainerSteps) {
  auto be = make_cpu_backend();
  for (LinearMode mode : {LinearMode::FP32, LinearMode::FP8_BLOCK}) {
    EnginePrecision prec;
    prec.linear = mode;
    Trainer trainer(*be, model_weights_to_device(*be, tiny_mla(DType::F32, 41, true), DType::F32), prec,
                    TrainerOptions{});
    const auto ids = test::token_sequences({8, 6}, 48, 4);
    std::vector<TrainSequence> seqs;
    for (const auto& s : ids) seqs.push_back(TrainSequence{s, 3});
    const std::vector<float> before = to_float_vector(be->to_host(trainer.master().layers[1].kv_b.w));
    TokenLossFn loss_fn = [](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
      double l = 0;
      for (size_t i = 0; i < lp.size(); ++i) l -= lp[i], grad[i] = -1.0f / lp.size();
      return l / lp.size();
    };
    const StepResult st = trainer.step(seqs, 1.0f, loss_fn, 1e-2f);
    EXPECT_TRUE(st.applied);
    const ModelWeights& m = static_cast<const Trainer&>(trainer).master();
    EXPECT_NE(to_float_vector(be->to_host(m.layers[1].kv_b.w)), before);
  }
}

// ---- generation: the absorbed attention over the latent cache -----------------------------------

// The models generation is tested on: the tiny ones (q compression or not, both RoPE layouts) and
// the transformers-made DeepSeek-V3 fixtures (tests/data/fixtures, when present).
std::vector<std::pair<std::string, ModelWeights>> generation_models(Backend& be) {
  std::vector<std::pair<std::string, ModelWeights>> out;
  out.push_back({"tiny", model_weights_to_device(be, tiny_mla(DType::F32, 61, false, true), DType::F32)});
  out.push_back({"tiny_qlora_halfrot", model_weights_to_device(be, tiny_mla(DType::F32, 62, true, false), DType::F32)});
  const std::string dir = std::string(FP8RL_TEST_DATA) + "/fixtures/";
  for (const char* name : {"deepseek_v3", "deepseek_v3_qlora"})
    if (std::ifstream(dir + name + "/config.json"))
      out.push_back({name, model_weights_to_device(be, model_weights_load(dir + name, DType::F32), DType::F32)});
  return out;
}

std::vector<RolloutRequest> generation_requests(int vocab) {
  const auto prompts = test::token_sequences({5, 9, 2, 17}, vocab, 31);
  return {{prompts[0], 2}, {prompts[1], 1}, {prompts[2], 2}, {prompts[3], 1}};
}

// The expanded (trainer) form's full-recompute log-probs of every generated token.
std::vector<double> score_generated(Backend& be, const ModelWeights& w, const EnginePrecision& prec,
                                    const std::vector<RolloutRequest>& reqs, const std::vector<RolloutSample>& out,
                                    const std::vector<float>& kv_round = {}) {
  std::vector<std::vector<int32_t>> seqs;
  for (const RolloutSample& s : out) {
    seqs.push_back(reqs[s.request].prompt);
    seqs.back().insert(seqs.back().end(), s.tokens.begin(), s.tokens.end());
  }
  const ForwardBatch batch = forward_batch_from_sequences(seqs);
  ForwardOptions opt;
  opt.kv_round_k = kv_round;
  opt.kv_round_v = kv_round;
  const std::vector<double> lp = values_f64(be, model_forward_logprobs(be, w, prec, batch, opt).logp);
  std::vector<double> r;
  for (size_t i = 0; i < out.size(); ++i) {
    const int p = static_cast<int>(reqs[out[i].request].prompt.size());
    for (size_t t = 0; t < out[i].tokens.size(); ++t) r.push_back(lp[batch.cu_seqlens[i] + p - 1 + t]);
  }
  return r;
}

struct Diff {
  double mean = 0, worst = 0;
  size_t n = 0;
};
Diff diff_of(const std::vector<RolloutSample>& out, const std::vector<double>& want) {
  Diff d;
  for (const RolloutSample& s : out)
    for (float lp : s.logp) {
      const double e = std::fabs(lp - want[d.n++]);
      d.mean += e, d.worst = std::max(d.worst, e);
    }
  d.mean /= std::max<size_t>(d.n, 1);
  return d;
}

// Sampled generation (temperature 1, prefix-shared prompts, chunked prefill + decode over the
// latent cache) against the trainer's expanded scoring of the same tokens, FP32 weights and an
// F32 cache: the absorbed attention is the same function, so only FP32 rounding order differs
// (measured worst 1.9e-6 over the models here; 2e-5 leaves 10x for other compilers' orders).
TEST(MlaGeneration, SampledLogprobsEqualTrainerScoringFp32) {
  auto be = make_cpu_backend();
  EnginePrecision prec;
  prec.linear = LinearMode::FP32;
  prec.kv_cache = DType::F32;
  for (auto& [name, w] : generation_models(*be)) {
    SchedulerOptions so;
    so.max_batch_tokens = 8;  // prompts split into prefill chunks
    RolloutEngine engine(*be, w, prec, /*kv_pages=*/64, /*page_size=*/4, /*max_batch=*/8, so);
    const auto reqs = generation_requests(w.config.vocab_size);
    SamplingParams sp;
    sp.max_new_tokens = 10;
    sp.seed = 3;
    const std::vector<RolloutSample> out = engine.generate(reqs, sp);
    ASSERT_EQ(out.size(), 6u) << name;
    const Diff d = diff_of(out, score_generated(*be, w, prec, reqs, out));
    EXPECT_EQ(d.n, 60u) << name;
    EXPECT_LT(d.worst, 2e-5) << name << ": mean " << d.mean;
    std::printf("  %s: generator vs trainer fp32 mean |dlogp| %.3e worst %.3e over %zu tokens\n", name.c_str(),
                d.mean, d.worst, d.n);
  }
}

// Greedy generation equals, token for token, the argmax of a full-recompute forward (the
// expanded form) over each prefix; the test also checks that every step's winning margin exceeds
// the engines' difference, so the equality is not luck at a near-tie.
TEST(MlaGeneration, GreedyEqualsFullRecomputeArgmax) {
  auto be = make_cpu_backend();
  EnginePrecision prec;
  prec.linear = LinearMode::FP32;
  prec.kv_cache = DType::F32;
  for (auto& [name, w] : generation_models(*be)) {
    RolloutEngine engine(*be, w, prec, 64, 4, 8);
    const auto reqs = generation_requests(w.config.vocab_size);
    SamplingParams sp;
    sp.temperature = 0.0f;
    sp.max_new_tokens = 12;
    const std::vector<RolloutSample> out = engine.generate(reqs, sp);
    const Tensor head = be->to_host(w.lm_head);
    const int64_t V = w.config.vocab_size, D = w.config.hidden_size;
    double min_margin = 1e30;
    for (const RolloutSample& s : out) {
      std::vector<int32_t> seq = reqs[s.request].prompt;
      seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
      const ForwardBatch batch = forward_batch_from_sequences({seq});
      Activations acts;
      model_forward_logprobs(*be, w, prec, batch, ForwardOptions{}, &acts);
      const std::vector<double> hidden = values_f64(*be, acts.hidden);
      const size_t p = reqs[s.request].prompt.size();
      for (size_t t = 0; t < s.tokens.size(); ++t) {
        std::vector<double> logit(V, 0.0);
        for (int64_t v = 0; v < V; ++v)
          for (int64_t d = 0; d < D; ++d) logit[v] += hidden[(p - 1 + t) * D + d] * head.data<float>()[v * D + d];
        const int64_t best = std::max_element(logit.begin(), logit.end()) - logit.begin();
        ASSERT_EQ(s.tokens[t], best) << name << " request " << s.request << " token " << t;
        double second = -1e30;
        for (int64_t v = 0; v < V; ++v)
          if (v != best) second = std::max(second, logit[v]);
        min_margin = std::min(min_margin, logit[best] - second);
      }
    }
    EXPECT_GT(min_margin, 1e-4) << name;
    std::printf("  %s: %zu greedy samples equal the recompute argmax; smallest margin %.3e\n", name.c_str(),
                out.size(), min_margin);
  }
}

// An E4M3 latent cache stores the latent and the rope key rounded with the layer's scale; the
// trainer that rounds them the same way (ForwardOptions::kv_round_k, applied before kv_b) scores
// the generator's tokens with the generator's numerics up to FP32 order. The scales come from
// the scoring forward's amax (k: the cached row, v: the latent).
TEST(MlaGeneration, E4m3LatentCacheMatchesTheRoundingTrainer) {
  auto be = make_cpu_backend();
  EnginePrecision prec;
  prec.linear = LinearMode::FP32;
  prec.kv_cache = DType::E4M3;
  for (auto& [name, w] : generation_models(*be)) {
    const auto reqs = generation_requests(w.config.vocab_size);
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& r : reqs) prompts.push_back(r.prompt);
    ForwardOptions fo;
    fo.record_qkv_amax = true;
    const LogprobResult lr = model_forward_logprobs(*be, w, prec, forward_batch_from_sequences(prompts), fo);
    ASSERT_EQ(lr.k_amax.size(), static_cast<size_t>(w.config.num_layers));
    for (int l = 0; l < w.config.num_layers; ++l) EXPECT_GE(lr.k_amax[l], lr.v_amax[l]) << name;  // row >= latent
    const KvScales scales = kv_scales_calibrate({lr.k_amax}, {lr.v_amax}, 1.0f, 1.0f);
    RolloutEngine engine(*be, w, prec, 64, 4, 8);
    engine.refit(w, &scales);
    SamplingParams sp;
    sp.max_new_tokens = 10;
    sp.seed = 9;
    const std::vector<RolloutSample> out = engine.generate(reqs, sp);
    const Diff rounded = diff_of(out, score_generated(*be, w, prec, reqs, out, scales.k));
    const Diff plain = diff_of(out, score_generated(*be, w, prec, reqs, out));
    EXPECT_LT(rounded.worst, 2e-5) << name;
    EXPECT_GT(plain.mean, 10 * rounded.mean) << name;  // the rounding is real, and matched
    std::printf("  %s: e4m3 latent cache vs rounding trainer mean %.3e worst %.3e (vs unrounded trainer %.3e)\n",
                name.c_str(), rounded.mean, rounded.worst, plain.mean);
  }
}

// BF16 and FP8 recipes: the generator's MLA projections run as the trainer's (FP8 where the
// widths block, else BF16), but the absorbed products (q_nope W_k, o_lat W_v^T) round q_nope and
// the latent output to BF16 where the trainer's kv_b rounds the latent c: the same size of
// rounding on other operands, so a mismatch of the size of BF16 itself (vLLM has it too). Bound:
// at most 2x the distance between the trainer's scores in that recipe and in FP32 (measured
// 0.5-1.2x on these models: tiny random models with sharp distributions amplify rounding).
TEST(MlaGeneration, Bf16AndFp8GeneratorMismatchIsBf16Sized) {
  auto be = make_cpu_backend();
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK}) {
    EnginePrecision prec, exact;
    prec.linear = mode;
    prec.kv_cache = DType::F32;
    exact.linear = LinearMode::FP32;
    for (auto& [name, w] : generation_models(*be)) {
      RolloutEngine engine(*be, w, prec, 64, 4, 8);
      const auto reqs = generation_requests(w.config.vocab_size);
      SamplingParams sp;
      sp.max_new_tokens = 10;
      sp.seed = 4;
      const std::vector<RolloutSample> out = engine.generate(reqs, sp);
      const std::vector<double> trainer = score_generated(*be, w, prec, reqs, out);
      const std::vector<double> fp32 = score_generated(*be, w, exact, reqs, out);
      const Diff d = diff_of(out, trainer);
      double noise = 0;
      for (size_t i = 0; i < trainer.size(); ++i) noise += std::fabs(trainer[i] - fp32[i]);
      noise /= trainer.size();
      EXPECT_LT(d.mean, 2 * noise) << name << " " << linear_mode_name(mode) << ": worst " << d.worst;
      std::printf("  %s %s: generator vs trainer mean |dlogp| %.3e worst %.3e; trainer %s vs fp32 %.3e\n",
                  name.c_str(), linear_mode_name(mode), d.mean, d.worst, linear_mode_name(mode), noise);
    }
  }
}

// The latent cache: one row of kv_lora_rank + qk_rope_head_dim per token and layer, no V pools.
TEST(MlaGeneration, LatentCacheShape) {
  auto be = make_cpu_backend();
  const ModelConfig c = tiny_mla_config(false, true);
  const KvCache cache = model_alloc_kv_cache(*be, c, 8, 4, DType::E4M3);
  EXPECT_EQ(cache.num_kv_heads, 1);
  EXPECT_EQ(cache.head_dim, c.kv_lora_rank + c.qk_rope_head_dim);
  EXPECT_EQ(cache.latent_v_dim, c.kv_lora_rank);
  EXPECT_EQ(cache.v_dim(), c.kv_lora_rank);
  EXPECT_EQ(cache.k.size(), static_cast<size_t>(c.num_layers));
  EXPECT_TRUE(cache.v.empty());
}

}  // namespace
}  // namespace fp8rl
