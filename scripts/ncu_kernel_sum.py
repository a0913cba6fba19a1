#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (--csv --page raw, metric gpu__time_duration.sum) by kernel.

Usage: ncu_kernel_sum.py FILE.csv [--per NAME_SUBSTRING [--rows N]]
Prints each kernel's launches, total and mean microseconds and share, longest first. With --per,
only whole steps count: the kernels after one launch of the kernel whose name contains
NAME_SUBSTRING (e.g. the sampler's merge, the last kernel of every decode step) up to and
including the next one, and the totals are given per step too. With --rows N, only the steps
whose RoPE kernels have a grid of N blocks (one per token: decode steps of batch N, not the
prefill chunks that share the sampler) count.
"""
import csv
import re
import sys


def short(name: str) -> str:
    # "void fp8rl::cuda::(anonymous namespace)::paged_mmat_kernel<3, ...>(...)" -> "paged_mmat_kernel<3, ...>"
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*$", "", name)  # the parameter list
    name = re.sub(r"^[\w:]*::", "", name)
    return name[:90]


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    per = rows_wanted = None
    if "--per" in sys.argv:
        per = sys.argv[sys.argv.index("--per") + 1]
    if "--rows" in sys.argv:
        rows_wanted = sys.argv[sys.argv.index("--rows") + 1]
    rows = list(csv.reader(open(sys.argv[1], newline="")))
    head = None
    for i, r in enumerate(rows):
        if "Kernel Name" in r and "gpu__time_duration.sum" in r:
            head = i
            break
    if head is None:
        print(f"{sys.argv[1]}: no kernel rows with gpu__time_duration.sum (ncu failed?)")
        return 1
    cols = rows[head]
    kn, tm = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    unit = rows[head + 1][tm] if head + 1 < len(rows) else ""
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit.strip(), None)
    start = head + 1 if scale is None else head + 2
    if scale is None:
        scale = 1e-3  # ncu's default unit for durations is ns
    gs = cols.index("Grid Size") if "Grid Size" in cols else None
    launches = [r for r in rows[start:]
                if len(r) > max(kn, tm) and r[tm].replace(".", "", 1).replace(",", "").isdigit()]
    segments = [launches]
    steps = None
    if per:  # whole steps: (one `per` launch, the next one]
        segments, cur, started = [], [], False
        for r in launches:
            if started:
                cur.append(r)
            if per in r[kn]:
                if started:
                    segments.append(cur)
                cur, started = [], True
        if not segments:
            print(f"warning: no two launches of '{per}': no whole step to count", file=sys.stderr)
        if rows_wanted is not None and gs is None:
            print("warning: the CSV has no 'Grid Size' column: --rows ignored", file=sys.stderr)
        if rows_wanted is not None and gs is not None:
            def rows_of(seg):
                # embedding_kernel: one block per row, for the step's tokens and for the rows whose
                # logits it selects; both are the batch in a decode step (a prefill chunk has more
                # tokens than rows).
                grids = {r[gs].strip("()").split(",")[0].strip() for r in seg if "embedding_kernel" in r[kn]}
                return grids.pop() if len(grids) == 1 else None
            skipped = len(segments)
            segments = [g for g in segments if rows_of(g) == rows_wanted]
            skipped -= len(segments)
            print(f"{len(segments)} steps of {rows_wanted} rows ({skipped} other steps left out)")
        steps = len(segments) or None
    agg = {}
    for seg in segments:
        for r in seg:
            k = short(r[kn])
            n, us = agg.get(k, (0, 0.0))
            agg[k] = (n + 1, us + float(r[tm].replace(",", "")) * scale)
    total = sum(us for _, us in agg.values())
    print(f"{sum(n for n, _ in agg.values())} kernels, {total:.1f} us"
          + (f", {steps} whole steps ('{per}' to '{per}'): {total / steps:.1f} us per step" if steps else ""))
    print(f"{'kernel':90s} {'launches':>8s} {'total us':>10s} {'mean us':>8s} {'share':>6s}" +
          (f" {'us/step':>8s}" if steps else ""))
    for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        line = f"{k:90s} {n:8d} {us:10.1f} {us / n:8.2f} {100 * us / total:5.1f}%"
        if steps:
            line += f" {us / steps:8.1f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
