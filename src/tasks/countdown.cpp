// Countdown: combine the given numbers with + - * / to reach the target, using each given
// number EXACTLY once (all must be used). Answers are expressions in \boxed{...} (or after
// "####"); a trailing "= value" is ignored. Evaluation is exact (rationals), so
// intermediate fractions are allowed; division by zero or overflow makes the answer wrong.
#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "tasks/answer.h"
#include "tasks/expr.h"
#include "tasks/procedural.h"

namespace fp8rl {
namespace {

struct Reference {
  std::vector<int64_t> numbers;
  int64_t target = 0;
};

std::string format_reference(const Reference& r) {
  std::string s = "numbers=";
  for (size_t i = 0; i < r.numbers.size(); ++i) s += (i ? "," : "") + std::to_string(r.numbers[i]);
  return s + " target=" + std::to_string(r.target);
}

Reference parse_reference(const std::string& answer) {
  Reference r;
  const size_t t = answer.find(" target=");
  FP8RL_CHECK(answer.rfind("numbers=", 0) == 0 && t != std::string::npos,
              "countdown: malformed reference '", answer, "' (expected 'numbers=a,b,c target=t')");
  std::stringstream ss(answer.substr(8, t - 8));
  std::string tok;
  try {
    while (std::getline(ss, tok, ',')) r.numbers.push_back(std::stoll(tok));
    r.target = std::stoll(answer.substr(t + 8));
  } catch (const std::exception&) {
    FP8RL_FAIL("countdown: malformed reference '", answer, "'");
  }
  return r;
}

class CountdownTask : public ProceduralTask {
 public:
  explicit CountdownTask(const CountdownConfig& c)
      : ProceduralTask(c.seed, c.train_size, c.validation_size), cfg_(c) {
    FP8RL_CHECK(c.numbers >= 2 && c.numbers <= 6, "countdown: numbers must be in [2, 6]");
    FP8RL_CHECK(c.max_number >= 2 && c.max_number <= 1000 && c.max_target >= 1,
                "countdown: need 2 <= max_number <= 1000 and max_target >= 1");
    build_validation_set();
  }
  std::string name() const override { return "countdown"; }

  double reward(std::string_view response, const std::string& answer) const override {
    const Reference ref = parse_reference(answer);
    const auto got = answer_extract(response, /*last_number_fallback=*/false);
    if (!got) return 0.0;
    const std::string expr = got->substr(0, got->find('='));
    const ExprResult r = expr_evaluate(expr);
    if (!r.ok || r.value.den != 1 || r.value.num != ref.target) return 0.0;
    std::vector<int64_t> used = r.numbers, given = ref.numbers;
    std::sort(used.begin(), used.end());
    std::sort(given.begin(), given.end());
    return used == given ? 1.0 : 0.0;
  }

 protected:
  TaskItem generate(TaskRng& rng) const override {
    for (int attempt = 0;; ++attempt) {
      FP8RL_CHECK(attempt < 10000, "countdown: no puzzle found; raise max_target");
      Reference ref;
      struct Item {
        int64_t value;
        std::string expr;
        bool leaf;
      };
      std::vector<Item> pool;
      for (int i = 0; i < cfg_.numbers; ++i) {
        ref.numbers.push_back(rng.uniform(1, cfg_.max_number));
        pool.push_back({ref.numbers.back(), std::to_string(ref.numbers.back()), true});
      }
      std::string steps;
      while (pool.size() > 1) {
        const size_t i = size_t(rng.uniform(0, int64_t(pool.size()) - 1));
        size_t j = size_t(rng.uniform(0, int64_t(pool.size()) - 2));
        if (j >= i) ++j;
        Item a = pool[i], b = pool[j];
        if (a.value < b.value) std::swap(a, b);  // a >= b: subtraction stays non-negative
        std::vector<char> ops = {'+', '*'};
        if (a.value > b.value) ops.push_back('-');
        if (b.value > 1 && a.value % b.value == 0) ops.push_back('/');
        const char op = ops[rng.uniform(0, int64_t(ops.size()) - 1)];
        const int64_t c = op == '+' ? a.value + b.value : op == '-' ? a.value - b.value
                        : op == '*' ? a.value * b.value : a.value / b.value;
        steps += std::to_string(a.value) + " " + op + " " + std::to_string(b.value) + " = " +
                 std::to_string(c) + "\n";
        auto wrap = [](const Item& x) { return x.leaf ? x.expr : "(" + x.expr + ")"; };
        Item merged{c, wrap(a) + " " + op + " " + wrap(b), false};
        pool.erase(pool.begin() + long(std::max(i, j)));
        pool.erase(pool.begin() + long(std::min(i, j)));
        pool.push_back(merged);
      }
      ref.target = pool[0].value;
      if (ref.target < 1 || ref.target > cfg_.max_target) continue;
      TaskItem it;
      std::string list;
      for (size_t k = 0; k < ref.numbers.size(); ++k) list += (k ? ", " : "") + std::to_string(ref.numbers[k]);
      it.prompt = "Using the numbers " + list + ", make " + std::to_string(ref.target) +
                  ". Use each number exactly once, with + - * / and parentheses. Give the final "
                  "expression as \\boxed{<expression>}.";
      it.answer = format_reference(ref);
      it.solution = steps + pool[0].expr + " = " + std::to_string(ref.target) + "\n\\boxed{" + pool[0].expr + "}";
      return it;
    }
  }

 private:
  CountdownConfig cfg_;
};

}  // namespace

std::unique_ptr<Task> task_make_countdown(const CountdownConfig& cfg) {
  return std::make_unique<CountdownTask>(cfg);
}

}  // namespace fp8rl
