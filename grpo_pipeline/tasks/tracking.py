"""What the flow logs to the run's experiment trackers (tracking/trackers.py), and when.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow]'

Once the run is planned: the tracker run is opened (or found again, for a retried or resumed run) with
the resolved profile (secrets redacted, as in profile.yaml) and the environment as parameters, and tags
naming the Prefect flow run (its id; its URL when a Prefect server is used), the model, the device and
the backend. During training: each step's metrics, for a backend whose job does not log them itself
(`Backend.logs_to_trackers`), the guards' numbers among them, each once, from metrics.jsonl when a tracker did not answer
(tracking/session.py); a guard that stops the run, at its step. At the end, whichever way the run ends: every tracker filled up to the
last step, the report (which links the tracker runs and names steps one missed), the base and trained
evaluation on each benchmark with its intervals, each saved step's at its step (eval.checkpoints=all|best:
the curve) and the best checkpoint's name, the report, its plots and the run's records as files, and the
tracker runs closed with the run's status (FINISHED, FAILED, KILLED).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from uuid import UUID

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.guards import GuardTrip
from grpo_pipeline.backends.metrics import StepMetrics, read_metrics, step_ranges
from grpo_pipeline.tracking.session import StepSource, tracking_session
from grpo_pipeline.tracking.trackers import TrackingState, read_state, start_tracking
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.profiles.evaluation import HELDOUT
from grpo_pipeline.stages.eval_metrics import metric_value
from grpo_pipeline.run.folder import RunFolder

# What the steps of every backend's `StepMetrics` are called in a tracker.
_STEP_FIELDS = ("reward_mean", "reward_std", "kl", "loss", "entropy", "response_length", "tokens_per_s",
                "step_time_s", "generation_s", "learning_rate", "grad_norm", "mismatch", "zero_advantage_share")
_EVAL_FIELDS = ("mean_reward", "accuracy", "format_rate", "pass_at_k", "response_length_mean", "truncation_rate")


def flow_run_url(flow_run_id: UUID) -> str | None:
    """The flow run in Prefect's UI, when a Prefect server (not a temporary one) holds it."""
    from prefect.settings import PREFECT_UI_URL
    from prefect.utilities.urls import url_for

    if not PREFECT_UI_URL.value():
        return None
    try:
        return url_for("flow-run", obj_id=flow_run_id)
    except Exception:  # no UI configured for this API: the id alone names the run
        return None


def run_params(profile: RunProfile, env: dict | None) -> dict[str, str]:
    """The resolved profile, flattened to `section.key`, and the run's environment (both redacted)."""
    params: dict[str, str] = {}

    def flatten(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            params[prefix] = scrub(str(value))

    flatten("", profile.model_dump(mode="json"))
    for name, item in (env or {}).items():
        params[f"env.{name}"] = str(item["value"])
    return params


def run_tags(profile: RunProfile, device: DeviceInfo, flow_run_id: UUID, run_dir: Path) -> dict[str, str]:
    tags = {"prefect.flow_run_id": str(flow_run_id), "model": profile.model.name, "device": device.kind,
            "backend": profile.backend, "run_folder": str(Path(run_dir).resolve())}
    if url := flow_run_url(flow_run_id):
        tags["prefect.flow_run_url"] = url
    return tags


def open_tracker_run(profile: RunProfile, device: DeviceInfo, env: dict | None, run_dir: Path, flow_run_id: UUID,
                     warn) -> TrackingState | None:
    """The run's tracker runs, opened or continued; a tracker that cannot be reached fails here (UserError)."""
    return start_tracking(profile.tracking, run_dir, Path(run_dir).name, run_params(profile, env),
                          run_tags(profile, device, flow_run_id, run_dir), warn)


def step_values(metrics: StepMetrics) -> dict[str, float]:
    values = {f"train/{name}": getattr(metrics, name) for name in _STEP_FIELDS}
    values |= {f"train/{name}": value for name, value in metrics.rewards.items()}  # each reward part, its extras
    return {key: float(value) for key, value in values.items() if value is not None}


def metrics_steps(run_dir: Path) -> StepSource:
    """The steps of the run's metrics.jsonl, as trackers get them (the last record of a step wins: a
    resumed attempt's)."""
    path = Path(run_dir) / RunFolder.METRICS

    def steps(after: int, upto: int) -> list[tuple[int, dict[str, float]]]:
        by_step = {record.step: record for record in read_metrics(path) if after < record.step <= upto}
        return [(step, step_values(by_step[step])) for step in sorted(by_step)]
    return steps


class StepTracking:
    """Training's steps to the trackers, for a backend whose job does not log them itself. A tracker
    that goes away once training runs costs a warning and at most a few seconds every RETRY_S, never
    the training; its steps are sent when it answers, or at the end (tracking/session.py)."""

    def __init__(self, profile: RunProfile, run_dir: Path, logs_itself: bool, warn):
        self._context, self.session = None, None
        if logs_itself:
            return
        self._context = tracking_session(profile.tracking, run_dir, Path(run_dir).name, metrics_steps(run_dir), warn)
        self.session = self._context.__enter__()
        if self.session is not None:
            self.session.catch_up()  # a rerun: steps that earlier attempts, or workers a killed flow left, trained

    def step(self, metrics: StepMetrics) -> None:
        if self.session is not None:
            self.session.log_step(metrics.step, step_values(metrics))

    def close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = self.session = None


def tell_trackers(profile: RunProfile, run_dir: Path, trip: GuardTrip, warn) -> None:
    """A guard stopped the run: its tracker runs get `guard/<guard>` and `guard/stopped_at_step` at the step it
    stopped at (the failure's report, with the guard's line, follows as the run's file when it is closed)."""
    with tracking_session(profile.tracking, run_dir, Path(run_dir).name, warn=warn) as session:
        if session is not None:
            step = trip.step or session.state.last_step
            session.log_values(step, {f"guard/{trip.guard}": 1.0, "guard/stopped_at_step": float(step)})


Report = TypeVar("Report")


def close_tracker_runs(profile: RunProfile | None, run_dir: Path, result: dict, status: str,
                       write_report: Callable[[], Report], warn=None) -> Report:
    """The run's end for its tracker runs, whichever way it ended: every tracker filled up to the last
    step of metrics.jsonl (`result["tracking"]` then names the steps one still missed), `write_report`,
    then the evaluation (at the training step it evaluated; each saved step's at its own step: the curve),
    the best checkpoint's name, the report's files, and the runs closed with `status`. A tracker's fault costs a warning; the report is written whatever they answer."""
    if profile is None or not result.get("tracking"):
        return write_report()
    logs_itself = backend_for(profile.backend).logs_to_trackers
    with tracking_session(profile.tracking, run_dir, Path(run_dir).name, metrics_steps(run_dir), warn) as session:
        if session is not None and not logs_itself:
            session.catch_up()
            session.missed()
        result["tracking"] = tracking_lines(read_state(run_dir))
        written = write_report()
        if session is None:
            return written
        if evaluation := result.get("eval"):
            step = (result.get("train") or {}).get("steps_done") or session.state.last_step
            for at, values in sorted(evaluation_values(evaluation, step).items()):
                session.log_evaluation(at, values)
            if best := evaluation.get("best"):
                session.log_tags({"best_checkpoint": best["name"], "best_checkpoint_path": best["path"],
                                  "best_checkpoint_metric": f"{best['benchmark']}/{best['metric']}"})
        session.log_files(report_files(run_dir))
        session.close(status)
    return written


def _key(metric: str) -> str:
    """A metric's name as every tracker takes it (MLflow refuses `@`)."""
    return metric.replace("@", "_at_")


def model_values(model: dict) -> dict[str, float]:
    """One model's result on one benchmark, with the intervals, under `eval/<model>[/<benchmark>]/`."""
    prefix = f"eval/{model['name']}" + ("" if model.get("benchmark", HELDOUT) == HELDOUT else f"/{model['benchmark']}")
    values = {f"{prefix}/{name}": float(model[name]) for name in _EVAL_FIELDS}
    intervals = {"mean_reward": model["reward_ci95"], **(model.get("ci95") or {})}
    if model.get("pass_at"):
        values[f"{prefix}/avg_at_n"] = float(model["avg_at_n"])
        values |= {f"{prefix}/{_key(name)}": float(value) for name, value in model["pass_at"].items()}
    for name, (low, high) in intervals.items():
        values[f"{prefix}/{_key(name)}_ci95_low"] = float(low)
        values[f"{prefix}/{_key(name)}_ci95_high"] = float(high)
    return values


def evaluation_values(evaluation: dict, step: int) -> dict[int, dict[str, float]]:
    """What the trackers get, by training step: the fixed models (base, trained) at the run's step; each saved
    step's results at that step, and its chosen metric as `eval/checkpoints/<benchmark>/<metric>` (the curve)."""
    by_step: dict[int, dict[str, float]] = {}
    metric = (evaluation.get("best") or {}).get("metric", "pass@1")
    for model in evaluation["models"]:
        at = model.get("step") or step
        values = by_step.setdefault(at, {})
        values |= model_values(model)
        if model.get("step") is not None and model.get("pass_at"):
            value, (low, high) = metric_value(model, metric)
            curve = f"eval/checkpoints/{model.get('benchmark', HELDOUT)}/{_key(metric)}"
            values |= {curve: value, f"{curve}_ci95_low": low, f"{curve}_ci95_high": high}
    if best := evaluation.get("best"):
        by_step.setdefault(step, {})["eval/best_step"] = float(best["step"])
    return by_step


def report_files(run_dir: Path) -> list[Path]:
    """What the tracker run keeps as files: the report and its plots, and the run's own records. Only the
    run's own files: a link there (to a `best.json` or a plot elsewhere) is never followed, so no file from
    outside the run folder reaches a tracker's store."""
    run_dir = Path(run_dir)
    names = (RunFolder.REPORT, RunFolder.REWARD_CURVE, RunFolder.EVAL_PLOT, RunFolder.CURVE_PLOT, RunFolder.GUARDS_PLOT,
             RunFolder.METRICS, RunFolder.PROFILE, RunFolder.EVAL_REPORT, RunFolder.BEST_RECORD)
    return [path for path in (run_dir / name for name in names) if _inside(path, run_dir)]


def _inside(path: Path, run_dir: Path) -> bool:
    """A plain file of the run folder itself: no link on the way, nothing that resolves outside."""
    relative = path.relative_to(run_dir)
    steps = [run_dir.joinpath(*relative.parts[:n]) for n in range(1, len(relative.parts) + 1)]
    return not any(step.is_symlink() for step in steps) and path.resolve().is_relative_to(run_dir.resolve())


def tracking_lines(state: TrackingState | None) -> dict[str, str]:
    """Per tracker, where the run is (for the report): a URL or the folder and command that shows it;
    and the training steps a tracker missed (it did not answer when they were sent, nor at the end)."""
    if state is None:
        return {}
    missed = {f"{name} missed": f"training steps {step_ranges(steps)} (it did not answer; they are in metrics.jsonl)"
              for name, steps in state.missed.items() if steps}
    return dict(state.links) | {name: f"left out: {why}" for name, why in state.skipped.items()} | missed
