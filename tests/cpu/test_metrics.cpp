#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "rl/metrics.h"
#include "rl/metrics_log.h"

using namespace fp8rl;

namespace {

std::string make_temp_dir(const char* tag) {
  std::random_device rd;
  auto p = std::filesystem::temp_directory_path() /
           ("fp8rl_" + std::string(tag) + "_" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(p);
  return p.string();
}

std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string s;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

}  // namespace

TEST(Mismatch, GenKlIsKlOfGeneratorFromTrainer) {
  // Generator q = {0.5, 0.25, 0.25}, trainer p = {0.4, 0.4, 0.2} over three outcomes. Tokens
  // drawn from q in exact proportion: x1, x1, x2, x3. Then mean k3 = KL(q || p) exactly:
  //   KL(q||p) = 0.5 ln(1.25) + 0.25 ln(0.625) + 0.25 ln(1.25) = 0.0498568
  //   KL(p||q) = 0.4 ln(0.8)  + 0.4 ln(1.6)    + 0.2 ln(0.8)   = 0.0541154  (the other direction)
  const std::vector<float> gen = {std::log(0.5f), std::log(0.5f), std::log(0.25f), std::log(0.25f)};
  const std::vector<float> train = {std::log(0.4f), std::log(0.4f), std::log(0.4f), std::log(0.2f)};
  const auto m = metrics_compute_mismatch(train, gen);
  EXPECT_NEAR(m.gen_kl_error, 0.0498568, 1e-6);
  EXPECT_GT(std::fabs(m.gen_kl_error - 0.0541154), 1e-3);
  // token_mult_prob_error: exp|log p - log q| = 1.25, 1.25, 1.6, 1.25 -> 5.35 / 4
  EXPECT_NEAR(m.token_mult_prob_error, 1.3375, 1e-6);
  EXPECT_NEAR(m.max_abs_logp_diff, std::log(1.6), 1e-6);
  EXPECT_EQ(m.tokens, 4);
}

TEST(Mismatch, IdenticalEnginesAndMask) {
  const std::vector<float> a = {-0.3f, -2.0f, -1.0f};
  auto m = metrics_compute_mismatch(a, a);
  EXPECT_EQ(m.token_mult_prob_error, 1.0);
  EXPECT_EQ(m.gen_kl_error, 0.0);
  // a masked-out token does not count, even when it disagrees wildly
  const std::vector<float> b = {-0.3f, -9.0f, -1.0f};
  const std::vector<uint8_t> mask = {1, 0, 1};
  m = metrics_compute_mismatch(a, b, mask);
  EXPECT_EQ(m.token_mult_prob_error, 1.0);
  EXPECT_EQ(m.tokens, 2);
  EXPECT_TRUE(std::isnan(metrics_compute_mismatch({}, {}).gen_kl_error));  // nothing: null
  const std::vector<float> bad = {-0.3f, NAN, -1.0f};
  EXPECT_THROW(metrics_compute_mismatch(a, bad), Error);
  EXPECT_THROW(metrics_compute_mismatch(a, std::vector<float>{-1.0f}), Error);
}

TEST(Metrics, LengthsRewardAccuracyEntropy) {
  const std::vector<int64_t> lens = {3, 8, 8, 5};
  const auto l = metrics_length_stats(lens, 8);
  EXPECT_DOUBLE_EQ(l.mean, 6.0);
  EXPECT_EQ(l.min, 3);
  EXPECT_EQ(l.max, 8);
  EXPECT_DOUBLE_EQ(l.capped_fraction, 0.5);
  EXPECT_NEAR(l.std, std::sqrt((9.0 + 4 + 4 + 1) / 4), 1e-12);
  const std::vector<float> rewards = {1, 0, 0.5f, 1};
  EXPECT_DOUBLE_EQ(metrics_mean(rewards), 0.625);
  const std::vector<uint8_t> correct = {1, 0, 0, 1, 1};
  EXPECT_DOUBLE_EQ(metrics_accuracy(correct), 0.6);
  const std::vector<float> ent = {0.5f, 2.0f, 1.0f};
  const std::vector<uint8_t> mask = {1, 0, 1};
  EXPECT_DOUBLE_EQ(metrics_masked_mean(ent, mask), 0.75);
  EXPECT_TRUE(std::isnan(metrics_accuracy({})));
}

TEST(MetricsLog, JsonLineHasRequiredKeysAndNullForNonFinite) {
  StepMetrics m;
  m.step = 3;
  m.reward_mean = 0.25;
  m.token_mult_prob_error = 1.01;
  m.gen_kl_error = std::numeric_limits<double>::infinity();  // must not become invalid JSON
  m.time_generation_s = 1.5;
  m.time_train_s = 0.5;
  m.time_refit_s = 0.01;
  m.extra = {{"custom_metric", 7.0}};
  auto j = nlohmann::json::parse(metrics_to_json_line(m));
  for (const char* k : {"step", "reward_mean", "token_mult_prob_error", "gen_kl_error", "time_generation_s",
                        "time_train_s", "time_refit_s"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["step"], 3);
  EXPECT_EQ(j["reward_mean"], 0.25);
  EXPECT_TRUE(j["gen_kl_error"].is_null());
  EXPECT_TRUE(j["loss"].is_null());  // not measured
  EXPECT_EQ(j["custom_metric"], 7.0);
  EXPECT_FALSE(j.contains("val_accuracy"));  // validation did not run
  m.val_accuracy = 0.6;
  j = nlohmann::json::parse(metrics_to_json_line(m));
  EXPECT_EQ(j["val_accuracy"], 0.6);
  m.extra.push_back({"reward_mean", 1.0});  // a duplicate of a fixed key is a bug in the caller
  EXPECT_THROW(metrics_to_json_line(m), Error);
}

TEST(MetricsLog, AppendsOneFlushedLinePerStep) {
  const std::string dir = make_temp_dir("mlog");
  std::FILE* console = std::tmpfile();
  ASSERT_NE(console, nullptr);
  {
    MetricsLog log(dir, console);
    for (int s = 0; s < 3; ++s) {
      StepMetrics m;
      m.step = s;
      m.reward_mean = 0.1 * s;
      if (s == 0) m.val_accuracy = 0.5;
      log.write(m, 3);
      // flushed: the file already holds s + 1 lines while the log is open
      std::ifstream in(log.path());
      int lines = 0;
      for (std::string l; std::getline(in, l);) ++lines;
      EXPECT_EQ(lines, s + 1);
    }
  }
  std::ifstream in(dir + "/metrics.jsonl");
  std::vector<nlohmann::json> rows;
  for (std::string l; std::getline(in, l);) rows.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[2]["step"], 2);
  EXPECT_TRUE(rows[0].contains("val_accuracy"));
  EXPECT_FALSE(rows[1].contains("val_accuracy"));
  const std::string text = read_all(console);
  EXPECT_NE(text.find("step 2/3 | reward 0.200"), std::string::npos) << text;
  EXPECT_NE(text.find("val_acc 0.500"), std::string::npos) << text;
  std::fclose(console);
  std::filesystem::remove_all(dir);
  EXPECT_THROW(MetricsLog(dir + "/missing/dir", nullptr), Error);
}

TEST(Progress, PlainLinesWhenNotATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("generate", 4, f, /*tty=*/0, /*line_interval_s=*/0.0);
    for (int i = 1; i <= 4; ++i) p.update(i);
  }
  const std::string text = read_all(f);
  std::fclose(f);
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_NE(text.find("generate: 2/4"), std::string::npos) << text;
  EXPECT_NE(text.find("generate: 4/4"), std::string::npos) << text;
  EXPECT_NE(text.find(" done\n"), std::string::npos) << text;
}

TEST(Progress, RedrawnBarOnATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  Progress p("val", 10, f, /*tty=*/1);
  p.update(5);
  p.finish();
  p.update(7);  // after finish: ignored
  const std::string text = read_all(f);
  std::fclose(f);
  EXPECT_NE(text.find("\rval [###############---------------] 5/10"), std::string::npos) << text;
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(text.find("7/10"), std::string::npos);
}

TEST(MetricsLog, FilledFromLossAndMismatchStatistics) {
  GrpoStats s;
  s.tokens = 10;
  s.seqs = 2;
  s.clipped = 3;
  s.is_tokens = 10;
  s.is_weight_sum = 10.5;
  s.is_weight_min = 0.7;
  s.is_weight_max = 1.6;
  s.truncated = 1;
  StepMetrics m;
  step_metrics_set_loss_stats(m, s);
  EXPECT_DOUBLE_EQ(m.clip_fraction, 0.3);
  EXPECT_DOUBLE_EQ(m.is_weight_mean, 1.05);
  EXPECT_DOUBLE_EQ(m.is_weight_max, 1.6);
  EXPECT_DOUBLE_EQ(m.is_truncated_fraction, 0.1);
  // no IS tokens at all: min/max are null, not +-inf
  StepMetrics e;
  step_metrics_set_loss_stats(e, GrpoStats{});
  const auto j = nlohmann::json::parse(metrics_to_json_line(e));
  EXPECT_TRUE(j["is_weight_min"].is_null());
  EXPECT_TRUE(j["clip_fraction"].is_null());
  const std::vector<float> a = {-1.0f, -2.0f}, b = {-1.1f, -2.0f};
  step_metrics_set_mismatch(m, metrics_compute_mismatch(a, b));
  EXPECT_NEAR(m.token_mult_prob_error, (std::exp(0.1) + 1.0) / 2, 1e-6);
}
