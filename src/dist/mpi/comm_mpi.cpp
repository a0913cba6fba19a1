// The MPI communicator (`mpirun -np N fp8rl train ...`), built when CMake finds MPI
// (FP8RL_MPI). Host buffers only; MPI's default error handler aborts the whole job when a rank
// fails, so a dead rank stops every rank (mpirun reports which). MPI has no collective timeout.
// A rank that fails with an fp8rl error does not MPI_Finalize (which would wait for ranks
// blocked in a collective): main prints the error, then dist_abort_job MPI_Aborts the job.
#include <mpi.h>

#include <exception>
#include <string>

#include "core/error.h"
#include "dist/comm.h"

namespace fp8rl {

namespace {

void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  FP8RL_FAIL("MPI ", what, " failed: ", std::string(msg, len));
}

void mpi_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::Sum ? MPI_SUM : op == ReduceOp::Max ? MPI_MAX : MPI_MIN; }

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      mpi_check(MPI_Init(nullptr, nullptr), "MPI_Init");
      owns_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);  // errors become fp8rl::Error
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &local_rank_);
    MPI_Comm_free(&local);
  }
  ~MpiCommunicator() override {
    if (!owns_) return;
    if (std::uncaught_exceptions() > 0) dist_set_abort_hook(mpi_abort);  // unwinding from an error
    else MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return local_rank_; }
  std::string name() const override { return "mpi"; }

  void all_reduce(float* d, size_t n, ReduceOp op) override { reduce(d, n, MPI_FLOAT, op); }
  void all_reduce(double* d, size_t n, ReduceOp op) override { reduce(d, n, MPI_DOUBLE, op); }
  void all_reduce(int64_t* d, size_t n, ReduceOp op) override { reduce(d, n, MPI_INT64_T, op); }
  void reduce_scatter_sum(const float* in, float* out, size_t n) override {
    mpi_check(MPI_Reduce_scatter_block(in, out, count(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "reduce_scatter");
  }
  void all_gather(const void* in, void* out, size_t bytes) override {
    mpi_check(MPI_Allgather(in, count(bytes), MPI_BYTE, out, count(bytes), MPI_BYTE, MPI_COMM_WORLD), "all_gather");
  }
  void broadcast(void* data, size_t bytes, int root) override {
    mpi_check(MPI_Bcast(data, count(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "broadcast");
  }
  void barrier() override { mpi_check(MPI_Barrier(MPI_COMM_WORLD), "barrier"); }

 private:
  static int count(size_t n) {
    FP8RL_CHECK(n <= static_cast<size_t>(INT32_MAX), "MPI message of ", n, " elements exceeds the int count");
    return static_cast<int>(n);
  }
  void reduce(void* d, size_t n, MPI_Datatype t, ReduceOp op) {
    if (n == 0) return;
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, d, count(n), t, mpi_op(op), MPI_COMM_WORLD), "all_reduce");
  }
  int rank_ = 0, world_ = 1, local_rank_ = 0;
  bool owns_ = false;
};

}  // namespace

bool comm_mpi_available() { return true; }
std::unique_ptr<Communicator> comm_mpi_open() { return std::make_unique<MpiCommunicator>(); }

}  // namespace fp8rl
