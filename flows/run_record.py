"""What a flow run has done so far, and what happens when it fails, crashes or is cancelled.

    python -m flows.grpo --model tiny --device cpu --set trainer.step_timeout_s=1   # fails in `train`

`RunRecord` keeps each stage's result and time, and the step the run is in (a stage, or the flow's
own work between two, e.g. checking that every Ray node sees data.root). Prefect's failure hooks get
the flow run, not its variables, so records are kept by flow-run id in `RUNS`; the hook stops what
the run started (the backend's work, this process's Ray job) and writes the failure into report.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger
from prefect.logging import get_logger

from backends import backend_for
from common.files import write_json_atomic
from common.ray_cluster import stop_ray_job
from profiles.errors import UserError
from profiles.schema import RunProfile
from profiles.secrets import scrub
from stages.device import DeviceInfo
from stages.environment import RuntimeEnv
from stages.report import write_report


@dataclass
class RunRecord:
    """What a flow run has done so far; the failure hooks write the report from it."""

    run_dir: Path
    device: DeviceInfo
    profile: RunProfile | None = None
    env: RuntimeEnv | None = None
    result: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    stage: str | None = None
    failure: str | None = None

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Work that a failure report names `name`: a stage's task, or the flow's own work between
        tasks (finding a store entry, checking the cluster), timed under that name."""
        self.stage = name
        started = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.failure = f"Stage `{name}`: {type(exc).__name__}: {scrub(str(exc))}"
            raise
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - started

    def write(self, name: str, data) -> Path:
        """One of the flow's own files of the run folder (plan.json, data/dataset.json, ...): a folder that
        refuses it fails the run with one line naming the file, as a step of its own."""
        path = self.run_dir / name
        try:
            return write_json_atomic(path, data)
        except OSError as exc:
            self.stage = f"write {name}"
            error = UserError(f"cannot write the run's file {path} ({exc.strerror or exc}); make the run folder "
                              "writable there, or choose another --run-name or --run-dir")
            self.failure = f"Stage `{self.stage}`: {error}"
            raise error from None

    def run(self, stage: str, task_fn, *args, checked: str | None = None):
        """Run one stage's task; a cache hit is said to be one, with what was checked to trust it."""
        with self.step(stage):
            state = task_fn(*args, return_state=True)
            value = state.result()
            if state.name == "Cached":
                get_run_logger().info("%s: skipped, its inputs and output are unchanged since an earlier run (checked: %s)",
                                      stage, checked)
                value = value.model_copy(update={"cached": True})
            return value


# Flow runs of this process, by id, for the failure hooks (they get the run, not its variables).
RUNS: dict[UUID, RunRecord] = {}


def after_failure(flow, flow_run, state) -> None:
    """Prefect `on_failure` / `on_crashed` / `on_cancellation` (a cancel from the UI stops the
    run's process): stop the Ray job the run started (its training workers hold devices), and write
    where the run stopped into the report, next to what it did produce."""
    record = RUNS.pop(flow_run.id, None)
    logger = get_logger("grpo_pipeline")
    stopped = bool(record and record.profile) and backend_for(record.profile.backend).stop(record.run_dir)
    if stop_ray_job() or stopped:  # this process's own Ray work (evaluation shards) too
        logger.info("stopped this run's Ray job")
    if record is None:
        return  # the device could not be decided: no run directory; Prefect's state message says why
    failure = record.failure or f"Stage `{record.stage}`: {scrub(state.message or '')}"
    try:
        write_json_atomic(record.run_dir / "timings.json", record.timings)
        path = write_run_report(record, failure=failure)
    except OSError as exc:  # the run's folder itself may be what failed
        logger.error("the run failed in stage %s; no report (%s)", record.stage, exc.strerror or exc)
        return
    logger.error("the run failed in stage %s; report: %s", record.stage, path)


def write_run_report(record: RunRecord, failure: str | None = None) -> Path:
    """report.md from what the run did so far (stages/report.py)."""
    return write_report(
        record.run_dir, profile=record.profile.model_dump(mode="json") if record.profile else None,
        device=record.device.model_dump(mode="json"), env=record.env.redacted() if record.env else None,
        train=record.result.get("train"), evaluation=record.result.get("eval"), timings=dict(record.timings),
        failure=failure,
    )
