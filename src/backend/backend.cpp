#include "backend/backend.h"

#include <charconv>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace fp8rl {

Tensor Backend::to_device(const Tensor& host) {
  Tensor t = alloc(host.shape(), host.dtype());
  copy(host, t);
  return t;
}

Tensor Backend::to_host(const Tensor& dev) {
  Tensor t = Tensor::empty(dev.shape(), dev.dtype());
  copy(dev, t);
  return t;
}

QuantTensor Backend::alloc_quant(int64_t rows, int64_t cols, int block_rows, int block_cols, bool pow2) {
  QuantTensor q;
  q.block_rows = block_rows;
  q.block_cols = block_cols;
  q.pow2 = pow2;
  q.data = alloc({rows, cols}, DType::E4M3);
  q.scales = alloc({ceil_div(rows, block_rows), ceil_div(cols, block_cols)}, DType::F32);
  return q;
}

KvCache Backend::alloc_kv_cache(int num_layers, int num_pages, int page_size, int num_kv_heads, int head_dim,
                                DType dtype, int latent_v_dim) {
  FP8RL_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::E4M3,
              "KV cache dtype must be F32, BF16 or E4M3, got ", dtype_name(dtype));
  FP8RL_CHECK(latent_v_dim >= 0 && latent_v_dim <= head_dim, "a latent KV cache's V width (", latent_v_dim,
              ") must be in [0, head_dim = ", head_dim, "]");
  KvCache c;
  c.num_layers = num_layers;
  c.num_pages = num_pages;
  c.page_size = page_size;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.latent_v_dim = latent_v_dim;
  c.dtype = dtype;
  for (int l = 0; l < num_layers; ++l) {
    c.k.push_back(alloc({num_pages, page_size, num_kv_heads, head_dim}, dtype));
    if (latent_v_dim == 0) c.v.push_back(alloc({num_pages, page_size, num_kv_heads, head_dim}, dtype));
  }
  c.k_scale = alloc({num_layers, num_kv_heads}, DType::F32);
  c.v_scale = alloc({num_layers, num_kv_heads}, DType::F32);
  fill(c.k_scale, 1.0f);
  fill(c.v_scale, 1.0f);
  return c;
}

// ---- the contracts -----------------------------------------------------------------------------
// Every public op checks its arguments here, once, then calls the backend's _impl (backend.h).
// The messages name the op and the argument ("rmsnorm rstd must ..."), say what was expected and
// what was given; none of them depends on the backend except for the dtypes it takes.

namespace {

// The checks of one op on one backend.
class Contract {
 public:
  explicit Contract(const Backend& be) : be_(be) {}

  // Defined and on this backend's device.
  void on_device(const Tensor& t, const char* what) const {
    FP8RL_CHECK(t.defined(), what, " is undefined (allocate it before calling the op)");
    FP8RL_CHECK(t.device() == be_.device(), what, " must be on the ", device_name(be_.device()), " for the ",
                be_.name(), " backend, got ", t.str(), " (copy it with to_device / to_host first)");
  }
  // On the device, a float dtype the backend's kernels take; stat: a tensor the interface
  // calls F32 (statistics, logits, log-probs, routing weights).
  void floating(const Tensor& t, const char* what, bool stat = false) const {
    on_device(t, what);
    if (be_.takes_float(t.dtype(), stat)) return;
    std::string names;
    std::vector<DType> ok;
    for (DType d : {DType::F32, DType::BF16, DType::F16, DType::F64})
      if (be_.takes_float(d, stat)) ok.push_back(d);
    for (size_t i = 0; i < ok.size(); ++i)
      names += std::string(i == 0 ? "" : (i + 1 == ok.size() ? " or " : ", ")) + dtype_name(ok[i]);
    FP8RL_FAIL(what, " must be ", names, " on the ", be_.name(), " backend, got ", t.str());
  }
  void stat(const Tensor& t, const char* what) const { floating(t, what, true); }
  void i32(const Tensor& t, const char* what) const {
    on_device(t, what);
    check_dtype(t, DType::I32, what);
  }
  // A tensor of exactly `shape`.
  void floating(const Tensor& t, const Shape& shape, const char* what) const {
    floating(t, what);
    check_shape(t, shape, what);
  }
  void stat(const Tensor& t, const Shape& shape, const char* what) const {
    stat(t, what);
    check_shape(t, shape, what);
  }
  void i32(const Tensor& t, const Shape& shape, const char* what) const {
    i32(t, what);
    check_shape(t, shape, what);
  }

 private:
  const Backend& be_;
};

// A 128x128 E4M3 quantization of a weight (LinearWeight wq [N, K] or wqt [K, N]): on this
// device, its scale grid, the spec's pow2 when an FP8 op reads it.
void weight_quant_contract(const Contract& c, const QuantTensor& q, const LinearSpec& spec, const std::string& o,
                           const char* name, const char* layout) {
  const std::string what = o + " weight " + name;
  c.on_device(q.data, (what + " data").c_str());
  c.on_device(q.scales, (what + " scales").c_str());
  FP8RL_CHECK(q.block_rows == kQuantBlock && q.block_cols == kQuantBlock, what, " must have 128x128 blocks, got ",
              q.block_rows, "x", q.block_cols);
  check_dtype(q.data, DType::E4M3, (what + " data").c_str());
  FP8RL_CHECK(q.data.ndim() == 2, what, " must be ", layout, ", got ", q.data.str());
  check_dtype(q.scales, DType::F32, (what + " scales").c_str());
  check_shape(q.scales, {ceil_div(q.rows(), kQuantBlock), ceil_div(q.cols(), kQuantBlock)}, (what + " scales").c_str());
  if (spec.mode == LinearMode::FP8_BLOCK)
    FP8RL_CHECK(q.pow2 == spec.pow2_scales, what, " was quantized with pow2=", q.pow2,
                " but the spec asks pow2=", spec.pow2_scales, " (requantize the weight with the recipe's scales)");
}

// The linear weight (backend.h, LinearWeight): w [N, K] and/or wq (E4M3 [N, K], 128x128 blocks,
// quantized with the spec's pow2 when the FP8 forward or dgrad reads it), wqt (wq transposed,
// [K, N]; only with w or wq, which give the forward's weight), bias [N].
void weight_contract(const Contract& c, const LinearWeight& W, const LinearSpec& spec, const char* op) {
  const std::string o(op);
  FP8RL_CHECK(W.w.defined() || W.wq.defined(), o, ": the weight has neither w nor wq");
  if (W.w.defined()) {
    c.floating(W.w, (o + " weight w").c_str());
    FP8RL_CHECK(W.w.ndim() == 2, o, " weight w must be [N, K], got ", W.w.str());
  }
  if (W.wq.defined()) {
    weight_quant_contract(c, W.wq, spec, o, "wq", "[N, K]");
    if (W.w.defined())
      FP8RL_CHECK(W.wq.rows() == W.w.dim(0) && W.wq.cols() == W.w.dim(1), o, " weight wq ", W.wq.data.str(),
                  " does not match w ", W.w.str());
  }
  if (W.wqt.defined()) {
    weight_quant_contract(c, W.wqt, spec, o, "wqt", "[K, N]");
    FP8RL_CHECK(W.wqt.rows() == W.in_features() && W.wqt.cols() == W.out_features(), o, " weight wqt ",
                W.wqt.data.str(), " must be the transpose [", W.in_features(), ", ", W.out_features(),
                "] of the weight");
  }
  if (spec.mode != LinearMode::FP8_BLOCK)
    FP8RL_CHECK(W.w.defined(), "a ", linear_mode_name(spec.mode), " ", o, " needs the high-precision weight w");
  if (W.bias.defined()) {
    c.floating(W.bias, (o + " bias").c_str());
    check_shape(W.bias, {W.out_features()}, (o + " bias").c_str());
  }
}

// `view` can stand for the quantization of x [M, K] under `spec`: 1x128 blocks, shape [M, K],
// the spec's pow2, made from x (source == x.raw()).
void fp8_view_check(const Contract& c, const Fp8View& view, const Tensor& x, const LinearSpec& spec, const char* what) {
  FP8RL_CHECK(view.defined(), what, ": the FP8 view of the input is undefined");
  c.on_device(view.q.data, "the FP8 view's data");
  c.on_device(view.q.scales, "the FP8 view's scales");
  const int64_t K = x.ndim() >= 1 ? x.dim(-1) : 0, M = K ? x.numel() / K : 0;
  FP8RL_CHECK(view.q.block_rows == 1 && view.q.block_cols == kQuantBlock && view.q.rows() == M && view.q.cols() == K,
              what, ": the FP8 view ", view.q.data.str(), " (blocks ", view.q.block_rows, "x", view.q.block_cols,
              ") is not a 1x128 quantization of the input ", x.str());
  FP8RL_CHECK(view.q.pow2 == spec.pow2_scales, what, ": the FP8 view has pow2=", view.q.pow2,
              " but the spec asks pow2=", spec.pow2_scales);
  FP8RL_CHECK(view.source == x.raw(), what, ": the FP8 view was made from another tensor than the input ", x.str(),
              " (a stale view: pass the view its producer wrote with this tensor)");
}

// The view a fused producer fills for out [..., D]: alloc_fp8_view(rows, D, pow2) on this device.
void fp8_view_target(const Contract& c, const Tensor& out, const Fp8View& fp8, const char* op) {
  FP8RL_CHECK(out.ndim() >= 1 && out.dim(-1) > 0, op, ": out must have a last dimension, got ", out.str());
  const int64_t D = out.dim(-1), R = out.numel() / D;
  FP8RL_CHECK(fp8.defined() && fp8.q.rows() == R && fp8.q.cols() == D && fp8.q.block_rows == 1 &&
                  fp8.q.block_cols == kQuantBlock,
              op, ": the FP8 view must be alloc_fp8_view(", R, ", ", D, ", pow2), got ",
              fp8.defined() ? fp8.q.data.str() : std::string("an undefined view"));
  c.on_device(fp8.q.data, "the FP8 view's data");
  c.on_device(fp8.q.scales, "the FP8 view's scales");
  check_dtype(fp8.q.data, DType::E4M3, "the FP8 view's data");
  check_dtype(fp8.q.scales, DType::F32, "the FP8 view's scales");
  FP8RL_CHECK(fp8.q.scales.numel() == R * ceil_div(D, kQuantBlock), op, ": the FP8 view's scales ", fp8.q.scales.str(),
              " do not hold ", R, " x ", ceil_div(D, kQuantBlock), " values");
}

// The weight gradient's GEMM of an FP8 linear (LinearSpec::wgrad).
void wgrad_contract(const LinearSpec& spec) {
  FP8RL_CHECK(
      spec.mode != LinearMode::FP8_BLOCK || spec.wgrad == LinearMode::FP8_BLOCK || spec.wgrad == LinearMode::BF16,
      "an FP8 linear's wgrad must be fp8 or bf16, got ", linear_mode_name(spec.wgrad));
}

void seqlens_contract(const std::vector<int32_t>& cu, int64_t T, const char* op) {
  FP8RL_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == T, op, ": cu_seqlens must run from 0 to T = ", T,
              " (got ", cu.size(), " entries ending at ", cu.empty() ? -1 : cu.back(), ")");
  for (size_t b = 1; b < cu.size(); ++b)
    FP8RL_CHECK(cu[b] >= cu[b - 1], op, ": cu_seqlens must be non-decreasing, it decreases at entry ", b);
}

// q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hdv], Hq % Hkv == 0.
void attention_shapes(const Contract& c, const Tensor& q, const Tensor& k, const Tensor& v,
                      const std::vector<int32_t>& cu, const char* op) {
  const std::string o(op);
  c.floating(q, (o + " q").c_str());
  c.floating(k, (o + " k").c_str());
  c.floating(v, (o + " v").c_str());
  FP8RL_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, op, " needs q [T, Hq, hd], k/v [T, Hkv, hd], got ",
              q.str(), ", ", k.str(), ", ", v.str());
  const int64_t T = q.dim(0), hd = q.dim(2), Hkv = k.dim(1);
  FP8RL_CHECK(k.dim(0) == T && k.dim(2) == hd && v.dim(0) == T && v.dim(1) == Hkv && v.dim(2) > 0, op, ": k ", k.str(),
              " must be [", T, ", Hkv, ", hd, "] and v ", v.str(), " [", T, ", Hkv, hdv]");
  FP8RL_CHECK(Hkv > 0 && q.dim(1) % Hkv == 0, op, ": Hq = ", q.dim(1), " is not a multiple of Hkv = ", Hkv);
  seqlens_contract(cu, T, op);
}

void logprobs_shapes(const Contract& c, const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                     float temperature, const char* op) {
  c.floating(hidden, "token_logprobs hidden");
  c.floating(lm_head, "token_logprobs lm_head");
  FP8RL_CHECK(hidden.ndim() == 2 && lm_head.ndim() == 2 && hidden.dim(1) == lm_head.dim(1), op,
              " needs hidden [T, D] and lm_head [V, D], got ", hidden.str(), " and ", lm_head.str());
  c.i32(targets, {hidden.dim(0)}, "token_logprobs targets");
  FP8RL_CHECK(temperature > 0 && std::isfinite(temperature), op, ": temperature must be > 0, got ", temperature);
}

// logits [T, E] and experts I32 [T, k] with 1 <= k <= E.
void route_shapes(const Contract& c, const Tensor& logits, const Tensor& experts, int64_t k, const char* op) {
  c.stat(logits, (std::string(op) + " logits").c_str());
  FP8RL_CHECK(logits.ndim() == 2, op, ": logits must be [T, E], got ", logits.str());
  FP8RL_CHECK(k >= 1 && k <= logits.dim(1), op, ": top_k (", k, ") must be in [1, E = ", logits.dim(1), "]");
  c.i32(experts, {logits.dim(0), k}, "moe experts");
}

void route_backward_shapes(const Contract& c, const Tensor& logits, const Tensor& experts, const Tensor& dweights,
                           const Tensor& dlogits, const char* op) {
  FP8RL_CHECK(experts.ndim() == 2, op, ": experts must be [T, k], got ", experts.str());
  route_shapes(c, logits, experts, experts.dim(1), op);
  const std::string o(op);
  c.stat(dweights, {logits.dim(0), experts.dim(1)}, (o + " dweights").c_str());
  c.stat(dlogits, logits.shape(), (o + " dlogits").c_str());
}

// The KV cache's pools and scales of `layer`, on this device.
void cache_layer_contract(const Contract& c, const KvCache& cache, int layer, const char* op) {
  const bool latent = cache.latent_v_dim > 0;  // MLA: K pools only, V = the first latent_v_dim of K
  FP8RL_CHECK(layer >= 0 && layer < cache.num_layers && static_cast<int>(cache.k.size()) == cache.num_layers &&
                  static_cast<int>(cache.v.size()) == (latent ? 0 : cache.num_layers),
              op, ": KV cache layer ", layer, " out of range [0, ", cache.num_layers, ")");
  FP8RL_CHECK(cache.latent_v_dim <= cache.head_dim, op, ": KV cache latent_v_dim ", cache.latent_v_dim, " > head_dim ",
              cache.head_dim);
  const Shape pool = {cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim};
  std::vector<const Tensor*> pools = {&cache.k[layer]};
  if (!latent) pools.push_back(&cache.v[layer]);
  for (const Tensor* t : pools) {
    c.on_device(*t, "KV cache pool");
    check_shape(*t, pool, "KV cache pool");
    check_dtype(*t, cache.dtype, "KV cache pool");
  }
  for (const Tensor* t : {&cache.k_scale, &cache.v_scale}) {
    c.on_device(*t, "KV cache scales");
    check_shape(*t, {cache.num_layers, cache.num_kv_heads}, "KV cache scales");
    check_dtype(*t, DType::F32, "KV cache scales");
  }
}

// kv_write's contract (also linear_qkv_norm_rope's with a KV destination).
void kv_write_contract(const Contract& c, const KvCache& cache, int layer, const Tensor& k, const Tensor& v,
                       const PagedBatch& batch) {
  cache_layer_contract(c, cache, layer, "kv_write");
  c.i32(batch.slots, "paged batch slots");
  const int64_t T = batch.slots.numel();
  c.floating(k, {T, cache.num_kv_heads, cache.head_dim}, "kv_write k");
  if (cache.latent_v_dim > 0)
    FP8RL_CHECK(!v.defined(), "kv_write: a latent (MLA) cache stores k only; v must be undefined, got ", v.str());
  else c.floating(v, {T, cache.num_kv_heads, cache.head_dim}, "kv_write v");
}

// logits F32 [B, V] (V > 0), tokens I32 [B], logp F32 [B], valid_vocab in [0, V].
// bf16_logits: BF16 logits are taken as well (sample_rows: the lm_head's output as it is).
void sample_shapes(const Contract& c, const Tensor& logits, const Tensor& tokens, const Tensor& logp,
                   int64_t valid_vocab, bool bf16_logits = false) {
  if (bf16_logits && logits.dtype() == DType::BF16) c.floating(logits, "sample logits");
  else c.stat(logits, "sample logits");
  FP8RL_CHECK(logits.ndim() == 2 && logits.dim(1) > 0, "sample logits must be [B, V], got ", logits.str());
  const int64_t B = logits.dim(0), V = logits.dim(1);
  FP8RL_CHECK(valid_vocab >= 0 && valid_vocab <= V, "sample: valid_vocab ", valid_vocab, " must be in [0, V = ", V,
              "] (0: all V)");
  c.i32(tokens, {B}, "sample tokens");
  c.stat(logp, {B}, "sample logp");
}

}  // namespace

// ---- memory and element-wise ----

void Backend::copy(const Tensor& src, Tensor& dst) {
  for (const auto& [t, what] :
       {std::pair<const Tensor*, const char*>{&src, "copy source"}, {&dst, "copy destination"}}) {
    FP8RL_CHECK(t->defined(), what, " is undefined (allocate it before calling the op)");
    FP8RL_CHECK(t->device() == DeviceKind::CPU || t->device() == device(), what, " must be on the host or on the ",
                device_name(device()), " for the ", name(), " backend, got ", t->str());
  }
  FP8RL_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(),
              "copy needs the same dtype and size: ", src.str(), " -> ", dst.str(), " (use convert to change dtype)");
  copy_impl(src, dst);
}

void Backend::convert(const Tensor& src, Tensor& dst) {
  const Contract c(*this);
  c.on_device(src, "convert source");
  c.on_device(dst, "convert destination");
  FP8RL_CHECK(src.numel() == dst.numel(), "convert needs the same number of elements: ", src.str(), " -> ", dst.str());
  convert_impl(src, dst);
}

void Backend::convert_many(const std::vector<ConvertJob>& jobs) {
  const Contract c(*this);
  for (const ConvertJob& j : jobs) {
    FP8RL_CHECK(j.src && j.dst, "convert_many: a job without its source or destination");
    c.on_device(*j.src, "convert source");
    c.on_device(*j.dst, "convert destination");
    FP8RL_CHECK(j.src->numel() == j.dst->numel(), "convert needs the same number of elements: ", j.src->str(), " -> ",
                j.dst->str());
  }
  convert_many_impl(jobs);
}

void Backend::convert_many_impl(const std::vector<ConvertJob>& jobs) {
  for (const ConvertJob& j : jobs) convert_impl(*j.src, *j.dst);
}

void Backend::fill(Tensor& t, float value) {
  Contract(*this).on_device(t, "fill target");
  fill_impl(t, value);
}

void Backend::copy_cols(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const Contract c(*this);
  c.on_device(src, "copy_cols source");
  c.on_device(dst, "copy_cols destination");
  FP8RL_CHECK(src.dtype() == dst.dtype() && src.ndim() >= 1 && dst.ndim() >= 1,
              "copy_cols needs two tensors of one "
              "dtype: ",
              src.str(), " -> ", dst.str());
  const int64_t cs = src.dim(-1), cd = dst.dim(-1);
  FP8RL_CHECK(cs > 0 && cd > 0 && src.numel() / cs == dst.numel() / cd, "copy_cols: ", src.str(), " and ", dst.str(),
              " do not have the same number of rows");
  FP8RL_CHECK(cols >= 0 && src_col >= 0 && dst_col >= 0 && src_col + cols <= cs && dst_col + cols <= cd,
              "copy_cols: columns [", src_col, ", ", src_col + cols, ") of ", src.str(), " -> [", dst_col, ", ",
              dst_col + cols, ") of ", dst.str(), " out of range");
  copy_cols_impl(src, src_col, dst, dst_col, cols);
}

void Backend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  const Contract c(*this);
  c.on_device(a, "add operand a");
  c.on_device(b, "add operand b");
  c.on_device(out, "add output");
  FP8RL_CHECK(a.numel() == b.numel() && a.numel() == out.numel(), "add needs equal sizes: ", a.str(), " + ", b.str(),
              " -> ", out.str());
  add_impl(a, b, out);
}

void Backend::scale(Tensor& x, float s) {
  Contract(*this).on_device(x, "scale operand");
  scale_impl(x, s);
}

double Backend::sum_squares(const Tensor& x) {
  Contract(*this).on_device(x, "sum_squares operand");
  return sum_squares_impl(x);
}

double Backend::sum_squares_total(const std::vector<const Tensor*>& xs) {
  const Contract c(*this);
  for (const Tensor* x : xs) c.on_device(*x, "sum_squares operand");
  std::vector<double> each(xs.size(), 0.0);
  sum_squares_each_impl(xs, each);
  double total = 0.0;
  for (double v : each) total += v;
  return total;
}

void Backend::sum_squares_each_impl(const std::vector<const Tensor*>& xs, std::vector<double>& out) {
  for (size_t i = 0; i < xs.size(); ++i) out[i] = sum_squares_impl(*xs[i]);
}

bool Backend::all_finite(const Tensor& x) {
  Contract(*this).on_device(x, "all_finite operand");
  return all_finite_impl(x);
}

void Backend::amax(const Tensor& x, Tensor& acc, int64_t i) {
  const Contract c(*this);
  c.floating(x, "amax x");
  c.on_device(acc, "amax accumulator");
  FP8RL_CHECK(acc.dtype() == DType::F32 && acc.ndim() == 1, "the amax accumulator must be F32 [n], got ", acc.str());
  FP8RL_CHECK(i >= 0 && i < acc.numel(), "amax slot ", i, " outside the accumulator ", acc.str());
  amax_impl(x, acc, i);
}

void Backend::amax_impl(const Tensor& x, Tensor& acc, int64_t i) {
  const Tensor h = x.device() == DeviceKind::CPU ? x : to_host(x);
  Tensor a = acc.device() == DeviceKind::CPU ? acc : to_host(acc);
  float m = a.data<float>()[i];
  for (float v : to_float_vector(h)) {
    if (std::isnan(m)) break;  // NaN propagates: the caller decides (quantizing it is an error)
    m = std::isnan(v) ? std::fabs(v) : std::max(m, std::fabs(v));
  }
  a.data<float>()[i] = m;
  if (acc.device() != DeviceKind::CPU) copy(a, acc);
}

// ---- model ops ----

void Backend::embedding(const Tensor& ids, const Tensor& table, Tensor& out) {
  const Contract c(*this);
  c.i32(ids, "embedding ids");
  c.floating(table, "embedding table");
  FP8RL_CHECK(table.ndim() == 2, "embedding table must be [V, D], got ", table.str());
  c.floating(out, {ids.numel(), table.dim(1)}, "embedding output");
  embedding_impl(ids, table, out);
}

void Backend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const Contract c(*this);
  c.i32(ids, "embedding ids");
  c.floating(dtable, "embedding dtable");
  FP8RL_CHECK(dtable.ndim() == 2, "embedding dtable must be [V, D], got ", dtable.str());
  c.floating(dout, {ids.numel(), dtable.dim(1)}, "embedding dout");
  embedding_backward_impl(ids, dout, dtable);
}

namespace {
// rmsnorm(x, w, eps, out, rstd)'s shapes; returns rstd when it is asked for (defined), else null.
Tensor* rmsnorm_contract(const Contract& c, const Tensor& x, const Tensor& w, const Tensor& out, Tensor* rstd,
                         const char* op) {
  c.floating(x, "rmsnorm x");
  c.floating(w, "rmsnorm weight");
  FP8RL_CHECK(w.ndim() == 1 && x.ndim() >= 1 && x.dim(-1) == w.dim(0), op, ": x ", x.str(), " and weight ", w.str(),
              " disagree on the normalized dimension");
  c.floating(out, "rmsnorm output");
  FP8RL_CHECK(out.shape() == x.shape(), "rmsnorm output must have x's shape ", shape_str(x.shape()), ", got ",
              out.str());
  if (!rstd || !rstd->defined()) return nullptr;
  const int64_t D = w.dim(0), R = D ? x.numel() / D : 0;
  c.stat(*rstd, "rmsnorm rstd");
  FP8RL_CHECK(rstd->numel() == R, "rmsnorm rstd must have ", R, " elements, got ", rstd->str());
  return rstd;
}
}  // namespace

namespace {
// x [T, H, head_dim] rotated by RoPE at positions I32 [T] (rope, rmsnorm_rope).
void rope_contract(const Contract& c, const Tensor& x, const Tensor& positions, const RopeParams& rope,
                   const char* op) {
  c.floating(x, "rope input");
  FP8RL_CHECK(x.ndim() == 3, op, " input must be [T, H, head_dim], got ", x.str());
  const int64_t hd = x.dim(2);
  FP8RL_CHECK(hd % 2 == 0 && static_cast<int64_t>(rope.inv_freq.size()) == hd / 2, op, ": head_dim ", hd, " needs ",
              hd / 2, " inverse frequencies, got ", rope.inv_freq.size());
  c.i32(positions, "rope positions");
  FP8RL_CHECK(positions.numel() == x.dim(0), op, ": ", positions.numel(), " positions for ", x.dim(0), " tokens");
}
}  // namespace

void Backend::rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) {
  rmsnorm_impl(x, w, eps, out, rmsnorm_contract(Contract(*this), x, w, out, rstd, "rmsnorm"));
}

void Backend::rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dx,
                               Tensor& dw) {
  const Contract c(*this);
  c.floating(x, "rmsnorm x");
  c.floating(w, "rmsnorm weight");
  FP8RL_CHECK(w.ndim() == 1 && x.ndim() >= 1 && x.dim(-1) == w.dim(0), "rmsnorm_backward: x ", x.str(), " and weight ",
              w.str(), " disagree on the normalized dimension");
  const int64_t D = w.dim(0), R = D ? x.numel() / D : 0;
  c.floating(dout, "rmsnorm dout");
  c.floating(dx, "rmsnorm dx");
  FP8RL_CHECK(dout.shape() == x.shape() && dx.shape() == x.shape(), "rmsnorm_backward: dout ", dout.str(), " and dx ",
              dx.str(), " must have x's shape ", shape_str(x.shape()));
  c.stat(rstd, "rmsnorm rstd");
  FP8RL_CHECK(rstd.numel() == R, "rmsnorm rstd must have ", R, " elements, got ", rstd.str());
  c.floating(dw, {D}, "rmsnorm dw");
  rmsnorm_backward_impl(dout, x, w, rstd, dx, dw);
}

// ---- fused producers of FP8 linear inputs: the reference is the unfused sequence ----

Fp8View Backend::alloc_fp8_view(int64_t rows, int64_t cols, bool pow2) {
  Fp8View v;
  v.q = alloc_quant(rows, cols, 1, kQuantBlock, pow2);
  return v;
}

void Backend::rmsnorm_fp8(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8) {
  const Contract c(*this);
  Tensor* r = rmsnorm_contract(c, x, w, out, rstd, "rmsnorm_fp8");
  fp8_view_target(c, out, fp8, "rmsnorm_fp8");
  rmsnorm_fp8_impl(x, w, eps, out, r, fp8);
}

void Backend::rmsnorm_rope(const Tensor& x, const Tensor& w, float eps, const Tensor& positions, const RopeParams& rope,
                           Tensor& out, Tensor* rstd) {
  const Contract c(*this);
  FP8RL_CHECK(x.ndim() == 3 && out.ndim() == 3, "rmsnorm_rope: x and out must be [T, H, head_dim], got ", x.str(), ", ",
              out.str());
  Tensor* r = rmsnorm_contract(c, x, w, out, rstd, "rmsnorm_rope");
  FP8RL_CHECK(x.raw() != out.raw(), "rmsnorm_rope: out must not alias x");
  rope_contract(c, out, positions, rope, "rmsnorm_rope");
  rmsnorm_rope_impl(x, w, eps, positions, rope, out, r);
}

void Backend::add_rmsnorm(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out,
                          Tensor* rstd, Fp8View* fp8) {
  const Contract c(*this);
  c.floating(a, "add_rmsnorm a");
  c.floating(b, "add_rmsnorm b");
  c.floating(sum, "add_rmsnorm sum");
  FP8RL_CHECK(a.numel() == sum.numel() && b.numel() == sum.numel(),
              "add_rmsnorm: a, b and sum must have one size, got ", a.str(), ", ", b.str(), ", ", sum.str());
  Tensor* r = rmsnorm_contract(c, sum, w, out, rstd, "add_rmsnorm");
  if (fp8) fp8_view_target(c, out, *fp8, "add_rmsnorm");
  add_rmsnorm_impl(a, b, sum, w, eps, out, r, fp8);
}

namespace {
void swiglu_contract(const Contract& c, const Tensor& gate, const Tensor& up, const Tensor& out) {
  c.floating(gate, "swiglu gate");
  c.floating(up, "swiglu up");
  c.floating(out, "swiglu output");
  FP8RL_CHECK(gate.shape() == up.shape() && gate.shape() == out.shape(),
              "swiglu needs gate, up, out of one shape: ", gate.str(), ", ", up.str(), ", ", out.str());
}

void swiglu_backward_contract(const Contract& c, const Tensor& dout, const Tensor& gate, const Tensor& up,
                              const Tensor& dgate, const Tensor& dup, const char* op) {
  for (const auto& [t, what] : {std::pair<const Tensor*, const char*>{&dout, "swiglu dout"},
                                {&gate, "swiglu gate"},
                                {&up, "swiglu up"},
                                {&dgate, "swiglu dgate"},
                                {&dup, "swiglu dup"}})
    c.floating(*t, what);
  FP8RL_CHECK(gate.shape() == up.shape() && gate.shape() == dout.shape() && gate.shape() == dgate.shape() &&
                  gate.shape() == dup.shape(),
              op, " needs dout, gate, up, dgate, dup of one shape, got gate ", gate.str(), ", up ", up.str(), ", dout ",
              dout.str(), ", dgate ", dgate.str(), ", dup ", dup.str());
}
}  // namespace

void Backend::swiglu_fp8(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8) {
  const Contract c(*this);
  swiglu_contract(c, gate, up, out);
  fp8_view_target(c, out, fp8, "swiglu_fp8");
  swiglu_fp8_impl(gate, up, out, fp8);
}

void Backend::add_fp8(const Tensor& a, const Tensor& b, Tensor& out, Fp8View& fp8) {
  const Contract c(*this);
  c.floating(a, "add_fp8 a");
  c.floating(b, "add_fp8 b");
  c.floating(out, "add_fp8 out");
  FP8RL_CHECK(a.numel() == out.numel() && b.numel() == out.numel(), "add_fp8 needs equal sizes: ", a.str(), " + ",
              b.str(), " -> ", out.str());
  fp8_view_target(c, out, fp8, "add_fp8");
  add_fp8_impl(a, b, out, fp8);
}

void Backend::swiglu_backward_fp8(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup,
                                  Fp8View& dgate_fp8, Fp8View& dup_fp8) {
  const Contract c(*this);
  swiglu_backward_contract(c, dout, gate, up, dgate, dup, "swiglu_backward_fp8");
  fp8_view_target(c, dgate, dgate_fp8, "swiglu_backward_fp8 (dgate)");
  fp8_view_target(c, dup, dup_fp8, "swiglu_backward_fp8 (dup)");
  FP8RL_CHECK(dgate_fp8.q.data.raw() != dup_fp8.q.data.raw() && dgate_fp8.q.scales.raw() != dup_fp8.q.scales.raw(),
              "swiglu_backward_fp8: dgate and dup need two FP8 views, got one twice");
  swiglu_backward_fp8_impl(dout, gate, up, dgate, dup, dgate_fp8, dup_fp8);
}

void Backend::rmsnorm_fp8_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8) {
  const int64_t D = out.dim(-1);
  rmsnorm_impl(x, w, eps, out, rstd);
  quantize_impl(out.reshape({out.numel() / D, D}), false, fp8.q, false);
  fp8.scales_gemm_layout = false;
  fp8.source = out.raw();
}

void Backend::rmsnorm_rope_impl(const Tensor& x, const Tensor& w, float eps, const Tensor& positions,
                                const RopeParams& rope, Tensor& out, Tensor* rstd) {
  rmsnorm_impl(x, w, eps, out, rstd);
  rope_impl(out, positions, rope, /*inverse=*/false);
}

void Backend::add_rmsnorm_impl(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out,
                               Tensor* rstd, Fp8View* fp8) {
  add_impl(a, b, sum);
  rmsnorm_impl(sum, w, eps, out, rstd);
  if (fp8) {
    const int64_t D = out.dim(-1);
    quantize_impl(out.reshape({out.numel() / D, D}), false, fp8->q, false);
    fp8->scales_gemm_layout = false;
    fp8->source = out.raw();
  }
}

void Backend::swiglu_fp8_impl(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8) {
  const int64_t D = out.dim(-1);
  swiglu_impl(gate, up, out);
  quantize_impl(out.reshape({out.numel() / D, D}), false, fp8.q, false);
  fp8.scales_gemm_layout = false;
  fp8.source = out.raw();
}

void Backend::add_fp8_impl(const Tensor& a, const Tensor& b, Tensor& out, Fp8View& fp8) {
  const int64_t D = out.dim(-1);
  add_impl(a, b, out);
  quantize_impl(out.reshape({out.numel() / D, D}), false, fp8.q, false);
  fp8.scales_gemm_layout = false;
  fp8.source = out.raw();
}

void Backend::swiglu_backward_fp8_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                       Tensor& dup, Fp8View& dgate_fp8, Fp8View& dup_fp8) {
  const int64_t F = dgate.dim(-1);
  swiglu_backward_impl(dout, gate, up, dgate, dup);
  for (auto [d, v] : {std::pair<Tensor*, Fp8View*>{&dgate, &dgate_fp8}, {&dup, &dup_fp8}}) {
    quantize_impl(d->reshape({d->numel() / F, F}), false, v->q, false);
    v->scales_gemm_layout = false;
    v->source = d->raw();
  }
}

// ---- linear layers ----

namespace {
// linear(x, W, spec, out, x_fp8)'s contract: x [..., K], out [..., N] with x's rows.
void linear_contract(const Contract& c, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                     const Tensor& out, const Fp8View* x_fp8) {
  weight_contract(c, W, spec, "linear");
  const int64_t N = W.out_features(), K = W.in_features();
  c.floating(x, "linear input x");
  FP8RL_CHECK(x.ndim() >= 1 && x.dim(-1) == K, "linear input x must have last dimension ", K,
              " (the weight's in_features), got ", x.str());
  const int64_t M = K ? x.numel() / K : 0;
  c.floating(out, "linear output");
  FP8RL_CHECK(out.ndim() >= 1 && out.dim(-1) == N && out.numel() == M * N, "linear output must be [", M, ", ", N,
              "], got ", out.str());
  if (x_fp8 && spec.mode == LinearMode::FP8_BLOCK) fp8_view_check(c, *x_fp8, x, spec, "linear");
}
}  // namespace

void Backend::linear(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                     const Fp8View* x_fp8) {
  linear_contract(Contract(*this), x, W, spec, out, x_fp8);
  linear_impl(x, W, spec, out, spec.mode == LinearMode::FP8_BLOCK ? x_fp8 : nullptr);
}

void Backend::linear_shared_input(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                  const std::vector<Tensor*>& outs, const Fp8View* x_fp8) {
  FP8RL_CHECK(!W.empty() && W.size() == outs.size(), "linear_shared_input: ", W.size(), " weights for ", outs.size(),
              " outputs");
  const Contract c(*this);
  for (size_t i = 0; i < W.size(); ++i) {
    FP8RL_CHECK(W[i] && outs[i], "linear_shared_input: weight or output ", i, " is null");
    linear_contract(c, x, *W[i], spec, *outs[i], x_fp8);
  }
  linear_shared_input_impl(x, W, spec, outs, spec.mode == LinearMode::FP8_BLOCK ? x_fp8 : nullptr);
}

void Backend::linear_cols(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out, int64_t col0) {
  const Contract c(*this);
  weight_contract(c, W, spec, "linear_cols");
  const int64_t N = W.out_features(), K = W.in_features();
  c.floating(x, "linear_cols input x");
  FP8RL_CHECK(x.ndim() == 2 && x.dim(1) == K, "linear_cols input x must be [M, ", K,
              "] (the weight's in_features), got ", x.str());
  c.floating(out, "linear_cols output");
  FP8RL_CHECK(out.ndim() == 2 && out.dim(0) == x.dim(0) && col0 >= 0 && col0 + N <= out.dim(1),
              "linear_cols output must be [", x.dim(0), ", >= col0 + ", N, "] with col0 >= 0, got ", out.str(),
              " and col0 = ", col0);
  linear_cols_impl(x, W, spec, out, col0);
}

void Backend::linear_chunked(const Tensor& x, const Tensor& w, const LinearSpec& spec, int64_t chunk, Tensor& out) {
  const Contract c(*this);
  c.floating(x, "linear_chunked input x");
  c.floating(w, "linear_chunked weight");
  c.floating(out, "linear_chunked output");
  FP8RL_CHECK(x.ndim() == 2 && w.ndim() == 2 && x.dim(1) == w.dim(1) && out.ndim() == 2 && out.dim(0) == x.dim(0) &&
                  out.dim(1) == w.dim(0) && chunk >= 1,
              "linear_chunked needs x [M, K], w [V, K], out [M, V] and chunk >= 1, got ", x.str(), ", ", w.str(), ", ",
              out.str(), " and ", chunk);
  linear_chunked_impl(x, w, spec, chunk, out);
}

void Backend::linear_chunked_impl(const Tensor& x, const Tensor& w, const LinearSpec& spec, int64_t chunk,
                                  Tensor& out) {
  const int64_t V = w.dim(0);
  for (int64_t v0 = 0; v0 < V; v0 += chunk) {
    LinearWeight part;
    part.w = w.slice_rows(v0, std::min(V, v0 + chunk));
    linear_cols(x, part, spec, out, v0);
  }
}

void Backend::linear_cols_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                               int64_t col0) {
  Tensor tmp = alloc({x.dim(0), W.out_features()}, out.dtype());
  linear_impl(x, W, spec, tmp, nullptr);
  copy_cols(tmp, 0, out, col0, W.out_features());
}

void Backend::linear_shared_input_impl(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                       const LinearSpec& spec, const std::vector<Tensor*>& outs, const Fp8View* x_fp8) {
  for (size_t i = 0; i < W.size(); ++i) linear_impl(x, *W[i], spec, *outs[i], x_fp8);
}

void Backend::linear_swiglu(const Tensor& x, const LinearWeight& gate_w, const LinearWeight& up_w,
                            const LinearSpec& spec, Tensor& gate, Tensor& up, bool keep, Tensor& act, Fp8View* act_fp8,
                            const Fp8View* x_fp8) {
  const Contract c(*this);
  linear_contract(c, x, gate_w, spec, gate, x_fp8);
  linear_contract(c, x, up_w, spec, up, x_fp8);
  swiglu_contract(c, gate, up, act);
  if (act_fp8) fp8_view_target(c, act, *act_fp8, "linear_swiglu");
  linear_swiglu_impl(x, gate_w, up_w, spec, gate, up, keep, act, act_fp8,
                     spec.mode == LinearMode::FP8_BLOCK ? x_fp8 : nullptr);
}

void Backend::linear_swiglu_impl(const Tensor& x, const LinearWeight& gate_w, const LinearWeight& up_w,
                                 const LinearSpec& spec, Tensor& gate, Tensor& up, bool /*keep*/, Tensor& act,
                                 Fp8View* act_fp8, const Fp8View* x_fp8) {
  linear_shared_input_impl(x, {&gate_w, &up_w}, spec, {&gate, &up}, x_fp8);
  if (act_fp8) swiglu_fp8_impl(gate, up, act, *act_fp8);
  else swiglu_impl(gate, up, act);
}

void Backend::linear_qkv_norm_rope(const Tensor& x, const LinearWeight& Wq, const LinearWeight& Wk,
                                   const LinearWeight& Wv, const LinearSpec& spec, const Tensor& q_norm,
                                   const Tensor& k_norm, float eps, const Tensor& positions, const RopeParams& rope,
                                   bool keep, Tensor& q_raw, Tensor& k_raw, Tensor& q, Tensor& k, Tensor& v,
                                   Tensor* q_rstd, Tensor* k_rstd, const Fp8View* x_fp8, const KvDest* kv) {
  const Contract c(*this);
  linear_contract(c, x, Wq, spec, q_raw, x_fp8);
  linear_contract(c, x, Wk, spec, k_raw, x_fp8);
  linear_contract(c, x, Wv, spec, v, x_fp8);
  FP8RL_CHECK(q.ndim() == 3 && k.ndim() == 3 && k.dim(2) == q.dim(2) && v.numel() == k.numel(),
              "linear_qkv_norm_rope: q and k must be [T, H, head_dim] of one head_dim and v k's size, got ", q.str(),
              ", ", k.str(), ", ", v.str());
  const Tensor q3 = q_raw.reshape(q.shape()), k3 = k_raw.reshape(k.shape());
  Tensor* qr = rmsnorm_contract(c, q3, q_norm, q, q_rstd, "linear_qkv_norm_rope (q)");
  Tensor* kr = rmsnorm_contract(c, k3, k_norm, k, k_rstd, "linear_qkv_norm_rope (k)");
  FP8RL_CHECK(q.raw() != q_raw.raw() && k.raw() != k_raw.raw(),
              "linear_qkv_norm_rope: q and k must not alias q_raw and k_raw");
  rope_contract(c, q, positions, rope, "linear_qkv_norm_rope");
  rope_contract(c, k, positions, rope, "linear_qkv_norm_rope");
  if (kv) {
    FP8RL_CHECK(kv->cache && kv->batch, "linear_qkv_norm_rope: the KV destination needs a cache and a batch");
    kv_write_contract(c, *kv->cache, kv->layer, k, v.reshape(k.shape()), *kv->batch);
  }
  linear_qkv_norm_rope_impl(x, {&Wq, &Wk, &Wv}, spec, q_norm, k_norm, eps, positions, rope, keep, q_raw, k_raw, q, k, v,
                            qr, kr, spec.mode == LinearMode::FP8_BLOCK ? x_fp8 : nullptr, kv);
}

void Backend::linear_qkv_norm_rope_impl(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                        const LinearSpec& spec, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                        const Tensor& positions, const RopeParams& rope, bool /*keep*/, Tensor& q_raw,
                                        Tensor& k_raw, Tensor& q, Tensor& k, Tensor& v, Tensor* q_rstd, Tensor* k_rstd,
                                        const Fp8View* x_fp8, const KvDest* kv) {
  linear_shared_input_impl(x, W, spec, {&q_raw, &k_raw, &v}, x_fp8);
  rmsnorm_rope_impl(q_raw.reshape(q.shape()), q_norm, eps, positions, rope, q, q_rstd);
  rmsnorm_rope_impl(k_raw.reshape(k.shape()), k_norm, eps, positions, rope, k, k_rstd);
  if (kv) kv_write_impl(*kv->cache, kv->layer, k, v.reshape(k.shape()), *kv->batch);
}

namespace {
// grouped_linear's contract (shapes, dtypes, offsets, each weight's form).
void grouped_linear_contract(const Contract& c, const Tensor& x, const std::vector<int64_t>& offsets,
                             const std::vector<const LinearWeight*>& W, const LinearSpec& spec, const Tensor& out) {
  FP8RL_CHECK(!W.empty() && offsets.size() == W.size() + 1, "grouped_linear: ", W.size(), " weights need ",
              W.size() + 1, " row offsets, got ", offsets.size());
  c.floating(x, "grouped_linear x");
  c.floating(out, "grouped_linear out");
  FP8RL_CHECK(x.ndim() == 2 && out.ndim() == 2 && x.dim(0) == out.dim(0), "grouped_linear: x must be [R, K] and ",
              "out [R, N], got ", x.str(), " and ", out.str());
  const int64_t R = x.dim(0);
  FP8RL_CHECK(offsets.front() == 0 && offsets.back() == R, "grouped_linear: row offsets must run from 0 to ", R,
              ", got ", offsets.front(), " .. ", offsets.back());
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    FP8RL_CHECK(offsets[g + 1] >= offsets[g], "grouped_linear: row offsets must not decrease (group ", g, ")");
  for (size_t g = 0; g < W.size(); ++g) {
    FP8RL_CHECK(W[g], "grouped_linear: weight ", g, " is null");
    weight_contract(c, *W[g], spec, "grouped_linear");
    FP8RL_CHECK(W[g]->in_features() == x.dim(1) && W[g]->out_features() == out.dim(1), "grouped_linear: weight ", g,
                " is [", W[g]->out_features(), ", ", W[g]->in_features(), "], x ", x.str(), " and out ", out.str(),
                " need [", out.dim(1), ", ", x.dim(1), "]");
  }
}
}  // namespace

void Backend::grouped_linear(const Tensor& x, const std::vector<int64_t>& offsets,
                             const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor& out,
                             const Fp8View* x_fp8) {
  const Contract c(*this);
  grouped_linear_contract(c, x, offsets, W, spec, out);
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  if (x_fp8 && fp8) fp8_view_check(c, *x_fp8, x, spec, "grouped_linear");
  grouped_linear_impl(x, offsets, W, spec, out, fp8 ? x_fp8 : nullptr);
}

void Backend::grouped_linear_shared_input(const Tensor& x, const std::vector<int64_t>& offsets,
                                          const std::vector<std::vector<const LinearWeight*>>& W,
                                          const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                          const Fp8View* x_fp8) {
  FP8RL_CHECK(!W.empty() && W.size() == outs.size(), "grouped_linear_shared_input: ", W.size(), " weight sets for ",
              outs.size(), " outputs");
  const Contract c(*this);
  for (size_t i = 0; i < W.size(); ++i) {
    FP8RL_CHECK(outs[i], "grouped_linear_shared_input: output ", i, " is null");
    FP8RL_CHECK(W[i].size() == W[0].size(), "grouped_linear_shared_input: weight set ", i, " has ", W[i].size(),
                " groups, set 0 has ", W[0].size());
    grouped_linear_contract(c, x, offsets, W[i], spec, *outs[i]);
  }
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  if (x_fp8 && fp8) fp8_view_check(c, *x_fp8, x, spec, "grouped_linear_shared_input");
  grouped_linear_shared_input_impl(x, offsets, W, spec, outs, fp8 ? x_fp8 : nullptr);
}

void Backend::grouped_linear_planned(const Tensor& x, const MoeDevicePlan& plan,
                                     const std::vector<std::vector<const LinearWeight*>>& W, const LinearSpec& spec,
                                     const std::vector<Tensor*>& outs, const Fp8View* x_fp8) {
  FP8RL_CHECK(!W.empty() && W.size() == outs.size(), "grouped_linear_planned: ", W.size(), " weight sets for ",
              outs.size(), " outputs");
  const Contract c(*this);
  const int64_t G = static_cast<int64_t>(W[0].size());
  c.i32(plan.offsets, {G + 1}, "grouped_linear_planned offsets");
  FP8RL_CHECK(plan.block_m >= 1, "grouped_linear_planned: block_m must be >= 1, got ", plan.block_m);
  c.i32(plan.tiles, {moe_plan_max_tiles(x.dim(0), G, plan.block_m), 4}, "grouped_linear_planned tiles");
  c.i32(plan.tile_count, {1}, "grouped_linear_planned tile_count");
  // The shapes against offsets {0, .., R} (the rows themselves are the plan's).
  std::vector<int64_t> shape_offsets(static_cast<size_t>(G) + 1, x.dim(0));
  shape_offsets[0] = 0;
  for (size_t i = 0; i < W.size(); ++i) {
    FP8RL_CHECK(outs[i], "grouped_linear_planned: output ", i, " is null");
    FP8RL_CHECK(static_cast<int64_t>(W[i].size()) == G, "grouped_linear_planned: weight set ", i, " has ", W[i].size(),
                " groups, set 0 has ", G);
    grouped_linear_contract(c, x, shape_offsets, W[i], spec, *outs[i]);
  }
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  if (x_fp8 && fp8) fp8_view_check(c, *x_fp8, x, spec, "grouped_linear_planned");
  grouped_linear_planned_impl(x, plan, W, spec, outs, fp8 ? x_fp8 : nullptr);
}

void Backend::grouped_linear_planned_impl(const Tensor& x, const MoeDevicePlan& plan,
                                          const std::vector<std::vector<const LinearWeight*>>& W,
                                          const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                          const Fp8View* x_fp8) {
  const Tensor off = to_host(plan.offsets);
  const std::vector<int64_t> offsets(off.data<int32_t>(), off.data<int32_t>() + off.numel());
  FP8RL_CHECK(offsets.front() == 0 && offsets.back() == x.dim(0), "grouped_linear_planned: the plan covers rows [",
              offsets.front(), ", ", offsets.back(), "), not [0, ", x.dim(0), ")");
  if (W.size() == 1) grouped_linear_impl(x, offsets, W[0], spec, *outs[0], x_fp8);
  else grouped_linear_shared_input_impl(x, offsets, W, spec, outs, x_fp8);
}

void Backend::grouped_linear_shared_input_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                               const std::vector<std::vector<const LinearWeight*>>& W,
                                               const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                               const Fp8View* x_fp8) {
  for (size_t i = 0; i < W.size(); ++i) grouped_linear_impl(x, offsets, W[i], spec, *outs[i], x_fp8);
}

// Per group through linear_impl, which quantizes the group's rows itself: x_fp8 holds those bits
// (1x128 blocks never cross a row), so it is not needed here.
void Backend::grouped_linear_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                  const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor& out,
                                  const Fp8View* /*x_fp8*/) {
  for (size_t g = 0; g < W.size(); ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    const Tensor xg = x.slice_rows(offsets[g], offsets[g + 1]);
    Tensor og = out.slice_rows(offsets[g], offsets[g + 1]);
    linear_impl(xg, *W[g], spec, og, nullptr);
  }
}

void Backend::linear_backward(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                              Tensor* dx, Tensor* dw, Tensor* dbias, const Fp8View* dy_fp8) {
  const Contract c(*this);
  weight_contract(c, W, spec, "linear_backward");
  const int64_t N = W.out_features(), K = W.in_features();
  c.floating(x, "linear input x");
  FP8RL_CHECK(x.ndim() >= 1 && x.dim(-1) == K, "linear input x must have last dimension ", K, ", got ", x.str());
  c.floating(dy, "linear output gradient dy");
  FP8RL_CHECK(dy.ndim() >= 1 && dy.dim(-1) == N, "linear output gradient dy must have last dimension ", N, ", got ",
              dy.str());
  const int64_t M = K ? x.numel() / K : 0;
  FP8RL_CHECK(dy.numel() / std::max<int64_t>(N, 1) == M, "linear_backward: dy ", dy.str(), " and x ", x.str(),
              " differ in rows");
  if (dx) {
    c.floating(*dx, "linear dx");
    FP8RL_CHECK(dx->numel() == M * K && dx->dim(-1) == K, "linear dx must be [", M, ", ", K, "], got ", dx->str());
  }
  if (dw) {
    c.floating(*dw, {N, K}, "linear dw");
    wgrad_contract(spec);
  }
  if (dbias) c.floating(*dbias, {N}, "linear dbias");
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  if (dy_fp8 && fp8) fp8_view_check(c, *dy_fp8, dy, spec, "linear_backward (dy)");
  linear_backward_impl(dy, x, W, spec, dx, dw, dbias, fp8 ? dy_fp8 : nullptr);
}

void Backend::grouped_linear_backward(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                      const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor* dx,
                                      const std::vector<Tensor*>& dw, const Fp8View* dy_fp8) {
  FP8RL_CHECK(!W.empty() && offsets.size() == W.size() + 1, "grouped_linear_backward: ", W.size(), " weights need ",
              W.size() + 1, " row offsets, got ", offsets.size());
  FP8RL_CHECK(dw.empty() || dw.size() == W.size(), "grouped_linear_backward: ", dw.size(), " weight gradients for ",
              W.size(), " weights (give none or one per weight)");
  const Contract c(*this);
  c.floating(x, "grouped_linear_backward x");
  c.floating(dy, "grouped_linear_backward dy");
  FP8RL_CHECK(x.ndim() == 2 && dy.ndim() == 2 && x.dim(0) == dy.dim(0), "grouped_linear_backward: x must be [R, K] ",
              "and dy [R, N], got ", x.str(), " and ", dy.str());
  const int64_t R = x.dim(0), K = x.dim(1), N = dy.dim(1);
  FP8RL_CHECK(offsets.front() == 0 && offsets.back() == R, "grouped_linear_backward: row offsets must run from 0 to ",
              R, ", got ", offsets.front(), " .. ", offsets.back());
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    FP8RL_CHECK(offsets[g + 1] >= offsets[g], "grouped_linear_backward: row offsets must not decrease (group ", g, ")");
  for (size_t g = 0; g < W.size(); ++g) {
    FP8RL_CHECK(W[g], "grouped_linear_backward: weight ", g, " is null");
    weight_contract(c, *W[g], spec, "grouped_linear_backward");
    FP8RL_CHECK(!W[g]->bias.defined(), "grouped_linear_backward: weight ", g, " has a bias (not supported)");
    FP8RL_CHECK(W[g]->in_features() == K && W[g]->out_features() == N, "grouped_linear_backward: weight ", g, " is [",
                W[g]->out_features(), ", ", W[g]->in_features(), "], x ", x.str(), " and dy ", dy.str(), " need [", N,
                ", ", K, "]");
    if (!dw.empty() && dw[g]) c.floating(*dw[g], {N, K}, "grouped_linear_backward dw");
  }
  if (dx) c.floating(*dx, {R, K}, "grouped_linear_backward dx");
  if (!dw.empty()) wgrad_contract(spec);
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  if (dy_fp8 && fp8) fp8_view_check(c, *dy_fp8, dy, spec, "grouped_linear_backward (dy)");
  grouped_linear_backward_impl(dy, x, offsets, W, spec, dx, dw, fp8 ? dy_fp8 : nullptr);
}

// Per group through linear_backward_impl (dy_fp8 not needed: as grouped_linear_impl's x_fp8).
void Backend::grouped_linear_backward_impl(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                           const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                           Tensor* dx, const std::vector<Tensor*>& dw, const Fp8View* /*dy_fp8*/) {
  for (size_t g = 0; g < W.size(); ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    Tensor* dwg = dw.empty() ? nullptr : dw[g];
    if (!dx && !dwg) continue;
    const Tensor dyg = dy.slice_rows(offsets[g], offsets[g + 1]), xg = x.slice_rows(offsets[g], offsets[g + 1]);
    Tensor dxg = dx ? dx->slice_rows(offsets[g], offsets[g + 1]) : Tensor{};
    linear_backward_impl(dyg, xg, *W[g], spec, dx ? &dxg : nullptr, dwg, nullptr, nullptr);
  }
}

void Backend::rope(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse) {
  rope_contract(Contract(*this), x, positions, rope, "rope");
  rope_impl(x, positions, rope, inverse);
}

void Backend::attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu_seqlens,
                        float softmax_scale, Tensor& out, Tensor& lse) {
  const Contract c(*this);
  attention_shapes(c, q, k, v, cu_seqlens, "attention");
  const int64_t T = q.dim(0), Hq = q.dim(1);
  c.floating(out, {T, Hq, v.dim(2)}, "attention output");
  c.stat(lse, {Hq, T}, "attention lse");
  attention_impl(q, k, v, cu_seqlens, softmax_scale, out, lse);
}

void Backend::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& out, const Tensor& lse, const std::vector<int32_t>& cu_seqlens,
                                 float softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const Contract c(*this);
  attention_shapes(c, q, k, v, cu_seqlens, "attention_backward");
  const int64_t T = q.dim(0), Hq = q.dim(1);
  c.floating(dout, {T, Hq, v.dim(2)}, "attention dout");
  c.floating(out, {T, Hq, v.dim(2)}, "attention out");
  c.stat(lse, {Hq, T}, "attention lse");
  c.floating(dq, q.shape(), "attention dq");
  c.floating(dk, k.shape(), "attention dk");
  c.floating(dv, v.shape(), "attention dv");
  attention_backward_impl(dout, q, k, v, out, lse, cu_seqlens, softmax_scale, dq, dk, dv);
}

void Backend::swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  swiglu_contract(Contract(*this), gate, up, out);
  swiglu_impl(gate, up, out);
}

void Backend::swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup) {
  swiglu_backward_contract(Contract(*this), dout, gate, up, dgate, dup, "swiglu_backward");
  swiglu_backward_impl(dout, gate, up, dgate, dup);
}

void Backend::token_logprobs(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, float temperature,
                             const LinearSpec& spec, Tensor& logp, Tensor& lse, Tensor* entropy) {
  const Contract c(*this);
  logprobs_shapes(c, hidden, lm_head, targets, temperature, "token_logprobs");
  const int64_t T = hidden.dim(0);
  c.stat(logp, {T}, "token_logprobs logp");
  c.stat(lse, {T}, "token_logprobs lse");
  if (entropy) c.stat(*entropy, {T}, "token_logprobs entropy");
  token_logprobs_impl(hidden, lm_head, targets, temperature, spec, logp, lse, entropy);
}

void Backend::token_logprobs_backward(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                      float temperature, const LinearSpec& spec, const Tensor& lse, const Tensor& dlogp,
                                      Tensor& dhidden, Tensor* dlm_head) {
  const Contract c(*this);
  logprobs_shapes(c, hidden, lm_head, targets, temperature, "token_logprobs_backward");
  const int64_t T = hidden.dim(0);
  c.stat(lse, {T}, "token_logprobs lse");
  c.stat(dlogp, {T}, "token_logprobs dlogp");
  c.floating(dhidden, hidden.shape(), "token_logprobs dhidden");
  if (dlm_head) {
    c.floating(*dlm_head, lm_head.shape(), "token_logprobs dlm_head");
    wgrad_contract(spec);
  }
  token_logprobs_backward_impl(hidden, lm_head, targets, temperature, spec, lse, dlogp, dhidden, dlm_head);
}

void Backend::logprobs_of_logits(const Tensor& logits, const Tensor& targets, float temperature, Tensor& logp,
                                 Tensor& lse) {
  const Contract c(*this);
  c.stat(logits, "logprobs_of_logits logits");
  FP8RL_CHECK(logits.ndim() == 2 && logits.dim(1) > 0, "logprobs_of_logits logits must be [R, V], got ", logits.str());
  const int64_t R = logits.dim(0);
  c.i32(targets, {R}, "logprobs_of_logits targets");
  FP8RL_CHECK(temperature > 0 && std::isfinite(temperature), "logprobs_of_logits: temperature must be > 0, got ",
              temperature);
  c.stat(logp, {R}, "logprobs_of_logits logp");
  c.stat(lse, {R}, "logprobs_of_logits lse");
  logprobs_of_logits_impl(logits, targets, temperature, logp, lse);
}

// ---- mixture of experts ----

void Backend::moe_route_softmax(const Tensor& logits, int top_k, bool renormalize, Tensor& experts, Tensor& weights) {
  const Contract c(*this);
  route_shapes(c, logits, experts, top_k, "moe_route_softmax");
  c.stat(weights, {logits.dim(0), top_k}, "moe_route_softmax weights");
  moe_route_softmax_impl(logits, top_k, renormalize, experts, weights);
}

void Backend::moe_route_softmax_backward(const Tensor& logits, const Tensor& experts, bool renormalize,
                                         const Tensor& dweights, Tensor& dlogits) {
  route_backward_shapes(Contract(*this), logits, experts, dweights, dlogits, "moe_route_softmax_backward");
  moe_route_softmax_backward_impl(logits, experts, renormalize, dweights, dlogits);
}

void Backend::moe_route_sigmoid(const Tensor& logits, const Tensor* bias, int top_k, int n_group, int topk_group,
                                bool renormalize, float scaling, Tensor& experts, Tensor& weights) {
  const Contract c(*this);
  route_shapes(c, logits, experts, top_k, "moe_route_sigmoid");
  c.stat(weights, {logits.dim(0), top_k}, "moe_route_sigmoid weights");
  const int64_t E = logits.dim(1);
  FP8RL_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "moe_route_sigmoid: n_group (", n_group, ") must divide E (", E, ") and 1 <= topk_group (", topk_group,
              ") <= n_group");
  FP8RL_CHECK(top_k <= topk_group * (E / n_group), "moe_route_sigmoid: top_k (", top_k,
              ") exceeds the experts of the kept groups (", topk_group * (E / n_group), ")");
  if (bias) c.stat(*bias, {E}, "moe_route_sigmoid bias");
  moe_route_sigmoid_impl(logits, bias, top_k, n_group, topk_group, renormalize, scaling, experts, weights);
}

void Backend::moe_route_sigmoid_backward(const Tensor& logits, const Tensor& experts, bool renormalize, float scaling,
                                         const Tensor& dweights, Tensor& dlogits) {
  route_backward_shapes(Contract(*this), logits, experts, dweights, dlogits, "moe_route_sigmoid_backward");
  moe_route_sigmoid_backward_impl(logits, experts, renormalize, scaling, dweights, dlogits);
}

void Backend::moe_route_softmax_weights(const Tensor& logits, const Tensor& experts, bool renormalize,
                                        Tensor& weights) {
  const Contract c(*this);
  FP8RL_CHECK(experts.ndim() == 2, "moe_route_softmax_weights: experts must be [T, k], got ", experts.str());
  route_shapes(c, logits, experts, experts.dim(1), "moe_route_softmax_weights");
  c.stat(weights, experts.shape(), "moe_route_softmax_weights weights");
  moe_route_softmax_weights_impl(logits, experts, renormalize, weights);
}

void Backend::moe_route_sigmoid_weights(const Tensor& logits, const Tensor& experts, bool renormalize, float scaling,
                                        Tensor& weights) {
  const Contract c(*this);
  FP8RL_CHECK(experts.ndim() == 2, "moe_route_sigmoid_weights: experts must be [T, k], got ", experts.str());
  route_shapes(c, logits, experts, experts.dim(1), "moe_route_sigmoid_weights");
  c.stat(weights, experts.shape(), "moe_route_sigmoid_weights weights");
  moe_route_sigmoid_weights_impl(logits, experts, renormalize, scaling, weights);
}

void Backend::moe_permute(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights, Tensor& out) {
  const Contract c(*this);
  c.floating(x, "moe_permute x");
  FP8RL_CHECK(x.ndim() == 2 && top_k >= 1, "moe_permute: x must be [T, D] and top_k >= 1, got ", x.str(), ", ", top_k);
  c.i32(row_slot, "moe_permute row_slot");
  c.floating(out, {row_slot.numel(), x.dim(1)}, "moe_permute out");
  if (weights) c.stat(*weights, {x.dim(0) * top_k}, "moe_permute weights");
  moe_permute_impl(x, row_slot, top_k, weights, out);
}

void Backend::moe_permute_fp8(const Tensor& x, const Fp8View* xq, const Tensor& row_slot, int top_k,
                              const Tensor* weights, Tensor& out, Fp8View& outq) {
  const Contract c(*this);
  c.floating(x, "moe_permute_fp8 x");
  FP8RL_CHECK(x.ndim() == 2 && top_k >= 1, "moe_permute_fp8: x must be [T, D] and top_k >= 1, got ", x.str(), ", ",
              top_k);
  c.i32(row_slot, "moe_permute_fp8 row_slot");
  c.floating(out, {row_slot.numel(), x.dim(1)}, "moe_permute_fp8 out");
  if (weights) c.stat(*weights, {x.dim(0) * top_k}, "moe_permute_fp8 weights");
  fp8_view_target(c, out, outq, "moe_permute_fp8");
  if (xq) {
    FP8RL_CHECK(!weights, "moe_permute_fp8: x's FP8 copy stands for the rows only without weights");
    const LinearSpec pow2{LinearMode::FP8_BLOCK, outq.q.pow2};
    fp8_view_check(c, *xq, x, pow2, "moe_permute_fp8 (x's FP8 copy)");
  }
  moe_permute_fp8_impl(x, xq, row_slot, top_k, weights, out, outq);
}

// The definition: the gather, then its quantization (xq, x's quantization, holds the same bits
// row by row; the CUDA backend gathers them instead, or quantizes in the gather's pass).
void Backend::moe_permute_fp8_impl(const Tensor& x, const Fp8View* /*xq*/, const Tensor& row_slot, int top_k,
                                   const Tensor* weights, Tensor& out, Fp8View& outq) {
  moe_permute_impl(x, row_slot, top_k, weights, out);
  quantize_impl(out, false, outq.q, false);
  outq.scales_gemm_layout = false;
  outq.source = out.raw();
}

void Backend::mla_absorb(const Tensor& x, int64_t x_col0, const Tensor& w, int64_t nope, int64_t dv, bool values,
                         Tensor& out, int64_t out_col0) {
  const Contract c(*this);
  c.floating(x, "mla_absorb x");
  c.floating(w, "mla_absorb w (kv_b_proj)");
  c.floating(out, "mla_absorb out");
  FP8RL_CHECK(x.ndim() == 3 && out.ndim() == 3 && w.ndim() == 2 && x.dim(0) == out.dim(0) && x.dim(1) == out.dim(1),
              "mla_absorb: x [T, H, *], out [T, H, *] and w [H (nope + dv), kvr] expected, got ", x.str(), ", ",
              out.str(), ", ", w.str());
  const int64_t H = x.dim(1), kvr = w.dim(1), in = values ? kvr : nope, n = values ? dv : kvr;
  FP8RL_CHECK(nope > 0 && dv > 0 && w.dim(0) == H * (nope + dv), "mla_absorb: w must be [", H, " x (", nope, " + ", dv,
              "), kvr], got ", w.str());
  FP8RL_CHECK(x_col0 >= 0 && x_col0 + in <= x.dim(2) && out_col0 >= 0 && out_col0 + n <= out.dim(2),
              "mla_absorb: columns [", x_col0, ", ", x_col0 + in, ") of x ", x.str(), " into [", out_col0, ", ",
              out_col0 + n, ") of out ", out.str(), " do not fit");
  mla_absorb_impl(x, x_col0, w, nope, dv, values, out, out_col0);
}

void Backend::mla_absorb_impl(const Tensor& x, int64_t x_col0, const Tensor& w, int64_t nope, int64_t dv, bool values,
                              Tensor& out, int64_t out_col0) {
  const LinearSpec fp32{LinearMode::FP32, false};
  const int64_t T = x.dim(0), H = x.dim(1), kvr = w.dim(1), rows = nope + dv;
  const Tensor x2 = x.reshape({T, H * x.dim(2)});
  Tensor o2 = out.reshape({T, H * out.dim(2)});
  Tensor xin = alloc({T, values ? kvr : nope}, x.dtype()), res = alloc({T, values ? dv : kvr}, out.dtype());
  for (int64_t h = 0; h < H; ++h) {
    copy_cols(x2, h * x.dim(2) + x_col0, xin, 0, xin.dim(1));
    LinearWeight wh;
    if (values) {  // res = xin W_v^T
      wh.w = w.slice_rows(h * rows + nope, (h + 1) * rows);
      linear(xin, wh, fp32, res);
    } else {  // res = xin W_k: the input gradient of x -> x W_k^T for the output gradient xin
      wh.w = w.slice_rows(h * rows, h * rows + nope);
      linear_backward(xin, res, wh, fp32, &res, nullptr, nullptr);
    }
    copy_cols(res, 0, o2, h * out.dim(2) + out_col0, res.dim(1));
  }
}

void Backend::moe_unpermute(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) {
  const Contract c(*this);
  c.floating(y, "moe_unpermute y");
  c.floating(out, "moe_unpermute out");
  FP8RL_CHECK(y.ndim() == 2 && out.ndim() == 2 && out.dim(1) == y.dim(1) && out.dim(0) > 0,
              "moe_unpermute: y [R, D] and out [T, D] expected, got ", y.str(), ", ", out.str());
  c.i32(slot_row, "moe_unpermute slot_row");
  const int64_t T = out.dim(0), S = slot_row.numel();
  FP8RL_CHECK(S > 0 && S % T == 0, "moe_unpermute: slot_row has ", S, " entries, not a multiple of T = ", T);
  if (weights) c.stat(*weights, {S}, "moe_unpermute weights");
  moe_unpermute_impl(y, slot_row, weights, out);
}

MoeSlotSort moe_sort_slots(const int32_t* ex, int64_t R, int64_t E) {
  MoeSlotSort p;
  p.offsets.assign(static_cast<size_t>(E) + 1, 0);
  for (int64_t s = 0; s < R; ++s) {
    FP8RL_CHECK(ex[s] >= 0 && ex[s] < E, "moe routing produced expert ", ex[s], " outside [0, ", E, ")");
    ++p.offsets[static_cast<size_t>(ex[s]) + 1];
  }
  for (int64_t e = 0; e < E; ++e) p.offsets[e + 1] += p.offsets[e];
  p.row_slot.resize(static_cast<size_t>(R));
  p.slot_row.resize(static_cast<size_t>(R));
  std::vector<int64_t> next(p.offsets.begin(), p.offsets.end() - 1);
  for (int64_t s = 0; s < R; ++s) {
    const int64_t r = next[ex[s]]++;
    p.row_slot[r] = static_cast<int32_t>(s);
    p.slot_row[s] = static_cast<int32_t>(r);
  }
  return p;
}

std::vector<int32_t> moe_tiles(const std::vector<int64_t>& offsets, int block_m) {
  FP8RL_CHECK(block_m >= 1, "moe_tiles: block_m must be >= 1, got ", block_m);
  std::vector<int32_t> t;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += block_m)
      t.insert(t.end(), {static_cast<int32_t>(e), static_cast<int32_t>(r), static_cast<int32_t>(offsets[e + 1]), 0});
  return t;
}

// Each expert's tiles: ceil(rows / block_m) <= rows / block_m + 1 for the experts with rows.
int64_t moe_plan_max_tiles(int64_t slots, int64_t num_experts, int block_m) {
  return (slots + block_m - 1) / block_m + std::min(slots, num_experts);
}

void Backend::moe_plan(const Tensor& experts, int64_t num_experts, int block_m, Tensor& offsets, Tensor& row_slot,
                       Tensor& slot_row, Tensor& tiles, Tensor& tile_count) {
  const Contract c(*this);
  c.i32(experts, "moe_plan experts");
  FP8RL_CHECK(experts.ndim() == 2 && experts.dim(1) >= 1, "moe_plan: experts must be [T, k], got ", experts.str());
  FP8RL_CHECK(num_experts >= 1 && num_experts <= kMoePlanMaxExperts && block_m >= 1,
              "moe_plan: num_experts must be in [1, ", kMoePlanMaxExperts, "] and block_m >= 1, got ", num_experts,
              " and ", block_m);
  const int64_t R = experts.numel();
  FP8RL_CHECK(R < (int64_t{1} << 31), "moe_plan: ", R, " slots are more than its I32 rows index");
  c.i32(offsets, {num_experts + 1}, "moe_plan offsets");
  c.i32(row_slot, {R}, "moe_plan row_slot");
  c.i32(slot_row, {R}, "moe_plan slot_row");
  c.i32(tiles, {moe_plan_max_tiles(R, num_experts, block_m), 4}, "moe_plan tiles");
  c.i32(tile_count, {1}, "moe_plan tile_count");
  moe_plan_impl(experts, num_experts, block_m, offsets, row_slot, slot_row, tiles, tile_count);
}

void Backend::moe_plan_impl(const Tensor& experts, int64_t num_experts, int block_m, Tensor& offsets, Tensor& row_slot,
                            Tensor& slot_row, Tensor& tiles, Tensor& tile_count) {
  const Tensor ex = to_host(experts);
  const MoeSlotSort p = moe_sort_slots(ex.data<int32_t>(), ex.numel(), num_experts);
  const std::vector<int32_t> t = moe_tiles(p.offsets, block_m);
  auto upload = [&](const int32_t* v, int64_t n, Tensor& dst) {
    Tensor h = Tensor::empty({n}, DType::I32);
    std::copy_n(v, n, h.data<int32_t>());
    Tensor d = dst.reshape({n});
    copy(h, d);
  };
  std::vector<int32_t> off(p.offsets.begin(), p.offsets.end());
  upload(off.data(), static_cast<int64_t>(off.size()), offsets);
  upload(p.row_slot.data(), static_cast<int64_t>(p.row_slot.size()), row_slot);
  upload(p.slot_row.data(), static_cast<int64_t>(p.slot_row.size()), slot_row);
  std::vector<int32_t> all(static_cast<size_t>(tiles.numel()), 0);  // past the count: empty tiles
  std::copy(t.begin(), t.end(), all.begin());
  upload(all.data(), static_cast<int64_t>(all.size()), tiles);
  const int32_t n = static_cast<int32_t>(t.size() / 4);
  upload(&n, 1, tile_count);
}

void Backend::moe_unpermute_backward_weights(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                             Tensor& dweights) {
  const Contract c(*this);
  c.floating(dout, "moe_unpermute_backward_weights dout");
  c.floating(y, "moe_unpermute_backward_weights y");
  FP8RL_CHECK(y.ndim() == 2 && dout.ndim() == 2 && dout.dim(1) == y.dim(1) && dout.dim(0) > 0,
              "moe_unpermute_backward_weights: dout [T, D] and y [R, D] expected, got ", dout.str(), ", ", y.str());
  c.i32(slot_row, "moe_unpermute_backward_weights slot_row");
  const int64_t T = dout.dim(0), S = slot_row.numel();
  FP8RL_CHECK(S > 0 && S % T == 0, "moe_unpermute_backward_weights: slot_row has ", S,
              " entries, not a multiple of T = ", T);
  c.stat(dweights, {S}, "moe_unpermute_backward_weights dweights");
  moe_unpermute_backward_weights_impl(dout, y, slot_row, dweights);
}

// ---- optimizer and quantization ----

namespace {

void adamw_contract(const Contract& c, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                    const AdamWParams& p) {
  c.stat(param, "adamw param");
  c.floating(grad, "adamw grad");
  c.floating(m, "adamw m");
  c.floating(v, "adamw v");
  FP8RL_CHECK(param.shape() == grad.shape() && param.shape() == m.shape() && param.shape() == v.shape(),
              "adamw needs param, grad, m, v of one shape: ", param.str(), ", ", grad.str(), ", ", m.str(), ", ",
              v.str());
  FP8RL_CHECK(p.step >= 1, "adamw step is 1-based, got ", p.step);
  FP8RL_CHECK(m.dtype() == v.dtype(), "adamw: m and v must have one dtype, got ", m.str(), " and ", v.str());
  if (m.dtype() == DType::BF16) {  // adamw_rule.h: FP32 math on the F32 master
    FP8RL_CHECK(param.dtype() == DType::F32, "adamw with BF16 moments needs the F32 master, got ", param.str());
    FP8RL_CHECK(grad.dtype() == DType::F32 || grad.dtype() == DType::BF16, "adamw grad must be F32 or BF16, got ",
                grad.str());
  }
}

}  // namespace

void Backend::adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  adamw_contract(Contract(*this), param, grad, m, v, p);
  adamw_impl(param, grad, m, v, p);
}

void Backend::adamw_many(const std::vector<AdamWJob>& jobs) {
  const Contract c(*this);
  for (const AdamWJob& j : jobs) {
    FP8RL_CHECK(j.param && j.grad && j.m && j.v, "adamw_many: a job without its param, grad, m or v");
    adamw_contract(c, *j.param, *j.grad, *j.m, *j.v, j.p);
  }
  adamw_many_impl(jobs);
}

void Backend::adamw_many_impl(const std::vector<AdamWJob>& jobs) {
  for (const AdamWJob& j : jobs) adamw_impl(*j.param, *j.grad, *j.m, *j.v, j.p);
}

namespace {

void quantize_contract(const Contract& c, const Tensor& x, bool transpose, const QuantTensor& out) {
  c.floating(x, "quantize input");
  FP8RL_CHECK(x.ndim() == 2, "quantize: the input must be 2-D [rows, cols], got ", x.str());
  const int64_t R = transpose ? x.dim(1) : x.dim(0), C = transpose ? x.dim(0) : x.dim(1);
  FP8RL_CHECK(out.block_rows > 0 && out.block_cols > 0, "quantize: bad block shape ", out.block_rows, "x",
              out.block_cols);
  c.on_device(out.data, "quantized data");
  c.on_device(out.scales, "quantization scales");
  check_dtype(out.data, DType::E4M3, "quantized data");
  check_shape(out.data, {R, C}, "quantized data");
  check_dtype(out.scales, DType::F32, "quantization scales");
  check_shape(out.scales, {ceil_div(R, out.block_rows), ceil_div(C, out.block_cols)}, "quantization scales");
}

}  // namespace

void Backend::quantize(const Tensor& x, bool transpose, QuantTensor& out, bool deferred) {
  quantize_contract(Contract(*this), x, transpose, out);
  quantize_impl(x, transpose, out, deferred);
}

void Backend::quantize_weights(const std::vector<WeightQuantJob>& jobs) {
  const Contract c(*this);
  for (const WeightQuantJob& j : jobs) {
    FP8RL_CHECK(j.w && j.q, "quantize_weights: a job without its weight or its quantized copy");
    for (const QuantTensor* q : {j.q, j.qt}) {
      if (!q) continue;
      FP8RL_CHECK(q->block_rows == kQuantBlock && q->block_cols == kQuantBlock,
                  "quantize_weights: weight copies use 128x128 blocks, got ", q->block_rows, "x", q->block_cols);
      quantize_contract(c, *j.w, q == j.qt, *q);
    }
  }
  quantize_weights_impl(jobs);
}

void Backend::quantize_weights_impl(const std::vector<WeightQuantJob>& jobs) {
  for (const WeightQuantJob& j : jobs) {
    quantize_impl(*j.w, false, *j.q, true);
    if (j.qt) quantize_impl(*j.w, true, *j.qt, true);
  }
}

// ---- generation ----

void Backend::kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) {
  kv_write_contract(Contract(*this), cache, layer, k, v, batch);
  kv_write_impl(cache, layer, k, v, batch);
}

void Backend::kv_round(Tensor& x, const std::vector<float>& head_scale) {
  Contract(*this).floating(x, "kv_round x");
  FP8RL_CHECK(x.ndim() == 3 && x.dim(1) == static_cast<int64_t>(head_scale.size()), "kv_round: x must be [T, H, hd] ",
              "with one scale per head, got ", x.str(), " and ", head_scale.size(), " scales");
  for (float s : head_scale) FP8RL_CHECK(std::isfinite(s) && s > 0, "kv_round: scales must be finite and > 0, got ", s);
  kv_round_impl(x, head_scale);
}

void Backend::attention_paged(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                              float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse, Fp8View* out_fp8) {
  const Contract c(*this);
  cache_layer_contract(c, cache, layer, "attention_paged");
  c.floating(q, "attention_paged q");
  FP8RL_CHECK(
      q.ndim() == 3 && q.dim(2) == cache.head_dim && cache.num_kv_heads > 0 && q.dim(1) % cache.num_kv_heads == 0,
      "attention_paged q must be [T, Hq, ", cache.head_dim, "] with Hq a multiple of ", cache.num_kv_heads, ", got ",
      q.str());
  const int64_t T = q.dim(0);
  c.i32(batch.token_seq, "paged batch token_seq");
  c.i32(batch.token_pos, "paged batch token_pos");
  FP8RL_CHECK(batch.token_seq.numel() == T && batch.token_pos.numel() == T, "attention_paged: token_seq and token_pos ",
              "need ", T, " entries, got ", batch.token_seq.str(), " and ", batch.token_pos.str());
  c.i32(batch.page_table, "paged batch page_table");
  FP8RL_CHECK(batch.page_table.ndim() == 2, "page_table must be [B, max_pages], got ", batch.page_table.str());
  if (batch.query_runs.defined()) {
    c.i32(batch.query_runs, "paged batch query_runs");
    FP8RL_CHECK(batch.query_runs.ndim() == 2 && batch.query_runs.dim(1) == 2 && batch.query_run_tokens >= 1,
                "paged batch query_runs must be [R, 2] runs of at most query_run_tokens >= 1 tokens, got ",
                batch.query_runs.str(), " and ", batch.query_run_tokens);
  }
  c.floating(out, {T, q.dim(1), cache.v_dim()}, "attention_paged output");
  if (lse) c.stat(*lse, {q.dim(1), T}, "attention_paged lse");
  if (!out_fp8) {
    attention_paged_impl(cache, layer, q, batch, softmax_scale, fp8_attention, out, lse);
    return;
  }
  FP8RL_CHECK(!lse, "attention_paged: the output's FP8 copy is not taken with the lse");
  fp8_view_target(c, out.reshape({T, q.dim(1) * cache.v_dim()}), *out_fp8, "attention_paged");
  attention_paged_fp8_impl(cache, layer, q, batch, softmax_scale, fp8_attention, out, *out_fp8);
}

void Backend::attention_paged_fp8_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                       float softmax_scale, bool fp8_attention, Tensor& out, Fp8View& fp8) {
  attention_paged_impl(cache, layer, q, batch, softmax_scale, fp8_attention, out, nullptr);
  quantize_impl(out.reshape({out.dim(0), out.numel() / out.dim(0)}), false, fp8.q, false);
  fp8.scales_gemm_layout = false;
  fp8.source = out.raw();
}

void Backend::sample(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
                     const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens, Tensor& logp,
                     int64_t valid_vocab) {
  sample_shapes(Contract(*this), logits, tokens, logp, valid_vocab);
  const int64_t B = logits.dim(0);
  const auto n = static_cast<size_t>(B);
  FP8RL_CHECK(temperature.size() == n && top_p.size() == n && top_k.size() == n && uniforms.size() == n,
              "sample needs one temperature, top_p, top_k and uniform per row (", B, " rows), got ", temperature.size(),
              ", ", top_p.size(), ", ", top_k.size(), ", ", uniforms.size());
  for (size_t b = 0; b < n; ++b) {
    FP8RL_CHECK(std::isfinite(temperature[b]) && temperature[b] >= 0, "sample: temperature of row ", b,
                " must be >= 0, got ", temperature[b]);
    FP8RL_CHECK(top_p[b] > 0 && top_p[b] <= 1, "sample: top_p of row ", b, " must be in (0, 1], got ", top_p[b]);
    FP8RL_CHECK(top_k[b] >= 0, "sample: top_k of row ", b, " must be >= 0, got ", top_k[b]);
    FP8RL_CHECK(uniforms[b] >= 0 && uniforms[b] < 1, "sample: uniform of row ", b, " must be in [0, 1), got ",
                uniforms[b]);
  }
  sample_impl(logits, temperature, top_p, top_k, uniforms, tokens, logp, valid_vocab);
}

void Backend::sample_rows(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens, Tensor& logp,
                          int64_t valid_vocab) {
  const Contract c(*this);
  sample_shapes(c, logits, tokens, logp, valid_vocab, /*bf16_logits=*/true);
  c.i32(rows, {logits.dim(0), 8}, "sample_rows rows (one SampleRow each)");
  sample_rows_impl(logits, rows, truncation, tokens, logp, valid_vocab);
}

std::unique_ptr<Backend> make_backend(const std::string& device, DType act_dtype) {
  if (device == "cpu") return make_cpu_backend();
  if (device.rfind("cuda", 0) == 0) {
    int index = 0;
    if (device.size() > 5 && device[4] == ':') {
      const char* e = device.data() + device.size();
      const auto [p, ec] = std::from_chars(device.data() + 5, e, index);
      if (ec != std::errc() || p != e || index < 0)
        FP8RL_FAIL("unknown device '", device, "' (expected cpu, cuda or cuda:N with N a GPU index)");
    } else {
      FP8RL_CHECK(device == "cuda", "unknown device '", device, "' (expected cpu, cuda or cuda:N)");
    }
    return make_cuda_backend(index, act_dtype);
  }
  FP8RL_FAIL("unknown device '", device, "' (expected cpu, cuda or cuda:N)");
}

std::unique_ptr<Backend> make_backend(const std::string& device) { return make_backend(device, DType::BF16); }

#ifndef FP8RL_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(int index) { return make_cuda_backend(index, DType::BF16); }
std::unique_ptr<Backend> make_cuda_backend(int, DType) {
  FP8RL_FAIL(
      "this fp8rl was built without CUDA; rebuild with -DFP8RL_CUDA=ON on a machine with nvcc, "
      "or use --device cpu");
}
#endif

}  // namespace fp8rl
