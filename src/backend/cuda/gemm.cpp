#include "backend/cuda/gemm.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/kernels.h"
#include "quant/quant.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace fp8rl::cuda {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::E4M3: return CUDA_R_8F_E4M3;
    default: FP8RL_FAIL("GEMM: unsupported dtype ", dtype_name(t));
  }
}

// RAII holders for the cuBLASLt descriptors of one call.
struct Desc {
  cublasLtMatmulDesc_t d = nullptr;
  ~Desc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};
struct Pref {
  cublasLtMatmulPreference_t p = nullptr;
  ~Pref() { if (p) cublasLtMatmulPreferenceDestroy(p); }
};

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The own FP8 kernel's operands, scales and epilogue (the tiles and splits are the caller's).
Fp8GemmArgs own_fp8_args(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales,
                         bool a_scales_kb_major, const uint8_t* b, const float* b_scales, void* C, DType c_dtype,
                         float alpha, float beta) {
  Fp8GemmArgs g;
  g.M = M, g.N = N, g.K = K;
  g.a = a, g.a_scales = a_scales, g.a_scales_kb_major = a_scales_kb_major;
  g.b = b, g.b_scales = b_scales;
  g.c = C, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta;
  return g;
}

}  // namespace

GemmEngine::GemmEngine(cudaStream_t stream) : stream_(stream) {
  CUBLAS_CHECK(cublasLtCreate(&handle_), "creating the cuBLASLt handle");
  workspace_ = cuda_malloc(kWorkspaceBytes, "the cuBLASLt workspace");
  workspace_bytes_ = kWorkspaceBytes;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev), "cudaGetDevice");
  CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, dev), "reading the SM count");
  if (const char* e = std::getenv("FP8RL_FP8_GEMM")) set_fp8_kernel(e);
  if (const char* e = std::getenv("FP8RL_FP8_WGRAD_GEMM")) set_fp8_wgrad_kernel(e);
  if (const char* e = std::getenv("FP8RL_FP8_ROW_INVARIANT")) {
    FP8RL_CHECK(std::string(e) == "0" || std::string(e) == "1", "FP8RL_FP8_ROW_INVARIANT must be 0 or 1, got '", e,
                "'");
    fp8_row_invariant_ = std::string(e) == "1";
  }
  if (const char* e = std::getenv("FP8RL_LT_TUNE")) {
    const std::string v(e);
    FP8RL_CHECK(v == "0" || v == "fp8" || v == "all", "FP8RL_LT_TUNE must be 0, fp8 (the default) or all, got '", e,
                "'");
    tune_ = v == "0" ? Tune::Off : v == "fp8" ? Tune::Fp8 : Tune::All;
  }
  if (const char* e = std::getenv("FP8RL_FP8_GEMM_SPLITS")) {
    own_splits_ = std::atoi(e);
    FP8RL_CHECK(own_splits_ >= 1 && own_splits_ <= 64, "FP8RL_FP8_GEMM_SPLITS must be 1..64, got '", e, "'");
  }
}

bool GemmEngine::use_own_fp8(int64_t M, int64_t N, int64_t K) const {
  if (own_mode_ == 2) return fp8_gemm_sm90_supported(M, N, K);
  return own_mode_ == 1 &&
         (fp8_gemm_sm90_preferred(M, N, K) || (stream_k_for(M) && fp8_gemm_sm90_supported(M, N, K)));
}

bool GemmEngine::stream_k_for(int64_t M) const {
  // Stream-K's cuts follow M: not for FP8RL_FP8_ROW_INVARIANT's products.
  return M <= 256 && !fp8_row_invariant_ && fp8_gemm_sm90_stream_k();
}

void GemmEngine::set_fp8_kernel(const std::string& v) {
  FP8RL_CHECK(v == "auto" || v == "own" || v == "cublaslt", "FP8RL_FP8_GEMM must be auto, own or cublaslt, got '", v,
              "'");
  own_mode_ = v == "cublaslt" ? 0 : v == "auto" ? 1 : 2;
}

bool GemmEngine::fp8_wgrad_own(int64_t M, int64_t N, int64_t K) const {
  return own_wgrad_ && fp8_gemm_sm90_supported(M, N, K);
}

void GemmEngine::set_fp8_wgrad_kernel(const std::string& v) {
  FP8RL_CHECK(v == "own" || v == "cublaslt", "FP8RL_FP8_WGRAD_GEMM must be own or cublaslt, got '", v, "'");
  own_wgrad_ = v == "own";
}

GemmEngine::~GemmEngine() {
  if (own_ws_) cudaFree(own_ws_);
  if (sk_partials_) cudaFree(sk_partials_);
  if (sk_counters_) cudaFree(sk_counters_);
  if (grouped_meta_) cudaFree(grouped_meta_);
  for (auto& [k, m] : grouped_maps_) cudaFree(m.dev);
  if (grouped_ptrs_) cudaFree(grouped_ptrs_);
  if (blas_) cublasDestroy(blas_);
  if (tail_) cudaFree(tail_);
  if (scales_) cudaFree(scales_);
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

float* GemmEngine::scale_scratch(size_t floats) {
  if (floats > scales_floats_) {
    if (scales_) CUDA_CHECK(cudaFree(scales_), "freeing the GEMM scale scratch");
    scales_floats_ = floats * 2;
    scales_ = static_cast<float*>(cuda_malloc(scales_floats_ * sizeof(float), "the GEMM scale scratch"));
  }
  return scales_;
}

namespace {
// An algorithm's configuration attributes (bench-gemm --algos): cuBLASLt's enum values.
std::string algo_desc(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) -> long long {
    size_t size = 0;  // asked first: the call wants the attribute's exact size
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS ||
        size == 0 || size > 8)
      return -1;
    uint64_t v = 0;  // an integer of `size` bytes, little-endian
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, size, &written) != CUBLAS_STATUS_SUCCESS) return -1;
    return static_cast<long long>(v);
  };
  return "id " + std::to_string(get(CUBLASLT_ALGO_CONFIG_ID)) + " tile " + std::to_string(get(CUBLASLT_ALGO_CONFIG_TILE_ID)) +
         " stages " + std::to_string(get(CUBLASLT_ALGO_CONFIG_STAGES_ID)) + " splitk " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + " reduction " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) + " swizzle " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) + " custom " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)) + " cluster " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}
}  // namespace

std::string GemmEngine::LtConfig::str() const {
  return "tile " + std::to_string(tile) + " stages " + std::to_string(stages) + " splitk " + std::to_string(splitk) +
         " reduction " + std::to_string(reduction) + " swizzle " + std::to_string(swizzle) + " cluster " +
         std::to_string(cluster);
}

namespace {
template <class T>
bool set_config(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, T v) {
  return cublasLtMatmulAlgoConfigSetAttribute(&algo, attr, &v, sizeof(v)) == CUBLAS_STATUS_SUCCESS;
}
template <class T>
T get_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
  return v;
}
std::vector<uint32_t> cap_ids(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0)
    return {0};
  std::vector<uint32_t> v(bytes / sizeof(uint32_t));
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &written) != CUBLAS_STATUS_SUCCESS) return {0};
  v.resize(written / sizeof(uint32_t));
  return v.empty() ? std::vector<uint32_t>{0} : v;
}
template <class T>
T cap_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  T v{};
  size_t written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &v, sizeof(v), &written);
  return v;
}
// An algorithm with a configuration's attributes set, or false when one cannot be set.
bool apply_config(cublasLtMatmulAlgo_t& algo, const GemmEngine::LtConfig& c) {
  return set_config(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, c.tile) &&
         set_config(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, c.stages) &&
         set_config(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, c.splitk) &&
         set_config(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, c.reduction) &&
         set_config(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, c.swizzle) &&
         set_config(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, c.cluster);
}
}  // namespace

cublasLtMatmulAlgo_t GemmEngine::lt_configured(cublasLtMatmulAlgo_t base, cublasLtMatmulDesc_t desc,
                                               cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                               cublasLtMatrixLayout_t c) {
  auto accepted = [&](const cublasLtMatmulAlgo_t& algo) {
    cublasLtMatmulHeuristicResult_t r{};
    return cublasLtMatmulAlgoCheck(handle_, desc, a, b, c, c, &algo, &r) == CUBLAS_STATUS_SUCCESS &&
           r.workspaceSize <= workspace_bytes_;
  };
  if (lt_enumerate_) {
    lt_enumerate_ = false;
    lt_space_.clear();
    LtConfig own;  // the heuristic's configuration, first
    own.tile = get_config<uint32_t>(base, CUBLASLT_ALGO_CONFIG_TILE_ID);
    own.stages = get_config<uint32_t>(base, CUBLASLT_ALGO_CONFIG_STAGES_ID);
    own.splitk = get_config<int32_t>(base, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    own.reduction = get_config<uint32_t>(base, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
    own.swizzle = get_config<uint32_t>(base, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
    own.cluster = get_config<uint16_t>(base, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
    lt_space_.push_back(own);
    const std::vector<uint32_t> tiles = cap_ids(base, CUBLASLT_ALGO_CAP_TILE_IDS);
    const std::vector<uint32_t> stages = cap_ids(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
    const bool splitk = cap_value<int32_t>(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != 0;
    const uint32_t reductions = cap_value<uint32_t>(base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
    const uint32_t swizzles = cap_value<uint32_t>(base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT) ? 2 : 1;
    std::vector<std::pair<int32_t, uint32_t>> splits = {{1, CUBLASLT_REDUCTION_SCHEME_NONE}};
    if (splitk)
      for (int32_t s : {2, 3, 4})
        for (uint32_t r : {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                           CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE})
          if (reductions & r) splits.emplace_back(s, r);
    for (uint32_t t : tiles)
      for (uint32_t st : stages)
        for (const auto& [s, r] : splits)
          for (uint32_t w = 0; w < swizzles; ++w)
            for (uint16_t cl : {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1, CUBLASLT_CLUSTER_SHAPE_1x4x1,
                                CUBLASLT_CLUSTER_SHAPE_2x2x1}) {
              LtConfig x;
              x.tile = t, x.stages = st, x.splitk = s, x.reduction = r, x.swizzle = w, x.cluster = cl;
              cublasLtMatmulAlgo_t algo = base;
              if (apply_config(algo, x) && accepted(algo)) lt_space_.push_back(x);
            }
  }
  if (!lt_force_) return base;
  cublasLtMatmulAlgo_t algo = base;
  FP8RL_CHECK(apply_config(algo, lt_config_) && accepted(algo), "cuBLASLt refuses the configuration ",
              lt_config_.str(), " for this product");
  lt_desc_ = algo_desc(algo);
  return algo;
}

cublasLtMatmulAlgo_t GemmEngine::tuned_algo(const Key& key, const cublasLtMatmulAlgo_t& base, cublasLtMatmulDesc_t desc,
                                            cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                            cublasLtMatrixLayout_t c, int64_t M, int64_t N, DType c_dtype, float beta,
                                            bool fp8,
                                            const std::function<void(const cublasLtMatmulAlgo_t&, void*)>& run) {
  const bool wanted = tune_ == Tune::All || (fp8 && tune_ == Tune::Fp8);
  const bool diagnosing = lt_candidate_ >= 0 || lt_force_ || lt_enumerate_;  // bench-gemm's own choices
  if (!wanted || diagnosing || beta != 0.0f || M > kTuneMaxRows) return base;
  if (auto it = tuned_.find(key); it != tuned_.end()) return it->second;
  if (!tuning_allowed_) return base;           // Backend::set_gemm_tuning(false): the trainer's passes
  if (stream_capturing(stream_)) return base;  // tuned at the next eager call
  const auto t_start = std::chrono::steady_clock::now();
  // The candidates: the heuristic's algorithm in each tile and cluster shape cuBLASLt accepts,
  // everything else (stages, split-K, reduction, swizzling) as the heuristic chose it.
  std::vector<cublasLtMatmulAlgo_t> cands = {base};
  const uint32_t base_tile = get_config<uint32_t>(base, CUBLASLT_ALGO_CONFIG_TILE_ID);
  const uint16_t base_cluster = get_config<uint16_t>(base, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  for (uint32_t t : cap_ids(base, CUBLASLT_ALGO_CAP_TILE_IDS))
    for (uint16_t cl : {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1}) {
      if (t == base_tile && cl == base_cluster) continue;
      cublasLtMatmulAlgo_t x = base;
      cublasLtMatmulHeuristicResult_t r{};
      if (set_config(x, CUBLASLT_ALGO_CONFIG_TILE_ID, t) && set_config(x, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cl) &&
          cublasLtMatmulAlgoCheck(handle_, desc, a, b, c, c, &x, &r) == CUBLAS_STATUS_SUCCESS &&
          r.workspaceSize <= workspace_bytes_)
        cands.push_back(x);
    }
  const size_t bytes = static_cast<size_t>(M * N) * dtype_size(c_dtype), padded = (bytes + 255) / 256 * 256;
  // Two scratch outputs, allocated for the tuning alone (outside the memory plan): a product
  // whose outputs exceed kTuneMaxOutputBytes (the lm_head's logits), or any when the device has
  // no room for them, keeps the heuristic's configuration.
  void* raw = nullptr;
  if (bytes > kTuneMaxOutputBytes || cudaMalloc(&raw, 2 * padded) != cudaSuccess) {
    cudaGetLastError();  // a failed cudaMalloc is not sticky; clear it
    tuned_.emplace(key, base);
    return base;
  }
  char* buf = static_cast<char*>(raw);
  struct Scratch {
    char* p;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    ~Scratch() {  // also on an exception (statuses not checked there)
      cudaFree(p);
      if (e0) cudaEventDestroy(e0);
      if (e1) cudaEventDestroy(e1);
    }
  } scratch{buf};
  CUDA_CHECK(cudaEventCreate(&scratch.e0), "creating a tuning event");
  CUDA_CHECK(cudaEventCreate(&scratch.e1), "creating a tuning event");
  void* ref = buf;
  void* out = buf + padded;
  // Each candidate as a graph of kTuneReps runs (launch gaps excluded), the faster of two replays.
  std::vector<std::pair<float, size_t>> times;
  for (size_t i = 0; i < cands.size(); ++i) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    try {
      run(cands[i], out);  // a configuration the launch refuses throws here, outside the capture
      CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "capturing a tuning graph");
      try {
        for (int r = 0; r < kTuneReps; ++r) run(cands[i], out);
      } catch (...) {
        cudaStreamEndCapture(stream_, &graph);
        throw;
      }
      CUDA_CHECK(cudaStreamEndCapture(stream_, &graph), "capturing a tuning graph");
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0), "instantiating a tuning graph");
      float best = 0.0f;
      for (int rep = 0; rep < 3; ++rep) {  // the first replay warms up
        CUDA_CHECK(cudaEventRecord(scratch.e0, stream_), "timing a tuning graph");
        CUDA_CHECK(cudaGraphLaunch(exec, stream_), "replaying a tuning graph");
        CUDA_CHECK(cudaEventRecord(scratch.e1, stream_), "timing a tuning graph");
        CUDA_CHECK(cudaEventSynchronize(scratch.e1), "timing a tuning graph");
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, scratch.e0, scratch.e1), "timing a tuning graph");
        if (rep == 1 || (rep > 1 && ms < best)) best = ms;
      }
      times.emplace_back(best, i);
    } catch (const Error&) {
      cudaGetLastError();
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
  std::sort(times.begin(), times.end());
  // The fastest of the kTuneChecked fastest whose output is the heuristic's, bit for bit (on this
  // call's operands); the heuristic's own when none is.
  cublasLtMatmulAlgo_t chosen = base;
  size_t chosen_i = 0;
  run(base, ref);
  std::vector<char> h_ref(bytes), h_out(bytes);
  CUDA_CHECK(cudaMemcpyAsync(h_ref.data(), ref, bytes, cudaMemcpyDeviceToHost, stream_), "reading a tuning output");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "reading a tuning output");
  for (size_t k = 0; k < std::min<size_t>(times.size(), kTuneChecked); ++k) {
    const size_t i = times[k].second;
    if (i == 0) break;  // the heuristic's is the fastest left
    run(cands[i], out);
    CUDA_CHECK(cudaMemcpyAsync(h_out.data(), out, bytes, cudaMemcpyDeviceToHost, stream_), "reading a tuning output");
    CUDA_CHECK(cudaStreamSynchronize(stream_), "reading a tuning output");
    if (std::memcmp(h_ref.data(), h_out.data(), bytes) == 0) {
      chosen = cands[i], chosen_i = i;
      break;
    }
  }
  tuned_.emplace(key, chosen);
  ++tuned_count_;
  if (chosen_i != 0) ++tuned_changed_;
  tune_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start).count();
  return chosen;
}

cublasLtMatmulAlgo_t GemmEngine::find_algo(const Key& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                           cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, const char* what) {
  const cublasLtMatmulAlgo_t algo = heuristic_algo(key, desc, a, b, c, what);
  return lt_enumerate_ || lt_force_ ? lt_configured(algo, desc, a, b, c) : algo;
}

cublasLtMatmulAlgo_t GemmEngine::heuristic_algo(const Key& key_in, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                                cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, const char* what) {
  Key key = key_in;
  std::get<8>(key) = lt_candidate_ + 1;  // 0: the heuristic's first (the default); c + 1: set_lt_candidate(c)
  auto it = algos_.find(key);
  if (it != algos_.end()) {
    if (lt_candidate_ >= 0) lt_desc_ = algo_desc(it->second);
    return it->second;
  }
  Pref pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.p), "creating a matmul preference");
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes_, sizeof(workspace_bytes_)),
               "setting the workspace size");
  // A BF16 output accumulated into (beta != 0: the BF16 weight gradients, train.grad_dtype: bf16):
  // split-K partials only in the compute type, FP32 (not summed in the output's BF16: INPLACE,
  // OUTPUT_TYPE), so the product plus the old value is rounded into the gradient once.
  if (std::get<0>(key) == 0 && std::get<2>(key) == static_cast<int>(DType::BF16) && (std::get<3>(key) & 4)) {
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                                      sizeof(mask)),
                 "restricting the split-K reduction to FP32");
  }
  const int want = lt_candidate_ < 0 ? 1 : lt_candidate_ + 1;  // the candidate's rank + 1
  cublasLtMatmulHeuristicResult_t res[kMaxLtCandidates] = {};
  int n = 0;
  const auto t_start = std::chrono::steady_clock::now();
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, desc, a, b, c, c, pref.p, want, res, &n),
               "asking cuBLASLt for a ", what, " algorithm (M=", std::get<5>(key), " N=", std::get<4>(key),
               " K=", std::get<6>(key), ")");
  ++heuristic_count_;
  heuristic_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start).count();
  FP8RL_CHECK(n > 0, "cuBLASLt has no ", what, " kernel for M=", std::get<5>(key), " N=", std::get<4>(key),
              " K=", std::get<6>(key), "; use another precision for this layer");
  FP8RL_CHECK(n >= want, "cuBLASLt offers ", n, " ", what, " candidates for M=", std::get<5>(key), " N=",
              std::get<4>(key), " K=", std::get<6>(key), ", not ", want);
  const cublasLtMatmulAlgo_t algo = res[want - 1].algo;
  if (lt_candidate_ >= 0) lt_desc_ = algo_desc(algo);
  algos_.emplace(key, algo);
  return algo;
}

cublasLtMatmulAlgo_t GemmEngine::find_row_invariant_algo(const Key& key, cublasLtMatmulDesc_t desc,
                                                         cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b_big,
                                                         cublasLtMatrixLayout_t c_big, const char* what) {
  auto it = algos_.find(key);
  if (it != algos_.end()) return it->second;
  Pref pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.p), "creating a matmul preference");
  // No workspace and no reduction scheme: the algorithms left compute each output tile in one
  // pass over K by one CTA (no split-K, no stream-K fix-up), in a partition that depends only on
  // the tile grid, never on how many rows share the launch.
  const uint64_t no_workspace = 0;
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace,
                                                    sizeof(no_workspace)),
               "setting the workspace size");
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_reduction,
                                                    sizeof(no_reduction)),
               "setting the reduction scheme mask");
  constexpr int kAsk = 8;
  cublasLtMatmulHeuristicResult_t res[kAsk] = {};
  int n = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, desc, a, b_big, c_big, c_big, pref.p, kAsk, res, &n),
               "asking cuBLASLt for a row-invariant ", what, " algorithm (N=", std::get<4>(key), " K=",
               std::get<6>(key), ")");
  for (int i = 0; i < n; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize != 0) continue;
    cublasLtMatmulAlgo_t algo = res[i].algo;
    int32_t splits = 1;
    uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits),
                                             &written) == CUBLAS_STATUS_SUCCESS &&
        splits > 1)
      continue;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme),
                                             &written) == CUBLAS_STATUS_SUCCESS &&
        scheme != CUBLASLT_REDUCTION_SCHEME_NONE)
      continue;
    splits = 1;  // explicit: one pass over K whatever the algorithm's default
    CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits)),
                 "fixing the split-K count of a row-invariant ", what);
    algos_.emplace(key, algo);
    return algo;
  }
  FP8RL_FAIL("cuBLASLt has no ", what, " kernel without split-K and workspace for N=", std::get<4>(key), " K=",
             std::get<6>(key), ": a row-invariant product cannot run this layer (turn precision.consistent off, or unset "
             "FP8RL_FP8_ROW_INVARIANT)");
}

void GemmEngine::gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, const void* B, DType ab,
                      void* C, DType c_dtype, float alpha, float beta, bool row_invariant, int64_t ldc,
                      int64_t algo_n) {
  FP8RL_CHECK(ab == DType::F32 || ab == DType::BF16, "GEMM operands must be F32 or BF16, got ", dtype_name(ab));
  FP8RL_CHECK(c_dtype == DType::F32 || c_dtype == DType::BF16, "GEMM output must be F32 or BF16, got ",
              dtype_name(c_dtype));
  FP8RL_CHECK(!(ab == DType::F32 && c_dtype != DType::F32), "an FP32 GEMM writes F32");
  if (M == 0 || N == 0) return;
  // Column-major view: C^T[N, M] = op(B)^T [N, K] * op(A)^T [K, M].
  Desc desc;
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // never TF32
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.d, compute, CUDA_R_32F), "creating a matmul descriptor");
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS A = our B
  const cublasOperation_t opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS B = our A
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), "TRANSA");
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), "TRANSB");
  Layout la, lb, lc;
  // our B: [N, K] row-major (tb) = col-major [K, N] ld K; else [K, N] row-major = col-major [N, K] ld N.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la.l, cuda_type(ab), tb ? K : N, tb ? N : K, tb ? K : N), "layout A");
  // our A: [K, M] row-major (ta) = col-major [M, K] ld M; else [M, K] = col-major [K, M] ld K.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb.l, cuda_type(ab), ta ? M : K, ta ? K : M, ta ? M : K), "layout B");
  FP8RL_CHECK(ldc == 0 || ldc >= N, "GEMM: output row stride ", ldc, " below N = ", N);
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc.l, cuda_type(c_dtype), N, M, ldc > 0 ? ldc : N), "layout C");
  const int flags = (ta ? 2 : 0) | (tb ? 1 : 0) | (beta != 0 ? 4 : 0);
  const char* what = ab == DType::F32 ? "FP32 GEMM" : "BF16 GEMM";
  if (row_invariant) {
    // The key has no M (-1): one algorithm for every M, chosen on a layout of kRowInvariantM rows.
    const int64_t Na = algo_n > 0 ? algo_n : N;  // the algorithm of products Na wide
    const Key key{0, static_cast<int>(ab), static_cast<int>(c_dtype), flags | 8, Na, -1, K, 0, 0};
    const int64_t Mb = kRowInvariantM;
    Layout lab, lbb, lcb;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lab.l, cuda_type(ab), tb ? K : Na, tb ? Na : K, tb ? K : Na),
                 "layout A (row-invariant)");
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lbb.l, cuda_type(ab), ta ? Mb : K, ta ? K : Mb, ta ? Mb : K),
                 "layout B (row-invariant)");
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lcb.l, cuda_type(c_dtype), Na, Mb, Na), "layout C (row-invariant)");
    cublasLtMatmulAlgo_t algo = find_row_invariant_algo(key, desc.d, lab.l, lbb.l, lcb.l, what);
    CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &alpha, B, la.l, A, lb.l, &beta, C, lc.l, C, lc.l, &algo, nullptr, 0,
                                stream_),
                 "row-invariant ", what, " M=", M, " N=", N, " K=", K,
                 " (the consistent mode's fixed cuBLASLt algorithm does not take this M)");
    return;
  }
  const Key key{0, static_cast<int>(ab), static_cast<int>(c_dtype), flags, N, M, K, 0, 0};
  cublasLtMatmulAlgo_t algo;
  if (ldc > 0 && ldc != N) {  // the algorithm of the ld = N layout
    Layout ln;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ln.l, cuda_type(c_dtype), N, M, N), "layout C (ld N)");
    algo = find_algo(key, desc.d, la.l, lb.l, ln.l, what);
  } else {
    algo = find_algo(key, desc.d, la.l, lb.l, lc.l, what);
    algo = tuned_algo(key, algo, desc.d, la.l, lb.l, lc.l, M, N, c_dtype, beta, /*fp8=*/false,
                      [&](const cublasLtMatmulAlgo_t& x, void* out) {
                        CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &alpha, B, la.l, A, lb.l, &beta, out, lc.l, out,
                                                    lc.l, &x, workspace_, workspace_bytes_, stream_),
                                     "tuning ", what, " M=", M, " N=", N, " K=", K);
                      });
  }
  CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &alpha, B, la.l, A, lb.l, &beta, C, lc.l, C, lc.l, &algo, workspace_,
                              workspace_bytes_, stream_),
               what, " M=", M, " N=", N, " K=", K);
}

void GemmEngine::gemm_grouped(bool ta, bool tb, const std::vector<Problem>& problems, DType ab, DType c_dtype,
                              float alpha, float beta) {
  FP8RL_CHECK(ab == DType::BF16, "grouped GEMM operands must be BF16, got ", dtype_name(ab));
  FP8RL_CHECK(grouped_bf16_supported(c_dtype), "grouped GEMM output must be BF16, got ", dtype_name(c_dtype));
  // The column-major view of every problem, as gemm() issues it: C^T[N, M] = op(B)^T op(A)^T.
  std::vector<cublasOperation_t> opa, opb;
  std::vector<int64_t> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alphas, betas;
  std::vector<const void*> ptrs;  // cuBLAS A (our B) pointers, then B (our A), then C
  std::vector<const Problem*> live;
  for (const Problem& p : problems)
    if (p.M > 0 && p.N > 0) live.push_back(&p);
  if (live.empty()) return;
  const size_t G = live.size();
  ptrs.resize(3 * G);
  for (size_t g = 0; g < G; ++g) {
    const Problem& p = *live[g];
    opa.push_back(tb ? CUBLAS_OP_T : CUBLAS_OP_N);
    opb.push_back(ta ? CUBLAS_OP_T : CUBLAS_OP_N);
    m.push_back(p.N), n.push_back(p.M), k.push_back(p.K);
    lda.push_back(tb ? p.K : p.N), ldb.push_back(ta ? p.M : p.K), ldc.push_back(p.N);
    alphas.push_back(alpha), betas.push_back(beta), size.push_back(1);
    ptrs[g] = p.B, ptrs[G + g] = p.A, ptrs[2 * G + g] = p.C;
  }
  if (!blas_) {
    CUBLAS_CHECK(cublasCreate(&blas_), "creating the cuBLAS handle");
    CUBLAS_CHECK(cublasSetWorkspace(blas_, workspace_, workspace_bytes_), "setting the cuBLAS workspace");
  }
  CUBLAS_CHECK(cublasSetStream(blas_, stream_), "setting the cuBLAS stream");
  const size_t bytes = ptrs.size() * sizeof(void*);
  if (bytes > grouped_ptrs_bytes_) {
    if (grouped_ptrs_) CUDA_CHECK(cudaFree(grouped_ptrs_), "freeing the grouped GEMM pointers");
    grouped_ptrs_bytes_ = 2 * bytes;
    grouped_ptrs_ = cuda_malloc(grouped_ptrs_bytes_, "the grouped GEMM pointer arrays");
  }
  if (!uploads_.upload(ptrs.data(), grouped_ptrs_, bytes, stream_))
    CUDA_CHECK(cudaMemcpyAsync(grouped_ptrs_, ptrs.data(), bytes, cudaMemcpyHostToDevice, stream_),
               "uploading the grouped GEMM pointers");
  const void* const* dp = static_cast<const void* const*>(grouped_ptrs_);
  void* const* dc = static_cast<void* const*>(grouped_ptrs_) + 2 * G;
  CUBLAS_CHECK(cublasGemmGroupedBatchedEx_64(blas_, opa.data(), opb.data(), m.data(), n.data(), k.data(), alphas.data(),
                                             dp, cuda_type(ab), lda.data(), dp + G, cuda_type(ab), ldb.data(),
                                             betas.data(), dc, cuda_type(c_dtype), ldc.data(),
                                             static_cast<int64_t>(G), size.data(), CUBLAS_COMPUTE_32F),
               "grouped BF16 GEMM of ", G, " problems");
}

void GemmEngine::gemm_strided_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                                      int64_t stride_a, const void* B, int64_t ldb, int64_t stride_b, DType ab,
                                      void* C, int64_t ldc, int64_t stride_c, DType c_dtype, int64_t batch) {
  FP8RL_CHECK(ab == DType::F32 || ab == DType::BF16, "GEMM operands must be F32 or BF16, got ", dtype_name(ab));
  FP8RL_CHECK(c_dtype == DType::F32 || c_dtype == DType::BF16, "GEMM output must be F32 or BF16, got ",
              dtype_name(c_dtype));
  if (M == 0 || N == 0 || batch == 0) return;
  if (!blas_) {
    CUBLAS_CHECK(cublasCreate(&blas_), "creating the cuBLAS handle");
    CUBLAS_CHECK(cublasSetWorkspace(blas_, workspace_, workspace_bytes_), "setting the cuBLAS workspace");
  }
  CUBLAS_CHECK(cublasSetStream(blas_, stream_), "setting the cuBLAS stream");
  const float alpha = 1.0f, beta = 0.0f;
  // The column-major view, as gemm() issues it: C^T [N, M] = op(B)^T op(A)^T.
  CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                                             M, K, &alpha, B, cuda_type(ab), ldb, stride_b, A, cuda_type(ab), lda,
                                             stride_a, &beta, C, cuda_type(c_dtype), ldc, stride_c, batch,
                                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "strided batched GEMM of ", batch, " products ", M, "x", N, "x", K);
}

bool GemmEngine::fp8_supported(int64_t M, int64_t N, int64_t K) {
  return M > 0 && N > 0 && K > 0 && N % kFp8RowGranule == 0 && K % kQuantBlock == 0;
}

int64_t GemmEngine::scale_buffer_floats(int64_t rows, int64_t K, int block_rows) {
  const int64_t kb = ceil_div(K, kQuantBlock);
  if (block_rows == 1) return kb * rows;
  return ceil_div(rows, kQuantBlock) * round_up(kb, 4);
}

void GemmEngine::layout_scales(const float* src, int64_t rows, int64_t K, int block_rows, float* dst) {
  const int64_t kb = ceil_div(K, kQuantBlock);
  if (block_rows == 1) {
    launch_scales_vec128(src, rows, kb, rows, dst, stream_);
  } else {
    launch_scales_blk(src, ceil_div(rows, kQuantBlock), kb, round_up(kb, 4), dst, stream_);
  }
}

void* GemmEngine::tail_scratch(size_t bytes) {
  if (bytes > tail_bytes_) {
    if (tail_) CUDA_CHECK(cudaFree(tail_), "freeing the GEMM tail scratch");
    tail_bytes_ = bytes * 2;
    tail_ = cuda_malloc(tail_bytes_, "the FP8 GEMM tail scratch");
  }
  return tail_;
}

// cuBLASLt's block-scaled kernels take A's rows (tokens) in multiples of 16. Any M is served
// either as two products over the same B: rows [0, M16) in place, and the last M - M16 < 16 rows
// padded to 16 with zero rows (zero data, scales 1) in a scratch tile whose result rows are
// copied out; or, where copying A in and C out moves fewer bytes than reading B again (decode
// M), as one product of A padded to a multiple of 16 rows in scratch. Each is the same quantized
// product row for row (each output row depends only on its own A row), so the split changes no
// value's definition.
void GemmEngine::gemm_fp8(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales,
                          const uint8_t* b, const float* b_scales, int b_block_rows, void* C, DType c_dtype,
                          float alpha, float beta, bool a_scales_laid, bool row_invariant, bool b_scales_laid) {
  FP8RL_CHECK(b_block_rows == 1 || b_block_rows == kQuantBlock, "FP8 GEMM: B blocks must be 1x128 or 128x128");
  FP8RL_CHECK(!b_scales_laid || b_block_rows == 1, "FP8 GEMM: B scales in the VEC128 layout are for 1x128 blocks");
  // FP8RL_FP8_WGRAD_GEMM=own: 1x128-block B (the FP8 wgrad) on the own kernel's per-row B scales,
  // any M (no tail product); B's scales laid out [kb][N] here unless the caller's are.
  if (b_block_rows == 1 && !row_invariant && fp8_wgrad_own(M, N, K)) {
    const float* b_rows = b_scales;
    if (!b_scales_laid) {
      const int64_t kbs = ceil_div(K, kQuantBlock);
      float* laid = scale_scratch(static_cast<size_t>(kbs * N));
      launch_scales_vec128(b_scales, N, kbs, N, laid, stream_);
      b_rows = laid;
    }
    gemm_fp8_own_b_rows(M, N, K, a, a_scales, a_scales_laid, b, b_rows, C, c_dtype, alpha, beta, own_splits_);
    return;
  }
  FP8RL_CHECK(!a_scales_laid || M % kFp8RowGranule == 0, "FP8 GEMM: A scales in VEC128 layout need M % 16 == 0, got ",
              "M=", M);
  FP8RL_CHECK(fp8_supported(M, N, K), "FP8 block GEMM: cuBLASLt needs N a multiple of ", kFp8RowGranule,
              " and K a multiple of ", kQuantBlock, ", got M=", M, " N=", N, " K=", K,
              " (the backend pads K or falls back to a dequantized GEMM)");
  // row_invariant asks for cuBLASLt's fixed algorithm: never FP8RL_FP8_GEMM's own-kernel routing
  // (its split count follows the shape).
  if (!row_invariant && use_own_fp8(M, N, K) && b_block_rows == kQuantBlock && fp8_gemm_sm90_supported(M, N, K)) {
    gemm_fp8_own(M, N, K, a, a_scales, a_scales_laid, b, b_scales, C, c_dtype, alpha, beta, own_splits_);
    return;
  }
  const int64_t kb = K / kQuantBlock;
  const int64_t m16 = M / kFp8RowGranule * kFp8RowGranule, tail = M - m16;
  // B's scales as cuBLASLt takes them: 128x128 blocks where K's blocks are a multiple of 4, or
  // 1x128 blocks already in the VEC128 layout (b_scales_laid).
  const bool b_as_is = (b_block_rows == kQuantBlock && kb % 4 == 0) || b_scales_laid;
  // A tail of a few rows costs a second read of B. Where copying A in and C out moves fewer bytes
  // than B (decode-sized M: under ~470 rows for the 1.7B-class q|k|v product), the whole product
  // runs instead as one of M16 = M rounded up to 16 rows in scratch (zero padding rows), and its M
  // rows are copied out.
  const bool pad_whole =
      tail > 0 && static_cast<double>(M) * (K + 2.0 * N * dtype_size(c_dtype)) < static_cast<double>(N) * K;
  // Rows [r0, M) are staged padded to mp rows (a multiple of 16) in scratch: the tail, or all of A.
  const int64_t r0 = pad_whole ? 0 : m16, staged = M - r0, mp = round_up(staged, kFp8RowGranule);
  const int64_t na = a_scales_laid || pad_whole ? 0 : kb * m16, nt = kb * mp;
  const int64_t nb = b_as_is ? 0 : scale_buffer_floats(N, K, b_block_rows);
  float* scratch = scale_scratch(static_cast<size_t>(na + nt + nb));
  const float* b_lt = b_scales;
  if (!b_as_is) {
    layout_scales(b_scales, N, K, b_block_rows, scratch + na + nt);
    b_lt = scratch + na + nt;
  }
  if (r0 > 0) {
    if (!a_scales_laid) layout_scales(a_scales, m16, K, 1, scratch);
    gemm_fp8_prelaid(m16, N, K, a, a_scales_laid ? a_scales : scratch, b, b_lt, b_block_rows, C, c_dtype, alpha,
                     beta, row_invariant);
  }
  if (staged == 0) return;
  ++tail_products_;
  const size_t esz = dtype_size(c_dtype);
  const size_t a_bytes = static_cast<size_t>(mp * K), c_bytes = static_cast<size_t>(mp * N) * esz;
  uint8_t* ta = static_cast<uint8_t*>(tail_scratch(a_bytes + c_bytes));
  uint8_t* tc = ta + a_bytes;  // a_bytes is a multiple of 128 (K is)
  uint8_t* c_rows = static_cast<uint8_t*>(C) + static_cast<size_t>(r0 * N) * esz;
  CUDA_CHECK(cudaMemcpyAsync(ta, a + r0 * K, static_cast<size_t>(staged * K), cudaMemcpyDeviceToDevice, stream_),
             "staging the padded FP8 GEMM rows");
  CUDA_CHECK(cudaMemsetAsync(ta + staged * K, 0, static_cast<size_t>((mp - staged) * K), stream_),
             "zeroing the FP8 GEMM's padding rows");
  float* ts = scratch + na;  // [kb][mp]: the staged rows' scales; the layout kernel gives padding rows 1 (zero data)
  launch_scales_vec128(a_scales + r0 * kb, staged, kb, mp, ts, stream_);
  if (beta != 0.0f)
    CUDA_CHECK(cudaMemcpyAsync(tc, c_rows, static_cast<size_t>(staged * N) * esz, cudaMemcpyDeviceToDevice, stream_),
               "staging the padded FP8 GEMM's output rows");
  gemm_fp8_prelaid(mp, N, K, ta, ts, b, b_lt, b_block_rows, tc, c_dtype, alpha, beta, row_invariant);
  CUDA_CHECK(cudaMemcpyAsync(c_rows, tc, static_cast<size_t>(staged * N) * esz, cudaMemcpyDeviceToDevice, stream_),
             "copying the padded FP8 GEMM's rows out");
}

bool GemmEngine::fp8_lt_is_own(int64_t N, int64_t K, DType c_dtype) {
  constexpr int64_t M = 300;  // 18 row granules of 16 and a padded tail of 12 rows
  if (!fp8_supported(M, N, K) || !fp8_gemm_sm90_supported(M, N, K)) return false;
  const auto key = std::make_tuple(N, K, static_cast<int>(c_dtype));
  if (auto it = fp8_lt_own_.find(key); it != fp8_lt_own_.end()) return it->second;
  if (stream_capturing(stream_)) return false;
  const int64_t kb = K / kQuantBlock, nb = (N + kQuantBlock - 1) / kQuantBlock;
  std::vector<uint8_t> ha(static_cast<size_t>(M * K)), hb(static_cast<size_t>(N * K));
  std::vector<float> hsa(static_cast<size_t>(M * kb)), hsb(static_cast<size_t>(nb * kb));
  uint32_t x = 0x9e3779b9u;
  auto next = [&x] { return x = x * 1664525u + 1013904223u; };
  for (auto* v : {&ha, &hb})
    for (uint8_t& c : *v) {
      c = static_cast<uint8_t>(next() >> 24);
      if ((c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
    }
  for (auto* v : {&hsa, &hsb})
    for (float& s : *v) s = 0.001f * (1.0f + static_cast<float>(next() >> 8) / 16777216.0f);
  const size_t esz = dtype_size(c_dtype), cbytes = static_cast<size_t>(M * N) * esz;
  const size_t bytes = ha.size() + hb.size() + 4 * (hsa.size() + hsb.size()) + 2 * cbytes + 64;
  char* buf = static_cast<char*>(cuda_malloc(bytes, "the FP8 GEMM agreement probe"));
  struct Free {
    char* p;
    ~Free() { cudaFree(p); }  // also on an exception (its status not checked there)
  } free_buf{buf};
  uint8_t* da = reinterpret_cast<uint8_t*>(buf);
  uint8_t* db = da + ha.size();
  float* dsa = reinterpret_cast<float*>(buf + ((ha.size() + hb.size() + 15) / 16) * 16);
  float* dsb = dsa + hsa.size();
  char* c1 = reinterpret_cast<char*>(dsb + hsb.size());
  c1 += (16 - reinterpret_cast<uintptr_t>(c1) % 16) % 16;
  char* c2 = c1 + cbytes;
  bool same = false;
  const int64_t own0 = own_products_, tail0 = tail_products_;  // the probe's products are not the caller's
  try {
    CUDA_CHECK(cudaMemcpyAsync(da, ha.data(), ha.size(), cudaMemcpyHostToDevice, stream_), "probe upload");
    CUDA_CHECK(cudaMemcpyAsync(db, hb.data(), hb.size(), cudaMemcpyHostToDevice, stream_), "probe upload");
    CUDA_CHECK(cudaMemcpyAsync(dsa, hsa.data(), 4 * hsa.size(), cudaMemcpyHostToDevice, stream_), "probe upload");
    CUDA_CHECK(cudaMemcpyAsync(dsb, hsb.data(), 4 * hsb.size(), cudaMemcpyHostToDevice, stream_), "probe upload");
    gemm_fp8_own(M, N, K, da, dsa, false, db, dsb, c1, c_dtype, 1.0f, 0.0f, /*splits=*/1);
    gemm_fp8(M, N, K, da, dsa, db, dsb, kQuantBlock, c2, c_dtype, 1.0f, 0.0f, false, /*row_invariant=*/true);
    std::vector<char> h1(cbytes), h2(cbytes);
    CUDA_CHECK(cudaMemcpyAsync(h1.data(), c1, cbytes, cudaMemcpyDeviceToHost, stream_), "probe download");
    CUDA_CHECK(cudaMemcpyAsync(h2.data(), c2, cbytes, cudaMemcpyDeviceToHost, stream_), "probe download");
    CUDA_CHECK(cudaStreamSynchronize(stream_), "the FP8 GEMM agreement probe");
    same = std::memcmp(h1.data(), h2.data(), cbytes) == 0;
  } catch (const Error&) {  // an algorithm cuBLASLt will not run here: not the same
    same = false;
  }
  own_products_ = own0, tail_products_ = tail0;
  CUDA_CHECK(cudaStreamSynchronize(stream_), "the FP8 GEMM agreement probe");
  fp8_lt_own_[key] = same;
  return same;
}

float* GemmEngine::own_workspace(int64_t M, int64_t N, int splits) {
  const size_t ws = static_cast<size_t>(fp8_gemm_sm90_workspace_floats(M, N, splits));
  if (ws > own_ws_floats_) {
    if (own_ws_) CUDA_CHECK(cudaFree(own_ws_), "freeing the FP8 GEMM split-K workspace");
    own_ws_floats_ = ws * 2;
    own_ws_ = static_cast<float*>(cuda_malloc(own_ws_floats_ * sizeof(float), "the FP8 GEMM split-K workspace"));
  }
  return own_ws_;
}

void GemmEngine::stream_k_buffers(int64_t M, int64_t N, float** partials, int** counters) {
  const int64_t tiles = fp8_gemm_sm90_stream_k_tiles(M, N);
  FP8RL_CHECK((sk_partials_ && tiles <= sk_counters_n_) || !stream_capturing(stream_),
              "FP8 GEMM: stream-K's buffers are made by an eager call, not inside a CUDA graph capture (run the ",
              "step once before recording it)");
  if (!sk_partials_)
    sk_partials_ = static_cast<float*>(cuda_malloc(static_cast<size_t>(fp8_gemm_sm90_stream_k_floats()) * sizeof(float),
                                                   "the FP8 GEMM's stream-K partial tiles"));
  if (tiles > sk_counters_n_) {
    // A kernel in flight may still count on the old counters: free them in stream order.
    CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting before growing the stream-K counters");
    if (sk_counters_) CUDA_CHECK(cudaFree(sk_counters_), "freeing the stream-K counters");
    sk_counters_n_ = std::max<int64_t>(tiles, 4096);
    sk_counters_ = static_cast<int*>(cuda_malloc(static_cast<size_t>(sk_counters_n_) * sizeof(int),
                                                 "the FP8 GEMM's stream-K tile counters"));
    CUDA_CHECK(cudaMemsetAsync(sk_counters_, 0, static_cast<size_t>(sk_counters_n_) * sizeof(int), stream_),
               "zeroing the stream-K counters");  // in stream order: before the first kernel that counts
  }
  *partials = sk_partials_, *counters = sk_counters_;
}

void GemmEngine::gemm_fp8_own(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales,
                              bool a_scales_kb_major, const uint8_t* b, const float* b_scales, void* C, DType c_dtype,
                              float alpha, float beta, int splits, int block_m, int block_n) {
  Fp8GemmArgs g = own_fp8_args(M, N, K, a, a_scales, a_scales_kb_major, b, b_scales, C, c_dtype, alpha, beta);
  if (splits <= 0 && own_splits_ <= 0 && block_m <= 0 && stream_k_for(M)) {
    g.stream_k = true;
    stream_k_buffers(M, N, &g.sk_partials, &g.sk_counters);
  } else {
    const Fp8GemmConfig cfg = fp8_gemm_sm90_config(M, N, K, sm_count_);
    g.block_m = block_m > 0 ? block_m : cfg.block_m;
    g.block_n = block_n;
    g.splits = splits > 0 ? splits : own_splits_ > 0 ? own_splits_ : cfg.splits;
    g.workspace = own_workspace(M, N, g.splits);
  }
  fp8_gemm_sm90(g, stream_);
  ++own_products_;
}

void GemmEngine::gemm_fp8_own_b_rows(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_scales,
                                     bool a_scales_kb_major, const uint8_t* b, const float* b_scales, void* C,
                                     DType c_dtype, float alpha, float beta, int splits) {
  Fp8GemmArgs g = own_fp8_args(M, N, K, a, a_scales, a_scales_kb_major, b, b_scales, C, c_dtype, alpha, beta);
  g.b_scales_rows = true;
  const Fp8GemmConfig cfg = fp8_gemm_sm90_b_rows_config(M, N, K, sm_count_);
  g.block_m = cfg.block_m;
  g.splits = splits > 0 ? splits : cfg.splits;
  g.workspace = own_workspace(M, N, g.splits);
  fp8_gemm_sm90(g, stream_);
  ++own_products_;
}

void GemmEngine::gemm_bf16_own(int64_t M, int64_t N, int64_t K, const void* a, const void* b, void* C, DType c_dtype,
                               float alpha, float beta, int splits, int block_m) {
  const Fp8GemmConfig cfg = fp8_gemm_sm90_config(M, N, K, sm_count_, DType::BF16);
  Fp8GemmArgs g;
  g.ab = DType::BF16;
  g.block_m = block_m > 0 ? block_m : cfg.block_m;
  g.M = M, g.N = N, g.K = K;
  g.a = static_cast<const uint8_t*>(a), g.b = static_cast<const uint8_t*>(b);
  g.c = C, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta;
  g.splits = splits > 0 ? splits : own_splits_ > 0 ? own_splits_ : cfg.splits;
  g.workspace = own_workspace(M, N, g.splits);
  fp8_gemm_sm90(g, stream_);
}

void* GemmEngine::grouped_scratch(size_t bytes) {
  if (bytes > grouped_meta_bytes_) {
    // The previous table may still be read by a kernel in flight: free in stream order.
    if (grouped_meta_) {
      CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting before growing the grouped GEMM table");
      CUDA_CHECK(cudaFree(grouped_meta_), "freeing the grouped GEMM table");
    }
    grouped_meta_bytes_ = bytes * 2;
    grouped_meta_ = cuda_malloc(grouped_meta_bytes_, "the grouped FP8 GEMM's tile table");
  }
  return grouped_meta_;
}

const void* GemmEngine::kept_grouped_maps(const std::vector<const uint8_t*>& b,
                                          const std::vector<const float*>& b_scales, int64_t N, int64_t K, DType ab,
                                          bool pin) {
  std::vector<uintptr_t> key{static_cast<uintptr_t>(N), static_cast<uintptr_t>(K), static_cast<uintptr_t>(ab)};
  for (const uint8_t* p : b) key.push_back(reinterpret_cast<uintptr_t>(p));
  for (const float* p : b_scales) key.push_back(reinterpret_cast<uintptr_t>(p));
  auto it = grouped_maps_.find(key);
  if (it == grouped_maps_.end()) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing), "querying the stream's capture");
    FP8RL_CHECK(capturing == cudaStreamCaptureStatusNone, "grouped GEMM: the ", b.size(), " groups' tensor maps for ",
                "these weights are not on the device yet, and uploading them cannot be captured in a CUDA graph: run ",
                "the product once before the capture");
    const auto unpinned = std::count_if(grouped_maps_.begin(), grouped_maps_.end(),
                                        [](const auto& e) { return !e.second.pinned; });
    if (grouped_maps_.size() >= kept_maps_limit_ && unpinned > 0) {
      // Only the host form's sets go: a device-form set may be held by a recorded CUDA graph
      // (an MoE decode step's), which would read freed (and reused) memory at its next replay.
      CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting before dropping the grouped GEMM maps");
      std::erase_if(grouped_maps_, [](auto& e) {
        if (e.second.pinned) return false;
        cudaFree(e.second.dev);
        return true;
      });
    }
    const std::vector<unsigned char> host = fp8_gemm_sm90_grouped_maps(b, b_scales, N, K, ab);
    void* d = cuda_malloc(host.size(), "the grouped FP8 GEMM's tensor maps");
    CUDA_CHECK(cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice), "uploading the grouped GEMM maps");
    it = grouped_maps_.emplace(std::move(key), KeptMaps{d, false}).first;
  }
  it->second.pinned = it->second.pinned || pin;
  return it->second.dev;
}

void GemmEngine::gemm_fp8_grouped(const std::vector<int64_t>& offsets, int64_t N, int64_t K, const uint8_t* a,
                                  const float* a_scales, bool a_scales_kb_major, const std::vector<const uint8_t*>& b,
                                  const std::vector<const float*>& b_scales, void* C, DType c_dtype, float alpha,
                                  float beta, int block_m, bool keep_maps) {
  Fp8GroupedArgs g;
  g.N = N, g.K = K, g.offsets = offsets;
  g.a = a, g.a_scales = a_scales, g.a_scales_kb_major = a_scales_kb_major;
  g.b = b, g.b_scales = b_scales;
  g.c = C, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta, g.block_m = block_m;
  g.device_meta = grouped_scratch(
      fp8_gemm_sm90_grouped_meta_bytes(static_cast<int>(b.size()), offsets.empty() ? 0 : offsets.back(), block_m));
  g.device_meta_bytes = grouped_meta_bytes_;
  g.uploads = &uploads_;
  if (keep_maps && !b.empty()) g.maps = kept_grouped_maps(b, b_scales, N, K, DType::E4M3, /*pin=*/false);
  fp8_gemm_sm90_grouped(g, stream_);
  ++own_products_;
}

void GemmEngine::gemm_bf16_grouped(const std::vector<int64_t>& offsets, int64_t N, int64_t K, const void* a,
                                   const std::vector<const void*>& b, void* C, DType c_dtype, float alpha, float beta,
                                   int block_m, bool keep_maps) {
  Fp8GroupedArgs g;
  g.ab = DType::BF16;
  g.N = N, g.K = K, g.offsets = offsets;
  g.a = static_cast<const uint8_t*>(a);
  for (const void* p : b) g.b.push_back(static_cast<const uint8_t*>(p));
  g.c = C, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta, g.block_m = block_m;
  g.device_meta = grouped_scratch(
      fp8_gemm_sm90_grouped_meta_bytes(static_cast<int>(b.size()), offsets.empty() ? 0 : offsets.back(), block_m));
  g.device_meta_bytes = grouped_meta_bytes_;
  g.uploads = &uploads_;
  if (keep_maps && !b.empty()) g.maps = kept_grouped_maps(g.b, {}, N, K, DType::BF16, /*pin=*/false);
  fp8_gemm_sm90_grouped(g, stream_);
}

void GemmEngine::gemm_bf16_kgrouped(int64_t M, int64_t N, int64_t K, const void* a, const void* b,
                                    const std::vector<int64_t>& k_offsets, const std::vector<void*>& c,
                                    DType c_dtype, float alpha, float beta, int block_m) {
  Fp8KGroupedArgs g;
  g.M = M, g.N = N, g.K = K, g.a = a, g.b = b, g.block_m = block_m;
  g.k_offsets = k_offsets, g.c = c, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta;
  g.device_meta = grouped_scratch(fp8_gemm_sm90_kgrouped_meta_bytes(static_cast<int>(c.size())));
  g.device_meta_bytes = grouped_meta_bytes_;
  g.uploads = &uploads_;
  fp8_gemm_sm90_kgrouped(g, stream_);
}

void GemmEngine::gemm_fp8_grouped_device(const int4* tiles, const int* tile_count, int64_t max_tiles, int64_t R,
                                         int block_m, int64_t N, int64_t K, const uint8_t* a, const float* a_scales,
                                         bool a_scales_kb_major, const std::vector<const uint8_t*>& b,
                                         const std::vector<const float*>& b_scales, void* C, DType c_dtype,
                                         float alpha, float beta) {
  FP8RL_CHECK(!b.empty(), "grouped FP8 GEMM: no groups");
  Fp8GroupedArgs g;
  g.N = N, g.K = K;
  g.a = a, g.a_scales = a_scales, g.a_scales_kb_major = a_scales_kb_major;
  g.c = C, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta, g.block_m = block_m;
  g.device_tiles = tiles, g.device_tile_count = tile_count, g.max_tiles = max_tiles;
  g.rows = R, g.groups = static_cast<int>(b.size());
  g.maps = kept_grouped_maps(b, b_scales, N, K, DType::E4M3, /*pin=*/true);
  fp8_gemm_sm90_grouped(g, stream_);
  ++own_products_;
}

void GemmEngine::gemm_bf16_grouped_device(const int4* tiles, const int* tile_count, int64_t max_tiles, int64_t R,
                                          int block_m, int64_t N, int64_t K, const void* a,
                                          const std::vector<const void*>& b, void* C, DType c_dtype, float alpha,
                                          float beta) {
  FP8RL_CHECK(!b.empty(), "grouped BF16 GEMM: no groups");
  Fp8GroupedArgs g;
  g.ab = DType::BF16;
  g.N = N, g.K = K;
  g.a = static_cast<const uint8_t*>(a);
  g.c = C, g.c_dtype = c_dtype, g.alpha = alpha, g.beta = beta, g.block_m = block_m;
  g.device_tiles = tiles, g.device_tile_count = tile_count, g.max_tiles = max_tiles;
  g.rows = R, g.groups = static_cast<int>(b.size());
  std::vector<const uint8_t*> bp;
  for (const void* p : b) bp.push_back(static_cast<const uint8_t*>(p));
  g.maps = kept_grouped_maps(bp, {}, N, K, DType::BF16, /*pin=*/true);
  fp8_gemm_sm90_grouped(g, stream_);
}

void GemmEngine::gemm_fp8_prelaid(int64_t M, int64_t N, int64_t K, const uint8_t* a, const float* a_lt_scales,
                                  const uint8_t* b, const float* b_lt_scales, int b_block_rows, void* C,
                                  DType c_dtype, float alpha, float beta, bool row_invariant) {
  FP8RL_CHECK(M % kFp8RowGranule == 0 && fp8_supported(M, N, K), "FP8 block GEMM (pre-laid scales): cuBLASLt ",
              "needs M and N multiples of ", kFp8RowGranule, " and K a multiple of ", kQuantBlock, ", got M=", M,
              " N=", N, " K=", K);
  FP8RL_CHECK(c_dtype == DType::F32 || c_dtype == DType::BF16, "FP8 GEMM output must be F32 or BF16");
  Desc desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "creating an FP8 matmul descriptor");
  const cublasOperation_t opt = CUBLAS_OP_T, opn = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &opt, sizeof(opt)), "TRANSA");
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &opn, sizeof(opn)), "TRANSB");
  // cuBLAS A = our B (weights or dY^T), cuBLAS B = our A (activations).
  const int32_t mode_a = b_block_rows == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                           : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)),
               "setting the A scale mode");
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)),
               "setting the B scale mode");
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_lt_scales,
                                              sizeof(b_lt_scales)), "setting the A scale pointer");
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_lt_scales,
                                              sizeof(a_lt_scales)), "setting the B scale pointer");
  if (fp8_fast_accum_) {
    const int8_t fast = 1;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                 "setting FP8 fast accumulation");
  }
  const int accum_flag = fp8_fast_accum_ ? 16 : 0;  // the algorithm caches keep both modes apart
  Layout la, lb, lc;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la.l, CUDA_R_8F_E4M3, K, N, K), "FP8 layout A");
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb.l, CUDA_R_8F_E4M3, K, M, K), "FP8 layout B");
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc.l, cuda_type(c_dtype), N, M, N), "FP8 layout C");
  if (fp8_row_invariant_ || row_invariant) {  // one algorithm for every M (set_fp8_row_invariant), no workspace
    const Key key{1, b_block_rows, static_cast<int>(c_dtype), (beta != 0 ? 4 : 0) | 8 | accum_flag, N, -1, K, 0, 0};
    Layout lbb, lcb;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lbb.l, CUDA_R_8F_E4M3, K, kRowInvariantM, K),
                 "FP8 layout B (row-invariant)");
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lcb.l, cuda_type(c_dtype), N, kRowInvariantM, N),
                 "FP8 layout C (row-invariant)");
    cublasLtMatmulAlgo_t algo = find_row_invariant_algo(key, desc.d, la.l, lbb.l, lcb.l, "FP8 block-scaled GEMM");
    CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &alpha, b, la.l, a, lb.l, &beta, C, lc.l, C, lc.l, &algo, nullptr, 0,
                                stream_),
                 "row-invariant FP8 block-scaled GEMM M=", M, " N=", N, " K=", K,
                 " (the algorithm fixed for every M does not take this M; unset FP8RL_FP8_ROW_INVARIANT)");
    return;
  }
  const Key key{1, b_block_rows, static_cast<int>(c_dtype), (beta != 0 ? 4 : 0) | accum_flag, N, M, K, 0, 0};
  cublasLtMatmulAlgo_t algo = find_algo(key, desc.d, la.l, lb.l, lc.l, "FP8 block-scaled GEMM");
  algo = tuned_algo(key, algo, desc.d, la.l, lb.l, lc.l, M, N, c_dtype, beta, /*fp8=*/true,
                    [&](const cublasLtMatmulAlgo_t& x, void* out) {
                      CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &alpha, b, la.l, a, lb.l, &beta, out, lc.l, out,
                                                  lc.l, &x, workspace_, workspace_bytes_, stream_),
                                   "tuning the FP8 block-scaled GEMM M=", M, " N=", N, " K=", K);
                    });
  CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &alpha, b, la.l, a, lb.l, &beta, C, lc.l, C, lc.l, &algo, workspace_,
                              workspace_bytes_, stream_),
               "FP8 block-scaled GEMM M=", M, " N=", N, " K=", K);
}

}  // namespace fp8rl::cuda
