#include "rl/config.h"

#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>

#include "core/error.h"
#include "core/fs.h"

namespace fp8rl {

// ---- the key table ---------------------------------------------------------------------------
namespace {

// One configurable value: its dotted key, the type as users read it, a help line, and how to
// parse/print it. `set` throws a bare message ("expected ..."); callers prefix the key.
struct Field {
  std::string key, type, help;
  std::function<void(const std::string&)> set;
  std::function<std::string()> get;
  bool quote = false;  // strings are written double-quoted in YAML
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
  if (b != e && *b == '+') ++b;
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
  t.add_string("model.path", m.path, "HF checkpoint directory; empty = the tiny model below");
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

  t.add_string("tokenizer.path", c.tokenizer.path, "empty = model.path (tiny model: built-in byte tokenizer)");
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
  t.add_string("task.gsm8k.path", k.gsm8k.path, "GSM8K directory (train.jsonl, test.jsonl)");
  t.add_string("task.jsonl.path", k.jsonl.path, "training data: one JSON object per line");
  t.add_string("task.jsonl.validation_path", k.jsonl.validation_path, "held-out data; empty = a fraction of path");
  t.add_float("task.jsonl.validation_fraction", k.jsonl.validation_fraction, "held out when validation_path is empty");
  t.add_string("task.jsonl.prompt_field", k.jsonl.prompt_field, "field holding the prompt");
  t.add_string("task.jsonl.answer_field", k.jsonl.answer_field, "field holding the reference answer");
  t.add_string("task.jsonl.solution_field", k.jsonl.solution_field, "field holding a worked solution (sft)");
  t.add_string("task.jsonl.instruction", k.jsonl.instruction, "appended to every prompt when non-empty");

  auto& r = c.rollout;
  t.add_int("rollout.prompts_per_step", r.prompts_per_step, "P prompts per GRPO step");
  t.add_int("rollout.generations_per_prompt", r.generations_per_prompt, "G samples per prompt (the group)");
  t.add_int("rollout.max_new_tokens", r.max_new_tokens, "response length cap");
  t.add_float("rollout.temperature", r.temperature, "sampling temperature (> 0)");
  t.add_float("rollout.top_p", r.top_p, "nucleus sampling; 1 = off");
  t.add_int("rollout.top_k", r.top_k, "top-k sampling; 0 = off");

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
  t.add_bool("train.shard_optimizer", tr.shard_optimizer,
             "data parallel: AdamW moments sharded over the ranks (ZeRO-1)");
  t.add_float("train.ratio_clip_low", tr.ratio_clip_low, "ratio clipped below at 1 - low");
  t.add_float("train.ratio_clip_high", tr.ratio_clip_high, "ratio clipped above at 1 + high");
  t.add_enum("train.loss_aggregation", tr.loss_aggregation, {"token", "sequence"}, loss_aggregation_from_name,
             loss_aggregation_name, "token: mean over all tokens; sequence: mean of per-sequence means");
  t.add_enum("train.baseline", tr.baseline, {"group_norm", "leave_one_out"}, advantage_baseline_from_name,
             advantage_baseline_name, "advantage baseline");
  t.add_float("train.kl_beta", tr.kl_beta, "k3 KL penalty to the initial policy; 0 = off");
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
  t.add_bool("precision.pow2_scales", p.pow2_scales, "power-of-two FP8 scales (UE8M0), both engines");
  t.add_int("precision.bf16_first_layers", p.bf16_first_layers, "first n blocks stay BF16, both engines");
  t.add_int("precision.bf16_last_layers", p.bf16_last_layers, "last m blocks stay BF16, both engines");
  t.add_choice("precision.kv_cache", p.kv_cache, {"auto", "f32", "bf16", "e4m3"}, "generator KV cache dtype");
  t.add_bool("precision.fp8_attention", p.fp8_attention, "generator: QK^T and PV in FP8 (needs e4m3 KV)");
  t.add_float("precision.kv_calib_percentile", p.kv_calib_percentile, "KV scale: percentile of micro-batch amax");
  t.add_float("precision.kv_calib_margin", p.kv_calib_margin, "KV scale: margin on that amax");

  t.add_int("sft.steps", c.sft.steps, "optimizer steps of fp8rl sft");
  t.add_int("sft.batch_size", c.sft.batch_size, "sequences per optimizer step");
  t.add_float("sft.lr", c.sft.lr, "peak learning rate of fp8rl sft (rest of the optimizer: train.*)");
  t.add_string("sft.data", c.sft.data, "jsonl of (prompt, answer); empty = the task's gold answers");
  t.add_string("sft.mix_gsm8k_path", c.sft.mix_gsm8k_path, "GSM8K directory mixed into SFT batches; empty = none");
  t.add_float("sft.mix_gsm8k_fraction", c.sft.mix_gsm8k_fraction, "fraction of each SFT batch from GSM8K train");
  t.add_int64("sft.max_seq_tokens", c.sft.max_seq_tokens, "skip mixed-in sequences longer than this; 0 = no limit");

  t.add_choice("checkpoint.dtype", c.checkpoint.dtype, {"bf16", "f32"},
               "dtype of the checkpoint's model files (the F32 master is kept for resume)");
  t.add_choice("checkpoint.format", c.checkpoint.format, {"hf", "fp8-block"},
               "hf, or fp8-block: the FP8 linears as F8_E4M3 + weight_scale_inv (vLLM, transformers)");
  t.add_float("checkpoint.max_shard_gb", c.checkpoint.max_shard_gb,
              "shard the model files above this size (with the index); 0 = never");
  t.add_int("steps", c.steps, "GRPO steps");
  t.add_int("val_every", c.val_every, "validate at step 0 and every N steps; 0 = never");
  t.add_int("val_size", c.val_size, "held-out prompts per validation");
  t.add_int("checkpoint_every", c.checkpoint_every, "checkpoint every N steps; 0 = only at the end");
  t.add_string("out", c.out, "run directory (config, metrics.jsonl, checkpoints)");
  t.add_choice("device", c.device, {"cpu", "cuda"}, "backend");
  t.add_int64("seed", c.seed, "run seed");
  t.add_int("max_consecutive_bad_steps", c.max_consecutive_bad_steps,
            "abort after this many non-finite steps in a row");
  t.add_float("time_budget_s", c.time_budget_s, "wall-clock budget of the run in seconds; 0 = none");
  return std::move(t.fields);
}

Field* find_field(std::vector<Field>& fields, const std::string& key) {
  for (auto& f : fields)
    if (f.key == key) return &f;
  return nullptr;
}

bool is_section(const std::vector<Field>& fields, const std::string& prefix) {
  for (auto& f : fields)
    if (f.key.size() > prefix.size() && f.key.compare(0, prefix.size(), prefix) == 0 && f.key[prefix.size()] == '.')
      return true;
  return false;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
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
      FP8RL_FAIL(origin, ": '", key, "' is a section, not a value: set one of its keys (e.g. '", example, "')");
    }
    fail_unknown(key, origin);
  }
  try {
    f->set(value);
  } catch (const Error& e) {
    std::string msg = e.what();
    const size_t tag = msg.rfind(" [");  // drop the file:line tag of the inner message
    if (tag != std::string::npos) msg.resize(tag);
    FP8RL_FAIL(origin, ": ", key, ": ", msg);
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

void apply_node(std::vector<Field>& fields, const YAML::Node& node, const std::string& prefix,
                const std::string& origin) {
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
      apply_node(fields, v, key, origin);
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
      set_field(fields, key, v.Scalar(), where);
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
  set_field(fields, assignment.substr(0, eq), assignment.substr(eq + 1), "override '" + assignment + "'");
}

void config_apply_yaml(RunConfig& c, const std::string& yaml_text, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    FP8RL_FAIL(origin, ":", e.mark.line + 1, ":", e.mark.column + 1, ": not valid YAML: ", e.msg);
  }
  if (root.IsNull()) return;  // an empty file: the defaults
  if (!root.IsMap()) FP8RL_FAIL(origin, ": the top level must be a mapping of sections (model:, train:, ...)");
  auto fields = config_fields(c);
  try {
    apply_node(fields, root, "", origin);
  } catch (const YAML::Exception& e) {
    FP8RL_FAIL(origin, ":", e.mark.line + 1, ": ", e.msg);
  }
}

RunConfig config_load(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  RunConfig c;
  if (!yaml_path.empty()) config_apply_yaml(c, read_file(yaml_path), yaml_path);
  for (const std::string& o : overrides) config_apply_override(c, o);
  config_validate(c);
  return c;
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
  }
  const auto& t = c.task;
  if (t.name == "arithmetic") {
    need(t.arithmetic.min_operands >= 2 && t.arithmetic.max_operands >= t.arithmetic.min_operands,
         "task.arithmetic.max_operands", "needs 2 <= min_operands <= max_operands");
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
  need(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1");
  need(r.generations_per_prompt >= 2, "rollout.generations_per_prompt",
       "must be >= 2 (a group of one has no baseline, its advantage is always 0)");
  need(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1");
  need(r.temperature > 0, "rollout.temperature", "must be > 0 (use a small value for near-greedy sampling)");
  need(r.top_p > 0 && r.top_p <= 1, "rollout.top_p", "must be in (0, 1]");
  need(r.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)");

  const auto& tr = c.train;
  need(tr.lr >= 0, "train.lr", "must be >= 0");
  need(tr.warmup_steps >= 0, "train.warmup_steps", "must be >= 0");
  need(tr.weight_decay >= 0, "train.weight_decay", "must be >= 0");
  need(tr.adam_beta1 >= 0 && tr.adam_beta1 < 1, "train.adam_beta1", "must be in [0, 1)");
  need(tr.adam_beta2 >= 0 && tr.adam_beta2 < 1, "train.adam_beta2", "must be in [0, 1)");
  need(tr.adam_eps > 0, "train.adam_eps", "must be > 0");
  need(tr.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 = off)");
  need(tr.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1");
  need(tr.optimizer_steps_per_rollout >= 1, "train.optimizer_steps_per_rollout", "must be >= 1");
  need(tr.optimizer_steps_per_rollout <= r.prompts_per_step * r.generations_per_prompt,
       "train.optimizer_steps_per_rollout", "must not exceed the sequences per step (",
       r.prompts_per_step * r.generations_per_prompt, ")");
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
  const PrecisionRecipe recipe = config_precision_recipe(p);
  need(!recipe.generator.fp8_attention || recipe.generator.kv_cache == DType::E4M3, "precision.fp8_attention",
       "needs an E4M3 KV cache (set precision.kv_cache=e4m3 or use an fp8 recipe)");
  need(p.kv_calib_percentile > 0 && p.kv_calib_percentile <= 1, "precision.kv_calib_percentile", "must be in (0, 1]");
  need(p.kv_calib_margin >= 1, "precision.kv_calib_margin", "must be >= 1 (a margin below 1 clips the largest values)");

  need(c.sft.steps >= 0, "sft.steps", "must be >= 0");
  need(c.sft.batch_size >= 1, "sft.batch_size", "must be >= 1");
  need(c.sft.lr >= 0, "sft.lr", "must be >= 0");
  need(c.sft.mix_gsm8k_fraction >= 0 && c.sft.mix_gsm8k_fraction <= 1, "sft.mix_gsm8k_fraction", "must be in [0, 1]");
  need(c.sft.mix_gsm8k_fraction == 0 || !c.sft.mix_gsm8k_path.empty(), "sft.mix_gsm8k_path",
       "is required when sft.mix_gsm8k_fraction > 0 (the GSM8K directory)");
  need(c.sft.max_seq_tokens >= 0, "sft.max_seq_tokens", "must be >= 0 (0 = no limit)");
  need(c.time_budget_s >= 0, "time_budget_s", "must be >= 0 (0 = none)");

  need(c.steps >= 0, "steps", "must be >= 0");
  need(c.val_every >= 0, "val_every", "must be >= 0 (0 = never)");
  need(c.val_size >= 0, "val_size", "must be >= 0");
  need(c.val_every == 0 || c.val_size >= 1, "val_size", "must be >= 1 when val_every > 0");
  need(c.checkpoint_every >= 0, "checkpoint_every", "must be >= 0");
  need(c.checkpoint.max_shard_gb >= 0, "checkpoint.max_shard_gb", "must be >= 0");
  need(!c.out.empty(), "out", "must name a run directory");
  need(c.max_consecutive_bad_steps >= 0, "max_consecutive_bad_steps", "must be >= 0");
}

// ---- mapping onto the engines ----------------------------------------------------------------
PrecisionRecipe config_precision_recipe(const PrecisionSection& p) {
  PrecisionRecipe r = PrecisionRecipe::preset(p.recipe);
  if (p.generator_linear != "auto") r.generator.linear = linear_mode_from_name(p.generator_linear);
  if (p.trainer_linear != "auto") r.trainer.linear = linear_mode_from_name(p.trainer_linear);
  for (EnginePrecision* e : {&r.generator, &r.trainer}) {
    e->pow2_scales = p.pow2_scales;
    e->bf16_first_layers = p.bf16_first_layers;
    e->bf16_last_layers = p.bf16_last_layers;
  }
  if (p.kv_cache != "auto") r.generator.kv_cache = dtype_from_name(p.kv_cache);
  r.generator.fp8_attention = p.fp8_attention;
  const bool custom = p.generator_linear != "auto" || p.trainer_linear != "auto" || p.kv_cache != "auto" ||
                      p.fp8_attention || p.pow2_scales || p.bf16_first_layers || p.bf16_last_layers;
  if (custom) r.name += "+custom";
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
