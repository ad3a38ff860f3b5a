#!/usr/bin/env bash
# H200 (issues #6, #7 and #8), after regen_train.sh on the same warm machine (or with the
# committed head): replay and diagnose with the correctly wired head and with a deliberately
# mis-wired copy (SGLang-classic ids, i.e. layer + 1, in a foreign-style config without
# Tandem's manifest); compare (offline vs online acceptance, chain and tree); a bounded serve
# load test, speculative vs target-only; bench on MT-Bench next to HF transformers generate().
# One table per part in log.txt; the compare and bench tables (scripts/gpu/summary.py) last.
#
#   call 1 (carry .device/a):  mkdir -p /tmp/tandem && cp .device/a/part-a /tmp/tandem/
#   call 2 (carry .device/b):  bash scripts/gpu/serve_wiring.sh
# Knobs: PARTS (which parts, in order; default "replay compare diagnose serve bench"; one
# call has 10 minutes, so run the long parts on their own, e.g. PARTS=compare, PARTS=bench),
# HEAD (replay/diagnose/serve/bench; default: the regenerated head if present, else the
# committed one), REQUESTS (64), CONCURRENCY (8), CONCURRENCIES (serve: one load test per
# value, default CONCURRENCY), SERVE_ENGINE (auto: the CUDA fast path; burn), MAX_TOKENS (128),
# PROMPTS (compare/diagnose prompts, 16).
# compare: COMPARE_HEAD (heads/smollm2-135m-eagle3, the committed head), COMPARE_DUMP
# ($W/sharegpt-regen if it holds a dump, else DUMP), COMPARE_SAMPLES (dump samples, 16),
# COMPARE_TREE ("3 4 8": steps, topk, draft tokens; the engine builds SGLang's tree for any
# valid setting, 3/4/8 is the tree of BENCHMARKS' bench rows), COMPARE_MISWIRED (1: also the
# head served on every tap one block early, chain). About 2 minutes per run (estimate).
# bench: BENCH_PROMPTS (20; 80 = all of MT-Bench), BENCH_TOKENS (64), BENCH_TIMEOUT (540 s).
# At session 3's speeds (target-only 15 tok/s, speculative 16) 80 prompts x 64 tokens is ~11
# minutes, more than one call: BENCH_PROMPTS=80 BENCH_TOKENS=32 fits (~6 min + HF ~1.5 min).
source scripts/gpu/common.sh
mkdir -p "$W/data/mtbench" && cp "$BIN/mtbench.jsonl" "$W/data/mtbench/question.jsonl"
LOG="$OUT/log.txt"
if [[ -z "${HEAD:-}" ]]; then
  if [[ -f "$W/head-regen/model.safetensors" ]]; then HEAD="$W/head-regen"; else HEAD="heads/smollm2-135m-eagle3"; fi
fi
DUMP="${DUMP:-$W/sharegpt-regen}"
REQUESTS="${REQUESTS:-64}" CONCURRENCY="${CONCURRENCY:-8}" MAX_TOKENS="${MAX_TOKENS:-128}"
PROMPTS="${PROMPTS:-16}"
echo "head: $HEAD  dump: $DUMP" | tee -a "$LOG"

# The mis-wired copy: the ids the head was trained on, written one higher (SGLang classic's
# layer + 1) and read back as plain layer ids, with the manifest removed (a foreign head).
miswire() {
  rm -rf "$2" && cp -r "$1" "$2"
  python3 - "$2/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
c.pop("tandem_wiring", None)
json.dump(c, open(p, "w"), indent=2)
print("mis-wired ids", ids, "->", c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
PY
}
BAD="$W/head-miswired"
miswire "$HEAD" "$BAD"
# What a vLLM server feeds a head whose SGLang-classic ids it reads as its own (vLLM id k =
# block k-1): every slot one block early. The SGLang heuristic cannot express those taps from
# ids (the copy above is read back to the trained taps), so this copy says them in its manifest
# and drops the ids (the loader refuses ids that disagree with the manifest).
miswire_as_vllm() {
  rm -rf "$2" && cp -r "$1" "$2"
  python3 - "$2/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
w = c["tandem_wiring"]
taps = w["taps"]
if not all(t.startswith("block:") for t in taps):
    sys.exit(f"{p}: taps {taps} are not all blocks; no vLLM misreading to build")
blocks = [int(t.split(":")[1]) for t in taps]
w["taps"] = [f"block:{b - 1}" for b in blocks]
w["raw_ids"] = {"convention": "vllm", "ids": blocks}
c.get("eagle_config", {}).pop("eagle_aux_hidden_state_layer_ids", None)
json.dump(c, open(p, "w"), indent=2)
print("served as vLLM reads SGLang ids", blocks, ":", taps, "->", w["taps"])
PY
}

# The fault suite's "permuted slots" as a serving configuration: the head served on its own
# three taps in reverse slot order (a config that lists the ids in another order than the one
# the head was trained with). The manifest says the reversed taps, so serving does not stop.
miswire_permuted() {
  rm -rf "$2" && cp -r "$1" "$2"
  python3 - "$2/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
w = c["tandem_wiring"]
taps = w["taps"]
w["taps"] = taps[::-1]
w.pop("raw_ids", None)
c.get("eagle_config", {}).pop("eagle_aux_hidden_state_layer_ids", None)
json.dump(c, open(p, "w"), indent=2)
print("served with slots reversed:", taps, "->", w["taps"])
PY
}

run() { echo "== $*" | tee -a "$LOG"; timeout "${TIMEOUT:-300}" "$@" 2>&1 | grep -v '^wiring: dtype' | tail -${TAIL:-25} | tee -a "$LOG"; }
PARTS="${PARTS:-replay compare diagnose serve bench}"
has() { [[ " $PARTS " == *" $1 "* ]]; }

part_replay() {
if [[ -f "$DUMP/manifest.json" ]]; then
  run "$T" replay --dump "$DUMP" --model "$M" --head "$HEAD" --device cuda --max-samples 8 \
    --json "$OUT/replay.json"
  TAIL=12 run "$T" replay --dump "$DUMP" --model "$M" --head "$BAD" --device cuda --max-samples 4
else
  echo "no dump at $DUMP: replay skipped" | tee -a "$LOG"
fi
}

# Issue #7: offline (the engine's own drafting fed the dump's recorded taps, at serving's
# round positions, walked with the target's greedy tokens) vs online (the speculative engine
# on MT-Bench first turns), chain 3/1/4 and the tree, with the committed head.
part_compare() {
  local head="${COMPARE_HEAD:-heads/smollm2-135m-eagle3}" dump="${COMPARE_DUMP:-}"
  local samples="${COMPARE_SAMPLES:-16}"
  if [[ -z "$dump" ]]; then
    if [[ -f "$W/sharegpt-regen/manifest.json" ]]; then dump="$W/sharegpt-regen"; else dump="$W/compare-regen"; fi
  fi
  if [[ ! -f "$dump/manifest.json" ]]; then
    # No regenerated dump on this machine: regenerate just the samples compare reads, from
    # ShareGPT, or from MT-Bench with COMPARE_DATASET=mtbench (the target answers each turn).
    local data=(--dataset "$W/sharegpt-3k.jsonl")
    if [[ "${COMPARE_DATASET:-sharegpt}" == mtbench ]]; then
      # An evaluation set: dumped only to measure on (compare), never to train on.
      data=(--dataset mtbench --data-root "$W/data" --allow-eval)
    else
      [[ -f "$W/sharegpt-3k.jsonl" ]] || xz -dc "$BIN/sharegpt-3k.jsonl.xz" > "$W/sharegpt-3k.jsonl"
    fi
    TAIL=4 run "$T" dump --model "$M" "${data[@]}" --out "$dump" --regenerate \
      --max-new-tokens 128 --batch-size "$samples" --max-len 512 --max-samples "$samples" \
      --device cuda --quiet
  fi
  local tree=(${COMPARE_TREE:-3 4 8})
  # Online on the dump's own first exchanges (--prompts dump): with greedy decoding the engine
  # re-generates the text offline measures, so the two accept lengths are comparable.
  local common=(--dump "$dump" --model "$M" --device cuda --prompts dump
    --max-prompts "$samples" --max-samples "$samples" --offline-batch "$samples")
  echo "compare: head $head, dump $dump, tree ${tree[*]}" | tee -a "$LOG"
  TAIL=14 run "$T" compare "${common[@]}" --head "$head" --steps 3 --topk 1 --num-draft-tokens 4 \
    --json "$OUT/compare_chain.json" --html "$OUT/compare_chain.html"
  TAIL=14 run "$T" compare "${common[@]}" --head "$head" --steps "${tree[0]}" --topk "${tree[1]}" \
    --num-draft-tokens "${tree[2]}" --json "$OUT/compare_tree.json" --html "$OUT/compare_tree.html"
  if [[ "${COMPARE_MISWIRED:-1}" == 1 ]]; then
    miswire_as_vllm "$head" "$W/compare-head-miswired"
    TAIL=14 run "$T" compare "${common[@]}" --head "$W/compare-head-miswired" --steps 3 --topk 1 \
      --num-draft-tokens 4 --json "$OUT/compare_miswired_chain.json"
  fi
}

# Issue #7, mis-wired serving: compare (offline on the dump's recorded taps vs online through
# the mis-wired serving configuration) and diagnose on the two mis-wired copies. Needs the
# dump part_compare made (or regenerates it).
part_collapse() {
  local head="${COMPARE_HEAD:-heads/smollm2-135m-eagle3}" dump="${COMPARE_DUMP:-$W/compare-regen}"
  local samples="${COMPARE_SAMPLES:-16}"
  if [[ ! -f "$dump/manifest.json" ]]; then
    local data="$W/sharegpt-3k.jsonl"
    [[ -f "$data" ]] || xz -dc "$BIN/sharegpt-3k.jsonl.xz" > "$data"
    TAIL=4 run "$T" dump --model "$M" --dataset "$data" --out "$dump" --regenerate \
      --max-new-tokens 128 --batch-size "$samples" --max-len 512 --max-samples "$samples" \
      --device cuda --quiet
  fi
  local common=(--dump "$dump" --model "$M" --device cuda --prompts dump
    --max-prompts "$samples" --max-samples "$samples" --offline-batch "$samples")
  miswire_permuted "$head" "$W/compare-head-permuted"
  TAIL=14 run "$T" compare "${common[@]}" --head "$W/compare-head-permuted" --steps 3 --topk 1 \
    --num-draft-tokens 4 --json "$OUT/compare_permuted_chain.json" --html "$OUT/compare_permuted_chain.html"
  TAIL=16 run "$T" replay --dump "$dump" --model "$M" --head "$W/compare-head-permuted" --device cuda \
    --max-samples 4 --json "$OUT/replay_permuted.json"
  for bad in permuted miswired; do
    [[ -d "$W/compare-head-$bad" ]] || miswire_as_vllm "$head" "$W/compare-head-$bad"
    TAIL=30 run "$T" diagnose --head "$W/compare-head-$bad" --model "$M" --device cuda \
      --data-root "$W/data" --samples "${DIAG_SAMPLES:-8}" --max-new-tokens 64 \
      --json "$OUT/diagnose_$bad.json" --html "$OUT/diagnose_$bad.html"
  done
}

part_diagnose() {
run "$T" diagnose --head "$HEAD" --model "$M" --device cuda --data-root "$W/data" --samples "${DIAG_SAMPLES:-8}" --max-new-tokens 48 \
  --json "$OUT/diagnose.json"
run "$T" diagnose --head "$BAD" --model "$M" --device cuda --data-root "$W/data" --samples "${DIAG_SAMPLES:-8}" --max-new-tokens 48 \
  --json "$OUT/diagnose_miswired.json"
}

serve_load() {
  local label=$1 concurrency=$2; shift 2
  "$T" serve --model "$M" --device cuda --port 8199 --max-batch "$concurrency" --context 2048 \
    --engine "${SERVE_ENGINE:-auto}" "$@" > "$W/serve_$label.txt" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do grep -q "listening on" "$W/serve_$label.txt" && break; sleep 1; done
  grep "listening on" "$W/serve_$label.txt" | tee -a "$LOG"
  # Warm-up (JIT and autotune) outside the measurement.
  "$T" load-test --url http://127.0.0.1:8199 --data-root "$W/data" --requests "$concurrency" \
    --concurrency "$concurrency" --max-tokens 16 --label warmup > /dev/null 2>&1
  "$T" load-test --url http://127.0.0.1:8199 --data-root "$W/data" --requests "$REQUESTS" \
    --concurrency "$concurrency" --max-tokens "$MAX_TOKENS" --label "$label" \
    --json "$OUT/load_$label.json" 2>&1 | tail -3 | tee -a "$LOG"
  kill -TERM $pid; wait $pid
  tail -2 "$W/serve_$label.txt" | tee -a "$LOG"
}
# The load test per concurrency (CONCURRENCIES, default "$CONCURRENCY"; the server's max batch
# is the concurrency), speculative then target-only on the same engine (SERVE_ENGINE: auto =
# the CUDA fast path, or burn); the speculative server's tree: SERVE_STEPS (3), SERVE_TOPK (1),
# SERVE_NDT (num draft tokens; default the engine's for steps/topk).
part_serve() {
for c in ${CONCURRENCIES:-$CONCURRENCY}; do
  echo "== serve load test: $REQUESTS requests, concurrency $c, max_tokens $MAX_TOKENS, engine ${SERVE_ENGINE:-auto}" | tee -a "$LOG"
  serve_load "speculative_c$c" "$c" --draft "$HEAD" --steps "${SERVE_STEPS:-3}" --topk "${SERVE_TOPK:-1}" \
    ${SERVE_NDT:+--num-draft-tokens "$SERVE_NDT"}
  serve_load "target-only_c$c" "$c" --no-draft
done
}

# Issue #6: tandem target-only and speculative (greedy equality, every mismatch traced to the
# target's logit gap) on MT-Bench first turns, then HF transformers generate() on the same
# prompts, same token budget, same GPU, in the same run.
part_bench() {
  local prompts="${BENCH_PROMPTS:-20}" tokens="${BENCH_TOKENS:-64}"
  echo "== bench with mismatch tracing: $prompts MT-Bench prompts, $tokens tokens" | tee -a "$LOG"
  TIMEOUT="${BENCH_TIMEOUT:-540}" TAIL=40 run "$T" bench --model "$M" --draft "$HEAD" --device cuda \
    --prompts mtbench --data-root "$W/data" --max-prompts "$prompts" --max-new-tokens "$tokens" \
    --steps 3 --topk 1 --json "$OUT/bench_trace.json"
  TIMEOUT=300 TAIL=4 run python3 scripts/reference/hf_mtbench_bench.py "$M" "$W/data/mtbench/question.jsonl" \
    --max-prompts "$prompts" --max-new-tokens "$tokens" --device cuda --json "$OUT/hf_mtbench.json"
}

for part in $PARTS; do "part_$part"; done
python3 scripts/gpu/summary.py "$OUT" | tee -a "$LOG"
