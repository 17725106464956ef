"""The house rules DESIGN.md states, kept by a test: modules about one thing stay small, only
backends/ knows a backend by its name, and common/ imports nothing above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "stages", "common", "backends", "profiles")
MAX_MODULE_LINES = 400


def modules(*packages: str) -> list[Path]:
    return [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


def test_no_module_is_past_the_size_that_asks_for_a_split():
    long = {str(p.relative_to(ROOT)): n for p in modules(*PACKAGES) if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_nothing_outside_backends_branches_on_a_backends_name():
    branch = re.compile(r"\.backend\s*(==|!=|in)\s|backend\s*==\s*[\"'](verl|local)[\"']")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in modules("flows", "stages", "common", "profiles")
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []


def test_common_imports_no_package_above_it():
    """common/ is shared by the stages and backends; importing them back would make a cycle (and Ray
    job packaging used to import every package only to find its folder)."""
    above = {"flows", "stages", "backends"}
    found = []
    for path in modules("common"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in above]
    assert found == []


def test_the_packages_a_ray_job_carries_are_the_projects_own_folders():
    from common.ray_cluster import project_modules

    folders = [Path(folder) for folder in project_modules()]
    assert {folder.name for folder in folders} == set(PACKAGES) - {"flows"}
    assert all((folder / "__init__.py").is_file() for folder in folders)
