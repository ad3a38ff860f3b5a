#!/usr/bin/env bash
# Issue #5 on the H200: the CUDA fast path (crate tandem-cuda, kernels/llama.cu) checked against
# the CPU f32 reference and benchmarked next to HF transformers generate() in the same run.
#
# Runs from the repository root on the device machine. Earlier calls on the same warm machine
# carried the GGUF pieces (.device/a -> /tmp/tandem/part-a, .device/c -> /tmp/tandem/part-c);
# this call carries .device/f:
#   part-b                    the rest of the GGUF
#   tandem.xz                 `cargo build --release` (the CPU build: the fast path loads the
#                             CUDA driver, NVRTC and cuBLAS at run time, no cuda feature needed)
#   tandem-cuda-tests.xz      `cargo test -p tandem-cuda --release --no-run` (the GPU tests)
# Knobs: PARTS (default "tests check bench hf"), BATCHES (1,8,16), CHECK_ARGS (extra fast-check
# arguments), NEW_TOKENS (64).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
W=/tmp/tandem
BIN="${BIN:-.device/f}"
PARTS="${PARTS:-tests check bench hf}"
BATCHES="${BATCHES:-1,8,16}"
NEW_TOKENS="${NEW_TOKENS:-64}"
mkdir -p "$W" "$OUT"
LOG="$OUT/log.txt"
# cuBLAS: the toolkit's, else the one PyTorch ships.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cublas/lib") for p in nvidia.__path__))' 2>/dev/null); do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
if [[ ! -f "$W/smollm2/model.safetensors" ]]; then
  cat "$W/part-a" $( [[ -f "$W/part-c" ]] && echo "$W/part-c" ) "$BIN/part-b" > "$W/smollm2.gguf"
fi
xz -dc "$BIN/tandem.xz" > "$W/tandem" && chmod +x "$W/tandem"
T="$W/tandem"
[[ -f "$W/smollm2/model.safetensors" ]] || "$T" import-gguf "$W/smollm2.gguf" "$W/smollm2" | tail -1
M="$W/smollm2"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"

if [[ " $PARTS " == *" tests "* ]]; then
  echo "== (1) GPU tests of tandem-cuda (kernels vs references, fast path vs burn on tiny models)" | tee -a "$LOG"
  xz -dc "$BIN/tandem-cuda-tests.xz" > "$W/tandem-cuda-tests" && chmod +x "$W/tandem-cuda-tests"
  timeout 300 "$W/tandem-cuda-tests" --ignored --test-threads 1 2>&1 | tail -25 | tee -a "$LOG"
fi
if [[ " $PARTS " == *" check "* ]]; then
  echo "== (2) fast-check on SmolLM2: batch 1..16, KV 1..4096, prefill + decode + tree, every tap" | tee -a "$LOG"
  timeout 400 "$T" fast-check --model "$M" --json "$OUT/fast_check.json" ${CHECK_ARGS:-} > "$OUT/fast_check.md" 2> "$W/fast_check.err"
  echo "exit $?" | tee -a "$LOG"
  tail -5 "$W/fast_check.err" | tee -a "$LOG"
fi
if [[ " $PARTS " == *" bench "* ]]; then
  echo "== (3) fast-bench (cold process: includes NVRTC compile and weight upload)" | tee -a "$LOG"
  timeout 300 "$T" fast-bench --model "$M" --batch "$BATCHES" --new-tokens "$NEW_TOKENS" --with-taps \
    --json "$OUT/fast_bench.json" > "$OUT/fast_bench.md" 2> "$W/fast_bench.err"
  echo "exit $?" | tee -a "$LOG"
  tail -3 "$W/fast_bench.err" | tee -a "$LOG"
fi
if [[ " $PARTS " == *" hf "* ]]; then
  echo "== (4) HF transformers generate(), same GPU, same run" | tee -a "$LOG"
  timeout 300 python3 scripts/reference/hf_decode_bench.py "$M" --batch "$BATCHES" --prompt-tokens 128 \
    --new-tokens "$NEW_TOKENS" --repeats 3 --json "$OUT/hf_bench.json" 2>&1 | grep -v -i warn > "$OUT/hf_bench.md"
fi
echo "== tables" | tee -a "$LOG"
cat "$OUT"/fast_check.md "$OUT"/fast_bench.md "$OUT"/hf_bench.md 2>/dev/null | grep '^|\|cold' | tee -a "$LOG"
