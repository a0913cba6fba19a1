// Byte-level BPE internals (not a public header): the GPT-2 byte<->char table, the
// merge table keyed by a pair of token ids, and the merge loop over one word.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl::bpe {

// GPT-2's reversible map of the 256 byte values to printable Unicode chars
// (33..126, 161..172, 174..255 map to themselves, the rest to 256, 257, ...).
// Returns the UTF-8 text of the char for `byte`.
const std::string& byte_to_char(uint8_t byte);
// Inverse: the byte for a code point of the table, or -1 if it is not in the table.
int char_to_byte(uint32_t code_point);
// Maps raw bytes to their byte-level text ("hello world" -> "helloĠworld").
std::string bytes_to_byte_level(std::string_view bytes);

// Merge rank and result for a pair of token ids: an open-addressing hash table.
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;  // (left << 32) | right
    int32_t rank = 0;       // position in the merges list: lower merges first
    int32_t merged = 0;     // id of the merged token
  };
  void reserve(size_t n);
  // Returns false if the pair is already present (the first rank is kept).
  bool insert(int32_t left, int32_t right, int32_t rank, int32_t merged);
  const Entry* find(int32_t left, int32_t right) const {
    const uint64_t key = make_key(left, right);
    size_t i = hash(key) & mask_;
    while (true) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return count_; }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t make_key(int32_t l, int32_t r) {
    return (uint64_t(uint32_t(l)) << 32) | uint32_t(r);
  }
  static size_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return size_t(k);
  }
  std::vector<Entry> slots_;
  size_t mask_ = 0, count_ = 0;
};

// Applies merges to `ids` (the word's initial symbols) in place, lowest rank first and,
// among equal ranks, leftmost first (the HF `tokenizers` order). Words longer than
// `heap_threshold` symbols use a heap (O(n log n)); shorter ones a linear scan.
void merge_word(std::vector<int32_t>& ids, const MergeTable& merges, size_t heap_threshold = 48);

}  // namespace fp8rl::bpe

namespace fp8rl::bpe {
// The pre-tokenizer regex the small tokenizer uses (Qwen2 / Llama 3 style, but digits split
// one by one so numbers tokenize digit-wise).
extern const char* const kSmallPattern;
// Pieces of `text` for a PCRE2 (UTF + UCP) regex with HF Split "Isolated" semantics:
// matches and the gaps between them, in order, none empty. Views into `text`.
std::vector<std::string_view> split_regex(const std::string& pattern, std::string_view text);
}  // namespace fp8rl::bpe
