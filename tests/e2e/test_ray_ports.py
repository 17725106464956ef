"""Two Rays on one host (issue 44): every Ray the project or its tests start takes free ports for all
its services, and a port clash is named in one line.

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_ray_ports.py

A node started without ports binds its dashboard agent to 52365, Ray's one fixed default: the second
Ray on the host found it taken ("Agent port #52365 failed to bind after 6 attempts"), and every job
submitted to it answered "No available agent to submit job" until the verl-job tests' 300 s bound.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_pipeline.cluster.ray_cluster import FREE_PORTS

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
AGENT_DEFAULT_PORT = 52365
# The flow's local Ray, started as the train stage starts it; it says when it is up, then waits.
LOCAL_RAY = """
import time
from grpo_pipeline.cluster.ray_cluster import connect_ray
connect_ray(None, None)
print("up", flush=True)
time.sleep(600)
"""
# A job that needs the cluster's agent: the job API hands every submission to it.
JOB = [sys.executable, "-c", "print('the job ran')"]


def _hold(port: int) -> socket.socket | None:
    """Listen on `port`, as another Ray's agent would; None when something already does."""
    holder = socket.socket()
    try:
        holder.bind(("0.0.0.0", port))
    except OSError:
        holder.close()
        return None
    holder.listen()
    return holder


def test_a_cluster_started_beside_another_ray_takes_jobs(tmp_path):
    holder = _hold(AGENT_DEFAULT_PORT)  # another Ray's agent on this host
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    local = subprocess.Popen([sys.executable, "-c", LOCAL_RAY], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    cluster = None
    try:
        assert local.stdout.readline().strip() == "up", "the flow's local Ray did not start beside another"
        from ray.cluster_utils import Cluster

        # As the verl-job tests start theirs (tests/verl_cluster.py): a head with its dashboard (the job API).
        cluster = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 1, "include_dashboard": True})
        from ray.job_submission import JobStatus

        from grpo_pipeline.backends.verl.job_api import job_client

        client = job_client(cluster.address)  # the job API the verl backend submits to
        deadline = time.monotonic() + 120  # the agent registers within seconds; a bound on a hang only
        while True:
            try:
                job = client.submit_job(entrypoint=shlex.join(JOB))
                break
            except RuntimeError as exc:
                assert "No available agent" in str(exc) and time.monotonic() < deadline, str(exc)
                time.sleep(2)
        while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            assert time.monotonic() < deadline + 120, "the job did not end"
            time.sleep(1)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED, client.get_job_logs(job)[-2000:]
        assert "the job ran" in client.get_job_logs(job)
    finally:
        if cluster is not None:
            cluster.shutdown()
        local.kill()
        local.wait()
        if holder is not None:
            holder.close()


CLASH = """
import os, socket
holder = socket.socket()
holder.bind(("0.0.0.0", 0))
holder.listen()
os.environ["RAY_GCS_SERVER_PORT"] = str(holder.getsockname()[1])  # a port the user gave Ray, already taken
print(holder.getsockname()[1], flush=True)
from grpo_pipeline.cluster.ray_cluster import connect_ray
try:
    connect_ray(None, None)
except Exception as exc:
    print(type(exc).__name__, exc, sep="|")
"""


def test_a_port_clash_is_named_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", CLASH], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    port, said = done.stdout.splitlines()[0], done.stdout.splitlines()[-1]
    kind, message = said.split("|", 1)
    assert kind == "RayStartError" and "\n" not in message
    assert message.startswith(f"the local Ray could not start: port {port} is already in use by pid ")
    assert message.endswith("; unset RAY_GCS_SERVER_PORT so Ray picks a free port")


JOINS = """
import ray
from ray.cluster_utils import Cluster
from grpo_pipeline.cluster import ray_cluster as rc

other = Cluster(initialize_head=True, head_node_args={**rc.FREE_PORTS, "num_cpus": 1})
ray.init(address=other.address)  # opened by the code around the run (a notebook, a test left it)
rc.connect_ray(None, None)
print("foreign kept", ray.get_runtime_context().gcs_address == other.address, rc.joined_by_connect_ray())
try:
    rc.check_room({"CPU": 2}, 1)
except rc.ClusterTooSmall as exc:
    print("refused|" + str(exc))
rc.check_room({"CPU": 1}, 1)
ray.shutdown()
rc.connect_ray(other.address, None)  # an earlier run's cluster, joined by connect_ray
print("joined", rc.joined_by_connect_ray())
rc.connect_ray(None, None)  # this run asks for a Ray of its own
print("switched", ray.get_runtime_context().gcs_address != other.address, rc.joined_by_connect_ray())
ray.shutdown()
other.shutdown()
"""


def test_a_run_joins_the_ray_it_asks_for_and_refuses_one_too_small_in_one_line(tmp_path):
    # A connection some other code left open is used as it is (a notebook's ray.init), but one that can never
    # hold the workers is refused at once: a suite's run joined a 1-CPU Ray another test had left, asked Ray
    # Train for 2 CPUs, and waited 60 s a try. A connection an earlier run made for another target is left.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", JOINS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines[0] == "foreign kept True False"
    kind, message = lines[1].split("|", 1)
    assert message.startswith("the joined Ray offers 1 CPU in all, the training workers need 2 CPU (1 x 2): add nodes")
    assert lines[2:] == ["joined True", "switched True True"]
