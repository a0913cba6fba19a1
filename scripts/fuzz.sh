#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/*.cpp: tokenizer.json, config.json + run-config YAML,
# safetensors headers) with clang, ASan and UBSan, and runs each for FP8RL_FUZZ_SECONDS
# (default 30; FP8RL_FUZZ_JOBS targets at once, default nproc: one core each) on inputs up to
# 1 MB, starting from the committed corpus tests/fuzz/corpus/<name> (read only; what the run
# finds goes to $dir/corpus/<name>). A crash, a sanitizer report, an
# uncaught exception or a hang fails the script and leaves the input in $dir (crash-*, timeout-*).
# Without clang or libFuzzer it says so and exits 0. FP8RL_FUZZ_CONFIGURE_ONLY=1 stops after the
# cmake configure step (scripts/test.sh runs it early, in the background).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FP8RL_FUZZ_SECONDS:-30}
dir=${FP8RL_FUZZ_BUILD_DIR:-build-fuzz}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: no clang++; skipped"
  exit 0
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$probe/t.cpp"
if ! clang++ -fsanitize=fuzzer "$probe/t.cpp" -o "$probe/t" 2>/dev/null; then
  echo "fuzz: clang++ has no libFuzzer (Debian: libclang-rt-dev); skipped"
  exit 0
fi
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFP8RL_FUZZ=ON \
  -DFP8RL_TESTS=OFF -DFP8RL_CUDA=OFF "$@" > /dev/null
[ "${FP8RL_FUZZ_CONFIGURE_ONLY:-0}" = "1" ] && exit 0
targets=(fuzz_tokenizer fuzz_config fuzz_safetensors)
cmake --build "$dir" -j "$(nproc)" --target "${targets[@]}"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# One target per core (each libFuzzer process is single-threaded, so each has a core's worth of
# $secs); every target writes its own log, printed when it fails.
fuzz_one() {
  local t=$1 name=${1#fuzz_} log="$dir/$1.log"
  mkdir -p "$dir/corpus/$name"
  if ! (cd "$dir" && "./$t" -max_total_time="$secs" -max_len=1048576 -timeout=30 -rss_limit_mb=4096 \
          -print_final_stats=1 "corpus/$name" "../tests/fuzz/corpus/$name" > "$t.log" 2>&1); then
    cat "$log"
    echo "fuzz: $t FAILED (input saved in $dir)"
    return 1
  fi
  echo "fuzz: $t ok: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') inputs in ${secs}s"
}
par=${FP8RL_FUZZ_JOBS:-$(nproc)}
# More targets than cores: all of them at once for secs x targets / cores each, the same CPU time
# per target as one core for $secs, without a second round that leaves cores idle.
if [ "${#targets[@]}" -gt "$par" ]; then
  secs=$(((secs * ${#targets[@]} + par - 1) / par))
  par=${#targets[@]}
fi
running=0
failed=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$par" ]; then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || failed=1
  running=$((running - 1))
done
[ "$failed" = 0 ] || exit 1
