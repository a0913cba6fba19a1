// The CPU reference backend: every op of backend/backend.h as naive, readable loops.
//
// Numerics (the reference the CUDA backend is compared against):
// - Every op reads its float inputs (F32, BF16, F16 or F64) as double, computes in double,
//   and rounds once into the output's dtype. F32 outputs are therefore FP32-rounded results
//   of (nearly) exact math; F64 outputs are plain double math (the FP64 gradient checks).
// - Roundings that are part of the numerics are applied explicitly where the spec puts them:
//   BF16 linear operands (bf16_round), FP8 linear operands (quant/quant.h, then dequantized
//   exactly in double: q * s has at most 28 significant bits), RoPE cos/sin in FP32 as HF,
//   KV-cache stores, the FP8-attention Q quantization.
// - Saved statistics (rmsnorm rstd, attention lse, token_logprobs lse) may be F32 or F64;
//   allocate them F64 for FP64 gradient checks.
#pragma once
#include <vector>

#include "backend/backend.h"

namespace fp8rl::cpu {

bool is_float_dtype(DType t);
// The values of a CPU float tensor (F32, BF16, F16, F64) as double; `what` names it in errors.
std::vector<double> load(const Tensor& t, const char* what);
// Writes v (rounded to t's dtype: F32, BF16, F16 or F64) into t; sizes must match.
void store(const std::vector<double>& v, Tensor& t, const char* what);
// t += v (in t's dtype, the sum computed in double then rounded once).
void accumulate(const std::vector<double>& v, Tensor& t, const char* what);
std::vector<int32_t> load_i32(const Tensor& t, const char* what);
void check_cpu(const Tensor& t, const char* what);
void check_float(const Tensor& t, const char* what);

// C[M, N] = A[M, K] B[N, K]^T in double (cpu_gemm.cpp: blocked, vectorized, threaded).
std::vector<double> matmul_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t N,
                              int64_t K);

// The effective operands of a linear layer under `mode` (values the GEMM multiplies), as
// double: FP32 as they are, BF16 rounded to BF16, FP8 quantized and dequantized exactly.
// x [M, K] quantized 1x128 along K.
std::vector<double> linear_operand_act(const Tensor& x, LinearMode mode, bool pow2);
// W [N, K] quantized 128x128 (W.wq when defined, else W.w).
std::vector<double> linear_operand_weight(const LinearWeight& W, LinearMode mode, bool pow2);
// Dequantized values of q in double (exact).
std::vector<double> dequantize_exact(const QuantTensor& q);

class CpuBackend final : public Backend {
 public:
  DeviceKind device() const override { return DeviceKind::CPU; }
  std::string name() const override { return "cpu"; }
  DType act_dtype() const override { return DType::F32; }

  // Every float dtype, everywhere: the reference computes in double and rounds once per output.
  bool takes_float(DType t, bool) const override { return is_float_dtype(t); }
  Tensor alloc(const Shape& shape, DType dtype) override { return Tensor::zeros(shape, dtype); }

 protected:
  // The ops of backend.h; each runs after its contract held (backend.cpp).
  void copy_impl(const Tensor& src, Tensor& dst) override;
  void copy_cols_impl(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) override;
  void convert_impl(const Tensor& src, Tensor& dst) override;
  void fill_impl(Tensor& t, float value) override;

  void add_impl(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale_impl(Tensor& x, float s) override;
  double sum_squares_impl(const Tensor& x) override;
  bool all_finite_impl(const Tensor& x) override;

  void embedding_impl(const Tensor& ids, const Tensor& table, Tensor& out) override;
  void embedding_backward_impl(const Tensor& ids, const Tensor& dout, Tensor& dtable) override;
  void rmsnorm_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) override;
  void rmsnorm_backward_impl(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dx,
                             Tensor& dw) override;
  void linear_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                   const Fp8View* x_fp8) override;
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
  void moe_permute_impl(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights,
                        Tensor& out) override;
  void moe_unpermute_impl(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) override;
  void moe_unpermute_backward_weights_impl(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                           Tensor& dweights) override;
  void adamw_impl(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) override;
  void quantize_impl(const Tensor& x, bool transpose, QuantTensor& out, bool deferred) override;
  void kv_write_impl(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) override;
  void kv_round_impl(Tensor& x, const std::vector<float>& head_scale) override;
  void attention_paged_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                            float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse) override;
  void sample_impl(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
                   const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens, Tensor& logp,
                   int64_t valid_vocab) override;
  void sample_rows_impl(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens, Tensor& logp,
                        int64_t valid_vocab) override;
};

}  // namespace fp8rl::cpu
