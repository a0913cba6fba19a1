// The consistent mode on the GPU (precision.consistent; docs/design.md "The consistent mode"):
// the kernels it relies on are batch-invariant at real shapes — the BF16 / FP32 cuBLASLt GEMMs on
// one algorithm for every M, the own FP8 kernel at one split (with a fused producer's view in
// either scale layout), the paged attention with the position-fixed split plan — the generator's
// logp_gen op (logprobs_of_logits of its head's logits) is token_logprobs bit for bit, and, end
// to end, the generator's log-probs equal the trainer's scoring bit for bit (bf16 and fp8_e2e
// with its E4M3 KV cache; ragged batches, CUDA-graph decode steps, a sequence past one attention
// chunk), as on the CPU (tests/cpu/test_consistent.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "support/consistent_util.h"
#include "support/cuda_timing.h"
#include "support/random_tensor.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

Tensor rand_dev(Backend& be, const Shape& shape, uint32_t seed, DType dt, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  Tensor h = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = nd(rng) * ((i % 101) == 0 ? 8.0f : 1.0f);
  Tensor c = dt == DType::F32 ? h : from_float_vector(to_float_vector(h), shape, dt);
  return be.to_device(c);
}

// How many of `part`'s rows differ from rows [r0, ...) of `full` (host copies).
int64_t rows_differing(const Tensor& full, const Tensor& part, int64_t r0) {
  const size_t row = full.nbytes() / static_cast<size_t>(full.dim(0));
  int64_t n = 0;
  for (int64_t r = 0; r < part.dim(0); ++r)
    n += std::memcmp(static_cast<const char*>(full.raw()) + static_cast<size_t>(r0 + r) * row,
                     static_cast<const char*>(part.raw()) + static_cast<size_t>(r) * row, row) != 0;
  return n;
}

const std::vector<std::pair<int64_t, int64_t>> kParts = {{0, 1},   {5, 1},    {3, 7},   {16, 16},  {40, 33},
                                                         {64, 64}, {100, 96}, {0, 256}, {37, 512}, {1, 700}};

// BF16 and FP32 GEMMs with spec.consistent: rows computed inside products of 1 .. 701 rows are
// the same bits, at the shapes of the 1.7B model's lm_head chunks (4096 and the last 384 rows of
// 151936) and its linears; the usual heuristic path is timed by M and is reported, not asserted.
TEST(CudaConsistent, GemmRowsDoNotDependOnM) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t M = 701;
  struct Shape2 {
    int64_t N, K;
  };
  for (const Shape2 s : {Shape2{4096, 2048}, Shape2{384, 2048}, Shape2{2048, 2048}, Shape2{6144, 2048},
                         Shape2{2048, 6144}, Shape2{904, 256}}) {
    for (LinearMode mode : {LinearMode::BF16, LinearMode::FP32}) {
      const DType xt = mode == LinearMode::BF16 ? DType::BF16 : DType::F32;
      const Tensor x = rand_dev(be, {M, s.K}, 11, xt);
      LinearWeight W;
      W.w = rand_dev(be, {s.N, s.K}, 12, xt, 0.05f);
      for (DType odt : {DType::F32, DType::BF16}) {
        if (mode == LinearMode::FP32 && odt == DType::BF16) continue;
        for (bool consistent : {true, false}) {
          LinearSpec spec{mode, false};
          spec.consistent = consistent;
          Tensor full = be.alloc({M, s.N}, odt);
          be.linear(x, W, spec, full);
          const Tensor hf = be.to_host(full);
          int64_t differ = 0;
          for (auto [r0, m] : kParts) {
            Tensor part = be.alloc({m, s.N}, odt);
            be.linear(x.slice_rows(r0, r0 + m), W, spec, part);
            const int64_t d = rows_differing(hf, be.to_host(part), r0);
            differ += d;
            if (consistent) {
              EXPECT_EQ(d, 0) << linear_mode_name(mode) << " N=" << s.N << " K=" << s.K << " out " << dtype_name(odt)
                              << ": rows " << r0 << "+" << m << " differ inside M=" << m;
            }
          }
          if (!consistent)
            std::printf("  usual %s GEMM N=%lld K=%lld out %s: %lld rows differ across M (not asserted)\n",
                        linear_mode_name(mode), static_cast<long long>(s.N), static_cast<long long>(s.K),
                        dtype_name(odt), static_cast<long long>(differ));
        }
      }
    }
  }
}

// FP8 linears with spec.consistent run the own kernel at one split for every M (counted), and a
// row is the same bits whether the linear quantized its input, or took a fused producer's view
// with scales in cuBLASLt's layout (M % 16 == 0) or row-major (other M).
TEST(CudaConsistent, Fp8RowsDoNotDependOnMOrTheViewLayout) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t M = 701, K = 2048;  // kParts reaches row 700
  const Tensor x = rand_dev(be, {M, K}, 21, DType::BF16), wn = rand_dev(be, {K}, 22, DType::BF16, 0.3f);
  for (int64_t N : {2048, 6144, 384}) {
    LinearWeight W;
    W.wq = be.alloc_quant(N, K, 128, 128, false);
    be.quantize(rand_dev(be, {N, K}, 23, DType::F32, 0.05f), false, W.wq);
    LinearSpec spec{LinearMode::FP8_BLOCK, false};
    spec.consistent = true;
    Tensor xn = be.alloc({M, K}, DType::BF16), full = be.alloc({M, N}, DType::BF16);
    be.rmsnorm(x, wn, 1e-6f, xn, nullptr);
    const int64_t own0 = be.counters().fp8_gemm_own, lt0 = be.counters().fp8_gemm_lt_fixed;
    be.linear(xn, W, spec, full);
    // M = 701: the own kernel, or cuBLASLt's fixed algorithm where the probe found it the same bits
    EXPECT_EQ(be.counters().fp8_gemm_own + be.counters().fp8_gemm_lt_fixed, own0 + lt0 + 1)
        << "the consistent FP8 linear runs the own kernel or the probed cuBLASLt algorithm";
    std::printf("  N=%lld K=%lld: M=701 ran on %s\n", static_cast<long long>(N), static_cast<long long>(K),
                be.counters().fp8_gemm_lt_fixed > lt0 ? "cuBLASLt's fixed algorithm (probe: bitwise the own kernel)"
                                                      : "the own kernel");
    const Tensor hf = be.to_host(full);
    for (auto [r0, m] : kParts) {
      // The rows normed and quantized by the fused producer (its view) in a batch of m rows.
      Tensor xm = be.alloc({m, K}, DType::BF16), ym = be.alloc({m, N}, DType::BF16), yq = be.alloc({m, N}, DType::BF16);
      Fp8View view = be.alloc_fp8_view(m, K, false);
      be.rmsnorm_fp8(x.slice_rows(r0, r0 + m), wn, 1e-6f, xm, nullptr, view);
      be.linear(xm, W, spec, ym, &view);
      be.linear(xm, W, spec, yq);
      EXPECT_EQ(rows_differing(hf, be.to_host(ym), r0), 0)
          << "N=" << N << " rows " << r0 << "+" << m << " (view, scales " << (view.scales_gemm_layout ? "laid" : "rows")
          << ")";
      EXPECT_EQ(rows_differing(hf, be.to_host(yq), r0), 0) << "N=" << N << " rows " << r0 << "+" << m;
    }
  }
  EXPECT_EQ(be.counters().fp8_gemm_fallbacks, 0);
}

// GemmEngine::set_fp8_row_invariant (FP8RL_FP8_ROW_INVARIANT=1): cuBLASLt's block-scaled FP8
// products on one algorithm per (N, K) for every M, at the 1.7B model's linears (q|k|v 4096,
// o 2048, gate|up 12288, down K = 6144) and a 384-wide one: every row the same bits at M = 701
// (its last 13 rows the padded tail product) and inside each part of kParts. Printed, not
// asserted: how many rows the usual per-M heuristic computes differently across the same parts,
// and how many rows of the row-invariant product differ from the own kernel's at one split (the
// consistent mode's), i.e. whether the consistent mode could use cuBLASLt.
TEST(CudaConsistent, Fp8CublasLtRowInvariantRows) {
  cuda::CudaBackend be(0, DType::BF16);
  const int64_t M = 701;
  struct Shape2 {
    int64_t N, K;
  };
  for (const Shape2 s :
       {Shape2{4096, 2048}, Shape2{2048, 2048}, Shape2{12288, 2048}, Shape2{2048, 6144}, Shape2{384, 2048}}) {
    const Tensor x = rand_dev(be, {M, s.K}, 31, DType::BF16);
    LinearWeight W;
    W.wq = be.alloc_quant(s.N, s.K, 128, 128, false);
    be.quantize(rand_dev(be, {s.N, s.K}, 32, DType::F32, 0.05f), false, W.wq);
    const LinearSpec spec{LinearMode::FP8_BLOCK, false};
    int64_t usual_differ = 0;
    for (bool invariant : {true, false}) {
      be.gemm().set_fp8_row_invariant(invariant);
      Tensor full = be.alloc({M, s.N}, DType::BF16);
      be.linear(x, W, spec, full);
      const Tensor hf = be.to_host(full);
      for (auto [r0, m] : kParts) {
        Tensor part = be.alloc({m, s.N}, DType::BF16);
        be.linear(x.slice_rows(r0, r0 + m), W, spec, part);
        const int64_t d = rows_differing(hf, be.to_host(part), r0);
        if (invariant)
          EXPECT_EQ(d, 0) << "N=" << s.N << " K=" << s.K << ": rows " << r0 << "+" << m << " differ inside M=" << m;
        else usual_differ += d;
      }
      if (invariant && s.N > 1024) {  // the first 1024 output columns as a product of their own
        LinearWeight first;
        first.wq = W.wq;
        first.wq.data = W.wq.data.slice_rows(0, 1024);
        first.wq.scales = W.wq.scales.slice_rows(0, 1024 / 128);
        Tensor narrow = be.alloc({M, 1024}, DType::BF16);
        be.linear(x, first, spec, narrow);
        const Tensor hn = be.to_host(narrow);
        int64_t cols_differ = 0;
        for (int64_t r = 0; r < M; ++r)
          cols_differ += std::memcmp(static_cast<const char*>(hf.raw()) + static_cast<size_t>(r * s.N) * 2,
                                     static_cast<const char*>(hn.raw()) + static_cast<size_t>(r * 1024) * 2, 2048) != 0;
        std::printf(
            "  N=%lld K=%lld: row-invariant cuBLASLt, its first 1024 columns as a product of N = 1024: "
            "%lld of %lld rows differ\n",
            static_cast<long long>(s.N), static_cast<long long>(s.K), static_cast<long long>(cols_differ),
            static_cast<long long>(M));
      }
      if (invariant) {  // against the own kernel at one split, on the same quantized operands
        LinearSpec own = spec;
        own.consistent = true;
        Tensor o = be.alloc({M, s.N}, DType::BF16);
        be.linear(x, W, own, o);
        std::printf("  N=%lld K=%lld: row-invariant cuBLASLt vs own kernel at one split: %lld of %lld rows differ\n",
                    static_cast<long long>(s.N), static_cast<long long>(s.K),
                    static_cast<long long>(rows_differing(hf, be.to_host(o), 0)), static_cast<long long>(M));
      }
    }
    std::printf("  N=%lld K=%lld: the usual per-M cuBLASLt FP8 heuristic: %lld rows differ across M (not asserted)\n",
                static_cast<long long>(s.N), static_cast<long long>(s.K), static_cast<long long>(usual_differ));
  }
  be.gemm().set_fp8_row_invariant(false);
  EXPECT_EQ(be.counters().fp8_gemm_fallbacks, 0);
}

// Sequences of `lens` tokens cached whole from position 0 in pages of ps positions (each
// sequence's pages in a run of its own): every token a query, its slot, and the page table
// [lens.size(), width] of the longest sequence's page count.
struct WholeSequences {
  std::vector<int32_t> seq, pos, slots, table;
  int pages = 0, width = 0;
};
WholeSequences whole_sequences(const std::vector<int32_t>& lens, int ps) {
  WholeSequences w;
  for (int32_t n : lens) w.width = std::max(w.width, (n + ps - 1) / ps);
  for (int b = 0; b < static_cast<int>(lens.size()); ++b) {
    const int np = (lens[b] + ps - 1) / ps;
    for (int p = 0; p < w.width; ++p) w.table.push_back(p < np ? w.pages + p : 0);
    for (int p = 0; p < lens[b]; ++p) {
      w.seq.push_back(b);
      w.pos.push_back(p);
      w.slots.push_back((w.pages + p / ps) * ps + p % ps);
    }
    w.pages += np;
  }
  return w;
}

// Paged attention with batch_invariant at the 1.7B model's heads (16 / 8, head_dim 128) over
// BF16 and E4M3 pools: each token's output in a prefill-sized batch (every position of three
// sequences of 1500, 700 and 30 tokens), in a decode batch of their last tokens and in a mixed
// batch is the same bits; the lse matches attention()'s convention (the CPU's, within 1e-5).
TEST(CudaConsistent, PagedAttentionDoesNotDependOnTheBatch) {
  cuda::CudaBackend be(0, DType::BF16);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const int Hq = 16, Hkv = 8, hd = 128, ps = 16;
  const std::vector<int32_t> lens = {1500, 700, 30};
  const WholeSequences ws = whole_sequences(lens, ps);
  const int width = ws.width, pages = ws.pages;
  const std::vector<int32_t>&seq = ws.seq, &pos = ws.pos, &slots = ws.slots, &table = ws.table;
  const int64_t T = static_cast<int64_t>(seq.size());
  const Tensor k = rand_dev(be, {T, Hkv, hd}, 31, DType::BF16), v = rand_dev(be, {T, Hkv, hd}, 32, DType::BF16);
  const Tensor q = rand_dev(be, {T, Hq, hd}, 33, DType::BF16, 0.3f);
  for (DType pool : {DType::BF16, DType::E4M3}) {
    KvCache c = be.alloc_kv_cache(1, pages, ps, Hkv, hd, pool);
    if (pool == DType::E4M3) {
      std::vector<float> s(Hkv, 0.01f);
      be.copy(from_float_vector(s, {1, Hkv}), c.k_scale);
      be.copy(from_float_vector(std::vector<float>(Hkv, 0.012f), {1, Hkv}), c.v_scale);
    }
    PagedBatch all{be.to_device(test::i32_tensor(seq)), be.to_device(test::i32_tensor(pos)),
                   be.to_device(test::i32_tensor(slots)), be.to_device(test::i32_tensor(table)).reshape({3, width}),
                   1500};
    all.batch_invariant = true;
    be.kv_write(c, 0, k, v, all);
    Tensor out = be.alloc({T, Hq, hd}, DType::BF16), lse = be.alloc({Hq, T}, DType::F32);
    be.attention_paged(c, 0, q, all, 0.088f, false, out, &lse);
    const Tensor ho = be.to_host(out);
    // Sub-batches: the last tokens (decode), and a mix of positions of every sequence.
    for (const std::vector<int32_t>& pick : {std::vector<int32_t>{1499, 1500 + 699, 2200 + 29},
                                             std::vector<int32_t>{3, 511, 512, 513, 1024, 1499, 1500, 2012, 2201}}) {
      std::vector<int32_t> s2, p2, sl2;
      for (int32_t i : pick) s2.push_back(seq[i]), p2.push_back(pos[i]), sl2.push_back(slots[i]);
      const int64_t n = static_cast<int64_t>(pick.size());
      PagedBatch sub{be.to_device(test::i32_tensor(s2)), be.to_device(test::i32_tensor(p2)),
                     be.to_device(test::i32_tensor(sl2)), all.page_table, 1500 + 600};
      sub.batch_invariant = true;
      Tensor qs = be.alloc({n, Hq * hd}, DType::BF16), os = be.alloc({n, Hq, hd}, DType::BF16);
      be.embedding(be.to_device(test::i32_tensor(pick)), q.reshape({T, Hq * hd}), qs);
      be.attention_paged(c, 0, qs.reshape({n, Hq, hd}), sub, 0.088f, false, os);
      const Tensor hs = be.to_host(os);
      const size_t row = static_cast<size_t>(Hq * hd) * 2;
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(std::memcmp(static_cast<const char*>(ho.raw()) + static_cast<size_t>(pick[i]) * row,
                              static_cast<const char*>(hs.raw()) + static_cast<size_t>(i) * row, row),
                  0)
            << dtype_name(pool) << " pool: token at position " << p2[i] << " of sequence " << s2[i]
            << " depends on the batch";
    }
    // The lse against the CPU reference on the same cache contents.
    KvCache cc = cpu->alloc_kv_cache(1, pages, ps, Hkv, hd, pool);
    cpu->copy(be.to_host(c.k[0]), cc.k[0]);
    cpu->copy(be.to_host(c.v[0]), cc.v[0]);
    cpu->copy(be.to_host(c.k_scale), cc.k_scale);
    cpu->copy(be.to_host(c.v_scale), cc.v_scale);
    PagedBatch hb{test::i32_tensor(seq), test::i32_tensor(pos), test::i32_tensor(slots),
                  test::i32_tensor(table).reshape({3, width}), 1500};
    Tensor qc = from_float_vector(to_float_vector(be.to_host(q)), {T, Hq, hd});
    Tensor oc = cpu->alloc({T, Hq, hd}, DType::F32), lc = cpu->alloc({Hq, T}, DType::F32);
    cpu->attention_paged(cc, 0, qc, hb, 0.088f, false, oc, &lc);
    EXPECT_LT(test::rel_err(be.to_host(lse), lc), 1e-5) << dtype_name(pool);
    EXPECT_LT(test::rel_err(ho, oc), 2e-2) << dtype_name(pool);
  }
}

// The consistent scoring's query runs (PagedBatch::query_runs: up to 8 / group consecutive tokens
// of a sequence per CTA, one block of MMA columns, or 16 / group, two blocks, or 64 / group, the
// wide CTAs of eight blocks, their K/V read once for all): every token's output and lse are the
// same bits as
// with one CTA per token, at group 1, 2 (the 1.7B heads), 4 and 8, over BF16 and E4M3 pools, for
// sequences scored whole across the 1024-position chunk end (kPagedInvariantChunk), with keys growing along the
// positions (the running max moves: the lazy rescale's per-token vote).
TEST(CudaConsistent, PagedAttentionQueryRunsAreBitwiseOneTokenCtas) {
  cuda::CudaBackend be(0, DType::BF16);
  const int hd = 128, ps = 16, Hkv = 4;
  const std::vector<int32_t> lens = {1100, 37, 520, 1};
  const WholeSequences ws = whole_sequences(lens, ps);
  const int width = ws.width, pages = ws.pages;
  const std::vector<int32_t>&seq = ws.seq, &pos = ws.pos, &slots = ws.slots, &table = ws.table;
  const int64_t T = static_cast<int64_t>(seq.size());
  // Keys scaled by 1 + position / 200: later positions tend to raise the running max.
  Tensor kh = be.to_host(rand_dev(be, {T, Hkv, hd}, 41, DType::F32));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < Hkv * hd; ++i)
      kh.data<float>()[t * Hkv * hd + i] *= 1.0f + static_cast<float>(pos[t]) / 200.0f;
  const Tensor k = be.to_device(from_float_vector(to_float_vector(kh), {T, Hkv, hd}, DType::BF16));
  const Tensor v = rand_dev(be, {T, Hkv, hd}, 42, DType::BF16);
  // cols -64: the wide runs on CTAs of 4 warps (FP8RL_WIDE_CTA_WARPS=4, two CTAs per run).
  for (int group : {1, 2, 4, 8})
    for (int cols_arg : {8, 16, 64, -64}) {
      const int cols = cols_arg < 0 ? -cols_arg : cols_arg;
      setenv("FP8RL_WIDE_CTA_WARPS", cols_arg < 0 ? "4" : "8", 1);
      const int Hq = Hkv * group, run = cols / group;
      const Tensor q = rand_dev(be, {T, Hq, hd}, 43 + group, DType::BF16, 0.3f);
      std::vector<int32_t> runs;
      for (int b = 0, t0 = 0; b < static_cast<int>(lens.size()); t0 += lens[b], ++b)
        for (int t = t0; t < t0 + lens[b]; t += run) runs.push_back(t), runs.push_back(std::min(run, t0 + lens[b] - t));
      ASSERT_TRUE(cuda::paged_attention_runs_apply(group, -1, false) && run <= cuda::paged_attention_run_tokens(group))
          << "group " << group << ": runs of " << run << " tokens would not be taken";
      for (DType pool : {DType::BF16, DType::E4M3}) {
        KvCache c = be.alloc_kv_cache(1, pages, ps, Hkv, hd, pool);
        if (pool == DType::E4M3) {
          be.copy(from_float_vector(std::vector<float>(Hkv, 0.02f), {1, Hkv}), c.k_scale);
          be.copy(from_float_vector(std::vector<float>(Hkv, 0.012f), {1, Hkv}), c.v_scale);
        }
        PagedBatch one{be.to_device(test::i32_tensor(seq)), be.to_device(test::i32_tensor(pos)),
                       be.to_device(test::i32_tensor(slots)),
                       be.to_device(test::i32_tensor(table)).reshape({static_cast<int64_t>(lens.size()), width}), 1100};
        one.batch_invariant = true;
        be.kv_write(c, 0, k, v, one);
        Tensor o1 = be.alloc({T, Hq, hd}, DType::BF16), l1 = be.alloc({Hq, T}, DType::F32);
        be.attention_paged(c, 0, q, one, 0.088f, false, o1, &l1);
        PagedBatch grouped = one;
        grouped.query_runs = be.to_device(test::i32_tensor(runs)).reshape({static_cast<int64_t>(runs.size() / 2), 2});
        grouped.query_run_tokens = run;
        Tensor o2 = be.alloc({T, Hq, hd}, DType::BF16), l2 = be.alloc({Hq, T}, DType::F32);
        be.attention_paged(c, 0, q, grouped, 0.088f, false, o2, &l2);
        const Tensor h1 = be.to_host(o1), h2 = be.to_host(o2), hl1 = be.to_host(l1), hl2 = be.to_host(l2);
        EXPECT_EQ(rows_differing(h1, h2, 0), 0)
            << "group " << group << ", runs of " << run << ", " << dtype_name(pool) << " pool: outputs";
        EXPECT_EQ(std::memcmp(hl1.raw(), hl2.raw(), hl1.nbytes()), 0)
            << "group " << group << ", runs of " << run << ", " << dtype_name(pool) << " pool: lse";
        const std::vector<float> f = to_float_vector(h1);
        EXPECT_TRUE(std::all_of(f.begin(), f.end(), [](float x) { return std::isfinite(x); }));
      }
    }
  unsetenv("FP8RL_WIDE_CTA_WARPS");
}

// Timing (FP8RL_QUERY_RUN_BENCH=1; gpu_bench.sh stages query_runs, ncu_query_runs): the consistent
// trainer's attention forward at the 1.7B heads (16 / 8 x 128) over one 8k-token micro-batch of 16
// ragged sequences — the paged kernel over an E4M3 scratch cache in query runs of 8, 16 and 64 MMA
// columns (the training_attention's consistent branch; `consistent=attn`'s extra training cost)
// against flash attention's forward over the same tokens (what fp8_e2e's trainer runs).
// FP8RL_QUERY_RUN_BENCH_COLS=8|16|64|-64 times that width only, for a profiler's first launch
// (-64: the wide runs on CTAs of 4 warps).
TEST(CudaConsistent, QueryRunBench) {
  const char* on = std::getenv("FP8RL_QUERY_RUN_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "timing mode: FP8RL_QUERY_RUN_BENCH=1";
  const char* only = std::getenv("FP8RL_QUERY_RUN_BENCH_COLS");
  cuda::CudaBackend be(0, DType::BF16);
  const int Hq = 16, Hkv = 8, hd = 128, ps = 16, group = Hq / Hkv;
  const std::vector<int32_t> lens = {512, 431, 600, 380, 700, 290, 555, 468, 620, 333, 505, 410, 690, 350, 575, 445};
  const WholeSequences ws = whole_sequences(lens, ps);
  const int64_t T = static_cast<int64_t>(ws.seq.size());
  std::vector<int32_t> cu = {0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  const Tensor q = rand_dev(be, {T, Hq, hd}, 71, DType::BF16, 0.3f);
  const Tensor k = rand_dev(be, {T, Hkv, hd}, 72, DType::BF16), v = rand_dev(be, {T, Hkv, hd}, 73, DType::BF16);
  KvCache c = be.alloc_kv_cache(1, ws.pages, ps, Hkv, hd, DType::E4M3);
  be.copy(from_float_vector(std::vector<float>(Hkv, 0.02f), {1, Hkv}), c.k_scale);
  be.copy(from_float_vector(std::vector<float>(Hkv, 0.012f), {1, Hkv}), c.v_scale);
  PagedBatch one{be.to_device(test::i32_tensor(ws.seq)), be.to_device(test::i32_tensor(ws.pos)),
                 be.to_device(test::i32_tensor(ws.slots)),
                 be.to_device(test::i32_tensor(ws.table)).reshape({static_cast<int64_t>(lens.size()), ws.width}), 700};
  one.batch_invariant = true;
  be.kv_write(c, 0, k, v, one);
  Tensor out = be.alloc({T, Hq, hd}, DType::BF16), lse = be.alloc({Hq, T}, DType::F32);
  const float scale = 0.088f;
  std::printf("consistent trainer attention, 1.7B heads, %lld tokens in %zu sequences (E4M3 scratch cache):\n",
              static_cast<long long>(T), lens.size());
  for (int cols_arg : {8, 16, 64, -64}) {  // -64: the wide runs on CTAs of 4 warps
    const int cols = cols_arg < 0 ? -cols_arg : cols_arg;
    setenv("FP8RL_WIDE_CTA_WARPS", cols_arg < 0 ? "4" : "8", 1);
    if (only && std::to_string(cols_arg) != only) continue;
    const int run = cols / group;
    if (!cuda::paged_attention_runs_apply(group, -1, false) || run > cuda::paged_attention_run_tokens(group)) continue;
    std::vector<int32_t> runs;
    for (size_t b = 0; b < lens.size(); ++b)
      for (int t = cu[b]; t < cu[b + 1]; t += run) runs.push_back(t), runs.push_back(std::min(run, cu[b + 1] - t));
    PagedBatch grouped = one;
    grouped.query_runs = be.to_device(test::i32_tensor(runs)).reshape({static_cast<int64_t>(runs.size() / 2), 2});
    grouped.query_run_tokens = run;
    const double us =
        test::time_calls([&](int) { be.attention_paged(c, 0, q, grouped, scale, false, out, &lse); }, be.stream());
    std::printf("  paged, query runs of %2d columns (%d tokens)%s: %8.1f us\n", cols, run,
                cols_arg < 0 ? ", CTAs of 4 warps" : "", us);
  }
  if (!only) {
    const double us = test::time_calls([&](int) { be.attention(q, k, v, cu, scale, out, lse); }, be.stream());
    std::printf("  flash attention forward:                   %8.1f us\n", us);
  }
  unsetenv("FP8RL_WIDE_CTA_WARPS");
}

// consistent=flash's decode attention (PagedBatch::flash_order, flash_decode_kernel): every
// token's output over the paged cache is bitwise the trainer's flash attention row over the
// values the cache hands out — E4M3: k and v rounded by kv_round with the cache's per-head scales;
// BF16 as stored — for whole sequences (prefill-sized batches) and a decode batch of their last
// tokens, at head_dim 128 and 64, group 2 (the 1.7B heads) and 8; in the online softmax's order
// and in the tile-merge order (FP8RL_FLASH_ORDER=merge: both kernels, the E4M3 decode's tiles in
// parallel; merge_coop: E4M3 on the cooperative decode).
TEST(CudaConsistent, FlashOrderDecodeIsBitwiseFlashAttention) {
  cuda::CudaBackend be(0, DType::BF16);
  const int ps = 16, Hkv = 4;
  const std::vector<int32_t> lens = {700, 37, 130, 1};
  const WholeSequences ws = whole_sequences(lens, ps);
  const int64_t T = static_cast<int64_t>(ws.seq.size());
  std::vector<int32_t> cu = {0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  // fold: FP8RL_FLASH_DECODE_FOLD=1 with power-of-two scales (the kernel folds them into the score
  // multiplier and 1 / l); the other E4M3 cases have scales that are not powers of two.
  for (const char* order : {"online", "merge", "merge_coop"})
    for (int hd : {128, 64})
      for (int group : {2, 8})
        for (int fold : {0, 1})
          for (DType pool : {DType::E4M3, DType::BF16}) {
            if (fold && pool != DType::E4M3) continue;
            setenv("FP8RL_FLASH_DECODE_FOLD", fold ? "1" : "0", 1);
            setenv("FP8RL_FLASH_ORDER", order, 1);
            const int Hq = Hkv * group;
            const Tensor q = rand_dev(be, {T, Hq, hd}, 61 + group, DType::BF16, 0.5f);
            const Tensor k = rand_dev(be, {T, Hkv, hd}, 62, DType::BF16),
                         v = rand_dev(be, {T, Hkv, hd}, 63, DType::BF16);
            const std::vector<float> kscale = fold ? std::vector<float>{0.015625f, 0.03125f, 0.0078125f, 0.0625f}
                                                   : std::vector<float>{0.02f, 0.03f, 0.015f, 0.05f};
            const std::vector<float> vscale = fold ? std::vector<float>{0.0078125f, 0.015625f, 0.0078125f, 0.03125f}
                                                   : std::vector<float>{0.012f, 0.02f, 0.01f, 0.04f};
            KvCache c = be.alloc_kv_cache(1, ws.pages, ps, Hkv, hd, pool);
            if (pool == DType::E4M3) {
              be.copy(from_float_vector(kscale, {1, Hkv}), c.k_scale);
              be.copy(from_float_vector(vscale, {1, Hkv}), c.v_scale);
            }
            PagedBatch all{
                be.to_device(test::i32_tensor(ws.seq)), be.to_device(test::i32_tensor(ws.pos)),
                be.to_device(test::i32_tensor(ws.slots)),
                be.to_device(test::i32_tensor(ws.table)).reshape({static_cast<int64_t>(lens.size()), ws.width}), 700};
            be.kv_write(c, 0, k, v, all);
            all.flash_order = true;
            Tensor o1 = be.alloc({T, Hq, hd}, DType::BF16);
            be.attention_paged(c, 0, q, all, 0.088f, false, o1);
            // The trainer's side: k and v as the cache hands them out, then flash attention.
            Tensor kr = be.alloc(k.shape(), DType::BF16), vr = be.alloc(v.shape(), DType::BF16);
            be.copy(k, kr);
            be.copy(v, vr);
            if (pool == DType::E4M3) {
              be.kv_round(kr, kscale);
              be.kv_round(vr, vscale);
            }
            Tensor o2 = be.alloc({T, Hq, hd}, DType::BF16), lse = be.alloc({Hq, T}, DType::F32);
            be.attention(q, kr, vr, cu, 0.088f, o2, lse);
            const Tensor h1 = be.to_host(o1), h2 = be.to_host(o2);
            EXPECT_EQ(rows_differing(h2, h1, 0), 0)
                << order << " order, hd " << hd << ", group " << group << ", " << dtype_name(pool) << " pool, fold "
                << fold << ": whole sequences";
            // A decode batch: each sequence's last token alone.
            std::vector<int32_t> dseq, dpos, dslots;
            std::vector<int64_t> rows;
            for (int b = 0; b < static_cast<int>(lens.size()); ++b) {
              const int64_t t = cu[b + 1] - 1;
              dseq.push_back(b), dpos.push_back(ws.pos[t]), dslots.push_back(ws.slots[t]), rows.push_back(t);
            }
            PagedBatch dec{be.to_device(test::i32_tensor(dseq)), be.to_device(test::i32_tensor(dpos)),
                           be.to_device(test::i32_tensor(dslots)), all.page_table, 700};
            dec.flash_order = true;
            const int64_t B = static_cast<int64_t>(rows.size());
            Tensor qd = be.alloc({B, Hq, hd}, DType::BF16);
            for (int64_t i = 0; i < B; ++i) {
              Tensor dst = qd.slice_rows(i, i + 1);
              be.copy(q.slice_rows(rows[i], rows[i] + 1), dst);
            }
            Tensor od = be.alloc({B, Hq, hd}, DType::BF16);
            be.attention_paged(c, 0, qd, dec, 0.088f, false, od);
            const Tensor hd_out = be.to_host(od);
            for (int64_t i = 0; i < B; ++i)
              EXPECT_EQ(std::memcmp(static_cast<const char*>(hd_out.raw()) + i * Hq * hd * 2,
                                    static_cast<const char*>(h2.raw()) + rows[i] * Hq * hd * 2, Hq * hd * 2),
                        0)
                  << order << " order, hd " << hd << ", group " << group << ", " << dtype_name(pool) << " pool, fold "
                  << fold << ": decode row " << rows[i];
          }
  unsetenv("FP8RL_FLASH_DECODE_FOLD");
  unsetenv("FP8RL_FLASH_ORDER");
}

// consistent=flash end to end with power-of-two scales (pow2: the fast linears' sums round
// nowhere, docs/design.md): logp_gen and the trainer's logp_old the same bits. Measured, not
// constructed (the consistent=on test above is the construction); reported either way.
TEST(CudaConsistent, FlashOrderRecipeWithPow2ScalesAgrees) {
  auto be = make_cuda_backend(0);
  test::ConsistentShape sh;
  sh.family = "qwen3";
  const std::string spec = "fp8_e2e:pow2=on+consistent=flash";
  for (const char* order : {"online", "merge"})  // FP8RL_FLASH_ORDER: both kernels' order
    for (const char* fold : {"0", "1"}) {        // the decode kernel's folded power-of-two scales too
      setenv("FP8RL_FLASH_DECODE_FOLD", fold, 1);
      setenv("FP8RL_FLASH_ORDER", order, 1);
      const test::ConsistentRun r = test::consistent_run(*be, sh, spec);
      std::printf("  %s, %s order, fold %s: %zu tokens, mult %.6f kl %.3g, max |logp_old - logp_gen| %.3g\n",
                  spec.c_str(), order, fold, r.logp_gen.size(), r.mismatch.token_mult_prob_error,
                  r.mismatch.gen_kl_error, test::max_abs_diff(r.logp_old, r.logp_gen));
      EXPECT_TRUE(test::same_bits(r.logp_old, r.logp_gen)) << order << " order, fold " << fold;
      EXPECT_EQ(r.mismatch.token_mult_prob_error, 1.0) << order << " order, fold " << fold;
    }
  unsetenv("FP8RL_FLASH_ORDER");
  unsetenv("FP8RL_FLASH_DECODE_FOLD");
}

// consistent=attn with power-of-two scales and each engine's own head (logits=fast): the engines
// agree bitwise up to the final hidden state, so logp_gen and logp_old differ only by the heads:
// the generator's decode product writes BF16 logits (each rounded by up to 2^-9 of itself; this
// model's logits reach a few units, so logp moves by up to ~0.01) and samples from them, the
// trainer's token_logprobs keeps F32. That difference passes through no quantizer, so it stays a
// small fraction of what the same recipe without the consistent mode shows, where every
// difference upstream of an FP8 quantizer is amplified (on the 1.7B rl-step: 1.0014 against
// 1.1957).
TEST(CudaConsistent, AttnRecipeWithFastLogitsAgreesToTheHeadsRounding) {
  auto be = make_cuda_backend(0);
  test::ConsistentShape sh;
  sh.family = "qwen3";
  const std::string spec = "fp8_e2e:pow2=on+consistent=attn+logits=fast", base = "fp8_e2e:pow2=on";
  const test::ConsistentRun r = test::consistent_run(*be, sh, spec);
  const test::ConsistentRun u = test::consistent_run(*be, sh, base);
  for (const auto* x : {&r, &u})
    std::printf("  %s: %zu tokens, mult %.6f kl %.3g, max |logp_old - logp_gen| %.3g\n",
                x == &r ? spec.c_str() : base.c_str(), x->logp_gen.size(), x->mismatch.token_mult_prob_error,
                x->mismatch.gen_kl_error, test::max_abs_diff(x->logp_old, x->logp_gen));
  ASSERT_GT(r.logp_gen.size(), 50u);
  // The heads' rounding alone: within 0.02 per token's logp, and the token-level errors a tenth
  // of the unaligned recipe's at most.
  EXPECT_LT(test::max_abs_diff(r.logp_old, r.logp_gen), 0.02);
  EXPECT_LT(r.mismatch.token_mult_prob_error - 1.0, 0.1 * (u.mismatch.token_mult_prob_error - 1.0));
  EXPECT_LT(r.mismatch.gen_kl_error, 0.1 * u.mismatch.gen_kl_error);
}

// The consistent generator's logp_gen without a second lm_head GEMM: logprobs_of_logits over the
// head's chunked logits (model_consistent_logits: linear of each kConsistentVocabChunk chunk into
// F32, what model_forward_paged writes and the sampler reads) is token_logprobs with the
// consistent spec, bit for bit. The fast path at the 1.7B head (BF16 hidden and lm_head, D 2048,
// V 151936: 37 chunks and one of 384) for decode-sized batches, and the exact path (F32, V 9000:
// three chunks, the last partial); temperatures 0.8 and 1.
TEST(CudaConsistent, LogprobsOfLogitsIsTokenLogprobsBitwise) {
  struct Case {
    DType act;
    int64_t D, V;
    std::vector<int64_t> rows;
  };
  for (const Case& c : {Case{DType::BF16, 2048, 151936, {1, 7, 64, 256}}, Case{DType::F32, 256, 9000, {1, 19}}}) {
    cuda::CudaBackend be(0, c.act);
    const Tensor head = rand_dev(be, {c.V, c.D}, 51, c.act, 0.05f);
    LinearSpec spec{c.act == DType::BF16 ? LinearMode::BF16 : LinearMode::FP32, false};
    spec.consistent = true;
    for (int64_t R : c.rows) {
      const Tensor hidden = rand_dev(be, {R, c.D}, 52 + static_cast<uint32_t>(R), c.act);
      std::vector<int32_t> tg(static_cast<size_t>(R));
      for (int64_t i = 0; i < R; ++i) tg[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 4095) % c.V);
      tg.back() = static_cast<int32_t>(c.V - 1);
      const Tensor targets = be.to_device(test::i32_tensor(tg));
      Tensor logits = be.alloc({R, c.V}, DType::F32);
      model_consistent_logits(be, hidden, head, logits);
      for (float temp : {0.8f, 1.0f}) {
        Tensor logp = be.alloc({R}, DType::F32), lse = be.alloc({R}, DType::F32);
        Tensor tl_logp = be.alloc({R}, DType::F32), tl_lse = be.alloc({R}, DType::F32);
        be.logprobs_of_logits(logits, targets, temp, logp, lse);
        be.token_logprobs(hidden, head, targets, temp, spec, tl_logp, tl_lse, nullptr);
        const std::string what = std::string(dtype_name(c.act)) + " V=" + std::to_string(c.V) +
                                 " R=" + std::to_string(R) + " temperature " + std::to_string(temp);
        const Tensor hl = be.to_host(logp), ht = be.to_host(tl_logp);
        EXPECT_EQ(rows_differing(ht, hl, 0), 0) << what << ": logp";
        EXPECT_EQ(rows_differing(be.to_host(tl_lse), be.to_host(lse), 0), 0) << what << ": lse";
        for (int64_t i = 0; i < R; ++i)
          ASSERT_TRUE(std::isfinite(hl.data<float>()[i]) && hl.data<float>()[i] < 0.0f) << what << " row " << i;
      }
    }
  }
}

struct GpuCase {
  const char* recipe;
  const char* family;
  bool long_sequence;
};

class CudaConsistentRecipe : public testing::TestWithParam<GpuCase> {};

// End to end on the fast path (BF16 activations, CUDA-graph decode steps): logp_gen, the
// trainer's logp_old, the frozen reference's and the training forward's logp_new are the same
// bits; token_mult_prob_error exactly 1, gen_kl exactly 0. Without the consistent mode they are
// not (the same run with the usual kernels, reported). The FP8 products all run on the own kernel.
TEST_P(CudaConsistentRecipe, GeneratorAndTrainerAgreeBitForBit) {
  auto be = make_cuda_backend(0);
  test::ConsistentShape sh;
  sh.family = GetParam().family;
  sh.long_sequence = GetParam().long_sequence;
  const std::string spec = std::string(GetParam().recipe) + ":consistent=on";
  const BackendCounters c0 = be->counters();
  const test::ConsistentRun r = test::consistent_run(*be, sh, spec);
  const BackendCounters c1 = be->counters();
  EXPECT_GT(r.stats.graph_steps, 0) << "decode steps replayed from CUDA graphs";
  EXPECT_GT(r.stats.prefix_shared_tokens, 0);
  EXPECT_TRUE(test::same_bits(r.logp_old, r.logp_gen))
      << spec << ": max |logp_old - logp_gen| = " << test::max_abs_diff(r.logp_old, r.logp_gen);
  EXPECT_EQ(r.mismatch.token_mult_prob_error, 1.0);
  EXPECT_EQ(r.mismatch.gen_kl_error, 0.0);
  EXPECT_TRUE(test::same_bits(r.logp_ref, r.logp_old));
  EXPECT_TRUE(test::same_bits(r.logp_new, r.logp_old));
  EXPECT_EQ(c1.fp8_gemm_fallbacks - c0.fp8_gemm_fallbacks, 0);
  if (std::string(GetParam().recipe) == "fp8_e2e") {
    EXPECT_GT(c1.fp8_gemm_own - c0.fp8_gemm_own, 0);
  }
  const test::ConsistentRun plain = test::consistent_run(*be, sh, GetParam().recipe);
  ASSERT_TRUE(std::isfinite(r.grad_norm) && std::isfinite(plain.grad_norm));
  EXPECT_LT(std::fabs(r.grad_norm - plain.grad_norm), 0.05 * plain.grad_norm)
      << "consistent " << r.grad_norm << " vs usual " << plain.grad_norm;
  std::printf("  %s %s%s: %zu tokens, %d graph steps; consistent mult %.6f kl %.3g; usual mult %.6f kl %.3g\n",
              GetParam().recipe, GetParam().family, sh.long_sequence ? " (long)" : "", r.logp_gen.size(),
              r.stats.graph_steps, r.mismatch.token_mult_prob_error, r.mismatch.gen_kl_error,
              plain.mismatch.token_mult_prob_error, plain.mismatch.gen_kl_error);
}

INSTANTIATE_TEST_SUITE_P(Recipes, CudaConsistentRecipe,
                         testing::Values(GpuCase{"bf16", "qwen3", false}, GpuCase{"fp8_e2e", "qwen3", false},
                                         GpuCase{"fp8_e2e", "qwen2", false}, GpuCase{"bf16", "llama", true},
                                         GpuCase{"fp8_e2e", "qwen3", true}),
                         [](const testing::TestParamInfo<GpuCase>& i) {
                           return std::string(i.param.recipe) + "_" + i.param.family +
                                  (i.param.long_sequence ? "_long" : "");
                         });

// Decode steps replayed from CUDA graphs (padded batches) and run directly give the same tokens
// and log-probs bit for bit in the consistent mode (the usual mode allows rare flips:
// test_cuda_rollout.cpp).
TEST(CudaConsistent, GraphReplaysAreBitwiseTheDirectSteps) {
  auto be = make_cuda_backend(0);
  const ModelConfig mc = model_config_tiny("qwen3", 4500, 256, 2, 4, 2, 384);
  RandomInit init;
  init.seed = 5;
  init.std = 0.1f;
  const ModelWeights master = model_weights_to_device(*be, model_weights_random(mc, init, DType::F32), DType::F32);
  const EnginePrecision prec = PrecisionRecipe::parse("fp8_e2e:consistent=on").generator;
  std::vector<RolloutRequest> reqs;
  for (int i = 0; i < 5; ++i) {
    RolloutRequest r;
    for (int j = 0; j < 5 + 7 * i; ++j) r.prompt.push_back((i * 37 + j * 11) % 4000 + 1);
    r.n = 1 + i % 3;
    reqs.push_back(r);
  }
  SamplingParams sp;
  sp.max_new_tokens = 30;
  sp.seed = 3;
  SchedulerOptions with, without;
  without.cuda_graphs = false;
  RolloutEngine a(*be, master, prec, 64, 16, 64, with), b(*be, master, prec, 64, 16, 64, without);
  const auto ga = a.generate(reqs, sp), gb = b.generate(reqs, sp);
  if (a.last_stats().graph_steps == 0) GTEST_SKIP() << "no CUDA graphs in this build (FP8RL_CUDA_GRAPHS=0?)";
  ASSERT_EQ(ga.size(), gb.size());
  for (size_t i = 0; i < ga.size(); ++i) {
    EXPECT_EQ(ga[i].tokens, gb[i].tokens) << "sample " << i;
    EXPECT_TRUE(test::same_bits(ga[i].logp, gb[i].logp)) << "sample " << i;
  }
}

}  // namespace
}  // namespace fp8rl
