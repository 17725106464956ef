"""A parallel layout, and what each of its pipeline stages holds on one device: its decoder layers
and its parameters, split by TP (what TP shards) and by EP x ETP (routed experts).

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --suggest-layout   # layouts, uneven stages included

Stages are megatron-core's (planner/rules.py `pipeline_split`: even, uneven first/last stages, or
the embedding and loss counted as layers); the first holds the embedding (and a vision tower), the last
the output layer (a copy of a tied embedding) and, when trained, the MTP layers. What megatron-core keeps
whole on every TP rank (norms, the router) is not divided by TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_pipeline.planner.rules import pipeline_split

if TYPE_CHECKING:
    from grpo_pipeline.profiles.model_size import ModelSize
    from grpo_pipeline.profiles.schema import RunProfile


@dataclass(frozen=True)
class Layout:
    """What a layout search varies; the rest of a run comes from its profile."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    rollout_tp: int
    param_offload: bool
    optimizer_offload: bool
    optimizer_cpu_offload: bool  # megatron-core's CPU optimizer (engine.optimizer_overrides)
    micro_batch: int
    first_stage_layers: int | None = None  # uneven pipeline stages (engine.num_layers_in_*_pipeline_stage)
    last_stage_layers: int | None = None
    embedding_in_split: bool = False  # engine.account_for_embedding/loss_in_pipeline_split
    loss_in_split: bool = False
    strategy: str = "megatron"  # engine.strategy (its plan: planner/engines.py); with fsdp, tp ... etp are 1 and these three matter:
    fsdp_size: int = -1  # engine.fsdp_size (-1: the world)
    ulysses_sp: int = 1  # engine.ulysses_sp
    checkpointing: bool = True  # model.enable_gradient_checkpointing (FSDP; Megatron recomputes by its overrides)

    @classmethod
    def of(cls, p: RunProfile) -> Layout:
        e = p.engine
        return cls(rollout_tp=p.rollout.tp, param_offload=e.param_offload, optimizer_offload=e.optimizer_offload,
                   micro_batch=p.actor.ppo_micro_batch_size_per_gpu, strategy=e.strategy,
                   checkpointing=p.model.enable_gradient_checkpointing, **e.layout_fields())


@dataclass(frozen=True)
class Stage:
    """One pipeline stage on one device: its decoder layers, and its parameters split by TP (dense)
    and by EP x ETP (routed experts)."""

    index: int
    layers: range
    dense: float
    experts: float
    mtp: bool  # holds the multi-token-prediction layers (the last stage, when trained)


def stages(p: RunProfile, size: ModelSize, lay: Layout) -> list[Stage]:
    """Every pipeline stage of the layout (an invalid split, which validation refuses, is taken as even)."""
    split, _ = pipeline_split(size.num_layers, lay.pp, p.engine.vpp, lay.first_stage_layers, lay.last_stage_layers,
                              lay.embedding_in_split, lay.loss_in_split)
    if not split:
        split = [size.num_layers // lay.pp + (r < size.num_layers % lay.pp) for r in range(lay.pp)]
    mtp = p.engine.mtp and size.mtp_layers > 0
    out, start = [], 0
    for r, count in enumerate(split):
        split_by_tp, whole, experts = size.layers_in(start, start + count)
        last = r == lay.pp - 1
        if r == 0:
            split_by_tp += size.embedding + size.vision  # the vision tower is built with the first stage (taken as split by TP)
        if last:  # a tied output layer is a copy of the embedding on the last stage
            split_by_tp += size.output or (size.embedding if lay.pp > 1 else 0)
            whole += size.final_norm
            if mtp:  # the MTP block: its layer split as the others (a few norms counted with the split part)
                split_by_tp += size.mtp_layers * (size.mtp_layer - size.experts)
                experts += size.mtp_layers * size.experts
        out.append(Stage(r, range(start, start + count), split_by_tp / lay.tp + whole, experts / (lay.ep * lay.etp),
                         mtp and last))
        start += count
    return out


def stage_parameters(size: ModelSize, lay: Layout, p: RunProfile) -> tuple[float, float]:
    """(dense, expert) parameters on one device of the stage that holds the most."""
    fullest = max(stages(p, size, lay), key=lambda s: s.dense + s.experts)
    return fullest.dense, fullest.experts
