// The generator's copy of the policy and the refit that rewrites it in place.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "quant/fp8_rule.h"
#include "rollout/rollout.h"

namespace fp8rl {

namespace {

// dst <- src (same shape), converting the dtype when they differ.
void assign(Backend& be, const Tensor& src, Tensor& dst) {
  FP8RL_CHECK(src.numel() == dst.numel(), "refit: ", src.str(), " does not match ", dst.str());
  if (src.dtype() == dst.dtype()) be.copy(src, dst);
  else be.convert(src, dst);
}

Tensor alloc_like(Backend& be, const Tensor& t, DType dtype) {
  return t.defined() ? be.alloc(t.shape(), dtype) : Tensor();
}

// Visits the linears of block l that follow the block's precision (q, k, v, o, MLA's
// projections, and the dense MLP's or every expert's gate, up, down) of two weight sets side by
// side. g.experts must be sized.
template <class Fn>
void for_each_linear_pair(const LayerWeights& m, LayerWeights& g, Fn fn) {
  auto defined = [](const LinearWeight& w) { return w.w.defined() || w.wq.defined(); };
  for (auto p : {&LayerWeights::q, &LayerWeights::k, &LayerWeights::v, &LayerWeights::o, &LayerWeights::q_a,
                 &LayerWeights::q_b, &LayerWeights::kv_a, &LayerWeights::kv_b})
    if (defined(m.*p)) fn(m.*p, g.*p);  // (MLA has no k, v; the others have no q_a ... kv_b)
  if (m.gate.w.defined() || m.gate.wq.defined()) {  // the dense MLP, or an MoE layer's shared experts
    fn(m.gate, g.gate);
    fn(m.up, g.up);
    fn(m.down, g.down);
  }
  for (size_t e = 0; e < m.experts.size(); ++e) {
    fn(m.experts[e].gate, g.experts[e].gate);
    fn(m.experts[e].up, g.experts[e].up);
    fn(m.experts[e].down, g.experts[e].down);
  }
}

// Allocates the generator copies g[i] of master linears m[i] as consecutive row blocks of one
// buffer, when every m[i] exists without a bias, they share their input width, and (FP8) each
// has a multiple of 128 rows; otherwise leaves g untouched (for_each_linear_pair allocates them).
void concatenate(Backend& be, const std::vector<const LinearWeight*>& m, const std::vector<LinearWeight*>& g,
                 LinearMode mode, bool pow2, DType act) {
  if (mode == LinearMode::FP32) return;
  int64_t rows = 0;
  for (const LinearWeight* w : m) {
    if (!w->w.defined() || w->bias.defined() || w->w.dim(1) != m[0]->w.dim(1)) return;
    if (mode == LinearMode::FP8_BLOCK && w->w.dim(0) % kQuantBlock != 0) return;
    rows += w->w.dim(0);
  }
  const int64_t K = m[0]->w.dim(1);
  int64_t r0 = 0;
  if (mode == LinearMode::FP8_BLOCK) {
    const QuantTensor cat = be.alloc_quant(rows, K, kQuantBlock, kQuantBlock, pow2);
    for (size_t i = 0; i < m.size(); ++i) {
      const int64_t r1 = r0 + m[i]->w.dim(0);
      g[i]->wq = cat;
      g[i]->wq.data = cat.data.slice_rows(r0, r1);
      g[i]->wq.scales = cat.scales.slice_rows(r0 / kQuantBlock, r1 / kQuantBlock);
      r0 = r1;
    }
  } else {
    const Tensor cat = be.alloc({rows, K}, act);
    for (size_t i = 0; i < m.size(); ++i) {
      const int64_t r1 = r0 + m[i]->w.dim(0);
      g[i]->w = cat.slice_rows(r0, r1);
      r0 = r1;
    }
  }
}

}  // namespace

ModelWeights generator_weights_alloc(Backend& be, const ModelWeights& master, const EnginePrecision& prec) {
  const DType act = be.act_dtype();
  const int L = master.config.num_layers;
  ModelWeights g;
  g.config = master.config;
  g.embed = alloc_like(be, master.embed, act);
  g.final_norm = alloc_like(be, master.final_norm, act);
  g.lm_head = master.config.tie_word_embeddings ? g.embed : alloc_like(be, master.lm_head, act);
  g.layers.resize(L);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& m = master.layers[l];
    LayerWeights& gl = g.layers[l];
    gl.attn_norm = alloc_like(be, m.attn_norm, act);
    gl.mlp_norm = alloc_like(be, m.mlp_norm, act);
    gl.q_norm = alloc_like(be, m.q_norm, act);
    gl.k_norm = alloc_like(be, m.k_norm, act);
    gl.q_a_norm = alloc_like(be, m.q_a_norm, act);  // MLA
    gl.kv_a_norm = alloc_like(be, m.kv_a_norm, act);
    gl.router.w = alloc_like(be, m.router.w, DType::F32);  // the router stays FP32 (model/transformer.h)
    gl.router_bias = alloc_like(be, m.router_bias, DType::F32);
    gl.experts.resize(m.experts.size());
    const LinearMode mode = prec.linear_for_layer(l, L);
    // q|k|v and gate|up as consecutive rows of one buffer each, so the CUDA backend can run each
    // group as one product at decode sizes (linear_shared_input); the values are those of the
    // separate weights (same quantizer, 128-row blocks that never straddle two weights).
    concatenate(be, {&m.q, &m.k, &m.v}, {&gl.q, &gl.k, &gl.v}, mode, prec.pow2_scales, act);
    concatenate(be, {&m.gate, &m.up}, {&gl.gate, &gl.up}, mode, prec.pow2_scales, act);
    for_each_linear_pair(m, gl, [&](const LinearWeight& mw, LinearWeight& gw) {
      if (gw.w.defined() || gw.wq.defined()) return;  // allocated by concatenate()
      FP8RL_CHECK(mw.w.defined(), "the generator is built from high-precision master weights");
      // MLA: kv_b is kept unquantized for the absorbed attention (transformer.cpp,
      // mla_attention_paged), and projections of widths the recipe cannot block stay BF16.
      const bool mla_unquantized = &mw == &m.kv_b || mla_projection_kept_bf16(master.config, mw.w.dim(0), mw.w.dim(1));
      if (mode == LinearMode::FP8_BLOCK && !mla_unquantized) {
        gw.wq = be.alloc_quant(mw.w.dim(0), mw.w.dim(1), kQuantBlock, kQuantBlock, prec.pow2_scales);
      } else if (&mw == &m.kv_b && mode != LinearMode::FP32) {
        gw.w = alloc_like(be, mw.w, DType::BF16);  // the absorbed products read it as stored (BF16: the trainer's rounding)
      } else {
        gw.w = alloc_like(be, mw.w, act);
      }
      gw.bias = alloc_like(be, mw.bias, act);
    });
  }
  generator_weights_refit(be, master, prec, g);
  return g;
}

void generator_weights_refit(Backend& be, const ModelWeights& master, const EnginePrecision& prec,
                             ModelWeights& g) {
  const int L = master.config.num_layers;
  FP8RL_CHECK(static_cast<int>(g.layers.size()) == L, "refit: generator has ", g.layers.size(),
              " layers, master ", L);
  assign(be, master.embed, g.embed);
  assign(be, master.final_norm, g.final_norm);
  if (!master.config.tie_word_embeddings) assign(be, master.lm_head, g.lm_head);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& m = master.layers[l];
    LayerWeights& gl = g.layers[l];
    assign(be, m.attn_norm, gl.attn_norm);
    assign(be, m.mlp_norm, gl.mlp_norm);
    if (m.q_norm.defined()) assign(be, m.q_norm, gl.q_norm);
    if (m.k_norm.defined()) assign(be, m.k_norm, gl.k_norm);
    if (m.q_a_norm.defined()) assign(be, m.q_a_norm, gl.q_a_norm);
    if (m.kv_a_norm.defined()) assign(be, m.kv_a_norm, gl.kv_a_norm);
    if (m.router.w.defined()) assign(be, m.router.w, gl.router.w);
    if (m.router_bias.defined()) assign(be, m.router_bias, gl.router_bias);
    for_each_linear_pair(m, gl, [&](const LinearWeight& mw, LinearWeight& gw) {
      if (gw.wq.defined()) be.quantize(mw.w, /*transpose=*/false, gw.wq);  // in place, same quantizer
      else assign(be, mw.w, gw.w);
      if (mw.bias.defined()) assign(be, mw.bias, gw.bias);
    });
  }
}

KvScales kv_scales_calibrate(const std::vector<std::vector<float>>& k_amax,
                             const std::vector<std::vector<float>>& v_amax, float percentile, float margin,
                             bool pow2) {
  FP8RL_CHECK(!k_amax.empty() && k_amax.size() == v_amax.size(),
              "KV calibration needs amax samples from at least one micro-batch");
  FP8RL_CHECK(percentile > 0.0f && percentile <= 1.0f && margin > 0.0f, "KV calibration: percentile must be in (0, 1] "
              "and margin > 0, got ", percentile, " and ", margin);
  const size_t L = k_amax[0].size();
  auto pick = [&](const std::vector<std::vector<float>>& a, size_t l) {
    std::vector<float> s;
    for (auto& mb : a) {
      FP8RL_CHECK(mb.size() == L, "KV calibration: inconsistent layer counts");
      FP8RL_CHECK(std::isfinite(mb[l]), "KV calibration: non-finite amax in layer ", l);
      s.push_back(mb[l]);
    }
    std::sort(s.begin(), s.end());
    // Nearest-rank percentile: the smallest sample with at least p of the samples at or below it.
    const size_t rank = static_cast<size_t>(std::ceil(percentile * s.size()));
    const float amax = s[std::min(s.size(), std::max<size_t>(rank, 1)) - 1];
    if (!(amax > 0.0f)) return 1.0f;
    const float scale = amax * margin / kE4M3Max;
    return pow2 && scale > 0.0f ? fp8_pow2_round_up(scale) : scale;
  };
  KvScales r;
  for (size_t l = 0; l < L; ++l) {
    r.k.push_back(pick(k_amax, l));
    r.v.push_back(pick(v_amax, l));
  }
  return r;
}

}  // namespace fp8rl
