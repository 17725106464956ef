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

# verl's loss_agg_mode -> TRL's loss_type: how per-token losses become one number. Not
# seq-mean-token-sum-norm: verl 0.9.1 divides it by the micro batch's longest response (actor.loss_scale_factor
# unset: core_algos.py agg_loss, the horizon `loss_mask.shape[-1]` of the micro batch padded to its own longest),
# TRL's dr_grpo by max_completion_length: a different scale on every micro batch.
LOSS_TYPES = {
    "token-mean": "dapo",  # mean over every active token of the update
    "seq-mean-token-mean": "grpo",  # mean per sequence, then over sequences
}

# verl 0.9.1's actor optimizer when the profile sets only the learning rate (trainer/config/optim/fsdp.yaml:
# AdamW, weight_decay 0.01, betas [0.9, 0.999], clip_grad 1.0, constant schedule, no warm-up;
# workers/config/optimizer.py build_optimizer: torch.optim.AdamW over every parameter, eps left at torch's
# 1e-8). TRL leaves weight decay at 0.0 and would exempt biases and norms (trl_hooks.py decays them as verl
# does). tests/test_verl_parity.py checks these against verl's composed config and steps both optimizers.
VERL_WEIGHT_DECAY = 0.01
VERL_BETAS = (0.9, 0.999)
VERL_ADAM_EPS = 1e-8
VERL_CLIP_GRAD = 1.0


def decays_every_parameter(profile: RunProfile) -> bool:
    """Which parameters verl's actor decays: all of them with the FSDP engine (build_optimizer over
    `module.parameters()`), none of the biases and 1-D ones (norms) with Megatron (megatron-core's
    optimizer/__init__.py param groups: wd_mult 0 for `*.bias` and len(shape) == 1), which is what
    transformers' Trainer exempts on these models too (profiles/engine.py: each engine's fact)."""
    return profile.engine.decays_every_parameter


# verl's dual clip (actor.clip_ratio_c, trainer/config/actor/actor.yaml): a negative-advantage token's loss stops
# growing at ratio 3. TRL's two-sided `delta` caps the ratio at the same bound, which gives verl's loss for both
# signs of the advantage while 1 + clip_ratio_high <= 3 (above it verl's cap binds where TRL's does not).
VERL_CLIP_RATIO_C = 3.0
# verl's KL estimators that are TRL's (k3: exp(ref - logp) - (ref - logp) - 1; verl clamps it to [-10, 10]).
K3_KL = ("low_var_kl", "k3")


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
        problems.append(f"algorithm.loss_agg_mode={algo.loss_agg_mode}: the local backend supports {', '.join(LOSS_TYPES)}"
                        " (TRL has no aggregation that equals verl's for it)")
    if algo.use_kl_loss and algo.kl_loss_type not in K3_KL:
        problems.append(f"algorithm.kl_loss_type={algo.kl_loss_type}: TRL's KL loss is k3 only; use "
                        "algorithm.kl_loss_type=low_var_kl")
    if algo.clip_ratio_high > VERL_CLIP_RATIO_C - 1:
        problems.append(f"algorithm.clip_ratio_high={algo.clip_ratio_high}: above {VERL_CLIP_RATIO_C - 1:g} verl's dual "
                        f"clip (ratio {VERL_CLIP_RATIO_C:g}) cuts below TRL's; use {VERL_CLIP_RATIO_C - 1:g} or less")
    per_update, micro = profile.sequences_per_update, actor.ppo_micro_batch_size_per_gpu
    if algo.entropy_coeff and not (algo.loss_agg_mode == "token-mean" and workers == 1 and micro == per_update):
        # TRL's bonus is each micro batch's token mean (averaged over micro batches and workers), verl's the
        # update's loss_agg_mode mean: the same number only for one micro batch, on one worker, under token-mean.
        problems.append(f"algorithm.entropy_coeff={algo.entropy_coeff}: TRL's entropy bonus equals verl's only with "
                        "algorithm.loss_agg_mode=token-mean and the whole update in one micro batch on one worker "
                        f"(actor.ppo_micro_batch_size_per_gpu={per_update}, cluster.devices_per_node=1); set those, or "
                        "algorithm.entropy_coeff=0")
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
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    delta: float
    use_bias_correction_kl: bool
    entropy_coef: float
    loss_type: Literal["dapo", "grpo"]
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
    vllm_importance_sampling_correction: bool = True
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
    # verl 0.9.1 weights no token by the rollout engine's log-probs (algorithm.rollout_correction.rollout_is: null);
    # TRL's vLLM path would (truncated importance sampling, on by default).
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=profile.rollout.gpu_memory_utilization,
                vllm_importance_sampling_correction=False)
    fields = GrpoFields(
        num_generations=n,
        beta=algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        epsilon=algo.clip_ratio_low,
        epsilon_high=algo.clip_ratio_high,
        learning_rate=algo.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=VERL_WEIGHT_DECAY,
        adam_beta1=VERL_BETAS[0],
        adam_beta2=VERL_BETAS[1],
        adam_epsilon=VERL_ADAM_EPS,
        max_grad_norm=VERL_CLIP_GRAD,
        delta=VERL_CLIP_RATIO_C,
        # TRL 1.16 weights the KL term by the (differentiable) policy ratio by default; verl's KL loss is the
        # plain estimator (workers/utils/losses.py ppo_loss), so the KL gradients differ even on-policy.
        use_bias_correction_kl=False,
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


def staleness_note(profile: RunProfile, generation: GenerationPlan) -> str | None:
    """What generation.steps_per_generation > 1 (a lever verl lacks: verl generates every step) changes of the
    algorithm; None when every round serves one step, as verl's do."""
    rounds = generation.steps_per_generation
    if rounds <= 1:
        return None
    per_step = profile.data.train_batch_size // profile.actor.ppo_mini_batch_size
    updates = rounds * per_step
    return (f"generation.steps_per_generation={rounds}: one rollout round feeds {updates} updates (verl: {per_step}), "
            f"so an update trains on rollouts up to {updates - 1} updates old (verl: {per_step - 1}); TRL scores the "
            "round once with the policy that generated it (the old-policy pass) and clips each update's ratio to it "
            f"(clip_ratio_low/high, and {VERL_CLIP_RATIO_C:g} for negative advantages), which bounds how far a stale "
            "update moves but does not undo it; rewards are logged once a round")


def algorithm_notes(profile: RunProfile, generation: GenerationPlan) -> list[str]:
    """Where the local backend's update departs from verl's for this profile, each in one line."""
    return [note for note in (staleness_note(profile, generation),) if note]
