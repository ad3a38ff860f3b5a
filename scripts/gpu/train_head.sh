#!/usr/bin/env bash
# H200: dump ShareGPT (3k conversations, first exchange, the dataset's replies) and a small
# regenerated subset through the capture hook, then train the SmolLM2 EAGLE-3 head on GPU.
# The head comes back in $OUT (split into <16 MiB parts).
source scripts/gpu/common.sh
xz -dc .device/b/sharegpt-3k.jsonl.xz > "$W/sharegpt-3k.jsonl"
SAMPLES="${SAMPLES:-2000}"
STEPS="${STEPS:-600}"
echo "== dump (prefill, dataset replies) on cuda"
/usr/bin/time -f "dump wall %e s" "$T" dump --model "$M" --dataset "$W/sharegpt-3k.jsonl" --out "$W/dump" \
  --max-samples "$SAMPLES" --max-len 512 --device cuda 2>&1 | tail -5
"$T" dump-info "$W/dump" 2>&1 | tail -20 | tee "$OUT/dump_info.txt"
echo "== HF transformers capture baseline (same samples, same GPU)"
python3 scripts/reference/hf_capture_bench.py "$M" "$W/sharegpt-3k.jsonl" --samples 300 --max-len 512 2>&1 | grep '^|' | tee "$OUT/hf_capture.txt"
echo "== dump with --regenerate (small subset)"
/usr/bin/time -f "regen dump wall %e s" "$T" dump --model "$M" --dataset "$W/sharegpt-3k.jsonl" --out "$W/dump-regen" \
  --max-samples 64 --max-len 512 --regenerate --max-new-tokens 128 --batch-size 16 --device cuda 2>&1 | tail -3
echo "== train on cuda"
/usr/bin/time -f "train wall %e s" "$T" train --dump "$W/dump" --model "$M" --out "$W/head" \
  --draft-vocab 8192 --batch-size 8 --max-len 512 --lr 3e-4 --epochs 3 --max-steps "$STEPS" \
  --save-every 200 --device cuda --quiet --export-bf16 2>&1 | tail -8 | tee "$OUT/train.txt"
cp "$W/head/config.json" "$W/head/curves.html" "$W/head/metrics.jsonl" "$OUT/" 2>/dev/null
split -b 15M -d "$W/head/model.safetensors" "$OUT/head.safetensors.part"
ls -la "$OUT"
