"""A whole run logged to MLflow (a real server over HTTP), W&B (offline) and TensorBoard, resumed after
a crash, read back with each tool's own reader: one tracker run per pipeline run, every step once.

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_tracking_flow.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpo_pipeline.tracking.trackers import read_state
from mlflow_server import mlflow_server
from tracker_readers import tensorboard_scalars, wandb_offline_run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def test_a_demo_run_resumed_after_a_crash_is_one_tracker_run_with_every_step_once(cli, mlflow_url, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = [f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}",
                "trainer.total_training_steps=4", "trainer.save_freq=2", "eval.max_prompts=8",
                "tracking.trackers=[mlflow,wandb,tensorboard]", f"tracking.mlflow.tracking_uri={mlflow_url}",
                "tracking.wandb.mode=offline"]
    args = ["--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path), "--run-name", "tracked",
            *(arg for item in settings for arg in ("--set", item))]
    first = cli(*args, "--stages", "fetch_dataset,prepare_checkpoint,train")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "tracked"
    ids = read_state(run_dir).runs
    assert read_state(run_dir).last_step == 4
    # A crash after step 4 was logged but before its checkpoint was complete: the next run of the
    # folder resumes from step 2 and trains steps 3 and 4 again.
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / "global_step_4")
    (checkpoints / "latest").write_text("2\n")

    second = cli(*args)
    assert second.returncode == 0, second.stderr
    assert "resumed from step 2" in second.stdout
    assert read_state(run_dir).runs == ids

    client = MlflowClient(mlflow_url)
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")] == [1, 2, 3, 4]
    assert {"eval/base/mean_reward", "eval/trained/mean_reward", "eval/trained/mean_reward_ci95_high"} <= set(run.data.metrics)
    assert {"report.md", "reward_curve.png", "eval_comparison.png", "metrics.jsonl"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)}
    tags = run.data.tags
    assert (tags["model"], tags["device"], tags["backend"]) == ("tiny", "cpu", "local")
    flow_run = tags["prefect.flow_run_id"]
    if "prefect.flow_run_url" in tags:  # the command line's own Prefect API is a server with a UI
        assert tags["prefect.flow_run_url"].endswith(flow_run)
    report = (run_dir / "report.md").read_text()
    assert f"runs/{run.info.run_id}" in report  # the report links the tracker run

    wandb_run = wandb_offline_run(run_dir / "wandb", ids["wandb"]["run_id"])
    assert [row["_step"] for row in wandb_run["history"] if "train/reward_mean" in row] == [1, 2, 3, 4]
    assert "report.md" in wandb_run["files"]
    scalars = tensorboard_scalars(Path(ids["tensorboard"]["log_dir"]))
    assert [step for step, _ in scalars["train/reward_mean"]] == [1, 2, 3, 4]
    assert [step for step, _ in scalars["eval/trained/mean_reward"]] == [4]
