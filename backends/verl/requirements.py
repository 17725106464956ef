"""What the verl backend needs on every training node, beside what the device profile (its runtime)
and the model recipe (its layers) put in the profile's `requires`, which win by name.

    python -m flows.grpo --model qwen3.5-122b-a10b --device gpu --dry-run   # "# node requirements"

verl itself at the release the overrides are rendered for; megatron-core; and the bridge
`engine.vanilla_mbridge` selects, which must know the model: mbridge looks the checkpoint's
`model_type` up in its registry, Megatron-Bridge its architecture class
(`verl/workers/engine/megatron/transformer_impl.py`, verl 0.9.1). Facts in
`../shared/reference/verl-cluster-notes.md` (bridges and what a node's image needs).
"""

from __future__ import annotations

from backends.verl.command import VERL_VERSION
from profiles.requirements import NodeRequirement
from profiles.schema import RunProfile

# mbridge fills this dict (model_type -> bridge class) when the package is imported.
MBRIDGE_REGISTRY = "mbridge.core.bridge:_MODEL_REGISTRY"
# Megatron-Bridge lists the architecture names it has a bridge for.
MEGATRON_BRIDGE_REGISTRY = "megatron.bridge:AutoBridge.list_supported_models"


def verl_requirements(profile: RunProfile) -> dict[str, NodeRequirement]:
    architecture = profile.model.architecture
    needs = {
        "verl": NodeRequirement(
            version=f"=={VERL_VERSION}", stages=["train"],
            why=f"the job's overrides are rendered for verl {VERL_VERSION}'s config: another release may refuse them "
                "with Hydra's 'Could not override', or read them differently",
            fix=f"pip install verl=={VERL_VERSION} in the image"),
        "megatron-core": NodeRequirement(
            version=">=0.13", stages=["train"], why="verl's Megatron engine, whose fused forward needs 0.13",
            fix="pip install 'megatron-core>=0.13' in the image"),
    }
    if profile.engine.vanilla_mbridge:
        needs["mbridge"] = NodeRequirement(
            stages=["train"], registry=MBRIDGE_REGISTRY, knows=architecture.model_type,
            imports=[] if architecture.model_type else ["mbridge"],
            why=f"engine.vanilla_mbridge=true: verl builds the model with mbridge, found by model_type "
                f"{architecture.model_type or 'which the recipe does not record'}",
            fix="install mbridge from git, pip install git+https://github.com/ISEEKYAN/mbridge, since 0.15.1 on PyPI "
                "has no Qwen3.5; or set engine.vanilla_mbridge=false to use Megatron-Bridge")
    else:
        needs["megatron-bridge"] = NodeRequirement(
            stages=["train"], registry=MEGATRON_BRIDGE_REGISTRY, knows=architecture.hf_architecture,
            imports=[] if architecture.hf_architecture else ["megatron.bridge"],
            why=f"engine.vanilla_mbridge=false: verl builds the model with Megatron-Bridge, found by architecture "
                f"{architecture.hf_architecture or 'which the recipe does not record'}",
            fix="pip install megatron-bridge, whose 0.6 needs Python >= 3.12, megatron-core >= 0.18 and "
                "TransformerEngine; or set engine.vanilla_mbridge=true to use mbridge")
    return needs
