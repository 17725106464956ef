"""The engine sections of a profile: the training engine (Megatron or FSDP2, through verl), the
inference engine that generates rollouts (vLLM) and log-prob recomputation.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --set engine.pp=8 --dry-run

Declared once and rendered to every role that runs the model (backends/verl/command.py), so the actor
and the reference can never disagree; the local backend reads the dtype and the rollout length.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grpo_pipeline.profiles.section import MAX_DEVICES_PER_NODE, MAX_EXPERTS, MAX_LAYERS, MAX_SEQUENCES, MAX_TOKENS, Section


class EngineSection(Section):
    """Training-engine settings, declared once and rendered to every role that runs the model
    (actor and reference), so the roles can never disagree."""

    strategy: Literal["megatron", "fsdp"] = Field(
        "megatron", description="verl's training engine. `megatron`: Megatron-core's TP/PP/CP/EP layouts (MoE models, "
        "the largest dense ones; needs megatron-core, a bridge and, in practice, TransformerEngine); `fsdp`: PyTorch "
        "FSDP2, parameters, gradients and Adam's state sharded over `engine.fsdp_size` ranks (dense models, up to "
        "~32B on one node; Hugging Face transformers modelling code, no TransformerEngine). The `engine.tp` ... "
        "`engine.etp`, pipeline, MTP and override settings are Megatron's; `fsdp_size`, `ulysses_sp` and "
        "`attn_implementation` are FSDP's.")
    fsdp_size: int = Field(
        -1, ge=-1, le=MAX_DEVICES_PER_NODE * 1024,
        description="FSDP: ranks one copy of the model is sharded over (verl's `fsdp_config.fsdp_size`); -1: the whole "
        "world. A smaller group (e.g. one node's devices) is replicated over the rest (hybrid sharding).")
    ulysses_sp: int = Field(
        1, gt=0, le=MAX_DEVICES_PER_NODE,
        description="FSDP: Ulysses sequence-parallel size; each sequence's tokens are split over this many ranks "
        "(attention heads all-to-all). Must divide the attention heads; needs `use_remove_padding`.")
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = Field(
        "sdpa",
        description="FSDP: the transformers attention of the actor and reference (`model.override_config`). verl's "
        "own default is `flash_attention_2`, which needs flash-attn on every node; `sdpa` needs nothing more.")
    tp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Tensor parallel size.")
    pp: int = Field(1, gt=0, le=MAX_LAYERS, description="Pipeline parallel size.")
    vpp: int | None = Field(None, gt=0, le=MAX_LAYERS, description="Virtual pipeline stages per rank (null: off).")
    cp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Context parallel size.")
    ep: int = Field(1, gt=0, le=MAX_EXPERTS, description="Expert parallel size.")
    etp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Expert tensor parallel size.")
    num_layers_in_first_pipeline_stage: int | None = Field(
        None, gt=0, le=MAX_LAYERS,
        description="Uneven pipeline: decoder layers of the first stage (megatron-core's field, rendered through "
        "`override_transformer_config`); empty: an even split. The middle stages share the rest evenly.")
    num_layers_in_last_pipeline_stage: int | None = Field(
        None, gt=0, le=MAX_LAYERS, description="Uneven pipeline: decoder layers of the last stage; empty: an even split.")
    account_for_embedding_in_pipeline_split: bool = Field(
        False, description="Count the embedding as one layer of the first stage when the layers are split over "
        "the pipeline (it then builds one decoder layer fewer); not with the first/last stage counts.")
    account_for_loss_in_pipeline_split: bool = Field(
        False, description="Count the output layer and loss as one layer of the last stage when the layers are "
        "split over the pipeline; not with the first/last stage counts.")
    mtp: bool = Field(
        False, description="Train the checkpoint's multi-token-prediction layers too (verl's "
        "`actor_rollout_ref.model.mtp.enable`; off: verl builds none).")
    param_offload: bool = Field(False, description="Keep parameters (and grad buffers) on the host.")
    optimizer_offload: bool = Field(False, description="Keep optimizer state on the host.")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Training dtype.")
    use_mbridge: bool = Field(
        True, description="Load Hugging Face safetensors directly through a bridge."
    )
    vanilla_mbridge: bool = Field(
        False,
        description="True: the legacy `mbridge` package; False: NVIDIA Megatron-Bridge "
        "(MindSpeed on Ascend).",
    )
    use_remove_padding: bool = Field(
        True,
        description="Pack sequences without padding (THD). Must be off for Qwen3.5's Gated DeltaNet "
        "layers before megatron-core 0.18. The local backend packs its log-prob passes when this is on and "
        "generation.attn_implementation is flash_attention_2 (backends/local/packing.py).",
    )
    transformer_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Megatron TransformerConfig fields to override."
    )
    optimizer_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Megatron optimizer config fields to override."
    )


class RolloutSection(Section):
    engine: Literal["vllm"] = Field("vllm", description="Inference engine that generates rollouts.")
    tp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Tensor parallel size of the inference engine.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of device memory the inference engine may take."
    )
    max_model_len: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="Context length the inference engine reserves (prompt + response)."
    )
    max_num_seqs: int = Field(
        256, gt=0, le=MAX_SEQUENCES, description="Sequences vLLM runs at once (verl's default); the KV cache should hold this many.")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Inference dtype.")
    update_weights_bucket_megabytes: int = Field(
        512, gt=0, description="Size of the buckets that carry new weights to the inference engine."
    )
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra vLLM engine arguments (e.g. `mm_processor_cache_gb`)."
    )


class GenerationSection(Section):
    """How the local backend generates its rollouts and the evaluation stage its responses: the same
    model doing the same work, on the same settings. Library options only (transformers' generate,
    TRL, vLLM); the device profiles hold the fastest measured for each device. What `auto` means on the
    host is decided once, at planning, by generation/plan.py (`GenerationPlan`)."""

    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto",
        description="`vllm`: vLLM (vllm-ascend on NPUs) in colocate mode through TRL, `rollout.gpu_memory_utilization` "
        "of the device; `transformers`: `generate` with the settings below; `auto`: vLLM when it is importable on "
        "a GPU or NPU, else transformers.",
    )
    cache: Literal["dynamic", "static"] = Field(
        "dynamic", description="KV cache of `generate`: `static` preallocates it, which compiled decoding needs."
    )
    compile: bool = Field(
        False,
        description="Compile the decode step (torch.compile; CUDA graphs on GPUs): one launch per token instead "
        "of hundreds. Needs `cache: static`; the first generation pays the compilation.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernels of the transformers model (`flash_attention_2` needs flash-attn)."
    )
    steps_per_generation: int = Field(
        1,
        gt=0,
        le=MAX_SEQUENCES,
        description="GRPO steps whose prompts are generated in one round (one large batch instead of several "
        "small ones); the later steps of a round update on responses of a slightly older policy, which GRPO's "
        "clipped importance ratio accounts for. 1: every step generates from the current policy, as verl does.",
    )
    decoder: Literal["auto", "native", "generate"] = Field(
        "auto",
        description="How the transformers engine decodes. `native`: the project's decode loop (static KV cache; "
        "with `compile`, the step compiled and, on CUDA GPUs, captured whole in a CUDA graph; sampling and "
        "end-of-sequence on the device) for Llama-family models (Llama, Qwen2, Qwen3, Mistral), transformers' "
        "`generate` for any other; `generate`: transformers' `generate` with `cache` and `compile`; `auto`: "
        "native on CUDA GPUs, `generate` elsewhere.",
    )


class LogProbSection(Section):
    """Log-prob recomputation settings, shared by the rollout (old log-probs) and the reference."""

    micro_batch_size_per_gpu: int = Field(
        1, gt=0, le=MAX_SEQUENCES, description="Sequences per device per log-prob forward pass."
    )
    max_token_len_per_gpu: int = Field(
        8192, gt=0, le=MAX_TOKENS, description="Token budget per device when dynamic batch size is on."
    )
    use_dynamic_bsz: bool = Field(False, description="Pack log-prob batches by token count.")
