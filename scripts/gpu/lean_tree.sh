#!/usr/bin/env bash
# The device tool sends the working tree with every call, and a call carries at most 64 MiB in
# all: the committed head, its curves, the golden fixtures and the regenerated conversations
# (38 MB of the 41 MB tree) would leave 23 MB a call for a large upload. `enter` checks out a
# throw-away branch without them (a 3 MB tree); `leave` returns to the branch you were on, the
# files restored by git. Both refuse to run with uncommitted changes to tracked files.
#   bash scripts/gpu/lean_tree.sh enter     # before a run of upload calls (qwen_chain.sh)
#   KEEP_HEAD=1 bash scripts/gpu/lean_tree.sh enter   # the same, for the SmolLM2 scripts
#   bash scripts/gpu/lean_tree.sh leave     # after the last call
set -euo pipefail
cd "$(dirname "$0")/../.."
LEAN=device-lean
HEAVY=(heads/smollm2-135m-eagle3/model.safetensors heads/smollm2-135m-eagle3/metrics.jsonl
       heads/smollm2-135m-eagle3/curves.html tests/fixtures datasets/regenerated)
# KEEP_HEAD=1 keeps the committed head's weights (20 MB): the SmolLM2 scripts bench with it.
[[ "${KEEP_HEAD:-0}" == 1 ]] && HEAVY=("${HEAVY[@]:1}")
if ! git diff --quiet HEAD; then
  echo "lean_tree: commit or stash your changes first (git checkout would carry them along)" >&2
  exit 1
fi
case "${1:?usage: $0 enter|leave}" in
enter)
  git rev-parse --abbrev-ref HEAD > .git/lean-tree-return
  git checkout -q -B "$LEAN"
  git rm -q -r "${HEAVY[@]}"
  git commit -q -m "lean tree for device transfers (never pushed)"
  echo "on $LEAN: $(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}') bytes tracked"
  ;;
leave)
  back=$(cat .git/lean-tree-return 2>/dev/null || echo main)
  git checkout -q "$back"
  git branch -q -D "$LEAN"
  rm -f .git/lean-tree-return
  echo "back on $back"
  ;;
esac
