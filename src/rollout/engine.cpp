// RolloutEngine: continuous batching over the paged KV cache. Each iteration the scheduler
// (scheduler.h) plans a mixed batch of decode tokens and prefill chunks within max_batch_tokens;
// the engine runs one generation forward over it and one sampling op over the sequences whose
// chunk reached their last token, and ends the sequences that stopped.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "core/error.h"
#include "core/rng.h"
#include "model/transformer.h"
#include "rollout/decode_graphs.h"
#include "rollout/rollout.h"
#include "rollout/scheduler.h"

namespace fp8rl {

const char* finish_reason_name(FinishReason r) { return r == FinishReason::Stop ? "stop" : "length"; }

namespace {

// Sample j of global request gi: the seed of its uniforms' stream (top-k / top-p rows) and the
// Philox key of its Gumbel draws (every other row), so a run's tokens depend only on the seed.
uint64_t sequence_key(uint64_t seed, uint64_t gi, int j) {
  return splitmix64(seed ^ splitmix64((gi << 32) | static_cast<uint64_t>(j)));
}

// The first v.size() elements of the device buffer `buf` (I32, 1-D; grown when too small) as
// `shape`, holding v (copied from the host).
Tensor upload(Backend& be, const std::vector<int32_t>& v, Tensor& buf, const Shape& shape) {
  const int64_t n = static_cast<int64_t>(v.size());
  Tensor host = Tensor::empty(shape, DType::I32);
  FP8RL_CHECK(host.numel() == n, "rollout: internal error: upload of ", n, " values as ", shape_str(shape));
  std::copy(v.begin(), v.end(), host.data<int32_t>());
  if (!buf.defined() || buf.numel() < n) buf = be.alloc({std::max<int64_t>(n, 2 * (buf.defined() ? buf.numel() : 0))}, DType::I32);
  Tensor dst = buf.slice_rows(0, n).reshape(shape);
  be.copy(host, dst);
  return dst;
}

}  // namespace

int RolloutStats::iter_kind(int batch, bool prefill) {
  if (prefill) return kIterKinds - 1;
  int k = 0;
  for (int cap = 16; k < kIterKinds - 2 && batch > cap; cap *= 2) ++k;
  return k;
}

const char* RolloutStats::iter_kind_name(int kind) {
  static const char* const names[kIterKinds] = {"B<=16", "B<=32", "B<=64", "B<=128", "B<=256", "B>256", "prefill"};
  return kind >= 0 && kind < kIterKinds ? names[kind] : "?";
}

namespace {

// The sequences of `requests` (n each, in order), every request checked against the vocabulary
// and the pool; `max_seq_pages` receives the most pages one sequence can need.
std::vector<Sequence> generate_make_sequences(const std::vector<RolloutRequest>& requests, const SamplingParams& sp,
                                              int V, int page_size, int usable_pages, RolloutStats& stats,
                                              int& max_seq_pages) {
  std::vector<Sequence> seqs;
  max_seq_pages = 1;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    FP8RL_CHECK(!r.prompt.empty(), "request ", i, " has an empty prompt");
    FP8RL_CHECK(r.n >= 1, "request ", i, " asks for ", r.n, " samples");
    FP8RL_CHECK(r.stop_after.empty() || static_cast<int>(r.stop_after.size()) == r.n, "request ", i, " has ",
                r.stop_after.size(), " stop_after entries for ", r.n, " samples");
    for (int len : r.stop_after)
      FP8RL_CHECK(len >= 1 && len <= sp.max_new_tokens, "request ", i, ": stop_after ", len, " outside [1, ",
                  sp.max_new_tokens, "]");
    for (int32_t id : r.prompt)
      FP8RL_CHECK(id >= 0 && id < V, "request ", i, ": token id ", id, " outside the vocabulary [0, ", V, ")");
    const int need = static_cast<int>(ceil_div(static_cast<int64_t>(r.prompt.size()) + sp.max_new_tokens, page_size));
    max_seq_pages = std::max(max_seq_pages, need);
    FP8RL_CHECK(need <= usable_pages, "request ", i, " needs ", need, " KV pages (prompt ", r.prompt.size(),
                " + max_new_tokens ", sp.max_new_tokens, ") but the pool has ", usable_pages,
                "; raise the KV pool size or lower max_new_tokens");
    for (int j = 0; j < r.n; ++j) {
      Sequence s;
      s.request = static_cast<int>(i);
      s.index = j;
      s.ids = r.prompt;
      s.ids.reserve(r.prompt.size() + sp.max_new_tokens);
      s.prompt_len = static_cast<int>(r.prompt.size());
      s.max_new = r.stop_after.empty() ? sp.max_new_tokens : r.stop_after[j];
      const uint64_t gi = static_cast<uint64_t>(sp.first_request) + static_cast<uint64_t>(i);
      s.rng.seed(sequence_key(sp.seed, gi, j));
      s.out.request = s.request;
      s.out.index = j;
      stats.prompt_tokens += s.prompt_len;
      seqs.push_back(std::move(s));
    }
  }
  return seqs;
}

// Host staging of one iteration's batch (capacity kept across iterations).
struct HostBatch {
  std::vector<int32_t> ids, tok_seq, tok_pos, slots, rows, table, packed;
  std::vector<SampleRow> sample_rows;
  size_t max_pages = 0;  // page-table width
  int max_pos = 0;
  bool any_row = false;  // false: only unfinished prefills (one row computed, not sampled)
};

// The batch: each scheduled sequence's chunk; a row of logits for each chunk that ends at its
// sequence's last token (the others are unfinished prefills).
void generate_stage_batch(const std::vector<Sequence>& seqs, const std::vector<int>& batch_seqs, int page_size,
                          HostBatch& hb) {
  const int B = static_cast<int>(batch_seqs.size());
  hb.max_pages = 0;
  for (int si : batch_seqs) hb.max_pages = std::max(hb.max_pages, seqs[si].pages.size());
  hb.ids.clear(), hb.tok_seq.clear(), hb.tok_pos.clear(), hb.slots.clear(), hb.rows.clear();
  hb.table.assign(B * hb.max_pages, 0);
  hb.max_pos = 0;
  for (int b = 0; b < B; ++b) {
    const Sequence& s = seqs[batch_seqs[b]];
    std::copy(s.pages.begin(), s.pages.end(), hb.table.begin() + b * hb.max_pages);
    for (int pos = s.cached; pos < s.cached + s.chunk; ++pos) {
      hb.ids.push_back(s.ids[pos]);
      hb.tok_seq.push_back(b);
      hb.tok_pos.push_back(pos);
      hb.slots.push_back(s.pages[pos / page_size] * page_size + pos % page_size);
    }
    hb.max_pos = std::max(hb.max_pos, s.cached + s.chunk);
    if (s.samples()) hb.rows.push_back(static_cast<int32_t>(hb.ids.size()) - 1);
  }
  hb.any_row = !hb.rows.empty();
  if (!hb.any_row) hb.rows.push_back(0);  // only unfinished prefills: one row computed, not sampled
}

// Each sampled sequence's draw: key (seed, request, sample), counter = the position of the token
// drawn; the uniform, when it truncates, from its own stream once per sampled token.
void generate_stage_sample_rows(std::vector<Sequence>& seqs, const std::vector<int>& batch_seqs,
                                const SamplingParams& sp, bool truncation, HostBatch& hb) {
  hb.sample_rows.clear();
  for (int si : batch_seqs) {
    Sequence& s = seqs[si];
    if (!s.samples()) continue;
    SampleRow r;
    r.temperature = sp.temperature;
    r.top_p = sp.top_p;
    r.top_k = sp.top_k;
    if (truncation) r.uniform = static_cast<float>(s.rng() >> 40) * 0x1.0p-24f;
    const uint64_t key = sequence_key(sp.seed, static_cast<uint64_t>(sp.first_request) + s.request, s.index);
    r.key_lo = static_cast<uint32_t>(key), r.key_hi = static_cast<uint32_t>(key >> 32);
    r.counter = static_cast<uint32_t>(s.len());
    hb.sample_rows.push_back(r);
  }
  if (!hb.any_row) hb.sample_rows.emplace_back().temperature = 0.0f;  // (never run)
}

// The sampled tokens appended to their sequences; a sequence that stopped (a stop id, its
// stop_after) or reached max_new_tokens is finished. `slots_done` counts progress.
void generate_append_tokens(std::vector<Sequence>& seqs, const std::vector<int>& batch_seqs,
                            const std::vector<RolloutRequest>& requests, const SamplingParams& sp,
                            const Tensor& tokens, const Tensor& logp, Scheduler& sched, RolloutStats& stats,
                            int64_t& slots_done) {
  int r = 0;
  for (int si : batch_seqs) {
    Sequence& s = seqs[si];
    if (s.cached != s.len()) continue;
    const int32_t tok = tokens.data<int32_t>()[r];
    s.ids.push_back(tok);
    s.out.tokens.push_back(tok);
    s.out.logp.push_back(logp.data<float>()[r++]);
    stats.generated_tokens++;
    ++slots_done;
    const int n_out = static_cast<int>(s.out.tokens.size());
    const bool forced = !requests[s.request].stop_after.empty() && n_out >= s.max_new;
    const bool stop = forced || std::find(sp.stop_ids.begin(), sp.stop_ids.end(), tok) != sp.stop_ids.end();
    if (stop || n_out >= sp.max_new_tokens) {
      s.out.finish = stop ? FinishReason::Stop : FinishReason::Length;
      sched.finish(si);
      slots_done += sp.max_new_tokens - static_cast<int64_t>(s.out.tokens.size());
    }
  }
}

// Routing record (SamplingParams::record_routing): the experts of the batch's tokens in every MoE
// layer (`rec`, [layers][T * k]) written at their sequences' positions.
void generate_record_routing(std::vector<Sequence>& seqs, const std::vector<int>& batch_seqs, const HostBatch& hb,
                             const MoeRouting& rec) {
  const int64_t Lm = static_cast<int64_t>(rec.ids.size()), k = rec.top_k, stride = Lm * k;
  for (size_t i = 0; i < hb.ids.size(); ++i) {
    Sequence& s = seqs[batch_seqs[hb.tok_seq[i]]];
    const int64_t pos = hb.tok_pos[i];
    std::vector<int16_t>& r = s.out.routing;
    if (static_cast<int64_t>(r.size()) < (pos + 1) * stride) {
      r.reserve(static_cast<size_t>((s.prompt_len + s.max_new) * stride));
      r.resize(static_cast<size_t>((pos + 1) * stride), -1);
    }
    for (int64_t m = 0; m < Lm; ++m)
      for (int64_t j = 0; j < k; ++j)
        r[(pos * Lm + m) * k + j] = static_cast<int16_t>(rec.ids[m][i * k + j]);
  }
}

// Each sample's record sized to its prompt + tokens; prompt positions it did not compute (pages
// shared from another sample of its request) take the routing of a sample that did.
void generate_finish_routing(std::vector<Sequence>& seqs, int64_t stride) {
  std::vector<std::vector<Sequence*>> by_request;
  for (Sequence& s : seqs) {
    if (static_cast<int>(by_request.size()) <= s.request) by_request.resize(s.request + 1);
    by_request[s.request].push_back(&s);
    s.out.routing.resize(static_cast<size_t>((s.prompt_len + s.out.tokens.size()) * stride), -1);
  }
  for (const std::vector<Sequence*>& group : by_request)
    for (Sequence* s : group)
      for (int64_t p = 0; p < s->prompt_len; ++p) {
        int16_t* dst = s->out.routing.data() + p * stride;
        if (dst[0] >= 0) continue;
        for (const Sequence* o : group)
          if (o->out.routing[p * stride] >= 0) {
            std::copy_n(o->out.routing.data() + p * stride, stride, dst);
            break;
          }
      }
}

}  // namespace

RolloutEngine::RolloutEngine(Backend& be, const ModelWeights& weights, const EnginePrecision& prec, int kv_pages,
                             int page_size, int max_batch, const SchedulerOptions& options)
    : be_(be), prec_(prec), page_size_(page_size), max_batch_(max_batch), opt_(options) {
  FP8RL_CHECK(kv_pages > 0 && page_size > 0 && max_batch > 0 && options.max_batch_tokens > 0,
              "rollout: kv_pages, page_size, max_batch and max_batch_tokens must be positive");
  model_check_consistent(weights.config, prec);
  gen_ = generator_weights_alloc(be, weights, prec);
  cache_ = model_alloc_kv_cache(be, weights.config, kv_pages, page_size, prec.kv_cache);
  buf_.packed = be.alloc({5 * static_cast<int64_t>(options.max_batch_tokens) + 64 * max_batch}, DType::I32);
  buf_.tokens = be.alloc({max_batch}, DType::I32);
  buf_.logp = be.alloc({max_batch}, DType::F32);
  // Decode-only steps replay CUDA graphs where the backend can record them; the pool's last
  // page is then kept back for the graphs' padding rows.
  if (options.cuda_graphs && kv_pages > 1) {
    graphs_ = std::make_unique<DecodeGraphs>(be, gen_, prec_, cache_, max_batch, kv_pages - 1);
    if (graphs_->disabled()) graphs_.reset();
  }
}

RolloutEngine::~RolloutEngine() = default;

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
  FP8RL_CHECK(sp.valid_vocab >= 0, "valid_vocab must be >= 0 (0: the whole vocabulary), got ", sp.valid_vocab);
  const int64_t valid_vocab = sp.valid_vocab > 0 ? std::min<int64_t>(sp.valid_vocab, V) : V;
  FP8RL_CHECK(sp.temperature >= 0.0f && sp.top_p > 0.0f && sp.top_p <= 1.0f && sp.top_k >= 0,
              "bad sampling parameters: temperature >= 0, top_p in (0, 1], top_k >= 0");
  stats_ = RolloutStats{};

  const int usable_pages = cache_.num_pages - (graphs_ ? 1 : 0);  // the graphs' padding page
  int max_seq_pages = 1;
  std::vector<Sequence> seqs =
      generate_make_sequences(requests, sp, V, page_size_, usable_pages, stats_, max_seq_pages);
  Scheduler sched(seqs, usable_pages, {page_size_, max_batch_, opt_.max_batch_tokens, opt_.prefix_sharing}, stats_);
  HostBatch hb;
  // Top-k / top-p rows draw by inverse CDF with a uniform from the sequence's stream; plain
  // temperature rows (and greedy ones) by Gumbel-max keyed by (sequence, position): one read of
  // the logits (Backend::sample_rows).
  const bool truncation = sp.temperature > 0.0f && (sp.top_k > 0 || sp.top_p < 1.0f);
  // The consistent mode: logp_gen by logprobs_of_logits (token_logprobs' reduction, the
  // trainer's code) of the sampled tokens over the logits the sampler drew from, in place of the
  // sampler's own reduction (greedy rows keep the sampler's 0).
  const float consistent_temperature = prec_.exact_logits() ? sp.temperature : 0.0f;
  std::vector<const std::vector<int32_t>*> graph_pages;
  const ModelConfig& mc = gen_.config;
  const bool record = sp.record_routing && mc.is_moe();
  if (record)
    FP8RL_CHECK(mc.num_experts <= 32767, "rollout: the routing record holds 16-bit expert ids; the model has ",
                mc.num_experts, " experts");
  MoeRouting rec;
  // Progress in token slots: every sample has max_new_tokens; a finished one counts them all.
  int64_t slots_done = 0;
  const int64_t slots_total = static_cast<int64_t>(seqs.size()) * sp.max_new_tokens;
  using Clock = std::chrono::steady_clock;
  const auto t_loop = Clock::now();
  while (!sched.done()) {
    if (sp.on_progress) sp.on_progress(slots_done, slots_total);
    const auto t_iter = Clock::now();
    const std::vector<int>& batch_seqs = sched.schedule();
    if (batch_seqs.empty()) continue;  // everything scheduled was preempted: plan again
    generate_stage_batch(seqs, batch_seqs, page_size_, hb);
    generate_stage_sample_rows(seqs, batch_seqs, sp, truncation, hb);

    // The forward and the sampling op: a recorded decode graph, else one eager pass.
    const int B = static_cast<int>(batch_seqs.size());
    const int64_t T = static_cast<int64_t>(hb.ids.size()), R = static_cast<int64_t>(hb.rows.size());
    Tensor tokens_dev, logp_dev, routing_dev;
    bool ran = false;
    if (graphs_ && T == B && R == B) {  // decode only: one token per sequence, each sampled
      graph_pages.clear();
      for (int si : batch_seqs) graph_pages.push_back(&seqs[si].pages);
      ran = graphs_->run(hb.ids, hb.tok_pos, hb.slots, graph_pages, max_seq_pages, hb.sample_rows, truncation,
                         valid_vocab, consistent_temperature, tokens_dev, logp_dev, record ? &routing_dev : nullptr);
      if (ran) stats_.graph_steps++;
    }
    if (!ran) {
      // One upload of [ids | seq | pos | slots | rows | page table | SampleRows] (one host round trip).
      std::vector<int32_t>& packed = hb.packed;
      packed.clear();
      for (const auto* v : {&hb.ids, &hb.tok_seq, &hb.tok_pos, &hb.slots, &hb.rows, &hb.table})
        packed.insert(packed.end(), v->begin(), v->end());
      const size_t sr0 = packed.size();
      packed.resize(sr0 + 8 * hb.sample_rows.size());
      std::memcpy(packed.data() + sr0, hb.sample_rows.data(), hb.sample_rows.size() * sizeof(SampleRow));
      const Tensor all = upload(be_, packed, buf_.packed, {static_cast<int64_t>(packed.size())});
      PagedBatch batch;
      const Tensor ids_dev = all.slice_rows(0, T);
      batch.token_seq = all.slice_rows(T, 2 * T);
      batch.token_pos = all.slice_rows(2 * T, 3 * T);
      batch.slots = all.slice_rows(3 * T, 4 * T);
      const Tensor rows_dev = all.slice_rows(4 * T, 4 * T + R);
      batch.page_table = all.slice_rows(4 * T + R, 4 * T + R + static_cast<int64_t>(hb.table.size()))
                             .reshape({B, static_cast<int64_t>(hb.max_pages)});
      batch.max_pos = hb.max_pos;
      const Tensor srows_dev =
          all.slice_rows(static_cast<int64_t>(sr0), static_cast<int64_t>(packed.size())).reshape({R, 8});
      if (!buf_.logits.defined() || buf_.logits.dim(0) < R)
        buf_.logits = be_.alloc({R, V}, model_logits_dtype(be_, gen_, prec_));
      Tensor logits = buf_.logits.slice_rows(0, R);
      // The routing record stays on the device during the forward (its MoE blocks then never wait
      // for the host) and comes down with the step's tokens.
      if (record) {
        const int64_t Lm = model_num_moe_layers(mc), n = Lm * T * mc.num_experts_per_tok;
        if (!buf_.routing.defined() || buf_.routing.numel() < n) buf_.routing = be_.alloc({n}, DType::I32);
        routing_dev = buf_.routing.slice_rows(0, n).reshape({Lm, T * mc.num_experts_per_tok});
      }
      model_forward_paged(be_, gen_, prec_, cache_, ids_dev, batch, rows_dev, logits, nullptr, nullptr,
                          record ? &routing_dev : nullptr);
      tokens_dev = buf_.tokens.slice_rows(0, R), logp_dev = buf_.logp.slice_rows(0, R);
      if (hb.any_row) be_.sample_rows(logits, srows_dev, truncation, tokens_dev, logp_dev, valid_vocab);
      if (hb.any_row && consistent_temperature > 0.0f)  // token_logprobs' reduction on these rows
        model_sampled_logprobs(be_, logits, tokens_dev, consistent_temperature, logp_dev);
    }
    stats_.decode_steps++;
    sched.commit();
    // The iteration's bucket (RolloutStats::iter_kind), timed to its end: when it samples, after
    // its tokens are on the host (the scope's end); a prefill chunk that samples nothing, now.
    struct IterTimer {
      RolloutStats& st;
      int kind;
      Clock::time_point t0;
      ~IterTimer() {
        st.iter_steps[kind]++;
        st.iter_seconds[kind] += std::chrono::duration<double>(Clock::now() - t0).count();
      }
    } iter_timer{stats_, RolloutStats::iter_kind(B, T != B), t_iter};
    if (record) {  // after the step's work is queued (a prefill chunk without sampled rows waits here)
      const auto t_wait = Clock::now();
      const Tensor ids = be_.to_host(routing_dev);
      stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - t_wait).count();
      const int64_t per = routing_dev.dim(1);  // T * k, or a graph's padded Bp * k (the first T * k are the batch's)
      rec.top_k = mc.num_experts_per_tok;
      rec.ids.resize(static_cast<size_t>(routing_dev.dim(0)));
      for (size_t m = 0; m < rec.ids.size(); ++m)
        rec.ids[m].assign(ids.data<int32_t>() + static_cast<int64_t>(m) * per,
                          ids.data<int32_t>() + static_cast<int64_t>(m + 1) * per);
      generate_record_routing(seqs, batch_seqs, hb, rec);
    }
    if (!hb.any_row) continue;
    const auto t_wait = Clock::now();
    const Tensor tokens = be_.to_host(tokens_dev), logp = be_.to_host(logp_dev);
    stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - t_wait).count();
    generate_append_tokens(seqs, batch_seqs, requests, sp, tokens, logp, sched, stats_, slots_done);
  }

  stats_.loop_seconds = std::chrono::duration<double>(Clock::now() - t_loop).count();
  if (record) generate_finish_routing(seqs, int64_t(model_num_moe_layers(mc)) * mc.num_experts_per_tok);
  std::vector<RolloutSample> out;
  out.reserve(seqs.size());
  for (auto& s : seqs) out.push_back(std::move(s.out));
  return out;
}

}  // namespace fp8rl
