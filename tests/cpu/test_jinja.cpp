// The Jinja interpreter: every golden render of ../shared/data/chat_templates (transformers'
// own output, byte for byte), its expected errors, and unit cases for the semantics the
// goldens lean on (whitespace control, scoping, filters, errors naming the line).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <sys/wait.h>

#include "core/error.h"
#include "rl/config.h"
#include "rl/session.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/jinja.h"

namespace fp8rl {
namespace {

using ojson = nlohmann::ordered_json;

std::string shared_data() {
  const char* env = std::getenv("FP8RL_SHARED_DATA");
  return env && *env ? env : FP8RL_SHARED_DATA;
}
std::string templates_dir() { return shared_data() + "/chat_templates"; }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct GoldenCase {
  std::string tpl, conv;
  bool gen = false;
  std::string name() const { return tpl + "__" + conv + "__" + (gen ? "true" : "false"); }
};

std::vector<GoldenCase> golden_cases() {
  std::vector<GoldenCase> cases;
  std::ifstream tf(templates_dir() + "/templates.json"), cf(templates_dir() + "/conversations.json");
  if (!tf.good() || !cf.good()) return cases;
  ojson templates = ojson::parse(tf), convs = ojson::parse(cf);
  for (auto it = templates.begin(); it != templates.end(); ++it) {
    if (!it.value().is_object()) continue;
    for (const ojson& c : convs["conversations"])
      for (bool gen : {true, false}) cases.push_back({it.key(), c["id"].get<std::string>(), gen});
  }
  return cases;
}

const ojson& templates_json() {
  static ojson j = ojson::parse(slurp(templates_dir() + "/templates.json"));
  return j;
}
const ojson& conversation(const std::string& id) {
  static ojson j = ojson::parse(slurp(templates_dir() + "/conversations.json"));
  for (const ojson& c : j["conversations"])
    if (c["id"] == id) return c;
  throw Error("no conversation " + id);
}
const ojson* expected_error(const GoldenCase& g) {
  static ojson j = ojson::parse(slurp(templates_dir() + "/golden/errors.json"));
  for (const ojson& e : j["errors"])
    if (e["template"] == g.tpl && e["conversation"] == g.conv && e["add_generation_prompt"] == g.gen) return &e;
  return nullptr;
}

ChatJinja load_template(const std::string& name) {
  const ojson& t = templates_json()[name];
  auto tok = [&](const char* key) -> std::optional<std::string> {
    if (t[key].is_null()) return std::nullopt;
    return t[key].get<std::string>();
  };
  return ChatJinja::from_source(slurp(templates_dir() + "/" + t["file"].get<std::string>()), tok("bos_token"),
                                tok("eos_token"));
}

class ChatTemplateGolden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(ChatTemplateGolden, MatchesTransformers) {
  const GoldenCase& g = GetParam();
  ChatJinja tpl = load_template(g.tpl);
  ChatJinja::Vars vars;
  vars.add_generation_prompt = g.gen;
  vars.now = "2025-03-09 14:05:06";
  const ojson* err = expected_error(g);
  if (err) {
    try {
      std::string out = tpl.render(conversation(g.conv), vars);
      FAIL() << g.name() << ": expected an error (" << (*err)["message"] << "), rendered:\n" << out;
    } catch (const JinjaRaise& e) {
      EXPECT_EQ((*err)["kind"], "raise_exception") << g.name() << ": " << e.what();
      if ((*err)["kind"] == "raise_exception") {
        EXPECT_EQ(std::string(e.what()), (*err)["message"].get<std::string>());
      }
    } catch (const Error& e) {
      EXPECT_EQ((*err)["kind"], "runtime_error") << g.name() << ": " << e.what();
    }
    return;
  }
  const std::string golden = slurp(templates_dir() + "/golden/" + g.name() + ".txt");
  std::string out;
  try {
    out = tpl.render(conversation(g.conv), vars);
  } catch (const std::exception& e) {
    FAIL() << g.name() << ": " << e.what();
  }
  EXPECT_EQ(out, golden) << g.name();
}

INSTANTIATE_TEST_SUITE_P(All, ChatTemplateGolden, ::testing::ValuesIn(golden_cases()),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) {
                           std::string n = info.param.name();
                           for (char& c : n)
                             if (!isalnum((unsigned char)c)) c = '_';
                           return n;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ChatTemplateGolden);

TEST(ChatTemplateGolden, AllCasesPresent) {
  std::vector<GoldenCase> cases = golden_cases();
  if (cases.empty()) GTEST_SKIP() << "no " << templates_dir();
  int goldens = 0, errors = 0;
  for (const GoldenCase& g : cases) {
    if (expected_error(g)) ++errors;
    else if (std::ifstream(templates_dir() + "/golden/" + g.name() + ".txt").good()) ++goldens;
    else ADD_FAILURE() << "no golden and no expected error for " << g.name();
  }
  EXPECT_EQ(goldens, 166);
  EXPECT_EQ(errors, 10);
}

std::string render(const std::string& src, const ojson& ctx = ojson::object()) {
  return JinjaTemplate(src).render(ctx);
}

TEST(Jinja, WhitespaceControlAsTransformers) {
  // trim_blocks removes the newline after a block tag; lstrip_blocks the indentation before.
  EXPECT_EQ(render("{% if true %}\n  a\n{% endif %}\nb"), "  a\nb");
  EXPECT_EQ(render("x\n    {% if true %}y{% endif %}"), "x\ny");
  EXPECT_EQ(render("a  {{- 'b' -}}  \n c"), "abc");
  EXPECT_EQ(render("a\n  {%- if true -%}\n  b\n{%- endif %}"), "ab");
  EXPECT_EQ(render("{{ 'v' }}\n"), "v");           // one trailing newline dropped
  EXPECT_EQ(render("{{ 'v' }}\n\n"), "v\n");
  EXPECT_EQ(render("a\r\n{% if true %}\r\nb{% endif %}"), "a\nb");
  EXPECT_EQ(render("{# c #}\nx"), "x");
  EXPECT_EQ(render("a {%+ if true %}b{% endif %}"), "a b");
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
  EXPECT_EQ(render("{{ '}}' }}"), "}}");
}

TEST(Jinja, LoopsAndScoping) {
  EXPECT_EQ(render("{% set n = 0 %}{% for i in [1,2,3] %}{% set n = n + i %}{{ n }}{% endfor %}|{{ n }}"), "123|0");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1,2,3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(render("{% for x in [1,2,3,4] if x is even %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}"
                   "{% endfor %}"),
            "1/2,2/2");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "a=1;b=2;");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in [1,2,3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}"), "1");
  EXPECT_EQ(render("{% for x in [1,2,3] %}{{ loop.revindex }}{{ loop.cycle('a','b') }}{% endfor %}"), "3a2b1a");
}

TEST(Jinja, ExpressionsFiltersTests) {
  EXPECT_EQ(render("{{ 'ab' + 'c' | upper + 'd' }}"), "abCd");  // a filter binds tighter than +
  EXPECT_EQ(render("{{ [1, 'a', none, true, 1.5] }}"), "[1, 'a', None, True, 1.5]");
  EXPECT_EQ(render("{{ {'k': [1, 2.0, 'é\"'], 'n': none} | tojson }}"), "{\"k\": [1, 2.0, \"é\\\"\"], \"n\": null}");
  EXPECT_EQ(render("{{ {'a': [1]} | tojson(indent=2) }}"), "{\n  \"a\": [\n    1\n  ]\n}");
  EXPECT_EQ(render("{{ 'hello'[1:-1] }}{{ 'abc'[::-1] }}{{ [1,2,3][-1] }}"), "ellcba3");
  EXPECT_EQ(render("{{ ' x '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b  c'.split() | length }}"),
            "x|['a', 'b', '', 'c']|3");
  EXPECT_EQ(render("{{ 'x' in 'axb' }}{{ 2 not in [1] }}{{ 'k' in {'k': 1} }}"), "TrueTrueTrue");
  EXPECT_EQ(render("{{ undefined_thing is defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}"),
            "FalseTrueTrueTrue");
  EXPECT_EQ(render("{{ [{'r': 'u'}, {'r': 'a'}, {'r': 'u'}] | selectattr('r', 'equalto', 'u') | list | length }}"),
            "2");
  EXPECT_EQ(render("{{ [{'n': 'a'}, {'n': 'b'}] | map(attribute='n') | join('|') }}"), "a|b");
  EXPECT_EQ(render("{{ missing | default('d') }}{{ 7 // 2 }}{{ -7 // 2 }}{{ 7 % 3 }}{{ 1 / 2 }}"), "d3-410.5");
  EXPECT_EQ(render("{{ 'a' if false else 'b' }}{{ 'x' ~ 1 }}{{ 'Ab'.lower() }}{{ 'a-b'.replace('-', '+') }}"),
            "bx1aba+b");
  EXPECT_EQ(render("{{ 'é✓'|length }}{{ 'é✓'[1] }}"), "2✓");
  EXPECT_EQ(render("{{ {'a': 1}.get('b', 'z') }}{{ {'a': 1}.get('a') }}"), "z1");
  EXPECT_EQ(render("{% set x %}A{{ 1 }}{% endset %}{{ x }}{% filter upper %}b{% endfilter %}"), "A1B");
  EXPECT_EQ(render("{{ 1e-05 }} {{ 0.1 }} {{ 1e16 }} {{ 2.5e-7 }} {{ 100.0 }}"), "1e-05 0.1 1e+16 2.5e-07 100.0");
}

TEST(Jinja, MacrosAndCall) {
  EXPECT_EQ(render("{% macro m(a, b='B') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}"), "1B23");
  EXPECT_EQ(render("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"), "321");
  EXPECT_EQ(render("{% macro w() %}[{{ caller() }}]{% endmacro %}{% call w() %}in{% endcall %}"), "[in]");
  // Unbounded recursion stops at the depth bound with an error, not a crash.
  EXPECT_THROW(render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"), Error);
}

TEST(Jinja, Errors) {
  try {
    render("a\n{% if x %}\n{% include 'other' %}{% endif %}");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("include"), std::string::npos) << e.what();
  }
  try {
    render("\n{{ x | no_such_filter }}");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  try {
    render("{{ raise_exception('bad role') }}");
    FAIL();
  } catch (const JinjaRaise& e) {
    EXPECT_STREQ(e.what(), "bad role");
  }
  EXPECT_THROW(render("{{ 'a' + {} }}"), Error);
  EXPECT_THROW(render("{{ x.y }}"), Error);  // attribute of an undefined value
  EXPECT_THROW(render("{% if x %}"), Error);  // missing endif
  // Depth bounds: template nesting, and user data nested deeper than 64 levels.
  EXPECT_THROW(render("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}"), Error);
  EXPECT_EQ(render("{{ " + std::string(50, '(') + "1" + std::string(50, ')') + " }}"), "1");
  ojson deep = 1;
  for (int i = 0; i < 100; ++i) deep = ojson::array({deep});
  EXPECT_THROW(render("{{ x | length }}", {{"x", deep}}), Error);
}

TEST(Jinja, StrftimeNow) {
  JinjaOptions opt;
  opt.now = "2025-03-09 14:05:06";
  EXPECT_EQ(JinjaTemplate("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y %A') }}").render(ojson::object(), opt),
            "2025-03-09|09 Mar 2025 Sunday");
}

// The CLI: exact bytes on stdout; a raising template exits non-zero with its message.
TEST(Jinja, TemplateCommand) {
  if (golden_cases().empty()) GTEST_SKIP() << "no " << templates_dir();
  const std::string dir = ::testing::TempDir() + "/fp8rl_template_cmd";
  std::system(("mkdir -p '" + dir + "'").c_str());
  ojson cfg = {{"bos_token", "<bos>"}, {"eos_token", "<eos>"},
               {"chat_template", slurp(templates_dir() + "/gemma2-it.jinja")}};
  std::ofstream(dir + "/tokenizer_config.json") << cfg.dump();
  ojson convs = ojson::parse(slurp(templates_dir() + "/conversations.json"));
  for (const ojson& c : convs["conversations"]) std::ofstream(dir + "/" + c["id"].get<std::string>() + ".json") << c.dump();
  auto run = [&](const std::string& args, std::string* out) {
    std::string cmd = std::string("'") + FP8RL_BINARY + "' template --tokenizer '" + dir + "' " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    out->clear();
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  std::string out;
  EXPECT_EQ(run("--messages '" + dir + "/multi_turn.json' --generation-prompt", &out), 0) << out;
  EXPECT_EQ(out, slurp(templates_dir() + "/golden/gemma2-it__multi_turn__true.txt"));
  EXPECT_NE(run("--messages '" + dir + "/system_user.json'", &out), 0);
  EXPECT_NE(out.find("System role not supported"), std::string::npos) << out;
  EXPECT_EQ(out.find(".cpp:"), std::string::npos) << out;  // no source location
}

// Session setup: with tokenizer.chat_template the model's own Jinja template formats prompts,
// with chat_template_kwargs as extra variables (Qwen3's enable_thinking here).
TEST(Jinja, SessionUsesTheModelTemplate) {
  const std::string qwen = shared_data() + "/tokenizers/qwen3";
  if (!std::ifstream(qwen + "/chat_template.jinja").good()) GTEST_SKIP() << "no " << qwen;
  RunConfig c = config_load("", {"tokenizer.path=" + qwen, "tokenizer.chat_template=true",
                                 "tokenizer.chat_template_kwargs={\"enable_thinking\": false}"});
  Session s = session_open(c, ::testing::TempDir());
  ASSERT_TRUE(s.chat_jinja);
  TaskItem item = s.train_item(0);
  const std::string text = s.tokenizer.decode(s.prompt_ids(item), /*skip_special=*/false);
  EXPECT_EQ(text, "<|im_start|>user\n" + item.prompt + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_THROW(config_load("", {"tokenizer.chat_template_kwargs=[1]"}), Error);
  // generation_config.json's eos ids stop generation too.
  const std::string model_dir = ::testing::TempDir() + "/fp8rl_stop_ids";
  std::system(("mkdir -p '" + model_dir + "'").c_str());
  std::ofstream(model_dir + "/tokenizer.json") << slurp(qwen + "/tokenizer.json");
  std::ofstream(model_dir + "/generation_config.json") << "{\"eos_token_id\": [151645, 151643]}";
  Session m = session_open(config_load("", {"model.path=" + model_dir}), ::testing::TempDir());
  EXPECT_EQ(m.stop_ids, (std::vector<int32_t>{m.eos_id, 151643}));
  EXPECT_EQ(m.response_text({s.tokenizer.token_to_id("a"), 151643, s.tokenizer.token_to_id("b")}), "a");
  RunConfig y;
  config_apply_yaml(y, "tokenizer:\n  chat_template_kwargs: {enable_thinking: false, effort: \"low\"}\n", "t.yaml");
  EXPECT_EQ(y.tokenizer.chat_template_kwargs, "{\"effort\":\"low\",\"enable_thinking\":false}");
}

}  // namespace
}  // namespace fp8rl
