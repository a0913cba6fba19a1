// The rows of the op table (op_table.h): every op of backend/backend.h, on fresh random inputs
// (never zeros), ragged shapes (rows not a multiple of 128, a single row). Tolerance classes,
// against the CPU reference:
//   bitwise: quantize (every block shape, transpose, pow2), dtype conversion, copies, KV-cache
//            writes, routing choices, sampled tokens, amax;
//   GEMMs: FP32 1e-5, BF16 (same rounded operands) 1e-4; FP8 block: DeepGEMM's
//          1 - 2 sum(xy) / sum(x^2 + y^2) < 1e-3 and 2e-2 relative, against the CPU FP8 result;
//   other F32 ops 1e-5 (1e-4 where a long reduction feeds an exp), BF16 activations 1e-2
//   (backward 2e-2 / 3e-2 where two BF16 roundings meet).
// Every output starts as NaN (OpRun::output), so an unwritten element fails.
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "backend/sampling.h"
#include "ops/op_table.h"
#include "quant/quant.h"

namespace fp8rl::test {
namespace {

std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t x : d) s += (s.empty() ? "" : "x") + std::to_string(x);
  return s;
}

// ---- memory and element-wise ----------------------------------------------------------------

void memory_cases(std::vector<OpCase>& t) {
  t.push_back({"copy + fill",
               "37x129 F32",
               [] {
                 return Tensors{{"x", rnd({37, 129}, 1)}};
               },
               [](OpRun& r) {
                 r.be.copy(r["x"], r.output("copy", {37, 129}, DType::F32));
                 r.be.fill(r.output("filled", {37, 129}, DType::F32), 2.5f);
                 // +0 (a memset on CUDA) over BF16, and -0 (the element kernel: the sign kept).
                 r.be.fill(r.output("zeros", {37, 129}, DType::BF16), 0.0f);
                 r.be.fill(r.output("neg_zeros", {37, 129}, DType::F32), -0.0f);
               },
               {{"copy", bitwise()}, {"filled", bitwise()}, {"zeros", bitwise()}, {"neg_zeros", bitwise()}}});
  t.back().invariants = [](const Tensors& o) {
    for (double v : values(o.at("filled"))) ASSERT_EQ(v, 2.5);
    const Tensor& z = o.at("zeros");
    for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.data<uint16_t>()[i], 0u);
    const Tensor& nz = o.at("neg_zeros");
    for (int64_t i = 0; i < nz.numel(); ++i) ASSERT_TRUE(std::signbit(nz.data<float>()[i]) && nz.data<float>()[i] == 0);
  };
  t.push_back({"convert",
               "33x300 F32 -> BF16 -> F32, wide range; 32x300 (a multiple of 8: CUDA's 16-byte path)",
               [] {
                 return Tensors{{"x", rnd_wide(33, 300, 2, DType::F32)}, {"x8", rnd_wide(32, 300, 3, DType::F32)}};
               },
               [](OpRun& r) {
                 Tensor& bf = r.output("bf16", {33, 300}, DType::BF16);
                 r.be.convert(r["x"], bf);
                 r.be.convert(bf, r.output("back", {33, 300}, DType::F32));
                 Tensor& bf8 = r.output("bf16_x8", {32, 300}, DType::BF16);
                 r.be.convert(r["x8"], bf8);
                 r.be.convert(bf8, r.output("back_x8", {32, 300}, DType::F32));
               },
               {{"bf16", bitwise()}, {"back", bitwise()}, {"bf16_x8", bitwise()}, {"back_x8", bitwise()}}});
  t.back().invariants = [](const Tensors& o) {  // round to nearest even, then exactly back
    for (const char* sfx : {"", "_x8"}) {
      const Tensor& bf = o.at(std::string("bf16") + sfx);
      const Tensor ref = from_float_vector(to_float_vector(bf), bf.shape(), DType::F32);
      EXPECT_EQ(std::memcmp(ref.raw(), o.at(std::string("back") + sfx).raw(), ref.nbytes()), 0) << sfx;
    }
  };
  // The vectorized F32 -> BF16 stores convert in pairs by instruction (common.cuh, bf16_pack8):
  // exact ties both ways, FP32 subnormals (kept, rounded), the smallest normals, the largest
  // finite values BF16 rounds to, bitwise the CPU's rounding. (NaN and infinity: test_cuda_ops.)
  t.push_back({"convert",
               "F32 -> BF16 [4, 64] of rounding edges (ties, subnormals, BF16's largest finite values)",
               [] {
                 std::vector<float> v;
                 std::mt19937 gen(41);
                 for (int i = 0; v.size() < 256; ++i) {
                   const uint32_t hi = (gen() & 0x80000000u) | (gen() % 0x7f7fu << 16);  // a finite BF16 value
                   const uint32_t lows[] = {0x8000u, 0x7fffu, 0x8001u, 0x0001u, 0xffffu};
                   uint32_t u = hi | lows[i % 5];
                   if (i % 7 == 0) u = (gen() & 0x80000000u) | (gen() & 0x7fffffu);               // FP32 subnormal
                   if (i % 11 == 0) u = (gen() & 0x80000000u) | 0x7f7f0000u | (gen() & 0x7fffu);  // < max + ulp/2
                   float f;
                   std::memcpy(&f, &u, 4);
                   v.push_back(f);
                 }
                 return Tensors{{"x", from_float_vector(v, {4, 64}, DType::F32)}};
               },
               [](OpRun& r) {
                 r.be.convert(r["x"], r.output("bf16", {4, 64}, DType::BF16));
               },
               {{"bf16", bitwise()}}});
  t.push_back(
      {"convert_many",
       "F32 -> BF16 of 5 tensors (sizes 8 .. 33000, one of 301 elements: the per-tensor path), BF16 -> F32",
       [] {
         return Tensors{{"a", rnd_wide(1, 8, 30, DType::F32)},
                        {"b", rnd_wide(33, 1000, 31, DType::F32)},
                        {"c", rnd_wide(1, 301, 32, DType::F32)},
                        {"d", rnd_wide(16, 64, 33, DType::F32)},
                        {"e", rnd_wide(4, 80, 34, DType::BF16)}};
       },
       [](OpRun& r) {
         std::vector<Backend::ConvertJob> jobs;
         for (const char* n : {"a", "b", "c", "d", "e"}) {
           const Tensor& x = r[n];
           const DType to = x.dtype() == DType::F32 ? DType::BF16 : DType::F32;
           jobs.push_back({&x, &r.output(std::string(n) + "_many", x.shape(), to)});
           r.be.convert(x, r.output(std::string(n) + "_one", x.shape(), to));
         }
         r.be.convert_many(jobs);
       },
       {{"a_many", bitwise()},
        {"b_many", bitwise()},
        {"c_many", bitwise()},
        {"d_many", bitwise()},
        {"e_many", bitwise()}},
       {{"a_many", "a_one"}, {"b_many", "b_one"}, {"c_many", "c_one"}, {"d_many", "d_one"}, {"e_many", "e_one"}}});
  t.push_back({"copy_cols",
               "MLA's nope | rope concatenation, 5x3x(16+8)",
               [] {
                 return Tensors{{"a", rnd({15, 16}, 3)}, {"b", rnd({15, 8}, 4)}};
               },
               [](OpRun& r) {
                 Tensor& cat = r.output("cat", {15, 24}, DType::F32);
                 r.be.copy_cols(r["a"], 0, cat, 0, 16);
                 r.be.copy_cols(r["b"], 0, cat, 16, 8);
               },
               {{"cat", bitwise()}}});
  t.back().errors = [](OpRun& r) {
    Tensor cat = r.be.alloc({15, 24}, DType::F32);
    EXPECT_THROW(r.be.copy_cols(r["a"], 0, cat, 10, 16), Error);  // past the destination's columns
    Tensor other = r.be.alloc({14, 24}, DType::F32);
    EXPECT_THROW(r.be.copy_cols(r["a"], 0, other, 0, 16), Error);  // rows differ
  };
  t.push_back({"add + scale + sum_squares + all_finite",
               "77x65 F32",
               [] {
                 Tensor bad = rnd({77, 65}, 20);
                 bad.data<float>()[1234] = NAN;
                 Tensor ninf = rnd({77, 65}, 20);
                 ninf.data<float>()[1234] = -INFINITY;
                 return Tensors{{"a", rnd({77, 65}, 20)}, {"b", rnd({77, 65}, 21)}, {"bad", bad}, {"ninf", ninf}};
               },
               [](OpRun& r) {
                 r.be.add(r["a"], r["b"], r.output("sum", {77, 65}, DType::F32));
                 r.be.scale(r.updated("scaled", "a"), 0.37f);
                 Tensor ss = Tensor::empty({1}, DType::F64);  // host results of the reductions
                 ss.data<double>()[0] = r.be.sum_squares(r["a"]);
                 r.out["sum_squares"] = ss;
                 // sum_squares_total: bitwise the in-order loop of sum_squares on the same backend.
                 Tensor tot = Tensor::empty({2}, DType::F64);
                 tot.data<double>()[0] = r.be.sum_squares_total({&r["a"], &r["b"], &r["a"]});
                 double loop = 0.0;
                 for (const char* n : {"a", "b", "a"}) loop += r.be.sum_squares(r[n]);
                 tot.data<double>()[1] = loop;
                 r.out["sum_squares_total"] = tot;
                 Tensor fin = Tensor::empty({3}, DType::I32);
                 fin.data<int32_t>()[0] = r.be.all_finite(r["a"]);
                 fin.data<int32_t>()[1] = r.be.all_finite(r["bad"]);
                 fin.data<int32_t>()[2] = r.be.all_finite(r["ninf"]);
                 r.out["all_finite"] = fin;
               },
               {{"sum", rel(1e-7)},
                {"scaled", rel(1e-7)},
                {"sum_squares", rel(1e-9)},
                {"sum_squares_total", rel(1e-9)},
                {"all_finite", bitwise()}}});
  t.back().invariants = [](const Tensors& o) {
    EXPECT_EQ(values(o.at("all_finite")), (std::vector<double>{1, 0, 0}));
    const std::vector<double> tot = values(o.at("sum_squares_total"));
    EXPECT_EQ(tot[0], tot[1]) << "sum_squares_total differs from the loop of sum_squares";
  };
  t.back().errors = [](OpRun& r) {
    Tensor wrong = r.be.alloc({4, 5}, DType::F32);
    EXPECT_THROW(r.be.add(r["a"], r["b"], wrong), Error);
    Tensor h = r.be.alloc({77, 65}, DType::BF16);
    EXPECT_THROW(r.be.copy(r["a"], h), Error);  // copy does not convert
  };
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1) << 20}) {
      t.push_back({"amax",
                   std::string(dtype_name(dt)) + " n " + std::to_string(n),
                   [=] {
                     return Tensors{{"x", rnd({n}, 25 + static_cast<uint32_t>(n), dt, 3.0f)}};
                   },
                   [](OpRun& r) {
                     // Slot 1 of a zeroed accumulator, then slot 2 over a prior 1e6 (stays 1e6).
                     Tensor& acc = r.output("amax", {3}, DType::F32);
                     Tensor prior = Tensor::empty({3}, DType::F32);
                     prior.data<float>()[0] = prior.data<float>()[1] = 0.0f;
                     prior.data<float>()[2] = 1e6f;
                     r.be.copy(r.be.device() == DeviceKind::CPU ? prior : r.be.to_device(prior), acc);
                     r.be.amax(r["x"], acc, 1);
                     r.be.amax(r["x"], acc, 2);
                   },
                   {{"amax", bitwise()}}});  // max is exact
      t.back().invariants = [](const Tensors& o) {
        const std::vector<double> v = values(o.at("amax"));
        EXPECT_EQ(v[0], 0.0) << "another slot changed";
        EXPECT_GT(v[1], 0.0);
        EXPECT_EQ(v[2], 1e6) << "the amax must accumulate (max with the slot's value)";
      };
    }
  // BF16 through the 16-byte-chunk kernel (aligned, n % 8 == 0) and the element kernel (a view
  // one element in: unaligned), a negative NaN at an odd index (the high half of a chunk's word).
  t.push_back({"amax",
               "BF16 4097: aligned and unaligned views, -NaN at an odd index",
               [] {
                 Tensor x = rnd({4097}, 27, DType::BF16, 2.0f), y = rnd({4096}, 28, DType::BF16);
                 x.data<uint16_t>()[3001] = 0xc2f0;  // -120: the largest |x|, in the unaligned view only
                 y.data<uint16_t>()[1233] = 0xffc0;  // -NaN
                 return Tensors{{"x", x}, {"nan", y}};
               },
               [](OpRun& r) {
                 Tensor acc = r.be.alloc({3}, DType::F32);
                 r.be.fill(acc, 0.0f);
                 r.be.amax(r["x"].slice_rows(1, 4097), acc, 0);
                 r.be.amax(r["x"].slice_rows(0, 4096), acc, 1);
                 r.be.amax(r["nan"], acc, 2);
                 const Tensor a = r.be.device() == DeviceKind::CPU ? acc : r.be.to_host(acc);
                 Tensor h = Tensor::empty({3}, DType::F32);
                 h.data<float>()[0] = a.data<float>()[0];
                 h.data<float>()[1] = a.data<float>()[1];
                 h.data<float>()[2] = std::isnan(a.data<float>()[2]) ? 1.0f : 0.0f;
                 r.out["amax"] = h;
               },
               {{"amax", bitwise()}}});
  t.back().invariants = [](const Tensors& o) {
    const std::vector<double> v = values(o.at("amax"));
    EXPECT_EQ(v[0], 120.0);
    EXPECT_EQ(v[1], 120.0);  // index 3001 is in both views
    EXPECT_EQ(v[2], 1.0) << "a BF16 NaN must come back as NaN";
  };
  t.push_back({"amax",
               "F32 5000, one -1e30 and one NaN",
               [] {
                 Tensor x = rnd({5000}, 26), y = rnd({5000}, 26);
                 x.data<float>()[4321] = -1e30f;
                 y.data<float>()[4321] = -1e30f;
                 y.data<float>()[17] = NAN;
                 return Tensors{{"x", x}, {"nan", y}};
               },
               [](OpRun& r) {
                 Tensor acc = r.be.alloc({3}, DType::F32);
                 r.be.fill(acc, 0.0f);
                 r.be.amax(r["x"], acc, 0);
                 r.be.amax(r["nan"], acc, 1);
                 r.be.amax(r["x"], acc, 1);  // a NaN slot stays NaN
                 const Tensor a = r.be.device() == DeviceKind::CPU ? acc : r.be.to_host(acc);
                 Tensor h = Tensor::empty({3}, DType::F32);  // the NaN as a flag: outputs are finite
                 h.data<float>()[0] = a.data<float>()[0];
                 h.data<float>()[1] = std::isnan(a.data<float>()[1]) ? 1.0f : 0.0f;
                 h.data<float>()[2] = a.data<float>()[2];
                 r.out["amax"] = h;
               },
               {{"amax", bitwise()}}});
  t.back().invariants = [](const Tensors& o) {
    const std::vector<double> v = values(o.at("amax"));
    EXPECT_EQ(v[0], double(1e30f));
    EXPECT_EQ(v[1], 1.0) << "a NaN must come back as NaN";
    EXPECT_EQ(v[2], 0.0);
  };
  t.back().errors = [](OpRun& r) {
    Tensor acc = r.be.alloc({2}, DType::F32), wrong = r.be.alloc({2}, DType::BF16);
    EXPECT_THROW(r.be.amax(r["x"], acc, 2), Error);
    EXPECT_THROW(r.be.amax(r["x"], acc, -1), Error);
    EXPECT_THROW(r.be.amax(r["x"], wrong, 0), Error);
  };
}

// ---- quantization ----------------------------------------------------------------------------

void quantize_cases(std::vector<OpCase>& t) {
  // quantize x (or x^T) into an [R, C] QuantTensor of br x 128 blocks: its codes and scales.
  const auto quantize_run = [](int64_t R, int64_t C, int br, bool pow2, bool transpose) {
    return [=](OpRun& run) {
      QuantTensor q = run.be.alloc_quant(R, C, br, 128, pow2);
      run.be.fill(q.scales, NAN);
      run.be.quantize(run["x"], transpose, q);
      run.out["data"] = q.data;
      run.out["scales"] = q.scales;
    };
  };
  // Widths that are multiples of 8 take the vectorized kernels, the others the element-wise
  // ones; {200, 136} and {130, 264} transposed give output rows not 16-byte aligned (mixed
  // 16-byte and byte stores) and partial tiles.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 128},  {1, 300},   {7, 128},   {130, 257}, {256, 512},
                                                {3, 1000}, {200, 129}, {200, 136}, {130, 264}, {384, 256}};
  uint32_t seed = 10;
  for (const auto& [rows, cols] : shapes)
    for (DType dt : {DType::F32, DType::BF16})
      for (bool transpose : {false, true})
        for (int br : {1, 128})
          for (bool pow2 : {false, true}) {
            const uint32_t s = seed++;
            const int64_t r = rows, c = cols, R = transpose ? c : r, C = transpose ? r : c;
            t.push_back({"quantize",
                         dims({r, c}) + " " + dtype_name(dt) + (transpose ? " T" : "") + " blocks " +
                             std::to_string(br) + "x128" + (pow2 ? " pow2" : ""),
                         [=] {
                           return Tensors{{"x", rnd_wide(r, c, s, dt)}};
                         },
                         quantize_run(R, C, br, pow2, transpose),
                         {{"scales", bitwise()}, {"data", bitwise()}}});
            if (r == 130 && c == 257 && dt == DType::F32 && !transpose && br == 1 && !pow2)
              t.back().invariants = [=](const Tensors& o) {  // the reference quantizer itself
                QuantTensor ref = quant_alloc(R, C, br, 128, pow2);
                quantize_blocks_into(rnd_wide(r, c, s, dt), transpose, ref);
                EXPECT_EQ(std::memcmp(ref.data.raw(), o.at("data").raw(), ref.data.nbytes()), 0);
              };
          }
  // Blocks whose scales are the hardest for the GPU quantizers' division-free quotients
  // (fp8_rule.h, Fp8Divisor): codes bitwise the CPU's x / s, rows, 128 x 128 blocks, transposed.
  for (DType dt : {DType::F32, DType::BF16})
    for (bool transpose : {false, true})
      for (int br : {1, 128}) {
        const int64_t r = 256, c = 1024, R = transpose ? c : r, C = transpose ? r : c;
        t.push_back({"quantize",
                     dims({r, c}) + " " + dtype_name(dt) + (transpose ? " T" : "") + " blocks " + std::to_string(br) +
                         "x128, the hardest scales",
                     [=] {
                       return Tensors{{"x", rnd_hard_scales(r, c, 77, dt)}};
                     },
                     quantize_run(R, C, br, false, transpose),
                     {{"scales", bitwise()}, {"data", bitwise()}}});
      }
  t.push_back({"quantize",
               "non-finite input (NaN, Inf) is an error",
               [] {
                 Tensors in;
                 for (float bad : {NAN, INFINITY}) {
                   Tensor x = rnd({5, 256}, 3);
                   x.data<float>()[3 * 256 + 17] = bad;
                   in[std::isnan(bad) ? "nan" : "inf"] = x;
                 }
                 return in;
               },
               [](OpRun&) {},
               {}});
  t.back().errors = [](OpRun& r) {
    for (const char* name : {"nan", "inf"}) {
      QuantTensor q = r.be.alloc_quant(5, 256, 1, 128, false);
      EXPECT_THROW(r.be.quantize(r[name], false, q), Error) << name;
      QuantTensor qt = r.be.alloc_quant(256, 5, 128, 128, false);
      EXPECT_THROW(r.be.quantize(r[name], true, qt), Error) << name;
    }
    QuantTensor wrong = r.be.alloc_quant(5, 200, 1, 128, false);
    EXPECT_THROW(r.be.quantize(r["nan"], false, wrong), Error);  // shape mismatch: the contract
  };
  // The trainer's batched weight copies: W and W^T of weights of several shapes (partial tiles,
  // a width not a multiple of 8: CUDA's per-tensor fallback; F32 and BF16), in one call.
  {
    const std::pair<int64_t, int64_t> wshapes[] = {{256, 384}, {130, 264}, {200, 129}, {1, 128}, {384, 136}};
    for (bool pow2 : {false, true})
      t.push_back({"quantize_weights",
                   std::string("5 weights, W and W^T, 128x128 blocks") + (pow2 ? " pow2" : ""),
                   [=] {
                     Tensors in;
                     uint32_t s = 900;
                     for (size_t k = 0; k < std::size(wshapes); ++k)
                       in["w" + std::to_string(k)] =
                           rnd_wide(wshapes[k].first, wshapes[k].second, s++, k == 2 ? DType::BF16 : DType::F32);
                     return in;
                   },
                   [=](OpRun& run) {
                     std::vector<QuantTensor> q, qt;
                     for (const auto& [n, k] : wshapes) {
                       q.push_back(run.be.alloc_quant(n, k, 128, 128, pow2));
                       qt.push_back(run.be.alloc_quant(k, n, 128, 128, pow2));
                       run.be.fill(q.back().scales, NAN);
                       run.be.fill(qt.back().scales, NAN);
                     }
                     std::vector<Backend::WeightQuantJob> jobs;
                     for (size_t k = 0; k < q.size(); ++k)  // weight 3 without its W^T copy
                       jobs.push_back({&run["w" + std::to_string(k)], &q[k], k == 3 ? nullptr : &qt[k]});
                     run.be.quantize_weights(jobs);
                     for (size_t k = 0; k < q.size(); ++k) {
                       const std::string n = std::to_string(k);
                       run.out["q" + n] = q[k].data;
                       run.out["qs" + n] = q[k].scales;
                       if (k == 3) continue;
                       run.out["qt" + n] = qt[k].data;
                       run.out["qts" + n] = qt[k].scales;
                       // bitwise the single op on the same backend
                       QuantTensor one = run.be.alloc_quant(wshapes[k].second, wshapes[k].first, 128, 128, pow2);
                       run.be.quantize(run["w" + n], true, one);
                       run.out["one_t" + n] = one.data;
                       run.out["one_ts" + n] = one.scales;
                     }
                   },
                   [] {
                     std::vector<std::pair<std::string, Tolerance>> tol;
                     for (int k = 0; k < 5; ++k) {
                       const std::string n = std::to_string(k);
                       tol.push_back({"q" + n, bitwise()});
                       tol.push_back({"qs" + n, bitwise()});
                       if (k == 3) continue;  // no W^T copy asked
                       tol.push_back({"qt" + n, bitwise()});
                       tol.push_back({"qts" + n, bitwise()});
                     }
                     return tol;
                   }(),
                   {{"qt0", "one_t0"},
                    {"qts0", "one_ts0"},
                    {"qt1", "one_t1"},
                    {"qts1", "one_ts1"},
                    {"qt2", "one_t2"},
                    {"qts2", "one_ts2"},
                    {"qt4", "one_t4"},
                    {"qts4", "one_ts4"}}});
    t.back().errors = [](OpRun& r) {
      QuantTensor q = r.be.alloc_quant(256, 384, 128, 128, false), wrong = r.be.alloc_quant(256, 384, 1, 128, false);
      EXPECT_THROW(r.be.quantize_weights({{&r["w0"], &wrong}}), Error);  // 1x128 blocks: not a weight copy
      QuantTensor bad_t = r.be.alloc_quant(256, 384, 128, 128, false);
      EXPECT_THROW(r.be.quantize_weights({{&r["w0"], &q, &bad_t}}), Error);  // W^T of the wrong shape
      Tensor h = r.be.to_host(r["w0"]);
      h.data<float>()[5 * 384 + 7] = NAN;
      const Tensor nan_w = r.be.to_device(h);
      EXPECT_THROW(
          {
            r.be.quantize_weights({{&nan_w, &q}});
            r.be.synchronize();
          },
          Error);  // non-finite: at the next synchronization at the latest
    };
  }
}

// ---- linear layers ---------------------------------------------------------------------------

struct Gemm {
  int64_t M, N, K;
};
std::string gemm_name(const Gemm& g) { return dims({g.M, g.N, g.K}); }

LinearWeight weight_of(OpRun& r, bool bias) {
  LinearWeight W;
  W.w = r["w"];
  if (bias) W.bias = r["bias"];
  return W;
}

void linear_cases(std::vector<OpCase>& t) {
  // cuBLASLt FP8 block path: M, N % 16 and K % 128; the rest fall back (dequantize + FP32 GEMM).
  const Gemm fwd[] = {{1, 256, 128},    {16, 256, 512}, {130, 384, 256}, {256, 512, 384},
                      {128, 640, 1024}, {64, 128, 200}, {48, 256, 128}};
  uint32_t seed = 100;
  for (const Gemm& g : fwd)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK})
      for (DType odt : {DType::F32, DType::BF16}) {
        if (mode == LinearMode::FP32 && odt == DType::BF16) continue;
        const LinearSpec spec{mode, (seed % 2) == 1};
        const uint32_t sx = seed++;
        const bool bias = (seed % 3) == 0;
        const uint32_t sw = seed++;
        t.push_back({"linear",
                     gemm_name(g) + " " + linear_mode_name(mode) + (spec.pow2_scales ? " pow2" : "") + " out " +
                         dtype_name(odt) + (bias ? " bias" : ""),
                     [=] {
                       Tensors in{{"x", rnd({g.M, g.K}, sx)}, {"w", rnd({g.N, g.K}, sw, DType::F32, 0.05f)}};
                       if (bias) in["bias"] = rnd({g.N}, sw + 1);
                       return in;
                     },
                     [=](OpRun& r) {  // the CPU reference in F32, as the GPU's is compared with it
                       const DType o = r.be.device() == DeviceKind::CPU ? DType::F32 : odt;
                       r.be.linear(r["x"], weight_of(r, bias), spec, r.output("out", {g.M, g.N}, o));
                     },
                     {{"out", linear_tolerance(mode, odt)}}});
      }
  // linear_cols: the product written into columns [N, 2N) of a [M, 3N] output (the consistent
  // generator's vocabulary chunks of its logits, CUDA: the GEMM's row stride), bitwise linear()
  // into [M, N] then copy_cols; the other columns keep their values. BF16 with the consistent spec
  // (the lm_head's), FP32, FP8 (the composed default on every backend); a chunk of 384 columns.
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP32, LinearMode::FP8_BLOCK}) {
    const Gemm g{37, 384, 256};
    LinearSpec spec{mode, false};
    spec.consistent = mode == LinearMode::BF16;
    t.push_back({"linear_cols",
                 gemm_name(g) + " " + linear_mode_name(mode) + (spec.consistent ? " consistent" : "") +
                     " into columns [N, 2N) of [M, 3N]",
                 [=] {
                   return Tensors{{"x", rnd({g.M, g.K}, 61)},
                                  {"w", rnd({g.N, g.K}, 62, DType::F32, 0.05f)},
                                  {"base", rnd({g.M, 3 * g.N}, 63)}};
                 },
                 [=](OpRun& r) {
                   Tensor& out = r.output("out", {g.M, 3 * g.N}, DType::F32);
                   r.be.copy(r["base"], out);
                   r.be.linear_cols(r["x"], weight_of(r, false), spec, out, g.N);
                   Tensor& ref = r.output("out_composed", {g.M, 3 * g.N}, DType::F32);
                   r.be.copy(r["base"], ref);
                   Tensor tmp = r.be.alloc({g.M, g.N}, DType::F32);
                   r.be.linear(r["x"], weight_of(r, false), spec, tmp);
                   r.be.copy_cols(tmp, 0, ref, g.N, g.N);
                 },
                 {{"out", linear_tolerance(mode, DType::F32)}},
                 {{"out", "out_composed"}}});
    t.back().errors = [=](OpRun& r) {
      Tensor out = r.be.alloc({g.M, 2 * g.N}, DType::F32);
      EXPECT_THROW(r.be.linear_cols(r["x"], weight_of(r, false), spec, out, g.N + 1), Error);  // past the width
      EXPECT_THROW(r.be.linear_cols(r["x"], weight_of(r, false), spec, out, -1), Error);
      Tensor rows = r.be.alloc({g.M + 1, 2 * g.N}, DType::F32);
      EXPECT_THROW(r.be.linear_cols(r["x"], weight_of(r, false), spec, rows, 0), Error);  // M mismatch
    };
  }
  // linear_chunked (the consistent generator's logits): w's rows in chunks of 384 (three whole
  // chunks and one of 100), bitwise linear_cols of each chunk; BF16 consistent (CUDA: one GEMM of
  // the whole chunks once its first call's probe found it the same bits) and FP32.
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP32}) {
    const int64_t M = 37, K = 256, V = 3 * 384 + 100, chunk = 384;
    LinearSpec spec{mode, false};
    spec.consistent = true;
    t.push_back({"linear_chunked",
                 std::string(linear_mode_name(mode)) + " consistent, V 1252 in chunks of 384",
                 [=] {
                   return Tensors{{"x", rnd({M, K}, 64, mode == LinearMode::BF16 ? DType::BF16 : DType::F32)},
                                  {"w", rnd({V, K}, 65, mode == LinearMode::BF16 ? DType::BF16 : DType::F32, 0.05f)}};
                 },
                 [=](OpRun& r) {
                   const bool cpu = r.be.device() == DeviceKind::CPU;
                   const Tensor x = cpu ? r.as("x", DType::F32) : r["x"];
                   const Tensor w = cpu ? r.as("w", DType::F32) : r["w"];
                   r.be.linear_chunked(x, w, spec, chunk, r.output("out", {M, V}, DType::F32));
                   r.be.linear_chunked(x, w, spec, chunk, r.output("out_again", {M, V}, DType::F32));
                   Tensor& ref = r.output("out_chunks", {M, V}, DType::F32);
                   for (int64_t v0 = 0; v0 < V; v0 += chunk) {
                     LinearWeight part;
                     part.w = w.slice_rows(v0, std::min(V, v0 + chunk));
                     r.be.linear_cols(x, part, spec, ref, v0);
                   }
                 },
                 {{"out", linear_tolerance(mode, DType::F32)}},
                 {{"out", "out_chunks"}, {"out_again", "out_chunks"}}});
    t.back().errors = [=](OpRun& r) {
      Tensor narrow = r.be.alloc({M, V - 1}, DType::F32);
      EXPECT_THROW(r.be.linear_chunked(r["x"], r["w"], spec, chunk, narrow), Error);  // out is not [M, V]
      Tensor out = r.be.alloc({M, V}, DType::F32);
      EXPECT_THROW(r.be.linear_chunked(r["x"], r["w"], spec, 0, out), Error);  // chunk >= 1
    };
  }
  // A pre-quantized weight (the generator's wq, the trainer's per-step cache) gives the result of
  // quantizing w.
  for (const Gemm& g : {Gemm{256, 512, 384}, Gemm{130, 384, 256}}) {
    const LinearSpec spec{LinearMode::FP8_BLOCK, false};
    t.push_back({"linear",
                 gemm_name(g) + " fp8 with W.wq only",
                 [=] {
                   return Tensors{{"x", rnd({g.M, g.K}, 7)}, {"w", rnd({g.N, g.K}, 8, DType::F32, 0.05f)}};
                 },
                 [=](OpRun& r) {
                   LinearWeight W;
                   W.wq = r.be.alloc_quant(g.N, g.K, 128, 128, false);
                   r.be.quantize(r["w"], false, W.wq);
                   r.be.linear(r["x"], W, spec, r.output("out", {g.M, g.N}, DType::F32));
                   r.be.linear(r["x"], weight_of(r, false), spec, r.output("out_w", {g.M, g.N}, DType::F32));
                 },
                 {{"out", fp8_gemm()}},
                 {{"out", "out_w"}}});
    t.back().errors = [=](OpRun& r) {
      LinearWeight W;
      W.wq = r.be.alloc_quant(g.N, g.K, 128, 128, false);
      r.be.quantize(r["w"], false, W.wq);
      Tensor out = r.be.alloc({g.M, g.N}, DType::F32);
      EXPECT_THROW(r.be.linear(r["x"], W, {LinearMode::FP8_BLOCK, true}, out), Error);  // pow2 mismatch
      EXPECT_THROW(r.be.linear(r["x"], W, {LinearMode::FP32, false}, out), Error);      // FP32 needs w
      Tensor narrow = r.be.alloc({g.M, g.N - 1}, DType::F32);
      EXPECT_THROW(r.be.linear(r["x"], weight_of(r, false), spec, narrow), Error);
    };
  }
  // dgrad with a pre-quantized weight takes W.wq transposed instead of requantizing W.w, or the
  // cached transpose W.wqt (the trainer's): bitwise the same dx, with or without w.
  for (const Gemm& g : {Gemm{256, 512, 384}, Gemm{130, 200, 260}, Gemm{64, 384, 128}})
    for (bool pow2 : {false, true}) {
      const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
      t.push_back({"linear_backward",
                   gemm_name(g) + " fp8 dgrad with W.wq, W.wqt" + (pow2 ? " pow2" : ""),
                   [=] {
                     return Tensors{{"x", rnd({g.M, g.K}, 40)},
                                    {"dy", rnd({g.M, g.N}, 41)},
                                    {"w", rnd({g.N, g.K}, 42, DType::F32, 0.05f)}};
                   },
                   [=](OpRun& r) {
                     const LinearWeight W = weight_of(r, false);
                     r.be.linear_backward(r["dy"], r["x"], W, spec, &r.output("dx_w", {g.M, g.K}, DType::F32), nullptr,
                                          nullptr);
                     LinearWeight both = W;
                     both.wq = r.be.alloc_quant(g.N, g.K, 128, 128, pow2);
                     r.be.quantize(W.w, false, both.wq);
                     r.be.linear_backward(r["dy"], r["x"], both, spec, &r.output("dx_both", {g.M, g.K}, DType::F32),
                                          nullptr, nullptr);
                     LinearWeight only_q;
                     only_q.wq = both.wq;
                     r.be.linear_backward(r["dy"], r["x"], only_q, spec, &r.output("dx_q", {g.M, g.K}, DType::F32),
                                          nullptr, nullptr);
                     // The trainer's cache: wq and its transpose wqt (quantize(w, transpose) with
                     // 128x128 blocks), with and without w.
                     LinearWeight cached = both;
                     cached.wqt = r.be.alloc_quant(g.K, g.N, 128, 128, pow2);
                     r.be.quantize(W.w, true, cached.wqt);
                     r.be.linear_backward(r["dy"], r["x"], cached, spec, &r.output("dx_t", {g.M, g.K}, DType::F32),
                                          nullptr, nullptr);
                     cached.w = Tensor();
                     r.be.linear_backward(r["dy"], r["x"], cached, spec, &r.output("dx_tq", {g.M, g.K}, DType::F32),
                                          nullptr, nullptr);
                     r.out["wqt"] = cached.wqt.data;
                     r.out["wqt_scales"] = cached.wqt.scales;
                     r.out["wq"] = both.wq.data;
                     r.out["wq_scales"] = both.wq.scales;
                   },
                   {{"dx_q", fp8_gemm()}, {"dx_t", fp8_gemm()}, {"wqt", bitwise()}, {"wqt_scales", bitwise()}},
                   {{"dx_both", "dx_w"}, {"dx_q", "dx_w"}, {"dx_t", "dx_w"}, {"dx_tq", "dx_w"}}});
      // wqt is wq's exact transpose (data and scale grid).
      t.back().invariants = [](const Tensors& o) {
        QuantTensor q;
        q.data = o.at("wq");
        q.scales = o.at("wq_scales");
        q.block_rows = q.block_cols = 128;
        const QuantTensor qt = transpose_128x128(q);
        EXPECT_EQ(std::memcmp(qt.data.raw(), o.at("wqt").raw(), qt.data.nbytes()), 0) << "wqt data";
        EXPECT_EQ(std::memcmp(qt.scales.raw(), o.at("wqt_scales").raw(), qt.scales.nbytes()), 0) << "wqt scales";
      };
      t.back().errors = [=](OpRun& r) {  // the spec's pow2 must match the cached weight's
        LinearWeight only_q;
        only_q.wq = r.be.alloc_quant(g.N, g.K, 128, 128, pow2);
        r.be.quantize(r["w"], false, only_q.wq);
        Tensor dx = r.be.alloc({g.M, g.K}, DType::F32);
        EXPECT_THROW(
            r.be.linear_backward(r["dy"], r["x"], only_q, {LinearMode::FP8_BLOCK, !pow2}, &dx, nullptr, nullptr),
            Error);
        LinearWeight with_t = only_q;
        with_t.wqt = r.be.alloc_quant(g.K, g.N, 128, 128, !pow2);  // quantized with the other pow2
        r.be.quantize(r["w"], true, with_t.wqt);
        EXPECT_THROW(r.be.linear_backward(r["dy"], r["x"], with_t, spec, &dx, nullptr, nullptr), Error);
        with_t.wqt = r.be.alloc_quant(g.N, g.K, 128, 128, pow2);  // not transposed
        EXPECT_THROW(r.be.linear_backward(r["dy"], r["x"], with_t, spec, &dx, nullptr, nullptr), Error);
      };
    }
  seed = 300;
  const Gemm bwd[] = {{128, 256, 384}, {48, 256, 128}, {130, 200, 384}, {256, 128, 512}, {1, 128, 256}};
  for (const Gemm& g : bwd)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK}) {
      const LinearSpec spec{mode, (seed % 2) == 0};
      const uint32_t sx = seed++, sdy = seed++, sw = seed++, sdw = seed++, sdb = seed++;
      t.push_back({"linear_backward",
                   gemm_name(g) + " " + linear_mode_name(mode) + (spec.pow2_scales ? " pow2" : ""),
                   [=] {
                     return Tensors{{"x", rnd({g.M, g.K}, sx)},
                                    {"dy", rnd({g.M, g.N}, sdy)},
                                    {"w", rnd({g.N, g.K}, sw, DType::F32, 0.05f)},
                                    {"bias", rnd({g.N}, sw + 1)},
                                    {"dw0", rnd({g.N, g.K}, sdw, DType::F32, 0.1f)},
                                    {"db0", rnd({g.N}, sdb)}};
                   },
                   [=](OpRun& r) {
                     r.be.linear_backward(r["dy"], r["x"], weight_of(r, true), spec,
                                          &r.output("dx", {g.M, g.K}, DType::F32), &r.updated("dw", "dw0"),
                                          &r.updated("dbias", "db0"));
                   },
                   {{"dx", linear_tolerance(mode, DType::F32)},
                    {"dw", linear_tolerance(mode, DType::F32)},
                    {"dbias", rel(1e-5)}}});
    }
  // The trainer's micro-batches have ragged token counts: every FP8 product must stay on the
  // tensor cores (rows M % 16 != 0 as a padded tail product; the wgrad's token contraction padded
  // to a multiple of 128), match the CPU reference, and count no fallback.
  seed = 900;
  for (const Gemm& g :
       {Gemm{1, 256, 384}, Gemm{15, 256, 384}, Gemm{17, 512, 256}, Gemm{1000, 512, 1024}, Gemm{4099, 256, 384}})
    for (bool pow2 : {false, true}) {
      const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
      const uint32_t sx = seed++, sdy = seed++, sw = seed++, sdw = seed++;
      t.push_back({"linear + linear_backward",
                   gemm_name(g) + " fp8 ragged tokens" + (pow2 ? " pow2" : ""),
                   [=] {
                     return Tensors{{"x", rnd({g.M, g.K}, sx)},
                                    {"dy", rnd({g.M, g.N}, sdy)},
                                    {"w", rnd({g.N, g.K}, sw, DType::F32, 0.05f)},
                                    {"dw0", rnd({g.N, g.K}, sdw, DType::F32, 0.1f)}};
                   },
                   [=](OpRun& r) {
                     const LinearWeight W = weight_of(r, false);
                     const DType o = r.be.device() == DeviceKind::CPU ? DType::F32 : DType::BF16;
                     r.be.linear(r["x"], W, spec, r.output("out", {g.M, g.N}, o));
                     r.be.linear_backward(r["dy"], r["x"], W, spec, &r.output("dx", {g.M, g.K}, DType::F32),
                                          &r.updated("dw", "dw0"), nullptr);
                   },
                   {{"out", fp8_gemm()}, {"dx", fp8_gemm()}, {"dw", fp8_gemm()}}});
      t.back().no_fp8_fallback = true;
      if (g.M % 16 != 0) t.back().fp8_tails = 2;  // forward and dgrad
    }
}

// ---- layers ----------------------------------------------------------------------------------

void layer_cases(std::vector<OpCase>& t) {
  // The embedding's backward adds each table row's tokens in token order (CUDA: after a stable
  // sort by id, no atomics): bitwise the CPU's, here with runs of ~60 tokens per row.
  t.push_back({"embedding_backward",
               "V 64, D 136, 3000 ids over 50 rows (long runs), BF16 dout",
               [] {
                 std::vector<int32_t> ids(3000);
                 for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + i / 7) % 50);
                 return Tensors{{"ids", i32_tensor(ids, {3000})},
                                {"dout", rnd({3000, 136}, 33, DType::BF16)},
                                {"dt0", rnd({64, 136}, 34)}};
               },
               [](OpRun& r) { r.be.embedding_backward(r["ids"], r["dout"], r.updated("dtable", "dt0")); },
               {{"dtable", bitwise()}}});
  {
    const int64_t V = 300, D = 96;
    const std::vector<int32_t> ids = {5, 299, 0, 5, 17, 42, 5};
    t.push_back({"embedding + embedding_backward",
                 "V 300, D 96, 7 ids (repeated)",
                 [=] {
                   std::vector<int32_t> bad = ids;
                   bad[3] = 300;
                   return Tensors{{"table", rnd({V, D}, 30)},
                                  {"ids", i32_tensor(ids, {7})},
                                  {"bad_ids", i32_tensor(bad, {7})},
                                  {"dout", rnd({7, D}, 31)},
                                  {"dt0", rnd({V, D}, 32)}};
                 },
                 [=](OpRun& r) {
                   r.be.embedding(r["ids"], r["table"], r.output("out", {7, D}, DType::F32));
                   r.be.embedding_backward(r["ids"], r["dout"], r.updated("dtable", "dt0"));
                 },
                 {{"out", bitwise()}, {"dtable", bitwise()}}});
    t.back().errors = [=](OpRun& r) {
      // A data error (on the GPU found on the device) surfaces at the next synchronizing call at
      // the latest, once, naming the op; the backend is usable afterwards.
      Tensor out = r.be.alloc({7, D}, DType::F32);
      try {
        r.be.embedding(r["bad_ids"], r["table"], out);
        r.be.synchronize();
        ADD_FAILURE() << "an out-of-range id was not reported";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("embedding"), std::string::npos) << e.what();
      }
      r.be.synchronize();
      r.be.embedding(r["ids"], r["table"], out);
      EXPECT_NO_THROW(r.be.synchronize());
      Tensor wrong = r.be.alloc({6, D}, DType::F32);
      EXPECT_THROW(r.be.embedding(r["ids"], r["table"], wrong), Error);
    };
  }
  // RMSNorm: the model's rows (D 320) and the q/k-norm head shapes (D <= 256, one warp per row).
  struct Norm {
    int64_t R, D;
    uint32_t seed;
    double fwd, rstd;
    bool dw_from_input;
  };
  std::vector<Norm> norms;
  for (int64_t R : {int64_t(1), int64_t(131)}) norms.push_back({R, 320, 40, 1e-5, 1e-5, true});
  for (int64_t D : {int64_t(128), int64_t(64), int64_t(40), int64_t(256)})
    for (int64_t R : {int64_t(1), int64_t(9), int64_t(4099)}) norms.push_back({R, D, 60, 1e-6, 1e-6, false});
  for (const Norm& n : norms)
    for (DType dt : {DType::F32, DType::BF16}) {
      const bool f32 = dt == DType::F32;
      t.push_back({"rmsnorm + rmsnorm_backward",
                   dims({n.R, n.D}) + " " + dtype_name(dt),
                   [=] {
                     return Tensors{
                         {"x", rnd({n.R, n.D}, n.seed, dt)},
                         {"w", rnd({n.D}, n.seed + 1)},
                         {"g", rnd({n.R, n.D}, n.seed + 2, dt)},
                         {"dw0", n.dw_from_input ? rnd({n.D}, n.seed + 3) : Tensor::zeros({n.D}, DType::F32)}};
                   },
                   [=](OpRun& r) {
                     Tensor& out = r.output("out", {n.R, n.D}, dt);
                     Tensor& rstd = r.output("rstd", {n.R}, DType::F32);
                     r.be.rmsnorm(r["x"], r["w"], 1e-6f, out, &rstd);
                     r.be.rmsnorm_backward(r["g"], r["x"], r["w"], rstd, r.output("dx", {n.R, n.D}, dt),
                                           r.updated("dw", "dw0"));
                   },
                   {{"out", rel(f32 ? n.fwd : 1e-2)},
                    {"rstd", rel(n.rstd)},
                    {"dx", rel(f32 ? 1e-5 : 2e-2)},
                    {"dw", rel(f32 ? 1e-5 : 1e-2)}}});
    }
  // RoPE: the test shapes (hd 64) and the model's heads (several heads per thread).
  struct Rope {
    int64_t T, H, hd;
    float theta;
    uint32_t seed;
    bool bf16;
  };
  const Rope ropes[] = {{19, 3, 64, 10000.0f, 50, false},
                        {37, 16, 128, 1000000.0f, 70, true},
                        {300, 8, 128, 1000000.0f, 70, true},
                        {5, 32, 64, 1000000.0f, 70, true},
                        {3, 1, 64, 1000000.0f, 70, true}};
  for (const Rope& rc : ropes)
    for (DType dt : {DType::F32, DType::BF16}) {
      if (dt == DType::BF16 && !rc.bf16) continue;
      for (bool inverse : {false, true}) {
        t.push_back(
            {"rope",
             dims({rc.T, rc.H, rc.hd}) + " " + dtype_name(dt) + (inverse ? " inverse" : ""),
             [=] {
               std::vector<int32_t> pos(rc.T);
               for (int64_t i = 0; i < rc.T; ++i) pos[i] = static_cast<int32_t>((i * 397) % 4000);
               return Tensors{{"x", rnd({rc.T, rc.H, rc.hd}, rc.seed + inverse, dt)}, {"pos", i32_tensor(pos, {rc.T})}};
             },
             [=](OpRun& r) {
               RopeParams rp;
               for (int i = 0; i < rc.hd / 2; ++i) rp.inv_freq.push_back(std::pow(rc.theta, -2.0f * i / rc.hd));
               r.be.rope(r.updated("x", "x"), r["pos"], rp, inverse);
             },
             {{"x", rel(dt == DType::F32 ? 1e-5 : 1e-2)}}});
      }
    }
  // q/k-norm and RoPE fused (Qwen3's heads, hd 64 and 128, both pair layouts, an F32 norm weight
  // on BF16 rows as the trainer's master): the values of rmsnorm then rope, bit for bit on each
  // backend ("composed" below), and the CPU's to the two ops' tolerance.
  struct NormRope {
    int64_t T, H, hd;
    bool interleaved;
    DType wdt = DType::F32;  // the norm weight's (BF16: the generator's copy)
  };
  for (const NormRope& nr : {NormRope{37, 4, 128, false}, NormRope{300, 8, 128, false}, NormRope{19, 3, 64, false},
                             NormRope{21, 2, 64, true}, NormRope{5, 16, 96, false}, NormRope{9, 2, 256, false},
                             NormRope{33, 4, 128, false, DType::BF16}, NormRope{7, 3, 72, false}})
    for (DType dt : {DType::F32, DType::BF16}) {
      t.push_back(
          {"rmsnorm_rope",
           dims({nr.T, nr.H, nr.hd}) + " " + dtype_name(dt) + (nr.interleaved ? " interleaved" : "") +
               (nr.wdt == DType::BF16 ? " BF16 weight" : ""),
           [=] {
             std::vector<int32_t> pos(nr.T);
             for (int64_t i = 0; i < nr.T; ++i) pos[i] = static_cast<int32_t>((i * 211) % 3000);
             return Tensors{{"x", rnd({nr.T, nr.H, nr.hd}, 90 + static_cast<uint32_t>(nr.hd), dt, 2.0f)},
                            {"w", rnd({nr.hd}, 91, nr.wdt)},
                            {"pos", i32_tensor(pos, {nr.T})}};
           },
           [=](OpRun& r) {
             RopeParams rp;
             for (int i = 0; i < nr.hd / 2; ++i) rp.inv_freq.push_back(std::pow(1e6f, -2.0f * i / nr.hd));
             rp.interleaved = nr.interleaved;
             rp.attention_scaling = nr.interleaved ? 1.25f : 1.0f;
             Tensor& rstd = r.output("rstd", {nr.T * nr.H}, DType::F32);
             r.be.rmsnorm_rope(r["x"], r["w"], 1e-6f, r["pos"], rp, r.output("out", {nr.T, nr.H, nr.hd}, dt), &rstd);
             Tensor& c = r.output("composed", {nr.T, nr.H, nr.hd}, dt);
             Tensor& crstd = r.output("composed_rstd", {nr.T * nr.H}, DType::F32);
             r.be.rmsnorm(r["x"], r["w"], 1e-6f, c, &crstd);
             r.be.rope(c, r["pos"], rp, /*inverse=*/false);
           },
           {{"out", rel(dt == DType::F32 ? 1e-5 : 1e-2)},
            {"rstd", rel(1e-6)},
            {"composed", rel(dt == DType::F32 ? 1e-5 : 1e-2)},
            {"composed_rstd", rel(1e-6)}},
           {{"out", "composed"}, {"rstd", "composed_rstd"}}});
      t.back().errors = [](OpRun& r) {
        RopeParams rp;
        rp.inv_freq.assign(static_cast<size_t>(r["x"].dim(2) / 2), 1.0f);
        Tensor same = r["x"];
        EXPECT_THROW(r.be.rmsnorm_rope(r["x"], r["w"], 1e-6f, r["pos"], rp, same, nullptr), Error);  // aliasing
        RopeParams short_table;
        short_table.inv_freq.assign(3, 1.0f);
        Tensor out = r.be.alloc(r["x"].shape(), r["x"].dtype());
        EXPECT_THROW(r.be.rmsnorm_rope(r["x"], r["w"], 1e-6f, r["pos"], short_table, out, nullptr), Error);
      };
    }
  for (DType dt : {DType::F32, DType::BF16}) {
    const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
    t.push_back({"swiglu + swiglu_backward",
                 std::string("33x200 ") + dtype_name(dt),
                 [=] {
                   return Tensors{{"g", rnd({33, 200}, 60, dt, 3.0f)},
                                  {"u", rnd({33, 200}, 61, dt)},
                                  {"d", rnd({33, 200}, 62, dt)}};
                 },
                 [=](OpRun& r) {
                   r.be.swiglu(r["g"], r["u"], r.output("out", {33, 200}, dt));
                   r.be.swiglu_backward(r["d"], r["g"], r["u"], r.output("dgate", {33, 200}, dt),
                                        r.output("dup", {33, 200}, dt));
                 },
                 {{"out", rel(tol)}, {"dgate", rel(tol)}, {"dup", rel(tol)}}});
  }
  {
    AdamWParams p;
    p.lr = 1e-2f;
    p.weight_decay = 0.01f;
    p.step = 3;
    t.push_back(
        {"adamw",
         "1000 F32, step 3",
         [] {
           Tensor v = rnd({1000}, 73);
           for (int64_t i = 0; i < 1000; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
           return Tensors{
               {"w", rnd({1000}, 70)}, {"g", rnd({1000}, 71)}, {"m", rnd({1000}, 72, DType::F32, 0.1f)}, {"v", v}};
         },
         [=](OpRun& r) { r.be.adamw(r.updated("w", "w"), r["g"], r.updated("m", "m"), r.updated("v", "v"), p); },
         {{"w", rel(1e-6)}, {"m", rel(1e-6)}, {"v", rel(1e-6)}}});
    t.back().errors = [=](OpRun& r) {
      Tensor w = r.be.alloc({1000}, DType::F32), m = r.be.alloc({1000}, DType::F32), v = r.be.alloc({999}, DType::F32);
      EXPECT_THROW(r.be.adamw(w, r["g"], m, v, p), Error);  // shapes differ
      AdamWParams p0 = p;
      p0.step = 0;
      Tensor v2 = r.be.alloc({1000}, DType::F32);
      EXPECT_THROW(r.be.adamw(w, r["g"], m, v2, p0), Error);  // steps are 1-based
    };
  }
  // The optimizer step over many tensors in one call: sizes from 1 to past one CUDA chunk, odd
  // ones (the 8-wide path's tail), each tensor its own weight decay and rounding key, BF16 and
  // F32 moments and gradients mixed (runs of one dtype share a launch); bitwise the loop of adamw.
  for (DType md : {DType::BF16, DType::F32}) {
    const int64_t sizes[] = {1, 1000, 8197, 37, 16384 + 8, 3};
    const int n = static_cast<int>(std::size(sizes));
    auto name = [](const char* what, int k) { return what + std::to_string(k); };
    t.push_back(
        {"adamw_many", std::string("6 tensors, 1..16392 elements, ") + dtype_name(md) + " moments, stochastic rounding",
         [=] {
           Tensors in;
           for (int k = 0; k < n; ++k) {
             const int64_t e = sizes[k];
             Tensor v = rnd({e}, 80 + 4 * k);
             for (int64_t i = 0; i < e; ++i) v.data<float>()[i] = 0.01f * std::fabs(v.data<float>()[i]);
             in[name("w", k)] = rnd({e}, 81 + 4 * k);
             in[name("g", k)] = rnd({e}, 82 + 4 * k, k % 2 ? DType::BF16 : DType::F32, 0.1f);
             in[name("m", k)] = rnd({e}, 83 + 4 * k, md, 0.05f);
             in[name("v", k)] = md == DType::BF16 ? from_float_vector(to_float_vector(v), {e}, DType::BF16) : v;
           }
           return in;
         },
         [=](OpRun& r) {
           auto params = [&](int k) {
             AdamWParams p;
             p.lr = 1e-3f;
             p.weight_decay = k % 3 ? 0.01f * k : 0.0f;
             p.step = 7;
             p.grad_scale = 0.5f;
             p.stochastic_rounding = md == DType::BF16;
             p.rounding_key = 0x6f7074696d000000ull + k;
             return p;
           };
           std::vector<Backend::AdamWJob> jobs;
           for (int k = 0; k < n; ++k)
             jobs.push_back({&r.updated(name("w", k), name("w", k)), &r[name("g", k)],
                             &r.updated(name("m", k), name("m", k)), &r.updated(name("v", k), name("v", k)),
                             params(k)});
           r.be.adamw_many(jobs);
           for (int k = 0; k < n; ++k)
             r.be.adamw(r.updated(name("w1_", k), name("w", k)), r[name("g", k)],
                        r.updated(name("m1_", k), name("m", k)), r.updated(name("v1_", k), name("v", k)), params(k));
         },
         [=] {
           std::vector<std::pair<std::string, Tolerance>> tol;
           for (int k = 0; k < n; ++k)
             for (const char* o : {"w", "m", "v"})
               tol.push_back({name(o, k), md == DType::BF16 ? bitwise() : rel(1e-6)});
           return tol;
         }(),
         [=] {
           std::vector<std::pair<std::string, std::string>> same;
           for (int k = 0; k < n; ++k)
             for (const char* o : {"w", "m", "v"}) same.push_back({name(o, k), name(o, k).insert(1, "1_")});
           return same;
         }()});
  }
}

// ---- fused producers of FP8 linear inputs and linear_shared_input --------------------------------

// The FP8 view a fused producer wrote is bitwise the reference quantizer applied to the output
// the same backend wrote (any scale layout: "layout" 1 = cuBLASLt's block-major scales). The
// view of output `out` is kept as <view>q, <view>scales, <view>layout (keep_view).
void expect_view_is_quantized_out(const Tensors& o, bool pow2, const std::string& out_name = "out",
                                  const std::string& view = "") {
  const Tensor& out = o.at(out_name);
  const int64_t D = out.dim(-1), R = out.numel() / D, nb = (D + 127) / 128;
  QuantTensor ref = quant_alloc(R, D, 1, 128, pow2);
  quantize_blocks_into(out.reshape({R, D}), false, ref);
  EXPECT_EQ(std::memcmp(ref.data.raw(), o.at(view + "q").raw(), ref.data.nbytes()), 0)
      << "FP8 view data of " << out_name;
  const bool laid = o.at(view + "layout").data<int32_t>()[0] != 0;
  const float* s = o.at(view + "scales").data<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b)
      ASSERT_EQ(std::memcmp(&ref.scales.data<float>()[r * nb + b], &s[laid ? b * R + r : r * nb + b], 4), 0)
          << "FP8 view scale of " << out_name << " row " << r << " block " << b;
}

void keep_view(OpRun& r, const Fp8View& v, const std::string& view = "") {
  r.out[view + "q"] = v.q.data;
  r.out[view + "scales"] = v.q.scales;
  Tensor l = Tensor::empty({1}, DType::I32);
  l.data<int32_t>()[0] = v.scales_gemm_layout;
  r.out[view + "layout"] = l;
}

// The producers of the FP8 dgrads' dY: the residual gradient's add (o, down) and the SwiGLU
// backward (dgate, dup for gate, up). Each FP8 copy is bitwise the quantization of the output it
// was written with (and the outputs bitwise add's / swiglu_backward's); the dgrads given them
// bitwise the dgrads that quantize dy themselves. R 48: scales in cuBLASLt's layout on CUDA
// (BF16), tensor cores when the width % 128 == 0; R 37 ragged (row-major); width 200: a partial
// last block and CUDA's dequantize path.
void add_fp8_cases(std::vector<OpCase>& t) {
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t R : {int64_t(48), int64_t(37)})
      for (int64_t D : {int64_t(384), int64_t(200)}) {
        const int64_t K = 256;
        const bool f32 = dt == DType::F32, pow2 = R == 48;
        const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
        t.push_back(
            {"add_fp8 + linear_backward",
             dims({R, D}) + " " + dtype_name(dt) + (pow2 ? " pow2" : "") + ", dgrad K 256",
             [=] {
               return Tensors{{"a", rnd({R, D}, 550, dt)},
                              {"b", rnd({R, D}, 551, dt, 2.0f)},
                              {"x", rnd({R, K}, 552)},
                              {"w", rnd({D, K}, 553, DType::F32, 0.05f)}};
             },
             [=](OpRun& r) {
               Fp8View v = r.be.alloc_fp8_view(R, D, pow2);
               Tensor& out = r.output("out", {R, D}, dt);
               r.be.add_fp8(r["a"], r["b"], out, v);
               keep_view(r, v);
               r.be.add(r["a"], r["b"], r.output("out_ref", {R, D}, dt));
               Fp8View va = r.be.alloc_fp8_view(R, D, pow2);  // in place: out aliases a
               Tensor& sum_a = r.updated("sum_a", "a");
               r.be.add_fp8(sum_a, r["b"], sum_a, va);
               const LinearWeight W = weight_of(r, false);
               r.be.linear_backward(out, r["x"], W, spec, &r.output("dx", {R, K}, DType::F32), nullptr, nullptr, &v);
               r.be.linear_backward(out, r["x"], W, spec, &r.output("dx_ref", {R, K}, DType::F32), nullptr, nullptr);
             },
             {{"out", rel(f32 ? 1e-6 : 1e-2)}, {"dx", fp8_gemm()}},
             {{"out", "out_ref"}, {"sum_a", "out_ref"}, {"dx", "dx_ref"}}});
        t.back().invariants = [=](const Tensors& o) { expect_view_is_quantized_out(o, pow2); };
        t.back().errors = [=](OpRun& r) {
          Tensor out = r.be.alloc({R, D}, dt);
          Fp8View wide = r.be.alloc_fp8_view(R, D + 128, pow2);
          EXPECT_THROW(r.be.add_fp8(r["a"], r["b"], out, wide), Error);  // not out's view
        };
      }
}

void swiglu_backward_fp8_cases(std::vector<OpCase>& t) {
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t R : {int64_t(48), int64_t(37)})
      for (int64_t F : {int64_t(384), int64_t(200)}) {
        const int64_t K = 256;
        const bool f32 = dt == DType::F32, pow2 = R == 37;
        const LinearSpec spec{LinearMode::FP8_BLOCK, pow2};
        t.push_back(
            {"swiglu_backward_fp8 + linear_backward",
             dims({R, F}) + " " + dtype_name(dt) + (pow2 ? " pow2" : "") + ", dgrads K 256",
             [=] {
               return Tensors{{"gate", rnd({R, F}, 540, dt, 3.0f)},
                              {"up", rnd({R, F}, 541, dt)},
                              {"d", rnd({R, F}, 542, dt)},
                              {"x", rnd({R, K}, 543)},
                              {"wg", rnd({F, K}, 544, DType::F32, 0.05f)},
                              {"wu", rnd({F, K}, 545, DType::F32, 0.05f)}};
             },
             [=](OpRun& r) {
               Fp8View vg = r.be.alloc_fp8_view(R, F, pow2), vu = r.be.alloc_fp8_view(R, F, pow2);
               Tensor& dg = r.output("dgate", {R, F}, dt);
               Tensor& du = r.output("dup", {R, F}, dt);
               r.be.swiglu_backward_fp8(r["d"], r["gate"], r["up"], dg, du, vg, vu);
               keep_view(r, vg, "g_");
               keep_view(r, vu, "u_");
               r.be.swiglu_backward(r["d"], r["gate"], r["up"], r.output("dgate_ref", {R, F}, dt),
                                    r.output("dup_ref", {R, F}, dt));
               LinearWeight Wg, Wu;
               Wg.w = r["wg"];
               Wu.w = r["wu"];
               r.be.linear_backward(dg, r["x"], Wg, spec, &r.output("dx_g", {R, K}, DType::F32), nullptr, nullptr, &vg);
               r.be.linear_backward(du, r["x"], Wu, spec, &r.output("dx_u", {R, K}, DType::F32), nullptr, nullptr, &vu);
               r.be.linear_backward(dg, r["x"], Wg, spec, &r.output("dx_g_ref", {R, K}, DType::F32), nullptr, nullptr);
               r.be.linear_backward(du, r["x"], Wu, spec, &r.output("dx_u_ref", {R, K}, DType::F32), nullptr, nullptr);
             },
             {{"dgate", rel(f32 ? 1e-5 : 1e-2)},
              {"dup", rel(f32 ? 1e-5 : 1e-2)},
              {"dx_g", fp8_gemm()},
              {"dx_u", fp8_gemm()}},
             {{"dgate", "dgate_ref"}, {"dup", "dup_ref"}, {"dx_g", "dx_g_ref"}, {"dx_u", "dx_u_ref"}}});
        t.back().invariants = [=](const Tensors& o) {
          expect_view_is_quantized_out(o, pow2, "dgate", "g_");
          expect_view_is_quantized_out(o, pow2, "dup", "u_");
        };
        t.back().errors = [=](OpRun& r) {
          Tensor dg = r.be.alloc({R, F}, dt), du = r.be.alloc({R, F}, dt);
          Fp8View vg = r.be.alloc_fp8_view(R, F, pow2), vu = r.be.alloc_fp8_view(R, F, pow2);
          Fp8View narrow = r.be.alloc_fp8_view(R, F - 8, pow2);
          EXPECT_THROW(r.be.swiglu_backward_fp8(r["d"], r["gate"], r["up"], dg, du, vg, narrow), Error);
          EXPECT_THROW(r.be.swiglu_backward_fp8(r["d"], r["gate"], r["up"], dg, du, vg, vg), Error);  // one view twice
          r.be.swiglu_backward_fp8(r["d"], r["gate"], r["up"], dg, du, vg, vu);
          LinearWeight Wg;
          Wg.w = r["wg"];
          Tensor dx = r.be.alloc({R, K}, DType::F32);
          // dup's view for dgate (a stale or mismatched view), and the other pow2.
          EXPECT_THROW(r.be.linear_backward(dg, r["x"], Wg, spec, &dx, nullptr, nullptr, &vu), Error);
          EXPECT_THROW(r.be.linear_backward(dg, r["x"], Wg, {LinearMode::FP8_BLOCK, !pow2}, &dx, nullptr, nullptr, &vg),
                       Error);
          // Other modes ignore the view.
          EXPECT_NO_THROW(r.be.linear_backward(dg, r["x"], Wg, {LinearMode::BF16, false}, &dx, nullptr, nullptr, &vu));
        };
      }
}

void fused_cases(std::vector<OpCase>& t) {
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t R : {int64_t(48), int64_t(37)}) {
      // D 384: whole 128-column blocks, 16-byte code stores; 200 (on one dtype: row 48 BF16, row
      // 37 F32): a partial block whose last 8 columns take the CUDA row blocks' 8-byte stores.
      const int64_t D = (R == 48) == (dt == DType::BF16) ? 200 : 384;
      const bool f32 = dt == DType::F32, pow2 = R == 37;
      const std::string v = dims({R, D}) + " " + dtype_name(dt) + (pow2 ? " pow2" : "");
      auto inputs = [=] {
        return Tensors{{"x", rnd({R, D}, 500, dt)},
                       {"b", rnd({R, D}, 501, dt)},
                       {"w", rnd({D}, 502)},
                       {"gate", rnd({R, D}, 503, dt, 3.0f)},
                       {"up", rnd({R, D}, 504, dt)}};
      };
      t.push_back({"rmsnorm_fp8",
                   v,
                   inputs,
                   [=](OpRun& r) {
                     Fp8View view = r.be.alloc_fp8_view(R, D, pow2);
                     r.be.rmsnorm_fp8(r["x"], r["w"], 1e-6f, r.output("out", {R, D}, dt),
                                      &r.output("rstd", {R}, DType::F32), view);
                     keep_view(r, view);
                   },
                   {{"out", rel(f32 ? 1e-5 : 1e-2)}, {"rstd", rel(1e-5)}}});
      t.back().invariants = [=](const Tensors& o) { expect_view_is_quantized_out(o, pow2); };
      t.push_back({"add_rmsnorm",
                   v + ", with its FP8 view",
                   inputs,
                   [=](OpRun& r) {
                     Fp8View view = r.be.alloc_fp8_view(R, D, pow2);
                     r.be.add_rmsnorm(r["x"], r["b"], r.output("sum", {R, D}, dt), r["w"], 1e-6f,
                                      r.output("out", {R, D}, dt), &r.output("rstd", {R}, DType::F32), &view);
                     keep_view(r, view);
                     // Bitwise add then rmsnorm(_fp8) on each backend, with and without the view
                     // (the generation forward does a block's attention norm with the previous
                     // block's closing add; the trainer's saving forward does not).
                     Tensor& sum2 = r.output("sum_composed", {R, D}, dt);
                     r.be.add(r["x"], r["b"], sum2);
                     Fp8View view2 = r.be.alloc_fp8_view(R, D, pow2);
                     r.be.rmsnorm_fp8(sum2, r["w"], 1e-6f, r.output("out_composed", {R, D}, dt),
                                      &r.output("rstd_composed", {R}, DType::F32), view2);
                     r.out["codes_composed"] = view2.q.data;
                     r.be.add_rmsnorm(r["x"], r["b"], r.output("sum_noview", {R, D}, dt), r["w"], 1e-6f,
                                      r.output("out_noview", {R, D}, dt), nullptr, nullptr);
                     r.be.rmsnorm(sum2, r["w"], 1e-6f, r.output("out_noview_composed", {R, D}, dt), nullptr);
                   },
                   {{"sum", rel(f32 ? 1e-6 : 1e-2)}, {"out", rel(f32 ? 1e-5 : 1e-2)}, {"rstd", rel(1e-5)}},
                   {{"sum_composed", "sum"},
                    {"out_composed", "out"},
                    {"rstd_composed", "rstd"},
                    {"codes_composed", "q"},
                    {"sum_noview", "sum"},
                    {"out_noview", "out_noview_composed"}}});
      t.back().invariants = [=](const Tensors& o) { expect_view_is_quantized_out(o, pow2); };
      t.push_back({"swiglu_fp8",
                   v,
                   inputs,
                   [=](OpRun& r) {
                     Fp8View view = r.be.alloc_fp8_view(R, D, pow2);
                     r.be.swiglu_fp8(r["gate"], r["up"], r.output("out", {R, D}, dt), view);
                     keep_view(r, view);
                   },
                   {{"out", rel(f32 ? 1e-5 : 1e-2)}}});
      t.back().invariants = [=](const Tensors& o) { expect_view_is_quantized_out(o, pow2); };
      t.back().errors = [=](OpRun& r) {
        Fp8View wrong = r.be.alloc_fp8_view(R, D - 128, pow2);
        Tensor out = r.be.alloc({R, D}, dt);
        EXPECT_THROW(r.be.swiglu_fp8(r["gate"], r["up"], out, wrong), Error);  // not out's view
      };
    }
  // q/k/v through linear_shared_input: each output bitwise what linear() writes.
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK})
    for (int64_t M : {int64_t(64), int64_t(37)}) {
      const LinearSpec spec{mode, false};
      const int64_t K = 256, N[3] = {256, 128, 384};
      t.push_back({"linear_shared_input",
                   std::to_string(M) + " tokens, K 256, N 256/128/384 " + linear_mode_name(mode),
                   [=] {
                     Tensors in{{"x", rnd({M, K}, 510)}};
                     for (int i = 0; i < 3; ++i)
                       in["w" + std::to_string(i)] = rnd({N[i], K}, 511 + i, DType::F32, 0.05f);
                     return in;
                   },
                   [=](OpRun& r) {
                     LinearWeight W[3];
                     std::vector<const LinearWeight*> ws;
                     std::vector<Tensor*> outs;
                     for (int i = 0; i < 3; ++i) {
                       W[i].w = r["w" + std::to_string(i)];
                       ws.push_back(&W[i]);
                       outs.push_back(&r.output("out" + std::to_string(i), {M, N[i]}, DType::F32));
                     }
                     r.be.linear_shared_input(r["x"], ws, spec, outs);
                     for (int i = 0; i < 3; ++i)
                       r.be.linear(r["x"], W[i], spec, r.output("single" + std::to_string(i), {M, N[i]}, DType::F32));
                   },
                   {{"out0", linear_tolerance(mode, DType::F32)},
                    {"out1", linear_tolerance(mode, DType::F32)},
                    {"out2", linear_tolerance(mode, DType::F32)}},
                   {{"out0", "single0"}, {"out1", "single1"}, {"out2", "single2"}}});
    }
}

void expect_rows_equal(const Tensor& full, const Tensor& part, int64_t r0, const std::string& what);

// Consecutive row ranges [rows[i], rows[i + 1]) of one weight buffer wall [rows.back(), K] as
// weights of their own (the generator's q|k|v and gate|up): slices of wall, or with fp8 slices of
// its one 128x128-block quantization (every boundary a multiple of 128).
std::vector<LinearWeight> weight_row_parts(Backend& be, const Tensor& wall, const std::vector<int64_t>& rows,
                                           bool fp8) {
  QuantTensor qall;
  if (fp8) {
    qall = be.alloc_quant(wall.dim(0), wall.dim(1), kQuantBlock, kQuantBlock, false);
    be.quantize(wall, false, qall);
  }
  std::vector<LinearWeight> W(rows.size() - 1);
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    if (fp8) {
      W[i].wq = qall;
      W[i].wq.data = qall.data.slice_rows(rows[i], rows[i + 1]);
      W[i].wq.scales = qall.scales.slice_rows(rows[i] / kQuantBlock, rows[i + 1] / kQuantBlock);
    } else {
      W[i].w = wall.slice_rows(rows[i], rows[i + 1]);
    }
  }
  return W;
}

// linear_shared_input over weights that are consecutive rows of one buffer (the generator's
// q|k|v and gate|up): CUDA runs them as one product at decode sizes and splits the output; each
// output close to linear() of its own weight (the same quantized operands). FP8 in the consistent
// mode too: the own kernel computes each column from its own weight row alone, so the one product
// is bitwise the separate ones (the trainer's).
void concatenated_linear_cases(std::vector<OpCase>& t) {
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK})
    for (bool consistent : {false, true})
      for (int64_t M : {int64_t(64), int64_t(37)}) {
        if (consistent && mode != LinearMode::FP8_BLOCK) continue;
        LinearSpec spec{mode, false};
        spec.consistent = consistent;
        const int64_t K = 256, N[3] = {256, 128, 384}, rows = N[0] + N[1] + N[2];
        t.push_back({"linear_shared_input",
                     std::to_string(M) + " tokens, K 256, N 256/128/384 concatenated " + linear_mode_name(mode) +
                         (consistent ? " consistent" : ""),
                     [=] {
                       return Tensors{{"x", rnd({M, K}, 520)}, {"w", rnd({rows, K}, 521, DType::F32, 0.05f)}};
                     },
                     [=](OpRun& r) {
                       const Tensor x = r.as("x", DType::BF16), wall = r.as("w", DType::BF16);
                       const std::vector<LinearWeight> W =
                           weight_row_parts(r.be, wall, {0, N[0], N[0] + N[1], rows}, mode == LinearMode::FP8_BLOCK);
                       std::vector<const LinearWeight*> ws;
                       std::vector<Tensor*> outs;
                       for (int i = 0; i < 3; ++i) {
                         ws.push_back(&W[i]);
                         outs.push_back(&r.output("out" + std::to_string(i), {M, N[i]}, DType::BF16));
                       }
                       r.be.linear_shared_input(x, ws, spec, outs);
                       for (int i = 0; i < 3; ++i)
                         r.be.linear(x, W[i], spec, r.output("single" + std::to_string(i), {M, N[i]}, DType::BF16));
                     },
                     {{"out0", linear_tolerance(mode, DType::BF16)},
                      {"out1", linear_tolerance(mode, DType::BF16)},
                      {"out2", linear_tolerance(mode, DType::BF16)}}});
        for (int i = 0; i < 3; ++i)
          t.back().close.emplace_back("out" + std::to_string(i), "single" + std::to_string(i),
                                      linear_tolerance(mode, DType::BF16));
        t.back().no_fp8_fallback = true;
        t.back().concat_products = 1;
        if (consistent)
          t.back().invariants = [](const Tensors& out) {
            for (int i = 0; i < 3; ++i)
              expect_rows_equal(out.at("out" + std::to_string(i)), out.at("single" + std::to_string(i)), 0,
                                "linear_shared_input (consistent, concatenated)");
          };
      }
}

// linear_swiglu over gate|up as consecutive rows of one buffer (the generator's): act (and its FP8
// copy) bitwise the unfused linear_shared_input + swiglu / swiglu_fp8 of the same run, with the
// products kept (the trainer's forward) or left in the backend's scratch (decode: CUDA reads the
// concatenated product's halves in place, no split). FP8 in the consistent mode too.
void linear_swiglu_cases(std::vector<OpCase>& t) {
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK})
    for (bool consistent : {false, true})
      for (bool keep : {false, true})
        for (int64_t M : {int64_t(64), int64_t(37)}) {
          if (consistent && mode != LinearMode::FP8_BLOCK) continue;
          LinearSpec spec{mode, false};
          spec.consistent = consistent;
          const bool fp8 = mode == LinearMode::FP8_BLOCK;
          const int64_t K = 256, F = 384;
          t.push_back({"linear_swiglu",
                       std::to_string(M) + " tokens, K 256, F 384 concatenated " + linear_mode_name(mode) +
                           (consistent ? " consistent" : "") + (keep ? " kept" : " scratch"),
                       [=] {
                         return Tensors{{"x", rnd({M, K}, 530)}, {"w", rnd({2 * F, K}, 531, DType::F32, 0.05f)}};
                       },
                       [=](OpRun& r) {
                         const Tensor x = r.as("x", DType::BF16), wall = r.as("w", DType::BF16);
                         const std::vector<LinearWeight> W = weight_row_parts(r.be, wall, {0, F, 2 * F}, fp8);
                         Tensor g = r.be.alloc({M, F}, DType::BF16), u = r.be.alloc({M, F}, DType::BF16);
                         Tensor& act = r.output("act", {M, F}, DType::BF16);
                         Fp8View view = fp8 ? r.be.alloc_fp8_view(M, F, false) : Fp8View{};
                         r.be.linear_swiglu(x, W[0], W[1], spec, g, u, keep, act, fp8 ? &view : nullptr);
                         // The unfused reference in the same run.
                         Tensor g2 = r.be.alloc({M, F}, DType::BF16), u2 = r.be.alloc({M, F}, DType::BF16);
                         r.be.linear_shared_input(x, {&W[0], &W[1]}, spec, {&g2, &u2});
                         Tensor& act2 = r.output("act_unfused", {M, F}, DType::BF16);
                         if (fp8) {
                           Fp8View view2 = r.be.alloc_fp8_view(M, F, false);
                           r.be.swiglu_fp8(g2, u2, act2, view2);
                           r.out["codes"] = view.q.data;
                           r.out["codes_unfused"] = view2.q.data;
                           r.out["scales"] = view.q.scales;
                           r.out["scales_unfused"] = view2.q.scales;
                         } else {
                           r.be.swiglu(g2, u2, act2);
                         }
                         if (keep) {
                           r.out["gate"] = g;
                           r.out["gate_unfused"] = g2;
                         }
                       },
                       {{"act", linear_tolerance(mode, DType::BF16)}}});
          OpCase& c = t.back();
          c.same = {{"act", "act_unfused"}};
          if (fp8) {
            c.same.push_back({"codes", "codes_unfused"});
            c.same.push_back({"scales", "scales_unfused"});
          }
          if (keep) c.same.push_back({"gate", "gate_unfused"});
          c.no_fp8_fallback = true;
          c.concat_products = 2;  // CUDA: linear_swiglu's product and the reference's, one each
        }
}

// linear_qkv_norm_rope over q|k|v as consecutive rows of one buffer (the generator's), Qwen3's
// heads (hd 128, GQA 4 / 2): q, k, v and both rstd bitwise the unfused linear_shared_input +
// rmsnorm_rope of the same run, with the products kept (the trainer's forward) or left in the
// backend's scratch (decode: CUDA norms, rotates and splits the concatenated product in one kernel).
// With a KV destination (the generator's decode: CUDA writes the cache in the same kernel): both
// pools bitwise the op then kv_write of its k and v, for BF16, E4M3 and F32 caches.
// Their q, k and v weights (rows of the input "w", [(Hq + 2 Hkv) hd, K]) and Qwen3's RoPE.
std::vector<LinearWeight> qkv_case_weights(OpRun& r, int64_t Hq, int64_t Hkv, int64_t hd, bool fp8) {
  return weight_row_parts(r.be, r.as("w", DType::BF16), {0, Hq * hd, (Hq + Hkv) * hd, (Hq + 2 * Hkv) * hd}, fp8);
}
RopeParams qkv_case_rope(int64_t hd) {
  RopeParams rp;
  for (int64_t i = 0; i < hd / 2; ++i) rp.inv_freq.push_back(std::pow(1e6f, -2.0f * static_cast<float>(i) / hd));
  return rp;
}
void linear_qkv_norm_rope_cases(std::vector<OpCase>& t) {
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK})
    for (bool consistent : {false, true})
      for (bool keep : {false, true})
        for (int64_t M : {int64_t(64), int64_t(37)})
          for (DType pool : {DType::U8, DType::BF16, DType::E4M3, DType::F32}) {  // U8: no KV destination
            if (consistent && mode != LinearMode::FP8_BLOCK) continue;
            if (pool != DType::U8 && (keep || consistent || M != 37)) continue;
            const bool to_cache = pool != DType::U8;
            LinearSpec spec{mode, false};
            spec.consistent = consistent;
            const bool fp8 = mode == LinearMode::FP8_BLOCK;
            const int64_t K = 256, hd = 128, Hq = 4, Hkv = 2, N = (Hq + 2 * Hkv) * hd;
            t.push_back(
                {"linear_qkv_norm_rope",
                 std::to_string(M) + " tokens, K 256, 4 / 2 heads of 128, concatenated " + linear_mode_name(mode) +
                     (consistent ? " consistent" : "") + (keep ? " kept" : " scratch") +
                     (to_cache ? std::string(", into a ") + dtype_name(pool) + " KV cache" : ""),
                 [=] {
                   std::vector<int32_t> pos(M);
                   for (int64_t i = 0; i < M; ++i) pos[i] = static_cast<int32_t>((i * 37) % 700);
                   // The cache slots: the tokens scattered over 8 pages of 16, in reverse.
                   std::vector<int32_t> slots(M);
                   for (int64_t i = 0; i < M; ++i) slots[i] = static_cast<int32_t>(127 - 3 * i % 128);
                   Tensor sc = rnd({2, Hkv * 2}, 544);
                   for (int64_t i = 0; i < sc.numel(); ++i)
                     sc.data<float>()[i] = 0.002f + std::fabs(sc.data<float>()[i]) * 0.004f;
                   return Tensors{{"x", rnd({M, K}, 540)},
                                  {"w", rnd({N, K}, 541, DType::F32, 0.05f)},
                                  {"qn", rnd({hd}, 542, DType::BF16)},
                                  {"kn", rnd({hd}, 543, DType::BF16)},
                                  {"pos", i32_tensor(pos, {M})},
                                  {"slots", i32_tensor(slots, {M})},
                                  {"kv_scales", sc}};
                 },
                 [=](OpRun& r) {
                   const Tensor x = r.as("x", DType::BF16);
                   const std::vector<LinearWeight> W = qkv_case_weights(r, Hq, Hkv, hd, fp8);
                   const RopeParams rp = qkv_case_rope(hd);
                   const DType bf = DType::BF16;
                   Tensor qr = r.be.alloc({M, Hq * hd}, bf), kr = r.be.alloc({M, Hkv * hd}, bf);
                   Tensor& q = r.output("q", {M, Hq, hd}, bf);
                   Tensor& k = r.output("k", {M, Hkv, hd}, bf);
                   Tensor& v = r.output("v", {M, Hkv * hd}, bf);
                   Tensor& qs = r.output("q_rstd", {M * Hq}, DType::F32);
                   Tensor& ks = r.output("k_rstd", {M * Hkv}, DType::F32);
                   // Two caches of 2 layers (layer 1 written): the op's and the reference's.
                   auto cache = [&] {
                     KvCache c = r.be.alloc_kv_cache(2, 8, 16, Hkv, hd, pool);
                     const Tensor sc = r["kv_scales"].reshape({2, 2, Hkv});
                     r.be.copy(sc.slice_rows(0, 1).reshape({2, Hkv}), c.k_scale);
                     r.be.copy(sc.slice_rows(1, 2).reshape({2, Hkv}), c.v_scale);
                     for (int l = 0; l < 2; ++l) {
                       r.be.fill(c.k[l], 0.0f);
                       r.be.fill(c.v[l], 0.0f);
                     }
                     return c;
                   };
                   KvCache c1, c2;
                   PagedBatch pb;
                   pb.slots = r["slots"];
                   Backend::KvDest kv;
                   if (to_cache) {
                     c1 = cache(), c2 = cache();
                     kv = Backend::KvDest{&c1, 1, &pb};
                   }
                   r.be.linear_qkv_norm_rope(x, W[0], W[1], W[2], spec, r["qn"], r["kn"], 1e-6f, r["pos"], rp, keep, qr,
                                             kr, q, k, v, &qs, &ks, nullptr, to_cache ? &kv : nullptr);
                   // The unfused reference in the same run.
                   Tensor qr2 = r.be.alloc({M, Hq * hd}, bf), kr2 = r.be.alloc({M, Hkv * hd}, bf);
                   Tensor& v2 = r.output("v_unfused", {M, Hkv * hd}, bf);
                   r.be.linear_shared_input(x, {&W[0], &W[1], &W[2]}, spec, {&qr2, &kr2, &v2});
                   r.be.rmsnorm_rope(qr2.reshape({M, Hq, hd}), r["qn"], 1e-6f, r["pos"], rp,
                                     r.output("q_unfused", {M, Hq, hd}, bf),
                                     &r.output("q_rstd_unfused", {M * Hq}, DType::F32));
                   r.be.rmsnorm_rope(kr2.reshape({M, Hkv, hd}), r["kn"], 1e-6f, r["pos"], rp,
                                     r.output("k_unfused", {M, Hkv, hd}, bf),
                                     &r.output("k_rstd_unfused", {M * Hkv}, DType::F32));
                   if (to_cache) {
                     r.be.kv_write(c2, 1, r.out["k_unfused"], v2.reshape({M, Hkv, hd}), pb);
                     r.out["k_pool"] = c1.k[1], r.out["v_pool"] = c1.v[1];
                     r.out["k_pool_unfused"] = c2.k[1], r.out["v_pool_unfused"] = c2.v[1];
                     r.out["k_pool_layer0"] = c1.k[0];  // untouched
                   }
                   if (keep) {
                     r.out["q_raw"] = qr;
                     r.out["q_raw_unfused"] = qr2;
                     r.out["k_raw"] = kr;
                     r.out["k_raw_unfused"] = kr2;
                   }
                 },
                 {{"q", linear_tolerance(mode, DType::BF16)},
                  {"k", linear_tolerance(mode, DType::BF16)},
                  {"v", linear_tolerance(mode, DType::BF16)},
                  {"q_rstd", linear_tolerance(mode, DType::BF16)},
                  {"k_rstd", linear_tolerance(mode, DType::BF16)}}});
            OpCase& c = t.back();
            c.same = {{"q", "q_unfused"},
                      {"k", "k_unfused"},
                      {"v", "v_unfused"},
                      {"q_rstd", "q_rstd_unfused"},
                      {"k_rstd", "k_rstd_unfused"}};
            if (keep) {
              c.same.push_back({"q_raw", "q_raw_unfused"});
              c.same.push_back({"k_raw", "k_raw_unfused"});
            }
            if (to_cache) {
              c.same.push_back({"k_pool", "k_pool_unfused"});
              c.same.push_back({"v_pool", "v_pool_unfused"});
              c.invariants = [](const Tensors& out) {
                const std::vector<float> z = to_float_vector(out.at("k_pool_layer0"));
                for (size_t i = 0; i < z.size(); ++i) ASSERT_EQ(z[i], 0.0f) << "layer 0 written at " << i;
                const std::vector<float> kf = to_float_vector(out.at("k_pool"));  // the written slots are not all zero
                double s = 0.0;
                for (float x : kf) s += std::fabs(x);
                EXPECT_GT(s, 0.0) << "nothing was written into the cache";
              };
              c.errors = [=](OpRun& r) {  // a layer the cache does not have
                KvCache bad = r.be.alloc_kv_cache(1, 8, 16, Hkv, hd, pool);
                PagedBatch pb;
                pb.slots = r["slots"];
                Backend::KvDest kv{&bad, 1, &pb};
                const Tensor x = r.as("x", DType::BF16);
                const std::vector<LinearWeight> W = qkv_case_weights(r, Hq, Hkv, hd, false);
                const RopeParams rp = qkv_case_rope(hd);
                const DType bf = DType::BF16;
                Tensor qr = r.be.alloc({M, Hq * hd}, bf), kr = r.be.alloc({M, Hkv * hd}, bf);
                Tensor q = r.be.alloc({M, Hq, hd}, bf), k = r.be.alloc({M, Hkv, hd}, bf),
                       v = r.be.alloc({M, Hkv * hd}, bf);
                EXPECT_THROW(
                    r.be.linear_qkv_norm_rope(x, W[0], W[1], W[2], LinearSpec{}, r["qn"], r["kn"], 1e-6f, r["pos"], rp,
                                              false, qr, kr, q, k, v, nullptr, nullptr, nullptr, &kv),
                    Error);
              };
            }
            c.no_fp8_fallback = true;
            c.concat_products = 2;  // CUDA: the op's product and the reference's, one each
          }
}

// ---- mixture of experts ------------------------------------------------------------------------

// grouped_linear: row groups (empty, one-row and ragged ones) through one weight each, against
// linear() of each group's rows. FP8 weights pre-quantized, as the generator and the trainer's
// per-step cache hold them (the CUDA grouped kernel's case); BF16 through W.w.
void grouped_linear_cases(std::vector<OpCase>& t) {
  struct V {
    LinearMode mode;
    DType dt;  // x and the weights (BF16: CUDA's cuBLAS grouped launch)
  };
  for (const V v :
       {V{LinearMode::FP8_BLOCK, DType::F32}, V{LinearMode::FP8_BLOCK, DType::BF16}, V{LinearMode::BF16, DType::F32},
        V{LinearMode::BF16, DType::BF16}, V{LinearMode::FP32, DType::F32}}) {
    const LinearMode mode = v.mode;
    const LinearSpec spec{mode, false};
    const std::vector<int64_t> rows = {0, 5, 37, 1, 21, 64};
    std::vector<int64_t> offsets = {0};
    for (int64_t r : rows) offsets.push_back(offsets.back() + r);
    const int64_t R = offsets.back(), K = 256, N = 384, G = static_cast<int64_t>(rows.size());
    t.push_back({"grouped_linear",
                 std::to_string(G) + " groups, " + std::to_string(R) + " rows, K 256, N 384 " + linear_mode_name(mode) +
                     " " + dtype_name(v.dt),
                 [=] {
                   Tensors in{{"x", rnd({R, K}, 530)}};
                   for (int64_t g = 0; g < G; ++g)
                     in["w" + std::to_string(g)] = rnd({N, K}, 531 + static_cast<uint32_t>(g), DType::F32, 0.05f);
                   return in;
                 },
                 [=](OpRun& r) {
                   std::vector<LinearWeight> W(static_cast<size_t>(G));
                   std::vector<const LinearWeight*> ws;
                   for (int64_t g = 0; g < G; ++g) {
                     LinearWeight& w = W[static_cast<size_t>(g)];
                     w.w = r.as("w" + std::to_string(g), v.dt);
                     if (mode == LinearMode::FP8_BLOCK) {
                       w.wq = r.be.alloc_quant(N, K, kQuantBlock, kQuantBlock, false);
                       r.be.quantize(w.w, false, w.wq);
                     }
                     ws.push_back(&w);
                   }
                   const Tensor x = r.as("x", v.dt);
                   r.be.grouped_linear(x, offsets, ws, spec, r.output("out", {R, N}, v.dt));
                   // The same groups planned on the device (moe_plan of slots already in group
                   // order: the identity permutation, these offsets).
                   std::vector<int32_t> ex;
                   for (int64_t g = 0; g < G; ++g) ex.insert(ex.end(), rows[static_cast<size_t>(g)], int32_t(g));
                   Backend::MoeDevicePlan plan;
                   plan.block_m = r.be.moe_plan_block_m(R, G);
                   plan.offsets = r.be.alloc({G + 1}, DType::I32);
                   plan.tiles = r.be.alloc({moe_plan_max_tiles(R, G, plan.block_m), 4}, DType::I32);
                   plan.tile_count = r.be.alloc({1}, DType::I32);
                   Tensor rs = r.be.alloc({R}, DType::I32), sr = r.be.alloc({R}, DType::I32);
                   r.be.moe_plan(r.be.to_device(i32_tensor(ex, {R, 1})), G, plan.block_m, plan.offsets, rs, sr,
                                 plan.tiles, plan.tile_count);
                   r.be.grouped_linear_planned(x, plan, {ws}, spec, {&r.output("out_planned", {R, N}, v.dt)});
                   Tensor& single = r.output("single", {R, N}, v.dt);
                   for (int64_t g = 0; g < G; ++g) {
                     if (rows[static_cast<size_t>(g)] == 0) continue;
                     const Tensor xg = x.slice_rows(offsets[g], offsets[g + 1]);
                     Tensor og = single.slice_rows(offsets[g], offsets[g + 1]);
                     r.be.linear(xg, W[static_cast<size_t>(g)], spec, og);
                   }
                   if (mode == LinearMode::FP8_BLOCK) {
                     // x's FP8 copy from a fused producer (add_fp8 of x + 0: x's values) stands
                     // for the op's own quantization: the same bits (CUDA: in the scale layout the
                     // producer chose: block-major for BF16 at R % 16 == 0, else row-major).
                     Tensor& xs = r.output("x_sum", {R, K}, v.dt);
                     Fp8View view = r.be.alloc_fp8_view(R, K, false);
                     Tensor zero = r.be.alloc({R, K}, v.dt);
                     r.be.fill(zero, 0.0f);
                     r.be.add_fp8(x, zero, xs, view);
                     r.be.grouped_linear(xs, offsets, ws, spec, r.output("out_view", {R, N}, v.dt), &view);
                     r.be.grouped_linear(xs, offsets, ws, spec, r.output("out_sum", {R, N}, v.dt));
                   }
                 },
                 {{"out", linear_tolerance(mode, v.dt)}},
                 mode == LinearMode::FP8_BLOCK
                     ? std::vector<std::pair<std::string, std::string>>{{"out_view", "out_sum"}, {"out_planned", "out"}}
                 : mode == LinearMode::BF16 && v.dt == DType::BF16
                     ? std::vector<std::pair<std::string, std::string>>{}
                     : std::vector<std::pair<std::string, std::string>>{{"out_planned", "out"}}});
    // The CPU computes both the same way (bitwise); the CUDA grouped kernel is close to its
    // per-group cuBLASLt products (the linear class's tolerance). The planned product: bitwise the
    // host-offsets one (the same own kernel; the CPU's same path), except CUDA's BF16, where the
    // own kernel's BF16 mode stands in for cuBLAS's grouped GEMM.
    t.back().close.emplace_back("out", "single", linear_tolerance(mode, v.dt));
    if (mode == LinearMode::BF16 && v.dt == DType::BF16)
      t.back().close.emplace_back("out_planned", "out", linear_tolerance(mode, v.dt));
    // CUDA: FP8 with quantized weights and BF16 with BF16 operands and output run grouped; the
    // others, one product per live group (5 of the 6), in the host-offsets and the planned op.
    const bool grouped = mode == LinearMode::FP8_BLOCK || (mode == LinearMode::BF16 && v.dt == DType::BF16);
    t.back().grouped_loops = grouped ? 0 : 10;
    t.back().errors = [=](OpRun& r) {
      LinearWeight w;
      w.w = r["w0"];
      std::vector<const LinearWeight*> ws(static_cast<size_t>(G), &w);
      Tensor out = r.be.alloc({R, N}, DType::F32);
      std::vector<int64_t> bad = offsets;
      bad.back() = R - 1;  // offsets must end at R
      EXPECT_THROW(r.be.grouped_linear(r["x"], bad, ws, spec, out), Error);
      std::vector<const LinearWeight*> fewer(ws.begin(), ws.end() - 1);  // one offset too many
      EXPECT_THROW(r.be.grouped_linear(r["x"], offsets, fewer, spec, out), Error);
    };
  }
}

// grouped_linear_shared_input: two weight sets (gate and up) over the same groups, each group's
// two weights consecutive rows of one buffer as the generator allocates them, against
// grouped_linear of each set. Both backends run the separate grouped products (CUDA's one
// concatenated grouped product, split in two, measured slower in the MoE decode: session 24), so
// the outputs are bitwise the separate products' and no concatenated product is counted.
void grouped_linear_shared_input_cases(std::vector<OpCase>& t) {
  for (const LinearMode mode : {LinearMode::FP8_BLOCK, LinearMode::BF16}) {
    const LinearSpec spec{mode, false};
    const DType dt = DType::BF16;
    const std::vector<int64_t> rows = {0, 5, 37, 1, 21, 64};
    std::vector<int64_t> offsets = {0};
    for (int64_t r : rows) offsets.push_back(offsets.back() + r);
    const int64_t R = offsets.back(), K = 256, N = 256, G = static_cast<int64_t>(rows.size());
    t.push_back({"grouped_linear_shared_input",
                 std::to_string(G) + " groups, " + std::to_string(R) + " rows, K 256, 2 x N 256 " +
                     linear_mode_name(mode) + ", consecutive weights",
                 [=] {
                   Tensors in{{"x", rnd({R, K}, 540)}};
                   for (int64_t g = 0; g < 2 * G; ++g)
                     in["w" + std::to_string(g)] = rnd({N, K}, 541 + static_cast<uint32_t>(g), DType::F32, 0.05f);
                   return in;
                 },
                 [=](OpRun& r) {
                   std::vector<LinearWeight> W(static_cast<size_t>(2 * G));  // gate g at 2g, up g at 2g + 1
                   std::vector<const LinearWeight*> gates, ups;
                   for (int64_t g = 0; g < G; ++g) {
                     const Tensor both = r.be.alloc({2 * N, K}, dt);
                     QuantTensor bq;
                     if (mode == LinearMode::FP8_BLOCK)
                       bq = r.be.alloc_quant(2 * N, K, kQuantBlock, kQuantBlock, false);
                     for (int64_t h = 0; h < 2; ++h) {
                       LinearWeight& w = W[static_cast<size_t>(2 * g + h)];
                       w.w = both.slice_rows(h * N, (h + 1) * N);
                       r.be.convert(r["w" + std::to_string(2 * g + h)], w.w);
                       if (mode == LinearMode::FP8_BLOCK) {
                         w.wq = bq;
                         w.wq.data = bq.data.slice_rows(h * N, (h + 1) * N);
                         w.wq.scales = bq.scales.slice_rows(h * N / kQuantBlock, (h + 1) * N / kQuantBlock);
                         r.be.quantize(w.w, false, w.wq);
                       }
                       (h == 0 ? gates : ups).push_back(&w);
                     }
                   }
                   const Tensor x = r.as("x", dt);
                   r.be.grouped_linear_shared_input(x, offsets, {gates, ups}, spec,
                                                    {&r.output("gate", {R, N}, dt), &r.output("up", {R, N}, dt)});
                   r.be.grouped_linear(x, offsets, gates, spec, r.output("gate_single", {R, N}, dt));
                   r.be.grouped_linear(x, offsets, ups, spec, r.output("up_single", {R, N}, dt));
                 },
                 {{"gate", linear_tolerance(mode, dt)}, {"up", linear_tolerance(mode, dt)}},
                 {}});
    OpCase& c = t.back();
    c.same = {{"gate", "gate_single"}, {"up", "up_single"}};
    c.concat_products = 0;
    c.grouped_loops = 0;
    c.errors = [=](OpRun& r) {
      LinearWeight w;
      w.w = r.as("w0", dt);
      const std::vector<const LinearWeight*> ws(static_cast<size_t>(G), &w), fewer(ws.begin(), ws.end() - 1);
      Tensor a = r.be.alloc({R, N}, dt), b = r.be.alloc({R, N}, dt);
      EXPECT_THROW(r.be.grouped_linear_shared_input(r.as("x", dt), offsets, {ws, fewer}, spec, {&a, &b}), Error);
      EXPECT_THROW(r.be.grouped_linear_shared_input(r.as("x", dt), offsets, {ws, ws}, spec, {&a}), Error);
    };
  }
}

// grouped_linear_backward: the same groups, dgrad and (accumulated) wgrad against
// linear_backward of each group's rows. BF16 with BF16 operands and weights (CUDA: cuBLAS
// grouped), FP8 with pre-quantized weights (CUDA: the own grouped kernel over W^T) and BF16 or
// FP8 wgrad (FP8 wgrad runs per group), FP32; the BF16 wgrads into BF16 gradients and into F32
// ones (the trainer's default; CUDA: grouped BF16 products staged, then added).
void grouped_linear_backward_cases(std::vector<OpCase>& t) {
  struct V {
    LinearMode mode, wgrad;
    DType dt;   // dy, x and (BF16 mode) the weights
    DType gdt;  // the weight gradients
  };
  for (const V v : {V{LinearMode::FP8_BLOCK, LinearMode::BF16, DType::BF16, DType::BF16},
                    V{LinearMode::FP8_BLOCK, LinearMode::BF16, DType::BF16, DType::F32},
                    V{LinearMode::FP8_BLOCK, LinearMode::FP8_BLOCK, DType::F32, DType::F32},
                    V{LinearMode::BF16, LinearMode::BF16, DType::BF16, DType::BF16},
                    V{LinearMode::BF16, LinearMode::BF16, DType::BF16, DType::F32},
                    V{LinearMode::FP32, LinearMode::FP32, DType::F32, DType::F32}}) {
    LinearSpec spec{v.mode, false};
    spec.wgrad = v.wgrad;
    const std::vector<int64_t> rows = {0, 5, 37, 1, 21, 64};
    std::vector<int64_t> offsets = {0};
    for (int64_t r : rows) offsets.push_back(offsets.back() + r);
    const int64_t R = offsets.back(), K = 256, N = 384, G = static_cast<int64_t>(rows.size());
    const std::string variant =
        std::to_string(G) + " groups, " + std::to_string(R) + " rows, K 256, N 384 " + linear_mode_name(v.mode) +
        (v.mode == LinearMode::FP8_BLOCK ? std::string(" wgrad ") + linear_mode_name(v.wgrad) : std::string()) + " " +
        dtype_name(v.dt) + (v.gdt != v.dt ? std::string(", ") + dtype_name(v.gdt) + " gradients" : std::string());
    t.push_back(
        {"grouped_linear_backward",
         variant,
         [=] {
           Tensors in{{"x", rnd({R, K}, 540)}, {"dy", rnd({R, N}, 541)}};
           for (int64_t g = 0; g < G; ++g) {
             in["w" + std::to_string(g)] = rnd({N, K}, 542 + static_cast<uint32_t>(g), DType::F32, 0.05f);
             in["dw0_" + std::to_string(g)] = rnd({N, K}, 560 + static_cast<uint32_t>(g), DType::F32, 0.1f);
           }
           return in;
         },
         [=](OpRun& r) {
           std::vector<LinearWeight> W(static_cast<size_t>(G));
           std::vector<const LinearWeight*> ws;
           for (int64_t g = 0; g < G; ++g) {
             LinearWeight& w = W[static_cast<size_t>(g)];
             w.w = v.mode == LinearMode::BF16 ? r.as("w" + std::to_string(g), DType::BF16) : r["w" + std::to_string(g)];
             if (v.mode == LinearMode::FP8_BLOCK) {
               w.wq = r.be.alloc_quant(N, K, kQuantBlock, kQuantBlock, false);
               r.be.quantize(w.w, false, w.wq);
             }
             ws.push_back(&w);
           }
           const Tensor dy = r.as("dy", v.dt), x = r.as("x", v.dt);
           // Gradients (accumulated into dw0) in v.gdt, dx in v.dt.
           std::vector<Tensor*> dws, singles;
           for (int64_t g = 0; g < G; ++g) {
             for (const char* n : {"dw", "dws"}) {
               Tensor& d = r.output(n + std::to_string(g), {N, K}, v.gdt);
               r.be.convert(r["dw0_" + std::to_string(g)], d);
               (std::string(n) == "dw" ? dws : singles).push_back(&d);
             }
           }
           r.be.grouped_linear_backward(dy, x, offsets, ws, spec, &r.output("dx", {R, K}, v.dt), dws);
           Tensor& dx1 = r.output("dx_single", {R, K}, v.dt);
           for (int64_t g = 0; g < G; ++g) {
             if (rows[static_cast<size_t>(g)] == 0) continue;
             Tensor dxg = dx1.slice_rows(offsets[g], offsets[g + 1]);
             r.be.linear_backward(dy.slice_rows(offsets[g], offsets[g + 1]), x.slice_rows(offsets[g], offsets[g + 1]),
                                  W[static_cast<size_t>(g)], spec, &dxg, singles[static_cast<size_t>(g)], nullptr);
           }
           if (v.mode == LinearMode::FP8_BLOCK) {  // the trainer's cached W^T (wqt): the same dx, bitwise
             for (LinearWeight& w : W) {
               w.wqt = r.be.alloc_quant(K, N, kQuantBlock, kQuantBlock, false);
               r.be.quantize(w.w, true, w.wqt);
             }
             r.be.grouped_linear_backward(dy, x, offsets, ws, spec, &r.output("dx_wqt", {R, K}, v.dt), {});
             // dy's FP8 copy from a fused producer (add_fp8 of dy + 0) for the dgrad: bitwise the
             // dgrad that quantizes the same dy itself.
             Tensor& dys = r.output("dy_sum", {R, N}, v.dt);
             Fp8View view = r.be.alloc_fp8_view(R, N, false);
             Tensor zero = r.be.alloc({R, N}, v.dt);
             r.be.fill(zero, 0.0f);
             r.be.add_fp8(dy, zero, dys, view);
             r.be.grouped_linear_backward(dys, x, offsets, ws, spec, &r.output("dx_view", {R, K}, v.dt), {}, &view);
             r.be.grouped_linear_backward(dys, x, offsets, ws, spec, &r.output("dx_sum", {R, K}, v.dt), {});
           }
         },
         {{"dx", linear_tolerance(v.mode, v.dt)}},
         v.mode == LinearMode::FP8_BLOCK
             ? std::vector<std::pair<std::string, std::string>>{{"dx_wqt", "dx"}, {"dx_view", "dx_sum"}}
             : std::vector<std::pair<std::string, std::string>>{}});
    // The CPU runs both the same way (bitwise); CUDA's grouped launches are close to the
    // per-group products. The weight gradients accumulate into the given values.
    t.back().close.emplace_back("dx", "dx_single", linear_tolerance(v.mode, v.dt));
    // CUDA: both halves grouped, except FP8 wgrad and FP32 (one product per live group).
    t.back().grouped_loops = v.wgrad == LinearMode::FP8_BLOCK || v.mode == LinearMode::FP32 ? 5 : 0;
    for (int64_t g = 0; g < G; ++g) {
      const std::string n = "dw" + std::to_string(g);
      const Tolerance tw = linear_tolerance(v.wgrad == LinearMode::FP8_BLOCK ? LinearMode::FP8_BLOCK
                                            : v.mode == LinearMode::FP32     ? LinearMode::FP32
                                                                             : LinearMode::BF16,
                                            v.dt);
      t.back().checks.emplace_back(n, tw);
      t.back().close.emplace_back(n, "dws" + std::to_string(g), tw);
    }
    t.back().errors = [=](OpRun& r) {
      LinearWeight w;
      w.w = r["w0"];
      std::vector<const LinearWeight*> ws(static_cast<size_t>(G), &w);
      Tensor dx = r.be.alloc({R, K}, DType::F32);
      std::vector<int64_t> bad = offsets;
      bad.back() = R + 1;  // offsets must end at R
      EXPECT_THROW(r.be.grouped_linear_backward(r["dy"], r["x"], bad, ws, spec, &dx, {}), Error);
      std::vector<Tensor*> one{&dx};  // one weight gradient for G weights
      EXPECT_THROW(r.be.grouped_linear_backward(r["dy"], r["x"], offsets, ws, spec, &dx, one), Error);
      Tensor narrow = r.be.alloc({R, K - 128}, DType::F32);  // dx of the wrong width
      EXPECT_THROW(r.be.grouped_linear_backward(r["dy"], r["x"], offsets, ws, spec, &narrow, {}), Error);
    };
    if (v.wgrad == LinearMode::BF16 && v.dt == DType::BF16) {
      // CUDA's opt-in K-grouped wgrad (FP8RL_GROUPED_WGRAD=own, own64: the transposes, the padded blocks
      // of the 5-, 37-, 1-, 21- and 64-row groups, one chunk) against the same CPU results.
      const OpCase base = t.back();
      for (const char* form : {"own", "own64"}) {
        OpCase own = base;
        own.variant += std::string(", FP8RL_GROUPED_WGRAD=") + form;
        own.env = {{"FP8RL_GROUPED_WGRAD", form}};
        t.push_back(own);
      }
    }
  }
}

void moe_cases(std::vector<OpCase>& t) {
  const int64_t T = 37, E = 12, k = 3, D = 72, R = T * k;
  // Routing: F32 logits; the selection must agree exactly away from ties, weights 1e-5. Two
  // widths: 12 experts (fewer than a warp's lanes) and 160 (five per lane on CUDA, top 8, eight
  // groups of 20 with three kept: the Qwen3-MoE / DeepSeek-V3 regime).
  auto route_rows = [&](int64_t T, int64_t E, int64_t k, int groups, int kept) {
    auto route_inputs = [=] {
      return Tensors{{"logits", rnd({T, E}, 90, DType::F32, 2.0f)},
                     {"dw", rnd({T, k}, 91)},
                     {"bias", rnd({E}, 96, DType::F32, 0.1f)}};
    };
    for (bool renorm : {false, true}) {
      t.push_back(
          {"moe_route_softmax + backward",
           dims({T, E}) + " top " + std::to_string(k) + (renorm ? " renormalized" : ""),
           route_inputs,
           [=](OpRun& r) {
             Tensor& ex = r.output("experts", {T, k}, DType::I32);
             r.be.moe_route_softmax(r["logits"], static_cast<int>(k), renorm, ex,
                                    r.output("weights", {T, k}, DType::F32));
             r.be.moe_route_softmax_backward(r["logits"], ex, renorm, r["dw"], r.output("dlogits", {T, E}, DType::F32));
           },
           {{"experts", bitwise()}, {"weights", rel(1e-5)}, {"dlogits", rel(1e-5)}}});
      t.back().errors = [=](OpRun& r) {
        Tensor ex = r.be.alloc({T, k}, DType::I32), w = r.be.alloc({T, k}, DType::F32);
        EXPECT_THROW(r.be.moe_route_softmax(r["logits"], static_cast<int>(E + 1), renorm, ex, w), Error);
      };
      // DeepSeek-V3 routing: E experts in `groups` groups, `kept` kept, with a correction bias.
      t.push_back({"moe_route_sigmoid + backward",
                   dims({T, E}) + " top " + std::to_string(k) + ", " + std::to_string(groups) + " groups, " +
                       std::to_string(kept) + " kept, bias" + (renorm ? " renormalized" : ""),
                   route_inputs,
                   [=](OpRun& r) {
                     Tensor& ex = r.output("experts", {T, k}, DType::I32);
                     r.be.moe_route_sigmoid(r["logits"], &r["bias"], static_cast<int>(k), groups, kept, renorm, 2.5f,
                                            ex, r.output("weights", {T, k}, DType::F32));
                     r.be.moe_route_sigmoid_backward(r["logits"], ex, renorm, 2.5f, r["dw"],
                                                     r.output("dlogits", {T, E}, DType::F32));
                   },
                   {{"experts", bitwise()}, {"weights", rel(1e-5)}, {"dlogits", rel(1e-5)}}});
      t.back().errors = [=](OpRun& r) {
        Tensor ex = r.be.alloc({T, k}, DType::I32), w = r.be.alloc({T, k}, DType::F32);
        EXPECT_THROW(r.be.moe_route_sigmoid(r["logits"], nullptr, static_cast<int>(k), 7, 2, renorm, 1.0f, ex, w),
                     Error);  // 7 groups divide neither 12 nor 160 experts
      };
    }
  };
  route_rows(T, E, k, 4, 2);
  route_rows(70, 160, 8, 8, 3);
  auto route_inputs = [=] {
    return Tensors{{"logits", rnd({T, E}, 90, DType::F32, 2.0f)},
                   {"dw", rnd({T, k}, 91)},
                   {"bias", rnd({E}, 96, DType::F32, 0.1f)}};
  };
  // Routing replay: the weights of given experts. Given the routing op's own experts they are its
  // weights bitwise (same); given other experts (distinct per token, a fixed pattern) they follow
  // the CPU's within the routing weights' class; the backward is the routing op's backward with
  // those experts, checked by FP64 finite differences.
  std::vector<int32_t> given(T * k);
  for (int64_t t2 = 0; t2 < T; ++t2)
    for (int64_t j = 0; j < k; ++j) given[t2 * k + j] = static_cast<int32_t>((t2 * 5 + j * 7 + 1) % E);
  std::vector<int32_t> given_bad = given;
  given_bad[7] = static_cast<int32_t>(E);
  const int64_t Tg = 5;  // the gradient check's tokens
  const std::vector<int32_t> given_g(given.begin(), given.begin() + Tg * k);
  for (bool sigmoid : {false, true})
    for (bool renorm : {false, true}) {
      const std::string name = sigmoid ? "moe_route_sigmoid" : "moe_route_softmax";
      auto route = [=](OpRun& r, const Tensor& logits, Tensor& ex, Tensor& w) {
        if (sigmoid) r.be.moe_route_sigmoid(logits, &r["bias"], static_cast<int>(k), 4, 2, renorm, 2.5f, ex, w);
        else r.be.moe_route_softmax(logits, static_cast<int>(k), renorm, ex, w);
      };
      auto weights_of = [=](Backend& be, const Tensor& logits, const Tensor& ex, Tensor& w) {
        if (sigmoid) be.moe_route_sigmoid_weights(logits, ex, renorm, 2.5f, w);
        else be.moe_route_softmax_weights(logits, ex, renorm, w);
      };
      t.push_back({name + "_weights (+ " + name + "_backward)",
                   dims({T, E}) + " top 3, given experts" + (renorm ? " renormalized" : ""),
                   [=] {
                     Tensors in = route_inputs();
                     in["given"] = i32_tensor(given, {T, k});
                     in["given_bad"] = i32_tensor(given_bad, {T, k});
                     return in;
                   },
                   [=](OpRun& r) {
                     Tensor& ex = r.output("experts", {T, k}, DType::I32);
                     route(r, r["logits"], ex, r.output("weights", {T, k}, DType::F32));
                     weights_of(r.be, r["logits"], ex, r.output("replayed", {T, k}, DType::F32));
                     weights_of(r.be, r["logits"], r["given"], r.output("given_weights", {T, k}, DType::F32));
                   },
                   {{"experts", bitwise()}, {"weights", rel(1e-5)}, {"given_weights", rel(1e-5)}},
                   {{"replayed", "weights"}}});
      t.back().errors = [=](OpRun& r) {
        Tensor w = r.be.alloc({T, k}, DType::F32);
        EXPECT_THROW(
            {
              weights_of(r.be, r["logits"], r["given_bad"], w);  // an expert id == E
              r.be.synchronize();
            },
            Error);
        Tensor w2 = r.be.alloc({T, k + 1}, DType::F32);
        EXPECT_THROW(weights_of(r.be, r["logits"], r["given"], w2), Error);  // weights not [T, k]
      };
      t.back().grad.inputs = [=] {
        return Tensors{{"logits", rnd({Tg, E}, 97, DType::F64, 2.0f)},
                       {"R", rnd({Tg, k}, 98, DType::F64)},
                       {"given", i32_tensor(given_g, {Tg, k})}};
      };
      t.back().grad.forward = [=](OpRun& r) {
        weights_of(r.be, r["logits"], r["given"], r.output("w", {Tg, k}, DType::F64));
      };
      t.back().grad.loss = {{"w", "R"}};
      t.back().grad.backward = [=](OpRun& r) {
        Tensor& dz = r.output("dlogits", {Tg, E}, DType::F64);
        if (sigmoid) r.be.moe_route_sigmoid_backward(r["logits"], r["given"], renorm, 2.5f, r["R"], dz);
        else r.be.moe_route_softmax_backward(r["logits"], r["given"], renorm, r["R"], dz);
      };
      t.back().grad.wrt = {{"logits", "dlogits"}};
    }
  // A permutation of the slots (sorted by a pseudo expert id) and its inverse.
  std::vector<int32_t> row_slot(R), slot_row(R);
  for (int64_t i = 0; i < R; ++i) row_slot[i] = static_cast<int32_t>((i * 7 + 3) % R);
  for (int64_t r = 0; r < R; ++r) slot_row[row_slot[r]] = static_cast<int32_t>(r);
  for (DType dt : {DType::F32, DType::BF16})
    for (bool weighted : {false, true}) {
      const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
      t.push_back({"moe_permute + moe_unpermute (+ backward_weights)",
                   std::string(dtype_name(dt)) + " T 37, k 3, D 72" + (weighted ? " weighted" : ""),
                   [=] {
                     std::vector<int32_t> bad = slot_row;
                     bad[5] = static_cast<int32_t>(R);
                     return Tensors{{"x", rnd({T, D}, 93, dt)},
                                    {"y", rnd({R, D}, 94, dt)},
                                    {"w", rnd({R}, 92)},
                                    {"row_slot", i32_tensor(row_slot, {R})},
                                    {"slot_row", i32_tensor(slot_row, {R})},
                                    {"bad", i32_tensor(bad, {R})}};
                   },
                   [=](OpRun& r) {
                     const Tensor* w = weighted ? &r["w"] : nullptr;
                     r.be.moe_permute(r["x"], r["row_slot"], static_cast<int>(k), w, r.output("permuted", {R, D}, dt));
                     r.be.moe_unpermute(r["y"], r["slot_row"], w, r.output("unpermuted", {T, D}, dt));
                     if (weighted)
                       r.be.moe_unpermute_backward_weights(r["x"], r["y"], r["slot_row"],
                                                           r.output("dweights", {R}, DType::F32));
                   },
                   {{"permuted", rel(tol)}, {"unpermuted", rel(tol)}}});
      if (weighted) t.back().checks.push_back({"dweights", rel(dt == DType::F32 ? 1e-5 : 1e-3)});
      // An out-of-range index is an error (raised at the next synchronizing call at the latest).
      t.back().errors = [=](OpRun& r) {
        Tensor out = r.be.alloc({T, D}, dt);
        EXPECT_THROW(
            {
              r.be.moe_unpermute(r["y"], r["bad"], nullptr, out);
              r.be.synchronize();
            },
            Error);
      };
    }
  // moe_plan: the slots sorted by expert and the tile table, bitwise moe_sort_slots / moe_tiles
  // (the CPU's) on every backend: a few tokens, a decode step (256 x 8 of 128 experts, one of two
  // chunks of the CUDA kernel's placement), 16,000 slots over 64 experts (16 chunks), experts
  // with no rows (more experts than slots), a block of 1 row. The tiles compared up to their count.
  struct PlanCase {
    int64_t T, k, E;
    int bm;
  };
  for (const PlanCase pc : {PlanCase{37, 3, 8, 4}, PlanCase{256, 8, 128, 64}, PlanCase{2000, 8, 64, 128},
                            PlanCase{5, 2, 300, 64}, PlanCase{40, 1, 16, 1}}) {
    const int64_t R = pc.T * pc.k, max_tiles = moe_plan_max_tiles(R, pc.E, pc.bm);
    t.push_back(
        {"moe_plan",
         "T " + std::to_string(pc.T) + ", k " + std::to_string(pc.k) + ", E " + std::to_string(pc.E) + ", block " +
             std::to_string(pc.bm),
         [=] {
           // Skewed ids (a few experts take most slots, as trained routers do): e = (h^2 mod E^2) / E.
           std::vector<int32_t> ex(static_cast<size_t>(R));
           for (int64_t s = 0; s < R; ++s) {
             const uint64_t h = (static_cast<uint64_t>(s) * 2654435761u + 12345u) % static_cast<uint64_t>(pc.E * pc.E);
             ex[s] = static_cast<int32_t>(h * h % static_cast<uint64_t>(pc.E * pc.E) / static_cast<uint64_t>(pc.E));
           }
           std::vector<int32_t> bad = ex;
           bad[static_cast<size_t>(R / 2)] = static_cast<int32_t>(pc.E);
           return Tensors{{"experts", i32_tensor(ex, {pc.T, pc.k})}, {"bad", i32_tensor(bad, {pc.T, pc.k})}};
         },
         [=](OpRun& r) {
           Tensor& tiles = r.output("tiles", {max_tiles, 4}, DType::I32);
           Tensor& count = r.output("tile_count", {1}, DType::I32);
           r.be.moe_plan(r["experts"], pc.E, pc.bm, r.output("offsets", {pc.E + 1}, DType::I32),
                         r.output("row_slot", {R}, DType::I32), r.output("slot_row", {R}, DType::I32), tiles, count);
           const int64_t n = r.be.to_host(count).data<int32_t>()[0];
           ASSERT_TRUE(n >= 0 && n <= max_tiles) << n << " tiles of at most " << max_tiles;
           r.be.copy(tiles.slice_rows(0, n), r.output("tiles_used", {n, 4}, DType::I32));
         },
         {{"offsets", bitwise()},
          {"row_slot", bitwise()},
          {"slot_row", bitwise()},
          {"tile_count", bitwise()},
          {"tiles_used", bitwise()}}});
    // An expert id outside [0, E) is an error (raised at the next synchronizing call at the latest).
    t.back().errors = [=](OpRun& r) {
      Tensor off = r.be.alloc({pc.E + 1}, DType::I32), rs = r.be.alloc({R}, DType::I32),
             sr = r.be.alloc({R}, DType::I32), tl = r.be.alloc({max_tiles, 4}, DType::I32),
             n = r.be.alloc({1}, DType::I32);
      EXPECT_THROW(
          {
            r.be.moe_plan(r["bad"], pc.E, pc.bm, off, rs, sr, tl, n);
            r.be.synchronize();
          },
          Error);
    };
  }
}

// moe_permute_fp8: moe_permute's rows and their FP8 copy, bitwise the quantization of those
// rows, the rows bitwise moe_permute's: gathered from x's copy (xq, written by add_fp8 here as
// add_rmsnorm writes xn_mlp's: the experts' input), or quantized in the pass, with or without the
// routing weights (the down dgrad's dY). T 48: x's scales block-major on CUDA (BF16), R 144 the
// output's too; T 37 (R 111) row-major; D 200: a partial last block (CUDA: no 16-byte rows, so
// the gather quantizes instead).
void moe_permute_fp8_cases(std::vector<OpCase>& t) {
  enum Mode { kGather, kQuantize, kWeighted };
  for (Mode mode : {kGather, kQuantize, kWeighted})
    for (DType dt : {DType::F32, DType::BF16})
      for (int64_t T : {int64_t(48), int64_t(37)})
        for (int64_t D : {int64_t(256), int64_t(200)}) {
          const int64_t k = 3, R = T * k;
          const bool pow2 = T == 37;
          std::vector<int32_t> row_slot(R);
          for (int64_t i = 0; i < R; ++i) row_slot[i] = static_cast<int32_t>((i * 7 + 3) % R);
          const char* how = mode == kGather ? " from x's copy" : mode == kQuantize ? " quantized" : " weighted";
          t.push_back({"moe_permute_fp8",
                       dims({T, D}) + " k 3 " + dtype_name(dt) + (pow2 ? " pow2" : "") + how,
                       [=] {
                         return Tensors{{"x", rnd({T, D}, 95, dt, 3.0f)},
                                        {"w", rnd({R}, 96)},
                                        {"row_slot", i32_tensor(row_slot, {R})}};
                       },
                       [=](OpRun& r) {
                         Tensor zero = r.be.alloc({T, D}, dt);
                         r.be.fill(zero, 0.0f);
                         Tensor& xn = r.output("xn", {T, D}, dt);
                         Fp8View xq = r.be.alloc_fp8_view(T, D, pow2);
                         r.be.add_fp8(r["x"], zero, xn, xq);
                         const Tensor* w = mode == kWeighted ? &r["w"] : nullptr;
                         Fp8View oq = r.be.alloc_fp8_view(R, D, pow2);
                         r.be.moe_permute_fp8(xn, mode == kGather ? &xq : nullptr, r["row_slot"], static_cast<int>(k),
                                              w, r.output("out", {R, D}, dt), oq);
                         keep_view(r, oq);
                         r.be.moe_permute(xn, r["row_slot"], static_cast<int>(k), w, r.output("out_ref", {R, D}, dt));
                       },
                       {{"out", mode == kWeighted ? rel(dt == DType::F32 ? 1e-6 : 1e-2) : bitwise()}},
                       {{"out", "out_ref"}}});
          t.back().invariants = [=](const Tensors& o) { expect_view_is_quantized_out(o, pow2); };
          t.back().errors = [=](OpRun& r) {
            Tensor out = r.be.alloc({R, D}, dt), other = r.be.alloc({T, D}, dt);
            r.be.fill(other, 1.0f);
            Fp8View xq = r.be.alloc_fp8_view(T, D, pow2), oq = r.be.alloc_fp8_view(R, D, pow2);
            Tensor zero = r.be.alloc({T, D}, dt);
            r.be.fill(zero, 0.0f);
            r.be.add_fp8(other, zero, zero, xq);  // a view of another tensor than x
            EXPECT_THROW(r.be.moe_permute_fp8(r["x"], &xq, r["row_slot"], static_cast<int>(k), nullptr, out, oq),
                         Error);
            EXPECT_THROW(r.be.moe_permute_fp8(zero, &xq, r["row_slot"], static_cast<int>(k), &r["w"], out, oq),
                         Error);  // x's copy with weights
            Fp8View narrow = r.be.alloc_fp8_view(R, D - 8, pow2);
            EXPECT_THROW(r.be.moe_permute_fp8(zero, &xq, r["row_slot"], static_cast<int>(k), nullptr, out, narrow),
                         Error);
          };
        }
}

// mla_absorb: MLA generation's absorbed products over every head (keys: x W_k into kvr columns;
// values: x W_v^T into dv columns) at column offsets inside wider per-head rows, the other
// columns untouched; F32 and BF16 (CUDA: one strided batched GEMM each). The CPU reference
// (per-head FP32 linears) against naive double sums.
void mla_absorb_cases(std::vector<OpCase>& t) {
  const int64_t T = 37, H = 3, nope = 16, dv = 24, kvr = 40;
  for (DType dt : {DType::F32, DType::BF16})
    for (bool values : {false, true}) {
      const int64_t in = values ? kvr : nope, n = values ? dv : kvr, X = in + 8, O = n + 12;
      const int64_t x0 = values ? 0 : 8, o0 = values ? 12 : 0;
      t.push_back({"mla_absorb",
                   std::string(values ? "values" : "keys") + " T 37 H 3 nope 16 dv 24 kvr 40 " + dtype_name(dt),
                   [=] {
                     return Tensors{{"x", rnd({T, H, X}, 97, dt)},
                                    {"w", rnd({H * (nope + dv), kvr}, 98, dt, 0.2f)},
                                    {"o", rnd({T, H, O}, 99, dt)}};
                   },
                   [=](OpRun& r) {
                     Tensor& out = r.updated("out", "o");
                     r.be.mla_absorb(r["x"], x0, r["w"], nope, dv, values, out, o0);
                   },
                   {{"out", rel(dt == DType::F32 ? 1e-5 : 1e-2)}}});
      t.back().references.push_back({"MlaAbsorbMatchesNaive", [=](Backend& cpu) {
                                       const Tensor x = rnd({T, H, X}, 97);
                                       const Tensor w = rnd({H * (nope + dv), kvr}, 98, DType::F32, 0.2f);
                                       Tensor out = cpu.alloc({T, H, O}, DType::F32);
                                       cpu.fill(out, 7.0f);
                                       cpu.mla_absorb(x, x0, w, nope, dv, values, out, o0);
                                       const std::vector<double> xv = test::values(x), wv = test::values(w);
                                       std::vector<double> ref(T * H * O, 7.0);
                                       for (int64_t i = 0; i < T * H; ++i) {
                                         const int64_t h = i % H, base = h * (nope + dv) + (values ? nope : 0);
                                         for (int64_t j = 0; j < n; ++j) {
                                           double acc = 0;
                                           for (int64_t e = 0; e < in; ++e)
                                             acc += xv[i * X + x0 + e] *
                                                    (values ? wv[(base + j) * kvr + e] : wv[(base + e) * kvr + j]);
                                           ref[i * O + o0 + j] = acc;
                                         }
                                       }
                                       EXPECT_LT(test::rel_err(test::values(out), ref), 1e-6);
                                     }});
      t.back().errors = [=](OpRun& r) {
        Tensor out = r.be.alloc({T, H, O}, dt);
        EXPECT_THROW(r.be.mla_absorb(r["x"], x0 + 9, r["w"], nope, dv, values, out, o0), Error);  // past x's row
        EXPECT_THROW(r.be.mla_absorb(r["x"], x0, r["w"], nope + 1, dv, values, out, o0), Error);  // w's rows
      };
    }
}

// ---- attention -------------------------------------------------------------------------------

void attention_cases(std::vector<OpCase>& t) {
  struct Attn {
    int Hq, Hkv, hd;
    std::vector<int32_t> cu;
  };
  const Attn cases[] = {{4, 2, 64, {0, 1, 17, 50}}, {2, 2, 128, {0, 40, 41}}, {6, 1, 80, {0, 23}}};
  uint32_t seed = 80;
  for (const Attn& c : cases)
    for (DType dt : {DType::F32, DType::BF16}) {
      const int64_t T = c.cu.back();
      const float sc = 1.0f / std::sqrt(static_cast<float>(c.hd));
      const uint32_t s = seed;
      seed += 4;
      const bool f32 = dt == DType::F32;
      t.push_back({"attention + attention_backward",
                   "Hq " + std::to_string(c.Hq) + " Hkv " + std::to_string(c.Hkv) + " hd " + std::to_string(c.hd) +
                       " T " + std::to_string(T) + " " + dtype_name(dt),
                   [=] {
                     return Tensors{{"q", rnd({T, c.Hq, c.hd}, s, dt)},
                                    {"k", rnd({T, c.Hkv, c.hd}, s + 1, dt)},
                                    {"v", rnd({T, c.Hkv, c.hd}, s + 2, dt)},
                                    {"dout", rnd({T, c.Hq, c.hd}, s + 3, dt)}};
                   },
                   [=](OpRun& r) {
                     Tensor& o = r.output("out", {T, c.Hq, c.hd}, dt);
                     Tensor& l = r.output("lse", {c.Hq, T}, DType::F32);
                     r.be.attention(r["q"], r["k"], r["v"], c.cu, sc, o, l);
                     r.be.attention_backward(r["dout"], r["q"], r["k"], r["v"], o, l, c.cu, sc,
                                             r.output("dq", {T, c.Hq, c.hd}, dt), r.output("dk", {T, c.Hkv, c.hd}, dt),
                                             r.output("dv", {T, c.Hkv, c.hd}, dt));
                   },
                   {{"out", rel(f32 ? 1e-5 : 1e-2)},
                    {"lse", rel(1e-5)},
                    {"dq", rel(f32 ? 1e-4 : 3e-2)},
                    {"dk", rel(f32 ? 1e-4 : 3e-2)},
                    {"dv", rel(f32 ? 1e-4 : 3e-2)}}});
      t.back().errors = [=](OpRun& r) {
        Tensor o = r.be.alloc({T, c.Hq, c.hd}, dt), l = r.be.alloc({c.Hq, T}, DType::F32);
        EXPECT_THROW(r.be.attention(r["q"], r["k"], r["v"], {0, static_cast<int32_t>(T - 1)}, sc, o, l), Error);
        if (T > 2) {
          EXPECT_THROW(r.be.attention(r["q"], r["k"], r["v"], {0, 2, 1, static_cast<int32_t>(T)}, sc, o, l), Error);
        }
      };
    }
  // The tensor-core flash path (BF16 activations, head dims (q/k, v) (64, 64), (128, 128) and
  // MLA's (192, 128)): packed ragged sequences (lengths 1, 17, 64, 130, 300: partial, exact and
  // multi-tile 64-token tiles, tiles starting off a multiple of 64), GQA ratio 4, on the flash
  // kernels and on the simple ones (FP8RL_CUDA_ATTENTION=simple), both against the CPU op on the
  // same BF16 inputs and against each other. BF16 class: P and dS are rounded to BF16 before their
  // tensor-core products, so 1e-2 forward and 3e-2 backward; lse 1e-5 (exact BF16 products
  // accumulated in FP32). The backward runs from the CPU's out / lse ("out_ref", "lse_ref"), so
  // both paths see identical inputs.
  const std::vector<int32_t> cu = {0, 1, 18, 82, 212, 512};
  const int Hq = 8, Hkv = 2;
  const int64_t T = cu.back();
  const DType dt = DType::BF16;
  seed = 300;
  for (const std::pair<int, int>& dims : {std::pair<int, int>{64, 64}, {128, 128}, {192, 128}}) {
    const int hd = dims.first, hdv = dims.second;  // plain names: lambdas below capture them
    const float sc = 1.0f / std::sqrt(static_cast<float>(hd));
    const uint32_t s = seed;
    seed += 4;
    auto inputs = [=] {
      Tensors in{{"q", rnd({T, Hq, hd}, s, dt, 2.0f)},  // sharper softmax rows: masking errors show
                 {"k", rnd({T, Hkv, hd}, s + 1, dt)},
                 {"v", rnd({T, Hkv, hdv}, s + 2, dt)},
                 {"dout", rnd({T, Hq, hdv}, s + 3, dt)}};
      auto cpu = make_cpu_backend();
      Tensor o = Tensor::empty({T, Hq, hdv}, dt), l = Tensor::empty({Hq, T}, DType::F32);
      cpu->attention(in["q"], in["k"], in["v"], cu, sc, o, l);
      in["out_ref"] = o;
      in["lse_ref"] = l;
      return in;
    };
    auto run = [=](OpRun& r) {
      for (const std::string mode : {"flash", "simple"}) {
        const ScopedEnv env("FP8RL_CUDA_ATTENTION", mode.c_str());  // the CPU has one path
        r.be.attention(r["q"], r["k"], r["v"], cu, sc, r.output("out_" + mode, {T, Hq, hdv}, dt),
                       r.output("lse_" + mode, {Hq, T}, DType::F32));
        r.be.attention_backward(r["dout"], r["q"], r["k"], r["v"], r["out_ref"], r["lse_ref"], cu, sc,
                                r.output("dq_" + mode, {T, Hq, hd}, dt), r.output("dk_" + mode, {T, Hkv, hd}, dt),
                                r.output("dv_" + mode, {T, Hkv, hdv}, dt));
      }
    };
    OpCase c{"attention + attention_backward",
             std::string("BF16 ragged GQA 4, hd ") + std::to_string(hd) +
                 (hdv != hd ? ", v hd " + std::to_string(hdv) : std::string()) + ", flash and simple kernels",
             inputs, run};
    for (const std::string mode : {"flash", "simple"})
      for (const auto& [name, tol] :
           {std::pair<const char*, double>{"out_", 1e-2}, {"lse_", 1e-5}, {"dq_", 3e-2}, {"dk_", 3e-2}, {"dv_", 3e-2}})
        c.checks.push_back({name + mode, rel(tol)});
    for (const auto& [name, tol] :
         {std::pair<const char*, double>{"out_", 1e-2}, {"dq_", 3e-2}, {"dk_", 3e-2}, {"dv_", 3e-2}})
      c.close.push_back({name + std::string("flash"), name + std::string("simple"), rel(tol)});
    t.push_back(c);
  }
}

// ---- fused log-probabilities ---------------------------------------------------------------

void logprob_cases(std::vector<OpCase>& t) {
  const int64_t T = 37, D = 256, V = 3000;
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16}) {
    const LinearSpec spec{mode, false};
    t.push_back(
        {"token_logprobs + backward",
         std::string("T 37, D 256, V 3000 ") + linear_mode_name(mode),
         [=] {
           std::vector<int32_t> tg(T);
           for (int64_t i = 0; i < T; ++i) tg[i] = static_cast<int32_t>((i * 977 + 5) % V);
           return Tensors{{"h", rnd({T, D}, 90)},
                          {"W", rnd({V, D}, 91, DType::F32, 0.1f)},
                          {"dl", rnd({T}, 92)},
                          {"targets", i32_tensor(tg, {T})},
                          {"dW0", rnd({V, D}, 93, DType::F32, 0.01f)}};
         },
         [=](OpRun& r) {
           Tensor& lse = r.output("lse", {T}, DType::F32);
           r.be.token_logprobs(r["h"], r["W"], r["targets"], 0.7f, spec, r.output("logp", {T}, DType::F32), lse,
                               &r.output("entropy", {T}, DType::F32));
           r.be.token_logprobs_backward(r["h"], r["W"], r["targets"], 0.7f, spec, lse, r["dl"],
                                        r.output("dh", {T, D}, DType::F32), &r.updated("dW", "dW0"));
         },
         {{"logp", rel(1e-4)}, {"lse", rel(1e-5)}, {"entropy", rel(1e-4)}, {"dh", rel(1e-4)}, {"dW", rel(1e-4)}}});
    t.back().errors = [=](OpRun& r) {
      Tensor logp = r.be.alloc({T}, DType::F32), lse = r.be.alloc({T}, DType::F32);
      EXPECT_THROW(r.be.token_logprobs(r["h"], r["W"], r["targets"], 0.0f, spec, logp, lse, nullptr), Error);
      Tensor short_lse = r.be.alloc({T - 1}, DType::F32);
      EXPECT_THROW(r.be.token_logprobs(r["h"], r["W"], r["targets"], 1.0f, spec, logp, short_lse, nullptr), Error);
    };
    if (mode == LinearMode::BF16) {
      // BF16 hidden states and head (CUDA: the head's fused backward), the weight gradient in F32
      // and in BF16 (train.grad_dtype: bf16), accumulated into the given values.
      OpCase c = t.back();  // the same inputs and errors
      c.variant = "T 37, D 256, V 3000 bf16, BF16 operands, F32 and BF16 weight gradients";
      c.run = [=](OpRun& r) {
        const Tensor h = r.as("h", DType::BF16), W = r.as("W", DType::BF16);
        Tensor& lse = r.output("lse", {T}, DType::F32);
        r.be.token_logprobs(h, W, r["targets"], 0.7f, spec, r.output("logp", {T}, DType::F32), lse, nullptr);
        r.be.token_logprobs_backward(h, W, r["targets"], 0.7f, spec, lse, r["dl"], r.output("dh", {T, D}, DType::F32),
                                     &r.updated("dW", "dW0"));
        Tensor& dwb = r.output("dW_bf16", {V, D}, DType::BF16);
        r.be.convert(r["dW0"], dwb);
        r.be.token_logprobs_backward(h, W, r["targets"], 0.7f, spec, lse, r["dl"],
                                     r.output("dh_bf16", {T, D}, DType::F32), &dwb);
      };
      c.checks = {{"logp", rel(1e-4)}, {"lse", rel(1e-5)},     {"dh", rel(1e-4)},
                  {"dW", rel(1e-4)},   {"dh_bf16", rel(1e-4)}, {"dW_bf16", rel(1e-2)}};
      c.same = {{"dh_bf16", "dh"}};  // the weight gradient's dtype does not touch dh
      c.close = {{"dW_bf16", "dW", rel(1e-2)}};
      t.push_back(c);
    }
  }
}

// ---- the consistent mode (EnginePrecision::consistent) ----------------------------------------

// Rows of a [M, N] output (host copy) against a product of rows [r0, r0 + m) alone: the same bits.
void expect_rows_equal(const Tensor& full, const Tensor& part, int64_t r0, const std::string& what) {
  const size_t row = full.nbytes() / static_cast<size_t>(full.dim(0));
  ASSERT_EQ(part.nbytes(), row * static_cast<size_t>(part.dim(0))) << what;
  EXPECT_EQ(
      std::memcmp(static_cast<const char*>(full.raw()) + static_cast<size_t>(r0) * row, part.raw(), part.nbytes()), 0)
      << what << ": rows " << r0 << "+" << part.dim(0) << " depend on the other rows of the batch";
}

void consistent_cases(std::vector<OpCase>& t) {
  // linear with spec.consistent: each row's result is the same bits in a product of 70 rows, of
  // 17 of them and of one (the CUDA GEMMs: the own FP8 kernel at one split, one cuBLASLt algorithm
  // for every M). K spans several 128-blocks, one partial; N = 300 is no multiple of 16 (FP8: the
  // dequantized FP32 GEMM on one algorithm).
  const Gemm shapes[] = {{70, 256, 384}, {70, 300, 200}};
  uint32_t seed = 900;
  for (const Gemm& g : shapes)
    for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16, LinearMode::FP8_BLOCK})
      for (DType odt : {DType::F32, DType::BF16}) {
        if (mode == LinearMode::FP32 && odt == DType::BF16) continue;
        LinearSpec spec{mode, false};
        spec.consistent = true;
        const uint32_t sx = seed++, sw = seed++;
        const bool bias = (sx % 2) == 0;
        t.push_back(
            {"linear",
             gemm_name(g) + " " + linear_mode_name(mode) + " consistent out " + dtype_name(odt) + (bias ? " bias" : ""),
             [=] {
               Tensors in{{"x", rnd({g.M, g.K}, sx)}, {"w", rnd({g.N, g.K}, sw, DType::F32, 0.05f)}};
               if (bias) in["bias"] = rnd({g.N}, sw + 1);
               return in;
             },
             [=](OpRun& r) {
               const DType o = r.be.device() == DeviceKind::CPU ? DType::F32 : odt;
               const LinearWeight W = weight_of(r, bias);
               r.be.linear(r["x"], W, spec, r.output("out", {g.M, g.N}, o));
               const Tensor x17 = r["x"].slice_rows(5, 22), x1 = r["x"].slice_rows(69, 70);
               r.be.linear(x17, W, spec, r.output("out_rows5", {17, g.N}, o));
               r.be.linear(x1, W, spec, r.output("out_row69", {1, g.N}, o));
             },
             {{"out", linear_tolerance(mode, odt)}}});
        t.back().invariants = [](const Tensors& out) {
          expect_rows_equal(out.at("out"), out.at("out_rows5"), 5, "linear (consistent)");
          expect_rows_equal(out.at("out"), out.at("out_row69"), 69, "linear (consistent)");
        };
      }
  // token_logprobs with spec.consistent: vocabulary chunks of kConsistentVocabChunk (V = 4500:
  // two chunks, the last partial) whatever T, so a row's logp / lse / entropy are the same bits
  // alone or among 33 rows.
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16}) {
    LinearSpec spec{mode, false};
    spec.consistent = true;
    const int64_t T = 33, D = 128, V = 4500;
    t.push_back(
        {"token_logprobs",
         std::string("T 33, V 4500 (two chunks) ") + linear_mode_name(mode) + " consistent",
         [=] {
           std::vector<int32_t> tg(T);
           for (int64_t i = 0; i < T; ++i) tg[i] = static_cast<int32_t>((i * 1777 + 11) % V);
           return Tensors{
               {"h", rnd({T, D}, 950)}, {"W", rnd({V, D}, 951, DType::F32, 0.1f)}, {"targets", i32_tensor(tg, {T})}};
         },
         [=](OpRun& r) {
           auto run = [&](int64_t t0, int64_t n, const std::string& tag) {
             const Tensor h = r["h"].slice_rows(t0, t0 + n), tg = r["targets"].slice_rows(t0, t0 + n);
             r.be.token_logprobs(h, r["W"], tg, 0.9f, spec, r.output("logp" + tag, {n}, DType::F32),
                                 r.output("lse" + tag, {n}, DType::F32), &r.output("entropy" + tag, {n}, DType::F32));
           };
           run(0, T, "");
           run(7, 1, "_row7");
           run(20, 13, "_rows20");
         },
         {{"logp", rel(1e-4)}, {"lse", rel(1e-5)}, {"entropy", rel(1e-4)}}});
    t.back().invariants = [](const Tensors& out) {
      for (const char* k : {"logp", "lse", "entropy"}) {
        expect_rows_equal(out.at(k), out.at(std::string(k) + "_row7"), 7, std::string("token_logprobs ") + k);
        expect_rows_equal(out.at(k), out.at(std::string(k) + "_rows20"), 20, std::string("token_logprobs ") + k);
      }
    };
  }
  // logprobs_of_logits over the consistent head's logits (linear of each kConsistentVocabChunk
  // chunk of lm_head into F32, copied into [T, V]: model_consistent_logits) is token_logprobs with
  // spec.consistent, bitwise, on every backend (it folds the same chunks with the same code):
  // V = 9000 (three chunks, the last partial), targets in every chunk, temperatures 0.8 and 1,
  // BF16 hidden rows with the BF16 head (the fast path), F32 ones with the FP32 head; a row alone
  // is the same bits as among the others.
  for (LinearMode mode : {LinearMode::FP32, LinearMode::BF16}) {
    LinearSpec spec{mode, false};
    spec.consistent = true;
    const int64_t T = 19, D = 128, V = 9000;
    const DType hdt = mode == LinearMode::BF16 ? DType::BF16 : DType::F32;
    t.push_back(
        {"logprobs_of_logits + token_logprobs",
         std::string("T 19, V 9000 (three chunks) ") + linear_mode_name(mode) + " consistent head logits",
         [=] {
           std::vector<int32_t> tg(T);
           for (int64_t i = 0; i < T; ++i) tg[i] = static_cast<int32_t>((i * 2311 + 17) % V);
           tg[3] = static_cast<int32_t>(V - 1);
           std::vector<int32_t> bad = tg;
           bad[5] = static_cast<int32_t>(V);
           return Tensors{{"h", rnd({T, D}, 960)},
                          {"W", rnd({V, D}, 961, DType::F32, 0.1f)},
                          {"targets", i32_tensor(tg, {T})},
                          {"bad_targets", i32_tensor(bad, {T})}};
         },
         [=](OpRun& r) {
           const Tensor h = r.as("h", hdt);
           Tensor& logits = r.output("logits", {T, V}, DType::F32);
           for (int64_t v0 = 0; v0 < V; v0 += kConsistentVocabChunk) {
             const int64_t n = std::min(kConsistentVocabChunk, V - v0);
             LinearWeight chunk;
             chunk.w = r["W"].slice_rows(v0, v0 + n);
             Tensor tmp = r.be.alloc({T, n}, DType::F32);
             r.be.linear(h, chunk, spec, tmp);
             r.be.copy_cols(tmp, 0, logits, v0, n);
           }
           for (const auto& [temp, tag] : {std::pair<float, const char*>{0.8f, "_t08"}, {1.0f, "_t1"}}) {
             const std::string k(tag);
             r.be.logprobs_of_logits(logits, r["targets"], temp, r.output("logp" + k, {T}, DType::F32),
                                     r.output("lse" + k, {T}, DType::F32));
             r.be.token_logprobs(h, r["W"], r["targets"], temp, spec, r.output("tl_logp" + k, {T}, DType::F32),
                                 r.output("tl_lse" + k, {T}, DType::F32), nullptr);
           }
           r.be.logprobs_of_logits(logits.slice_rows(7, 8), r["targets"].slice_rows(7, 8), 0.8f,
                                   r.output("logp_row7", {1}, DType::F32), r.output("lse_row7", {1}, DType::F32));
         },
         {{"logits", linear_tolerance(mode, DType::F32)},
          {"logp_t08", rel(1e-4)},
          {"lse_t08", rel(1e-5)},
          {"logp_t1", rel(1e-4)},
          {"lse_t1", rel(1e-5)}},
         {{"logp_t08", "tl_logp_t08"}, {"lse_t08", "tl_lse_t08"}, {"logp_t1", "tl_logp_t1"}, {"lse_t1", "tl_lse_t1"}}});
    t.back().invariants = [](const Tensors& out) {
      expect_rows_equal(out.at("logp_t08"), out.at("logp_row7"), 7, "logprobs_of_logits logp");
      expect_rows_equal(out.at("lse_t08"), out.at("lse_row7"), 7, "logprobs_of_logits lse");
    };
    t.back().errors = [=](OpRun& r) {
      Tensor logits = r.be.alloc({T, V}, DType::F32), logp = r.be.alloc({T}, DType::F32),
             lse = r.be.alloc({T}, DType::F32);
      r.be.fill(logits, 0.25f);
      // An out-of-range target (on the GPU found on the device) surfaces at the next
      // synchronizing call at the latest, naming the op; the backend is usable afterwards.
      try {
        r.be.logprobs_of_logits(logits, r["bad_targets"], 1.0f, logp, lse);
        r.be.synchronize();
        ADD_FAILURE() << "an out-of-range target was not reported";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("logprobs_of_logits"), std::string::npos) << e.what();
      }
      r.be.synchronize();
      r.be.logprobs_of_logits(logits, r["targets"], 1.0f, logp, lse);
      EXPECT_NO_THROW(r.be.synchronize());
      EXPECT_THROW(r.be.logprobs_of_logits(logits, r["targets"], 0.0f, logp, lse), Error);  // temperature 0
      Tensor short_lse = r.be.alloc({T - 1}, DType::F32);
      EXPECT_THROW(r.be.logprobs_of_logits(logits, r["targets"], 1.0f, logp, short_lse), Error);
      EXPECT_THROW(r.be.logprobs_of_logits(logits.reshape({T * V}), r["targets"], 1.0f, logp, lse), Error);  // not 2-D
      EXPECT_THROW(r.be.logprobs_of_logits(logits.slice_rows(0, T - 1), r["targets"], 1.0f, logp, lse), Error);
    };
  }
}

// ---- generation ----------------------------------------------------------------------------------

void generation_cases(std::vector<OpCase>& t) {
  // KV-cache writes (bitwise) and paged attention over them: two sequences of 9 and 6 tokens in
  // scattered pages of 4.
  const int L = 2, pages = 12, ps = 4, Hkv = 2, hd = 64, Hq = 4;
  const std::vector<std::vector<int32_t>> page_lists = {{7, 2, 9}, {0, 11}};
  const std::vector<int32_t> lens = {9, 6};
  std::vector<int32_t> seq, pos, slots;
  for (int b = 0; b < 2; ++b)
    for (int p = 0; p < lens[b]; ++p) {
      seq.push_back(b);
      pos.push_back(p);
      slots.push_back(page_lists[b][p / ps] * ps + p % ps);
    }
  const int64_t T = static_cast<int64_t>(seq.size());
  const std::vector<int32_t> table = {7, 2, 9, 0, 11, -1};
  for (DType kdt : {DType::F32, DType::BF16, DType::E4M3})
    for (bool fp8q : {false, true}) {
      t.push_back({"kv_write + attention_paged",
                   std::string(dtype_name(kdt)) + " cache" + (fp8q ? ", FP8 attention" : "") + ", 2 sequences",
                   [=] {
                     Tensor ks = rnd({L, Hkv}, 100), vs = rnd({L, Hkv}, 101);
                     for (int64_t i = 0; i < L * Hkv; ++i) {
                       ks.data<float>()[i] = 0.01f + std::fabs(ks.data<float>()[i]) * 0.02f;
                       vs.data<float>()[i] = 0.01f + std::fabs(vs.data<float>()[i]) * 0.02f;
                     }
                     return Tensors{{"k_scale", ks},
                                    {"v_scale", vs},
                                    {"k", rnd({T, Hkv, hd}, 102, DType::F32, 2.0f)},
                                    {"v", rnd({T, Hkv, hd}, 103, DType::F32, 2.0f)},
                                    {"q", rnd({T, Hq, hd}, 104)},
                                    {"seq", i32_tensor(seq, {T})},
                                    {"pos", i32_tensor(pos, {T})},
                                    {"slots", i32_tensor(slots, {T})},
                                    {"table", i32_tensor(table, {2, 3})}};
                   },
                   [=](OpRun& r) {
                     KvCache c = r.be.alloc_kv_cache(L, pages, ps, Hkv, hd, kdt);
                     r.be.copy(r["k_scale"], c.k_scale);
                     r.be.copy(r["v_scale"], c.v_scale);
                     for (int l = 0; l < L; ++l) {  // zero the pools so untouched slots compare equal
                       r.be.fill(c.k[l], 0.0f);
                       r.be.fill(c.v[l], 0.0f);
                     }
                     const PagedBatch b{r["seq"], r["pos"], r["slots"], r["table"], 9};
                     r.be.kv_write(c, 1, r["k"], r["v"], b);
                     r.out["k_pool"] = c.k[1];
                     r.out["v_pool"] = c.v[1];
                     r.be.attention_paged(c, 1, r["q"], b, 1.0f / 8.0f, fp8q, r.output("out", {T, Hq, hd}, DType::F32));
                   },
                   {{"k_pool", bitwise()}, {"v_pool", bitwise()}, {"out", rel(1e-5)}}});
      t.back().errors = [=](OpRun& r) {
        KvCache c = r.be.alloc_kv_cache(L, pages, ps, Hkv, hd, kdt);
        const PagedBatch b{r["seq"], r["pos"], r["slots"], r["table"], 9};
        EXPECT_THROW(r.be.kv_write(c, L, r["k"], r["v"], b), Error);  // no such layer
        Tensor out = r.be.alloc({T, Hq, hd}, DType::F32);
        EXPECT_THROW(r.be.attention_paged(c, 1, r["k"], b, 1.0f, fp8q, out), Error);  // k is not [T, Hq, hd]
      };
    }
  // The trainer's KV rounding: the value an E4M3 cache hands the attention, in place.
  for (DType dt : {DType::F32, DType::BF16})
    t.push_back({"kv_round",
                 std::string("T 21, 3 heads of 64 ") + dtype_name(dt),
                 [=] {
                   return Tensors{{"x", rnd({21, 3, 64}, 105, dt, 2.0f)}};
                 },
                 [](OpRun& r) {
                   r.be.kv_round(r.updated("x", "x"), {0.01f, 0.02f, 0.005f});
                 },
                 {{"x", bitwise()}}});
  t.back().errors = [](OpRun& r) {
    Tensor x = r.be.alloc({21, 3, 64}, DType::BF16);
    EXPECT_THROW(r.be.kv_round(x, {0.01f, 0.02f}), Error);        // one scale per head
    EXPECT_THROW(r.be.kv_round(x, {0.01f, 0.0f, 0.01f}), Error);  // scales > 0
  };

  // attention_paged in the consistent mode (batch_invariant) with its lse: two sequences of 1100
  // and 37 positions in pages of 16 (the longer spans two of CUDA's invariant chunks of 1024), every
  // token a query; each token's output is the same bits in that prefill-sized batch and in a
  // decode batch of three tokens (max_pos, T and the split of the batch differ); asking for the
  // lse does not change out; the lse is attention()'s on the values the cache hands back.
  for (DType kdt : {DType::F32, DType::BF16, DType::E4M3}) {
    const DType qdt = kdt == DType::F32 ? DType::F32 : DType::BF16;  // CUDA: the tiled / tensor-core kernels
    const int ips = 16, iHkv = 2, ihd = 64, iHq = 4;
    const std::vector<int32_t> ilens = {1100, 37};
    std::vector<int32_t> iseq, ipos, islots, itable;
    int ipages = 0;
    const int width = (1100 + ips - 1) / ips;
    for (int b = 0; b < 2; ++b) {
      const int np = (ilens[b] + ips - 1) / ips;
      for (int p = 0; p < width; ++p) itable.push_back(p < np ? ipages + (p * 7) % np : 0);  // scattered
      for (int p = 0; p < ilens[b]; ++p) {
        iseq.push_back(b);
        ipos.push_back(p);
        islots.push_back(itable[static_cast<size_t>(b) * width + p / ips] * ips + p % ips);
      }
      ipages += np;
    }
    const int64_t iT = static_cast<int64_t>(iseq.size());
    const std::vector<int32_t> dec = {1099, 1100 + 36, 300};  // the tokens of the decode batch
    t.push_back(
        {"kv_write + attention_paged",
         std::string(dtype_name(kdt)) + " cache, batch-invariant with lse, 1100 + 37 positions",
         [=] {
           Tensor ks = rnd({1, iHkv}, 120), vs = rnd({1, iHkv}, 121);
           for (int64_t i = 0; i < iHkv; ++i) {
             ks.data<float>()[i] = 0.01f + std::fabs(ks.data<float>()[i]) * 0.02f;
             vs.data<float>()[i] = 0.01f + std::fabs(vs.data<float>()[i]) * 0.02f;
           }
           std::vector<int32_t> dseq, dpos, dslots;
           for (int32_t i : dec) {
             dseq.push_back(iseq[i]);
             dpos.push_back(ipos[i]);
             dslots.push_back(islots[i]);
           }
           return Tensors{{"k_scale", ks},
                          {"v_scale", vs},
                          {"k", rnd({iT, iHkv, ihd}, 122, qdt, 2.0f)},
                          {"v", rnd({iT, iHkv, ihd}, 123, qdt, 2.0f)},
                          {"q", rnd({iT, iHq, ihd}, 124, qdt, 0.5f)},
                          {"seq", i32_tensor(iseq, {iT})},
                          {"pos", i32_tensor(ipos, {iT})},
                          {"slots", i32_tensor(islots, {iT})},
                          {"table", i32_tensor(itable, {2, width})},
                          {"dseq", i32_tensor(dseq, {3})},
                          {"dpos", i32_tensor(dpos, {3})},
                          {"dslots", i32_tensor(dslots, {3})}};
         },
         [=](OpRun& r) {
           KvCache c = r.be.alloc_kv_cache(1, ipages, ips, iHkv, ihd, kdt);
           r.be.copy(r["k_scale"], c.k_scale);
           r.be.copy(r["v_scale"], c.v_scale);
           PagedBatch b{r["seq"], r["pos"], r["slots"], r["table"], 1100};
           b.batch_invariant = true;
           r.be.kv_write(c, 0, r["k"], r["v"], b);
           const DType odt = r.be.device() == DeviceKind::CPU ? DType::F32 : qdt;
           const Tensor q = r.be.device() == DeviceKind::CPU ? r.as("q", DType::F32) : r["q"];
           Tensor& out = r.output("out", {iT, iHq, ihd}, odt);
           r.be.attention_paged(c, 0, q, b, 0.125f, false, out, &r.output("lse", {iHq, iT}, DType::F32));
           r.be.attention_paged(c, 0, q, b, 0.125f, false, r.output("out_nolse", {iT, iHq, ihd}, odt));
           // The same with query runs (4 or 8 consecutive tokens of a sequence per run, 8 or
           // 16 (token, head) columns: CUDA's multi-query CTAs read a run's K/V once for
           // one or two blocks of MMA columns): the same bits.
           for (const int rt : {4, 8}) {
             std::vector<int32_t> runs;
             for (int b0 = 0, t0 = 0; b0 < 2; t0 += ilens[b0], ++b0)
               for (int t1 = t0; t1 < t0 + ilens[b0]; t1 += rt)
                 runs.push_back(t1), runs.push_back(std::min(rt, t0 + ilens[b0] - t1));
             PagedBatch br = b;
             br.query_runs = r.be.to_device(i32_tensor(runs, {static_cast<int64_t>(runs.size() / 2), 2}));
             br.query_run_tokens = rt;
             const std::string sfx = rt == 4 ? "" : "8";
             r.be.attention_paged(c, 0, q, br, 0.125f, false, r.output("out_runs" + sfx, {iT, iHq, ihd}, odt),
                                  &r.output("lse_runs" + sfx, {iHq, iT}, DType::F32));
           }
           // The decode batch: its q rows gathered from q (a row gather: embedding).
           PagedBatch d{r["dseq"], r["dpos"], r["dslots"], r["table"], 1100};  // another split count
           d.batch_invariant = true;
           Tensor qd = r.be.alloc({3, iHq * ihd}, q.dtype());
           Tensor idx = r.be.to_device(i32_tensor(dec, {3}));
           r.be.embedding(idx, q.reshape({iT, iHq * ihd}), qd);
           r.be.attention_paged(c, 0, qd.reshape({3, iHq, ihd}), d, 0.125f, false,
                                r.output("out_decode", {3, iHq, ihd}, odt));
         },
         {{"out", rel(kdt == DType::F32 ? 1e-5 : 1e-2)}, {"lse", rel(1e-5)}},
         {{"out_nolse", "out"}, {"out_runs", "out"}, {"lse_runs", "lse"}, {"out_runs8", "out"}, {"lse_runs8", "lse"}}});
    t.back().invariants = [=](const Tensors& out) {
      const Tensor& full = out.at("out");
      const Tensor& d = out.at("out_decode");
      const size_t row = full.nbytes() / static_cast<size_t>(iT);
      for (size_t i = 0; i < dec.size(); ++i)
        EXPECT_EQ(std::memcmp(static_cast<const char*>(full.raw()) + static_cast<size_t>(dec[i]) * row,
                              static_cast<const char*>(d.raw()) + i * row, row),
                  0)
            << "token " << dec[i] << ": its attention depends on the batch (batch_invariant)";
    };
  }

  // attention_paged with its output's FP8 copy (the generator's o projection input; CUDA: written
  // by the tensor-core kernel's epilogue with one split, by the split combine with several): out
  // bitwise the plain call's, codes and scales bitwise quantize(out) of the same run, in either
  // scale layout (CUDA's VEC128 layout when T % 16 == 0). Head_dim 128, GQA 4 / 2, batch-invariant
  // plans: one split below 1024 positions, two for the 1100-position sequence.
  for (DType kdt : {DType::BF16, DType::E4M3})
    for (const std::vector<int32_t>& flens : {std::vector<int32_t>{37}, std::vector<int32_t>{48},
                                              std::vector<int32_t>{1100, 37}, std::vector<int32_t>{1100, 40}}) {
      const int fps = 16, fHkv = 2, fhd = 128, fHq = 4, B = static_cast<int>(flens.size());
      std::vector<int32_t> fseq, fpos, fslots, ftable;
      int fpages = 0, width = 0, maxlen = 0;
      for (int32_t n : flens) width = std::max(width, (n + fps - 1) / fps), maxlen = std::max(maxlen, n);
      for (int b = 0; b < B; ++b) {
        const int np = (flens[b] + fps - 1) / fps;
        for (int p = 0; p < width; ++p) ftable.push_back(p < np ? fpages + (p * 5) % np : 0);
        for (int p = 0; p < flens[b]; ++p) {
          fseq.push_back(b);
          fpos.push_back(p);
          fslots.push_back(ftable[static_cast<size_t>(b) * width + p / fps] * fps + p % fps);
        }
        fpages += np;
      }
      const int64_t fT = static_cast<int64_t>(fseq.size());
      std::string lens_name;
      for (int32_t n : flens) lens_name += (lens_name.empty() ? "" : " + ") + std::to_string(n);
      t.push_back({"kv_write + attention_paged",
                   std::string(dtype_name(kdt)) + " cache, output FP8 copy, " + lens_name + " positions, hd 128",
                   [=] {
                     Tensor ks = rnd({1, fHkv}, 130), vs = rnd({1, fHkv}, 131);
                     for (int64_t i = 0; i < fHkv; ++i) {
                       ks.data<float>()[i] = 0.01f + std::fabs(ks.data<float>()[i]) * 0.02f;
                       vs.data<float>()[i] = 0.01f + std::fabs(vs.data<float>()[i]) * 0.02f;
                     }
                     return Tensors{{"k_scale", ks},
                                    {"v_scale", vs},
                                    {"k", rnd({fT, fHkv, fhd}, 132, DType::BF16, 2.0f)},
                                    {"v", rnd({fT, fHkv, fhd}, 133, DType::BF16, 2.0f)},
                                    {"q", rnd({fT, fHq, fhd}, 134, DType::BF16, 0.5f)},
                                    {"seq", i32_tensor(fseq, {fT})},
                                    {"pos", i32_tensor(fpos, {fT})},
                                    {"slots", i32_tensor(fslots, {fT})},
                                    {"table", i32_tensor(ftable, {B, width})}};
                   },
                   [=](OpRun& r) {
                     KvCache c = r.be.alloc_kv_cache(1, fpages, fps, fHkv, fhd, kdt);
                     r.be.copy(r["k_scale"], c.k_scale);
                     r.be.copy(r["v_scale"], c.v_scale);
                     PagedBatch b{r["seq"], r["pos"], r["slots"], r["table"], maxlen};
                     b.batch_invariant = true;
                     r.be.kv_write(c, 0, r["k"], r["v"], b);
                     const bool cpu = r.be.device() == DeviceKind::CPU;
                     const DType odt = cpu ? DType::F32 : DType::BF16;
                     const Tensor q = cpu ? r.as("q", DType::F32) : r["q"];
                     Tensor& out = r.output("out", {fT, fHq, fhd}, odt);
                     Fp8View view = r.be.alloc_fp8_view(fT, fHq * fhd, false);
                     {
                       const ScopedEnv fused("FP8RL_CUDA_ATTN_FP8_OUT", "1");  // CUDA: the kernels' own copy
                       r.be.attention_paged(c, 0, q, b, 0.125f, false, out, nullptr, &view);
                     }
                     Fp8View view2 = r.be.alloc_fp8_view(fT, fHq * fhd, false);  // the default
                     r.be.attention_paged(c, 0, q, b, 0.125f, false, r.output("out_default", {fT, fHq, fhd}, odt),
                                          nullptr, &view2);
                     r.out["codes_default"] = view2.q.data;
                     r.out["scales_default"] = view2.q.scales;
                     r.be.attention_paged(c, 0, q, b, 0.125f, false, r.output("out_plain", {fT, fHq, fhd}, odt));
                     QuantTensor ref = r.be.alloc_quant(fT, fHq * fhd, 1, kQuantBlock, false);
                     r.be.quantize(out.reshape({fT, fHq * fhd}), false, ref);
                     r.out["codes"] = view.q.data;
                     r.out["codes_ref"] = ref.data;
                     r.out["scales"] = view.q.scales;
                     r.out["scales_ref"] = ref.scales;
                     Tensor layout = Tensor::empty({2}, DType::I32);
                     layout.data<int32_t>()[0] = view.scales_gemm_layout ? 1 : 0;
                     layout.data<int32_t>()[1] = view2.scales_gemm_layout ? 1 : 0;
                     r.out["gemm_layout"] = r.be.to_device(layout);
                     EXPECT_EQ(view.source, out.raw());
                   },
                   {{"out", rel(1e-2)}},
                   {{"out_plain", "out"}, {"out_default", "out"}, {"codes_ref", "codes"}, {"codes_default", "codes"}}});
      t.back().invariants = [=](const Tensors& out) {
        const Tensor& ref = out.at("scales_ref");
        const int64_t nb = fHq * fhd / kQuantBlock;
        for (int i = 0; i < 2; ++i) {
          const bool gemm = out.at("gemm_layout").data<int32_t>()[i] != 0;
          const Tensor& s = out.at(i == 0 ? "scales" : "scales_default");
          for (int64_t r = 0; r < fT; ++r)
            for (int64_t k = 0; k < nb; ++k) {
              const float got = s.data<float>()[gemm ? k * fT + r : r * nb + k];
              const float want = ref.data<float>()[r * nb + k];
              ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << (i == 0 ? "fused" : "default") << " row " << r << " block "
                                                        << k << ": scale " << got << " vs the quantizer's " << want;
            }
        }
      };
    }

  // The GPU sampler (no sort: radix search on order keys) draws the CPU reference's token for the
  // same uniforms: greedy, plain, top-k, top-p, both, on continuous logits (well separated) and
  // on integer logits (many exact ties: the lower id comes first), several vocabulary sizes.
  for (int64_t V : {int64_t(1000), int64_t(1), int64_t(50000)}) {
    const int64_t B = 12;
    const std::vector<float> temp = {0.0f, 1.0f, 0.7f, 1.0f, 1.3f, 1.0f, 0.5f, 2.0f, 1.0f, 1.0f, 0.0f, 0.8f};
    const std::vector<float> top_p = {1.0f, 1.0f, 0.9f, 0.5f, 0.95f, 1.0f, 0.3f, 1.0f, 1.0f, 0.6f, 1.0f, 0.9f};
    const std::vector<int> top_k = {0, 0, 50, 0, 10, 1, 0, 3, 0, 0, 0, 20};
    std::mt19937 gen(5);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int draw = 0; draw < 4; ++draw) {
      std::vector<float> u(B);
      for (float& x : u) x = std::min(ud(gen), 0.99999f);
      if (draw == 0) u[1] = 0.0f;
      t.push_back({"sample",
                   "V " + std::to_string(V) + ", 12 rows, draw " + std::to_string(draw),
                   [=] {
                     Tensor lg = rnd({B, V}, 110 + static_cast<uint32_t>(V), DType::F32, 3.0f);
                     for (int64_t j = 0; j < V; ++j)  // rows 8..11: integer logits, many exact ties
                       for (int64_t b = 8; b < 12; ++b)
                         lg.data<float>()[b * V + j] = std::round(lg.data<float>()[b * V + j]);
                     if (V > 10) lg.data<float>()[5 * V + 7] = -INFINITY;  // a masked token
                     Tensor bad = rnd({2, 100}, 120);
                     bad.data<float>()[150] = NAN;
                     return Tensors{{"logits", lg}, {"bad", bad}, {"good", rnd({2, 100}, 121)}};
                   },
                   [=](OpRun& r) {
                     r.be.sample(r["logits"], temp, top_p, top_k, u, r.output("tokens", {B}, DType::I32),
                                 r.output("logp", {B}, DType::F32));
                   },
                   {{"tokens", bitwise()}, {"logp", near(1e-5)}}});
      if (V == 1000 && draw == 0)
        t.back().errors = [](OpRun& r) {
          Tensor tk = r.be.alloc({2}, DType::I32), lp = r.be.alloc({2}, DType::F32);
          EXPECT_THROW(r.be.sample(r["bad"], {1.0f, 1.0f}, {1.0f, 1.0f}, {0, 0}, {0.5f, 0.5f}, tk, lp), Error);
          EXPECT_THROW(r.be.sample(r["good"], {1.0f, 1.0f}, {1.0f, 1.0f}, {0, 0}, {0.5f, 1.0f}, tk, lp), Error);
        };
    }
  }
  // A padded vocabulary (Qwen: 151936 rows, 151669 tokenizer ids): with valid_vocab the sampler
  // draws only among the first Vv ids of each row (the padding holds the largest logits and
  // -inf: never drawn), the token of sampling the first Vv columns alone; logp, normalized over
  // all V ids, matches the CPU's. NaN in the padding is an error (it is read for logp).
  {
    const int64_t B = 16, V = 151936, Vv = 151669;
    std::vector<float> temp(B), top_p(B);
    std::vector<int> top_k(B);
    const float temps[] = {1.0f, 0.7f, 1.0f, 0.0f};
    const float tps[] = {1.0f, 0.9f, 0.5f, 1.0f};
    const int tks[] = {0, 0, 40, 1000};
    for (int64_t b = 0; b < B; ++b) {
      temp[b] = temps[b % 4];
      top_p[b] = tps[(b / 4) % 4];
      top_k[b] = tks[(b / 2) % 4];
    }
    std::mt19937 gen(13);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int draw = 0; draw < 2; ++draw) {
      std::vector<float> u(B);
      for (float& e : u) e = std::min(ud(gen), 0.99999f);
      u[0] = 0.0f;
      u[2] = 0.99999f;
      t.push_back({"sample",
                   "padded vocabulary 151936 / 151669, 16 rows, draw " + std::to_string(draw),
                   [=] {
                     Tensor lg = rnd({B, V}, 140, DType::F32, 3.0f);
                     Tensor cut = Tensor::empty({B, Vv}, DType::F32);
                     float* x = lg.data<float>();
                     for (int64_t b = 0; b < B; ++b)
                       for (int64_t j = 0; j < V; ++j) {
                         float& e = x[b * V + j];
                         if (b % 4 == 1) e = bf16_round(e);  // ties
                         if (j >= Vv) e = (j - Vv) % 3 == 0 ? 12.0f + e : ((j - Vv) % 3 == 1 ? -INFINITY : e);
                         else cut.data<float>()[b * Vv + j] = e;
                       }
                     Tensor nan_pad = Tensor::empty({B, V}, DType::F32);
                     std::memcpy(nan_pad.raw(), lg.raw(), lg.nbytes());
                     nan_pad.data<float>()[3 * V + Vv + 5] = NAN;
                     return Tensors{{"logits", lg}, {"cut", cut}, {"nan_pad", nan_pad}};
                   },
                   [=](OpRun& r) {
                     r.be.sample(r["logits"], temp, top_p, top_k, u, r.output("tokens", {B}, DType::I32),
                                 r.output("logp", {B}, DType::F32), Vv);
                     r.be.sample(r["cut"], temp, top_p, top_k, u, r.output("tokens_cut", {B}, DType::I32),
                                 r.output("logp_cut", {B}, DType::F32));
                   },
                   {{"tokens", bitwise()}, {"logp", near(1e-5)}},
                   {{"tokens", "tokens_cut"}}});
      t.back().invariants = [=](const Tensors& o) {
        const std::vector<double> tk = values(o.at("tokens")), lp = values(o.at("logp")), lc = values(o.at("logp_cut"));
        for (int64_t b = 0; b < B; ++b) {
          EXPECT_LT(tk[b], Vv) << "row " << b;
          if (temp[b] > 0) {
            EXPECT_LT(lp[b], lc[b] - 1.0) << "row " << b << ": the padding carries most of the mass";
          }
        }
      };
      if (draw == 0)
        t.back().errors = [=](OpRun& r) {
          Tensor tk = r.be.alloc({B}, DType::I32), lp = r.be.alloc({B}, DType::F32);
          const std::vector<float> half(B, 0.5f);
          EXPECT_THROW(r.be.sample(r["logits"], temp, top_p, top_k, half, tk, lp, V + 1), Error);
          EXPECT_THROW(r.be.sample(r["nan_pad"], temp, top_p, top_k, half, tk, lp, Vv), Error);
        };
    }
  }
  // A Llama-3 sized vocabulary: the digit search over 128256 keys, rows of bf16-rounded logits
  // (many exact ties), a masked half, top-k and top-p, greedy, uniforms at 0 and near 1.
  {
    const int64_t B = 64, V = 128256;
    std::vector<float> temp(B), top_p(B);
    std::vector<int> top_k(B);
    const float temps[] = {1.0f, 0.7f, 1.0f, 1.3f, 0.0f, 1.0f, 0.6f, 1.0f};
    const float tps[] = {1.0f, 1.0f, 0.9f, 0.95f, 1.0f, 0.5f, 1.0f, 0.8f};
    const int tks[] = {0, 0, 0, 40, 0, 0, 1000, 7};
    for (int64_t b = 0; b < B; ++b) {
      temp[b] = temps[b % 8];
      top_p[b] = tps[(b / 8) % 8];
      top_k[b] = tks[(b / 3) % 8];
    }
    std::mt19937 gen(9);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int draw = 0; draw < 3; ++draw) {
      std::vector<float> u(B);
      for (float& e : u) e = std::min(ud(gen), 0.99999f);
      u[0] = 0.0f;
      u[1] = 0.99999f;
      t.push_back({"sample",
                   "V 128256, 64 rows, draw " + std::to_string(draw),
                   [=] {
                     Tensor lg = rnd({B, V}, 130, DType::F32, 4.0f);
                     float* x = lg.data<float>();
                     for (int64_t b = 0; b < B; ++b)
                       for (int64_t j = 0; j < V; ++j) {
                         float& e = x[b * V + j];
                         if (b % 4 == 1) e = bf16_round(e);            // ties
                         if (b % 8 == 2 && j % 2 == 0) e = -INFINITY;  // masked
                         if (b % 8 == 3) e *= 3.0f;                    // peaked
                       }
                     return Tensors{{"logits", lg}};
                   },
                   [=](OpRun& r) {
                     r.be.sample(r["logits"], temp, top_p, top_k, u, r.output("tokens", {B}, DType::I32),
                                 r.output("logp", {B}, DType::F32));
                   },
                   {{"tokens", bitwise()}, {"logp", near(1e-5)}}});
    }
  }
}

// sample_rows: the generator's sampler with device parameters (Gumbel-max rows, greedy rows, and
// inverse-CDF rows when truncation is allowed): the CPU's token, logp within 1e-5. BF16 logits
// (the lm_head's output) draw exactly what their F32 copy draws: the same tokens and logp bits.
void sample_rows_cases(std::vector<OpCase>& t) {
  const int64_t B = 16, V = 5000;
  for (DType ldt : {DType::F32, DType::BF16})
    for (bool truncation : {false, true}) {
      t.push_back({"sample_rows",
                   "V 5000, 16 rows" + std::string(truncation ? ", with top-k / top-p rows" : ", plain") +
                       (ldt == DType::BF16 ? ", BF16 logits" : ""),
                   [=] {
                     std::vector<SampleRow> rows(B);
                     for (int64_t b = 0; b < B; ++b) {
                       SampleRow& p = rows[b];
                       p.temperature = b % 5 == 0 ? 0.0f : 0.6f + 0.1f * static_cast<float>(b % 4);
                       p.key_lo = static_cast<uint32_t>(1000 + b);
                       p.key_hi = 7;
                       p.counter = static_cast<uint32_t>(3 * b);
                       p.uniform = 0.37f;
                       if (truncation && b % 3 == 1) p.top_k = 40;
                       if (truncation && b % 3 == 2) p.top_p = 0.9f;
                     }
                     Tensor rt = Tensor::empty({B, 8}, DType::I32);
                     std::memcpy(rt.raw(), rows.data(), B * sizeof(SampleRow));
                     return Tensors{{"logits", rnd({B, V}, 520, DType::F32, 3.0f)}, {"rows", rt}};
                   },
                   [=](OpRun& r) {
                     const Tensor lg = r.as("logits", ldt);
                     r.be.sample_rows(lg, r["rows"], truncation, r.output("tokens", {B}, DType::I32),
                                      r.output("logp", {B}, DType::F32));
                     if (ldt == DType::BF16) {  // the same logits as F32
                       Tensor lf = r.be.alloc({B, V}, DType::F32);
                       r.be.convert(lg, lf);
                       r.be.sample_rows(lf, r["rows"], truncation, r.output("tokens_f32", {B}, DType::I32),
                                        r.output("logp_f32", {B}, DType::F32));
                     }
                   },
                   {{"tokens", bitwise()}, {"logp", near(1e-5)}}});
      if (ldt == DType::BF16)
        t.back().invariants = [](const Tensors& out) {
          expect_rows_equal(out.at("tokens_f32"), out.at("tokens"), 0, "sample_rows (BF16 logits: tokens)");
          expect_rows_equal(out.at("logp_f32"), out.at("logp"), 0, "sample_rows (BF16 logits: logp)");
        };
      t.back().errors = [=](OpRun& r) {
        Tensor tk = r.be.alloc({B}, DType::I32), lp = r.be.alloc({B}, DType::F32);
        Tensor short_rows = r.be.alloc({B, 7}, DType::I32);
        EXPECT_THROW(r.be.sample_rows(r["logits"], short_rows, truncation, tk, lp), Error);
      };
    }
}

}  // namespace

const std::vector<OpCase>& op_table() {
  static const std::vector<OpCase> table = [] {
    std::vector<OpCase> t;
    memory_cases(t);
    quantize_cases(t);
    linear_cases(t);
    layer_cases(t);
    fused_cases(t);
    concatenated_linear_cases(t);
    linear_swiglu_cases(t);
    linear_qkv_norm_rope_cases(t);
    add_fp8_cases(t);
    swiglu_backward_fp8_cases(t);
    grouped_linear_cases(t);
    grouped_linear_shared_input_cases(t);
    grouped_linear_backward_cases(t);
    moe_permute_fp8_cases(t);
    mla_absorb_cases(t);
    moe_cases(t);
    attention_cases(t);
    logprob_cases(t);
    consistent_cases(t);
    generation_cases(t);
    sample_rows_cases(t);
    attach_references(t);
    return t;
  }();
  return table;
}

}  // namespace fp8rl::test
