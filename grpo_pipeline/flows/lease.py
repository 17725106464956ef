"""What a run leaves behind when its process is killed outright (kill -9, the OOM killer), found
and ended by the next run, and nothing else: docs/files.md ("What a later run cleans up") has the rule.

    python -m grpo_pipeline --model tiny --device cpu    # reaps what an earlier, killed run left

A process that runs the flow holds a lease while it runs: `<PREFECT_HOME>/grpo-pipeline/leases/
<id>.json` names its pid and start time, the Prefect database its flow runs are in, those runs and the
local Ray sessions it started (by id). Every process it starts (the command line's Prefect API, Ray's
local processes, training workers) inherits `GRPO_PIPELINE_LEASE=<id>` in its environment, so it can be
found even after its parent is gone. A run ending normally (or on SIGTERM / Ctrl-C) releases its
lease. At the start of each run, the leases of this host whose owner is no longer alive are reaped:
the processes that are provably the dead run's are ended (SIGTERM, then SIGKILL), its flow runs that
still look alive are marked Crashed, and its files (the lease, the local API's log) are removed.

A process is the dead run's only when both hold: it started after the run's owner (start since boot,
which no step of the wall clock moves), and it carries the lease's variable in its environment or its
parent chain (through processes that also started after the owner) leads to one that does. What files
it reads or its command line names prove nothing (a person's `tail -f` of the run's log does both).
Ray renames its processes over their environment block (setproctitle) unless SPT_NOENV is set, so the
run sets it: renamed agents and workers keep the variable readable in /proc/<pid>/environ.

A lease file is input another program may have written or broken: it is read only under a name of
the pattern a run gives it, only if it is a regular file of this user of at most 64 KiB, and only if
its `id` is its file's name; anything else is skipped with one warning, and no path is ever built
from what a lease holds.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from pydantic import BaseModel, Field, ValidationError

from grpo_pipeline.store.bounded_read import read_regular, short
from grpo_pipeline.errors import UserError
from grpo_pipeline.store.files import write_json_atomic

LEASE_VAR = "GRPO_PIPELINE_LEASE"
# setproctitle's switch (Ray vendors it): a new title stays within the command line's bytes and leaves
# the environment block, where the lease's variable is, as it was.
TITLE_KEEPS_ENVIRONMENT = ("SPT_NOENV", "1")
STOP_GRACE_S = 5.0
# What a run names its lease: `<unix time>-<pid>-<6 hex>`; the file is `<id>.json`, its API's log `<id>.api.log`.
LEASE_ID = r"[0-9]{1,12}-[0-9]{1,10}-[0-9a-f]{6}"
_LEASE_FILE = re.compile(rf"({LEASE_ID})\.json")
RAY_SESSION = r"session_[0-9]{4}-[0-9]{2}-[0-9]{2}_[0-9]{2}-[0-9]{2}-[0-9]{2}_[0-9]{1,6}_[0-9]{1,10}"
MAX_LEASE_BYTES = 64 * 1024  # a lease is a few hundred bytes; a run with thousands of flow runs stays far below


class Lease(BaseModel):
    id: str = Field(..., pattern=rf"^{LEASE_ID}$", description="Its file's name less `.json`.")
    pid: int = Field(..., gt=1, lt=2**32)
    started: float = Field(..., description="The owner's process start time (psutil), so a reused pid is not taken for it.")
    started_after_boot: float | None = Field(
        None, description="The owner's start in seconds after boot (Linux): what tells it from a reused pid, as a step "
        "of the wall clock leaves it alone. None in a lease of an earlier version, or off Linux.")
    host: str = Field(..., max_length=255)
    database: str | None = Field(None, max_length=4096,
                                 description="Where its flow runs are: `local:<PREFECT_HOME>` or an API URL.")
    flow_runs: list[UUID] = Field(default_factory=list)
    ray_sessions: list[str] = Field(default_factory=list, description="The local Ray sessions the run started, by id "
                                    "(the name of the session's folder): what a clean-up says it ended.")

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


class UnreadableLease(ValueError):
    """A file in the leases folder that is not a lease this program can trust."""


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
    lease_id = os.environ.get(LEASE_VAR, "")
    if not re.fullmatch(LEASE_ID, lease_id):
        return None
    try:
        lease = read_lease(leases_dir() / f"{lease_id}.json")
    except (OSError, UnreadableLease):
        return None
    return lease if lease.pid == os.getpid() else None


def read_lease(path: Path) -> Lease:
    """The lease in `path`, trusting nothing in it: UnreadableLease (saying why, in a few words) for a
    name a run never gives, anything but this user's regular file (a link is not followed, a FIFO is
    not waited on), more than MAX_LEASE_BYTES, or content that is not a lease named after its file."""
    import stat

    named = _LEASE_FILE.fullmatch(path.name)
    if named is None:
        raise UnreadableLease("not the name of a lease (<time>-<pid>-<6 hex>.json)")
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise UnreadableLease("a symbolic link, not a lease")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise UnreadableLease(f"owned by another user (uid {info.st_uid})")
        data = read_regular(path, MAX_LEASE_BYTES, follow_links=False)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise UnreadableLease(f"cannot be read ({exc.strerror or exc})") from None
    try:
        lease = Lease.model_validate(json.loads(data))
    except ValidationError as exc:
        raise UnreadableLease(f"not a lease (its {'.'.join(map(str, exc.errors()[0]['loc'])) or 'content'} is not valid)") from None
    except ValueError:  # JSON or UTF-8
        raise UnreadableLease("not a lease (not JSON)") from None
    if lease.id != named.group(1):
        raise UnreadableLease("its id is not its file's name")
    return lease


@contextmanager
def held(database: str | None = None, required: bool = False) -> Iterator[Lease]:
    """This process's lease for the duration (the one it already holds, if any, which then stays).
    Where PREFECT_HOME cannot be written the run goes on without one (nothing to reap it by), unless
    `required` (the command line's local API keeps its database there too)."""
    import psutil

    from grpo_pipeline.cluster.ray_cluster import LOCAL_RAY_STARTED

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
    title_var, title_value = TITLE_KEEPS_ENVIRONMENT
    set_title_var = title_var not in os.environ
    os.environ[LEASE_VAR] = lease.id
    os.environ.setdefault(title_var, title_value)
    LOCAL_RAY_STARTED.append(note_ray_session)
    try:
        yield lease
    finally:
        LOCAL_RAY_STARTED.remove(note_ray_session)
        os.environ.pop(LEASE_VAR, None)
        if set_title_var:
            os.environ.pop(title_var, None)
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
        lease.flow_runs.append(UUID(str(flow_run_id)))
        lease.save()


def note_ray_session(session: str) -> None:
    """Record a local Ray session this process started (cluster/ray_cluster.py tells), by its id."""
    if (lease := current()) is not None and re.fullmatch(RAY_SESSION, session) and session not in lease.ray_sessions:
        lease.ray_sessions.append(session)
        lease.save()


def end_leftovers(database: str, log: Callable[[str], None]) -> None:
    """Reap the leases of killed runs, and mark their flow runs in this run's database crashed."""
    stale = stale_leases(warn=log)
    if not stale:
        return
    from prefect.client.orchestration import get_client

    ended = reap(stale)
    with get_client(sync_client=True) as client:
        marked = mark_crashed(stale, database, client)
    sessions = [session for lease in stale for session in lease.ray_sessions]
    log(f"ended {ended} process(es) and marked {marked} flow run(s) crashed, left by killed run(s) of pid(s) "
        f"{', '.join(str(lease.pid) for lease in stale)}" + (f" (Ray sessions {', '.join(sessions)})" if sessions else ""))


def stale_leases(warn: Callable[[str], None] | None = None) -> list[Lease]:
    """Leases of this host whose owner is gone; never this process's own (it is alive, whatever a
    clock says). A file of the folder that is not a trustworthy lease is skipped, with one `warn` line."""
    host, found = socket.gethostname(), []
    own = os.environ.get(LEASE_VAR)
    try:
        entries = sorted(os.scandir(leases_dir()), key=lambda entry: entry.name)
    except OSError:  # no folder yet (no run here), or one this user cannot list
        return []
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue  # an API's log, a write's temporary file
        try:
            lease = read_lease(Path(entry.path))
        except FileNotFoundError:  # released meanwhile
            continue
        except UnreadableLease as exc:
            if warn is not None:
                warn(f"lease clean-up: skipped {short(repr(entry.name))} in {leases_dir()}: {exc}; remove it if no run "
                     "of yours wrote it")
            continue
        if lease.id == own and lease.pid == os.getpid():
            continue
        if lease.host == host and not lease.owner_alive():
            found.append(lease)
    return found


def reap(leases: list[Lease]) -> int:
    """End every process that is provably one of these leases' runs' (the module's rule), and remove
    the leases' files (each named from its validated id). Returns how many processes were ended."""
    import psutil

    if not leases:
        return 0
    left = processes_of(leases)
    for process in left:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:  # gone meanwhile
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


def processes_of(leases: list[Lease]) -> list:
    """The live processes of this user that are provably a lease's run's: started after its owner, and
    carrying its id in their environment or below (parent chain) a process that does. Never this
    process or one of its ancestors."""
    import psutil

    by_id = {lease.id: lease for lease in leases}
    spared = {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}
    table = {}  # pid: (process, parent pid, lease id in its environment, its start since boot, its create time)
    for process in psutil.process_iter():
        try:
            table[process.pid] = (process, process.ppid(), _lease_of(process), started_after_boot(process.pid),
                                  process.create_time())
        except psutil.Error:  # gone meanwhile, or another user's
            continue

    def started_after_owner(pid: int, lease: Lease) -> bool:
        _, _, _, after_boot, created = table[pid]
        if lease.started_after_boot is not None and after_boot is not None:
            return after_boot >= lease.started_after_boot
        return created >= lease.started - 1.0  # an earlier version's lease, or off Linux: the wall clock

    def run_of(pid: int) -> Lease | None:
        """The lease whose run `pid` provably belongs to: the first id up its parent chain."""
        seen = set()
        while pid in table and pid not in seen:
            seen.add(pid)
            _, parent, marker, _, _ = table[pid]
            if marker is not None:
                lease = by_id.get(marker)
                return lease if lease is not None and started_after_owner(pid, lease) else None
            pid = parent
        return None

    return [table[pid][0] for pid in table
            if pid not in spared and (lease := run_of(pid)) is not None and started_after_owner(pid, lease)]


def _lease_of(process) -> str | None:
    """The lease id in a process's environment, read from /proc as raw bytes where there is one: a
    title written over the block (setproctitle without SPT_NOENV) leaves gaps of zeros, where psutil's
    parser stops."""
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
