"""The `train` stage: GRPO with the profile's backend, resuming from the run's latest checkpoint.

    python -m grpo_pipeline --model tiny --device cpu --run-name try1    # again: "already complete"

The stage hands the backend (backends/: `local` trains in this process on Ray Train; `verl` runs
verl on a Ray cluster) what the data and model stages produced and follows it through
`TrainingProgress`; `runs/<run>/train.json` records the result. Every step passes the run's guards
(backends/guards.py) on its way: a guard that trips stops the engine (`Backend.stop_for_guard`), and
`runs/<run>/guards.json` says which, where and what was kept.
"""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainingInputs, TrainingProgress, TrainingRun, TrainResult
from grpo_pipeline.backends.guards import GuardTripped, StepGuards
from grpo_pipeline.backends.metrics import StepMetrics, read_metrics
from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.stages.dataset import DatasetFiles, DataSpec, dataset_dir
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.stages.environment import RuntimeEnv
from grpo_pipeline.stages.model import ModelCheckpoint, ModelSpec, dist_checkpoint_dir, model_dir
from grpo_pipeline.run.folder import RunFolder

# A plan made before the base model is in the store names the dist checkpoint by what makes it.
PLANNED_DIST_CHECKPOINT = "<the dist checkpoint prepare_checkpoint converts>"


def training_inputs(
    profile: RunProfile,
    run_dir: Path,
    data: DatasetFiles | None = None,
    model: ModelCheckpoint | None = None,
) -> TrainingInputs:
    """What training reads: the dataset and model stages' outputs, or (in a plan made before they
    ran) the store paths they will produce, which are known without fetching anything."""
    data_path = Path(data.path) if data else dataset_dir(DataSpec.from_profile(profile.data))
    spec = ModelSpec.from_profile(profile.model)
    model_path = Path(model.path) if model else model_dir(spec)
    dist = None
    if model and model.dist_checkpoint:
        dist = model.dist_checkpoint.path
    elif spec.dist_checkpoint:  # its store key hashes the HF weights: known once they are in the store
        dist = str(dist_checkpoint_dir(spec, model_path)) if model_path.is_dir() else PLANNED_DIST_CHECKPOINT
    return TrainingInputs(
        model_path=str(model_path),
        dist_checkpoint_path=dist,
        train_files=data.train_files if data else [str(data_path / "train.parquet")],
        val_files=data.val_files if data else [str(data_path / "test.parquet")],
        checkpoint_dir=str((run_dir / RunFolder.CHECKPOINTS).resolve()),
    )


def train(
    profile: RunProfile, device: DeviceInfo, env: RuntimeEnv, data: DatasetFiles, model: ModelCheckpoint,
    run_dir: Path, ray_address: str | None, progress: TrainingProgress, generation: GenerationPlan,
) -> TrainResult:
    run = TrainingRun(
        inputs=training_inputs(profile, run_dir, data, model),
        run_dir=str(run_dir), run_name=run_dir.name, devices_here=device.count, ray_address=ray_address,
        runtime_env=env.ray_runtime_env(), generation=generation,
    )
    backend = backend_for(profile.backend)
    try:
        result = backend.train(profile, run, GuardedProgress(progress, StepGuards(profile.guards), run_dir / RunFolder.METRICS))
    except GuardTripped as tripped:
        try:
            tripped.trip.kept = backend.stop_for_guard(run_dir, tripped.trip)
        except OSError as exc:  # the guard's line still ends the run; what could not be kept is said with it
            tripped.trip.kept = f"unknown: the checkpoints could not be put in order ({exc.strerror or exc})"
        write_json_atomic(run_dir / RunFolder.GUARDS, tripped.trip.model_dump(mode="json"))
        raise
    write_json_atomic(run_dir / RunFolder.TRAIN, result.model_dump(mode="json"))
    return result


class GuardedProgress:
    """The stage's `TrainingProgress` with the guards in front: each step is shown, then checked."""

    def __init__(self, progress: TrainingProgress, guards: StepGuards, metrics_file: Path):
        self.progress, self.guards, self.metrics_file = progress, guards, metrics_file

    def started(self, max_steps: int, resumed_from: int | None) -> None:
        # What the run's records hold now is what earlier attempts passed on: the steps before this one's.
        self.guards.records, self.guards.resumed_from = read_metrics(self.metrics_file), resumed_from
        self.progress.started(max_steps, resumed_from)

    def step(self, metrics: StepMetrics) -> None:
        self.progress.step(metrics)
        if trip := self.guards.check(metrics):
            raise GuardTripped(trip)

    def note(self, message: str) -> None:
        self.progress.note(message)

    def warn(self, message: str) -> None:
        self.progress.warn(message)

    def output(self, line: str) -> None:
        self.progress.output(line)

    def nodes(self, title: str, table: list[str]) -> None:
        self.progress.nodes(title, table)
