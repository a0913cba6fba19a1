#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>

#include "core/error.h"
#include "core/fs.h"
#include "core/precision.h"
#include "rl/config.h"
#include "rl/run_dir.h"
#include "rl/session.h"

using namespace fp8rl;

namespace {

const std::string kConfigs = std::string(FP8RL_SOURCE_DIR) + "/configs/";

// The message of the Error that `f` throws ("" when it does not throw).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string make_temp_dir(const char* tag) {
  std::random_device rd;
  auto p = std::filesystem::temp_directory_path() /
           ("fp8rl_" + std::string(tag) + "_" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(p);
  return p.string();
}

}  // namespace

TEST(Config, DefaultsAreTheCpuDemoFile) {
  const RunConfig defaults;
  config_validate(defaults);
  const RunConfig demo = config_load(kConfigs + "demo_cpu.yaml");
  EXPECT_TRUE(demo == defaults) << config_to_yaml(demo);
  EXPECT_EQ(demo.device, "cpu");
}

// The parity experiment's two stages: the same task (so GRPO validates on the SFT task's
// held-out problems), a Qwen3-shaped ~100-150M model, and the new keys read back.
TEST(Config, ParityConfigsAgree) {
  const RunConfig sft = config_load(kConfigs + "parity/sft.yaml");
  const RunConfig grpo = config_load(kConfigs + "parity/grpo.yaml");
  EXPECT_TRUE(sft.task == grpo.task) << config_to_yaml(sft) << config_to_yaml(grpo);
  EXPECT_EQ(sft.task.arithmetic.style, "story");
  EXPECT_EQ(sft.rollout.max_new_tokens, grpo.rollout.max_new_tokens);
  EXPECT_EQ(sft.val_size, grpo.val_size);
  EXPECT_EQ(sft.precision.recipe, "bf16");
  EXPECT_GT(sft.time_budget_s, 0);
  // ~110M parameters with the Qwen3 vocabulary (151,669 ids), embeddings tied.
  const auto& t = sft.model.tiny;
  const int64_t V = 151669, D = t.hidden_size, q = int64_t(t.num_heads) * t.head_dim,
                kv = int64_t(t.num_kv_heads) * t.head_dim;
  const int64_t n = V * D + t.num_layers * (2 * D * q + 2 * D * kv + 3 * D * t.intermediate_size);
  EXPECT_GT(n, 100000000);
  EXPECT_LT(n, 150000000);
  // Overrides of the new keys, and their validation.
  RunConfig c = grpo;
  config_apply_override(c, "time_budget_s=90");
  config_apply_override(c, "task.arithmetic.style=expression");
  EXPECT_DOUBLE_EQ(c.time_budget_s, 90);
  EXPECT_TRUE(has(error_of([&] { config_apply_override(c, "task.arithmetic.style=poem"); }), "expression, story"));
  c.sft.mix_gsm8k_fraction = 0.5;
  EXPECT_TRUE(has(error_of([&] { config_validate(c); }), "sft.mix_gsm8k_path"));
  c.sft.mix_gsm8k_path = "somewhere";
  EXPECT_NO_THROW(config_validate(c));
  c.time_budget_s = -1;
  EXPECT_TRUE(has(error_of([&] { config_validate(c); }), "time_budget_s"));
}

TEST(Config, GpuExampleLoads) {
  const RunConfig c = config_load(kConfigs + "gsm8k_gpu.yaml");
  EXPECT_EQ(c.task.name, "gsm8k");
  EXPECT_EQ(c.rollout.prompts_per_step, 64);
  EXPECT_EQ(c.rollout.generations_per_prompt, 32);
  EXPECT_EQ(c.train.optimizer_steps_per_rollout, 4);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-7);
  EXPECT_DOUBLE_EQ(c.train.kl_beta, 0.01);
  EXPECT_EQ(c.train.baseline, AdvantageBaseline::LeaveOneOut);
  EXPECT_EQ(c.device, "cuda");
  // The near-exact FP8 arm: it validates, and its recipe is fp8_e2e with the consistent attention.
  EXPECT_NO_THROW(config_validate(c));
  const PrecisionRecipe r = config_precision_recipe(c.precision);
  EXPECT_TRUE(r.consistent() && !r.trainer.consistent_linears && !r.trainer.consistent_logits);
  EXPECT_TRUE(r.generator.pow2_scales && r.trainer.linear == LinearMode::FP8_BLOCK);
  // The documented BF16 and fp8_gen arms' overrides validate too; the recipe alone does not.
  for (const char* arm : {"bf16", "fp8_gen"}) {
    const std::string recipe = std::string("precision.recipe=") + arm;
    const RunConfig b = config_load(kConfigs + "gsm8k_gpu.yaml",
                                    {recipe, "precision.consistent=off", "precision.consistent_logits=true"});
    EXPECT_NO_THROW(config_validate(b)) << arm;
    EXPECT_FALSE(config_precision_recipe(b.precision).consistent()) << arm;
    EXPECT_THROW(config_validate(config_load(kConfigs + "gsm8k_gpu.yaml", {recipe})), Error) << arm;
  }
  // keys the file does not set keep their defaults
  EXPECT_EQ(c.model.tiny.hidden_size, RunConfig{}.model.tiny.hidden_size);
}

TEST(Config, OverridesApplyInOrder) {
  const RunConfig c = config_load("", {"train.lr=1e-6", "train.is.mode=icepop", "rollout.top_k=50",
                                       "tokenizer.chat_template=true", "out=runs/x", "train.lr=2e-6",
                                       "task.arithmetic.operators=+-*", "train.schedule=cosine"});
  EXPECT_DOUBLE_EQ(c.train.lr, 2e-6);
  EXPECT_EQ(c.train.is.mode, IsMode::Icepop);
  EXPECT_EQ(c.rollout.top_k, 50);
  EXPECT_TRUE(c.tokenizer.chat_template);
  EXPECT_EQ(c.out, "runs/x");
  EXPECT_EQ(c.task.arithmetic.operators, "+-*");
  EXPECT_EQ(c.train.schedule, LrScheduleKind::Cosine);
}

// MoE routing replay: train.routing_replay, also spelled rl.routing_replay (the name), as
// an override and in YAML (nested or dotted).
TEST(Config, RoutingReplayKeyAndItsAlias) {
  EXPECT_FALSE(config_load("").train.routing_replay);
  EXPECT_TRUE(config_load("", {"train.routing_replay=true"}).train.routing_replay);
  EXPECT_TRUE(config_load("", {"rl.routing_replay=true"}).train.routing_replay);
  RunConfig c;
  config_apply_yaml(c, "train:\n  routing_replay: true\n", "test.yaml");
  EXPECT_TRUE(c.train.routing_replay);
  RunConfig d;
  config_apply_yaml(d, "rl:\n  routing_replay: true\n", "test.yaml");
  EXPECT_TRUE(d.train.routing_replay);
  EXPECT_THROW(config_load("", {"train.routing_replay=maybe"}), Error);
  EXPECT_TRUE(has(config_to_yaml(c), "routing_replay: true"));
}

// train.dgrad_weight_cache: auto (default) | on | off, as an override and in YAML; a bad value
// names the key and the allowed ones; the trainer's options follow it (auto stays on until the
// memory plan resolves it).
TEST(Config, DgradWeightCacheKey) {
  EXPECT_EQ(RunConfig{}.train.dgrad_weight_cache, "auto");
  EXPECT_EQ(config_load("", {"train.dgrad_weight_cache=off"}).train.dgrad_weight_cache, "off");
  RunConfig c;
  config_apply_yaml(c, "train:\n  dgrad_weight_cache: on\n", "test.yaml");
  EXPECT_EQ(c.train.dgrad_weight_cache, "on");
  EXPECT_TRUE(has(config_to_yaml(c), "dgrad_weight_cache: on"));
  const std::string e = error_of([] { config_load("", {"train.dgrad_weight_cache=yes"}); });
  EXPECT_TRUE(has(e, "train.dgrad_weight_cache") && has(e, "one of auto, on, off") && has(e, "'yes'")) << e;
  EXPECT_TRUE(trainer_options(config_load("")).dgrad_weight_cache);
  EXPECT_TRUE(trainer_options(config_load("", {"train.dgrad_weight_cache=on"})).dgrad_weight_cache);
  EXPECT_FALSE(trainer_options(config_load("", {"train.dgrad_weight_cache=off"})).dgrad_weight_cache);
}

TEST(Config, YamlDumpReadsBackExactly) {
  RunConfig c;
  config_set(c, "train.lr", "3.3e-7");
  config_set(c, "train.adam_eps", "1e-12");
  config_set(c, "precision.recipe", "fp8_gen");
  config_set(c, "precision.kv_cache", "bf16");
  config_set(c, "task.jsonl.prompt_field", "question: text");  // needs quoting in YAML
  config_set(c, "model.path", "");
  config_set(c, "seed", "-5");
  config_set(c, "train.baseline", "group_norm");
  config_set(c, "rollout.temperature", "0.1");
  const std::string yaml = config_to_yaml(c);
  RunConfig back;
  config_apply_yaml(back, yaml, "dump");
  EXPECT_TRUE(back == c) << yaml;
  EXPECT_TRUE(has(yaml, "lr: 3.3e-07")) << yaml;
}

TEST(Config, UnknownKeysSuggestTheNearest) {
  std::string e = error_of([] { config_load("", {"train.lrr=1e-6"}); });
  EXPECT_TRUE(has(e, "unknown key 'train.lrr'") && has(e, "'train.lr'")) << e;
  e = error_of([] { config_load("", {"tis_cap=3"}); });
  EXPECT_TRUE(has(e, "'train.is.tis_cap'")) << e;
  e = error_of([] {
    RunConfig c;
    config_apply_yaml(c, "rollout:\n  prompts_per_step: 4\n  temprature: 0.7\n", "my.yaml");
  });
  EXPECT_TRUE(has(e, "my.yaml:3") && has(e, "rollout.temprature") && has(e, "'rollout.temperature'")) << e;
  e = error_of([] {
    RunConfig c;
    config_apply_yaml(c, "trian:\n  lr: 1\n", "f.yaml");
  });
  EXPECT_TRUE(has(e, "unknown key 'trian'") && has(e, "did you mean 'train'")) << e;
  EXPECT_EQ(config_nearest_key("lr"), "train.lr");
  EXPECT_EQ(config_nearest_key("precision.kv_cach"), "precision.kv_cache");
}

TEST(Config, TypeErrorsNameKeyAndType) {
  std::string e = error_of([] { config_load("", {"train.lr=fast"}); });
  EXPECT_TRUE(has(e, "train.lr") && has(e, "expected a number")) << e;
  e = error_of([] { config_load("", {"rollout.top_k=1.5"}); });
  EXPECT_TRUE(has(e, "rollout.top_k") && has(e, "expected an integer")) << e;
  e = error_of([] { config_load("", {"tokenizer.chat_template=maybe"}); });
  EXPECT_TRUE(has(e, "tokenizer.chat_template") && has(e, "boolean")) << e;
  e = error_of([] { config_load("", {"train.is.mode=tiss"}); });
  EXPECT_TRUE(has(e, "train.is.mode") && has(e, "one of none, is, tis, icepop, seq_mask")) << e;
  e = error_of([] { config_load("", {"train.lr=nan"}); });
  EXPECT_TRUE(has(e, "finite")) << e;
  e = error_of([] { config_load("", {"train=5"}); });
  EXPECT_TRUE(has(e, "is a section")) << e;
  e = error_of([] { config_load("", {"train.lr"}); });
  EXPECT_TRUE(has(e, "key.sub=value")) << e;
  e = error_of([] {
    RunConfig c;
    config_apply_yaml(c, "train:\n  lr:\n    a: 1\n", "f.yaml");
  });
  EXPECT_TRUE(has(e, "train.lr") && has(e, "got a mapping")) << e;
  e = error_of([] {
    RunConfig c;
    config_apply_yaml(c, "steps: [1, 2]\n", "f.yaml");
  });
  EXPECT_TRUE(has(e, "steps") && has(e, "got a list")) << e;
  e = error_of([] {
    RunConfig c;
    config_apply_yaml(c, "train: {lr: 1\n", "bad.yaml");
  });
  EXPECT_TRUE(has(e, "bad.yaml") && has(e, "not valid YAML")) << e;
  e = error_of([] { config_load("/nonexistent/run.yaml"); });
  EXPECT_TRUE(has(e, "/nonexistent/run.yaml")) << e;
}

TEST(Config, ValidationCatchesInconsistentSettings) {
  EXPECT_TRUE(has(error_of([] { config_load("", {"rollout.generations_per_prompt=1"}); }),
                  "rollout.generations_per_prompt"));
  EXPECT_TRUE(has(error_of([] { config_load("", {"precision.recipe=bf16", "precision.fp8_attention=true"}); }),
                  "precision.fp8_attention"));
  EXPECT_TRUE(has(error_of([] { config_load("", {"task.name=gsm8k"}); }), "task.gsm8k.path"));
  EXPECT_TRUE(has(error_of([] { config_load("", {"train.is.icepop_low=6"}); }), "train.is.icepop_low"));
  EXPECT_TRUE(has(error_of([] { config_load("", {"model.tiny.num_kv_heads=3"}); }), "num_kv_heads"));
  EXPECT_TRUE(has(error_of([] { config_load("", {"train.schedule=cosine", "steps=1", "train.warmup_steps=8"}); }),
                  "warmup_steps"));
  // ... and accepts a consistent non-default one
  config_load("", {"precision.recipe=bf16", "precision.kv_cache=e4m3", "precision.fp8_attention=true"});
}

TEST(Config, PrecisionSectionMapsOntoTheRecipe) {
  RunConfig c;
  config_set(c, "precision.recipe", "fp8_e2e");
  config_set(c, "precision.pow2_scales", "true");
  config_set(c, "precision.bf16_first_layers", "1");
  config_set(c, "precision.bf16_last_layers", "2");
  PrecisionRecipe r = config_precision_recipe(c.precision);
  for (const EnginePrecision* e : {&r.generator, &r.trainer}) {
    EXPECT_EQ(e->linear, LinearMode::FP8_BLOCK);
    EXPECT_TRUE(e->pow2_scales);
    EXPECT_EQ(e->linear_for_layer(0, 6), LinearMode::BF16);
    EXPECT_EQ(e->linear_for_layer(3, 6), LinearMode::FP8_BLOCK);
    EXPECT_EQ(e->linear_for_layer(4, 6), LinearMode::BF16);
  }
  EXPECT_EQ(r.generator.kv_cache, DType::E4M3);  // the preset's
  // bf16 preset, with the generator's linears and KV cache overridden to FP8
  RunConfig d;
  config_set(d, "precision.recipe", "bf16");
  config_set(d, "precision.generator_linear", "fp8");
  config_set(d, "precision.kv_cache", "e4m3");
  config_set(d, "precision.fp8_attention", "true");
  r = config_precision_recipe(d.precision);
  EXPECT_EQ(r.generator.linear, LinearMode::FP8_BLOCK);
  EXPECT_EQ(r.trainer.linear, LinearMode::BF16);
  EXPECT_EQ(r.generator.kv_cache, DType::E4M3);
  EXPECT_TRUE(r.generator.fp8_attention);
  EXPECT_FALSE(r.trainer.fp8_attention);
  EXPECT_EQ(r.name, "bf16+custom");
  // GRPO options and LR schedule
  config_set(c, "train.is.mode", "seq_mask");
  config_set(c, "train.is.seq_mask_high", "1.01");
  config_set(c, "train.loss_aggregation", "sequence");
  const GrpoLossOptions o = config_grpo_options(c.train);
  EXPECT_EQ(o.is_mode, IsMode::SeqMask);
  EXPECT_DOUBLE_EQ(o.seq_mask_high, 1.01);
  EXPECT_EQ(o.aggregation, LossAggregation::Sequence);
  const LrSchedule s = config_lr_schedule(c.train, 80);
  EXPECT_EQ(s.total_steps, 80);
  EXPECT_DOUBLE_EQ(s.base_lr, c.train.lr);
}

TEST(Config, EveryKeyRoundTripsThroughSet) {
  // Each key accepts the text form of its own value (the dump's form).
  const auto keys = config_keys();
  EXPECT_GT(keys.size(), 60u);
  RunConfig c;
  const std::string yaml = config_to_yaml(c);
  for (const auto& k : keys) EXPECT_TRUE(has(yaml, k.substr(k.rfind('.') + 1) + ":")) << k;
}

TEST(RunDir, CreateSaveAndRefuseReuse) {
  const std::string root = make_temp_dir("rundir");
  const std::string path = root + "/run1";
  RunDir d = run_dir_create(path);
  EXPECT_TRUE(std::filesystem::is_directory(d.checkpoints_dir()));
  EXPECT_EQ(d.checkpoint_path(12), path + "/checkpoints/step_000012");
  RunConfig c;
  config_set(c, "train.lr", "1.5e-5");
  run_dir_save_config(d, c);
  EXPECT_TRUE(config_load(d.config_path()) == c);
  // a directory holding a run is refused unless resuming
  write_file_atomic(d.metrics_path(), "{\"step\":0}\n");
  EXPECT_TRUE(has(error_of([&] { run_dir_create(path); }), "already holds a run"));
  EXPECT_NO_THROW(run_dir_create(path, /*resume=*/true));
  std::filesystem::remove_all(root);
}

TEST(Fs, AtomicWriteReplacesAndLeavesNoTemporary) {
  const std::string root = make_temp_dir("fs");
  const std::string f = root + "/a.txt";
  write_file_atomic(f, "first version, longer");
  write_file_atomic(f, std::string("second\0bytes", 12));
  EXPECT_EQ(read_file(f), std::string("second\0bytes", 12));
  int entries = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator(root)) ++entries;
  EXPECT_EQ(entries, 1);  // no .tmp left behind
  EXPECT_THROW(write_file_atomic(root + "/no/such/dir/x", "x"), Error);
  EXPECT_THROW(read_file(root + "/missing"), Error);
  std::filesystem::remove_all(root);
}

TEST(Config, RecipeSpecOverridesOnePart) {
  const PrecisionRecipe base = PrecisionRecipe::parse("fp8_e2e");
  EXPECT_EQ(base.generator.kv_cache, DType::E4M3);
  EXPECT_EQ(base.trainer.linear, LinearMode::FP8_BLOCK);
  const PrecisionRecipe r = PrecisionRecipe::parse("fp8_e2e:kv=bf16+train=bf16+pow2=on+last=2");
  EXPECT_EQ(r.name, "fp8_e2e:kv=bf16+train=bf16+pow2=on+last=2");
  EXPECT_EQ(r.generator.kv_cache, DType::BF16);
  EXPECT_EQ(r.generator.linear, LinearMode::FP8_BLOCK);
  EXPECT_EQ(r.trainer.linear, LinearMode::BF16);
  EXPECT_TRUE(r.generator.pow2_scales && r.trainer.pow2_scales);
  EXPECT_EQ(r.generator.bf16_last_layers, 2);
  EXPECT_EQ(r.trainer.bf16_last_layers, 2);
  EXPECT_TRUE(PrecisionRecipe::parse("fp8_e2e:attn=fp8").generator.fp8_attention);
  EXPECT_THROW(PrecisionRecipe::parse("fp8_e2e:kv=bf16+attn=fp8"), Error);  // FP8 attention needs E4M3 KV
  EXPECT_THROW(PrecisionRecipe::parse("fp8_e2e:kv"), Error);
  EXPECT_THROW(PrecisionRecipe::parse("fp8_e2e:colour=red"), Error);
  EXPECT_THROW(PrecisionRecipe::parse("fp9:kv=bf16"), Error);
}
