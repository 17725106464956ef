"""What a flow run has done so far, and what happens when it fails, crashes or is cancelled.

    python -m grpo_pipeline --model tiny --device cpu --set trainer.step_timeout_s=1   # fails in `train`

`RunRecord` keeps the run's plan (a record is made once the plan is, so it is never without one),
each stage's typed result (`RunResult`) and time, and the step the run is in (a stage, or the flow's
own work between two, e.g. checking that every Ray node sees data.root). Prefect's failure hooks get
the flow run, not its variables, so records are kept by flow-run id in `RUNS`; the hook stops what
the run started (the backend's work, this process's Ray job) and writes the failure into report.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from pydantic import BaseModel, Field

from prefect import get_run_logger
from prefect.artifacts import MarkdownArtifact
from prefect.logging import get_logger

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainResult
from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.cluster.ray_cluster import stop_ray_job
from grpo_pipeline.tracking.trackers import FAILED, KILLED
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.stages.dataset import DatasetFiles
from grpo_pipeline.stages.evaluate import EvalReport
from grpo_pipeline.stages.export import ExportedPolicy
from grpo_pipeline.stages.model import ModelCheckpoint
from grpo_pipeline.stages.plan import RunPlan
from grpo_pipeline.stages.report import ui_report, write_report
from grpo_pipeline.tasks.tracking import close_tracker_runs
from grpo_pipeline.run.folder import RunFolder


class RunResult(BaseModel):
    """What a flow run produced, stage by stage (the flow's return value, as `shown()`); a stage that did
    not run leaves its field empty."""

    run_dir: str
    device: str = Field(..., description="The device kind the run planned for.")
    tracking: dict[str, str] | None = Field(None, description="Per tracker, where the run is (tasks/tracking.py).")
    dataset: DatasetFiles | None = None
    model: ModelCheckpoint | None = None
    command: list[str] | None = Field(None, description="The training command, with the fetched data and model.")
    train: TrainResult | None = None
    policy: ExportedPolicy | None = None
    eval: EvalReport | None = None
    report: str | None = None

    def shown(self) -> dict[str, Any]:
        """As JSON, the stages that ran: what the flow returns, the command line prints and the report and
        trackers read."""
        return {stage: value for stage, value in self.model_dump(mode="json").items() if value is not None}


@dataclass
class RunRecord:
    """What a flow run has done so far, from its plan on; the failure hooks write the report from it."""

    plan: RunPlan
    result: RunResult = field(init=False)
    timings: dict[str, float] = field(default_factory=dict)
    stage: str | None = None
    failure: str | None = None

    def __post_init__(self) -> None:
        self.result = RunResult(run_dir=self.plan.run_dir, device=self.plan.device.kind)

    @property
    def run_dir(self) -> Path:
        return Path(self.plan.run_dir)

    def close_trackers(self, status: str, report: Callable[[], tuple[Path, str]] | None, warn) -> tuple[Path, str] | None:
        """End the tracker runs the run opened with `status` (tasks/tracking.py `close_tracker_runs`), and
        keep where each tracker is, with the steps one missed, for what the run returns."""
        shown = self.result.shown()
        closed = close_tracker_runs(self.plan.profile, self.run_dir, shown, status, report or (lambda: None), warn)
        self.result.tracking = shown.get("tracking")
        return closed

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Work that a failure report names `name`: a stage's task, or the flow's own work between
        tasks (finding a store entry, checking the cluster), timed under that name."""
        self.stage = name
        started = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.failure = f"Stage `{name}`: {failure_words(exc)}"
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
    if cancelled:
        # A UI cancel runs this hook in the worker, after the flow's process has ended: the process may not
        # have marked its task runs (Ray's core ends it at once when the cancel's SIGTERM reaches the run's
        # local Ray first; the worker kills it 30 s after the signal), and nothing in it can overwrite now.
        try:
            _mark_task_runs_cancelled(flow_run.id)
        except Exception as exc:  # the API may be what went away
            get_logger("grpo_pipeline").warning("the run's task runs could not be marked cancelled: %s", exc)
    close_failed_run(flow_run.id, "was cancelled" if cancelled else "failed", state.message,
                     KILLED if cancelled or state.is_crashed() else FAILED)


def close_failed_run(flow_run_id: UUID, how: str, message: str | None, status: str = FAILED) -> None:
    """Stop the Ray job the run started (its training workers hold devices), and write where the run
    stopped into the report, next to what it did produce; publish that report to Prefect's UI too;
    end the tracker runs with `status`."""
    record = RUNS.pop(flow_run_id, None)
    logger = get_logger("grpo_pipeline")
    stopped = []
    if record and backend_for(record.plan.profile.backend).stop(record.run_dir):
        stopped.append(f"the {record.plan.profile.backend} backend's training (its Ray job or workers)")
    if stop_ray_job():  # this process's own Ray work (a local Ray, evaluation tasks)
        stopped.append("the Ray work of the flow's process")
    if stopped:
        logger.info("stopped %s", " and ".join(stopped))
    if record is None:  # refused (or stopped) while it was planned: no run folder, so the report is the UI's only
        _publish(flow_run_id, f"> **The run {how}.** Stage `plan_run`: {scrub(message or '')}\n\nIt {how} while it was "
                 "planned: nothing was started and no run folder was made.\n", f"Report of the run ({how} while it was "
                 "planned)", "", logger)
        return
    failure = record.failure or f"Stage `{record.stage}`: {scrub(message or '')}"

    def report() -> tuple[Path, str]:
        write_json_atomic(record.run_dir / RunFolder.TIMINGS, record.timings)
        return write_run_report(record, failure=failure, stopped=stopped)

    try:  # the tracker runs end with the run's status, and the report names steps a tracker missed
        path, markdown = record.close_trackers(status, report, logger.warning)
    except OSError as exc:  # the run's folder itself may be what failed
        logger.error("the run %s in stage %s; no report (%s)", how, record.stage, exc.strerror or exc)
        return
    _publish(flow_run_id, markdown, f"Report of run {record.run_dir.name} ({how})", f"; it is in {path}", logger)
    logger.error("the run %s in stage %s; report: %s", how, record.stage, path)


def _publish(flow_run_id: UUID, markdown: str, description: str, where: str, logger) -> None:
    """The UI shows a failed run's report as it shows a finished one's."""
    try:
        MarkdownArtifact(key="run-report", markdown=markdown, description=description, flow_run_id=flow_run_id).create()
    except Exception as exc:  # the API may be what went away
        logger.warning("the report could not be published to Prefect's API (%s)%s", exc, where)


def _mark_task_runs_cancelled(flow_run_id: UUID) -> bool:
    """Mark the run's unfinished task runs Cancelled when the flow run is being cancelled (Prefect's task
    engine marks them Crashed on the signal, or leaves them Running when the process ends first). False
    when the run is not being cancelled (a plain SIGTERM)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is None or not (state.is_cancelling() or state.is_cancelled()):
            return False
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        for task_run in runs:
            if task_run.state and not task_run.state.is_completed() and not task_run.state.is_cancelled():
                client.set_task_run_state(task_run.id, Cancelled(message="the flow run was cancelled"), force=True)
    return True


def close_cancelled_run(flow_run_id: UUID) -> bool:
    """A cancel from the UI: the worker sends the flow's process SIGTERM and owns the run's final
    state and its `on_cancellation` hooks, which it runs in its own process (where this run's record
    is not). So the process closes the run itself, when it lives long enough: its task runs, which
    Prefect's task engine marked Crashed as the signal's exception passed, marked Cancelled (after_failure
    marks them again in the worker), the report, stopped work. False when the run was not cancelled (a
    plain SIGTERM: the on_crashed hook, in this process, closes it)."""
    if not _mark_task_runs_cancelled(flow_run_id):
        return False
    close_failed_run(flow_run_id, "was cancelled", "cancelled from the UI or the API", KILLED)
    return True


def write_run_report(record: RunRecord, failure: str | None = None, stopped: list[str] | None = None) -> tuple[Path, str]:
    """report.md from what the run did so far, and the same for Prefect's UI (stages/report.py)."""
    plan, result = record.plan, record.result.shown()
    parts = dict(
        profile=plan.profile.model_dump(mode="json"), device=plan.device.model_dump(mode="json"),
        env=plan.env.redacted(), train=result.get("train"), evaluation=result.get("eval"), timings=dict(record.timings),
        failure=failure, stopped=stopped, tracking=result.get("tracking"),
    )
    return write_report(record.run_dir, **parts), ui_report(record.run_dir, **parts)


def failure_words(exc: BaseException) -> str:
    """An exception in the report's words: one with no message of its own (Prefect's TerminationSignal on
    SIGTERM, a KeyboardInterrupt) says what it means rather than ending on a bare colon."""
    if type(exc).__name__ in ("TerminationSignal", "KeyboardInterrupt"):
        signal = getattr(exc, "signal", None)
        return f"stopped by a signal{f' ({signal})' if signal is not None else ''} ({type(exc).__name__})"
    said = scrub(str(exc))
    return f"{type(exc).__name__}: {said}" if said else f"{type(exc).__name__} (with no message)"
