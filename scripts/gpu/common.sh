# Sourced by the GPU scripts: joins the GGUF carried in two calls, unpacks the binary, imports
# the model once per machine. Expects /tmp/tandem/part-a (and part-c) from previous calls.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
# The carried folder with part-b, tandem.xz and the data files (.device/b, or another via BIN).
BIN="${BIN:-.device/b}"
W=/tmp/tandem
mkdir -p "$W" "$OUT"
if [[ ! -f "$W/smollm2/model.safetensors" ]]; then
  # The GGUF travels in pieces (each call carries at most 64 MiB with the working tree):
  # part-a and, when the tree has grown, part-c in earlier calls; part-b with this one.
  cat "$W/part-a" $( [[ -f "$W/part-c" ]] && echo "$W/part-c" ) "$BIN/part-b" > "$W/smollm2.gguf"
  ls -la "$W/smollm2.gguf"
fi
xz -dc "$BIN/tandem.xz" > "$W/tandem" && chmod +x "$W/tandem"
T="$W/tandem"
if [[ ! -f "$W/smollm2/model.safetensors" ]]; then
  "$T" import-gguf "$W/smollm2.gguf" "$W/smollm2" | tail -1
fi
M="$W/smollm2"
