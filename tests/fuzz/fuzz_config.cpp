// libFuzzer target for the two config parsers: the first byte picks HF config.json (even) or a
// run config YAML (odd), the rest is the text. Any input must either parse (and, for YAML,
// validate) or throw fp8rl::Error; anything else is a bug. Corpus: tests/fuzz/corpus/config.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "rl/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 2 == 0) {
      (void)fp8rl::model_config_from_json(text, "fuzz/config.json");
    } else {
      fp8rl::RunConfig c;
      fp8rl::config_apply_yaml(c, text, "fuzz/config.yaml");
      fp8rl::config_validate(c);
      (void)fp8rl::config_to_yaml(c);
    }
  } catch (const fp8rl::Error&) {
  }
  return 0;
}
