#include "bench/rollout_bench.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/transformer.h"

namespace fp8rl {

namespace {

// host[0, n) <- amp * u, u uniform in [-1, 1) from hash(key, i); F32 or BF16; host threads.
void fill_uniform_host(void* host, DType dtype, int64_t n, uint64_t key, float amp) {
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 64);
  const int64_t chunk = std::max<int64_t>(int64_t(1) << 16, ceil_div(n, threads));
  auto work = [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t h = splitmix64(key + static_cast<uint64_t>(i));  // splitmix64's stream from key
      const float v = amp * (static_cast<float>(h >> 40) * 0x1.0p-23f - 1.0f);
      if (dtype == DType::BF16) static_cast<uint16_t*>(host)[i] = bf16_from_float(v);
      else static_cast<float*>(host)[i] = v;
    }
  };
  std::vector<std::thread> pool;
  for (int64_t b = chunk; b < n; b += chunk) pool.emplace_back(work, b, std::min(n, b + chunk));
  work(0, std::min(n, chunk));
  for (auto& t : pool) t.join();
}

}  // namespace

ModelWeights bench_random_weights(Backend& be, const ModelConfig& c, DType dtype, uint64_t seed, float std) {
  FP8RL_CHECK(dtype == DType::F32 || dtype == DType::BF16, "bench weights are F32 or BF16, not ", dtype_name(dtype));
  c.validate();
  FP8RL_CHECK(!c.attention_bias, "bench weights have no q/k/v biases (", c.model_type, " with attention_bias)");
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  // MLA (q without compression or q_a/q_b, kv_a, kv_b, o) and the experts' widths.
  const int64_t qk = c.qk_head_dim(), kvr = c.kv_lora_rank, qr = c.q_lora_rank, dv = c.v_head_dim;
  const int64_t Fe = c.moe_intermediate_size, Fs = int64_t(c.n_shared_experts) * Fe;
  const int64_t largest =
      std::max({V * D, F * D, Hq * hd * D, Hq * qk * std::max(D, qr), (kvr + c.qk_rope_head_dim) * D,
                Hq * (c.qk_nope_head_dim + dv) * kvr, Hq * dv * D, Fe * D, Fs * D, int64_t(c.num_experts) * D});
  Tensor staging = Tensor::empty({largest}, dtype);
  const float amp = std * std::sqrt(3.0f);
  uint64_t tensor_index = 0;
  auto random = [&](const Shape& shape) {
    Tensor host(staging.storage(), 0, shape, dtype);
    fill_uniform_host(host.raw(), dtype, host.numel(), splitmix64(seed) ^ splitmix64(~tensor_index++), amp);
    Tensor dev = be.alloc(shape, dtype);
    be.copy(host, dev);  // host -> device waits before returning: the staging buffer is free again
    return dev;
  };
  auto ones = [&](int64_t n) {
    Tensor t = be.alloc({n}, dtype);
    be.fill(t, 1.0f);
    return t;
  };
  auto linear = [&](int64_t n, int64_t k) {
    LinearWeight w;
    w.w = random({n, k});
    return w;
  };
  ModelWeights w;
  w.config = c;
  w.embed = random({V, D});
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights L;
    L.attn_norm = ones(D);
    if (c.is_mla()) {  // as model_weights_random lays MLA out (model/weights.h)
      if (qr > 0) {
        L.q_a = linear(qr, D);
        L.q_a_norm = ones(qr);
        L.q_b = linear(Hq * qk, qr);
      } else {
        L.q = linear(Hq * qk, D);
      }
      L.kv_a = linear(kvr + c.qk_rope_head_dim, D);
      L.kv_a_norm = ones(kvr);
      L.kv_b = linear(Hq * (c.qk_nope_head_dim + dv), kvr);
      L.o.w = random({D, Hq * dv});
    } else {
      L.q = linear(Hq * hd, D);
      L.k = linear(Hkv * hd, D);
      L.v = linear(Hkv * hd, D);
      L.o.w = random({D, Hq * hd});
    }
    if (c.qk_norm) {
      L.q_norm = ones(hd);
      L.k_norm = ones(hd);
    }
    L.mlp_norm = ones(D);
    if (c.layer_is_moe(l)) {
      // Router and experts as random as the rest: with std 0.02 the router logits are small, so
      // the routing is near uniform and every expert gets a ragged share of the tokens.
      L.router = linear(c.num_experts, D);
      if (c.moe_router == "sigmoid") L.router_bias = random({c.num_experts});
      L.experts.resize(c.num_experts);
      for (ExpertWeights& e : L.experts) {
        e.gate = linear(Fe, D);
        e.up = linear(Fe, D);
        e.down = linear(D, Fe);
      }
      if (Fs > 0) {  // the always-on shared experts (DeepSeek-V3)
        L.gate = linear(Fs, D);
        L.up = linear(Fs, D);
        L.down = linear(D, Fs);
      }
    } else {
      L.gate.w = random({F, D});
      L.up.w = random({F, D});
      L.down.w = random({D, F});
    }
    w.layers.push_back(std::move(L));
  }
  w.final_norm = ones(D);
  w.lm_head = c.tie_word_embeddings ? w.embed : random({V, D});
  be.synchronize();
  return w;
}

int64_t bench_weights_bytes(const ModelWeights& w) {
  int64_t bytes = 0;
  auto add = [&](const Tensor& t) { bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; };
  auto add_linear = [&](const LinearWeight& lw) {
    add(lw.w);
    add(lw.wq.data);
    add(lw.wq.scales);
    add(lw.wqt.data);
    add(lw.wqt.scales);
    add(lw.bias);
  };
  add(w.embed);
  add(w.final_norm);
  if (w.lm_head.defined() && w.lm_head.storage() != w.embed.storage()) add(w.lm_head);
  for (const LayerWeights& L : w.layers) {
    for (const Tensor* t : {&L.attn_norm, &L.mlp_norm, &L.q_norm, &L.k_norm, &L.q_a_norm, &L.kv_a_norm, &L.router_bias})
      add(*t);
    for (const LinearWeight* lw :
         {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down, &L.q_a, &L.q_b, &L.kv_a, &L.kv_b, &L.router})
      add_linear(*lw);
    for (const ExpertWeights& e : L.experts)
      for (const LinearWeight* lw : {&e.gate, &e.up, &e.down}) add_linear(*lw);
  }
  return bytes;
}

int64_t bench_kv_bytes_per_token(const ModelConfig& c, DType kv_dtype) {
  const KvCacheShape s = model_kv_cache_shape(c);  // MLA: one latent row per token, no V pool
  const int64_t pools = s.latent_v_dim > 0 ? 1 : 2;
  return pools * c.num_layers * s.num_kv_heads * s.head_dim * static_cast<int64_t>(dtype_size(kv_dtype));
}

DecodeRoofline bench_decode_roofline(double weight_bytes_per_step, double row_bytes, double kv_bytes_per_token,
                                     int prompts, int prompt_len, int gen_len, int concurrency) {
  FP8RL_CHECK(prompts > 0 && prompt_len > 0 && gen_len > 0 && concurrency > 0,
              "roofline: prompts, prompt_len, gen_len and concurrency must be positive");
  DecodeRoofline r;
  for (int start = 0; start < prompts; start += concurrency) {
    const double n = std::min(concurrency, prompts - start);
    for (int s = 1; s < gen_len; ++s) {
      r.steps++;
      r.weight_bytes += weight_bytes_per_step + n * row_bytes;
      r.kv_bytes += n * static_cast<double>(prompt_len + s) * kv_bytes_per_token;
    }
  }
  return r;
}

}  // namespace fp8rl
