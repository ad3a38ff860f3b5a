#!/usr/bin/env python3
"""Kernel time of each kind of step, from an ncu CSV of one `tandem fast-bench` run.

    python3 scripts/gpu/ncu_steps.py ncu.csv [--heads 9]

ncu (`--csv --metrics gpu__time_duration.sum,...`) lists every kernel of the run in launch
order. A step ends with its logits (`gemv_norm_rows_mma`, or `argmax_rows` right after it);
each step is named by what its attention ran: `qkv_attention_mma` (the one-launch q|k|v and
attention) or `attention_invariant` with rows x heads blocks. For each kind: the steps seen,
the median kernel time a step and its kernel count, then each kernel's mean time and count a
step. Set against a graphed step's device time (fast-bench), the difference is what the
launch boundaries cost on top of the kernels' own time.
"""
import argparse
import collections
import csv
import re
import statistics
import sys

UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def read_kernels(path):
    """[(id, name, grid, us)] in launch order."""
    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if not rows:
        sys.exit(f"{path}: no ncu CSV rows")
    head = rows[0]
    col = {c: head.index(c) for c in ("ID", "Kernel Name", "Grid Size", "Metric Name",
                                      "Metric Value", "Metric Unit")}
    kernels = {}
    for r in rows[1:]:
        k = kernels.setdefault(int(r[col["ID"]]), {"name": r[col["Kernel Name"]].split("(")[0],
                                                   "grid": r[col["Grid Size"]], "us": None})
        if r[col["Metric Name"]] == "gpu__time_duration.sum":
            unit = UNITS.get(r[col["Metric Unit"]])
            if unit is None:
                sys.exit(f"{path}: unknown time unit {r[col['Metric Unit']]!r}")
            k["us"] = float(r[col["Metric Value"]].replace(",", "")) * unit
    return [(i, k["name"], k["grid"], k["us"]) for i, k in sorted(kernels.items())
            if k["us"] is not None]


def split_steps(kernels):
    """Lists of kernels, each ending with a step's logits (and its argmax when one follows)."""
    steps, current = [], []
    for i, (kid, name, grid, us) in enumerate(kernels):
        current.append((name, grid, us))
        logits = name.startswith("gemv_norm_rows")
        next_is_argmax = i + 1 < len(kernels) and kernels[i + 1][1].startswith("argmax")
        if (logits and not next_is_argmax) or (name.startswith("argmax") and i > 0
                                               and kernels[i - 1][1].startswith("gemv_norm_rows")):
            steps.append(current)
            current = []
    return steps


def kind_of(step, heads):
    names = [n for n, _, _ in step]
    if any(n.startswith("qkv_attention") for n in names):
        return "one-launch attention"
    for n, grid, _ in step:
        if n.startswith("attention_invariant"):
            blocks = 1
            for v in re.findall(r"[0-9]+", grid):
                blocks *= int(v)
            return f"{blocks // heads} rows"
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2: 9)")
    args = ap.parse_args()
    steps = split_steps(read_kernels(args.csv))
    by_kind = collections.defaultdict(list)
    for s in steps:
        by_kind[kind_of(s, args.heads)].append(s)
    for kind, group in sorted(by_kind.items()):
        totals = [sum(us for _, _, us in s) for s in group]
        counts = [len(s) for s in group]
        print(f"STEP {kind}: {len(group)} steps, median {statistics.median(totals):.1f} us of "
              f"kernel time in {statistics.median(counts):.0f} kernels")
        per = collections.defaultdict(list)
        for s in group:
            seen = collections.Counter()
            for name, _, us in s:
                # A layer's two plain products share a kernel: o_proj first, then down_proj.
                if name == "gemv_rows_mma":
                    name += " (o_proj)" if seen[name] % 2 == 0 else " (down_proj)"
                    seen["gemv_rows_mma"] += 1
                per[name].append(us)
        for name, times in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {name:32s} {len(times) / len(group):6.1f} a step  mean {statistics.mean(times):6.2f} us"
                  f"  {sum(times) / len(group):7.1f} us a step")


if __name__ == "__main__":
    main()
