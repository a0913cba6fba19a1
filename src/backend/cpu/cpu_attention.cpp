// CPU backend: causal GQA attention over packed sequences (forward, backward) and the paged
// KV cache (write, attention).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"
#include "core/error.h"

namespace fp8rl {
namespace cpu {
namespace {

struct AttnDims {
  int64_t T, Hq, Hkv, hd, group, hdv;  // hdv: v's head dim (MLA: may differ from q/k's hd)
};

// The dimensions of q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hdv] (the contract checked them).
AttnDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v) {
  AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), 0, v.dim(2)};
  d.group = d.Hq / d.Hkv;
  return d;
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Multiply-adds of causal attention over these sequences (for the parallel split).
int64_t attention_work(const std::vector<int32_t>& cu_seqlens, int64_t heads, int64_t hd) {
  int64_t w = 0;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const int64_t n = cu_seqlens[b + 1] - cu_seqlens[b];
    w += n * (n + 1) / 2;
  }
  return w * heads * hd * 2;
}

}  // namespace

void CpuBackend::attention_impl(const Tensor& q, const Tensor& k, const Tensor& v,
                                const std::vector<int32_t>& cu_seqlens, float softmax_scale, Tensor& out, Tensor& lse) {
  const AttnDims d = attention_dims(q, k, v);
  const std::vector<double> vq = load(q, "attention q"), vk = load(k, "attention k"), vv = load(v, "attention v");
  std::vector<double> o(d.T * d.Hq * d.hdv, 0.0), l(d.Hq * d.T);
  // One task per (sequence, query head): each writes only its own rows of o and l.
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1;
  cpu_parallel_for(B * d.Hq, attention_work(cu_seqlens, d.Hq, d.hd), [&](int64_t task0, int64_t task1) {
    std::vector<double> p;
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t b = task / d.Hq, h = task % d.Hq;
      const int64_t s0 = cu_seqlens[b], s1 = cu_seqlens[b + 1];
      const int64_t kh = h / d.group;
      for (int64_t i = s0; i < s1; ++i) {
        const double* qi = vq.data() + (i * d.Hq + h) * d.hd;
        p.assign(i - s0 + 1, 0.0);
        double m = -INFINITY;
        for (int64_t j = s0; j <= i; ++j) {
          p[j - s0] = softmax_scale * dot(qi, vk.data() + (j * d.Hkv + kh) * d.hd, d.hd);
          m = std::max(m, p[j - s0]);
        }
        double sum = 0;
        for (double& e : p) sum += (e = std::exp(e - m));
        double* oi = o.data() + (i * d.Hq + h) * d.hdv;
        for (int64_t j = s0; j <= i; ++j) {
          const double* vj = vv.data() + (j * d.Hkv + kh) * d.hdv;
          for (int64_t c = 0; c < d.hdv; ++c) oi[c] += p[j - s0] / sum * vj[c];
        }
        l[h * d.T + i] = m + std::log(sum);
      }
    }
  });
  store(o, out, "attention output");
  store(l, lse, "attention lse");
}

// P_ij = exp(scale q_i.k_j - lse_i); D_i = dout_i . out_i; dS_ij = P_ij (dout_i . v_j - D_i);
// dq_i = scale sum_j dS_ij k_j; dk_j = scale sum_i dS_ij q_i; dv_j = sum_i P_ij dout_i.
void CpuBackend::attention_backward_impl(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& out, const Tensor& lse, const std::vector<int32_t>& cu_seqlens,
                                         float softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const AttnDims d = attention_dims(q, k, v);
  const std::vector<double> vq = load(q, "attention q"), vk = load(k, "attention k"), vv = load(v, "attention v"),
                            g = load(dout, "attention dout"), vo = load(out, "attention out"),
                            l = load(lse, "attention lse");
  std::vector<double> gq(vq.size(), 0.0), gk(vk.size(), 0.0), gv(vv.size(), 0.0);
  // One task per (sequence, KV head): it owns dk/dv of that head and dq of the query heads of
  // its group; within a task the loops run in the serial order (same bits for any thread count).
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1;
  cpu_parallel_for(B * d.Hkv, 3 * attention_work(cu_seqlens, d.Hq, d.hd), [&](int64_t task0, int64_t task1) {
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t b = task / d.Hkv, kh = task % d.Hkv;
      const int64_t s0 = cu_seqlens[b], s1 = cu_seqlens[b + 1];
      for (int64_t h = kh * d.group; h < (kh + 1) * d.group; ++h) {
        for (int64_t i = s0; i < s1; ++i) {
          const double* qi = vq.data() + (i * d.Hq + h) * d.hd;
          const double* gi = g.data() + (i * d.Hq + h) * d.hdv;
          const double Di = dot(gi, vo.data() + (i * d.Hq + h) * d.hdv, d.hdv);
          double* gqi = gq.data() + (i * d.Hq + h) * d.hd;
          for (int64_t j = s0; j <= i; ++j) {
            const double* kj = vk.data() + (j * d.Hkv + kh) * d.hd;
            const double* vj = vv.data() + (j * d.Hkv + kh) * d.hdv;
            const double P = std::exp(softmax_scale * dot(qi, kj, d.hd) - l[h * d.T + i]);
            const double dS = P * (dot(gi, vj, d.hdv) - Di);
            double* gkj = gk.data() + (j * d.Hkv + kh) * d.hd;
            double* gvj = gv.data() + (j * d.Hkv + kh) * d.hdv;
            for (int64_t c = 0; c < d.hd; ++c) {
              gqi[c] += softmax_scale * dS * kj[c];
              gkj[c] += softmax_scale * dS * qi[c];
            }
            for (int64_t c = 0; c < d.hdv; ++c) gvj[c] += P * gi[c];
          }
        }
      }
    }
  });
  store(gq, dq, "attention dq");
  store(gk, dk, "attention dk");
  store(gv, dv, "attention dv");
}

// ---- paged KV cache --------------------------------------------------------------------------

namespace {

// Stores value x as element `index` of a cache pool (E4M3: e4m3(x / scale)).
void cache_store(Tensor& pool, int64_t index, float x, float scale) {
  switch (pool.dtype()) {
    case DType::F32: pool.data<float>()[index] = x; break;
    case DType::BF16: pool.data<uint16_t>()[index] = bf16_from_float(x); break;
    case DType::E4M3: pool.data<uint8_t>()[index] = e4m3_from_float(x / scale); break;
    default: FP8RL_FAIL("KV cache dtype must be F32, BF16 or E4M3, got ", pool.str());
  }
}

// The values of n consecutive cache elements from `index` (E4M3: e4m3_to_float(q) * scale, one
// float product).
void cache_load_row(const Tensor& pool, int64_t index, int64_t n, float scale, float* out) {
  switch (pool.dtype()) {
    case DType::F32: std::copy_n(pool.data<float>() + index, n, out); break;
    case DType::BF16: {
      const uint16_t* p = pool.data<uint16_t>() + index;
      for (int64_t c = 0; c < n; ++c) out[c] = bf16_to_float(p[c]);
      break;
    }
    case DType::E4M3: {
      const uint8_t* p = pool.data<uint8_t>() + index;
      for (int64_t c = 0; c < n; ++c) out[c] = e4m3_to_float(p[c]) * scale;
      break;
    }
    default: FP8RL_FAIL("KV cache dtype must be F32, BF16 or E4M3, got ", pool.str());
  }
}

}  // namespace

void CpuBackend::kv_write_impl(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) {
  const std::vector<int32_t> slots = load_i32(batch.slots, "paged batch slots");
  const int64_t T = static_cast<int64_t>(slots.size()), H = cache.num_kv_heads, hd = cache.head_dim;
  const bool latent = cache.latent_v_dim > 0;
  const std::vector<double> vk = load(k, "kv_write k"), vv = latent ? std::vector<double>() : load(v, "kv_write v");
  const float* ks = cache.k_scale.data<float>() + layer * H;
  const float* vs = cache.v_scale.data<float>() + layer * H;
  if (cache.dtype == DType::E4M3)
    for (int64_t h = 0; h < H; ++h)
      FP8RL_CHECK(std::isfinite(ks[h]) && ks[h] > 0 && std::isfinite(vs[h]) && vs[h] > 0, "KV cache scales of layer ",
                  layer, " head ", h, " must be finite and > 0, got k ", ks[h], ", v ", vs[h]);
  const int64_t num_slots = int64_t(cache.num_pages) * cache.page_size;
  for (int64_t t = 0; t < T; ++t) {
    FP8RL_CHECK(slots[t] >= 0 && slots[t] < num_slots, "kv_write: slot ", slots[t], " of token ", t,
                " is outside the cache [0, ", num_slots, ")");
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < hd; ++c) {
        const int64_t src = (t * H + h) * hd + c, dst = (int64_t(slots[t]) * H + h) * hd + c;
        cache_store(cache.k[layer], dst, static_cast<float>(vk[src]), ks[h]);
        if (!latent) cache_store(cache.v[layer], dst, static_cast<float>(vv[src]), vs[h]);
      }
    }
  }
}

void CpuBackend::kv_round_impl(Tensor& x, const std::vector<float>& head_scale) {
  const int64_t T = x.dim(0), H = x.dim(1), hd = x.dim(2);
  std::vector<double> v = load(x, "kv_round x");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < hd; ++c) {
        double& e = v[static_cast<size_t>((t * H + h) * hd + c)];
        const float s = head_scale[static_cast<size_t>(h)];
        e = e4m3_to_float(e4m3_from_float(static_cast<float>(e) / s)) * s;  // cache_store + cache_load_row
      }
  store(v, x, "kv_round x");
}

// With fp8_attention, each (token, head) row of q is quantized with s = amax / 448 (the
// quant_scale_from_amax rule, no pow2) and the dequantized e4m3(q / s) * s is used; the
// softmax probabilities stay FP32 in this reference. Each token is computed on its own (its
// positions in order, in double): the result never depends on the batch (batch_invariant holds).
void CpuBackend::attention_paged_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                      float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse) {
  const std::vector<int32_t> seq = load_i32(batch.token_seq, "paged batch token_seq");
  const std::vector<int32_t> pos = load_i32(batch.token_pos, "paged batch token_pos");
  const std::vector<int32_t> table = load_i32(batch.page_table, "paged batch page_table");
  const int64_t B = batch.page_table.dim(0), max_pages = batch.page_table.dim(1);
  const int64_t T = q.dim(0), Hq = q.dim(1), Hkv = cache.num_kv_heads, hd = cache.head_dim, group = Hq / Hkv;
  // V: its own pool, or (a latent MLA cache) the first dv values of the K row, read with k's scale.
  const bool latent = cache.latent_v_dim > 0;
  const int64_t dv = cache.v_dim();
  std::vector<double> vq = load(q, "attention_paged q");
  const float* ks = cache.k_scale.data<float>() + layer * Hkv;
  const float* vs = latent ? ks : cache.v_scale.data<float>() + layer * Hkv;
  const Tensor& vpool = latent ? cache.k[layer] : cache.v[layer];
  std::vector<double> o(T * Hq * dv, 0.0), l(lse ? Hq * T : 0);
  // One task per query token: it writes only its own rows of o and l (and of its copy of q).
  cpu_parallel_for(T, T * Hq * (batch.max_pos + 1) * hd * 2, [&](int64_t t0, int64_t t1) {
    // The cache rows of sequence `cur` at positions [0, have), every KV head, dequantized once
    // for all the task's tokens of that sequence (a prefill's tokens share them): [pos][Hkv][hd].
    std::vector<float> K, V;
    int64_t cur = -1, have = 0;
    std::vector<double> p;
    for (int64_t t = t0; t < t1; ++t) {
      FP8RL_CHECK(seq[t] >= 0 && seq[t] < B, "attention_paged: token ", t, " has sequence ", seq[t], " outside [0, ",
                  B, ")");
      FP8RL_CHECK(pos[t] >= 0 && pos[t] < max_pages * cache.page_size, "attention_paged: token ", t, " position ",
                  pos[t], " does not fit ", max_pages, " pages of ", cache.page_size);
      const int64_t n = pos[t] + 1;
      if (seq[t] != cur) cur = seq[t], have = 0;
      if (n > have) {
        K.resize(static_cast<size_t>(n * Hkv * hd));
        V.resize(static_cast<size_t>(n * Hkv * dv));
        for (int64_t j = have; j < n; ++j) {
          const int32_t page = table[seq[t] * max_pages + j / cache.page_size];
          FP8RL_CHECK(page >= 0 && page < cache.num_pages, "attention_paged: page ", page, " of sequence ", seq[t],
                      " is outside the cache [0, ", cache.num_pages, ")");
          const int64_t slot = int64_t(page) * cache.page_size + j % cache.page_size;
          for (int64_t kh = 0; kh < Hkv; ++kh) {
            cache_load_row(cache.k[layer], (slot * Hkv + kh) * hd, hd, ks[kh], K.data() + (j * Hkv + kh) * hd);
            cache_load_row(vpool, (slot * Hkv + kh) * hd, dv, vs[kh], V.data() + (j * Hkv + kh) * dv);
          }
        }
        have = n;
      }
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kh = h / group;
        double* qi = vq.data() + (t * Hq + h) * hd;
        if (fp8_attention) {
          float amax = 0;
          for (int64_t c = 0; c < hd; ++c) {
            const float x = static_cast<float>(qi[c]);
            if (!std::isfinite(x))
              FP8RL_FAIL_NONFINITE("attention_paged: q of token ", t, " head ", h, " is not finite (", x, ")");
            amax = std::fmax(amax, std::fabs(x));
          }
          const float s = quant_scale_from_amax(amax, false);
          for (int64_t c = 0; c < hd; ++c) qi[c] = e4m3_to_float(e4m3_from_float(static_cast<float>(qi[c]) / s)) * s;
        }
        p.assign(n, 0.0);
        // Each score's sum runs over c in order; four positions at a time only interleave the
        // four independent sums (same bits, four times the additions in flight).
        const int64_t row = Hkv * hd;
        const float* k0 = K.data() + kh * hd;
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
          const float *ka = k0 + j * row, *kb = ka + row, *kc = kb + row, *kd = kc + row;
          double a = 0, b = 0, e = 0, f = 0;
          for (int64_t c = 0; c < hd; ++c) {
            a += qi[c] * ka[c];
            b += qi[c] * kb[c];
            e += qi[c] * kc[c];
            f += qi[c] * kd[c];
          }
          p[j] = softmax_scale * a, p[j + 1] = softmax_scale * b, p[j + 2] = softmax_scale * e;
          p[j + 3] = softmax_scale * f;
        }
        for (; j < n; ++j) {
          const float* kj = k0 + j * row;
          double acc = 0;
          for (int64_t c = 0; c < hd; ++c) acc += qi[c] * kj[c];
          p[j] = softmax_scale * acc;
        }
        double m = -INFINITY;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
        double sum = 0;
        for (double& e : p) sum += (e = std::exp(e - m));
        double* oi = o.data() + (t * Hq + h) * dv;
        for (int64_t j = 0; j < n; ++j) {
          const float* vj = V.data() + (j * Hkv + kh) * dv;
          for (int64_t c = 0; c < dv; ++c) oi[c] += p[j] / sum * vj[c];
        }
        if (lse) l[h * T + t] = m + std::log(sum);
      }
    }
  });
  store(o, out, "attention_paged output");
  if (lse) store(l, *lse, "attention_paged lse");
}

}  // namespace cpu
}  // namespace fp8rl
