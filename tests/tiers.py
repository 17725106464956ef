"""The unit tier starts nothing: no subprocess, no server, no cluster (DESIGN.md, Tests).

tests/conftest.py applies `forbid_starts` to every test not marked `e2e`: while it runs, starting a
process (subprocess, multiprocessing, fork, posix_spawn: a Prefect API, `ray.init`, an MLflow server and
the command line as a subprocess all start one) or listening on a socket (any server, an in-thread HTTP
server included) raises `UnitTierStarted`, and the test fails when it ends even if the code under test
caught the error (the standard library's own probes, LIBRARY_PROBES, excepted). A test that needs to start one is marked `e2e`.
"""

from __future__ import annotations

import ctypes.util
import multiprocessing.process
import os
import platform
import socket
import subprocess
import sys

import pytest


ADVICE = "mark it e2e (pytestmark = pytest.mark.e2e, or @pytest.mark.e2e with a comment saying what it starts)"


class UnitTierStarted(RuntimeError):
    """A test of the unit tier tried to start a process or a server."""


# The standard library's own probes that run a tool and read its answer (`uname -p` for
# platform.processor(), ldconfig/gcc for ctypes.util.find_library): libraries call them at import, so
# whichever test imports one first would fail for it. They start no process of the test's.
LIBRARY_PROBES = {platform.__file__, ctypes.util.__file__}


def _library_probe() -> bool:
    """Whether the start was asked for by one of the standard library's probes (LIBRARY_PROBES)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in LIBRARY_PROBES:
            return True
        frame = frame.f_back
    return False


def forbid_starts(monkeypatch: pytest.MonkeyPatch, test_id: str) -> list[str]:
    """Make every way of starting a process or a server raise for the rest of the test; returns the list
    of what was tried (the hooks below fail the test when it is not empty)."""
    tried: list[str] = []

    def refuse(what: str, original):
        def refused(*args, **kwargs):
            if _library_probe():
                return original(*args, **kwargs)
            tried.append(what)
            raise UnitTierStarted(f"{test_id} is in the unit tier and {what}: {ADVICE}")

        return refused

    monkeypatch.setattr(subprocess.Popen, "_execute_child",
                        refuse("started a subprocess", subprocess.Popen._execute_child))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        refuse("started a process (multiprocessing)", multiprocessing.process.BaseProcess.start))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"started a process (os.{name})", getattr(os, name)))
    monkeypatch.setattr(socket.socket, "listen", refuse("started a server (a socket listening)", socket.socket.listen))
    return tried


def _unit_tier_guarded(item):
    """Setting up and running a test of the unit tier (its fixtures of any scope included) with every way
    of starting a process or a server refused (tests/tiers.py); what was tried fails the test even where the
    code under test caught the refusal."""
    if item.get_closest_marker("e2e") is not None:
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        tried = item.starts_tried = forbid_starts(patch, item.nodeid)
        result = yield
    if tried:
        pytest.fail(f"{item.nodeid} is in the unit tier and {tried[0]}: {ADVICE}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _unit_tier_guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _unit_tier_guarded(item))
