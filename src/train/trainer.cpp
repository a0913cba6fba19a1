#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "dist/comm.h"

namespace fp8rl {

namespace {

struct Packed {
  ForwardBatch batch;
  std::vector<int64_t> logp_index;  // [response tokens]: index into the forward's [T] logp
  int64_t pad = 0;                  // padding rows after the sequences' tokens
};

int64_t round_up(int64_t n, int64_t g) { return (n + g - 1) / g * g; }

// Response token j of a sequence starting at s with prompt p is predicted at position s + p - 1 + j.
// The tokens are then padded to a multiple of `granule` by prefixes of sequence `first`, each a
// sequence of its own (TrainerOptions::pad_tokens_to): rows that repeat real rows, never scored.
Packed pack(const std::vector<TrainSequence>& seqs, size_t first, size_t end, int64_t granule, int64_t max_tokens) {
  Packed p;
  std::vector<std::vector<int32_t>> ids;
  int64_t start = 0;
  for (size_t i = first; i < end; ++i) {
    const TrainSequence& s = seqs[i];
    FP8RL_CHECK(s.prompt_len >= 1 && s.response_len() >= 0, "train sequence ", i, " needs a prompt of at least "
                "one token (got prompt_len ", s.prompt_len, " of ", s.ids.size(), " ids)");
    for (int64_t j = 0; j < s.response_len(); ++j) p.logp_index.push_back(start + s.prompt_len - 1 + j);
    start += static_cast<int64_t>(s.ids.size());
    ids.push_back(s.ids);
  }
  const std::vector<int32_t>& src = seqs[first].ids;
  // Never past micro_batch_tokens (the memory plan's bound) when the sequences fit in it: a lone
  // sequence just under a limit that is not a multiple of the granule keeps its tail product.
  const int64_t padded = round_up(start, granule);
  p.pad = src.empty() || (start <= max_tokens && padded > max_tokens) ? 0 : padded - start;
  for (int64_t pad = p.pad; pad > 0;) {
    const int64_t n = std::min<int64_t>(pad, static_cast<int64_t>(src.size()));
    ids.emplace_back(src.begin(), src.begin() + n);
    pad -= n;
  }
  p.batch = forward_batch_from_sequences(ids);
  return p;
}

// The generator's routing of sequences [first, end) as the packed forward's T tokens (-1 rows
// where a sequence has none; pack()'s padding rows copy their rows'); nullopt when none carries
// a record.
std::optional<MoeRouting> pack_routing(const ModelConfig& c, const std::vector<TrainSequence>& seqs, size_t first,
                                       size_t end, int64_t T) {
  bool any = false;
  for (size_t i = first; i < end; ++i) any |= !seqs[i].routing.empty();
  if (!any || !c.is_moe()) return std::nullopt;
  const int64_t Lm = model_num_moe_layers(c), k = c.num_experts_per_tok, stride = Lm * k;
  MoeRouting r;
  r.top_k = static_cast<int>(k);
  r.ids.assign(static_cast<size_t>(Lm), std::vector<int32_t>(static_cast<size_t>(T * k), -1));
  int64_t t0 = 0;
  for (size_t i = first; i < end; ++i) {
    const TrainSequence& s = seqs[i];
    const int64_t n = static_cast<int64_t>(s.ids.size());
    if (!s.routing.empty()) {
      FP8RL_CHECK(static_cast<int64_t>(s.routing.size()) == n * stride, "train sequence ", i, ": its routing record "
                  "has ", s.routing.size(), " ids, expected ", n, " positions x ", Lm, " MoE layers x top-", k);
      for (int64_t p = 0; p < n; ++p)
        for (int64_t m = 0; m < Lm; ++m)
          for (int64_t j = 0; j < k; ++j) r.ids[m][(t0 + p) * k + j] = s.routing[(p * Lm + m) * k + j];
    }
    t0 += n;
  }
  // pack()'s padding rows repeat prefixes of sequence `first` (which starts at token 0): they
  // take its routing too, so under replay they stay copies of its rows in every later block
  // (their q/k/v then add nothing to the amax).
  const int64_t n0 = static_cast<int64_t>(seqs[first].ids.size());
  for (int64_t t = t0; t < T; ++t)
    for (int64_t m = 0; m < Lm; ++m)
      for (int64_t j = 0; j < k; ++j) r.ids[m][t * k + j] = r.ids[m][((t - t0) % n0) * k + j];
  return r;
}

// Whether token t's experts in `a` and `b` are the same set (k ids each).
bool same_experts(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t t, int64_t k) {
  return std::is_permutation(a.begin() + t * k, a.begin() + (t + 1) * k, b.begin() + t * k);
}

// The trainer's routing (used; own: its router's top-k, empty = the used one) against the
// generator's `gen` at the scored positions `index`: per scored token, agreement in every layer.
void routing_agreement(const MoeRouting& gen, const MoeRouting& used, const MoeRouting& own,
                       const std::vector<int64_t>& index, std::vector<uint8_t>& agreed, RoutingAgreement& counts) {
  const int64_t k = gen.top_k;
  const MoeRouting& router = own.ids.empty() ? used : own;
  for (int64_t t : index) {
    bool all = gen.ids.empty() ? false : gen.ids[0][t * k] >= 0;
    for (size_t m = 0; m < gen.ids.size(); ++m) {
      if (gen.ids[m][t * k] < 0) continue;
      const bool same = same_experts(used.ids[m], gen.ids[m], t, k);
      ++counts.pairs;
      counts.agreed += same;
      counts.router_agreed += same_experts(router.ids[m], gen.ids[m], t, k);
      all &= same;
    }
    agreed.push_back(all ? 1 : 0);
  }
}

// A forward's per-token values over its head rows (ForwardOptions::head_rows = the packed
// response tokens, Packed::logp_index), read back.
std::vector<float> head_values(Backend& be, const Tensor& dev) { return to_float_vector(be.to_host(dev)); }

std::vector<Tensor*> params_of(ModelWeights& w) {
  std::vector<Tensor*> out;
  model_for_each_parameter(w, [&](const std::string&, Tensor& t) { out.push_back(&t); });
  return out;
}

// Appends a micro-batch's scores to r as Trainer::score reports them (its packed response tokens'
// logp, entropy when asked, the q/k/v amax when asked, the routing agreement when recorded).
void append_scores(Backend& be, const LogprobResult& lr, const Packed& p, const std::optional<MoeRouting>& gen,
                   const ScoreRequest& want, const std::vector<float>& logp, ScoreResult& r) {
  if (gen) routing_agreement(*gen, lr.routing, lr.router_topk, p.logp_index, r.routing_agreed, r.routing);
  r.logp.insert(r.logp.end(), logp.begin(), logp.end());
  if (want.entropy) {
    std::vector<float> en = head_values(be, lr.entropy);
    r.entropy.insert(r.entropy.end(), en.begin(), en.end());
  }
  if (want.record_amax) {
    r.q_amax.push_back(lr.q_amax);
    r.k_amax.push_back(lr.k_amax);
    r.v_amax.push_back(lr.v_amax);
  }
}

}  // namespace

BadStepGuard::BadStepGuard(int max_in_a_row, std::string hint) : max_in_a_row_(max_in_a_row), hint_(std::move(hint)) {
  FP8RL_CHECK(max_in_a_row >= 1, "max_consecutive_bad_steps must be at least 1, got ", max_in_a_row);
}

bool BadStepGuard::record(const StepResult& r, int64_t step) {
  if (r.applied) {
    in_a_row_ = 0;
    return true;
  }
  ++in_a_row_;
  ++total_;
  std::fprintf(stderr, "step %lld: optimizer step skipped (%s; loss %g, grad norm %g), %d in a row, %lld in all\n",
               static_cast<long long>(step), r.skip_reason.c_str(), r.loss, r.grad_norm, in_a_row_,
               static_cast<long long>(total_));
  if (in_a_row_ >= max_in_a_row_)
    FP8RL_FAIL(in_a_row_, " consecutive optimizer steps met non-finite values (a non-finite loss or gradient; the ",
               "last: ", r.skip_reason, " at step ", step, "); stopping. The weights were not updated by those "
               "steps and the last good checkpoint is kept. ", hint_, " (max_consecutive_bad_steps=", max_in_a_row_, ")");
  return false;
}

Trainer::Trainer(Backend& be, ModelWeights master, const EnginePrecision& prec, const TrainerOptions& opt)
    : be_(be), master_(std::move(master)), prec_(prec), opt_(opt) {
  FP8RL_CHECK(master_.embed.dtype() == DType::F32, "the trainer keeps FP32 master weights, got ", master_.embed.str());
  FP8RL_CHECK(opt_.micro_batch_tokens > 0, "micro_batch_tokens must be positive");
  model_check_consistent(master_.config, prec_);
  {  // FP8 linears that stay BF16 by their width (MLA projections), said once at start
    const std::vector<std::string> kept = model_bf16_kept_linears(master_, prec_);
    if (!kept.empty()) {
      std::string list;
      for (size_t i = 0; i < kept.size() && i < 8; ++i) list += (i ? ", " : "") + kept[i];
      if (kept.size() > 8) list += ", ...";
      std::fprintf(stderr, "trainer: %zu MLA projection(s) stay BF16 under the FP8 recipe (out or in features not a "
                   "multiple of 128): %s\n", kept.size(), list.c_str());
    }
  }
  if (opt_.frozen) {
    // Build the compute weights once, then drop every F32 tensor they replace: the FP8 linears
    // read only wq, the others their BF16 copies (with BF16 activations); norms stay shared.
    opt_.cache_fp8_weights = true;
    compute_weights();
    model_for_each_linear(compute_, [&](const std::string& name, int layer, LinearWeight& lw) {
      if (model_linear_mode(compute_.config, prec_, name, layer, lw) == LinearMode::FP8_BLOCK) lw.w = Tensor();
    });
    const ModelConfig config = master_.config;
    master_ = ModelWeights{};
    master_.config = config;
    return;
  }
  FP8RL_CHECK(opt_.grad_dtype == DType::F32 || opt_.grad_dtype == DType::BF16, "trainer gradients must be F32 or "
              "BF16, got ", dtype_name(opt_.grad_dtype));
  FP8RL_CHECK(opt_.moment_dtype == DType::F32 || opt_.moment_dtype == DType::BF16, "Adam moments must be F32 or "
              "BF16, got ", dtype_name(opt_.moment_dtype));
  grads_ = model_grads_alloc(be_, master_, opt_.grad_dtype, &grads_arena_);
  m_ = model_grads_alloc(be_, master_, opt_.moment_dtype);
  v_ = model_grads_alloc(be_, master_, opt_.moment_dtype);
}

int64_t Trainer::pad_granule() const { return opt_.pad_tokens_to > 0 ? opt_.pad_tokens_to : be_.row_granule(); }

std::vector<std::pair<size_t, size_t>> Trainer::micro_batches(const std::vector<TrainSequence>& seqs) const {
  std::vector<std::pair<size_t, size_t>> out;
  const int64_t g = pad_granule();
  size_t first = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(seqs[i].ids.size());
    if (i > first && round_up(tokens + n, g) > opt_.micro_batch_tokens) {  // padded, it would not fit
      out.push_back({first, i});
      first = i;
      tokens = 0;
    }
    tokens += n;
  }
  if (first < seqs.size()) out.push_back({first, seqs.size()});
  return out;
}

const ModelWeights& Trainer::compute_weights() {
  if (!opt_.cache_fp8_weights) return master_;
  if (!wq_stale_) {
#ifndef NDEBUG
    if (!opt_.frozen) check_weight_cache();
#endif
    return compute_;
  }
  compute_ = master_;  // shares every tensor; a w replaced through master() is picked up here
  // BF16 copies where the backend's GEMMs would otherwise convert the FP32 master per call
  // (BF16 activations: the CUDA fast path). Round-to-nearest-even once per step gives the same
  // operands as the per-call conversion.
  const bool bf16_copies = be_.act_dtype() == DType::BF16;
  const bool keep_wqt = !opt_.frozen && opt_.dgrad_weight_cache;
  size_t i = 0, j = 0;
  // The FP8 copies are quantized after the walk, in one batched call (wq_ / wqt_ may grow
  // during it, so the jobs are made once their entries stay put).
  std::vector<Tensor> to_quantize;  // [i]: the master weight of wq_[i]
  std::vector<Tensor> to_convert;   // [j]: the master tensor of w16_[j]
  auto bf16_copy = [&](const Tensor& w) {
    if (j == w16_.size()) w16_.emplace_back();
    Tensor& c = w16_[j++];
    if (!c.defined() || c.shape() != w.shape()) c = be_.alloc(w.shape(), DType::BF16);
    to_convert.push_back(w);  // converted below, with the others in one call
    return c;
  };
  model_for_each_linear(compute_, [&](const std::string& name, int layer, LinearWeight& lw) {
    const LinearMode mode = model_linear_mode(compute_.config, prec_, name, layer, lw);
    if (mode == LinearMode::BF16 && bf16_copies) lw.w = bf16_copy(lw.w);
    // The consistent mode: biases as the generator keeps them (the activation dtype).
    if (prec_.consistent && bf16_copies && lw.bias.defined()) lw.bias = bf16_copy(lw.bias);
    if (mode != LinearMode::FP8_BLOCK) return;
    const size_t k = i++;
    if (k == wq_.size()) wq_.emplace_back();
    QuantTensor& q = wq_[k];
    const int64_t N = lw.w.dim(0), K = lw.w.dim(1);
    if (!q.defined() || q.rows() != N || q.cols() != K || q.pow2 != prec_.pow2_scales)
      q = be_.alloc_quant(N, K, kQuantBlock, kQuantBlock, prec_.pow2_scales);
    to_quantize.push_back(lw.w);  // in place, below; non-finite: at the synchronization
    lw.wq = q;
    if (!keep_wqt) return;  // a frozen policy has no dgrad; without the W^T cache it transposes wq
    // W^T for the dgrad: quantizing w^T with 128x128 blocks makes the same blocks, amaxes and
    // codes as wq's, transposed (LinearWeight): the exact transpose, once per step.
    if (k == wqt_.size()) wqt_.emplace_back();
    QuantTensor& qt = wqt_[k];
    if (!qt.defined() || qt.rows() != K || qt.cols() != N || qt.pow2 != prec_.pow2_scales)
      qt = be_.alloc_quant(K, N, kQuantBlock, kQuantBlock, prec_.pow2_scales);
    lw.wqt = qt;
  });
  std::vector<Backend::WeightQuantJob> jobs;
  for (size_t k = 0; k < to_quantize.size(); ++k)
    jobs.push_back({&to_quantize[k], &wq_[k], keep_wqt ? &wqt_[k] : nullptr});
  be_.quantize_weights(jobs);
  if (bf16_copies) {  // the lm_head runs in BF16 with BF16 activations (and the embedding reads rows)
    const bool tied = master_.lm_head.storage() == master_.embed.storage();
    compute_.embed = bf16_copy(master_.embed);
    compute_.lm_head = tied ? compute_.embed : bf16_copy(master_.lm_head);
  }
  if (bf16_copies && prec_.consistent) {
    // The consistent mode: the norm weights as the generator keeps them too (BF16 copies of the
    // master: generator_weights_alloc), so every forward op reads the generator's operands.
    compute_.final_norm = bf16_copy(master_.final_norm);
    for (size_t l = 0; l < compute_.layers.size(); ++l) {
      LayerWeights& cl = compute_.layers[l];
      const LayerWeights& ml = master_.layers[l];
      cl.attn_norm = bf16_copy(ml.attn_norm);
      cl.mlp_norm = bf16_copy(ml.mlp_norm);
      if (ml.q_norm.defined()) cl.q_norm = bf16_copy(ml.q_norm);
      if (ml.k_norm.defined()) cl.k_norm = bf16_copy(ml.k_norm);
    }
  }
  std::vector<Backend::ConvertJob> converts;
  for (size_t k = 0; k < to_convert.size(); ++k) converts.push_back({&to_convert[k], &w16_[k]});
  be_.convert_many(converts);
  // Non-finite weights throw here (NonFiniteError), once for all the copies: one synchronization
  // per refresh instead of one per weight.
  be_.synchronize();
  wq_.resize(i);
  wqt_.resize(keep_wqt ? i : 0);
  w16_.resize(j);
  wq_stale_ = false;
  ++wq_refreshes_;
  return compute_;
}

void Trainer::check_weight_cache() const {
  ModelWeights& m = const_cast<ModelWeights&>(master_);  // read only: model_for_each_linear is non-const
  size_t i = 0;
  model_for_each_linear(m, [&](const std::string& name, int layer, LinearWeight& lw) {
    if (model_linear_mode(m.config, prec_, name, layer, lw) != LinearMode::FP8_BLOCK) return;
    FP8RL_CHECK(i < wq_.size(), "trainer FP8 weight cache: no entry for ", name);
    const QuantTensor want = quantize_128x128(be_.to_host(lw.w), prec_.pow2_scales);
    auto check = [&](const QuantTensor& have, const QuantTensor& ref, const char* what) {
      const Tensor hd = be_.to_host(have.data), hs = be_.to_host(have.scales);
      FP8RL_CHECK(hd.nbytes() == ref.data.nbytes() && hs.nbytes() == ref.scales.nbytes() &&
                      std::memcmp(hd.raw(), ref.data.raw(), hd.nbytes()) == 0 &&
                      std::memcmp(hs.raw(), ref.scales.raw(), hs.nbytes()) == 0,
                  "trainer FP8 weight cache (", what, ") is stale for ", name, ": the master weight changed without ",
                  "marking the cache (write master weights through Trainer::master() before score/step)");
    };
    check(wq_[i], want, "wq");
    if (opt_.dgrad_weight_cache) {
      FP8RL_CHECK(i < wqt_.size(), "trainer FP8 weight cache: no W^T entry for ", name);
      check(wqt_[i], transpose_128x128(want), "wqt");
    }
    ++i;
  });
  FP8RL_CHECK(opt_.dgrad_weight_cache || wqt_.empty(), "trainer FP8 weight cache: W^T copies kept without "
              "dgrad_weight_cache");
}

int64_t Trainer::dgrad_weight_cache_bytes() const {
  int64_t bytes = 0;
  for (const QuantTensor& q : wqt_)
    if (q.defined()) bytes += static_cast<int64_t>(q.data.nbytes() + q.scales.nbytes());
  return bytes;
}

void score_results_append(ScoreResult& a, const ScoreResult& b) {
  a.logp.insert(a.logp.end(), b.logp.begin(), b.logp.end());
  a.entropy.insert(a.entropy.end(), b.entropy.begin(), b.entropy.end());
  a.routing_agreed.insert(a.routing_agreed.end(), b.routing_agreed.begin(), b.routing_agreed.end());
  a.q_amax.insert(a.q_amax.end(), b.q_amax.begin(), b.q_amax.end());
  a.k_amax.insert(a.k_amax.end(), b.k_amax.begin(), b.k_amax.end());
  a.v_amax.insert(a.v_amax.end(), b.v_amax.begin(), b.v_amax.end());
  a.routing.pairs += b.routing.pairs;
  a.routing.agreed += b.routing.agreed;
  a.routing.router_agreed += b.routing.router_agreed;
}

namespace {
// No GEMM tuning for the trainer's products while it lives (Backend::set_gemm_tuning): the
// micro-batches' shapes change from step to step.
class NoGemmTuning {
 public:
  explicit NoGemmTuning(Backend& be) : be_(be), prev_(be.set_gemm_tuning(false)) {}
  ~NoGemmTuning() { be_.set_gemm_tuning(prev_); }
  NoGemmTuning(const NoGemmTuning&) = delete;
  NoGemmTuning& operator=(const NoGemmTuning&) = delete;

 private:
  Backend& be_;
  bool prev_;
};
}  // namespace

ScoreResult Trainer::score(const std::vector<TrainSequence>& seqs, float temperature, bool entropy, bool record_amax) {
  const NoGemmTuning no_tuning(be_);
  ScoreResult r;
  const ScoreRequest want{entropy, record_amax};
  for (auto [first, end] : micro_batches(seqs)) {
    Packed p = pack(seqs, first, end, pad_granule(), opt_.micro_batch_tokens);
    pad_tokens_ += p.pad;
    ForwardOptions fo;
    fo.temperature = temperature;
    fo.entropy = entropy;
    fo.record_qkv_amax = record_amax;
    fo.head_rows = &p.logp_index;  // the lm_head over the response tokens alone
    fo.kv_round_k = kv_round_k_;
    fo.kv_round_v = kv_round_v_;
    const std::optional<MoeRouting> gen = pack_routing(master_.config, seqs, first, end, p.batch.num_tokens());
    fo.record_routing = gen.has_value();
    if (gen && opt_.routing_replay) fo.replay_routing = &*gen;
    LogprobResult lr = model_forward_logprobs(be_, compute_weights(), prec_, p.batch, fo);
    append_scores(be_, lr, p, gen, want, head_values(be_, lr.logp), r);
  }
  return r;
}

void Trainer::forward_backward(const std::vector<TrainSequence>& seqs, float temperature, const TokenLossFn& loss_fn,
                               StepResult& r, const ScoreRequest* score, ScoreResult* scored) {
  const NoGemmTuning no_tuning(be_);
  const ModelWeights& weights = compute_weights();
  for (auto [first, end] : micro_batches(seqs)) {
    Packed p = pack(seqs, first, end, pad_granule(), opt_.micro_batch_tokens);
    pad_tokens_ += p.pad;
    Activations acts;
    ForwardOptions fo;
    fo.temperature = temperature;
    fo.recompute = opt_.recompute;
    fo.head_rows = &p.logp_index;  // the lm_head over the response tokens alone
    fo.kv_round_k = kv_round_k_;
    fo.kv_round_v = kv_round_v_;
    // Scoring in the same forward (score()'s options and records).
    const bool rec = score && scored;
    if (rec) fo.entropy = score->entropy, fo.record_qkv_amax = score->record_amax;
    const std::optional<MoeRouting> gen = opt_.routing_replay || rec
                                              ? pack_routing(master_.config, seqs, first, end, p.batch.num_tokens())
                                              : std::nullopt;
    if (gen && rec) fo.record_routing = true;
    if (gen && opt_.routing_replay) fo.replay_routing = &*gen;
    LogprobResult out = model_forward_logprobs(be_, weights, prec_, p.batch, fo, &acts);
    std::vector<float> logp_new = head_values(be_, out.logp);
    if (rec) append_scores(be_, out, p, gen, *score, logp_new, *scored);
    std::vector<float> grad(logp_new.size(), 0.0f);
    r.loss += loss_fn(first, end, logp_new, grad);
    // dloss/dlogp over the head's rows, as the forward's logp.
    Tensor dlogp = be_.to_device(from_float_vector(grad, {static_cast<int64_t>(grad.size())}));
    BackwardOptions bo;
    bo.router_grad = opt_.train_router;
    model_backward(be_, weights, prec_, acts, dlogp, grads_, bo);
  }

  std::vector<Tensor*> g = params_of(grads_);
  if (comm_ && comm_->world_size() > 1) {  // data parallel: the global loss and gradient
    comm_->all_reduce(&r.loss, 1, ReduceOp::Sum);
    dist_all_reduce_sum(*comm_, be_, g);
  }
  std::vector<const Tensor*> gs;
  for (Tensor* t : params_of(grads_)) gs.push_back(t);
  r.grad_norm = std::sqrt(be_.sum_squares_total(gs));  // synchronizes: device errors surface here
}

StepResult Trainer::step(const std::vector<TrainSequence>& seqs, float temperature, const TokenLossFn& loss_fn,
                         float lr, const ScoreRequest* score, ScoreResult* scored) {
  FP8RL_CHECK(!opt_.frozen, "a frozen policy (the KL reference) cannot take optimizer steps");
  StepResult r;
  model_grads_zero(be_, grads_, &grads_arena_);
  // A non-finite activation, logit, loss or gradient met on the way (the FP8 quantizer, the
  // loss and the attention refuse them with NonFiniteError) skips this update like a
  // non-finite loss does: the weights and the optimizer state are only written below.
  try {
    forward_backward(seqs, temperature, loss_fn, r, score, scored);
  } catch (const NonFiniteError& e) {
    std::string msg = e.what();
    const size_t tag = msg.rfind(" [");  // drop the file:line tag
    if (tag != std::string::npos) msg.resize(tag);
    r.skip_reason = "non-finite values in the forward/backward pass: " + msg;
    r.loss = std::nan("");
    r.grad_norm = std::nan("");
    return r;
  }
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
    r.skip_reason = !std::isfinite(r.loss) ? "non-finite loss" : "non-finite gradient";
    return r;  // the weights and the optimizer state stay untouched
  }
  std::vector<Tensor*> g = params_of(grads_);
  float grad_scale = 1.0f;  // BF16 gradients: the clipping factor is applied inside AdamW (no second rounding)
  if (opt_.grad_clip > 0 && r.grad_norm > opt_.grad_clip) {
    const float s = static_cast<float>(opt_.grad_clip / (r.grad_norm + 1e-6));
    if (opt_.grad_dtype == DType::BF16) grad_scale = s;
    else
      for (Tensor* t : g) be_.scale(*t, s);
  }
  ++adam_step_;
  std::vector<Tensor*> w = params_of(master_);
  std::vector<Tensor*> m = owner_.empty() ? params_of(m_) : m_ptr_, v = owner_.empty() ? params_of(v_) : v_ptr_;
  std::vector<bool> frozen;  // a frozen MoE router gets no update (weight decay included)
  model_for_each_parameter(master_, [&](const std::string& n, Tensor&) {
    frozen.push_back(!opt_.train_router && n.size() > 16 && n.compare(n.size() - 16, 16, ".mlp.gate.weight") == 0);
  });
  std::vector<Backend::AdamWJob> jobs;
  for (size_t i = 0; i < w.size(); ++i) {
    if (frozen[i]) continue;
    if (!owner_.empty() && owner_[i] != comm_->rank()) continue;  // ZeRO-1: another rank's
    AdamWParams ap;
    ap.lr = lr;
    ap.beta1 = opt_.beta1;
    ap.beta2 = opt_.beta2;
    ap.eps = opt_.eps;
    ap.weight_decay = w[i]->ndim() == 2 ? opt_.weight_decay : 0.0f;
    ap.step = adam_step_;
    ap.grad_scale = grad_scale;
    ap.stochastic_rounding = opt_.stochastic_rounding;
    ap.rounding_key = 0x6f7074696d000000ull + i;  // per parameter tensor (model_for_each_parameter order)
    jobs.push_back({w[i], g[i], m[i], v[i], ap});
  }
  be_.adamw_many(jobs);  // bitwise the loop of adamw over the jobs
  if (!owner_.empty()) broadcast_from_owners(w, nullptr);  // every rank gets every new weight
  wq_stale_ = true;  // requantized at the next score() / step()
  r.applied = true;
  return r;
}

void Trainer::set_kv_rounding(std::vector<float> k_scales, std::vector<float> v_scales) {
  FP8RL_CHECK(k_scales.size() == v_scales.size(), "set_kv_rounding: ", k_scales.size(), " k scales and ",
              v_scales.size(), " v scales");
  FP8RL_CHECK(k_scales.empty() || static_cast<int>(k_scales.size()) == master_.config.num_layers,
              "set_kv_rounding: one scale per layer (", master_.config.num_layers, "), got ", k_scales.size());
  if (prec_.kv_cache != DType::E4M3) return;  // the recipe does not round: nothing to keep
  kv_round_k_ = std::move(k_scales);
  kv_round_v_ = std::move(v_scales);
}

void Trainer::set_communicator(Communicator* comm, bool shard_optimizer) {
  comm_ = comm;
  owner_.clear();
  gathered_.clear();
  if (!comm || comm->world_size() == 1 || !shard_optimizer) return;
  FP8RL_CHECK(!opt_.frozen, "a frozen policy has no optimizer state to shard");
  const std::vector<Tensor*> w = params_of(master_);
  std::vector<size_t> order(w.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a]->numel() > w[b]->numel(); });
  std::vector<int64_t> load(comm->world_size(), 0);
  owner_.assign(w.size(), 0);
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = r;
    load[r] += w[i]->numel();
  }
  // Kept by index: model_for_each_parameter skips the undefined tensors freed here.
  m_ptr_ = params_of(m_);
  v_ptr_ = params_of(v_);
  FP8RL_CHECK(m_ptr_.size() == w.size() && v_ptr_.size() == w.size(), "ZeRO-1: moments do not match the parameters");
  for (size_t i = 0; i < w.size(); ++i)
    if (owner_[i] != comm->rank()) *m_ptr_[i] = *v_ptr_[i] = Tensor();  // freed: only the owner keeps them
}

void Trainer::broadcast_from_owners(const std::vector<Tensor*>& of, std::vector<Tensor>* keep_host) {
  if (keep_host) keep_host->assign(of.size(), Tensor());
  const bool want_host = keep_host != nullptr;
  const std::vector<Tensor*> shapes = params_of(master_);  // `of` may lack non-owned tensors
  for (int r = 0; r < comm_->world_size(); ++r) {
    std::vector<size_t> mine;
    size_t n = 0;
    for (size_t i = 0; i < of.size(); ++i)
      if (owner_[i] == r) {
        mine.push_back(i);
        n += static_cast<size_t>(shapes[i]->numel());
      }
    if (mine.empty()) continue;
    std::vector<float> flat;
    flat.reserve(n);
    if (comm_->rank() == r)
      for (size_t i : mine) {
        const std::vector<float> h = to_float_vector(be_.to_host(*of[i]));
        flat.insert(flat.end(), h.begin(), h.end());
      }
    flat.resize(n);
    comm_->broadcast(flat.data(), n * sizeof(float), r);
    size_t at = 0;
    for (size_t i : mine) {
      const size_t k = static_cast<size_t>(shapes[i]->numel());
      const std::vector<float> part(flat.begin() + at, flat.begin() + at + k);
      Tensor h = from_float_vector(part, shapes[i]->shape());
      if (want_host) (*keep_host)[i] = h;
      else if (comm_->rank() != r) be_.copy(h, *of[i]);
      at += k;
    }
  }
}

void Trainer::gather_optimizer_state() {
  if (owner_.empty()) return;
  std::vector<std::string> names;
  model_for_each_parameter(master_, [&](const std::string& n, const Tensor&) { names.push_back(n); });
  std::vector<Tensor> hm, hv;
  broadcast_from_owners(m_ptr_, &hm);
  broadcast_from_owners(v_ptr_, &hv);
  gathered_.clear();
  if (comm_->rank() != 0) return;
  // The broadcast moves F32; BF16 moments convert back exactly.
  auto in_dtype = [&](const Tensor& h) {
    return h.dtype() == opt_.moment_dtype ? h : from_float_vector(to_float_vector(h), h.shape(), opt_.moment_dtype);
  };
  for (size_t i = 0; i < names.size(); ++i) gathered_.push_back({names[i] + ".exp_avg", in_dtype(hm[i])});
  for (size_t i = 0; i < names.size(); ++i) gathered_.push_back({names[i] + ".exp_avg_sq", in_dtype(hv[i])});
  gathered_step_ = adam_step_;
}

std::vector<std::pair<std::string, Tensor>> Trainer::optimizer_state() const {
  if (!owner_.empty()) {
    FP8RL_CHECK(comm_->rank() == 0 && gathered_step_ == adam_step_ && !gathered_.empty(), "the optimizer state is "
                "sharded (ZeRO-1): call gather_optimizer_state() on every rank, then read it on rank 0");
    return gathered_;
  }
  std::vector<std::pair<std::string, Tensor>> out;
  model_for_each_parameter(m_, [&](const std::string& n, const Tensor& t) { out.push_back({n + ".exp_avg", be_.to_host(t)}); });
  model_for_each_parameter(v_, [&](const std::string& n, const Tensor& t) { out.push_back({n + ".exp_avg_sq", be_.to_host(t)}); });
  return out;
}

void Trainer::load_optimizer_state(const std::function<Tensor(const std::string&)>& get, int64_t adam_step) {
  auto load = [&](ModelWeights& dst, const char* suffix) {
    model_for_each_parameter(dst, [&](const std::string& n, Tensor& t) {
      if (!t.defined()) return;  // ZeRO-1: another rank's
      Tensor h = get(n + suffix);
      FP8RL_CHECK(h.shape() == t.shape(), "optimizer state ", n, suffix, " is ", h.str(), ", expected ",
                  dtype_name(t.dtype()), shape_str(t.shape()), "; the checkpoint does not match this model");
      if (h.dtype() != t.dtype())
        FP8RL_FAIL("the checkpoint's Adam moments are ", dtype_name(h.dtype()), " (", n, suffix, ") but this run keeps ",
                   dtype_name(t.dtype()), " moments: resume with the run's train.optimizer_state_dtype (",
                   h.dtype() == DType::BF16 ? "bf16" : "fp32", ")");
      be_.copy(h, t);
    });
  };
  load(m_, ".exp_avg");
  load(v_, ".exp_avg_sq");
  adam_step_ = adam_step;
}

}  // namespace fp8rl
