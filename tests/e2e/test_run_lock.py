"""A run folder belongs to one live run (run/lock.py): a second run of the same --run-name is
refused in one line while the first lives, and the folder of a run killed outright is free again. The
lock cannot be turned against its users: a link planted at .run.lock is never followed nor written
through, deleting or replacing .run.lock during a run does not free the folder, and a directory or a
FIFO there is one line, exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_pipeline.run import lock as run_lock
from grpo_pipeline.flows.grpo import main
from grpo_pipeline.errors import UserError
from grpo_pipeline.run.folder import RunFolder

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _lock_holder(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / RunFolder.LOCK).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _cli_args(tmp_path: Path, name: str) -> list[str]:
    return ["--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"), "--run-name", name,
            "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}",
            "--stages", "fetch_dataset"]


def _holder_process(run_dir: Path) -> subprocess.Popen:
    """Another process that claims the folder as a run does (the same `claim`), then lives on."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from grpo_pipeline.run import lock as run_lock; "
         "run_lock.claim(sys.argv[1]); print('held', flush=True); time.sleep(600)", str(run_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _one_line_refusal(capsys, args: list[str]) -> str:
    assert main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --run-name "), lines
    return lines[0]


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_symlink_at_the_lock_file_is_refused_in_one_line_and_never_written_through(tmp_path, capsys, dangling):
    run_dir = tmp_path / "runs" / "linked"
    run_dir.mkdir(parents=True)
    target = tmp_path / "someone-elses-notes.txt"
    if not dangling:
        target.write_text("a week of notes\n")
    (run_dir / RunFolder.LOCK).symlink_to(target)

    line = _one_line_refusal(capsys, _cli_args(tmp_path, "linked"))
    assert "is a symbolic link" in line and "rm -ri" in line
    assert target.read_text() == "a week of notes\n" if not dangling else not target.exists()
    assert (run_dir / RunFolder.LOCK).is_symlink() and not (run_dir / "profile.yaml").exists()


def test_a_hard_link_at_the_lock_file_is_refused_and_its_other_name_kept(tmp_path):
    run_dir = tmp_path / "runs" / "hard"
    run_dir.mkdir(parents=True)
    other = tmp_path / "notes.txt"
    other.write_text("kept\n")
    os.link(other, run_dir / RunFolder.LOCK)
    with pytest.raises(UserError, match="has 2 hard links"):
        run_lock.claim(run_dir)
    assert other.read_text() == "kept\n"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_a_fifo_at_the_lock_file_is_one_line_exit_2(tmp_path, capsys, kind):
    run_dir = tmp_path / "runs" / kind
    run_dir.mkdir(parents=True)
    (run_dir / RunFolder.LOCK).mkdir() if kind == "directory" else os.mkfifo(run_dir / RunFolder.LOCK)
    if kind == "fifo":  # in a process of its own, so a hang on the FIFO fails the test instead of stalling it
        done = subprocess.run([sys.executable, "-m", "grpo_pipeline", *_cli_args(tmp_path, kind)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")})
        assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
        (line,) = done.stderr.splitlines()
    else:
        line = _one_line_refusal(capsys, _cli_args(tmp_path, kind))
    assert f"{RunFolder.LOCK} is {'a directory' if kind == 'directory' else 'not a regular file'}" in line


@pytest.mark.parametrize("swap", ["deleted", "replaced-by-a-file", "replaced-by-a-symlink"])
def test_deleting_or_replacing_the_lock_file_during_a_run_does_not_free_the_folder(tmp_path, capsys, swap):
    run_dir = tmp_path / "runs" / "held"
    holder = _holder_process(run_dir)
    try:
        lock_path = run_dir / RunFolder.LOCK
        lock_path.unlink()
        target = tmp_path / "target.txt"
        target.write_text("untouched\n")
        if swap == "replaced-by-a-file":
            lock_path.write_text("{}")
        elif swap == "replaced-by-a-symlink":
            lock_path.symlink_to(target)

        line = _one_line_refusal(capsys, _cli_args(tmp_path, "held"))
        assert f"the run folder {run_dir.resolve()} is in use by another live run" in line
        other = subprocess.run([sys.executable, "-c", "import sys; from grpo_pipeline.run import lock as run_lock; "
                                "run_lock.claim(sys.argv[1])", str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)  # and from a third process
        assert other.returncode == 1 and "RunFolderBusy" in other.stderr, other.stderr[-2000:]
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert target.read_text() == "untouched\n"
    if swap == "replaced-by-a-symlink":
        lock_path.unlink()
    run_lock.claim(run_dir)  # the holder is gone: the folder is free, whatever .run.lock went through
    try:
        assert _lock_holder(run_dir) == os.getpid()
    finally:
        run_lock.release(run_dir)


def test_a_second_run_of_a_live_runs_folder_is_refused_and_a_killed_runs_folder_is_free(tmp_path, capsys):
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "shared-name"
    common = ["--model", "tiny", "--device", "cpu", "--run-dir", str(runs), "--run-name", "shared-name",
              "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}"]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    first = subprocess.Popen([sys.executable, "-m", "grpo_pipeline", *common, "--stages", "train"], cwd=ROOT, env=env,
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
