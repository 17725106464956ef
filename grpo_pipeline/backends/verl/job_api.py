"""Ray's job API, as the verl backend uses it: a client found without a Ray core client, submit, stop, status.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --ray-address head:6379

The job API is the head's dashboard (http://host:port). For a GCS address its URL is read from the
GCS over gRPC (cluster/ray_address.py `job_api_url`): Ray's own client would look it up through a Ray
core client that stays in the process, and a Ray core client connected to a head that dies aborts
its process a minute later.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from grpo_pipeline.backends.verl.job import TERMINAL, JobSpec
from grpo_pipeline.cluster.ray_cluster import RAY_CONNECT_TIMEOUT_VAR, ClusterNotReady, answer_timeout_s
from grpo_pipeline.cluster.ray_address import cluster_address, job_api_url

STOP_WAIT_S = 60.0
API_SERVER_VAR = "RAY_API_SERVER_ADDRESS"
NO_AGENT, AGENT_RETRY_S = "No available agent to submit job", 2.0
DEFAULT_AGENT_PORT = 52365  # ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT, for a node started without one


def job_client(address: str | None):
    """Ray's job API for the cluster at `address` (GCS, ray:// or the dashboard's http address)."""
    from ray.job_submission import JobSubmissionClient

    try:
        url = job_api_url(address)
        if url is None:
            raise ValueError("the head runs no dashboard")
        # Ray's client takes RAY_API_SERVER_ADDRESS, else RAY_ADDRESS (a deployment's GCS address: looked up
        # through a Ray core client that stays), over the address it is given: this one is meant.
        with _env_default(API_SERVER_VAR, url):
            return JobSubmissionClient(url)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterNotReady(
            f"the Ray cluster at {cluster_address(address)[0]} has no job API answering "
            f"({str(exc).splitlines()[0]}); start the head with its dashboard (ray start --head --include-dashboard=true)"
        ) from None


@contextmanager
def _env_default(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` for the duration, unless it is set already."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def submit(client, spec: JobSpec) -> bool:
    """Submit `spec`; False when a job of that submission id was already there (it is followed). A head
    whose job agent has not registered yet (a cluster just started, a loaded head: Ray waits 10 s for it,
    then answers "No available agent to submit job, please try again later") is asked again, for as
    long as a head may take to answer."""
    deadline = time.monotonic() + answer_timeout_s()
    while True:
        try:
            client.submit_job(entrypoint=spec.entrypoint, submission_id=spec.submission_id,
                              runtime_env=spec.runtime_env, metadata=spec.metadata)
            return True
        except RuntimeError as exc:
            if "already exists" in str(exc):
                return False
            if NO_AGENT not in str(exc):
                raise
            if time.monotonic() > deadline:
                # Its agent never registered: on a host with a second Ray, the agent's fixed default port was taken.
                raise ClusterNotReady(
                    f"the Ray cluster's job API answers '{NO_AGENT}' after {answer_timeout_s():.0f} s: the head's "
                    "dashboard agent is not up; if another Ray runs on the head's host, it may hold the agent's port "
                    f"({DEFAULT_AGENT_PORT} unless given): start the head with --dashboard-agent-listen-port=0, or raise "
                    f"{RAY_CONNECT_TIMEOUT_VAR} for a slow head") from None
        time.sleep(AGENT_RETRY_S)


def stop_job(client, submission_id: str) -> bool:
    """Ask Ray to stop the job (SIGTERM, then a kill), and wait until it has ended."""
    stopped = client.stop_job(submission_id)
    deadline = time.monotonic() + STOP_WAIT_S
    while job_status(client, submission_id) not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
    return stopped


def job_status(client, submission_id: str) -> str | None:
    """The job's status, None when the cluster does not know it (a restarted head)."""
    try:
        return str(client.get_job_status(submission_id).value)
    except RuntimeError as exc:
        if "does not exist" in str(exc) or "404" in str(exc):
            return None
        raise
