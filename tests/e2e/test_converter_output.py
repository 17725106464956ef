"""What a conversion leaves, when it is killed and when two run at once (checkpoints/staged_output.py):
a conversion killed with -9 leaves a partial that the next conversion of the same OUT removes, while
a live writer's partial is left alone and its late rename refused; what a conversion writes has the
modes of the umask.

    .venv/bin/python -m pytest -q tests/e2e/test_converter_output.py
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from converter_inputs import HANG_GUARD_S, ROOT, cli, env, llama, stopped_mid_way

from grpo_pipeline.checkpoints.dist_reader import DistCheckpointReader
from grpo_pipeline.checkpoints.megatron_layout import dist_plan, dist_to_hf, hf_to_dist, model_shape


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return llama(tmp_path_factory.mktemp("sources") / "llama")


def test_a_conversion_killed_mid_way_leaves_a_partial_that_the_next_one_removes(tmp_path):
    """kill -9 gives no chance to clean up: the partial stays, its lock free; the next conversion of
    the same OUT removes it, says so, and completes."""
    source = llama(tmp_path / "large-vocab", vocab=100_000)  # the first tensor written: 25.6 MB
    out = tmp_path / "out"
    with stopped_mid_way(["to-dist", str(source), str(out)]) as killed:
        killed.kill()
        assert killed.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
    [partial] = tmp_path.glob("out.partial-*")
    assert (partial / "__0_0.distcp").stat().st_size > 25_000_000 and not out.exists()
    again = subprocess.run(cli("to-dist", str(source), str(out)), capture_output=True, text=True, env=env(), cwd=ROOT,
                           timeout=HANG_GUARD_S)
    assert (again.returncode, again.stdout) == (0, f"{out}\n"), again.stderr
    assert again.stderr.startswith(f"note: removed {partial} (25.6 MB), left by a conversion to {out} whose writer died")
    assert len(again.stderr.splitlines()) == 1 and not list(tmp_path.glob("*out.partial-*"))
    DistCheckpointReader(out).check(dist_plan(model_shape(source)))


def test_a_live_writer_s_partial_is_left_alone_and_its_late_rename_refused(llama_dir, tmp_path):
    """Two conversions of one OUT: the second, while the first is stopped mid-way, completes without
    touching the first's partial (its lock is held); the first, resumed, finds OUT made meanwhile,
    leaves it as it is, removes its own partial and says so in one line."""
    out = tmp_path / "out"
    with stopped_mid_way(["to-dist", str(llama_dir), str(out)]) as first:
        [partial] = tmp_path.glob("out.partial-*")
        second = subprocess.run(cli("to-dist", str(llama_dir), str(out)), capture_output=True, text=True, env=env(),
                                cwd=ROOT, timeout=HANG_GUARD_S)
        assert (second.returncode, second.stderr) == (0, "") and partial.is_dir()
        written = {p.name: p.read_bytes() for p in out.iterdir()}
        first.send_signal(signal.SIGCONT)
        _, stderr = first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == 2 and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"error: {out} was made by another process during the conversion")
    assert not partial.exists() and {p.name: p.read_bytes() for p in out.iterdir()} == written


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_what_a_conversion_writes_has_the_modes_of_the_umask(tiny_model_dir, tmp_path, umask):
    """Run files are for the team (store/files.py): 0666 / 0777 less the umask, both ways, although
    safetensors writes its files 0600 and the source's files may have other modes."""
    previous = os.umask(umask)
    try:
        dist = hf_to_dist(tiny_model_dir, tmp_path / "dist")  # a store entry: files 0644 whatever the umask
        back = dist_to_hf(dist, tiny_model_dir, tmp_path / "back")
    finally:
        os.umask(previous)
    for folder in (dist, back):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
        assert modes == dict.fromkeys(modes, oct(0o666 & ~umask)), modes
