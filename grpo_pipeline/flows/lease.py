"""What a run leaves behind when its process is killed outright (kill -9, the OOM killer), found
and ended by the next run.

    python -m grpo_pipeline --model tiny --device cpu    # reaps what an earlier, killed run left

A process that runs the flow holds a lease while it runs: `<PREFECT_HOME>/grpo-pipeline/leases/
<id>.json` names its pid and start time, the Prefect database its flow runs are in and those runs.
Every process it starts (the command line's Prefect API, Ray's local processes, training workers)
inherits `GRPO_PIPELINE_LEASE=<id>` in its environment, so it can be found even after its parent
is gone. A run ending normally (or on SIGTERM / Ctrl-C) releases its lease. At the start of each
run, the leases of this host whose owner is no longer alive are reaped: the processes that carry
their id are ended (SIGTERM, then SIGKILL), their flow runs that still look alive are marked
Crashed, and their files (the lease, the local API's log) are removed.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.common.errors import UserError
from grpo_pipeline.common.files import write_json_atomic

LEASE_VAR = "GRPO_PIPELINE_LEASE"
STOP_GRACE_S = 5.0


class Lease(BaseModel):
    id: str
    pid: int
    started: float = Field(..., description="The owner's process start time (psutil), so a reused pid is not taken for it.")
    started_after_boot: float | None = Field(
        None, description="The owner's start in seconds after boot (Linux): what tells it from a reused pid, as a step "
        "of the wall clock leaves it alone. None in a lease of an earlier version, or off Linux.")
    host: str
    database: str | None = Field(None, description="Where its flow runs are: `local:<PREFECT_HOME>` or an API URL.")
    flow_runs: list[str] = Field(default_factory=list)

    @property
    def path(self) -> Path:
        return leases_dir() / f"{self.id}.json"

    @property
    def api_log(self) -> Path:
        """The command line's local Prefect API writes its log here (private: it holds request details)."""
        return leases_dir() / f"{self.id}.api.log"

    def save(self) -> None:
        write_json_atomic(self.path, self.model_dump(mode="json"), private=True)

    def owner_alive(self) -> bool:
        import psutil

        try:
            if self.started_after_boot is not None and (after_boot := started_after_boot(self.pid)) is not None:
                return abs(after_boot - self.started_after_boot) < 0.005  # whole clock ticks, the same for one process
            return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
        except psutil.Error:
            return False


def started_after_boot(pid: int) -> float | None:
    """When process `pid` started, in seconds after boot (`starttime` of /proc/<pid>/stat), on Linux;
    None elsewhere. psutil's create_time is the boot time plus this, and the boot time the kernel
    gives is the wall clock less the time since boot: a step of the wall clock (NTP, a virtual machine
    restored from a snapshot: 33 s on a CI machine) moves every process's create_time by the step,
    which once made a live run's own lease look stale and its clean-up end the run's own Prefect API."""
    import psutil

    if not sys.platform.startswith("linux"):
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    except OSError as exc:
        raise psutil.AccessDenied(pid) from exc
    fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    return int(fields[22 - 3]) / os.sysconf("SC_CLK_TCK")


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def leases_dir() -> Path:
    return prefect_home() / "grpo-pipeline" / "leases"


def current() -> Lease | None:
    """This process's lease, if it holds one."""
    lease_id = os.environ.get(LEASE_VAR)
    if not lease_id:
        return None
    try:
        lease = Lease.model_validate_json((leases_dir() / f"{lease_id}.json").read_text())
    except (OSError, ValueError):
        return None
    return lease if lease.pid == os.getpid() else None


@contextmanager
def held(database: str | None = None, required: bool = False) -> Iterator[Lease]:
    """This process's lease for the duration (the one it already holds, if any, which then stays).
    Where PREFECT_HOME cannot be written the run goes on without one (nothing to reap it by), unless
    `required` (the command line's local API keeps its database there too)."""
    import psutil

    if (lease := current()) is not None:
        yield lease
        return
    lease = Lease(id=f"{int(time.time())}-{os.getpid()}-{secrets.token_hex(3)}", pid=os.getpid(),
                  started=psutil.Process().create_time(), started_after_boot=started_after_boot(os.getpid()),
                  host=socket.gethostname(), database=database)
    try:
        lease.save()
    except OSError as exc:
        if required:
            raise UserError(f"PREFECT_HOME {prefect_home()} cannot be written ({exc.strerror or exc}); set PREFECT_HOME "
                            "to a writable directory, or PREFECT_API_URL to a running Prefect server") from None
        yield lease
        return
    os.environ[LEASE_VAR] = lease.id
    try:
        yield lease
    finally:
        os.environ.pop(LEASE_VAR, None)
        lease.path.unlink(missing_ok=True)
        lease.api_log.unlink(missing_ok=True)


def database_of_this_run() -> str:
    """Which Prefect database this process's flow runs go to: the one its lease names (the command
    line's local API), a configured API's URL, or the local one under PREFECT_HOME."""
    if (lease := current()) is not None and lease.database:
        return lease.database
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or f"local:{prefect_home()}"


def note_flow_run(flow_run_id) -> None:
    """Record a flow run this process runs, so a reaper can mark it crashed."""
    if (lease := current()) is not None:
        lease.flow_runs.append(str(flow_run_id))
        lease.save()


def end_leftovers(database: str, log) -> None:
    """Reap the leases of killed runs, and mark their flow runs in this run's database crashed."""
    stale = stale_leases()
    if not stale:
        return
    from prefect.client.orchestration import get_client

    ended = reap(stale)
    with get_client(sync_client=True) as client:
        marked = mark_crashed(stale, database, client)
    log(f"ended {ended} process(es) and marked {marked} flow run(s) crashed, left by killed run(s) of pid(s) "
        f"{', '.join(str(lease.pid) for lease in stale)}")


def stale_leases() -> list[Lease]:
    """Leases of this host whose owner is gone; never this process's own (it is alive, whatever a
    clock says)."""
    host, found = socket.gethostname(), []
    own = os.environ.get(LEASE_VAR)
    for path in sorted(leases_dir().glob("*.json")) if leases_dir().is_dir() else []:
        try:
            lease = Lease.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue
        if lease.id == own and lease.pid == os.getpid():
            continue
        if lease.host == host and not lease.owner_alive():
            found.append(lease)
    return found


def reap(leases: list[Lease]) -> int:
    """End every process that carries one of these leases' ids, and every process of a local Ray
    session their owners started; remove their files. Returns how many processes were ended."""
    import psutil

    ids = {lease.id for lease in leases}
    if not ids:
        return 0
    sessions = [str(path) + os.sep for lease in leases for path in ray_sessions_of(lease)]
    left = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and (_lease_of(process) in ids or _in_session(process, sessions)):
                process.send_signal(signal.SIGTERM)
                left.append(process)
        except psutil.Error:  # gone meanwhile, or another user's
            continue
    _, alive = psutil.wait_procs(left, timeout=STOP_GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    for lease in leases:
        lease.path.unlink(missing_ok=True)
        lease.api_log.unlink(missing_ok=True)
    return len(left)


def ray_temp_root() -> Path:
    """Where Ray puts its sessions (ray._private.utils.get_ray_temp_dir, read without importing Ray)."""
    return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"


def ray_sessions_of(lease: Lease) -> list[Path]:
    """The local Ray sessions the lease's owner started: Ray names a session's folder after the time
    and the pid of the process whose ray.init started it (`session_2026-12-05_00-02-53_236149_10823`);
    one from before the owner started belongs to an earlier process of the same pid."""
    found = []
    for path in ray_temp_root().glob(f"session_*_{lease.pid}"):
        try:
            started = time.mktime(time.strptime(path.name[len("session_"):].rsplit("_", 2)[0], "%Y-%m-%d_%H-%M-%S"))
        except ValueError:
            continue
        if started >= lease.started - 1 and path.is_dir() and not path.is_symlink():
            found.append(path)
    return found


def _in_session(process, sessions: list[str]) -> bool:
    """The process belongs to one of these Ray sessions: its command line names the session's folder,
    or it holds a file there open (its logs). Ray's agents (DashboardAgent, RuntimeEnvAgent) rename
    themselves over both their command line and their environment, so the lease's variable is gone
    from them: their open logs are what is left to know them by."""
    if not sessions:
        return False
    command = " ".join(process.cmdline())
    if any(re.search(re.escape(session.rstrip(os.sep)) + r"(?![0-9])", command) for session in sessions):
        return True
    try:
        fds = os.listdir(f"/proc/{process.pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{process.pid}/fd/{fd}")
        except OSError:
            continue
        if any(target.startswith(session) for session in sessions):
            return True
    return False


def _lease_of(process) -> str | None:
    """The lease id in a process's environment. Read from /proc as raw bytes where there is one:
    Ray renames its processes (setproctitle), which zeroes the start of that block, and psutil's
    parser stops at the first gap."""
    import psutil

    try:
        raw = Path(f"/proc/{process.pid}/environ").read_bytes()
    except FileNotFoundError:
        return process.environ().get(LEASE_VAR)
    except OSError as exc:
        raise psutil.AccessDenied(process.pid) from exc
    start = raw.find(f"{LEASE_VAR}=".encode())
    if start < 0 or (start > 0 and raw[start - 1] != 0):
        return None
    value = raw[start + len(LEASE_VAR) + 1:].split(b"\0", 1)[0]
    return value.decode(errors="replace")


def mark_crashed(leases: list[Lease], database: str | None, client) -> int:
    """Mark the leases' flow runs in `database` (the one `client` talks to) that still look alive as
    Crashed; returns how many."""
    from prefect.states import Crashed

    marked = 0
    for lease in leases:
        if lease.database != database:
            continue
        for flow_run_id in lease.flow_runs:
            try:
                run = client.read_flow_run(flow_run_id)
            except Exception:  # deleted meanwhile
                continue
            if run.state is not None and not run.state.is_final():
                message = f"the process running it (pid {lease.pid}) was killed; found and ended by a later run"
                client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
                marked += 1
    return marked
