"""A real (not dry) run from the command line: the local Prefect API it starts, the stages, and a
bad input reported as one line with exit code 2, with no traceback anywhere in the output.

The runs read the session's prepared data and model stores (`stores`), and those whose test is not about
the local API use the session's Prefect API (`api_url`) instead of starting one each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from grpo_pipeline.data.rl_data import arith_splits

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, tmp_path: Path, api_url: str, stores: list[str]) -> subprocess.CompletedProcess:
    """The command line against the session's Prefect API (`api_url`), its stores at `stores`."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_API_URL": api_url}
    return subprocess.run(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         *(arg for store in stores for arg in ("--set", store)), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_a_bad_dataset_fails_the_flow_with_one_line_and_exit_2(tmp_path, api_url, stores):
    unsplit = tmp_path / "unsplit"
    unsplit.mkdir()
    pq.write_table(arith_splits(4, 2, seed=0)["train"], unsplit / "everything.parquet")
    own_data = [f"data.root={tmp_path / 'data'}", *stores[1:]]  # what it must not write is its own store's
    done = run_cli("--set", "data.dataset=gsm8k", "--set", f"data.source={unsplit}", "--stages", "fetch_dataset",
                   tmp_path=tmp_path, api_url=api_url, stores=own_data)
    assert done.returncode == 2, done.stderr[-2000:]
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {unsplit}: 4 distinct prompts and no test split; give a test")
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "data" / "gsm8k").exists()


def test_evaluate_any_directories_without_training_and_refuse_one_without_weights(tmp_path, api_url, stores):
    from grpo_pipeline.data.builtin_models import build_tiny

    first, second = tmp_path / "policy-a", tmp_path / "policy-b"
    build_tiny(first)
    build_tiny(second, seed=1)
    done = run_cli("--stages", "evaluate", "--set", f"eval.models=[{first},{second}]", "--set", "eval.max_prompts=8",
                   "--run-name", "eval-only", tmp_path=tmp_path, api_url=api_url, stores=stores)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval policy-a: mean reward" in done.stdout and "eval policy-b: mean reward" in done.stdout
    run_dir = tmp_path / "runs" / "eval-only"
    assert sorted(p.name for p in (run_dir / "eval").glob("*.jsonl")) == ["policy-a.jsonl", "policy-b.jsonl"]
    assert not (run_dir / "checkpoints").exists()  # nothing was trained
    assert "| metric | policy-a | policy-b | policy-b - policy-a |" in (run_dir / "report.md").read_text()

    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text((first / "config.json").read_text())
    done = run_cli("--stages", "evaluate", "--set", f"eval.models=[{empty}]", "--run-name", "bad-eval", tmp_path=tmp_path,
                   api_url=api_url, stores=stores)
    assert done.returncode == 2
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error == f"error: {empty}: no safetensors weights"
    assert "Traceback" not in done.stderr and not (tmp_path / "runs" / "bad-eval" / "eval").exists()


def test_a_run_stopped_with_sigterm_ends_its_ray_job_and_reports_where_it_stopped(tmp_path, stores):
    """What a worker's cancel or a killed terminal does: Prefect marks the run crashed, and the
    crash hook stops the Ray job (training workers included) and writes the report. (Its own local
    API: a stop of the command line that started it is what is tested.)"""
    import signal
    import time

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         "--run-name", "stopped", *(arg for store in stores for arg in ("--set", store)),
         "--set", "trainer.total_training_steps=500"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = tmp_path / "runs" / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()) and process.poll() is None:
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
    assert _train_workers(env["PREFECT_HOME"]), "the run's training workers are not found by their environment"
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]  # the shell's code for "stopped by SIGTERM"
    assert "stopped by SIGTERM" in output and "Aborted" not in output
    assert not list((tmp_path / "prefect" / "grpo-pipeline" / "leases").glob("*"))  # released, log removed
    report = (tmp_path / "runs" / "stopped" / "report.md").read_text()
    assert "**The run failed.** Stage `train`" in report, output[-3000:]
    assert "stopped the local backend's training (its Ray job or workers)" in output
    deadline = time.monotonic() + 30
    while _train_workers(env["PREFECT_HOME"]) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _train_workers(env["PREFECT_HOME"])


def _train_workers(prefect_home: str) -> list[str]:
    """This run's training workers: Ray's workers inherit the run's environment, whose PREFECT_HOME is this
    test's own (another run's workers on the machine are not this run's to end)."""
    found = subprocess.run(["pgrep", "-af", "RayTrainWorker"], capture_output=True, text=True).stdout
    mine = []
    for line in found.splitlines():
        pid = line.split(maxsplit=1)[0]
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"PREFECT_HOME={prefect_home}".encode() in environ:
            mine.append(line)
    return mine


def test_the_local_api_stops_even_when_sending_the_last_logs_fails(monkeypatch, tmp_path):
    from prefect.logging.handlers import APILogHandler

    from grpo_pipeline.flows.local_api import local_api_unless_configured

    monkeypatch.delenv("PREFECT_API_URL", raising=False)

    def broken_flush(self):
        raise RuntimeError("flush failed")

    monkeypatch.setattr(APILogHandler, "flush", broken_flush)
    with pytest.raises(RuntimeError, match="flush failed"), local_api_unless_configured(tmp_path / "api.log") as api:
        api.wait_ready()
    assert api.process.poll() is not None and "PREFECT_API_URL" not in os.environ


def test_a_port_that_is_not_rays_is_refused_before_the_run_starts_naming_the_address(tmp_path):
    """A head address whose port accepts connections but never answers: Ray's own client would retry
    for many minutes; the planning check's one call to the GCS gives up at its deadline, before a
    Prefect API, Ray or the run's folder is started."""
    import socket

    with socket.socket() as listener:  # accepts TCP connections (the kernel's backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
        env.pop("PREFECT_API_URL", None)
        done = subprocess.run(
            [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
             "--run-name", "not-ray", "--ray-address", address, "--stages", "fetch_dataset",
             "--set", f"data.root={tmp_path / 'data'}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: --ray-address: {address} is not a Ray cluster's GCS port: it gave no answer "
                                  "within 10 s; give the head's GCS port (6379 by default")
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "prefect").exists()


def test_a_run_killed_with_sigkill_leaves_nothing_a_later_run_does_not_end(tmp_path, stores):
    """kill -9 of the CLI mid-training: its Prefect API dies with it; the next run ends the Ray
    processes and training worker it left, marks its flow run crashed, and removes its files. (Its own
    local API: that API's end with the killed process is what is tested.)"""
    import json
    import time

    import psutil

    from grpo_pipeline.flows.lease import _lease_of
    from grpo_pipeline.flows.local_api import LocalAPI

    home = tmp_path / "prefect"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    common = ["--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
              *(arg for store in stores for arg in ("--set", store))]
    killed = subprocess.Popen([sys.executable, "-m", "grpo_pipeline", *common, "--run-name", "killed",
                               "--set", "trainer.total_training_steps=500"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert killed.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
    leases = home / "grpo-pipeline" / "leases"
    (lease_file,) = leases.glob("*.json")
    lease = json.loads(lease_file.read_text())
    killed.kill()
    killed.wait()

    def carrying_the_lease() -> list[str]:
        found = []
        for process in psutil.process_iter():
            try:
                if _lease_of(process) == lease["id"]:
                    found.append(" ".join(process.cmdline())[:80])
            except psutil.Error:
                continue
        return found

    deadline = time.monotonic() + 20
    while any("prefect" in cmd and "server" in cmd for cmd in carrying_the_lease()):
        assert time.monotonic() < deadline, "the local Prefect API outlived the process that started it"
        time.sleep(0.5)

    later = subprocess.run([sys.executable, "-m", "grpo_pipeline", *common, "--run-name", "later", "--stages", "fetch_dataset"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert later.returncode == 0, later.stderr[-3000:]
    assert f"marked 1 flow run(s) crashed, left by killed run(s) of pid(s) {lease['pid']}" in later.stdout + later.stderr
    assert carrying_the_lease() == []  # no stray server, Ray agent or training worker
    steps = metrics.read_text()
    time.sleep(3)
    assert metrics.read_text() == steps  # nothing writes into the killed run's directory any more
    assert sorted(p.name for p in leases.iterdir()) == []  # its lease and its API's log are gone

    api = LocalAPI(tmp_path / "api.log", env={**env, "PREFECT_HOME": str(home)})
    try:
        api.wait_ready()
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from prefect.client.orchestration import get_client\n"
             "with get_client(sync_client=True) as c: print(c.read_flow_run(sys.argv[1]).state.type.value)",
             lease["flow_runs"][0]], env={**env, "PREFECT_API_URL": api.url}, capture_output=True, text=True, timeout=120)
    finally:
        api.stop()
    assert done.stdout.strip() == "CRASHED", done.stderr[-2000:]


def test_a_run_file_the_folder_refuses_fails_the_run_in_one_line_naming_it(tmp_path, api_url, stores):
    blocked = tmp_path / "runs" / "blocked" / "plan.json"
    blocked.mkdir(parents=True)  # what the flow's own file must replace is a folder: the rename fails
    done = run_cli("--stages", "fetch_dataset", "--run-name", "blocked", tmp_path=tmp_path, api_url=api_url, stores=stores)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error == (f"error: cannot write the run's file {blocked} (Is a directory); make the run folder writable "
                     "there, or choose another --run-name or --run-dir")
    report = (blocked.parent / "report.md").read_text()
    assert "Stage `write plan.json`: cannot write the run's file" in report


def test_a_full_disk_fails_the_run_at_once_in_one_line_naming_enospc(tmp_path, api_url, stores):
    """The run folder on a real 600 KiB tmpfs: the first checkpoint fills it. It was retried twice as
    if transient (torch's writer says only "unexpected pos 5952 vs 5844", safetensors "os error 28")
    and ended in tracebacks; now the train stage fails once, naming the folder, ENOSPC and the fix."""
    import shutil

    runs = tmp_path / "runs"
    runs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(runs)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"this test mounts a small tmpfs (root, or a mount namespace): {mounted.stderr}"
    try:
        done = run_cli("--run-name", "full", "--set", "trainer.total_training_steps=2", "--set", "trainer.save_freq=1",
                       tmp_path=tmp_path, api_url=api_url, stores=stores)
    finally:
        subprocess.run(["umount", str(runs)], check=True)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {runs / 'full'}: No space left on device (ENOSPC: ") and error.endswith(
        "free space on that file system (or give --run-dir on another) and run again: training resumes from the "
        "latest checkpoint"), error
    assert "Retry" not in done.stderr + done.stdout  # one attempt: a retry cannot free the disk
    assert shutil.disk_usage(tmp_path).free > 0


def test_training_that_fails_after_its_retries_ends_the_cli_in_one_line(tmp_path, api_url, stores):
    """Every attempt is taken for a hang (no step within 1 s: loading the model alone takes longer):
    the stage's retries are spent and the run fails. The CLI ended with an uncaught
    TrainingInterrupted traceback (rc 1); now one line, rc 1, naming the report."""
    done = run_cli("--run-name", "hangs", "--set", "trainer.step_timeout_s=1", tmp_path=tmp_path, api_url=api_url,
                   stores=stores)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[-1].startswith("error: the run failed: TrainingInterrupted: no training step finished in 1 s "
                                "(trainer.step_timeout_s)"), lines[-3:]
    assert lines[-1].endswith(f"see {tmp_path / 'runs' / 'hangs' / 'report.md'} for where")
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert (tmp_path / "runs" / "hangs" / "report.md").is_file()
