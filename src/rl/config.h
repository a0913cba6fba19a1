// RunConfig: everything `fp8rl train` and `fp8rl sft` read, as one struct tree.
// Loaded from YAML, then `section.key=value` overrides from the command line; every key is
// declared once (config.cpp, config_fields) with its type and help, which gives: unknown-key
// errors with the nearest valid key, type errors naming key and expected type, and the
// resolved-config dump (saved in the run directory, loadable again).
// The defaults are the CPU demo: `fp8rl train` with no arguments == configs/demo_cpu.yaml.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/precision.h"
#include "train/grpo.h"
#include "train/lr_schedule.h"

namespace fp8rl {

// A small Qwen3-style model built in memory (model.path empty): the CPU demo and the tests.
struct TinyModelConfig {
  int vocab_size = 0;           // 0 = the tokenizer's vocabulary size
  int hidden_size = 64;
  int intermediate_size = 192;
  int num_layers = 2;
  int num_heads = 4;
  int num_kv_heads = 2;
  int head_dim = 16;
  bool qk_norm = true;
  int max_position_embeddings = 512;
  double rope_theta = 10000.0;
  double init_std = 0.02;       // normal(0, init_std) for every matrix; norms start at 1
  // Mixture of experts (qwen3_moe): every block's MLP becomes num_experts SwiGLU experts of
  // moe_intermediate_size, num_experts_per_tok per token (renormalized). 0 = a dense MLP.
  int num_experts = 0;
  int num_experts_per_tok = 2;
  int moe_intermediate_size = 64;
  bool operator==(const TinyModelConfig&) const = default;
};

struct ModelSection {
  std::string path;             // HF checkpoint directory (config.json + safetensors); "" = tiny
  TinyModelConfig tiny;
  bool operator==(const ModelSection&) const = default;
};

struct TokenizerSection {
  std::string path;             // tokenizer.json directory; "" = model.path, or the built-in
                                // byte-level tokenizer when the model is tiny
  bool chat_template = false;   // wrap prompts in the tokenizer's chat template (instruct models):
                                // its own Jinja template when the directory has one, else a
                                // built-in family (tokenizer/chat_template.h)
  std::string chat_template_kwargs;  // extra Jinja template variables as a JSON object, e.g.
                                     // {"enable_thinking": false}; "" = none
  bool operator==(const TokenizerSection&) const = default;
};

struct TaskSection {
  std::string name = "arithmetic";  // arithmetic | countdown | gsm8k | jsonl
  int64_t seed = 0;                 // 0 = the run seed
  struct Arithmetic {               // tasks/task.h ArithmeticConfig
    int min_operands = 3, max_operands = 3;  // numbers per expression
    int digits = 1;                 // each operand has 1..digits digits
    std::string operators = "+-";   // any of "+-*/" ('/' only where exact)
    bool parentheses = false;
    std::string style = "expression";  // expression ("What is 3 + 4 * 2?") | story (a word problem
                                    // computed left to right, GSM8K-style worked solution)
    bool operator==(const Arithmetic&) const = default;
  } arithmetic;
  struct Countdown {                // tasks/task.h CountdownConfig
    int numbers = 3;                // how many given numbers (2..6), each used exactly once
    int max_number = 10;            // each in [1, max_number]
    int max_target = 50;            // targets in [1, max_target]
    bool operator==(const Countdown&) const = default;
  } countdown;
  struct Gsm8k {
    std::string path;               // directory with train.jsonl / test.jsonl (shared/data/gsm8k)
    bool operator==(const Gsm8k&) const = default;
  } gsm8k;
  struct Jsonl {
    std::string path;               // training data, one JSON object per line
    std::string validation_path;    // "" = hold out validation_fraction of path
    double validation_fraction = 0.05;
    std::string prompt_field = "prompt";
    std::string answer_field = "answer";
    std::string solution_field;     // worked solutions for sft ("" = none)
    std::string instruction;        // appended to every prompt when non-empty
    std::string prompt_template;    // "" = the prompt field; else the prompt with {field} (nested:
                                    // {a.b}) replaced by the row's values, e.g. "Q: {problem}"
    bool operator==(const Jsonl&) const = default;
  } jsonl;
  struct Reward {
    std::string python;             // "module:function" or "path/file.py:function": a Python
                                    // reward called once per batch (rl/python_reward.h); "" = the
                                    // task's own verifier
    bool operator==(const Reward&) const = default;
  } reward;
  bool operator==(const TaskSection&) const = default;
};

struct RolloutSection {
  int prompts_per_step = 16;        // P
  int generations_per_prompt = 8;   // G (the GRPO group)
  int max_new_tokens = 40;
  double temperature = 1.0;
  double top_p = 1.0;               // 1 = off
  int top_k = 0;                    // 0 = off
  // The generator's KV pool (rl/memory_plan.h memory_plan_choose). 0 = sized from the rollout
  // shape: pages for min(max_num_seqs, max(P x G, val_size)) sequences of min(2048, 256 +
  // max_new_tokens) tokens. In (0, 1], as vLLM's gpu_memory_utilization: the run's planned peak
  // may use this fraction of the device's free memory at start, and the KV pool gets what the
  // rest of the plan leaves (never less than the shape-sized pool; never more than max_num_seqs
  // sequences of max_position_embeddings tokens). Needs a known free memory (CUDA, or
  // memory.free_gib); otherwise the shape-sized pool.
  double gpu_memory_utilization = 0;
  // Sequences the rollout engine runs at once (vLLM's max_num_seqs): a larger KV pool holds
  // more of them only up to this count; the rest wait for a batch slot.
  int max_num_seqs = 256;
  bool operator==(const RolloutSection&) const = default;
};

struct ImportanceSamplingSection {
  IsMode mode = IsMode::TIS;        // none | is | tis | icepop | seq_mask
  double tis_cap = 2.0;
  double icepop_low = 0.5, icepop_high = 5.0;
  double seq_mask_low = 0.999, seq_mask_high = 1.002;
  bool operator==(const ImportanceSamplingSection&) const = default;
};

struct TrainSection {
  double lr = 2e-4;
  int warmup_steps = 4;             // optimizer steps
  LrScheduleKind schedule = LrScheduleKind::Constant;
  double min_lr_ratio = 0.0;        // cosine: final lr / lr
  double weight_decay = 0.01;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  double grad_clip = 1.0;           // global grad-norm clip; 0 = off
  int64_t micro_batch_tokens = 4096;  // tokens per forward/backward chunk
  int optimizer_steps_per_rollout = 2;  // the rollout batch is split in this many mini-batches
  // auto: the first mini-batch's logp_old (and the entropy, KV amax and routing records of its
  // sequences) come from its own optimizer step's forward, which runs on the rollout's weights,
  // so only the later mini-batches are scored beforehand (one optimizer step per rollout: no
  // scoring pass at all); score: every sequence scored before the first step.
  std::string old_logprobs = "auto";
  std::string recompute = "none";   // none | block: keep each block's input, recompute it in backward;
                                    // auto: block when the memory plan does not fit otherwise
  // on | off: an FP8 trainer keeps each FP8 linear's W^T quantization for the dgrad, refreshed
  // every optimizer step (one more copy of the FP8 weights); off: the dgrad transposes W per
  // call (slower). auto: on unless the memory plan does not fit with it (dropped before
  // train.recompute: auto turns on block recomputation).
  std::string dgrad_weight_cache = "auto";
  std::string grad_dtype = "fp32";  // fp32 | bf16: gradients accumulated over micro-batches in this dtype
  std::string optimizer_state_dtype = "fp32";        // fp32 | bf16: the Adam moments m, v
  std::string optimizer_state_rounding = "nearest";  // nearest | stochastic: BF16 moments' rounding
  bool shard_optimizer = false;     // data parallel: AdamW moments sharded over the ranks (ZeRO-1)
  double ratio_clip_low = 0.2, ratio_clip_high = 0.2;
  LossAggregation loss_aggregation = LossAggregation::Token;
  AdvantageBaseline baseline = AdvantageBaseline::LeaveOneOut;
  double kl_beta = 0.0;             // k3 KL to the initial policy; 0 = off (no reference model)
  // Mixture-of-experts models: the trainer's forwards (scoring and update) use the experts the
  // generator chose for each token (recorded in the rollout) instead of their own top-k, with the
  // routing weights from the trainer's router over them (slime's / veRL's routing replay).
  bool routing_replay = false;
  ImportanceSamplingSection is;
  bool operator==(const TrainSection&) const = default;
};

struct PrecisionSection {
  std::string recipe = "fp8_e2e";   // bf16 | fp8_gen | fp8_e2e | fp32 (PrecisionRecipe::preset)
  // Fine-grained overrides of the preset ("auto" = the preset's choice).
  std::string generator_linear = "auto";  // auto | fp32 | bf16 | fp8
  std::string trainer_linear = "auto";    // auto | fp32 | bf16 | fp8
  std::string trainer_wgrad = "auto";     // auto | fp8 | bf16: an FP8 trainer linear's weight-gradient GEMM
  bool pow2_scales = false;               // both engines (same quantizer on both sides)
  int bf16_first_layers = 0;              // both engines
  int bf16_last_layers = 0;               // both engines
  std::string kv_cache = "auto";          // auto | f32 | bf16 | e4m3 (generator)
  bool fp8_attention = false;             // generator; needs an E4M3 KV cache
  // auto | on | off: the trainer rounds its k and v as the generator's E4M3 cache stores them
  // (the rollout's scales), so both engines attend over the same values. auto: the preset's choice.
  std::string trainer_kv_rounding = "auto";
  // The consistent mode (EnginePrecision::consistent): the trainer scores as the generator
  // generated, so logp_old equals logp_gen bit for bit on the same weights. off | on (every op
  // batch-invariant, the trainer attending through the generator's cache and kernel) | attn (the
  // attention and logits as on, the linears on the fast kernels: needs pow2_scales) | flash (the
  // generator's decode attention in the trainer's flash order, the linears on the fast kernels:
  // needs pow2_scales). true / false read as on / off.
  std::string consistent = "off";
  bool consistent_logits = true;  // false: each engine's own lm_head and log-softmax (EnginePrecision)
  double kv_calib_percentile = 0.999;     // KV-scale recalibration: percentile of per-micro-batch amax
  double kv_calib_margin = 1.05;          // ... times this margin, / 448
  bool operator==(const PrecisionSection&) const = default;
};

struct SftSection {
  int steps = 1000;                 // optimizer steps of `fp8rl sft`
  int batch_size = 16;              // sequences per optimizer step
  double lr = 1e-3;                 // sft uses train.* for the rest of the optimizer
  std::string data;                 // jsonl (prompt, answer) file; "" = the task's gold answers
  std::string mix_gsm8k_path;       // GSM8K directory whose train solutions are mixed in ("" = none)
  double mix_gsm8k_fraction = 0.0;  // fraction of each SFT batch drawn from it
  int64_t max_seq_tokens = 0;       // mixed-in sequences longer than this are skipped; 0 = no limit
  bool operator==(const SftSection&) const = default;
};

struct CheckpointSection {          // how checkpoints/step_N/ stores the policy (rl/checkpoint.h)
  std::string dtype = "bf16";       // bf16 | f32: the model files (config.json says it); resume
                                    // stays exact either way (the F32 master is kept beside)
  std::string format = "hf";        // hf | fp8-block (FP8 linears + weight_scale_inv, vLLM/transformers)
  double max_shard_gb = 5;          // shard model files above this size (with the index); 0 = never
  int keep_last = 0;                // keep the newest N checkpoints (older ones pruned); 0 = all
  bool operator==(const CheckpointSection&) const = default;
};

// The start-up memory check of `fp8rl train` / `sft` (rl/memory_plan.h memory_plan_check).
struct MemorySection {
  bool allow_overcommit = false;  // start even when the plan's peak exceeds the device's free memory
  double free_gib = 0;            // free device memory to plan against; 0 = ask the device (CUDA:
                                  // cudaMemGetInfo; the CPU backend reports none: no check)
  bool operator==(const MemorySection&) const = default;
};

struct LoggerSection {
  bool tensorboard = false;         // also write TensorBoard event files under RUN/tensorboard/
  bool operator==(const LoggerSection&) const = default;
};

struct RunConfig {
  ModelSection model;
  TokenizerSection tokenizer;
  TaskSection task;
  RolloutSection rollout;
  TrainSection train;
  PrecisionSection precision;
  SftSection sft;
  CheckpointSection checkpoint;
  MemorySection memory;
  int steps = 20;                   // GRPO steps
  int val_every = 5;               // validate at step 0 and every N steps; 0 = never
  int val_size = 200;               // held-out prompts per validation
  int checkpoint_every = 0;         // 0 = only at the end
  LoggerSection logger;
  std::string out = "runs/demo";    // run directory
  std::string device = "cpu";       // cpu | cuda
  int64_t seed = 1234;
  int max_consecutive_bad_steps = 3;  // non-finite optimizer steps skipped in a row before abort (>= 1)
  double time_budget_s = 0;         // wall-clock budget of one train/sft run; 0 = none. The step
                                    // that leaves no room for another is the last (validated, saved)
  double checkpoint_max_abs_weight = 1e5;  // a checkpoint with a larger |weight| is refused (the
                                    // run exploded: lr too high); 0 = no bound
  bool operator==(const RunConfig&) const = default;
};

// Loads `yaml_path` ("" = defaults only), then applies `overrides` ("train.lr=1e-6") in order,
// then validates. Errors name the file/key and say what is expected. Relative paths (model.path,
// task.jsonl.path, ...) in the file resolve against the file's folder, on the command line
// against the current directory; both are stored absolute.
RunConfig config_load(const std::string& yaml_path, const std::vector<std::string>& overrides = {});
// Applies a YAML document (a subset of keys) on top of `c`; `origin` names it in errors;
// relative path values resolve against `base_dir` (empty: kept as written).
void config_apply_yaml(RunConfig& c, const std::string& yaml_text, const std::string& origin,
                       const std::string& base_dir = "");
// "key: old -> new" for every key whose value differs between `from` and `to` (key order).
std::vector<std::string> config_diff(const RunConfig& from, const RunConfig& to);
// One "key.sub=value" override (a relative path value becomes absolute against the current
// directory).
void config_apply_override(RunConfig& c, const std::string& assignment);
// Sets one key from its text form (the same parser as YAML scalars).
void config_set(RunConfig& c, const std::string& key, const std::string& value);
// Checks ranges and cross-field consistency; throws naming the key.
void config_validate(const RunConfig& c);
// The resolved config as YAML with a comment per key (config_apply_yaml reads it back exactly).
std::string config_to_yaml(const RunConfig& c);

// Every valid key ("train.is.mode", ...) in declaration order, and the nearest to `key`.
std::vector<std::string> config_keys();
std::string config_nearest_key(const std::string& key);
// True for a valid key or one of its aliases (task.jsonl.prompt_key = task.jsonl.prompt_field,
// answer_key, solution_key).
bool config_has_key(const std::string& key);

// The mapping onto the engines' structs.
PrecisionRecipe config_precision_recipe(const PrecisionSection& p);
GrpoLossOptions config_grpo_options(const TrainSection& t);
LrSchedule config_lr_schedule(const TrainSection& t, int64_t total_optimizer_steps);

}  // namespace fp8rl
