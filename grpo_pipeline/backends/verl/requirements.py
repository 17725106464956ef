"""What the verl backend needs on every training node, beside what the device profile (its runtime)
and the model recipe (its layers) put in the profile's `requires`, which win by name.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run   # "# node requirements"

verl itself at the release the overrides are rendered for, and TransferQueue (verl 0.9.1's default
`trainer.use_v1=true` trainer imports `transfer_queue`, from verl's `verl-core` extra), and what the engine
needs (backends/verl/engines.py): with `engine.strategy: megatron`, megatron-core and the bridge
`engine.vanilla_mbridge` selects, which must know the model: mbridge looks the checkpoint's `model_type` up in
its registry, Megatron-Bridge its architecture class (`verl/workers/engine/megatron/transformer_impl.py`, verl
0.9.1). With `fsdp`, neither: the model is transformers' own; flash-attn only when `engine.attn_implementation`
asks for it. Facts in `../shared/reference/verl-cluster-notes.md` (bridges and what a node's image needs).
"""

from __future__ import annotations

from grpo_pipeline.backends.verl.command import VERL_VERSION
from grpo_pipeline.backends.verl.engines import verl_engine
from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.tracking import tracker_requirements


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
    return needs | _reward_requirements(profile) | verl_engine(profile).requirements(profile)


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
