// Collectives between the ranks of a data-parallel job (docs/design.md "Several GPUs and
// several nodes"). One interface, several implementations:
//   single  one rank, every collective a no-op (the default `fp8rl train`)
//   tcp     a star over TCP sockets, rank 0 at MASTER_ADDR:MASTER_PORT (torchrun-style
//           variables RANK / WORLD_SIZE / LOCAL_RANK); needs nothing but POSIX sockets
//   mpi     Open MPI (`mpirun -np N fp8rl train ...`), built when FP8RL_MPI finds MPI
//   nccl    NCCL on CUDA device buffers, bootstrapped over tcp or mpi (FP8RL_NCCL)
//
// Host collectives take host memory. The device_* collectives take buffers in the memory of a
// backend device for which reduces_on(kind) is true: host memory for CPU (every
// implementation), CUDA memory for nccl. dist_all_reduce_sum (below) stages through the host
// when the communicator cannot reach the tensors' device.
//
// Every rank must call the same collectives in the same order with the same sizes; the tcp
// implementation checks that and names the disagreeing rank. Errors (a peer that died, a
// timeout, mismatched world sizes) throw fp8rl::Error; main prefixes them with the rank.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace fp8rl {

class Backend;

enum class ReduceOp : uint8_t { Sum, Max, Min };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual int local_rank() const { return 0; }  // the rank within its node (picks the GPU)
  virtual std::string name() const = 0;         // "single", "tcp", "mpi", "nccl"

  // ---- host memory -------------------------------------------------------------------
  // data [n]: every rank's n values combined elementwise, the result on every rank. Sums are
  // taken in rank order (tcp, mpi with one node) where the implementation allows.
  virtual void all_reduce(float* data, size_t n, ReduceOp op) = 0;
  virtual void all_reduce(double* data, size_t n, ReduceOp op) = 0;
  virtual void all_reduce(int64_t* data, size_t n, ReduceOp op) = 0;
  // in [world_size * n] -> out [n]: rank r gets the sum of every rank's in[r*n .. r*n + n).
  virtual void reduce_scatter_sum(const float* in, float* out, size_t n) = 0;
  // in [bytes] -> out [world_size * bytes], rank r's bytes at out + r * bytes.
  virtual void all_gather(const void* in, void* out, size_t bytes) = 0;
  // data [bytes]: root's bytes on every rank.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;

  // ---- device memory -----------------------------------------------------------------
  virtual bool reduces_on(DeviceKind kind) const { return kind == DeviceKind::CPU; }
  virtual void device_all_reduce_sum(float* data, size_t n) { all_reduce(data, n, ReduceOp::Sum); }
  virtual void device_reduce_scatter_sum(const float* in, float* out, size_t n) { reduce_scatter_sum(in, out, n); }
  virtual void device_all_gather(const float* in, float* out, size_t n) { all_gather(in, out, n * sizeof(float)); }
};

// Where a job's ranks meet: what the launcher's variables say.
struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool from_mpi = false;      // launched by mpirun (OMPI_COMM_WORLD_* / PMI_* variables)
  double timeout_s = 600;     // FP8RL_DIST_TIMEOUT_S: the longest wait for a peer
  std::string backend;        // FP8RL_DIST_BACKEND: "", tcp, mpi, nccl (empty: choose)
};
// Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun, Slurm scripts),
// else OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK (mpirun). Throws on malformed values.
DistEnv dist_env_read();

// The job's communicator: single when the environment names one rank; mpi under mpirun (when
// built with MPI); tcp with the torchrun-style variables; nccl on top when `device` is CUDA and
// NCCL was built. Sets the rank prefix of error messages (dist_log_prefix).
std::unique_ptr<Communicator> dist_open(const DistEnv& env, DeviceKind device = DeviceKind::CPU);

std::unique_ptr<Communicator> comm_single_open();
// rank 0 listens on addr:port; the others connect (retrying until timeout_s). Every rank
// checks that all agree on world_size.
std::unique_ptr<Communicator> comm_tcp_open(int rank, int world_size, int local_rank, const std::string& addr,
                                            int port, double timeout_s);
bool comm_mpi_available();                      // built with FP8RL_MPI
std::unique_ptr<Communicator> comm_mpi_open();  // MPI_Init; throws when not built
bool comm_nccl_available();                     // built with FP8RL_NCCL
// NCCL over CUDA buffers: cudaSetDevice(local_rank), the unique id broadcast over `bootstrap`,
// ncclCommInitRank; host collectives go to `bootstrap`.
std::unique_ptr<Communicator> comm_nccl_open(std::unique_ptr<Communicator> bootstrap);

// After an error that ends this rank: stops the whole job where the communicator cannot let
// the others know by itself (MPI: MPI_Abort; MPI_Finalize would wait on ranks blocked in a
// collective). main calls it after printing the error; without such a hook it does nothing.
void dist_abort_job(int exit_code);
void dist_set_abort_hook(void (*hook)(int exit_code));

// "[rank 1/4] " once a job of several ranks is open, else "": main prefixes its error lines.
const std::string& dist_log_prefix();
void dist_set_log_prefix(int rank, int world_size);

// ---- helpers on top of the interface -----------------------------------------------

// Sums the tensors (F32, on backend `be`) over the ranks, in place: directly when the
// communicator reaches be's device, else through one host buffer (one collective).
void dist_all_reduce_sum(Communicator& comm, Backend& be, const std::vector<Tensor*>& tensors);

// Every rank's `local` concatenated in rank order (sizes may differ between ranks).
template <class T>
std::vector<T> dist_all_gather_v(Communicator& comm, const std::vector<T>& local) {
  const int W = comm.world_size();
  if (W == 1) return local;
  int64_t n = static_cast<int64_t>(local.size());
  std::vector<int64_t> counts(W);
  comm.all_gather(&n, counts.data(), sizeof(int64_t));
  int64_t most = 0;
  for (int64_t c : counts) most = std::max(most, c);
  std::vector<T> padded(static_cast<size_t>(most)), all(static_cast<size_t>(most) * W);
  std::copy(local.begin(), local.end(), padded.begin());
  comm.all_gather(padded.data(), all.data(), sizeof(T) * static_cast<size_t>(most));
  std::vector<T> out;
  for (int r = 0; r < W; ++r) out.insert(out.end(), all.begin() + r * most, all.begin() + r * most + counts[r]);
  return out;
}

// Rank 0's value of a trivially copyable `v` on every rank.
template <class T>
T dist_broadcast_value(Communicator& comm, T v) {
  comm.broadcast(&v, sizeof(T), 0);
  return v;
}

}  // namespace fp8rl
