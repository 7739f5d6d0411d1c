#!/usr/bin/env bash
# A standalone rollout service on this node: NPROC ranks, TP ranks per engine.
#   NPROC=4 TP=2 ENGINE=cpu launch/serve.sh [extra launch options]
#   NPROC=8 TP=2 ENGINE=sglang MODEL=/models/qwen2.5-7b launch/serve.sh --sglang '{"attention_backend": "flashinfer"}'
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" launch/serve.py --tp "${TP:-1}" --engine "${ENGINE:-cpu}" \
  ${MODEL:+--model "$MODEL"} "$@"
