// Jinja built-ins with Python semantics: attribute/item access, slicing, operators, filters,
// tests, str/dict methods and the globals transformers adds.
#include <algorithm>
#include <cmath>
#include <ctime>

#include "core/error.h"
#include "tokenizer/jinja.h"
#include "tokenizer/jinja_ast.h"

namespace fp8rl::jinja {
namespace {

constexpr int64_t kMaxRange = 1 << 20;

bool py_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f); }

// Python str.strip/lstrip/rstrip: `chars` empty-optional means whitespace.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  auto strip_me = [&](unsigned char c) {
    return chars.is_string() ? chars.s.find((char)c) != std::string::npos : py_space(c);
  };
  if (chars.is_string()) {
    bool ascii = true;
    for (unsigned char c : chars.s) ascii = ascii && c < 0x80;
    if (!ascii) {  // multi-byte strip set: compare whole code points
      std::vector<size_t> off = utf8_offsets(s);
      std::vector<size_t> coff = utf8_offsets(chars.s);
      auto in_set = [&](size_t k) {
        std::string cp = s.substr(off[k], off[k + 1] - off[k]);
        for (size_t j = 0; j + 1 < coff.size(); ++j)
          if (chars.s.compare(coff[j], coff[j + 1] - coff[j], cp) == 0) return true;
        return false;
      };
      size_t a = 0, b = off.size() - 1;
      while (left && a < b && in_set(a)) ++a;
      while (right && b > a && in_set(b - 1)) --b;
      return s.substr(off[a], off[b] - off[a]);
    }
  }
  size_t a = 0, b = s.size();
  while (left && a < b && strip_me((unsigned char)s[a])) ++a;
  while (right && b > a && strip_me((unsigned char)s[b - 1])) --b;
  return s.substr(a, b - a);
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep.is_string()) {
    size_t k = 0;
    while (true) {
      while (k < s.size() && py_space((unsigned char)s[k])) ++k;
      if (k >= s.size()) break;
      if (maxsplit >= 0 && (int64_t)out.size() == maxsplit) {
        size_t e = s.size();
        while (e > k && py_space((unsigned char)s[e - 1])) --e;
        out.push_back(s.substr(k, e - k));
        break;
      }
      size_t e = k;
      while (e < s.size() && !py_space((unsigned char)s[e])) ++e;
      out.push_back(s.substr(k, e - k));
      k = e;
    }
    return out;
  }
  if (sep.s.empty()) throw Error("chat template: empty separator in split()");
  size_t k = 0;
  while (true) {
    size_t f = s.find(sep.s, k);
    if (f == std::string::npos || (maxsplit >= 0 && (int64_t)out.size() == maxsplit)) {
      out.push_back(s.substr(k));
      break;
    }
    out.push_back(s.substr(k, f - k));
    k = f + sep.s.size();
  }
  return out;
}

std::string ascii_map(std::string s, int (*f)(int)) {
  for (char& c : s)
    if ((unsigned char)c < 0x80) c = (char)f((unsigned char)c);
  return s;
}

std::string py_capitalize(const std::string& s) {
  std::string out = ascii_map(s, [](int c) { return std::tolower(c); });
  if (!out.empty() && (unsigned char)out[0] < 0x80) out[0] = (char)std::toupper((unsigned char)out[0]);
  return out;
}

std::string py_title(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    unsigned char u = (unsigned char)c;
    bool alpha = u < 0x80 && std::isalpha(u);
    if (alpha) c = (char)(prev_cased ? std::tolower(u) : std::toupper(u));
    prev_cased = alpha;
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  size_t k = 0;
  int64_t n = 0;
  if (from.empty()) {
    std::vector<size_t> off = utf8_offsets(s);
    for (size_t j = 0; j + 1 < off.size(); ++j) {
      if (count < 0 || n < count) out += to, ++n;
      out += s.substr(off[j], off[j + 1] - off[j]);
    }
    if (count < 0 || n < count) out += to;
    return out;
  }
  while (true) {
    size_t f = s.find(from, k);
    if (f == std::string::npos || (count >= 0 && n >= count)) break;
    out += s.substr(k, f - k) + to;
    k = f + from.size();
    ++n;
  }
  return out + s.substr(k);
}

// Positional-or-keyword argument k named `name`, or `fallback`.
Value arg(const CallArgs& a, size_t k, const char* name, Value fallback = Value::undefined()) {
  if (k < a.pos.size()) return a.pos[k];
  if (const Value* v = a.kwarg(name)) return *v;
  return fallback;
}

int64_t as_int(const Value& v, int line, const char* what) {
  if (v.kind == Kind::kInt) return v.i;
  if (v.kind == Kind::kBool) return v.b;
  if (v.kind == Kind::kFloat) return (int64_t)v.f;
  jinja_fail(line, std::string(what) + " must be an integer, not " + value_type_name(v));
}

double as_num(const Value& v) { return v.kind == Kind::kFloat ? v.f : v.kind == Kind::kBool ? v.b : (double)v.i; }

const std::string& need_str(const Value& v, int line, const char* what) {
  if (v.kind == Kind::kUndefined) jinja_fail_undefined(line, v);
  if (!v.is_string()) jinja_fail(line, std::string(what) + " needs a string, not " + value_type_name(v));
  return v.s;
}

Value callable(std::string name, std::function<Value(CallArgs&)> fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

Value str_list(const std::vector<std::string>& parts) {
  List l;
  for (const auto& p : parts) l.push_back(Value::string(p));
  return Value::make_list(std::move(l));
}

// A str or dict method bound to `obj`; undefined if there is none of that name.
Value bound_method(const Value& obj, const std::string& name, int line) {
  static const char* kStr[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "lower",
                               "upper", "title", "capitalize", "replace", "find", "rfind", "count", "join",
                               "splitlines", "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper"};
  static const char* kDict[] = {"items", "keys", "values", "get"};
  bool found = false;
  if (obj.is_string()) {
    for (const char* m : kStr) found = found || name == m;
  } else if (obj.kind == Kind::kDict) {
    for (const char* m : kDict) found = found || name == m;
  }
  if (!found) return Value::undefined();
  return callable(name, [obj, name, line](CallArgs& a) -> Value {
    if (obj.kind == Kind::kDict) {
      if (name == "get") {
        const Value* v = obj.dict->find(need_str(arg(a, 0, "key"), line, "dict.get"));
        return v ? *v : arg(a, 1, "default", Value::none());
      }
      List l;
      for (const auto& kv : obj.dict->items) {
        if (name == "keys") l.push_back(Value::string(kv.first));
        else if (name == "values") l.push_back(kv.second);
        else l.push_back(Value::make_list({Value::string(kv.first), kv.second}));
      }
      return Value::make_list(std::move(l));
    }
    const std::string& s = obj.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      Value chars = arg(a, 0, "chars");
      return Value::string(py_strip(s, chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      Value sep = arg(a, 0, "sep");
      int64_t maxsplit = as_int(arg(a, 1, "maxsplit", Value::integer(-1)), line, "maxsplit");
      if (name == "rsplit" && maxsplit >= 0) {
        if (!sep.is_string()) jinja_fail(line, "rsplit() without a separator is not supported");
        std::vector<std::string> parts;
        std::string rest = s;
        while ((int64_t)parts.size() < maxsplit) {
          size_t f = rest.rfind(sep.s);
          if (f == std::string::npos) break;
          parts.insert(parts.begin(), rest.substr(f + sep.s.size()));
          rest = rest.substr(0, f);
        }
        parts.insert(parts.begin(), rest);
        return str_list(parts);
      }
      return str_list(py_split(s, sep, maxsplit));
    }
    if (name == "startswith" || name == "endswith") {
      Value p = arg(a, 0, "prefix");
      std::vector<Value> options = p.kind == Kind::kList ? *p.list : std::vector<Value>{p};
      for (const Value& o : options) {
        const std::string& x = need_str(o, line, name.c_str());
        bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0 && s.size() >= x.size()
                                        : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        if (hit) return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "lower") return Value::string(ascii_map(s, [](int c) { return std::tolower(c); }));
    if (name == "upper") return Value::string(ascii_map(s, [](int c) { return std::toupper(c); }));
    if (name == "title") return Value::string(py_title(s));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    if (name == "replace")
      return Value::string(py_replace(s, need_str(arg(a, 0, "old"), line, "replace"),
                                      need_str(arg(a, 1, "new"), line, "replace"),
                                      as_int(arg(a, 2, "count", Value::integer(-1)), line, "count")));
    if (name == "find" || name == "rfind") {
      const std::string& x = need_str(arg(a, 0, "sub"), line, name.c_str());
      size_t f = name == "find" ? s.find(x) : s.rfind(x);
      if (f == std::string::npos) return Value::integer(-1);
      return Value::integer((int64_t)utf8_offsets(s.substr(0, f)).size() - 1);
    }
    if (name == "count") {
      const std::string& x = need_str(arg(a, 0, "sub"), line, "count");
      int64_t n = 0;
      if (x.empty()) return Value::integer((int64_t)utf8_offsets(s).size());
      for (size_t f = s.find(x); f != std::string::npos; f = s.find(x, f + x.size())) ++n;
      return Value::integer(n);
    }
    if (name == "join") {
      std::string out;
      std::vector<Value> items = value_iterate(arg(a, 0, "iterable"));
      for (size_t k = 0; k < items.size(); ++k) out += (k ? s : "") + need_str(items[k], line, "str.join");
      return Value::string(out);
    }
    if (name == "splitlines") {
      std::vector<std::string> parts;
      size_t k = 0;
      while (k < s.size()) {
        size_t e = s.find_first_of("\r\n", k);
        if (e == std::string::npos) {
          parts.push_back(s.substr(k));
          break;
        }
        parts.push_back(s.substr(k, e - k));
        k = e + ((s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n') ? 2 : 1);
      }
      return str_list(parts);
    }
    int (*pred)(int) = name == "isdigit" ? ::isdigit : name == "isalpha" ? ::isalpha : name == "isalnum" ? ::isalnum
                     : name == "isspace" ? ::isspace : name == "islower" ? ::islower : ::isupper;
    if (s.empty()) return Value::boolean(false);
    for (unsigned char c : s)
      if (!pred(c)) return Value::boolean(false);
    return Value::boolean(true);
  });
}

// attribute paths "a.b" (selectattr, map, sort, join ...).
Value attr_path(const Value& obj, const std::string& path, int line) {
  Value cur = obj;
  size_t k = 0;
  while (k <= path.size()) {
    size_t e = path.find('.', k);
    std::string part = path.substr(k, e == std::string::npos ? std::string::npos : e - k);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    cur = numeric ? jinja_getitem(cur, Value::integer(std::stoll(part)), line) : jinja_getattr(cur, part, line);
    if (cur.is_undefined() || e == std::string::npos) break;
    k = e + 1;
  }
  return cur;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::vector<Value> sorted_values(std::vector<Value> items, bool reverse, bool case_sensitive, const Value& attribute,
                                 int line) {
  auto key = [&](const Value& v) {
    Value k = attribute.is_string() ? attr_path(v, attribute.s, line) : v;
    if (!case_sensitive && k.is_string()) k.s = ascii_map(k.s, [](int c) { return std::tolower(c); });
    return k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    int c = value_compare(key(a), key(b));
    return reverse ? c > 0 : c < 0;
  });
  return items;
}

}  // namespace

[[noreturn]] void jinja_fail(int line, const std::string& msg) {
  throw Error("chat template line " + std::to_string(line) + ": " + msg);
}

[[noreturn]] void jinja_fail_undefined(int line, const Value& undefined) {
  jinja_fail(line, undefined.s.empty() ? "undefined value" : undefined.s);
}

Value jinja_getattr(const Value& obj, const std::string& name, int line) {
  switch (obj.kind) {
    case Kind::kUndefined: jinja_fail_undefined(line, obj);
    case Kind::kDict: {
      Value m = bound_method(obj, name, line);
      if (!m.is_undefined()) return m;
      if (const Value* v = obj.dict->find(name)) return *v;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    case Kind::kNamespace: {
      if (const Value* v = obj.dict->find(name)) return *v;
      return Value::undefined("'Namespace' object has no attribute '" + name + "'");
    }
    case Kind::kString: {
      Value m = bound_method(obj, name, line);
      if (!m.is_undefined()) return m;
      return Value::undefined("'str object' has no attribute '" + name + "'");
    }
    default: return Value::undefined("'" + value_type_name(obj) + " object' has no attribute '" + name + "'");
  }
}

Value jinja_getitem(const Value& obj, const Value& key, int line) {
  switch (obj.kind) {
    case Kind::kUndefined: jinja_fail_undefined(line, obj);
    case Kind::kDict:
    case Kind::kNamespace: {
      if (key.is_string()) {
        if (const Value* v = obj.dict->find(key.s)) return *v;
        if (obj.kind == Kind::kDict) return jinja_getattr(obj, key.s, line);
      }
      return Value::undefined("'dict object' has no attribute " + value_repr(key));
    }
    case Kind::kList:
    case Kind::kString: {
      if (key.kind != Kind::kInt && key.kind != Kind::kBool) {
        if (key.is_string()) return jinja_getattr(obj, key.s, line);
        jinja_fail(line, value_type_name(obj) + " indices must be integers, not " + value_type_name(key));
      }
      int64_t k = key.kind == Kind::kBool ? key.b : key.i;
      if (obj.kind == Kind::kList) {
        int64_t n = (int64_t)obj.list->size();
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::undefined(value_type_name(obj) + " object has no element " + value_repr(key));
        return (*obj.list)[(size_t)k];
      }
      std::vector<size_t> off = utf8_offsets(obj.s);
      int64_t n = (int64_t)off.size() - 1;
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undefined("str object has no element " + value_repr(key));
      return Value::string(obj.s.substr(off[(size_t)k], off[(size_t)k + 1] - off[(size_t)k]));
    }
    default: return Value::undefined("'" + value_type_name(obj) + " object' has no attribute " + value_repr(key));
  }
}

Value jinja_slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v, int line) {
  if (obj.is_undefined()) jinja_fail_undefined(line, obj);
  if (obj.kind != Kind::kList && obj.kind != Kind::kString)
    jinja_fail(line, "'" + value_type_name(obj) + "' object is not subscriptable");
  std::vector<size_t> off;
  int64_t n;
  if (obj.kind == Kind::kList) {
    n = (int64_t)obj.list->size();
  } else {
    off = utf8_offsets(obj.s);
    n = (int64_t)off.size() - 1;
  }
  auto given = [](const Value& v) { return v.kind != Kind::kUndefined && v.kind != Kind::kNone; };
  int64_t step = given(step_v) ? as_int(step_v, line, "slice step") : 1;
  if (step == 0) jinja_fail(line, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt) {
    if (!given(v)) return dflt;
    int64_t x = as_int(v, line, "slice index");
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  int64_t start = clamp(start_v, step > 0 ? 0 : n - 1), stop = clamp(stop_v, step > 0 ? n : -1);
  List items;
  std::string s;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
    if (obj.kind == Kind::kList) items.push_back((*obj.list)[(size_t)k]);
    else s += obj.s.substr(off[(size_t)k], off[(size_t)k + 1] - off[(size_t)k]);
  }
  return obj.kind == Kind::kList ? Value::make_list(std::move(items)) : Value::string(s);
}

Value jinja_binary(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "==") return Value::boolean(value_equal(a, b));
  if (op == "!=") return Value::boolean(!value_equal(a, b));
  if (op == "~") return Value::string(value_str(a) + value_str(b));
  if (op == "in" || op == "not in") {
    bool found = false;
    if (b.is_string()) {
      found = need_str(a, line, "'in <string>'").empty() || b.s.find(a.s) != std::string::npos;
    } else if (b.kind == Kind::kList) {
      for (const Value& x : *b.list) found = found || value_equal(x, a);
    } else if (b.is_mapping()) {
      found = a.is_string() && b.dict->find(a.s) != nullptr;
    } else if (!b.is_undefined()) {
      jinja_fail(line, "argument of type '" + value_type_name(b) + "' is not iterable");
    }
    return Value::boolean(op == "in" ? found : !found);
  }
  if (a.is_undefined()) jinja_fail_undefined(line, a);
  if (b.is_undefined()) jinja_fail_undefined(line, b);
  if (op == "<") return Value::boolean(value_compare(a, b) < 0);
  if (op == ">") return Value::boolean(value_compare(a, b) > 0);
  if (op == "<=") return Value::boolean(value_compare(a, b) <= 0);
  if (op == ">=") return Value::boolean(value_compare(a, b) >= 0);
  auto unsupported = [&]() -> Value {
    if (op == "+" && a.is_string())
      jinja_fail(line, "can only concatenate str (not \"" + value_type_name(b) + "\") to str");
    if (op == "+" && a.kind == Kind::kList)
      jinja_fail(line, "can only concatenate list (not \"" + value_type_name(b) + "\") to list");
    jinja_fail(line, "unsupported operand type(s) for " + op + ": '" + value_type_name(a) + "' and '" +
                         value_type_name(b) + "'");
  };
  if (a.is_number() && b.is_number()) {
    bool ints = a.kind != Kind::kFloat && b.kind != Kind::kFloat;
    int64_t p = a.kind == Kind::kBool ? a.b : a.i, q = b.kind == Kind::kBool ? b.b : b.i;
    double x = as_num(a), y = as_num(b);
    if (op == "+") return ints ? Value::integer(p + q) : Value::real(x + y);
    if (op == "-") return ints ? Value::integer(p - q) : Value::real(x - y);
    if (op == "*") return ints ? Value::integer(p * q) : Value::real(x * y);
    if (op == "/") {
      if (y == 0) jinja_fail(line, "division by zero");
      return Value::real(x / y);
    }
    if (op == "//" || op == "%") {
      if (y == 0) jinja_fail(line, "integer division or modulo by zero");
      if (ints) {
        int64_t d = p / q, m = p % q;
        if (m != 0 && ((m < 0) != (q < 0))) d -= 1, m += q;
        return Value::integer(op == "//" ? d : m);
      }
      double d = std::floor(x / y);
      return Value::real(op == "//" ? d : x - d * y);
    }
    if (op == "**") {
      if (ints && q >= 0) {
        int64_t r = 1;
        for (int64_t k = 0; k < q; ++k) r *= p;
        return Value::integer(r);
      }
      return Value::real(std::pow(x, y));
    }
  }
  if (op == "+" && a.is_string() && b.is_string()) return Value::string(a.s + b.s);
  if (op == "+" && a.kind == Kind::kList && b.kind == Kind::kList) {
    List l = *a.list;
    l.insert(l.end(), b.list->begin(), b.list->end());
    return Value::make_list(std::move(l));
  }
  if (op == "*" && (a.is_string() || a.kind == Kind::kList) && (b.kind == Kind::kInt)) {
    if (b.i > kMaxRange) jinja_fail(line, "repetition count too large");
    if (a.is_string()) {
      std::string s;
      for (int64_t k = 0; k < b.i; ++k) s += a.s;
      return Value::string(s);
    }
    List l;
    for (int64_t k = 0; k < b.i; ++k) l.insert(l.end(), a.list->begin(), a.list->end());
    return Value::make_list(std::move(l));
  }
  if (op == "%" && a.is_string()) jinja_fail(line, "unsupported Jinja construct: printf-style string formatting '%'");
  return unsupported();
}

bool jinja_test(const std::string& name, const Value& v, CallArgs& a, int line) {
  Kind k = v.kind;
  if (name == "defined") return k != Kind::kUndefined;
  if (name == "undefined") return k == Kind::kUndefined;
  if (name == "none") return k == Kind::kNone;
  if (name == "boolean") return k == Kind::kBool;
  if (name == "true") return k == Kind::kBool && v.b;
  if (name == "false") return k == Kind::kBool && !v.b;
  if (name == "integer") return k == Kind::kInt;
  if (name == "float") return k == Kind::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return k == Kind::kString;
  if (name == "mapping") return k == Kind::kDict;
  if (name == "iterable") return k == Kind::kList || k == Kind::kDict || k == Kind::kString || k == Kind::kUndefined;
  if (name == "sequence") return k == Kind::kList || k == Kind::kDict || k == Kind::kString;
  if (name == "callable") return k == Kind::kCallable;
  if (name == "escaped") return false;
  if (name == "lower" || name == "upper") {
    if (k != Kind::kString) return false;
    bool any = false;
    for (unsigned char c : v.s) {
      if (c < 0x80 && std::isalpha(c)) {
        any = true;
        if (name == "lower" ? std::isupper(c) : std::islower(c)) return false;
      }
    }
    return any;
  }
  if (name == "even" || name == "odd") {
    int64_t x = as_int(v, line, "the value of 'even'/'odd'");
    return (x % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    int64_t d = as_int(arg(a, 0, "num"), line, "divisibleby's argument");
    if (d == 0) jinja_fail(line, "divisibleby 0");
    return as_int(v, line, "the value of divisibleby") % d == 0;
  }
  Value other = arg(a, 0, "other");
  if (name == "eq" || name == "equalto" || name == "==") return value_equal(v, other);
  if (name == "ne" || name == "!=") return !value_equal(v, other);
  if (name == "lt" || name == "lessthan" || name == "<") return jinja_binary("<", v, other, line).b;
  if (name == "le" || name == "<=") return jinja_binary("<=", v, other, line).b;
  if (name == "gt" || name == "greaterthan" || name == ">") return jinja_binary(">", v, other, line).b;
  if (name == "ge" || name == ">=") return jinja_binary(">=", v, other, line).b;
  if (name == "in") return jinja_binary("in", v, arg(a, 0, "seq"), line).b;
  if (name == "sameas") {
    if (v.kind != other.kind) return false;
    switch (k) {
      case Kind::kList: return v.list == other.list;
      case Kind::kDict:
      case Kind::kNamespace: return v.dict == other.dict;
      case Kind::kCallable: return v.fn == other.fn;
      default: return value_equal(v, other);
    }
  }
  jinja_fail(line, "unsupported Jinja test '" + name + "'");
}

Value jinja_filter(const std::string& name, const Value& in, CallArgs& a, int line) {
  if (name == "default" || name == "d") {
    bool boolean = value_truthy(arg(a, 1, "boolean", Value::boolean(false)));
    if (in.is_undefined() || (boolean && !value_truthy(in))) return arg(a, 0, "default_value", Value::string(""));
    return in;
  }
  if (name == "safe") return in;
  if (name == "string") return Value::string(value_str(in));
  if (name == "trim") return Value::string(py_strip(value_str(in), arg(a, 0, "chars"), true, true));
  if (name == "upper") return Value::string(ascii_map(value_str(in), [](int c) { return std::toupper(c); }));
  if (name == "lower") return Value::string(ascii_map(value_str(in), [](int c) { return std::tolower(c); }));
  if (name == "capitalize") return Value::string(py_capitalize(value_str(in)));
  if (name == "title") return Value::string(py_title(value_str(in)));
  if (name == "escape" || name == "e") return Value::string(html_escape(value_str(in)));
  if (name == "length" || name == "count") return Value::integer(value_length(in));
  if (name == "tojson") {
    Value indent = arg(a, 0, "indent");
    return Value::string(value_tojson(in, indent.kind == Kind::kInt ? (int)indent.i : -1));
  }
  if (name == "replace") {
    return Value::string(py_replace(value_str(in), value_str(arg(a, 0, "old")), value_str(arg(a, 1, "new")),
                                    as_int(arg(a, 2, "count", Value::integer(-1)), line, "count")));
  }
  if (name == "items") {
    if (in.is_undefined()) return Value::make_list();
    if (!in.is_mapping()) jinja_fail(line, "can only get item pairs from a mapping, not " + value_type_name(in));
    List l;
    for (const auto& kv : in.dict->items) l.push_back(Value::make_list({Value::string(kv.first), kv.second}));
    return Value::make_list(std::move(l));
  }
  if (name == "dictsort") {
    if (!in.is_mapping()) jinja_fail(line, "dictsort needs a mapping, not " + value_type_name(in));
    List l;
    for (const auto& kv : in.dict->items) l.push_back(Value::make_list({Value::string(kv.first), kv.second}));
    bool cs = value_truthy(arg(a, 0, "case_sensitive", Value::boolean(false)));
    bool rev = value_truthy(arg(a, 2, "reverse", Value::boolean(false)));
    return Value::make_list(sorted_values(std::move(l), rev, cs, Value::string("0"), line));
  }
  if (name == "list") return Value::make_list(value_iterate(in));
  if (name == "first" || name == "last") {
    std::vector<Value> items = value_iterate(in);
    if (items.empty()) return Value::undefined("No first item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (in.is_string()) {
      std::vector<Value> chars = value_iterate(in);
      std::string s;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) s += it->s;
      return Value::string(s);
    }
    std::vector<Value> items = value_iterate(in);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "join") {
    Value attribute = arg(a, 1, "attribute");
    std::string sep = value_str(arg(a, 0, "d", Value::string(""))), out;
    std::vector<Value> items = value_iterate(in);
    for (size_t k = 0; k < items.size(); ++k)
      out += (k ? sep : "") + value_str(attribute.is_string() ? attr_path(items[k], attribute.s, line) : items[k]);
    return Value::string(out);
  }
  if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
    bool attr = name == "selectattr" || name == "rejectattr";
    bool keep_if = name == "selectattr" || name == "select";
    size_t t = attr ? 1 : 0;
    std::string attr_name = attr ? need_str(arg(a, 0, "attribute"), line, name.c_str()) : "";
    CallArgs targs;
    if (a.pos.size() > t + 1) targs.pos.assign(a.pos.begin() + (long)t + 1, a.pos.end());
    List out;
    for (const Value& item : value_iterate(in)) {
      Value v = attr ? attr_path(item, attr_name, line) : item;
      bool pass = a.pos.size() > t ? jinja_test(need_str(a.pos[t], line, "test name"), v, targs, line) : value_truthy(v);
      if (pass == keep_if) out.push_back(item);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "map") {
    List out;
    const Value* attribute = a.kwarg("attribute");
    if (attribute) {
      const Value* dflt = a.kwarg("default");
      for (const Value& item : value_iterate(in)) {
        Value v = attr_path(item, need_str(*attribute, line, "map attribute"), line);
        out.push_back(v.is_undefined() && dflt ? *dflt : v);
      }
    } else {
      std::string f = need_str(arg(a, 0, "filter"), line, "map");
      CallArgs fargs;
      if (a.pos.size() > 1) fargs.pos.assign(a.pos.begin() + 1, a.pos.end());
      fargs.kw = a.kw;
      for (const Value& item : value_iterate(in)) out.push_back(jinja_filter(f, item, fargs, line));
    }
    return Value::make_list(std::move(out));
  }
  if (name == "sort") {
    return Value::make_list(sorted_values(value_iterate(in), value_truthy(arg(a, 0, "reverse")),
                                          value_truthy(arg(a, 1, "case_sensitive")), arg(a, 2, "attribute"), line));
  }
  if (name == "unique") {
    List out;
    for (const Value& item : value_iterate(in)) {
      bool seen = false;
      for (const Value& o : out) seen = seen || value_equal(o, item);
      if (!seen) out.push_back(item);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "min" || name == "max") {
    std::vector<Value> items = sorted_values(value_iterate(in), false, false, arg(a, 1, "attribute"), line);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    return name == "min" ? items.front() : items.back();
  }
  if (name == "sum") {
    Value attribute = arg(a, 0, "attribute");
    Value total = arg(a, 1, "start", Value::integer(0));
    for (const Value& item : value_iterate(in))
      total = jinja_binary("+", total, attribute.is_string() ? attr_path(item, attribute.s, line) : item, line);
    return total;
  }
  if (name == "int") {
    if (in.is_number()) return Value::integer(as_int(in, line, "int"));
    if (in.is_string()) {
      try {
        size_t used = 0;
        std::string t = py_strip(in.s, Value::undefined(), true, true);
        int64_t x = std::stoll(t, &used, 10);
        if (used == t.size()) return Value::integer(x);
      } catch (const std::exception&) {
      }
    }
    return arg(a, 0, "default", Value::integer(0));
  }
  if (name == "float") {
    if (in.is_number()) return Value::real(as_num(in));
    if (in.is_string()) {
      try {
        size_t used = 0;
        std::string t = py_strip(in.s, Value::undefined(), true, true);
        double x = std::stod(t, &used);
        if (used == t.size()) return Value::real(x);
      } catch (const std::exception&) {
      }
    }
    return arg(a, 0, "default", Value::real(0));
  }
  if (name == "abs") {
    if (in.kind == Kind::kInt) return Value::integer(in.i < 0 ? -in.i : in.i);
    if (in.is_number()) return Value::real(std::fabs(as_num(in)));
    jinja_fail(line, "bad operand type for abs(): '" + value_type_name(in) + "'");
  }
  if (name == "round") {
    int64_t precision = as_int(arg(a, 0, "precision", Value::integer(0)), line, "precision");
    std::string method = value_str(arg(a, 1, "method", Value::string("common")));
    double scale = std::pow(10.0, (double)precision), x = as_num(in) * scale;
    x = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
    return Value::real(x / scale);
  }
  if (name == "wordcount") return Value::integer((int64_t)py_split(value_str(in), Value::undefined(), -1).size());
  if (name == "indent") {
    Value width = arg(a, 0, "width", Value::integer(4));
    std::string pad = width.is_string() ? width.s : std::string((size_t)as_int(width, line, "indent width"), ' ');
    bool first = value_truthy(arg(a, 1, "first")), blank = value_truthy(arg(a, 2, "blank"));
    std::string s = value_str(in), out;
    std::vector<std::string> lines = py_split(s, Value::string("\n"), -1);
    for (size_t k = 0; k < lines.size(); ++k) {
      if (k) out += "\n";
      bool indent_it = (k > 0 || first) && (blank || !lines[k].empty());
      out += (indent_it ? pad : "") + lines[k];
    }
    return Value::string(out);
  }
  jinja_fail(line, "unsupported Jinja filter '" + name + "'");
}

std::vector<std::pair<std::string, Value>> jinja_globals(const std::string& now) {
  std::vector<std::pair<std::string, Value>> g;
  g.emplace_back("raise_exception", callable("raise_exception", [](CallArgs& a) -> Value {
    throw JinjaRaise(value_str(arg(a, 0, "message")));
  }));
  g.emplace_back("namespace", callable("namespace", [](CallArgs& a) -> Value {
    Value ns;
    ns.kind = Kind::kNamespace;
    ns.dict = std::make_shared<Dict>();
    for (const Value& p : a.pos) {
      if (p.kind != Kind::kDict) throw Error("chat template: namespace() takes a dict or keyword arguments");
      for (const auto& kv : p.dict->items) ns.dict->set(kv.first, kv.second);
    }
    for (const auto& kv : a.kw) ns.dict->set(kv.first, kv.second);
    return ns;
  }));
  g.emplace_back("dict", callable("dict", [](CallArgs& a) -> Value {
    Dict d;
    for (const Value& p : a.pos) {
      if (p.kind != Kind::kDict) throw Error("chat template: dict() takes a dict or keyword arguments");
      for (const auto& kv : p.dict->items) d.set(kv.first, kv.second);
    }
    for (const auto& kv : a.kw) d.set(kv.first, kv.second);
    return Value::make_dict(std::move(d));
  }));
  g.emplace_back("range", callable("range", [](CallArgs& a) -> Value {
    int64_t start = 0, stop = 0, step = 1;
    auto num = [](const Value& v) {
      if (v.kind != Kind::kInt) throw Error("chat template: range() takes integers, not " + value_type_name(v));
      return v.i;
    };
    if (a.pos.size() == 1) stop = num(a.pos[0]);
    else if (a.pos.size() >= 2) start = num(a.pos[0]), stop = num(a.pos[1]);
    if (a.pos.size() >= 3) step = num(a.pos[2]);
    if (a.pos.empty() || a.pos.size() > 3) throw Error("chat template: range() takes 1 to 3 arguments");
    if (step == 0) throw Error("chat template: range() step must not be zero");
    List l;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if ((int64_t)l.size() >= kMaxRange) throw Error("chat template: range() too long");
      l.push_back(Value::integer(k));
    }
    return Value::make_list(std::move(l));
  }));
  g.emplace_back("strftime_now", callable("strftime_now", [now](CallArgs& a) -> Value {
    std::tm tm{};
    if (now.empty()) {
      std::time_t t = std::time(nullptr);
      localtime_r(&t, &tm);
    } else {
      int y, mo, d, h, mi, s;
      if (std::sscanf(now.c_str(), "%d-%d-%d %d:%d:%d", &y, &mo, &d, &h, &mi, &s) != 6)
        throw Error("--now / strftime clock '" + now + "' is not \"YYYY-MM-DD HH:MM:SS\"");
      tm.tm_year = y - 1900, tm.tm_mon = mo - 1, tm.tm_mday = d, tm.tm_hour = h, tm.tm_min = mi, tm.tm_sec = s;
      tm.tm_isdst = -1;
      std::time_t t = timegm(&tm);  // fills in the weekday and day of the year
      gmtime_r(&t, &tm);
    }
    std::string fmt = value_str(arg(a, 0, "format"));
    if (fmt.empty()) return Value::string("");
    char buf[512];
    size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
    return Value::string(std::string(buf, n));
  }));
  return g;
}

}  // namespace fp8rl::jinja
