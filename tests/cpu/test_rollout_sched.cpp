// The rollout scheduler (issue 6): prefix sharing, chunked prefill and recompute preemption
// change how the work is batched, never the results. On the CPU backend in FP32 every token's
// computation does not depend on the rest of its batch, so the samples must be token-for-token
// and logp-for-logp identical to a plain run (a big pool, no sharing, everything in one batch).
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "rollout/rollout.h"
#include "rollout/scheduler.h"
#include "test_model_util.h"

namespace fp8rl {
namespace {

constexpr int kVocab = 48, kPage = 4;

EnginePrecision fp32_precision() {
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  p.kv_cache = DType::F32;
  return p;
}

// Prompts of 9 (two full pages + 1), 8 (exactly two pages), 3 (less than a page) and 13 tokens.
std::vector<RolloutRequest> requests() {
  const auto p = test::token_sequences({9, 8, 3, 13}, kVocab, 23);
  return {{p[0], 3}, {p[1], 2}, {p[2], 3}, {p[3], 2}};
}

SamplingParams sampling(float temperature) {
  SamplingParams sp;
  sp.temperature = temperature;
  sp.max_new_tokens = 7;
  sp.seed = 11;
  sp.stop_ids = {5};
  return sp;
}

void expect_same_samples(const std::vector<RolloutSample>& out, const std::vector<RolloutSample>& ref,
                         const std::string& what) {
  ASSERT_EQ(out.size(), ref.size()) << what;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].request, ref[i].request) << what;
    EXPECT_EQ(out[i].index, ref[i].index) << what;
    EXPECT_EQ(out[i].tokens, ref[i].tokens) << what << ", sample " << i;
    EXPECT_EQ(out[i].logp, ref[i].logp) << what << ", sample " << i;
    EXPECT_EQ(out[i].finish, ref[i].finish) << what << ", sample " << i;
  }
}

struct Fixture {
  std::unique_ptr<Backend> be = make_cpu_backend();
  ModelWeights w = model_weights_to_device(*be, test::tiny_model("qwen3", DType::F32, 61), DType::F32);
  // The plain run: every sample prefills its whole prompt, all in one batch, pages to spare.
  std::vector<RolloutSample> reference(const SamplingParams& sp) {
    RolloutEngine e(*be, w, fp32_precision(), /*kv_pages=*/128, kPage, /*max_batch=*/64,
                    SchedulerOptions{/*max_batch_tokens=*/8192, /*prefix_sharing=*/false});
    auto out = e.generate(requests(), sp);
    EXPECT_EQ(e.last_stats().waves, 1);
    EXPECT_EQ(e.last_stats().preemptions, 0);
    EXPECT_EQ(e.last_stats().prefix_shared_tokens, 0);
    EXPECT_EQ(e.last_stats().prefill_tokens, e.last_stats().prompt_tokens);
    expect_iterations_accounted(e.last_stats());
    return out;
  }
  // Every iteration in one bucket (RolloutStats::iter_kind), their time within the loop's.
  static void expect_iterations_accounted(const RolloutStats& st) {
    int steps = 0;
    double seconds = 0;
    for (int k = 0; k < RolloutStats::kIterKinds; ++k) steps += st.iter_steps[k], seconds += st.iter_seconds[k];
    EXPECT_EQ(steps, st.decode_steps);
    EXPECT_LE(seconds, st.loop_seconds);
    EXPECT_GT(st.iter_steps[RolloutStats::kIterKinds - 1], 0) << "the prompts' prefill";
    EXPECT_GT(st.iter_steps[0], 0) << "decode steps of at most 16 sequences (this batch has 10)";
  }
};

TEST(RolloutScheduler, IterationKindsByBatchSize) {
  EXPECT_EQ(RolloutStats::iter_kind(1, false), 0);
  EXPECT_EQ(RolloutStats::iter_kind(16, false), 0);
  EXPECT_EQ(RolloutStats::iter_kind(17, false), 1);
  EXPECT_EQ(RolloutStats::iter_kind(128, false), 3);
  EXPECT_EQ(RolloutStats::iter_kind(129, false), 4);
  EXPECT_EQ(RolloutStats::iter_kind(256, false), 4);
  EXPECT_EQ(RolloutStats::iter_kind(257, false), 5);
  EXPECT_EQ(RolloutStats::iter_kind(100000, false), 5);
  EXPECT_EQ(RolloutStats::iter_kind(3, true), RolloutStats::kIterKinds - 1);
  EXPECT_STREQ(RolloutStats::iter_kind_name(0), "B<=16");
  EXPECT_STREQ(RolloutStats::iter_kind_name(5), "B>256");
  EXPECT_STREQ(RolloutStats::iter_kind_name(RolloutStats::kIterKinds - 1), "prefill");
}

TEST(RolloutScheduler, PrefixSharingGivesTheSameSamples) {
  Fixture f;
  for (float temperature : {0.0f, 1.0f}) {
    const SamplingParams sp = sampling(temperature);
    const std::vector<RolloutSample> ref = f.reference(sp);
    RolloutEngine e(*f.be, f.w, fp32_precision(), 128, kPage, 64);  // sharing on by default
    const std::vector<RolloutSample> out = e.generate(requests(), sp);
    expect_same_samples(out, ref, "temperature " + std::to_string(temperature));
    // Each follower shares the full pages before its prompt's last token:
    // 9 tokens -> 2 pages, 8 -> 1, 3 -> 0, 13 -> 3.
    const RolloutStats& st = e.last_stats();
    const int64_t shared = kPage * (2 * 2 + 1 * 1 + 0 * 2 + 3 * 1);
    EXPECT_EQ(st.prefix_shared_tokens, shared);
    EXPECT_EQ(st.prefill_tokens, st.prompt_tokens - shared);
    EXPECT_EQ(st.waves, 1);
    EXPECT_EQ(st.max_running, 10);
    if (temperature > 0) {
      int differ = 0;  // sampling must vary within a request for this test to mean anything
      for (size_t i = 1; i < out.size(); ++i) differ += out[i].request == out[i - 1].request && out[i].tokens != out[i - 1].tokens;
      EXPECT_GE(differ, 3);
    }
  }
}

TEST(RolloutScheduler, ChunkedPrefillGivesTheSameSamples) {
  Fixture f;
  const SamplingParams sp = sampling(1.0f);
  const std::vector<RolloutSample> ref = f.reference(sp);
  for (int budget : {1, 5, 12}) {
    for (bool sharing : {false, true}) {
      RolloutEngine e(*f.be, f.w, fp32_precision(), 128, kPage, 64, SchedulerOptions{budget, sharing});
      const std::vector<RolloutSample> out = e.generate(requests(), sp);
      const std::string what = "max_batch_tokens " + std::to_string(budget) + (sharing ? ", sharing" : "");
      expect_same_samples(out, ref, what);
      const RolloutStats& st = e.last_stats();
      // No forward holds more than the budget; the 78 prompt tokens need several admissions.
      EXPECT_GE(st.decode_steps, ceil_div(st.prefill_tokens, budget)) << what;
      EXPECT_GT(st.waves, 1) << what;
      EXPECT_EQ(st.preemptions, 0) << what;
      EXPECT_EQ(st.prefill_tokens + st.prefix_shared_tokens, st.prompt_tokens) << what;
    }
  }
}

// A pool too small for all sequences at once forces preemption; results do not change.
TEST(RolloutScheduler, PreemptionRecomputesToTheSameSamples) {
  Fixture f;
  for (float temperature : {0.0f, 1.0f}) {
    const SamplingParams sp = sampling(temperature);
    const std::vector<RolloutSample> ref = f.reference(sp);
    // The longest sequence needs ceil((13 + 7) / 4) = 5 pages.
    for (int pages : {5, 8}) {
      for (int budget : {6, 8192}) {
        for (bool sharing : {false, true}) {
          RolloutEngine e(*f.be, f.w, fp32_precision(), pages, kPage, 64, SchedulerOptions{budget, sharing});
          testing::internal::CaptureStderr();
          const std::vector<RolloutSample> out = e.generate(requests(), sp);
          const std::string err = testing::internal::GetCapturedStderr();
          const std::string what = std::to_string(pages) + " pages, max_batch_tokens " + std::to_string(budget) +
                                   (sharing ? ", sharing" : "") + ", temperature " + std::to_string(temperature);
          expect_same_samples(out, ref, what);
          const RolloutStats& st = e.last_stats();
          EXPECT_GT(st.preemptions, 0) << what;
          EXPECT_GT(st.recomputed_tokens, 0) << what;
          EXPECT_LE(st.max_pages_used, pages) << what;
          // One warning line per generate call, however many preemptions.
          EXPECT_NE(err.find("KV pool is full"), std::string::npos) << what;
          EXPECT_EQ(err.find("KV pool is full"), err.rfind("KV pool is full")) << what;
        }
      }
    }
  }
}

TEST(RolloutScheduler, PagesAreSharedAndFreedByReference) {
  PagePool pool(3);
  const int32_t a = pool.alloc(), b = pool.alloc();
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.free_pages(), 1);
  pool.retain(a);
  pool.release({a, b});
  EXPECT_EQ(pool.free_pages(), 2);  // b freed, a still held once
  EXPECT_EQ(pool.used_pages(), 1);
  pool.release({a});
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_THROW(pool.release({a}), Error);
  EXPECT_THROW(pool.retain(b), Error);
}

// The policy itself, without a model: chunks within the token budget, a follower sharing its
// holder's full prompt pages, and preemption of the youngest sequence when the pool is short.
std::vector<Sequence> sequences(const std::vector<std::pair<int, int>>& request_and_prompt_len) {
  std::vector<Sequence> seqs;
  for (auto [r, n] : request_and_prompt_len) {
    Sequence s;
    s.request = r;
    s.ids.assign(n, 1);
    s.prompt_len = n;
    seqs.push_back(s);
  }
  return seqs;
}

// After a forward: every sequence whose chunk reached its last token gets one more token.
void commit_and_sample(Scheduler& sched, std::vector<Sequence>& seqs) {
  sched.commit();
  for (Sequence& s : seqs)
    if (!s.finished && s.cached == s.len() && !s.pages.empty()) s.ids.push_back(2);
}

TEST(RolloutScheduler, PlansChunksSharingAndPreemption) {
  {
    std::vector<Sequence> seqs = sequences({{0, 10}, {0, 10}, {1, 3}});
    RolloutStats st;
    Scheduler sched(seqs, /*num_pages=*/16, SchedulerLimits{kPage, 8, /*max_batch_tokens=*/8, true}, st);
    EXPECT_EQ(sched.schedule(), std::vector<int>{0});  // the first prompt's first 8 tokens
    EXPECT_EQ(seqs[0].chunk, 8);
    EXPECT_EQ(seqs[0].pages.size(), 2u);
    commit_and_sample(sched, seqs);
    // Its last 2 tokens, then the follower (2 shared pages, recomputing tokens 8..9), then 3.
    EXPECT_EQ(sched.schedule(), (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(seqs[1].cached, 8);
    EXPECT_EQ(seqs[1].chunk, 2);
    ASSERT_EQ(seqs[1].pages.size(), 3u);
    EXPECT_EQ(seqs[1].pages[0], seqs[0].pages[0]);
    EXPECT_EQ(seqs[1].pages[1], seqs[0].pages[1]);
    EXPECT_NE(seqs[1].pages[2], seqs[0].pages[2]);
    EXPECT_EQ(st.prefix_shared_tokens, 8);
    EXPECT_EQ(st.max_pages_used, 3 + 1 + 1);
    commit_and_sample(sched, seqs);
    sched.schedule();  // three decodes
    for (const Sequence& s : seqs) EXPECT_EQ(s.chunk, 1);
    EXPECT_EQ(st.waves, 2);
    EXPECT_EQ(st.preemptions, 0);
    sched.commit();
    for (int i : {0, 1, 2}) sched.finish(i);
    EXPECT_TRUE(sched.done());
  }
  {
    std::vector<Sequence> seqs = sequences({{0, 4}, {1, 4}});
    RolloutStats st;
    Scheduler sched(seqs, /*num_pages=*/3, SchedulerLimits{kPage, 8, 64, true}, st);
    EXPECT_EQ(sched.schedule(), (std::vector<int>{0, 1}));
    commit_and_sample(sched, seqs);
    // Both need a second page; one is left: the youngest is preempted, keeping its tokens.
    EXPECT_EQ(sched.schedule(), std::vector<int>{0});
    EXPECT_EQ(st.preemptions, 1);
    EXPECT_EQ(seqs[1].cached, 0);
    EXPECT_TRUE(seqs[1].pages.empty());
    EXPECT_EQ(seqs[1].len(), 5);
    commit_and_sample(sched, seqs);
    sched.finish(0);
    // Re-admitted: prompt + generated token recomputed as one prefill.
    EXPECT_EQ(sched.schedule(), std::vector<int>{1});
    EXPECT_EQ(seqs[1].chunk, 5);
    EXPECT_EQ(st.recomputed_tokens, 4);
  }
}

// Random workloads through the scheduler alone: every sequence completes, no plan exceeds the
// budget, the batch or its pages, and every page is free at the end.
TEST(RolloutScheduler, RandomWorkloadsCompleteAndFreeEveryPage) {
  std::mt19937 rng(7);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int64_t preemptions = 0, shared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int page = uni(1, 5), max_new = uni(1, 10);
    std::vector<std::pair<int, int>> spec;
    int longest = 0;
    for (int r = 0, R = uni(1, 5); r < R; ++r) {
      const int len = uni(1, 20), n = uni(1, 4);
      longest = std::max(longest, len);
      for (int j = 0; j < n; ++j) spec.push_back({r, len});
    }
    std::vector<Sequence> seqs = sequences(spec);
    const int pages = static_cast<int>(ceil_div(longest + max_new, page)) + uni(0, 10);
    const SchedulerLimits lim{page, uni(1, 8), uni(1, 32), uni(0, 1) == 1};
    RolloutStats st;
    Scheduler sched(seqs, pages, lim, st);
    int iterations = 0;
    while (!sched.done()) {
      ASSERT_LT(++iterations, 10000) << "trial " << trial << " makes no progress";
      const std::vector<int> plan = sched.schedule();
      int tokens = 0;
      for (int si : plan) {
        const Sequence& s = seqs[si];
        tokens += s.chunk;
        ASSERT_GE(static_cast<int>(s.pages.size()) * page, s.cached + s.chunk) << "trial " << trial;
      }
      ASSERT_LE(tokens, lim.max_batch_tokens);
      ASSERT_LE(static_cast<int>(plan.size()), lim.max_batch);
      ASSERT_LE(st.max_pages_used, pages);
      sched.commit();
      for (int si : plan) {
        Sequence& s = seqs[si];
        if (s.cached != s.len()) continue;
        s.ids.push_back(uni(0, 9));
        if (s.len() - s.prompt_len == max_new || s.ids.back() == 0) sched.finish(si);
      }
    }
    EXPECT_EQ(sched.free_pages(), pages) << "trial " << trial;
    for (const Sequence& s : seqs) EXPECT_TRUE(s.finished);
    preemptions += st.preemptions;
    shared += st.prefix_shared_tokens;
  }
  EXPECT_GT(preemptions, 100);  // the workloads do exercise preemption and sharing
  EXPECT_GT(shared, 100);
}

TEST(RolloutScheduler, BadOptionsAreClearErrors) {
  Fixture f;
  EXPECT_THROW(RolloutEngine(*f.be, f.w, fp32_precision(), 8, kPage, 4, SchedulerOptions{0, true}), Error);
}

}  // namespace
}  // namespace fp8rl
