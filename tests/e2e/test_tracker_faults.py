"""Trackers that fail or are interrupted (issue 44), against a real `mlflow server` on 127.0.0.1 (its
SQLite store and artifacts under the test's folder), stopped, replaced by a server that takes
connections and never answers, and started again on the same port with the same store.

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_tracker_faults.py

The flow's side is what the train and report stages run (tasks/tracking.py: `StepTracking`,
`close_tracker_runs`), with metrics.jsonl written before each step as the training side writes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import pytest
from mlflow.tracking import MlflowClient

from grpo_pipeline.backends.metrics import StepMetrics, append_metrics
from grpo_pipeline.tracking import session as tracker_session
from grpo_pipeline.tracking.trackers import FAILED, FINISHED, read_state, write_state
from grpo_pipeline.profiles.loader import resolve_profile
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.tasks.tracking import StepTracking, close_tracker_runs, open_tracker_run
from grpo_pipeline.run.folder import RunFolder
from mlflow_server import free_port, mlflow_server, silent_server
from tracker_readers import tensorboard_scalars

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DEVICE = DeviceInfo(kind="cpu", count=2, decided_by="requested", reason="test")


def _record(step: int) -> StepMetrics:
    return StepMetrics(step=step, reward_mean=step / 10, reward_std=0.01, loss=1.0 / step, step_time_s=0.5, time=time.time())


def _train(steps: StepTracking, run_dir: Path, numbers) -> None:
    """Steps as the training side and the flow see them: the record in metrics.jsonl, then the flow's step."""
    for step in numbers:
        append_metrics(run_dir / RunFolder.METRICS, _record(step))
        steps.step(_record(step))


def _history(url: str, run_id: str) -> list[int]:
    return [m.step for m in MlflowClient(url).get_metric_history(run_id, "train/reward_mean")]


def _tracked_run(tmp_path: Path):
    """A port for the MLflow server (started, stopped and restarted on it), its folder, its URL, a profile
    that logs to it and to TensorBoard, and the run's folder."""
    port, store = free_port(), tmp_path / "server"
    store.mkdir()
    url = f"http://127.0.0.1:{port}"
    profile = resolve_profile("tiny", "cpu", overrides=["tracking.trackers=[mlflow,tensorboard]",
                                                        f"tracking.mlflow.tracking_uri={url}"])
    (run_dir := tmp_path / "run").mkdir()
    return port, store, url, profile, run_dir


def test_mlflow_going_away_costs_one_bounded_attempt_per_wait_and_its_steps_are_sent_when_it_answers(tmp_path,
                                                                                                      monkeypatch):
    port, store, url, profile, run_dir = _tracked_run(tmp_path)
    warned: list[str] = []
    with mlflow_server(store, port):
        state = open_tracker_run(profile, DEVICE, {}, run_dir, uuid4(), warn=pytest.fail)
        run_id = state.runs["mlflow"]["run_id"]
        steps = StepTracking(profile, run_dir, logs_itself=False, warn=warned.append)
        _train(steps, run_dir, (1, 2))
    # The server is gone, and its port now takes connections and never answers: MLflow's client
    # retried each request 7 times for up to 120 s each (a step took minutes, the run 672 s for 109).
    with silent_server(port) as taken:
        _train(steps, run_dir, (3, 4, 5, 6))
        assert len(taken) <= 1, "a tracker that did not answer was asked again before its wait was over"
        assert len(warned) == 1 and warned[0].startswith("tracking: MLflow did not answer (") and "\n" not in warned[0]
        assert read_state(run_dir).logged_to == {"mlflow": 2, "tensorboard": 6}  # TensorBoard is not held up
    monkeypatch.setattr(tracker_session, "RETRY_S", 0.0)  # its wait is over
    with mlflow_server(store, port):
        _train(steps, run_dir, (7,))  # the steps it missed go first, in order
        assert _history(url, run_id) == [1, 2, 3, 4, 5, 6, 7]
        assert warned[-1] == "tracking: MLflow answers again; it has every step up to 7"
    # Away again at the end: what it lacks then is named by the report, and a later run fills it.
    _train(steps, run_dir, (8, 9))
    steps.close()
    result = {"tracking": {"mlflow": "x"}, "train": {"steps_done": 9}}
    report = close_tracker_runs(profile, run_dir, result, FAILED, lambda: dict(result["tracking"]))
    assert report["mlflow missed"] == "training steps 8-9 (it did not answer; they are in metrics.jsonl)"
    assert read_state(run_dir).missed == {"mlflow": [8, 9]}
    with mlflow_server(store, port):
        StepTracking(profile, run_dir, logs_itself=False, warn=warned.append).close()  # a rerun's train stage
        assert _history(url, run_id) == list(range(1, 10))
    assert [step for step, _ in tensorboard_scalars(run_dir / "tensorboard")["train/reward_mean"]] == list(range(1, 10))


def test_a_rerun_after_kill_9_fills_every_tracker_up_to_the_last_step_once(tmp_path):
    """The flow was killed at step 6 with the trackers at step 4; the Ray workers it left trained on to
    step 12 (metrics.jsonl and the checkpoint), so the rerun resumed at 12 of 12 and trained nothing:
    MLflow and TensorBoard kept steps 1-4 for good."""
    port, store, url, profile, run_dir = _tracked_run(tmp_path)
    with mlflow_server(store, port):
        state = open_tracker_run(profile, DEVICE, {}, run_dir, uuid4(), warn=pytest.fail)
        killed = StepTracking(profile, run_dir, logs_itself=False, warn=pytest.fail)
        _train(killed, run_dir, (1, 2, 3, 4))
        for step in range(5, 13):  # trained and recorded, never logged by the killed flow
            append_metrics(run_dir / RunFolder.METRICS, _record(step))
        # The rerun: its tracker runs are found again, its train stage resumes at 12 of 12.
        again = open_tracker_run(profile, DEVICE, {}, run_dir, uuid4(), warn=pytest.fail)
        assert again.runs == state.runs
        StepTracking(profile, run_dir, logs_itself=False, warn=pytest.fail).close()
        result = {"tracking": {"mlflow": "x"}, "train": {"steps_done": 12}}
        close_tracker_runs(profile, run_dir, result, FINISHED, lambda: None)
        close_tracker_runs(profile, run_dir, result, FINISHED, lambda: None)  # a second end sends nothing again
        assert _history(url, state.runs["mlflow"]["run_id"]) == list(range(1, 13))
        assert MlflowClient(url).get_run(state.runs["mlflow"]["run_id"]).info.status == "FINISHED"
    scalars = tensorboard_scalars(run_dir / "tensorboard")["train/reward_mean"]
    assert [step for step, _ in scalars] == list(range(1, 13))
    assert read_state(run_dir).logged_to == {"mlflow": 12, "tensorboard": 12} and read_state(run_dir).missed == {}


def test_a_tracking_json_of_an_earlier_version_continues_from_its_last_step(tmp_path):
    profile = resolve_profile("tiny", "cpu", overrides=["tracking.trackers=[tensorboard]"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    open_tracker_run(profile, DEVICE, {}, run_dir, uuid4(), warn=pytest.fail)
    state = read_state(run_dir)
    write_state(run_dir, state.model_copy(update={"logged_to": {}, "last_step": 3}))
    steps = StepTracking(profile, run_dir, logs_itself=False, warn=pytest.fail)
    _train(steps, run_dir, (4,))
    steps.close()
    assert [step for step, _ in tensorboard_scalars(run_dir / "tensorboard")["train/reward_mean"]] == [4]


def _cli(*args: str, tmp_path: Path, cwd: Path = ROOT, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"), **env}
    environ.pop("PREFECT_API_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}", *args],
        cwd=cwd, env={**environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)


def test_every_way_a_run_ends_closes_its_tracker_runs_and_the_default_stores_artifacts_stay_in_the_runs_folder(
        tmp_path):
    """Planning alone (no report stage) left its MLflow run RUNNING forever; a failed run ends FAILED.
    The default store is SQLite in the runs folder, and its artifacts go beside it, not into the
    working directory's `./mlruns` (which MLflow records in the experiment for every later run)."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    tracked = ["--set", "tracking.trackers=[mlflow]"]
    planned = _cli("--run-name", "planned", "--stages", "prepare_environment", *tracked, tmp_path=tmp_path, cwd=elsewhere)
    assert planned.returncode == 0, planned.stderr[-3000:]
    failed = _cli("--run-name", "failed", "--stages", "train", "--set", "trainer.total_training_steps=2",
                  "--set", "trainer.step_timeout_s=1", *tracked, tmp_path=tmp_path, cwd=elsewhere)
    assert failed.returncode != 0
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = MlflowClient(store)
    statuses = {name: client.get_run(read_state(tmp_path / "runs" / name).runs["mlflow"]["run_id"]).info.status
                for name in ("planned", "failed")}
    assert statuses == {"planned": "FINISHED", "failed": "FAILED"}
    assert read_state(tmp_path / "runs" / "failed").ended == "FAILED"
    experiment = client.get_experiment_by_name("grpo-pipeline")
    assert experiment.artifact_location == (tmp_path / "runs" / "mlflow-artifacts").as_uri()
    assert list((tmp_path / "runs" / "mlflow-artifacts").rglob("report.md"))  # the failed run's report
    assert not (elsewhere / "mlruns").exists()


def test_a_store_that_cannot_be_made_is_refused_at_planning_in_one_line(tmp_path):
    """`sqlite:////proc/mlflow.db` took 145 s and 51 warning lines of MLflow's retries before its error."""
    for uri, dry in (("sqlite:////proc/mlflow.db", False), (f"sqlite:///{ROOT / 'README.md'}/mlflow.db", True),
                     (f"sqlite:///{ROOT / 'README.md'}", True)):
        done = _cli("--run-name", "store", "--stages", "prepare_environment", *(["--dry-run"] if dry else []),
                    "--set", "tracking.trackers=[mlflow]", "--set", f"tracking.mlflow.tracking_uri={uri}",
                    tmp_path=tmp_path)
        assert done.returncode == 2, (uri, done.stderr[-2000:])
        assert done.stderr.startswith(f"error: tracking.mlflow.tracking_uri: MLflow's store {uri} cannot be ")
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr
    assert not (tmp_path / "prefect").exists()  # refused before anything started
    answer = json.loads(_cli("--dry-run", "--json", "--set", "tracking.trackers=[mlflow]", "--set",
                             f"tracking.mlflow.tracking_uri=sqlite:///{tmp_path / 'new' / 'mlflow.db'}",
                             tmp_path=tmp_path).stdout)
    assert answer["profile"]["tracking"]["trackers"] == ["mlflow"]  # a folder MLflow can make is fine
