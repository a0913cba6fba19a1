#include "tokenizer/train_small.h"

#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/bpe.h"

namespace fp8rl {

namespace {
const char* const kSpecials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
}

std::string tokenizer_train_small(const std::vector<std::string>& corpus, int vocab_size) {
  constexpr int kNumSpecial = 3;
  FP8RL_CHECK(vocab_size >= 256 + kNumSpecial, "vocab_size ", vocab_size,
              " is too small: a byte-level tokenizer needs 256 byte tokens + 3 special tokens");
  // Unique pre-tokenized words with their counts (std::map: a deterministic order).
  std::map<std::string, int64_t> word_counts;
  for (const std::string& text : corpus)
    for (std::string_view w : bpe::split_regex(bpe::kSmallPattern, text)) ++word_counts[std::string(w)];

  std::vector<std::string> tokens;  // byte-level spelling per id
  std::unordered_map<std::string, int32_t> vocab;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(bpe::byte_to_char(uint8_t(b)));
    vocab[tokens.back()] = b;
  }
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> counts;
  for (auto& [w, c] : word_counts) {
    std::vector<int32_t> ids(w.begin(), w.end());
    for (int32_t& id : ids) id = static_cast<unsigned char>(id);
    if (ids.size() > 1) {
      words.push_back(std::move(ids));
      counts.push_back(c);
    }
  }
  nlohmann::json merges = nlohmann::json::array();
  const int max_tokens = vocab_size - kNumSpecial;
  while (int(tokens.size()) < max_tokens) {
    std::map<std::pair<int32_t, int32_t>, int64_t> pairs;
    for (size_t i = 0; i < words.size(); ++i)
      for (size_t k = 0; k + 1 < words[i].size(); ++k) pairs[{words[i][k], words[i][k + 1]}] += counts[i];
    std::pair<int32_t, int32_t> best{-1, -1};
    int64_t best_count = 1;  // a merge must be seen at least twice
    for (auto& [p, c] : pairs)
      if (c > best_count) {
        best = p;
        best_count = c;
      }
    if (best.first < 0) break;
    const std::string merged = tokens[best.first] + tokens[best.second];
    auto it = vocab.find(merged);
    int32_t id;
    if (it == vocab.end()) {
      id = int32_t(tokens.size());
      tokens.push_back(merged);
      vocab[merged] = id;
    } else {
      id = it->second;  // the same string reached by another merge path
    }
    merges.push_back({tokens[best.first], tokens[best.second]});
    for (auto& w : words) {
      size_t out = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        if (k + 1 < w.size() && w[k] == best.first && w[k + 1] == best.second) {
          w[out++] = id;
          ++k;
        } else {
          w[out++] = w[k];
        }
      }
      w.resize(out);
    }
  }

  nlohmann::ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (int s = 0; s < kNumSpecial; ++s)
    added.push_back({{"id", int(tokens.size()) + s}, {"content", kSpecials[s]}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  j["added_tokens"] = added;
  j["normalizer"] = {{"type", "NFC"}};
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", bpe::kSmallPattern}}}, {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  nlohmann::ordered_json vocab_json = nlohmann::ordered_json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab_json[tokens[i]] = int(i);
  j["model"] = {{"type", "BPE"},          {"dropout", nullptr},        {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},       {"byte_fallback", false},    {"ignore_merges", false},
                {"vocab", vocab_json},     {"merges", merges}};
  return j.dump(1) + "\n";
}

}  // namespace fp8rl
