"""The run's tracker runs: opened once the run is planned, found again, and what a job needs to continue them.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow,tensorboard]'
    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db        # then: the run, its metrics, its report

A tracker run is the whole pipeline run. `start_tracking` opens it once the run is planned (or finds it
again: its ids are kept in the run folder's `tracking.json`, so a retried or resumed run continues the
same tracker run), a `TrackingSession` (tracking/session.py) logs to it, and `job_env` gives the
variables verl's own loggers read to continue it from a cluster job. Each tracker (MLflow, Weights &
Biases, TensorBoard) is a class of profiles/trackers/; this module asks them, by the names in
`tracking.trackers`, and knows none of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.errors import UserError
from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.profiles.trackers import (  # noqa: F401  (the run's end statuses: the flow imports them from here)
    FAILED,
    FINISHED,
    KILLED,
    tracker_class,
    tracker_for,
)
from grpo_pipeline.profiles.tracking import TrackingSection
from grpo_pipeline.run.folder import RunFolder

# How long opening a tracker's run may take: a yes/no at the start (a step's bound: `Tracker.bounded`).
OPEN_TIMEOUT_S = 15


class TrackingState(BaseModel):
    """`runs/<run>/tracking.json`: the tracker runs of this pipeline run, and how far they got."""

    runs: dict[str, dict[str, str]] = Field(default_factory=dict, description="Per tracker: its run's ids and where it is.")
    links: dict[str, str] = Field(default_factory=dict, description="Per tracker: where a person looks at the run.")
    skipped: dict[str, str] = Field(default_factory=dict, description="Trackers left out at the start (warn): why.")
    last_step: int = Field(0, description="The last training step every tracker has (from an earlier version: the "
                           "last one the flow logged).")
    logged_to: dict[str, int] = Field(default_factory=dict, description="Per tracker: the last training step it has, "
                                      "each step up to it once; steps after it wait in metrics.jsonl.")
    missed: dict[str, list[int]] = Field(default_factory=dict, description="Per tracker: steps of metrics.jsonl it did "
                                         "not get by the run's end (it did not answer); the report names them.")
    ended: str | None = Field(None, description="The status the tracker runs were closed with, once the run ended.")
    evaluated_at: list[int] = Field(default_factory=list, description="Training steps whose evaluation was logged.")

    def logged(self, name: str) -> int:
        return self.logged_to.get(name, self.last_step)


def read_state(run_dir: Path) -> TrackingState | None:
    try:
        return TrackingState.model_validate_json((Path(run_dir) / RunFolder.TRACKING).read_text())
    except (OSError, ValueError):
        return None


def write_state(run_dir: Path, state: TrackingState) -> None:
    write_json_atomic(Path(run_dir) / RunFolder.TRACKING, state.model_dump(mode="json"))


def start_tracking(settings: TrackingSection, run_dir: Path, run_name: str, params: dict[str, str],
                   tags: dict[str, str], warn) -> TrackingState | None:
    """Open (or continue) the run's tracker runs and log what the run is; None without trackers. A tracker
    that cannot be reached raises `UserError` in one line naming it, or with `on_unreachable: warn` is
    left out of the run (`warn` says so, `tracking.json` remembers it)."""
    if not settings.trackers:
        return None
    state = read_state(run_dir) or TrackingState()
    for name in settings.trackers:
        if name in state.skipped:
            continue
        tracker = tracker_for(name, settings, run_dir)
        try:
            with tracker.bounded(OPEN_TIMEOUT_S):  # a server that is not there fails in seconds, not after its retries
                if name not in state.runs:
                    state.logged_to[name] = 0  # a new tracker run gets every step of metrics.jsonl
                state.runs[name] = tracker.open(state.runs.get(name), run_name)
                state.links[name] = tracker.link()
                tracker.log_params(params, tags)
                tracker.close()
        except Exception as exc:  # each tool raises its own types (connection, auth, timeouts)
            problem = f"{tracker.label} ({tracker.where()}) cannot be reached: {one_line(exc)}"
            if settings.on_unreachable == "fail":
                raise UserError(f"tracking: {problem}; start it or fix tracking.{name}, drop it from tracking.trackers, "
                                "or set tracking.on_unreachable=warn to run without it") from None
            warn(f"tracking: {problem}; the run goes on without {tracker.label} (tracking.on_unreachable=warn)")
            state.skipped[name] = problem
    write_state(run_dir, state)
    return state


def job_env(settings: TrackingSection, run_dir: Path) -> dict[str, str]:
    """The variables verl's loggers read to log to this run's tracker runs from a cluster job."""
    state = read_state(run_dir)
    if state is None:
        return {}
    env: dict[str, str] = {}
    for name, ids in state.runs.items():
        env |= tracker_for(name, settings, run_dir).job_env(ids)
    return env


def store_problem(settings: TrackingSection, write: bool) -> str | None:
    """The first tracker store the run could not use (an MLflow SQLite file it could not create or open),
    checked at planning; `write`: a run's check, which may create and remove a file (a dry run looks only)."""
    return next((problem for name in settings.trackers
                 if (problem := tracker_class(name).store_problem(getattr(settings, name), write))), None)


def missing_credentials(settings: TrackingSection, environ: Mapping[str, str] | None = None) -> str | None:
    """A tracker the run cannot log to without credentials this environment lacks (W&B online without a
    key), known before anything starts: the problem and its fix, or None."""
    environ = os.environ if environ is None else environ
    return next((missing for name in settings.trackers
                 if (missing := tracker_class(name).missing_credentials(getattr(settings, name), environ))), None)


def one_line(exc: Exception) -> str:
    """An exception in one line, scrubbed of secrets: a warning's or a refusal's words."""
    text = scrub(str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
