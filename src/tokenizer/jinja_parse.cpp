// Jinja lexer and parser: source text -> tokens (whitespace control applied) -> AST.
//
// Whitespace rules are jinja2's with trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False (what transformers uses):
//   - newlines are normalized to \n and one trailing newline of the source is dropped;
//   - "{%-" / "{{-" / "{#-" strip all whitespace before the tag, "-%}" / "-}}" / "-#}" all after;
//   - trim_blocks: the first newline after a block or comment tag is removed ("+%}" keeps it);
//   - lstrip_blocks: spaces/tabs between the start of a line and a block or comment tag are
//     removed ("{%+" keeps them). Variable tags {{ }} are not affected by either.
#include <cstdlib>

#include "core/error.h"
#include "tokenizer/jinja_ast.h"

namespace fp8rl::jinja {
namespace {

enum class Tok { kText, kBlockBegin, kBlockEnd, kVarBegin, kVarEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type = Tok::kEof;
  std::string text;
  int line = 0;
  int64_t i = 0;
  double f = 0;
};

[[noreturn]] void fail_at(int line, const std::string& msg) {
  throw Error("chat template line " + std::to_string(line) + ": " + msg);
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += (char)cp;
  } else if (cp < 0x800) {
    out += (char)(0xC0 | (cp >> 6));
    out += (char)(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += (char)(0xE0 | (cp >> 12));
    out += (char)(0x80 | ((cp >> 6) & 0x3F));
    out += (char)(0x80 | (cp & 0x3F));
  } else {
    out += (char)(0xF0 | (cp >> 18));
    out += (char)(0x80 | ((cp >> 12) & 0x3F));
    out += (char)(0x80 | ((cp >> 6) & 0x3F));
    out += (char)(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {}

  std::vector<Token> run() {
    size_t pos = 0;
    while (pos < src_.size()) {
      size_t open = find_opener(pos);
      std::string text = src_.substr(pos, (open == std::string::npos ? src_.size() : open) - pos);
      bool line_starting = pos == 0 || src_[pos - 1] == '\n';
      int text_line = line_;
      count_lines(pos, open == std::string::npos ? src_.size() : open);
      if (open == std::string::npos) {
        emit_text(text, text_line);
        break;
      }
      char kind = src_[open + 1];  // '{', '%' or '#'
      char mod = open + 2 < src_.size() ? src_[open + 2] : 0;
      if (mod == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (kind != '{' && mod != '+') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          bool blank = true;
          for (size_t k = l_pos; k < text.size(); ++k) blank = blank && (text[k] == ' ' || text[k] == '\t');
          if (blank) text.resize(l_pos);
        }
      }
      emit_text(text, text_line);
      size_t p = open + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#') {
        pos = lex_comment(p);
      } else if (kind == '%' && try_raw(p, &pos)) {
      } else {
        pos = lex_tag(p, kind == '%');
      }
    }
    toks_.push_back({Tok::kEof, "", line_});
    return std::move(toks_);
  }

 private:
  size_t find_opener(size_t pos) const {
    for (size_t k = pos; k + 1 < src_.size(); ++k)
      if (src_[k] == '{' && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#')) return k;
    return std::string::npos;
  }
  void count_lines(size_t a, size_t b) {
    for (size_t k = a; k < b && k < src_.size(); ++k) line_ += src_[k] == '\n';
  }
  void emit_text(const std::string& text, int line) {
    if (!text.empty()) toks_.push_back({Tok::kText, text, line});
  }
  // After a closing delimiter ending at `end`: "-" strips all whitespace, trim_blocks one newline.
  size_t after_close(size_t end, char mod, bool block) {
    size_t p = end;
    if (mod == '-') {
      while (p < src_.size() && is_space(src_[p])) ++p;
    } else if (block && mod != '+' && p < src_.size() && src_[p] == '\n') {
      ++p;
    }
    count_lines(end, p);
    return p;
  }
  size_t lex_comment(size_t p) {
    size_t close = src_.find("#}", p);
    if (close == std::string::npos) fail_at(line_, "unclosed comment {# ... #}");
    char mod = close > p && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
    count_lines(p, close + 2);
    return after_close(close + 2, mod, true);
  }
  // {% raw %}...{% endraw %}: the text between is emitted verbatim.
  bool try_raw(size_t p, size_t* pos_out) {
    size_t q = p;
    while (q < src_.size() && is_space(src_[q])) ++q;
    if (src_.compare(q, 3, "raw") != 0) return false;
    q += 3;
    while (q < src_.size() && is_space(src_[q])) ++q;
    char mod = 0;
    if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) mod = src_[q++];
    if (src_.compare(q, 2, "%}") != 0) return false;
    count_lines(p, q + 2);
    size_t body = after_close(q + 2, mod, true);
    for (size_t k = body; k + 1 < src_.size(); ++k) {
      if (src_[k] != '{' || src_[k + 1] != '%') continue;
      size_t r = k + 2;
      char open_mod = 0;
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) open_mod = src_[r++];
      while (r < src_.size() && is_space(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < src_.size() && is_space(src_[r])) ++r;
      char close_mod = 0;
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) close_mod = src_[r++];
      if (src_.compare(r, 2, "%}") != 0) continue;
      std::string text = src_.substr(body, k - body);
      if (open_mod == '-')
        while (!text.empty() && is_space(text.back())) text.pop_back();
      emit_text(text, line_);
      count_lines(body, r + 2);
      *pos_out = after_close(r + 2, close_mod, true);
      return true;
    }
    fail_at(line_, "{% raw %} without {% endraw %}");
  }

  size_t lex_tag(size_t p, bool block) {
    toks_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, "", line_});
    int depth = 0;
    const char* close = block ? "%}" : "}}";
    while (true) {
      while (p < src_.size() && is_space(src_[p])) line_ += src_[p++] == '\n';
      if (p >= src_.size()) fail_at(line_, std::string("missing '") + close + "' at the end of the template");
      if (depth == 0) {
        char mod = (src_[p] == '-' || src_[p] == '+') ? src_[p] : 0;
        size_t c = p + (mod ? 1 : 0);
        if (src_.compare(c, 2, close) == 0 && (mod != '+' || block)) {
          toks_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, "", line_});
          return after_close(c + 2, mod, block);
        }
      }
      char ch = src_[p];
      if (ch == '\'' || ch == '"') {
        p = lex_string(p);
      } else if (is_digit(ch)) {
        p = lex_number(p);
      } else if (is_name_start(ch)) {
        size_t q = p;
        while (q < src_.size() && (is_name_start(src_[q]) || is_digit(src_[q]))) ++q;
        toks_.push_back({Tok::kName, src_.substr(p, q - p), line_});
        p = q;
      } else {
        static const char* kOps2[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* o : kOps2)
          if (src_.compare(p, 2, o) == 0) op = o;
        if (op.empty()) {
          if (std::string("+-*/%~<>()[]{}.,:|=").find(ch) == std::string::npos)
            fail_at(line_, std::string("unexpected character '") + ch + "' in a tag");
          op = std::string(1, ch);
          if (ch == '(' || ch == '[' || ch == '{') ++depth;
          if (ch == ')' || ch == ']' || ch == '}') --depth;
        }
        toks_.push_back({Tok::kOp, op, line_});
        p += op.size();
      }
    }
  }

  // Python string literal with unicode-escape decoding (jinja2's rule): \n \t \\ \' \" \xHH
  // \uXXXX \UXXXXXXXX octal, backslash-newline is a continuation; unknown escapes are kept.
  size_t lex_string(size_t p) {
    char q = src_[p];
    int start_line = line_;
    std::string out;
    size_t k = p + 1;
    for (;; ++k) {
      if (k >= src_.size()) fail_at(start_line, "unterminated string literal");
      char c = src_[k];
      if (c == q) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (++k >= src_.size()) fail_at(start_line, "unterminated string literal");
      char e = src_[k];
      auto hex = [&](int n) {
        if (k + n >= src_.size()) fail_at(line_, "truncated \\x/\\u escape in a string literal");
        uint32_t cp = (uint32_t)std::strtoul(src_.substr(k + 1, n).c_str(), nullptr, 16);
        k += n;
        append_utf8(out, cp);
      };
      switch (e) {
        case '\n': ++line_; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case 'a': out += '\a'; break;
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = 0;
            int n = 0;
            while (n < 3 && k < src_.size() && src_[k] >= '0' && src_[k] <= '7') cp = cp * 8 + (src_[k++] - '0'), ++n;
            --k;
            append_utf8(out, cp);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    toks_.push_back({Tok::kString, out, start_line});
    return k + 1;
  }

  size_t lex_number(size_t p) {
    size_t q = p;
    bool is_float = false;
    while (q < src_.size() && (is_digit(src_[q]) || src_[q] == '_')) ++q;
    if (q + 1 < src_.size() && src_[q] == '.' && is_digit(src_[q + 1])) {
      is_float = true;
      ++q;
      while (q < src_.size() && (is_digit(src_[q]) || src_[q] == '_')) ++q;
    }
    if (q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
      size_t r = q + 1;
      if (r < src_.size() && (src_[r] == '+' || src_[r] == '-')) ++r;
      if (r < src_.size() && is_digit(src_[r])) {
        is_float = true;
        q = r;
        while (q < src_.size() && is_digit(src_[q])) ++q;
      }
    }
    std::string digits;
    for (size_t k = p; k < q; ++k)
      if (src_[k] != '_') digits += src_[k];
    Token t{is_float ? Tok::kFloat : Tok::kInt, digits, line_};
    if (is_float) t.f = std::strtod(digits.c_str(), nullptr);
    else t.i = std::strtoll(digits.c_str(), nullptr, 10);
    toks_.push_back(t);
    return q;
  }

  std::string src_;
  std::vector<Token> toks_;
  int line_ = 1;
};

std::string normalize_source(const std::string& in) {
  std::string s;
  s.reserve(in.size());
  for (size_t k = 0; k < in.size(); ++k) {
    if (in[k] == '\r') {
      s += '\n';
      if (k + 1 < in.size() && in[k + 1] == '\n') ++k;
    } else {
      s += in[k];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_template() {
    std::string end;
    Body b = parse_body({}, &end);
    return b;
  }

 private:
  const Token& cur() const { return t_[p_]; }
  const Token& peek(int k = 1) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool is_op(const std::string& op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(const std::string& n) const { return cur().type == Tok::kName && cur().text == n; }
  bool skip_op(const std::string& op) {
    if (!is_op(op)) return false;
    ++p_;
    return true;
  }
  bool skip_name(const std::string& n) {
    if (!is_name(n)) return false;
    ++p_;
    return true;
  }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case Tok::kBlockEnd: return "'%}'";
      case Tok::kVarEnd: return "'}}'";
      case Tok::kEof: return "the end of the template";
      case Tok::kString: return "a string";
      case Tok::kText: return "template text";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const std::string& op) {
    if (!skip_op(op)) fail_at(cur().line, "expected '" + op + "', found " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) fail_at(cur().line, "expected a name, found " + describe(cur()));
    return t_[p_++].text;
  }
  void expect(Tok type, const char* what) {
    if (cur().type != type) fail_at(cur().line, std::string("expected ") + what + ", found " + describe(cur()));
    ++p_;
  }
  void expect_block_end() { expect(Tok::kBlockEnd, "'%}'"); }

  // Statements until one of `ends` ({% end... %}): *end_found is the keyword (its tag is
  // left open after the keyword).
  Body parse_body(const std::vector<std::string>& ends, std::string* end_found) {
    DepthGuard g(depth_, cur().line);
    Body body;
    while (cur().type != Tok::kEof) {
      const Token& t = cur();
      if (t.type == Tok::kText) {
        auto s = std::make_shared<Stmt>();
        s->op = Stmt::Op::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(s);
        ++p_;
      } else if (t.type == Tok::kVarBegin) {
        auto s = std::make_shared<Stmt>();
        s->op = Stmt::Op::kOutput;
        s->line = t.line;
        ++p_;
        s->expr = parse_tuple();
        expect(Tok::kVarEnd, "'}}'");
        body.push_back(s);
      } else if (t.type == Tok::kBlockBegin) {
        ++p_;
        int line = cur().line;
        std::string kw = expect_name();
        for (const auto& e : ends)
          if (kw == e) {
            *end_found = kw;
            return body;
          }
        parse_statement(kw, line, body);
      } else {
        fail_at(t.line, "unexpected " + describe(t));
      }
    }
    if (!ends.empty()) fail_at(cur().line, "missing {% " + ends.back() + " %} before the end of the template");
    return body;
  }

  void parse_statement(const std::string& kw, int line, Body& body) {
    auto s = std::make_shared<Stmt>();
    s->line = line;
    std::string end;
    if (kw == "if") {
      s->op = Stmt::Op::kIf;
      s->conds.push_back(parse_tuple());
      expect_block_end();
      s->bodies.push_back(parse_body({"elif", "else", "endif"}, &end));
      while (end == "elif") {
        s->conds.push_back(parse_tuple());
        expect_block_end();
        s->bodies.push_back(parse_body({"elif", "else", "endif"}, &end));
      }
      if (end == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endif"}, &end));
      }
      expect_block_end();
    } else if (kw == "for") {
      s->op = Stmt::Op::kFor;
      s->targets.push_back(expect_name());
      while (skip_op(",")) s->targets.push_back(expect_name());
      if (!skip_name("in")) fail_at(cur().line, "expected 'in' in the for statement, found " + describe(cur()));
      s->expr = parse_tuple(false);
      if (skip_name("if")) s->conds.push_back(parse_expression());
      if (is_name("recursive")) fail_at(cur().line, "unsupported Jinja construct: recursive for loops");
      expect_block_end();
      s->bodies.push_back(parse_body({"else", "endfor"}, &end));
      if (end == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endfor"}, &end));
      }
      expect_block_end();
    } else if (kw == "set") {
      s->targets.push_back(expect_name());
      if (skip_op(".")) {
        s->attr_target = true;
        s->targets.push_back(expect_name());
      } else if (is_op(",")) {
        fail_at(cur().line, "unsupported Jinja construct: tuple assignment in set");
      }
      if (skip_op("=")) {
        s->op = Stmt::Op::kSet;
        s->expr = parse_tuple();
        expect_block_end();
      } else {
        if (s->attr_target) fail_at(line, "a block set cannot assign to an attribute");
        s->op = Stmt::Op::kSetBlock;
        if (is_op("|")) s->filter = parse_filter_chain();
        expect_block_end();
        s->bodies.push_back(parse_body({"endset"}, &end));
        expect_block_end();
      }
    } else if (kw == "macro") {
      s->op = Stmt::Op::kMacro;
      s->name = expect_name();
      parse_params(s->params);
      expect_block_end();
      s->bodies.push_back(parse_body({"endmacro"}, &end));
      if (cur().type == Tok::kName) ++p_;  // {% endmacro name %}
      expect_block_end();
    } else if (kw == "call") {
      s->op = Stmt::Op::kCallBlock;
      if (is_op("(")) parse_params(s->params);
      s->expr = parse_expression();
      if (s->expr->op != Expr::Op::kCall) fail_at(line, "{% call %} needs a macro call");
      expect_block_end();
      s->bodies.push_back(parse_body({"endcall"}, &end));
      expect_block_end();
    } else if (kw == "filter") {
      s->op = Stmt::Op::kFilterBlock;
      s->filter = parse_filter_chain(false);
      expect_block_end();
      s->bodies.push_back(parse_body({"endfilter"}, &end));
      expect_block_end();
    } else if (kw == "break" || kw == "continue") {
      s->op = kw == "break" ? Stmt::Op::kBreak : Stmt::Op::kContinue;
      expect_block_end();
    } else if (kw == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it renders its body.
      expect_block_end();
      Body inner = parse_body({"endgeneration"}, &end);
      expect_block_end();
      body.insert(body.end(), inner.begin(), inner.end());
      return;
    } else {
      fail_at(line, "unsupported Jinja statement '{% " + kw + " %}'");
    }
    body.push_back(s);
  }

  void parse_params(std::vector<std::pair<std::string, ExprPtr>>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string n = expect_name();
      ExprPtr def;
      if (skip_op("=")) def = parse_expression();
      params.emplace_back(n, def);
    }
    expect_op(")");
  }

  // "| f(args) | g": a kFilter chain whose innermost input (args[0]) is null.
  ExprPtr parse_filter_chain(bool leading_pipe = true) {
    ExprPtr node;
    bool first = true;
    while (first ? (!leading_pipe || skip_op("|")) : skip_op("|")) {
      first = false;
      node = parse_filter(node);
    }
    return node;
  }

  ExprPtr make(Expr::Op op, int line) {
    auto e = std::make_shared<Expr>();
    e->op = op;
    e->line = line;
    return e;
  }
  ExprPtr binary(const std::string& op, ExprPtr a, ExprPtr b, int line) {
    ExprPtr e = make(op == "and" ? Expr::Op::kAnd : op == "or" ? Expr::Op::kOr : Expr::Op::kBinary, line);
    e->name = op;
    e->args = {std::move(a), std::move(b)};
    return e;
  }

  // A comma-separated tuple without parentheses ({{ a, b }}, {% set x = 1, 2 %}).
  ExprPtr parse_tuple(bool with_cond = true) {
    int line = cur().line;
    ExprPtr first = parse_expression(with_cond);
    if (!is_op(",")) return first;
    ExprPtr t = make(Expr::Op::kTuple, line);
    t->args.push_back(first);
    while (skip_op(",")) {
      if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd || is_name("in")) break;
      t->args.push_back(parse_expression(with_cond));
    }
    return t;
  }

  // Nesting guard: the parser recurses per nested expression and statement.
  struct DepthGuard {
    int& d;
    DepthGuard(int& depth, int line) : d(depth) {
      if (++d > kMaxNesting) fail_at(line, "expressions or statements nested deeper than " + std::to_string(kMaxNesting));
    }
    ~DepthGuard() { --d; }
  };
  static constexpr int kMaxNesting = 200;

  ExprPtr parse_expression(bool with_cond = true) {
    DepthGuard g(depth_, cur().line);
    return with_cond ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      int line = cur().line;
      ++p_;
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (skip_name("else")) other = parse_condexpr();
      ExprPtr c = make(Expr::Op::kCond, line);
      c->args = {e, cond, other};
      e = c;
    }
    return e;
  }
  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      int line = cur().line;
      ++p_;
      e = binary("or", e, parse_and(), line);
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      int line = cur().line;
      ++p_;
      e = binary("and", e, parse_not(), line);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      ExprPtr e = make(Expr::Op::kNot, cur().line);
      ++p_;
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    while (true) {
      int line = cur().line;
      if (cur().type == Tok::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                     cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        std::string op = t_[p_++].text;
        e = binary(op, e, parse_math1(), line);
      } else if (is_name("in")) {
        ++p_;
        e = binary("in", e, parse_math1(), line);
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        p_ += 2;
        e = binary("not in", e, parse_math1(), line);
      } else {
        return e;
      }
    }
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      int line = cur().line;
      std::string op = t_[p_++].text;
      e = binary(op, e, parse_concat(), line);
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      int line = cur().line;
      ++p_;
      e = binary("~", e, parse_math2(), line);
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      int line = cur().line;
      std::string op = t_[p_++].text;
      e = binary(op, e, parse_pow(), line);
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (is_op("**")) {
      int line = cur().line;
      ++p_;
      e = binary("**", e, parse_unary(), line);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter = true) {
    DepthGuard g(depth_, cur().line);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make(is_op("-") ? Expr::Op::kNeg : Expr::Op::kPos, cur().line);
      ++p_;
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(node);
    if (with_filter) node = parse_filter_expr(node);
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    int line = t.line;
    if (t.type == Tok::kName) {
      ++p_;
      if (t.text == "true" || t.text == "True") return literal(Value::boolean(true), line);
      if (t.text == "false" || t.text == "False") return literal(Value::boolean(false), line);
      if (t.text == "none" || t.text == "None") return literal(Value::none(), line);
      ExprPtr e = make(Expr::Op::kName, line);
      e->name = t.text;
      return e;
    }
    if (t.type == Tok::kString) {
      std::string s;
      while (cur().type == Tok::kString) s += t_[p_++].text;
      return literal(Value::string(s), line);
    }
    if (t.type == Tok::kInt) {
      ++p_;
      return literal(Value::integer(t.i), line);
    }
    if (t.type == Tok::kFloat) {
      ++p_;
      return literal(Value::real(t.f), line);
    }
    if (skip_op("(")) {
      if (skip_op(")")) return make(Expr::Op::kTuple, line);
      ExprPtr first = parse_expression();
      if (skip_op(")")) return first;
      ExprPtr tup = make(Expr::Op::kTuple, line);
      tup->args.push_back(first);
      while (skip_op(",")) {
        if (is_op(")")) break;
        tup->args.push_back(parse_expression());
      }
      expect_op(")");
      return tup;
    }
    if (skip_op("[")) {
      ExprPtr l = make(Expr::Op::kList, line);
      while (!is_op("]")) {
        if (!l->args.empty()) expect_op(",");
        if (is_op("]")) break;
        l->args.push_back(parse_expression());
      }
      expect_op("]");
      return l;
    }
    if (skip_op("{")) {
      ExprPtr d = make(Expr::Op::kDict, line);
      while (!is_op("}")) {
        if (!d->args.empty()) expect_op(",");
        if (is_op("}")) break;
        d->args.push_back(parse_expression());
        expect_op(":");
        d->args.push_back(parse_expression());
      }
      expect_op("}");
      return d;
    }
    fail_at(line, "unexpected " + describe(t) + " in an expression");
  }
  ExprPtr literal(Value v, int line) {
    ExprPtr e = make(Expr::Op::kLiteral, line);
    e->literal = std::move(v);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      int line = cur().line;
      if (skip_op(".")) {
        if (cur().type == Tok::kInt) {
          ExprPtr e = make(Expr::Op::kGetItem, line);
          e->args = {node, literal(Value::integer(cur().i), line)};
          ++p_;
          node = e;
        } else {
          ExprPtr e = make(Expr::Op::kGetAttr, line);
          e->name = expect_name();
          e->args = {node};
          node = e;
        }
      } else if (skip_op("[")) {
        ExprPtr start, stop, step;
        bool slice = false;
        if (!is_op(":")) start = parse_expression();
        if (skip_op(":")) {
          slice = true;
          if (!is_op(":") && !is_op("]")) stop = parse_expression();
          if (skip_op(":") && !is_op("]")) step = parse_expression();
        }
        expect_op("]");
        ExprPtr e = make(slice ? Expr::Op::kSlice : Expr::Op::kGetItem, line);
        e->args = slice ? std::vector<ExprPtr>{node, start, stop, step} : std::vector<ExprPtr>{node, start};
        node = e;
      } else if (is_op("(")) {
        node = parse_call(node);
      } else {
        return node;
      }
    }
  }

  // Call arguments into e->args (after any leading ones) and e->kwargs.
  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail_at(cur().line, "unsupported Jinja construct: *args / **kwargs in a call");
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        std::string n = t_[p_].text;
        p_ += 2;
        e.kwargs.emplace_back(n, parse_expression());
      } else {
        e.args.push_back(parse_expression());
      }
    }
    expect_op(")");
  }
  ExprPtr parse_call(ExprPtr callee) {
    ExprPtr e = make(Expr::Op::kCall, cur().line);
    e->args.push_back(callee);
    parse_call_args(*e);
    return e;
  }
  ExprPtr parse_filter(ExprPtr input) {
    ExprPtr e = make(Expr::Op::kFilter, cur().line);
    e->name = expect_name();
    while (skip_op(".")) e->name += "." + expect_name();
    e->args.push_back(input);
    if (is_op("(")) parse_call_args(*e);
    return e;
  }
  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (skip_op("|")) {
        node = parse_filter(node);
      } else if (is_name("is")) {
        ExprPtr e = make(Expr::Op::kTest, cur().line);
        ++p_;
        if (skip_name("not")) e->negated = true;
        e->name = expect_name();
        e->args.push_back(node);
        const Token& c = cur();
        if (is_op("(")) {
          parse_call_args(*e);
        } else if ((c.type == Tok::kName || c.type == Tok::kString || c.type == Tok::kInt || c.type == Tok::kFloat ||
                    is_op("[") || is_op("{")) &&
                   !(c.type == Tok::kName && (c.text == "else" || c.text == "or" || c.text == "and"))) {
          if (is_name("is")) fail_at(c.line, "you cannot chain multiple tests with 'is'");
          e->args.push_back(parse_postfix(parse_primary()));
        }
        node = e;
      } else if (is_op("(")) {
        node = parse_call(node);
      } else {
        return node;
      }
    }
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  int depth_ = 0;
};

}  // namespace

Program jinja_parse(const std::string& source) {
  Lexer lexer(normalize_source(source));
  Parser parser(lexer.run());
  Program prog;
  prog.body = parser.parse_template();
  return prog;
}

}  // namespace fp8rl::jinja
