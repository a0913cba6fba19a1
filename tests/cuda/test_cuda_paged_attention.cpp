// The paged decode/prefill attention kernel (src/backend/cuda/paged_attention.cu) against the CPU
// reference and the simple GPU kernel (FP8RL_CUDA_ATTENTION=simple): GQA ratios 1, 4, 8 (and 5,
// padded inside the kernel), head_dim 64 and 128, F32/BF16/E4M3 pools with per-head scales,
// fp8_attention on and off, long contexts (1500 positions, many splits), mixed prefill + decode
// batches (tokens of one sequence at several positions in one call), pages scattered over the
// pool, split counts chosen by the plan and forced (FP8RL_CUDA_PAGED_SPLITS).
// Tolerances: F32 q/out 1e-5 of the largest |output| (as test_cuda_ops.cpp) and 1e-4 per
// (token, head) row relative to that row's largest |output| (long contexts give small rows, a
// wrong merge shows there); BF16 q/out 1e-2 against the CPU on the same BF16-rounded q.
// Every output is poisoned (NaN) before the call, so an unwritten row fails. Every variant of the
// tensor-core kernel (cuda::paged_attention_mma_variants(), FP8RL_PAGED_VARIANT) runs wherever
// the tensor-core kernel does, each against the CPU with the same tolerances.
// The decode shapes of issue 14 (Qwen3-1.7B and Llama-3.1-8B heads, 256 sequences of 80..700
// positions and 16 of 4096, BF16 / E4M3 pools): the tensor-core kernel against the CPU
// (DecodeShapesMatchCpu), and, with FP8RL_PAGED_BENCH=1, the timing of the tiled and the
// tensor-core kernel there, one row per variant (DecodeBench: us per call and GB/s of K/V read; a
// table on stdout and, with FP8RL_PAGED_BENCH_JSON=FILE, the rows as JSON; the default variant's
// kernel is "mma", the others "mma:" + the variant's name).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "core/rng.h"
#include "support/cuda_timing.h"

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
// (1 and 7), the tiled and grouped paged kernels (plan and 7 splits) and the simple kernel; all
// against the CPU reference. "auto" / "1" / "7" run the tensor-core kernel for BF16 q over BF16 /
// E4M3 pools (every variant) and the tiled one otherwise.
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
      // "auto" / "1" / "7" run the tensor-core kernel here (each variant)
      const bool mma_case = qdt == DType::BF16 && s.pool != DType::F32;
      for (const char* mode : {"auto", "1", "7", "tiled", "tiled7", "grouped", "grouped7", "simple"})
        for (int v = 0; v < cuda::paged_attention_mma_variants(); ++v) {
          const std::string md = mode;
          const bool simple = md == "simple", grouped = md.rfind("grouped", 0) == 0, tiled = md.rfind("tiled", 0) == 0;
          if (v > 0 && (simple || grouped || tiled || !mma_case)) continue;  // variants of the tensor-core kernel only
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(s.pool) << " pool, hd " << s.hd << ", Hq " << s.Hq << ", Hkv " << s.Hkv << ", q "
                       << dtype_name(qdt) << ", fp8_attention " << fp8q << ", splits " << mode << ", variant "
                       << cuda::paged_attention_mma_variant_name(v));
          const char* splits = md == "1" || md == "7" ? mode : md == "grouped7" || md == "tiled7" ? "7" : nullptr;
          EnvSwitch e1("FP8RL_CUDA_ATTENTION", simple ? "simple" : grouped ? "grouped" : tiled ? "tiled" : nullptr);
          EnvSwitch e2("FP8RL_CUDA_PAGED_SPLITS", splits);
          const std::string vs = std::to_string(v);
          EnvSwitch e3("FP8RL_PAGED_VARIANT", vs.c_str());
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

// ---- issue 14's decode shapes -------------------------------------------------------------

// A cache of two layers whose pools hold random values (written as raw BF16 / E4M3 codes: no
// kv_write, which the tests above check, so 100k-position caches build in seconds), sequences of
// the given lengths on shuffled pages of 16, one decode token per sequence at its last position,
// on the GPU and (with_cpu) the same bytes in a CPU cache, whose batch hb holds only every
// `cpu_every`-th token (cpu_rows: their rows in the GPU output). Both layers differ.
struct Big {
  KvCache hc, gc;
  PagedBatch hb, db;
  int64_t T = 0, positions = 0;  // tokens; positions attended in all (sum of pos + 1)
  std::vector<int> cpu_rows;
};
Big build_big(const std::vector<int>& lens, int Hkv, int hd, DType pool, uint32_t seed, bool with_cpu,
              int cpu_every = 1) {
  Big b;
  const int B = static_cast<int>(lens.size()), L = 2, ps = 16;
  int max_pages = 1, used = 0, max_pos = 0;
  for (int n : lens) {
    max_pages = std::max(max_pages, (n + ps - 1) / ps);
    used += (n + ps - 1) / ps;
    max_pos = std::max(max_pos, n);
    b.positions += n;
  }
  const int pages = used + 3;
  std::vector<int32_t> perm(pages);
  for (int i = 0; i < pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
  std::vector<int32_t> table(static_cast<size_t>(B) * max_pages, -1), seq(B), pos(B);
  for (int q = 0, k = 0; q < B; ++q) {
    for (int p = 0; p < (lens[q] + ps - 1) / ps; ++p) table[q * max_pages + p] = perm[k++];
    seq[q] = q;
    pos[q] = lens[q] - 1;
  }
  b.gc = G().alloc_kv_cache(L, pages, ps, Hkv, hd, pool);
  if (with_cpu) b.hc = C().alloc_kv_cache(L, pages, ps, Hkv, hd, pool);
  SplitMix64 rng(kSplitMix64Gamma ^ seed);
  auto next = [&rng]() { return rng.next(); };
  for (int l = 0; l < L; ++l)
    for (int which = 0; which < 2; ++which) {
      Tensor h = Tensor::empty({pages, ps, Hkv, hd}, pool);
      const int64_t n = h.numel();
      if (pool == DType::E4M3) {
        uint8_t* d = static_cast<uint8_t*>(h.raw());
        for (int64_t i = 0; i < n; i += 8) {
          const uint64_t r = next();
          for (int j = 0; j < 8 && i + j < n; ++j) {
            uint8_t c = static_cast<uint8_t>(r >> (8 * j));
            if ((c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
            d[i + j] = c;
          }
        }
      } else {  // BF16: random sign and mantissa, |x| in [2^-6, 4): 8 exponents, 4 values per draw
        uint16_t* d = static_cast<uint16_t*>(h.raw());
        for (int64_t i = 0; i < n; i += 4) {
          const uint64_t r = next();
          for (int j = 0; j < 4 && i + j < n; ++j) {
            const uint32_t u = static_cast<uint32_t>(r >> (16 * j)) & 0xffffu;
            d[i + j] = static_cast<uint16_t>((u & 0x807fu) | ((121u + ((u >> 7) & 7u)) << 7));
          }
        }
      }
      G().copy(h, which ? b.gc.v[l] : b.gc.k[l]);
      if (with_cpu) C().copy(h, which ? b.hc.v[l] : b.hc.k[l]);
    }
  Tensor ks = Tensor::empty({L, Hkv}, DType::F32), vs = Tensor::empty({L, Hkv}, DType::F32);
  for (int64_t i = 0; i < L * Hkv; ++i) {  // E4M3 codes span +-448: scores of a few units
    ks.data<float>()[i] = 0.004f + 0.0005f * static_cast<float>(i % 5);
    vs.data<float>()[i] = 0.01f + 0.002f * static_cast<float>(i % 3);
  }
  G().copy(ks, b.gc.k_scale);
  G().copy(vs, b.gc.v_scale);
  if (with_cpu) C().copy(ks, b.hc.k_scale), C().copy(vs, b.hc.v_scale);
  b.T = B;
  const Tensor ts = i32(seq, {B}), tp = i32(pos, {B}), tt = i32(table, {B, max_pages});
  b.db = PagedBatch{G().to_device(ts), G().to_device(tp), Tensor(), G().to_device(tt), max_pos};
  std::vector<int32_t> hs, hp;
  for (int q = 0; q < B; q += cpu_every) hs.push_back(q), hp.push_back(pos[q]), b.cpu_rows.push_back(q);
  const int64_t Th = static_cast<int64_t>(hs.size());
  b.hb = PagedBatch{i32(hs, {Th}), i32(hp, {Th}), Tensor(), tt, max_pos};
  return b;
}

std::vector<int> uniform_lens(int B, int lo, int hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<int> v(B);
  for (int& x : v) x = d(gen);
  return v;
}

struct DecodeShape {
  const char* name;
  int Hq, Hkv, hd, B, lo, hi;
};
const DecodeShape kDecodeShapes[] = {
    {"qwen3-1.7b B256 ctx 80..700", 16, 8, 128, 256, 80, 700},
    {"qwen3-1.7b B16 ctx 4096", 16, 8, 128, 16, 4096, 4096},
    {"llama-3.1-8b B256 ctx 80..700", 32, 8, 128, 256, 80, 700},
    {"llama-3.1-8b B16 ctx 4096", 32, 8, 128, 16, 4096, 4096},
};
// DecodeBench only: the first shape's bytes and CTAs with one KV head per sequence, each of the 8
// heads as its own sequence, so a CTA's page of 16 positions is one contiguous run (2 KB E4M3, 4 KB
// BF16) instead of 16 rows 1 KB (2 KB) apart: what a head-major page layout would give the kernel.
const DecodeShape kDecodeBenchShapes[] = {
    {"qwen3-1.7b B256, a head a seq", 2, 1, 128, 2048, 80, 700},
};

TEST(CudaPagedAttention, DecodeShapesMatchCpu) {
  // The tensor-core kernel (default mode) at the benchmark's shapes, BF16 q, both layers,
  // fp8_attention off and (E4M3 pools) on, against the CPU reference; the tiled kernel at the
  // same inputs as the scale of the BF16 class.
  uint32_t seed = 900;
  for (const DecodeShape& sh : kDecodeShapes)
    for (DType pool : {DType::BF16, DType::E4M3}) {
      // The CPU reference on every 4th sequence of the 256 (all 16 of the long ones).
      Big b = build_big(uniform_lens(sh.B, sh.lo, sh.hi, seed), sh.Hkv, sh.hd, pool, seed, true, sh.B > 64 ? 4 : 1);
      const int64_t Th = static_cast<int64_t>(b.cpu_rows.size());
      const float sc = 1.0f / std::sqrt(static_cast<float>(sh.hd));
      for (int layer : {0, 1})
        for (bool fp8q : {false, true}) {
          if (fp8q && (pool != DType::E4M3 || layer == 0)) continue;
          const Tensor q32 = rnd({b.T, sh.Hq, sh.hd}, seed + 7 + layer);
          const Tensor q = from_float_vector(to_float_vector(q32), q32.shape(), DType::BF16);
          const std::vector<float> qv = to_float_vector(q);
          std::vector<float> qsub;  // the CPU batch's rows of q
          const size_t rowlen = static_cast<size_t>(sh.Hq) * sh.hd;
          for (int r : b.cpu_rows) qsub.insert(qsub.end(), qv.begin() + r * rowlen, qv.begin() + (r + 1) * rowlen);
          const Tensor qh = from_float_vector(qsub, {Th, sh.Hq, sh.hd}, DType::F32);
          Tensor ro = Tensor::empty(qh.shape(), DType::F32);
          C().attention_paged(b.hc, layer, qh, b.hb, sc, fp8q, ro);
          const std::vector<float> ref = host_floats(ro);
          const Tensor qd = G().to_device(q);
          // "mma-short": max_pos understated (100) with 3 forced splits, so the last split runs
          // far past its chunk (as a stale plan would).
          for (const char* mode : {"mma", "mma-short", "tiled"})
            for (int v = 0; v < cuda::paged_attention_mma_variants(); ++v) {
              const std::string md = mode;
              if (md == "mma-short" && layer == 1) continue;
              if (md == "tiled" && v > 0) continue;
              SCOPED_TRACE(::testing::Message()
                           << sh.name << ", " << dtype_name(pool) << " pool, layer " << layer << ", fp8_attention "
                           << fp8q << ", kernel " << mode << ", variant " << cuda::paged_attention_mma_variant_name(v));
              EnvSwitch e1("FP8RL_CUDA_ATTENTION", md == "tiled" ? "tiled" : nullptr);
              EnvSwitch e2("FP8RL_CUDA_PAGED_SPLITS", md == "mma-short" ? "3" : nullptr);
              const std::string vs = std::to_string(v);
              EnvSwitch e3("FP8RL_PAGED_VARIANT", vs.c_str());
              PagedBatch db = b.db;
              if (md == "mma-short") db.max_pos = 100;
              Tensor go = G().alloc(q.shape(), DType::BF16);
              G().fill(go, NAN);
              G().attention_paged(b.gc, layer, qd, db, sc, fp8q, go);
              const std::vector<float> all = host_floats(go);
              std::vector<float> got;
              for (int r : b.cpu_rows) got.insert(got.end(), all.begin() + r * rowlen, all.begin() + (r + 1) * rowlen);
              for (float x : all) ASSERT_TRUE(std::isfinite(x)) << "an output row was not written";
              const Err e = compare(got, ref, sh.hd);
              std::printf("  %-30s %-4s layer %d fp8q %d %-9s %-10s: err global %.2e row %.2e\n", sh.name,
                          dtype_name(pool), layer, int(fp8q), mode,
                          md == "tiled" ? "" : cuda::paged_attention_mma_variant_name(v), e.global, e.row);
              EXPECT_LT(e.global, 1e-2);
              EXPECT_LT(e.row, 2e-2);
            }
        }
      ++seed;
    }
}

TEST(CudaPagedAttention, DecodeBench) {
  const char* on = std::getenv("FP8RL_PAGED_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "timing mode: FP8RL_PAGED_BENCH=1";
  int sm = 0, dev = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // The card's nominal HBM bandwidth: the H100 SXM's 3.35 TB/s, else the H200's 4.8 (the bench's
  // target card); FP8RL_PEAK_BW overrides.
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, dev), cudaSuccess);
  double peak = std::string(prop.name).find("H100") != std::string::npos ? 3.35e12 : 4.8e12;
  if (const char* e = std::getenv("FP8RL_PEAK_BW")) peak = std::atof(e);
  std::printf("%s: %% of %.2f TB/s\n", prop.name, peak / 1e12);
  std::string json = "[\n";
  for (int v = 0; v < cuda::paged_attention_mma_variants(); ++v)
    std::printf("variant %d %-12s CTAs per SM at hd 128: BF16 %d, E4M3 %d\n", v,
                cuda::paged_attention_mma_variant_name(v), cuda::paged_attention_mma_blocks_per_sm(128, DType::BF16, v),
                cuda::paged_attention_mma_blocks_per_sm(128, DType::E4M3, v));
  std::printf("\n%-30s %-5s %-14s %7s %9s %8s %6s %8s\n", "shape", "pool", "kernel", "splits", "us/call", "GB/s",
              "%peak", "speedup");
  // For a profiler (gpu_bench.sh ncu_paged_src): FP8RL_PAGED_BENCH_POOL=bf16|e4m3 times that pool
  // only, FP8RL_PAGED_BENCH_DEFAULT=1 the default variant only, so the first tensor-core launch is
  // the kernel wanted.
  const char* only_pool = std::getenv("FP8RL_PAGED_BENCH_POOL");
  const bool only_default = std::getenv("FP8RL_PAGED_BENCH_DEFAULT") != nullptr;
  uint32_t seed = 1900;
  std::vector<DecodeShape> shapes(std::begin(kDecodeShapes), std::end(kDecodeShapes));
  shapes.insert(shapes.end(), std::begin(kDecodeBenchShapes), std::end(kDecodeBenchShapes));
  for (const DecodeShape& sh : shapes)
    for (DType pool : {DType::BF16, DType::E4M3}) {
      ++seed;
      if (only_pool && std::string(only_pool) != (pool == DType::E4M3 ? "e4m3" : "bf16")) continue;
      Big b = build_big(uniform_lens(sh.B, sh.lo, sh.hi, seed), sh.Hkv, sh.hd, pool, seed, false);
      const Tensor q = G().to_device(
          from_float_vector(to_float_vector(rnd({b.T, sh.Hq, sh.hd}, seed)), {b.T, sh.Hq, sh.hd}, DType::BF16));
      Tensor out = G().alloc(q.shape(), DType::BF16);
      const bool e4m3 = pool == DType::E4M3;
      const double bytes = double(b.positions) * sh.Hkv * sh.hd * 2 * (e4m3 ? 1 : 2);  // K and V read
      const float sc = 1.0f / std::sqrt(static_cast<float>(sh.hd));
      const int max_pages = static_cast<int>(b.db.page_table.dim(1));
      double base_us = 0;
      auto report = [&](const std::string& kname, const cuda::PagedSplit& plan, double us) {
        const double gbs = bytes / (us * 1e-6) / 1e9;
        std::printf("%-30s %-5s %-14s %7d %9.1f %8.0f %5.0f%% %7.2fx\n", sh.name, dtype_name(pool), kname.c_str(),
                    plan.splits, us, gbs, 100.0 * gbs * 1e9 / peak, base_us / us);
        char row[512];
        std::snprintf(row, sizeof row,
                      "  {\"shape\": \"%s\", \"pool\": \"%s\", \"kernel\": \"%s\", \"splits\": %d, \"chunk\": %d, "
                      "\"us_per_call\": %.2f, \"gb_per_s\": %.1f, \"bytes\": %.0f},\n",
                      sh.name, dtype_name(pool), kname.c_str(), plan.splits, plan.chunk, us, gbs, bytes);
        json += row;
      };
      // The tiled kernel (v = -1), every variant of the tensor-core kernel at its own split plan,
      // then the default variant at 2 and 4 forced context splits (FP8RL_CUDA_PAGED_SPLITS; issue
      // 14's fixed per-call time: session 33 measured them slower at B = 256, as was a
      // longest-first CTA order).
      const int dv = cuda::paged_attention_mma_variant_env();
      std::vector<std::pair<int, int>> runs;  // (variant, forced splits)
      for (int v = -1; v < cuda::paged_attention_mma_variants(); ++v)
        if (!only_default || v == dv) runs.push_back({v, 0});
      runs.push_back({dv, 2});
      runs.push_back({dv, 4});
      for (const auto& [v, forced] : runs) {
        const bool mma = v >= 0;
        const std::string kname = !mma      ? "tiled"
                                  : forced  ? "mma split" + std::to_string(forced)
                                  : v == dv ? "mma"
                                            : std::string("mma:") + cuda::paged_attention_mma_variant_name(v);
        const cuda::PagedSplit plan =
            mma ? cuda::paged_attention_mma_split(b.T, sh.Hkv, sh.hd, pool, b.db.max_pos, sm, forced, v)
                : cuda::paged_attention_split(b.T, sh.Hkv, b.db.max_pos, sm, 0);
        Tensor part = G().alloc({std::max<int64_t>(b.T * sh.Hq * plan.splits * (sh.hd + 1), 1)}, DType::F32);
        float* po = part.data<float>();
        float* pl = po + b.T * sh.Hq * plan.splits * sh.hd;
        G().synchronize();
        auto call = [&](int layer) {
          const float* ks = e4m3 ? b.gc.k_scale.data<float>() + layer * sh.Hkv : nullptr;
          const float* vs = e4m3 ? b.gc.v_scale.data<float>() + layer * sh.Hkv : nullptr;
          const auto* seqp = b.db.token_seq.data<int32_t>();
          const auto* posp = b.db.token_pos.data<int32_t>();
          const auto* tab = b.db.page_table.data<int32_t>();
          if (mma)
            cuda::launch_paged_attention_mma(q.raw(), DType::BF16, seqp, posp, tab, max_pages, b.T, sh.Hq, sh.Hkv,
                                             sh.hd, 16, b.gc.k[layer].raw(), b.gc.v[layer].raw(), pool, ks, vs, sc,
                                             false, plan, po, pl, out.raw(), stream, v);
          else
            cuda::launch_paged_attention(q.raw(), DType::BF16, seqp, posp, tab, max_pages, b.T, sh.Hq, sh.Hkv, sh.hd,
                                         16, b.gc.k[layer].raw(), b.gc.v[layer].raw(), pool, ks, vs, sc, false, plan,
                                         po, pl, out.raw(), stream, false);
        };
        const double us = test::time_calls(call, stream);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        if (!mma) base_us = us;
        report(kname, plan, us);
      }
      // The consistent mode's flash-order decode (PagedBatch::flash_order): one warp per (token, KV
      // head) over all its tiles in flash attention's order, no context split.
      if (!only_default && cuda::flash_decode_supported(sh.hd, sh.Hq / sh.Hkv, pool, DType::BF16)) {
        auto call = [&](int layer) {
          const float* ks = e4m3 ? b.gc.k_scale.data<float>() + layer * sh.Hkv : nullptr;
          const float* vs = e4m3 ? b.gc.v_scale.data<float>() + layer * sh.Hkv : nullptr;
          cuda::launch_flash_decode(q.raw(), b.db.token_seq.data<int32_t>(), b.db.token_pos.data<int32_t>(),
                                    b.db.page_table.data<int32_t>(), max_pages, b.T, sh.Hq, sh.Hkv, sh.hd, 16,
                                    b.gc.k[layer].raw(), b.gc.v[layer].raw(), pool, ks, vs, sc, out.raw(), stream);
        };
        const double us = test::time_calls(call, stream);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        cuda::PagedSplit one;
        one.chunk = 0;  // no split plan
        report("flash-order", one, us);
      }
    }
  cudaStreamDestroy(stream);
  if (json.size() > 2) json.erase(json.size() - 2, 1);  // the last comma
  json += "]\n";
  if (const char* path = std::getenv("FP8RL_PAGED_BENCH_JSON")) std::ofstream(path) << json;
}

}  // namespace
}  // namespace fp8rl
