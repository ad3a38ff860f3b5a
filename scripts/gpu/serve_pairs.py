"""Ratios of interleaved serve load tests (head_lib.sh's serve_pairs).

Usage: python3 serve_pairs.py RESULTS_DIR BASELINE_LABEL LABEL...

Reads RESULTS_DIR/load_LABEL_rN.json for every repeat N that every label has, and prints one
line per label after the first (and one per adaptive-X against target-only-X where both ran):
its tokens/s to the baseline's, repeat by repeat (the loads of
one repeat ran back to back), then the median, the smallest and the largest. A ratio of medians
would pair a fast repeat of one server with a slow one of the other; the median of per-repeat
ratios does not. The geometric mean of the ratios and its standard error say how far from 1 a
ratio is in units of the repeat-to-repeat noise. A repeat where either load failed requests is
left out and counted.
"""

import glob
import json
import math
import os
import re
import statistics
import sys


def loads(root, label):
    """{repeat: report} of a label's loads."""
    found = {}
    pattern = re.compile(re.escape(f"load_{label}_r") + r"(\d+)\.json$")
    for path in glob.glob(os.path.join(root, f"load_{label}_r*.json")):
        m = pattern.search(os.path.basename(path))
        if m:
            with open(path) as f:
                found[int(m.group(1))] = json.load(f)
    return found


def ratios(baseline, other):
    """Per-repeat tokens/s ratios of `other` to `baseline`, and the repeats left out."""
    paired, dropped = [], []
    for rep in sorted(set(baseline) & set(other)):
        b, o = baseline[rep], other[rep]
        if b.get("failed", 0) or o.get("failed", 0) or not b.get("tokens_per_second"):
            dropped.append(rep)
            continue
        paired.append((rep, o["tokens_per_second"] / b["tokens_per_second"]))
    return paired, dropped


def summary_line(label, base_label, baseline, other):
    paired, dropped = ratios(baseline, other)
    if not paired:
        return f"{label} / {base_label}: no repeat with both loads complete"
    values = [r for _, r in paired]
    each = " ".join(f"{r:.3f}" for r in values)
    tps = statistics.median(other[rep]["tokens_per_second"] for rep, _ in paired)
    base_tps = statistics.median(baseline[rep]["tokens_per_second"] for rep, _ in paired)
    shapes = other[paired[-1][0]].get("shapes")
    # The geometric mean of the ratios and its standard error (from the logs' spread): how
    # far a ratio is from 1 in units of the repeat-to-repeat noise.
    logs = [math.log(r) for r in values]
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    line = (
        f"{label} / {base_label}: median {statistics.median(values):.3f} "
        f"(min {min(values):.3f}, max {max(values):.3f}; {len(values)} repeats: {each}); "
        f"geometric mean {math.exp(mean):.3f} (se {math.exp(mean) * se:.3f}); "
        f"median tok/s {tps:,.1f} / {base_tps:,.1f}"
    )
    if shapes:
        line += f"; last repeat's rounds by shape {shapes}"
    if dropped:
        line += f"; left out (failed requests): repeats {dropped}"
    return line


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    root, base_label, others = argv[1], argv[2], argv[3:]
    baseline = loads(root, base_label)
    if not baseline:
        print(f"{base_label}: no loads in {root}")
        return
    for label in others:
        print(summary_line(label, base_label, baseline, loads(root, label)))
    # adaptive-X against target-only-X as well (the same switch on both servers).
    for label in others:
        if not label.startswith("adaptive"):
            continue
        twin = "target-only" + label[len("adaptive"):]
        if twin != base_label and twin in others:
            print(summary_line(label, twin, loads(root, twin), loads(root, label)))


if __name__ == "__main__":
    main(sys.argv)
