// Chat templates (Qwen3 thinking rules, ChatML, Llama 3) and the small trained tokenizer.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/train_small.h"

namespace fp8rl {
namespace {

std::string shared_data() {
  const char* env = std::getenv("FP8RL_SHARED_DATA");
  return env && *env ? env : FP8RL_SHARED_DATA;
}
const std::string kTokData = std::string(FP8RL_TEST_DATA) + "/tokenizers";

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(ChatTemplate, Qwen3FromTokenizerConfig) {
  const Tokenizer tok = Tokenizer::load(shared_data() + "/tokenizers/qwen3");
  const ChatTemplate t = ChatTemplate::for_tokenizer(tok);
  EXPECT_EQ(t.family, ChatFamily::kQwen3);
  // Expected strings written from chat_template.jinja by hand.
  EXPECT_EQ(t.render_prompt("What is 2+2?", "Be brief."),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  ChatOptions no_think;
  no_think.enable_thinking = false;
  EXPECT_EQ(t.render_prompt("Hi", "", no_think),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // A final assistant turn gets an (empty) think block; an earlier one keeps only its answer.
  ChatOptions no_gen;
  no_gen.add_generation_prompt = false;
  EXPECT_EQ(t.render({{"user", "a"}, {"assistant", "<think>\nhmm\n</think>\n\nB"}, {"user", "c"},
                      {"assistant", "D"}},
                     no_gen),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n"
            "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nD<|im_end|>\n");
  // The rendered prompt tokenizes with the special tokens as single ids.
  const std::vector<int32_t> ids = tok.encode(t.render_prompt("Hi"));
  EXPECT_EQ(ids.front(), tok.token_to_id("<|im_start|>"));
  EXPECT_THROW(t.render({{"tool", "x"}}), Error);
}

TEST(ChatTemplate, FamiliesFromTemplateText) {
  EXPECT_EQ(ChatTemplate::from_jinja_text("{{'<|im_start|>' + m.role}}").family, ChatFamily::kChatML);
  const ChatTemplate l = ChatTemplate::from_jinja_text("{{'<|start_header_id|>' + role + '<|end_header_id|>'}}");
  EXPECT_EQ(l.family, ChatFamily::kLlama3);
  EXPECT_EQ(l.render_prompt("  Hello  ", "Sys"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nSys<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_THROW(ChatTemplate::from_jinja_text("{{ bos_token }}[INST]"), Error);
}

std::vector<std::string> small_corpus() {
  std::ifstream f(shared_data() + "/gsm8k/train.jsonl");
  std::vector<std::string> corpus;
  std::string line;
  while (corpus.size() < 200 && std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    corpus.push_back(j["question"].get<std::string>() + "\n" + j["answer"].get<std::string>());
  }
  return corpus;
}

// tests/data/tokenizers/small/tokenizer.json was written by tokenizer_train_small(200 GSM8K
// items, 400) (FP8RL_UPDATE_GOLDEN=1 rewrites it); golden.out holds the HF `tokenizers` ids
// for golden.inp (make_tiny.py). Same bytes again + same ids as HF = the contract.
TEST(SmallTokenizer, TrainedFileMatchesCommittedAndHf) {
  const std::string text = tokenizer_train_small(small_corpus(), 400);
  const std::string path = kTokData + "/small/tokenizer.json";
  if (std::getenv("FP8RL_UPDATE_GOLDEN")) std::ofstream(path, std::ios::binary) << text;
  ASSERT_EQ(text, slurp(path)) << "training is not deterministic or the trainer changed";
  const Tokenizer tok = Tokenizer::from_json(text);
  EXPECT_EQ(tok.vocab_size(), 400);
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 397);
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 399);
  EXPECT_TRUE(tok.is_special(398));
  EXPECT_EQ(tok.eos_id(), 399);
  EXPECT_EQ(ChatTemplate::for_tokenizer(tok).family, ChatFamily::kChatML);

  const std::string inp = slurp(kTokData + "/golden.inp");
  std::istringstream out(slurp(kTokData + "/small/golden.out"));
  const std::string sep = "\n__ggml_vocab_test__\n";
  size_t pos = 0, cases = 0;
  std::string line;
  while (pos < inp.size()) {
    const size_t end = inp.find(sep, pos);
    ASSERT_NE(end, std::string::npos);
    const std::string s = inp.substr(pos, end - pos);
    pos = end + sep.size();
    ASSERT_TRUE(std::getline(out, line));
    std::istringstream ls(line);
    std::vector<int32_t> want;
    int32_t v;
    while (ls >> v) want.push_back(v);
    EXPECT_EQ(tok.encode(s), want) << "case " << cases << ": " << s;
    ++cases;
  }
  EXPECT_EQ(cases, 20u);
  // Round trip of text the tokenizer never saw (any bytes are covered).
  const std::string unseen = "Ünïcödé 😀 text\twith\r\nodd 123456 <|im_start|>";
  EXPECT_EQ(tok.decode(tok.encode(unseen)), unseen);
  // Merges compress the corpus text.
  const std::string sample = small_corpus()[0];
  EXPECT_LT(tok.encode(sample).size() * 4, sample.size() * 3);
}

TEST(SmallTokenizer, RejectsTooSmallVocab) {
  EXPECT_THROW(tokenizer_train_small({"abc"}, 258), Error);
  const Tokenizer t = Tokenizer::from_json(tokenizer_train_small({"ab ab ab"}, 1000));
  EXPECT_LT(t.vocab_size(), 270);  // stops when no pair repeats
  EXPECT_EQ(t.decode(t.encode("ab ab")), "ab ab");
}

}  // namespace
}  // namespace fp8rl
