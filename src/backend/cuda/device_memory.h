// Device memory of one CUDA backend: its one stream and the allocator of its tensors.
//
// Allocations are stream-ordered (cudaMallocFromPoolAsync / cudaFreeAsync on the backend's
// stream) from a private memory pool whose release threshold is unlimited, so freed memory stays
// in the pool and is handed out again without a device synchronization. The model allocates its
// activations per layer per step and the rollout engine small index tensors per decode step:
// with plain cudaMalloc / cudaFree every such free synchronized the device. Stream-ordered
// allocation is also legal inside CUDA graph capture. Everything runs on the one stream, so
// stream order is the only order a freed block needs.
//
// Lifetime: the stream and the pool belong to DeviceMemory, which the backend and every Storage
// it allocated share (shared_ptr). A tensor may outlive its backend: its release still frees on
// a live stream, and the last owner synchronizes the stream and destroys stream and pool.
//
// FP8RL_CUDA_ALLOC=plain (read when the backend is made): plain cudaMalloc / cudaFree instead,
// for debugging (compute-sanitizer's memcheck sees each allocation exactly).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"

namespace fp8rl::cuda {

class DeviceMemory : public std::enable_shared_from_this<DeviceMemory> {
 public:
  // Creates the stream (non-blocking) and, unless FP8RL_CUDA_ALLOC=plain, the pool on `device`
  // (which must be current).
  static std::shared_ptr<DeviceMemory> create(int device);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  cudaStream_t stream() const { return stream_; }
  bool plain() const { return pool_ == nullptr; }

  // `bytes` of device memory (nullptr for 0), released when the Storage dies. Out of memory
  // throws fp8rl::Error naming describe() (called only on failure); on the pool path a failed
  // allocation first returns the pool's unused memory to the device and tries once more.
  std::shared_ptr<Storage> allocate(size_t bytes, const std::function<std::string()>& describe);

  MemoryStats stats() const;
  void reset_peak();

 private:
  DeviceMemory() = default;
  void release(void* p, size_t bytes) noexcept;

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;  // null: plain cudaMalloc
  std::atomic<int64_t> used_{0}, peak_used_{0};
};

// Host-to-device copies that return without waiting for the GPU: the host bytes are first copied
// into one of `slots` pinned slots, whose copy is enqueued on the stream; a slot is reused only
// after the event recorded behind its last copy has completed (by then, in practice, long ago).
// So the caller may reuse or free its host bytes on return, and small per-step uploads (an MoE
// block's sorted slots, the grouped GEMM's tile table) cost no stream synchronization. The
// pinned memory is allocated at the first upload. Not for use while a CUDA graph records (a
// recorded copy would read the slot again at every replay).
class PinnedUploads {
 public:
  explicit PinnedUploads(size_t slot_bytes = size_t{256} << 10, int slots = 16);
  ~PinnedUploads();
  PinnedUploads(const PinnedUploads&) = delete;
  PinnedUploads& operator=(const PinnedUploads&) = delete;

  // Enqueues the copy of n bytes from host to dev on stream; false (nothing done) when n exceeds
  // a slot: the caller copies some other way.
  bool upload(const void* host, void* dev, size_t n, cudaStream_t stream);

 private:
  size_t slot_bytes_;
  int slots_, next_ = 0;
  unsigned char* pinned_ = nullptr;
  std::vector<cudaEvent_t> done_;
};

}  // namespace fp8rl::cuda
