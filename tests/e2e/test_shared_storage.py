"""A dataset on storage one Ray node cannot see is caught before training, and that node is named.

The second node is a real `ray start` in its own mount namespace, with an empty tmpfs mounted over
the data root: what a worker whose machine does not mount the shared filesystem sees.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from grpo_pipeline.cluster.ray_cluster import FREE_PORTS

from grpo_pipeline.profiles.schema import DataSection
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
from grpo_pipeline.cluster.node_tasks import NotSharedError, check_visible_on_nodes

RAY_CLI = Path(sys.executable).with_name("ray")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture
def cluster_with_a_blind_node(tmp_path, monkeypatch):
    if not _can_unshare():
        pytest.fail("this test needs `unshare -m` (root, util-linux) to give a Ray node its own mounts")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    hidden = tmp_path / "head-only"
    hidden.mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 1})
    node = subprocess.Popen(
        [
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs tmpfs "{hidden}" && exec "{RAY_CLI}" start --address={cluster.address} '
            "--num-cpus=1 --dashboard-agent-listen-port=0 --block",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    ray.init(address=cluster.address)
    deadline = time.monotonic() + 90
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        assert node.poll() is None and time.monotonic() < deadline, "the second Ray node did not join"
        time.sleep(0.5)
    yield hidden
    ray.shutdown()
    os.killpg(node.pid, signal.SIGTERM)
    node.wait(timeout=60)
    cluster.shutdown()


def test_the_check_names_the_node_that_cannot_see_the_data(cluster_with_a_blind_node, tmp_path):
    visible_everywhere = fetch_dataset(DataSpec.from_profile(DataSection(root=str(tmp_path / "shared"))))
    assert check_visible_on_nodes([Path(visible_everywhere.path)], "data.root") == 2

    head_only = fetch_dataset(DataSpec.from_profile(DataSection(root=str(cluster_with_a_blind_node))))
    with pytest.raises(NotSharedError) as raised:
        check_visible_on_nodes([Path(head_only.path)], "data.root")
    message = str(raised.value)
    assert message.startswith("data.root is not on storage every Ray node shares: node ")
    assert message.count("cannot see") == 1 and "manifest.json is missing" in message
    assert message.endswith("set data.root to a path all nodes mount (e.g. NFS)")
