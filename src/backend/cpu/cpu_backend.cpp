// CPU backend: tensor helpers, memory, element-wise ops, AdamW, quantize.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "backend/adamw_rule.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {

bool is_float_dtype(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::F64;
}

void check_cpu(const Tensor& t, const char* what) {
  FP8RL_CHECK(t.defined(), what, " is undefined (allocate it before calling the op)");
  FP8RL_CHECK(t.device() == DeviceKind::CPU, what, " must be on the CPU for the cpu backend, got ", t.str());
}

void check_float(const Tensor& t, const char* what) {
  check_cpu(t, what);
  FP8RL_CHECK(is_float_dtype(t.dtype()), what, " must be F32, BF16, F16 or F64, got ", t.str());
}

std::vector<double> load(const Tensor& t, const char* what) {
  check_float(t, what);
  const int64_t n = t.numel();
  std::vector<double> v(n);
  switch (t.dtype()) {
    case DType::F32: std::copy_n(t.data<float>(), n, v.data()); break;
    case DType::F64: std::copy_n(t.data<double>(), n, v.data()); break;
    case DType::BF16: {
      const uint16_t* p = t.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) v[i] = bf16_to_float(p[i]);
      break;
    }
    case DType::F16: {
      const uint16_t* p = t.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) v[i] = f16_to_float(p[i]);
      break;
    }
    default: break;
  }
  return v;
}

// BF16 and F16 are rounded from double through float (two roundings; the second is exact
// unless the double lies within 2^-29 relative of a BF16/F16 midpoint).
void store(const std::vector<double>& v, Tensor& t, const char* what) {
  check_float(t, what);
  const int64_t n = t.numel();
  FP8RL_CHECK(static_cast<int64_t>(v.size()) == n, what, ": ", v.size(), " values for ", t.str());
  switch (t.dtype()) {
    case DType::F32: {
      float* p = t.data<float>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(v[i]);
      break;
    }
    case DType::F64: std::copy_n(v.data(), n, t.data<double>()); break;
    case DType::BF16: {
      uint16_t* p = t.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = bf16_from_float(static_cast<float>(v[i]));
      break;
    }
    case DType::F16: {
      uint16_t* p = t.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = f16_from_float(static_cast<float>(v[i]));
      break;
    }
    default: break;
  }
}

void accumulate(const std::vector<double>& v, Tensor& t, const char* what) {
  check_float(t, what);
  FP8RL_CHECK(static_cast<int64_t>(v.size()) == t.numel(), what, ": cannot accumulate ", v.size(), " values into ",
              t.str());
  if (t.dtype() == DType::F32) {  // the common case (gradients), without a double copy of t
    float* p = t.data<float>();
    for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<float>(double(p[i]) + v[i]);
    return;
  }
  std::vector<double> cur = load(t, what);
  for (size_t i = 0; i < cur.size(); ++i) cur[i] += v[i];
  store(cur, t, what);
}

std::vector<int32_t> load_i32(const Tensor& t, const char* what) {
  check_cpu(t, what);
  check_dtype(t, DType::I32, what);
  return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
}

// ---- memory ------------------------------------------------------------------------------

void CpuBackend::copy_impl(const Tensor& src, Tensor& dst) {
  if (src.nbytes() && src.raw() != dst.raw()) std::memmove(dst.raw(), src.raw(), src.nbytes());
}

void CpuBackend::copy_cols_impl(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const int64_t cs = src.dim(src.ndim() - 1), cd = dst.dim(dst.ndim() - 1);
  const int64_t R = src.numel() / cs, es = static_cast<int64_t>(dtype_size(src.dtype()));
  const auto* s = static_cast<const uint8_t*>(src.raw());
  auto* d = static_cast<uint8_t*>(dst.raw());
  for (int64_t r = 0; r < R; ++r)
    std::memmove(d + (r * cd + dst_col) * es, s + (r * cs + src_col) * es, static_cast<size_t>(cols * es));
}

// Any float dtype to any other (load and store refuse the others).
void CpuBackend::convert_impl(const Tensor& src, Tensor& dst) {
  store(load(src, "convert source"), dst, "convert destination");
}

void CpuBackend::fill_impl(Tensor& t, float value) {
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::E4M3: std::memset(t.raw(), e4m3_from_float(value), n); break;
    case DType::I32:
      for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(value);
      break;
    case DType::I64:
      for (int64_t i = 0; i < n; ++i) t.data<int64_t>()[i] = static_cast<int64_t>(value);
      break;
    default: store(std::vector<double>(n, value), t, "fill target");
  }
}

// ---- element-wise and reductions ---------------------------------------------------------

void CpuBackend::add_impl(const Tensor& a, const Tensor& b, Tensor& out) {
  std::vector<double> va = load(a, "add operand a");
  const std::vector<double> vb = load(b, "add operand b");
  for (size_t i = 0; i < va.size(); ++i) va[i] += vb[i];
  store(va, out, "add output");
}

void CpuBackend::scale_impl(Tensor& x, float s) {
  std::vector<double> v = load(x, "scale operand");
  for (double& e : v) e *= s;
  store(v, x, "scale operand");
}

double CpuBackend::sum_squares_impl(const Tensor& x) {
  double acc = 0;
  for (double e : load(x, "sum_squares operand")) acc += e * e;
  return acc;
}

bool CpuBackend::all_finite_impl(const Tensor& x) {
  for (double e : load(x, "all_finite operand"))
    if (!std::isfinite(e)) return false;
  return true;
}

// ---- optimizer ---------------------------------------------------------------------------

// torch.optim.AdamW (single-tensor path): p *= 1 - lr*wd; m = lerp(m, g, 1 - b1);
// v = b2 v + (1 - b2) g^2; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
// F32 moments: in double, rounded once into each output. BF16 moments: adamw_rule.h (FP32).
void CpuBackend::adamw_impl(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  if (m.dtype() == DType::BF16) {
    const std::vector<double> g = load(grad, "adamw grad");  // exact: F32 and BF16 widen to double
    const AdamWScalars sc = adamw_scalars(p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale);
    float* w = param.data<float>();
    uint16_t *mm = m.data<uint16_t>(), *vv = v.data<uint16_t>();
    for (int64_t i = 0; i < param.numel(); ++i) {
      const uint32_t bits = p.stochastic_rounding ? adamw_rounding_bits(p.rounding_key, p.step, i) : 0;
      adamw_bf16_moments_step(w[i], static_cast<float>(g[i]), mm[i], vv[i], sc, p.stochastic_rounding, bits);
    }
    return;
  }
  std::vector<double> w = load(param, "adamw param"), mm = load(m, "adamw m"), vv = load(v, "adamw v");
  std::vector<double> g = load(grad, "adamw grad");
  if (p.grad_scale != 1.0f)
    for (double& e : g) e *= p.grad_scale;
  const double bc1 = 1 - std::pow(double(p.beta1), double(p.step));
  const double bc2_sqrt = std::sqrt(1 - std::pow(double(p.beta2), double(p.step)));
  const double step_size = double(p.lr) / bc1;
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] *= 1 - double(p.lr) * p.weight_decay;
    mm[i] += (1 - double(p.beta1)) * (g[i] - mm[i]);
    vv[i] = p.beta2 * vv[i] + (1 - double(p.beta2)) * g[i] * g[i];
    w[i] -= step_size * mm[i] / (std::sqrt(vv[i]) / bc2_sqrt + p.eps);
  }
  store(w, param, "adamw param");
  store(mm, m, "adamw m");
  store(vv, v, "adamw v");
}

// ---- quantization ------------------------------------------------------------------------

void CpuBackend::quantize_impl(const Tensor& x, bool transpose, QuantTensor& out, bool /*deferred: reports at once*/) {
  quantize_blocks_into(x, transpose, out, "tensor");
}

}  // namespace cpu

std::unique_ptr<Backend> make_cpu_backend() {
#if defined(__GLIBC__)
  // The ops allocate and free many same-sized buffers (MBs) per call. glibc would hand large
  // ones back to the kernel on free and page-fault them in again on the next call (a third
  // of the run time of a training step); keeping them in the heap makes reuse free.
  static const bool tuned = [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest allowed value on 64-bit
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
    return true;
  }();
  (void)tuned;
#endif
  return std::make_unique<cpu::CpuBackend>();
}

}  // namespace fp8rl
