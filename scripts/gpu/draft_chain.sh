#!/usr/bin/env bash
# H200, issue #16: greedy draft chains on the GPU (`CudaDraft::draft_chain`: each step's argmax
# mapped through d2t on the device into the next step's tokens, one read-back a chain) against
# the host loop (`TANDEM_CUDA_DEVICE_CHAIN=0`: read each argmax back, build the next step), same
# binary, same run. Then the Qwen2.5-1.5B-shaped random model's step times with the fused
# kernels at 8 rows against cuBLAS (whether `TANDEM_CUDA_FUSED=8` can be the default for the
# second target too), and every GPU suite (tandem-infer's also with TANDEM_CUDA_FUSED=8).
# Knobs: SHAPES (chain shapes, default 3/1/4 5/1/6), QWEN=0, TESTS=0.
#   here:     cargo build --release && bash scripts/gpu/persistent.sh pack   # .device/a .. .device/e
#             KEEP_HEAD=1 bash scripts/gpu/lean_tree.sh enter
#   call 1 (carry .device/a): bash scripts/gpu/draft_chain.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/draft_chain.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/draft_chain.sh start;  later calls: ... wait
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries
EXTRA_FILES="scripts/reference/make_random_llama.py"

pipeline() {
  if [[ "${TESTS:-1}" == 1 ]]; then
    timeout 200 "$W/gpu-fast-tests" --ignored --test-threads 1 device_chain > "$R/tests-chain.log" 2>&1
    echo "device chain GPU test: exit $?" | tee -a "$R/summary.txt"
  fi
  # Device chain vs host chain, each with every step of up to 8 rows fused (the default now)
  # and on cuBLAS (TANDEM_CUDA_FUSED=0, the old default); each bench measures its own
  # target-only baseline on the same kernels.
  for s in ${SHAPES:-3/1/4 5/1/6}; do
    for kernels in fused8 cublas; do
      fused=0; [[ $kernels == fused8 ]] && fused=8
      TANDEM_CUDA_FUSED=$fused bench "$W/head" "$kernels-device" "$s"
      rounds_line "$kernels-device" "$s"
      TANDEM_CUDA_FUSED=$fused TANDEM_CUDA_DEVICE_CHAIN=0 bench "$W/head" "$kernels-host" "$s"
      rounds_line "$kernels-host" "$s"
    done
  done
  TANDEM_CUDA_FUSED=8 bench "$W/head" fused8-tree 3/4/8
  rounds_line fused8-tree 3/4/8
  mark "spec bench done"
  if [[ "${QWEN:-1}" == 1 ]]; then
    python3 make_random_llama.py "$W/qwen-random" --shape qwen2.5-1.5b --tokenizer-from "$M" \
      > "$R/qwen-make.log" 2>&1
    echo "qwen-shaped model: $(tail -1 "$R/qwen-make.log")" | tee -a "$R/summary.txt"
    TANDEM_CUDA_FUSED=8 timeout 300 "$T" fast-bench --model "$W/qwen-random" --batch 1,8 \
      --verify-widths 4,8 --new-tokens 32 --repeats 3 --with-taps --graphs-only --fused both \
      --json "$R/qwen-fast-bench.json" > "$R/qwen-fast-bench.md" 2> "$R/qwen-fast-bench.log"
    echo "qwen-shaped fast-bench: exit $?" | tee -a "$R/summary.txt"
    rm -rf "$W/qwen-random"
    mark "qwen-shaped fast-bench done"
  fi
  if [[ "${TESTS:-1}" == 1 ]]; then
    run_gpu_tests 400
    TANDEM_CUDA_FUSED=8 timeout 400 "$W/gpu-fast-tests" --ignored --test-threads 1 \
      > "$R/tests-infer-fused8.log" 2>&1
    echo "tandem-infer GPU tests with TANDEM_CUDA_FUSED=8: exit $?" | tee -a "$R/summary.txt"
  fi
}

report() {
  grep -hE "^test .*(FAILED|ok)$|test result|panicked" "$R"/tests-*.log | tail -50
  cat "$R/qwen-fast-bench.md" 2>/dev/null
  cat "$R/summary.txt" 2>/dev/null
}

run_phases "$0" "${1:-}" "${2:-}"
