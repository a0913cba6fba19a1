// splitmix64 (Steele, Lea, Flood 2014; Vigna's constants): the one seeded, platform-independent
// integer hash and generator of the host code (std distributions differ between platforms).
// Every seeded stream of fp8rl (tasks, rollout keys, bench weights, initial weights) is built
// from these, so a seed gives the same bits everywhere. The device's rounding bits of the BF16
// optimizer (backend/adamw_rule.h) use the same mixer, written there for host and device.
#pragma once
#include <cstdint>

namespace fp8rl {

constexpr uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio, the stream's step

// splitmix64's finalizer (the bijective mix of one 64-bit word), without the step.
constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// One splitmix64 step as a hash: the generator's output for state x (x + gamma, mixed).
constexpr uint64_t splitmix64(uint64_t x) { return splitmix64_mix(x + kSplitMix64Gamma); }

// The generator: next() returns splitmix64(s) and advances s by gamma.
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(uint64_t seed) : s_(seed) {}
  constexpr uint64_t next() { return splitmix64_mix(s_ += kSplitMix64Gamma); }

 private:
  uint64_t s_;
};

}  // namespace fp8rl
