#!/usr/bin/env bash
# clang-format (.clang-format: the code's style) in --dry-run -Werror mode over the files listed
# in scripts/format_files.txt (one path a line, # comments): the files already in that style.
# Most of the tree is hand-wrapped (aligned comments, lines broken by meaning) and would not
# pass, so the tree is not reformatted wholesale; a file joins the list once it is formatted.
# FP8RL_FORMAT_CHANGED=1 checks instead the C++/CUDA files changed since the merge base with
# main (what a branch should keep formatted). Skipped, with a line, without clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
cf=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$cf" ]; then
  echo "format check skipped: clang-format not found (apt-get install clang-format-14)"
  exit 0
fi
if [ "${FP8RL_FORMAT_CHANGED:-0}" = "1" ]; then
  base=$(git merge-base HEAD main)
  mapfile -t files < <(git diff --name-only --diff-filter=d "$base" -- '*.cpp' '*.h' '*.cu' '*.cuh')
else
  mapfile -t files < <(grep -v '^\s*\(#\|$\)' scripts/format_files.txt)
fi
[ "${#files[@]}" -eq 0 ] && { echo "format check: no files"; exit 0; }
"$cf" --dry-run -Werror "${files[@]}"
echo "format check: ${#files[@]} files in .clang-format's style"
