// The op table (tests/ops/op_table.h) on the CPU reference: every case runs twice and must give
// the same bits (the threaded reference is deterministic), write every output (they start as
// NaN / -1), keep its invariants, refuse its contract violations, pass its FP64
// finite-difference gradient check where it has one and its naive references (op_reference.cpp). FP8RL_OP_TABLE_PERF=1
// also times each case.
#include <gtest/gtest.h>

#include <cstring>

#include "ops/op_table.h"

namespace fp8rl::test {
namespace {

Backend& cpu() {
  static std::unique_ptr<Backend> be = make_cpu_backend();
  return *be;
}

class OpTableCpu : public ::testing::TestWithParam<size_t> {};

TEST_P(OpTableCpu, DeterministicWrittenAndConsistent) {
  const OpCase& c = op_table()[GetParam()];
  SCOPED_TRACE(c.name());
  const Tensors in = c.inputs();
  const Tensors a = to_host(cpu(), run_case(c, cpu(), in)), b = to_host(cpu(), run_case(c, cpu(), in));
  for (const auto& [name, check] : c.checks) ASSERT_TRUE(a.count(name)) << "the case makes no output " << name;
  for (const auto& [name, t] : a) {
    const Tensor& u = b.at(name);
    EXPECT_TRUE(t.nbytes() == u.nbytes() && std::memcmp(t.raw(), u.raw(), t.nbytes()) == 0)
        << name << ": two runs on the same inputs differ";
    const std::vector<double> v = values(t);
    for (size_t i = 0; i < v.size(); ++i) {
      if (t.dtype() == DType::I32) {
        ASSERT_GE(v[i], 0) << name << " element " << i << " was not written";
      } else {
        ASSERT_TRUE(std::isfinite(v[i])) << name << " element " << i << " is " << v[i] << " (not written?)";
      }
    }
  }
  check_run(c, cpu(), in, a);
  if (c.grad) check_grad(c.grad, cpu());
  for (const auto& [what, ref] : c.references) {
    SCOPED_TRACE(what);
    ref(cpu());
  }
  maybe_time_case(c, cpu(), in);
}

INSTANTIATE_TEST_SUITE_P(Table, OpTableCpu, ::testing::Range<size_t>(0, op_table().size()), case_test_name);

// The table covers every op of the interface (backend.h): adding an op means adding its row.
TEST(OpTableCpu, CoversEveryOp) {
  const char* ops[] = {"copy",
                       "convert",
                       "convert_many",
                       "fill",
                       "copy_cols",
                       "add",
                       "scale",
                       "sum_squares",
                       "all_finite",
                       "amax",
                       "embedding",
                       "rmsnorm",
                       "rmsnorm_fp8",
                       "add_rmsnorm",
                       "swiglu_fp8",
                       "swiglu_backward_fp8",
                       "add_fp8",
                       "linear",
                       "linear_shared_input",
                       "linear_backward",
                       "grouped_linear",
                       "rope",
                       "attention",
                       "swiglu",
                       "token_logprobs",
                       "logprobs_of_logits",
                       "moe_route_softmax",
                       "moe_route_sigmoid",
                       "moe_route_softmax_weights",
                       "moe_route_sigmoid_weights",
                       "moe_permute",
                       "moe_permute_fp8",
                       "mla_absorb",
                       "moe_unpermute",
                       "adamw",
                       "adamw_many",
                       "quantize",
                       "quantize_weights",
                       "kv_write",
                       "kv_round",
                       "attention_paged",
                       "sample",
                       "sample_rows"};
  for (const char* op : ops) {
    bool found = false;
    for (const OpCase& c : op_table()) {
      const std::string& s = c.op;
      for (size_t p = s.find(op); p != std::string::npos && !found; p = s.find(op, p + 1)) {
        const size_t e = p + std::strlen(op);
        found = (p == 0 || s[p - 1] == ' ') && (e == s.size() || s[e] == ' ' || s[e] == ')');
      }
    }
    EXPECT_TRUE(found) << "no op-table case calls " << op;
  }
}

}  // namespace
}  // namespace fp8rl::test
