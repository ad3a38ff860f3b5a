#!/usr/bin/env bash
# Data-parallel dump (issue #19): one `tandem dump` process per GPU, each started the way torchrun
# starts a rank (RANK, WORLD_SIZE, LOCAL_RANK; CUDA_VISIBLE_DEVICES = its GPU, so it sees one
# device). Rank R dumps the dataset records i % WORLD_SIZE == R into OUT/rank-RRRRR/ and resumes
# there; `tandem train --dump OUT` and `tandem dump-info OUT` read the ranks as one dump.
#
#   DEVICES=0,1 bash scripts/dump_dp.sh --model M --dataset D --out OUT --device cuda [dump options]
#
# Each rank's log: LOG_DIR/dump-rank-R.log (LOG_DIR defaults to the current directory). On N
# machines of G GPUs each, run it on every machine with NNODES=N and NODE_RANK=0..N-1 (ranks
# NODE_RANK*G .. NODE_RANK*G+G-1 of N*G) and OUT on a shared filesystem, or copy the rank
# directories into one OUT afterwards. No rank talks to another: the records are split by index,
# so there is nothing to bootstrap. --max-samples and --max-seconds apply per rank.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ranks.sh
. "$here/ranks.sh"
launch_ranks dump "$@"
