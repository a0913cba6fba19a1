// The op table (tests/ops/op_table.h) on the GPU: every case runs on the CUDA backend and on the
// CPU reference with the same inputs, each output compared by its tolerance class; then the
// case's same-run checks, invariants and contract violations on the GPU, and its tensor-core
// expectations (no FP8 fallback, the padded tail products). FP8RL_OP_TABLE_PERF=1 also times
// each case on the GPU (e.g. --gtest_filter='Table/OpTableCuda.*linear*').
#include <gtest/gtest.h>

#include "ops/op_table.h"

namespace fp8rl::test {
namespace {

struct Backends {
  std::unique_ptr<Backend> gpu = make_cuda_backend(0);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
};
Backends& backends() {
  static Backends b;
  return b;
}

class OpTableCuda : public ::testing::TestWithParam<size_t> {};

TEST_P(OpTableCuda, MatchesCpu) {
  const OpCase& c = op_table()[GetParam()];
  SCOPED_TRACE(c.name());
  Backend& gpu = *backends().gpu;
  Backend& cpu = *backends().cpu;
  const Tensors in = c.inputs();
  const Tensors ref = to_host(cpu, run_case(c, cpu, in));
  const BackendCounters c0 = gpu.counters();
  const Tensors got = to_host(gpu, run_case(c, gpu, in));
  const BackendCounters c1 = gpu.counters();
  for (const auto& [name, tol] : c.checks) {
    ASSERT_TRUE(got.count(name) && ref.count(name)) << "the case makes no output " << name;
    expect_close(got.at(name), ref.at(name), tol, name);
  }
  check_run(c, gpu, in, got);
  if (c.no_fp8_fallback) {
    EXPECT_EQ(c1.fp8_gemm_fallbacks, c0.fp8_gemm_fallbacks) << "an FP8 product fell back";
  }
  // A ragged FP8 product runs either on the own kernel (any M) or on cuBLASLt with a padded tail.
  if (c.fp8_tails >= 0) {
    EXPECT_EQ(c1.fp8_gemm_tails - c0.fp8_gemm_tails + c1.fp8_gemm_own - c0.fp8_gemm_own, c.fp8_tails)
        << "padded tail products + own-kernel products";
  }
  if (c.concat_products >= 0) {
    EXPECT_EQ(c1.concat_products - c0.concat_products, c.concat_products) << "concatenated products";
  }
  if (c.grouped_loops >= 0) {
    EXPECT_EQ(c1.grouped_loops - c0.grouped_loops, c.grouped_loops) << "groups run one product each (no grouped path)";
  }
  maybe_time_case(c, gpu, in);
}

INSTANTIATE_TEST_SUITE_P(Table, OpTableCuda, ::testing::Range<size_t>(0, op_table().size()), case_test_name);

}  // namespace
}  // namespace fp8rl::test
