#!/usr/bin/env bash
# One GPU iteration, from the repository root on the GPU machine:
#   configure + build (Release, CUDA on, -j16), CPU tests (ctest -L cpu), GPU tests (ctest -L gpu,
#   then compute-sanitizer memcheck on a subset), `fp8rl bench-gemm`, the torch peer script.
# Every log and JSON goes to $OUT (first argument, or the OUT environment variable).
# If the native configure fails (a dependency missing on that machine), binaries prebuilt on
# the development machine in ./prebuilt (with their shared libraries in ./prebuilt/lib) are used:
# seen 2026-11 on the H200 image, which lacks libpcre2-8. Make them here with
#   cmake -S . -B build -G Ninja && ninja -C build -j2 fp8rl fp8rl_gpu_tests fp8rl_tests
#   mkdir -p prebuilt && cp build/fp8rl build/fp8rl_gpu_tests build/fp8rl_tests prebuilt/
# (they link only libcudart/libcublasLt 13 and libstdc++ dynamically).
set -u
OUT_TOP="${1:-${OUT:-$PWD/gpu_out}}"
# Logs go to $OUT_TOP/logs and are packed into $OUT_TOP/logs.tgz at the end (the device tool
# brings back at most 8 files); summary.txt stays beside it.
OUT="$OUT_TOP/logs"
mkdir -p "$OUT"
ROOT="$PWD"
SUMMARY="$OUT_TOP/summary.txt"
# shared/data does not travel to the GPU machine: a copy can be carried in .shared_copy.
[ -d .shared_copy ] && export FP8RL_SHARED_DATA="$ROOT/.shared_copy"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
t0=$(date +%s)

{ nvidia-smi; nvcc --version; cmake --version | head -1; python3 -c 'import torch; print("torch", torch.__version__)'; } \
  > "$OUT/env.log" 2>&1
note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
note "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"

BIN=""
if cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8RL_CUDA=ON > "$OUT/configure.log" 2>&1; then
  if ninja -C build-gpu -j16 > "$OUT/build.log" 2>&1; then
    BIN="$ROOT/build-gpu"
    note "build: native OK ($(( $(date +%s) - t0 )) s)"
  else
    note "build: native FAILED (see build.log):"
    grep -E "error|FAILED" "$OUT/build.log" | head -20 | tee -a "$SUMMARY"
  fi
else
  note "configure: native FAILED (missing dependency?), tail of configure.log:"
  tail -5 "$OUT/configure.log" | tee -a "$SUMMARY"
fi
if [ -z "$BIN" ] && [ -x prebuilt/fp8rl_gpu_tests ]; then
  BIN="$ROOT/prebuilt"
  export LD_LIBRARY_PATH="$ROOT/prebuilt/lib:${LD_LIBRARY_PATH:-}"
  note "using prebuilt binaries from the development machine"
fi
[ -z "$BIN" ] && { note "no binaries: stopping"; cat "$SUMMARY"; exit 1; }

# Reference fixtures (torch + transformers live there): FP8RL_FIXTURES=1.
if [ "${FP8RL_FIXTURES:-0}" = 1 ]; then
  timeout 240 python3 scripts/fixtures/make_fixtures.py "$OUT_TOP/fixtures" --device cpu > "$OUT/fixtures.log" 2>&1
  note "fixtures: rc=$? $(tail -1 "$OUT/fixtures.log")"
  tar czf "$OUT_TOP/fixtures.tgz" -C "$OUT_TOP" fixtures && rm -rf "$OUT_TOP/fixtures"
fi

# Tokenizer: fp8rl vs HF tokenizers, single thread, same text.
if [ -n "${FP8RL_SHARED_DATA:-}" ]; then
  timeout 120 bash scripts/bench_tokenizer.sh "$BIN/fp8rl" > "$OUT/bench_tokenizer.log" 2>&1
  note "bench-tokenize: rc=$?"; grep -E "^(fp8rl|tokenizers)" "$OUT/bench_tokenizer.log" | tee -a "$SUMMARY"
fi

# CPU tests
if [ "$BIN" = "$ROOT/build-gpu" ]; then
  (cd build-gpu && timeout 300 ctest -L cpu -j8 --output-on-failure) > "$OUT/ctest_cpu.log" 2>&1
  note "cpu tests: $(grep -E 'tests passed|tests failed' "$OUT/ctest_cpu.log" | tail -1)"
elif [ -x "$BIN/fp8rl_tests" ]; then
  timeout 300 "$BIN/fp8rl_tests" > "$OUT/ctest_cpu.log" 2>&1
  note "cpu tests (prebuilt): $(grep -E '^\[  (PASSED|FAILED)' "$OUT/ctest_cpu.log" | tr '\n' ' ')"
fi

# GPU tests (the whole binary, verbose per test)
timeout 400 "$BIN/fp8rl_gpu_tests" --gtest_color=no > "$OUT/gpu_tests.log" 2>&1
note "gpu tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/gpu_tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure|error' "$OUT/gpu_tests.log" | head -30 >> "$SUMMARY"

# Benchmarks (FP8RL_BENCH_GEMM=0 skips the GEMM ones)
[ "${FP8RL_BENCH_GEMM:-1}" = 1 ] && timeout 300 "$BIN/fp8rl" bench-gemm --json "$OUT/bench_gemm.json" > "$OUT/bench_gemm.log" 2>&1
note "bench-gemm: rc=$?"
[ "${FP8RL_BENCH_GEMM:-1}" = 1 ] && timeout 300 env PYTHONUNBUFFERED=1 python3 scripts/bench_gemm_torch.py --json "$OUT/bench_torch.json" \
  > "$OUT/bench_torch.log" 2>&1
note "torch peer: rc=$?"

# Memory checker on the fast parity tests, if time is left.
if command -v compute-sanitizer > /dev/null && [ $(( $(date +%s) - t0 )) -lt 330 ]; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/fp8rl_gpu_tests" \
    --gtest_filter='CudaQuant.*:CudaOps.*:CudaAttention.*:CudaGeneration.*' > "$OUT/memcheck.log" 2>&1
  note "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
fi

echo
echo "===== bench-gemm ====="
cat "$OUT/bench_gemm.log"
echo "===== torch peer (table) ====="
grep -E "TFLOP/s" "$OUT/bench_torch.log"
grep -A3 '"errors"' "$OUT/bench_torch.json" 2>/dev/null | head -5
echo "===== summary ($(( $(date +%s) - t0 )) s) ====="
cat "$SUMMARY"
tar czf "$OUT_TOP/logs.tgz" -C "$OUT_TOP" logs && rm -rf "$OUT"
