#!/usr/bin/env bash
# A driver job: rank 0 runs examples/driver.py's main() while every TP leader serves.
#   NPROC=4 TP=2 launch/driver.sh --requests 100
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec torchrun --standalone --nproc-per-node "${NPROC:-4}" examples/driver.py --tp "${TP:-1}" --engine "${ENGINE:-cpu}" "$@"
