// Backend::sample_rows on the GPU against the CPU reference: the Gumbel-max draw picks the same
// token (bitwise: sampling.h runs on both) and logp agrees within 1e-5, at the Qwen3 RL shape
// (B = 256, V = 151936, valid_vocab 151669); mixed batches (top-k / top-p rows through the radix
// kernel, greedy rows) on a row stride that is not a multiple of 4 (the scalar-load path);
// data errors raised at the next synchronizing call; and graph replays that draw with each
// replay's rows. Prints the sampler's time at the RL shape (no assertion on it).
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/sampling.h"
#include "core/error.h"

namespace fp8rl {
namespace {

struct Env {
  std::unique_ptr<Backend> gpu = make_cuda_backend(0);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
};
Env& env() {
  static Env e;
  return e;
}
Backend& G() { return *env().gpu; }
Backend& C() { return *env().cpu; }

float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

Tensor rows_host(const std::vector<SampleRow>& rows) {
  Tensor t = Tensor::empty({static_cast<int64_t>(rows.size()), 8}, DType::I32);
  std::memcpy(t.raw(), rows.data(), rows.size() * sizeof(SampleRow));
  return t;
}

// Logits like a language model's at the RL shape: N(0, 3), rows of bf16-rounded values (many
// ties), peaked rows (one id 25 above: the Gumbel kernel's skip path), -inf entries, and a
// padding [Vv, V) that holds large logits in some rows (never drawn, in logp's normalization).
Tensor lm_logits(int64_t B, int64_t V, int64_t Vv, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  Tensor lg = Tensor::empty({B, V}, DType::F32);
  float* x = lg.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < V; ++j) {
      float e = nd(gen);
      if (b % 4 == 1) e = bf16_round(e);
      if (b % 8 == 2 && j % 5 == 0) e = -INFINITY;
      if (b % 8 == 5 && j >= Vv) e += 12.0f;
      x[b * V + j] = e;
    }
    if (b % 8 == 3) x[b * V + (b * 7919) % Vv] += 25.0f;
  }
  return lg;
}

void expect_same_draws(const Tensor& lg, const std::vector<SampleRow>& rows, bool truncation, int64_t Vv,
                       const char* what) {
  const int64_t B = lg.dim(0);
  Tensor ct = Tensor::empty({B}, DType::I32), cp = Tensor::empty({B}, DType::F32);
  C().sample_rows(lg, rows_host(rows), truncation, ct, cp, Vv);
  Tensor dlg = G().to_device(lg), drows = G().to_device(rows_host(rows));
  Tensor gt = G().alloc({B}, DType::I32), gp = G().alloc({B}, DType::F32);
  G().fill(gt, -1.0f);
  G().fill(gp, NAN);
  G().sample_rows(dlg, drows, truncation, gt, gp, Vv);
  const Tensor ht = G().to_host(gt), hp = G().to_host(gp);
  int64_t mismatches = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t g = ht.data<int32_t>()[b], c = ct.data<int32_t>()[b];
    EXPECT_LT(g, Vv > 0 ? Vv : lg.dim(1)) << what << " row " << b;
    if (g != c) ++mismatches;
    EXPECT_EQ(g, c) << what << " row " << b << " T " << rows[b].temperature << " top_k " << rows[b].top_k;
    const float pg = hp.data<float>()[b], pc = cp.data<float>()[b];
    EXPECT_NEAR(pg, pc, 1e-5 * std::max(1.0f, std::fabs(pc))) << what << " row " << b;
  }
  EXPECT_EQ(mismatches, 0) << what;
}

TEST(CudaSampleGumbel, MatchesCpuAtTheQwenRlShape) {
  const int64_t B = 256, V = 151936, Vv = 151669;
  const Tensor lg = lm_logits(B, V, Vv, 21);
  const float temps[] = {1.0f, 0.7f, 1.0f, 0.0f, 1.3f, 1.0f, 0.6f, 1.0f};
  for (uint32_t step = 0; step < 2; ++step) {
    std::vector<SampleRow> rows(B);
    for (int64_t b = 0; b < B; ++b) {
      rows[b].temperature = temps[b % 8];
      const uint64_t key = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(b + 1);
      rows[b].key_lo = static_cast<uint32_t>(key), rows[b].key_hi = static_cast<uint32_t>(key >> 32);
      rows[b].counter = 512 + step + static_cast<uint32_t>(b % 3);
    }
    expect_same_draws(lg, rows, false, Vv, step ? "step 1" : "step 0");
  }
  // valid_vocab 0 (all ids drawable) too.
  std::vector<SampleRow> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b].temperature = 1.0f, rows[b].key_lo = static_cast<uint32_t>(b);
  expect_same_draws(lg, rows, false, 0, "valid_vocab 0");
}

// Mixed rows (Gumbel, greedy, top-k, top-p) on a stride of 32003 ids (scalar loads), few rows
// (several blocks per row and the merge kernel over splits).
TEST(CudaSampleGumbel, MixedBatchMatchesCpu) {
  const int64_t B = 24, V = 32003, Vv = 32000;
  const Tensor lg = lm_logits(B, V, Vv, 5);
  std::vector<SampleRow> rows(B);
  std::mt19937 gen(2);
  std::uniform_real_distribution<float> ud(0.0f, 0.99999f);
  for (int64_t b = 0; b < B; ++b) {
    SampleRow& r = rows[b];
    r.temperature = b % 6 == 0 ? 0.0f : (b % 2 ? 1.0f : 0.8f);
    if (b % 3 == 1) r.top_k = 50;
    if (b % 4 == 2) r.top_p = 0.9f;
    r.uniform = ud(gen);
    r.key_lo = static_cast<uint32_t>(1000 + b), r.key_hi = 7u, r.counter = static_cast<uint32_t>(b);
  }
  expect_same_draws(lg, rows, true, Vv, "mixed");
  // Only plain rows, no truncation kernel, a single row.
  std::vector<SampleRow> one(1);
  one[0].key_lo = 3;
  Tensor lg1 = Tensor::empty({1, V}, DType::F32);
  std::memcpy(lg1.raw(), lg.raw(), V * sizeof(float));
  expect_same_draws(lg1, one, false, Vv, "one row");
}

TEST(CudaSampleGumbel, DataErrorsSurfaceAtTheNextSync) {
  const int64_t B = 4, V = 1024;
  Tensor lg = lm_logits(B, V, V, 9);
  std::vector<SampleRow> rows(B);
  Tensor gt = G().alloc({B}, DType::I32), gp = G().alloc({B}, DType::F32);
  auto run = [&](const Tensor& l, const std::vector<SampleRow>& r, bool truncation) {
    G().sample_rows(G().to_device(l), G().to_device(rows_host(r)), truncation, gt, gp, 1000);
    G().synchronize();
  };
  EXPECT_NO_THROW(run(lg, rows, false));
  std::vector<SampleRow> bad = rows;
  bad[2].top_k = 5;  // a truncating row without `truncation`
  EXPECT_THROW(run(lg, bad, false), Error);
  bad = rows;
  bad[1].temperature = -1.0f;
  EXPECT_THROW(run(lg, bad, true), Error);
  bad = rows;
  bad[3].top_p = 0.5f, bad[3].uniform = 1.5f;
  EXPECT_THROW(run(lg, bad, true), Error);
  Tensor nan_lg = Tensor::empty({B, V}, DType::F32);
  std::memcpy(nan_lg.raw(), lg.raw(), lg.nbytes());
  nan_lg.data<float>()[2 * V + 1010] = NAN;  // in the padding: still an error
  EXPECT_THROW(run(nan_lg, rows, false), Error);
  EXPECT_NO_THROW(run(lg, rows, false));
}

// The sampler inside a recorded graph reads each replay's rows: new counters, new draws, each
// equal to the CPU's.
TEST(CudaSampleGumbel, GraphReplaysDrawWithTheirRows) {
  const int64_t B = 64, V = 151936, Vv = 151669;
  const Tensor lg = lm_logits(B, V, Vv, 33);
  const Tensor dlg = G().to_device(lg);
  Tensor drows = G().alloc({B, 8}, DType::I32);
  Tensor gt = G().alloc({B}, DType::I32), gp = G().alloc({B}, DType::F32);
  auto rows_at = [&](uint32_t step) {
    std::vector<SampleRow> rows(B);
    for (int64_t b = 0; b < B; ++b) {
      rows[b].temperature = b % 5 == 4 ? 0.0f : 1.0f;
      rows[b].key_lo = static_cast<uint32_t>(b), rows[b].key_hi = 99u, rows[b].counter = step;
    }
    return rows;
  };
  G().copy(rows_host(rows_at(0)), drows);
  G().sample_rows(dlg, drows, false, gt, gp, Vv);  // the unrecorded run record() asks for
  std::unique_ptr<OpGraph> g = G().record([&] { G().sample_rows(dlg, drows, false, gt, gp, Vv); });
  if (!g) GTEST_SKIP() << "this backend does not record graphs (FP8RL_CUDA_GRAPHS=0 or plain allocation)";
  std::vector<int32_t> prev;
  int changed = 0;
  for (uint32_t step = 1; step <= 3; ++step) {
    const std::vector<SampleRow> rows = rows_at(step);
    G().copy(rows_host(rows), drows);
    g->replay();
    const Tensor ht = G().to_host(gt), hp = G().to_host(gp);
    Tensor ct = Tensor::empty({B}, DType::I32), cp = Tensor::empty({B}, DType::F32);
    C().sample_rows(lg, rows_host(rows), false, ct, cp, Vv);
    std::vector<int32_t> cur(ht.data<int32_t>(), ht.data<int32_t>() + B);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(cur[b], ct.data<int32_t>()[b]) << "replay " << step << " row " << b;
      EXPECT_NEAR(hp.data<float>()[b], cp.data<float>()[b], 1e-5 * std::max(1.0f, std::fabs(cp.data<float>()[b])));
      if (!prev.empty() && prev[b] != cur[b]) ++changed;
    }
    prev = cur;
  }
  EXPECT_GT(changed, B / 2) << "replays with new counters must draw new tokens";
}

// BF16 logits (the lm_head's output, read as they are) draw exactly what their F32 copy draws on
// the GPU — the same tokens and logp bits — and the CPU's tokens: the RL shape (plain and greedy
// rows, 8-byte loads) and a mixed batch on an odd stride (scalar loads; top-k / top-p rows through
// the radix kernel on the converted copy).
TEST(CudaSampleGumbel, Bf16LogitsDrawAsTheirF32Copy) {
  struct Case {
    int64_t B, V, Vv;
    bool truncation;
  };
  for (const Case cs : {Case{256, 151936, 151669, false}, Case{24, 32003, 32000, true}}) {
    SCOPED_TRACE(testing::Message() << "B=" << cs.B << " V=" << cs.V);
    const Tensor lg = lm_logits(cs.B, cs.V, cs.Vv, 61);
    std::vector<float> v(lg.data<float>(), lg.data<float>() + lg.numel());
    for (float& x : v) x = std::isfinite(x) ? bf16_round(x) : x;
    const Tensor lf = from_float_vector(v, {cs.B, cs.V}, DType::F32);  // the BF16 values, exactly
    const Tensor lb = from_float_vector(v, {cs.B, cs.V}, DType::BF16);
    std::vector<SampleRow> rows(static_cast<size_t>(cs.B));
    for (int64_t b = 0; b < cs.B; ++b) {
      SampleRow& r = rows[b];
      r.temperature = b % 7 == 3 ? 0.0f : (b % 2 ? 1.0f : 0.7f);
      if (cs.truncation && b % 3 == 1) r.top_k = 50;
      if (cs.truncation && b % 4 == 2) r.top_p = 0.9f;
      r.uniform = 0.3f + 0.02f * static_cast<float>(b % 10);
      r.key_lo = static_cast<uint32_t>(77 + b), r.key_hi = 5u, r.counter = static_cast<uint32_t>(2 * b);
    }
    const Tensor drows = G().to_device(rows_host(rows));
    Tensor t16 = G().alloc({cs.B}, DType::I32), p16 = G().alloc({cs.B}, DType::F32);
    Tensor t32 = G().alloc({cs.B}, DType::I32), p32 = G().alloc({cs.B}, DType::F32);
    G().sample_rows(G().to_device(lb), drows, cs.truncation, t16, p16, cs.Vv);
    G().sample_rows(G().to_device(lf), drows, cs.truncation, t32, p32, cs.Vv);
    const Tensor h16 = G().to_host(t16), h32 = G().to_host(t32), q16 = G().to_host(p16), q32 = G().to_host(p32);
    EXPECT_EQ(std::memcmp(h16.raw(), h32.raw(), h16.nbytes()), 0) << "tokens differ from the F32 copy's";
    EXPECT_EQ(std::memcmp(q16.raw(), q32.raw(), q16.nbytes()), 0) << "logp differ from the F32 copy's";
    expect_same_draws(lf, rows, cs.truncation, cs.Vv, "the BF16 values as F32, against the CPU");
  }
}

// Time of one sample_rows at B = 256, V = 151936 (plain temperature), and of the inverse-CDF
// sample() on the same logits, printed for docs/benchmarks.md.
TEST(CudaSampleGumbel, PrintsTheSamplerTime) {
  const int64_t B = 256, V = 151936, Vv = 151669;
  const Tensor lg = lm_logits(B, V, Vv, 44);
  const Tensor dlg = G().to_device(lg);
  std::vector<SampleRow> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b].key_lo = static_cast<uint32_t>(b);
  const Tensor drows = G().to_device(rows_host(rows));
  Tensor gt = G().alloc({B}, DType::I32), gp = G().alloc({B}, DType::F32);
  auto time_ms = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    G().synchronize();
    const int reps = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) fn();
    G().synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  const double gumbel = time_ms([&] { G().sample_rows(dlg, drows, false, gt, gp, Vv); });
  Tensor dlb = G().alloc({B, V}, DType::BF16);
  G().convert(dlg, dlb);
  const double gumbel16 = time_ms([&] { G().sample_rows(dlb, drows, false, gt, gp, Vv); });
  std::printf("sample_rows (Gumbel-max) on BF16 logits: %.3f ms (%.0f GB/s)\n", gumbel16,
              static_cast<double>(B) * V * 2 / gumbel16 / 1e6);
  const std::vector<float> temp(B, 1.0f), top_p(B, 1.0f), u(B, 0.5f);
  const std::vector<int> top_k(B, 0);
  const double icdf = time_ms([&] { G().sample(dlg, temp, top_p, top_k, u, gt, gp, Vv); });
  const double bytes = static_cast<double>(B) * V * sizeof(float);
  std::printf("sample_rows (Gumbel-max) B=%lld V=%lld: %.3f ms (%.0f GB/s of logits); sample (inverse CDF): %.3f ms\n",
              static_cast<long long>(B), static_cast<long long>(V), gumbel, bytes / gumbel / 1e6, icdf);
  EXPECT_GT(gumbel, 0.0);
}

}  // namespace
}  // namespace fp8rl
