"""The engine sections of a profile: the training engine (Megatron or FSDP2, through verl), the
inference engine that generates rollouts (vLLM) and log-prob recomputation.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --set engine.pp=8 --dry-run

The training engine is one class per `engine.strategy` (`MegatronEngine`, `FsdpEngine`: a pydantic
discriminated union), each with its own fields, so no reader asks which engine it holds: what each engine
does with them is registered by its strategy beside it, as verl registers its engines (planner/engines.py:
layout rules, memory estimate, step cost; backends/verl/engines.py: verl's overrides, node requirements).
Declared once and rendered to every role that runs the model, so the actor and the reference can never
disagree; the local backend reads the shared fields (dtype, padding).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from grpo_pipeline.store.bounded_read import short
from grpo_pipeline.profiles.section import MAX_DEVICES_PER_NODE, MAX_EXPERTS, MAX_LAYERS, MAX_SEQUENCES, MAX_TOKENS, Section

STRATEGY_DESCRIPTION = (
    "verl's training engine. `megatron`: Megatron-core's TP/PP/CP/EP layouts (MoE models, the largest dense ones; "
    "needs megatron-core, a bridge and, in practice, TransformerEngine); `fsdp`: PyTorch FSDP2, parameters, gradients "
    "and Adam's state sharded over `engine.fsdp_size` ranks (dense models, up to ~32B on one node; Hugging Face "
    "transformers modelling code, no TransformerEngine). The `engine.tp` ... `engine.etp`, pipeline, MTP, bridge and "
    "override settings are Megatron's; `fsdp_size`, `ulysses_sp` and `attn_implementation` are FSDP's.")


class TrainingEngine(Section):
    """What both training engines read; each engine's own settings are its subclass's. A setting of the
    other engine is refused, naming the engine it belongs to, except at its default: profiles saved before
    the engines were classes (profile.yaml, plan.json) hold both engines' settings, and the `best:` line of
    --suggest-layout resets the other engine's to their defaults."""

    strategy: str = Field(..., description=STRATEGY_DESCRIPTION)
    param_offload: bool = Field(False, description="Keep parameters (and grad buffers) on the host.")
    optimizer_offload: bool = Field(False, description="Keep optimizer state on the host.")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Training dtype.")
    use_remove_padding: bool = Field(
        True,
        description="Pack sequences without padding (THD). Must be off for Qwen3.5's Gated DeltaNet "
        "layers before megatron-core 0.18. The local backend packs its log-prob passes when this is on and "
        "generation.attn_implementation is flash_attention_2 (backends/local/packing.py).",
    )

    @model_validator(mode="before")
    @classmethod
    def refuse_the_other_engines_settings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept = dict(data)
        for name, value in data.items():
            owner = next((engine for engine in ENGINES.values() if name in engine.model_fields), None)
            if name in cls.model_fields or owner is None:
                continue  # unknown keys are Section's (extra="forbid")
            if problem := owner.value_problem(name, value):
                raise ValueError(f"engine.{name}={short(repr(value))}: {problem}")
            if not owner.is_default(name, value):
                raise ValueError(cls.foreign_setting(name, value, owner.default(name)))
            del kept[name]
        return kept

    @classmethod
    @abstractmethod
    def foreign_setting(cls, name: str, value: Any, default: Any) -> str:
        """The refusal of the other engine's setting `name` (given `value`, whose default is `default`)."""

    @classmethod
    def default(cls, name: str) -> Any:
        return cls.model_fields[name].get_default(call_default_factory=True)

    @classmethod
    def is_default(cls, name: str, value: Any) -> bool:
        """`value` is the field's default, and of its type (YAML's `true` is no TP of 1)."""
        default = cls.default(name)
        return type(value) is type(default) and value == default

    @classmethod
    def value_problem(cls, name: str, value: Any) -> str | None:
        """What this engine's own validation says of `value` for its field `name` (None: valid), so that a
        wrong value of the other engine's setting is named for what is wrong with it, as under its engine."""
        try:
            cls.__pydantic_validator__.validate_assignment(cls.model_construct(), name, value)
        except ValidationError as exc:
            message = exc.errors()[0]["msg"].removeprefix("Value error, ")
            return message[0].lower() + message[1:]
        return None

    def shared_settings(self) -> dict[str, Any]:
        """The settings every engine reads, carried into another engine (a layout search's candidates)."""
        return {name: getattr(self, name) for name in TrainingEngine.model_fields if name != "strategy"}

    @abstractmethod
    def layout_fields(self) -> dict[str, Any]:
        """The planner's `Layout` fields this engine's settings give (planner/parallel.py)."""

    @abstractmethod
    def data_parallel(self, world: int) -> int:
        """The data-parallel ranks a batch splits over on `world` devices (0 when the layout does not divide it)."""


class MegatronEngine(TrainingEngine):
    """Megatron-core through verl: tensor, pipeline, context and expert parallelism, a bridge that loads the
    Hugging Face weights, megatron-core's own config overrides."""

    strategy: Literal["megatron"] = Field("megatron", description=STRATEGY_DESCRIPTION)
    # verl's Megatron actor exempts biases and 1-D parameters (norms) from weight decay (megatron-core's optimizer
    # param groups: wd_mult 0), as transformers' Trainer does.
    decays_every_parameter: ClassVar[bool] = False
    tp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Tensor parallel size.")
    pp: int = Field(1, gt=0, le=MAX_LAYERS, description="Pipeline parallel size.")
    vpp: int | None = Field(None, gt=0, le=MAX_LAYERS, description="Virtual pipeline stages per rank (null: off).")
    cp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Context parallel size.")
    ep: int = Field(1, gt=0, le=MAX_EXPERTS, description="Expert parallel size.")
    etp: int = Field(1, gt=0, le=MAX_DEVICES_PER_NODE, description="Expert tensor parallel size.")
    mtp: bool = Field(
        False, description="Train the checkpoint's multi-token-prediction layers too (verl's "
        "`actor_rollout_ref.model.mtp.enable`; off: verl builds none).")
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
    use_mbridge: bool = Field(
        True, description="Load Hugging Face safetensors directly through a bridge."
    )
    vanilla_mbridge: bool = Field(
        False,
        description="True: the legacy `mbridge` package; False: NVIDIA Megatron-Bridge "
        "(MindSpeed on Ascend).",
    )
    transformer_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Megatron TransformerConfig fields to override."
    )
    optimizer_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Megatron optimizer config fields to override."
    )

    @classmethod
    def foreign_setting(cls, name: str, value: Any, default: Any) -> str:
        return f"engine.strategy=megatron: engine.{name}={value} is an FSDP setting; set engine.strategy=fsdp, or " \
               f"leave engine.{name} out"

    def layout_fields(self) -> dict[str, Any]:
        """The planner's `Layout` fields this engine's settings give (planner/parallel.py)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp,
                "optimizer_cpu_offload": bool(self.optimizer_overrides.get("optimizer_cpu_offload")),
                "first_stage_layers": self.num_layers_in_first_pipeline_stage,
                "last_stage_layers": self.num_layers_in_last_pipeline_stage,
                "embedding_in_split": self.account_for_embedding_in_pipeline_split,
                "loss_in_split": self.account_for_loss_in_pipeline_split}

    def data_parallel(self, world: int) -> int:
        """Megatron's data-parallel ranks: what TP x PP x CP leave of the world (0 when they do not divide it)."""
        model_parallel = self.tp * self.pp * self.cp
        return world // model_parallel if world % model_parallel == 0 else 0


class FsdpEngine(TrainingEngine):
    """PyTorch FSDP2 through verl: parameters, gradients and Adam's state sharded over `fsdp_size` ranks,
    Ulysses sequence parallelism, transformers' modelling code."""

    strategy: Literal["fsdp"] = Field("fsdp", description=STRATEGY_DESCRIPTION)
    # verl's FSDP actor decays every parameter (workers/config/optimizer.py build_optimizer over module.parameters()).
    decays_every_parameter: ClassVar[bool] = True
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

    @classmethod
    def foreign_setting(cls, name: str, value: Any, default: Any) -> str:
        return (f"engine.strategy=fsdp: engine.{name}={value!r} is a Megatron setting FSDP does not read; set "
                f"engine.{name}={_plain(default)} (FSDP shards over engine.fsdp_size ranks) or engine.strategy=megatron")

    def layout_fields(self) -> dict[str, Any]:
        """The planner's `Layout` fields this engine's settings give: no model parallelism, a group and Ulysses."""
        return {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "optimizer_cpu_offload": False,
                "fsdp_size": self.fsdp_size, "ulysses_sp": self.ulysses_sp}

    def data_parallel(self, world: int) -> int:
        """FSDP's data-parallel ranks: what Ulysses leaves of the world (0 when it does not divide it)."""
        return world // self.ulysses_sp if world % self.ulysses_sp == 0 else 0


# Each engine by its `engine.strategy`: what the planner's and the verl backend's registries are keyed by.
ENGINES: dict[str, type[TrainingEngine]] = {engine.model_fields["strategy"].default: engine
                                            for engine in (MegatronEngine, FsdpEngine)}



def strategy(engine: Any) -> str | None:
    """The engine a section is (pydantic's discriminator): its `strategy`, Megatron's when it names none (a
    recipe's or a --set's engine settings alone). A callable, as the string form refuses the before-validators
    every Section has."""
    if isinstance(engine, dict):
        return engine.get("strategy", "megatron")
    return getattr(engine, "strategy", None)


EngineSection = Annotated[Annotated[MegatronEngine, Tag("megatron")] | Annotated[FsdpEngine, Tag("fsdp")],
                          Discriminator(strategy)]


def _plain(value: object) -> str:
    """A default as `--set` writes it."""
    return "null" if value is None else "{}" if value == {} else str(value).lower() if isinstance(value, bool) else str(value)


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
