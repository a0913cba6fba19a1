#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, run `fp8rl train` on its
# embedded default (a small, complete GRPO run on the CPU). Extra arguments go to fp8rl train.
# The demo runs on the CPU, so this builds without CUDA (faster) into build-cpu/ unless
# FP8RL_CUDA=ON is set; scripts/build.sh builds everything into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
export FP8RL_BUILD_DIR="${FP8RL_BUILD_DIR:-build-cpu}" FP8RL_CUDA="${FP8RL_CUDA:-OFF}"
bash scripts/build.sh -DFP8RL_TESTS=OFF
exec "./$FP8RL_BUILD_DIR/fp8rl" train "$@"
