"""The run's Ray: its address, the connection (bounded in time), its end, and the nodes it waits for.

    python -m grpo_pipeline --model tiny --device cpu --ray-address head-node:6379

An address is checked for its form when the run is requested and for an answer from the head, as
Ray (common/ray_probe.py), before anything starts, so a typo or a port that is not Ray's fails in
seconds with the address in the message, not minutes later inside Ray's own retries. A cluster that
stops answering later is let go of within a bounded time: a Ray core client left connected to a dead
head aborts its process a minute later. What runs on every node is common/node_tasks.py.
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
from typing import NamedTuple

from grpo_pipeline.common.errors import UserError
from grpo_pipeline.profiles.secrets import redact_url_credentials

# Reaching a cluster's head: a TCP connect first (a wrong host or port fails in seconds), then
# Ray's own connection, which would otherwise retry for many minutes against a port that answers
# but is not Ray's; a slow head may need more (GRPO_PIPELINE_RAY_CONNECT_TIMEOUT_S).
TCP_PROBE_TIMEOUT_S = 10
RAY_CONNECT_TIMEOUT_VAR, RAY_CONNECT_TIMEOUT_S = "GRPO_PIPELINE_RAY_CONNECT_TIMEOUT_S", 60.0
# Ports Ray listens on by default, by address scheme (a bare host:port must name its port).
DEFAULT_PORTS = {"ray": 10001, "http": 8265, "https": 443}
_PORT_NAMES = {None: ("GCS port", 6379), "ray": ("Ray client port", DEFAULT_PORTS["ray"])}
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
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+")


class RayAddressError(UserError):
    """A Ray address that is malformed or cannot be reached."""


class ClusterLost(UserError):
    """The run's Ray cluster stopped answering while the run used it."""


class RayAddress(NamedTuple):
    scheme: str | None
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme + '://' if self.scheme else ''}{self.target}"

    @property
    def target(self) -> str:
        """host:port, as gRPC and sockets take it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def cluster_address(given: str | None) -> tuple[str | None, str]:
    """The run's Ray cluster and where it was named: --ray-address (the request's field), else
    `RAY_ADDRESS` (a deployment's `job_variables.env`); None when the run starts a Ray of its own."""
    address, origin = (given, "--ray-address") if given else (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    return (None if not address or address.strip() == "local" else address.strip()), origin


def parse_ray_address(address: str, origin: str = "--ray-address") -> RayAddress | None:
    """`host:port`, `ray://host[:port]`, `http(s)://host[:port]` or `[IPv6]:port`; None for `auto`
    and `local` (Ray finds or starts the cluster itself). Credentials are refused: Ray's clients do
    not use them, and the address is stored by Prefect and shown in its UI and the NO_PROXY list
    (Ray authenticates with RAY_AUTH_TOKEN, exported where the flow runs)."""
    text = address.strip()
    if text in ("auto", "local"):
        return None
    how = "use host:port (the GCS, e.g. head-node:6379) or ray://host:10001"
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = None, text
    elif scheme not in DEFAULT_PORTS:
        raise RayAddressError(f"{origin}: unknown scheme {scheme!r}; {how}")
    rest = rest.split("/", 1)[0]
    if "@" in rest or "%" in rest:  # `u:pw%40head` is `u:pw@head` to a client that unescapes it
        raise RayAddressError(
            f"{origin}: a Ray address carries no credentials nor %-escapes (they would be stored and shown with it); "
            "remove the user:password@ part and export RAY_AUTH_TOKEN where the flow runs if the cluster uses token auth"
        )
    bracketed = re.fullmatch(r"\[([^\]]*)\](?::(.*))?", rest)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
        host_ok = bool(_IPV6.fullmatch(host))
    else:
        host, _, port = rest.partition(":") if rest.count(":") <= 1 else (rest, "", None)
        port = port or None
        host_ok = bool(_HOST.fullmatch(host))
    if not host_ok:
        raise RayAddressError(f"{origin}={redact_url_credentials(text)!r} names no valid host; {how}")
    if port is None:
        if scheme is None:
            raise RayAddressError(f"{origin}={text!r} has no port; {how}")
        return RayAddress(scheme, host, DEFAULT_PORTS[scheme])
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RayAddressError(f"{origin}={text!r}: port {port!r} is not a number from 1 to 65535; {how}")
    return RayAddress(scheme, host, int(port))


def check_reachable(address: RayAddress, origin: str = "--ray-address") -> None:
    """A TCP connection to the head, then one call only Ray answers (the GCS's, or the Ray client
    server's for ray://), so a wrong host, port or service fails in seconds with its address."""
    from grpo_pipeline.common.ray_probe import ask_ray

    try:
        with socket.create_connection((address.host, address.port), timeout=TCP_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        if isinstance(exc, TimeoutError):
            reason = f"no answer in {TCP_PROBE_TIMEOUT_S} s"
        else:
            reason = exc.strerror or type(exc).__name__
        raise RayAddressError(
            f"{origin}: cannot reach the Ray cluster at {address} ({reason}); start it (ray start --head) or fix the address"
        ) from None
    if address.scheme not in (None, "ray"):
        return
    answer, port = ask_ray(address.target, address.scheme == "ray"), _PORT_NAMES[address.scheme]
    if answer.kind == "token":
        raise RayAddressError(f"{origin}: the Ray cluster at {address} asks for its token: export RAY_AUTH_MODE=token and "
                              "RAY_AUTH_TOKEN (the cluster's) where the flow runs")
    if answer.kind == "other":
        raise RayAddressError(f"{origin}: {address} is not a Ray cluster's {port[0]}: {answer.detail}; give the head's "
                              f"{port[0]} ({port[1]} by default, printed by ray start --head)")


def job_api_url(address: str | None) -> str | None:
    """The cluster's job API (its dashboard, http://host:port) for `address`: an http(s) address is
    one already; a GCS address's is recorded in the GCS (asked over gRPC, no Ray client left behind);
    anything else (ray://, auto) is left to Ray's job client. None: the head runs no dashboard."""
    from grpo_pipeline.common.ray_probe import dashboard_address

    found, origin = cluster_address(address)
    parsed = parse_ray_address(found or "auto", origin)
    if parsed is None or parsed.scheme is not None:
        return found
    try:
        dashboard = dashboard_address(parsed.target)
    except Exception as exc:  # grpc.RpcError: the GCS did not answer
        raise RayAddressError(f"{origin}: the Ray cluster at {parsed} did not say where its job API is "
                              f"({type(exc).__name__}); check that its head is up (ray status)") from None
    return f"http://{dashboard}" if dashboard else None


def connect_ray(address: str | None, runtime_env: dict | None) -> None:
    """Join the run's Ray cluster (or start a local one) once per process, with the run's env."""
    import ray

    if ray.is_initialized():
        return
    # No address: a fresh local Ray ("local"), never whatever /tmp/ray/ray_current_cluster names
    # (a cluster that may be long dead: ray.init would wait on it). A Ray started here runs no
    # dashboard: on a small machine it takes a third of the CPU training needs. A cluster keeps its own.
    found, origin = cluster_address(address)
    target = found or "local"
    parsed = parse_ray_address(target, origin)
    if parsed is not None:
        # Tasks of this project's code (node checks, cluster evaluation) run on nodes whose image
        # has the engines, not this package: the code travels with the job (Ray's py_modules, which
        # only a job's runtime_env may upload).
        runtime_env = {**(runtime_env or {}), "py_modules": project_modules()}
    options = dict(address=target, runtime_env=runtime_env, log_to_driver=False, include_dashboard=False)
    with sigterm_handler_kept():
        if parsed is None:
            # Started here, in this thread: Ray's local processes die with the thread that started them.
            quiet_default_token_auth()
            with _free_node_ports():
                try:
                    ray.init(**options)
                except RuntimeError as exc:
                    raise port_clash(exc) or exc
            for hook in LOCAL_RAY_STARTED:
                hook(ray._private.worker.global_worker.node.session_name)
            return
        check_reachable(parsed, origin)
        _init_within(options, answer_timeout_s(), f"{origin}: the Ray cluster at {parsed}")


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


def disconnect_ray(within_s: float = DISCONNECT_TIMEOUT_S) -> bool:
    """Leave the Ray cluster this process is connected to (nothing when it is not), waiting at most
    `within_s`: a connection to a head that died would make Ray's core abort this process a minute
    later (its GCS client gives up). False when the disconnect did not end in time."""
    import ray

    if not ray.is_initialized():
        return True
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
