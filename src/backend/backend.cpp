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

KvCache Backend::alloc_kv_cache(int num_layers, int num_pages, int page_size, int num_kv_heads,
                                int head_dim, DType dtype, int latent_v_dim) {
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

void Backend::linear_shared_input(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                  const LinearSpec& spec, const std::vector<Tensor*>& outs, const Fp8View* x_fp8) {
  FP8RL_CHECK(!W.empty() && W.size() == outs.size(), "linear_shared_input: ", W.size(), " weights for ", outs.size(),
              " outputs");
  for (size_t i = 0; i < W.size(); ++i) linear(x, *W[i], spec, *outs[i], x_fp8);
}

// ---- fused producers: the reference is the unfused sequence -----------------------------------

Fp8View Backend::alloc_fp8_view(int64_t rows, int64_t cols, bool pow2) {
  Fp8View v;
  v.q = alloc_quant(rows, cols, 1, kQuantBlock, pow2);
  return v;
}

void fp8_view_check(const Fp8View& view, const Tensor& x, const LinearSpec& spec, const char* what) {
  FP8RL_CHECK(view.defined(), what, ": the FP8 view of the input is undefined");
  const int64_t K = x.ndim() >= 1 ? x.dim(-1) : 0, M = K ? x.numel() / K : 0;
  FP8RL_CHECK(view.q.block_rows == 1 && view.q.block_cols == kQuantBlock && view.q.rows() == M && view.q.cols() == K,
              what, ": the FP8 view ", view.q.data.str(), " (blocks ", view.q.block_rows, "x", view.q.block_cols,
              ") is not a 1x128 quantization of the input ", x.str());
  FP8RL_CHECK(view.q.pow2 == spec.pow2_scales, what, ": the FP8 view has pow2=", view.q.pow2, " but the spec asks pow2=",
              spec.pow2_scales);
  FP8RL_CHECK(view.source == x.raw(), what, ": the FP8 view was made from another tensor than the input ", x.str(),
              " (a stale view: pass the view its producer wrote with this tensor)");
}

void kv_round_check(const Tensor& x, const std::vector<float>& head_scale) {
  FP8RL_CHECK(x.ndim() == 3 && x.dim(1) == static_cast<int64_t>(head_scale.size()), "kv_round: x must be [T, H, hd] ",
              "with one scale per head, got ", x.str(), " and ", head_scale.size(), " scales");
  for (float s : head_scale)
    FP8RL_CHECK(std::isfinite(s) && s > 0, "kv_round: scales must be finite and > 0, got ", s);
}

namespace {
// out [..., D] as the 2-D tensor the quantizer takes, checked against the view's shape.
Tensor fp8_view_target(const Tensor& out, const Fp8View& fp8, const char* op) {
  FP8RL_CHECK(out.ndim() >= 1 && out.dim(-1) > 0, op, ": out must have a last dimension, got ", out.str());
  const int64_t D = out.dim(-1), R = out.numel() / D;
  FP8RL_CHECK(fp8.defined() && fp8.q.rows() == R && fp8.q.cols() == D && fp8.q.block_rows == 1 &&
                  fp8.q.block_cols == kQuantBlock,
              op, ": the FP8 view must be alloc_fp8_view(", R, ", ", D, ", pow2), got ",
              fp8.defined() ? fp8.q.data.str() : std::string("an undefined view"));
  return out.reshape({R, D});
}
}  // namespace

void Backend::rmsnorm_fp8(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8) {
  const Tensor o2 = fp8_view_target(out, fp8, "rmsnorm_fp8");
  rmsnorm(x, w, eps, out, rstd);
  quantize(o2, false, fp8.q);
  fp8.scales_gemm_layout = false;
  fp8.source = out.raw();
}

void Backend::add_rmsnorm(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out,
                          Tensor* rstd, Fp8View* fp8) {
  const Tensor o2 = fp8 ? fp8_view_target(out, *fp8, "add_rmsnorm") : Tensor();
  add(a, b, sum);
  rmsnorm(sum, w, eps, out, rstd);
  if (fp8) {
    quantize(o2, false, fp8->q);
    fp8->scales_gemm_layout = false;
    fp8->source = out.raw();
  }
}

void Backend::swiglu_fp8(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8) {
  const Tensor o2 = fp8_view_target(out, fp8, "swiglu_fp8");
  swiglu(gate, up, out);
  quantize(o2, false, fp8.q);
  fp8.scales_gemm_layout = false;
  fp8.source = out.raw();
}

float Backend::amax(const Tensor& x) {
  const Tensor h = x.device() == DeviceKind::CPU ? x : to_host(x);
  float m = 0.0f;
  for (float v : to_float_vector(h)) {
    if (std::isnan(v)) return v;  // NaN propagates: the caller decides (quantizing it is an error)
    m = std::max(m, std::fabs(v));
  }
  return m;
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
  FP8RL_FAIL("this fp8rl was built without CUDA; rebuild with -DFP8RL_CUDA=ON on a machine with nvcc, "
             "or use --device cpu");
}
#endif

}  // namespace fp8rl
