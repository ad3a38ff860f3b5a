#!/usr/bin/env bash
# H200, issue #16 (session 18): the fused small-step kernels (steps of at most 8 rows: decode
# and tree verification at small batch run five launches a layer instead of nine). GPU tests
# first (`fused_small_steps_match_the_unfused_kernels` and every earlier one), then `tandem
# fast-bench --fused both` (unfused, as the baseline, then fused, in the same run; CUDA graphs
# on), MT-Bench at batch 1 with the committed head (the bench's own target-only baseline in the
# same run; the fused kernels on with TANDEM_CUDA_FUSED=4, tree 3/4/8 also without), HF transformers (sdpa) decode in the
# same run, and ncu's kernel-by-kernel times of a fused batch-1 decode step (eager launches).
# Knobs: SHAPES (default 3/1/4 3/4/8 5/8/32), NCU=0, HF=0, TESTS=0, PDL=0.
#   here:     cargo build --release && bash scripts/gpu/fused.sh pack   # .device/a .. .device/e
#   call 1 (carry .device/a): bash scripts/gpu/fused.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/fused.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/fused.sh start;  later calls: bash ... wait
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries

pipeline() {
  [[ "${TESTS:-1}" == 1 ]] && run_gpu_tests 300
  timeout 400 "$T" fast-bench --model "$M" --batch 1,8,32 --verify-widths 4,8 --new-tokens 64 \
    --repeats 3 --with-taps --graphs-only --fused both --json "$R/fast-bench.json" \
    > "$R/fast-bench.md" 2> "$R/fast-bench.log"
  echo "fast-bench: exit $?" | tee -a "$R/summary.txt"
  # The same steps with programmatic dependent launch (an experiment, off by default: each
  # small-step kernel starts while the previous one runs and waits for it before reading).
  [[ "${PDL:-1}" == 1 ]] && TANDEM_CUDA_PDL=1 timeout 300 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4,8 \
    --new-tokens 64 --repeats 3 --graphs-only --fused both > "$R/fast-bench-pdl.md" 2> "$R/fast-bench-pdl.log"
  echo "fast-bench with PDL: exit $?" | tee -a "$R/summary.txt"
  mark "fast-bench done"
  for s in ${SHAPES:-3/1/4 3/4/8 5/8/32}; do
    TANDEM_CUDA_FUSED=4 bench "$W/head" fused "$s"
  done
  bench "$W/head" unfused 3/4/8
  mark "spec bench done"
  if [[ "${HF:-1}" == 1 ]]; then
    timeout 200 python3 "$W/hf_decode_bench.py" "$M" --batch 1,8 --attn sdpa --json "$R/hf.json" > "$R/hf.log" 2>&1
    mark "hf done"
  fi
  if [[ "${NCU:-1}" == 1 ]]; then
    ncu_decode_profile ncu 1200
    mark "ncu exit $?"
  fi
}

report() {
  grep -hE "^test .*(FAILED|ok)$|test result|panicked" "$R"/tests-*.log | tail -30
  grep -h "time split" "$R"/bench_*.log
  cat "$R/fast-bench.md" 2>/dev/null
  grep -E "^\|" "$R/fast-bench-pdl.md" 2>/dev/null | sed 's/^/PDL /'
  tail -n 12 "$R/hf.log" 2>/dev/null
  head -n 24 "$R/ncu_summary.txt" 2>/dev/null
  cat "$R/summary.txt" 2>/dev/null
}

run_phases "$0" "${1:-}" "${2:-}"
