// fp8rl template --tokenizer DIR --messages FILE.json [--generation-prompt] [--now "..."]
//                [--kwargs JSON]
// Renders a conversation with the model's own Jinja chat template and prints exactly the
// text (no newline added), as transformers' apply_chat_template(tokenize=False) would.
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "core/fs.h"
#include "tokenizer/chat_template.h"

namespace fp8rl::cli {
namespace {

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"tokenizer", "messages", "now", "kwargs"}, {"generation-prompt", "help"});
  if (args.has("help")) {
    std::fprintf(stderr,
                 "usage: fp8rl template --tokenizer DIR --messages FILE.json [--generation-prompt]\n"
                 "                      [--now \"YYYY-MM-DD HH:MM:SS\"] [--kwargs '{\"enable_thinking\": false}']\n"
                 "  DIR: a model/tokenizer directory with chat_template.jinja or tokenizer_config.json\n"
                 "  FILE.json: a list of messages, or {\"messages\": [...], \"tools\": [...], \"kwargs\": {...}}\n"
                 "  --now pins strftime_now (default: the current local time)\n");
    return 0;
  }
  const std::string dir = args.require("tokenizer");
  const std::string file = args.require("messages");
  std::optional<ChatJinja> tpl = ChatJinja::load(dir);
  if (!tpl) throw Error(dir + " has no chat template (neither chat_template.jinja nor a \"chat_template\" in "
                        "tokenizer_config.json)");
  nlohmann::ordered_json conversation;
  try {
    conversation = nlohmann::ordered_json::parse(read_file(file));
  } catch (const nlohmann::ordered_json::exception& e) {
    throw Error(file + " is not valid JSON: " + e.what());
  }
  ChatJinja::Vars vars;
  vars.add_generation_prompt = args.has("generation-prompt");
  vars.now = args.get("now");
  if (args.has("kwargs")) {
    try {
      vars.kwargs = nlohmann::ordered_json::parse(args.get("kwargs"));
    } catch (const nlohmann::ordered_json::exception& e) {
      throw Error(std::string("--kwargs is not valid JSON: ") + e.what());
    }
    if (!vars.kwargs.is_object()) throw Error("--kwargs must be a JSON object");
  }
  // A template that raises (JinjaRaise) reaches main: "fp8rl template: error: <its message>", exit 1.
  const std::string out = tpl->render(conversation, vars);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

Register reg{"template", "render a conversation with the model's Jinja chat template", run};

}  // namespace
}  // namespace fp8rl::cli
