"""A policy with a LoRA adapter (PEFT), as the native decoder reads it: the weights it computes with.

    .venv/bin/python -m pytest -q tests/test_lora_decoding.py   # the decoder's log-probs are the trainer's, adapter on

PEFT keeps the base weight W of each adapted linear layer as it was and adds the adapter's term
(alpha / r) x B (A x) in the layer's forward. The native decoder (generation/decoding.py) does not run
the modules' forward: it reads weights. Reading an adapted layer's `.weight` gives PEFT's base weight, so
the adapter would be silently ignored (the rollouts would come from the base model while the trainer
scores them with the adapter on). Here each adapted layer gets a decoder-side copy of its merged weight
W + (alpha / r) B A, written again at every weight sync (`NativeDecoder._refresh_weights`, before each
round's rollouts): the decoder's step then runs as fast as on a plain model, at the cost of one copy of
the adapted weights. A layer without an adapter (or with adapters disabled, as for the reference policy)
is read in place, as before.
"""

from __future__ import annotations


def base_model_of(model):
    """The transformers model under a PEFT wrapper (its adapted layers are PEFT's), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def is_adapted(linear) -> bool:
    """The layer adds an active, unmerged adapter's term to its output (a PEFT tuner layer)."""
    if not hasattr(linear, "base_layer") or not hasattr(linear, "get_delta_weight"):
        return False
    return not linear.disable_adapters and not linear.merged and any(
        name in getattr(linear, "lora_A", {}) for name in linear.active_adapters)


def adapter_refusal(model) -> str | None:
    """Why the decoder cannot compute with this model's adapter (None: it can, or there is none)."""
    model = base_model_of(model)
    ends = [model.get_input_embeddings(), model.get_output_embeddings()]
    if any(is_adapted(module) or hasattr(module, "base_layer") for module in ends if module is not None):
        return "a LoRA adapter on the embedding or output layer"
    for module in model.modules():
        if is_adapted(module):
            variants = getattr(module, "lora_variant", {}) or {}
            if any(name in variants for name in module.active_adapters):
                return "a LoRA variant (DoRA, ...) whose term is not a low-rank product"
    return None


def weight_for_decoding(linear, device, dtype):
    """The tensor the decoder reads for this layer: its weight itself, or an empty decoder-side copy of the
    merged weight for an adapted layer (`write_merged` fills it)."""
    import torch

    if not is_adapted(linear):
        return linear.weight
    return torch.empty_like(linear.weight, device=device, dtype=dtype)


def merged_weight(linear):
    """W + (alpha / r) B A for every active adapter of the layer (W itself without one), in W's dtype."""
    weight = linear.weight
    if not is_adapted(linear):
        return weight
    merged = weight.float()
    for name in linear.active_adapters:
        if name in linear.lora_A:
            merged = merged + linear.get_delta_weight(name).float()
    return merged.to(weight.dtype)


def write_merged(linear, out) -> None:
    """The layer's merged weight into the decoder's copy `out` (nothing for a layer read in place)."""
    if out is not linear.weight:
        out.copy_(merged_weight(linear))
