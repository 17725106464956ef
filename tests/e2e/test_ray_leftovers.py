"""What a killed run's local Ray leaves, ended by the next run's clean-up (flows/lease.py), with a
real kill -9: the run's lease names its owner, and the Ray session its owner started is found by
its folder; every process of that session ends, Ray's agents too, which rename themselves over
their environment and so no longer carry the lease's variable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

# Holds a lease, starts a local Ray the way the train stage does, says its session, then waits.
OWNER = """
import sys, time
from grpo_pipeline.flows import lease
from grpo_pipeline.common.ray_cluster import connect_ray
with lease.held(None):
    connect_ray(None, None)
    import ray
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    time.sleep(600)
"""


def _agents_of(session: str) -> list[psutil.Process]:
    """Ray's agents of `session`, once they have renamed themselves (ray::DashboardAgent,
    ray::RuntimeEnvAgent): the processes of those names holding its log files open."""
    found = []
    for process in psutil.process_iter():
        try:
            if not " ".join(process.cmdline()).startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")):
                continue
            if any(f.path.startswith(session + os.sep) for f in process.open_files()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _of_session(session: str) -> list[str]:
    """Every live process that names `session` or holds a file of it open."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and (session in " ".join(process.cmdline()) or any(
                    f.path.startswith(session + os.sep) for f in process.open_files())):
                found.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
        except psutil.Error:
            continue
    return found


def test_a_killed_runs_ray_agents_are_ended_by_the_next_clean_up(tmp_path, monkeypatch):
    from grpo_pipeline.flows.lease import reap, stale_leases

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "PREFECT_HOME": str(tmp_path / "prefect")}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    agents: list[psutil.Process] = []
    try:
        session = owner.stdout.readline().strip()
        assert session, "the owner did not start Ray"
        deadline = time.monotonic() + 120
        while len(agents := _agents_of(session)) < 2:
            assert time.monotonic() < deadline, f"Ray's agents did not start: {agents}"
            time.sleep(0.5)
        owner.kill()
        owner.wait()
        # Stopped, an agent cannot end itself when its raylet goes (as they did six times in seven):
        # only the clean-up ends it now.
        for agent in agents:
            agent.send_signal(signal.SIGSTOP)
        (stale,) = stale_leases()
        # Renamed, an agent may have lost the lease's variable (it did in the run that left them): the
        # session alone must find every process of it, so the lease's id here is one nothing carries.
        assert reap([stale.model_copy(update={"id": "an-id-no-process-carries"})]) >= 2
        gone, alive = psutil.wait_procs(agents, timeout=10)
        assert alive == [], f"{[a.pid for a in alive]} survived the clean-up"
        assert _of_session(session) == []  # raylet, GCS, dashboard agents, log monitor, workers: all ended
        reap([stale])
        assert stale_leases() == []
    finally:
        if owner.poll() is None:
            owner.kill()
        for agent in agents:  # what this test started, by pid
            try:
                agent.kill()
            except psutil.Error:
                pass
        if owner.returncode is not None and (lease := list((tmp_path / "prefect").rglob("*.json"))):
            from grpo_pipeline.flows.lease import Lease

            reap([Lease.model_validate_json(path.read_text()) for path in lease])
