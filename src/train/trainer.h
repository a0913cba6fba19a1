// The trainer: FP32 master weights, gradients and AdamW moments on one backend; scores
// sequences (logp_old, entropy, q/k/v amax for KV calibration) and runs optimizer steps of any
// per-token loss given as dloss/dlogp (GRPO, SFT), micro-batched with gradient accumulation.
//
// FP8 weight cache: the master weights change only at the optimizer step (or when written
// through the non-const master()), so the FP8_BLOCK linears' 128x128 E4M3 weights (LinearWeight
// wq, 1/4 of the FP32 master's bytes plus scales) and their exact transposes (wqt, as much
// again; TrainerOptions::dgrad_weight_cache, train.dgrad_weight_cache; not kept by a frozen
// policy, which has no backward) are quantized once per change, not in every forward and dgrad
// of every micro-batch. The ops then read wq for the forward and wqt for dgrad (backend.h;
// without wqt the dgrad transposes wq per call); the results are bitwise those of quantizing w
// in each op. The cache is
// marked stale by the optimizer step and by the non-const master(), and requantized at the next
// score() / step(); debug builds also check it against a fresh quantization at every use.
// With BF16 activations (CUDA) the same cache holds BF16 copies of the BF16 linears, the
// embedding and the lm_head, so no GEMM converts the FP32 master per call.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/precision.h"
#include "model/transformer.h"
#include "model/weights.h"

namespace fp8rl {

class Communicator;

// A sequence to train on: prompt + response ids. Its response tokens ids[prompt_len..] are the
// ones scored and trained; their per-token arrays are packed in sequence order.
struct TrainSequence {
  std::vector<int32_t> ids;
  int prompt_len = 0;
  // MoE models: the generator's routing of these ids (RolloutSample::routing: [ids.size()][MoE
  // layers][top_k], -1 where not recorded), or empty. score() measures the trainer's routing
  // against it; with TrainerOptions::routing_replay, score() and step() replay it.
  std::vector<int16_t> routing = {};
  int64_t response_len() const { return static_cast<int64_t>(ids.size()) - prompt_len; }
};

struct TrainerOptions {
  float grad_clip = 1.0f;             // global L2 norm; <= 0 disables clipping
  float weight_decay = 0.0f;          // decoupled; applied to 2-D weights only (not norms, biases)
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  // The lean optimizer (train.grad_dtype, train.optimizer_state_dtype): the master stays F32.
  // Gradients F32 or BF16: accumulated over the micro-batches in the gradient's dtype, each op's
  // contribution added in FP32 and rounded once (backend.h). Adam moments F32 or BF16 (FP32 math,
  // backend/adamw_rule.h), rounded to nearest or stochastically (stochastic_rounding).
  DType grad_dtype = DType::F32;
  DType moment_dtype = DType::F32;
  bool stochastic_rounding = false;
  int64_t micro_batch_tokens = 4096;  // a micro-batch holds whole sequences up to this many tokens
  // Each micro-batch's token count is padded up to a multiple of this (0: the backend's
  // row_granule(), 16 on CUDA) with copies of a prefix of its first sequence, as sequences of
  // their own that nothing scores: every product of the micro-batch then takes the fast path
  // (no tail product on ragged counts). The padding rows only repeat real rows (their q/k/v
  // amax is that of the rows they copy; MoE routing: that of the rows they copy) and get a zero
  // gradient, so the scored log-probs and the gradients are those of the unpadded batch — with
  // an FP8 wgrad, whose 1x128 blocks run along the tokens, the padding rows can raise the scale
  // of the last 128-token block (the loss stays exact). Padding never takes a micro-batch past
  // micro_batch_tokens (the memory plan's bound): one that would go past it is left unpadded.
  int64_t pad_tokens_to = 0;
  bool recompute = false;             // block recomputation in backward (ForwardOptions::recompute)
  bool cache_fp8_weights = true;      // the FP8 weight cache (above); false: the ops quantize w per call
  // With the cache: also each FP8 linear's W^T (wqt, as large as wq) for the dgrad; false: wqt
  // stays undefined and the dgrad transposes wq per call (the same bits, slower; the memory plan
  // resolves train.dgrad_weight_cache: auto into this).
  bool dgrad_weight_cache = true;
  // A frozen policy (the KL reference): it only scores. It keeps just its compute weights — the
  // FP8 linears' wq, BF16 copies with BF16 activations, F32 norms — and no master, gradients or
  // moments (2 B or ~1 B per parameter instead of 16). step() and master() are errors.
  bool frozen = false;
  // Mixture-of-experts models: train the router too (its gradient flows through the routing
  // weights). Off by default, as in the reference RL recipes: the router gets no gradient and
  // no optimizer update (no weight decay either).
  bool train_router = false;
  // Routing replay (train.routing_replay, as slime's and veRL's): the forwards of score() and
  // step() use the generator's experts (TrainSequence::routing) instead of the router's top-k,
  // with the routing weights from the trainer's router logits over them (ForwardOptions::
  // replay_routing). Sequences without a record route as usual.
  bool routing_replay = false;
};

// The trainer's routing against the generator's (score() of sequences that carry a routing
// record), over the positions whose next-token log-probs are scored (a response token's is
// predicted at the position before it) and every MoE layer. Sums: they add over micro-batches
// and ranks.
struct RoutingAgreement {
  int64_t pairs = 0;          // (position, MoE layer) pairs with a generator record
  int64_t agreed = 0;         // ... where the experts the trainer used are the generator's (as sets)
  int64_t router_agreed = 0;  // ... where the trainer router's own top-k is (= agreed without replay)
};

struct ScoreResult {
  std::vector<float> logp;        // [response tokens, packed] log p(token | prefix), trainer numerics
  std::vector<float> entropy;     // [response tokens] when asked
  std::vector<std::vector<float>> q_amax, k_amax, v_amax;  // [micro-batch][layer] when asked
  // When the sequences carry routing records (MoE): per response token, 1 when the experts the
  // trainer used at its predicting position agree with the generator's in every MoE layer (0
  // otherwise, or without a record there), and the counts.
  std::vector<uint8_t> routing_agreed;  // [response tokens]
  RoutingAgreement routing;
};

// Appends b's scores (sequences after a's) to a: per-token arrays concatenated, amax lists
// appended, routing counts summed.
void score_results_append(ScoreResult& a, const ScoreResult& b);

// What a forward that scores records (Trainer::score's entropy and record_amax).
struct ScoreRequest {
  bool entropy = false;
  bool record_amax = false;
};

// loss_fn(first_seq, end_seq, logp_new, grad): the micro-batch holds sequences [first, end);
// logp_new packs their response tokens; it writes dloss/dlogp_new into grad (same size) and
// returns the micro-batch's share of the loss.
using TokenLossFn = std::function<double(size_t first_seq, size_t end_seq, const std::vector<float>& logp_new,
                                         std::vector<float>& grad)>;

struct StepResult {
  double loss = 0;
  double grad_norm = 0;  // before clipping
  bool applied = false;  // false: a non-finite loss, gradient or activation; the update was skipped
  std::string skip_reason;
};

// Fault handling of a training loop: every skipped step (StepResult::applied false: a
// non-finite loss or gradient) is logged to stderr and counted; `max_in_a_row` consecutive
// skips abort the run with an Error that says what happened and what to do (`hint`).
class BadStepGuard {
 public:
  BadStepGuard(int max_in_a_row, std::string hint);
  // Records the outcome of optimizer step `r` taken during loop step `step`; returns r.applied.
  bool record(const StepResult& r, int64_t step);
  int in_a_row() const { return in_a_row_; }
  int64_t total_skipped() const { return total_; }

 private:
  int max_in_a_row_, in_a_row_ = 0;
  int64_t total_ = 0;
  std::string hint_;
};

class Trainer {
 public:
  // `master`: the policy on the backend's device, F32 (it becomes the master weights).
  Trainer(Backend& backend, ModelWeights master, const EnginePrecision& precision, const TrainerOptions& options);

  ScoreResult score(const std::vector<TrainSequence>& seqs, float temperature, bool entropy, bool record_amax);
  // With `score` and `scored`: the step's forward also scores its sequences, appending to
  // *scored what score(seqs, temperature, score->entropy, score->record_amax) would have returned
  // before the step (the forward runs on the same weights, and its log-probs are the ones the
  // loss sees; on the CPU reference bitwise score()'s, tested). A step that meets a non-finite
  // value leaves *scored with the micro-batches done before it.
  StepResult step(const std::vector<TrainSequence>& seqs, float temperature, const TokenLossFn& loss_fn, float lr,
                  const ScoreRequest* score = nullptr, ScoreResult* scored = nullptr);

  // Data parallelism: step() sums the loss and the gradients over the communicator's ranks
  // before the norm, the clipping and AdamW, so every rank takes the same step. `seqs` is then
  // this rank's share (possibly empty) and loss_fn must normalize by the global count.
  // nullptr (the default): one rank.
  // shard_optimizer (ZeRO-1): each parameter's AdamW moments live on one owner rank (whole
  // tensors, largest first to the least-loaded rank); the owner updates it and broadcasts the
  // new weights. Bitwise the same step as unsharded; the moments take 8 B/param / W per rank.
  // Call before load_optimizer_state (a checkpoint's full state loads on any rank count).
  void set_communicator(Communicator* comm, bool shard_optimizer = false);
  // The generator's per-layer E4M3 KV scales of the rollout being scored and trained on. When the
  // trainer's recipe says kv_cache e4m3, score() and step() round k and v with them as the
  // generator's cache did (ForwardOptions::kv_round_k/v); otherwise they are ignored. Empty: no
  // rounding (e.g. before the first calibration).
  void set_kv_rounding(std::vector<float> k_scales, std::vector<float> v_scales);
  bool kv_rounding() const { return !kv_round_k_.empty(); }
  bool optimizer_sharded() const { return !owner_.empty(); }
  // Sharded: a collective that brings every moment to rank 0 for optimizer_state() (call it on
  // every rank before rank 0 saves a checkpoint). Unsharded: nothing to do.
  void gather_optimizer_state();

  // Mutable access marks the FP8 weight cache stale: write the weights before the next score()
  // or step() (a reference kept past that and written later is not seen by the cache).
  ModelWeights& master() {
    FP8RL_CHECK(!opt_.frozen, "a frozen policy has no master weights to write");
    wq_stale_ = true;
    return master_;
  }
  const ModelWeights& master() const { return master_; }
  const EnginePrecision& precision() const { return prec_; }
  const TrainerOptions& options() const { return opt_; }
  int64_t optimizer_step() const { return adam_step_; }
  // How many times the FP8 weight cache was (re)quantized (tests, benchmarks).
  int64_t weight_cache_refreshes() const { return wq_refreshes_; }
  // Bytes of the dgrad's W^T copies held (data + scales; 0 without them), as the memory plan's
  // "trainer FP8 dgrad weights (W^T)" line counts them.
  int64_t dgrad_weight_cache_bytes() const;
  // Padding rows run so far by score() and step() (TrainerOptions::pad_tokens_to).
  int64_t padding_tokens() const { return pad_tokens_; }
  // The gradients of the last step(), after clipping (tests).
  const ModelWeights& gradients() const { return grads_; }

  // Optimizer state for checkpoints: the moments as named host tensors ("<param>.exp_avg",
  // "<param>.exp_avg_sq") in their dtype (TrainerOptions::moment_dtype) and the step counter;
  // loading requires that dtype (a resumed run continues bit for bit).
  std::vector<std::pair<std::string, Tensor>> optimizer_state() const;
  void load_optimizer_state(const std::function<Tensor(const std::string&)>& get, int64_t adam_step);

 private:
  // step()'s forward and backward over every micro-batch: accumulates r.loss, the gradients
  // and r.grad_norm; throws NonFiniteError on non-finite data.
  void forward_backward(const std::vector<TrainSequence>& seqs, float temperature, const TokenLossFn& loss_fn,
                        StepResult& r, const ScoreRequest* score, ScoreResult* scored);
  // Whole sequences [first, end) per micro-batch.
  std::vector<std::pair<size_t, size_t>> micro_batches(const std::vector<TrainSequence>& seqs) const;
  int64_t pad_granule() const;  // TrainerOptions::pad_tokens_to, or the backend's row_granule()

  // The weights forward and backward read: master_'s tensors, plus the cached wq of every
  // FP8_BLOCK linear when the cache is on. Requantizes when stale.
  const ModelWeights& compute_weights();
  void check_weight_cache() const;  // debug builds: the cache equals quantize_128x128(w)

  Backend& be_;
  ModelWeights master_, grads_, m_, v_;
  Tensor grads_arena_;  // every gradient is a view into it (model_grads_alloc): zeroed in one fill
  ModelWeights compute_;             // master_ + the cache (shares master_'s tensors)
  std::vector<QuantTensor> wq_;      // [FP8 linears, model_for_each_linear order] the cache
  std::vector<QuantTensor> wqt_;     // [same] their transposes (empty: frozen, or no dgrad_weight_cache)
  std::vector<Tensor> w16_;          // BF16 compute copies (BF16 linears, embedding, lm_head) with BF16 activations
  bool wq_stale_ = true;
  int64_t wq_refreshes_ = 0;
  int64_t pad_tokens_ = 0;
  EnginePrecision prec_;
  TrainerOptions opt_;
  int64_t adam_step_ = 0;
  std::vector<float> kv_round_k_, kv_round_v_;  // set_kv_rounding, when the recipe rounds
  Communicator* comm_ = nullptr;
  std::vector<int> owner_;  // [parameters] ZeRO-1 owner rank of each; empty: unsharded
  std::vector<Tensor*> m_ptr_, v_ptr_;  // [parameters] into m_, v_ (undefined where not owned)
  std::vector<std::pair<std::string, Tensor>> gathered_;  // rank 0, sharded: the last gather
  int64_t gathered_step_ = -1;
  // Each owner's parameters `of` (params_of order), packed, broadcast from the owner.
  void broadcast_from_owners(const std::vector<Tensor*>& of, std::vector<Tensor>* keep_host);
};

}  // namespace fp8rl
