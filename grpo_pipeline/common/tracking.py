"""One interface over the experiment trackers a run logs to: MLflow, Weights & Biases, TensorBoard.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow,tensorboard]'
    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db        # then: the run, its metrics, its report

A tracker run is the whole pipeline run. `start_tracking` opens it once the run is planned (or finds it
again: its ids are kept in the run folder's `tracking.json`, so a retried or resumed run continues the
same tracker run), a `TrackingSession` logs to it, and `job_env` gives the variables verl's own loggers
read to continue it from a cluster job. A training step is logged once: `tracking.json` remembers the
last one, and a resumed attempt's steps up to it are skipped (they were logged by the attempt before).
"""

from __future__ import annotations

import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.common.files import write_json_atomic
from grpo_pipeline.common.errors import UserError
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.profiles.tracking import TrackingSection

STATE_FILE = "tracking.json"
# MLflow caps a parameter's value (6,000 characters since 2.x) and a batch (100 parameters).
_PARAM_CHARS, _BATCH = 6000, 100


class TrackingState(BaseModel):
    """`runs/<run>/tracking.json`: the tracker runs of this pipeline run, and how far they got."""

    runs: dict[str, dict[str, str]] = Field(default_factory=dict, description="Per tracker: its run's ids and where it is.")
    links: dict[str, str] = Field(default_factory=dict, description="Per tracker: where a person looks at the run.")
    skipped: dict[str, str] = Field(default_factory=dict, description="Trackers left out at the start (warn): why.")
    last_step: int = Field(0, description="The last training step logged by the flow; a resumed attempt's earlier steps are skipped.")
    evaluated_at: list[int] = Field(default_factory=list, description="Training steps whose evaluation was logged.")


def read_state(run_dir: Path) -> TrackingState | None:
    try:
        return TrackingState.model_validate_json((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_state(run_dir: Path, state: TrackingState) -> None:
    write_json_atomic(Path(run_dir) / STATE_FILE, state.model_dump(mode="json"))


class Tracker(ABC):
    """One tool's run: opened (created or found again by its ids), logged to, closed."""

    name: str

    def __init__(self, settings: TrackingSection, run_dir: Path):
        self.settings, self.run_dir = settings, Path(run_dir)

    @abstractmethod
    def open(self, ids: dict[str, str] | None, run_name: str) -> dict[str, str]:
        """Create the run (ids None) or continue it; the ids to find it again. Raises when unreachable."""

    @abstractmethod
    def link(self) -> str:
        """Where a person looks at the run (a URL, or a folder and the command that shows it)."""

    @abstractmethod
    def log_params(self, params: dict[str, str], tags: dict[str, str]) -> None: ...

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    @abstractmethod
    def log_file(self, path: Path) -> None: ...

    def close(self, finished: bool | None = None) -> None:
        """End this session's hold on the run; `finished` True/False also ends the run itself (done / failed)."""

    def job_env(self, ids: dict[str, str]) -> dict[str, str]:
        """What verl's logger for this tool reads (verl/utils/tracking.py, verl 0.9.1) to continue the run."""
        return {}


class MlflowTracker(Tracker):
    """Through `MlflowClient` and the run's id only (no active-run state), so the flow's threads and a
    cluster job (verl attaches with MLFLOW_RUN_ID) can all log to the one run."""

    name = "mlflow"

    def __init__(self, settings: TrackingSection, run_dir: Path):
        super().__init__(settings, run_dir)
        self.uri = tracking_uri(settings, run_dir)

    def open(self, ids, run_name):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.uri)
        if ids:
            self.run_id, self.experiment_id = ids["run_id"], ids["experiment_id"]
            with _answer_soon():
                self.client.update_run(self.run_id, status="RUNNING")
        else:
            with _answer_soon():  # a server that is not there fails in seconds, not after MLflow's retries
                experiment = self.client.get_experiment_by_name(self.settings.mlflow.experiment)
            self.experiment_id = (experiment.experiment_id if experiment
                                  else self.client.create_experiment(self.settings.mlflow.experiment))
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.uri}

    def link(self):
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"run {self.run_id} of `mlflow ui --backend-store-uri {self.uri}`"

    def log_params(self, params, tags):
        from mlflow.entities import Param, RunTag

        items = [Param(k, v[:_PARAM_CHARS]) for k, v in params.items()]
        for start in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + _BATCH])
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_metrics(self, metrics, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_file(self, path):
        self.client.log_artifact(self.run_id, str(path))

    def close(self, finished=None):
        if finished is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")

    def job_env(self, ids):
        return {"MLFLOW_TRACKING_URI": ids["tracking_uri"], "MLFLOW_RUN_ID": ids["run_id"]}


class WandbTracker(Tracker):
    """`wandb.init(id=..., resume="allow")`: each session attaches to the run by its id (offline: a folder
    per session under the run folder's `wandb/`, which `wandb sync` joins into the one run)."""

    name = "wandb"

    def open(self, ids, run_name):
        import wandb

        w = self.settings.wandb
        if w.mode == "online" and not os.environ.get("WANDB_API_KEY") and not _netrc_has_wandb():
            raise RuntimeError("no WANDB_API_KEY in the flow's environment (and no `wandb login`)")
        self.run = wandb.init(
            project=w.project, entity=w.entity, id=(ids or {}).get("run_id"), name=run_name, resume="allow",
            mode=w.mode, dir=str(self.run_dir), reinit="create_new",
            settings=wandb.Settings(init_timeout=60, silent=True, console="off", x_disable_stats=True))
        return {"run_id": self.run.id, "project": w.project, "entity": w.entity or "", "mode": w.mode,
                "dir": str(self.run_dir)}

    def link(self):
        if self.settings.wandb.mode == "online":
            return self.run.url or ""
        return f"offline run {self.run.id} in {self.run_dir / 'wandb'} (`wandb sync {self.run_dir / 'wandb'}/offline-run-*`)"

    def log_params(self, params, tags):
        self.run.config.update({**params, **{f"tags/{k}": v for k, v in tags.items()}}, allow_val_change=True)
        # W&B's tags are short labels (64 characters at most).
        self.run.tags = tuple(sorted({*self.run.tags, *(f"{k}:{v}"[:64] for k, v in tags.items() if "url" not in k)}))

    def log_metrics(self, metrics, step):
        self.run.log(dict(metrics), step=step)

    def log_file(self, path):
        self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def close(self, finished=None):
        self.run.finish(exit_code=0 if finished in (None, True) else 1)

    def job_env(self, ids):
        env = {"WANDB_RUN_ID": ids["run_id"], "WANDB_RESUME": "allow", "WANDB_MODE": ids["mode"],
               "WANDB_DIR": ids["dir"]}
        return env | ({"WANDB_ENTITY": ids["entity"]} if ids.get("entity") else {})


class TensorboardTracker(Tracker):
    """Event files through torch's `SummaryWriter`, the writer verl's TensorBoard logger uses; a session
    adds a file, and TensorBoard's reader shows the folder as one run."""

    name = "tensorboard"

    def open(self, ids, run_name):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(ids["log_dir"]) if ids else tensorboard_dir(self.settings, self.run_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.log_dir))
        return {"log_dir": str(self.log_dir)}

    def link(self):
        return f"`tensorboard --logdir {self.log_dir}`"

    def log_params(self, params, tags):
        # TensorBoard has no parameters: the profile and the tags are text, shown in its TEXT tab.
        self.writer.add_text("tags", "\n".join(f"- {k}: {v}" for k, v in tags.items()))
        if params:
            self.writer.add_text("profile", "\n".join(f"    {k}: {v}" for k, v in params.items()))

    def log_metrics(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def log_file(self, path):
        path = Path(path)
        if path.suffix in (".md", ".txt"):
            self.writer.add_text(path.stem, path.read_text())
        (self.log_dir / "files").mkdir(exist_ok=True)
        shutil.copy2(path, self.log_dir / "files" / path.name)

    def close(self, finished=None):
        self.writer.close()

    def job_env(self, ids):
        return {"TENSORBOARD_DIR": ids["log_dir"]}


TRACKER_CLASSES: dict[str, type[Tracker]] = {t.name: t for t in (MlflowTracker, WandbTracker, TensorboardTracker)}
DESCRIBED = {"mlflow": "MLflow", "wandb": "Weights & Biases", "tensorboard": "TensorBoard"}


def tracking_uri(settings: TrackingSection, run_dir: Path) -> str:
    """The profile's URI, else MLflow's own variable, else a SQLite store beside the run folders."""
    return (settings.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(Path(run_dir).resolve().parent / 'mlflow.db')}")


def tensorboard_dir(settings: TrackingSection, run_dir: Path) -> Path:
    return Path(settings.tensorboard.log_dir).expanduser().resolve() if settings.tensorboard.log_dir else (
        Path(run_dir).resolve() / "tensorboard")


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
        tracker = TRACKER_CLASSES[name](settings, run_dir)
        try:
            state.runs[name] = tracker.open(state.runs.get(name), run_name)
            state.links[name] = tracker.link()
            tracker.log_params(params, tags)
            tracker.close()
        except Exception as exc:  # each tool raises its own types (connection, auth, timeouts)
            problem = f"{DESCRIBED[name]} ({where(settings, run_dir, name)}) cannot be reached: {_one_line(exc)}"
            if settings.on_unreachable == "fail":
                raise UserError(f"tracking: {problem}; start it or fix tracking.{name}, drop it from tracking.trackers, "
                                "or set tracking.on_unreachable=warn to run without it") from None
            warn(f"tracking: {problem}; the run goes on without {DESCRIBED[name]} (tracking.on_unreachable=warn)")
            state.skipped[name] = problem
    write_state(run_dir, state)
    return state


def where(settings: TrackingSection, run_dir: Path, name: str) -> str:
    if name == "mlflow":
        return scrub(tracking_uri(settings, run_dir))
    if name == "wandb":
        return f"project {settings.wandb.project}, {settings.wandb.mode}"
    return str(tensorboard_dir(settings, run_dir))


class TrackingSession:
    """The run's trackers, open for a stretch of the flow (training's steps, the evaluation and report)."""

    def __init__(self, settings: TrackingSection, run_dir: Path, state: TrackingState, run_name: str):
        self.run_dir, self.state, self.trackers = Path(run_dir), state, []
        for name, ids in state.runs.items():
            tracker = TRACKER_CLASSES[name](settings, run_dir)
            tracker.open(ids, run_name)
            self.trackers.append(tracker)

    def log_step(self, step: int, metrics: dict[str, float]) -> bool:
        """Log a training step once: False for a step an earlier attempt already logged."""
        if step <= self.state.last_step:
            return False
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)
        self.state.last_step = step
        write_state(self.run_dir, self.state)
        return True

    def log_evaluation(self, step: int, metrics: dict[str, float]) -> bool:
        """The evaluation of the policy at training step `step`, once."""
        if step in self.state.evaluated_at:
            return False
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)
        self.state.evaluated_at.append(step)
        write_state(self.run_dir, self.state)
        return True

    def log_tags(self, tags: dict[str, str]) -> None:
        for tracker in self.trackers:
            tracker.log_params({}, tags)

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            if Path(path).is_file():
                for tracker in self.trackers:
                    tracker.log_file(Path(path))

    def close(self, finished: bool | None = None) -> None:
        for tracker in self.trackers:
            tracker.close(finished)


@contextmanager
def tracking_session(settings: TrackingSection, run_dir: Path, run_name: str) -> Iterator[TrackingSession | None]:
    """The run's trackers for a stretch of work; None when the run has none (or none was reachable)."""
    state = read_state(run_dir)
    if not settings.trackers or state is None or not state.runs:
        yield None
        return
    session = TrackingSession(settings, run_dir, state, run_name)
    try:
        yield session
    finally:
        session.close()


def job_env(settings: TrackingSection, run_dir: Path) -> dict[str, str]:
    """The variables verl's loggers read to log to this run's tracker runs from a cluster job."""
    state = read_state(run_dir)
    if state is None:
        return {}
    env: dict[str, str] = {}
    for name, ids in state.runs.items():
        env |= TRACKER_CLASSES[name](settings, run_dir).job_env(ids)
    return env


@contextmanager
def _answer_soon() -> Iterator[None]:
    """MLflow retries a request for minutes by default; reaching the server at the start is a yes/no."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="15")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _one_line(exc: Exception) -> str:
    text = scrub(str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
