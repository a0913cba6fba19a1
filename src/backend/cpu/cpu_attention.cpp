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

AttnDims check_attention_args(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::vector<int32_t>& cu_seqlens) {
  FP8RL_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, "attention needs q [T, Hq, hd], k/v [T, Hkv, hd], got ",
              q.str(), ", ", k.str(), ", ", v.str());
  AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), 0, v.dim(2)};
  FP8RL_CHECK(k.dim(0) == d.T && k.dim(2) == d.hd && v.dim(0) == d.T && v.dim(1) == d.Hkv && d.hdv > 0,
              "attention: k ", k.str(), " must be [", d.T, ", Hkv, ", d.hd, "] and v ", v.str(), " [", d.T,
              ", Hkv, hdv]");
  FP8RL_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0, "attention: Hq = ", d.Hq, " is not a multiple of Hkv = ", d.Hkv);
  d.group = d.Hq / d.Hkv;
  FP8RL_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == d.T,
              "attention: cu_seqlens must run from 0 to T = ", d.T, " (got ", cu_seqlens.size(), " entries)");
  for (size_t b = 1; b < cu_seqlens.size(); ++b)
    FP8RL_CHECK(cu_seqlens[b] >= cu_seqlens[b - 1], "attention: cu_seqlens decreases at entry ", b);
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

void CpuBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu_seqlens,
                           float softmax_scale, Tensor& out, Tensor& lse) {
  const AttnDims d = check_attention_args(q, k, v, cu_seqlens);
  check_shape(out, {d.T, d.Hq, d.hdv}, "attention output");
  check_shape(lse, {d.Hq, d.T}, "attention lse");
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
void CpuBackend::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, const std::vector<int32_t>& cu_seqlens,
                                    float softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const AttnDims d = check_attention_args(q, k, v, cu_seqlens);
  check_shape(dout, {d.T, d.Hq, d.hdv}, "attention dout");
  check_shape(out, {d.T, d.Hq, d.hdv}, "attention out");
  check_shape(lse, {d.Hq, d.T}, "attention lse");
  check_shape(dq, q.shape(), "attention dq");
  check_shape(dk, k.shape(), "attention dk");
  check_shape(dv, v.shape(), "attention dv");
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

void check_cache_layer(const KvCache& cache, int layer) {
  const bool latent = cache.latent_v_dim > 0;  // MLA: K pools only, V = the first latent_v_dim of K
  FP8RL_CHECK(layer >= 0 && layer < cache.num_layers && static_cast<int>(cache.k.size()) == cache.num_layers &&
                  static_cast<int>(cache.v.size()) == (latent ? 0 : cache.num_layers),
              "KV cache layer ", layer, " out of range [0, ", cache.num_layers, ")");
  FP8RL_CHECK(cache.latent_v_dim <= cache.head_dim, "KV cache: latent_v_dim ", cache.latent_v_dim, " > head_dim ",
              cache.head_dim);
  check_shape(cache.k[layer], {cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim}, "KV cache k");
  check_dtype(cache.k[layer], cache.dtype, "KV cache k");
  if (!latent) {
    check_shape(cache.v[layer], {cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim}, "KV cache v");
    check_dtype(cache.v[layer], cache.dtype, "KV cache v");
  }
  check_shape(cache.k_scale, {cache.num_layers, cache.num_kv_heads}, "KV cache k_scale");
  check_shape(cache.v_scale, {cache.num_layers, cache.num_kv_heads}, "KV cache v_scale");
  check_dtype(cache.k_scale, DType::F32, "KV cache k_scale");
  check_dtype(cache.v_scale, DType::F32, "KV cache v_scale");
}

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

void CpuBackend::kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) {
  check_cache_layer(cache, layer);
  const std::vector<int32_t> slots = load_i32(batch.slots, "paged batch slots");
  const int64_t T = static_cast<int64_t>(slots.size()), H = cache.num_kv_heads, hd = cache.head_dim;
  const bool latent = cache.latent_v_dim > 0;
  check_shape(k, {T, H, hd}, "kv_write k");
  if (latent)
    FP8RL_CHECK(!v.defined(), "kv_write: a latent (MLA) cache stores k only; v must be undefined, got ", v.str());
  else
    check_shape(v, {T, H, hd}, "kv_write v");
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

void CpuBackend::kv_round(Tensor& x, const std::vector<float>& head_scale) {
  check_float(x, "kv_round x");
  kv_round_check(x, head_scale);
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
// softmax probabilities stay FP32 in this reference.
void CpuBackend::attention_paged(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                 float softmax_scale, bool fp8_attention, Tensor& out) {
  check_cache_layer(cache, layer);
  const std::vector<int32_t> seq = load_i32(batch.token_seq, "paged batch token_seq");
  const std::vector<int32_t> pos = load_i32(batch.token_pos, "paged batch token_pos");
  const std::vector<int32_t> table = load_i32(batch.page_table, "paged batch page_table");
  FP8RL_CHECK(batch.page_table.ndim() == 2, "page_table must be [B, max_pages], got ", batch.page_table.str());
  const int64_t B = batch.page_table.dim(0), max_pages = batch.page_table.dim(1);
  FP8RL_CHECK(q.ndim() == 3 && q.dim(2) == cache.head_dim && q.dim(1) % cache.num_kv_heads == 0,
              "attention_paged q must be [T, Hq, ", cache.head_dim, "] with Hq a multiple of ", cache.num_kv_heads,
              ", got ", q.str());
  const int64_t T = q.dim(0), Hq = q.dim(1), Hkv = cache.num_kv_heads, hd = cache.head_dim, group = Hq / Hkv;
  // V: its own pool, or (a latent MLA cache) the first dv values of the K row, read with k's scale.
  const bool latent = cache.latent_v_dim > 0;
  const int64_t dv = cache.v_dim();
  FP8RL_CHECK(static_cast<int64_t>(seq.size()) == T && static_cast<int64_t>(pos.size()) == T,
              "attention_paged: token_seq and token_pos need ", T, " entries");
  check_shape(out, {T, Hq, dv}, "attention_paged output");
  std::vector<double> vq = load(q, "attention_paged q");
  const float* ks = cache.k_scale.data<float>() + layer * Hkv;
  const float* vs = latent ? ks : cache.v_scale.data<float>() + layer * Hkv;
  const Tensor& vpool = latent ? cache.k[layer] : cache.v[layer];
  std::vector<double> o(T * Hq * dv, 0.0);
  // One task per query token: it writes only its own rows of o (and of its copy of q).
  cpu_parallel_for(T, T * Hq * (batch.max_pos + 1) * hd * 2, [&](int64_t t0, int64_t t1) {
    std::vector<double> p;
    std::vector<float> kj(hd), vj(dv);
    for (int64_t t = t0; t < t1; ++t) {
      FP8RL_CHECK(seq[t] >= 0 && seq[t] < B, "attention_paged: token ", t, " has sequence ", seq[t], " outside [0, ",
                  B, ")");
      FP8RL_CHECK(pos[t] >= 0 && pos[t] < max_pages * cache.page_size, "attention_paged: token ", t, " position ",
                  pos[t], " does not fit ", max_pages, " pages of ", cache.page_size);
      const int64_t n = pos[t] + 1;
      auto slot_of = [&](int64_t j) {
        const int32_t page = table[seq[t] * max_pages + j / cache.page_size];
        FP8RL_CHECK(page >= 0 && page < cache.num_pages, "attention_paged: page ", page, " of sequence ", seq[t],
                    " is outside the cache [0, ", cache.num_pages, ")");
        return int64_t(page) * cache.page_size + j % cache.page_size;
      };
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
        double m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          cache_load_row(cache.k[layer], (slot_of(j) * Hkv + kh) * hd, hd, ks[kh], kj.data());
          double acc = 0;
          for (int64_t c = 0; c < hd; ++c) acc += qi[c] * kj[c];
          p[j] = softmax_scale * acc;
          m = std::max(m, p[j]);
        }
        double sum = 0;
        for (double& e : p) sum += (e = std::exp(e - m));
        double* oi = o.data() + (t * Hq + h) * dv;
        for (int64_t j = 0; j < n; ++j) {
          cache_load_row(vpool, (slot_of(j) * Hkv + kh) * hd, dv, vs[kh], vj.data());
          for (int64_t c = 0; c < dv; ++c) oi[c] += p[j] / sum * vj[c];
        }
      }
    }
  });
  store(o, out, "attention_paged output");
}

}  // namespace cpu
}  // namespace fp8rl
