#!/usr/bin/env bash
# H200, issue #16: why the fused small-step kernels slow down with rows (SmolLM2 batch-1 decode
# 0.82 ms, a tree-8 verification 1.36 ms, though both read the same weights once). Step times
# by row count (`tandem fast-bench --fused both`, CUDA graphs: 1, 2, 4, 8 rows as batch-1 verify
# widths and batch 2..8 decodes), then ncu kernel by kernel (eager launches, fused on) with
# duration, registers, achieved occupancy and DRAM bytes, grouped by the step's row count
# (read from the attention grid: rows x heads blocks).
# Then every GPU suite, MT-Bench at batch 1 (SHAPES, default 3/1/4 3/4/8 5/8/32) and, with
# SERVE="1 8 32 64", the serve load test at those concurrencies (the servers up at once, loaded
# in turn SERVE_REPEATS times, default 5: serve_pairs in head_lib.sh).
# QWEN=1: a Qwen2.5-1.5B-shaped random model's step times too, fused against cuBLAS.
# GEMV_SWEEP="1,1,2,4 1,1,1,1 ..": fused step times for each outputs-a-warp setting of gemv_rows
# (TANDEM_CUDA_GEMV_OUTPUTS), the fastest then used by the bench and serve; SERVE_LONG="64":
# 256 requests at those concurrencies too.
# HF=1: HF transformers (sdpa) decode of the same model, batch 1 and 8, in the same run.
# NSYS=1: an nsys timeline of 3/1/4 speculative rounds (the raw kernel and API traces come back).
# AB_ENV="VAR=value ..": each shape's bench (and the adaptive serve at each concurrency) also
# runs with these variables exported, labelled `ab`: an A/B of one switch in one binary and run.
# FAST_AB="VAR=value ..": fast-bench (fused) again with these exported, in the same run;
# FAST_AB2 a second such arm, followed by the defaults once more. FAST_BATCH (default 1,2,4,8)
# and FAST_WIDTHS (2,4,8): fast-bench's batches and verification widths.
# MMA_AB="N ..": prefill and verify step times with the tensor-core attention for steps of at
# least N slots a sequence (one arm per N) against the row kernel (fast-bench, same run).
# AB_TARGET=1: the serve load test's target-only server runs with AB_ENV too.
# TESTS_AB_ENV="VAR=value ..": the tandem-infer GPU tests again with these exported.
# LAUNCH_FLOOR=1: a CUDA graph of N dependent tiny kernels (and 576x576 gemvs) timed, N = 158 ..
# 32 (scripts/gpu/launch_floor.py). NCU_WARM=1: ncu keeps the caches between kernels.
# Knobs: TESTS=0, NCU=0 (2: also batch 8; 32: batch 8's 8- and 32-row steps only), NCU_HEAD=1, BENCH=0, FAST_AB, MMA_AB, SHAPES, SERVE, SERVE_LONG, QWEN, GEMV_SWEEP, HF, NSYS,
# INTERLEAVE=1 (benches alternate target-only and speculative prompt by prompt; every bench prints
# its speedup's standard error).
#   here:     cargo build --release && bash scripts/gpu/rows_profile.sh pack
#             KEEP_HEAD=1 bash scripts/gpu/lean_tree.sh enter
#   call 1 (carry .device/a): bash scripts/gpu/rows_profile.sh a
#   calls 2-4 (carry .device/b, c, d): bash scripts/gpu/rows_profile.sh piece b|c|d
#   call 5 (carry .device/e): bash scripts/gpu/rows_profile.sh start;  later calls: ... wait
set -uo pipefail
source "$(dirname "$0")/head_lib.sh"
use_cublas_libraries
EXTRA_FILES="scripts/reference/make_random_llama.py scripts/reference/hf_decode_bench.py scripts/gpu/mma_ab.py scripts/gpu/launch_floor.py"
# A baseline binary (e.g. the build before a kernel change that has no switch) travels split as
# .device/{c,d}/tandem-base.xz.{1,2} (no one piece has room for it beside the tree; phase_piece
# copies them into $W): fast-bench and the 3/1/4 bench run with it too, between two runs of the
# new binary (the pipeline's baseline section).

# ncu_rows NAME FAST_BENCH_ARGS...: ncu over one fast-bench run, summarised by rows and kernel.
ncu_rows() {
  local name=$1 ncu
  shift
  ncu=$(find_tool ncu)
  [[ -n "$ncu" ]] || { echo "ncu missing" | tee -a "$R/summary.txt"; return 1; }
  # NCU_WARM=1: caches kept between kernels (`--cache-control none`), as in the pipeline, where
  # a kernel reads the rows the previous one just wrote from L2.
  local warm=()
  [[ "${NCU_WARM:-0}" == 1 ]] && warm=(--cache-control none)
  TANDEM_CUDA_GRAPHS=0 TANDEM_CUDA_FUSED=${NCU_FUSED:-8} timeout 280 "$ncu" --clock-control none "${warm[@]}" \
    --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum \
    --csv --launch-count 5000 "$T" fast-bench --model "$M" --prompt-tokens 128 --new-tokens "${NCU_NEW_TOKENS:-8}" \
    --repeats 1 --fused on "$@" > "$R/$name.csv" 2> "$R/$name.err"
  echo "ncu $name: exit $?" | tee -a "$R/summary.txt"
  python3 - "$R/$name.csv" "$name" > "$R/${name}_summary.txt" 2>&1 <<'PY'
import csv, sys, collections, re
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
col = {c: head.index(c) for c in ("ID", "Kernel Name", "Grid Size", "Metric Name", "Metric Value", "Metric Unit")}
kernels = {}
for r in body:
    k = kernels.setdefault(int(r[col["ID"]]), {"name": r[col["Kernel Name"]][:40], "grid": r[col["Grid Size"]]})
    v = float(r[col["Metric Value"]].replace(",", "") or "nan")
    unit = r[col["Metric Unit"]]
    if r[col["Metric Name"]] == "gpu__time_duration.sum":
        v *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, float("nan"))
    elif r[col["Metric Name"]] == "dram__bytes_read.sum":
        v *= {"byte": 1e-3, "Kbyte": 1.0, "Mbyte": 1e3, "Gbyte": 1e6}.get(unit, float("nan"))
    k[r[col["Metric Name"]]] = v
heads = 9  # SmolLM2
label = "?"
by = collections.defaultdict(list)
for i in sorted(kernels):
    k = kernels[i]
    if k["name"].startswith("attention_invariant"):
        blocks = int(re.findall(r"[0-9]+", k["grid"])[0])
        label = f"{blocks // heads} rows"
    elif k["name"].startswith("attention"):
        label = "unfused"
    by[(label, k["name"], k["grid"])].append(k)
print(f"{sys.argv[2]}: {len(kernels)} kernels. Per (rows, kernel, grid): count, mean us, registers, achieved occupancy %, DRAM KB read")
for key in sorted(by, key=lambda key: (key[0], -sum(k.get("gpu__time_duration.sum", 0) for k in by[key]))):
    ks = by[key]
    mean = lambda m: sum(k.get(m, float("nan")) for k in ks) / len(ks)
    if len(ks) < 20:
        continue
    print(f"{key[0]:>8} {key[1]:40s} {key[2]:>14} {len(ks):6d} {mean('gpu__time_duration.sum'):8.2f} us "
          f"{mean('launch__registers_per_thread'):5.0f} reg {mean('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f}% "
          f"{mean('dram__bytes_read.sum'):8.1f} KB")
# Kernel time a step by row count: every kernel labelled with that row count, over the number
# of steps (attention launches / 30 layers), to set against the graphed step time (the rest of
# that time is the gaps between launches).
layers = 30  # SmolLM2
per_label = collections.defaultdict(lambda: [0.0, 0, 0])
for (label, name, _grid), ks in by.items():
    per_label[label][0] += sum(k.get("gpu__time_duration.sum", 0) for k in ks)
    per_label[label][1] += len(ks)
    if name.startswith("attention_invariant"):
        per_label[label][2] += len(ks)
for label, (us, count, attn) in sorted(per_label.items()):
    if attn >= layers:
        steps = attn / layers
        print(f"STEP {label:>8}: {us / steps:8.1f} us of kernel time a step, {count / steps:6.1f} kernels a step ({steps:.0f} steps)")
PY
}

mma_attention_ab() {
  # MMA_AB="N ..": the tensor-core attention (kernels/attention_mma.cu) for steps of at least N
  # slots a sequence (TANDEM_CUDA_MMA_ATTENTION=N), one arm per N, against the row kernel, same
  # run and binary: fast-bench prefills (TTFT) of MMA_PROMPTS-token prompts (default 512) at
  # batch 1, 8 and 32, and verifying 4, 8 and 32 tokens after them (N=4 also takes the
  # unfused verifications of 4 and 8 tokens, i.e. batch 8 and up), each with the default floor
  # of 2,048 (slot, query head) rows (MMA_MIN_QUERY_ROWS). Table in summary.txt.
  local p arm
  for p in ${MMA_PROMPTS:-512}; do
    for arm in rows ${MMA_AB}; do
      TANDEM_CUDA_MMA_ATTENTION=$([[ $arm == rows ]] && echo 0 || echo "$arm") timeout 300 "$T" \
        fast-bench --model "$M" --prompt-tokens "$p" --batch 1,8,32 --verify-widths 4,8,32 \
        --new-tokens 16 --repeats 3 --with-taps --graphs-only --json "$R/prefill-$arm-$p.json" \
        > "$R/prefill-$arm-$p.md" 2> "$R/prefill-$arm-$p.log"
      echo "fast-bench, attention $arm, $p-token prompts: exit $?" | tee -a "$R/summary.txt"
    done
  done
  python3 "$(dirname "$0")/mma_ab.py" "$R" ${MMA_PROMPTS:-512} -- ${MMA_AB} | tee -a "$R/summary.txt"
  # The real model's prefill, decode and tree steps with the tensor cores from the smallest
  # width, every tap and the logits against the burn CPU f32 reference (fast-check's
  # bf16 tolerances), at a few points (the full sweep takes minutes of CPU reference).
  local narrowest
  narrowest=$(printf '%s\n' ${MMA_AB} | sort -n | head -1)
  TANDEM_CUDA_MMA_ATTENTION="$narrowest" timeout 240 "$T" fast-check --model "$M" \
    --kv-lens 33,144,511 --batches 3,8 --points 8x300 --json "$R/fast-check-mma.json" \
    > "$R/fast-check-mma.md" 2> "$R/fast-check-mma.log"
  echo "fast-check, tensor-core attention from width $narrowest: exit $?" | tee -a "$R/summary.txt"
  mark "mma attention A/B done"
}

# fused_fast_bench BIN NAME: fast-bench of the fused small steps (decode at batch 1-8, verify
# 2/4/8), its table and JSON as $R/NAME.{md,json}.
fused_fast_bench() {
  timeout 300 "$1" fast-bench --model "$M" --batch "${FAST_BATCH:-1,2,4,8}" \
    --verify-widths "${FAST_WIDTHS:-2,4,8}" --new-tokens 64 \
    --repeats 3 --with-taps --graphs-only --fused on --json "$R/$2.json" > "$R/$2.md" 2> "$R/$2.log"
}

pipeline() {
  [[ "${TESTS:-1}" == 1 ]] && run_gpu_tests 300
  if [[ "${BENCH:-1}" == 1 ]]; then
    timeout 300 "$T" fast-bench --model "$M" --batch "${FAST_BATCH:-1,2,4,8}" \
      --verify-widths "${FAST_WIDTHS:-2,4,8}" --new-tokens 64 --repeats 3 --with-taps --graphs-only --fused both --json "$R/fast-bench.json" \
      > "$R/fast-bench.md" 2> "$R/fast-bench.log"
    echo "fast-bench: exit $?" | tee -a "$R/summary.txt"
    # FAST_AB="VAR=value ..": the same fast-bench again with these exported (same run).
    if [[ -n "${FAST_AB:-}" ]]; then
      (export $FAST_AB; fused_fast_bench "$T" fast-bench-ab)
      echo "fast-bench with $FAST_AB: exit $?" | tee -a "$R/summary.txt"
    fi
    # FAST_AB2: a second arm, then the defaults again (a drift of the card shows between them).
    if [[ -n "${FAST_AB2:-}" ]]; then
      (export $FAST_AB2; fused_fast_bench "$T" fast-bench-ab2)
      echo "fast-bench with $FAST_AB2: exit $?" | tee -a "$R/summary.txt"
      fused_fast_bench "$T" fast-bench-again
      echo "fast-bench (defaults again): exit $?" | tee -a "$R/summary.txt"
    fi
    mark "fast-bench done"
  fi
  # The baseline binary (see the top): fast-bench with it, then the new binary again, and the
  # 3/1/4 bench with each, so a device drift shows as a difference between the two new runs.
  if compgen -G "$W/tandem-base.xz.*" > /dev/null; then
    cat "$W"/tandem-base.xz.* | xz -dc > "$W/tandem-base" && chmod +x "$W/tandem-base"
    fused_fast_bench "$W/tandem-base" fast-bench-base
    echo "fast-bench (base binary): exit $?" | tee -a "$R/summary.txt"
    fused_fast_bench "$T" fast-bench-new2
    echo "fast-bench (new binary again): exit $?" | tee -a "$R/summary.txt"
    (T="$W/tandem-base"; bench "$W/head" bin-base 3/1/4)
    bench "$W/head" bin-new 3/1/4
    python3 - "$R" <<'PY' | tee -a "$R/summary.txt"
import json, os, sys
r = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(r, name)))
    except (OSError, ValueError):
        return []
runs = {"new": load("fast-bench.json"), "base": load("fast-bench-base.json"), "new2": load("fast-bench-new2.json")}
def ms(rows, step, width, batch):
    for x in rows:
        if (x["step"], x["width"], x["batch"], x["taps"], x["kernels"]) == (step, width, batch, 3, "fused"):
            return x["step_ms_median"]
    return float("nan")
print("| step | batch | base ms | new ms | new again ms | new / base |")
print("|---|---|---|---|---|---|")
for step, width, batch in [("decode", 1, 1), ("decode", 1, 2), ("decode", 1, 4), ("decode", 1, 8), ("verify", 2, 1), ("verify", 4, 1), ("verify", 8, 1)]:
    b = ms(runs["base"], step, width, batch)
    n1 = ms(runs["new"], step, width, batch)
    n2 = ms(runs["new2"], step, width, batch)
    label = step if step == "decode" else f"verify {width}"
    print(f"| {label} | {batch} | {b:.3f} | {n1:.3f} | {n2:.3f} | {min(n1, n2) / b:.3f} |")
PY
    mark "baseline binary done"
  fi
  [[ -n "${MMA_AB:-}" ]] && mma_attention_ab
  # LAUNCH_FLOOR=1: what N dependent kernels cost in one CUDA graph on this card (tiny kernels
  # and 576x576 gemvs, PyTorch), the floor under a decode step of N launches.
  if [[ "${LAUNCH_FLOOR:-0}" == 1 ]]; then
    timeout 120 python3 "$W/launch_floor.py" > "$R/launch_floor.md" 2>&1
    echo "launch floor: exit $?" | tee -a "$R/summary.txt"
    cat "$R/launch_floor.md" >> "$R/summary.txt"
  fi
  # Outputs a warp of gemv_rows per row bucket (TANDEM_CUDA_GEMV_OUTPUTS; bits never change):
  # fused step times for each setting in GEMV_SWEEP, and the fastest over the 4- and 8-row
  # steps is exported for the bench and the serve load test below.
  if [[ -n "${GEMV_SWEEP:-}" ]]; then
    local g
    for g in $GEMV_SWEEP; do
      TANDEM_CUDA_GEMV_OUTPUTS=$g timeout 120 "$T" fast-bench --model "$M" --batch 1,2,4,8 \
        --verify-widths 4,8 --new-tokens 64 --repeats 3 --with-taps --graphs-only --fused on \
        --json "$R/sweep_${g//,/-}.json" > "$R/sweep_${g//,/-}.md" 2>&1
    done
    python3 - "$R" $GEMV_SWEEP > "$R/sweep.txt" <<'PY'
import json, os, sys
r, settings = sys.argv[1], sys.argv[2:]
def ms(rows, step, width, batch):
    return next((x["step_ms_median"] for x in rows if x["step"] == step and x["width"] == width
                 and x["batch"] == batch and x["taps"] == 3), float("nan"))
cols = [("decode", 1, 1), ("decode", 1, 2), ("decode", 1, 4), ("decode", 1, 8), ("verify", 4, 1), ("verify", 8, 1)]
print("| outputs a warp (buckets 1,2,4,8) | decode b1 | b2 | b4 | b8 | verify 4 b1 | verify 8 b1 | 4- and 8-row steps |")
print("|---|---|---|---|---|---|---|---|")
best = None
for g in settings:
    try:
        rows = json.load(open(os.path.join(r, f"sweep_{g.replace(',', '-')}.json")))
    except (OSError, ValueError):
        continue
    v = [ms(rows, *c) for c in cols]
    score = v[2] + v[3] + v[4] + v[5]
    print(f"| {g} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {score:.3f} |")
    if score == score and (best is None or score < best[0]):
        best = (score, g)
print(f"BEST {best[1] if best else ''}")
PY
    cat "$R/sweep.txt" | tee -a "$R/summary.txt"
    export TANDEM_CUDA_GEMV_OUTPUTS
    TANDEM_CUDA_GEMV_OUTPUTS=$(awk '/^BEST/ {print $2}' "$R/sweep.txt")
    echo "bench and serve with TANDEM_CUDA_GEMV_OUTPUTS=$TANDEM_CUDA_GEMV_OUTPUTS" | tee -a "$R/summary.txt"
    mark "sweep done"
  fi
  # HF transformers (sdpa, bf16) decoding the same imported model in the same run.
  if [[ "${HF:-0}" == 1 ]]; then
    timeout 200 python3 "$W/hf_decode_bench.py" "$M" --batch 1,8 --attn sdpa --json "$R/hf.json" \
      > "$R/hf.log" 2>&1
    echo "HF sdpa decode: exit $?" | tee -a "$R/summary.txt"
    mark "hf done"
  fi
  # MT-Bench at batch 1 with the committed head and the default kernels, each bench with its
  # own target-only baseline; the round's parts against a decode step of that baseline.
  # A shape listed twice is benched twice (the run's bench-to-bench spread): each pass has its
  # own reports (default1, default2, ...).
  local s pass=0
  for s in ${SHAPES:-3/1/4 3/4/8 5/8/32}; do
    pass=$((pass + 1))
    bench "$W/head" "default$pass" "$s"
    # The same bench with each phase waiting for its device work: the round's split.
    bench "$W/head" "phases$pass" "$s" --phase-timing --no-baseline
    rounds_line "default$pass" "$s" "phases$pass"
    if [[ -n "${AB_ENV:-}" ]]; then
      (export $AB_ENV; bench "$W/head" "ab$pass" "$s"
       bench "$W/head" "abphases$pass" "$s" --phase-timing --no-baseline)
      rounds_line "ab$pass" "$s" "abphases$pass"
    fi
  done
  mark "spec bench done"
  # NCU=1: one-row decode and 4/8-token verifications; 2: also batch-8 decode; 32: only batch-8
  # decode (8 rows) and 3/1/4-shaped verification at batch 8 (32 rows), four steps each.
  case "${NCU:-1}" in
    1|2) ncu_rows ncu-b1 --batch 1 --verify-widths 4,8 ;;&
    2) ncu_rows ncu-b8 --batch 8 --verify-widths 1 ;;
    32) NCU_NEW_TOKENS=4 NCU_FUSED=32 ncu_rows ncu-b8v4 --batch 8 --verify-widths 4 ;;
  esac
  [[ "${NCU:-1}" != 0 ]] && mark "ncu done"
  # NSYS=1: an nsys timeline of speculative rounds (3/1/4, 8 MT-Bench prompts): where a round's
  # draft and extend go between kernels (host step building, copies, syncs). The raw traces come
  # back (nsys-*.csv); the API and kernel summaries are printed.
  if [[ "${NSYS:-0}" == 1 ]]; then
    local nsys
    nsys=$(find_tool nsys)
    if [[ -n "$nsys" ]]; then
      timeout 240 "$nsys" profile --trace cuda,osrt --sample none -o "$R/round" --force-overwrite true \
        "$T" bench --model "$M" --draft "$W/head" --device cuda --prompts mtbench --data-root "$W/data" \
        --max-prompts 8 --max-new-tokens 128 --steps 3 --topk 1 --num-draft-tokens 4 --batch 1 \
        > "$R/nsys-bench.log" 2>&1
      echo "nsys bench: exit $?" | tee -a "$R/summary.txt"
      timeout 120 "$nsys" stats --report cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_trace,cuda_api_trace \
        --format csv --output "$R/nsys" "$R/round.nsys-rep" > "$R/nsys-stats.log" 2>&1
      rm -f "$R/round.sqlite"
    else
      echo "nsys missing" | tee -a "$R/summary.txt"
    fi
    mark "nsys done"
  fi
  # NCU_HEAD=1: ncu over speculative rounds (3/1/4, 2 MT-Bench prompts, graphs off so every
  # launch is its own): each kernel's count and device time, to split a round's draft and
  # extend (0.115 + 0.128 ms of device time on an H100, session 37) into kernel time and the
  # gaps between launches. nsys is not installed on the machines. Caches are not flushed between
  # kernels (`--cache-control none`): with ncu's default flush, kernels that read rows the
  # previous one just wrote looked several times slower than in the pipeline (session 37).
  if [[ "${NCU_HEAD:-0}" == 1 ]]; then
    local ncu
    ncu=$(find_tool ncu)
    if [[ -n "$ncu" ]]; then
      TANDEM_CUDA_GRAPHS=0 timeout 280 "$ncu" --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum \
        --csv --launch-count 6000 "$T" bench --model "$M" --draft "$W/head" --device cuda \
        --prompts mtbench --data-root "$W/data" --max-prompts 2 --max-new-tokens 48 --steps 3 \
        --topk 1 --num-draft-tokens 4 --batch 1 --no-baseline > "$R/ncu-head.csv" 2> "$R/ncu-head.err"
      echo "ncu head: exit $?" | tee -a "$R/summary.txt"
      python3 - "$R/ncu-head.csv" <<'PY' | tee -a "$R/summary.txt"
import csv, collections, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
col = {c: head.index(c) for c in ("ID", "Kernel Name", "Metric Value", "Metric Unit")}
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
by = collections.defaultdict(list)
for r in body:
    by[r[col["Kernel Name"]][:48]].append(float(r[col["Metric Value"]].replace(",", "")) * scale.get(r[col["Metric Unit"]], float("nan")))
total = sum(sum(v) for v in by.values())
print(f"ncu head: {sum(len(v) for v in by.values())} kernels, {total / 1e3:.2f} ms of kernel time; per kernel: count, total ms, mean us")
for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {name:48s} {len(v):6d} {sum(v) / 1e3:8.3f} {sum(v) / len(v):8.2f}")
PY
    else
      echo "ncu missing" | tee -a "$R/summary.txt"
    fi
    mark "ncu head done"
  fi
  # A Qwen2.5-1.5B-shaped random model (hidden 1,536; fused kernels off by default there since
  # session 25): fused (cut-off 8) against cuBLAS at 1 and 8 rows.
  if [[ "${QWEN:-0}" == 1 ]]; then
    python3 "$W/make_random_llama.py" "$W/qwen-random" --shape qwen2.5-1.5b --tokenizer-from "$M" \
      > "$R/qwen-make.log" 2>&1
    echo "qwen-shaped model: $(tail -1 "$R/qwen-make.log")" | tee -a "$R/summary.txt"
    TANDEM_CUDA_FUSED=8 timeout 300 "$T" fast-bench --model "$W/qwen-random" --batch 1,2,4,8 \
      --verify-widths 4,8 --new-tokens 32 --repeats 3 --with-taps --graphs-only --fused both \
      --json "$R/qwen-fast-bench.json" > "$R/qwen-fast-bench.md" 2> "$R/qwen-fast-bench.log"
    echo "qwen-shaped fast-bench: exit $?" | tee -a "$R/summary.txt"
    rm -rf "$W/qwen-random"
    mark "qwen done"
  fi
  # The serve load test (64 MT-Bench requests, 128 tokens) at each concurrency in SERVE
  # (default none): target-only and the adaptive policy (and, with AB_ENV, the adaptive policy
  # with those variables; AB_TARGET=1 target-only with them too) up at once, loaded in turn
  # SERVE_REPEATS times (serve_pairs); ratios to target-only in summary.txt.
  # SERVE_ARMS="LABEL:ENV:ARGS;..." replaces those servers (ENV "-" for none; @HEAD stands for
  # the head), e.g. "target-only:-:--no-draft;adaptive:-:--draft @HEAD;
  # target-only-mma:TANDEM_CUDA_MMA_ATTENTION=4:--no-draft;adaptive-mma:TANDEM_CUDA_MMA_ATTENTION=4:--draft @HEAD"
  # (the first is every ratio's baseline; adaptive-X is also set against target-only-X).
  local c arm arms servers=("target-only:-:--no-draft" "adaptive:-:--draft $W/head")
  if [[ -n "${SERVE_ARMS:-}" ]]; then
    servers=()
    IFS=';' read -ra arms <<< "$SERVE_ARMS"
    for arm in "${arms[@]}"; do
      arm="${arm#"${arm%%[![:space:]]*}"}"
      [[ -n "$arm" ]] && servers+=("${arm//@HEAD/$W/head}")
    done
  elif [[ -n "${AB_ENV:-}" ]]; then
    servers+=("adaptive-ab:$AB_ENV:--draft $W/head")
    [[ "${AB_TARGET:-0}" == 1 ]] && servers+=("target-only-ab:$AB_ENV:--no-draft")
  fi
  for c in ${SERVE:-}; do
    serve_pairs "$c" "${servers[@]}"
  done
  # Steady state: 256 requests at the concurrencies in SERVE_LONG.
  for c in ${SERVE_LONG:-}; do
    REQUESTS=256 serve_load "target-only_long_c$c" "$c" --no-draft
    REQUESTS=256 serve_load "adaptive_long_c$c" "$c" --draft "$W/head"
  done
}

report() {
  grep -hE "^test .*(FAILED|ok)$|test result|panicked" "$R"/tests-*.log 2>/dev/null | tail -40
  cat "$R/summary.txt" 2>/dev/null
  grep -E "^\|" "$R/fast-bench.md" 2>/dev/null
  for f in fast-bench-ab fast-bench-ab2 fast-bench-again; do
    grep -E "^\|" "$R/$f.md" 2>/dev/null | sed "s/^/$f /"
  done
  grep -E "^\|" "$R/qwen-fast-bench.md" 2>/dev/null | sed 's/^/QWEN /'
  tail -n 12 "$R/hf.log" 2>/dev/null
  head -n 25 "$R"/nsys_cuda_api_sum.csv "$R"/nsys_cuda_gpu_kern_sum.csv 2>/dev/null
  cat "$R/ncu-b1_summary.txt" "$R/ncu-b8_summary.txt" 2>/dev/null | head -40
  python3 - "$R" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "load_*.json"))):
    d = json.load(open(path))
    print(os.path.basename(path), {k: d[k] for k in d if isinstance(d[k], (int, float))})
PY
}

run_phases "$0" "${1:-}" "${2:-}"
