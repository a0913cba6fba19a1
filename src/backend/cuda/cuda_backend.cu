// The CUDA backend (see cuda_backend.h): memory, validation, and the op implementations that
// sequence kernels (kernels.h) and GEMMs (gemm.h) on the backend's one stream.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace fp8rl {

namespace cuda {

namespace {

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16; }

void check_float(const Tensor& t, const char* what) {
  FP8RL_CHECK(is_float(t.dtype()), what, " must be F32 or BF16 on the CUDA backend, got ", t.str());
}

void check_same_numel(const Tensor& a, const Tensor& b, const char* what) {
  FP8RL_CHECK(a.numel() == b.numel(), what, ": element counts differ (", a.str(), " vs ", b.str(), ")");
}

// [.., K] -> rows of K.
int64_t rows_of(const Tensor& t) { return t.ndim() == 0 ? 1 : t.numel() / std::max<int64_t>(t.dim(-1), 1); }

// A defined W.wq as the FP8 ops take it (backend.h, LinearWeight): on the GPU, E4M3 [N, K] in
// 128x128 blocks, w's shape when w is defined, quantized with the spec's pow2 setting.
void check_wq(const LinearWeight& W, const LinearSpec& spec) {
  const QuantTensor& q = W.wq;
  FP8RL_CHECK(q.data.device() == DeviceKind::CUDA && q.scales.device() == DeviceKind::CUDA,
              "linear W.wq must be on the GPU, got ", q.data.str());
  FP8RL_CHECK(q.block_rows == kQuantBlock && q.block_cols == kQuantBlock, "linear W.wq must have 128x128 blocks, got ",
              q.block_rows, "x", q.block_cols);
  check_dtype(q.data, DType::E4M3, "linear W.wq data");
  FP8RL_CHECK(q.data.ndim() == 2, "linear W.wq must be [N, K], got ", q.data.str());
  check_shape(q.scales, {ceil_div(q.rows(), kQuantBlock), ceil_div(q.cols(), kQuantBlock)}, "linear W.wq scales");
  check_dtype(q.scales, DType::F32, "linear W.wq scales");
  if (W.w.defined())
    FP8RL_CHECK(W.w.ndim() == 2 && q.rows() == W.w.dim(0) && q.cols() == W.w.dim(1), "linear W.wq ", q.data.str(),
                " does not match w ", W.w.str());
  FP8RL_CHECK(q.pow2 == spec.pow2_scales, "linear W.wq was quantized with pow2=", q.pow2, " but the spec asks pow2=",
              spec.pow2_scales, " (requantize the weight with the recipe's scales)");
}


// A BF16 weight gradient (train.grad_dtype: bf16; backend.h) is accumulated through an F32 copy:
// widened exactly, the op's F32 path adds its contribution, rounded back once.
bool is_bf16_grad(const Tensor* g) { return g && g->defined() && g->dtype() == DType::BF16; }

Tensor grad_widen(Backend& be, const Tensor* g) {
  if (!is_bf16_grad(g)) return Tensor();
  Tensor w = be.alloc(g->shape(), DType::F32);
  be.convert(*g, w);
  return w;
}

void grad_narrow(Backend& be, const Tensor& w, Tensor* g) {
  if (w.defined()) be.convert(w, *g);
}

}  // namespace

CudaBackend::CudaBackend(int device_index, DType act_dtype) : device_(device_index), act_dtype_(act_dtype) {
  FP8RL_CHECK(act_dtype == DType::F32 || act_dtype == DType::BF16, "the CUDA backend's activations are F32 or ",
              "BF16, got ", dtype_name(act_dtype));
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    FP8RL_FAIL("no usable CUDA GPU (", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e),
               "); check nvidia-smi and the driver, or use --device cpu");
  }
  FP8RL_CHECK(device_index >= 0 && device_index < count, "cuda:", device_index, " does not exist (", count,
              " GPU(s) visible); use cuda:0..cuda:", count - 1);
  CUDA_CHECK(cudaSetDevice(device_index), "selecting GPU ", device_index);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device_index), "reading the GPU's properties");
  name_ = "cuda:" + std::to_string(device_index) + " (" + prop.name + ", sm_" + std::to_string(prop.major) +
          std::to_string(prop.minor) + ")";
  sm_count_ = prop.multiProcessorCount;
  mem_ = DeviceMemory::create(device_index);
  stream_ = mem_->stream();
  gemm_ = std::make_unique<GemmEngine>(stream_);
  flag_dev_ = static_cast<int*>(cuda_malloc(kFlagSlots * sizeof(int), "the device error flags"));
  flag_cur_ = flag_dev_;
  CUDA_CHECK(cudaMemset(flag_dev_, 0, kFlagSlots * sizeof(int)), "zeroing the device error flags");
  CUDA_CHECK(cudaMallocHost(&flag_host_, kFlagSlots * sizeof(int)), "allocating the pinned error flags");
  const char* prof_env = std::getenv("FP8RL_CUDA_PROFILE");
  profile_ = prof_env && std::string(prof_env) == "1";
  const char* sync_env = std::getenv("FP8RL_CUDA_SYNC_CHECKS");
  sync_checks_ = sync_env && std::string(sync_env) == "1";
  slots_.resize(kSlotCount);
}

CudaBackend::~CudaBackend() {
  try {
    profile_report("", true);
  } catch (...) {
  }
  if (stream_) cudaStreamSynchronize(stream_);
  slots_.clear();
  gemm_.reset();
  if (flag_dev_) cudaFree(flag_dev_);
  if (flag_host_) cudaFreeHost(flag_host_);
  // The stream and the pool live on while a tensor of this backend does (device_memory.h).
  mem_.reset();
}

std::string CudaBackend::name() const { return name_; }

void CudaBackend::check_dev(const Tensor& t, const char* what) const {
  FP8RL_CHECK(t.defined(), what, " is undefined");
  FP8RL_CHECK(t.device() == DeviceKind::CUDA, what, " must be on the GPU, got ", t.str(),
              " (copy it with to_device first)");
}

// ---- memory ------------------------------------------------------------------------------------

Tensor CudaBackend::alloc(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto st = mem_->allocate(bytes, [&] { return std::string("a tensor ") + dtype_name(dtype) + shape_str(shape); });
  return Tensor(std::move(st), 0, shape, dtype);
}

MemoryStats CudaBackend::memory_stats() { return mem_->stats(); }
void CudaBackend::reset_peak_memory_stats() { mem_->reset_peak(); }
int64_t CudaBackend::free_device_bytes() {
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const MemoryStats st = mem_->stats();
  return static_cast<int64_t>(free_b) + std::max<int64_t>(0, st.reserved_bytes - st.used_bytes);
}

Tensor CudaBackend::scratch(Slot slot, const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto& st = slots_[slot];
  if (!st || st->bytes < bytes) {
    FP8RL_CHECK(!recording_, "a scratch buffer must grow while recording a CUDA graph: run the ops once "
                "unrecorded first");
    const size_t want = std::max<size_t>(bytes + bytes / 4, 256);
    st.reset();  // the old buffer goes back to the pool first (stream-ordered)
    st = mem_->allocate(want, [&] { return "a scratch buffer (slot " + std::to_string(slot) + ")"; });
  }
  return Tensor(st, 0, shape, dtype);
}

QuantTensor CudaBackend::scratch_quant(Slot data_slot, Slot scale_slot, int64_t rows, int64_t cols, int block_rows,
                                       bool pow2) {
  QuantTensor q;
  q.block_rows = block_rows;
  q.block_cols = kQuantBlock;
  q.pow2 = pow2;
  q.data = scratch(data_slot, {rows, cols}, DType::E4M3);
  q.scales = scratch(scale_slot, {ceil_div(rows, block_rows), ceil_div(cols, kQuantBlock)}, DType::F32);
  return q;
}

void CudaBackend::copy(const Tensor& src, Tensor& dst) {
  const OpTimer op_timer_(*this, "copy");
  FP8RL_CHECK(src.defined() && dst.defined(), "copy: undefined tensor");
  FP8RL_CHECK(src.dtype() == dst.dtype(), "copy: dtypes differ (", src.str(), " -> ", dst.str(),
              "); use convert for dtype changes");
  check_same_numel(src, dst, "copy");
  const size_t n = src.nbytes();
  if (n == 0) return;
  const bool sd = src.device() == DeviceKind::CUDA, dd = dst.device() == DeviceKind::CUDA;
  const cudaMemcpyKind kind = sd ? (dd ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                 : (dd ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  if (kind == cudaMemcpyHostToHost) {
    std::memcpy(dst.raw(), src.raw(), n);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), n, kind, stream_), "copying ", src.str(), " to ", dst.str());
  // Host memory is pageable: wait so the host side may be read or freed on return.
  if (kind != cudaMemcpyDeviceToDevice) {
    CUDA_CHECK(cudaStreamSynchronize(stream_), "copying ", src.str());
    flag_drain();  // errors of earlier ops surface here at the latest
  }
}

void CudaBackend::convert(const Tensor& src, Tensor& dst) {
  const OpTimer op_timer_(*this, "convert");
  check_dev(src, "convert source");
  check_dev(dst, "convert destination");
  check_same_numel(src, dst, "convert");
  if (src.dtype() == dst.dtype()) {
    copy(src, dst);
    return;
  }
  launch_convert(src.raw(), src.dtype(), dst.raw(), dst.dtype(), src.numel(), stream_);
}

void CudaBackend::fill(Tensor& t, float value) {
  const OpTimer op_timer_(*this, "fill");
  check_dev(t, "fill target");
  launch_fill(t.raw(), t.dtype(), t.numel(), value, stream_);
}

void CudaBackend::synchronize() {
  CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting for the GPU");
  flag_drain();
}

int* CudaBackend::flag_reset() {
  if (recording_) return flag_cur_ = flag_dev_ + kFlagSticky;  // a replay's errors accumulate there
  if (pending_.size() + 1 >= static_cast<size_t>(kFlagSticky)) flag_drain();
  flag_cur_ = flag_dev_ + pending_.size();
  CUDA_CHECK(cudaMemsetAsync(flag_cur_, 0, sizeof(int), stream_), "resetting a device error flag");
  return flag_cur_;
}

void CudaBackend::flag_check(const std::string& message) {
  if (recording_) {
    if (recorded_message_.empty()) recorded_message_ = message;
    return;
  }
  pending_.push_back(message);  // the slot flag_reset() opened
  if (sync_checks_) flag_drain();
}

void CudaBackend::flag_drain() {
  FP8RL_CHECK(!recording_, "a synchronizing call while recording a CUDA graph: record only asynchronous ops");
  if (pending_.empty() && sticky_message_.empty()) return;
  CUDA_CHECK(cudaMemcpyAsync(flag_host_, flag_dev_, kFlagSlots * sizeof(int), cudaMemcpyDeviceToHost, stream_),
             "reading the device error flags");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting for the GPU to check its error flags");
  std::vector<std::string> messages;
  messages.swap(pending_);
  std::string sticky;
  sticky.swap(sticky_message_);
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!flag_host_[i]) continue;
    // Non-finite data (quantizer/linear inputs, logits) is a NonFiniteError: a training step
    // that meets one skips its update (train/trainer.h).
    if (messages[i].find("NaN") != std::string::npos || messages[i].find("non-finite") != std::string::npos)
      FP8RL_FAIL_NONFINITE(messages[i]);
    FP8RL_FAIL(messages[i]);
  }
  if (flag_host_[kFlagSticky]) {
    CUDA_CHECK(cudaMemsetAsync(flag_dev_ + kFlagSticky, 0, sizeof(int), stream_), "resetting the sticky flag");
    FP8RL_FAIL(sticky);
  }
}

// ---- op timing (FP8RL_CUDA_PROFILE=1) -----------------------------------------------------------

CudaBackend::OpTimer::OpTimer(CudaBackend& be, const char* op) : be_(be.profile_ && !be.recording_ ? &be : nullptr) {
  if (!be_) return;
  if (be_->depth_++ > 0) {  // an op inside an op: counted in the outer one
    be_ = nullptr;
    be.depth_--;
    return;
  }
  Record r;
  r.op = op;
  cudaEventCreate(&r.start);
  cudaEventCreate(&r.stop);
  cudaEventRecord(r.start, be_->stream_);
  be_->records_.push_back(r);
}

CudaBackend::OpTimer::~OpTimer() {
  if (!be_) return;
  be_->depth_--;
  cudaEventRecord(be_->records_.back().stop, be_->stream_);
  if (be_->records_.size() >= 100000) be_->profile_flush();
}

void CudaBackend::profile_flush() {
  cudaStreamSynchronize(stream_);
  for (auto& r : records_) {
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, r.start, r.stop);
    auto& t = profile_totals_[r.op];
    t.first += 1;
    t.second += ms;
    cudaEventDestroy(r.start);
    cudaEventDestroy(r.stop);
  }
  records_.clear();
}

void CudaBackend::profile_report(const std::string& title, bool print) {
  if (!profile_) return;
  profile_flush();
  if (!print) {
    profile_totals_.clear();
    return;
  }
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> rows(profile_totals_.begin(), profile_totals_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  double total = 0.0;
  for (const auto& r : rows) total += r.second.second;
  std::fprintf(stderr, "cuda op profile%s%s (stream time between each op's start and end events; a CUDA-graph "
                       "replay counts as one op, graph_replay): total %.1f ms\n",
               title.empty() ? "" : ": ", title.c_str(), total);
  for (const auto& r : rows)
    std::fprintf(stderr, "  %-24s %9lld calls %10.2f ms %5.1f%%  %8.1f us/call\n", r.first.c_str(),
                 static_cast<long long>(r.second.first), r.second.second, 100.0 * r.second.second / total,
                 1000.0 * r.second.second / r.second.first);
  profile_totals_.clear();
}

// ---- graphs ------------------------------------------------------------------------------------

class CudaGraph final : public OpGraph {
 public:
  CudaGraph(CudaBackend& be, cudaGraphExec_t exec, std::string message)
      : be_(be), exec_(exec), message_(std::move(message)), keep_(be.slots_) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  void replay() override {
    const CudaBackend::OpTimer op_timer_(be_, "graph_replay");
    CUDA_CHECK(cudaGraphLaunch(exec_, be_.stream_), "replaying a CUDA graph");
    if (!message_.empty() && be_.sticky_message_.empty())
      be_.sticky_message_ = "in a CUDA-graph replay: " + message_;
  }

 private:
  CudaBackend& be_;
  cudaGraphExec_t exec_;
  std::string message_;
  std::vector<std::shared_ptr<Storage>> keep_;  // scratch buffers baked into the graph stay alive
};

std::unique_ptr<OpGraph> CudaBackend::record(const std::function<void()>& ops) {
  static const bool off = [] {
    const char* e = std::getenv("FP8RL_CUDA_GRAPHS");
    return e && std::string(e) == "0";
  }();
  if (off || !stream_ordered_alloc()) return nullptr;
  flag_drain();  // nothing of before belongs to the graph
  recorded_message_.clear();
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "starting a CUDA graph capture");
  recording_ = true;
  cudaGraph_t graph = nullptr;
  try {
    ops();
  } catch (...) {
    recording_ = false;
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  recording_ = false;
  CUDA_CHECK(cudaStreamEndCapture(stream_, &graph), "ending a CUDA graph capture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  CUDA_CHECK(e, "instantiating a CUDA graph");
  return std::make_unique<CudaGraph>(*this, exec, recorded_message_);
}

// ---- element-wise ----------------------------------------------------------------------------

void CudaBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  const OpTimer op_timer_(*this, "add");
  check_dev(a, "add a");
  check_dev(b, "add b");
  check_dev(out, "add out");
  check_same_numel(a, b, "add");
  check_same_numel(a, out, "add");
  launch_add(a.raw(), a.dtype(), b.raw(), b.dtype(), out.raw(), out.dtype(), a.numel(), stream_);
}

void CudaBackend::scale(Tensor& x, float s) {
  const OpTimer op_timer_(*this, "scale");
  check_dev(x, "scale x");
  launch_scale(x.raw(), x.dtype(), x.numel(), s, stream_);
}

double CudaBackend::sum_squares(const Tensor& x) {
  const OpTimer op_timer_(*this, "sum_squares");
  check_dev(x, "sum_squares x");
  Tensor acc = scratch(kSlotState, {1}, DType::F64);
  CUDA_CHECK(cudaMemsetAsync(acc.raw(), 0, sizeof(double), stream_), "zeroing the sum");
  launch_sum_squares(x.raw(), x.dtype(), x.numel(), acc.data<double>(), stream_);
  double h = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&h, acc.raw(), sizeof(double), cudaMemcpyDeviceToHost, stream_), "reading the sum");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "sum_squares");
  flag_drain();
  return h;
}

bool CudaBackend::all_finite(const Tensor& x) {
  const OpTimer op_timer_(*this, "all_finite");
  check_dev(x, "all_finite x");
  flag_drain();  // earlier ops' errors first: this op reads its flag itself
  int* f = flag_reset();
  launch_flag_nonfinite(x.raw(), x.dtype(), x.numel(), f, stream_);
  CUDA_CHECK(cudaMemcpyAsync(flag_host_, f, sizeof(int), cudaMemcpyDeviceToHost, stream_), "reading the flag");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "all_finite");
  return *flag_host_ == 0;
}

float CudaBackend::amax(const Tensor& x) {
  const OpTimer op_timer_(*this, "amax");
  check_dev(x, "amax x");
  check_float(x, "amax x");
  // Non-negative floats order like their bit patterns: an atomicMax on the bits of |x|; a NaN
  // (bits above +inf's) wins and comes back as NaN, as the interface asks.
  Tensor acc = scratch(kSlotState, {1}, DType::I32);
  CUDA_CHECK(cudaMemsetAsync(acc.raw(), 0, sizeof(int32_t), stream_), "zeroing the amax");
  launch_amax(x.raw(), x.dtype(), x.numel(), reinterpret_cast<uint32_t*>(acc.raw()), stream_);
  uint32_t bits = 0;
  CUDA_CHECK(cudaMemcpyAsync(&bits, acc.raw(), sizeof(bits), cudaMemcpyDeviceToHost, stream_), "reading the amax");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "amax");
  flag_drain();
  float m;
  std::memcpy(&m, &bits, sizeof m);
  return m;
}

// ---- model ops ---------------------------------------------------------------------------------

void CudaBackend::embedding(const Tensor& ids, const Tensor& table, Tensor& out) {
  const OpTimer op_timer_(*this, "embedding");
  check_dev(ids, "embedding ids");
  check_dev(table, "embedding table");
  check_dev(out, "embedding out");
  check_dtype(ids, DType::I32, "embedding ids");
  FP8RL_CHECK(table.ndim() == 2, "embedding table must be [V, D], got ", table.str());
  const int64_t T = ids.numel(), V = table.dim(0), D = table.dim(1);
  check_shape(out, {T, D}, "embedding out");
  launch_embedding(ids.data<int32_t>(), T, table.raw(), table.dtype(), V, D, out.raw(), out.dtype(), flag_reset(),
                   stream_);
  flag_check("embedding: a token id is out of range [0, " + std::to_string(V) +
             "); check the tokenizer against the model's vocab_size");
}

void CudaBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  if (is_bf16_grad(&dtable)) {
    Tensor d32 = grad_widen(*this, &dtable);
    embedding_backward(ids, dout, d32);
    grad_narrow(*this, d32, &dtable);
    return;
  }
  const OpTimer op_timer_(*this, "embedding_backward");
  check_dev(ids, "embedding ids");
  check_dev(dout, "embedding dout");
  check_dev(dtable, "embedding dtable");
  check_dtype(ids, DType::I32, "embedding ids");
  check_dtype(dtable, DType::F32, "embedding dtable");
  const int64_t T = ids.numel(), V = dtable.dim(0), D = dtable.dim(1);
  check_shape(dout, {T, D}, "embedding dout");
  launch_embedding_backward(ids.data<int32_t>(), T, dout.raw(), dout.dtype(), V, D, dtable.data<float>(),
                            flag_reset(), stream_);
  flag_check("embedding_backward: a token id is out of range [0, " + std::to_string(V) + ")");
}

void CudaBackend::rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) {
  const OpTimer op_timer_(*this, "rmsnorm");
  check_dev(x, "rmsnorm x");
  check_dev(w, "rmsnorm w");
  check_dev(out, "rmsnorm out");
  const int64_t D = x.dim(-1), R = rows_of(x);
  check_shape(w, {D}, "rmsnorm w");
  FP8RL_CHECK(out.shape() == x.shape(), "rmsnorm out must have x's shape ", shape_str(x.shape()), ", got ", out.str());
  float* rs = nullptr;
  if (rstd && rstd->defined()) {
    check_dev(*rstd, "rmsnorm rstd");
    check_dtype(*rstd, DType::F32, "rmsnorm rstd");
    FP8RL_CHECK(rstd->numel() == R, "rmsnorm rstd must have ", R, " elements, got ", rstd->str());
    rs = rstd->data<float>();
  }
  launch_rmsnorm(x.raw(), x.dtype(), w.raw(), w.dtype(), R, D, eps, out.raw(), out.dtype(), rs, stream_);
}

void CudaBackend::rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                   Tensor& dx, Tensor& dw) {
  if (is_bf16_grad(&dw)) {
    Tensor dw32 = grad_widen(*this, &dw);
    rmsnorm_backward(dout, x, w, rstd, dx, dw32);
    grad_narrow(*this, dw32, &dw);
    return;
  }
  const OpTimer op_timer_(*this, "rmsnorm_backward");
  check_dev(dout, "rmsnorm dout");
  check_dev(x, "rmsnorm x");
  check_dev(w, "rmsnorm w");
  check_dev(rstd, "rmsnorm rstd");
  check_dev(dx, "rmsnorm dx");
  check_dev(dw, "rmsnorm dw");
  const int64_t D = x.dim(-1), R = rows_of(x);
  FP8RL_CHECK(dout.shape() == x.shape() && dx.shape() == x.shape(), "rmsnorm_backward: dout/dx must have x's shape");
  check_dtype(rstd, DType::F32, "rmsnorm rstd");
  check_dtype(dw, DType::F32, "rmsnorm dw");
  check_shape(dw, {D}, "rmsnorm dw");
  launch_rmsnorm_backward(dout.raw(), dout.dtype(), x.raw(), x.dtype(), w.raw(), w.dtype(), rstd.data<float>(), R, D,
                          dx.raw(), dx.dtype(), dw.data<float>(), stream_);
}

// One strided 2-D copy on the stream (rows of `cols` elements at pitches Cs and Cd).
void CudaBackend::copy_cols(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const OpTimer op_timer_(*this, "copy_cols");
  check_dev(src, "copy_cols source");
  check_dev(dst, "copy_cols destination");
  FP8RL_CHECK(src.dtype() == dst.dtype() && src.ndim() >= 1 && dst.ndim() >= 1, "copy_cols needs two tensors of one "
              "dtype: ", src.str(), " -> ", dst.str());
  const int64_t cs = src.dim(src.ndim() - 1), cd = dst.dim(dst.ndim() - 1);
  FP8RL_CHECK(cs > 0 && cd > 0 && src.numel() / cs == dst.numel() / cd, "copy_cols: ", src.str(), " and ", dst.str(),
              " do not have the same number of rows");
  FP8RL_CHECK(cols >= 0 && src_col >= 0 && dst_col >= 0 && src_col + cols <= cs && dst_col + cols <= cd,
              "copy_cols: columns [", src_col, ", ", src_col + cols, ") of ", src.str(), " -> [", dst_col, ", ",
              dst_col + cols, ") of ", dst.str(), " out of range");
  const int64_t R = src.numel() / cs;
  const size_t es = dtype_size(src.dtype());
  if (R == 0 || cols == 0) return;
  CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(dst.raw()) + dst_col * es, cd * es,
                               static_cast<const uint8_t*>(src.raw()) + src_col * es, cs * es, cols * es, R,
                               cudaMemcpyDeviceToDevice, stream_),
             "copying columns of ", src.str(), " to ", dst.str());
}

void CudaBackend::rope(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse) {
  const OpTimer op_timer_(*this, "rope");
  check_dev(x, "rope x");
  check_dev(positions, "rope positions");
  check_dtype(positions, DType::I32, "rope positions");
  FP8RL_CHECK(x.ndim() == 3, "rope x must be [T, H, head_dim], got ", x.str());
  const int64_t T = x.dim(0), H = x.dim(1), hd = x.dim(2);
  FP8RL_CHECK(hd % 2 == 0 && static_cast<int64_t>(rope.inv_freq.size()) == hd / 2, "rope: inv_freq must have ",
              "head_dim / 2 = ", hd / 2, " entries, got ", rope.inv_freq.size());
  FP8RL_CHECK(hd / 2 <= kMaxRopeHalf, "rope: head_dim up to ", 2 * kMaxRopeHalf, " supported, got ", hd);
  check_shape(positions, {T}, "rope positions");
  RopeTable tab{};
  std::copy(rope.inv_freq.begin(), rope.inv_freq.end(), tab.inv_freq);
  launch_rope(x.raw(), x.dtype(), T, H, hd, positions.data<int32_t>(), tab, rope.attention_scaling, inverse,
              rope.interleaved, stream_);
}

void CudaBackend::swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  const OpTimer op_timer_(*this, "swiglu");
  check_dev(gate, "swiglu gate");
  check_dev(up, "swiglu up");
  check_dev(out, "swiglu out");
  FP8RL_CHECK(gate.shape() == up.shape() && out.shape() == gate.shape(), "swiglu: gate, up and out must have one shape");
  FP8RL_CHECK(gate.dtype() == up.dtype() && out.dtype() == gate.dtype(), "swiglu: one dtype for gate, up, out");
  launch_swiglu(gate.raw(), up.raw(), out.raw(), gate.dtype(), gate.numel(), stream_);
}

void CudaBackend::swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                  Tensor& dup) {
  const OpTimer op_timer_(*this, "swiglu_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &gate, &up, &dgate, &dup}) {
    check_dev(*t, "swiglu_backward tensor");
    FP8RL_CHECK(t->shape() == gate.shape() && t->dtype() == gate.dtype(),
                "swiglu_backward: all tensors must be ", gate.str(), ", got ", t->str());
  }
  launch_swiglu_backward(dout.raw(), gate.raw(), up.raw(), dgate.raw(), dup.raw(), gate.dtype(), gate.numel(), stream_);
}

// ---- fused producers of FP8 linear inputs ------------------------------------------------------

bool CudaBackend::fp8_view_gemm_layout(int64_t R, int64_t C) const {
  return act_dtype_ == DType::BF16 && R % kFp8RowGranule == 0 && C % kQuantBlock == 0;
}

// The view a fused producer fills for out [R, D]: checked, its scale layout chosen, bound to out.
void CudaBackend::fp8_view_prepare(Fp8View& fp8, const Tensor& out, const char* what) {
  const int64_t D = out.dim(-1), R = rows_of(out);
  FP8RL_CHECK(fp8.defined() && fp8.q.block_rows == 1 && fp8.q.block_cols == kQuantBlock && fp8.q.rows() == R &&
                  fp8.q.cols() == D,
              what, ": the FP8 view must be alloc_fp8_view(", R, ", ", D, ", pow2), got ",
              fp8.defined() ? fp8.q.data.str() : std::string("an undefined view"));
  check_dev(fp8.q.data, "FP8 view data");
  check_dev(fp8.q.scales, "FP8 view scales");
  check_dtype(fp8.q.data, DType::E4M3, "FP8 view data");
  check_dtype(fp8.q.scales, DType::F32, "FP8 view scales");
  FP8RL_CHECK(fp8.q.scales.numel() == R * ceil_div(D, kQuantBlock), what, ": the FP8 view's scales ",
              fp8.q.scales.str(), " do not hold ", R, " x ", ceil_div(D, kQuantBlock), " values");
  fp8.scales_gemm_layout = fp8_view_gemm_layout(R, D);
  fp8.source = out.raw();
}

// rmsnorm's checks; returns rstd's pointer (null when not asked).
float* CudaBackend::rmsnorm_check(const Tensor& x, const Tensor& w, Tensor& out, Tensor* rstd) {
  check_dev(x, "rmsnorm x");
  check_dev(w, "rmsnorm w");
  check_dev(out, "rmsnorm out");
  const int64_t D = x.dim(-1), R = rows_of(x);
  check_shape(w, {D}, "rmsnorm w");
  FP8RL_CHECK(out.shape() == x.shape(), "rmsnorm out must have x's shape ", shape_str(x.shape()), ", got ", out.str());
  FP8RL_CHECK(out.dtype() == x.dtype(), "rmsnorm: x and out must have the same dtype");
  if (!rstd || !rstd->defined()) return nullptr;
  check_dev(*rstd, "rmsnorm rstd");
  check_dtype(*rstd, DType::F32, "rmsnorm rstd");
  FP8RL_CHECK(rstd->numel() == R, "rmsnorm rstd must have ", R, " elements, got ", rstd->str());
  return rstd->data<float>();
}

void CudaBackend::rmsnorm_fp8(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd, Fp8View& fp8) {
  const OpTimer op_timer_(*this, "rmsnorm_fp8");
  float* rs = rmsnorm_check(x, w, out, rstd);
  fp8_view_prepare(fp8, out, "rmsnorm_fp8");
  const int64_t D = x.dim(-1), R = rows_of(x);
  int* bad = flag_reset();
  if (!launch_rmsnorm_fused(x.raw(), nullptr, nullptr, x.dtype(), w.raw(), w.dtype(), R, D, eps, out.raw(), rs,
                            fp8.q.pow2, fp8.q.data.data<uint8_t>(), fp8.q.scales.data<float>(), fp8.scales_gemm_layout,
                            bad, stream_)) {
    launch_rmsnorm(x.raw(), x.dtype(), w.raw(), w.dtype(), R, D, eps, out.raw(), out.dtype(), rs, stream_);
    quantize_async(out.reshape({R, D}), false, fp8.q, false, fp8.scales_gemm_layout);
  }
  flag_check("rmsnorm_fp8: the output " + out.str() + " holds NaN or Inf (FP8 quantization refuses non-finite values)");
}

void CudaBackend::add_rmsnorm(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& out,
                              Tensor* rstd, Fp8View* fp8) {
  const OpTimer op_timer_(*this, "add_rmsnorm");
  check_dev(a, "add a");
  check_dev(b, "add b");
  check_dev(sum, "add out");
  FP8RL_CHECK(a.shape() == sum.shape() && b.shape() == sum.shape() && a.dtype() == sum.dtype() &&
                  b.dtype() == sum.dtype(),
              "add_rmsnorm: a, b and sum must have one shape and dtype, got ", a.str(), ", ", b.str(), ", ", sum.str());
  float* rs = rmsnorm_check(sum, w, out, rstd);
  FP8RL_CHECK(out.raw() != sum.raw(), "add_rmsnorm: out must not alias sum");
  if (fp8) fp8_view_prepare(*fp8, out, "add_rmsnorm");
  const int64_t D = sum.dim(-1), R = rows_of(sum);
  int* bad = fp8 ? flag_reset() : nullptr;
  uint8_t* q = fp8 ? fp8->q.data.data<uint8_t>() : nullptr;
  float* qs = fp8 ? fp8->q.scales.data<float>() : nullptr;
  const bool laid = fp8 && fp8->scales_gemm_layout;
  if (!launch_rmsnorm_fused(a.raw(), b.raw(), sum.raw(), sum.dtype(), w.raw(), w.dtype(), R, D, eps, out.raw(), rs,
                            fp8 && fp8->q.pow2, q, qs, laid, bad, stream_)) {
    launch_add(a.raw(), a.dtype(), b.raw(), b.dtype(), sum.raw(), sum.dtype(), sum.numel(), stream_);
    launch_rmsnorm(sum.raw(), sum.dtype(), w.raw(), w.dtype(), R, D, eps, out.raw(), out.dtype(), rs, stream_);
    if (fp8) quantize_async(out.reshape({R, D}), false, fp8->q, false, laid);
  }
  if (fp8)
    flag_check("add_rmsnorm: the output " + out.str() + " holds NaN or Inf (FP8 quantization refuses non-finite "
               "values)");
}

void CudaBackend::swiglu_fp8(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8) {
  const OpTimer op_timer_(*this, "swiglu_fp8");
  check_dev(gate, "swiglu gate");
  check_dev(up, "swiglu up");
  check_dev(out, "swiglu out");
  FP8RL_CHECK(gate.shape() == up.shape() && out.shape() == gate.shape(), "swiglu: gate, up and out must have one shape");
  FP8RL_CHECK(gate.dtype() == up.dtype() && out.dtype() == gate.dtype(), "swiglu: one dtype for gate, up, out");
  FP8RL_CHECK(out.ndim() >= 1, "swiglu_fp8: out must have a last dimension, got ", out.str());
  fp8_view_prepare(fp8, out, "swiglu_fp8");
  const int64_t F = out.dim(-1), R = rows_of(out);
  int* bad = flag_reset();
  if (!launch_swiglu_fp8(gate.raw(), up.raw(), out.raw(), out.dtype(), R, F, fp8.q.pow2, fp8.q.data.data<uint8_t>(),
                         fp8.q.scales.data<float>(), fp8.scales_gemm_layout, bad, stream_)) {
    launch_swiglu(gate.raw(), up.raw(), out.raw(), gate.dtype(), gate.numel(), stream_);
    quantize_async(out.reshape({R, F}), false, fp8.q, false, fp8.scales_gemm_layout);
  }
  flag_check("swiglu_fp8: the output " + out.str() + " holds NaN or Inf (FP8 quantization refuses non-finite values)");
}

// ---- mixture of experts --------------------------------------------------------------------------

void CudaBackend::moe_route_softmax(const Tensor& logits, int top_k, bool renormalize, Tensor& experts,
                                    Tensor& weights) {
  const OpTimer op_timer_(*this, "moe_route_softmax");
  check_dev(logits, "moe_route_softmax logits");
  check_dev(experts, "moe_route_softmax experts");
  check_dev(weights, "moe_route_softmax weights");
  check_dtype(logits, DType::F32, "moe_route_softmax logits");
  FP8RL_CHECK(logits.ndim() == 2 && top_k >= 1 && top_k <= logits.dim(1), "moe_route_softmax: logits [T, E] and "
              "1 <= top_k <= E expected, got ", logits.str(), ", top_k ", top_k);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_shape(experts, {T, top_k}, "moe_route_softmax experts");
  check_dtype(experts, DType::I32, "moe_route_softmax experts");
  check_shape(weights, {T, top_k}, "moe_route_softmax weights");
  check_dtype(weights, DType::F32, "moe_route_softmax weights");
  launch_moe_route_softmax(logits.data<float>(), T, static_cast<int>(E), top_k, renormalize, experts.data<int32_t>(),
                           weights.data<float>(), stream_);
}

void CudaBackend::moe_route_softmax_backward(const Tensor& logits, const Tensor& experts, bool renormalize,
                                             const Tensor& dweights, Tensor& dlogits) {
  const OpTimer op_timer_(*this, "moe_route_softmax_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &experts, &dweights, &dlogits})
    check_dev(*t, "moe_route_softmax_backward tensor");
  check_dtype(logits, DType::F32, "moe_route_softmax_backward logits");
  FP8RL_CHECK(logits.ndim() == 2 && experts.ndim() == 2 && experts.dim(0) == logits.dim(0),
              "moe_route_softmax_backward: logits [T, E] and experts [T, k] expected, got ", logits.str(), ", ",
              experts.str());
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  check_dtype(experts, DType::I32, "moe_route_softmax_backward experts");
  check_shape(dweights, {T, k}, "moe_route_softmax_backward dweights");
  check_dtype(dweights, DType::F32, "moe_route_softmax_backward dweights");
  check_shape(dlogits, {T, E}, "moe_route_softmax_backward dlogits");
  check_dtype(dlogits, DType::F32, "moe_route_softmax_backward dlogits");
  launch_moe_route_softmax_backward(logits.data<float>(), experts.data<int32_t>(), dweights.data<float>(), T,
                                    static_cast<int>(E), static_cast<int>(k), renormalize, dlogits.data<float>(),
                                    stream_);
}

void CudaBackend::moe_route_sigmoid(const Tensor& logits, const Tensor* bias, int top_k, int n_group, int topk_group,
                                    bool renormalize, float scaling, Tensor& experts, Tensor& weights) {
  const OpTimer op_timer_(*this, "moe_route_sigmoid");
  check_dev(logits, "moe_route_sigmoid logits");
  check_dev(experts, "moe_route_sigmoid experts");
  check_dev(weights, "moe_route_sigmoid weights");
  check_dtype(logits, DType::F32, "moe_route_sigmoid logits");
  FP8RL_CHECK(logits.ndim() == 2 && top_k >= 1 && top_k <= logits.dim(1), "moe_route_sigmoid: logits [T, E] and "
              "1 <= top_k <= E expected, got ", logits.str(), ", top_k ", top_k);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  FP8RL_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
                  top_k <= topk_group * (E / n_group),
              "moe_route_sigmoid: n_group (", n_group, ") must divide E (", E, "), 1 <= topk_group (", topk_group,
              ") <= n_group, and top_k (", top_k, ") fit the kept groups");
  check_shape(experts, {T, top_k}, "moe_route_sigmoid experts");
  check_dtype(experts, DType::I32, "moe_route_sigmoid experts");
  check_shape(weights, {T, top_k}, "moe_route_sigmoid weights");
  check_dtype(weights, DType::F32, "moe_route_sigmoid weights");
  if (bias) {
    check_dev(*bias, "moe_route_sigmoid bias");
    check_shape(*bias, {E}, "moe_route_sigmoid bias");
    check_dtype(*bias, DType::F32, "moe_route_sigmoid bias");
  }
  launch_moe_route_sigmoid(logits.data<float>(), bias ? bias->data<float>() : nullptr, T, static_cast<int>(E), top_k,
                           n_group, topk_group, renormalize, scaling, experts.data<int32_t>(), weights.data<float>(),
                           stream_);
}

void CudaBackend::moe_route_sigmoid_backward(const Tensor& logits, const Tensor& experts, bool renormalize,
                                             float scaling, const Tensor& dweights, Tensor& dlogits) {
  const OpTimer op_timer_(*this, "moe_route_sigmoid_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &experts, &dweights, &dlogits})
    check_dev(*t, "moe_route_sigmoid_backward tensor");
  check_dtype(logits, DType::F32, "moe_route_sigmoid_backward logits");
  FP8RL_CHECK(logits.ndim() == 2 && experts.ndim() == 2 && experts.dim(0) == logits.dim(0),
              "moe_route_sigmoid_backward: logits [T, E] and experts [T, k] expected, got ", logits.str(), ", ",
              experts.str());
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  check_dtype(experts, DType::I32, "moe_route_sigmoid_backward experts");
  check_shape(dweights, {T, k}, "moe_route_sigmoid_backward dweights");
  check_dtype(dweights, DType::F32, "moe_route_sigmoid_backward dweights");
  check_shape(dlogits, {T, E}, "moe_route_sigmoid_backward dlogits");
  check_dtype(dlogits, DType::F32, "moe_route_sigmoid_backward dlogits");
  launch_moe_route_sigmoid_backward(logits.data<float>(), experts.data<int32_t>(), dweights.data<float>(), T,
                                    static_cast<int>(E), static_cast<int>(k), renormalize, scaling,
                                    dlogits.data<float>(), stream_);
}

void CudaBackend::moe_permute(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights, Tensor& out) {
  const OpTimer op_timer_(*this, "moe_permute");
  check_dev(x, "moe_permute x");
  check_dev(row_slot, "moe_permute row_slot");
  check_dev(out, "moe_permute out");
  check_dtype(row_slot, DType::I32, "moe_permute row_slot");
  FP8RL_CHECK(x.ndim() == 2 && top_k >= 1, "moe_permute: x [T, D] and top_k >= 1 expected, got ", x.str());
  const int64_t T = x.dim(0), D = x.dim(1), R = row_slot.numel();
  check_shape(out, {R, D}, "moe_permute out");
  check_dtype(out, x.dtype(), "moe_permute out");
  if (weights) {
    check_dev(*weights, "moe_permute weights");
    check_shape(*weights, {T * top_k}, "moe_permute weights");
    check_dtype(*weights, DType::F32, "moe_permute weights");
  }
  launch_moe_permute(x.raw(), x.dtype(), row_slot.data<int32_t>(), weights ? weights->data<float>() : nullptr, R, D,
                     top_k, T * top_k, out.raw(), flag_reset(), stream_);
  flag_check("moe_permute: a row_slot entry is outside [0, T * top_k)");
}

void CudaBackend::moe_unpermute(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) {
  const OpTimer op_timer_(*this, "moe_unpermute");
  check_dev(y, "moe_unpermute y");
  check_dev(slot_row, "moe_unpermute slot_row");
  check_dev(out, "moe_unpermute out");
  check_dtype(slot_row, DType::I32, "moe_unpermute slot_row");
  FP8RL_CHECK(y.ndim() == 2 && out.ndim() == 2 && out.dim(1) == y.dim(1) && out.dim(0) > 0,
              "moe_unpermute: y [R, D] and out [T, D] expected, got ", y.str(), ", ", out.str());
  check_dtype(out, y.dtype(), "moe_unpermute out");
  const int64_t R = y.dim(0), D = y.dim(1), T = out.dim(0), S = slot_row.numel();
  FP8RL_CHECK(S > 0 && S % T == 0, "moe_unpermute: slot_row has ", S, " entries, not a multiple of T = ", T);
  if (weights) {
    check_dev(*weights, "moe_unpermute weights");
    check_shape(*weights, {S}, "moe_unpermute weights");
    check_dtype(*weights, DType::F32, "moe_unpermute weights");
  }
  launch_moe_unpermute(y.raw(), y.dtype(), slot_row.data<int32_t>(), weights ? weights->data<float>() : nullptr, T, D,
                       static_cast<int>(S / T), R, out.raw(), flag_reset(), stream_);
  flag_check("moe_unpermute: a slot_row entry is outside [0, R)");
}

void CudaBackend::moe_unpermute_backward_weights(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                                 Tensor& dweights) {
  const OpTimer op_timer_(*this, "moe_unpermute_backward_weights");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &y, &slot_row, &dweights})
    check_dev(*t, "moe_unpermute_backward_weights tensor");
  check_dtype(slot_row, DType::I32, "moe_unpermute_backward_weights slot_row");
  FP8RL_CHECK(y.ndim() == 2 && dout.ndim() == 2 && dout.dim(1) == y.dim(1) && dout.dim(0) > 0 &&
                  dout.dtype() == y.dtype(),
              "moe_unpermute_backward_weights: dout [T, D] and y [R, D] of one dtype expected, got ", dout.str(),
              ", ", y.str());
  const int64_t R = y.dim(0), D = y.dim(1), T = dout.dim(0), S = slot_row.numel();
  FP8RL_CHECK(S > 0 && S % T == 0, "moe_unpermute_backward_weights: slot_row has ", S,
              " entries, not a multiple of T = ", T);
  check_shape(dweights, {S}, "moe_unpermute_backward_weights dweights");
  check_dtype(dweights, DType::F32, "moe_unpermute_backward_weights dweights");
  launch_moe_weight_grad(dout.raw(), y.raw(), y.dtype(), slot_row.data<int32_t>(), S, D, static_cast<int>(S / T), R,
                         dweights.data<float>(), flag_reset(), stream_);
  flag_check("moe_unpermute_backward_weights: a slot_row entry is outside [0, R)");
}

void CudaBackend::adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  const OpTimer op_timer_(*this, "adamw");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v}) {
    check_dev(*t, "adamw tensor");
    FP8RL_CHECK(t->shape() == param.shape(), "adamw: param/grad/m/v must have one shape");
  }
  check_dtype(param, DType::F32, "adamw param");
  FP8RL_CHECK(grad.dtype() == DType::F32 || grad.dtype() == DType::BF16, "adamw grad must be F32 or BF16, got ",
              grad.str());
  FP8RL_CHECK(m.dtype() == v.dtype() && (m.dtype() == DType::F32 || m.dtype() == DType::BF16),
              "adamw: m and v must be both F32 or both BF16, got ", m.str(), " and ", v.str());
  FP8RL_CHECK(p.step >= 1, "adamw: step is 1-based, got ", p.step);
  if (m.dtype() == DType::BF16) {
    const AdamWScalars sc = adamw_scalars(p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale);
    launch_adamw_bf16_moments(param.data<float>(), grad.raw(), grad.dtype(), m.data<uint16_t>(), v.data<uint16_t>(),
                              param.numel(), sc, p.stochastic_rounding, p.rounding_key, p.step, stream_);
    return;
  }
  Tensor g32 = grad;  // a BF16 or scaled gradient: an F32 copy for the F32 kernel
  if (grad.dtype() == DType::BF16 || p.grad_scale != 1.0f) {
    g32 = alloc(grad.shape(), DType::F32);
    launch_convert(grad.raw(), grad.dtype(), g32.raw(), DType::F32, grad.numel(), stream_);
    if (p.grad_scale != 1.0f) launch_scale(g32.raw(), DType::F32, g32.numel(), p.grad_scale, stream_);
  }
  const float bc1 = 1.0f - std::pow(p.beta1, static_cast<float>(p.step));
  const float bc2 = 1.0f - std::pow(p.beta2, static_cast<float>(p.step));
  launch_adamw(param.data<float>(), g32.data<float>(), m.data<float>(), v.data<float>(), param.numel(), p.lr, p.beta1,
               p.beta2, p.eps, p.weight_decay, bc1, bc2, stream_);
}

// ---- quantization ---------------------------------------------------------------------------

void CudaBackend::quantize_async(const Tensor& x, bool transpose, QuantTensor& out, bool pad_cols, bool gemm_layout) {
  check_dev(x, "quantize x");
  check_float(x, "quantize x");
  FP8RL_CHECK(x.ndim() == 2, "quantize x must be 2-D, got ", x.str());
  check_dev(out.data, "quantize out.data");
  check_dev(out.scales, "quantize out.scales");
  const int64_t R = transpose ? x.dim(1) : x.dim(0), C = transpose ? x.dim(0) : x.dim(1);
  const int64_t ld = pad_cols ? ceil_div(C, kQuantBlock) * kQuantBlock : C;
  check_shape(out.data, {R, ld}, "quantize out.data");
  check_dtype(out.data, DType::E4M3, "quantize out.data");
  check_shape(out.scales, {ceil_div(R, out.block_rows), ceil_div(C, out.block_cols)}, "quantize out.scales");
  check_dtype(out.scales, DType::F32, "quantize out.scales");
  launch_quantize(x.raw(), x.dtype(), x.dim(0), x.dim(1), transpose, out.block_rows, out.block_cols, out.pow2,
                  out.data.data<uint8_t>(), out.scales.data<float>(), flag_cur_, stream_, ld, gemm_layout);
}

void CudaBackend::quantize(const Tensor& x, bool transpose, QuantTensor& out) {
  const OpTimer op_timer_(*this, "quantize");
  flag_reset();
  quantize_async(x, transpose, out);
  flag_check("quantize: the input " + x.str() +
             " holds NaN or Inf; FP8 quantization refuses non-finite values (check the loss scale / learning rate)");
  flag_drain();  // the explicit op (refit, tests) reports at once
}

// ---- GEMMs and linear layers ------------------------------------------------------------------

// FP8 block GEMMs run on cuBLASLt's FP8 tensor-core kernels when the shape allows, except on a
// backend made with F32 activations (the exact path): there every FP8 product is the FP32 GEMM
// of the dequantized operands, as the CPU reference computes it. Measured on the H200
// (docs/benchmarks.md, "CUDA model parity"): with cuBLASLt the llama fixture's FP8 log-probs
// were 3e-2 (mean) from the exact emulation, the dequantized path 5e-7 on the other fixtures.
bool CudaBackend::fp8_tensor_cores(int64_t M, int64_t N, int64_t K) {
  if (act_dtype_ == DType::F32) return false;  // the exact path: dequantize + FP32 by design
  if (GemmEngine::fp8_supported(M, N, K)) return true;
  ++fp8_fallbacks_;
  if (fp8_fallback_shapes_.insert({N, K}).second)
    std::fprintf(stderr, "warning: FP8 GEMM M=%lld N=%lld K=%lld runs as dequantize + FP32 GEMM (slow): cuBLASLt's "
                         "block-scaled kernels need N %% 16 == 0 and K %% 128 == 0 (reported once per N, K; counted "
                         "in fp8_gemm_fallbacks)\n",
                 static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K));
  return false;
}

BackendCounters CudaBackend::counters() const {
  BackendCounters c;
  c.fp8_gemm_fallbacks = fp8_fallbacks_;
  c.fp8_gemm_tails = gemm_->tail_products();
  c.fp8_gemm_own = gemm_->own_products();
  return c;
}

void CudaBackend::mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const Tensor& A, const Tensor& B, DType ab,
                     Tensor& C, float beta) {
  const Tensor* a = &A;
  const Tensor* b = &B;
  Tensor ac, bc;
  if (A.dtype() != ab) {
    ac = scratch(kSlotA, A.shape(), ab);
    launch_convert(A.raw(), A.dtype(), ac.raw(), ab, A.numel(), stream_);
    a = &ac;
  }
  if (B.dtype() != ab) {
    bc = scratch(kSlotB, B.shape(), ab);
    launch_convert(B.raw(), B.dtype(), bc.raw(), ab, B.numel(), stream_);
    b = &bc;
  }
  if (ab == DType::F32 && C.dtype() != DType::F32) {  // FP32 GEMMs write F32: go through a buffer
    Tensor c32 = scratch(kSlotC, C.shape(), DType::F32);
    if (beta != 0.0f) launch_convert(C.raw(), C.dtype(), c32.raw(), DType::F32, C.numel(), stream_);
    gemm_->gemm(ta, tb, M, N, K, a->raw(), b->raw(), ab, c32.raw(), DType::F32, 1.0f, beta);
    launch_convert(c32.raw(), DType::F32, C.raw(), C.dtype(), C.numel(), stream_);
    return;
  }
  gemm_->gemm(ta, tb, M, N, K, a->raw(), b->raw(), ab, C.raw(), C.dtype(), 1.0f, beta);
}

void CudaBackend::linear_fwd(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                             const Fp8View* x_view) {
  const int64_t M = x.dim(0), K = x.dim(1), N = W.out_features();
  if (spec.mode != LinearMode::FP8_BLOCK) {
    check_dev(W.w, "linear W.w");
    check_float(W.w, "linear W.w");
    mm(false, true, M, N, K, x, W.w, spec.mode == LinearMode::FP32 ? DType::F32 : DType::BF16, out, 0.0f);
  } else {
    // With M % 16 == 0 (decode batches, aligned micro-batches) the quantizer writes the scales
    // straight into cuBLASLt's layout: no layout kernel. x_view: x already quantized (by a fused
    // producer or linear_shared_input); the dequantize path reads row-major scales only, so a
    // view in cuBLASLt's layout is then ignored and x quantized again (the same values).
    const bool tc = fp8_tensor_cores(M, N, K);
    const bool use_view = x_view && (tc || !x_view->scales_gemm_layout);
    const bool laid = use_view ? x_view->scales_gemm_layout : tc && M % kFp8RowGranule == 0;
    const bool quantizes = !use_view || !W.wq.defined();  // a flag slot only when a quantizer runs
    if (quantizes) flag_reset();
    QuantTensor xq;
    if (use_view) {
      xq = x_view->q;
    } else {
      xq = scratch_quant(kSlotAq, kSlotAs, M, K, 1, spec.pow2_scales);
      quantize_async(x, false, xq, false, /*gemm_layout=*/laid);
    }
    QuantTensor wq;
    if (W.wq.defined()) {  // pre-quantized (the generator's, or the trainer's per-step cache)
      check_wq(W, spec);
      wq = W.wq;
    } else {
      check_dev(W.w, "linear W.w");
      wq = scratch_quant(kSlotBq, kSlotBs, N, K, kQuantBlock, spec.pow2_scales);
      quantize_async(W.w, false, wq);
    }
    if (quantizes)
      flag_check(use_view ? "linear (FP8): the weight holds NaN or Inf"
                          : "linear (FP8): the input " + x.str() + " or the weight holds NaN or Inf");
    if (tc) {
      gemm_->gemm_fp8(M, N, K, xq.data.data<uint8_t>(), xq.scales.data<float>(), wq.data.data<uint8_t>(),
                      wq.scales.data<float>(), kQuantBlock, out.raw(), out.dtype(), 1.0f, 0.0f, laid);
    } else {  // cuBLASLt's block mode rejects the shape: the same quantized product in FP32
      Tensor xf = scratch(kSlotA, {M, K}, DType::F32), wf = scratch(kSlotB, {N, K}, DType::F32);
      launch_dequantize(xq.data.data<uint8_t>(), xq.scales.data<float>(), M, K, 1, kQuantBlock, xf.raw(), DType::F32,
                        stream_);
      launch_dequantize(wq.data.data<uint8_t>(), wq.scales.data<float>(), N, K, kQuantBlock, kQuantBlock, wf.raw(),
                        DType::F32, stream_);
      mm(false, true, M, N, K, xf, wf, DType::F32, out, 0.0f);
    }
  }
  if (W.bias.defined()) {
    check_dev(W.bias, "linear bias");
    check_shape(W.bias, {N}, "linear bias");
    launch_add_bias(out.raw(), out.dtype(), W.bias.raw(), W.bias.dtype(), M, N, stream_);
  }
}

void CudaBackend::linear(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                         const Fp8View* x_fp8) {
  const OpTimer op_timer_(*this, "linear");
  check_dev(x, "linear x");
  check_dev(out, "linear out");
  check_float(x, "linear x");
  check_float(out, "linear out");
  const int64_t K = W.in_features(), N = W.out_features();
  FP8RL_CHECK(x.dim(-1) == K, "linear: x ", x.str(), " does not match the weight's in_features ", K);
  const int64_t M = rows_of(x);
  FP8RL_CHECK(out.numel() == M * N && out.dim(-1) == N, "linear: out must be [", M, ", ", N, "], got ", out.str());
  const Fp8View* view = spec.mode == LinearMode::FP8_BLOCK ? x_fp8 : nullptr;
  if (view) {
    fp8_view_check(*view, x, spec, "linear");
    check_dev(view->q.data, "linear x_fp8 data");
    check_dev(view->q.scales, "linear x_fp8 scales");
  }
  Tensor x2 = x.reshape({M, K}), o2 = out.reshape({M, N});
  linear_fwd(x2, W, spec, o2, view);
}

// FP8: x quantized once for every weight (q/k/v, gate/up) when all of them take the tensor
// cores, or not at all when a fused producer gave its FP8 copy (x_fp8); the products are then
// exactly those of separate linear() calls.
void CudaBackend::linear_shared_input(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                      const LinearSpec& spec, const std::vector<Tensor*>& outs, const Fp8View* x_fp8) {
  FP8RL_CHECK(!W.empty() && W.size() == outs.size(), "linear_shared_input: ", W.size(), " weights for ", outs.size(),
              " outputs");
  bool shared = spec.mode == LinearMode::FP8_BLOCK;
  const int64_t K = W[0]->in_features(), M = rows_of(x);
  for (const LinearWeight* w : W) shared = shared && w->in_features() == K;
  if (shared)
    for (const LinearWeight* w : W) shared = shared && GemmEngine::fp8_supported(M, w->out_features(), K);
  if (!shared || act_dtype_ == DType::F32) {
    Backend::linear_shared_input(x, W, spec, outs, x_fp8);
    return;
  }
  const OpTimer op_timer_(*this, "linear");
  check_dev(x, "linear x");
  check_float(x, "linear x");
  FP8RL_CHECK(x.dim(-1) == K, "linear: x ", x.str(), " does not match the weight's in_features ", K);
  const Tensor x2 = x.reshape({M, K});
  Fp8View view;
  if (x_fp8) {
    fp8_view_check(*x_fp8, x, spec, "linear");
    check_dev(x_fp8->q.data, "linear x_fp8 data");
    check_dev(x_fp8->q.scales, "linear x_fp8 scales");
    view = *x_fp8;
  } else {
    view.q = scratch_quant(kSlotAq, kSlotAs, M, K, 1, spec.pow2_scales);
    view.scales_gemm_layout = M % kFp8RowGranule == 0;
    view.source = x.raw();
    flag_reset();
    quantize_async(x2, false, view.q, false, /*gemm_layout=*/view.scales_gemm_layout);
    flag_check("linear (FP8): the input " + x.str() + " holds NaN or Inf");
  }
  for (size_t i = 0; i < W.size(); ++i) {
    Tensor& out = *outs[i];
    const int64_t N = W[i]->out_features();
    check_dev(out, "linear out");
    check_float(out, "linear out");
    FP8RL_CHECK(out.numel() == M * N && out.dim(-1) == N, "linear: out must be [", M, ", ", N, "], got ", out.str());
    Tensor o2 = out.reshape({M, N});
    linear_fwd(x2, *W[i], spec, o2, &view);
  }
}

void CudaBackend::linear_backward(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                                  Tensor* dx, Tensor* dw, Tensor* dbias) {
  if (is_bf16_grad(dw) || is_bf16_grad(dbias)) {
    Tensor dw32 = grad_widen(*this, dw), db32 = grad_widen(*this, dbias);
    linear_backward(dy, x, W, spec, dx, dw32.defined() ? &dw32 : dw, db32.defined() ? &db32 : dbias);
    grad_narrow(*this, dw32, dw);
    grad_narrow(*this, db32, dbias);
    return;
  }
  const OpTimer op_timer_(*this, "linear_backward");
  check_dev(dy, "linear_backward dy");
  check_dev(x, "linear_backward x");
  check_float(dy, "linear_backward dy");
  check_float(x, "linear_backward x");
  const int64_t K = W.in_features(), N = W.out_features(), M = rows_of(x);
  FP8RL_CHECK(x.dim(-1) == K && dy.dim(-1) == N && rows_of(dy) == M, "linear_backward: dy ", dy.str(), " / x ",
              x.str(), " do not match W [", N, ", ", K, "]");
  const Tensor dy2 = dy.reshape({M, N}), x2 = x.reshape({M, K});
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  const DType ab = spec.mode == LinearMode::FP32 ? DType::F32 : DType::BF16;
  if (dx) {
    check_dev(*dx, "linear_backward dx");
    FP8RL_CHECK(dx->numel() == M * K, "linear_backward: dx must be [", M, ", ", K, "], got ", dx->str());
    Tensor dx2 = dx->reshape({M, K});
    if (!fp8) {
      FP8RL_CHECK(W.w.defined(), "linear_backward (", linear_mode_name(spec.mode), ") on the GPU needs the ",
                  "high-precision weight W.w");
      check_dev(W.w, "linear_backward W.w");
      mm(false, false, M, K, N, dy2, W.w, ab, dx2, 0.0f);
    } else {
      // dgrad: dY 1x128 along N; W^T [K, N] 128x128, the exact transpose of W's quantization:
      // of W.wq when defined (a byte transpose, no requantization), else of W.w quantized here.
      const bool tc = fp8_tensor_cores(M, K, N), laid = tc && M % kFp8RowGranule == 0;  // as in the forward
      QuantTensor dyq = scratch_quant(kSlotAq, kSlotAs, M, N, 1, spec.pow2_scales);
      QuantTensor wtq = scratch_quant(kSlotBq, kSlotBs, K, N, kQuantBlock, spec.pow2_scales);
      flag_reset();
      quantize_async(dy2, false, dyq, false, /*gemm_layout=*/laid);
      if (W.wq.defined()) {
        check_wq(W, spec);
        launch_transpose_quant(W.wq.data.data<uint8_t>(), W.wq.scales.data<float>(), N, K, kQuantBlock,
                               wtq.data.data<uint8_t>(), wtq.scales.data<float>(), stream_);
      } else {
        check_dev(W.w, "linear_backward W.w");
        quantize_async(W.w, true, wtq);
      }
      flag_check("linear_backward (FP8 dgrad): dy " + dy.str() + " or the weight holds NaN or Inf");
      if (tc) {
        gemm_->gemm_fp8(M, K, N, dyq.data.data<uint8_t>(), dyq.scales.data<float>(), wtq.data.data<uint8_t>(),
                        wtq.scales.data<float>(), kQuantBlock, dx2.raw(), dx2.dtype(), 1.0f, 0.0f, laid);
      } else {
        Tensor af = scratch(kSlotA, {M, N}, DType::F32), bf = scratch(kSlotB, {K, N}, DType::F32);
        launch_dequantize(dyq.data.data<uint8_t>(), dyq.scales.data<float>(), M, N, 1, kQuantBlock, af.raw(),
                          DType::F32, stream_);
        launch_dequantize(wtq.data.data<uint8_t>(), wtq.scales.data<float>(), K, N, kQuantBlock, kQuantBlock,
                          bf.raw(), DType::F32, stream_);
        mm(false, true, M, K, N, af, bf, DType::F32, dx2, 0.0f);
      }
    }
  }
  if (dw) {
    check_dev(*dw, "linear_backward dw");
    check_dtype(*dw, DType::F32, "linear_backward dw");
    check_shape(*dw, {N, K}, "linear_backward dw");
    FP8RL_CHECK(!fp8 || spec.wgrad == LinearMode::FP8_BLOCK || spec.wgrad == LinearMode::BF16,
                "an FP8 linear's wgrad must be fp8 or bf16, got ", linear_mode_name(spec.wgrad));
    if (!fp8 || spec.wgrad == LinearMode::BF16) {  // BF16 wgrad of an FP8 linear: ab is BF16 here
      mm(true, false, N, K, M, dy2, x2, ab, *dw, 1.0f);
    } else {
      // wgrad: dY^T [N, M] and X^T [K, M], both requantized 1x128 along tokens. The token
      // dimension is the contraction: its last block is padded with zeros to a multiple of 128
      // (Mp), as cuBLASLt wants, which adds nothing to the product.
      const int64_t Mp = ceil_div(M, kQuantBlock) * kQuantBlock;
      const bool tc = fp8_tensor_cores(N, K, Mp);
      QuantTensor dytq = scratch_quant(kSlotAq, kSlotAs, N, tc ? Mp : M, 1, spec.pow2_scales);
      QuantTensor xtq = scratch_quant(kSlotBq, kSlotBs, K, tc ? Mp : M, 1, spec.pow2_scales);
      flag_reset();
      quantize_async(dy2, true, dytq, /*pad_cols=*/tc);
      quantize_async(x2, true, xtq, /*pad_cols=*/tc);
      flag_check("linear_backward (FP8 wgrad): dy " + dy.str() + " or x " + x.str() + " holds NaN or Inf");
      if (tc) {
        gemm_->gemm_fp8(N, K, Mp, dytq.data.data<uint8_t>(), dytq.scales.data<float>(), xtq.data.data<uint8_t>(),
                        xtq.scales.data<float>(), 1, dw->raw(), DType::F32, 1.0f, 1.0f);
      } else {
        Tensor af = scratch(kSlotA, {N, M}, DType::F32), bf = scratch(kSlotB, {K, M}, DType::F32);
        launch_dequantize(dytq.data.data<uint8_t>(), dytq.scales.data<float>(), N, M, 1, kQuantBlock, af.raw(),
                          DType::F32, stream_);
        launch_dequantize(xtq.data.data<uint8_t>(), xtq.scales.data<float>(), K, M, 1, kQuantBlock, bf.raw(),
                          DType::F32, stream_);
        mm(false, true, N, K, M, af, bf, DType::F32, *dw, 1.0f);
      }
    }
  }
  if (dbias) {
    check_dev(*dbias, "linear_backward dbias");
    check_dtype(*dbias, DType::F32, "linear_backward dbias");
    check_shape(*dbias, {N}, "linear_backward dbias");
    launch_bias_grad(dy2.raw(), dy2.dtype(), M, N, dbias->data<float>(), stream_);
  }
}

// ---- attention -------------------------------------------------------------------------------

namespace {
// Host: per-token sequence start and end from cu_seqlens.
void seq_bounds(const std::vector<int32_t>& cu, int64_t T, std::vector<int32_t>& out) {
  FP8RL_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == T, "cu_seqlens must run from 0 to T = ", T,
              " (got ", cu.size(), " entries ending at ", cu.empty() ? -1 : cu.back(), ")");
  out.assign(2 * T, 0);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    FP8RL_CHECK(cu[b] <= cu[b + 1], "cu_seqlens must be non-decreasing");
    for (int32_t t = cu[b]; t < cu[b + 1]; ++t) {
      out[t] = cu[b];
      out[T + t] = cu[b + 1];
    }
  }
}

// The tensor-core flash kernels (flash_attention.cu) serve BF16 activations with head_dim 64 or
// 128 and 16-byte aligned tensors; everything else takes the simple kernels. The environment
// variable FP8RL_CUDA_ATTENTION=simple forces the simple kernels (=flash: the flash ones where
// supported), a diagnostic switch read at each call.
constexpr bool kFlashByDefault = true;
bool use_flash_attention(DType dt, int hd, std::initializer_list<const Tensor*> ts) {
  const char* e = std::getenv("FP8RL_CUDA_ATTENTION");
  const bool want = e && std::string(e) == "simple" ? false : (e && std::string(e) == "flash") || kFlashByDefault;
  if (!want || !flash_attention_supported(dt, hd)) return false;
  for (const Tensor* t : ts)
    if (reinterpret_cast<uintptr_t>(t->raw()) % 16 != 0) return false;
  return true;
}
}  // namespace

void CudaBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu_seqlens,
                            float softmax_scale, Tensor& out, Tensor& lse) {
  const OpTimer op_timer_(*this, "attention");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q, &k, &v, &out, &lse}) check_dev(*t, "attention tensor");
  FP8RL_CHECK(q.ndim() == 3 && k.ndim() == 3, "attention: q, k, v must be [T, H, head_dim]");
  const int64_t T = q.dim(0);
  const int Hq = static_cast<int>(q.dim(1)), Hkv = static_cast<int>(k.dim(1)), hd = static_cast<int>(q.dim(2));
  FP8RL_CHECK(Hkv > 0 && Hq % Hkv == 0, "attention: Hq (", Hq, ") must be a multiple of Hkv (", Hkv, ")");
  FP8RL_CHECK(v.ndim() == 3 && v.dim(2) > 0, "attention: v must be [T, Hkv, hdv], got ", v.str());
  // MLA: v's heads (v_head_dim) are narrower than q/k's (qk_nope + qk_rope); the simple kernels
  // take both widths, the flash kernel one (so MLA runs the simple ones).
  const int hdv = static_cast<int>(v.dim(2));
  check_shape(k, {T, Hkv, hd}, "attention k");
  check_shape(v, {T, Hkv, hdv}, "attention v");
  check_shape(out, {T, Hq, hdv}, "attention out");
  check_shape(lse, {Hq, T}, "attention lse");
  check_dtype(lse, DType::F32, "attention lse");
  FP8RL_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype() && out.dtype() == q.dtype(),
              "attention: q, k, v, out must share a dtype");
  std::vector<int32_t> b;
  seq_bounds(cu_seqlens, T, b);
  if (hdv == hd && use_flash_attention(q.dtype(), hd, {&q, &k, &v, &out})) {
    const std::vector<int32_t> tiles = flash_attention_tiles(cu_seqlens);
    Tensor td = scratch(kSlotIdx, {static_cast<int64_t>(tiles.size()) + 1}, DType::I32);
    CUDA_CHECK(cudaMemcpyAsync(td.raw(), tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice, stream_),
               "uploading attention tiles");
    launch_flash_attention(q.raw(), k.raw(), v.raw(), td.data<int32_t>(), static_cast<int>(tiles.size() / 8), T, Hq,
                           Hkv, hd, softmax_scale, out.raw(), lse.data<float>(), stream_);
    return;
  }
  Tensor idx = scratch(kSlotIdx, {2 * T}, DType::I32);
  CUDA_CHECK(cudaMemcpyAsync(idx.raw(), b.data(), b.size() * 4, cudaMemcpyHostToDevice, stream_), "uploading seqlens");
  launch_attention(q.raw(), k.raw(), v.raw(), q.dtype(), idx.data<int32_t>(), T, Hq, Hkv, hd, hdv, softmax_scale,
                   out.raw(), lse.data<float>(), stream_);
}

void CudaBackend::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& lse, const std::vector<int32_t>& cu_seqlens,
                                     float softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const OpTimer op_timer_(*this, "attention_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv}) check_dev(*t, "attention_backward tensor");
  const int64_t T = q.dim(0);
  const int Hq = static_cast<int>(q.dim(1)), Hkv = static_cast<int>(k.dim(1)), hd = static_cast<int>(q.dim(2));
  FP8RL_CHECK(Hkv > 0 && Hq % Hkv == 0, "attention_backward: Hq must be a multiple of Hkv");
  FP8RL_CHECK(v.ndim() == 3 && v.dim(2) > 0, "attention_backward: v must be [T, Hkv, hdv], got ", v.str());
  const int hdv = static_cast<int>(v.dim(2));  // MLA: v_head_dim (the simple kernels; see attention)
  check_shape(dq, q.shape(), "attention_backward dq");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &out}) check_shape(*t, {T, Hq, hdv}, "attention_backward out-shaped tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &dk}) check_shape(*t, {T, Hkv, hd}, "attention_backward k-shaped tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&v, &dv}) check_shape(*t, {T, Hkv, hdv}, "attention_backward v-shaped tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &k, &v, &out, &dq, &dk, &dv})
    FP8RL_CHECK(t->dtype() == q.dtype(), "attention_backward: all tensors must share q's dtype");
  check_shape(lse, {Hq, T}, "attention_backward lse");
  std::vector<int32_t> b;
  seq_bounds(cu_seqlens, T, b);
  Tensor delta = scratch(kSlotAttn, {T * Hq}, DType::F32);
  if (hdv == hd && use_flash_attention(q.dtype(), hd, {&dout, &q, &k, &v, &out, &dq, &dk, &dv})) {
    const std::vector<int32_t> tiles = flash_attention_tiles(cu_seqlens);
    Tensor td = scratch(kSlotIdx, {static_cast<int64_t>(tiles.size()) + 1}, DType::I32);
    CUDA_CHECK(cudaMemcpyAsync(td.raw(), tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice, stream_),
               "uploading attention tiles");
    launch_flash_attention_backward(dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(), lse.data<float>(),
                                    td.data<int32_t>(), static_cast<int>(tiles.size() / 8), T, Hq, Hkv, hd,
                                    softmax_scale, dq.raw(), dk.raw(), dv.raw(), delta.data<float>(), stream_);
    return;
  }
  Tensor idx = scratch(kSlotIdx, {2 * T}, DType::I32);
  CUDA_CHECK(cudaMemcpyAsync(idx.raw(), b.data(), b.size() * 4, cudaMemcpyHostToDevice, stream_), "uploading seqlens");
  launch_attention_backward(dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(), q.dtype(), lse.data<float>(),
                            idx.data<int32_t>(), idx.data<int32_t>() + T, T, Hq, Hkv, hd, hdv, softmax_scale,
                            dq.raw(), dk.raw(), dv.raw(), delta.data<float>(), stream_);
}

// ---- fused log-probabilities -------------------------------------------------------------------

namespace {
int64_t vocab_chunk(int64_t T, int64_t V) {
  const int64_t budget = (256LL << 20) / 4;  // F32 logits of one chunk: at most 256 MiB
  int64_t c = std::max<int64_t>(budget / std::max<int64_t>(T, 1), 128);
  c = (c / 128) * 128;
  return std::min(c, V);
}
}  // namespace

void CudaBackend::token_logprobs(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, float temperature,
                                 const LinearSpec& spec, Tensor& logp, Tensor& lse, Tensor* entropy) {
  const OpTimer op_timer_(*this, "token_logprobs");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&hidden, &lm_head, &targets, &logp, &lse}) check_dev(*t, "token_logprobs tensor");
  FP8RL_CHECK(temperature > 0.0f, "token_logprobs: temperature must be > 0, got ", temperature);
  const int64_t T = hidden.dim(0), D = hidden.dim(1), V = lm_head.dim(0);
  check_shape(lm_head, {V, D}, "token_logprobs lm_head");
  check_dtype(targets, DType::I32, "token_logprobs targets");
  check_shape(targets, {T}, "token_logprobs targets");
  check_shape(logp, {T}, "token_logprobs logp");
  check_shape(lse, {T}, "token_logprobs lse");
  check_dtype(logp, DType::F32, "token_logprobs logp");
  check_dtype(lse, DType::F32, "token_logprobs lse");
  if (entropy) {
    check_dev(*entropy, "token_logprobs entropy");
    check_shape(*entropy, {T}, "token_logprobs entropy");
  }
  Tensor state = scratch(kSlotState, {4, T}, DType::F32);
  float* m = state.data<float>();
  float *s = m + T, *e = m + 2 * T, *tgt = m + 3 * T;
  launch_logprob_init(m, s, e, tgt, T, stream_);
  // The sticky slot: set by any out-of-range target of any call, read and cleared by flag_drain.
  int* bad = flag_dev_ + kFlagSticky;
  if (sticky_message_.empty()) sticky_message_ = "token_logprobs: a target id is out of range [0, " + std::to_string(V) + ")";
  const int64_t vc = vocab_chunk(T, V);
  for (int64_t v0 = 0; v0 < V; v0 += vc) {
    const int64_t n = std::min(vc, V - v0);
    Tensor logits = scratch(kSlotLogits, {T, n}, DType::F32);
    LinearWeight chunk;
    chunk.w = lm_head.slice_rows(v0, v0 + n);
    linear_fwd(hidden, chunk, spec, logits);
    launch_logprob_chunk(logits.data<float>(), T, n, v0, V, 1.0f / temperature, targets.data<int32_t>(), m, s, e, tgt,
                         bad, stream_);
  }
  launch_logprob_finish(m, s, e, tgt, T, logp.data<float>(), lse.data<float>(),
                        entropy ? entropy->data<float>() : nullptr, stream_);
}

void CudaBackend::token_logprobs_backward(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                          float temperature, const LinearSpec& spec, const Tensor& lse,
                                          const Tensor& dlogp, Tensor& dhidden, Tensor* dlm_head) {
  const OpTimer op_timer_(*this, "token_logprobs_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&hidden, &lm_head, &targets, &lse, &dlogp, &dhidden})
    check_dev(*t, "token_logprobs_backward tensor");
  const int64_t T = hidden.dim(0), D = hidden.dim(1), V = lm_head.dim(0);
  check_shape(dhidden, {T, D}, "token_logprobs_backward dhidden");
  check_shape(dlogp, {T}, "token_logprobs_backward dlogp");
  if (dlm_head) {
    check_dev(*dlm_head, "token_logprobs_backward dlm_head");
    FP8RL_CHECK(dlm_head->dtype() == DType::F32 || dlm_head->dtype() == DType::BF16,
                "token_logprobs_backward dlm_head must be F32 or BF16, got ", dlm_head->str());  // chunks: linear_backward
    check_shape(*dlm_head, {V, D}, "token_logprobs_backward dlm_head");
  }
  // Each chunk's raw-logit gradient goes through linear_backward in `spec` numerics, as the CPU
  // reference does; its dx is summed over chunks in FP32.
  Tensor dh = scratch(kSlotDh, {T, D}, DType::F32);
  launch_fill(dh.raw(), DType::F32, dh.numel(), 0.0f, stream_);
  const int64_t vc = vocab_chunk(T, V);
  for (int64_t v0 = 0; v0 < V; v0 += vc) {
    const int64_t n = std::min(vc, V - v0);
    Tensor logits = scratch(kSlotLogits, {T, n}, DType::F32);
    LinearWeight chunk;
    chunk.w = lm_head.slice_rows(v0, v0 + n);
    linear_fwd(hidden, chunk, spec, logits);
    launch_logprob_grad_chunk(logits.data<float>(), T, n, v0, 1.0f / temperature, targets.data<int32_t>(),
                              lse.data<float>(), dlogp.data<float>(), stream_);
    Tensor dxc = scratch(kSlotTmp, {T, D}, DType::F32);
    Tensor dchunk;
    if (dlm_head) dchunk = dlm_head->slice_rows(v0, v0 + n);
    linear_backward(logits, hidden, chunk, spec, &dxc, dlm_head ? &dchunk : nullptr, nullptr);
    launch_add(dh.raw(), DType::F32, dxc.raw(), DType::F32, dh.raw(), DType::F32, dh.numel(), stream_);
  }
  launch_convert(dh.raw(), DType::F32, dhidden.raw(), dhidden.dtype(), dh.numel(), stream_);
}

// ---- generation -------------------------------------------------------------------------------

void CudaBackend::kv_round(Tensor& x, const std::vector<float>& head_scale) {
  const OpTimer op_timer_(*this, "kv_round");
  check_dev(x, "kv_round x");
  kv_round_check(x, head_scale);
  FP8RL_CHECK(x.dim(1) <= kMaxKvRoundHeads, "kv_round: at most ", kMaxKvRoundHeads, " heads, got ", x.dim(1));
  KvRoundScales s{};
  for (size_t h = 0; h < head_scale.size(); ++h) s.v[h] = head_scale[h];
  launch_kv_round(x.raw(), x.dtype(), x.dim(0), static_cast<int>(x.dim(1)), static_cast<int>(x.dim(2)), s, stream_);
}

void CudaBackend::kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) {
  const OpTimer op_timer_(*this, "kv_write");
  FP8RL_CHECK(layer >= 0 && layer < cache.num_layers, "kv_write: layer ", layer, " out of range");
  const bool latent = cache.latent_v_dim > 0;  // MLA: k only (KvCache)
  check_dev(k, "kv_write k");
  if (latent)
    FP8RL_CHECK(!v.defined(), "kv_write: a latent (MLA) cache stores k only; v must be undefined, got ", v.str());
  else
    check_dev(v, "kv_write v");
  check_dev(batch.slots, "kv_write slots");
  const int64_t T = k.dim(0);
  check_shape(k, {T, cache.num_kv_heads, cache.head_dim}, "kv_write k");
  if (!latent) {
    check_shape(v, {T, cache.num_kv_heads, cache.head_dim}, "kv_write v");
    FP8RL_CHECK(k.dtype() == v.dtype(), "kv_write: k and v must share a dtype");
  }
  check_shape(batch.slots, {T}, "kv_write slots");
  const float* ks = cache.k_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads;
  const float* vs = cache.v_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads;
  launch_kv_write(k.raw(), latent ? nullptr : v.raw(), k.dtype(), batch.slots.data<int32_t>(), T, cache.num_kv_heads,
                  cache.head_dim, cache.k[layer].raw(), latent ? nullptr : cache.v[layer].raw(), cache.dtype, ks, vs,
                  stream_);
}

void CudaBackend::attention_paged(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                  float softmax_scale, bool fp8_attention, Tensor& out) {
  const OpTimer op_timer_(*this, "attention_paged");
  FP8RL_CHECK(layer >= 0 && layer < cache.num_layers, "attention_paged: layer ", layer, " out of range");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q, &out, &batch.token_seq, &batch.token_pos, &batch.page_table})
    check_dev(*t, "attention_paged tensor");
  const int64_t T = q.dim(0);
  const int Hq = static_cast<int>(q.dim(1)), hd = static_cast<int>(q.dim(2));
  FP8RL_CHECK(hd == cache.head_dim && Hq % cache.num_kv_heads == 0, "attention_paged: q ", q.str(),
              " does not match the cache (", cache.num_kv_heads, " KV heads of ", cache.head_dim, ")");
  const bool latent = cache.latent_v_dim > 0;  // MLA: V = the first latent_v_dim values of the K row
  check_shape(out, {T, Hq, cache.v_dim()}, "attention_paged out");
  FP8RL_CHECK(out.dtype() == q.dtype(), "attention_paged: out must have q's dtype");
  check_shape(batch.token_seq, {T}, "attention_paged token_seq");
  check_shape(batch.token_pos, {T}, "attention_paged token_pos");
  FP8RL_CHECK(batch.page_table.ndim() == 2, "attention_paged: page_table must be [B, max_pages]");
  const bool e4m3 = cache.dtype == DType::E4M3;
  const float* ks = e4m3 ? cache.k_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads : nullptr;
  const float* vs = !e4m3  ? nullptr
                    : latent ? ks
                             : cache.v_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads;
  const int max_pages = static_cast<int>(batch.page_table.dim(1));
  const void* kp = cache.k[layer].raw();
  const void* vp = latent ? kp : cache.v[layer].raw();
  // The tensor-core paged kernel (paged_attention.cu, paged_mma_kernel) for BF16 q over BF16 /
  // E4M3 pools, the tiled CUDA-core kernel for the other cases (F32 q or pools), the simple one
  // outside both. FP8RL_CUDA_ATTENTION=tiled / grouped / simple selects the tiled kernel, the
  // earlier paged kernel (lanes over head dims) or the one-warp-per-head reference kernel.
  // FP8RL_CUDA_PAGED_SPLITS=N forces N splits of the positions (diagnostics and tests). Both are
  // read at each call.
  const char* mode = std::getenv("FP8RL_CUDA_ATTENTION");
  const std::string md = mode ? mode : "";
  const bool simple = md == "simple", grouped = md == "grouped", tiled = md == "tiled";
  const int group = Hq / cache.num_kv_heads;
  // MLA's latent cache (one 576-wide row per token, Hq query heads over it) runs the simple
  // kernel: correct, not fast (a FlashMLA-style kernel is the next step; docs/design.md).
  if (simple || latent || !paged_attention_supported(hd, group, cache.dtype, kp, vp)) {
    launch_attention_paged(q.raw(), q.dtype(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                           batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd, cache.v_dim(),
                           hd, cache.page_size, kp, vp, cache.dtype, ks, vs, softmax_scale, fp8_attention, out.raw(),
                           stream_);
    return;
  }
  const char* forced = std::getenv("FP8RL_CUDA_PAGED_SPLITS");
  const int nforced = forced ? std::atoi(forced) : 0;
  const bool mma = !grouped && !tiled && paged_attention_mma_supported(hd, group, cache.dtype, q.dtype(), kp, vp);
  // max_pos only sizes the split plan: a token past it is still served in full (last split).
  const PagedSplit plan =
      mma ? paged_attention_mma_split(T, cache.num_kv_heads, hd, cache.dtype, batch.max_pos, sm_count_, nforced)
          : paged_attention_split(T, cache.num_kv_heads, batch.max_pos, sm_count_, nforced);
  float* part = nullptr;
  if (plan.splits > 1) part = scratch(kSlotAttn, {T * Hq * plan.splits * (hd + 1)}, DType::F32).data<float>();
  float* part_lse = part ? part + T * Hq * plan.splits * hd : nullptr;
  if (mma) {
    launch_paged_attention_mma(q.raw(), q.dtype(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                               batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd,
                               cache.page_size, kp, vp, cache.dtype, ks, vs, softmax_scale, fp8_attention, plan, part,
                               part_lse, out.raw(), stream_);
    return;
  }
  launch_paged_attention(q.raw(), q.dtype(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                         batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd, cache.page_size,
                         kp, vp, cache.dtype, ks, vs, softmax_scale, fp8_attention, plan, part, part_lse, out.raw(),
                         stream_, grouped);
}

namespace {
// FP8RL_CUDA_SAMPLER=host: sampling runs on the CPU reference on copied-back logits (a
// diagnostic switch; sample_kernels.cu / sample_gumbel_kernels.cu say how results compare).
bool host_sampler_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("FP8RL_CUDA_SAMPLER");
    return e && std::string(e) == "host";
  }();
  return on;
}
}  // namespace

void CudaBackend::sample(const Tensor& logits, const std::vector<float>& temperature, const std::vector<float>& top_p,
                         const std::vector<int>& top_k, const std::vector<float>& uniforms, Tensor& tokens,
                         Tensor& logp, int64_t valid_vocab) {
  const OpTimer op_timer_(*this, "sample");
  check_dev(logits, "sample logits");
  check_dev(tokens, "sample tokens");
  check_dev(logp, "sample logp");
  check_dtype(logits, DType::F32, "sample logits");
  FP8RL_CHECK(logits.ndim() == 2 && logits.dim(1) > 0, "sample logits must be [B, V], got ", logits.str());
  const int64_t B = logits.dim(0), V = logits.dim(1);
  FP8RL_CHECK(valid_vocab >= 0 && valid_vocab <= V, "sample: valid_vocab ", valid_vocab, " must be in [0, V = ", V,
              "] (0: all V)");
  const int64_t Vv = valid_vocab > 0 ? valid_vocab : V;  // sampled ids [0, Vv); rows are V apart
  const auto n = static_cast<size_t>(B);
  FP8RL_CHECK(temperature.size() == n && top_p.size() == n && top_k.size() == n && uniforms.size() == n,
              "sample needs one temperature, top_p, top_k and uniform per row (", B, " rows), got ",
              temperature.size(), ", ", top_p.size(), ", ", top_k.size(), ", ", uniforms.size());
  check_dtype(tokens, DType::I32, "sample tokens");
  check_shape(tokens, {B}, "sample tokens");
  check_dtype(logp, DType::F32, "sample logp");
  check_shape(logp, {B}, "sample logp");
  if (B == 0) return;
  // FP8RL_CUDA_SAMPLER=host: the CPU reference on copied-back logits (a diagnostic switch; the
  // results are the same up to the rounding described in sample_kernels.cu).
  if (host_sampler_enabled()) {
    Tensor hl = to_host(logits);
    Tensor ht = Tensor::empty(tokens.shape(), tokens.dtype()), hp = Tensor::empty(logp.shape(), logp.dtype());
    static std::unique_ptr<Backend> cpu = make_cpu_backend();
    cpu->sample(hl, temperature, top_p, top_k, uniforms, ht, hp, valid_vocab);
    copy(ht, tokens);
    copy(hp, logp);
    return;
  }
  // Parameters: [temperature | top_p | uniform | top_k] as 4 B words, checked as the CPU does.
  std::vector<float> params(4 * n);
  for (size_t b = 0; b < n; ++b) {
    FP8RL_CHECK(std::isfinite(temperature[b]) && temperature[b] >= 0, "sample: temperature of row ", b,
                " must be >= 0, got ", temperature[b]);
    FP8RL_CHECK(top_p[b] > 0 && top_p[b] <= 1, "sample: top_p of row ", b, " must be in (0, 1], got ", top_p[b]);
    FP8RL_CHECK(top_k[b] >= 0, "sample: top_k of row ", b, " must be >= 0, got ", top_k[b]);
    FP8RL_CHECK(uniforms[b] >= 0 && uniforms[b] < 1, "sample: uniform of row ", b, " must be in [0, 1), got ",
                uniforms[b]);
    params[b] = temperature[b];
    params[n + b] = top_p[b];
    params[2 * n + b] = uniforms[b];
    const int32_t k = top_k[b];
    std::memcpy(&params[3 * n + b], &k, sizeof k);
  }
  Tensor pd = scratch(kSlotIdx, {static_cast<int64_t>(4 * n)}, DType::F32);
  CUDA_CHECK(cudaMemcpyAsync(pd.raw(), params.data(), params.size() * sizeof(float), cudaMemcpyHostToDevice, stream_),
             "uploading the sampling parameters");
  const float* p = pd.data<float>();  // no [B, V] scratch: the kernel recomputes keys and weights
  launch_sample(logits.data<float>(), B, V, Vv, p, p + n, reinterpret_cast<const int32_t*>(p + 3 * n), p + 2 * n,
                1, false, tokens.data<int32_t>(), logp.data<float>(), flag_reset(), stream_);
  // Synchronizes: the host-side parameter vector must outlive the upload.
  flag_check("sample: a row of logits holds NaN or +inf, or only -inf");
  flag_drain();
}

void CudaBackend::sample_rows(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens, Tensor& logp,
                              int64_t valid_vocab) {
  const OpTimer op_timer_(*this, "sample");
  check_dev(logits, "sample logits");
  check_dev(rows, "sample_rows rows");
  check_dev(tokens, "sample tokens");
  check_dev(logp, "sample logp");
  check_dtype(logits, DType::F32, "sample logits");
  FP8RL_CHECK(logits.ndim() == 2 && logits.dim(1) > 0, "sample logits must be [B, V], got ", logits.str());
  const int64_t B = logits.dim(0), V = logits.dim(1);
  FP8RL_CHECK(valid_vocab >= 0 && valid_vocab <= V, "sample: valid_vocab ", valid_vocab, " must be in [0, V = ", V,
              "] (0: all V)");
  const int64_t Vv = valid_vocab > 0 ? valid_vocab : V;  // sampled ids [0, Vv); rows are V apart
  check_dtype(rows, DType::I32, "sample_rows rows");
  check_shape(rows, {B, 8}, "sample_rows rows (one SampleRow each)");
  check_dtype(tokens, DType::I32, "sample tokens");
  check_shape(tokens, {B}, "sample tokens");
  check_dtype(logp, DType::F32, "sample logp");
  check_shape(logp, {B}, "sample logp");
  if (B == 0) return;
  if (host_sampler_enabled()) {  // FP8RL_CUDA_SAMPLER=host: the CPU reference (synchronizes: no graphs)
    Tensor ht = Tensor::empty(tokens.shape(), tokens.dtype()), hp = Tensor::empty(logp.shape(), logp.dtype());
    static std::unique_ptr<Backend> cpu = make_cpu_backend();
    cpu->sample_rows(to_host(logits), to_host(rows), truncation, ht, hp, valid_vocab);
    copy(ht, tokens);
    copy(hp, logp);
    return;
  }
  const auto* r = reinterpret_cast<const SampleRow*>(rows.raw());
  const int splits = sample_gumbel_splits(B, V, sm_count_);
  Tensor part = scratch(kSlotTmp, {static_cast<int64_t>(sample_gumbel_scratch_bytes(B, splits))}, DType::U8);
  int* f = flag_reset();
  launch_sample_gumbel(logits.data<float>(), B, V, Vv, r, truncation, splits, part.raw(), tokens.data<int32_t>(),
                       logp.data<float>(), f, stream_);
  if (truncation) {
    const auto* w = reinterpret_cast<const float*>(rows.raw());  // SampleRow's first four words
    launch_sample(logits.data<float>(), B, V, Vv, w, w + 1, reinterpret_cast<const int32_t*>(w + 2), w + 3, 8, true,
                  tokens.data<int32_t>(), logp.data<float>(), f, stream_);
  }
  flag_check("sample: a row of logits holds NaN or +inf, or only -inf, or its parameters are out of range "
             "(temperature >= 0, top_p in (0, 1], top_k >= 0, uniform in [0, 1); top-k / top-p only with "
             "truncation)");
}

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(int device_index, DType act_dtype) {
  return std::make_unique<cuda::CudaBackend>(device_index, act_dtype);
}
std::unique_ptr<Backend> make_cuda_backend(int device_index) { return make_cuda_backend(device_index, DType::BF16); }

}  // namespace fp8rl
