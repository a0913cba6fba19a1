// Procedural multi-step arithmetic with worked, one-operation-per-line solutions.
#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "core/error.h"
#include "tasks/answer.h"
#include "tasks/expr.h"
#include "tasks/procedural.h"

namespace fp8rl {
namespace {

struct Node {
  char op = 0;  // 0 for a number
  Rational value;
  int left = -1, right = -1;
};

int precedence(char op) { return op == '+' || op == '-' ? 1 : op == '*' || op == '/' ? 2 : 3; }

std::string format_rational(const Rational& r) {
  return r.den == 1 ? std::to_string(r.num) : std::to_string(r.num) + "/" + std::to_string(r.den);
}

// Prints with the parentheses the tree needs: a child of lower precedence, or a right
// child of equal precedence (so the text parses back to exactly this tree).
std::string print(const std::vector<Node>& t, int i, bool top = true) {
  const Node& n = t[i];
  if (!n.op) {
    const std::string s = format_rational(n.value);
    return n.value.num < 0 && !top ? "(" + s + ")" : s;
  }
  auto side = [&](int c, bool right) {
    const bool paren = precedence(t[c].op) < precedence(n.op) ||
                       (right && t[c].op && precedence(t[c].op) == precedence(n.op));
    const std::string s = print(t, c, false);
    return paren ? "(" + s + ")" : s;
  };
  return side(n.left, false) + " " + std::string(1, n.op) + " " + side(n.right, true);
}

// Word problems: who, what, and one sentence (and its solution wording) per operation.
constexpr const char* kNames[] = {"Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo",
                                  "Isla", "Jack", "Lena", "Omar", "Priya", "Sam", "Tara", "Yuki"};
constexpr const char* kItems[] = {"apples", "marbles", "stickers", "coins", "books",
                                  "cards",  "shells",  "pencils",  "stamps", "cookies"};
struct StoryStep {
  char op;
  const char* sentence;  // {N} name, {B} operand, {I} items
  const char* because;   // the solution's wording of the same step
};
constexpr StoryStep kSteps[] = {
    {'+', "{N} buys {B} more {I}.", "After buying {B} more"},
    {'+', "A friend gives {N} {B} {I}.", "After getting {B} from a friend"},
    {'+', "{N} finds {B} more {I}.", "After finding {B} more"},
    {'-', "{N} gives away {B} {I}.", "After giving away {B}"},
    {'-', "{N} sells {B} {I}.", "After selling {B}"},
    {'-', "{N} loses {B} {I}.", "After losing {B}"},
    {'*', "Then the number of {I} {N} has becomes {B} times as large.", "After it becomes {B} times as large"},
    {'/', "{N} splits the {I} into {B} equal piles and keeps one pile.", "After keeping one of {B} equal piles"},
};

std::string fill(std::string s, const std::string& name, int64_t b, const std::string& items) {
  for (const auto& [key, value] : {std::pair<std::string, std::string>{"{N}", name}, {"{B}", std::to_string(b)},
                                   {"{I}", items}})
    for (size_t at = s.find(key); at != std::string::npos; at = s.find(key, at + value.size()))
      s.replace(at, key.size(), value);
  return s;
}

bool needs_parentheses(const std::vector<Node>& t, int root) {
  return print(t, root).find('(') != std::string::npos;
}

class ArithmeticTask : public ProceduralTask {
 public:
  explicit ArithmeticTask(const ArithmeticConfig& c)
      : ProceduralTask(c.seed, c.train_size, c.validation_size), cfg_(c) {
    FP8RL_CHECK(c.min_operands >= 2 && c.max_operands >= c.min_operands && c.max_operands <= 12,
                "arithmetic: operands must satisfy 2 <= min_operands <= max_operands <= 12");
    FP8RL_CHECK(c.digits >= 1 && c.digits <= 6, "arithmetic: digits must be in [1, 6]");
    FP8RL_CHECK(!c.operators.empty() && c.operators.find_first_not_of("+-*/") == std::string::npos,
                "arithmetic: operators must be a non-empty subset of \"+-*/\"");
    build_validation_set();
  }
  std::string name() const override { return cfg_.story ? "arithmetic_story" : "arithmetic"; }

  double reward(std::string_view response, const std::string& answer) const override {
    const auto got = answer_extract(response);
    return got && answer_equal(*got, answer) ? 1.0 : 0.0;
  }

 protected:
  TaskItem generate(TaskRng& rng) const override {
    int64_t max_value = 9;
    for (int d = 1; d < cfg_.digits; ++d) max_value = max_value * 10 + 9;
    if (cfg_.story) return story(rng, max_value);
    for (int attempt = 0;; ++attempt) {
      FP8RL_CHECK(attempt < 10000, "arithmetic: no valid expression found; loosen the knobs");
      std::vector<Node> t;
      const int n = int(rng.uniform(cfg_.min_operands, cfg_.max_operands));
      bool ok = true;
      const int root = build(t, n, rng, max_value, ok);
      if (!ok || (!cfg_.parentheses && needs_parentheses(t, root))) continue;
      return solve(t, root);
    }
  }

 private:
  ArithmeticConfig cfg_;

  int build(std::vector<Node>& t, int n, TaskRng& rng, int64_t max_value, bool& ok) const {
    if (n == 1) {
      t.push_back(Node{0, Rational{rng.uniform(1, max_value), 1}});
      return int(t.size()) - 1;
    }
    const int k = int(rng.uniform(1, n - 1));
    const char op = cfg_.operators[rng.uniform(0, int64_t(cfg_.operators.size()) - 1)];
    const int l = build(t, k, rng, max_value, ok), r = build(t, n - k, rng, max_value, ok);
    Node node{op, {}, l, r};
    const Rational a = t[l].value, b = t[r].value;
    bool fine = op == '+' ? rational_add(a, b, node.value)
              : op == '-' ? rational_sub(a, b, node.value)
              : op == '*' ? rational_mul(a, b, node.value)
                          : b.num != 0 && rational_div(a, b, node.value);
    // Exact integer results that stay readable.
    if (!fine || node.value.den != 1 || node.value.num > 1000000000000LL || node.value.num < -1000000000000LL)
      ok = false;
    t.push_back(node);
    return int(t.size()) - 1;
  }

  // Leftmost operation whose operands are both numbers (the usual evaluation order).
  static int ready(const std::vector<Node>& t, int i) {
    if (!t[i].op) return -1;
    const int l = ready(t, t[i].left);
    if (l >= 0) return l;
    if (!t[t[i].left].op && !t[t[i].right].op) return i;
    return ready(t, t[i].right);
  }

  // A left-to-right word problem; an operation that does not fit the current value (a
  // subtraction below 0, an inexact division, growth to 10^(digits + 1) or more) is drawn again.
  TaskItem story(TaskRng& rng, int64_t max_value) const {
    const std::string name = kNames[rng.uniform(0, std::size(kNames) - 1)];
    const std::string items = kItems[rng.uniform(0, std::size(kItems) - 1)];
    int64_t value = rng.uniform(2, std::max<int64_t>(2, max_value));
    TaskItem it;
    it.prompt = name + " has " + std::to_string(value) + " " + items + ".";
    it.solution = name + " starts with " + std::to_string(value) + " " + items + ".\n";
    const int64_t cap = max_value * 10 + 9;  // every value stays below 10^(digits + 1)
    const int n = int(rng.uniform(cfg_.min_operands, cfg_.max_operands));
    for (int i = 1; i < n; ++i) {
      for (int attempt = 0;; ++attempt) {
        FP8RL_CHECK(attempt < 1000, "arithmetic story: no operation fits; loosen the knobs");
        const char op = cfg_.operators[rng.uniform(0, int64_t(cfg_.operators.size()) - 1)];
        const int64_t b = op == '*' || op == '/' ? rng.uniform(2, 9) : rng.uniform(1, max_value);
        int64_t next = 0;
        if (op == '+') next = value + b;
        else if (op == '-') next = value - b;
        else if (op == '*') next = value * b;
        else next = value % b == 0 ? value / b : -1;
        if (next < 0 || next > cap) continue;
        std::vector<const StoryStep*> choices;
        for (const StoryStep& s : kSteps)
          if (s.op == op) choices.push_back(&s);
        const StoryStep& s = *choices[rng.uniform(0, int64_t(choices.size()) - 1)];
        it.prompt += " " + fill(s.sentence, name, b, items);
        it.solution += fill(s.because, name, b, items) + ", " + name + " has " + std::to_string(value) + " " +
                       std::string(1, op) + " " + std::to_string(b) + " = " + std::to_string(next) +
                       " " + items + ".\n";
        value = next;
        break;
      }
    }
    it.prompt += " How many " + items + " does " + name + " have now?\n" + kMathInstruction;
    it.answer = std::to_string(value);
    it.solution += "#### " + it.answer;
    return it;
  }

  TaskItem solve(std::vector<Node> t, int root) const {
    TaskItem it;
    const std::string expr = print(t, root);
    it.prompt = "What is " + expr + "?\n" + kMathInstruction;
    it.answer = format_rational(t[root].value);
    it.solution = expr + "\n";
    for (int i = ready(t, root); i >= 0; i = ready(t, root)) {
      t[i].op = 0;  // collapse the operation into its value
      it.solution += "= " + print(t, root) + "\n";
    }
    it.solution += "#### " + it.answer;
    return it;
  }
};

}  // namespace

std::unique_ptr<Task> task_make_arithmetic(const ArithmeticConfig& cfg) {
  return std::make_unique<ArithmeticTask>(cfg);
}

}  // namespace fp8rl
