"""A real Prefect server with its UI, the deployments of prefect.yaml, a process worker, and a real
headless Chromium driven by playwright: the Prefect UI as a person uses it.

    make test      # installs playwright (PyPI) and @sparticuz/chromium (npm), then runs this tier too

The browser is npm's `@sparticuz/chromium` (playwright's own download host is not reachable here);
`GRPO_CHROMIUM` may name another Chromium. On a host without node and npm the tier is skipped, saying
so; CI sets GRPO_REQUIRE_BROWSER=1, which makes that a failure instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
CHROMIUM_PACKAGE = REPO / ".venv" / "browser" / "node_modules" / "@sparticuz" / "chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-zygote", "--disable-dev-shm-usage", "--use-gl=angle",
                 "--use-angle=swiftshader"]
SERVER_START_S = 240


def chromium_executable() -> str:
    if path := os.environ.get("GRPO_CHROMIUM"):
        return path
    missing = None
    if not shutil.which("node"):
        missing = "node"
    elif not CHROMIUM_PACKAGE.is_dir():
        missing = f"{CHROMIUM_PACKAGE.relative_to(REPO)} (make setup installs it with npm)"
    if missing is None:
        try:
            import playwright  # noqa: F401
        except ImportError:
            missing = "playwright (pip)"
    if missing:
        if os.environ.get("GRPO_REQUIRE_BROWSER"):
            pytest.fail(f"the browser tier needs {missing}")
        pytest.skip(f"the browser tier needs {missing}")
    # The package unpacks its Chromium into the temp folder and prints where.
    done = subprocess.run(["node", "-e", f"require({json.dumps(str(CHROMIUM_PACKAGE))}).executablePath()"
                                         ".then(p => console.log(p))"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _prefect(env: dict, *args: str, timeout: float = 300) -> str:
    done = subprocess.run([*PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# Module scope, not session: playwright's sync API runs an event loop on the main thread while it is
# open, and Prefect's sync-compatible calls in every later test module would see it and return
# coroutines ("'coroutine' object is not subscriptable").
@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """A Prefect server with its UI on 127.0.0.1 (SQLite under a fresh PREFECT_HOME; its services run,
    as a real server's do, except the scheduler: no scheduled run of a deployment competes with the
    test's), `prefect deploy --all`, and a process worker on the `local` queue. Yields what the tests
    need: the UI's base URL, the env that points at the server, the worker's process."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": f"{base}/api",
           "PREFECT_UI_API_URL": f"{base}/api", "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
           "RAY_AUTH_MODE": "disabled", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    log = open(home / "server.log", "w")
    server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        _prefect(env, "work-pool", "create", "grpo-process", "--type", "process")
        _prefect(env, "deploy", "--all", "--no-prompt")
        worker = subprocess.Popen([*PREFECT, "worker", "start", "--pool", "grpo-process", "--work-queue", "local"],
                                  cwd=REPO, env=env, stdout=open(home / "worker.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        yield {"base": base, "env": env, "home": home, "worker": worker, "api": lambda call: _api(env, call)}
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)
        log.close()


@pytest.fixture(scope="module")
def browser(ui):
    from playwright.sync_api import sync_playwright

    executable = chromium_executable()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1600})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        yield page
    finally:
        context.close()


def _api(env: dict, call):
    """`call(client)` against the UI's server, from the test's process (Prefect's sync client: playwright's
    sync API holds this thread's event loop)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        return call(client)


@pytest.fixture(scope="module")
def headless_chromium():
    """The same Chromium without the Prefect server of `ui`: for pages of other tools (the MLflow UI)."""
    from playwright.sync_api import sync_playwright

    executable = chromium_executable()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
