"""The profile's `tracking` section: which experiment trackers get the run, and how each is reached.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow,tensorboard]'

One choice drives both backends: the flow opens one tracker run per pipeline run (tracking/trackers.py)
and the verl backend renders verl's own loggers to continue that same run from the cluster. Each tool
keeps its own conventions: MLflow's `MLFLOW_TRACKING_URI`, W&B's `WANDB_API_KEY` (read from the
environment where the flow runs, never from a profile), TensorBoard's log folder. The section is made
from the trackers' registry (profiles/trackers/): `trackers` takes their names, and each has its
settings under its name (`tracking.mlflow.experiment`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model

from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.section import Section
from grpo_pipeline.profiles.trackers import TRACKERS

TrackerName = Literal[tuple(TRACKERS)]  # type: ignore[valid-type]  (the registered names, in their order)


class _TrackingChoice(Section):
    trackers: list[TrackerName] = Field(
        default_factory=list, description="Trackers that get the run: "
        f"{', '.join(f'`{name}`' for name in TRACKERS)} (any of them); empty: none, the run folder and Prefect keep "
        "everything.")
    on_unreachable: Literal["fail", "warn"] = Field(
        "fail", description="A tracker that cannot be reached when the run starts: `fail` the run at once, in one "
        "line naming it, or `warn` and run without it.")


TrackingSection = create_model(
    "TrackingSection", __base__=_TrackingChoice, __module__=__name__,
    __doc__="Experiment trackers of the run (none by default).",
    **{name: (cls.settings_class, Field(default_factory=cls.settings_class, description=f"{cls.label} settings."))
       for name, cls in TRACKERS.items()})


def tracker_requirements(tracking: TrackingSection) -> dict[str, NodeRequirement]:
    """What every training node needs when a job logs to the run's trackers itself (the verl backend)."""
    return {TRACKERS[name].package: TRACKERS[name].requirement() for name in tracking.trackers}
