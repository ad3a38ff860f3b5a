"""Same-run table of rows_profile.sh's MMA_AB: fast-bench with the row attention kernel and
with the tensor-core one (kernels/attention_mma.cu), prompt by prompt length.

Usage: python3 mma_ab.py RESULTS_DIR   (reads prefill-{rows,mma}-{128,512}.json)

One line per (prompt tokens, step, batch): the prefill's TTFT and the step's median ms under
each kernel, and the row kernel's time over the tensor cores' (above 1: the tensor cores are
faster). Decode steps (one slot a sequence) run the row kernel in both arms: their ratio is the
run's noise.
"""

import json
import os
import sys


def load(root, arm, prompt):
    path = os.path.join(root, f"prefill-{arm}-{prompt}.json")
    try:
        with open(path) as f:
            return {(r["step"], r["width"], r["batch"]): r for r in json.load(f)}
    except (OSError, ValueError) as e:
        print(f"{path}: no report ({e})")
        return None


def main(root):
    print("| prompt | step | batch | TTFT ms rows / mma | x | step ms rows / mma | x |")
    print("|---|---|---|---|---|---|---|")
    for prompt in (128, 512):
        rows, mma = load(root, "rows", prompt), load(root, "mma", prompt)
        if rows is None or mma is None:
            continue
        for key in sorted(rows, key=lambda k: (k[0], k[1], k[2])):
            if key not in mma:
                continue
            a, b = rows[key], mma[key]
            step = "decode" if key[0] == "decode" else f"verify {key[1]}"
            print(
                f"| {prompt} | {step} | {key[2]} | {a['ttft_ms_median']:.2f} / {b['ttft_ms_median']:.2f} "
                f"| {a['ttft_ms_median'] / b['ttft_ms_median']:.2f} | {a['step_ms_median']:.3f} / "
                f"{b['step_ms_median']:.3f} | {a['step_ms_median'] / b['step_ms_median']:.2f} |"
            )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
