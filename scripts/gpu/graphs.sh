#!/usr/bin/env bash
# H200, issue #16 (session 12): CUDA graphs for decode-sized steps of the target. GPU tests
# first (graph replay vs eager launches, the fast path vs burn, the fast speculative engine),
# then `tandem fast-bench` (eager launches and graphs in the same run: decode at batch 1, 8, 32
# and verification of 4- and 8-token trees), HF transformers (sdpa) decode in the same run, and
# MT-Bench speculative vs target-only with the committed head (graphs on for both; then with
# TANDEM_CUDA_GRAPHS=0, every kernel launched eagerly, as the baseline). Knobs: FAST_BENCH=0,
# HF=0 skip those parts; SHAPES (default 3/1/4 3/4/8 6/8/48).
#   here:     bash scripts/gpu/graphs.sh pack        # .device/a .. .device/e
#   call 1 (carry .device/a): bash scripts/gpu/graphs.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/graphs.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/graphs.sh start;  then: bash ... wait
set -uo pipefail
HEAD=heads/smollm2-135m-eagle3
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries

pipeline() {
  run_gpu_tests 300
  if [[ "${FAST_BENCH:-1}" == 1 ]]; then
    timeout 300 "$T" fast-bench --model "$M" --batch 1,8,32 --verify-widths 4,8 --new-tokens 64 \
      --repeats 3 --with-taps --json "$R/fast-bench.json" > "$R/fast-bench.md" 2> "$R/fast-bench.log"
    echo "fast-bench: exit $?" | tee -a "$R/summary.txt"
    mark "fast-bench done"
  fi
  # Speculative vs target-only, graphs on (the default), then every kernel launched eagerly
  # (TANDEM_CUDA_GRAPHS=0) as the baseline, back to back.
  for s in ${SHAPES:-3/1/4 3/4/8 6/8/48}; do
    bench "$W/head" head "$s"
    TANDEM_CUDA_GRAPHS=0 bench "$W/head" eager "$s"
  done
  mark "spec bench done"
  if [[ "${HF:-1}" == 1 ]]; then
    timeout 200 python3 "$W/hf_decode_bench.py" "$M" --batch 1,8,32 --attn sdpa --json "$R/hf.json" > "$R/hf.log" 2>&1
    mark "hf done"
  fi
}

report() {
  grep -E "^test |test result|panicked|graphs:" "$R"/tests-*.log | tail -30
  grep -h "time split" "$R"/bench_*.log
  cat "$R/fast-bench.md" 2>/dev/null
  tail -n 12 "$R/hf.log" 2>/dev/null
  cat "$R/summary.txt" 2>/dev/null
}

run_phases "$0" "${1:-}" "${2:-}"
