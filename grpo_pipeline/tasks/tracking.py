"""What the flow logs to the run's experiment trackers (common/tracking.py), and when.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow]'

Once the run is planned: the tracker run is opened (or found again, for a retried or resumed run) with
the resolved profile (secrets redacted, as in profile.yaml) and the environment as parameters, and tags
naming the Prefect flow run (its id; its URL when a Prefect server is used), the model, the device and
the backend. During training: each step's metrics, for a backend whose job does not log them itself
(`Backend.logs_to_trackers`). At the end: the base and trained evaluation on each benchmark with its
intervals, each saved step's at its step (eval.checkpoints=all|best: the curve) and the best checkpoint's
name, and the report, its plots and the run's records as files. The report links the tracker runs.
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from grpo_pipeline.backends.metrics import METRICS, StepMetrics
from grpo_pipeline.common.tracking import TrackingState, start_tracking, tracking_session
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.profiles.evaluation import HELDOUT
from grpo_pipeline.stages.benchmark_report import CURVE_PLOT, EVAL_PLOT
from grpo_pipeline.stages.eval_metrics import metric_value
from grpo_pipeline.stages.export import BEST
from grpo_pipeline.stages.report import REPORT, REWARD_CURVE

# What the steps of every backend's `StepMetrics` are called in a tracker.
_STEP_FIELDS = ("reward_mean", "reward_std", "kl", "loss", "entropy", "response_length", "tokens_per_s",
                "step_time_s", "generation_s", "learning_rate")
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


class StepTracking:
    """Training's steps to the trackers, for a backend whose job does not log them itself. A tracker
    that goes away once training runs costs its steps a warning, never the training (reaching it is
    checked at the start); the steps stay in metrics.jsonl and the report."""

    def __init__(self, profile: RunProfile, run_dir: Path, logs_itself: bool, warn):
        self.warn, self._context, self.session = warn, None, None
        if logs_itself:
            return
        self._context = tracking_session(profile.tracking, run_dir, Path(run_dir).name)
        try:
            self.session = self._context.__enter__()
        except Exception as exc:  # each tool raises its own types
            self._context = None
            warn(f"tracking: the tracker runs could not be reopened for training's steps ({scrub(str(exc))[:200]}); "
                 "training goes on, its steps are in metrics.jsonl")

    def step(self, metrics: StepMetrics) -> None:
        if self.session is None:
            return
        try:
            self.session.log_step(metrics.step, step_values(metrics))
        except Exception as exc:
            self.warn(f"tracking: step {metrics.step} was not logged ({scrub(str(exc))[:200]}); training goes on")

    def close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = self.session = None


def finish_tracker_run(profile: RunProfile, run_dir: Path, result: dict, files: list[Path], finished: bool) -> bool:
    """The evaluation (at the training step it evaluated; each saved step's at its own step: the curve), the
    best checkpoint's name, and the report's files, then the run's end."""
    with tracking_session(profile.tracking, run_dir, Path(run_dir).name) as session:
        if session is None:
            return False
        if evaluation := result.get("eval"):
            step = (result.get("train") or {}).get("steps_done") or session.state.last_step
            for at, values in sorted(evaluation_values(evaluation, step).items()):
                session.log_evaluation(at, values)
            if best := evaluation.get("best"):
                session.log_tags({"best_checkpoint": best["name"], "best_checkpoint_path": best["path"],
                                  "best_checkpoint_metric": f"{best['benchmark']}/{best['metric']}"})
        session.log_files(files)
        session.close(finished)
        session.trackers = []  # closed with the run's outcome above
    return True


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
    """What the tracker run keeps as files: the report and its plots, and the run's own records."""
    run_dir = Path(run_dir)
    return [run_dir / name for name in (REPORT, REWARD_CURVE, EVAL_PLOT, CURVE_PLOT, METRICS, "profile.yaml",
                                        "eval/eval.json", f"{BEST}.json")]


def tracking_lines(state: TrackingState | None) -> dict[str, str]:
    """Per tracker, where the run is (for the report): a URL or the folder and command that shows it."""
    if state is None:
        return {}
    return dict(state.links) | {name: f"left out: {why}" for name, why in state.skipped.items()}
