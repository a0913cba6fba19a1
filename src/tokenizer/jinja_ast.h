// Internals of the Jinja interpreter (jinja.h): the value type and the AST.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace fp8rl::jinja {

struct Value;
struct Callable;
using List = std::vector<Value>;
struct Dict {  // insertion-ordered, string keys (Python dict order)
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };

// A Python-like value. Lists and dicts are shared (copying a Value is cheap); templates
// cannot mutate them (transformers renders in an immutable sandbox) except namespaces.
struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                    // string; for kUndefined, the name that was undefined
  std::shared_ptr<List> list;       // kList
  std::shared_ptr<Dict> dict;       // kDict, kNamespace
  std::shared_ptr<Callable> fn;     // kCallable

  static Value undefined(std::string name = "") { Value v; v.s = std::move(name); return v; }
  static Value none() { Value v; v.kind = Kind::kNone; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::kBool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = Kind::kInt; v.i = x; return v; }
  static Value real(double x) { Value v; v.kind = Kind::kFloat; v.f = x; return v; }
  static Value string(std::string x) { Value v; v.kind = Kind::kString; v.s = std::move(x); return v; }
  static Value make_list(List x = {}) {
    Value v; v.kind = Kind::kList; v.list = std::make_shared<List>(std::move(x)); return v;
  }
  static Value make_dict(Dict x = {}) {
    Value v; v.kind = Kind::kDict; v.dict = std::make_shared<Dict>(std::move(x)); return v;
  }
  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_mapping() const { return kind == Kind::kDict || kind == Kind::kNamespace; }
};

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* kwarg(const std::string& name) const;
};

struct Callable {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

// ---- values (jinja_value.cpp) -------------------------------------------------------
Value value_from_json(const nlohmann::ordered_json& j);
bool value_truthy(const Value& v);
std::string value_type_name(const Value& v);   // Python's: 'str', 'dict', 'NoneType', ...
std::string value_str(const Value& v, int depth = 0);   // Python str(); undefined -> ""
std::string value_repr(const Value& v, int depth = 0);  // Python repr()
// Python json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: none).
std::string value_tojson(const Value& v, int indent = -1, int depth = 0);
bool value_equal(const Value& a, const Value& b);
int value_compare(const Value& a, const Value& b);  // <0, 0, >0; throws for unorderable
int64_t value_length(const Value& v);               // len(); undefined -> 0
// Iterating a value: list items, dict keys, string characters; undefined -> none.
std::vector<Value> value_iterate(const Value& v);
// UTF-8 helpers: code point boundaries (byte offsets, size = count + 1).
std::vector<size_t> utf8_offsets(const std::string& s);

// ---- AST ----------------------------------------------------------------------------
struct Expr;
using ExprPtr = std::shared_ptr<Expr>;
struct Expr {
  enum class Op {
    kLiteral, kName, kList, kTuple, kDict, kGetAttr, kGetItem, kSlice, kCall, kFilter, kTest,
    kNot, kNeg, kPos, kBinary, kAnd, kOr, kCond,
  };
  Op op = Op::kLiteral;
  int line = 0;
  Value literal;                 // kLiteral
  std::string name;              // name / attribute / filter / test / binary operator
  bool negated = false;          // kTest: "is not"
  std::vector<ExprPtr> args;     // operands (see the parser for each op's layout)
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Stmt;
using StmtPtr = std::shared_ptr<Stmt>;
using Body = std::vector<StmtPtr>;
struct Stmt {
  enum class Op { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kCallBlock, kFilterBlock, kBreak, kContinue };
  Op op = Op::kText;
  int line = 0;
  std::string text;                    // kText
  ExprPtr expr;                        // kOutput, kFor iterable, kSet value, kCallBlock call
  std::vector<ExprPtr> conds;          // kIf: one per if/elif; kFor: [filter] or empty
  std::vector<Body> bodies;            // kIf: one per cond (+ else); kFor: body (+ else); others: [body]
  std::vector<std::string> targets;    // kFor / kSet names; kSet "ns.attr" as {"ns", "attr"} with attr_target
  bool attr_target = false;            // kSet: targets = {object name, attribute}
  std::string name;                    // kMacro name
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro / kCallBlock caller params
  ExprPtr filter;                      // kFilterBlock / kSetBlock: a kFilter chain applied to the body (args[0] null)
};

struct Program {
  Body body;
};

Program jinja_parse(const std::string& source);

// ---- built-ins (jinja_builtins.cpp) ---------------------------------------------------
// Errors carry "chat template line N: " with `line`. Undefined operands that cannot be used
// (an attribute of an undefined value, arithmetic) throw with the undefined value's hint.
[[noreturn]] void jinja_fail(int line, const std::string& msg);
[[noreturn]] void jinja_fail_undefined(int line, const Value& undefined);
// obj.name: a dict key (or a bound dict/str method), a namespace attribute; else undefined.
Value jinja_getattr(const Value& obj, const std::string& name, int line);
// obj[key]: dict key, list/str index (negative from the end); else undefined.
Value jinja_getitem(const Value& obj, const Value& key, int line);
// obj[start:stop:step] for lists and strings (null Exprs are None).
Value jinja_slice(const Value& obj, const Value& start, const Value& stop, const Value& step, int line);
Value jinja_binary(const std::string& op, const Value& a, const Value& b, int line);
Value jinja_filter(const std::string& name, const Value& input, CallArgs& args, int line);
bool jinja_test(const std::string& name, const Value& v, CallArgs& args, int line);
// The globals: range, namespace, dict, raise_exception, strftime_now (clock from `now`).
std::vector<std::pair<std::string, Value>> jinja_globals(const std::string& now);

}  // namespace fp8rl::jinja
