#!/usr/bin/env python3
"""Summary of the parity experiment (scripts/parity.sh): one row per GRPO arm from its
metrics.jsonl: validation accuracy (start, final, best, at the last step every arm validated),
mismatch (token_mult_prob_error, gen_kl_error), median step time by phase, speed-up over the
baseline arm, and the issue's targets checked. Writes OUT.md and OUT.json. Standard library only.

  parity_summary.py --out REPORT/summary [--baseline bf16] [--logs LOGS_DIR] NAME=RUN_DIR ...
"""
import argparse
import json
import math
import os
import statistics

PHASES = ["time_generation_s", "time_reward_s", "time_logprob_s", "time_train_s", "time_calibration_s",
          "time_refit_s", "time_step_excl_val_s", "time_validation_s"]


def finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load(run_dir):
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a torn last line (a killed run)
    return rows


def median(values):
    values = [v for v in values if finite(v)]
    return statistics.median(values) if values else None


def mean(values):
    values = [v for v in values if finite(v)]
    return sum(values) / len(values) if values else None


def summarize(name, run_dir):
    rows = load(run_dir)
    steps = [r for r in rows if r.get("step", 0) >= 1]
    # Medians skip step 1 (kernel warm-up, first allocations) when there are later steps.
    timed = steps[1:] if len(steps) > 1 else steps
    val = [(r["step"], r["val_accuracy"]) for r in rows if finite(r.get("val_accuracy"))]
    s = {
        "name": name, "dir": run_dir, "steps": len(steps),
        "last_step": steps[-1]["step"] if steps else 0,
        "val": val,
        "val_start": val[0][1] if val and val[0][0] == 0 else None,
        "val_final": val[-1][1] if val else None,
        "val_best": max(v for _, v in val) if val else None,
        "token_mult_prob_error_mean": mean(r.get("token_mult_prob_error") for r in steps),
        "token_mult_prob_error_max": max((r["token_mult_prob_error"] for r in steps
                                          if finite(r.get("token_mult_prob_error"))), default=None),
        "gen_kl_error_mean": mean(r.get("gen_kl_error") for r in steps),
        "refit_calib_fraction_median": median(r.get("time_refit_calib_fraction") for r in timed),
        "generation_tokens_per_s_median": median(r.get("generation_tokens_per_s") for r in timed),
        "reward_mean_last": steps[-1].get("reward_mean") if steps else None,
    }
    for p in PHASES:
        s[p + "_median"] = median(r.get(p) for r in timed)
    return s


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path without extension (.md and .json are written)")
    ap.add_argument("--baseline", default="bf16")
    ap.add_argument("--logs", help="logs directory: its plan_*.txt (memory plans) and *.rc go into the report")
    ap.add_argument("runs", nargs="*", metavar="NAME=RUN_DIR")
    a = ap.parse_args()
    runs = []
    for spec in a.runs:
        name, _, d = spec.partition("=")
        if not d:
            ap.error(f"'{spec}' is not NAME=RUN_DIR")
        try:
            runs.append(summarize(name, d))
        except (OSError, KeyError) as e:
            print(f"parity_summary: {name}: cannot read {d}/metrics.jsonl ({e})")
    base = next((r for r in runs if r["name"] == a.baseline), None)
    # Accuracy where every arm validated: the last common validation step.
    common = set.intersection(*[set(s for s, _ in r["val"]) for r in runs]) if runs else set()
    common_step = max(common) if common else None
    for r in runs:
        r["val_at_common_step"] = dict(r["val"]).get(common_step) if common_step is not None else None
        b = base["time_step_excl_val_s_median"] if base else None
        t = r["time_step_excl_val_s_median"]
        r["step_time_vs_baseline"] = t / b if (b and t) else None
        r["speedup_vs_baseline"] = b / t if (b and t) else None
        g, gb = r["time_generation_s_median"], base["time_generation_s_median"] if base else None
        r["generation_speedup_vs_baseline"] = gb / g if (g and gb) else None
        tr, tb = r["time_train_s_median"], base["time_train_s_median"] if base else None
        r["train_speedup_vs_baseline"] = tb / tr if (tr and tb) else None
        va, vb = r["val_at_common_step"], base["val_at_common_step"] if base else None
        r["val_delta_vs_baseline_points"] = 100 * (va - vb) if (va is not None and vb is not None) else None

    targets = {}
    e2e = next((r for r in runs if r["name"].startswith("fp8_e2e")), None)
    if e2e and base:
        d = e2e["val_delta_vs_baseline_points"]
        vb = base["val_at_common_step"]
        # At 0% or 100% both arms agree trivially: the comparison says nothing then.
        degenerate = vb is not None and (vb <= 0.0 or vb >= 1.0) and e2e["val_at_common_step"] == vb
        key = "fp8_e2e within 1 point of bf16 (at the common step)" + (
            " [degenerate: both at %.0f%%]" % (100 * vb) if degenerate else "")
        targets[key] = None if d is None else d >= -1.0
        m = e2e["token_mult_prob_error_mean"]
        targets["fp8_e2e token_mult_prob_error <= 1.01 (mean)"] = None if m is None else m <= 1.01
        x = e2e["step_time_vs_baseline"]
        targets["fp8_e2e step time <= 0.75x bf16 (median, validation excluded)"] = None if x is None else x <= 0.75
        f = e2e["refit_calib_fraction_median"]
        targets["fp8_e2e refit + KV calibration <= 1% of the step (median)"] = None if f is None else f <= 0.01

    lines = ["# Parity experiment: summary", ""]
    lines += [f"Baseline: `{a.baseline}`. Validation accuracy is greedy, on the same held-out problems; "
              f"the common step is the last step every arm validated ({common_step}). Times are medians "
              "over steps >= 2 (validation excluded from the step time).", ""]
    lines += ["| arm | steps | val@0 | val@common | final | best | delta vs base (pts) | token_mult_prob_error | "
              "gen_kl_error | step s | speed-up | gen speed-up | train speed-up | refit+calib |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append("| " + " | ".join([
            r["name"], str(r["steps"]), fmt(r["val_start"]), fmt(r["val_at_common_step"]), fmt(r["val_final"]),
            fmt(r["val_best"]), fmt(r["val_delta_vs_baseline_points"], "+.1f"),
            fmt(r["token_mult_prob_error_mean"], ".4f"), fmt(r["gen_kl_error_mean"], ".2e"),
            fmt(r["time_step_excl_val_s_median"]), fmt(r["speedup_vs_baseline"], ".2f"),
            fmt(r["generation_speedup_vs_baseline"], ".2f"), fmt(r["train_speedup_vs_baseline"], ".2f"),
            fmt(None if r["refit_calib_fraction_median"] is None else 100 * r["refit_calib_fraction_median"], ".2f") + "%",
        ]) + " |")
    lines += ["", "Median seconds per phase:", "",
              "| arm | " + " | ".join(p.replace("time_", "").replace("_s", "") for p in PHASES) + " | gen tok/s |",
              "|---" * (len(PHASES) + 2) + "|"]
    for r in runs:
        lines.append("| " + r["name"] + " | " + " | ".join(fmt(r[p + "_median"]) for p in PHASES) +
                     " | " + fmt(r["generation_tokens_per_s_median"], ".0f") + " |")
    lines += ["", "Targets (issue #7):", ""]
    for k, ok in targets.items():
        lines.append(f"- {k}: {'n/a' if ok is None else ('met' if ok else 'NOT met')}")
    if not targets:
        lines.append("- n/a (needs the baseline and an fp8_e2e arm)")
    if a.logs and os.path.isdir(a.logs):
        rcs = sorted(f for f in os.listdir(a.logs) if f.endswith(".rc"))
        if rcs:
            lines += ["", "Exit status: " + ", ".join(
                f"{f[:-3]} {open(os.path.join(a.logs, f)).read().strip()}" for f in rcs)]
        for f in sorted(os.listdir(a.logs)):
            if f.startswith("plan_") and f.endswith(".txt"):
                lines += ["", f"Memory plan ({f[5:-4]}):", "", "```", open(os.path.join(a.logs, f)).read().rstrip(), "```"]
    md = "\n".join(lines) + "\n"
    with open(a.out + ".md", "w") as f:
        f.write(md)
    with open(a.out + ".json", "w") as f:
        json.dump({"baseline": a.baseline, "common_step": common_step, "runs": runs, "targets": targets}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
