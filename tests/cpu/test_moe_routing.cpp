// Mixture-of-experts routing between the engines (issue 16): the generator's routing record
// (RolloutSample::routing), the trainer's routing agreement with it (Trainer::score), and routing
// replay (ForwardOptions::replay_routing, TrainerOptions::routing_replay): bitwise the normal
// forward and backward when the replayed routing is the model's own, FP64 finite differences
// through replayed weights, the record under prefix sharing and preemption, and an FP8 generator
// whose routing differs from an FP32 trainer's until the trainer replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/transformer.h"
#include "rl/memory_plan.h"
#include "rl/metrics.h"
#include "rl/metrics_log.h"
#include "rollout/rollout.h"
#include "test_model_util.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

using test::values_f64;

// A tiny Qwen3-MoE (layer 0 dense, the rest sparse: model_config_tiny's qwen3_moe), or with
// DeepSeek-V3's MoE block (sigmoid grouped routing, correction bias, a shared expert).
ModelWeights tiny_moe(DType dtype, uint64_t seed, bool deepseek = false, int experts = 4, int top_k = 2, int layers = 3,
                      bool norm_topk = true) {
  ModelConfig c = model_config_tiny("qwen3_moe", 48, /*hidden=*/64, layers, /*heads=*/4, /*kv_heads=*/2,
                                    /*intermediate=*/96);
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.moe_intermediate_size = 40;
  c.norm_topk_prob = norm_topk;
  if (deepseek) {
    c.moe_router = "sigmoid";
    c.n_group = 4;
    c.topk_group = 2;
    c.routed_scaling_factor = 2.5f;
    c.n_shared_experts = 1;
  }
  c.validate();
  RandomInit init;
  init.seed = seed;
  init.std = 0.15f;
  init.norm_jitter = 0.2f;
  return model_weights_random(c, init, dtype);
}

// FP32 linears and cache: the exact path.
EnginePrecision fp32_precision() {
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  p.kv_cache = DType::F32;
  return p;
}

std::vector<uint8_t> bytes_of(Backend& be, const Tensor& t) {
  const Tensor h = t.device() == DeviceKind::CPU ? t : be.to_host(t);
  const auto* p = static_cast<const uint8_t*>(h.raw());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

struct ForwardBackward {
  std::vector<uint8_t> logp;
  std::vector<std::vector<uint8_t>> grads;
  MoeRouting routing, router_topk;
};

// Scoring with the routing recorded, then sum_t c_t logp_t's backward (the router trained, so its
// gradient through the routing weights is compared too).
ForwardBackward forward_backward(Backend& be, const ModelWeights& w, const EnginePrecision& p, const ForwardBatch& b,
                                 const MoeRouting* replay, bool recompute) {
  ForwardOptions fo;
  fo.record_routing = true;
  fo.replay_routing = replay;
  fo.recompute = recompute;
  Activations acts;
  const LogprobResult lr = model_forward_logprobs(be, w, p, b, fo, &acts);
  ForwardBackward out;
  out.logp = bytes_of(be, lr.logp);
  out.routing = lr.routing;
  out.router_topk = lr.router_topk;
  const int64_t T = b.num_tokens();
  Tensor c = Tensor::empty({T}, lr.logp.dtype());
  for (int64_t t = 0; t < T; ++t) {
    const double v = 0.5 + 0.37 * std::sin(1.3 * t + 0.2);
    if (c.dtype() == DType::F64) c.data<double>()[t] = v;
    else c.data<float>()[t] = static_cast<float>(v);
  }
  ModelWeights g = model_grads_alloc(be, w, w.embed.dtype() == DType::F64 ? DType::F64 : DType::F32);
  BackwardOptions bo;
  bo.router_grad = true;
  model_backward(be, w, p, acts, be.to_device(c), g, bo);
  model_for_each_parameter(g, [&](const std::string&, Tensor& t) { out.grads.push_back(bytes_of(be, t)); });
  return out;
}

// Replaying the forward's own routing changes nothing: the same bytes of every log-prob and every
// gradient (router included), in FP32 and FP8 linears, with and without block recomputation, for
// both routers. The replay runs the replay ops (moe_route_*_weights), so this is their bitwise
// contract inside the model.
TEST(MoeReplay, OwnRoutingIsBitwiseTheNormalForwardAndBackward) {
  auto be = make_cpu_backend();
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({9, 6, 11}, 48, 4));
  for (bool deepseek : {false, true})
    for (LinearMode mode : {LinearMode::FP32, LinearMode::FP8_BLOCK})
      for (bool recompute : {false, true}) {
        SCOPED_TRACE(std::string(deepseek ? "deepseek" : "softmax") + " mode " + std::to_string(int(mode)) +
                     (recompute ? " recompute" : ""));
        const ModelWeights w = tiny_moe(DType::F32, 31, deepseek, deepseek ? 8 : 4, deepseek ? 3 : 2);
        EnginePrecision p;
        p.linear = mode;
        const ForwardBackward normal = forward_backward(*be, w, p, b, nullptr, recompute);
        ASSERT_EQ(normal.routing.ids.size(), 2u) << "two MoE layers recorded";
        EXPECT_TRUE(normal.router_topk.ids.empty()) << "the router's own top-k is recorded only under a replay";
        const ForwardBackward replayed = forward_backward(*be, w, p, b, &normal.routing, recompute);
        EXPECT_EQ(replayed.logp, normal.logp);
        ASSERT_EQ(replayed.grads.size(), normal.grads.size());
        for (size_t i = 0; i < normal.grads.size(); ++i)
          EXPECT_EQ(replayed.grads[i], normal.grads[i]) << "tensor " << i;
        EXPECT_EQ(replayed.routing.ids, normal.routing.ids);
        EXPECT_EQ(replayed.router_topk.ids, normal.routing.ids);
      }
}

// A replayed routing that is not the model's own: for each token and MoE layer the experts
// (t + m) % E, (t + m + 1) % E (...), token 0 of every layer kept on its own (-1).
MoeRouting other_routing(const ModelConfig& c, int64_t T) {
  MoeRouting r;
  r.top_k = c.num_experts_per_tok;
  const int Lm = model_num_moe_layers(c);
  for (int m = 0; m < Lm; ++m) {
    std::vector<int32_t> ids(static_cast<size_t>(T * r.top_k));
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < r.top_k; ++j) ids[t * r.top_k + j] = static_cast<int32_t>((t + m + j) % c.num_experts);
    for (int j = 0; j < r.top_k; ++j) ids[j] = -1;
    r.ids.push_back(ids);
  }
  return r;
}

// The replay is applied: the forward differs from the normal one, it records the replayed experts
// as the ones used (token 0 keeps its own) and the router's own top-k beside them.
TEST(MoeReplay, AnotherRoutingIsUsedAndRecorded) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F32, 32);
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({10, 7}, 48, 5));
  const EnginePrecision p = fp32_precision();
  const ForwardBackward normal = forward_backward(*be, w, p, b, nullptr, false);
  const MoeRouting other = other_routing(w.config, b.num_tokens());
  const ForwardBackward replayed = forward_backward(*be, w, p, b, &other, false);
  EXPECT_NE(replayed.logp, normal.logp);
  const int k = other.top_k;
  for (size_t m = 0; m < other.ids.size(); ++m) {
    for (int j = 0; j < k; ++j) EXPECT_EQ(replayed.routing.ids[m][j], normal.routing.ids[m][j]) << "token 0: its own";
    EXPECT_TRUE(std::equal(other.ids[m].begin() + k, other.ids[m].end(), replayed.routing.ids[m].begin() + k));
    // Token 0 and the tokens before the first replayed layer see the same inputs: the router's
    // own top-k of layer 1 (the first MoE layer) is the normal forward's.
    if (m == 0) {
      EXPECT_EQ(replayed.router_topk.ids[m], normal.routing.ids[m]);
    }
  }
}

// A bad replay is a clear error: wrong size, an expert out of range, an expert twice.
TEST(MoeReplay, MalformedReplayIsAnError) {
  auto be = make_cpu_backend();
  const ModelWeights w = tiny_moe(DType::F32, 33);
  const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({6}, 48, 6));
  const MoeRouting good = other_routing(w.config, b.num_tokens());
  auto run = [&](const MoeRouting& r) {
    ForwardOptions fo;
    fo.replay_routing = &r;
    model_forward_logprobs(*be, w, fp32_precision(), b, fo);
  };
  EXPECT_NO_THROW(run(good));
  MoeRouting r = good;
  r.ids[1].pop_back();
  EXPECT_THROW(run(r), Error);
  r = good;
  r.ids.pop_back();
  EXPECT_THROW(run(r), Error);
  r = good;
  r.ids[0][5] = w.config.num_experts;
  EXPECT_THROW(run(r), Error);
  r = good;
  r.ids[0][4] = r.ids[0][5];  // token 2 names one expert twice
  EXPECT_THROW(run(r), Error);
}

double replay_loss(Backend& be, const ModelWeights& w, const ForwardBatch& b, const MoeRouting& replay,
                   const std::vector<double>& c) {
  ForwardOptions fo;
  fo.replay_routing = &replay;
  const std::vector<double> logp = values_f64(be, model_forward_logprobs(be, w, fp32_precision(), b, fo).logp);
  double L = 0;
  for (size_t t = 0; t < logp.size(); ++t) L += c[t] * logp[t];
  return L;
}

// Backward under a replay that is not the model's own routing matches FP64 central differences of
// the replayed forward, for every parameter tensor (4 entries each; the router trained, so its
// gradient through the replayed experts' weights is checked too). With the routing fixed by the
// replay the loss is smooth in every weight: no top-k tie can be crossed.
TEST(MoeReplay, BackwardMatchesFiniteDifferencesFp64) {
  auto be = make_cpu_backend();
  for (bool deepseek : {false, true}) {
    SCOPED_TRACE(deepseek ? "deepseek" : "softmax");
    ModelWeights w = tiny_moe(DType::F64, 34, deepseek, deepseek ? 8 : 4, deepseek ? 3 : 2);
    const ForwardBatch b = forward_batch_from_sequences(test::token_sequences({6, 5}, 48, 7));
    const int64_t T = b.num_tokens();
    const MoeRouting replay = other_routing(w.config, T);
    std::vector<double> c(T);
    for (int64_t t = 0; t < T; ++t) c[t] = 0.5 + 0.37 * std::sin(1.3 * t + 0.2);
    ForwardOptions fo;
    fo.replay_routing = &replay;
    Activations acts;
    model_forward_logprobs(*be, w, fp32_precision(), b, fo, &acts);
    ModelWeights g = model_grads_alloc(*be, w, DType::F64);
    Tensor ct = Tensor::empty({T}, DType::F64);
    for (int64_t t = 0; t < T; ++t) ct.data<double>()[t] = c[t];
    BackwardOptions bo;
    bo.router_grad = true;
    model_backward(*be, w, fp32_precision(), acts, be->to_device(ct), g, bo);
    std::vector<Tensor> grads;
    model_for_each_parameter(g, [&](const std::string&, Tensor& t) { grads.push_back(t); });
    size_t gi = 0;
    int checked = 0, routers = 0;
    double worst = 0;
    model_for_each_parameter(w, [&](const std::string& name, Tensor& p) {
      const std::vector<double> an = values_f64(*be, grads[gi++]);
      if (name.find("e_score_correction_bias") != std::string::npos) return;  // selects only: replayed away
      double gmax = 0;
      size_t imax = 0;
      for (size_t i = 0; i < an.size(); ++i)
        if (std::fabs(an[i]) > gmax) gmax = std::fabs(an[i]), imax = i;
      if (gmax == 0.0 && name.find(".mlp.experts.") != std::string::npos) return;  // an expert no token used
      ASSERT_GT(gmax, 0.0) << name;
      routers += name.find(".mlp.gate.weight") != std::string::npos;
      double* data = p.data<double>();
      for (size_t i : {imax, an.size() / 3, (2 * an.size()) / 3 + 1, an.size() - 1}) {
        i = std::min(i, an.size() - 1);
        const double orig = data[i], h = 1e-5 * std::max(1.0, std::fabs(orig));
        data[i] = orig + h;
        const double lp = replay_loss(*be, w, b, replay, c);
        data[i] = orig - h;
        const double lm = replay_loss(*be, w, b, replay, c);
        data[i] = orig;
        const double fd = (lp - lm) / (2 * h);
        const double rel = std::fabs(fd - an[i]) / std::max({std::fabs(fd), std::fabs(an[i]), 1e-3 * gmax});
        EXPECT_LT(rel, 1e-5) << name << "[" << i << "]: finite difference " << fd << ", backward " << an[i];
        worst = std::max(worst, rel);
        ++checked;
      }
    });
    EXPECT_EQ(routers, 2) << "both routers get a gradient through the replayed weights";
    EXPECT_GT(checked, 100);
    RecordProperty(deepseek ? "worst_relative_error_deepseek" : "worst_relative_error_softmax", std::to_string(worst));
  }
}

// ---- the generator's record and the trainer's agreement --------------------------------------

struct Rollout {
  std::vector<RolloutSample> samples;
  std::vector<TrainSequence> seqs;
  std::vector<float> logp_gen;
  RolloutStats stats;
};

Rollout generate(Backend& be, const ModelWeights& master, const EnginePrecision& gen, int kv_pages, int n_prompts,
                 int n, int max_new, uint32_t seed) {
  RolloutEngine engine(be, master, gen, kv_pages, /*page_size=*/4, /*max_batch=*/16);
  std::vector<int> lengths;
  for (int i = 0; i < n_prompts; ++i) lengths.push_back(5 + (i * 3) % 8);
  const auto prompts = test::token_sequences(lengths, 48, seed);
  std::vector<RolloutRequest> reqs;
  for (const auto& p : prompts) reqs.push_back({p, n});
  SamplingParams sp;
  sp.max_new_tokens = max_new;
  sp.seed = seed;
  sp.record_routing = true;
  Rollout r;
  r.samples = engine.generate(reqs, sp);
  r.stats = engine.last_stats();
  for (const RolloutSample& s : r.samples) {
    TrainSequence t{reqs[s.request].prompt, static_cast<int>(reqs[s.request].prompt.size())};
    t.ids.insert(t.ids.end(), s.tokens.begin(), s.tokens.end());
    t.routing = s.routing;
    r.seqs.push_back(t);
    r.logp_gen.insert(r.logp_gen.end(), s.logp.begin(), s.logp.end());
  }
  return r;
}

// The record covers every position the generator ran (all but the last token) with valid,
// distinct expert ids, also with prefix sharing (prompts longer than a page, 3 samples each) and
// preemption (a pool too small for all sequences); an FP32 generator's routing is an FP32
// trainer's (agreement 1 at every scored position), and replaying it changes no log-prob.
TEST(MoeRoutingRecord, CoversEveryComputedPositionAndMatchesAnFp32Trainer) {
  auto be = make_cpu_backend();
  const EnginePrecision fp32 = fp32_precision();
  Trainer trainer(*be, model_weights_to_device(*be, tiny_moe(DType::F32, 41), DType::F32), fp32, TrainerOptions{});
  const ModelConfig& c = static_cast<const Trainer&>(trainer).master().config;
  const int64_t stride = int64_t(model_num_moe_layers(c)) * c.num_experts_per_tok;
  const Rollout r = generate(*be, trainer.master(), fp32, /*kv_pages=*/14, /*prompts=*/5, /*n=*/3, /*max_new=*/8, 3);
  EXPECT_GT(r.stats.prefix_shared_tokens, 0) << "prompts share pages";
  EXPECT_GT(r.stats.preemptions, 0) << "the pool is small enough to preempt";
  for (const TrainSequence& s : r.seqs) {
    ASSERT_EQ(static_cast<int64_t>(s.routing.size()), static_cast<int64_t>(s.ids.size()) * stride);
    for (size_t p = 0; p < s.ids.size(); ++p) {
      const int16_t* row = s.routing.data() + p * stride;
      if (p + 1 == s.ids.size()) {
        EXPECT_TRUE(std::all_of(row, row + stride, [](int16_t e) { return e == -1; })) << "the last token never ran";
        continue;
      }
      for (int64_t m = 0; m < stride / c.num_experts_per_tok; ++m)
        for (int j = 0; j < c.num_experts_per_tok; ++j) {
          const int16_t e = row[m * c.num_experts_per_tok + j];
          ASSERT_TRUE(e >= 0 && e < c.num_experts) << "position " << p;
          for (int i = 0; i < j; ++i) EXPECT_NE(row[m * c.num_experts_per_tok + i], e);
        }
    }
  }
  const ScoreResult sc = trainer.score(r.seqs, 1.0f, false, false);
  ASSERT_EQ(sc.routing_agreed.size(), r.logp_gen.size());
  EXPECT_EQ(sc.routing.pairs, static_cast<int64_t>(r.logp_gen.size()) * model_num_moe_layers(c));
  EXPECT_EQ(sc.routing.agreed, sc.routing.pairs);
  EXPECT_EQ(sc.routing.router_agreed, sc.routing.pairs);
  EXPECT_TRUE(std::all_of(sc.routing_agreed.begin(), sc.routing_agreed.end(), [](uint8_t a) { return a == 1; }));

  TrainerOptions replay;
  replay.routing_replay = true;
  Trainer replaying(*be, model_weights_to_device(*be, tiny_moe(DType::F32, 41), DType::F32), fp32, replay);
  const ScoreResult sr = replaying.score(r.seqs, 1.0f, false, false);
  EXPECT_EQ(sr.logp, sc.logp) << "replaying the trainer's own routing changes nothing";
}

// The routing record of an FP8 generator (FP8 linears, E4M3 KV cache) differs from an FP32
// trainer's at some (position, layer) pairs: agreement < 1 without replay. With routing replay
// the trainer uses the generator's experts: agreement exactly 1 by construction, while its
// router's own top-k still disagrees; the step trains through the replay; the mismatch split by
// agreement is larger where the routing differed.
TEST(MoeRoutingRecord, Fp8GeneratorAgreementBelowOneWithoutReplayExactlyOneWith) {
  auto be = make_cpu_backend();
  const ModelWeights host = tiny_moe(DType::F32, 42, false, /*experts=*/8, /*top_k=*/2, /*layers=*/4);
  EnginePrecision fp8;
  fp8.linear = LinearMode::FP8_BLOCK;
  fp8.kv_cache = DType::E4M3;
  const EnginePrecision fp32 = fp32_precision();
  Trainer plain(*be, model_weights_to_device(*be, host, DType::F32), fp32, TrainerOptions{});
  const Rollout r = generate(*be, plain.master(), fp8, /*kv_pages=*/256, /*prompts=*/8, /*n=*/2, /*max_new=*/16, 9);
  const ScoreResult s0 = plain.score(r.seqs, 1.0f, false, false);
  ASSERT_GT(s0.routing.pairs, 600);
  EXPECT_LT(s0.routing.agreed, s0.routing.pairs) << "FP8 generation flips some experts";
  EXPECT_GT(s0.routing.agreed, s0.routing.pairs / 2);
  EXPECT_EQ(s0.routing.router_agreed, s0.routing.agreed);

  TrainerOptions ro;
  ro.routing_replay = true;
  Trainer replay(*be, model_weights_to_device(*be, host, DType::F32), fp32, ro);
  const ScoreResult s1 = replay.score(r.seqs, 1.0f, false, false);
  EXPECT_EQ(s1.routing.pairs, s0.routing.pairs);
  EXPECT_EQ(s1.routing.agreed, s1.routing.pairs) << "replay: the trainer uses the generator's experts";
  EXPECT_LT(s1.routing.router_agreed, s1.routing.pairs) << "its router alone still disagrees";
  EXPECT_NE(s1.logp, s0.logp);

  const RoutingMetrics m0 = metrics_compute_routing(s0.logp, r.logp_gen, s0.routing_agreed, s0.routing.pairs,
                                                    s0.routing.agreed, s0.routing.router_agreed);
  const RoutingMetrics m1 = metrics_compute_routing(s1.logp, r.logp_gen, s1.routing_agreed, s1.routing.pairs,
                                                    s1.routing.agreed, s1.routing.router_agreed);
  EXPECT_LT(m0.agreement, 1.0);
  EXPECT_EQ(m1.agreement, 1.0);
  EXPECT_EQ(m1.agreed_token_fraction, 1.0);
  EXPECT_TRUE(std::isnan(m1.differs.token_mult_prob_error)) << "no token is left in the 'differs' group";
  EXPECT_GT(m0.differs.tokens, 0);
  EXPECT_GT(m0.differs.token_mult_prob_error, m0.agreed.token_mult_prob_error);
  RecordProperty("agreement_without_replay", std::to_string(m0.agreement));
  RecordProperty("mult_prob_error_agreed_differs", std::to_string(m0.agreed.token_mult_prob_error) + " / " +
                                                       std::to_string(m0.differs.token_mult_prob_error));
  RecordProperty("mult_prob_error_with_replay", std::to_string(m1.agreed.token_mult_prob_error));

  // An optimizer step through the replayed routing (scoring and update forwards replay alike).
  std::vector<float> logp_old = s1.logp;
  TokenLossFn loss = [&](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
    double l = 0;
    for (size_t i = 0; i < lp.size(); ++i) {
      EXPECT_EQ(lp[i], logp_old[i]) << "the update's forward is the replayed scoring forward";
      l -= lp[i] / lp.size();
      grad[i] = -1.0f / lp.size();
    }
    return l;
  };
  EXPECT_TRUE(replay.step(r.seqs, 1.0f, loss, 1e-3f).applied);
}

// fp8_e2e on the CPU: the trainer (FP8 linears, k/v rounded as the E4M3 cache with the
// rollout's scales) computes what the generator computed, so it routes every position as the
// generator did and replaying the record changes no log-prob and no gradient, bit for bit.
TEST(MoeRoutingRecord, Fp8EndToEndReplayIsANoOp) {
  auto be = make_cpu_backend();
  const ModelWeights host = tiny_moe(DType::F32, 44, false, 8, 2, 3);
  const PrecisionRecipe recipe = PrecisionRecipe::preset("fp8_e2e");
  TrainerOptions ro;
  ro.routing_replay = true;
  Trainer plain(*be, model_weights_to_device(*be, host, DType::F32), recipe.trainer, TrainerOptions{});
  Trainer replay(*be, model_weights_to_device(*be, host, DType::F32), recipe.trainer, ro);
  RolloutEngine engine(*be, plain.master(), recipe.generator, 128, 4, 16);
  KvScales scales;
  scales.k.assign(3, 0.01f);
  scales.v.assign(3, 0.004f);
  engine.refit(plain.master(), &scales);
  for (Trainer* t : {&plain, &replay}) t->set_kv_rounding(scales.k, scales.v);
  std::vector<RolloutRequest> reqs;
  for (const auto& p : test::token_sequences({9, 13, 6, 21}, 48, 12)) reqs.push_back({p, 3});
  SamplingParams sp;
  sp.max_new_tokens = 12;
  sp.seed = 4;
  sp.record_routing = true;
  std::vector<TrainSequence> seqs;
  for (const RolloutSample& s : engine.generate(reqs, sp)) {
    TrainSequence t{reqs[s.request].prompt, static_cast<int>(reqs[s.request].prompt.size())};
    t.ids.insert(t.ids.end(), s.tokens.begin(), s.tokens.end());
    t.routing = s.routing;
    seqs.push_back(t);
  }
  const ScoreResult a = plain.score(seqs, 1.0f, false, false), b = replay.score(seqs, 1.0f, false, false);
  EXPECT_EQ(a.routing.agreed, a.routing.pairs);
  EXPECT_EQ(b.logp, a.logp);
  // Every position the generator ran, prompt included, routes as the trainer does.
  ForwardOptions fo;
  fo.record_routing = true;
  fo.kv_round_k = scales.k;
  fo.kv_round_v = scales.v;
  const ModelWeights& w = static_cast<const Trainer&>(plain).master();
  const ModelConfig& c = w.config;
  const int64_t Lm = model_num_moe_layers(c), k = c.num_experts_per_tok;
  for (const TrainSequence& s : seqs) {
    const LogprobResult lr = model_forward_logprobs(*be, w, recipe.trainer, forward_batch_from_sequences({s.ids}), fo);
    for (size_t p = 0; p + 1 < s.ids.size(); ++p)
      for (int64_t m = 0; m < Lm; ++m)
        for (int64_t j = 0; j < k; ++j)
          ASSERT_EQ(lr.routing.ids[m][p * k + j], s.routing[(p * Lm + m) * k + j])
              << "position " << p << " layer " << m;
  }
  // One optimizer step on the rollout: the same loss, gradient norm and new weights. (A second
  // mini-batch of the same rollout would differ: the updated policy may route a token otherwise
  // while the replay keeps the rollout's experts — the point of the replay.)
  TokenLossFn loss = [](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
    double l = 0;
    for (size_t i = 0; i < lp.size(); ++i) l -= lp[i] / lp.size(), grad[i] = -1.0f / lp.size();
    return l;
  };
  const StepResult ra = plain.step(seqs, 1.0f, loss, 1e-2f), rb = replay.step(seqs, 1.0f, loss, 1e-2f);
  EXPECT_EQ(ra.loss, rb.loss);
  EXPECT_EQ(ra.grad_norm, rb.grad_norm);
  std::vector<std::vector<uint8_t>> wa, wb;
  model_for_each_parameter(const_cast<ModelWeights&>(static_cast<const Trainer&>(plain).master()),
                           [&](const std::string&, Tensor& t) { wa.push_back(bytes_of(*be, t)); });
  model_for_each_parameter(const_cast<ModelWeights&>(static_cast<const Trainer&>(replay).master()),
                           [&](const std::string&, Tensor& t) { wb.push_back(bytes_of(*be, t)); });
  EXPECT_TRUE(wa == wb) << "the replayed step updates the weights bitwise as the plain one";
}

// A record of the wrong size is refused with a clear message.
TEST(MoeRoutingRecord, RecordOfTheWrongSizeIsAnError) {
  auto be = make_cpu_backend();
  Trainer trainer(*be, model_weights_to_device(*be, tiny_moe(DType::F32, 43), DType::F32), fp32_precision(),
                  TrainerOptions{});
  TrainSequence s{{1, 2, 3, 4, 5}, 2};
  s.routing.assign(7, 0);
  EXPECT_THROW(trainer.score({s}, 1.0f, false, false), Error);
}

// ---- metrics --------------------------------------------------------------------------------

TEST(MoeRoutingMetrics, SplitByAgreement) {
  const std::vector<float> old = {-1.0f, -2.0f, -0.5f, -3.0f}, gen = {-1.0f, -2.5f, -0.5f, -2.0f};
  const std::vector<uint8_t> agreed = {1, 0, 1, 0};
  const RoutingMetrics m = metrics_compute_routing(old, gen, agreed, 10, 7, 6);
  EXPECT_DOUBLE_EQ(m.agreement, 0.7);
  EXPECT_DOUBLE_EQ(m.router_agreement, 0.6);
  EXPECT_DOUBLE_EQ(m.agreed_token_fraction, 0.5);
  EXPECT_EQ(m.agreed.tokens, 2);
  EXPECT_DOUBLE_EQ(m.agreed.token_mult_prob_error, 1.0);
  EXPECT_EQ(m.differs.tokens, 2);
  EXPECT_DOUBLE_EQ(m.differs.token_mult_prob_error, (std::exp(0.5) + std::exp(1.0)) / 2);
  const std::vector<uint8_t> two = {1, 0};
  EXPECT_THROW(metrics_compute_routing(old, gen, two, 10, 7, 6), Error);
  EXPECT_THROW(metrics_compute_routing(old, gen, agreed, 10, 11, 6), Error);
  const RoutingMetrics none = metrics_compute_routing({}, {}, {}, 0, 0, 0);
  EXPECT_TRUE(std::isnan(none.agreement) && std::isnan(none.agreed_token_fraction));

  StepMetrics sm;
  sm.step = 3;
  step_metrics_set_routing(sm, m);
  const std::string line = metrics_to_json_line(sm);
  for (const char* key :
       {"\"routing_agreement\":0.7", "\"router_topk_agreement\":0.6", "\"routing_agreed_token_fraction\":0.5",
        "\"token_mult_prob_error_routing_agreed\":1.0", "\"token_mult_prob_error_routing_differs\"",
        "\"gen_kl_error_routing_agreed\"", "\"gen_kl_error_routing_differs\""})
    EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
  EXPECT_NE(metrics_console_line(sm, 10).find("route 0.7000 (mult_err 1.0000/"), std::string::npos);
  EXPECT_EQ(metrics_to_json_line(StepMetrics{}).find("routing"), std::string::npos) << "dense models: no routing keys";
}

// The memory plan counts the rollout's routing record (host memory) for MoE models only.
TEST(MoeRoutingMetrics, MemoryPlanCountsTheRecord) {
  MemoryPlanInput in;
  in.model = tiny_moe(DType::F32, 1).config;  // 2 MoE layers, top-2
  in.kv_pages = 8;
  in.micro_batch_tokens = 1000;
  in.rollout_sequences = 32;
  in.rollout_positions = 100;
  const MemoryPlan p = memory_plan_compute(in);
  ASSERT_EQ(p.host.size(), 2u);
  EXPECT_EQ(p.host[0].bytes, 32 * 100 * 2 * 2 * 2);
  EXPECT_EQ(p.host[1].bytes, 3 * 1000 * 2 * 2 * 4);
  EXPECT_EQ(p.host_bytes(), p.host[0].bytes + p.host[1].bytes);
  in.model = test::tiny_model("qwen3", DType::F32, 1).config;
  EXPECT_TRUE(memory_plan_compute(in).host.empty()) << "dense: no routing";
}

// The host sort of a block's slots by expert (moe_sort_slots, moe_plan's reference) and its tile
// table, on a hand-checked case: slots 0..5 of experts {2, 0, 2, 1, 2, 0} (E = 4: expert 3 has no
// rows) sort to rows [1 5 | 3 | 0 2 4], each expert's slots in slot order; tiles of 2 rows.
TEST(MoeSlotSort, StableByExpertWithItsTiles) {
  const int32_t ex[] = {2, 0, 2, 1, 2, 0};
  const MoeSlotSort p = moe_sort_slots(ex, 6, 4);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 2, 3, 6, 6}));
  EXPECT_EQ(p.row_slot, (std::vector<int32_t>{1, 5, 3, 0, 2, 4}));
  EXPECT_EQ(p.slot_row, (std::vector<int32_t>{3, 0, 4, 2, 5, 1}));
  EXPECT_EQ(moe_tiles(p.offsets, 2), (std::vector<int32_t>{0, 0, 2, 0, 1, 2, 3, 0, 2, 3, 6, 0, 2, 5, 6, 0}));
  EXPECT_EQ(moe_plan_max_tiles(6, 4, 2), 3 + 4);
  const int32_t bad[] = {0, 4};
  EXPECT_THROW(moe_sort_slots(bad, 2, 4), Error);
}

}  // namespace
}  // namespace fp8rl
