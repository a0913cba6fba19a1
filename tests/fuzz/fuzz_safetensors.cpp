// libFuzzer target for the safetensors header parser: any input must either parse into a
// header whose entries all lie inside the buffer, or throw fp8rl::Error. Anything else
// (a crash, an ASan report, another exception type) is a bug.
// Build and run (every target, bounded time, inputs up to 1 MB): bash scripts/fuzz.sh
// Corpus: tests/fuzz/corpus/safetensors (more seeds: tests/data/broken_safetensors).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    fp8rl::SafetensorsHeader h = fp8rl::safetensors_parse_header(data, size, "fuzz");
    for (const auto& e : h.entries) {
      if (e.begin > e.end || h.data_start + e.end > size) std::abort();
      if (static_cast<uint64_t>(fp8rl::shape_numel(e.shape)) * fp8rl::dtype_size(e.dtype) != e.end - e.begin)
        std::abort();
    }
  } catch (const fp8rl::Error&) {
  }
  return 0;
}
