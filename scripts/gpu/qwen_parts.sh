#!/usr/bin/env bash
# Moves the Qwen2.5-Coder-1.5B GGUF (1,117,320,768 bytes) to an empty GPU machine, whose uploads
# take at most 64 MiB per call (tracked files included), then joins, checks and imports it there.
#
#   here:   bash scripts/gpu/qwen_parts.sh split       # .device/qNN/piece: as large as a call allows
#           next to the working tree (64 MiB less the tree, less 1 MB of slack; 37.6 MB of tree in
#           session 11 gives 28 MB pieces, 40 calls)
#   device: bash scripts/gpu/qwen_parts.sh receive     # once per call, carry [".device/qN"], back to back
#           (each call appends its piece to /tmp/tandem/qwen.gguf.partial; the last one checks the
#           size and SHA-256, renames it and imports it to /tmp/tandem/qwen)
set -euo pipefail
GGUF_HERE=models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
SIZE=1117320768
SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
W=/tmp/tandem
# The tree travels with every call: what is left of 64 MiB is the piece (override with PIECE).
tree_bytes() { git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}'; }
case "${1:?usage: $0 split|receive}" in
split)
  [[ -f "$GGUF_HERE" ]] || { echo "no $GGUF_HERE: run scripts/fetch_qwen_coder.sh" >&2; exit 1; }
  rm -rf .device/q[0-9][0-9]
  PIECE=${PIECE:-$(( 64 * 1024 * 1024 - $(tree_bytes) - 1000000 ))}
  n=$(( (SIZE + PIECE - 1) / PIECE ))
  for ((i = 0; i < n; i++)); do
    d=$(printf ".device/q%02d" "$i")
    mkdir -p "$d"
    # Each piece names its index so a call that carries the wrong one fails instead of
    # appending out of order.
    dd if="$GGUF_HERE" of="$d/piece" bs="$PIECE" skip="$i" count=1 status=none
    echo "$i" > "$d/index"
    echo "$PIECE" > "$d/piece_size"
  done
  echo "$n pieces under .device/q00 .. $(printf 'q%02d' $((n - 1)))"
  ;;
receive)
  mkdir -p "$W"
  d=$(ls -d .device/q[0-9][0-9] | head -1)
  i=$(cat "$d/index")
  PIECE=$(cat "$d/piece_size")
  have=$(stat -c %s "$W/qwen.gguf.partial" 2>/dev/null || echo 0)
  if (( have != i * PIECE )); then
    echo "piece $i arrives but $have bytes are joined (expected $((i * PIECE))): carry the pieces in order" >&2
    exit 1
  fi
  cat "$d/piece" >> "$W/qwen.gguf.partial"
  have=$(stat -c %s "$W/qwen.gguf.partial")
  echo "piece $i: $have of $SIZE bytes"
  if (( have == SIZE )); then
    echo "$SHA256  $W/qwen.gguf.partial" | sha256sum -c - && mv "$W/qwen.gguf.partial" "$W/qwen.gguf"
    "$W/tandem" import-gguf "$W/qwen.gguf" "$W/qwen" | tail -1
  fi
  ;;
esac
