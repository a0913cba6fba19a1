// The embedding's backward without atomics, so the same bits every run and the CPU reference's
// (cpu_layers.cpp: row by row in token order, F32): the token indices are sorted by id with CUB's
// radix sort (stable, so a run of equal ids keeps token order), then the block at the first
// position of each run adds the run's dout rows to its table row one token after another,
// dtable[id] + dout[t0] + dout[t1] + ... as F32 sums — what the CPU computes for that row.
// (Was: one block per token adding its row with FP32 atomicAdd, in no fixed order.)
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

__global__ void iota_i32_kernel(int32_t* v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    v[i] = static_cast<int32_t>(i);
}

// Block i: nothing unless position i starts a run of equal ids in the sorted keys; then the run's
// rows (token indices vals[i ..]) added in order to table row keys[i]. An id outside [0, V)
// raises the flag (the run is skipped).
template <class TD>
__global__ void embedding_backward_runs_kernel(const int32_t* keys, const int32_t* vals, int64_t ntok, const TD* dout,
                                               int64_t V, int64_t D, float* dtable, int* bad) {
  const int64_t i = blockIdx.x;
  const int32_t id = keys[i];
  if (i > 0 && keys[i - 1] == id) return;
  if (id < 0 || id >= V) {
    if (threadIdx.x == 0) atomicExch(bad, 1);
    return;
  }
  int64_t end = i + 1;
  while (end < ntok && keys[end] == id) ++end;
  float* row = dtable + static_cast<int64_t>(id) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = row[d];
    for (int64_t j = i; j < end; ++j) acc += load_f(dout, static_cast<int64_t>(vals[j]) * D + d);
    row[d] = acc;
  }
}

// The sort's buffers in one scratch allocation: keys_out, vals_in, vals_out (ntok each), then
// CUB's temporary storage.
size_t sort_temp_bytes(int64_t ntok) {
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(ntok)),
             "sizing the embedding backward's sort");
  return bytes;
}
int64_t ids_bytes(int64_t ntok) { return (ntok * 4 + 255) / 256 * 256; }

}  // namespace

int64_t embedding_backward_scratch_bytes(int64_t ntok) {
  if (ntok == 0) return 0;
  return 3 * ids_bytes(ntok) + static_cast<int64_t>(sort_temp_bytes(ntok));
}

void launch_embedding_backward(const int32_t* ids, int64_t ntok, const void* dout, DType ddt, int64_t V, int64_t D,
                               float* dtable, int* bad_flag, void* scratch, int64_t scratch_bytes,
                               cudaStream_t stream) {
  if (ntok == 0) return;
  FP8RL_CHECK(ntok <= 0x7fffffff, "embedding_backward: ", ntok, " tokens in one call (at most 2^31 - 1)");
  FP8RL_CHECK(scratch_bytes >= embedding_backward_scratch_bytes(ntok),
              "embedding_backward: a scratch of ", scratch_bytes, " bytes, ", embedding_backward_scratch_bytes(ntok),
              " needed");
  unsigned char* base = static_cast<unsigned char*>(scratch);
  int32_t* keys_out = reinterpret_cast<int32_t*>(base);
  int32_t* vals_in = reinterpret_cast<int32_t*>(base + ids_bytes(ntok));
  int32_t* vals_out = reinterpret_cast<int32_t*>(base + 2 * ids_bytes(ntok));
  void* temp = base + 3 * ids_bytes(ntok);
  size_t temp_bytes = static_cast<size_t>(scratch_bytes - 3 * ids_bytes(ntok));
  iota_i32_kernel<<<grid_for(ntok, 256), 256, 0, stream>>>(vals_in, ntok);
  CUDA_CHECK_LAUNCH("iota_i32_kernel");
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, keys_out, vals_in, vals_out, static_cast<int>(ntok),
                                             0, static_cast<int>(sizeof(int32_t) * 8), stream),
             "sorting the embedding backward's token ids");
  FP8RL_DISPATCH_FLOAT(ddt, "embedding gradient", {
    embedding_backward_runs_kernel<T><<<static_cast<unsigned>(ntok), 256, 0, stream>>>(
        keys_out, vals_out, ntok, static_cast<const T*>(dout), V, D, dtable, bad_flag);
  });
  CUDA_CHECK_LAUNCH("embedding_backward_runs_kernel");
}

}  // namespace fp8rl::cuda
