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
Rollout generation is taken to cost the same for every layout; only the update is ranked.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from grpo_pipeline.planner.activations import recompute
from grpo_pipeline.planner.fsdp import group_size as fsdp_group_size
from grpo_pipeline.planner.memory import GIB, MemoryPlan, estimate
from grpo_pipeline.planner.parallel import Layout, stage_parameters
from grpo_pipeline.profiles.model_size import ModelSize, model_size
from grpo_pipeline.planner.rules import FSDP_DEFAULTS, divisors, MEGATRON_DEFAULTS, UNEVEN_PIPELINE_FIELDS, batch_problems, fsdp_problems, \
    layout_problems, rollout_problems, uneven_split

if TYPE_CHECKING:
    from grpo_pipeline.profiles.platform import Accelerator
    from grpo_pipeline.profiles.schema import RunProfile

MFU = 0.4
# Offload levels, least first: (param_offload, optimizer_offload, megatron-core CPU optimizer).
OFFLOAD_LEVELS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
MICRO_BATCHES = (4, 2, 1)
CONTEXT_PARALLEL = (1, 2, 4, 8)
LONG_CONTEXT_CHUNK = 4096  # CP 4 and 8 only where each rank keeps a chunk of at least this many tokens


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


def with_layout(p: RunProfile, lay: Layout) -> RunProfile:
    """The profile with `lay`'s settings (no validation: the rule functions check it). An FSDP layout
    leaves Megatron's settings at their defaults, a Megatron one FSDP's."""
    prefix = "engine.optimizer_overrides."
    overrides = {**p.engine.optimizer_overrides,
                 **{k.removeprefix(prefix): v for k, v in lay.settings().items() if k.startswith(prefix)}}
    fsdp = lay.strategy == "fsdp"
    engine = p.engine.model_copy(update={"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp,
                                         "param_offload": lay.param_offload, "optimizer_offload": lay.optimizer_offload,
                                         "optimizer_overrides": overrides,
                                         "num_layers_in_first_pipeline_stage": lay.first_stage_layers,
                                         "num_layers_in_last_pipeline_stage": lay.last_stage_layers,
                                         "account_for_embedding_in_pipeline_split": lay.embedding_in_split,
                                         "account_for_loss_in_pipeline_split": lay.loss_in_split,
                                         "strategy": lay.strategy, "fsdp_size": lay.fsdp_size, "ulysses_sp": lay.ulysses_sp,
                                         **(fsdp_engine_settings(lay) if fsdp else FSDP_DEFAULTS)})
    if fsdp:
        engine = engine.model_copy(update={k: v for k, v in MEGATRON_DEFAULTS.items() if k not in ("tp", "pp", "cp", "ep", "etp")})
    update = {"engine": engine, "rollout": p.rollout.model_copy(update={"tp": lay.rollout_tp}),
              "actor": p.actor.model_copy(update={"ppo_micro_batch_size_per_gpu": lay.micro_batch})}
    if fsdp:
        update["model"] = p.model.model_copy(update={"enable_gradient_checkpointing": lay.checkpointing})
    return p.model_copy(update=update)


def fsdp_engine_settings(lay: Layout) -> dict:
    """Ulysses patches only transformers' FlashAttention 2 path (planner/rules.py)."""
    return {"attn_implementation": "flash_attention_2"} if lay.ulysses_sp > 1 else {}


def step_cost(p: RunProfile, size: ModelSize, lay: Layout, spec: Accelerator) -> dict[str, float]:
    """The cost model of the module's docstring, seconds per step by part."""
    if lay.strategy == "fsdp":
        return fsdp_step_cost(p, size, lay, spec)
    arch, c = p.model.architecture, p.cluster
    world, per_node = p.world_size, c.devices_per_node
    tokens = p.data.train_batch_size * p.algorithm.rollout_n * (p.data.max_prompt_length + p.data.max_response_length)
    dp = world // (lay.tp * lay.pp * lay.cp)
    edp = world // (lay.ep * lay.etp * lay.pp)
    recomputed = recompute(p) is not None
    sequences = p.actor.ppo_mini_batch_size * p.algorithm.rollout_n / dp
    m = max(sequences / lay.micro_batch, 1)
    compute = (8 if recomputed else 6) * size.active * tokens / (world * spec.bf16_tflops * 1e12 * MFU)
    cost = {"compute": compute, "bubble": compute * (lay.pp - 1) / m}
    link, network, host = spec.link_gb_s * 1e9, spec.network_gb_s * 1e9, spec.host_gb_s * 1e9
    replica_tokens = tokens / dp
    layers = arch.num_layers / lay.pp
    cost["tensor parallel"] = (replica_tokens * layers * (12 if recomputed else 8) * 2 * arch.hidden_size
                               * (lay.tp - 1) / lay.tp / link)
    if arch.num_experts:
        device_tokens = replica_tokens / (lay.tp * lay.cp)
        bandwidth = link if lay.ep * lay.etp <= per_node else network  # expert ranks are contiguous
        cost["expert parallel"] = (device_tokens * layers * 4 * (arch.num_experts_per_tok or 1) * arch.hidden_size * 2
                                   * (lay.ep - 1) / lay.ep / bandwidth)
    if lay.cp > 1:  # ring attention passes each chunk's keys and values around, and their gradients back
        kv = 2 * arch.num_kv_heads * (arch.head_dim or arch.hidden_size // arch.num_attention_heads) * 2
        cost["context parallel"] = (replica_tokens / lay.tp * size.attention_layers / lay.pp * 3 * kv
                                    * (lay.cp - 1) / lay.cp / link)
    dense, experts = stage_parameters(size, lay, p)
    stage_ranks = world // lay.pp
    dp_bandwidth = network if stage_ranks > per_node else link
    cost["data parallel"] = 6 * (dense * (dp - 1) / dp + experts * (edp - 1) / edp) / dp_bandwidth
    cost["pipeline"] = (2 * replica_tokens * arch.hidden_size * 2 / (lay.tp * lay.cp) / (network if world > per_node else link)
                        if lay.pp > 1 else 0.0)
    params = dense + experts
    moved = (2 * 6 * params if lay.param_offload else 0.0)
    if lay.optimizer_cpu_offload:
        moved += 6 * params  # gradients down, updated parameters up; Adam itself runs on the host
    elif lay.optimizer_offload:
        moved += 2 * 12 * (dense / dp + experts / edp)
    cost["offload"] = moved / host
    return cost


def fsdp_step_cost(p: RunProfile, size: ModelSize, lay: Layout, spec: Accelerator) -> dict[str, float]:
    """FSDP2's step: the same compute; per micro batch, each parameter gathered in bf16 for the forward
    and again for the backward and its gradient reduce-scattered in fp32 (verl syncs every micro batch),
    over the node's links when the group stays in a node; across groups (hybrid sharding), the shard's
    gradients all-reduced over the network; Ulysses' all-to-alls (4 a layer forward, 4 backward)."""
    arch, per_node, world = p.model.architecture, p.cluster.devices_per_node, p.world_size
    length = p.data.max_prompt_length + p.data.max_response_length
    tokens = p.data.train_batch_size * p.algorithm.rollout_n * length
    group = fsdp_group_size(world, lay.fsdp_size)
    dp = world // lay.ulysses_sp
    compute = (8 if lay.checkpointing else 6) * size.active * tokens / (world * spec.bf16_tflops * 1e12 * MFU)
    link, network, host = spec.link_gb_s * 1e9, spec.network_gb_s * 1e9, spec.host_gb_s * 1e9
    rank_tokens = tokens / dp
    if p.actor.use_dynamic_bsz:
        micro_batches = max(rank_tokens / lay.ulysses_sp / p.actor.ppo_max_token_len_per_gpu, 1)
    else:
        micro_batches = max(p.data.train_batch_size * p.algorithm.rollout_n / dp / lay.micro_batch, 1)
    gather = (2 + 2 + 4) * size.total * (group - 1) / group * micro_batches
    cost = {"compute": compute, "data parallel": gather / (link if group <= per_node else network)}
    if world > group:
        replicas = world // group
        cost["data parallel"] += 2 * 4 * size.total / group * (replicas - 1) / replicas / network
    if lay.ulysses_sp > 1:
        cost["sequence parallel"] = (8 * rank_tokens / lay.ulysses_sp * arch.num_layers * arch.hidden_size * 2
                                     * (lay.ulysses_sp - 1) / lay.ulysses_sp / link)
    moved = (2 * 4 * size.total / group if lay.param_offload else 0.0) + (2 * 8 * size.total / group if lay.optimizer_offload else 0.0)
    cost["offload"] = moved / host
    return cost


def fsdp_layouts(p: RunProfile) -> list[Layout]:
    """FSDP2 layouts of a dense model: the group over the world or one node, Ulysses where a sequence
    leaves each rank LONG_CONTEXT_CHUNK tokens or more, with and without gradient checkpointing."""
    arch, world, per_node = p.model.architecture, p.world_size, p.cluster.devices_per_node
    if arch.num_experts or p.model.dist_checkpoint:  # MoE stays Megatron's (expert parallelism)
        return []
    length = p.data.max_prompt_length + p.data.max_response_length
    groups = [-1] + ([per_node] if world > per_node else [])
    sps = [sp for sp in divisors(per_node) if sp == 1 or length / sp >= LONG_CONTEXT_CHUNK]
    out = []
    for group, sp, checkpointing in itertools.product(groups, sps, (False, True)):
        lay = Layout(1, 1, 1, 1, 1, 1, False, False, False, 1, strategy="fsdp", fsdp_size=group, ulysses_sp=sp,
                     checkpointing=checkpointing)
        if not fsdp_problems(with_layout(p, lay)):
            out.append(lay)
    return out


def candidate_layouts(p: RunProfile) -> list[Layout]:
    """Layouts (TP, PP with its stage split, CP, EP, ETP) that pass the layout rules (rollout and batches
    are checked per layout)."""
    arch, world, per_node = p.model.architecture, p.world_size, p.cluster.devices_per_node
    out = []
    pipelines = [pp for pp in divisors(world) if pp <= arch.num_layers]
    length = p.data.max_prompt_length + p.data.max_response_length
    contexts = [cp for cp in CONTEXT_PARALLEL if cp <= 2 or length / cp >= LONG_CONTEXT_CHUNK]
    for tp, pp, cp in itertools.product(divisors(per_node), pipelines, contexts):
        if world % (tp * pp * cp):
            continue
        first, last = (None, None) if arch.num_layers % pp == 0 else (uneven_split(arch.num_layers, pp) or (None, None))
        for ep in (divisors(arch.num_experts) if arch.num_experts else [1]):
            for etp in sorted({1, tp}) if arch.num_experts else [1]:
                lay = Layout(tp, pp, cp, ep, etp, 1, False, False, False, 1, first, last)
                if not layout_problems(with_layout(p, lay)):
                    out.append(lay)
    return out + fsdp_layouts(p)


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
        levels = OFFLOAD_LEVELS[:3] if candidate.strategy == "fsdp" else OFFLOAD_LEVELS  # no CPU Adam in FSDP
        for param_off, opt_off, cpu_off in levels:  # the least offloading under which some micro batch fits
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
    if lay.strategy == "fsdp":
        return "fsdp", lay.fsdp_size, lay.ulysses_sp, lay.checkpointing
    return lay.tp, lay.pp, lay.cp, lay.ep, lay.etp


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
        lay = s.layout
        offload = "+".join(name for name, on in (("params", lay.param_offload), ("optimizer", lay.optimizer_offload),
                                                 ("cpu-adam", lay.optimizer_cpu_offload)) if on) or "none"
        pp = f"{lay.pp} ({lay.first_stage_layers}/../{lay.last_stage_layers})" if lay.first_stage_layers else lay.pp
        dims = " | ".join(["-"] * 5) if lay.strategy == "fsdp" else f"{lay.tp} | {pp} | {lay.cp} | {lay.ep} | {lay.etp}"
        lines.append(f"| {rank} | {_engine(lay)} | {dims} | {lay.rollout_tp} | {offload} | {lay.micro_batch} | "
                     f"{s.actor_gib()} | {s.seconds:.2f} |")
    mine = Layout.of(p)
    own = parallel_dims(mine)
    rank = next((i for i, s in enumerate(suggestions, 1) if parallel_dims(s.layout) == own), None)
    shown = _engine(mine) if mine.strategy == "fsdp" else f"TP {own[0]} PP {own[1]} CP {own[2]} EP {own[3]} ETP {own[4]}"
    lines.append(f"the profile's layout ({shown}): " + (f"fits, rank {rank} of {len(suggestions)}" if rank else
                                                       "does not fit or does not validate here"))
    if suggestions:
        best_layout = suggestions[0].layout
        settings = best_layout.settings()
        # What the profile sets that the cheapest layout's engine would refuse goes back to its default on the
        # same line: Megatron's settings under FSDP, FSDP's under Megatron, an uneven split the layout lacks.
        resets = dict(MEGATRON_DEFAULTS) if best_layout.strategy == "fsdp" else {"strategy": "megatron", **FSDP_DEFAULTS}
        resets.update({name: None if name.endswith("stage") else False for name in UNEVEN_PIPELINE_FIELDS})
        settings.update({f"engine.{name}": value for name, value in resets.items()
                         if f"engine.{name}" not in settings and getattr(p.engine, name) != value})
        lines.append("best: " + " ".join(f"--set {k}={_value(v)}" for k, v in settings.items()))
    return lines


def _engine(lay: Layout) -> str:
    if lay.strategy != "fsdp":
        return "megatron"
    group = "world" if lay.fsdp_size < 0 else lay.fsdp_size
    return f"fsdp (group {group}, Ulysses {lay.ulysses_sp}, checkpointing {'on' if lay.checkpointing else 'off'})"


def _value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return "{}" if value == {} else str(value)
