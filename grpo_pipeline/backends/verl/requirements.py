"""What the verl backend needs on every training node, beside what the device profile (its runtime)
and the model recipe (its layers) put in the profile's `requires`, which win by name.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run   # "# node requirements"

verl itself at the release the overrides are rendered for, and TransferQueue (verl 0.9.1's default
`trainer.use_v1=true` trainer imports `transfer_queue`, from verl's `verl-core` extra). With
`engine.strategy: megatron`, megatron-core and the bridge `engine.vanilla_mbridge` selects, which must
know the model: mbridge looks the checkpoint's `model_type` up in its registry, Megatron-Bridge its
architecture class (`verl/workers/engine/megatron/transformer_impl.py`, verl 0.9.1). With `fsdp`,
neither: the model is transformers' own; flash-attn only when `engine.attn_implementation` asks for it. Facts in
`../shared/reference/verl-cluster-notes.md` (bridges and what a node's image needs).
"""

from __future__ import annotations

from typing import NamedTuple

from grpo_pipeline.backends.verl.command import VERL_VERSION
from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.tracking import tracker_requirements


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


def verl_requirements(profile: RunProfile) -> dict[str, NodeRequirement]:
    needs = {
        **tracker_requirements(profile.tracking),
        "verl": NodeRequirement(
            version=f"=={VERL_VERSION}", stages=["train"],
            why=f"the job's overrides are rendered for verl {VERL_VERSION}'s config: another release may refuse them "
                "with Hydra's 'Could not override', or read them differently",
            fix=f"pip install verl=={VERL_VERSION} in the image"),
        "TransferQueue": NodeRequirement(
            version=">=0.1.10", imports=["transfer_queue"], stages=["train"],
            why=f"verl {VERL_VERSION}'s trainer (trainer.use_v1=true, its default) imports transfer_queue",
            fix=f"pip install 'verl[verl-core]=={VERL_VERSION}' (or 'TransferQueue>=0.1.10') in the image"),
    }
    needs |= _reward_requirements(profile)
    if profile.engine.strategy == "fsdp":
        return needs | _fsdp_requirements(profile)
    return needs | _megatron_requirements(profile)


def _reward_requirements(profile: RunProfile) -> dict[str, NodeRequirement]:
    """The pipeline's reward in verl's reward workers (backends/verl/rewards.py): math-verify grades math
    answers, httpx reaches a reward server, pydantic reads the carried plan."""
    from grpo_pipeline.backends.verl.rewards import pipeline_reward

    if not pipeline_reward(profile):
        return {}
    why = "the job scores with the pipeline's reward (grpo_pipeline.rewards.verl_entry), which imports it"
    needs = {name: NodeRequirement(stages=["train"], imports=[module], why=why, fix=f"pip install '{spec}' in the image")
             for name, module, spec in (("math-verify", "math_verify", "math-verify[antlr4_9_3]>=0.9"),
                                        ("pydantic", "pydantic", "pydantic>=2.7"))}
    if profile.reward.url:
        needs["httpx"] = NodeRequirement(stages=["train"], imports=["httpx"], why="reward.url: the job asks the reward "
                                         "server over HTTP", fix="pip install httpx in the image")
    return needs


def _fsdp_requirements(profile: RunProfile) -> dict[str, NodeRequirement]:
    if profile.engine.attn_implementation != "flash_attention_2":
        return {}
    return {"flash-attn": NodeRequirement(
        imports=["flash_attn"], stages=["train"],
        why="engine.attn_implementation=flash_attention_2: the actor and reference load with FlashAttention 2",
        fix="pip install flash-attn built for the image's torch and CUDA; or set engine.attn_implementation=sdpa")}


def _megatron_requirements(profile: RunProfile) -> dict[str, NodeRequirement]:
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
