#include "rl/config.h"

#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>

#include "core/error.h"
#include "core/fs.h"
#include "io/json_input.h"
#include "core/suggest.h"

namespace fp8rl {

// ---- the key table ---------------------------------------------------------------------------
namespace {

constexpr size_t kMaxYamlBytes = size_t(4) << 20;  // a full config is ~10 KB
constexpr int kMaxYamlDepth = 8;

// The real bounds of size-like values (docs/design.md "What is validated where").
constexpr int kMaxVocab = 1 << 24;               // the tokenizer's id limit
constexpr int kMaxWidth = 1 << 16;               // hidden size
constexpr int kMaxPositions = 1 << 20;           // positions (max_position_embeddings, max_new_tokens)
constexpr int64_t kMaxSequences = 1 << 20;       // sequences per rollout / SFT batch
constexpr int64_t kMaxRolloutTokens = int64_t(1) << 32;  // tokens per step (response caps summed)
constexpr double kMaxFloat = 3.0e38;             // FP32 max is 3.4e38
constexpr double kMinNormalFloat = 1.1754944e-38;

int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : 0;
}

// One configurable value: its dotted key, the type as users read it, a help line, and how to
// parse/print it. `set` throws a bare message ("expected ..."); callers prefix the key.
struct Field {
  std::string key, type, help;
  std::function<void(const std::string&)> set;
  std::function<std::string()> get;
  bool quote = false;  // strings are written double-quoted in YAML
  bool path = false;   // a file or directory: relative values resolve against the config's folder
                       // (for "file.py:function" values, the file part)
};

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

template <class Int>
Int parse_int(const std::string& s, const char* type) {
  Int v{};
  const char* b = s.data();
  const char* e = b + s.size();
  if (e - b > 1 && *b == '+' && b[1] != '-') ++b;  // "+5", not "+-5"
  auto [p, ec] = std::from_chars(b, e, v);
  if (s.empty() || ec != std::errc() || p != e) FP8RL_FAIL("expected ", type, ", got '", s, "'");
  return v;
}

double parse_float(const std::string& s) {
  char* end = nullptr;
  const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) FP8RL_FAIL("expected a number (float), got '", s, "'");
  if (!std::isfinite(v)) FP8RL_FAIL("expected a finite number, got '", s, "'");
  return v;
}

bool parse_bool(const std::string& s) {
  const std::string l = lower(s);
  if (l == "true" || l == "yes" || l == "on" || l == "1") return true;
  if (l == "false" || l == "no" || l == "off" || l == "0") return false;
  FP8RL_FAIL("expected a boolean (true or false), got '", s, "'");
}

std::string format_float(double v) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back exactly
  std::string s(buf, p);
  // Keep a '.' in the mantissa so that YAML 1.1 readers (PyYAML) also see a float: 3.0e-04.
  const size_t e = s.find('e');
  if (s.find('.') == std::string::npos) s.insert(e == std::string::npos ? s.size() : e, ".0");
  return s;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

class FieldTable {
 public:
  std::vector<Field> fields;

  void add_int(const std::string& key, int& v, const std::string& help) {
    fields.push_back({key, "an integer", help, [&v](const std::string& s) { v = parse_int<int>(s, "an integer"); },
                      [&v] { return std::to_string(v); }});
  }
  void add_int64(const std::string& key, int64_t& v, const std::string& help) {
    fields.push_back({key, "an integer", help,
                      [&v](const std::string& s) { v = parse_int<int64_t>(s, "an integer"); },
                      [&v] { return std::to_string(v); }});
  }
  void add_float(const std::string& key, double& v, const std::string& help) {
    fields.push_back({key, "a number (float)", help, [&v](const std::string& s) { v = parse_float(s); },
                      [&v] { return format_float(v); }});
  }
  void add_bool(const std::string& key, bool& v, const std::string& help) {
    fields.push_back({key, "a boolean", help, [&v](const std::string& s) { v = parse_bool(s); },
                      [&v] { return std::string(v ? "true" : "false"); }});
  }
  void add_string(const std::string& key, std::string& v, const std::string& help) {
    fields.push_back({key, "a string", help, [&v](const std::string& s) { v = s; }, [&v] { return v; }, true});
  }
  // A JSON object held as its text ("" = none); checked when set.
  void add_json_object(const std::string& key, std::string& v, const std::string& help) {
    fields.push_back({key, "a JSON object", help,
                      [&v](const std::string& s) {
                        if (!s.empty()) {
                          nlohmann::json j;
                          try {
                            j = nlohmann::json::parse(s);
                          } catch (const nlohmann::json::exception&) {
                            FP8RL_FAIL("expected a JSON object such as '{\"enable_thinking\": false}', got '", s, "'");
                          }
                          if (!j.is_object()) FP8RL_FAIL("expected a JSON object, got '", s, "'");
                        }
                        v = s;
                      },
                      [&v] { return v; }, true});
  }

  void add_path(const std::string& key, std::string& v, const std::string& help) {
    add_string(key, v, help);
    fields.back().path = true;
  }
  void add_choice(const std::string& key, std::string& v, std::vector<std::string> choices, const std::string& help) {
    const std::string type = "one of " + join(choices, ", ");
    fields.push_back({key, type, help,
                      [&v, choices, type](const std::string& s) {
                        if (std::find(choices.begin(), choices.end(), s) == choices.end())
                          FP8RL_FAIL("expected ", type, ", got '", s, "'");
                        v = s;
                      },
                      [&v] { return v; }});
  }
  // precision.consistent: off | on | attn | flash, with the boolean spellings of off and on (configs
  // written before the modes) kept.
  void add_consistent(const std::string& key, std::string& v, const std::string& help) {
    fields.push_back({key, "one of off, on, attn, flash (true / false: on / off)", help,
                      [&v](const std::string& s) {
                        if (s == "off" || s == "on" || s == "attn" || s == "flash") v = s;
                        else if (s == "true" || s == "false") v = s == "true" ? "on" : "off";
                        else FP8RL_FAIL("expected one of off, on, attn, flash (true / false: on / off), got '", s, "'");
                      },
                      [&v] { return v; }});
  }
  template <class E>
  void add_enum(const std::string& key, E& v, std::vector<std::string> choices, E (*from)(const std::string&),
                const char* (*name)(E), const std::string& help) {
    const std::string type = "one of " + join(choices, ", ");
    fields.push_back({key, type, help,
                      [&v, from, type](const std::string& s) {
                        try {
                          v = from(s);
                        } catch (const Error&) {
                          FP8RL_FAIL("expected ", type, ", got '", s, "'");
                        }
                      },
                      [&v, name] { return std::string(name(v)); }});
  }
};

// Every key, once. The order here is the order of the YAML dump.
std::vector<Field> config_fields(RunConfig& c) {
  FieldTable t;
  auto& m = c.model;
  t.add_path("model.path", m.path, "HF checkpoint directory; empty = the tiny model below");
  t.add_int("model.tiny.vocab_size", m.tiny.vocab_size, "0 = the tokenizer's vocabulary size");
  t.add_int("model.tiny.hidden_size", m.tiny.hidden_size, "D");
  t.add_int("model.tiny.intermediate_size", m.tiny.intermediate_size, "F (MLP)");
  t.add_int("model.tiny.num_layers", m.tiny.num_layers, "transformer blocks");
  t.add_int("model.tiny.num_heads", m.tiny.num_heads, "query heads");
  t.add_int("model.tiny.num_kv_heads", m.tiny.num_kv_heads, "key/value heads (GQA)");
  t.add_int("model.tiny.head_dim", m.tiny.head_dim, "per-head dimension");
  t.add_bool("model.tiny.qk_norm", m.tiny.qk_norm, "per-head RMSNorm on q and k (Qwen3)");
  t.add_int("model.tiny.max_position_embeddings", m.tiny.max_position_embeddings, "longest sequence");
  t.add_float("model.tiny.rope_theta", m.tiny.rope_theta, "RoPE base");
  t.add_float("model.tiny.init_std", m.tiny.init_std, "std of the random initialization");
  t.add_int("model.tiny.num_experts", m.tiny.num_experts, "mixture of experts (Qwen3-MoE): experts per block; 0 = dense MLP");
  t.add_int("model.tiny.num_experts_per_tok", m.tiny.num_experts_per_tok, "experts each token uses (with num_experts > 0)");
  t.add_int("model.tiny.moe_intermediate_size", m.tiny.moe_intermediate_size, "F of each expert (with num_experts > 0)");

  t.add_path("tokenizer.path", c.tokenizer.path, "empty = model.path (tiny model: built-in byte tokenizer)");
  t.add_bool("tokenizer.chat_template", c.tokenizer.chat_template,
             "wrap prompts in the chat template (the model's Jinja one if it has one)");
  t.add_json_object("tokenizer.chat_template_kwargs", c.tokenizer.chat_template_kwargs,
                    "extra chat template variables as JSON, e.g. {\"enable_thinking\": false}");

  auto& k = c.task;
  t.add_choice("task.name", k.name, {"arithmetic", "countdown", "gsm8k", "jsonl"}, "which task");
  t.add_int64("task.seed", k.seed, "prompt sampling seed; 0 = the run seed");
  t.add_int("task.arithmetic.min_operands", k.arithmetic.min_operands, "fewest operands per expression");
  t.add_int("task.arithmetic.max_operands", k.arithmetic.max_operands, "most operands per expression");
  t.add_int("task.arithmetic.digits", k.arithmetic.digits, "each operand has 1..digits digits");
  t.add_string("task.arithmetic.operators", k.arithmetic.operators, "operators to draw from (subset of +-*/)");
  t.add_bool("task.arithmetic.parentheses", k.arithmetic.parentheses, "allow parenthesized sub-expressions");
  t.add_choice("task.arithmetic.style", k.arithmetic.style, {"expression", "story"},
               "expression: What is 3 + 4 * 2?; story: a word problem, worked left to right");
  t.add_int("task.countdown.numbers", k.countdown.numbers, "given numbers, each used exactly once (2..6)");
  t.add_int("task.countdown.max_number", k.countdown.max_number, "each number in [1, max_number]");
  t.add_int("task.countdown.max_target", k.countdown.max_target, "target in [1, max_target]");
  t.add_path("task.gsm8k.path", k.gsm8k.path, "GSM8K directory (train.jsonl, test.jsonl)");
  t.add_path("task.jsonl.path", k.jsonl.path, "training data: one JSON object per line");
  t.add_path("task.jsonl.validation_path", k.jsonl.validation_path, "held-out data; empty = a fraction of path");
  t.add_float("task.jsonl.validation_fraction", k.jsonl.validation_fraction, "held out when validation_path is empty");
  t.add_string("task.jsonl.prompt_field", k.jsonl.prompt_field, "field holding the prompt");
  t.add_string("task.jsonl.answer_field", k.jsonl.answer_field, "field holding the reference answer");
  t.add_string("task.jsonl.solution_field", k.jsonl.solution_field, "field holding a worked solution (sft)");
  t.add_string("task.jsonl.instruction", k.jsonl.instruction, "appended to every prompt when non-empty");
  t.add_string("task.jsonl.prompt_template", k.jsonl.prompt_template,
               "empty = the prompt field; else {field} / {a.b} replaced by the row's values");
  t.add_path("task.reward.python", k.reward.python,
             "module:function or file.py:function scoring a batch; empty = the task's verifier");

  auto& r = c.rollout;
  t.add_int("rollout.prompts_per_step", r.prompts_per_step, "P prompts per GRPO step");
  t.add_int("rollout.generations_per_prompt", r.generations_per_prompt, "G samples per prompt (the group)");
  t.add_int("rollout.max_new_tokens", r.max_new_tokens, "response length cap");
  t.add_float("rollout.temperature", r.temperature, "sampling temperature (> 0)");
  t.add_float("rollout.top_p", r.top_p, "nucleus sampling; 1 = off");
  t.add_int("rollout.top_k", r.top_k, "top-k sampling; 0 = off");
  t.add_float("rollout.gpu_memory_utilization", r.gpu_memory_utilization,
              "as vLLM's: the fraction of the device's free memory the run may use; the KV pool gets what the "
              "memory plan leaves of it (more concurrent sequences, up to max_num_seqs); 0 = the pool sized from "
              "the rollout shape");
  t.add_int("rollout.max_num_seqs", r.max_num_seqs, "sequences the rollout engine runs at once (as vLLM's)");

  auto& tr = c.train;
  t.add_float("train.lr", tr.lr, "peak learning rate (Adam)");
  t.add_int("train.warmup_steps", tr.warmup_steps, "linear warm-up, in optimizer steps");
  t.add_enum("train.schedule", tr.schedule, {"constant", "cosine"}, lr_schedule_kind_from_name,
             lr_schedule_kind_name, "lr after warm-up");
  t.add_float("train.min_lr_ratio", tr.min_lr_ratio, "cosine: final lr / peak lr");
  t.add_float("train.weight_decay", tr.weight_decay, "AdamW decoupled weight decay");
  t.add_float("train.adam_beta1", tr.adam_beta1, "Adam beta1");
  t.add_float("train.adam_beta2", tr.adam_beta2, "Adam beta2");
  t.add_float("train.adam_eps", tr.adam_eps, "Adam epsilon");
  t.add_float("train.grad_clip", tr.grad_clip, "global gradient-norm clip; 0 = off");
  t.add_int64("train.micro_batch_tokens", tr.micro_batch_tokens, "tokens per forward/backward chunk");
  t.add_int("train.optimizer_steps_per_rollout", tr.optimizer_steps_per_rollout,
            "optimizer steps per GRPO step (mini-batches of the rollout batch)");
  t.add_choice("train.old_logprobs", tr.old_logprobs, {"auto", "score"},
               "where logp_old comes from: auto takes the first mini-batch's from its own optimizer step's forward "
               "(the rollout's weights: nothing is updated before it) and scores only the later mini-batches first "
               "(one optimizer step per rollout: no scoring pass); score: a scoring pass over every sequence");
  t.add_choice("train.recompute", tr.recompute, {"none", "block", "auto"},
               "activation recomputation: block keeps only each block's input and recomputes the block in "
               "backward (same gradients, ~1/5 of the saved activations, one more forward); auto: block when "
               "the memory plan does not fit the device without it (said at start)");
  t.add_choice("train.dgrad_weight_cache", tr.dgrad_weight_cache, {"auto", "on", "off"},
               "FP8 trainer: each FP8 linear's transposed 128x128 quantization (W^T) kept for the dgrad, "
               "refreshed every optimizer step (as large as the FP8 weights); off: the dgrad transposes W per call "
               "(slower); auto: on unless the memory plan does not fit with it (dropped before recomputation "
               "is turned on; said at start)");
  t.add_choice("train.grad_dtype", tr.grad_dtype, {"fp32", "bf16"},
               "gradient accumulation dtype (bf16: 2 B/param instead of 4; each op's contribution added in FP32 "
               "and rounded once)");
  t.add_choice("train.optimizer_state_dtype", tr.optimizer_state_dtype, {"fp32", "bf16"},
               "Adam moments m, v (bf16: 2+2 B/param instead of 4+4; FP32 math, FP32 master weights)");
  t.add_choice("train.optimizer_state_rounding", tr.optimizer_state_rounding, {"nearest", "stochastic"},
               "how BF16 moments are rounded: nearest (even) or stochastic (unbiased; seeded by the step, "
               "so runs and resumes are reproducible)");
  t.add_bool("train.shard_optimizer", tr.shard_optimizer,
             "data parallel: AdamW moments sharded over the ranks (ZeRO-1)");
  t.add_float("train.ratio_clip_low", tr.ratio_clip_low, "ratio clipped below at 1 - low");
  t.add_float("train.ratio_clip_high", tr.ratio_clip_high, "ratio clipped above at 1 + high");
  t.add_enum("train.loss_aggregation", tr.loss_aggregation, {"token", "sequence"}, loss_aggregation_from_name,
             loss_aggregation_name, "token: mean over all tokens; sequence: mean of per-sequence means");
  t.add_enum("train.baseline", tr.baseline, {"group_norm", "leave_one_out"}, advantage_baseline_from_name,
             advantage_baseline_name, "advantage baseline");
  t.add_float("train.kl_beta", tr.kl_beta, "k3 KL penalty to the initial policy; 0 = off");
  t.add_bool("train.routing_replay", tr.routing_replay,
             "MoE: the trainer uses the generator's recorded experts per token (weights from its own router)");
  t.add_enum("train.is.mode", tr.is.mode, {"none", "is", "tis", "icepop", "seq_mask"}, is_mode_from_name,
             is_mode_name, "importance-sampling correction of the generator/trainer mismatch");
  t.add_float("train.is.tis_cap", tr.is.tis_cap, "tis: weights truncated at this value");
  t.add_float("train.is.icepop_low", tr.is.icepop_low, "icepop: tokens with weight below are masked");
  t.add_float("train.is.icepop_high", tr.is.icepop_high, "icepop: tokens with weight above are masked");
  t.add_float("train.is.seq_mask_low", tr.is.seq_mask_low, "seq_mask: sequences with geometric-mean weight below are dropped");
  t.add_float("train.is.seq_mask_high", tr.is.seq_mask_high, "seq_mask: ... above are dropped");

  auto& p = c.precision;
  t.add_choice("precision.recipe", p.recipe, {"bf16", "fp8_gen", "fp8_e2e", "fp32"}, "preset (recipe.md)");
  t.add_choice("precision.generator_linear", p.generator_linear, {"auto", "fp32", "bf16", "fp8"},
               "override the preset's generator linears");
  t.add_choice("precision.trainer_linear", p.trainer_linear, {"auto", "fp32", "bf16", "fp8"},
               "override the preset's trainer linears");
  t.add_choice("precision.trainer_wgrad", p.trainer_wgrad, {"auto", "fp8", "bf16"},
               "FP8 trainer linears: weight gradient as an FP8 GEMM (dY, X requantized along tokens) or BF16");
  t.add_bool("precision.pow2_scales", p.pow2_scales, "power-of-two FP8 scales (UE8M0), both engines: weights, activations, KV cache");
  t.add_int("precision.bf16_first_layers", p.bf16_first_layers, "first n blocks stay BF16, both engines");
  t.add_int("precision.bf16_last_layers", p.bf16_last_layers, "last m blocks stay BF16, both engines");
  t.add_choice("precision.kv_cache", p.kv_cache, {"auto", "f32", "bf16", "e4m3"}, "generator KV cache dtype");
  t.add_bool("precision.fp8_attention", p.fp8_attention, "generator: QK^T and PV in FP8 (needs e4m3 KV)");
  t.add_choice("precision.trainer_kv_rounding", p.trainer_kv_rounding, {"auto", "on", "off"},
               "trainer: round k/v as the generator's E4M3 cache (needs e4m3 KV)");
  t.add_consistent("precision.consistent", p.consistent,
                   "off | on | attn | flash: the trainer scores as the generator generated, logp_old == "
                   "logp_gen bitwise (on: every op batch-invariant; attn / flash, with pow2_scales: the fast "
                   "FP8 products, the attention met in the generator's kernel / in flash order; docs/design.md)");
  t.add_bool("precision.consistent_logits", p.consistent_logits,
             "with a consistent mode: the logits and log-probs by token_logprobs' fixed F32 chunks on both "
             "engines (bitwise); false: each engine's own head, the engines agreeing up to the final hidden state");
  t.add_float("precision.kv_calib_percentile", p.kv_calib_percentile, "KV scale: percentile of micro-batch amax");
  t.add_float("precision.kv_calib_margin", p.kv_calib_margin, "KV scale: margin on that amax");

  t.add_int("sft.steps", c.sft.steps, "optimizer steps of fp8rl sft");
  t.add_int("sft.batch_size", c.sft.batch_size, "sequences per optimizer step");
  t.add_float("sft.lr", c.sft.lr, "peak learning rate of fp8rl sft (rest of the optimizer: train.*)");
  t.add_path("sft.data", c.sft.data, "jsonl of (prompt, answer); empty = the task's gold answers");
  t.add_path("sft.mix_gsm8k_path", c.sft.mix_gsm8k_path, "GSM8K directory mixed into SFT batches; empty = none");
  t.add_float("sft.mix_gsm8k_fraction", c.sft.mix_gsm8k_fraction, "fraction of each SFT batch from GSM8K train");
  t.add_int64("sft.max_seq_tokens", c.sft.max_seq_tokens, "skip mixed-in sequences longer than this; 0 = no limit");

  t.add_choice("checkpoint.dtype", c.checkpoint.dtype, {"bf16", "f32"},
               "dtype of the checkpoint's model files (the F32 master is kept for resume)");
  t.add_choice("checkpoint.format", c.checkpoint.format, {"hf", "fp8-block"},
               "hf, or fp8-block: the FP8 linears as F8_E4M3 + weight_scale_inv (vLLM, transformers)");
  t.add_float("checkpoint.max_shard_gb", c.checkpoint.max_shard_gb,
              "shard the model files above this size (with the index); 0 = never");
  t.add_bool("memory.allow_overcommit", c.memory.allow_overcommit,
             "start even if the memory plan's peak exceeds the device's free memory");
  t.add_float("memory.free_gib", c.memory.free_gib,
              "free device memory to check the plan against, GiB; 0 = ask the device (CPU: no check)");

  t.add_int("steps", c.steps, "GRPO steps");
  t.add_int("val_every", c.val_every, "validate at step 0 and every N steps; 0 = never");
  t.add_int("val_size", c.val_size, "held-out prompts per validation");
  t.add_int("checkpoint_every", c.checkpoint_every, "checkpoint every N steps; 0 = only at the end");
  t.add_int("checkpoint.keep_last", c.checkpoint.keep_last, "keep only the newest N checkpoints; 0 = all");
  t.add_bool("logger.tensorboard", c.logger.tensorboard, "also write TensorBoard events under RUN/tensorboard/");
  t.add_string("out", c.out, "run directory (config, metrics.jsonl, checkpoints)");
  t.add_choice("device", c.device, {"cpu", "cuda"}, "backend");
  t.add_int64("seed", c.seed, "run seed");
  t.add_int("max_consecutive_bad_steps", c.max_consecutive_bad_steps,
            "abort after this many non-finite steps in a row");
  t.add_float("time_budget_s", c.time_budget_s, "wall-clock budget of the run in seconds; 0 = none");
  t.add_float("checkpoint_max_abs_weight", c.checkpoint_max_abs_weight,
              "refuse to save a checkpoint with a weight of larger magnitude (exploded); 0 = no bound");
  return std::move(t.fields);
}

// Other spellings of a key that users bring from other tools (stored under the main name).
constexpr std::pair<const char*, const char*> kKeyAliases[] = {
    {"task.jsonl.prompt_key", "task.jsonl.prompt_field"},
    {"task.jsonl.answer_key", "task.jsonl.answer_field"},
    {"task.jsonl.solution_key", "task.jsonl.solution_field"},
    {"rl.routing_replay", "train.routing_replay"},
};

Field* find_field(std::vector<Field>& fields, const std::string& key_in) {
  std::string key = key_in;
  for (const auto& [alias, name] : kKeyAliases)
    if (key == alias) key = name;
  for (auto& f : fields)
    if (f.key == key) return &f;
  return nullptr;
}

bool is_section(const std::vector<Field>& fields, const std::string& prefix) {
  auto under = [&](const std::string& key) {
    return key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 && key[prefix.size()] == '.';
  };
  for (auto& f : fields)
    if (under(f.key)) return true;
  for (const auto& [alias, name] : kKeyAliases)  // an alias's section (rl: routing_replay) reads too
    if (under(alias)) return true;
  return false;
}

std::string leaf(const std::string& key) {
  const size_t dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

[[noreturn]] void fail_unknown(const std::string& key, const std::string& origin) {
  FP8RL_FAIL(origin, ": unknown key '", key, "' (did you mean '", config_nearest_key(key),
             "'? configs/demo_cpu.yaml lists every key)");
}

void set_field(std::vector<Field>& fields, const std::string& key, const std::string& value,
               const std::string& origin) {
  Field* f = find_field(fields, key);
  if (!f) {
    if (is_section(fields, key)) {
      std::string example;
      for (auto& g : fields)
        if (example.empty() && g.key.rfind(key + ".", 0) == 0) example = g.key;
      for (const auto& [alias, name] : kKeyAliases)
        if (example.empty() && std::string(alias).rfind(key + ".", 0) == 0) example = alias;
      FP8RL_FAIL(origin, ": '", key, "' is a section, not a value: set one of its keys (e.g. '", example, "')");
    }
    fail_unknown(key, origin);
  }
  try {
    f->set(value);
  } catch (const Error& e) {
    FP8RL_FAIL(origin, ": ", key, ": ", e.message());
  }
}

// A YAML value as JSON (for JSON-object keys written as a YAML mapping): plain scalars that
// read as booleans, null or numbers become those, quoted ones stay strings.
nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    nlohmann::json j = nlohmann::json::object();
    for (auto it = n.begin(); it != n.end(); ++it) j[it->first.as<std::string>()] = yaml_to_json(it->second);
    return j;
  }
  if (n.IsSequence()) {
    nlohmann::json j = nlohmann::json::array();
    for (auto it = n.begin(); it != n.end(); ++it) j.push_back(yaml_to_json(*it));
    return j;
  }
  if (n.IsNull()) return nullptr;
  const std::string s = n.Scalar();
  if (n.Tag() == "!") return s;  // quoted
  const std::string l = lower(s);
  if (l == "true" || l == "false") return l == "true";
  if (l == "null" || l == "~") return nullptr;
  try {
    return nlohmann::json::parse(s);  // numbers
  } catch (const nlohmann::json::exception&) {
    return s;
  }
}

// Nesting depth of a loaded document, walked with an explicit stack (no recursion over user
// data): a config is at most 4 levels deep (train.is.mode); deeper nesting is refused.
void check_yaml_depth(const YAML::Node& root, const std::string& origin) {
  std::vector<std::pair<YAML::Node, int>> stack{{root, 1}};
  while (!stack.empty()) {
    auto [n, depth] = stack.back();
    stack.pop_back();
    if (!n.IsMap() && !n.IsSequence()) continue;
    if (depth > kMaxYamlDepth)
      FP8RL_FAIL(origin, ":", n.Mark().line + 1, ": nested more than ", kMaxYamlDepth,
                 " levels deep; a run config has sections of keys (train: {lr: ..., is: {mode: ...}})");
    for (auto it = n.begin(); it != n.end(); ++it) stack.push_back({n.IsMap() ? it->second : *it, depth + 1});
  }
}

// A relative path value made absolute against `base_dir` ("" = the current directory).
std::string resolve_path(const std::string& value, const std::string& base_dir) {
  if (value.empty()) return value;
  // "module:function" stays (a module on PYTHONPATH); "file.py:function" resolves the file.
  if (const size_t colon = value.rfind(':'); colon != std::string::npos) {
    const std::string file = value.substr(0, colon);
    if (file.size() < 3 || file.compare(file.size() - 3, 3, ".py") != 0) return value;
    return resolve_path(file, base_dir) + value.substr(colon);
  }
  std::filesystem::path p(value);
  if (p.is_absolute()) return value;
  const std::filesystem::path base = base_dir.empty() ? std::filesystem::current_path()
                                                      : std::filesystem::absolute(base_dir);
  return (base / p).lexically_normal().string();
}

void apply_node(std::vector<Field>& fields, const YAML::Node& node, const std::string& prefix,
                const std::string& origin, const std::string& base_dir) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    // Copies: the iterator hands out a temporary pair, references into it would dangle.
    const YAML::Node k = it->first, v = it->second;
    const std::string name = k.as<std::string>();
    const std::string key = prefix.empty() ? name : prefix + "." + name;
    const std::string where = origin + ":" + std::to_string(k.Mark().line + 1);
    if (v.IsMap()) {
      if (Field* f = find_field(fields, key); f && f->type == "a JSON object") {
        set_field(fields, key, yaml_to_json(v).dump(), where);
        continue;
      }
      if (find_field(fields, key)) {
        Field* f = find_field(fields, key);
        FP8RL_FAIL(where, ": ", key, ": expected ", f->type, ", got a mapping");
      }
      if (!is_section(fields, key)) fail_unknown(key, where);
      apply_node(fields, v, key, origin, base_dir);
    } else if (v.IsSequence()) {
      Field* f = find_field(fields, key);
      if (!f) fail_unknown(key, where);
      FP8RL_FAIL(where, ": ", key, ": expected ", f->type, ", got a list");
    } else if (v.IsNull()) {
      Field* f = find_field(fields, key);
      if (!f && !is_section(fields, key)) fail_unknown(key, where);
      if (!f || !f->quote) FP8RL_FAIL(where, ": ", key, ": no value given (expected ", f ? f->type : "a mapping", ")");
      f->set("");
    } else {
      Field* f = find_field(fields, key);
      const bool resolve = f && f->path && !base_dir.empty();
      set_field(fields, key, resolve ? resolve_path(v.Scalar(), base_dir) : v.Scalar(), where);
    }
  }
}

}  // namespace

// ---- public API ------------------------------------------------------------------------------
std::vector<std::string> config_keys() {
  RunConfig c;
  std::vector<std::string> keys;
  for (auto& f : config_fields(c)) keys.push_back(f.key);
  return keys;
}

bool config_has_key(const std::string& key) {
  RunConfig c;
  auto fields = config_fields(c);
  return find_field(fields, key) != nullptr;
}

std::string config_nearest_key(const std::string& key) {
  // A key's distance is the smaller of the whole-key distance and the leaf distance plus one,
  // so that "lr" finds "train.lr" and "train.lrr" finds "train.lr".
  // Candidates: every key and every section ("trian" -> "train").
  std::vector<std::string> candidates;
  for (const std::string& k : config_keys()) {
    for (size_t dot = k.find('.'); dot != std::string::npos; dot = k.find('.', dot + 1))
      if (std::find(candidates.begin(), candidates.end(), k.substr(0, dot)) == candidates.end())
        candidates.push_back(k.substr(0, dot));
    candidates.push_back(k);
  }
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& k : candidates) {
    const size_t d = std::min(edit_distance(key, k), edit_distance(leaf(key), leaf(k)) + 1);
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

void config_set(RunConfig& c, const std::string& key, const std::string& value) {
  auto fields = config_fields(c);
  set_field(fields, key, value, "config");
}

void config_apply_override(RunConfig& c, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    FP8RL_FAIL("override '", assignment, "' must look like key.sub=value (e.g. train.lr=1e-6)");
  auto fields = config_fields(c);
  const std::string key = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  // Paths on the command line are relative to the current directory; stored absolute, so that a
  // saved run config means the same files from anywhere (--resume from another directory).
  if (Field* f = find_field(fields, key); f && f->path) value = resolve_path(value, "");
  set_field(fields, key, value, "override '" + assignment + "'");
}

void config_apply_yaml(RunConfig& c, const std::string& yaml_text_in, const std::string& origin,
                       const std::string& base_dir) {
  if (yaml_text_in.size() > kMaxYamlBytes)
    FP8RL_FAIL(origin, ": ", yaml_text_in.size(), " bytes is far more than a run config needs (limit ",
               kMaxYamlBytes >> 20, " MiB); is this the right file?");
  // yaml-cpp ends an unclosed quoted string at a final newline instead of failing ("illegal EOF
  // in scalar" only without one): parse the text without its trailing line breaks.
  std::string yaml_text = yaml_text_in;
  while (!yaml_text.empty() && (yaml_text.back() == '\n' || yaml_text.back() == '\r')) yaml_text.pop_back();
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    FP8RL_FAIL(origin, ":", e.mark.line + 1, ":", e.mark.column + 1, ": not valid YAML: ", e.msg);
  }
  if (root.IsNull()) return;  // an empty file: the defaults
  if (!root.IsMap()) FP8RL_FAIL(origin, ": the top level must be a mapping of sections (model:, train:, ...)");
  check_yaml_depth(root, origin);
  auto fields = config_fields(c);
  try {
    apply_node(fields, root, "", origin, base_dir);
  } catch (const YAML::Exception& e) {
    FP8RL_FAIL(origin, ":", e.mark.line + 1, ": ", e.msg);
  }
}

RunConfig config_load(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  RunConfig c;
  if (!yaml_path.empty()) {
    if (!std::filesystem::exists(yaml_path)) FP8RL_FAIL("config file '", yaml_path, "' does not exist");
    const std::string dir = std::filesystem::path(yaml_path).parent_path().string();
    config_apply_yaml(c, read_file_limited(yaml_path, kMaxYamlBytes, "config file"), yaml_path, dir.empty() ? "." : dir);
  }
  for (const std::string& o : overrides) config_apply_override(c, o);
  config_validate(c);
  return c;
}

std::vector<std::string> config_diff(const RunConfig& a_in, const RunConfig& b_in) {
  RunConfig a = a_in, b = b_in;  // the field tables bind to mutable configs; we only read them
  const auto fa = config_fields(a), fb = config_fields(b);
  std::vector<std::string> out;
  for (size_t i = 0; i < fa.size(); ++i) {
    const std::string va = fa[i].get(), vb = fb[i].get();
    if (va == vb) continue;
    auto show = [&](const std::string& v) { return fa[i].quote ? "\"" + v + "\"" : v; };
    out.push_back(fa[i].key + ": " + show(va) + " -> " + show(vb));
  }
  return out;
}

std::string config_to_yaml(const RunConfig& c_in) {
  RunConfig c = c_in;  // the field table binds to a mutable config; we only read it
  const auto fields = config_fields(c);
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // the sections currently open
  for (const Field& f : fields) {
    std::vector<std::string> parts;
    for (size_t s = 0, d; ; s = d + 1) {
      d = f.key.find('.', s);
      parts.push_back(f.key.substr(s, d == std::string::npos ? d : d - s));
      if (d == std::string::npos) break;
    }
    const std::vector<std::string> sections(parts.begin(), parts.end() - 1);
    size_t common = 0;
    while (common < open.size() && common < sections.size() && open[common] == sections[common]) ++common;
    while (open.size() > common) {
      out << YAML::EndMap;
      open.pop_back();
    }
    while (open.size() < sections.size()) {
      out << YAML::Key << sections[open.size()] << YAML::Value << YAML::BeginMap;
      open.push_back(sections[open.size()]);
    }
    out << YAML::Key << parts.back() << YAML::Value;
    if (f.quote) out << YAML::DoubleQuoted;
    out << f.get() << YAML::Comment(f.help);
  }
  while (!open.empty()) {
    out << YAML::EndMap;
    open.pop_back();
  }
  out << YAML::EndMap;
  FP8RL_CHECK(out.good(), "internal: YAML emitter failed: ", out.GetLastError());
  return std::string(out.c_str()) + "\n";
}

// ---- validation ------------------------------------------------------------------------------
void config_validate(const RunConfig& c) {
  auto need = [](bool ok, const char* key, const auto&... what) {
    if (!ok) FP8RL_FAIL("config: ", key, ": ", what...);
  };
  const auto& tiny = c.model.tiny;
  if (c.model.path.empty()) {
    need(tiny.vocab_size >= 0, "model.tiny.vocab_size", "must be >= 0 (0 = the tokenizer's)");
    need(tiny.hidden_size > 0 && tiny.intermediate_size > 0 && tiny.num_layers > 0, "model.tiny",
         "hidden_size, intermediate_size and num_layers must be > 0");
    need(tiny.num_heads > 0 && tiny.num_kv_heads > 0 && tiny.num_heads % tiny.num_kv_heads == 0,
         "model.tiny.num_kv_heads", "must be > 0 and divide num_heads (", tiny.num_heads, ")");
    need(tiny.head_dim > 0 && tiny.head_dim % 2 == 0, "model.tiny.head_dim", "must be even and > 0 (RoPE)");
    need(tiny.max_position_embeddings > 0, "model.tiny.max_position_embeddings", "must be > 0");
    need(tiny.rope_theta > 0, "model.tiny.rope_theta", "must be > 0");
    need(tiny.init_std > 0, "model.tiny.init_std", "must be > 0");
    need(tiny.num_experts >= 0, "model.tiny.num_experts", "must be >= 0 (0 = dense)");
    if (tiny.num_experts > 0) {
      need(tiny.num_experts_per_tok >= 1 && tiny.num_experts_per_tok <= tiny.num_experts,
           "model.tiny.num_experts_per_tok", "must be in [1, num_experts = ", tiny.num_experts, "]");
      need(tiny.moe_intermediate_size > 0, "model.tiny.moe_intermediate_size", "must be > 0");
    }
    need(tiny.num_experts <= 1024 && tiny.moe_intermediate_size <= 4 * kMaxWidth, "model.tiny",
         "num_experts must be <= 1024 and moe_intermediate_size <= ", 4 * kMaxWidth);
    // Real bounds before anything is allocated: each dimension, then the whole model's training
    // state (FP32 weights, gradients and two Adam moments: 16 bytes per parameter) in 64 bits.
    need(tiny.vocab_size <= kMaxVocab, "model.tiny.vocab_size", "must be <= ", kMaxVocab);
    need(tiny.hidden_size <= kMaxWidth, "model.tiny.hidden_size", "must be <= ", kMaxWidth);
    need(tiny.intermediate_size <= 4 * kMaxWidth, "model.tiny.intermediate_size", "must be <= ", 4 * kMaxWidth);
    need(tiny.num_layers <= 1024, "model.tiny.num_layers", "must be <= 1024");
    need(tiny.num_heads <= 1024, "model.tiny.num_heads", "must be <= 1024");
    need(tiny.head_dim <= 1024, "model.tiny.head_dim", "must be <= 1024");
    need(tiny.max_position_embeddings <= kMaxPositions, "model.tiny.max_position_embeddings", "must be <= ",
         kMaxPositions);
    const int64_t D = tiny.hidden_size, F = tiny.intermediate_size, L = tiny.num_layers, hd = tiny.head_dim;
    const int64_t V = std::max(tiny.vocab_size, 384);
    // A mixture-of-experts MLP holds num_experts experts of moe_intermediate_size (and a router).
    const int64_t mlp = tiny.num_experts > 0
                            ? int64_t(tiny.num_experts) * (3 * D * int64_t(tiny.moe_intermediate_size) + D)
                            : 3 * D * F;
    const int64_t per_layer = D * hd * (2 * int64_t(tiny.num_heads) + 2 * int64_t(tiny.num_kv_heads)) + mlp + 2 * D;
    const int64_t params = 2 * V * D + L * per_layer + D;
    const int64_t mem = host_memory_bytes();
    need(mem <= 0 || params * 16 <= mem, "model.tiny", "a model of ", params, " parameters needs ",
         params * 16 / (int64_t(1) << 20), " MiB of training state (16 bytes per parameter), more than this "
         "machine's ", mem / (int64_t(1) << 20), " MiB: reduce hidden_size, intermediate_size or num_layers");
  }
  const auto& t = c.task;
  if (t.name == "arithmetic") {
    need(t.arithmetic.min_operands >= 2 && t.arithmetic.max_operands >= t.arithmetic.min_operands &&
             t.arithmetic.max_operands <= 64,
         "task.arithmetic.max_operands", "needs 2 <= min_operands <= max_operands <= 64");
    need(t.arithmetic.digits >= 1 && t.arithmetic.digits <= 9, "task.arithmetic.digits", "must be in [1, 9]");
    need(!t.arithmetic.operators.empty() && t.arithmetic.operators.find_first_not_of("+-*/") == std::string::npos,
         "task.arithmetic.operators", "must be a non-empty subset of \"+-*/\", got \"", t.arithmetic.operators, "\"");
  } else if (t.name == "countdown") {
    need(t.countdown.numbers >= 2 && t.countdown.numbers <= 6, "task.countdown.numbers", "must be in [2, 6]");
    need(t.countdown.max_number >= 1, "task.countdown.max_number", "must be >= 1");
    need(t.countdown.max_target >= 1, "task.countdown.max_target", "must be >= 1");
  } else if (t.name == "gsm8k") {
    need(!t.gsm8k.path.empty(), "task.gsm8k.path", "is required with task.name=gsm8k");
  } else if (t.name == "jsonl") {
    need(!t.jsonl.path.empty(), "task.jsonl.path", "is required with task.name=jsonl");
    need(!t.jsonl.prompt_field.empty() && !t.jsonl.answer_field.empty(), "task.jsonl",
         "prompt_field and answer_field must be non-empty");
  }
  const auto& r = c.rollout;
  need(r.prompts_per_step >= 1 && r.prompts_per_step <= kMaxSequences, "rollout.prompts_per_step",
       "must be in [1, ", kMaxSequences, "]");
  need(r.generations_per_prompt >= 2 && r.generations_per_prompt <= kMaxSequences, "rollout.generations_per_prompt",
       "must be in [2, ", kMaxSequences, "] (a group of one has no baseline, its advantage is always 0)");
  const int64_t sequences = int64_t(r.prompts_per_step) * r.generations_per_prompt;  // 64-bit: no overflow
  need(sequences <= kMaxSequences, "rollout.generations_per_prompt", "prompts_per_step x generations_per_prompt = ",
       sequences, " sequences per step; at most ", kMaxSequences, " fit the rollout batch");
  need(r.max_new_tokens >= 1 && r.max_new_tokens <= kMaxPositions, "rollout.max_new_tokens", "must be in [1, ",
       kMaxPositions, "]");
  if (c.model.path.empty())
    need(r.max_new_tokens < tiny.max_position_embeddings, "rollout.max_new_tokens", "must be below ",
         "model.tiny.max_position_embeddings (", tiny.max_position_embeddings, "): prompt and response share the ",
         "model's positions");
  need(int64_t(r.max_new_tokens) * sequences <= kMaxRolloutTokens, "rollout.max_new_tokens",
       "x the sequences per step (", sequences, ") is more than ", kMaxRolloutTokens, " tokens per step");
  need(r.temperature > 0, "rollout.temperature", "must be > 0 (use a small value for near-greedy sampling)");
  need(r.top_p > 0 && r.top_p <= 1, "rollout.top_p", "must be in (0, 1]");
  need(r.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)");
  need(r.gpu_memory_utilization >= 0 && r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
       "must be in [0, 1] (0 = the KV pool sized from the rollout shape; e.g. 0.9)");
  need(r.max_num_seqs >= 1 && r.max_num_seqs <= kMaxSequences, "rollout.max_num_seqs", "must be in [1, ",
       kMaxSequences, "]");

  const auto& tr = c.train;
  // Values the engines use as FP32 must be representable there (1e-50 would become 0).
  need(tr.lr >= 0 && tr.lr <= kMaxFloat, "train.lr", "must be in [0, ", kMaxFloat, "]");
  need(tr.adam_eps >= kMinNormalFloat || tr.adam_eps <= 0, "train.adam_eps", "is ", tr.adam_eps,
       ", below the smallest normal FP32 value (", kMinNormalFloat, "): it would be 0 in the optimizer; use 1e-8");
  need(tr.kl_beta <= kMaxFloat, "train.kl_beta", "must be <= ", kMaxFloat);
  need(tr.grad_clip <= kMaxFloat, "train.grad_clip", "must be <= ", kMaxFloat);
  need(tr.warmup_steps >= 0, "train.warmup_steps", "must be >= 0");
  need(tr.weight_decay >= 0, "train.weight_decay", "must be >= 0");
  need(tr.adam_beta1 >= 0 && tr.adam_beta1 < 1, "train.adam_beta1", "must be in [0, 1)");
  need(tr.adam_beta2 >= 0 && tr.adam_beta2 < 1, "train.adam_beta2", "must be in [0, 1)");
  need(tr.adam_eps > 0, "train.adam_eps", "must be > 0");
  need(tr.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 = off)");
  need(tr.micro_batch_tokens >= 1 && tr.micro_batch_tokens <= kMaxRolloutTokens, "train.micro_batch_tokens",
       "must be in [1, ", kMaxRolloutTokens, "]");
  need(tr.optimizer_state_rounding == "nearest" || tr.optimizer_state_dtype == "bf16", "train.optimizer_state_rounding",
       "stochastic rounds BF16 moments: set train.optimizer_state_dtype: bf16 too, or leave the rounding nearest");
  need(tr.optimizer_steps_per_rollout >= 1, "train.optimizer_steps_per_rollout", "must be >= 1");
  need(tr.optimizer_steps_per_rollout <= sequences, "train.optimizer_steps_per_rollout",
       "must not exceed the sequences per step (", sequences, ")");
  need(tr.min_lr_ratio >= 0 && tr.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]");
  const int64_t total_opt = static_cast<int64_t>(c.steps) * tr.optimizer_steps_per_rollout;
  need(tr.schedule != LrScheduleKind::Cosine || total_opt > tr.warmup_steps, "train.warmup_steps",
       "cosine decay needs steps * optimizer_steps_per_rollout (", total_opt, ") > warmup_steps");
  need(tr.ratio_clip_low >= 0 && tr.ratio_clip_low < 1, "train.ratio_clip_low", "must be in [0, 1)");
  need(tr.ratio_clip_high >= 0, "train.ratio_clip_high", "must be >= 0");
  need(tr.kl_beta >= 0, "train.kl_beta", "must be >= 0 (0 = off)");
  need(tr.is.tis_cap > 0, "train.is.tis_cap", "must be > 0");
  need(tr.is.icepop_low >= 0 && tr.is.icepop_low < tr.is.icepop_high, "train.is.icepop_low",
       "the icepop band needs 0 <= icepop_low < icepop_high, got [", tr.is.icepop_low, ", ", tr.is.icepop_high, "]");
  need(tr.is.seq_mask_low > 0 && tr.is.seq_mask_low < tr.is.seq_mask_high, "train.is.seq_mask_low",
       "the seq_mask band needs 0 < seq_mask_low < seq_mask_high, got [", tr.is.seq_mask_low, ", ",
       tr.is.seq_mask_high, "]");
  grpo_validate_options(config_grpo_options(tr));  // the loss's own checks (same conditions)

  const auto& p = c.precision;
  need(p.bf16_first_layers >= 0, "precision.bf16_first_layers", "must be >= 0");
  need(p.bf16_last_layers >= 0, "precision.bf16_last_layers", "must be >= 0");
  const bool consistent = p.consistent != "off";
  need(!consistent || !p.fp8_attention, "precision.consistent",
       "does not take FP8 attention (the trainer's attention backward has no FP8 form): set "
       "precision.fp8_attention=false");
  need(!consistent || p.trainer_kv_rounding == "auto", "precision.consistent",
       "decides how the trainer reads k and v (through a cache of the generator's KV dtype): leave "
       "precision.trainer_kv_rounding at auto");
  need(consistent || p.consistent_logits, "precision.consistent_logits",
       "= false relaxes a consistent mode's head: set precision.consistent (on, attn or flash) too, or "
       "precision.consistent_logits=true");
  const PrecisionRecipe recipe = config_precision_recipe(p);
  if (p.consistent == "attn" || p.consistent == "flash") {
    need(recipe.generator.linear == LinearMode::FP8_BLOCK && recipe.trainer.linear == LinearMode::FP8_BLOCK,
         "precision.consistent", p.consistent,
         " keeps each engine's fast per-batch-size products, which agree only as FP8 products with "
         "power-of-two scales: use the fp8_e2e recipe with precision.pow2_scales=true, or precision.consistent=on; "
         "for a run without the consistent mode set precision.consistent=off precision.consistent_logits=true");
    need(p.pow2_scales, "precision.consistent", p.consistent,
         " keeps each engine's fast per-batch-size FP8 products, which agree only with power-of-two "
         "scales: set precision.pow2_scales=true (or use precision.consistent=on)");
  }
  need(p.trainer_kv_rounding != "on" || recipe.generator.kv_cache == DType::E4M3, "precision.trainer_kv_rounding",
       "needs an E4M3 KV cache (set precision.kv_cache=e4m3 or use an fp8 recipe)");
  need(!recipe.generator.fp8_attention || recipe.generator.kv_cache == DType::E4M3, "precision.fp8_attention",
       "needs an E4M3 KV cache (set precision.kv_cache=e4m3 or use an fp8 recipe)");
  need(p.kv_calib_percentile > 0 && p.kv_calib_percentile <= 1, "precision.kv_calib_percentile", "must be in (0, 1]");
  need(p.kv_calib_margin >= 1, "precision.kv_calib_margin", "must be >= 1 (a margin below 1 clips the largest values)");

  need(c.sft.steps >= 0, "sft.steps", "must be >= 0");
  need(c.sft.batch_size >= 1 && c.sft.batch_size <= kMaxSequences, "sft.batch_size", "must be in [1, ",
       kMaxSequences, "]");
  need(c.sft.lr >= 0, "sft.lr", "must be >= 0");
  need(c.sft.mix_gsm8k_fraction >= 0 && c.sft.mix_gsm8k_fraction <= 1, "sft.mix_gsm8k_fraction", "must be in [0, 1]");
  need(c.sft.mix_gsm8k_fraction == 0 || !c.sft.mix_gsm8k_path.empty(), "sft.mix_gsm8k_path",
       "is required when sft.mix_gsm8k_fraction > 0 (the GSM8K directory)");
  need(c.sft.max_seq_tokens >= 0, "sft.max_seq_tokens", "must be >= 0 (0 = no limit)");
  need(c.time_budget_s >= 0, "time_budget_s", "must be >= 0 (0 = none)");
  need(c.memory.free_gib >= 0, "memory.free_gib", "must be >= 0 (0 = ask the device)");

  need(c.steps >= 0, "steps", "must be >= 0");
  need(c.val_every >= 0, "val_every", "must be >= 0 (0 = never)");
  need(c.val_size >= 0 && c.val_size <= kMaxSequences, "val_size", "must be in [0, ", kMaxSequences, "]");
  need(r.top_k <= kMaxVocab, "rollout.top_k", "must be <= ", kMaxVocab);
  need(r.temperature <= kMaxFloat, "rollout.temperature", "must be <= ", kMaxFloat);
  need(c.val_every == 0 || c.val_size >= 1, "val_size", "must be >= 1 when val_every > 0");
  need(c.checkpoint_every >= 0, "checkpoint_every", "must be >= 0");
  need(c.checkpoint.max_shard_gb >= 0, "checkpoint.max_shard_gb", "must be >= 0");
  need(c.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0 = keep all)");
  need(c.task.reward.python.empty() || c.task.reward.python.find(':') != std::string::npos, "task.reward.python",
       "must look like module:function or path/to/file.py:function, got \"", c.task.reward.python, "\"");
  need(!c.out.empty(), "out", "must name a run directory");
  need(c.max_consecutive_bad_steps >= 1, "max_consecutive_bad_steps",
       "must be >= 1 (the run stops after this many skipped optimizer steps in a row)");
  need(c.checkpoint_max_abs_weight >= 0, "checkpoint_max_abs_weight", "must be >= 0 (0 = no bound)");
}

// ---- mapping onto the engines ----------------------------------------------------------------
PrecisionRecipe config_precision_recipe(const PrecisionSection& p) {
  PrecisionRecipe r = PrecisionRecipe::preset(p.recipe);
  if (p.generator_linear != "auto") r.generator.linear = linear_mode_from_name(p.generator_linear);
  if (p.trainer_linear != "auto") r.trainer.linear = linear_mode_from_name(p.trainer_linear);
  if (p.trainer_wgrad != "auto") r.trainer.wgrad = linear_mode_from_name(p.trainer_wgrad);
  for (EnginePrecision* e : {&r.generator, &r.trainer}) {
    e->pow2_scales = p.pow2_scales;
    e->bf16_first_layers = p.bf16_first_layers;
    e->bf16_last_layers = p.bf16_last_layers;
  }
  if (p.kv_cache != "auto") r.generator.kv_cache = dtype_from_name(p.kv_cache);
  r.generator.fp8_attention = p.fp8_attention;
  if (p.trainer_kv_rounding != "auto") r.trainer.kv_cache = p.trainer_kv_rounding == "on" ? DType::E4M3 : DType::BF16;
  if (r.generator.kv_cache != DType::E4M3) r.trainer.kv_cache = DType::BF16;  // nothing to round as
  r.set_consistent_mode(p.consistent);
  r.generator.consistent_logits = r.trainer.consistent_logits = p.consistent_logits;
  const bool custom = p.generator_linear != "auto" || p.trainer_linear != "auto" || p.kv_cache != "auto" ||
                      p.fp8_attention || p.pow2_scales || p.bf16_first_layers || p.bf16_last_layers ||
                      p.trainer_kv_rounding != "auto" || p.trainer_wgrad != "auto";
  if (custom) r.name += "+custom";
  if (p.consistent == "on") r.name += "+consistent";
  else if (p.consistent != "off") r.name += "+consistent=" + p.consistent;
  if (p.consistent != "off" && !p.consistent_logits) r.name += "+logits=fast";
  return r;
}

GrpoLossOptions config_grpo_options(const TrainSection& t) {
  GrpoLossOptions o;
  o.ratio_clip_low = t.ratio_clip_low;
  o.ratio_clip_high = t.ratio_clip_high;
  o.aggregation = t.loss_aggregation;
  o.is_mode = t.is.mode;
  o.tis_cap = t.is.tis_cap;
  o.icepop_low = t.is.icepop_low;
  o.icepop_high = t.is.icepop_high;
  o.seq_mask_low = t.is.seq_mask_low;
  o.seq_mask_high = t.is.seq_mask_high;
  o.kl_beta = t.kl_beta;
  return o;
}

LrSchedule config_lr_schedule(const TrainSection& t, int64_t total_optimizer_steps) {
  LrSchedule s;
  s.base_lr = t.lr;
  s.warmup_steps = t.warmup_steps;
  s.kind = t.schedule;
  s.total_steps = total_optimizer_steps;
  s.min_lr_ratio = t.min_lr_ratio;
  return s;
}

}  // namespace fp8rl
