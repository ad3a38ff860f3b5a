#!/usr/bin/env bash
# Issue #6 on the H200: the speculative loop on the CUDA fast path. One run: the GPU tests of
# the fast head and engine, then `tandem bench --device cuda` (fast path: target-only and
# speculative, greedy, on MT-Bench first turns, every greedy difference traced to the target's
# logits) for the chain and the tree at batch 1 and 8, then HF transformers generate() on the
# same model, GPU and prompts. The tables are printed last.
#
# Runs from the repository root on the device machine. Earlier calls on the same warm machine
# carried the GGUF pieces (.device/a -> /tmp/tandem/part-a, .device/c -> /tmp/tandem/part-c);
# this call carries .device/f: part-b, mtbench.jsonl, tandem.xz (a `--features cuda` release
# build; the fast path itself needs no feature) and tandem-infer-tests.xz / tandem-cuda-tests.xz
# (`cargo test -p tandem-infer -p tandem-cuda --release --no-run`).
# Knobs: PARTS ("tests pool bench hf"; pool = fast-bench with CUDA's default memory-pool
# release threshold and with the one Gpu::new sets), PROMPTS (80 = all of MT-Bench), TOKENS (128), BATCHES ("1 8"),
# CONFIGS ("3/1/4 3/4/8": steps/topk/draft tokens), HF_PROMPTS (20), HEAD (committed head).
source scripts/gpu/common.sh
PARTS="${PARTS:-tests pool bench hf}"
PROMPTS="${PROMPTS:-80}"
TOKENS="${TOKENS:-128}"
BATCHES="${BATCHES:-1 8}"
CONFIGS="${CONFIGS:-3/1/4 3/4/8}"
HF_PROMPTS="${HF_PROMPTS:-20}"
HEAD="${HEAD:-heads/smollm2-135m-eagle3}"
LOG="$OUT/log.txt"
mkdir -p "$W/data/mtbench" && cp "$BIN/mtbench.jsonl" "$W/data/mtbench/question.jsonl"
# cuBLAS: the toolkit's, else the one PyTorch ships.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cublas/lib") for p in nvidia.__path__))' 2>/dev/null); do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"

if [[ " $PARTS " == *" tests "* ]]; then
  for t in tandem-cuda-tests tandem-infer-tests; do
    [[ -f "$BIN/$t.xz" ]] || continue
    echo "== GPU tests: $t --ignored" | tee -a "$LOG"
    xz -dc "$BIN/$t.xz" > "$W/$t" && chmod +x "$W/$t"
    # The whole output stays in $OUT/$t.txt (assertion messages follow the "panicked" line).
    timeout 240 "$W/$t" --ignored --test-threads 1 > "$OUT/$t.txt" 2>&1
    grep -E "^test |test result|panicked|rel err" "$OUT/$t.txt" | tail -30 | tee -a "$LOG"
  done
fi
if [[ " $PARTS " == *" pool "* ]]; then
  # The CUDA memory pool's release threshold: CUDA's default (0, freed memory goes back to the
  # driver at every synchronisation) vs what Gpu::new sets (keep it), same binary, same run.
  for threshold in 0 18446744073709551615; do
    echo "== fast-bench, pool release threshold $threshold" | tee -a "$LOG"
    timeout 200 "$T" fast-bench --model "$M" --batch 1,8,16 --new-tokens 64 --with-taps \
      --pool-release-threshold "$threshold" --json "$OUT/fast_bench_pool_$threshold.json" \
      2> "$W/fast_bench.err" | sed "s/^| tandem-cuda fast path |/| fast path, pool threshold $threshold |/" | tee -a "$LOG"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
  done
fi
if [[ " $PARTS " == *" bench "* ]]; then
  for cfg in $CONFIGS; do
    IFS=/ read -r steps topk ndt <<< "$cfg"
    for b in $BATCHES; do
      echo "== bench (fast path) $steps/$topk/$ndt batch $b: $PROMPTS MT-Bench prompts x $TOKENS tokens" | tee -a "$LOG"
      timeout 300 "$T" bench --model "$M" --draft "$HEAD" --device cuda --prompts mtbench \
        --data-root "$W/data" --max-prompts "$PROMPTS" --max-new-tokens "$TOKENS" \
        --steps "$steps" --topk "$topk" --num-draft-tokens "$ndt" --batch "$b" \
        --json "$OUT/bench_${steps}_${topk}_${ndt}_b$b.json" > "$W/bench.txt" 2> "$W/bench.err"
      echo "exit $?" | tee -a "$LOG"
      tail -3 "$W/bench.err" | tee -a "$LOG"
      cat "$W/bench.txt" | tee -a "$LOG"
    done
  done
fi
if [[ " $PARTS " == *" hf "* ]]; then
  echo "== HF transformers generate(), eager bf16, first $HF_PROMPTS MT-Bench prompts, $TOKENS tokens" | tee -a "$LOG"
  timeout 300 python3 scripts/reference/hf_mtbench_bench.py "$M" "$W/data/mtbench/question.jsonl" \
    --max-prompts "$HF_PROMPTS" --max-new-tokens "$TOKENS" --device cuda \
    --json "$OUT/hf_mtbench.json" 2>&1 | grep -v -i warn | tail -4 | tee -a "$LOG"
fi
echo "== tables" | tee -a "$LOG"
awk '/^\|/ && !seen[$0]++' "$LOG" | tee "$OUT/tables.md"
