"""What runs inside each Ray Train worker: one data-parallel rank of TRL's GRPOTrainer.

    python -m grpo_pipeline --model tiny --device cpu --set cluster.devices_per_node=2   # two of these

Imported by the driver only when it starts training, and by the workers: transformers, TRL and
torch load here, never when the flow is imported. A worker never calls Prefect: rank 0 appends a
`StepMetrics` record per optimizer step to metrics.jsonl and publishes checkpoints; the driver
follows both. Every rank runs the guards on each step (the values are the same on all ranks: gathered or
all-reduced): a non-finite step stops before its checkpoint is written, so a poisoned step is never
saved; any other guard stops the run after the step's checkpoint and before the next rollout, so the
run ends at the step that tripped whatever the driver has read of the records by then.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from grpo_pipeline.backends.guards import GuardTrip, GuardTripped, StepGuards
from grpo_pipeline.backends.local.checkpoints import TRAINER_DIR, latest_step, publish_step
from grpo_pipeline.backends.local.probe import MISMATCH, RolloutProbe
from grpo_pipeline.backends.local.rewards import trl_rewards
from grpo_pipeline.backends.local.settings import LocalTrainSettings, prompt_length
from grpo_pipeline.backends.metrics import StepMetrics, append_metrics, read_metrics
from grpo_pipeline.generation.compiled import compiled_decoding
from grpo_pipeline.run.folder import RunFolder


def worker_loop(config: dict[str, Any]) -> None:
    """One data-parallel rank: TRL's GRPOTrainer, resuming from the latest checkpoint if any."""
    import datasets
    import ray.train
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig

    from grpo_pipeline.backends.local.trl_hooks import grpo_trainer_class

    settings = LocalTrainSettings.model_validate(config)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    if settings.platform.ray_resource is None:
        # Ray gives each worker its share of the cores; more threads than that only contend.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    set_seed(settings.seed)
    resume = latest_step(settings.checkpoints)  # the driver has cut metrics.jsonl back to it

    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    plan = settings.generation  # decided at planning (generation/plan.py); the engine is in settings.grpo
    model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=getattr(torch, settings.dtype),
                                                 attn_implementation=plan.attn_implementation)
    timer = GenerationTimer()
    train = training_rows(settings, tokenizer, datasets)
    reward_funcs, reward_weights = trl_rewards(settings.reward, settings.guards)
    args = GRPOConfig(**trainer_arguments(settings, reward_weights))
    options = {}
    if plan.native:
        from grpo_pipeline.backends.local.rollouts import NativeRollouts

        options["native"] = NativeRollouts(plan, settings.max_prompt_length, settings.compile_cache_dir)
    if settings.guards.probe_sequences:  # the rollouts' log-probs, probed: the mismatch guard's numbers
        options["probe"] = RolloutProbe(settings.guards.probe_sequences)
    if settings.lora.enabled:  # TRL wraps the model with PEFT; the reference is the base, adapter disabled
        from grpo_pipeline.backends.local.lora import peft_config

        options["peft_config"] = peft_config(settings.lora)
    # Every run orders its data by epoch (backends/local/data_order.py) and times its rollouts.
    trainer = grpo_trainer_class()(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[_MetricsWriter(settings, rank, resume, timer), _CheckpointPublisher(settings, rank)],
        packed=settings.padding_free,
        timer=timer,
        decay_every_parameter=settings.decay_every_parameter,
        master_weights=settings.master_weights,
        **options,
    )
    if settings.phase_timing and rank == 0:
        from grpo_pipeline.backends.local.phases import StepPhases

        StepPhases.attach(trainer, Path(settings.run_dir) / RunFolder.PHASES)
    native_rollouts = plan.native and trainer.native_refusal is None
    if plan.native and not native_rollouts:
        print(f"rollouts: transformers generate, not native decoding: {trainer.native_refusal}", flush=True)
    if plan.compile and plan.engine == "transformers" and not native_rollouts:
        compiled_decoding(trainer.generation_config, settings.platform.accelerated)
    checkpoint = settings.checkpoints / f"global_step_{resume}" if resume is not None else None
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)


def trainer_arguments(settings: LocalTrainSettings, reward_weights: list[float] | None) -> dict[str, Any]:
    """Every GRPOConfig argument a worker passes: the profile's (settings.grpo) and the run's own."""
    return dict(
        output_dir=str(settings.checkpoints / TRAINER_DIR),
        max_steps=settings.max_steps,
        save_strategy="steps" if settings.save_steps > 0 else "no",
        save_steps=max(settings.save_steps, 1),
        logging_steps=1,
        report_to=[],
        seed=settings.seed,
        use_cpu=not settings.platform.accelerated,
        bf16=settings.dtype == "bfloat16",
        dataloader_num_workers=0,
        disable_tqdm=True,
        # transformers replaces a NaN or infinite loss in its log by the mean of the logged ones: the log
        # (and the non_finite guard) would never see it.
        logging_nan_inf_filter=False,
        reward_weights=reward_weights,
        **settings.grpo.model_dump(),
    )


class GenerationTimer:
    """Seconds spent generating since the last `take()`: inside `timing()`, which the trainer's rollouts
    run in (backends/local/trl_hooks.py: TRL's `generate`, vLLM or the native decoder alike)."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def training_rows(settings: LocalTrainSettings, tokenizer, datasets_module):
    """The train split as TRL reads it: `prompt` (chat messages) and the columns TRL hands the rewards
    (`data_source`, `ground_truth`, `extra_info` and each of its fields), without the prompts longer than
    data.max_prompt_length when data.filter_overlong_prompts is set (the driver refused the run already
    if some are too long and filtering is off)."""
    rows = datasets_module.load_dataset("parquet", data_files=settings.train_files, split="train")
    kept = ("prompt", "data_source", "ability", "reward_model", "extra_info")
    rows = rows.map(
        lambda row: {"ground_truth": row["reward_model"]["ground_truth"],
                     **{key: value for key, value in (row.get("extra_info") or {}).items() if key not in kept}},
        remove_columns=[c for c in rows.column_names if c not in kept],
    )
    if settings.filter_overlong_prompts:
        rows = rows.filter(lambda row: prompt_length(tokenizer, row["prompt"]) <= settings.max_prompt_length)
    return rows


# What TRL logs once per generation round (a round serves generation.steps_per_generation steps): the
# summed reward, each reward part's (`rewards/<name>/mean`) and a verl reward's extras (`reward_extras/...`).
ROUND_KEYS = ("reward", "reward_std", "completions/mean_length", "frac_reward_zero_std", MISMATCH)
ROUND_PREFIXES = ("rewards/", "reward_extras/")


class _MetricsWriter(TrainerCallback):
    """Rank 0 appends one JSON line per optimizer step; the driver follows the file. Every rank runs the
    guards here: a non-finite step stops before its checkpoint (transformers logs a step, then saves it),
    another trip at the next step's start, once the tripping step is saved."""

    def __init__(self, settings: LocalTrainSettings, rank: int, resumed_from: int | None, timer: GenerationTimer):
        self.settings, self.rank, self.resumed_from, self.timer = settings, rank, resumed_from, timer
        # The driver cut the records back to the checkpoint resumed from before starting the workers: what
        # is left is the history the windowed guards look back over (empty on a node that cannot read it).
        self.guards = StepGuards(settings.guards, read_metrics(settings.metrics_file), resumed_from)
        self.tripped: GuardTrip | None = None
        self.round: dict[str, float] = {}
        self.step_started = time.perf_counter()
        self.completions_per_step = settings.grpo.completions_per_step * settings.workers

    def on_step_begin(self, args, state, control, **kwargs):
        if self.tripped:  # the step that tripped is saved; no rollout of the next one
            raise GuardTripped(self.tripped)
        self.step_started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or ("loss" not in logs and "reward" not in logs):
            return  # the end-of-training summary
        # TRL logs the rewards of a generation round on its first step only; the round's other steps
        # (generation.steps_per_generation > 1) train on the same responses: their record says so.
        if "reward" in logs:
            self.round = {key: value for key, value in logs.items()
                          if key in ROUND_KEYS or key.startswith(ROUND_PREFIXES)}
        if not self.round:
            return
        logs = {**self.round, **logs}
        step_time = time.perf_counter() - self.step_started
        length = logs.get("completions/mean_length", 0.0)
        record = StepMetrics(
            step=state.global_step,
            reward_mean=logs["reward"],
            reward_std=logs.get("reward_std"),
            kl=logs.get("kl"),
            loss=logs.get("loss"),
            entropy=logs.get("entropy"),
            response_length=length,
            tokens_per_s=length * self.completions_per_step / step_time if step_time > 0 else None,
            step_time_s=step_time,
            generation_s=self.timer.take(),
            learning_rate=logs.get("learning_rate"),
            grad_norm=logs.get("grad_norm"),
            mismatch=logs.get(MISMATCH),
            zero_advantage_share=logs.get("frac_reward_zero_std"),
            resumed_from=self.resumed_from,
            rewards={key: value for key, value in self.round.items() if key.startswith(ROUND_PREFIXES)},
            time=time.time(),
        )
        if self.rank == 0:
            append_metrics(self.settings.metrics_file, record)
        if trip := self.guards.check(record):
            if trip.guard == "non_finite":
                raise GuardTripped(trip)
            self.tripped = trip


class _CheckpointPublisher(TrainerCallback):
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
            publish_step(self.settings.checkpoints, step)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
