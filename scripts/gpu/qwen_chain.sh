#!/usr/bin/env bash
# H200, issue #18: the whole job chain for the second real target, Qwen2.5-Coder-1.5B-Instruct.
# The machine starts empty and a call carries at most 64 MiB, tree included, so the 1.1 GB GGUF
# travels in pieces, from a lean checkout (scripts/gpu/lean_tree.sh: 3 MB of tree instead of
# 41 MB, so 18 calls instead of 48).
#
#   here:  cargo build --release && bash scripts/gpu/qwen_chain.sh pack   # .device/q00 .. qNN
#          bash scripts/gpu/lean_tree.sh enter                            # before the first call
#   call k (carry [".device/qKK"]), k = 0 .. N-1, back to back:  bash scripts/gpu/qwen_chain.sh receive KK
#          (call 0 also unpacks the binary, the GPU tests and the prompt sets; the last call
#          checks the size and SHA-256 of the joined GGUF and imports it)
#   then:  bash scripts/gpu/qwen_chain.sh start      # starts the pipeline, waits up to WAIT_SECONDS
#          bash scripts/gpu/qwen_chain.sh wait       # as often as needed; brings back results.tar.xz
#   here:  bash scripts/gpu/lean_tree.sh leave
#
# The pipeline, most needed first (each step under a timeout, so a failure costs its step only):
#  0. with CHECK=1 (the default), `tandem fast-check` on this model (a few batch and KV points
#     against the CPU f32 reference); the pipeline stops there if a point fails;
#  1. with BASELINES=1, target-only decode, `tandem fast-bench` at batch 1 and 8 (verify widths
#     4 and 8), next to HF transformers (sdpa, bf16) decoding the same imported model;
#  2. training data: with PREV=1 the replies earlier sessions regenerated (dump-*.jsonl.xz of
#     datasets/regenerated/qwen2.5-coder-1.5b-instruct) captured again without generation
#     (dump prev); then ShareGPT first turns, code requests first (sharegpt_subset.py
#     --code-first; MT-Bench and HumanEval kept out), past the first SKIP_LINES, the replies
#     regenerated greedily by the target on the fast path for REGEN_SECONDS and captured through
#     the hook (dump A);
#  3. the EAGLE-3 head on both dumps: TTT 7, draft vocabulary DRAFT_VOCAB, for TRAIN_SECONDS;
#  4. `tandem bench` on HumanEval (164 prompts) over SHAPES_B1 and 3/4/8 with the fused kernels,
#     batch 1, 128 new tokens, greedy, speculative vs target-only in the same run;
#  5. a fresh dump (ShareGPT conversations no training row saw): `replay` and `compare`; then
#     MT-Bench (80 first turns) 3/4/8 at batch 1;
#  6. `tandem serve` load tests (64 MT-Bench requests, 128 tokens) at CONCURRENCIES, target-only
#     vs the adaptive speculation policy with the new head;
#  7. batch-8 bench over SHAPES_B8;
#  8. with TESTS=1 (the default), the GPU test binaries (tiny models: kernels, engines, compare's
#     offline half, the data-parallel trainer); TESTS_FIRST=1 runs them before step 1.
# Session 19 (static batches of 256, 1,024-token budget) regenerated 0.86M tokens in 200 s and
# its head overfit them; a static batch waits for its longest reply (mean 454 tokens against a
# budget of 1,024), so session 22 ran a 512-token budget. Batches of 512 rows ran out of GPU
# memory in their ragged prefill (session 22), so REGEN_BATCH is 256.
set -uo pipefail
PHASE="${1:?usage: $0 pack|receive NN|receive-opt|start|wait|pipeline}"
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries
M="$W/qwen"
GGUF_HERE=models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
SIZE=1117320768
SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
REGEN_SECONDS="${REGEN_SECONDS:-200}"
REGEN_BATCH="${REGEN_BATCH:-256}"
MAX_NEW="${MAX_NEW:-512}"
# Lines of sharegpt-code-12k.jsonl earlier sessions already regenerated (session 19 read lines
# 1-768, session 22 769-1,280, session 23 1,281-2,560; their replies travel as
# datasets/regenerated/qwen2.5-coder-1.5b-instruct/dump-a, dump-b and dump-c and are captured
# again, without generation, when PREV=1: 2.55M tokens, ~150 s at session 23's 16.8k tok/s).
# Disk: the H200 machine had ~32 GB free after session 23's 2.55M tokens of dumps (~12 KB a
# token in bf16), so keep PREV + new regeneration under ~4.5M tokens.
SKIP_LINES="${SKIP_LINES:-2560}"
PREV="${PREV:-1}"
TRAIN_SECONDS="${TRAIN_SECONDS:-200}"
DRAFT_VOCAB="${DRAFT_VOCAB:-32000}"
LR="${LR:-5e-4}"
SHAPES_B1="${SHAPES_B1:-3/1/4 3/4/8 5/8/32}"
SHAPES_B8="${SHAPES_B8:-3/4/8}"
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
REQUESTS="${REQUESTS:-64}"
MAX_TOKENS="${MAX_TOKENS:-128}"
# Held-out conversations for replay and compare: session 22's 16 gave compare a standard error
# of ~6% of the accept length; "within 2%" needs about ten times as many.
FRESH="${FRESH:-160}"

# bench_set PROMPTS BATCH SHAPE [fused]: one `tandem bench` run, its summary line into
# summary.txt; "fused" runs it with the fused small-step kernels (TANDEM_CUDA_FUSED=8, the
# default since session 25), anything else with them off (TANDEM_CUDA_FUSED=0).
bench_set() {
  local prompts=$1 batch=$2 shape=$3 fused=${4:-} suffix=${5:-} s k n
  IFS=/ read -r s k n <<< "$shape"
  local tag="${prompts}_b${batch}_${s}_${k}_${n}${fused:+_fused}${suffix:+_$suffix}"
  TANDEM_CUDA_FUSED=${fused:+8} timeout 400 "$T" bench --model "$M" --draft "$W/head" --device cuda --prompts "$prompts" \
    --data-root "$W/data" --max-new-tokens 128 --steps "$s" --topk "$k" --num-draft-tokens "$n" \
    --batch "$batch" --json "$R/bench_${tag}.json" > "$R/bench_${tag}.log" 2>&1
  python3 - "$R/bench_${tag}.json" "$tag" <<'PY' | tee -a "$LOG" "$R/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"{sys.argv[2]:24s} no report ({e})"); sys.exit()
pos = " ".join(f"{p:.2f}" for p in d["per_position"])
print(f"{sys.argv[2]:24s} accept {d['accept_length']:.3f} [{pos}] spec {d['spec_tokens_per_second']:.1f} tok/s "
      f"target {d['target_tokens_per_second']:.1f} speedup {d['speedup']:.3f} "
      f"identical {d.get('identical_outputs')}/{d.get('compared_outputs')}")
PY
}

# opt_bench: a second binary carried while the pipeline runs (`receive-opt`), benched on
# HumanEval 3/4/8 at batch 1 with the same head right after the first binary (an A/B of one
# change in one run), once; the pipeline calls it at several points and the first call after
# the binary arrived runs it.
opt_bench() {
  [[ -x "$W/tandem-opt" && ! -f "$R/opt-done" ]] || return 0
  touch "$R/opt-done"
  local T="$W/tandem-opt"
  bench_set humaneval 1 3/4/8 "" opt
  mark "HumanEval 3/4/8 with tandem-opt done"
}

# serve_load (head_lib.sh): the 1.5B target takes longer to start.
SERVE_WAIT=240

# pack (here): the binary, test binaries and prompt sets in q00, the GGUF in pieces q00 .. qNN.
own_pack() {
  [[ -f "$GGUF_HERE" ]] || { echo "no $GGUF_HERE: run scripts/fetch_qwen_coder.sh" >&2; exit 1; }
  require_fresh_binary || exit 1
  rm -rf .device/q[0-9][0-9]
  mkdir -p .device/q00
  xz -9e -T2 -c target/release/tandem > .device/q00/tandem.xz
  # PACK_TESTS=0 leaves the GPU test binaries out (a run too short for TESTS=1; saves the
  # release build of four test targets here).
  [[ "${PACK_TESTS:-1}" == 1 ]] && pack_gpu_tests .device/q00 .device/q00 .device/q00 .device/q00
  python3 scripts/reference/sharegpt_subset.py data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json \
    --count 12000 --code-first --prompts-only --out .device/q00/sharegpt-code-12k.jsonl \
    --exclude data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz
  xz -9 -f .device/q00/sharegpt-code-12k.jsonl
  cp data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz .device/q00/
  xz -dc datasets/regenerated/qwen2.5-coder-1.5b-instruct/dump-*.jsonl.xz | xz -9 -T2 > .device/q00/prev.jsonl.xz
  # What the lean tree leaves of 64 MiB, less 1.5 MB of slack, is the GGUF's share of a call.
  tree=${TREE_BYTES:-3100000}
  first=$(( 64 * 1024 * 1024 - tree - 1500000 - $(du -cb .device/q00 | tail -1 | cut -f1) ))
  piece=$(( 64 * 1024 * 1024 - tree - 1500000 ))
  head -c "$first" "$GGUF_HERE" > .device/q00/gguf.part
  offset=$first i=1
  while (( offset < SIZE )); do
    d=$(printf ".device/q%02d" "$i")
    mkdir -p "$d"
    tail -c +$((offset + 1)) "$GGUF_HERE" | head -c "$piece" > "$d/gguf.part"
    offset=$((offset + piece)) i=$((i + 1))
  done
  # Each piece names its offset, so a call that carries the wrong one fails instead of
  # appending out of order.
  offset=0
  for d in .device/q[0-9][0-9]; do
    echo "$offset" > "$d/offset"
    offset=$((offset + $(stat -c %s "$d/gguf.part")))
  done
  du -b .device/q[0-9][0-9] | tail -3
  echo "$i calls: .device/q00 .. $(printf 'q%02d' $((i - 1)))"
}

# receive NN (call k): joins piece NN; call 0 also unpacks the binaries and data; the last
# checks the joined GGUF and imports it.
own_receive() {
  d=".device/q$1"
  have=$(stat -c %s "$W/qwen.gguf.partial" 2>/dev/null || echo 0)
  if (( have != $(cat "$d/offset") )); then
    echo "piece $1 starts at byte $(cat "$d/offset") but $have bytes are joined: this machine" \
      "missed a piece (a fresh machine starts empty: start again from q00)" >&2
    exit 1
  fi
  if [[ -f "$d/tandem.xz" ]]; then
    mkdir -p "$W/data/mtbench" "$W/data/humaneval"
    xz -dc "$d/tandem.xz" > "$T" && chmod +x "$T"
    for t in gpu-tests gpu-fast-tests gpu-compare-tests gpu-train-tests; do
      [[ -f "$d/$t.xz" ]] && xz -dc "$d/$t.xz" > "$W/$t" && chmod +x "$W/$t"
    done
    xz -dc "$d/sharegpt-code-12k.jsonl.xz" > "$W/sharegpt-code-12k.jsonl"
    xz -dc "$d/prev.jsonl.xz" > "$W/prev.jsonl"
    cp "$d/question.jsonl" "$W/data/mtbench/"
    cp "$d/HumanEval.jsonl.gz" "$W/data/humaneval/"
    cp scripts/reference/hf_decode_bench.py scripts/gpu/head_lib.sh scripts/gpu/nccl_env.sh "$0" "$W/"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
  fi
  cat "$d/gguf.part" >> "$W/qwen.gguf.partial"
  rm -rf "$d"
  have=$(stat -c %s "$W/qwen.gguf.partial")
  echo "piece $1: $have of $SIZE bytes"
  if (( have == SIZE )); then
    echo "$SHA256  $W/qwen.gguf.partial" | sha256sum -c - && mv "$W/qwen.gguf.partial" "$W/qwen.gguf" &&
      /usr/bin/time -f "import wall %e s" "$T" import-gguf "$W/qwen.gguf" "$M" 2>&1 | tail -2 &&
      rm -f "$W/qwen.gguf"
  fi
}

own_receive_opt() {
  # The second binary for opt_bench (carry .device/opt); the pipeline picks it up.
  xz -dc .device/opt/tandem.xz > "$W/tandem-opt.partial" && chmod +x "$W/tandem-opt.partial" &&
    mv "$W/tandem-opt.partial" "$W/tandem-opt" && echo "tandem-opt in place"
  exec bash "$0" wait
}

# start: the shared launch (head_lib.sh's run_phases) once the pieces are imported.
prepare_start() {
  [[ -f "$M/model.safetensors" ]] || { echo "no imported model at $M: carry the pieces first" >&2; return 3; }
}

# What the last call shows, after the phases (run_phases' wait).
report() {
  grep -hE "^test .*(FAILED|ok)$|test result|panicked" "$R"/tests-*.log | tail -12
  cat "$R/summary.txt" 2>/dev/null
  cat "$R/fast-check.md" "$R/fast-bench.md" 2>/dev/null
  tail -n 8 "$R/hf.log" 2>/dev/null
  grep -h '"kind":"val"' "$R/metrics.jsonl" 2>/dev/null | tail -2 | cut -c1-400
  tail -n 5 "$LOG"
  df -h /tmp | tail -1
}

pipeline() {
  [[ "${TESTS_FIRST:-0}" == 1 ]] && run_gpu_tests 200
  if [[ "${CHECK:-1}" == 1 ]]; then
    # The fast path against the CPU f32 reference on this model before any data is made from
    # it (a kernel that is wrong would also poison the dumps the head trains on).
    # Batch 1 only: the CPU f32 reference of this 1.5B model took 141 s for the batch-8 point
    # and the whole default set ran past 240 s (session 23); CHECK_ARGS widens it.
    timeout 240 "$T" fast-check --model "$M" ${CHECK_ARGS:---kv-lens 1,160 --batches 1 --points 1x300} \
      --json "$R/fast-check.json" > "$R/fast-check.md" 2> "$R/fast-check.log"
    status=$?
    echo "fast-check: exit $status" | tee -a "$R/summary.txt"
    mark "fast-check done"
    # A check cut short by its timeout says nothing either way: the pipeline goes on.
    if (( status != 0 && status != 124 )); then
      touch "$R/done"
      exit 1
    fi
  fi
  if [[ "${BASELINES:-1}" == 1 ]]; then
    timeout 300 "$T" fast-bench --model "$M" --batch 1,8 --verify-widths 4,8 --new-tokens 64 \
      --repeats 3 --with-taps --graphs-only --json "$R/fast-bench.json" \
      > "$R/fast-bench.md" 2> "$R/fast-bench.log"
    echo "fast-bench: exit $?" | tee -a "$R/summary.txt"
    timeout 240 python3 "$W/hf_decode_bench.py" "$M" --batch 1,8 --attn sdpa --json "$R/hf.json" > "$R/hf.log" 2>&1
    echo "hf sdpa: exit $?" | tee -a "$R/summary.txt"
    mark "decode baselines done"
  fi
  dumps=()
  if [[ "$PREV" == 1 && -f prev.jsonl ]]; then
    # Earlier sessions' regenerated replies: capture only (no generation).
    run /usr/bin/time -f "dump prev wall %e s" "$T" dump --model "$M" --dataset "$W/prev.jsonl" \
      --out "$W/dump-prev" --max-len 2048 --batch-size 64 --shard-rows 256 --device cuda --quiet
    dumps+=(--dump "$W/dump-prev")
    mark "dump prev done"
  fi
  # Training data: the last FRESH conversations are kept for the fresh dump of step 6; the
  # first SKIP_LINES were regenerated by an earlier session.
  head -n -"$FRESH" sharegpt-code-12k.jsonl | tail -n +"$((SKIP_LINES + 1))" > sg-train.jsonl
  tail -n "$FRESH" sharegpt-code-12k.jsonl > sg-fresh.jsonl
  regen() {
    run /usr/bin/time -f "dump a wall %e s" "$T" dump --model "$M" --dataset "$W/sg-train.jsonl" \
      --out "$W/dump-a" --regenerate --max-new-tokens "$MAX_NEW" --max-len 2048 --temperature 0 \
      --batch-size "$1" --shard-rows 256 --device cuda --quiet --max-seconds "$2"
  }
  t0=$(date +%s)
  # A failure at the batch size (memory) falls back to half of it for the time left; the dump
  # resumes from what it wrote.
  regen "$REGEN_BATCH" "$REGEN_SECONDS" ||
    regen "$(( REGEN_BATCH / 2 ))" "$(( REGEN_SECONDS - ($(date +%s) - t0) ))"
  run "$T" dump-info "$W/dump-a" | tail -n 20 > "$R/dump-a-info.txt"
  cp "$W/dump-a/manifest.json" "$R/dump-a-manifest.json"
  cat "$W/dump-a"/conversations-*.jsonl | xz -6 -T0 > "$R/conversations-a.jsonl.xz"
  dumps+=(--dump "$W/dump-a")
  mark "dump a done"
  # The cosine schedule spans --epochs: epochs that fit TRAIN_SECONDS at the trainer's measured
  # ~80k tokens/s (sessions 19 and 22), so the learning rate reaches its floor before the time
  # limit (session 22 asked for 20 epochs and stopped after 10.3, at half the peak rate).
  tokens=$(python3 -c 'import json, sys; print(sum(json.load(open(d + "/manifest.json"))["tokens"] for d in sys.argv[1:] if d))' \
    "${dumps[@]/#--dump/}" 2>/dev/null || echo 0)
  epochs=${EPOCHS:-$(python3 -c "print(max(1, min(20, int($TRAIN_SECONDS * ${TRAIN_TOKENS_PER_SECOND:-80000} * 0.85 / max(1, $tokens * 0.95)))))")}
  echo "train: $tokens tokens in the dumps, $epochs epochs for ${TRAIN_SECONDS}s" | tee -a "$R/summary.txt"
  run "$T" train "${dumps[@]}" --out "$W/head" --model "$M" --draft-vocab "$DRAFT_VOCAB" \
    --batch-size 16 --max-len 2048 --lr "$LR" --val-fraction 0.05 --epochs "$epochs" \
    --max-seconds "$TRAIN_SECONDS" --eval-every 400 --save-every 0 --device cuda --quiet --export-bf16
  cp "$W/head/config.json" "$W/head/curves.html" "$W/head/metrics.jsonl" "$R/"
  sha256sum "$W/head/model.safetensors" | tee "$R/head.sha256"
  last_val "$W/head" head
  mark "head trained"
  for s in $SHAPES_B1; do bench_set humaneval 1 "$s"; done
  [[ "${FUSED_BENCH:-1}" == 1 ]] && bench_set humaneval 1 3/4/8 fused
  mark "batch-1 HumanEval bench done"
  opt_bench
  # A fresh dump the head never saw: replay (the serving path against the recorded taps) and
  # compare (offline on the recorded taps vs online through the engine), chain and tree.
  run "$T" dump --model "$M" --dataset "$W/sg-fresh.jsonl" --out "$W/dump-fresh" --regenerate \
    --max-new-tokens 128 --max-len 1024 --batch-size "$FRESH" --max-samples "$FRESH" --device cuda --quiet
  timeout 200 "$T" replay --dump "$W/dump-fresh" --model "$M" --head "$W/head" --device cuda \
    --max-samples 8 --json "$R/replay.json" > "$R/replay.log" 2>&1
  echo "replay: exit $?" | tee -a "$R/summary.txt"
  for shape in 3/4/8 3/1/4; do
    IFS=/ read -r s k n <<< "$shape"
    timeout 300 "$T" compare --dump "$W/dump-fresh" --head "$W/head" --model "$M" --device cuda \
      --prompts dump --max-prompts "$FRESH" --max-samples "$FRESH" --offline-batch 32 \
      --steps "$s" --topk "$k" --num-draft-tokens "$n" --json "$R/compare_${s}_${k}_${n}.json" \
      --html "$R/compare_${s}_${k}_${n}.html" > "$R/compare_${s}_${k}_${n}.log" 2>&1
    echo "compare $shape: exit $?" | tee -a "$R/summary.txt"
  done
  mark "replay and compare done"
  opt_bench
  bench_set mtbench 1 3/4/8
  mark "batch-1 MT-Bench bench done"
  opt_bench
  for c in $CONCURRENCIES; do
    serve_load "target-only_c$c" "$c" --no-draft
    serve_load "adaptive_c$c" "$c" --draft "$W/head"
    mark "serve c$c done"
  done
  for s in $SHAPES_B8; do bench_set humaneval 8 "$s"; bench_set mtbench 8 "$s"; done
  mark "batch-8 bench done"
  [[ "${TESTS:-1}" == 1 && "${TESTS_FIRST:-0}" != 1 ]] && run_gpu_tests 150
}

run_phases "$0" "$PHASE" "${2:-}"
