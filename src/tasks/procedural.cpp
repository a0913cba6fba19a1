#include "tasks/procedural.h"

#include "core/error.h"

namespace fp8rl {
namespace {
uint64_t mix(uint64_t seed, uint64_t split, uint64_t index, uint64_t attempt) {
  return splitmix64(seed ^ (split * 0x632be59bd9b4e019ull) ^ (index * kSplitMix64Gamma) ^
                    (attempt * 0xd1b54a32d192ed03ull));
}
}  // namespace

ProceduralTask::ProceduralTask(uint64_t seed, size_t train_size, size_t validation_size)
    : seed_(seed), train_size_(train_size), validation_size_(validation_size) {}

void ProceduralTask::build_validation_set() {
  for (size_t i = 0; i < validation_size_; ++i) validation_prompts_.insert(item(Split::kValidation, i).prompt);
}

size_t ProceduralTask::size(Split split) const {
  return split == Split::kTrain ? train_size_ : validation_size_;
}

TaskItem ProceduralTask::item(Split split, size_t index) const {
  FP8RL_CHECK(index < size(split), name(), ": item ", index, " is out of range (split size ", size(split), ")");
  const uint64_t s = split == Split::kTrain ? 0 : 1;
  for (uint64_t attempt = 0; attempt < 1000; ++attempt) {
    TaskRng rng(mix(seed_, s, index, attempt));
    TaskItem it = generate(rng);
    if (split == Split::kValidation || !validation_prompts_.count(it.prompt)) return it;
  }
  FP8RL_FAIL(name(), ": cannot draw a train item outside the validation set: the problem space is too "
             "small for validation_size ", validation_size_, "; raise the difficulty or shrink validation");
}

}  // namespace fp8rl
