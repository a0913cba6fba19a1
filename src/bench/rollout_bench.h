// What `fp8rl bench generate` needs besides the engine: random weights built fast on any backend
// and the memory-bandwidth roofline of decoding. The model shapes: model/shapes.h; the bytes of
// the generator copy a shape and precision make: memory_plan_generator_bytes (rl/memory_plan.h).
//
// Roofline (issue #6): a decode step must read every generator weight it uses once (linears
// in their storage dtype with their FP8 scales, norms, lm_head; of an untied embedding table
// only the B rows looked up; of a mixture of experts every expert, which a decode batch of B
// tokens routed top-k over E experts all but surely touches once B * k >> E) plus the K and V
// cache (MLA: the latent row) of every running sequence at its current length, in the cache dtype. Its time at
// bandwidth BW is bytes / BW; the roofline of a run is the sum over its decode steps. scripts/bench_generate_hf.py
// applies the same formula.
#pragma once
#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "core/precision.h"
#include "model/weights.h"

namespace fp8rl {

// Random weights directly on `backend` in `dtype` (F32 or BF16): linears and the embedding
// uniform in [-std*sqrt(3), std*sqrt(3)) (standard deviation `std`) from a counter-based hash
// of (seed, tensor, index), filled by host threads one tensor at a time through one staging
// buffer (at most one tensor's worth of host memory), norms 1. The same seed gives the same
// weights on every backend.
ModelWeights bench_random_weights(Backend& backend, const ModelConfig& config, DType dtype, uint64_t seed,
                                  float std = 0.02f);

// Bytes actually held by a weight set (every defined tensor, FP8 data and scales; a tied
// lm_head counted once).
int64_t bench_weights_bytes(const ModelWeights& weights);
// Bytes of K and V of one token over all layers in the cache dtype (MLA: the latent row).
int64_t bench_kv_bytes_per_token(const ModelConfig& config, DType kv_dtype);

struct DecodeRoofline {
  int64_t steps = 0;        // decode steps (every forward after the prefill of each wave)
  double weight_bytes = 0;  // summed over steps
  double kv_bytes = 0;      // summed over steps
  double bytes() const { return weight_bytes + kv_bytes; }
  double seconds(double bandwidth) const { return bytes() / bandwidth; }
};

// The decode roofline of `prompts` sequences of prompt_len + gen_len tokens run `concurrency` at a
// time (waves of equal start; the last may be smaller). Decode step s = 1..gen_len-1 of a wave of n
// sequences reads `weight_bytes_per_step` + n * (row_bytes + (prompt_len + s) * kv_bytes_per_token).
// weight_bytes_per_step: the generator's bytes without an untied embedding table; row_bytes: one
// embedding row in its dtype.
DecodeRoofline bench_decode_roofline(double weight_bytes_per_step, double row_bytes, double kv_bytes_per_token,
                                     int prompts, int prompt_len, int gen_len, int concurrency);

}  // namespace fp8rl
