// The CUDA backend: the ops of backend/backend.h on one GPU, one stream. Memory is
// stream-ordered from a caching pool on that stream (device_memory.h; FP8RL_CUDA_ALLOC=plain:
// cudaMalloc / cudaFree); kernels live in *_kernels.cu, GEMMs in gemm.*.
// Activations are BF16 by default (act_dtype); a backend made with act_dtype F32 runs the model
// with F32 activations (the exact path: FP32 references, `fp8rl logprobs`), and computes FP8
// block linears as FP32 GEMMs of the dequantized operands (exact, like the CPU reference)
// instead of on cuBLASLt's FP8 tensor cores. Every op accepts
// both dtypes whatever act_dtype says (the parity tests use both).
// Errors: CUDA_CHECK / CUBLAS_CHECK (cuda_check.h); data errors found on the device (non-finite
// quantizer input, out-of-range ids) set device flags that are read back at the next
// synchronizing call (see flag_reset), so ops never stall the stream to check their data.
//
// Limitations (documented, tested): the simple attention kernels are one warp per (token, head)
// with an online softmax; training attention takes the tensor-core flash kernels where they
// apply, paged (generation) attention the tiled split-K kernel of paged_attention.cu (CUDA
// cores, no tensor cores yet). sample_rows() draws plain-temperature rows by Gumbel-max in one
// read of the logits (sample_gumbel_kernels.cu); top-k / top-p rows, and sample(), without a sort
// (sample_kernels.cu: a 4-bit-digit radix search on order keys, one block per row).
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/gemm.h"

namespace fp8rl::cuda {

struct PagedOutFp8;  // kernels.h

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device_index, DType act_dtype);
  ~CudaBackend() override;

  DeviceKind device() const override { return DeviceKind::CUDA; }
  std::string name() const override;
  DType act_dtype() const override { return act_dtype_; }
  int64_t row_granule() const override;

  // F32 and BF16 (F32 where the interface says F32): what the kernels are written for.
  bool takes_float(DType t, bool stat) const override { return t == DType::F32 || (!stat && t == DType::BF16); }
  Tensor alloc(const Shape& shape, DType dtype) override;
  void synchronize() override;
  MemoryStats memory_stats() override;
  void reset_peak_memory_stats() override;
  bool set_gemm_tuning(bool on) override { return gemm_->set_tuning_allowed(on); }
  int64_t free_device_bytes() override;

 protected:
  // The ops of backend.h; each runs after its contract held (backend.cpp) and checks only its
  // kernels' own limits (dtype combinations, sizes, the MLA shapes no kernel serves yet).
  void copy_impl(const Tensor& src, Tensor& dst) override;
  void copy_cols_impl(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) override;
  void convert_impl(const Tensor& src, Tensor& dst) override;
  void convert_many_impl(const std::vector<ConvertJob>& jobs) override;
  void fill_impl(Tensor& t, float value) override;

  void add_impl(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale_impl(Tensor& x, float s) override;
  double sum_squares_impl(const Tensor& x) override;
  void sum_squares_each_impl(const std::vector<const Tensor*>& xs, std::vector<double>& out) override;
  bool all_finite_impl(const Tensor& x) override;
  void amax_impl(const Tensor& x, Tensor& acc, int64_t i) override;

  void embedding_impl(const Tensor& ids, const Tensor& table, Tensor& out) override;
  void embedding_backward_impl(const Tensor& ids, const Tensor& dout, Tensor& dtable) override;
  void rmsnorm_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) override;
  void rmsnorm_backward_impl(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dx,
                             Tensor& dw) override;
  void linear_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                   const Fp8View* x_fp8) override;
  void grouped_linear_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                           const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor& out,
                           const Fp8View* x_fp8) override;
  void grouped_linear_backward_impl(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                    const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor* dx,
                                    const std::vector<Tensor*>& dw, const Fp8View* dy_fp8) override;
  void grouped_linear_shared_input_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                        const std::vector<std::vector<const LinearWeight*>>& W, const LinearSpec& spec,
                                        const std::vector<Tensor*>& outs, const Fp8View* x_fp8) override;
  void linear_shared_input_impl(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                const std::vector<Tensor*>& outs, const Fp8View* x_fp8) override;
  void linear_cols_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                        int64_t col0) override;
  void linear_chunked_impl(const Tensor& x, const Tensor& w, const LinearSpec& spec, int64_t chunk,
                           Tensor& out) override;
  void linear_qkv_norm_rope_impl(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                 const Tensor& q_norm, const Tensor& k_norm, float eps, const Tensor& positions,
                                 const RopeParams& rope, bool keep, Tensor& q_raw, Tensor& k_raw, Tensor& q, Tensor& k,
                                 Tensor& v, Tensor* q_rstd, Tensor* k_rstd, const Fp8View* x_fp8,
                                 const KvDest* kv) override;
  void linear_swiglu_impl(const Tensor& x, const LinearWeight& gate_w, const LinearWeight& up_w, const LinearSpec& spec,
                          Tensor& gate, Tensor& up, bool keep, Tensor& act, Fp8View* act_fp8,
                          const Fp8View* x_fp8) override;
  void rmsnorm_fp8_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8) override;
  void rmsnorm_rope_impl(const Tensor& x, const Tensor& w, float eps, const Tensor& positions, const RopeParams& rope,
                         Tensor& out, Tensor* rstd) override;
  void add_rmsnorm_impl(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out,
                        Tensor* rstd, Fp8View* fp8) override;
  void swiglu_fp8_impl(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8) override;
  void add_fp8_impl(const Tensor& a, const Tensor& b, Tensor& out, Fp8View& fp8) override;
  void swiglu_backward_fp8_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup,
                                Fp8View& dgate_fp8, Fp8View& dup_fp8) override;
  void linear_backward_impl(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                            Tensor* dx, Tensor* dw, Tensor* dbias, const Fp8View* dy_fp8) override;
  void rope_impl(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse) override;
  void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu_seqlens,
                      float softmax_scale, Tensor& out, Tensor& lse) override;
  void attention_backward_impl(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& lse, const std::vector<int32_t>& cu_seqlens, float softmax_scale,
                               Tensor& dq, Tensor& dk, Tensor& dv) override;
  void swiglu_impl(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void swiglu_backward_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                            Tensor& dup) override;
  void token_logprobs_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, float temperature,
                           const LinearSpec& spec, Tensor& logp, Tensor& lse, Tensor* entropy) override;
  void token_logprobs_backward_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                    float temperature, const LinearSpec& spec, const Tensor& lse, const Tensor& dlogp,
                                    Tensor& dhidden, Tensor* dlm_head) override;
  void logprobs_of_logits_impl(const Tensor& logits, const Tensor& targets, float temperature, Tensor& logp,
                               Tensor& lse) override;
  void moe_route_softmax_impl(const Tensor& logits, int top_k, bool renormalize, Tensor& experts,
                              Tensor& weights) override;
  void moe_route_softmax_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                       const Tensor& dweights, Tensor& dlogits) override;
  void moe_route_sigmoid_impl(const Tensor& logits, const Tensor* bias, int top_k, int n_group, int topk_group,
                              bool renormalize, float scaling, Tensor& experts, Tensor& weights) override;
  void moe_route_sigmoid_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize, float scaling,
                                       const Tensor& dweights, Tensor& dlogits) override;
  void moe_route_softmax_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                      Tensor& weights) override;
  void moe_route_sigmoid_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize, float scaling,
                                      Tensor& weights) override;
  void mla_absorb_impl(const Tensor& x, int64_t x_col0, const Tensor& w, int64_t nope, int64_t dv, bool values,
                       Tensor& out, int64_t out_col0) override;
  void moe_permute_fp8_impl(const Tensor& x, const Fp8View* xq, const Tensor& row_slot, int top_k,
                            const Tensor* weights, Tensor& out, Fp8View& outq) override;
  void moe_permute_impl(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights,
                        Tensor& out) override;
  void moe_unpermute_impl(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) override;
  void moe_plan_impl(const Tensor& experts, int64_t num_experts, int block_m, Tensor& offsets, Tensor& row_slot,
                     Tensor& slot_row, Tensor& tiles, Tensor& tile_count) override;
  int moe_plan_block_m(int64_t rows, int64_t groups) const override;
  void grouped_linear_planned_impl(const Tensor& x, const MoeDevicePlan& plan,
                                   const std::vector<std::vector<const LinearWeight*>>& W, const LinearSpec& spec,
                                   const std::vector<Tensor*>& outs, const Fp8View* x_fp8) override;
  void moe_unpermute_backward_weights_impl(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                           Tensor& dweights) override;
  void adamw_impl(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) override;
  void adamw_many_impl(const std::vector<AdamWJob>& jobs) override;
  void quantize_impl(const Tensor& x, bool transpose, QuantTensor& out, bool deferred) override;
  void quantize_weights_impl(const std::vector<WeightQuantJob>& jobs) override;
  void kv_write_impl(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) override;
  void kv_round_impl(Tensor& x, const std::vector<float>& head_scale) override;
  void attention_paged_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                            float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse) override;
  void attention_paged_fp8_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                float softmax_scale, bool fp8_attention, Tensor& out, Fp8View& fp8) override;
  void sample_impl(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
                   const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens, Tensor& logp,
                   int64_t valid_vocab) override;
  void sample_rows_impl(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens, Tensor& logp,
                        int64_t valid_vocab) override;

 public:
  std::unique_ptr<OpGraph> record(const std::function<void()>& ops) override;

  // ---- for the benchmark and tests ----
  cudaStream_t stream() const { return stream_; }
  GemmEngine& gemm() { return *gemm_; }
  // Launches the quantizer without the host-side non-finite check (no synchronization).
  // pad_cols (transpose only): out.data has round_up(C, 128) columns, the padding written as zeros.
  // gemm_layout (1x128 blocks): scales in cuBLASLt's VEC128 layout [ceil(C/128)][R], K-block-major.
  void quantize_async(const Tensor& x, bool transpose, QuantTensor& out, bool pad_cols = false,
                      bool gemm_layout = false);
  BackendCounters counters() const override;

 private:
  enum Slot {
    kSlotA,
    kSlotB,
    kSlotC,
    kSlotAq,
    kSlotAs,
    kSlotBq,
    kSlotBs,
    kSlotLogits,
    kSlotState,
    kSlotDh,
    kSlotIdx,
    kSlotAttn,
    kSlotTmp,
    kSlotCat,         // linear_shared_input's concatenated product
    kSlotColSums,     // column sums' per-chunk partials (norm weight and bias gradients)
    kSlotSort,        // the embedding backward's sort of token ids
    kSlotLogpParts,   // logprobs_of_logits' per-chunk partial folds
    kSlotWgradStage,  // grouped_wgrad_f32's BF16 products
    kSlotWgradOps,    // grouped_wgrad_own's transposed dY [N, padded rows] and X [K, padded rows]
    kSlotCount
  };
  // A device buffer reused across calls (grown on demand); valid until the next scratch(slot).
  Tensor scratch(Slot slot, const Shape& shape, DType dtype);
  QuantTensor scratch_quant(Slot data_slot, Slot scale_slot, int64_t rows, int64_t cols, int block_rows, bool pow2);
  // grouped_linear_backward's weight gradient into F32 gradients (BF16 products staged, then
  // added), in chunks of groups whose staging stays within this many bytes.
  static constexpr int64_t kGroupedWgradStagingBytes = int64_t{128} << 20;
  // The grouped FP8 forward's pieces: whether the own grouped kernel takes (x, W, spec) with N
  // output columns; x quantized 1x128 into scratch; the grouped product of those rows (xq's
  // scales row-major, or block-major [K / 128][R] with scales_kb_major: a producer's Fp8View).
  bool fp8_grouped_ok(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                      int64_t N) const;
  QuantTensor grouped_fp8_input(const Tensor& x, const LinearSpec& spec);
  void grouped_fp8_product(const QuantTensor& xq, bool scales_kb_major, const std::vector<int64_t>& offsets,
                           const std::vector<const LinearWeight*>& W, Tensor& out);
  void grouped_wgrad_f32(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                         const std::vector<Tensor*>& dw);
  // grouped_linear_backward's weight gradient on the own kernel's K-grouped form (BF16 operands,
  // F32 or BF16 gradients accumulated in place), in chunks of groups whose transposed operands
  // stay within kGroupedWgradOperandBytes (a group larger than that alone); false (nothing done)
  // where the shapes are outside it.
  static constexpr int64_t kGroupedWgradOperandBytes = int64_t{64} << 20;
  bool grouped_wgrad_own(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                         const std::vector<Tensor*>& dw, int block_m);
  // The FP8 linears' operands (cuda_backend.cu): x's 1x128 copy (a view's, or quantized into the
  // A scratch) and W's 128x128 one (W.wq, or W.w quantized into the B scratch).
  QuantTensor quantized_rows(const Tensor& x, const Fp8View* view, bool pow2, bool laid, const char* what);
  QuantTensor quantized_weight(const LinearWeight& W, bool pow2);
  // Device flag protocol, without stalling the stream: flag_reset() opens a fresh flag slot
  // (an async memset) that the op's kernels set on bad data; flag_check(message) records that
  // slot with its message. Recorded slots are read back at the next synchronizing call
  // (synchronize, a copy to or from the host, a reduction, sample, quantize) by flag_drain,
  // which raises the first set flag's message; FP8RL_CUDA_SYNC_CHECKS=1 drains after every op.
  // Slot kFlagSticky is token_logprobs' and logprobs_of_logits' cumulative target-range flag (never
  // reset per call).
  static constexpr int kFlagSlots = 256, kFlagSticky = kFlagSlots - 1;
  int* flag_reset();
  void flag_check(const std::string& message);
  void flag_drain();
  // C[M, N] = op(A) op(B) + beta C with A, B converted to `ab` (F32 or BF16) when they differ.
  // row_invariant: one cuBLASLt algorithm for every M (GemmEngine::gemm; the consistent mode).
  void linear_fwd_fp8_consistent(const Tensor& x2, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                                 const Fp8View* x_view);
  void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const Tensor& A, const Tensor& B, DType ab, Tensor& C,
          float beta, bool row_invariant = false);
  // x_view: x2's FP8 copy (a fused producer's, or linear_shared_input's), used when the product
  // can take it (any layout on the tensor cores; row-major scales on the dequantize path).
  void linear_fwd(const Tensor& x2, const LinearWeight& W, const LinearSpec& spec, Tensor& out2,
                  const Fp8View* x_view = nullptr);
  // Where a fused producer's FP8 copy of an [R, C] activation puts its scales: cuBLASLt's layout
  // when the GEMMs will take it as is (BF16 activations, R % 16 == 0), else row-major.
  bool fp8_view_gemm_layout(int64_t R, int64_t C) const;
  // The online log-softmax state of T rows (token_logprobs, logprobs_of_logits): running max, sum,
  // entropy sum and target logit, initialised; `bad` the sticky slot out-of-range targets set,
  // reported with `op`'s name.
  struct LogprobRows {
    float *m, *s, *e, *tgt;
    int* bad;
  };
  LogprobRows logprob_rows_begin(int64_t T, int64_t V, const char* op);
  // attention_paged's kernels; with out_fp8, true when a kernel wrote out's FP8 copy too.
  bool attention_paged_run(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                           float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse,
                           const PagedOutFp8* out_fp8);
  void fp8_view_prepare(Fp8View& fp8, const Tensor& out);
  void check_dev(const Tensor& t, const char* what) const;  // quantize_async's own entry
  // Whether an FP8 block GEMM [M, N, K] takes cuBLASLt's FP8 kernels (else: dequantize + FP32 GEMM).
  // On the fast path (BF16 activations) a shape that cannot is a fallback: counted, and reported
  // on stderr once per (N, K).
  bool fp8_tensor_cores(int64_t M, int64_t N, int64_t K);
  // linear_shared_input: W as one concatenated weight (cuda_backend.cu), used up to kCatMaxRows
  // rows (decode batches and small prefill chunks; the scratch is at most 2048 x sum N).
  static constexpr int64_t kCatMaxRows = 2048;
  bool concatenated(const std::vector<const LinearWeight*>& W, const LinearSpec& spec, LinearWeight& cat);
  void split_concatenated(const Tensor& y, const std::vector<const LinearWeight*>& W, const std::vector<Tensor*>& outs);
  bool concatenated_product(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                            LinearWeight& cat);
  int64_t fp8_fallbacks_ = 0;
  int64_t grouped_loops_ = 0;    // groups of grouped ops that ran as one product each (no grouped path)
  int64_t paged_runs_off_ = 0;   // paged-attention calls with query runs their kernel variant cannot serve
  int64_t concat_products_ = 0;  // linear_shared_input / linear_swiglu calls that ran as one concatenated product
  std::set<std::pair<int64_t, int64_t>> fp8_fallback_shapes_;

  int device_ = 0;
  // linear_chunked's probes: (chunk, whole-chunk columns, K, GEMM dtype, output dtype) -> one GEMM
  // of the whole chunks is the chunked products' bits.
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int>, bool> chunked_one_gemm_;
  int64_t lt_fixed_products_ = 0;  // counters().fp8_gemm_lt_fixed
  int sm_count_ = 1;               // streaming multiprocessors (sizes the paged attention split plan)
  DType act_dtype_ = DType::BF16;
  std::shared_ptr<DeviceMemory> mem_;  // owns the stream and the pool; shared with every Storage
  cudaStream_t stream_ = nullptr;      // mem_->stream()
  std::unique_ptr<GemmEngine> gemm_;
  PinnedUploads uploads_;  // copy_impl's small host-to-device copies
  static constexpr size_t kDownloadBytes = size_t{256} << 10;
  void* download_ = nullptr;          // pinned [kDownloadBytes]: copy_impl's small device-to-host copies
  int* flag_dev_ = nullptr;           // [kFlagSlots]
  int* flag_host_ = nullptr;          // pinned [kFlagSlots]
  int* flag_cur_ = nullptr;           // the slot flag_reset() opened last
  std::vector<std::string> pending_;  // message of slot i
  std::string sticky_message_;        // set while the sticky slot may hold an unchecked error
  bool sync_checks_ = false;
  bool recording_ = false;        // inside record(): flags go to the sticky slot
  std::string recorded_message_;  // first flag_check message while recording
  // alloc() is stream-ordered from a pool (capturable): graphs allowed.
  bool stream_ordered_alloc() const { return !mem_->plain(); }
  friend class CudaGraph;

  // FP8RL_CUDA_PROFILE=1: every op's stream time (events around it), summed per op and printed
  // to stderr when the backend is destroyed (or by profile_report()).
  struct Record {
    const char* op;
    cudaEvent_t start, stop;
    double host_start = 0.0, host_ms = 0.0;  // host time inside the op (seconds since an epoch; ms)
  };
  class OpTimer {
   public:
    // level 0: timed whenever profiling; 1: only at FP8RL_CUDA_PROFILE=1 (the linear ops as a
    // whole); 2: only at FP8RL_CUDA_PROFILE=2 (their phases: quantizers, transposes, GEMMs).
    OpTimer(CudaBackend& be, const char* op, int level = 0);
    ~OpTimer();

   private:
    CudaBackend* be_;
  };
  bool profile_ = false;
  int profile_level_ = 0;
  int depth_ = 0;
  std::vector<Record> records_;
  struct ProfileTotal {
    int64_t calls = 0;
    double ms = 0.0, host_ms = 0.0;
  };
  std::map<std::string, ProfileTotal> profile_totals_;
  void profile_flush();

 public:
  void profile_report(const std::string& title, bool print) override;

 private:
  std::vector<std::shared_ptr<Storage>> slots_;
  std::string name_;
};

}  // namespace fp8rl::cuda
