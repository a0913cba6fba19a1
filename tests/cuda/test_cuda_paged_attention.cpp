// The paged decode/prefill attention kernel (src/backend/cuda/paged_attention.cu) against the CPU
// reference and the simple GPU kernel (FP8RL_CUDA_ATTENTION=simple): GQA ratios 1, 4, 8 (and 5,
// padded inside the kernel), head_dim 64 and 128, F32/BF16/E4M3 pools with per-head scales,
// fp8_attention on and off, long contexts (1500 positions, many splits), mixed prefill + decode
// batches (tokens of one sequence at several positions in one call), pages scattered over the
// pool, split counts chosen by the plan and forced (FP8RL_CUDA_PAGED_SPLITS).
// Tolerances: F32 q/out 1e-5 of the largest |output| (as test_cuda_ops.cpp) and 1e-4 per
// (token, head) row relative to that row's largest |output| (long contexts give small rows, a
// wrong merge shows there); BF16 q/out 1e-2 against the CPU on the same BF16-rounded q.
// Every output is poisoned (NaN) before the call, so an unwritten row fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

namespace fp8rl {
namespace {

Backend& G() {
  static std::unique_ptr<Backend> b = make_cuda_backend(0);
  return *b;
}
Backend& C() {
  static std::unique_ptr<Backend> b = make_cpu_backend();
  return *b;
}

Tensor rnd(const Shape& shape, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) x = nd(gen);
  return from_float_vector(v, shape, DType::F32);
}
Tensor i32(const std::vector<int32_t>& v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::I32);
  std::memcpy(t.raw(), v.data(), v.size() * 4);
  return t;
}
std::vector<float> host_floats(const Tensor& t) {
  return to_float_vector(t.device() == DeviceKind::CUDA ? G().to_host(t) : t);
}

// Sets (or, with nullptr, clears) an environment switch for the scope; restores it after.
struct EnvSwitch {
  std::string name, old;
  bool had = false;
  EnvSwitch(const char* n, const char* value) : name(n) {
    if (const char* o = std::getenv(n)) had = true, old = o;
    if (value) setenv(n, value, 1);
    else unsetenv(n);
  }
  ~EnvSwitch() {
    if (had) setenv(name.c_str(), old.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

struct Scenario {
  int hd, Hq, Hkv, ps;
  DType pool;
  std::vector<int> lens;                    // cached length of each sequence
  std::vector<std::pair<int, int>> tokens;  // (sequence, position) of each query token
};

// The cache of both backends filled by kv_write (all positions of every sequence, pages
// shuffled over a pool with spare pages), and the query batch.
struct Built {
  KvCache hc, gc;
  PagedBatch hb, db;
  int64_t T = 0;
};
Built build(const Scenario& s, uint32_t seed) {
  Built b;
  const int B = static_cast<int>(s.lens.size()), L = 2, layer = 1;
  int max_pages = 1, used = 0;
  for (int n : s.lens) {
    max_pages = std::max(max_pages, (n + s.ps - 1) / s.ps);
    used += (n + s.ps - 1) / s.ps;
  }
  const int pages = used + 5;
  std::vector<int32_t> perm(pages);
  for (int i = 0; i < pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
  std::vector<int32_t> table(static_cast<size_t>(B) * max_pages, -1), wslots(static_cast<size_t>(pages) * s.ps);
  std::vector<char> used_slot(wslots.size(), 0);
  for (int q = 0, k = 0; q < B; ++q) {
    for (int p = 0; p < (s.lens[q] + s.ps - 1) / s.ps; ++p) table[q * max_pages + p] = perm[k++];
    for (int j = 0; j < s.lens[q]; ++j) used_slot[table[q * max_pages + j / s.ps] * s.ps + j % s.ps] = 1;
  }
  for (size_t i = 0; i < wslots.size(); ++i) wslots[i] = static_cast<int32_t>(i);
  b.hc = C().alloc_kv_cache(L, pages, s.ps, s.Hkv, s.hd, s.pool);
  b.gc = G().alloc_kv_cache(L, pages, s.ps, s.Hkv, s.hd, s.pool);
  Tensor ks = rnd({L, s.Hkv}, seed + 1), vs = rnd({L, s.Hkv}, seed + 2);
  for (int64_t i = 0; i < L * s.Hkv; ++i) {  // E4M3 scales ~ amax / 448 of the written values
    ks.data<float>()[i] = 0.005f + std::fabs(ks.data<float>()[i]) * 0.01f;
    vs.data<float>()[i] = 0.005f + std::fabs(vs.data<float>()[i]) * 0.01f;
  }
  C().copy(ks, b.hc.k_scale);
  C().copy(vs, b.hc.v_scale);
  G().copy(ks, b.gc.k_scale);
  G().copy(vs, b.gc.v_scale);
  // Every slot of the pool is written; slots outside the sequences (spare pages, page tails)
  // get values 4x larger, so reading one shows in the output.
  const int64_t W = static_cast<int64_t>(wslots.size()), row = int64_t(s.Hkv) * s.hd;
  Tensor k = rnd({W, s.Hkv, s.hd}, seed + 3, 1.5f), v = rnd({W, s.Hkv, s.hd}, seed + 4);
  for (int64_t i = 0; i < W; ++i)
    if (!used_slot[i])
      for (int64_t c = 0; c < row; ++c) k.data<float>()[i * row + c] *= 4.0f, v.data<float>()[i * row + c] *= 4.0f;
  const Tensor tw = i32(wslots, {W});
  PagedBatch wh{Tensor(), Tensor(), tw, Tensor(), 0}, wd{Tensor(), Tensor(), G().to_device(tw), Tensor(), 0};
  C().kv_write(b.hc, layer, k, v, wh);
  G().kv_write(b.gc, layer, G().to_device(k), G().to_device(v), wd);
  std::vector<int32_t> seq, pos;
  int max_pos = 0;
  for (auto [q, p] : s.tokens) {
    seq.push_back(q);
    pos.push_back(p);
    max_pos = std::max(max_pos, p + 1);
  }
  b.T = static_cast<int64_t>(seq.size());
  const Tensor ts = i32(seq, {b.T}), tp = i32(pos, {b.T}), tt = i32(table, {B, max_pages});
  b.hb = PagedBatch{ts, tp, Tensor(), tt, max_pos};
  b.db = PagedBatch{G().to_device(ts), G().to_device(tp), Tensor(), G().to_device(tt), max_pos};
  return b;
}

// Largest |a - r| over the largest |r|: globally, and the worst (token, head) row.
struct Err {
  double global = INFINITY, row = INFINITY;
};
Err compare(const std::vector<float>& a, const std::vector<float>& r, int hd) {
  Err e;
  double d = 0, m = 0, worst = 0;
  for (size_t i0 = 0; i0 < r.size(); i0 += hd) {
    double rd = 0, rm = 0;
    for (size_t i = i0; i < i0 + hd; ++i) {
      if (!std::isfinite(a[i])) return e;
      rd = std::max(rd, std::fabs(double(a[i]) - r[i]));
      rm = std::max(rm, std::fabs(double(r[i])));
    }
    d = std::max(d, rd);
    m = std::max(m, rm);
    worst = std::max(worst, rd / std::max(rm, 1e-30));
  }
  e.global = d / std::max(m, 1e-30);
  e.row = worst;
  return e;
}

// Runs the scenario with q F32 and BF16, fp8_attention off and on, splits by the plan and forced
// (1 and 7), the grouped paged kernel (plan and 7 splits) and the simple kernel; all against the
// CPU reference.
void check(const Scenario& s, uint32_t seed) {
  Built b = build(s, seed);
  const int layer = 1;
  const float sc = 1.0f / std::sqrt(static_cast<float>(s.hd));
  for (bool fp8q : {false, true})
    for (DType qdt : {DType::F32, DType::BF16}) {
      const Tensor q32 = rnd({b.T, s.Hq, s.hd}, seed + 10 + fp8q);
      const Tensor q = qdt == DType::F32 ? q32 : from_float_vector(to_float_vector(q32), q32.shape(), DType::BF16);
      const Tensor qh = from_float_vector(to_float_vector(q), q.shape(), DType::F32);  // the CPU input
      Tensor ro = Tensor::empty(q.shape(), DType::F32);
      C().attention_paged(b.hc, layer, qh, b.hb, sc, fp8q, ro);
      const std::vector<float> ref = host_floats(ro);
      const Tensor qd = G().to_device(q);
      for (const char* mode : {"auto", "1", "7", "grouped", "grouped7", "simple"}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(s.pool) << " pool, hd " << s.hd << ", Hq " << s.Hq << ", Hkv "
                                          << s.Hkv << ", q " << dtype_name(qdt) << ", fp8_attention " << fp8q
                                          << ", splits " << mode);
        const std::string md = mode;
        const bool simple = md == "simple", grouped = md.rfind("grouped", 0) == 0;
        const char* splits = md == "1" || md == "7" ? mode : md == "grouped7" ? "7" : nullptr;
        EnvSwitch e1("FP8RL_CUDA_ATTENTION", simple ? "simple" : grouped ? "grouped" : nullptr);
        EnvSwitch e2("FP8RL_CUDA_PAGED_SPLITS", splits);
        Tensor go = G().alloc(q.shape(), qdt);
        G().fill(go, NAN);
        G().attention_paged(b.gc, layer, qd, b.db, sc, fp8q, go);
        const Err e = compare(host_floats(go), ref, s.hd);
        if (qdt == DType::F32) {
          EXPECT_LT(e.global, 1e-5);
          EXPECT_LT(e.row, 1e-4);
        } else {
          EXPECT_LT(e.global, 1e-2);
          EXPECT_LT(e.row, 2e-2);
        }
      }
    }
}

TEST(CudaPagedAttention, GqaRatiosHeadDimsAndPools) {
  // Decode tokens plus a short prefill chunk; GQA 1, 4, 8 and 5; hd 64 and 128; three pools.
  for (int hd : {64, 128})
    for (auto [Hq, Hkv] : {std::pair{4, 4}, std::pair{16, 4}, std::pair{16, 2}, std::pair{10, 2}})
      for (DType pool : {DType::BF16, DType::E4M3, DType::F32}) {
        if (pool == DType::F32 && Hq != 16) continue;  // F32 pools: the two 16-head ratios suffice
        Scenario s{hd, Hq, Hkv, 16, pool, {1, 40, 131}, {}};
        s.tokens = {{0, 0}, {1, 39}, {2, 130}, {2, 100}, {2, 101}, {2, 102}, {1, 5}};
        check(s, static_cast<uint32_t>(hd + 7 * Hq + Hkv + static_cast<int>(pool)));
      }
}

TEST(CudaPagedAttention, LongContextsManySplits) {
  // One 1500-position decode (the plan splits it many ways), next to short sequences; odd page
  // size so chunks do not align with pages.
  for (DType pool : {DType::BF16, DType::E4M3}) {
    Scenario s{128, 32, 8, 16, pool, {1500, 7}, {{0, 1499}, {1, 6}}};
    check(s, 200 + static_cast<uint32_t>(pool));
    Scenario t{64, 16, 2, 5, pool, {1500}, {{0, 1499}, {0, 1000}, {0, 64}}};
    check(t, 300 + static_cast<uint32_t>(pool));
  }
}

TEST(CudaPagedAttention, MixedPrefillAndDecodeBatch) {
  // Llama-3.1-8B heads (32 / 8, hd 128): a prefill chunk of one sequence (positions 680..711),
  // the full prompt of another, decode steps of the rest; page size 1 makes the kernel stage
  // its page list several times for the 1300-position sequence.
  for (int ps : {16, 1}) {
    Scenario s{128, 32, 8, ps, DType::E4M3, {1300, 712, 24, 3}, {}};
    for (int p = 680; p < 712; ++p) s.tokens.push_back({1, p});
    for (int p = 0; p < 24; ++p) s.tokens.push_back({2, p});
    s.tokens.push_back({0, 1299});
    s.tokens.push_back({3, 2});
    check(s, 400 + static_cast<uint32_t>(ps));
  }
}

TEST(CudaPagedAttention, ManyTokensNoSplit) {
  // T * Hkv large enough that the plan keeps one split (the direct-output path), Llama-3.2-1B
  // heads (32 / 8, hd 64), BF16 pool.
  Scenario s{64, 32, 8, 16, DType::BF16, {}, {}};
  for (int q = 0; q < 80; ++q) {
    s.lens.push_back(100 + 7 * q);
    s.tokens.push_back({q, 99 + 7 * q});
  }
  check(s, 500);
}

}  // namespace
}  // namespace fp8rl
