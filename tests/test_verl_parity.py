"""The local backend's GRPO update is verl 0.9.1's: on fixed batches, the advantages, the loss, the gradient and
optimizer steps computed by verl's own functions and by the local backend's TRL trainer agree
(tests/verl_parity.py says what each side runs).

    .venv/bin/python -m pytest -q tests/test_verl_parity.py

Tolerances (float32 on the CPU; the two sides run the model on differently padded batches):
- advantages: TRL divides by (std + 1e-4), verl by (std + 1e-6) (trl grpo_trainer.py:2787, verl
  core_algos.py:326): within 1.01e-4 / std of each advantage, relatively, and 0 on a group whose rewards are all
  1.0 (a reward float32 cannot hold exactly, such as 0.9, is another matter: see the test on it below);
- from verl's advantages on: loss within 1e-6 relatively, gradient norm within 1e-5, every gradient within 1e-5
  of the largest, every parameter's change in each optimizer step of two passes within 1e-4 x lr plus what the
  gradient's float noise makes of it (Adam's step is about lr x g / (|g| + 1e-8), so a gradient near 1e-9 with
  1e-5 x the largest of noise moves visibly), learning rates equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_pipeline.backends.local.mapping import (
    K3_KL, VERL_ADAM_EPS, VERL_BETAS, VERL_CLIP_GRAD, VERL_CLIP_RATIO_C, VERL_WEIGHT_DECAY, decays_every_parameter,
    grpo_fields,
)
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.stages.plan import resolve_profile
from verl_parity import (
    codetiming_note, fixed_batch, local_inputs, local_trainer, local_update, padded_responses, policy_logprobs,
    verl_actor_config, verl_advantages, verl_composed, verl_update,
)

pytestmark = pytest.mark.skipif(bool(codetiming_note()), reason=codetiming_note() or "")

STEPS = 2  # passes over the batch, one optimizer step per update each: Adam's moments (betas, eps) and the schedule past step 1
GRAD_TOL = 1e-5  # of the largest gradient
LR = 1e-3  # large enough that weight decay (lr x 0.01 x w) is far above float noise in a parameter's change


@pytest.mark.parametrize("model, device", [("smollm2-135m", "gpu"), ("smollm2-135m", "cpu"), ("tiny", "cpu")])
def test_the_mapping_sets_what_verl_composes_for_the_profile(model, device):
    """verl's actor settings the profile leaves to verl's defaults are the ones the mapping gives TRL."""
    profile = resolve_profile(model, device)
    composed = verl_composed(profile)
    actor, algorithm = composed["actor_rollout_ref"]["actor"], composed["algorithm"]
    optim = actor["optim"]
    grpo, _ = grpo_fields(profile, profile.world_size, plan_generation(profile))
    if profile.engine.strategy == "fsdp":  # torch's AdamW, verl's constant schedule
        assert (optim["optimizer"], optim["optimizer_impl"], optim["override_optimizer_config"]) == ("AdamW", "torch.optim", None)
        assert optim["lr_scheduler_type"] == "constant"
    else:  # megatron-core's Adam (decoupled weight decay), its constant schedule
        assert (optim["optimizer"], optim["lr_decay_style"], optim["override_optimizer_config"]) == ("adam", "constant", {})
    assert (grpo.weight_decay, (grpo.adam_beta1, grpo.adam_beta2), grpo.max_grad_norm) == \
        (optim["weight_decay"], tuple(optim["betas"]), optim["clip_grad"]) == (VERL_WEIGHT_DECAY, VERL_BETAS, VERL_CLIP_GRAD)
    assert grpo.adam_epsilon == VERL_ADAM_EPS == torch.optim.AdamW([torch.zeros(1)]).defaults["eps"]
    assert grpo.lr_scheduler_type == "constant" and grpo.learning_rate == optim["lr"]
    assert optim["lr_warmup_steps"] <= 0 and optim["lr_warmup_steps_ratio"] == 0.0 and grpo.warmup_steps == 0
    assert actor["clip_ratio_c"] == grpo.delta == VERL_CLIP_RATIO_C
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (grpo.epsilon, grpo.epsilon_high)
    assert actor["policy_loss"]["loss_mode"] == "vanilla" and actor["loss_scale_factor"] is None
    assert actor["kl_loss_type"] in K3_KL and actor["entropy_coeff"] == grpo.entropy_coef
    assert algorithm["norm_adv_by_std_in_grpo"] is True and grpo.scale_rewards == "group"
    assert algorithm["rollout_correction"]["rollout_is"] is None  # nor does the local backend weight by vLLM's log-probs
    assert not grpo.vllm_importance_sampling_correction or not grpo.use_vllm
    assert (actor["ppo_epochs"], actor["shuffle"]) == (1, False)
    # Weight decay on biases and norms: verl's FSDP actor decays them, its Megatron actor does not.
    assert decays_every_parameter(profile) == (profile.engine.strategy == "fsdp")


# (group size, groups a step, groups an update, micro batch, profile overrides): every setting the profile exposes
# that reaches the update.
CASES = {
    "token-mean": (4, 3, 3, 12, []),
    "token-mean, micro batches, KL, asymmetric clip": (
        2, 4, 4, 2, ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.05", "algorithm.clip_ratio_high=0.28"]),
    "seq-mean-token-mean, KL, low and high clip": (
        8, 2, 2, 4, ["algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.use_kl_loss=true",
                     "algorithm.kl_loss_coef=0.01", "algorithm.clip_ratio_low=0.1", "algorithm.clip_ratio_high=0.3"]),
    "entropy bonus, one micro batch": (4, 2, 2, 8, ["algorithm.entropy_coeff=0.01", "algorithm.temperature=0.7"]),
    "dual clip (ratios far from 1)": (4, 2, 2, 4, ["algorithm.clip_ratio_high=0.28"]),
    "token-mean, three updates a step": (2, 6, 2, 2, []),
    "seq-mean-token-mean, two updates a step": (4, 4, 2, 4, ["algorithm.loss_agg_mode=seq-mean-token-mean"]),
}


# What the mapping refuses (profile resolution runs mapping_problems), set past it: the numbers that say why.
# (group size, groups a step, groups an update, micro batch, profile overrides, algorithm settings set past it)
REFUSED = {
    "entropy bonus over two micro batches": (4, 2, 2, 4, [], {"entropy_coeff": 1.0}),
}


def parity_profile(group: int, groups: int, per_update: int, micro: int, overrides: list[str]):
    return resolve_profile("tiny", "cpu", overrides=[
        f"algorithm.rollout_n={group}", f"data.train_batch_size={groups}", f"actor.ppo_mini_batch_size={per_update}",
        f"actor.ppo_micro_batch_size_per_gpu={micro}", "cluster.devices_per_node=1", f"algorithm.lr={LR}",
        "generation.steps_per_generation=1", "trainer.total_training_steps=10", "engine.strategy=fsdp", *overrides])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    special = set(tokenizer.all_special_ids)
    first = max(special) + 1 if max(special) < 64 else 64
    assert not special & set(range(first, first + 200))
    return model, tokenizer, range(first, first + 200)


def both_sides(tiny, tmp_path, case: str):
    model, tokenizer, tokens = tiny
    group, groups, per_update, micro, overrides, *refused = {**CASES, **REFUSED}[case]
    profile = parity_profile(group, groups, per_update, micro, overrides)
    if refused:
        profile = profile.model_copy(update={"algorithm": profile.algorithm.model_copy(update=refused[0])})
    batch = fixed_batch(group, groups, seed=len(case), token_ids=tokens)
    if "dual clip" in case:
        batch.rollout_noise = 2.0  # ratios e^(+-4): both clip bounds and the dual clip at 3 bind
    temperature = profile.algorithm.temperature
    with torch.no_grad():
        own = padded_responses(policy_logprobs(model, batch, temperature)[0], batch, range(batch.rows))
    rollout, reference = own + batch.noise(batch.rollout_noise, 1), own + batch.noise(batch.reference_noise, 2)
    composed = verl_composed(profile)
    actor = verl_actor_config(composed, profile.trainer.total_training_steps)
    advantages = verl_advantages(batch, composed["algorithm"]["norm_adv_by_std_in_grpo"])
    verl = verl_update(copy.deepcopy(model), batch, actor, advantages, rollout, reference, temperature,
                       per_update * group, micro, STEPS)
    steps = profile.trainer.total_training_steps * groups // per_update  # TRL's optimizer steps (mapping: max_steps)
    trainer = local_trainer(profile, copy.deepcopy(model), tokenizer, batch, tmp_path, steps)
    inputs = local_inputs(trainer, batch)
    local = local_update(trainer, inputs, batch, advantages, rollout, reference, STEPS)
    if "dual clip" in case:  # negative-advantage tokens past ratio 3: verl's dual clip binds
        ratio = torch.exp(own - rollout) * batch.response_mask()
        assert ((ratio > VERL_CLIP_RATIO_C) & (advantages < 0)).any()
    return batch, verl, local, inputs


@pytest.mark.parametrize("case", list(CASES))
def test_advantages_loss_gradient_and_steps_agree_with_verls(tiny, tmp_path, case):
    batch, verl, local, inputs = both_sides(tiny, tmp_path, case)
    # TRL kept the fixed rollouts as verl's batch has them: same tokens counted.
    assert inputs["completion_mask"].sum().item() == batch.response_mask().sum().item()
    rewards = torch.tensor(batch.rewards).view(-1, batch.group_size)
    std = rewards.std(dim=1).repeat_interleave(batch.group_size)
    gap = (local.advantages - verl.advantages).abs()
    assert torch.all(gap <= verl.advantages.abs() * 1.01e-4 / std.clamp(min=1e-3) + 1e-6), case
    assert local.advantages[:batch.group_size].eq(0).all() and verl.advantages[:batch.group_size].eq(0).all()
    assert local.loss == pytest.approx(verl.loss, rel=1e-6, abs=1e-7), case
    assert local.grad_norm == pytest.approx(verl.grad_norm, rel=1e-5), case
    if case == "token-mean":
        assert verl.grad_norm > VERL_CLIP_GRAD  # the clipping binds
    largest = max(g.abs().max().item() for g in verl.grads.values())
    for name, grad in verl.grads.items():
        assert torch.allclose(local.grads[name], grad, rtol=0, atol=GRAD_TOL * largest), f"{case}: gradient of {name}"
    assert local.learning_rates == pytest.approx(verl.learning_rates, rel=1e-12)
    for step, (ours, theirs) in enumerate(zip(local.deltas, verl.deltas, strict=True)):
        for name, delta in theirs.items():
            # Adam's step is about lr x g / (|g| + eps): a gradient's float noise (below GRAD_TOL of the largest)
            # moves it by up to lr x noise / (|g| + eps), which is visible only where |g| is that small.
            noise = LR * GRAD_TOL * largest / (verl.grads[name].abs() + VERL_ADAM_EPS)
            assert torch.all((ours[name] - delta).abs() <= 1e-4 * LR + noise), f"{case}: step {step + 1} of {name}"


def test_an_entropy_bonus_over_micro_batches_is_refused_because_trl_weighs_it_otherwise(tiny, tmp_path):
    """TRL's entropy bonus is each micro batch's token mean (trl grpo_trainer.py:3200), verl's the update's
    (workers/utils/losses.py: agg_loss over the mini batch's tokens): with two micro batches of different token
    counts the gradients part, so the mapping refuses the setting (tests/test_backends.py has the dry run's line)."""
    from grpo_pipeline.backends.local.mapping import mapping_problems

    case = "entropy bonus over two micro batches"
    batch, verl, local, _ = both_sides(tiny, tmp_path, case)
    profile = parity_profile(*REFUSED[case][:5])
    refused = profile.model_copy(update={"algorithm": profile.algorithm.model_copy(update=REFUSED[case][5])})
    assert any(line.startswith("algorithm.entropy_coeff=1.0:") for line in mapping_problems(refused))
    tokens = batch.response_mask().sum(dim=1)
    assert tokens[:4].sum() != tokens[4:].sum()  # micro batches of different token counts
    largest = max(g.abs().max().item() for g in verl.grads.values())
    gap = max((local.grads[n] - g).abs().max().item() for n, g in verl.grads.items())
    assert gap > 100 * GRAD_TOL * largest  # far outside what the settings TRL can express come to


def test_an_all_equal_group_of_inexact_rewards_is_not_zero_in_verl():
    """A difference the local backend keeps (TRL has no epsilon setting): verl's mean of eight 0.9s in float32
    is off by a rounding, its std a rounding too, and (r - mean) / (std + 1e-6) turns that into an advantage of
    about -0.056 for the whole group (8 x 0.1: -0.007; groups of 2 to 5 come out exact); TRL's 1e-4 keeps it under
    1e-3. arith's 0.9 (correct, not a bare integer) and 0.1 (format only) rewards meet it in groups of 8."""
    import numpy as np
    from verl.trainer.ppo import core_algos

    rewards = torch.zeros(8, 3)
    rewards[:, -1] = 0.9
    advantages, _ = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(8, 3), np.array(["uid"] * 8, dtype=object))
    row = advantages[:, 0]
    trl_like = (rewards.sum(-1) - rewards.sum(-1).mean()) / (rewards.sum(-1).std() + 1e-4)
    assert row.eq(row[0]).all() and -0.06 < row[0] < -0.05  # every response of the group pushed down alike
    assert trl_like.abs().max() < 1e-3


def test_a_bf16_policy_steps_fp32_copies_of_its_weights_as_verls_actor_does(tiny, tmp_path):
    """verl's FSDP actor keeps fp32 weights (fsdp_config.model_dtype) and computes in bf16. AdamW stepping the bf16
    weights themselves, as the local backend did, rounds away every step below half a bf16 spacing: at the
    issue's learning rate (5e-5) about half of this model never moves, however many steps. The local trainer on a
    bf16 policy now steps fp32 copies (backends/local/master_weights.py): the copies follow verl's fp32 steps and
    the policy is them rounded to bf16, so steps add up."""
    from grpo_pipeline.backends.local.master_weights import trains_master_weights

    model, tokenizer, tokens = tiny
    lr, steps = 5e-5, 30
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=generator).to(torch.bfloat16) for n, p in bf16.items()}

    def adamw(dtype) -> dict[str, torch.Tensor]:
        """`steps` AdamW steps of the same gradients on the bf16 weights held in `dtype`."""
        weights = {n: p.to(dtype).requires_grad_() for n, p in bf16.items()}
        optimizer = torch.optim.AdamW(list(weights.values()), lr=lr, weight_decay=VERL_WEIGHT_DECAY)
        for _ in range(steps):
            for n, p in weights.items():
                p.grad = grads[n].to(dtype)
            optimizer.step()
        return {n: p.detach() for n, p in weights.items()}

    def moved(after: dict[str, torch.Tensor]) -> float:
        return sum((p.to(torch.bfloat16) != bf16[n]).sum().item() for n, p in after.items()) / \
            sum(p.numel() for p in after.values())

    verl = adamw(torch.float32)  # verl: fp32 weights, the bf16 compute's gradients
    assert moved(adamw(torch.bfloat16)) < 0.6  # the weights stepped in bf16: the same half stays frozen

    assert trains_master_weights("bfloat16") and not trains_master_weights("float32")
    profile = parity_profile(4, 2, 2, 8, [f"algorithm.lr={lr}"])
    batch = fixed_batch(4, 2, seed=0, token_ids=tokens)
    policy_model = copy.deepcopy(model).to(torch.bfloat16)
    trainer = local_trainer(profile, policy_model, tokenizer, batch, tmp_path, steps, master_weights=True)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    policy = dict(trainer.model.named_parameters())
    for _ in range(steps):
        for n, p in policy.items():
            p.grad = grads[n].clone()
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    copies = {id(param): master for param, master in trainer.optimizer.fp32_copies}
    assert len(copies) == len(policy) and all(p.grad is None for p in policy.values())  # bf16 gradients freed
    for n, p in policy.items():
        assert torch.allclose(copies[id(p)], verl[n], rtol=0, atol=1e-6), n
        assert torch.equal(p.detach(), copies[id(p)].to(torch.bfloat16)), n
    assert moved({n: p.detach() for n, p in policy.items()}) > 0.95
