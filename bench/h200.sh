#!/usr/bin/env bash
# The H200 runs of performance and "verified on" tables of docs/performance.md, on the lent GPU machine
# (device tool): wheels from ../shared/tools/gpu_wheels.py installed into /tmp/site first.
#   bash bench/h200.sh decode       # the native decoder vs the floor, the current path and bare TRL (no wheels needed;
#                                   # SKIP=current,cache leaves parts out: bench/bench_decode_floor.py --skip)
#   bash bench/h200.sh generation   # correctness of the fast path + evaluation eager vs fast
#   bash bench/h200.sh training     # local backend vs bare TRL
#   bash bench/h200.sh pipeline     # the CLI end to end: tiny, and a Qwen3-0.6B-shape directory (RUNS="q06": only it)
#   bash bench/h200.sh step         # the GRPO step by phase vs its floor, Qwen3 0.6B/1.7B/4B (MODELS=..., STEPS=, SHORT=0: no
#                                   # short-response setting, VARIANTS="--variant a=k=v ..."); longer than one device call:
#                                   # SEGMENTS=step bash bench/h200_verl.sh session, then its `wait` (STEP_MODELS=...);
#                                   # DRY=1: every cell planned from config-only models, nothing run (the CPU test)
#   bash bench/h200.sh current      # the current path's cells a decode-floor results file lacks (RESUME=file)
#   bash bench/h200.sh lora         # the LoRA table: full and LoRA r16 at Qwen3 0.6B-8B, planned vs measured peak and
#                                   # largest micro batch (DRY=1: planned on the CPU; in a session: SEGMENTS=lora)
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false \
       HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "$1" in
  decode)
    python3 bench/bench_decode_floor.py --device gpu --deadline "${DEADLINE:-520}" --skip "${SKIP:-}" \
        --models "${DECODE_MODELS:-qwen3-0.6b,qwen3-1.7b}" --out "$OUT/decode-floor.json" ;;
  generation)
    python3 bench/check_fast_generation.py --model qwen3-0.6b --device gpu --prompts 32 --max-new-tokens 128 \
        --out "$OUT/check-fast-generation.json"
    python3 bench/bench_generation.py --compare fast --model qwen3-0.6b --device gpu --prompts 64 --batch 32 \
        --max-new-tokens 256 --rounds 3 --out "$OUT/eval-generation.json" ;;
  training)
    python3 bench/bench_local_backend.py --model qwen3-0.6b --device gpu --steps 8 --warmup 4 --rounds 2 --prompts 4 \
        --generations 4 --completion-length 256 --out "$OUT/local-backend.json" ;;
  step)
    python3 bench/bench_grpo_step.py --device gpu --model "${MODELS:-qwen3-0.6b,qwen3-1.7b,qwen3-4b}" --prompts 16 \
        --generations 8 --prompt-length 256 --completion-length 1024 --short "${SHORT:-128}" --steps "${STEPS:-5}" --warmup 2 \
        ${VARIANTS:-} ${DRY:+--dry-run} --out "$OUT/grpo-step.json" ;;
  lora)
    # The LoRA table: full training and LoRA r16 at each shape's planned micro batch (peak beside the plan), then
    # the next larger one run unsized (out of memory there: the planner's largest is the device's).
    python3 bench/bench_grpo_step.py --device gpu --model "${MODELS:-qwen3-0.6b,qwen3-1.7b,qwen3-4b,qwen3-8b}" --prompts 16 \
        --generations 8 --prompt-length 256 --completion-length 1024 --short 0 --steps 3 --warmup 1 \
        --variant full= --variant lora=lora.rank=16 --probe-larger ${DRY:+--dry-run} --out "$OUT/lora-table.json" ;;
  current)
    python3 bench/bench_decode_floor.py --resume "$RESUME" --deadline "${DEADLINE:-300}" --out "$OUT/decode-floor.json" \
        ${CURRENT_ARGS:-} ;;
  pipeline)
    for run in ${RUNS:-tiny q06}; do
      start=$(date +%s)
      if [ "$run" = tiny ]; then
        python3 -m grpo_pipeline --model tiny --device auto --run-dir /tmp/runs --run-name tiny-h200 2>&1 | tail -25
      else
        python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_local_backend import make_model; from pathlib import Path; make_model('qwen3-0.6b', Path('/tmp/qwen3-0.6b-shape'))"
        python3 -m grpo_pipeline --model /tmp/qwen3-0.6b-shape --device auto --run-dir /tmp/runs --run-name q06-h200 \
            --set cluster.devices_per_node=1 --set trainer.total_training_steps=6 2>&1 | tail -25
      fi
      echo "$run: $(( $(date +%s) - start )) s"
      cp "/tmp/runs/$run-h200/report.md" "$OUT/report-$run.md"
      cp "/tmp/runs/$run-h200/metrics.jsonl" "$OUT/metrics-$run.jsonl" || true
    done ;;
esac
