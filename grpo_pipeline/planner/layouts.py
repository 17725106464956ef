"""Layouts that fit: for a model, a device kind and a device count, every parallel layout that passes
validation and the memory plan, ranked by a simple cost model.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --suggest-layout --set cluster.nnodes=2

Searched: TP (within a node, dividing the heads), PP (dividing the world; where it does not divide the
layers, uneven first and last stages as megatron-core allows, the fullest stage as small as it can be:
94 layers over 8 stages as 11 + 6 x 12 + 11), CP 1 or 2 (4 and 8 where a sequence leaves each CP rank
4096 tokens or more), EP (dividing the experts and a stage's ranks), ETP 1 or TP, and for each such
layout the least offloading (none; parameters; parameters and optimizer; and megatron-core's CPU
optimizer) under which every role fits with some micro batch of 4, 2 or 1, and of those the cheapest,
with the smallest rollout TP within a node whose KV cache holds `rollout.max_num_seqs` sequences (else
the smallest that fits at all; an engine over whole nodes only when none within one fits).

The cost model, seconds per training step on the fullest device, is deliberately simple:
- compute: (6, or 8 with full recompute) x active parameters x tokens of a step, over the world's
  bf16 peak at 40% utilisation, stretched by the 1F1B pipeline bubble (m + PP - 1) / m for m micro
  batches per data-parallel rank;
- context parallel: keys and values of the full-attention layers passed around the ring, 3 times;
- tensor parallel: 8 (12 with recompute) sequence-parallel collectives of a token's hidden state per
  layer, (TP-1)/TP of it over the node's links;
- expert parallel: 4 all-to-alls (dispatch, combine; forward, backward) of each token's top-k copies,
  (EP-1)/EP of it, over the links when the group stays in a node, else the network;
- data parallel: the distributed optimizer's reduce-scatter of fp32 gradients and all-gather of bf16
  parameters, (DP-1)/DP of them, over the network when the group spans nodes;
- offload: what each step moves to the host and back, over the host link.
Rollout generation is taken to cost the same for every layout; only the update is ranked. Each engine's
part (its layouts, its cost) is its plan's (planner/engines.py): Megatron's in planner/memory.py, FSDP2's in
planner/fsdp.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from grpo_pipeline.planner.engines import layout_settings, plan_of, with_layout
from grpo_pipeline.planner.memory import GIB, MemoryPlan, estimate
from grpo_pipeline.planner.parallel import Layout
from grpo_pipeline.planner.rules import divisors, batch_problems, rollout_problems
from grpo_pipeline.profiles.engine import ENGINES
from grpo_pipeline.profiles.model_size import ModelSize, model_size

if TYPE_CHECKING:
    from grpo_pipeline.profiles.platform import Accelerator
    from grpo_pipeline.profiles.schema import RunProfile

MICRO_BATCHES = (4, 2, 1)

__all__ = ["Suggestion", "candidate_layouts", "parallel_dims", "suggest_layouts", "suggestion_table", "with_layout"]


@dataclass
class Suggestion:
    layout: Layout
    plan: MemoryPlan
    cost: dict[str, float]  # seconds per step by part

    @property
    def seconds(self) -> float:
        return sum(self.cost.values())

    def actor_gib(self) -> float:
        return round(self.plan.roles[0].total / GIB, 1)

    def settings(self) -> dict[str, object]:
        """The profile keys that make this layout (`--set` them)."""
        return layout_settings(self.layout)


def step_cost(p: RunProfile, size: ModelSize, lay: Layout, spec: Accelerator) -> dict[str, float]:
    """The cost model of the module's docstring, seconds per step by part (the layout's engine's)."""
    return plan_of(lay.strategy).step_cost(p, size, lay, spec)


def candidate_layouts(p: RunProfile) -> list[Layout]:
    """Every engine's layouts that pass its layout rules (rollout and batches are checked per layout): Megatron's
    (TP, PP with its stage split, CP, EP, ETP), then FSDP2's."""
    return [lay for strategy in ENGINES for lay in plan_of(strategy).layouts(p)]  # the profile's order of engines


def suggest_layouts(p: RunProfile) -> tuple[list[Suggestion], dict[str, float]]:
    """Every layout that fits, cheapest first, and what the search looked at."""
    started = time.perf_counter()
    size = model_size(p.model.architecture)
    name, spec = p.platform.accelerator_for()
    if spec is None:
        raise ValueError(f"platform.accelerator {name!r} has no row in platform.accelerators; the cost model needs one")
    # Within a node, or over whole nodes (verl spans an engine over nodes when its TP is larger than one).
    rollout_tps = [t for t in divisors(p.world_size)
                   if not rollout_problems(with_layout(p, replace(Layout.of(p), rollout_tp=t)))]
    found: list[Suggestion] = []
    layouts = candidate_layouts(p)
    estimates = 0
    for candidate in layouts:
        for param_off, opt_off, cpu_off in plan_of(candidate.strategy).offload_levels:  # the least under which some micro batch fits
            fitting = []
            for micro in MICRO_BATCHES:
                lay = replace(candidate, rollout_tp=rollout_tps[0] if rollout_tps else p.rollout.tp,
                              param_offload=param_off, optimizer_offload=opt_off, optimizer_cpu_offload=cpu_off,
                              micro_batch=micro)
                if batch_problems(with_layout(p, lay), p.world_size // (lay.tp * lay.pp * lay.cp * lay.ulysses_sp)):
                    continue
                estimates += 1
                if not all(role.fits for role in estimate(p, lay, size=size).roles if role.role != "rollout"):
                    continue
                if (chosen := _with_rollout(p, lay, rollout_tps, size)) is not None:
                    fitting.append(Suggestion(chosen[0], chosen[1], step_cost(p, size, chosen[0], spec)))
            if fitting:
                found.append(min(fitting, key=lambda s: s.seconds))
                break
    found.sort(key=lambda s: s.seconds)
    facts = {"layouts": len(layouts), "estimates": estimates, "fit": len(found),
             "seconds": time.perf_counter() - started}
    return found, facts


def _with_rollout(p: RunProfile, lay: Layout, rollout_tps: list[int], size: ModelSize) -> tuple[Layout, MemoryPlan] | None:
    """The smallest rollout TP within a node whose KV cache holds max_num_seqs sequences, else the smallest
    within a node that fits; an engine over several nodes only when none within one fits."""
    per_node = p.cluster.devices_per_node
    for tier in ([t for t in rollout_tps if t <= per_node], [t for t in rollout_tps if t > per_node]):
        fitting = []
        for rtp in tier:
            plan = estimate(p, replace(lay, rollout_tp=rtp), size=size)
            if plan.fits:
                if plan.kv_sequences >= p.rollout.max_num_seqs:
                    return replace(lay, rollout_tp=rtp), plan
                fitting.append((replace(lay, rollout_tp=rtp), plan))
        if fitting:
            return fitting[0]
    return None


def parallel_dims(lay: Layout) -> tuple:
    """What tells layouts apart in the table: the engine and its parallel sizes."""
    return plan_of(lay.strategy).dims(lay)


def suggestion_table(suggestions: list[Suggestion], facts: dict[str, float], p: RunProfile, limit: int = 10) -> list[str]:
    """The `limit` cheapest layouts as Markdown, where the profile's own layout ranks, and the `--set`
    line of the cheapest."""
    c = p.cluster
    head = (f"{p.model.name} on {c.nnodes} x {c.devices_per_node} {p.platform.accelerator or p.platform.kind}: "
            f"{facts['fit']} of {facts['layouts']} valid layouts fit ({facts['estimates']} estimates, "
            f"{facts['seconds'] * 1000:.0f} ms); cost model: planner/layouts.py")
    lines = [head, "| rank | engine | TP | PP | CP | EP | ETP | rollout TP | offload | micro batch | actor GiB | step s (model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rank, s in enumerate(suggestions[:limit], 1):
        lay, plan = s.layout, plan_of(s.layout.strategy)
        offload = "+".join(name for name, on in (("params", lay.param_offload), ("optimizer", lay.optimizer_offload),
                                                 ("cpu-adam", lay.optimizer_cpu_offload)) if on) or "none"
        lines.append(f"| {rank} | {plan.label(lay)} | {plan.columns(lay)} | {lay.rollout_tp} | {offload} | {lay.micro_batch} | "
                     f"{s.actor_gib()} | {s.seconds:.2f} |")
    mine = Layout.of(p)
    own = parallel_dims(mine)
    rank = next((i for i, s in enumerate(suggestions, 1) if parallel_dims(s.layout) == own), None)
    lines.append(f"the profile's layout ({plan_of(mine.strategy).shown(mine)}): " + (
        f"fits, rank {rank} of {len(suggestions)}" if rank else "does not fit or does not validate here"))
    if suggestions:
        best_layout = suggestions[0].layout
        settings = layout_settings(best_layout)
        # What the profile sets that the cheapest layout's engine would refuse goes back to its default on the
        # same line: Megatron's settings under FSDP, FSDP's under Megatron, an uneven split the layout lacks.
        resets = plan_of(best_layout.strategy).resets(p.engine)
        settings.update({f"engine.{name}": value for name, value in resets.items() if f"engine.{name}" not in settings})
        lines.append("best: " + " ".join(f"--set {k}={_value(v)}" for k, v in settings.items()))
    return lines


def _value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return "{}" if value == {} else str(value)
