"""Where a run's trackers keep it: MLflow's tracking URI (and that URI as a person may see it), the
artifacts beside a SQLite store, TensorBoard's folder, and MLflow's store checked at planning.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow]' \
        --set tracking.mlflow.tracking_uri=sqlite:////proc/mlflow.db --dry-run     # refused in one line, exit 2
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from grpo_pipeline.profiles.tracking import TrackingSection
from grpo_pipeline.run.folder import RunFolder

MLFLOW_ARTIFACTS = "mlflow-artifacts"  # beside a SQLite store: the default store's, under the runs folder
_CREDENTIALS = re.compile(r"://[^/@\s]+(?:@|%40)")


def tracking_uri(settings: TrackingSection, run_dir: Path) -> str:
    """The profile's URI, else MLflow's own variable, else a SQLite store beside the run folders."""
    return (settings.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(Path(run_dir).resolve().parent / 'mlflow.db')}")


def without_credentials(uri: str) -> str:
    """The URI as a person may see it and a file may keep it: no `user:password@` (%-escaped `@` too)."""
    return _CREDENTIALS.sub("://", uri)


def artifacts_beside(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: `mlflow-artifacts/` beside the
    database (for the default store, in the runs folder). MLflow's own default is `./mlruns` of the
    working directory, recorded in the experiment, so every later run from anywhere wrote there.
    None for a server, which has its own artifact store."""
    path = _sqlite_path(uri)
    return (path.parent / MLFLOW_ARTIFACTS).as_uri() if path is not None else None


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):]).expanduser().resolve()


def store_problem(settings: TrackingSection, write: bool) -> str | None:
    """MLflow's store named by the profile or MLFLOW_TRACKING_URI, checked at planning: a SQLite file
    MLflow could not create or open would otherwise take MLflow's retries (minutes, a warning each)
    before its error. `write`: a run's check, which creates and removes a file in its folder (a dry
    run looks only). None when it is fine, the default store (the run makes its folder) or a server
    (reached when the run starts)."""
    if "mlflow" not in settings.trackers:
        return None
    named, origin = ((settings.mlflow.tracking_uri, "tracking.mlflow.tracking_uri") if settings.mlflow.tracking_uri
                     else (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"))
    path = _sqlite_path(named) if named else None
    if path is None:
        return None
    fix = (f"{origin}: MLflow's store {without_credentials(named)} cannot be {{}}; point it at a SQLite file in a folder "
           "you can write (sqlite:////path/to/mlflow.db), or leave it empty for <runs folder>/mlflow.db")
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


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False


def tensorboard_dir(settings: TrackingSection, run_dir: Path) -> Path:
    return Path(settings.tensorboard.log_dir).expanduser().resolve() if settings.tensorboard.log_dir else (
        Path(run_dir).resolve() / RunFolder.TENSORBOARD)
