"""What a killed run's local Ray leaves, ended by the next run's clean-up (flows/lease.py), with a
real kill -9, and what that clean-up never touches (docs/files.md, "What a later run cleans up").

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_ray_leftovers.py

A process is the killed run's only when the run can prove it: it started after the run's owner and
it carries the lease's variable the run set in its environment (Ray's renamed agents keep it: the run
sets SPT_NOENV), or its parent chain leads to one that does. What files a process reads, what its
command line names, or a Ray session folder whose name ends in the owner's (reused) pid prove nothing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from grpo_pipeline.flows.lease import LEASE_VAR, Lease, reap, stale_leases, started_after_boot

ROOT = Path(__file__).resolve().parents[2]

# Starts a local Ray the way the train stage does (under a lease, when `with_lease`), runs a task so a
# worker is there too, says its session, then waits.
RAY_OWNER = """
import sys, time
from contextlib import nullcontext
from grpo_pipeline.flows import lease
from grpo_pipeline.cluster.ray_cluster import connect_ray
with (lease.held(None) if sys.argv[1] == "with_lease" else nullcontext()):
    connect_ray(None, None)
    import ray
    ray.get(ray.remote(lambda: 1).remote())
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    time.sleep(600)
"""
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _ray_owner(tmp_path: Path, with_lease: bool) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop(LEASE_VAR, None)
    owner = subprocess.Popen([sys.executable, "-c", RAY_OWNER, "with_lease" if with_lease else "no_lease"], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, text=True)
    session = owner.stdout.readline().strip()
    assert session, "the owner did not start Ray"
    return owner, session


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _agents_under(pid: int) -> list[psutil.Process]:
    """Ray's agents started under `pid`, once they have renamed themselves."""
    deadline = time.monotonic() + 120
    while True:
        found = [p for p in _descendants(pid) if _cmdline(p).startswith(AGENTS)]
        if len(found) >= 2:
            return found
        assert time.monotonic() < deadline, f"Ray's agents did not start: {found}"
        time.sleep(0.5)


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _alive(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {_cmdline(process)[:60]}")
        except psutil.Error:
            continue
    return alive


def _end(processes: list[psutil.Process]) -> None:
    """What this test started, by pid."""
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass


def test_a_killed_runs_ray_is_ended_but_a_users_tail_of_its_log_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.delenv(LEASE_VAR, raising=False)
    owner, session = _ray_owner(tmp_path, with_lease=True)
    raylet_log = Path(session) / "logs" / "raylet.out"
    # A person follows the run's log from their own shell: it reads the session's files, and names one.
    tail = subprocess.Popen(["tail", "-f", str(raylet_log)], stdout=subprocess.DEVNULL, start_new_session=True)
    ray_processes = _descendants(owner.pid)
    agents = _agents_under(owner.pid)
    try:
        owner.kill()
        owner.wait()
        # Stopped, an agent cannot end itself when its raylet goes (orphaned agents stayed for minutes):
        # only the clean-up ends it now.
        for agent in agents:
            agent.send_signal(signal.SIGSTOP)
        (stale,) = stale_leases()
        assert stale.ray_sessions == [Path(session).name]  # recorded by id when the run started it
        assert reap([stale]) >= 4  # GCS, raylet, agents, worker (some may have ended themselves)
        psutil.wait_procs(ray_processes, timeout=15)
        assert _alive(ray_processes) == [], "the killed run's Ray outlived the clean-up"
        assert tail.poll() is None, "the clean-up ended a user's tail -f of the killed run's log"
        assert stale_leases() == []
    finally:
        tail.kill()
        tail.wait()
        if owner.poll() is None:
            owner.kill()
        _end(ray_processes)


def test_a_later_process_with_the_dead_owners_pid_and_its_own_ray_is_left_alone(tmp_path, monkeypatch):
    """The dead run's pid, reused: a process started after the run's owner (here, with that pid)
    started a Ray session of its own, named with that pid as every session is. None of it is the run's."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.delenv(LEASE_VAR, raising=False)
    other, session = _ray_owner(tmp_path, with_lease=False)
    processes = [psutil.Process(other.pid), *_descendants(other.pid)]
    _agents_under(other.pid)
    processes = [psutil.Process(other.pid), *_descendants(other.pid)]
    try:
        # The killed run's lease: its owner had this pid and started a minute before the process that has it now.
        after_boot = started_after_boot(other.pid)
        dead = Lease(id=f"{int(time.time()) - 60}-{other.pid}-0a0b0c", pid=other.pid,
                     started=psutil.Process(other.pid).create_time() - 60,
                     started_after_boot=None if after_boot is None else after_boot - 60, host=socket.gethostname())
        dead.save()
        assert [lease.id for lease in stale_leases()] == [dead.id]
        assert Path(session).name.endswith(f"_{other.pid}")  # the folder old clean-ups took for the run's
        assert reap(stale_leases()) == 0
        time.sleep(2)
        assert len(_alive(processes)) == len(processes), "the clean-up ended a process that was not the run's"
    finally:
        other.kill()
        other.wait()
        _end(processes)
