// The fused producers of FP8 linear inputs (backend.h, Fp8View) on the CPU reference: each is
// bitwise its unfused form followed by the reference quantizer; linears given a view compute
// bitwise what they compute without; a view of another tensor is refused. And the BF16 wgrad
// option of FP8 linears (precision.trainer_wgrad).
#include <gtest/gtest.h>

#include <cstring>

#include "backend/backend.h"
#include "core/precision.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "quant/quant.h"
#include "rl/config.h"
#include "support/random_tensor.h"
#include "test_model_util.h"

namespace fp8rl::test {
namespace {

std::vector<uint8_t> bytes(const Tensor& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.raw());
  return std::vector<uint8_t>(p, p + t.numel() * dtype_size(t.dtype()));
}

// The view equals quantize_1x128(out) bit for bit (row-major scales on the CPU).
void expect_view_is_quantization(const Fp8View& v, const Tensor& out, bool pow2) {
  const int64_t D = out.dim(-1);
  const QuantTensor ref = quantize_1x128(out.reshape({out.numel() / D, D}), pow2);
  ASSERT_TRUE(v.defined());
  EXPECT_FALSE(v.scales_gemm_layout);
  EXPECT_EQ(v.source, out.raw());
  EXPECT_EQ(v.q.pow2, pow2);
  EXPECT_EQ(bytes(v.q.data), bytes(ref.data));
  EXPECT_EQ(bytes(v.q.scales), bytes(ref.scales));
}

class FusedFp8 : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
};

// Widths: a partial last block (200), a multiple of 128 (256), under one block (72).
TEST_F(FusedFp8, RmsnormFp8IsRmsnormThenQuantize) {
  for (int64_t D : {200, 256, 72}) {
    for (bool pow2 : {false, true}) {
      const int64_t R = 7;
      const Tensor x = random_tensor({R, D}, 1 + D, DType::F32, 3.0), w = random_tensor({D}, 2 + D, DType::F32);
      Tensor out = be->alloc({R, D}, DType::F32), ref = be->alloc({R, D}, DType::F32);
      Tensor rstd = be->alloc({R}, DType::F32), rstd_ref = be->alloc({R}, DType::F32);
      Fp8View v = be->alloc_fp8_view(R, D, pow2);
      be->rmsnorm_fp8(x, w, 1e-6f, out, &rstd, v);
      be->rmsnorm(x, w, 1e-6f, ref, &rstd_ref);
      EXPECT_EQ(bytes(out), bytes(ref));
      EXPECT_EQ(bytes(rstd), bytes(rstd_ref));
      expect_view_is_quantization(v, out, pow2);
    }
  }
}

TEST_F(FusedFp8, AddRmsnormIsAddThenRmsnormThenQuantize) {
  const int64_t R = 5, D = 200;
  const Tensor a = random_tensor({R, D}, 3, DType::F32), b = random_tensor({R, D}, 4, DType::F32);
  const Tensor w = random_tensor({D}, 5, DType::F32);
  Tensor sum = be->alloc({R, D}, DType::F32), out = be->alloc({R, D}, DType::F32), rstd = be->alloc({R}, DType::F32);
  Tensor sum_ref = be->alloc({R, D}, DType::F32), out_ref = be->alloc({R, D}, DType::F32);
  Tensor rstd_ref = be->alloc({R}, DType::F32);
  be->add(a, b, sum_ref);
  be->rmsnorm(sum_ref, w, 1e-5f, out_ref, &rstd_ref);
  Fp8View v = be->alloc_fp8_view(R, D, false);
  be->add_rmsnorm(a, b, sum, w, 1e-5f, out, &rstd, &v);
  EXPECT_EQ(bytes(sum), bytes(sum_ref));
  EXPECT_EQ(bytes(out), bytes(out_ref));
  EXPECT_EQ(bytes(rstd), bytes(rstd_ref));
  expect_view_is_quantization(v, out, false);
  // Without a view, and with sum aliasing a (the residual stream updated in place).
  Tensor a2 = be->alloc({R, D}, DType::F32);
  be->copy(a, a2);
  be->add_rmsnorm(a2, b, a2, w, 1e-5f, out, nullptr, nullptr);
  EXPECT_EQ(bytes(a2), bytes(sum_ref));
  EXPECT_EQ(bytes(out), bytes(out_ref));
}

TEST_F(FusedFp8, SwigluFp8IsSwigluThenQuantize) {
  for (bool pow2 : {false, true}) {
    const int64_t R = 6, F = 328;
    const Tensor g = random_tensor({R, F}, 6, DType::F32, 2.0), u = random_tensor({R, F}, 7, DType::F32);
    Tensor out = be->alloc({R, F}, DType::F32), ref = be->alloc({R, F}, DType::F32);
    Fp8View v = be->alloc_fp8_view(R, F, pow2);
    be->swiglu_fp8(g, u, out, v);
    be->swiglu(g, u, ref);
    EXPECT_EQ(bytes(out), bytes(ref));
    expect_view_is_quantization(v, out, pow2);
  }
}

TEST_F(FusedFp8, AddFp8IsAddThenQuantize) {
  for (bool pow2 : {false, true}) {
    const int64_t R = 5, D = 200;
    const Tensor a = random_tensor({R, D}, 30, DType::F32), b = random_tensor({R, D}, 31, DType::F32);
    Tensor out = be->alloc({R, D}, DType::F32), ref = be->alloc({R, D}, DType::F32);
    Fp8View v = be->alloc_fp8_view(R, D, pow2);
    be->add_fp8(a, b, out, v);
    be->add(a, b, ref);
    EXPECT_EQ(bytes(out), bytes(ref));
    expect_view_is_quantization(v, out, pow2);
    Tensor a2 = be->alloc({R, D}, DType::F32);  // out aliasing a
    be->copy(a, a2);
    be->add_fp8(a2, b, a2, v);
    EXPECT_EQ(bytes(a2), bytes(ref));
    expect_view_is_quantization(v, a2, pow2);
  }
}

TEST_F(FusedFp8, SwigluBackwardFp8IsSwigluBackwardThenQuantize) {
  for (bool pow2 : {false, true}) {
    const int64_t R = 6, F = 328;
    const Tensor d = random_tensor({R, F}, 21, DType::F32), g = random_tensor({R, F}, 22, DType::F32, 2.0);
    const Tensor u = random_tensor({R, F}, 23, DType::F32);
    Tensor dg = be->alloc({R, F}, DType::F32), du = be->alloc({R, F}, DType::F32);
    Tensor dg_ref = be->alloc({R, F}, DType::F32), du_ref = be->alloc({R, F}, DType::F32);
    Fp8View vg = be->alloc_fp8_view(R, F, pow2), vu = be->alloc_fp8_view(R, F, pow2);
    be->swiglu_backward_fp8(d, g, u, dg, du, vg, vu);
    be->swiglu_backward(d, g, u, dg_ref, du_ref);
    EXPECT_EQ(bytes(dg), bytes(dg_ref));
    EXPECT_EQ(bytes(du), bytes(du_ref));
    expect_view_is_quantization(vg, dg, pow2);
    expect_view_is_quantization(vu, du, pow2);
  }
}

// linear_backward with dy's FP8 view and/or the cached W^T (wqt): bitwise the dx of quantizing
// dy and transposing W itself; dw and dbias do not read them.
TEST_F(FusedFp8, LinearBackwardWithViewAndWqtIsBitwiseWithout) {
  const int64_t M = 9, K = 200, N = 328;
  for (bool pow2 : {false, true})
    for (LinearMode wgrad : {LinearMode::FP8_BLOCK, LinearMode::BF16}) {
      const LinearSpec spec{LinearMode::FP8_BLOCK, pow2, wgrad};
      const Tensor x = random_tensor({M, K}, 24, DType::F32), d = random_tensor({M, N}, 25, DType::F32);
      const Tensor g = random_tensor({M, N}, 26, DType::F32, 2.0), u = random_tensor({M, N}, 27, DType::F32);
      Tensor dy = be->alloc({M, N}, DType::F32), dy2 = be->alloc({M, N}, DType::F32);
      Fp8View v = be->alloc_fp8_view(M, N, pow2), v2 = be->alloc_fp8_view(M, N, pow2);
      be->swiglu_backward_fp8(d, g, u, dy, dy2, v, v2);
      LinearWeight W;
      W.w = random_tensor({N, K}, 28, DType::F32);
      W.bias = random_tensor({N}, 29, DType::F32);
      LinearWeight cached = W;
      cached.wq = quantize_128x128(W.w, pow2);
      cached.wqt = be->alloc_quant(K, N, kQuantBlock, kQuantBlock, pow2);
      be->quantize(W.w, /*transpose=*/true, cached.wqt);
      EXPECT_EQ(bytes(cached.wqt.data), bytes(transpose_128x128(cached.wq).data));
      EXPECT_EQ(bytes(cached.wqt.scales), bytes(transpose_128x128(cached.wq).scales));
      auto grads = [&](const LinearWeight& w, const Fp8View* view) {
        Tensor dx = be->alloc({M, K}, DType::F32), dw = Tensor::zeros({N, K}, DType::F32);
        Tensor db = Tensor::zeros({N}, DType::F32);
        be->linear_backward(dy, x, w, spec, &dx, &dw, &db, view);
        return std::vector<std::vector<uint8_t>>{bytes(dx), bytes(dw), bytes(db)};
      };
      const auto ref = grads(W, nullptr);
      EXPECT_EQ(grads(W, &v), ref);
      EXPECT_EQ(grads(cached, nullptr), ref);
      EXPECT_EQ(grads(cached, &v), ref);
      LinearWeight only_q = cached;  // the quantized weights alone
      only_q.w = Tensor();
      only_q.bias = Tensor();
      Tensor dx = be->alloc({M, K}, DType::F32), dx_ref = be->alloc({M, K}, DType::F32);
      be->linear_backward(dy, x, only_q, spec, &dx, nullptr, nullptr, &v);
      be->linear_backward(dy, x, W, spec, &dx_ref, nullptr, nullptr);
      EXPECT_EQ(bytes(dx), bytes(dx_ref));
      EXPECT_THROW(be->linear_backward(dy, x, W, spec, &dx, nullptr, nullptr, &v2), Error);  // dup's view
    }
}

TEST_F(FusedFp8, ProducerRefusesAViewOfAnotherShape) {
  const Tensor x = random_tensor({4, 200}, 8, DType::F32), w = random_tensor({200}, 9, DType::F32);
  Tensor out = be->alloc({4, 200}, DType::F32);
  Fp8View v = be->alloc_fp8_view(4, 256, false);
  EXPECT_THROW(be->rmsnorm_fp8(x, w, 1e-6f, out, nullptr, v), Error);
  Fp8View none;
  EXPECT_THROW(be->rmsnorm_fp8(x, w, 1e-6f, out, nullptr, none), Error);
}

// linear / linear_shared_input with the producer's view: bitwise the same outputs.
TEST_F(FusedFp8, LinearWithViewIsBitwiseLinearWithout) {
  const int64_t M = 9, K = 200, N1 = 130, N2 = 64;
  for (bool pow2 : {false, true}) {
    const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
    const Tensor x = random_tensor({M, K}, 10, DType::F32), nw = random_tensor({K}, 11, DType::F32);
    LinearWeight W1, W2;
    W1.w = random_tensor({N1, K}, 12, DType::F32);
    W2.w = random_tensor({N2, K}, 13, DType::F32);
    W2.bias = random_tensor({N2}, 14, DType::F32);
    Tensor xn = be->alloc({M, K}, DType::F32);
    Fp8View v = be->alloc_fp8_view(M, K, pow2);
    be->rmsnorm_fp8(x, nw, 1e-6f, xn, nullptr, v);
    Tensor a1 = be->alloc({M, N1}, DType::F32), a2 = be->alloc({M, N2}, DType::F32);
    Tensor b1 = be->alloc({M, N1}, DType::F32), b2 = be->alloc({M, N2}, DType::F32);
    be->linear_shared_input(xn, {&W1, &W2}, spec, {&a1, &a2});
    be->linear_shared_input(xn, {&W1, &W2}, spec, {&b1, &b2}, &v);
    EXPECT_EQ(bytes(a1), bytes(b1));
    EXPECT_EQ(bytes(a2), bytes(b2));
    be->linear(xn, W1, spec, b1, &v);
    EXPECT_EQ(bytes(a1), bytes(b1));
    // Other modes ignore the view.
    const LinearSpec bf16{LinearMode::BF16, pow2};
    be->linear(xn, W1, bf16, a1);
    be->linear(xn, W1, bf16, b1, &v);
    EXPECT_EQ(bytes(a1), bytes(b1));
  }
}

TEST_F(FusedFp8, LinearRefusesAStaleOrMismatchedView) {
  const int64_t M = 4, K = 128, N = 32;
  const Tensor x = random_tensor({M, K}, 15, DType::F32), nw = random_tensor({K}, 16, DType::F32);
  LinearWeight W;
  W.w = random_tensor({N, K}, 17, DType::F32);
  Tensor xn = be->alloc({M, K}, DType::F32), other = be->alloc({M, K}, DType::F32), y = be->alloc({M, N}, DType::F32);
  Fp8View v = be->alloc_fp8_view(M, K, false);
  be->rmsnorm_fp8(x, nw, 1e-6f, xn, nullptr, v);
  be->copy(xn, other);
  EXPECT_THROW(be->linear(other, W, {LinearMode::FP8_BLOCK, false}, y, &v), Error);  // not made from `other`
  EXPECT_THROW(be->linear(xn, W, {LinearMode::FP8_BLOCK, true}, y, &v), Error);      // pow2 differs
  EXPECT_NO_THROW(be->linear(xn, W, {LinearMode::FP8_BLOCK, false}, y, &v));
}

// BF16 wgrad of an FP8 linear: dx as the FP8 linear's, dw (and dbias) as the BF16 linear's.
TEST_F(FusedFp8, Bf16WgradIsTheBf16WeightGradient) {
  const int64_t M = 11, N = 130, K = 200;
  const Tensor x = random_tensor({M, K}, 18, DType::F32), dy = random_tensor({M, N}, 19, DType::F32);
  LinearWeight W;
  W.w = random_tensor({N, K}, 20, DType::F32);
  auto grads = [&](const LinearSpec& spec, std::vector<double>& gx, std::vector<double>& gw) {
    Tensor dx = be->alloc({M, K}, DType::F32), dw = Tensor::zeros({N, K}, DType::F32);
    be->linear_backward(dy, x, W, spec, &dx, &dw, nullptr);
    gx = values(dx);
    gw = values(dw);
  };
  std::vector<double> dx8, dw8, dxb, dwb, dxm, dwm;
  grads({LinearMode::FP8_BLOCK, false}, dx8, dw8);
  grads({LinearMode::BF16, false}, dxb, dwb);
  grads({LinearMode::FP8_BLOCK, false, LinearMode::BF16}, dxm, dwm);
  EXPECT_EQ(dxm, dx8);
  EXPECT_EQ(dwm, dwb);
  EXPECT_NE(dwm, dw8);
  // A BF16 linear ignores the key.
  grads({LinearMode::BF16, false, LinearMode::BF16}, dxm, dwm);
  EXPECT_EQ(dwm, dwb);
}

// Through the model: with trainer.wgrad = bf16 the dgrad chain is the FP8 one, so every
// gradient that is not a block linear's weight (norms, embedding, lm_head) is bitwise the
// fp8-wgrad one; the linears' weight gradients differ and are closer to the FP32 ones.
TEST(ModelGrad, Bf16WgradChangesOnlyTheLinearWeightGradients) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, tiny_model("qwen3", DType::F32, 11, 48), DType::F32);
  // hidden 64 / intermediate 96 are under one block: still real FP8 (padded blocks).
  const ForwardBatch batch = forward_batch_from_sequences(token_sequences({9, 5}, w.config.vocab_size, 5));
  const int64_t T = batch.num_tokens();
  Tensor dlogp = Tensor::empty({T}, DType::F32);
  for (int64_t t = 0; t < T; ++t) dlogp.data<float>()[t] = 1.0f;
  auto grads_under = [&](LinearMode mode, LinearMode wgrad) {
    EnginePrecision p;
    p.linear = mode;
    p.wgrad = wgrad;
    Activations acts;
    model_forward_logprobs(*be, w, p, batch, ForwardOptions{}, &acts);
    ModelWeights g = model_grads_alloc(*be, w);
    model_backward(*be, w, p, acts, be->to_device(dlogp), g);
    std::vector<std::pair<std::string, std::vector<double>>> all;
    model_for_each_parameter(g, [&](const std::string& name, Tensor& t) { all.push_back({name, values_f64(*be, t)}); });
    return all;
  };
  const auto ref = grads_under(LinearMode::FP32, LinearMode::FP8_BLOCK);
  const auto g8 = grads_under(LinearMode::FP8_BLOCK, LinearMode::FP8_BLOCK);
  const auto gb = grads_under(LinearMode::FP8_BLOCK, LinearMode::BF16);
  ASSERT_EQ(g8.size(), gb.size());
  double e8 = 0, eb = 0, n = 0;
  int linears = 0;
  for (size_t i = 0; i < g8.size(); ++i) {
    const std::string& name = g8[i].first;
    const bool block_linear = name.find("_proj.weight") != std::string::npos;
    if (!block_linear) {
      EXPECT_EQ(g8[i].second, gb[i].second) << name;
      continue;
    }
    ++linears;
    EXPECT_NE(g8[i].second, gb[i].second) << name;
    for (size_t j = 0; j < ref[i].second.size(); ++j) {
      const double r = ref[i].second[j];
      e8 += (g8[i].second[j] - r) * (g8[i].second[j] - r);
      eb += (gb[i].second[j] - r) * (gb[i].second[j] - r);
      n += r * r;
    }
  }
  EXPECT_EQ(linears, 2 * 7);
  EXPECT_LT(eb, e8) << "BF16 wgrad error " << std::sqrt(eb / n) << " vs FP8 " << std::sqrt(e8 / n);
}

// Through the model: the FP8 dgrad's operands from their producers (the SwiGLU backward's FP8
// copies of dgate and dup, the residual adds' of o's and down's dY; the trainer's cached W^T)
// leave every gradient bitwise what it was
// with each linear_backward quantizing dy and W^T itself (BackwardOptions::fused_dy_fp8 false,
// weights without wq / wqt: the path before them). Intermediate 320: three 128-blocks, the last
// partial; pow2 scales, both wgrads, a BF16 first block.
TEST(ModelGrad, Fp8DgradOperandsFromProducersLeaveGradientsBitwise) {
  auto be = make_cpu_backend();
  const ModelConfig c = model_config_tiny("qwen3", 48, /*hidden=*/128, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2,
                                          /*intermediate=*/320);
  RandomInit init;
  init.seed = 12;
  init.std = 0.15f;
  const ModelWeights w = model_weights_to_device(*be, model_weights_random(c, init, DType::F32), DType::F32);
  const ForwardBatch batch = forward_batch_from_sequences(token_sequences({9, 5}, c.vocab_size, 5));
  const int64_t T = batch.num_tokens();
  Tensor dlogp = Tensor::empty({T}, DType::F32);
  for (int64_t t = 0; t < T; ++t) dlogp.data<float>()[t] = 0.5f + 0.25f * static_cast<float>(t % 3);
  for (int variant = 0; variant < 3; ++variant) {
    EnginePrecision p;
    p.linear = LinearMode::FP8_BLOCK;
    p.pow2_scales = variant == 1;
    p.wgrad = variant == 2 ? LinearMode::FP8_BLOCK : LinearMode::BF16;
    p.bf16_first_layers = variant == 2 ? 1 : 0;
    SCOPED_TRACE("variant " + std::to_string(variant));
    // The trainer's compute weights: wq and wqt of every FP8 linear (Trainer::compute_weights).
    ModelWeights cached = w;
    int with_wqt = 0;
    model_for_each_linear(cached, [&](const std::string& name, int layer, LinearWeight& lw) {
      if (model_linear_mode(c, p, name, layer, lw) != LinearMode::FP8_BLOCK) return;
      lw.wq = quantize_128x128(lw.w, p.pow2_scales);
      lw.wqt = be->alloc_quant(lw.w.dim(1), lw.w.dim(0), kQuantBlock, kQuantBlock, p.pow2_scales);
      be->quantize(lw.w, /*transpose=*/true, lw.wqt);
      ++with_wqt;
    });
    EXPECT_EQ(with_wqt, 7 * (variant == 2 ? 1 : 2));
    auto grads = [&](const ModelWeights& weights, bool fused) {
      Activations acts;
      model_forward_logprobs(*be, weights, p, batch, ForwardOptions{}, &acts);
      ModelWeights g = model_grads_alloc(*be, w);
      BackwardOptions bo;
      bo.fused_dy_fp8 = fused;
      model_backward(*be, weights, p, acts, be->to_device(dlogp), g, bo);
      std::vector<std::pair<std::string, std::vector<uint8_t>>> all;
      model_for_each_parameter(g, [&](const std::string& name, Tensor& t) { all.push_back({name, bytes(t)}); });
      return all;
    };
    const auto before = grads(w, false);
    const auto now = grads(cached, true);
    ASSERT_EQ(before.size(), now.size());
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(before[i] == now[i]) << before[i].first;
    EXPECT_TRUE(grads(w, true) == before);  // the fused SwiGLU backward alone
  }
}

TEST(PrecisionRecipe, Bf16WgradSpecAndConfigKey) {
  const PrecisionRecipe base = PrecisionRecipe::preset("fp8_e2e");
  EXPECT_EQ(base.trainer.wgrad, LinearMode::BF16);  // the preset's choice (measured faster on the H200)
  const PrecisionRecipe r = PrecisionRecipe::parse("fp8_e2e:wgrad=bf16");
  EXPECT_EQ(r.name, "fp8_e2e:wgrad=bf16");
  EXPECT_EQ(r.trainer.wgrad, LinearMode::BF16);
  EXPECT_EQ(r.trainer.linear, LinearMode::FP8_BLOCK);
  EXPECT_EQ(r.generator.kv_cache, DType::E4M3);
  EXPECT_EQ(PrecisionRecipe::parse("fp8_e2e:kv=bf16+wgrad=bf16").trainer.wgrad, LinearMode::BF16);
  EXPECT_EQ(PrecisionRecipe::parse("fp8_e2e:wgrad=fp8").trainer.wgrad, LinearMode::FP8_BLOCK);
  EXPECT_THROW(PrecisionRecipe::parse("fp8_e2e:wgrad=fp32"), Error);

  RunConfig c;
  EXPECT_EQ(config_precision_recipe(c.precision).trainer.wgrad, LinearMode::BF16);  // auto: the preset's
  config_apply_override(c, "precision.trainer_wgrad=fp8");
  config_validate(c);
  const PrecisionRecipe cr = config_precision_recipe(c.precision);
  EXPECT_EQ(cr.trainer.wgrad, LinearMode::FP8_BLOCK);
  EXPECT_EQ(cr.name, "fp8_e2e+custom");
  EXPECT_THROW(config_apply_override(c, "precision.trainer_wgrad=fp16"), Error);
}

}  // namespace
}  // namespace fp8rl::test
