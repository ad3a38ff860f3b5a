#!/usr/bin/env bash
# H200, issue #15 at scale: regenerate millions of ShareGPT tokens with the fast path, train the
# head on them, prove parity against the PyTorch reference from the same initial weights, and
# bench the head on MT-Bench. One background pipeline on one warm machine; each device call
# either starts it or waits on it, so no phase is cut by the 10-minute call limit.
#
#   call 1 (carry .device/a):  bash scripts/gpu/scale_head.sh check
#        .device/a: part-a (the GGUF's first 47,000,000 bytes), tandem.xz (release build),
#        sharegpt-12k.jsonl.xz (scripts/reference/sharegpt_subset.py --prompts-only, MT-Bench and
#        HumanEval prompts excluded), question.jsonl (MT-Bench). Runs `tandem train-check`.
#   call 2 (carry .device/b):  bash scripts/gpu/scale_head.sh start
#        .device/b: part-b (the rest of the GGUF), gpu-tests.xz (the tandem-cuda GPU test binary).
#        Joins and imports the model, runs the fast path's GPU tests (attention, sampling, ...),
#        then starts the pipeline below in its own session and waits on it.
#   calls 3..:                 bash scripts/gpu/scale_head.sh wait
#        Waits (up to WAIT_SECONDS) and brings back what the pipeline has finished.
#   then, same machine:        bash scripts/gpu/scale_head.sh extend
#        Dump C (sg-b's records from 3,001 on, never touched by dump B) at REGEN_BATCH_C for
#        REGEN_SECONDS_C; the committed head on A + B + C; the MT-Bench sweep over SHAPES_C.
#        Session 8 ran this by hand in three calls (the same commands; BENCHMARKS.md).
#
# The pipeline: dump A (the first PARITY_ROWS conversations) and dump B (the rest, until
# REGEN_SECONDS_B or MAX_SAMPLES_B), sampled at TEMPERATURE/TOP_P on the GPU; the regenerated
# conversations (xz) for the repository; same-init parity on A (tandem train --max-steps 0
# exports the initial head; tandem and train_eagle3_ref.py both start from it); the head on
# A + B; MT-Bench bench sweep (80 first turns, 128 tokens, greedy, batch 1, speculative vs
# target-only in the same run).
set -uo pipefail
PHASE="${1:?usage: $0 check|start|wait|pipeline|extend}"
OUT="${OUT:-/tmp/out}"
W=/tmp/tandem
R="$W/results"
mkdir -p "$W" "$OUT" "$R" "$W/data/mtbench"
T="$W/tandem"
M="$W/smollm2"
LOG="$R/pipeline.log"
TEMPERATURE="${TEMPERATURE:-0.7}"
TOP_P="${TOP_P:-0.9}"
REGEN_BATCH="${REGEN_BATCH:-256}"
MAX_NEW="${MAX_NEW:-1024}"
MAX_LEN="${MAX_LEN:-2048}"
PARITY_ROWS="${PARITY_ROWS:-512}"
REGEN_SECONDS_A="${REGEN_SECONDS_A:-100}"
REGEN_SECONDS_B="${REGEN_SECONDS_B:-300}"
REGEN_BATCH_C="${REGEN_BATCH_C:-512}"
REGEN_SECONDS_C="${REGEN_SECONDS_C:-300}"
TRAIN_SECONDS_C="${TRAIN_SECONDS_C:-140}"
SHAPES_C="${SHAPES_C:-3/1/4 3/4/8 5/8/32 6/8/48 8/8/64}"
MAX_SAMPLES_B="${MAX_SAMPLES_B:-7000}"
TRAIN_BATCH="${TRAIN_BATCH:-16}"
LR="${LR:-5e-4}"
DRAFT_VOCAB="${DRAFT_VOCAB:-8192}"
PARITY_EPOCHS="${PARITY_EPOCHS:-2}"
EPOCHS="${EPOCHS:-10}"
TRAIN_SECONDS="${TRAIN_SECONDS:-240}"
SHAPES="${SHAPES:-3/1/4 3/4/8 4/4/16 5/8/32 6/8/48}"
WAIT_SECONDS="${WAIT_SECONDS:-560}"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }
mark() { echo "$(date +%T) $1" | tee -a "$R/phases.txt"; }

# Brings back what is finished: at most 8 files (the device tool's limit).
collect() {
  (cd "$R" && tar -cJf "$OUT/results.tar.xz" --exclude='*.xz' --exclude='head.safetensors*' . 2>/dev/null)
  for f in conversations-a.jsonl.xz conversations-b.jsonl.xz head.safetensors.part-aa head.safetensors.part-ab; do
    [[ -f "$R/$f" ]] && cp "$R/$f" "$OUT/"
  done
  ls -la "$OUT"
}

case "$PHASE" in
check)
  cp .device/a/part-a "$W/"
  cp .device/a/sharegpt-12k.jsonl.xz "$W/"
  cp .device/a/question.jsonl "$W/data/mtbench/"
  xz -dc .device/a/tandem.xz > "$T" && chmod +x "$T"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
  df -h /tmp | tail -1 | tee -a "$LOG"
  run "$T" train-check
  ;;
start)
  [[ -f .device/b/tandem.xz ]] && xz -dc .device/b/tandem.xz > "$T" && chmod +x "$T"
  cat "$W/part-a" .device/b/part-b > "$W/smollm2.gguf" && ls -la "$W/smollm2.gguf"
  run "$T" import-gguf "$W/smollm2.gguf" "$M" | tail -1
  rm -f "$W/smollm2.gguf" "$W/part-a"
  if [[ -f .device/b/gpu-tests.xz ]]; then
    xz -dc .device/b/gpu-tests.xz > "$W/gpu-tests" && chmod +x "$W/gpu-tests"
    # The fast path itself (attention, norms, caches, every mode against burn) must pass: a
    # broken kernel would poison the whole dump.
    if ! run "$W/gpu-tests" --ignored --test-threads 1 --skip sample_kernel; then
      mark "fast-path GPU tests FAILED: no pipeline"
      collect
      exit 1
    fi
    if run "$W/gpu-tests" --ignored sample_kernel; then
      mark "gpu tests passed"
    else
      # The sampling kernel is new: if its test fails, regenerate greedily (argmax, which the
      # serving tests cover) rather than from an unproven sampler.
      mark "sampling test FAILED: regenerating greedily"
      echo "TEMPERATURE=0" > "$W/override.env"
    fi
  fi
  cp "$0" "$W/scale_head.sh"
  setsid nohup bash "$W/scale_head.sh" pipeline > "$W/pipeline.out" 2>&1 < /dev/null &
  sleep 2
  exec bash "$0" wait
  ;;
wait)
  start=$(date +%s)
  while [[ ! -f "$R/done" ]] && (( $(date +%s) - start < WAIT_SECONDS )); do
    sleep 10
  done
  cat "$R/phases.txt" 2>/dev/null
  tail -n 40 "$LOG" | cut -c1-300
  df -h /tmp | tail -1
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  collect
  ;;
pipeline)
  [[ -f "$W/override.env" ]] && source "$W/override.env"
  mark "pipeline start (temperature $TEMPERATURE, top_p $TOP_P, regen batch $REGEN_BATCH)"
  xz -dc "$W/sharegpt-12k.jsonl.xz" > "$W/sg.jsonl"
  head -n "$PARITY_ROWS" "$W/sg.jsonl" > "$W/sg-a.jsonl"
  tail -n +"$((PARITY_ROWS + 1))" "$W/sg.jsonl" > "$W/sg-b.jsonl"
  for part in a b; do
    limit=(--max-seconds "$REGEN_SECONDS_A")
    [[ $part == b ]] && limit=(--max-seconds "$REGEN_SECONDS_B" --max-samples "$MAX_SAMPLES_B")
    run /usr/bin/time -f "dump $part wall %e s" "$T" dump --model "$M" --dataset "$W/sg-$part.jsonl" \
      --out "$W/dump-$part" --regenerate --max-new-tokens "$MAX_NEW" --max-len "$MAX_LEN" \
      --temperature "$TEMPERATURE" --top-p "$TOP_P" --seed 8 \
      --batch-size "$REGEN_BATCH" --shard-rows 256 --device cuda --quiet "${limit[@]}"
    run "$T" dump-info "$W/dump-$part"
    cp "$W/dump-$part/manifest.json" "$R/dump-$part-manifest.json"
    # The regenerated conversations: the repository keeps them, so a later run re-captures
    # (`tandem dump --dataset`, no --regenerate) instead of regenerating.
    cat "$W/dump-$part"/conversations-*.jsonl | xz -6 -T0 > "$R/conversations-$part.jsonl.xz"
    mark "dump $part done"
    df -h /tmp | tail -1 | tee -a "$LOG"
  done
  common=(--model "$M" --draft-vocab "$DRAFT_VOCAB" --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN"
          --lr "$LR" --val-fraction 0.1 --epochs "$PARITY_EPOCHS")
  run "$T" train --dump "$W/dump-a" --out "$W/init" "${common[@]}" --max-steps 0 --save-every 0 --device cuda --quiet
  run "$T" train --dump "$W/dump-a" --out "$W/head-a" "${common[@]}" --init-from "$W/init" --save-every 0 --device cuda --quiet
  cp "$W/head-a/metrics.jsonl" "$R/tandem-a-metrics.jsonl"
  mark "tandem parity run done"
  PYTHONUNBUFFERED=1 run timeout 400 python3 scripts/reference/train_eagle3_ref.py --dump "$W/dump-a" "${common[@]}" \
    --init-head "$W/init" --out "$R/ref-a.json" --tandem-metrics "$W/head-a/metrics.jsonl"
  mark "reference parity run done"
  run "$T" train --dump "$W/dump-a" --dump "$W/dump-b" --out "$W/head" --model "$M" \
    --draft-vocab "$DRAFT_VOCAB" --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN" --lr "$LR" \
    --epochs "$EPOCHS" --max-seconds "$TRAIN_SECONDS" --eval-every 1000 --save-every 0 \
    --device cuda --quiet --export-bf16
  cp "$W/head/config.json" "$W/head/curves.html" "$W/head/metrics.jsonl" "$R/"
  split -b 12M "$W/head/model.safetensors" "$R/head.safetensors.part-"
  sha256sum "$W/head/model.safetensors" | tee "$R/head.sha256"
  mark "head trained"
  for shape in $SHAPES; do
    IFS=/ read -r s k n <<< "$shape"
    echo "== bench $s/$k/$n" | tee -a "$LOG"
    timeout 200 "$T" bench --model "$M" --draft "$W/head" --device cuda --prompts mtbench \
      --data-root "$W/data" --max-prompts 80 --max-new-tokens 128 --steps "$s" --topk "$k" \
      --num-draft-tokens "$n" --batch 1 --json "$R/bench_${s}_${k}_${n}.json" 2>&1 \
      | grep -v '^wiring' | tail -8 | tee -a "$LOG"
    mark "bench $shape done"
  done
  touch "$R/done"
  mark "pipeline done"
  ;;
extend)
  tail -n +3001 "$W/sg-b.jsonl" > "$W/sg-c.jsonl"
  run /usr/bin/time -f "dump c wall %e s" "$T" dump --model "$M" --dataset "$W/sg-c.jsonl" \
    --out "$W/dump-c" --regenerate --max-new-tokens "$MAX_NEW" --max-len "$MAX_LEN" \
    --temperature "$TEMPERATURE" --top-p "$TOP_P" --seed 8 --batch-size "$REGEN_BATCH_C" \
    --shard-rows 256 --device cuda --quiet --max-seconds "$REGEN_SECONDS_C"
  run "$T" dump-info "$W/dump-c"
  cp "$W/dump-c/manifest.json" "$R/dump-c-manifest.json"
  cat "$W/dump-c"/conversations-*.jsonl | xz -6 -T0 > "$R/conversations-c.jsonl.xz"
  cp "$R/conversations-c.jsonl.xz" "$OUT/"
  run "$T" train --dump "$W/dump-a" --dump "$W/dump-b" --dump "$W/dump-c" --out "$W/head2" \
    --model "$M" --draft-vocab "$DRAFT_VOCAB" --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN" \
    --lr "$LR" --epochs "$EPOCHS" --max-seconds "$TRAIN_SECONDS_C" --eval-every 1500 \
    --save-every 0 --device cuda --quiet --export-bf16
  mkdir -p "$R/head2"
  cp "$W/head2/config.json" "$W/head2/curves.html" "$W/head2/metrics.jsonl" "$R/head2/"
  split -b 12M "$W/head2/model.safetensors" "$OUT/head2.safetensors.part-"
  sha256sum "$W/head2/model.safetensors" | tee "$R/head2/sha256"
  for shape in $SHAPES_C; do
    IFS=/ read -r s k n <<< "$shape"
    timeout 100 "$T" bench --model "$M" --draft "$W/head2" --device cuda --prompts mtbench \
      --data-root "$W/data" --max-prompts 80 --max-new-tokens 128 --steps "$s" --topk "$k" \
      --num-draft-tokens "$n" --batch 1 --json "$R/head2/bench_${s}_${k}_${n}.json" \
      > "$R/head2/bench_${s}_${k}_${n}.log" 2>&1
    python3 -c "import json; d=json.load(open('$R/head2/bench_${s}_${k}_${n}.json')); print('$shape', 'accept', round(d['accept_length'], 3), 'speedup', round(d['speedup'], 3))" | tee -a "$LOG"
  done
  (cd "$R" && tar -cJf "$OUT/results-extend.tar.xz" head2 pipeline.log dump-c-manifest.json)
  ;;
esac
