"""verl's side of each training engine, registered by its `engine.strategy` beside the profile's engine classes
(profiles/engine.py), as verl registers its engines: the `model_engine` config group, each role's overrides,
what a node needs, the rules verl checks and whether verl trains a LoRA adapter with it.

    python -m grpo_pipeline --model smollm2-135m --device gpu --backend verl --dry-run                            # fsdp
    python -m grpo_pipeline --model smollm2-135m --device gpu --backend verl --set engine.strategy=megatron --dry-run

The command (backends/verl/command.py) and the node requirements (backends/verl/requirements.py) are the same
for both engines but for what `verl_engine(profile)` adds; facts about the bridges are in
`../shared/reference/verl-cluster-notes.md`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from grpo_pipeline.planner.memory import plan_of  # imported from memory.py, which registers both engines' plans
from grpo_pipeline.planner.rules import UNEVEN_PIPELINE_FIELDS, batch_problems, rollout_problems
from grpo_pipeline.profiles.engine import FsdpEngine, MegatronEngine, TrainingEngine
from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.schema import RunProfile

# Hydra's `++key=value` adds a key or overrides it. Free-form maps (transformer / optimizer
# overrides, vLLM kwargs, env vars) get it because whether verl's defaults already hold a key
# there differs per key and per release; typed keys stay plain so a renamed key fails loudly.
ADD_OR_OVERRIDE = "++"

# verl 0.9.1's own `override_transformer_config` defaults (trainer/config/engine/megatron.yaml). The
# actor starts from them; the reference would start from an empty dict once any key of its map is
# set. Writing the defaults to both roles keeps the two maps identical (the compose test checks it).
VERL_TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "recompute_granularity": None,
    "recompute_modules": ["core_attn"],
    "recompute_method": None,
    "recompute_num_layers": None,
    "attention_backend": "flash",
}
FSDP_VERSION = "fsdp2"  # verl 0.9.1's dp actor still defaults to FSDP1 (`strategy: fsdp`)


class VerlEngine(ABC):
    """What the verl backend does with one training engine. Subclasses set `engine` (the profile's class) and
    `model_engine`, and are registered with `@verl_engine_for`."""

    engine: ClassVar[type[TrainingEngine]]
    model_engine: ClassVar[str]  # verl's `model_engine` config group (trainer/config/model_engine/*.yaml)
    trains_lora: ClassVar[bool] = False  # verl 0.9.1's LoRA here is its FSDP engine's (PEFT): backends/verl/lora.py

    @abstractmethod
    def role_settings(self, profile: RunProfile, role: str) -> dict[str, Any]:
        """The engine's settings of one role (`actor` or `ref`), declared once in the profile."""

    def model_settings(self, profile: RunProfile) -> dict[str, Any]:
        """`actor_rollout_ref.model` keys only this engine has."""
        return {}

    @abstractmethod
    def actor_settings(self, profile: RunProfile) -> dict[str, Any]:
        """The actor's keys beside its role settings that only this engine has."""

    def optimizer_settings(self, profile: RunProfile) -> dict[str, Any]:
        """Overrides of the actor's optimizer config (only Megatron's has a free-form one here)."""
        return {}

    @abstractmethod
    def requirements(self, profile: RunProfile) -> dict[str, NodeRequirement]:
        """What every training node needs for this engine."""

    def problems(self, profile: RunProfile) -> list[str]:
        """The layout rules (the planner's), vLLM's, and the batches over this engine's data-parallel ranks."""
        p = profile
        return plan_of(p.engine.strategy).problems(p) + rollout_problems(p) + \
            batch_problems(p, data_parallel=p.engine.data_parallel(p.world_size))


VERL_ENGINES: dict[str, VerlEngine] = {}


def verl_engine_for(engine: type[VerlEngine]) -> type[VerlEngine]:
    """Register verl's side of an engine under its profile class's strategy."""
    VERL_ENGINES[engine.engine.model_fields["strategy"].default] = engine()
    return engine


def verl_engine(profile: RunProfile) -> VerlEngine:
    return VERL_ENGINES[profile.engine.strategy]


class Bridge(NamedTuple):
    """One of the two bridges verl can build the model with, and how it finds a model."""

    name: str
    distribution: str
    registry: str  # `module:attribute` of the names it has a bridge for
    found_by: str  # what of the checkpoint it looks the model up by
    setting: str  # engine.vanilla_mbridge's value that selects it
    install: str


# mbridge fills a dict (model_type -> bridge class) when imported; Megatron-Bridge lists the
# architecture class names it has a bridge for.
BRIDGES = {
    True: Bridge("mbridge", "mbridge", "mbridge.core.bridge:_MODEL_REGISTRY", "model_type", "true",
                 "install mbridge from git, pip install git+https://github.com/ISEEKYAN/mbridge, since 0.15.1 on PyPI "
                 "has no Qwen3.5"),
    False: Bridge("Megatron-Bridge", "megatron-bridge", "megatron.bridge:AutoBridge.list_supported_models",
                  "architecture", "false",
                  "pip install megatron-bridge, whose 0.6 needs Python >= 3.12, megatron-core >= 0.18 and TransformerEngine"),
}


@verl_engine_for
class MegatronVerl(VerlEngine):
    """verl's `megatron` model engine: megatron-core and a bridge on every node."""

    engine = MegatronEngine
    model_engine = "megatron"

    def role_settings(self, profile: RunProfile, role: str) -> dict[str, Any]:
        e = profile.engine
        prefix = f"actor_rollout_ref.{role}.megatron"
        settings: dict[str, Any] = {
            f"{prefix}.tensor_model_parallel_size": e.tp,
            f"{prefix}.pipeline_model_parallel_size": e.pp,
            f"{prefix}.virtual_pipeline_model_parallel_size": e.vpp,
            f"{prefix}.context_parallel_size": e.cp,
            f"{prefix}.expert_model_parallel_size": e.ep,
            f"{prefix}.expert_tensor_parallel_size": e.etp,
            f"{prefix}.param_offload": e.param_offload,
            f"{prefix}.dtype": e.dtype,
            f"{prefix}.use_mbridge": e.use_mbridge,
            f"{prefix}.vanilla_mbridge": e.vanilla_mbridge,
            f"{prefix}.use_remove_padding": e.use_remove_padding,
        }
        # Uneven pipeline stages are megatron-core TransformerConfig fields: verl passes them through
        # override_transformer_config, to both roles alike (only those set: verl's defaults are even stages).
        uneven = {name: getattr(e, name) for name in UNEVEN_PIPELINE_FIELDS if getattr(e, name)}
        for name, value in {**VERL_TRANSFORMER_DEFAULTS, **e.transformer_overrides, **uneven}.items():
            settings[f"{ADD_OR_OVERRIDE}{prefix}.override_transformer_config.{name}"] = value
        return settings

    def model_settings(self, profile: RunProfile) -> dict[str, Any]:
        return {"actor_rollout_ref.model.mtp.enable": True} if profile.engine.mtp else {}

    def actor_settings(self, profile: RunProfile) -> dict[str, Any]:
        return {"actor_rollout_ref.actor.megatron.optimizer_offload": profile.engine.optimizer_offload}

    def optimizer_settings(self, profile: RunProfile) -> dict[str, Any]:
        return {f"{ADD_OR_OVERRIDE}actor_rollout_ref.actor.optim.override_optimizer_config.{name}": value
                for name, value in profile.engine.optimizer_overrides.items()}

    def requirements(self, profile: RunProfile) -> dict[str, NodeRequirement]:
        architecture = profile.model.architecture
        bridge, other = BRIDGES[profile.engine.vanilla_mbridge], BRIDGES[not profile.engine.vanilla_mbridge]
        knows = architecture.model_type if bridge.found_by == "model_type" else architecture.hf_architecture
        return {
            "megatron-core": NodeRequirement(
                version=">=0.13", stages=["train"], why="verl's Megatron engine, whose fused forward needs 0.13",
                fix="pip install 'megatron-core>=0.13' in the image"),
            bridge.distribution: NodeRequirement(
                stages=["train"], registry=bridge.registry, knows=knows,
                imports=[] if knows else [bridge.registry.partition(":")[0]],
                why=f"engine.vanilla_mbridge={bridge.setting}: verl builds the model with {bridge.name}, found by "
                    f"{bridge.found_by} {knows or 'which the recipe does not record'}",
                fix=f"{bridge.install}; or set engine.vanilla_mbridge={other.setting} to use {other.name}"),
        }

    def problems(self, profile: RunProfile) -> list[str]:
        problems = super().problems(profile)
        if profile.actor.use_dynamic_bsz and not profile.engine.use_remove_padding:
            problems.append(
                "actor.use_dynamic_bsz=true: dynamic batch size needs packed sequences, but "
                "engine.use_remove_padding=false; set actor.use_dynamic_bsz=false"
            )
        return problems


@verl_engine_for
class FsdpVerl(VerlEngine):
    """verl's `dp` model engine with FSDP2: transformers' modelling code, flash-attn only when asked for."""

    engine = FsdpEngine
    model_engine = "dp"
    trains_lora = True

    def role_settings(self, profile: RunProfile, role: str) -> dict[str, Any]:
        """The reference never offloads on its own terms: verl 0.9.1 gives a forward-only FSDP2 model
        CPUOffloadPolicy whatever `param_offload` says (transformer_impl.py)."""
        e = profile.engine
        prefix = f"actor_rollout_ref.{role}"
        return {
            f"{prefix}.fsdp_config.param_offload": e.param_offload,
            f"{prefix}.fsdp_config.optimizer_offload": e.optimizer_offload,
            f"{prefix}.fsdp_config.fsdp_size": e.fsdp_size,
            f"{prefix}.fsdp_config.dtype": e.dtype,
            # The role's own key is deprecated but still read by verl's batch checks; both say the same.
            f"{prefix}.ulysses_sequence_parallel_size": e.ulysses_sp,
            f"{prefix}.fsdp_config.ulysses_sequence_parallel_size": e.ulysses_sp,
        }

    def actor_settings(self, profile: RunProfile) -> dict[str, Any]:
        saved = profile.actor.checkpoint_save_contents
        return {
            "actor_rollout_ref.actor.strategy": FSDP_VERSION,  # the reference follows the actor's
            # FSDP's checkpoint is sharded .pt files; the export stage reads the policy's HF weights, which
            # verl writes to actor/huggingface only when asked (backends/verl/checkpoint.py).
            **({"actor_rollout_ref.actor.checkpoint.save_contents": [*saved, "hf_model"]} if "hf_model" not in saved else {}),
            # verl loads the model with flash_attention_2 unless told otherwise (HFModelConfig).
            f"{ADD_OR_OVERRIDE}actor_rollout_ref.model.override_config.attn_implementation": profile.engine.attn_implementation,
        }

    def requirements(self, profile: RunProfile) -> dict[str, NodeRequirement]:
        if profile.engine.attn_implementation != "flash_attention_2":
            return {}
        return {"flash-attn": NodeRequirement(
            imports=["flash_attn"], stages=["train"],
            why="engine.attn_implementation=flash_attention_2: the actor and reference load with FlashAttention 2",
            fix="pip install flash-attn built for the image's torch and CUDA; or set engine.attn_implementation=sdpa")}
