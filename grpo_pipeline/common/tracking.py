"""One interface over the experiment trackers a run logs to: MLflow, Weights & Biases, TensorBoard.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow,tensorboard]'
    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db        # then: the run, its metrics, its report

A tracker run is the whole pipeline run. `start_tracking` opens it once the run is planned (or finds it
again: its ids are kept in the run folder's `tracking.json`, so a retried or resumed run continues the
same tracker run), a `TrackingSession` (common/tracker_session.py) logs to it, and `job_env` gives the
variables verl's own loggers read to continue it from a cluster job. A tracking URI's credentials
(`http://user:pass@host`, as MLflow documents) reach MLflow's client in this process only: ids, links
and the job's variables keep the URI without them.
"""

from __future__ import annotations

import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.common.errors import UserError
from grpo_pipeline.common.files import write_json_atomic
from grpo_pipeline.common.tracker_stores import artifacts_beside, tensorboard_dir, tracking_uri, without_credentials
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.profiles.tracking import TrackingSection
from grpo_pipeline.run.folder import RunFolder

# Where each tool's own local UI serves a store or folder by default (`mlflow ui`, `tensorboard`).
LOCAL_UI = {"mlflow": "http://127.0.0.1:5000", "tensorboard": "http://localhost:6006"}
# MLflow caps a parameter's value (6,000 characters since 2.x) and a batch (100 parameters).
_PARAM_CHARS, _BATCH = 6000, 100
# How long one request to MLflow may take: opening the run (a yes/no at the start), a step while training.
OPEN_TIMEOUT_S, STEP_TIMEOUT_S = 15, 5
# The status a tracker run ends with, by how the pipeline run ended (MLflow's RunStatus names).
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


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

    def close(self, status: str | None = None) -> None:
        """End this session's hold on the run; a `status` (FINISHED, FAILED, KILLED) also ends the run itself."""

    def bounded(self, timeout_s: float = STEP_TIMEOUT_S):
        """A context in which each request to the tool gives up after `timeout_s`, without retries."""
        return nullcontext()

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
        # MLflow prints "View run ... at: <the URI>" when a run ends: with the URI's credentials, if it has any.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

    def open(self, ids, run_name):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.uri)
        if ids:
            self.run_id, self.experiment_id = ids["run_id"], ids["experiment_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(self.settings.mlflow.experiment)
            self.experiment_id = (experiment.experiment_id if experiment else self.client.create_experiment(
                self.settings.mlflow.experiment, artifact_location=artifacts_beside(self.uri)))
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": without_credentials(self.uri)}

    def link(self):
        uri = without_credentials(self.uri)
        if uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return (f"{LOCAL_UI['mlflow']}/#/experiments/{self.experiment_id}/runs/{self.run_id} (once "
                f"`.venv/bin/mlflow ui --backend-store-uri {uri}` serves it)")

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

    def close(self, status=None):
        if status is not None:
            self.client.set_terminated(self.run_id, status)

    def bounded(self, timeout_s=STEP_TIMEOUT_S):
        return _answer_soon(timeout_s)

    def job_env(self, ids):
        # Without its credentials: a node's MLflow reads them from its own environment (MLFLOW_TRACKING_USERNAME
        # and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, exported before `ray start` there), as every
        # secret a job needs is read; a runtime_env is kept in Ray's GCS, its logs and its dashboard.
        return {"MLFLOW_TRACKING_URI": without_credentials(ids["tracking_uri"]), "MLFLOW_RUN_ID": ids["run_id"]}


class WandbTracker(Tracker):
    """`wandb.init(id=..., resume="allow")`: each session attaches to the run by its id (offline: a folder
    per session under the run folder's `wandb/`, which `wandb sync` joins into the one run)."""

    name = "wandb"

    def open(self, ids, run_name):
        import wandb

        w = self.settings.wandb
        if missing := missing_credentials(self.settings):
            raise RuntimeError(missing)
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

    def close(self, status=None):
        self.run.finish(exit_code=0 if status in (None, FINISHED) else 1)

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
        return f"{LOCAL_UI['tensorboard']} (once `.venv/bin/tensorboard --logdir {self.log_dir}` serves it)"

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

    def close(self, status=None):
        self.writer.close()

    def job_env(self, ids):
        return {"TENSORBOARD_DIR": ids["log_dir"]}


TRACKER_CLASSES: dict[str, type[Tracker]] = {t.name: t for t in (MlflowTracker, WandbTracker, TensorboardTracker)}
DESCRIBED = {"mlflow": "MLflow", "wandb": "Weights & Biases", "tensorboard": "TensorBoard"}


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
            with tracker.bounded(OPEN_TIMEOUT_S):  # a server that is not there fails in seconds, not after its retries
                if name not in state.runs:
                    state.logged_to[name] = 0  # a new tracker run gets every step of metrics.jsonl
                state.runs[name] = tracker.open(state.runs.get(name), run_name)
                state.links[name] = tracker.link()
                tracker.log_params(params, tags)
                tracker.close()
        except Exception as exc:  # each tool raises its own types (connection, auth, timeouts)
            problem = f"{DESCRIBED[name]} ({where(settings, run_dir, name)}) cannot be reached: {one_line(exc)}"
            if settings.on_unreachable == "fail":
                raise UserError(f"tracking: {problem}; start it or fix tracking.{name}, drop it from tracking.trackers, "
                                "or set tracking.on_unreachable=warn to run without it") from None
            warn(f"tracking: {problem}; the run goes on without {DESCRIBED[name]} (tracking.on_unreachable=warn)")
            state.skipped[name] = problem
    write_state(run_dir, state)
    return state


def where(settings: TrackingSection, run_dir: Path, name: str) -> str:
    if name == "mlflow":
        return without_credentials(tracking_uri(settings, run_dir))
    if name == "wandb":
        return f"project {settings.wandb.project}, {settings.wandb.mode}"
    return str(tensorboard_dir(settings, run_dir))


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
def _answer_soon(timeout_s: float) -> Iterator[None]:
    """MLflow retries a request for minutes by default (7 retries, 120 s each): reaching the server at
    the start is a yes/no, and a step is never held up by a server that went away (its steps wait in
    metrics.jsonl: common/tracker_session.py)."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(int(timeout_s)))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def missing_credentials(settings: TrackingSection, environ: Mapping[str, str] | None = None) -> str | None:
    """A tracker the run cannot log to without credentials this environment lacks (W&B online without a
    key), known before anything starts: the problem and its fix, or None."""
    environ = os.environ if environ is None else environ
    w = settings.wandb
    if "wandb" in settings.trackers and w.mode == "online" and not environ.get("WANDB_API_KEY") and not _netrc_has_wandb():
        return ("tracking: W&B (online) needs WANDB_API_KEY, which is not set here (nor `wandb login`); export it, "
                "or --set tracking.wandb.mode=offline")
    return None


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def one_line(exc: Exception) -> str:
    """An exception in one line, scrubbed of secrets: a warning's or a refusal's words."""
    text = scrub(str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
