// CPU backend: the thread pool behind cpu_parallel_for (see cpu_parallel.h).
#include "backend/cpu/cpu_parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fp8rl::cpu {
namespace {

thread_local bool tls_in_parallel = false;

int threads_from_env() {
  if (const char* s = std::getenv("FP8RL_CPU_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end != s && *end == '\0' && v >= 1) return static_cast<int>(std::min(v, 256L));
  }
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 256u));
}

// Workers sleep on `start_` until `generation_` changes, run their chunk of the current job,
// and count down `pending_`; the caller waits for it to reach 0.
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { worker(w); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  int threads() const { return threads_; }

  // Runs the job on all threads; the caller must hold `call_` (one job at a time).
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& f) {
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &f;
      n_ = n;
      pending_ = threads_ - 1;
      error_ = nullptr;
      ++generation_;
    }
    start_.notify_all();
    run_chunk(0);
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  std::mutex call_;  // held by the thread whose job is running

 private:
  void run_chunk(int w) {
    const int64_t begin = n_ * w / threads_, end = n_ * (w + 1) / threads_;
    if (begin >= end) return;
    tls_in_parallel = true;
    try {
      (*job_)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(m_);
      if (!error_) error_ = std::current_exception();
    }
    tls_in_parallel = false;
  }

  void worker(int w) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(m_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run_chunk(w);
      {
        std::lock_guard<std::mutex> lock(m_);
        --pending_;
      }
      done_.notify_one();
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable start_, done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool p(threads_from_env());
  return p;
}

}  // namespace

int cpu_num_threads() { return pool().threads(); }

void cpu_parallel_for(int64_t n, int64_t work, const std::function<void(int64_t, int64_t)>& f) {
  if (n <= 0) return;
  if (n == 1 || work < kParallelMinWork || tls_in_parallel || pool().threads() == 1) {
    f(0, n);
    return;
  }
  Pool& p = pool();
  std::unique_lock<std::mutex> call(p.call_, std::try_to_lock);
  if (!call.owns_lock()) {  // another thread's job is running: do this one alone
    f(0, n);
    return;
  }
  p.run(n, f);
}

}  // namespace fp8rl::cpu
