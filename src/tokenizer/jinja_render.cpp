// Jinja evaluator: walks the AST (jinja_ast.h) and writes the output text.
//
// Scopes follow jinja2: the template's top level is one scope (the context variables plus
// top-level sets); every for-loop iteration and every macro call gets a child scope, so a
// {% set %} inside them is gone when they end (namespace attributes are the way out, as in
// jinja2). {% if %} bodies run in the enclosing scope.
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/jinja.h"
#include "tokenizer/jinja_ast.h"

namespace fp8rl {
namespace jinja {
namespace {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { kNormal, kBreak, kContinue };

ScopePtr child_of(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

class Renderer {
 public:
  explicit Renderer(const JinjaOptions& opt) : opt_(opt) {}

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const StmtPtr& s : body) {
      Flow f = exec_stmt(*s, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    switch (e.op) {
      case Expr::Op::kLiteral: return e.literal;
      case Expr::Op::kName: {
        const Value* v = scope->find(e.name);
        return v ? *v : Value::undefined("'" + e.name + "' is undefined");
      }
      case Expr::Op::kList:
      case Expr::Op::kTuple: {
        List l;
        for (const ExprPtr& a : e.args) l.push_back(eval(*a, scope));
        return Value::make_list(std::move(l));
      }
      case Expr::Op::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k], scope);
          if (!key.is_string()) jinja_fail(e.line, "dict literal keys must be strings");
          d.set(key.s, eval(*e.args[k + 1], scope));
        }
        return Value::make_dict(std::move(d));
      }
      case Expr::Op::kGetAttr: return jinja_getattr(eval(*e.args[0], scope), e.name, e.line);
      case Expr::Op::kGetItem: return jinja_getitem(eval(*e.args[0], scope), eval(*e.args[1], scope), e.line);
      case Expr::Op::kSlice: {
        auto opt = [&](const ExprPtr& p) { return p ? eval(*p, scope) : Value::none(); };
        return jinja_slice(eval(*e.args[0], scope), opt(e.args[1]), opt(e.args[2]), opt(e.args[3]), e.line);
      }
      case Expr::Op::kCall: {
        Value callee = eval(*e.args[0], scope);
        CallArgs a = eval_args(e, scope, 1);
        return call(callee, a, e.line);
      }
      case Expr::Op::kFilter: {
        Value in = eval(*e.args[0], scope);
        CallArgs a = eval_args(e, scope, 1);
        return jinja_filter(e.name, in, a, e.line);
      }
      case Expr::Op::kTest: {
        Value v = eval(*e.args[0], scope);
        CallArgs a = eval_args(e, scope, 1);
        return Value::boolean(jinja_test(e.name, v, a, e.line) != e.negated);
      }
      case Expr::Op::kNot: return Value::boolean(!value_truthy(eval(*e.args[0], scope)));
      case Expr::Op::kNeg:
      case Expr::Op::kPos: {
        Value v = eval(*e.args[0], scope);
        if (v.is_undefined()) jinja_fail_undefined(e.line, v);
        if (!v.is_number()) jinja_fail(e.line, "bad operand type for unary -: '" + value_type_name(v) + "'");
        if (e.op == Expr::Op::kPos) return v;
        if (v.kind == Kind::kFloat) return Value::real(-v.f);
        return Value::integer(-(v.kind == Kind::kBool ? (int64_t)v.b : v.i));
      }
      case Expr::Op::kAnd: {
        Value a = eval(*e.args[0], scope);
        return value_truthy(a) ? eval(*e.args[1], scope) : a;
      }
      case Expr::Op::kOr: {
        Value a = eval(*e.args[0], scope);
        return value_truthy(a) ? a : eval(*e.args[1], scope);
      }
      case Expr::Op::kBinary: return jinja_binary(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope), e.line);
      case Expr::Op::kCond: {
        if (value_truthy(eval(*e.args[1], scope))) return eval(*e.args[0], scope);
        return e.args[2] ? eval(*e.args[2], scope) : Value::undefined("the conditional expression had no else");
      }
    }
    jinja_fail(e.line, "internal: unknown expression");
  }

 private:
  CallArgs eval_args(const Expr& e, const ScopePtr& scope, size_t first) {
    CallArgs a;
    for (size_t k = first; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k], scope));
    for (const auto& kv : e.kwargs) a.kw.emplace_back(kv.first, eval(*kv.second, scope));
    return a;
  }

  Value call(const Value& callee, CallArgs& a, int line) {
    if (callee.is_undefined()) jinja_fail_undefined(line, callee);
    if (callee.kind != Kind::kCallable) jinja_fail(line, "'" + value_type_name(callee) + "' object is not callable");
    try {
      return callee.fn->call(a);
    } catch (const JinjaRaise&) {
      throw;
    } catch (const Error& err) {
      std::string msg = err.what();
      if (msg.rfind("chat template", 0) == 0) throw;
      jinja_fail(line, msg);
    }
  }

  Flow exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out) {
    switch (s.op) {
      case Stmt::Op::kText: out += s.text; return Flow::kNormal;
      case Stmt::Op::kOutput: out += value_str(eval(*s.expr, scope)); return Flow::kNormal;
      case Stmt::Op::kIf:
        for (size_t k = 0; k < s.conds.size(); ++k)
          if (value_truthy(eval(*s.conds[k], scope))) return exec(s.bodies[k], scope, out);
        if (s.bodies.size() > s.conds.size()) return exec(s.bodies.back(), scope, out);
        return Flow::kNormal;
      case Stmt::Op::kFor: exec_for(s, scope, out); return Flow::kNormal;
      case Stmt::Op::kSet: assign(s, scope, eval(*s.expr, scope)); return Flow::kNormal;
      case Stmt::Op::kSetBlock: {
        std::string text;
        exec(s.bodies[0], scope, text);
        assign(s, scope, s.filter ? apply_filter_chain(*s.filter, Value::string(text), scope) : Value::string(text));
        return Flow::kNormal;
      }
      case Stmt::Op::kFilterBlock: {
        std::string text;
        exec(s.bodies[0], scope, text);
        out += value_str(apply_filter_chain(*s.filter, Value::string(text), scope));
        return Flow::kNormal;
      }
      case Stmt::Op::kMacro: scope->vars[s.name] = make_macro(s, s.name, scope); return Flow::kNormal;
      case Stmt::Op::kCallBlock: {
        const Expr& c = *s.expr;
        Value callee = eval(*c.args[0], scope);
        CallArgs a = eval_args(c, scope, 1);
        a.kw.emplace_back("caller", make_macro(s, "caller", scope));
        out += value_str(call(callee, a, s.line));
        return Flow::kNormal;
      }
      case Stmt::Op::kBreak: return Flow::kBreak;
      case Stmt::Op::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  // `chain` is a kFilter whose innermost input (args[0]) is null: apply it to `input`.
  Value apply_filter_chain(const Expr& chain, const Value& input, const ScopePtr& scope) {
    Value in = chain.args[0] ? apply_filter_chain(*chain.args[0], input, scope) : input;
    CallArgs a = eval_args(chain, scope, 1);
    return jinja_filter(chain.name, in, a, chain.line);
  }

  void assign(const Stmt& s, const ScopePtr& scope, Value v) {
    if (!s.attr_target) {
      scope->vars[s.targets[0]] = std::move(v);
      return;
    }
    const Value* obj = scope->find(s.targets[0]);
    if (!obj || obj->kind != Kind::kNamespace)
      jinja_fail(s.line, "cannot assign attribute '" + s.targets[1] + "' on '" + s.targets[0] +
                             "': only namespace() objects have assignable attributes");
    obj->dict->set(s.targets[1], std::move(v));
  }

  void bind_targets(const Stmt& s, const ScopePtr& scope, const Value& item) {
    if (s.targets.size() == 1) {
      scope->vars[s.targets[0]] = item;
      return;
    }
    std::vector<Value> parts = value_iterate(item);
    if (parts.size() != s.targets.size())
      jinja_fail(s.line, "cannot unpack " + std::to_string(parts.size()) + " values into " +
                             std::to_string(s.targets.size()) + " loop variables");
    for (size_t k = 0; k < parts.size(); ++k) scope->vars[s.targets[k]] = parts[k];
  }

  void exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    Value iterable = eval(*s.expr, scope);
    if (iterable.kind != Kind::kList && iterable.kind != Kind::kDict && iterable.kind != Kind::kString &&
        !iterable.is_undefined())
      jinja_fail(s.line, "'" + value_type_name(iterable) + "' object is not iterable");
    std::vector<Value> items = value_iterate(iterable);
    if (!s.conds.empty()) {  // {% for x in xs if cond %}: loop.* counts the kept items
      std::vector<Value> kept;
      for (const Value& item : items) {
        ScopePtr probe = child_of(scope);
        bind_targets(s, probe, item);
        if (value_truthy(eval(*s.conds[0], probe))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t n = (int64_t)items.size();
    for (int64_t k = 0; k < n; ++k) {
      ScopePtr it = child_of(scope);
      bind_targets(s, it, items[(size_t)k]);
      Dict loop;
      loop.set("index", Value::integer(k + 1));
      loop.set("index0", Value::integer(k));
      loop.set("revindex", Value::integer(n - k));
      loop.set("revindex0", Value::integer(n - k - 1));
      loop.set("first", Value::boolean(k == 0));
      loop.set("last", Value::boolean(k == n - 1));
      loop.set("length", Value::integer(n));
      loop.set("depth", Value::integer(1));
      loop.set("depth0", Value::integer(0));
      loop.set("previtem", k > 0 ? items[(size_t)k - 1] : Value::undefined("there is no previous item"));
      loop.set("nextitem", k + 1 < n ? items[(size_t)k + 1] : Value::undefined("there is no next item"));
      Value cycle;
      cycle.kind = Kind::kCallable;
      cycle.fn = std::make_shared<Callable>(Callable{"cycle", [k](CallArgs& a) -> Value {
        if (a.pos.empty()) throw Error("chat template: loop.cycle() needs at least one value");
        return a.pos[(size_t)k % a.pos.size()];
      }});
      loop.set("cycle", cycle);
      it->vars["loop"] = Value::make_dict(std::move(loop));
      if (exec(s.bodies[0], it, out) == Flow::kBreak) break;
    }
    if (n == 0 && s.bodies.size() > 1) exec(s.bodies[1], scope, out);
  }

  // A macro (or a call block's caller) as a callable. The closure is held weakly: a macro
  // lives in the scope it closes over, and a strong reference would be a cycle.
  Value make_macro(const Stmt& s, const std::string& name, const ScopePtr& closure) {
    std::weak_ptr<Scope> weak = closure;
    const Stmt* stmt = &s;
    Value v;
    v.kind = Kind::kCallable;
    v.fn = std::make_shared<Callable>(Callable{name, [this, stmt, weak, name](CallArgs& a) -> Value {
      ScopePtr parent = weak.lock();
      if (!parent) throw Error("chat template line " + std::to_string(stmt->line) + ": macro '" + name +
                               "' called after its scope ended");
      if (++depth_ > opt_.max_depth) {
        depth_ = 0;
        throw Error("chat template line " + std::to_string(stmt->line) + ": macro '" + name + "' nested deeper than " +
                    std::to_string(opt_.max_depth) + " calls");
      }
      ScopePtr scope = child_of(parent);
      const auto& params = stmt->params;
      if (a.pos.size() > params.size())
        jinja_fail(stmt->line, "macro '" + name + "' takes not more than " + std::to_string(params.size()) +
                                   " argument(s)");
      for (size_t k = 0; k < params.size(); ++k) {
        const Value* kw = a.kwarg(params[k].first);
        if (k < a.pos.size()) scope->vars[params[k].first] = a.pos[k];
        else if (kw) scope->vars[params[k].first] = *kw;
        else if (params[k].second) scope->vars[params[k].first] = eval(*params[k].second, scope);
        else scope->vars[params[k].first] = Value::undefined("'" + params[k].first + "' is undefined");
      }
      for (const auto& kv : a.kw) {
        bool known = kv.first == "caller";
        for (const auto& p : params) known = known || p.first == kv.first;
        if (!known) jinja_fail(stmt->line, "macro '" + name + "' takes no keyword argument '" + kv.first + "'");
        if (kv.first == "caller") scope->vars["caller"] = kv.second;
      }
      std::string text;
      exec(stmt->bodies[0], scope, text);
      --depth_;
      return Value::string(text);
    }});
    return v;
  }

  const JinjaOptions& opt_;
  int depth_ = 0;
};

}  // namespace
}  // namespace jinja

JinjaTemplate::JinjaTemplate(const std::string& source)
    : program_(std::make_shared<jinja::Program>(jinja::jinja_parse(source))) {}

std::string JinjaTemplate::render(const nlohmann::ordered_json& context, const JinjaOptions& opt) const {
  using namespace jinja;
  if (!context.is_object()) throw Error("chat template: the render context must be a JSON object");
  auto globals = std::make_shared<Scope>();
  for (auto& kv : jinja_globals(opt.now)) globals->vars[kv.first] = kv.second;
  ScopePtr root = child_of(globals);
  for (auto it = context.begin(); it != context.end(); ++it) root->vars[it.key()] = value_from_json(it.value());
  Renderer r(opt);
  std::string out;
  r.exec(program_->body, root, out);
  return out;
}

}  // namespace fp8rl
