// Helpers of the GPU model tests (test_cuda_model.cpp, test_cuda_mla.cpp): the fixtures
// directory, the CPU reference and the two CUDA backends, and the comparison of two value vectors.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace fp8rl::test {

// The fixtures: $FP8RL_TEST_DATA/fixtures, else ./tests/data/fixtures (gpu_run.sh runs from the
// repository root on the GPU machine, where the compiled-in path does not exist), else the
// compiled-in source path.
inline std::string fixtures_dir() {
  if (const char* e = std::getenv("FP8RL_TEST_DATA")) return std::string(e) + "/fixtures";
  if (std::filesystem::exists("tests/data/fixtures/reference.json")) return "tests/data/fixtures";
  return std::string(FP8RL_TEST_DATA) + "/fixtures";
}

// The CPU reference, and the GPU with F32 activations (the exact path) and with BF16 (the fast one).
struct ModelBackends {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu32 = make_cuda_backend(0, DType::F32);
  std::unique_ptr<Backend> gpu16 = make_cuda_backend(0, DType::BF16);
};
inline ModelBackends& env() {
  static ModelBackends e;
  return e;
}

struct Diff {
  double max_abs = 0, mean_abs = 0, rel = 0, deepgemm = 0;  // rel: max |a - b| / max |b|
  bool finite = true;
};

// got against ref: a non-finite value on either side makes max_abs, rel and deepgemm infinite.
inline Diff compare(const std::vector<double>& got, const std::vector<double>& ref) {
  Diff d;
  EXPECT_EQ(got.size(), ref.size());
  double m = 0, xy = 0, xx = 0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) d.finite = false;
    const double e = std::fabs(got[i] - ref[i]);
    d.max_abs = std::max(d.max_abs, e);
    d.mean_abs += e / static_cast<double>(got.size());
    m = std::max(m, std::fabs(ref[i]));
    xy += got[i] * ref[i];
    xx += got[i] * got[i] + ref[i] * ref[i];
  }
  d.rel = d.max_abs / std::max(m, 1e-30);
  d.deepgemm = xx > 0 ? 1.0 - 2.0 * xy / xx : 0.0;
  if (!d.finite) d.rel = d.deepgemm = d.max_abs = INFINITY;
  return d;
}

}  // namespace fp8rl::test
