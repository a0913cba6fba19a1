// jinja::Value: conversions and Python semantics (str, repr, json.dumps, ==, <, len).
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "tokenizer/jinja_ast.h"

namespace fp8rl::jinja {
namespace {

constexpr int kMaxValueDepth = 64;

void check_depth(int depth) {
  if (depth > kMaxValueDepth)
    throw Error("chat template: value nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
}

// Python's repr(float): the shortest round-trip digits, fixed notation for exponents in
// [-4, 16), else d.ddde+XX.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // "-d.ddde+XX"
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  bool neg = !mant.empty() && mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out = "0." + std::string(-exp - 1, '0') + digits;
    } else if ((int)digits.size() <= exp + 1) {
      out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string json_escape(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out += (char)c;
        }
    }
  }
  return out + "\"";
}

std::string py_string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == (unsigned char)q || c == '\\') {
      out += '\\';
      out += (char)c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else {
      out += (char)c;
    }
  }
  return out + q;
}

double as_double(const Value& v) {
  return v.kind == Kind::kFloat ? v.f : v.kind == Kind::kBool ? (v.b ? 1.0 : 0.0) : (double)v.i;
}

}  // namespace

const Value* Dict::find(const std::string& key) const {
  for (const auto& kv : items)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  for (auto& kv : items)
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

const Value* CallArgs::kwarg(const std::string& name) const {
  for (const auto& kv : kw)
    if (kv.first == name) return &kv.second;
  return nullptr;
}

namespace {
Value from_json_at(const nlohmann::ordered_json& j, int depth);
bool equal_at(const Value& a, const Value& b, int depth);
}  // namespace

Value value_from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }
bool value_equal(const Value& a, const Value& b) { return equal_at(a, b, 0); }

namespace {

Value from_json_at(const nlohmann::ordered_json& j, int depth) {
  check_depth(depth);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer((int64_t)j.get<uint64_t>());
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& e : j) l.push_back(from_json_at(e, depth + 1));
      return Value::make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.items.emplace_back(it.key(), from_json_at(it.value(), depth + 1));
      return Value::make_dict(std::move(d));
    }
    default: throw Error("chat template: unsupported JSON value (binary) in the template variables");
  }
}

bool equal_at(const Value& a, const Value& b, int depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return as_double(a) == as_double(b);
    return (a.kind == Kind::kBool ? (int64_t)a.b : a.i) == (b.kind == Kind::kBool ? (int64_t)b.b : b.i);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString: return a.s == b.s;
    case Kind::kList: {
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal_at((*a.list)[k], (*b.list)[k], depth + 1)) return false;
      return true;
    }
    case Kind::kDict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& kv : a.dict->items) {
        const Value* o = b.dict->find(kv.first);
        if (!o || !equal_at(kv.second, *o, depth + 1)) return false;
      }
      return true;
    }
    case Kind::kNamespace: return a.dict == b.dict;
    case Kind::kCallable: return a.fn == b.fn;
    default: return false;
  }
}

}  // namespace

bool value_truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return v.b;
    case Kind::kInt: return v.i != 0;
    case Kind::kFloat: return v.f != 0;
    case Kind::kString: return !v.s.empty();
    case Kind::kList: return !v.list->empty();
    case Kind::kDict: return !v.dict->items.empty();
    case Kind::kNamespace:
    case Kind::kCallable: return true;
  }
  return false;
}

std::string value_type_name(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kCallable: return "function";
  }
  return "?";
}

std::string value_str(const Value& v, int depth) {
  switch (v.kind) {
    case Kind::kUndefined: return "";
    case Kind::kString: return v.s;
    default: return value_repr(v, depth);
  }
}

std::string value_repr(const Value& v, int depth) {
  check_depth(depth);
  switch (v.kind) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return v.b ? "True" : "False";
    case Kind::kInt: return std::to_string(v.i);
    case Kind::kFloat: return float_repr(v.f);
    case Kind::kString: return py_string_repr(v.s);
    case Kind::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + value_repr((*v.list)[k], depth + 1);
      return out + "]";
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      std::string out = v.kind == Kind::kNamespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& kv : v.dict->items) {
        out += (first ? "" : ", ") + py_string_repr(kv.first) + ": " + value_repr(kv.second, depth + 1);
        first = false;
      }
      return out + (v.kind == Kind::kNamespace ? "}>" : "}");
    }
    case Kind::kCallable: return "<function " + v.fn->name + ">";
  }
  return "";
}

std::string value_tojson(const Value& v, int indent, int depth) {
  check_depth(depth);
  std::string nl = indent >= 0 ? "\n" + std::string((size_t)indent * (depth + 1), ' ') : "";
  std::string nl_end = indent >= 0 ? "\n" + std::string((size_t)indent * depth, ' ') : "";
  const char* item_sep = indent >= 0 ? "," : ", ";
  switch (v.kind) {
    case Kind::kNone: return "null";
    case Kind::kBool: return v.b ? "true" : "false";
    case Kind::kInt: return std::to_string(v.i);
    case Kind::kFloat:
      if (std::isnan(v.f)) return "NaN";
      if (std::isinf(v.f)) return v.f > 0 ? "Infinity" : "-Infinity";
      return float_repr(v.f);
    case Kind::kString: return json_escape(v.s);
    case Kind::kList: {
      if (v.list->empty()) return "[]";
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k)
        out += (k ? item_sep : "") + nl + value_tojson((*v.list)[k], indent, depth + 1);
      return out + nl_end + "]";
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) return "{}";
      std::string out = "{";
      bool first = true;
      for (const auto& kv : v.dict->items) {
        out += (first ? "" : item_sep) + nl + json_escape(kv.first) + ": " + value_tojson(kv.second, indent, depth + 1);
        first = false;
      }
      return out + nl_end + "}";
    }
    default:
      throw Error("chat template: Object of type " + value_type_name(v) + " is not JSON serializable");
  }
}

static int compare_at(const Value& a, const Value& b, int depth);
int value_compare(const Value& a, const Value& b) { return compare_at(a, b, 0); }
static int compare_at(const Value& a, const Value& b, int depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    double x = as_double(a), y = as_double(b);
    if (a.kind != Kind::kFloat && b.kind != Kind::kFloat) {
      int64_t p = a.kind == Kind::kBool ? a.b : a.i, q = b.kind == Kind::kBool ? b.b : b.i;
      return p < q ? -1 : p > q ? 1 : 0;
    }
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
  if (a.kind == Kind::kList && b.kind == Kind::kList) {
    size_t n = std::min(a.list->size(), b.list->size());
    for (size_t k = 0; k < n; ++k) {
      int c = compare_at((*a.list)[k], (*b.list)[k], depth + 1);
      if (c) return c;
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  throw Error("chat template: '<' not supported between instances of '" + value_type_name(a) + "' and '" +
              value_type_name(b) + "'");
}

std::vector<size_t> utf8_offsets(const std::string& s) {
  std::vector<size_t> off;
  off.reserve(s.size() + 1);
  for (size_t k = 0; k < s.size(); ++k)
    if (((unsigned char)s[k] & 0xC0) != 0x80) off.push_back(k);
  off.push_back(s.size());
  return off;
}

int64_t value_length(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return (int64_t)utf8_offsets(v.s).size() - 1;
    case Kind::kList: return (int64_t)v.list->size();
    case Kind::kDict:
    case Kind::kNamespace: return (int64_t)v.dict->items.size();
    default: throw Error("chat template: object of type '" + value_type_name(v) + "' has no len()");
  }
}

std::vector<Value> value_iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return {};
    case Kind::kList: return *v.list;
    case Kind::kDict: {
      std::vector<Value> keys;
      for (const auto& kv : v.dict->items) keys.push_back(Value::string(kv.first));
      return keys;
    }
    case Kind::kString: {
      std::vector<size_t> off = utf8_offsets(v.s);
      std::vector<Value> chars;
      for (size_t k = 0; k + 1 < off.size(); ++k) chars.push_back(Value::string(v.s.substr(off[k], off[k + 1] - off[k])));
      return chars;
    }
    default: throw Error("chat template: '" + value_type_name(v) + "' object is not iterable");
  }
}

}  // namespace fp8rl::jinja
