#include "rl/memory_plan.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "model/shapes.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "quant/quant.h"

namespace fp8rl {

namespace {

constexpr int64_t kBlock = kQuantBlock;  // FP8 weight blocks are 128 x 128

struct LinearShape {
  int64_t rows, cols;  // [out, in]
  bool mla_kv_b = false;  // MLA's kv_b_proj: the generator keeps it unquantized (BF16)
};

// The linears of block `layer` that follow the block precision, [out, in] each: q, k, v, o (MLA:
// q or q_a + q_b, kv_a, kv_b, o) and the dense MLP's 3, or (mixture of experts) every expert's 3
// and the shared experts' 3.
std::vector<LinearShape> block_linears(const ModelConfig& c, int layer) {
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  const int64_t q = int64_t(c.num_heads) * c.head_dim, kv = int64_t(c.num_kv_heads) * c.head_dim;
  std::vector<LinearShape> out = {{q, D}, {kv, D}, {kv, D}, {D, q}};
  if (c.is_mla()) {  // model/weights.h's MLA layout
    const int64_t H = c.num_heads, qk = c.qk_head_dim(), qr = c.q_lora_rank, kvr = c.kv_lora_rank;
    out.clear();
    if (qr > 0) out.insert(out.end(), {LinearShape{qr, D}, LinearShape{H * qk, qr}});
    else out.push_back({H * qk, D});
    out.push_back({kvr + c.qk_rope_head_dim, D});
    out.push_back({H * (c.qk_nope_head_dim + c.v_head_dim), kvr, /*mla_kv_b=*/true});
    out.push_back({D, H * c.v_head_dim});
  }
  if (!c.layer_is_moe(layer)) {
    for (LinearShape s : {LinearShape{F, D}, LinearShape{F, D}, LinearShape{D, F}}) out.push_back(s);
    return out;
  }
  const int64_t Fe = c.moe_intermediate_size, Fs = int64_t(c.n_shared_experts) * Fe;
  for (int e = 0; e < c.num_experts; ++e)
    for (LinearShape s : {LinearShape{Fe, D}, LinearShape{Fe, D}, LinearShape{D, Fe}}) out.push_back(s);
  if (Fs > 0)
    for (LinearShape s : {LinearShape{Fs, D}, LinearShape{Fs, D}, LinearShape{D, Fs}}) out.push_back(s);
  return out;
}

// Whether the linear `s` of a block in `mode` is an FP8 128x128 weight (as generator_weights_alloc
// and the trainer's cache make it): MLA's kv_b and the MLA projections the recipe cannot block
// (mla_projection_kept_bf16) are not; kv_b is BF16 unless the block is FP32.
bool fp8_linear(const ModelConfig& c, const LinearShape& s, LinearMode mode) {
  return mode == LinearMode::FP8_BLOCK && !s.mla_kv_b && !mla_projection_kept_bf16(c, s.rows, s.cols);
}

int64_t fp8_weight_bytes(const LinearShape& s) {
  return s.rows * s.cols + ceil_div(s.rows, kBlock) * ceil_div(s.cols, kBlock) * 4;  // E4M3 + F32 scales
}

// The trainer's W^T copies (LinearWeight::wqt, train/trainer.cpp; train.dgrad_weight_cache):
// one per FP8 linear of the trainer (model_linear_mode: MLA's kv_b too, which only the generator
// keeps unquantized), as large as its wq.
int64_t trainer_wqt_bytes(const ModelConfig& c, const EnginePrecision& trainer) {
  int64_t bytes = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (trainer.linear_for_layer(l, c.num_layers) != LinearMode::FP8_BLOCK) continue;
    for (const LinearShape& s : block_linears(c, l))
      if (!mla_projection_kept_bf16(c, s.rows, s.cols)) bytes += fp8_weight_bytes(s);
  }
  return bytes;
}

// Without those copies the dgrad transposes wq per call into one reused scratch buffer (CUDA
// linear_backward; the grouped expert dgrad transposes all of a layer's routed experts into it at
// once): the largest such W^T, kept once grown.
int64_t trainer_wqt_scratch_bytes(const ModelConfig& c, const EnginePrecision& trainer) {
  int64_t bytes = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (trainer.linear_for_layer(l, c.num_layers) != LinearMode::FP8_BLOCK) continue;
    for (const LinearShape& s : block_linears(c, l))
      if (!mla_projection_kept_bf16(c, s.rows, s.cols)) bytes = std::max(bytes, fp8_weight_bytes(s));
    if (c.layer_is_moe(l)) {
      const int64_t Fe = c.moe_intermediate_size, D = c.hidden_size;
      bytes = std::max(bytes, int64_t(c.num_experts) * std::max(fp8_weight_bytes({Fe, D}), fp8_weight_bytes({D, Fe})));
    }
  }
  return bytes;
}

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(1ll << 30));
  return buf;
}

}  // namespace

int64_t MemoryPlan::resident_bytes() const {
  int64_t s = 0;
  for (const auto& l : resident) s += l.bytes;
  return s;
}

int64_t MemoryPlan::host_bytes() const {
  int64_t s = 0;
  for (const auto& l : host) s += l.bytes;
  return s;
}

int64_t MemoryPlan::peak_bytes() const {
  int64_t s = resident_bytes();
  for (const auto& l : transient) s += l.bytes;
  return s;
}

int64_t memory_plan_block_bytes_per_token(const ModelConfig& c, DType act) {
  const int64_t a = int64_t(dtype_size(act));
  const int64_t st = act == DType::F64 ? 8 : 4;  // per-row statistics (rstd, lse) are F32 (F64)
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  const int64_t q = int64_t(c.num_heads) * c.head_dim, kv = int64_t(c.num_kv_heads) * c.head_dim;
  // x, xn_attn, x_mid, xn_mlp, proj [D]; q, attn [Hq*hd]; k, v [Hkv*hd]
  int64_t attn_elems = 5 * D + 2 * q + 2 * kv;
  int64_t stats = 2 + c.num_heads;  // attn_rstd, mlp_rstd, lse [Hq]
  if (c.is_mla()) {  // LayerActivations' MLA tensors (model/transformer.h)
    const int64_t H = c.num_heads, qk = c.qk_head_dim(), dv = c.v_head_dim, r = c.qk_rope_head_dim;
    const int64_t kvr = c.kv_lora_rank, qr = c.q_lora_rank;
    // q, k [H*qk]; v, attn [H*dv]; q_a, q_an [qr]; kv_a [kvr + r]; kv_lat, kv_latn [kvr];
    // kv_b [H*(nope + dv)]; rope_q [H*r], rope_k [r]
    attn_elems = 5 * D + 2 * H * qk + 2 * H * dv + 2 * qr + (kvr + r) + 2 * kvr + H * (c.qk_nope_head_dim + dv) +
                 H * r + r;
    stats += 1 + (qr > 0 ? 1 : 0);  // kv_rstd (+ q_a_rstd)
  }
  if (c.qk_norm) {
    attn_elems += q + kv;                    // q_raw, k_raw
    stats += c.num_heads + c.num_kv_heads;   // q_rstd, k_rstd
  }
  const int64_t dense = (attn_elems + 3 * F) * a + stats * st;  // + gate, up, act [F]
  if (!c.is_moe()) return dense;
  // A sparse block: moe_x, moe_y [k * D]; moe_gate, moe_up, moe_act [k * Fe]; the shared experts'
  // gate, up, act [Fs] and output [D]; FP32 router input (a copy with BF16 activations) [D],
  // logits [E], weights [k]; I32 experts, row_slot, slot_row [k] each.
  const int64_t k = c.num_experts_per_tok, Fe = c.moe_intermediate_size, Fs = int64_t(c.n_shared_experts) * Fe;
  const int64_t sparse = (attn_elems + k * (2 * D + 3 * Fe) + (Fs > 0 ? 3 * Fs + D : 0)) * a + stats * st +
                         ((a == 4 ? 0 : D) + c.num_experts + k) * 4 + 3 * k * 4;
  bool any_dense = false;
  for (int l = 0; l < c.num_layers; ++l) any_dense |= !c.layer_is_moe(l);
  return any_dense ? std::max(dense, sparse) : sparse;  // the plan counts L blocks of the larger kind
}

int64_t memory_plan_head_bytes_per_token(const ModelConfig& c, DType act) {
  const int64_t a = int64_t(dtype_size(act));
  const int64_t st = act == DType::F64 ? 8 : 4;
  // x_final, hidden [D]; final_rstd, lm_lse; ids, positions, targets (I32)
  return 2 * int64_t(c.hidden_size) * a + 2 * st + 3 * 4;
}

int64_t memory_plan_generator_bytes(const ModelConfig& c, const EnginePrecision& gen, DType act) {
  const int64_t a = int64_t(dtype_size(act));
  const int64_t D = c.hidden_size, V = c.vocab_size, hd = c.head_dim;
  int64_t bytes = V * D * a * (c.tie_word_embeddings ? 1 : 2) + D * a;  // embed (+ lm_head), final_norm
  for (int l = 0; l < c.num_layers; ++l) {
    bytes += 2 * D * a + (c.qk_norm ? 2 * hd * a : 0);  // attn_norm, mlp_norm (+ q_norm, k_norm)
    if (c.is_mla()) bytes += (int64_t(c.q_lora_rank) + c.kv_lora_rank) * a;  // q_a_norm, kv_a_norm
    if (c.attention_bias) bytes += (int64_t(c.num_heads) + 2 * c.num_kv_heads) * hd * a;
    const LinearMode mode = gen.linear_for_layer(l, c.num_layers);
    if (c.layer_is_moe(l))  // FP32 router (+ the sigmoid router's correction bias)
      bytes += int64_t(c.num_experts) * (D + (c.moe_router == "sigmoid" ? 1 : 0)) * 4;
    for (const LinearShape& s : block_linears(c, l)) {
      if (fp8_linear(c, s, mode))
        bytes += fp8_weight_bytes(s);
      else if (s.mla_kv_b && mode != LinearMode::FP32)
        bytes += s.rows * s.cols * 2;
      else
        bytes += s.rows * s.cols * a;
    }
  }
  return bytes;
}

MemoryPlan memory_plan_compute(const MemoryPlanInput& in) {
  const ModelConfig& c = in.model;
  c.validate();
  FP8RL_CHECK(in.kv_pages >= 0 && in.page_size > 0 && in.micro_batch_tokens > 0 && in.generation_batch > 0,
              "memory plan: kv_pages, page_size, micro_batch_tokens and generation_batch must be positive");
  MemoryPlan p;
  p.parameters = c.num_parameters();
  const int64_t N = p.parameters;
  const int64_t a = int64_t(dtype_size(in.act_dtype));
  const int64_t T = in.micro_batch_tokens, V = c.vocab_size, L = c.num_layers;

  FP8RL_CHECK((in.grad_dtype == DType::F32 || in.grad_dtype == DType::BF16) &&
                  (in.moment_dtype == DType::F32 || in.moment_dtype == DType::BF16),
              "memory plan: gradients and moments are F32 or BF16");
  const int64_t gb = int64_t(dtype_size(in.grad_dtype)), mb = int64_t(dtype_size(in.moment_dtype));
  p.resident.push_back({"master weights (F32)", 4 * N, "4 B x parameters"});
  p.resident.push_back({std::string("gradients (") + dtype_name(in.grad_dtype) + ")", gb * N,
                        std::to_string(gb) + " B x parameters (train.grad_dtype)"});
  p.resident.push_back({std::string("Adam moments m, v (") + dtype_name(in.moment_dtype) + ")", 2 * mb * N,
                        "2 x " + std::to_string(mb) + " B x parameters (train.optimizer_state_dtype)"});
  // Trainer::compute_weights, rebuilt in place every optimizer step (an FP32 trainer, the exact
  // recipe, keeps only BF16 embedding/lm_head copies: not counted).
  if (in.act_dtype == DType::BF16 && in.trainer.linear != LinearMode::FP32)
    p.resident.push_back({"trainer compute copies", memory_plan_generator_bytes(c, in.trainer, in.act_dtype),
                          "FP8 linears' 128x128 cache + scales, BF16 copies of the other linears, embedding, lm_head"});
  if (in.trainer.linear == LinearMode::FP8_BLOCK && in.dgrad_weight_cache)  // the reference policy keeps none
    p.resident.push_back({"trainer FP8 dgrad weights (W^T)", trainer_wqt_bytes(c, in.trainer),
                          "each FP8 linear's 128x128 quantization transposed, + scales: read by the dgrad, "
                          "refreshed with the cache every optimizer step (train.dgrad_weight_cache)"});
  else if (in.trainer.linear == LinearMode::FP8_BLOCK)
    p.resident.push_back({"trainer dgrad W^T scratch (no W^T cache)", trainer_wqt_scratch_bytes(c, in.trainer),
                          "the largest FP8 linear's W^T (MoE: a layer's experts'), transposed from wq in every dgrad "
                          "call (train.dgrad_weight_cache: off)"});
  if (in.reference_policy)
    p.resident.push_back({"reference policy (kl_beta > 0)", memory_plan_generator_bytes(c, in.trainer, in.act_dtype),
                          "frozen: weights only, in the trainer's compute dtypes (FP8 linears + scales, or the "
                          "activation dtype)"});
  const bool fp8 = in.generator.linear == LinearMode::FP8_BLOCK;
  p.resident.push_back({fp8 ? "generator weights (FP8 linears + scales)" : "generator weights",
                        memory_plan_generator_bytes(c, in.generator, in.act_dtype),
                        fp8 ? "linears 1 B/elem + F32 scale per 128x128 block; embed/norms in activation dtype"
                            : "every tensor in the activation dtype"});
  const int64_t kv_tokens = in.kv_pages * in.page_size;
  // MLA (model_kv_cache_shape): one latent row of kv_lora_rank + qk_rope_head_dim per token and
  // layer, no V pool (V is the latent).
  const KvCacheShape kvs = model_kv_cache_shape(c);
  const int64_t pools = kvs.latent_v_dim > 0 ? 1 : 2;
  const int64_t kv = pools * L * kv_tokens * kvs.num_kv_heads * kvs.head_dim * int64_t(dtype_size(in.generator.kv_cache)) +
                     2 * L * kvs.num_kv_heads * 4;
  p.resident.push_back({std::string("KV pool (") + dtype_name(in.generator.kv_cache) + ")", kv,
                        std::to_string(in.kv_pages) + " pages x " + std::to_string(in.page_size) +
                            (kvs.latent_v_dim > 0 ? " tokens x layers x (kv_lora_rank + qk_rope_head_dim) (MLA latent)"
                                                  : " tokens x layers x K,V x kv_heads x head_dim") +
                            (in.kv_note.empty() ? "" : "; " + in.kv_note)});

  const int64_t act = T * (L * memory_plan_block_bytes_per_token(c, in.act_dtype) +
                           memory_plan_head_bytes_per_token(c, in.act_dtype));
  p.activations_recompute_bytes = T * (L * int64_t(c.hidden_size) * a + memory_plan_block_bytes_per_token(c, in.act_dtype) +
                                       memory_plan_head_bytes_per_token(c, in.act_dtype));
  if (in.recompute)
    p.transient.push_back({"saved activations, one micro-batch", p.activations_recompute_bytes,
                           std::to_string(T) + " tokens x (every block's input + one recomputed block) "
                           "(train.recompute: block)"});
  else
    p.transient.push_back({"saved activations, one micro-batch", act,
                           std::to_string(T) + " tokens x every block's LayerActivations (no recomputation)"});
  if (in.grad_dtype == DType::BF16) {  // CUDA: a BF16 gradient accumulates through an F32 copy, one tensor at a time
    int64_t largest = int64_t(V) * c.hidden_size;  // the embedding (and an untied lm_head)
    for (int l = 0; l < c.num_layers; ++l)
      for (const LinearShape& s : block_linears(c, l)) largest = std::max(largest, s.rows * s.cols);
    p.transient.push_back({"F32 copy of one BF16 gradient", 4 * largest,
                           "the largest parameter tensor, while an op accumulates into it (train.grad_dtype: bf16)"});
  }
  if (c.is_moe() && in.act_dtype == DType::BF16) {
    // CUDA's expert weight gradients: the larger of its two forms' scratch, each grown with a
    // quarter's slack (as every scratch slot):
    // - cuBLAS's grouped GEMM (the default): into F32 gradients through BF16 staging, groups of
    //   experts at a time (CudaBackend::kGroupedWgradStagingBytes: 128 MiB, or all experts' if less);
    // - FP8RL_GROUPED_WGRAD=own (CudaBackend::grouped_wgrad_own): dY and X transposed, each expert's
    //   tokens padded to 64, in chunks of experts within kGroupedWgradOperandBytes (64 MiB; a chunk
    //   holds at least one expert, whose tokens are at most T: a token takes an expert once).
    const int64_t D = c.hidden_size, Fe = c.moe_intermediate_size;
    int64_t staging = 0, own = 0;
    if (in.grad_dtype != DType::BF16) {
      const int64_t per = (D * Fe + 7) / 8 * 8 * 2;
      staging = std::clamp<int64_t>((int64_t{128} << 20) / per, 1, std::max(1, c.num_experts)) * per;
      staging += staging / 4;
    }
    if (D % 16 == 0 && Fe % 16 == 0) {
      const int64_t padded = T * c.num_experts_per_tok + 63 * int64_t(std::max(1, c.num_experts));
      const int64_t need =
          std::min<int64_t>(padded * (D + Fe) * 2, std::max<int64_t>(int64_t{64} << 20, (T + 64) * (D + Fe) * 2));
      own = need + need / 4;
    }
    if (std::max(staging, own) > 0)
      p.transient.push_back({"grouped weight-gradient scratch (BF16)", std::max(staging, own),
                             "the larger of the default's BF16 staging (F32 gradients) and FP8RL_GROUPED_WGRAD=own's "
                             "transposed operands"});
  }
  const int64_t hq = int64_t(c.num_heads) * c.head_dim, hkv = int64_t(c.num_kv_heads) * c.head_dim;
  const int64_t F = c.intermediate_size;
  const bool fp8_trainer = in.trainer.linear == LinearMode::FP8_BLOCK;
  // The attention part of a block's gradients, then its MLP's: the dense MLP's (an F32 estimate),
  // or a sparse block's MoeGradScratch (transformer.cpp moe_backward: d_y, d_xe, d_xe2 [k T, D] and
  // d_act, d_gate, d_up [k T, Fe] in the activation dtype; d_logits [T, E], d_router_x [T, D] in
  // F32; the shared experts' [T, Fs] x 3 and [T, D]) with the FP8 grouped dgrad's quantized dy
  // [k T, max(D, Fe)] and the FP8 copies of d_y [k T, D], d_gate, d_up [k T, Fe]: the dense estimate left ~1 GiB
  // of a 6-layer Qwen3-30B-A3B step uncounted
  // (bench rl-step, session 23).
  const int64_t D = c.hidden_size;
  const int64_t mlp_dense = T * 3 * F * 4 + (fp8_trainer ? 2 * T * (F + ceil_div(F, kBlock) * 4) : 0);
  int64_t mlp = mlp_dense;
  if (c.is_moe()) {
    const int64_t k = c.num_experts_per_tok, Fe = c.moe_intermediate_size, R = T * k, W = std::max(D, Fe);
    const int64_t Fs = int64_t(c.n_shared_experts) * Fe;
    int64_t moe = R * (3 * D + 3 * Fe) * a + T * (c.num_experts + D) * 4 + (Fs > 0 ? T * (3 * Fs + D) * a : 0);
    // FP8: the grouped dgrad's quantized dy (scratch), and the producers' copies of d_y, d_gate, d_up.
    if (fp8_trainer)
      moe += R * W + R * ceil_div(W, kBlock) * 4 + R * (D + ceil_div(D, kBlock) * 4) +
             2 * R * (Fe + ceil_div(Fe, kBlock) * 4);
    bool any_dense = false;
    for (int l = 0; l < c.num_layers; ++l) any_dense |= !c.layer_is_moe(l);
    mlp = any_dense ? std::max(mlp_dense, moe) : moe;
  }
  p.transient.push_back({"backward scratch of one block (estimate)", T * (2 * D + 2 * hq + 2 * hkv) * 4 + mlp,
                         c.is_moe()     ? "F32 gradients of the attention's activations + the MoE block's gradient scratch"
                         : fp8_trainer ? "F32 gradients of one block's activations + the FP8 copies of dgate, dup"
                                       : "F32 gradients of one block's activations"});
  // The attention backward's F32 work area (flash_attention_backward_work): delta per (token, q
  // head) rounded up to 16 bytes, and with GQA the dk/dv partials of every q head before the group sum.
  p.transient.push_back({"attention backward scratch (F32)",
                         (T * c.num_heads + 3) / 4 * 4 * 4 + (c.num_heads != c.num_kv_heads ? 2 * T * hq * 4 : 0),
                         c.num_heads != c.num_kv_heads ? "delta + per-q-head dk/dv partials (GQA)" : "delta"});
  p.transient.push_back({"lm_head logits chunk (F32)", std::min(in.logits_chunk_bytes, T * V * 4),
                         "tokens x vocabulary chunk"});
  // The head GEMM's output as the sampler reads it (model_logits_dtype): BF16 with BF16
  // activations, F32 on the exact path and in the consistent mode.
  const bool bf16_logits = in.act_dtype == DType::BF16 && !in.generator.exact_logits();
  p.transient.push_back({bf16_logits ? "decode logits (BF16)" : "decode logits (F32)",
                         in.generation_batch * V * (bf16_logits ? 2 : 4),
                         std::to_string(in.generation_batch) + " sequences x vocabulary"});
  // MoE: the generator's experts per token and MoE layer, recorded in the rollout (int16 ids) for
  // the routing-agreement metrics and routing replay; the trainer packs one micro-batch's as I32
  // and records its own beside it (routing used, router top-k).
  const int64_t moe_ids = int64_t(model_num_moe_layers(c)) * c.num_experts_per_tok;
  if (moe_ids > 0 && in.rollout_sequences > 0) {
    p.host.push_back({"rollout routing record (int16)", in.rollout_sequences * in.rollout_positions * moe_ids * 2,
                      std::to_string(in.rollout_sequences) + " sequences x " + std::to_string(in.rollout_positions) +
                          " positions x MoE layers x top_k x 2 B"});
    p.host.push_back({"routing of one trainer micro-batch (I32)", 3 * T * moe_ids * 4,
                      "the generator's, the one used, the router's own: tokens x MoE layers x top_k x 4 B"});
  }
  return p;
}

int64_t memory_plan_host_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : 0;
}

void memory_plan_check_host(const MemoryPlan& plan, const std::string& device) {
  if (device != "cpu") return;
  const int64_t host = memory_plan_host_bytes();
  const int64_t need = plan.peak_bytes() + plan.host_bytes();
  if (host > 0 && need > host)
    FP8RL_FAIL("the run needs ", need / double(int64_t(1) << 30), " GiB at its peak (the memory plan ",
               "above) but this machine has ", host / double(int64_t(1) << 30), " GiB: reduce the model, ",
               "rollout.prompts_per_step x generations_per_prompt, max_new_tokens or train.micro_batch_tokens");
}

namespace {

// Sequences the engine can hold at once: at most max_num_seqs, and no more than a step (or a
// validation) ever asks for.
int64_t kv_sequences(const RunConfig& c) {
  const int64_t asked = std::max<int64_t>(int64_t(c.rollout.prompts_per_step) * c.rollout.generations_per_prompt,
                                          c.val_size);
  return std::min<int64_t>(c.rollout.max_num_seqs, asked);
}

}  // namespace

int64_t memory_plan_kv_pages(const RunConfig& c) {
  // The engine runs at most max_num_seqs sequences at once (the rest wait for a slot), so a
  // pool for more would never be used.
  const int64_t len = std::min(2048, 256 + c.rollout.max_new_tokens);
  const int64_t page = 16;
  return kv_sequences(c) * ((len + page - 1) / page) + 1;
}

int64_t memory_plan_kv_pages_max(const RunConfig& c, const ModelConfig& model) {
  const int64_t page = 16;
  const int64_t pages = kv_sequences(c) * ceil_div(int64_t(model.max_position_embeddings), page) + 1;
  return std::min<int64_t>(pages, (int64_t(1) << 31) - 1);  // page ids are I32
}

int64_t memory_plan_kv_page_bytes(const ModelConfig& m, DType kv_dtype, int64_t page_size) {
  const KvCacheShape kvs = model_kv_cache_shape(m);  // MLA: one latent row, no V pool
  const int64_t pools = kvs.latent_v_dim > 0 ? 1 : 2;
  return pools * int64_t(m.num_layers) * page_size * kvs.num_kv_heads * kvs.head_dim * int64_t(dtype_size(kv_dtype));
}

MemoryPlanInput memory_plan_input(const RunConfig& c, const ModelConfig& model, DType act_dtype, bool sft) {
  MemoryPlanInput in;
  in.model = model;
  in.generator = config_precision_recipe(c.precision).generator;
  in.trainer = config_precision_recipe(c.precision).trainer;
  in.act_dtype = act_dtype;
  in.reference_policy = !sft && c.train.kl_beta > 0;
  in.kv_pages = sft ? memory_plan_sft_kv_pages(c) : memory_plan_kv_pages(c);
  in.micro_batch_tokens = c.train.micro_batch_tokens;
  in.recompute = c.train.recompute == "block";
  in.dgrad_weight_cache = c.train.dgrad_weight_cache != "off";
  in.grad_dtype = c.train.grad_dtype == "bf16" ? DType::BF16 : DType::F32;
  in.moment_dtype = c.train.optimizer_state_dtype == "bf16" ? DType::BF16 : DType::F32;
  in.generation_batch = c.rollout.max_num_seqs;
  if (!sft) {  // the routing record's positions: as the KV pool's shape-sized sequences
    in.rollout_sequences = int64_t(c.rollout.prompts_per_step) * c.rollout.generations_per_prompt;
    in.rollout_positions = std::min<int64_t>(model.max_position_embeddings, std::min(2048, 256 + c.rollout.max_new_tokens));
  }
  return in;
}

MemoryPlanInput memory_plan_input_chosen(const RunConfig& c_in, const ModelConfig& model, DType act,
                                         const MemoryChoice& choice, bool sft) {
  RunConfig c = c_in;
  c.train.recompute = choice.recompute;
  c.train.dgrad_weight_cache = choice.dgrad_weight_cache;
  MemoryPlanInput in = memory_plan_input(c, model, act, sft);
  in.kv_pages = choice.kv_pages;
  in.kv_note = choice.kv_note;
  return in;
}

std::string memory_plan_format(const MemoryPlan& p, const ModelConfig& c, int64_t device_bytes) {
  std::string s;
  char buf[512];
  char moe[96] = "";
  if (c.is_moe())
    std::snprintf(moe, sizeof moe, ", %d experts x F %d top-%d", c.num_experts, c.moe_intermediate_size,
                  c.num_experts_per_tok);
  std::snprintf(buf, sizeof buf, "memory plan: %s, %.1fM parameters (D %d, F %d%s, %d layers, %d/%d heads x %d, vocab %d%s)\n",
                c.model_type.c_str(), double(p.parameters) / 1e6, c.hidden_size, c.intermediate_size, moe, c.num_layers,
                c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.tie_word_embeddings ? ", tied" : "");
  s += buf;
  auto add = [&](const MemoryPlanLine& l) {
    std::snprintf(buf, sizeof buf, "  %-44s %12s  %s\n", l.name.c_str(), gib(l.bytes).c_str(), l.note.c_str());
    s += buf;
  };
  s += " resident for the whole run:\n";
  for (const auto& l : p.resident) add(l);
  std::snprintf(buf, sizeof buf, "  %-44s %12s\n", "= resident", gib(p.resident_bytes()).c_str());
  s += buf;
  s += " per training micro-batch / decode step (as built):\n";
  for (const auto& l : p.transient) add(l);
  std::snprintf(buf, sizeof buf, "  %-44s %12s\n", "= peak (resident + transient)", gib(p.peak_bytes()).c_str());
  s += buf;
  if (p.transient.empty() || p.transient.front().bytes != p.activations_recompute_bytes) {
    std::snprintf(buf, sizeof buf, "  %-44s %12s  %s\n", "saved activations with block recomputation",
                  gib(p.activations_recompute_bytes).c_str(), "(train.recompute: block)");
    s += buf;
  }
  if (!p.host.empty()) {
    s += " on the host (not device memory; counted against the machine's memory on the CPU backend):\n";
    for (const auto& l : p.host) add(l);
  }
  s += " not counted: the CUDA context, GEMM workspaces (cuBLASLt's; the own FP8 kernel's split-K and\n"
       " stream-K partials: ~17 MB on 132 SMs), CUDA-graph memory pools, allocator slack (fragmentation),\n"
       " the rest of the host side (checkpoint staging: a host copy of master + moments while saving);\n"
       " ZeRO-1's split of the moments over ranks (train.shard_optimizer: counted whole); the\n"
       " generator's prefill activations (one layer's buffers of at most max_batch_tokens tokens, reused)\n"
       " and the trainer's scoring forward (no saved activations) are below the training micro-batch's peak\n"
       " and not added to it; the generator's concatenated q|k|v / gate|up product scratch (at most 2048 rows)"
       ", with top-k / top-p sampling, an F32 copy of the BF16 decode logits for the radix sampler, and,\n"
       " with precision.consistent, the trainer's one-layer scoring cache and attention partials.\n";
  if (device_bytes > 0) {
    const int64_t free = device_bytes - p.peak_bytes();
    std::snprintf(buf, sizeof buf, "  %s in %s: %s %s\n", free >= 0 ? "fits" : "DOES NOT FIT", gib(device_bytes).c_str(),
                  gib(free >= 0 ? free : -free).c_str(), free >= 0 ? "left" : "short (lower train.micro_batch_tokens or the KV pool)");
    s += buf;
  }
  return s;
}

namespace {

int64_t peak_for(const RunConfig& c, const ModelConfig& model, DType act, bool sft) {
  return memory_plan_compute(memory_plan_input(c, model, act, sft)).peak_bytes();
}

// Largest v in [lo, hi] with fits(v), fits monotone (true then false); lo - 1 when none.
template <class F>
int64_t largest_fitting(int64_t lo, int64_t hi, F&& fits) {
  if (lo > hi || !fits(lo)) return lo - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace

int64_t memory_plan_free_bytes(const RunConfig& c, int64_t backend_free_bytes) {
  if (c.memory.free_gib > 0) return static_cast<int64_t>(c.memory.free_gib * double(1ll << 30));
  return backend_free_bytes;
}

namespace {

// The W^T copies the plan `in` holds with the cache on (0: no FP8 trainer linears).
int64_t dgrad_cache_bytes(const MemoryPlanInput& in) {
  return in.trainer.linear == LinearMode::FP8_BLOCK ? trainer_wqt_bytes(in.model, in.trainer) : 0;
}

}  // namespace

TrainerMemoryChoice memory_plan_resolve_trainer(const MemoryPlanInput& given, const std::string& recompute,
                                                const std::string& cache, int64_t budget) {
  FP8RL_CHECK(recompute == "none" || recompute == "block" || recompute == "auto", "train.recompute must be none, "
              "block or auto, got '", recompute, "'");
  FP8RL_CHECK(cache == "on" || cache == "off" || cache == "auto", "train.dgrad_weight_cache must be auto, on or off, "
              "got '", cache, "'");
  TrainerMemoryChoice ch;
  ch.recompute = recompute == "block";
  ch.dgrad_weight_cache = cache != "off";
  const bool auto_r = recompute == "auto", auto_w = cache == "auto";
  if (!auto_r && !auto_w) return ch;
  MemoryPlanInput in = given;
  auto peak = [&](bool r, bool w) {
    in.recompute = r;
    in.dgrad_weight_cache = w;
    return memory_plan_compute(in).peak_bytes();
  };
  const int64_t wqt = dgrad_cache_bytes(given);
  char buf[768];
  if (budget < 0) {
    const char* unknown = "the device's free memory is unknown; set memory.free_gib to let the plan choose";
    if (auto_w) {
      std::snprintf(buf, sizeof buf, "train.dgrad_weight_cache: auto -> on (%s)\n", unknown);
      ch.lines += buf;
    }
    if (auto_r) {
      std::snprintf(buf, sizeof buf, "train.recompute: auto -> none (%s)\n", unknown);
      ch.lines += buf;
    }
    return ch;
  }
  // Fastest first: a per-call W^T transpose costs far less than one more forward per micro-batch.
  std::vector<std::pair<bool, bool>> candidates;  // (recompute, cache)
  for (bool r : {false, true})
    for (bool w : {true, false})
      if ((auto_r || r == ch.recompute) && (auto_w || w == ch.dgrad_weight_cache)) candidates.push_back({r, w});
  std::pair<bool, bool> pick = candidates.back();
  for (const auto& k : candidates)
    if (peak(k.first, k.second) <= budget) {
      pick = k;
      break;
    }
  ch.recompute = pick.first;
  ch.dgrad_weight_cache = pick.second;
  const std::string free = gib(budget) + " free";
  const char* with_block = ch.recompute ? " with block recomputation" : "";
  if (auto_w) {
    if (wqt == 0)
      std::snprintf(buf, sizeof buf, "train.dgrad_weight_cache: auto -> on (nothing to keep: the trainer has no FP8 "
                    "linears)\n");
    else if (ch.dgrad_weight_cache)
      std::snprintf(buf, sizeof buf, "train.dgrad_weight_cache: auto -> on (the plan's peak%s with the FP8 dgrad's W^T "
                    "copies (%s), %s, fits in %s)\n", with_block, gib(wqt).c_str(),
                    gib(peak(ch.recompute, true)).c_str(), free.c_str());
    else
      std::snprintf(buf, sizeof buf, "train.dgrad_weight_cache: auto -> off (with the FP8 dgrad's W^T copies, %s, the "
                    "plan's peak%s, %s, exceeds the %s; without them: %s; the dgrad transposes each FP8 weight per "
                    "call instead)\n", gib(wqt).c_str(), with_block, gib(peak(ch.recompute, true)).c_str(),
                    free.c_str(), gib(peak(ch.recompute, false)).c_str());
    ch.lines += buf;
  }
  if (auto_r) {
    if (!ch.recompute) {
      std::snprintf(buf, sizeof buf, "train.recompute: auto -> none (the plan's peak without recomputation, %s, fits "
                    "in %s%s)\n", gib(peak(false, ch.dgrad_weight_cache)).c_str(), free.c_str(),
                    wqt > 0 && !ch.dgrad_weight_cache ? ", without the W^T cache" : "");
    } else {
      const bool least_w = auto_w ? false : ch.dgrad_weight_cache;  // the least memory without recomputation
      std::snprintf(buf, sizeof buf, "train.recompute: auto -> block (without recomputation the plan's peak%s, %s, "
                    "exceeds the %s; with it: %s)\n", auto_w && wqt > 0 ? " even without the W^T cache" : "",
                    gib(peak(false, least_w)).c_str(), free.c_str(), gib(peak(true, ch.dgrad_weight_cache)).c_str());
    }
    ch.lines += buf;
  }
  return ch;
}

int64_t memory_plan_budget_bytes(const RunConfig& c, int64_t free_bytes, bool sft) {
  const double u = c.rollout.gpu_memory_utilization;
  if (free_bytes < 0 || sft || u <= 0) return free_bytes;
  return static_cast<int64_t>(double(free_bytes) * u);
}

MemoryChoice memory_plan_choose(const RunConfig& c_in, const ModelConfig& model, DType act, int64_t free_bytes,
                                bool sft) {
  MemoryChoice ch;
  const int64_t budget = memory_plan_budget_bytes(c_in, free_bytes, sft);
  {  // resolved with the shape-sized KV pool: the least the rollout gets
    const TrainerMemoryChoice t = memory_plan_resolve_trainer(memory_plan_input(c_in, model, act, sft),
                                                              c_in.train.recompute, c_in.train.dgrad_weight_cache, budget);
    ch.recompute = t.recompute ? "block" : "none";
    ch.dgrad_weight_cache = t.dgrad_weight_cache ? "on" : "off";
    ch.lines = t.lines;
  }
  ch.kv_pages = sft ? memory_plan_sft_kv_pages(c_in) : memory_plan_kv_pages(c_in);
  const double u = c_in.rollout.gpu_memory_utilization;
  if (sft || u <= 0) return ch;
  RunConfig c = c_in;
  c.train.recompute = ch.recompute;
  c.train.dgrad_weight_cache = ch.dgrad_weight_cache;
  char buf[768];
  const int64_t need = ch.kv_pages;  // the shape-sized pool: the least the rollout gets
  if (budget < 0) {
    ch.kv_note = "sized from the rollout shape (free memory unknown)";
    std::snprintf(buf, sizeof buf, "rollout.gpu_memory_utilization %.2f: the device's free memory is unknown (set "
                  "memory.free_gib): the KV pool is sized from the rollout shape, %lld pages\n", u,
                  static_cast<long long>(need));
    ch.lines += buf;
    return ch;
  }
  MemoryPlanInput in = memory_plan_input(c, model, act);
  in.kv_pages = 0;
  const int64_t rest = memory_plan_compute(in).peak_bytes();  // everything but the pages
  const int64_t page_bytes = memory_plan_kv_page_bytes(model, in.generator.kv_cache, in.page_size);
  const int64_t room = budget > rest ? (budget - rest) / page_bytes : 0;
  const int64_t most = std::max(need, memory_plan_kv_pages_max(c, model));
  const int64_t len_pages = ceil_div(int64_t(256 + c.rollout.max_new_tokens), in.page_size);
  if (room < need) {
    ch.kv_note = "the rollout shape's (gpu_memory_utilization leaves less)";
    std::snprintf(buf, sizeof buf, "rollout.gpu_memory_utilization %.2f: %s x %.2f = %s, less the rest of the plan "
                  "(%s), leaves room for %lld KV pages, below the %lld the rollout needs (%s); the pool keeps those\n",
                  u, gib(free_bytes).c_str(), u, gib(budget).c_str(), gib(rest).c_str(), static_cast<long long>(room),
                  static_cast<long long>(need), gib(need * page_bytes).c_str());
    ch.lines += buf;
    return ch;
  }
  ch.kv_pages = std::min(room, most);
  const bool capped = room > most;
  std::snprintf(buf, sizeof buf, "what gpu_memory_utilization %.2f leaves%s", u,
                capped ? ", capped at max_num_seqs x max_position_embeddings" : "");
  ch.kv_note = buf;
  char how[256];
  if (capped)
    std::snprintf(how, sizeof how, "the most the engine can use (max_num_seqs sequences of max_position_embeddings "
                  "tokens; %s x %.2f would allow more)", gib(free_bytes).c_str(), u);
  else
    std::snprintf(how, sizeof how, "what %s free x %.2f = %s leaves after the rest of the plan (%s)",
                  gib(free_bytes).c_str(), u, gib(budget).c_str(), gib(rest).c_str());
  std::snprintf(buf, sizeof buf,
                "rollout.gpu_memory_utilization %.2f: KV pool %lld pages, %s (the rollout shape needs %lld, %s): %s; "
                "it holds %lld sequences of 256 + max_new_tokens tokens; the engine runs at most "
                "rollout.max_num_seqs = %d at once\n",
                u, static_cast<long long>(ch.kv_pages), gib(ch.kv_pages * page_bytes).c_str(),
                static_cast<long long>(need), gib(need * page_bytes).c_str(), how,
                static_cast<long long>((ch.kv_pages - 1) / std::max<int64_t>(1, len_pages)), c.rollout.max_num_seqs);
  ch.lines += buf;
  return ch;
}

std::string memory_plan_check(const RunConfig& c_in, const ModelConfig& model, DType act, int64_t free_bytes, bool sft) {
  RunConfig c = c_in;
  const MemoryChoice choice = memory_plan_choose(c_in, model, act, free_bytes, sft);
  const std::string lead = choice.lines;  // train.recompute / dgrad_weight_cache: auto, resolved; the KV pool
  c.train.recompute = choice.recompute;
  c.train.dgrad_weight_cache = choice.dgrad_weight_cache;
  if (free_bytes < 0)
    return lead + "memory check: skipped (the device reports no free memory; set memory.free_gib to check)\n";
  const int64_t budget = memory_plan_budget_bytes(c, free_bytes, sft);
  const double u = c.rollout.gpu_memory_utilization;
  const bool fraction = budget != free_bytes;
  char where[256];  // what the peak is checked against
  if (fraction)
    std::snprintf(where, sizeof where, "%s (rollout.gpu_memory_utilization %.2f of the device's %s free)",
                  gib(budget).c_str(), u, gib(free_bytes).c_str());
  else
    std::snprintf(where, sizeof where, "%s free", gib(free_bytes).c_str());
  const int64_t peak = memory_plan_compute(memory_plan_input_chosen(c, model, act, choice, sft)).peak_bytes();
  char buf[768];
  if (peak <= budget) {
    std::snprintf(buf, sizeof buf, "memory check: peak %s fits in %s (%s left for what the plan does not count)\n",
                  gib(peak).c_str(), where, gib(free_bytes - peak).c_str());
    return lead + buf;
  }
  std::string msg = lead;
  if (fraction)
    std::snprintf(buf, sizeof buf, "the memory plan's peak, %s, exceeds %s by %s.", gib(peak).c_str(), where,
                  gib(peak - budget).c_str());
  else
    std::snprintf(buf, sizeof buf, "the memory plan's peak, %s, exceeds the device's free memory, %s, by %s.",
                  gib(peak).c_str(), gib(free_bytes).c_str(), gib(peak - free_bytes).c_str());
  msg += buf;
  std::vector<std::string> fixes;
  // Each knob is checked with the plan at the shape-sized KV pool (the least the run gets).
  auto fits = [&](const RunConfig& t) { return peak_for(t, model, act, sft) <= memory_plan_budget_bytes(t, free_bytes, sft); };
  if (fraction && u < 1 && peak <= free_bytes) {  // the smallest fraction (in hundredths) that holds the peak
    int hundredths = static_cast<int>(std::ceil(100.0 * double(peak) / double(free_bytes)));
    while (hundredths < 100 && static_cast<int64_t>(double(free_bytes) * (hundredths / 100.0)) < peak) ++hundredths;
    std::snprintf(buf, sizeof buf, "rollout.gpu_memory_utilization >= %.2f (now %.2f; or 0: the plan against all the "
                  "free memory)", std::min(100, hundredths) / 100.0, u);
    fixes.push_back(buf);
  }
  // train.micro_batch_tokens (saved activations, backward scratch, the logits chunk).
  {
    const int64_t cur = c.train.micro_batch_tokens;
    const int64_t best = largest_fitting(1, cur - 1, [&](int64_t v) {
      RunConfig t = c;
      t.train.micro_batch_tokens = v;
      return fits(t);
    });
    if (best >= 1) {
      const int64_t nice = best >= 256 ? best / 256 * 256 : best;
      std::snprintf(buf, sizeof buf, "train.micro_batch_tokens <= %lld (now %lld)", static_cast<long long>(nice),
                    static_cast<long long>(cur));
      fixes.push_back(buf);
    }
  }
  // sft: its validation KV pool (val_size prompts).
  if (sft) {
    const int64_t best = largest_fitting(1, c.val_size - 1, [&](int64_t v) {
      RunConfig t = c;
      t.val_size = static_cast<int>(v);
      return fits(t);
    });
    if (best >= 1) {
      std::snprintf(buf, sizeof buf, "val_size <= %lld (now %d: the validation engine's KV pool)",
                    static_cast<long long>(best), c.val_size);
      fixes.push_back(buf);
    }
  }
  // The KV pool: sequences decoded at once (min(max_num_seqs, max(P x G, val_size))) and their length.
  if (!sft) {
    const int P = c.rollout.prompts_per_step, G = c.rollout.generations_per_prompt;
    const int cur = static_cast<int>(kv_sequences(c));
    const int64_t best_seqs = largest_fitting(1, c.rollout.max_num_seqs - 1, [&](int64_t n) {
      RunConfig t = c;
      t.rollout.max_num_seqs = static_cast<int>(n);
      return fits(t);
    });
    if (best_seqs >= 1) {
      std::snprintf(buf, sizeof buf, "rollout.max_num_seqs <= %lld (now %d: fewer sequences at once, the rest wait)",
                    static_cast<long long>(best_seqs), c.rollout.max_num_seqs);
      fixes.push_back(buf);
    }
    const int64_t best = largest_fitting(1, cur - 1, [&](int64_t s) {
      RunConfig t = c;
      t.rollout.prompts_per_step = static_cast<int>(s);
      t.rollout.generations_per_prompt = 1;
      t.val_size = static_cast<int>(s);
      return fits(t);
    });
    if (best >= 1) {
      std::snprintf(buf, sizeof buf,
                    "rollout.prompts_per_step x rollout.generations_per_prompt and val_size <= %lld (now %d x %d, "
                    "val_size %d: a KV pool for %d sequences)",
                    static_cast<long long>(best), P, G, c.val_size, cur);
      fixes.push_back(buf);
    }
    const int64_t best_len = largest_fitting(1, c.rollout.max_new_tokens - 1, [&](int64_t m) {
      RunConfig t = c;
      t.rollout.max_new_tokens = static_cast<int>(m);
      return fits(t);
    });
    if (best_len >= 1) {
      std::snprintf(buf, sizeof buf, "rollout.max_new_tokens <= %lld (now %d)", static_cast<long long>(best_len),
                    c.rollout.max_new_tokens);
      fixes.push_back(buf);
    }
  }
  if (!sft && c.train.kl_beta > 0) {
    RunConfig t = c;
    t.train.kl_beta = 0;
    if (fits(t)) fixes.push_back("train.kl_beta: 0 (drops the frozen reference policy's weights)");
  }
  // The lean optimizer: 2 B/param per moment instead of 4, BF16 gradients 2 B instead of 4.
  if (c.train.optimizer_state_dtype != "bf16") {
    RunConfig t = c;
    t.train.optimizer_state_dtype = "bf16";
    if (fits(t)) fixes.push_back("train.optimizer_state_dtype: bf16 (Adam moments in BF16: saves 4 B per parameter)");
  }
  if (c.train.grad_dtype != "bf16") {
    RunConfig t = c;
    t.train.grad_dtype = "bf16";
    if (fits(t)) fixes.push_back("train.grad_dtype: bf16 (BF16 gradients: saves 2 B per parameter)");
  }
  if (c.train.recompute != "block") {
    RunConfig t = c;
    t.train.recompute = "block";
    if (fits(t))
      fixes.insert(fixes.begin(), "train.recompute: block (keeps only each block's input and recomputes the block "
                                  "in backward: one more forward per micro-batch; or train.recompute: auto)");
  }
  // The cheapest trade first: the FP8 dgrad's W^T copies (a per-call transpose without them).
  const int64_t wqt = dgrad_cache_bytes(memory_plan_input(c, model, act, sft));
  if (wqt > 0 && c.train.dgrad_weight_cache == "on") {
    RunConfig t = c;
    t.train.dgrad_weight_cache = "off";
    if (fits(t)) {
      std::snprintf(buf, sizeof buf, "train.dgrad_weight_cache: off (drops the FP8 dgrad's W^T copies, %s: the dgrad "
                    "transposes each FP8 weight per call instead, a little slower; or train.dgrad_weight_cache: auto)",
                    gib(wqt).c_str());
      fixes.insert(fixes.begin(), buf);
    }
  }
  if (fixes.empty()) {
    const std::string cache_knob = wqt > 0 ? "train.dgrad_weight_cache, " : "";
    msg += sft ? " No single knob makes it fit (" + cache_knob + "train.recompute, train.micro_batch_tokens, "
                 "val_size, train.optimizer_state_dtype, train.grad_dtype): combine them, or use a smaller model or "
                 "more memory."
               : " No single knob makes it fit (" + cache_knob + "train.recompute, train.micro_batch_tokens, the "
                 "rollout sizes, train.kl_beta, train.optimizer_state_dtype, train.grad_dtype" +
                     (fraction ? ", rollout.gpu_memory_utilization" : "") +
                     "): combine them, or use a smaller model or more memory.";
  } else {
    msg += " Any one of these makes it fit:";
    for (const std::string& f : fixes) msg += "\n  - " + f;
  }

  if (c.memory.allow_overcommit)
    return "warning: " + msg + "\nmemory.allow_overcommit is set: starting anyway\n";
  FP8RL_FAIL(msg, "\nNothing was run. To start anyway (e.g. the plan over-counts your case), set "
             "memory.allow_overcommit: true.");
}


}  // namespace fp8rl
