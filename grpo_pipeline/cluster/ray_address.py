"""A Ray cluster's address: its form, checked when the run is requested, and an answer from its head
(as Ray, cluster/ray_probe.py), before anything starts, so a typo or a port that is not Ray's fails in
seconds with the address in the message, not minutes later inside Ray's own retries.

    python -m grpo_pipeline --model tiny --device cpu --ray-address head-node:6379
"""

from __future__ import annotations

import os
import re
import socket
from typing import NamedTuple

from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.secrets import redact_url_credentials

# Reaching a cluster's head: a TCP connect first (a wrong host or port fails in seconds), then
# Ray's own connection, which would otherwise retry for many minutes against a port that answers
# but is not Ray's; a slow head may need more (GRPO_PIPELINE_RAY_CONNECT_TIMEOUT_S).
TCP_PROBE_TIMEOUT_S = 10
# Ports Ray listens on by default, by address scheme (a bare host:port must name its port).
DEFAULT_PORTS = {"ray": 10001, "http": 8265, "https": 443}
_PORT_NAMES = {None: ("GCS port", 6379), "ray": ("Ray client port", DEFAULT_PORTS["ray"])}
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+")
class RayAddressError(UserError):
    """A Ray address that is malformed or cannot be reached."""


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
    from grpo_pipeline.cluster.ray_probe import ask_ray

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
    from grpo_pipeline.cluster.ray_probe import dashboard_address

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
