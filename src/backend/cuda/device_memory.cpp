#include "backend/cuda/device_memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace fp8rl::cuda {

namespace {

bool plain_requested() {
  const char* e = std::getenv("FP8RL_CUDA_ALLOC");
  if (!e || !*e) return false;
  const std::string v(e);
  FP8RL_CHECK(v == "plain" || v == "pool", "FP8RL_CUDA_ALLOC must be 'plain' (cudaMalloc / cudaFree) or 'pool' ",
              "(the default: stream-ordered from a caching pool), got '", v, "'");
  return v == "plain";
}

uint64_t pool_attr(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  uint64_t v = 0;
  CUDA_CHECK(cudaMemPoolGetAttribute(pool, attr, &v), "reading a memory pool statistic");
  return v;
}

}  // namespace

std::shared_ptr<DeviceMemory> DeviceMemory::create(int device) {
  std::shared_ptr<DeviceMemory> m(new DeviceMemory());
  m->device_ = device;
  CUDA_CHECK(cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking), "creating the backend's stream");
  int pools = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device), "asking for memory pools");
  if (plain_requested() || !pools) return m;  // no pool: plain cudaMalloc
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  CUDA_CHECK(cudaMemPoolCreate(&m->pool_, &props), "creating the backend's memory pool");
  // Keep freed memory in the pool (the default threshold 0 returns it at every synchronization).
  uint64_t keep = UINT64_MAX;
  CUDA_CHECK(cudaMemPoolSetAttribute(m->pool_, cudaMemPoolAttrReleaseThreshold, &keep),
             "setting the memory pool's release threshold");
  return m;
}

DeviceMemory::~DeviceMemory() {
  // The last owner: no Storage of ours is alive. Errors are ignored (a destructor, possibly at
  // process exit after the CUDA runtime is gone).
  if (stream_) cudaStreamSynchronize(stream_);
  if (pool_) cudaMemPoolDestroy(pool_);
  if (stream_) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

std::shared_ptr<Storage> DeviceMemory::allocate(size_t bytes, const std::function<std::string()>& describe) {
  auto st = std::make_shared<Storage>();
  st->device = DeviceKind::CUDA;
  st->bytes = bytes;
  if (bytes == 0) return st;
  void* p = nullptr;
  if (!pool_) {
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) throw_alloc_error(e, bytes, describe(), "cudaMalloc");
  } else {
    cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, pool_, stream_);
    if (e == cudaErrorMemoryAllocation) {
      // The pool may hold freed blocks of other sizes: give them back to the device and retry.
      cudaGetLastError();
      CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting for the GPU before trimming the memory pool");
      CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0), "trimming the memory pool");
      e = cudaMallocFromPoolAsync(&p, bytes, pool_, stream_);
    }
    if (e != cudaSuccess) throw_alloc_error(e, bytes, describe(), "cudaMallocFromPoolAsync");
  }
  const int64_t used = used_.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = peak_used_.load();
  while (used > peak && !peak_used_.compare_exchange_weak(peak, used)) {
  }
  st->ptr = p;
  st->release = [self = shared_from_this(), bytes](void* q) { self->release(q, bytes); };
  return st;
}

void DeviceMemory::release(void* p, size_t bytes) noexcept {
  used_.fetch_sub(static_cast<int64_t>(bytes));
  // Stream order makes the block free only after the work queued so far; a failure here (the
  // runtime shutting down at exit) cannot be reported from a destructor and leaks nothing.
  if (pool_) cudaFreeAsync(p, stream_);
  else cudaFree(p);
  cudaGetLastError();
}

MemoryStats DeviceMemory::stats() const {
  MemoryStats s;
  s.used_bytes = used_.load();
  s.peak_used_bytes = peak_used_.load();
  if (pool_) {
    s.reserved_bytes = static_cast<int64_t>(pool_attr(pool_, cudaMemPoolAttrReservedMemCurrent));
    s.peak_reserved_bytes = static_cast<int64_t>(pool_attr(pool_, cudaMemPoolAttrReservedMemHigh));
  } else {
    s.reserved_bytes = s.used_bytes;
    s.peak_reserved_bytes = s.peak_used_bytes;
  }
  return s;
}

void DeviceMemory::reset_peak() {
  peak_used_.store(used_.load());
  if (pool_) {
    uint64_t zero = 0;  // the only value these attributes accept: resets to the current value
    CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero), "resetting the pool's peak");
    CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero), "resetting the pool's peak");
  }
}

PinnedUploads::PinnedUploads(size_t slot_bytes, int slots) : slot_bytes_(slot_bytes), slots_(slots) {}

PinnedUploads::~PinnedUploads() {
  for (cudaEvent_t e : done_) {
    cudaEventSynchronize(e);
    cudaEventDestroy(e);
  }
  if (pinned_) cudaFreeHost(pinned_);
}

bool PinnedUploads::upload(const void* host, void* dev, size_t n, cudaStream_t stream) {
  if (n > slot_bytes_) return false;
  if (!pinned_) {
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_), slot_bytes_ * static_cast<size_t>(slots_)),
               "allocating ", slot_bytes_ * static_cast<size_t>(slots_), " bytes of pinned upload slots");
    done_.resize(static_cast<size_t>(slots_));
    for (cudaEvent_t& e : done_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating an event");
  }
  const int slot = next_;
  next_ = (next_ + 1) % slots_;
  CUDA_CHECK(cudaEventSynchronize(done_[static_cast<size_t>(slot)]), "waiting for a pinned upload slot");
  unsigned char* p = pinned_ + static_cast<size_t>(slot) * slot_bytes_;
  std::memcpy(p, host, n);
  CUDA_CHECK(cudaMemcpyAsync(dev, p, n, cudaMemcpyHostToDevice, stream), "uploading ", n, " bytes");
  CUDA_CHECK(cudaEventRecord(done_[static_cast<size_t>(slot)], stream), "recording a pinned upload's event");
  return true;
}

}  // namespace fp8rl::cuda
