// The rollout engine: samples n answers for each prompt with the generator's weights and
// numerics, and reports, for every sampled token, its log-probability under those numerics
// (logp_gen). One implementation runs over any Backend (CPU reference or CUDA): the model's
// paged generation forward, a page allocator, and batched decode.
#pragma once
#include <cstdint>
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
};

struct RolloutRequest {
  std::vector<int32_t> prompt;  // token ids, non-empty
  int n = 1;                    // samples of this prompt
};

enum class FinishReason { Stop, Length };
const char* finish_reason_name(FinishReason r);

struct RolloutSample {
  int request = 0;               // index into the requests
  int index = 0;                 // j-th sample of that request
  std::vector<int32_t> tokens;   // generated ids (stop id included when finished by one)
  std::vector<float> logp;       // [tokens.size()] logp_gen of each generated token
  FinishReason finish = FinishReason::Length;
};

// Per-layer FP32 dequantization scales of the E4M3 KV cache (recipe section 3).
struct KvScales {
  std::vector<float> k, v;  // [num_layers]
};

struct RolloutStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int decode_steps = 0;  // generation forwards (one per iteration)
  int waves = 0;         // iterations that admitted new sequences (1 when everything fit at once)
};

class RolloutEngine {
 public:
  // `weights`: the model on the backend's device (typically the trainer's master weights):
  // the engine makes its own generator copy in the generator's numerics (FP8 linears as 128x128
  // QuantTensors, others copied), and a KV pool of `kv_pages` pages of `page_size` tokens.
  RolloutEngine(Backend& backend, const ModelWeights& weights, const EnginePrecision& precision,
                int kv_pages, int page_size = 16, int max_batch = 256);

  // Samples every request's n answers. Sequences are batched (up to max_batch and the KV pool);
  // results come back in request order, samples in index order.
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
  RolloutStats stats_;
};

// The generator's copy of `master` in `precision`: FP8 linears get `wq` (and no `w`), the rest a
// copy in the backend's activation dtype. Used by the engine and by tests of the refit.
ModelWeights generator_weights_alloc(Backend& backend, const ModelWeights& master, const EnginePrecision& precision);
void generator_weights_refit(Backend& backend, const ModelWeights& master, const EnginePrecision& precision,
                             ModelWeights& gen);

// KV-scale calibration (recipe section 3): from per-micro-batch amax samples of k and v per layer
// (amax[m][l]), scale_l = percentile_p(amax[.][l]) * margin / 448; a layer whose amax is 0 gets 1.
KvScales kv_scales_calibrate(const std::vector<std::vector<float>>& k_amax,
                             const std::vector<std::vector<float>>& v_amax, float percentile = 0.999f,
                             float margin = 1.05f);

}  // namespace fp8rl
