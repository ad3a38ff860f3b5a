#!/usr/bin/env bash
# One device call, no GGUF transfer: flow counters (TANDEM_CUDA_FLOW=1) against the
# programmatic wait on a SmolLM2-shaped model with random bf16 weights made on the GPU machine
# (step times depend on the shapes, not the values), plus the GPU batch-invariance test with
# its flow modes. Here: `bash scripts/gpu/flow_ab.sh pack` (after `cargo build --release` and
# the GPU test binary: `rows_profile.sh pack` leaves .device/b/gpu-tests.xz); there (carry
# .device/x): `bash scripts/gpu/flow_ab.sh run`. Arms in order: defaults, flow, flow with the
# early trigger, defaults again (a drift of the card shows between the two default arms);
# ARMS="default flow default-again" for fewer; also flow-warp (session 52's spin, a poller a
# warp) and flow-sleep (a pause of FLOW_SLEEP_NS, default 100, between a block's polls).
set -uo pipefail
case "${1:-}" in
pack)
  rm -rf .device/x && mkdir -p .device/x/smol
  cp .device/a/tandem.xz .device/b/gpu-tests.xz .device/x/
  for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json generation_config.json; do
    [[ -f "models/SmolLM2-135M-Instruct/$f" ]] && cp "models/SmolLM2-135M-Instruct/$f" .device/x/smol/
  done
  du -b .device/x
  ;;
run)
  source "$(dirname "$0")/head_lib.sh"
  use_cublas_libraries
  W=/tmp/flow && mkdir -p "$W" && R=${OUT:-$W/out} && mkdir -p "$R"
  xz -dc .device/x/tandem.xz > "$W/tandem" && xz -dc .device/x/gpu-tests.xz > "$W/gpu-tests"
  chmod +x "$W/tandem" "$W/gpu-tests"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 120 python3 scripts/reference/make_random_llama.py "$W/smol" --config-from .device/x/smol \
    --tokenizer-from .device/x/smol 2>&1 | tail -1
  timeout 150 "$W/gpu-tests" --ignored --test-threads 1 --nocapture small_step_rows_are_batch_invariant \
    > "$R/test.log" 2>&1
  echo "batch-invariance GPU test (with the flow modes): exit $?"
  grep -E "^test |test result|panicked" "$R/test.log" | head
  for arm in ${ARMS:-default flow flow-early default-again}; do
    case $arm in
      default*) envs=() ;;
      flow) envs=(TANDEM_CUDA_FLOW=1) ;;
      flow-warp) envs=(TANDEM_CUDA_FLOW=1 TANDEM_CUDA_FLOW_SPIN=warp) ;;
      flow-sleep) envs=(TANDEM_CUDA_FLOW=1 TANDEM_CUDA_FLOW_SPIN=${FLOW_SLEEP_NS:-100}) ;;
      flow-early) envs=(TANDEM_CUDA_FLOW=1 TANDEM_CUDA_PDL_LATE=0) ;;
    esac
    env "${envs[@]}" timeout 100 "$W/tandem" fast-bench --model "$W/smol" --batch "${FAST_BATCH:-1,8}" \
      --verify-widths "${FAST_WIDTHS:-4,8}" --new-tokens 64 --repeats 3 --with-taps --graphs-only \
      --fused on --json "$R/fb-$arm.json" > "$R/fb-$arm.md" 2> "$R/fb-$arm.log"
    echo "fast-bench $arm (${envs[*]:-defaults}): exit $?; $(grep -h 'flow counters' "$R/fb-$arm.log")"
  done
  for arm in ${ARMS:-default flow flow-early default-again}; do
    grep -E "^\|" "$R/fb-$arm.md" | sed "s/^/$arm /"
  done
  ;;
*) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
