"""A run's files are for the team and for Ray nodes that may run as other users: 0666 / 0777 less the
umask, including the policy weights a library wrote (safetensors writes 0600)."""

from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import save_file

from grpo_pipeline.backends.local.checkpoints import LATEST, TRAINER_DIR, latest_step, publish_step
from grpo_pipeline.store.files import current_umask


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_published_local_checkpoint_follows_the_umask_not_the_writers_0600(tmp_path):
    written = tmp_path / TRAINER_DIR / "checkpoint-3"
    (written / "nested").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, written / "model.safetensors")
    save_file({"w": torch.zeros(2)}, written / "nested" / "optimizer.safetensors")
    assert _mode(written / "model.safetensors") == 0o600  # what the library does: why publishing sets modes
    old = os.umask(0o022)
    try:
        assert current_umask() == 0o022
        publish_step(tmp_path, 3)
    finally:
        os.umask(old)
    final = tmp_path / "global_step_3"
    assert latest_step(tmp_path) == 3 and (tmp_path / LATEST).read_text() == "3\n"
    assert {_mode(p) for p in final.rglob("*") if p.is_file()} == {0o644}
    assert {_mode(p) for p in [final, *final.rglob("*")] if p.is_dir()} == {0o755}
