"""What one training (or log-prob) micro batch keeps on a device: the tokens of a micro batch, the bytes
each token keeps per decoder layer for the backward pass, and the logits of the vocabulary-parallel loss.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run   # the actor rows' activations, logits

Two layer implementations (`planner.layer_spec`):
- `local`: megatron-core's plain PyTorch layers with flash attention, as bench/megatron_memory_probe.py
  builds them; calibrated against 17 measured H200 training steps (bench/results-h200-memory.json,
  ratios 0.975-1.060, kept within +-15% by tests/test_memory.py).
- `transformer_engine` (verl's images): the same attention terms; MoE layers as megatron-core 0.16 keeps
  them under TE grouped GEMM and the alltoall dispatcher, per token of T per layer (bytes, SP on,
  balanced routing; read from megatron-core's moe_layer.py, experts.py, token_dispatcher.py, moe_utils.py):
      [4H + router + permute + 5E] / TP      norm in/out, router, permute map, dispatcher-held probs/map
    + k ETP (2H + 4) / TP                    expert fc1 input and probs per routed row
    + c k F / TP + c Fs / TP                 fc1 output and activation output (c = 6 fused SwiGLU, 10 unfused)
  with router = 12k (softmax top-k) or 4E + 8k (sigmoid), permute = 8E + 4 (moe_permute_fusion) or 8k + E.
  A dense MLP keeps 4H + (6 fused, 8 unfused) F. Not measured here (TransformerEngine needs the cluster's
  image); the published runs (bench/bench_planner_reference.py) are its check.

Logits, one micro batch on the last pipeline stage, bytes per token per vocabulary entry of the TP shard
(verl 0.9.1's `_lm_head_logits_processor` and megatron-core's vocab-parallel cross entropy): the update 6
(bf16 logits and the fp32 copy the loss keeps), 10 with an entropy term; the old policy's log-prob pass 8
(verl always computes its entropy); the reference's 6.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from grpo_pipeline.profiles.model_size import family, head_dim, is_mla, linear_attention_dims

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import ModelArchitecture, RunProfile

LOGITS_UPDATE, LOGITS_UPDATE_ENTROPY, LOGITS_OLD_POLICY, LOGITS_REFERENCE = 6, 10, 8, 6


def _mixer_elements(arch: ModelArchitecture, linear: bool) -> float:
    """bf16 elements one token keeps in a layer's mixer (flash attention: no score matrix)."""
    if linear:
        key, value, conv = linear_attention_dims(arch)
        return conv + value + 2 * (arch.linear_num_value_heads or 0) + conv + 3 * value
    heads = arch.num_attention_heads
    if is_mla(arch):  # compressed q and kv, q up-projection and its rotary copy, kv up-projection, key, output
        qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        return (2 * (arch.q_lora_rank or 0) + 2 * arch.kv_lora_rank + 3 * heads * qk
                + heads * (arch.qk_nope_head_dim + arch.v_head_dim) + heads * arch.v_head_dim)
    d = head_dim(arch)
    q, kv = heads * d, arch.num_kv_heads * d
    # projections (queries with their gate), q/k norms, rotary outputs, attention output, o_proj input
    return q * (2 if arch.attention_output_gate else 1) + 2 * kv + (q + kv if arch.qk_norm else 0) + (q + kv) + 2 * q


def layer_bytes(p: RunProfile, linear: bool, moe: bool, tp: int, etp: int) -> float:
    """Bytes one token of a micro batch keeps in one decoder layer for the backward pass, per device
    (tensor and sequence parallel split them by TP): the mixer with its input norm, and the MLP."""
    arch = p.model.architecture
    return (4 * arch.hidden_size + 2 * _mixer_elements(arch, linear) + mlp_bytes(p, moe, etp)) / tp


def mlp_bytes(p: RunProfile, moe: bool, etp: int) -> float:
    """Bytes one token keeps in a layer's MLP with its norm (to be divided by TP)."""
    arch, h = p.model.architecture, p.model.architecture.hidden_size
    k, f, shared = arch.num_experts_per_tok or 1, arch.moe_intermediate_size or 0, arch.shared_expert_intermediate_size or 0
    if p.planner.layer_spec == "local":  # the norm's input and output, then:
        if moe:  # router logits and probs in fp32, each routed copy's input, fc1 output, activations
            return 4 * h + 2 * (4 * arch.num_experts + k * (2 * h + 4 * f / etp) + 4 * shared)
        return 4 * h + 8 * (arch.intermediate_size or 0)  # fc1's gate and up outputs, silu(gate), their product
    fam, overrides = family(arch), p.engine.transformer_overrides
    fused = bool(overrides.get("bias_activation_fusion", fam.fused_swiglu))
    if not moe:
        return 4 * h + (6 if fused else 8) * (arch.intermediate_size or 0)
    e = arch.num_experts
    router = 4 * e + 8 * k if fam.sigmoid_router else 12 * k
    permute = 8 * e + 4 if overrides.get("moe_permute_fusion", fam.permute_fusion) else 8 * k + e
    return 4 * h + router + permute + 5 * e + k * etp * (2 * h + 4) + (6 if fused else 10) * (k * f + shared)


def logits_bytes(p: RunProfile, tokens: float, tp: int, coefficient: int) -> float:
    return tokens * p.model.architecture.vocab_size / tp * coefficient


def update_logits_coefficient(p: RunProfile) -> int:
    return LOGITS_UPDATE_ENTROPY if p.algorithm.entropy_coeff else LOGITS_UPDATE


def micro_batch(sequences: float, max_length: int, cp: int, dynamic: bool, micro: int, budget: int) -> tuple[float, int]:
    """(tokens of one micro batch on one device, micro batches) for `sequences` of up to `max_length`
    tokens on a data-parallel rank. Fixed: `micro` sequences a micro batch, split over CP. Dynamic (verl's
    `rearrange_micro_batches`): micro batches of at most `budget` tokens a device (verl packs budget x CP
    tokens and gives each CP rank 1/CP), as many as the rank's tokens need; sized at the budget, the
    bound verl keeps (packing fills micro batches close to it), or the whole batch when it is smaller."""
    whole = sequences * max_length / cp
    if dynamic:
        return min(float(budget), whole), max(math.ceil(whole / budget), 1)
    return micro * max_length / cp, max(int(sequences // micro), 1)


def recompute(p: RunProfile) -> tuple[str, int] | None:
    """(method, layers) of full recomputation, None without it (selective recomputation is taken as none)."""
    o = p.engine.transformer_overrides
    if o.get("recompute_granularity") != "full":
        return None
    return str(o.get("recompute_method") or "uniform"), int(o.get("recompute_num_layers") or 1)


def stage_activations(p: RunProfile, per_layer: list[float], tokens: float, in_flight: float, tp: int) -> float:
    """Bytes of one pipeline stage's stored activations: `per_layer` bytes per token of its layers, for
    the micro batches in flight; under full recomputation the inputs of each recomputed chunk (block:
    the first `recompute_num_layers` layers, the rest stored), and one chunk recomputed during backward
    with its gradients beside it."""
    layers = len(per_layer)
    if not layers:
        return 0.0
    full, mean = sum(per_layer), sum(per_layer) / layers
    chunk_input = 2 * p.model.architecture.hidden_size / tp
    recomputed = recompute(p)
    if recomputed is None:
        return full * tokens * in_flight
    method, chunk = recomputed
    if method == "block":
        kept = min(chunk, layers) * chunk_input + sum(per_layer[min(chunk, layers):])
        return kept * tokens * in_flight + 2 * mean * tokens
    return layers / chunk * chunk_input * tokens * in_flight + 2 * min(chunk, layers) * mean * tokens
