// Final-answer extraction and exact numeric equivalence for math verifiers.
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace fp8rl {

// The final answer of a response: the content of the last \boxed{...} (braces balanced),
// else the rest of the line after the last "####", else (if `last_number_fallback`) the last
// number in the text. nullopt if none.
std::optional<std::string> answer_extract(std::string_view response, bool last_number_fallback = true);

// An exact rational parsed from answer text, with arbitrary-size digits. Accepts: optional
// sign (- or U+2212), '$', thousands commas (groups of 3), decimals ("2.50", "3.", ".5"),
// simple fractions "3/4", "\frac{3}{4}" / "\dfrac{3}{4}", surrounding spaces, and a final
// '.' (sentence end). Returns false on anything else (units, words, zero denominators).
struct ExactNumber {
  bool negative = false;
  std::string numerator = "0", denominator = "1";  // decimal digits, no leading zeros
};
bool answer_parse_number(std::string_view text, ExactNumber& out);

// True if both parse as numbers with the same exact value ("1,000" == "1000.0" == "$1000",
// "0.75" == "3/4", "-0" == "0"); otherwise compares the texts with surrounding whitespace
// removed.
bool answer_equal(std::string_view candidate, std::string_view reference);

// The last number in the text ("-1,234.5", "3/4"), or nullopt.
std::optional<std::string> answer_last_number(std::string_view text);

// A math final answer made comparable (MATH / DAPO-style \boxed{} answers): unwraps \text{},
// \textbf{}, \mathrm{}, \mathbf{}, \boxed{}; drops $ and \$, \left / \right, spacing commands
// (\, \! \; \:), degree and percent signs, a leading "x =", trailing unit words ("5 cm",
// "12 dollars", "\text{ meters}"); turns {,} and \, thousands separators into plain digits,
// \dfrac / \tfrac into \frac, \frac12 into \frac{1}{2}, \frac{-3}{4} into -\frac{3}{4}.
std::string answer_normalize(std::string_view answer);
// answer_equal of the normalized texts.
bool answer_equal_normalized(std::string_view candidate, std::string_view reference);
// The normalized content of the last \boxed{...} or \fbox{...} (braces balanced); nullopt if none.
std::optional<std::string> answer_extract_boxed(std::string_view response);

}  // namespace fp8rl
