// The lean optimizer (issue 15): AdamW with BF16 moments (backend/adamw_rule.h) against the F64
// reference, its two roundings (to nearest, stochastic), BF16 gradients accumulated with one
// rounding per op, and the trainer with each option against FP32 gradients and moments.
// Resuming with each option is tested end to end in test_rl_loop.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <tuple>

#include "backend/adamw_rule.h"
#include "model/transformer.h"
#include "rl/config.h"
#include "support/random_tensor.h"
#include "train/trainer.h"

namespace fp8rl {
namespace {

using test::random_tensor;
using test::values;

std::vector<uint16_t> bits16(const Tensor& t) {
  std::vector<uint16_t> out(t.numel());
  std::memcpy(out.data(), t.raw(), t.nbytes());
  return out;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Distance in BF16 ulps of two finite BF16 values of one sign (their bit patterns are ordered).
int ulps(uint16_t a, uint16_t b) { return std::abs(int(a & 0x7fff) - int(b & 0x7fff)) + (((a ^ b) & 0x8000) ? 1 : 0); }

Tensor as(const Tensor& t, DType d) { return from_float_vector(to_float_vector(t), t.shape(), d); }

// Moments that are BF16 values (so the F32 and the BF16 tensors start equal), v >= 0.
void bf16_moments(int64_t n, uint32_t seed, Tensor& m, Tensor& v) {
  m = as(random_tensor({n}, seed, DType::F32, 0.05), DType::BF16);
  std::vector<float> vv = to_float_vector(random_tensor({n}, seed + 1, DType::F32, 0.05));
  for (float& x : vv) x = x * x;
  v = from_float_vector(vv, {n}, DType::BF16);
}

TEST(LeanOptimizer, Bf16MomentsStepIsTheF64StepWithinOneUlp) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t n = 4096;
  AdamWParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.01f;
  p.step = 7;
  Tensor m16, v16;
  bf16_moments(n, 3, m16, v16);
  const Tensor w0 = random_tensor({n}, 1, DType::F32), g = random_tensor({n}, 2, DType::F32, 0.1);
  Tensor w32 = as(w0, DType::F32), m32 = as(m16, DType::F32), v32 = as(v16, DType::F32);
  be->adamw(w32, g, m32, v32, p);  // the reference: double math
  Tensor w = as(w0, DType::F32);
  be->adamw(w, g, m16, v16, p);
  const std::vector<uint16_t> mb = bits16(m16), vb = bits16(v16);
  const std::vector<uint16_t> mr = bits16(as(m32, DType::BF16)), vr = bits16(as(v32, DType::BF16));
  int worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = std::max({worst, ulps(mb[i], mr[i]), ulps(vb[i], vr[i])});
  EXPECT_LE(worst, 1) << "BF16 moments differ from the F64 step rounded to BF16 by more than one ulp";
  EXPECT_LT(test::rel_err(values(w), values(w32)), 1e-6);
}

TEST(LeanOptimizer, Bf16MomentsFollowTheSharedRuleBitwise) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t n = 1000;
  AdamWParams p;
  p.lr = 3e-4f;
  p.weight_decay = 0.1f;
  p.step = 2;
  p.grad_scale = 0.7f;
  for (bool sr : {false, true}) {
    p.stochastic_rounding = sr;
    p.rounding_key = 42;
    Tensor m, v;
    bf16_moments(n, 11, m, v);
    Tensor w = random_tensor({n}, 12, DType::F32);
    const Tensor g = random_tensor({n}, 13, DType::BF16, 0.1);
    std::vector<float> ew = to_float_vector(w), eg = to_float_vector(g);
    std::vector<uint16_t> em = bits16(m), ev = bits16(v);
    const AdamWScalars s = adamw_scalars(p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale);
    for (int64_t i = 0; i < n; ++i)
      adamw_bf16_moments_step(ew[i], eg[i], em[i], ev[i], s, sr, adamw_rounding_bits(42, p.step, i));
    be->adamw(w, g, m, v, p);
    EXPECT_EQ(to_float_vector(w), ew);
    EXPECT_EQ(bits16(m), em);
    EXPECT_EQ(bits16(v), ev);
  }
}

// Why stochastic rounding is offered: with beta2 = 0.999 and a zero gradient, v should decay by
// 1e-3 per step; to nearest it cannot (under half an ulp), stochastically it does on average.
TEST(LeanOptimizer, NearestCannotDecayVStochasticRoundingDoes) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t n = 1 << 16;
  for (bool sr : {false, true}) {
    Tensor w = from_float_vector(std::vector<float>(n, 1.0f), {n}), g = from_float_vector(std::vector<float>(n, 0.0f), {n});
    Tensor m = from_float_vector(std::vector<float>(n, 0.0f), {n}, DType::BF16);
    Tensor v = from_float_vector(std::vector<float>(n, 1.0f), {n}, DType::BF16);
    AdamWParams p;
    p.step = 100;
    p.stochastic_rounding = sr;
    p.rounding_key = 7;
    be->adamw(w, g, m, v, p);
    double mean = 0;
    for (float x : to_float_vector(v)) mean += x / double(n);
    if (!sr) EXPECT_EQ(mean, 1.0) << "to nearest, v = 0.999 rounds back to 1";
    else EXPECT_NEAR(mean, 0.999, 2e-4) << "stochastic rounding keeps E[v] = 0.999";
  }
}

TEST(LeanOptimizer, StochasticRoundingIsReproducibleAndKeyedByTensorAndStep) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t n = 512;
  auto run = [&](uint64_t key, int64_t step) {
    Tensor m, v;
    bf16_moments(n, 5, m, v);
    Tensor w = random_tensor({n}, 6, DType::F32);
    AdamWParams p;
    p.step = step;
    p.stochastic_rounding = true;
    p.rounding_key = key;
    be->adamw(w, random_tensor({n}, 8, DType::F32, 0.1), m, v, p);
    return bits16(m);
  };
  EXPECT_EQ(run(1, 3), run(1, 3));
  EXPECT_NE(run(1, 3), run(2, 3));
  EXPECT_NE(run(1, 3), run(1, 4));
  // Unbiased: 2^16 stochastic roundings of one value average to it.
  double mean = 0;
  const float x = 1.0f + 3.0f / 1024.0f;  // between two BF16 values (1 and 1 + 1/128)
  for (int64_t i = 0; i < (1 << 16); ++i) mean += adamw_bf16_to_float(adamw_bf16_stochastic(x, adamw_rounding_bits(9, 1, i) & 0xffffu));
  EXPECT_NEAR(mean / (1 << 16), x, 2e-5);
  EXPECT_EQ(adamw_bf16_stochastic(INFINITY, 0xffff), adamw_bf16_nearest(INFINITY));
  EXPECT_EQ(adamw_bf16_nearest(1.0f + 1.0f / 256.0f), adamw_bf16_nearest(1.0f));  // a tie: to even
}

// A BF16 gradient is read exactly (widened); grad_scale by a power of two equals a pre-scaled gradient.
TEST(LeanOptimizer, Bf16GradientsAndGradScaleAreExactInputs) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const int64_t n = 300;
  const Tensor g16 = random_tensor({n}, 21, DType::BF16, 0.1);
  std::vector<float> half = to_float_vector(g16);
  for (float& x : half) x *= 0.5f;
  for (DType md : {DType::F32, DType::BF16}) {
    auto step = [&](const Tensor& g, float scale) {
      Tensor w = random_tensor({n}, 22, DType::F32), m = as(random_tensor({n}, 23, DType::F32, 0.01), md);
      Tensor v = as(random_tensor({n}, 24, DType::F32, 0.0), md);
      AdamWParams p;
      p.grad_scale = scale;
      be->adamw(w, g, m, v, p);
      return std::vector<Tensor>{w, m, v};
    };
    const auto a = step(g16, 1.0f), b = step(as(g16, DType::F32), 1.0f);
    const auto c = step(g16, 0.5f), d = step(from_float_vector(half, {n}), 1.0f);
    for (int k = 0; k < 3; ++k) {
      EXPECT_TRUE(bitwise_equal(a[k], b[k])) << dtype_name(md) << " " << k;
      EXPECT_TRUE(bitwise_equal(c[k], d[k])) << dtype_name(md) << " " << k;
    }
  }
  Tensor w = random_tensor({4}, 1, DType::F32), m = random_tensor({4}, 2, DType::F32);
  Tensor v16 = random_tensor({4}, 3, DType::BF16);
  EXPECT_THROW(be->adamw(w, random_tensor({4}, 4, DType::F32), m, v16, AdamWParams{}), Error);  // m F32, v BF16
}

// A BF16 weight gradient gets each op's whole contribution added in double and rounded once:
// bitwise the F64 gradient of the same op rounded to BF16 (through F32, as the CPU stores BF16).
TEST(LeanOptimizer, Bf16GradientsRoundOncePerOp) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  auto check = [&](const char* what, const Tensor& start, const std::function<void(Tensor&)>& op) {
    Tensor g16 = as(start, DType::BF16), g64 = Tensor::empty(start.shape(), DType::F64);
    const std::vector<float> s = to_float_vector(g16);
    for (int64_t i = 0; i < g64.numel(); ++i) g64.data<double>()[i] = s[i];
    op(g16);
    op(g64);
    std::vector<float> want(g64.numel());
    for (int64_t i = 0; i < g64.numel(); ++i) want[i] = static_cast<float>(g64.data<double>()[i]);
    EXPECT_TRUE(bitwise_equal(g16, from_float_vector(want, start.shape(), DType::BF16))) << what;
  };
  const int64_t M = 37, N = 48, K = 64;
  const Tensor x = random_tensor({M, K}, 31, DType::F32), dy = random_tensor({M, N}, 32, DType::F32);
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK}) {
    LinearWeight W;
    W.w = random_tensor({N, K}, 33, DType::F32, 0.1);
    LinearSpec spec;
    spec.mode = mode;
    check(linear_mode_name(mode), random_tensor({N, K}, 34, DType::F32, 0.01),
          [&](Tensor& dw) { be->linear_backward(dy, x, W, spec, nullptr, &dw, nullptr); });
  }
  const Tensor w = random_tensor({K}, 35, DType::F32), rstd = random_tensor({M}, 36, DType::F32);
  check("rmsnorm dw", random_tensor({K}, 37, DType::F32, 0.01), [&](Tensor& dw) {
    Tensor dx = be->alloc({M, K}, DType::F32);
    be->rmsnorm_backward(random_tensor({M, K}, 38, DType::F32), x, w, rstd, dx, dw);
  });
  // Embedding: token ids repeat (each row gets several tokens' gradients, summed before rounding).
  const Tensor ids = test::i32_tensor({3, 1, 3, 3, 0, 1, 7});
  check("embedding dtable", from_float_vector(std::vector<float>(8 * K, 0.0f), {8, K}),
        [&](Tensor& dt) { be->embedding_backward(ids, random_tensor({7, K}, 39, DType::F32), dt); });
}

// The trainer with each option takes nearly the FP32 step (first steps, SFT-like loss), and keeps
// its gradients and moments in the asked dtype.
TEST(LeanOptimizer, TrainerOptionsTrackTheFp32Trainer) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  ModelConfig c = model_config_tiny("qwen3", 64, 128, 2, 4, 2, 256);
  RandomInit init;
  init.seed = 4;
  init.std = 0.08f;
  const ModelWeights host = model_weights_random(c, init, DType::F32);
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, 63);
  std::vector<TrainSequence> seqs;
  for (int len : {12, 9, 17, 5}) {
    TrainSequence s{std::vector<int32_t>(len), 2};
    for (int32_t& t : s.ids) t = tok(rng);
    seqs.push_back(s);
  }
  const TokenLossFn loss = [](size_t, size_t, const std::vector<float>& lp, std::vector<float>& grad) {
    double l = 0;
    for (size_t i = 0; i < lp.size(); ++i) {
      l -= lp[i] / 43.0;
      grad[i] = -1.0f / 43.0f;
    }
    return l;
  };
  const EnginePrecision prec = PrecisionRecipe::preset("bf16").trainer;
  auto train = [&](DType gd, DType md, bool sr) {
    TrainerOptions o;
    o.micro_batch_tokens = 20;  // several micro-batches: the BF16 gradient accumulates across them
    o.grad_dtype = gd;
    o.moment_dtype = md;
    o.stochastic_rounding = sr;
    Trainer t(*be, model_weights_to_device(*be, host, DType::F32), prec, o);
    std::vector<double> losses;
    for (int i = 0; i < 4; ++i) {
      const StepResult r = t.step(seqs, 1.0f, loss, 3e-3f);
      EXPECT_TRUE(r.applied);
      losses.push_back(r.loss);
    }
    for (const auto& [n, m] : t.optimizer_state()) EXPECT_EQ(m.dtype(), md) << n;
    return losses;
  };
  const std::vector<double> ref = train(DType::F32, DType::F32, false);
  EXPECT_LT(ref.back(), ref.front());
  for (auto [gd, md, sr] : {std::tuple{DType::BF16, DType::F32, false}, std::tuple{DType::F32, DType::BF16, false},
                            std::tuple{DType::F32, DType::BF16, true}, std::tuple{DType::BF16, DType::BF16, true}}) {
    const std::vector<double> l = train(gd, md, sr);
    for (size_t i = 0; i < l.size(); ++i)
      EXPECT_NEAR(l[i], ref[i], 2e-3 * std::fabs(ref[i])) << dtype_name(gd) << " grads, " << dtype_name(md)
                                                         << " moments, sr " << sr << ", step " << i;
  }
}

// The config keys: their values, and stochastic rounding only with BF16 moments.
TEST(LeanOptimizer, ConfigKeys) {
  RunConfig c;
  EXPECT_EQ(c.train.grad_dtype, "fp32");  // defaults: the FP32 optimizer
  EXPECT_EQ(c.train.optimizer_state_dtype, "fp32");
  EXPECT_EQ(c.train.optimizer_state_rounding, "nearest");
  config_apply_override(c, "train.grad_dtype=bf16");
  config_apply_override(c, "train.recompute=auto");
  EXPECT_THROW(config_apply_override(c, "train.optimizer_state_dtype=fp8"), Error);
  config_apply_override(c, "train.optimizer_state_rounding=stochastic");
  try {
    config_validate(c);
    ADD_FAILURE() << "stochastic rounding of FP32 moments was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.optimizer_state_dtype: bf16"), std::string::npos) << e.what();
  }
  config_apply_override(c, "train.optimizer_state_dtype=bf16");
  EXPECT_NO_THROW(config_validate(c));
}

}  // namespace
}  // namespace fp8rl
