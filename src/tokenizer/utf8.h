// UTF-8 helpers shared by the tokenizer and the tasks.
#pragma once
#include <cstddef>
#include <string_view>

namespace fp8rl {

// Index of the first byte that starts an invalid UTF-8 sequence (overlong forms,
// surrogates, code points > U+10FFFF and truncated sequences are invalid), or npos.
size_t utf8_find_invalid(std::string_view s);
inline bool utf8_is_valid(std::string_view s) { return utf8_find_invalid(s) == std::string_view::npos; }
// Length in bytes of the UTF-8 sequence starting with lead byte `c` (1 for a stray byte).
inline size_t utf8_seq_len(unsigned char c) {
  return c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
}

}  // namespace fp8rl
