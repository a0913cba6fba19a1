// Shared helpers of the CPU-op tests: random tensors, naive references, finite differences.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "support/test_support.h"

namespace fp8rl::test {

inline Tensor random_tensor(const Shape& shape, uint32_t seed, DType dtype = DType::F64, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> nd(0.0, scale);
  Tensor t = Tensor::empty(shape, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = nd(gen);
  if (dtype == DType::F64) return t;
  std::vector<float> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<float>(t.data<double>()[i]);
  return from_float_vector(v, shape, dtype);
}

inline Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  for (size_t i = 0; i < v.size(); ++i) t.data<int32_t>()[i] = v[i];
  return t;
}

// sum(out * R), the scalar loss whose gradient w.r.t. out is R.
inline double dot_loss(const Tensor& out, const Tensor& R) {
  const std::vector<double> a = values(out), b = values(R);
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central finite differences of loss() w.r.t. the elements `which` of the F64 tensor x
// (all when empty), compared with `analytic` (values of the backward's gradient).
inline void expect_grad(Tensor& x, const std::vector<double>& analytic, const std::function<double()>& loss,
                        const char* name, std::vector<int64_t> which = {}, double h = 1e-5, double tol = 1e-6) {
  ASSERT_EQ(x.dtype(), DType::F64);
  ASSERT_EQ(static_cast<int64_t>(analytic.size()), x.numel());
  if (which.empty())
    for (int64_t i = 0; i < x.numel(); ++i) which.push_back(i);
  std::vector<double> fd, an;
  for (int64_t i : which) {
    double& e = x.data<double>()[i];
    const double orig = e;
    e = orig + h;
    const double lp = loss();
    e = orig - h;
    const double lm = loss();
    e = orig;
    fd.push_back((lp - lm) / (2 * h));
    an.push_back(analytic[i]);
  }
  double m = 0;
  for (double a : an) m = std::max(m, std::fabs(a));
  ASSERT_GT(m, 1e-3) << name << ": gradient is (almost) zero, the check would be vacuous";
  EXPECT_LT(rel_err(an, fd), tol) << name;
}

}  // namespace fp8rl::test
