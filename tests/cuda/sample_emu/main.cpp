// Checks the emulated sampling kernel against a re-statement of cpu_sample.cpp (see run.sh).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

#include "kern.inc"

static_assert(emu::kSampleThreads == 512, "emu.h launches 512 threads per block");

namespace {

struct Ref {
  int32_t token;
  double logp;
};

// cpu_sample.cpp's algorithm for one row (double throughout, stable sort). The draw is over the
// first V ids; logp is normalized over all ld >= V ids (a padded vocabulary, backend.h).
Ref ref_sample(const float* lg, int64_t V, float tau, float top_p, int top_k, float u, int64_t ld = 0) {
  if (ld == 0) ld = V;
  std::vector<double> row(lg, lg + V);
  const double mx = *std::max_element(row.begin(), row.end());
  if (tau == 0) return {static_cast<int32_t>(std::find(row.begin(), row.end(), mx) - row.begin()), 0.0};
  std::vector<double> z(row);
  for (double& e : z) e /= tau;
  const double zmax = mx / tau;
  double sum = 0;
  for (double e : z) sum += std::exp(e - zmax);
  const double lse = zmax + std::log(sum);
  std::vector<int64_t> order(V);
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
  double lse_all = lse;
  double pm = -INFINITY;
  for (int64_t j = V; j < ld; ++j) pm = std::max(pm, double(lg[j]));
  if (pm > -INFINITY) {
    double ps = 0;
    for (int64_t j = V; j < ld; ++j) ps += std::exp(double(lg[j]) / tau - pm / tau);
    const double lp = pm / tau + std::log(ps), hi = std::max(lse, lp), lo = std::min(lse, lp);
    lse_all = hi + std::log(1.0 + std::exp(lo - hi));
  }
  return {static_cast<int32_t>(tok), z[tok] - lse_all};
}

struct Batch {
  int64_t V;
  int64_t ld = 0;  // row stride (0: V); ld > V is a padded vocabulary, ids >= V never sampled
  std::vector<float> logits, temp, top_p, u;
  std::vector<int32_t> top_k;
};

// Runs the kernel; returns tokens/logp and the bad flag.
int run_kernel(const Batch& b, std::vector<int32_t>& tok, std::vector<float>& lp) {
  const int B = static_cast<int>(b.temp.size());
  tok.assign(B, -7);
  lp.assign(B, -7.0f);
  int bad = 0;
  emu::emu_launch(B, sizeof(emu::SampleShared), emu::kBinBytes, [&] {
    emu::sample_kernel(b.logits.data(), b.ld ? b.ld : b.V, b.V, b.temp.data(), b.top_p.data(), b.top_k.data(), b.u.data(), 1, false, tok.data(),
                       lp.data(), &bad);
  });
  return bad;
}

int g_fail = 0, g_checked = 0;

void check(const char* name, const Batch& b) {
  std::vector<int32_t> tok;
  std::vector<float> lp;
  const int bad = run_kernel(b, tok, lp);
  if (bad) {
    std::printf("FAIL %s: bad flag raised on valid rows\n", name);
    ++g_fail;
  }
  for (size_t r = 0; r < b.temp.size(); ++r) {
    const Ref ref = ref_sample(b.logits.data() + r * (b.ld ? b.ld : b.V), b.V, b.temp[r], b.top_p[r], b.top_k[r], b.u[r],
                               b.ld);
    ++g_checked;
    const bool lp_ok = std::fabs(lp[r] - ref.logp) <= 1e-5 * std::max(1.0, std::fabs(ref.logp));
    if (tok[r] != ref.token || !lp_ok) {
      std::printf("FAIL %s row %zu (V %lld tau %g top_p %g top_k %d u %.7g): token %d logp %.7g, want %d %.7g\n", name,
                  r, static_cast<long long>(b.V), b.temp[r], b.top_p[r], b.top_k[r], b.u[r], tok[r], lp[r], ref.token,
                  ref.logp);
      ++g_fail;
    }
  }
}

}  // namespace

int main() {
  std::mt19937 gen(2026);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  const float temps[] = {1.0f, 0.7f, 1.3f, 0.0f, 2.0f, 1.0f, 0.5f, 1.0f};
  const float tps[] = {1.0f, 0.9f, 0.5f, 1.0f, 0.95f, 0.3f, 1.0f, 0.6f};
  const int tks[] = {0, 0, 50, 0, 10, 0, 3, 1};
  for (int64_t V : {int64_t(1), int64_t(1000), int64_t(5003)}) {
    for (int kind = 0; kind < 4; ++kind) {  // 0 random, 1 integer ties, 2 -inf masked, 3 constant row
      Batch b;
      b.V = V;
      const int B = 8;
      for (int r = 0; r < B; ++r) {
        for (int64_t j = 0; j < V; ++j) {
          float x = nd(gen);
          if (kind == 1) x = std::round(x);
          if (kind == 2 && j % 3 == 1) x = -INFINITY;
          if (kind == 3) x = 0.25f;
          b.logits.push_back(x);
        }
        b.temp.push_back(temps[(r + kind) % 8]);
        b.top_p.push_back(tps[(r + 3 * kind) % 8]);
        b.top_k.push_back(tks[(r + 5 * kind + V) % 8]);
        float u = std::min(ud(gen), 0.99999f);
        if (r == 1) u = 0.0f;
        if (r == 2) u = 0.99999f;
        b.u.push_back(u);
      }
      char name[64];
      std::snprintf(name, sizeof name, "V%lld kind%d", static_cast<long long>(V), kind);
      check(name, b);
    }
  }
  // A padded vocabulary: rows of ld = V + 37 logits, only the first V sampled. The padding holds
  // the row's largest logits and -inf: never drawn, but in logp's normalization.
  for (int64_t V : {int64_t(1), int64_t(1000), int64_t(5003)}) {
    Batch b;
    b.V = V;
    b.ld = V + 37;
    const int B = 8;
    for (int r = 0; r < B; ++r) {
      for (int64_t j = 0; j < b.ld; ++j) {
        float x = nd(gen);
        if (j >= V) x = (j - V) % 3 == 0 ? 8.0f + nd(gen) : ((j - V) % 3 == 1 ? -INFINITY : nd(gen));
        b.logits.push_back(x);
      }
      b.temp.push_back(temps[r % 8]);
      b.top_p.push_back(tps[(r + 1) % 8]);
      b.top_k.push_back(tks[(r + 2) % 8]);
      b.u.push_back(r == 2 ? 0.99999f : std::min(ud(gen), 0.99999f));
    }
    char name[64];
    std::snprintf(name, sizeof name, "padded V%lld ld%lld", static_cast<long long>(V), static_cast<long long>(b.ld));
    check(name, b);
  }
  // NaN in the padding raises the flag too (it is read for logp).
  {
    Batch b;
    b.V = 50;
    b.ld = 60;
    for (int j = 0; j < 60; ++j) b.logits.push_back(j == 55 ? NAN : nd(gen));
    b.temp = {1};
    b.top_p = {1};
    b.top_k = {0};
    b.u = {0.5f};
    std::vector<int32_t> tok;
    std::vector<float> lp;
    if (!run_kernel(b, tok, lp) || !std::isnan(lp[0])) {
      std::printf("FAIL NaN in the padding not flagged\n");
      ++g_fail;
    }
  }
  // Invalid rows raise the flag: NaN, +inf, only -inf.
  {
    Batch b;
    b.V = 100;
    for (int r = 0; r < 3; ++r)
      for (int j = 0; j < 100; ++j) b.logits.push_back(r == 2 ? -INFINITY : nd(gen));
    b.logits[50] = NAN;
    b.logits[100 + 3] = INFINITY;
    b.temp = {1, 1, 1};
    b.top_p = {1, 1, 1};
    b.top_k = {0, 0, 0};
    b.u = {0.5f, 0.5f, 0.5f};
    std::vector<int32_t> tok;
    std::vector<float> lp;
    if (!run_kernel(b, tok, lp) || !std::isnan(lp[0]) || !std::isnan(lp[1]) || !std::isnan(lp[2])) {
      std::printf("FAIL invalid rows not flagged\n");
      ++g_fail;
    }
  }
  std::printf("%s: %d rows checked, %d failures\n", g_fail ? "FAILED" : "OK", g_checked, g_fail);
  return g_fail ? 1 : 0;
}
