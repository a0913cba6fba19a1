// A Jinja interpreter for Hugging Face chat templates: the subset real templates use,
// with the semantics of transformers' renderer (jinja2 3.x with trim_blocks=True,
// lstrip_blocks=True, loopcontrols, Python str/list/dict behaviour for values).
//
// Pipeline: source -> jinja_lex (tokens, whitespace control applied) -> jinja_parse (AST of
// statements and expressions, jinja_ast.h) -> jinja_render (tree-walking evaluator over
// jinja::Value, a small JSON-like value with Python semantics).
//
// Covered: {{ }}, {% if/elif/else %}, {% for x in y if c %} (tuple targets, loop.* variables,
// else, break/continue), {% set %} (names, ns.attr, block set), {% macro %} (defaults,
// caller), {% call %}, {% filter %}, {% generation %}, {% raw %}, comments; Jinja's scoping
// (a set inside a loop or macro does not leak out); the usual filters, tests, str/dict
// methods, slicing; globals range, namespace, dict, raise_exception, strftime_now.
// A construct outside the subset is an error naming the template line. Errors are user
// errors (fp8rl::Error without a source location); raise_exception(msg) throws JinjaRaise
// whose what() is exactly msg.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace fp8rl {

namespace jinja {
struct Program;
}

// The template called raise_exception(message): what() is the message, nothing added.
class JinjaRaise : public Error {
 public:
  using Error::Error;
};

struct JinjaOptions {
  // strftime_now's clock, "YYYY-MM-DD HH:MM:SS"; empty = the current local time.
  std::string now;
  int max_depth = 64;  // bound on macro recursion and on nesting of values being printed
};

class JinjaTemplate {
 public:
  // Parses `source` (LF or CRLF); throws Error("chat template line N: ...") on a syntax
  // error or an unsupported construct.
  explicit JinjaTemplate(const std::string& source);
  // Renders with the variables of `context` (an object; a null value is Python None, an
  // absent key is undefined). Throws JinjaRaise from raise_exception, Error otherwise.
  std::string render(const nlohmann::ordered_json& context, const JinjaOptions& opt = {}) const;

 private:
  std::shared_ptr<const jinja::Program> program_;
};

}  // namespace fp8rl
