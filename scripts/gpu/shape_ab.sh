#!/usr/bin/env bash
# One device call, no GGUF transfer: fast-bench arms (environment switches) on a SmolLM2-shaped
# model with random bf16 weights made on the GPU machine (step times depend on the shapes, not
# the values), after one GPU test (the batch-invariance test by default). Here: `bash
# scripts/gpu/shape_ab.sh pack` (after `cargo build --release` and the GPU test binary:
# `rows_profile.sh pack` leaves .device/a/tandem.xz and .device/b/gpu-tests.xz); there (carry
# .device/x): `ARMS="- TANDEM_CUDA_PDL_LATE=0 -" bash scripts/gpu/shape_ab.sh run`. Each arm is
# `-` (the defaults) or comma-separated VAR=VALUE switches; repeat `-` last, so that a drift of
# the card shows between the two default arms. Its predecessor, flow_ab.sh, measured the flow
# counters in session 53; it measured the one-launch q|k|v and attention's switch (BENCHMARKS.md).
# NCU=1: also each kernel's own time by kind of step (below); NCU_BENCH=1 the same for
# speculative rounds with the committed head.
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
  W=/tmp/shape_ab && mkdir -p "$W" && R=${OUT:-$W/out} && mkdir -p "$R"
  xz -dc .device/x/tandem.xz > "$W/tandem" && xz -dc .device/x/gpu-tests.xz > "$W/gpu-tests"
  chmod +x "$W/tandem" "$W/gpu-tests"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 120 python3 scripts/reference/make_random_llama.py "$W/smol" --config-from .device/x/smol \
    --tokenizer-from .device/x/smol 2>&1 | tail -1
  test_name=${TEST:-small_step_rows_are_batch_invariant}
  timeout 150 "$W/gpu-tests" --ignored --test-threads 1 --nocapture "$test_name" > "$R/test.log" 2>&1
  echo "GPU test $test_name: exit $?"
  grep -E "^test |test result|panicked" "$R/test.log" | head
  arms=(${ARMS:--})
  for i in "${!arms[@]}"; do
    arm=${arms[$i]}
    envs=()
    [[ $arm != - ]] && IFS=, read -r -a envs <<< "$arm"
    env "${envs[@]}" timeout 100 "$W/tandem" fast-bench --model "$W/smol" --batch "${FAST_BATCH:-1,8}" \
      --verify-widths "${FAST_WIDTHS:-4,8}" --new-tokens 64 --repeats 3 --with-taps --graphs-only \
      --fused on --json "$R/fb-$i.json" > "$R/fb-$i.md" 2> "$R/fb-$i.log"
    echo "fast-bench arm $i (${envs[*]:-defaults}): exit $?"
  done
  for i in "${!arms[@]}"; do
    grep -E "^\| fast" "$R/fb-$i.md" | sed "s/^/arm $i /"
  done
  # NCU=1: each kernel's own time (ncu, eager launches, caches kept between kernels as in the
  # pipeline) in batch-1 decodes and 4- and 8-token verifications, by kind of step
  # (scripts/gpu/ncu_steps.py); the graphed step's device time above minus this is what the
  # launch boundaries cost.
  # ncu_steps NAME LAUNCHES TANDEM_ARGS...: ncu over one eager tandem run (at most LAUNCHES
  # kernels), its kernels by kind of step into $R/NAME_steps.txt.
  ncu_steps() {
    local name=$1 launches=$2 ncu
    shift 2
    ncu=$(find_tool ncu)
    [[ -n "$ncu" ]] || { echo "ncu missing"; return 1; }
    TANDEM_CUDA_GRAPHS=0 timeout 280 "$ncu" --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --launch-count "$launches" "$W/tandem" "$@" \
      > "$R/$name.csv" 2> "$R/$name.err"
    echo "ncu $name: exit $?"
    python3 scripts/gpu/ncu_steps.py "$R/$name.csv" | tee "$R/${name}_steps.txt"
  }
  if [[ "${NCU:-0}" == 1 ]]; then
    ncu_steps ncu 6000 fast-bench --model "$W/smol" --prompt-tokens 128 --new-tokens 8 \
      --repeats 1 --batch 1 --verify-widths 4,8 --fused on
  fi
  # NCU_BENCH=1: speculative rounds (3/1/4, batch 1) with the committed head on the random
  # target (KEEP_HEAD=1 lean tree; MT-Bench questions carried as .device/x/question.jsonl; the
  # target's weights are not the head's, so drafts are rejected, but every step has the shape
  # of a real round's): the phase-timed bench (graphed), then ncu over a few rounds with each
  # kernel by kind of step, the head's extends and draft steps among them.
  if [[ "${NCU_BENCH:-0}" == 1 ]]; then
    mkdir -p "$W/data/mtbench" && cp .device/x/question.jsonl "$W/data/mtbench/"
    spec=(bench --model "$W/smol" --draft heads/smollm2-135m-eagle3 --allow-wiring-mismatch
      --device cuda --prompts mtbench --data-root "$W/data" --steps 3 --topk 1
      --num-draft-tokens 4 --batch 1)
    timeout 150 "$W/tandem" "${spec[@]}" --max-prompts 8 --max-new-tokens 64 --phase-timing \
      --json "$R/bench.json" > "$R/bench.log" 2>&1
    echo "phase-timed bench: exit $?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if isinstance(v, (int, float))})" "$R/bench.json"
    ncu_steps ncu-bench 8000 "${spec[@]}" --max-prompts 2 --max-new-tokens 24 --no-baseline
  fi
  ;;
*) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
