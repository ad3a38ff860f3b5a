#!/usr/bin/env bash
# H200, issue #15 (session 11), second round on the machine scratch_head.sh left warm (its
# openings dumps A-E2 cut to 512 tokens, heads in /tmp/tandem). Round 1's best was c10 (the
# committed head continued on all openings, lr 1e-4, 3 epochs): chain 3/1/4 1.971. Side by side:
#   c20:  c10 again on all openings, lr 1e-4, 3 epochs (is continuing still paying?);
#   c10s: c10 on all rows cut to 256 tokens (MT-Bench: short prompt, 128-token reply), 3 epochs;
#   c10h: the committed head on all openings at lr 2e-4, 4 epochs (round 1's step, larger).
# Usage: bash scripts/gpu/scratch_round2.sh start | wait
set -uo pipefail
W=/tmp/tandem; R=$W/results; T=$W/tandem; M=$W/smollm2; OUT="${OUT:-/tmp/out}"
LOG=$R/pipeline.log
source "$(dirname "$0")/head_lib.sh"
case "$1" in
start)
  pkill -f train_eagle3_ref.py  # round 1's background reference run: the GPU is needed here
  cp "$0" "$W/scratch_round2.sh"; cp "$(dirname "$0")/head_lib.sh" "$W/"
  setsid nohup bash "$W/scratch_round2.sh" pipeline > "$W/round2.out" 2>&1 < /dev/null &
  sleep 2; exec bash "$0" wait ;;
wait)
  start=$(date +%s)
  while [[ ! -f "$R/done2" ]] && (( $(date +%s) - start < ${WAIT_SECONDS:-560} )); do sleep 10; done
  cat "$R/phases.txt"; grep -E "^c" "$R/summary.txt" | tail -12; tail -5 "$W/round2.out"
  mkdir -p "$OUT"; (cd "$R" && tar -cJf "$OUT/results2.tar.xz" --exclude='*.part-*' .)
  for f in "$R"/best2.safetensors.part-*; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done; ls -la "$OUT" ;;
pipeline)
  cd "$W"
  mark "round 2 start"
  all=(); for f in a b c d e e2; do all+=(--dump "$W/dump-$f"); done
  common=(--model "$M" --batch-size 32 --save-every 0 --device cuda --quiet --export-bf16)
  "$T" train "${all[@]}" --out c20 "${common[@]}" --init-from c10 --lr 1e-4 --max-len 512 --epochs 3 > "$R/c20.log" 2>&1 &
  a=$!
  "$T" train "${all[@]}" --out c10s "${common[@]}" --init-from c10 --lr 1e-4 --max-len 256 --epochs 3 > "$R/c10s.log" 2>&1 &
  b=$!
  "$T" train "${all[@]}" --out c10h "${common[@]}" --init-from committed --lr 2e-4 --max-len 512 --epochs 4 > "$R/c10h.log" 2>&1
  wait "$a" "$b"
  for h in c20 c10s c10h; do cp "$W/$h/metrics.jsonl" "$R/$h-metrics.jsonl"; last_val "$W/$h" "$h"; done
  mark "round 2 heads trained"
  pids=()
  for h in c20 c10s c10h; do bench "$W/$h" "$h" 3/1/4 --no-baseline & pids+=($!); done
  wait "${pids[@]}"
  best=$(best_chain c10 c20 c10s c10h)
  echo "best2: $best" | tee -a "$LOG" "$R/summary.txt"
  if [[ "$best" != c10 ]]; then
    for shape in 3/1/4 5/8/32 6/8/48; do bench "$W/$best" "${best}x" "$shape"; done
    cp "$W/$best/config.json" "$R/best2-config.json"
    split -b 12M "$W/$best/model.safetensors" "$R/best2.safetensors.part-"
    sha256sum "$W/$best/model.safetensors" | tee "$R/best2.sha256"
  fi
  mark "round 2 done"; touch "$R/done2" ;;
esac
