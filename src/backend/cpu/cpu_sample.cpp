// CPU backend: token sampling (temperature, top-k, top-p, inverse CDF driven by given uniforms).
//
// Per row b, with z = logits / temperature[b] and p = softmax(z):
//   1. order the tokens by z descending, ties by lower id first;
//   2. keep the first top_k[b] (0 = all);
//   3. keep the smallest prefix whose probability mass, renormalized over the top-k kept
//      tokens, reaches top_p[b] (top_p >= 1 keeps them all; at least one token is kept);
//   4. draw the first kept token whose cumulative mass exceeds uniforms[b] * (kept mass).
// logp[b] = z[token] - logsumexp(z): the log-prob before truncation.
// temperature 0 is greedy: the lowest-id argmax of the logits, logp = 0 (the log-prob of the
// one-hot limit distribution).
// valid_vocab Vv (0 = V): steps 1-4 and greedy run over ids [0, Vv) only (ids >= Vv as if their
// logits were -inf), so no id >= Vv is ever drawn; logp stays the log-prob before truncation,
// over all V ids: lse = log(e^lse_valid + e^lse_padding), each part with its own max.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {

void CpuBackend::sample(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
                        const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens,
                        Tensor& logp, int64_t valid_vocab) {
  check_float(logits, "sample logits");
  FP8RL_CHECK(logits.ndim() == 2 && logits.dim(1) > 0, "sample logits must be [B, V], got ", logits.str());
  const int64_t B = logits.dim(0), ld = logits.dim(1);
  FP8RL_CHECK(valid_vocab >= 0 && valid_vocab <= ld, "sample: valid_vocab ", valid_vocab,
              " must be in [0, V = ", ld, "] (0: all V)");
  const int64_t V = valid_vocab > 0 ? valid_vocab : ld;  // the row's sampled ids [0, V)
  const auto n = static_cast<size_t>(B);
  FP8RL_CHECK(temperature.size() == n && top_p.size() == n && top_k.size() == n && uniforms.size() == n,
              "sample needs one temperature, top_p, top_k and uniform per row (", B, " rows), got ",
              temperature.size(), ", ", top_p.size(), ", ", top_k.size(), ", ", uniforms.size());
  check_cpu(tokens, "sample tokens");
  check_dtype(tokens, DType::I32, "sample tokens");
  check_shape(tokens, {B}, "sample tokens");
  check_shape(logp, {B}, "sample logp");
  const std::vector<double> x = load(logits, "sample logits");
  std::vector<double> lp(B);
  std::vector<int64_t> order(V);
  for (int64_t b = 0; b < B; ++b) {
    const double* row = x.data() + b * ld;
    const float tau = temperature[b];
    FP8RL_CHECK(std::isfinite(tau) && tau >= 0, "sample: temperature of row ", b, " must be >= 0, got ", tau);
    FP8RL_CHECK(top_p[b] > 0 && top_p[b] <= 1, "sample: top_p of row ", b, " must be in (0, 1], got ", top_p[b]);
    FP8RL_CHECK(top_k[b] >= 0, "sample: top_k of row ", b, " must be >= 0, got ", top_k[b]);
    FP8RL_CHECK(uniforms[b] >= 0 && uniforms[b] < 1, "sample: uniform of row ", b, " must be in [0, 1), got ",
                uniforms[b]);
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(row[j]) || row[j] == INFINITY)
        FP8RL_FAIL_NONFINITE("sample: logit ", j, " of row ", b, " is ", row[j]);
      mx = std::max(mx, row[j]);
    }
    FP8RL_CHECK(mx > -INFINITY, "sample: every logit of row ", b, " is -inf");
    double pad_mx = -INFINITY;  // ids [V, ld): never drawn, but in logp's normalization
    for (int64_t j = V; j < ld; ++j) {
      FP8RL_CHECK(!std::isnan(row[j]) && row[j] != INFINITY, "sample: logit ", j, " of row ", b, " is ", row[j]);
      pad_mx = std::max(pad_mx, row[j]);
    }
    if (tau == 0) {
      tokens.data<int32_t>()[b] = static_cast<int32_t>(std::find(row, row + V, mx) - row);
      lp[b] = 0;
      continue;
    }
    std::vector<double> z(row, row + V);
    for (double& e : z) e /= tau;
    const double zmax = mx / tau;
    double sum = 0;
    for (double e : z) sum += std::exp(e - zmax);
    const double lse = zmax + std::log(sum);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return z[a] > z[c]; });
    int64_t keep = top_k[b] > 0 ? std::min<int64_t>(top_k[b], V) : V;
    if (top_p[b] < 1) {
      double mass = 0;
      for (int64_t r = 0; r < keep; ++r) mass += std::exp(z[order[r]] - lse);
      double cum = 0;
      int64_t r = 0;
      while (r < keep) {
        cum += std::exp(z[order[r]] - lse);
        ++r;
        if (cum >= top_p[b] * mass) break;
      }
      keep = r;
    }
    double kept = 0;
    for (int64_t r = 0; r < keep; ++r) kept += std::exp(z[order[r]] - lse);
    const double target = uniforms[b] * kept;
    int64_t tok = order[keep - 1];
    double cum = 0;
    for (int64_t r = 0; r < keep; ++r) {
      cum += std::exp(z[order[r]] - lse);
      if (cum > target) {
        tok = order[r];
        break;
      }
    }
    double lse_all = lse;
    if (pad_mx > -INFINITY) {
      const double pmax = pad_mx / tau;
      double ps = 0;
      for (int64_t j = V; j < ld; ++j) ps += std::exp(row[j] / tau - pmax);
      const double lse_pad = pmax + std::log(ps);
      const double hi = std::max(lse, lse_pad), lo = std::min(lse, lse_pad);
      lse_all = hi + std::log(1.0 + std::exp(lo - hi));
    }
    tokens.data<int32_t>()[b] = static_cast<int32_t>(tok);
    lp[b] = z[tok] - lse_all;
  }
  store(lp, logp, "sample logp");
}

}  // namespace cpu
}  // namespace fp8rl
