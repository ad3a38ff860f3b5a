"""Same-run table of rows_profile.sh's MMA_AB: fast-bench with the row attention kernel and
with the tensor-core one (kernels/attention_mma.cu) from each width N, prompt length by prompt
length.

Usage: python3 mma_ab.py RESULTS_DIR PROMPT... -- N...
(reads prefill-rows-P.json and prefill-N-P.json)

One line per (prompt tokens, step, batch): the prefill's TTFT and the step's median ms with the
row kernel, then for each N the same and the row kernel's time over it (above 1: faster with
the tensor cores). Steps narrower than N run the row kernel in both arms (the fused steps of at
most 8 rows always do): their ratio is the run's noise.
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


def main(root, prompts, widths):
    head = "| prompt | step | batch | rows: TTFT ms, step ms |"
    head += "".join(f" N={n}: TTFT ms (x), step ms (x) |" for n in widths)
    print(head)
    print("|---" * (4 + len(widths)) + "|")
    for prompt in prompts:
        base = load(root, "rows", prompt)
        arms = [load(root, n, prompt) for n in widths]
        if base is None:
            continue
        for key in sorted(base, key=lambda k: (k[0], k[1], k[2])):
            a = base[key]
            step = "decode" if key[0] == "decode" else f"verify {key[1]}"
            line = f"| {prompt} | {step} | {key[2]} | {a['ttft_ms_median']:.2f}, {a['step_ms_median']:.3f} |"
            for arm in arms:
                b = (arm or {}).get(key)
                if b is None:
                    line += " - |"
                    continue
                line += (
                    f" {b['ttft_ms_median']:.2f} ({a['ttft_ms_median'] / b['ttft_ms_median']:.2f}),"
                    f" {b['step_ms_median']:.3f} ({a['step_ms_median'] / b['step_ms_median']:.2f}) |"
                )
            print(line)


if __name__ == "__main__":
    if "--" not in sys.argv[2:]:
        sys.exit(__doc__)
    cut = sys.argv.index("--")
    main(sys.argv[1], sys.argv[2:cut], sys.argv[cut + 1 :])
