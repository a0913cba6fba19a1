// CPU backend: embedding, RMSNorm, RoPE, SwiGLU (forward and backward).
#include <cmath>
#include <map>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {

// ---- embedding -------------------------------------------------------------------------------

void CpuBackend::embedding_impl(const Tensor& ids, const Tensor& table, Tensor& out) {
  const std::vector<int32_t> id = load_i32(ids, "embedding ids");
  const int64_t T = static_cast<int64_t>(id.size()), V = table.dim(0), D = table.dim(1);
  std::vector<double> o(T * D);
  for (int64_t t = 0; t < T; ++t) {
    FP8RL_CHECK(id[t] >= 0 && id[t] < V, "embedding: token id ", id[t], " at position ", t,
                " is outside the vocabulary [0, ", V, ")");
    const std::vector<double> row = load(table.select(id[t]), "embedding table row");
    std::copy(row.begin(), row.end(), o.begin() + t * D);
  }
  store(o, out, "embedding output");
}

void CpuBackend::embedding_backward_impl(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const std::vector<int32_t> id = load_i32(ids, "embedding ids");
  const int64_t T = static_cast<int64_t>(id.size()), V = dtable.dim(0), D = dtable.dim(1);
  const std::vector<double> g = load(dout, "embedding dout");
  for (int64_t t = 0; t < T; ++t)
    FP8RL_CHECK(id[t] >= 0 && id[t] < V, "embedding_backward: token id ", id[t], " at position ", t,
                " is outside the vocabulary [0, ", V, ")");
  if (dtable.dtype() == DType::F32 || dtable.dtype() == DType::F64) {  // row by row, in token order
    for (int64_t t = 0; t < T; ++t) {
      Tensor row = dtable.select(id[t]);
      accumulate(std::vector<double>(g.begin() + t * D, g.begin() + (t + 1) * D), row, "embedding dtable");
    }
    return;
  }
  // A 16-bit gradient: each row's contributions summed in double, then rounded into it once.
  std::map<int32_t, std::vector<double>> rows;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double>& r = rows[id[t]];
    r.resize(D, 0.0);
    for (int64_t j = 0; j < D; ++j) r[j] += g[t * D + j];
  }
  for (auto& [i, r] : rows) {
    Tensor row = dtable.select(i);
    accumulate(r, row, "embedding dtable");
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------------
// y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps), over the last dimension.
//
// With float (F32 / BF16) outputs this is Hugging Face's float32 op sequence, rounding step by
// rounding step: var = mean(x^2) as a float (the exact mean, summed in double, rounded once),
// r = 1 / sqrt(var + eps) in float (var + eps, sqrtf and the division each rounded), then
// y = w * (x * r) with both products rounded to float. This matters for FP8: an RMSNorm output
// feeds the q/k/v and gate/up quantizers directly, and on BF16-valued weights and embeddings
// x / s often lands exactly on an E4M3 rounding midpoint, so one ulp of difference in r or y
// flips codes; rounding the way a float32 PyTorch forward does keeps `fp8rl logprobs --precision
// fp8` on the same codes as an FP8 emulation built on transformers (docs/design.md, Numerics).
// With F64 activations (gradient checks) everything is double.

void CpuBackend::rmsnorm_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) {
  const int64_t D = w.dim(0), R = D ? x.numel() / D : 0;
  const std::vector<double> vx = load(x, "rmsnorm x"), vw = load(w, "rmsnorm weight");
  const bool f64 = out.dtype() == DType::F64;
  std::vector<double> y(R * D), r(R);
  for (int64_t i = 0; i < R; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += vx[i * D + j] * vx[i * D + j];
    if (f64) {
      r[i] = 1.0 / std::sqrt(ss / D + eps);
      for (int64_t j = 0; j < D; ++j) y[i * D + j] = vw[j] * (vx[i * D + j] * r[i]);
      continue;
    }
    const float var = static_cast<float>(ss / D);
    const float rf = 1.0f / std::sqrt(var + eps);
    r[i] = rf;
    for (int64_t j = 0; j < D; ++j) {
      const float xr = static_cast<float>(vx[i * D + j]) * rf;
      y[i * D + j] = static_cast<float>(vw[j]) * xr;
    }
  }
  store(y, out, "rmsnorm output");
  if (rstd) store(r, *rstd, "rmsnorm rstd");
}

// dx_j = r (w_j g_j) - r^3 / D * x_j * sum_k (w_k g_k x_k);  dw_j += sum_rows g_j x_j r.
void CpuBackend::rmsnorm_backward_impl(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       Tensor& dx, Tensor& dw) {
  const int64_t D = w.dim(0), R = D ? x.numel() / D : 0;
  const std::vector<double> g = load(dout, "rmsnorm dout"), vx = load(x, "rmsnorm x"), vw = load(w, "rmsnorm w"),
                            r = load(rstd, "rmsnorm rstd");
  std::vector<double> gx(R * D), gw(D, 0.0);
  for (int64_t i = 0; i < R; ++i) {
    double dot = 0;
    for (int64_t j = 0; j < D; ++j) dot += vw[j] * g[i * D + j] * vx[i * D + j];
    const double c = r[i] * r[i] * r[i] / D * dot;
    for (int64_t j = 0; j < D; ++j) {
      gx[i * D + j] = r[i] * vw[j] * g[i * D + j] - c * vx[i * D + j];
      gw[j] += g[i * D + j] * vx[i * D + j] * r[i];
    }
  }
  store(gx, dx, "rmsnorm dx");
  accumulate(gw, dw, "rmsnorm dw");
}

// ---- RoPE ------------------------------------------------------------------------------------
// HF rotate_half: for i < hd/2, with angle = float(pos) * inv_freq[i] (an FP32 product),
// c = float(cos(angle)) * attention_scaling and s likewise (FP32, as HF's cos/sin cache):
//   y[i] = x[i] c - x[i + hd/2] s,   y[i + hd/2] = x[i + hd/2] c + x[i] s.
// inverse=true uses -s: the transpose of the forward map, i.e. its backward (and its exact
// inverse when attention_scaling == 1).

void CpuBackend::rope_impl(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse) {
  const std::vector<int32_t> pos = load_i32(positions, "rope positions");
  const int64_t T = x.dim(0), H = x.dim(1), hd = x.dim(2), half = hd / 2;
  std::vector<double> v = load(x, "rope input");
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos[t]) * rope.inv_freq[i];
      const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * rope.attention_scaling;
      float s = static_cast<float>(std::sin(static_cast<double>(angle))) * rope.attention_scaling;
      if (inverse) s = -s;
      // Pair i: dims (i, i + half), or (2i, 2i + 1) interleaved.
      const int64_t ia = rope.interleaved ? 2 * i : i, ib = rope.interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < H; ++h) {
        double* row = v.data() + (t * H + h) * hd;
        const double a = row[ia], b = row[ib];
        row[ia] = a * c - b * s;
        row[ib] = b * c + a * s;
      }
    }
  }
  store(v, x, "rope output");
}

// ---- SwiGLU ----------------------------------------------------------------------------------
// out = silu(g) u, silu(g) = g sigmoid(g); silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))).

namespace {
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
}  // namespace

void CpuBackend::swiglu_impl(const Tensor& gate, const Tensor& up, Tensor& out) {
  const std::vector<double> g = load(gate, "swiglu gate"), u = load(up, "swiglu up");
  std::vector<double> y(g.size());
  for (size_t i = 0; i < g.size(); ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
  store(y, out, "swiglu output");
}

void CpuBackend::swiglu_backward_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                      Tensor& dup) {
  const std::vector<double> d = load(dout, "swiglu dout"), g = load(gate, "swiglu gate"), u = load(up, "swiglu up");
  std::vector<double> dg(g.size()), du(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    const double sg = sigmoid(g[i]);
    du[i] = d[i] * g[i] * sg;
    dg[i] = d[i] * u[i] * sg * (1 + g[i] * (1 - sg));
  }
  store(dg, dgate, "swiglu dgate");
  store(du, dup, "swiglu dup");
}

}  // namespace cpu
}  // namespace fp8rl
