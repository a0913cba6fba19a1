// Host-side launchers of the CUDA kernels (raw device pointers, shapes as integers). The
// backend (cuda_backend.cu) validates tensors and calls these; every launcher checks its launch.
// Float tensors are F32 or BF16 (`DType` arguments); math is FP32 inside.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend/adamw_rule.h"
#include "backend/sampling.h"
#include "core/dtype.h"

namespace fp8rl::cuda {

// ---- quantization (quant_kernels.cu) ----
// x [x_rows, x_cols]; q [R, C] with R, C = x's shape, swapped when `transpose`; scales
// [ceil(R / block_rows), ceil(C / block_cols)]. Sets *bad_flag = 1 on non-finite input.
// q_ld: q's row stride (0 = C). A transposed output may be padded, C < q_ld <= round_up(C, 128):
// columns [C, q_ld) are written as zeros and the scales cover the real columns only (the FP8
// wgrad's token dimension, padded to cuBLASLt's K granularity). gemm_layout (1x128 blocks):
// scales written as cuBLASLt's VEC128 layout [ceil(C/128)][R] instead of [R][ceil(C/128)], so a
// GEMM of R % 16 == 0 rows needs no separate layout kernel (the decode step's FP8 linears); the
// same values, K-block-major (transposed: the FP8 wgrad's operands for the own kernel's per-row B).
void launch_quantize(const void* x, DType x_dtype, int64_t x_rows, int64_t x_cols, bool transpose, int block_rows,
                     int block_cols, bool pow2, uint8_t* q, float* scales, int* bad_flag, cudaStream_t stream,
                     int64_t q_ld = 0, bool gemm_layout = false);
// One weight of a batched weight quantization: w [N, K] (K % 8 == 0, 16-byte aligned) into q
// [N, K] with 128x128 scales qs, and when qt is non-null w^T into qt [K, N] with scales qts.
struct WeightQuantTensor {
  const void* w;
  int64_t N, K;
  uint8_t* q;
  float* qs;
  uint8_t* qt;  // nullptr: no W^T copy
  float* qts;
};
// Every weight of `ws` (all of dtype w_dtype), up to 48 per launch: each CTA reads one 128x128
// tile once and writes its codes to q and, transposed, to qt. Bitwise launch_quantize(w, false)
// and launch_quantize(w, true) with 128x128 blocks. Sets *bad_flag = 1 on non-finite input.
void launch_quantize_weights(const std::vector<WeightQuantTensor>& ws, DType w_dtype, bool pow2, int* bad_flag,
                             cudaStream_t stream);
void launch_dequantize(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, int block_rows,
                       int block_cols, void* out, DType out_dtype, cudaStream_t stream);
// Exact transpose of a block x block quantization (block x block scales): q [rows, cols] ->
// qt [cols, rows], scales [ceil(rows/block), ceil(cols/block)] -> scales_t transposed.
void launch_transpose_quant(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, int block,
                            uint8_t* qt, float* scales_t, cudaStream_t stream);
void launch_scales_vec128(const float* s, int64_t rows, int64_t nb, int64_t ld, float* out, cudaStream_t stream);
void launch_scales_blk(const float* s, int64_t rb, int64_t cb, int64_t ld, float* out, cudaStream_t stream);

// ---- element-wise and reductions (elementwise_kernels.cu) ----
// The columns of one [rows, C] buffer split into up to kSplitColsMax row-major outputs: output o
// takes the row bytes [end[o - 1], end[o]) (end[-1] = 0) of every row. Element size >= 2 bytes.
constexpr int kSplitColsMax = 3;
struct SplitColsArgs {
  void* out[kSplitColsMax];
  int64_t end[kSplitColsMax];  // cumulative row bytes
  int n = 0;
};
void launch_split_cols(const void* src, int64_t rows, const SplitColsArgs& a, cudaStream_t stream);
void launch_fill(void* p, DType dtype, int64_t n, float value, cudaStream_t stream);
void launch_convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n, cudaStream_t stream);
void launch_add(const void* a, DType adt, const void* b, DType bdt, void* out, DType odt, int64_t n,
                cudaStream_t stream);
void launch_scale(void* x, DType dtype, int64_t n, float s, cudaStream_t stream);
// dst[i] = bf16(src[i]) for every tensor (n[i] % 8 == 0, 16-byte aligned), many per launch;
// bitwise launch_convert.
void launch_convert_many_f32_bf16(const std::vector<const float*>& src, const std::vector<void*>& dst,
                                  const std::vector<int64_t>& n, cudaStream_t stream);
// dst[i] += float(src[i]) for every tensor (src BF16, dst F32; n[i] elements each), many per
// launch: the grouped weight gradient's BF16 products added into F32 gradients.
void launch_accumulate_many_bf16_f32(const std::vector<const void*>& src, const std::vector<float*>& dst,
                                     const std::vector<int64_t>& n, cudaStream_t stream);
// out[i] = sum xs[i]^2 in FP64 (ns[i] elements of dtypes[i]) for every tensor, deterministically
// (a tensor's sum is the same whatever tensors share its launch); partials: scratch of
// sum_squares_partials(ns) doubles.
int64_t sum_squares_partials(const std::vector<int64_t>& ns);
void launch_sum_squares_many(const std::vector<const void*>& xs, const std::vector<DType>& dtypes,
                             const std::vector<int64_t>& ns, double* out, double* partials, cudaStream_t stream);
// *out = max over i of the bits of |x[i]| (out zeroed by the caller): a float, NaN if any x is.
void launch_amax(const void* x, DType dtype, int64_t n, uint32_t* out, cudaStream_t stream);
void launch_flag_nonfinite(const void* x, DType dtype, int64_t n, int* flag, cudaStream_t stream);
// out[r, c] += bias[c] ; out [rows, cols].
void launch_add_bias(void* out, DType odt, const void* bias, DType bdt, int64_t rows, int64_t cols, cudaStream_t stream);
// Column sums over rows without atomics, so the same bits every run: the rows are cut into
// column_sum_chunks(rows) chunks whose per-column partial sums go to part [chunks, cols] (F32),
// then out[c] += the partials in chunk order (launch_add_column_partials).
int64_t column_sum_chunks(int64_t rows);
void launch_add_column_partials(const float* part, int64_t chunks, int64_t cols, float* out, cudaStream_t stream);
// The same sum for many chunks (a fixed tree: 8 or 32 interleaved runs, then their sums in order).
void launch_sum_column_partials(const float* part, int64_t chunks, int64_t cols, float* out, cudaStream_t stream);
// dbias[c] += sum_r dy[r, c] ; dbias F32; part: column_sum_chunks(rows) x cols floats.
void launch_bias_grad(const void* dy, DType dt, int64_t rows, int64_t cols, float* dbias, float* part,
                      cudaStream_t stream);

// ---- mixture of experts (moe_kernels.cu); shapes as in backend.h ----
// logits F32 [T, E] -> experts I32 [T, k], weights F32 [T, k]; dlogits F32 [T, E] from dweights [T, k].
void launch_moe_route_softmax(const float* logits, int64_t T, int E, int k, bool renorm, int32_t* experts,
                              float* weights, cudaStream_t stream);
void launch_moe_route_softmax_backward(const float* logits, const int32_t* experts, const float* dweights, int64_t T,
                                       int E, int k, bool renorm, float* dlogits, cudaStream_t stream);
// DeepSeek-V3 sigmoid routing (bias F32 [E] or null; n_group <= 64) and its backward.
void launch_moe_route_sigmoid(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                              int topk_group, bool renorm, float scaling, int32_t* experts, float* weights,
                              cudaStream_t stream);
void launch_moe_route_sigmoid_backward(const float* logits, const int32_t* experts, const float* dweights, int64_t T,
                                       int E, int k, bool renorm, float scaling, float* dlogits, cudaStream_t stream);
// Routing replay: weights F32 [T, k] of given experts I32 [T, k] (out of [0, E): *bad_flag = 1).
void launch_moe_route_softmax_weights(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                      bool renorm, float* weights, int* bad_flag, cudaStream_t stream);
void launch_moe_route_sigmoid_weights(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                      bool renorm, float scaling, float* weights, int* bad_flag, cudaStream_t stream);
// out [R, D] = x[row_slot / k] (* weights[row_slot]); slots = T * k bounds row_slot (else *bad_flag = 1).
void launch_moe_permute(const void* x, DType dt, const int32_t* row_slot, const float* weights, int64_t R, int64_t D,
                        int k, int64_t slots, void* out, int* bad_flag, cudaStream_t stream);
// The FP8 copy of moe_permute's output from x's: rows of xq [T, D] (scales xs, block-major when
// xs_kb) gathered into q [R, D] (scales s, block-major when s_kb). false (nothing launched):
// D % 16 != 0 or unaligned rows.
bool launch_moe_permute_fp8(const uint8_t* xq, const float* xs, bool xs_kb, int64_t T, const int32_t* row_slot,
                            int64_t R, int64_t D, int k, uint8_t* q, float* s, bool s_kb, int* bad_flag,
                            cudaStream_t stream);
// moe_permute (weights optional) and out's 1x128 FP8 copy in the same pass (q, scales: block-major
// with gemm_layout). false (nothing launched): D % 8 != 0 or unaligned rows.
bool launch_moe_permute_quant(const void* x, DType dt, const int32_t* row_slot, const float* weights, int64_t tokens,
                              int64_t R, int64_t D, int k, void* out, bool pow2, uint8_t* q, float* scales,
                              bool gemm_layout, int* bad_flag, cudaStream_t stream);
// out [T, D] = sum_j (weights[t*k+j] *) y[slot_row[t*k+j]], y [R, D].
void launch_moe_unpermute(const void* y, DType dt, const int32_t* slot_row, const float* weights, int64_t T,
                          int64_t D, int k, int64_t R, void* out, int* bad_flag, cudaStream_t stream);
// dweights F32 [S = T*k] = dot(dout[s / k], y[slot_row[s]]).
void launch_moe_weight_grad(const void* dout, const void* y, DType dt, const int32_t* slot_row, int64_t S, int64_t D,
                            int k, int64_t R, float* dweights, int* bad_flag, cudaStream_t stream);
// moe_plan (backend.h): one CTA; E <= 1024; tiles [max_tiles, 4], 16-byte aligned; bad_flag set for
// an expert outside [0, E).
// The experts' weight-gradient operands (the own kernel's K-grouped form, fp8_gemm.h): the rows
// of src (BF16 [R, cols], cols a multiple of 8) transposed into dst (BF16 [cols, ld], ld a
// multiple of 64) in blocks of 64 columns: dst column block j holds the transposes of src rows
// [blocks[j].x, blocks[j].x + blocks[j].y) (0 < y <= 64) in its first y columns, zeros after.
// blocks: nblocks int2 on the device.
void launch_transpose_row_blocks_bf16(const void* src, int64_t cols, const int2* blocks, int64_t nblocks, int64_t ld,
                                      void* dst, cudaStream_t stream);
void launch_moe_plan(const int32_t* experts, int64_t R, int E, int block_m, int32_t* offsets, int32_t* row_slot,
                     int32_t* slot_row, int32_t* tiles, int64_t max_tiles, int32_t* tile_count, int* bad_flag,
                     cudaStream_t stream);

// ---- model ops (model_kernels.cu) ----
void launch_embedding(const int32_t* ids, int64_t T, const void* table, DType tdt, int64_t V, int64_t D, void* out,
                      DType odt, int* bad_flag, cudaStream_t stream);
// dtable[ids[t]] += dout[t] in token order per row, no atomics (embedding_backward.cu); scratch:
// embedding_backward_scratch_bytes(T) bytes, 256-byte aligned.
int64_t embedding_backward_scratch_bytes(int64_t T);
void launch_embedding_backward(const int32_t* ids, int64_t T, const void* dout, DType ddt, int64_t V, int64_t D,
                               float* dtable, int* bad_flag, void* scratch, int64_t scratch_bytes, cudaStream_t stream);
void launch_rmsnorm(const void* x, DType xdt, const void* w, DType wdt, int64_t R, int64_t D, float eps, void* out,
                    DType odt, float* rstd, cudaStream_t stream);
// dw += sum_r dout * x * rstd by partial sums in dw_part [rmsnorm_backward_partial_rows(R), D] (F32):
// for 8-aligned rows of D <= 256 or of up to 2 chunks of 8 per thread one pass over dout and x
// writes dx and the partials of row ranges, else column_sum_chunks(R) partials of a second pass.
int64_t rmsnorm_backward_partial_rows(int64_t R);
void launch_rmsnorm_backward(const void* dout, DType gdt, const void* x, DType xdt, const void* w, DType wdt,
                             const float* rstd, int64_t R, int64_t D, void* dx, DType dxdt, float* dw, float* dw_part,
                             cudaStream_t stream);
// ---- fused producers of FP8 linear inputs (fused_kernels.cu) ----
// out = rmsnorm(x) over rows [R, D] (x = a, or with b non-null x = sum = a + b, written; sum may
// alias a), rstd [R] written when non-null, and with q non-null out's 1x128 E4M3 copy q [R, D]
// with scales [R][ceil(D/128)] (gemm_layout: [ceil(D/128)][R]); non-finite outputs set
// *bad_flag. a, b, sum, out share dtype dt. Bitwise launch_add + launch_rmsnorm + launch_quantize.
// Returns false, launching nothing, when the shape or alignment has no fused kernel (D % 8 != 0,
// pointers not 16-byte aligned): the caller then runs the unfused ops.
bool launch_rmsnorm_fused(const void* a, const void* b, void* sum, DType dt, const void* w, DType wdt, int64_t R,
                          int64_t D, float eps, void* out, float* rstd, bool pow2, uint8_t* q, float* scales,
                          bool gemm_layout, int* bad_flag, cudaStream_t stream);
// out = swiglu(g, u) over [R, F] and its 1x128 E4M3 copy (scales as above); false as above. g and
// u rows ld elements apart (F for separate tensors; 2F for the halves of one gate|up product).
bool launch_swiglu_fp8(const void* g, const void* u, int64_t ld, void* out, DType dt, int64_t R, int64_t F, bool pow2,
                       uint8_t* q, float* scales, bool gemm_layout, int* bad_flag, cudaStream_t stream);
// out = a + b over [R, D] (out may alias a; one dtype) and its 1x128 E4M3 copy (scales as
// above); bitwise launch_add + launch_quantize; false as above.
bool launch_add_fp8(const void* a, const void* b, void* out, DType dt, int64_t R, int64_t D, bool pow2, uint8_t* q,
                    float* scales, bool gemm_layout, int* bad_flag, cudaStream_t stream);
// dg, du = swiglu_backward(dout, g, u) over [R, F] and their 1x128 E4M3 copies qg, qu (scales
// sg, su as above); bitwise launch_swiglu_backward + two launch_quantize; false as above.
bool launch_swiglu_backward_fp8(const void* dout, const void* g, const void* u, void* dg, void* du, DType dt, int64_t R,
                                int64_t F, bool pow2, uint8_t* qg, float* sg, uint8_t* qu, float* su, bool gemm_layout,
                                int* bad_flag, cudaStream_t stream);
constexpr int kMaxRopeHalf = 256;
struct RopeTable {
  float inv_freq[kMaxRopeHalf];
};
// interleaved: pairs (2i, 2i + 1) (DeepSeek-V3's rope_interleave), else (i, i + hd / 2).
void launch_rope(void* x, DType dt, int64_t T, int64_t H, int64_t hd, const int32_t* pos, const RopeTable& tab,
                 float attention_scaling, bool inverse, bool interleaved, cudaStream_t stream);
// rmsnorm over each [hd] row of x [T, H, hd] (weight w [hd]) into out, then RoPE (not inverse) on
// out: launch_rmsnorm then launch_rope, bit for bit, in one pass. False (nothing launched) outside
// its limits (hd <= 256, a multiple of 16; 16-byte aligned rows): the caller runs the two ops.
bool launch_rmsnorm_rope(const void* x, DType dt, const void* w, DType wdt, int64_t T, int64_t H, int64_t hd,
                         float eps, void* out, float* rstd, const int32_t* pos, const RopeTable& tab,
                         float attention_scaling, bool interleaved, cudaStream_t stream);
// rmsnorm_rope over the q and k heads of a concatenated q|k|v product qkv [T, Hq + 2 Hkv, hd]
// (norm weights wq, wk of dtype wdt) into q [T, Hq, hd] and k [T, Hkv, hd], and its v heads
// copied into v [T, Hkv, hd]: one launch, each row's values those of launch_rmsnorm_rope.
// The KV cache write of qkv_norm_rope (kv_write's, in the same kernel): none while slots is null.
// e4m3 (set by the launcher from the pool dtype): the pools hold E4M3 codes over the per-head
// scales k_scale / v_scale; otherwise the activation dtype's values.
struct QkvCacheWrite {
  const int32_t* slots = nullptr;
  void* kpool = nullptr;
  void* vpool = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bool e4m3 = false;
};
// kv (optional): also write k and v into the cache of dtype pool_dt (E4M3, or dt); false when the
// shapes, alignment or pool dtype are outside the kernel's (nothing written then).
bool launch_qkv_norm_rope(const void* qkv, DType dt, const void* wq, const void* wk, DType wdt, int64_t T,
                          int64_t Hq, int64_t Hkv, int64_t hd, float eps, void* q, void* k, void* v, float* q_rstd,
                          float* k_rstd, const int32_t* pos, const RopeTable& tab, float attention_scaling,
                          bool interleaved, cudaStream_t stream, QkvCacheWrite kv = {}, DType pool_dt = DType::BF16);
void launch_swiglu(const void* g, const void* u, void* out, DType dt, int64_t n, cudaStream_t stream);
// out [R, F] = swiglu(g, u) with g and u rows ld elements apart (the halves of a gate|up product).
void launch_swiglu_rows(const void* g, const void* u, int64_t ld, void* out, DType dt, int64_t R, int64_t F,
                        cudaStream_t stream);
void launch_swiglu_backward(const void* dout, const void* g, const void* u, void* dg, void* du, DType dt, int64_t n,
                            cudaStream_t stream);
// ---- optimizer (optimizer_kernels.cu) ----
// One tensor of a multi-tensor AdamW: p F32 [n], g [n], m and v [n]; its weight decay as
// adamw_scalars' `decay` (1 - lr * weight_decay) and its stochastic-rounding key.
struct AdamWTensor {
  float* p;
  const void* g;
  void* m;
  void* v;
  int64_t n;
  float decay;
  uint64_t key;
};
// AdamW by adamw_rule.h over every tensor of `ts` (g of g_dtype, F32 or BF16; m and v of
// m_dtype: BF16 bits, or F32 by adamw_f32_moments_step), the scalars of `s` except each tensor's
// decay; up to 64 tensors per launch, elements at their own indices (bitwise a launch per tensor).
void launch_adamw_many(const std::vector<AdamWTensor>& ts, DType g_dtype, DType m_dtype, const AdamWScalars& s,
                       bool stochastic, int64_t step, cudaStream_t stream);

// ---- attention (attention_kernels.cu) ----
// Packed causal GQA. seq_start[t]: first token of t's sequence; seq_end[t]: one past its last.
// q, k [T, H*, hd]; v [T, Hkv, hdv], out, dout [T, Hq, hdv] (MLA: hdv = v_head_dim != hd).
void launch_attention(const void* q, const void* k, const void* v, DType dt, const int32_t* seq_start,
                      int64_t T, int Hq, int Hkv, int hd, int hdv, float scale, void* out, float* lse,
                      cudaStream_t stream);
void launch_attention_backward(const void* dout, const void* q, const void* k, const void* v, const void* out,
                               DType dt, const float* lse, const int32_t* seq_start, const int32_t* seq_end,
                               int64_t T, int Hq, int Hkv, int hd, int hdv, float scale, void* dq, void* dk, void* dv,
                               float* scratch_delta, cudaStream_t stream);
// Tensor-core flash attention (flash_attention.cu): BF16 q/k/v/out/dout, head dims (hd of q and
// k, hdv of v and out) (64, 64), (128, 128) or (192, 128) (MLA), 16-byte aligned tensors. Same
// contract as the launchers above; tiles are kFlashTile tokens of one sequence. `tiles` (device)
// holds flash_attention_tiles(cu_seqlens): 2 * num_tiles descriptors of 4 int32 (num_tiles = its
// size / 8). The backward's F32 scratch `work` holds flash_attention_backward_work(T, Hq, Hkv,
// hd, hdv) floats (delta; with GQA the dk/dv partials of every q head).
constexpr int kFlashTile = 64;
bool flash_attention_supported(DType dt, int hd, int hdv);
// The decode attention in flash attention's order (flash_attention.cu, flash_decode_kernel): q
// [T, Hq, hd] BF16 over a paged cache (BF16 pools, or E4M3 with the layer's per-head k_scale /
// v_scale), token t attending positions 0..token_pos[t] of its sequence (page_table row
// token_seq[t]); out [T, Hq, hd] BF16, each row bitwise launch_flash_attention's for that token
// over the cache's values (E4M3: code * scale rounded to BF16, kv_round's values). hd 64 / 128,
// group Hq / Hkv <= 16, q, pools and out 16-byte aligned. PagedBatch::flash_order.
bool flash_decode_supported(int hd, int group, DType pool_dt, DType qdt);
void launch_flash_decode(const void* q, const int32_t* token_seq, const int32_t* token_pos, const int32_t* page_table,
                         int max_pages, int64_t T, int Hq, int Hkv, int hd, int page_size, const void* kpool,
                         const void* vpool, DType pool_dt, const float* k_scale, const float* v_scale, float scale,
                         void* out, cudaStream_t stream);
int64_t flash_attention_backward_work(int64_t T, int Hq, int Hkv, int hd, int hdv);
std::vector<int32_t> flash_attention_tiles(const std::vector<int32_t>& cu_seqlens);
void launch_flash_attention(const void* q, const void* k, const void* v, const int32_t* tiles, int num_tiles,
                            int64_t T, int Hq, int Hkv, int hd, int hdv, float scale, void* out, float* lse,
                            cudaStream_t stream);
void launch_flash_attention_backward(const void* dout, const void* q, const void* k, const void* v, const void* out,
                                     const float* lse, const int32_t* tiles, int num_tiles, int64_t T, int Hq,
                                     int Hkv, int hd, int hdv, float scale, void* dq, void* dk, void* dv, float* work,
                                     cudaStream_t stream);
// KV pool element type: F32, BF16 or E4M3 (then k_scale/v_scale [Hkv] of the layer apply).
// Per-head scales by value (at most kMaxKvRoundHeads KV heads).
constexpr int kMaxKvRoundHeads = 64;
struct KvRoundScales {
  float v[kMaxKvRoundHeads];
};
void launch_kv_round(void* x, DType dt, int64_t T, int H, int hd, const KvRoundScales& s, cudaStream_t stream);
// v / vpool null: a latent (MLA) cache, k only.
void launch_kv_write(const void* k, const void* v, DType src_dt, const int32_t* slots, int64_t T, int Hkv, int hd,
                     void* kpool, void* vpool, DType pool_dt, const float* k_scale, const float* v_scale,
                     cudaStream_t stream);
// The simple paged kernel. K rows of hd values; V rows of hdv values at a row stride of v_row
// elements per (slot, KV head) in vpool: hdv = v_row = hd for a K/V cache; for MLA's latent
// cache vpool = kpool, v_row = hd and hdv = latent_v_dim (V is the first values of the K row).
// out [T, Hq, hdv]. hd, hdv <= kPagedSimpleMaxDim.
constexpr int kPagedSimpleMaxDim = 768;
void launch_attention_paged(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                            const int32_t* page_table, int max_pages, int64_t T, int Hq, int Hkv, int hd, int hdv,
                            int v_row, int page_size, const void* kpool, const void* vpool, DType pool_dt,
                            const float* k_scale, const float* v_scale, float scale, bool fp8_q, void* out,
                            cudaStream_t stream, float* lse = nullptr);  // lse: [Hq, T] natural, when non-null
// Paged decode/prefill attention (paged_attention.cu): same contract as launch_attention_paged
// (the simple reference kernel above, one warp per (token, q head)); one CTA per (token, KV
// head, split) serves the whole query-head group, the positions of a token are split into
// `split.splits` chunks of `split.chunk` whose partials (part_o F32 [T, Hq, splits, hd],
// part_lse F32 [T, Hq, splits]; unused when splits == 1) a combine kernel merges.
// Supported: head_dim 64 or 128, group Hq / Hkv <= kPagedMaxGroup, 16-byte aligned pools.
// Two kernels of that contract: the tiled one (default; lanes over positions for QK^T) and the
// grouped one (grouped = true; lanes over head dims throughout, the earlier default).
constexpr int kPagedMaxGroup = 8;
constexpr int kPagedTargetCtasPerSm = 4;  // split until T * Hkv * splits fills this many CTAs per SM
constexpr int kPagedMinChunk = 128;       // ... but never below this many positions per split (a tile per warp)
constexpr int kPagedMaxSplits = 64;
// The consistent mode's split (PagedBatch::batch_invariant): positions in chunks of this many (a
// multiple of the tensor-core kernel's 16-position tile), whatever the batch. 1024 (512 until
// session 27): a decode graph's plan is sized by its page-table width (a power of two of pages),
// so at 512 every replay of a 600-position rollout ran two splits and the combine; at 1024 one
// CTA per (token, head) up to 1024 positions — the near-exact recipe's generation 1.791 -> 1.705 s
// and step 0.97x -> 0.99x of fp8_e2e's (H100, docs/benchmarks.md session 27).
constexpr int kPagedInvariantChunk = 1024;
struct PagedSplit {
  int splits = 1, chunk = 1;  // split s covers positions [s * chunk, (s + 1) * chunk); the last one runs to pos
};
bool paged_attention_supported(int hd, int group, DType pool_dt, const void* kpool, const void* vpool);
// The split plan for T tokens of which the longest attends to max_pos positions; forced > 0
// imposes that many splits (clamped to [1, max_pos]).
PagedSplit paged_attention_split(int64_t T, int Hkv, int max_pos, int sm_count, int forced);
void launch_paged_attention(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                            const int32_t* page_table, int max_pages, int64_t T, int Hq, int Hkv, int hd,
                            int page_size, const void* kpool, const void* vpool, DType pool_dt, const float* k_scale,
                            const float* v_scale, float scale, bool fp8_q, const PagedSplit& split, float* part_o,
                            float* part_lse, void* out, cudaStream_t stream, bool grouped = false,
                            float* lse_out = nullptr);
// lse_out (non-null): also the natural log-sum-exp [Hq, T] of each token's scores (backend.h
// attention_paged's lse); the kernels then write partials whatever the split count (part_o,
// part_lse needed) and the combine writes out and lse — out is the same bits as without it.
// The consistent mode's plan: chunks of kPagedInvariantChunk, splits for max_pos (both kernels).
PagedSplit paged_attention_invariant_split(int max_pos);
// The tensor-core decode kernel (paged_attention.cu, paged_mma_kernel; the default where it
// applies): same contract and partial layout, for BF16 q over BF16 or E4M3 pools, head_dim 64 or
// 128, group <= 8 (prefill chunks too: one CTA per token, as above). Its split plan
// (paged_attention_mma_split: chunks are multiples of 16 positions, chosen for the CTAs the
// device holds at once) must be the one passed to launch_paged_attention_mma.
// Variants (paged_attention.cu: 0 is paged_mma_kernel, 1.. the transposed paged_mmat_kernel
// with its knobs): `variant` < 0 takes FP8RL_PAGED_VARIANT (a number or a name, read at each
// call; unset: the default); the split plan and the launch must name the same one.
bool paged_attention_mma_supported(int hd, int group, DType pool_dt, DType qdt, const void* kpool,
                                   const void* vpool);
int paged_attention_mma_variants();
const char* paged_attention_mma_variant_name(int v);
int paged_attention_mma_variant_env();  // FP8RL_PAGED_VARIANT, or the default; errors on other values
// The variant of batch-invariant batches (the consistent mode's decode and query runs): the
// runs' own unless FP8RL_PAGED_VARIANT names one (then the runs apply only if it is that one).
int paged_attention_mma_invariant_variant();
int paged_attention_mma_blocks_per_sm(int hd, DType pool_dt, int variant = -1);
PagedSplit paged_attention_mma_split(int64_t T, int Hkv, int hd, DType pool_dt, int max_pos, int sm_count, int forced,
                                     int variant = -1);
// The output's 1x128 E4M3 copy that launch_paged_attention_mma writes with out when asked (head_dim
// 128: one block per (token, head)): bitwise what the 1x128 quantizer makes of out [T, Hq * 128].
struct PagedOutFp8 {
  uint8_t* q;          // [T, Hq * 128] codes
  float* scales;       // [T, Hq] row-major, or [Hq][T] with gemm_layout
  bool gemm_layout, pow2;
  int* bad;            // set to 1 when an output is not finite
};
void launch_paged_attention_mma(const void* q, DType qdt, const int32_t* token_seq, const int32_t* token_pos,
                                const int32_t* page_table, int max_pages, int64_t T, int Hq, int Hkv, int hd,
                                int page_size, const void* kpool, const void* vpool, DType pool_dt,
                                const float* k_scale, const float* v_scale, float scale, bool fp8_q,
                                const PagedSplit& split, float* part_o, float* part_lse, void* out, cudaStream_t stream,
                                int variant = -1, float* lse_out = nullptr, const PagedOutFp8* out_fp8 = nullptr,
                                const int32_t* qruns = nullptr, int64_t nruns = 0, int run_tokens = 0,
                                int64_t pool_slots = 0);
// pool_slots: the pools' pages x page_size, bounding the TMA variant's boxes (0: unbounded).
// Query runs (qruns: I32 [nruns][2] {first token, count}, every token in exactly one run; a run is
// count <= run_tokens <= paged_attention_run_tokens(group) consecutive tokens of one sequence at
// consecutive positions, e.g. a sequence scored whole): where paged_attention_runs_apply, one CTA per (run,
// KV head, split) serves the run's tokens from one read of their K/V (the consistent mode's
// scoring), each token's out / lse bitwise what the one-token CTAs give it; elsewhere the runs
// are ignored (one CTA per token). The default variant only, no fused FP8 output, group 1, 2, 4, 8.
// Runs of up to 8 (token, head) columns take one block of the MMA kernel, up to 16 two, up to
// 64 (paged_attention_run_tokens) the wide CTAs: 8 warps, a block each, every K/V tile converted
// once for the whole run.
bool paged_attention_runs_apply(int group, int variant, bool out_fp8);
int paged_attention_run_tokens(int group);

// ---- sampling (sample_kernels.cu) ----
// One token per row of logits [B, V] (F32), backend.h's semantics; per-row parameters on the
// device; keys/weights are scratch [B, V]. *bad_flag = 1 when a row holds NaN / +inf or only -inf.
// logits [B, ld]; row b samples over its first V <= ld ids (the rest are never read).
// Row b's parameters are element b * pstride of temperature / top_p / top_k / uniforms (1: four
// arrays; 8: the fields of a SampleRow array); only_truncating skips rows without top-k / top-p
// (sample_rows: the Gumbel kernel's); out-of-range parameters set *bad_flag (token 0, logp NaN).
void launch_sample(const float* logits, int64_t B, int64_t ld, int64_t V, const float* temperature, const float* top_p,
                   const int32_t* top_k, const float* uniforms, int64_t pstride, bool only_truncating, int32_t* tokens,
                   float* logp, int* bad_flag, cudaStream_t stream);

// ---- the Gumbel-max sampler (sample_gumbel_kernels.cu) ----
// sample_rows' rows that do not truncate (greedy or plain temperature), backend.h's semantics:
// rows[B] SampleRow on the device; logits [B, ld], ids [0, V) drawable. Truncating rows are
// left alone when `truncation` (launch_sample draws them), else they are errors. splits blocks
// per row (sample_gumbel_splits), scratch of sample_gumbel_scratch_bytes. *bad_flag = 1 for a
// row with NaN / +inf, only -inf drawable, or bad parameters (token 0, logp NaN).
int sample_gumbel_splits(int64_t B, int64_t ld, int sm_count);
size_t sample_gumbel_scratch_bytes(int64_t B, int splits);
// logits F32 or BF16 (exactly the draws and logp of their F32 copy).
void launch_sample_gumbel(const void* logits, DType dtype, int64_t B, int64_t ld, int64_t V, const SampleRow* rows,
                          bool truncation, int splits, void* scratch, int32_t* tokens, float* logp, int* bad_flag,
                          cudaStream_t stream);

// ---- fused log-probabilities (logprob_kernels.cu) ----
// Online log-sum-exp over one vocabulary chunk of raw logits (F32) starting at v0: Vc values
// per row, row t at logits + t * ld (ld = Vc: a [T, Vc] chunk; ld = V: a column slice of
// [T, V] logits, read in place); state m, s, e (entropy accumulator) and tgt (target logit) of
// length T.
void launch_logprob_chunk(const float* logits, int64_t ld, int64_t T, int64_t Vc, int64_t v0, int64_t V,
                          float inv_temp, const int32_t* targets, float* m, float* s, float* e, float* tgt,
                          int* bad_flag, cudaStream_t stream);
// Every chunk of each of R rows of [R, V] logits, folded in order [0, chunk), [chunk, 2 chunk),
// ...: the same state bits as launch_logprob_chunk over those column slices, in three launches
// whatever the number of chunks (the chunks' two passes run in parallel, then a serial merge).
// scratch: logprob_rows_scratch_bytes(R, V, chunk) bytes of device memory.
int64_t logprob_rows_scratch_bytes(int64_t R, int64_t V, int64_t chunk);
void launch_logprob_rows(const float* logits, int64_t R, int64_t V, int64_t chunk, float inv_temp,
                         const int32_t* targets, float* m, float* s, float* e, float* tgt, int* bad_flag,
                         void* scratch, cudaStream_t stream);
void launch_logprob_init(float* m, float* s, float* e, float* tgt, int64_t T, cudaStream_t stream);
void launch_logprob_finish(const float* m, const float* s, const float* e, const float* tgt, int64_t T, float* logp,
                           float* lse, float* entropy, cudaStream_t stream);
// In place: logits [T, Vc] -> dlogits = dlogp[t] * (onehot - softmax) * inv_temp; with out_bf16
// the gradient goes there in BF16 instead, logits left as they are.
void launch_logprob_grad_chunk(float* logits, int64_t T, int64_t Vc, int64_t v0, float inv_temp,
                               const int32_t* targets, const float* lse, const float* dlogp, cudaStream_t stream,
                               void* out_bf16 = nullptr);

// ---- MLA latent decode attention (mla_decode.cu) ----
// Tensor-core paged attention over MLA's latent cache (KvCache::latent_v_dim = kMlaV, head_dim
// kMlaRow, num_kv_heads 1): q [T, H, kMlaRow] BF16 (absorbed queries), pool [num_pages,
// page_size, kMlaRow] BF16 or E4M3 (value = code * k_scale[0]; V is the first kMlaV values of
// each row), out [T, H, kMlaV] BF16, lse [H, T] (natural) when non-null: launch_attention_paged's
// semantics. One CTA per (token, block of 16 heads). Returns false, launching nothing, for what it
// does not take (other pool dtypes, E4M3 without k_scale, pointers not 16-byte aligned, ...).
constexpr int kMlaRow = 576;  // kv_lora_rank 512 + qk_rope_head_dim 64
constexpr int kMlaV = 512;    // kv_lora_rank
bool launch_mla_decode(const void* q, const int32_t* token_seq, const int32_t* token_pos, const int32_t* page_table,
                       int max_pages, int64_t T, int H, int page_size, const void* pool, DType pool_dtype /*BF16 or E4M3*/,
                       const float* k_scale, float softmax_scale, void* out /*BF16 [T,H,512]*/, float* lse /*nullable*/,
                       cudaStream_t stream);

}  // namespace fp8rl::cuda
