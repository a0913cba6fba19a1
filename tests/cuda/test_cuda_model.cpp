// The whole model on the GPU against the CPU reference backend, and against Hugging Face.
//
// Models: the committed fixture checkpoints (tests/data/fixtures/{llama,qwen2,qwen3}: hidden
// 128 / 160 / 96, head_dim 32 / 40 / 48, larger-than-HF-init weights) and one "sharp" random
// model per family (hidden 256, head_dim 64, weights ~N(0, 0.15^2)). Batches are ragged and
// packed: three sequences of 24 / 32 / 40 tokens plus sequences of 1, 47 and 128 tokens
// (T = 272, a multiple of 16, so FP8 linears with K % 128 == 0 take cuBLASLt's block-scaled
// path; the others, e.g. down with K = 192, the dequantized fallback).
//
// Checked for LinearMode FP32, BF16 and FP8_BLOCK, on two GPU backends:
//   F32 activations (make_cuda_backend(0, F32), the exact path; FP8 products there are FP32
//   GEMMs of the dequantized operands) and BF16 activations (the default fast path, cuBLASLt
//   FP8 tensor cores);
//   - scoring forward: logp, entropy and q/k/v amax (model_forward_logprobs);
//   - backward: the gradient of every parameter (model_backward, random dlogp);
//   - paged generation: a ragged prefill chunk then two decode steps (model_forward_paged),
//     logits of every token, KV cache F32 / BF16 / E4M3 (with FP8 attention).
// Tolerances by class. The exact class (F32 activations, FP32 linears) is tight: FP32
// accumulation-order noise only (measured on the H200: logp <= 2e-5, gradients <= 1e-5
// relative), on the fixtures and on the sharp models. The quantized classes (BF16 / FP8
// linears, BF16 activations) are dominated by rounding-boundary flips: where the two backends'
// FP32 values differ by an ulp, a BF16 / E4M3 rounding can go the other way, and these random
// models amplify it. A CPU-only experiment shows the size: a 1-ulp random perturbation of the
// q/k/v weights moves the CPU's own fixture logp by up to 1e-2 (BF16 linears) and 5e-2 (FP8),
// mean 2e-3. So those classes run on the fixtures only (the sharp models are chaotic there),
// with bounds about 2-3x the values measured on the H200 (docs/benchmarks.md, "CUDA model
// parity"): they catch broken kernels and layouts (O(1) errors, NaN), not ulp-level drift,
// which the op-level tests (test_cuda_ops.cpp) check on identical inputs.
// And against HF: model_forward_logprobs on the F32-activation GPU backend versus reference.json
// ("fp32": mean |diff| < 2e-4; "fp8" / "fp8_pow2" emulation: < 1e-2), as the CPU test does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "../cpu/test_model_util.h"
#include "cuda_model_util.h"
#include "backend/backend.h"
#include "core/error.h"
#include "support/test_support.h"
#include "model/transformer.h"
#include "model/weights.h"

namespace fp8rl {
namespace {

using test::compare;
using test::Diff;
using test::env;
using test::fixtures_dir;
using test::values_f64;

bool load_reference(nlohmann::json& ref) {
  std::ifstream f(fixtures_dir() + "/reference.json");
  if (!f) return false;
  ref = nlohmann::json::parse(f);
  return true;
}

// Tolerances of one (activation dtype, linear mode) class.
struct Tol {
  double logp_max_abs, logp_mean_abs;  // scoring log-probs
  double rel;                          // gradients, logits, amax: max |a - b| / max |b|
  double deepgemm;                     // gradients, logits: DeepGEMM similarity
};

Tol tolerance(DType act, LinearMode mode) {
  if (act == DType::BF16) {
    if (mode == LinearMode::FP8_BLOCK) return {0.6, 0.15, 0.5, 4e-2};
    return {0.1, 2e-2, 6e-2, 1e-3};
  }
  switch (mode) {
    case LinearMode::FP32: return {1e-4, 2e-5, 2e-4, 1e-8};
    case LinearMode::BF16: return {3e-2, 5e-3, 3e-2, 1e-4};
    case LinearMode::FP8_BLOCK: return {0.3, 5e-2, 0.2, 1e-2};
  }
  return {};
}

// The exact class; the others are flip-dominated and run on the fixtures only (see the top).
bool exact_class(DType act, LinearMode mode) { return act == DType::F32 && mode == LinearMode::FP32; }

std::string case_name(const std::string& model, DType act, LinearMode mode) {
  return model + " act " + dtype_name(act) + " linear " + linear_mode_name(mode);
}

// ---- models and batches --------------------------------------------------------------------------

struct ModelCase {
  std::string name;
  bool sharp = false;  // a "sharp" random model: exact class only
  ModelWeights host;  // F32 on the host
  std::vector<std::vector<int32_t>> seqs;
};

std::vector<std::vector<int32_t>> ragged_batch(std::vector<std::vector<int32_t>> base, int vocab, uint32_t seed) {
  for (auto& s : test::token_sequences({1, 47, 128}, vocab, seed)) base.push_back(s);
  return base;
}

std::vector<ModelCase> model_cases(bool fixtures_only = false) {
  std::vector<ModelCase> out;
  nlohmann::json ref;
  if (load_reference(ref)) {
    for (const char* family : {"llama", "qwen2", "qwen3"}) {
      const auto& m = ref["models"][family];
      ModelCase c;
      c.name = std::string("fixture ") + family;
      c.host = model_weights_load(fixtures_dir() + "/" + m["dir"].get<std::string>(), DType::F32);
      c.seqs = ragged_batch(m["sequences"].get<std::vector<std::vector<int32_t>>>(), c.host.config.vocab_size, 3);
      out.push_back(std::move(c));
    }
  } else {
    ADD_FAILURE() << fixtures_dir() << "/reference.json is missing (set FP8RL_TEST_DATA to tests/data)";
  }
  if (fixtures_only) return out;
  uint64_t seed = 11;
  for (const char* family : {"llama", "qwen2", "qwen3"}) {
    ModelConfig mc = model_config_tiny(family, 512, /*hidden=*/256, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2,
                                       /*intermediate=*/512);
    RandomInit init;
    init.seed = seed++;
    init.std = 0.15f;
    init.bias_std = 0.1f;
    init.norm_jitter = 0.2f;
    ModelCase c;
    c.name = std::string("sharp ") + family;
    c.sharp = true;
    c.host = model_weights_random(mc, init, DType::F32);
    c.seqs = ragged_batch(test::token_sequences({24, 32, 40}, 512, 5), 512, 6);
    out.push_back(std::move(c));
  }
  // Mixture of experts (qwen3_moe): exact class only for now. In the other classes a token whose
  // top-k experts are nearly tied may route differently on the GPU than on the CPU, which is a
  // real and expected mismatch; its metrics split by routing agreement are still to be written.
  {
    ModelConfig mc = model_config_tiny("qwen3_moe", 512, /*hidden=*/256, /*layers=*/3, /*heads=*/4,
                                       /*kv_heads=*/2, /*intermediate=*/512);
    mc.num_experts = 8;
    mc.num_experts_per_tok = 2;
    mc.moe_intermediate_size = 192;
    RandomInit init;
    init.seed = seed++;
    init.std = 0.15f;
    init.norm_jitter = 0.2f;
    ModelCase c;
    c.name = "sharp qwen3_moe";
    c.sharp = true;
    c.host = model_weights_random(mc, init, DType::F32);
    c.seqs = ragged_batch(test::token_sequences({24, 32, 40}, 512, 7), 512, 8);
    out.push_back(std::move(c));
  }
  if (std::filesystem::exists(fixtures_dir() + "/qwen3_moe_np/config.json")) {
    ModelCase c;
    c.name = "fixture qwen3_moe_np";
    c.sharp = true;
    c.host = model_weights_load(fixtures_dir() + "/qwen3_moe_np", DType::F32);
    c.seqs = ragged_batch(test::token_sequences({24, 32, 40}, c.host.config.vocab_size, 9), c.host.config.vocab_size, 10);
    out.push_back(std::move(c));
  }
  return out;
}

// Every parameter tensor of a gradient struct, by HF name.
std::vector<std::pair<std::string, std::vector<double>>> grad_tensors(Backend& be, const ModelWeights& g) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  model_for_each_parameter(g, [&](const std::string& name, const Tensor& t) {
    out.emplace_back(name, values_f64(be, t));
  });
  return out;
}

EnginePrecision precision_of(LinearMode m) {
  EnginePrecision p;
  p.linear = m;
  return p;
}

// ---- scoring forward and backward ----------------------------------------------------------------

struct CpuResult {
  std::vector<double> logp, entropy;
  std::vector<float> q_amax, k_amax, v_amax;
  std::vector<std::pair<std::string, std::vector<double>>> grads;
};

CpuResult run_model(Backend& be, const ModelCase& mc, LinearMode mode, const std::vector<float>& dlogp_host) {
  const ModelWeights w = model_weights_to_device(be, mc.host, DType::F32);  // FP32 master, as the trainer
  const ForwardBatch batch = forward_batch_from_sequences(mc.seqs);
  ForwardOptions opt;
  opt.entropy = true;
  opt.record_qkv_amax = true;
  Activations acts;
  const EnginePrecision prec = precision_of(mode);
  const LogprobResult r = model_forward_logprobs(be, w, prec, batch, opt, &acts);
  CpuResult out;
  out.logp = values_f64(be, r.logp);
  out.entropy = values_f64(be, r.entropy);
  out.q_amax = r.q_amax;
  out.k_amax = r.k_amax;
  out.v_amax = r.v_amax;
  ModelWeights g = model_grads_alloc(be, w, DType::F32);
  const Tensor dl = be.to_device(from_float_vector(dlogp_host, {static_cast<int64_t>(dlogp_host.size())}, DType::F32));
  model_backward(be, w, prec, acts, dl, g);
  out.grads = grad_tensors(be, g);
  return out;
}

double amax_rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]) / std::max(double(std::fabs(b[i])), 1e-30));
  return worst;
}

TEST(CudaModel, ScoringAndBackwardMatchCpu) {
  const std::vector<ModelCase> cases = model_cases();
  std::mt19937 gen(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const ModelCase& mc : cases)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK}) {
      if (mc.sharp && mode != LinearMode::FP32) continue;
      const ForwardBatch batch = forward_batch_from_sequences(mc.seqs);
      std::vector<float> dlogp(batch.num_tokens());
      for (float& x : dlogp) x = nd(gen);
      const CpuResult ref = run_model(*env().cpu, mc, mode, dlogp);
      for (Backend* gpu : {env().gpu32.get(), env().gpu16.get()}) {
        const DType act = gpu->act_dtype();
        if (mc.sharp && !exact_class(act, mode)) continue;
        const std::string what = case_name(mc.name, act, mode);
        SCOPED_TRACE(what);
        const Tol tol = tolerance(act, mode);
        const CpuResult got = run_model(*gpu, mc, mode, dlogp);
        const Diff lp = compare(got.logp, ref.logp), en = compare(got.entropy, ref.entropy);
        std::printf("  %-40s logp max %.2e mean %.2e | entropy rel %.2e", what.c_str(), lp.max_abs, lp.mean_abs,
                    en.rel);
        EXPECT_LT(lp.max_abs, tol.logp_max_abs) << "logp";
        EXPECT_LT(lp.mean_abs, tol.logp_mean_abs) << "logp";
        EXPECT_LT(en.rel, tol.rel) << "entropy";
        const double am = std::max({amax_rel(got.q_amax, ref.q_amax), amax_rel(got.k_amax, ref.k_amax),
                                    amax_rel(got.v_amax, ref.v_amax)});
        EXPECT_LT(am, tol.rel) << "q/k/v amax";
        ASSERT_EQ(got.grads.size(), ref.grads.size());
        double worst_rel = 0, worst_dg = 0;
        std::string worst_name;
        for (size_t i = 0; i < ref.grads.size(); ++i) {
          ASSERT_EQ(got.grads[i].first, ref.grads[i].first);
          const Diff d = compare(got.grads[i].second, ref.grads[i].second);
          EXPECT_LT(d.rel, tol.rel) << "gradient of " << ref.grads[i].first << " (DeepGEMM " << d.deepgemm << ")";
          EXPECT_LT(d.deepgemm, tol.deepgemm) << "gradient of " << ref.grads[i].first << " (rel " << d.rel << ")";
          if (d.rel > worst_rel) worst_rel = d.rel, worst_name = ref.grads[i].first;
          worst_dg = std::max(worst_dg, d.deepgemm);
        }
        std::printf(" | amax rel %.2e | grads worst rel %.2e (%s) DeepGEMM %.2e\n", am, worst_rel,
                    worst_name.c_str(), worst_dg);
      }
    }
}

// ---- flash attention inside the model ------------------------------------------------------------

using test::ScopedEnv;

// The BF16-activation backend's tensor-core flash attention (head_dim 64 and 128, GQA 4) in the
// whole model: scoring forward and backward against the CPU, in the BF16-activation class
// (FP32 linears), on random llama models with HF-like init (std 0.02, not the chaotic sharp
// models) and sequences of 1, 17, 64, 130 and 300 tokens. The simple kernels
// (FP8RL_CUDA_ATTENTION=simple) run the same comparison, as the scale of this class here.
TEST(CudaModel, FlashAttentionScoringAndBackwardMatchCpu) {
  std::mt19937 gen(91);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct ModelShape {
    int hidden, heads, kv_heads;
  };
  uint64_t seed = 40;
  for (const ModelShape sh : {ModelShape{256, 4, 1}, ModelShape{512, 4, 1}}) {
    ModelCase mc;
    mc.name = "random llama head_dim " + std::to_string(sh.hidden / sh.heads);
    RandomInit init;
    init.seed = seed++;
    mc.host = model_weights_random(
        model_config_tiny("llama", 512, sh.hidden, /*layers=*/2, sh.heads, sh.kv_heads, /*intermediate=*/512), init,
        DType::F32);
    mc.seqs = test::token_sequences({1, 17, 64, 130, 300}, 512, 8);
    const ForwardBatch batch = forward_batch_from_sequences(mc.seqs);
    std::vector<float> dlogp(batch.num_tokens());
    for (float& x : dlogp) x = nd(gen);
    const CpuResult ref = run_model(*env().cpu, mc, LinearMode::FP32, dlogp);
    const Tol tol = tolerance(DType::BF16, LinearMode::FP32);
    struct Errs {
      double logp_max = 0, logp_mean = 0, grad_rel = 0, grad_dg = 0;
    } errs[2];
    const char* modes[2] = {"simple", "flash"};
    for (int mi = 0; mi < 2; ++mi) {
      const std::string what = mc.name + " attention " + modes[mi];
      SCOPED_TRACE(what);
      ScopedEnv env_mode("FP8RL_CUDA_ATTENTION", modes[mi]);
      const CpuResult got = run_model(*env().gpu16, mc, LinearMode::FP32, dlogp);
      const Diff lp = compare(got.logp, ref.logp);
      Errs& e = errs[mi];
      e.logp_max = lp.max_abs;
      e.logp_mean = lp.mean_abs;
      std::string worst_name;
      ASSERT_EQ(got.grads.size(), ref.grads.size());
      for (size_t i = 0; i < ref.grads.size(); ++i) {
        const Diff d = compare(got.grads[i].second, ref.grads[i].second);
        if (d.rel > e.grad_rel) e.grad_rel = d.rel, worst_name = ref.grads[i].first;
        e.grad_dg = std::max(e.grad_dg, d.deepgemm);
      }
      std::printf("  %-44s logp max %.2e mean %.2e | grads worst rel %.2e (%s) DeepGEMM %.2e\n", what.c_str(),
                  e.logp_max, e.logp_mean, e.grad_rel, worst_name.c_str(), e.grad_dg);
    }
    // The flash path within the BF16-activation class bounds, or (should this model amplify
    // rounding flips more than the fixtures do) within 2x the simple kernels' own distance to
    // the CPU; a broken kernel is O(1) off either way.
    const Errs& s = errs[0];
    const Errs& f = errs[1];
    EXPECT_LT(f.logp_max, std::max(tol.logp_max_abs, 2 * s.logp_max)) << "logp max";
    EXPECT_LT(f.logp_mean, std::max(tol.logp_mean_abs, 2 * s.logp_mean)) << "logp mean";
    EXPECT_LT(f.grad_rel, std::min(0.5, std::max(tol.rel, 2 * s.grad_rel))) << "gradients max-rel";
    EXPECT_LT(f.grad_dg, std::max(tol.deepgemm, 2 * s.grad_dg)) << "gradients DeepGEMM";
  }
}

// ---- paged generation --------------------------------------------------------------------------

Tensor i32_tensor(Backend& be, const std::vector<int32_t>& v) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), h.data<int32_t>());
  return be.to_device(h);
}

// Sequence b's page j is page j * B + b (pages interleaved between sequences).
PagedBatch make_paged(Backend& be, int B, int page_size, int max_pages, const std::vector<int32_t>& seq,
                      const std::vector<int32_t>& pos) {
  PagedBatch pb;
  std::vector<int32_t> table(B * max_pages), slots;
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < max_pages; ++j) table[b * max_pages + j] = j * B + b;
  int max_pos = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    const int page = table[seq[i] * max_pages + pos[i] / page_size];
    slots.push_back(page * page_size + pos[i] % page_size);
    max_pos = std::max(max_pos, pos[i] + 1);
  }
  pb.token_seq = i32_tensor(be, seq);
  pb.token_pos = i32_tensor(be, pos);
  pb.slots = i32_tensor(be, slots);
  Tensor t = Tensor::empty({B, max_pages}, DType::I32);
  std::copy(table.begin(), table.end(), t.data<int32_t>());
  pb.page_table = be.to_device(t);
  pb.max_pos = max_pos;
  return pb;
}

// A ragged prefill (each sequence's first min(len, 20) tokens, all in one call), then two decode
// steps; returns the logits of every token of every call, concatenated. head_dtype: the logits
// as the generator allocates them (model_logits_dtype) instead of F32.
std::vector<double> run_paged(Backend& be, const ModelCase& mc, const EnginePrecision& prec,
                              bool head_dtype = false) {
  const ModelWeights w = model_weights_to_device(be, mc.host, DType::F32);
  const int B = static_cast<int>(mc.seqs.size()), page_size = 16, max_pages = 4;
  KvCache cache = model_alloc_kv_cache(be, w.config, B * max_pages, page_size, prec.kv_cache);
  if (prec.kv_cache == DType::E4M3) {  // calibrated-looking scales (not 1): amax / 448 of a plausible range
    be.fill(cache.k_scale, 4.0f / 448.0f);
    be.fill(cache.v_scale, 2.0f / 448.0f);
  }
  std::vector<double> all;
  const int prefill = 20;
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> seq, pos, ids, rows;
    for (int b = 0; b < B; ++b) {
      const int n = static_cast<int>(mc.seqs[b].size());
      const int begin = step == 0 ? 0 : prefill - 1 + step, end = step == 0 ? std::min(prefill, n) : begin + 1;
      for (int p = begin; p < end && p < n; ++p) {
        seq.push_back(b), pos.push_back(p), ids.push_back(mc.seqs[b][p]);
        rows.push_back(static_cast<int32_t>(ids.size()) - 1);
      }
    }
    if (ids.empty()) break;
    const PagedBatch pb = make_paged(be, B, page_size, max_pages, seq, pos);
    Tensor logits = be.alloc({static_cast<int64_t>(rows.size()), w.config.vocab_size},
                             head_dtype ? model_logits_dtype(be, w, prec) : DType::F32);
    be.fill(logits, NAN);
    model_forward_paged(be, w, prec, cache, i32_tensor(be, ids), pb, i32_tensor(be, rows), logits);
    const std::vector<double> v = values_f64(be, logits);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

// BF16 activations: the generator's logits are the head GEMM's BF16 output written as it is
// (model_logits_dtype), the same values as the F32 logits (its exact widening), bf16 / fp8_e2e.
TEST(CudaModel, PagedGenerationBf16LogitsAreTheF32Logits) {
  Backend& gpu = *env().gpu16;
  for (const ModelCase& mc : model_cases())
    for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK}) {
      if (mc.sharp) continue;  // the BF16 cases of the other tests
      const EnginePrecision prec = precision_of(mode);
      SCOPED_TRACE(case_name(mc.name, DType::BF16, mode));
      const ModelWeights w = model_weights_to_device(gpu, mc.host, DType::F32);
      ASSERT_EQ(model_logits_dtype(gpu, w, prec), DType::BF16);
      const std::vector<double> f32 = run_paged(gpu, mc, prec), head = run_paged(gpu, mc, prec, true);
      ASSERT_EQ(f32.size(), head.size());
      int64_t differ = 0;
      for (size_t i = 0; i < f32.size(); ++i) differ += f32[i] != head[i];
      EXPECT_EQ(differ, 0) << "of " << f32.size() << " logits";
    }
}

TEST(CudaModel, PagedGenerationMatchesCpu) {
  const std::vector<ModelCase> cases = model_cases();
  for (const ModelCase& mc : cases)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK})
      for (Backend* gpu : {env().gpu32.get(), env().gpu16.get()}) {
        const DType act = gpu->act_dtype();
        if (mc.sharp && !exact_class(act, mode)) continue;
        // The cache follows the activations (F32 / BF16); FP8 linears also run the FP8 cache
        // with FP8 attention (the fp8_e2e generator).
        std::vector<std::pair<DType, bool>> kvs = {{act, false}};
        if (mode == LinearMode::FP8_BLOCK) kvs.push_back({DType::E4M3, true});
        for (const auto& [kv, fp8_attn] : kvs) {
          EnginePrecision prec = precision_of(mode);
          prec.kv_cache = kv;
          prec.fp8_attention = fp8_attn;
          const std::string what = case_name(mc.name, act, mode) + " kv " + dtype_name(kv);
          SCOPED_TRACE(what);
          const std::vector<double> ref = run_paged(*env().cpu, mc, prec);
          const std::vector<double> got = run_paged(*gpu, mc, prec);
          const Diff d = compare(got, ref);
          Tol tol = tolerance(act, mode);
          if (kv == DType::E4M3) tol = tolerance(DType::BF16, mode);  // E4M3 k/v: rounded like BF16 activations
          std::printf("  %-48s logits rel %.2e DeepGEMM %.2e\n", what.c_str(), d.rel, d.deepgemm);
          EXPECT_LT(d.rel, tol.rel) << "logits";
          EXPECT_LT(d.deepgemm, std::max(tol.deepgemm, 1e-8)) << "logits";
        }
      }
}

// ---- against Hugging Face --------------------------------------------------------------------------

TEST(CudaModel, LogprobsMatchHfReference) {
  nlohmann::json ref;
  ASSERT_TRUE(load_reference(ref)) << fixtures_dir() << "/reference.json is missing";
  Backend& be = *env().gpu32;
  struct Ref {
    const char* key;
    LinearMode mode;
    bool pow2;
    double max_mad;
  };
  for (const char* family : {"llama", "qwen2", "qwen3"})
    for (const Ref& r : {Ref{"fp32", LinearMode::FP32, false, 2e-4}, Ref{"fp8", LinearMode::FP8_BLOCK, false, 1e-2},
                         Ref{"fp8_pow2", LinearMode::FP8_BLOCK, true, 1e-2}}) {
      SCOPED_TRACE(std::string(family) + " " + r.key);
      const auto& m = ref["models"][family];
      const auto seqs = m["sequences"].get<std::vector<std::vector<int32_t>>>();
      const auto want = m["logprobs"][r.key].get<std::vector<std::vector<double>>>();
      const ModelWeights host = model_weights_load(fixtures_dir() + "/" + m["dir"].get<std::string>(), DType::F32);
      const ModelWeights w = model_weights_to_device(be, host, DType::F32);
      EnginePrecision p = precision_of(r.mode);
      p.pow2_scales = r.pow2;
      const ForwardBatch batch = forward_batch_from_sequences(seqs);
      const std::vector<double> got = values_f64(be, model_forward_logprobs(be, w, p, batch, {}).logp);
      double sum = 0, worst = 0;
      size_t n = 0;
      for (size_t s = 0; s < seqs.size(); ++s)
        for (size_t t = 0; t + 1 < seqs[s].size(); ++t) {
          const double d = std::fabs(got[batch.cu_seqlens[s] + t] - want[s][t]);
          sum += d, worst = std::max(worst, d), ++n;
        }
      std::printf("  HF %-6s %-8s mean |diff| %.3e worst %.3e over %zu tokens\n", family, r.key, sum / n, worst, n);
      EXPECT_LT(sum / n, r.max_mad);
    }
}

}  // namespace
}  // namespace fp8rl
