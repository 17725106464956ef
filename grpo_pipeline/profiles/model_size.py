"""How big a model is, from the architecture numbers a profile records: parameters by part (what
each parallel dimension splits), layer by layer, in total and active per token, and the bytes one
token keeps in an inference engine's cache.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run   # "parameters: ..." line

Counted as the Hugging Face modules hold them (SmolLM2-135M: 134,515,008, exactly what its checkpoint
holds; DeepSeek-V3 671,026,404,352 and Qwen3-235B-A22B 235,093,634,560, as transformers counts them);
planner/memory.py turns the parts into bytes per device. The families sized are `FAMILIES`; a
checkpoint of another `model_type` is not estimated (`size_problems` says so), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import ModelArchitecture


@dataclass(frozen=True)
class Family:
    """What a model family's layers hold beyond the recorded numbers, and how Megatron-Bridge builds them
    (its bridges turn on `bias_activation_fusion` and `moe_permute_fusion` for these families)."""

    shared_expert_gate: bool = False  # a sigmoid gate (hidden -> 1) on the shared expert's output
    sigmoid_router: bool = False  # scores by sigmoid: the backward keeps [tokens, experts] fp32 scores
    fused_swiglu: bool = False
    permute_fusion: bool = False


_QWEN_HYBRID = Family(shared_expert_gate=True, fused_swiglu=True, permute_fusion=True)
_DEEPSEEK = Family(sigmoid_router=True, fused_swiglu=True, permute_fusion=True)
FAMILIES: dict[str, Family] = {
    "llama": Family(), "qwen2": Family(), "qwen3": Family(), "qwen3_moe": Family(permute_fusion=True),
    "qwen3_next": _QWEN_HYBRID, "qwen3_5": _QWEN_HYBRID, "qwen3_5_text": _QWEN_HYBRID,
    "qwen3_5_moe": _QWEN_HYBRID, "qwen3_5_moe_text": _QWEN_HYBRID,
    "deepseek_v3": _DEEPSEEK, "kimi_k2": _DEEPSEEK, "glm4_moe": _DEEPSEEK,
}
# No model_type: a decoder exactly as the numbers describe, with a Qwen-style gated shared expert.
UNTYPED = Family(shared_expert_gate=True)


def family(arch: ModelArchitecture) -> Family:
    return FAMILIES.get(arch.model_type or "", UNTYPED)


@dataclass(frozen=True)
class ModelSize:
    """Parameters by part. A layer is a mixer (softmax attention, multi-latent attention or Gated
    DeltaNet, with its input norm) and an MLP (dense, or MoE: router, shared expert, routed experts)."""

    embedding: int
    output: int  # 0 when tied to the embedding
    final_norm: int
    attention_layer: int  # one full-attention (or multi-latent attention) mixer with its input norm
    linear_layer: int  # one linear-attention (Gated DeltaNet) mixer with its input norm
    dense_mlp: int  # one dense MLP with its norm
    moe_dense: int  # one MoE layer's router, shared expert(s) and norm
    experts: int  # one MoE layer's routed experts: what EP x ETP split
    active_experts: int  # the routed experts one token goes through
    layer_kinds: tuple[tuple[bool, bool], ...]  # per decoder layer: (linear attention, MoE)
    # What TP leaves whole on every rank (megatron-core replicates norms and the router): of a full-attention
    # mixer, a linear-attention mixer, a dense MLP, an MoE layer's dense part.
    replicated: tuple[int, int, int, int] = (0, 0, 0, 0)
    vision: int = 0  # a multimodal checkpoint's vision tower
    mtp_layer: int = 0  # one multi-token-prediction block: projection, norms and one MoE (or dense) layer
    mtp_layers: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @cached_property
    def linear_layers(self) -> int:
        return sum(linear for linear, _ in self.layer_kinds)

    @property
    def attention_layers(self) -> int:
        return self.num_layers - self.linear_layers

    @cached_property
    def moe_layers(self) -> int:
        return sum(moe for _, moe in self.layer_kinds)

    def layer(self, index: int) -> tuple[int, int, int]:
        """(parameters TP splits, parameters every TP rank holds whole, routed-expert parameters) of one
        decoder layer."""
        linear, moe = self.layer_kinds[index]
        attention, linear_attention, dense, moe_dense = self.replicated
        mixer = (self.linear_layer, linear_attention) if linear else (self.attention_layer, attention)
        mlp = (self.moe_dense, moe_dense) if moe else (self.dense_mlp, dense)
        return mixer[0] - mixer[1] + mlp[0] - mlp[1], mixer[1] + mlp[1], self.experts if moe else 0

    @cached_property
    def _kind_counts(self) -> dict[tuple[bool, bool], list[int]]:
        """Per kind of layer, how many of the first i layers are of it (i = 0..num_layers)."""
        counts = {kind: [0] for kind in set(self.layer_kinds)}
        for kind in self.layer_kinds:
            for other, prefix in counts.items():
                prefix.append(prefix[-1] + (other == kind))
        return counts

    @cached_property
    def _kind_parts(self) -> dict[tuple[bool, bool], tuple[int, int, int]]:
        return {kind: self.layer(self.layer_kinds.index(kind)) for kind in set(self.layer_kinds)}

    def layers_in(self, start: int, end: int) -> tuple[int, int, int]:
        """`layer`'s three parts summed over layers start..end-1."""
        totals = (0, 0, 0)
        for kind, prefix in self._kind_counts.items():
            if count := prefix[end] - prefix[start]:
                totals = tuple(t + count * part for t, part in zip(totals, self._kind_parts[kind]))
        return totals

    @cached_property
    def layers_dense(self) -> int:
        """Every layer's parameters except routed experts, summed over the layers."""
        return sum(self.layers_in(0, self.num_layers)[:2])

    @property
    def total(self) -> int:
        """What the checkpoint's model holds (the vision tower included, MTP layers not: Hugging Face
        leaves them out)."""
        return (self.embedding + self.output + self.final_norm + self.layers_dense + self.moe_layers * self.experts
                + self.vision)

    @property
    def active(self) -> int:
        """Parameters one text token goes through (embedding and output included, as published counts do)."""
        return (self.embedding + self.output + self.final_norm + self.layers_dense
                + self.moe_layers * self.active_experts)


def is_mla(arch: ModelArchitecture) -> bool:
    return arch.kv_lora_rank is not None


# What the sizes need beyond the layout numbers, by kind of model.
_NEEDED_DENSE = ("intermediate_size",)
_NEEDED_MOE = ("moe_intermediate_size", "num_experts_per_tok")
_NEEDED_LINEAR = ("full_attention_interval", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
_NEEDED_MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def size_problems(arch: ModelArchitecture) -> list[str]:
    """Why the model cannot be sized: a family the size model does not know, or the
    `model.architecture` fields it needs that the profile leaves empty. Empty: it can."""
    if arch.model_type and arch.model_type not in FAMILIES:
        return [f"model_type {arch.model_type} is not in the size model (it sizes {', '.join(FAMILIES)}); "
                "its layers may hold what these do not (attention sinks, expert biases, other attention)"]
    needed = _NEEDED_MOE if arch.num_experts else _NEEDED_DENSE
    if arch.num_experts and arch.first_k_dense_replace:
        needed += _NEEDED_DENSE
    if arch.linear_num_key_heads:
        needed += _NEEDED_LINEAR
    if arch.model_type in ("deepseek_v3", "kimi_k2") or is_mla(arch):
        needed += _NEEDED_MLA
    missing = [f"model.architecture.{name}" for name in needed if getattr(arch, name) is None]
    return [f"the model's size needs {', '.join(missing)}"] if missing else []


def head_dim(arch: ModelArchitecture) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def layer_kinds(arch: ModelArchitecture) -> tuple[tuple[bool, bool], ...]:
    """(linear attention, MoE) of each decoder layer: in a hybrid model every `full_attention_interval`-th
    layer is full attention; the first `first_k_dense_replace` layers of an MoE model are dense."""
    interval = arch.full_attention_interval if arch.linear_num_key_heads else None
    return tuple((bool(interval) and (i + 1) % interval != 0, bool(arch.num_experts) and i >= arch.first_k_dense_replace)
                 for i in range(arch.num_layers))


def attention_layer_count(arch: ModelArchitecture) -> int:
    """The full-attention layers (`layer_kinds`'s rule: every `full_attention_interval`-th in a hybrid)."""
    if arch.linear_num_key_heads and arch.full_attention_interval:
        return arch.num_layers // arch.full_attention_interval
    return arch.num_layers


def linear_attention_dims(arch: ModelArchitecture) -> tuple[int, int, int]:
    """(key width, value width, convolution channels) of a linear-attention layer."""
    key = (arch.linear_num_key_heads or 0) * (arch.linear_key_head_dim or 0)
    value = (arch.linear_num_value_heads or 0) * (arch.linear_value_head_dim or 0)
    return key, value, 2 * key + value


def _attention(arch: ModelArchitecture) -> int:
    """One attention mixer with its input norm."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    if is_mla(arch):  # DeepSeek-V3's multi-latent attention (modeling_deepseek_v3.py)
        qk, rope, v, latent = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim, arch.kv_lora_rank
        query = (h * arch.q_lora_rank + arch.q_lora_rank + arch.q_lora_rank * heads * qk) if arch.q_lora_rank else h * heads * qk
        key_value = h * (latent + rope) + latent + latent * heads * (qk - rope + v)
        bias = (arch.q_lora_rank or heads * qk) + latent + rope + h if arch.attention_bias else 0  # q(_a), kv_a, o
        return query + key_value + heads * v * h + bias + h
    d = head_dim(arch)
    q_width, kv_width = heads * d, arch.num_kv_heads * d
    return (
        h * q_width * (2 if arch.attention_output_gate else 1)  # the gate is projected with the queries
        + 2 * h * kv_width
        + q_width * h
        + ((q_width + 2 * kv_width) if arch.attention_bias else 0)
        + (2 * d if arch.qk_norm else 0)
        + h  # input norm
    )


def _linear_attention(arch: ModelArchitecture) -> int:
    if not arch.linear_num_key_heads:
        return 0
    h = arch.hidden_size
    key, value, conv = linear_attention_dims(arch)
    value_heads = arch.linear_num_value_heads or 0
    return (
        h * conv + h * value + 2 * h * value_heads  # in_proj: qkv, z (output gate), b and a
        + conv * (arch.linear_conv_kernel_dim or 0)  # depthwise convolution
        + 2 * value_heads  # A_log, dt_bias
        + (arch.linear_value_head_dim or 0)  # gated RMSNorm of the output
        + value * h  # out_proj
        + h  # input norm
    )


def model_size(arch: ModelArchitecture) -> ModelSize:
    """Parameters by part; `size_problems` must be empty."""
    if problems := size_problems(arch):
        raise ValueError("; ".join(problems))
    h = arch.hidden_size
    dense_mlp = 3 * h * arch.intermediate_size + h if arch.intermediate_size else 0
    moe_dense = experts = active = gate = 0
    if arch.num_experts:
        shared = arch.shared_expert_intermediate_size or 0
        gate = h if shared and family(arch).shared_expert_gate else 0
        expert = 3 * h * arch.moe_intermediate_size
        moe_dense = arch.num_experts * h + (3 * h * shared + gate if shared else 0) + h  # router, shared expert, norm
        experts, active = arch.num_experts * expert, arch.num_experts_per_tok * expert
    attention = _attention(arch)
    norms = h + (2 * head_dim(arch) if arch.qk_norm else 0) + ((arch.q_lora_rank or 0) + arch.kv_lora_rank if is_mla(arch) else 0)
    # An MTP block: the embedding/hidden projection (2h -> h), three norms, one full-attention layer.
    mtp_layer = 2 * h * h + 3 * h + attention + (moe_dense + experts if arch.num_experts else dense_mlp)
    return ModelSize(
        embedding=arch.vocab_size * h,
        output=0 if arch.tie_word_embeddings else arch.vocab_size * h,
        final_norm=h,
        attention_layer=attention,
        linear_layer=_linear_attention(arch),
        dense_mlp=dense_mlp,
        moe_dense=moe_dense,
        experts=experts,
        active_experts=active,
        layer_kinds=layer_kinds(arch),
        # norms, router and the shared expert's gate
        replicated=(norms, h if arch.linear_num_key_heads else 0, h if dense_mlp else 0,
                    arch.num_experts * h + gate + h if arch.num_experts else 0),
        vision=arch.vision_parameters,
        mtp_layer=mtp_layer if arch.mtp_layers else 0,
        mtp_layers=arch.mtp_layers,
    )


def kv_bytes_per_token(arch: ModelArchitecture, tp: int, dtype_bytes: int = 2) -> int:
    """Bytes one token adds to an inference engine's KV cache on one of `tp` ranks (full-attention
    layers only; KV heads fewer than the ranks are replicated, as vLLM does). Multi-latent attention
    caches one latent and its rotary key per layer, on every rank (vLLM's MLA cache)."""
    if is_mla(arch):
        return attention_layer_count(arch) * (arch.kv_lora_rank + arch.qk_rope_head_dim) * dtype_bytes
    kv_heads = max(arch.num_kv_heads // tp, 1)
    return attention_layer_count(arch) * 2 * kv_heads * head_dim(arch) * dtype_bytes


def linear_state_bytes_per_sequence(arch: ModelArchitecture, tp: int, dtype_bytes: int = 2) -> int:
    """The fixed state one sequence holds in the linear-attention layers on one of `tp` ranks: the
    short convolution's window and the recurrent state (value heads x key width x value width)."""
    if not arch.linear_num_key_heads:
        return 0
    _, _, conv = linear_attention_dims(arch)
    per_layer = (conv * ((arch.linear_conv_kernel_dim or 1) - 1)
                 + (arch.linear_num_value_heads or 0) * (arch.linear_key_head_dim or 0) * (arch.linear_value_head_dim or 0))
    return (arch.num_layers - attention_layer_count(arch)) * per_layer * dtype_bytes // tp


def vision_tower_parameters(vision: dict, out_hidden_size: int) -> int:
    """Qwen3.5's vision tower (Qwen3_5MoeVisionModel) from config.json's vision_config: the patch
    embedding, learned position embeddings, the blocks (two LayerNorms, qkv, proj, fc1, fc2, all with
    bias) and the patch merger; equal to transformers' count (446,571,248 for the 35B-A3B)."""
    hv, fv, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    patch = vision.get("in_channels", 3) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    merged = hv * vision["spatial_merge_size"] ** 2
    embeddings = patch * hv + hv + vision["num_position_embeddings"] * hv
    block = 4 * hv + 3 * hv * hv + 3 * hv + hv * hv + hv + hv * fv + fv + fv * hv + hv
    merger = 2 * hv + merged * merged + merged + merged * out_hidden_size + out_hidden_size
    return embeddings + depth * block + merger
