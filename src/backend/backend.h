// The op interface. The model, the rollout engine and the trainer are written once over it;
// the CPU backend (backend/cpu/) is the readable reference of every op, the CUDA backend
// (backend/cuda/) the fast path, tested op by op against the CPU one.
//
// Conventions
// - Tensors are contiguous, row-major, on the backend's device; shapes in comments.
// - "written" outputs are overwritten; "accumulated" outputs are added to (gradients).
// - Activations use act_dtype(): F32 on the CPU; on CUDA BF16 by default, F32 when the backend
//   is made with act_dtype F32 (make_cuda_backend). Math is FP32 inside.
// - Token-major packing: a batch of sequences is concatenated along tokens, T = sum of lengths;
//   cu_seqlens[B+1] (host) gives each sequence's token range.
// - Every op has one contract, checked once before a backend runs it: the public ops are
//   non-virtual, check their arguments (backend.cpp) and call the backend's protected *_impl.
//   A broken contract throws fp8rl::Error saying what is wrong, naming the op and argument.
// - Data errors only the device can see (an out-of-range id, a non-finite FP8 quantizer input)
//   may be raised by the op itself (CPU) or at the backend's next synchronizing call
//   (synchronize, a copy to/from the host, a reduction, sample, quantize) on the GPU, whose ops
//   do not stall the stream to check; either way they are raised, once, naming the op.
// - The CPU backend also accepts F64 tensors in every float argument (FP64 gradient checks);
//   it computes in double and rounds once into each output's dtype. Saved statistics (rstd,
//   lse) may then be F64 too, and should be for gradient checks.
// - "Accumulated" weight gradients (dw, dbias, dtable, dlm_head) may also be BF16
//   (train.grad_dtype: bf16): each op adds its whole contribution in FP32 (CPU: double) and rounds
//   the sum into the BF16 gradient once per call (CUDA: through an F32 copy of the gradient, or
//   a BF16 GEMM's epilogue adding into it: the BF16 wgrads and the lm_head's).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/sampling.h"
#include "core/precision.h"
#include "core/tensor.h"
#include "quant/quant.h"

namespace fp8rl {

// A linear layer's weight W[N, K] (+ bias[N]). `w` is the high-precision weight (FP32 master
// on the trainer, or BF16). `wq`, when defined, is the pre-quantized 128x128 FP8 copy: the
// generator's (refit writes it; no `w`), or the trainer's cache of quantize_128x128(w), made
// once per optimizer step. In FP8_BLOCK a defined `wq` is THE quantized weight of the forward
// and of dgrad (as W^T: the same 128x128 blocks and scales, transposed), and `w` is not read;
// when `wq` is undefined the op quantizes `w` itself. So with both defined, `wq` must be the
// quantization of `w` (the caller's invariant). `wqt`, when defined, is that quantization's
// exact transpose W^T [K, N] (data and scale grid transposed: transpose_128x128(wq), which is
// also quantize(w, transpose=true) with 128x128 blocks), kept by the trainer beside `wq` so the
// FP8 dgrad reads it instead of transposing per call; the caller's invariant again. A defined
// `wq` / `wqt` must have been quantized with the spec's pow2 setting (checked). In FP8_BLOCK the
// output is the exact product of the dequantized operands rounded once to the output dtype on
// the CPU (FP32 per-block accumulation on the GPU).
struct LinearWeight {
  Tensor w;         // [N, K]
  QuantTensor wq;   // E4M3 [N, K], 128x128 blocks (optional)
  QuantTensor wqt;  // E4M3 [K, N], 128x128 blocks: wq transposed (optional; FP8 dgrad only)
  Tensor bias;      // [N] (optional)
  int64_t out_features() const { return w.defined() ? w.dim(0) : wq.rows(); }
  int64_t in_features() const { return w.defined() ? w.dim(1) : wq.cols(); }
};

struct LinearSpec {
  LinearMode mode = LinearMode::FP32;
  bool pow2_scales = false;
  // FP8_BLOCK only: the weight gradient's GEMM, FP8_BLOCK (dY^T and X^T requantized 1x128 along
  // tokens) or BF16 (the unquantized dY and X rounded to BF16). Ignored by the other modes.
  LinearMode wgrad = LinearMode::FP8_BLOCK;
  // The consistent mode (EnginePrecision::consistent): the forward product of each row of x is
  // the same bits whatever the other rows (M) are — one kernel and one summation order for
  // every M. CPU: always so (each output is one double dot product in a fixed order). CUDA: FP8
  // on the own sm_90a kernel at one split (any M, no tail product), BF16 / FP32 GEMMs on one
  // cuBLASLt algorithm per (N, K) without split-K (GemmEngine::gemm's row_invariant). Forward
  // products only (linear, linear_shared_input, token_logprobs' logits); backward GEMMs ignore it.
  bool consistent = false;
};

// token_logprobs with spec.consistent splits the vocabulary into chunks of this many ids (the
// last one shorter), on every backend and whatever T: a chunk's logits are exactly
// linear(hidden, lm_head rows [v0, v0 + n), spec) written in F32, so a caller computing logits
// with linear over the same chunks (the generator in the consistent mode) gets those values,
// and logprobs_of_logits folds them in the same chunks.
constexpr int64_t kConsistentVocabChunk = 4096;
// The (token, head) pairs of a query run that a model builds for a sequence scored whole
// (PagedBatch::query_runs): runs of kQueryRunColumns / group tokens. CUDA: the wide query-run
// CTAs (8 warps, a block of 8 MMA columns each, every K/V tile converted once for the run;
// paged_attention_run_tokens). Measured on the H100 (session 25, docs/benchmarks.md): the 1.7B
// consistent trainer's attention 359 us per 8k-token call in 64-column runs against 637 in runs
// of 8 columns (one block per CTA) and 623 in runs of 16 (flash attention: 140); FP8RL_QUERY_RUN_COLUMNS=8 or 16
// (transformer.cpp) builds the narrower runs again, for A/B (the same bits).
constexpr int kQueryRunColumns = 64;

// The 1x128 E4M3 copy of an activation x [M, K] that a fused producer (rmsnorm_fp8,
// add_rmsnorm, swiglu_fp8) writes together with x, for the FP8 linears that read x: passed to
// linear / linear_shared_input, it stands for their own quantization of x, and is bitwise that
// quantization (the producer quantizes the x it stores, with the one scale rule of quant.h).
// The same for an output gradient dy [M, N] (swiglu_backward_fp8, add_fp8 -> linear_backward's
// dgrad, which quantizes dy 1x128 along N: the same layout).
// Allocate with Backend::alloc_fp8_view; the producer fills q, scales_gemm_layout and source.
struct Fp8View {
  QuantTensor q;  // E4M3 [M, K], 1x128 blocks; scales: M * ceil(K / 128) F32 values
  // Scales block-major, value (r, b) at [b * M + r] (cuBLASLt's VEC128 layout: the CUDA
  // producer writes it when M % 16 == 0, so the GEMM needs no layout kernel), else row-major
  // [M, ceil(K / 128)] as QuantTensor says.
  bool scales_gemm_layout = false;
  const void* source = nullptr;  // raw() of the x it quantizes: a consumer checks it is given that x
  bool defined() const { return q.defined(); }
};

// Rotary embedding. Non-interleaved (rotate_half, as HF Llama/Qwen): dims i and i + hd/2 form
// pair i. Interleaved (DeepSeek-V3's rope_interleave): dims 2i and 2i + 1 form
// pair i, rotated in place. (HF's apply_rotary_pos_emb_interleave writes the rotated pairs
// de-interleaved, evens then odds: a fixed permutation of the dims applied to q and k alike,
// which leaves every q.k, hence the attention, unchanged.) inv_freq has head_dim/2 entries
// (llama3 scaling already applied by model config code); angle = pos * inv_freq[i], computed
// in FP32 as HF does.
struct RopeParams {
  std::vector<float> inv_freq;     // [head_dim / 2]
  float attention_scaling = 1.0f;  // multiplies cos and sin (1 for the supported rope types)
  bool interleaved = false;
};

struct AdamWParams {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based, for bias correction
  // Multiplies the gradient before use (the clipping factor: a BF16 gradient is then not rounded a
  // second time by scaling it in place).
  float grad_scale = 1.0f;
  // BF16 moments only (backend/adamw_rule.h): round m and v stochastically instead of to nearest,
  // with bits drawn from (rounding_key, step, element); the caller gives each tensor its own key.
  bool stochastic_rounding = false;
  uint64_t rounding_key = 0;
};

// Paged KV cache, flashinfer style (NHD): per layer one K and one V pool of
// [num_pages, page_size, num_kv_heads, head_dim]. Storage dtype F32, BF16 or E4M3; with E4M3
// the stored value is e4m3(x / scale) and the read value e4m3_to_float(q) * scale, with FP32
// scales per layer and KV head (k_scale/v_scale [num_layers, num_kv_heads], on the device;
// per-layer calibration writes the same value to every head). Refit replaces the scales.
// MLA's latent cache (latent_v_dim > 0; DeepSeek / vLLM / FlashMLA): one K row per token and
// KV head ([latent | rope key], head_dim wide) and no V pools: the V of a position is the first
// latent_v_dim values of its K row (the latent), read with k_scale (v_scale is unused).
struct KvCache {
  int num_layers = 0, num_pages = 0, page_size = 16, num_kv_heads = 0, head_dim = 0;
  int latent_v_dim = 0;  // > 0: V = K[..., :latent_v_dim], v pools empty (MLA)
  DType dtype = DType::BF16;
  std::vector<Tensor> k, v;  // per layer: [num_pages, page_size, num_kv_heads, head_dim] (v: none when latent)
  Tensor k_scale, v_scale;   // F32 [num_layers, num_kv_heads]
  int v_dim() const { return latent_v_dim > 0 ? latent_v_dim : head_dim; }  // V's width (the output's)
};

// The query tokens of one paged-attention call (a prefill chunk, a decode step, or both).
struct PagedBatch {
  Tensor token_seq;   // I32 [T]: row of page_table of the token's sequence
  Tensor token_pos;   // I32 [T]: position of the token in its sequence; it attends to 0..pos
  Tensor slots;       // I32 [T]: cache slot written for the token = page * page_size + offset
  Tensor page_table;  // I32 [B, max_pages]: pages of each sequence, in order
  int max_pos = 0;    // host: the largest token_pos + 1 (kernel sizing)
  // The consistent mode: each token's output depends only on its q row, its position and its
  // sequence's cached K/V, not on the other tokens of the batch, T or max_pos — one kernel and
  // a split of the positions fixed by the position alone (CUDA: chunks of kPagedInvariantChunk
  // positions, FP8RL_CUDA_PAGED_SPLITS ignored). The CPU reference is always so.
  bool batch_invariant = false;
  // The consistent mode's flash order (EnginePrecision::consistent_flash): each token's output is
  // bitwise what `attention` (the trainer's flash attention) gives its row over the values the
  // cache hands out (E4M3: code * scale rounded to the activation dtype, as kv_round) — the same
  // key tiles from position 0, the same fragments, reductions and normalization (CUDA:
  // flash_decode_kernel; no lse, no FP8 attention). Batch-invariant too. The CPU reference's
  // attention_paged and attention already agree row for row, so it ignores the flag.
  bool flash_order = false;
  // Optional (a hint; results are the same bits without it): I32 [R, 2] {first token, count} runs
  // covering every token once, each run consecutive tokens of one sequence at consecutive
  // positions (e.g. a sequence scored whole), of at most query_run_tokens tokens. A backend may
  // read a run's K/V once for all its tokens (CUDA: paged_attention_run_tokens(group) tokens
  // fill the tensor-core kernel's MMA columns).
  Tensor query_runs = Tensor();
  int query_run_tokens = 0;
};

// A recorded sequence of ops (a CUDA graph) that replays with the same buffers: refill the
// tensors the recorded ops read (same addresses), then replay(). Must not outlive its backend.
class OpGraph {
 public:
  virtual ~OpGraph() = default;
  virtual void replay() = 0;
};

// Device memory accounting of a backend (memory_stats). Bytes; "used" counts the live tensors
// and scratch buffers the backend allocated, "reserved" what its allocator holds from the
// device (>= used: a caching allocator keeps freed memory for reuse). Peaks since the backend
// was made or since reset_peak_memory_stats().
struct MemoryStats {
  int64_t used_bytes = 0, peak_used_bytes = 0;
  int64_t reserved_bytes = 0, peak_reserved_bytes = 0;
};

// Slow paths a backend took (since it was made). Each is also reported on stderr once per shape
// when first taken; the RL loop logs them per step and the GPU tests require zero fallbacks on
// the benchmark shapes. The CPU reference has none.
struct BackendCounters {
  int64_t fp8_gemm_fallbacks = 0;  // FP8 products computed as dequantize + FP32 GEMM off the exact path
  int64_t fp8_gemm_own = 0;        // FP8 products on the own sm_90a kernel (the rest: cuBLASLt)
  int64_t fp8_gemm_lt_fixed = 0;   // consistent FP8 products on cuBLASLt's probed fixed algorithm
  int64_t fp8_gemm_tails = 0;      // FP8 products whose last M % 16 rows ran as a padded second product
  int64_t grouped_loops = 0;       // groups of grouped (expert) products run as one product each
  int64_t paged_runs_off = 0;      // paged-attention calls whose query runs ran as one CTA per token
  int64_t concat_products = 0;     // linear_shared_input / linear_swiglu groups run as one concatenated product
  int64_t gemm_tuned = 0;          // GEMM shapes whose cuBLASLt configuration was tuned (CUDA: GemmEngine)
  int64_t gemm_tuned_changed = 0;  // of them, those that run another configuration than the heuristic's
  double gemm_tune_ms = 0.0;       // host time the tuning took
  int64_t gemm_heuristics = 0;     // cuBLASLt heuristic queries (one per new product shape: M included)
  double gemm_heuristic_ms = 0.0;  // host time those queries took (the stream waits on it inside the op)
};

// A mixture-of-experts block's slots sorted by expert (the rows of its expert GEMMs), on the host:
// the T k slots of experts [T * k] (slot t * k + j: token t's j-th expert), each in [0, E) (an
// Error otherwise), counted per expert: offsets [E + 1] (offsets[e]: the rows of the experts
// below e); row r of the permuted rows holds slot row_slot[r] and slot s sits in row slot_row[s],
// the slots of one expert in slot order (stable).
struct MoeSlotSort {
  std::vector<int64_t> offsets;
  std::vector<int32_t> row_slot, slot_row;
};
MoeSlotSort moe_sort_slots(const int32_t* experts, int64_t slots, int64_t num_experts);
// The grouped kernels' tile table of such a sort: per expert in order, its rows in tiles of block_m,
// each {expert, first row, end row (the expert's), 0}. At most moe_plan_max_tiles entries.
std::vector<int32_t> moe_tiles(const std::vector<int64_t>& offsets, int block_m);
int64_t moe_plan_max_tiles(int64_t slots, int64_t num_experts, int block_m);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceKind device() const = 0;
  virtual std::string name() const = 0;
  virtual DType act_dtype() const = 0;
  // Whether this backend's kernels take float dtype t (ggml's supports_op, for dtypes): the
  // contracts check every float tensor argument with it. stat: a tensor the interface calls F32
  // (saved statistics, logits, log-probs, routing weights, the FP32 master). The CPU reference
  // takes F32, BF16, F16 and F64 everywhere (it computes in double); CUDA F32 and BF16, and F32
  // where the interface says F32. Element-wise ops (convert, fill, add, scale, sum_squares,
  // all_finite) leave the dtype to the backend's kernels.
  virtual bool takes_float(DType t, bool stat) const = 0;
  // The row count whose multiples every product of this backend takes on its fast path: CUDA
  // 16 (cuBLASLt's FP8 block GEMMs want M % 16 == 0; other M pays a tail product), the CPU 1.
  // The trainer pads its micro-batches to it (TrainerOptions::pad_tokens_to).
  virtual int64_t row_granule() const { return 1; }

  // ---- memory ----------------------------------------------------------------------------
  virtual Tensor alloc(const Shape& shape, DType dtype) = 0;
  // Copies between the host and this device or within it; same dtype and numel.
  void copy(const Tensor& src, Tensor& dst);
  // Element-wise dtype conversion on this device (F32 <-> BF16 <-> F16; F64 on the CPU), same
  // numel. Rounds to nearest even (F64 -> BF16/F16 goes through F32).
  void convert(const Tensor& src, Tensor& dst);
  // Many conversions in one call (the trainer's per-step BF16 weight copies): bitwise convert(src,
  // dst) for each job; CUDA converts F32 -> BF16 tensors of whole 16-byte chunks many per launch.
  struct ConvertJob {
    const Tensor* src;
    Tensor* dst;
  };
  void convert_many(const std::vector<ConvertJob>& jobs);
  void fill(Tensor& t, float value);
  // A column block copy between 2-D views of one dtype: dst[r, dst_col + c] = src[r, src_col + c]
  // for r < R, c < cols, where src is viewed as [R, Cs] and dst as [R, Cd] (each by its last
  // dim: R = numel / Cs = numel / Cd). Column slices and concatenations (MLA's nope | rope).
  void copy_cols(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols);
  virtual void synchronize() {}
  // Device memory accounting (CUDA); the CPU backend reports zeros.
  virtual MemoryStats memory_stats() { return {}; }
  virtual BackendCounters counters() const { return {}; }
  // The per-op time table gathered since the last call (CUDA with FP8RL_CUDA_PROFILE=1: summed
  // stream time per op), printed to stderr under `title` when `print`, then cleared. No-op elsewhere.
  virtual void profile_report(const std::string& title, bool print) {
    (void)title;
    (void)print;
  }
  virtual void reset_peak_memory_stats() {}
  // Whether the products that follow may have their GEMM configuration tuned at first sight (CUDA:
  // GemmEngine's per-product tuning, ~50 ms of host time per new shape); returns the previous
  // setting. On by default; the trainer turns it off for its passes: its micro-batches' shapes
  // change from step to step, so tuning them would cost host time in every step and never pay back
  // (a configuration tuned earlier is still used: tuning never changes a product's bits).
  virtual bool set_gemm_tuning(bool on) { return on; }
  // Bytes this process could still allocate on the device now (CUDA: cudaMemGetInfo's free plus
  // what this backend's cache holds unused); -1 = not known (the CPU backend: host memory is
  // not checked).
  virtual int64_t free_device_bytes() { return -1; }
  Tensor to_device(const Tensor& host);  // allocates on this device and copies
  Tensor to_host(const Tensor& dev);     // allocates on the host and copies
  QuantTensor alloc_quant(int64_t rows, int64_t cols, int block_rows, int block_cols, bool pow2);

  // Records the ops that `ops` issues, without running them, into a graph to replay later;
  // nullptr when this backend cannot record (the CPU; CUDA with FP8RL_CUDA_GRAPHS=0 or plain
  // allocation): the caller then just calls `ops`. Rules while recording: no synchronizing
  // call (it fails), every tensor `ops` allocates is released inside it, and `ops` must have
  // run once unrecorded with the same shapes (so scratch buffers have their size). Data errors
  // of replays (flag_check) surface at the next synchronizing call.
  virtual std::unique_ptr<OpGraph> record(const std::function<void()>& ops) {
    (void)ops;
    return nullptr;
  }

  // ---- element-wise and reductions -------------------------------------------------------
  void add(const Tensor& a, const Tensor& b, Tensor& out);  // out = a + b (out may alias a)
  void scale(Tensor& x, float s);                           // x *= s
  double sum_squares(const Tensor& x);                      // sum x^2 (F32/BF16), FP64 result
  // sum_squares of each tensor, added in order on the host: bitwise the loop of sum_squares, with
  // one synchronization for all (the gradient norm over thousands of expert tensors).
  double sum_squares_total(const std::vector<const Tensor*>& xs);
  bool all_finite(const Tensor& x);
  // acc[i] = max(acc[i], max |x|): x F32/BF16/F64, acc F32 [n] on this device with acc[i] >= 0
  // (or NaN), 0 <= i < n; NaN when x holds a NaN. Asynchronous on a device: the forward collects
  // every layer's q/k/v amax into one tensor and reads it once (FP8 KV-scale calibration). The
  // default reduces on the host; backends override it with a device reduction.
  void amax(const Tensor& x, Tensor& acc, int64_t i);

  // ---- model ops ---------------------------------------------------------------------------
  // out[t] = table[ids[t]]; ids I32 [T] (out of range is an error), table [V, D], out [T, D].
  void embedding(const Tensor& ids, const Tensor& table, Tensor& out);
  // dtable[ids[t]] += dout[t]; dtable F32 [V, D] accumulated.
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

  // out = x / sqrt(mean(x^2) + eps) * w over the last dim. x, out [R, D]; w [D];
  // rstd F32 [R] written when defined (saved for backward).
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd);
  // dx [R, D] written; dw F32 [D] accumulated.
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dx,
                        Tensor& dw);

  // ---- fused producers of FP8 linear inputs (backend.h, Fp8View) ----
  // Each is bitwise its unfused form followed by quantize(out, false, fp8.q) (1x128 along the
  // last dim, fp8.q.pow2 as allocated); the default runs exactly that, a backend may fuse it.
  // fp8 must come from alloc_fp8_view(rows, last dim, pow2).
  // rmsnorm(x, w, eps, out, rstd), then out's FP8 copy into fp8.
  void rmsnorm_fp8(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8);
  // rmsnorm(x, w) into out, then rope(out, positions, rope, inverse=false): Qwen3's q/k-norm
  // and RoPE in one pass. x, out [T, H, head_dim] (distinct), w [head_dim], positions I32 [T],
  // rstd F32 [T * H]. The same values as the two ops, out rounded to its dtype between them.
  void rmsnorm_rope(const Tensor& x, const Tensor& w, float eps, const Tensor& positions, const RopeParams& rope,
                    Tensor& out, Tensor* rstd);
  // sum = a + b (may alias a), then rmsnorm(sum, w, eps, out, rstd) — the residual add and the
  // next norm — and, when fp8 is non-null, out's FP8 copy. a, b, sum, out [R, D].
  void add_rmsnorm(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out, Tensor* rstd,
                   Fp8View* fp8);
  // swiglu(gate, up, out), then out's FP8 copy into fp8 (the down projection's input).
  void swiglu_fp8(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8);
  // add(a, b, out) (out may alias a), then out [R, D]'s FP8 copy into fp8: the residual
  // stream's gradient, the output gradient of the o and down projections (their FP8 dgrads).
  void add_fp8(const Tensor& a, const Tensor& b, Tensor& out, Fp8View& fp8);
  // swiglu_backward(dout, gate, up, dgate, dup), then dgate's FP8 copy into dgate_fp8 and dup's
  // into dup_fp8 (the output gradients of the gate and up projections, for their FP8 dgrads).
  void swiglu_backward_fp8(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup,
                           Fp8View& dgate_fp8, Fp8View& dup_fp8);
  // An empty view for an activation [rows, cols] (1x128 blocks, pow2 scales when asked).
  Fp8View alloc_fp8_view(int64_t rows, int64_t cols, bool pow2);

  // out[M, N] = x[M, K] W^T (+ bias) under `spec` (FP8: x quantized 1x128 along K, W 128x128).
  // x_fp8 (FP8_BLOCK only; ignored by the other modes): x's FP8 copy from a fused producer,
  // used instead of quantizing x (the result is the same bits); it must have been made from
  // this x ([M, K], source == x.raw(), the spec's pow2): anything else is an error.
  void linear(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
              const Fp8View* x_fp8 = nullptr);
  // linear() of one input through several weights of equal in_features (q/k/v, gate/up):
  // *outs[i] = x W[i]^T, each bitwise what linear(x, *W[i], spec, *outs[i]) writes. A backend
  // may share work between them (CUDA FP8: x quantized once, or not at all with x_fp8); the
  // default calls linear().
  void linear_shared_input(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                           const std::vector<Tensor*>& outs, const Fp8View* x_fp8 = nullptr);
  // linear() written into columns [col0, col0 + N) of a wider out [M, Ntotal] (the consistent
  // generator's vocabulary chunks of its [R, V] logits): the bits linear() writes into [M, N],
  // then copy_cols; the other columns untouched. The default is exactly that composition; CUDA
  // writes BF16 / FP32 products in place (the GEMM's output row stride).
  void linear_cols(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out, int64_t col0);
  // out [M, V] = x w^T (w [V, K], no bias) as linear_cols of w's row chunks of `chunk` rows, in
  // order, the last one shorter: the bits token_logprobs' consistent chunks compute (the
  // consistent generator's logits). CUDA runs the whole chunks as one GEMM on the chunks'
  // algorithm where a probe on its first call found that the same bits (BF16 / FP32 only).
  void linear_chunked(const Tensor& x, const Tensor& w, const LinearSpec& spec, int64_t chunk, Tensor& out);
  // The SwiGLU MLP's first half: gate = x Wg^T, up = x Wu^T [M, F], act = swiglu(gate, up), with
  // act's FP8 copy in act_fp8 when given (the down projection's input: swiglu_fp8's). keep: gate
  // and up hold the products on return (the backward's inputs); otherwise they are scratch that a
  // backend may leave unwritten (CUDA at decode sizes: one concatenated product that the swiglu
  // reads in place, no split). act's values are those of linear_shared_input(x, {Wg, Wu}) then
  // swiglu / swiglu_fp8, bit for bit. x_fp8 as linear's.
  void linear_swiglu(const Tensor& x, const LinearWeight& gate_w, const LinearWeight& up_w, const LinearSpec& spec,
                     Tensor& gate, Tensor& up, bool keep, Tensor& act, Fp8View* act_fp8,
                     const Fp8View* x_fp8 = nullptr);
  // The attention's input products with Qwen3's q/k-norm and RoPE: linear_shared_input(x,
  // {Wq, Wk, Wv}) into q_raw [T, Hq * hd], k_raw [T, Hkv * hd] and v [T, Hkv * hd], then
  // rmsnorm_rope(q_raw as [T, Hq, hd], q_norm -> q, q_rstd) and (k_raw, k_norm -> k, k_rstd), bit
  // for bit. keep: q_raw and k_raw hold the products on return (the backward's inputs); otherwise
  // they are scratch a backend may leave unwritten (CUDA at decode sizes: one concatenated
  // product whose rows one kernel norms, rotates and splits). x_fp8 as linear's. kv (the
  // generator's decode and prefill): then kv_write(*kv->cache, kv->layer, k, v, *kv->batch) as
  // well, bit for bit (CUDA: in the same kernel, so the step has no separate cache write).
  struct KvDest {
    KvCache* cache = nullptr;
    int layer = 0;
    const PagedBatch* batch = nullptr;
  };
  void linear_qkv_norm_rope(const Tensor& x, const LinearWeight& Wq, const LinearWeight& Wk, const LinearWeight& Wv,
                            const LinearSpec& spec, const Tensor& q_norm, const Tensor& k_norm, float eps,
                            const Tensor& positions, const RopeParams& rope, bool keep, Tensor& q_raw, Tensor& k_raw,
                            Tensor& q, Tensor& k, Tensor& v, Tensor* q_rstd, Tensor* k_rstd,
                            const Fp8View* x_fp8 = nullptr, const KvDest* kv = nullptr);
  // linear() of row groups through one weight each (mixture-of-experts layers): rows
  // [offsets[g], offsets[g + 1]) of x [R, K] and out [R, N] go through *W[g] (every W of equal
  // in and out features; offsets from 0 to R, non-decreasing). Each group's rows equal what
  // linear() of those rows writes, within the mode's tolerance (CUDA FP8 with pre-quantized
  // weights: one grouped launch of the own kernel); the default calls linear() per group.
  // x_fp8 (FP8_BLOCK only): x's FP8 copy from a fused producer (swiglu_fp8: the experts' down
  // input), used instead of quantizing x (the same bits), under linear's x_fp8 rule.
  void grouped_linear(const Tensor& x, const std::vector<int64_t>& offsets, const std::vector<const LinearWeight*>& W,
                      const LinearSpec& spec, Tensor& out, const Fp8View* x_fp8 = nullptr);
  // grouped_linear of the same rows through several weight sets (the experts' gate and up):
  // outs[i] = grouped_linear(x, offsets, W[i]), each under grouped_linear's contract, run one
  // after another on every backend. (The seam for one wider grouped product over each expert's
  // gate|up: CUDA's first form of it — the experts' gate|up allocated as consecutive rows, the
  // concatenated weights built per call, the output split by a kernel — made the FP8 MoE decode
  // slower on an H100, 1.182 s against 1.038 s per rl-step generation, and was removed: session 24.)
  void grouped_linear_shared_input(const Tensor& x, const std::vector<int64_t>& offsets,
                                   const std::vector<std::vector<const LinearWeight*>>& W, const LinearSpec& spec,
                                   const std::vector<Tensor*>& outs, const Fp8View* x_fp8 = nullptr);
  // grouped_linear_shared_input (one weight set: grouped_linear) with the groups' rows known only on
  // the device: moe_plan's offsets I32 [G + 1] and its tile table for plan.block_m (the generator's
  // MoE blocks, which then never wait for the host: no download per block). The same results as
  // the host-offsets op within its tolerance (CUDA: bitwise the host-offsets own grouped kernel,
  // FP8 with pre-quantized weights or BF16 with BF16 weights); the default downloads the offsets
  // and runs the host-offsets op.
  struct MoeDevicePlan {
    Tensor offsets;     // I32 [G + 1]
    Tensor tiles;       // I32 [moe_plan_max_tiles(R, G, block_m), 4]
    Tensor tile_count;  // I32 [1]
    int block_m = 64;
  };
  void grouped_linear_planned(const Tensor& x, const MoeDevicePlan& plan,
                              const std::vector<std::vector<const LinearWeight*>>& W, const LinearSpec& spec,
                              const std::vector<Tensor*>& outs, const Fp8View* x_fp8 = nullptr);
  // The tile rows moe_plan should use for a planned block of `rows` rows over `groups` groups (the
  // backend's grouped kernel's choice; the CPU's is any).
  virtual int moe_plan_block_m(int64_t rows, int64_t groups) const {
    (void)rows, (void)groups;
    return 64;
  }
  // Backward of linear. dx [M, K] written when non-null (dgrad: dY 1x128 along N, W^T);
  // dw F32 [N, K] and dbias F32 [N] accumulated when non-null (wgrad: dY^T and X^T requantized
  // 1x128 along tokens, or with spec.wgrad == BF16 the BF16 GEMM of dY and X). FP8 dgrad uses
  // W.wqt when defined, else W.wq transposed when defined, else quantizes W.w
  // (see LinearWeight); other modes need W.w. dbias is the sum of the unquantized dy.
  // dy_fp8 (FP8_BLOCK only; ignored by the other modes): dy's FP8 copy from a fused producer
  // (swiglu_backward_fp8, add_fp8), used by the dgrad instead of quantizing dy (the same bits); it must
  // have been made from this dy ([M, N], source == dy.raw(), the spec's pow2), as linear's x_fp8.
  void linear_backward(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor* dx,
                       Tensor* dw, Tensor* dbias, const Fp8View* dy_fp8 = nullptr);
  // Backward of grouped_linear: for each group g, rows offsets[g]..offsets[g+1] of dy [R, N]
  // and x [R, K] through W[g], as linear_backward of those rows (no biases): dx [R, K] written
  // when non-null; dw empty (no weight gradients) or one [N, K] gradient per group (F32 or BF16,
  // null: that group's skipped), accumulated. The default calls linear_backward per group; CUDA
  // runs each half as one grouped launch where the mode allows (FP8 dgrad with pre-quantized
  // weights: the own grouped kernel over W^T; BF16 dgrad and BF16 wgrad: cuBLAS grouped).
  // dy_fp8: dy's FP8 copy from a fused producer (swiglu_backward_fp8), as linear_backward's.
  void grouped_linear_backward(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                               const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor* dx,
                               const std::vector<Tensor*>& dw, const Fp8View* dy_fp8 = nullptr);

  // In place on x [T, H, head_dim]; positions I32 [T]. inverse=true rotates by -angle with the
  // same (scaled) cos/sin: the transpose of the forward map, i.e. its backward (the exact
  // inverse only when attention_scaling == 1). cos/sin are FP32 values of the FP32 angle,
  // times attention_scaling in FP32 (as HF's cos/sin cache).
  void rope(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse);

  // Causal grouped-query attention over packed sequences (training and reference prefill).
  // q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hdv], Hq % Hkv == 0; out [T, Hq, hdv]; lse F32
  // [Hq, T] (log-sum-exp of the scaled scores, saved for backward). cu_seqlens host [B + 1].
  // hdv != hd: MLA (v_head_dim != qk_nope + qk_rope; CUDA: the simple kernels).
  void attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu_seqlens,
                 float softmax_scale, Tensor& out, Tensor& lse);
  // dq [T, Hq, hd], dk [T, Hkv, hd], dv [T, Hkv, hdv] written.
  void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const std::vector<int32_t>& cu_seqlens, float softmax_scale, Tensor& dq,
                          Tensor& dk, Tensor& dv);

  // out = silu(gate) * up; all [T, F].
  void swiglu(const Tensor& gate, const Tensor& up, Tensor& out);
  // dgate, dup [T, F] written.
  void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup);

  // Fused lm_head + log-softmax + gather, in vocabulary chunks (no [T, V] FP32 logits):
  // logits = hidden[T, D] lm_head[V, D]^T / temperature (lm_head in `spec` precision);
  // logp[t] = log_softmax(logits[t])[targets[t]]; lse F32 [T] saved for backward;
  // entropy F32 [T] written when non-null. targets I32 [T], each in [0, V) (no ignore index:
  // out of range is an error); logp F32 [T]; temperature > 0. spec.consistent: each row's
  // logp, lse and entropy do not depend on the other rows (T): chunks of kConsistentVocabChunk.
  void token_logprobs(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, float temperature,
                      const LinearSpec& spec, Tensor& logp, Tensor& lse, Tensor* entropy);
  // Given dlogp F32 [T]: dhidden [T, D] written; dlm_head F32 [V, D] accumulated when non-null.
  // The logits' gradient goes through the lm_head GEMM's backward in `spec` numerics (the
  // same operand roundings/quantizations as linear_backward).
  void token_logprobs_backward(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, float temperature,
                               const LinearSpec& spec, const Tensor& lse, const Tensor& dlogp, Tensor& dhidden,
                               Tensor* dlm_head);
  // token_logprobs' consistent reduction over logits already computed (the consistent
  // generator's head: model_forward_paged): logits F32 [R, V], targets I32 [R] each in [0, V)
  // (out of range: an error, as token_logprobs'), temperature > 0; logp and lse F32 [R]
  // written. The rows are folded in the vocabulary chunks of kConsistentVocabChunk with
  // token_logprobs' own kernels, in place (no copy of a chunk), so when logits holds the chunk
  // products token_logprobs with spec.consistent computes (linear of each lm_head chunk in F32),
  // logp and lse are bitwise that op's: logp_gen without a second lm_head GEMM.
  void logprobs_of_logits(const Tensor& logits, const Tensor& targets, float temperature, Tensor& logp, Tensor& lse);

  // ---- mixture of experts (model/transformer.cpp, moe_forward) ---------------------------------
  // A token's k routing slots are numbered t * k + j. The model sorts the T * k slots by expert
  // on the host (the per-expert row counts size the expert GEMMs); row r of the permuted
  // activations [R = T * k, D] holds slot row_slot[r], and slot s sits in row slot_row[s].
  //
  // Softmax routing (Qwen3-MoE, Mixtral): p = softmax(logits[t]) over all E experts; the top_k
  // largest p (descending; ties: the lower expert id first) give experts I32 [T, k] and weights
  // [T, k] = their p, divided by their sum when `renormalize`. logits F32 [T, E] (F64 on the
  // CPU); weights F32 (F64 on the CPU, for gradient checks); math in FP32 (CPU: double).
  void moe_route_softmax(const Tensor& logits, int top_k, bool renormalize, Tensor& experts, Tensor& weights);
  // The routing's backward: dlogits [T, E] (logits' dtype) written from dweights [T, k]; the
  // selection is piecewise constant, so only the weights carry a gradient.
  void moe_route_softmax_backward(const Tensor& logits, const Tensor& experts, bool renormalize, const Tensor& dweights,
                                  Tensor& dlogits);
  // DeepSeek-V3 routing (topk_method noaux_tc, scoring_func sigmoid): s = sigmoid(logits)
  // (FP32); choice c = s + bias (e_score_correction_bias [E] F32, or null for none); the E experts
  // form n_group equal groups of consecutive ids, a group's score is the sum of its two largest
  // c (its one c when a group has one expert); the topk_group best groups are kept (ties: the
  // lower group) and the other experts' c set to 0 (as transformers and DeepSeek's reference
  // code, not -inf); experts = the top_k largest c (descending; ties: the lower id); weights =
  // their *uncorrected* s, divided by (sum + 1e-20) when `renormalize`, times `scaling`
  // (routed_scaling_factor). Shapes as moe_route_softmax.
  void moe_route_sigmoid(const Tensor& logits, const Tensor* bias, int top_k, int n_group, int topk_group,
                         bool renormalize, float scaling, Tensor& experts, Tensor& weights);
  // Its backward: dlogits [T, E] written (nonzero only at the selected experts).
  void moe_route_sigmoid_backward(const Tensor& logits, const Tensor& experts, bool renormalize, float scaling,
                                  const Tensor& dweights, Tensor& dlogits);
  // Routing replay (train.routing_replay: the trainer uses the generator's experts): the weights of
  // GIVEN experts I32 [T, k] (each in [0, E); a data error otherwise) from these logits, computed
  // as the routing op above computes them for its own selection: softmax, p = softmax(logits[t])
  // over all E experts, weights = p[experts[t, j]] (/ their sum over j when `renormalize`);
  // sigmoid, s = sigmoid(logits[t]), weights = s[experts[t, j]] (/ (sum + 1e-20) when
  // `renormalize`) times `scaling` (no bias, no groups: they only select). Given the routing op's
  // own experts, the weights equal its weights bitwise (one shared formula per backend). The
  // backward is moe_route_*_backward with these experts.
  void moe_route_softmax_weights(const Tensor& logits, const Tensor& experts, bool renormalize, Tensor& weights);
  void moe_route_sigmoid_weights(const Tensor& logits, const Tensor& experts, bool renormalize, float scaling,
                                 Tensor& weights);
  // out[r] = x[row_slot[r] / top_k] * (weights ? weights[row_slot[r]] : 1). x [T, D];
  // row_slot I32 [R], each in [0, T * top_k); weights [T * top_k] (F32/F64) or null; out [R, D].
  // Forward: the gather of the expert inputs; backward: the weighted gather of dy.
  void moe_permute(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights, Tensor& out);
  // moe_permute(x, row_slot, top_k, weights, out), and out's 1x128 FP8 copy into outq
  // (alloc_fp8_view(R, D, pow2), bound to out): the experts' FP8 input (forward) or the down
  // dgrad's dY (backward, weighted). xq (no weights only): x's copy written by its producer
  // (add_rmsnorm), whose rows the backend may gather instead of quantizing R rows (a 1x128 block
  // never crosses a row, so the gather is bitwise the quantization of out).
  void moe_permute_fp8(const Tensor& x, const Fp8View* xq, const Tensor& row_slot, int top_k, const Tensor* weights,
                       Tensor& out, Fp8View& outq);
  // MLA's absorbed products over all H heads of a layer (generation's latent attention), w =
  // kv_b_proj's weight [H (nope + dv), kvr] (head h's rows: W_k [nope, kvr], then W_v [dv, kvr]),
  // x [T, H, *] and out [T, H, *] read and written at a column offset within each head:
  //   keys (values false): out[t, h, out_col0 + j] = sum_{i < nope} x[t, h, x_col0 + i] W_k[h][i, j], j < kvr;
  //   values (true):       out[t, h, out_col0 + j] = sum_{i < kvr} x[t, h, x_col0 + i] W_v[h][j, i], j < dv.
  // Other columns of out untouched. FP32 products and sums of the operands as stored (the default:
  // each head as an FP32-spec linear_backward / linear over copied columns; CUDA: one strided
  // batched GEMM when x and w share a dtype).
  void mla_absorb(const Tensor& x, int64_t x_col0, const Tensor& w, int64_t nope, int64_t dv, bool values, Tensor& out,
                  int64_t out_col0);
  // out[t] = sum_j (weights ? weights[t*k + j] : 1) * y[slot_row[t*k + j]] over j = 0..k-1 in
  // order, accumulated in FP32 (CPU: double), written. y [R, D]; slot_row I32 [T * k], each in
  // [0, R); out [T, D] with k = slot_row.numel() / T. Forward: the weighted un-permute; backward
  // (no weights): the gradient of the gather. Deterministic (no atomics).
  void moe_unpermute(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out);
  // The weights' gradient of moe_unpermute: dweights[s] = dot(dout[s / k], y[slot_row[s]]),
  // dout [T, D], y [R, D], slot_row I32 [T * k]; dweights [T * k] (F32/F64) written.
  void moe_unpermute_backward_weights(const Tensor& dout, const Tensor& y, const Tensor& slot_row, Tensor& dweights);
  // The slots sorted by expert as an op, for a block that runs without the host knowing its
  // experts' rows (no download: CUDA-graph capturable): moe_sort_slots and moe_tiles below, on
  // the backend's device. experts I32 [T, k], each in [0, E) (a data error otherwise: thrown on
  // the CPU, flagged on CUDA and reported at its next check; the outputs are then unspecified),
  // E = num_experts <= kMoePlanMaxExperts. Writes offsets I32 [E + 1], row_slot and slot_row I32
  // [T k], tiles I32 [moe_plan_max_tiles(T k, E, block_m), 4] (the first tile_count rows; the rest
  // {0, 0, 0, 0}: empty tiles) and tile_count I32 [1]. block_m >= 1.
  static constexpr int64_t kMoePlanMaxExperts = 1024;
  void moe_plan(const Tensor& experts, int64_t num_experts, int block_m, Tensor& offsets, Tensor& row_slot,
                Tensor& slot_row, Tensor& tiles, Tensor& tile_count);

  // ---- optimizer -------------------------------------------------------------------------
  // Decoupled AdamW (torch.optim.AdamW), in place, on tensors of one shape: param F32 (the master),
  // grad F32 or BF16, m and v both F32 or both BF16. F32 moments: the CPU computes in double,
  // CUDA in FP32. BF16 moments: FP32 math by backend/adamw_rule.h on both (bitwise equal), m and v
  // rounded to nearest even or, with p.stochastic_rounding, stochastically.
  void adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p);
  // Many tensors' AdamW in one call (the optimizer step over every parameter): bitwise the loop
  // of adamw over `jobs` in order. CUDA runs them as few multi-tensor launches (tensors of many
  // sizes, each element's arithmetic the single op's), so a step over thousands of expert
  // matrices costs launches per group of tensors, not per tensor.
  struct AdamWJob {
    Tensor* param;
    const Tensor* grad;
    Tensor *m, *v;
    AdamWParams p;
  };
  void adamw_many(const std::vector<AdamWJob>& jobs);

  // ---- quantization ----------------------------------------------------------------------
  // Bitwise equal to quantize_blocks_into (quant/quant.h): x [r, c] (F32 or BF16) into out
  // (data [r, c], or [c, r] with transpose), reusing out's buffers (refit writes in place).
  // A non-finite input throws NonFiniteError on return, or with `deferred` at the next
  // synchronizing call (synchronize, a copy to the host): many weights quantized in a row (the
  // trainer's per-step copies) then cost no host round trip each.
  void quantize(const Tensor& x, bool transpose, QuantTensor& out, bool deferred = false);
  // The trainer's per-step weight copies in one call: for each job, w [N, K] (F32 or BF16) into
  // q (128 x 128 blocks, [N, K]) and, when qt is non-null, w^T into qt (128 x 128 blocks, [K, N]:
  // the same blocks, amaxes and codes as q, transposed). Bitwise quantize(w, false, *q, true)
  // then quantize(w, true, *qt, true) for every job, the non-finite check deferred; CUDA reads
  // each 128 x 128 tile of w once for both copies, many weights per launch.
  struct WeightQuantJob {
    const Tensor* w;
    QuantTensor* q;
    QuantTensor* qt = nullptr;
  };
  void quantize_weights(const std::vector<WeightQuantJob>& jobs);

  // ---- generation --------------------------------------------------------------------------
  // Allocates a paged cache (scales initialized to 1); latent_v_dim > 0 (<= head_dim): MLA's
  // latent cache, K pools only (KvCache).
  KvCache alloc_kv_cache(int num_layers, int num_pages, int page_size, int num_kv_heads, int head_dim, DType dtype,
                         int latent_v_dim = 0);
  // Writes k, v [T, Hkv, hd] of `layer` into their slots (E4M3: quantized with the layer's scales).
  // A latent cache (latent_v_dim > 0) stores k only: v must be undefined.
  void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch);
  // x [T, H, hd] in place: each element of head h becomes e4m3(x / head_scale[h]) * head_scale[h],
  // the value an E4M3 KV cache with those scales hands the attention (kv_write then the pool
  // load), rounded to x's dtype. The trainer applies it to its k and v when the recipe rounds
  // them as the generator's cache does (trainer kv_cache e4m3); gradients pass straight through.
  void kv_round(Tensor& x, const std::vector<float>& head_scale);
  // Causal attention of q [T, Hq, hd] over the cached keys/values of each token's sequence,
  // positions 0..token_pos (inclusive; the token's own k/v must already be written).
  // out [T, Hq, cache.v_dim()] (hd, or a latent cache's latent_v_dim: MLA's absorbed attention,
  // an MQA over [latent | rope key] rows whose V is the latent). With fp8_attention, q is quantized per token and head
  // (FP32 scale) too: each q[t, h, :] row uses s = quant_scale_from_amax(amax of the row, pow2=false) and the value
  // e4m3_to_float(e4m3_from_float(q / s)) * s. The CPU reference keeps the softmax probabilities in FP32 (a GPU PV
  // product in FP8 is compared against it with a tolerance).
  // lse F32 [Hq, T], written when non-null: the natural log-sum-exp of softmax_scale * q.k over
  // the positions attended (k as the cache hands it), attention()'s convention, so that
  // attention_backward can take this op's out and lse (the consistent mode's trainer). Asking for
  // it does not change out.
  // out_fp8 (a fused producer, as rmsnorm_fp8): out's FP8 copy too, for the o projection that
  // reads out as [T, Hq * v_dim] (alloc_fp8_view(T, Hq * v_dim, pow2)): bitwise
  // quantize(out [T, Hq * v_dim]). Not with lse.
  void attention_paged(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch, float softmax_scale,
                       bool fp8_attention, Tensor& out, Tensor* lse = nullptr, Fp8View* out_fp8 = nullptr);
  // The inverse-CDF sampler with host parameters (every row, top-k / top-p or not; synchronizes).
  // Samples one token per row of logits F32 [B, V]: softmax(logits / temperature[b]) restricted
  // to top_k[b] (0 = all) and the smallest top_p[b] nucleus; uniforms F32 [B] in [0, 1) drive an
  // inverse-CDF draw over the kept tokens in descending-probability order (ties: lower id
  // first). temperature 0 = greedy. tokens I32 [B]; logp F32 [B] = log-prob of the token under
  // softmax(logits / temperature) before truncation (the generator's numerics).
  // Order: top-k first, then the smallest prefix whose mass renormalized over the top-k kept
  // tokens reaches top_p (at least one token); the draw is the first kept token whose
  // cumulative mass exceeds uniform * kept mass. Greedy: the lowest-id argmax, logp = 0 (the
  // one-hot limit distribution). Uniforms outside [0, 1) and NaN/+inf logits are errors.
  // valid_vocab (0 = V): only ids < valid_vocab <= V can be drawn: softmax, top-k, top-p, the
  // draw and the greedy argmax run over them as if the other logits were -inf. logp stays, as
  // with top-k / top-p, the log-prob before truncation, normalized over all V ids: the log-prob
  // the trainer's scoring forward gives the same token (so the mask adds no generator/trainer
  // mismatch). For a model whose vocabulary is padded past its tokenizer's (Qwen: 151936 rows,
  // 151669 ids), the caller passes the tokenizer's size and no undecodable id is ever sampled.
  void sample(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
              const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens, Tensor& logp,
              int64_t valid_vocab = 0);
  // The sampler of generation, with its parameters in device memory (so a recorded graph reads
  // each replay's values; no synchronization): rows I32 [B, 8] on this backend, one SampleRow
  // (backend/sampling.h) per row of logits [B, V], F32 or BF16 (the lm_head's BF16 output as it
  // is: exactly the draws and logp of its F32 copy); tokens I32 [B], logp F32 [B] as above.
  // Per row, by its parameters:
  //  - temperature 0: greedy, as above (lowest-id argmax, logp = 0);
  //  - top_k > 0 or top_p < 1 (a truncating row): sample()'s inverse-CDF draw with `uniform`;
  //    allowed only when `truncation` is true (else a data error: the fast path launches no
  //    truncating kernel);
  //  - otherwise (plain temperature sampling, GRPO's default) the Gumbel-max draw:
  //    token = argmax over ids < valid_vocab of fl(logit * fl(1 / temperature)) + g_id (ties:
  //    the lowest id), g_id = -log(-log(u_id)) with u_id from Philox4x32-10 keyed by
  //    (key_hi:key_lo) at counter (id / 4, counter, "GUMB", 0), word id % 4, and the logarithms
  //    of sampling.h: the same code on every backend, so CPU and CUDA draw the same token from
  //    the same logits. The draw is an exact sample of softmax(logit / temperature) up to the
  //    32-bit uniforms (sampling.h); one read of the logits on the GPU.
  // logp is, in every case, the log-prob under softmax(logits / temperature) over all V ids
  // (the padding past valid_vocab included), as for sample(). Data errors (NaN / +inf logits,
  // a row of only -inf, parameters out of range) are raised here on the CPU and at the next
  // synchronizing call on the GPU (that row gets token 0, logp NaN).
  void sample_rows(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens, Tensor& logp,
                   int64_t valid_vocab = 0);

 protected:
  // ---- what a backend implements ---------------------------------------------------------
  // Each public op above checks its contract (backend.cpp: shapes, dtypes, devices, host
  // parameters; the errors name the op and the argument) and then calls its _impl, which may
  // assume the contract holds. An _impl checks only what is its own: a kernel's size limit or
  // dtype combination, a layout only it needs, or data only it can see (an id out of range).
  // The fused producers, linear_shared_input and amax have default implementations (the
  // unfused sequence, one linear per weight, a host reduction) that a backend may replace.

  virtual void copy_impl(const Tensor& src, Tensor& dst) = 0;
  virtual void convert_impl(const Tensor& src, Tensor& dst) = 0;
  virtual void convert_many_impl(const std::vector<ConvertJob>& jobs);  // default: the loop
  virtual void fill_impl(Tensor& t, float value) = 0;
  virtual void copy_cols_impl(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) = 0;
  virtual void add_impl(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  virtual void scale_impl(Tensor& x, float s) = 0;
  virtual double sum_squares_impl(const Tensor& x) = 0;
  virtual void sum_squares_each_impl(const std::vector<const Tensor*>& xs, std::vector<double>& out);
  virtual bool all_finite_impl(const Tensor& x) = 0;
  virtual void amax_impl(const Tensor& x, Tensor& acc, int64_t i);
  virtual void embedding_impl(const Tensor& ids, const Tensor& table, Tensor& out) = 0;
  virtual void embedding_backward_impl(const Tensor& ids, const Tensor& dout, Tensor& dtable) = 0;
  virtual void rmsnorm_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) = 0;
  virtual void rmsnorm_backward_impl(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                     Tensor& dx, Tensor& dw) = 0;
  virtual void rmsnorm_fp8_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8);
  virtual void rmsnorm_rope_impl(const Tensor& x, const Tensor& w, float eps, const Tensor& positions,
                                 const RopeParams& rope, Tensor& out, Tensor* rstd);
  virtual void add_rmsnorm_impl(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out,
                                Tensor* rstd, Fp8View* fp8);
  virtual void swiglu_fp8_impl(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8);
  virtual void add_fp8_impl(const Tensor& a, const Tensor& b, Tensor& out, Fp8View& fp8);
  virtual void swiglu_backward_fp8_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                        Tensor& dup, Fp8View& dgate_fp8, Fp8View& dup_fp8);
  virtual void linear_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                           const Fp8View* x_fp8) = 0;
  virtual void linear_shared_input_impl(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                        const LinearSpec& spec, const std::vector<Tensor*>& outs, const Fp8View* x_fp8);
  virtual void linear_cols_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                                int64_t col0);
  virtual void linear_chunked_impl(const Tensor& x, const Tensor& w, const LinearSpec& spec, int64_t chunk,
                                   Tensor& out);
  virtual void linear_swiglu_impl(const Tensor& x, const LinearWeight& gate_w, const LinearWeight& up_w,
                                  const LinearSpec& spec, Tensor& gate, Tensor& up, bool keep, Tensor& act,
                                  Fp8View* act_fp8, const Fp8View* x_fp8);
  virtual void linear_qkv_norm_rope_impl(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                         const LinearSpec& spec, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                         const Tensor& positions, const RopeParams& rope, bool keep, Tensor& q_raw,
                                         Tensor& k_raw, Tensor& q, Tensor& k, Tensor& v, Tensor* q_rstd, Tensor* k_rstd,
                                         const Fp8View* x_fp8, const KvDest* kv);
  virtual void grouped_linear_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                   const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor& out,
                                   const Fp8View* x_fp8);
  virtual void grouped_linear_shared_input_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                                const std::vector<std::vector<const LinearWeight*>>& W,
                                                const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                                const Fp8View* x_fp8);
  virtual void grouped_linear_planned_impl(const Tensor& x, const MoeDevicePlan& plan,
                                           const std::vector<std::vector<const LinearWeight*>>& W,
                                           const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                           const Fp8View* x_fp8);
  virtual void linear_backward_impl(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                                    Tensor* dx, Tensor* dw, Tensor* dbias, const Fp8View* dy_fp8) = 0;
  virtual void grouped_linear_backward_impl(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                            const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                            Tensor* dx, const std::vector<Tensor*>& dw, const Fp8View* dy_fp8);
  virtual void rope_impl(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse) = 0;
  virtual void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu_seqlens,
                              float softmax_scale, Tensor& out, Tensor& lse) = 0;
  virtual void attention_backward_impl(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, const std::vector<int32_t>& cu_seqlens,
                                       float softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) = 0;
  virtual void swiglu_impl(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  virtual void swiglu_backward_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                    Tensor& dup) = 0;
  virtual void token_logprobs_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                   float temperature, const LinearSpec& spec, Tensor& logp, Tensor& lse,
                                   Tensor* entropy) = 0;
  virtual void token_logprobs_backward_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                            float temperature, const LinearSpec& spec, const Tensor& lse,
                                            const Tensor& dlogp, Tensor& dhidden, Tensor* dlm_head) = 0;
  virtual void logprobs_of_logits_impl(const Tensor& logits, const Tensor& targets, float temperature, Tensor& logp,
                                       Tensor& lse) = 0;
  virtual void moe_route_softmax_impl(const Tensor& logits, int top_k, bool renormalize, Tensor& experts,
                                      Tensor& weights) = 0;
  virtual void moe_route_softmax_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                               const Tensor& dweights, Tensor& dlogits) = 0;
  virtual void moe_route_sigmoid_impl(const Tensor& logits, const Tensor* bias, int top_k, int n_group, int topk_group,
                                      bool renormalize, float scaling, Tensor& experts, Tensor& weights) = 0;
  virtual void moe_route_sigmoid_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                               float scaling, const Tensor& dweights, Tensor& dlogits) = 0;
  virtual void moe_route_softmax_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                              Tensor& weights) = 0;
  virtual void moe_route_sigmoid_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                              float scaling, Tensor& weights) = 0;
  virtual void mla_absorb_impl(const Tensor& x, int64_t x_col0, const Tensor& w, int64_t nope, int64_t dv, bool values,
                               Tensor& out, int64_t out_col0);
  virtual void moe_permute_fp8_impl(const Tensor& x, const Fp8View* xq, const Tensor& row_slot, int top_k,
                                    const Tensor* weights, Tensor& out, Fp8View& outq);
  virtual void moe_permute_impl(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights,
                                Tensor& out) = 0;
  virtual void moe_unpermute_impl(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) = 0;
  virtual void moe_unpermute_backward_weights_impl(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                                   Tensor& dweights) = 0;
  // Default: the experts downloaded, moe_sort_slots and moe_tiles, the results uploaded (the CPU
  // reference).
  virtual void moe_plan_impl(const Tensor& experts, int64_t num_experts, int block_m, Tensor& offsets, Tensor& row_slot,
                             Tensor& slot_row, Tensor& tiles, Tensor& tile_count);
  virtual void adamw_impl(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) = 0;
  virtual void quantize_impl(const Tensor& x, bool transpose, QuantTensor& out, bool deferred) = 0;
  // Defaults: the loops (the CPU reference); CUDA overrides both with multi-tensor launches.
  virtual void adamw_many_impl(const std::vector<AdamWJob>& jobs);
  virtual void quantize_weights_impl(const std::vector<WeightQuantJob>& jobs);
  virtual void kv_write_impl(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) = 0;
  virtual void kv_round_impl(Tensor& x, const std::vector<float>& head_scale) = 0;
  virtual void attention_paged_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                    float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse) = 0;
  // attention_paged_impl, then out's FP8 copy into fp8 (out [T, H, d] as [T, H * d]); a backend may fuse it.
  virtual void attention_paged_fp8_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                        float softmax_scale, bool fp8_attention, Tensor& out, Fp8View& fp8);
  virtual void sample_impl(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
                           const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens,
                           Tensor& logp, int64_t valid_vocab) = 0;
  virtual void sample_rows_impl(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens, Tensor& logp,
                                int64_t valid_vocab) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// Throws a clear error when fp8rl was built without CUDA or no GPU is visible.
// Activations are BF16 (the fast path) unless act_dtype says F32: the exact path, used where
// results are compared with FP32 references (`fp8rl logprobs`, the CUDA model parity tests).
std::unique_ptr<Backend> make_cuda_backend(int device_index = 0);
std::unique_ptr<Backend> make_cuda_backend(int device_index, DType act_dtype);
// "cpu" or "cuda[:N]". act_dtype applies to CUDA (F32 or BF16); the CPU backend is always F32.
std::unique_ptr<Backend> make_backend(const std::string& device);
std::unique_ptr<Backend> make_backend(const std::string& device, DType act_dtype);

}  // namespace fp8rl
