"""A stand-in for `python3 -m verl.trainer.main_ppo` that behaves like verl 0.9.1 at the process
boundary, for testing the verl backend's Ray-job path on a CPU-only Ray cluster (verl itself needs
GPUs/NPUs and vLLM). Selected with `--set "trainer.entrypoint=<python> tests/verl_stand_in.py"`.

What it shares with verl, not imitates: the overrides are composed through verl's own Hydra config
(`ppo_trainer`, as main_ppo does; a bad key fails as Hydra does), and Ray is joined exactly as
main_ppo joins it (`ray.init` with verl's `get_ppo_ray_runtime_env()`, merged by Ray with the job's
runtime_env). What it imitates: verl's device check ("Total available GPUs X is less than total
desired GPUs Y"), its console step lines, its file logger (`$VERL_FILE_LOGGER_PATH`, opened "wb"), its
checkpoint layout (`global_step_N/actor/...` then `latest_checkpointed_iteration.txt`), and its
resume rule (`trainer.resume_mode=auto` starts after the tracker's step; at the last step it
validates and exits 0 without training). Its experiment trackers (`trainer.logger`: mlflow, wandb,
tensorboard) are verl's own tracking layer (`verl.utils.tracking.Tracking`), as verl's trainer builds it,
so the settings the backend renders for them are read by verl's code. Its checkpoints hold the base model's weights as the policy,
as HF safetensors or, when the run loads a dist checkpoint, as one.

Test controls, from the job's environment (the profile's `env`):
  STAND_IN_STEP_S       seconds per step (default 0.05) ...
  STAND_IN_STEP_WORK_MB ... or, instead, this many MB hashed per step (CPU-bound steps, for bench/)
  STAND_IN_FAIL_AT_STEP fail when this step starts ...
  STAND_IN_FAIL_TEXT    ... printing this (e.g. an NCCL watchdog line) and exiting 1 ...
  STAND_IN_FAIL_TIMES   ... in this many attempts (default 1; counted in the checkpoint folder)
  STAND_IN_DROP_ROWS    training rows its data filter drops (verl counts fewer steps than whole batches
                        of the file when `data.filter_overlong_prompts` drops prompts)
  STAND_IN_ENV_PROBE    comma-separated variable names: a task pinned to each node records what it
                        sees of them in <checkpoint folder>/../stand-in-env.json
  STAND_IN_GATE         a file holding the last step it may start: it waits before any later step
                        until the file says more (a test holds a job mid-run on an event, not a time)
Every start writes its pid to <checkpoint folder>/../stand-in.pids.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from verl_config import compose_verl  # noqa: E402


def main(overrides: list[str]) -> int:
    try:
        config = compose_verl(overrides)
    except Exception as exc:  # what @hydra.main prints for a composition error before exiting 1
        print(exc, file=sys.stderr)
        if exc.__cause__ is not None:
            print(exc.__cause__, file=sys.stderr)
        print("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=sys.stderr)
        return 1
    trainer = config["trainer"]
    checkpoints = Path(trainer["default_local_dir"])
    run_dir = checkpoints.parent
    checkpoints.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stand-in.pids", "a") as pids:
        pids.write(f"{os.getpid()}\n")

    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if not ray.is_initialized():
        ray.init(runtime_env=get_ppo_ray_runtime_env(), log_to_driver=True)
    resource = "NPU" if "NPU" in ray.cluster_resources() else "GPU"
    available = int(ray.cluster_resources().get(resource, 0))
    desired = trainer["nnodes"] * trainer["n_gpus_per_node"]
    if available < desired:
        raise ValueError(f"Total available GPUs {available} is less than total desired GPUs {desired}.")
    megatron = config["actor_rollout_ref"]["actor"]["megatron"]
    if megatron["use_dist_checkpointing"] and not (Path(megatron["dist_checkpointing_path"]) / ".metadata").is_file():
        raise FileNotFoundError(f"no dist checkpoint at {megatron['dist_checkpointing_path']}")
    if probe := os.environ.get("STAND_IN_ENV_PROBE"):
        _probe_env_on_every_node(probe.split(","), run_dir / "stand-in-env.json")

    total = trainer["total_training_steps"] or _steps_per_epoch(config) * trainer["total_epochs"]
    step = 0
    if trainer["resume_mode"] == "auto" and (checkpoints / "latest_checkpointed_iteration.txt").is_file():
        step = int((checkpoints / "latest_checkpointed_iteration.txt").read_text())
        print(f"Resuming from {checkpoints}/global_step_{step}, setting global step to {step}", flush=True)
    else:
        print("Training from scratch", flush=True)
    logger = open(os.environ["VERL_FILE_LOGGER_PATH"], "wb", buffering=0) if "file" in trainer["logger"] else None
    tracking = _trackers(config)
    print(f"Total training steps: {total}", flush=True)
    if trainer["val_before_train"]:
        _log(logger, step, {"val-core/arith/reward/mean@1": 0.1}, tracking)
    step += 1
    while step <= total:
        _wait_at_gate(step)
        _maybe_fail(step, checkpoints)
        started = time.monotonic()
        if work_mb := int(os.environ.get("STAND_IN_STEP_WORK_MB", "0")):
            hashlib.sha256(bytes(work_mb << 20)).digest()
        else:
            time.sleep(float(os.environ.get("STAND_IN_STEP_S", "0.05")))
        metrics = _step_metrics(step, time.monotonic() - started, config)
        if trainer["save_freq"] > 0 and (step == total or step % trainer["save_freq"] == 0):
            _save(checkpoints, step, config)
        _log(logger, step, metrics, tracking)
        step += 1
    if tracking is not None:
        tracking.finish()
    return 0


def _trackers(config: dict):
    """verl's own tracking layer for the experiment trackers in `trainer.logger`, built as verl's trainer
    builds it (`Tracking(project_name, experiment_name, trainer.logger, config)`); the console and file
    loggers stay this stand-in's own (above)."""
    trainer = config["trainer"]
    tracked = [name for name in trainer["logger"] if name not in ("console", "file")]
    if not tracked:
        return None
    from verl.utils.tracking import Tracking

    return Tracking(project_name=trainer["project_name"], experiment_name=trainer["experiment_name"],
                    default_backend=tracked, config=config)


def _steps_per_epoch(config: dict) -> int:
    import pyarrow.parquet as pq

    files = config["data"]["train_files"]
    files = [files] if isinstance(files, str) else files
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in files) - int(os.environ.get("STAND_IN_DROP_ROWS", "0"))
    return rows // config["data"]["train_batch_size"]


def _step_metrics(step: int, seconds: float, config: dict) -> dict:
    """verl's key names (trainer/ppo/metric_utils.py), with a reward that rises."""
    reward = 1.0 - math.exp(-step / 4)
    metrics = {
        "training/global_step": step, "training/epoch": 0,
        "critic/score/mean": reward, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": reward, "critic/advantages/mean": 0.0,
        "response_length/mean": 12.0 + step, "response_length/max": 16.0, "response_length/clip_ratio": 0.0,
        "actor/pg_loss": -0.01 * step, "actor/entropy": 2.0 - 0.1 * step, "actor/ppo_kl": 0.001,
        "actor/grad_norm": 0.5, "actor/lr": config["actor_rollout_ref"]["actor"]["optim"]["lr"],
        "timing_s/gen": seconds / 2, "timing_s/update_actor": seconds / 3, "timing_s/step": seconds,
        "perf/time_per_step": seconds, "perf/throughput": 100.0,
    }
    if config["actor_rollout_ref"]["actor"]["use_kl_loss"]:
        metrics["actor/kl_loss"] = 0.002 * step
    return metrics


def _log(logger, step: int, data: dict, tracking=None) -> None:
    """verl's console line (aggregate_logger.concat_dict_to_str), its file-logger record, and its trackers."""
    print(" - ".join([f"step:{step}", *(f"{k}:{v!r}" for k, v in data.items())]), flush=True)
    if logger is not None:
        logger.write(json.dumps({"step": step, "data": data}).encode() + b"\n")
    if tracking is not None:
        tracking.log(data=data, step=step)


def _save(checkpoints: Path, step: int, config: dict) -> None:
    """verl's Megatron layout v2 (the policy unchanged: the stand-in does not train). The HF config and
    tokenizer always go to model/huggingface; the weights as HF safetensors there, or, when the run
    loaded a dist checkpoint (`use_dist_checkpointing`), as a dist checkpoint in model/dist_ckpt."""
    import shutil

    model = config["actor_rollout_ref"]["model"]["path"]
    megatron = config["actor_rollout_ref"]["actor"]["megatron"]
    actor = checkpoints / f"global_step_{step}" / "actor"
    exported = actor / "model" / "huggingface"
    exported.mkdir(parents=True, exist_ok=True)
    for item in Path(model).iterdir():
        weights = item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json"
        if item.is_file() and item.name != "manifest.json" and not (weights and megatron["use_dist_checkpointing"]):
            shutil.copy2(item, exported / item.name)
    if megatron["use_dist_checkpointing"]:
        shutil.copytree(megatron["dist_checkpointing_path"], actor / "model" / "dist_ckpt",
                        ignore=shutil.ignore_patterns("manifest.json"))
    (actor / "ckpt_contents.json").write_text(json.dumps({"step": step}))
    (checkpoints / f"global_step_{step}" / "data.pt").write_bytes(b"stand-in dataloader state")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(str(step))


def _wait_at_gate(step: int) -> None:
    gate = os.environ.get("STAND_IN_GATE")
    while gate:
        try:
            if int(Path(gate).read_text()) >= step:
                return
        except (OSError, ValueError):  # not written yet, or being written
            pass
        time.sleep(0.1)


def _maybe_fail(step: int, checkpoints: Path) -> None:
    if str(step) != os.environ.get("STAND_IN_FAIL_AT_STEP"):
        return
    counter = checkpoints / ".stand-in-failures"
    failed = int(counter.read_text()) if counter.is_file() else 0
    if failed >= int(os.environ.get("STAND_IN_FAIL_TIMES", "1")):
        return
    counter.write_text(str(failed + 1))
    print(os.environ.get("STAND_IN_FAIL_TEXT", "RuntimeError: stand-in failure"), file=sys.stderr, flush=True)
    sys.exit(1)


def _probe_env_on_every_node(names: list[str], out: Path) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def look() -> dict:
        return {name: os.environ.get(name) for name in names}

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    seen = ray.get([look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                    for node in nodes])
    out.write_text(json.dumps(dict(zip(nodes, seen))))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
