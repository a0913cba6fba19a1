// The decoder (Llama / Qwen2 / Qwen3) written once over the op interface (backend/backend.h):
// a scoring forward that saves what backward needs, its backward, and a generation forward
// over the paged KV cache. Both forwards run the same layer loop (transformer.cpp,
// forward_layers); only the attention step differs.
//
// MLA attention (deepseek_v3, DeepseekV3Attention), replacing q, k, v above:
//   q = xn Wq^T, or with q_lora_rank q = rmsnorm(xn Wqa^T, q_a_norm) Wqb^T      [T, H, nope + r]
//   [c | kr] = xn Wkva^T (kv_a_proj_with_mqa); c = rmsnorm(c, kv_a_norm)       [kvr | r]
//   [k_nope | v] = c Wkvb^T per head; k = [k_nope | rope(kr)] (kr shared by the heads)
//   q = [q_nope | rope(q_rope)]; attention with scale 1/sqrt(nope + r); o over [T, H*dv].
//   (q_a/kv_a layernorms use eps 1e-6, as HF's DeepseekV3RMSNorm default.) The nope | rope
//   splits and joins are copy_cols; RoPE is interleaved when rope_interleave.
// One block, pre-norm:
//   xn = rmsnorm(x, attn_norm)
//   q, k, v = xn Wq^T (+bq), xn Wk^T (+bk), xn Wv^T (+bv)        [the linears q, k, v]
//   qwen3: q, k = rmsnorm(q, q_norm), rmsnorm(k, k_norm) per head
//   q, k = rope(q), rope(k)
//   x = x + attention(q, k, v) Wo^T                                [o]
//   xn = rmsnorm(x, mlp_norm)
//   x = x + (silu(xn Wg^T) * (xn Wu^T)) Wd^T                       [gate, up, down]
//   or, in a mixture-of-experts layer (qwen3_moe, config.layer_is_moe):
//   p = softmax(xn Wr^T) (FP32) over E experts; the top-k experts of each token, weights
//   w_j = p_j (/ sum of the k when norm_topk_prob);  x = x + sum_j w_j expert_j(xn), each expert
//   a SwiGLU MLP [experts.{e}.gate, up, down]. DeepSeek-V3 routing (moe_router "sigmoid"):
//   sigmoid scores, grouped top-k on the bias-corrected scores, weights from the uncorrected
//   ones times routed_scaling_factor (moe_route_sigmoid), plus always-on shared experts
//   [gate, up, down of the layer, mlp.shared_experts.*]. The tokens are permuted by expert on the host
//   (the per-expert counts size the GEMMs), each expert's rows run as plain linears, and the
//   weighted un-permute sums the k outputs of a token (moe_* ops, backend.h).
// then hidden = rmsnorm(x, final_norm) and logits = hidden lm_head^T.
//
// Precision: the 7 linears of block l (an MoE block: q, k, v, o and every expert's gate, up,
// down; an MLA block: its projections) run in precision.linear_for_layer(l, L) (MLA
// projections whose widths are not multiples of 128 stay BF16 under FP8: model_linear_mode,
// weights.h); the MoE router is an FP32 GEMM on FP32 inputs; lm_head and
// everything else run with LinearMode::FP32 in the backend's activation dtype (FP32 on the
// CPU), except that with BF16 activations (the CUDA fast path) lm_head is a BF16 GEMM with FP32
// accumulation (transformer.cpp, head_spec_for). With F64 weights (CPU only) every activation, statistic and logp is F64 instead: the
// CPU backend then computes in plain double math (the FP64 finite-difference checks).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "core/precision.h"
#include "model/weights.h"

namespace fp8rl {

// A packed batch of sequences on the host (token-major, see backend.h).
struct ForwardBatch {
  std::vector<int32_t> ids;         // [T] token ids, sequences concatenated
  std::vector<int32_t> positions;   // [T] position of each token in its sequence (0-based)
  std::vector<int32_t> cu_seqlens;  // [B + 1] token range of each sequence
  int64_t num_tokens() const { return static_cast<int64_t>(ids.size()); }
  int num_sequences() const { return static_cast<int>(cu_seqlens.size()) - 1; }
};
ForwardBatch forward_batch_from_sequences(const std::vector<std::vector<int32_t>>& sequences);
// Throws unless the batch is consistent and every id is in [0, vocab_size).
void forward_batch_validate(const ForwardBatch& batch, int vocab_size);

// The experts every token used in each mixture-of-experts layer of one forward, on the host:
// ids[m] is [T * top_k] for the m-th MoE layer in layer order (ModelConfig::layer_is_moe), token
// t's experts at [t * k, (t + 1) * k) by descending routing weight. As a replay
// (ForwardOptions::replay_routing), a token whose first id is -1 keeps its own top-k.
struct MoeRouting {
  int top_k = 0;
  std::vector<std::vector<int32_t>> ids;  // [MoE layers][T * top_k]
};
// The number of mixture-of-experts layers (0 for a dense model).
int model_num_moe_layers(const ModelConfig& config);

// What the scoring forward saves for backward, per block (all on the backend's device).
struct LayerActivations {
  Tensor x;             // [T, D]        block input (residual stream)
  Tensor attn_rstd;     // [T]           1/rms of x (attn_norm)
  Tensor xn_attn;       // [T, D]        attn_norm(x): input of q, k, v
  Tensor q_raw, k_raw;  // [T, Hq*hd], [T, Hkv*hd]  projections before q/k-norm (qwen3 only)
  Tensor q_rstd, k_rstd;  // [T*Hq], [T*Hkv]        1/rms of each head (qwen3 only)
  Tensor q, k, v;       // [T, Hq, hd], [T, Hkv, hd], [T, Hkv, hd]  after q/k-norm and RoPE
  bool kv_written = false;  // generation: k and v are in the paged cache already (linear_qkv_norm_rope)
  // MLA (deepseek_v3; H = Hq heads, qk = qk_nope + qk_rope, dv = v_head_dim, r = qk_rope,
  // kvr = kv_lora_rank, qr = q_lora_rank): q [T, H, qk], k [T, H, qk], v [T, H, dv] above, and
  Tensor q_a, q_a_rstd, q_an;  // [T, qr], [T], [T, qr]  q_a_proj output, its 1/rms, q_a_layernorm (qr > 0)
  Tensor kv_a;                 // [T, kvr + r]  kv_a_proj_with_mqa output: latent | rotary key
  Tensor kv_lat, kv_rstd, kv_latn;  // [T, kvr], [T], [T, kvr]  the latent, 1/rms, kv_a_layernorm (kv_b's input)
  Tensor kv_b;                 // [T, H * (qk_nope + dv)]  kv_b_proj output: per head k_nope | v
  Tensor rope_q, rope_k;       // [T, H, r], [T, 1, r]  scratch: the rotary parts
  Tensor attn;          // [T, Hq, hd]   attention output: input of o (MLA: [T, H, dv])
  Tensor lse;           // [Hq, T]       attention log-sum-exp (scoring forward only)
  Fp8View attn_fp8;     // attn's FP8 copy for an FP8 o projection (generation only: the paged step writes it)
  Tensor x_mid;         // [T, D]        x + o(attn)
  Tensor mlp_rstd;      // [T]           1/rms of x_mid (mlp_norm)
  Tensor xn_mlp;        // [T, D]        mlp_norm(x_mid): input of gate, up
  Tensor gate, up;      // [T, F]        gate and up projections
  Tensor act;           // [T, F]        silu(gate) * up: input of down (dense MLP)
  // Mixture-of-experts MLP (R = T * k permuted rows, sorted by expert):
  Tensor router_x;      // F32 [T, D]    the router's input: xn_mlp, or its F32 copy (BF16 activations)
  Tensor router_logits; // F32 [T, E]    router_x Wr^T (F64 with F64 weights)
  Tensor moe_experts;   // I32 [T, k]    each token's experts, by descending probability
  Tensor moe_weights;   // F32 [T, k]    routing weights (F64 with F64 weights)
  Tensor moe_row_slot;  // I32 [R]       slot (t * k + j) of each permuted row
  Tensor moe_slot_row;  // I32 [T * k]   permuted row of each slot
  std::vector<int64_t> moe_offsets;  // host [E + 1]: rows [offsets[e], offsets[e+1]) are expert e's
                                     // (empty when the block was planned on the device)
  Backend::MoeDevicePlan moe_plan;   // the device plan (moe_plan) of a generator block
  Tensor moe_x;         // [R, D]        permuted xn_mlp: the experts' input
  Tensor moe_gate, moe_up, moe_act;  // [R, Fe]
  Tensor moe_y;         // [R, D]        expert outputs, before the routing weights
  Tensor shared_gate, shared_up, shared_act;  // [T, Fs]  shared experts (n_shared_experts * Fe)
  Tensor shared_out;    // [T, D]        the shared experts' output, added to the routed one
  Tensor proj;          // [T, D]        scratch: output of o, then of down (not needed by backward)
};

struct Activations {
  ForwardBatch batch;               // host copy
  float temperature = 1.0f;
  Tensor ids, positions, targets;   // I32 [T] on the device
  std::vector<LayerActivations> layers;
  // Block recomputation (ForwardOptions::recompute): layers[l] holds only its block input x;
  // model_backward runs the block's forward again from it before its backward.
  bool recompute = false;
  Tensor x_final;                   // [T, D] residual stream after the last block
  Tensor final_rstd;                // [T]
  Tensor hidden;                    // [R, D] final_norm(x_final) at the head's rows (R = T: every token)
  Tensor lm_lse;                    // [R]    log-sum-exp of the logits (token_logprobs)
  // ForwardOptions::head_rows: the head's rows I32 [R] and, for the backward's scatter of the
  // head's gradient, each token's row I32 [T] (R for the tokens the head skipped). Undefined: the
  // head ran over every token (R = T) and `targets` is [T].
  Tensor head_rows, head_row_of;
  // The E4M3 KV rounding the forward applied (ForwardOptions::kv_round_k/v), for the recompute.
  std::vector<float> kv_round_k, kv_round_v;
  MoeRouting replay_routing;  // the forward's routing replay (empty: none), for the recompute
};

struct ForwardOptions {
  float temperature = 1.0f;   // logits / temperature before the softmax
  bool entropy = false;       // also compute the entropy of each position's distribution
  bool record_qkv_amax = false;  // per-layer amax of q, k (after q/k-norm and RoPE) and v
  // With saved activations: keep only each block's input and recompute the block in backward
  // (train.recompute: block). The same ops on the same inputs: gradients equal bit for bit.
  bool recompute = false;
  // Per-layer E4M3 KV scales (empty: none): k and v are rounded as the generator's E4M3 cache
  // stores them (Backend::kv_round, every head with its layer's scale) before the attention, so
  // the trainer attends over the values the generator attended over; gradients pass straight
  // through. Set by the trainer when its recipe says kv_cache e4m3.
  std::vector<float> kv_round_k, kv_round_v;
  // Mixture of experts, routing replay (train.routing_replay): every token of the batch uses
  // these experts (MoeRouting, T tokens) instead of its router's top-k; the routing weights still
  // come from this forward's router logits, over the replayed experts and normalized as the
  // model's own routing does (Backend::moe_route_*_weights). Backward differentiates those weights
  // like the normal routing's. Given the forward's own routing, every output is bitwise the same.
  const MoeRouting* replay_routing = nullptr;
  bool record_routing = false;  // fill LogprobResult::routing (and router_topk under a replay)
  // The tokens whose log-prob (and entropy) are wanted, strictly increasing, each with a target
  // (not the last token of its sequence); null: every token. The lm_head (the step's largest GEMMs
  // at a 150k vocabulary) then runs over these rows alone: GRPO and SFT read the response
  // tokens only, so a prompt's rows are skipped in the forward and the backward. Each row's
  // log-prob is the one the whole-batch head computes for it (the same op on the same row; bitwise
  // where the head is row-invariant: the CPU, the consistent mode).
  const std::vector<int64_t>* head_rows = nullptr;
};

struct LogprobResult {
  // F32 [T] (F64 with F64 weights) on the device. logp[t] = log p(ids[t+1] | ids[s..t]) for a token t of the sequence
  // [s, e) with t + 1 < e; the last token of each sequence has no target and holds 0. With
  // ForwardOptions::head_rows: [R], logp[i] that of token head_rows[i].
  Tensor logp;
  Tensor entropy;  // F32 [T] or [R] as logp (when asked): entropy of the next-token distribution at t
  std::vector<float> q_amax, k_amax, v_amax;  // [num_layers] (when asked)
  // MoE models with record_routing: the experts each token used (the replayed ones under a
  // replay), and under a replay the router's own top-k (computed, then overridden).
  MoeRouting routing, router_topk;
};

// The scoring / training forward. `acts`, when non-null, receives what backward needs.
LogprobResult model_forward_logprobs(Backend& backend, const ModelWeights& weights,
                                     const EnginePrecision& precision, const ForwardBatch& batch,
                                     const ForwardOptions& options, Activations* acts = nullptr);

struct BackwardOptions {
  // The MoE router's weight gradient. Off by default: the router is frozen in RL post-training
  // (its gradient stays zero), like requires_grad = False in torch: the gradient still flows
  // through the routing weights into the block input either way. The top-k selection itself is
  // piecewise constant (no gradient).
  bool router_grad = false;
  // FP8 blocks: the producers of the FP8 dgrads' dY write its FP8 copy, which the dgrad takes
  // instead of quantizing dy: the SwiGLU backward dgate's and dup's (swiglu_backward_fp8, dense
  // MLPs and the MoE experts' grouped dgrads), the residual gradient's adds the o projection's and
  // the down projection's (add_fp8).
  // false: each linear_backward quantizes its dy itself — the same bits (tests compare the two).
  bool fused_dy_fp8 = true;
};

// Backward of sum_t dlogp[t] * logp[t] (dlogp F32 [T] on the device; the entries of the last
// token of each sequence are ignored; [R] for a forward with head_rows, as its logp).
// Accumulates into `grads` (model_grads_alloc: F32, or F64 with F64 weights). `weights` and
// `precision` must be the forward's.
void model_backward(Backend& backend, const ModelWeights& weights, const EnginePrecision& precision,
                    const Activations& acts, const Tensor& dlogp, ModelWeights& grads,
                    const BackwardOptions& options = {});

// The generation forward over the paged KV cache. ids I32 [T] (device) are the batch's query
// tokens (a prefill chunk, a decode step, or a mix), described by `batch` (positions =
// batch.token_pos). Each block writes its k/v into `cache` and attends over it. rows I32 [R]
// (device) selects the tokens whose outputs are returned: logits [R, V] written (F32, or the
// head GEMM's BF16 output as it is when model_logits_dtype says BF16), and hidden [R, D]
// (final_norm output, act dtype) written when non-null. MoE models: `routing`,
// when non-null, receives the experts of each of the T tokens in every MoE layer (on the host:
// each block then waits for its routing); `routing_device` (I32 [MoE layers, T * k] on the
// device), when non-null instead, receives them without a wait — the blocks sort their experts'
// rows on the device (moe_plan) whenever `routing` is null. In the
// consistent mode (precision.consistent) every op is batch-invariant and the logits are
// token_logprobs' (its vocabulary chunks of kConsistentVocabChunk, F32 head GEMMs): a token's
// logits, and the token_logprobs of `hidden`, are those the trainer's scoring forward computes.
void model_forward_paged(Backend& backend, const ModelWeights& weights, const EnginePrecision& precision,
                         KvCache& cache, const Tensor& ids, const PagedBatch& batch, const Tensor& rows,
                         Tensor& logits, Tensor* hidden = nullptr, MoeRouting* routing = nullptr,
                         Tensor* routing_device = nullptr);

// The dtype of the logits model_forward_paged writes with no conversion: BF16 with BF16
// activations (the lm_head GEMM's output; sample_rows reads it as it is, drawing exactly what its
// F32 copy draws), F32 otherwise and in the consistent mode (token_logprobs' F32 chunk logits).
DType model_logits_dtype(const Backend& backend, const ModelWeights& weights, const EnginePrecision& precision);

// The consistent mode's head: logits F32 [R, V] of hidden [R, D] (act dtype) written chunk by
// chunk of kConsistentVocabChunk lm_head [V, D] rows, each chunk linear in the head spec the
// scoring forward uses (model_forward_logprobs; consistent) into F32: bitwise the chunk logits
// token_logprobs computes in the consistent mode. model_forward_paged's head in that mode.
void model_consistent_logits(Backend& backend, const Tensor& hidden, const Tensor& lm_head, Tensor& logits);

// The consistent mode's logp_gen of sampled tokens: logp F32 [R] written with logprobs_of_logits
// of logits F32 [R, V] (model_forward_paged's, i.e. model_consistent_logits') at tokens I32 [R]:
// token_logprobs' reduction over token_logprobs' logits, so with the batch-invariant ops of the
// consistent mode the trainer's bits for the same token, without a second lm_head GEMM.
// temperature > 0.
void model_sampled_logprobs(Backend& backend, const Tensor& logits, const Tensor& tokens, float temperature,
                            Tensor& logp);

// Throws, saying what to change, when `precision` asks for the consistent mode
// (EnginePrecision::consistent) on a model it does not serve: mixture-of-experts or MLA layers
// (their routing and absorbed attention are not batch-invariant / not the trainer's form yet), or
// FP8 attention. Called by the forwards, the rollout engine and the trainer at construction.
void model_check_consistent(const ModelConfig& config, const EnginePrecision& precision);

// The paged cache's per-layer row of a model: num_kv_heads x head_dim per token; MLA
// (deepseek_v3) caches one row of kv_lora_rank + qk_rope_head_dim values (the normed latent and
// the roped shared key) whose first kv_lora_rank are V (latent_v_dim): the absorbed attention
// (transformer.cpp, mla_attention_paged; docs/design.md says why).
struct KvCacheShape {
  int num_kv_heads = 0, head_dim = 0, latent_v_dim = 0;
};
KvCacheShape model_kv_cache_shape(const ModelConfig& config);
// A KV cache sized for this model (layers and model_kv_cache_shape from its config).
KvCache model_alloc_kv_cache(Backend& backend, const ModelConfig& config, int num_pages, int page_size,
                             DType dtype);

}  // namespace fp8rl
