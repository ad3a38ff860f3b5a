#!/usr/bin/env bash
# Issue #19 on a GPU machine: the data-parallel trainer's test and its throughput, same run.
#   bash scripts/gpu/dp_train.sh DUMP_DIR [STEPS]
# 1. `data_parallel_replicas_take_the_single_gpu_steps` with one replica per visible GPU (on one
#    GPU: NCCL with a single rank, through the same code path);
# 2. `tandem train --device cuda` on DUMP_DIR for STEPS steps, then the same with
#    `--devices 0..N-1` (same global batch and seed): median train tokens/s of each, and the
#    ratio; the loss of every step side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/nccl_env.sh
dump=${1:?usage: dp_train.sh DUMP_DIR [STEPS]}
steps=${2:-60}
gpus=$(nvidia-smi -L | wc -l)
devices=$(seq -s, 0 $((gpus - 1)))
TANDEM_TEST_GPUS=$gpus cargo test -p tandem-train --release --test train -- --ignored \
  data_parallel --nocapture 2>&1 | tail -n 5
out=${OUT_DIR:-/tmp/dp-train}
rm -rf "$out"; mkdir -p "$out"
common=(--dump "$dump" --device cuda --batch-size "${BATCH:-16}" --max-steps "$steps" --save-every 0 --quiet)
target/release/tandem train "${common[@]}" --out "$out/one" > "$out/one.log" 2>&1
target/release/tandem train "${common[@]}" --devices "$devices" --out "$out/dp"
python3 - "$out" "$gpus" <<'PY'
import json, statistics, sys
out, gpus = sys.argv[1], int(sys.argv[2])
def lines(p):
    return [json.loads(l) for l in open(p) if l.strip()]
one = [l for l in lines(f"{out}/one/metrics.jsonl") if l["kind"] == "train"]
dp = [l for l in lines(f"{out}/dp/metrics.jsonl") if l["kind"] == "train"]
skip = 5
t1 = statistics.median(l["tokens_per_s"] for l in one[skip:])
t2 = statistics.median(l["tokens_per_s"] for l in dp[skip:])
worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(dp, one))
print(f"| GPUs | train tok/s (median, steps > {skip}) | vs 1 GPU |")
print("|---|---|---|")
print(f"| 1 | {t1:,.0f} | 1.00x |")
print(f"| {gpus} | {t2:,.0f} | {t2 / t1:.2f}x |")
print(f"max relative loss difference over {len(dp)} steps: {worst:.2e}")
PY
