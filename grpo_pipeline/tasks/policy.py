"""How Prefect runs each stage: retries, time limits, the cross-run cache of the data and model
stages, progress artifacts, and what the run's log lines may carry.

    python -m grpo_pipeline --model tiny --device cpu    # a second run: both stages "skipped"

The table `STAGE_SETTINGS` is the one place a stage's retries and limits are set (docs/running.md: the
stage table). A config error (`UserError`) is never retried, whatever the row says, nor is a run a
guard stopped (`GuardTripped`).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.exceptions import FailedRun
from prefect.tasks import exponential_backoff

from grpo_pipeline.backends.base import TrainingInterrupted
from grpo_pipeline.backends.guards import GuardTripped
from grpo_pipeline.backends.metrics import StepMetrics, read_metrics
from grpo_pipeline.store.file_faults import file_fault
from grpo_pipeline.progress import reporting_to
from grpo_pipeline.store.content import fingerprint, verify_entry, what_is_checked
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.secrets import scrub, secret_values

# Task settings, per stage. Every stage fails at once on a config error (`retry_unless_user_error`).
# Prefect's `timeout_seconds` interrupts a stage that runs in the flow's main thread (it uses
# SIGALRM); work that blocks elsewhere carries its own limit: the device probe is a subprocess
# with a timeout, hub transfers time out per read (huggingface_hub), and a
# training step that never ends is caught by `trainer.step_timeout_s`.
HOUR = 3600
# Downloads: 4 retries after 2, 4, 8, 16 s (each +-50% jitter), so a mirror's bad minute passes.
FETCH_RETRIES = dict(retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_jitter_factor=0.5)
STAGE_SETTINGS: dict[str, dict] = {
    # The run's plan (stages/plan.py `plan_run`): the device probe (retried once: a driver may answer
    # late), the profile's checks (user rewards are imported in a child process with their own limit).
    "plan_run": dict(retries=1, retry_delay_seconds=2, timeout_seconds=600),
    "detect_device": dict(timeout_seconds=120),
    "resolve_profile": dict(timeout_seconds=120),
    "prepare_environment": dict(timeout_seconds=120),
    "fetch_dataset": dict(**FETCH_RETRIES, timeout_seconds=2 * HOUR),
    # 244 GB of weights at 100 MB/s is 40 min; a slow mirror may take hours.
    "prepare_checkpoint": dict(**FETCH_RETRIES, timeout_seconds=12 * HOUR),
    # A lost worker, node or collective is retried twice, resuming from the latest checkpoint. No
    # wall-clock limit: a run may take days; a hang is a step that never ends.
    "train": dict(retries=2, retry_delay_seconds=10),
    # HF -> Megatron dist checkpoint, part of prepare_checkpoint when `model.dist_checkpoint` asks for
    # it: 244 GB read and written once, streamed. A bad checkpoint is a UserError (never retried).
    "convert_checkpoint": dict(retries=1, retry_delay_seconds=10, timeout_seconds=6 * HOUR),
    # A verl step saved as a dist checkpoint is converted back to HF here, streamed, like the above.
    "export_checkpoint": dict(retries=1, retry_delay_seconds=10, timeout_seconds=6 * HOUR),
    "evaluate": dict(retries=1, retry_delay_seconds=10, timeout_seconds=6 * HOUR),
    "report": dict(timeout_seconds=300),
}
PROGRESS_UPDATE_S = 1.0
TABLE_UPDATE_S = 2.0


class RunLogFilter(logging.Filter):
    """On every handler of the run's logs (the terminal, and Prefect's API, which stores them): a
    user error, and training that stopped (a lost worker, a hang: its line says which and where), is
    reported by its one-line message (Prefect would log its traceback, which only buries the line
    that says what to fix), and no secret value of this process reaches a line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (UserError, TrainingInterrupted, GuardTripped)):
            record.exc_info, record.exc_text = None, None
        if record.exc_info and isinstance(record.exc_info[1], FailedRun) and record.getMessage() == _ENGINE_EXIT:
            # The flow ended its own run Failed with the one line that says what to fix (flows/form.py); the
            # engine that ran it then reads the state's result, gets FailedRun and logs it with a traceback.
            return False
        if _cancelling() and (said := _CANCELLED_WORDING.get(record.getMessage().split("(")[0])):
            # A cancel reaches the process as SIGTERM: Prefect's engines call the running task crashed (an
            # ERROR) and the flow "Finished in state Running()" (the worker records Cancelled after).
            record.msg, record.args, record.levelno, record.levelname = said, (), logging.INFO, "INFO"
        values = secret_values()
        if values:
            record.msg, record.args = scrub(record.getMessage(), values), ()
            if record.exc_info and not record.exc_text:
                record.exc_text = scrub(logging.Formatter().formatException(record.exc_info), values)
        return True


_ENGINE_EXIT = "Engine execution exited with unexpected exception"  # prefect.flow_engine.run_flow's words
_CANCELLED_WORDING = {
    "Crash detected! Execution was aborted by a termination signal.": "Stopped: the flow run was cancelled",
    "Finished in state Crashed": "Finished: cancelled",
    "Finished in state Running": "Finished: cancelled (the worker records the Cancelled state)",
}


def _cancelling() -> bool:
    """The worker asked this process to stop because the run was cancelled (Prefect's control channel
    says so before its SIGTERM; a plain SIGTERM is a crash and keeps Prefect's words)."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:  # another Prefect: its own words stay
        return False
    return get_intent() == "cancel"


def filter_run_logs() -> None:
    """RunLogFilter on every handler a run's line can reach: the terminal's (root, `prefect`) and the ones
    that send lines to Prefect's API, which sit on `prefect.flow_runs`, `prefect.task_runs` and
    `prefect.extra` (the UI's Logs tab shows what those stored)."""
    names = [name for name in logging.Logger.manager.loggerDict if name == "prefect" or name.startswith("prefect.")]
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in names)]
    for handler in {handler for logger in loggers for handler in logger.handlers}:
        if not any(isinstance(f, RunLogFilter) for f in handler.filters):
            handler.addFilter(RunLogFilter())


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: a bad profile or device fails at once, and so does a run a guard
    stopped (backends/guards.py: the same data and weights would trip it again); faults may retry."""
    try:
        state.result()
    except (UserError, GuardTripped):
        return False
    except Exception:
        return True
    return True


@contextmanager
def progress_artifact(key: str, description: str) -> Iterator[None]:
    """The stage's progress bars, also as a Prefect progress artifact (updated at most once a second).

    Each attempt of a stage has its own artifact under the key (Prefect keeps them as the key's versions,
    the newest shown as the key's); an attempt that fails says so on its bar, so a retried stage's page
    does not show an earlier attempt's bar as if it were still going."""
    artifact_id = create_progress_artifact(0.0, key=key, description=description)
    last_update, shown = 0.0, 0.0

    def show(progress: float, what: str) -> None:
        nonlocal shown
        try:
            update_progress_artifact(artifact_id, progress=progress, description=f"{description}: {what}")
            shown = progress
        except Exception:  # the UI's progress is not worth failing a download for
            pass

    def update(fraction: float, what: str) -> None:
        nonlocal last_update
        now = time.monotonic()
        if fraction < 1.0 and now - last_update < PROGRESS_UPDATE_S:
            return
        last_update = now
        show(round(100 * fraction, 1), what)

    try:
        with reporting_to(update):
            yield
    except BaseException as exc:
        # The type only: an error's message may hold a value the run's redaction has not seen.
        show(shown, f"this attempt stopped ({type(exc).__name__})")
        raise
    update_progress_artifact(artifact_id, progress=100.0, description=f"{description}: done")


class StepTable:
    """The Prefect table artifact `train-metrics`: every step record of the run so far (earlier attempts'
    too), patched in place through the API (at most every TABLE_UPDATE_S), so the run's page shows the
    table growing as training goes, beside the `train` progress bar."""

    def __init__(self, metrics_file: Path):
        self.metrics_file, self.artifact_id, self.shown_at = metrics_file, None, 0.0

    def show(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.shown_at < TABLE_UPDATE_S:
            return
        self.shown_at = now
        rows = [_row(record) for record in read_metrics(self.metrics_file)]
        try:
            if self.artifact_id is None:
                self.artifact_id = create_table_artifact(rows, key="train-metrics",
                                                         description="GRPO step metrics, one row per step (live)")
            else:
                from prefect.client.orchestration import get_client
                from prefect.client.schemas.actions import ArtifactUpdate

                with get_client(sync_client=True) as client:
                    client.update_artifact(self.artifact_id, ArtifactUpdate(data=json.dumps(rows)))
        except Exception:  # the UI's table is not worth failing a training step for
            pass


def _row(record: StepMetrics) -> dict:
    def rounded(value: float | None, digits: int) -> float | str | None:
        if value is not None and not math.isfinite(value):
            return str(value)  # JSON has no NaN: the API would refuse the table
        return None if value is None else round(value, digits)

    return {"step": record.step, "reward": rounded(record.reward_mean, 3), "reward std": rounded(record.reward_std, 3),
            "KL": rounded(record.kl, 4), "loss": rounded(record.loss, 4), "response length": round(record.response_length, 1),
            "tokens/s": rounded(record.tokens_per_s, 0), "step s": round(record.step_time_s, 2),
            # the guards' numbers (backends/guards.py)
            "grad norm": rounded(record.grad_norm, 3), "mismatch": None if record.mismatch is None else (
                f"{record.mismatch:.2e}"), "zero-adv groups": rounded(record.zero_advantage_share, 2)}


def stage_task(name: str, **options):
    """A stage's Prefect task, with the settings of its row in STAGE_SETTINGS."""

    def decorate(fn):
        return task(name=name, retry_condition_fn=retry_unless_user_error, **STAGE_SETTINGS[name], **options)(
            errors_scrubbed(fn))

    return decorate


def errors_scrubbed(fn):
    """A stage whose error would carry a secret value (a library's message quoting a URL with
    credentials, say) raises it scrubbed: Prefect stores a failed task's message in its database and
    pickles the exception into its result storage. The kind of error stays: a config error (UserError)
    is still one, never retried; an OSError no retry can fix (a full disk, a file where a folder
    belongs: store/file_faults.py) becomes one; anything else is still retried. (functools.wraps: the task's cache key
    is still its own source.)"""

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            # A stage that writes in the run's folder: a full disk there is why, whatever the error says.
            folder = signature.bind_partial(*args, **kwargs).arguments.get("run_dir")
            if not isinstance(exc, (UserError, GuardTripped)) and (fault := file_fault(exc, folder and Path(folder))):
                raise type(fault)(scrub(str(fault))) from None  # no retry helps
            text = str(exc)
            if (clean := scrub(text)) == text:
                raise
            if isinstance(exc, GuardTripped):  # still one: never retried
                raise GuardTripped(exc.trip.model_copy(update={"line": scrub(exc.trip.line)})) from None
            kind = UserError if isinstance(exc, UserError) else RuntimeError
            raise kind(f"{type(exc).__name__}: {clean}") from None

    return run


@dataclass
class LocalSourceUnchanged(CachePolicy):
    """Part of the data and model stages' cross-run cache key: for a local source directory, what
    it looks like now (file names, sizes, mtimes), so an edited directory is read again."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        spec = inputs["spec"]
        return fingerprint(Path(spec.source)) if spec.source_kind == "local" else None


# Keyed by the stage's inputs and code, not by the run (Prefect's default adds the run id), with
# the result persisted, so a later run with the same data and model settings skips the stage.
CACHED_ACROSS_RUNS = dict(cache_policy=INPUTS + TASK_SOURCE + LocalSourceUnchanged(), persist_result=True)


def reuse_only_if_intact(task_fn, output_dir: Path, in_store: bool):
    """The task, which an earlier run's cached result may stand in for while the directory that
    result names passes the store's own check (`verify_entry`: see `what_is_checked`), and what
    that check was; a damaged entry makes the task run, which repairs it and replaces the result.
    A local model directory is used in place: its fingerprint is part of the cache key."""
    if in_store:
        intact, checked = not verify_entry(output_dir), what_is_checked(output_dir)
    else:
        intact, checked = output_dir.is_dir(), "file names, sizes and mtimes, in the cache key"
    return (task_fn if intact else task_fn.with_options(refresh_cache=True)), checked
