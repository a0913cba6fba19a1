// GEMMs through cuBLASLt, in row-major terms (cuBLAS is column-major: a row-major [r, c]
// matrix is a column-major [c, r] one, so C = op(A) op(B) is issued as C^T = op(B)^T op(A)^T).
//
// gemm():      C[M, N] = alpha * op(A) op(B) + beta * C, FP32 accumulation.
//              A is [M, K] (ta = false) or [K, M] (ta = true); B is [K, N] (tb = false) or
//              [N, K] (tb = true). Types: F32 x F32 (FP32 math, no TF32) or BF16 x BF16;
//              C is F32 or BF16.
// gemm_fp8():  C[M, N] = alpha * A B^T + beta * C with A E4M3 [M, K] and B E4M3 [N, K], both
//              K-major (cuBLAS "TN", the only FP8 layout), block-scaled:
//                A: 1 x 128 blocks along K (activations, dY, X^T / dY^T along tokens);
//                B: 1 x 128 along K, or 128 x 128 (weights).
//              Scales are passed in our QuantTensor layout (row-major [rows / br, ceil(K / 128)])
//              and rearranged here, on the stream, into what cuBLASLt 13 expects:
//                VEC128_32F    (1 x 128):   [ceil(K/128)][rows]            (rows contiguous)
//                BLK128x128_32F (128 x 128): [ceil(rows/128)][round_up(ceil(K/128), 4)]
//              (the layouts torch._scaled_mm hands to cuBLASLt; the 128x128 one equals ours
//              when ceil(K/128) is a multiple of 4, then no copy is made; the padded form for
//              other K was verified on the H200 by tests/cuda (M=256, N=512, K=384)).
//              fp8_supported() says whether the shape runs on cuBLASLt's block-scaled kernels:
//              N a multiple of 16 and K a multiple of 128 (callers pad K, e.g. the wgrad's token
//              dimension, with zero columns); any M: cuBLASLt wants M % 16 == 0, so the last
//              M % 16 rows run as a second product padded to 16 rows (tail_products() counts
//              them). Shapes outside fp8_supported() are the caller's fallback (backend:
//              dequantize + FP32 GEMM, the same quantized product, counted and reported).
// gemm_grouped(): gemm()'s product for several independent problems of one layout (ta, tb),
//              each with its own M, N, K and pointers, in one cuBLAS grouped launch
//              (cublasGemmGroupedBatchedEx; BF16 operands and BF16 C, FP32 accumulation: the
//              H200's cuBLAS 13.0 refuses F32 C with BF16 operands, NOT_SUPPORTED): the
//              mixture-of-experts products. Problems with M or N = 0 are skipped.
//              grouped_bf16_supported(c_dtype) says which C it takes.
// Heuristics are cached per (types, layout, shape); one workspace serves every call.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>
#include <tuple>

#include "backend/cuda/device_memory.h"
#include "core/dtype.h"
#include "core/error.h"

namespace fp8rl::cuda {

constexpr int64_t kFp8RowGranule = 16;  // cuBLASLt's FP8 block-scaled kernels: M and N in multiples of 16

class GemmEngine {
 public:
  explicit GemmEngine(cudaStream_t stream);
  ~GemmEngine();
  GemmEngine(const GemmEngine&) = delete;
  GemmEngine& operator=(const GemmEngine&) = delete;

  // See above. ab: F32 or BF16 (A and B alike); c_dtype: F32 or BF16.
  // row_invariant (the consistent mode): each row of C is the same bits whatever M — one
  // cuBLASLt algorithm per (types, layout, N, K), the heuristic's first for M = kRowInvariantM
  // among those without split-K and without workspace (so no stream-K or split reduction, whose
  // partition depends on M), with SPLITK_NUM forced to 1, used for every M. Measured row for row
  // by tests/cuda/test_cuda_consistent.cpp (GemmRowsDoNotDependOnM).
  // ldc: C's row stride in elements (0: N), e.g. C a column range of a wider matrix; the algorithm
  // (and so every element's bits) is the one chosen for ldc = N. algo_n (row_invariant only, 0: N):
  // run the row-invariant algorithm chosen for products of algo_n columns (several such column
  // blocks at once; the bits per element of that algorithm are checked by the caller's probe).
  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, const void* B, DType ab,
            void* C, DType c_dtype, float alpha, float beta, bool row_invariant = false, int64_t ldc = 0,
            int64_t algo_n = 0);
  static constexpr int64_t kRowInvariantM = 4096;
  // batch products C_b = op(A_b) op(B_b) in one cuBLAS strided batched launch (no pointer
  // arrays: graph-safe), laid out as gemm() says for (ta, tb) with explicit row strides lda,
  // ldb, ldc (elements) and the element offsets between consecutive batches' A, B, C. ab: F32 or
  // BF16; C F32 or BF16; FP32 accumulation (never TF32); alpha 1, beta 0.
  void gemm_strided_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                            int64_t stride_a, const void* B, int64_t ldb, int64_t stride_b, DType ab, void* C,
                            int64_t ldc, int64_t stride_c, DType c_dtype, int64_t batch);
  // One problem of gemm_grouped(): C [M, N], A and B laid out as gemm() says for (ta, tb).
  struct Problem {
    int64_t M, N, K;
    const void* A;
    const void* B;
    void* C;
  };
  // See above. ab and c_dtype: BF16. Not inside a CUDA graph capture (the pointer arrays are
  // uploaded with a pageable copy).
  static bool grouped_bf16_supported(DType c_dtype) { return c_dtype == DType::BF16; }
  void gemm_grouped(bool ta, bool tb, const std::vector<Problem>& problems, DType ab, DType c_dtype, float alpha,
                    float beta);

  static bool fp8_supported(int64_t M, int64_t N, int64_t K);
  // a: E4M3 [M, K], a_scales F32 [M, ceil(K/128)] (1x128). b: E4M3 [N, K], b_scales F32
  // [N, ceil(K/128)] when b_block_rows == 1, [ceil(N/128), ceil(K/128)] when 128.
  // a_scales_laid: a_scales are already in the VEC128 layout [ceil(K/128)][M] (the quantizer's
  // gemm_layout; M % 16 == 0 unless the product runs on the own kernel), so no layout kernel runs for A.
  // row_invariant: cuBLASLt's algorithm fixed for every M (as set_fp8_row_invariant, for this call).
  // b_scales_laid (b_block_rows == 1): b_scales are [ceil(K/128)][N] (the quantizer's gemm_layout;
  // cuBLASLt's VEC128 layout and the own kernel's per-row B layout alike), so no layout kernel runs
  // for B. Products of 1x128-block B (the FP8 wgrad) run on the own kernel's per-row B scales where
  // fp8_wgrad_own says so (any M there), else on cuBLASLt.
  void gemm_fp8(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales, const uint8_t* b,
                const float* b_scales, int b_block_rows, void* C, DType c_dtype, float alpha, float beta,
                bool a_scales_laid = false, bool row_invariant = false, bool b_scales_laid = false);
  // Whether gemm_fp8 with row_invariant computes every element of a product with B [N, K] in
  // 128x128 blocks and a c_dtype output as the own kernel at one split does (the consistent
  // mode's arithmetic): probed once per (N, K, c_dtype) on seeded random operands, bitwise over
  // M = 300 rows (the last 12 through the padded tail product). Measured so at every 1.7B
  // product (docs/benchmarks.md, session 15), not promised by cuBLASLt: hence the probe. False
  // for shapes cuBLASLt does not take, and while the stream is capturing a graph (the probe
  // synchronizes; nothing is cached then).
  bool fp8_lt_is_own(int64_t N, int64_t K, DType c_dtype);

  // The scale rearrangement alone (exposed for the benchmark, which times pre-laid-out GEMMs).
  // Writes into `dst` (device, at least scale_buffer_floats(...) floats).
  static int64_t scale_buffer_floats(int64_t rows, int64_t K, int block_rows);
  void layout_scales(const float* src, int64_t rows, int64_t K, int block_rows, float* dst);
  // gemm_fp8 with scales already in cuBLASLt layout; M must be a multiple of 16.
  void gemm_fp8_prelaid(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_lt_scales,
                        const uint8_t* b, const float* b_lt_scales, int b_block_rows, void* C, DType c_dtype,
                        float alpha, float beta, bool row_invariant = false);

  // The own sm_90a kernel (fp8_gemm.h) for the same product (B in 128x128 blocks): any M, no
  // tail; split-K chosen from the shape (splits = 0) or given. a_scales_kb_major: A's scales
  // are [ceil(K/128)][M] (the quantizer's gemm_layout), else [M][ceil(K/128)].
  void gemm_fp8_own(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales, bool a_scales_kb_major,
                    const uint8_t* b, const float* b_scales, void* C, DType c_dtype, float alpha, float beta,
                    int splits = 0, int block_m = 0,  // 0, 0: fp8_gemm_sm90_config's
                    int block_n = 0);                 // 64-row tiles' columns (0: FP8RL_FP8_GEMM_BN); same bits
  // Which kernel gemm_fp8 runs for 128x128-block B (FP8RL_FP8_GEMM): cublaslt (default); auto =
  // the own one where the graph-timed sweep found it faster (fp8_gemm_sm90_preferred: decode
  // products of small N) — in the real decode step that made generation 6% slower (bench
  // rl-step, docs/benchmarks.md session 5), so it is not the default; own = always. Products of 1x128-block B (the FP8
  // wgrad) follow FP8RL_FP8_WGRAD_GEMM instead (fp8_wgrad_own). FP8RL_FP8_GEMM_SPLITS=S fixes the own kernel's
  // split count (1: every row's result independent of M, for the consistency experiments).
  // FP8RL_FP8_GEMM_STREAMK=1 (fp8_gemm_sm90_stream_k): auto also takes every decode-sized product
  // (M <= 256), and the own kernel runs those as stream-K (Fp8GemmArgs::stream_k) unless a split
  // count or block_m is given.
  bool use_own_fp8(int64_t M, int64_t N, int64_t K) const;
  // Whether an own-kernel product of M rows runs as stream-K (FP8RL_FP8_GEMM_STREAMK=1, M <= 256,
  // not under FP8RL_FP8_ROW_INVARIANT).
  bool stream_k_for(int64_t M) const;
  // Which kernel gemm_fp8 runs for 1x128-block B (the FP8 wgrad dW = dY^T X, A = dY^T and B = X^T:
  // M the layer's outputs, N its inputs, K the tokens), FP8RL_FP8_WGRAD_GEMM (read at construction): cublaslt
  // (the default: its VEC128 x VEC128 mode) or own (the own kernel's per-row B scales,
  // Fp8GemmArgs::b_scales_rows, wherever fp8_gemm_sm90_supported takes the shape; opt-in until
  // measured on a GPU). Whether the product of this shape runs on the own kernel:
  bool fp8_wgrad_own(int64_t M, int64_t N, int64_t K) const;
  // The same choice in code (tests and benchmarks): "own" or "cublaslt".
  void set_fp8_wgrad_kernel(const std::string& mode);
  // The own kernel with per-row B scales (fp8_gemm.h's b_scales_rows): C = alpha A B^T + beta C
  // with a E4M3 [M, K] (a_scales [M][ceil(K/128)], or [ceil(K/128)][M] when a_scales_kb_major)
  // and b E4M3 [N, K] with b_scales [ceil(K/128)][N] (16-byte aligned); 128-row tiles, splits
  // from fp8_gemm_sm90_b_rows_config (splits = 0) or given. Counted in own_products().
  void gemm_fp8_own_b_rows(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales,
                           bool a_scales_kb_major, const uint8_t* b, const float* b_scales, void* C, DType c_dtype,
                           float alpha, float beta, int splits = 0);
  // The grouped product of fp8_gemm.h (one launch over every group's rows): the own kernel only.
  // keep_maps: b and b_scales are long-lived (the experts' weights): their tensor maps are encoded
  // and uploaded once per pointer set and kept, so a call uploads only its tile table, through
  // pinned slots without a stream synchronization (an MoE decode step calls this three times per
  // block; encoding 128 experts' maps per call cost ~0.1 ms of host time each).
  void gemm_fp8_grouped(const std::vector<int64_t>& offsets, int64_t N, int64_t K, const uint8_t* a,
                        const float* a_scales, bool a_scales_kb_major, const std::vector<const uint8_t*>& b,
                        const std::vector<const float*>& b_scales, void* C, DType c_dtype, float alpha, float beta,
                        int block_m = 0, bool keep_maps = false);
  // The BF16 mode of the own kernel (fp8_gemm.h): C[M, N] = alpha * A B^T + beta * C with a BF16
  // [M, K] and b BF16 [N, K] (both K-major), FP32 accumulation, c_dtype BF16 or F32; N a multiple
  // of 16, K of 8. splits 0 and block_m 0 (64 or 128): fp8_gemm_sm90_config's for BF16, or
  // FP8RL_FP8_GEMM_SPLITS. Not counted in own_products() (the FP8 products).
  void gemm_bf16_own(int64_t M, int64_t N, int64_t K, const void* a, const void* b, void* C, DType c_dtype,
                     float alpha, float beta, int splits = 0, int block_m = 0);
  // gemm_fp8_grouped's BF16 mode: rows [offsets[g], offsets[g + 1]) of a (BF16 [R, K]) times
  // b[g]^T (BF16 [N, K]) into C [R, N]; block_m 0, 64 or 128; keep_maps as there.
  void gemm_bf16_grouped(const std::vector<int64_t>& offsets, int64_t N, int64_t K, const void* a,
                         const std::vector<const void*>& b, void* C, DType c_dtype, float alpha, float beta,
                         int block_m = 0, bool keep_maps = false);
  // The K-grouped BF16 product of fp8_gemm.h (the experts' weight gradients): for every group g
  // with a non-empty K range [k_offsets[g], k_offsets[g + 1]) (multiples of 64) and a non-null
  // c[g], C_g [M, N] = alpha * A[:, range] B[:, range]^T + beta * C_g, with a BF16 [M, K] and b
  // BF16 [N, K] K-major; one launch of the own kernel (tiles of block_m = 128 or 64 rows), its
  // group table uploaded per call.
  void gemm_bf16_kgrouped(int64_t M, int64_t N, int64_t K, const void* a, const void* b,
                          const std::vector<int64_t>& k_offsets, const std::vector<void*>& c, DType c_dtype,
                          float alpha, float beta, int block_m = 128);
  // The grouped products over a device tile table (fp8_gemm.h's Fp8GroupedArgs: tiles holds
  // max_tiles int4 {group, first row, group's end row, 0} built for block_m (64, 128, or 192 for
  // FP8), of which the first *tile_count (an int on the device) are valid; R rows of a and C).
  // Nothing is uploaded and nothing read back, so an MoE block's row counts need not reach the
  // host and the call may be captured in a CUDA graph. The groups' maps are kept as keep_maps
  // keeps them: the first call for a set of b (and b_scales) pointers encodes and uploads them,
  // so it must come before any capture (inside one it is an error that says so).
  void gemm_fp8_grouped_device(const int4* tiles, const int* tile_count, int64_t max_tiles, int64_t R, int block_m,
                               int64_t N, int64_t K, const uint8_t* a, const float* a_scales, bool a_scales_kb_major,
                               const std::vector<const uint8_t*>& b, const std::vector<const float*>& b_scales,
                               void* C, DType c_dtype, float alpha, float beta);
  void gemm_bf16_grouped_device(const int4* tiles, const int* tile_count, int64_t max_tiles, int64_t R, int block_m,
                                int64_t N, int64_t K, const void* a, const std::vector<const void*>& b, void* C,
                                DType c_dtype, float alpha, float beta);
  // The same choice in code (tests and benchmarks): "auto", "own" or "cublaslt".
  void set_fp8_kernel(const std::string& mode);
  // The kept grouped maps (keep_maps and the device forms): how many weight sets are kept, and
  // the count at which the ones no device-form call has used are freed (tests).
  size_t kept_grouped_map_sets() const { return grouped_maps_.size(); }
  void set_kept_maps_limit(size_t n) { kept_maps_limit_ = std::max<size_t>(n, 1); }
  // FP8RL_FP8_ROW_INVARIANT=1 (or this setter): cuBLASLt's block-scaled products take gemm()'s
  // row_invariant rule too — one algorithm per (B blocks, C type, N, K), chosen for M =
  // kRowInvariantM among those without split-K and workspace, for every M (the tail product's
  // included), so a row of C never depends on how many rows share the launch: the generator's
  // decode batches and the trainer's micro-batches compute the same bits (issue 11's
  // experiment: the linears' share of the mismatch without the own kernel's decode cost).
  void set_fp8_row_invariant(bool on) { fp8_row_invariant_ = on; }
  bool fp8_row_invariant() const { return fp8_row_invariant_; }
  // A diagnostic (bench-gemm --fast-accum): cuBLASLt's block-scaled products with
  // CUBLASLT_MATMUL_DESC_FAST_ACCUM set (off by default: it lets cuBLASLt skip promoting partial
  // sums into FP32, and the recipe keeps every 128-K block's sum in FP32), so that its speed and
  // its difference from the default can be measured side by side.
  void set_fp8_fast_accum(bool on) { fp8_fast_accum_ = on; }
  int64_t own_products() const { return own_products_; }

  // Diagnostics (bench-gemm --algos): with candidate c >= 0 the products that follow (not the
  // row-invariant ones) run the c-th of cuBLASLt's heuristic candidates for their shape instead of
  // its first (c = -1, the default); a shape with fewer candidates is an error naming the count.
  // lt_algo_desc(): while a candidate is forced, the last such product's algorithm as cuBLASLt's
  // configuration attributes (empty before).
  static constexpr int kMaxLtCandidates = 16;
  void set_lt_candidate(int c) {
    FP8RL_CHECK(c >= -1 && c < kMaxLtCandidates, "cuBLASLt candidate ", c, " (-1 .. ", kMaxLtCandidates - 1, ")");
    lt_candidate_ = c;
  }
  const std::string& lt_algo_desc() const { return lt_desc_; }
  // Diagnostics (bench-gemm --lt-search): the configuration space of the heuristic's first
  // algorithm. lt_enumerate(): the next product (not a row-invariant one) records every
  // configuration of its algorithm — tile, stages, split-K with each reduction scheme, CTA
  // swizzling, cluster shape — that cublasLtMatmulAlgoCheck accepts with the engine's workspace
  // (lt_space(), the heuristic's own configuration first); set_lt_config(&c): the products that
  // follow run that configuration (one the algorithm refuses throws); nullptr: the heuristic's.
  struct LtConfig {
    uint32_t tile = 0, stages = 0;
    int32_t splitk = 1;
    uint32_t reduction = 0, swizzle = 0;
    uint16_t cluster = 0;
    std::string str() const;
  };
  void lt_enumerate() { lt_enumerate_ = true; }
  const std::vector<LtConfig>& lt_space() const { return lt_space_; }
  void set_lt_config(const LtConfig* c) {
    lt_force_ = c != nullptr;
    if (c) lt_config_ = *c;
  }

  // Configurations tuned per product (the decode and prefill sizes, M <= kTuneMaxRows, beta 0):
  // cuBLASLt's heuristic picks one tile for a shape; at the decode step's M = 256 its FP8 block-
  // scaled choice (128 x 128 tiles) leaves most SMs idle (bench-gemm --lt-search, session 26:
  // o 8.9 -> 6.3 us with 64 x 64 tiles on the H100). At a product's first call outside a graph
  // capture the engine times the heuristic's algorithm in each tile and cluster shape cuBLASLt
  // accepts, with the heuristic's stages, split-K count and reduction, on the call's own operands
  // into a scratch output (each candidate as a captured graph of kTuneReps runs), and keeps the
  // fastest whose output is bitwise the heuristic's (the kTuneChecked fastest tried in order of
  // time; the heuristic's own otherwise) — so tuning changes speed, never results. Products first met inside a capture run
  // the heuristic's until an eager call tunes them. Products whose output exceeds
  // kTuneMaxOutputBytes (the lm_head's logits), or met when the two scratch outputs cannot be
  // allocated, keep the heuristic's. Which products: FP8RL_LT_TUNE=fp8 (the default) the
  // block-scaled FP8 ones (~50 ms of host time each on the H100, session 26: a few dozen shapes
  // per model, paid back within ~15 RL steps); all: the BF16 / FP32 ones too (more tiles to try,
  // and the lm_head at the small decode buckets: 32.6 s for the 1.7B bf16 recipe's 30 shapes, for
  // 2% of its generation, paid back only after hundreds of steps); 0: none.
  // tune_stats(): products tuned, those whose configuration changed, the time it took.
  static constexpr int64_t kTuneMaxRows = 512;
  static constexpr int kTuneReps = 8;
  static constexpr size_t kTuneChecked = 4;
  static constexpr size_t kTuneMaxOutputBytes = size_t(32) << 20;
  struct TuneStats {
    int64_t products = 0, changed = 0;
    double ms = 0.0;  // host time spent tuning
  };
  TuneStats tune_stats() const { return {tuned_count_, tuned_changed_, tune_ms_}; }
  // cuBLASLt heuristic queries (a product shape not seen before) and the host time they took.
  TuneStats heuristic_stats() const { return {heuristic_count_, 0, heuristic_ms_}; }
  enum class Tune { Off, Fp8, All };
  void set_tune(Tune t) { tune_ = t; }  // FP8RL_LT_TUNE in code (tests)
  // Backend::set_gemm_tuning: off, products not tuned yet keep the heuristic's configuration.
  bool set_tuning_allowed(bool on) {
    const bool prev = tuning_allowed_;
    tuning_allowed_ = on;
    return prev;
  }

  cudaStream_t stream() const { return stream_; }
  // FP8 products whose last M % 16 rows ran as a padded second product (since construction).
  int64_t tail_products() const { return tail_products_; }


 private:
  using Key = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int, int>;
  cublasLtMatmulAlgo_t find_algo(const Key& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                 cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, const char* what);
  cublasLtMatmulAlgo_t heuristic_algo(const Key& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                      cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, const char* what);
  // The tuned configuration of a product (see kTuneMaxRows); run(algo, C) issues the product with
  // that algorithm into C (the caller's operands, alpha, beta 0).
  cublasLtMatmulAlgo_t tuned_algo(const Key& key, const cublasLtMatmulAlgo_t& base, cublasLtMatmulDesc_t desc,
                                  cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                  int64_t M, int64_t N, DType c_dtype, float beta, bool fp8,
                                  const std::function<void(const cublasLtMatmulAlgo_t&, void*)>& run);
  // lt_enumerate / set_lt_config applied to the heuristic's algorithm of one product.
  cublasLtMatmulAlgo_t lt_configured(cublasLtMatmulAlgo_t base, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                     cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c);
  // The row-invariant algorithm of gemm(): asked once per key (M = -1) with a layout of
  // kRowInvariantM rows.
  cublasLtMatmulAlgo_t find_row_invariant_algo(const Key& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                               cublasLtMatrixLayout_t b_big, cublasLtMatrixLayout_t c_big,
                                               const char* what);
  float* scale_scratch(size_t floats);
  void* tail_scratch(size_t bytes);
  // The own kernel's split-K partials for M x N at `splits` (grown as needed).
  float* own_workspace(int64_t M, int64_t N, int splits);
  // Stream-K's partial tiles and tile counters (zeroed once: every call leaves them zero) for an
  // M x N product: grown here, so not inside a stream capture the first time a size is met.
  void stream_k_buffers(int64_t M, int64_t N, float** partials, int** counters);
  // The grouped kernel's device scratch of at least `bytes` (its tile table and, without kept
  // maps, the maps).
  void* grouped_scratch(size_t bytes);
  // keep_maps' device copy of the groups' maps for these weights (ab: E4M3 or BF16), encoded and
  // uploaded at the first call for the set (not inside a graph capture). pin: the device form's
  // (graph-capturable) maps, which a recorded graph keeps reading: never freed before the engine.
  const void* kept_grouped_maps(const std::vector<const uint8_t*>& b, const std::vector<const float*>& b_scales,
                                int64_t N, int64_t K, DType ab, bool pin);

  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  cublasHandle_t blas_ = nullptr;  // gemm_grouped's (made at its first call)
  void* grouped_ptrs_ = nullptr;   // its device pointer arrays
  size_t grouped_ptrs_bytes_ = 0;

  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  float* scales_ = nullptr;
  size_t scales_floats_ = 0;
  void* tail_ = nullptr;  // the padded tail's A rows and output rows
  size_t tail_bytes_ = 0;
  int64_t tail_products_ = 0;
  int64_t own_products_ = 0;
  int own_mode_ = 0;     // 0 cublaslt, 1 auto, 2 own (FP8RL_FP8_GEMM)
  int own_splits_ = 0;   // FP8RL_FP8_GEMM_SPLITS (0: from the shape)
  bool own_wgrad_ = false;  // FP8RL_FP8_WGRAD_GEMM=own (set_fp8_wgrad_kernel)
  bool fp8_row_invariant_ = false;  // FP8RL_FP8_ROW_INVARIANT (set_fp8_row_invariant)
  bool fp8_fast_accum_ = false;    // set_fp8_fast_accum (bench-gemm --fast-accum)
  std::map<std::tuple<int64_t, int64_t, int>, bool> fp8_lt_own_;  // fp8_lt_is_own's probes
  int sm_count_ = 132;
  float* own_ws_ = nullptr;  // split-K partials of the own kernel
  float* sk_partials_ = nullptr;  // stream-K's (stream_k_buffers)
  int* sk_counters_ = nullptr;
  int64_t sk_counters_n_ = 0;
  void* grouped_meta_ = nullptr;  // the grouped kernel's tile table, tensor maps and scale pointers
  size_t grouped_meta_bytes_ = 0;
  // keep_maps' device copies of fp8_gemm_sm90_grouped_maps, by {N, K, ab, b..., b_scales...};
  // pinned: used by the device form (a CUDA graph may hold it). When kept_maps_limit_ sets are
  // kept, the unpinned ones are freed (a bound on what stale pointer sets may hold). Pinned sets
  // live as long as the engine: each new device-form weight set (a generator's weights moved to
  // new buffers) adds one, ~17 KB for 128 experts.
  struct KeptMaps {
    void* dev = nullptr;
    bool pinned = false;
  };
  std::map<std::vector<uintptr_t>, KeptMaps> grouped_maps_;
  size_t kept_maps_limit_ = 4096;
  PinnedUploads uploads_;  // the grouped products' tile tables and cuBLAS's pointer arrays
  size_t own_ws_floats_ = 0;
  std::map<Key, cublasLtMatmulAlgo_t> algos_;
  int lt_candidate_ = -1;  // set_lt_candidate
  std::string lt_desc_;    // lt_algo_desc
  bool lt_enumerate_ = false, lt_force_ = false;  // lt_enumerate, set_lt_config
  LtConfig lt_config_;
  std::vector<LtConfig> lt_space_;
  Tune tune_ = Tune::Fp8;  // FP8RL_LT_TUNE
  std::map<Key, cublasLtMatmulAlgo_t> tuned_;
  int64_t tuned_count_ = 0, tuned_changed_ = 0;
  double tune_ms_ = 0.0;
  int64_t heuristic_count_ = 0;
  bool tuning_allowed_ = true;  // set_tuning_allowed
  double heuristic_ms_ = 0.0;
};

}  // namespace fp8rl::cuda
