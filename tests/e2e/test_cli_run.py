"""A real (not dry) run from the command line: the local Prefect API it starts, the stages, and a
bad input reported as one line with exit code 2, with no traceback anywhere in the output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.rl_data import arith_splits

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "flows.grpo", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_a_bad_dataset_fails_the_flow_with_one_line_and_exit_2(tmp_path):
    unsplit = tmp_path / "unsplit"
    unsplit.mkdir()
    pq.write_table(arith_splits(4, 2, seed=0)["train"], unsplit / "everything.parquet")
    done = run_cli("--set", "data.dataset=gsm8k", "--set", f"data.source={unsplit}", "--stages", "fetch_dataset",
                   tmp_path=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {unsplit}: no train or test split")
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "data" / "gsm8k").exists()


def test_evaluate_any_directories_without_training_and_refuse_one_without_weights(tmp_path):
    from tasks.builtin_models import build_tiny

    first, second = tmp_path / "policy-a", tmp_path / "policy-b"
    build_tiny(first)
    build_tiny(second, seed=1)
    done = run_cli("--stages", "evaluate", "--set", f"eval.models=[{first},{second}]", "--set", "eval.max_prompts=8",
                   "--run-name", "eval-only", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval policy-a: mean reward" in done.stdout and "eval policy-b: mean reward" in done.stdout
    run_dir = tmp_path / "runs" / "eval-only"
    assert sorted(p.name for p in (run_dir / "eval").glob("*.jsonl")) == ["policy-a.jsonl", "policy-b.jsonl"]
    assert not (run_dir / "checkpoints").exists()  # nothing was trained
    assert "| metric | policy-a | policy-b | Δ (last - first) |" in (run_dir / "report.md").read_text()

    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text((first / "config.json").read_text())
    done = run_cli("--stages", "evaluate", "--set", f"eval.models=[{empty}]", "--run-name", "bad-eval", tmp_path=tmp_path)
    assert done.returncode == 2
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error == f"error: {empty}: no safetensors weights"
    assert "Traceback" not in done.stderr and not (tmp_path / "runs" / "bad-eval" / "eval").exists()


def test_a_run_stopped_with_sigterm_ends_its_ray_job_and_reports_where_it_stopped(tmp_path):
    """What a worker's cancel or a killed terminal does: Prefect marks the run crashed, and the
    crash hook stops the Ray job (training workers included) and writes the report."""
    import signal
    import time

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "flows.grpo", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         "--run-name", "stopped", "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}",
         "--set", "trainer.total_training_steps=500"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = tmp_path / "runs" / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()) and process.poll() is None:
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    report = (tmp_path / "runs" / "stopped" / "report.md").read_text()
    assert "**The run failed.** Stage `train`" in report, output[-3000:]
    assert "stopped this run's Ray job" in output
    deadline = time.monotonic() + 30
    while _train_workers() and time.monotonic() < deadline:
        time.sleep(1)
    assert not _train_workers()


def _train_workers() -> list[str]:
    found = subprocess.run(["pgrep", "-af", "RayTrainWorker"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def test_the_local_api_stops_even_when_sending_the_last_logs_fails(monkeypatch):
    from prefect.logging.handlers import APILogHandler

    from flows.local_api import local_api_unless_configured

    monkeypatch.delenv("PREFECT_API_URL", raising=False)

    def broken_flush(self):
        raise RuntimeError("flush failed")

    monkeypatch.setattr(APILogHandler, "flush", broken_flush)
    with pytest.raises(RuntimeError, match="flush failed"), local_api_unless_configured() as api:
        api.wait_ready()
    assert api.process.poll() is not None and "PREFECT_API_URL" not in os.environ
