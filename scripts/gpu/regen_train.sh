#!/usr/bin/env bash
# H200 (issues #3 and #4): regenerate a ShareGPT subset with SmolLM2 through the capture hook,
# time HF transformers doing the same regeneration + capture, train the EAGLE-3 head on the
# regenerated dump, and print one table.
#
# Runs from the repository root on the device machine, like the other scripts here:
#   call 1 (carry .device/a):  mkdir -p /tmp/tandem && cp .device/a/part-a /tmp/tandem/
#   call 2 (carry .device/b):  bash scripts/gpu/regen_train.sh            (everything, ~9 min)
# or, to give the dump and the training ~4 minutes each, split over two calls (the machine
# must still be warm for the second one: /tmp/tandem is reused):
#   call 2 (carry .device/b):  bash scripts/gpu/regen_train.sh dump       (dump + HF reference)
#   call 3 (carry .device/b):  bash scripts/gpu/regen_train.sh train      (train + the table)
# .device/b must hold part-b, sharegpt-3k.jsonl.xz and tandem.xz = a `--features cuda` release
# build (CUDARC_CUDA_VERSION=13000, --target-dir target/cuda) of a tree that has
# `dump --max-seconds` and `train --max-seconds` (this script's commit or later).
#
# Knobs (environment): REGEN_SECONDS (dump: no new batch after this; default 240 split, 170
# all), REGEN_BATCH (64), MAX_NEW (128 tokens per turn), MAX_LEN (512), REGEN_SAMPLES (cap,
# 4000), HF_SAMPLES (rows for the HF reference, 256), TRAIN_SECONDS (240 split, 190 all),
# TRAIN_STEPS_PER_S (planning estimate for the schedule, 2.5), DRAFT_VOCAB (8192), TRAIN_BATCH (8),
# LR (3e-4), DATA_XZ (the prompts: a path, or a name in $BIN; sharegpt-3k.jsonl.xz), HF_SAMPLES=0 skips the HF run.
#
# Sizing: BENCHMARKS.md measured `dump --regenerate` at batch 16 at 228 generated tok/s (64
# rows in 85 s, cold start included). Decode is launch bound (step time flat from batch 1 to
# 8), so batch 64 should give ~3-4x the rows per second; the time limit, not the row cap,
# ends the dump, so the dump takes REGEN_SECONDS plus its last batch whatever the speed.
#
# Back in $OUT (at most 8 files): log.txt (every command's output and the table),
# dump_manifest.json, hf_regen.json, config.json (names the dump under
# tandem_wiring.trained_on), metrics.jsonl, curves.html, head.safetensors.part00/01 (join
# with `cat head.safetensors.part* > model.safetensors`).
PHASE="${1:-all}"
case "$PHASE" in
  all) DEF_REGEN=170 DEF_TRAIN=190 ;;
  dump | train) DEF_REGEN=240 DEF_TRAIN=240 ;;
  *) echo "usage: $0 [all|dump|train]" >&2; exit 2 ;;
esac
source scripts/gpu/common.sh
REGEN_SECONDS="${REGEN_SECONDS:-$DEF_REGEN}"
TRAIN_SECONDS="${TRAIN_SECONDS:-$DEF_TRAIN}"
REGEN_BATCH="${REGEN_BATCH:-64}"
MAX_NEW="${MAX_NEW:-128}"
MAX_LEN="${MAX_LEN:-512}"
REGEN_SAMPLES="${REGEN_SAMPLES:-4000}"
HF_SAMPLES="${HF_SAMPLES:-256}"
TRAIN_STEPS_PER_S="${TRAIN_STEPS_PER_S:-2.5}"
DRAFT_VOCAB="${DRAFT_VOCAB:-8192}"
TRAIN_BATCH="${TRAIN_BATCH:-8}"
LR="${LR:-3e-4}"
# The prompts: an xz'd chat JSONL, a path or a name in $BIN (scripts/reference/sharegpt_subset.py
# writes bigger ones; one that does not fit a call with $BIN travels in an earlier call to /tmp).
DATA_XZ="${DATA_XZ:-sharegpt-3k.jsonl.xz}"
DATA="$W/$(basename "$DATA_XZ" .xz)"
DUMP="$W/sharegpt-regen"
HEAD="$W/head-regen"
LOGS="$W/regen-logs"
mkdir -p "$LOGS"
LOG="$OUT/log.txt"
[[ -f "$DATA_XZ" ]] || DATA_XZ="$BIN/$DATA_XZ"
[[ -f "$DATA" ]] || xz -dc "$DATA_XZ" > "$DATA"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"

if [[ "$PHASE" != train ]]; then
  echo "== (1) tandem dump --regenerate on cuda: batch $REGEN_BATCH, $MAX_NEW tokens/turn, max-len $MAX_LEN, no new batch after ${REGEN_SECONDS}s" | tee -a "$LOG"
  rm -rf "$DUMP"
  # --shard-rows 128: if the safety timeout ever fires, at most one shard of rows is lost and
  # the completed shards stay readable.
  /usr/bin/time -f "regen dump wall %e s" timeout $((REGEN_SECONDS + 240)) \
    "$T" dump --model "$M" --dataset "$DATA" --out "$DUMP" --regenerate \
    --max-new-tokens "$MAX_NEW" --batch-size "$REGEN_BATCH" --max-len "$MAX_LEN" \
    --max-samples "$REGEN_SAMPLES" --max-seconds "$REGEN_SECONDS" --shard-rows 128 \
    --device cuda --quiet > "$LOGS/dump.txt" 2>&1
  tail -8 "$LOGS/dump.txt" | tee -a "$LOG"
  "$T" dump-info "$DUMP" 2>&1 | tail -20 | tee -a "$LOG"
  cp "$DUMP/manifest.json" "$OUT/dump_manifest.json"

  if [[ "$HF_SAMPLES" -gt 0 ]]; then
  echo "== (2) HF transformers regenerate + capture, same file, same settings, first $HF_SAMPLES rows" | tee -a "$LOG"
  timeout 240 python3 scripts/reference/hf_regen_bench.py "$M" "$DATA" --samples "$HF_SAMPLES" \
    --batch-size "$REGEN_BATCH" --max-new-tokens "$MAX_NEW" --max-len "$MAX_LEN" \
    --device cuda --json "$OUT/hf_regen.json" > "$LOGS/hf.txt" 2>&1
  grep -v -i warn "$LOGS/hf.txt" | tail -4 | tee -a "$LOG"
  cp "$OUT/hf_regen.json" "$LOGS/hf_regen.json" 2>/dev/null
  fi
fi

if [[ "$PHASE" != dump ]]; then
  if [[ ! -f "$DUMP/manifest.json" ]]; then
    echo "no dump in $DUMP: run the dump phase first (on the same warm machine)" | tee -a "$LOG"
    exit 1
  fi
  # The schedule (warm-up + cosine) spans --epochs; size it so that TRAIN_SECONDS at the
  # planning rate is about one whole schedule. --max-seconds ends the run either way.
  ROWS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['rows'])" "$DUMP/manifest.json")
  EPOCHS=$(python3 -c "import math,sys; r,s,b,t=map(float,sys.argv[1:]); print(max(1, math.ceil(s*t/max(1.0, math.ceil(0.98*r/b)))))" \
    "$ROWS" "$TRAIN_SECONDS" "$TRAIN_BATCH" "$TRAIN_STEPS_PER_S")
  echo "== (3) tandem train on cuda: $ROWS rows, $EPOCHS epochs planned, stop after ${TRAIN_SECONDS}s" | tee -a "$LOG"
  rm -rf "$HEAD"
  /usr/bin/time -f "train wall %e s" timeout $((TRAIN_SECONDS + 240)) \
    "$T" train --dump "$DUMP" --model "$M" --out "$HEAD" --draft-vocab "$DRAFT_VOCAB" \
    --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN" --lr "$LR" --epochs "$EPOCHS" \
    --max-seconds "$TRAIN_SECONDS" --save-every 0 --device cuda --quiet --export-bf16 \
    > "$LOGS/train.txt" 2>&1
  tail -8 "$LOGS/train.txt" | tee -a "$LOG"
  cp "$HEAD/config.json" "$HEAD/curves.html" "$HEAD/metrics.jsonl" "$OUT/" 2>/dev/null
  split -b 15M -d "$HEAD/model.safetensors" "$OUT/head.safetensors.part"

  echo "== (4) table" | tee -a "$LOG"
  python3 - "$LOGS" "$HEAD" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, re, sys
logs, head = sys.argv[1], sys.argv[2]
def text(name):
    p = os.path.join(logs, name)
    return open(p).read() if os.path.exists(p) else ""
def num(pattern, s, cast=float):
    m = re.search(pattern, s)
    return cast(m.group(1)) if m else None
d = text("dump.txt")
wrote = re.search(r"wrote (\d+) rows, (\d+) tokens in ([\d.]+)s: (\d+) tok/s overall, (\d+) tok/s in prefill", d)
regen = re.search(r"regenerated (\d+) turns \((\d+) hit the token budget\): (\d+) tokens in ([\d.]+)s, ([\d.]+) tok/s", d)
try:
    hf = json.load(open(os.path.join(logs, "hf_regen.json")))
except (OSError, ValueError):
    hf = {}
t = text("train.txt")
steps = re.search(r"(\d+) of (\d+) steps \((\d+) train / (\d+) validation samples\): ([\d.]+) steps/s, (\d+) tokens/s", t)
val = re.search(r"validation: loss [\d.]+ -> ([\d.]+), acc_i \[[^\]]*\] -> \[([^\]]*)\]", t)
try:
    named = json.load(open(os.path.join(head, "config.json")))["tandem_wiring"].get("trained_on", [])
except (OSError, ValueError, KeyError):
    named = []
na = "n/a"
print("| quantity | tandem (burn-cuda bf16) | HF transformers eager bf16 |")
print("|---|---|---|")
print(f"| regenerate: rows / captured tokens | {wrote.group(1) if wrote else na} / {wrote.group(2) if wrote else na} | {hf.get('rows', na)} / {hf.get('tokens', na)} |")
print(f"| regenerate: turns (cut at budget) / generated tokens | {regen.group(1) + ' (' + regen.group(2) + ')' if regen else na} / {regen.group(3) if regen else na} | {hf.get('turns', na)} ({hf.get('cut_turns', na)}) / {hf.get('generated_tokens', na)} |")
print(f"| regenerate: generated tok/s | {regen.group(5) if regen else na} | {hf.get('generation_tokens_per_s', 0):.1f} |")
print(f"| capture tok/s (prefill captures) | {wrote.group(5) if wrote else na} | {hf.get('capture_tokens_per_s', 0):.0f} |")
print(f"| overall captured tok/s (wall of the loop) | {wrote.group(4) if wrote else na} | {hf.get('tokens_per_s', 0):.0f} |")
if steps:
    print(f"| train: steps (of schedule) / rows train+val | {steps.group(1)} ({steps.group(2)}) / {steps.group(3)}+{steps.group(4)} | |")
    print(f"| train: steps/s, tokens/s | {steps.group(5)}, {steps.group(6)} | |")
else:
    print("| train | no report (see log.txt) | |")
print(f"| val acc_0..acc_6 | {val.group(2) if val else na} | |")
for n in named:
    print(f"| head trained on | {n.get('name')} ({n.get('rows')} rows, {n.get('tokens')} tokens, manifest sha256 {str(n.get('manifest_sha256'))[:16]}) | |")
PY
fi
ls -la "$OUT"
