// The NCCL communicator (FP8RL_NCCL: CUDA builds where nccl.h is found). Device collectives run
// NCCL on the current stream (the default stream, which the CUDA backend uses) and wait for it;
// host collectives go to the bootstrap communicator (tcp or mpi), which also carries the NCCL
// unique id from rank 0 to the others. Not run in CI (no GPUs there).
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/error.h"
#include "dist/comm.h"

#define FP8RL_NCCL_CHECK(expr)                                                              \
  do {                                                                                      \
    const ncclResult_t _r = (expr);                                                         \
    FP8RL_CHECK(_r == ncclSuccess, #expr, ": ", ncclGetErrorString(_r), " (", ncclGetLastError(nullptr), ")"); \
  } while (0)
#define FP8RL_CUDA_CHECK_NCCL(expr)                                                 \
  do {                                                                              \
    const cudaError_t _e = (expr);                                                  \
    FP8RL_CHECK(_e == cudaSuccess, #expr, ": ", cudaGetErrorString(_e));            \
  } while (0)

namespace fp8rl {

namespace {

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::unique_ptr<Communicator> boot) : boot_(std::move(boot)) {
    int devices = 0;
    FP8RL_CUDA_CHECK_NCCL(cudaGetDeviceCount(&devices));
    if (boot_->local_rank() >= devices)
      FP8RL_FAIL("LOCAL_RANK ", boot_->local_rank(), " but this node has ", devices, " GPUs; launch at most ", devices,
                 " ranks per node");
    FP8RL_CUDA_CHECK_NCCL(cudaSetDevice(boot_->local_rank()));  // before ncclCommInitRank
    ncclUniqueId id;
    if (boot_->rank() == 0) FP8RL_NCCL_CHECK(ncclGetUniqueId(&id));
    boot_->broadcast(&id, sizeof id, 0);
    FP8RL_NCCL_CHECK(ncclCommInitRank(&comm_, boot_->world_size(), id, boot_->rank()));
  }
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  int rank() const override { return boot_->rank(); }
  int world_size() const override { return boot_->world_size(); }
  int local_rank() const override { return boot_->local_rank(); }
  std::string name() const override { return "nccl"; }

  void all_reduce(float* d, size_t n, ReduceOp op) override { boot_->all_reduce(d, n, op); }
  void all_reduce(double* d, size_t n, ReduceOp op) override { boot_->all_reduce(d, n, op); }
  void all_reduce(int64_t* d, size_t n, ReduceOp op) override { boot_->all_reduce(d, n, op); }
  void reduce_scatter_sum(const float* in, float* out, size_t n) override { boot_->reduce_scatter_sum(in, out, n); }
  void all_gather(const void* in, void* out, size_t bytes) override { boot_->all_gather(in, out, bytes); }
  void broadcast(void* data, size_t bytes, int root) override { boot_->broadcast(data, bytes, root); }
  void barrier() override { boot_->barrier(); }

  bool reduces_on(DeviceKind kind) const override { return kind == DeviceKind::CUDA; }
  void device_all_reduce_sum(float* d, size_t n) override {
    FP8RL_NCCL_CHECK(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, comm_, nullptr));
    FP8RL_CUDA_CHECK_NCCL(cudaStreamSynchronize(nullptr));
  }
  void device_reduce_scatter_sum(const float* in, float* out, size_t n) override {
    FP8RL_NCCL_CHECK(ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, comm_, nullptr));
    FP8RL_CUDA_CHECK_NCCL(cudaStreamSynchronize(nullptr));
  }
  void device_all_gather(const float* in, float* out, size_t n) override {
    FP8RL_NCCL_CHECK(ncclAllGather(in, out, n, ncclFloat32, comm_, nullptr));
    FP8RL_CUDA_CHECK_NCCL(cudaStreamSynchronize(nullptr));
  }

 private:
  std::unique_ptr<Communicator> boot_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool comm_nccl_available() { return true; }
std::unique_ptr<Communicator> comm_nccl_open(std::unique_ptr<Communicator> bootstrap) {
  return std::make_unique<NcclCommunicator>(std::move(bootstrap));
}

}  // namespace fp8rl
