// The op table: one case per Backend op (and per shape / dtype / mode worth its own row), as
// ggml's test-backend-ops. A case makes seeded host inputs (never zeros), runs the op on a
// backend, and says how each output compares with the CPU reference's (its tolerance class).
// Two runners read the table:
//   tests/cpu/test_op_table.cpp        the CPU alone: each case runs twice (bitwise the same:
//                                      the threaded reference is deterministic), every output is
//                                      written (outputs start as NaN), the case's invariants and
//                                      contract violations hold, its gradient is checked by
//                                      FP64 finite differences where it has one, and its naive
//                                      references (the spec written out) hold;
//   tests/cuda/test_cuda_op_table.cpp  CUDA against the CPU: the same inputs on both, each output
//                                      compared by its class, plus the case's GPU expectations
//                                      (FP8 products on the tensor cores).
// Performance mode: FP8RL_OP_TABLE_PERF=1 times every case (mean of a few runs after a warm-up)
// and prints one line per case, on either runner.
// Adding an op = adding a row in op_table.cpp (its naive reference and gradient check beside it,
// or in op_reference.cpp, which attaches the CPU's spec checks to the first row of their op).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "support/test_support.h"

namespace fp8rl::test {

// How an output of the backend under test compares with the CPU reference's.
struct Tolerance {
  enum Kind {
    kBitwise,  // the same bytes (quantize, conversion, KV-cache writes, routing choices)
    kRel,      // max |a - b| / max |b| < bound (NaN anywhere fails)
    kNear,     // |a - b| <= bound * max(1, |b|) element by element
    kGemm,     // FP8 block GEMMs: DeepGEMM's 1 - 2 sum(ab) / sum(a^2 + b^2) < bound, and kRel < rel
  } kind = kRel;
  double bound = 0, rel = 0;
};
inline Tolerance bitwise() { return {Tolerance::kBitwise, 0, 0}; }
inline Tolerance rel(double bound) { return {Tolerance::kRel, bound, 0}; }
inline Tolerance near(double bound) { return {Tolerance::kNear, bound, 0}; }
inline Tolerance fp8_gemm() { return {Tolerance::kGemm, 1e-3, 2e-2}; }
// The class of a linear layer's output under `mode`: FP8 block as above; FP32 GEMMs 1e-5, BF16
// (same rounded operands) 1e-4; a BF16 output 1e-2.
Tolerance linear_tolerance(LinearMode mode, DType out);

// Named tensors: a case's inputs, or the outputs of one run.
using Tensors = std::map<std::string, Tensor>;

// One run of a case on one backend: the inputs (on the backend's device) and the outputs it makes.
struct OpRun {
  Backend& be;
  const Tensors& in;
  Tensors out;
  const Tensor& operator[](const std::string& name) const;
  // An output the op writes, poisoned first (NaN; I32 -1; E4M3 0), so an unwritten element fails.
  Tensor& output(const std::string& name, const Shape& shape, DType dtype);
  // An output the op accumulates into (or updates in place): a copy of input `from`.
  Tensor& updated(const std::string& name, const std::string& from);
  // An input's values in another dtype (on the device).
  Tensor as(const std::string& name, DType dtype);
};

// An FP64 finite-difference check of an op's backward (CPU runner only). The scalar loss is the
// sum over `loss` of dot(output, weight input), so each weight is that output's upstream
// gradient; every `wrt` input (F64) is moved by +-h and the central difference compared with the
// backward's gradient output: max relative error < tol, and the gradient not (almost) zero
// (max |g| > 1e-3, else the check would be vacuous).
struct GradCheck {
  struct Wrt {
    std::string input, grad;
    std::vector<int64_t> which = {};  // the elements checked; empty: all
  };
  std::function<Tensors()> inputs;                        // F64 host inputs, the loss weights among them
  std::function<void(OpRun&)> forward;                    // makes the outputs the loss reads
  std::vector<std::pair<std::string, std::string>> loss;  // {output, weight input}
  std::function<void(OpRun&)> backward;  // makes the gradient outputs (running the forward if it needs)
  std::vector<Wrt> wrt;
  double h = 1e-5, tol = 1e-6;
  explicit operator bool() const { return static_cast<bool>(inputs); }
};

// A naive reference of an op (CPU runner only): the formula written out, on its own small
// inputs (FP64 where the op takes it), with its own tolerance: the CPU reference's specification.
using Reference = std::function<void(Backend& cpu)>;

struct OpCase {
  OpCase(std::string op_, std::string variant_, std::function<Tensors()> inputs_, std::function<void(OpRun&)> run_,
         std::vector<std::pair<std::string, Tolerance>> checks_ = {},
         std::vector<std::pair<std::string, std::string>> same_ = {})
      : op(std::move(op_)),
        variant(std::move(variant_)),
        inputs(std::move(inputs_)),
        run(std::move(run_)),
        checks(std::move(checks_)),
        same(std::move(same_)) {}

  std::string op;       // the Backend op(s) the case calls
  std::string variant;  // shapes, dtypes, modes
  std::function<Tensors()> inputs;
  std::function<void(OpRun&)> run;
  // Each output against the CPU's (GPU runner); an output named here must be one run() makes.
  std::vector<std::pair<std::string, Tolerance>> checks;
  // Outputs that must equal another output of the same run, bitwise (both runners): {a, b}.
  std::vector<std::pair<std::string, std::string>> same;
  // Outputs of one run close to another of the same run (both runners): {a, b (the reference), t}.
  std::vector<std::tuple<std::string, std::string, Tolerance>> close;
  // Properties of one run's outputs (host copies), checked on every backend.
  std::function<void(const Tensors& out)> invariants;
  // Calls that must throw fp8rl::Error on every backend (contract violations, bad data), given
  // the inputs on the backend's device.
  std::function<void(OpRun&)> errors;
  // FP64 finite differences of the op's backward (CPU runner only); empty: no gradient check.
  GradCheck grad;
  // Naive references of the op (CPU runner only), each named after what it checks.
  std::vector<std::pair<std::string, Reference>> references;
  // Environment set while the case runs (kernel selection switches).
  std::vector<std::pair<std::string, std::string>> env;
  // GPU only: FP8 products must take the tensor cores (no fallback), and this many of them run
  // a padded tail product (-1: not checked).
  bool no_fp8_fallback = false;
  int fp8_tails = -1;
  // GPU only: groups of grouped ops (the experts) that ran as one product each (-1: not checked).
  int grouped_loops = -1;
  // GPU only: linear_shared_input calls run as one concatenated product (-1: not checked).
  int concat_products = -1;

  std::string name() const { return op + ": " + variant; }
};

// Every case, built once.
const std::vector<OpCase>& op_table();

// Seeded inputs: normal(0, scale) values, and values with a wide dynamic range (each row scaled
// by 10^U(-6, 3), one all-zero row when rows > 2: the quantizer's amax == 0 rule).
Tensor rnd(const Shape& shape, uint32_t seed, DType dtype = DType::F32, float scale = 1.0f);
Tensor rnd_wide(int64_t rows, int64_t cols, uint32_t seed, DType dtype);
// Rows whose 1 x 128 blocks have the scales the quantizer's Fp8Divisor finds hardest (s = amax
// / 448 with the worst-rounded reciprocals among amax's significands, F32 or BF16, binades
// 2^-20 .. 2^20), each block holding +-amax once and values of every significand below it.
Tensor rnd_hard_scales(int64_t rows, int64_t cols, uint32_t seed, DType dtype);
Tensor i32_tensor(const std::vector<int32_t>& v, const Shape& shape);

// The CPU's spec checks (op_reference.cpp): naive references and finite-difference gradients,
// attached to the first row of their op.
void attach_references(std::vector<OpCase>& table);

// Runs `c` on `be` with host inputs `in` (copied to the device), with the case's environment.
Tensors run_case(const OpCase& c, Backend& be, const Tensors& in);
// Host copies of every output.
Tensors to_host(Backend& be, const Tensors& out);
// Checks c.same and c.invariants on one run's host outputs, and c.errors on `be`.
void check_run(const OpCase& c, Backend& be, const Tensors& in, const Tensors& out_host);
// c.grad on the CPU backend `cpu` (op_table_run.cpp).
void check_grad(const GradCheck& g, Backend& cpu);
// a against the reference b under t; `what` names the output in failures.
void expect_close(const Tensor& a, const Tensor& b, const Tolerance& t, const std::string& what);
// FP8RL_OP_TABLE_PERF=1: times c on be and prints a line (no-op otherwise).
void maybe_time_case(const OpCase& c, Backend& be, const Tensors& in);

// The gtest name of case i: its op and index.
std::string case_test_name(const ::testing::TestParamInfo<size_t>& info);

}  // namespace fp8rl::test
