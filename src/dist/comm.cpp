// The launcher's environment, the choice of communicator, the single-rank communicator and
// the helpers of comm.h.
#include "dist/comm.h"

#include <cstdlib>
#include <cstring>

#include "backend/backend.h"
#include "core/error.h"

namespace fp8rl {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback, int lo) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > (1 << 30))
    FP8RL_FAIL("environment variable ", name, "='", v, "' is not an integer >= ", lo,
               "; the launcher (torchrun, mpirun, a Slurm script) sets it, or unset it for one process");
  return static_cast<int>(x);
}

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "single"; }
  void all_reduce(float*, size_t, ReduceOp) override {}
  void all_reduce(double*, size_t, ReduceOp) override {}
  void all_reduce(int64_t*, size_t, ReduceOp) override {}
  void reduce_scatter_sum(const float* in, float* out, size_t n) override {
    if (in != out) std::memmove(out, in, n * sizeof(float));
  }
  void all_gather(const void* in, void* out, size_t bytes) override {
    if (in != out) std::memmove(out, in, bytes);
  }
  void broadcast(void*, size_t, int root) override {
    FP8RL_CHECK(root == 0, "broadcast from rank ", root, " in a job of one rank");
  }
  void barrier() override {}
  bool reduces_on(DeviceKind) const override { return true; }  // nothing to move
  void device_all_reduce_sum(float*, size_t) override {}
  void device_reduce_scatter_sum(const float* in, float* out, size_t n) override {
    FP8RL_CHECK(in == out, "single-rank device reduce-scatter must be in place");
  }
  void device_all_gather(const float* in, float* out, size_t) override {
    FP8RL_CHECK(in == out, "single-rank device all-gather must be in place");
  }
};

std::string& log_prefix() {
  static std::string p;
  return p;
}

void (*g_abort_hook)(int) = nullptr;

}  // namespace

DistEnv dist_env_read() {
  DistEnv e;
  if (env("WORLD_SIZE") || env("RANK")) {  // torchrun, Slurm scripts, the tests
    e.world_size = env_int("WORLD_SIZE", 1, 1);
    e.rank = env_int("RANK", 0, 0);
    e.local_rank = env_int("LOCAL_RANK", e.rank, 0);
  } else if (env("OMPI_COMM_WORLD_SIZE")) {  // mpirun (Open MPI)
    e.from_mpi = true;
    e.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1, 1);
    e.rank = env_int("OMPI_COMM_WORLD_RANK", 0, 0);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, 0);
  } else if (env("PMI_SIZE")) {  // MPICH / Slurm PMI
    e.from_mpi = true;
    e.world_size = env_int("PMI_SIZE", 1, 1);
    e.rank = env_int("PMI_RANK", 0, 0);
    e.local_rank = env_int("MPI_LOCALRANKID", 0, 0);
  }
  if (const char* a = env("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", 0, 0);
  e.timeout_s = env_int("FP8RL_DIST_TIMEOUT_S", 600, 1);
  if (const char* b = env("FP8RL_DIST_BACKEND")) e.backend = b;
  if (e.rank >= e.world_size)
    FP8RL_FAIL("RANK=", e.rank, " is not below WORLD_SIZE=", e.world_size, "; ranks are 0 .. WORLD_SIZE-1");
  return e;
}

std::unique_ptr<Communicator> dist_open(const DistEnv& e, DeviceKind device) {
  if (!e.backend.empty() && e.backend != "tcp" && e.backend != "mpi" && e.backend != "nccl")
    FP8RL_FAIL("FP8RL_DIST_BACKEND='", e.backend, "' is not one of tcp, mpi, nccl");
  if (e.world_size == 1 && e.backend.empty()) return comm_single_open();
  dist_set_log_prefix(e.rank, e.world_size);  // rendezvous errors name the rank too
  std::unique_ptr<Communicator> host;
  const bool want_mpi = e.backend == "mpi" || (e.backend != "tcp" && e.from_mpi && comm_mpi_available());
  if (want_mpi) {
    host = comm_mpi_open();
  } else {
    if (e.master_port == 0)
      FP8RL_FAIL(e.from_mpi ? "launched by mpirun, but this fp8rl was built without MPI (FP8RL_MPI: install "
                              "libopenmpi-dev and rebuild), and MASTER_PORT is not set for the TCP rendezvous"
                            : "WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (where rank 0 listens), as "
                              "torchrun sets them");
    host = comm_tcp_open(e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.timeout_s);
  }
  if (host->world_size() != e.world_size)
    FP8RL_FAIL("the launcher's variables say ", e.world_size, " ranks but the ", host->name(), " job has ",
               host->world_size(), "; launch every rank with the same WORLD_SIZE");
  dist_set_log_prefix(host->rank(), host->world_size());
  const bool want_nccl = e.backend == "nccl" || (device == DeviceKind::CUDA && comm_nccl_available());
  if (want_nccl) return comm_nccl_open(std::move(host));
  return host;
}

std::unique_ptr<Communicator> comm_single_open() { return std::make_unique<SingleCommunicator>(); }

void dist_abort_job(int exit_code) {
  if (g_abort_hook) g_abort_hook(exit_code);
}
void dist_set_abort_hook(void (*hook)(int)) { g_abort_hook = hook; }

const std::string& dist_log_prefix() { return log_prefix(); }

void dist_set_log_prefix(int rank, int world_size) {
  log_prefix() = world_size > 1 ? "[rank " + std::to_string(rank) + "/" + std::to_string(world_size) + "] " : "";
}

void dist_all_reduce_sum(Communicator& comm, Backend& be, const std::vector<Tensor*>& tensors) {
  if (comm.world_size() == 1) return;
  bool all_f32 = true;
  for (const Tensor* t : tensors) {
    FP8RL_CHECK(t->dtype() == DType::F32 || t->dtype() == DType::BF16, "dist_all_reduce_sum takes F32 or BF16 "
                "tensors, got ", t->str());
    all_f32 &= t->dtype() == DType::F32;
  }
  if (be.device() == DeviceKind::CUDA && comm.reduces_on(DeviceKind::CUDA)) {
    FP8RL_CHECK(all_f32, "the NCCL gradient all-reduce takes F32 gradients; train.grad_dtype: bf16 is not supported "
                "with NCCL yet (use train.grad_dtype: fp32, or FP8RL_DIST_BACKEND=tcp)");
    be.synchronize();  // the gradients are written on the backend's stream; NCCL runs on its own
    for (Tensor* t : tensors) comm.device_all_reduce_sum(t->data<float>(), static_cast<size_t>(t->numel()));
    return;
  }
  // One host buffer: one collective, whatever the number of tensors.
  std::vector<float> flat;
  for (const Tensor* t : tensors) {
    const std::vector<float> h = to_float_vector(be.to_host(*t));
    flat.insert(flat.end(), h.begin(), h.end());
  }
  comm.all_reduce(flat.data(), flat.size(), ReduceOp::Sum);
  size_t at = 0;
  for (Tensor* t : tensors) {
    const size_t n = static_cast<size_t>(t->numel());
    const std::vector<float> part(flat.begin() + at, flat.begin() + at + n);
    be.copy(from_float_vector(part, t->shape(), t->dtype()), *t);  // BF16: the F32 sum rounded once
    at += n;
  }
}

#ifndef FP8RL_HAVE_MPI
bool comm_mpi_available() { return false; }
std::unique_ptr<Communicator> comm_mpi_open() {
  FP8RL_FAIL("this fp8rl was built without MPI; install libopenmpi-dev (scripts/install-deps.sh) and rebuild "
             "(cmake -DFP8RL_MPI=ON), or launch with the torchrun-style variables (RANK, WORLD_SIZE, "
             "MASTER_ADDR, MASTER_PORT) instead");
}
#endif

#ifndef FP8RL_HAVE_NCCL
bool comm_nccl_available() { return false; }
std::unique_ptr<Communicator> comm_nccl_open(std::unique_ptr<Communicator>) {
  FP8RL_FAIL("this fp8rl was built without NCCL (FP8RL_NCCL needs CUDA and nccl.h); unset FP8RL_DIST_BACKEND=nccl");
}
#endif

}  // namespace fp8rl
