// `fp8rl bench generate` (issue #6): the benchmark shapes, the random weights, the byte
// accounting of the roofline, and a CPU smoke run of the command.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "model/shapes.h"
#include "rl/memory_plan.h"
#include "rollout/rollout.h"
#include "bench/rollout_bench.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

TEST(BenchGenerate, ModelShapesHaveThePublishedParameterCounts) {
  // Llama-3.1-8B: 8,030,261,248 parameters; Llama-3.2-1B: 1,235,814,400 (tied embeddings).
  const ModelConfig big = model_shape("8b"), small = model_shape("1b");
  EXPECT_EQ(big.num_parameters(), 8030261248LL);
  EXPECT_EQ(small.num_parameters(), 1235814400LL);
  EXPECT_FALSE(big.tie_word_embeddings);
  EXPECT_TRUE(small.tie_word_embeddings);
  // KV per token: 32 layers x (K + V) x 8 heads x 128 x 2 bytes = 128 KiB in BF16, half in E4M3.
  EXPECT_EQ(bench_kv_bytes_per_token(big, DType::BF16), 2 * 32 * 8 * 128 * 2);
  EXPECT_EQ(bench_kv_bytes_per_token(big, DType::E4M3), 2 * 32 * 8 * 128);
  EXPECT_THROW(model_shape("70b"), Error);
}

TEST(BenchGenerate, GeneratorBytesMatchWhatTheEngineAllocates) {
  const ModelConfig c = model_shape("tiny");
  auto be = make_cpu_backend();
  const ModelWeights master = bench_random_weights(*be, c, DType::F32, 3);
  EXPECT_EQ(bench_weights_bytes(master), c.num_parameters() * 4);
  EnginePrecision fp8;
  fp8.linear = LinearMode::FP8_BLOCK;
  fp8.bf16_last_layers = 1;  // one block FP8, one high precision
  for (const EnginePrecision& p : {EnginePrecision{}, fp8}) {
    const ModelWeights gen = generator_weights_alloc(*be, master, p);
    EXPECT_EQ(memory_plan_generator_bytes(c, p, be->act_dtype()), bench_weights_bytes(gen));
  }
  // FP8 storage is smaller than F32 storage, but more than a quarter (scales, norms, embeddings).
  const int64_t full = memory_plan_generator_bytes(c, EnginePrecision{}, DType::F32);
  fp8.bf16_last_layers = 0;
  const int64_t q = memory_plan_generator_bytes(c, fp8, DType::F32);
  EXPECT_LT(q, full);
  EXPECT_GT(4 * q, full);
}

TEST(BenchGenerate, RandomWeightsAreSeededAndHaveTheAskedSpread) {
  const ModelConfig c = model_shape("tiny");
  auto be = make_cpu_backend();
  const ModelWeights a = bench_random_weights(*be, c, DType::F32, 7, 0.05f);
  const ModelWeights b = bench_random_weights(*be, c, DType::F32, 7, 0.05f);
  const ModelWeights other = bench_random_weights(*be, c, DType::F32, 8, 0.05f);
  const std::vector<float> va = to_float_vector(a.layers[1].gate.w), vb = to_float_vector(b.layers[1].gate.w);
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, to_float_vector(other.layers[1].gate.w));
  EXPECT_NE(va, to_float_vector(a.layers[1].up.w));  // every tensor draws its own stream
  double sum = 0, sq = 0;
  for (float v : va) {
    EXPECT_LT(std::fabs(v), 0.05f * std::sqrt(3.0f));
    sum += v;
    sq += double(v) * v;
  }
  const double n = static_cast<double>(va.size());
  EXPECT_NEAR(sum / n, 0.0, 0.05 * 4 / std::sqrt(n));  // 4 standard errors
  EXPECT_NEAR(std::sqrt(sq / n), 0.05, 0.05 * 0.05);
  EXPECT_EQ(to_float_vector(a.final_norm), std::vector<float>(c.hidden_size, 1.0f));
  EXPECT_EQ(a.lm_head.storage() == a.embed.storage(), c.tie_word_embeddings);
  // BF16 weights are the F32 ones rounded.
  const ModelWeights h = bench_random_weights(*be, c, DType::BF16, 7, 0.05f);
  const std::vector<float> vh = to_float_vector(h.layers[1].gate.w);
  for (size_t i = 0; i < va.size(); i += 97) EXPECT_EQ(vh[i], bf16_round(va[i]));
}

TEST(BenchGenerate, DecodeRooflineSumsWeightsAndTheGrowingCache) {
  // One wave of n sequences: steps s = 1..G-1 each read W + n * (row + (P + s) * kv).
  const double W = 1000, row = 3, kv = 10;
  const int n = 5, P = 7, G = 6;
  const DecodeRoofline r = bench_decode_roofline(W, row, kv, n, P, G, n);
  EXPECT_EQ(r.steps, G - 1);
  EXPECT_DOUBLE_EQ(r.weight_bytes, (G - 1) * (W + n * row));
  // sum_{s=1}^{G-1} (P + s) = (G-1) P + G (G-1) / 2
  EXPECT_DOUBLE_EQ(r.kv_bytes, n * kv * ((G - 1) * P + G * (G - 1) / 2.0));
  EXPECT_DOUBLE_EQ(r.seconds(2.0), (r.weight_bytes + r.kv_bytes) / 2.0);
  // Two at a time: waves of 2, 2, 1 re-read the weights per wave; the cache bytes are the same.
  const DecodeRoofline waves = bench_decode_roofline(W, row, kv, n, P, G, 2);
  EXPECT_EQ(waves.steps, 3 * (G - 1));
  EXPECT_DOUBLE_EQ(waves.kv_bytes, r.kv_bytes);
  EXPECT_DOUBLE_EQ(waves.weight_bytes, 3 * (G - 1) * W + (G - 1) * n * row);
  EXPECT_THROW(bench_decode_roofline(W, row, kv, n, P, G, 0), Error);
}

int run_fp8rl(const std::vector<std::string>& args, const std::string& log, std::string& output) {
  std::string cmd = std::string("'") + FP8RL_BINARY + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " > '" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  output = fs::exists(log) ? read_file(log) : "";
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(BenchGenerateCli, TinyCpuRunWritesEveryFigure) {
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_bench_generate_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string json_path = (dir / "bench.json").string(), log = (dir / "log.txt").string();
  std::string out;
  ASSERT_EQ(run_fp8rl({"bench", "generate", "--device", "cpu", "--model", "tiny", "--prompts", "4", "--prompt-len",
                       "8", "--gen-len", "4", "--json", json_path},
                      log, out),
            0)
      << out;
  const nlohmann::json j = nlohmann::json::parse(read_file(json_path));
  EXPECT_EQ(j["workload"]["prompts"], 4);
  EXPECT_GT(j["copy_bw_Bps"].get<double>(), 0.0);
  ASSERT_EQ(j["recipes"].size(), 4u);
  const std::vector<std::string> names = {"bf16", "fp8_linear", "fp8_kv", "fp8_attn"};
  for (size_t i = 0; i < names.size(); ++i) {
    const nlohmann::json& r = j["recipes"][i];
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(r["recipe"], names[i]);
    EXPECT_EQ(r["output_tokens"].get<double>(), 16.0);
    EXPECT_GT(r["tokens_per_s"].get<double>(), 0.0);
    EXPECT_GT(r["wall_s"].get<double>(), 0.0);
    EXPECT_GT(r["prefill_s"].get<double>(), 0.0);
    EXPECT_TRUE(r.contains("decode_s") && r.contains("decode_tokens_per_s"));
    EXPECT_EQ(r["engine"]["forwards"], 4);  // one prefill + 3 decode steps, all sequences at once
    EXPECT_EQ(r["roofline"]["decode_steps"], 3);
    EXPECT_GT(r["roofline"]["weight_bytes"].get<double>(), 0.0);
    EXPECT_GT(r["roofline"]["kv_bytes"].get<double>(), 0.0);
    EXPECT_GT(r["roofline"]["time_s_peak"].get<double>(), 0.0);
    const nlohmann::json& m = r["memory"];
    EXPECT_EQ(m["generator_weights_bytes"], m["generator_weights_bytes_expected"]);
    EXPECT_EQ(m["kv_pool_pages"], m["kv_pages_needed"]);
    EXPECT_GT(m["kv_pool_bytes"].get<int64_t>(), 0);
    EXPECT_TRUE(m["measured_activations_peak_bytes"].is_null());  // no cudaMemGetInfo on the CPU
  }
  // FP8 linears store less than the activation dtype; an E4M3 cache is half the BF16 one.
  EXPECT_LT(j["recipes"][1]["memory"]["generator_weights_bytes"].get<int64_t>(),
            j["recipes"][0]["memory"]["generator_weights_bytes"].get<int64_t>());
  EXPECT_EQ(2 * j["recipes"][2]["memory"]["kv_pool_bytes"].get<int64_t>(),
            j["recipes"][1]["memory"]["kv_pool_bytes"].get<int64_t>());

  EXPECT_NE(run_fp8rl({"bench", "generate", "--device", "cpu", "--model", "tiny", "--recipes", "fp9"}, log, out), 0);
  EXPECT_NE(out.find("fp9"), std::string::npos) << out;
  EXPECT_NE(run_fp8rl({"bench", "nope"}, log, out), 0);
  EXPECT_NE(out.find("generate"), std::string::npos) << out;
  fs::remove_all(dir);
}


// bench rl-step on the CPU: every recipe runs whole GRPO steps on the same ragged workload
// (forced response lengths: the same token counts in every recipe), no FP8 fallback.
TEST(BenchRlStepCli, TinyCpuRunTimesEveryPhaseOfEveryRecipe) {
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_bench_rl_step_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string json_path = (dir / "rl.json").string(), log = (dir / "log.txt").string();
  std::string out;
  ASSERT_EQ(run_fp8rl({"bench", "rl-step", "--model", "tiny", "--prompts", "2", "--samples", "3", "--prompt-len", "8",
                       "--max-new-tokens", "12", "--steps", "1", "--warmup", "1", "--kl-beta", "0.01", "--json",
                       json_path},
                      log, out),
            0)
      << out;
  const nlohmann::json j = nlohmann::json::parse(read_file(json_path));
  ASSERT_EQ(j["recipes"].size(), 3u);
  double gen_tokens = -1;
  for (const char* r : {"bf16", "fp8_gen", "fp8_e2e"}) {
    SCOPED_TRACE(r);
    const nlohmann::json& x = j["recipes"][r];
    for (const char* p : {"generation", "scoring", "reference", "training", "refit_calibration", "step"})
      EXPECT_GE(x["seconds"][p]["median"].get<double>(), 0.0) << p;
    EXPECT_GT(x["seconds"]["step"]["median"].get<double>(), 0.0);
    EXPECT_EQ(x["fp8_gemm_fallbacks"], 0);
    const double g = x["generated_tokens"][0].get<double>();
    EXPECT_GT(g, 0.0);
    EXPECT_LE(g, 2 * 3 * 12);
    if (gen_tokens >= 0) {
      EXPECT_EQ(g, gen_tokens) << "the forced lengths make every recipe generate the same count";
    }
    gen_tokens = g;
    EXPECT_GE(x["token_mult_prob_error"][0].get<double>(), 1.0);
  }
  EXPECT_NE(out.find("scoring+training"), std::string::npos) << out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fp8rl
