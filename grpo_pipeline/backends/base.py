"""What the flow needs from any training engine, and the values it passes in and gets back.

    python -m grpo_pipeline --model tiny --device cpu --set algorithm.use_kl_in_reward=true --dry-run   # a backend refuses

A backend checks a resolved profile (every engine-specific refusal happens while the run is planned,
so a dry run and the UI form reject it before anything is fetched), renders the command it runs,
trains to a `TrainResult` (resuming from the run's latest checkpoint), stops what a run started (the
failure hooks, and a guard that tripped: backends/guards.py), and says where the trained policy is. The flow, the planner, validation and export
call these through `backends.backend_for` and never branch on a backend's name.

Training reports through `TrainingProgress`; its step records are `StepMetrics` (backends/metrics.py),
the same for every engine. What a backend needs to find its work again after a retry or a crash (its
checkpoints, a remote job's id) it keeps in the run's folder, which is why `stop` takes the folder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict, Field

from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.backend_table import BACKEND_TABLE, BackendCard

if TYPE_CHECKING:
    from grpo_pipeline.backends.guards import GuardTrip
    from grpo_pipeline.backends.metrics import StepMetrics
    from grpo_pipeline.planner.memory import MemoryPlan
    from grpo_pipeline.profiles.requirements import NodeRequirement
    from grpo_pipeline.profiles.schema import RunProfile
    from grpo_pipeline.generation.protocol import Generate, GenerationSettings


class TrainingInputs(BaseModel):
    """What training reads and writes, as the data and model stages (or a plan made before they
    ran) give them."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(..., description="HF directory or repo id of the base model.")
    train_files: list[str] = Field(..., description="Training parquet files (verl RL schema).")
    val_files: list[str] = Field(..., description="Validation parquet files.")
    checkpoint_dir: str = Field(..., description="Where the engine writes global_step_N/ checkpoints (absolute).")
    dist_checkpoint_path: str | None = Field(
        None, description="The base model as a megatron-core dist checkpoint (`model.dist_checkpoint`), if made.")


class TrainingRun(BaseModel):
    """One training stage's work: the inputs plus where and how it runs."""

    inputs: TrainingInputs
    run_dir: str = Field(..., description="The run's folder: metrics.jsonl, checkpoints/, the engine's own records.")
    run_name: str
    devices_here: int = Field(..., description="Devices (on cpu: cores) of this host, as detected.")
    ray_address: str | None = Field(None, description="An existing Ray cluster; empty: a local Ray.")
    runtime_env: dict = Field(default_factory=dict, description="Ray runtime_env of every worker.")
    generation: GenerationPlan = Field(..., description="How rollouts generate (generation/plan.py, resolved at "
                                       "planning).")


class TrainResult(BaseModel):
    backend: str
    checkpoint_dir: str = Field(..., description="The latest checkpoint: global_step_N.")
    steps_done: int
    max_steps: int
    metrics_file: str
    resumed_from: int | None = Field(None, description="Step this attempt resumed from, if any.")
    already_complete: bool = Field(False, description="The run had finished before this attempt; nothing was trained.")
    rollouts: str | None = Field(None, description="How rollouts were generated (engine, cache, compile, batch).")


class TrainingInterrupted(Exception):
    """Training stopped before the last step (a worker died, a collective timed out, a node was
    lost, a step hung): transient, the train stage retries and resumes from the latest checkpoint."""


class TrainingProgress(Protocol):
    """How a backend tells the flow what training does (a log, a progress bar, a Prefect artifact)."""

    def started(self, max_steps: int, resumed_from: int | None) -> None: ...

    def step(self, metrics: StepMetrics) -> None: ...

    def note(self, message: str) -> None:
        """What training does, for the record (INFO)."""

    def warn(self, message: str) -> None:
        """Something a person should act on or know is off (WARNING)."""

    def output(self, line: str) -> None:
        """A line the training program printed (a remote job's log)."""

    def nodes(self, title: str, table: list[str]) -> None:
        """What each node of the cluster has (the preflight's markdown table), for the UI."""


class Backend(ABC):
    name: str  # its row of profiles/backend_table.py

    @property
    def card(self) -> BackendCard:
        """This backend's row of the table: what the flow and the profile know of it without importing it."""
        return BACKEND_TABLE[self.name]
    # True: the engine's own job logs each step to the run's experiment trackers (verl's loggers,
    # rendered from the profile's `tracking`); False: the flow logs the steps it follows.
    logs_to_trackers: bool = False

    @abstractmethod
    def profile_problems(self, profile: RunProfile) -> list[str]:
        """What this engine cannot run in a resolved profile (layout, batch split, unsupported
        settings), each naming the field, its value and a fix; `resolve_profile` reports them."""

    def check_run(self, profile: RunProfile, devices_here: int, stages: list[str], dry_run: bool,
                  ray_address: str | None) -> None:
        """Refuse at planning what depends on the host, the cluster address or the stages asked for (UserError)."""

    def detected_layer(self, profile: RunProfile, devices_here: int, generation: GenerationPlan,
                       detected_names: list[str] | None = None, detected_gib: list[float] | None = None,
                       given: frozenset[str] = frozenset()) -> dict | None:
        """Settings this engine takes from the `devices_here` found on the run's one host (their names and
        memory when known; `generation`: the run's plan, of which the layer may change only the rounds,
        `generation.steps_per_generation`), as a profile layer
        above the device profile's defaults (a recipe, a profile file or --set still wins: `given` names what
        they set, profiles/loader.py `given_settings`); None: the device profile's defaults stand."""
        return None

    def memory_plan(self, profile: RunProfile, detected_names: list[str] | None = None,
                    detected_gib: list[float] | None = None) -> MemoryPlan | None:
        """Device memory per role of this engine's layout (planner/memory.py), with the devices detected
        here when there are any; None when this engine has no estimate or the architecture is incomplete."""
        return None

    def memory_note(self, profile: RunProfile, generation: GenerationPlan, detected_names: list[str] | None = None,
                    detected_gib: list[float] | None = None) -> str | None:
        """What the dry run says of memory where `memory_plan` gives no table: why there is no estimate
        (what the model's size lacks), or what an engine without a plan decided from its own estimate (the
        local backend: gradient checkpointing); None when there is nothing to say."""
        return None

    def size_table(self, profile: RunProfile, generation: GenerationPlan) -> tuple[dict, list[str]] | None:
        """`--suggest-layout --backend <this>` where this engine sizes one device's step rather than searching
        layouts: the largest batch that fits (full training and LoRA) as JSON (with a `refusal` when nothing
        fits) and as the lines printed; None: the layout search (planner/layouts.py) answers."""
        return None

    def algorithm_notes(self, profile: RunProfile, generation: GenerationPlan) -> list[str]:
        """Where this engine's update departs from verl's own for the profile (the dry run's `# algorithm:` lines, and
        the run's notes): a lever verl lacks and what it changes, a difference kept; none for verl itself."""
        return []

    def generation_summary(self, profile: RunProfile, generation: GenerationPlan) -> str:
        """How this engine's runs generate rollouts and evaluation, for the dry run's header: by default
        both by the run's plan (generation/plan.py)."""
        return f"rollouts and evaluation: {generation.describe()}"

    def evaluation(self, profile: RunProfile, settings: GenerationSettings, devices_here: int, ray_address: str | None,
                   runtime_env: dict) -> tuple[GenerationSettings, Generate]:
        """Where the evaluation stage generates for this engine's runs: by default on this host's
        devices, with the engine of the run's plan (`settings.plan`: the same path as rollouts)."""
        from grpo_pipeline.generation.sharding import choose_engine

        return settings, choose_engine(profile.platform, devices_here, settings.plan)

    def node_requirements(self, profile: RunProfile, stage: str) -> dict[str, NodeRequirement]:
        """What every node of the run's cluster must have for `stage` (`train`, `evaluate`), checked on
        each node before anything is started there (cluster/preflight.py); empty for an engine that runs
        in the flow's own process."""
        return {}

    def submission(self, profile: RunProfile, run: TrainingRun) -> dict | None:
        """What training submits to a cluster, for the dry run; None when it trains in the flow."""
        return None

    @abstractmethod
    def command(self, profile: RunProfile, inputs: TrainingInputs) -> list[str] | None:
        """The command this engine runs for training, or None when it trains inside the flow."""

    @abstractmethod
    def train(self, profile: RunProfile, run: TrainingRun, progress: TrainingProgress) -> TrainResult:
        """Train to the profile's last step, resuming from the latest checkpoint in the run's folder."""

    @abstractmethod
    def stop(self, run_dir: Path) -> bool:
        """End what this engine started for the run (workers, a job); True when something was stopped."""

    @abstractmethod
    def stop_for_guard(self, run_dir: Path, trip: GuardTrip) -> str:
        """Stop the run a guard tripped (backends/guards.py), keeping its latest good checkpoint: after a
        non-finite step, nothing saved from that step on is left where a resume or the export would take it.
        Returns what was kept, in words."""

    @abstractmethod
    def policy_dir(self, result: TrainResult) -> Path:
        """The Hugging Face directory of the trained policy (converted from the engine's checkpoint if need be; a
        LoRA run's: the base model with the adapter merged, checkpoints/lora_export.py)."""

    def adapter_dir(self, result: TrainResult) -> Path | None:
        """A LoRA run's adapter alone, in PEFT's format (written by `policy_dir`); None for full fine-tuning."""
        return None
