#!/usr/bin/env bash
# Runs on the H200 (device tool), from the repository root, after .device/ has been carried:
#   .device/b/tandem.xz        release binary built with --features cuda (CUDARC_CUDA_VERSION=13000)
#   /tmp/tandem/part-a       first part of the SmolLM2 GGUF (left by the previous run)
#   .device/b/part-b           the rest
# Checks "Paris" and CPU-vs-GPU parity, then benchmarks tandem vs HF transformers generate().
set -uo pipefail
OUT="${OUT:-/tmp/out}"
W=/tmp/tandem
mkdir -p "$W" "$OUT"
cat "$W/part-a" .device/b/part-b > "$W/smollm2.gguf"
ls -la "$W/smollm2.gguf"
xz -dc .device/b/tandem.xz > "$W/tandem" && chmod +x "$W/tandem"
T="$W/tandem"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$T" import-gguf "$W/smollm2.gguf" "$W/smollm2" | tail -1
M="--model $W/smollm2"
echo "== generate on cuda (bf16), cold"
/usr/bin/time -f "process wall %e s" "$T" generate $M --device cuda --max-tokens 8 2>&1
echo "== check-device"
"$T" check-device $M --device cuda 2>&1 | tee "$OUT/check_device.md"
echo "== bench tandem cuda"
"$T" bench-target $M --device cuda --batch 1,8 --prompt-tokens 128 --new-tokens 64 --repeats 3 --json "$OUT/tandem_bench.json" 2>&1 | tee "$OUT/tandem_bench.md"
echo "== bench HF transformers"
python3 scripts/reference/hf_decode_bench.py "$W/smollm2" --batch 1,8 --prompt-tokens 128 --new-tokens 64 --repeats 3 --json "$OUT/hf_bench.json" 2>&1 | grep -v Warning | tee "$OUT/hf_bench.md"
echo "== tables"
cat "$OUT/check_device.md" "$OUT/tandem_bench.md" "$OUT/hf_bench.md" | grep '^|\|cold'
