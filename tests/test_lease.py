"""A run's lease (flows/lease.py) names a live owner for as long as it lives, whatever the wall clock
does: a step of the clock (NTP, a virtual machine restored from a snapshot) moves every process's
create time as psutil computes it (the boot time plus the start since boot), and a CI machine's
restore, 33 s, once made a live run's own lease look stale: its clean-up ended the run's own Prefect
API, and the run failed on `Connection refused`. The owner is known by its start since boot instead,
which no step moves, and a run never takes its own lease for a stale one.

    PYTHONPATH=$PWD python -m pytest -q tests/test_lease.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from grpo_pipeline.flows import lease

pytestmark = pytest.mark.e2e  # each test starts owner processes and kills them

ROOT = Path(__file__).resolve().parent.parent
# Holds a lease, says its id, then lives on.
OWNER = """
import time
from grpo_pipeline.flows import lease
with lease.held(None) as held:
    print(held.id, flush=True)
    time.sleep(600)
"""
CLOCK_STEP_S = 33.5  # the wall clock's step when the CI machine was restored from its snapshot


def _owner(home: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(home)}
    env.pop(lease.LEASE_VAR, None)
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lease_id = owner.stdout.readline().strip()
    assert lease_id, "the owner did not take its lease"
    return owner, lease_id


def _step_the_wall_clock(monkeypatch, seconds: float) -> None:
    """The machine's clock is not the test's to step: psutil is shown the boot time such a step gives
    (the kernel's boot time is the wall clock less the time since boot, so it moves with the step)."""
    stepped = psutil.boot_time() + seconds
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: stepped)


def test_a_step_of_the_wall_clock_leaves_live_owners_leases_alive_and_a_killed_owners_stale(tmp_path, monkeypatch):
    home = tmp_path / "prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.delenv(lease.LEASE_VAR, raising=False)
    live, live_id = _owner(home)
    killed, killed_id = _owner(home)
    try:
        killed.kill()
        killed.wait(timeout=60)
        with lease.held(None) as mine:
            before = psutil.Process(live.pid).create_time()
            _step_the_wall_clock(monkeypatch, CLOCK_STEP_S)
            assert abs(psutil.Process(live.pid).create_time() - before - CLOCK_STEP_S) < 0.01  # the step psutil sees

            assert [found.id for found in lease.stale_leases()] == [killed_id]
            by_id = {path.stem: lease.Lease.model_validate_json(path.read_text())
                     for path in (home / "grpo-pipeline" / "leases").glob("*.json")}
            assert set(by_id) == {live_id, killed_id, mine.id}
            assert by_id[live_id].owner_alive() and by_id[mine.id].owner_alive()  # this process's, judged as any other
            assert not by_id[killed_id].owner_alive()
    finally:
        live.kill()
        live.wait(timeout=60)
    assert {found.id for found in lease.stale_leases()} == {live_id, killed_id}  # both owners gone now; its own released


# The clean-up as the next run makes it, in a process of its own (a lease that hangs the reader must
# not hang the test): each lease it skipped is a warning line, then what it found stale.
CLEAN_UP = """
from grpo_pipeline.flows import lease
stale = lease.stale_leases(warn=print)
lease.reap(stale)
print("stale:", sorted(found.id for found in stale), flush=True)
"""


def _clean_up(home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(home)}
    env.pop(lease.LEASE_VAR, None)
    return subprocess.run([sys.executable, "-c", CLEAN_UP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_a_lease_is_hostile_input_the_clean_up_skips_with_one_warning_and_never_builds_a_path_from(tmp_path):
    home = tmp_path / "prefect"
    leases = home / "grpo-pipeline" / "leases"
    leases.mkdir(parents=True)
    outside = tmp_path / "x"
    outside.mkdir()
    for name in ("precious.json", "precious.api.log"):
        (outside / name).write_text("the user's own file")
    dead = _dead_pid()
    record = {"pid": dead, "started": 1.0, "started_after_boot": 0.01, "host": socket.gethostname(), "flow_runs": []}
    good = "1700000000-%d-abcdef" % dead
    hostile = {
        f"{good}.json": {**record, "id": good},  # the one stale lease here
        "1700000001-1-000001.json": {**record, "id": str(outside / "precious")},  # an id that is a path
        "1700000002-1-000002.json": {**record, "id": "a\0b"},  # a NUL: ValueError in every Path call
        "../escape.json": None,  # (not made: a name is never a path)
        "1700000003-1-000003.json": "x" * 200_000,  # bigger than any lease
        "not-a-lease.json": {**record, "id": "not-a-lease"},
    }
    for name, content in hostile.items():
        if content is not None:
            (leases / name).write_text(content if isinstance(content, str) else json.dumps(content))
    os.mkfifo(leases / "1700000004-1-000004.json")  # a FIFO: a plain read waits for a writer forever
    (leases / "1700000005-1-000005.json").symlink_to(outside / "precious.json")  # a link out of the folder

    done = _clean_up(home)

    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == f"stale: ['{good}']"
    warnings = lines[:-1]
    assert len(warnings) == 6, warnings  # one line per lease skipped, each naming its file
    for name in ("1700000001-1-000001.json", "1700000002-1-000002.json", "1700000003-1-000003.json",
                 "not-a-lease.json", "1700000004-1-000004.json", "1700000005-1-000005.json"):
        assert sum(name in line for line in warnings) == 1, (name, warnings)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.api.log", "precious.json"]  # nothing outside touched
    assert not (leases / f"{good}.json").exists()  # the good one reaped
    assert (leases / "1700000004-1-000004.json").is_fifo()  # what is not a lease is left as it is
