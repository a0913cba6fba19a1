// Chat templates: a few fixed string patterns, not a Jinja engine.
//
// A template is data (struct ChatTemplate): every message renders as
//   message_begin (with "{role}" replaced) + content + message_end
// the conversation starts with `bos`, and the generation prompt is `generation_prompt`.
// Families (chosen from tokenizer_config.json's chat_template text):
//   kChatML   Qwen2/2.5 and our small tokenizer:  <|im_start|>role\n...<|im_end|>\n
//   kQwen3    ChatML plus Qwen3's thinking rules (below)
//   kLlama3   <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
//             (content is trimmed, as Llama 3's template does)
// Qwen3 (from its chat_template.jinja): with enable_thinking=false the generation prompt
// ends in "<think>\n\n</think>\n\n"; an assistant message after the last user message is
// rendered "<think>\n{reasoning}\n</think>\n\n{answer}" where reasoning/answer are split at
// "</think>" in the content (an empty think block if there is none); earlier assistant
// messages keep only the answer part.
// Not reproduced: tool calls/tool messages, default system prompts some templates inject
// (Qwen2.5's "You are Qwen...", Llama 3.1's "Cutting Knowledge Date"): pass a system
// message explicitly if the model expects one.
#pragma once
#include <string>
#include <vector>

namespace fp8rl {

class Tokenizer;

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

enum class ChatFamily { kChatML, kQwen3, kLlama3 };

struct ChatOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;  // Qwen3 only; false adds the empty think block
};

struct ChatTemplate {
  ChatFamily family = ChatFamily::kChatML;
  std::string bos;                // emitted once at the start
  std::string message_begin;      // "{role}" is replaced by the role
  std::string message_end;
  std::string generation_prompt;  // after the last message when add_generation_prompt
  bool trim_content = false;      // strip leading/trailing whitespace of contents

  static ChatTemplate for_family(ChatFamily family);
  // Picks the family from a Jinja template text (kQwen3 if it mentions <think> or
  // enable_thinking, kChatML for <|im_start|>, kLlama3 for <|start_header_id|>); throws
  // naming the supported families otherwise.
  static ChatTemplate from_jinja_text(const std::string& jinja);
  // From tok.chat_template_text(); a tokenizer without one (our small tokenizer) gets
  // kChatML if it has <|im_start|>/<|im_end|> tokens, else kLlama3 if it has its tokens.
  static ChatTemplate for_tokenizer(const Tokenizer& tok);

  std::string render(const std::vector<ChatMessage>& messages, const ChatOptions& opt = {}) const;
  // The usual single-turn prompt: optional system message, then the user message.
  std::string render_prompt(const std::string& user, const std::string& system = "",
                            const ChatOptions& opt = {}) const;
  // Text that ends an assistant turn (appended after a response for SFT): "<|im_end|>\n" etc.
  std::string end_of_turn() const { return message_end; }
};

}  // namespace fp8rl
