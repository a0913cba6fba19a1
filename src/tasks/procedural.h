// Shared machinery of the procedural tasks (not a public header): a portable seeded RNG and
// a base class that makes splits deterministic and disjoint.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_set>

#include "core/rng.h"
#include "tasks/task.h"

namespace fp8rl {

// splitmix64 (core/rng.h): the same numbers on every platform (std distributions are not).
class TaskRng {
 public:
  explicit TaskRng(uint64_t seed) : s_(seed) {}
  uint64_t next() { return s_.next(); }
  int64_t uniform(int64_t lo, int64_t hi) { return lo + int64_t(next() % uint64_t(hi - lo + 1)); }
  bool chance(double p) { return double(next() >> 11) * 0x1.0p-53 < p; }

 private:
  SplitMix64 s_;
};

// Item (split, index) is generated from an RNG seeded by (seed, split, index, attempt).
// Validation items come first; a train item whose prompt is a validation prompt is drawn
// again (next attempt), so the splits never overlap.
class ProceduralTask : public Task {
 public:
  ProceduralTask(uint64_t seed, size_t train_size, size_t validation_size);
  size_t size(Split split) const override;
  TaskItem item(Split split, size_t index) const override;

 protected:
  virtual TaskItem generate(TaskRng& rng) const = 0;
  void build_validation_set();  // call at the end of the derived constructor

 private:
  uint64_t seed_;
  size_t train_size_, validation_size_;
  std::unordered_set<std::string> validation_prompts_;
};

}  // namespace fp8rl
