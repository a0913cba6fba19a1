// Procedural multi-step arithmetic with worked, one-operation-per-line solutions.
#include <algorithm>

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
  std::string name() const override { return "arithmetic"; }

  double reward(std::string_view response, const std::string& answer) const override {
    const auto got = answer_extract(response);
    return got && answer_equal(*got, answer) ? 1.0 : 0.0;
  }

 protected:
  TaskItem generate(TaskRng& rng) const override {
    int64_t max_value = 9;
    for (int d = 1; d < cfg_.digits; ++d) max_value = max_value * 10 + 9;
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
