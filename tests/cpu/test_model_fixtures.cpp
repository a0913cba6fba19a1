// The transformer against Hugging Face: tiny llama / qwen2 / qwen3 checkpoints and the
// reference log-probs of tests/data/fixtures/reference.json (scripts/fixtures/make_fixtures.py
// documents the schema): HF FP32 and an independent FP8 emulation (pow2 scales off and on).
// Skipped, with a message, until the fixtures are generated and committed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <sys/wait.h>

#include "test_model_util.h"

namespace fp8rl {
namespace {

const std::string kFixtures = std::string(FP8RL_TEST_DATA) + "/fixtures";

bool load_reference(nlohmann::json& ref) {
  std::ifstream f(kFixtures + "/reference.json");
  if (!f) return false;
  ref = nlohmann::json::parse(f);
  return true;
}

#define FP8RL_REQUIRE_FIXTURES(ref)                                                              \
  nlohmann::json ref;                                                                            \
  if (!load_reference(ref))                                                                      \
    GTEST_SKIP() << kFixtures << "/reference.json is missing: generate the fixtures with "       \
                 << "`python3 scripts/fixtures/make_fixtures.py tests/data/fixtures` (torch + "  \
                 << "transformers 5) and commit them"

struct FixtureCase {
  const char* family;
  const char* reference;  // key in "logprobs"
  LinearMode mode;
  bool pow2;
  double max_mean_abs_diff;
};

class ModelFixtureTest : public ::testing::TestWithParam<FixtureCase> {};

// The three sequences of a family packed into one batch, scored at once: the mean absolute
// difference of every log-prob against the reference stays under the target.
TEST_P(ModelFixtureTest, LogprobsMatchReference) {
  FP8RL_REQUIRE_FIXTURES(ref);
  const FixtureCase& fc = GetParam();
  ASSERT_TRUE(ref["models"].contains(fc.family)) << "reference.json has no model " << fc.family;
  const auto& m = ref["models"][fc.family];
  const std::vector<std::vector<int32_t>> seqs = m["sequences"].get<std::vector<std::vector<int32_t>>>();
  const auto want = m["logprobs"][fc.reference].get<std::vector<std::vector<double>>>();
  ASSERT_EQ(want.size(), seqs.size());

  auto be = make_cpu_backend();
  const ModelWeights host = model_weights_load(kFixtures + "/" + m["dir"].get<std::string>(), DType::F32);
  const ModelWeights w = model_weights_to_device(*be, host, DType::F32);
  EnginePrecision p;
  p.linear = fc.mode;
  p.pow2_scales = fc.pow2;
  const ForwardBatch batch = forward_batch_from_sequences(seqs);
  const std::vector<double> got = test::values_f64(*be, model_forward_logprobs(*be, w, p, batch, {}).logp);

  double sum = 0.0, worst = 0.0;
  size_t n = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    ASSERT_EQ(want[s].size() + 1, seqs[s].size());
    for (size_t t = 0; t + 1 < seqs[s].size(); ++t) {
      const double d = std::fabs(got[batch.cu_seqlens[s] + t] - want[s][t]);
      sum += d, worst = std::max(worst, d), ++n;
    }
  }
  const double mad = sum / n;
  EXPECT_LT(mad, fc.max_mean_abs_diff) << fc.family << " " << fc.reference << ": worst " << worst;
  RecordProperty("mean_abs_diff", std::to_string(mad));
  std::printf("  %s %-8s mean |diff| %.3e  worst %.3e  over %zu tokens\n", fc.family, fc.reference, mad, worst, n);
}

INSTANTIATE_TEST_SUITE_P(
    Families, ModelFixtureTest,
    ::testing::Values(FixtureCase{"llama", "fp32", LinearMode::FP32, false, 2e-4},
                      FixtureCase{"qwen2", "fp32", LinearMode::FP32, false, 2e-4},
                      FixtureCase{"qwen3", "fp32", LinearMode::FP32, false, 2e-4},
                      FixtureCase{"llama", "fp8", LinearMode::FP8_BLOCK, false, 1e-2},
                      FixtureCase{"qwen2", "fp8", LinearMode::FP8_BLOCK, false, 1e-2},
                      FixtureCase{"qwen3", "fp8", LinearMode::FP8_BLOCK, false, 1e-2},
                      FixtureCase{"llama", "fp8_pow2", LinearMode::FP8_BLOCK, true, 1e-2},
                      FixtureCase{"qwen2", "fp8_pow2", LinearMode::FP8_BLOCK, true, 1e-2},
                      FixtureCase{"qwen3", "fp8_pow2", LinearMode::FP8_BLOCK, true, 1e-2}),
    [](const auto& info) { return std::string(info.param.family) + "_" + info.param.reference; });

// The acceptance path: `fp8rl logprobs` on a fixture checkpoint prints the reference values.
TEST(ModelFixtureCommand, LogprobsCommandMatchesHf) {
  FP8RL_REQUIRE_FIXTURES(ref);
  for (const char* family : {"llama", "qwen2", "qwen3"}) {
    const auto& m = ref["models"][family];
    const auto ids = m["sequences"][0].get<std::vector<int32_t>>();
    const auto want = m["logprobs"]["fp32"][0].get<std::vector<double>>();
    std::string text;
    for (int32_t id : ids) text += (text.empty() ? "" : " ") + std::to_string(id);
    const std::string cmd = std::string(FP8RL_BINARY) + " logprobs --model " + kFixtures + "/" +
                            m["dir"].get<std::string>() + " --ids \"" + text + "\" --precision fp32";
    FILE* f = popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string out;
    char buf[4096];
    size_t k;
    while ((k = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, k);
    const int st = pclose(f);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd;
    std::istringstream in(out);
    std::vector<double> got;
    double v;
    while (in >> v) got.push_back(v);
    ASSERT_EQ(got.size(), want.size()) << family;
    double mad = 0.0;
    for (size_t t = 0; t < got.size(); ++t) mad += std::fabs(got[t] - want[t]) / got.size();
    EXPECT_LT(mad, 2e-4) << family;
  }
}

}  // namespace
}  // namespace fp8rl
