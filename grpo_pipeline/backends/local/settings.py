"""What the local backend checks before a worker starts, and the settings every worker gets.

    python -m grpo_pipeline --model tiny --device cpu --set cluster.devices_per_node=4   # refused on 2 cores

Checks: the worker count against the host's devices, the dataset's reward columns, the run's reward
(rewards/check.py: a built-in one for every data_source, or the user's imported and called on two rows),
prompt lengths against data.max_prompt_length, and that the run has a step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.backends.local.mapping import GrpoFields, decays_every_parameter, grpo_fields
from grpo_pipeline.backends.local.master_weights import trains_master_weights
from grpo_pipeline.backends.local.packing import padding_free
from grpo_pipeline.errors import ProfileError, UserError
from grpo_pipeline.generation.decoding import compile_cache_dir
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.guards import GuardsSection
from grpo_pipeline.profiles.lora import LoraSection
from grpo_pipeline.profiles.platform import Platform
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.rewards.check import check_rewards
from grpo_pipeline.rewards.plan import RewardPlan
from grpo_pipeline.run.folder import RunFolder


log = logging.getLogger(__name__)


class LocalTrainSettings(BaseModel):
    """Everything a worker needs; plain data, shipped to every Ray Train worker."""

    model_path: str
    train_files: list[str]
    run_dir: str
    platform: Platform = Field(..., description="The device's facts (torch device, Ray resource, process group).")
    workers: int = Field(..., gt=0)
    cpus_per_worker: int = Field(1, gt=0, description="Without a device resource (cpu): cores for each worker (its "
                                 "torch threads).")
    dtype: str = Field(..., description="Training dtype: the platform's (float32 on cpu), else engine.dtype.")
    max_steps: int = Field(..., gt=0, description="Optimizer steps in all.")
    step_timeout_s: float = Field(3600, gt=0, description="No new step for this long is taken for a hang.")
    save_steps: int = Field(..., description="Checkpoint every this many optimizer steps (<= 0: only at the end).")
    seed: int
    max_prompt_length: int
    filter_overlong_prompts: bool
    reward: RewardPlan = Field(default_factory=RewardPlan, description="What scores the completions (rewards/plan.py).")
    grpo: GrpoFields = Field(..., description="GRPOConfig fields derived from the profile (backends/local/mapping.py).")
    decay_every_parameter: bool = Field(False, description="Weight decay on biases and norms too, as verl's FSDP actor "
                                        "does (backends/local/mapping.py); else transformers' choice, Megatron's.")
    master_weights: bool = Field(False, description="The optimizer steps fp32 copies of the 16-bit weights, as verl's "
                                 "actor keeps fp32 weights (backends/local/master_weights.py).")
    generation: GenerationPlan = Field(..., description="How rollouts are generated (generation/plan.py, resolved at "
                                       "planning): the engine in `grpo`, the decoder and compiling here.")
    padding_free: bool = Field(False, description="Log-prob passes on packed micro batches, no padding "
                               "(backends/local/packing.py: engine.use_remove_padding with flash-attention).")
    phase_timing: bool = Field(False, description="Rank 0 writes each step's time by phase to <run>/phases.jsonl "
                               "(backends/local/phases.py; bench/bench_grpo_step.py turns it on).")
    compile_cache_dir: str | None = Field(None, description="Where torch keeps compiled decode steps between runs "
                                          "(under model.root).")
    guards: GuardsSection = Field(default_factory=GuardsSection, description="The run's guards: the workers stop "
                                  "on a non-finite step before it is saved, and probe the rollouts' log-probs.")
    lora: LoraSection = Field(default_factory=LoraSection, description="The adapter TRL trains instead of every weight "
                              "(rank 0: none; backends/local/lora.py).")

    @property
    def checkpoints(self) -> Path:
        return Path(self.run_dir) / RunFolder.CHECKPOINTS

    @property
    def metrics_file(self) -> Path:
        return Path(self.run_dir) / RunFolder.METRICS


def check_workers_fit(p: RunProfile, devices_here: int) -> None:
    """On one host the local backend starts one training worker per device (on cpu: per process
    slot); more than the host has would wait for devices that never come."""
    workers = p.world_size
    if p.cluster.nnodes != 1 or devices_here <= 0 or workers <= devices_here:
        return
    raise ProfileError(
        f"cluster.devices_per_node={p.cluster.devices_per_node}: {workers} training workers but this host has "
        f"{devices_here} {p.platform.device_noun}; use --set cluster.devices_per_node={devices_here} or fewer"
    )


def plan_local_training(
    profile: RunProfile, data_train_files: list[str], model_path: str, run_dir: Path, devices_here: int,
    generation: GenerationPlan,
) -> LocalTrainSettings:
    """Every check that can fail before a worker starts: worker count vs devices, batch and group
    sizes, the dataset's reward columns, prompt lengths."""
    workers, platform = profile.world_size, profile.platform
    check_workers_fit(profile, devices_here)
    grpo, updates_per_step = grpo_fields(profile, workers, generation)
    check_reward_columns(data_train_files)
    reward = RewardPlan.from_section(profile.reward)
    for line in check_rewards(reward, data_train_files[0], profile.reward.check_timeout_s):
        log.info("%s", line)
    steps = profile.trainer.total_training_steps or profile.trainer.total_epochs * (
        _rows(data_train_files) // profile.data.train_batch_size
    )
    if steps <= 0:
        raise ProfileError("trainer.total_training_steps: the run has no step; set it, or use more data")
    return LocalTrainSettings(
        model_path=model_path,
        train_files=data_train_files,
        run_dir=str(run_dir),
        platform=platform,
        workers=workers,
        # Workers without a device of their own share the host's cores.
        cpus_per_worker=max(1, devices_here // workers) if platform.ray_resource is None else 1,
        dtype=platform.run_dtype(profile.engine.dtype),
        max_steps=steps * updates_per_step,
        step_timeout_s=profile.trainer.step_timeout_s,
        save_steps=profile.trainer.save_freq * updates_per_step if profile.trainer.save_freq > 0 else 0,
        seed=profile.data.seed,
        max_prompt_length=profile.data.max_prompt_length,
        filter_overlong_prompts=profile.data.filter_overlong_prompts,
        reward=reward,
        grpo=grpo,
        decay_every_parameter=decays_every_parameter(profile),
        master_weights=trains_master_weights(platform.run_dtype(profile.engine.dtype)),
        generation=generation,
        compile_cache_dir=str(compile_cache_dir(profile.model.root)),
        padding_free=padding_free(profile.engine.use_remove_padding, generation.attn_implementation),
        guards=profile.guards,
        lora=profile.lora,
    )


def _rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def check_reward_columns(files: list[str]) -> None:
    """The columns every reward reads (verl's RL schema); what each reward needs beyond them is
    rewards/check.py's."""
    import pyarrow.parquet as pq

    for path in files:
        columns = pq.ParquetFile(path).schema_arrow.names
        missing = [c for c in ("prompt", "data_source", "reward_model") if c not in columns]
        if missing:
            raise UserError(f"{path}: no {', '.join(missing)} column(s); the reward needs prompt, data_source and "
                            "reward_model.ground_truth (verl's RL schema: let the fetch_dataset stage convert it)")


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
