// The op table's machinery: inputs, runs, comparisons, timing (op_table.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>

#include "ops/op_table.h"

namespace fp8rl::test {

Tolerance linear_tolerance(LinearMode mode, DType out) {
  if (mode == LinearMode::FP8_BLOCK) return fp8_gemm();
  if (out == DType::BF16) return rel(1e-2);
  return rel(mode == LinearMode::FP32 ? 1e-5 : 1e-4);
}

Tensor rnd(const Shape& shape, uint32_t seed, DType dtype, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) x = nd(gen);
  return from_float_vector(v, shape, dtype);
}

Tensor rnd_wide(int64_t r, int64_t c, uint32_t seed, DType dtype) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ue(-6.0f, 3.0f);
  std::vector<float> v(r * c);
  for (int64_t i = 0; i < r; ++i) {
    const float s = std::pow(10.0f, ue(gen));
    for (int64_t j = 0; j < c; ++j) v[i * c + j] = nd(gen) * s;
  }
  if (r > 2)
    for (int64_t j = 0; j < c; ++j) v[1 * c + j] = 0.0f;
  return from_float_vector(v, {r, c}, dtype);
}

Tensor rnd_hard_scales(int64_t r, int64_t c, uint32_t seed, DType dtype) {
  // amax significands (every F32 one, or the 128 of BF16) ranked by how far 1 / s rounds from
  // the true reciprocal, s = amax / 448 as the quantizer computes it; the worst 64 (F32) or 16.
  std::vector<std::pair<double, float>> cand;
  const uint32_t step = dtype == DType::BF16 ? (1u << 16) : 1u;
  for (uint32_t m = 0; m < (1u << 23); m += step) {
    uint32_t u = 0x3f800000u | m;
    float amax;
    std::memcpy(&amax, &u, 4);
    const float s = amax / 448.0f, inv = 1.0f / s;
    const double e =
        std::fabs(static_cast<double>(inv) - 1.0 / static_cast<double>(s)) / std::ldexp(1.0, std::ilogb(inv) - 23);
    if (dtype == DType::BF16 || e > 0.499) cand.emplace_back(e, amax);
  }
  const size_t n = std::min<size_t>(dtype == DType::BF16 ? 16 : 64, cand.size());
  std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(n), cand.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-20, 20);
  std::vector<float> v(r * c);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t b0 = 0; b0 < c; b0 += 128) {
      const float amax = std::ldexp(cand[static_cast<size_t>(gen() % n)].second, ex(gen));
      const int64_t b1 = std::min<int64_t>(c, b0 + 128);
      for (int64_t j = b0; j < b1; ++j) v[i * c + j] = amax * u(gen);  // |v| < amax, also as BF16
      v[i * c + b0 + static_cast<int64_t>(gen() % static_cast<uint32_t>(b1 - b0))] = (gen() & 1) ? amax : -amax;
    }
  return from_float_vector(v, {r, c}, dtype);
}

Tensor i32_tensor(const std::vector<int32_t>& v, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::I32);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

const Tensor& OpRun::operator[](const std::string& name) const {
  const auto it = in.find(name);
  if (it == in.end()) throw Error("op table: the case has no input '" + name + "'");
  return it->second;
}

Tensor& OpRun::output(const std::string& name, const Shape& shape, DType dtype) {
  Tensor t = be.alloc(shape, dtype);
  be.fill(t, dtype == DType::I32 ? -1.0f : (dtype == DType::E4M3 || dtype == DType::U8 ? 0.0f : NAN));
  return out[name] = t;
}

Tensor& OpRun::updated(const std::string& name, const std::string& from) {
  const Tensor& src = (*this)[from];
  Tensor t = be.alloc(src.shape(), src.dtype());
  be.copy(src, t);
  return out[name] = t;
}

Tensor OpRun::as(const std::string& name, DType dtype) {
  const Tensor& src = (*this)[name];
  Tensor t = be.alloc(src.shape(), dtype);
  be.convert(src, t);
  return t;
}

namespace {
// Sets the case's environment for a scope.
struct CaseEnv {
  std::vector<std::unique_ptr<ScopedEnv>> vars;
  explicit CaseEnv(const OpCase& c) {
    for (const auto& [k, v] : c.env) vars.push_back(std::make_unique<ScopedEnv>(k.c_str(), v.c_str()));
  }
};

Tensors on_device(Backend& be, const Tensors& in) {
  Tensors d;
  for (const auto& [k, t] : in) d[k] = be.device() == DeviceKind::CPU ? t : be.to_device(t);
  return d;
}

bool bytes_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

int64_t first_diff(const Tensor& a, const Tensor& b) {
  const auto* p = static_cast<const uint8_t*>(a.raw());
  const auto* q = static_cast<const uint8_t*>(b.raw());
  for (size_t i = 0; i < std::min(a.nbytes(), b.nbytes()); ++i)
    if (p[i] != q[i]) return static_cast<int64_t>(i);
  return -1;
}
}  // namespace

Tensors run_case(const OpCase& c, Backend& be, const Tensors& in) {
  const CaseEnv env(c);
  const Tensors din = on_device(be, in);
  OpRun r{be, din, {}};
  c.run(r);
  be.synchronize();
  return r.out;
}

Tensors to_host(Backend& be, const Tensors& out) {
  Tensors h;
  for (const auto& [k, t] : out) h[k] = t.device() == DeviceKind::CPU ? t : be.to_host(t);
  return h;
}

void expect_close(const Tensor& a, const Tensor& b, const Tolerance& t, const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  switch (t.kind) {
    case Tolerance::kBitwise:
      EXPECT_TRUE(bytes_equal(a, b)) << what << ": first differing byte " << first_diff(a, b);
      break;
    case Tolerance::kRel:
      EXPECT_LT(rel_err(a, b), t.bound) << what;
      break;
    case Tolerance::kNear: {
      const std::vector<double> x = values(a), y = values(b);
      for (size_t i = 0; i < x.size(); ++i)
        EXPECT_NEAR(x[i], y[i], t.bound * std::max(1.0, std::fabs(y[i]))) << what << " element " << i;
      break;
    }
    case Tolerance::kGemm: {
      const std::vector<double> x = values(a), y = values(b);
      double xy = 0, xx = 0;
      bool finite = true;
      for (size_t i = 0; i < x.size(); ++i) {
        finite = finite && std::isfinite(x[i]);
        xy += x[i] * y[i];
        xx += x[i] * x[i] + y[i] * y[i];
      }
      const double diff = finite ? 1.0 - 2.0 * xy / xx : INFINITY;
      EXPECT_LT(diff, t.bound) << what << " (DeepGEMM diff; max rel err " << rel_err(a, b) << ")";
      EXPECT_LT(rel_err(a, b), t.rel) << what;
      break;
    }
  }
}

void check_run(const OpCase& c, Backend& be, const Tensors& in, const Tensors& out_host) {
  for (const auto& [a, b] : c.same) {
    ASSERT_TRUE(out_host.count(a) && out_host.count(b)) << c.name() << ": no output " << a << " or " << b;
    EXPECT_TRUE(bytes_equal(out_host.at(a), out_host.at(b))) << c.name() << ": " << a << " differs from " << b;
  }
  for (const auto& [a, b, tol] : c.close) {
    ASSERT_TRUE(out_host.count(a) && out_host.count(b)) << c.name() << ": no output " << a << " or " << b;
    expect_close(out_host.at(a), out_host.at(b), tol, c.name() + ": " + a + " against " + b);
  }
  if (c.invariants) c.invariants(out_host);
  if (c.errors) {
    const CaseEnv env(c);
    const Tensors din = on_device(be, in);
    OpRun r{be, din, {}};
    c.errors(r);
  }
}

void check_grad(const GradCheck& g, Backend& cpu) {
  Tensors in = g.inputs();
  auto loss = [&] {
    OpRun r{cpu, in, {}};
    g.forward(r);
    double s = 0;
    for (const auto& [o, w] : g.loss) {
      const std::vector<double> a = values(r.out.at(o)), b = values(in.at(w));
      for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    }
    return s;
  };
  OpRun rb{cpu, in, {}};
  g.backward(rb);
  for (const GradCheck::Wrt& w : g.wrt) {
    const std::string name = w.input + " -> " + w.grad;
    ASSERT_TRUE(in.count(w.input) && rb.out.count(w.grad)) << name << ": no such input or gradient";
    Tensor& x = in.at(w.input);
    const std::vector<double> analytic = values(rb.out.at(w.grad));
    ASSERT_EQ(x.dtype(), DType::F64) << name;
    ASSERT_EQ(static_cast<int64_t>(analytic.size()), x.numel()) << name;
    std::vector<int64_t> which = w.which;
    if (which.empty())
      for (int64_t i = 0; i < x.numel(); ++i) which.push_back(i);
    std::vector<double> fd, an;
    for (int64_t i : which) {
      double& e = x.data<double>()[i];
      const double orig = e;
      e = orig + g.h;
      const double lp = loss();
      e = orig - g.h;
      const double lm = loss();
      e = orig;
      fd.push_back((lp - lm) / (2 * g.h));
      an.push_back(analytic[i]);
    }
    double m = 0;
    for (double a : an) {
      ASSERT_TRUE(std::isfinite(a)) << name << ": the gradient is " << a << " (an accumulated output not zeroed?)";
      m = std::max(m, std::fabs(a));
    }
    ASSERT_GT(m, 1e-3) << name << ": gradient is (almost) zero, the check would be vacuous";
    EXPECT_LT(rel_err(an, fd), g.tol) << name;
  }
}

void maybe_time_case(const OpCase& c, Backend& be, const Tensors& in) {
  const char* e = std::getenv("FP8RL_OP_TABLE_PERF");
  if (!e || std::string(e) != "1") return;
  const CaseEnv env(c);
  const Tensors din = on_device(be, in);
  auto once = [&] {
    OpRun r{be, din, {}};
    c.run(r);
    be.synchronize();
  };
  once();  // warm-up: scratch buffers, caches
  const int reps = 5;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) once();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
  std::printf("  perf %-6s %-40s %12.1f us/run\n", be.device() == DeviceKind::CPU ? "cpu" : "cuda", c.name().c_str(),
              us);
}

std::string case_test_name(const ::testing::TestParamInfo<size_t>& info) {
  std::string n = op_table()[info.param].op;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n + "_" + std::to_string(info.param);
}

}  // namespace fp8rl::test
