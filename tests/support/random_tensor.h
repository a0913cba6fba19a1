// Seeded host tensors of the CPU tests: normal(0, scale) values drawn in double (F64 by default,
// for finite differences), and I32 index vectors.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
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

}  // namespace fp8rl::test
