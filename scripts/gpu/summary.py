"""The last tables of scripts/gpu/serve_wiring.sh, from the JSON its parts wrote to OUT:

- compare (issue #7): every compare_*.json (`tandem compare --json`), one row per run:
  setting, head, offline and online accept length, relative gap, per-position acceptance,
  rounds, whether the gap was flagged;
- bench (issue #6): bench_trace.json (`tandem bench --json`: tandem target-only and
  speculative, same prompts) next to hf_mtbench.json (scripts/reference/hf_mtbench_bench.py:
  HF transformers generate() on the same prompts and GPU).

A part that did not run (no JSON) prints nothing. Usage: python3 summary.py OUT_DIR
"""
import glob
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"(cannot read {path}: {e})")
        return None


def positions(values):
    return " ".join(f"{v:.2f}" for v in values)


def compare_table(out):
    paths = sorted(glob.glob(os.path.join(out, "compare_*.json")))
    reports = [(os.path.basename(p)[len("compare_"):-len(".json")], load(p)) for p in paths]
    reports = [(label, r) for label, r in reports if r]
    if not reports:
        return
    print("\n## compare: offline (engine drafting on the dump's taps, serving's rounds) vs online "
          "(speculative engine, MT-Bench), greedy\n")
    print("| run | steps/topk/tokens | head | dump samples / rounds | online prompts / rounds | "
          "offline accept length | online accept length | relative gap | offline per position | "
          "online per position | dump = target greedy | flagged |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in reports:
        s, d, o = r["setup"], r["drafted"], r["online"]
        greedy = d["greedy_equal"] / d["greedy_checked"] if d["greedy_checked"] else 0.0
        print(f"| {label} | {s['steps']}/{s['topk']}/{s['num_draft_tokens']} | {s['head']} | "
              f"{d['samples']} / {d['stats']['rounds']} | {o['prompts']} / {o['stats']['rounds']} | "
              f"{r['drafted_accept_length']:.3f} | {r['online_accept_length']:.3f} | "
              f"{100 * r['relative_gap']:+.1f}% | {positions(r['drafted_per_position'])} | "
              f"{positions(r['online_per_position'])} | {100 * greedy:.1f}% | "
              f"{'FLAG' if r['flagged'] else 'no'} |")


def bench_table(out):
    tandem = load(os.path.join(out, "bench_trace.json")) if os.path.exists(
        os.path.join(out, "bench_trace.json")) else None
    hf = load(os.path.join(out, "hf_mtbench.json")) if os.path.exists(
        os.path.join(out, "hf_mtbench.json")) else None
    if not tandem and not hf:
        return
    print("\n## bench: MT-Bench first turns, greedy, batch 1, same GPU, one run\n")
    print("| implementation | prompts | tokens | seconds | tok/s | vs tandem target-only | "
          "accept length | greedy identical to target-only |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    if tandem:
        c = tandem["config"]
        base = tandem["target_tokens_per_second"]
        print(f"| tandem target-only | {tandem['prompts']} | {tandem['target_tokens']} | "
              f"{tandem['target_seconds']:.1f} | {base:.1f} | 1.00x | - | - |")
        print(f"| tandem speculative {c['num_steps']}/{c['topk']}/{c['num_draft_tokens']} | "
              f"{tandem['prompts']} | {tandem['spec_tokens']} | {tandem['spec_seconds']:.1f} | "
              f"{tandem['spec_tokens_per_second']:.1f} | {tandem['speedup']:.2f}x | "
              f"{tandem['accept_length']:.2f} | "
              f"{tandem['identical_outputs']}/{tandem['compared_outputs']} |")
    if hf:
        s = hf["summary"]
        ratio = f"{s['tokens_per_second'] / base:.2f}x" if base else "-"
        print(f"| {s['impl']} {s['dtype']} generate() | {s['prompts']} | {s['tokens']} | "
              f"{s['seconds']:.1f} | {s['tokens_per_second']:.1f} | {ratio} | - | - |")


def main():
    out = sys.argv[1]
    compare_table(out)
    bench_table(out)


if __name__ == "__main__":
    main()
