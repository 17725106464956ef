"""A stand-in for `python3 -m verl.trainer.main_ppo` that behaves like verl 0.9.1 at the process
boundary, for testing the verl backend's Ray-job path on a CPU-only Ray cluster (verl itself needs
GPUs/NPUs and vLLM). Selected with `--set "trainer.entrypoint=<python> tests/verl_stand_in.py"`.
docs/verl-stand-in.md lists each behaviour beside verl 0.9.1's source (file:line).

What it shares with verl, not imitates: the overrides are composed by Hydra's own `@hydra.main` over
verl's `ppo_trainer` config (a bad key fails as main_ppo fails; any exception main raises is printed
by Hydra after "Error executing job with overrides" and exits 1), Ray is joined as main_ppo joins it
(`ray.init(**ray_kwargs.ray_init)` with verl's `get_ppo_ray_runtime_env(config)` merged in, and Ray
merging the job's runtime_env), and the file logger writes with orjson as verl's does. What it
imitates, from verl's source: validate_config's batch check, the device check, the step loop of the
v1 trainer (validation at the resumed step, steps up to total_training_steps or the last epoch, a
save at save_freq and at the last step, validation at test_freq merged into the step's record), its
console and log lines, the checkpoint layout of the FSDP engine and the Megatron engine (layout v2)
with `latest_checkpointed_iteration.txt` written after the step's folder, and the resume rules
(auto: after the tracker's step, also at the last step, where it validates and exits 0). Its
checkpoints hold the base model's weights as the policy (it does not train). Like main_ppo it runs the
trainer in a `TaskRunnerV1` Ray actor (its lines come prefixed through Ray). Where it still differs
from verl is listed in docs/verl-stand-in.md.

Test controls, from the job's environment (the profile's `env`):
  STAND_IN_STEP_S       seconds per step (default 0.05) ...
  STAND_IN_STEP_WORK_MB ... or, instead, this many MB hashed per step (CPU-bound steps, for bench/)
  STAND_IN_FAIL_AT_STEP fail when this step starts ...
  STAND_IN_FAIL_TEXT    ... printing this (e.g. an NCCL watchdog line) and raising (Hydra exits 1) ...
  STAND_IN_FAIL_TIMES   ... in this many attempts (default 1; counted in the checkpoint folder)
  STAND_IN_DROP_ROWS    training rows its data filter drops (verl counts fewer steps than whole batches
                        of the file when `data.filter_overlong_prompts` drops prompts)
  STAND_IN_ENV_PROBE    comma-separated variable names: a task pinned to each node records what it
                        sees of them in <checkpoint folder>/../stand-in-env.json
  STAND_IN_GATE         a file holding the last step it may start: it waits before any later step
                        until the file says more (a test holds a job mid-run on an event, not a time)
Faults the guards must catch (backends/guards.py), each as verl would show it:
  STAND_IN_STALE_ROLLOUT_FROM_STEP  from this step on, `rollout_corr/k3_kl` grows as it does when the
                        rollout engine keeps generating with older weights (a weight sync that failed)
  STAND_IN_NAN_AT_STEP  this step's loss and gradient norm are NaN (written null, as orjson writes NaN),
                        after the step's checkpoint was saved (verl saves a step before logging it)
  STAND_IN_CONSTANT_REWARD  every response scores this: every group constant, every advantage 0
  STAND_IN_EPOCH_BOUNDARY_BUG  a resume from a step at an epoch boundary trains nothing and exits 0: the
                        restored dataloader is exhausted (verl #7401: its SFT trainer; the PPO trainer
                        before #5725)
  STAND_IN_NO_DATALOADER_STATE  checkpoints without data.pt (a resume then warns, as verl does, and
                        starts the data over)
Every start writes its pid and its TaskRunnerV1 actor's to <checkpoint folder>/../stand-in.pids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from pprint import pprint

import hydra
import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from verl_config import verl_config_dir  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
# verl's TaskRunnerV1 logs through the "verl" logger (utils/logging_utils.py configure_verl_logging).
log = logging.getLogger("verl.trainer.ppo.v1.trainer_base")


def _configure_verl_logging() -> None:
    handler = logging.StreamHandler(stream=sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(asctime)s:%(message)s"))
    verl = logging.getLogger("verl")
    verl.handlers, verl.propagate = [handler], False
    verl.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


@hydra.main(config_path=str(verl_config_dir()), config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    _validate_config(config)
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if not ray.is_initialized():  # main_ppo.run_ppo
        ray_init = config.ray_kwargs.get("ray_init", {})
        runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.get("runtime_env", {}))
        ray_init = OmegaConf.create({**ray_init, "runtime_env": runtime_env})
        print(f"ray init kwargs: {ray_init}")
        ray.init(**OmegaConf.to_container(ray_init))
    container = OmegaConf.to_container(config, resolve=True)
    _record_pid(container)
    # main_ppo.run_ppo: the trainer runs in a TaskRunnerV1 actor; its lines reach the job's log through
    # Ray, prefixed "(TaskRunnerV1 pid=N)", and its failure comes back as a RayTaskError.
    runner = ray.remote(TaskRunnerV1).remote()
    ray.get(runner.run.remote(container))


class TaskRunnerV1:
    def run(self, config: dict) -> None:
        run(config)


def _record_pid(config: dict) -> None:
    run_dir = Path(config["trainer"]["default_local_dir"]).parent
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stand-in.pids", "a") as pids:
        pids.write(f"{os.getpid()}\n")


def _validate_config(config) -> None:
    """verl.utils.config.validate_config's first check (main_ppo runs it before joining Ray)."""
    trainer, actor = config.trainer, config.actor_rollout_ref.actor
    n_gpus = trainer.n_gpus_per_node * trainer.nnodes
    if actor.use_dynamic_bsz:
        return
    minimal_bsz = n_gpus
    if actor.strategy == "megatron":
        model_parallel_size = actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size
        assert n_gpus % (model_parallel_size * actor.megatron.context_parallel_size) == 0, (
            f"n_gpus ({n_gpus}) must be divisible by model_parallel_size ({model_parallel_size}) times "
            f"context_parallel_size ({actor.megatron.context_parallel_size})")
        minimal_bsz = n_gpus // (model_parallel_size * actor.megatron.context_parallel_size) * actor.ppo_micro_batch_size_per_gpu
    real_train_batch_size = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    assert real_train_batch_size % minimal_bsz == 0, (
        f"real_train_batch_size ({real_train_batch_size}) must be divisible by minimal possible batch size ({minimal_bsz})")


def run(config: dict) -> None:
    """TaskRunnerV1.run (in the actor): the trainer's init (data, devices, checkpoint) and fit."""
    _configure_verl_logging()
    _print_harmless_import_failures()
    pprint(config)
    trainer = config["trainer"]
    checkpoints = Path(trainer["default_local_dir"])
    run_dir = checkpoints.parent
    checkpoints.mkdir(parents=True, exist_ok=True)
    _record_pid(config)
    per_epoch = _rows(config["data"]["train_files"]) // config["data"]["train_batch_size"]
    total = trainer["total_training_steps"] or per_epoch * trainer["total_epochs"]
    log.info(f"Total training steps: {total}")
    _check_devices(trainer["nnodes"] * trainer["n_gpus_per_node"])
    actor = config["actor_rollout_ref"]["actor"]
    megatron = actor.get("megatron") or {}
    if megatron.get("use_dist_checkpointing") and not (Path(megatron["dist_checkpointing_path"]) / ".metadata").is_file():
        raise FileNotFoundError(f"no dist checkpoint at {megatron['dist_checkpointing_path']}")
    if probe := os.environ.get("STAND_IN_ENV_PROBE"):
        _probe_env_on_every_node(probe.split(","), run_dir / "stand-in-env.json")
    step = _load_checkpoint(trainer, checkpoints)
    fit(config, checkpoints, step, total, per_epoch)


def _rows(files) -> int:
    import pyarrow.parquet as pq

    files = [files] if isinstance(files, str) else files
    return sum(pq.ParquetFile(path).metadata.num_rows for path in files) - int(os.environ.get("STAND_IN_DROP_ROWS", "0"))


def _check_devices(desired: int) -> None:
    """single_controller/ray/base.py _check_resource_available: GPUs, else NPUs, available per node."""
    import ray

    available = sum(node.get("GPU", 0) if "GPU" in node else node.get("NPU", 0)
                    for node in ray._private.state.available_resources_per_node().values())
    if available < desired:
        raise ValueError(f"Total available GPUs {available} is less than total desired GPUs {desired}")


def _load_checkpoint(trainer: dict, checkpoints: Path) -> int:
    """v1 trainer_base._load_checkpoint and checkpoint_manager.find_latest_ckpt_path, their prints included."""
    mode = trainer["resume_mode"]
    if mode == "disable":
        return 0
    if mode == "auto":
        tracker = checkpoints / TRACKER
        if not tracker.exists():
            print(f"Checkpoint tracker file does not exist: {tracker}")
            log.info("Training from scratch")
            return 0
        folder = checkpoints / f"global_step_{int(tracker.read_bytes().decode())}"
        if not folder.exists():
            print("Checkpoint does not exist: %s", folder)
            log.info("Training from scratch")
            return 0
        print("Found checkpoint: %s", folder)
    elif mode == "resume_path":
        assert isinstance(trainer["resume_from_path"], str), "resume ckpt must be str type"
        assert "global_step_" in trainer["resume_from_path"], "resume ckpt must specify the global_steps"
        folder = trainer["resume_from_path"]
    else:
        log.exception(f"Unknown resume mode {mode}")
        raise UnboundLocalError("cannot access local variable 'global_step_folder' where it is not associated with a value")
    step = int(str(folder).split("global_step_")[-1])
    log.info(f"Resuming from {folder}, setting global step to {step}")
    if not (Path(folder) / "data.pt").exists():  # its step 4: the dataloader's state, else only a warning
        log.warning(f"Warning: No dataloader state found at {Path(folder) / 'data.pt'}, will start from scratch")
    return step


class _Tracking:
    """utils/tracking.py Tracking: the `console` (LocalLogger) and `file` (FileLogger) backends imitated;
    the experiment trackers (mlflow, wandb, tensorboard) are verl's own tracking layer, built as verl's
    trainer builds it, so the settings the backend renders for them are read by verl's code."""

    def __init__(self, backends: list[str], config: dict):
        self.console, self.file, self.trackers = "console" in backends, None, None
        if "file" in backends:
            path = os.environ["VERL_FILE_LOGGER_PATH"]
            print(f"Creating file logger at {os.path.abspath(path)}")
            self.file = open(path, "wb", buffering=0)
        if tracked := [name for name in backends if name not in ("console", "file")]:
            from verl.utils.tracking import Tracking

            trainer = config["trainer"]
            self.trackers = Tracking(project_name=trainer["project_name"], experiment_name=trainer["experiment_name"],
                                     default_backend=tracked, config=config)

    def log(self, data: dict, step: int) -> None:
        import numbers
        import pprint as pretty

        import orjson

        if self.console:  # aggregate_logger.concat_dict_to_str: numbers only, pformat (np.float64(...))
            print(" - ".join([f"step:{step}", *(f"{k}:{pretty.pformat(v)}" for k, v in data.items()
                                                 if isinstance(v, numbers.Number))]), flush=True)
        if self.file is not None:
            self.file.write(orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        if self.trackers is not None:
            self.trackers.log(data=data, step=step)

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.trackers is not None:
            self.trackers.finish()


def fit(config: dict, checkpoints: Path, step: int, total: int, per_epoch: int) -> None:
    """v1 trainer_base.fit: validation at the step it starts from, then steps from the next one while
    the epochs last and up to total_training_steps; the last step is the one that reaches the total."""
    trainer = config["trainer"]
    tracking = _Tracking(trainer["logger"] if isinstance(trainer["logger"], list) else [trainer["logger"]], config)
    try:
        if trainer["val_before_train"]:
            metrics = _validate(config, step)
            pprint(f"Initial validation metrics: {metrics}")
            tracking.log(metrics, step)
        if os.environ.get("STAND_IN_EPOCH_BOUNDARY_BUG") and step and step % per_epoch == 0:
            return  # the restored dataloader state is the finished epoch's: no batch, the loop ends, exit 0
        epoch, step, last_validation = step // per_epoch, step + 1, None
        while epoch < trainer["total_epochs"] and step <= total:
            is_last_step = step >= total
            _wait_at_gate(step)
            _maybe_fail(step, checkpoints)
            started = time.monotonic()
            if work_mb := int(os.environ.get("STAND_IN_STEP_WORK_MB", "0")):
                hashlib.sha256(bytes(work_mb << 20)).digest()
            else:
                time.sleep(float(os.environ.get("STAND_IN_STEP_S", "0.05")))
            if trainer["save_freq"] > 0 and (is_last_step or step % trainer["save_freq"] == 0):
                _save(checkpoints, step, config)
            metrics = {}
            if trainer["test_freq"] > 0 and (is_last_step or step % trainer["test_freq"] == 0):
                metrics.update(validation := _validate(config, step))
                last_validation = validation if is_last_step else last_validation
            metrics.update(_step_metrics(step, epoch, time.monotonic() - started, config))
            tracking.log(metrics, step)
            step += 1
            epoch = (step - 1) // per_epoch
            if is_last_step:
                pprint(f"Final validation metrics: {last_validation}")
                return
    finally:
        tracking.finish()


def _validate(config: dict, step: int) -> dict:
    """trainer_base._val_metrics_update: `val-core/<data_source>/reward/mean@<n>` for each data source."""
    import pyarrow.parquet as pq

    files = config["data"]["val_files"]
    sources = sorted({source for path in ([files] if isinstance(files, str) else files)
                      for source in pq.read_table(path, columns=["data_source"]).column(0).to_pylist()})
    n = config["actor_rollout_ref"]["rollout"]["val_kwargs"]["n"]
    return {f"val-core/{source}/reward/mean@{n}": 0.1 + 0.01 * step for source in sources}


def _custom_scores(config: dict, step: int) -> list[float] | None:
    """With `reward.custom_reward_function.path` set, the step's rewards as verl computes them: the function
    loaded by verl's own `get_custom_reward_fn` (trainer/ppo/reward.py, reward_kwargs merged), called as
    `NaiveRewardManager.run_single` calls it (experimental/reward_loop/reward_manager/naive.py: keyword
    arguments, awaited when async, all of a worker's samples gathered on one loop; a dict's `score` is the
    reward). The stand-in generates nothing: of each prompt's `rollout.n` responses, the even ones state the
    ground truth (`\\boxed{...}`) and the odd ones do not."""
    import asyncio

    import pyarrow.parquet as pq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    if not config["reward"]["custom_reward_function"]["path"]:
        return None
    compute_score = get_custom_reward_fn(OmegaConf.create(config))
    files = config["data"]["train_files"]
    rows = [row for path in ([files] if isinstance(files, str) else files)
            for row in pq.read_table(path, columns=["data_source", "reward_model", "extra_info"]).to_pylist()]
    size, n = config["data"]["train_batch_size"], config["actor_rollout_ref"]["rollout"]["n"]
    start = ((step - 1) * size) % max(1, len(rows) - size + 1)
    # More responses state the truth as training goes (step 1: the even ones), so the reward rises as a run's would.
    samples = [(row, f"The answer is \\boxed{{{row['reward_model']['ground_truth']}}}." if j % 2 == 0 or j < step - 1
                else "I am not sure.")
               for row in rows[start:start + size] for j in range(n)]

    async def score_all():
        async def one(row, text):
            kwargs = dict(data_source=row["data_source"], solution_str=text,
                          ground_truth=row["reward_model"]["ground_truth"], extra_info=dict(row["extra_info"] or {}))
            result = compute_score(**kwargs)
            result = await result if asyncio.iscoroutine(result) else result
            return result["score"] if isinstance(result, dict) else result
        return await asyncio.gather(*(one(row, text) for row, text in samples))

    return [float(score) for score in asyncio.run(score_all())]


def _step_metrics(step: int, epoch: int, seconds: float, config: dict) -> dict:
    """verl's key names and types (trainer/ppo/metric_utils.py, reduced to np.float64), a reward that rises (or,
    with a custom reward, the reward verl's own loader gives: `_custom_scores`)."""
    scores = _custom_scores(config, step)
    reward = np.float64(np.mean(scores) if scores else 1.0 - math.exp(-step / 4))
    constant = os.environ.get("STAND_IN_CONSTANT_REWARD")
    nan = str(step) == os.environ.get("STAND_IN_NAN_AT_STEP")
    stale_from = int(os.environ.get("STAND_IN_STALE_ROLLOUT_FROM_STEP", "0"))
    # rollout_corr_helper.compute_offpolicy_metrics: vLLM's and the trainer's log-probs of the same tokens.
    k3_kl = np.float64(0.15 * (step - stale_from + 1)) if stale_from and step >= stale_from else np.float64(0.0004)
    metrics = {
        "actor/pg_loss": np.float64("nan" if nan else -0.01 * step), "actor/entropy": np.float64(2.0 - 0.1 * step),
        "actor/ppo_kl": np.float64(0.001), "actor/grad_norm": np.float64("nan" if nan else 0.5),
        "actor/lr": config["actor_rollout_ref"]["actor"]["optim"]["lr"],
        "training/global_step": step, "training/epoch": epoch,
        "critic/score/mean": reward, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": reward, "critic/advantages/mean": np.float64(0.0),
        "critic/advantages/max": np.float64(1.2), "critic/advantages/min": np.float64(-1.1),
        "rollout_corr/k3_kl": k3_kl, "rollout_corr/kl": k3_kl, "rollout_corr/training_log_ppl": np.float64(1.3),
        "rollout_corr/rollout_log_ppl": np.float64(1.3), "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_mean": np.float64(0.002),
        "response_length/mean": 12.0 + step, "response_length/max": 16.0, "response_length/clip_ratio": 0.0,
        "timing_s/gen": seconds / 2, "timing_s/update_actor": seconds / 3, "timing_s/step": seconds,
        "perf/time_per_step": seconds, "perf/throughput": np.float64(100.0),
        "training/num_turns/mean": np.float64(1.0),
    }
    if constant is not None:
        metrics.update({key: np.float64(constant) for key in ("critic/score/mean", "critic/score/max", "critic/score/min",
                                                               "critic/rewards/mean")})
        metrics.update({f"critic/advantages/{end}": np.float64(0.0) for end in ("mean", "max", "min")})
    if config["actor_rollout_ref"]["actor"]["use_kl_loss"]:
        metrics["actor/kl_loss"] = np.float64(0.002 * step)
    return metrics


def _save(checkpoints: Path, step: int, config: dict) -> None:
    """trainer_base._save_checkpoint: the actor's folder as its engine writes it, data.pt, then the
    tracker file (the policy unchanged: the stand-in does not train)."""
    actor_config = config["actor_rollout_ref"]["actor"]
    contents = actor_config["checkpoint"]["save_contents"]
    log.info(f"Saving checkpoint to {checkpoints / f'global_step_{step}'}")  # seen on the H200 (2026-12-06)
    actor = checkpoints / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    if actor_config["strategy"] == "megatron":
        _save_megatron(actor, contents, config)
    else:
        _save_fsdp(actor, contents, config)
    if not os.environ.get("STAND_IN_NO_DATALOADER_STATE"):
        (checkpoints / f"global_step_{step}" / "data.pt").write_bytes(b"stand-in dataloader state")
    (checkpoints / TRACKER).write_text(str(step))


def _copy_model(into: Path, model: str, weights: bool) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for item in Path(model).iterdir():
        is_weights = item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json"
        if item.is_file() and item.name != "manifest.json" and (weights or not is_weights):
            shutil.copy2(item, into / item.name)


def _save_fsdp(actor: Path, contents: list[str], config: dict) -> None:
    """utils/checkpoint/fsdp_checkpoint_manager.py save_checkpoint: per-rank shard files, the HF config
    and tokenizer in huggingface/ (with the HF weights only for 'hf_model'), fsdp_config.json."""
    world = config["trainer"]["nnodes"] * config["trainer"]["n_gpus_per_node"]
    for rank in range(world):
        for part, wanted in (("model", "model"), ("optim", "optimizer"), ("extra_state", "extra")):
            if wanted in contents:
                (actor / f"{part}_world_size_{world}_rank_{rank}.pt").write_bytes(b"stand-in shard")
    _copy_model(actor / "huggingface", config["actor_rollout_ref"]["model"]["path"], "hf_model" in contents)
    version = 2 if config["actor_rollout_ref"]["actor"]["strategy"] == "fsdp2" else 1
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": version, "world_size": world}, indent=4))


def _save_megatron(actor: Path, contents: list[str], config: dict) -> None:
    """utils/checkpoint/megatron_checkpoint_manager.py save_checkpoint (layout v2): model/huggingface
    (config, tokenizer, the bridge's HF weights) only when it saves HF weights, model/dist_ckpt with
    use_dist_checkpointing, optimizer/ and extra/ shards, ckpt_contents.json last."""
    megatron = config["actor_rollout_ref"]["actor"]["megatron"]
    dist = megatron["use_dist_checkpointing"]
    if "hf_model" in contents or ("model" in contents and not dist):
        _copy_model(actor / "model" / "huggingface", config["actor_rollout_ref"]["model"]["path"], True)
    if "model" in contents and dist:
        shutil.copytree(megatron["dist_checkpointing_path"], actor / "model" / "dist_ckpt",
                        ignore=shutil.ignore_patterns("manifest.json"), dirs_exist_ok=True)
    for part, wanted in (("optimizer", "optimizer"), ("extra", "extra")):
        if wanted in contents:
            (actor / part / "dist_ckpt").mkdir(parents=True, exist_ok=True)
    if "extra" in contents:
        (actor / "transformer_config.json").write_text("{}")
    (actor / "ckpt_contents.json").write_text(json.dumps({"layout_version": 2, "contents": contents}))


def _wait_at_gate(step: int) -> None:
    gate = os.environ.get("STAND_IN_GATE")
    while gate:
        try:
            if int(Path(gate).read_text()) >= step:
                return
        except (OSError, ValueError):  # not written yet, or being written
            pass
        time.sleep(0.1)


def _print_harmless_import_failures() -> None:
    """What every real verl + vLLM start prints before it trains (the H200 run's log, verl 0.9.1, vLLM
    0.24): import failures that end nothing. A parser that reads them as the job's failure is wrong."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"WARNING {stamp} [_custom_ops.py:21] Failed to import from vllm._C with "
          "ModuleNotFoundError(\"No module named 'vllm._C'\")", file=sys.stderr, flush=True)
    print("Failed to import megatron: No module named 'megatron'", flush=True)


def _maybe_fail(step: int, checkpoints: Path) -> None:
    """A worker's failure as verl meets it: the worker's line in the log, then an exception that ends
    the actor's run and main (Hydra prints it and exits 1)."""
    if str(step) != os.environ.get("STAND_IN_FAIL_AT_STEP"):
        return
    counter = checkpoints / ".stand-in-failures"
    failed = int(counter.read_text()) if counter.is_file() else 0
    if failed >= int(os.environ.get("STAND_IN_FAIL_TIMES", "1")):
        return
    counter.write_text(str(failed + 1))
    text = os.environ.get("STAND_IN_FAIL_TEXT", "RuntimeError: stand-in failure")
    print(text, file=sys.stderr, flush=True)
    # The worker's error travels in the exception too (the RayTaskError's traceback, printed by Hydra):
    # a line the actor printed just before may not reach the job's log before the driver exits.
    raise RuntimeError(text.removeprefix("RuntimeError: "))


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
    # Hydra's own run folder (outputs/<date>/<time>/ under the job's working directory in verl) goes to
    # the temp dir, so a job run from a checkout leaves nothing in it.
    sys.argv.append(f"hydra.run.dir={tempfile.gettempdir()}/verl-stand-in-hydra/${{now:%Y-%m-%d_%H-%M-%S-%f}}")
    main()
