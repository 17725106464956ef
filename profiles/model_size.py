"""How big a model is, from the architecture numbers a profile records: parameters by part (what
each parallel dimension splits), in total and active per token, and the bytes one token keeps in an
inference engine's cache.

    python -m flows.grpo --model qwen3.5-122b-a10b --device gpu --dry-run   # "parameters: ..." line

Counted as the Hugging Face modules hold them (SmolLM2-135M: 134,515,008, exactly what its checkpoint
holds); profiles/memory.py turns the parts into bytes per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from profiles.schema import ModelArchitecture


@dataclass(frozen=True)
class ModelSize:
    """Parameters by part. A layer's dense part is everything but its routed experts."""

    embedding: int
    output: int  # 0 when tied to the embedding
    final_norm: int
    attention_layers: int  # full (softmax) attention layers
    linear_layers: int  # linear-attention (Gated DeltaNet) layers
    attention_layer: int  # one full-attention block, with its input norm
    linear_layer: int  # one linear-attention block, with its input norm
    mlp_dense: int  # per layer: a dense MLP, or an MoE layer's router + shared expert; with its norm
    experts: int  # per layer: all routed experts
    active_experts: int  # per layer: the routed experts one token uses

    @property
    def num_layers(self) -> int:
        return self.attention_layers + self.linear_layers

    @property
    def layers_dense(self) -> int:
        """Every layer's parameters except routed experts, summed over the layers."""
        return (self.attention_layers * self.attention_layer + self.linear_layers * self.linear_layer
                + self.num_layers * self.mlp_dense)

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.final_norm + self.layers_dense + self.num_layers * self.experts

    @property
    def active(self) -> int:
        """Parameters one token goes through (embedding and output included, as published counts do)."""
        return self.embedding + self.output + self.final_norm + self.layers_dense + self.num_layers * self.active_experts


# What the sizes need beyond the layout numbers, by kind of model.
_NEEDED_DENSE = ("intermediate_size",)
_NEEDED_MOE = ("moe_intermediate_size", "num_experts_per_tok")
_NEEDED_LINEAR = ("full_attention_interval", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")


def missing_size_fields(arch: ModelArchitecture) -> list[str]:
    """The `model.architecture` fields a size needs that the profile leaves empty."""
    needed = _NEEDED_MOE if arch.num_experts else _NEEDED_DENSE
    if arch.linear_num_key_heads:
        needed += _NEEDED_LINEAR
    return [f"model.architecture.{name}" for name in needed if getattr(arch, name) is None]


def head_dim(arch: ModelArchitecture) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def attention_layer_count(arch: ModelArchitecture) -> int:
    if arch.linear_num_key_heads and arch.full_attention_interval:
        return arch.num_layers // arch.full_attention_interval
    return arch.num_layers


def linear_attention_dims(arch: ModelArchitecture) -> tuple[int, int, int]:
    """(key width, value width, convolution channels) of a linear-attention layer."""
    key = (arch.linear_num_key_heads or 0) * (arch.linear_key_head_dim or 0)
    value = (arch.linear_num_value_heads or 0) * (arch.linear_value_head_dim or 0)
    return key, value, 2 * key + value


def model_size(arch: ModelArchitecture) -> ModelSize:
    """Parameters by part; `missing_size_fields` must be empty."""
    if missing := missing_size_fields(arch):
        raise ValueError(f"the model's size needs {', '.join(missing)}")
    h, d = arch.hidden_size, head_dim(arch)
    q_width, kv_width = arch.num_attention_heads * d, arch.num_kv_heads * d
    attention = (
        h * q_width * (2 if arch.attention_output_gate else 1)  # the gate is projected with the queries
        + 2 * h * kv_width
        + q_width * h
        + ((q_width + 2 * kv_width) if arch.attention_bias else 0)
        + (2 * d if arch.qk_norm else 0)
        + h  # input norm
    )
    key, value, conv = linear_attention_dims(arch)
    value_heads = arch.linear_num_value_heads or 0
    linear = (
        h * conv + h * value + 2 * h * value_heads  # in_proj: qkv, z (output gate), b and a
        + conv * (arch.linear_conv_kernel_dim or 0)  # depthwise convolution
        + 2 * value_heads  # A_log, dt_bias
        + (arch.linear_value_head_dim or 0)  # gated RMSNorm of the output
        + value * h  # out_proj
        + h  # input norm
    )
    if arch.num_experts:
        shared = arch.shared_expert_intermediate_size or 0
        expert = 3 * h * arch.moe_intermediate_size
        mlp_dense = arch.num_experts * h + (3 * h * shared + h if shared else 0) + h  # router, shared expert + gate, norm
        experts, active = arch.num_experts * expert, arch.num_experts_per_tok * expert
    else:
        mlp_dense, experts, active = 3 * h * arch.intermediate_size + h, 0, 0
    attention_layers = attention_layer_count(arch)
    return ModelSize(
        embedding=arch.vocab_size * h,
        output=0 if arch.tie_word_embeddings else arch.vocab_size * h,
        final_norm=h,
        attention_layers=attention_layers,
        linear_layers=arch.num_layers - attention_layers,
        attention_layer=attention,
        linear_layer=linear if arch.linear_num_key_heads else 0,
        mlp_dense=mlp_dense,
        experts=experts,
        active_experts=active,
    )


def kv_bytes_per_token(arch: ModelArchitecture, tp: int, dtype_bytes: int = 2) -> int:
    """Bytes one token adds to an inference engine's KV cache on one of `tp` ranks (full-attention
    layers only; KV heads fewer than the ranks are replicated, as vLLM does)."""
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
