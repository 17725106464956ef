"""Shared by the whole-flow tests: one Prefect test harness (real API, SQLite) for the session; for a module
of verl tests, its own Ray cluster of NPU nodes (tests/verl_cluster.py) and that cluster's job API."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="module")
def cluster():
    import ray

    from verl_cluster import npu_cluster

    ray.shutdown()  # whatever an earlier test joined: this module's runs join this cluster
    made = npu_cluster()
    yield made
    ray.shutdown()
    made.shutdown()


@pytest.fixture(scope="module")
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
