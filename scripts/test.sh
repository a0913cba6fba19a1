#!/usr/bin/env bash
# The test command (README, CI): builds and runs every CPU test twice, once in the normal
# build (which also compiles the CUDA sources when nvcc is present) and once under
# AddressSanitizer + UndefinedBehaviorSanitizer (CPU only; every test but the one MoE learning
# curve, see below). GPU tests (label gpu) run only on
# a GPU machine: scripts/gpu_run.sh. Set FP8RL_TEST_SANITIZE=0 to skip the sanitizer pass.
# Then the libFuzzer targets run for a bounded time (scripts/fuzz.sh; FP8RL_TEST_FUZZ=0 skips,
# FP8RL_FUZZ_SECONDS sets the time per target; skipped without clang/libFuzzer). First of all,
# the format check (scripts/format_check.sh: the files listed in scripts/format_files.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# Each phase's wall time, printed when it ends (CI's log: where the time goes).
t0=$SECONDS
took() { echo "== $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }
echo "== format (clang-format --dry-run -Werror over scripts/format_files.txt)"
bash scripts/format_check.sh
took "format check"
# The sanitizer build's arguments (its configure runs twice: early in the background, below).
# Compiled by clang when there is one (a fresh build directory only; the fuzzers need it too):
# it builds this instrumented program in 600 CPU-s against GCC's ~950 (its tests then take
# ~60 s longer; measured on 2 cores, docs/benchmarks.md), and a second compiler's warnings.
asan_env=(FP8RL_BUILD_DIR=build-asan FP8RL_CUDA=OFF FP8RL_BUILD_TYPE=Release)
if command -v clang++ >/dev/null && [ ! -f build-asan/CMakeCache.txt ]; then asan_env+=(CC=clang CXX=clang++); fi
asan_args=(-DFP8RL_SANITIZE=ON -DFP8RL_PYTHON=OFF -DFP8RL_TEST_SHARDS=16
           "-DFP8RL_TEST_FILTER=-RlLoop.TinyMoeLearnsInBf16AndFp8")
# The sanitizer and fuzz builds' cmake configure steps (one core, ~15 s together) run now, beside
# the Release configure and build, rather than alone later: their second cmake call, before
# their build, then only re-checks (~2 s) and reports any error of the first.
bash scripts/install-deps.sh
(
  if [ "${FP8RL_TEST_SANITIZE:-1}" != "0" ]; then
    env "${asan_env[@]}" FP8RL_CONFIGURE_ONLY=1 bash scripts/build.sh "${asan_args[@]}" || true
  fi
  if [ "${FP8RL_TEST_FUZZ:-1}" != "0" ]; then FP8RL_FUZZ_CONFIGURE_ONLY=1 bash scripts/fuzz.sh || true; fi
) > /dev/null 2>&1 &
early_pid=$!
early_wait() { if [ -n "$early_pid" ]; then wait "$early_pid" || true; early_pid=; fi; }
echo "== build (Release$(command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] && echo ' + CUDA compile'))"
# The CPU tests as 16 GoogleTest shards, one process each (FP8RL_TEST_SHARDS): a test process of
# the CUDA build maps cuBLASLt and the CUDA runtime at every start (~0.12 s), paid 1046 times
# otherwise; the longest test (the MoE learning curve) has an entry of its own, started first.
# `ctest -N` or a build without the option lists the tests one by one. The test processes of a
# ctest run share one cache of the tiny model's tokenizer and starting policy (CMakeLists.txt).
bash scripts/build.sh -DFP8RL_TEST_SHARDS=16
took "build"
echo "== CPU tests"
ctest --test-dir build -L cpu --output-on-failure -j "$jobs"
took "CPU tests"
if [ "${FP8RL_TEST_SANITIZE:-1}" != "0" ]; then
  echo "== CPU tests under ASan + UBSan"
  # Without the embedded Python here: an uninstrumented libpython and its extension modules
  # (pyarrow) under LeakSanitizer report their own allocations; the Python tests run above.
  # The tests as 16 shards again (an instrumented process start costs ~0.1 s). Without the one
  # learning-curve test (16 GRPO steps of a tiny MoE in two recipes, 210 s here against 47 s
  # above): it repeats the code paths the shorter MoE tests sanitize
  # (Cli.MoeTrainLogsRoutingAgreementAndReplays, the MoE op-table rows).
  early_wait
  env "${asan_env[@]}" bash scripts/build.sh "${asan_args[@]}"
  took "sanitizer build"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan -L cpu --output-on-failure -j "$jobs"
  took "CPU tests under ASan + UBSan"
fi
if [ "${FP8RL_TEST_FUZZ:-1}" != "0" ]; then
  early_wait
  secs=${FP8RL_FUZZ_SECONDS:-25}
  echo "== fuzzing the input parsers (libFuzzer + ASan + UBSan, ${secs} s per target)"
  FP8RL_FUZZ_SECONDS=$secs bash scripts/fuzz.sh
  took "fuzzing (build and runs)"
fi
echo "== all tests passed"
