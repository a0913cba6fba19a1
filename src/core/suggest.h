// "Did you mean ...?" for user input: the nearest of a list of valid words.
#pragma once
#include <string>
#include <vector>

namespace fp8rl {

// Levenshtein distance (insertions, deletions, substitutions of bytes).
size_t edit_distance(const std::string& a, const std::string& b);

// The candidate nearest to `word`, or "" when none is within max(2, |word| / 3) edits (a
// suggestion further away than that is noise).
std::string suggest_nearest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace fp8rl
