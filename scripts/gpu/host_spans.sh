#!/usr/bin/env bash
# One device call, no GGUF transfer (issue #16, sessions 55-56, not yet run): every GPU suite, then
# where a 3/1/4 round's host time goes. `tandem bench --phase-timing` showed ~59 us of host
# queueing in each of draft, verify and extend a round (H100, session 55); TANDEM_HOST_SPANS=1
# prints the fast path's host time by call site. The committed head runs on a SmolLM2-shaped
# target with random weights made on the machine (drafts are rejected, but every step has a
# real round's shape).
# Here: `cargo build --release && bash scripts/gpu/rows_profile.sh pack && bash
# scripts/gpu/shape_ab.sh pack`, then copy .device/c/gpu-fast-tests.xz, .device/e/gpu-compare-tests.xz,
# .device/e/gpu-train-tests.xz and .device/a/question.jsonl into .device/x, and `KEEP_HEAD=1
# bash scripts/gpu/lean_tree.sh enter`. There (carry .device/x): `bash scripts/gpu/host_spans.sh`.
source scripts/gpu/head_lib.sh; use_cublas_libraries
W=/tmp/w; R=${OUT:-$W/out}; mkdir -p "$W" "$R"
for t in tandem gpu-tests gpu-fast-tests gpu-compare-tests gpu-train-tests; do xz -dc .device/x/$t.xz > $W/$t; chmod +x $W/$t; done
cp scripts/gpu/nccl_env.sh $W/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run_gpu_tests 150 > /dev/null
for f in $R/tests-*.log; do echo "$(basename $f): $(grep -h 'test result' $f)"; grep -h "FAILED\|panicked" $f | head -3; done
timeout 120 python3 scripts/reference/make_random_llama.py "$W/smol" --config-from .device/x/smol --tokenizer-from .device/x/smol 2>&1 | tail -1
mkdir -p "$W/data/mtbench" && cp .device/x/question.jsonl "$W/data/mtbench/"
spec=(bench --model "$W/smol" --draft heads/smollm2-135m-eagle3 --allow-wiring-mismatch --device cuda --prompts mtbench --data-root "$W/data" --steps 3 --topk 1 --num-draft-tokens 4 --batch 1 --max-prompts 8 --max-new-tokens 64)
for mode in pipelined phase; do
  extra=(); [[ $mode == phase ]] && extra=(--phase-timing)
  TANDEM_HOST_SPANS=1 timeout 150 "$W/tandem" "${spec[@]}" "${extra[@]}" --no-baseline > $W/spans-$mode.log 2>&1
  echo "== $mode: exit $?"; grep -E "^\| cuda|time split|host queued|^\| (host span|[a-z])" $W/spans-$mode.log
done
# the target-only decode loop alone, for its spans
TANDEM_HOST_SPANS=1 timeout 100 "$W/tandem" fast-bench --model "$W/smol" --batch 1 --verify-widths 4 --new-tokens 64 --repeats 3 --graphs-only --fused on > $W/fb.log 2>&1
echo "== fast-bench: exit $?"; grep -E "^\|" $W/fb.log | head -12
# Session 56's two changes, emulator-checked only: argmax_rows_split and the mask built inside
# each graph. The same runs with each switched off, alternating, no spans (gather_accepted_roots'
# split has no switch: in every arm). The GPU suites above ran with both on (the defaults);
# norm_silu_and_argmax_kernels_match_their_references and build_mask_kernel_expands_the_layouts_mask
# also compare each with the old launch.
for rep in 1 2; do
  for arm in - TANDEM_CUDA_ARGMAX_SPLIT=0 TANDEM_CUDA_GRAPH_MASK=0; do
    envs=(); [[ $arm != - ]] && envs=("$arm")
    env "${envs[@]}" timeout 100 "$W/tandem" "${spec[@]}" --no-baseline > $W/ab.log 2>&1
    echo "== 3/1/4 bench, ${arm/-/defaults} (rep $rep): exit $?"; grep -E "^\| cuda" $W/ab.log
    env "${envs[@]}" timeout 100 "$W/tandem" fast-bench --model "$W/smol" --batch 1 --verify-widths 4,8 --new-tokens 64 --repeats 3 --graphs-only --fused on > $W/abfb.log 2>&1
    echo "== fast-bench, ${arm/-/defaults} (rep $rep): exit $?"; grep -E "^\|" $W/abfb.log | head -8
  done
done
