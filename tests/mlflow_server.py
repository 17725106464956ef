"""A real MLflow tracking server for the tracking tests: `mlflow server` over HTTP on 127.0.0.1, its
SQLite backend store and its artifact store under a temporary folder, as a team runs one.

    PYTHONPATH=$PWD python -m pytest -q tests/test_tracking.py
"""

from __future__ import annotations

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

# Starting takes ~25 s on a loaded 2-core machine (its imports and the database's migrations).
START_WAIT_S = 300


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def mlflow_server(root: Path, port: int | None = None) -> Iterator[str]:
    """The server's URL while it runs; stopped (and its workers with it) on exit. The same `root` and
    `port` again: the same server, restarted (its store and artifacts kept)."""
    port = port or free_port()
    log = open(root / "mlflow-server.log", "a")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        # A tracking server only: MLflow 3's server also starts its job runner (GenAI scorer jobs) and 8 huey
        # consumers, 9 processes each importing MLflow, which no tracker uses (the suite's MLflow processes took
        # 6.6% of its CPU: results-cpu-suite-processes.json).
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_WAIT_S
        while True:
            assert process.poll() is None, f"mlflow server exited: {(root / 'mlflow-server.log').read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            time.sleep(0.5)
        # It answers /health before its store: the first request that reads it (SQLite, its tables) took over
        # the 5 s a tracker's step is given on a loaded 2-core machine. One such request here, unbounded.
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1",
                                    timeout=max(5.0, deadline - time.monotonic())) as answer:
            assert answer.status == 200
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@contextmanager
def silent_server(port: int) -> Iterator[list[socket.socket]]:
    """A server that stopped answering, on 127.0.0.1:`port`: it takes every connection and never
    replies (the worst a tracker that went away can do: each request waits for its timeout). Yields
    the connections taken so far."""
    import threading

    taken: list[socket.socket] = []
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                taken.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield taken
    finally:
        stop.set()
        thread.join()
        listener.close()
        for connection in taken:
            connection.close()
