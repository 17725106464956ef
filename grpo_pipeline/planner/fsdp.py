"""Will an FSDP2 layout fit? Device memory per role of a verl run with `engine.strategy: fsdp`.

    python -m grpo_pipeline --model smollm2-135m --device gpu --backend verl --dry-run          # the table
    python -m grpo_pipeline --model smollm2-135m --device gpu --backend verl --set engine.fsdp_size=4 --dry-run

verl 0.9.1's FSDP engine (workers/engine/fsdp/transformer_impl.py) wraps each decoder layer and the
root module (embedding, output layer, final norm) with `fully_shard` over a group of `engine.fsdp_size`
ranks (`group_size`); with `engine.ulysses_sp` > 1 each sequence's tokens are split
over that many ranks, which leaves world / SP data-parallel ranks. Its roles run in turn on every device:
- actor, update: the actor's parameters in fp32 (verl's `fsdp_config.model_dtype`), its fp32 gradients
  and Adam's two fp32 moments, each 1/F of the model on a group of F ranks; loaded back for the update
  when offloaded. Beside them what is gathered for compute (MixedPrecisionPolicy: bf16): the root
  module, kept gathered through forward and backward, and two decoder layers (one prefetched); the
  output layer's unsharded bf16 gradient (computed first, reduced when backward ends) and one layer's
  (bf16 computed, fp32 for the reduce-scatter). Activations of one micro batch as the transformers
  layers keep them (`hf_layer_bytes`): every layer's whole set without gradient checkpointing, held at
  the loss beside the logits; with it (`model.enable_gradient_checkpointing`) each layer's bf16 input,
  then the larger of the logits (freed once lm_head's backward ran) and one recomputed layer with its
  backward's working set. Logits as verl 0.9.1 uses transformers' bf16 output with flash-attn's in-place
  cross entropy: x2, x8 with an entropy term (the constants below, with their file:line).
- LoRA (`lora.rank` > 0): the base's fp32 shard stays, the adapter (cast to the base's fp32) is all that has
  gradients and Adam's moments, and the reference is the actor with its adapter disabled (verl's `ref_in_actor`):
  no reference role, no reference shard on the host.
- actor, optimizer step: the state plus torch AdamW's foreach temporaries (4 bytes a parameter of the shard).
- log-probs: the old policy's no-grad forward (logits x6: verl always computes its entropy), beside
  what the actor keeps resident (parameters unless offloaded, Adam's state unless offloaded; gradients
  are freed after each step); the reference's (x2): verl 0.9.1 gives a forward-only FSDP2 model
  `CPUOffloadPolicy`, so its fp32 shard lives on the host and only the gathered bf16 units reach the device.
- rollout: vLLM's share of the device beside what the actor leaves resident (planner/roles.py).
- host: per node, each device's offloaded parameters and Adam's state, and the reference's shard.
bench/fsdp_memory_probe.py measures the update and log-prob peaks on a GPU beside these figures.
`FsdpPlan` is FSDP2's engine plan (planner/engines.py): its layout rules, memory, step cost and layouts.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from grpo_pipeline.planner.activations import _mixer_elements, logits_bytes, micro_batch
from grpo_pipeline.planner.engines import LONG_CONTEXT_CHUNK, MFU, OFFLOAD_LEVELS, EnginePlan, registered
from grpo_pipeline.planner.lora import adapter_size
from grpo_pipeline.planner.parallel import Layout
from grpo_pipeline.planner.roles import GIB, MemoryPlan, RoleMemory, rollout_rows
from grpo_pipeline.planner.rules import divisors, fsdp_problems
from grpo_pipeline.profiles.engine import FsdpEngine

if TYPE_CHECKING:
    from grpo_pipeline.profiles.model_size import ModelSize
    from grpo_pipeline.profiles.platform import Accelerator
    from grpo_pipeline.profiles.schema import RunProfile

MASTER_BYTES = 4  # fsdp_config.model_dtype fp32: the actor's sharded parameters
GRAD_BYTES = 4  # reduce_dtype fp32: the sharded gradients
ADAM_BYTES = 8  # exp_avg and exp_avg_sq, fp32
COMPUTE_BYTES = 2  # MixedPrecisionPolicy param_dtype bf16: what all-gather makes for compute
FOREACH_BYTES = 4  # torch AdamW foreach: one fp32 temporary of the shard during the step
# Bytes per token per vocabulary entry of transformers' bf16 logits (lm_head's output, no fp32 upcast) as
# verl 0.9.1's FSDP engine uses them with remove padding; flash-attn's Triton cross entropy computes each
# row in fp32 on chip and keeps no copy (utils/torch_functional.py:110-133).
# - update, no entropy term: the logits alone (x2). engine/fsdp/transformer_impl.py:1425-1431 calls it with
#   inplace_backward=True, so the logits' gradient is written into the logits; at temperature 1
#   `_scale_logits_by_temperature` returns the logits themselves (transformer_impl.py:98-103), otherwise
#   the division makes one more copy (TEMPERATURE_COPY).
# - update with an entropy term (calculate_entropy = entropy_coeff != 0, trainer/ppo/ray_trainer.py:1336-1338):
#   inplace_backward is off (transformer_impl.py:1426-1427) and entropy_from_logits keeps softmax and its
#   product with the logits for backward (torch_functional.py:243-244): x8 with their gradients.
# - the old policy's pass always computes its entropy (ray_trainer.py:1300 calculate_entropy=True), no grad:
#   logits, softmax and the product (x6).
# - the reference's log-probs only (ray_trainer.py:1272 calculate_entropy=False): the logits (x2).
# Without flash-attn verl falls back to a row-by-row log-softmax (torch_functional.py:173) that keeps a
# bf16 copy for backward; verl's NVIDIA images ship flash-attn, which remove padding needs anyway.
LOGITS_UPDATE, LOGITS_UPDATE_ENTROPY, LOGITS_OLD_POLICY, LOGITS_REFERENCE = 2, 8, 6, 2
TEMPERATURE_COPY = 2


def group_size(world: int, fsdp_size: int) -> int:
    """Ranks one copy of the model is sharded over (verl: -1, or the world or more, is the world)."""
    return world if fsdp_size < 0 or fsdp_size >= world else fsdp_size


def hf_layer_bytes(p: RunProfile, linear: bool, moe: bool) -> float:
    """Bytes one token keeps in one transformers decoder layer for the backward pass (bf16): the input
    norm's input and output, the mixer, the MLP's norm and its unfused SwiGLU (gate, up, silu, product)
    or the routed experts' copies as planner/activations.py counts megatron-core's plain layers."""
    arch = p.model.architecture
    h = arch.hidden_size
    if moe:
        k, f = arch.num_experts_per_tok or 1, arch.moe_intermediate_size or 0
        mlp = 4 * h + 2 * (4 * (arch.num_experts or 0) + k * (2 * h + 4 * f) + 4 * (arch.shared_expert_intermediate_size or 0))
    else:
        mlp = 4 * h + 8 * (arch.intermediate_size or 0)
    return 4 * h + 2 * _mixer_elements(arch, linear) + mlp


def backward_working_bytes(p: RunProfile, linear: bool, moe: bool) -> float:
    """Bytes per token one dense layer's backward allocates beyond what its forward stored. Autograd
    frees each saved tensor once its node has run, so in transformers' SwiGLU MLP
    (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) the product's backward holds its output gradient and
    the gradients of both factors (3 x 2f) after `down_proj` freed the product (2f): +4f; the attention's
    flash-attn backward holds the output gradient, dq and its fp32 accumulator (2h + 2h + 4h = 8h). An MoE
    or linear-attention layer keeps the conservative bound: its whole stored set again."""
    arch = p.model.architecture
    if moe or linear:
        return hf_layer_bytes(p, linear, moe)
    return 4 * (arch.intermediate_size or 0) + 8 * arch.hidden_size


def activation_bytes(p: RunProfile, size: ModelSize, tokens: float, checkpointing: bool) -> tuple[float, float]:
    """(what one micro batch keeps through the whole backward, what one recomputed layer and its backward
    hold at once) on one device (`tokens`: its share after Ulysses)."""
    per_layer = [hf_layer_bytes(p, *kind) + backward_working_bytes(p, *kind) for kind in size.layer_kinds]
    if not per_layer:
        return 0.0, 0.0
    if not checkpointing:
        return sum(hf_layer_bytes(p, *kind) for kind in size.layer_kinds) * tokens, 0.0
    # each layer's input is kept (bf16, 2h a token); backward recomputes one layer at a time
    return len(per_layer) * 2 * p.model.architecture.hidden_size * tokens, max(per_layer) * tokens


def estimate_fsdp(p: RunProfile, lay: Layout, device: str, capacity_gib: float | None, source: str,
                  size: ModelSize) -> MemoryPlan:
    """The memory plan of an FSDP2 layout (`lay`: its fsdp_size, ulysses_sp, offload, micro batch,
    checkpointing and rollout TP)."""
    plat, actor, lp = p.platform, p.actor, p.log_prob
    capacity = None if capacity_gib is None else capacity_gib * GIB
    usable = None if capacity is None else capacity - plat.reserved_memory_gib * GIB
    plan = MemoryPlan(device=device, device_memory=capacity, reserved=plat.reserved_memory_gib * GIB, source=source,
                      parameters=size.total, active_parameters=size.active, enforced=p.planner.enforce)
    world, max_length = p.world_size, p.data.max_prompt_length + p.data.max_response_length
    group = group_size(world, lay.fsdp_size)
    sp = lay.ulysses_sp
    dp = max(world // sp, 1)
    shard = size.total / group
    # verl's apply_fsdp2 shards each decoder layer and an untied embedding as units of their own; the rest
    # (the output layer, or a tied embedding, and the final norm) is the root, which FSDP2 keeps gathered.
    root = (size.output or size.embedding) + size.final_norm
    layer = max((sum(size.layer(i)) for i in range(size.num_layers)), default=0)
    # The separate embedding unit is gathered only where forward starts and backward ends, when no
    # activations are held; at the peaks the root and two decoder layers (one prefetched) are.
    gathered = COMPUTE_BYTES * (root + 2 * max(layer, size.vision))
    # With LoRA only the adapter trains (verl casts it to the base's fp32, transformer_impl.py _build_lora_module):
    # gradients and Adam's moments are the adapter's; a model transformers cannot build is counted as full.
    adapter = adapter_size(p) if p.lora.enabled else None
    trained = adapter.parameters / group if adapter else shard
    state = {"weights": MASTER_BYTES * (shard + trained if adapter else shard), "gradients": GRAD_BYTES * trained,
             "optimizer": ADAM_BYTES * trained}
    where = f"FSDP2 over {group} rank{'s' if group > 1 else ''}" + (f", Ulysses {sp}" if sp > 1 else "")

    sequences = p.sequences_per_update / dp
    tokens, _ = micro_batch(sequences, max_length, sp, actor.use_dynamic_bsz, lay.micro_batch, actor.ppo_max_token_len_per_gpu)
    stored, recomputed = activation_bytes(p, size, tokens, lay.checkpointing)
    logits = logits_bytes(p, tokens, 1, (LOGITS_UPDATE_ENTROPY if p.algorithm.entropy_coeff else LOGITS_UPDATE)
                          + (TEMPERATURE_COPY if p.algorithm.temperature != 1 else 0))
    # The logits and their gradient are gone once lm_head's backward has run, before backward reaches the
    # last decoder layer and recomputes it (transformers' CausalLM applies lm_head after the layers), so
    # with checkpointing the peak holds the larger of the two, not both: the recomputed layer's part is
    # what it needs beyond the logits. Without checkpointing every layer's activations are held at the loss.
    unsharded = (COMPUTE_BYTES + GRAD_BYTES) * adapter.parameters / max(size.num_layers, 1) if adapter else (
        COMPUTE_BYTES * (size.output or size.embedding) + (COMPUTE_BYTES + GRAD_BYTES) * layer)
    update = {**state, "gathered weights": gathered, "unsharded gradients": unsharded,
              "activations": stored, "logits": logits, "recomputed layer": max(recomputed - logits, 0.0)}
    update = {k: v for k, v in update.items() if v or k in ("activations", "logits")}
    when = (f"update, {where}, " + (f"token budget {int(tokens)} per micro batch" if actor.use_dynamic_bsz else
                                    f"micro batch {lay.micro_batch} x {int(tokens * sp / lay.micro_batch)} tokens")
            + f", gradient checkpointing {'on' if lay.checkpointing else 'off'}")
    plan.roles.append(RoleMemory("actor", when, update, usable, _fix(p, lay, update)))
    step = {**state, "optimizer step temporaries": FOREACH_BYTES * trained}
    plan.roles.append(RoleMemory("actor", f"optimizer step, torch AdamW foreach, {where}", step, usable, _fix(p, lay, step)))

    resident = {"weights": 0.0 if lay.param_offload else state["weights"],
                "optimizer": 0.0 if lay.optimizer_offload else state["optimizer"]}
    lp_sequences = p.sequences_per_step / dp
    lp_tokens, _ = micro_batch(lp_sequences, max_length, sp, lp.use_dynamic_bsz, lp.micro_batch_size_per_gpu,
                               lp.max_token_len_per_gpu)
    forward = max(hf_layer_bytes(p, *kind) for kind in size.layer_kinds) * lp_tokens if size.layer_kinds else 0.0
    lp_when = (f"log-probs, token budget {int(lp_tokens)} per micro batch (log_prob.max_token_len_per_gpu)"
               if lp.use_dynamic_bsz else f"log-probs, micro batch {lp.micro_batch_size_per_gpu}")
    # verl loads an offloaded actor's parameters back for its own log-prob pass
    old_policy = {"weights": state["weights"], "optimizer": resident["optimizer"], "gathered weights": gathered,
                  "activations": forward, "logits": logits_bytes(p, lp_tokens, 1, LOGITS_OLD_POLICY)}
    plan.roles.append(RoleMemory("actor", lp_when, {k: v for k, v in old_policy.items() if v}, usable,
                                 _fix(p, lay, old_policy, log_probs=True)))
    if p.builds_reference_model:  # with LoRA verl's reference is the actor, adapter disabled (ref_in_actor)
        reference = {"gathered weights": gathered, "activations": forward,
                     "logits": logits_bytes(p, lp_tokens, 1, LOGITS_REFERENCE), "actor resident": sum(resident.values())}
        plan.roles.append(RoleMemory("reference", lp_when + ", its shard on the host (CPUOffloadPolicy)",
                                     {k: v for k, v in reference.items() if v}, usable,
                                     _fix(p, lay, reference, log_probs=True)))

    rows, plan.kv_sequences = rollout_rows(p, size, lay.rollout_tp, capacity, usable, sum(resident.values()))
    plan.roles.extend(rows)
    host = (state["weights"] if lay.param_offload else 0.0) + (state["optimizer"] if lay.optimizer_offload else 0.0)
    host += MASTER_BYTES * shard if p.builds_reference_model else 0.0
    host_capacity = plat.host_memory_gib * GIB if plat.host_memory_gib else None
    plan.roles.append(RoleMemory("host", f"offloaded, {p.cluster.devices_per_node} devices a node",
                                 {"offloaded": host * p.cluster.devices_per_node}, host_capacity,
                                 "spread the run over more nodes (cluster.nnodes) or offload less"))
    return plan


def _fix(p: RunProfile, lay: Layout, parts: dict[str, float], log_probs: bool = False) -> str:
    """The change that frees most of the largest part."""
    largest = max(parts, key=parts.get)
    if largest in ("activations", "logits", "recomputed layer"):
        if log_probs:
            budget = "log_prob.max_token_len_per_gpu" if p.log_prob.use_dynamic_bsz else "log_prob.micro_batch_size_per_gpu"
            return f"lower {budget}, or raise engine.ulysses_sp"
        if largest == "activations" and not lay.checkpointing:
            return "set model.enable_gradient_checkpointing=true"
        budget = "actor.ppo_max_token_len_per_gpu" if p.actor.use_dynamic_bsz else "actor.ppo_micro_batch_size_per_gpu"
        return f"lower {budget}, or raise engine.ulysses_sp (each rank keeps 1/SP of a sequence)"
    if largest == "actor resident" and not (lay.param_offload and lay.optimizer_offload):
        return "set engine.param_offload=true and engine.optimizer_offload=true"
    if p.world_size == 1 and not p.lora.rank:
        # One device has no ranks to shard over, and both offloads may be on already: only an adapter's
        # training state (the frozen base in bf16, optimizer state for the adapter alone) can fit.
        return "train an adapter (lora.rank=16): one device holds the whole model's training state"
    return ("shard over more ranks (engine.fsdp_size=-1, more devices), offload (engine.param_offload, "
            "engine.optimizer_offload), or engine.strategy=megatron; --suggest-layout lists layouts that fit")


@registered
class FsdpPlan(EnginePlan):
    """FSDP2's layouts of a dense model: the group over the world or one node, Ulysses, gradient checkpointing;
    no CPU Adam (megatron-core's)."""

    engine = FsdpEngine
    offload_levels = OFFLOAD_LEVELS[:3]

    def problems(self, p: RunProfile) -> list[str]:
        return fsdp_problems(p)

    def estimate(self, p: RunProfile, lay: Layout, device: str, capacity_gib: float | None, source: str,
                 size: ModelSize) -> MemoryPlan:
        return estimate_fsdp(p, lay, device, capacity_gib, source, size)

    def step_cost(self, p: RunProfile, size: ModelSize, lay: Layout, spec: Accelerator) -> dict[str, float]:
        """FSDP2's step: the same compute; per micro batch, each parameter gathered in bf16 for the forward
        and again for the backward and its gradient reduce-scattered in fp32 (verl syncs every micro batch),
        over the node's links when the group stays in a node; across groups (hybrid sharding), the shard's
        gradients all-reduced over the network; Ulysses' all-to-alls (4 a layer forward, 4 backward)."""
        arch, per_node, world = p.model.architecture, p.cluster.devices_per_node, p.world_size
        length = p.data.max_prompt_length + p.data.max_response_length
        tokens = p.sequences_per_step * length
        group = group_size(world, lay.fsdp_size)
        dp = world // lay.ulysses_sp
        compute = (8 if lay.checkpointing else 6) * size.active * tokens / (world * spec.bf16_tflops * 1e12 * MFU)
        link, network, host = spec.link_gb_s * 1e9, spec.network_gb_s * 1e9, spec.host_gb_s * 1e9
        rank_tokens = tokens / dp
        if p.actor.use_dynamic_bsz:
            micro_batches = max(rank_tokens / lay.ulysses_sp / p.actor.ppo_max_token_len_per_gpu, 1)
        else:
            micro_batches = max(p.sequences_per_step / dp / lay.micro_batch, 1)
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

    def layouts(self, p: RunProfile) -> list[Layout]:
        """The group over the world or one node, Ulysses where a sequence leaves each rank LONG_CONTEXT_CHUNK
        tokens or more, with and without gradient checkpointing; none for an MoE model (expert parallelism is
        Megatron's) or a Megatron dist checkpoint."""
        arch, world, per_node = p.model.architecture, p.world_size, p.cluster.devices_per_node
        if arch.num_experts or p.model.dist_checkpoint:
            return []
        length = p.data.max_prompt_length + p.data.max_response_length
        groups = [-1] + ([per_node] if world > per_node else [])
        sps = [sp for sp in divisors(per_node) if sp == 1 or length / sp >= LONG_CONTEXT_CHUNK]
        out = []
        for group, sp, checkpointing in itertools.product(groups, sps, (False, True)):
            lay = Layout(1, 1, 1, 1, 1, 1, False, False, False, 1, strategy="fsdp", fsdp_size=group, ulysses_sp=sp,
                         checkpointing=checkpointing)
            if not fsdp_problems(self.with_layout(p, lay)):
                out.append(lay)
        return out

    def engine_settings(self, engine: FsdpEngine, lay: Layout) -> dict[str, Any]:
        # verl's Ulysses patches transformers' FlashAttention 2 path only (planner/rules.py)
        return {"fsdp_size": lay.fsdp_size, "ulysses_sp": lay.ulysses_sp,
                **({"attn_implementation": "flash_attention_2"} if lay.ulysses_sp > 1 else {})}

    def model_settings(self, p: RunProfile, lay: Layout) -> dict[str, Any]:
        return {"model": p.model.model_copy(update={"enable_gradient_checkpointing": lay.checkpointing})}

    def settings(self, lay: Layout) -> dict[str, Any]:
        return {"engine.strategy": "fsdp", "engine.fsdp_size": lay.fsdp_size, "engine.ulysses_sp": lay.ulysses_sp,
                "rollout.tp": lay.rollout_tp, "engine.param_offload": lay.param_offload,
                "engine.optimizer_offload": lay.optimizer_offload,
                "model.enable_gradient_checkpointing": lay.checkpointing,
                "actor.ppo_micro_batch_size_per_gpu": lay.micro_batch,
                **({"engine.attn_implementation": "flash_attention_2"} if lay.ulysses_sp > 1 else {})}

    def dims(self, lay: Layout) -> tuple:
        return "fsdp", lay.fsdp_size, lay.ulysses_sp, lay.checkpointing

    def columns(self, lay: Layout) -> str:
        return " | ".join(["-"] * 5)

    def label(self, lay: Layout) -> str:
        group = "world" if lay.fsdp_size < 0 else lay.fsdp_size
        return f"fsdp (group {group}, Ulysses {lay.ulysses_sp}, checkpointing {'on' if lay.checkpointing else 'off'})"

    def shown(self, lay: Layout) -> str:
        return self.label(lay)
