// Device-memory plan of a GRPO run, computed from the shapes alone (nothing is allocated):
// what the trainer, the reference policy, the generator and the KV pool hold for the whole run,
// and what one training micro-batch needs on top. Printed at the start of `fp8rl train` and
// `fp8rl sft`, and by `fp8rl plan` for any shape (e.g. a ~1B model on one H200) without running.
// The byte counts follow what the code allocates (train/trainer.cpp, rollout/generator_weights.cpp,
// model/transformer.cpp LayerActivations); allocator slack and the CUDA context are not counted.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/precision.h"
#include "model/config.h"
#include "rl/config.h"

namespace fp8rl {

// Sequences a RolloutEngine decodes at once by default (rollout.max_num_seqs's default; the
// engine's max_batch).
inline constexpr int kRolloutMaxBatch = 256;

struct MemoryPlanInput {
  ModelConfig model;
  EnginePrecision generator;             // linears FP8 (128x128 blocks + F32 scales) or not; KV dtype
  EnginePrecision trainer;               // the frozen reference policy's weights follow it
  DType act_dtype = DType::BF16;         // activation / generator storage dtype (CUDA: BF16; CPU: F32)
  bool reference_policy = false;         // kl_beta > 0: a frozen copy of the policy (weights only)
  int64_t kv_pages = 0, page_size = 16;  // the generator's KV pool
  std::string kv_note;                   // how its size was chosen (MemoryChoice::kv_note), shown in the plan
  int64_t micro_batch_tokens = 4096;     // tokens per forward/backward chunk
  bool recompute = false;                // train.recompute: block (saved activations: block inputs)
  bool dgrad_weight_cache = true;        // train.dgrad_weight_cache: an FP8 trainer's W^T copies
  DType grad_dtype = DType::F32;         // train.grad_dtype
  DType moment_dtype = DType::F32;       // train.optimizer_state_dtype (m and v)
  int64_t generation_batch = 256;        // sequences decoded together (logits rows per decode step)
  int64_t logits_chunk_bytes = 256ll << 20;  // the lm_head logits are computed in vocabulary chunks
                                             // of at most this many bytes (CUDA backend)
  // MoE models: the rollout's routing record (RolloutSample::routing, host memory): this many
  // sequences of this many positions (0: none, e.g. sft).
  int64_t rollout_sequences = 0, rollout_positions = 0;
};

struct MemoryPlanLine {
  std::string name;   // "master weights (F32)"
  int64_t bytes = 0;
  std::string note;   // how it was counted
};

struct MemoryPlan {
  int64_t parameters = 0;
  std::vector<MemoryPlanLine> resident;    // held for the whole run
  std::vector<MemoryPlanLine> transient;   // per training micro-batch / decode step, as built
  std::vector<MemoryPlanLine> host;        // host memory the run holds beside (not device memory;
                                           // on the CPU backend it adds to the peak's check)
  int64_t activations_recompute_bytes = 0;  // saved activations with blocks recomputed in
                                            // backward (block inputs + one block + the head)
  int64_t resident_bytes() const;
  int64_t peak_bytes() const;               // resident + transient
  int64_t host_bytes() const;
};

MemoryPlan memory_plan_compute(const MemoryPlanInput& in);

// Saved activation bytes per token of one block / of the model head (LayerActivations, Activations).
int64_t memory_plan_block_bytes_per_token(const ModelConfig& c, DType act);
int64_t memory_plan_head_bytes_per_token(const ModelConfig& c, DType act);
// Generator weight bytes: what generator_weights_alloc (rollout/rollout.h) holds for a `c` model
// under `gen` with activation dtype `act` (FP8 linears: E4M3 data + F32 128x128 scales; the
// rest in `act`). The one count of them: the plan, `bench generate` and its tests use it.
int64_t memory_plan_generator_bytes(const ModelConfig& c, const EnginePrecision& gen, DType act);

// The KV pool sized from the rollout shape (`fp8rl train` without rollout.gpu_memory_utilization,
// and the least it gets with it): pages for min(rollout.max_num_seqs, max(P x G, val_size))
// sequences of min(2048, 256 + max_new_tokens) tokens, plus one (the decode graphs' padding page).
int64_t memory_plan_kv_pages(const RunConfig& c);
// The most pages the rollout engine can ever use: min(max_num_seqs, max(P x G, val_size))
// sequences of the model's max_position_embeddings tokens (prompt + response never exceed it),
// plus one. A larger pool would never be touched: the scheduler admits at most max_num_seqs.
int64_t memory_plan_kv_pages_max(const RunConfig& c, const ModelConfig& model);
// Bytes of one KV page (K and V of every layer, `page_size` tokens, the cache's dtype).
int64_t memory_plan_kv_page_bytes(const ModelConfig& model, DType kv_dtype, int64_t page_size = 16);

// The KV pool of `fp8rl sft`'s validation engine: 8 pages of 16 tokens per validation prompt, plus 8.
inline int64_t memory_plan_sft_kv_pages(const RunConfig& c) { return int64_t(c.val_size) * 8 + 8; }

// The plan's input from a run config, for a given model shape and backend activation dtype.
// sft: `fp8rl sft`'s run (its validation KV pool, no reference policy) instead of GRPO's.
// train.recompute: auto counts as none and train.dgrad_weight_cache: auto as on here (resolve
// them first: memory_plan_choose).
MemoryPlanInput memory_plan_input(const RunConfig& c, const ModelConfig& model, DType act_dtype, bool sft = false);

// How a run uses the device, decided at start from the plan and the free memory (`fp8rl
// train`, `fp8rl sft`, `fp8rl plan` against --device-gib): train.recompute and
// train.dgrad_weight_cache with auto resolved (memory_plan_resolve_trainer), and the KV pool. The pool is the shape-sized one (memory_plan_kv_pages; sft: its validation
// pool) unless rollout.gpu_memory_utilization > 0 and the free memory is known; then it gets
// what the rest of the plan leaves of gpu_memory_utilization x free_bytes, at least the
// shape-sized pool (when even that does not fit, memory_plan_check refuses) and at most
// memory_plan_kv_pages_max.
struct MemoryChoice {
  std::string recompute = "none";  // none | block
  std::string dgrad_weight_cache = "on";  // on | off
  int64_t kv_pages = 0;
  std::string kv_note;  // how the pool was sized (for the plan's KV line)
  std::string lines;    // one line per automatic choice, printed at start
};
MemoryChoice memory_plan_choose(const RunConfig& c, const ModelConfig& model, DType act_dtype, int64_t free_bytes,
                                bool sft = false);
// What the plan's peak may reach: free_bytes x rollout.gpu_memory_utilization when that is set
// (GRPO runs), else free_bytes (< 0: unknown).
int64_t memory_plan_budget_bytes(const RunConfig& c, int64_t free_bytes, bool sft = false);
// The plan's input as memory_plan_input, with the choice applied (recompute, the W^T cache, KV pool).
MemoryPlanInput memory_plan_input_chosen(const RunConfig& c, const ModelConfig& model, DType act_dtype,
                                         const MemoryChoice& choice, bool sft = false);

// The trainer's two trades of time for memory, resolved: block recomputation (one more forward
// per micro-batch) and dropping the FP8 dgrad's W^T cache (a per-call transpose of each FP8
// weight in the dgrad instead: far cheaper). `recompute` (none | block | auto) and
// `dgrad_weight_cache` (on | off | auto) as configured; `in` is the plan with everything else
// set. An auto setting takes the first of (no recomputation, cache), (no recomputation, no
// cache), (block, cache), (block, no cache) — fastest first, the fixed settings as given —
// whose peak fits `budget_bytes`; when none fits, the last (the least memory; the check then
// refuses). The budget unknown (< 0): none, on. `lines` gets one line per auto setting that says
// which and why (train.* key names), printed at start.
struct TrainerMemoryChoice {
  bool recompute = false;
  bool dgrad_weight_cache = true;
  std::string lines;
};
TrainerMemoryChoice memory_plan_resolve_trainer(const MemoryPlanInput& in, const std::string& recompute,
                                                const std::string& dgrad_weight_cache, int64_t budget_bytes);

// The machine's physical memory in bytes (0 when unknown).
int64_t memory_plan_host_bytes();
// On the CPU backend the plan (its peak and its host lines) must fit the machine's memory: refused
// before anything is allocated.
void memory_plan_check_host(const MemoryPlan& plan, const std::string& device);

// A readable table; `device_bytes` > 0 adds the headroom line ("fits in 139.0 GiB: 12.3 GiB free").
std::string memory_plan_format(const MemoryPlan& plan, const ModelConfig& model, int64_t device_bytes = 0);

// The start-up check of `fp8rl train` / `fp8rl sft`, before any work: the plan's peak for
// (config, model, act) against `free_bytes` of free device memory (< 0: unknown, nothing is
// checked). When the peak does not fit it throws an Error that says by how much and names what
// would make it fit, each computed with the plan: the largest train.micro_batch_tokens, the
// largest rollout batch (rollout.prompts_per_step x generations_per_prompt, val_size) and
// rollout.max_new_tokens the KV pool allows, train.kl_beta = 0 when a reference policy is held,
// and what block recomputation (not built) would give; unless memory.allow_overcommit, then it
// returns a warning instead. Otherwise returns the "fits" line. The plan does not count the CUDA
// context, library workspaces (cuBLASLt), CUDA-graph pools and allocator slack (see
// memory_plan_format): a peak just under the free memory can still run out.
// sft: the plan of `fp8rl sft` (knobs: train.micro_batch_tokens, val_size).
// train.recompute and train.dgrad_weight_cache: auto are resolved first (memory_plan_choose) and
// their lines lead the result. Among the knobs: train.dgrad_weight_cache: off (an FP8 trainer),
// train.recompute: block, and the lean optimizer's train.optimizer_state_dtype /
// train.grad_dtype: bf16 when not already set. With
// rollout.gpu_memory_utilization the peak is checked against that fraction of the free memory
// (memory_plan_budget_bytes), with the KV pool memory_plan_choose gives (the line saying how
// leads the result too), and a larger fraction that would fit is among the knobs.
std::string memory_plan_check(const RunConfig& c, const ModelConfig& model, DType act_dtype, int64_t free_bytes,
                              bool sft = false);

// The free memory memory_plan_check is given: memory.free_gib when > 0, else what the backend
// reports (Backend::free_device_bytes; the CPU backend: -1, no check).
int64_t memory_plan_free_bytes(const RunConfig& c, int64_t backend_free_bytes);

}  // namespace fp8rl
