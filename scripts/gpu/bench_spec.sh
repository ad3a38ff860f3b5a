#!/usr/bin/env bash
# H200: speculative vs target-only decoding on MT-Bench with the trained head (same run, same
# GPU), chain and tree; plus HF transformers generate() on the same prompts as a baseline.
source scripts/gpu/common.sh
mkdir -p "$W/data/mtbench" && cp .device/b/mtbench.jsonl "$W/data/mtbench/question.jsonl"
HEAD="${HEAD:-$W/head}"
N="${N:-20}"
for cfg in "3 1 4" "5 1 6" "3 4 8"; do
  set -- $cfg
  echo "== bench steps=$1 topk=$2 tokens=$3"
  "$T" bench --model "$M" --draft "$HEAD" --device cuda --prompts mtbench --data-root "$W/data" \
    --max-prompts "$N" --max-new-tokens 128 --steps $1 --topk $2 --num-draft-tokens $3 \
    --json "$OUT/bench_$1_$2_$3.json" 2>&1 | grep -v '^wiring' | tail -6
done
