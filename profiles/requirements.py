"""What every node of a cluster run must have installed, and how a node's answer is judged.

    python -m flows.grpo --model qwen3.5-122b-a10b --device gpu --dry-run    # "# node requirements"

A profile's `requires` maps a distribution's name to what the job needs of it. The layers fill it as
they fill everything else: the device profile adds its runtime (vLLM, or torch_npu, vllm-ascend and
CANN), a model recipe what its layers need (TransformerEngine and flash-linear-attention for Gated
DeltaNet), and the training backend what it runs (verl adds verl itself, megatron-core and the
bridge that must know the model: `Backend.node_requirements`). `--set requires.<name>=null` drops
one. The preflight (common/node_image.py) asks every node and `node_problems` judges each answer.

Names the probe answers that are not distributions: `python`, `cann` (the Ascend toolkit's version),
`nvidia-driver` (the driver NVML reports), and `devices`: the node must have at least the devices
Ray offers on it (NVML's count for GPUs, /dev/davinci* for NPUs).
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from profiles.section import Section


class NodeRequirement(Section):
    version: str = Field("", description="A PEP 440 specifier the installed version must meet (`==0.9.1`, `>=0.16`); "
                         "empty: any version.")
    also_named: list[str] = Field(default_factory=list, description="Other distribution names it may be installed "
                                  "under (a source build of TransformerEngine is `transformer_engine`).")
    same_release_as: str | None = Field(None, description="Another requirement whose major.minor.patch this one's "
                                        "must equal (torch_npu and torch, vllm-ascend and vLLM).")
    imports: list[str] = Field(default_factory=list, description="Modules that must import on the node (a broken "
                               "native library fails here, not in the job).")
    torch_build: str | None = Field(None, description="torch only: the build it must be (`cuda`, `rocm`): a CPU wheel on a "
                                    "GPU node is a common image mistake.")
    registry: str | None = Field(None, description="`module:attribute` of the package's registry of models (a dict "
                                 "or a function that lists them), which must hold `knows`.")
    knows: str | None = Field(None, description="The model name (`model_type` or architecture) the registry must hold.")
    why: str = Field("", description="What needs it, for the message.")
    fix: str = Field("", description="How to fix a node that lacks it (a package and version, or a profile setting "
                     "that avoids it).")

    def check_version(self, found: str) -> bool:
        try:
            return not self.version or Version(found) in SpecifierSet(self.version)
        except (InvalidVersion, InvalidSpecifier):
            return False


class NodeFacts(BaseModel):
    """One node's answer (common/node_image.py)."""

    node: str = Field(..., description="`<address> (<node id>)`.")
    versions: dict[str, str | None] = Field(default_factory=dict, description="Installed version of each name asked "
                                            "for and of the stack (None: not installed).")
    installed_as: dict[str, str] = Field(default_factory=dict, description="The distribution name a requirement was "
                                         "found under, when it was one of its other names.")
    imports: dict[str, str | None] = Field(default_factory=dict, description="Module -> None (imports) or its error.")
    registries: dict[str, list[str] | str] = Field(default_factory=dict, description="Registry -> the names it holds, "
                                                   "or the error reading it.")
    torch_build: str | None = Field(None, description="cuda <version>, rocm <version>, or cpu (torch/version.py).")
    devices: int = Field(0, description="Devices the node has (NVML for GPUs, /dev/davinci* for NPUs).")
    devices_offered: float = Field(0, description="What Ray offers on the node of the platform's resource.")


def _release(version: str | None) -> tuple[int, ...] | None:
    try:
        return Version(version).release[:3] if version else None
    except InvalidVersion:
        return None


def node_problems(facts: NodeFacts, requirements: dict[str, NodeRequirement | None]) -> list[str]:
    """What this node lacks for the job, each naming what was found and the fix."""
    problems = []
    for name, need in requirements.items():
        if need is None:
            continue
        fix = f"; fix: {need.fix}" if need.fix else ""
        why = f" ({need.why})" if need.why else ""
        if name == "devices":
            if facts.devices < facts.devices_offered:
                problems.append(f"Ray offers {facts.devices_offered:g} devices here but the node has {facts.devices}{why}"
                                f"{fix}")
            continue
        found = facts.versions.get(name)
        shown = facts.installed_as.get(name, name)
        if found is None:
            problems.append(f"{name} is not installed{why}{fix}")
            continue
        if need.torch_build and not (facts.torch_build or "").startswith(need.torch_build):
            problems.append(f"{shown} {found} is a {facts.torch_build} build, the job needs a {need.torch_build} "
                            f"build{why}{fix}")
            continue
        if not need.check_version(found):
            problems.append(f"{shown} {found} is installed, the job needs {name}{need.version}{why}{fix}")
            continue
        if need.same_release_as:
            other = facts.versions.get(need.same_release_as)
            if _release(found) != _release(other):
                problems.append(f"{shown} {found} does not match {need.same_release_as} {other or '(not installed)'}: "
                                f"their releases must be the same{why}{fix}")
                continue
        if failed := [f"{module} ({error})" for module in need.imports if (error := facts.imports.get(module))]:
            problems.append(f"{shown} {found} is installed but does not import: {'; '.join(failed)}{why}{fix}")
            continue
        if need.registry and need.knows:
            held = facts.registries.get(need.registry)
            if isinstance(held, str):
                problems.append(f"{shown} {found}: its registry {need.registry} could not be read ({held}){why}{fix}")
            elif need.knows not in (held or []):
                problems.append(f"{shown} {found} does not know {need.knows} (it knows {', '.join(sorted(held or []))})"
                                f"{why}{fix}")
    return problems
