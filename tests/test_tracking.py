"""Experiment tracking against the real tools: an MLflow server over HTTP (SQLite backend) read back
through MLflow's client, W&B offline read back from its files, TensorBoard read back with its reader.

    PYTHONPATH=$PWD python -m pytest -q tests/test_tracking.py

The flow's own calls (tasks/tracking.py) open the tracker run, log training's steps through a retry
that resumes from a checkpoint, the evaluation and the report; verl's tracking layer continues the
same tracker runs from the variables the verl backend renders for its job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from grpo_pipeline.backends.base import TrainingInputs
from grpo_pipeline.backends.metrics import StepMetrics
from grpo_pipeline.backends.verl.command import verl_command
from grpo_pipeline.backends.verl.job import job_spec
from grpo_pipeline.backends.verl.rewards import reward_modules
from grpo_pipeline.tracking.session import tracking_session
from grpo_pipeline.tracking.trackers import FINISHED, read_state
from grpo_pipeline.tasks.tracking import StepTracking, close_tracker_runs, open_tracker_run, tracking_lines
from mlflow_server import free_port, mlflow_server
from grpo_pipeline.errors import UserError
from grpo_pipeline.data.rl_data import arith_splits
from grpo_pipeline.profiles.loader import resolve_profile
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.stages.environment import resolve_environment
from grpo_pipeline.run.folder import RunFolder
from tracker_readers import tensorboard_scalars, tensorboard_texts, wandb_offline_run

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hf_tracking_secret_value_123"
ALL = ["tracking.trackers=[mlflow,wandb,tensorboard]", "tracking.wandb.mode=offline",
       "env.HF_TOKEN=${HF_TOKEN}"]


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture(autouse=True)
def quiet_wandb(monkeypatch, tmp_path):
    # W&B keeps its settings and cache under the home folder: the test's own, not the user's.
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_TOKEN", SECRET)


def _step(step: int) -> StepMetrics:
    return StepMetrics(step=step, reward_mean=step / 10, reward_std=0.01, loss=1.0 / step, step_time_s=0.5,
                       time=time.time())


def _evaluation() -> dict:
    def model(name: str, reward: float) -> dict:
        return {"name": name, "mean_reward": reward, "accuracy": reward, "format_rate": 1.0, "pass_at_k": reward,
                "response_length_mean": 7.0, "truncation_rate": 0.0, "reward_ci95": [reward - 0.1, reward + 0.1]}
    return {"models": [model("base", 0.2), model("trained", 0.6)]}


@pytest.mark.e2e  # starts a real MLflow server (mlflow_url)
def test_a_run_and_its_resumed_retry_are_one_tracker_run_in_each_tool(mlflow_url, tmp_path):
    profile = resolve_profile("tiny", "cpu", overrides=[*ALL, f"tracking.mlflow.tracking_uri={mlflow_url}",
                                                        "tracking.mlflow.experiment=grpo-tests"])
    env = resolve_environment(profile).redacted()
    device = DeviceInfo(kind="cpu", count=2, decided_by="requested", reason="test")
    run_dir, flow_run = tmp_path / "tiny-run", uuid4()
    run_dir.mkdir()

    first = open_tracker_run(profile, device, env, run_dir, flow_run, warn=pytest.fail)
    steps = StepTracking(profile, run_dir, logs_itself=False, warn=pytest.fail)
    for step in (1, 2, 3):
        steps.step(_step(step))
    steps.close()
    # The retry resumes from the checkpoint of step 1: steps 2 and 3 are trained again, logged once.
    retry = uuid4()  # a second flow run of the same run folder
    again = open_tracker_run(profile, device, env, run_dir, retry, warn=pytest.fail)
    assert again.runs == first.runs
    steps = StepTracking(profile, run_dir, logs_itself=False, warn=pytest.fail)
    for step in (2, 3, 4, 5):
        steps.step(_step(step))
    steps.close()
    (run_dir / "report.md").write_text("# GRPO run `tiny-run`\n\nthe report\n")
    (run_dir / "metrics.jsonl").write_text("".join(_step(s).model_dump_json() + "\n" for s in range(1, 6)))
    result = {"eval": _evaluation(), "train": {"steps_done": 5}, "tracking": tracking_lines(read_state(run_dir))}
    assert close_tracker_runs(profile, run_dir, result, FINISHED, lambda: "written") == "written"

    ids = read_state(run_dir).runs
    links = tracking_lines(read_state(run_dir))
    assert links["mlflow"] == f"{mlflow_url}/#/experiments/{ids['mlflow']['experiment_id']}/runs/{ids['mlflow']['run_id']}"

    # MLflow, through its client against the server.
    client = MlflowClient(mlflow_url)
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-run"
    assert client.get_experiment(run.info.experiment_id).name == "grpo-tests"
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [(m.step, m.value) for m in history] == [(s, s / 10) for s in range(1, 6)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/trained/mean_reward_ci95_low")] == [5]
    assert run.data.metrics["eval/trained/mean_reward"] == 0.6 and run.data.metrics["eval/base/accuracy"] == 0.2
    assert run.data.params["model.name"] == "tiny" and run.data.params["backend"] == "local"
    assert run.data.params["env.HF_TOKEN"] == "***"
    assert not any(SECRET in value for value in run.data.params.values())
    tags = run.data.tags
    assert tags["model"] == "tiny" and tags["device"] == "cpu" and tags["backend"] == "local"
    assert tags["prefect.flow_run_id"] == str(retry)  # the tracker run names the latest flow run of it
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.md", "metrics.jsonl"} <= artifacts
    report = Path(client.download_artifacts(run.info.run_id, "report.md", str(tmp_path)))
    assert "the report" in report.read_text()

    # W&B offline: every session of the run's id, joined as `wandb sync` joins them.
    wandb_run = wandb_offline_run(run_dir / "wandb", ids["wandb"]["run_id"])
    assert wandb_run["sessions"] >= 3
    trained = [row["_step"] for row in wandb_run["history"] if "train/reward_mean" in row]
    assert trained == [1, 2, 3, 4, 5]
    assert wandb_run["config"]["model.name"] == "tiny" and wandb_run["config"]["env.HF_TOKEN"] == "***"
    assert {"model:tiny", "device:cpu", "backend:local"} <= wandb_run["tags"]
    assert "report.md" in wandb_run["files"]
    assert wandb_run["summary"]["eval/trained/mean_reward"] == 0.6

    # TensorBoard, through its own reader.
    log_dir = Path(ids["tensorboard"]["log_dir"])
    scalars = tensorboard_scalars(log_dir)
    assert [step for step, _ in scalars["train/reward_mean"]] == [1, 2, 3, 4, 5]
    assert [step for step, _ in scalars["eval/trained/mean_reward"]] == [5]
    texts = tensorboard_texts(log_dir)
    assert "the report" in texts["report"][-1] and "tiny" in texts["profile"][0]

    everything = "".join(p.read_text(errors="ignore") for p in run_dir.rglob("*") if p.is_file())
    assert SECRET not in everything


def test_a_tracker_that_cannot_be_reached_fails_the_start_in_one_line(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    profile = resolve_profile("tiny", "cpu", overrides=["tracking.trackers=[mlflow]",
                                                        f"tracking.mlflow.tracking_uri={closed}"])
    device = DeviceInfo(kind="cpu", decided_by="requested", reason="test")
    started = time.monotonic()
    with pytest.raises(UserError) as refused:
        open_tracker_run(profile, device, {}, tmp_path, uuid4(), warn=pytest.fail)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"tracking: MLflow ({closed}) cannot be reached")
    assert "tracking.on_unreachable=warn" in message
    assert not (tmp_path / "tracking.json").exists()
    assert time.monotonic() - started < 120  # a bound on MLflow's own retries, not a timing

    warned: list[str] = []
    lenient = profile.model_copy(update={"tracking": profile.tracking.model_copy(update={"on_unreachable": "warn"})})
    state = open_tracker_run(lenient, device, {}, tmp_path, uuid4(), warn=warned.append)
    assert len(warned) == 1 and "MLflow" in warned[0] and "goes on without" in warned[0]
    assert state.runs == {} and "mlflow" in state.skipped
    with tracking_session(lenient.tracking, tmp_path, "run") as session:
        assert session is None


@pytest.mark.e2e  # starts a real MLflow server (mlflow_url)
def test_the_verl_job_continues_the_tracker_runs_through_verls_own_tracking_layer(mlflow_url, tmp_path):
    """The overrides and variables the verl backend renders, read by verl 0.9.1's `Tracking` (built as
    the stand-in, and verl's trainer, build it) in a process of its own, as the cluster job does."""
    profile = resolve_profile("tiny", "npu", "verl", overrides=[
        *ALL, f"tracking.mlflow.tracking_uri={mlflow_url}", "tracking.wandb.project=grpo-verl",
        "cluster.devices_per_node=1"])
    run_dir = tmp_path / "verl-run"
    run_dir.mkdir()
    device = DeviceInfo(kind="npu", decided_by="requested", reason="test")
    state = open_tracker_run(profile, device, resolve_environment(profile).redacted(), run_dir, uuid4(), pytest.fail)
    # arith has no scorer in verl: the stand-in scores the training rows with the carried reward, as verl would
    pq.write_table(arith_splits(8, 4, seed=0)["train"], tmp_path / "train.parquet")
    inputs = TrainingInputs(model_path=str(tmp_path / "model"), train_files=[str(tmp_path / "train.parquet")],
                            val_files=[str(tmp_path / "test.parquet")], checkpoint_dir=str(run_dir / "checkpoints"))
    spec = job_spec(profile, inputs, run_dir, run_dir.name, {"env_vars": {}}, "abc123", 1)
    env_vars = spec.runtime_env["env_vars"]
    assert env_vars["MLFLOW_RUN_ID"] == state.runs["mlflow"]["run_id"] and env_vars["MLFLOW_TRACKING_URI"] == mlflow_url
    assert env_vars["WANDB_RUN_ID"] == state.runs["wandb"]["run_id"] and env_vars["WANDB_MODE"] == "offline"
    assert env_vars["TENSORBOARD_DIR"] == state.runs["tensorboard"]["log_dir"]
    assert not any("API_KEY" in name or SECRET in value for name, value in env_vars.items())
    overrides = verl_command(profile, inputs)[3:]
    assert "trainer.logger=[console,mlflow,wandb,tensorboard,file]" in overrides
    assert "trainer.project_name=grpo-verl" in overrides

    # what Ray's py_modules puts on the job's path: the project and the run's reward plan (written at submission)
    carried = [str(Path(p).parent) for p in reward_modules(profile, run_dir / RunFolder.JOB, write=True)]
    assert carried == [str(Path(p).parent) for p in spec.runtime_env["py_modules"]]
    job = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, *{carried!r}]\n"
           "from verl_config import compose_verl\nimport verl_stand_in\n"
           f"config = compose_verl({overrides!r})\n"
           "tracking = verl_stand_in._Tracking([n for n in config['trainer']['logger'] if n not in ('console', 'file')],"
           " config)\n"
           "for step in (1, 2, 3):\n"
           "    tracking.log(data=verl_stand_in._step_metrics(step, 0, 0.1, config), step=step)\n"
           "tracking.finish()\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_RUN", "TENSORBOARD"))}
    subprocess.run([sys.executable, "-c", job], env={**environ, **env_vars}, cwd=tmp_path, check=True, timeout=600)

    client = MlflowClient(mlflow_url)
    run_id = state.runs["mlflow"]["run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "critic/score/mean")] == [1, 2, 3]
    params = client.get_run(run_id).data.params
    assert params["trainer/experiment_name"] == profile.trainer.experiment_name  # verl's own config, same run
    assert params["model.name"] == "tiny"  # the flow's
    assert len(client.search_runs([state.runs["mlflow"]["experiment_id"]])) == 1
    wandb_run = wandb_offline_run(run_dir / "wandb", state.runs["wandb"]["run_id"])
    assert [row["_step"] for row in wandb_run["history"] if "critic/score/mean" in row] == [1, 2, 3]
    scalars = tensorboard_scalars(Path(state.runs["tensorboard"]["log_dir"]))
    assert [step for step, _ in scalars["critic/score/mean"]] == [1, 2, 3]


@pytest.mark.e2e  # runs the command line as a subprocess
def test_an_unknown_tracker_is_refused_at_planning_in_one_line():
    answer = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--dry-run",
         "--set", "tracking.trackers=[mlflow,neptune]"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert answer.returncode == 2, answer.stderr
    lines = answer.stderr.strip().splitlines()
    assert len(lines) == 1 and "tracking.trackers" in lines[0] and "neptune" in lines[0], lines


def test_the_forms_tracker_choice_is_the_profiles_tracking_trackers():
    from grpo_pipeline.flows.form import run_from_form
    from grpo_pipeline.run.request import RunRequest
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(run_from_form.fn).model_dump()
    field = schema["properties"]["trackers"]
    choices = schema["definitions"][field["items"]["$ref"].split("/")[-1]]["enum"] if "$ref" in field["items"] \
        else field["items"]["enum"]
    assert choices == ["mlflow", "wandb", "tensorboard"] and field["default"] == []
    request = RunRequest.from_form(model="tiny", device="cpu", backend="local", overrides="tracking.wandb.mode=offline",
                                   stages=[], run_name="", run_root="runs", ray_address="", profile_file="",
                                   trackers=["tensorboard", "wandb"])
    profile = resolve_profile("tiny", "cpu", overrides=request.overrides)
    assert profile.tracking.trackers == ["tensorboard", "wandb"] and profile.tracking.wandb.mode == "offline"


def test_a_tracker_that_goes_away_during_training_costs_warnings_not_the_training(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    profile = resolve_profile("tiny", "cpu", overrides=["tracking.trackers=[mlflow]", f"tracking.mlflow.tracking_uri={store}"])
    device = DeviceInfo(kind="cpu", decided_by="requested", reason="test")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state = open_tracker_run(profile, device, {}, run_dir, uuid4(), warn=pytest.fail)
    MlflowClient(store).delete_run(state.runs["mlflow"]["run_id"])  # someone deletes it while training runs
    warned: list[str] = []
    steps = StepTracking(profile, run_dir, logs_itself=False, warn=warned.append)
    for step in (1, 2):
        steps.step(_step(step))
    steps.close()
    assert warned and all(line.startswith("tracking: ") and "\n" not in line for line in warned)


def test_a_tracker_is_one_class_that_the_profile_the_preflight_and_the_verl_command_ask():
    """Each registered class says everything about its tool; the profile's section, the node requirements
    and verl's loggers are made from the registry (so a new tracker is one class: docs/tracking.md)."""
    from typing import get_args

    from grpo_pipeline.backends.verl.command import tracked_loggers
    from grpo_pipeline.profiles.trackers import TRACKERS
    from grpo_pipeline.profiles.tracking import TrackingSection, tracker_requirements

    assert get_args(get_args(TrackingSection.model_fields["trackers"].annotation)[0]) == tuple(TRACKERS)
    for name, tracker in TRACKERS.items():
        assert tracker.name == name and tracker.label and tracker.package and tracker.imports and tracker.verl_logger
        assert TrackingSection.model_fields[name].annotation is tracker.settings_class
    everything = TrackingSection(trackers=list(TRACKERS))
    assert list(tracker_requirements(everything)) == [t.package for t in TRACKERS.values()]
    assert tracked_loggers(["console"], everything.trackers) == ["console", *(t.verl_logger for t in TRACKERS.values()), "file"]


def test_no_file_from_outside_the_run_folder_reaches_a_tracker(tmp_path):
    """Issue 55: a `best.json` or `checkpoint_curve.png` link in the run folder was followed and uploaded to
    MLflow's artifacts and TensorBoard; only the run's own plain files are kept."""
    from grpo_pipeline.run.folder import RunFolder
    from grpo_pipeline.tasks.tracking import report_files

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run_dir / "eval").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "secret.json").write_text("{}")
    (run_dir / RunFolder.BEST_RECORD).symlink_to(elsewhere / "secret.json")
    (run_dir / RunFolder.CURVE_PLOT).symlink_to(elsewhere / "secret.json")
    (run_dir / RunFolder.REPORT).write_text("# report\n")
    (run_dir / "eval").rmdir()
    (run_dir / "eval").symlink_to(elsewhere)  # a linked folder too
    (elsewhere / "eval.json").write_text("{}")
    kept = report_files(run_dir)
    assert run_dir / RunFolder.REPORT in kept
    assert not {run_dir / RunFolder.BEST_RECORD, run_dir / RunFolder.CURVE_PLOT, run_dir / RunFolder.EVAL_REPORT} & set(kept)
