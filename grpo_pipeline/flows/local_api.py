"""Prefect's API on 127.0.0.1 for one command-line run, when no PREFECT_API_URL is set.

Without an API URL, Prefect would start its temporary server inside the flow run: importing the
server takes this process ~6 s and the server ~6 s more, one after the other, before the first
stage. Started here as a subprocess first thing (`prefect server start`, SQLite under
PREFECT_HOME, no UI, no background services), it comes up while the run is validated and the
stages are imported. It stops when the run ends, and on Linux also when this process is killed
outright (the kernel sends it SIGTERM: `PR_SET_PDEATHSIG`); elsewhere the next run's lease reaper
ends it (flows/lease.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 120


class LocalAPIError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalAPI:
    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = log
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
            # Its own session, so a Ctrl-C in the terminal reaches the run (which stops it in order), not it.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port),
                 "--no-services", "--no-ui", "--analytics-off"],
                stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                preexec_fn=_die_with_parent,
            )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-2000:] if self.log.exists() else ""
                raise LocalAPIError(f"Prefect's local API did not start; set PREFECT_API_URL to a running "
                                    f"server, or see its log:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.unlink(missing_ok=True)


@contextmanager
def local_api_unless_configured(log: Path) -> Iterator[LocalAPI | None]:
    """The local API (its output in `log`), with this process (and so Ray's workers) pointed at it,
    unless the user set PREFECT_API_URL. Enter before Prefect is imported: it reads the URL once,
    at import."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    api = LocalAPI(log)
    os.environ["PREFECT_API_URL"] = api.url
    # This API has no UI and ends with the run: Prefect's "View at <url>" line would point at nothing.
    hidden_ui = "PREFECT_UI_URL" not in os.environ
    if hidden_ui:
        os.environ["PREFECT_UI_URL"] = ""
    try:
        yield api
    finally:
        try:
            _flush_to(api)
        finally:  # whatever the flush does, the server must not outlive the run
            api.stop()
            os.environ.pop("PREFECT_API_URL", None)
            if hidden_ui:
                os.environ.pop("PREFECT_UI_URL", None)


def _flush_to(api: LocalAPI) -> None:
    """Send the run's last log lines and events while the API is there to take them (at exit,
    Prefect would send them to a stopped API, and wait)."""
    if api.process.poll() is None:
        flush_prefect()


def flush_prefect() -> None:
    """Send what Prefect still holds (log lines, events) to its API now, not at interpreter exit."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    EventsWorker.drain_all(timeout=5)
