"""Can the hub be reached from here? Asked before a run starts (stages/plan.py) for what is not in the
store yet, and again when a transfer fails to connect (store/hub.py).

    HF_ENDPOINT=http://127.0.0.1:9 .venv/bin/python -m grpo_pipeline --model tiny --device cpu --set data.dataset=gsm8k

A name that does not resolve, or a host that refuses the connection, is not a fault a retry minutes later
gets past: after a few tries over a few seconds it is a refusal in one line, naming the host and the
ways around it (another network, a mirror in HF_ENDPOINT, a local copy), with the hub settings below.
The hub's client goes through the proxy the environment names for it, and so does this check.
Light on purpose (no hub client imported): planning a run stays fast.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from grpo_pipeline.errors import UserError

DEFAULT_ENDPOINT = "https://huggingface.co"
# Reaching the hub's first hop: tries, seconds each, the pause between them (about 11 s at most in all).
REACH_TRIES, REACH_TIMEOUT_S, REACH_PAUSE_S = 3, 3.0, 1.0


class HubUnreachable(UserError):
    """The hub cannot be reached from here, after a short bounded retry: said at once, never retried."""


def hub_endpoint(environ: Mapping[str, str]) -> str:
    return (environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline(environ: Mapping[str, str]) -> bool:
    return environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def first_hop(endpoint: str, environ: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) a connection to `endpoint` goes to first: the proxy for its scheme unless NO_PROXY
    exempts the host (as the hub's HTTP client reads them), else the endpoint itself."""
    url = urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    named = {k.lower(): v for k, v in environ.items() if v}
    proxy = named.get(f"{url.scheme}_proxy") or named.get("all_proxy")
    exempt = [h.strip().lstrip(".") for h in named.get("no_proxy", "").split(",") if h.strip()]
    if proxy and not any(h == "*" or host == h or host.endswith("." + h) for h in exempt):
        hop = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return hop.hostname or "", hop.port or 80
    return host, port


def reach_problem(endpoint: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the hub at `endpoint` cannot be reached from here after REACH_TRIES tries; None once a
    connection is accepted."""
    host, port = first_hop(endpoint, os.environ if environ is None else environ)
    problem = None
    for attempt in range(REACH_TRIES):
        try:
            with socket.create_connection((host, port), timeout=REACH_TIMEOUT_S):
                return None
        except socket.gaierror:
            problem = f"the name {host} does not resolve"
        except ConnectionRefusedError:
            problem = f"{host}:{port} refuses connections"
        except OSError as exc:  # a timeout, no route to the host
            problem = f"{host}:{port} does not answer ({exc.strerror or type(exc).__name__})"
        if attempt + 1 < REACH_TRIES:
            time.sleep(REACH_PAUSE_S)
    return problem


def unreachable(what: str, problem: str, endpoint: str, local_copy: str, store_entry: str) -> HubUnreachable:
    """The refusal: the problem and the ways around it; the hub settings and the store on the line below."""
    return HubUnreachable(
        f"cannot fetch {what}: {problem}; use a network that reaches it, a mirror in HF_ENDPOINT, or {local_copy}\n"
        f"HF_ENDPOINT={endpoint}; HF_HUB_OFFLINE=1 only serves what is in the store, and {store_entry} has no copy")
