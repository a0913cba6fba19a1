// The head-rows check's common body (tests/cpu/test_head_rows.cpp on the CPU,
// tests/cuda/test_cuda_head_rows.cpp on the GPU): the scoring forward + backward of a ragged
// batch run twice, once with the lm_head over every token (dlogp zero outside the chosen rows)
// and once over the chosen rows alone (ForwardOptions::head_rows), as the trainer runs it.
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "backend/backend.h"
#include "model/transformer.h"

namespace fp8rl::test {

// Each sequence's response tokens as the trainer picks them: the rows from prompt_len - 1 to
// the second-to-last token of every sequence of `batch` (prompts of `prompt_len` tokens).
inline std::vector<int64_t> head_rows_of(const ForwardBatch& batch, int prompt_len) {
  std::vector<int64_t> rows;
  for (int b = 0; b < batch.num_sequences(); ++b)
    for (int64_t t = batch.cu_seqlens[b] + prompt_len - 1; t + 1 < batch.cu_seqlens[b + 1]; ++t) rows.push_back(t);
  return rows;
}

// logp_full: the whole-batch head's logp read at `rows`; logp_rows: the head-rows forward's;
// grads[0] / grads[1]: the gradients of sum_i dl[i] * logp[rows[i]] from each.
inline void head_rows_run_twice(Backend& be, const ModelWeights& w, const EnginePrecision& prec,
                                const ForwardBatch& batch, const std::vector<int64_t>& rows,
                                std::vector<double>& logp_full, std::vector<double>& logp_rows,
                                ModelWeights grads[2]) {
  const int64_t T = batch.num_tokens(), R = static_cast<int64_t>(rows.size());
  std::vector<float> dl(R), dl_full(T, 0.0f);
  for (int64_t i = 0; i < R; ++i) dl_full[rows[i]] = dl[i] = 0.01f * static_cast<float>((i * 7) % 11) - 0.05f;
  for (int r = 0; r < 2; ++r) {
    Activations acts;
    ForwardOptions fo;
    fo.entropy = true;
    if (r == 1) fo.head_rows = &rows;
    const LogprobResult lr = model_forward_logprobs(be, w, prec, batch, fo, &acts);
    const Tensor h = be.to_host(lr.logp);
    std::vector<double> v(h.numel());
    for (int64_t i = 0; i < h.numel(); ++i) v[i] = h.dtype() == DType::F64 ? h.data<double>()[i] : h.data<float>()[i];
    if (r == 0) {
      ASSERT_EQ(h.numel(), T);
      logp_full.clear();
      for (int64_t t : rows) logp_full.push_back(v[t]);
    } else {
      ASSERT_EQ(h.numel(), R);
      ASSERT_EQ(lr.entropy.numel(), R);
      logp_rows = v;
    }
    grads[r] = model_grads_alloc(be, w, DType::F32);
    model_grads_zero(be, grads[r]);
    model_backward(be, w, prec, acts, be.to_device(from_float_vector(r == 0 ? dl_full : dl, {r == 0 ? T : R})),
                   grads[r]);
  }
}

}  // namespace fp8rl::test
