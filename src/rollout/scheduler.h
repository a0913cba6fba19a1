// The rollout engine's scheduler: which tokens of which sequences go into the next generation
// forward, and which KV pages they use. Host-only bookkeeping (no backend calls); the engine
// (engine.cpp) turns each plan into a PagedBatch, runs the forward and samples.
//
// Policy, per iteration (one forward of at most max_batch_tokens tokens):
//   1. Running sequences get their tokens: decode tokens (one per decoding sequence) first,
//      then prefill chunks (prompt, or prompt + generated tokens after a preemption) in
//      admission order; a long prefill is split over several iterations.
//   2. Pages are allocated on demand, in admission order. When the pool is empty, the most
//      recently admitted running sequence is preempted: its pages are released and it goes
//      back to the front of the waiting queue, keeping its tokens and rng; it is recomputed
//      as a prefill when re-admitted ("recompute" preemption).
//   3. Waiting sequences are admitted (FCFS) while a batch slot, token budget and pages for
//      their first chunk are free (not in an iteration that preempted).
// Prefix sharing: a sequence admitted with nothing cached takes references to the full pages
// of its prompt's prefix held by a running sequence of the same request (the "holder"); the
// rest of the prompt (1 to page_size tokens, always including the last prompt token, whose
// logits give the first sampled token) is recomputed into its own pages. Pages are
// reference-counted and freed when their last user releases them. The holder's shared prefix
// may be written by the same forward: every layer writes the batch's k/v before attending.
#pragma once
#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "rollout/rollout.h"

namespace fp8rl {

// One sample being generated.
struct Sequence {
  int request = 0, index = 0;
  std::vector<int32_t> ids;    // prompt + generated so far
  int prompt_len = 0;
  int cached = 0;              // tokens whose k/v are in the cache (a prefix of ids)
  int chunk = 0;               // tokens [cached, cached + chunk) scheduled in this iteration
  int computed = 0;            // most tokens ever cached (what a preemption made us recompute)
  int max_new = 0;             // this sequence's token limit (the request's stop_after, or max_new_tokens)
  bool finished = false;
  std::vector<int32_t> pages;  // in order; may start with pages shared with other sequences
  std::mt19937_64 rng;
  RolloutSample out;
  int len() const { return static_cast<int>(ids.size()); }
  // This iteration's chunk ends at the last token: its logits give the next token.
  bool samples() const { return chunk > 0 && cached + chunk == len(); }
};

// Reference-counted KV pages.
class PagePool {
 public:
  explicit PagePool(int num_pages);
  int free_pages() const { return static_cast<int>(free_.size()); }
  int used_pages() const { return static_cast<int>(refs_.size() - free_.size()); }  // shared ones once
  int32_t alloc();                 // a free page with one reference (the pool must not be empty)
  void retain(int32_t page);       // one more reference
  void release(const std::vector<int32_t>& pages);  // one reference less each; freed at zero

 private:
  std::vector<int32_t> free_;  // lowest page last (allocated first)
  std::vector<int> refs_;      // [num_pages]
};

struct SchedulerLimits {
  int page_size = 16, max_batch = 256, max_batch_tokens = 8192;
  bool prefix_sharing = true;
};

class Scheduler {
 public:
  // `seqs` (fresh, nothing cached) outlive the scheduler; all start waiting, in order.
  Scheduler(std::vector<Sequence>& seqs, int num_pages, const SchedulerLimits& limits, RolloutStats& stats);
  bool done() const { return running_.empty() && waiting_.empty(); }
  int free_pages() const { return pool_.free_pages(); }
  // Plans the next iteration: sets `chunk` of every running sequence (pages reserved for it)
  // and returns those with chunk > 0, in admission order. Throws if no progress is possible.
  const std::vector<int>& schedule();
  // After the forward: the scheduled chunks are cached (their k/v written).
  void commit();
  // Ends a running sequence (after its last sampled token): releases its pages.
  void finish(int seq);

 private:
  bool reserve(Sequence& s);   // pages for cached + chunk tokens; false when the pool is short
  void preempt_last();         // the most recently admitted running sequence back to waiting
  bool admit_next(int& budget);  // the first waiting sequence, if it fits; false otherwise
  void drop_holder(int seq);   // `seq` stops running: another holder for its request

  std::vector<Sequence>& seqs_;
  PagePool pool_;
  SchedulerLimits lim_;
  RolloutStats& stats_;
  std::deque<int> waiting_;   // indices into seqs_, admission order (preempted ones first)
  std::vector<int> running_;  // admission order
  std::vector<int> holder_;   // [requests] a running sequence holding the prompt prefix, or -1
  std::vector<int> scheduled_;
  bool preempted_now_ = false, warned_ = false;
  int idle_iterations_ = 0;
};

}  // namespace fp8rl
