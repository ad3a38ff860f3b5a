#!/usr/bin/env bash
# Data-parallel training (issue #19): one `tandem train --device cuda` replica per GPU, each
# started the way torchrun starts a rank (RANK, WORLD_SIZE, LOCAL_RANK; CUDA_VISIBLE_DEVICES =
# its GPU). The replicas join one NCCL communicator: rank 0 writes its unique id to
# RENDEZVOUS (a file on a filesystem every machine sees; default OUT/nccl-id), tagged with
# TANDEM_RUN_ID so no rank joins a file an earlier launch left; without a shared filesystem,
# export NCCL_COMM_ID=<machine of rank 0>:<free port> on every machine instead (NCCL's own
# rendezvous: rank 0 listens there). Every step, each
# replica trains on its share of the global batch (--batch-size rows) and the gradients are
# summed over NCCL, so the run takes the steps one GPU would take. Rank 0 writes the head,
# checkpoints and OUT/metrics.jsonl; rank R>0 logs the same numbers in OUT/rank-R/.
#
#   DEVICES=0,1 bash scripts/train_dp.sh --dump D --out OUT [train options]
#
# On N machines of G GPUs each: the same command on every machine with NNODES=N,
# NODE_RANK=0..N-1, the same TANDEM_RUN_ID (e.g. a date stamp chosen once) and OUT on a
# shared filesystem. `tandem train --devices 0,1` does the single-machine case itself.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=gpu/nccl_env.sh
. "$here/gpu/nccl_env.sh"
if [ "${NNODES:-1}" -gt 1 ] && [ -z "${NCCL_COMM_ID:-}" ] && [ -z "${TANDEM_RUN_ID:-}" ]; then
  echo "NNODES>1: set the same TANDEM_RUN_ID on every machine (or NCCL_COMM_ID=host:port)" >&2
  exit 2
fi
export TANDEM_RUN_ID=${TANDEM_RUN_ID:-run-$(date +%s)-$$}
if [ -n "${NCCL_COMM_ID:-}" ]; then
  # Rank 0 listens at NCCL_COMM_ID only once its corpus is loaded; NCCL's default retries
  # (34, sleeping n x 100 ms: ~60 s) would give up on a rank 0 whose load takes longer. 600
  # retries of n x 5 ms wait ~900 s (the file rendezvous' limit), with gaps of at most 3 s.
  export NCCL_SOCKET_RETRY_CNT=${NCCL_SOCKET_RETRY_CNT:-600}
  export NCCL_SOCKET_RETRY_SLEEP_MSEC=${NCCL_SOCKET_RETRY_SLEEP_MSEC:-5}
fi
# shellcheck source=ranks.sh
. "$here/ranks.sh"
# Replicas meet in every step's all-reduce: one that fails stops the others, which would
# otherwise wait for it in NCCL for good.
STOP_ON_FAILURE=1 launch_ranks train --device cuda "$@"
