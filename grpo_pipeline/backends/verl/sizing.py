"""A verl run sized by the planner for the devices found: what users otherwise guess, from the memory plan.

    python -m grpo_pipeline --model /models/Qwen3-8B --device auto --backend verl --set lora.rank=16 --dry-run

On a host whose devices were counted (`VerlBackend.detected_layer`), from the engine's memory plan
(planner/memory.py, planner/fsdp.py: each role's peak on one device), in this order:
- the update: gradient checkpointing off wherever some micro batch fits without it (where the engine's plan
  counts it: FSDP; Megatron recomputes by its own overrides), on otherwise; and the largest micro batch
  (`actor.ppo_micro_batch_size_per_gpu`, or with dynamic batches the token budget
  `actor.ppo_max_token_len_per_gpu` in whole sequences) that verl accepts for the batch (planner/rules.py) and
  whose update, optimizer step and log-prob rows fit;
- the log-prob passes (old policy, reference): the largest micro batch (or token budget) that fits;
- offload (`engine.param_offload`, `engine.optimizer_offload`) only where vLLM could not start beside what
  the trainer keeps resident (verl loads an offloaded actor back for its update: offload frees no update memory);
- vLLM's share of the device (`rollout.gpu_memory_utilization`): the largest, up to vLLM's own default 0.9,
  that still starts beside what the trainer keeps resident: the rest is its KV cache;
- `rollout.max_num_seqs`: the sequences one rollout engine generates per step, or fewer where its KV cache
  holds fewer (vLLM would queue and preempt the rest), which also shrinks the sampler's buffers.
A setting that a recipe, a profile file or --set gives wins, and the rest is decided around it. The dry run's
memory plan names each setting, the planner's choice and why (`sizing_notes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from grpo_pipeline.planner.memory import plan_for
from grpo_pipeline.planner.roles import HEADROOM, MemoryPlan, largest_batch_row, largest_batch_table, largest_fitting
from grpo_pipeline.planner.rules import divisors
from grpo_pipeline.profiles.schema import RunProfile

VLLM_MAX_SHARE = 0.9  # vLLM's own default gpu_memory_utilization: above it, fragmentation and the runtime's own
SHARE_STEP = 0.01
TRAINER_ROLES = ("actor", "reference")
CHECKPOINTING = "model.enable_gradient_checkpointing"
OFFLOAD = ("engine.param_offload", "engine.optimizer_offload")
SHARE, SEQS = "rollout.gpu_memory_utilization", "rollout.max_num_seqs"


@dataclass
class Choice:
    """One setting the planner decided (or was given), with why."""

    key: str
    value: Any
    why: str
    given: bool = False


@dataclass
class RunSizing:
    choices: list[Choice] = field(default_factory=list)

    @property
    def layer(self) -> dict:
        """The detected layer: what the planner chose (a given setting is above the layer anyway)."""
        layer: dict = {}
        for choice in self.choices:
            if not choice.given:
                section, name = choice.key.split(".", 1)
                layer.setdefault(section, {})[name] = choice.value
        return layer


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_settings(p: RunProfile, settings: dict[str, Any]) -> RunProfile:
    """`p` with dotted `section.field` settings replaced (no validation: the planner's own candidates)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return p.model_copy(update={s: getattr(p, s).model_copy(update=values) for s, values in sections.items()})


class _Search:
    """The profile being sized, the detected devices and what is given."""

    def __init__(self, p: RunProfile, names: list[str] | None, gib: list[float] | None, given: frozenset[str],
                 problems: Callable[[RunProfile], list[str]]):
        self.p, self.names, self.gib, self.given = p, names, gib, given
        # A candidate is refused for what it adds to the profile's own problems (those are refused elsewhere).
        self.base, self.problems = set(problems(p)), problems
        self.sizing = RunSizing()
        self.spare = HEADROOM

    def plan(self, p: RunProfile | None = None) -> MemoryPlan | None:
        return plan_for(p or self.p, self.names, self.gib)

    def fits(self, p: RunProfile, roles: tuple[str, ...]) -> bool:
        """Rows `roles` fit with `self.spare` of the device to spare."""
        plan = self.plan(p)
        if plan is None:
            return False
        spare = self.spare * (plan.device_memory or 0)
        return all(r.capacity is None or r.total <= r.capacity - spare for r in plan.roles if r.role in roles)

    def decide(self, key: str, value: Any, why: str) -> None:
        if key in self.given:
            value = self._value(key)
            why = f"given; {why}"
        self.p = with_settings(self.p, {key: value})
        self.sizing.choices.append(Choice(key, value, why, key in self.given))

    def _value(self, key: str) -> Any:
        return _value(self.p, key)

    def largest(self, key: str, candidates: list[int], roles: tuple[str, ...], extra: dict | None = None) -> int | None:
        """The largest candidate (ascending; the peak grows with it) whose rows `roles` fit."""
        best = None
        for value in candidates:
            trial = with_settings(self.p, {**(extra or {}), key: value})
            if set(self.problems(trial)) - self.base or not self.fits(trial, roles):
                if best is not None:
                    break
                continue
            best = value
        return best


def _micro_batch(s: _Search, dynamic: bool, micro_key: str, budget_key: str, sequences: int) -> tuple[str, list[int]]:
    """The setting that bounds a pass's micro batch and its candidates: whole sequences (the divisors of the
    pass's sequences, so every rank's share splits evenly) or, with dynamic batches, their tokens."""
    if dynamic:
        length = s.p.data.max_prompt_length + s.p.data.max_response_length
        return budget_key, [k * length for k in range(1, max(sequences, 1) + 1)]
    return micro_key, divisors(max(sequences, 1))


def size_verl_run(p: RunProfile, names: list[str] | None, gib: list[float] | None, given: frozenset[str],
                  problems: Callable[[RunProfile], list[str]]) -> RunSizing | None:
    """The planner's settings for this run on the devices found (see the module); None where the model cannot
    be sized or the device's memory is unknown."""
    s = _Search(p, names, gib, given, problems)
    first = s.plan()
    if first is None or first.device_memory is None:
        return None
    sequences = p.sequences_per_step
    update_key, update_candidates = _micro_batch(s, p.actor.use_dynamic_bsz, "actor.ppo_micro_batch_size_per_gpu",
                                                 "actor.ppo_max_token_len_per_gpu", p.sequences_per_update)
    lp_key, lp_candidates = _micro_batch(s, p.log_prob.use_dynamic_bsz, "log_prob.micro_batch_size_per_gpu",
                                         "log_prob.max_token_len_per_gpu", sequences)
    smallest_lp = {lp_key: lp_candidates[0]} if lp_key not in given else {}

    def update_sizes() -> tuple[bool, int] | None:
        """(checkpointing, micro batch) of the update: checkpointing only where the plan counts it and needs it."""
        modes = [s.p.model.enable_gradient_checkpointing] if CHECKPOINTING in given else [False, True]
        counted = s.plan(with_settings(s.p, {CHECKPOINTING: False})).roles[0].total != \
            s.plan(with_settings(s.p, {CHECKPOINTING: True})).roles[0].total
        if not counted:
            modes = [s.p.model.enable_gradient_checkpointing]
        for checkpointing in modes:
            extra = {**smallest_lp, CHECKPOINTING: checkpointing}
            candidates = [s._value(update_key)] if update_key in given else update_candidates
            if (micro := s.largest(update_key, candidates, TRAINER_ROLES, extra)) is not None:
                return checkpointing, micro
        return None

    found = update_sizes()
    edge = ""
    if found is None:  # what no micro batch changes (the weights, Adam's state) leaves less than the spare
        s.spare, edge = 0.0, f" (within the estimate: without the {HEADROOM:.0%} of the device kept spare elsewhere)"
        if (found := update_sizes()) is None:
            return s.sizing  # not one sequence fits: the plan's refusal says what does not, with its fix
    checkpointing, micro = found
    s.decide(CHECKPOINTING, checkpointing, ("some micro batch fits without recomputation" if not checkpointing else
             "no micro batch fits without recomputing each layer in backward") + edge)
    s.decide(update_key, micro, f"the largest that fits the update, of {_range(update_candidates)}{edge}")
    lp = s.largest(lp_key, [s._value(lp_key)] if lp_key in given else lp_candidates, TRAINER_ROLES)
    if lp is not None:
        s.decide(lp_key, lp, f"the largest that fits the log-prob passes, of {_range(lp_candidates)}{edge}")
    _size_rollout(s, sequences)
    return s.sizing


def _free_share(s: _Search, needed: int) -> tuple[float, float] | None:
    """(the share of the device vLLM can take beside what the trainer keeps resident, with the spare; the share its
    weights, working memory and one sequence's cache need), or None where the plan has no rollout rows."""
    plan = s.plan(with_settings(s.p, {SEQS: min(needed, s.p.rollout.max_num_seqs)}))
    rows = {next(iter(r.parts)): r for r in plan.roles if r.role == "rollout"} if plan else {}
    start, cache = rows.get("vLLM share"), rows.get("weights")
    if start is None or cache is None or start.capacity is None:
        return None
    device = plan.device_memory
    return (start.capacity - s.spare * device - start.parts["trainer resident"]) / device, cache.total / device


def _size_rollout(s: _Search, sequences: int) -> None:
    """vLLM's share: the largest that starts beside the trainer's resident state, offloading that state only where
    vLLM could not start otherwise; its concurrent sequences: one engine's share of the step, or what its KV cache
    holds."""
    p = s.p
    engines = max(p.world_size // p.rollout.tp, 1)
    needed = -(-sequences // engines)
    if SHARE not in s.given and (shares := _free_share(s, needed)):
        free, least = shares
        if not set(OFFLOAD) & s.given:  # decided from nothing offloaded: the same profile sizes the same again
            kept = s.p
            s.p = with_settings(kept, dict.fromkeys(OFFLOAD, False))
            free, least = _free_share(s, needed) or shares
            offload = False
            if free < least:
                s.p = with_settings(kept, dict.fromkeys(OFFLOAD, True))
                offloaded = _free_share(s, needed)
                offload = bool(offloaded and offloaded[0] >= offloaded[1])
                free = offloaded[0] if offload else free
            for key in OFFLOAD:
                s.decide(key, offload, "vLLM cannot start beside the actor's resident weights and Adam's state: they "
                         "wait on the host while it generates" if offload else "vLLM starts beside what the trainer "
                         "keeps resident: nothing is offloaded")
        share = min(math.floor(free / SHARE_STEP) * SHARE_STEP, VLLM_MAX_SHARE)
        if share >= least:  # otherwise the plan's refusal says what does not fit, with its fix
            s.decide(SHARE, round(share, 2), f"the largest share up to vLLM's default {VLLM_MAX_SHARE} that starts "
                     "beside what the trainer keeps resident; the rest of it is the KV cache")
    seqs = needed if SEQS not in s.given else s._value(SEQS)
    for _ in range(2):  # the sampler's buffers shrink with max_num_seqs, and the cache then holds a few more
        plan = s.plan(with_settings(s.p, {SEQS: seqs}))
        if plan is None or not plan.kv_sequences or seqs <= plan.kv_sequences or SEQS in s.given:
            break
        seqs = max(plan.kv_sequences, 1)
    held = f"its KV cache holds {plan.kv_sequences}" if plan else "its KV cache is not estimated"
    s.decide(SEQS, seqs, f"{needed} sequences per rollout engine per step ({sequences} over {engines} engine(s)); {held}")


def _range(candidates: list[int]) -> str:
    return ", ".join(map(str, candidates)) if len(candidates) <= 8 else f"{', '.join(map(str, candidates[:3]))} ... {candidates[-1]}"


def sizing_notes(p: RunProfile, free: RunSizing) -> list[str]:
    """The memory plan's notes on the sized settings: the profile's value beside the planner's own choice `free`
    (nothing given) and why."""
    notes = []
    for choice in free.choices:
        value = _value(p, choice.key)
        if value == choice.value:
            notes.append(f"planner: {choice.key}={_shown(value)}: {choice.why}")
        else:
            notes.append(f"{choice.key}={_shown(value)}, as a recipe, a profile file or --set has it; the planner would "
                         f"choose {_shown(choice.value)}: {choice.why}")
    return notes


def _value(p: RunProfile, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(p, section), name)


def one_device_table(p: RunProfile) -> tuple[dict, list[str]] | None:
    """`--suggest-layout --backend verl` for one device: the largest update micro batch that fits, full training and
    LoRA (the profile's rank, else 16), gradient checkpointing off and on, at the profile's lengths (the log-prob
    passes at micro batch 1); as JSON (`refusal` when not one sequence fits) and as the lines printed. None on
    more devices: the layout search answers."""
    if p.world_size != 1:
        return None
    name, memory_gib, source = p.platform.device_memory()
    if memory_gib is None:
        return {"refusal": f"--suggest-layout needs the device's memory ({source})"}, []
    rank, rows = p.lora.rank or 16, []
    for label, trained_rank in (("full", 0), (f"LoRA r{rank}", rank)):
        trained = with_settings(p, {"lora.rank": trained_rank, "actor.use_dynamic_bsz": False,
                                    "log_prob.micro_batch_size_per_gpu": 1})
        search = _Search(trained, None, None, frozenset(), lambda _: [])
        for checkpointing in (False, True):
            def sized(m: int) -> RunProfile:
                return with_settings(trained, {CHECKPOINTING: checkpointing, "actor.ppo_micro_batch_size_per_gpu": m})

            largest = largest_fitting(lambda m: search.fits(sized(m), TRAINER_ROLES))
            rows.append(largest_batch_row(label, checkpointing, largest,
                                          search.plan(sized(largest)).roles[0].total if largest else None))
    tokens = p.data.max_prompt_length + p.data.max_response_length
    device = f"{memory_gib:.1f} GiB {name} ({source}), {HEADROOM:.0%} kept spare"
    return largest_batch_table(
        f"# verl ({p.engine.strategy}): the largest micro batch of {tokens}-token sequences one device's update fits: "
        f"{device}", "update", device, tokens, rows,
        f"not one sequence of {p.model.name} fits one {name} device in verl's update, even as LoRA with gradient "
        "checkpointing; lower data.max_response_length, or add devices (--set cluster.devices_per_node=N: the layout "
        "search answers)")
