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
//
// Models that ship a Jinja chat template (tokenizer_config.json's "chat_template" or
// chat_template.jinja) are rendered by the Jinja interpreter (jinja.h) instead, exactly as
// transformers' apply_chat_template(tokenize=False) does: see ChatJinja below. The fixed
// families above are the fallback for tokenizers without a template.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/jinja.h"

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

// A model's Jinja chat template with the special tokens transformers passes to it.
struct ChatJinja {
  std::string source;                    // the template text
  std::string origin;                    // file it came from (for messages)
  std::optional<std::string> bos_token;  // absent: the variable is not passed (undefined)
  std::optional<std::string> eos_token;
  std::shared_ptr<const JinjaTemplate> tpl;  // parsed `source`

  // From a model/tokenizer directory: chat_template.jinja if present, else
  // tokenizer_config.json's "chat_template" (a string, or a list of {name, template}: the
  // "default" one); bos/eos from tokenizer_config.json (a string or {"content": ...}).
  // Returns nullopt when the directory has no template. Throws on a malformed one.
  static std::optional<ChatJinja> load(const std::string& dir);
  static ChatJinja from_source(std::string source, std::optional<std::string> bos = {},
                               std::optional<std::string> eos = {});

  struct Vars {
    bool add_generation_prompt = true;
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();  // extra variables (enable_thinking, ...)
    std::string now;                                                  // strftime_now clock; empty = now
  };
  // `conversation`: a list of messages, or {"messages": [...], "tools": [...], "kwargs": {...}}
  // (its kwargs are overridden by vars.kwargs). Applies transformers' preprocessing (keys
  // whose value is null are dropped; reasoning_content/thinking/reasoning aliased to both
  // "thinking" and "reasoning_content"); tools and documents are passed as None when absent.
  std::string render(const nlohmann::ordered_json& conversation, const Vars& vars) const;
  // A single-turn prompt (optional system message, then the user message).
  std::string render_prompt(const std::string& user, const std::string& system, const Vars& vars) const;
};

}  // namespace fp8rl
