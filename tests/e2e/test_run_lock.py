"""A run folder belongs to one live run (flows/run_lock.py): a second run of the same --run-name is
refused in one line while the first lives, and the folder of a run killed outright is free again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import run_lock
from flows.grpo import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _lock_holder(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / run_lock.LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_second_run_of_a_live_runs_folder_is_refused_and_a_killed_runs_folder_is_free(tmp_path, capsys):
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "shared-name"
    common = ["--model", "tiny", "--device", "cpu", "--run-dir", str(runs), "--run-name", "shared-name",
              "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}"]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    first = subprocess.Popen([sys.executable, "-m", "flows.grpo", *common, "--stages", "train"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240  # planning on a loaded 2-core machine: imports take most of it
        while _lock_holder(run_dir) != first.pid:
            assert first.poll() is None, "the first run ended before it held its folder"
            assert time.monotonic() < deadline, "the first run never held its folder"
            time.sleep(0.2)

        assert main([*common, "--stages", "fetch_dataset"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"error: --run-name shared-name: the run folder {run_dir.resolve()} is in use by "
                                   f"another live run (pid {first.pid} on ")
        assert not (run_dir / "profile.yaml").exists()  # nothing of the second run was written
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the run and what it started (its local Prefect API)
        first.wait(timeout=60)

    # Killed outright, it cannot release the folder: the kernel drops its lock with it.
    run_lock.claim(run_dir)
    try:
        assert _lock_holder(run_dir) == os.getpid()
        run_lock.claim(run_dir)  # the holder claiming again: still its own
    finally:
        run_lock.release(run_dir)
