// The TCP communicator: a star with rank 0 at the centre (MASTER_ADDR:MASTER_PORT). Every
// collective is "the others send to rank 0, rank 0 combines in rank order and sends back", so
// results are deterministic and identical on every rank. Meant for the CPU backend, tests and
// bootstrapping NCCL (whose unique id it broadcasts), not for bandwidth.
//
// Every message carries a header {op, bytes}; rank 0 checks that each rank called the same
// collective with the same size. Every wait is bounded by timeout_s; a peer that exits closes
// its socket, and the ranks waiting on it fail naming it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "dist/comm.h"

namespace fp8rl {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x46503844;  // "FP8D"

enum class Op : uint32_t { Hello = 1, Ack, AllReduceF32, AllReduceF64, AllReduceI64, AllGather, Broadcast, Barrier };

const char* op_name(uint32_t op) {
  switch (static_cast<Op>(op)) {
    case Op::Hello: return "hello";
    case Op::Ack: return "ack";
    case Op::AllReduceF32: return "all_reduce(f32)";
    case Op::AllReduceF64: return "all_reduce(f64)";
    case Op::AllReduceI64: return "all_reduce(i64)";
    case Op::AllGather: return "all_gather";
    case Op::Broadcast: return "broadcast";
    case Op::Barrier: return "barrier";
  }
  return "unknown";
}

struct Header {
  uint32_t op = 0, reduce = 0;
  uint64_t bytes = 0;
};

struct Hello {
  uint32_t magic = kMagic;
  int32_t rank = 0, world_size = 0, reserved = 0;
};

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(int rank, int world, int local_rank, const std::string& addr, int port, double timeout_s)
      : rank_(rank), world_(world), local_rank_(local_rank), timeout_s_(timeout_s) {
    FP8RL_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of world size ", world);
    FP8RL_CHECK(port > 0 && port < 65536, "MASTER_PORT must be in 1..65535, got ", port);
    peers_.assign(world, -1);
    try {
      if (rank == 0) listen_and_accept(addr, port);
      else connect_to_root(addr, port);
    } catch (...) {
      close_all();
      throw;
    }
  }
  ~TcpCommunicator() override { close_all(); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return local_rank_; }
  std::string name() const override { return "tcp"; }

  void all_reduce(float* d, size_t n, ReduceOp op) override { reduce(Op::AllReduceF32, d, n, op); }
  void all_reduce(double* d, size_t n, ReduceOp op) override { reduce(Op::AllReduceF64, d, n, op); }
  void all_reduce(int64_t* d, size_t n, ReduceOp op) override { reduce(Op::AllReduceI64, d, n, op); }

  void reduce_scatter_sum(const float* in, float* out, size_t n) override {
    std::vector<float> all(in, in + n * world_);
    all_reduce(all.data(), all.size(), ReduceOp::Sum);
    std::memcpy(out, all.data() + n * rank_, n * sizeof(float));
  }

  void all_gather(const void* in, void* out, size_t bytes) override {
    const Header h{static_cast<uint32_t>(Op::AllGather), 0, bytes};
    char* o = static_cast<char*>(out);
    if (rank_ == 0) {
      std::memmove(o, in, bytes);
      for (int r = 1; r < world_; ++r) recv_checked(r, h, o + r * bytes);
      for (int r = 1; r < world_; ++r) send_msg(r, Header{h.op, 0, bytes * world_}, o);
    } else {
      send_msg(0, h, in);
      recv_checked(0, Header{h.op, 0, bytes * world_}, o);
    }
  }

  void broadcast(void* data, size_t bytes, int root) override {
    FP8RL_CHECK(root >= 0 && root < world_, "broadcast root ", root, " of world size ", world_);
    if (root != 0) {  // rare (small values): through an all-gather
      std::vector<char> all(bytes * world_);
      all_gather(data, all.data(), bytes);
      std::memcpy(data, all.data() + bytes * root, bytes);
      return;
    }
    const Header h{static_cast<uint32_t>(Op::Broadcast), 0, bytes};
    if (rank_ == 0) {
      for (int r = 1; r < world_; ++r) send_msg(r, h, data);
    } else {
      recv_checked(0, h, data);
    }
  }

  void barrier() override {
    int64_t x = 0;
    reduce(Op::Barrier, &x, 1, ReduceOp::Sum);
  }

 private:
  template <class T>
  void reduce(Op code, T* data, size_t n, ReduceOp op) {
    if (world_ == 1) return;
    const Header h{static_cast<uint32_t>(code), static_cast<uint32_t>(op), n * sizeof(T)};
    if (rank_ == 0) {
      std::vector<T> other(n);
      for (int r = 1; r < world_; ++r) {  // rank order: (x0 + x1) + x2 ...
        recv_checked(r, h, other.data());
        for (size_t i = 0; i < n; ++i) {
          if (op == ReduceOp::Sum) data[i] += other[i];
          else if (op == ReduceOp::Max) data[i] = std::max(data[i], other[i]);
          else data[i] = std::min(data[i], other[i]);
        }
      }
      for (int r = 1; r < world_; ++r) send_msg(r, h, data);
    } else {
      send_msg(0, h, data);
      recv_checked(0, h, data);
    }
  }

  double remaining(Clock::time_point deadline) const {
    return std::chrono::duration<double>(deadline - Clock::now()).count();
  }

  // Waits for fd to become ready for `events` before the deadline.
  void wait_fd(int peer, short events, Clock::time_point deadline, const char* what) {
    for (;;) {
      const double left = remaining(deadline);
      if (left <= 0)
        FP8RL_FAIL("timed out after ", timeout_s_, " s waiting for rank ", peer, " (", what, "): it is stuck, slower "
                   "than the timeout, or running a different step or config; raise FP8RL_DIST_TIMEOUT_S if it is "
                   "only slow");
      pollfd p{peers_[peer], events, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::min(left * 1000.0, 1000.0)) + 1);
      if (rc > 0) return;
      if (rc < 0 && errno != EINTR) FP8RL_FAIL("poll on the connection to rank ", peer, ": ", std::strerror(errno));
    }
  }

  [[noreturn]] void peer_gone(int peer) const {
    FP8RL_FAIL("rank ", peer, " closed its connection (it exited or crashed; its own error message says why)");
  }

  void send_bytes(int peer, const void* p, size_t n, Clock::time_point deadline) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      wait_fd(peer, POLLOUT, deadline, "sending");
      const ssize_t k = ::send(peers_[peer], c, n, MSG_NOSIGNAL);
      if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) peer_gone(peer);
      if (k < 0) FP8RL_FAIL("send to rank ", peer, ": ", std::strerror(errno));
      c += k;
      n -= static_cast<size_t>(k);
    }
  }

  void recv_bytes(int peer, void* p, size_t n, Clock::time_point deadline) {
    char* c = static_cast<char*>(p);
    while (n > 0) {
      wait_fd(peer, POLLIN, deadline, "receiving");
      const ssize_t k = ::recv(peers_[peer], c, n, 0);
      if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (k == 0 || (k < 0 && errno == ECONNRESET)) peer_gone(peer);
      if (k < 0) FP8RL_FAIL("recv from rank ", peer, ": ", std::strerror(errno));
      c += k;
      n -= static_cast<size_t>(k);
    }
  }

  Clock::time_point deadline() const {
    return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
  }

  void send_msg(int peer, const Header& h, const void* data) {
    const auto d = deadline();
    send_bytes(peer, &h, sizeof h, d);
    if (h.bytes) send_bytes(peer, data, h.bytes, d);
  }

  // Receives a message that must match `want` (the same collective, the same size).
  void recv_checked(int peer, const Header& want, void* data) {
    const auto d = deadline();
    Header h;
    recv_bytes(peer, &h, sizeof h, d);
    if (h.op != want.op || h.bytes != want.bytes || h.reduce != want.reduce)
      FP8RL_FAIL("ranks disagree on the collective: rank ", peer, " called ", op_name(h.op), " of ", h.bytes,
                 " bytes where rank ", rank_, " called ", op_name(want.op), " of ", want.bytes,
                 " bytes (different configs, or a rank on a different step)");
    recv_bytes(peer, data, h.bytes, d);
  }

  void listen_and_accept(const std::string& addr, int port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    FP8RL_CHECK(listen_fd_ >= 0, "socket: ", std::strerror(errno));
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in sa = resolve(addr, port);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
      FP8RL_FAIL("rank 0 cannot listen on ", addr, ":", port, " (", std::strerror(errno), "); pick a free ",
                 "MASTER_PORT, and a MASTER_ADDR of this host");
    FP8RL_CHECK(::listen(listen_fd_, world_) == 0, "listen: ", std::strerror(errno));
    const auto d = deadline();
    for (int got = 1; got < world_;) {
      const double left = remaining(d);
      if (left <= 0) {
        std::string missing;
        for (int r = 1; r < world_; ++r)
          if (peers_[r] < 0) missing += " " + std::to_string(r);
        FP8RL_FAIL("timed out after ", timeout_s_, " s waiting for ranks", missing, " to connect to ", addr, ":",
                   port, "; start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE=", world_);
      }
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min(left * 1000.0, 1000.0)) + 1) <= 0) continue;
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      set_nodelay(fd);
      Hello h;
      peers_.push_back(fd);  // temporarily, so recv_bytes can read it
      const int tmp = static_cast<int>(peers_.size()) - 1;
      try {
        recv_bytes(tmp, &h, sizeof h, d);
      } catch (const Error&) {
        ::close(fd);
        peers_.pop_back();
        continue;  // not one of ours (a port scan, a rank that died while connecting)
      }
      peers_.pop_back();
      std::string bad;
      if (h.magic != kMagic) bad = "a connection that is not an fp8rl rank";
      else if (h.world_size != world_)
        bad = "rank " + std::to_string(h.rank) + " has WORLD_SIZE=" + std::to_string(h.world_size) +
              " but rank 0 has WORLD_SIZE=" + std::to_string(world_);
      else if (h.rank <= 0 || h.rank >= world_) bad = "a connection claims rank " + std::to_string(h.rank);
      else if (peers_[h.rank] >= 0) bad = "two processes claim rank " + std::to_string(h.rank);
      const Header ack{static_cast<uint32_t>(Op::Ack), bad.empty() ? 1u : 0u, bad.size()};
      peers_.push_back(fd);
      try {
        send_msg(tmp, ack, bad.data());
      } catch (const Error&) {
      }
      peers_.pop_back();
      if (!bad.empty()) {
        ::close(fd);
        if (h.magic != kMagic) continue;
        FP8RL_FAIL("rendezvous at ", addr, ":", port, ": ", bad, "; launch every rank with the same WORLD_SIZE and ",
                   "distinct RANKs 0..WORLD_SIZE-1");
      }
      peers_[h.rank] = fd;
      ++got;
    }
    ::close(listen_fd_);
    listen_fd_ = -1;
  }

  void connect_to_root(const std::string& addr, int port) {
    const auto d = deadline();
    sockaddr_in sa = resolve(addr, port);
    for (;;) {  // rank 0 may not listen yet: retry until the deadline
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      FP8RL_CHECK(fd >= 0, "socket: ", std::strerror(errno));
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
        peers_[0] = fd;
        break;
      }
      ::close(fd);
      if (remaining(d) <= 0)
        FP8RL_FAIL("timed out after ", timeout_s_, " s connecting to rank 0 at ", addr, ":", port,
                   " (", std::strerror(errno), "); is rank 0 running with the same MASTER_ADDR and MASTER_PORT?");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    set_nodelay(peers_[0]);
    const Hello h{kMagic, rank_, world_, 0};
    send_bytes(0, &h, sizeof h, d);
    Header ack;
    recv_bytes(0, &ack, sizeof ack, d);
    FP8RL_CHECK(ack.op == static_cast<uint32_t>(Op::Ack) && ack.bytes < 4096, "rendezvous: a malformed reply from ",
                addr, ":", port, " (is something other than fp8rl rank 0 listening there?)");
    std::string why(ack.bytes, '\0');
    if (ack.bytes) recv_bytes(0, why.data(), ack.bytes, d);
    if (ack.reduce != 1) FP8RL_FAIL("rank 0 refused this rank: ", why);
  }

  static sockaddr_in resolve(const std::string& addr, int port) {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) == 1) return sa;
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(addr.c_str(), nullptr, &hints, &res) != 0 || !res)
      FP8RL_FAIL("MASTER_ADDR='", addr, "' does not resolve to an IPv4 address");
    sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    ::freeaddrinfo(res);
    return sa;
  }

  static void set_nodelay(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }

  void close_all() {
    for (int& fd : peers_)
      if (fd >= 0) {
        ::close(fd);
        fd = -1;
      }
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
  }

  int rank_, world_, local_rank_;
  double timeout_s_;
  std::vector<int> peers_;  // [world] socket to each rank (rank 0: all others; others: [0] only)
  int listen_fd_ = -1;
};

}  // namespace

std::unique_ptr<Communicator> comm_tcp_open(int rank, int world_size, int local_rank, const std::string& addr,
                                            int port, double timeout_s) {
  return std::make_unique<TcpCommunicator>(rank, world_size, local_rank, addr, port, timeout_s);
}

}  // namespace fp8rl
