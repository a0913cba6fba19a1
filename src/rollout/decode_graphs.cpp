#include "rollout/decode_graphs.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "model/transformer.h"

namespace fp8rl {

namespace {
// The decode graphs' input buffer for Bp rows and a page-table width W, element offsets:
// [ids | seq | pos | slots | rows | page table (Bp x W) | sampling rows (Bp x 8)].
struct InLayout {
  int64_t table, srows, size;
  InLayout(int64_t Bp, int64_t W) : table(5 * Bp), srows(table + Bp * W), size(srows + 8 * Bp) {}
};
}  // namespace

DecodeGraphs::DecodeGraphs(Backend& be, const ModelWeights& weights, const EnginePrecision& prec, KvCache& cache,
                           int max_batch, int dummy_page)
    : be_(be), gen_(weights), prec_(prec), cache_(cache), max_batch_(max_batch), dummy_page_(dummy_page) {
  FP8RL_CHECK(dummy_page >= 0 && dummy_page < cache.num_pages, "decode graphs: dummy page ", dummy_page,
              " outside the pool of ", cache.num_pages);
  disabled_ = be_.record([] {}) == nullptr;  // the CPU, FP8RL_CUDA_GRAPHS=0, plain allocation
  // Mixture-of-experts blocks sort their experts' rows on the device (moe_plan) and keep the
  // routing record there (routing_), so their decode step records like a dense one.
}

// Padded batch sizes: multiples of 16 (cuBLASLt's FP8 block GEMMs need M % 16 == 0, so every
// replay takes the tensor cores), 16 apart up to 64, then 32 apart, capped at max_batch.
int DecodeGraphs::bucket(int B) const {
  const int step = B <= 64 ? 16 : 32;
  return std::min((B + step - 1) / step * step, max_batch_);
}

void DecodeGraphs::step(int Bp) {
  const int64_t W = width_;
  PagedBatch batch;
  const Tensor ids = in_.slice_rows(0, Bp);
  batch.token_seq = in_.slice_rows(Bp, 2 * Bp);
  batch.token_pos = in_.slice_rows(2 * Bp, 3 * Bp);
  batch.slots = in_.slice_rows(3 * Bp, 4 * Bp);
  const Tensor rows = in_.slice_rows(4 * Bp, 5 * Bp);
  const InLayout L(Bp, W);
  batch.page_table = in_.slice_rows(L.table, L.srows).reshape({Bp, W});
  batch.max_pos = static_cast<int>(W) * cache_.page_size;  // fixed: sequences grow under one graph
  Tensor logits = logits_.slice_rows(0, Bp);
  Tensor routing = routing_view(Bp);
  model_forward_paged(be_, gen_, prec_, cache_, ids, batch, rows, logits, nullptr, nullptr,
                      routing.defined() ? &routing : nullptr);
  const Tensor srows = in_.slice_rows(L.srows, L.size).reshape({Bp, 8});
  Tensor tokens = tokens_.slice_rows(0, Bp), logp = logp_.slice_rows(0, Bp);
  be_.sample_rows(logits, srows, truncation_, tokens, logp, valid_vocab_);
  if (consistent_temperature_ > 0.0f)
    model_sampled_logprobs(be_, logits, tokens, consistent_temperature_, logp);
}

Tensor DecodeGraphs::routing_view(int Bp) const {
  if (!routing_.defined()) return {};
  const ModelConfig& c = gen_.config;
  const int64_t Lm = model_num_moe_layers(c), per = static_cast<int64_t>(Bp) * c.num_experts_per_tok;
  return routing_.slice_rows(0, Lm * per).reshape({Lm, per});
}

bool DecodeGraphs::run(const std::vector<int32_t>& ids, const std::vector<int32_t>& pos,
                       const std::vector<int32_t>& slots, const std::vector<const std::vector<int32_t>*>& pages,
                       int width, const std::vector<SampleRow>& sample_rows, bool truncation, int64_t valid_vocab,
                       float consistent_temperature, Tensor& tokens_view, Tensor& logp_view,
                       Tensor* routing_out) {
  const int B = static_cast<int>(ids.size());
  if (disabled_ || B == 0 || B > max_batch_) return false;
  FP8RL_CHECK(static_cast<int>(sample_rows.size()) == B, "decode graphs: ", sample_rows.size(),
              " sampling rows for ", B, " sequences");
  // A pow2 width keeps the graphs across calls whose contexts differ a little.
  int W = 1;
  while (W < width) W *= 2;
  if (W != width_) {  // (re)size the buffers: graphs recorded over the old ones are dropped
    graphs_.clear();
    width_ = W;
    in_ = be_.alloc({InLayout(max_batch_, W).size}, DType::I32);
    if (!logits_.defined()) {
      logits_ = be_.alloc({max_batch_, gen_.config.vocab_size}, model_logits_dtype(be_, gen_, prec_));
      tokens_ = be_.alloc({max_batch_}, DType::I32);
      logp_ = be_.alloc({max_batch_}, DType::F32);
      if (gen_.config.is_moe())
        routing_ = be_.alloc({model_num_moe_layers(gen_.config) * max_batch_ * gen_.config.num_experts_per_tok},
                             DType::I32);
    }
  }
  if (truncation != truncation_ || valid_vocab != valid_vocab_ ||
      consistent_temperature != consistent_temperature_) {  // recorded into the sampler's / logprobs' launches
    graphs_.clear();
    truncation_ = truncation;
    valid_vocab_ = valid_vocab;
    consistent_temperature_ = consistent_temperature;
  }
  const int Bp = bucket(B);
  const InLayout L(Bp, W);
  host_.assign(static_cast<size_t>(L.size), 0);
  int32_t* h = host_.data();
  for (int b = 0; b < Bp; ++b) {
    const bool real = b < B;
    h[b] = real ? ids[b] : 0;
    h[Bp + b] = b;
    h[2 * Bp + b] = real ? pos[b] : 0;
    h[3 * Bp + b] = real ? slots[b] : dummy_page_ * cache_.page_size;
    h[4 * Bp + b] = b;
    int32_t* row = h + L.table + static_cast<int64_t>(b) * W;
    if (real) {
      FP8RL_CHECK(static_cast<int>(pages[b]->size()) <= W, "decode graphs: a sequence has ", pages[b]->size(),
                  " pages, more than the width ", W);
      std::copy(pages[b]->begin(), pages[b]->end(), row);
    } else {
      row[0] = dummy_page_;
    }
    // The sampling row (padding rows: greedy; their tokens are dropped).
    SampleRow sr;
    if (real) sr = sample_rows[b];
    else sr.temperature = 0.0f;
    std::memcpy(h + L.srows + 8 * static_cast<int64_t>(b), &sr, sizeof sr);
  }
  Tensor staged = Tensor::empty({static_cast<int64_t>(host_.size())}, DType::I32);
  std::copy(host_.begin(), host_.end(), staged.data<int32_t>());
  Tensor dst = in_.slice_rows(0, static_cast<int64_t>(host_.size()));
  be_.copy(staged, dst);

  auto it = graphs_.find(Bp);
  if (it != graphs_.end()) {
    it->second->replay();
    ++replays_;
  } else {
    step(Bp);  // this step's result, and the warm-up the recording needs
    std::unique_ptr<OpGraph> g;
    try {
      g = be_.record([&] { step(Bp); });
    } catch (const Error& e) {
      std::fprintf(stderr, "warning: recording a CUDA graph of the decode step failed (%s); decoding without "
                           "graphs\n", e.what());
    }
    if (!g) {
      disabled_ = true;  // this step already ran directly: its logits are valid
    } else {
      graphs_.emplace(Bp, std::move(g));
    }
  }
  tokens_view = tokens_.slice_rows(0, B);
  logp_view = logp_.slice_rows(0, B);
  if (routing_out) *routing_out = routing_view(Bp);
  return true;
}

}  // namespace fp8rl
