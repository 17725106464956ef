"""Will the layout fit? Device memory per role of a verl run, estimated from the profile alone
(Megatron here; `engine.strategy: fsdp` is planner/fsdp.py's).

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run          # the table
    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run --json   # "memory": {...}

verl colocates its roles on every device and runs them in turn, so each is checked at its own peak
with what the other roles leave resident then, on the fullest pipeline stage (stages hold their own
layers, uneven ones included; the first the embedding and a vision tower, the last the output layer,
the logits and any MTP layers; 1F1B keeps min(PP - stage, micro batches) micro batches in flight):
- actor, update: megatron-core's training step: bf16 parameters, fp32 gradients (verl's
  grad_reduce_in_fp32), Adam's state sharded over the data-parallel ranks (the distributed optimizer),
  the activations of the micro batches in flight under the recompute settings, and the logits of the
  vocabulary-parallel loss (planner/activations.py). verl loads offloaded parameters back for it.
  Megatron's CPU optimizer (`optimizer_cpu_offload` x `optimizer_offload_fraction` f) keeps Adam's
  moments and master weights on the host, except that without the precision-aware optimizer the fp32
  master stays on the device: 4 + 8 (1 - f) bytes per parameter of the shard (12 (1 - f) with it); the
  host holds 16 f (with a pinned fp32 gradient copy).
- actor, optimizer step: the same state plus the step's temporaries: none for a fused Adam (TE/apex
  FusedAdam), +4 bytes per parameter of the shard for torch AdamW's foreach kernel (`planner.adam`).
- log-probs: the old policy's forward pass (logits x 8: verl computes its entropy) beside what the
  actor keeps resident, and the reference's (x 6) with its own bf16 weights when a KL term is on.
- rollout: vLLM takes `gpu_memory_utilization` of the device, which must be free when it starts (what
  the trainer's roles leave resident: `param_offload` / `optimizer_offload` move it to the host);
  within that, the weights at the rollout TP and the engine's working memory leave the KV cache,
  which must hold at least one `max_model_len` sequence (Gated DeltaNet layers hold a fixed state,
  multi-latent attention caches one latent per layer).
- host: per node, everything offloaded.
Estimates are of the framework allocator's peak (`torch.cuda.max_memory_allocated`); the device's
`platform.reserved_memory_gib` (context, communication buffers) is kept out of what they may use.
bench/bench_memory.py compares them with measured peaks, bench/bench_planner_reference.py with
published runs (docs/memory-planner.md).

`estimate` is the memory plan of either engine's layout, by the layout's engine plan (planner/engines.py);
`MegatronPlan` here is Megatron's (its layout rules, step cost and layouts), planner/fsdp.py's `FsdpPlan` FSDP2's.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from grpo_pipeline.planner.activations import LOGITS_OLD_POLICY, LOGITS_REFERENCE, layer_bytes, logits_bytes, micro_batch, \
    recompute, stage_activations, update_logits_coefficient
from grpo_pipeline.planner.engines import CONTEXT_PARALLEL, LONG_CONTEXT_CHUNK, MFU, EnginePlan, plan_of, registered
from grpo_pipeline.planner.fsdp import FsdpPlan  # noqa: F401  (registers FSDP2's plan: `estimate` finds every engine's)
from grpo_pipeline.planner.parallel import Layout, Stage, stage_parameters, stages
from grpo_pipeline.planner.rules import UNEVEN_PIPELINE_FIELDS, divisors, layout_problems, uneven_split
from grpo_pipeline.profiles.engine import MegatronEngine
from grpo_pipeline.profiles.model_size import ModelSize, model_size, size_problems
from grpo_pipeline.planner.roles import GIB, PARAM_BYTES, MemoryPlan, RoleMemory, gib, memory_table, rollout_rows  # noqa: F401

if TYPE_CHECKING:
    from grpo_pipeline.profiles.platform import Accelerator
    from grpo_pipeline.profiles.schema import RunProfile

GRAD_BYTES = 4  # verl's DDP: grad_reduce_in_fp32 unless a low-precision main_grads_dtype is asked for
MASTER_BYTES = 4  # fp32 master weights
HOST_GRAD_BYTES = 4  # the CPU optimizer's pinned fp32 copy of each offloaded gradient
FOREACH_ADAM_BYTES = 4  # torch AdamW foreach: sqrt(exp_avg_sq) of the whole shard, fp32


# --- the parts ----------------------------------------------------------------------------------------

def _optimizer_bytes(p: RunProfile, lay: Layout) -> tuple[float, float, float]:
    """(bytes per parameter of Adam's state on the device, on the host, the share of parameters Adam
    updates on the device) with megatron-core's CPU optimizer."""
    o = p.engine.optimizer_overrides
    per_param = 12.0
    precision_aware = bool(o.get("use_precision_aware_optimizer"))
    if precision_aware:
        sizes = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
        per_param = sum(sizes.get(str(o.get(name, "fp32")), 4)
                        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"))
    if not lay.optimizer_cpu_offload:
        return per_param, 0.0, 1.0
    # megatron-core's default fraction is 0 (nothing moves); a layout search that turns the CPU optimizer
    # on sets the fraction to 1 with it (Layout.settings).
    fraction = float(o.get("optimizer_offload_fraction", 0.0 if o.get("optimizer_cpu_offload") else 1.0))
    # Without the precision-aware optimizer the distributed optimizer's fp32 master shard stays on the device.
    kept = 0.0 if precision_aware else MASTER_BYTES
    return kept + (per_param - kept) * (1 - fraction), (per_param + HOST_GRAD_BYTES) * fraction, 1 - fraction


def _grad_bytes(p: RunProfile) -> int:
    o = p.engine.optimizer_overrides
    low = o.get("use_precision_aware_optimizer") and str(o.get("main_grads_dtype", "fp32")) in ("bf16", "bfloat16", "fp16")
    return 2 if low else GRAD_BYTES


def _stage_label(stage: Stage, lay: Layout) -> str:
    return f", pipeline stage {stage.index + 1} of {lay.pp} ({len(stage.layers)} layers)" if lay.pp > 1 else ""


def estimate(p: RunProfile, lay: Layout | None = None, device_gib: tuple[str, float | None, str] | None = None,
             size: ModelSize | None = None) -> MemoryPlan:
    """The memory plan of a verl run's layout (the profile's own, or `lay`; `size`: the model's, when known),
    whichever its engine: this module's for Megatron, planner/fsdp.py's for FSDP2."""
    lay = lay or Layout.of(p)
    device, capacity_gib, source = device_gib or p.platform.device_memory()
    return plan_of(lay.strategy).estimate(p, lay, device, capacity_gib, source, size or model_size(p.model.architecture))


def estimate_megatron(p: RunProfile, lay: Layout, device: str, capacity_gib: float | None, source: str,
                      size: ModelSize) -> MemoryPlan:
    """Megatron's memory plan of `lay` (the module's docstring)."""
    arch, plat, actor, lp = p.model.architecture, p.platform, p.actor, p.log_prob
    capacity = None if capacity_gib is None else capacity_gib * GIB
    usable = None if capacity is None else capacity - plat.reserved_memory_gib * GIB
    plan = MemoryPlan(device=device, device_memory=capacity, reserved=plat.reserved_memory_gib * GIB, source=source,
                      parameters=size.total, active_parameters=size.active, enforced=p.planner.enforce)
    world, max_length = p.world_size, p.data.max_prompt_length + p.data.max_response_length
    dp_dense = max(world // (lay.tp * lay.pp * lay.cp), 1)
    dp_expert = max(world // (lay.ep * lay.etp * lay.pp), 1)
    opt_device, opt_host, updated_on_device = _optimizer_bytes(p, lay)
    if lay.optimizer_offload and not lay.optimizer_cpu_offload:
        plan.notes.append("engine.optimizer_offload moves Adam's state to the host between updates; verl loads it back for each")
    reference = p.uses_reference_model
    kinds = {kind: layer_bytes(p, *kind, lay.tp, lay.etp) for kind in set(size.layer_kinds)}

    def shard(s: Stage) -> float:  # parameters of the distributed optimizer's shard on the device
        return s.dense / dp_dense + s.experts / dp_expert

    grad_bytes = _grad_bytes(p)

    def static(s: Stage) -> dict[str, float]:
        params = s.dense + s.experts
        return {"weights": PARAM_BYTES * params, "gradients": grad_bytes * params, "optimizer": opt_device * shard(s)}

    all_stages = stages(p, size, lay)
    state = {s.index: static(s) for s in all_stages}
    heaviest = max(all_stages, key=lambda s: sum(state[s.index].values()))
    # actor, update step: the stage whose stored activations, logits and state add up to the most
    sequences = p.sequences_per_update / dp_dense
    tokens, micro_batches = micro_batch(sequences, max_length, lay.cp, actor.use_dynamic_bsz, lay.micro_batch,
                                        actor.ppo_max_token_len_per_gpu)
    interleaved = 1 + (lay.pp - 1) / (lay.pp * p.engine.vpp) if p.engine.vpp else 1  # Narayanan et al. 2021

    def update(s: Stage) -> dict[str, float]:
        per_layer = [kinds[size.layer_kinds[i]] for i in s.layers]
        if s.mtp:
            per_layer += [kinds[(False, bool(arch.num_experts))]] * size.mtp_layers
        in_flight = min(lay.pp - s.index, micro_batches) * interleaved
        parts = {**state[s.index], "activations": stage_activations(p, per_layer, tokens, in_flight, lay.tp)}
        if s.index == lay.pp - 1:  # one micro batch's logits (and the MTP layers' own)
            parts["logits"] = logits_bytes(p, tokens, lay.tp, update_logits_coefficient(p)) * (1 + s.mtp * size.mtp_layers)
        return parts

    ref_resident = {s.index: PARAM_BYTES * (s.dense + s.experts) if reference and not lay.param_offload else 0.0
                    for s in all_stages}
    fullest, actor_parts = max(((s, update(s)) for s in all_stages),
                               key=lambda item: sum(item[1].values()) + ref_resident[item[0].index])
    if ref_resident[fullest.index]:
        actor_parts["reference weights"] = ref_resident[fullest.index]
    if actor.use_dynamic_bsz:
        when = (f"update, token budget {int(tokens)} per micro batch (actor.ppo_max_token_len_per_gpu)"
                if tokens >= actor.ppo_max_token_len_per_gpu else
                f"update, one micro batch of {int(tokens)} tokens (under actor.ppo_max_token_len_per_gpu)")
    else:
        when = f"update, micro batch {lay.micro_batch} x {int(tokens * lay.cp / lay.micro_batch)} tokens"
    when += f", {'full recompute' if recompute(p) else 'no recompute'}{_stage_label(fullest, lay)}"
    plan.roles.append(RoleMemory("actor", when, actor_parts, usable, _actor_fix(p, lay, actor_parts)))

    # actor, optimizer step: its temporaries beside the state (none for a fused Adam)
    if p.planner.adam == "foreach":
        step = {**state[heaviest.index], "optimizer step temporaries": FOREACH_ADAM_BYTES * updated_on_device * shard(heaviest),
                "reference weights": ref_resident[heaviest.index]}
        plan.roles.append(RoleMemory(
            "actor", f"optimizer step, torch AdamW foreach (planner.adam){_stage_label(heaviest, lay)}",
            {k: v for k, v in step.items() if v}, usable,
            "use an image with a fused Adam (TransformerEngine or apex: planner.adam=fused), offload the optimizer "
            "(engine.optimizer_overrides.optimizer_cpu_offload=true, optimizer_offload_fraction=1) or raise engine.pp / engine.ep"))

    # log-probs: no-grad forward passes, the actor's (the old policy's) and the reference's with its own
    # weights, each beside what the other keeps resident then; logits on the last stage only
    lp_sequences = p.sequences_per_step / dp_dense
    lp_tokens, _ = micro_batch(lp_sequences, max_length, lay.cp, lp.use_dynamic_bsz, lp.micro_batch_size_per_gpu,
                               lp.max_token_len_per_gpu)

    def actor_resident(s: Stage) -> dict[str, float]:
        own = state[s.index]
        kept = {} if lay.param_offload else {"weights": own["weights"], "gradients": own["gradients"]}
        return kept | ({} if lay.optimizer_offload else {"optimizer": own["optimizer"]})

    def log_probs(s: Stage, coefficient: int, own_weights: bool) -> dict[str, float]:
        last = s.index == lay.pp - 1
        parts = {"logits": logits_bytes(p, lp_tokens, lay.tp, coefficient) if last else 0.0}
        if own_weights:  # the reference: its weights, beside the actor's resident state
            return {"weights": state[s.index]["weights"], **parts, "actor resident": sum(actor_resident(s).values())}
        # the actor in eval mode: verl loads its weights (not its gradients) back for the pass
        return {"weights": state[s.index]["weights"], **actor_resident(s), **parts, "reference weights": ref_resident[s.index]}

    lp_when = (f"log-probs, token budget {int(lp_tokens)} per micro batch (log_prob.max_token_len_per_gpu)"
               if lp.use_dynamic_bsz else f"log-probs, micro batch {lp.micro_batch_size_per_gpu}")
    old_policy = max((log_probs(s, LOGITS_OLD_POLICY, False) for s in all_stages), key=lambda parts: sum(parts.values()))
    old_policy = {k: v for k, v in old_policy.items() if v}
    plan.roles.append(RoleMemory("actor", lp_when, old_policy, usable, _actor_fix(p, lay, old_policy, log_probs=True)))
    resident_by_stage = {s.index: sum(actor_resident(s).values()) for s in all_stages}
    if reference:
        parts = max((log_probs(s, LOGITS_REFERENCE, True) for s in all_stages), key=lambda parts: sum(parts.values()))
        fix = "set engine.param_offload=true" if parts["actor resident"] else _actor_fix(p, lay, parts, log_probs=True)
        plan.roles.append(RoleMemory("reference", lp_when, parts, usable, fix))

    # rollout: vLLM's share must be free when it starts, and must hold one full sequence's cache
    trainer_resident = max(resident_by_stage[s.index] + ref_resident[s.index] for s in all_stages)
    rollout_roles, plan.kv_sequences = rollout_rows(p, size, lay.rollout_tp, capacity, usable, trainer_resident)
    plan.roles.extend(rollout_roles)

    # host: everything offloaded, for the node's devices
    most = state[heaviest.index]
    per_device = (most["weights"] + most["gradients"] if lay.param_offload else 0.0)
    per_device += most["weights"] if reference and lay.param_offload else 0.0
    per_device += (most["optimizer"] if lay.optimizer_offload else 0.0) + opt_host * shard(heaviest)
    host_capacity = plat.host_memory_gib * GIB if plat.host_memory_gib else None
    plan.roles.append(RoleMemory(
        "host", f"offloaded, {p.cluster.devices_per_node} devices a node", {"offloaded": per_device * p.cluster.devices_per_node},
        host_capacity, "spread the run over more nodes (cluster.nnodes) or offload less"))
    return plan

def _actor_fix(p: RunProfile, lay: Layout, parts: dict[str, float], log_probs: bool = False) -> str:
    """The change that frees most of the largest part (of the update step, or of a log-prob pass)."""
    largest = max(parts, key=parts.get)
    if largest in ("activations", "logits"):
        if log_probs:
            budget = "log_prob.max_token_len_per_gpu" if p.log_prob.use_dynamic_bsz else "log_prob.micro_batch_size_per_gpu"
            return f"lower {budget} or raise engine.tp"
        if p.actor.use_dynamic_bsz:  # micro batches are token budgets, not sequence counts
            budget = "lower actor.ppo_max_token_len_per_gpu (the token budget of a micro batch)"
            if recompute(p) is None:
                return f"recompute activations (engine.transformer_overrides.recompute_granularity=full) or {budget}"
            return f"{budget} or raise engine.tp or engine.cp"
        if lay.micro_batch > 1:
            return "lower actor.ppo_micro_batch_size_per_gpu"
        if recompute(p) is None:
            return "recompute activations (engine.transformer_overrides.recompute_granularity=full)"
        return "raise engine.tp or engine.cp, or lower data.max_response_length"
    if largest == "optimizer":
        return ("offload the optimizer (engine.optimizer_overrides.optimizer_cpu_offload=true, "
                "optimizer_offload_fraction=1) or raise engine.pp / engine.ep; --suggest-layout lists layouts that fit")
    return "raise engine.pp or engine.ep (more devices share the weights); --suggest-layout lists layouts that fit"


def plan_for(p: RunProfile, detected_names: list[str] | None = None, detected_gib: list[float] | None = None) -> MemoryPlan | None:
    """The profile's memory plan, or None when the size model cannot size its model (size_problems)."""
    if size_problems(p.model.architecture):
        return None
    return estimate(p, device_gib=p.platform.device_memory(detected_names, detected_gib))


@registered
class MegatronPlan(EnginePlan):
    """Megatron-core's layouts: TP, PP (even or uneven stages), CP, EP and ETP; megatron-core's CPU optimizer."""

    engine = MegatronEngine

    def problems(self, p: RunProfile) -> list[str]:
        return layout_problems(p)

    def estimate(self, p: RunProfile, lay: Layout, device: str, capacity_gib: float | None, source: str,
                 size: ModelSize) -> MemoryPlan:
        return estimate_megatron(self.own(p), lay, device, capacity_gib, source, size)

    def step_cost(self, p: RunProfile, size: ModelSize, lay: Layout, spec: Accelerator) -> dict[str, float]:
        p = self.own(p)
        arch, c = p.model.architecture, p.cluster
        world, per_node = p.world_size, c.devices_per_node
        tokens = p.sequences_per_step * (p.data.max_prompt_length + p.data.max_response_length)
        dp = world // (lay.tp * lay.pp * lay.cp)
        edp = world // (lay.ep * lay.etp * lay.pp)
        recomputed = recompute(p) is not None
        sequences = p.sequences_per_update / dp
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

    def layouts(self, p: RunProfile) -> list[Layout]:
        """TP within a node dividing the heads, PP dividing the world (uneven first/last stages where it does not
        divide the layers), CP, EP dividing the experts, ETP 1 or TP."""
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
                    if not layout_problems(self.with_layout(p, lay)):
                        out.append(lay)
        return out

    def engine_settings(self, engine: MegatronEngine, lay: Layout) -> dict[str, Any]:
        prefix = "engine.optimizer_overrides."
        overrides = {**engine.optimizer_overrides,
                     **{k.removeprefix(prefix): v for k, v in self.settings(lay).items() if k.startswith(prefix)}}
        return {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp, "optimizer_overrides": overrides,
                "num_layers_in_first_pipeline_stage": lay.first_stage_layers,
                "num_layers_in_last_pipeline_stage": lay.last_stage_layers,
                "account_for_embedding_in_pipeline_split": lay.embedding_in_split,
                "account_for_loss_in_pipeline_split": lay.loss_in_split}

    def settings(self, lay: Layout) -> dict[str, Any]:
        return {"engine.tp": lay.tp, "engine.pp": lay.pp, "engine.cp": lay.cp, "engine.ep": lay.ep,
                "engine.etp": lay.etp, "rollout.tp": lay.rollout_tp, "engine.param_offload": lay.param_offload,
                "engine.optimizer_offload": lay.optimizer_offload,
                "engine.optimizer_overrides.optimizer_cpu_offload": lay.optimizer_cpu_offload,
                **({"engine.optimizer_overrides.optimizer_offload_fraction": 1} if lay.optimizer_cpu_offload else {}),
                "actor.ppo_micro_batch_size_per_gpu": lay.micro_batch,
                **{f"engine.{name}": value for name, value in (
                    ("num_layers_in_first_pipeline_stage", lay.first_stage_layers),
                    ("num_layers_in_last_pipeline_stage", lay.last_stage_layers),
                    ("account_for_embedding_in_pipeline_split", lay.embedding_in_split),
                    ("account_for_loss_in_pipeline_split", lay.loss_in_split)) if value}}

    def resets(self, engine) -> dict[str, Any]:
        """Also an uneven split the profile sets and a layout lacks (its settings name the split it has)."""
        out = super().resets(engine)
        if isinstance(engine, MegatronEngine):
            out.update({name: default for name in UNEVEN_PIPELINE_FIELDS
                        if getattr(engine, name) != (default := engine.default(name))})
        return out

    def dims(self, lay: Layout) -> tuple:
        return lay.tp, lay.pp, lay.cp, lay.ep, lay.etp

    def columns(self, lay: Layout) -> str:
        pp = f"{lay.pp} ({lay.first_stage_layers}/../{lay.last_stage_layers})" if lay.first_stage_layers else lay.pp
        return f"{lay.tp} | {pp} | {lay.cp} | {lay.ep} | {lay.etp}"

    def label(self, lay: Layout) -> str:
        return "megatron"

    def shown(self, lay: Layout) -> str:
        return f"TP {lay.tp} PP {lay.pp} CP {lay.cp} EP {lay.ep} ETP {lay.etp}"
