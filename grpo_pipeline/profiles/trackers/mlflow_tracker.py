"""MLflow as a run's tracker: its settings, its store (checked at planning), its run through `MlflowClient`."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import Field

from grpo_pipeline.profiles.section import Section
from grpo_pipeline.profiles.trackers.base import STEP_TIMEOUT_S, Tracker

# A URI's `user:password@` (%-escaped `@` too). Not profiles/secrets.py's pattern: that module reads the
# schema, which this module is part of.
_CREDENTIALS = re.compile(r"://[^/@\s]+(?:@|%40)")


def without_credentials(uri: str) -> str:
    """The URI as a person may see it and a file may keep it: no `user:password@`."""
    return _CREDENTIALS.sub("://", uri)


class MlflowSettings(Section):
    tracking_uri: str | None = Field(
        None, description="The MLflow tracking server (`http://host:5000`) or store (`sqlite:///path/mlflow.db`); "
        "empty: the MLFLOW_TRACKING_URI variable of the flow's environment, else `sqlite:///<run root>/mlflow.db`.")
    experiment: str = Field("grpo-pipeline", min_length=1, description="MLflow experiment the run is logged under.")


class MlflowTracker(Tracker):
    """Through `MlflowClient` and the run's id only (no active-run state), so the flow's threads and a
    cluster job (verl attaches with MLFLOW_RUN_ID) can all log to the one run."""

    name = verl_logger = "mlflow"
    label, settings_class = "MLflow", MlflowSettings
    package, also_named, imports = "mlflow", ("mlflow-skinny",), ("mlflow",)
    local_ui = "http://127.0.0.1:5000"  # where `mlflow ui` serves a store by default
    artifacts = "mlflow-artifacts"  # beside a SQLite store: the default store's, under the runs folder
    # MLflow caps a parameter's value (6,000 characters since 2.x) and a batch (100 parameters).
    param_chars, batch = 6000, 100

    def __init__(self, settings: MlflowSettings, run_dir: Path):
        super().__init__(settings, run_dir)
        # The profile's URI, else MLflow's own variable, else a SQLite store beside the run folders.
        self.uri = (settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                    or f"sqlite:///{(self.run_dir.resolve().parent / 'mlflow.db')}")
        # MLflow prints "View run ... at: <the URI>" when a run ends: with the URI's credentials, if it has any.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

    def where(self):
        return without_credentials(self.uri)

    def open(self, ids, run_name):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.uri)
        if ids:
            self.run_id, self.experiment_id = ids["run_id"], ids["experiment_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(self.settings.experiment)
            self.experiment_id = (experiment.experiment_id if experiment else self.client.create_experiment(
                self.settings.experiment, artifact_location=self.artifacts_beside(self.uri)))
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.where()}

    def link(self):
        uri = self.where()
        if uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return (f"{self.local_ui}/#/experiments/{self.experiment_id}/runs/{self.run_id} (once "
                f"`.venv/bin/mlflow ui --backend-store-uri {uri}` serves it)")

    def log_params(self, params, tags):
        from mlflow.entities import Param, RunTag

        items = [Param(k, v[:self.param_chars]) for k, v in params.items()]
        for start in range(0, len(items), self.batch):
            self.client.log_batch(self.run_id, params=items[start:start + self.batch])
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
        return _mlflow_answers_soon(timeout_s)

    def job_env(self, ids):
        # Without its credentials: a node's MLflow reads them from its own environment (MLFLOW_TRACKING_USERNAME
        # and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, exported before `ray start` there), as every
        # secret a job needs is read; a runtime_env is kept in Ray's GCS, its logs and its dashboard.
        return {"MLFLOW_TRACKING_URI": without_credentials(ids["tracking_uri"]), "MLFLOW_RUN_ID": ids["run_id"]}

    @classmethod
    def artifacts_beside(cls, uri: str) -> str | None:
        """Where a new experiment of a SQLite store keeps its artifacts: `mlflow-artifacts/` beside the
        database (for the default store, in the runs folder). MLflow's own default is `./mlruns` of the
        working directory, recorded in the experiment, so every later run from anywhere wrote there.
        None for a server, which has its own artifact store."""
        path = _sqlite_path(uri)
        return (path.parent / cls.artifacts).as_uri() if path is not None else None

    @classmethod
    def store_problem(cls, settings, write):
        """MLflow's store named by the profile or MLFLOW_TRACKING_URI: a SQLite file MLflow could not create
        or open would otherwise take MLflow's retries (minutes, a warning each) before its error. `write`: a
        run's check, which creates and removes a file in its folder (a dry run looks only). None when it is
        fine, the default store (the run makes its folder) or a server (reached when the run starts)."""
        named, origin = ((settings.tracking_uri, "tracking.mlflow.tracking_uri") if settings.tracking_uri
                         else (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"))
        path = _sqlite_path(named) if named else None
        if path is None:
            return None
        fix = (f"{origin}: MLflow's store {without_credentials(named)} cannot be {{}}; point it at a SQLite file "
               "in a folder you can write (sqlite:////path/to/mlflow.db), or leave it empty for <runs folder>/mlflow.db")
        if _exists(path):
            if not path.is_file():
                return fix.format("used (it is not a regular file)")
            if not os.access(path, os.R_OK | os.W_OK):
                return fix.format("used (it is not readable and writable by you)")
            with open(path, "rb") as handle:
                head = handle.read(16)
            return None if head in (b"", b"SQLite format 3\0") else fix.format("used (it is not a SQLite database)")
        folder = next(p for p in path.parents if _exists(p))  # MLflow makes the folders below it
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            return fix.format(f"created ({folder} is not a folder you can write)")
        if write:
            try:
                made, name = tempfile.mkstemp(dir=folder, prefix=".mlflow-check-")
                os.close(made)
                os.unlink(name)
            except OSError as exc:
                return fix.format(f"created ({folder}: {exc.strerror or exc})")
        return None


@contextmanager
def _mlflow_answers_soon(timeout_s: float) -> Iterator[None]:
    """MLflow retries a request for minutes by default (7 retries, 120 s each): reaching the server at
    the start is a yes/no, and a step is never held up by a server that went away (its steps wait in
    metrics.jsonl: tracking/session.py)."""
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


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):]).expanduser().resolve()


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False
