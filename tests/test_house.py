"""The house rules DESIGN.md states, kept by a test: modules about one thing stay small, only
backends/ knows a backend by its name, every package imports only from the floors below it, no
modules import each other around a loop, nothing below tasks/ imports Prefect, only the tracker classes
name a tracker, and docs/layout.md is the map the modules make (tests/house_map.py). Paths are relative to grpo_pipeline/."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import house_map

PACKAGE = house_map.PACKAGE
PACKAGES = house_map.FLOORS
MAX_MODULE_LINES = 400


def modules(*packages: str) -> list[Path]:
    return [path for package in packages for path in sorted((PACKAGE / package).rglob("*.py"))]


def test_no_module_is_past_the_size_that_asks_for_a_split():
    long = {house_map.shown(p): n for p in modules(*PACKAGES) if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_nothing_outside_backends_branches_on_a_backends_name():
    branch = re.compile(r"\.backend\s*(==|!=|in)\s|backend\s*==\s*[\"'](verl|local)[\"']")
    found = [f"{house_map.shown(p)}:{i}" for p in modules(*(f for f in PACKAGES if f != "backends"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []


# The training engines' own modules: their classes (profiles/engine.py) and what each floor registers for them by
# their strategy, as verl registers its engines (the planner's plans, verl's side).
ENGINE_MODULES = ("profiles/engine.py", "planner/engines.py", "planner/memory.py", "planner/fsdp.py", "backends/verl/engines.py")


def test_nothing_outside_the_engines_own_modules_asks_which_engine_it_holds():
    """`engine.strategy` was a string every reader compared (15 branches in 7 files): each engine is now a class
    of its own (`MegatronEngine | FsdpEngine`) whose plan and verl rendering are looked up by its strategy."""
    branch = re.compile(r"strategy\s*(==|!=)|\.strategy\s+(not\s+)?in\b|isinstance\([^)]*\b(Megatron|Fsdp)Engine\b")
    found = [f"{house_map.shown(p)}:{i}" for p in modules(*PACKAGES) if house_map.shown(p) not in ENGINE_MODULES
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []


def test_a_steps_sequence_count_is_computed_in_one_place():
    """`train_batch_size x rollout_n` was recomputed in 9 files: `RunProfile.sequences_per_step` (and
    `sequences_per_update`, the mini batch's) compute it, once, in profiles/schema.py."""
    product = re.compile(r"\b(train_batch_size|ppo_mini_batch_size|prompts)\s*\*|\*\s*[\w.]*\brollout_n\b|\brollout_n\s*\*")
    found = [f"{house_map.shown(p)}:{i}" for p in modules(*PACKAGES)
             for i, line in enumerate(p.read_text().splitlines(), 1) if product.search(line)]
    assert [place.split(":")[0] for place in found] == ["profiles/schema.py"] * 2, found


def test_every_package_has_a_floor():
    assert set(house_map.packages()) == set(house_map.FLOORS), (
        "a new top-level package gets its floor in tests/house_map.py's FLOORS")


def test_no_import_goes_up_a_floor():
    """Each package imports only from the floors below it (tests/house_map.py FLOORS, drawn in
    docs/layout.md; errors.py and progress.py stand below them all): store/ is read by everything
    above, generation/ by the backends' rollouts and the evaluation stage; an import back up would
    make them unreadable apart (and Ray job packaging used to import every package only to find its
    folder). Imports inside functions count too."""
    found = house_map.upward_imports()
    assert found - set(house_map.PENDING) == set(), "an import goes up a floor"
    assert set(house_map.PENDING) - found == set(), "gone: delete its line from tests/house_map.py's PENDING"


def test_no_modules_import_each_other_around_a_loop():
    assert house_map.cycles(house_map.edges_without_pending()) == []


def test_the_layout_doc_is_the_map_the_modules_make():
    """docs/layout.md's picture and module tables are generated; re-run `tests/house_map.py --write`."""
    text = house_map.DOC.read_text()
    assert text == house_map.current_doc(text), "docs/layout.md is not current: run .venv/bin/python tests/house_map.py --write"
    assert all(house_map.first_sentence(path) for path in house_map.modules().values()), "a module without a docstring"


def test_nothing_below_tasks_imports_prefect():
    """Prefect is the tasks' and the flows' business: the stages, backends and everything below them
    run without it (the dry run plans a run before Prefect is imported; Ray workers never call it)."""
    below = PACKAGES[:PACKAGES.index("tasks")]
    found = [house_map.shown(p) for p in modules(*below) for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, (ast.Import, ast.ImportFrom))
             and any(name.split(".")[0] == "prefect" for name in
                     ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]))]
    assert found == []


def test_the_package_a_ray_job_carries_is_the_projects_one_package():
    from grpo_pipeline.cluster.ray_cluster import project_modules

    assert [Path(folder) for folder in project_modules()] == [PACKAGE]
    assert (PACKAGE / "__init__.py").is_file()


def calls_of(name: str, *packages: str) -> list[str]:
    """`module:line` of each call of a function called `name` (plain or as an attribute)."""
    return [f"{house_map.shown(path)}:{node.lineno}" for path in modules(*packages)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))]


def test_a_runs_generation_path_is_decided_in_one_place():
    """generation/plan.py decides it (`plan_generation`), once per run, at one call (issue 46: there were
    four, one of them the flow's own for a run from the form): in the planning of every run's plan;
    everything else reads the `GenerationPlan` it is handed, never the profile's `generation` section
    (docs/layout.md walks it)."""
    assert len(calls_of("plan_generation", *PACKAGES)) == 1, calls_of("plan_generation", *PACKAGES)
    section = re.compile(r"\.generation\.(engine|decoder|cache|compile|attn_implementation|steps_per_generation)\b")
    read = [f"{house_map.shown(p)}:{i}" for p in modules(*PACKAGES) if p.parts[-2:] != ("generation", "plan.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if section.search(line)]
    assert read == []


def test_only_the_tracker_classes_name_a_tracker():
    """Each experiment tracker is one class of profiles/trackers/ that owns its name, label, package, settings,
    folder, link and verl logger; everything else asks the registry. A tracker's name as a string anywhere
    else (a table keyed by it, a `name == "mlflow"` branch) is the second place a new tracker must be added.
    Words in prose (docstrings, messages) are not names: only a string that is exactly one counts."""
    from grpo_pipeline.profiles.trackers import TRACKERS

    names = {*TRACKERS, "swanlab", "clearml", "comet", "neptune", "aim"}  # and those a tracker may be named next
    found = [f"{house_map.shown(p)}:{node.lineno} {node.value!r}" for p in modules(*PACKAGES)
             if p.parent.name != "trackers" for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names]
    assert found == []


def test_the_ground_floor_stands_at_the_package_root():
    """The ground floor's modules are the package's own (`grpo_pipeline/errors.py`), not a folder's:
    one inside a folder (it was inside common/) makes every floor below that folder import up into
    it, as a tool that draws folders sees the house."""
    assert [g for g in house_map.GROUND if g.count(".") != 1] == []


def test_no_folder_is_named_for_no_concern():
    """A folder named for no concern (`common/`, `utils/`) gathers whatever has no home until it is
    the largest room of the house; name a folder for what its modules are about (docs/layout.md, "The
    rooms")."""
    assert [p for p in house_map.packages() if p in {"common", "utils", "util", "misc", "helpers", "shared", "lib"}] == []


def test_the_ground_floor_imports_nothing_of_the_project():
    graph = house_map.graph()
    assert {ground: graph[ground] for ground in house_map.GROUND} == {ground: set() for ground in house_map.GROUND}


# A run-folder name that another module spells for a file of its own, not the run folder's.
NOT_THE_RUN_FOLDERS = {("rewards/verl_entry.py", "plan.json"): "the reward package's plan, inside the verl job's folder"}


def test_each_run_folder_name_is_defined_in_one_module():
    """run/folder.py's `RunFolder` names every file and folder a run writes; a module that spells one
    itself (`METRICS = "metrics.jsonl"`, `run_dir / "checkpoints"`) keeps writing or reading the old
    name when it changes. A file's name is found anywhere in the code; a folder's (`eval`, `ray`: words
    used for other things too) where a path is joined with it."""
    from grpo_pipeline.run.folder import RunFolder

    names = {value for key, value in vars(RunFolder).items() if key.isupper() and isinstance(value, str)}
    files, folders = {n for n in names if "." in n}, {n for n in names if "." not in n}
    home = PACKAGE / "run" / "folder.py"
    found = []
    for path in [*PACKAGE.glob("*.py"), *modules(*PACKAGES)]:
        if path == home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            joined = node.right if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) else None
            if isinstance(node, ast.Constant) and node.value in files or (
                    isinstance(joined, ast.Constant) and joined.value in folders):
                name = node.value if isinstance(node, ast.Constant) else joined.value
                if (house_map.shown(path), name) not in NOT_THE_RUN_FOLDERS:
                    found.append(f"{house_map.shown(path)}:{node.lineno}: {name}")
    assert found == [], "name it by RunFolder (run/folder.py)"


@pytest.mark.e2e  # runs ruff as a subprocess
def test_no_module_uses_a_name_nothing_defines():
    """pyflakes' undefined-name family over the package, bench/, tools/ and tests/: a lost import in a
    path only a GPU run or a bench takes (the worker's phase timing lost `Path` in a move) fails here."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    root = PACKAGE.parent
    found = subprocess.run([ruff, "check", "--no-cache", "--select", "F821,F822,F823,F811", "--output-format",
                            "concise", "grpo_pipeline", "bench", "tools", "tests"], cwd=root, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_every_door_into_a_run_plans_it_with_the_one_function_and_nothing_after_recomputes_a_part():
    """Issue 46: a run from the form planned inside the flow, task by task (five `plan.x if plan else ...`
    in the flow, three "planned or recompute" fallbacks in its tasks), so its plan was not the one the
    dry run prints. Now `plan_run` makes every run's plan (the command line's, before Prefect starts, or
    the flow's first task), the run record holds it (never None), and the tasks after it are handed
    their part: none of them detects the device, resolves the profile or the environment again."""
    import typing

    from grpo_pipeline.stages.plan import RunPlan
    from grpo_pipeline.tasks.run_record import RunRecord, RunResult

    callers = {call.split("/")[0] for call in calls_of("plan_run", *PACKAGES)}
    assert callers == {"flows", "tasks"}  # the command line (dry run, preflight, a run) and the flow's first task
    assert len(calls_of("plan_run", "tasks")) == 1
    planning = ("detect_device", "profile_for", "checked_profile", "check_plan", "resolve_environment", "run_dir_for",
                "plan_generation")
    assert [call for name in planning for call in calls_of(name, "flows", "tasks")] == []
    fallbacks = [f"{house_map.shown(path)}:{node.lineno}" for path in modules("flows", "tasks")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.IfExp)
                 and {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)} & {"plan", "planned"}]
    assert fallbacks == []
    fields = typing.get_type_hints(RunRecord)
    assert fields["plan"] is RunPlan and fields["result"] is RunResult


def trl_private_names() -> set[str]:
    """The private methods and attributes of TRL's GRPOTrainer and transformers' Trainer below it."""
    import inspect

    import transformers.trainer
    import trl.trainer.grpo_trainer
    from trl import GRPOTrainer

    names = {name for name in dir(GRPOTrainer) if name.startswith("_") and not name.startswith("__")}
    for module in (trl.trainer.grpo_trainer, transformers.trainer):
        names |= set(re.findall(r"self\.(_[a-z]\w*)", inspect.getsource(module)))
    return names


def test_trls_private_names_are_touched_in_one_module():
    """The local backend overrides, wraps, calls or reads TRL's trainer below its public API only in
    backends/local/trl_hooks.py, which pins each name to the TRL releases it was checked on (its test fails
    on a release whose signature moved); nowhere is a trainer class put together at run time with type()."""
    from grpo_pipeline.backends.local.trl_hooks import PRIVATE_ATTRIBUTES, PRIVATE_METHODS

    private = trl_private_names()
    found, composed = [], []
    for path in modules("backends/local"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type" and len(node.args) == 3:
                composed.append(f"{house_map.shown(path)}:{node.lineno}")
            name = (node.attr if isinstance(node, ast.Attribute) else node.name if isinstance(node, ast.FunctionDef)
                    else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if name in private:
                (found if path.name != "trl_hooks.py" else []).append(f"{house_map.shown(path)}:{node.lineno} {name}")
            if path.name == "trl_hooks.py" and name in private and name not in {*PRIVATE_METHODS, *PRIVATE_ATTRIBUTES}:
                found.append(f"{house_map.shown(path)}:{node.lineno} {name} is not pinned in PRIVATE_METHODS/_ATTRIBUTES")
    assert found == [] and composed == []


def test_a_unit_test_that_starts_a_process_or_a_server_fails(request, tmp_path):
    """The tiers are honest (tests/tiers.py, applied by tests/conftest.py to every test not marked e2e):
    in the unit tier a subprocess (the command line, a Prefect API, `ray.init`, an MLflow server all
    start one), a multiprocessing process, a fork and a listening socket (any server, an in-thread one
    included) are refused, and a refusal the code under test swallows still fails the test."""
    import multiprocessing
    import socket
    import subprocess
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from tiers import UnitTierStarted

    with pytest.raises(UnitTierStarted, match="is in the unit tier and started a subprocess: mark it e2e"):
        subprocess.run(["true"])
    with pytest.raises(UnitTierStarted, match="started a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(UnitTierStarted, match="os.fork"):
        os.fork()
    with pytest.raises(UnitTierStarted, match="started a server"):
        HTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    with socket.socket() as probe:  # a free port's probe binds and never listens: allowed
        probe.bind(("127.0.0.1", 0))
    import ctypes.util

    ctypes.util.find_library("no-such-library-here")  # the standard library's probes (ldconfig): allowed
    tried = request.node.starts_tried
    assert tried == ["started a subprocess", "started a process (multiprocessing)", "started a process (os.fork)",
                     "started a server (a socket listening)"]
    tried.clear()  # what this test tried on purpose: the rest of the suite's unit tests fail on any


@pytest.mark.e2e  # starts a subprocess and a server: the guard is off in the e2e tier
def test_the_e2e_tier_may_start_processes_and_servers():
    import socket
    import subprocess

    assert subprocess.run(["true"]).returncode == 0
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)


def test_a_refusal_the_code_swallows_or_a_fixture_meets_still_fails_the_unit_test(pytester):
    """The guard covers a test's fixtures of every scope, and fails a test whose code caught the refusal."""
    pytester.makeconftest("from tiers import pytest_runtest_call, pytest_runtest_setup  # noqa: F401\n")
    pytester.makepyfile(test_inner="""
        import socket
        import subprocess

        import pytest

        @pytest.fixture(scope="module")
        def server():
            with socket.socket() as listening:
                listening.bind(("127.0.0.1", 0))
                listening.listen(1)
                yield listening

        def test_swallows_a_refusal():
            try:
                subprocess.run(["true"])
            except Exception:
                pass

        def test_uses_a_module_server(server):
            pass

        def test_starts_nothing():
            pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_uses_a_module_server is in the unit tier and started a server*",
                                 "*test_swallows_a_refusal is in the unit tier and started a subprocess: mark it e2e*"])
