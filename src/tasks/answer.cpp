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

// ---- normalization of \boxed{} answers ----------------------------------------------------------
namespace {

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) s.replace(p, from.size(), to);
}

// The index after the '}' closing the '{' at `open`, or npos.
size_t close_brace(const std::string& s, size_t open) {
  int depth = 0;
  for (size_t k = open; k < s.size(); ++k) {
    if (s[k] == '{') ++depth;
    else if (s[k] == '}' && --depth == 0) return k + 1;
  }
  return std::string::npos;
}

// \cmd{X} -> X for every occurrence (innermost content kept as written).
void unwrap(std::string& s, std::string_view cmd) {
  const std::string head = std::string(cmd) + "{";
  for (size_t p = s.find(head); p != std::string::npos; p = s.find(head, p)) {
    const size_t open = p + head.size() - 1, end = close_brace(s, open);
    if (end == std::string::npos) return;
    s = s.substr(0, p) + s.substr(open + 1, end - open - 2) + s.substr(end);
  }
}

bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

}  // namespace

std::string answer_normalize(std::string_view in) {
  std::string s(trim(in));
  for (std::string_view w : {"\\boxed", "\\fbox", "\\text", "\\textbf", "\\textit", "\\mathrm", "\\mathbf",
                             "\\operatorname"})
    unwrap(s, w);
  for (std::string_view w : {"\\left", "\\right", "\\displaystyle"}) replace_all(s, w, "");
  replace_all(s, "{,}", ",");
  replace_all(s, "\\!", "");
  replace_all(s, "\\;", " ");
  replace_all(s, "\\:", " ");
  replace_all(s, "\\ ", " ");
  replace_all(s, "\\$", "");
  replace_all(s, "$", "");
  for (std::string_view w : {"^{\\circ}", "^\\circ", "\\circ", "\xC2\xB0", "\\%", "%"}) replace_all(s, w, "");
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  // "1\,000" (a thin space between digit groups) -> "1000"; any other \, is a space.
  for (size_t p = s.find("\\,"); p != std::string::npos; p = s.find("\\,", p)) {
    const bool grouped = p > 0 && is_digit(s[p - 1]) && p + 5 <= s.size() && is_digit(s[p + 2]) && is_digit(s[p + 3]) &&
                         is_digit(s[p + 4]) && (p + 5 == s.size() || !is_digit(s[p + 5]));
    s.replace(p, 2, grouped ? "" : " ");
  }
  // \frac12 -> \frac{1}{2}
  for (size_t p = s.find("\\frac"); p != std::string::npos; p = s.find("\\frac", p + 5))
    if (p + 6 < s.size() && is_digit(s[p + 5]) && is_digit(s[p + 6]))
      s = s.substr(0, p) + "\\frac{" + s[p + 5] + "}{" + s[p + 6] + "}" + s.substr(p + 7);
  // \frac{-3}{4} -> -\frac{3}{4}
  for (size_t p = s.find("\\frac{-"); p != std::string::npos; p = s.find("\\frac{-", p + 1))
    s = s.substr(0, p) + "-\\frac{" + s.substr(p + 7);
  std::string t(trim(s));
  // "x = 5" -> "5" (one variable name, then '=')
  if (t.size() > 2) {
    size_t k = 0;
    while (k < t.size() && is_alpha(t[k])) ++k;
    size_t e = k;
    while (e < t.size() && t[e] == ' ') ++e;
    if (k >= 1 && k <= 2 && e < t.size() && t[e] == '=') t = std::string(trim(std::string_view(t).substr(e + 1)));
  }
  // Trailing unit words: "5 cm", "12.50 dollars", "3 square meters." -> the number before them.
  const size_t sp = t.find(' ');
  if (sp != std::string::npos) {
    ExactNumber n;
    const std::string head = t.substr(0, sp), tail = t.substr(sp + 1);
    bool words = !tail.empty();
    for (char c : tail) words = words && (is_alpha(c) || c == ' ' || c == '.' || c == '^' || is_digit(c));
    if (words && is_alpha(trim(tail).empty() ? ' ' : trim(tail)[0]) && answer_parse_number(head, n)) t = head;
  }
  return t;
}

bool answer_equal_normalized(std::string_view candidate, std::string_view reference) {
  return answer_equal(answer_normalize(candidate), answer_normalize(reference));
}

std::optional<std::string> answer_extract_boxed(std::string_view r) {
  size_t best = std::string_view::npos, width = 0;
  for (std::string_view head : {std::string_view("\\boxed{"), std::string_view("\\fbox{")}) {
    const size_t p = r.rfind(head);
    if (p != std::string_view::npos && (best == std::string_view::npos || p > best)) best = p, width = head.size();
  }
  for (size_t pos = best; pos != std::string_view::npos;) {
    const size_t start = pos + width;
    int depth = 1;
    for (size_t k = start; k < r.size(); ++k) {
      if (r[k] == '{') ++depth;
      else if (r[k] == '}' && --depth == 0) return answer_normalize(r.substr(start, k - start));
    }
    if (pos == 0) break;
    pos = r.rfind("\\boxed{", pos - 1);
    width = 7;
  }
  return std::nullopt;
}

}  // namespace fp8rl
