// The CUDA backend (see cuda_backend.h): memory, validation, and the op implementations that
// sequence kernels (kernels.h) and GEMMs (gemm.h) on the backend's one stream.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace fp8rl {

namespace cuda {

namespace {

void check_float(const Tensor& t, const char* what) {
  FP8RL_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, what, " must be F32 or BF16 on the CUDA backend, got ",
              t.str());
}

// [.., K] -> rows of K.
int64_t rows_of(const Tensor& t) { return t.ndim() == 0 ? 1 : t.numel() / std::max<int64_t>(t.dim(-1), 1); }

// The CUDA kernels' own limit: one dtype for all the tensors of a call (the CPU reference reads
// and writes each tensor in its own dtype).
void one_dtype(std::initializer_list<const Tensor*> ts, const char* op) {
  const Tensor& first = **ts.begin();
  for (const Tensor* t : ts)
    FP8RL_CHECK(t->dtype() == first.dtype(), op, ": the CUDA kernels take one dtype for all tensors, got ",
                first.str(), " and ", t->str());
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
  profile_level_ = prof_env && std::string(prof_env) == "2" ? 2 : prof_env && std::string(prof_env) == "1" ? 1 : 0;
  profile_ = profile_level_ > 0;
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
  if (download_) cudaFreeHost(download_);
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
int64_t CudaBackend::row_granule() const { return kFp8RowGranule; }

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

void CudaBackend::copy_impl(const Tensor& src, Tensor& dst) {
  const OpTimer op_timer_(*this, "copy");
  const size_t n = src.nbytes();
  if (n == 0) return;
  const bool sd = src.device() == DeviceKind::CUDA, dd = dst.device() == DeviceKind::CUDA;
  const cudaMemcpyKind kind = sd ? (dd ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                 : (dd ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  if (kind == cudaMemcpyHostToHost) {
    std::memcpy(dst.raw(), src.raw(), n);
    return;
  }
  // Small uploads go through pinned slots, so the host may free its side at once without waiting
  // for the GPU (an MoE block uploads its sorted slots every decode step).
  if (kind == cudaMemcpyHostToDevice && !recording_ && uploads_.upload(src.raw(), dst.raw(), n, stream_)) return;
  // Small downloads (an MoE block's expert ids every decode step) land in a pinned buffer first: a
  // pageable destination makes the driver stage the copy itself, at several times the cost.
  // FP8RL_CUDA_PINNED_DOWNLOADS=0 (read once): the pageable path for them too (an A/B knob).
  static const bool pinned_downloads = [] {
    const char* e = std::getenv("FP8RL_CUDA_PINNED_DOWNLOADS");
    return !(e && std::string(e) == "0");
  }();
  if (kind == cudaMemcpyDeviceToHost && n <= kDownloadBytes && !recording_ && pinned_downloads) {
    if (!download_)
      CUDA_CHECK(cudaMallocHost(&download_, kDownloadBytes), "allocating the pinned download buffer");
    CUDA_CHECK(cudaMemcpyAsync(download_, src.raw(), n, kind, stream_), "copying ", src.str(), " to the host");
    CUDA_CHECK(cudaStreamSynchronize(stream_), "copying ", src.str());
    std::memcpy(dst.raw(), download_, n);
    flag_drain();
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), n, kind, stream_), "copying ", src.str(), " to ", dst.str());
  // Host memory is pageable: wait so the host side may be read or freed on return.
  if (kind != cudaMemcpyDeviceToDevice) {
    CUDA_CHECK(cudaStreamSynchronize(stream_), "copying ", src.str());
    flag_drain();  // errors of earlier ops surface here at the latest
  }
}

void CudaBackend::convert_impl(const Tensor& src, Tensor& dst) {
  const OpTimer op_timer_(*this, "convert");
  if (src.dtype() == dst.dtype()) {
    copy_impl(src, dst);
    return;
  }
  launch_convert(src.raw(), src.dtype(), dst.raw(), dst.dtype(), src.numel(), stream_);
}

void CudaBackend::convert_many_impl(const std::vector<ConvertJob>& jobs) {
  const OpTimer op_timer_(*this, "convert");
  std::vector<const float*> src;
  std::vector<void*> dst;
  std::vector<int64_t> n;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  for (const ConvertJob& j : jobs) {
    if (j.src->dtype() == DType::F32 && j.dst->dtype() == DType::BF16 && j.src->numel() % 8 == 0 &&
        aligned(j.src->raw()) && aligned(j.dst->raw())) {
      src.push_back(j.src->data<float>());
      dst.push_back(j.dst->raw());
      n.push_back(j.src->numel());
    } else {
      convert_impl(*j.src, *j.dst);
    }
  }
  launch_convert_many_f32_bf16(src, dst, n, stream_);
}

void CudaBackend::fill_impl(Tensor& t, float value) {
  const OpTimer op_timer_(*this, "fill");
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

namespace {
double host_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

CudaBackend::OpTimer::OpTimer(CudaBackend& be, const char* op, int level)
    : be_(be.profile_ && !be.recording_ && (level == 0 || level == be.profile_level_) ? &be : nullptr) {
  if (!be_) return;
  if (be_->depth_++ > 0) {  // an op inside an op: counted in the outer one
    be_ = nullptr;
    be.depth_--;
    return;
  }
  Record r;
  r.op = op;
  r.host_start = host_seconds();
  cudaEventCreate(&r.start);
  cudaEventCreate(&r.stop);
  cudaEventRecord(r.start, be_->stream_);
  be_->records_.push_back(r);
}

CudaBackend::OpTimer::~OpTimer() {
  if (!be_) return;
  be_->depth_--;
  Record& r = be_->records_.back();
  cudaEventRecord(r.stop, be_->stream_);
  r.host_ms = (host_seconds() - r.host_start) * 1e3;
  if (be_->records_.size() >= 100000) be_->profile_flush();
}

void CudaBackend::profile_flush() {
  cudaStreamSynchronize(stream_);
  for (auto& r : records_) {
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, r.start, r.stop);
    ProfileTotal& t = profile_totals_[r.op];
    t.calls += 1;
    t.ms += ms;
    t.host_ms += r.host_ms;
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
  std::vector<std::pair<std::string, ProfileTotal>> rows(profile_totals_.begin(), profile_totals_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0.0, host = 0.0;
  for (const auto& r : rows) total += r.second.ms, host += r.second.host_ms;
  std::fprintf(stderr, "cuda op profile%s%s (stream time between each op's start and end events; a CUDA-graph "
                       "replay counts as one op, graph_replay; host: the host's time inside the op, waits "
                       "included): total %.1f ms, host %.1f ms\n",
               title.empty() ? "" : ": ", title.c_str(), total, host);
  for (const auto& r : rows)
    std::fprintf(stderr, "  %-24s %9lld calls %10.2f ms %5.1f%%  %8.1f us/call  host %8.1f us/call\n",
                 r.first.c_str(), static_cast<long long>(r.second.calls), r.second.ms, 100.0 * r.second.ms / total,
                 1000.0 * r.second.ms / r.second.calls, 1000.0 * r.second.host_ms / r.second.calls);
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

void CudaBackend::add_impl(const Tensor& a, const Tensor& b, Tensor& out) {
  const OpTimer op_timer_(*this, "add");
  launch_add(a.raw(), a.dtype(), b.raw(), b.dtype(), out.raw(), out.dtype(), a.numel(), stream_);
}

void CudaBackend::scale_impl(Tensor& x, float s) {
  const OpTimer op_timer_(*this, "scale");
  launch_scale(x.raw(), x.dtype(), x.numel(), s, stream_);
}

double CudaBackend::sum_squares_impl(const Tensor& x) {
  std::vector<double> out(1, 0.0);
  sum_squares_each_impl({&x}, out);
  return out[0];
}

// Every tensor's sum in one multi-tensor launch per 64 tensors (the same deterministic kernels
// for one tensor or thousands: the same values), one read back and one synchronization for all.
void CudaBackend::sum_squares_each_impl(const std::vector<const Tensor*>& xs, std::vector<double>& out) {
  if (xs.empty()) return;
  const OpTimer op_timer_(*this, "sum_squares");
  std::vector<const void*> ptrs;
  std::vector<DType> dtypes;
  std::vector<int64_t> ns;
  for (const Tensor* x : xs) {
    ptrs.push_back(x->raw());
    dtypes.push_back(x->dtype());
    ns.push_back(x->numel());
  }
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor acc = scratch(kSlotState, {n + std::max<int64_t>(1, sum_squares_partials(ns))}, DType::F64);
  double* sums = acc.data<double>();
  launch_sum_squares_many(ptrs, dtypes, ns, sums, sums + n, stream_);
  CUDA_CHECK(cudaMemcpyAsync(out.data(), sums, static_cast<size_t>(n) * sizeof(double), cudaMemcpyDeviceToHost,
                             stream_), "reading the sums");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "sum_squares");
  flag_drain();
}

bool CudaBackend::all_finite_impl(const Tensor& x) {
  const OpTimer op_timer_(*this, "all_finite");
  flag_drain();  // earlier ops' errors first: this op reads its flag itself
  int* f = flag_reset();
  launch_flag_nonfinite(x.raw(), x.dtype(), x.numel(), f, stream_);
  CUDA_CHECK(cudaMemcpyAsync(flag_host_, f, sizeof(int), cudaMemcpyDeviceToHost, stream_), "reading the flag");
  CUDA_CHECK(cudaStreamSynchronize(stream_), "all_finite");
  return *flag_host_ == 0;
}

void CudaBackend::amax_impl(const Tensor& x, Tensor& acc, int64_t i) {
  const OpTimer op_timer_(*this, "amax");
  // Non-negative floats order like their bit patterns: an atomicMax on the bits of |x| into
  // acc[i]'s (>= 0 or NaN); a NaN (bits above +inf's) wins and stays NaN, as the interface asks.
  // No synchronization: the caller reads acc when it needs the values.
  launch_amax(x.raw(), x.dtype(), x.numel(), reinterpret_cast<uint32_t*>(acc.data<float>() + i), stream_);
}

// ---- model ops ---------------------------------------------------------------------------------

void CudaBackend::embedding_impl(const Tensor& ids, const Tensor& table, Tensor& out) {
  const OpTimer op_timer_(*this, "embedding");
  const int64_t T = ids.numel(), V = table.dim(0), D = table.dim(1);
  launch_embedding(ids.data<int32_t>(), T, table.raw(), table.dtype(), V, D, out.raw(), out.dtype(), flag_reset(),
                   stream_);
  flag_check("embedding: a token id is out of range [0, " + std::to_string(V) +
             "); check the tokenizer against the model's vocab_size");
}

void CudaBackend::embedding_backward_impl(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  if (is_bf16_grad(&dtable)) {
    Tensor d32 = grad_widen(*this, &dtable);
    embedding_backward_impl(ids, dout, d32);
    grad_narrow(*this, d32, &dtable);
    return;
  }
  const OpTimer op_timer_(*this, "embedding_backward");
  const int64_t T = ids.numel(), V = dtable.dim(0), D = dtable.dim(1);
  const int64_t sbytes = embedding_backward_scratch_bytes(T);
  Tensor sort = scratch(kSlotSort, {std::max<int64_t>(sbytes, 1)}, DType::U8);
  launch_embedding_backward(ids.data<int32_t>(), T, dout.raw(), dout.dtype(), V, D, dtable.data<float>(),
                            flag_reset(), sort.raw(), sbytes, stream_);
  flag_check("embedding_backward: a token id is out of range [0, " + std::to_string(V) + ")");
}

void CudaBackend::rmsnorm_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd) {
  const OpTimer op_timer_(*this, "rmsnorm");
  const int64_t D = x.dim(-1), R = rows_of(x);
  float* rs = rstd ? rstd->data<float>() : nullptr;
  launch_rmsnorm(x.raw(), x.dtype(), w.raw(), w.dtype(), R, D, eps, out.raw(), out.dtype(), rs, stream_);
}

void CudaBackend::rmsnorm_backward_impl(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                        Tensor& dx, Tensor& dw) {
  if (is_bf16_grad(&dw)) {
    Tensor dw32 = grad_widen(*this, &dw);
    rmsnorm_backward_impl(dout, x, w, rstd, dx, dw32);
    grad_narrow(*this, dw32, &dw);
    return;
  }
  const OpTimer op_timer_(*this, "rmsnorm_backward");
  const int64_t D = x.dim(-1), R = rows_of(x);
  Tensor part = scratch(kSlotColSums, {rmsnorm_backward_partial_rows(R), D}, DType::F32);
  launch_rmsnorm_backward(dout.raw(), dout.dtype(), x.raw(), x.dtype(), w.raw(), w.dtype(), rstd.data<float>(), R, D,
                          dx.raw(), dx.dtype(), dw.data<float>(), part.data<float>(), stream_);
}

// One strided 2-D copy on the stream (rows of `cols` elements at pitches Cs and Cd).
void CudaBackend::copy_cols_impl(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const OpTimer op_timer_(*this, "copy_cols");
  const int64_t cs = src.dim(src.ndim() - 1), cd = dst.dim(dst.ndim() - 1);
  const int64_t R = src.numel() / cs;
  const size_t es = dtype_size(src.dtype());
  if (R == 0 || cols == 0) return;
  CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(dst.raw()) + dst_col * es, cd * es,
                               static_cast<const uint8_t*>(src.raw()) + src_col * es, cs * es, cols * es, R,
                               cudaMemcpyDeviceToDevice, stream_),
             "copying columns of ", src.str(), " to ", dst.str());
}

void CudaBackend::rope_impl(Tensor& x, const Tensor& positions, const RopeParams& rope, bool inverse) {
  // The kernel's own limit: the frequency table it takes by value (both layouts: rotate_half and
  // DeepSeek's interleaved pairs).
  const OpTimer op_timer_(*this, "rope");
  const int64_t T = x.dim(0), H = x.dim(1), hd = x.dim(2);
  FP8RL_CHECK(hd / 2 <= kMaxRopeHalf, "rope: head_dim up to ", 2 * kMaxRopeHalf, " supported, got ", hd);
  RopeTable tab{};
  std::copy(rope.inv_freq.begin(), rope.inv_freq.end(), tab.inv_freq);
  launch_rope(x.raw(), x.dtype(), T, H, hd, positions.data<int32_t>(), tab, rope.attention_scaling, inverse,
              rope.interleaved, stream_);
}

void CudaBackend::swiglu_impl(const Tensor& gate, const Tensor& up, Tensor& out) {
  const OpTimer op_timer_(*this, "swiglu");
  one_dtype({&gate, &up, &out}, "swiglu");
  launch_swiglu(gate.raw(), up.raw(), out.raw(), gate.dtype(), gate.numel(), stream_);
}

void CudaBackend::swiglu_backward_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                       Tensor& dup) {
  const OpTimer op_timer_(*this, "swiglu_backward");
  one_dtype({&dout, &gate, &up, &dgate, &dup}, "swiglu_backward");
  launch_swiglu_backward(dout.raw(), gate.raw(), up.raw(), dgate.raw(), dup.raw(), gate.dtype(), gate.numel(), stream_);
}

// ---- fused producers of FP8 linear inputs ------------------------------------------------------

bool CudaBackend::fp8_view_gemm_layout(int64_t R, int64_t C) const {
  return act_dtype_ == DType::BF16 && R % kFp8RowGranule == 0 && C % kQuantBlock == 0;
}

// The view a fused producer fills for out [R, D] (the contract checked its shape): its scale
// layout chosen, bound to out.
void CudaBackend::fp8_view_prepare(Fp8View& fp8, const Tensor& out) {
  fp8.scales_gemm_layout = fp8_view_gemm_layout(rows_of(out), out.dim(-1));
  fp8.source = out.raw();
}

void CudaBackend::rmsnorm_fp8_impl(const Tensor& x, const Tensor& w, float eps, Tensor& out, Tensor* rstd,
                                   Fp8View& fp8) {
  const OpTimer op_timer_(*this, "rmsnorm_fp8");
  // The fused kernel's own limit: it writes out in x's dtype.
  FP8RL_CHECK(out.dtype() == x.dtype(), "rmsnorm_fp8: x and out must have the same dtype on the CUDA backend");
  float* rs = rstd ? rstd->data<float>() : nullptr;
  fp8_view_prepare(fp8, out);
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

void CudaBackend::rmsnorm_rope_impl(const Tensor& x, const Tensor& w, float eps, const Tensor& positions,
                                    const RopeParams& rope, Tensor& out, Tensor* rstd) {
  {
    const OpTimer op_timer_(*this, "rmsnorm_rope");
    const int64_t T = x.dim(0), H = x.dim(1), hd = x.dim(2);
    RopeTable tab{};
    if (x.dtype() == out.dtype() && hd / 2 <= kMaxRopeHalf) {
      std::copy(rope.inv_freq.begin(), rope.inv_freq.end(), tab.inv_freq);
      if (launch_rmsnorm_rope(x.raw(), x.dtype(), w.raw(), w.dtype(), T, H, hd, eps, out.raw(),
                              rstd ? rstd->data<float>() : nullptr, positions.data<int32_t>(), tab,
                              rope.attention_scaling, rope.interleaved, stream_))
        return;
    }
  }
  Backend::rmsnorm_rope_impl(x, w, eps, positions, rope, out, rstd);  // outside the fused kernel's limits
}

void CudaBackend::add_rmsnorm_impl(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps,
                                   Tensor& out, Tensor* rstd, Fp8View* fp8) {
  const OpTimer op_timer_(*this, "add_rmsnorm");
  // The fused kernel's own limits: one dtype for a, b, sum and out, and out written while sum
  // is read (so no aliasing).
  one_dtype({&a, &b, &sum, &out}, "add_rmsnorm");
  FP8RL_CHECK(out.raw() != sum.raw(), "add_rmsnorm: out must not alias sum on the CUDA backend");
  float* rs = rstd ? rstd->data<float>() : nullptr;
  if (fp8) fp8_view_prepare(*fp8, out);
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

void CudaBackend::swiglu_fp8_impl(const Tensor& gate, const Tensor& up, Tensor& out, Fp8View& fp8) {
  const OpTimer op_timer_(*this, "swiglu_fp8");
  one_dtype({&gate, &up, &out}, "swiglu_fp8");
  fp8_view_prepare(fp8, out);
  const int64_t F = out.dim(-1), R = rows_of(out);
  int* bad = flag_reset();
  if (!launch_swiglu_fp8(gate.raw(), up.raw(), F, out.raw(), out.dtype(), R, F, fp8.q.pow2, fp8.q.data.data<uint8_t>(),
                         fp8.q.scales.data<float>(), fp8.scales_gemm_layout, bad, stream_)) {
    launch_swiglu(gate.raw(), up.raw(), out.raw(), gate.dtype(), gate.numel(), stream_);
    quantize_async(out.reshape({R, F}), false, fp8.q, false, fp8.scales_gemm_layout);
  }
  flag_check("swiglu_fp8: the output " + out.str() + " holds NaN or Inf (FP8 quantization refuses non-finite values)");
}

void CudaBackend::add_fp8_impl(const Tensor& a, const Tensor& b, Tensor& out, Fp8View& fp8) {
  const OpTimer op_timer_(*this, "add_fp8");
  fp8_view_prepare(fp8, out);
  const int64_t D = out.dim(-1), R = rows_of(out);
  int* bad = flag_reset();
  // The fused kernel takes one dtype; anything else is the unfused pair (the same bits).
  const bool one = a.dtype() == out.dtype() && b.dtype() == out.dtype();
  if (!one || !launch_add_fp8(a.raw(), b.raw(), out.raw(), out.dtype(), R, D, fp8.q.pow2, fp8.q.data.data<uint8_t>(),
                              fp8.q.scales.data<float>(), fp8.scales_gemm_layout, bad, stream_)) {
    launch_add(a.raw(), a.dtype(), b.raw(), b.dtype(), out.raw(), out.dtype(), out.numel(), stream_);
    quantize_async(out.reshape({R, D}), false, fp8.q, false, fp8.scales_gemm_layout);
  }
  flag_check("add_fp8: the output " + out.str() + " holds NaN or Inf (FP8 quantization refuses non-finite values)");
}

void CudaBackend::swiglu_backward_fp8_impl(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                                           Tensor& dup, Fp8View& dgate_fp8, Fp8View& dup_fp8) {
  const OpTimer op_timer_(*this, "swiglu_backward_fp8");
  one_dtype({&dout, &gate, &up, &dgate, &dup}, "swiglu_backward_fp8");
  fp8_view_prepare(dgate_fp8, dgate);
  fp8_view_prepare(dup_fp8, dup);
  const int64_t F = dgate.dim(-1), R = rows_of(dgate);
  const bool laid = dgate_fp8.scales_gemm_layout;  // the same for both: one shape
  int* bad = flag_reset();
  if (!launch_swiglu_backward_fp8(dout.raw(), gate.raw(), up.raw(), dgate.raw(), dup.raw(), dgate.dtype(), R, F,
                                  dgate_fp8.q.pow2, dgate_fp8.q.data.data<uint8_t>(), dgate_fp8.q.scales.data<float>(),
                                  dup_fp8.q.data.data<uint8_t>(), dup_fp8.q.scales.data<float>(), laid, bad,
                                  stream_)) {
    launch_swiglu_backward(dout.raw(), gate.raw(), up.raw(), dgate.raw(), dup.raw(), gate.dtype(), gate.numel(),
                           stream_);
    quantize_async(dgate.reshape({R, F}), false, dgate_fp8.q, false, laid);
    quantize_async(dup.reshape({R, F}), false, dup_fp8.q, false, laid);
  }
  flag_check("swiglu_backward_fp8: dgate " + dgate.str() + " or dup holds NaN or Inf (FP8 quantization refuses "
             "non-finite values)");
}

// ---- mixture of experts --------------------------------------------------------------------------

void CudaBackend::moe_route_softmax_impl(const Tensor& logits, int top_k, bool renormalize, Tensor& experts,
                                         Tensor& weights) {
  const OpTimer op_timer_(*this, "moe_route_softmax");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  launch_moe_route_softmax(logits.data<float>(), T, static_cast<int>(E), top_k, renormalize, experts.data<int32_t>(),
                           weights.data<float>(), stream_);
}

void CudaBackend::moe_route_softmax_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                  const Tensor& dweights, Tensor& dlogits) {
  const OpTimer op_timer_(*this, "moe_route_softmax_backward");
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  launch_moe_route_softmax_backward(logits.data<float>(), experts.data<int32_t>(), dweights.data<float>(), T,
                                    static_cast<int>(E), static_cast<int>(k), renormalize, dlogits.data<float>(),
                                    stream_);
}

void CudaBackend::moe_route_sigmoid_impl(const Tensor& logits, const Tensor* bias, int top_k, int n_group,
                                         int topk_group, bool renormalize, float scaling, Tensor& experts,
                                         Tensor& weights) {
  const OpTimer op_timer_(*this, "moe_route_sigmoid");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  launch_moe_route_sigmoid(logits.data<float>(), bias ? bias->data<float>() : nullptr, T, static_cast<int>(E), top_k,
                           n_group, topk_group, renormalize, scaling, experts.data<int32_t>(), weights.data<float>(),
                           stream_);
}

void CudaBackend::moe_route_sigmoid_backward_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                  float scaling, const Tensor& dweights, Tensor& dlogits) {
  const OpTimer op_timer_(*this, "moe_route_sigmoid_backward");
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  launch_moe_route_sigmoid_backward(logits.data<float>(), experts.data<int32_t>(), dweights.data<float>(), T,
                                    static_cast<int>(E), static_cast<int>(k), renormalize, scaling,
                                    dlogits.data<float>(), stream_);
}

void CudaBackend::moe_route_softmax_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                 Tensor& weights) {
  const OpTimer op_timer_(*this, "moe_route_softmax_weights");
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  launch_moe_route_softmax_weights(logits.data<float>(), experts.data<int32_t>(), T, static_cast<int>(E),
                                   static_cast<int>(k), renormalize, weights.data<float>(), flag_reset(), stream_);
  flag_check("moe_route_softmax_weights: an expert id is outside [0, E)");
}

void CudaBackend::moe_route_sigmoid_weights_impl(const Tensor& logits, const Tensor& experts, bool renormalize,
                                                 float scaling, Tensor& weights) {
  const OpTimer op_timer_(*this, "moe_route_sigmoid_weights");
  const int64_t T = logits.dim(0), E = logits.dim(1), k = experts.dim(1);
  launch_moe_route_sigmoid_weights(logits.data<float>(), experts.data<int32_t>(), T, static_cast<int>(E),
                                   static_cast<int>(k), renormalize, scaling, weights.data<float>(), flag_reset(),
                                   stream_);
  flag_check("moe_route_sigmoid_weights: an expert id is outside [0, E)");
}

void CudaBackend::moe_permute_impl(const Tensor& x, const Tensor& row_slot, int top_k, const Tensor* weights,
                                   Tensor& out) {
  const OpTimer op_timer_(*this, "moe_permute");
  one_dtype({&x, &out}, "moe_permute");
  const int64_t T = x.dim(0), D = x.dim(1), R = row_slot.numel();
  launch_moe_permute(x.raw(), x.dtype(), row_slot.data<int32_t>(), weights ? weights->data<float>() : nullptr, R, D,
                     top_k, T * top_k, out.raw(), flag_reset(), stream_);
  flag_check("moe_permute: a row_slot entry is outside [0, T * top_k)");
}

// One strided batched GEMM over the heads (the default ran 2 copies and a product per head, each
// a launch: ~100 launches per MLA layer and decode step, which runs without CUDA graphs).
void CudaBackend::mla_absorb_impl(const Tensor& x, int64_t x_col0, const Tensor& w, int64_t nope, int64_t dv,
                                  bool values, Tensor& out, int64_t out_col0) {
  const bool ok = x.dtype() == w.dtype() && (x.dtype() == DType::BF16 || x.dtype() == DType::F32) &&
                  (out.dtype() == DType::BF16 || out.dtype() == DType::F32);
  if (!ok) {
    Backend::mla_absorb_impl(x, x_col0, w, nope, dv, values, out, out_col0);
    return;
  }
  const OpTimer op_timer_(*this, "mla_absorb");
  const int64_t T = x.dim(0), H = x.dim(1), X = x.dim(2), O = out.dim(2), kvr = w.dim(1), rows = nope + dv;
  const size_t xs = dtype_size(x.dtype()), os = dtype_size(out.dtype());
  const char* xp = static_cast<const char*>(x.raw()) + x_col0 * static_cast<int64_t>(xs);
  char* op = static_cast<char*>(out.raw()) + out_col0 * static_cast<int64_t>(os);
  const char* wp = static_cast<const char*>(w.raw()) + (values ? nope * kvr : 0) * static_cast<int64_t>(xs);
  // Per head h: keys out_h [T, kvr] = x_h [T, nope] W_k [nope, kvr]; values out_h [T, dv] =
  // x_h [T, kvr] W_v^T (W_v [dv, kvr] stored, tb). Rows of x_h and out_h are H * X and H * O apart.
  if (values)
    gemm_->gemm_strided_batched(false, true, T, dv, kvr, xp, H * X, X, wp, kvr, rows * kvr, x.dtype(), op, H * O, O,
                                out.dtype(), H);
  else
    gemm_->gemm_strided_batched(false, false, T, kvr, nope, xp, H * X, X, wp, kvr, rows * kvr, x.dtype(), op, H * O, O,
                                out.dtype(), H);
}

// With x's copy: the BF16 gather, then its rows' FP8 blocks gathered from xq. Otherwise one pass
// writes out and quantizes it (moe_permute's arithmetic, then the row quantizer's).
void CudaBackend::moe_permute_fp8_impl(const Tensor& x, const Fp8View* xq, const Tensor& row_slot, int top_k,
                                       const Tensor* weights, Tensor& out, Fp8View& outq) {
  const int64_t T = x.dim(0), D = x.dim(1), R = row_slot.numel();
  fp8_view_prepare(outq, out);
  uint8_t* q = outq.q.data.data<uint8_t>();
  float* qs = outq.q.scales.data<float>();
  if (xq) {
    moe_permute_impl(x, row_slot, top_k, nullptr, out);
    const OpTimer op_timer_(*this, "moe_permute_fp8");
    int* bad = flag_reset();
    if (!launch_moe_permute_fp8(xq->q.data.data<uint8_t>(), xq->q.scales.data<float>(), xq->scales_gemm_layout, T,
                                row_slot.data<int32_t>(), R, D, top_k, q, qs, outq.scales_gemm_layout, bad, stream_))
      quantize_async(out, false, outq.q, false, outq.scales_gemm_layout);
    flag_check("moe_permute_fp8: a row_slot entry is outside [0, T * top_k), or the output holds NaN or Inf");
    return;
  }
  const OpTimer op_timer_(*this, "moe_permute_fp8");
  one_dtype({&x, &out}, "moe_permute_fp8");
  int* bad = flag_reset();
  if (!launch_moe_permute_quant(x.raw(), x.dtype(), row_slot.data<int32_t>(), weights ? weights->data<float>() : nullptr,
                                T, R, D, top_k, out.raw(), outq.q.pow2, q, qs, outq.scales_gemm_layout, bad, stream_)) {
    launch_moe_permute(x.raw(), x.dtype(), row_slot.data<int32_t>(), weights ? weights->data<float>() : nullptr, R, D,
                       top_k, T * top_k, out.raw(), bad, stream_);
    quantize_async(out, false, outq.q, false, outq.scales_gemm_layout);
  }
  flag_check("moe_permute_fp8: a row_slot entry is outside [0, T * top_k), or the output holds NaN or Inf");
}

void CudaBackend::moe_unpermute_impl(const Tensor& y, const Tensor& slot_row, const Tensor* weights, Tensor& out) {
  const OpTimer op_timer_(*this, "moe_unpermute");
  one_dtype({&y, &out}, "moe_unpermute");
  const int64_t R = y.dim(0), D = y.dim(1), T = out.dim(0), S = slot_row.numel();
  launch_moe_unpermute(y.raw(), y.dtype(), slot_row.data<int32_t>(), weights ? weights->data<float>() : nullptr, T, D,
                       static_cast<int>(S / T), R, out.raw(), flag_reset(), stream_);
  flag_check("moe_unpermute: a slot_row entry is outside [0, R)");
}

void CudaBackend::moe_unpermute_backward_weights_impl(const Tensor& dout, const Tensor& y, const Tensor& slot_row,
                                                      Tensor& dweights) {
  const OpTimer op_timer_(*this, "moe_unpermute_backward_weights");
  one_dtype({&dout, &y}, "moe_unpermute_backward_weights");
  const int64_t R = y.dim(0), D = y.dim(1), T = dout.dim(0), S = slot_row.numel();
  launch_moe_weight_grad(dout.raw(), y.raw(), y.dtype(), slot_row.data<int32_t>(), S, D, static_cast<int>(S / T), R,
                         dweights.data<float>(), flag_reset(), stream_);
  flag_check("moe_unpermute_backward_weights: a slot_row entry is outside [0, R)");
}

void CudaBackend::moe_plan_impl(const Tensor& experts, int64_t num_experts, int block_m, Tensor& offsets,
                                Tensor& row_slot, Tensor& slot_row, Tensor& tiles, Tensor& tile_count) {
  const OpTimer op_timer_(*this, "moe_plan");
  launch_moe_plan(experts.data<int32_t>(), experts.numel(), static_cast<int>(num_experts), block_m,
                  offsets.data<int32_t>(), row_slot.data<int32_t>(), slot_row.data<int32_t>(), tiles.data<int32_t>(),
                  tiles.dim(0), tile_count.data<int32_t>(), flag_reset(), stream_);
  flag_check("moe_plan: an expert id is outside [0, " + std::to_string(num_experts) + ")");
}

void CudaBackend::adamw_impl(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  adamw_many_impl({{&param, &grad, &m, &v, p}});
}

// Runs of jobs that share the launch's scalars (every AdamWParams field but the weight decay and
// the rounding key, which each tensor carries) and dtypes go to launch_adamw_many together: the
// trainer's step is one run of up to 64 tensors per launch.
void CudaBackend::adamw_many_impl(const std::vector<AdamWJob>& jobs) {
  const OpTimer op_timer_(*this, "adamw");
  auto same_launch = [](const AdamWJob& a, const AdamWJob& b) {
    return a.grad->dtype() == b.grad->dtype() && a.m->dtype() == b.m->dtype() && a.p.lr == b.p.lr &&
           a.p.beta1 == b.p.beta1 && a.p.beta2 == b.p.beta2 && a.p.eps == b.p.eps && a.p.step == b.p.step &&
           a.p.grad_scale == b.p.grad_scale && a.p.stochastic_rounding == b.p.stochastic_rounding;
  };
  for (size_t first = 0; first < jobs.size();) {
    size_t end = first + 1;
    while (end < jobs.size() && same_launch(jobs[first], jobs[end])) ++end;
    const AdamWParams& p = jobs[first].p;
    const AdamWScalars sc = adamw_scalars(p.lr, p.beta1, p.beta2, p.eps, 0.0f, p.step, p.grad_scale);
    std::vector<AdamWTensor> ts;
    for (size_t i = first; i < end; ++i) {
      const AdamWJob& j = jobs[i];
      ts.push_back({j.param->data<float>(), j.grad->raw(), j.m->raw(), j.v->raw(), j.param->numel(),
                    adamw_scalars(j.p.lr, j.p.beta1, j.p.beta2, j.p.eps, j.p.weight_decay, j.p.step, j.p.grad_scale)
                        .decay,
                    j.p.rounding_key});
    }
    launch_adamw_many(ts, jobs[first].grad->dtype(), jobs[first].m->dtype(), sc, p.stochastic_rounding, p.step,
                      stream_);
    first = end;
  }
}

// ---- quantization ---------------------------------------------------------------------------

// quantize_async is the CUDA backend's own entry (the GEMMs' operands, pad_cols, gemm_layout; the
// tests call it directly), so it checks its layout itself; quantize() came through the contract.
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

void CudaBackend::quantize_impl(const Tensor& x, bool transpose, QuantTensor& out, bool deferred) {
  // Named apart: the trainer's per-step W^T copies (LinearWeight wqt) are the transposed ones.
  const OpTimer op_timer_(*this, transpose ? "quantize (transposed)" : "quantize");
  flag_reset();
  quantize_async(x, transpose, out);
  flag_check("quantize: the input " + x.str() +
             " holds NaN or Inf; FP8 quantization refuses non-finite values (check the loss scale / learning rate)");
  // The explicit op (refit, tests) reports at once; deferred, at the next synchronizing call (a
  // stream synchronization each cost the MoE trainer's ~4,600 per-step expert copies ~25 us each).
  if (!deferred) flag_drain();
}

// Weights whose rows are whole aligned 16-byte chunks go to launch_quantize_weights, batched by
// dtype and pow2 (the trainer's weights: one run of F32 masters); any other takes quantize_impl.
// One deferred flag per batch: the first NaN/Inf weight reports at the next synchronization.
void CudaBackend::quantize_weights_impl(const std::vector<WeightQuantJob>& jobs) {
  const OpTimer op_timer_(*this, "quantize_weights");
  std::map<std::pair<DType, bool>, std::vector<WeightQuantTensor>> batches;
  for (const WeightQuantJob& j : jobs) {
    const Tensor& w = *j.w;
    const bool vec = (w.dtype() == DType::F32 || w.dtype() == DType::BF16) && w.dim(1) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(w.raw()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(j.q->data.raw()) % 16 == 0 && (!j.qt || j.qt->pow2 == j.q->pow2);
    if (!vec) {
      quantize_impl(w, false, *j.q, true);
      if (j.qt) quantize_impl(w, true, *j.qt, true);
      continue;
    }
    batches[{w.dtype(), j.q->pow2}].push_back({w.raw(), w.dim(0), w.dim(1), j.q->data.data<uint8_t>(),
                                               j.q->scales.data<float>(),
                                               j.qt ? j.qt->data.data<uint8_t>() : nullptr,
                                               j.qt ? j.qt->scales.data<float>() : nullptr});
  }
  for (const auto& [key, ws] : batches) {
    int* flag = flag_reset();
    launch_quantize_weights(ws, key.first, key.second, flag, stream_);
    flag_check("quantize_weights: one of " + std::to_string(ws.size()) + " " + dtype_name(key.first) +
               " weights holds NaN or Inf; FP8 quantization refuses non-finite values (check the loss scale / "
               "learning rate)");
  }
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
  c.fp8_gemm_lt_fixed = lt_fixed_products_;
  c.grouped_loops = grouped_loops_;
  c.paged_runs_off = paged_runs_off_;
  c.concat_products = concat_products_;
  const GemmEngine::TuneStats t = gemm_->tune_stats();
  c.gemm_tuned = t.products, c.gemm_tuned_changed = t.changed, c.gemm_tune_ms = t.ms;
  const GemmEngine::TuneStats h = gemm_->heuristic_stats();
  c.gemm_heuristics = h.products, c.gemm_heuristic_ms = h.ms;
  return c;
}

void CudaBackend::mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const Tensor& A, const Tensor& B, DType ab,
                     Tensor& C, float beta, bool row_invariant) {
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
    gemm_->gemm(ta, tb, M, N, K, a->raw(), b->raw(), ab, c32.raw(), DType::F32, 1.0f, beta, row_invariant);
    launch_convert(c32.raw(), DType::F32, C.raw(), C.dtype(), C.numel(), stream_);
    return;
  }
  gemm_->gemm(ta, tb, M, N, K, a->raw(), b->raw(), ab, C.raw(), C.dtype(), 1.0f, beta, row_invariant);
}

// x [M, K]'s 1x128 quantization: the view's when given (a fused producer's copy), else x
// quantized into the A scratch (`what`: its profile name), scales in the GEMM layout when laid.
QuantTensor CudaBackend::quantized_rows(const Tensor& x, const Fp8View* view, bool pow2, bool laid, const char* what) {
  if (view) return view->q;
  const OpTimer t(*this, what, 2);
  QuantTensor q = scratch_quant(kSlotAq, kSlotAs, x.dim(0), x.dim(1), 1, pow2);
  quantize_async(x, false, q, false, /*gemm_layout=*/laid);
  return q;
}

// W's 128x128 quantization: W.wq when defined, else W.w quantized into the B scratch.
QuantTensor CudaBackend::quantized_weight(const LinearWeight& W, bool pow2) {
  if (W.wq.defined()) return W.wq;
  const OpTimer t(*this, "linear: quantize W", 2);
  QuantTensor q = scratch_quant(kSlotBq, kSlotBs, W.w.dim(0), W.w.dim(1), kQuantBlock, pow2);
  quantize_async(W.w, false, q);
  return q;
}

void CudaBackend::linear_fwd(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                             const Fp8View* x_view) {
  const int64_t M = x.dim(0), K = x.dim(1), N = W.out_features();
  if (spec.mode != LinearMode::FP8_BLOCK) {
    const OpTimer t(*this, spec.mode == LinearMode::FP32 ? "linear: FP32 GEMM" : "linear: BF16 GEMM", 2);
    mm(false, true, M, N, K, x, W.w, spec.mode == LinearMode::FP32 ? DType::F32 : DType::BF16, out, 0.0f,
       spec.consistent);
  } else if (spec.consistent) {
    linear_fwd_fp8_consistent(x, W, spec, out, x_view);
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
    const QuantTensor xq = quantized_rows(x, use_view ? x_view : nullptr, spec.pow2_scales, laid, "linear: quantize x");
    const QuantTensor wq = quantized_weight(W, spec.pow2_scales);  // the generator's, or the trainer's cache
    if (quantizes)
      flag_check(use_view ? "linear (FP8): the weight holds NaN or Inf"
                          : "linear (FP8): the input " + x.str() + " or the weight holds NaN or Inf");
    if (tc) {
      const OpTimer t(*this, "linear: FP8 GEMM", 2);
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
  if (W.bias.defined()) launch_add_bias(out.raw(), out.dtype(), W.bias.raw(), W.bias.dtype(), M, N, stream_);
}

// BF16 / FP32 products (no bias, operands already of the GEMM's dtype) straight into the column
// range: the GEMM's output row stride is out's width (gemm's ldc), its algorithm the one of a
// [M, N] output, so the bits are linear()'s. The others: the default (linear, then copy_cols).
void CudaBackend::linear_cols_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                                   int64_t col0) {
  const int64_t M = x.dim(0), K = x.dim(1), N = W.out_features();
  const DType ab = spec.mode == LinearMode::FP32 ? DType::F32 : DType::BF16;
  const size_t esz = dtype_size(out.dtype());
  // 16-byte aligned column start and row stride: the alignment the algorithm was chosen for.
  if (spec.mode == LinearMode::FP8_BLOCK || W.bias.defined() || x.dtype() != ab || W.w.dtype() != ab ||
      (ab == DType::F32 && out.dtype() != DType::F32) || (static_cast<size_t>(col0) * esz) % 16 != 0 ||
      (static_cast<size_t>(out.dim(1)) * esz) % 16 != 0) {
    Backend::linear_cols_impl(x, W, spec, out, col0);
    return;
  }
  const OpTimer op_timer_(*this, "linear", 1);
  char* c = static_cast<char*>(out.raw()) + static_cast<size_t>(col0) * esz;
  gemm_->gemm(false, true, M, N, K, x.raw(), W.w.raw(), ab, c, out.dtype(), 1.0f, 0.0f, spec.consistent, out.dim(1));
}

// The consistent head: its whole chunks as one GEMM (the chunks' row-invariant algorithm over all
// their columns: every chunk's CTAs at once, where one launch per 4096-column chunk at decode M
// fills a few SMs), the shorter last chunk as its own product, where a probe found the one GEMM
// the chunked products' bits: once per (chunk, columns, K, dtypes), on seeded random rows against
// the real weights, outside graph captures (until then, and where it fails or cuBLASLt refuses
// the wide launch: the chunked products).
void CudaBackend::linear_chunked_impl(const Tensor& x, const Tensor& w, const LinearSpec& spec, int64_t chunk,
                                      Tensor& out) {
  const int64_t M = x.dim(0), K = x.dim(1), V = w.dim(0), whole = V / chunk * chunk;
  const DType ab = spec.mode == LinearMode::FP32 ? DType::F32 : DType::BF16;
  const size_t esz = dtype_size(out.dtype());
  if (!spec.consistent || spec.mode == LinearMode::FP8_BLOCK || x.dtype() != ab || w.dtype() != ab ||
      (ab == DType::F32 && out.dtype() != DType::F32) || whole < 2 * chunk || M == 0 ||
      (static_cast<size_t>(V) * esz) % 16 != 0 || (static_cast<size_t>(chunk) * esz) % 16 != 0) {
    Backend::linear_chunked_impl(x, w, spec, chunk, out);
    return;
  }
  const auto key = std::make_tuple(chunk, whole, K, static_cast<int>(ab), static_cast<int>(out.dtype()));
  auto it = chunked_one_gemm_.find(key);
  if (it == chunked_one_gemm_.end()) {
    if (stream_capturing(stream_)) {
      Backend::linear_chunked_impl(x, w, spec, chunk, out);
      return;
    }
    const OpTimer op_timer_(*this, "linear_chunked: probe", 1);
    // 64 seeded random rows (both products run one algorithm for every M), each chunk's product
    // into its columns as linear_cols computes it, and the one GEMM; compared bit for bit.
    constexpr int64_t pm = 64;
    std::vector<float> hx(static_cast<size_t>(pm * K));
    uint32_t r = 0x2545f491u;
    for (float& v : hx) {
      r = r * 1664525u + 1013904223u;
      v = static_cast<float>(static_cast<int32_t>(r >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
    }
    Tensor xp = to_device(from_float_vector(hx, {pm, K}, ab));
    Tensor ref = alloc({pm, whole}, out.dtype()), one = alloc({pm, whole}, out.dtype());
    bool same = false;
    try {
      for (int64_t v0 = 0; v0 < whole; v0 += chunk)
        gemm_->gemm(false, true, pm, chunk, K, xp.raw(), static_cast<const char*>(w.raw()) + v0 * K * dtype_size(ab),
                    ab, static_cast<char*>(ref.raw()) + static_cast<size_t>(v0) * esz, out.dtype(), 1.0f, 0.0f, true,
                    whole);
      gemm_->gemm(false, true, pm, whole, K, xp.raw(), w.raw(), ab, one.raw(), out.dtype(), 1.0f, 0.0f, true, 0, chunk);
      std::vector<char> a(ref.nbytes()), b(one.nbytes());
      CUDA_CHECK(cudaMemcpyAsync(a.data(), ref.raw(), a.size(), cudaMemcpyDeviceToHost, stream_),
                 "linear_chunked probe: download");
      CUDA_CHECK(cudaMemcpyAsync(b.data(), one.raw(), b.size(), cudaMemcpyDeviceToHost, stream_),
                 "linear_chunked probe: download");
      CUDA_CHECK(cudaStreamSynchronize(stream_), "linear_chunked probe");
      same = std::memcmp(a.data(), b.data(), a.size()) == 0;
    } catch (const Error&) {  // cuBLASLt refused a launch: the chunked products
      same = false;
    }
    it = chunked_one_gemm_.emplace(key, same).first;
  }
  if (!it->second) {
    Backend::linear_chunked_impl(x, w, spec, chunk, out);
    return;
  }
  const OpTimer op_timer_(*this, "linear", 1);
  gemm_->gemm(false, true, M, whole, K, x.raw(), w.raw(), ab, out.raw(), out.dtype(), 1.0f, 0.0f, true, V, chunk);
  if (whole < V) {
    LinearWeight last;
    last.w = w.slice_rows(whole, V);
    linear_cols_impl(x, last, spec, out, whole);
  }
}

// The consistent mode's FP8 forward product: every row computed the same way whatever M. With BF16
// activations the own sm_90a kernel at one split (row-invariant: fp8_gemm.h; any M, no tail
// product, either scale layout of a view); where it does not take the shape (N or K not a
// multiple of 16) and on the exact path (F32 activations), the dequantized operands' FP32 GEMM on
// one cuBLASLt algorithm for every M. The quantized operands are those of the other paths.
void CudaBackend::linear_fwd_fp8_consistent(const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                                            Tensor& out, const Fp8View* x_view) {
  const int64_t M = x.dim(0), K = x.dim(1), N = W.out_features();
  const bool own = act_dtype_ != DType::F32 && fp8_gemm_sm90_supported(M, N, K);
  if (!own && act_dtype_ != DType::F32) (void)fp8_tensor_cores(M, N, K);  // counted and reported as a fallback
  // The dequantize path reads row-major scales: a view in the GEMM layout is quantized again there.
  const bool use_view = x_view && (own || !x_view->scales_gemm_layout);
  const bool quantizes = !use_view || !W.wq.defined();
  if (quantizes) flag_reset();
  const QuantTensor xq = quantized_rows(x, use_view ? x_view : nullptr, spec.pow2_scales, false, "linear: quantize x");
  const QuantTensor wq = quantized_weight(W, spec.pow2_scales);
  if (quantizes)
    flag_check(use_view ? "linear (FP8): the weight holds NaN or Inf"
                        : "linear (FP8): the input " + x.str() + " or the weight holds NaN or Inf");
  const bool laid = use_view && x_view->scales_gemm_layout;
  // Above decode sizes (the trainer's micro-batches, prefill chunks): cuBLASLt's block-scaled
  // kernel on its algorithm fixed for every M where a probe found it bitwise the own kernel at one
  // split (GemmEngine::fp8_lt_is_own: at every 1.7B product on the H200), ~1.5x the own kernel's
  // rate there; the rows stay the bits of every other M either way.
  // The fewest rows that take it: 257, or 192 for the wide products (N >= 8192: the 1.7B gate|up,
  // 22.9 us on the own kernel against 16.6 on cuBLASLt at 256 rows, equal at 64: H100, session 19);
  // the narrower decode products (o, down, q|k|v) stay on the own kernel's 64-column tiles, which
  // need no split-K there. FP8RL_CONSISTENT_LT_ROWS (read once) sets one threshold for every
  // product (an experiment's knob: 1 puts every decode product on it).
  static const int64_t lt_rows_env = [] {
    const char* e = std::getenv("FP8RL_CONSISTENT_LT_ROWS");
    if (!e) return int64_t{0};
    char* end = nullptr;
    const long long v = std::strtoll(e, &end, 10);
    FP8RL_CHECK(end != e && *end == 0 && v >= 1, "FP8RL_CONSISTENT_LT_ROWS must be a row count >= 1, got '", e,
                "'; unset it for the default (257, or 192 for N >= 8192)");
    return static_cast<int64_t>(v);
  }();
  const int64_t lt_rows = lt_rows_env > 0 ? lt_rows_env : N >= 8192 ? 192 : 257;
  if (own && M >= lt_rows && gemm_->fp8_lt_is_own(N, K, out.dtype())) {
    const OpTimer t(*this, "linear: FP8 GEMM", 2);
    gemm_->gemm_fp8(M, N, K, xq.data.data<uint8_t>(), xq.scales.data<float>(), wq.data.data<uint8_t>(),
                    wq.scales.data<float>(), kQuantBlock, out.raw(), out.dtype(), 1.0f, 0.0f,
                    laid && M % kFp8RowGranule == 0, /*row_invariant=*/true);
    ++lt_fixed_products_;
    return;
  }
  if (own) {
    const OpTimer t(*this, "linear: FP8 GEMM", 2);
    // Decode-sized products whose 128-column tiles would not fill the SMs twice over (o, down,
    // q|k|v at the 1.7B width) take 64-column tiles: twice the CTAs at one split, each element's
    // arithmetic unchanged (fp8_gemm.h block_n), so rows stay the bits of every other M.
    const bool narrow = M <= 256 && (M + 63) / 64 * ((N + 127) / 128) <= 2 * static_cast<int64_t>(sm_count_);
    gemm_->gemm_fp8_own(M, N, K, xq.data.data<uint8_t>(), xq.scales.data<float>(), laid, wq.data.data<uint8_t>(),
                        wq.scales.data<float>(), out.raw(), out.dtype(), 1.0f, 0.0f, /*splits=*/1, /*block_m=*/0,
                        narrow ? 64 : 0);
    return;
  }
  Tensor xf = scratch(kSlotA, {M, K}, DType::F32), wf = scratch(kSlotB, {N, K}, DType::F32);
  launch_dequantize(xq.data.data<uint8_t>(), xq.scales.data<float>(), M, K, 1, kQuantBlock, xf.raw(), DType::F32,
                    stream_);
  launch_dequantize(wq.data.data<uint8_t>(), wq.scales.data<float>(), N, K, kQuantBlock, kQuantBlock, wf.raw(),
                    DType::F32, stream_);
  mm(false, true, M, N, K, xf, wf, DType::F32, out, 0.0f, /*row_invariant=*/true);
}

void CudaBackend::linear_impl(const Tensor& x, const LinearWeight& W, const LinearSpec& spec, Tensor& out,
                              const Fp8View* x_fp8) {
  const OpTimer op_timer_(*this, "linear", 1);
  const int64_t K = W.in_features(), N = W.out_features(), M = rows_of(x);
  Tensor x2 = x.reshape({M, K}), o2 = out.reshape({M, N});
  linear_fwd(x2, W, spec, o2, x_fp8);  // x_fp8: FP8_BLOCK only (the contract drops it otherwise)
}

namespace {
// b's rows follow a's in one buffer (same storage, dtype and width, b right after a).
bool rows_follow(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.storage() == b.storage() && a.dtype() == b.dtype() && a.ndim() == 2 &&
         b.ndim() == 2 && a.dim(1) == b.dim(1) && b.offset_bytes() == a.offset_bytes() + a.nbytes();
}
// The rows of t and of the `rows` rows that follow it, as one tensor.
Tensor rows_through(const Tensor& t, int64_t rows) {
  return Tensor(t.storage(), t.offset_bytes(), {rows, t.dim(1)}, t.dtype());
}
}  // namespace

// Whether W are consecutive row blocks of one buffer (the generator allocates q|k|v and gate|up
// so: rollout/generator_weights.cpp) in the form `spec` reads (FP8: wq, 128-row aligned so the
// scale rows follow too; else w), without biases; then `cat` is the concatenated weight.
bool CudaBackend::concatenated(const std::vector<const LinearWeight*>& W, const LinearSpec& spec, LinearWeight& cat) {
  if (W.size() < 2) return false;
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  int64_t rows = 0;
  for (size_t i = 0; i < W.size(); ++i) {
    const LinearWeight& w = *W[i];
    if (w.bias.defined() || (fp8 ? !w.wq.defined() : !w.w.defined())) return false;
    if (fp8 && (w.wq.block_rows != kQuantBlock || w.wq.pow2 != spec.pow2_scales || w.wq.rows() % kQuantBlock != 0))
      return false;
    if (i > 0) {
      const LinearWeight& p = *W[i - 1];
      if (fp8 ? !(rows_follow(p.wq.data, w.wq.data) && rows_follow(p.wq.scales, w.wq.scales)) : !rows_follow(p.w, w.w))
        return false;
    }
    rows += w.out_features();
  }
  cat = LinearWeight{};
  if (fp8) {
    cat.wq = W[0]->wq;
    cat.wq.data = rows_through(W[0]->wq.data, rows);
    cat.wq.scales = rows_through(W[0]->wq.scales, rows / kQuantBlock);
  } else {
    cat.w = rows_through(W[0]->w, rows);
  }
  return true;
}

// Whether the weights W (consecutive rows of one buffer) run as one product `cat` on x's M rows:
// at decode-sized M (<= kCatMaxRows), BF16 activations, a BF16 or FP8 product on the fast path.
// In the consistent mode FP8 only: the own kernel computes each output column from its own
// weight row and 128-row scale block alone (the weights are 128-row aligned), so the wider
// product is bitwise the separate ones the trainer runs; cuBLASLt's BF16 algorithm may differ by N.
bool CudaBackend::concatenated_product(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                       const LinearSpec& spec, LinearWeight& cat) {
  const int64_t K = W[0]->in_features(), M = rows_of(x);
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  if (!((!spec.consistent || fp8) && act_dtype_ != DType::F32 && spec.mode != LinearMode::FP32 && M > 0 &&
        M <= kCatMaxRows && static_cast<int>(W.size()) <= kSplitColsMax && concatenated(W, spec, cat)))
    return false;
  const int64_t N = cat.out_features();
  // Row-invariant cuBLASLt FP8 (GemmEngine::set_fp8_row_invariant) fixes one algorithm per N: the
  // wider product's columns need not be the separate products' bits (the trainer's, at its M).
  if (fp8 && !spec.consistent && gemm_->fp8_row_invariant()) return false;
  return !fp8 || (spec.consistent ? fp8_gemm_sm90_supported(M, N, K) : fp8_tensor_cores(M, N, K));
}

// The outputs' columns of a concatenated product y [M, sum N] (one kernel), counted.
void CudaBackend::split_concatenated(const Tensor& y, const std::vector<const LinearWeight*>& W,
                                     const std::vector<Tensor*>& outs) {
  SplitColsArgs a;
  const int64_t es = static_cast<int64_t>(dtype_size(y.dtype()));
  int64_t end = 0;
  for (size_t i = 0; i < W.size(); ++i) {
    end += W[i]->out_features() * es;
    a.out[a.n] = outs[i]->raw(), a.end[a.n] = end, ++a.n;
  }
  const OpTimer t(*this, "linear: split the concatenated output", 2);
  launch_split_cols(y.raw(), y.dim(0), a, stream_);
  ++concat_products_;
}

// Concatenated weights (above) at decode-sized M (<= kCatMaxRows: where the separate products
// are latency-bound) run as ONE product into a scratch [M, sum N], split into the outputs by one
// kernel: q/k/v and gate/up each one launch instead of 2-3. The products are those of the
// separate weights (same quantized operands; the GEMM of the wider N may order its sums
// differently within the linear class's tolerance). Otherwise FP8: x quantized once for every
// weight when all of them take the tensor cores, or not at all when a fused producer gave its
// FP8 copy (x_fp8); the products are then exactly those of separate linear() calls.
void CudaBackend::linear_shared_input_impl(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                           const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                           const Fp8View* x_fp8) {
  bool shared = spec.mode == LinearMode::FP8_BLOCK;
  const int64_t K = W[0]->in_features(), M = rows_of(x);
  LinearWeight cat;
  if (concatenated_product(x, W, spec, cat)) {
    bool same_dtype = true;
    for (const Tensor* o : outs) same_dtype = same_dtype && o->dtype() == outs[0]->dtype();
    const int64_t N = cat.out_features();
    if (same_dtype) {
      const OpTimer op_timer_(*this, "linear", 1);
      const Tensor x2 = x.reshape({M, K});
      Tensor y = scratch(kSlotCat, {M, N}, outs[0]->dtype());
      linear_fwd(x2, cat, spec, y, x_fp8);
      split_concatenated(y, W, outs);
      return;
    }
  }
  for (const LinearWeight* w : W) shared = shared && w->in_features() == K;
  if (shared)
    for (const LinearWeight* w : W) shared = shared && GemmEngine::fp8_supported(M, w->out_features(), K);
  if (!shared || act_dtype_ == DType::F32) {
    Backend::linear_shared_input_impl(x, W, spec, outs, x_fp8);
    return;
  }
  const OpTimer op_timer_(*this, "linear", 1);
  const Tensor x2 = x.reshape({M, K});
  Fp8View view;
  if (x_fp8) {
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
    Tensor o2 = out.reshape({M, N});
    linear_fwd(x2, *W[i], spec, o2, &view);
  }
}

// q|k|v as one product at decode sizes (concatenated_product) whose rows one kernel norms, rotates
// and splits into q, k and v (launch_qkv_norm_rope): one launch instead of the split and two
// rmsnorm_rope. When q_raw and k_raw must be kept (the backward's inputs), or off that path, the
// default: linear_shared_input then rmsnorm_rope twice.
void CudaBackend::linear_qkv_norm_rope_impl(const Tensor& x, const std::vector<const LinearWeight*>& W,
                                            const LinearSpec& spec, const Tensor& q_norm, const Tensor& k_norm,
                                            float eps, const Tensor& positions, const RopeParams& rope, bool keep,
                                            Tensor& q_raw, Tensor& k_raw, Tensor& q, Tensor& k, Tensor& v,
                                            Tensor* q_rstd, Tensor* k_rstd, const Fp8View* x_fp8,
                                            const KvDest* kv) {
  const int64_t K = W[0]->in_features(), M = rows_of(x), hd = q.dim(2);
  LinearWeight cat;
  const DType dt = q.dtype();
  const bool one_dtype = q_raw.dtype() == dt && k_raw.dtype() == dt && v.dtype() == dt && k.dtype() == dt &&
                         q_norm.dtype() == k_norm.dtype() && hd / 2 <= kMaxRopeHalf;
  if (!keep && one_dtype && concatenated_product(x, W, spec, cat)) {
    Tensor y = scratch(kSlotCat, {M, cat.out_features()}, dt);
    {
      const OpTimer op_timer_(*this, "linear", 1);
      linear_fwd(x.reshape({M, K}), cat, spec, y, x_fp8);
    }
    const OpTimer op_timer_(*this, "qkv_norm_rope");  // the q|k|v split with both rmsnorm_rope (+ the cache write)
    RopeTable tab{};
    std::copy(rope.inv_freq.begin(), rope.inv_freq.end(), tab.inv_freq);
    QkvCacheWrite cw;  // kv: the cache write in the same kernel
    DType pool_dt = dt;
    if (kv) {
      const KvCache& c = *kv->cache;
      cw.slots = kv->batch->slots.data<int32_t>();
      cw.kpool = c.k[kv->layer].raw();
      cw.vpool = c.v[kv->layer].raw();
      cw.k_scale = c.k_scale.data<float>() + static_cast<int64_t>(kv->layer) * c.num_kv_heads;
      cw.v_scale = c.v_scale.data<float>() + static_cast<int64_t>(kv->layer) * c.num_kv_heads;
      pool_dt = c.dtype;
    }
    if (launch_qkv_norm_rope(y.raw(), dt, q_norm.raw(), k_norm.raw(), q_norm.dtype(), M, q.dim(1), k.dim(1), hd, eps,
                             q.raw(), k.raw(), v.raw(), q_rstd ? q_rstd->data<float>() : nullptr,
                             k_rstd ? k_rstd->data<float>() : nullptr, positions.data<int32_t>(), tab,
                             rope.attention_scaling, rope.interleaved, stream_, cw, pool_dt)) {
      ++concat_products_;
      return;
    }
    // Outside the kernel's limits (head_dim, alignment, pool dtype): the product is in y; split it.
    split_concatenated(y, W, {&q_raw, &k_raw, &v});
    rmsnorm_rope_impl(q_raw.reshape(q.shape()), q_norm, eps, positions, rope, q, q_rstd);
    rmsnorm_rope_impl(k_raw.reshape(k.shape()), k_norm, eps, positions, rope, k, k_rstd);
    if (kv) kv_write_impl(*kv->cache, kv->layer, k, v.reshape(k.shape()), *kv->batch);
    return;
  }
  Backend::linear_qkv_norm_rope_impl(x, W, spec, q_norm, k_norm, eps, positions, rope, keep, q_raw, k_raw, q, k, v,
                                     q_rstd, k_rstd, x_fp8, kv);
}

// gate|up as one product at decode sizes (concatenated_product) whose two halves the swiglu reads
// in place (rows of 2F): no split of the output. When gate and up must be kept (the backward's
// inputs), or off that path, the default: linear_shared_input then swiglu(_fp8).
void CudaBackend::linear_swiglu_impl(const Tensor& x, const LinearWeight& gate_w, const LinearWeight& up_w,
                                     const LinearSpec& spec, Tensor& gate, Tensor& up, bool keep, Tensor& act,
                                     Fp8View* act_fp8, const Fp8View* x_fp8) {
  LinearWeight cat;
  const int64_t K = gate_w.in_features(), M = rows_of(x), F = gate_w.out_features();
  if (keep || gate.dtype() != act.dtype() || up.dtype() != act.dtype() || F % 8 != 0 ||
      !concatenated_product(x, {&gate_w, &up_w}, spec, cat)) {
    Backend::linear_swiglu_impl(x, gate_w, up_w, spec, gate, up, keep, act, act_fp8, x_fp8);
    return;
  }
  const OpTimer op_timer_(*this, "linear_swiglu", 1);
  Tensor y = scratch(kSlotCat, {M, 2 * F}, act.dtype());
  linear_fwd(x.reshape({M, K}), cat, spec, y, x_fp8);
  const unsigned char* g = static_cast<const unsigned char*>(y.raw());
  const void* u = g + F * dtype_size(act.dtype());
  if (act_fp8) {
    fp8_view_prepare(*act_fp8, act);
    int* bad = flag_reset();
    if (!launch_swiglu_fp8(g, u, 2 * F, act.raw(), act.dtype(), M, F, act_fp8->q.pow2,
                           act_fp8->q.data.data<uint8_t>(), act_fp8->q.scales.data<float>(),
                           act_fp8->scales_gemm_layout, bad, stream_)) {
      launch_swiglu_rows(g, u, 2 * F, act.raw(), act.dtype(), M, F, stream_);
      quantize_async(act.reshape({M, F}), false, act_fp8->q, false, act_fp8->scales_gemm_layout);
    }
    flag_check("linear_swiglu: the output " + act.str() + " holds NaN or Inf (FP8 quantization refuses non-finite values)");
  } else {
    launch_swiglu_rows(g, u, 2 * F, act.raw(), act.dtype(), M, F, stream_);
  }
  ++concat_products_;
}

namespace {
int64_t live_groups(const std::vector<int64_t>& offsets) {
  int64_t n = 0;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) n += offsets[g + 1] > offsets[g];
  return n;
}
// BF16 operands for cuBLAS's grouped GEMM: every weight's W.w BF16 (the BF16 compute copies).
bool bf16_weights(const std::vector<const LinearWeight*>& W) {
  for (const LinearWeight* w : W)
    if (!w->w.defined() || w->w.dtype() != DType::BF16 || w->bias.defined()) return false;
  return true;
}
// The rows of group g of a row-major [R, cols] tensor.
const void* group_rows(const Tensor& t, int64_t r0) {
  return static_cast<const char*>(t.raw()) + r0 * t.dim(1) * static_cast<int64_t>(dtype_size(t.dtype()));
}
}  // namespace

// FP8 with every group's weight pre-quantized (the generator's weights, the trainer's per-step
// cache): x quantized once, every group in one launch of the own grouped kernel (fp8_gemm.h).
// BF16 with BF16 weights: one launch of the own kernel's BF16 mode (1.94x cuBLAS's grouped GEMM
// on the Qwen3-30B-A3B expert products, H100, session 31; the same kernel as the generator's
// device-planned blocks), or of cuBLAS's grouped GEMM where the shape is outside it (K % 8, N %
// 16). Otherwise (FP32, the exact path, F32 weights, biases) one linear per group, counted in
// grouped_loops.
void CudaBackend::grouped_linear_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                      const std::vector<const LinearWeight*>& W, const LinearSpec& spec, Tensor& out,
                                      const Fp8View* x_fp8) {
  const int64_t R = x.dim(0), K = x.dim(1), N = out.dim(1);
  // Not while a graph records: both grouped paths upload their tables with a pageable copy.
  if (spec.mode == LinearMode::BF16 && act_dtype_ != DType::F32 && !recording_ && x.dtype() == DType::BF16 &&
      bf16_weights(W) && GemmEngine::grouped_bf16_supported(out.dtype())) {
    const OpTimer op_timer_(*this, "grouped_linear");
    if (K % 8 == 0 && N % 16 == 0 && R < (int64_t{1} << 31)) {
      std::vector<const void*> bp;
      for (const LinearWeight* w : W) bp.push_back(w->w.raw());
      gemm_->gemm_bf16_grouped(offsets, N, K, x.raw(), bp, out.raw(), out.dtype(), 1.0f, 0.0f, /*block_m=*/0,
                               /*keep_maps=*/true);
      return;
    }
    std::vector<GemmEngine::Problem> probs;
    for (size_t g = 0; g < W.size(); ++g) {
      const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
      if (rows > 0)
        probs.push_back({rows, N, K, group_rows(x, r0), W[g]->w.raw(), const_cast<void*>(group_rows(out, r0))});
    }
    gemm_->gemm_grouped(false, true, probs, DType::BF16, out.dtype(), 1.0f, 0.0f);
    return;
  }
  if (!fp8_grouped_ok(x, W, spec, N)) {
    if (act_dtype_ != DType::F32) grouped_loops_ += live_groups(offsets);
    Backend::grouped_linear_impl(x, offsets, W, spec, out, x_fp8);
    return;
  }
  const OpTimer op_timer_(*this, "grouped_linear");
  if (x_fp8) {  // the producer's copy: the bits grouped_fp8_input would write, in either scale layout
    grouped_fp8_product(x_fp8->q, x_fp8->scales_gemm_layout, offsets, W, out);
    return;
  }
  const QuantTensor xq = grouped_fp8_input(x, spec);
  grouped_fp8_product(xq, false, offsets, W, out);
}

bool CudaBackend::fp8_grouped_ok(const Tensor& x, const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                 int64_t N) const {
  const int64_t R = x.dim(0), K = x.dim(1);
  bool ok = spec.mode == LinearMode::FP8_BLOCK && act_dtype_ != DType::F32 && R > 0 &&
            fp8_gemm_sm90_supported(R, N, K) && K % kQuantBlock == 0 && R < (int64_t{1} << 31) && !recording_;
  for (const LinearWeight* w : W) ok = ok && w->wq.defined() && !w->bias.defined() && w->wq.pow2 == spec.pow2_scales;
  return ok;
}

QuantTensor CudaBackend::grouped_fp8_input(const Tensor& x, const LinearSpec& spec) {
  QuantTensor xq = scratch_quant(kSlotAq, kSlotAs, x.dim(0), x.dim(1), 1, spec.pow2_scales);
  flag_reset();
  quantize_async(x, false, xq, false, /*gemm_layout=*/false);
  flag_check("grouped_linear (FP8): the input " + x.str() + " holds NaN or Inf");
  return xq;
}

void CudaBackend::grouped_fp8_product(const QuantTensor& xq, bool scales_kb_major, const std::vector<int64_t>& offsets,
                                      const std::vector<const LinearWeight*>& W, Tensor& out) {
  std::vector<const uint8_t*> bp;
  std::vector<const float*> sp;
  for (const LinearWeight* w : W) {
    bp.push_back(w->wq.data.data<uint8_t>());
    sp.push_back(w->wq.scales.data<float>());
  }
  gemm_->gemm_fp8_grouped(offsets, out.dim(1), xq.data.dim(1), xq.data.data<uint8_t>(), xq.scales.data<float>(),
                          scales_kb_major, bp, sp, out.raw(), out.dtype(), 1.0f, 0.0f, /*block_m=*/0,
                          /*keep_maps=*/true);
}

// The device-planned grouped products (the generator's MoE blocks): the own grouped kernel over
// moe_plan's tile table, FP8 with pre-quantized weights (x quantized once for every weight set)
// or BF16 with BF16 weights (the kernel's BF16 mode, in place of cuBLAS's grouped GEMM, which
// needs the row counts on the host); nothing is uploaded or read back. Otherwise the default (the
// offsets downloaded, the host-offsets op).
int CudaBackend::moe_plan_block_m(int64_t rows, int64_t groups) const {
  return rows / std::max<int64_t>(1, std::min(rows, groups)) <= 96 ? 64 : 128;  // gemm_fp8_grouped's rule
}

void CudaBackend::grouped_linear_planned_impl(const Tensor& x, const MoeDevicePlan& plan,
                                              const std::vector<std::vector<const LinearWeight*>>& W,
                                              const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                              const Fp8View* x_fp8) {
  const int64_t R = x.dim(0), K = x.dim(1);
  const int4* tiles = reinterpret_cast<const int4*>(plan.tiles.data<int32_t>());
  const int* count = plan.tile_count.data<int32_t>();
  const int64_t max_tiles = plan.tiles.dim(0);
  const bool bm_ok = plan.block_m == 64 || plan.block_m == 128;
  bool fp8 = bm_ok && spec.mode == LinearMode::FP8_BLOCK && act_dtype_ != DType::F32 && R > 0 &&
             K % kQuantBlock == 0 && R < (int64_t{1} << 31);
  bool bf16 = bm_ok && spec.mode == LinearMode::BF16 && act_dtype_ != DType::F32 && R > 0 &&
              x.dtype() == DType::BF16 && K % 8 == 0 && R < (int64_t{1} << 31);
  for (size_t i = 0; i < W.size(); ++i) {
    const int64_t N = outs[i]->dim(1);
    fp8 = fp8 && fp8_gemm_sm90_supported(R, N, K);
    for (const LinearWeight* w : W[i]) fp8 = fp8 && w->wq.defined() && !w->bias.defined() && w->wq.pow2 == spec.pow2_scales;
    bf16 = bf16 && N % 16 == 0 && outs[i]->dtype() == DType::BF16 && bf16_weights(W[i]);
  }
  if (fp8) {
    const OpTimer op_timer_(*this, "grouped_linear");
    const QuantTensor xq = x_fp8 ? x_fp8->q : grouped_fp8_input(x, spec);
    const bool kb_major = x_fp8 && x_fp8->scales_gemm_layout;
    for (size_t i = 0; i < W.size(); ++i) {
      std::vector<const uint8_t*> bp;
      std::vector<const float*> sp;
      for (const LinearWeight* w : W[i]) {
        bp.push_back(w->wq.data.data<uint8_t>());
        sp.push_back(w->wq.scales.data<float>());
      }
      gemm_->gemm_fp8_grouped_device(tiles, count, max_tiles, R, plan.block_m, outs[i]->dim(1), K,
                                     xq.data.data<uint8_t>(), xq.scales.data<float>(), kb_major, bp, sp,
                                     outs[i]->raw(), outs[i]->dtype(), 1.0f, 0.0f);
    }
    return;
  }
  if (bf16) {
    const OpTimer op_timer_(*this, "grouped_linear");
    for (size_t i = 0; i < W.size(); ++i) {
      std::vector<const void*> bp;
      for (const LinearWeight* w : W[i]) bp.push_back(w->w.raw());
      gemm_->gemm_bf16_grouped_device(tiles, count, max_tiles, R, plan.block_m, outs[i]->dim(1), K, x.raw(), bp,
                                      outs[i]->raw(), outs[i]->dtype(), 1.0f, 0.0f);
    }
    return;
  }
  Backend::grouped_linear_planned_impl(x, plan, W, spec, outs, x_fp8);
}

// The experts' gate and up over the same rows: FP8 with pre-quantized weights quantizes x once for
// every weight set, then one grouped launch per set (bitwise grouped_linear per set: the same
// quantized rows, the same kernel); otherwise grouped_linear per set.
void CudaBackend::grouped_linear_shared_input_impl(const Tensor& x, const std::vector<int64_t>& offsets,
                                                   const std::vector<std::vector<const LinearWeight*>>& W,
                                                   const LinearSpec& spec, const std::vector<Tensor*>& outs,
                                                   const Fp8View* x_fp8) {
  bool fp8 = W.size() > 1;
  for (size_t i = 0; i < W.size(); ++i) fp8 = fp8 && fp8_grouped_ok(x, W[i], spec, outs[i]->dim(1));
  if (!fp8) {
    Backend::grouped_linear_shared_input_impl(x, offsets, W, spec, outs, x_fp8);
    return;
  }
  const OpTimer op_timer_(*this, "grouped_linear");
  const QuantTensor xq = x_fp8 ? x_fp8->q : grouped_fp8_input(x, spec);
  const bool kb_major = x_fp8 && x_fp8->scales_gemm_layout;
  for (size_t i = 0; i < W.size(); ++i) grouped_fp8_product(xq, kb_major, offsets, W[i], *outs[i]);
}

// The grouped weight gradient into F32 gradients. cuBLAS's grouped GEMM writes BF16 only, so
// each group's product dY_g^T X_g goes to a BF16 staging buffer (beta 0) and one launch adds the
// staged products into the F32 gradients: the micro-batch's contribution is rounded to BF16 once
// before the F32 sum (Megatron's grouped MLP accumulates its BF16 expert gradients into the F32
// main_grad the same way), where a dense linear's wgrad writes F32 directly. The groups run in
// chunks whose staging stays within kGroupedWgradStagingBytes.
void CudaBackend::grouped_wgrad_f32(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                    const std::vector<Tensor*>& dw) {
  const int64_t K = x.dim(1), N = dy.dim(1), per = N * K;
  std::vector<size_t> live;
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    if (offsets[g + 1] > offsets[g] && dw[g]) live.push_back(g);
  if (live.empty() || per == 0) return;
  // Each staged product 16-byte aligned (the accumulate's 8-element accesses).
  const int64_t stride = ceil_div(per, 8) * 8;
  const int64_t chunk =
      std::clamp<int64_t>(kGroupedWgradStagingBytes / (stride * 2), 1, static_cast<int64_t>(live.size()));
  Tensor stage = scratch(kSlotWgradStage, {chunk * stride}, DType::BF16);
  for (size_t c0 = 0; c0 < live.size(); c0 += static_cast<size_t>(chunk)) {
    const size_t c1 = std::min(live.size(), c0 + static_cast<size_t>(chunk));
    std::vector<GemmEngine::Problem> probs;
    std::vector<const void*> src;
    std::vector<float*> dst;
    std::vector<int64_t> n;
    for (size_t i = c0; i < c1; ++i) {
      const size_t g = live[i];
      const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
      void* s = stage.data<uint16_t>() + static_cast<int64_t>(i - c0) * stride;
      probs.push_back({N, K, rows, group_rows(dy, r0), group_rows(x, r0), s});
      src.push_back(s), dst.push_back(dw[g]->data<float>()), n.push_back(per);
    }
    {
      const OpTimer t(*this, "grouped_linear_backward: wgrad BF16 GEMM (staged)", 2);
      gemm_->gemm_grouped(true, false, probs, DType::BF16, DType::BF16, 1.0f, 0.0f);
    }
    const OpTimer t(*this, "grouped_linear_backward: wgrad F32 accumulate", 2);
    launch_accumulate_many_bf16_f32(src, dst, n, stream_);
  }
}

// The experts' weight gradients dw_g += dY_g^T X_g on the own kernel's K-grouped form
// (fp8_gemm.h): dY and X transposed into [N, Rp] and [K, Rp] BF16, each group's tokens padded with
// zeros to a multiple of 64 columns, then one launch per chunk of groups, each gradient accumulated
// in place (beta 1: the FP32 sum of the micro-batch's products added to an F32 gradient, or
// rounded once into a BF16 one). A few launches (one per chunk) instead of cuBLAS's grouped
// GEMM, which ran at ~280 TF/s on the expert products, and no BF16 staging for F32 gradients.
// The chunks' transposes stay within kGroupedWgradOperandBytes (a group larger than that alone).
// FP8RL_GROUPED_WGRAD (read at each call): cublas (the default), own (grouped_wgrad_own, 128-row
// tiles) or own64 (64-row tiles, two CTAs per SM: one CTA's read-modify-write epilogue beside the
// other's MMAs). Measured (bench rl-step, Qwen3-30B-A3B width, H100): own made the training phase
// slower in both recipes (session 32: bf16 0.927 -> 1.027 s, fp8_e2e 0.848 -> 0.950): its tiles'
// read-modify-write epilogue (no overlap with the next tile's MMAs) and the transposes cost more
// than cuBLAS's grouped GEMM; own64 more still (session 33: fp8_e2e 0.807 -> 0.957 s). Returns
// the block_m, 0 for cublas.
static int grouped_wgrad_own_block_m() {
  const char* e = std::getenv("FP8RL_GROUPED_WGRAD");
  if (!e) return 0;
  const std::string v(e);
  FP8RL_CHECK(v == "own" || v == "own64" || v == "cublas", "FP8RL_GROUPED_WGRAD must be own, own64 or cublas, got '",
              v, "'");
  return v == "own" ? 128 : v == "own64" ? 64 : 0;
}

bool CudaBackend::grouped_wgrad_own(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                    const std::vector<Tensor*>& dw, int block_m) {
  const int64_t N = dy.dim(1), K = x.dim(1);
  if (dy.dtype() != DType::BF16 || x.dtype() != DType::BF16 || N % 8 != 0 || K % 16 != 0) return false;
  std::vector<size_t> live;
  DType gt = DType::F32;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    if (offsets[g + 1] == offsets[g] || !dw[g]) continue;
    if (live.empty()) gt = dw[g]->dtype();
    if (dw[g]->dtype() != gt || (gt != DType::F32 && gt != DType::BF16)) return false;
    live.push_back(g);
  }
  if (live.empty()) return true;
  const int64_t cap_rows = std::max<int64_t>(64, kGroupedWgradOperandBytes / ((N + K) * 2));
  // The chunks: consecutive live groups, [first, end) into `live`, and their padded rows.
  std::vector<std::pair<size_t, size_t>> chunks;
  int64_t max_rows = 0;
  for (size_t i = 0; i < live.size();) {
    size_t j = i;
    int64_t rows = 0;
    while (j < live.size()) {
      const int64_t r = ceil_div(offsets[live[j] + 1] - offsets[live[j]], int64_t{64}) * 64;
      if (j > i && rows + r > cap_rows) break;
      rows += r, ++j;
    }
    chunks.emplace_back(i, j);
    max_rows = std::max(max_rows, rows);
    i = j;
  }
  // One buffer for both operands: the experts' three projections all have N + K = D + Fe, so the
  // slot keeps one size across them (two slots would each grow to max(D, Fe) rows).
  Tensor ops = scratch(kSlotWgradOps, {(N + K) * max_rows}, DType::BF16);
  uint16_t* dyt_p = ops.data<uint16_t>();
  uint16_t* xt_p = dyt_p + N * max_rows;
  for (const auto& [i0, i1] : chunks) {
    std::vector<int32_t> blocks;  // int2 {first row, rows} per 64 padded columns
    std::vector<int64_t> k_offsets{0};
    std::vector<void*> c;
    for (size_t i = i0; i < i1; ++i) {
      const size_t g = live[i];
      for (int64_t r = offsets[g]; r < offsets[g + 1]; r += 64) {
        blocks.push_back(static_cast<int32_t>(r));
        blocks.push_back(static_cast<int32_t>(std::min<int64_t>(64, offsets[g + 1] - r)));
      }
      k_offsets.push_back(static_cast<int64_t>(blocks.size() / 2) * 64);
      c.push_back(dw[g]->raw());
    }
    const int64_t nblocks = static_cast<int64_t>(blocks.size() / 2), Rp = nblocks * 64;
    Tensor bd = scratch(kSlotIdx, {static_cast<int64_t>(blocks.size())}, DType::I32);
    if (!uploads_.upload(blocks.data(), bd.raw(), blocks.size() * 4, stream_))
      CUDA_CHECK(cudaMemcpyAsync(bd.raw(), blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice, stream_),
                 "uploading the weight gradient's row blocks");
    {
      const OpTimer t(*this, "grouped_linear_backward: wgrad transposes", 2);
      const int2* b2 = reinterpret_cast<const int2*>(bd.raw());
      launch_transpose_row_blocks_bf16(dy.raw(), N, b2, nblocks, Rp, dyt_p, stream_);
      launch_transpose_row_blocks_bf16(x.raw(), K, b2, nblocks, Rp, xt_p, stream_);
    }
    const OpTimer t(*this, "grouped_linear_backward: wgrad BF16 K-grouped GEMM (own)", 2);
    gemm_->gemm_bf16_kgrouped(N, K, Rp, dyt_p, xt_p, k_offsets, c, gt, 1.0f, 1.0f, block_m);
  }
  return true;
}

// The experts' backward, each half in one launch where the mode allows:
//   dgrad, FP8 with pre-quantized weights: dY quantized once (1x128 along N), each routed
//     expert's W^T (its cached wqt, the trainer's; else the byte transpose of its 128x128
//     quantization, as linear_backward, packed in one scratch), the own grouped kernel over
//     them; BF16 with BF16 weights: cuBLAS grouped;
//   wgrad (BF16 mode, or FP8 with spec.wgrad == BF16): cuBLAS grouped dY_g^T X_g into each dw_g
//     (BF16 gradients, train.grad_dtype bf16), or into BF16 staging then added (F32 gradients:
//     grouped_wgrad_f32; cuBLAS has no grouped BF16 GEMM into F32); or, with
//     FP8RL_GROUPED_WGRAD=own or own64, the own kernel's K-grouped form (grouped_wgrad_own).
// What does not qualify runs as linear_backward per group (counted in grouped_loops).
void CudaBackend::grouped_linear_backward_impl(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                               const std::vector<const LinearWeight*>& W, const LinearSpec& spec,
                                               Tensor* dx, const std::vector<Tensor*>& dw, const Fp8View* dy_fp8) {
  const OpTimer op_timer_(*this, "grouped_linear_backward", 1);  // level 2: its phases instead
  const int64_t R = x.dim(0), K = x.dim(1), N = dy.dim(1);
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK, fast = act_dtype_ != DType::F32 && !recording_ && R > 0;
  const bool bf16_ops = dy.dtype() == DType::BF16 && x.dtype() == DType::BF16;
  bool dx_done = !dx;
  if (dx && fast && fp8) {
    bool ok = fp8_gemm_sm90_supported(R, K, N) && N % kQuantBlock == 0 && K % kQuantBlock == 0 &&
              R < (int64_t{1} << 31);
    for (const LinearWeight* w : W) ok = ok && w->wq.defined() && w->wq.pow2 == spec.pow2_scales;
    if (ok) {
      // dy's 1x128 copy: the producer's (swiglu_backward_fp8), else quantized here.
      QuantTensor dyq = dy_fp8 ? dy_fp8->q : scratch_quant(kSlotAq, kSlotAs, R, N, 1, spec.pow2_scales);
      const bool dy_kb_major = dy_fp8 && dy_fp8->scales_gemm_layout;
      if (!dy_fp8) {
        flag_reset();
        {
          const OpTimer t(*this, "grouped_linear_backward: dgrad quantize dy", 2);
          quantize_async(dy, false, dyq, false, /*gemm_layout=*/false);
        }
        flag_check("grouped_linear_backward (FP8 dgrad): dy " + dy.str() + " holds NaN or Inf");
      }
      std::vector<const uint8_t*> bp(W.size(), nullptr);
      std::vector<const float*> sp(W.size(), nullptr);
      bool cached = true;  // every routed expert's W^T kept by the trainer (LinearWeight::wqt)
      for (size_t g = 0; g < W.size(); ++g) cached = cached && (offsets[g + 1] == offsets[g] || W[g]->wqt.defined());
      if (cached) {
        for (size_t g = 0; g < W.size(); ++g)  // groups without rows: any valid map (never read)
          if (offsets[g + 1] > offsets[g]) bp[g] = W[g]->wqt.data.data<uint8_t>(), sp[g] = W[g]->wqt.scales.data<float>();
        const size_t any = static_cast<size_t>(std::find_if(bp.begin(), bp.end(), [](const uint8_t* p) { return p; }) -
                                               bp.begin());
        for (size_t g = 0; g < W.size(); ++g)
          if (!bp[g]) bp[g] = bp[any], sp[g] = sp[any];
      } else {
        const OpTimer t(*this, "grouped_linear_backward: dgrad transpose W", 2);
        QuantTensor wt = scratch_quant(kSlotBq, kSlotBs, live_groups(offsets) * K, N, kQuantBlock, spec.pow2_scales);
        int64_t u = 0;
        for (size_t g = 0; g < W.size(); ++g) {
          if (offsets[g + 1] == offsets[g]) continue;
          uint8_t* q = wt.data.data<uint8_t>() + u * K * N;
          float* sc = wt.scales.data<float>() + u * (K / kQuantBlock) * (N / kQuantBlock);
          launch_transpose_quant(W[g]->wq.data.data<uint8_t>(), W[g]->wq.scales.data<float>(), N, K, kQuantBlock, q,
                                 sc, stream_);
          bp[g] = q, sp[g] = sc, ++u;
        }
        for (size_t g = 0; g < W.size(); ++g)  // groups without rows: any valid map (never read)
          if (!bp[g]) bp[g] = wt.data.data<uint8_t>(), sp[g] = wt.scales.data<float>();
      }
      const OpTimer t(*this, "grouped_linear_backward: dgrad FP8 GEMM", 2);
      gemm_->gemm_fp8_grouped(offsets, K, N, dyq.data.data<uint8_t>(), dyq.scales.data<float>(), dy_kb_major, bp,
                              sp, dx->raw(), dx->dtype(), 1.0f, 0.0f, /*block_m=*/0, /*keep_maps=*/cached);
      dx_done = true;
    }
  } else if (dx && fast && spec.mode == LinearMode::BF16 && bf16_ops && bf16_weights(W) &&
             GemmEngine::grouped_bf16_supported(dx->dtype())) {
    const OpTimer t(*this, "grouped_linear_backward: dgrad BF16 GEMM", 2);
    std::vector<GemmEngine::Problem> probs;
    for (size_t g = 0; g < W.size(); ++g) {
      const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
      if (rows > 0)
        probs.push_back({rows, K, N, group_rows(dy, r0), W[g]->w.raw(), const_cast<void*>(group_rows(*dx, r0))});
    }
    gemm_->gemm_grouped(false, false, probs, DType::BF16, dx->dtype(), 1.0f, 0.0f);
    dx_done = true;
  }
  bool dw_done = dw.empty();
  const bool bf16_wgrad =
      fast && bf16_ops && (spec.mode == LinearMode::BF16 || (fp8 && spec.wgrad == LinearMode::BF16));
  if (const int own_bm = bf16_wgrad && !dw_done ? grouped_wgrad_own_block_m() : 0; own_bm > 0)
    dw_done = grouped_wgrad_own(dy, x, offsets, dw, own_bm);
  if (!dw_done && bf16_wgrad) {
    // One output dtype for the launch: every given gradient F32, or every one BF16.
    const Tensor* any = nullptr;
    bool ok = true;
    for (const Tensor* d : dw) {
      if (!d) continue;
      ok = ok && (!any || d->dtype() == any->dtype());
      any = any ? any : d;
    }
    const DType gt = any ? any->dtype() : DType::BF16;
    if (ok && GemmEngine::grouped_bf16_supported(gt)) {
      const OpTimer t(*this, "grouped_linear_backward: wgrad BF16 GEMM", 2);
      std::vector<GemmEngine::Problem> probs;
      for (size_t g = 0; g < W.size(); ++g) {
        const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
        if (rows > 0 && dw[g]) probs.push_back({N, K, rows, group_rows(dy, r0), group_rows(x, r0), dw[g]->raw()});
      }
      gemm_->gemm_grouped(true, false, probs, DType::BF16, gt, 1.0f, 1.0f);
      dw_done = true;
    } else if (ok && gt == DType::F32) {
      grouped_wgrad_f32(dy, x, offsets, dw);
      dw_done = true;
    }
  }
  if (dx_done && dw_done) return;
  if (act_dtype_ != DType::F32) grouped_loops_ += live_groups(offsets);
  Backend::grouped_linear_backward_impl(dy, x, offsets, W, spec, dx_done ? nullptr : dx,
                                        dw_done ? std::vector<Tensor*>{} : dw, dy_fp8);
}

void CudaBackend::linear_backward_impl(const Tensor& dy, const Tensor& x, const LinearWeight& W, const LinearSpec& spec,
                                       Tensor* dx, Tensor* dw, Tensor* dbias, const Fp8View* dy_fp8) {
  // A BF16 weight gradient: the BF16 wgrad GEMM adds into it directly: its FP32 sum, rounded to
  // BF16 by cuBLASLt's BF16-output epilogue before the old value is added and the result rounded
  // (session 35; as PyTorch accumulates a BF16 .grad), so within one BF16 ulp of the F32 copy's
  // result plus half an ulp of the product and the GEMM's summation order
  // (CudaOptimizer.Bf16GradientsAccumulateThroughF32Once); the FP8 wgrad (cuBLASLt's
  // block-scaled F32 output), the FP32 one and the bias's column sums go through an F32 copy of
  // the gradient. The copy cost ~16 bytes of traffic per weight per micro-batch (session 32's MoE
  // profile: ~7 ms per step for the attention's qkv and o alone).
  const bool widen_dw = is_bf16_grad(dw) && (spec.mode == LinearMode::FP32 ||
                                             (spec.mode == LinearMode::FP8_BLOCK && spec.wgrad != LinearMode::BF16));
  if (widen_dw || is_bf16_grad(dbias)) {
    Tensor dw32, db32;
    {
      const OpTimer t(*this, "linear_backward: BF16 grad widen/narrow", 2);
      dw32 = widen_dw ? grad_widen(*this, dw) : Tensor(), db32 = grad_widen(*this, dbias);
    }
    linear_backward_impl(dy, x, W, spec, dx, dw32.defined() ? &dw32 : dw, db32.defined() ? &db32 : dbias, dy_fp8);
    const OpTimer t(*this, "linear_backward: BF16 grad widen/narrow", 2);
    grad_narrow(*this, dw32, dw);
    grad_narrow(*this, db32, dbias);
    return;
  }
  const OpTimer op_timer_(*this, "linear_backward", 1);
  const int64_t K = W.in_features(), N = W.out_features(), M = rows_of(x);
  const Tensor dy2 = dy.reshape({M, N}), x2 = x.reshape({M, K});
  const bool fp8 = spec.mode == LinearMode::FP8_BLOCK;
  const DType ab = spec.mode == LinearMode::FP32 ? DType::F32 : DType::BF16;
  if (dx) {
    Tensor dx2 = dx->reshape({M, K});
    if (!fp8) {
      const OpTimer t(*this, "linear_backward: dgrad BF16/FP32 GEMM", 2);
      mm(false, false, M, K, N, dy2, W.w, ab, dx2, 0.0f);
    } else {
      // dgrad: dY 1x128 along N (dy_fp8: already quantized by its producer; the dequantize path
      // reads row-major scales only, so a view in cuBLASLt's layout is then ignored and dy
      // quantized again: the same values, as in the forward); W^T [K, N] 128x128, the exact
      // transpose of W's quantization: W.wqt when defined (the trainer's per-step copy), else
      // W.wq byte-transposed here, else W.w quantized transposed here.
      const bool tc = fp8_tensor_cores(M, K, N);
      const bool use_view = dy_fp8 && (tc || !dy_fp8->scales_gemm_layout);
      const bool laid = use_view ? dy_fp8->scales_gemm_layout : tc && M % kFp8RowGranule == 0;  // as in the forward
      const bool quantizes = !use_view || !(W.wqt.defined() || W.wq.defined());  // a flag slot only then
      if (quantizes) flag_reset();
      const QuantTensor dyq = quantized_rows(dy2, use_view ? dy_fp8 : nullptr, spec.pow2_scales, laid,
                                             "linear_backward: dgrad quantize dy");
      QuantTensor wtq;
      if (W.wqt.defined()) {
        wtq = W.wqt;
      } else if (W.wq.defined()) {
        const OpTimer t(*this, "linear_backward: dgrad transpose W", 2);
        wtq = scratch_quant(kSlotBq, kSlotBs, K, N, kQuantBlock, spec.pow2_scales);
        launch_transpose_quant(W.wq.data.data<uint8_t>(), W.wq.scales.data<float>(), N, K, kQuantBlock,
                               wtq.data.data<uint8_t>(), wtq.scales.data<float>(), stream_);
      } else {
        const OpTimer t(*this, "linear_backward: dgrad quantize W^T", 2);
        wtq = scratch_quant(kSlotBq, kSlotBs, K, N, kQuantBlock, spec.pow2_scales);
        quantize_async(W.w, true, wtq);
      }
      if (quantizes)
        flag_check(use_view ? "linear_backward (FP8 dgrad): the weight holds NaN or Inf"
                            : "linear_backward (FP8 dgrad): dy " + dy.str() + " or the weight holds NaN or Inf");
      if (tc) {
        const OpTimer t(*this, "linear_backward: dgrad FP8 GEMM", 2);
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
    if (!fp8 || spec.wgrad == LinearMode::BF16) {  // BF16 wgrad of an FP8 linear: ab is BF16 here
      const OpTimer t(*this, "linear_backward: wgrad BF16/FP32 GEMM", 2);
      mm(true, false, N, K, M, dy2, x2, ab, *dw, 1.0f);
    } else {
      // wgrad: dY^T [N, M] and X^T [K, M], both requantized 1x128 along tokens. The token
      // dimension is the contraction: its last block is padded with zeros to a multiple of 128
      // (Mp), as cuBLASLt wants, which adds nothing to the product. FP8RL_FP8_WGRAD_GEMM=own (the
      // own kernel's per-row B scales, GemmEngine::fp8_wgrad_own): both operands' scales written
      // K-block-major ([Mp/128][N] and [Mp/128][K]), the layouts that kernel reads, so no layout
      // kernel runs; cuBLASLt's path keeps the row-major scales.
      const int64_t Mp = ceil_div(M, kQuantBlock) * kQuantBlock;
      const bool tc = fp8_tensor_cores(N, K, Mp);
      const bool own = tc && gemm_->fp8_wgrad_own(N, K, Mp);
      QuantTensor dytq = scratch_quant(kSlotAq, kSlotAs, N, tc ? Mp : M, 1, spec.pow2_scales);
      QuantTensor xtq = scratch_quant(kSlotBq, kSlotBs, K, tc ? Mp : M, 1, spec.pow2_scales);
      flag_reset();
      {
        const OpTimer t(*this, "linear_backward: wgrad quantize dy^T, x^T", 2);
        quantize_async(dy2, true, dytq, /*pad_cols=*/tc, /*gemm_layout=*/own);
        quantize_async(x2, true, xtq, /*pad_cols=*/tc, /*gemm_layout=*/own);
      }
      flag_check("linear_backward (FP8 wgrad): dy " + dy.str() + " or x " + x.str() + " holds NaN or Inf");
      if (tc) {
        const OpTimer t(*this, "linear_backward: wgrad FP8 GEMM", 2);
        gemm_->gemm_fp8(N, K, Mp, dytq.data.data<uint8_t>(), dytq.scales.data<float>(), xtq.data.data<uint8_t>(),
                        xtq.scales.data<float>(), 1, dw->raw(), DType::F32, 1.0f, 1.0f, /*a_scales_laid=*/own,
                        /*row_invariant=*/false, /*b_scales_laid=*/own);
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
    const OpTimer t(*this, "linear_backward: bias", 2);
    Tensor part = scratch(kSlotColSums, {column_sum_chunks(M), N}, DType::F32);
    launch_bias_grad(dy2.raw(), dy2.dtype(), M, N, dbias->data<float>(), part.data<float>(), stream_);
  }
}

// ---- attention -------------------------------------------------------------------------------

namespace {
// Host: per-token sequence start and end from cu_seqlens (the contract checked it).
void seq_bounds(const std::vector<int32_t>& cu, int64_t T, std::vector<int32_t>& out) {
  out.assign(2 * T, 0);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    for (int32_t t = cu[b]; t < cu[b + 1]; ++t) {
      out[t] = cu[b];
      out[T + t] = cu[b + 1];
    }
  }
}

// The tensor-core flash kernels (flash_attention.cu) serve BF16 activations with head dims (q/k,
// v) of (64, 64), (128, 128) or MLA's (192, 128) and 16-byte aligned tensors; everything else
// takes the simple kernels. The environment variable FP8RL_CUDA_ATTENTION=simple forces the simple
// kernels (=flash: the flash ones where supported), a diagnostic switch read at each call. MLA's
// widths (192, 128) take them by default since they passed on a GPU (session 30: the op table's
// (192, 128) rows and CudaMlaOps against the CPU; Moonlight's step, docs/benchmarks.md).
constexpr bool kFlashByDefault = true, kFlashMlaByDefault = true;
bool use_flash_attention(DType dt, int hd, int hdv, std::initializer_list<const Tensor*> ts) {
  const char* e = std::getenv("FP8RL_CUDA_ATTENTION");
  const bool asked = e && std::string(e) == "flash";
  const bool want = e && std::string(e) == "simple" ? false : asked || (hd == hdv ? kFlashByDefault : kFlashMlaByDefault);
  if (!want || !flash_attention_supported(dt, hd, hdv)) return false;
  for (const Tensor* t : ts)
    if (reinterpret_cast<uintptr_t>(t->raw()) % 16 != 0) return false;
  return true;
}
}  // namespace

void CudaBackend::attention_impl(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const std::vector<int32_t>& cu_seqlens, float softmax_scale, Tensor& out,
                                 Tensor& lse) {
  const OpTimer op_timer_(*this, "attention");
  const int64_t T = q.dim(0);
  const int Hq = static_cast<int>(q.dim(1)), Hkv = static_cast<int>(k.dim(1)), hd = static_cast<int>(q.dim(2));
  // The kernels' own limits: one dtype; v heads may be narrower than q/k's (MLA).
  one_dtype({&q, &k, &v, &out}, "attention");
  const int hdv = static_cast<int>(v.dim(2));
  std::vector<int32_t> b;
  seq_bounds(cu_seqlens, T, b);
  if (use_flash_attention(q.dtype(), hd, hdv, {&q, &k, &v, &out})) {
    const std::vector<int32_t> tiles = flash_attention_tiles(cu_seqlens);
    Tensor td = scratch(kSlotIdx, {static_cast<int64_t>(tiles.size()) + 1}, DType::I32);
    CUDA_CHECK(cudaMemcpyAsync(td.raw(), tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice, stream_),
               "uploading attention tiles");
    launch_flash_attention(q.raw(), k.raw(), v.raw(), td.data<int32_t>(), static_cast<int>(tiles.size() / 8), T, Hq,
                           Hkv, hd, hdv, softmax_scale, out.raw(), lse.data<float>(), stream_);
    return;
  }
  Tensor idx = scratch(kSlotIdx, {2 * T}, DType::I32);
  CUDA_CHECK(cudaMemcpyAsync(idx.raw(), b.data(), b.size() * 4, cudaMemcpyHostToDevice, stream_), "uploading seqlens");
  launch_attention(q.raw(), k.raw(), v.raw(), q.dtype(), idx.data<int32_t>(), T, Hq, Hkv, hd, hdv, softmax_scale,
                   out.raw(), lse.data<float>(), stream_);
}

void CudaBackend::attention_backward_impl(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const Tensor& lse, const std::vector<int32_t>& cu_seqlens,
                                          float softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const OpTimer op_timer_(*this, "attention_backward");
  const int64_t T = q.dim(0);
  const int Hq = static_cast<int>(q.dim(1)), Hkv = static_cast<int>(k.dim(1)), hd = static_cast<int>(q.dim(2));
  // The kernels' own limits, as in the forward.
  one_dtype({&dout, &q, &k, &v, &out, &dq, &dk, &dv}, "attention_backward");
  const int hdv = static_cast<int>(v.dim(2));  // MLA: v_head_dim
  std::vector<int32_t> b;
  seq_bounds(cu_seqlens, T, b);
  if (use_flash_attention(q.dtype(), hd, hdv, {&dout, &q, &k, &v, &out, &dq, &dk, &dv})) {
    Tensor work = scratch(kSlotAttn, {flash_attention_backward_work(T, Hq, Hkv, hd, hdv)}, DType::F32);
    const std::vector<int32_t> tiles = flash_attention_tiles(cu_seqlens);
    Tensor td = scratch(kSlotIdx, {static_cast<int64_t>(tiles.size()) + 1}, DType::I32);
    CUDA_CHECK(cudaMemcpyAsync(td.raw(), tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice, stream_),
               "uploading attention tiles");
    launch_flash_attention_backward(dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(), lse.data<float>(),
                                    td.data<int32_t>(), static_cast<int>(tiles.size() / 8), T, Hq, Hkv, hd, hdv,
                                    softmax_scale, dq.raw(), dk.raw(), dv.raw(), work.data<float>(), stream_);
    return;
  }
  Tensor delta = scratch(kSlotAttn, {T * Hq}, DType::F32);
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

void CudaBackend::token_logprobs_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                      float temperature, const LinearSpec& spec, Tensor& logp, Tensor& lse,
                                      Tensor* entropy) {
  const OpTimer op_timer_(*this, "token_logprobs");
  const int64_t T = hidden.dim(0), V = lm_head.dim(0);
  const LogprobRows st = logprob_rows_begin(T, V, "token_logprobs");
  // The consistent mode: chunks fixed by V alone (backend.h kConsistentVocabChunk), so a row's
  // online log-sum-exp runs over the same chunks whatever T.
  const int64_t vc = spec.consistent ? std::min(kConsistentVocabChunk, V) : vocab_chunk(T, V);
  for (int64_t v0 = 0; v0 < V; v0 += vc) {
    const int64_t n = std::min(vc, V - v0);
    Tensor logits = scratch(kSlotLogits, {T, n}, DType::F32);
    LinearWeight chunk;
    chunk.w = lm_head.slice_rows(v0, v0 + n);
    linear_fwd(hidden, chunk, spec, logits);
    launch_logprob_chunk(logits.data<float>(), n, T, n, v0, V, 1.0f / temperature, targets.data<int32_t>(), st.m,
                         st.s, st.e, st.tgt, st.bad, stream_);
  }
  launch_logprob_finish(st.m, st.s, st.e, st.tgt, T, logp.data<float>(), lse.data<float>(),
                        entropy ? entropy->data<float>() : nullptr, stream_);
}

CudaBackend::LogprobRows CudaBackend::logprob_rows_begin(int64_t T, int64_t V, const char* op) {
  Tensor state = scratch(kSlotState, {4, T}, DType::F32);
  LogprobRows r;
  r.m = state.data<float>();
  r.s = r.m + T, r.e = r.m + 2 * T, r.tgt = r.m + 3 * T;
  launch_logprob_init(r.m, r.s, r.e, r.tgt, T, stream_);
  // The sticky slot: set by any out-of-range target of any call, read and cleared by flag_drain.
  r.bad = flag_dev_ + kFlagSticky;
  if (sticky_message_.empty())
    sticky_message_ = std::string(op) + ": a target id is out of range [0, " + std::to_string(V) + ")";
  return r;
}

void CudaBackend::logprobs_of_logits_impl(const Tensor& logits, const Tensor& targets, float temperature, Tensor& logp,
                                          Tensor& lse) {
  const OpTimer op_timer_(*this, "logprobs_of_logits");
  const int64_t R = logits.dim(0), V = logits.dim(1);
  const LogprobRows st = logprob_rows_begin(R, V, "logprobs_of_logits");
  // token_logprobs' consistent chunks, each a column slice of the [R, V] logits read in place,
  // folded by three launches whatever their number (the same bits as one launch per chunk).
  const int64_t chunk = std::min(kConsistentVocabChunk, V);
  Tensor parts = scratch(kSlotLogpParts, {ceil_div(logprob_rows_scratch_bytes(R, V, chunk), int64_t{4})}, DType::F32);
  launch_logprob_rows(logits.data<float>(), R, V, chunk, 1.0f / temperature, targets.data<int32_t>(), st.m, st.s,
                      st.e, st.tgt, st.bad, parts.data<float>(), stream_);
  launch_logprob_finish(st.m, st.s, st.e, st.tgt, R, logp.data<float>(), lse.data<float>(), nullptr, stream_);
}

void CudaBackend::token_logprobs_backward_impl(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets,
                                               float temperature, const LinearSpec& spec, const Tensor& lse,
                                               const Tensor& dlogp, Tensor& dhidden, Tensor* dlm_head) {
  const OpTimer op_timer_(*this, "token_logprobs_backward", 1);
  const int64_t T = hidden.dim(0), D = hidden.dim(1), V = lm_head.dim(0);
  // BF16 lm_head (every recipe's): the chunk's gradient is written in BF16 by the gradient kernel
  // (the rounding the BF16 GEMMs' operand conversion applies), the dgrad accumulates into dh in
  // place (beta = 1) and the wgrad into dlm_head: no F32 gradient, no conversions, no per-chunk
  // dx buffer and add. The products are those of the general path below, summed by the GEMM's
  // epilogue instead of a separate add. A BF16 dlm_head (train.grad_dtype: bf16) takes the
  // wgrad's FP32 sum rounded to BF16, then added to the old value and rounded, as
  // linear_backward's BF16 wgrad does (docs/benchmarks.md, session 35). Before session 32
  // BF16 gradients took the general path below, with its conversions and per-chunk dx adds: 5-6%
  // of the MoE benches' training phase.
  if (spec.mode == LinearMode::BF16 && hidden.dtype() == DType::BF16 && lm_head.dtype() == DType::BF16 &&
      (!dlm_head || dlm_head->dtype() == DType::F32 || dlm_head->dtype() == DType::BF16)) {
    Tensor dh = scratch(kSlotDh, {T, D}, DType::F32);
    const int64_t vc = vocab_chunk(T, V);
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t n = std::min(vc, V - v0);
      Tensor logits = scratch(kSlotLogits, {T, n}, DType::F32);
      Tensor g = scratch(kSlotTmp, {T, n}, DType::BF16);
      const Tensor w = lm_head.slice_rows(v0, v0 + n);
      {
        const OpTimer t(*this, "token_logprobs_backward: logits GEMM", 2);
        gemm_->gemm(false, true, T, n, D, hidden.raw(), w.raw(), DType::BF16, logits.raw(), DType::F32, 1.0f, 0.0f);
      }
      {
        const OpTimer t(*this, "token_logprobs_backward: softmax gradient", 2);
        launch_logprob_grad_chunk(logits.data<float>(), T, n, v0, 1.0f / temperature, targets.data<int32_t>(),
                                  lse.data<float>(), dlogp.data<float>(), stream_, g.raw());
      }
      {
        const OpTimer t(*this, "token_logprobs_backward: dgrad GEMM", 2);
        gemm_->gemm(false, false, T, D, n, g.raw(), w.raw(), DType::BF16, dh.raw(), DType::F32, 1.0f,
                    v0 == 0 ? 0.0f : 1.0f);
      }
      if (dlm_head) {
        const OpTimer t(*this, "token_logprobs_backward: wgrad GEMM", 2);
        Tensor dchunk = dlm_head->slice_rows(v0, v0 + n);
        gemm_->gemm(true, false, n, D, T, g.raw(), hidden.raw(), DType::BF16, dchunk.raw(), dchunk.dtype(), 1.0f,
                    1.0f);
      }
    }
    launch_convert(dh.raw(), DType::F32, dhidden.raw(), dhidden.dtype(), dh.numel(), stream_);
    return;
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
    linear_backward_impl(logits, hidden, chunk, spec, &dxc, dlm_head ? &dchunk : nullptr, nullptr, nullptr);
    launch_add(dh.raw(), DType::F32, dxc.raw(), DType::F32, dh.raw(), DType::F32, dh.numel(), stream_);
  }
  launch_convert(dh.raw(), DType::F32, dhidden.raw(), dhidden.dtype(), dh.numel(), stream_);
}

// ---- generation -------------------------------------------------------------------------------

void CudaBackend::kv_round_impl(Tensor& x, const std::vector<float>& head_scale) {
  const OpTimer op_timer_(*this, "kv_round");
  // The kernel's own limit: the per-head scales go by value.
  FP8RL_CHECK(x.dim(1) <= kMaxKvRoundHeads, "kv_round: at most ", kMaxKvRoundHeads, " heads, got ", x.dim(1));
  KvRoundScales s{};
  for (size_t h = 0; h < head_scale.size(); ++h) s.v[h] = head_scale[h];
  launch_kv_round(x.raw(), x.dtype(), x.dim(0), static_cast<int>(x.dim(1)), static_cast<int>(x.dim(2)), s, stream_);
}

void CudaBackend::kv_write_impl(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const PagedBatch& batch) {
  const OpTimer op_timer_(*this, "kv_write");
  const bool latent = cache.latent_v_dim > 0;  // MLA: k only (KvCache)
  if (!latent) one_dtype({&k, &v}, "kv_write");
  const int64_t T = k.dim(0);
  const float* ks = cache.k_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads;
  const float* vs = cache.v_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads;
  launch_kv_write(k.raw(), latent ? nullptr : v.raw(), k.dtype(), batch.slots.data<int32_t>(), T, cache.num_kv_heads,
                  cache.head_dim, cache.k[layer].raw(), latent ? nullptr : cache.v[layer].raw(), cache.dtype, ks, vs,
                  stream_);
}

void CudaBackend::attention_paged_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                       float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse) {
  const OpTimer op_timer_(*this, "attention_paged");
  attention_paged_run(cache, layer, q, batch, softmax_scale, fp8_attention, out, lse, nullptr);
}

// The output's FP8 copy: by the quantizer after the kernel, or with FP8RL_CUDA_ATTN_FP8_OUT=1 (read
// at each call) written by the tensor-core kernel's epilogue (or its split combine) when it runs
// at head_dim 128. The fused form is off by default until the GPU op table has run it (it was
// written in a session whose device time ran out: docs/benchmarks.md, session 14).
void CudaBackend::attention_paged_fp8_impl(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                           float softmax_scale, bool fp8_attention, Tensor& out, Fp8View& fp8) {
  const OpTimer op_timer_(*this, "attention_paged_fp8");
  const char* fuse_env = std::getenv("FP8RL_CUDA_ATTN_FP8_OUT");
  const bool fuse = fuse_env && std::string(fuse_env) == "1";
  const Tensor out2 = out.reshape({out.dim(0), out.numel() / std::max<int64_t>(out.dim(0), 1)});
  fp8_view_prepare(fp8, out2);
  int* bad = flag_reset();
  const PagedOutFp8 o{fp8.q.data.data<uint8_t>(), fp8.q.scales.data<float>(), fp8.scales_gemm_layout, fp8.q.pow2,
                      bad};
  if (!attention_paged_run(cache, layer, q, batch, softmax_scale, fp8_attention, out, nullptr, fuse ? &o : nullptr))
    quantize_async(out2, false, fp8.q, false, fp8.scales_gemm_layout);
  flag_check("attention_paged: the output " + out.str() + " holds NaN or Inf (FP8 quantization refuses non-finite values)");
}

namespace {
constexpr bool kMlaDecodeByDefault = true;
bool mla_decode_wanted() {
  const char* e = std::getenv("FP8RL_CUDA_MLA_DECODE");
  return e ? std::string(e) == "mma" : kMlaDecodeByDefault;
}
}  // namespace

bool CudaBackend::attention_paged_run(const KvCache& cache, int layer, const Tensor& q, const PagedBatch& batch,
                                      float softmax_scale, bool fp8_attention, Tensor& out, Tensor* lse,
                                      const PagedOutFp8* out_fp8) {
  one_dtype({&q, &out}, "attention_paged");
  const int64_t T = q.dim(0);
  const int Hq = static_cast<int>(q.dim(1)), hd = static_cast<int>(q.dim(2));
  const bool latent = cache.latent_v_dim > 0;  // MLA: V = the first latent_v_dim values of the K row
  const bool e4m3 = cache.dtype == DType::E4M3;
  const float* ks = e4m3 ? cache.k_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads : nullptr;
  const float* vs = !e4m3  ? nullptr
                    : latent ? ks
                             : cache.v_scale.data<float>() + static_cast<int64_t>(layer) * cache.num_kv_heads;
  const int max_pages = static_cast<int>(batch.page_table.dim(1));
  const void* kp = cache.k[layer].raw();
  const void* vp = latent ? kp : cache.v[layer].raw();
  float* lse_out = lse ? lse->data<float>() : nullptr;
  // The tensor-core paged kernel (paged_attention.cu, paged_mma_kernel) for BF16 q over BF16 /
  // E4M3 pools, the tiled CUDA-core kernel for the other cases (F32 q or pools), the simple one
  // outside both. FP8RL_CUDA_ATTENTION=tiled / grouped / simple selects the tiled kernel, the
  // earlier paged kernel (lanes over head dims) or the one-warp-per-head reference kernel.
  // FP8RL_CUDA_PAGED_SPLITS=N forces N splits of the positions (diagnostics and tests). Both are
  // read at each call. The choice depends on the head shape, dtypes and switches only, never on
  // the batch; with batch.batch_invariant the split plan is fixed by the positions alone
  // (paged_attention_invariant_split) and FP8RL_CUDA_PAGED_SPLITS is ignored.
  const char* mode = std::getenv("FP8RL_CUDA_ATTENTION");
  const std::string md = mode ? mode : "";
  const bool simple = md == "simple", grouped = md == "grouped", tiled = md == "tiled";
  const int group = Hq / cache.num_kv_heads;
  if (batch.flash_order) {  // the consistent mode's flash order (PagedBatch): its own kernel, whatever the switches
    FP8RL_CHECK(!latent && !fp8_attention && !lse_out &&
                    flash_decode_supported(hd, group, cache.dtype, q.dtype()),
                "attention_paged (flash order): needs BF16 q over a BF16 or E4M3 cache of K and V, head_dim 64 or 128, "
                "group <= 16, no FP8 attention and no lse; got q ", q.str(), ", pool ", dtype_name(cache.dtype));
    launch_flash_decode(q.raw(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                        batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd, cache.page_size,
                        kp, vp, cache.dtype, ks, vs, softmax_scale, out.raw(), stream_);
    return false;  // an FP8 copy of out, if asked, is the caller's quantizer's
  }
  // MLA's latent cache (one 576-wide row per token, Hq query heads over it): the tensor-core
  // kernel (mla_decode.cu: a token's 16-head blocks as MMA rows over 64-position tiles) with BF16
  // q over a BF16 / E4M3 pool (the default since CudaMlaOps.LatentPagedAttentionMatchesCpu passed
  // on a GPU, session 30; FP8RL_CUDA_MLA_DECODE set to anything but "mma", read at each call,
  // selects the simple kernel), else the simple kernel.
  if (latent && !simple && !fp8_attention && mla_decode_wanted() && q.dtype() == DType::BF16 && hd == kMlaRow &&
      cache.v_dim() == kMlaV && cache.num_kv_heads == 1 &&
      launch_mla_decode(q.raw(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                        batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.page_size, kp, cache.dtype, ks,
                        softmax_scale, out.raw(), lse_out, stream_))
    return false;
  if (simple || latent || !paged_attention_supported(hd, group, cache.dtype, kp, vp)) {
    launch_attention_paged(q.raw(), q.dtype(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                           batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd, cache.v_dim(),
                           hd, cache.page_size, kp, vp, cache.dtype, ks, vs, softmax_scale, fp8_attention, out.raw(),
                           stream_, lse_out);
    return false;
  }
  const char* forced = std::getenv("FP8RL_CUDA_PAGED_SPLITS");
  const int nforced = forced ? std::atoi(forced) : 0;
  const bool mma = !grouped && !tiled && paged_attention_mma_supported(hd, group, cache.dtype, q.dtype(), kp, vp);
  // max_pos only sizes the split plan: a token past it is still served in full (last split).
  const PagedSplit plan =
      batch.batch_invariant
          ? paged_attention_invariant_split(batch.max_pos)
          : mma ? paged_attention_mma_split(T, cache.num_kv_heads, hd, cache.dtype, batch.max_pos, sm_count_, nforced)
                : paged_attention_split(T, cache.num_kv_heads, batch.max_pos, sm_count_, nforced);
  float* part = nullptr;
  if (plan.splits > 1 || lse_out) part = scratch(kSlotAttn, {T * Hq * plan.splits * (hd + 1)}, DType::F32).data<float>();
  float* part_lse = part ? part + T * Hq * plan.splits * hd : nullptr;
  const bool fused = out_fp8 && hd == 128;  // one 1x128 block per (token, head) row
  // Query runs: only runs that fit the kernel's MMA columns (same bits either way).
  const bool runs = batch.query_runs.defined() && batch.query_runs.numel() > 0 && batch.query_run_tokens >= 1 &&
                    batch.query_run_tokens <= paged_attention_run_tokens(group);
  const int variant = batch.batch_invariant ? paged_attention_mma_invariant_variant() : -1;
  if (mma && runs && !paged_attention_runs_apply(group, variant, fused)) {
    // The runs read each sequence's K/V once for all its tokens; without them every token is its
    // own CTA (same bits, much slower scoring): say so once, count every call.
    if (paged_runs_off_++ == 0)
      std::fprintf(stderr, "warning: paged attention: the query runs are off (variant %s, group %d%s): each token "
                           "is scored by its own CTA (same results, slower; counted in paged_runs_off)\n",
                   paged_attention_mma_variant_name(variant >= 0 ? variant : paged_attention_mma_variant_env()),
                   group, fused ? ", fused FP8 output" : "");
  }
  if (mma) {
    launch_paged_attention_mma(q.raw(), q.dtype(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                               batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd,
                               cache.page_size, kp, vp, cache.dtype, ks, vs, softmax_scale, fp8_attention, plan, part,
                               part_lse, out.raw(), stream_, variant, lse_out, fused ? out_fp8 : nullptr,
                               runs ? batch.query_runs.data<int32_t>() : nullptr, runs ? batch.query_runs.dim(0) : 0,
                               runs ? batch.query_run_tokens : 0,
                               static_cast<int64_t>(cache.num_pages) * cache.page_size);
    return fused;
  }
  launch_paged_attention(q.raw(), q.dtype(), batch.token_seq.data<int32_t>(), batch.token_pos.data<int32_t>(),
                         batch.page_table.data<int32_t>(), max_pages, T, Hq, cache.num_kv_heads, hd, cache.page_size,
                         kp, vp, cache.dtype, ks, vs, softmax_scale, fp8_attention, plan, part, part_lse, out.raw(),
                         stream_, grouped, lse_out);
  return false;
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

void CudaBackend::sample_impl(const Tensor& logits, const std::vector<float>& temperature,
                              const std::vector<float>& top_p, const std::vector<int>& top_k,
                              const std::vector<float>& uniforms, Tensor& tokens, Tensor& logp, int64_t valid_vocab) {
  const OpTimer op_timer_(*this, "sample");
  const int64_t B = logits.dim(0), V = logits.dim(1);
  const int64_t Vv = valid_vocab > 0 ? valid_vocab : V;  // sampled ids [0, Vv); rows are V apart
  const auto n = static_cast<size_t>(B);
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
  // Parameters: [temperature | top_p | uniform | top_k] as 4 B words (the contract checked them).
  std::vector<float> params(4 * n);
  for (size_t b = 0; b < n; ++b) {
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

void CudaBackend::sample_rows_impl(const Tensor& logits, const Tensor& rows, bool truncation, Tensor& tokens,
                                   Tensor& logp, int64_t valid_vocab) {
  const OpTimer op_timer_(*this, "sample");
  const int64_t B = logits.dim(0), V = logits.dim(1);
  const int64_t Vv = valid_vocab > 0 ? valid_vocab : V;  // sampled ids [0, Vv); rows are V apart
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
  // BF16 logits (the lm_head's output): the Gumbel kernels read them as they are; the radix
  // kernel of top-k / top-p rows takes F32, converted here for it alone (exact: the same draws).
  Tensor lf = logits;
  if (truncation && logits.dtype() == DType::BF16) {
    lf = scratch(kSlotLogits, {B, V}, DType::F32);
    launch_convert(logits.raw(), DType::BF16, lf.raw(), DType::F32, logits.numel(), stream_);
  }
  Tensor part = scratch(kSlotTmp, {static_cast<int64_t>(sample_gumbel_scratch_bytes(B, splits))}, DType::U8);
  int* f = flag_reset();
  launch_sample_gumbel(logits.raw(), logits.dtype(), B, V, Vv, r, truncation, splits, part.raw(),
                       tokens.data<int32_t>(), logp.data<float>(), f, stream_);
  if (truncation) {
    const auto* w = reinterpret_cast<const float*>(rows.raw());  // SampleRow's first four words
    launch_sample(lf.data<float>(), B, V, Vv, w, w + 1, reinterpret_cast<const int32_t*>(w + 2), w + 3, 8, true,
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
