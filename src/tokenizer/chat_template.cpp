#include "tokenizer/chat_template.h"

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace fp8rl {
namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::string strip_newlines(std::string s, bool left, bool right) {
  if (left) s.erase(0, s.find_first_not_of('\n') == std::string::npos ? s.size() : s.find_first_not_of('\n'));
  if (right) {
    const size_t e = s.find_last_not_of('\n');
    s.erase(e == std::string::npos ? 0 : e + 1);
  }
  return s;
}

// Qwen3: split "<think>reasoning</think>answer" as its template does.
void qwen3_split(const std::string& content, std::string& reasoning, std::string& answer) {
  const size_t close = content.rfind("</think>");
  if (close == std::string::npos) {
    reasoning.clear();
    answer = content;
    return;
  }
  answer = strip_newlines(content.substr(close + 8), true, false);
  std::string before = content.substr(0, content.find("</think>"));
  before = strip_newlines(before, false, true);
  const size_t open = before.rfind("<think>");
  if (open != std::string::npos) before = before.substr(open + 7);
  reasoning = strip_newlines(before, true, false);
}

}  // namespace

ChatTemplate ChatTemplate::for_family(ChatFamily family) {
  ChatTemplate t;
  t.family = family;
  if (family == ChatFamily::kLlama3) {
    t.bos = "<|begin_of_text|>";
    t.message_begin = "<|start_header_id|>{role}<|end_header_id|>\n\n";
    t.message_end = "<|eot_id|>";
    t.generation_prompt = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    t.trim_content = true;
  } else {
    t.message_begin = "<|im_start|>{role}\n";
    t.message_end = "<|im_end|>\n";
    t.generation_prompt = "<|im_start|>assistant\n";
  }
  return t;
}

ChatTemplate ChatTemplate::from_jinja_text(const std::string& jinja) {
  if (jinja.find("<|im_start|>") != std::string::npos) {
    const bool thinking = jinja.find("<think>") != std::string::npos ||
                          jinja.find("enable_thinking") != std::string::npos;
    return for_family(thinking ? ChatFamily::kQwen3 : ChatFamily::kChatML);
  }
  if (jinja.find("<|start_header_id|>") != std::string::npos) return for_family(ChatFamily::kLlama3);
  FP8RL_FAIL("unsupported chat template (supported families: ChatML/Qwen with <|im_start|>, "
             "Qwen3 with <think>, Llama 3 with <|start_header_id|>); template starts: ",
             jinja.substr(0, 80));
}

ChatTemplate ChatTemplate::for_tokenizer(const Tokenizer& tok) {
  if (!tok.chat_template_text().empty()) return from_jinja_text(tok.chat_template_text());
  if (tok.token_to_id("<|im_start|>") >= 0 && tok.token_to_id("<|im_end|>") >= 0)
    return for_family(ChatFamily::kChatML);
  if (tok.token_to_id("<|start_header_id|>") >= 0 && tok.token_to_id("<|eot_id|>") >= 0)
    return for_family(ChatFamily::kLlama3);
  FP8RL_FAIL("the tokenizer has no chat_template and neither ChatML (<|im_start|>, <|im_end|>) "
             "nor Llama 3 (<|start_header_id|>, <|eot_id|>) tokens: cannot pick a chat template");
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, const ChatOptions& opt) const {
  size_t last_user = messages.size();
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    FP8RL_CHECK(r == "system" || r == "user" || r == "assistant", "chat message ", i, " has role '", r,
                "' (supported: system, user, assistant)");
    if (r == "user") last_user = i;
  }
  std::string out = bos;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    std::string begin = message_begin;
    begin.replace(begin.find("{role}"), 6, m.role);
    std::string content = trim_content ? trim(m.content) : m.content;
    if (family == ChatFamily::kQwen3 && m.role == "assistant") {
      std::string reasoning, answer;
      qwen3_split(content, reasoning, answer);
      const bool after_query = last_user != messages.size() && i > last_user;
      if (after_query && (i + 1 == messages.size() || !reasoning.empty()))
        content = "<think>\n" + strip_newlines(reasoning, true, true) + "\n</think>\n\n" + answer;
      else
        content = answer;
    }
    out += begin + content + message_end;
  }
  if (opt.add_generation_prompt) {
    out += generation_prompt;
    if (family == ChatFamily::kQwen3 && !opt.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

std::string ChatTemplate::render_prompt(const std::string& user, const std::string& system,
                                        const ChatOptions& opt) const {
  std::vector<ChatMessage> m;
  if (!system.empty()) m.push_back({"system", system});
  m.push_back({"user", user});
  return render(m, opt);
}

}  // namespace fp8rl
