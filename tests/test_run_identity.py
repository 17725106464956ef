"""A run folder is the identity of one request (run/identity.py): a rerun into a folder holding a trained
policy with another model, data, algorithm, reward, adapter or backend is refused in one line naming the
first difference, before anything starts; more steps continue the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_pipeline.run.folder import RunFolder


def empty_store(root: Path) -> list[str]:  # no data there: planning calls no reward in a child
    return ["--set", f"data.root={root / 'data'}"]


def _trained(cli, run_root: Path, *settings: str) -> Path:
    """A folder as a finished run leaves it: its plan.json (the dry run's) and a saved step."""
    done = cli("--model", "tiny", "--device", "cpu", "--run-dir", str(run_root), "--run-name", "rw", *settings,
               *empty_store(run_root), "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    folder = run_root / "rw"
    (folder / RunFolder.CHECKPOINTS / "global_step_2").mkdir(parents=True)
    (folder / RunFolder.PLAN).write_text(done.stdout)
    return folder


@pytest.mark.parametrize(("change", "said"), [
    (("--model", "smollm2-135m"), "holds a policy trained with model.name='tiny'; this request has model.name='smollm2-135m'"),
    (("--set", "data.dataset=gsm8k"), "data.dataset='arith'; this request has data.dataset='gsm8k'"),
    (("--set", "algorithm.lr=0.5"), "algorithm.lr="),
    (("--set", "lora.rank=8"), "lora.rank=0; this request has lora.rank=8"),
    pytest.param(("--set", "reward.functions=[tests/constant_reward.py:always_one]"), "reward.functions=",
                 marks=pytest.mark.e2e),  # the planning check imports a reward in a child process
])
def test_a_rerun_that_would_train_something_else_is_refused(cli, tmp_path, change, said):
    folder = _trained(cli, tmp_path)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    args = ["--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path), "--run-name", "rw", *empty_store(tmp_path)]
    if change[0] == "--model":
        args[1] = change[1]
    else:
        args += list(change)
    refused = cli(*args, "--dry-run")
    assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    assert "choose a new --run-name" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before  # nothing touched


def test_more_steps_or_other_trackers_continue_the_run_and_an_untrained_folder_is_free(cli, tmp_path):
    _trained(cli, tmp_path)
    base = ["--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path), "--run-name", "rw", *empty_store(tmp_path)]
    for more in (["--set", "trainer.total_training_steps=20"], ["--set", "trainer.save_freq=1"],
                 ["--set", "guards.reward_collapse_steps=off"]):
        assert cli(*base, *more, "--dry-run").returncode == 0
    empty = tmp_path / "fresh"
    empty.mkdir()
    (empty / RunFolder.PLAN).write_text(json.dumps({"profile": {"model": {"name": "tiny"}}}))
    assert cli("--model", "smollm2-135m", "--device", "cpu", "--run-dir", str(tmp_path), "--run-name", "fresh",
               *empty_store(tmp_path), "--dry-run").returncode == 0  # no policy there yet: the folder is the new run's
