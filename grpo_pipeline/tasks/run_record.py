"""What a flow run has done so far, and what happens when it fails, crashes or is cancelled.

    python -m grpo_pipeline --model tiny --device cpu --set trainer.step_timeout_s=1   # fails in `train`

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
from prefect.artifacts import MarkdownArtifact
from prefect.logging import get_logger

from grpo_pipeline.backends import backend_for
from grpo_pipeline.common.files import write_json_atomic
from grpo_pipeline.common.ray_cluster import stop_ray_job
from grpo_pipeline.common.tracking import FAILED, KILLED
from grpo_pipeline.common.errors import UserError
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.stages.environment import RuntimeEnv
from grpo_pipeline.stages.report import ui_report, write_report
from grpo_pipeline.tasks.tracking import close_tracker_runs
from grpo_pipeline.run.folder import RunFolder


@dataclass
class RunRecord:
    """What a flow run has done so far; the failure hooks write the report from it."""

    run_dir: Path
    device: DeviceInfo
    profile: RunProfile | None = None
    env: RuntimeEnv | None = None
    generation: GenerationPlan | None = None
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
    """Prefect `on_failure` / `on_crashed` / `on_cancellation`: `close_failed_run`. A run cancelled or
    stopped (SIGTERM: crashed) ends its tracker runs KILLED, one that failed FAILED."""
    cancelled = state.is_cancelled() or state.is_cancelling()
    close_failed_run(flow_run.id, "was cancelled" if cancelled else "failed", state.message,
                     KILLED if cancelled or state.is_crashed() else FAILED)


def close_failed_run(flow_run_id: UUID, how: str, message: str | None, status: str = FAILED) -> None:
    """Stop the Ray job the run started (its training workers hold devices), and write where the run
    stopped into the report, next to what it did produce; publish that report to Prefect's UI too;
    end the tracker runs with `status`."""
    record = RUNS.pop(flow_run_id, None)
    logger = get_logger("grpo_pipeline")
    stopped = []
    if record and record.profile and backend_for(record.profile.backend).stop(record.run_dir):
        stopped.append(f"the {record.profile.backend} backend's training (its Ray job or workers)")
    if stop_ray_job():  # this process's own Ray work (a local Ray, evaluation tasks)
        stopped.append("the Ray work of the flow's process")
    if stopped:
        logger.info("stopped %s", " and ".join(stopped))
    if record is None:
        return  # the device could not be decided: no run directory; Prefect's state message says why
    failure = record.failure or f"Stage `{record.stage}`: {scrub(message or '')}"

    def report() -> tuple[Path, str]:
        write_json_atomic(record.run_dir / RunFolder.TIMINGS, record.timings)
        return write_run_report(record, failure=failure, stopped=stopped)

    try:  # the tracker runs end with the run's status, and the report names steps a tracker missed
        path, markdown = close_tracker_runs(record.profile, record.run_dir, record.result, status, report, logger.warning)
    except OSError as exc:  # the run's folder itself may be what failed
        logger.error("the run %s in stage %s; no report (%s)", how, record.stage, exc.strerror or exc)
        return
    try:  # the UI shows a failed run's report as it shows a finished one's
        MarkdownArtifact(key="run-report", markdown=markdown, description=f"Report of run {record.run_dir.name} ({how})",
                         flow_run_id=flow_run_id).create()
    except Exception as exc:  # the API may be what went away; the file is written
        logger.warning("the report could not be published to Prefect's API (%s); it is in %s", exc, path)
    logger.error("the run %s in stage %s; report: %s", how, record.stage, path)


def close_cancelled_run(flow_run_id: UUID) -> bool:
    """A cancel from the UI: the worker sends the flow's process SIGTERM and owns the run's final
    state and its `on_cancellation` hooks, which it runs in its own process (where this run's record
    is not). So the process closes the run itself: report, stopped work, and its task runs, which
    Prefect's task engine marks Crashed on the signal, marked Cancelled. False when the run was not
    cancelled (a plain SIGTERM: the on_crashed hook, in this process, closes it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is None or not (state.is_cancelling() or state.is_cancelled()):
            return False
        close_failed_run(flow_run_id, "was cancelled", "cancelled from the UI or the API", KILLED)
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        for task_run in runs:
            if task_run.state and not task_run.state.is_completed() and not task_run.state.is_cancelled():
                client.set_task_run_state(task_run.id, Cancelled(message="the flow run was cancelled"), force=True)
    return True


def write_run_report(record: RunRecord, failure: str | None = None, stopped: list[str] | None = None) -> tuple[Path, str]:
    """report.md from what the run did so far, and the same for Prefect's UI (stages/report.py)."""
    parts = dict(
        profile=record.profile.model_dump(mode="json") if record.profile else None,
        device=record.device.model_dump(mode="json"), env=record.env.redacted() if record.env else None,
        train=record.result.get("train"), evaluation=record.result.get("eval"), timings=dict(record.timings),
        failure=failure, stopped=stopped, tracking=record.result.get("tracking"),
    )
    return write_report(record.run_dir, **parts), ui_report(record.run_dir, **parts)
