#!/usr/bin/env bash
# One GPU iteration, from the repository root on the GPU machine:
#   configure + build (Release, CUDA on, -j16), CPU tests (ctest -L cpu), GPU tests (ctest -L gpu),
#   `fp8rl logprobs --device cuda` against HF's reference.json, the 1B train-step benchmark
#   (ours bf16 / fp8 and scripts/bench_train_step_torch.py), `fp8rl bench-gemm` (--quant-only
#   with FP8RL_BENCH_GEMM=0) and its torch peer, then compute-sanitizer memcheck on a subset if
#   time is left. Steps check the time left against FP8RL_RUN_BUDGET_S (default 520 s).
# Every log and JSON goes to $OUT (first argument, or the OUT environment variable).
# If the native configure fails (a dependency missing on that machine), binaries prebuilt on
# the development machine in ./prebuilt (with their shared libraries in ./prebuilt/lib) are used:
# seen 2026-11 on the H200 image, which lacks libpcre2-8. Make them here with
# scripts/make_prebuilt.sh, then run with carry ["prebuilt", ".shared_copy"]; the compiled-in
# source paths of the tests are linked to this checkout below.
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
  note "using prebuilt binaries from the development machine (scripts/make_prebuilt.sh)"
  # The tests carry the development checkout's paths: make them resolve to this checkout.
  if [ -f prebuilt/SOURCE_DIR ]; then
    src="$(cat prebuilt/SOURCE_DIR)"
    if [ ! -e "$src" ]; then
      mkdir -p "$(dirname "$src")" && ln -s "$ROOT" "$src"
      [ -d "$ROOT/.shared_copy" ] && [ ! -e "$(dirname "$src")/shared/data" ] &&
        mkdir -p "$(dirname "$src")/shared" && ln -s "$ROOT/.shared_copy" "$(dirname "$src")/shared/data"
    fi
    [ -e "$ROOT/build/fp8rl" ] || { mkdir -p "$ROOT/build" && ln -sf "$ROOT/prebuilt/fp8rl" "$ROOT/build/fp8rl"; }
  fi
fi
[ -z "$BIN" ] && { note "no binaries: stopping"; cat "$SUMMARY"; exit 1; }

# GPU tests (the whole binary, verbose per test); FP8RL_GPU_TESTS=0 skips them.
[ "${FP8RL_GPU_TESTS:-1}" = 1 ] && timeout 200 "$BIN/fp8rl_gpu_tests" --gtest_color=no --gtest_filter="${FP8RL_GPU_TEST_FILTER:-*}" > "$OUT/gpu_tests.log" 2>&1
note "gpu tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/gpu_tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure|error' "$OUT/gpu_tests.log" | head -30 >> "$SUMMARY"
# A failing GPU sampler must not take the benchmarks' generation phase down with it.
if grep -qE "FAILED +\] CudaGeneration\.Sample" "$OUT/gpu_tests.log"; then
  export FP8RL_CUDA_SAMPLER=host; note "GPU sampler test failed: benchmarks use FP8RL_CUDA_SAMPLER=host"
fi
# A failing kernel must not take the benchmarks down with it: fall back to the reference paths.
if grep -qE "FAILED +\] Cuda(PagedAttention|Attention|Generation)\." "$OUT/gpu_tests.log"; then
  export FP8RL_CUDA_ATTENTION=grouped; note "a paged-attention/generation test failed: benchmarks use FP8RL_CUDA_ATTENTION=grouped (the kernel that passed on 2026-11-29)"
fi
if grep -qE "FAILED +\] Cuda(Graph|Rollout)\." "$OUT/gpu_tests.log"; then
  export FP8RL_CUDA_GRAPHS=0; note "a CUDA-graph test failed: benchmarks use FP8RL_CUDA_GRAPHS=0"
fi

# Where a decode step's time goes (FP8RL_PROFILE_GENERATE=1): per-op stream time of a short
# `bench generate` on the 1B shape (FP8RL_CUDA_PROFILE=1 prints the table per recipe).
if [ "${FP8RL_PROFILE_GENERATE:-0}" = 1 ] && [ "${FP8RL_CUDA_SAMPLER:-}" != host ]; then
  FP8RL_CUDA_PROFILE=1 timeout 150 "$BIN/fp8rl" bench generate --device cuda --model 1b --recipes bf16,fp8_kv \
    --gen-len 64 --json "$OUT/profile_generate.json" > "$OUT/profile_generate.log" 2>&1
  note "profile generate: rc=$?"
  grep -E "^(recipe|bf16|fp8_kv) |cuda op profile|^  [a-z_]+ +[0-9]+ calls" "$OUT/profile_generate.log" | head -60 | tee -a "$SUMMARY"
fi

# Rollout throughput (issue #6), FP8RL_BENCH_GENERATE=1: `fp8rl bench generate` (4 recipes) on
# each of FP8RL_BENCH_GENERATE_MODELS (default "1b 8b"), then the HF transformers floor
# (scripts/bench_generate_hf.py) on FP8RL_BENCH_GENERATE_HF (default "1b 8b"), each while the
# budget allows; HF shrinks its --gen-len to the time left. FP8RL_BENCH_GENERATE_WORKLOAD (e.g.
# "--prompts 64 --gen-len 256") applies to both; FP8RL_BENCH_GENERATE_ONLY=1 stops after this.
if [ "${FP8RL_BENCH_GENERATE:-0}" = 1 ] && [ "${FP8RL_CUDA_SAMPLER:-}" = host ]; then
  note "bench generate: skipped (the GPU sampler failed its test; the host sampler would only measure the host)"
elif [ "${FP8RL_BENCH_GENERATE:-0}" = 1 ]; then
  bg_left() { echo $(( ${FP8RL_RUN_BUDGET_S:-520} - ($(date +%s) - t0) )); }
  BG_WL="${FP8RL_BENCH_GENERATE_WORKLOAD:-}"
  for m in ${FP8RL_BENCH_GENERATE_MODELS:-1b 8b}; do
    if [ "$(bg_left)" -gt 90 ]; then
      timeout $(( $(bg_left) - 45 )) "$BIN/fp8rl" bench generate --device cuda --model "$m" $BG_WL \
        --json "$OUT/bench_generate_$m.json" > "$OUT/bench_generate_$m.log" 2>&1
      note "bench generate $m: rc=$?"
      grep -E "^(recipe |bf16 |fp8_)" "$OUT/bench_generate_$m.log" | tee -a "$SUMMARY"
      grep -iE "error" "$OUT/bench_generate_$m.log" | head -3 >> "$SUMMARY"
    else
      note "bench generate $m: skipped (time)"
    fi
  done
  for m in ${FP8RL_BENCH_GENERATE_HF-1b 8b}; do
    if [ "$(bg_left)" -gt 120 ]; then
      timeout $(( $(bg_left) - 15 )) env PYTHONUNBUFFERED=1 python3 scripts/bench_generate_hf.py --model "$m" $BG_WL \
        --budget-s $(( $(bg_left) - 30 )) --json "$OUT/bench_generate_hf_$m.json" > "$OUT/bench_generate_hf_$m.log" 2>&1
      note "HF generate $m: rc=$?"
      grep -E "^(engine |hf |--budget)" "$OUT/bench_generate_hf_$m.log" | tee -a "$SUMMARY"
      tail -3 "$OUT/bench_generate_hf_$m.log" | grep -iE "error" >> "$SUMMARY"
    else
      note "HF generate $m: skipped (time)"
    fi
  done
  if [ "${FP8RL_BENCH_GENERATE_ONLY:-0}" = 1 ]; then
    echo "===== summary ($(( $(date +%s) - t0 )) s) ====="
    cat "$SUMMARY"
    tar czf "$OUT_TOP/logs.tgz" -C "$OUT_TOP" logs && rm -rf "$OUT"
    exit 0
  fi
fi

# The parity experiment (issue #7), FP8RL_PARITY=1: scripts/parity.sh with the time left
# (report files in $OUT_TOP/parity: at most 6), then stop. FP8RL_PARITY_BIN: another fp8rl
# binary for it (e.g. one whose kernels already passed on the H200).
if [ "${FP8RL_PARITY:-0}" = 1 ]; then
  p_left=$(( ${FP8RL_RUN_BUDGET_S:-520} - ($(date +%s) - t0) - 15 ))
  PARITY_BUDGET_S=$p_left FP8RL_BIN="${FP8RL_PARITY_BIN:-$BIN/fp8rl}" bash scripts/parity.sh /tmp/parity_runs "$OUT_TOP/parity" \
    ${FP8RL_PARITY_OVERRIDES:-} > "$OUT/parity.log" 2>&1
  note "parity: rc=$? (budget ${p_left}s)"
  tail -40 "$OUT/parity.log"
  cat "$OUT_TOP/parity/summary.md" 2>/dev/null
  echo "===== summary ($(( $(date +%s) - t0 )) s) ====="
  cat "$SUMMARY"
  tar czf "$OUT_TOP/logs.tgz" -C "$OUT_TOP" logs && rm -rf "$OUT"
  exit 0
fi

# Reference fixtures (torch + transformers live there): FP8RL_FIXTURES=1.
if [ "${FP8RL_FIXTURES:-0}" = 1 ]; then
  timeout 240 python3 scripts/fixtures/make_fixtures.py "$OUT_TOP/fixtures" --device cpu > "$OUT/fixtures.log" 2>&1
  note "fixtures: rc=$? $(tail -1 "$OUT/fixtures.log")"
  tar czf "$OUT_TOP/fixtures.tgz" -C "$OUT_TOP" fixtures && rm -rf "$OUT_TOP/fixtures"
fi

# Tokenizer: fp8rl vs HF tokenizers, single thread, same text (FP8RL_BENCH_TOKENIZE=1).
if [ -n "${FP8RL_SHARED_DATA:-}" ] && [ "${FP8RL_BENCH_TOKENIZE:-0}" = 1 ]; then
  timeout 120 bash scripts/bench_tokenizer.sh "$BIN/fp8rl" > "$OUT/bench_tokenizer.log" 2>&1
  note "bench-tokenize: rc=$?"; grep -E "^(fp8rl|tokenizers)" "$OUT/bench_tokenizer.log" | tee -a "$SUMMARY"
fi

left() { echo $(( ${FP8RL_RUN_BUDGET_S:-520} - ($(date +%s) - t0) )); }

# `fp8rl logprobs --device cuda` against HF (reference.json): fp32 mean |diff| < 2e-4, fp8 vs
# the FP8 emulation < 1e-2, every family, every sequence.
python3 - "$BIN/fp8rl" > "$OUT/logprobs_cli.log" 2>&1 <<'PY'
import json, subprocess, sys
ref = json.load(open("tests/data/fixtures/reference.json"))
ok = True
for fam, m in ref["models"].items():
    for prec, key, tol in (("fp32", "fp32", 2e-4), ("fp8", "fp8", 1e-2)):
        for s, ids in enumerate(m["sequences"]):
            cmd = [sys.argv[1], "logprobs", "--device", "cuda", "--model", "tests/data/fixtures/" + m["dir"],
                   "--ids", " ".join(map(str, ids)), "--precision", prec]
            got = [float(v) for v in subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()]
            want = m["logprobs"][key][s]
            mad = sum(abs(a - b) for a, b in zip(got, want)) / len(want)
            good = len(got) == len(want) and mad < tol
            ok &= good
            print(f"{fam} {prec} seq {s}: mean |diff| {mad:.3e} (< {tol}) {'ok' if good else 'FAIL'}")
print("logprobs cli:", "PASS" if ok else "FAIL")
PY
note "logprobs --device cuda vs HF: rc=$? $(tail -1 "$OUT/logprobs_cli.log")"
grep -E "FAIL" "$OUT/logprobs_cli.log" | head -5 >> "$SUMMARY"

# Train step, Llama-3.2-1B shape (qwen3-style tiny config: q/k-norm, tied embeddings), 8 x 2048
# tokens: ours (bf16, fp8 = fp8_e2e) and PyTorch eager BF16. --prompt-len 2040 keeps the
# generation phase to a 2040-token prefill + 8 decode steps.
SHAPE1B="--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --vocab 128256 --seqs 8 --seq-len 2048 --prompt-len 2040 --repeats 3"
for prec in bf16 fp8; do
  if [ "${FP8RL_BENCH_TRAIN:-1}" = 1 ] && [ "$(left)" -gt 100 ]; then
    timeout $(( $(left) - 60 > 150 ? 150 : $(left) - 60 )) "$BIN/fp8rl" bench-train-step --device cuda --precision $prec $SHAPE1B \
      --json "$OUT/bench_train_$prec.json" > "$OUT/bench_train_$prec.log" 2>&1
    note "bench-train-step $prec: rc=$?"; grep -E "^(score|train_step|generate) " "$OUT/bench_train_$prec.log" | tee -a "$SUMMARY"
    grep -iE "error|fail" "$OUT/bench_train_$prec.log" | head -3 >> "$SUMMARY"
  else
    note "bench-train-step $prec: skipped (time)"
  fi
  if [ "$prec" = bf16 ] && [ "$(left)" -gt 80 ]; then
    [ "${FP8RL_BENCH_TRAIN:-1}" = 1 ] && timeout 110 env PYTHONUNBUFFERED=1 python3 scripts/bench_train_step_torch.py --json "$OUT/bench_train_torch.json" \
      > "$OUT/bench_train_torch.log" 2>&1
    note "torch train step: rc=$? $(grep -E 'median' "$OUT/bench_train_torch.log")"
    tail -3 "$OUT/bench_train_torch.log" | grep -iE "error" >> "$SUMMARY"
  fi
done

# Quantizers (memory-bound) always; GEMMs unless FP8RL_BENCH_GEMM=0.
QONLY=""; [ "${FP8RL_BENCH_GEMM:-1}" = 1 ] || QONLY="--quant-only"
timeout 120 "$BIN/fp8rl" bench-gemm $QONLY --json "$OUT/bench_gemm.json" > "$OUT/bench_gemm.log" 2>&1
note "bench-gemm $QONLY: rc=$?"; grep -E "copy|quant" "$OUT/bench_gemm.log" | tee -a "$SUMMARY"
[ "${FP8RL_BENCH_GEMM:-1}" = 1 ] && timeout 300 env PYTHONUNBUFFERED=1 python3 scripts/bench_gemm_torch.py --json "$OUT/bench_torch.json" \
  > "$OUT/bench_torch.log" 2>&1 && note "torch gemm peer: rc=$?"

# CPU tests (after the GPU work: they have CI; here they only check the binaries run)
if [ "$BIN" = "$ROOT/build-gpu" ]; then
  (cd build-gpu && timeout $(( $(left) > 150 ? 120 : 30 )) ctest -L cpu -j8 --output-on-failure) > "$OUT/ctest_cpu.log" 2>&1
  note "cpu tests: $(grep -E 'tests passed|tests failed' "$OUT/ctest_cpu.log" | tail -1)"
elif [ -x "$BIN/fp8rl_tests" ]; then
  timeout $(( $(left) > 150 ? 120 : 30 )) "$BIN/fp8rl_tests" > "$OUT/ctest_cpu.log" 2>&1
  note "cpu tests (prebuilt): $(grep -E '^\[  (PASSED|FAILED)' "$OUT/ctest_cpu.log" | tr '\n' ' ')"
fi

# Memory checker on the fast parity tests, if time is left.
if command -v compute-sanitizer > /dev/null && [ "$(left)" -gt 100 ]; then
  timeout $(( $(left) - 30 )) compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/fp8rl_gpu_tests" \
    --gtest_filter='CudaQuant.*:CudaOps.*:CudaAttention.*:CudaGeneration.*' > "$OUT/memcheck.log" 2>&1
  note "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
fi

echo
echo "===== bench-gemm ====="
cat "$OUT/bench_gemm.log"
echo "===== model parity (printed by the GPU tests) ====="
grep -E "^  (fixture|sharp|HF)" "$OUT/gpu_tests.log" | head -150
echo "===== train step ====="
cat "$OUT"/bench_train_*.log 2>/dev/null | grep -vE "^$" | tail -30
echo "===== summary ($(( $(date +%s) - t0 )) s) ====="
cat "$SUMMARY"
tar czf "$OUT_TOP/logs.tgz" -C "$OUT_TOP" logs && rm -rf "$OUT"
