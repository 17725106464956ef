"""One GRPO update on a fixed batch, twice: with verl 0.9.1's own functions, and as the local backend runs it.

    .venv/bin/python -m pytest -q tests/test_verl_parity.py

verl's side (what its FSDP actor does with a batch, by its own code): the config main_ppo composes from the
profile's rendered overrides (tests/verl_config.py), `core_algos.compute_grpo_outcome_advantage` with the
composed `algorithm.norm_adv_by_std_in_grpo`, the actor's loss `workers/utils/losses.py ppo_loss` (policy loss
`compute_policy_loss_vanilla`, `agg_loss`, `kl_penalty`, the entropy term) on every micro batch with the mini
batch's token and sequence counts, gradient clipping at `optim.clip_grad`, `build_optimizer` and the FSDP
engine's `_build_lr_scheduler` from the composed `actor.optim`.

The local side: the GRPOConfig the worker builds from the profile (backends/local/worker.py
`trainer_arguments`, backends/local/mapping.py), the local backend's GRPOTrainer (trl_hooks.py), whose rollouts
are the batch's fixed responses (TRL's public `rollout_func`) and whose rewards are the batch's rewards; TRL's
own `_generate_and_score_completions` (advantages, masks, token counts) and `_compute_loss`, the Trainer's
optimizer and scheduler (`create_optimizer_and_scheduler`) and its clipping.

Both sides score the responses with the same tiny model (log-probs of the logits divided by the temperature).
The rollout ("old") and reference log-probs are the model's own plus fixed noise, given to both sides alike, so
that ratios leave the clip range on both sides of it and the KL term is not zero.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from grpo_pipeline.profiles.schema import RunProfile

RUN_DIR = Path("/shared/runs/parity")


@dataclass
class FixedBatch:
    """Prompts (token ids), `group_size` responses each (group-major), their rewards, and the noise that makes the
    rollout and reference log-probs differ from the policy's."""

    group_size: int
    prompts: list[list[int]]
    responses: list[list[int]]
    rewards: list[float]
    seed: int
    rollout_noise: float = 0.3
    reference_noise: float = 0.2

    @property
    def rows(self) -> int:
        return len(self.responses)

    def prompt_of(self, row: int) -> list[int]:
        return self.prompts[row // self.group_size]

    @property
    def width(self) -> int:
        return max(len(r) for r in self.responses)

    def response_mask(self) -> torch.Tensor:
        return torch.tensor([[1.0] * len(r) + [0.0] * (self.width - len(r)) for r in self.responses])

    def noise(self, scale: float, salt: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 101 + salt)
        return scale * torch.randn(self.rows, self.width, generator=generator) * self.response_mask()


def fixed_batch(group_size: int, groups: int, seed: int, token_ids: range, longest: int = 7,
                equal_reward: float | None = 1.0) -> FixedBatch:
    """Prompts of 2 to 6 tokens and responses of 1 to `longest` (padding on every row but the longest), rewards
    from arith's {0, 0.1, 0.9, 1} with every group mixed but the first, whose rewards are all `equal_reward`
    (unless None)."""
    rng = np.random.default_rng(seed)
    draw = lambda n: [int(t) for t in rng.integers(token_ids.start, token_ids.stop, n)]  # noqa: E731
    prompts = [draw(int(rng.integers(2, 7))) for _ in range(groups)]
    responses = [draw(int(rng.integers(1, longest + 1))) for _ in range(groups * group_size)]
    responses[0] = draw(longest)  # one response as long as the longest allowed
    rewards = []
    for group in range(groups):
        if group == 0 and equal_reward is not None:
            rewards += [equal_reward] * group_size
            continue
        scores = [float(rng.choice([0.0, 0.1, 0.9, 1.0])) for _ in range(group_size)]
        scores[-1] = 1.0 if scores[0] != 1.0 else 0.0  # never all equal
        rewards += scores
    return FixedBatch(group_size, prompts, responses, rewards, seed)


# ---- verl's side -------------------------------------------------------------------------------------------

def import_verl():
    """verl's modules the actor's update runs; verl's `profiler` imports codetiming (a verl requirement the
    `--no-deps` install leaves to the dev extra)."""
    from verl.trainer.ppo import core_algos
    from verl.utils import tensordict_utils
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    from verl.workers.config.optimizer import build_optimizer
    from verl.workers.utils.losses import ppo_loss

    return SimpleNamespace(core_algos=core_algos, tu=tensordict_utils, entropy_from_logits=entropy_from_logits,
                           logprobs_from_logits=logprobs_from_logits, build_optimizer=build_optimizer,
                           ppo_loss=ppo_loss)


def verl_composed(profile: RunProfile) -> dict:
    """The config verl's main_ppo composes from the profile's rendered command."""
    from grpo_pipeline.backends.verl.command import render_overrides, verl_settings
    from grpo_pipeline.stages.train import training_inputs
    from verl_config import compose_verl

    return compose_verl(render_overrides(verl_settings(profile, training_inputs(profile, RUN_DIR))))


def verl_actor_config(composed: dict, total_training_steps: int):
    """verl's actor config as its workers build it (`omega_conf_to_dataclass`), with the run's step count,
    which verl's trainer injects into `actor.optim` before the workers start (ray_trainer.py:447)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    actor = copy.deepcopy(composed["actor_rollout_ref"]["actor"])
    actor["optim"]["total_training_steps"] = total_training_steps
    return omega_conf_to_dataclass(OmegaConf.create(actor))


def verl_lr_scheduler(optimizer, optim_config):
    """The FSDP engine's own scheduler builder (workers/engine/fsdp/transformer_impl.py `_build_lr_scheduler`),
    called on a stand-in engine that holds only what the method reads."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    return FSDPEngine._build_lr_scheduler(SimpleNamespace(optimizer_config=optim_config, rank=1), optimizer)


def verl_advantages(batch: FixedBatch, norm_adv_by_std_in_grpo: bool) -> torch.Tensor:
    """verl's GRPO advantage per response (the reward sits on each response's last token, as verl's reward
    manager puts it)."""
    verl = import_verl()
    mask = batch.response_mask()
    token_rewards = torch.zeros_like(mask)
    for row, response in enumerate(batch.responses):
        token_rewards[row, len(response) - 1] = batch.rewards[row]
    index = np.array([f"uid{row // batch.group_size}" for row in range(batch.rows)], dtype=object)
    advantages, _ = verl.core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards, response_mask=mask, index=index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    return advantages


def policy_logprobs(model, batch: FixedBatch, temperature: float, rows: range | None = None,
                    entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each response's log-probs (and entropies) as verl's actor takes them: every sequence on its own,
    positions from 0, logits / temperature, verl's `logprobs_from_logits` and `entropy_from_logits`; in verl's
    packed layout (per sequence, one value per position, shifted by one), as `ppo_loss` reads them."""
    verl = import_verl()
    logps, entropies = [], []
    for row in rows or range(batch.rows):
        ids = torch.tensor([batch.prompt_of(row) + batch.responses[row]])
        logits = model(input_ids=ids).logits[0, :-1] / temperature
        logps.append(torch.cat([verl.logprobs_from_logits(logits, ids[0, 1:], inplace_backward=False),
                                torch.zeros(1)]))
        if entropy:
            entropies.append(torch.cat([verl.entropy_from_logits(logits), torch.zeros(1)]))
    return torch.cat(logps), (torch.cat(entropies) if entropy else None)


def padded_responses(packed: torch.Tensor, batch: FixedBatch, rows: range) -> torch.Tensor:
    """The packed per-position values back as (rows, width): what verl's `no_padding_2_padding` slices."""
    out, offset = torch.zeros(len(rows), batch.width), 0
    for i, row in enumerate(rows):
        prompt, response = len(batch.prompt_of(row)), len(batch.responses[row])
        out[i, :response] = packed[offset + prompt - 1: offset + prompt + response - 1]
        offset += prompt + response
    return out


@dataclass
class Update:
    """One side's numbers for the same update."""

    advantages: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor]
    grad_norm: float
    deltas: list[dict[str, torch.Tensor]] = field(default_factory=list)  # parameter change of each optimizer step
    learning_rates: list[float] = field(default_factory=list)


def verl_update(model, batch: FixedBatch, actor_config, advantages: torch.Tensor, rollout: torch.Tensor,
                reference: torch.Tensor, temperature: float, mini_batch: int, micro_batch: int, steps: int) -> Update:
    """verl's actor on the batch, `steps` times over: for each mini batch of `mini_batch` rows (in order: actor.shuffle
    is off), every micro batch's `ppo_loss` with the mini batch's token and sequence counts (dp 1), backward; then
    clipping, the optimizer and scheduler steps (workers/engine/fsdp/transformer_impl.py forward_backward_batch,
    optimizer_step)."""
    from tensordict import TensorDict

    verl = import_verl()
    optimizer = verl.build_optimizer(model.parameters(), actor_config.optim)
    scheduler = verl_lr_scheduler(optimizer, actor_config.optim)
    mask = batch.response_mask()
    entropy = actor_config.entropy_coeff != 0.0  # verl computes entropies only then (ray_trainer.py)
    update = Update(advantages=advantages[:, 0], loss=0.0, grads={}, grad_norm=0.0)
    for step in range(steps):
        for first in range(0, batch.rows, mini_batch):
            optimizer.zero_grad()
            loss_sum = 0.0
            tokens = int(mask[first:first + mini_batch].sum().item())
            for start in range(first, first + mini_batch, micro_batch):
                rows = range(start, start + micro_batch)
                logps, entropies = policy_logprobs(model, batch, temperature, rows, entropy)
                prompts = max(len(batch.prompt_of(r)) for r in rows)
                attention = torch.tensor([[0] * (prompts - len(batch.prompt_of(r))) + [1] * len(batch.prompt_of(r))
                                          for r in rows])
                data = TensorDict({
                    "prompts": torch.ones(len(rows), prompts, dtype=torch.long),
                    "responses": torch.ones(len(rows), batch.width, dtype=torch.long),
                    "attention_mask": torch.cat([attention, mask[list(rows)].long()], dim=1),
                    "response_mask": mask[list(rows)],
                    "old_log_probs": rollout[list(rows)],
                    "advantages": advantages[list(rows)],
                    "ref_log_prob": reference[list(rows)],
                }, batch_size=[len(rows)])
                verl.tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens, global_batch_size=mini_batch)
                output = {"log_probs": logps, **({"entropy": entropies} if entropy else {})}
                loss, _ = verl.ppo_loss(actor_config, output, data)
                loss.backward()
                loss_sum += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=actor_config.optim.clip_grad)
            record(update, model, loss_sum, grad_norm, optimizer.param_groups[0]["lr"], optimizer, scheduler)
    return update


def record(update: Update, model, loss: float, grad_norm, lr: float, optimizer, scheduler) -> None:
    """One optimizer step, taken and written down: the first update's loss, gradients and norm, every step's
    learning rate and parameter change."""
    if not update.grads:
        update.loss, update.grad_norm = loss, float(grad_norm)
        update.grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    update.learning_rates.append(lr)
    optimizer.step()
    scheduler.step()
    update.deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters()})


# ---- the local backend's side ------------------------------------------------------------------------------

def local_trainer(profile: RunProfile, model, tokenizer, batch: FixedBatch, out_dir: Path, max_steps: int,
                  master_weights: bool = False):
    """The local backend's GRPOTrainer with the worker's GRPOConfig for this profile (one worker), rolling out
    the batch's fixed responses and scoring them with its rewards."""
    import datasets
    from trl import GRPOConfig

    from grpo_pipeline.backends.local.mapping import decays_every_parameter, grpo_fields
    from grpo_pipeline.backends.local.settings import LocalTrainSettings
    from grpo_pipeline.backends.local.trl_hooks import grpo_trainer_class
    from grpo_pipeline.backends.local.worker import trainer_arguments
    from grpo_pipeline.generation.plan import plan_generation

    generation = plan_generation(profile)
    grpo, _ = grpo_fields(profile, 1, generation)
    settings = LocalTrainSettings(
        model_path="parity", train_files=[], run_dir=str(out_dir), platform=profile.platform, workers=1,
        dtype="float32", max_steps=max_steps, save_steps=0, seed=profile.data.seed,
        max_prompt_length=profile.data.max_prompt_length, filter_overlong_prompts=False, grpo=grpo,
        decay_every_parameter=decays_every_parameter(profile), generation=generation)
    names = [f"prompt{i}" for i in range(len(batch.prompts))]
    reward_of = {(names[row // batch.group_size], tuple(batch.responses[row])): batch.rewards[row]
                 for row in range(batch.rows)}

    def fixed_rollouts(prompts, trainer):
        ids = [batch.prompts[names.index(p)] for p in prompts]
        seen: dict[str, int] = {}
        responses = []
        for p in prompts:  # the k-th time a prompt comes is its k-th response
            k = seen[p] = seen.get(p, -1) + 1
            responses.append(batch.responses[names.index(p) * batch.group_size + k])
        return {"prompt_ids": ids, "completion_ids": responses, "logprobs": None}

    def fixed_reward(prompts, completion_ids, **_):
        return [reward_of[(p, tuple(c))] for p, c in zip(prompts, completion_ids)]

    args = GRPOConfig(**trainer_arguments(settings, None))
    rows = datasets.Dataset.from_list([{"prompt": name} for name in names])
    return grpo_trainer_class()(model=model, reward_funcs=fixed_reward, args=args, train_dataset=rows,
                                processing_class=tokenizer, rollout_func=fixed_rollouts,
                                decay_every_parameter=settings.decay_every_parameter, master_weights=master_weights)


def local_inputs(trainer, batch: FixedBatch) -> dict:
    """TRL's own generation-and-scoring step on the fixed rollouts: advantages, masks, token counts."""
    names = [f"prompt{i}" for i in range(len(batch.prompts))]
    trainer.model.train()
    return trainer._generate_and_score_completions([{"prompt": names[row // batch.group_size]}
                                                    for row in range(batch.rows)])


def local_update(trainer, inputs: dict, batch: FixedBatch, advantages: torch.Tensor, rollout: torch.Tensor,
                 reference: torch.Tensor, steps: int) -> Update:
    """TRL's loss on the round's micro batches in order (TRL shuffles them first: the same set), each accumulation
    window one update with the local trainer's token counts (trl_hooks.py `per_update_token_counts`), then the
    Trainer's clipping, optimizer and scheduler steps, `steps` times over (transformers' inner loop's order)."""
    from grpo_pipeline.backends.local.trl_hooks import per_update_token_counts

    model, args = trainer.model, trainer.args
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    update = Update(advantages=inputs["advantages"].detach().clone(), loss=0.0, grads={}, grad_norm=0.0)
    width = inputs["completion_ids"].shape[1]
    given = {"advantages": advantages[:, 0], "old_per_token_logps": rollout[:, :width]}
    if trainer.beta != 0.0:
        given["ref_per_token_logps"] = reference[:, :width]
    round_ = {**inputs, **given}
    micro_batches = [{key: (value[start:start + micro] if torch.is_tensor(value) and value.dim() > 0 else value)
                      for key, value in round_.items()} for start in range(0, batch.rows, micro)]
    assert len(micro_batches) == args.steps_per_generation  # the round TRL would buffer
    if trainer.loss_type == "dapo":
        per_update_token_counts(micro_batches, accumulation, lambda tokens: tokens)
    trainer.current_gradient_accumulation_steps = accumulation
    for step in range(steps):
        for first in range(0, len(micro_batches), accumulation):
            trainer.optimizer.zero_grad()
            loss_sum = 0.0
            for part in micro_batches[first:first + accumulation]:
                loss = trainer._compute_loss(model, part)
                loss.backward()
                loss_sum += loss.item()
            grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            record(update, model, loss_sum, grad_norm, trainer.lr_scheduler.get_last_lr()[0], trainer.optimizer,
                   trainer.lr_scheduler)
    return update


def codetiming_note() -> str | None:
    """Why verl's modules would not import here, in one line (None when they do)."""
    try:
        import_verl()
    except ImportError as exc:  # verl is installed --no-deps; codetiming comes with the dev extra
        return f"verl's actor code does not import here ({exc}); pip install -e '.[dev]'"
    return None

