// CPU backend: contract violations of attention and token_logprobs. The CPU ops' naive
// references and FP64 finite-difference gradient checks are in the op table
// (tests/ops/op_reference.cpp, run by tests/cpu/test_op_table.cpp).
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "support/random_tensor.h"

namespace fp8rl {
namespace {

using test::i32_tensor;
using test::random_tensor;

class CpuOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
};

TEST_F(CpuOps, AttentionRejectsBadSeqlens) {
  const Tensor q = random_tensor({4, 2, 4}, 1), k = random_tensor({4, 1, 4}, 2);
  Tensor out = be->alloc({4, 2, 4}, DType::F64), lse = be->alloc({2, 4}, DType::F64);
  EXPECT_THROW(be->attention(q, k, k, {0, 3}, 1.0f, out, lse), Error);
  EXPECT_THROW(be->attention(q, k, k, {0, 3, 2, 4}, 1.0f, out, lse), Error);
  const Tensor k3 = random_tensor({4, 3, 4}, 2);
  EXPECT_THROW(be->attention(q, k3, k3, {0, 4}, 1.0f, out, lse), Error);
}

TEST_F(CpuOps, TokenLogprobsRejectsBadTargets) {
  const Tensor hidden = random_tensor({2, 4}, 1), lm = random_tensor({10, 4}, 2);
  Tensor logp = be->alloc({2}, DType::F64), lse = be->alloc({2}, DType::F64);
  EXPECT_THROW(be->token_logprobs(hidden, lm, i32_tensor({1, 10}), 1.0f, {}, logp, lse, nullptr), Error);
  EXPECT_THROW(be->token_logprobs(hidden, lm, i32_tensor({1, -1}), 1.0f, {}, logp, lse, nullptr), Error);
  EXPECT_THROW(be->token_logprobs(hidden, lm, i32_tensor({1, 2}), 0.0f, {}, logp, lse, nullptr), Error);
}

}  // namespace
}  // namespace fp8rl
