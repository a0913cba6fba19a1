// CPU backend: token sampling. Two entry points share the per-row rules below.
//
// sample (host parameters; every row the inverse-CDF draw). Per row b, with z = logits /
// temperature[b] and p = softmax(z):
//   1. order the tokens by z descending, ties by lower id first;
//   2. keep the first top_k[b] (0 = all);
//   3. keep the smallest prefix whose probability mass, renormalized over the top-k kept
//      tokens, reaches top_p[b] (top_p >= 1 keeps them all; at least one token is kept);
//   4. draw the first kept token whose cumulative mass exceeds uniforms[b] * (kept mass).
//
// sample_rows (parameters as SampleRow, backend/sampling.h): a row with top_k > 0 or top_p < 1
// takes the same inverse-CDF draw with its `uniform`; any other row with temperature > 0 the
// Gumbel-max draw: token = argmax_i fl(logit_i * fl(1/T)) + g_i over the valid ids, ties to
// the lowest id, g_i from Philox keyed by (key, counter, i) (sampling.h, the same code the GPU
// runs: both pick the same token from the same logits).
//
// Both: logp[b] = z[token] - logsumexp(z): the log-prob before truncation, in double.
// temperature 0 is greedy: the lowest-id argmax of the logits, logp = 0 (the log-prob of the
// one-hot limit distribution).
// valid_vocab Vv (0 = V): the draw and greedy run over ids [0, Vv) only (ids >= Vv as if their
// logits were -inf), so no id >= Vv is ever drawn; logp stays the log-prob before truncation,
// over all V ids: lse = log(e^lse_valid + e^lse_padding), each part with its own max.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"
#include "backend/sampling.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {

namespace {

struct RowResult {
  int32_t token;
  double logp;
};

// Checks a row of logits (ld ids, the first V drawable): no NaN / +inf anywhere, and not only
// -inf among the drawable ids. Returns the drawable ids' max.
double check_row(const double* row, int64_t V, int64_t ld, int64_t b) {
  double mx = -INFINITY;
  for (int64_t j = 0; j < ld; ++j) {
    if (std::isnan(row[j]) || row[j] == INFINITY)
      FP8RL_FAIL_NONFINITE("sample: logit ", j, " of row ", b, " is ", row[j]);
    if (j < V) mx = std::max(mx, row[j]);
  }
  FP8RL_CHECK(mx > -INFINITY, "sample: every logit of row ", b, " is -inf");
  return mx;
}

// log sum_j exp(row[j] / tau) over all ld ids, as the drawable part [0, V) (its max mx) and the
// padding [V, ld) each with its own max.
double row_lse(const double* row, int64_t V, int64_t ld, double tau, double mx) {
  const double zmax = mx / tau;
  double sum = 0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(row[j] / tau - zmax);
  const double lse = zmax + std::log(sum);
  double pad_mx = -INFINITY;
  for (int64_t j = V; j < ld; ++j) pad_mx = std::max(pad_mx, row[j]);
  if (pad_mx == -INFINITY) return lse;
  const double pmax = pad_mx / tau;
  double ps = 0;
  for (int64_t j = V; j < ld; ++j) ps += std::exp(row[j] / tau - pmax);
  const double lse_pad = pmax + std::log(ps);
  const double hi = std::max(lse, lse_pad), lo = std::min(lse, lse_pad);
  return hi + std::log(1.0 + std::exp(lo - hi));
}

// Greedy: the lowest-id argmax of the drawable ids.
RowResult row_greedy(const double* row, int64_t V, double mx) {
  return {static_cast<int32_t>(std::find(row, row + V, mx) - row), 0.0};
}

// Steps 1-4 of the inverse-CDF draw (tau > 0). `order` is scratch.
RowResult row_inverse_cdf(const double* row, int64_t V, int64_t ld, double tau, float top_p, int top_k, float u,
                          double mx, std::vector<int64_t>& order) {
  std::vector<double> z(row, row + V);
  for (double& e : z) e /= tau;
  const double zmax = mx / tau;
  double sum = 0;
  for (double e : z) sum += std::exp(e - zmax);
  const double lse = zmax + std::log(sum);
  order.resize(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return z[a] > z[c]; });
  int64_t keep = top_k > 0 ? std::min<int64_t>(top_k, V) : V;
  if (top_p < 1) {
    double mass = 0;
    for (int64_t r = 0; r < keep; ++r) mass += std::exp(z[order[r]] - lse);
    double cum = 0;
    int64_t r = 0;
    while (r < keep) {
      cum += std::exp(z[order[r]] - lse);
      ++r;
      if (cum >= top_p * mass) break;
    }
    keep = r;
  }
  double kept = 0;
  for (int64_t r = 0; r < keep; ++r) kept += std::exp(z[order[r]] - lse);
  const double target = u * kept;
  int64_t tok = order[keep - 1];
  double cum = 0;
  for (int64_t r = 0; r < keep; ++r) {
    cum += std::exp(z[order[r]] - lse);
    if (cum > target) {
      tok = order[r];
      break;
    }
  }
  return {static_cast<int32_t>(tok), z[tok] - row_lse(row, V, ld, tau, mx)};
}

// The Gumbel-max draw (tau > 0): sampling.h's scores, the first maximum.
RowResult row_gumbel(const double* row, int64_t V, int64_t ld, float tau, const SampleRow& p, double mx) {
  const float inv_t = sampling::div_rn(1.0f, tau);
  float best = -INFINITY;
  int64_t tok = -1;
  for (int64_t j0 = 0; j0 < V; j0 += 4) {  // one Philox call per 4 ids (= gumbel_noise of each)
    const sampling::Philox4 r = sampling::philox4x32_10(static_cast<uint32_t>(j0 >> 2), p.counter,
                                                        sampling::kGumbelDomain, 0u, p.key_lo, p.key_hi);
    for (int64_t j = j0; j < std::min(j0 + 4, V); ++j) {
      const float l = static_cast<float>(row[j]);
      if (l == -INFINITY) continue;  // never drawn (its score is -inf)
      const float s = sampling::gumbel_score(l, inv_t, sampling::gumbel_from_bits(r.v[j - j0]));
      if (s > best) best = s, tok = j;
    }
  }
  FP8RL_CHECK(tok >= 0, "sample: internal error: no Gumbel maximum");
  return {static_cast<int32_t>(tok), row[tok] / tau - row_lse(row, V, ld, tau, mx)};
}

// Rows B, row length ld and drawable ids V of logits [B, ld] (the contract checked the shapes).
void row_dims(const Tensor& logits, int64_t valid_vocab, int64_t& B, int64_t& ld, int64_t& V) {
  B = logits.dim(0), ld = logits.dim(1);
  V = valid_vocab > 0 ? valid_vocab : ld;  // the row's sampled ids [0, V)
}

}  // namespace

void CpuBackend::sample_impl(const Tensor& logits, const std::vector<float>& temperature,
                             const std::vector<float>& top_p, const std::vector<int>& top_k,
                             const std::vector<float>& uniforms, Tensor& tokens, Tensor& logp, int64_t valid_vocab) {
  int64_t B, ld, V;
  row_dims(logits, valid_vocab, B, ld, V);
  const std::vector<double> x = load(logits, "sample logits");
  std::vector<double> lp(B);
  std::vector<int64_t> order;
  for (int64_t b = 0; b < B; ++b) {
    const double* row = x.data() + b * ld;
    const float tau = temperature[b];
    const double mx = check_row(row, V, ld, b);
    const RowResult r = tau == 0 ? row_greedy(row, V, mx)
                                 : row_inverse_cdf(row, V, ld, tau, top_p[b], top_k[b], uniforms[b], mx, order);
    tokens.data<int32_t>()[b] = r.token;
    lp[b] = r.logp;
  }
  store(lp, logp, "sample logp");
}

void CpuBackend::sample_rows_impl(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens,
                                  Tensor& logp, int64_t valid_vocab) {
  int64_t B, ld, V;
  row_dims(logits, valid_vocab, B, ld, V);
  // The rows' parameters are data (on the device on the GPU): checked here, as the GPU checks them.
  std::vector<SampleRow> params(B);
  if (B > 0) std::memcpy(params.data(), rows.raw(), static_cast<size_t>(B) * sizeof(SampleRow));
  for (int64_t b = 0; b < B; ++b) {
    const SampleRow& p = params[b];
    FP8RL_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "sample: temperature of row ", b,
                " must be >= 0, got ", p.temperature);
    if (!sample_row_truncates(p)) continue;
    FP8RL_CHECK(truncation, "sample_rows: row ", b, " has top_k ", p.top_k, " / top_p ", p.top_p,
                " but the call says no row truncates (pass truncation = true)");
    FP8RL_CHECK(p.top_p > 0 && p.top_p <= 1, "sample: top_p of row ", b, " must be in (0, 1], got ", p.top_p);
    FP8RL_CHECK(p.top_k >= 0, "sample: top_k of row ", b, " must be >= 0, got ", p.top_k);
    FP8RL_CHECK(p.uniform >= 0 && p.uniform < 1, "sample: uniform of row ", b, " must be in [0, 1), got ", p.uniform);
  }
  const std::vector<double> x = load(logits, "sample logits");
  std::vector<double> lp(B);
  int32_t* tok = tokens.data<int32_t>();
  // Rows are independent: each writes only its own outputs (same bits with any thread count).
  cpu_parallel_for(B, B * ld * 64, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> order;
    for (int64_t b = b0; b < b1; ++b) {
      const double* row = x.data() + b * ld;
      const SampleRow& p = params[b];
      const double mx = check_row(row, V, ld, b);
      const RowResult r = p.temperature == 0 ? row_greedy(row, V, mx)
                          : sample_row_truncates(p)
                              ? row_inverse_cdf(row, V, ld, p.temperature, p.top_p, p.top_k, p.uniform, mx, order)
                              : row_gumbel(row, V, ld, p.temperature, p, mx);
      tok[b] = r.token;
      lp[b] = r.logp;
    }
  });
  store(lp, logp, "sample logp");
}

}  // namespace cpu
}  // namespace fp8rl
