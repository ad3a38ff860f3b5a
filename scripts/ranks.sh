# Sourced by dump_dp.sh and train_dp.sh: one `tandem JOB` process per GPU of this machine,
# each started the way torchrun starts a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
# CUDA_VISIBLE_DEVICES = its GPU, so it sees one device; NCCL_NVLS_ENABLE=0).
#
#   launch_ranks JOB [tandem JOB options...]
#
# DEVICES (default 0) lists this machine's GPUs; NNODES and NODE_RANK place them among N
# machines (ranks NODE_RANK*G .. NODE_RANK*G+G-1 of N*G); TANDEM is the binary (default
# target/release/tandem); each rank logs to LOG_DIR/JOB-rank-R.log (LOG_DIR defaults to the
# current directory). Waits for every rank, names the ones that failed, prints the last lines
# of every log and returns 1 if any failed. STOP_ON_FAILURE=1 (ranks that meet in collectives,
# which would wait for a dead rank for good) stops the others once one fails.
launch_ranks() {
  local job=$1 i rank status=0
  shift
  local -a gpus pids=()
  IFS=, read -r -a gpus <<< "${DEVICES:-0}"
  local local_world=${#gpus[@]} node=${NODE_RANK:-0}
  local world=$((local_world * ${NNODES:-1}))
  local tandem=${TANDEM:-target/release/tandem} logs=${LOG_DIR:-.}
  mkdir -p "$logs"
  for i in "${!gpus[@]}"; do
    rank=$((node * local_world + i))
    CUDA_VISIBLE_DEVICES=${gpus[$i]} RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$i \
      LOCAL_WORLD_SIZE=$local_world NCCL_NVLS_ENABLE=0 \
      "$tandem" "$job" --quiet "$@" > "$logs/$job-rank-$rank.log" 2>&1 &
    pids+=($!)
  done
  if [[ "${STOP_ON_FAILURE:-0}" == 1 ]]; then
    local left=${#pids[@]}
    while (( left > 0 )); do
      # (pids already reaped are named "no such job" and passed over)
      if ! wait -n "${pids[@]}" 2> /dev/null; then
        echo "a rank failed: stopping the others (the logs below say which)" >&2
        # The ranks only (this file is sourced); one already reaped makes kill fail, which
        # must not end a caller running under set -e.
        kill "${pids[@]}" 2> /dev/null || true
        wait || true
        status=1
        break
      fi
      left=$((left - 1))
    done
  else
    for i in "${!pids[@]}"; do
      rank=$((node * local_world + i))
      if ! wait "${pids[$i]}"; then
        echo "rank $rank failed: $logs/$job-rank-$rank.log" >&2
        status=1
      fi
    done
  fi
  for i in "${!gpus[@]}"; do tail -n 6 "$logs/$job-rank-$((node * local_world + i)).log"; done
  return $status
}
