"""The guards on the verl backend: its faults injected at verl's process boundary (tests/verl_stand_in.py
on a real 2-node Ray cluster), the command line as a user runs it, and the same run with the guard off
exiting 0 with the fault unnoticed. A test's two runs share only the cluster (their run names, folders and
jobs differ); they run one after the other (started together, on 2 cores beside the suite's other process,
they took a browser test's cancel past its bounds).

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_verl_guards.py
"""

from __future__ import annotations

import json

import pytest

from grpo_pipeline.backends.metrics import read_metrics
from grpo_pipeline.backends.verl.follow import tracker_step
from grpo_pipeline.backends.verl.job import read_record
from verl_cluster import EVENT_WAIT_S, FlowProcess, flow_process, submissions

pytestmark = pytest.mark.e2e
NCCL_TIMEOUT = "RuntimeError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9) ran for 600012 ms"
# 24 of the 1024 rows kept by verl's filter: 3 steps an epoch, 2 epochs; a checkpoint at the epoch's end.
SHORT_EPOCHS = ["env.STAND_IN_DROP_ROWS=1000", "trainer.total_training_steps=null", "trainer.total_epochs=2",
                "trainer.save_freq=3"]


@pytest.fixture
def launch(world, cluster, tmp_path):
    """`launch(name, *overrides)` starts the command line against the cluster, with the session's Prefect API
    and stores (`world`); a run still going when the test ends (it failed first) is killed."""
    api_url, stores = world
    launched: list[FlowProcess] = []

    def start(name: str, *overrides: str) -> FlowProcess:
        launched.append(flow_process(cluster.address, tmp_path, name, *overrides, stores=stores, api_url=api_url))
        return launched[-1]

    yield start
    for process in launched:
        if process.poll() is None:
            process.kill()
            process.wait()


def _ended(process: FlowProcess) -> tuple[int, str]:
    output, _ = process.communicate(timeout=3 * EVENT_WAIT_S)
    return process.returncode, output


def _error_line(output: str) -> str:
    return next(line for line in reversed(output.splitlines()) if line.startswith("error: "))


def test_a_resume_at_an_epoch_boundary_that_ends_training_early_fails_the_run(launch, jobs, tmp_path):
    """Attempt 1 saves step 3 (the first epoch's end) and loses a worker at step 4; attempt 2 resumes at the
    boundary, finds its dataloader exhausted and exits 0 having trained nothing (verl #7401)."""
    fault = [*SHORT_EPOCHS, "env.STAND_IN_FAIL_AT_STEP=4", f"env.STAND_IN_FAIL_TEXT={NCCL_TIMEOUT}",
             "env.STAND_IN_EPOCH_BOUNDARY_BUG=1"]
    guarded = launch("boundary", *fault)
    code, output = _ended(guarded)
    assert code == 1, output[-3000:]
    line = _error_line(output)
    assert line.startswith("error: the run failed: GuardTripped: verl job grpo-boundary-"), line
    assert "exited 0 at step 3 of the 6 it planned: training ended early and silently" in line
    assert [job.status for job in sorted(submissions(jobs, "boundary"), key=lambda j: j.metadata["attempt"])] == [
        "FAILED", "SUCCEEDED"]
    assert json.loads((tmp_path / "boundary" / "guards.json").read_text())["guard"] == "short_run"
    assert read_record(tmp_path / "boundary").final_step is None  # not finished: a later run resumes it

    unguarded = launch("boundary-off", *fault, "guards.short_run=off")
    code, output = _ended(unguarded)
    assert code == 0, output[-3000:]
    train = json.loads((tmp_path / "boundary-off" / "train.json").read_text())
    assert (train["steps_done"], train["already_complete"]) == (3, True)  # "complete", 3 of verl's 6 steps


def test_a_resume_from_a_checkpoint_without_its_dataloader_state_is_refused(launch, jobs, tmp_path):
    fault = ["env.STAND_IN_NO_DATALOADER_STATE=1", "env.STAND_IN_FAIL_AT_STEP=3", f"env.STAND_IN_FAIL_TEXT={NCCL_TIMEOUT}"]
    guarded = launch("no-data", *fault)
    code, output = _ended(guarded)
    assert code == 1, output[-3000:]
    assert _error_line(output).endswith(
        "GuardTripped: cannot resume from checkpoint global_step_2: it has no dataloader state (data.pt), which verl "
        "only warns about, so the resumed run would start the data over instead of continuing where it stopped "
        "(guards.data_position=off to run on); kept: checkpoint global_step_2, the latest; see "
        f"{tmp_path / 'no-data' / 'report.md'} for where")
    assert len(submissions(jobs, "no-data")) == 1  # the resume was never submitted

    unguarded = launch("no-data-off", *fault, "guards.data_position=off")
    code, output = _ended(unguarded)
    assert code == 0, output[-3000:]
    assert "No dataloader state found at " in output and "will start from scratch" in output  # all the user saw


def test_a_nan_stops_the_job_through_rays_job_api_and_sets_aside_the_step_verl_saved(launch, jobs, gate, tmp_path):
    """verl saves step 4 before it logs the step's NaN: that checkpoint is set aside, the tracker points
    back at step 2, and the job (still running: held before step 5 by its gate) is stopped."""
    gate.write_text("4")
    guarded = launch("nan", "env.STAND_IN_NAN_AT_STEP=4", f"env.STAND_IN_GATE={gate}")
    code, output = _ended(guarded)
    assert code == 1, output[-3000:]
    line = _error_line(output)
    assert "GuardTripped: step 4: non-finite loss nan, grad norm nan" in line
    assert "kept: checkpoint global_step_2; poisoned-global_step_4" in line
    (job,) = submissions(jobs, "nan")
    assert job.status == "STOPPED" and read_record(tmp_path / "nan").status == "STOPPED"
    checkpoints = tmp_path / "nan" / "checkpoints"
    assert tracker_step(checkpoints) == 2 and (checkpoints / "poisoned-global_step_4").is_dir()
    assert not (checkpoints / "global_step_4").exists()
    assert [r.step for r in read_metrics(tmp_path / "nan" / "metrics.jsonl")][-1] == 4
    assert "**Stopped by the `non_finite` guard**" in (tmp_path / "nan" / "report.md").read_text()

    unguarded = launch("nan-off", "env.STAND_IN_NAN_AT_STEP=4", "guards.non_finite=off")
    code, output = _ended(unguarded)
    assert code == 0, output[-3000:]  # the poisoned step 4 and the steps after it are the run's policy
    assert tracker_step(tmp_path / "nan-off" / "checkpoints") == 6
