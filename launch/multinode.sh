#!/usr/bin/env bash
# The same service across nodes.  Run on every node with its NODE_RANK; RDZV is node 0's host:port.
#   NNODES=2 NODE_RANK=0 RDZV=node0:29400 NPROC=8 TP=2 ENGINE=sglang MODEL=/models/x launch/multinode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec torchrun --nnodes "${NNODES:-2}" --node-rank "${NODE_RANK:?set NODE_RANK}" --nproc-per-node "${NPROC:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "${RDZV:?set RDZV=host:port}" --rdzv-id "${RDZV_ID:-rollout}" \
  launch/serve.py --tp "${TP:-1}" --engine "${ENGINE:-cpu}" ${MODEL:+--model "$MODEL"} "$@"
