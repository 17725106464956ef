"""The experiment trackers a run can log to, one class each, registered by the name users write in
`tracking.trackers`: its label, its settings, the package its client ships in, where it keeps the run,
how a person finds the run, verl's logger for it and what that logger reads to continue the run, the
credentials it needs, and how it logs.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow,tensorboard]'

Everything else asks the registry (`TRACKERS`, `tracker_class`, `tracker_for`), so a new tracker is
one class in a module of this package, listed in `TRACKERS` below. The clients are imported only when
a run opens the tracker. A tracking URI's credentials (`http://user:pass@host`, as MLflow documents)
reach MLflow's client in this process only: ids, links, messages and the job's variables keep the URI
without them.
"""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.profiles.section import Section
from grpo_pipeline.profiles.trackers.base import (
    FAILED,
    FINISHED,
    KILLED,
    STEP_TIMEOUT_S,
    Tracker,
)
from grpo_pipeline.profiles.trackers.mlflow_tracker import MlflowTracker
from grpo_pipeline.profiles.trackers.tensorboard_tracker import TensorboardTracker
from grpo_pipeline.profiles.trackers.wandb_tracker import WandbTracker

__all__ = ["FAILED", "FINISHED", "KILLED", "STEP_TIMEOUT_S", "TRACKERS", "Tracker", "tracker_class", "tracker_for"]

# Every tracker users can name, by that name, in the order the schema, the form and the docs list them.
TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (MlflowTracker, WandbTracker, TensorboardTracker)}


def tracker_class(name: str) -> type[Tracker]:
    return TRACKERS[name]


def tracker_for(name: str, tracking: Section, run_dir: Path) -> Tracker:
    """The tracker `name` of the profile's `tracking` section, for the run in `run_dir`."""
    return TRACKERS[name](getattr(tracking, name), run_dir)
