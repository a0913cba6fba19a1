// bench_gemm_run (bench/gemm_bench.h): `fp8rl bench-gemm`'s body, built into the CUDA library.
// CUDA events, warm-up, median of repeats, random non-zero data.
#include "bench/gemm_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace fp8rl {
namespace {

using cuda::CudaBackend;

// Median milliseconds of `reps` timed runs of fn after `warm` untimed ones.
template <class F>
double time_ms(cudaStream_t s, int warm, int reps, F&& fn) {
  for (int i = 0; i < warm; ++i) fn();
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a), "creating an event");
  CUDA_CHECK(cudaEventCreate(&b), "creating an event");
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(a, s), "recording an event");
    fn();
    CUDA_CHECK(cudaEventRecord(b, s), "recording an event");
    CUDA_CHECK(cudaEventSynchronize(b), "timing");
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b), "reading an event");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Tensor random_device(CudaBackend& be, const Shape& shape, DType dtype, uint32_t seed) {
  // Uniform in [-1, 1) via a host-generated F32 block (repeated), converted on the device.
  const int64_t n = shape_numel(shape);
  const int64_t block = std::min<int64_t>(n, 1 << 22);
  std::vector<float> h(block);
  uint32_t x = seed * 2654435761u + 12345u;
  for (auto& v : h) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>((x >> 8) & 0xffffff) / 8388608.0f - 1.0f;
    if (v == 0.0f) v = 0.5f;
  }
  Tensor f = be.alloc({n}, DType::F32);
  for (int64_t off = 0; off < n; off += block) {
    const int64_t m = std::min(block, n - off);
    // On the backend's stream: its allocations are stream-ordered (device_memory.h).
    CUDA_CHECK(
        cudaMemcpyAsync(static_cast<float*>(f.raw()) + off, h.data(), m * 4, cudaMemcpyHostToDevice, be.stream()),
        "uploading random data");
  }
  be.synchronize();  // h (host) must outlive the uploads
  if (dtype == DType::F32) return f.reshape(shape);
  Tensor t = be.alloc(shape, dtype);
  Tensor fv = f.reshape(shape);
  be.convert(fv, t);
  be.synchronize();
  return t;
}

// Decode-sized products: per-call milliseconds of `reps` back-to-back calls replayed from one
// CUDA graph (median of 5 replays), as the decode step runs them: no host work between calls.
template <class F>
double time_graph_ms(cudaStream_t s, int warm, int reps, F&& fn) {
  for (int i = 0; i < warm; ++i) fn();
  CUDA_CHECK(cudaStreamSynchronize(s), "warm-up");
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), "beginning a capture");
  for (int i = 0; i < reps; ++i) fn();
  CUDA_CHECK(cudaStreamEndCapture(s, &g), "ending a capture");
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0), "instantiating a graph");
  CUDA_CHECK(cudaGraphLaunch(ge, s), "replaying a graph");
  const double ms = time_ms(s, 1, 5, [&] { CUDA_CHECK(cudaGraphLaunch(ge, s), "replaying a graph"); }) / reps;
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return ms;
}

struct Shape3 {
  const char* name;
  int64_t K, N;
};

}  // namespace

nlohmann::json bench_gemm_run(const GemmBenchOptions& options) {
  const int reps = options.reps, warm = options.warmup;
  CudaBackend be(options.device, DType::BF16);
  cudaStream_t s = be.stream();
  auto& gemm = be.gemm();
  nlohmann::json out;
  out["device"] = be.name();
  out["reps"] = reps;
  out["warmup"] = warm;

  const bool selected = !options.shapes.empty() || options.grouped_only;  // one kernel's view
  // ---- copy bandwidth and quantization kernels ----
  if (!selected) {
    const int64_t rows = 8192, cols = 14336;  // 117M elements
    Tensor x = random_device(be, {rows, cols}, DType::BF16, 1);
    Tensor y = be.alloc({rows, cols}, DType::BF16);
    const double bytes_copy = 2.0 * x.nbytes();
    const double ms_copy = time_ms(s, warm, reps, [&] {
      CUDA_CHECK(cudaMemcpyAsync(y.raw(), x.raw(), x.nbytes(), cudaMemcpyDeviceToDevice, s), "copy");
    });
    const double copy_gbs = bytes_copy / ms_copy / 1e6;
    out["copy"] = {{"bytes", bytes_copy}, {"ms", ms_copy}, {"GBps", copy_gbs}};
    std::printf("\n%-34s %10s %10s %8s\n", "memory-bound kernel", "ms", "GB/s", "of copy");
    std::printf("%-34s %10.3f %10.1f %8s\n", "device-to-device copy (BF16)", ms_copy, copy_gbs, "100%");
    struct Q {
      const char* name;
      bool transpose;
      int br;
      int64_t r, c;
    };
    const Q qs[] = {{"quant 1x128 (act, BF16 in)", false, 1, rows, cols},
                    {"quant 1x128 along tokens (T)", true, 1, cols, rows},
                    {"quant 128x128 (weight)", false, 128, rows, cols}};
    out["quant"] = nlohmann::json::array();
    for (const Q& q : qs) {
      QuantTensor qt = be.alloc_quant(q.r, q.c, q.br, 128, false);
      const double bytes = x.nbytes() + static_cast<double>(x.numel()) + qt.scales.nbytes();
      const double ms = time_ms(s, warm, reps, [&] { be.quantize_async(x, q.transpose, qt); });
      be.synchronize();
      const double gbs = bytes / ms / 1e6;
      std::printf("%-34s %10.3f %10.1f %7.0f%%\n", q.name, ms, gbs, 100.0 * gbs / copy_gbs);
      out["quant"].push_back({{"name", q.name}, {"ms", ms}, {"GBps", gbs}, {"fraction_of_copy", gbs / copy_gbs}});
    }
  }

  // ---- GEMMs ----
  // Llama-3.1-8B and Qwen3-1.7B linear widths. Decode-sized products (M <= 256) rotate over
  // enough copies of the weight that L2 (50 MB) never holds the next call's: as in a decode step.
  const Shape3 shapes[] = {{"8b qkv 4096->6144", 4096, 6144},         {"8b o 4096->4096", 4096, 4096},
                           {"8b gate/up 4096->14336", 4096, 14336},   {"8b down 14336->4096", 14336, 4096},
                           {"1.7b qkv 2048->4096", 2048, 4096},       {"1.7b o 2048->2048", 2048, 2048},
                           {"1.7b gate/up 2048->12288", 2048, 12288}, {"1.7b down 6144->2048", 6144, 2048}};
  std::vector<int64_t> Ms = {8192, 256, 128, 64, 32};
  if (options.quick) Ms = {8192};
  if (options.quant_only || selected) Ms.clear();  // the memory-bound kernels alone, or --shapes
  struct Product {
    std::string name;
    int64_t M, K, N;
  };
  std::vector<Product> products;
  for (const Shape3& sh : shapes)
    for (int64_t M : Ms) products.push_back({sh.name, M, sh.K, sh.N});
  for (const auto& s3 : options.shapes) products.push_back({"--shapes", s3[0], s3[2], s3[1]});
  out["gemm"] = nlohmann::json::array();
  std::printf("\n%-26s %6s %-6s %10s %10s %10s %10s %10s %8s %8s %9s\n", "linear", "M", "pass", "BF16 TF/s", "FP8 TF/s",
              "own TF/s", "own ms", "tile ms", "FP8/BF16", "own/BF16", "own-vs-lt");
  for (const Product& sh : products) {
    const int64_t M = sh.M, K = sh.K, N = sh.N;
    struct Pass {
      const char* name;
      int64_t m, n, k;  // C[m, n] = A[m, k] B[n, k]^T
      int b_block_rows;
    };
    std::vector<Pass> passes = {{"fwd", M, N, K, 128}};
    if (M == 8192 && options.shapes.empty()) {
      passes.push_back({"dgrad", M, K, N, 128});
      passes.push_back({"wgrad", N, K, M, 1});
    }
    for (const Pass& p : passes) {
      const double flops = 2.0 * p.m * p.n * p.k;
      const int copies = p.m <= 256 ? static_cast<int>(std::min<int64_t>(16, 1 + (120ll << 20) / (2 * p.n * p.k))) : 1;
      // BF16: C = A B^T with A [m, k], B [n, k] (layouts of each pass as the backend issues them).
      Tensor a = random_device(be, {p.m, p.k}, DType::BF16, 2);
      std::vector<Tensor> b;
      for (int i = 0; i < copies; ++i) b.push_back(random_device(be, {p.n, p.k}, DType::BF16, 3 + i));
      Tensor c = be.alloc({p.m, p.n}, DType::BF16);
      int rot = 0;
      auto timer = [&](auto&& fn) {
        return p.m <= 256 ? time_graph_ms(s, warm, reps, fn) : time_ms(s, warm, reps, fn);
      };
      const double ms_bf16 = timer([&] {
        const Tensor& bi = b[static_cast<size_t>(rot++ % copies)];
        gemm.gemm(false, true, p.m, p.n, p.k, a.raw(), bi.raw(), DType::BF16, c.raw(), DType::BF16, 1.0f, 0.0f);
      });
      // FP8: operands quantized once (1x128 / 128x128), scales laid out once: GEMM alone.
      QuantTensor aq = be.alloc_quant(p.m, p.k, 1, 128, false);
      be.quantize(a, false, aq);
      std::vector<QuantTensor> bq;
      std::vector<Tensor> bs;
      for (int i = 0; i < copies; ++i) {
        bq.push_back(be.alloc_quant(p.n, p.k, p.b_block_rows, 128, false));
        be.quantize(b[static_cast<size_t>(i)], false, bq.back());
        bs.push_back(be.alloc({cuda::GemmEngine::scale_buffer_floats(p.n, p.k, p.b_block_rows)}, DType::F32));
        gemm.layout_scales(bq.back().scales.data<float>(), p.n, p.k, p.b_block_rows, bs.back().data<float>());
      }
      Tensor as = be.alloc({cuda::GemmEngine::scale_buffer_floats(p.m, p.k, 1)}, DType::F32);
      gemm.layout_scales(aq.scales.data<float>(), p.m, p.k, 1, as.data<float>());
      const DType cdt = p.b_block_rows == 1 ? DType::F32 : DType::BF16;  // wgrad accumulates F32
      Tensor c8 = be.alloc({p.m, p.n}, cdt);
      rot = 0;
      const bool m16 = p.m % 16 == 0;
      const double ms_fp8 = !m16 ? 0.0 : timer([&] {
        const size_t i = static_cast<size_t>(rot++ % copies);
        gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[i].data.data<uint8_t>(),
                              bs[i].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f,
                              p.b_block_rows == 1 ? 1.0f : 0.0f);
      });
      // The own sm_90a kernel (128x128-block B here; the wgrad's per-row B below), A scales in the
      // same [kb][M] layout.
      double ms_own = 0.0, ms_own_tile = 0.0, own_vs_lt = 0.0, own64 = 0.0;
      if (p.b_block_rows == kQuantBlock) {
        Tensor co = be.alloc({p.m, p.n}, cdt);
        rot = 0;
        auto own = [&] {
          const size_t i = static_cast<size_t>(rot++ % copies);
          gemm.gemm_fp8_own(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), true, bq[i].data.data<uint8_t>(),
                            bq[i].scales.data<float>(), co.raw(), cdt, 1.0f, 0.0f);
        };
        ms_own = timer(own);  // the persistent grid (the default)
        if (p.m > 256) {      // 64-row tiles: one consumer warpgroup, two CTAs per SM (bench-gemm --mma-probe's
                              // 99% pattern, against the 128-row tiles' two warpgroups' 73%), same bits
          rot = 0;
          const double ms64 = timer([&] {
            const size_t i = static_cast<size_t>(rot++ % copies);
            gemm.gemm_fp8_own(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), true,
                              bq[i].data.data<uint8_t>(), bq[i].scales.data<float>(), co.raw(), cdt, 1.0f, 0.0f, 0, 64);
          });
          std::printf("    own 64-row tiles: %.1f TF/s (the default %d-row: %.1f)\n", flops / ms64 / 1e9,
                      cuda::fp8_gemm_sm90_config(p.m, p.n, p.k, 132).block_m, flops / ms_own / 1e9);
          own64 = flops / ms64 / 1e9;
        }
        rot = 0;
        setenv("FP8RL_FP8_GEMM_GRID", "tile", 1);
        ms_own_tile = timer(own);  // one CTA per tile, for comparison
        unsetenv("FP8RL_FP8_GEMM_GRID");
        // Same operands (copy 0) through both kernels: the largest difference relative to the largest |C|.
        gemm.gemm_fp8_own(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), true, bq[0].data.data<uint8_t>(),
                          bq[0].scales.data<float>(), co.raw(), cdt, 1.0f, 0.0f);
        gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[0].data.data<uint8_t>(),
                              bs[0].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f, 0.0f);
        const Tensor ho = be.to_host(co), hl = be.to_host(c8);
        double dmax = 0.0, cmax = 0.0;
        for (int64_t i = 0; i < ho.numel(); ++i) {
          const double x = bf16_to_float(ho.data<uint16_t>()[i]), y = bf16_to_float(hl.data<uint16_t>()[i]);
          dmax = std::max(dmax, std::fabs(x - y));
          cmax = std::max(cmax, std::fabs(y));
        }
        own_vs_lt = dmax / std::max(cmax, 1e-30);
      }
      // The wgrad's 1x128 x 1x128 product on the own kernel's per-row B scales (the kernel
      // FP8RL_FP8_WGRAD_GEMM=own runs), timed as cuBLASLt's above (F32 output, beta 1), with A's and
      // B's scales in the [kb][rows] layouts that cuBLASLt reads too; its largest difference from
      // cuBLASLt's on copy 0 at beta 0.
      if (p.b_block_rows == 1) {
        Tensor co = be.alloc({p.m, p.n}, cdt);
        auto own_rows = [&](size_t i, Tensor& out, float beta) {
          gemm.gemm_fp8_own_b_rows(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), true,
                                   bq[i].data.data<uint8_t>(), bs[i].data<float>(), out.raw(), cdt, 1.0f, beta);
        };
        rot = 0;
        auto own = [&] { own_rows(static_cast<size_t>(rot++ % copies), co, 1.0f); };
        ms_own = timer(own);
        rot = 0;
        setenv("FP8RL_FP8_GEMM_GRID", "tile", 1);
        ms_own_tile = timer(own);  // one CTA per tile, for comparison
        unsetenv("FP8RL_FP8_GEMM_GRID");
        own_rows(0, co, 0.0f);
        gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[0].data.data<uint8_t>(),
                              bs[0].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f, 0.0f);
        const Tensor ho = be.to_host(co), hl = be.to_host(c8);
        double dmax = 0.0, cmax = 0.0;
        for (int64_t i = 0; i < ho.numel(); ++i) {
          const double x = ho.data<float>()[i], y = hl.data<float>()[i];
          dmax = std::max(dmax, std::fabs(x - y));
          cmax = std::max(cmax, std::fabs(y));
        }
        own_vs_lt = dmax / std::max(cmax, 1e-30);
        std::printf(
            "    own per-row B scales (FP8RL_FP8_WGRAD_GEMM=own): %.1f TF/s, cuBLASLt VEC128 x VEC128: %.1f TF/s\n",
            flops / ms_own / 1e9, ms_fp8 > 0 ? flops / ms_fp8 / 1e9 : 0.0);
      }
      // --fast-accum: cuBLASLt's FP8 product with CUBLASLT_MATMUL_DESC_FAST_ACCUM, timed alike, and
      // (forward and dgrad: beta 0) its largest difference from the default's output on copy 0,
      // relative to the largest |C|: whether block scaling leaves cuBLASLt anything to skip.
      nlohmann::json fast = nullptr;
      if (options.fast_accum && m16) {
        gemm.set_fp8_fast_accum(true);
        try {  // cuBLASLt may have no fast-accumulation kernel for block scaling
          gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[0].data.data<uint8_t>(),
                                bs[0].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f, 0.0f);
        } catch (const std::exception& e) {
          gemm.set_fp8_fast_accum(false);
          std::printf("    FP8 fast accumulation: not available (%s)\n", e.what());
          fast = {{"error", e.what()}};
        }
      }
      if (options.fast_accum && m16 && fast.is_null()) {
        rot = 0;
        const double ms_fast = timer([&] {
          const size_t i = static_cast<size_t>(rot++ % copies);
          gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[i].data.data<uint8_t>(),
                                bs[i].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f,
                                p.b_block_rows == 1 ? 1.0f : 0.0f);
        });
        double rel = -1.0;  // not compared (wgrad accumulates)
        if (p.b_block_rows == kQuantBlock) {
          auto copy0 = [&](bool on) {
            gemm.set_fp8_fast_accum(on);
            gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[0].data.data<uint8_t>(),
                                  bs[0].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f, 0.0f);
            return be.to_host(c8);
          };
          const Tensor hf = copy0(true), hd = copy0(false);
          double dmax = 0.0, cmax = 0.0;
          for (int64_t i = 0; i < hd.numel(); ++i) {
            const double x = bf16_to_float(hf.data<uint16_t>()[i]), y = bf16_to_float(hd.data<uint16_t>()[i]);
            dmax = std::max(dmax, std::fabs(x - y));
            cmax = std::max(cmax, std::fabs(y));
          }
          rel = dmax / std::max(cmax, 1e-30);
        }
        gemm.set_fp8_fast_accum(false);
        std::printf("    FP8 fast accumulation: %.2f us (default %.2f us: %.3fx), max |diff| / max |C| %s%.3g\n",
                    ms_fast * 1e3, ms_fp8 * 1e3, ms_fp8 / ms_fast, rel < 0 ? "(not compared) " : "",
                    rel < 0 ? 0.0 : rel);
        fast = {{"ms", ms_fast}, {"speedup", ms_fp8 / ms_fast}, {"rel_diff", rel}};
      }
      // Decode shapes: the own kernel's configurations (rows per CTA x K splits), timed alike.
      nlohmann::json sweep = nlohmann::json::array();
      if (p.b_block_rows == kQuantBlock && p.m <= 256) {
        Tensor co = be.alloc({p.m, p.n}, cdt);
        std::printf("    own configs (block_m x splits: us):");
        for (int bm : {64, 128})
          for (int sp : {1, 2, 3, 4, 8}) {
            rot = 0;
            const double ms = timer([&] {
              const size_t i = static_cast<size_t>(rot++ % copies);
              gemm.gemm_fp8_own(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), true,
                                bq[i].data.data<uint8_t>(), bq[i].scales.data<float>(), co.raw(), cdt, 1.0f, 0.0f, sp,
                                bm);
            });
            std::printf(" %dx%d %.1f", bm, sp, ms * 1e3);
            sweep.push_back({{"block_m", bm}, {"splits", sp}, {"ms", ms}});
          }
        std::printf("\n");
      }
      // One product of a kind (0 BF16, 1 FP8) through the engine's current cuBLASLt choice, on the
      // next weight copy (--algos and --lt-search).
      auto run_kind = [&](int kind) {
        const size_t i = static_cast<size_t>(rot++ % copies);
        if (kind == 0) {
          gemm.gemm(false, true, p.m, p.n, p.k, a.raw(), b[i].raw(), DType::BF16, c.raw(), DType::BF16, 1.0f, 0.0f);
        } else {
          gemm.gemm_fp8_prelaid(p.m, p.n, p.k, aq.data.data<uint8_t>(), as.data<float>(), bq[i].data.data<uint8_t>(),
                                bs[i].data<float>(), p.b_block_rows, c8.raw(), cdt, 1.0f,
                                p.b_block_rows == 1 ? 1.0f : 0.0f);
        }
      };
      // --algos: every cuBLASLt heuristic candidate for this shape, BF16 and FP8, timed alike (the
      // default runs the first).
      nlohmann::json cands = nlohmann::json::array();
      if (options.algos) {
        for (int kind = 0; kind < 2; ++kind) {
          if (kind == 1 && !m16) continue;
          auto run = [&] { run_kind(kind); };
          for (int cnd = 0; cnd < cuda::GemmEngine::kMaxLtCandidates; ++cnd) {
            gemm.set_lt_candidate(cnd);
            std::string desc;
            try {  // outside a graph first: a shape with fewer candidates (or a refused one) throws here
              rot = 0;
              run();
              be.synchronize();
              desc = gemm.lt_algo_desc();
            } catch (const std::exception&) {
              continue;
            }
            rot = 0;
            const double ms = timer(run);
            std::printf("    %s candidate %2d: %9.2f us  %s\n", kind == 0 ? "BF16" : "FP8 ", cnd, ms * 1e3,
                        desc.c_str());
            cands.push_back({{"kind", kind == 0 ? "bf16" : "fp8"}, {"candidate", cnd}, {"ms", ms}, {"algo", desc}});
          }
          gemm.set_lt_candidate(-1);
        }
      }
      // --lt-search: every configuration cuBLASLt accepts of its first algorithm for this product
      // (tile, stages, split-K, swizzling, cluster), BF16 and FP8, timed alike; the best against the
      // heuristic's own configuration, and the best one's largest difference from it.
      nlohmann::json search = nlohmann::json::array();
      if (options.lt_search) {
        for (int kind = 0; kind < 2; ++kind) {
          if (kind == 1 && !m16) continue;
          Tensor& out_c = kind == 0 ? c : c8;
          auto run = [&] { run_kind(kind); };
          auto output = [&] {  // copy 0's product
            rot = 0;
            run();
            const Tensor h = be.to_host(out_c);
            std::vector<double> v(static_cast<size_t>(h.numel()));
            for (int64_t i = 0; i < h.numel(); ++i)
              v[static_cast<size_t>(i)] =
                  out_c.dtype() == DType::F32 ? h.data<float>()[i] : bf16_to_float(h.data<uint16_t>()[i]);
            return v;
          };
          gemm.lt_enumerate();
          rot = 0;
          run();
          be.synchronize();
          const std::vector<cuda::GemmEngine::LtConfig> space = gemm.lt_space();
          const std::vector<double> ref = kind == 0 || p.b_block_rows != 1 ? output() : std::vector<double>{};
          std::vector<std::pair<double, size_t>> timed;
          const size_t cap = std::min<size_t>(space.size(), 4000);
          for (size_t i = 0; i < cap; ++i) {
            gemm.set_lt_config(&space[i]);
            try {
              rot = 0;
              run();
              be.synchronize();
              rot = 0;
              timed.emplace_back(p.m <= 256 ? time_graph_ms(s, 2, 10, run) : time_ms(s, 2, 10, run), i);
            } catch (const std::exception&) {
              cudaGetLastError();  // a refused launch leaves no sticky error; clear a plain one
            }
          }
          std::sort(timed.begin(), timed.end());
          double diff = 0.0;
          if (!timed.empty() && !ref.empty()) {
            gemm.set_lt_config(&space[timed[0].second]);
            const std::vector<double> got = output();
            double cmax = 0.0;
            for (size_t i = 0; i < got.size(); ++i) {
              diff = std::max(diff, std::fabs(got[i] - ref[i]));
              cmax = std::max(cmax, std::fabs(ref[i]));
            }
            diff /= std::max(cmax, 1e-30);
          }
          gemm.set_lt_config(nullptr);
          double own_ms = 0.0;
          for (const auto& [ms, i] : timed)
            if (i == 0) own_ms = ms;
          std::printf("    %s lt-search: %zu configurations (%zu timed); heuristic's %.2f us [%s]\n",
                      kind == 0 ? "BF16" : "FP8 ", space.size(), timed.size(), own_ms * 1e3,
                      space.empty() ? "" : space[0].str().c_str());
          nlohmann::json top = nlohmann::json::array();
          for (size_t r = 0; r < std::min<size_t>(5, timed.size()); ++r) {
            const auto& cfg = space[timed[r].second];
            std::printf("      #%zu %.2f us [%s]%s\n", r + 1, timed[r].first * 1e3, cfg.str().c_str(),
                        r == 0 ? (" max |diff| / max |C| vs the heuristic's: " + std::to_string(diff)).c_str() : "");
            top.push_back({{"ms", timed[r].first}, {"config", cfg.str()}});
          }
          search.push_back({{"kind", kind == 0 ? "bf16" : "fp8"},
                            {"configs", space.size()},
                            {"heuristic_ms", own_ms},
                            {"best_max_rel_diff", diff},
                            {"top", top}});
        }
      }
      const double tf_bf16 = flops / ms_bf16 / 1e9, tf_fp8 = ms_fp8 > 0 ? flops / ms_fp8 / 1e9 : 0.0;
      const double tf_own = ms_own > 0 ? flops / ms_own / 1e9 : 0.0;
      std::printf("%-26s %6lld %-6s %10.1f %10.1f %10.1f %10.3f %10.3f %7.2fx %7.2fx %9.1e\n", sh.name.c_str(),
                  static_cast<long long>(M), p.name, tf_bf16, tf_fp8, tf_own, ms_own, ms_own_tile, tf_fp8 / tf_bf16,
                  tf_own / tf_bf16, own_vs_lt);
      out["gemm"].push_back({{"linear", sh.name},
                             {"M_tokens", M},
                             {"pass", p.name},
                             {"m", p.m},
                             {"n", p.n},
                             {"k", p.k},
                             {"weight_copies", copies},
                             {"bf16_ms", ms_bf16},
                             {"bf16_tflops", tf_bf16},
                             {"fp8_ms", ms_fp8},
                             {"fp8_tflops", tf_fp8},
                             {"own_b_scales", p.b_block_rows == 1 ? "per-row" : "128x128"},
                             {"own_ms", ms_own},
                             {"own_tile_ms", ms_own_tile},
                             {"own_tflops", tf_own},
                             {"own_64row_tflops", own64},
                             {"own_vs_cublaslt_max_rel", own_vs_lt},
                             {"own_configs", sweep},
                             {"lt_candidates", cands},
                             {"lt_search", search},
                             {"fast_accum", fast},
                             {"fp8_over_bf16", tf_fp8 / tf_bf16}});
    }
  }
  // ---- grouped expert GEMMs (Qwen3-30B-A3B: 128 experts, 16k tokens x top-8 rows, ragged) ----
  if (!options.quant_only && (options.shapes.empty() || options.grouped_only)) {
    struct GShape {
      const char* name;
      int64_t K, N;
    };
    const GShape gshapes[] = {{"30b-a3b gate/up 2048->1536", 2048, 1536}, {"30b-a3b down 768->2048", 768, 2048}};
    const int E = 128;
    std::vector<int64_t> offsets = {0};
    for (int e = 0; e < E; ++e) offsets.push_back(offsets.back() + 512 + (e * 7919) % 1024);  // 512..1535 rows
    const int64_t R = offsets.back();
    out["grouped"] = nlohmann::json::array();
    std::printf("\n%-28s %7s %10s %12s %12s %10s\n", "grouped (128 experts)", "rows", "own TF/s", "dense own",
                "dense lt", "vs lt");
    for (const GShape& g : gshapes) {
      Tensor a = random_device(be, {R, g.K}, DType::BF16, 70);
      QuantTensor aq = be.alloc_quant(R, g.K, 1, 128, false);
      be.quantize(a, false, aq);
      std::vector<QuantTensor> bq;
      std::vector<const uint8_t*> bp;
      std::vector<const float*> sp;
      std::vector<Tensor> wb;  // the BF16 weights (the BF16 grouped products)
      for (int e = 0; e < E; ++e) {
        wb.push_back(random_device(be, {g.N, g.K}, DType::BF16, 100 + e));
        bq.push_back(be.alloc_quant(g.N, g.K, 128, 128, false));
        be.quantize(wb.back(), false, bq.back());
      }
      for (const QuantTensor& q : bq) bp.push_back(q.data.data<uint8_t>()), sp.push_back(q.scales.data<float>());
      Tensor c = be.alloc({R, g.N}, DType::BF16);
      const double flops = 2.0 * R * g.N * g.K;
      auto grouped = [&] {
        gemm.gemm_fp8_grouped(offsets, g.N, g.K, aq.data.data<uint8_t>(), aq.scales.data<float>(), false, bp, sp,
                              c.raw(), DType::BF16, 1.0f, 0.0f);
      };
      const double ms_g = time_ms(s, warm, reps, grouped);
      const double ms_g64 = time_ms(s, warm, reps, [&] {  // 64-row tiles (the default: 128 at these rows)
        gemm.gemm_fp8_grouped(offsets, g.N, g.K, aq.data.data<uint8_t>(), aq.scales.data<float>(), false, bp, sp,
                              c.raw(), DType::BF16, 1.0f, 0.0f, /*block_m=*/64);
      });
      setenv("FP8RL_FP8_GEMM_GRID", "tile", 1);
      const double ms_g_tile = time_ms(s, warm, reps, grouped);
      unsetenv("FP8RL_FP8_GEMM_GRID");
      // The same FLOPs as one dense product (expert 0's weight for every row).
      const double ms_own = time_ms(s, warm, reps, [&] {
        gemm.gemm_fp8_own(R, g.N, g.K, aq.data.data<uint8_t>(), aq.scales.data<float>(), false, bp[0], sp[0], c.raw(),
                          DType::BF16, 1.0f, 0.0f);
      });
      const double ms_lt = time_ms(s, warm, reps, [&] {
        gemm.set_fp8_kernel("cublaslt");
        gemm.gemm_fp8(R, g.N, g.K, aq.data.data<uint8_t>(), aq.scales.data<float>(), bp[0], sp[0], 128, c.raw(),
                      DType::BF16, 1.0f, 0.0f);
      });
      // BF16 on the same rows and experts: the own kernel's BF16 grouped product (its maps kept, as
      // a model's experts would keep them) and cuBLAS's grouped BF16 GEMM (one problem per expert).
      std::vector<const void*> wp;
      for (const Tensor& w : wb) wp.push_back(w.raw());
      const double ms_own16 = time_ms(s, warm, reps, [&] {
        gemm.gemm_bf16_grouped(offsets, g.N, g.K, a.raw(), wp, c.raw(), DType::BF16, 1.0f, 0.0f, /*block_m=*/0,
                               /*keep_maps=*/true);
      });
      std::vector<cuda::GemmEngine::Problem> problems;
      for (int e = 0; e < E; ++e)
        problems.push_back({offsets[e + 1] - offsets[e], g.N, g.K,
                            static_cast<const uint16_t*>(a.raw()) + offsets[e] * g.K, wp[e],
                            static_cast<uint16_t*>(c.raw()) + offsets[e] * g.N});
      const double ms_blas16 = time_ms(
          s, warm, reps, [&] { gemm.gemm_grouped(false, true, problems, DType::BF16, DType::BF16, 1.0f, 0.0f); });
      const double tg = flops / ms_g / 1e9, to = flops / ms_own / 1e9, tl = flops / ms_lt / 1e9;
      const double to16 = flops / ms_own16 / 1e9, tb16 = flops / ms_blas16 / 1e9;
      std::printf(
          "%-28s %7lld %10.1f %12.1f %12.1f %9.2fx  (one CTA per tile: %.1f TF/s; 64-row tiles: %.1f TF/s, "
          "%.2fx)\n",
          g.name, static_cast<long long>(R), tg, to, tl, tg / tl, flops / ms_g_tile / 1e9, flops / ms_g64 / 1e9,
          flops / ms_g64 / 1e9 / tl);
      std::printf("  %-26s %7lld %10.1f  (BF16 own grouped / cuBLAS grouped BF16: %.2fx)\n", "BF16 own grouped",
                  static_cast<long long>(R), to16, to16 / tb16);
      std::printf("  %-26s %7lld %10.1f\n", "BF16 cuBLAS grouped", static_cast<long long>(R), tb16);
      out["grouped"].push_back({{"linear", g.name},
                                {"rows", R},
                                {"experts", E},
                                {"grouped_ms", ms_g},
                                {"grouped_tflops", tg},
                                {"grouped_tile_tflops", flops / ms_g_tile / 1e9},
                                {"grouped_64row_tflops", flops / ms_g64 / 1e9},
                                {"dense_own_tflops", to},
                                {"dense_cublaslt_tflops", tl},
                                {"bf16_own_grouped_tflops", to16},
                                {"bf16_cublas_grouped_tflops", tb16}});
    }
  }
  be.synchronize();
  return out;
}

}  // namespace fp8rl
