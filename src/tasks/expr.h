// Exact evaluation of +, -, *, / expressions over integers (countdown, arithmetic):
// a recursive-descent parser, never eval. Rationals of int64 with overflow checks.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl {

struct Rational {
  int64_t num = 0, den = 1;  // den > 0, gcd(num, den) == 1
};
// Arithmetic that reports overflow / division by zero by returning false.
bool rational_add(Rational a, Rational b, Rational& out);
bool rational_sub(Rational a, Rational b, Rational& out);
bool rational_mul(Rational a, Rational b, Rational& out);
bool rational_div(Rational a, Rational b, Rational& out);

struct ExprResult {
  bool ok = false;
  Rational value;
  std::vector<int64_t> numbers;  // integer literals in the order they appear
  std::string error;             // why !ok ("division by zero", "unexpected ')'", ...)
};
// Grammar: expr := term (('+'|'-') term)* ; term := factor (('*'|'x'|'×'|'/'|'÷') factor)* ;
// factor := integer | '(' expr ')'. Spaces are ignored; no unary minus, no decimals;
// integers up to 10^15; nesting up to 64 levels.
ExprResult expr_evaluate(std::string_view text);

}  // namespace fp8rl
