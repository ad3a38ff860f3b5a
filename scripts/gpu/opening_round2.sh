#!/usr/bin/env bash
# H200, issue #15 (session 10), second round on the machine opening_head.sh left warm (its dumps,
# heads h1..h5 in /tmp/tandem). h5 (committed -> A+B+C+D cut to 512 -> D) won the first round.
#   h6: h5 -> D again, 4 epochs at lr 1e-4 (is D fine-tuning saturated?);
#   h7: h3 -> D cut to 640 tokens (greedy openings only), 4 epochs;
#   E:  greedy replies (256-token budget) to the kept ShareGPT conversations of dump B;
#   h9: h5 -> D + E, 2 epochs.
# Usage: bash scripts/gpu/opening_round2.sh start | wait
set -uo pipefail
W=/tmp/tandem; R=$W/results; T=$W/tandem; M=$W/smollm2; OUT="${OUT:-/tmp/out}"
case "$1" in
start)
  cp "$0" "$W/round2.sh"
  setsid nohup bash "$W/round2.sh" pipeline > "$W/round2.out" 2>&1 < /dev/null &
  sleep 2; exec bash "$0" wait ;;
wait)
  start=$(date +%s)
  while [[ ! -f "$R/done2" ]] && (( $(date +%s) - start < ${WAIT_SECONDS:-560} )); do sleep 10; done
  cat "$R/phases2.txt"; grep -E "^h[0-9]" "$R/summary.txt" | grep -v kind; tail -5 "$W/round2.out"
  mkdir -p "$OUT"; (cd "$R" && tar -cJf "$OUT/results2.tar.xz" --exclude='*.part-*' --exclude='best.*' .)
  for f in "$R"/best2.safetensors.part-*; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done; ls -la "$OUT" ;;
pipeline)
  cd "$W"
  mark() { echo "$(date +%T) $1" | tee -a "$R/phases2.txt"; }
  source <(sed -n '/^bench() {/,/^}/p' "$W/opening_head.sh")
  LOG=$R/pipeline.log
  ft=(--model "$M" --batch-size 16 --save-every 0 --device cuda --quiet --export-bf16)
  mark "round 2 start"
  "$T" dump --model "$M" --dataset "$W/conversations-b.jsonl" --out "$W/dump-e" --regenerate \
    --temperature 0 --max-new-tokens 256 --max-len 2048 --batch-size 512 --shard-rows 512 \
    --device cuda --quiet --max-seconds 170 > "$R/dump-e.log" 2>&1 &
  pe=$!
  "$T" train --dump dump-d --out h6 "${ft[@]}" --init-from h5 --lr 1e-4 --max-len 2048 --epochs 4 > "$R/h6.log" 2>&1 &
  "$T" train --dump dump-d --out h7 "${ft[@]}" --init-from h3 --lr 2e-4 --max-len 640 --epochs 4 > "$R/h7.log" 2>&1
  wait
  "$T" dump-info dump-e | tail -2 | tee -a "$R/summary.txt"
  cat dump-e/conversations-*.jsonl | xz -6 -T0 > "$R/conversations-e.jsonl.xz"
  mark "h6 h7 dump-e done"
  "$T" train --dump dump-d --dump dump-e --out h9 "${ft[@]}" --init-from h5 --lr 2e-4 --max-len 2048 --epochs 2 > "$R/h9.log" 2>&1
  for h in h6 h7 h9; do
    cp "$W/$h/metrics.jsonl" "$R/$h-metrics.jsonl"
    tail -4 "$R/$h.log" | head -2 | sed "s/^/$h /" | tee -a "$R/summary.txt"
  done
  mark "heads trained"
  for h in h6 h7 h9; do bench "$W/$h" "$h" 3/1/4 --no-baseline; done
  mark "benches done"
  best=$(python3 - "$R" <<'PY'
import glob, json, os, sys
s = {}
for f in glob.glob(os.path.join(sys.argv[1], "bench_*_3_1_4.json")):
    s[os.path.basename(f)[6:-11]] = json.load(open(f))["accept_length"]
print(max(s, key=s.get))
PY
)
  echo "best2: $best" | tee -a "$R/summary.txt"
  if [[ "$best" != h5 && "$best" != committed ]]; then
    for shape in 3/1/4 3/4/8 6/8/48; do bench "$W/$best" "${best}x" "$shape"; done
    cp "$W/$best/config.json" "$R/best2-config.json"
    split -b 10M "$W/$best/model.safetensors" "$R/best2.safetensors.part-"
    sha256sum "$W/$best/model.safetensors" | tee "$R/best2.sha256"
  fi
  mark "round 2 done"; touch "$R/done2" ;;
esac
