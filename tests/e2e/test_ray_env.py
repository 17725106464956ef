"""The run's environment reaches Ray workers on other nodes: a real 2-node local Ray cluster whose
second node starts from a shell that lacks the run's variables (and has a proxy of its own)."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster

from grpo_pipeline.cluster.ray_cluster import FREE_PORTS

from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.stages.environment import PROXY_VARS, resolve_environment


@pytest.fixture
def two_node_cluster(monkeypatch):
    ray.shutdown()  # whatever an earlier test of this process joined: this test joins its own cluster
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("http_proxy", "http://driver-proxy:3128")  # the messy launching shell
    cluster = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 1, "resources": {"head": 1}})
    # Node 2: a fresh shell without the run's variables, but with a node-local proxy exported.
    for name in [n for n in os.environ if n.startswith(("HCCL_", "TASK_QUEUE", "VLLM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HTTPS_PROXY", "http://node2-proxy:3128")
    cluster.add_node(num_cpus=1, resources={"node2": 1})
    monkeypatch.delenv("HTTPS_PROXY")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_worker_on_second_node_sees_the_run_env_and_no_proxy(two_node_cluster):
    profile = resolve_profile("qwen3.5-122b-a10b", "npu", overrides=["proxy_policy=clear"])
    env = resolve_environment(profile, environ=dict(os.environ), ray_address=two_node_cluster.address)
    assert env.worker_env["HCCL_CONNECT_TIMEOUT"] == "5400"

    ray.init(address=two_node_cluster.address, runtime_env=env.ray_runtime_env())

    @ray.remote(num_cpus=1, resources={"node2": 1})
    def environment_of_worker():
        return dict(os.environ), ray.get_runtime_context().get_node_id()

    seen, node_id = ray.get(environment_of_worker.remote())
    head_id = ray.get_runtime_context().get_node_id()
    assert node_id != head_id, "the task must run on the second node"
    for name, value in env.worker_env.items():
        assert seen.get(name) == value, name
    assert seen["HCCL_CONNECT_TIMEOUT"] == "5400" and seen["HCCL_BUFFSIZE"] == "300"
    assert seen["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert not any(seen.get(name) for name in PROXY_VARS), {n: seen.get(n) for n in PROXY_VARS}
