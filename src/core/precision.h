// The precision recipe is data: one struct per engine says what runs in FP8 and how it is
// scaled. It is the one answer to "where does FP8 enter?" (docs/design.md).
#pragma once
#include <string>

#include "core/dtype.h"

namespace fp8rl {

// How a linear layer Y = X W^T (+ b) computes.
enum class LinearMode {
  FP32,       // operands as they are (FP32 on the CPU), FP32 accumulation
  BF16,       // operands rounded to BF16, FP32 accumulation
  FP8_BLOCK,  // X 1x128 and W 128x128 block-scaled E4M3 (recipe.md section 2), FP32 accumulation
};
const char* linear_mode_name(LinearMode m);
LinearMode linear_mode_from_name(const std::string& s);  // "fp32" | "bf16" | "fp8"

// The numerics of one engine (the generator or the trainer).
struct EnginePrecision {
  LinearMode linear = LinearMode::BF16;  // the 7 linears of each transformer block
  bool pow2_scales = false;              // round FP8 scales up to powers of two (UE8M0)
  int bf16_first_layers = 0;             // keep the first n blocks' linears in BF16
  int bf16_last_layers = 0;              // keep the last m blocks' linears in BF16
  DType kv_cache = DType::BF16;          // generator: F32 | BF16 | E4M3. Trainer: E4M3 = its k and v
                                         // are rounded as the generator's E4M3 cache stores them
  bool fp8_attention = false;            // generator only: Q quantized, QK^T and PV in FP8
  // Trainer, FP8 linears only: the weight gradient dW = dY^T X as an FP8 GEMM of dY and X
  // requantized 1x128 along tokens (FP8_BLOCK, recipe.md section 2), or as a BF16 GEMM of the
  // unquantized dY and X (BF16: no transposed quantizations). The forward and dgrad stay FP8.
  LinearMode wgrad = LinearMode::FP8_BLOCK;
  // The consistent mode (precision.consistent; set on both engines together by the recipe): every
  // op of the forward computes each row (token) independently of the batch it is in, with one
  // kernel and one reduction order whatever the batch (LinearSpec::consistent,
  // PagedBatch::batch_invariant, token_logprobs' fixed vocabulary chunks), and the trainer's
  // forward attends through a paged cache of the generator's KV dtype with the paged attention
  // kernel of generation (transformer.cpp). So on the same weights the trainer's log-prob of a
  // sampled token is bitwise the generator's (docs/design.md, "The consistent mode"). The
  // trainer's kv_cache is then the generator's cache dtype (F32, BF16 or E4M3), which its
  // attention reads through. Dense models only; no fp8_attention.
  bool consistent = false;
  // With consistent: the 7 linears of each block on the row-invariant kernels too (the bitwise
  // mode). false ("consistent=attn"): everything else of the consistent mode (the attention over
  // the generator's cache, the lm_head's logits and log-softmax) but the linears on the fast
  // kernels, whose accumulation order depends on M: not bitwise, but the quantizers' inputs
  // differ only by those orders, not by a different attention.
  bool consistent_linears = true;
  // With consistent: where the two engines' attention meets (consistent=flash). false: the
  // trainer's forward attends through a paged cache with the generator's decode kernel (above).
  // true: the generator's decode attention runs in the trainer's flash-attention order
  // (PagedBatch::flash_order: each token's row bitwise flash attention's over the cache's values)
  // and the trainer keeps its flash attention with the usual KV rounding — the consistent
  // attention at the fast kernels' cost. Set with consistent_linears false; the linears then agree
  // where their sums round nowhere (pow2 scales: docs/design.md).
  bool consistent_flash = false;
  // With consistent: the lm_head's logits and the sampled token's log-prob by token_logprobs'
  // fixed vocabulary chunks in F32 on both engines (the generator's logp_gen bitwise the trainer's
  // logp_old). false (precision.consistent_logits=false, recipe spec logits=fast): each engine's
  // own head (the generator's BF16 decode logits and sampler reduction, the trainer's usual
  // token_logprobs), so the engines agree bitwise up to the final hidden state and their log-probs
  // differ by the last product's rounding alone — which no quantizer downstream amplifies.
  bool consistent_logits = true;
  // The consistent head above in force.
  bool exact_logits() const { return consistent && consistent_logits; }
  // Everything else (embedding, norms, RoPE, softmax, SiLU, lm_head, loss) stays in high
  // precision: FP32 on the CPU backend, BF16 storage with FP32 math on the CUDA backend.

  // The mode of the linears of block `layer` out of `num_layers`.
  LinearMode linear_for_layer(int layer, int num_layers) const {
    if (linear == LinearMode::FP8_BLOCK &&
        (layer < bf16_first_layers || layer >= num_layers - bf16_last_layers))
      return LinearMode::BF16;
    return linear;
  }
};

struct PrecisionRecipe {
  std::string name = "bf16";
  EnginePrecision generator;
  EnginePrecision trainer;
  // The consistent mode (EnginePrecision::consistent) of both engines.
  bool consistent() const { return generator.consistent && trainer.consistent; }
  // Turns the consistent mode on or off on both engines; on: the trainer's kv_cache becomes the
  // generator's cache dtype. Throws (saying what to change) when the recipe cannot be consistent:
  // fp8_attention (the trainer's attention backward has no FP8 form).
  void set_consistent(bool on);
  // The consistent mode by name (precision.consistent, the recipe spec's consistent=): off, on
  // (set_consistent(true), row-invariant linears), attn (consistent_linears off) or flash (also
  // consistent_flash), on both engines. Throws on any other name.
  void set_consistent_mode(const std::string& mode);
  // Presets: "fp32" (exact reference), "bf16", "fp8_gen" (FP8 generation + FP8 KV, BF16
  // training), "fp8_e2e" (FP8 both, FP8 KV, BF16 weight gradients). Both FP8 presets have the
  // trainer round k/v as the E4M3 cache stores them. Throws on anything else.
  static PrecisionRecipe preset(const std::string& name);
  // A preset with overrides, for experiments that isolate one component (bench rl-step):
  // "PRESET[:key=value[+key=value...]]" with keys gen / train (linear: fp32|bf16|fp8),
  // kv (f32|bf16|e4m3), tkv (trainer: bf16|e4m3 = round k/v as the generator's E4M3 cache does),
  // attn (fp8|off), pow2 (on|off), first / last (BF16 blocks, both engines), wgrad (fp8|bf16:
  // trainer.wgrad), consistent (on|off|attn|flash: the consistent mode, set_consistent; applied last;
  // attn: with consistent_linears off; flash: also with consistent_flash), logits (exact|fast:
  // consistent_logits, with a consistent mode).
  // E.g. "fp8_e2e:kv=bf16" = FP8 linears in both engines over a BF16 KV cache. The recipe's name
  // is the whole spec. Throws on an unknown preset, key or value.
  static PrecisionRecipe parse(const std::string& spec);
};

}  // namespace fp8rl
