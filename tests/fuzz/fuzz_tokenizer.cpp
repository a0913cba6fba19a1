// libFuzzer target for tokenizer.json: any input must either load into a tokenizer that encodes
// and decodes text, or throw fp8rl::Error. A crash, a sanitizer report, a hang or another
// exception type is a bug. Inputs up to 1 MB (scripts/fuzz.sh); corpus: tests/fuzz/corpus/tokenizer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const fp8rl::Tokenizer t = fp8rl::Tokenizer::from_json(text, "", "fuzz/tokenizer.json");
    const std::vector<int32_t> ids = t.encode("Hello world 123 <|im_end|>", /*allow_special=*/true);
    (void)t.decode(ids, /*skip_special=*/false);
  } catch (const fp8rl::Error&) {
  }
  return 0;
}
