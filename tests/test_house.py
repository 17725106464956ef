"""The house rules DESIGN.md states, kept by a test: modules about one thing stay small, only
backends/ knows a backend by its name, every package imports only from the floors below it, no
modules import each other around a loop, nothing below tasks/ imports Prefect, and docs/layout.md is
the map the modules make (tests/house_map.py). Paths are relative to grpo_pipeline/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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


def test_every_package_has_a_floor():
    assert set(house_map.packages()) == set(house_map.FLOORS), (
        "a new top-level package gets its floor in tests/house_map.py's FLOORS")


def test_no_import_goes_up_a_floor():
    """Each package imports only from the floors below it (profiles < planner < common < generation <
    backends < stages < tasks < flows; common/errors.py and common/bounded_read.py stand below them
    all): common/ is shared by everything above, generation/ by the backends' rollouts and
    the evaluation stage; an import back up would make them unreadable apart (and Ray job packaging
    used to import every package only to find its folder). Imports inside functions count too."""
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
    from grpo_pipeline.common.ray_cluster import project_modules

    assert [Path(folder) for folder in project_modules()] == [PACKAGE]
    assert (PACKAGE / "__init__.py").is_file()


def test_a_runs_generation_path_is_decided_in_one_place():
    """generation/plan.py decides it (`plan_generation`), once per run: in the command line's plan
    or, for a run from the form, right after the flow resolves the profile; everything else reads the
    `GenerationPlan` it is handed, never the profile's `generation` section (docs/layout.md walks it)."""
    decided = [house_map.shown(p) for p in modules(*PACKAGES) if "plan_generation(" in p.read_text()]
    assert sorted(decided) == ["flows/pipeline.py", "generation/plan.py", "stages/plan.py"]
    section = re.compile(r"\.generation\.(engine|decoder|cache|compile|attn_implementation|steps_per_generation)\b")
    read = [f"{house_map.shown(p)}:{i}" for p in modules(*PACKAGES) if p.parts[-2:] != ("generation", "plan.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if section.search(line)]
    assert read == []


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
