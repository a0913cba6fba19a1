// The rollout scheduler (scheduler.h): token budget, on-demand pages, prefix sharing and
// recompute preemption.
#include "rollout/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "core/error.h"

namespace fp8rl {

PagePool::PagePool(int num_pages) : free_(num_pages), refs_(num_pages, 0) {
  std::iota(free_.rbegin(), free_.rend(), 0);
}

int32_t PagePool::alloc() {
  FP8RL_CHECK(!free_.empty(), "rollout: internal error: page allocation from an empty pool");
  const int32_t p = free_.back();
  free_.pop_back();
  refs_[p] = 1;
  return p;
}

void PagePool::retain(int32_t page) {
  FP8RL_CHECK(refs_[page] > 0, "rollout: internal error: sharing free page ", page);
  refs_[page]++;
}

void PagePool::release(const std::vector<int32_t>& pages) {
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    FP8RL_CHECK(refs_[*it] > 0, "rollout: internal error: releasing free page ", *it);
    if (--refs_[*it] == 0) free_.push_back(*it);
  }
}

Scheduler::Scheduler(std::vector<Sequence>& seqs, int num_pages, const SchedulerLimits& limits, RolloutStats& stats)
    : seqs_(seqs), pool_(num_pages), lim_(limits), stats_(stats) {
  FP8RL_CHECK(lim_.page_size > 0 && lim_.max_batch > 0 && lim_.max_batch_tokens > 0,
              "rollout: page_size, max_batch and max_batch_tokens must be positive");
  int requests = 0;
  for (size_t i = 0; i < seqs_.size(); ++i) {
    waiting_.push_back(static_cast<int>(i));
    requests = std::max(requests, seqs_[i].request + 1);
  }
  holder_.assign(requests, -1);
}

bool Scheduler::reserve(Sequence& s) {
  const int need = static_cast<int>(ceil_div(s.cached + s.chunk, lim_.page_size)) - static_cast<int>(s.pages.size());
  if (need > pool_.free_pages()) return false;
  for (int i = 0; i < need; ++i) s.pages.push_back(pool_.alloc());
  return true;
}

void Scheduler::drop_holder(int si) {
  const int r = seqs_[si].request;
  if (holder_[r] != si) return;
  holder_[r] = -1;
  for (int o : running_)
    if (o != si && seqs_[o].request == r) {
      holder_[r] = o;
      break;
    }
}

void Scheduler::preempt_last() {
  const int si = running_.back();
  Sequence& s = seqs_[si];
  pool_.release(s.pages);
  s.pages.clear();
  s.cached = s.chunk = 0;
  running_.pop_back();
  drop_holder(si);
  waiting_.push_front(si);
  stats_.preemptions++;
  preempted_now_ = true;
  if (!warned_) {
    warned_ = true;
    std::fprintf(stderr,
                 "rollout: warning: the KV pool is full (%d running sequences); preempting the youngest and "
                 "recomputing them later. Raise the KV pool size (kv_pages) or lower the batch for throughput.\n",
                 static_cast<int>(running_.size()) + 1);
  }
}

bool Scheduler::admit_next(int& budget) {
  const int si = waiting_.front();
  Sequence& s = seqs_[si];
  // Prefix sharing: the full pages of the prompt before its last token, from a running
  // sequence of the same request whose k/v there are cached or computed in this forward.
  const int shared_pages = lim_.prefix_sharing ? (s.prompt_len - 1) / lim_.page_size : 0;
  const int h = holder_[s.request];
  bool share = false;
  if (shared_pages > 0 && h >= 0) {
    const Sequence& hs = seqs_[h];
    // A holder still prefilling its prompt: wait for it rather than recompute what it shares.
    if (hs.cached + hs.chunk < shared_pages * lim_.page_size) return false;
    share = true;
  }
  const int start = share ? shared_pages * lim_.page_size : 0;
  const int chunk = std::min(s.len() - start, budget);
  const int need = static_cast<int>(ceil_div(start + chunk, lim_.page_size)) - (share ? shared_pages : 0);
  if (chunk <= 0 || need > pool_.free_pages()) return false;

  waiting_.pop_front();
  if (share) {
    const Sequence& hs = seqs_[h];
    for (int p = 0; p < shared_pages; ++p) {
      pool_.retain(hs.pages[p]);
      s.pages.push_back(hs.pages[p]);
    }
    stats_.prefix_shared_tokens += start;
  }
  s.cached = start;
  s.chunk = chunk;
  reserve(s);
  budget -= chunk;
  running_.push_back(si);
  if (holder_[s.request] < 0) holder_[s.request] = si;
  return true;
}

const std::vector<int>& Scheduler::schedule() {
  preempted_now_ = false;
  int budget = lim_.max_batch_tokens;
  // 1. Running sequences: decode tokens first, then prefill chunks in admission order.
  for (int si : running_) {
    Sequence& s = seqs_[si];
    s.chunk = (s.len() - s.cached == 1 && budget > 0) ? 1 : 0;
    budget -= s.chunk;
  }
  for (int si : running_) {
    Sequence& s = seqs_[si];
    if (s.len() - s.cached > 1) {
      s.chunk = std::min(s.len() - s.cached, budget);
      budget -= s.chunk;
    }
  }
  // 2. Pages, oldest first; a short pool preempts the youngest (possibly this one).
  for (size_t k = 0; k < running_.size(); ++k) {
    Sequence& s = seqs_[running_[k]];
    if (s.chunk == 0) continue;
    while (!reserve(s)) {
      FP8RL_CHECK(running_.size() > 1, "rollout: internal error: a lone sequence does not fit the KV pool");
      const bool self = running_.back() == running_[k];
      preempt_last();
      if (self) break;
    }
  }
  // 3. Admission (FCFS), unless this iteration had to preempt.
  bool admitted = false;
  while (!preempted_now_ && !waiting_.empty() && static_cast<int>(running_.size()) < lim_.max_batch && budget > 0 &&
         admit_next(budget))
    admitted = true;
  if (admitted) stats_.waves++;

  scheduled_.clear();
  for (int si : running_) {
    const Sequence& s = seqs_[si];
    if (s.chunk == 0) continue;
    scheduled_.push_back(si);
    const bool decode = s.chunk == 1 && s.cached == s.len() - 1 && s.len() > s.prompt_len;
    if (!decode) stats_.prefill_tokens += s.chunk;
    stats_.recomputed_tokens += std::max(0, std::min(s.cached + s.chunk, s.computed) - s.cached);
  }
  stats_.max_running = std::max(stats_.max_running, static_cast<int>(running_.size()));
  stats_.max_pages_used = std::max(stats_.max_pages_used, pool_.used_pages());
  if (scheduled_.empty()) {
    FP8RL_CHECK(++idle_iterations_ < 3, "rollout: internal error: the scheduler makes no progress (",
                running_.size(), " running, ", waiting_.size(), " waiting)");
  } else {
    idle_iterations_ = 0;
  }
  return scheduled_;
}

void Scheduler::commit() {
  for (int si : scheduled_) {
    Sequence& s = seqs_[si];
    s.cached += s.chunk;
    s.computed = std::max(s.computed, s.cached);
    s.chunk = 0;
  }
}

void Scheduler::finish(int si) {
  Sequence& s = seqs_[si];
  s.finished = true;
  pool_.release(s.pages);
  s.pages.clear();
  running_.erase(std::find(running_.begin(), running_.end(), si));
  drop_holder(si);
}

}  // namespace fp8rl
