"""The local backend's LoRA: the profile's `lora` section as TRL's `peft_config`, and what the adapter keeps on a device.

    python -m grpo_pipeline --model tiny --device cpu --set lora.rank=8 --set algorithm.lr=1e-3

TRL's GRPOTrainer wraps the loaded model with PEFT (`get_peft_model`) when given a `peft_config`: only the
adapter's A and B train (in fp32: PEFT's `autocast_adapter_dtype`), so the step keeps gradients and AdamW's
moments for them alone. With a KL term the reference policy is the same model with the adapter disabled
(TRL's `use_adapter(model, None)`): no second copy of the weights. Rollouts: transformers' `generate` runs the
PEFT model's forward; the native decoder reads each adapted layer merged (generation/adapted.py). Checkpoints
hold the adapter (TRL saves the PEFT model); the export stage writes the adapter alone and the merged model
(checkpoints/lora_export.py), and evaluation runs on the merged one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_pipeline.planner.lora import AdapterSize, adapter_size

if TYPE_CHECKING:
    from grpo_pipeline.profiles.lora import LoraSection
    from grpo_pipeline.profiles.schema import RunProfile

ADAPTER_BYTES = 4  # PEFT keeps the adapter in fp32 (autocast_adapter_dtype) whatever the base model's dtype
INPUT_COPY_BYTES = 2  # an activation in the compute dtype (bf16 under the trainer's autocast)


def peft_config(lora: LoraSection):
    """The section as PEFT's LoraConfig (a causal LM; biases stay frozen)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules, bias="none")


def adapter_state(p: RunProfile, workers: int) -> tuple[dict[str, float], AdapterSize | None]:
    """What the adapter adds to one worker's state, by part: its fp32 weights, their gradients, AdamW's two
    moments and, with more than one worker, DDP's bucket copy of the gradients."""
    size = adapter_size(p)
    if size is None:
        return {}, None
    adapter = size.parameters * ADAPTER_BYTES
    parts = {"adapter": adapter, "adapter gradients": adapter, "adapter optimizer": 2 * adapter,
             "adapter DDP buckets": adapter if workers > 1 else 0.0}
    return {k: v for k, v in parts.items() if v}, size


def adapter_activation_bytes(p: RunProfile, size: AdapterSize | None) -> float:
    """Bytes per token one decoder layer's adapters keep for the backward pass beyond what full training keeps.

    A frozen base weight needs no gradient, so its linear keeps no input; A's weight gradient needs that same
    input, so the adapter keeps what full training kept (already in `hf_layer_bytes`): only B's input, A x
    (r values), is new. Dropout gives A an input of its own: its mask and the dropped copy. Measured on an
    H100 (bench/results-h100-lora-table.json: LoRA r16 on all-linear adds about 0.02 GiB a 1,280-token
    sequence over full training at Qwen3 0.6B) and on the CPU by what autograd saves (tests/test_lora_planning.py).
    """
    if size is None:
        return 0.0
    dropout = 1 + INPUT_COPY_BYTES if p.lora.dropout else 0
    return sum(dropout * features + INPUT_COPY_BYTES * p.lora.rank for features in size.per_layer.values())
