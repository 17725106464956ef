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
from tasks.files import write_text_atomic

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
    comm_backend: str
    ray_resource: str | None
    dtype: str = Field(..., description="Training dtype on this device: float32 on cpu, the profile's otherwise.")
    max_steps: int = Field(..., gt=0, description="Optimizer steps in all.")
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
    if rank == 0 and resume is not None:
        _keep_metrics_up_to(settings.metrics_file, resume)

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
    if settings.save_steps <= 0 or settings.max_steps % settings.save_steps:
        trainer._save_checkpoint(trainer.model, trial=None)  # the final policy, whatever save_steps is
        _CheckpointPublisher(settings, rank).publish(trainer.state.global_step)


def training_rows(settings: LocalTrainSettings, tokenizer, datasets_module):
    """The train split as TRL reads it: `prompt` (chat messages) plus what the reward needs."""
    rows = datasets_module.load_dataset("parquet", data_files=settings.train_files, split="train")
    rows = rows.map(
        lambda row: {"ground_truth": row["reward_model"]["ground_truth"]},
        remove_columns=[c for c in rows.column_names if c not in ("prompt", "data_source", "reward_model")],
    ).remove_columns(["reward_model"])
    return rows


def _reward_function(custom: str | None) -> Callable:
    from tasks.rewards import score

    def reward(prompts, completions, data_source, ground_truth, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(source, text, truth, custom).reward for source, text, truth in zip(data_source, texts, ground_truth)]

    reward.__name__ = "reward"
    return reward


def _keep_metrics_up_to(metrics_file: Path, step: int) -> None:
    """On resume, steps after the checkpoint are trained again: drop their old lines."""
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
