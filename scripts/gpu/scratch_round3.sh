#!/usr/bin/env bash
# H200, issue #15 (session 11), third round on the same warm machine. Round 2: c10s (c10 on rows
# cut to 256 tokens) 1.991, c10h (committed, lr 2e-4, 4 epochs on openings) 1.986, c20 (c10 on
# openings again) 1.983. Side by side, each on rows cut to 256 tokens, 3 epochs:
#   c20s: c20, lr 1e-4;  c10hs: c10h, lr 1e-4;  c10ss: c10s again, lr 5e-5.
# Usage: bash scripts/gpu/scratch_round3.sh start | wait
set -uo pipefail
W=/tmp/tandem; R=$W/results; T=$W/tandem; M=$W/smollm2; OUT="${OUT:-/tmp/out}"
LOG=$R/pipeline.log
source "$(dirname "$0")/head_lib.sh"
case "$1" in
start)
  cp "$0" "$W/scratch_round3.sh"; cp "$(dirname "$0")/head_lib.sh" "$W/"
  setsid nohup bash "$W/scratch_round3.sh" pipeline > "$W/round3.out" 2>&1 < /dev/null &
  sleep 2; exec bash "$0" wait ;;
wait)
  start=$(date +%s)
  while [[ ! -f "$R/done3" ]] && (( $(date +%s) - start < ${WAIT_SECONDS:-560} )); do sleep 10; done
  cat "$R/phases.txt"; grep -E "^c" "$R/summary.txt" | tail -12; tail -5 "$W/round3.out"
  mkdir -p "$OUT"; (cd "$R" && tar -cJf "$OUT/results3.tar.xz" --exclude='*.part-*' .)
  for f in "$R"/best3.safetensors.part-*; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done; ls -la "$OUT" ;;
pipeline)
  cd "$W"
  mark "round 3 start"
  all=(); for f in a b c d e e2; do all+=(--dump "$W/dump-$f"); done
  common=(--model "$M" --batch-size 32 --save-every 0 --device cuda --quiet --export-bf16)
  "$T" train "${all[@]}" --out c20s "${common[@]}" --init-from c20 --lr 1e-4 --max-len 256 --epochs 3 > "$R/c20s.log" 2>&1 &
  a=$!
  "$T" train "${all[@]}" --out c10ss "${common[@]}" --init-from c10s --lr 5e-5 --max-len 256 --epochs 3 > "$R/c10ss.log" 2>&1 &
  b=$!
  "$T" train "${all[@]}" --out c10hs "${common[@]}" --init-from c10h --lr 1e-4 --max-len 256 --epochs 3 > "$R/c10hs.log" 2>&1
  wait "$a" "$b"
  for h in c20s c10ss c10hs; do cp "$W/$h/metrics.jsonl" "$R/$h-metrics.jsonl"; last_val "$W/$h" "$h"; done
  mark "round 3 heads trained"
  pids=()
  for h in c20s c10ss c10hs; do bench "$W/$h" "$h" 3/1/4 --no-baseline & pids+=($!); done
  wait "${pids[@]}"
  best=$(best_chain c10s c20s c10ss c10hs)
  echo "best3: $best" | tee -a "$LOG" "$R/summary.txt"
  if [[ "$best" != c10s ]]; then
    for shape in 3/1/4; do bench "$W/$best" "${best}x" "$shape"; done
    cp "$W/$best/config.json" "$R/best3-config.json"
    split -b 12M "$W/$best/model.safetensors" "$R/best3.safetensors.part-"
    sha256sum "$W/$best/model.safetensors" | tee "$R/best3.sha256"
  fi
  mark "round 3 done"; touch "$R/done3" ;;
esac
