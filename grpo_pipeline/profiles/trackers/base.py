"""`Tracker`: what every experiment tracker's class says and does (the classes: the `*_tracker.py`
modules beside it; the registry of them: profiles/trackers/__init__.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import ClassVar

from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.section import Section

# How long one request to a tracker may take while training (a step is never held up for long).
STEP_TIMEOUT_S = 5
# The status a tracker run ends with, by how the pipeline run ended (MLflow's RunStatus names).
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


class Tracker(ABC):
    """One tool's run: opened (created or found again by its ids), logged to, closed. A class says what
    the tool is; an instance is one session's hold on the run, given the tool's own settings."""

    name: ClassVar[str]  # as `tracking.trackers` names it
    verl_logger: ClassVar[str]  # verl's logger that continues the run from a job (`trainer.logger`)
    label: ClassVar[str]  # as the report's lines, warnings and refusals name it
    settings_class: ClassVar[type[Section]]  # `tracking.<name>`
    package: ClassVar[str]  # the distribution its client ships in: what every node of a job that logs itself needs
    also_named: ClassVar[tuple[str, ...]] = ()  # other distributions that ship the same client
    imports: ClassVar[tuple[str, ...]]  # the modules that must import where it logs

    def __init__(self, settings: Section, run_dir: Path):
        self.settings, self.run_dir = settings, Path(run_dir)

    @classmethod
    def requirement(cls) -> NodeRequirement:
        """What every training node needs when a job logs to this tracker itself (the verl backend)."""
        return NodeRequirement(
            stages=["train"], also_named=list(cls.also_named), imports=list(cls.imports),
            why=f"tracking.trackers has {cls.name}: the job's own logger writes each step to it",
            fix=f"pip install {cls.package} in the image, or drop {cls.name} from tracking.trackers")

    @classmethod
    def store_problem(cls, settings: Section, write: bool) -> str | None:
        """What keeps the tracker's store from being used, checked at planning (before anything starts)."""
        return None

    @classmethod
    def missing_credentials(cls, settings: Section, environ: Mapping[str, str]) -> str | None:
        """Credentials it needs that this environment lacks: the problem and its fix, or None."""
        return None

    @classmethod
    def verl_project(cls, settings: Section) -> str | None:
        """The project verl's `trainer.project_name` must be for this tracker's run, if it decides one."""
        return None

    @abstractmethod
    def where(self) -> str:
        """Where the run goes, as a refusal names it."""

    @abstractmethod
    def open(self, ids: dict[str, str] | None, run_name: str) -> dict[str, str]:
        """Create the run (ids None) or continue it; the ids to find it again. Raises when unreachable."""

    @abstractmethod
    def link(self) -> str:
        """Where a person looks at the run (a URL, or a folder and the command that shows it)."""

    @abstractmethod
    def log_params(self, params: dict[str, str], tags: dict[str, str]) -> None: ...

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    @abstractmethod
    def log_file(self, path: Path) -> None: ...

    def close(self, status: str | None = None) -> None:
        """End this session's hold on the run; a `status` (FINISHED, FAILED, KILLED) also ends the run itself."""

    def bounded(self, timeout_s: float = STEP_TIMEOUT_S):
        """A context in which each request to the tool gives up after `timeout_s`, without retries."""
        return nullcontext()

    def job_env(self, ids: dict[str, str]) -> dict[str, str]:
        """What verl's logger for this tool reads (verl/utils/tracking.py, verl 0.9.1) to continue the run."""
        return {}
