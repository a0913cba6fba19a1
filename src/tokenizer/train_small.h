// A small byte-level BPE tokenizer for tiny models, trained on the tasks' text.
#pragma once
#include <string>
#include <vector>

namespace fp8rl {

// Trains byte-level BPE on `corpus` and returns the text of an HF tokenizer.json that both
// fp8rl::Tokenizer and the HF `tokenizers` package load and encode identically:
//   ids 0..255     the 256 byte tokens (any input round-trips)
//   256..          one token per merge, most frequent pair first (ties: smaller ids first)
//   last three     <|endoftext|>, <|im_start|>, <|im_end|> (special; the ChatML template works)
// Pre-tokenizer: the Qwen2 regex (digits one by one) + ByteLevel; normalizer NFC.
// `vocab_size` counts everything (>= 259); training stops early when no pair repeats.
// Deterministic: the same corpus and size give the same bytes.
std::string tokenizer_train_small(const std::vector<std::string>& corpus, int vocab_size);

}  // namespace fp8rl
