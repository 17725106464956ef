"""Move grpo_pipeline's modules into rooms named after the project's concerns (issue 46, part 3;
docs/layout.md says why), and rewrite every reference to them.

    python3 tools/move_packages.py           # from anywhere in the checkout; a second run changes nothing
    python3 tools/move_packages.py --check   # exit 1, listing what is left, when a run would change something

It works from MOVES (old module -> new module) alone, never from a saved diff, so it can run again on
a tree where others have since changed what the modules say. What it does, in order:

1. `git mv` of every module in MOVES whose old file is still there (one already moved is passed over;
   both there stops the run). Each new folder gets an `__init__.py` saying what it holds (PACKAGES);
   a folder left with only its `__init__.py` (`common/`) is removed, and one left with modules that
   MOVES does not name is reported, untouched (add them to MOVES and run again).
2. In every tracked text file (.py .md .yaml .yml .sh .toml .cfg .txt, Makefile, .ci/run; never this
   file, never recorded .json results):
   - a `from grpo_pipeline.<package> import a, b` whose names are moved modules is split by where each
     now lives, and keeps each module's old name (`from grpo_pipeline.run import lock as run_lock`),
     also after a `;` in a one-line string (`python -c "import sys; from ... import run_lock"`);
   - any dotted name of a moved module (`grpo_pipeline.common.ray_cluster`, in an import, a string for
     Ray, Prefect, monkeypatch or importlib, a `-m` command, prose) becomes the new one;
   - any path of one (`common/ray_cluster.py`, with or without `grpo_pipeline/` in front).
3. tests/house_map.py gets the new floors (FLOORS, lowest first), their roles and the ground floor,
   and the map in docs/layout.md is generated again (`tests/house_map.py --write`).

Everything it rewrites is recognised by an old name that the rewritten text no longer has, which is
why a second run finds nothing. What it cannot do (docs/layout.md's prose about the rooms, new house
rules) is in the commit after the one that is this script's output. It names, on standard error, what
is left for a person: mentions of a removed package (`common/`) it cannot place.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

TOP = "grpo_pipeline"
# old module -> new module, both under TOP. A module moved here keeps its name unless the name only
# repeated its new folder's (`common/tracker_session.py` -> `tracking/session.py`).
MOVES = {
    # the ground floor: how the project speaks to a person, imported by every floor
    "common.errors": "errors",
    "common.progress": "progress",
    # store/: what is kept on disk and fetched: the content store, the hub, files written whole, bounded reads
    "common.store": "store.content",
    "common.hub": "store.hub",
    "common.hub_reach": "store.hub_reach",
    "common.files": "store.files",
    "common.bounded_read": "store.bounded_read",
    "common.file_faults": "store.file_faults",
    # checkpoints/: HF <-> megatron-core dist checkpoints, shards, staged output, LoRA export
    "common.dist_checkpoint": "checkpoints.convert",
    "common.dist_reader": "checkpoints.dist_reader",
    "common.dist_writer": "checkpoints.dist_writer",
    "common.megatron_layout": "checkpoints.megatron_layout",
    "common.hf_shards": "checkpoints.hf_shards",
    "common.staged_output": "checkpoints.staged_output",
    "common.lora_export": "checkpoints.lora_export",
    # data/: what a run trains on and starts from, made or converted here
    "common.rl_data": "data.rl_data",
    "common.math_data": "data.math_data",
    "common.mapped_data": "data.mapped_data",
    "common.builtin_models": "data.builtin_models",
    # cluster/: Ray and its nodes
    "common.ray_address": "cluster.ray_address",
    "common.ray_probe": "cluster.ray_probe",
    "common.ray_cluster": "cluster.ray_cluster",
    "common.node_image": "cluster.node_image",
    "common.node_tasks": "cluster.node_tasks",
    "common.preflight": "cluster.preflight",
    # tracking/: the experiment trackers
    "common.tracking": "tracking.trackers",
    "common.tracker_session": "tracking.session",
    "common.tracker_stores": "tracking.stores",
    # run/: a run before any work: its request and the form's rules, its folder, its lock
    "stages.request": "run.request",
    "stages.form_rules": "run.form_rules",
    "stages.run_lock": "run.lock",
}
# Each new folder's __init__.py, and its role in the map (tests/house_map.py ROLES).
PACKAGES = {
    "store": "What is kept on disk and fetched: the content store (content.py), the hub, files written "
             "whole, bounded reads of what a user brings, file faults said in one line.",
    "checkpoints": "Checkpoints converted and written: HF safetensors <-> megatron-core dist checkpoints "
                   "(convert.py), their layouts and shards, staged output, the LoRA export.",
    "data": "What a run trains on and starts from, made or converted here: verl's RL parquet (the built-in, "
            "math and mapped datasets) and the built-in models.",
    "cluster": "Ray and its nodes: the address, the connection and its end, what each node's image has, "
               "the preflight.",
    "tracking": "The experiment trackers: one interface over MLflow, W&B and TensorBoard (trackers.py), "
                "where they keep a run, and the run's tracker session.",
}
# The floors after the move, lowest first (tests/house_map.py FLOORS), and the roles of those that change.
FLOORS = ("store", "profiles", "planner", "rewards", "checkpoints", "data", "cluster", "run", "tracking",
          "generation", "backends", "stages", "tasks", "flows")
GONE = ("common",)  # folders the move empties
GROUND = ("errors", "progress")
ROLES = {
    "store": "what is kept on disk and fetched: the content store, the hub, files, bounded reads, file faults",
    "checkpoints": "checkpoint conversion: HF <-> dist checkpoints, layouts, shards, staged output, LoRA export",
    "data": "what a run trains on and starts from: verl's RL parquet, the math and mapped datasets, the built-in models",
    "cluster": "Ray and its nodes: address, connection, node images and tasks, the preflight",
    "run": "a run before any work: its request and the form's rules, its folder's names, its lock",
    "tracking": "the experiment trackers: one interface, where they keep a run, the run's session",
    "stages": "one module per stage: plain functions, no Prefect; the run's plan",
}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".txt"}
TEXT_NAMES = {"Makefile", ".ci/run"}
SELF = "tools/move_packages.py"
HOUSE_MAP = "tests/house_map.py"

IDENT = r"[A-Za-z_]\w*"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def path_of(module: str) -> str:
    """`common.store` -> `grpo_pipeline/common/store.py`."""
    return f"{TOP}/{module.replace('.', '/')}.py"


# --- 1. the moves -------------------------------------------------------------------------------

def init_text(package: str) -> str:
    return f'"""{PACKAGES[package]}"""\n'


def move(root: Path, check: bool) -> list[str]:
    done = []
    for old, new in MOVES.items():
        source, target = root / path_of(old), root / path_of(new)
        if source.exists() and target.exists():
            sys.exit(f"move_packages: both {path_of(old)} and {path_of(new)} exist; merge them by hand, then run again")
        if not source.exists():
            continue  # moved already
        done.append(f"{path_of(old)} -> {path_of(new)}")
        if check:
            continue
        for folder in reversed(Path(path_of(new)).parents[:-2]):  # every folder below grpo_pipeline/
            init = root / folder / "__init__.py"
            if not init.exists():
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text(init_text(folder.name))
                git(root, "add", str(init.relative_to(root)))
        git(root, "mv", path_of(old), path_of(new))
    for package in GONE:
        folder = root / TOP / package
        left = [p for p in folder.glob("*.py") if p.name != "__init__.py"] if folder.is_dir() else []
        if left:
            print(f"move_packages: {TOP}/{package}/ still holds {', '.join(p.name for p in left)}: add each to MOVES "
                  "and run again", file=sys.stderr)
        elif (folder / "__init__.py").exists():
            done.append(f"{TOP}/{package}/ (emptied) removed")
            if not check:
                git(root, "rm", "-q", f"{TOP}/{package}/__init__.py")
                for cache in folder.rglob("__pycache__"):
                    for stale in cache.iterdir():
                        stale.unlink()
                    cache.rmdir()
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
    return done


# --- 2. the rewrites ----------------------------------------------------------------------------

# `from grpo_pipeline.common import dist_writer, store as s`: the names may be moved modules. On a line of
# its own (group 1: indent), or after a `;` in a one-line string (group 1: the `;` and its spaces).
FROM_PACKAGE = re.compile(rf"(^[ \t]*|;[ \t]*)from {TOP}\.({IDENT})[ \t]+import[ \t]+"
                          rf"({IDENT}(?:[ \t]+as[ \t]+{IDENT})?(?:[ \t]*,[ \t]*{IDENT}(?:[ \t]+as[ \t]+{IDENT})?)*)"
                          rf"(?=[ \t]*(?:#.*)?$|[ \t]*[;\"'\\])", re.M)
FROM_PARENS = re.compile(rf"^[ \t]*from {TOP}\.({IDENT})[ \t]+import[ \t]*\(", re.M)
DOTTED = {old: re.compile(rf"(?<![\w.]){re.escape(f'{TOP}.{old}')}(?!\w)") for old in MOVES}
PATHS = {old: re.compile(rf"(?<![\w./-])((?:{TOP}/)?){re.escape(old.replace('.', '/'))}\.py\b") for old in MOVES}


def split_from(match: re.Match) -> str:
    lead, package, names = match.groups()
    homes: dict[str, list[str]] = {}
    for item in (i.strip() for i in names.split(",")):
        name, _, alias = (w.strip() for w in item.partition(" as "))
        alias = alias or name
        new = MOVES.get(f"{package}.{name}")
        home, new_name = (new.rpartition(".")[0], new.rpartition(".")[2]) if new else (package, name)
        home = f"{TOP}.{home}" if home else TOP
        homes.setdefault(home, []).append(new_name if new_name == alias else f"{new_name} as {alias}")
    statements = [f"from {home} import {', '.join(items)}" for home, items in homes.items()]
    joiner = "; " if lead.startswith(";") else "\n" + lead
    return lead + joiner.join(statements)


def rewrite_text(text: str) -> str:
    for match in FROM_PARENS.finditer(text):
        if any(key.startswith(f"{match.group(1)}.") for key in MOVES):
            tail = text[match.end():text.index(")", match.end())]
            if any(f"{match.group(1)}.{name}" in MOVES for name in re.findall(IDENT, tail)):
                sys.exit(f"move_packages: cannot split the parenthesised `{match.group(0).strip()}...`: write it "
                         "one import a line, then run again")
    text = FROM_PACKAGE.sub(split_from, text)
    for old, new in MOVES.items():
        text = DOTTED[old].sub(f"{TOP}.{new}", text)
        text = PATHS[old].sub(lambda m, new=new: m.group(1) + new.replace(".", "/") + ".py", text)
    return text


def text_files(root: Path) -> list[str]:
    return [path for path in git(root, "ls-files", "-z").split("\0")
            if path and path != SELF and (Path(path).suffix in TEXT_SUFFIXES or path in TEXT_NAMES)
            and (root / path).is_file()]


def house_map_text(text: str) -> str:
    """tests/house_map.py with the floors after the move (FLOORS, GROUND, and ROLES's changed lines)."""
    floors = re.search(r"^FLOORS = \((.*)\)$", text, re.M)
    known = set(FLOORS) | set(GONE)
    unplaced = [p for p in re.findall(r'"(\w+)"', floors.group(1)) if p not in known] if floors else []
    if unplaced:
        sys.exit(f"move_packages: {HOUSE_MAP} has floors this script does not place: {', '.join(unplaced)}; "
                 "add them to FLOORS here, then run again")
    text = re.sub(r"^FLOORS = \(.*\)$", "FLOORS = (" + ", ".join(f'"{p}"' for p in FLOORS) + ")", text, flags=re.M)
    text = re.sub(r"^GROUND = \(.*\)$", "GROUND = (" + ", ".join(f'"{TOP}.{g}"' for g in GROUND) + ")", text, flags=re.M)
    block = re.search(r"^ROLES = \{\n(.*?)^\}$", text, re.M | re.S)
    roles = dict(re.findall(r'^    ("?\w+"?): (".*"),$', block.group(1), re.M))
    for package in GONE:
        roles.pop(f'"{package}"', None)
    roles.update({f'"{p}"': f'"{role}"' for p, role in ROLES.items()})
    order = [f'"{p}"' for p in FLOORS] + [k for k in roles if not k.startswith('"')]
    lines = "".join(f"    {key}: {roles[key]},\n" for key in order if key in roles)
    return text[:block.start(1)] + lines + text[block.end(1):]


def rewrite(root: Path, check: bool) -> list[str]:
    changed = []
    for path in text_files(root):
        old = (root / path).read_text()
        new = rewrite_text(old)
        if path == HOUSE_MAP:
            new = house_map_text(new)
        if new != old:
            changed.append(path)
            if not check:
                (root / path).write_text(new)
    return changed


def leftovers(root: Path) -> list[str]:
    """Mentions of a removed package that no rule placed: prose for a person to write again."""
    gone = "|".join(GONE)
    mention = re.compile(rf"(?<![\w./-])(?:{TOP}/)?(?:{gone})/|{TOP}\.(?:{gone})\b")
    return [f"{path}:{n}" for path in text_files(root) for n, line in enumerate((root / path).read_text().splitlines(), 1)
            if mention.search(line)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 tools/move_packages.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a run would")
    args = parser.parse_args(argv)
    root = Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel").strip())
    moves = move(root, args.check)
    if args.check and moves:
        # the rewrite is judged on the moved tree: a check before the move lists the moves only
        print("\n".join(["to move:", *moves]))
        return 1
    changed = rewrite(root, args.check)
    for line in [*(["moved:"] + moves if moves else []), *(["rewritten:"] + changed if changed else [])]:
        print(line)
    if not moves and not changed:
        print("nothing to move or rewrite")
    stranded = [package for package in GONE if any(p.name != "__init__.py" for p in (root / TOP / package).glob("*.py"))]
    if stranded:
        return 1  # the map would place modules on a floor that is gone; move() said what to add to MOVES
    if not args.check:
        python = root / ".venv" / "bin" / "python"
        subprocess.run([str(python) if python.exists() else sys.executable, HOUSE_MAP, "--write"], cwd=root, check=True)
    for where in leftovers(root):
        print(f"by hand: {where}: names a folder the move removed", file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
