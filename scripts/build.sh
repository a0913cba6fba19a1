#!/usr/bin/env bash
# Configures and builds fp8rl into build/ (or $FP8RL_BUILD_DIR). CUDA is built when nvcc is
# found (override: FP8RL_CUDA=ON|OFF). Extra cmake arguments pass through. FP8RL_CONFIGURE_ONLY=1
# only configures, without installing the dependencies (scripts/test.sh, which has installed
# them, configures its later builds early, in the background).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${FP8RL_CONFIGURE_ONLY:-0}" = "1" ] || bash scripts/install-deps.sh
dir=${FP8RL_BUILD_DIR:-build}
args=(-S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=${FP8RL_BUILD_TYPE:-Release})
[ -n "${FP8RL_CUDA:-}" ] && args+=(-DFP8RL_CUDA="$FP8RL_CUDA")
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake "${args[@]}" "$@" >/dev/null
[ "${FP8RL_CONFIGURE_ONLY:-0}" = "1" ] && exit 0
cmake --build "$dir" -j "$(nproc)"
