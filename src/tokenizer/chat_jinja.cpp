// ChatJinja (chat_template.h): a model's Jinja chat template rendered the way transformers'
// apply_chat_template(tokenize=False) renders it.
#include <filesystem>

#include "core/error.h"
#include "core/fs.h"
#include "tokenizer/chat_template.h"

namespace fp8rl {
namespace {

using ojson = nlohmann::ordered_json;

std::optional<std::string> config_token(const ojson& cfg, const char* key) {
  if (!cfg.contains(key)) return std::nullopt;
  const ojson& t = cfg[key];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  return std::nullopt;  // null: the tokenizer has no such token
}

// transformers' _normalize_chat_messages + render_jinja_template's reasoning alias.
ojson normalize_message(const ojson& m) {
  if (!m.is_object()) throw Error("chat template: every message must be a JSON object, got " + m.dump());
  ojson out = ojson::object();
  for (auto it = m.begin(); it != m.end(); ++it)
    if (!it.value().is_null()) out[it.key()] = it.value();
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    if (!out.contains(key)) continue;
    ojson r = out[key];
    ojson aliased = ojson::object();
    aliased["thinking"] = r;
    for (auto it = out.begin(); it != out.end(); ++it) aliased[it.key()] = it.value();
    aliased["reasoning_content"] = r;
    return aliased;
  }
  return out;
}

}  // namespace

ChatJinja ChatJinja::from_source(std::string source, std::optional<std::string> bos, std::optional<std::string> eos) {
  ChatJinja c;
  c.source = std::move(source);
  c.bos_token = std::move(bos);
  c.eos_token = std::move(eos);
  c.tpl = std::make_shared<JinjaTemplate>(c.source);
  return c;
}

std::optional<ChatJinja> ChatJinja::load(const std::string& dir) {
  namespace sfs = std::filesystem;
  const std::string cfg_path = dir + "/tokenizer_config.json";
  const std::string jinja_path = dir + "/chat_template.jinja";
  ojson cfg = ojson::object();
  if (sfs::exists(cfg_path)) {
    try {
      cfg = ojson::parse(read_file(cfg_path));
    } catch (const ojson::exception& e) {
      throw Error(cfg_path + " is not valid JSON: " + e.what());
    }
  }
  std::string source, origin;
  if (sfs::exists(jinja_path)) {
    source = read_file(jinja_path);
    origin = jinja_path;
  } else if (cfg.contains("chat_template")) {
    const ojson& ct = cfg["chat_template"];
    origin = cfg_path;
    if (ct.is_string()) {
      source = ct.get<std::string>();
    } else if (ct.is_array()) {
      for (const ojson& e : ct)
        if (e.is_object() && e.value("name", "") == "default" && e.contains("template"))
          source = e["template"].get<std::string>();
      if (source.empty())
        throw Error(cfg_path + ": chat_template is a list without a template named \"default\"");
    } else if (!ct.is_null()) {
      throw Error(cfg_path + ": chat_template must be a string or a list of {name, template}");
    }
  }
  if (source.empty()) return std::nullopt;
  try {
    ChatJinja c = from_source(source, config_token(cfg, "bos_token"), config_token(cfg, "eos_token"));
    c.origin = origin;
    return c;
  } catch (const Error& e) {
    throw Error(origin + ": " + e.what());
  }
}

std::string ChatJinja::render(const ojson& conversation, const Vars& vars) const {
  const ojson* messages = &conversation;
  ojson ctx = ojson::object();
  if (conversation.is_object()) {
    if (!conversation.contains("messages"))
      throw Error("chat template: the conversation object has no \"messages\" list");
    messages = &conversation["messages"];
  }
  if (!messages->is_array()) throw Error("chat template: \"messages\" must be a list of messages");
  ojson msgs = ojson::array();
  for (const ojson& m : *messages) msgs.push_back(normalize_message(m));
  ctx["messages"] = msgs;
  ctx["tools"] = conversation.is_object() && conversation.contains("tools") ? conversation["tools"] : ojson();
  ctx["documents"] = ojson();
  ctx["add_generation_prompt"] = vars.add_generation_prompt;
  if (bos_token) ctx["bos_token"] = *bos_token;
  if (eos_token) ctx["eos_token"] = *eos_token;
  if (conversation.is_object() && conversation.contains("kwargs")) {
    const ojson& kw = conversation["kwargs"];
    if (!kw.is_object()) throw Error("chat template: \"kwargs\" must be an object");
    for (auto it = kw.begin(); it != kw.end(); ++it) ctx[it.key()] = it.value();
  }
  for (auto it = vars.kwargs.begin(); it != vars.kwargs.end(); ++it) ctx[it.key()] = it.value();
  JinjaOptions opt;
  opt.now = vars.now;
  return tpl->render(ctx, opt);
}

std::string ChatJinja::render_prompt(const std::string& user, const std::string& system, const Vars& vars) const {
  ojson msgs = ojson::array();
  if (!system.empty()) msgs.push_back({{"role", "system"}, {"content", system}});
  msgs.push_back({{"role", "user"}, {"content", user}});
  return render(msgs, vars);
}

}  // namespace fp8rl
