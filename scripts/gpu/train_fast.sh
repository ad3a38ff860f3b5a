#!/usr/bin/env bash
# H200 (issue #15): the GPU trainer end to end, in four back-to-back calls on one warm machine
# (/tmp/tandem survives between calls only while the machine is kept, ~30 s after a call).
#
#   call 1 (carry .device/a):  bash scripts/gpu/train_fast.sh check
#        .device/a: part-a (the GGUF's first bytes), tandem.xz (a release build of this commit),
#        sharegpt-12k.jsonl.xz (scripts/reference/sharegpt_subset.py --prompts-only --exclude
#        MT-Bench/HumanEval), question.jsonl (MT-Bench). Runs `tandem train-check` (the GPU
#        trainer vs burn autodiff on the CPU).
#   call 2 (carry .device/b):  bash scripts/gpu/train_fast.sh dump
#        (session 7 ran it at REGEN_BATCH=31: larger batches failed before 7707ca3 moved the fast
#        path's attention rows to grid x; 256 is the default again but unverified on a GPU)
#        .device/b: part-b (the rest of the GGUF), optionally a newer tandem.xz. Imports the
#        model, regenerates ShareGPT with the fast path: dump A (the first PARITY_ROWS
#        conversations, whole) and dump B (the rest, until REGEN_SECONDS).
#   call 3:                    bash scripts/gpu/train_fast.sh train
#        Same dump (A), same batch, same steps, same hyper-parameters: tandem train (GPU trainer)
#        and scripts/reference/train_eagle3_ref.py (PyTorch eager, then torch.compile for speed
#        only); then the head to commit, trained on A + B.
#   call 4:                    bash scripts/gpu/train_fast.sh bench
#        MT-Bench (80 first turns, 128 tokens, greedy, batch 1): chain 3/1/4 and a tree sweep,
#        speculative vs target-only in the same run; diagnose on the new head.
set -uo pipefail
PHASE="${1:?usage: $0 check|dump|train|bench}"
OUT="${OUT:-/tmp/out}"
W=/tmp/tandem
mkdir -p "$W" "$OUT" "$W/data/mtbench"
T="$W/tandem"
M="$W/smollm2"
LOG="$OUT/log.txt"
REGEN_BATCH="${REGEN_BATCH:-256}"
MAX_NEW="${MAX_NEW:-1024}"
MAX_LEN="${MAX_LEN:-2048}"
PARITY_ROWS="${PARITY_ROWS:-800}"
REGEN_SECONDS="${REGEN_SECONDS:-330}"
TRAIN_BATCH="${TRAIN_BATCH:-16}"
LR="${LR:-5e-4}"
DRAFT_VOCAB="${DRAFT_VOCAB:-8192}"
PARITY_EPOCHS="${PARITY_EPOCHS:-2}"
EPOCHS="${EPOCHS:-6}"
TRAIN_SECONDS="${TRAIN_SECONDS:-200}"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

case "$PHASE" in
check)
  cp .device/a/part-a "$W/"
  cp .device/a/sharegpt-12k.jsonl.xz "$W/"
  cp .device/a/question.jsonl "$W/data/mtbench/"
  xz -dc .device/a/tandem.xz > "$T" && chmod +x "$T"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
  run "$T" train-check
  ;;
dump)
  [[ -f .device/b/tandem.xz ]] && xz -dc .device/b/tandem.xz > "$T" && chmod +x "$T"
  cat "$W/part-a" .device/b/part-b > "$W/smollm2.gguf" && ls -la "$W/smollm2.gguf"
  run "$T" import-gguf "$W/smollm2.gguf" "$M" | tail -1
  xz -dc "$W/sharegpt-12k.jsonl.xz" > "$W/sg.jsonl"
  head -n "$PARITY_ROWS" "$W/sg.jsonl" > "$W/sg-a.jsonl"
  tail -n +"$((PARITY_ROWS + 1))" "$W/sg.jsonl" > "$W/sg-b.jsonl"
  for part in a b; do
    limit=()
    [[ $part == b ]] && limit=(--max-seconds "$REGEN_SECONDS")
    run /usr/bin/time -f "dump $part wall %e s" "$T" dump --model "$M" --dataset "$W/sg-$part.jsonl" \
      --out "$W/dump-$part" --regenerate --max-new-tokens "$MAX_NEW" --max-len "$MAX_LEN" \
      --batch-size "$REGEN_BATCH" --shard-rows 256 --device cuda --quiet "${limit[@]}"
    run "$T" dump-info "$W/dump-$part"
    cp "$W/dump-$part/manifest.json" "$OUT/dump-$part-manifest.json"
    # The regenerated conversations (a few MB): bring them home so that a later run can
    # re-capture (`tandem dump --dataset`, no --regenerate) instead of regenerating.
    cat "$W/dump-$part"/conversations-*.jsonl 2>/dev/null | xz -6 -T0 > "$OUT/conversations-$part.jsonl.xz"
  done
  df -h /tmp | tail -1
  ;;
train)
  common=(--model "$M" --draft-vocab "$DRAFT_VOCAB" --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN"
          --lr "$LR" --val-fraction 0.1 --epochs "$PARITY_EPOCHS")
  echo "== parity: tandem train (GPU trainer) on dump A" | tee -a "$LOG"
  run "$T" train --dump "$W/dump-a" --out "$W/head-a" "${common[@]}" --save-every 0 --device cuda --quiet
  cp "$W/head-a/metrics.jsonl" "$OUT/tandem-a-metrics.jsonl"
  echo "== parity: PyTorch reference, same dump, vocabulary, batches, steps" | tee -a "$LOG"
  PYTHONUNBUFFERED=1 run python3 scripts/reference/train_eagle3_ref.py --dump "$W/dump-a" "${common[@]}" \
    --vocab-from "$W/head-a" --out "$OUT/ref-a.json" --tandem-metrics "$W/head-a/metrics.jsonl"
  echo "== speed: torch.compile reference (tokens/s only)" | tee -a "$LOG"
  PYTHONUNBUFFERED=1 run timeout 420 python3 scripts/reference/train_eagle3_ref.py --dump "$W/dump-a" "${common[@]}" \
    --vocab-from "$W/head-a" --out "$OUT/ref-a-compiled.json" --compile --bench-only --max-steps 60 --timing-warmup 10
  echo "== the head to commit: tandem train on dumps A + B" | tee -a "$LOG"
  run "$T" train --dump "$W/dump-a" --dump "$W/dump-b" --out "$W/head" --model "$M" \
    --draft-vocab "$DRAFT_VOCAB" --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN" --lr "$LR" \
    --epochs "$EPOCHS" --max-seconds "$TRAIN_SECONDS" --eval-every 400 --save-every 0 \
    --device cuda --quiet --export-bf16
  cp "$W/head/config.json" "$W/head/curves.html" "$W/head/metrics.jsonl" "$OUT/"
  cp "$W/head/model.safetensors" "$OUT/head.safetensors"
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, statistics, sys
out = sys.argv[1]
def tandem(path):
    lines = [json.loads(l) for l in open(path)]
    train = [l for l in lines if l["kind"] == "train"]
    tps = [l["tokens_per_s"] for l in train[5:]] or [l["tokens_per_s"] for l in train]
    val = [l for l in lines if l["kind"] == "val"][-1]
    return len(train), statistics.median(tps), val["acc"]
steps, tps, acc = tandem(f"{out}/tandem-a-metrics.jsonl")
ref = json.load(open(f"{out}/ref-a.json"))
try:
    comp = json.load(open(f"{out}/ref-a-compiled.json"))
except OSError:
    comp = {}
def get(d, *keys):
    for k in keys:
        if k in d:
            return d[k]
    return None
racc = (ref.get("val") or {}).get("acc") or []
print("| dump A, same batches and steps | steps | tokens/s (median) | val acc_0..acc_6 |")
print("|---|---|---|---|")
print(f"| tandem train --device cuda | {steps} | {tps:,.0f} | {' '.join(f'{a:.3f}' for a in acc)} |")
print(f"| PyTorch eager reference | {get(ref, 'steps')} | {get(ref, 'tokens_per_s_median', 'tokens_per_s') or 0:,.0f} | {' '.join(f'{a:.3f}' for a in racc)} |")
print(f"| PyTorch torch.compile reference | {get(comp, 'steps')} | {get(comp, 'tokens_per_s_median', 'tokens_per_s') or 0:,.0f} | (speed only) |")
if racc:
    print("max |acc diff|:", max(abs(a - b) for a, b in zip(acc, racc)))
s2, t2, a2 = tandem(f"{out}/metrics.jsonl")
print(f"committed head: {s2} steps, {t2:,.0f} tokens/s median, val acc {' '.join(f'{a:.3f}' for a in a2)}")
PY
  ;;
bench)
  HEAD="${HEAD:-$W/head}"
  for shape in "3 1 4" "3 4 8" "4 4 16" "5 8 32" "6 8 48"; do
    set -- $shape
    echo "== bench chain/tree $1/$2/$3" | tee -a "$LOG"
    timeout 200 "$T" bench --model "$M" --draft "$HEAD" --device cuda --prompts mtbench \
      --data-root "$W/data" --max-prompts 80 --max-new-tokens 128 --steps "$1" --topk "$2" \
      --num-draft-tokens "$3" --batch 1 --json "$OUT/bench_$1_$2_$3.json" 2>&1 \
      | grep -v '^wiring' | tail -8 | tee -a "$LOG"
  done
  echo "== diagnose the head as trained, then served one block off (the vLLM misreading)" | tee -a "$LOG"
  timeout 150 "$T" diagnose --head "$HEAD" --model "$M" --device cuda --data-root "$W/data" \
    --samples 16 --max-new-tokens 64 --json "$OUT/diagnose.json" 2>&1 | tail -12 | tee -a "$LOG"
  rm -rf "$W/head-vllm" && cp -r "$HEAD" "$W/head-vllm"
  python3 - "$W/head-vllm/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
w = c["tandem_wiring"]
blocks = [int(t.split(":")[1]) for t in w["taps"]]
w["taps"] = [f"block:{b - 1}" for b in blocks]
w["raw_ids"] = {"convention": "vllm", "ids": blocks}
c.get("eagle_config", {}).pop("eagle_aux_hidden_state_layer_ids", None)
json.dump(c, open(p, "w"), indent=2)
print("served as vLLM reads SGLang ids", blocks, "->", w["taps"])
PY
  timeout 150 "$T" diagnose --head "$W/head-vllm" --model "$M" --device cuda --data-root "$W/data" \
    --samples 16 --max-new-tokens 64 --json "$OUT/diagnose_vllm.json" 2>&1 | tail -16 | tee -a "$LOG"
  ;;
esac
ls -la "$OUT"
