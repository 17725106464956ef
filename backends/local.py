"""The `local` training backend: GRPO with TRL's GRPOTrainer on Ray Train workers, any device.

    python -m flows.grpo --model tiny --device cpu --set cluster.devices_per_node=2
    python -m flows.grpo --model smollm2-135m --device gpu

Ray Train starts N workers (devices on gpu / npu, processes on cpu) and the process group (nccl,
hccl or gloo, from the device profile); in each, TRL's GRPOTrainer trains the prepared model on the
prepared parquet files, data-parallel (accelerate reuses Ray's process group and wraps the model in
DDP). The worker never calls Prefect: it writes `metrics.jsonl` and checkpoints under the run
directory, and the driver (the flow's train task) follows them.

Checkpoints: every `trainer.save_freq` steps, `checkpoints/global_step_N/` (HF policy + tokenizer +
optimizer, scheduler, RNG and trainer state), then `checkpoints/latest` (atomically, last). A retry
resumes from `latest`; nothing a previous attempt wrote is deleted.

The verl <-> TRL mapping of the one `algorithm` section (also in docs/local-backend.md):

| profile (verl key)                          | GRPOConfig                                   |
|---------------------------------------------|----------------------------------------------|
| algorithm.rollout_n (rollout.n)             | num_generations                              |
| algorithm.use_kl_loss, kl_loss_coef         | beta = kl_loss_coef if use_kl_loss else 0    |
| algorithm.clip_ratio_low / _high            | epsilon / epsilon_high                       |
| algorithm.lr (actor.optim.lr)               | learning_rate, lr_scheduler_type="constant"  |
| algorithm.entropy_coeff                     | entropy_coef                                 |
| algorithm.loss_agg_mode                     | loss_type (token-mean -> dapo, ...)          |
| algorithm.temperature                       | temperature                                  |
| data.max_response_length                    | max_completion_length                        |
| data.max_prompt_length                      | prompts longer are filtered or refused here  |
| data.train_batch_size x rollout_n           | generation_batch_size                        |
| actor.ppo_mini_batch_size x rollout_n       | completions per optimizer step (grad. accum.) |
| actor.ppo_micro_batch_size_per_gpu          | per_device_train_batch_size (+ grad. accum.) |
| trainer.total_training_steps, save_freq     | max_steps, save_steps (x steps_per_generation)|
| model.enable_gradient_checkpointing         | gradient_checkpointing (TRL's default: on)   |

TRL's own defaults differ (loss_type="dapo" happens to match token-mean, beta=0, a linearly decaying
learning rate, num_generations=8, max_completion_length=512): every value above is set explicitly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from profiles.errors import ProfileError, UserError
from profiles.schema import RunProfile
from profiles.validation import check_workers_fit
from common.files import write_text_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
METRICS = "metrics.jsonl"
# verl's loss_agg_mode -> TRL's loss_type: how per-token losses become one number.
LOSS_TYPES = {
    "token-mean": "dapo",  # mean over every active token of the batch
    "seq-mean-token-mean": "grpo",  # mean per sequence, then over sequences
    "seq-mean-token-sum-norm": "dr_grpo",  # sum per sequence / a constant (max length)
}
POLL_S = 1.0


class TrainingInterrupted(Exception):
    """The workers stopped before the last step (a worker died, a collective timed out, a node was
    lost): transient, the task retries and resumes from the latest checkpoint."""


class LocalTrainSettings(BaseModel):
    """Everything a worker needs; plain data, shipped to every Ray Train worker."""

    model_path: str
    train_files: list[str]
    run_dir: str
    device: str = Field(..., description="cpu, gpu or npu.")
    workers: int = Field(..., gt=0)
    cpus_per_worker: int = Field(1, gt=0, description="On cpu: cores for each worker (its torch threads).")
    comm_backend: str
    ray_resource: str | None
    dtype: str = Field(..., description="Training dtype on this device: float32 on cpu, the profile's otherwise.")
    max_steps: int = Field(..., gt=0, description="Optimizer steps in all.")
    step_timeout_s: float = Field(3600, gt=0, description="No new step for this long is taken for a hang.")
    save_steps: int = Field(..., description="Checkpoint every this many optimizer steps (<= 0: only at the end).")
    seed: int
    max_prompt_length: int
    filter_overlong_prompts: bool
    reward_function: str | None = None
    grpo: dict[str, Any] = Field(..., description="GRPOConfig fields derived from the profile.")

    @property
    def checkpoints(self) -> Path:
        return Path(self.run_dir) / CHECKPOINTS

    @property
    def metrics_file(self) -> Path:
        return Path(self.run_dir) / METRICS


class TrainResult(BaseModel):
    backend: str
    checkpoint_dir: str = Field(..., description="The latest checkpoint: global_step_N with the HF policy.")
    steps_done: int
    max_steps: int
    metrics_file: str
    resumed_from: int | None = Field(None, description="Step this attempt resumed from, if any.")
    already_complete: bool = Field(False, description="The run had finished before this attempt; nothing was trained.")


def latest_step(checkpoints: Path) -> int | None:
    """The step of the last complete checkpoint (the `latest` marker is written after it)."""
    try:
        step = int((checkpoints / LATEST).read_text().strip())
    except (OSError, ValueError):
        return None
    return step if (checkpoints / f"global_step_{step}").is_dir() else None


def grpo_fields(profile: RunProfile, workers: int) -> tuple[dict[str, Any], int]:
    """GRPOConfig fields for the profile, and how many optimizer steps make one verl step."""
    algo, data, actor = profile.algorithm, profile.data, profile.actor
    if algo.use_kl_in_reward:
        raise ProfileError("algorithm.use_kl_in_reward=true: the local backend (TRL) has no in-reward KL; use algorithm.use_kl_loss")
    if algo.loss_agg_mode not in LOSS_TYPES:
        raise ProfileError(
            f"algorithm.loss_agg_mode={algo.loss_agg_mode}: the local backend supports {', '.join(LOSS_TYPES)}"
        )
    n = algo.rollout_n
    per_update = actor.ppo_mini_batch_size * n  # completions per optimizer step
    micro = actor.ppo_micro_batch_size_per_gpu
    if per_update % (micro * workers):
        raise ProfileError(
            f"actor.ppo_mini_batch_size x algorithm.rollout_n = {per_update} completions per update is not a multiple of "
            f"actor.ppo_micro_batch_size_per_gpu x workers = {micro} x {workers}; pick sizes that divide"
        )
    updates_per_step = data.train_batch_size // actor.ppo_mini_batch_size
    fields = {
        "num_generations": n,
        "beta": algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        "epsilon": algo.clip_ratio_low,
        "epsilon_high": algo.clip_ratio_high,
        "learning_rate": algo.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "entropy_coef": algo.entropy_coeff,
        "loss_type": LOSS_TYPES[algo.loss_agg_mode],
        "scale_rewards": "group",
        "temperature": algo.temperature,
        "max_completion_length": data.max_response_length,
        # Global completions per generation round; TRL splits them into micro batches and takes
        # train_batch_size / ppo_mini_batch_size optimizer steps on them, as verl does.
        "generation_batch_size": data.train_batch_size * n,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": per_update // (micro * workers),
        "gradient_checkpointing": profile.model.enable_gradient_checkpointing,
    }
    return fields, updates_per_step


# --- the worker: runs in each Ray Train worker process ----------------------------------------


def worker_loop(config: dict[str, Any]) -> None:
    """One data-parallel rank: TRL's GRPOTrainer, resuming from the latest checkpoint if any."""
    import datasets
    import ray.train
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig, GRPOTrainer

    settings = LocalTrainSettings.model_validate(config)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    if settings.device == "cpu":
        # Ray gives each worker its share of the cores; more threads than that only contend.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    set_seed(settings.seed)
    resume = latest_step(settings.checkpoints)
    if rank == 0:
        _keep_metrics_up_to(settings.metrics_file, resume or 0)

    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=getattr(torch, settings.dtype))
    train = training_rows(settings, tokenizer, datasets)
    args = GRPOConfig(
        output_dir=str(settings.checkpoints / ".trainer"),
        max_steps=settings.max_steps,
        save_strategy="steps" if settings.save_steps > 0 else "no",
        save_steps=max(settings.save_steps, 1),
        logging_steps=1,
        report_to=[],
        seed=settings.seed,
        use_cpu=settings.device == "cpu",
        bf16=settings.dtype == "bfloat16",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **settings.grpo,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward_function(settings.reward_function),
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[_MetricsWriter(settings, rank, resume), _CheckpointPublisher(settings, rank)],
    )
    checkpoint = settings.checkpoints / f"global_step_{resume}" if resume is not None else None
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)


def training_rows(settings: LocalTrainSettings, tokenizer, datasets_module):
    """The train split as TRL reads it: `prompt` (chat messages) plus what the reward needs, without
    the prompts longer than data.max_prompt_length when data.filter_overlong_prompts is set (the
    driver refused the run already if some are too long and filtering is off)."""
    rows = datasets_module.load_dataset("parquet", data_files=settings.train_files, split="train")
    rows = rows.map(
        lambda row: {"ground_truth": row["reward_model"]["ground_truth"]},
        remove_columns=[c for c in rows.column_names if c not in ("prompt", "data_source", "reward_model")],
    ).remove_columns(["reward_model"])
    if settings.filter_overlong_prompts:
        rows = rows.filter(lambda row: prompt_length(tokenizer, row["prompt"]) <= settings.max_prompt_length)
    return rows


def prompt_length(tokenizer, messages: list[dict]) -> int:
    """Tokens of the prompt as the model sees it: chat template applied, generation prompt added."""
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def check_prompt_lengths(settings: LocalTrainSettings) -> int:
    """How many training prompts exceed data.max_prompt_length; an error when they would be
    truncated silently (filtering off)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    prompts = [m for f in settings.train_files for m in pq.read_table(f, columns=["prompt"]).column("prompt").to_pylist()]
    longest, overlong = 0, 0
    for messages in prompts:
        length = prompt_length(tokenizer, messages)
        longest = max(longest, length)
        overlong += length > settings.max_prompt_length
    if overlong and not settings.filter_overlong_prompts:
        raise ProfileError(
            f"data.max_prompt_length={settings.max_prompt_length}: {overlong} of {len(prompts)} training prompts are "
            f"longer (up to {longest} tokens); raise it or set data.filter_overlong_prompts=true"
        )
    return overlong


def _reward_function(custom: str | None) -> Callable:
    from common.rewards import score

    def reward(prompts, completions, data_source, ground_truth, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(source, text, truth, custom).reward for source, text, truth in zip(data_source, texts, ground_truth)]

    reward.__name__ = "reward"
    return reward


def _keep_metrics_up_to(metrics_file: Path, step: int) -> None:
    """Steps after the checkpoint an attempt starts from are trained again: drop their old lines."""
    if not metrics_file.is_file():
        return
    kept = [line for line in metrics_file.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_text_atomic(metrics_file, "".join(f"{line}\n" for line in kept))


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _MetricsWriter(_trainer_callback_base()):
    """Rank 0 appends one JSON line per optimizer step; the driver follows the file."""

    def __init__(self, settings: LocalTrainSettings, rank: int, resumed_from: int | None):
        self.settings, self.rank, self.resumed_from = settings, rank, resumed_from
        self.step_started = time.perf_counter()
        grpo = settings.grpo
        self.completions_per_step = grpo["per_device_train_batch_size"] * settings.workers * grpo["gradient_accumulation_steps"]

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.rank != 0 or not logs or "reward" not in logs:
            return
        step_time = time.perf_counter() - self.step_started
        length = logs.get("completions/mean_length", 0.0)
        record = {
            "step": state.global_step,
            "reward_mean": logs.get("reward"),
            "reward_std": logs.get("reward_std"),
            "kl": logs.get("kl"),
            "loss": logs.get("loss"),
            "entropy": logs.get("entropy"),
            "response_length": length,
            "tokens_per_s": length * self.completions_per_step / step_time if step_time > 0 else None,
            "step_time_s": step_time,
            "learning_rate": logs.get("learning_rate"),
            "resumed_from": self.resumed_from,
            "time": time.time(),
        }
        with open(self.settings.metrics_file, "a") as handle:
            handle.write(json.dumps(record) + "\n")


class _CheckpointPublisher(_trainer_callback_base()):
    """Moves the trainer's `checkpoint-N` to `global_step_N` once every rank has written its part,
    then points `latest` at it. A step saved again (after a resume) replaces its older copy."""

    def __init__(self, settings: LocalTrainSettings, rank: int):
        self.settings, self.rank = settings, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_save = True  # the final policy, whatever save_freq is

    def on_save(self, args, state, control, **kwargs):
        self.publish(state.global_step)

    def publish(self, step: int) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's RNG state is in checkpoint-N before it moves
        if self.rank == 0:
            written = self.settings.checkpoints / ".trainer" / f"checkpoint-{step}"
            final = self.settings.checkpoints / f"global_step_{step}"
            if written.is_dir():
                if final.exists():
                    os.replace(final, self.settings.checkpoints / f".replaced-global_step_{step}-{time.time_ns()}")
                os.replace(written, final)
                write_text_atomic(self.settings.checkpoints / LATEST, f"{step}\n")
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


# --- the driver: plans, starts the workers, follows them ---------------------------------------


def plan_local_training(
    profile: RunProfile, data_train_files: list[str], model_path: str, run_dir: Path, devices_here: int
) -> LocalTrainSettings:
    """Every check that can fail before a worker starts: worker count vs devices, batch and group
    sizes, the dataset's reward columns, prompt lengths."""
    workers = profile.world_size
    kind = profile.platform.kind
    check_workers_fit(profile, devices_here)
    grpo, updates_per_step = grpo_fields(profile, workers)
    check_reward_columns(data_train_files, profile.algorithm.reward_function)
    steps = profile.trainer.total_training_steps or profile.trainer.total_epochs * (
        _rows(data_train_files) // profile.data.train_batch_size
    )
    if steps <= 0:
        raise ProfileError("trainer.total_training_steps: the run has no step; set it, or use more data")
    return LocalTrainSettings(
        model_path=model_path,
        train_files=data_train_files,
        run_dir=str(run_dir),
        device=kind,
        workers=workers,
        cpus_per_worker=max(1, devices_here // workers) if kind == "cpu" else 1,
        comm_backend=profile.platform.comm_backend,
        ray_resource=profile.platform.ray_resource,
        dtype="float32" if kind == "cpu" else profile.engine.dtype,
        max_steps=steps * updates_per_step,
        step_timeout_s=profile.trainer.step_timeout_s,
        save_steps=profile.trainer.save_freq * updates_per_step if profile.trainer.save_freq > 0 else 0,
        seed=profile.data.seed,
        max_prompt_length=profile.data.max_prompt_length,
        filter_overlong_prompts=profile.data.filter_overlong_prompts,
        reward_function=profile.algorithm.reward_function,
        grpo=grpo,
    )


def _rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def check_reward_columns(files: list[str], reward_function: str | None) -> None:
    """The columns the reward reads, and a reward function for every data_source in the data."""
    import pyarrow.parquet as pq

    from common.rewards import REWARDS, custom_reward

    for path in files:
        columns = pq.ParquetFile(path).schema_arrow.names
        missing = [c for c in ("prompt", "data_source", "reward_model") if c not in columns]
        if missing:
            raise UserError(f"{path}: no {', '.join(missing)} column(s); the reward needs prompt, data_source and "
                            "reward_model.ground_truth (verl's RL schema: let the fetch_dataset stage convert it)")
        if reward_function:
            custom_reward(reward_function)
            continue
        sources = set(pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist())
        unknown = sorted(str(s) for s in sources - set(REWARDS))
        if unknown:
            raise UserError(f"{path}: no reward function for data_source {', '.join(unknown)}; known: "
                            f"{', '.join(REWARDS)} (or set algorithm.reward_function=/path/file.py:function)")


class MetricsFollower:
    """New step records of metrics.jsonl since the last call (the file is rewritten on resume)."""

    def __init__(self, path: Path, after_step: int | None):
        self.path, self.last_step = path, after_step if after_step is not None else 0

    def new(self) -> list[dict]:
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written
            if record["step"] > self.last_step:
                records.append(record)
                self.last_step = record["step"]
        return records


def train_local(
    settings: LocalTrainSettings,
    runtime_env: dict | None,
    ray_address: str | None,
    on_step: Callable[[dict], None] = lambda record: None,
    run_name: str = "grpo",
) -> TrainResult:
    """Train to `settings.max_steps`, resuming from the latest checkpoint; `on_step` sees each
    step's metrics as the workers write them."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from common.ray_cluster import connect_ray, stop_ray_job

    resumed = latest_step(settings.checkpoints)
    result = partial_result(settings, resumed)
    if resumed is not None and resumed >= settings.max_steps:
        return result.model_copy(update={"already_complete": True, "resumed_from": None})
    settings.checkpoints.mkdir(parents=True, exist_ok=True)
    connect_ray(ray_address, runtime_env)
    use_gpu = settings.device == "gpu"
    if settings.device == "cpu":
        # Ray sets each worker's OMP_NUM_THREADS (its torch threads) to the CPUs it was given.
        resources = {"CPU": settings.cpus_per_worker}
    else:
        resources = {settings.ray_resource: 1} if settings.ray_resource and not use_gpu else None
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config=settings.model_dump(),
        scaling_config=ray.train.ScalingConfig(num_workers=settings.workers, use_gpu=use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend=settings.comm_backend),
        # A fresh name per attempt: a reused one would bring back Ray's record of an older run.
        run_config=ray.train.RunConfig(
            name=f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
            storage_path=str(Path(settings.run_dir) / "ray"),
            failure_config=ray.train.FailureConfig(max_failures=0),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised below, in the caller's thread
            outcome["error"] = exc

    follower = MetricsFollower(settings.metrics_file, resumed)
    runner = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    runner.start()
    last_step_at = time.monotonic()
    while runner.is_alive():
        runner.join(POLL_S)
        for record in follower.new():
            last_step_at = time.monotonic()
            on_step(record)
        if time.monotonic() - last_step_at > settings.step_timeout_s:
            # A hung collective or a stuck worker never raises: end this driver's Ray job, which
            # takes its workers (and their devices) with it, so the retry starts clean.
            stop_ray_job()
            raise TrainingInterrupted(
                f"no training step finished in {settings.step_timeout_s:.0f} s (trainer.step_timeout_s): taken for a "
                f"hang, workers stopped; the latest checkpoint is step {latest_step(settings.checkpoints) or 0}"
            )
    for record in follower.new():
        on_step(record)
    if "error" in outcome:
        raise _as_project_error(outcome["error"]) from outcome["error"]
    done = latest_step(settings.checkpoints)
    if done is None or done < settings.max_steps:
        raise TrainingInterrupted(f"the workers stopped at step {done or 0} of {settings.max_steps}")
    return partial_result(settings, done).model_copy(update={"resumed_from": resumed})


def partial_result(settings: LocalTrainSettings, step: int | None) -> TrainResult:
    return TrainResult(
        backend="local",
        checkpoint_dir=str(settings.checkpoints / f"global_step_{step}") if step is not None else "",
        steps_done=step or 0,
        max_steps=settings.max_steps,
        metrics_file=str(settings.metrics_file),
    )


def _as_project_error(error: BaseException) -> Exception:
    """A worker's UserError stays one (never retried); anything else interrupted training."""
    for failure in getattr(error, "worker_failures", {}).values():
        cause = getattr(failure, "cause", failure)
        if isinstance(cause, UserError):
            return cause
    return TrainingInterrupted(f"training stopped: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
