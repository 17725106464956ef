"""The profile's `tracking` section: which experiment trackers get the run, and how each is reached.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow,tensorboard]'

One choice drives both backends: the flow opens one tracker run per pipeline run (common/tracking.py)
and the verl backend renders verl's own loggers to continue that same run from the cluster. Each tool
keeps its own conventions: MLflow's `MLFLOW_TRACKING_URI`, W&B's `WANDB_API_KEY` (read from the
environment where the flow runs, never from a profile), TensorBoard's log folder.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.section import Section

TrackerName = Literal["mlflow", "wandb", "tensorboard"]
# The distribution each tracker's client ships in: what the preflight asks every node for when the
# verl backend's job logs to the tracker itself.
# verl's TensorBoard logger writes through torch's SummaryWriter, which needs the tensorboard package.
TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}
_ALSO_NAMED = {"mlflow": ["mlflow-skinny"]}
_IMPORTS = {"mlflow": ["mlflow"], "wandb": ["wandb"], "tensorboard": ["torch.utils.tensorboard"]}


class MlflowSettings(Section):
    tracking_uri: str | None = Field(
        None, description="The MLflow tracking server (`http://host:5000`) or store (`sqlite:///path/mlflow.db`); "
        "empty: the MLFLOW_TRACKING_URI variable of the flow's environment, else `sqlite:///<run root>/mlflow.db`.")
    experiment: str = Field("grpo-pipeline", min_length=1, description="MLflow experiment the run is logged under.")


class WandbSettings(Section):
    project: str = Field("grpo-pipeline", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); empty: the key's default entity.")
    mode: Literal["online", "offline"] = Field(
        "online", description="`online` sends the run to W&B (WANDB_API_KEY must be exported where the flow runs, "
        "and on every node for the verl backend); `offline` writes it under the run folder for `wandb sync`.")


class TensorboardSettings(Section):
    log_dir: str | None = Field(
        None, description="Folder of the event files (shared storage for the verl backend); empty: "
        "`<run folder>/tensorboard`.")


class TrackingSection(Section):
    """Experiment trackers of the run (none by default)."""

    trackers: list[TrackerName] = Field(
        default_factory=list, description="Trackers that get the run: `mlflow`, `wandb`, `tensorboard` (any of them); "
        "empty: none, the run folder and Prefect keep everything.")
    on_unreachable: Literal["fail", "warn"] = Field(
        "fail", description="A tracker that cannot be reached when the run starts: `fail` the run at once, in one "
        "line naming it, or `warn` and run without it.")
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings, description="MLflow settings.")
    wandb: WandbSettings = Field(default_factory=WandbSettings, description="Weights & Biases settings.")
    tensorboard: TensorboardSettings = Field(default_factory=TensorboardSettings, description="TensorBoard settings.")


def tracker_requirements(tracking: TrackingSection) -> dict[str, NodeRequirement]:
    """What every training node needs when a job logs to the run's trackers itself (the verl backend)."""
    return {
        TRACKER_PACKAGES[name]: NodeRequirement(
            stages=["train"], also_named=_ALSO_NAMED.get(name, []), imports=_IMPORTS[name],
            why=f"tracking.trackers has {name}: the job's own logger writes each step to it",
            fix=f"pip install {TRACKER_PACKAGES[name]} in the image, or drop {name} from tracking.trackers")
        for name in tracking.trackers
    }
