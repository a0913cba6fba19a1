// CUDA graphs for decode-only iterations of the rollout engine. A decode step of a small model
// is bound by kernel launches (tens of ops per layer, microseconds each); recorded once per
// padded batch size and replayed, a step costs one launch. The engine hands over a decode-only
// batch (one query token per sequence); DecodeGraphs pads it to a bucket size with dummy rows
// that write into a reserved page and attend to it alone, uploads everything in one copy, and
// replays (or, the first time a bucket is seen, runs directly and records it). Backends that
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
  // sequence b (at most `width` pages). Writes logits F32 [B, V] into logits_out's first B
  // rows (the returned view). Returns false (nothing run) when graphs are not available.
  bool run(const std::vector<int32_t>& ids, const std::vector<int32_t>& pos, const std::vector<int32_t>& slots,
           const std::vector<const std::vector<int32_t>*>& pages, int width, Tensor& logits_view);

  int replays() const { return replays_; }
  int recorded() const { return static_cast<int>(graphs_.size()); }
  bool disabled() const { return disabled_; }

 private:
  int bucket(int B) const;
  void forward(int Bp);  // the recorded ops of bucket Bp over the fixed buffers

  Backend& be_;
  const ModelWeights& gen_;
  EnginePrecision prec_;
  KvCache& cache_;
  int max_batch_, dummy_page_;
  int width_ = 0;      // page-table width the graphs were recorded with
  Tensor in_;          // I32: per bucket [ids | seq | pos | slots | rows | table (Bp x width)]
  Tensor logits_;      // F32 [max_batch, V]
  std::vector<int32_t> host_;
  std::map<int, std::unique_ptr<OpGraph>> graphs_;
  bool disabled_ = false;
  int replays_ = 0;
};

}  // namespace fp8rl
