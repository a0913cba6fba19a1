// The decoder forward (scoring and generation) and backward, over the op interface.
// Read top to bottom: helpers, the layer loop, the two forwards, the backward.
#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "core/error.h"

namespace fp8rl {

namespace {

// Activations are in the backend's act_dtype(), except with F64 weights: then everything runs
// in F64 (the CPU backend computes F64 outputs in plain double math: FP64 gradient checks).
DType act_dtype_for(const Backend& be, const ModelWeights& w) {
  return w.embed.dtype() == DType::F64 ? DType::F64 : be.act_dtype();
}
// Per-row statistics (rstd, lse, logp, entropy) are F32, or F64 when activations are F64.
DType stat_dtype_for(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

Tensor upload_i32(Backend& be, const std::vector<int32_t>& v) {
  Tensor host = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  for (size_t i = 0; i < v.size(); ++i) host.data<int32_t>()[i] = v[i];
  return be.to_device(host);
}

LinearSpec block_spec(const EnginePrecision& p, int layer, int num_layers) {
  return LinearSpec{p.linear_for_layer(layer, num_layers), p.pow2_scales, p.wgrad,
                    p.consistent && p.consistent_linears};
}

const LinearSpec kFp32Spec{LinearMode::FP32, false};

// The lm_head's numerics follow the activation dtype: FP32 with F32 / F64 activations (the
// exact path: CPU reference, `fp8rl logprobs`, the CUDA backend made with F32 activations);
// with BF16 activations (the CUDA fast path) the hidden state is already BF16, so the head is a
// BF16 x BF16 tensor-core GEMM with FP32 accumulation (the weight rounded to BF16 once per
// call) rather than an FP32 GEMM on the hidden state converted back to F32, which at a 128k
// vocabulary would be the most expensive GEMM of the step.
LinearSpec head_spec_for(DType act, bool consistent) {
  LinearSpec s = act == DType::BF16 ? LinearSpec{LinearMode::BF16, false} : kFp32Spec;
  s.consistent = consistent;
  return s;
}

// Sets slots [e - 1] of every sequence of a [T] tensor to 0 (positions without a target).
void zero_last_tokens(Backend& be, Tensor& t, const std::vector<int32_t>& cu_seqlens) {
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    if (cu_seqlens[b + 1] == cu_seqlens[b]) continue;
    Tensor last = t.slice_rows(cu_seqlens[b + 1] - 1, cu_seqlens[b + 1]);
    be.fill(last, 0.0f);
  }
}

void check_weights_on(const Backend& be, const ModelWeights& w) {
  FP8RL_CHECK(w.embed.defined() && w.embed.device() == be.device(), "model weights must be on the ",
              be.name(), " backend's device (use model_weights_to_device)");
  FP8RL_CHECK(static_cast<int>(w.layers.size()) == w.config.num_layers, "weights have ", w.layers.size(),
              " layers but the config says ", w.config.num_layers);
}

// The attention step of one block: given a.q [T, Hq, hd], a.k, a.v [T, Hkv, hd] (after
// q/k-norm and RoPE), writes a.attn [T, Hq, hd] (and whatever the step saves, e.g. a.lse).
// MLA blocks: the step also says what the projections hand it. Expanded (training): q, k, v
// per head as above. Latent (mla_latent, generation's absorbed attention): a.q [T, H, qk], the
// normed latent a.kv_latn [T, kvr] and the roped shared key a.rope_k [T, 1, r]; kv_b is not run.
// mla_kv_round (per layer, empty: none): the latent and the rope key rounded as an E4M3 latent
// cache with that layer's scale stores them, before kv_b (the trainer of a generator whose MLA
// cache is E4M3; gradients pass straight through).
struct AttentionStep {
  std::function<void(int layer, LayerActivations& a)> run;
  bool mla_latent = false;
  std::vector<float> mla_kv_round;
  bool fp8_out = false;  // run writes a.attn_fp8 too when it is defined (attention_paged's out_fp8)
  // The generator's paged cache and batch (null elsewhere): a block with q/k-norm has its
  // products write k and v into the cache (linear_qkv_norm_rope's KV destination) and sets
  // a.kv_written, so run does not write them again.
  KvCache* kv_cache = nullptr;
  const PagedBatch* kv_batch = nullptr;
};

// What the mixture-of-experts blocks of one forward replay and record (each may be null):
// replay (ForwardOptions::replay_routing), the experts each token used, and the router's own
// top-k (recorded under a replay, where it differs from the used experts).
// device_plan (the generator's blocks): the experts' rows sorted on the device (moe_plan, no
// download: the block never waits for the host) unless a host record or a replay asks for the
// experts on the host; used_device, if set, then receives the used experts of MoE block m in its
// row m ([MoE layers, T * k] I32 on the device).
struct MoeRoutingIo {
  const MoeRouting* replay = nullptr;
  MoeRouting* used = nullptr;
  MoeRouting* own = nullptr;
  bool device_plan = false;
  Tensor* used_device = nullptr;
};

// Allocates the buffers of one block for T tokens (x, the block input, is set by the caller):
// those of the attention and, for the MLP, the dense or the mixture-of-experts ones. Buffers
// already defined are kept (the generation forward reuses one set across blocks of both kinds).
// mla_latent: an MLA block's expanded k, v (and kv_b's output) are not needed (generation).
void alloc_layer(Backend& be, const ModelConfig& c, DType act, int64_t T, bool moe, bool mla_latent,
                 LayerActivations& a) {
  const DType st = stat_dtype_for(act);
  const int64_t D = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  if (!a.xn_attn.defined() && c.is_mla()) {
    const int64_t H = c.num_heads, qk = c.qk_head_dim(), dv = c.v_head_dim, r = c.qk_rope_head_dim;
    const int64_t kvr = c.kv_lora_rank, qr = c.q_lora_rank;
    a.attn_rstd = be.alloc({T}, st);
    a.xn_attn = be.alloc({T, D}, act);
    if (qr > 0) {
      a.q_a = be.alloc({T, qr}, act);
      a.q_a_rstd = be.alloc({T}, st);
      a.q_an = be.alloc({T, qr}, act);
    }
    a.kv_a = be.alloc({T, kvr + r}, act);
    a.kv_lat = be.alloc({T, kvr}, act);
    a.kv_rstd = be.alloc({T}, st);
    a.kv_latn = be.alloc({T, kvr}, act);
    a.rope_q = be.alloc({T, H, r}, act);
    a.rope_k = be.alloc({T, 1, r}, act);
    a.q = be.alloc({T, H, qk}, act);
    if (!mla_latent) {
      a.kv_b = be.alloc({T, H * (c.qk_nope_head_dim + dv)}, act);
      a.k = be.alloc({T, H, qk}, act);
      a.v = be.alloc({T, H, dv}, act);
    }
    a.attn = be.alloc({T, H, dv}, act);
    a.x_mid = be.alloc({T, D}, act);
    a.mlp_rstd = be.alloc({T}, st);
    a.xn_mlp = be.alloc({T, D}, act);
    a.proj = be.alloc({T, D}, act);
  }
  if (!a.xn_attn.defined()) {
    a.attn_rstd = be.alloc({T}, st);
    a.xn_attn = be.alloc({T, D}, act);
    if (c.qk_norm) {
      a.q_raw = be.alloc({T, Hq * hd}, act);
      a.k_raw = be.alloc({T, Hkv * hd}, act);
      a.q_rstd = be.alloc({T * Hq}, st);
      a.k_rstd = be.alloc({T * Hkv}, st);
    }
    a.q = be.alloc({T, Hq, hd}, act);
    a.k = be.alloc({T, Hkv, hd}, act);
    a.v = be.alloc({T, Hkv, hd}, act);
    a.attn = be.alloc({T, Hq, hd}, act);
    a.x_mid = be.alloc({T, D}, act);
    a.mlp_rstd = be.alloc({T}, st);
    a.xn_mlp = be.alloc({T, D}, act);
    a.proj = be.alloc({T, D}, act);
  }
  if (!moe && !a.gate.defined()) {
    a.gate = be.alloc({T, F}, act);
    a.up = be.alloc({T, F}, act);
    a.act = be.alloc({T, F}, act);
  }
  if (moe && c.n_shared_experts > 0 && !a.shared_out.defined()) {  // the shared experts' buffers
    const int64_t Fs = int64_t(c.n_shared_experts) * c.moe_intermediate_size;
    a.shared_gate = be.alloc({T, Fs}, act);
    a.shared_up = be.alloc({T, Fs}, act);
    a.shared_act = be.alloc({T, Fs}, act);
    a.shared_out = be.alloc({T, D}, act);
  }
  if (moe && !a.moe_x.defined()) {
    const int64_t E = c.num_experts, k = c.num_experts_per_tok, R = T * k, Fe = c.moe_intermediate_size;
    const DType rt = act == DType::F64 ? DType::F64 : DType::F32;  // the router runs in FP32
    a.router_x = rt == act ? a.xn_mlp : be.alloc({T, D}, rt);
    a.router_logits = be.alloc({T, E}, rt);
    a.moe_experts = be.alloc({T, k}, DType::I32);
    a.moe_weights = be.alloc({T, k}, st);
    a.moe_row_slot = be.alloc({R}, DType::I32);
    a.moe_slot_row = be.alloc({R}, DType::I32);
    a.moe_x = be.alloc({R, D}, act);
    a.moe_gate = be.alloc({R, Fe}, act);
    a.moe_up = be.alloc({R, Fe}, act);
    a.moe_act = be.alloc({R, Fe}, act);
    a.moe_y = be.alloc({R, D}, act);
  }
}

// Routing replay of one MoE block (moe_index m): the tokens with a replayed row take its experts
// (host `ex` [T * k], the router's own on entry), uploaded into a.moe_experts; the weights are
// recomputed from the router logits over them, as the model's routing weights them.
void moe_replay_routing(Backend& be, const ModelConfig& c, const MoeRouting& replay, int m, Tensor& experts,
                        LayerActivations& a) {
  const int64_t T = a.moe_experts.dim(0), E = c.num_experts, k = c.num_experts_per_tok;
  FP8RL_CHECK(replay.top_k == k && m < static_cast<int>(replay.ids.size()) &&
                  static_cast<int64_t>(replay.ids[m].size()) == T * k,
              "routing replay: MoE layer ", m, " needs ", T, " tokens x top-", k, " experts, got ",
              m < static_cast<int>(replay.ids.size()) ? replay.ids[m].size() : 0, " ids of top-", replay.top_k);
  const int32_t* rep = replay.ids[m].data();
  int32_t* ex = experts.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (rep[t * k] < 0) continue;  // not recorded: the router's own top-k
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = rep[t * k + j];
      FP8RL_CHECK(e >= 0 && e < E, "routing replay: token ", t, " of MoE layer ", m, " has expert ", e,
                  " outside [0, ", E, ")");
      for (int64_t i = 0; i < j; ++i)
        FP8RL_CHECK(rep[t * k + i] != e, "routing replay: token ", t, " of MoE layer ", m, " has expert ", e,
                    " twice");
      ex[t * k + j] = e;
    }
  }
  be.copy(experts, a.moe_experts);
  if (c.moe_router == "sigmoid")
    be.moe_route_sigmoid_weights(a.router_logits, a.moe_experts, c.norm_topk_prob, c.routed_scaling_factor,
                                 a.moe_weights);
  else
    be.moe_route_softmax_weights(a.router_logits, a.moe_experts, c.norm_topk_prob, a.moe_weights);
}

// The mixture-of-experts MLP of one block (the m-th MoE layer): a.proj [T, D] = sum_j w_j
// expert_j(a.xn_mlp).
// 1. router logits in FP32 and the top-k routing (on the device); under a replay, the replayed
//    experts and their weights from the same logits (moe_replay_routing);
// 2. the slots sorted by expert on the host (stable: token order within an expert);
// 3. permute, each expert's SwiGLU on its rows, the weighted un-permute.
void moe_forward(Backend& be, const ModelConfig& c, const LayerWeights& lw, const LinearSpec& spec, int m,
                 const MoeRoutingIo& io, const Fp8View* xq, LayerActivations& a) {
  const int64_t T = a.xn_mlp.dim(0), E = c.num_experts, k = c.num_experts_per_tok, R = T * k;
  if (a.router_x.storage() != a.xn_mlp.storage()) be.convert(a.xn_mlp, a.router_x);
  be.linear(a.router_x, lw.router, kFp32Spec, a.router_logits);
  if (c.moe_router == "sigmoid") {
    be.moe_route_sigmoid(a.router_logits, lw.router_bias.defined() ? &lw.router_bias : nullptr, static_cast<int>(k),
                         c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, a.moe_experts,
                         a.moe_weights);
  } else {
    be.moe_route_softmax(a.router_logits, static_cast<int>(k), c.norm_topk_prob, a.moe_experts, a.moe_weights);
  }

  const bool planned = io.device_plan && !io.replay && !io.own && !io.used;
  if (planned) {  // sorted on the device; the host never learns the rows
    Backend::MoeDevicePlan& plan = a.moe_plan;
    plan.block_m = be.moe_plan_block_m(R, E);
    const int64_t max_tiles = moe_plan_max_tiles(R, E, plan.block_m);
    if (!plan.offsets.defined()) plan.offsets = be.alloc({E + 1}, DType::I32);
    if (!plan.tile_count.defined()) plan.tile_count = be.alloc({1}, DType::I32);
    if (!plan.tiles.defined() || plan.tiles.dim(0) != max_tiles) plan.tiles = be.alloc({max_tiles, 4}, DType::I32);
    be.moe_plan(a.moe_experts, E, plan.block_m, plan.offsets, a.moe_row_slot, a.moe_slot_row, plan.tiles,
                plan.tile_count);
    if (io.used_device) {
      Tensor dst = io.used_device->slice_rows(m, m + 1).reshape({R});
      be.copy(a.moe_experts.reshape({R}), dst);
    }
    a.moe_offsets.clear();
  } else {
    Tensor experts = be.to_host(a.moe_experts);  // the host sizes the expert GEMMs
    if (io.own) io.own->ids[m].assign(experts.data<int32_t>(), experts.data<int32_t>() + R);
    if (io.replay) moe_replay_routing(be, c, *io.replay, m, experts, a);
    if (io.used) io.used->ids[m].assign(experts.data<int32_t>(), experts.data<int32_t>() + R);
    MoeSlotSort sorted = moe_sort_slots(experts.data<int32_t>(), R, E);
    a.moe_offsets = std::move(sorted.offsets);
    Tensor row_slot = Tensor::empty({R}, DType::I32), slot_row = Tensor::empty({R}, DType::I32);
    std::copy(sorted.row_slot.begin(), sorted.row_slot.end(), row_slot.data<int32_t>());
    std::copy(sorted.slot_row.begin(), sorted.slot_row.end(), slot_row.data<int32_t>());
    be.copy(row_slot, a.moe_row_slot);
    be.copy(slot_row, a.moe_slot_row);
  }

  // FP8: the experts' input rows gathered from xn_mlp's FP8 copy (xq, written by the norm) with
  // the BF16 rows: T rows quantized, not k T.
  Fp8View moe_xq;
  if (xq) {
    moe_xq = be.alloc_fp8_view(R, a.moe_x.dim(1), spec.pow2_scales);
    be.moe_permute_fp8(a.xn_mlp, xq, a.moe_row_slot, static_cast<int>(k), nullptr, a.moe_x, moe_xq);
  } else {
    be.moe_permute(a.xn_mlp, a.moe_row_slot, static_cast<int>(k), nullptr, a.moe_x);
  }
  // Every expert's SwiGLU over its rows: gate and up (grouped_linear_shared_input: two grouped
  // products), down, each one launch on CUDA FP8; one swiglu over all rows (element-wise: the
  // per-expert values).
  std::vector<const LinearWeight*> gates, ups, downs;
  for (int64_t e = 0; e < E; ++e) {
    gates.push_back(&lw.experts[e].gate);
    ups.push_back(&lw.experts[e].up);
    downs.push_back(&lw.experts[e].down);
  }
  if (planned)
    be.grouped_linear_planned(a.moe_x, a.moe_plan, {gates, ups}, spec, {&a.moe_gate, &a.moe_up},
                              xq ? &moe_xq : nullptr);
  else
    be.grouped_linear_shared_input(a.moe_x, a.moe_offsets, {gates, ups}, spec, {&a.moe_gate, &a.moe_up},
                                   xq ? &moe_xq : nullptr);
  Fp8View act_q;
  if (spec.mode == LinearMode::FP8_BLOCK) {  // the SwiGLU writes the down products' FP8 input too
    act_q = be.alloc_fp8_view(R, a.moe_act.dim(1), spec.pow2_scales);
    be.swiglu_fp8(a.moe_gate, a.moe_up, a.moe_act, act_q);
  } else {
    be.swiglu(a.moe_gate, a.moe_up, a.moe_act);
  }
  const Fp8View* down_q = act_q.defined() ? &act_q : nullptr;
  if (planned) be.grouped_linear_planned(a.moe_act, a.moe_plan, {downs}, spec, {&a.moe_y}, down_q);
  else be.grouped_linear(a.moe_act, a.moe_offsets, downs, spec, a.moe_y, down_q);
  const Tensor w = a.moe_weights.reshape({R});
  be.moe_unpermute(a.moe_y, a.moe_slot_row, &w, a.proj);
  if (lw.gate.w.defined() || lw.gate.wq.defined()) {  // always-on shared experts (DeepSeek)
    be.linear_shared_input(a.xn_mlp, {&lw.gate, &lw.up}, spec, {&a.shared_gate, &a.shared_up}, xq);
    if (spec.mode == LinearMode::FP8_BLOCK) {
      Fp8View act_q = be.alloc_fp8_view(T, a.shared_act.dim(1), spec.pow2_scales);
      be.swiglu_fp8(a.shared_gate, a.shared_up, a.shared_act, act_q);
      be.linear(a.shared_act, lw.down, spec, a.shared_out, &act_q);
    } else {
      be.swiglu(a.shared_gate, a.shared_up, a.shared_act);
      be.linear(a.shared_act, lw.down, spec, a.shared_out);
    }
    be.add(a.proj, a.shared_out, a.proj);
  }
}

// HF's DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are built without the
// config's rms_norm_eps.
constexpr float kMlaNormEps = 1e-6f;

// The spec of an MLA projection: the block's, or BF16 where model_linear_mode keeps it BF16.
LinearSpec mla_spec(const ModelConfig& c, const LinearSpec& block, const LinearWeight& W) {
  LinearSpec s = block;
  if (s.mode == LinearMode::FP8_BLOCK && mla_projection_kept_bf16(c, W.out_features(), W.in_features()))
    s.mode = LinearMode::BF16;
  return s;
}

// The q/k/v amax of every block, collected on the device (Backend::amax accumulates into a slot)
// and read once after the forward: acc F32 [L, 3] zero-filled, row `layer` the block running.
struct QkvAmax {
  Tensor acc;
  int layer = 0;
  void add(Backend& be, const Tensor& x, int j) { be.amax(x, acc, 3 * int64_t{layer} + j); }  // j: 0 q, 1 k, 2 v
};

// MLA's q, k, v (after RoPE) from a.xn_attn: a.q [T, H, qk], a.k [T, H, qk], a.v [T, H, dv];
// with `latent` only a.q, a.kv_latn [T, kvr] and a.rope_k [T, 1, r] (what a latent cache
// holds: kv_b is not run). xq: xn_attn's FP8 copy, used by the projections that run FP8.
// amax: k's is the amax of the cached row [latent | rope key], v's of the latent (V is the
// latent): they size the latent cache's one scale. kv_round > 0: the latent and the rope key are
// rounded as an E4M3 latent cache with that scale stores them, after the amax, before kv_b.
void mla_qkv(Backend& be, const ModelConfig& c, const LayerWeights& lw, const LinearSpec& spec,
             const Tensor& positions, const RopeParams& rope, const Fp8View* xq, bool latent, float kv_round,
             QkvAmax* amax, LayerActivations& a) {
  const int64_t T = a.xn_attn.dim(0), H = c.num_heads, nope = c.qk_nope_head_dim, r = c.qk_rope_head_dim;
  const int64_t qk = c.qk_head_dim(), dv = c.v_head_dim, kvr = c.kv_lora_rank;
  Tensor q2 = a.q.reshape({T, H * qk});
  if (c.q_lora_rank > 0) {
    be.linear(a.xn_attn, lw.q_a, mla_spec(c, spec, lw.q_a), a.q_a, xq);
    be.rmsnorm(a.q_a, lw.q_a_norm, kMlaNormEps, a.q_an, &a.q_a_rstd);
    be.linear(a.q_an, lw.q_b, mla_spec(c, spec, lw.q_b), q2);
  } else {
    be.linear(a.xn_attn, lw.q, mla_spec(c, spec, lw.q), q2, xq);
  }
  Tensor qh = a.q.reshape({T * H, qk}), rq = a.rope_q.reshape({T * H, r});
  be.copy_cols(qh, nope, rq, 0, r);
  be.rope(a.rope_q, positions, rope, /*inverse=*/false);
  be.copy_cols(rq, 0, qh, nope, r);

  be.linear(a.xn_attn, lw.kv_a, mla_spec(c, spec, lw.kv_a), a.kv_a, xq);
  be.copy_cols(a.kv_a, 0, a.kv_lat, 0, kvr);
  be.rmsnorm(a.kv_lat, lw.kv_a_norm, kMlaNormEps, a.kv_latn, &a.kv_rstd);
  Tensor rk = a.rope_k.reshape({T, r});
  be.copy_cols(a.kv_a, kvr, rk, 0, r);
  be.rope(a.rope_k, positions, rope, /*inverse=*/false);
  if (amax) {
    amax->add(be, a.q, 0);
    amax->add(be, a.kv_latn, 1);
    amax->add(be, a.rope_k, 1);
    amax->add(be, a.kv_latn, 2);
  }
  if (kv_round > 0.0f) {
    Tensor lat3 = a.kv_latn.reshape({T, 1, kvr});
    be.kv_round(lat3, {kv_round});
    be.kv_round(a.rope_k, {kv_round});
  }
  if (latent) return;
  be.linear(a.kv_latn, lw.kv_b, mla_spec(c, spec, lw.kv_b), a.kv_b);
  const Tensor kvh = a.kv_b.reshape({T * H, nope + dv});
  Tensor kh = a.k.reshape({T * H, qk}), vh = a.v.reshape({T * H, dv}), k2 = a.k.reshape({T, H * qk});
  be.copy_cols(kvh, 0, kh, 0, nope);
  be.copy_cols(kvh, nope, vh, 0, dv);
  for (int64_t h = 0; h < H; ++h) be.copy_cols(rk, 0, k2, h * qk + nope, r);  // the shared rotary key
}

// The attention norm of the block that follows, carried out by this block's closing residual
// add (add_rmsnorm: the values of add then rmsnorm(_fp8), bit for bit) in the forward that reuses
// one set of buffers for every block (no saved activations): `normed` says the block's input is
// already normed into a.xn_attn / a.attn_rstd and, for FP8 linears, into xq; `next_norm` is the
// next block's weight (null: the last block, or a saving forward) and next_fp8 whether its
// linears take the FP8 copy. One launch fewer per block.
struct BlockNormCarry {
  bool normed = false;
  Fp8View xq;
  const Tensor* next_norm = nullptr;
  bool next_fp8 = false;
};

// One transformer block: fills `a` (its activations, buffers allocated here) from the block
// input x [T, D] and writes the block output into x_next [T, D] (may be x itself).
// for_backward: a.gate and a.up are kept (the backward's inputs); otherwise the MLP's two
// products may stay in the backend's scratch (linear_swiglu's keep). carry: BlockNormCarry.
void forward_block(Backend& be, const ModelWeights& w, const EnginePrecision& prec, int l, const Tensor& x,
                   const Tensor& positions, const AttentionStep& attention, const MoeRoutingIo& routing,
                   QkvAmax* amax, bool for_backward, LayerActivations& a, Tensor& x_next,
                   BlockNormCarry* carry = nullptr) {
  const ModelConfig& c = w.config;
  const int L = c.num_layers;
  const int64_t T = x.dim(0), hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  const RopeParams rope = c.rope_params();
  const LayerWeights& lw = w.layers[l];
  const LinearSpec spec = block_spec(prec, l, L);
  alloc_layer(be, c, x.dtype(), T, c.layer_is_moe(l), c.is_mla() && attention.mla_latent, a);
  a.x = x;
  if (amax) amax->layer = l;
  // FP8 linears: the norms and the SwiGLU write their output's FP8 copy too (xq: of xn_attn,
  // then of xn_mlp; hq: of act), which the linears take instead of quantizing their input.
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  const bool normed = carry && carry->normed;
  Fp8View xq = !fp8                          ? Fp8View{}
               : normed && carry->xq.defined() ? carry->xq
                                               : be.alloc_fp8_view(T, c.hidden_size, spec.pow2_scales);
  Fp8View* xq_or_null = fp8 ? &xq : nullptr;

  // ---- attention ----
  if (normed) {
    FP8RL_CHECK(!fp8 || (carry->xq.defined() && carry->xq.source == a.xn_attn.raw()),
                "forward: block ", l, "'s normed input has no FP8 copy of its own (the carry's next_fp8 was wrong)");
  } else if (fp8) {
    be.rmsnorm_fp8(x, lw.attn_norm, c.rms_norm_eps, a.xn_attn, &a.attn_rstd, xq);
  } else {
    be.rmsnorm(x, lw.attn_norm, c.rms_norm_eps, a.xn_attn, &a.attn_rstd);
  }
  if (c.is_mla()) {  // q [T, H, qk], k [T, H, qk], v [T, H, dv] (or the latent: AttentionStep)
    const float kv_round = attention.mla_kv_round.empty() ? 0.0f : attention.mla_kv_round[static_cast<size_t>(l)];
    mla_qkv(be, c, lw, spec, positions, rope, xq_or_null, attention.mla_latent, kv_round, amax, a);
  } else {
    Tensor q2 = a.q.reshape({T, Hq * hd}), k2 = a.k.reshape({T, Hkv * hd}), v2 = a.v.reshape({T, Hkv * hd});
    a.kv_written = false;
    if (c.qk_norm) {
      // The products, then q/k-norm and RoPE in one pass each (the values of rmsnorm then rope);
      // q_raw and k_raw kept only for the backward. The generator's cache write too.
      Backend::KvDest kv{attention.kv_cache, l, attention.kv_batch};
      be.linear_qkv_norm_rope(a.xn_attn, lw.q, lw.k, lw.v, spec, lw.q_norm, lw.k_norm, c.rms_norm_eps, positions, rope,
                              for_backward, a.q_raw, a.k_raw, a.q, a.k, v2, &a.q_rstd, &a.k_rstd, xq_or_null,
                              attention.kv_cache ? &kv : nullptr);
      a.kv_written = attention.kv_cache != nullptr;
    } else {
      be.linear_shared_input(a.xn_attn, {&lw.q, &lw.k, &lw.v}, spec, {&q2, &k2, &v2}, xq_or_null);
      be.rope(a.q, positions, rope, /*inverse=*/false);
      be.rope(a.k, positions, rope, /*inverse=*/false);
    }
  }
  if (amax && !c.is_mla()) {
    amax->add(be, a.q, 0);
    amax->add(be, a.k, 1);
    amax->add(be, a.v, 2);
  }
  // FP8 o projection: an attention step that can write its output's FP8 copy (the generator's
  // paged one) is handed a view for it (AttentionStep::fp8_out), which the product then reads.
  a.attn_fp8 = fp8 && attention.fp8_out && !c.is_mla() ? be.alloc_fp8_view(T, Hq * hd, spec.pow2_scales) : Fp8View{};
  attention.run(l, a);
  if (c.is_mla())
    be.linear(a.attn.reshape({T, Hq * c.v_head_dim}), lw.o, mla_spec(c, spec, lw.o), a.proj);
  else
    be.linear(a.attn.reshape({T, Hq * hd}), lw.o, spec, a.proj, a.attn_fp8.defined() ? &a.attn_fp8 : nullptr);

  // ---- MLP ---- (the residual add and the norm in one op; the MoE MLP permutes xn_mlp's rows
  // first, so its experts quantize their own inputs)
  const bool moe = c.layer_is_moe(l);
  be.add_rmsnorm(x, a.proj, a.x_mid, lw.mlp_norm, c.rms_norm_eps, a.xn_mlp, &a.mlp_rstd, xq_or_null);
  if (moe) {
    FP8RL_CHECK(lw.is_moe() && lw.router.w.defined(), "layer ", l, " is a mixture-of-experts layer but its "
                "weights have no router/experts");
    int m = 0;  // this block's index among the MoE layers
    for (int i = 0; i < l; ++i) m += c.layer_is_moe(i) ? 1 : 0;
    moe_forward(be, c, lw, spec, m, routing, xq_or_null, a);
  } else {
    if (fp8) {
      Fp8View hq = be.alloc_fp8_view(T, a.act.dim(1), spec.pow2_scales);
      be.linear_swiglu(a.xn_mlp, lw.gate, lw.up, spec, a.gate, a.up, for_backward, a.act, &hq, xq_or_null);
      be.linear(a.act, lw.down, spec, a.proj, &hq);
    } else {
      be.linear_swiglu(a.xn_mlp, lw.gate, lw.up, spec, a.gate, a.up, for_backward, a.act, nullptr, xq_or_null);
      be.linear(a.act, lw.down, spec, a.proj);
    }
  }
  if (carry && carry->next_norm) {
    // The next block's attention norm (into this set of buffers, which it reuses) with the add.
    carry->xq = !carry->next_fp8 ? Fp8View{}
                : xq.defined()   ? xq  // consumed by this block's products already
                                 : be.alloc_fp8_view(T, c.hidden_size, prec.pow2_scales);
    be.add_rmsnorm(a.x_mid, a.proj, x_next, *carry->next_norm, c.rms_norm_eps, a.xn_attn, &a.attn_rstd,
                   carry->next_fp8 ? &carry->xq : nullptr);
    carry->normed = true;
  } else {
    be.add(a.x_mid, a.proj, x_next);
    if (carry) carry->normed = false;
  }
}

// THE layer loop, shared by both forwards. x [T, D] is the residual stream after the
// embedding; on return `out` [T, D] holds the residual stream after the last block.
// saved != null: every block keeps its own buffers in (*saved)[l] (scoring forward), or with
// `inputs_only` just its input x (block recomputation); otherwise one set of buffers is reused
// and x is updated in place.
void forward_layers(Backend& be, const ModelWeights& w, const EnginePrecision& prec, const Tensor& x_in,
                    const Tensor& positions, const AttentionStep& attention, const MoeRoutingIo& routing,
                    std::vector<LayerActivations>* saved, bool inputs_only, QkvAmax* amax, Tensor& out) {
  const int L = w.config.num_layers;
  LayerActivations scratch;
  if (saved) saved->assign(L, LayerActivations{});
  for (MoeRouting* r : {routing.used, routing.own})
    if (r) {
      r->top_k = w.config.num_experts_per_tok;
      r->ids.assign(static_cast<size_t>(model_num_moe_layers(w.config)), {});
    }
  Tensor x = x_in;  // [T, D] residual stream
  BlockNormCarry carry;  // without saving: each block's closing add does the next one's norm
  for (int l = 0; l < L; ++l) {
    LayerActivations& a = saved && !inputs_only ? (*saved)[l] : scratch;
    // Saving: the next block's input is a new tensor (this block's x stays intact).
    Tensor x_next = saved ? be.alloc(x.shape(), x.dtype()) : x;
    carry.next_norm = !saved && l + 1 < L ? &w.layers[l + 1].attn_norm : nullptr;
    carry.next_fp8 = carry.next_norm && block_spec(prec, l + 1, L).mode == LinearMode::FP8_BLOCK;
    forward_block(be, w, prec, l, x, positions, attention, routing, amax, saved && !inputs_only, a, x_next,
                  saved ? nullptr : &carry);
    if (saved && inputs_only) (*saved)[l].x = x;
    x = x_next;
  }
  out = x;
}

// The consistent mode's attention step (EnginePrecision::consistent): each query attends exactly
// as it does in generation. k and v are written with kv_write into a paged cache of the
// generator's KV dtype (scales: the rollout's, per layer; pages of 16 positions, one run of pages
// per sequence) and every token is a query of attention_paged over it (batch_invariant: the
// generator's kernel and split of the positions), which also gives the lse the usual attention
// backward takes. Then k and v are rounded as that cache holds them (kv_round for E4M3, a round
// trip through the cache dtype otherwise), so the backward sees the values the forward attended
// over; gradients pass straight through the rounding, as with the trainer's KV rounding.
struct ConsistentKv {
  KvCache cache;              // one layer: K and V pools [pages, 16, Hkv, hd] of the cache dtype (first use)
  DType dtype = DType::BF16;  // the cache dtype (dtype_of_k: set at the first layer)
  int pages = 1;
  Tensor k_scale, v_scale;    // F32 [L, Hkv]: layer l's scales in row l
  std::vector<float> k_host, v_host;  // [L] the same, on the host (kv_round)
  PagedBatch batch;           // every token of the forward batch as a query at its position
  int64_t T = 0;
  bool dtype_of_k = false;    // the cache takes k's own dtype (no rounding)
};

// kv_k / kv_v: the rollout's per-layer scales of an E4M3 cache. Without them (an E4M3 recipe
// before set_kv_rounding, e.g. the calibration that precedes the first rollout) the cache takes
// the activations' own dtype: k and v unrounded, as the usual trainer does then.
std::shared_ptr<ConsistentKv> consistent_kv_alloc(Backend& be, const ModelConfig& c, DType cache_dtype,
                                                  const ForwardBatch& batch, const std::vector<float>& kv_k,
                                                  const std::vector<float>& kv_v) {
  constexpr int kPage = 16;
  auto s = std::make_shared<ConsistentKv>();
  const int L = c.num_layers, Hkv = c.num_kv_heads, B = batch.num_sequences();
  s->T = batch.num_tokens();
  s->dtype = cache_dtype;
  s->dtype_of_k = cache_dtype == DType::E4M3 && kv_k.empty();
  s->k_host = kv_k.empty() ? std::vector<float>(L, 1.0f) : kv_k;
  s->v_host = kv_v.empty() ? std::vector<float>(L, 1.0f) : kv_v;
  std::vector<int32_t> first_page(B + 1, 0);
  int max_pages = 1, max_len = 1;
  for (int b = 0; b < B; ++b) {
    const int n = batch.cu_seqlens[b + 1] - batch.cu_seqlens[b];
    const int pages = (n + kPage - 1) / kPage;
    first_page[b + 1] = first_page[b] + pages;
    max_pages = std::max(max_pages, pages);
    max_len = std::max(max_len, n);
  }
  std::vector<int32_t> seq(s->T), pos(s->T), slots(s->T), table(static_cast<size_t>(B) * max_pages, 0);
  for (int b = 0; b < B; ++b) {
    for (int p = 0; p < first_page[b + 1] - first_page[b]; ++p)
      table[static_cast<size_t>(b) * max_pages + p] = first_page[b] + p;
    for (int32_t t = batch.cu_seqlens[b]; t < batch.cu_seqlens[b + 1]; ++t) {
      const int32_t p = batch.positions[t];
      FP8RL_CHECK(p == t - batch.cu_seqlens[b], "the consistent mode scores whole sequences from position 0 (token ",
                  t, " has position ", p, ")");
      seq[t] = b;
      pos[t] = p;
      slots[t] = (first_page[b] + p / kPage) * kPage + p % kPage;
    }
  }
  s->pages = std::max(1, first_page[B]);
  Tensor ks = Tensor::empty({L, Hkv}, DType::F32), vs = Tensor::empty({L, Hkv}, DType::F32);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < Hkv; ++h) {
      ks.data<float>()[l * Hkv + h] = s->k_host[l];
      vs.data<float>()[l * Hkv + h] = s->v_host[l];
    }
  s->k_scale = be.to_device(ks);
  s->v_scale = be.to_device(vs);
  s->batch.token_seq = upload_i32(be, seq);
  s->batch.token_pos = upload_i32(be, pos);
  s->batch.slots = upload_i32(be, slots);
  s->batch.page_table = upload_i32(be, table).reshape({B, max_pages});
  s->batch.max_pos = max_len;
  s->batch.batch_invariant = true;
  // Every sequence is scored whole: its tokens in runs of up to kQueryRunColumns / group (the CUDA
  // tensor-core kernel's MMA columns of (token, head) pairs), each run's K/V read once for all its
  // tokens.
  // FP8RL_QUERY_RUN_COLUMNS=8, 16 or 64 (read once): runs of one or two MMA column blocks, or of
  // eight (the CUDA wide query-run CTAs, the default kQueryRunColumns, backend.h), for A/B; any
  // run width gives the same bits.
  static const int run_columns = [] {
    const char* e = std::getenv("FP8RL_QUERY_RUN_COLUMNS");
    if (!e) return kQueryRunColumns;
    const std::string v = e;
    FP8RL_CHECK(v == "8" || v == "16" || v == "64", "FP8RL_QUERY_RUN_COLUMNS must be 8, 16 or 64, got '", v,
                "'; unset it for the default (", kQueryRunColumns, ")");
    return std::stoi(v);
  }();
  const int group = c.num_heads / std::max(1, Hkv);
  const int run = group >= 1 && group <= run_columns ? run_columns / group : 1;
  std::vector<int32_t> runs;
  for (int b = 0; b < B; ++b)
    for (int32_t t = batch.cu_seqlens[b]; t < batch.cu_seqlens[b + 1]; t += run) {
      runs.push_back(t);
      runs.push_back(std::min<int32_t>(run, batch.cu_seqlens[b + 1] - t));
    }
  if (!runs.empty()) {
    s->batch.query_runs = upload_i32(be, runs).reshape({static_cast<int64_t>(runs.size() / 2), 2});
    s->batch.query_run_tokens = run;
  }
  return s;
}

// x [T, H, hd] rounded in place to the value a cache of `dtype` (with per-layer `scale` when
// E4M3) hands the attention.
void round_as_cache(Backend& be, Tensor& x, DType dtype, float scale) {
  if (dtype == DType::E4M3) {
    be.kv_round(x, std::vector<float>(static_cast<size_t>(x.dim(1)), scale));
  } else if (dtype_size(dtype) < dtype_size(x.dtype())) {  // e.g. a BF16 cache under F32 activations
    Tensor tmp = be.alloc(x.shape(), dtype);
    be.convert(x, tmp);
    be.convert(tmp, x);
  }
}

// The training forward's attention step (causal over the batch's packed sequences; lse saved).
// With kv_round_k/v (per-layer E4M3 scales), k and v are first rounded as an E4M3 KV cache stores them.
// In the consistent mode: the paged step above (kv_round_k/v are then the cache's scales).
AttentionStep training_attention(Backend& be, const ModelConfig& c, const EnginePrecision& prec,
                                 const ForwardBatch& batch, DType st, const std::vector<float>& kv_round_k,
                                 const std::vector<float>& kv_round_v) {
  const float softmax_scale = c.softmax_scale();
  const int64_t T = batch.num_tokens();
  const bool round = !kv_round_k.empty();
  FP8RL_CHECK(!round || (static_cast<int>(kv_round_k.size()) == c.num_layers &&
                         static_cast<int>(kv_round_v.size()) == c.num_layers),
              "KV rounding needs one k and one v scale per layer (", c.num_layers, "), got ", kv_round_k.size(), " and ",
              kv_round_v.size());
  AttentionStep step;
  if (prec.consistent) model_check_consistent(c, prec);
  // consistent=flash: the trainer keeps flash attention (with the KV rounding below); the
  // generator's decode attention runs in its order (PagedBatch::flash_order).
  if (prec.consistent && !prec.consistent_flash) {
    std::shared_ptr<ConsistentKv> kv = consistent_kv_alloc(be, c, prec.kv_cache, batch, kv_round_k, kv_round_v);
    step.run = [&be, &c, st, softmax_scale, T, kv](int layer, LayerActivations& a) {
      if (!kv->cache.k.size()) {  // the pools, at the first layer (k's dtype known)
        if (kv->dtype_of_k) kv->dtype = a.k.dtype() == DType::F64 ? DType::F32 : a.k.dtype();
        kv->cache = be.alloc_kv_cache(1, kv->pages, 16, c.num_kv_heads, c.head_dim, kv->dtype);
      }
      KvCache lc = kv->cache;  // this layer's scales in the one-layer cache
      lc.k_scale = kv->k_scale.slice_rows(layer, layer + 1);
      lc.v_scale = kv->v_scale.slice_rows(layer, layer + 1);
      be.kv_write(lc, 0, a.k, a.v, kv->batch);
      if (!a.lse.defined()) a.lse = be.alloc({c.num_heads, T}, st);
      be.attention_paged(lc, 0, a.q, kv->batch, softmax_scale, false, a.attn, &a.lse);
      round_as_cache(be, a.k, kv->dtype, kv->k_host[static_cast<size_t>(layer)]);
      round_as_cache(be, a.v, kv->dtype, kv->v_host[static_cast<size_t>(layer)]);
    };
    return step;
  }
  // MLA: the cache holds the latent and the rope key, so those are what gets rounded (mla_qkv).
  if (round && c.is_mla()) step.mla_kv_round = kv_round_k;
  const bool round_kv = round && !c.is_mla();
  // consistent=flash with a cache narrower than the activations (a BF16 cache under F32 ones):
  // k and v as that cache holds them, as the paged branch's round_as_cache.
  const bool round_as_dtype = prec.consistent && !round_kv && prec.kv_cache != DType::E4M3;
  const DType cache_dtype = prec.kv_cache;
  step.run = [&be, &c, &batch, st, softmax_scale, T, round_kv, round_as_dtype, cache_dtype, &kv_round_k,
              &kv_round_v](int layer, LayerActivations& a) {
    if (round_kv) {
      be.kv_round(a.k, std::vector<float>(static_cast<size_t>(a.k.dim(1)), kv_round_k[static_cast<size_t>(layer)]));
      be.kv_round(a.v, std::vector<float>(static_cast<size_t>(a.v.dim(1)), kv_round_v[static_cast<size_t>(layer)]));
    } else if (round_as_dtype) {
      round_as_cache(be, a.k, cache_dtype, 1.0f);
      round_as_cache(be, a.v, cache_dtype, 1.0f);
    }
    if (!a.lse.defined()) a.lse = be.alloc({c.num_heads, T}, st);
    be.attention(a.q, a.k, a.v, batch.cu_seqlens, softmax_scale, a.attn, a.lse);
  };
  return step;
}

// ---- MLA generation: the absorbed attention over the latent cache ----
// Per token the cache holds one row [c | kr] (kvr + r values, shared by the H heads): c the
// normed latent (kv_a_layernorm's output), kr the roped shared key. With kv_b's rows of head h
// split into W_k [nope, kvr] (k_nope = c W_k^T) and W_v [dv, kvr] (v = c W_v^T), the expanded
// score q_nope . k_nope + q_rope . kr equals [q_nope W_k | q_rope] . [c | kr] and the output
// sum_j p_j v_j equals (sum_j p_j c_j) W_v^T. So: q_abs = [q_nope W_k | q_rope] per head, an MQA
// over the cache rows with V = c (attention_paged on a latent cache), then each head's W_v.
// The same function as the expanded form up to FP32 rounding order. kv_b runs unquantized
// (the generator keeps it BF16 / FP32, as vLLM dequantizes it for the absorption).
// Every head at once each way (mla_absorb: one strided batched GEMM on CUDA).
struct MlaLatentScratch {
  Tensor kv_row;  // [T, 1, kvr + r]  the rows written into the cache
  Tensor q_abs;   // [T, H, kvr + r]  absorbed queries
  Tensor o_lat;   // [T, H, kvr]      attention output in latent space
};

MlaLatentScratch mla_latent_scratch_alloc(Backend& be, const ModelConfig& c, DType act, int64_t T) {
  const int64_t H = c.num_heads, kvr = c.kv_lora_rank, r = c.qk_rope_head_dim;
  MlaLatentScratch s;
  s.kv_row = be.alloc({T, 1, kvr + r}, act);
  s.q_abs = be.alloc({T, H, kvr + r}, act);
  s.o_lat = be.alloc({T, H, kvr}, act);
  return s;
}

// The absorbed products (Backend::mla_absorb) run in FP32 on their operands as stored: q_nope
// and the latent output in the activation dtype, kv_b as the generator keeps it (BF16 under a
// BF16 / FP8 block, the trainer's rounding of the weight; the activation dtype under FP32).
// Rounding q_nope or the latent output to BF16 as well would add a rounding the trainer's
// expanded form does not have (measured: 2-5x the BF16 recipe's own mismatch on the fixtures).

// From a.q [T, H, qk], a.kv_latn [T, kvr], a.rope_k [T, 1, r] (mla_qkv with latent): writes the
// cache rows of the batch's tokens, attends, and writes a.attn [T, H, dv].
void mla_attention_paged(Backend& be, const ModelWeights& w, const EnginePrecision& prec, int l, KvCache& cache,
                         const PagedBatch& batch, MlaLatentScratch& s, LayerActivations& a) {
  const ModelConfig& c = w.config;
  const int64_t T = a.q.dim(0), H = c.num_heads, nope = c.qk_nope_head_dim, r = c.qk_rope_head_dim;
  const int64_t qk = c.qk_head_dim(), dv = c.v_head_dim, kvr = c.kv_lora_rank;
  const LayerWeights& lw = w.layers[l];
  FP8RL_CHECK(lw.kv_b.w.defined(), "MLA generation needs kv_b_proj's unquantized weight (the generator keeps it)");
  // 1. the cache rows [c | kr]
  Tensor row = s.kv_row.reshape({T, kvr + r});
  be.copy_cols(a.kv_latn, 0, row, 0, kvr);
  be.copy_cols(a.rope_k.reshape({T, r}), 0, row, kvr, r);
  be.kv_write(cache, l, s.kv_row, Tensor(), batch);
  // 2. q_abs = [q_nope W_k | q_rope] per head (mla_absorb: every head at once)
  be.mla_absorb(a.q, 0, lw.kv_b.w, nope, dv, /*values=*/false, s.q_abs, 0);
  Tensor qah = s.q_abs.reshape({T * H, kvr + r});
  be.copy_cols(a.q.reshape({T * H, qk}), nope, qah, kvr, r);
  // 3. the MQA over the latent rows (softmax scale of the expanded head, 1/sqrt(qk)), V = c
  be.attention_paged(cache, l, s.q_abs, batch, c.softmax_scale(), prec.fp8_attention, s.o_lat);
  // 4. each head's output through its W_v [dv, kvr] (mla_absorb)
  be.mla_absorb(s.o_lat, 0, lw.kv_b.w, nope, dv, /*values=*/true, a.attn, 0);
}

}  // namespace

// ---- batches ---------------------------------------------------------------------------------

ForwardBatch forward_batch_from_sequences(const std::vector<std::vector<int32_t>>& sequences) {
  ForwardBatch b;
  b.cu_seqlens.push_back(0);
  for (const auto& s : sequences) {
    for (size_t i = 0; i < s.size(); ++i) {
      b.ids.push_back(s[i]);
      b.positions.push_back(static_cast<int32_t>(i));
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.ids.size()));
  }
  return b;
}

void forward_batch_validate(const ForwardBatch& b, int vocab_size) {
  FP8RL_CHECK(b.cu_seqlens.size() >= 2 && b.cu_seqlens.front() == 0, "a batch needs cu_seqlens [B + 1] "
              "starting at 0 with B >= 1");
  FP8RL_CHECK(b.cu_seqlens.back() == b.num_tokens(), "cu_seqlens ends at ", b.cu_seqlens.back(),
              " but the batch has ", b.num_tokens(), " tokens");
  FP8RL_CHECK(b.positions.size() == b.ids.size(), "positions [", b.positions.size(), "] must match ids [",
              b.ids.size(), "]");
  FP8RL_CHECK(b.num_tokens() > 0, "empty batch: nothing to score");
  for (size_t i = 0; i + 1 < b.cu_seqlens.size(); ++i)
    FP8RL_CHECK(b.cu_seqlens[i] <= b.cu_seqlens[i + 1], "cu_seqlens must be non-decreasing (index ", i, ")");
  for (size_t t = 0; t < b.ids.size(); ++t) {
    FP8RL_CHECK(b.ids[t] >= 0 && b.ids[t] < vocab_size, "token id ", b.ids[t], " at position ", t,
                " is out of the vocabulary [0, ", vocab_size, ")");
    FP8RL_CHECK(b.positions[t] >= 0, "negative position at token ", t);
  }
}

// ---- the scoring forward -----------------------------------------------------------------------

LogprobResult model_forward_logprobs(Backend& be, const ModelWeights& w, const EnginePrecision& prec,
                                     const ForwardBatch& batch, const ForwardOptions& opt, Activations* acts) {
  const ModelConfig& c = w.config;
  check_weights_on(be, w);
  forward_batch_validate(batch, c.vocab_size);
  FP8RL_CHECK(opt.temperature > 0.0f, "temperature must be > 0 for scoring, got ", opt.temperature);
  const int64_t T = batch.num_tokens(), D = c.hidden_size;
  const DType act = act_dtype_for(be, w), st = stat_dtype_for(act);

  // target[t] = ids[t + 1] inside a sequence; the last token gets a placeholder (0), masked below.
  std::vector<int32_t> targets(T, 0);
  for (int b = 0; b < batch.num_sequences(); ++b)
    for (int32_t t = batch.cu_seqlens[b]; t + 1 < batch.cu_seqlens[b + 1]; ++t) targets[t] = batch.ids[t + 1];

  Activations local;
  Activations& A = acts ? *acts : local;
  A.batch = batch;
  A.temperature = opt.temperature;
  A.ids = upload_i32(be, batch.ids);
  A.positions = upload_i32(be, batch.positions);
  A.targets = upload_i32(be, targets);

  Tensor x = be.alloc({T, D}, act);  // [T, D]
  be.embedding(A.ids, w.embed, x);

  A.kv_round_k = opt.kv_round_k;
  A.kv_round_v = opt.kv_round_v;
  const AttentionStep attention = training_attention(be, c, prec, A.batch, st, A.kv_round_k, A.kv_round_v);
  QkvAmax amax;
  if (opt.record_qkv_amax) {
    amax.acc = be.alloc({3 * int64_t{c.num_layers}}, DType::F32);
    be.fill(amax.acc, 0.0f);
  }
  A.recompute = acts && opt.recompute;
  LogprobResult r;
  MoeRoutingIo routing;
  if (c.is_moe()) {
    if (acts) A.replay_routing = opt.replay_routing ? *opt.replay_routing : MoeRouting{};  // for the recompute
    routing.replay = opt.replay_routing;
    routing.used = opt.record_routing ? &r.routing : nullptr;
    routing.own = opt.record_routing && opt.replay_routing ? &r.router_topk : nullptr;
  }
  forward_layers(be, w, prec, x, A.positions, attention, routing, acts ? &A.layers : nullptr, A.recompute,
                 opt.record_qkv_amax ? &amax : nullptr, A.x_final);

  A.final_rstd = be.alloc({T}, st);
  A.hidden = be.alloc({T, D}, act);
  be.rmsnorm(A.x_final, w.final_norm, c.rms_norm_eps, A.hidden, &A.final_rstd);

  // The head over the wanted rows only (ForwardOptions::head_rows): their hidden states and
  // targets gathered, the rest never reaches the lm_head.
  const int64_t R = opt.head_rows ? static_cast<int64_t>(opt.head_rows->size()) : T;
  if (opt.head_rows) {
    std::vector<int32_t> rows(R), row_of(T, static_cast<int32_t>(R)), sub_targets(R);
    std::vector<bool> last(T, false);
    for (int b = 0; b < batch.num_sequences(); ++b)
      if (batch.cu_seqlens[b + 1] > batch.cu_seqlens[b]) last[batch.cu_seqlens[b + 1] - 1] = true;
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = (*opt.head_rows)[i];
      FP8RL_CHECK(t >= 0 && t < T && (i == 0 || t > (*opt.head_rows)[i - 1]) && !last[t], "head_rows: entry ", i,
                  " (token ", t, ") is not an increasing token with a target in a batch of ", T);
      rows[i] = static_cast<int32_t>(t);
      row_of[t] = static_cast<int32_t>(i);
      sub_targets[i] = targets[t];
    }
    A.head_rows = upload_i32(be, rows);
    A.head_row_of = upload_i32(be, row_of);
    A.targets = upload_i32(be, sub_targets);
    Tensor hidden = be.alloc({R, D}, act);
    if (R > 0) be.embedding(A.head_rows, A.hidden, hidden);  // a row gather
    A.hidden = hidden;
  }
  r.logp = be.alloc({R}, st);
  A.lm_lse = be.alloc({R}, st);
  if (opt.entropy) r.entropy = be.alloc({R}, st);
  if (R > 0)
    be.token_logprobs(A.hidden, w.lm_head, A.targets, opt.temperature, head_spec_for(act, prec.exact_logits()),
                      r.logp, A.lm_lse, opt.entropy ? &r.entropy : nullptr);
  if (!opt.head_rows) zero_last_tokens(be, r.logp, batch.cu_seqlens);
  if (opt.record_qkv_amax) {
    const std::vector<float> m = to_float_vector(be.to_host(amax.acc));  // one read for every block
    for (int l = 0; l < c.num_layers; ++l) {
      r.q_amax.push_back(m[3 * l]);
      r.k_amax.push_back(m[3 * l + 1]);
      r.v_amax.push_back(m[3 * l + 2]);
    }
  }
  return r;
}

// ---- the generation forward ----------------------------------------------------------------------

void model_forward_paged(Backend& be, const ModelWeights& w, const EnginePrecision& prec, KvCache& cache,
                         const Tensor& ids, const PagedBatch& batch, const Tensor& rows, Tensor& logits,
                         Tensor* hidden_out, MoeRouting* routing_out, Tensor* routing_device) {
  const ModelConfig& c = w.config;
  check_weights_on(be, w);
  const KvCacheShape want = model_kv_cache_shape(c);
  FP8RL_CHECK(cache.num_layers == c.num_layers && cache.num_kv_heads == want.num_kv_heads &&
                  cache.head_dim == want.head_dim && cache.latent_v_dim == want.latent_v_dim,
              "the KV cache (", cache.num_layers, " layers, ", cache.num_kv_heads, " KV heads, head_dim ",
              cache.head_dim, ", latent V ", cache.latent_v_dim, ") does not fit the model (", c.num_layers, ", ",
              want.num_kv_heads, ", ", want.head_dim, ", ", want.latent_v_dim,
              "); allocate it with model_alloc_kv_cache");
  check_dtype(ids, DType::I32, "ids");
  check_dtype(rows, DType::I32, "rows");
  const int64_t T = ids.numel(), R = rows.numel(), D = c.hidden_size;
  check_shape(batch.token_pos, {T}, "batch.token_pos");
  check_shape(logits, {R, c.vocab_size}, "logits");
  const DType head_dtype = model_logits_dtype(be, w, prec);
  FP8RL_CHECK(logits.dtype() == DType::F32 || logits.dtype() == head_dtype, "model_forward_paged: logits must be F32",
              head_dtype == DType::F32 ? "" : " or BF16", ", got ", logits.str());
  const DType act = act_dtype_for(be, w);
  if (prec.consistent) model_check_consistent(c, prec);
  // The consistent mode: every token's attention independent of the batch (the trainer's
  // scoring runs the same kernel over its own batch).
  PagedBatch pb = batch;
  pb.batch_invariant = pb.batch_invariant || prec.consistent;
  // consistent=flash: the decode attention in the trainer's flash-attention order instead.
  pb.flash_order = pb.flash_order || (prec.consistent && prec.consistent_flash);

  Tensor x = be.alloc({T, D}, act);  // [T, D]
  be.embedding(ids, w.embed, x);

  AttentionStep attention;
  MlaLatentScratch mla;
  // Captured by reference below: it must outlive the if (forward_layers runs the lambdas).
  const float softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (c.is_mla()) {
    mla = mla_latent_scratch_alloc(be, c, act, T);
    attention.mla_latent = true;
    attention.run = [&](int layer, LayerActivations& a) {
      mla_attention_paged(be, w, prec, layer, cache, pb, mla, a);
    };
  } else {
    attention.fp8_out = true;
    attention.kv_cache = &cache;
    attention.kv_batch = &pb;
    attention.run = [&](int layer, LayerActivations& a) {
      if (!a.kv_written) be.kv_write(cache, layer, a.k, a.v, pb);
      be.attention_paged(cache, layer, a.q, pb, softmax_scale, prec.fp8_attention, a.attn, nullptr,
                         a.attn_fp8.defined() ? &a.attn_fp8 : nullptr);
    };
  }
  Tensor x_final;
  MoeRoutingIo routing;
  FP8RL_CHECK(!(routing_out && routing_device), "model_forward_paged: the routing record goes to the host or the "
              "device, not both");
  if (c.is_moe()) {
    routing.used = routing_out;
    routing.device_plan = routing_out == nullptr;
    if (routing_device) {
      const int64_t Lm = model_num_moe_layers(c);
      check_dtype(*routing_device, DType::I32, "routing_device");
      check_shape(*routing_device, {Lm, T * c.num_experts_per_tok}, "routing_device");
    }
    routing.used_device = routing_device;
  }
  forward_layers(be, w, prec, x, pb.token_pos, attention, routing, nullptr, false, nullptr, x_final);

  // Select the requested rows (embedding is a row gather: out[r] = table[rows[r]]), then norm.
  Tensor sel = be.alloc({R, D}, act);
  be.embedding(rows, x_final, sel);
  Tensor hidden = be.alloc({R, D}, act);
  be.rmsnorm(sel, w.final_norm, c.rms_norm_eps, hidden, nullptr);
  LinearWeight head;
  head.w = w.lm_head;
  if (prec.exact_logits()) {
    model_consistent_logits(be, hidden, w.lm_head, logits);
  } else if (act == DType::F32) {
    be.linear(hidden, head, kFp32Spec, logits);
  } else if (logits.dtype() == act) {  // model_logits_dtype: the GEMM's output is the sampler's input
    be.linear(hidden, head, head_spec_for(act, false), logits);
  } else {
    Tensor tmp = be.alloc({R, c.vocab_size}, act);
    be.linear(hidden, head, head_spec_for(act, false), tmp);
    be.convert(tmp, logits);
  }
  if (hidden_out) *hidden_out = hidden;
}

DType model_logits_dtype(const Backend& be, const ModelWeights& w, const EnginePrecision& prec) {
  return act_dtype_for(be, w) == DType::BF16 && !prec.exact_logits() ? DType::BF16 : DType::F32;
}

int model_num_moe_layers(const ModelConfig& c) {
  int n = 0;
  for (int l = 0; l < c.num_layers; ++l) n += c.layer_is_moe(l) ? 1 : 0;
  return n;
}

void model_consistent_logits(Backend& be, const Tensor& hidden, const Tensor& lm_head, Tensor& logits) {
  // The logits exactly as token_logprobs computes them (its vocabulary chunks, F32 outputs of
  // the head GEMM): the sampler draws from the values the trainer's scoring sees, and
  // logprobs_of_logits folds them as token_logprobs does.
  const LinearSpec spec = head_spec_for(hidden.dtype(), true);
  be.linear_chunked(hidden, lm_head, spec, kConsistentVocabChunk, logits);  // each chunk written in place
}

void model_sampled_logprobs(Backend& be, const Tensor& logits, const Tensor& tokens, float temperature, Tensor& logp) {
  Tensor lse = be.alloc({logits.dim(0)}, DType::F32);
  be.logprobs_of_logits(logits, tokens, temperature, logp, lse);
}

void model_check_consistent(const ModelConfig& c, const EnginePrecision& prec) {
  if (!prec.consistent) return;
  FP8RL_CHECK(!c.is_moe() && !c.is_mla(), "precision.consistent supports dense models (Llama, Qwen2, Qwen3) only: "
              "this model has ", c.is_moe() ? "mixture-of-experts" : "MLA", " layers; turn precision.consistent off");
  FP8RL_CHECK(!prec.fp8_attention, "precision.consistent does not take FP8 attention: turn precision.fp8_attention "
              "off");
  FP8RL_CHECK(prec.kv_cache == DType::F32 || prec.kv_cache == DType::BF16 || prec.kv_cache == DType::E4M3,
              "precision.consistent: the KV cache dtype must be f32, bf16 or e4m3, got ", dtype_name(prec.kv_cache));
}

KvCacheShape model_kv_cache_shape(const ModelConfig& c) {
  if (c.is_mla()) return {1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank};
  return {c.num_kv_heads, c.head_dim, 0};
}

KvCache model_alloc_kv_cache(Backend& be, const ModelConfig& c, int num_pages, int page_size, DType dtype) {
  const KvCacheShape s = model_kv_cache_shape(c);
  return be.alloc_kv_cache(c.num_layers, num_pages, page_size, s.num_kv_heads, s.head_dim, dtype, s.latent_v_dim);
}

// ---- the backward ------------------------------------------------------------------------------

namespace {

// Scratch gradients of the MoE MLP backward (R = T * k rows), allocated at the first MoE block.
struct MoeGradScratch {
  Tensor d_y, d_xe, d_xe2;         // [R, D]
  Tensor d_act, d_gate, d_up;      // [R, Fe]
  Fp8View d_y_q, d_gate_q, d_up_q;  // [R, D], [R, Fe] x 2: FP8 copies of d_y, d_gate, d_up (fused: FP8 blocks)
  Tensor d_w, d_logits, d_router_x;  // [T * k], [T, E], [T, D] (FP32 / F64)
  Tensor d_shared_act, d_shared_gate, d_shared_up, d_shared_x;  // [T, Fs] x 3, [T, D] (shared experts)
};

// Backward of a.proj = moe(xn_mlp) given dproj [T, D]: d_xn [T, D] written (through the experts
// and the routing weights); the experts' weight gradients accumulated; with router_grad, the
// router's too. fused (FP8 blocks, BackwardOptions::fused_dy_fp8): the producers of the experts'
// dY write its FP8 copy for the grouped dgrads, as in a dense MLP: the weighted permute the down
// products' (moe_permute_fp8), the SwiGLU backward the gate and up products' (swiglu_backward_fp8).
void moe_backward(Backend& be, const ModelConfig& c, const LayerWeights& lw, LayerWeights& lg,
                  const LinearSpec& spec, const LayerActivations& a, const Tensor& dproj, bool router_grad,
                  bool fused, MoeGradScratch& sc, Tensor& d_xn) {
  const int64_t T = dproj.dim(0), D = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok, R = T * k;
  const int64_t Fe = c.moe_intermediate_size;
  const DType act = dproj.dtype();
  if (!sc.d_y.defined()) {
    sc.d_y = be.alloc({R, D}, act);
    sc.d_xe = be.alloc({R, D}, act);
    sc.d_xe2 = be.alloc({R, D}, act);
    sc.d_act = be.alloc({R, Fe}, act);
    sc.d_gate = be.alloc({R, Fe}, act);
    sc.d_up = be.alloc({R, Fe}, act);
  }
  const Tensor w = a.moe_weights.reshape({R});
  fused = fused && spec.mode == LinearMode::FP8_BLOCK;
  if (fused) {
    auto view = [&](Fp8View& v, int64_t cols) {
      if (!v.defined() || v.q.pow2 != spec.pow2_scales) v = be.alloc_fp8_view(R, cols, spec.pow2_scales);
    };
    view(sc.d_y_q, D);
    view(sc.d_gate_q, Fe);
    view(sc.d_up_q, Fe);
    be.moe_permute_fp8(dproj, nullptr, a.moe_row_slot, static_cast<int>(k), &w, sc.d_y, sc.d_y_q);
  } else {
    be.moe_permute(dproj, a.moe_row_slot, static_cast<int>(k), &w, sc.d_y);  // dy[r] = w * dproj[token]
  }
  // Every expert's SwiGLU backward over its rows: grouped backward linears (one launch per half
  // on CUDA where the mode allows) and one swiglu_backward over all rows (element-wise).
  std::vector<const LinearWeight*> gates, ups, downs;
  std::vector<Tensor*> d_gates, d_ups, d_downs;
  for (int64_t e = 0; e < E; ++e) {
    gates.push_back(&lw.experts[e].gate);
    ups.push_back(&lw.experts[e].up);
    downs.push_back(&lw.experts[e].down);
    d_gates.push_back(&lg.experts[e].gate.w);
    d_ups.push_back(&lg.experts[e].up.w);
    d_downs.push_back(&lg.experts[e].down.w);
  }
  be.grouped_linear_backward(sc.d_y, a.moe_act, a.moe_offsets, downs, spec, &sc.d_act, d_downs,
                             fused ? &sc.d_y_q : nullptr);
  if (fused) {
    be.swiglu_backward_fp8(sc.d_act, a.moe_gate, a.moe_up, sc.d_gate, sc.d_up, sc.d_gate_q, sc.d_up_q);
  } else {
    be.swiglu_backward(sc.d_act, a.moe_gate, a.moe_up, sc.d_gate, sc.d_up);
  }
  be.grouped_linear_backward(sc.d_gate, a.moe_x, a.moe_offsets, gates, spec, &sc.d_xe, d_gates,
                             fused ? &sc.d_gate_q : nullptr);
  be.grouped_linear_backward(sc.d_up, a.moe_x, a.moe_offsets, ups, spec, &sc.d_xe2, d_ups, fused ? &sc.d_up_q : nullptr);
  be.add(sc.d_xe, sc.d_xe2, sc.d_xe);
  be.moe_unpermute(sc.d_xe, a.moe_slot_row, nullptr, d_xn);
  // Through the routing weights into the block input (always: a frozen router is a constant
  // weight, as requires_grad = False in torch, not a stop-gradient) and the router weight.
  const DType rt = a.router_logits.dtype();
  if (!sc.d_w.defined()) {
    sc.d_w = be.alloc({T, k}, a.moe_weights.dtype());
    sc.d_logits = be.alloc({T, E}, rt);
    sc.d_router_x = be.alloc({T, D}, rt);
  }
  Tensor dw = sc.d_w.reshape({R});
  be.moe_unpermute_backward_weights(dproj, a.moe_y, a.moe_slot_row, dw);
  if (c.moe_router == "sigmoid") {
    be.moe_route_sigmoid_backward(a.router_logits, a.moe_experts, c.norm_topk_prob, c.routed_scaling_factor, sc.d_w,
                                  sc.d_logits);
  } else {
    be.moe_route_softmax_backward(a.router_logits, a.moe_experts, c.norm_topk_prob, sc.d_w, sc.d_logits);
  }
  be.linear_backward(sc.d_logits, a.router_x, lw.router, kFp32Spec, &sc.d_router_x,
                     router_grad ? &lg.router.w : nullptr, nullptr);
  be.add(d_xn, sc.d_router_x, d_xn);
  if (lw.gate.w.defined() || lw.gate.wq.defined()) {  // the shared experts
    const int64_t Fs = a.shared_gate.dim(1);
    if (!sc.d_shared_act.defined()) {
      sc.d_shared_act = be.alloc({T, Fs}, act);
      sc.d_shared_gate = be.alloc({T, Fs}, act);
      sc.d_shared_up = be.alloc({T, Fs}, act);
      sc.d_shared_x = be.alloc({T, D}, act);
    }
    be.linear_backward(dproj, a.shared_act, lw.down, spec, &sc.d_shared_act, &lg.down.w, nullptr);
    be.swiglu_backward(sc.d_shared_act, a.shared_gate, a.shared_up, sc.d_shared_gate, sc.d_shared_up);
    be.linear_backward(sc.d_shared_gate, a.xn_mlp, lw.gate, spec, &sc.d_shared_x, &lg.gate.w, nullptr);
    be.add(d_xn, sc.d_shared_x, d_xn);
    be.linear_backward(sc.d_shared_up, a.xn_mlp, lw.up, spec, &sc.d_shared_x, &lg.up.w, nullptr);
    be.add(d_xn, sc.d_shared_x, d_xn);
  }
}

// Scratch gradients of the MLA projections' backward.
struct MlaGradScratch {
  Tensor d_rq, d_rk, d_rk_h;   // [T, H, r], [T, 1, r], [T, r]
  Tensor d_qan, d_qa;          // [T, qr] x 2 (q_lora_rank > 0)
  Tensor d_kvb;                // [T, H * (nope + dv)]
  Tensor d_latn, d_lat;        // [T, kvr] x 2
  Tensor d_kva;                // [T, kvr + r]
  Tensor d_x2;                 // [T, D]
};

// Backward of mla_qkv: from dq [T, H, qk], dk [T, H, qk], dv [T, H, dv] (the attention's
// input gradients; dq is modified) to d_xn [T, D] (written); the projections' and the two
// norms' weight gradients accumulated.
void mla_backward(Backend& be, const ModelConfig& c, const LayerWeights& lw, LayerWeights& lg, const LinearSpec& spec,
                  const Tensor& positions, const RopeParams& rope, const LayerActivations& a, Tensor& dq,
                  const Tensor& dk, const Tensor& dv, MlaGradScratch& sc, Tensor& d_xn) {
  const int64_t T = dq.dim(0), H = c.num_heads, nope = c.qk_nope_head_dim, r = c.qk_rope_head_dim;
  const int64_t qk = c.qk_head_dim(), hdv = c.v_head_dim, kvr = c.kv_lora_rank, qr = c.q_lora_rank;
  const int64_t D = c.hidden_size;
  const DType act = dq.dtype();
  if (!sc.d_kva.defined()) {
    sc.d_rq = be.alloc({T, H, r}, act);
    sc.d_rk = be.alloc({T, 1, r}, act);
    sc.d_rk_h = be.alloc({T, r}, act);
    if (qr > 0) {
      sc.d_qan = be.alloc({T, qr}, act);
      sc.d_qa = be.alloc({T, qr}, act);
    }
    sc.d_kvb = be.alloc({T, H * (nope + hdv)}, act);
    sc.d_latn = be.alloc({T, kvr}, act);
    sc.d_lat = be.alloc({T, kvr}, act);
    sc.d_kva = be.alloc({T, kvr + r}, act);
    sc.d_x2 = be.alloc({T, D}, act);
  }
  auto bias = [](LinearWeight& gw) { return gw.bias.defined() ? &gw.bias : nullptr; };
  // q: the rotary part back through RoPE (its transpose), then the q projection(s).
  Tensor dqh = dq.reshape({T * H, qk}), drq = sc.d_rq.reshape({T * H, r});
  be.copy_cols(dqh, nope, drq, 0, r);
  be.rope(sc.d_rq, positions, rope, /*inverse=*/true);
  be.copy_cols(drq, 0, dqh, nope, r);
  const Tensor dq2 = dq.reshape({T, H * qk});
  if (qr > 0) {
    be.linear_backward(dq2, a.q_an, lw.q_b, mla_spec(c, spec, lw.q_b), &sc.d_qan, &lg.q_b.w, nullptr);
    be.rmsnorm_backward(sc.d_qan, a.q_a, lw.q_a_norm, a.q_a_rstd, sc.d_qa, lg.q_a_norm);
    be.linear_backward(sc.d_qa, a.xn_attn, lw.q_a, mla_spec(c, spec, lw.q_a), &d_xn, &lg.q_a.w, bias(lg.q_a));
  } else {
    be.linear_backward(dq2, a.xn_attn, lw.q, mla_spec(c, spec, lw.q), &d_xn, &lg.q.w, nullptr);
  }
  // k_nope | v per head -> kv_b -> kv_a_layernorm -> the latent columns of kv_a.
  Tensor dkvh = sc.d_kvb.reshape({T * H, nope + hdv});
  be.copy_cols(dk.reshape({T * H, qk}), 0, dkvh, 0, nope);
  be.copy_cols(dv.reshape({T * H, hdv}), 0, dkvh, nope, hdv);
  be.linear_backward(sc.d_kvb, a.kv_latn, lw.kv_b, mla_spec(c, spec, lw.kv_b), &sc.d_latn, &lg.kv_b.w, nullptr);
  be.rmsnorm_backward(sc.d_latn, a.kv_lat, lw.kv_a_norm, a.kv_rstd, sc.d_lat, lg.kv_a_norm);
  be.copy_cols(sc.d_lat, 0, sc.d_kva, 0, kvr);
  // The shared rotary key: the sum over heads of their k_rope gradients, back through RoPE.
  const Tensor dk2 = dk.reshape({T, H * qk});
  Tensor drk = sc.d_rk.reshape({T, r});
  be.copy_cols(dk2, nope, drk, 0, r);
  for (int64_t h = 1; h < H; ++h) {
    be.copy_cols(dk2, h * qk + nope, sc.d_rk_h, 0, r);
    be.add(drk, sc.d_rk_h, drk);
  }
  be.rope(sc.d_rk, positions, rope, /*inverse=*/true);
  be.copy_cols(drk, 0, sc.d_kva, kvr, r);
  be.linear_backward(sc.d_kva, a.xn_attn, lw.kv_a, mla_spec(c, spec, lw.kv_a), &sc.d_x2, &lg.kv_a.w, bias(lg.kv_a));
  be.add(d_xn, sc.d_x2, d_xn);
}

}  // namespace

void model_backward(Backend& be, const ModelWeights& w, const EnginePrecision& prec, const Activations& A,
                    const Tensor& dlogp_in, ModelWeights& g, const BackwardOptions& opt) {
  const ModelConfig& c = w.config;
  const int L = c.num_layers;
  FP8RL_CHECK(static_cast<int>(A.layers.size()) == L, "model_backward needs the activations saved by "
              "model_forward_logprobs(..., &acts) (got ", A.layers.size(), " layers of ", L, ")");
  const int64_t T = A.batch.num_tokens(), D = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  const bool head_rows = A.head_rows.defined();
  const int64_t R = head_rows ? A.head_rows.numel() : T;
  check_shape(dlogp_in, {R}, "dlogp");
  const DType act = act_dtype_for(be, w);
  const RopeParams rope = c.rope_params();
  const float softmax_scale = c.softmax_scale();

  // dlogp without the targetless last tokens (head rows never hold one).
  Tensor dlogp = be.alloc({R}, dlogp_in.dtype());
  be.copy(dlogp_in, dlogp);
  if (!head_rows) zero_last_tokens(be, dlogp, A.batch.cu_seqlens);

  // lm_head + log-softmax, then the final norm. dx [T, D] is the gradient of the residual stream.
  Tensor dhidden = be.alloc({T, D}, act);
  if (!head_rows) {
    be.token_logprobs_backward(A.hidden, w.lm_head, A.targets, A.temperature, head_spec_for(act, prec.exact_logits()),
                               A.lm_lse, dlogp, dhidden, &g.lm_head);
  } else {
    // The head's rows' gradient in rows [0, R) of `rows`, a zero row R for every token the head
    // skipped, spread to the T tokens by the gather moe_unpermute does (one source row each).
    Tensor rows = be.alloc({R + 1, D}, act);
    Tensor zero = rows.slice_rows(R, R + 1);
    be.fill(zero, 0.0f);
    if (R > 0) {
      Tensor head = rows.slice_rows(0, R);
      be.token_logprobs_backward(A.hidden, w.lm_head, A.targets, A.temperature,
                                 head_spec_for(act, prec.exact_logits()), A.lm_lse, dlogp, head, &g.lm_head);
    }
    be.moe_unpermute(rows, A.head_row_of, nullptr, dhidden);
  }
  Tensor dx = be.alloc({T, D}, act);
  be.rmsnorm_backward(dhidden, A.x_final, w.final_norm, A.final_rstd, dx, g.final_norm);

  // Scratch gradients, reused by every block.
  Tensor d_xn = be.alloc({T, D}, act), d_tmp = be.alloc({T, D}, act), d_mid = be.alloc({T, D}, act);
  Tensor d_act, d_gate, d_up;  // [T, F] (dense MLP blocks)
  MoeGradScratch moe_scratch;  // (MoE blocks)
  const bool mla = c.is_mla();
  // MLA: q/k heads of qk_nope + qk_rope, v heads of v_head_dim, H = Hq for k and v too.
  const int64_t hq = mla ? c.qk_head_dim() : hd, hkv_heads = mla ? Hq : Hkv, hdv = mla ? c.v_head_dim : hd;
  Tensor d_attn = be.alloc({T, Hq, hdv}, act);
  Tensor dq = be.alloc({T, Hq, hq}, act), dk = be.alloc({T, hkv_heads, hq}, act), dv = be.alloc({T, hkv_heads, hdv}, act);
  MlaGradScratch mla_scratch;
  Tensor dq_raw, dk_raw;
  if (c.qk_norm) {
    dq_raw = be.alloc({T, Hq * hd}, act);
    dk_raw = be.alloc({T, Hkv * hd}, act);
  }

  // The bias gradient of a linear, when it has a bias (q/k/v in qwen2; any with attention_bias).
  auto bias = [](LinearWeight& gw) { return gw.bias.defined() ? &gw.bias : nullptr; };

  // FP8 dgrads take their dY's FP8 copy from its producer (opt.fused_dy_fp8): the SwiGLU
  // backward writes dgate's and dup's (gate, up), the residual gradient's adds d_mid's (o) and
  // dx's (the down projection of the block below). dx_q holds dx's copy when dx_quantized.
  Fp8View d_gate_q, d_up_q, d_mid_q, dx_q;
  bool dx_quantized = false;
  auto view = [&](Fp8View& v, int64_t cols) -> Fp8View& {  // every FP8 block has the recipe's pow2
    if (!v.defined()) v = be.alloc_fp8_view(T, cols, prec.pow2_scales);
    return v;
  };
  auto fused = [&](const LinearSpec& s) { return opt.fused_dy_fp8 && s.mode == LinearMode::FP8_BLOCK; };
  // dx = d_mid + d_tmp, the gradient of block l's input; quantized too when it is the dY of
  // block l - 1's FP8 down projection.
  auto block_input_grad = [&](int l) {
    dx_quantized = l > 0 && !c.layer_is_moe(l - 1) && fused(block_spec(prec, l - 1, L));
    if (dx_quantized)
      be.add_fp8(d_mid, d_tmp, dx, view(dx_q, D));
    else
      be.add(d_mid, d_tmp, dx);
  };

  const AttentionStep attention =
      training_attention(be, c, prec, A.batch, stat_dtype_for(act), A.kv_round_k, A.kv_round_v);
  LayerActivations recomputed;  // block recomputation: one block's activations at a time
  MoeRoutingIo recompute_routing;  // the forward's routing replay, replayed again
  if (!A.replay_routing.ids.empty()) recompute_routing.replay = &A.replay_routing;
  Tensor recomputed_out = A.recompute ? be.alloc({T, D}, act) : Tensor();
  for (int l = L - 1; l >= 0; --l) {
    const LayerWeights& lw = w.layers[l];
    LayerWeights& lg = g.layers[l];
    if (A.recompute)
      forward_block(be, w, prec, l, A.layers[l].x, A.positions, attention, recompute_routing, nullptr,
                    /*for_backward=*/true, recomputed, recomputed_out);
    const LayerActivations& a = A.recompute ? recomputed : A.layers[l];
    const LinearSpec spec = block_spec(prec, l, L);

    // ---- MLP: x_out = x_mid + mlp(xn), xn = mlp_norm(x_mid) ----
    if (c.layer_is_moe(l)) {
      moe_backward(be, c, lw, lg, spec, a, dx, opt.router_grad, opt.fused_dy_fp8, moe_scratch, d_xn);
    } else {  // mlp(xn) = down(silu(gate(xn)) * up(xn))
      if (!d_act.defined()) {
        d_act = be.alloc({T, F}, act);
        d_gate = be.alloc({T, F}, act);
        d_up = be.alloc({T, F}, act);
      }
      be.linear_backward(dx, a.act, lw.down, spec, &d_act, &lg.down.w, bias(lg.down), dx_quantized ? &dx_q : nullptr);
      const bool mlp_fused = fused(spec);
      if (mlp_fused)
        be.swiglu_backward_fp8(d_act, a.gate, a.up, d_gate, d_up, view(d_gate_q, F), view(d_up_q, F));
      else
        be.swiglu_backward(d_act, a.gate, a.up, d_gate, d_up);
      be.linear_backward(d_gate, a.xn_mlp, lw.gate, spec, &d_xn, &lg.gate.w, bias(lg.gate),
                         mlp_fused ? &d_gate_q : nullptr);
      be.linear_backward(d_up, a.xn_mlp, lw.up, spec, &d_tmp, &lg.up.w, bias(lg.up), mlp_fused ? &d_up_q : nullptr);
      be.add(d_xn, d_tmp, d_xn);
    }
    be.rmsnorm_backward(d_xn, a.x_mid, lw.mlp_norm, a.mlp_rstd, d_tmp, lg.mlp_norm);
    // d x_mid: residual + through the norm (o's dY)
    const LinearSpec o_spec = mla ? mla_spec(c, spec, lw.o) : spec;
    if (fused(o_spec))
      be.add_fp8(dx, d_tmp, d_mid, view(d_mid_q, D));
    else
      be.add(dx, d_tmp, d_mid);
    const Fp8View* d_mid_fp8 = fused(o_spec) ? &d_mid_q : nullptr;

    // ---- attention: x_mid = x + o(attention(rope(norm(q)), rope(norm(k)), v)) ----
    if (mla) {
      Tensor d_attn2 = d_attn.reshape({T, Hq * hdv});
      be.linear_backward(d_mid, a.attn.reshape({T, Hq * hdv}), lw.o, o_spec, &d_attn2, &lg.o.w, bias(lg.o),
                         d_mid_fp8);
      be.attention_backward(d_attn, a.q, a.k, a.v, a.attn, a.lse, A.batch.cu_seqlens, softmax_scale, dq, dk, dv);
      mla_backward(be, c, lw, lg, spec, A.positions, rope, a, dq, dk, dv, mla_scratch, d_xn);
      be.rmsnorm_backward(d_xn, a.x, lw.attn_norm, a.attn_rstd, d_tmp, lg.attn_norm);
      block_input_grad(l);
      continue;
    }
    Tensor d_attn2 = d_attn.reshape({T, Hq * hd});
    be.linear_backward(d_mid, a.attn.reshape({T, Hq * hd}), lw.o, spec, &d_attn2, &lg.o.w, bias(lg.o), d_mid_fp8);
    be.attention_backward(d_attn, a.q, a.k, a.v, a.attn, a.lse, A.batch.cu_seqlens, softmax_scale, dq, dk, dv);
    be.rope(dq, A.positions, rope, /*inverse=*/true);
    be.rope(dk, A.positions, rope, /*inverse=*/true);
    Tensor dq2 = dq.reshape({T, Hq * hd}), dk2 = dk.reshape({T, Hkv * hd});
    if (c.qk_norm) {
      Tensor dqh = dq_raw.reshape({T * Hq, hd}), dkh = dk_raw.reshape({T * Hkv, hd});
      be.rmsnorm_backward(dq.reshape({T * Hq, hd}), a.q_raw.reshape({T * Hq, hd}), lw.q_norm, a.q_rstd, dqh,
                          lg.q_norm);
      be.rmsnorm_backward(dk.reshape({T * Hkv, hd}), a.k_raw.reshape({T * Hkv, hd}), lw.k_norm, a.k_rstd, dkh,
                          lg.k_norm);
      dq2 = dq_raw;
      dk2 = dk_raw;
    }
    be.linear_backward(dq2, a.xn_attn, lw.q, spec, &d_xn, &lg.q.w, bias(lg.q));
    be.linear_backward(dk2, a.xn_attn, lw.k, spec, &d_tmp, &lg.k.w, bias(lg.k));
    be.add(d_xn, d_tmp, d_xn);
    be.linear_backward(dv.reshape({T, Hkv * hd}), a.xn_attn, lw.v, spec, &d_tmp, &lg.v.w, bias(lg.v));
    be.add(d_xn, d_tmp, d_xn);
    be.rmsnorm_backward(d_xn, a.x, lw.attn_norm, a.attn_rstd, d_tmp, lg.attn_norm);
    block_input_grad(l);  // d x: residual + through the norm
  }
  be.embedding_backward(A.ids, dx, g.embed);
}

}  // namespace fp8rl
