"""The verl job path under crashes, on a real 2-node Ray cluster: the flow process killed outright
mid-job and run again, and the cluster's head killed outright mid-job.

The flow runs as a user runs it (`python -m grpo_pipeline`, a subprocess, with the session's Prefect API
and stores: neither is what is tested), the job as the stand-in entrypoint (tests/verl_stand_in.py), held
before a step by its gate file, so each kill lands mid-job whatever the machine's load.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import ray

from grpo_pipeline.backends.verl.job import LOST, read_record
from verl_cluster import EVENT_WAIT_S, flow_process, npu_cluster, steps_in, submissions, wait_for


def _verl_steps(run_dir: Path) -> list[int]:
    """The training steps in verl's own file-logger JSONL of each attempt."""
    return [entry["step"] for path in sorted((run_dir / "verl").glob("metrics-*.jsonl"))
            for entry in map(json.loads, path.read_text().splitlines()) if "critic/score/mean" in entry["data"]]


@pytest.fixture
def own_cluster():
    """A standard cluster of the test's own: the test kills its head."""
    ray.shutdown()
    made = npu_cluster()
    yield made
    made.shutdown()


def test_a_flow_killed_mid_job_and_run_again_records_every_step_once(world, cluster, jobs, gate, tmp_path):
    """kill -9 of the flow at step 2; the job goes on to step 12 alone; the flow runs again and
    follows it (the steps it missed first), is killed again, and runs once more after the job ended.
    (The session's standard cluster: killing the flow leaves the cluster as it was.)"""
    (api_url, stores), run_dir = world, tmp_path / "killed"
    gate.write_text("2")
    settings = (f"env.STAND_IN_GATE={gate}", "trainer.total_training_steps=20")
    flow = flow_process(cluster.address, tmp_path, "killed", *settings, stores=stores, api_url=api_url)
    wait_for(lambda: steps_in(run_dir / "metrics.jsonl") == [1, 2], "steps 1-2 in metrics.jsonl", process=flow)
    flow.send_signal(signal.SIGKILL)
    flow.wait()
    gate.write_text("12")
    wait_for(lambda: 12 in _verl_steps(run_dir), "step 12 in verl's file")

    again = flow_process(cluster.address, tmp_path, "killed", *settings, stores=stores, api_url=api_url)
    wait_for(lambda: 12 in steps_in(run_dir / "metrics.jsonl"), "step 12 in metrics.jsonl", process=again)
    gate.write_text("14")
    wait_for(lambda: 14 in steps_in(run_dir / "metrics.jsonl"), "step 14 in metrics.jsonl", process=again)
    again.send_signal(signal.SIGKILL)
    output = again.communicate()[0]
    assert "following the run's Ray job grpo-killed-" in output and "(attempt 1, running)" in output
    assert re.search(r"steps 3-12 trained while no flow followed Ray job grpo-killed-\S+: recorded", output), output[-3000:]
    assert steps_in(run_dir / "metrics.jsonl") == list(range(1, 15))

    gate.write_text("20")
    (job,) = submissions(jobs, "killed")
    wait_for(lambda: jobs.get_job_status(job.submission_id) == "SUCCEEDED", "the job's end")
    last = flow_process(cluster.address, tmp_path, "killed", *settings, stores=stores, api_url=api_url)
    output = last.communicate(timeout=EVENT_WAIT_S)[0]
    assert last.returncode == 0, output[-3000:]
    assert "steps 15-20 trained while no flow followed" in output
    assert steps_in(run_dir / "metrics.jsonl") == list(range(1, 21)) == _verl_steps(run_dir)
    assert len(submissions(jobs, "killed")) == 1
    assert "](reward_curve.png)" in (run_dir / "report.md").read_text()


def test_a_lost_head_ends_the_run_with_a_report_naming_the_cluster(world, own_cluster, gate, tmp_path):
    """kill -9 of every process of the head mid-job: the run ends with one line that names the cluster,
    its last step and how to resume, in the report too; the job record says LOST; Ray's core does not
    abort the flow process; a run again while the head is down is refused at once."""
    (api_url, stores), cluster, run_dir = world, own_cluster, tmp_path / "headless"
    gate.write_text("4")
    flow = flow_process(cluster.address, tmp_path, "headless", f"env.STAND_IN_GATE={gate}",
                        "trainer.total_training_steps=20", stores=stores, api_url=api_url)
    wait_for(lambda: 4 in steps_in(run_dir / "metrics.jsonl"), "step 4 in metrics.jsonl", process=flow)
    for infos in cluster.head_node.all_processes.values():
        for info in infos:
            info.process.send_signal(signal.SIGKILL)
    output = flow.communicate(timeout=EVENT_WAIT_S)[0]
    expected = f"the Ray cluster at {cluster.address} stopped answering (its job API at http://"
    (error,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert flow.returncode == 2 and error.startswith(f"error: {expected}"), output[-3000:]
    assert ("the run's last step is 4, its latest checkpoint step 4; once the cluster is back, run the flow again with "
            "--run-name headless to resume from step 4") in error
    assert "The program will terminate" not in output and "already complete" not in output
    assert expected in (run_dir / "report.md").read_text()
    assert read_record(run_dir).status == LOST

    again = flow_process(cluster.address, tmp_path, "headless", "trainer.total_training_steps=20", stores=stores,
                         api_url=api_url)
    refused = again.communicate(timeout=EVENT_WAIT_S)[0]
    (error,) = [line for line in refused.splitlines() if line.startswith("error: ")]
    assert again.returncode == 2 and "Traceback" not in refused
    assert error.startswith(f"error: --ray-address: cannot reach the Ray cluster at {cluster.address}"), refused[-2000:]
