// CUDA graphs for decode-only iterations of the rollout engine. A decode step of a small model
// is bound by kernel launches (tens of ops per layer, microseconds each); recorded once per
// padded batch size and replayed, a step costs one launch. The engine hands over a decode-only
// batch (one query token per sequence) and its sampling rows; DecodeGraphs pads it to a bucket
// size with dummy rows that write into a reserved page, attend to it alone and sample greedily,
// uploads everything (ids, positions, slots, page table, SampleRows) in one copy, and replays
// the forward and the sampler (Backend::sample_rows reads the rows, so each replay draws with
// its own keys and counters), or, the first time a bucket is seen, runs directly and records
// it. Graphs are dropped when the page-table width, `truncation` or valid_vocab change. Backends that
// cannot record (the CPU) or a failed recording make run() return false: the caller runs the
// forward itself. Refit and KV-scale changes need no re-recording: they rewrite the same
// buffers in place.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/precision.h"
#include "model/weights.h"

namespace fp8rl {

class DecodeGraphs {
 public:
  // `dummy_page`: a KV page the scheduler never hands out (padding rows write into it).
  DecodeGraphs(Backend& backend, const ModelWeights& weights, const EnginePrecision& precision, KvCache& cache,
               int max_batch, int dummy_page);

  // One decode step of B = ids.size() sequences: ids/pos/slots [B]; pages[b] the page list of
  // sequence b (at most `width` pages); rows [B] their sampling parameters (sample_rows, with
  // `truncation` and valid_vocab). Writes the sampled tokens I32 [B] and logp F32 [B] (the
  // returned views). consistent_temperature > 0 (the consistent mode): logp is then
  // model_sampled_logprobs' (logprobs_of_logits of the sampled logits) at that temperature,
  // recorded into the graph after the sampler.
  // MoE models: routing_out (if non-null) receives a view I32 [MoE layers, Bp * k] of the step's
  // experts on the device (Bp >= B, the padded batch: the first B * k of each row are the real
  // tokens'). Returns false (nothing run) when graphs are not available.
  bool run(const std::vector<int32_t>& ids, const std::vector<int32_t>& pos, const std::vector<int32_t>& slots,
           const std::vector<const std::vector<int32_t>*>& pages, int width, const std::vector<SampleRow>& rows,
           bool truncation, int64_t valid_vocab, float consistent_temperature, Tensor& tokens_view,
           Tensor& logp_view, Tensor* routing_out = nullptr);

  int replays() const { return replays_; }
  int recorded() const { return static_cast<int>(graphs_.size()); }
  bool disabled() const { return disabled_; }

 private:
  int bucket(int B) const;
  void step(int Bp);  // the recorded ops of bucket Bp over the fixed buffers: forward + sample
  Tensor routing_view(int Bp) const;  // MoE: routing_'s [MoE layers, Bp * k] prefix (undefined otherwise)

  Backend& be_;
  const ModelWeights& gen_;
  EnginePrecision prec_;
  KvCache& cache_;
  int max_batch_, dummy_page_;
  int width_ = 0;      // page-table width the graphs were recorded with
  bool truncation_ = false;  // the sampler settings they were recorded with
  int64_t valid_vocab_ = 0;
  float consistent_temperature_ = 0.0f;
  // I32: per bucket [ids | seq | pos | slots | rows | table (Bp x width) | SampleRow (Bp x 8)]
  Tensor in_;
  Tensor logits_;      // [max_batch, V] (model_logits_dtype)
  Tensor tokens_;      // I32 [max_batch]
  Tensor logp_;        // F32 [max_batch]
  Tensor routing_;     // MoE: I32 [MoE layers * max_batch * k], the step's experts (model_forward_paged's routing_device)
  std::vector<int32_t> host_;
  std::map<int, std::unique_ptr<OpGraph>> graphs_;
  bool disabled_ = false;
  int replays_ = 0;
};

}  // namespace fp8rl
