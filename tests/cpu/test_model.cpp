// The transformer: paged decode == packed prefill, q/k/v amax recording, precision modes,
// checkpoint save/load (F32 and FP8 block-scaled), and the `fp8rl logprobs` command.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <unistd.h>

#include "io/safetensors.h"
#include "test_model_util.h"

namespace fp8rl {
namespace {

using test::tiny_model;
using test::token_sequences;
using test::values_f64;

EnginePrecision precision_of(LinearMode m) {
  EnginePrecision p;
  p.linear = m;
  return p;
}

Tensor i32_tensor(Backend& be, const std::vector<int32_t>& v) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), h.data<int32_t>());
  return be.to_device(h);
}

// Token-by-token generation bookkeeping for B sequences in a paged cache whose pages are
// interleaved between sequences (sequence b's page j is j * B + b).
struct PagedRun {
  int B, page_size, max_pages;
  PagedBatch make(Backend& be, const std::vector<int>& seq, const std::vector<int>& pos) const {
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
    pb.token_seq = i32_tensor(be, std::vector<int32_t>(seq.begin(), seq.end()));
    pb.token_pos = i32_tensor(be, std::vector<int32_t>(pos.begin(), pos.end()));
    pb.slots = i32_tensor(be, slots);
    Tensor t = Tensor::empty({B, max_pages}, DType::I32);
    std::copy(table.begin(), table.end(), t.data<int32_t>());
    pb.page_table = be.to_device(t);
    pb.max_pos = max_pos;
    return pb;
  }
};

double log_softmax_at(const float* logits, int V, int target) {
  double m = logits[0];
  for (int i = 1; i < V; ++i) m = std::max(m, static_cast<double>(logits[i]));
  double s = 0.0;
  for (int i = 0; i < V; ++i) s += std::exp(logits[i] - m);
  return logits[target] - m - std::log(s);
}

class ModelFamilyTest : public ::testing::TestWithParam<const char*> {};

// Prefill a 3-token chunk of every sequence, then decode one token per step: the log-prob of
// each next token from the paged path equals the packed scoring forward's (F32 cache).
TEST_P(ModelFamilyTest, PagedDecodeEqualsPackedForward) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, tiny_model(GetParam(), DType::F32, 21), DType::F32);
  const int V = w.config.vocab_size;
  const auto seqs = token_sequences({9, 6, 7}, V, 4);
  const ForwardBatch packed = forward_batch_from_sequences(seqs);
  const EnginePrecision prec = precision_of(LinearMode::FP32);
  const std::vector<double> ref = values_f64(*be, model_forward_logprobs(*be, w, prec, packed, {}).logp);

  const int B = static_cast<int>(seqs.size()), page_size = 4, max_pages = 3;
  PagedRun run{B, page_size, max_pages};
  KvCache cache = model_alloc_kv_cache(*be, w.config, B * max_pages, page_size, DType::F32);
  const int prefill = 3;
  size_t compared = 0;
  double worst = 0.0;
  for (int step = 0;; ++step) {
    // This step's tokens: positions [0, prefill) at step 0, then position prefill - 1 + step.
    std::vector<int> seq, pos, rows;
    std::vector<int32_t> ids;
    for (int b = 0; b < B; ++b) {
      const int n = static_cast<int>(seqs[b].size());
      const int begin = step == 0 ? 0 : prefill - 1 + step, end = step == 0 ? prefill : begin + 1;
      if (begin >= n - 1) continue;  // the last token has no next token to score
      for (int p = begin; p < end; ++p) {  // every token is scored (rows: all of this step's)
        seq.push_back(b), pos.push_back(p), ids.push_back(seqs[b][p]);
        rows.push_back(static_cast<int>(ids.size()) - 1);
      }
    }
    if (ids.empty()) break;
    const PagedBatch pb = run.make(*be, seq, pos);
    Tensor logits = be->alloc({static_cast<int64_t>(rows.size()), V}, DType::F32);
    model_forward_paged(*be, w, prec, cache, i32_tensor(*be, ids), pb,
                        i32_tensor(*be, std::vector<int32_t>(rows.begin(), rows.end())), logits);
    const Tensor lh = be->to_host(logits);
    for (size_t r = 0; r < rows.size(); ++r) {
      const int b = seq[rows[r]], p = pos[rows[r]];
      const double lp = log_softmax_at(lh.data<float>() + r * V, V, seqs[b][p + 1]);
      const double want = ref[packed.cu_seqlens[b] + p];
      EXPECT_NEAR(lp, want, 1e-5) << "sequence " << b << " position " << p;
      worst = std::max(worst, std::fabs(lp - want));
      ++compared;
    }
  }
  EXPECT_EQ(compared, packed.ids.size() - seqs.size());
  RecordProperty("worst_abs_diff", std::to_string(worst));
}

// The last token of each sequence has no target: its slot is 0; the others are real log-probs.
TEST_P(ModelFamilyTest, LogprobLayoutAndAmax) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, tiny_model(GetParam(), DType::F32, 5), DType::F32);
  const ForwardBatch batch = forward_batch_from_sequences(token_sequences({5, 1, 4}, w.config.vocab_size, 9));
  ForwardOptions opt;
  opt.entropy = true;
  opt.record_qkv_amax = true;
  Activations acts;
  const LogprobResult r = model_forward_logprobs(*be, w, precision_of(LinearMode::FP32), batch, opt, &acts);
  const std::vector<double> logp = values_f64(*be, r.logp), ent = values_f64(*be, r.entropy);
  for (int b = 0; b < batch.num_sequences(); ++b)
    for (int t = batch.cu_seqlens[b]; t < batch.cu_seqlens[b + 1]; ++t) {
      if (t + 1 == batch.cu_seqlens[b + 1]) EXPECT_EQ(logp[t], 0.0) << t;
      else EXPECT_LT(logp[t], 0.0) << t;
      EXPECT_GT(ent[t], 0.0) << t;
      EXPECT_LE(ent[t], std::log(static_cast<double>(w.config.vocab_size)) + 1e-5) << t;
    }
  // Scoring without saving activations gives the same values.
  const std::vector<double> again =
      values_f64(*be, model_forward_logprobs(*be, w, precision_of(LinearMode::FP32), batch, {}).logp);
  EXPECT_EQ(again, logp);

  ASSERT_EQ(r.q_amax.size(), static_cast<size_t>(w.config.num_layers));
  ASSERT_EQ(r.k_amax.size(), r.q_amax.size());
  ASSERT_EQ(r.v_amax.size(), r.q_amax.size());
  auto amax = [&](const Tensor& t) {
    double m = 0;
    for (double v : values_f64(*be, t)) m = std::max(m, std::fabs(v));
    return m;
  };
  for (int l = 0; l < w.config.num_layers; ++l) {
    EXPECT_GT(r.q_amax[l], 0.0f);
    EXPECT_EQ(r.q_amax[l], static_cast<float>(amax(acts.layers[l].q))) << l;
    EXPECT_EQ(r.k_amax[l], static_cast<float>(amax(acts.layers[l].k))) << l;
    EXPECT_EQ(r.v_amax[l], static_cast<float>(amax(acts.layers[l].v))) << l;
  }
}

// bf16 and fp8 linears change the log-probs a little, never a lot.
TEST_P(ModelFamilyTest, LowPrecisionLinearsStayClose) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, tiny_model(GetParam(), DType::F32, 8), DType::F32);
  const ForwardBatch batch = forward_batch_from_sequences(token_sequences({12, 7}, w.config.vocab_size, 2));
  const auto run = [&](LinearMode m, bool pow2, int first_bf16) {
    EnginePrecision p = precision_of(m);
    p.pow2_scales = pow2;
    p.bf16_first_layers = first_bf16;
    return values_f64(*be, model_forward_logprobs(*be, w, p, batch, {}).logp);
  };
  const auto fp32 = run(LinearMode::FP32, false, 0);
  for (auto [m, pow2, first, tol] : {std::tuple{LinearMode::BF16, false, 0, 0.05},
                                     std::tuple{LinearMode::FP8_BLOCK, false, 0, 0.3},
                                     std::tuple{LinearMode::FP8_BLOCK, true, 0, 0.3},
                                     std::tuple{LinearMode::FP8_BLOCK, false, 1, 0.3}}) {
    const auto lp = run(m, pow2, first);
    double mad = 0.0;
    for (size_t t = 0; t < lp.size(); ++t) mad += std::fabs(lp[t] - fp32[t]) / lp.size();
    EXPECT_GT(mad, 0.0) << linear_mode_name(m) << ": the precision had no effect";
    EXPECT_LT(mad, tol) << linear_mode_name(m);
  }
  // bf16_first_layers really keeps the first block out of FP8.
  EXPECT_NE(run(LinearMode::FP8_BLOCK, false, 1), run(LinearMode::FP8_BLOCK, false, 0));
}

INSTANTIATE_TEST_SUITE_P(Families, ModelFamilyTest, ::testing::Values("qwen3", "qwen2", "llama"),
                         [](const auto& info) { return std::string(info.param); });

TEST(ModelBatch, RejectsBadBatches) {
  auto be = make_cpu_backend();
  const ModelWeights w = model_weights_to_device(*be, tiny_model("llama", DType::F32, 1), DType::F32);
  const EnginePrecision p = precision_of(LinearMode::FP32);
  ForwardBatch b = forward_batch_from_sequences({{1, 2, w.config.vocab_size}});
  EXPECT_THROW(model_forward_logprobs(*be, w, p, b, {}), Error);
  b = forward_batch_from_sequences({{1, -1}});
  EXPECT_THROW(model_forward_logprobs(*be, w, p, b, {}), Error);
  b = forward_batch_from_sequences({{1, 2, 3}});
  b.cu_seqlens.back() = 2;
  EXPECT_THROW(model_forward_logprobs(*be, w, p, b, {}), Error);
  Activations none;  // backward without a saving forward
  ModelWeights g = model_grads_alloc(*be, w);
  EXPECT_THROW(model_backward(*be, w, p, none, be->alloc({3}, DType::F32), g), Error);
}

// ---- checkpoints -----------------------------------------------------------------------------

std::string temp_dir(const std::string& tag) {
  const auto p = std::filesystem::temp_directory_path() /
                 ("fp8rl_test_model_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

TEST(ModelCheckpoint, SaveLoadRoundTripIsExact) {
  for (const char* family : {"qwen3", "qwen2", "llama"}) {
    const ModelWeights w = tiny_model(family, DType::F32, 33);
    const std::string dir = temp_dir(family);
    model_weights_save(w, dir);
    const ModelWeights r = model_weights_load(dir, DType::F32);
    EXPECT_EQ(r.config.model_type, w.config.model_type);
    EXPECT_EQ(r.config.tie_word_embeddings, w.config.tie_word_embeddings);
    if (r.config.tie_word_embeddings) {
      EXPECT_EQ(r.lm_head.raw(), r.embed.raw()) << "tie lost";
    }
    std::vector<std::pair<std::string, std::vector<float>>> a, b;
    model_for_each_parameter(w, [&](const std::string& n, const Tensor& t) { a.push_back({n, to_float_vector(t)}); });
    model_for_each_parameter(r, [&](const std::string& n, const Tensor& t) { b.push_back({n, to_float_vector(t)}); });
    EXPECT_EQ(a, b) << family;
    EXPECT_EQ(model_count_parameters(r), w.config.num_parameters()) << family;
    std::filesystem::remove_all(dir);
  }
}

TEST(ModelCheckpoint, LoadsFp8BlockScaledLinears) {
  const ModelWeights w = tiny_model("qwen2", DType::F32, 44);
  const std::string dir = temp_dir("fp8");
  model_weights_save(w, dir);
  // Rewrite the checkpoint with every block linear stored as F8_E4M3 + weight_scale_inv.
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<QuantTensor> quants;
  ModelWeights m = w;
  model_for_each_parameter(m, [&](const std::string& n, Tensor& t) {
    const bool linear = n.find("_proj.weight") != std::string::npos;
    if (!linear) return tensors.push_back({n, t});
    QuantTensor q = quantize_128x128(t, false);
    tensors.push_back({n, q.data});
    tensors.push_back({n + "_scale_inv", q.scales});
    quants.push_back(q);
  });
  safetensors_write(dir + "/model.safetensors", tensors, {{"format", "pt"}});

  const ModelWeights r = model_weights_load(dir, DType::F32, /*keep_fp8=*/true);
  size_t i = 0;
  ModelWeights rr = r;
  model_for_each_linear(rr, [&](const std::string& name, int, LinearWeight& lw) {
    ASSERT_TRUE(lw.wq.defined()) << name;
    ASSERT_LT(i, quants.size());
    EXPECT_EQ(to_float_vector(lw.w), to_float_vector(dequantize(quants[i]))) << name;
    ++i;
  });
  EXPECT_EQ(i, quants.size());
  // Loading without keep_fp8 dequantizes only.
  const ModelWeights d = model_weights_load(dir, DType::F32);
  EXPECT_FALSE(d.layers[0].q.wq.defined());
  std::filesystem::remove_all(dir);
}

TEST(ModelCheckpoint, ClearErrors) {
  EXPECT_THROW(model_weights_load("/nonexistent/fp8rl/model"), Error);
  const ModelWeights w = tiny_model("llama", DType::F32, 2);
  const std::string dir = temp_dir("missing");
  model_weights_save(w, dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  model_for_each_parameter(w, [&](const std::string& n, const Tensor& t) {
    if (n != "model.layers.1.mlp.up_proj.weight") tensors.push_back({n, t});
  });
  safetensors_write(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  try {
    model_weights_load(dir);
    ADD_FAILURE() << "a checkpoint without a tensor loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// ---- the command -------------------------------------------------------------------------------

struct CommandResult {
  int status;
  std::string out;
};

CommandResult run_command(const std::string& args) {
  const std::string cmd = std::string(FP8RL_BINARY) + " " + args + " 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return {-1, ""};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const int st = pclose(f);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(ModelCommand, LogprobsPrintsOneLineMatchingTheForward) {
  const ModelWeights w = tiny_model("qwen3", DType::F32, 55);
  const std::string dir = temp_dir("cli");
  model_weights_save(w, dir);
  const std::vector<int32_t> ids = {3, 17, 9, 40, 2, 11};
  std::string id_text;
  for (int32_t id : ids) id_text += (id_text.empty() ? "" : " ") + std::to_string(id);

  auto be = make_cpu_backend();
  const ModelWeights dw = model_weights_to_device(*be, w, DType::F32);
  for (const char* prec : {"fp32", "bf16", "fp8"}) {
    const CommandResult r = run_command("logprobs --model " + dir + " --ids \"" + id_text + "\" --precision " + prec);
    ASSERT_EQ(r.status, 0) << prec;
    ASSERT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    std::istringstream in(r.out);
    std::vector<double> got;
    double v;
    while (in >> v) got.push_back(v);
    ASSERT_EQ(got.size(), ids.size() - 1) << r.out;
    const std::vector<double> want = values_f64(
        *be, model_forward_logprobs(*be, dw, precision_of(linear_mode_from_name(prec)),
                                    forward_batch_from_sequences({ids}), {}).logp);
    for (size_t t = 0; t < got.size(); ++t) EXPECT_NEAR(got[t], want[t], 1e-6 * std::fabs(want[t]) + 1e-7) << prec;
  }
  EXPECT_EQ(run_command("logprobs --model " + dir + " --ids \"" + id_text + "\" --precision fp8 --pow2-scales").status, 0);

  // Errors exit non-zero.
  EXPECT_NE(run_command("logprobs --model /nonexistent/dir --ids \"1 2\"").status, 0);
  EXPECT_NE(run_command("logprobs --model " + dir + " --ids \"1 x 2\"").status, 0);
  EXPECT_NE(run_command("logprobs --model " + dir + " --ids \"1 " + std::to_string(w.config.vocab_size) + "\"").status, 0);
  EXPECT_NE(run_command("logprobs --model " + dir + " --ids \"1\"").status, 0);
  EXPECT_NE(run_command("logprobs --model " + dir + " --ids \"1 2\" --precision fp4").status, 0);
  EXPECT_NE(run_command("logprobs --ids \"1 2\"").status, 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fp8rl
