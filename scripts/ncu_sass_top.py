#!/usr/bin/env python3
"""The SASS instructions with the most warp-stall samples in an Nsight Compute source-page CSV.

Usage: ncu_sass_top.py SOURCE.csv [N]

The CSV is `ncu -i REPORT --page source --csv --print-source sass`. Its column names differ
between ncu versions, so the sample columns are found by name ("Sampling"); every column whose
name says "stall" or "Samples" and that holds numbers is summed over the kernel, and the top N
instructions are printed with their share of the samples and their three largest stall columns.
"""
import csv
import sys


def number(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return None


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    # The header: the first row that names the source column.
    start = next((i for i, r in enumerate(rows) if any(c.strip().lower() == "source" for c in r)), None)
    if start is None:
        print("no source header in", path, "; first lines:")
        for r in rows[:5]:
            print("  ", r[:8])
        return
    head = rows[start]
    body = [r for r in rows[start + 1:] if len(r) == len(head)]
    src = next(i for i, c in enumerate(head) if c.strip().lower() == "source")
    addr = next((i for i, c in enumerate(head) if "address" in c.lower()), None)
    samp = [i for i, c in enumerate(head) if "sampling" in c.lower()]
    if not samp:
        print("no sampling column; columns:", head)
        return
    total_col = next((i for i in samp if "all" in head[i].lower()), samp[0])
    stalls = [i for i, c in enumerate(head)
              if i not in samp and ("stall" in c.lower() or "samples" in c.lower())
              and any(number(r[i]) for r in body[:2000])]
    total = sum(number(r[total_col]) or 0 for r in body)
    print(f"{len(body)} instructions, {total:.0f} samples ({head[total_col]})")
    if stalls:
        sums = sorted(((sum(number(r[i]) or 0 for r in body), head[i]) for i in stalls), reverse=True)
        print("by stall column:", "; ".join(f"{n} {v / max(total, 1):.1%}" for v, n in sums[:10]))
    # Executed warp instructions by opcode (the SASS mnemonic without its modifiers).
    ex = next((i for i, c in enumerate(head) if c.strip().lower() == "instructions executed"), None)
    if ex is not None:
        ops = {}
        for r in body:
            words = r[src].split()
            if words and words[0].startswith("@"):
                words = words[1:]
            op = words[0].split(".")[0] if words else "?"
            ops[op] = ops.get(op, 0) + (number(r[ex]) or 0)
        n_ex = sum(ops.values())
        print(f"{n_ex:.0f} warp instructions executed; by opcode:",
              "; ".join(f"{o} {v / max(n_ex, 1):.1%}" for o, v in sorted(ops.items(), key=lambda t: -t[1])[:16]))
    body.sort(key=lambda r: -(number(r[total_col]) or 0))
    for r in body[:top]:
        v = number(r[total_col]) or 0
        if v == 0:
            break
        why = sorted(((number(r[i]) or 0, head[i]) for i in stalls), reverse=True)[:3]
        where = r[addr] if addr is not None else ""
        print(f"{v / max(total, 1):6.1%} {where:>8} {r[src][:70]:<70} " +
              ", ".join(f"{n} {x:.0f}" for x, n in why if x))


if __name__ == "__main__":
    main()
