#!/usr/bin/env bash
# One GPU iteration on the H200 machine, from the repository root (device tool: carry [".gpu"],
# a copy of ../shared/gpu). Builds natively into /tmp/fp8rl-build (kept while the machine stays
# warm), runs the GPU tests (FP8RL_GPU_TEST_FILTER, default all), then the stages listed in
# FP8RL_STAGES (space-separated, default "rlstep"):
#   rlstep          fp8rl bench rl-step on FP8RL_RLSTEP_MODEL (qwen3-1.7b): bf16, fp8_gen, fp8_e2e,
#                   16 prompts x 16 samples x FP8RL_RLSTEP_NEW (512) new tokens, ragged
#   rlstep_x<N>     an extra bench rl-step with FP8RL_RLSTEP_X<N>_ARGS under the env FP8RL_RLSTEP_X<N>_ENV
#   rlstep_narrow   rlstep with FP8RL_FP8_GEMM=auto FP8RL_FP8_GEMM_BN=64 (the own kernel's 64-column tiles
#                   for the decode products it prefers); skipped when the CudaFp8Gemm tests failed
#   rlstep_attnq    rlstep with FP8RL_CUDA_ATTN_FP8_OUT=1 (the decode attention writes o's FP8 input itself)
#   rlstep_rowinv   bench rl-step with FP8RL_FP8_ROW_INVARIANT=1 (cuBLASLt's FP8 products on one
#                   algorithm per N, K for every M): bf16, fp8_e2e, fp8_e2e:consistent=attn,
#                   fp8_e2e:consistent=on (the mismatch of consistent attention + row-invariant
#                   cuBLASLt linears, and what the no-split-K decode products cost)
#   rlstep_own      rlstep with the own sm_90a FP8 GEMM (FP8RL_FP8_GEMM=own); skipped when the
#                   CudaFp8Gemm tests failed
#   mismatch_own    the mismatch of FP8 linears over BF16 KV (and of fp8_e2e with the trainer's KV
#                   rounding) with the default GEMM choice and with every FP8 product on the own
#                   kernel at one split (row-invariant: both engines compute each row alike)
#   gemm            fp8rl bench-gemm: BF16, cuBLASLt FP8 and the own FP8 kernel at 8B and 1.7B widths
#   gemm_sk         bench-gemm at the decode products (FP8RL_SK_SHAPES: the 1.7B's at M = 256, 128, 64 and the
#                   8B's at M = 256) with FP8RL_FP8_GEMM_STREAMK=1: the own
#                   kernel's column is its stream-K form (its "tile ms" too: stream-K sizes its own grid), beside
#                   cuBLASLt's FP8 (tuned) and BF16 and the own kernel's split configs
#   gemm_algos      bench-gemm --algos at the 1.7B products (FP8RL_ALGO_SHAPES): every cuBLASLt candidate timed
#   lt_search       bench-gemm --lt-search at the 1.7B decode products (FP8RL_LT_SHAPES): every configuration
#                   (tile, stages, split-K, cluster) of cuBLASLt's first algorithm timed, BF16 and FP8
#   rlstep_profile  one step of FP8RL_PROFILE_RECIPES (bf16,fp8_e2e) with FP8RL_CUDA_PROFILE=${FP8RL_PROFILE_LEVEL:-1}
#                   (extra bench arguments: FP8RL_PROFILE_ARGS; env assignments for it alone:
#                   FP8RL_PROFILE_ENV, e.g. "FP8RL_CUDA_GRAPHS=0") (2: the
#                   linear ops split into quantizers, transposes and GEMMs; per-op stream time per
#                   recipe and phase; with FP8RL_CUDA_GRAPHS=0 the decode step's ops are split too)
#   tests_x<N>      the GPU tests FP8RL_TESTS_X<N>_FILTER under the env FP8RL_TESTS_X<N>_ENV (timeout FP8RL_TESTS_X_TIMEOUT, 300 s)
#   grouped         bench-gemm --grouped-only: the grouped FP8 expert GEMM against a dense FP8 GEMM of equal FLOPs
#   fast_accum      bench-gemm --fast-accum at FP8RL_FAST_ACCUM_SHAPES: cuBLASLt FP8 with fast accumulation, time and diff
#   mma_probe       bench-gemm --mma-probe: TFLOP/s of each E4M3 wgmma issue pattern on shared-memory tiles
#                   filled once (no TMA, no epilogue) against the dense FP8 peak: the MMA issue ceiling (~1 s)
#   rlstep_long     bench rl-step, bf16 and fp8_e2e, one step of up to 2048 new tokens (FP8RL_RLSTEP_LONG_ARGS:
#                   more arguments, default --warmup 0)
#   trainstep       fp8rl bench-train-step at the Llama-3.2-1B shape, bf16 and fp8, and PyTorch eager
#   trainstep_8b    fp8rl bench-train-step at the Llama-3.1-8B width (8 blocks, full vocabulary), bf16 and fp8
#   memory          bench rl-step with 32k-token micro-batches and kl_beta 0.01, recompute none and
#                   block: measured peak against the memory plan of the same setup (issue 15)
#   kernels         the tensor-core paged decode attention (old vs new, GB/s) and the sampler alone
#   flash_orders    DecodeBench's flash-order decode rows under FP8RL_FLASH_ORDER=online, merge_coop and merge
#                   (the tile-merge order's cooperative and tile-parallel decodes against the online order's)
#   pick_paged      after kernels: exports FP8RL_PAGED_VARIANT = the fastest passing tensor-core variant
#                   (least summed time over DecodeBench's Qwen3-1.7B rows) for the later stages
#   ncu_flash_decode  Nsight Compute on the flash-order decode (E4M3, Qwen3-1.7B B = 256) in each order
#                   (FP8RL_NCU_FLASH_ORDERS: online merge): warp states and SASS stall samples (issue 11)
#   query_runs      the consistent trainer's attention (query runs of 8 / 16 columns) vs flash attention's
#                   forward, one 8k-token micro-batch at the 1.7B heads (issue 11)
#   ncu_query_runs  Nsight Compute's source page of that query-run kernel (FP8RL_NCU_QUERY_COLS: 8, 16, 64)
#   ncu_paged_src   Nsight Compute's source page of the default decode kernel (paged_mmat_kernel), BF16 and E4M3:
#                   stall samples and executed instructions per SASS opcode
#   ncu_paged       Nsight Compute on the default tensor-core paged decode kernel (paged_mmat_kernel; BF16 and
#                   E4M3 pools, the first DecodeBench shape): speed of light, occupancy and waves, warp stalls,
#                   instruction mix
#   gemm_variants   bench-gemm --shapes (FP8RL_GEMM_SHAPES) and --grouped-only for each cluster:scales:ctas[:band[:store]]
#                   variant of the own FP8 GEMM in FP8RL_GEMM_VARIANTS (e.g. 1x1:smem:2)
#   ncu_gemm        Nsight Compute on one launch of the own FP8 GEMM per product of FP8RL_NCU_GEMM
#                   (MxNxK, or "grouped"): speed of light, pipes, memory, warp stalls; the first launch
#                   whose demangled name matches FP8RL_NCU_GEMM_KERNEL (default fp8_gemm_kernel; the
#                   stream-K instances: 'fp8_gemm_kernel<[^>]*, true>' with
#                   FP8RL_NCU_GEMM_ENV="FP8RL_FP8_GEMM_STREAMK=1", env assignments for this stage alone)
#   ncu_gemm_src    Nsight Compute's source page of the same launches: stall samples per SASS instruction
#                   (ncu_src_<product>.csv; the top 40 in the summary)
#   ncu_train       Nsight Compute speed of light of the training step's element-wise kernels and
#                   attention (one launch each, FP8RL_NCU_TRAIN_KERNELS regex; 2 blocks of FP8RL_RLSTEP_MODEL)
#   ncu_decode      Nsight Compute times every kernel of ~3 graph-replayed decode steps (bench generate,
#                   FP8RL_RLSTEP_MODEL, B = 256) for FP8RL_NCU_RECIPES (recipe:launches-to-skip, default
#                   bf16:12000 fp8_linear:20000 fp8_kv:20000): the decode step's per-kernel profile with
#                   graphs on (scripts/ncu_kernel_sum.py sums the whole decode-only steps of 256 rows)
#   trainstep_profile  FP8RL_CUDA_PROFILE=1 train steps (bf16, fp8) at that shape: the per-op table
#   generate        fp8rl bench generate --model 1b (four recipes)
#   generate_x<N>   an extra bench generate on FP8RL_GENERATE_X<N>_MODEL (1b) with FP8RL_GENERATE_X<N>_ARGS under
#                   the env FP8RL_GENERATE_X<N>_ENV
#   rlstep_kl       bench rl-step with the frozen KL reference policy (kl_beta 0.01): its memory and time
#   rlstep_8b       issue 15: bench rl-step at the Llama-3.1-8B shape, 16 prompts x 16 samples x 1024 new
#                   tokens, kl_beta 0.01, 1 optimizer step, 3 GRPO steps, fp8_e2e then bf16, with what the
#                   plan needs to fit one H200 (recompute auto, BF16 gradients and Adam moments, 8k-token
#                   micro-batches); a recipe whose plan does not fit (bf16) is refused with its shortfall
#                   (rlstep_8b.log, rlstep_8b.json "refused"). Several minutes: give it the run alone
#                   (FP8RL_STAGES=rlstep_8b FP8RL_GPU_TESTS=0)
#   multiblock      transformers-made multi-block FP8 fixtures vs fp8rl on CPU and CUDA (issue 11)
#   export          fp8rl's FP8-block export loaded by transformers, logprobs compared (issue 17)
#   moe_rlstep      issue 16: bench rl-step at Qwen3-30B-A3B width cut to FP8RL_MOE_LAYERS (12) blocks,
#                   bf16 and fp8_e2e in one run, 16 prompts x 16 samples x FP8RL_MOE_NEW (256) new tokens,
#                   BF16 gradients and Adam moments, 8k-token micro-batches (the plan: 12 layers fit one
#                   H200 so in both recipes without recomputation, 125.3 / 110.1 GiB of 135; check with
#                   `fp8rl bench rl-step ... --plan-only --free-gib 135 --device cuda`)
#   moe_generate    issue 16: bench generate at Qwen3-30B-A3B (all FP8RL_MOE_GEN_LAYERS = 48 blocks),
#                   bf16 vs fp8_linear vs fp8_attn (full FP8), 256 prompts x 256 tokens + 512 new (the
#                   BF16 KV of all 256 at once, 18 GiB, fits beside master + generator: 2 x 56.9 GiB)
#   moe_trainstep   issue 16: bench-train-step at Qwen3-30B-A3B width (FP8RL_MOE_TRAIN_LAYERS = 6 blocks, BF16
#                   gradients (FP8RL_MOE_TRAIN_GRAD=fp32: the experts' BF16 products staged into F32),
#                   full vocabulary), bf16 vs fp8, 8 x 2048 tokens; its plan: --plan-only
#   mismatch        issue 11's split of token_mult_prob_error by component (one step, 256 new tokens):
#                   bf16; FP8 generator linears alone; FP8 linears in both engines over BF16 KV;
#                   + E4M3 KV (fp8_e2e); + the trainer rounding k/v as the E4M3 cache (tkv=e4m3);
#                   FP8RL_MISMATCH_TEMPERATURE=T adds a run at sampling temperature T (lower entropy)
# Logs and JSON go to $OUT (first argument or $OUT); summary.txt is the short version.
set -u
OUT="${1:-${OUT:-$PWD/gpu_out}}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
t0=$(date +%s)
left() { echo $(( ${FP8RL_RUN_BUDGET_S:-560} - ($(date +%s) - t0) )); }

note "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)"
note "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
[ -f .gpu/deps-env.sh ] && source .gpu/deps-env.sh
B=/tmp/fp8rl-build
if ! { cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8RL_CUDA=ON > "$OUT/configure.log" 2>&1 &&
       ninja -C $B -j16 fp8rl fp8rl_gpu_tests > "$OUT/build.log" 2>&1; }; then
  note "build FAILED:"; grep -E "error|FAILED" "$OUT/configure.log" "$OUT/build.log" | head -20 | tee -a "$SUMMARY"; exit 1
fi
note "build: OK ($(( $(date +%s) - t0 )) s)"
FP8RL="$B/fp8rl"

if [ "${FP8RL_GPU_TESTS:-1}" = 1 ]; then
  timeout "${FP8RL_GPU_TEST_TIMEOUT:-300}" "$B/fp8rl_gpu_tests" --gtest_color=no --gtest_filter="${FP8RL_GPU_TEST_FILTER:-*}" > "$OUT/gpu_tests.log" 2>&1
  note "gpu tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/gpu_tests.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$OUT/gpu_tests.log" | head -20 >> "$SUMMARY"
  # A failing tensor-core paged-attention kernel must not feed the benchmarks: fall back, say so.
  grep -qE '^\[  FAILED  \] CudaFp8Gemm|^\[ fp8 gemm \].*deadlocked' "$OUT/gpu_tests.log" && { OWN_GEMM_BROKEN=1; note "own FP8 GEMM tests FAILED"; }
  if grep -qE '^\[  FAILED  \] CudaPagedAttention' "$OUT/gpu_tests.log"; then
    # A failing variant of the tensor-core kernel (its trace names it) is never picked (stage
    # pick_paged); a failing original kernel sends every benchmark to the tiled kernel.
    PAGED_BAD=$(grep -oE 'variant [a-z0-9-]+' "$OUT/gpu_tests.log" | sort -u | awk '{print $2}' | tr '\n' ' ')
    case " $PAGED_BAD " in *" orig "*) export FP8RL_CUDA_ATTENTION=tiled; note "paged attention tests FAILED (orig): benchmarks run with FP8RL_CUDA_ATTENTION=tiled" ;; esac
    note "paged attention tests FAILED; variants in failure traces: $PAGED_BAD"
  fi
fi

# Nsight Compute on the first launch whose name matches $2 in the GPU test $4 (under the env assignments
# $5...): speed of light, warp states, and the SASS with its stall samples and executed instructions by
# opcode (scripts/ncu_sass_top.py, the top $3 instructions). Files: $OUT/ncu_$1.{log,csv}.
ncu_source() {
  local tag=$1 kern=$2 top=$3 filter=$4; shift 4
  env "$@" timeout 150 ncu --clock-control none -k "regex:$kern" -c 1 \
    --section SourceCounters --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section InstructionStats --section LaunchStats --import-source no -f -o "$OUT/ncu_$tag" \
    "$B/fp8rl_gpu_tests" --gtest_color=no --gtest_filter="$filter" > "$OUT/ncu_$tag.log" 2>&1
  note "ncu $tag ($*): rc=$?"
  ncu -i "$OUT/ncu_$tag.ncu-rep" --page details --print-details all 2>&1 | \
    grep -E "$kern|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|SM Active Cycles|Elapsed Cycles|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|Executed Ipc A|Block Limit|Grid Size|Stall" | head -48 | tee -a "$SUMMARY"
  ncu -i "$OUT/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_$tag.csv" 2>&1
  python3 scripts/ncu_sass_top.py "$OUT/ncu_$tag.csv" "$top" 2>&1 | tee -a "$SUMMARY"
  rm -f "$OUT/ncu_$tag.ncu-rep"
}

for stage in ${FP8RL_STAGES:-rlstep}; do
  [ "$(left)" -lt 40 ] && { note "$stage: skipped (time)"; continue; }
  case $stage in
    rlstep)
      timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
        --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" ${FP8RL_RLSTEP_ARGS:-} --json "$OUT/rlstep.json" > "$OUT/rlstep.log" 2>&1
      note "bench rl-step: rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep.log" | tee -a "$SUMMARY"
      grep -iE "error|warning" "$OUT/rlstep.log" | head -5 | tee -a "$SUMMARY" ;;
    rlstep_x*)  # an extra bench rl-step: FP8RL_<STAGE>_ARGS (e.g. FP8RL_RLSTEP_X1_ARGS) after the model and
      # new-token options, under the env assignments FP8RL_<STAGE>_ENV (e.g. "FP8RL_CONSISTENT_LT_ROWS=1")
      up=$(echo "$stage" | tr a-z A-Z); xargs_var="FP8RL_${up}_ARGS"; xenv_var="FP8RL_${up}_ENV"
      case "${!xenv_var:-}" in *FP8RL_FP8_GEMM*)  # the own kernel failed its tests: no run on it
        if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "$stage: skipped (CudaFp8Gemm failed)"; continue; fi ;; esac
      env ${!xenv_var:-} timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda \
        --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" ${!xargs_var:-} \
        --json "$OUT/$stage.json" > "$OUT/$stage.log" 2>&1
      note "bench rl-step ($stage: ${!xenv_var:-} ${!xargs_var:-}): rc=$?"; sed -n '/^phase/,$p' "$OUT/$stage.log" | tee -a "$SUMMARY"
      grep -iE "error|warning" "$OUT/$stage.log" | head -5 | tee -a "$SUMMARY" ;;
    rlstep_narrow)  # bench rl-step with the decode products the own kernel prefers (FP8RL_FP8_GEMM=auto) on
      # 64-column tiles (FP8RL_FP8_GEMM_BN=64): bf16 and fp8_e2e side by side
      if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "rlstep_narrow: skipped (CudaFp8Gemm failed)"; continue; fi
      FP8RL_FP8_GEMM=auto FP8RL_FP8_GEMM_BN=64 timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda \
        --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" ${FP8RL_RLSTEP_ARGS:-} \
        --json "$OUT/rlstep_narrow.json" > "$OUT/rlstep_narrow.log" 2>&1
      note "bench rl-step (auto FP8 GEMM, 64-column tiles): rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep_narrow.log" | tee -a "$SUMMARY"
      grep -iE "error|warning" "$OUT/rlstep_narrow.log" | head -5 | tee -a "$SUMMARY" ;;
    rlstep_attnq)  # bench rl-step with the decode attention writing its output's FP8 copy itself
      FP8RL_CUDA_ATTN_FP8_OUT=1 timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda \
        --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" ${FP8RL_RLSTEP_ARGS:-} \
        --json "$OUT/rlstep_attnq.json" > "$OUT/rlstep_attnq.log" 2>&1
      note "bench rl-step (FP8RL_CUDA_ATTN_FP8_OUT=1): rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep_attnq.log" | tee -a "$SUMMARY"
      grep -iE "error|warning" "$OUT/rlstep_attnq.log" | head -5 | tee -a "$SUMMARY" ;;
    rlstep_rowinv)  # row-invariant cuBLASLt FP8 products in both engines (issue 11)
      FP8RL_FP8_ROW_INVARIANT=1 timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda \
        --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" \
        --recipes "${FP8RL_ROWINV_RECIPES:-bf16,fp8_e2e,fp8_e2e:consistent=attn,fp8_e2e:consistent=on}" --steps 1 --warmup 1 \
        --json "$OUT/rlstep_rowinv.json" > "$OUT/rlstep_rowinv.log" 2>&1
      note "bench rl-step (FP8RL_FP8_ROW_INVARIANT=1): rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep_rowinv.log" | tee -a "$SUMMARY"
      grep -iE "error|warning" "$OUT/rlstep_rowinv.log" | head -5 | tee -a "$SUMMARY" ;;
    rlstep_own)
      if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "rlstep_own: skipped (CudaFp8Gemm failed)"; continue; fi
      FP8RL_FP8_GEMM=own timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda \
        --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" ${FP8RL_RLSTEP_ARGS:-} \
        --json "$OUT/rlstep_own.json" > "$OUT/rlstep_own.log" 2>&1
      note "bench rl-step (own FP8 GEMM): rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep_own.log" | tee -a "$SUMMARY"
      grep -iE "error|warning" "$OUT/rlstep_own.log" | head -5 | tee -a "$SUMMARY" ;;
    mismatch_own)
      for mode in auto own1; do
        envs="FP8RL_FP8_GEMM=auto"; [ $mode = own1 ] && envs="FP8RL_FP8_GEMM=own FP8RL_FP8_GEMM_SPLITS=1"
        env $envs timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
          --recipes bf16,fp8_e2e:kv=bf16,fp8_e2e:tkv=e4m3 --max-new-tokens 256 --steps 1 \
          --json "$OUT/mismatch_$mode.json" > "$OUT/mismatch_$mode.log" 2>&1
        note "mismatch ($envs): rc=$?"; sed -n '/^phase/,$p' "$OUT/mismatch_$mode.log" | grep -iE "phase|^step|mult_prob|gen_kl|own" | tee -a "$SUMMARY"
      done ;;
    gemm)
      if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "gemm: skipped (CudaFp8Gemm failed)"; continue; fi
      timeout 200 "$FP8RL" bench-gemm --json "$OUT/bench_gemm.json" > "$OUT/bench_gemm.log" 2>&1
      note "bench-gemm: rc=$?"; sed -n '/^linear/,$p' "$OUT/bench_gemm.log" | tee -a "$SUMMARY" ;;
    gemm_sk)  # issue 14: the own FP8 GEMM as stream-K at the decode products, beside cuBLASLt
      if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "gemm_sk: skipped (CudaFp8Gemm failed)"; continue; fi
      FP8RL_FP8_GEMM_STREAMK=1 timeout 150 "$FP8RL" bench-gemm --shapes \
        "${FP8RL_SK_SHAPES:-256x4096x2048,256x2048x2048,256x12288x2048,256x2048x6144,128x4096x2048,128x2048x6144,64x12288x2048,256x6144x4096,256x4096x4096,256x28672x4096,256x4096x14336}" \
        > "$OUT/gemm_sk.log" 2>&1
      note "bench-gemm, the own kernel as stream-K: rc=$?"; sed -n '/^linear/,$p' "$OUT/gemm_sk.log" | tee -a "$SUMMARY" ;;
    gemm_algos)  # every cuBLASLt heuristic candidate (BF16 and FP8) of the 1.7B products, decode and training M
      timeout $(( $(left) - 20 )) "$FP8RL" bench-gemm --algos --json "$OUT/gemm_algos.json" --shapes \
        "${FP8RL_ALGO_SHAPES:-256x4096x2048,256x2048x2048,256x12288x2048,256x2048x6144,128x2048x6144,64x12288x2048,8192x12288x2048,8192x2048x6144}" \
        > "$OUT/gemm_algos.log" 2>&1
      note "bench-gemm --algos: rc=$?"; grep -E "^(linear|--shapes)|candidate" "$OUT/gemm_algos.log" | tee -a "$SUMMARY" ;;
    lt_search)  # every configuration cuBLASLt accepts of its first algorithm (BF16 and FP8), the 1.7B products
      timeout $(( $(left) - 20 )) "$FP8RL" bench-gemm --lt-search --json "$OUT/lt_search.json" --shapes \
        "${FP8RL_LT_SHAPES:-256x4096x2048,256x2048x2048,256x12288x2048,256x2048x6144,128x4096x2048,128x12288x2048}" \
        > "$OUT/lt_search.log" 2>&1
      note "bench-gemm --lt-search: rc=$?"; grep -E "^(linear|--shapes)|lt-search|#[0-9]" "$OUT/lt_search.log" | tee -a "$SUMMARY" ;;
    mismatch)
      timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
        --recipes "${FP8RL_MISMATCH_RECIPES:-bf16,fp8_gen:kv=bf16,fp8_e2e:kv=bf16,fp8_e2e,fp8_e2e:tkv=e4m3}" \
        --max-new-tokens 256 --steps 1 --json "$OUT/mismatch.json" > "$OUT/mismatch.log" 2>&1
      note "mismatch by component: rc=$?"; sed -n '/^phase/,$p' "$OUT/mismatch.log" | grep -iE "phase|mult_prob|gen_kl|entropy" | tee -a "$SUMMARY"
      if [ -n "${FP8RL_MISMATCH_TEMPERATURE:-}" ]; then
        timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
          --recipes bf16,fp8_e2e,fp8_e2e:tkv=e4m3 --temperature "$FP8RL_MISMATCH_TEMPERATURE" \
          --max-new-tokens 256 --steps 1 > "$OUT/mismatch_t.log" 2>&1
        note "mismatch at temperature $FP8RL_MISMATCH_TEMPERATURE: rc=$?"
        sed -n '/^phase/,$p' "$OUT/mismatch_t.log" | grep -iE "phase|mult_prob|gen_kl|entropy" | tee -a "$SUMMARY"
      fi ;;
    rlstep_profile)
      env ${FP8RL_PROFILE_ENV:-} FP8RL_CUDA_PROFILE=${FP8RL_PROFILE_LEVEL:-1} timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda \
        --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --recipes "${FP8RL_PROFILE_RECIPES:-bf16,fp8_e2e}" --steps 1 --warmup 1 \
        --max-new-tokens "${FP8RL_RLSTEP_NEW:-512}" ${FP8RL_PROFILE_ARGS:-} > "$OUT/rlstep_profile.log" 2>&1
      note "bench rl-step (profile, ${FP8RL_PROFILE_ENV:-} FP8RL_CUDA_GRAPHS=${FP8RL_CUDA_GRAPHS:-1}): rc=$?"
      grep -A${FP8RL_PROFILE_LINES:-12} "cuda op profile" "$OUT/rlstep_profile.log" | tee -a "$SUMMARY" ;;
    tests_x*)  # the GPU tests FP8RL_<STAGE>_FILTER under the env assignments FP8RL_<STAGE>_ENV
      up=$(echo "$stage" | tr a-z A-Z); tf_var="FP8RL_${up}_FILTER"; tenv_var="FP8RL_${up}_ENV"
      case "${!tenv_var:-}" in *FP8RL_FP8_GEMM*)
        if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "$stage: skipped (CudaFp8Gemm failed)"; continue; fi ;; esac
      env ${!tenv_var:-} timeout "${FP8RL_TESTS_X_TIMEOUT:-300}" "$B/fp8rl_gpu_tests" --gtest_color=no \
        --gtest_filter="${!tf_var:-*}" \
        > "$OUT/$stage.log" 2>&1
      note "gpu tests ($stage: ${!tenv_var:-}): rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$stage.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED|Failure' "$OUT/$stage.log" | head -20 >> "$SUMMARY" ;;
    grouped)  # issue 16: the grouped FP8 expert GEMM (Qwen3-30B-A3B shapes, 16k tokens x top 8) against dense FP8
      timeout 120 "$FP8RL" bench-gemm --grouped-only > "$OUT/grouped.log" 2>&1
      note "bench-gemm --grouped-only: rc=$?"; grep -A3 "^grouped" "$OUT/grouped.log" | tee -a "$SUMMARY" ;;
    fast_accum)  # cuBLASLt's block-scaled FP8 products with CUBLASLT_MATMUL_DESC_FAST_ACCUM against the default
      timeout 120 "$FP8RL" bench-gemm --fast-accum --shapes "${FP8RL_FAST_ACCUM_SHAPES:-8192x12288x2048,8192x4096x2048,8192x2048x6144,256x12288x2048,256x4096x2048,256x2048x6144}" > "$OUT/fast_accum.log" 2>&1
      note "bench-gemm --fast-accum: rc=$?"; grep -E "fast accumulation|own 64-row|^--shapes" "$OUT/fast_accum.log" | tee -a "$SUMMARY" ;;
    mma_probe)  # the own FP8 GEMM's wgmma issue patterns with the MMAs alone (src/bench/cuda/mma_probe.cu)
      timeout 60 "$FP8RL" bench-gemm --mma-probe > "$OUT/mma_probe.log" 2>&1
      note "bench-gemm --mma-probe: rc=$?"; grep "^mma_probe" "$OUT/mma_probe.log" | tee -a "$SUMMARY"
      grep -iE "error" "$OUT/mma_probe.log" | head -5 | tee -a "$SUMMARY" ;;
    rlstep_long)
      timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
        --recipes bf16,fp8_e2e --max-new-tokens 2048 --steps 1 ${FP8RL_RLSTEP_LONG_ARGS:---warmup 0} --json "$OUT/rlstep_2048.json" \
        > "$OUT/rlstep_2048.log" 2>&1
      note "bench rl-step 2048 new tokens: rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep_2048.log" | tee -a "$SUMMARY" ;;
    trainstep)
      for run in ${FP8RL_TRAINSTEP_RUNS:-bf16 fp8 fp8:fp8}; do  # precision[:wgrad] (default wgrad: the preset's)
        prec=${run%%:*}; wg=auto; [ "$run" != "$prec" ] && wg=${run#*:}
        timeout 150 "$FP8RL" bench-train-step --device cuda --precision $prec --wgrad $wg --hidden 2048 --layers 16 \
          --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --vocab 128256 --seqs 8 --seq-len 2048 --prompt-len 2040 \
          --repeats 3 --json "$OUT/trainstep_${prec}_$wg.json" > "$OUT/trainstep_${prec}_$wg.log" 2>&1
        note "bench-train-step $prec wgrad $wg: rc=$?"; grep -E "^(score|train_step) " "$OUT/trainstep_${prec}_$wg.log" | tee -a "$SUMMARY"
      done
      timeout 120 env PYTHONUNBUFFERED=1 python3 scripts/bench_train_step_torch.py --json "$OUT/trainstep_torch.json" \
        > "$OUT/trainstep_torch.log" 2>&1
      note "torch train step: rc=$?"; tail -3 "$OUT/trainstep_torch.log" | tee -a "$SUMMARY" ;;
    trainstep_8b)  # issue 13: bench-train-step at the Llama-3.1-8B width (FP8RL_TRAINSTEP_8B_LAYERS = 8 blocks,
      # full vocabulary), 8 x 2048 tokens, for each precision[:wgrad] of FP8RL_TRAINSTEP_8B_RUNS (bf16 fp8);
      # FP8RL_TRAINSTEP_8B_ARGS: more arguments; FP8RL_TRAINSTEP_8B_ENV: env assignments (e.g.
      # FP8RL_CUDA_PROFILE=2: the train step's op table goes to the summary)
      for run in ${FP8RL_TRAINSTEP_8B_RUNS:-bf16 fp8}; do
        prec=${run%%:*}; wg=auto; [ "$run" != "$prec" ] && wg=${run#*:}
        env ${FP8RL_TRAINSTEP_8B_ENV:-} timeout $(( $(left) / 2 )) "$FP8RL" bench-train-step --device cuda --precision $prec \
          --wgrad $wg --model llama-3.1-8b --layers "${FP8RL_TRAINSTEP_8B_LAYERS:-8}" --seqs 8 --seq-len 2048 \
          --prompt-len 2040 --repeats 3 ${FP8RL_TRAINSTEP_8B_ARGS:-} --json "$OUT/trainstep_8b_${prec}_$wg.json" \
          > "$OUT/trainstep_8b_${prec}_$wg.log" 2>&1
        note "bench-train-step llama-3.1-8b width $prec wgrad $wg: rc=$?"
        grep -E "^(bench-train-step:|score |train_step |fp8 fallbacks)|refused|error" "$OUT/trainstep_8b_${prec}_$wg.log" | tee -a "$SUMMARY"
        grep -A${FP8RL_PROFILE_ROWS:-30} "cuda op profile: train_step" "$OUT/trainstep_8b_${prec}_$wg.log" | tee -a "$SUMMARY"
      done ;;
    memory)  # issue 15: the recipe's 32k-token micro-batches with the KL reference, measured peak vs the plan
      for rc in none block; do
        recipes=bf16,fp8_e2e; [ $rc = block ] && recipes=bf16
        timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
          --recipes $recipes --kl-beta 0.01 --micro-batch-tokens 32768 --recompute $rc --max-new-tokens 256 \
          --steps 1 --json "$OUT/memory_$rc.json" > "$OUT/memory_$rc.log" 2>&1
        note "bench rl-step 32k micro-batches, kl 0.01, recompute $rc: rc=$?"
        sed -n '/^phase/,$p' "$OUT/memory_$rc.log" | grep -E "phase|^step|training|peak|plan" | tee -a "$SUMMARY"
      done ;;
    kernels)  # the decode attention and the sampler alone (issue 14)
      FP8RL_PAGED_BENCH=1 FP8RL_PAGED_BENCH_JSON="$OUT/paged_bench.json" timeout 120 "$B/fp8rl_gpu_tests" --gtest_color=no \
        --gtest_filter='CudaPagedAttention.DecodeBench' > "$OUT/paged_bench.log" 2>&1
      note "paged attention bench: rc=$?"; grep -vE '^\[|^$|^Note' "$OUT/paged_bench.log" | head -72 | tee -a "$SUMMARY"
      timeout 60 "$FP8RL" bench sample --device cuda > "$OUT/sample_bench.log" 2>&1
      note "bench sample: rc=$?"; tail -12 "$OUT/sample_bench.log" | tee -a "$SUMMARY" ;;
    flash_orders)  # issue 11: DecodeBench's flash-order decode in each FP8RL_FLASH_ORDER (online, merge_coop, merge)
      for order in online merge_coop merge; do
        FP8RL_FLASH_ORDER=$order FP8RL_PAGED_BENCH=1 timeout 120 "$B/fp8rl_gpu_tests" --gtest_color=no \
          --gtest_filter='CudaPagedAttention.DecodeBench' > "$OUT/paged_bench_$order.log" 2>&1
        note "flash-order decode, FP8RL_FLASH_ORDER=$order: rc=$?"
        grep -E "flash-order" "$OUT/paged_bench_$order.log" | tee -a "$SUMMARY"
      done ;;
    pick_paged)  # after `kernels`: the tensor-core variant with the least time over the 1.7B rows, BF16 + E4M3
      PICK=$(python3 - "$OUT/paged_bench.json" "${PAGED_BAD:-}" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))
bad = set(sys.argv[2].split())
tot = {}
for r in rows:
    k = r["kernel"]
    if not k.startswith("mma") or "split" in k or not r["shape"].startswith("qwen3-1.7b") or "a seq" in r["shape"]:
        continue
    name = k[4:] if k.startswith("mma:") else "orig"
    tot[name] = tot.get(name, 0.0) + r["us_per_call"]
ok = {n: t for n, t in tot.items() if n not in bad}
print(min(ok, key=ok.get) if ok else "orig")
PYEOF
)
      export FP8RL_PAGED_VARIANT="${PICK:-orig}"; note "pick_paged: FP8RL_PAGED_VARIANT=$FP8RL_PAGED_VARIANT for the stages after it" ;;
    ncu_paged)  # issue 14: why the E4M3 decode attention is not twice as fast as the BF16 one: the DEFAULT
      # tensor-core kernel (paged_mmat_kernel; before session 32 this regex matched the old paged_mma_kernel,
      # "orig"), DecodeBench's first shape, each pool's default variant alone (as ncu_paged_src); the
      # achieved against theoretical occupancy and the waves show the fixed per-call time (the ramp and
      # the tail of CTAs of random context lengths: session 32's fit of DecodeBench's figures)
      # FP8RL_NCU_PAGED_VARIANTS: the variants to profile (each as the default through FP8RL_PAGED_VARIANT;
      # unset: the default alone)
      for var in ${FP8RL_NCU_PAGED_VARIANTS:-default}; do
        [ "$var" = default ] && venv=() || venv=(FP8RL_PAGED_VARIANT="$var")
        for tag in bf16 e4m3; do
          env "${venv[@]}" FP8RL_PAGED_BENCH=1 FP8RL_PAGED_BENCH_POOL=$tag FP8RL_PAGED_BENCH_DEFAULT=1 timeout 150 ncu --clock-control none \
            -k "regex:paged_mmat" -c 1 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats --print-details all \
            "$B/fp8rl_gpu_tests" --gtest_color=no --gtest_filter='CudaPagedAttention.DecodeBench' > "$OUT/ncu_paged_${var}_$tag.log" 2>&1
          note "ncu paged $var $tag: rc=$?"
          grep -E "paged_mmat|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|SM Active Cycles|Elapsed Cycles|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Block Limit" \
            "$OUT/ncu_paged_${var}_$tag.log" | head -30 | tee -a "$SUMMARY"
        done
      done ;;
    ncu_flash_decode)  # issue 11: the flash-order decode (E4M3 pool, DecodeBench's first shape, Qwen3-1.7B B = 256)
      # in each FP8RL_FLASH_ORDER's kernel (online: flash_decode_kernel, merge: flash_decode_tiles_kernel)
      for order in ${FP8RL_NCU_FLASH_ORDERS:-online merge}; do
        ncu_source "flash_$order" flash_decode 25 CudaPagedAttention.DecodeBench FP8RL_PAGED_BENCH=1 \
          FP8RL_FLASH_ORDER=$order FP8RL_PAGED_BENCH_POOL=e4m3
      done ;;
    query_runs)  # issue 11: the consistent trainer's attention (paged, query runs of 8 / 16 columns) against flash
      # attention's forward, one 8k-token micro-batch at the 1.7B heads (CudaConsistent.QueryRunBench)
      FP8RL_QUERY_RUN_BENCH=1 timeout 120 "$B/fp8rl_gpu_tests" --gtest_color=no \
        --gtest_filter='CudaConsistent.QueryRunBench' > "$OUT/query_runs.log" 2>&1
      note "query-run bench: rc=$?"; grep -E "^ |^consistent" "$OUT/query_runs.log" | tee -a "$SUMMARY" ;;
    ncu_query_runs)  # issue 11: Nsight Compute on the query-run kernel (runs of FP8RL_NCU_QUERY_COLS = 8 columns;
      # 64: the wide CTAs, paged_wide_kernel)
      qc="${FP8RL_NCU_QUERY_COLS:-8}"; qk=paged_mmat; [ "$qc" = 64 ] && qk=paged_wide
      ncu_source "query_runs_$qc" "$qk" 30 CudaConsistent.QueryRunBench FP8RL_QUERY_RUN_BENCH=1 \
        FP8RL_QUERY_RUN_BENCH_COLS="$qc" ;;
    ncu_paged_src)  # issue 14: the default tensor-core decode kernel (paged_mmat_kernel), BF16 and E4M3 pools,
      # on DecodeBench's first shape (Qwen3-1.7B, B = 256). The test times only that pool's default variant
      # (FP8RL_PAGED_BENCH_POOL, _DEFAULT), so the first paged_mmat_kernel launch is the one (session 19:
      # regexes over the template arguments matched nothing).
      for tag in bf16 e4m3; do
        ncu_source "paged_src_$tag" paged_mmat 30 CudaPagedAttention.DecodeBench FP8RL_PAGED_BENCH=1 \
          FP8RL_PAGED_BENCH_POOL=$tag FP8RL_PAGED_BENCH_DEFAULT=1
      done ;;
    gemm_variants)  # issues 14 and 16: the own FP8 GEMM's variants side by side (bench-gemm --shapes)
      # cluster:scales:CTAs-per-SM[:band[:store[:columns[:pipe[:rows]]]]] (FP8RL_FP8_GEMM_CLUSTER,
      # _SCALES, _OCCUPANCY (64-row tiles), _BAND, _STORE, _BN: 64 or 128 columns beside 64-row
      # tiles, _PIPE: auto, drain or overlap, _BM: 128 or 192 rows where 64-row tiles are not taken)
      for v in ${FP8RL_GEMM_VARIANTS:-1x1:global:1 1x1:smem:1 1x1:global:2 1x1:smem:2 2x1:smem:1}; do
        IFS=: read -r vc vs vo vb vt vn vp vm <<< "$v"
        vb=${vb:-0}; [ "$vs" = global ] && vt=${vt:-tma}; vt=${vt:-direct}; vn=${vn:-128}; vp=${vp:-auto}; vm=${vm:-128}
        venv="FP8RL_FP8_GEMM_STORE=$vt FP8RL_FP8_GEMM_BAND=$vb FP8RL_FP8_GEMM_CLUSTER=$vc FP8RL_FP8_GEMM_SCALES=$vs FP8RL_FP8_GEMM_OCCUPANCY=$vo FP8RL_FP8_GEMM_BN=$vn FP8RL_FP8_GEMM_PIPE=$vp FP8RL_FP8_GEMM_BM=$vm"
        { echo "== cluster $vc, scales $vs, CTAs per SM (64-row tiles) $vo, band $vb, store $vt, columns $vn, pipe $vp, rows $vm"
          env $venv timeout 60 "$FP8RL" bench-gemm \
            --shapes "${FP8RL_GEMM_SHAPES:-8192x12288x2048,8192x4096x2048,8192x2048x6144,256x12288x2048,256x4096x2048,256x2048x2048,256x2048x6144}" | grep -A12 "^linear"
          [ -n "${FP8RL_GEMM_NO_GROUPED:-}" ] || env $venv timeout 150 "$FP8RL" bench-gemm --grouped-only | grep -A6 "^grouped"
        } >> "$OUT/gemm_variants.log" 2>&1
      done
      note "gemm variants (own TF/s column):"; tee -a "$SUMMARY" < "$OUT/gemm_variants.log" ;;
    ncu_gemm)  # issues 14 and 16: what bounds the own FP8 GEMM (one launch per product, Nsight Compute)
      # FP8RL_NCU_GEMM: MxNxK products (bench-gemm --shapes) or "grouped" (the expert products).
      for sh in ${FP8RL_NCU_GEMM:-8192x12288x2048 256x12288x2048 256x2048x6144 grouped}; do
        if [ "$sh" = grouped ]; then sel=(--grouped-only); else sel=(--shapes "$sh"); fi
        env ${FP8RL_NCU_GEMM_ENV:-} timeout 120 ncu --clock-control none --kernel-name-base demangled -k "regex:${FP8RL_NCU_GEMM_KERNEL:-fp8_gemm_kernel}" -c 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
          --print-details all "$FP8RL" bench-gemm --reps 1 --warmup 0 "${sel[@]}" > "$OUT/ncu_gemm_$sh.log" 2>&1
        note "ncu gemm $sh: rc=$?"
        grep -E "fp8_gemm_kernel|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Grid Size|Stall|Tensor|Shared Memory" \
          "$OUT/ncu_gemm_$sh.log" | grep -v "^==PROF==" | head -40 | tee -a "$SUMMARY"
      done ;;
    ncu_gemm_src)  # issues 14 and 16: where the own FP8 GEMM's warps stall, instruction by instruction
      # One launch per product of FP8RL_NCU_GEMM (as ncu_gemm), the variant from the FP8RL_FP8_GEMM_*
      # environment; the SASS with its stall samples (ncu's source page) to ncu_src_<product>.csv,
      # the 40 instructions with the most samples to the summary (scripts/ncu_sass_top.py).
      for sh in ${FP8RL_NCU_GEMM:-8192x12288x2048 256x12288x2048}; do
        if [ "$sh" = grouped ]; then sel=(--grouped-only); else sel=(--shapes "$sh"); fi
        timeout 150 ncu --clock-control none --kernel-name-base demangled -k "regex:${FP8RL_NCU_GEMM_KERNEL:-fp8_gemm_kernel}" -c 1 \
          --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --import-source no -f -o "$OUT/ncu_src_$sh" "$FP8RL" bench-gemm --reps 1 --warmup 0 "${sel[@]}" \
          > "$OUT/ncu_src_$sh.log" 2>&1
        note "ncu gemm source $sh: rc=$?"
        ncu -i "$OUT/ncu_src_$sh.ncu-rep" --page details --print-details all 2>&1 | \
          grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Stall|Warp Cycles Per Issued" | head -30 | tee -a "$SUMMARY"
        ncu -i "$OUT/ncu_src_$sh.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_src_$sh.csv" 2>&1
        note "source page: rc=$? $(wc -l < "$OUT/ncu_src_$sh.csv") lines"
        python3 scripts/ncu_sass_top.py "$OUT/ncu_src_$sh.csv" 40 2>&1 | tee -a "$SUMMARY"
        rm -f "$OUT/ncu_src_$sh.ncu-rep"
      done ;;
    ncu_train)  # issue 13: the training phase's element-wise producers and attention, each kernel's
      # speed of light (one launch of each, bench-train-step at FP8RL_RLSTEP_MODEL's width, 2 blocks,
      # FP8RL_NCU_TRAIN_PREC = fp8): duration, DRAM and SM throughput against their peaks.
      timeout $(( $(left) / 2 )) ncu --clock-control none --kernel-name-base demangled \
        -k "regex:${FP8RL_NCU_TRAIN_KERNELS:-rmsnorm_rope|swiglu|rope_kernel|rmsnorm_backward|rmsnorm_dw|add_fp8|rmsnorm_fused|flash_|kv_round|amax|add_vec|quant}" \
        -c "${FP8RL_NCU_TRAIN_COUNT:-150}" --section SpeedOfLight ${FP8RL_NCU_TRAIN_SECTIONS:-} "$FP8RL" bench-train-step --device cuda \
        --precision "${FP8RL_NCU_TRAIN_PREC:-fp8}" --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --layers 2 --seqs 8 \
        --seq-len 2048 --prompt-len 2040 --repeats 1 > "$OUT/ncu_train.log" 2>&1
      note "ncu train kernels: rc=$?"
      python3 - "$OUT/ncu_train.log" <<'PY' | tee -a "$SUMMARY"
import re, sys
rows, cur = {}, None
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"^  (\S.*?)\s+\((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context", line)
    if m:
        name = re.split(r"[<(]", m.group(1).replace("(anonymous namespace)", "anon"))[0].split("::")[-1]
        cur = name.replace("void ", "").strip() + f" grid {m.group(2)}x{m.group(3)} blk {m.group(5)}x{m.group(6)}"
        rows.setdefault(cur, {})
        continue
    for key, pat in (("us", r"^\s+Duration\s+(\S+)\s+([\d.,]+)"), ("dram", r"^\s+DRAM Throughput\s+%\s+([\d.,]+)"),
                     ("sm", r"^\s+Compute \(SM\) Throughput\s+%\s+([\d.,]+)"), ("mem", r"^\s+Memory Throughput\s+%\s+([\d.,]+)")):
        mm = re.match(pat, line)
        if mm and cur and key not in rows[cur]:
            if key == "us":
                v = float(mm.group(2).replace(",", "")); u = mm.group(1)
                rows[cur][key] = v / 1000 if u == "ns" else v * 1000 if u == "ms" else v
            else:
                rows[cur][key] = float(mm.group(1).replace(",", ""))
print(f"{'kernel':70s} {'us':>9s} {'dram%':>6s} {'mem%':>6s} {'sm%':>6s}")
# With FP8RL_NCU_TRAIN_SECTIONS (e.g. --section ComputeWorkloadAnalysis --section InstructionStats):
# ncu_train.log holds those sections too (the pipes' utilization, the instruction mix).
for k, v in rows.items():
    print(f"{k[:70]:70s} {v.get('us', 0):9.1f} {v.get('dram', 0):6.1f} {v.get('mem', 0):6.1f} {v.get('sm', 0):6.1f}")
PY
      ;;
    ncu_decode)  # issue 14: the decode step's kernels with CUDA graphs on, each graph node timed alone by ncu
      # bench generate's prefill (256 x 256 tokens) ends well before launch FP8RL_NCU_SKIP; the
      # next FP8RL_NCU_COUNT kernels are ~3 decode steps at B = 256 (the sampler's merge kernel
      # runs once per step: us per step). --cache-control none: L2 as the step leaves it.
      # recipe[:skip]: a recipe's launches before its first decode-only step (bench generate runs a
      # prefill-only pass, then prefill + decode; FP8 recipes have ~1.9x the kernels per step).
      # FP8RL_NCU_SKIP applies only to recipes listed without their own skip.
      for rs in ${FP8RL_NCU_RECIPES:-bf16:12000 fp8_linear:20000 fp8_kv:20000}; do
        r=${rs%%:*}; skip=${FP8RL_NCU_SKIP:-8000}; [ "$rs" != "$r" ] && skip=${rs#*:}
        timeout $(( $(left) / 2 )) ncu --clock-control none --cache-control none --graph-profiling node \
          --metrics gpu__time_duration.sum --csv --page raw --launch-skip "$skip" \
          --launch-count "${FP8RL_NCU_COUNT:-1500}" "$FP8RL" bench generate --device cuda \
          --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" --prompts 256 --prompt-len 256 --gen-len 64 --recipes "$r" \
          --warmup 0 > "$OUT/ncu_decode_$r.csv" 2> "$OUT/ncu_decode_$r.log"
        note "ncu decode step ($r): rc=$?"
        python3 scripts/ncu_kernel_sum.py "$OUT/ncu_decode_$r.csv" --per sample_gumbel_merge --rows 256 | head -30 | tee -a "$SUMMARY"
      done ;;
    moe_trainstep_profile)  # issue 16: the per-op stream time of one MoE train step, bf16 and fp8
      for prec in ${FP8RL_MOE_PROFILE_PRECS:-bf16 fp8}; do
        FP8RL_CUDA_PROFILE=${FP8RL_PROFILE_LEVEL:-1} timeout $(( $(left) / 2 )) "$FP8RL" bench-train-step --device cuda --precision $prec \
          --model qwen3-30b-a3b --layers "${FP8RL_MOE_TRAIN_LAYERS:-6}" --seqs 8 --seq-len 2048 --prompt-len 2040 \
          --repeats 1 --grad-dtype "${FP8RL_MOE_TRAIN_GRAD:-bf16}" > "$OUT/moe_trainstep_profile_$prec.log" 2>&1
        note "bench-train-step qwen3-30b-a3b $prec (profile): rc=$?"
        grep -A${FP8RL_PROFILE_ROWS:-24} "cuda op profile: train_step" "$OUT/moe_trainstep_profile_$prec.log" | tee -a "$SUMMARY"
      done ;;
    trainstep_profile)  # the per-op stream time of one bf16 and one fp8 train step (1B shape)
      for prec in bf16 fp8; do
        FP8RL_CUDA_PROFILE=1 timeout 150 "$FP8RL" bench-train-step --device cuda --precision $prec --hidden 2048 \
          --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --vocab 128256 --seqs 8 --seq-len 2048 \
          --prompt-len 2040 --repeats 1 > "$OUT/trainstep_profile_$prec.log" 2>&1
        note "bench-train-step $prec (profile): rc=$?"; grep -A16 "cuda op profile: train_step" "$OUT/trainstep_profile_$prec.log" | tee -a "$SUMMARY"
      done ;;
    generate)  # issue 14's table: bench generate on FP8RL_GENERATE_MODEL (1b) with FP8RL_GENERATE_ARGS
      gm=${FP8RL_GENERATE_MODEL:-1b}
      timeout $(( $(left) - 20 )) "$FP8RL" bench generate --device cuda --model "$gm" ${FP8RL_GENERATE_ARGS:-} \
        --json "$OUT/generate_$gm.json" > "$OUT/generate_$gm.log" 2>&1
      note "bench generate $gm: rc=$?"; sed -n '/^recipe/,$p' "$OUT/generate_$gm.log" | head -40 | tee -a "$SUMMARY" ;;
    generate_x*)  # an extra bench generate: model FP8RL_<STAGE>_MODEL (1b), FP8RL_<STAGE>_ARGS, under the env
      # assignments FP8RL_<STAGE>_ENV (e.g. FP8RL_GENERATE_X1_ENV="FP8RL_FP8_GEMM=auto FP8RL_FP8_GEMM_STREAMK=1")
      up=$(echo "$stage" | tr a-z A-Z); gm_var="FP8RL_${up}_MODEL"; ga_var="FP8RL_${up}_ARGS"; ge_var="FP8RL_${up}_ENV"
      case "${!ge_var:-}" in *FP8RL_FP8_GEMM*)
        if [ -n "${OWN_GEMM_BROKEN:-}" ]; then note "$stage: skipped (CudaFp8Gemm failed)"; continue; fi ;; esac
      env ${!ge_var:-} timeout $(( $(left) - 20 )) "$FP8RL" bench generate --device cuda --model "${!gm_var:-1b}" \
        ${!ga_var:-} --json "$OUT/$stage.json" > "$OUT/$stage.log" 2>&1
      note "bench generate ($stage: ${!gm_var:-1b} ${!ge_var:-} ${!ga_var:-}): rc=$?"
      sed -n '/^recipe/,$p' "$OUT/$stage.log" | head -40 | tee -a "$SUMMARY" ;;
    rlstep_kl)
      timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model "${FP8RL_RLSTEP_MODEL:-qwen3-1.7b}" \
        --recipes bf16,fp8_e2e --kl-beta 0.01 --max-new-tokens 256 --steps 1 --warmup 0 \
        --json "$OUT/rlstep_kl.json" > "$OUT/rlstep_kl.log" 2>&1
      note "bench rl-step kl_beta 0.01: rc=$?"; sed -n '/^phase/,$p' "$OUT/rlstep_kl.log" | tee -a "$SUMMARY" ;;
    rlstep_8b)  # issue 15: Llama-3.1-8B GRPO on one H200 (a refused recipe is reported, not a failure)
      timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model llama-3.1-8b --recipes fp8_e2e,bf16 \
        --prompts 16 --samples 16 --max-new-tokens 1024 --kl-beta 0.01 --optimizer-steps 1 --steps 3 --warmup 0 \
        --recompute auto --grad-dtype bf16 --optimizer-state-dtype bf16 --micro-batch-tokens 8192 \
        --json "$OUT/rlstep_8b.json" > "$OUT/rlstep_8b.log" 2>&1
      note "bench rl-step llama-3.1-8b (fp8_e2e, bf16): rc=$?"
      grep -E "plans checked|recompute auto|refused|step [0-9]" "$OUT/rlstep_8b.log" | tee -a "$SUMMARY"
      sed -n '/^phase/,$p' "$OUT/rlstep_8b.log" | tee -a "$SUMMARY"
      grep -iE "error" "$OUT/rlstep_8b.log" | head -5 | tee -a "$SUMMARY" ;;
    moe_rlstep)  # issue 16: GRPO steps of a Qwen3-30B-A3B-width MoE, bf16 and fp8_e2e side by side
      timeout $(( $(left) - 20 )) "$FP8RL" bench rl-step --device cuda --model qwen3-30b-a3b \
        --layers "${FP8RL_MOE_LAYERS:-12}" --recipes bf16,fp8_e2e --max-new-tokens "${FP8RL_MOE_NEW:-256}" \
        --grad-dtype bf16 --optimizer-state-dtype bf16 --micro-batch-tokens 8192 --steps 1 --warmup 1 \
        ${FP8RL_MOE_ARGS:-} --json "$OUT/moe_rlstep.json" > "$OUT/moe_rlstep.log" 2>&1
      note "bench rl-step qwen3-30b-a3b ${FP8RL_MOE_LAYERS:-12} layers (bf16, fp8_e2e): rc=$?"
      grep -E "plans checked|refused|step [0-9]" "$OUT/moe_rlstep.log" | tee -a "$SUMMARY"
      sed -n '/^phase/,$p' "$OUT/moe_rlstep.log" | tee -a "$SUMMARY"
      grep -iE "error" "$OUT/moe_rlstep.log" | head -5 | tee -a "$SUMMARY" ;;
    moe_generate)  # issue 16: rollout throughput at Qwen3-30B-A3B, full FP8 vs BF16
      timeout $(( $(left) - 20 )) "$FP8RL" bench generate --device cuda --model qwen3-30b-a3b \
        --layers "${FP8RL_MOE_GEN_LAYERS:-48}" --recipes bf16,fp8_linear,fp8_attn --prompts 256 --prompt-len 256 \
        --gen-len 512 --json "$OUT/moe_generate.json" > "$OUT/moe_generate.log" 2>&1
      note "bench generate qwen3-30b-a3b ${FP8RL_MOE_GEN_LAYERS:-48} layers: rc=$?"
      grep -E "^(recipe |bf16 |fp8_)" "$OUT/moe_generate.log" | tee -a "$SUMMARY" ;;
    moe_trainstep)  # issue 16: one training step at Qwen3-30B-A3B width, fp8 vs bf16
      for prec in bf16 fp8; do
        timeout $(( $(left) / 2 )) "$FP8RL" bench-train-step --device cuda --precision $prec --model qwen3-30b-a3b \
          --layers "${FP8RL_MOE_TRAIN_LAYERS:-6}" --seqs 8 --seq-len 2048 --prompt-len 2040 --repeats 3 \
          --grad-dtype "${FP8RL_MOE_TRAIN_GRAD:-bf16}" \
          --json "$OUT/moe_trainstep_$prec.json" > "$OUT/moe_trainstep_$prec.log" 2>&1
        note "bench-train-step qwen3-30b-a3b $prec: rc=$?"
        grep -E "^(bench-train-step:|score |train_step |generate |fp8 fallbacks)" "$OUT/moe_trainstep_$prec.log" | tee -a "$SUMMARY"
      done ;;
    multiblock)  # issue 11: transformers-made multi-block fixtures vs fp8rl (CPU, CUDA) and the emulation
      { python3 scripts/fixtures/make_multiblock_fixtures.py /tmp/tf_small --maker transformers --size small \
          --models llama_sharp,qwen2_sharp,qwen3_default &&
        python3 scripts/fixtures/compare_logprobs.py /tmp/tf_small --fp8rl "$FP8RL" --devices cpu,cuda --torch-emulation &&
        tar -C /tmp/tf_small -czf "$OUT/tf_small.tar.gz" . &&
        python3 scripts/fixtures/compare_logprobs.py tests/data/multiblock --fp8rl "$FP8RL" --devices cpu,cuda; } \
        > "$OUT/multiblock.log" 2>&1
      note "multiblock fixtures: rc=$?"; tail -30 "$OUT/multiblock.log" | tee -a "$SUMMARY" ;;
    export)  # issue 17: an fp8rl FP8-block export loads in transformers with matching logprobs
      for m in tests/data/multiblock/llama_sharp tests/data/multiblock/qwen3_default; do
        timeout 120 python3 scripts/check_fp8_export_hf.py --model "$m" --fp8rl "$FP8RL" --out "/tmp/export_$(basename $m)" \
          > "$OUT/export_$(basename $m).log" 2>&1
        note "fp8 export check $m: rc=$?"; tail -12 "$OUT/export_$(basename $m).log" | tee -a "$SUMMARY"
      done ;;
    *) note "unknown stage $stage" ;;
  esac
done
note "total: $(( $(date +%s) - t0 )) s"
# The device tool brings back at most 8 files: everything but the summary and the JSON results
# travels packed in logs.tgz (session 19 lost summary.txt behind stage logs and CSVs), and the
# packed files are removed whether or not tar complained.
(cd "$OUT" && tar -czf /tmp/gpu_bench_logs.tgz --exclude=tf_small.tar.gz --exclude=summary.txt --exclude='*.json' \
   --exclude=logs.tgz . 2>/dev/null; mv -f /tmp/gpu_bench_logs.tgz logs.tgz;
 find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name logs.tgz ! -name '*.json' ! -name tf_small.tar.gz \
   -exec rm -rf {} +)
