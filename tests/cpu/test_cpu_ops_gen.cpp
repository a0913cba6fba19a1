// CPU backend: element-wise ops, embedding, AdamW, the paged KV cache and sampling.
#include <gtest/gtest.h>

#include <map>

#include "test_cpu_ops_util.h"

namespace fp8rl {
namespace {

using test::i32_tensor;
using test::random_tensor;
using test::rel_err;
using test::values;

class CpuGen : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
};

TEST_F(CpuGen, ElementwiseOps) {
  const Tensor a = random_tensor({3, 5}, 1, DType::F32), b = random_tensor({3, 5}, 2, DType::F32);
  Tensor out = be->alloc({3, 5}, DType::F32);
  be->add(a, b, out);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(out.data<float>()[i], a.data<float>()[i] + b.data<float>()[i]);
  be->scale(out, 0.5f);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(out.data<float>()[i], (a.data<float>()[i] + b.data<float>()[i]) * 0.5f);
  double ss = 0;
  for (int i = 0; i < 15; ++i) ss += double(a.data<float>()[i]) * a.data<float>()[i];
  EXPECT_DOUBLE_EQ(be->sum_squares(a), ss);
  EXPECT_TRUE(be->all_finite(a));
  Tensor c = be->alloc({3, 5}, DType::F32);
  be->copy(a, c);
  c.data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(be->all_finite(c));
  be->fill(c, 2.5f);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(c.data<float>()[i], 2.5f);
  // convert F32 -> BF16 -> F32 equals bf16_round; F32 -> F64 -> F32 is exact; F16 rounds.
  Tensor h = be->alloc({3, 5}, DType::BF16), back = be->alloc({3, 5}, DType::F32), d = be->alloc({3, 5}, DType::F64),
         f16 = be->alloc({3, 5}, DType::F16);
  be->convert(a, h);
  be->convert(h, back);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(back.data<float>()[i], bf16_round(a.data<float>()[i]));
  be->convert(a, d);
  be->convert(d, back);
  EXPECT_EQ(values(back), values(a));
  be->convert(a, f16);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(f16.data<uint16_t>()[i], f16_from_float(a.data<float>()[i]));
  EXPECT_THROW(be->copy(a, h), Error);
  Tensor wrong = be->alloc({4, 5}, DType::F32);
  EXPECT_THROW(be->add(a, b, wrong), Error);
}

TEST_F(CpuGen, EmbeddingForwardBackward) {
  const Tensor table = random_tensor({10, 4}, 3, DType::BF16);
  const Tensor ids = i32_tensor({3, 9, 3, 0});
  Tensor out = be->alloc({4, 4}, DType::F32);
  be->embedding(ids, table, out);
  const std::vector<double> tv = values(table), ov = values(out);
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(ov[t * 4 + c], tv[ids.data<int32_t>()[t] * 4 + c]);
  const Tensor dout = random_tensor({4, 4}, 4, DType::F32);
  Tensor dtable = be->alloc({10, 4}, DType::F32);
  be->fill(dtable, 1.0f);
  be->embedding_backward(ids, dout, dtable);
  const std::vector<double> g = values(dout), dt = values(dtable);
  for (int c = 0; c < 4; ++c) {
    EXPECT_FLOAT_EQ(dt[3 * 4 + c], 1.0 + g[0 * 4 + c] + g[2 * 4 + c]);  // id 3 twice
    EXPECT_FLOAT_EQ(dt[9 * 4 + c], 1.0 + g[1 * 4 + c]);
    EXPECT_FLOAT_EQ(dt[5 * 4 + c], 1.0);
  }
  EXPECT_THROW(be->embedding(i32_tensor({10}), table, out), Error);
  Tensor out1 = be->alloc({1, 4}, DType::F32);
  EXPECT_THROW(be->embedding(i32_tensor({-1}), table, out1), Error);
}

// Adam as usually written: m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t),
// p -= lr (m_hat / (sqrt(v_hat) + eps)) after p *= 1 - lr wd.
TEST_F(CpuGen, AdamwMatchesTextbookForm) {
  const int64_t n = 50;
  Tensor p = random_tensor({n}, 5, DType::F32);
  Tensor m = be->alloc({n}, DType::F32), v = be->alloc({n}, DType::F32);
  std::vector<double> rp = values(p), rm(n, 0.0), rv(n, 0.0);
  AdamWParams ap;
  ap.lr = 1e-2f;
  ap.weight_decay = 0.1f;
  for (int step = 1; step <= 3; ++step) {
    const Tensor g = random_tensor({n}, 100 + step, DType::F32);
    ap.step = step;
    be->adamw(p, g, m, v, ap);
    const std::vector<double> gv = values(g);
    for (int64_t i = 0; i < n; ++i) {
      rp[i] *= 1 - double(ap.lr) * ap.weight_decay;
      rm[i] = ap.beta1 * rm[i] + (1 - double(ap.beta1)) * gv[i];
      rv[i] = ap.beta2 * rv[i] + (1 - double(ap.beta2)) * gv[i] * gv[i];
      const double mh = rm[i] / (1 - std::pow(double(ap.beta1), step));
      const double vh = rv[i] / (1 - std::pow(double(ap.beta2), step));
      rp[i] -= ap.lr * mh / (std::sqrt(vh) + ap.eps);
    }
  }
  EXPECT_LT(rel_err(values(p), rp), 1e-6);
  EXPECT_LT(rel_err(values(m), rm), 1e-6);
  EXPECT_LT(rel_err(values(v), rv), 1e-6);
}

// ---- paged KV cache --------------------------------------------------------------------------

// Two sequences (lengths 7 and 5) in scattered pages of size 4; their prefill as one batch.
struct PagedSetup {
  int64_t T = 12, Hq = 4, Hkv = 2, hd = 8;
  std::vector<int32_t> cu = {0, 7, 12};
  PagedBatch batch;
  PagedSetup() {
    const std::vector<std::vector<int32_t>> pages = {{5, 1}, {0, 3}};  // sequence -> pages
    std::vector<int32_t> seq, pos, slots;
    for (int b = 0; b < 2; ++b)
      for (int32_t p = 0; p < cu[b + 1] - cu[b]; ++p) {
        seq.push_back(b);
        pos.push_back(p);
        slots.push_back(pages[b][p / 4] * 4 + p % 4);
      }
    batch.token_seq = i32_tensor(seq);
    batch.token_pos = i32_tensor(pos);
    batch.slots = i32_tensor(slots);
    batch.page_table = i32_tensor({5, 1, 0, 3}).reshape({2, 2});
    batch.max_pos = 7;
  }
};

TEST_F(CpuGen, PagedAttentionEqualsPackedAttentionF32) {
  PagedSetup s;
  const Tensor q = random_tensor({s.T, s.Hq, s.hd}, 10, DType::F32), k = random_tensor({s.T, s.Hkv, s.hd}, 11, DType::F32),
               v = random_tensor({s.T, s.Hkv, s.hd}, 12, DType::F32);
  KvCache cache = be->alloc_kv_cache(2, 6, 4, s.Hkv, s.hd, DType::F32);
  be->kv_write(cache, 1, k, v, s.batch);
  Tensor paged = be->alloc(q.shape(), DType::F32), packed = be->alloc(q.shape(), DType::F32),
         lse = be->alloc({s.Hq, s.T}, DType::F32);
  be->attention_paged(cache, 1, q, s.batch, 0.35f, false, paged);
  be->attention(q, k, v, s.cu, 0.35f, packed, lse);
  EXPECT_LT(rel_err(values(paged), values(packed)), 1e-6);
  // A decode step of sequence 0 at position 6 only (one query) gives the same row.
  PagedBatch one = s.batch;
  one.token_seq = i32_tensor({0});
  one.token_pos = i32_tensor({6});
  one.slots = i32_tensor({s.batch.slots.data<int32_t>()[6]});
  Tensor q6 = q.slice_rows(6, 7), o6 = be->alloc(q6.shape(), DType::F32);
  be->attention_paged(cache, 1, q6, one, 0.35f, false, o6);
  EXPECT_LT(rel_err(values(o6), values(packed.slice_rows(6, 7))), 1e-6);
  // Bad pages and slots are errors.
  PagedBatch bad = s.batch;
  bad.slots = i32_tensor(std::vector<int32_t>(s.T, 24));
  EXPECT_THROW(be->kv_write(cache, 1, k, v, bad), Error);
  EXPECT_THROW(be->kv_write(cache, 2, k, v, s.batch), Error);
}

TEST_F(CpuGen, E4M3KvWriteIsTheFormulaAndPagedAttentionReadsIt) {
  PagedSetup s;
  const Tensor q = random_tensor({s.T, s.Hq, s.hd}, 20, DType::F32), k = random_tensor({s.T, s.Hkv, s.hd}, 21, DType::F32),
               v = random_tensor({s.T, s.Hkv, s.hd}, 22, DType::F32, 3.0);
  KvCache cache = be->alloc_kv_cache(1, 6, 4, s.Hkv, s.hd, DType::E4M3);
  const float ks[2] = {0.01f, 0.007f}, vs[2] = {0.02f, 0.03f};
  for (int h = 0; h < 2; ++h) {
    cache.k_scale.data<float>()[h] = ks[h];
    cache.v_scale.data<float>()[h] = vs[h];
  }
  be->kv_write(cache, 0, k, v, s.batch);
  // Bitwise: code = e4m3_from_float(x / scale); dequantized copies for the packed reference.
  std::vector<float> kd(k.numel()), vd(v.numel());
  for (int64_t t = 0; t < s.T; ++t) {
    const int32_t slot = s.batch.slots.data<int32_t>()[t];
    for (int64_t h = 0; h < s.Hkv; ++h)
      for (int64_t c = 0; c < s.hd; ++c) {
        const int64_t src = (t * s.Hkv + h) * s.hd + c, dst = (slot * s.Hkv + h) * s.hd + c;
        const uint8_t qk = e4m3_from_float(k.data<float>()[src] / ks[h]);
        const uint8_t qv = e4m3_from_float(v.data<float>()[src] / vs[h]);
        ASSERT_EQ(cache.k[0].data<uint8_t>()[dst], qk);
        ASSERT_EQ(cache.v[0].data<uint8_t>()[dst], qv);
        kd[src] = e4m3_to_float(qk) * ks[h];
        vd[src] = e4m3_to_float(qv) * vs[h];
      }
  }
  const Tensor kdt = from_float_vector(kd, k.shape()), vdt = from_float_vector(vd, v.shape());
  Tensor paged = be->alloc(q.shape(), DType::F32), packed = be->alloc(q.shape(), DType::F32),
         lse = be->alloc({s.Hq, s.T}, DType::F32);
  be->attention_paged(cache, 0, q, s.batch, 0.35f, false, paged);
  be->attention(q, kdt, vdt, s.cu, 0.35f, packed, lse);
  EXPECT_LT(rel_err(values(paged), values(packed)), 1e-6);
  // FP8 attention: q quantized per token and head with amax / 448.
  std::vector<float> qd(q.numel());
  for (int64_t r = 0; r < s.T * s.Hq; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < s.hd; ++c) amax = std::max(amax, std::fabs(q.data<float>()[r * s.hd + c]));
    const float sc = amax / 448.0f;
    for (int64_t c = 0; c < s.hd; ++c) qd[r * s.hd + c] = e4m3_round(q.data<float>()[r * s.hd + c] / sc) * sc;
  }
  be->attention_paged(cache, 0, q, s.batch, 0.35f, true, paged);
  be->attention(from_float_vector(qd, q.shape()), kdt, vdt, s.cu, 0.35f, packed, lse);
  EXPECT_LT(rel_err(values(paged), values(packed)), 1e-6);
  // BF16 cache stores bf16_from_float(x).
  KvCache cb = be->alloc_kv_cache(1, 6, 4, s.Hkv, s.hd, DType::BF16);
  be->kv_write(cb, 0, k, v, s.batch);
  const int32_t slot3 = s.batch.slots.data<int32_t>()[3];
  EXPECT_EQ(cb.k[0].data<uint16_t>()[slot3 * s.Hkv * s.hd + 5], bf16_from_float(k.data<float>()[3 * s.Hkv * s.hd + 5]));
}

// ---- sampling --------------------------------------------------------------------------------

TEST_F(CpuGen, SampleGreedyAndTopK1AreArgmax) {
  const int64_t B = 4, V = 50;
  const Tensor logits = random_tensor({B, V}, 30, DType::F32, 3.0);
  Tensor tok = be->alloc({B}, DType::I32), lp = be->alloc({B}, DType::F32);
  auto argmax = [&](int64_t b) {
    const float* r = logits.data<float>() + b * V;
    return static_cast<int32_t>(std::max_element(r, r + V) - r);
  };
  be->sample(logits, {0, 0, 0, 0}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0.1f, 0.5f, 0.9f, 0.99f}, tok, lp);
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(tok.data<int32_t>()[b], argmax(b));
  be->sample(logits, {1, 0.7f, 1.5f, 1}, {1, 1, 0.5f, 1}, {1, 1, 1, 1}, {0.0f, 0.5f, 0.9f, 0.999f}, tok, lp);
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(tok.data<int32_t>()[b], argmax(b));
  // logp is the log-prob under softmax(logits / T) before truncation.
  const float* r = logits.data<float>() + 3 * V;
  double z = 0;
  for (int64_t j = 0; j < V; ++j) z += std::exp(double(r[j]));
  EXPECT_NEAR(lp.data<float>()[3], r[argmax(3)] - std::log(z), 1e-5);
  EXPECT_THROW(be->sample(logits, {1, 1, 1, 1}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0, 0, 0, 1.0f}, tok, lp), Error);
}

// Frequencies of many draws against the probabilities: Pearson chi-square with V-1 = 5
// degrees of freedom; P(chi2_5 > 33.4) = 3.2e-6, the bound chosen before running.
TEST_F(CpuGen, SampleFrequenciesFollowSoftmax) {
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f, 0.0f};
  const int64_t V = 6, N = 20000;
  const float temp = 0.8f;
  for (int top_k : {0, 3}) {
    // Expected probabilities: softmax(row / temp) restricted to the top_k largest.
    std::vector<double> p(V);
    double z = 0;
    for (int64_t j = 0; j < V; ++j) z += (p[j] = std::exp(row[j] / temp));
    std::vector<float> sorted = row;
    std::sort(sorted.rbegin(), sorted.rend());
    double kept = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (top_k && row[j] < sorted[top_k - 1]) p[j] = 0;
      kept += p[j];
    }
    for (double& e : p) e /= kept;
    std::vector<float> lg;
    for (int64_t i = 0; i < N; ++i) lg.insert(lg.end(), row.begin(), row.end());
    std::mt19937 gen(77 + top_k);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    std::vector<float> u(N);
    for (float& e : u) e = std::min(ud(gen), 0.99999994f);
    Tensor tok = be->alloc({N}, DType::I32), lp = be->alloc({N}, DType::F32);
    be->sample(from_float_vector(lg, {N, V}), std::vector<float>(N, temp), std::vector<float>(N, 1.0f),
               std::vector<int>(N, top_k), u, tok, lp);
    std::vector<int64_t> count(V, 0);
    for (int64_t i = 0; i < N; ++i) ++count[tok.data<int32_t>()[i]];
    double chi2 = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (p[j] == 0) {
        EXPECT_EQ(count[j], 0) << "token " << j << " is outside the top-" << top_k;
        continue;
      }
      chi2 += (count[j] - N * p[j]) * (count[j] - N * p[j]) / (N * p[j]);
    }
    EXPECT_LT(chi2, 33.4) << "top_k " << top_k;
    // logp of the drawn tokens is that of the untruncated tempered softmax.
    EXPECT_NEAR(lp.data<float>()[0], row[tok.data<int32_t>()[0]] / temp - std::log(z), 1e-5);
  }
}

TEST_F(CpuGen, SampleTopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.25, 0.15, 0.1 (ids 2, 0, 3, 1).
  const std::vector<float> row = {std::log(0.25f), std::log(0.1f), std::log(0.5f), std::log(0.15f)};
  Tensor tok = be->alloc({1}, DType::I32), lp = be->alloc({1}, DType::F32);
  const Tensor lg = from_float_vector(row, {1, 4});
  auto last_kept = [&](float top_p) {  // a uniform just below 1 draws the last kept token
    be->sample(lg, {1.0f}, {top_p}, {0}, {0.9999f}, tok, lp);
    return tok.data<int32_t>()[0];
  };
  EXPECT_EQ(last_kept(0.3f), 2);   // {0.5}
  EXPECT_EQ(last_kept(0.5f - 1e-3f), 2);
  EXPECT_EQ(last_kept(0.6f), 0);   // {0.5, 0.25}
  EXPECT_EQ(last_kept(0.8f), 3);   // {0.5, 0.25, 0.15}
  EXPECT_EQ(last_kept(0.95f), 1);  // all
  EXPECT_EQ(last_kept(1.0f), 1);
  // Within the nucleus {0.5, 0.25} the draw is by renormalized mass: u < 2/3 gives id 2.
  be->sample(lg, {1.0f}, {0.6f}, {0}, {0.66f}, tok, lp);
  EXPECT_EQ(tok.data<int32_t>()[0], 2);
  be->sample(lg, {1.0f}, {0.6f}, {0}, {0.67f}, tok, lp);
  EXPECT_EQ(tok.data<int32_t>()[0], 0);
  EXPECT_NEAR(lp.data<float>()[0], std::log(0.25), 1e-6);
}

}  // namespace
}  // namespace fp8rl
