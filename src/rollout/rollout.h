// The rollout engine: samples n answers for each prompt with the generator's weights and
// numerics, and reports, for every sampled token, its log-probability under those numerics
// (logp_gen). One implementation runs over any Backend (CPU reference or CUDA): the model's
// paged generation forward, and a scheduler (scheduler.h) with reference-counted KV pages
// allocated on demand, prompt pages shared by a request's samples, chunked prefill within a
// token budget, and recompute preemption when the pool runs out.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/precision.h"
#include "model/weights.h"

namespace fp8rl {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;
  int top_k = 0;             // 0 = no top-k
  int max_new_tokens = 64;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (kept in tokens)
  uint64_t seed = 0;              // sample j of request i draws from a stream seeded by (seed, i, j)
  // Ids >= valid_vocab are never sampled (0 = the model's whole vocabulary; larger than the
  // model's is clamped to it). Callers pass the tokenizer's size, so that a model whose
  // vocabulary is padded past the tokenizer's (Qwen: 151936 rows, 151669 ids) never emits an
  // id the tokenizer cannot decode (Backend::sample masks their logits).
  int64_t valid_vocab = 0;
  // Called before every engine iteration with (done, total) token slots: total = samples x
  // max_new_tokens, done = generated tokens + the unused budget of finished samples. For
  // progress display only (never changes results).
  std::function<void(int64_t done, int64_t total)> on_progress;
  // Request i draws as request first_request + i: a data-parallel rank generating prompts
  // [first, ...) of a global batch samples what one rank generating all of them would.
  int64_t first_request = 0;
  // Mixture-of-experts models: record the generator's routing of every sample
  // (RolloutSample::routing), for the trainer's routing-agreement metrics and routing replay.
  bool record_routing = false;
};

struct RolloutRequest {
  std::vector<int32_t> prompt;  // token ids, non-empty
  int n = 1;                    // samples of this prompt
  // Optional [n]: sample j ends after stop_after[j] tokens (1..max_new_tokens) as if it had
  // sampled a stop id (finish Stop). Benchmarks use it for ragged batches from random weights.
  std::vector<int> stop_after = {};
};

enum class FinishReason { Stop, Length };
const char* finish_reason_name(FinishReason r);

struct RolloutSample {
  int request = 0;               // index into the requests
  int index = 0;                 // j-th sample of that request
  std::vector<int32_t> tokens;   // generated ids (stop id included when finished by one)
  std::vector<float> logp;       // [tokens.size()] logp_gen of each generated token
  FinishReason finish = FinishReason::Length;
  // With SamplingParams::record_routing (MoE models): the experts the generator chose at each
  // position of prompt + tokens in every MoE layer, [positions][MoE layers][top_k] (position-
  // major, by descending routing weight), -1 where the generator never ran the position: the last
  // token (sampled, never fed back). Prompt positions whose KV pages were shared from another
  // sample of the request (prefix sharing) hold that sample's routing. Empty otherwise.
  std::vector<int16_t> routing;
};

// Per-layer FP32 dequantization scales of the E4M3 KV cache (recipe section 3).
struct KvScales {
  std::vector<float> k, v;  // [num_layers]
};

struct RolloutStats {
  int64_t prompt_tokens = 0;         // sum of the prompt lengths of all samples
  int64_t generated_tokens = 0;
  int64_t prefill_tokens = 0;        // tokens run as prefill (prompts, recomputations), not decode
  int64_t prefix_shared_tokens = 0;  // prompt tokens not computed: KV pages shared between samples
  int64_t recomputed_tokens = 0;     // tokens computed again after a preemption
  int decode_steps = 0;  // generation forwards (one per iteration)
  int waves = 0;         // iterations that admitted sequences (1 when everything fit at once)
  int preemptions = 0;   // sequences preempted because the KV pool was full (memory pressure)
  int max_running = 0;   // most sequences running at once
  int max_pages_used = 0;  // most KV pages in use at once
  int graph_steps = 0;     // decode-only forwards run as CUDA-graph replays (or their recording step)
  // Wall time of generate()'s iterations, and the part of it spent blocked on the device's
  // sampled tokens. The rest (loop_seconds - wait_seconds: planning, staging, uploads, launches,
  // appending the tokens) is, when the decode steps are CUDA-graph replays (graph_steps), host
  // time during which the device has nothing queued; eager steps (prefill, graphs off) launch
  // their ops in it while the device runs them, so there it is no idle time.
  double loop_seconds = 0, wait_seconds = 0;
  // The iterations by kind: decode-only ones by the sequences in their batch (buckets of up to
  // 16, 32, 64, 128, 256 and more), and those that ran prefill tokens; their count and wall
  // seconds. An iteration that samples ends when its tokens are on the host, so a decode step's
  // wall time is its device time plus the host's share; a prefill chunk that samples nothing does
  // not wait, and its device time lands in the next iteration's. Where generation's time goes as
  // the ragged batch drains (issue 14: the FP8 gain of a step by its batch size).
  static constexpr int kIterKinds = 7;
  int iter_steps[kIterKinds] = {};
  double iter_seconds[kIterKinds] = {};
  static int iter_kind(int batch, bool prefill);  // the bucket of an iteration
  static const char* iter_kind_name(int kind);    // "B<=16" .. "B>256", "prefill"
};

// How the engine batches (rollout/scheduler.h describes the policy).
struct SchedulerOptions {
  int max_batch_tokens = 8192;  // tokens per forward: decode tokens first, then prefill chunks
  bool prefix_sharing = true;   // the n samples of a request share their prompt's full KV pages
  bool cuda_graphs = true;      // decode-only steps as CUDA-graph replays where the backend records
                                // them (rollout/decode_graphs.h; FP8RL_CUDA_GRAPHS=0 turns them off)
};

class DecodeGraphs;

class RolloutEngine {
 public:
  // `weights`: the model on the backend's device (typically the trainer's master weights):
  // the engine makes its own generator copy in the generator's numerics (FP8 linears as 128x128
  // QuantTensors, others copied), and a KV pool of `kv_pages` pages of `page_size` tokens.
  RolloutEngine(Backend& backend, const ModelWeights& weights, const EnginePrecision& precision,
                int kv_pages, int page_size = 16, int max_batch = 256, const SchedulerOptions& options = {});
  ~RolloutEngine();
  RolloutEngine(const RolloutEngine&) = delete;  // the decode graphs hold references to members
  RolloutEngine& operator=(const RolloutEngine&) = delete;

  // Samples every request's n answers. Sequences are batched (up to max_batch sequences and
  // max_batch_tokens tokens per forward), KV pages allocated as they grow; when the pool runs
  // out, the youngest sequences are preempted and recomputed later (stats().preemptions, and one
  // warning line on stderr per call). Results do not depend on the batching: they come back in
  // request order, samples in index order, sample j of request i drawing from its own stream.
  std::vector<RolloutSample> generate(const std::vector<RolloutRequest>& requests, const SamplingParams& params);

  // Refit: rewrites the generator's weights in place from `master` (same structure) with the
  // generator's quantizer (FP8 linears requantized 128x128, the rest copied), and installs new
  // KV scales (ignored unless the cache is E4M3). No buffer is reallocated.
  void refit(const ModelWeights& master, const KvScales* kv_scales);

  const ModelWeights& weights() const { return gen_; }
  const KvCache& kv_cache() const { return cache_; }
  const EnginePrecision& precision() const { return prec_; }
  const RolloutStats& last_stats() const { return stats_; }
  KvScales kv_scales() const;  // the scales in use (host copy)

 private:
  Backend& be_;
  EnginePrecision prec_;
  ModelWeights gen_;
  KvCache cache_;
  int page_size_, max_batch_;
  SchedulerOptions opt_;
  RolloutStats stats_;
  // Device scratch reused across iterations and calls (fixed addresses once grown): the batch's
  // index tensors, sized for max_batch_tokens tokens / max_batch sequences, and the outputs.
  struct Buffers {
    Tensor packed;        // I32: one iteration's [ids | seq | pos | slots | rows | page table], grown on demand
    Tensor tokens, logp;  // I32, F32 [max_batch]
    Tensor logits;        // [rows capacity, vocab] (model_logits_dtype), grown on demand
    Tensor routing;       // I32 [MoE layers * tokens * k]: the routing record of one forward, grown on demand
  } buf_;
  std::unique_ptr<DecodeGraphs> graphs_;  // null where the backend records no graphs
};

// The generator's copy of `master` in `precision`: FP8 linears get `wq` (and no `w`), the rest a
// copy in the backend's activation dtype. Used by the engine and by tests of the refit.
ModelWeights generator_weights_alloc(Backend& backend, const ModelWeights& master, const EnginePrecision& precision);
void generator_weights_refit(Backend& backend, const ModelWeights& master, const EnginePrecision& precision,
                             ModelWeights& gen);

// KV-scale calibration (recipe section 3): from per-micro-batch amax samples of k and v per layer
// (amax[m][l]), scale_l = percentile_p(amax[.][l]) * margin / 448; a layer whose amax is 0 gets 1.
// pow2 (precision.pow2_scales): each scale rounded up to a power of two (never clipping more than
// the exact scale would), so every FP8 scale of the recipe is one; the flash-order decode then
// folds the KV scales into its score multiplier and 1 / l.
KvScales kv_scales_calibrate(const std::vector<std::vector<float>>& k_amax,
                             const std::vector<std::vector<float>>& v_amax, float percentile = 0.999f,
                             float margin = 1.05f, bool pow2 = false);

}  // namespace fp8rl
