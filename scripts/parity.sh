#!/usr/bin/env bash
# The accuracy-parity experiment of docs/results/parity.md in one command, within a wall-clock
# budget: SFT of the starting policy (configs/parity/sft.yaml), then GRPO from it in four arms
# with the same seeds and steps (configs/parity/grpo.yaml + the arm's overrides), then charts
# (`fp8rl plot`) and a summary table (scripts/parity_summary.py) of the four runs.
#
#   scripts/parity.sh RUNS_DIR [REPORT_DIR] [key=value ...]
#     RUNS_DIR    run directories (sft/, one per arm) and console logs (logs/); must not hold a
#                 previous experiment
#     REPORT_DIR  at most 8 files: parity_curves.png, parity_time.png, sft_loss.png, summary.md,
#                 summary.json, parity_logs.tgz (logs, metrics, configs; default RUNS_DIR/report)
#     key=value   overrides for every run (both stages), e.g. the CPU dry run:
#                 device=cpu model.tiny.hidden_size=64 sft.steps=20 steps=3 ...
# Environment:
#   FP8RL_BIN          the fp8rl binary (default build/fp8rl)
#   FP8RL_SHARED_DATA  shared data (Qwen3 tokenizer, GSM8K); default .shared_copy, then
#                      /work/shared/data, then ../shared/data
#   PARITY_BUDGET_S    wall-clock budget of everything (default 520)
#   PARITY_SFT_S       SFT's share (default 150); the arms share the rest equally, less
#   PARITY_RESERVE_S   kept for charts and the summary (default 15)
#   PARITY_ARMS        "name:override,override name:..." (default: the four arms below)
set -u
if [ $# -lt 1 ]; then sed -n 2,22p "$0"; exit 2; fi
RUNS="$1"; shift
REPORT="$RUNS/report"
if [ $# -ge 1 ] && [[ "$1" != *=* ]]; then REPORT="$1"; shift; fi
EXTRA=("$@")
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${FP8RL_BIN:-$ROOT/build/fp8rl}"
BUDGET="${PARITY_BUDGET_S:-520}"
SFT_S="${PARITY_SFT_S:-150}"
RESERVE="${PARITY_RESERVE_S:-15}"
ARMS="${PARITY_ARMS:-bf16:precision.recipe=bf16,train.is.mode=tis fp8_gen_noIS:precision.recipe=fp8_gen,train.is.mode=none fp8_gen_tis:precision.recipe=fp8_gen,train.is.mode=tis fp8_e2e_tis:precision.recipe=fp8_e2e,train.is.mode=tis}"
if [ -z "${FP8RL_SHARED_DATA:-}" ]; then
  for d in "$ROOT/.shared_copy" /work/shared/data "$ROOT/../shared/data"; do
    [ -d "$d/tokenizers/qwen3" ] && { FP8RL_SHARED_DATA="$d"; break; }
  done
fi
DATA="${FP8RL_SHARED_DATA:-}"
[ -x "$BIN" ] || { echo "parity: no fp8rl binary at $BIN (build it, or set FP8RL_BIN)" >&2; exit 2; }
[ -f "$DATA/tokenizers/qwen3/tokenizer.json" ] ||
  { echo "parity: no Qwen3 tokenizer under FP8RL_SHARED_DATA='$DATA'" >&2; exit 2; }
for n in sft logs; do
  [ -e "$RUNS/$n" ] && { echo "parity: $RUNS/$n exists: give a fresh RUNS_DIR" >&2; exit 2; }
done
mkdir -p "$RUNS/logs" "$REPORT"
LOGS="$RUNS/logs"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "[parity $(elapsed)s] $*" | tee -a "$LOGS/parity.log"; }
note "budget ${BUDGET}s (sft ${SFT_S}s, reserve ${RESERVE}s); data $DATA; overrides: ${EXTRA[*]:-none}"

# The memory plans of a ~1B model on one H200 (GSM8K rollout sizes), for comparison; this
# experiment's plan is printed after SFT (from its checkpoint) and by every run at its start.
for shape in llama-3.2-1b qwen3-1.7b; do
  "$BIN" plan --config "$ROOT/configs/gsm8k_gpu.yaml" --shape "$shape" --device-gib 139 \
    > "$LOGS/plan_$shape.txt" 2>&1
done
# 1. SFT.
note "sft: start"
timeout --kill-after=10 $(( SFT_S + 30 )) "$BIN" sft --config "$ROOT/configs/parity/sft.yaml" \
  tokenizer.path="$DATA/tokenizers/qwen3" time_budget_s="$SFT_S" out="$RUNS/sft" "${EXTRA[@]}" \
  > "$LOGS/sft.log" 2>&1
rc=$?
echo "$rc" > "$LOGS/sft.rc"
CKPT="$(sed -n 's/^sft done: //p' "$LOGS/sft.log" | tail -1)"
note "sft: exit $rc, checkpoint '${CKPT}'"
if [ -d "$CKPT" ]; then
  "$BIN" plan --config "$ROOT/configs/parity/grpo.yaml" model.path="$CKPT" --device-gib 139 "${EXTRA[@]}" \
    > "$LOGS/plan_parity.txt" 2>&1
  cat "$LOGS/plan_parity.txt"
fi
if [ "$rc" != 0 ] || [ ! -d "$CKPT" ]; then
  tail -20 "$LOGS/sft.log"
  note "sft failed: no GRPO arms"
fi

# 2. The GRPO arms, each with an equal share of what is left.
read -r -a arm_list <<< "$ARMS"
DIRS=()
NAMES=()
if [ -d "${CKPT:-/nonexistent}" ]; then
  SHARE=$(( (BUDGET - $(elapsed) - RESERVE) / ${#arm_list[@]} ))
  note "grpo: ${#arm_list[@]} arms, ${SHARE}s each"
  for arm in "${arm_list[@]}"; do
    name="${arm%%:*}"
    IFS=',' read -r -a over <<< "${arm#*:}"
    if [ "$SHARE" -lt 15 ] || [ $(( $(elapsed) + SHARE )) -gt $(( BUDGET - RESERVE + 5 )) ]; then
      note "$name: skipped, out of time"
      echo skipped > "$LOGS/$name.rc"
      continue
    fi
    note "$name: start (${over[*]})"
    timeout --kill-after=10 $(( SHARE + 20 )) "$BIN" train --config "$ROOT/configs/parity/grpo.yaml" \
      model.path="$CKPT" "${over[@]}" time_budget_s="$SHARE" out="$RUNS/$name" "${EXTRA[@]}" \
      > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "$rc" > "$LOGS/$name.rc"
    note "$name: exit $rc; $(grep -E '^validation accuracy' "$LOGS/$name.log" | tail -1)"
    [ "$rc" != 0 ] && tail -5 "$LOGS/$name.log"
    [ -f "$RUNS/$name/metrics.jsonl" ] && { DIRS+=("$RUNS/$name"); NAMES+=("$name"); }
  done
fi

# 3. Charts, summary, logs.
if [ ${#DIRS[@]} -gt 0 ]; then
  "$BIN" plot "${DIRS[@]}" --out "$REPORT/parity_curves.png" --width 1600 --height 900 \
    --metrics val_accuracy,reward_mean,token_mult_prob_error,gen_kl_error >> "$LOGS/parity.log" 2>&1 ||
    note "plot of the curves failed (see parity.log)"
  "$BIN" plot "${DIRS[@]}" --out "$REPORT/parity_time.png" --width 1600 --height 900 \
    --metrics time_step_excl_val_s,time_generation_s,time_logprob_s,time_train_s,time_refit_s+time_calibration_s,time_refit_calib_fraction \
    >> "$LOGS/parity.log" 2>&1 || note "plot of the step times failed (see parity.log)"
fi
[ -f "$RUNS/sft/metrics.jsonl" ] &&
  { "$BIN" plot "$RUNS/sft" --out "$REPORT/sft_loss.png" --width 1000 --height 400 --metrics loss,lr \
      >> "$LOGS/parity.log" 2>&1 || note "plot of the sft loss failed"; }
args=()
for i in "${!DIRS[@]}"; do args+=("${NAMES[$i]}=${DIRS[$i]}"); done
if command -v python3 > /dev/null; then
  python3 "$ROOT/scripts/parity_summary.py" --logs "$LOGS" --out "$REPORT/summary" --baseline bf16 "${args[@]}" \
    2>&1 | tee -a "$LOGS/parity.log"
else
  note "python3 not found: no summary table (the metrics are in parity_logs.tgz)"
fi
note "done"
files=(logs)
[ -d "$RUNS/sft" ] && files+=(sft/metrics.jsonl sft/config.yaml)
for d in "${NAMES[@]}"; do files+=("$d/metrics.jsonl" "$d/config.yaml"); done
tar czf "$REPORT/parity_logs.tgz" -C "$RUNS" "${files[@]}" 2>/dev/null
ls -la "$REPORT"
