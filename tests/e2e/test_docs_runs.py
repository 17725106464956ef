"""The docs' whole CPU runs of the tiny model, run as written: from a folder laid out as the checkout
(its `.venv`), with a fresh HOME (nothing cached), each line exactly as the page shows it.

    .venv/bin/python -m pytest -q tests/e2e/test_docs_runs.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from test_docs_commands import ROOT, bash_lines

pytestmark = pytest.mark.e2e


def documented(page: str, *fragments: str) -> str:
    """The command line of `page` that holds every fragment (there must be exactly one)."""
    (line,) = [line.split(" #")[0].strip() for line in bash_lines(ROOT / "docs" / page)
               if all(fragment in line for fragment in fragments)]
    return line


def run_as_written(line: str, sandbox: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(sandbox / "home")}
    return subprocess.run(shlex.split(line), cwd=sandbox, capture_output=True, text=True, env=env, timeout=1200)


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    (tmp_path / "home").mkdir()
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    return tmp_path


def test_the_training_pages_try1_pair_trains_then_finds_it_complete(sandbox):
    first = documented("training-and-evaluation.md", "--set cluster.devices_per_node=2 --run-name try1")
    again = documented("training-and-evaluation.md", "--run-name try1", "already complete")
    done = run_as_written(first, sandbox)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training: 8/8 steps" in done.stdout and (sandbox / "runs" / "try1" / "report.md").is_file()
    done = run_as_written(again, sandbox)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training: already complete at step 8; nothing trained" in done.stdout


def test_the_data_pages_fetch_and_prepare_run(sandbox):
    done = run_as_written(documented("data-and-models.md", "--stages fetch_dataset,prepare_checkpoint"), sandbox)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dataset arith (fetched and verified)" in done.stdout and "base model tiny (prepared and verified)" in done.stdout
    assert (sandbox / "home" / "data" / "arith").is_dir() and (sandbox / "home" / "models" / "tiny").is_dir()
