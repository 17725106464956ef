"""Before a verl job is submitted: the cluster has the nodes and devices the layout needs (waiting for
nodes that join late, bounded), and every node can read the inputs and write the checkpoints.

A real Ray cluster (`ray.cluster_utils.Cluster`, dashboard on) whose nodes offer the custom `NPU`
resource; nodes are added while the wait is on.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.job_submission import JobSubmissionClient

from backends import backend_for
from backends.base import TrainingInputs, TrainingRun
from common.ray_cluster import ClusterNotReady, NotSharedError, check_paths_on_nodes, wait_for_nodes
from profiles.loader import resolve_profile

STAND_IN = Path(__file__).resolve().parents[1] / "verl_stand_in.py"


@pytest.fixture
def head_only(monkeypatch):
    ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"NPU": 1},
                                                            "include_dashboard": True, "dashboard_port": 0})
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_the_wait_covers_a_node_that_joins_late_and_names_what_never_came(head_only):
    notes: list[str] = []
    outcome: dict = {}
    waiting = threading.Thread(target=lambda: outcome.update(
        ready=wait_for_nodes("NPU", 2, 1, timeout_s=90, note=notes.append, note_every_s=1.0)))
    waiting.start()
    time.sleep(3.0)
    assert waiting.is_alive(), "the wait ended before the second node joined"
    head_only.add_node(num_cpus=1, resources={"NPU": 1})  # Ray starts nodes from the main thread only
    waiting.join(timeout=90)
    assert len(outcome["ready"]) == 2
    assert notes and notes[0].startswith("waiting for the Ray cluster: 1 of the 2 nodes with 1 NPU each are there")

    head_only.add_node(num_cpus=1)  # a node without NPUs: named, with what it offers
    deadline = time.monotonic() + 60
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(ClusterNotReady) as raised:
        wait_for_nodes("NPU", 3, 1, timeout_s=2, note=notes.append)
    message = str(raised.value)
    assert message.startswith("the Ray cluster is not ready after 2 s (cluster.ready_timeout_s=2): 2 of the 3 nodes with "
                              "1 NPU each are there (node ")
    assert message.count(" offers 0 NPU") == 1
    assert "start the missing nodes (ray start --address=<head>:6379 --resources='{\"NPU\": 1}')" in message


def test_every_node_must_read_the_inputs_and_write_the_checkpoints(head_only, tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")
    assert check_paths_on_nodes({}, {"data.root": [str(data)]}, {"--run-dir": [str(tmp_path / "run")]}) == 1
    with pytest.raises(NotSharedError) as raised:
        check_paths_on_nodes({}, {"data.root": [str(tmp_path / "absent.parquet")]}, {"--run-dir": ["/proc/run"]})
    message = str(raised.value)
    assert message.startswith("data.root and --run-dir are not on storage every Ray node shares: node ")
    assert "absent.parquet: it is not there or not readable" in message and "cannot write to /proc/run" in message


def test_train_submits_nothing_to_a_cluster_without_the_nodes_it_needs(head_only, tmp_path):
    profile = resolve_profile("tiny", "npu", "verl", overrides=[
        "cluster.nnodes=2", "cluster.devices_per_node=1", "cluster.ready_timeout_s=2", "trainer.total_training_steps=2",
        f"trainer.entrypoint={sys.executable} {STAND_IN}"])
    run_dir = tmp_path / "short"
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")
    inputs = TrainingInputs(model_path=str(tmp_path), train_files=[str(data)], val_files=[str(data)],
                            checkpoint_dir=str(run_dir / "checkpoints"))
    run = TrainingRun(inputs=inputs, run_dir=str(run_dir), run_name="short", devices_here=0, ray_address=head_only.address)

    class Silent:
        def started(self, *args): ...
        def step(self, metrics): ...
        def note(self, message): ...
        def output(self, line): ...

    with pytest.raises(ClusterNotReady, match=r"1 of the 2 nodes with 1 NPU each are there"):
        backend_for("verl").train(profile, run, Silent())
    assert [job for job in JobSubmissionClient(head_only.address).list_jobs() if job.submission_id] == []
    assert not (run_dir / "verl" / "job.json").exists()
