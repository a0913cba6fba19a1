// Refit and KV-scale recalibration (issue 4): after a trainer step the generator's weights are
// exactly the requantized master weights, written in place; calibrated KV scales reach the
// engine's cache and change what it stores and computes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "rollout/rollout.h"
#include "test_model_util.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

// Byte equality of two tensors (any device of `be`), with dtype and shape.
bool same_bytes(Backend& be, const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  const Tensor ha = be.to_host(a), hb = be.to_host(b);
  return ha.dtype() == hb.dtype() && ha.shape() == hb.shape() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

// 3 blocks; gate/up [160, 64] span two 128-row blocks, padded.
ModelWeights refit_model(const std::string& family, uint64_t seed) {
  const ModelConfig c = model_config_tiny(family, /*vocab=*/48, /*hidden=*/64, /*layers=*/3, /*heads=*/4,
                                          /*kv_heads=*/2, /*intermediate=*/160);
  RandomInit init;
  init.seed = seed;
  init.std = 0.1f;
  init.bias_std = 0.05f;
  init.norm_jitter = 0.1f;
  return model_weights_random(c, init, DType::F32);
}

std::vector<const LinearWeight*> linears(const LayerWeights& l) {
  return {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down};
}

// Data pointers of every tensor the engine owns (generator weights and KV cache), in a fixed order.
std::vector<const void*> engine_pointers(const RolloutEngine& e) {
  std::vector<const void*> p;
  auto add = [&](const Tensor& t) { p.push_back(t.defined() ? t.raw() : nullptr); };
  const ModelWeights& g = e.weights();
  add(g.embed);
  add(g.final_norm);
  add(g.lm_head);
  for (const LayerWeights& l : g.layers) {
    add(l.attn_norm);
    add(l.mlp_norm);
    add(l.q_norm);
    add(l.k_norm);
    for (const LinearWeight* w : linears(l)) {
      add(w->w);
      add(w->wq.data);
      add(w->wq.scales);
      add(w->bias);
    }
  }
  const KvCache& kv = e.kv_cache();
  for (const Tensor& t : kv.k) add(t);
  for (const Tensor& t : kv.v) add(t);
  add(kv.k_scale);
  add(kv.v_scale);
  return p;
}

// The generator equals `master` in `prec`: FP8 linears byte for byte quantize_128x128(w, pow2),
// BF16-kept linears, norms, embeddings and biases copied exactly.
void expect_generator_is_master(Backend& be, const ModelWeights& master_dev, const RolloutEngine& e,
                                const EnginePrecision& prec) {
  const ModelWeights m = model_weights_to_host(be, master_dev, DType::F32);
  const ModelWeights& g = e.weights();
  const int L = m.config.num_layers;
  ASSERT_EQ(static_cast<int>(g.layers.size()), L);
  EXPECT_TRUE(same_bytes(be, m.embed, g.embed));
  EXPECT_TRUE(same_bytes(be, m.final_norm, g.final_norm));
  EXPECT_TRUE(same_bytes(be, m.lm_head, g.lm_head));
  int fp8_linears = 0;
  for (int l = 0; l < L; ++l) {
    const LayerWeights &ml = m.layers[l], &gl = g.layers[l];
    EXPECT_TRUE(same_bytes(be, ml.attn_norm, gl.attn_norm)) << "layer " << l;
    EXPECT_TRUE(same_bytes(be, ml.mlp_norm, gl.mlp_norm)) << "layer " << l;
    EXPECT_TRUE(same_bytes(be, ml.q_norm, gl.q_norm)) << "layer " << l;
    EXPECT_TRUE(same_bytes(be, ml.k_norm, gl.k_norm)) << "layer " << l;
    const auto ms = linears(ml), gs = linears(gl);
    for (size_t i = 0; i < ms.size(); ++i) {
      EXPECT_TRUE(same_bytes(be, ms[i]->bias, gs[i]->bias)) << "layer " << l << " linear " << i;
      if (prec.linear_for_layer(l, L) == LinearMode::FP8_BLOCK) {
        ++fp8_linears;
        ASSERT_TRUE(gs[i]->wq.defined()) << "layer " << l << " linear " << i;
        EXPECT_FALSE(gs[i]->w.defined());
        const QuantTensor want = quantize_128x128(ms[i]->w, prec.pow2_scales);
        EXPECT_EQ(gs[i]->wq.block_rows, kQuantBlock);
        EXPECT_EQ(gs[i]->wq.block_cols, kQuantBlock);
        EXPECT_EQ(gs[i]->wq.pow2, prec.pow2_scales);
        EXPECT_TRUE(same_bytes(be, want.data, gs[i]->wq.data)) << "layer " << l << " linear " << i;
        EXPECT_TRUE(same_bytes(be, want.scales, gs[i]->wq.scales)) << "layer " << l << " linear " << i;
      } else {
        EXPECT_FALSE(gs[i]->wq.defined()) << "layer " << l << " linear " << i;
        EXPECT_TRUE(same_bytes(be, ms[i]->w, gs[i]->w)) << "layer " << l << " linear " << i;
      }
    }
  }
  EXPECT_GT(fp8_linears, 0);
}

std::vector<TrainSequence> train_sequences(int vocab, uint32_t seed) {
  std::vector<TrainSequence> out;
  for (auto& ids : test::token_sequences({9, 7, 11}, vocab, seed)) out.push_back({ids, 3});
  return out;
}

// Maximize the log-likelihood of the response tokens (a loss that moves every weight).
constexpr auto nll_loss = test::mean_nll;

struct RefitCase {
  const char* family;
  bool pow2;
  int bf16_first, bf16_last;
};

class RefitTest : public ::testing::TestWithParam<RefitCase> {};

TEST_P(RefitTest, GeneratorIsRequantizedMasterAfterTrainerStepInPlace) {
  const RefitCase rc = GetParam();
  auto be = make_cpu_backend();
  EnginePrecision gen;
  gen.linear = LinearMode::FP8_BLOCK;
  gen.pow2_scales = rc.pow2;
  gen.bf16_first_layers = rc.bf16_first;
  gen.bf16_last_layers = rc.bf16_last;
  gen.kv_cache = DType::E4M3;
  EnginePrecision train;  // BF16 linears
  TrainerOptions opt;
  opt.weight_decay = 0.01f;
  Trainer trainer(*be, model_weights_to_device(*be, refit_model(rc.family, 7), DType::F32), train, opt);
  RolloutEngine engine(*be, trainer.master(), gen, /*kv_pages=*/8, /*page_size=*/16, /*max_batch=*/4);
  expect_generator_is_master(*be, trainer.master(), engine, gen);
  const std::vector<const void*> before = engine_pointers(engine);

  // The first FP8 layer's q projection, before the step.
  const int l8 = rc.bf16_first;
  const QuantTensor q_before = quantize_128x128(be->to_host(trainer.master().layers[l8].q.w), rc.pow2);
  const StepResult r = trainer.step(train_sequences(48, 3), 1.0f, nll_loss, /*lr=*/1e-2f);
  ASSERT_TRUE(r.applied) << r.skip_reason;
  // The step moved the quantized weights; the generator is stale until the refit.
  const QuantTensor q_after = quantize_128x128(be->to_host(trainer.master().layers[l8].q.w), rc.pow2);
  ASSERT_FALSE(same_bytes(*be, q_before.data, q_after.data)) << "the step did not move the weights enough";
  EXPECT_TRUE(same_bytes(*be, q_before.data, engine.weights().layers[l8].q.wq.data));
  EXPECT_FALSE(same_bytes(*be, trainer.master().embed, engine.weights().embed));

  engine.refit(trainer.master(), nullptr);
  expect_generator_is_master(*be, trainer.master(), engine, gen);
  EXPECT_EQ(before, engine_pointers(engine)) << "refit reallocated a generator or KV-cache buffer";

  // A refit engine generates exactly what an engine built from the new weights generates.
  RolloutEngine fresh(*be, trainer.master(), gen, 8, 16, 4);
  SamplingParams sp;
  sp.max_new_tokens = 5;
  sp.seed = 11;
  const std::vector<RolloutRequest> reqs = {{{1, 5, 9, 2}, 2}};
  const auto a = engine.generate(reqs, sp), b = fresh.generate(reqs, sp);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    EXPECT_EQ(a[i].logp, b[i].logp);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, RefitTest,
                         ::testing::Values(RefitCase{"qwen3", false, 1, 0}, RefitCase{"qwen3", true, 0, 1},
                                           RefitCase{"qwen2", true, 1, 1}, RefitCase{"llama", false, 0, 0}),
                         [](const auto& info) {
                           const RefitCase& c = info.param;
                           return std::string(c.family) + (c.pow2 ? "_pow2" : "") + "_first" +
                                  std::to_string(c.bf16_first) + "_last" + std::to_string(c.bf16_last);
                         });

// ---- KV-scale calibration ---------------------------------------------------------------------

TEST(KvCalibration, NearestRankPercentileTimesMarginOver448) {
  // 1000 micro-batches, 3 layers. Layer 0: amax 0.001..1.0 shuffled plus one outlier of 50 in
  // place of the largest; the 0.999 percentile is the 999th smallest sample (the outlier ignored).
  const int M = 1000;
  std::vector<float> l0(M);
  for (int i = 0; i < M; ++i) l0[i] = static_cast<float>(i + 1) * 0.001f;
  l0[M - 1] = 50.0f;
  std::vector<float> sorted0 = l0;
  std::sort(sorted0.begin(), sorted0.end());
  std::mt19937 rng(5);
  std::shuffle(l0.begin(), l0.end(), rng);
  std::vector<std::vector<float>> k(M, std::vector<float>(3)), v(M, std::vector<float>(3));
  for (int m = 0; m < M; ++m) {
    k[m] = {l0[m], 0.0f, 2.0f + 0.25f * static_cast<float>(m % 4)};  // layer 1 all zero: scale 1
    v[m] = {2.0f * l0[m], 3.0f, 0.5f};
  }
  const KvScales s = kv_scales_calibrate(k, v, 0.999f, 1.05f);
  ASSERT_EQ(s.k.size(), 3u);
  ASSERT_EQ(s.v.size(), 3u);
  EXPECT_FLOAT_EQ(s.k[0], sorted0[998] * 1.05f / 448.0f);
  EXPECT_LT(s.k[0], 50.0f * 1.05f / 448.0f);
  EXPECT_EQ(s.k[1], 1.0f);
  EXPECT_FLOAT_EQ(s.k[2], 2.75f * 1.05f / 448.0f);
  EXPECT_FLOAT_EQ(s.v[0], 2.0f * sorted0[998] * 1.05f / 448.0f);
  EXPECT_FLOAT_EQ(s.v[1], 3.0f * 1.05f / 448.0f);
  EXPECT_FLOAT_EQ(s.v[2], 0.5f * 1.05f / 448.0f);

  // percentile 1 = the maximum; 0.5 of 10 samples = the 5th smallest; another margin.
  std::vector<std::vector<float>> k10, v10;
  for (int m = 0; m < 10; ++m) {
    k10.push_back({static_cast<float>((m * 7) % 10 + 1)});  // a permutation of 1..10
    v10.push_back({static_cast<float>(m + 1) * 0.5f});
  }
  const KvScales p1 = kv_scales_calibrate(k10, v10, 1.0f, 1.0f);
  EXPECT_FLOAT_EQ(p1.k[0], 10.0f / 448.0f);
  EXPECT_FLOAT_EQ(p1.v[0], 5.0f / 448.0f);
  const KvScales p50 = kv_scales_calibrate(k10, v10, 0.5f, 1.25f);
  EXPECT_FLOAT_EQ(p50.k[0], 5.0f * 1.25f / 448.0f);
  EXPECT_FLOAT_EQ(p50.v[0], 2.5f * 1.25f / 448.0f);
}

// precision.pow2_scales: each scale the least power of two at or above the exact one (a layer
// whose amax is 0 keeps 1, itself a power of two).
TEST(KvCalibration, PowerOfTwoScalesRoundUp) {
  const std::vector<std::vector<float>> k = {{3.0f, 0.0f, 448.0f}, {2.0f, 0.0f, 224.0f}},
                                        v = {{0.001f, 7.5f, 1e-30f}, {0.002f, 7.0f, 1e-30f}};
  const KvScales e = kv_scales_calibrate(k, v, 1.0f, 1.0f), p = kv_scales_calibrate(k, v, 1.0f, 1.0f, true);
  ASSERT_EQ(p.k.size(), 3u);
  for (size_t l = 0; l < 3; ++l)
    for (const auto& [exact, pow2] : {std::pair{e.k[l], p.k[l]}, std::pair{e.v[l], p.v[l]}}) {
      int ex = 0;
      EXPECT_EQ(std::frexp(pow2, &ex), 0.5f) << "layer " << l << ": " << pow2 << " is not a power of two";
      EXPECT_GE(pow2, exact) << "layer " << l;
      EXPECT_LT(pow2, 2.0f * exact) << "layer " << l;
    }
  EXPECT_EQ(p.k[1], 1.0f);
  EXPECT_EQ(p.k[2], 1.0f);        // 448 / 448: already a power of two
  EXPECT_EQ(p.k[0], 0.0078125f);  // 3 / 448 = 0.0067 -> 2^-7
}

TEST(KvCalibration, RejectsBadInput) {
  const std::vector<std::vector<float>> ok = {{1.0f, 2.0f}}, nan = {{1.0f, std::nanf("")}}, short_ = {{1.0f}};
  EXPECT_THROW(kv_scales_calibrate({}, {}), Error);
  EXPECT_THROW(kv_scales_calibrate(ok, nan), Error);
  EXPECT_THROW(kv_scales_calibrate({{1.0f, 2.0f}, {1.0f}}, {{1.0f, 2.0f}, {1.0f, 2.0f}}), Error);
  EXPECT_THROW(kv_scales_calibrate(ok, short_), Error);
  EXPECT_THROW(kv_scales_calibrate(ok, ok, 0.0f), Error);
  EXPECT_THROW(kv_scales_calibrate(ok, ok, 0.9f, 0.0f), Error);
}

// Scales calibrated from the trainer's amax, installed by refit: they are what the engine
// reports, what its cache holds for every KV head, and what its generation uses.
TEST(KvCalibration, RefitInstallsScalesThatTheCacheUses) {
  auto be = make_cpu_backend();
  const ModelWeights host = test::tiny_model("qwen3", DType::F32, 21);
  EnginePrecision gen;
  gen.linear = LinearMode::FP32;
  gen.kv_cache = DType::E4M3;
  Trainer trainer(*be, model_weights_to_device(*be, host, DType::F32), gen, TrainerOptions{});
  const ScoreResult sr = trainer.score(train_sequences(48, 4), 1.0f, false, /*record_amax=*/true);
  const int L = host.config.num_layers, H = host.config.num_kv_heads;
  ASSERT_EQ(sr.k_amax.size(), 1u);
  ASSERT_EQ(static_cast<int>(sr.k_amax[0].size()), L);
  const KvScales a = kv_scales_calibrate(sr.k_amax, sr.v_amax, 0.999f, 1.05f);
  for (int l = 0; l < L; ++l) {
    EXPECT_FLOAT_EQ(a.k[l], sr.k_amax[0][l] * 1.05f / 448.0f);
    EXPECT_NE(a.k[l], 1.0f);
  }
  KvScales b = a;  // a coarser grid: 8x larger scales, distinct per layer
  for (int l = 0; l < L; ++l) {
    b.k[l] *= 8.0f + static_cast<float>(l);
    b.v[l] *= 6.0f + static_cast<float>(l);
  }

  RolloutEngine engine(*be, trainer.master(), gen, 8, 16, 8);
  SamplingParams sp;
  sp.max_new_tokens = 6;
  sp.seed = 3;
  const std::vector<RolloutRequest> reqs = {{{4, 8, 15, 16, 23, 42, 7, 1, 30}, 2}};
  auto logps = [&] {
    std::vector<float> out;
    for (const RolloutSample& s : engine.generate(reqs, sp)) out.insert(out.end(), s.logp.begin(), s.logp.end());
    return out;
  };

  engine.refit(trainer.master(), &a);
  const KvScales got = engine.kv_scales();
  EXPECT_EQ(got.k, a.k);
  EXPECT_EQ(got.v, a.v);
  const Tensor ks = be->to_host(engine.kv_cache().k_scale), vs = be->to_host(engine.kv_cache().v_scale);
  ASSERT_EQ(ks.numel(), static_cast<int64_t>(L) * H);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      EXPECT_EQ(ks.data<float>()[l * H + h], a.k[l]);
      EXPECT_EQ(vs.data<float>()[l * H + h], a.v[l]);
    }
  const std::vector<float> lp_a = logps();
  EXPECT_EQ(lp_a, logps()) << "generation is not deterministic: the comparison below means nothing";

  engine.refit(trainer.master(), &b);
  EXPECT_EQ(engine.kv_scales().k, b.k);
  EXPECT_EQ(engine.kv_scales().v, b.v);
  const std::vector<float> lp_b = logps();
  ASSERT_EQ(lp_a.size(), lp_b.size());
  EXPECT_NE(lp_a, lp_b) << "the E4M3 cache ignores the KV scales installed by refit";

  // A KV write with the new scales stores e4m3(x / scale), bit for bit (engine cache, layer 1).
  const int layer = 1, hd = host.config.head_dim, T = 5;
  KvCache cache = engine.kv_cache();  // shares the engine's buffers
  std::vector<float> kx(T * H * hd), vx(T * H * hd);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (auto& x : kx) x = nd(rng);
  for (auto& x : vx) x = nd(rng);
  auto i32 = [](std::vector<int32_t> v, Shape s) {
    Tensor t = Tensor::empty(s, DType::I32);
    std::copy(v.begin(), v.end(), t.data<int32_t>());
    return t;
  };
  const std::vector<int32_t> slots = {16, 17, 18, 19, 20};  // page 1, offsets 0..4
  PagedBatch pb;
  pb.token_seq = be->to_device(i32({0, 0, 0, 0, 0}, {T}));
  pb.token_pos = be->to_device(i32({0, 1, 2, 3, 4}, {T}));
  pb.slots = be->to_device(i32(slots, {T}));
  pb.page_table = be->to_device(i32({1}, {1, 1}));
  pb.max_pos = T;
  be->kv_write(cache, layer, be->to_device(from_float_vector(kx, {T, H, hd})),
               be->to_device(from_float_vector(vx, {T, H, hd})), pb);
  const Tensor kc = be->to_host(cache.k[layer]), vc = be->to_host(cache.v[layer]);
  ASSERT_EQ(kc.dtype(), DType::E4M3);
  int mismatches = 0, nonzero = 0;
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H * hd; ++i) {
      const int64_t at = static_cast<int64_t>(slots[t]) * H * hd + i;
      const uint8_t want_k = e4m3_from_float(kx[t * H * hd + i] / b.k[layer]);
      const uint8_t want_v = e4m3_from_float(vx[t * H * hd + i] / b.v[layer]);
      mismatches += kc.data<uint8_t>()[at] != want_k;
      mismatches += vc.data<uint8_t>()[at] != want_v;
      nonzero += (want_k & 0x7F) != 0;
    }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(nonzero, T * H * hd / 2);
}

TEST(KvCalibration, RefitRejectsBadScales) {
  auto be = make_cpu_backend();
  const ModelWeights host = test::tiny_model("qwen3", DType::F32, 22);
  EnginePrecision gen;
  gen.linear = LinearMode::FP32;
  gen.kv_cache = DType::E4M3;
  const ModelWeights dev = model_weights_to_device(*be, host, DType::F32);
  RolloutEngine engine(*be, dev, gen, 4, 16, 4);
  KvScales wrong_layers{{1.0f}, {1.0f}};
  EXPECT_THROW(engine.refit(dev, &wrong_layers), Error);
  KvScales zero{{1.0f, 0.0f}, {1.0f, 1.0f}};
  EXPECT_THROW(engine.refit(dev, &zero), Error);
}

}  // namespace
}  // namespace fp8rl
