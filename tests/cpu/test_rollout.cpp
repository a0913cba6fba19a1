// The rollout engine against the scoring forward (issue 4): greedy generation is the
// step-by-step argmax, sampled logp_gen is the trainer's logp in the same numerics, requests
// that cannot fit are refused clearly, and work larger than the batch or the pool completes in
// waves with the same results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "rollout/rollout.h"
#include "test_model_util.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

constexpr int kVocab = 48;

EnginePrecision fp32_precision() {
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  p.kv_cache = DType::F32;
  return p;
}

// log p(c | prefix) for every token c of the vocabulary, by the scoring forward.
std::vector<double> next_token_logps(Backend& be, const ModelWeights& w, const EnginePrecision& prec,
                                     const std::vector<int32_t>& prefix) {
  std::vector<std::vector<int32_t>> seqs;
  for (int c = 0; c < kVocab; ++c) {
    seqs.push_back(prefix);
    seqs.back().push_back(c);
  }
  const ForwardBatch batch = forward_batch_from_sequences(seqs);
  const LogprobResult r = model_forward_logprobs(be, w, prec, batch, ForwardOptions{});
  const std::vector<double> lp = test::values_f64(be, r.logp);
  std::vector<double> out;
  for (int c = 0; c < kVocab; ++c) out.push_back(lp[batch.cu_seqlens[c + 1] - 2]);
  return out;
}

std::vector<RolloutRequest> some_requests() {
  const auto p = test::token_sequences({5, 3, 8}, kVocab, 17);
  return {{p[0], 2}, {p[1], 3}, {p[2], 2}};
}

TEST(RolloutEngine, GreedyIsStepByStepArgmaxOfTheScoringForward) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 31), DType::F32);
  const EnginePrecision prec = fp32_precision();
  RolloutEngine engine(*be, w, prec, /*kv_pages=*/16, /*page_size=*/4, /*max_batch=*/8);
  SamplingParams sp;
  sp.temperature = 0.0f;
  sp.max_new_tokens = 6;
  const std::vector<RolloutRequest> reqs = {some_requests()[0], some_requests()[1]};
  const std::vector<RolloutSample> out = engine.generate(reqs, sp);
  ASSERT_EQ(out.size(), 5u);
  int decided = 0;
  for (const RolloutSample& s : out) {
    ASSERT_EQ(s.tokens.size(), 6u);
    EXPECT_EQ(s.finish, FinishReason::Length);
    // Greedy samples of one prompt are identical.
    EXPECT_EQ(s.tokens, out[s.request == 0 ? 0 : 2].tokens);
    if (s.index > 0) continue;  // the scoring reference once per prompt
    std::vector<int32_t> prefix = reqs[s.request].prompt;
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      EXPECT_EQ(s.logp[j], 0.0f) << "greedy logp is the one-hot limit";
      const std::vector<double> lp = next_token_logps(*be, w, prec, prefix);
      const int best = static_cast<int>(std::max_element(lp.begin(), lp.end()) - lp.begin());
      std::vector<double> sorted = lp;
      std::sort(sorted.rbegin(), sorted.rend());
      if (sorted[0] - sorted[1] > 1e-4) {  // a clear winner: the engine must pick it
        EXPECT_EQ(s.tokens[j], best) << "request " << s.request << " token " << j;
        ++decided;
      } else {  // a near tie: any of the tied tokens
        EXPECT_GE(lp[s.tokens[j]], sorted[0] - 1e-4);
      }
      prefix.push_back(s.tokens[j]);
    }
  }
  EXPECT_GE(decided, 8);

  // A stop id ends the sequence after it is emitted (kept in the tokens).
  const int32_t stop = out[0].tokens[2];
  const size_t first = std::find(out[0].tokens.begin(), out[0].tokens.end(), stop) - out[0].tokens.begin();
  sp.stop_ids = {stop};
  const std::vector<RolloutSample> stopped = engine.generate({reqs[0]}, sp);
  ASSERT_EQ(stopped.size(), 2u);
  EXPECT_EQ(stopped[0].finish, FinishReason::Stop);
  EXPECT_EQ(stopped[0].tokens, std::vector<int32_t>(out[0].tokens.begin(), out[0].tokens.begin() + first + 1));
}

// logp_gen of sampled tokens is the trainer's logp of the same sequences (fp32, F32 cache),
// at temperatures 1 and 0.7, with top-p truncation (logp is before truncation).
TEST(RolloutEngine, SampledLogpMatchesTrainerScore) {
  auto be = make_cpu_backend();
  const EnginePrecision prec = fp32_precision();
  Trainer trainer(*be, model_weights_to_device(*be, test::tiny_model("qwen2", DType::F32, 32), DType::F32), prec,
                  TrainerOptions{});
  RolloutEngine engine(*be, trainer.master(), prec, 32, 4, 8);
  const std::vector<RolloutRequest> reqs = some_requests();
  for (float temperature : {1.0f, 0.7f}) {
    SamplingParams sp;
    sp.temperature = temperature;
    sp.top_p = temperature == 1.0f ? 1.0f : 0.9f;
    sp.max_new_tokens = 7;
    sp.seed = 99;
    const std::vector<RolloutSample> out = engine.generate(reqs, sp);
    ASSERT_EQ(out.size(), 7u);
    std::vector<TrainSequence> seqs;
    std::vector<float> logp_gen;
    std::vector<std::vector<int32_t>> distinct;
    for (const RolloutSample& s : out) {
      TrainSequence t{reqs[s.request].prompt, static_cast<int>(reqs[s.request].prompt.size())};
      t.ids.insert(t.ids.end(), s.tokens.begin(), s.tokens.end());
      seqs.push_back(t);
      logp_gen.insert(logp_gen.end(), s.logp.begin(), s.logp.end());
      if (std::find(distinct.begin(), distinct.end(), s.tokens) == distinct.end()) distinct.push_back(s.tokens);
    }
    EXPECT_GE(distinct.size(), 5u) << "sampling does not vary between samples";
    const ScoreResult sr = trainer.score(seqs, temperature, false, false);
    ASSERT_EQ(sr.logp.size(), logp_gen.size());
    double max_diff = 0, sum_logp = 0;
    for (size_t i = 0; i < logp_gen.size(); ++i) {
      max_diff = std::max(max_diff, std::abs(static_cast<double>(sr.logp[i]) - logp_gen[i]));
      sum_logp += logp_gen[i];
      EXPECT_LT(logp_gen[i], 0.0f);
    }
    EXPECT_LE(max_diff, 1e-4) << "temperature " << temperature;
    EXPECT_LT(sum_logp / logp_gen.size(), -0.5) << "the distribution is too peaked to test anything";
  }
}

// The draws are keyed by (seed, request, sample, position): the same seed gives the same tokens
// (plain temperature: Gumbel-max; top-k: the uniforms' streams), another seed other tokens, and
// a request's samples do not depend on what else is in the call.
TEST(RolloutEngine, TheSeedFixesTheTokens) {
  auto be = make_cpu_backend();
  const EnginePrecision prec = fp32_precision();
  const ModelWeights w = model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 5), DType::F32);
  RolloutEngine engine(*be, w, prec, 32, 4, 8);
  const std::vector<RolloutRequest> reqs = some_requests();
  for (int top_k : {0, 10}) {
    SamplingParams sp;
    sp.top_k = top_k;
    sp.max_new_tokens = 6;
    sp.seed = 7;
    const std::vector<RolloutSample> a = engine.generate(reqs, sp), b = engine.generate(reqs, sp);
    sp.seed = 8;
    const std::vector<RolloutSample> c = engine.generate(reqs, sp);
    sp.seed = 7;
    const std::vector<RolloutSample> last = engine.generate({reqs[2]}, [&] {
      SamplingParams q = sp;
      q.first_request = 2;  // request 2 alone, drawing as request 2
      return q;
    }());
    ASSERT_EQ(a.size(), b.size());
    int differ = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].tokens, b[i].tokens) << "top_k " << top_k << " sample " << i;
      EXPECT_EQ(a[i].logp, b[i].logp);
      differ += a[i].tokens != c[i].tokens;
    }
    EXPECT_GE(differ, 3) << "top_k " << top_k << ": another seed must draw other tokens";
    ASSERT_EQ(last.size(), 2u);
    EXPECT_EQ(last[0].tokens, a[5].tokens);
    EXPECT_EQ(last[1].tokens, a[6].tokens);
  }
}

TEST(RolloutEngine, RequestLargerThanThePoolIsAClearError) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 33), DType::F32);
  RolloutEngine engine(*be, w, fp32_precision(), /*kv_pages=*/2, /*page_size=*/4, 8);  // 8 tokens
  SamplingParams sp;
  sp.max_new_tokens = 4;
  EXPECT_NO_THROW(engine.generate({{{1, 2, 3, 4}, 3}}, sp));  // exactly fits (one at a time)
  sp.max_new_tokens = 5;
  try {
    engine.generate({{{1, 2, 3}, 1}, {{1, 2, 3, 4}, 1}}, sp);
    ADD_FAILURE() << "a request of 9 tokens in an 8-token pool was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("request 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("KV pages"), std::string::npos) << msg;
    EXPECT_NE(msg.find("max_new_tokens"), std::string::npos) << msg;
  }
  EXPECT_THROW(engine.generate({{{}, 1}}, sp), Error);
  EXPECT_THROW(engine.generate({{{1, kVocab}, 1}}, sp), Error);
  EXPECT_THROW(engine.generate({{{1, 2}, 0}}, sp), Error);
}

// More sequences than max_batch, or than the pool holds at once, complete in waves with the
// same tokens and logps as one wave.
TEST(RolloutEngine, MoreSequencesThanBatchOrPoolCompleteInWaves) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, test::tiny_model("llama", DType::F32, 34), DType::F32);
  const EnginePrecision prec = fp32_precision();
  const std::vector<RolloutRequest> reqs = some_requests();  // 7 sequences, prompts of 5, 3, 8 tokens
  SamplingParams sp;
  sp.max_new_tokens = 5;
  sp.seed = 5;
  sp.stop_ids = {3};

  RolloutEngine all(*be, w, prec, /*kv_pages=*/64, /*page_size=*/4, /*max_batch=*/64);
  const std::vector<RolloutSample> ref = all.generate(reqs, sp);
  EXPECT_EQ(all.last_stats().waves, 1);
  ASSERT_EQ(ref.size(), 7u);

  RolloutEngine small_batch(*be, w, prec, 64, 4, /*max_batch=*/2);
  // Each sequence needs up to ceil(13 / 4) = 4 pages, all 7 about 20: a pool of 8 admits some,
  // then preempts as they grow and re-admits them later (test_rollout_sched.cpp goes further).
  RolloutEngine small_pool(*be, w, prec, /*kv_pages=*/8, 4, 64);
  for (RolloutEngine* e : {&small_batch, &small_pool}) {
    const std::vector<RolloutSample> out = e->generate(reqs, sp);
    EXPECT_GE(e->last_stats().waves, e == &small_batch ? 3 : 2);
    EXPECT_GT(e->last_stats().decode_steps, all.last_stats().decode_steps);
    EXPECT_EQ(e->last_stats().generated_tokens, all.last_stats().generated_tokens);
    ASSERT_EQ(out.size(), ref.size());
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(out[i].request, ref[i].request);
      EXPECT_EQ(out[i].index, ref[i].index);
      EXPECT_EQ(out[i].tokens, ref[i].tokens) << "sample " << i;
      EXPECT_EQ(out[i].finish, ref[i].finish);
      ASSERT_EQ(out[i].logp.size(), ref[i].logp.size());
      for (size_t j = 0; j < out[i].logp.size(); ++j) EXPECT_NEAR(out[i].logp[j], ref[i].logp[j], 1e-5);
    }
  }
}

}  // namespace
}  // namespace fp8rl
