// RolloutEngine: continuous batching over the paged KV cache. Each iteration runs one
// generation forward over a mixed batch: the whole prompt of every newly admitted sequence
// (prefill) and the last sampled token of every running one (decode); then one sampling op.
// A sequence is admitted when a batch slot and the pages for prompt + max_new_tokens are free,
// and gives its pages back when it finishes.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"
#include "model/transformer.h"
#include "rollout/rollout.h"

namespace fp8rl {

const char* finish_reason_name(FinishReason r) { return r == FinishReason::Stop ? "stop" : "length"; }

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Sequence {
  int request = 0, index = 0;
  std::vector<int32_t> ids;    // prompt + generated so far
  int prompt_len = 0;
  int cached = 0;              // tokens whose k/v are in the cache
  std::vector<int32_t> pages;  // in order
  std::mt19937_64 rng;
  RolloutSample out;
};

Tensor host_i32(const std::vector<int32_t>& v, Shape shape) {
  Tensor t = Tensor::empty(shape, DType::I32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

}  // namespace

RolloutEngine::RolloutEngine(Backend& be, const ModelWeights& weights, const EnginePrecision& prec, int kv_pages,
                             int page_size, int max_batch)
    : be_(be), prec_(prec), page_size_(page_size), max_batch_(max_batch) {
  FP8RL_CHECK(kv_pages > 0 && page_size > 0 && max_batch > 0, "rollout: kv_pages, page_size and max_batch must "
              "be positive");
  gen_ = generator_weights_alloc(be, weights, prec);
  cache_ = model_alloc_kv_cache(be, weights.config, kv_pages, page_size, prec.kv_cache);
}

void RolloutEngine::refit(const ModelWeights& master, const KvScales* scales) {
  const int L = cache_.num_layers, H = cache_.num_kv_heads;
  // Check the scales before touching anything: a refused refit leaves the engine as it was.
  if (scales) {
    FP8RL_CHECK(static_cast<int>(scales->k.size()) == L && static_cast<int>(scales->v.size()) == L,
                "refit: KV scales for ", scales->k.size(), " layers, the cache has ", L);
    for (int l = 0; l < L; ++l)
      FP8RL_CHECK(std::isfinite(scales->k[l]) && scales->k[l] > 0 && std::isfinite(scales->v[l]) && scales->v[l] > 0,
                  "refit: KV scales must be finite and positive, layer ", l, " has k ", scales->k[l], ", v ",
                  scales->v[l]);
  }
  generator_weights_refit(be_, master, prec_, gen_);
  if (!scales) return;
  Tensor k = Tensor::empty({L, H}, DType::F32), v = Tensor::empty({L, H}, DType::F32);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      k.data<float>()[l * H + h] = scales->k[l];
      v.data<float>()[l * H + h] = scales->v[l];
    }
  be_.copy(k, cache_.k_scale);
  be_.copy(v, cache_.v_scale);
}

KvScales RolloutEngine::kv_scales() const {
  const int L = cache_.num_layers, H = cache_.num_kv_heads;
  Tensor k = be_.to_host(cache_.k_scale), v = be_.to_host(cache_.v_scale);
  KvScales s;
  for (int l = 0; l < L; ++l) {
    s.k.push_back(k.data<float>()[l * H]);
    s.v.push_back(v.data<float>()[l * H]);
  }
  return s;
}

std::vector<RolloutSample> RolloutEngine::generate(const std::vector<RolloutRequest>& requests,
                                                   const SamplingParams& sp) {
  const int V = gen_.config.vocab_size;
  FP8RL_CHECK(sp.max_new_tokens > 0, "max_new_tokens must be positive");
  FP8RL_CHECK(sp.temperature >= 0.0f && sp.top_p > 0.0f && sp.top_p <= 1.0f && sp.top_k >= 0,
              "bad sampling parameters: temperature >= 0, top_p in (0, 1], top_k >= 0");
  stats_ = RolloutStats{};

  std::vector<Sequence> seqs;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    FP8RL_CHECK(!r.prompt.empty(), "request ", i, " has an empty prompt");
    FP8RL_CHECK(r.n >= 1, "request ", i, " asks for ", r.n, " samples");
    for (int32_t id : r.prompt) FP8RL_CHECK(id >= 0 && id < V, "request ", i, ": token id ", id, " outside the vocabulary [0, ", V, ")");
    const int need = static_cast<int>(ceil_div(static_cast<int64_t>(r.prompt.size()) + sp.max_new_tokens, page_size_));
    FP8RL_CHECK(need <= cache_.num_pages, "request ", i, " needs ", need, " KV pages (prompt ", r.prompt.size(),
                " + max_new_tokens ", sp.max_new_tokens, ") but the pool has ", cache_.num_pages,
                "; raise the KV pool size or lower max_new_tokens");
    for (int j = 0; j < r.n; ++j) {
      Sequence s;
      s.request = static_cast<int>(i);
      s.index = j;
      s.ids = r.prompt;
      s.prompt_len = static_cast<int>(r.prompt.size());
      s.rng.seed(splitmix64(sp.seed ^ splitmix64((static_cast<uint64_t>(i) << 32) | static_cast<uint64_t>(j))));
      s.out.request = s.request;
      s.out.index = j;
      stats_.prompt_tokens += s.prompt_len;
      seqs.push_back(std::move(s));
    }
  }

  std::vector<int32_t> free_pages(cache_.num_pages);
  std::iota(free_pages.rbegin(), free_pages.rend(), 0);
  size_t next = 0;                  // next sequence to admit
  std::vector<int> running;         // indices into seqs
  Tensor logits_dev, tokens_dev, logp_dev;

  while (next < seqs.size() || !running.empty()) {
    // Admit. A wave: an iteration that admits new sequences.
    const size_t admitted_before = next;
    while (next < seqs.size() && static_cast<int>(running.size()) < max_batch_) {
      Sequence& s = seqs[next];
      const size_t need = ceil_div(s.prompt_len + sp.max_new_tokens, page_size_);
      if (free_pages.size() < need) break;
      for (size_t p = 0; p < need; ++p) {
        s.pages.push_back(free_pages.back());
        free_pages.pop_back();
      }
      running.push_back(static_cast<int>(next++));
    }
    FP8RL_CHECK(!running.empty(), "rollout: no sequence fits the KV pool");
    if (next > admitted_before) stats_.waves++;

    // The batch: every token not yet in the cache of every running sequence.
    const int B = static_cast<int>(running.size());
    size_t max_pages = 0;
    for (int si : running) max_pages = std::max(max_pages, seqs[si].pages.size());
    std::vector<int32_t> ids, tok_seq, tok_pos, slots, rows, table(B * max_pages, 0);
    int max_pos = 0;
    for (int b = 0; b < B; ++b) {
      Sequence& s = seqs[running[b]];
      std::copy(s.pages.begin(), s.pages.end(), table.begin() + b * max_pages);
      for (int pos = s.cached; pos < static_cast<int>(s.ids.size()); ++pos) {
        ids.push_back(s.ids[pos]);
        tok_seq.push_back(b);
        tok_pos.push_back(pos);
        slots.push_back(s.pages[pos / page_size_] * page_size_ + pos % page_size_);
        max_pos = std::max(max_pos, pos + 1);
      }
      rows.push_back(static_cast<int32_t>(ids.size()) - 1);
      s.cached = static_cast<int>(s.ids.size());
    }
    const int64_t T = static_cast<int64_t>(ids.size());
    PagedBatch batch;
    batch.token_seq = be_.to_device(host_i32(tok_seq, {T}));
    batch.token_pos = be_.to_device(host_i32(tok_pos, {T}));
    batch.slots = be_.to_device(host_i32(slots, {T}));
    batch.page_table = be_.to_device(host_i32(table, {B, static_cast<int64_t>(max_pages)}));
    batch.max_pos = max_pos;
    Tensor ids_dev = be_.to_device(host_i32(ids, {T}));
    Tensor rows_dev = be_.to_device(host_i32(rows, {B}));
    logits_dev = be_.alloc({B, V}, DType::F32);
    model_forward_paged(be_, gen_, prec_, cache_, ids_dev, batch, rows_dev, logits_dev);

    std::vector<float> temp(B, sp.temperature), top_p(B, sp.top_p), uniforms(B);
    std::vector<int> top_k(B, sp.top_k);
    for (int b = 0; b < B; ++b) uniforms[b] = static_cast<float>(seqs[running[b]].rng() >> 40) * 0x1.0p-24f;
    tokens_dev = be_.alloc({B}, DType::I32);
    logp_dev = be_.alloc({B}, DType::F32);
    be_.sample(logits_dev, temp, top_p, top_k, uniforms, tokens_dev, logp_dev);
    Tensor tokens = be_.to_host(tokens_dev), logp = be_.to_host(logp_dev);
    stats_.decode_steps++;

    std::vector<int> still;
    for (int b = 0; b < B; ++b) {
      Sequence& s = seqs[running[b]];
      const int32_t tok = tokens.data<int32_t>()[b];
      s.ids.push_back(tok);
      s.out.tokens.push_back(tok);
      s.out.logp.push_back(logp.data<float>()[b]);
      stats_.generated_tokens++;
      const bool stop = std::find(sp.stop_ids.begin(), sp.stop_ids.end(), tok) != sp.stop_ids.end();
      if (stop || static_cast<int>(s.out.tokens.size()) >= sp.max_new_tokens) {
        s.out.finish = stop ? FinishReason::Stop : FinishReason::Length;
        free_pages.insert(free_pages.end(), s.pages.rbegin(), s.pages.rend());
        s.pages.clear();
      } else {
        still.push_back(running[b]);
      }
    }
    running.swap(still);
  }

  std::vector<RolloutSample> out;
  out.reserve(seqs.size());
  for (auto& s : seqs) out.push_back(std::move(s.out));
  return out;
}

}  // namespace fp8rl
