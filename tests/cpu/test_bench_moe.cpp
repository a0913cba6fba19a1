// The benchmarks at mixture-of-experts shapes (issue 16): the registry's MoE shapes and their
// --layers cuts, random weights of experts, routers and MLA built on a backend, and CPU runs of
// `fp8rl bench rl-step`, `bench generate` and `bench-train-step` at tiny-moe / tiny-mla through
// the binary: every phase timed, no FP8 GEMM fallback where FP8 runs.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "bench/rollout_bench.h"
#include "core/error.h"
#include "core/fs.h"
#include "model/shapes.h"
#include "model/transformer.h"
#include "rl/memory_plan.h"
#include "rollout/rollout.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

TEST(BenchMoeShapes, Qwen3MoeAndMoonlightHaveTheirPublishedSizes) {
  const ModelConfig q = model_shape("qwen3-30b-a3b");
  EXPECT_EQ(q.model_type, "qwen3_moe");
  EXPECT_EQ(q.num_layers, 48);
  EXPECT_EQ(q.num_experts, 128);
  EXPECT_EQ(q.num_experts_per_tok, 8);
  for (int l = 0; l < q.num_layers; ++l) EXPECT_TRUE(q.layer_is_moe(l)) << l;
  // Qwen3-30B-A3B: "30.5B total, 3.3B activated" (model card). Total: embed + lm_head 2 x
  // 151936 x 2048, per layer attention 2048 x (4096 + 2 x 512) + 4096 x 2048 + q/k norms + two
  // RMSNorms, router 128 x 2048, experts 128 x 3 x 2048 x 768.
  const int64_t per_layer =
      2048LL * (4096 + 1024) + 4096LL * 2048 + 2 * 128 + 2 * 2048 + 128LL * 2048 + 128LL * 3 * 2048 * 768;
  EXPECT_EQ(q.num_parameters(), 2 * 151936LL * 2048 + 48 * per_layer + 2048);
  EXPECT_NEAR(double(q.num_parameters()) / 1e9, 30.5, 0.1);

  const ModelConfig m = model_shape("moonlight-16b-a3b");
  EXPECT_EQ(m.model_type, "deepseek_v3");
  EXPECT_TRUE(m.is_mla());
  EXPECT_EQ(m.num_layers, 27);
  EXPECT_FALSE(m.layer_is_moe(0));  // first_k_dense_replace 1
  for (int l = 1; l < m.num_layers; ++l) EXPECT_TRUE(m.layer_is_moe(l)) << l;
  EXPECT_EQ(m.qk_head_dim(), 192);
  // Moonlight-16B-A3B: "16B total" (model card); 15.96e9 by its config's sizes.
  EXPECT_NEAR(double(m.num_parameters()) / 1e9, 16.0, 0.1);
  // The latent cache: 512 + 64 values per token and layer, one pool.
  EXPECT_EQ(bench_kv_bytes_per_token(m, DType::E4M3), 27 * 576);
  EXPECT_EQ(bench_kv_bytes_per_token(m, DType::E4M3), memory_plan_kv_page_bytes(m, DType::E4M3, 1));
  EXPECT_EQ(bench_kv_bytes_per_token(q, DType::BF16), memory_plan_kv_page_bytes(q, DType::BF16, 1));
}

TEST(BenchMoeShapes, LayerCutsKeepTheLayerRules) {
  const ModelConfig m = model_shape_cut(model_shape("moonlight-16b-a3b"), 3);
  EXPECT_EQ(m.num_layers, 3);
  EXPECT_FALSE(m.layer_is_moe(0));
  EXPECT_TRUE(m.layer_is_moe(1));
  const ModelConfig t = model_shape("tiny-moe");
  ASSERT_EQ(t.mlp_only_layers, std::vector<int>{0});
  const ModelConfig one = model_shape_cut(t, 1);  // only the dense layer left
  EXPECT_EQ(one.num_layers, 1);
  EXPECT_FALSE(one.layer_is_moe(0));
  EXPECT_THROW(model_shape_cut(t, 0), Error);
  EXPECT_THROW(model_shape_cut(t, 4), Error);
}

// bench_random_weights builds every tensor of an MoE / MLA layer (what model_weights_random
// builds on the host), so the byte count is the parameter count, and the generator copy is what
// the memory plan says.
TEST(BenchMoeShapes, RandomWeightsHoldEveryExpertRouterAndMlaTensor) {
  auto be = make_cpu_backend();
  for (const char* name : {"tiny-moe", "tiny-mla"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = model_shape(name);
    const ModelWeights w = bench_random_weights(*be, c, DType::F32, 5);
    EXPECT_EQ(bench_weights_bytes(w), c.num_parameters() * 4);
    for (int l = 0; l < c.num_layers; ++l) {
      EXPECT_EQ(w.layers[l].is_moe(), c.layer_is_moe(l)) << l;
      if (!c.layer_is_moe(l)) continue;
      EXPECT_EQ(static_cast<int>(w.layers[l].experts.size()), c.num_experts);
      EXPECT_EQ(w.layers[l].router_bias.defined(), c.moe_router == "sigmoid");
      EXPECT_EQ(w.layers[l].gate.w.defined(), c.n_shared_experts > 0);
    }
    EnginePrecision fp8;
    fp8.linear = LinearMode::FP8_BLOCK;
    for (const EnginePrecision& p : {EnginePrecision{}, fp8}) {
      const ModelWeights gen = generator_weights_alloc(*be, w, p);
      EXPECT_EQ(memory_plan_generator_bytes(c, p, be->act_dtype()), bench_weights_bytes(gen));
    }
  }
}

// The plan's saved activations per token of a sparse block are what the forward saves: every
// distinct tensor of LayerActivations (MLA's included), summed, at T tokens (F32, CPU).
TEST(BenchMoeShapes, PlanCountsTheSavedActivationsOfMoeAndMlaBlocks) {
  auto be = make_cpu_backend();
  for (const char* name : {"tiny-moe", "tiny-mla"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = model_shape(name);
    const ModelWeights w = bench_random_weights(*be, c, DType::F32, 9);
    const ForwardBatch batch = forward_batch_from_sequences({{1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12}});
    Activations acts;
    EnginePrecision prec;
    prec.linear = LinearMode::FP32;
    model_forward_logprobs(*be, w, prec, batch, ForwardOptions{}, &acts);
    const int64_t T = batch.num_tokens();
    for (int l = 0; l < c.num_layers; ++l) {
      if (!c.layer_is_moe(l)) continue;
      const LayerActivations& a = acts.layers[l];
      std::set<const void*> seen;
      int64_t bytes = 0;
      for (const Tensor* t : {&a.x,
                              &a.attn_rstd,
                              &a.xn_attn,
                              &a.q_raw,
                              &a.k_raw,
                              &a.q_rstd,
                              &a.k_rstd,
                              &a.q,
                              &a.k,
                              &a.v,
                              &a.q_a,
                              &a.q_a_rstd,
                              &a.q_an,
                              &a.kv_a,
                              &a.kv_lat,
                              &a.kv_rstd,
                              &a.kv_latn,
                              &a.kv_b,
                              &a.rope_q,
                              &a.rope_k,
                              &a.attn,
                              &a.lse,
                              &a.x_mid,
                              &a.mlp_rstd,
                              &a.xn_mlp,
                              &a.gate,
                              &a.up,
                              &a.act,
                              &a.router_x,
                              &a.router_logits,
                              &a.moe_experts,
                              &a.moe_weights,
                              &a.moe_row_slot,
                              &a.moe_slot_row,
                              &a.moe_x,
                              &a.moe_gate,
                              &a.moe_up,
                              &a.moe_act,
                              &a.moe_y,
                              &a.shared_gate,
                              &a.shared_up,
                              &a.shared_act,
                              &a.shared_out,
                              &a.proj})
        if (t->defined() && seen.insert(t->raw()).second) bytes += static_cast<int64_t>(t->nbytes());
      EXPECT_EQ(bytes, T * memory_plan_block_bytes_per_token(c, DType::F32)) << "layer " << l;
    }
  }
}

int run_fp8rl(const std::vector<std::string>& args, const std::string& log, std::string& output) {
  std::string cmd = std::string("'") + FP8RL_BINARY + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " > '" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  output = fs::exists(log) ? read_file(log) : "";
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("fp8rl_bench_moe_" + tag + "_" + std::to_string(getpid()))) {
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// Whole GRPO steps of a random MoE model, every recipe, ragged batches (and so ragged expert
// row counts), with the KL reference; no FP8 fallback.
TEST(BenchMoeCli, RlStepRunsEveryPhaseAtMoeShapes) {
  for (const char* shape : {"tiny-moe", "tiny-mla"}) {
    SCOPED_TRACE(shape);
    const TempDir dir(std::string("rl_") + shape);
    std::string out;
    ASSERT_EQ(run_fp8rl({"bench",
                         "rl-step",
                         "--device",
                         "cpu",
                         "--model",
                         shape,
                         "--prompts",
                         "2",
                         "--samples",
                         "3",
                         "--prompt-len",
                         "8",
                         "--max-new-tokens",
                         "10",
                         "--steps",
                         "1",
                         "--warmup",
                         "1",
                         "--kl-beta",
                         "0.01",
                         "--json",
                         dir.file("rl.json")},
                        dir.file("log.txt"), out),
              0)
        << out;
    const nlohmann::json j = nlohmann::json::parse(read_file(dir.file("rl.json")));
    EXPECT_EQ(j["model"], shape);
    ASSERT_EQ(j["recipes"].size(), 3u);
    for (const char* r : {"bf16", "fp8_gen", "fp8_e2e"}) {
      SCOPED_TRACE(r);
      const nlohmann::json& x = j["recipes"][r];
      for (const char* p : {"generation", "scoring", "reference", "training", "refit_calibration", "step"})
        EXPECT_GE(x["seconds"][p]["median"].get<double>(), 0.0) << p;
      EXPECT_GT(x["seconds"]["step"]["median"].get<double>(), 0.0);
      EXPECT_GT(x["generated_tokens"][0].get<double>(), 0.0);
      EXPECT_EQ(x["fp8_gemm_fallbacks"], 0);
      EXPECT_GT(x["plan_peak_bytes"].get<int64_t>(), 0);
      ASSERT_EQ(x["routing_agreement"].size(), 1u) << "MoE shapes report the routing agreement";
      EXPECT_GT(x["routing_agreement"][0].get<double>(), 0.5);
      EXPECT_LE(x["routing_agreement"][0].get<double>(), 1.0);
      EXPECT_EQ(x["router_topk_agreement"], x["routing_agreement"]) << "no replay";
    }
  }
}

// --routing-replay: the trainer replays the generator's routing (agreement exactly 1), while its
// router's own top-k is still measured.
TEST(BenchMoeCli, RlStepRoutingReplay) {
  const TempDir dir("rl_replay");
  std::string out;
  ASSERT_EQ(run_fp8rl({"bench",        "rl-step", "--device",         "cpu",    "--model",          "tiny-moe",
                       "--recipes",    "fp8_gen", "--prompts",        "2",      "--samples",        "3",
                       "--prompt-len", "8",       "--max-new-tokens", "10",     "--steps",          "1",
                       "--warmup",     "0",       "--routing-replay", "--json", dir.file("rl.json")},
                      dir.file("log.txt"), out),
            0)
      << out;
  const nlohmann::json j = nlohmann::json::parse(read_file(dir.file("rl.json")));
  EXPECT_EQ(j["routing_replay"], true);
  const nlohmann::json& x = j["recipes"]["fp8_gen"];
  EXPECT_EQ(x["routing_agreement"][0].get<double>(), 1.0);
  EXPECT_LE(x["router_topk_agreement"][0].get<double>(), 1.0);
  EXPECT_TRUE(x["token_mult_prob_error_routing_differs"][0].is_null()) << "no token routed differently";
}

// --layers cuts the shape; --plan-only prints each recipe's plan and check and runs nothing
// (no device is opened: a CUDA plan from any build).
TEST(BenchMoeCli, RlStepPlanOnlyChecksEachRecipeWithoutRunning) {
  const TempDir dir("plan");
  std::string out;
  ASSERT_EQ(run_fp8rl({"bench", "rl-step", "--device", "cuda", "--model", "qwen3-30b-a3b", "--layers", "2", "--recipes",
                       "bf16,fp8_e2e", "--free-gib", "139", "--plan-only"},
                      dir.file("log.txt"), out),
            0)
      << out;
  EXPECT_NE(out.find("qwen3_moe"), std::string::npos) << out;
  EXPECT_NE(out.find("2 layers"), std::string::npos) << out;
  EXPECT_NE(out.find("bf16: fits"), std::string::npos) << out;
  EXPECT_NE(out.find("fp8_e2e: fits"), std::string::npos) << out;
  EXPECT_EQ(out.find("phase (median s)"), std::string::npos) << out;
  // The whole 48-layer model does not fit one H200 in bf16: refused, with its shortfall.
  EXPECT_NE(run_fp8rl({"bench", "rl-step", "--device", "cuda", "--model", "qwen3-30b-a3b", "--recipes", "bf16",
                       "--free-gib", "139", "--plan-only"},
                      dir.file("log.txt"), out),
            0)
      << out;
  EXPECT_NE(out.find("bf16: would be refused"), std::string::npos) << out;
  EXPECT_NE(
      run_fp8rl({"bench", "rl-step", "--model", "tiny-moe", "--layers", "9", "--plan-only"}, dir.file("log.txt"), out),
      0);
  EXPECT_NE(out.find("exceeds the shape's 3 layers"), std::string::npos) << out;
}

TEST(BenchMoeCli, GenerateRunsEveryRecipeAtMoeShapes) {
  for (const char* shape : {"tiny-moe", "tiny-mla"}) {
    SCOPED_TRACE(shape);
    const TempDir dir(std::string("gen_") + shape);
    std::string out;
    ASSERT_EQ(run_fp8rl({"bench", "generate", "--device", "cpu", "--model", shape, "--layers", "2", "--prompts", "4",
                         "--prompt-len", "8", "--gen-len", "4", "--json", dir.file("gen.json")},
                        dir.file("log.txt"), out),
              0)
        << out;
    const nlohmann::json j = nlohmann::json::parse(read_file(dir.file("gen.json")));
    EXPECT_EQ(j["model"]["layers"], 2);
    EXPECT_TRUE(j["model"].contains("moe"));
    ASSERT_EQ(j["recipes"].size(), 4u);
    for (const nlohmann::json& r : j["recipes"]) {
      SCOPED_TRACE(r["recipe"].get<std::string>());
      ASSERT_FALSE(r.contains("error")) << r["error"];
      EXPECT_EQ(r["output_tokens"].get<double>(), 16.0);
      EXPECT_GT(r["prefill_s"].get<double>(), 0.0);
      EXPECT_EQ(r["memory"]["generator_weights_bytes"], r["memory"]["generator_weights_bytes_expected"]);
      EXPECT_EQ(r["memory"]["kv_pool_pages"], r["memory"]["kv_pages_needed"]);
    }
  }
}

TEST(BenchMoeCli, TrainStepTakesARegistryShape) {
  for (const char* prec : {"bf16", "fp8"}) {
    for (const char* shape : {"tiny-moe", "tiny-mla"}) {
      SCOPED_TRACE(std::string(prec) + " " + shape);
      const TempDir dir(std::string("train_") + prec + "_" + shape);
      std::string out;
      ASSERT_EQ(run_fp8rl({"bench-train-step", "--device", "cpu", "--precision", prec, "--model", shape, "--seqs", "4",
                           "--seq-len", "24", "--prompt-len", "16", "--repeats", "1", "--json", dir.file("t.json")},
                          dir.file("log.txt"), out),
                0)
          << out;
      const nlohmann::json j = nlohmann::json::parse(read_file(dir.file("t.json")));
      EXPECT_EQ(j["model"]["name"], shape);
      EXPECT_EQ(j["model"]["layers"], 3);
      EXPECT_TRUE(j["model"].contains("moe"));
      for (const char* p : {"score", "train_step", "generate"})
        EXPECT_GT(j["phases"][p]["median_ms"].get<double>(), 0.0) << p;
      EXPECT_EQ(j["fp8_gemm_fallbacks"], 0);
      EXPECT_GT(j["plan_peak_bytes"].get<int64_t>(), 0);
    }
  }
  const TempDir dir("train_flags");
  std::string out;
  EXPECT_NE(run_fp8rl({"bench-train-step", "--model", "tiny-moe", "--hidden", "256"}, dir.file("log.txt"), out), 0);
  EXPECT_NE(out.find("--hidden"), std::string::npos) << out;
  EXPECT_NE(run_fp8rl({"bench-train-step", "--model", "nope"}, dir.file("log.txt"), out), 0);
  EXPECT_NE(out.find("qwen3-30b-a3b"), std::string::npos) << out;  // the known shapes are named
}

}  // namespace
}  // namespace fp8rl
