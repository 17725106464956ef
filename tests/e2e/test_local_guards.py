"""The guards on the local backend, each proven on its fault injected through the real training path
(TRL's GRPOTrainer on a Ray Train worker, the command line as a user runs it), and shown to be what
catches it: the same run with that guard off exits 0 with the fault unnoticed.

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_local_guards.py

Faults reach the workers through Ray's worker_process_setup_hook (tests/worker_faults.py). The module's
runs share one local Ray (`local_ray`), started once: each joins it with its faults as a job of its own,
and Ray gives a job's runtime_env to that job's workers only. The guarded run is the command line in a
process of its own, as a user runs it; the same run with the guard off is the command line in this process
(what it is asked for is its exit code and its run folder).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from grpo_pipeline.backends.guards import GuardTripped
from grpo_pipeline.backends.local.checkpoints import latest_step
from grpo_pipeline.backends.local.driver import train_local
from grpo_pipeline.backends.local.settings import plan_local_training
from grpo_pipeline.backends.metrics import read_metrics
from grpo_pipeline.cluster.ray_cluster import FREE_PORTS
from grpo_pipeline.flows.grpo import main as command_line
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
from grpo_pipeline.stages.model import ModelSpec, prepare_model
from stage_retry import like_the_stage
from tracker_readers import tensorboard_scalars
from worker_faults import join

pytestmark = pytest.mark.e2e
TESTS = Path(__file__).resolve().parents[1]
LEARNABLE = f"{TESTS / 'learnable_reward.py'}:digit_share"


@pytest.fixture(scope="module")
def local_ray():
    """The module's local Ray, as `ray.init(address="local")` would start it for one run (the host's CPUs, no
    dashboard), started once: a start takes 5-9 s on 2 cores, and every run here used to start its own."""
    ray.shutdown()  # whatever an earlier test joined: this module's runs join this one
    head = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": os.cpu_count(), "include_dashboard": False})
    yield head.address
    ray.shutdown()
    head.shutdown()


def _args(world, tmp_path: Path, name: str, settings: list[str]) -> list[str]:
    """The command line for the tiny model on one CPU worker, against the session's Prefect API and stores
    (`world`)."""
    stores = world[1]
    return ["--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path), "--run-name", name,
            "--stages", "fetch_dataset,prepare_checkpoint,train,report",
            *(arg for item in [*stores, "cluster.devices_per_node=1", *settings] for arg in ("--set", item))]


def _env(world, tmp_path: Path) -> dict[str, str]:
    return {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": world[0]}


def _run(world, local_ray, tmp_path: Path, name: str, settings: list[str], **fault_env) -> subprocess.CompletedProcess:
    """The command line as a user runs it, in a process of its own that joins the module's Ray with the faults
    first (tests/worker_faults.py)."""
    return subprocess.run(
        [sys.executable, str(TESTS / "worker_faults.py"), local_ray, *(f"{k}={v}" for k, v in fault_env.items()), "--",
         *_args(world, tmp_path, name, settings)],
        capture_output=True, text=True, env={**os.environ, **_env(world, tmp_path)}, timeout=1800)


def _run_here(world, local_ray, tmp_path: Path, name: str, settings: list[str], **fault_env) -> int:
    """The same command line in this process, which joins the module's Ray with the faults first: its exit code.
    Its output goes to pytest's capture of the session, never to `capsys`: Prefect binds its console handler
    to the stderr of the process's first flow run, and a test's `capsys` is closed when the test ends."""
    os.environ.update(_env(world, tmp_path))  # put back after the test (tests/e2e/conftest.py: restore_environ)
    join(local_ray, **fault_env)
    try:
        return command_line(_args(world, tmp_path, name, settings))
    finally:
        ray.shutdown()


def _report(run_dir: Path) -> str:
    """A run's report, for an assertion's message."""
    return (run_dir / "report.md").read_text() if (run_dir / "report.md").is_file() else f"no report in {run_dir}"


# Prefect's own words as the process exits, still sending events to the session's API (a loaded machine):
# they may follow the command line's last line, and are not the command line's.
PREFECT_DRAINING = re.compile(r"\| WARNING +\| \w+ - Still processing items: \d+ items remaining\.\.\.$")


def _said(done: subprocess.CompletedProcess) -> str:
    """The command line's last line: what the user is told."""
    return [line for line in done.stderr.strip().splitlines() if not PREFECT_DRAINING.search(line)][-1]


def _trip(run_dir: Path) -> dict:
    return json.loads((run_dir / "guards.json").read_text())


def test_a_weight_sync_that_leaves_the_rollouts_on_old_weights_is_stopped(world, local_ray, tmp_path):
    """The native decoder's copy of q/k/v and gate/up is made once and never refreshed: from the second
    round the rollouts come from a policy the trainer left behind."""
    settings = ["generation.decoder=native", f"reward.functions=[{LEARNABLE}]", "algorithm.lr=0.005",
                "trainer.total_training_steps=6", "trainer.save_freq=2", "tracking.trackers=[tensorboard]"]
    stopped = _run(world, local_ray, tmp_path, "stale", settings, FAULT_STALE_ROLLOUT_WEIGHTS=1)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    line = _said(stopped)
    assert line.startswith("error: the run failed: GuardTripped: step 4: rollout vs trainer log-prob mismatch "), line
    assert "rollouts are not using the trained weights" in line and "kept: checkpoint global_step_4" in line
    run_dir = tmp_path / "stale"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert records[0].mismatch < 1e-8 and all(r.mismatch > 1e-4 for r in records[1:])  # the threshold on a CPU
    assert _trip(run_dir)["guard"] == "rollout_mismatch"
    report = (run_dir / "report.md").read_text()
    assert "**The run failed.** Stage `train`: GuardTripped: step 4: rollout vs trainer" in report
    assert "**Stopped by the `rollout_mismatch` guard**" in report and "](guards.png)" in report
    scalars = tensorboard_scalars(run_dir / "tensorboard")  # the tracker heard it, at the step it stopped at
    assert scalars["guard/rollout_mismatch"] == [(4, 1.0)] and len(scalars["train/mismatch"]) == 4

    unnoticed = _run_here(world, local_ray, tmp_path, "stale-off", [*settings, "guards.rollout_mismatch=off"],
                          FAULT_STALE_ROLLOUT_WEIGHTS=1)
    assert unnoticed == 0, _report(tmp_path / "stale-off")
    records = read_metrics(tmp_path / "stale-off" / "metrics.jsonl")
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6] and all(r.mismatch > 1e-4 for r in records[1:])


def test_a_reward_that_returns_a_constant_is_stopped(world, local_ray, tmp_path):
    constant = [f"reward.functions=[{TESTS / 'constant_reward.py'}:always_one]", "trainer.total_training_steps=6",
                "guards.reward_collapse_steps=3"]
    stopped = _run(world, local_ray, tmp_path, "constant", constant)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert ("GuardTripped: step 3: every group's rewards were constant in each of the last 3 steps (mean reward 1.0): "
            "zero advantage everywhere, nothing is learned") in _said(stopped)
    # The workers stop themselves before step 4's rollout, however little of the records the flow has read.
    records = read_metrics(tmp_path / "constant" / "metrics.jsonl")
    assert [(r.step, r.zero_advantage_share) for r in records] == [(1, 1.0), (2, 1.0), (3, 1.0)], records

    unnoticed = _run_here(world, local_ray, tmp_path, "constant-off", [*constant, "guards.reward_collapse_steps=off"])
    assert unnoticed == 0, _report(tmp_path / "constant-off")
    assert len(read_metrics(tmp_path / "constant-off" / "metrics.jsonl")) == 6


def _weights_finite(step_dir: Path) -> bool:
    return all(bool(tensor.isfinite().all()) for tensor in load_file(step_dir / "model.safetensors").values())


def test_a_nan_in_the_loss_stops_at_once_and_keeps_the_last_good_checkpoint(world, local_ray, tmp_path):
    """The last step's loss is NaN: with the guard off the run exits 0 with a NaN policy. (A NaN earlier
    fails the next step's sampling, `probability tensor contains either inf, nan`, and each retry resumes
    from the poisoned checkpoint the step saved.)"""
    settings = ["trainer.total_training_steps=4", "trainer.save_freq=1"]
    stopped = _run(world, local_ray, tmp_path, "nan", settings, FAULT_NAN_LOSS_FROM_STEP=4)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "GuardTripped: step 4: non-finite loss nan, grad norm nan" in _said(stopped)
    checkpoints = tmp_path / "nan" / "checkpoints"
    # save_freq=1 and the last step (always saved), yet step 4 was not: the workers stop before its checkpoint
    assert sorted(p.name for p in checkpoints.glob("global_step_*")) == [f"global_step_{n}" for n in (1, 2, 3)]
    assert latest_step(checkpoints) == 3 and _weights_finite(checkpoints / "global_step_3")
    assert _trip(tmp_path / "nan")["kept"] == "checkpoint global_step_3, the latest"

    unnoticed = _run_here(world, local_ray, tmp_path, "nan-off", [*settings, "guards.non_finite=off"],
                          FAULT_NAN_LOSS_FROM_STEP=4)
    assert unnoticed == 0, _report(tmp_path / "nan-off")  # and its policy is NaN
    final = tmp_path / "nan-off" / "checkpoints" / "global_step_4"
    assert latest_step(final.parent) == 4 and not _weights_finite(final)
    assert math.isnan(read_metrics(tmp_path / "nan-off" / "metrics.jsonl")[-1].loss)


@pytest.fixture(scope="module")
def data_24(tmp_path_factory) -> Path:
    """The data store of the runs below (their 24 training rows), prepared once."""
    return tmp_path_factory.mktemp("data-24")


def _settings(run_root: Path, data_root: Path, model_store: Path, run: str, *overrides: str):
    """24 training rows, 8 prompts a step: 3 steps an epoch, 3 epochs, a checkpoint every 2 steps (the tiny
    model from the session's store)."""
    profile = resolve_profile("tiny", "cpu", overrides=[
        "cluster.devices_per_node=1", f"data.root={data_root}", f"model.root={model_store}",
        "data.arith_train_rows=24", "trainer.total_training_steps=null", "trainer.total_epochs=3", "trainer.save_freq=2",
        *overrides])
    data = fetch_dataset(DataSpec.from_profile(profile.data))
    model = prepare_model(ModelSpec.from_profile(profile.model))
    return plan_local_training(profile, data.train_files, model.path, run_root / run, devices_here=1,
                               generation=plan_generation(profile))


def _attempt(local_ray: str, settings, batches: Path, on_start=lambda max_steps, resumed_from: None, **fault_env):
    """One training attempt on the module's Ray with these faults, its batches observed into `batches` (Ray's
    cleaner race retried, as the stage would: tests/stage_retry.py)."""
    def once():
        join(local_ray, OBSERVE_BATCHES=batches, **fault_env)
        try:
            return train_local(settings, None, None, on_start=on_start)
        finally:
            ray.shutdown()

    return like_the_stage(once)


def _train(local_ray: str, settings, batches: Path, started: list | None = None, **fault_env):
    """Train to the end; `started` hears the step each attempt resumed from."""
    started = [] if started is None else started
    return _attempt(local_ray, settings, batches, lambda max_steps, resumed_from: started.append(resumed_from),
                    **fault_env)


def _batches(path: Path) -> dict[int, list[str]]:
    """The prompts each step trained on, the last time it was trained."""
    return {entry["step"]: entry["prompts"] for entry in map(json.loads, path.read_text().splitlines())}


def _crash(local_ray: str, settings, batches: Path, step: int, **fault_env) -> None:
    """A worker lost at `step`: the attempt ends (it would be retried) with its checkpoints."""
    with pytest.raises(Exception, match=rf"training stopped: RuntimeError: injected crash at step {step}"):
        _attempt(local_ray, settings, batches, FAULT_CRASH_AT_STEP=step, **fault_env)


@pytest.fixture(scope="module")
def crashed_at_5(local_ray, data_24, model_store, tmp_path_factory) -> Path:
    """A run that lost its worker at step 5, its latest checkpoint step 4 (mid-epoch 2), and the batches it
    trained on: the resume below carries it on, the test of a lost trainer state damages it, each in a copy
    of its own (one crash, not two: a training attempt is ~20 s of Ray Train and worker start-up)."""
    root = tmp_path_factory.mktemp("crashed-at-5")
    settings = _settings(root, data_24, model_store, "crashed")
    _crash(local_ray, settings, root / "crashed.jsonl", 5)
    assert latest_step(settings.checkpoints) == 4
    return root


def _copy_of(crashed: Path, tmp_path: Path, run: str) -> None:
    """The crashed run's folder and batches as run `run` of this test."""
    shutil.copytree(crashed / "crashed", tmp_path / run)
    shutil.copy(crashed / "crashed.jsonl", tmp_path / f"{run}.jsonl")


def test_a_resume_continues_the_data_where_it_stopped_mid_epoch_and_at_an_epoch_boundary(
        local_ray, crashed_at_5, data_24, tmp_path, model_store):
    whole = _settings(tmp_path, data_24, model_store, "whole")
    assert _train(local_ray, whole, tmp_path / "whole.jsonl").steps_done == 9
    expected = _batches(tmp_path / "whole.jsonl")
    assert len(expected) == 9 and expected[1] != expected[4] != expected[7]  # three epochs, each in its own order

    _copy_of(crashed_at_5, tmp_path, "resumed")  # lost at step 5: resumed from step 4, mid-epoch 2
    resumed = _settings(tmp_path, data_24, model_store, "resumed")
    batches = tmp_path / "resumed.jsonl"
    _crash(local_ray, resumed, batches, 7)
    assert latest_step(resumed.checkpoints) == 6  # step 6 ends epoch 2
    started = []
    assert _train(local_ray, resumed, batches, started).steps_done == 9
    assert started[0] == 6
    seen = _batches(batches)
    assert seen[5] == expected[5] and seen[7] == expected[7]  # the first batch after each resume
    assert seen == expected

    # Before (TRL's own sampler): the run resumed at the epoch boundary trains its first epoch's order
    # again, and says nothing.
    before = _settings(tmp_path, data_24, model_store, "trl-sampler")
    batches = tmp_path / "trl-sampler.jsonl"
    _crash(local_ray, before, batches, 7, FAULT_TRL_SAMPLER=1)
    assert _train(local_ray, before, batches, FAULT_TRL_SAMPLER=1).steps_done == 9  # exit 0
    replayed = _batches(batches)
    assert [replayed[n] for n in (7, 8, 9)] == [replayed[n] for n in (1, 2, 3)]


def test_a_checkpoint_without_its_trainer_state_is_not_resumed_from(crashed_at_5, data_24, tmp_path, model_store):
    """transformers takes the step, and so the batches to skip, from it: refused in one line, never retried
    (transformers itself fails with a FileNotFoundError the train stage would retry twice)."""
    _copy_of(crashed_at_5, tmp_path, "lost")
    lost = _settings(tmp_path, data_24, model_store, "lost")
    (lost.checkpoints / "global_step_4" / "trainer_state.json").unlink()
    with pytest.raises(GuardTripped, match=r"cannot resume from checkpoint global_step_4: it has no trainer_state.json, "
                                           "so the resumed run would start the data over"):
        train_local(lost, None, None)
