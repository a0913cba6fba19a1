// Padded vocabularies (issue 11): a model whose vocabulary is larger than its tokenizer's (Qwen:
// 151936 rows over 151669 ids). The ids past the tokenizer's are never sampled (Backend::sample's
// valid_vocab), decoding never throws in the middle of a run, and `fp8rl generate` on such a
// checkpoint samples, says once that the model is padded, and succeeds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "rl/session.h"
#include "rollout/rollout.h"
#include "test_model_util.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

Tensor logits_tensor(const std::vector<float>& v, int64_t B, int64_t V) { return from_float_vector(v, {B, V}); }

// Rows whose padding ids [Vv, V) hold the largest logits (and -inf): sampling with valid_vocab =
// Vv draws the token of sampling the first Vv columns alone, never a padding id; its logp is
// the log-prob before truncation, normalized over all V ids (the trainer's log-prob).
TEST(PaddedVocab, CpuSampleMasksIdsPastValidVocab) {
  auto be = make_cpu_backend();
  const int64_t B = 6, V = 50, Vv = 37;
  std::mt19937 gen(11);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> full(B * V), cut(B * Vv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < V; ++j) {
      float x = nd(gen);
      if (j >= Vv) x = j % 3 == 0 ? 6.0f + x : (j % 3 == 1 ? -INFINITY : x);
      full[b * V + j] = x;
      if (j < Vv) cut[b * Vv + j] = x;
    }
  const std::vector<float> temp = {1.0f, 0.0f, 0.7f, 1.3f, 1.0f, 1.0f}, top_p = {1, 1, 0.9f, 1, 0.5f, 1};
  const std::vector<int> top_k = {0, 0, 0, 5, 0, 100};
  const std::vector<float> u = {0.3f, 0.5f, 0.0f, 0.99999f, 0.7f, 0.999f};
  Tensor t1 = Tensor::empty({B}, DType::I32), l1 = Tensor::empty({B}, DType::F32);
  Tensor t2 = Tensor::empty({B}, DType::I32), l2 = Tensor::empty({B}, DType::F32);
  be->sample(logits_tensor(full, B, V), temp, top_p, top_k, u, t1, l1, Vv);
  be->sample(logits_tensor(cut, B, Vv), temp, top_p, top_k, u, t2, l2);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t tok = t1.data<int32_t>()[b];
    EXPECT_LT(tok, Vv) << "row " << b;
    EXPECT_EQ(tok, t2.data<int32_t>()[b]) << "row " << b;
    if (temp[b] == 0) {
      EXPECT_EQ(l1.data<float>()[b], 0.0f);
      continue;
    }
    double mx = -INFINITY, s = 0;  // log-softmax over all V at the token
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, double(full[b * V + j]) / temp[b]);
    for (int64_t j = 0; j < V; ++j) s += std::exp(double(full[b * V + j]) / temp[b] - mx);
    EXPECT_NEAR(l1.data<float>()[b], double(full[b * V + tok]) / temp[b] - mx - std::log(s), 1e-5) << "row " << b;
  }
  // > V is refused; NaN in the padding is an error (it is read for logp).
  EXPECT_THROW(be->sample(logits_tensor(full, B, V), temp, top_p, top_k, u, t1, l1, V + 1), Error);
  full[2 * V + Vv + 4] = NAN;
  EXPECT_THROW(be->sample(logits_tensor(full, B, V), temp, top_p, top_k, u, t1, l1, Vv), Error);
}

// A model of 64 ids of which the last 24 are padding: with valid_vocab 40 the rollout engine
// never emits a padding id (sampled or greedy); without it about 3/8 of the tokens are padding.
TEST(PaddedVocab, RolloutNeverSamplesPaddingIds) {
  auto be = make_cpu_backend();
  const int V = 64, Vv = 40;
  ModelWeights host = test::tiny_model("qwen2", DType::F32, 5, V);  // untied lm_head
  ASSERT_FALSE(host.config.tie_word_embeddings);
  // Kept rows scaled down (logits near 0), padding rows zero (logits exactly 0): the next-token
  // distribution is close to uniform, so the 24 padding ids carry ~3/8 of the mass.
  std::vector<float> head = to_float_vector(host.lm_head);
  const int64_t D = host.config.hidden_size;
  for (int64_t v = 0; v < V; ++v)
    for (int64_t d = 0; d < D; ++d) head[v * D + d] = v < Vv ? head[v * D + d] * 0.01f : 0.0f;
  host.lm_head = from_float_vector(head, host.lm_head.shape());
  const ModelWeights w = model_weights_to_device(*be, host, DType::F32);
  EnginePrecision p;
  p.linear = LinearMode::FP32;
  p.kv_cache = DType::F32;
  RolloutEngine engine(*be, w, p, /*kv_pages=*/64);
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.max_new_tokens = 12;
  sp.seed = 3;
  const std::vector<RolloutRequest> reqs = {{{1, 2, 3}, 8}, {{4, 5}, 8}};
  int padding_without_mask = 0;
  for (const RolloutSample& s : engine.generate(reqs, sp))
    for (int32_t t : s.tokens) padding_without_mask += t >= Vv;
  EXPECT_GT(padding_without_mask, 20) << "the padding ids should carry ~3/8 of the mass without the mask";
  sp.valid_vocab = Vv;
  int n = 0;
  std::vector<RolloutSample> masked = engine.generate(reqs, sp);
  for (const RolloutSample& s : masked) {
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      EXPECT_LT(s.tokens[i], Vv);
      EXPECT_TRUE(std::isfinite(s.logp[i]) && s.logp[i] <= 0.0f);
      ++n;
    }
  }
  EXPECT_EQ(n, 16 * 12);
  // logp_gen is the scoring forward's log-prob of the token (normalized over all V): the mask adds
  // no generator/trainer mismatch.
  std::vector<std::vector<int32_t>> seqs;
  for (const RolloutSample& s : masked) {
    seqs.push_back(reqs[s.request].prompt);
    seqs.back().insert(seqs.back().end(), s.tokens.begin(), s.tokens.end());
  }
  const ForwardBatch batch = forward_batch_from_sequences(seqs);
  const std::vector<double> lp = test::values_f64(*be, model_forward_logprobs(*be, w, p, batch, {}).logp);
  for (size_t i = 0; i < masked.size(); ++i) {
    const size_t plen = reqs[masked[i].request].prompt.size();
    for (size_t t = 0; t < masked[i].tokens.size(); ++t)
      EXPECT_NEAR(masked[i].logp[t], lp[batch.cu_seqlens[i] + plen - 1 + t], 2e-5) << "sample " << i << " token " << t;
  }
  sp.temperature = 0.0f;  // greedy too
  for (const RolloutSample& s : engine.generate(reqs, sp))
    for (int32_t t : s.tokens) EXPECT_LT(t, Vv);
  sp.valid_vocab = 1000;  // larger than the model's: clamped, not an error
  EXPECT_NO_THROW(engine.generate(reqs, sp));
}

const std::string kTok = std::string(FP8RL_TEST_DATA) + "/tokenizers/small/tokenizer.json";

TEST(PaddedVocab, DecodeLossyNeverThrows) {
  const Tokenizer tok = Tokenizer::load(kTok);
  const int32_t n = tok.vocab_size();
  const std::vector<int32_t> ok = tok.encode("hello world", false);
  std::vector<int32_t> ids = ok;
  ids.push_back(n + 5);
  ids.push_back(-1);
  EXPECT_THROW(tok.decode(ids), Error);
  EXPECT_EQ(tok.decode_lossy(ids), tok.decode(ok) + "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_FALSE(tok.can_decode(n));
  EXPECT_TRUE(tok.can_decode(ok[0]));
}

// The user's case: `fp8rl generate --temperature 1` on a model whose vocabulary is larger than
// its tokenizer's. It used to fail on the first padding id sampled.
TEST(PaddedVocab, GenerateOnAPaddedCheckpointSucceeds) {
  const Tokenizer tok = Tokenizer::load(kTok);
  const int V = tok.vocab_size() + 700;
  ModelConfig c = model_config_tiny("qwen3", V, 32, 1, 2, 1, 64);
  RandomInit init;
  init.seed = 9;
  init.std = 0.5f;  // sharp: padding rows get their share of the mass
  const ModelWeights w = model_weights_random(c, init, DType::F32);
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_padded_vocab_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  model_weights_save(w, dir.string());
  fs::copy_file(kTok, dir / "tokenizer.json");
  const std::string cmd = std::string(FP8RL_BINARY) + " generate --model " + dir.string() +
                          " --prompt 'hello' --n 6 --max-new-tokens 24 --temperature 1 --precision fp32 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) out += buf;
  const int status = pclose(f);
  fs::remove_all(dir);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("never sampled"), std::string::npos) << out;
  EXPECT_EQ(out.find("cannot decode"), std::string::npos) << out;
  size_t pos = 0, notes = 0;
  while ((pos = out.find("vocabulary: the model has", pos)) != std::string::npos) ++notes, ++pos;
  EXPECT_EQ(notes, 1u) << out;
}

}  // namespace
}  // namespace fp8rl
