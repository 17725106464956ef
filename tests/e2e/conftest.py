"""Shared by the whole-flow tests: one Prefect test harness (real API, SQLite) for the session, and one
standard Ray cluster of NPU nodes (tests/verl_cluster.py) with its job API for every verl test that can
share it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    # Persisted task results (the cross-run cache of the data and model stages) go to a fresh
    # directory, not ~/.prefect/storage.
    storage = tmp_path_factory.mktemp("prefect-results")
    with prefect_test_harness(server_startup_timeout=120), temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage}):
        yield


@pytest.fixture(autouse=True)
def restore_environ():
    """The environment stage applies the run's env to the driver (this process): undo it after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def no_foreign_ray_after():
    """A Ray connection a module opened itself (not the runs' own, which later modules reuse) is closed after
    it: a run of a later module in this process would otherwise join it as it is (connect_ray)."""
    yield
    import sys

    if "ray" in sys.modules:
        import ray

        from grpo_pipeline.cluster.ray_cluster import joined_by_connect_ray

        if ray.is_initialized() and not joined_by_connect_ray():
            ray.shutdown()


class StandardCluster:
    """The standard cluster (`npu_cluster()`: 2 nodes of 1 NPU, healthy images), started by the first test
    that asks for it and shut down after a test whose next one in this process does not ask for it
    (`pytest_runtest_teardown`), so that it is not left running beside the tests after them; at the
    session's end in any case."""

    def __init__(self):
        self.made = None

    def up(self):
        if self.made is None:
            import ray

            from verl_cluster import npu_cluster

            ray.shutdown()
            self.made = npu_cluster()
        return self.made

    def down(self) -> None:
        if self.made is not None:
            import ray

            ray.shutdown()
            self.made.shutdown()
            self.made = None


STANDARD = StandardCluster()


def _on_the_standard_cluster(item) -> bool:
    return item.path.parent == Path(__file__).parent and "cluster" in getattr(item, "fixturenames", ())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    torn_down = yield  # the test's own fixtures first
    # `nextitem` is this process's next test (pytest-xdist's too: `make test` runs a file whole in one of 2
    # processes, and the session's last user of the cluster may be in the other one), as pytest itself tears
    # down a module's fixtures; each process starts its own standard cluster.
    if nextitem is None or not _on_the_standard_cluster(nextitem):
        STANDARD.down()
    return torn_down


def pytest_sessionfinish(session):
    STANDARD.down()  # a run stopped early (-x, Ctrl-C) never reached its teardown


@pytest.fixture
def cluster():
    """The standard cluster, shared by the tests that ask for it one after another: every verl test on it
    tells its runs apart by their run names (`submissions`) and none stops, adds or changes a node. A test
    that kills the head, or needs other node images or another shape, starts a cluster of its own and says
    why."""
    import ray

    ray.shutdown()  # whatever an earlier test joined (a local Ray): this test's runs join this cluster
    return STANDARD.up()


@pytest.fixture
def jobs(cluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(cluster.address)


@pytest.fixture(scope="session")
def api_url(prefect_api) -> str:
    """The session's Prefect API as a URL for a subprocess: a command-line run given it (PREFECT_API_URL)
    starts no local API of its own. A test of the local API itself (its start, its stop with the run) gives
    none."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture
def world(api_url, stores) -> tuple[str, list[str]]:
    """What a command-line run that is not about its own Prefect API or stores is given: the session's API
    and its prepared stores."""
    return api_url, stores


@pytest.fixture
def gate(tmp_path) -> Path:
    """The stand-in's gate file (`env.STAND_IN_GATE`: the last step its job may start), opened wide at the end,
    so that a test that fails leaves no job held at it on the shared cluster."""
    path = tmp_path / "gate"
    yield path
    path.write_text("1000000")
