#!/usr/bin/env python3
"""Kernel time of each kind of step, from an ncu CSV of one `tandem fast-bench` run.

    python3 scripts/gpu/ncu_steps.py ncu.csv [--heads 9]

ncu (`--csv --metrics gpu__time_duration.sum,...`) lists every kernel of the run in launch
order (fast-bench, or `tandem bench` with a head). A step ends with its logits
(`gemv_norm_rows_mma`) and the kernels that finish it (TAIL). The target's steps are named by
what their attention ran: `qkv_attention_mma` (the one-launch q|k|v and attention) or
`attention_invariant` with rows x heads blocks; the head's (logits over fewer tiles) as
extends or draft steps. For each kind: the steps seen,
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


# Kernels that finish a step after its logits: the greedy ids, an extend's roots for the next
# chain, a chain's tokens scattered into the verification's input.
TAIL = ("argmax_rows", "gather_accepted_roots", "scatter_chain_tokens")


def split_steps(kernels):
    """Lists of (name, grid, us), each ending with a step's logits and the TAIL kernels after them."""
    steps, current, after_logits = [], [], False
    for _, name, grid, us in kernels:
        if after_logits and not name.startswith(TAIL):
            steps.append(current)
            current, after_logits = [], False
        current.append((name, grid, us))
        after_logits = after_logits or name.startswith("gemv_norm_rows")
    if current:
        steps.append(current)
    return steps


def grid_dims(grid):
    return [int(v) for v in re.findall(r"[0-9]+", grid)]


def kind_of(step, heads, target_tiles):
    """The target's steps by their attention, the EAGLE-3 head's (logits of fewer tiles: its
    draft vocabulary) as extends (fc input from the taps) or draft steps."""
    names = [n for n, _, _ in step]
    logits = [grid_dims(g) for n, g, _ in step if n.startswith("gemv_norm_rows")]
    if not logits:
        return "other"
    if logits[-1][1] < target_tiles:
        extend = any(n.startswith(("taps_to_bf16", "gather_accepted_roots")) for n in names)
        return "head extend" if extend else "head draft"
    if any(n.startswith("qkv_attention") for n in names):
        return "one-launch attention"
    for n, grid, _ in step:
        if n.startswith("attention_invariant"):
            blocks = 1
            for v in grid_dims(grid):
                blocks *= v
            return f"{blocks // heads} rows"
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2: 9)")
    args = ap.parse_args()
    steps = split_steps(read_kernels(args.csv))
    # The target's logits span the most tiles (grid y) of any step's.
    target_tiles = max((grid_dims(g)[1] for s in steps for n, g, _ in s
                        if n.startswith("gemv_norm_rows")), default=0)
    by_kind = collections.defaultdict(list)
    for s in steps:
        by_kind[kind_of(s, args.heads, target_tiles)].append(s)
    for kind, group in sorted(by_kind.items()):
        totals = [sum(us for _, _, us in s) for s in group]
        counts = [len(s) for s in group]
        print(f"STEP {kind}: {len(group)} steps, median {statistics.median(totals):.1f} us of "
              f"kernel time in {statistics.median(counts):.0f} kernels")
        per = collections.defaultdict(list)
        for s in group:
            # A layer's plain products share a kernel: o_proj, then down_proj (an extend's fc
            # before them).
            labels = ["fc"] if kind == "head extend" else []
            products = 0
            for name, _, us in s:
                if name == "gemv_rows_mma":
                    if products < len(labels):
                        label = labels[products]
                    else:
                        label = ("o_proj", "down_proj")[(products - len(labels)) % 2]
                    name += f" ({label})"
                    products += 1
                per[name].append(us)
        for name, times in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {name:32s} {len(times) / len(group):6.1f} a step  mean {statistics.mean(times):6.2f} us"
                  f"  {sum(times) / len(group):7.1f} us a step")


if __name__ == "__main__":
    main()
