#!/usr/bin/env bash
# H200 (issues #7 and #8), after regen_train.sh on the same warm machine (or with the
# committed head): replay, compare (chain) and diagnose with the correctly wired head,
# the same with a deliberately mis-wired copy (SGLang-classic ids, i.e. layer + 1, in a
# foreign-style config without Tandem's manifest), then a bounded serve load test,
# speculative vs target-only. One table per part at the end of log.txt.
#
#   call 1 (carry .device/a):  mkdir -p /tmp/tandem && cp .device/a/part-a /tmp/tandem/
#   call 2 (carry .device/b):  bash scripts/gpu/serve_wiring.sh
# Knobs: PARTS (which parts, in order; default "replay diagnose serve bench"), HEAD (default: the regenerated head if present, else the committed one), REQUESTS
# (64), CONCURRENCY (8), MAX_TOKENS (128), PROMPTS (compare/diagnose prompts, 16).
source scripts/gpu/common.sh
mkdir -p "$W/data/mtbench" && cp .device/b/mtbench.jsonl "$W/data/mtbench/question.jsonl"
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
BAD="$W/head-miswired"
rm -rf "$BAD" && cp -r "$HEAD" "$BAD"
python3 - "$BAD/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
c.pop("tandem_wiring", None)
json.dump(c, open(p, "w"), indent=2)
print("mis-wired ids", ids, "->", c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
PY

run() { echo "== $*" | tee -a "$LOG"; timeout 300 "$@" 2>&1 | grep -v '^wiring: dtype' | tail -${TAIL:-25} | tee -a "$LOG"; }
PARTS="${PARTS:-replay diagnose serve bench}"
has() { [[ " $PARTS " == *" $1 "* ]]; }

part_replay() {
if [[ -f "$DUMP/manifest.json" ]]; then
  run "$T" replay --dump "$DUMP" --model "$M" --head "$HEAD" --device cuda --max-samples 8 \
    --json "$OUT/replay.json"
  TAIL=12 run "$T" replay --dump "$DUMP" --model "$M" --head "$BAD" --device cuda --max-samples 4
  # compare drafts chains only (tree settings are not implemented in compare yet).
  run "$T" compare --dump "$DUMP" --head "$HEAD" --model "$M" --device cuda --data-root "$W/data" \
    --max-prompts "$PROMPTS" --max-samples 32 --steps 3 --json "$OUT/compare_chain.json"
  run "$T" compare --dump "$DUMP" --head "$BAD" --model "$M" --device cuda --data-root "$W/data" \
    --max-prompts "$PROMPTS" --max-samples 32 --steps 3 --json "$OUT/compare_miswired.json"
else
  echo "no dump at $DUMP: replay/compare skipped" | tee -a "$LOG"
fi
}

part_diagnose() {
run "$T" diagnose --head "$HEAD" --model "$M" --device cuda --data-root "$W/data" --samples "${DIAG_SAMPLES:-8}" --max-new-tokens 48 \
  --json "$OUT/diagnose.json"
run "$T" diagnose --head "$BAD" --model "$M" --device cuda --data-root "$W/data" --samples "${DIAG_SAMPLES:-8}" --max-new-tokens 48 \
  --json "$OUT/diagnose_miswired.json"
}

serve_load() {
  local label=$1; shift
  "$T" serve --model "$M" --device cuda --port 8199 --max-batch "$CONCURRENCY" --context 2048 "$@" \
    > "$W/serve_$label.txt" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do grep -q "listening on" "$W/serve_$label.txt" && break; sleep 1; done
  # Warm-up (JIT and autotune) outside the measurement.
  "$T" load-test --url http://127.0.0.1:8199 --data-root "$W/data" --requests "$CONCURRENCY" \
    --concurrency "$CONCURRENCY" --max-tokens 16 --label warmup > /dev/null 2>&1
  "$T" load-test --url http://127.0.0.1:8199 --data-root "$W/data" --requests "$REQUESTS" \
    --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --label "$label" \
    --json "$OUT/load_$label.json" 2>&1 | tail -3 | tee -a "$LOG"
  kill -TERM $pid; wait $pid
  tail -2 "$W/serve_$label.txt" | tee -a "$LOG"
}
part_serve() {
echo "== serve load test: $REQUESTS requests, concurrency $CONCURRENCY, max_tokens $MAX_TOKENS" | tee -a "$LOG"
serve_load speculative --draft "$HEAD" --steps 3 --topk 1
serve_load target-only --no-draft
}

# Issue #6: greedy equality on the GPU, every mismatch traced to the target's logit gap.
part_bench() {
  echo "== bench with mismatch tracing: ${BENCH_PROMPTS:-20} MT-Bench prompts, 64 tokens" | tee -a "$LOG"
  TAIL=40 run "$T" bench --model "$M" --draft "$HEAD" --device cuda --prompts mtbench --data-root "$W/data" \
    --max-prompts "${BENCH_PROMPTS:-20}" --max-new-tokens 64 --steps 3 --topk 1 --json "$OUT/bench_trace.json"
}

for part in $PARTS; do "part_$part"; done
