"""Will the layout fit? Device memory per role of a verl run, estimated from the profile alone.

    python -m flows.grpo --model qwen3.5-122b-a10b --device gpu --dry-run          # the table
    python -m flows.grpo --model qwen3.5-122b-a10b --device gpu --dry-run --json   # "memory": {...}

verl colocates its roles on every device and runs them in turn, so each role is checked at its own
peak with what the other roles leave resident then:
- actor: one update step of Megatron: bf16 parameters, fp32 gradients (verl's grad_reduce_in_fp32),
  Adam's fp32 master weights and two moments sharded over the data-parallel ranks (the distributed
  optimizer; the part `optimizer_cpu_offload` x `optimizer_offload_fraction` moves to the host stays
  there), and the activations of the micro batches in flight, under the recompute settings, with the
  logits of the vocabulary-parallel loss. verl loads offloaded parameters back for the update.
- log-probs: the actor's forward pass for the old policy's log-probs, and the reference's (when a KL
  term is on) with its own bf16 weights, `log_prob.micro_batch_size_per_gpu` sequences at a time.
- rollout: vLLM takes `gpu_memory_utilization` of the device, which must be free when it starts (what
  the trainer's roles leave resident: `param_offload` / `optimizer_offload` move it to the host);
  within that, the weights at the rollout TP and the engine's working memory leave the KV cache,
  which must hold at least one `max_model_len` sequence (Gated DeltaNet layers hold a fixed state).
- host: per node, everything offloaded.
Estimates are of the framework allocator's peak (`torch.cuda.max_memory_allocated`); the device's
`platform.reserved_memory_gib` (context, communication buffers) is kept out of what they may use.
The bench `bench/bench_memory.py` compares them with measured peaks (docs/memory-planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from profiles.model_size import ModelSize, head_dim, kv_bytes_per_token, linear_attention_dims, \
    linear_state_bytes_per_sequence, missing_size_fields, model_size

if TYPE_CHECKING:
    from profiles.schema import ModelArchitecture, RunProfile

GIB = 2**30
PARAM_BYTES = 2  # bf16 / fp16 weights
GRAD_BYTES = 4  # verl's DDP: grad_reduce_in_fp32 unless a low-precision main_grads_dtype is asked for
LOGIT_BYTES = 6  # the vocab-parallel loss: bf16 logits and their fp32 copy (exp kept for backward)
VLLM_OVERHEAD = 2 * GIB  # CUDA graphs, sampler and profiling buffers of one vLLM engine (approximate)


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

    @classmethod
    def of(cls, p: RunProfile) -> Layout:
        e = p.engine
        return cls(tp=e.tp, pp=e.pp, cp=e.cp, ep=e.ep, etp=e.etp, rollout_tp=p.rollout.tp,
                   param_offload=e.param_offload, optimizer_offload=e.optimizer_offload,
                   optimizer_cpu_offload=bool(e.optimizer_overrides.get("optimizer_cpu_offload")),
                   micro_batch=p.actor.ppo_micro_batch_size_per_gpu)

    def settings(self) -> dict[str, Any]:
        """The profile keys that make this layout (`--set` them)."""
        return {"engine.tp": self.tp, "engine.pp": self.pp, "engine.cp": self.cp, "engine.ep": self.ep,
                "engine.etp": self.etp, "rollout.tp": self.rollout_tp, "engine.param_offload": self.param_offload,
                "engine.optimizer_offload": self.optimizer_offload,
                "engine.optimizer_overrides.optimizer_cpu_offload": self.optimizer_cpu_offload,
                **({"engine.optimizer_overrides.optimizer_offload_fraction": 1} if self.optimizer_cpu_offload else {}),
                "actor.ppo_micro_batch_size_per_gpu": self.micro_batch}


@dataclass
class RoleMemory:
    """One role's peak on one device (host: one node), by part, in bytes."""

    role: str
    when: str
    parts: dict[str, float]
    capacity: float | None
    fix: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity

    def problem(self, device: str) -> str:
        """One line: the role, its estimate, the capacity and a fix."""
        where = "node's host memory" if self.role == "host" else f"{device} device"
        return (f"{self.role} needs {gib(self.total)} GiB per {'node' if self.role == 'host' else 'device'} "
                f"({self.when}) but one {where} has {gib(self.capacity)} GiB for it; {self.fix}")


@dataclass
class MemoryPlan:
    device: str
    device_memory: float | None  # bytes of one device
    reserved: float
    source: str
    parameters: int
    active_parameters: int
    roles: list[RoleMemory] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kv_sequences: int = 0  # full-length sequences the rollout's KV cache holds

    @property
    def fits(self) -> bool:
        return all(role.fits for role in self.roles)

    def problems(self) -> list[str]:
        """One message per role that does not fit: its first phase that does not."""
        failing: dict[str, RoleMemory] = {}
        for role in self.roles:
            if not role.fits:
                failing.setdefault(role.role, role)
        return [role.problem(self.device) for role in failing.values()]

    def summary(self) -> dict[str, Any]:
        """The plan as JSON: GiB, rounded."""
        return {
            "device": self.device, "device_memory_gib": gib(self.device_memory), "reserved_gib": gib(self.reserved),
            "source": self.source, "parameters": self.parameters, "active_parameters": self.active_parameters,
            "fits": self.fits,
            "roles": [{"role": r.role, "when": r.when, "estimate_gib": gib(r.total), "capacity_gib": gib(r.capacity),
                       "fits": r.fits, "parts_gib": {k: gib(v) for k, v in r.parts.items()}} for r in self.roles],
            "notes": self.notes,
        }


def memory_table(summary: dict[str, Any]) -> list[str]:
    """A plan's summary as a small Markdown table, as the dry run and the report show it."""
    s = summary
    lines = [f"parameters {s['parameters']:,} ({s['active_parameters']:,} active per token); device {s['device']}: "
             f"{s['device_memory_gib']} GiB, {s['reserved_gib']} GiB kept for the runtime ({s['source']})",
             "| role | when | estimate GiB | capacity GiB | fits | largest parts |", "|---|---|---|---|---|---|"]
    for r in s["roles"]:
        largest = ", ".join(f"{k} {v}" for k, v in sorted(r["parts_gib"].items(), key=lambda kv: -kv[1])[:3] if v)
        capacity = "-" if r["capacity_gib"] is None else r["capacity_gib"]
        lines.append(f"| {r['role']} | {r['when']} | {r['estimate_gib']} | {capacity} | {'yes' if r['fits'] else 'NO'} "
                     f"| {largest} |")
    return lines + [f"note: {note}" for note in s["notes"]]


def gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 1)


# --- the parts ----------------------------------------------------------------------------------------

def stage_parameters(size: ModelSize, lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on one device of the fullest pipeline stage."""
    share = 1 / lay.pp
    layers = (size.attention_layers * size.attention_layer + size.linear_layers * size.linear_layer
              + size.num_layers * size.mlp_dense) * share
    if lay.pp == 1:
        edges = size.embedding + size.output + size.final_norm
    else:  # the first stage holds the embedding, the last the output layer (a copy when tied)
        edges = max(size.embedding, (size.output or size.embedding) + size.final_norm)
    return (layers + edges) / lay.tp, size.num_layers * size.experts * share / (lay.ep * lay.etp)


def _layer_activation_elements(arch: ModelArchitecture, linear: bool, tp: int, etp: int) -> float:
    """bf16 elements one token of one layer keeps for the backward pass, per device (tensor and
    sequence parallel split them by TP). Flash attention keeps no score matrix."""
    h = arch.hidden_size
    if linear:
        key, value, conv = linear_attention_dims(arch)
        mixer = conv + value + 2 * (arch.linear_num_value_heads or 0) + conv + 3 * value
    else:
        d = head_dim(arch)
        q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
        # projections (queries with their gate), q/k norms, rotary outputs, attention output, o_proj input
        mixer = q * (2 if arch.attention_output_gate else 1) + 2 * kv + (q + kv if arch.qk_norm else 0) + (q + kv) + 2 * q
    if arch.num_experts:
        k, fe = arch.num_experts_per_tok or 1, arch.moe_intermediate_size or 0
        shared = 4 * (arch.shared_expert_intermediate_size or 0)
        mlp = 4 * arch.num_experts + k * (2 * h + 4 * fe / etp) + shared  # router logits and probs in fp32
    else:
        mlp = 4 * (arch.intermediate_size or 0)  # fc1's gate and up outputs, silu(gate), their product (fc2's input)
    return (4 * h + mixer + mlp) / tp


def recompute_layers(p: RunProfile) -> int | None:
    """Layers per recomputed chunk under full recomputation, None without it."""
    o = p.engine.transformer_overrides
    if o.get("recompute_granularity") != "full":
        return None
    return int(o.get("recompute_num_layers") or 1)


def activations(p: RunProfile, size: ModelSize, lay: Layout, tokens: float, in_flight: float) -> dict[str, float]:
    """Bytes of the activations of one device's update step: layers (worst stage) and logits."""
    arch = p.model.architecture
    tokens /= lay.cp
    attn = _layer_activation_elements(arch, False, lay.tp, lay.etp)
    linear = _layer_activation_elements(arch, True, lay.tp, lay.etp) if size.linear_layers else 0.0
    stage_layers = size.num_layers / lay.pp
    per_layer = (size.attention_layers * attn + size.linear_layers * linear) / size.num_layers
    full = stage_layers * per_layer * tokens * 2
    chunk = recompute_layers(p)
    if chunk is not None:
        kept = stage_layers / chunk * arch.hidden_size / lay.tp * tokens * 2  # the inputs of each chunk
        # During the backward pass one chunk is recomputed and its gradients are live beside it.
        stored = kept * in_flight + 2 * min(chunk, stage_layers) * per_layer * tokens * 2
    else:
        stored = full * in_flight
    logits = tokens * arch.vocab_size / lay.tp * LOGIT_BYTES
    return {"activations": stored, "logits": logits}


def _optimizer_bytes(p: RunProfile, lay: Layout) -> tuple[float, float]:
    """(bytes per parameter of Adam's state, the fraction of it on the host by megatron-core's CPU offload)."""
    o = p.engine.optimizer_overrides
    per_param = 12.0
    if o.get("use_precision_aware_optimizer"):
        sizes = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
        per_param = sum(sizes.get(str(o.get(name, "fp32")), 4)
                        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"))
    # megatron-core's default fraction is 0 (nothing moves); a layout search that turns the CPU optimizer
    # on sets the fraction to 1 with it (Layout.settings).
    fraction = o.get("optimizer_offload_fraction", 0.0 if o.get("optimizer_cpu_offload") else 1.0)
    host = float(fraction) if lay.optimizer_cpu_offload else 0.0
    return per_param, host


def _grad_bytes(p: RunProfile) -> int:
    o = p.engine.optimizer_overrides
    low = o.get("use_precision_aware_optimizer") and str(o.get("main_grads_dtype", "fp32")) in ("bf16", "bfloat16", "fp16")
    return 2 if low else GRAD_BYTES


def sequence_tokens(p: RunProfile, micro_batch: int, dynamic: bool, max_tokens: int) -> float:
    """Tokens of one micro batch: micro batch x (prompt + response), or the packing budget."""
    return float(max_tokens) if dynamic else float(micro_batch * (p.data.max_prompt_length + p.data.max_response_length))


def estimate(p: RunProfile, lay: Layout | None = None, device_gib: tuple[str, float | None, str] | None = None) -> MemoryPlan:
    """The memory plan of a verl run's layout (the profile's own, or `lay`)."""
    lay = lay or Layout.of(p)
    arch, plat = p.model.architecture, p.platform
    device, capacity_gib, source = device_gib or plat.device_memory()
    capacity = None if capacity_gib is None else capacity_gib * GIB
    usable = None if capacity is None else capacity - plat.reserved_memory_gib * GIB
    size = model_size(arch)
    plan = MemoryPlan(device=device, device_memory=capacity, reserved=plat.reserved_memory_gib * GIB, source=source,
                      parameters=size.total, active_parameters=size.active)
    world = p.world_size
    dense, experts = stage_parameters(size, lay)
    params = dense + experts
    dp_dense = max(world // (lay.tp * lay.pp * lay.cp), 1)
    dp_expert = max(world // (lay.ep * lay.etp * lay.pp), 1)
    opt_per_param, opt_host = _optimizer_bytes(p, lay)
    optimizer = opt_per_param * (dense / dp_dense + experts / dp_expert)
    if lay.optimizer_offload and not lay.optimizer_cpu_offload:
        note = "engine.optimizer_offload moves Adam's state to the host between updates; verl loads it back for each"
        plan.notes.append(note)
    weights, grads = PARAM_BYTES * params, _grad_bytes(p) * params
    reference = p.uses_reference_model

    # actor: the update step
    sequences = p.actor.ppo_mini_batch_size * p.algorithm.rollout_n / dp_dense
    micro_batches = max(int(sequences // lay.micro_batch), 1)
    in_flight = min(lay.pp, micro_batches)
    if p.engine.vpp:  # the interleaved schedule keeps (1 + (PP-1) / (PP x VPP)) times as many (Narayanan et al. 2021)
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * p.engine.vpp)
    tokens = sequence_tokens(p, lay.micro_batch, p.actor.use_dynamic_bsz, p.actor.ppo_max_token_len_per_gpu)
    act = activations(p, size, lay, tokens, in_flight)
    ref_resident = PARAM_BYTES * params if reference and not lay.param_offload else 0.0
    actor_parts = {"weights": weights, "gradients": grads, "optimizer": optimizer * (1 - opt_host), **act}
    if ref_resident:
        actor_parts["reference weights"] = ref_resident
    when = f"update, micro batch {lay.micro_batch} x {int(tokens / lay.micro_batch) if not p.actor.use_dynamic_bsz else int(tokens)} tokens"
    when += f", {'full recompute' if recompute_layers(p) else 'no recompute'}"
    plan.roles.append(RoleMemory("actor", when, actor_parts, usable, _actor_fix(p, lay, actor_parts)))

    # log-probs: forward passes of log_prob.micro_batch_size_per_gpu, by the actor (the old policy's) and
    # by the reference with its own weights, beside what the other keeps resident then
    actor_resident = 0.0 if lay.param_offload else weights + grads
    if not lay.optimizer_offload:
        actor_resident += optimizer * (1 - opt_host)
    lp = p.log_prob
    lp_logits = sequence_tokens(p, lp.micro_batch_size_per_gpu, lp.use_dynamic_bsz, lp.max_token_len_per_gpu) / lay.cp \
        * arch.vocab_size / lay.tp * LOGIT_BYTES
    old_policy = {"weights": weights, "gradients": grads, "optimizer": actor_parts["optimizer"] if not lay.optimizer_offload else 0.0,
                  "logits": lp_logits, "reference weights": ref_resident}
    old_policy = {k: v for k, v in old_policy.items() if v}
    plan.roles.append(RoleMemory("actor", f"log-probs, micro batch {lp.micro_batch_size_per_gpu}", old_policy, usable,
                                 _actor_fix(p, lay, old_policy, log_probs=True)))
    if reference:
        parts = {"weights": weights, "logits": lp_logits, "actor resident": actor_resident}
        fix = "set engine.param_offload=true" if actor_resident else _actor_fix(p, lay, parts, log_probs=True)
        plan.roles.append(RoleMemory("reference", f"log-probs, micro batch {lp.micro_batch_size_per_gpu}",
                                     parts, usable, fix))

    # rollout: vLLM's share must be free when it starts, and must hold one full sequence's cache
    rollout_roles, plan.kv_sequences = _rollout(p, size, lay, capacity, usable, actor_resident + ref_resident)
    plan.roles.extend(rollout_roles)

    # host: everything offloaded, for the node's devices
    per_device = (weights + grads if lay.param_offload else 0.0) + (PARAM_BYTES * params if reference and lay.param_offload else 0.0)
    per_device += optimizer * (1.0 if lay.optimizer_offload else opt_host)
    host_capacity = plat.host_memory_gib * GIB if plat.host_memory_gib else None
    plan.roles.append(RoleMemory(
        "host", f"offloaded, {p.cluster.devices_per_node} devices a node", {"offloaded": per_device * p.cluster.devices_per_node},
        host_capacity, "spread the run over more nodes (cluster.nnodes) or offload less"))
    return plan


def _rollout(p: RunProfile, size: ModelSize, lay: Layout, capacity: float | None, usable: float | None,
             resident: float) -> tuple[list[RoleMemory], int]:
    """vLLM's rows, and how many full-length sequences its KV cache holds."""
    r, arch = p.rollout, p.model.architecture
    if capacity is None:
        return [], 0
    budget = r.gpu_memory_utilization * capacity
    rtp = lay.rollout_tp
    weights = PARAM_BYTES * size.total / rtp
    # One profiling forward of max_num_batched_tokens (verl: 8192) tokens, one layer's widest tensor,
    # plus the sampler's fp32 logits for max_num_seqs sequences.
    widest = max(2 * (arch.intermediate_size or 0), 2 * (arch.num_experts_per_tok or 0) * (arch.moe_intermediate_size or 0),
                 arch.num_attention_heads * head_dim(arch) * 3)
    working = 8192 * (4 * arch.hidden_size + widest / rtp) * 2 + 3 * r.max_num_seqs * arch.vocab_size * 4 + VLLM_OVERHEAD
    kv_cache = budget - weights - working
    max_len = r.max_model_len or p.data.max_prompt_length + p.data.max_response_length
    per_sequence = kv_bytes_per_token(arch, rtp) * max_len + linear_state_bytes_per_sequence(arch, rtp)
    sequences = int(kv_cache // per_sequence) if kv_cache > 0 else 0
    free = None if usable is None else usable - resident
    start = RoleMemory(
        "rollout", f"vLLM start: gpu_memory_utilization {r.gpu_memory_utilization} of the device must be free",
        {"vLLM share": budget, "trainer resident": resident}, usable,
        "set engine.param_offload=true and engine.optimizer_offload=true" if resident else
        f"lower rollout.gpu_memory_utilization to {max(round((free or 0) / capacity - 0.005, 2), 0.05)}")
    cache = RoleMemory(
        "rollout", f"KV cache: {sequences} sequence(s) of {max_len} tokens fit (max_num_seqs {r.max_num_seqs})",
        {"weights": weights, "engine working memory": working, "one sequence's cache": per_sequence}, budget,
        "raise rollout.gpu_memory_utilization or rollout.tp, or lower rollout.max_model_len")
    if 0 < sequences < r.max_num_seqs:
        cache.when += "; fewer than max_num_seqs: vLLM queues the rest"
    return [start, cache], sequences


def _actor_fix(p: RunProfile, lay: Layout, parts: dict[str, float], log_probs: bool = False) -> str:
    """The change that frees most of the largest part (of the update step, or of a log-prob pass)."""
    largest = max(parts, key=parts.get)
    if largest in ("activations", "logits"):
        if log_probs:
            return "lower log_prob.micro_batch_size_per_gpu or raise engine.tp"
        if lay.micro_batch > 1:
            return "lower actor.ppo_micro_batch_size_per_gpu"
        if recompute_layers(p) is None:
            return "recompute activations (engine.transformer_overrides.recompute_granularity=full)"
        return "raise engine.tp or engine.cp, or lower data.max_response_length"
    if largest == "optimizer":
        return ("offload the optimizer (engine.optimizer_overrides.optimizer_cpu_offload=true, "
                "optimizer_offload_fraction=1) or raise engine.pp / engine.ep; --suggest-layout lists layouts that fit")
    return "raise engine.pp or engine.ep (more devices share the weights); --suggest-layout lists layouts that fit"


def plan_for(p: RunProfile, detected_names: list[str] | None = None, detected_gib: list[float] | None = None) -> MemoryPlan | None:
    """The profile's memory plan, or None when its architecture lacks what a size needs."""
    if missing_size_fields(p.model.architecture):
        return None
    return estimate(p, device_gib=p.platform.device_memory(detected_names, detected_gib))


