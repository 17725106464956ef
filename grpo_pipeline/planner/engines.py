"""Each training engine's planning, registered by its `engine.strategy` beside the profile's engine classes
(profiles/engine.py), as verl registers its engines: planner/memory.py registers Megatron's, planner/fsdp.py
FSDP2's, each with its layout rules, the ranks a batch splits over, its memory estimate, its step cost, the
layouts --suggest-layout tries and how a layout is set and shown.

    python -m grpo_pipeline --model smollm2-135m --device gpu --backend verl --suggest-layout   # both engines' layouts

Nothing outside an engine's own plan asks which engine a profile or a layout has: it asks the engine's plan
(`plan_of`), found by the strategy (tests/test_house.py keeps it so).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from grpo_pipeline.planner.parallel import Layout

if TYPE_CHECKING:
    from grpo_pipeline.planner.roles import MemoryPlan
    from grpo_pipeline.profiles.engine import TrainingEngine
    from grpo_pipeline.profiles.model_size import ModelSize
    from grpo_pipeline.profiles.platform import Accelerator
    from grpo_pipeline.profiles.schema import RunProfile

MFU = 0.4  # the cost model's utilisation of the world's bf16 peak (planner/layouts.py)
# Offload levels, least first: (param_offload, optimizer_offload, megatron-core CPU optimizer).
OFFLOAD_LEVELS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
CONTEXT_PARALLEL = (1, 2, 4, 8)
LONG_CONTEXT_CHUNK = 4096  # CP 4 and 8, Ulysses, only where each rank keeps a chunk of at least this many tokens


class EnginePlan(ABC):
    """What the planner knows of one training engine. Subclasses set `engine` (the profile's class) and are
    registered with `@registered`."""

    engine: ClassVar[type[TrainingEngine]]
    offload_levels: ClassVar[tuple[tuple[bool, bool, bool], ...]] = OFFLOAD_LEVELS

    @abstractmethod
    def problems(self, p: RunProfile) -> list[str]:
        """The engine's layout rules against the world and the model (verl 0.9.1's)."""

    @abstractmethod
    def estimate(self, p: RunProfile, lay: Layout, device: str, capacity_gib: float | None, source: str,
                 size: ModelSize) -> MemoryPlan:
        """Device memory per role of `lay` on a device of `capacity_gib`."""

    @abstractmethod
    def step_cost(self, p: RunProfile, size: ModelSize, lay: Layout, spec: Accelerator) -> dict[str, float]:
        """Seconds per training step by part (planner/layouts.py's cost model)."""

    @abstractmethod
    def layouts(self, p: RunProfile) -> list[Layout]:
        """The layouts of this engine that pass its rules (rollout and batches are checked per layout)."""

    @abstractmethod
    def engine_settings(self, engine: TrainingEngine, lay: Layout) -> dict[str, Any]:
        """The fields of the engine section `engine` that make `lay` (what `with_layout` writes)."""

    @abstractmethod
    def settings(self, lay: Layout) -> dict[str, Any]:
        """The profile keys that make `lay` (`--set` them)."""

    @abstractmethod
    def dims(self, lay: Layout) -> tuple:
        """What tells layouts apart in the suggestion table: the engine and its parallel sizes."""

    @abstractmethod
    def columns(self, lay: Layout) -> str:
        """The table's TP | PP | CP | EP | ETP cells."""

    @abstractmethod
    def label(self, lay: Layout) -> str:
        """The table's engine cell."""

    @abstractmethod
    def shown(self, lay: Layout) -> str:
        """The profile's own layout, as the line below the table names it."""

    def resets(self, engine: TrainingEngine) -> dict[str, Any]:
        """What the profile's engine section `engine` sets that this engine would refuse, back at its default (and
        `strategy`, when it changes): the `best:` line of --suggest-layout switches engines with them."""
        name_of = self.engine.model_fields["strategy"].default
        out: dict[str, Any] = {} if isinstance(engine, self.engine) else {"strategy": name_of}
        for name in type(engine).model_fields:
            if name not in self.engine.model_fields and getattr(engine, name) != (default := engine.default(name)):
                out[name] = default
        return out

    def own(self, p: RunProfile) -> RunProfile:
        """`p` with this engine: its own section when it is this engine's, else a fresh one with the settings both
        engines read (a layout search weighs either engine's layouts for any profile)."""
        if isinstance(p.engine, self.engine):
            return p
        return p.model_copy(update={"engine": self.engine.model_construct(**p.engine.shared_settings())})

    def with_layout(self, p: RunProfile, lay: Layout) -> RunProfile:
        """The profile with `lay`'s settings (no validation: the rule functions check it): the profile's engine
        when it is this one, else a fresh one of this engine with the settings both engines read."""
        base = self.own(p).engine
        engine = base.model_copy(update={"param_offload": lay.param_offload, "optimizer_offload": lay.optimizer_offload,
                                         **self.engine_settings(base, lay)})
        return p.model_copy(update={"engine": engine, "rollout": p.rollout.model_copy(update={"tp": lay.rollout_tp}),
                                    "actor": p.actor.model_copy(update={"ppo_micro_batch_size_per_gpu": lay.micro_batch}),
                                    **self.model_settings(p, lay)})

    def model_settings(self, p: RunProfile, lay: Layout) -> dict[str, Any]:
        """Sections other than the engine's that `lay` sets (none unless the engine says)."""
        return {}


ENGINE_PLANS: dict[str, EnginePlan] = {}


def registered(plan: type[EnginePlan]) -> type[EnginePlan]:
    """Register an engine's plan under its profile class's strategy."""
    ENGINE_PLANS[plan.engine.model_fields["strategy"].default] = plan()
    return plan


def plan_of(strategy: str) -> EnginePlan:
    """The plan of the engine `strategy` names (a layout's or a profile's `engine.strategy`). The engines register
    when planner/memory.py is imported (it imports planner/fsdp.py), as every caller of the planner does."""
    return ENGINE_PLANS[strategy]


def with_layout(p: RunProfile, lay: Layout) -> RunProfile:
    """The profile with `lay`'s settings, its engine the layout's (no validation: the rule functions check it)."""
    return plan_of(lay.strategy).with_layout(p, lay)


def layout_settings(lay: Layout) -> dict[str, Any]:
    """The profile keys that make `lay` (`--set` them)."""
    return plan_of(lay.strategy).settings(lay)
