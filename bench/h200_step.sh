#!/usr/bin/env bash
# Issue 33's step breakdown on the lent GPU as a daemon that outlives a device call, for a lease too
# short to carry and measure in one 10-minute call. The device calls, back to back (the machine stays
# warm 30 s after a call):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flow/*.whl   (carry .whl/flow)
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-ray/*.whl \
#       && bash bench/h200_step.sh start && bash bench/h200_step.sh wait                            (carry .whl-ray)
#   bash bench/h200_step.sh wait                                    # again until "== done"
# .whl/flow: ../shared/tools/gpu_wheels.py's wheels without Ray; .whl-ray: ray-2.60.0's wheel (45 MB).
# One call instead of two: the bench needs no Prefect, so ray with the flow's wheels less Prefect's own stack
# (prefect, cryptography, sqlalchemy, asyncpg, apprise, redis, burner_redis, greenlet, whenever, dateparser,
# pendulum, alembic) is 58 MB, under a call's 64 MiB with the working tree: carry that folder instead.
# MODELS, STEPS, VARIANTS (bench_grpo_step.py --variant ...) pick what runs; the default compares
# gradient checkpointing on and off, the lever the local backend's memory plan decides.
set -euo pipefail
OUT=${OUT:-/tmp/out}
KEEP=${KEEP:-/tmp/keep}
mkdir -p "$OUT" "$KEEP"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "$1" in
  start)
    setsid bash -c "python3 bench/bench_grpo_step.py --device gpu --model ${MODELS:-qwen3-0.6b,qwen3-1.7b} --prompts 16 \
        --generations 8 --prompt-length 256 --completion-length 1024 --short ${SHORT:-0} --steps ${STEPS:-5} --warmup 2 \
        ${VARIANTS:---variant ckpt=model.enable_gradient_checkpointing=true --variant no-ckpt=model.enable_gradient_checkpointing=false} \
        --out $KEEP/grpo-step.json > $KEEP/step.log 2>&1; echo \"== done: exit \$?\" >> $KEEP/step.log" \
        > /dev/null 2>&1 < /dev/null &
    echo "started: $KEEP/step.log" ;;
  wait)
    deadline=$(( $(date +%s) + ${WAIT:-540} ))
    while ! grep -q "^== done" "$KEEP/step.log" 2>/dev/null && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
    cp "$KEEP/grpo-step.json" "$OUT/" 2>/dev/null || true
    tail -c 300000 "$KEEP/step.log" > "$OUT/step.log"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    grep -E '^\{|^== done' "$KEEP/step.log" | cut -c1-400 || true
    tail -15 "$KEEP/step.log" ;;
  *)
    echo "usage: bash bench/h200_step.sh start|wait" >&2
    exit 2 ;;
esac
