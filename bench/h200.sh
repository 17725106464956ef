#!/usr/bin/env bash
# The H200 runs of performance and "verified on" tables of docs/performance.md, on the lent GPU machine
# (device tool): wheels from ../shared/tools/gpu_wheels.py installed into /tmp/site first.
#   bash bench/h200.sh generation   # correctness of the fast path + evaluation eager vs fast
#   bash bench/h200.sh training     # local backend vs bare TRL
#   bash bench/h200.sh pipeline     # the CLI end to end: tiny, and a Qwen3-0.6B-shape directory
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false \
       HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "$1" in
  generation)
    python3 bench/check_fast_generation.py --model qwen3-0.6b --device gpu --prompts 32 --max-new-tokens 128 \
        --out "$OUT/check-fast-generation.json"
    python3 bench/bench_generation.py --compare fast --model qwen3-0.6b --device gpu --prompts 64 --batch 32 \
        --max-new-tokens 256 --rounds 3 --out "$OUT/eval-generation.json" ;;
  training)
    python3 bench/bench_local_backend.py --model qwen3-0.6b --device gpu --steps 8 --warmup 4 --rounds 2 --prompts 4 \
        --generations 4 --completion-length 256 --out "$OUT/local-backend.json" ;;
  pipeline)
    python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_local_backend import make_model; from pathlib import Path; make_model('qwen3-0.6b', Path('/tmp/qwen3-0.6b-shape'))"
    start=$(date +%s)
    python3 -m flows.grpo --model tiny --device auto --run-dir /tmp/runs --run-name tiny-h200 2>&1 | tail -25
    echo "tiny: $(( $(date +%s) - start )) s"; start=$(date +%s)
    python3 -m flows.grpo --model /tmp/qwen3-0.6b-shape --device auto --run-dir /tmp/runs --run-name q06-h200 \
        --set cluster.devices_per_node=1 --set trainer.total_training_steps=6 2>&1 | tail -25
    echo "qwen3-0.6b shape: $(( $(date +%s) - start )) s"
    cp /tmp/runs/tiny-h200/report.md "$OUT/report-tiny.md"; cp /tmp/runs/q06-h200/report.md "$OUT/report-q06.md"
    cp /tmp/runs/q06-h200/metrics.jsonl "$OUT/metrics-q06.jsonl"; cp /tmp/runs/q06-h200/eval/eval.json "$OUT/eval-q06.json" ;;
esac
