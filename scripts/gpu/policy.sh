#!/usr/bin/env bash
# H200, issue #16 (session 13): the speculation policy. GPU tests first (both binaries, so the
# session-12 refactor is re-run too), then MT-Bench bench at batch 1 for chain 3/1/4 and trees
# 3/4/8 and 5/8/32 (verify and draft+extend per round next to a decode step of the target-only
# baseline in the same run), then the serve load test (64 MT-Bench requests, 128 tokens) at
# concurrency 1, 8, 32 and 64: target-only, speculative with the adaptive policy, and (at 32)
# the fixed chain of earlier sessions.
#   here:     bash scripts/gpu/policy.sh pack        # .device/a .. .device/e
#   call 1 (carry .device/a): bash scripts/gpu/policy.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/policy.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/policy.sh start;  then: bash ... wait
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries
REQUESTS="${REQUESTS:-64}"
MAX_TOKENS="${MAX_TOKENS:-128}"

pipeline() {
  run_gpu_tests 400
  # Issue #17 papercut: the target alone on the fast path from a default build.
  timeout 120 "$T" generate --model "$M" --device cuda --chat --prompt "Name three colours." \
    --max-tokens 24 > "$R/generate_cuda.txt" 2>&1
  echo "generate --device cuda (no head): exit $?" | tee -a "$R/summary.txt"
  for s in ${SHAPES-3/1/4 3/4/8 5/8/32}; do
    bench "$W/head" head "$s"
  done
  [[ " ${KERNELS:-} " == *" cublas "* ]] && TANDEM_CUDA_FUSED=0 bench "$W/head" cublas 3/4/8
  mark "bench done"
  # Step times of the default kernels against cuBLAS alone (FAST_FUSED=1), as session 24 ran them.
  if [[ "${FAST_FUSED:-0}" == 1 ]]; then
    timeout 300 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4,8 --new-tokens 64 \
      --repeats 3 --with-taps --graphs-only --fused both --json "$R/fast_bench_fused.json" \
      > "$R/fast_bench_fused.md" 2> "$R/fast_bench_fused.log"
    echo "fast-bench --fused both: exit $?" | tee -a "$R/summary.txt"
  fi
  # Session 16: how decode and verify costs grow with the context every row's attention reads
  # (the policy's start-up table is measured at one context; serving runs at others).
  for p in ${CONTEXTS-128 512}; do
    timeout 200 "$T" fast-bench --model "$M" --batch 1,8,32 --verify-widths 4,8 --with-taps \
      --graphs-only --prompt-tokens "$p" --new-tokens 32 --repeats 3 \
      --json "$R/fast_bench_p$p.json" > "$R/fast_bench_p$p.md" 2>&1
  done
  mark "fast-bench done"
  for c in ${CONCURRENCIES:-1 8 32 64}; do
    serve_load "target-only_c$c" "$c" --no-draft
    serve_load "adaptive_c$c" "$c" --draft "$W/head"
    # Session 24: the same pair with every step of up to 8 rows on the batch-invariant fused
    # kernels (KERNELS=fused8), to price TANDEM_CUDA_FUSED=8 as a default; session 25, where
    # that is SmolLM2's default: the pair on cuBLAS alone (KERNELS=cublas).
    if [[ " ${KERNELS:-} " == *" fused8 "* ]]; then
      TANDEM_CUDA_FUSED=8 serve_load "target-only_fused8_c$c" "$c" --no-draft
      TANDEM_CUDA_FUSED=8 serve_load "adaptive_fused8_c$c" "$c" --draft "$W/head"
    fi
    if [[ " ${KERNELS:-} " == *" cublas "* ]]; then
      TANDEM_CUDA_FUSED=0 serve_load "target-only_cublas_c$c" "$c" --no-draft
      TANDEM_CUDA_FUSED=0 serve_load "adaptive_cublas_c$c" "$c" --draft "$W/head"
    fi
    mark "serve c$c done"
  done
  # Session 17: more same-run pairs at the concurrencies REPEAT_AT (default 32), where the
  # ratio sits near the 0.98 bar and one pair does not resolve 2%.
  for i in $(seq 1 "${REPEATS:-0}"); do
    for c in ${REPEAT_AT:-32}; do
      serve_load "target-only_c${c}_r$i" "$c" --no-draft
      serve_load "adaptive_c${c}_r$i" "$c" --draft "$W/head"
    done
  done
  [[ -n "${FIXED-1}" ]] && serve_load "fixed_c32" 32 --draft "$W/head" --speculation fixed --steps 3 --topk 1
  # Experiment (session 15): catch-ups extend the head over the last 16 deferred tokens only.
  for c in ${TAIL_CONCURRENCIES-8 32 64}; do
    TANDEM_CATCH_UP_TAIL=16 serve_load "tail16_c$c" "$c" --draft "$W/head"
  done
  mark "serve done"
  # Steady state: 256 requests at the high concurrencies.
  for c in ${LONG_CONCURRENCIES:-32 64}; do
    REQUESTS=256 serve_load "target-only_long_c$c" "$c" --no-draft
    REQUESTS=256 serve_load "adaptive_long_c$c" "$c" --draft "$W/head"
  done
  mark "long serve done"
}

report() {
  grep -E "^test |test result|panicked" "$R"/tests-*.log | tail -40
  cat "$R/summary.txt" 2>/dev/null
  grep -E "^\|" "$R/fast_bench_fused.md" 2>/dev/null
  tail -n 4 "$R/generate_cuda.txt" 2>/dev/null
  python3 - "$R" <<'PY'
import json, glob, os, sys
r = sys.argv[1]
print("| shape | accept | spec tok/s | target tok/s | speedup | decode ms | verify ms/round | verify/decode | draft+extend ms/round | (draft+extend)/decode |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(r, "bench_head_*.json"))):
    d = json.load(open(f))
    c, t = d["config"], d["timings"]
    rounds = d["spec_tokens"] / d["accept_length"]
    decode = d["target_seconds"] / d["target_tokens"] * 1e3
    verify = t["verify_s"] / rounds * 1e3
    de = (t["draft_s"] + t["extend_s"]) / rounds * 1e3
    print(f"| {c['num_steps']}/{c['topk']}/{c['num_draft_tokens']} | {d['accept_length']:.3f} | {d['spec_tokens_per_second']:.1f} | "
          f"{d['target_tokens_per_second']:.1f} | {d['speedup']:.3f} | {decode:.3f} | {verify:.3f} | {verify/decode:.2f} | {de:.3f} | {de/decode:.2f} |")
print()
print("| concurrency | target-only tok/s | adaptive tok/s | adaptive / target-only | adaptive tau | rounds by shape | fixed 3/1/4 tok/s | tail-16 catch-up tok/s (ratio, tau) |")
print("|---|---|---|---|---|---|---|---|")
for c in (1, 8, 32, 64):
    def load(label):
        try:
            return json.load(open(os.path.join(r, f"load_{label}_c{c}.json")))
        except (OSError, ValueError):
            return None
    base, ada, fixed, tail = load("target-only"), load("adaptive"), load("fixed"), load("tail16")
    if not base or not ada:
        print(f"| {c} | missing |"); continue
    shapes = ", ".join(f"{k} {v}" for k, v in ada.get("shapes", {}).items())
    fx = f"{fixed['tokens_per_second']:.1f}" if fixed else ""
    tl = (f"{tail['tokens_per_second']:.1f} ({tail['tokens_per_second'] / base['tokens_per_second']:.3f}, "
          f"{tail['accept_length']:.3f})") if tail else ""
    print(f"| {c} | {base['tokens_per_second']:.1f} | {ada['tokens_per_second']:.1f} | "
          f"{ada['tokens_per_second'] / base['tokens_per_second']:.3f} | {ada['accept_length']:.3f} | {shapes} | {fx} | {tl} |")
for kernels in ("fused8", "cublas"):
  for c in (1, 8, 32, 64):
    try:
        base = json.load(open(os.path.join(r, f"load_target-only_{kernels}_c{c}.json")))
        ada = json.load(open(os.path.join(r, f"load_adaptive_{kernels}_c{c}.json")))
    except (OSError, ValueError):
        continue
    shapes = ", ".join(f"{k} {v}" for k, v in ada.get("shapes", {}).items())
    print(f"| {c} ({kernels}) | {base['tokens_per_second']:.1f} | {ada['tokens_per_second']:.1f} | "
          f"{ada['tokens_per_second'] / base['tokens_per_second']:.3f} | {ada['accept_length']:.3f} | {shapes} | | |")
for f in sorted(glob.glob(os.path.join(r, "load_adaptive_c*_r*.json"))):
    c, run = os.path.basename(f)[len("load_adaptive_c"):-len(".json")].split("_r")
    ada = json.load(open(f))
    base = json.load(open(os.path.join(r, f"load_target-only_c{c}_r{run}.json")))
    shapes = ", ".join(f"{k} {v}" for k, v in ada.get("shapes", {}).items())
    print(f"| {c} (repeat {run}) | {base['tokens_per_second']:.1f} | {ada['tokens_per_second']:.1f} | "
          f"{ada['tokens_per_second'] / base['tokens_per_second']:.3f} | {ada['accept_length']:.3f} | {shapes} | | |")
PY
  for f in "$R"/load_*long*.log; do tail -n 2 "$f"; done
  grep -H "engine time\|scheduler time" "$R"/serve_*.txt | sed "s|$R/||"
  grep -h -A 16 "policy at the end" "$R"/serve_adaptive_long_c64.txt
  grep -h -A 20 "round costs measured" "$R"/serve_adaptive_c64.txt 2>/dev/null
}

run_phases "$0" "${1:-}" "${2:-}"
