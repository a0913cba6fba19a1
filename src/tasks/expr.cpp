#include "tasks/expr.h"

#include <numeric>

namespace fp8rl {
namespace {

bool normalize(__int128 n, __int128 d, Rational& out) {
  if (d == 0) return false;
  if (d < 0) {
    n = -n;
    d = -d;
  }
  __int128 a = n < 0 ? -n : n, b = d;
  while (b) {
    const __int128 t = a % b;
    a = b;
    b = t;
  }
  if (a > 1) {
    n /= a;
    d /= a;
  }
  if (n > INT64_MAX || n < -INT64_MAX || d > INT64_MAX) return false;
  out = Rational{int64_t(n), int64_t(d)};
  return true;
}

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}
  ExprResult run() {
    ExprResult r;
    if (expr(r.value, 0)) {
      skip();
      if (pos_ == s_.size()) r.ok = true;
      else fail("unexpected '" + std::string(1, s_[pos_]) + "'");
    }
    r.numbers = std::move(numbers_);
    r.error = error_;
    if (!r.ok) r.value = Rational{};
    return r;
  }

 private:
  static constexpr int kMaxDepth = 64;
  std::string_view s_;
  size_t pos_ = 0;
  std::vector<int64_t> numbers_;
  std::string error_;

  bool fail(const std::string& e) {
    if (error_.empty()) error_ = e;
    return false;
  }
  void skip() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t')) ++pos_;
  }
  bool eat(std::string_view tok) {
    skip();
    if (s_.substr(pos_, tok.size()) != tok) return false;
    pos_ += tok.size();
    return true;
  }
  bool expr(Rational& v, int depth) {
    if (!term(v, depth)) return false;
    while (true) {
      const bool plus = eat("+");
      if (!plus && !eat("-")) return true;
      Rational rhs;
      if (!term(rhs, depth)) return false;
      if (!(plus ? rational_add(v, rhs, v) : rational_sub(v, rhs, v))) return fail("overflow");
    }
  }
  bool term(Rational& v, int depth) {
    if (!factor(v, depth)) return false;
    while (true) {
      bool mul = eat("*") || eat("x") || eat("\xC3\x97");
      if (!mul && !eat("/") && !eat("\xC3\xB7")) return true;
      Rational rhs;
      if (!factor(rhs, depth)) return false;
      if (mul) {
        if (!rational_mul(v, rhs, v)) return fail("overflow");
      } else {
        if (rhs.num == 0) return fail("division by zero");
        if (!rational_div(v, rhs, v)) return fail("overflow");
      }
    }
  }
  bool factor(Rational& v, int depth) {
    if (depth > kMaxDepth) return fail("nesting too deep");
    if (eat("(")) {
      if (!expr(v, depth + 1)) return false;
      return eat(")") || fail("missing ')'");
    }
    skip();
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') return fail("expected a number or '('");
    int64_t n = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      n = n * 10 + (s_[pos_++] - '0');
      if (n > 1000000000000000LL) return fail("number too large");
    }
    numbers_.push_back(n);
    v = Rational{n, 1};
    return true;
  }
};

}  // namespace

bool rational_add(Rational a, Rational b, Rational& out) {
  return normalize(__int128(a.num) * b.den + __int128(b.num) * a.den, __int128(a.den) * b.den, out);
}
bool rational_sub(Rational a, Rational b, Rational& out) {
  return normalize(__int128(a.num) * b.den - __int128(b.num) * a.den, __int128(a.den) * b.den, out);
}
bool rational_mul(Rational a, Rational b, Rational& out) {
  return normalize(__int128(a.num) * b.num, __int128(a.den) * b.den, out);
}
bool rational_div(Rational a, Rational b, Rational& out) {
  return normalize(__int128(a.num) * b.den, __int128(a.den) * b.num, out);
}

ExprResult expr_evaluate(std::string_view text) { return Parser(text).run(); }

}  // namespace fp8rl
