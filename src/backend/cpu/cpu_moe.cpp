// CPU backend: mixture-of-experts routing, permute and un-permute (backend.h, "mixture of experts").
#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {

namespace {

// Row-wise softmax of logits [T, E] in double.
std::vector<double> softmax_rows(const std::vector<double>& z, int64_t T, int64_t E) {
  std::vector<double> p(z.size());
  for (int64_t t = 0; t < T; ++t) {
    const double* zr = z.data() + t * E;
    const double m = *std::max_element(zr, zr + E);
    double s = 0.0;
    for (int64_t e = 0; e < E; ++e) s += (p[t * E + e] = std::exp(zr[e] - m));
    for (int64_t e = 0; e < E; ++e) p[t * E + e] /= s;
  }
  return p;
}

// The routing weights of token t's k experts ex[0..k) from its probabilities (softmax) or
// scores (sigmoid) sc[E]: the one formula of the routing ops and of the replay ops (bitwise equal
// weights for the same experts). Sums in slot order.
void softmax_weights_of(const double* sc, const int32_t* ex, int64_t k, bool renormalize, double* w) {
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += sc[ex[j]];
  for (int64_t j = 0; j < k; ++j) w[j] = renormalize ? sc[ex[j]] / sum : sc[ex[j]];
}
void sigmoid_weights_of(const double* sc, const int32_t* ex, int64_t k, bool renormalize, float scaling, double* w) {
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += sc[ex[j]];
  for (int64_t j = 0; j < k; ++j) w[j] = (renormalize ? sc[ex[j]] / (sum + 1e-20) : sc[ex[j]]) * scaling;
}
double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// Given experts I32 [T, k] (routing replay), each checked against [0, E).
std::vector<int32_t> load_given_experts(const Tensor& experts, int64_t E, const char* op) {
  std::vector<int32_t> ex = load_i32(experts, "moe experts");
  for (size_t i = 0; i < ex.size(); ++i)
    FP8RL_CHECK(ex[i] >= 0 && ex[i] < E, op, ": experts[", i, "] = ", ex[i], " is outside [0, ", E, ")");
  return ex;
}

}  // namespace

void CpuBackend::moe_route_softmax_impl(const Tensor& logits, int top_k, bool renormalize, Tensor& experts,
                                        Tensor& weights) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = top_k;
  const std::vector<double> p = softmax_rows(load(logits, "moe logits"), T, E);
  std::vector<double> w(T * k);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const double* pr = p.data() + t * E;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return pr[a] > pr[b]; });
    int32_t* ex = experts.data<int32_t>() + t * k;
    for (int64_t j = 0; j < k; ++j) ex[j] = static_cast<int32_t>(order[j]);
    softmax_weights_of(pr, ex, k, renormalize, w.data() + t * k);
  }
  store(w, weights, "moe_route_softmax weights");
}

void CpuBackend::moe_route_softmax_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                Tensor& weights) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  const std::vector<double> p = softmax_rows(load(logits, "moe logits"), T, E);
  const std::vector<int32_t> ex = load_given_experts(experts, E, "moe_route_softmax_weights");
  std::vector<double> w(T * k);
  for (int64_t t = 0; t < T; ++t)
    softmax_weights_of(p.data() + t * E, ex.data() + t * k, k, renormalize, w.data() + t * k);
  store(w, weights, "moe_route_softmax_weights weights");
}

// With s_j = p[e_j] and w = s (or s / S, S = sum s):  ds_j = dw_j (or (dw_j - sum_i dw_i w_i) / S);
// then dz_e = p_e (g_e - sum_j ds_j s_j), g_e = ds_j for e = e_j, else 0.
void CpuBackend::moe_route_softmax_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                 const Tensor& dweights, Tensor& dlogits) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  const std::vector<double> p = softmax_rows(load(logits, "moe logits"), T, E);
  const std::vector<double> dw = load(dweights, "moe dweights");
  const std::vector<int32_t> ex = load_i32(experts, "moe experts");
  std::vector<double> dz(T * E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* pr = p.data() + t * E;
    std::vector<double> s(k), ds(k);
    double S = 0.0;
    for (int64_t j = 0; j < k; ++j) S += (s[j] = pr[ex[t * k + j]]);
    double dot = 0.0;  // sum_i dw_i w_i
    for (int64_t j = 0; j < k; ++j) dot += dw[t * k + j] * s[j] / S;
    double c = 0.0;  // sum_j ds_j s_j
    for (int64_t j = 0; j < k; ++j) {
      ds[j] = renormalize ? (dw[t * k + j] - dot) / S : dw[t * k + j];
      c += ds[j] * s[j];
    }
    for (int64_t e = 0; e < E; ++e) dz[t * E + e] = -pr[e] * c;
    for (int64_t j = 0; j < k; ++j) dz[t * E + ex[t * k + j]] += pr[ex[t * k + j]] * ds[j];
  }
  store(dz, dlogits, "moe_route_softmax_backward dlogits");
}

void CpuBackend::moe_route_sigmoid_impl(const Tensor& logits, const Tensor* bias, int top_k, int n_group,
                                        int topk_group, bool renormalize, float scaling, Tensor& experts,
                                        Tensor& weights) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = top_k, G = E / n_group;
  std::vector<double> b(E, 0.0);
  if (bias) b = load(*bias, "moe_route_sigmoid bias");
  const std::vector<double> z = load(logits, "moe logits");
  std::vector<double> w(T * k), s(E), c(E), gs(n_group);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      s[e] = sigmoid(z[t * E + e]);
      c[e] = s[e] + b[e];
    }
    for (int g = 0; g < n_group; ++g) {
      double m1 = -INFINITY, m2 = -INFINITY;
      for (int64_t e = g * G; e < (g + 1) * G; ++e) {
        if (c[e] > m1) m2 = m1, m1 = c[e];
        else if (c[e] > m2) m2 = c[e];
      }
      gs[g] = G == 1 ? m1 : m1 + m2;
    }
    std::vector<int64_t> gorder(n_group);
    std::iota(gorder.begin(), gorder.end(), 0);
    std::stable_sort(gorder.begin(), gorder.end(), [&](int64_t a, int64_t bb) { return gs[a] > gs[bb]; });
    std::vector<bool> kept(n_group, false);
    for (int j = 0; j < topk_group; ++j) kept[gorder[j]] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!kept[e / G]) c[e] = 0.0;
    std::vector<int64_t> eorder(E);
    std::iota(eorder.begin(), eorder.end(), 0);
    std::stable_sort(eorder.begin(), eorder.end(), [&](int64_t a, int64_t bb) { return c[a] > c[bb]; });
    int32_t* ex = experts.data<int32_t>() + t * k;
    for (int64_t j = 0; j < k; ++j) ex[j] = static_cast<int32_t>(eorder[j]);
    sigmoid_weights_of(s.data(), ex, k, renormalize, scaling, w.data() + t * k);
  }
  store(w, weights, "moe_route_sigmoid weights");
}

void CpuBackend::moe_route_sigmoid_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                float scaling, Tensor& weights) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  const std::vector<double> z = load(logits, "moe logits");
  const std::vector<int32_t> ex = load_given_experts(experts, E, "moe_route_sigmoid_weights");
  std::vector<double> w(T * k), s(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) s[e] = sigmoid(z[t * E + e]);
    sigmoid_weights_of(s.data(), ex.data() + t * k, k, renormalize, scaling, w.data() + t * k);
  }
  store(w, weights, "moe_route_sigmoid_weights weights");
}

// w_j = a s_j / S' (S' = sum s + 1e-20) or a s_j:  ds_i = (a / S') (dw_i - sum_j dw_j s_j / S')
// or a dw_i;  dz_i = ds_i s_i (1 - s_i).
void CpuBackend::moe_route_sigmoid_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                 float scaling, const Tensor& dweights, Tensor& dlogits) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  const std::vector<double> z = load(logits, "moe logits"), dw = load(dweights, "moe dweights");
  const std::vector<int32_t> ex = load_i32(experts, "moe experts");
  std::vector<double> dz(T * E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(k);
    double S = 1e-20, dot = 0.0;
    for (int64_t j = 0; j < k; ++j) S += (s[j] = 1.0 / (1.0 + std::exp(-z[t * E + ex[t * k + j]])));
    for (int64_t j = 0; j < k; ++j) dot += dw[t * k + j] * s[j];
    for (int64_t j = 0; j < k; ++j) {
      const double ds = renormalize ? scaling / S * (dw[t * k + j] - dot / S) : scaling * dw[t * k + j];
      dz[t * E + ex[t * k + j]] += ds * s[j] * (1.0 - s[j]);
    }
  }
  store(dz, dlogits, "moe_route_sigmoid_backward dlogits");
}

void CpuBackend::moe_permute_impl(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights,
                                  Tensor& out) {
  const int64_t T = x.dim(0), D = x.dim(1), S = T * top_k;
  const std::vector<int32_t> rs = load_i32(row_slot, "moe_permute row_slot");
  const int64_t R = static_cast<int64_t>(rs.size());
  std::vector<double> w;
  if (weights) w = load(*weights, "moe_permute weights");
  const std::vector<double> vx = load(x, "moe_permute x");
  std::vector<double> o(R * D);
  for (int64_t r = 0; r < R; ++r) {
    FP8RL_CHECK(rs[r] >= 0 && rs[r] < S, "moe_permute: row_slot[", r, "] = ", rs[r], " is outside [0, ", S, ")");
    const double c = weights ? w[rs[r]] : 1.0;
    const int64_t t = rs[r] / top_k;
    for (int64_t d = 0; d < D; ++d) o[r * D + d] = c * vx[t * D + d];
  }
  store(o, out, "moe_permute out");
}

void CpuBackend::moe_unpermute_impl(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) {
  const int64_t R = y.dim(0), D = y.dim(1), T = out.dim(0);
  const std::vector<int32_t> sr = load_i32(slot_row, "moe_unpermute slot_row");
  const int64_t S = static_cast<int64_t>(sr.size()), k = S / T;
  std::vector<double> w;
  if (weights) w = load(*weights, "moe_unpermute weights");
  const std::vector<double> vy = load(y, "moe_unpermute y");
  std::vector<double> o(T * D, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      FP8RL_CHECK(sr[s] >= 0 && sr[s] < R, "moe_unpermute: slot_row[", s, "] = ", sr[s], " is outside [0, ", R, ")");
      const double c = weights ? w[s] : 1.0;
      for (int64_t d = 0; d < D; ++d) o[t * D + d] += c * vy[sr[s] * D + d];
    }
  store(o, out, "moe_unpermute out");
}

void CpuBackend::moe_unpermute_backward_weights_impl(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                                     Tensor& dweights) {
  const int64_t R = y.dim(0), D = y.dim(1), T = dout.dim(0);
  const std::vector<int32_t> sr = load_i32(slot_row, "moe_unpermute_backward_weights slot_row");
  const int64_t S = static_cast<int64_t>(sr.size()), k = S / T;
  const std::vector<double> g = load(dout, "moe dout"), vy = load(y, "moe y");
  std::vector<double> dw(S, 0.0);
  for (int64_t s = 0; s < S; ++s) {
    FP8RL_CHECK(sr[s] >= 0 && sr[s] < R, "moe_unpermute_backward_weights: slot_row[", s, "] = ", sr[s],
                " is outside [0, ", R, ")");
    for (int64_t d = 0; d < D; ++d) dw[s] += g[(s / k) * D + d] * vy[sr[s] * D + d];
  }
  store(dw, dweights, "moe_unpermute_backward_weights dweights");
}

}  // namespace cpu
}  // namespace fp8rl
