"""The one `algorithm` / `data` / `actor` description, mapped to TRL's GRPOConfig (the table in
backends/local/__init__.py), and what that mapping cannot express.

    python -m grpo_pipeline --model tiny --device cpu --set algorithm.use_kl_in_reward=true --dry-run   # refused
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.planner.rules import batch_problems

# verl's loss_agg_mode -> TRL's loss_type: how per-token losses become one number.
LOSS_TYPES = {
    "token-mean": "dapo",  # mean over every active token of the batch
    "seq-mean-token-mean": "grpo",  # mean per sequence, then over sequences
    "seq-mean-token-sum-norm": "dr_grpo",  # sum per sequence / a constant (max length)
}


def mapping_problems(profile: RunProfile) -> list[str]:
    """What TRL cannot do of this profile, and batch sizes that do not split over the workers (the
    local backend is plain data parallel: one rank per worker)."""
    algo, actor = profile.algorithm, profile.actor
    workers = profile.world_size
    problems = batch_problems(profile, data_parallel=workers)
    if algo.use_kl_in_reward:
        problems.append("algorithm.use_kl_in_reward=true: the local backend (TRL) has no in-reward KL; use "
                        "algorithm.use_kl_loss")
    if algo.loss_agg_mode not in LOSS_TYPES:
        problems.append(f"algorithm.loss_agg_mode={algo.loss_agg_mode}: the local backend supports {', '.join(LOSS_TYPES)}")
    per_update, micro = profile.sequences_per_update, actor.ppo_micro_batch_size_per_gpu
    if per_update % (micro * workers):
        problems.append(
            f"actor.ppo_mini_batch_size x algorithm.rollout_n = {per_update} completions per update is not a multiple of "
            f"actor.ppo_micro_batch_size_per_gpu x workers = {micro} x {workers}; pick sizes that divide"
        )
    return problems


class GrpoFields(BaseModel):
    """The GRPOConfig fields the pipeline sets, typed: what every worker passes to GRPOConfig. Every name is
    GRPOConfig's, and a field with a default (set only on some runs) has TRL's own default:
    tests/test_trl_hooks.py checks both against the installed GRPOConfig."""

    model_config = ConfigDict(extra="forbid")

    num_generations: int = Field(..., gt=0)
    beta: float
    epsilon: float
    epsilon_high: float
    learning_rate: float
    lr_scheduler_type: Literal["constant"]
    warmup_steps: int
    entropy_coef: float
    loss_type: Literal["dapo", "grpo", "dr_grpo"]
    scale_rewards: Literal["group"]
    temperature: float
    max_completion_length: int = Field(..., gt=0)
    generation_batch_size: int = Field(..., gt=0)
    cache_implementation: Literal["static"] | None = None
    per_device_train_batch_size: int = Field(..., gt=0)
    gradient_accumulation_steps: int = Field(..., gt=0)
    gradient_checkpointing: bool
    use_vllm: bool = False
    vllm_mode: Literal["colocate"] = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    generation_kwargs: dict[str, int] | None = Field(None, description="Only the step bench sets it "
                                                     "(min_new_tokens: every completion full length).")

    @property
    def completions_per_step(self) -> int:
        """Completions one worker trains on per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


def grpo_fields(profile: RunProfile, workers: int, generation: GenerationPlan) -> tuple[GrpoFields, int]:
    """GRPOConfig fields for the profile and the run's generation plan (generation/plan.py), and how
    many optimizer steps make one verl step."""
    algo, data, actor = profile.algorithm, profile.data, profile.actor
    n = algo.rollout_n
    per_update = profile.sequences_per_update  # completions per optimizer step
    micro = actor.ppo_micro_batch_size_per_gpu
    updates_per_step = data.train_batch_size // actor.ppo_mini_batch_size
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=profile.rollout.gpu_memory_utilization)
    fields = GrpoFields(
        num_generations=n,
        beta=algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        epsilon=algo.clip_ratio_low,
        epsilon_high=algo.clip_ratio_high,
        learning_rate=algo.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        entropy_coef=algo.entropy_coeff,
        loss_type=LOSS_TYPES[algo.loss_agg_mode],
        scale_rewards="group",
        temperature=algo.temperature,
        max_completion_length=data.max_response_length,
        # Global completions per generation round; TRL splits them into micro batches and takes
        # train_batch_size / ppo_mini_batch_size optimizer steps on them, as verl does.
        # generation.steps_per_generation > 1 generates several steps' prompts in one round.
        generation_batch_size=profile.sequences_per_step * generation.steps_per_generation,
        cache_implementation="static" if generation.cache == "static" else None,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_update // (micro * workers),
        gradient_checkpointing=profile.model.enable_gradient_checkpointing,
        **(vllm if generation.engine == "vllm" else {}),
    )
    return fields, updates_per_step
