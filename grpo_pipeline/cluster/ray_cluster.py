"""The run's Ray: the connection (bounded in time), its end, and the nodes it waits for.

    python -m grpo_pipeline --model tiny --device cpu --ray-address head-node:6379

The address is checked first (cluster/ray_address.py). A cluster that stops answering later is let go
of within a bounded time: a Ray core client left connected to a dead head aborts its process a minute
later. What runs on every node is cluster/node_tasks.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from grpo_pipeline.errors import UserError
from grpo_pipeline.cluster.ray_address import RayAddressError, check_reachable, cluster_address, parse_ray_address

# Ray's own connection to a cluster's head (after cluster/ray_address.py's TCP probe); a slow head may need more.
RAY_CONNECT_TIMEOUT_VAR, RAY_CONNECT_TIMEOUT_S = "GRPO_PIPELINE_RAY_CONNECT_TIMEOUT_S", 60.0
# ray.shutdown when the head no longer answers takes ~15 s (Ray's own retries); it is not waited on longer.
DISCONNECT_TIMEOUT_S = 60.0
# The one service port Ray gives a node a fixed default when it is started without one: its dashboard
# agent's HTTP port (52365), where a cluster's job API submits jobs. A second Ray on the host found it
# taken, its agent failed to bind ("Agent port #52365 failed to bind after 6 attempts"), and every job
# submission to it answered "No available agent to submit job". 0: the agent binds a free port and
# registers it, as every other service of a node already does (GCS, raylet, object manager, metrics,
# runtime-env agent); a dashboard, where a node runs one, the same (its default is 8265). Every Ray the
# project or its tests start is given these.
FREE_PORTS = {"dashboard_agent_listen_port": 0, "dashboard_port": 0}
# How Ray names the port a service could not bind (its GCS: "The specified port is 6379 ... `Address already
# in use`"; an agent: "Agent port #52365 failed to bind").
_PORT_IN_ERROR = re.compile(r"(?:specified port is|port #?)(\d{2,5})\b", re.IGNORECASE)
_TAKEN = re.compile(r"already in use|failed to bind", re.IGNORECASE)


class RayStartError(UserError):
    """The run's local Ray could not start (a port it was given is taken)."""


# Told the session's name (`session_<date>_<time>_<pid>`) when this process starts a local Ray: the
# run's lease records it (flows/lease.py, a floor up), so a later clean-up can say what it ended.
LOCAL_RAY_STARTED: list[Callable[[str], None]] = []


class ClusterLost(UserError):
    """The run's Ray cluster stopped answering while the run used it."""


# What connect_ray joined in this process, while it stays joined: (the target asked for, the GCS address
# joined). A later run in the same process (tests, a notebook) asking the same target reuses the connection.
_joined: list[tuple[str, str]] = []


def joined_by_connect_ray() -> bool:
    """Whether this process's Ray connection is one connect_ray made (not one some other code opened)."""
    import ray

    return ray.is_initialized() and bool(_joined) and _joined[0][1] == ray.get_runtime_context().gcs_address


# A Ray started here serves this run alone:
# - no idle workers started ahead (Ray starts one per CPU for the first driver, without the run's runtime_env,
#   so no task or actor of the run can use them: 2 processes on 2 cores, 16 on a 16-core GPU host, each
#   importing Ray while the run starts);
# - no Ray Train preemption watcher (an actor a training attempt starts to hear of nodes an autoscaler drains:
#   a Ray of one host has no autoscaler). Ray Train reads it from the controller's environment, the job's.
LOCAL_RAY_OPTIONS = {"_system_config": {"prestart_worker_first_driver": False}}
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def connect_ray(address: str | None, runtime_env: dict | None) -> None:
    """Join the run's Ray cluster (or start a local one) once per process, with the run's env."""
    import ray

    # No address: a fresh local Ray ("local"), never whatever /tmp/ray/ray_current_cluster names
    # (a cluster that may be long dead: ray.init would wait on it). A Ray started here runs no
    # dashboard: on a small machine it takes a third of the CPU training needs. A cluster keeps its own.
    found, origin = cluster_address(address)
    target = found or "local"
    if ray.is_initialized():
        if not joined_by_connect_ray() or _joined[0][0] == target:
            # Ours for this target, or opened by the code around the run (a notebook's ray.init): used as
            # it is; check_room refuses it in one line where it can never hold the run's workers.
            return
        disconnect_ray()  # joined by an earlier run for another cluster: this run's is another
    parsed = parse_ray_address(target, origin)
    if parsed is not None:
        # Tasks of this project's code (node checks, cluster evaluation) run on nodes whose image
        # has the engines, not this package: the code travels with the job (Ray's py_modules, which
        # only a job's runtime_env may upload).
        runtime_env = {**(runtime_env or {}), "py_modules": project_modules()}
    else:
        env = {**LOCAL_RAY_ENV, **(runtime_env or {}).get("env_vars", {})}
        runtime_env = {**(runtime_env or {}), "env_vars": env}
    options = dict(address=target, runtime_env=runtime_env, log_to_driver=False, include_dashboard=False)
    with sigterm_handler_kept():
        if parsed is None:
            # Started here, in this thread: Ray's local processes die with the thread that started them.
            quiet_default_token_auth()
            with _free_node_ports():
                try:
                    ray.init(**options, **LOCAL_RAY_OPTIONS)
                except RuntimeError as exc:
                    raise port_clash(exc) or exc
            for hook in LOCAL_RAY_STARTED:
                hook(ray._private.worker.global_worker.node.session_name)
        else:
            check_reachable(parsed, origin)
            _init_within(options, answer_timeout_s(), f"{origin}: the Ray cluster at {parsed}")
    _joined[:] = [(target, ray.get_runtime_context().gcs_address)]


class ClusterTooSmall(UserError):
    """The joined Ray cluster can never hold the run's workers, however long the run waits."""


def check_room(per_worker: dict[str, float], workers: int) -> None:
    """Refuse, in one line, workers the joined cluster has too few resources for in all: Ray Train would
    wait for them (its worker group gives up after 60 s, and the stage's retry waits again)."""
    import ray

    total = ray.cluster_resources()
    short = [f"{amount * workers:g} {name} ({workers} x {amount:g})" for name, amount in per_worker.items()
             if total.get(name, 0) < amount * workers]
    if short:
        offered = ", ".join(f"{total.get(name, 0):g} {name}" for name in per_worker)
        raise ClusterTooSmall(
            f"the joined Ray offers {offered} in all, the training workers need {', '.join(short)}: add nodes, "
            "lower cluster.nnodes / cluster.devices_per_node, or drop --ray-address for a Ray of this host's own"
        )


# Ray's logger and words for the default it applies to a new local Ray (token auth, with a token it makes).
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_DEFAULT_NOTICE = "Token authentication is enabled for this Ray cluster."


class _DefaultTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_AUTH_DEFAULT_NOTICE)


def quiet_default_token_auth() -> None:
    """A local Ray started here keeps Ray's default, token auth, without Ray's warning on every run that
    it is on (`RAY_AUTH_MODE=disabled` opts out, as the Makefile does for the tests; that, and any other
    word of Ray's, still shows)."""
    logger = logging.getLogger(RAY_AUTH_LOGGER)
    if not any(isinstance(f, _DefaultTokenAuthNotice) for f in logger.filters):
        logger.addFilter(_DefaultTokenAuthNotice())


@contextmanager
def _free_node_ports() -> Iterator[None]:
    """ray.init has no option for the agent's port (FREE_PORTS), and the node parameters it builds
    default it to 52365: for the duration, they are built with FREE_PORTS, unless given."""
    from ray._private import parameter

    fixed = parameter.RayParams

    class FreePortParams(fixed):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**FREE_PORTS, **kwargs})

    parameter.RayParams = FreePortParams
    try:
        yield
    finally:
        parameter.RayParams = fixed


def port_clash(exc: BaseException) -> RayStartError | None:
    """A Ray that could not start because a port is taken, in one line naming the port and, where this
    user may see it, the process that holds it; None for any other failure."""
    text = str(exc)
    for log in re.findall(r"(/\S+/logs/\S+\.(?:out|err|log))", text)[:3]:  # "Please check <session>/logs/gcs_server.out"
        try:
            text += "\n" + Path(log).read_bytes()[-65536:].decode(errors="replace")
        except OSError:
            continue
    found = _PORT_IN_ERROR.search(text)
    if found is not None and _TAKEN.search(text):
        port = int(found.group(1))
    elif "Failed to start GCS" in text and (given := os.environ.get("RAY_GCS_SERVER_PORT", "")).isdigit() \
            and _taken(int(given)):
        port = int(given)
    else:
        return None
    holder = ""
    try:
        import psutil

        pids = {c.pid for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port
                and c.status == psutil.CONN_LISTEN and c.pid}
        holder = "".join(f" by pid {pid} ({psutil.Process(pid).name()})" for pid in sorted(pids)[:1])
    except Exception:  # psutil.AccessDenied, or gone meanwhile: the port alone is named
        pass
    given = [name for name in ("RAY_GCS_SERVER_PORT",) if os.environ.get(name) == str(port)]
    fix = f"unset {given[0]} so Ray picks a free port" if given else "free it, or stop the other Ray on this host"
    return RayStartError(f"the local Ray could not start: port {port} is already in use{holder}; {fix}")


def _taken(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def answer_timeout_s() -> float:
    """How long a cluster's head may take to answer: joining it, or its job API while a job runs."""
    return float(os.environ.get(RAY_CONNECT_TIMEOUT_VAR) or RAY_CONNECT_TIMEOUT_S)


def project_modules() -> list[str]:
    """The project's one package folder (`grpo_pipeline/`, above this module's), for a job's
    `py_modules`. Ray puts it first on every worker's path; being one uncommon name, it shadows none
    of the packages a node's image has (docs/layout.md)."""
    return [str(Path(__file__).resolve().parent.parent)]


def _init_within(options: dict, timeout_s: float, what: str) -> None:
    """ray.init on an existing cluster, given up after `timeout_s` (it starts no process here, so a
    helper thread may make the call)."""
    import ray

    outcome: dict[str, BaseException] = {}

    def init() -> None:
        try:
            ray.init(**options)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    connecting = threading.Thread(target=init, name="ray-connect", daemon=True)
    connecting.start()
    connecting.join(timeout_s)
    if connecting.is_alive():
        raise RayAddressError(f"{what} accepted a connection but did not answer as Ray within {timeout_s:.0f} s; "
                              "check the address names the head's GCS port (6379 by default) or ray:// port (a slow "
                              f"head: raise {RAY_CONNECT_TIMEOUT_VAR})")
    if "error" in outcome:
        raise outcome["error"]


@contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """ray.init makes SIGTERM `sys.exit` (and Ray's core installs a handler of its own that aborts
    at exit; ray.shutdown puts back the default action behind Python's back); the run's handler
    (Prefect's, which marks the run crashed and runs its hooks) must stay the one that answers a
    stop: it is set again. Signal handlers belong to the main thread."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def stop_ray_job() -> bool:
    """End this process's Ray job: Ray stops every actor and task it started (training workers,
    evaluation shards) and frees their devices; a local Ray started here stops too. False when
    this process was not connected."""
    import ray

    if not ray.is_initialized():
        return False
    ray.shutdown()
    return True


def end_job_actors() -> None:
    """Kill every actor this process's Ray job started (not detached ones), leaving Ray itself up: a
    thread blocked in `ray.get` on one of them (Ray Train's `fit`, waiting on its controller) gets an
    error back and ends. ray.shutdown under such a thread tears Ray's core from under it, and the
    process crashed (SIGSEGV) on a later attempt's ray.init. Actors an actor started die with it
    (Ray's ownership). Ray has no public call for this without a dashboard (its state API needs one):
    the GCS actor table and the core worker's kill, as `ray.kill` uses."""
    import ray
    from ray._private import state
    from ray._raylet import ActorID
    from ray.exceptions import ActorHandleNotFoundError

    if not ray.is_initialized():
        return
    worker = ray._private.worker.global_worker
    for actor_id, actor in state.actors(job_id=worker.current_job_id).items():
        if actor.get("IsDetached") or actor.get("State") == "DEAD":  # also those still being created
            continue
        try:
            worker.core_worker.kill_actor(ActorID.from_hex(actor_id), True)
        except ActorHandleNotFoundError:  # made by another actor (Ray Train's workers, by its controller): it
            pass  # dies with the one this process made


def disconnect_ray(within_s: float = DISCONNECT_TIMEOUT_S) -> bool:
    """Leave the Ray cluster this process is connected to (nothing when it is not), waiting at most
    `within_s`: a connection to a head that died would make Ray's core abort this process a minute
    later (its GCS client gives up). False when the disconnect did not end in time."""
    import ray

    if not ray.is_initialized():
        return True
    _joined.clear()
    with sigterm_handler_kept():  # Ray's core puts back the default SIGTERM action (kill) when it stops
        leaving = threading.Thread(target=ray.shutdown, name="ray-disconnect", daemon=True)
        leaving.start()
        leaving.join(within_s)
    return not leaving.is_alive()


def node_label(node: dict) -> str:
    return f"{node['NodeManagerAddress']} ({node['NodeID'][:8]})"


def _offering(resource: str, count: int) -> str:
    """The `ray start` option that makes a node offer `count` of `resource`."""
    return f"--num-gpus={count}" if resource == "GPU" else f"--resources='{{\"{resource}\": {count}}}'"


class ClusterNotReady(UserError):
    """The cluster did not offer the nodes and devices a run needs in time."""


def wait_for_nodes(
    resource: str, nnodes: int, per_node: int, timeout_s: float, note, poll_s: float = 1.0, note_every_s: float = 15.0,
) -> list[dict]:
    """Wait (at most `timeout_s`) until `nnodes` alive nodes each offer `per_node` of `resource`
    (`GPU`, or the custom `NPU`), saying every `note_every_s` what is still missing; return those
    nodes. Ray must already be initialised. A node that joins late is waited for; when time runs
    out, the error names each node and what it lacks."""
    import ray

    started = last_note = time.monotonic()
    while True:
        alive = [node for node in ray.nodes() if node["Alive"]]
        ready = [node for node in alive if node["Resources"].get(resource, 0) >= per_node]
        if len(ready) >= nnodes:
            return ready[:nnodes]
        waited = time.monotonic() - started
        short = [f"node {node_label(node)} offers {node['Resources'].get(resource, 0):g} {resource}" for node in alive
                 if node not in ready]
        status = (f"{len(ready)} of the {nnodes} nodes with {per_node} {resource} each are there"
                  + (f" ({'; '.join(short)})" if short else ""))
        if waited >= timeout_s:
            raise ClusterNotReady(
                f"the Ray cluster is not ready after {waited:.0f} s (cluster.ready_timeout_s={timeout_s:g}): {status}; "
                f"start the missing nodes (ray start --address=<head>:6379 {_offering(resource, per_node)}), or lower "
                "cluster.nnodes / cluster.devices_per_node"
            )
        if time.monotonic() - last_note >= note_every_s:
            note(f"waiting for the Ray cluster: {status} (waited {waited:.0f} s of {timeout_s:g})")
            last_note = time.monotonic()
        time.sleep(poll_s)
