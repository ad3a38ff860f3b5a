#!/usr/bin/env bash
# H200, issue #15 (session 11): later rounds on the machine scratch_head.sh left warm (its
# openings dumps A-E2 cut to 512 tokens, heads in /tmp/tandem). Each round trains its heads side
# by side on all six dumps (`--batch-size 32`), benches each on MT-Bench chain 3/1/4, and sweeps
# the best if it beats the incumbent.
#   round 2 (incumbent c10, round 1's best: 1.971):
#     c20:  c10 again on all openings, lr 1e-4, 3 epochs (is continuing still paying?);
#     c10s: c10 on all rows cut to 256 tokens (MT-Bench: short prompt, 128-token reply), 3 epochs;
#     c10h: the committed head on all openings at lr 2e-4, 4 epochs (round 1's step, larger).
#   round 3 (incumbent c10s, 1.991), each on rows cut to 256 tokens, 3 epochs:
#     c20s: c20, lr 1e-4;  c10ss: c10s again, lr 5e-5;  c10hs: c10h, lr 1e-4.
# Usage: bash scripts/gpu/scratch_round.sh start|wait 2|3
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
ROUND="${2:?usage: $0 start|wait|pipeline 2|3}"

# heads: one line per head, "name init lr max_len epochs"; incumbent; sweep shapes.
case "$ROUND" in
2)
  heads="c20 c10 1e-4 512 3
c10s c10 1e-4 256 3
c10h committed 2e-4 512 4"
  incumbent=c10; sweep="3/1/4 5/8/32 6/8/48" ;;
3)
  heads="c20s c20 1e-4 256 3
c10ss c10s 5e-5 256 3
c10hs c10h 1e-4 256 3"
  incumbent=c10s; sweep="3/1/4" ;;
*) echo "no round $ROUND" >&2; exit 2 ;;
esac
names=$(cut -d' ' -f1 <<< "$heads" | tr '\n' ' ')

case "$1" in
start)
  pkill -f train_eagle3_ref.py  # round 1's background reference run: the GPU is needed here
  cp "$0" "$W/scratch_round.sh"; cp "$(dirname "$0")/head_lib.sh" "$W/"
  setsid nohup bash "$W/scratch_round.sh" pipeline "$ROUND" > "$W/round$ROUND.out" 2>&1 < /dev/null &
  sleep 2; exec bash "$0" wait "$ROUND" ;;
wait)
  wait_for "done$ROUND"
  cat "$R/phases.txt"; grep -E "^c" "$R/summary.txt" | tail -12; tail -5 "$W/round$ROUND.out"
  collect "results$ROUND.tar.xz" "best$ROUND" ;;
pipeline)
  cd "$W"
  mark "round $ROUND start"
  all=(); for f in a b c d e e2; do all+=(--dump "$W/dump-$f"); done
  common=(--model "$M" --batch-size 32 --save-every 0 --device cuda --quiet --export-bf16)
  pids=()
  while read -r name init lr len epochs; do
    "$T" train "${all[@]}" --out "$name" "${common[@]}" --init-from "$init" --lr "$lr" \
      --max-len "$len" --epochs "$epochs" > "$R/$name.log" 2>&1 &
    pids+=($!)
  done <<< "$heads"
  wait "${pids[@]}"
  for h in $names; do cp "$W/$h/metrics.jsonl" "$R/$h-metrics.jsonl"; last_val "$W/$h" "$h"; done
  mark "round $ROUND heads trained"
  pids=()
  for h in $names; do bench "$W/$h" "$h" 3/1/4 --no-baseline & pids+=($!); done
  wait "${pids[@]}"
  # shellcheck disable=SC2086  # the names are words
  best=$(best_chain "$incumbent" $names)
  echo "best$ROUND: $best" | tee -a "$LOG" "$R/summary.txt"
  if [[ "$best" != "$incumbent" ]]; then
    for shape in $sweep; do bench "$W/$best" "${best}x" "$shape"; done
    cp "$W/$best/config.json" "$R/best$ROUND-config.json"
    split -b 12M "$W/$best/model.safetensors" "$R/best$ROUND.safetensors.part-"
    sha256sum "$W/$best/model.safetensors" | tee "$R/best$ROUND.sha256"
  fi
  mark "round $ROUND done"; touch "$R/done$ROUND" ;;
esac
