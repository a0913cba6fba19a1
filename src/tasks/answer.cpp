#include "tasks/answer.h"

#include <cctype>
#include <vector>

namespace fp8rl {
namespace {

constexpr size_t kMaxNumberChars = 1000;  // longer "numbers" are not parsed (bounded work)

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool consume(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

// Digits with optional thousands commas ("1,234,567"); appends the digits to `out`.
bool parse_grouped_digits(std::string_view s, std::string& out) {
  if (s.empty()) return false;
  size_t group = 0;
  bool seen_comma = false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (is_digit(s[i])) {
      out += s[i];
      ++group;
    } else if (s[i] == ',') {
      if (group == 0 || (seen_comma ? group != 3 : group > 3)) return false;
      seen_comma = true;
      group = 0;
    } else {
      return false;
    }
  }
  return group > 0 && (!seen_comma || group == 3);
}

// "12", "1,000", "2.50", ".5", "3." -> digits over a power of ten.
bool parse_decimal(std::string_view s, std::string& num, std::string& den) {
  const size_t dot = s.find('.');
  std::string_view int_part = s.substr(0, dot), frac;
  if (dot != std::string_view::npos) frac = s.substr(dot + 1);
  if (int_part.empty() && frac.empty()) return false;
  num.clear();
  if (!int_part.empty() && !parse_grouped_digits(int_part, num)) return false;
  for (char c : frac)
    if (!is_digit(c)) return false;
  num += frac;
  den = "1" + std::string(frac.size(), '0');
  return true;
}

void strip_zeros(std::string& d) {
  const size_t nz = d.find_first_not_of('0');
  d = nz == std::string::npos ? "0" : d.substr(nz);
}

std::string multiply(const std::string& a, const std::string& b) {
  std::vector<int> r(a.size() + b.size(), 0);
  for (size_t i = a.size(); i-- > 0;)
    for (size_t j = b.size(); j-- > 0;) {
      const int p = (a[i] - '0') * (b[j] - '0') + r[i + j + 1];
      r[i + j + 1] = p % 10;
      r[i + j] += p / 10;
    }
  std::string s;
  for (int d : r) s += char('0' + d);
  strip_zeros(s);
  return s;
}

}  // namespace

bool answer_parse_number(std::string_view text, ExactNumber& out) {
  std::string_view s = trim(text);
  if (s.empty() || s.size() > kMaxNumberChars) return false;
  out = ExactNumber{};
  bool neg = false;
  if (consume(s, "-") || consume(s, "\xE2\x88\x92")) neg = true;
  else consume(s, "+");
  if (!consume(s, "\\$")) consume(s, "$");
  if (!neg && (consume(s, "-") || consume(s, "\xE2\x88\x92"))) neg = true;  // "$-5"
  std::string num, den;
  if (consume(s, "\\frac{") || consume(s, "\\dfrac{") || consume(s, "\\tfrac{")) {
    const size_t mid = s.find("}{");
    if (mid == std::string_view::npos || s.empty() || s.back() != '}') return false;
    std::string n2, d2;
    if (!parse_grouped_digits(s.substr(0, mid), num) ||
        !parse_grouped_digits(s.substr(mid + 2, s.size() - mid - 3), den))
      return false;
  } else {
    if (s.size() > 1 && s.back() == '.' && is_digit(s[s.size() - 2]) &&
        s.find('.') != s.size() - 1)  // "2.5." -> "2.5" (sentence end); "3." stays a decimal
      s.remove_suffix(1);
    const size_t slash = s.find('/');
    if (slash != std::string_view::npos) {  // a simple fraction of integers
      if (!parse_grouped_digits(trim(s.substr(0, slash)), num) ||
          !parse_grouped_digits(trim(s.substr(slash + 1)), den))
        return false;
    } else if (!parse_decimal(s, num, den)) {
      return false;
    }
  }
  strip_zeros(num);
  strip_zeros(den);
  if (den == "0") return false;
  out.negative = neg && num != "0";
  out.numerator = num;
  out.denominator = den;
  return true;
}

bool answer_equal(std::string_view candidate, std::string_view reference) {
  ExactNumber a, b;
  const bool na = answer_parse_number(candidate, a), nb = answer_parse_number(reference, b);
  if (na && nb)
    return a.negative == b.negative &&
           multiply(a.numerator, b.denominator) == multiply(b.numerator, a.denominator);
  if (na != nb) return false;
  const std::string_view tc = trim(candidate), tr = trim(reference);
  return !tr.empty() && tc == tr;
}

std::optional<std::string> answer_last_number(std::string_view t) {
  std::optional<std::string> last;
  size_t i = 0;
  while (i < t.size()) {
    const bool starts = is_digit(t[i]) || (t[i] == '.' && i + 1 < t.size() && is_digit(t[i + 1]));
    if (!starts) {
      ++i;
      continue;
    }
    size_t b = i, e = i;
    auto digits = [&](size_t p) {
      while (p < t.size() && is_digit(t[p])) ++p;
      return p;
    };
    e = digits(e);
    while (e + 3 < t.size() + 0 && t[e] == ',' && is_digit(t[e + 1]) && is_digit(t[e + 2]) &&
           is_digit(t[e + 3]) && (e + 4 >= t.size() || !is_digit(t[e + 4])))
      e += 4;
    if (e + 1 < t.size() && t[e] == '.' && is_digit(t[e + 1])) e = digits(e + 1);
    if (e + 1 < t.size() && t[e] == '/' && is_digit(t[e + 1])) e = digits(e + 1);
    if (b > 0 && t[b - 1] == '-') --b;
    else if (b >= 3 && t.substr(b - 3, 3) == "\xE2\x88\x92") b -= 3;
    last = std::string(t.substr(b, e - b));
    i = e;
  }
  return last;
}

std::optional<std::string> answer_extract(std::string_view r, bool last_number_fallback) {
  // The last \boxed{...} whose braces close.
  for (size_t pos = r.rfind("\\boxed{"); pos != std::string_view::npos;
       pos = pos == 0 ? std::string_view::npos : r.rfind("\\boxed{", pos - 1)) {
    const size_t start = pos + 7;
    int depth = 1;
    for (size_t k = start; k < r.size(); ++k) {
      if (r[k] == '{') ++depth;
      else if (r[k] == '}' && --depth == 0) return std::string(trim(r.substr(start, k - start)));
    }
  }
  const size_t h = r.rfind("####");
  if (h != std::string_view::npos) {
    std::string_view rest = r.substr(h + 4);
    rest = rest.substr(0, rest.find('\n'));
    rest = trim(rest);
    if (!rest.empty()) return std::string(rest);
  }
  if (last_number_fallback) return answer_last_number(r);
  return std::nullopt;
}

}  // namespace fp8rl
