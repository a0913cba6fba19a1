// Verifiers on tricky answers: formats, huge numbers, fractions, unicode, empty responses,
// countdown expressions (division by zero, reuse, overflow).
#include <gtest/gtest.h>

#include "tasks/answer.h"
#include "tasks/expr.h"
#include "tasks/task.h"

namespace fp8rl {
namespace {

TEST(Answer, ExtractPrefersBoxedThenHashesThenLastNumber) {
  EXPECT_EQ(answer_extract("so 3 then \\boxed{42} and 7").value(), "42");
  EXPECT_EQ(answer_extract("\\boxed{1} then \\boxed{\\frac{3}{4}}").value(), "\\frac{3}{4}");
  EXPECT_EQ(answer_extract("a\n#### 1,234\nthanks").value(), "1,234");
  EXPECT_EQ(answer_extract("we get 5 apples and -12.5 pears.").value(), "-12.5");
  EXPECT_EQ(answer_extract("ratio 3/4 of them").value(), "3/4");
  EXPECT_EQ(answer_extract("total 1,000,000 dollars").value(), "1,000,000");
  EXPECT_EQ(answer_extract("unclosed \\boxed{12 and #### 9").value(), "9");
  EXPECT_FALSE(answer_extract("").has_value());
  EXPECT_FALSE(answer_extract("no digits here ½").has_value());
  EXPECT_FALSE(answer_extract("12 apples", /*last_number_fallback=*/false).has_value());
  EXPECT_EQ(answer_extract("####   \n 8").value(), "8");  // empty #### line: fall back
}

TEST(Answer, NumericEquivalence) {
  const std::vector<std::pair<std::string, std::string>> same = {
      {"1,000", "1000"}, {"$1,000.00", "1000"}, {"42.0", "42"}, {"42.", "42"}, {"0.75", "3/4"},
      {"\\frac{3}{4}", "0.75"}, {"\\dfrac{6}{8}", "3/4"}, {"-5", "\xE2\x88\x92" "5"}, {"-0", "0"},
      {"$-3", "-3"}, {"007", "7"}, {".5", "1/2"}, {" 18 ", "18"}, {"2.50", "5/2"},
      {"123456789012345678901234567890", "123,456,789,012,345,678,901,234,567,890"},
      {"99999999999999999999999.5", "199999999999999999999999/2"}};
  for (auto& [a, b] : same) EXPECT_TRUE(answer_equal(a, b)) << a << " vs " << b;
  const std::vector<std::pair<std::string, std::string>> different = {
      {"-5", "5"}, {"1,00", "100"}, {"12 clips", "12"}, {"", "12"}, {"1/0", "0"}, {"3/4", "0.7501"},
      {"123456789012345678901234567891", "123456789012345678901234567890"}, {"0x10", "16"},
      {"1e3", "1000"}, {"½", "0.5"}, {"4..5", "4.5"}, {"--5", "5"}, {"1,2345", "12345"}};
  for (auto& [a, b] : different) EXPECT_FALSE(answer_equal(a, b)) << a << " vs " << b;
  EXPECT_TRUE(answer_equal("2.5.", "2.5"));  // a sentence-ending period
  // Over 1000 chars a "number" is only compared as text (bounded work).
  EXPECT_FALSE(answer_equal(std::string(2000, '9') + ".0", std::string(2000, '9')));
}

TEST(Answer, RewardsOfMathTaskNeverThrow) {
  ArithmeticConfig c;
  c.train_size = 10;
  c.validation_size = 10;
  auto t = task_make_arithmetic(c);
  EXPECT_EQ(t->reward("#### 14", "14"), 1.0);
  EXPECT_EQ(t->reward("The answer is \\boxed{14}.", "14"), 1.0);
  EXPECT_EQ(t->reward("14", "14"), 1.0);
  EXPECT_EQ(t->reward("", "14"), 0.0);
  EXPECT_EQ(t->reward("#### 15", "14"), 0.0);
  EXPECT_EQ(t->reward("\xFF\xFE garbage \xC3", "14"), 0.0);
  EXPECT_EQ(t->reward("\xF0\x9F\x98\x80 #### \xE2\x88\x92" "3", "-3"), 1.0);
  EXPECT_EQ(t->reward(std::string(100000, '9'), "14"), 0.0);
  EXPECT_EQ(t->reward("#### 99999999999999999999999999", "99999999999999999999999999"), 1.0);
}

TEST(Expr, EvaluatesExactlyAndSafely) {
  ExprResult r = expr_evaluate("(3 + 4) * 6 - 1");
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.value.num, 41);
  EXPECT_EQ(r.numbers, (std::vector<int64_t>{3, 4, 6, 1}));
  r = expr_evaluate("8 / (3 - 8 / 3)");  // rational intermediate: 8 / (1/3) = 24
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.value.num, 24);
  EXPECT_EQ(r.value.den, 1);
  r = expr_evaluate("7 / 2");
  EXPECT_EQ(r.value.num, 7);
  EXPECT_EQ(r.value.den, 2);
  r = expr_evaluate("5 / (3 - 3)");
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.error, "division by zero");
  for (const char* bad : {"", "(", "3 +", "3 ++ 4", "-3 + 4", "3.5 + 1", "import os", "3 4", "(3))",
                          "99999999999999999999 + 1", "1000000000000000 * 1000000000000000 * 1000000000000000"})
    EXPECT_FALSE(expr_evaluate(bad).ok) << bad;
  EXPECT_FALSE(expr_evaluate(std::string(5000, '(') + "1" + std::string(5000, ')')).ok);  // depth limit
  EXPECT_TRUE(expr_evaluate("2 \xC3\x97 3 \xC3\xB7 2").ok);  // × and ÷
}

TEST(Countdown, VerifierRules) {
  CountdownConfig c;
  c.train_size = 10;
  c.validation_size = 10;
  auto t = task_make_countdown(c);
  const std::string ref = "numbers=3,4,6,1 target=41";
  EXPECT_EQ(t->reward("\\boxed{(3 + 4) * 6 - 1}", ref), 1.0);
  EXPECT_EQ(t->reward("#### (4 + 3) * 6 - 1 = 41", ref), 1.0);          // "= value" ignored
  EXPECT_EQ(t->reward("\\boxed{(3 + 4) * 6}", ref), 0.0);                // 1 unused: exactly once
  EXPECT_EQ(t->reward("\\boxed{(3 + 4) * 6 - 1 + 1 - 1}", ref), 0.0);    // 1 used twice
  EXPECT_EQ(t->reward("\\boxed{(3 + 4) * 6 - 1 + 0 / (4 - 4)}", ref), 0.0);  // division by zero
  EXPECT_EQ(t->reward("\\boxed{(3 + 4) * 7 - 8}", ref), 0.0);            // numbers not given
  EXPECT_EQ(t->reward("41", ref), 0.0);                                  // no expression
  EXPECT_EQ(t->reward("", ref), 0.0);
  EXPECT_EQ(t->reward("\\boxed{(3+4)*6-1", ref), 0.0);                   // unclosed box
  EXPECT_EQ(t->reward("\\boxed{41}", "numbers=41 target=41"), 1.0);
  EXPECT_EQ(t->reward("\\boxed{4 * 6 / 3 + 1 * 33}", "numbers=4,6,3,1,33 target=41"), 1.0);
  EXPECT_EQ(t->reward("\\boxed{(6 - 4) / 3 * 3}", "numbers=6,4,3,3 target=2"), 1.0);  // fraction inside
  EXPECT_THROW(t->reward("\\boxed{1}", "garbage"), std::exception);  // bad reference is a bug
}

}  // namespace
}  // namespace fp8rl
