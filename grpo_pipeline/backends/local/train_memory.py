"""Does the local backend's training step fit a device without gradient checkpointing? Decided at planning.

    python -m grpo_pipeline --model /models/Qwen3-0.6B --device auto --dry-run   # "# memory plan: gradient checkpointing: off (...)"

Recomputing every layer's activations in the backward pass costs about a third more forward compute, so
`LocalBackend.detected_layer` turns `model.enable_gradient_checkpointing` off on a host whose devices it
counted when the step without it fits a device with room to spare (HEADROOM of the device, plus
platform.reserved_memory_gib); a recipe, a profile file or --set still wins. Per device, one worker: TRL's
GRPOTrainer on the model loaded in the run's dtype (bf16 on a GPU) with `bf16=True` (backends/local/worker.py):
- state: the parameters and their gradients in the parameters' dtype; the optimizer's fp32 copies of 16-bit
  parameters (backends/local/master_weights.py, as verl's actor keeps fp32 weights) and AdamW's two fp32
  moments; during the step the copies' fp32 gradients, the 16-bit ones freed as they are made; with more
  than one worker DDP's buckets, a second copy of the gradients (gradient_as_bucket_view is off); with a KL
  term TRL's reference model, a second copy of the weights. With LoRA (the profile's `lora`) only the adapter
  trains: its fp32 weights, gradients and moments replace the base model's (backends/local/lora.py), and the
  reference is the base with the adapter disabled, no copy. The optimizer step adds nothing the size of
  the parameters: with torch >= 2.9 (pyproject.toml) transformers picks the fused AdamW, which updates in
  place (verl's foreach step keeps an fp32 temporary: planner/fsdp.py), so the peak is in the backward pass.
- activations of one micro batch, actor.ppo_micro_batch_size_per_gpu sequences x (max_prompt_length +
  max_response_length) tokens, as the transformers layers keep them (planner/fsdp.py `hf_layer_bytes`).
  Without checkpointing every layer's set is held when backward starts, then the larger of the LM head's
  backward and one layer's backward working set (`backward_working_bytes`); with it each layer's input, then
  the larger of the head's backward and one recomputed layer. Attention other than flash-attention takes the
  padded batch's mask, which SDPA turns into the compute dtype for each layer's call and keeps for backward
  (and then repeats keys and values to every head: its GQA path takes no mask); eager attention also keeps
  the probabilities (fp32 softmax output and its bf16 copy).
- the LM head: TRL 1.16's GRPOTrainer always scores through its chunked fused head (trl add_fused_lm_head,
  ChunkedLogProbFunction), so the (tokens x vocabulary) logits never exist; its backward holds fp32
  gradients of its input and weight, their casts to the parameters' dtype, and one (4096 x 32768) tile.
- what rollouts keep through the step: the native decoder reuses its static KV cache and its packed q/k/v and
  gate/up copies every round (generation/decoding.py); vLLM colocated keeps its share of the device
  (rollout.gpu_memory_utilization); transformers' generate makes its cache for each call and frees it.
Not counted (the headroom's part): the allocator's fragmentation, compiled graphs' pools, kernels'
workspaces, TRL's per-token loss terms (tens of bytes a token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_pipeline.backends.local.lora import adapter_activation_bytes, adapter_state
from grpo_pipeline.backends.local.master_weights import trains_master_weights
from grpo_pipeline.backends.local.rollout_memory import DTYPE_BYTES, GIB, decoding_state
from grpo_pipeline.generation.decode_step import CACHE_BLOCK
from grpo_pipeline.generation.decoding import SUPPORTED_MODEL_TYPES
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.planner.fsdp import activation_bytes, backward_working_bytes
from grpo_pipeline.planner.lora import AdapterSize
from grpo_pipeline.planner.roles import HEADROOM
from grpo_pipeline.profiles.model_size import head_dim, model_size, size_problems
from grpo_pipeline.profiles.schema import RunProfile

# TRL 1.16's fused LM head (trl/kernels/chunked_logprob.py): TOKEN_CHUNK_SIZE tokens x the trainer's
# _CHUNKED_LOGPROB_CHUNK_SIZE vocabulary entries per tile, in the compute dtype.
HEAD_TILE_TOKENS, HEAD_TILE_VOCAB = 4096, 32768
FP32_BYTES = 4  # AdamW's moments and the master weights
ACTIVATION_BYTES = 2  # hf_layer_bytes counts bf16 activations, as the GPU runs them
# Eager attention keeps each score's fp32 softmax output and its bf16 copy for the product with the values.
EAGER_SCORE_BYTES = 4 + 2


@dataclass(frozen=True)
class StepMemory:
    """Bytes one worker's training step holds at its peak, by part."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class CheckpointingChoice:
    """Whether the step needs gradient checkpointing on this device, and the numbers that decided it."""

    enabled: bool
    needed: float  # bytes of the step without checkpointing, what rollouts keep included
    usable: float  # the device's bytes less the headroom and platform.reserved_memory_gib
    device: str  # its model (an accelerator row's name) or kind
    device_memory: float
    source: str  # where the device's memory comes from

    def describe(self, profile_value: bool, counted: bool) -> str:
        """One line for the dry run: what the profile has (`profile_value`, the resolved
        model.enable_gradient_checkpointing) and why; `counted`: the devices were counted on this host, so
        `LocalBackend.detected_layer` decided, below a recipe, a profile file and --set."""
        numbers = (f"the training step {'would need' if profile_value else 'needs'} {self.needed / GIB:.1f} GiB "
                   f"without it, {'more than' if self.enabled else 'within'} the {self.usable / GIB:.1f} GiB usable "
                   f"of the {self.device_memory / GIB:.1f} GiB {self.device} ({self.source})")
        state = "on" if profile_value else "off"
        if profile_value == self.enabled:
            return f"gradient checkpointing: {state} ({numbers})"
        if not counted:
            return (f"gradient checkpointing: {state}, as the profile has it: no devices were counted on this host "
                    f"(--device auto counts them), and the local backend decides only for those ({numbers})")
        advice = "" if profile_value else "; set model.enable_gradient_checkpointing=true if the step runs out of memory"
        return f"gradient checkpointing: {state}, as a recipe, a profile file or --set has it ({numbers}{advice})"


def step_memory(p: RunProfile, generation: GenerationPlan, checkpointing: bool, device_memory: float) -> StepMemory | None:
    """The step's peak on one device of `device_memory` bytes, rollouts and the model's attention as the
    run's `generation` plan has them (the module's model); None when the model cannot be sized."""
    arch = p.model.architecture
    if size_problems(arch):
        return None
    size = model_size(arch)
    run_dtype = p.platform.run_dtype(p.engine.dtype)
    dtype = DTYPE_BYTES.get(run_dtype, 4)
    parameters = size.total * dtype
    # TRL's beta = 0: no reference model; with LoRA the reference is the base with the adapter disabled.
    uses_reference = p.algorithm.use_kl_loss and p.algorithm.kl_loss_coef > 0 and p.builds_reference_model
    adapter_parts, adapter = adapter_state(p, p.world_size)
    if adapter_parts:  # only the adapter trains: its gradients and AdamW's moments, not the base model's
        state = {"weights": parameters, **adapter_parts}
    else:  # full fine-tuning (or an adapter on a model PEFT must size itself: counted as full, the safe side)
        # A 16-bit policy's optimizer steps fp32 copies (master_weights.py); the step's fp32 gradients replace the
        # 16-bit ones as they are made: counted as their difference on top of the backward's state (the safe side).
        master = FP32_BYTES * size.total if trains_master_weights(run_dtype) else 0.0
        state = {"weights": parameters, "gradients": parameters, "fp32 master weights": master,
                 "step's fp32 gradients": master - parameters if master else 0.0,
                 "optimizer": 2 * FP32_BYTES * size.total,
                 "DDP buckets": parameters if p.world_size > 1 else 0.0,
                 "reference model": parameters if uses_reference else 0.0}

    length = p.data.max_prompt_length + p.data.max_response_length
    tokens = p.actor.ppo_micro_batch_size_per_gpu * length
    attention = _attention_extra_bytes(p, generation, length) * tokens  # one full-attention layer's
    attention_layers = sum(not linear for linear, _ in size.layer_kinds)
    # The final norm's input and output, and the fused head's copy of the scored positions' hidden states.
    head_input = 3 * ACTIVATION_BYTES * arch.hidden_size * tokens
    lora = adapter_activation_bytes(p, adapter) * tokens  # one layer's adapters' saved inputs
    if checkpointing:
        stored, recomputed = activation_bytes(p, size, tokens, checkpointing=True)
        backward = recomputed + attention + lora
    else:
        stored = activation_bytes(p, size, tokens, checkpointing=False)[0] + attention_layers * attention
        stored += arch.num_layers * lora
        backward = max(backward_working_bytes(p, *kind) for kind in size.layer_kinds) * tokens
    # The head's backward runs first, with every stored activation held; its temporaries are gone before
    # the last layer's backward (or recomputation) starts: the peak holds the larger of the two.
    activations = {"activations": stored + head_input, "backward": max(_head_backward_bytes(p, tokens, dtype), backward)}
    return StepMemory({**{k: v for k, v in state.items() if v}, **activations,
                       **_rollouts_kept(p, generation, dtype, device_memory, adapter)})


def checkpointing_choice(p: RunProfile, generation: GenerationPlan, detected_names: list[str] | None = None,
                         detected_gib: list[float] | None = None) -> CheckpointingChoice | None:
    """Whether the step needs gradient checkpointing on one of the devices (the detected ones when
    given, else the platform's): off only when it fits without. None on a CPU (memory is plenty there,
    compute is not: the profile's value stands), and where the device's memory or the model's size is unknown."""
    platform = p.platform
    if not platform.accelerated:
        return None
    device, memory_gib, source = platform.device_memory(detected_names, detected_gib)
    if memory_gib is None:
        return None
    device_memory = memory_gib * GIB
    if (needed := step_memory(p, generation, checkpointing=False, device_memory=device_memory)) is None:
        return None
    usable = device_memory * (1 - HEADROOM) - platform.reserved_memory_gib * GIB
    return CheckpointingChoice(enabled=needed.total > usable, needed=needed.total, usable=usable, device=device,
                               device_memory=device_memory, source=source)


def _attention_extra_bytes(p: RunProfile, generation: GenerationPlan, length: int) -> float:
    """Bytes per token one full-attention layer keeps beyond `hf_layer_bytes` (which counts flash-attention,
    no mask and no scores) with the masked kernels: the mask in the compute dtype, keys and values repeated
    to every query head, and eager's probabilities."""
    attn = generation.attn_implementation  # the kernels the worker loads the model with
    if attn == "flash_attention_2":
        return 0.0
    arch = p.model.architecture
    queries = arch.num_attention_heads * head_dim(arch)
    repeated = 2 * ACTIVATION_BYTES * queries if arch.num_kv_heads < arch.num_attention_heads else 0
    scores = EAGER_SCORE_BYTES * arch.num_attention_heads * length if attn == "eager" else 0
    return ACTIVATION_BYTES * length + repeated + scores


def _head_backward_bytes(p: RunProfile, tokens: float, dtype: int) -> float:
    """The fused LM head's backward: fp32 gradients of its input and weight and their casts, one tile."""
    arch = p.model.architecture
    tile = min(tokens, HEAD_TILE_TOKENS) * HEAD_TILE_VOCAB * dtype
    return (tokens + arch.vocab_size) * arch.hidden_size * (4 + dtype) + tile


def _rollouts_kept(p: RunProfile, plan: GenerationPlan, dtype: int, device_memory: float,
                   adapter: AdapterSize | None = None) -> dict[str, float]:
    """What the rollouts' engine keeps on the device through the training step."""
    if plan.engine == "vllm":
        return {"vLLM's share": p.rollout.gpu_memory_utilization * device_memory}
    arch = p.model.architecture
    # A model outside the native decoder's family falls back to generate in the worker; one whose family
    # the profile does not name is counted as if it did not.
    if not plan.native or (arch.model_type and arch.model_type not in SUPPORTED_MODEL_TYPES):
        return {}  # generate's cache lives for one call
    per_position, linear_state = decoding_state(p, dtype)
    positions = CACHE_BLOCK * math.ceil((p.data.max_prompt_length + p.data.max_response_length) / CACHE_BLOCK)
    d, h = head_dim(arch), arch.hidden_size
    packed = arch.num_layers * ((arch.num_attention_heads + 2 * arch.num_kv_heads) * d + 2 * (arch.intermediate_size or 0)) * h
    # An adapted o_proj / down_proj is read merged from a decoder-side copy (generation/adapted.py); q/k/v and
    # gate/up are in the packed copies already.
    merged = arch.num_layers * sum(adapter.per_layer.get(name, 0) * out for name, out in
                                   (("o_proj", h), ("down_proj", h))) if adapter else 0
    return {"rollout KV cache": per_position * positions + linear_state, "rollout packed weights": (packed + merged) * dtype}
