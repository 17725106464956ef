"""The project takes one name, `grpo_pipeline`: packages called `common`, `stages`, `profiles`, ...
of someone else's, first on the path, change nothing for it, and it changes nothing for them
(docs/layout.md, "Why one package").

    PYTHONPATH=$PWD python -m pytest -q tests/test_package_name.py

The others' packages fail when imported, so any import of the old top-level names, anywhere the
command line or a module reaches, fails the test. On Ray (e2e): a node whose image has packages of
those names runs the project's code, which the job ships (`py_modules`), and its workers still import
the image's own packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import house_map

pytestmark = pytest.mark.e2e  # each test runs the command line or an import sweep as a subprocess

ROOT = Path(__file__).resolve().parent.parent
# The names the project's folders have (the design card's), and `common` (one of them until issue 46):
# generic enough that others take them too.
TAKEN_ELSEWHERE = (*house_map.FLOORS, "common", "tests")


def others_packages(site: Path, body: str) -> Path:
    for name in TAKEN_ELSEWHERE:
        (site / name).mkdir(parents=True, exist_ok=True)
        (site / name / "__init__.py").write_text(body.format(name=name))
    return site


def run_beside(others: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python argv` from a folder holding the others' packages (the working directory, first on the
    path of `-m` and `-c`), with them also first on PYTHONPATH and the checkout after them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(others), str(ROOT)]), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    return subprocess.run([sys.executable, *argv], cwd=others, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def failing_others(tmp_path) -> Path:
    return others_packages(tmp_path / "theirs", "raise ImportError('the other {name}, not the project\\'s')\n")


def console_script() -> list[str]:
    """What the installed `grpo` script runs (pyproject.toml's [project.scripts]), as `-c`."""
    module, _, function = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["grpo"].partition(":")
    return ["-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


@pytest.mark.parametrize("program", [["-m", "grpo_pipeline"], ["-m", "grpo_pipeline.flows.grpo"], console_script()],
                         ids=["python -m grpo_pipeline", "python -m grpo_pipeline.flows.grpo", "grpo"])
def test_the_dry_run_plans_with_same_named_packages_first_on_the_path(failing_others, program):
    done = run_beside(failing_others, *program, "--model", "tiny", "--device", "cpu", "--dry-run", "--json",
                      "--run-dir", str(failing_others.parent / "runs"))
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["command"][:3] == ["python", "-m", "grpo_pipeline"] and plan["device"]["kind"] == "cpu"
    assert not (failing_others.parent / "runs").exists()  # a dry run writes nothing


def test_every_module_imports_with_same_named_packages_first_on_the_path(failing_others):
    """Every module of the package, each from grpo_pipeline/; and the others' `common` is still
    what `import common` finds (so the test did put it first)."""
    names = [name for name in house_map.modules() if not name.endswith("__main__")]
    script = (
        "import importlib, json, sys\n"
        "files = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}\n"
        "try:\n    import common\n    theirs = 'imported'\n"
        "except ImportError as exc:\n    theirs = str(exc)\n"
        "print(json.dumps({'files': files, 'theirs': theirs}))\n")
    done = run_beside(failing_others, "-c", script, *names)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert {name: Path(file).resolve() for name, file in found["files"].items()} == {
        name: path.resolve() for name, path in house_map.modules().items() if name in names}
    assert found["theirs"] == "the other common, not the project's"


def _whose_packages_on_this_worker() -> dict[str, str]:
    """Run on a Ray worker: which `common`, `stages`, ... it imports, and where the project's own is."""
    import importlib

    import grpo_pipeline

    return {"grpo_pipeline": grpo_pipeline.__file__,
            **{name: importlib.import_module(name).WHOSE for name in TAKEN_ELSEWHERE}}


def test_a_ray_node_whose_image_has_same_named_packages_runs_the_project_and_keeps_its_own(tmp_path, monkeypatch):
    import ray
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    from grpo_pipeline.cluster.node_tasks import check_paths_on_nodes
    from grpo_pipeline.cluster.ray_cluster import FREE_PORTS, connect_ray

    image = others_packages(tmp_path / "image-site", "WHOSE = \"the image's {name}\"\n")
    # Ray adds the driver's working directory to its workers' path: here that would be this checkout,
    # which a real cluster's node does not have.
    monkeypatch.chdir(tmp_path)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.shutdown()
    # The node's raylet, and every worker it starts, has only the image's packages on PYTHONPATH: the
    # project reaches the worker as the job's py_modules, which Ray puts first.
    cluster = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 1, "env_vars": {"PYTHONPATH": str(image)}})
    try:
        connect_ray(cluster.address, {})  # as a run joins a cluster: the job's py_modules are the package
        # The project's own node task, pickled by reference: the worker imports grpo_pipeline.cluster.node_tasks.
        assert check_paths_on_nodes({}, {"data.root": [str(tmp_path)]}, {}) == 1
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        try:
            found = ray.get(ray.remote(num_cpus=0)(_whose_packages_on_this_worker).remote(), timeout=300)
        finally:
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    finally:
        ray.shutdown()
        cluster.shutdown()
    shipped = Path(found.pop("grpo_pipeline")).parent
    assert shipped != house_map.PACKAGE, "the worker imported the checkout's package, not the one the job shipped"
    assert found == {name: f"the image's {name}" for name in TAKEN_ELSEWHERE}
