#!/usr/bin/env bash
# Configures and builds fp8rl into build/ (or $FP8RL_BUILD_DIR). CUDA is built when nvcc is
# found (override: FP8RL_CUDA=ON|OFF). Extra cmake arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
dir=${FP8RL_BUILD_DIR:-build}
args=(-S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=${FP8RL_BUILD_TYPE:-Release})
[ -n "${FP8RL_CUDA:-}" ] && args+=(-DFP8RL_CUDA="$FP8RL_CUDA")
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake "${args[@]}" "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)"
