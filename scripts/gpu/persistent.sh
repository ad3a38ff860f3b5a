#!/usr/bin/env bash
# H200, issue #16: batch-invariant small steps. The persistent step (a whole step of at most 8
# rows in one launch, grid barriers between the phases; `persistent_step` in kernels/llama.cu)
# and the fused kernels with the batch-invariant attention (TANDEM_CUDA_FUSED=8). GPU tests
# first (the invariance ones, then every suite), then `tandem fast-bench` (unfused as the
# baseline, fused at 8 rows and the persistent step, same process, CUDA graphs), HF
# transformers (sdpa) decode at batch 1 in the same run, and MT-Bench at batch 1 with the
# committed head, target-only and speculative on the same kernels (each bench measures its own
# target-only baseline), plus tree 3/4/8 on the default kernels as the old baseline.
# Knobs: SHAPES (default 3/1/4 3/4/8), HF=0, TESTS=0, PROFILE=0.
#   here:     cargo build --release && bash scripts/gpu/persistent.sh pack   # .device/a .. .device/e
#             KEEP_HEAD=1 bash scripts/gpu/lean_tree.sh enter   # the tree and a piece exceed 64 MiB otherwise
#   call 1 (carry .device/a): bash scripts/gpu/persistent.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/persistent.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/persistent.sh start;  later calls: bash ... wait
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries

pipeline() {
  if [[ "${TESTS:-1}" == 1 ]]; then
    timeout 240 "$W/gpu-tests" --ignored --test-threads 1 persistent invariant fused \
      > "$R/tests-persistent.log" 2>&1
    echo "invariance GPU tests: exit $?" | tee -a "$R/summary.txt"
    mark "persistent tests done"
  fi
  TANDEM_CUDA_FUSED=8 timeout 300 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4,8 --new-tokens 64 \
    --repeats 3 --with-taps --graphs-only --fused both --persistent --json "$R/fast-bench.json" \
    > "$R/fast-bench.md" 2> "$R/fast-bench.log"
  status=$?
  echo "fast-bench: exit $status" | tee -a "$R/summary.txt"
  if [[ $status != 0 ]]; then
    # A plain launch instead of a cooperative one (in case the driver refuses the latter in a
    # graph capture).
    TANDEM_CUDA_COOPERATIVE=0 timeout 200 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4,8 \
      --new-tokens 64 --repeats 3 --graphs-only --fused off --persistent \
      > "$R/fast-bench-plain.md" 2> "$R/fast-bench-plain.log"
    echo "fast-bench, plain launch: exit $?" | tee -a "$R/summary.txt"
  fi
  # Where a persistent step's time goes (block 0's clock at every grid barrier), and the same
  # step compiled with 8 warps a block (twice the registers per thread).
  [[ "${PROFILE:-1}" == 1 ]] && TANDEM_CUDA_PERSISTENT_PROFILE=1 timeout 120 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4 \
    --new-tokens 32 --repeats 1 --graphs-only --fused off --persistent \
    > "$R/fast-bench-profile.md" 2> "$R/fast-bench-profile.log"
  echo "fast-bench with the profile: exit $?" | tee -a "$R/summary.txt"
  [[ "${PROFILE:-1}" == 1 ]] && TANDEM_CUDA_PERSISTENT_WARPS=8 timeout 200 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4,8 \
    --new-tokens 64 --repeats 3 --with-taps --graphs-only --fused off --persistent \
    > "$R/fast-bench-8warps.md" 2> "$R/fast-bench-8warps.log"
  echo "fast-bench, 8 warps a block: exit $?" | tee -a "$R/summary.txt"
  mark "fast-bench done"
  for s in ${SHAPES:-3/1/4 3/4/8}; do
    TANDEM_CUDA_FUSED=8 bench "$W/head" fused8 "$s"
    TANDEM_CUDA_PERSISTENT=8 bench "$W/head" persistent "$s"
  done
  TANDEM_CUDA_FUSED=4 bench "$W/head" fused4 3/4/8
  bench "$W/head" default 3/4/8
  mark "spec bench done"
  if [[ "${HF:-1}" == 1 ]]; then
    timeout 150 python3 "$W/hf_decode_bench.py" "$M" --batch 1 --attn sdpa --json "$R/hf.json" > "$R/hf.log" 2>&1
    mark "hf done"
  fi
  if [[ "${TESTS:-1}" == 1 ]]; then
    run_gpu_tests 400
    # The engine's GPU tests (greedy speculative output equal to target-only output, policy
    # rounds, running batches) with every step of at most 8 rows on the persistent step.
    TANDEM_CUDA_PERSISTENT=8 timeout 400 "$W/gpu-fast-tests" --ignored --test-threads 1 \
      > "$R/tests-infer-persistent.log" 2>&1
    echo "tandem-infer GPU tests with TANDEM_CUDA_PERSISTENT=8: exit $?" | tee -a "$R/summary.txt"
    TANDEM_CUDA_FUSED=8 timeout 400 "$W/gpu-fast-tests" --ignored --test-threads 1 \
      > "$R/tests-infer-fused8.log" 2>&1
    echo "tandem-infer GPU tests with TANDEM_CUDA_FUSED=8: exit $?" | tee -a "$R/summary.txt"
  fi
}

report() {
  grep -hE "^test .*(FAILED|ok)$|test result|panicked" "$R"/tests-*.log | tail -40
  grep -h "persistent step:" "$R"/fast-bench*.log
  grep -h "persistent profile" "$R"/fast-bench-profile.log
  cat "$R/fast-bench.md" 2>/dev/null
  grep -E "persistent" "$R/fast-bench-8warps.md" 2>/dev/null | sed 's/^/8 WARPS /'
  grep -E "^\|" "$R/fast-bench-plain.md" 2>/dev/null | sed 's/^/PLAIN /'
  tail -n 6 "$R/hf.log" 2>/dev/null
  cat "$R/summary.txt" 2>/dev/null
}

run_phases "$0" "${1:-}" "${2:-}"
