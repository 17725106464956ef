"""What every node of a cluster run must have installed, and how a node's answer is judged.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run    # "# node requirements"

A profile's `requires` maps a distribution's name to what the job needs of it. The layers fill it as
they fill everything else: the device profile adds its runtime (vLLM, or torch_npu, vllm-ascend and
CANN), a model recipe what its layers need (TransformerEngine and flash-linear-attention for Gated
DeltaNet), and the training backend what it runs (verl adds verl itself, megatron-core and the
bridge that must know the model: `Backend.node_requirements`). `--set requires.<name>=null` drops
one. The preflight (cluster/node_image.py) asks every node and `node_problems` judges each answer.

Names the probe answers that are not distributions: `python`, `cann` (the Ascend toolkit's version),
`nvidia-driver` (the driver NVML reports), and `devices`: the node must have at least the devices
Ray offers on it (NVML's count for GPUs, /dev/davinci* for NPUs).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, Field, field_validator
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from grpo_pipeline.profiles.section import Section


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
    stages: list[Literal["train", "evaluate"]] = Field(["train", "evaluate"], description="The cluster stages that "
                                                       "need it (a training library is not needed to evaluate).")
    why: str = Field("", description="What needs it, for the message.")
    fix: str = Field("", description="How to fix a node that lacks it (a package and version, or a profile setting "
                     "that avoids it).")

    @field_validator("version")
    @classmethod
    def a_pep_440_specifier(cls, version: str) -> str:
        """Checked here, at planning: an invalid one matched no node's version, so every node was blamed."""
        try:
            SpecifierSet(version)
        except InvalidSpecifier:
            raise ValueError(f"{version!r} is not a PEP 440 version specifier; write one like ==0.9.1, >=0.16 or "
                             ">=2.6,<2.8") from None
        return version

    def describe(self, name: str) -> str:
        """One line for the dry run: what is checked, and why."""
        checks = [f"{self.torch_build} build"] if self.torch_build else []
        checks += [f"same release as {self.same_release_as}"] if self.same_release_as else []
        checks += [f"imports {', '.join(self.imports)}"] if self.imports else []
        checks += [f"knows {self.knows}"] if self.registry and self.knows else []
        checks += [f"or {', '.join(self.also_named)}"] if self.also_named else []
        shown = "at least the devices Ray offers" if name == "devices" else name + self.version
        detail = " (" + "; ".join(checks) + ")" if checks else ""
        return f"{shown}{detail}{': ' + self.why if self.why else ''}"

    def check_version(self, found: str) -> bool:
        try:
            return not self.version or Version(found) in SpecifierSet(self.version)
        except (InvalidVersion, InvalidSpecifier):
            return False


class NodeFacts(BaseModel):
    """One node's answer (cluster/node_image.py)."""

    node: str = Field(..., description="`<address> (<node id>)`.")
    versions: dict[str, str | None] = Field(default_factory=dict, description="Installed version of each name asked "
                                            "for and of the stack (None: not installed).")
    installed_as: dict[str, str] = Field(default_factory=dict, description="The distribution name a requirement was "
                                         "found under, when it was one of its other names.")
    imports: dict[str, str | None] = Field(default_factory=dict, description="Module -> None (imports) or its error.")
    registries: dict[str, list[str] | str] = Field(default_factory=dict, description="Registry -> the names it holds, "
                                                   "or the error reading it.")
    unreadable: dict[str, str] = Field(default_factory=dict, description="Name -> why its installed metadata could "
                                       "not be read (a damaged installation).")
    torch_build: str | None = Field(None, description="cuda <version>, rocm <version>, or cpu (torch/version.py).")
    devices: int = Field(0, description="Devices the node has (NVML for GPUs, /dev/davinci* for NPUs).")
    devices_offered: float = Field(0, description="What Ray offers on the node of the platform's resource.")


def _release(version: str | None) -> tuple[int, ...] | None:
    try:
        return Version(version).release[:3] if version else None
    except InvalidVersion:
        return None


class NodeProblem(NamedTuple):
    """One thing a node lacks: what was found against what is needed, and the requirement (why, fix)."""

    found: str
    need: NodeRequirement

    def __str__(self) -> str:
        why = f" ({self.need.why})" if self.need.why else ""
        return f"{self.found}{why}{'; fix: ' + self.need.fix if self.need.fix else ''}"


# How a module's answer starts when the node's checking process never ran (cluster/node_image.py): the
# packages were not tried, so none is blamed.
COULD_NOT_START = "the check could not start"
KNOWN_SHOWN = 12  # a registry's names listed in a refusal, then counted


def node_problems(facts: NodeFacts, requirements: dict[str, NodeRequirement | None]) -> list[NodeProblem]:
    """What this node lacks for the job, each naming what was found."""
    return [NodeProblem(found, need) for name, need in requirements.items()
            if need is not None and (found := _problem(name, need, facts))]


def _problem(name: str, need: NodeRequirement, facts: NodeFacts) -> str | None:
    if name == "devices":
        if facts.devices < facts.devices_offered:
            return f"Ray offers {facts.devices_offered:g} devices here but the node has {facts.devices}"
        return None
    found = facts.versions.get(name)
    shown = facts.installed_as.get(name, name)
    if name in facts.unreadable:
        return (f"{shown} is installed but its package metadata cannot be read ({facts.unreadable[name]}): the "
                f"installation is damaged; reinstall {name} on the node")
    if found is None:
        return f"{name} is not installed"
    if need.torch_build and not (facts.torch_build or "").startswith(need.torch_build):
        return f"{shown} {found} is a {facts.torch_build} build, the job needs a {need.torch_build} build"
    if not need.check_version(found):
        return f"{shown} {found} is installed, the job needs {name}{need.version}"
    if need.same_release_as:
        other = facts.versions.get(need.same_release_as)
        for named, version in ((shown, found), (need.same_release_as, other)):
            if version is not None and _release(version) is None:
                return (f"{named} {version} is not a PEP 440 version, so its release cannot be matched with "
                        f"{need.same_release_as if named == shown else shown}'s; install a released build")
        if _release(found) != _release(other):
            return (f"{shown} {found} does not match {need.same_release_as} {other or '(not installed)'}: their "
                    "releases must be the same")
    errors = [error for module in need.imports if (error := facts.imports.get(module))]
    if unchecked := [error for error in errors if error.startswith(COULD_NOT_START)]:
        return f"{shown} {found} is installed but could not be checked: {unchecked[0]}; the node's Python could not run"
    if failed := [f"{module}: {error}" for module in need.imports if (error := facts.imports.get(module))]:
        return f"{shown} {found} is installed but does not import ({'; '.join(failed)})"
    if need.registry and need.knows:
        held = facts.registries.get(need.registry)
        if isinstance(held, str):
            return f"{shown} {found}: its list of models ({need.registry}) could not be read: {held}"
        if need.knows not in (held or []):
            names = sorted(held or [])
            more = f" and {len(names) - KNOWN_SHOWN} more" if len(names) > KNOWN_SHOWN else ""
            return f"{shown} {found} does not know {need.knows} (it knows {', '.join(names[:KNOWN_SHOWN]) or 'none'}{more})"
    return None


def for_stage(requirements: dict[str, NodeRequirement | None], stage: str) -> dict[str, NodeRequirement]:
    """The requirements a stage needs (those dropped with `null` left out)."""
    return {name: need for name, need in requirements.items() if need is not None and stage in need.stages}
