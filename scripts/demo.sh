#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, run `fp8rl train` on its
# embedded default (a small, complete GRPO run on the CPU). Extra arguments go to fp8rl train.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec ./build/fp8rl train "$@"
