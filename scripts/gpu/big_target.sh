#!/usr/bin/env bash
# H200, issue #16: the speed table of a Llama-3.1-8B-shaped target (random bf16 weights made on
# the GPU machine by scripts/reference/make_random_llama.py, tokenizer of SmolLM2): target-only
# decode and the verification step of 4, 8 and 32 tokens per sequence (the token counts of the
# shapes 3/1/4, 3/4/8 and 5/8/32) at batch 1, 8 and 32 on the fast path with CUDA graphs, next
# to HF transformers (sdpa) stepping the same model with its KV cache, and HF generate().
# Runs after scripts/gpu/policy.sh has imported SmolLM2 on the same machine (for $T and the
# tokenizer):
#   bash scripts/gpu/big_target.sh start     # then `wait` until it prints the tables
# or alone on an empty machine, from the binary and SmolLM2's tokenizer files packed here:
#   here:   bash scripts/gpu/big_target.sh pack       # .device/big (binary, tokenizer)
#   device: bash scripts/gpu/big_target.sh alone      # carry [".device/big"]
# It also times SmolLM2's decode and verify steps (fast-bench, eager and graphs) and profiles
# its batch-1 decode kernel by kernel with ncu; BIG=0 runs only that. MMA_AB=16: the 8B
# fast-bench again with the tensor-core attention (TANDEM_CUDA_MMA_ATTENTION=16).
set -uo pipefail
PHASE="${1:?usage: $0 start|wait|pipeline}"
source "$(dirname "$0")/head_lib.sh"
B="$W/llama8b-random"
TOK="$M"
[[ -d "$M" ]] || TOK="$W/tokenizer"
case "$PHASE" in
pack)
  rm -rf .device/big && mkdir -p .device/big/tokenizer
  xz -9e -T2 -c target/release/tandem > .device/big/tandem.xz
  cp models/SmolLM2-135M-Instruct/tokenizer*.json models/SmolLM2-135M-Instruct/config.json \
    models/SmolLM2-135M-Instruct/generation_config.json .device/big/tokenizer/
  du -sb .device/big
  ;;
alone)
  mkdir -p "$W"
  xz -dc .device/big/tandem.xz > "$T" && chmod +x "$T"
  cp -r .device/big/tokenizer "$W/tokenizer"
  exec bash "$0" start
  ;;
start)
  [[ -x "$T" && -d "$TOK" ]] || { echo "missing $T or $TOK: run scripts/gpu/policy.sh or \`alone\` first" >&2; exit 3; }
  rm -f "$R/big_done"
  cp "$0" scripts/gpu/head_lib.sh scripts/reference/make_random_llama.py \
    scripts/reference/hf_step_bench.py scripts/reference/hf_decode_bench.py "$W/"
  setsid nohup bash "$W/big_target.sh" pipeline > "$W/big.out" 2>&1 < /dev/null &
  sleep 2
  exec bash "$0" wait
  ;;
wait)
  wait_for big_done
  cat "$R/big_phases.txt" 2>/dev/null
  grep -E "^\||cold start" "$R/big_smol_fast.log"
  tail -n 30 "$R/big_fast.log" 2>/dev/null | grep -E "^\||cold start"
  tail -n 30 "$R/big_fast_mma.log" 2>/dev/null | grep -E "^\||cold start" | sed 's/^/MMA /'
  grep -E "^\|" "$R/big_hf_steps.log"
  grep -E "^\|" "$R/big_hf_generate.log"
  head -30 "$R/big_ncu_summary.txt" 2>/dev/null; tail -3 "$R/big_ncu.err" 2>/dev/null
  (cd "$R" && tar -cJf "$OUT/big_target.tar.xz" big_* 2>/dev/null)
  ;;
pipeline)
  cd "$W"
  stamp() { echo "$(date +%T) $1" | tee -a "$R/big_phases.txt"; }
  stamp "start"
  # SmolLM2 decode and verify steps, eager launches then graphs (the kernels' before/after).
  [[ -d "$M" ]] && timeout 300 "$T" fast-bench --model "$M" --batch 1,8,32 --verify-widths 4,8 --with-taps \
    --prompt-tokens 128 --new-tokens 64 --repeats 3 --json "$R/big_smol_fast.json" \
    > "$R/big_smol_fast.log" 2>&1
  stamp "smollm2 fast-bench exit $?"
  if [[ "${BIG:-1}" == 1 ]]; then
  python3 make_random_llama.py "$B" --tokenizer-from "$TOK" > "$R/big_make.log" 2>&1
  stamp "model written: $(tail -1 "$R/big_make.log")"
  timeout 500 "$T" fast-bench --model "$B" --batch 1,8,32 --verify-widths 4,8,32 --with-taps \
    --graphs-only --prompt-tokens 128 --new-tokens 32 --repeats 3 --json "$R/big_fast.json" \
    > "$R/big_fast.log" 2>&1
  stamp "fast-bench exit $?"
  # MMA_AB=N: the same with the tensor-core attention for steps of >= N slots a sequence
  # (kernels/attention_mma.cu: the prefill and the verification of 32 tokens at N=16).
  if [[ -n "${MMA_AB:-}" ]]; then
    TANDEM_CUDA_MMA_ATTENTION="$MMA_AB" timeout 500 "$T" fast-bench --model "$B" --batch 1,8,32 \
      --verify-widths 4,8,32 --with-taps --graphs-only --prompt-tokens 128 --new-tokens 32 \
      --repeats 3 --json "$R/big_fast_mma.json" > "$R/big_fast_mma.log" 2>&1
    stamp "fast-bench (tensor-core attention from width $MMA_AB) exit $?"
  fi
  timeout 400 python3 hf_step_bench.py "$B" --batch 1,8,32 --widths 4,8,32 --attn sdpa \
    --json "$R/big_hf_steps.json" > "$R/big_hf_steps.log" 2>&1
  stamp "hf steps exit $?"
  timeout 400 python3 hf_decode_bench.py "$B" --batch 1,8,32 --attn sdpa --new-tokens 32 \
    --repeats 2 --json "$R/big_hf_generate.json" > "$R/big_hf_generate.log" 2>&1
  stamp "hf generate exit $?"
  fi
  # Where SmolLM2's batch-1 decode step spends its time, kernel by kernel (head_lib.sh).
  ncu_decode_profile big_ncu && stamp "ncu exit 0"
  touch "$R/big_done"
  ;;
esac
