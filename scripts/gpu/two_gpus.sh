#!/usr/bin/env bash
# H200 x2 (device kind nvidia-h200-x2), issue #19: every measurement that needs two GPUs, in one
# pipeline, so the first session that is lent the 2-GPU kind spends it measuring. On one GPU it
# runs what one GPU allows (the NCCL cases with one rank, the host-sum tensor-parallel tests)
# and says which rows it skipped.
#
#   here:   cargo build --release && bash scripts/gpu/two_gpus.sh pack   # .device/a..e
#           KEEP_HEAD=1 bash scripts/gpu/lean_tree.sh enter
#   device: call 1 (carry .device/a): bash scripts/gpu/two_gpus.sh a
#           calls 2-4 (carry .device/b, c, d): bash scripts/gpu/two_gpus.sh piece b|c|d
#           call 5 (carry .device/e): bash scripts/gpu/two_gpus.sh start; later calls: ... wait
#   here:   bash scripts/gpu/lean_tree.sh leave
#
# The pipeline (each step under a timeout; results and summary.txt come back):
#  1. TESTS=1: every GPU test binary with TANDEM_TEST_GPUS=N: the tensor-parallel target's taps
#     and logits against one GPU's (host sums on GPU 0, NCCL with 1 rank, NCCL with 2 ranks on
#     GPUs 0 and 1, graphs on and off), replay naming the partial-sum fault, the data-parallel
#     trainer's steps against one GPU's;
#  2. data-parallel dump: the same DUMP_CONVERSATIONS ShareGPT conversations (capture only, no
#     generation, so one conversation at a time on each rank) with `--devices 0` and
#     `--devices 0,1`: tokens/s of each (the rank manifests' tokens over the wall time), then
#     every record of the two dumps compared by source index (ids, mask, and the raw bytes of
#     the hidden states);
#  3. data-parallel training on the 2-GPU dump, `--devices 0` against `--devices 0,1`, same global
#     batch and seed, TRAIN_STEPS steps: tokens/s of each (median after 5 steps) and the largest
#     relative difference of the loss curves;
#  4. tensor parallelism: `tandem fast-check --tp 2` of a 4-layer Qwen2.5-1.5B-shaped random model
#     against the CPU f32 reference (every tap and the logits, prefill and decode points), then
#     an 8B-shaped random bf16 model (scripts/reference/make_random_llama.py):
#     `tandem fast-bench --tp 1` and `--tp 2` (batch 1 and 32, verify 4, 8 and 32), next to HF
#     transformers (sdpa) with the model spread over both GPUs (`device_map="auto"`), same run;
#  5. two processes bootstrapped as on two machines (scripts/train_dp.sh with NNODES=2 and
#     NODE_RANK 0 and 1, one GPU each, a shared rendezvous file and TANDEM_RUN_ID), only when
#     step 3's two-GPU run worked: the loss curve against step 3's single-GPU one.
# Every rank's own log comes back next to its job's (`<job>.rank-N.log`).
# Knobs: DUMP_CONVERSATIONS (500; read by `pack`); on the `start` call: TESTS=0, TRAIN_STEPS
# (60), TP_TABLE=0, TP_LAYERS (the 8B shape's 32; fewer for a quicker table).
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries
EXTRA_FILES="scripts/reference/make_random_llama.py scripts/reference/hf_step_bench.py scripts/ranks.sh scripts/train_dp.sh"
DUMP_CONVERSATIONS="${DUMP_CONVERSATIONS:-500}"
TRAIN_STEPS="${TRAIN_STEPS:-60}"

own_pack() {
  pack_smollm2 || return 1
  python3 scripts/reference/sharegpt_subset.py data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json \
    --count "$DUMP_CONVERSATIONS" --out /tmp/two-gpus-sharegpt.jsonl \
    --exclude data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz || return 1
  xz -9 -c /tmp/two-gpus-sharegpt.jsonl > .device/a/sharegpt.jsonl.xz
  du -b .device/a/sharegpt.jsonl.xz
}

own_a() {
  phase_a
  xz -dc .device/a/sharegpt.jsonl.xz > "$W/sharegpt.jsonl"
  wc -l "$W/sharegpt.jsonl"
}

# rank_logs OUT: the per-rank logs a `--devices` job leaves in $W/OUT, brought back (the job's
# own log only names the rank that failed).
rank_logs() {
  local f
  for f in "$W/$1"/rank-*.log; do
    [[ -f "$f" ]] && cp "$f" "$R/$1.$(basename "$f")"
  done
}

# dump_on DEVICES OUT DATASET [options]: `tandem dump --devices DEVICES` of DATASET (capture
# only), its wall time into $R/OUT.wall.
dump_on() {
  local devices=$1 out=$2 dataset=$3 t0
  shift 3
  rm -rf "${W:?}/$out"
  t0=$(date +%s.%N)
  timeout 900 "$T" dump --model "$M" --dataset "$dataset" --out "$W/$out" --device cuda \
    --devices "$devices" --max-len 1024 --quiet "$@" > "$R/$out.log" 2>&1
  echo "dump $out on $devices: exit $?" | tee -a "$R/summary.txt"
  python3 -c "import time; print(time.time() - $t0)" > "$R/$out.wall"
  rank_logs "$out"
}

# same_records A B: every record of dumps A and B (all ranks' shards) by source index (the
# record's place in the dataset; sample ids repeat in ShareGPT): the ids, the mask and the raw
# bytes of both hidden-state columns (hashed from the Arrow buffers: converting 700 x 1,728
# values to Python objects takes 0.14 s a record); prints how many are identical.
same_records() {
  python3 - "$W/$1" "$W/$2" <<'PY' | tee -a "$R/summary.txt"
import glob, hashlib, os, sys
import pyarrow as pa
import pyarrow.ipc as ipc
def raw(value):
    a = value.values
    if isinstance(a, pa.FixedSizeListArray):
        a = a.flatten()
    k = a.type.bit_width // 8
    return a.buffers()[1][a.offset * k:(a.offset + len(a)) * k]
def records(d):
    out = {}
    for path in sorted(glob.glob(os.path.join(d, "**", "shard-*.arrow"), recursive=True)):
        with open(path, "rb") as f:
            table = ipc.open_file(f).read_all()
        for i in range(table.num_rows):
            digest = {c: hashlib.sha256(raw(table.column(c)[i])).hexdigest()
                      for c in ("input_ids", "loss_mask", "aux_hidden", "last_hidden")}
            out[table.column("source_index")[i].as_py()] = digest
    return out
a, b = records(sys.argv[1]), records(sys.argv[2])
common = sorted(set(a) & set(b))
same = sum(a[k] == b[k] for k in common)
tokens_same = sum(a[k]["input_ids"] == b[k]["input_ids"] and a[k]["loss_mask"] == b[k]["loss_mask"] for k in common)
print(f"{os.path.basename(sys.argv[1])} vs {os.path.basename(sys.argv[2])}: {len(a)} and {len(b)} records, "
      f"{len(common)} in both; ids and masks equal in {tokens_same}; every byte equal in {same}")
PY
}

# dump_rate NAME: tokens/s of dump NAME (its rank manifests' tokens over its wall time; a
# `--devices` dump, even of one GPU, is a directory of ranks).
dump_rate() {
  python3 - "$W/$1" "$R/$1.wall" <<'PY'
import glob, json, os, sys
ms = [json.load(open(p)) for p in glob.glob(os.path.join(sys.argv[1], "rank-*", "manifest.json"))]
if not ms:
    print("no rank manifests"); sys.exit()
tokens, rows = sum(m["tokens"] for m in ms), sum(m["rows"] for m in ms)
wall = float(open(sys.argv[2]).read())
print(f"{tokens} tokens, {rows} rows, {len(ms)} ranks, {wall:.1f} s, {tokens / wall:,.0f} tokens/s")
PY
}

train_on() {
  local devices=$1 out=$2
  rm -rf "${W:?}/$out"
  # NCCL says which transport joins the GPUs (P2P/IPC over NVLink, or SHM through the host,
  # which would cap the speedup): its INFO lines of the 2-GPU run go to the summary.
  local debug=WARN
  [[ "$devices" == *,* ]] && debug=INFO
  NCCL_DEBUG=$debug timeout 300 "$T" train --dump "$W/dump-2" --out "$W/$out" --model "$M" --device cuda \
    --devices "$devices" --batch-size 16 --max-len 1024 --max-steps "$TRAIN_STEPS" --seed 7 \
    --save-every 0 --quiet > "$R/$out.log" 2>&1
  echo "train $out on $devices: exit $?" | tee -a "$R/summary.txt"
  cp "$W/$out/metrics.jsonl" "$R/$out.metrics.jsonl" 2>/dev/null
  rank_logs "$out"
  grep -oh "via \(P2P\|SHM\|NET\)[A-Za-z0-9/_]*" "$R/$out".rank-*.log 2>/dev/null | sort | uniq -c \
    | sed "s/^ */$out NCCL channels: /" | tee -a "$R/summary.txt"
}

# curves ONE OTHER: median train tokens/s (steps after 5) and the largest relative loss gap.
curves() {
  python3 - "$R/$1.metrics.jsonl" "$R/$2.metrics.jsonl" "$2" <<'PY' | tee -a "$R/summary.txt"
import json, statistics, sys
def train(p):
    try:
        return [l for l in map(json.loads, filter(str.strip, open(p))) if l.get("kind") == "train"]
    except OSError:
        return []
one, other = train(sys.argv[1]), train(sys.argv[2])
if not one or not other:
    print(f"{sys.argv[3]}: no metrics"); sys.exit()
rate = lambda ls: statistics.median(l["tokens_per_s"] for l in ls[5:] or ls)
gap = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(other, one))
print(f"{sys.argv[3]}: {len(other)} steps, {rate(other):,.0f} train tok/s against {rate(one):,.0f} "
      f"on one GPU ({rate(other) / rate(one):.2f}x); largest relative loss gap {gap:.2e}")
PY
}

pipeline() {
  source "$W/nccl_env.sh"
  local gpus
  gpus=$(nvidia-smi -L | wc -l)
  echo "GPUs: $gpus" | tee -a "$R/summary.txt"
  nvidia-smi topo -m > "$R/topology.txt" 2>&1
  [[ "${TESTS:-1}" == 1 ]] && run_gpu_tests 600
  local both=0
  (( gpus >= 2 )) && both=0,1
  if [[ "$both" == 0 ]]; then
    echo "one GPU: the 2-GPU rows below run on GPU 0 only (no speedups measured)" | tee -a "$R/summary.txt"
  fi
  # 2. Data-parallel dump.
  dump_on 0 dump-1 "$W/sharegpt.jsonl"
  dump_on "$both" dump-2 "$W/sharegpt.jsonl"
  for d in dump-1 dump-2; do echo "$d: $(dump_rate $d)" | tee -a "$R/summary.txt"; done
  same_records dump-1 dump-2
  mark "data-parallel dump done"
  # 3. Data-parallel training.
  train_on 0 train-1
  train_on "$both" train-2
  curves train-1 train-2
  mark "data-parallel training done"
  # 4. Tensor parallelism: a 4-layer Qwen2.5-1.5B-shaped random model (q/k/v biases, 12 heads
  # and 2 KV heads: splits 2 ways) split over the GPUs against the CPU f32 reference, then the
  # 8B-shaped table.
  local qshape=$W/qwen-shape
  timeout 300 python3 "$W/make_random_llama.py" "$qshape" --shape qwen2.5-1.5b --layers 4 \
    --tokenizer-from "$M" > "$R/make_qwen_shape.log" 2>&1
  local reduction=""
  (( gpus < 2 )) && reduction=1
  TANDEM_CUDA_TP_SIMULATE=$reduction timeout 600 "$T" fast-check --model "$qshape" --tp 2 \
    --kv-lens 1,33,160 --batches 3 --points 2x64 --json "$R/fast-check-tp2.json" \
    > "$R/fast-check-tp2.md" 2> "$R/fast-check-tp2.log"
  echo "fast-check --tp 2 (qwen2.5-1.5b shape, 4 layers${reduction:+, host sums on one GPU}): exit $?" | tee -a "$R/summary.txt"
  if [[ "${TP_TABLE:-1}" == 1 ]]; then
    local big=$W/llama8b-random tp
    timeout 600 python3 "$W/make_random_llama.py" "$big" --tokenizer-from "$M" \
      ${TP_LAYERS:+--layers "$TP_LAYERS"} > "$R/make_random.log" 2>&1
    echo "8B-shaped model: exit $?" | tee -a "$R/summary.txt"
    for tp in 1 2; do
      (( tp > gpus )) && { echo "tp $tp: skipped (one GPU)" | tee -a "$R/summary.txt"; continue; }
      timeout 600 "$T" fast-bench --model "$big" --tp "$tp" --batch 1,32 --verify-widths 4,8,32 \
        --new-tokens 32 --repeats 3 --with-taps --graphs-only --json "$R/fast-bench-tp$tp.json" \
        > "$R/fast-bench-tp$tp.md" 2> "$R/fast-bench-tp$tp.log"
      echo "fast-bench --tp $tp: exit $?" | tee -a "$R/summary.txt"
    done
    timeout 900 python3 "$W/hf_step_bench.py" "$big" --batch 1,32 --widths 4,8,32 --steps 10 \
      --device-map auto --json "$R/hf-tp.json" > "$R/hf-tp.log" 2>&1
    echo "hf sdpa, device_map auto: exit $?" | tee -a "$R/summary.txt"
    mark "tensor-parallel table done"
  fi
  # 5. Two processes as on two machines, once the two-GPU trainer has worked (a rank 0 that
  # dies before publishing its NCCL id leaves rank 1 waiting out the rendezvous timeout).
  if (( gpus >= 2 )) && [[ -s "$R/train-2.metrics.jsonl" ]]; then
    rm -rf "$W/train-nodes"
    # train_dp.sh sources gpu/nccl_env.sh and ranks.sh next to itself.
    mkdir -p "$W/gpu" && cp "$W/nccl_env.sh" "$W/gpu/nccl_env.sh"
    export TANDEM_RUN_ID="two-gpus-$(date +%s)"
    for node in 0 1; do
      NNODES=2 NODE_RANK=$node DEVICES=$node LOG_DIR="$R/nodes" TANDEM="$T" timeout 300 \
        bash "$W/train_dp.sh" --dump "$W/dump-2" --out "$W/train-nodes" --model "$M" \
        --batch-size 16 --max-len 1024 --max-steps "$TRAIN_STEPS" --seed 7 --save-every 0 \
        > "$R/node-$node.log" 2>&1 &
    done
    wait
    cp "$W/train-nodes/metrics.jsonl" "$R/train-nodes.metrics.jsonl" 2>/dev/null
    curves train-1 train-nodes
    mark "two-process bootstrap done"
  fi
}

report() {
  grep -hE "^test .*(FAILED|ok)$|test result|panicked" "$R"/tests-*.log 2>/dev/null | tail -20
  cat "$R/summary.txt" 2>/dev/null
  cat "$R/fast-check-tp2.md" "$R"/fast-bench-tp*.md 2>/dev/null
  tail -n 12 "$R/hf-tp.log" 2>/dev/null
}

run_phases "$0" "${1:-}" "${2:-}"
