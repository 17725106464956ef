"""Move the project's packages into one package, `grpo_pipeline/`, and the Prefect tasks into
`grpo_pipeline/tasks/` (issue 35, part 4; docs/layout.md says why), and rewrite every reference.

    python3 tools/move_packages.py           # from anywhere in the checkout; a second run changes nothing
    python3 tools/move_packages.py --check   # exit 1, listing what is left, when a run would change something

What it does, in order:

1. `git mv` of every tracked file of the old top-level packages (`common/`, `stages/`, ...) to
   `grpo_pipeline/<package>/`, file by file, so a file added at an old path after an earlier run
   still moves; a module named in MODULE_MOVES goes to its new package instead (the Prefect task
   modules into `tasks/`, the plain planning modules they need into `stages/`). A folder left with
   nothing but `__pycache__` is removed (it would import as an empty namespace package).
2. In every tracked text file (.py .md .yaml .yml .sh .toml .cfg .txt, Makefile, .ci/run; never
   this file, never bench's recorded .json results):
   - import lines: `from common.x import y`, `from backends import backend_for`, `import common.store`
     (a bare `from flows import lease, run_lock` is split by where each module now lives), and a
     `from` statement after a `;` on a line (`python -c "import sys; from flows import run_lock"`);
   - the command line: `-m flows.grpo` and the argv pair `"-m", "flows.grpo"` become
     `-m grpo_pipeline` (grpo_pipeline/__main__.py), and so does the literal "flows.grpo";
   - any other dotted module path (a string for Ray, Prefect, monkeypatch or importlib, `-m x.y`,
     prose) whose first two parts name a module or folder of the moved tree, so that a profile key
     of the same look (`generation.cache`, `planner.enforce`) is left alone;
   - paths: `flows/task_policy.py` and the other MODULE_MOVES become their new package-relative
     path (`tasks/policy.py`), and a `file.py:function` entrypoint (prefect.yaml) gets the
     `grpo_pipeline/` folder in front;
   - pyproject.toml's `[tool.setuptools.packages.find] include` becomes `["grpo_pipeline*"]`.

Everything it rewrites is recognised by a form the rewritten text no longer has, which is why a
second run finds nothing. What it cannot do (new files, the house map's floors, the packages Ray
ships) is in the commits after the one that is this script's output. It names one thing to look at
by hand: a file where a plain `import grpo_pipeline.x` (it was `import flows.x`) binds the name
`grpo_pipeline`, which that file also imports as the flow's function.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

TOP = "grpo_pipeline"
PACKAGES = ("common", "stages", "profiles", "flows", "backends", "planner", "generation")
# old dotted module -> new dotted module (under TOP), for modules that change package or name
MODULE_MOVES = {
    "flows.stage_tasks": "tasks.stage_tasks",
    "flows.task_policy": "tasks.policy",
    "flows.run_record": "tasks.run_record",
    "flows.tracking": "tasks.tracking",
    "flows.plan": "stages.plan",
    "flows.request": "stages.request",
    "flows.form_rules": "stages.form_rules",
    "flows.run_lock": "stages.run_lock",
}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".txt"}
TEXT_NAMES = {"Makefile", ".ci/run"}
SELF = "tools/move_packages.py"

PKG = "|".join(PACKAGES)
IDENT = r"[A-Za-z_]\w*"
# A dotted name that starts with an old package and is not itself part of a longer dotted name or a path.
DOTTED = re.compile(rf"(?<![\w./-])({PKG})((?:\.{IDENT})+)")
FROM_LINE = re.compile(rf"^(\s*)from\s+({PKG})((?:\.{IDENT})*)(\s+import\s+)(.*)$")
# The same statement after a `;` on one line: code in a string (`python -c "import sys; from flows import x; ..."`).
FROM_INLINE = re.compile(rf"(;\s*)from\s+({PKG})((?:\.{IDENT})*)(\s+import\s+)"
                         rf"({IDENT}(?:\s*,\s*{IDENT})*)(?=\s*[;\"'\\]|\s*$)", re.M)
IMPORT_LINE = re.compile(r"^(\s*)import\s+(.+)$")
CLI_M = re.compile(r"(?<![\w.-])-m\s+flows\.grpo(?![\w.])")
CLI_ARGV = re.compile(r"""(["'])-m\1(\s*,\s*)(["'])flows\.grpo\3""")
CLI_LITERAL = re.compile(r"""(["'])flows\.grpo\1""")
MOVED_PATH = re.compile(rf"(?<![\w./-])((?:{TOP}/)?)flows/({'|'.join(m.split('.')[1] for m in MODULE_MOVES)})\.py\b")
ENTRYPOINT = re.compile(rf"(?<![\w./-])((?:{PKG})/[\w/]*\.py:{IDENT})")
FIND_INCLUDE = re.compile(r'^include = \[[^\]]*"flows\*"[^\]]*\]$', re.M)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def new_module(old: str) -> str:
    """`flows.task_policy.X` -> `grpo_pipeline.tasks.policy.X`; `common.store` -> `grpo_pipeline.common.store`."""
    parts = old.split(".")
    for cut in range(len(parts), 1, -1):
        head = ".".join(parts[:cut])
        if head in MODULE_MOVES:
            return ".".join([TOP, MODULE_MOVES[head], *parts[cut:]])
    return f"{TOP}.{old}"


def names_a_module(root: Path, old: str) -> bool:
    """Whether `old`'s first two parts are a module or folder of the moved tree."""
    first_two = new_module(".".join(old.split(".")[:2])).split(".")
    where = root.joinpath(*first_two)
    return where.with_suffix(".py").is_file() or where.is_dir()


# --- 1. the moves -------------------------------------------------------------------------------

def target_of(path: str) -> str:
    """A tracked file's place after the move (`flows/task_policy.py` -> `grpo_pipeline/tasks/policy.py`)."""
    package, _, rest = path.partition("/")
    if f"{package}.{Path(rest).stem}" in MODULE_MOVES and "/" not in rest and rest.endswith(".py"):
        return f"{TOP}/" + MODULE_MOVES[f"{package}.{Path(rest).stem}"].replace(".", "/") + ".py"
    return f"{TOP}/{path}"


def move(root: Path, check: bool) -> list[str]:
    moves = []
    tracked = git(root, "ls-files", "-z", "--", *[f"{p}/" for p in PACKAGES]).split("\0")
    for path in filter(None, tracked):
        if not (root / path).exists():
            continue  # deleted in the work tree: nothing to move
        target = target_of(path)
        if (root / target).exists():
            sys.exit(f"move_packages: both {path} and {target} exist; merge them by hand, then run again")
        moves.append(f"{path} -> {target}")
        if not check:
            (root / target).parent.mkdir(parents=True, exist_ok=True)
            git(root, "mv", path, target)
    for package in PACKAGES:
        folder = root / package
        if folder.is_dir() and all("__pycache__" in p.parts or p.is_dir() for p in folder.rglob("*")):
            moves.append(f"{package}/ (only __pycache__ left) removed")
            if not check:
                shutil.rmtree(folder)
        elif folder.is_dir() and not check:
            print(f"move_packages: {package}/ still holds untracked files; move them by hand", file=sys.stderr)
    return moves


# --- 2. the rewrites ----------------------------------------------------------------------------

def rewrite_from(root: Path, match: re.Match) -> str:
    indent, package, dotted, keyword, rest = match.groups()
    if dotted:
        return f"{indent}from {new_module(package + dotted)}{keyword}{rest}"
    # `from flows import lease, run_lock`: each name is a module of the package, maybe moved elsewhere
    comment = ""
    if "#" in rest:
        rest, comment = rest.split("#", 1)
        comment = "  #" + comment
    if "(" in rest or rest.rstrip().endswith("\\"):
        moved = [name for name in re.findall(IDENT, rest) if f"{package}.{name}" in MODULE_MOVES]
        if moved:
            sys.exit(f"move_packages: cannot split `{match.group(0).strip()}` (parenthesised, names moved modules)")
        return f"{indent}from {TOP}.{package}{keyword}{rest.rstrip() if comment else rest}{comment}"
    groups: dict[str, list[str]] = {}
    for item in (i.strip() for i in rest.split(",") if i.strip()):
        name = item.split()[0]
        home = new_module(f"{package}.{name}").rpartition(".")[0]
        groups.setdefault(home, []).append(item)
    lines = [f"{indent}from {home} import {', '.join(items)}" for home, items in groups.items()]
    lines[0] += comment
    return "\n".join(lines)


def rewrite_import(match: re.Match) -> str:
    indent, rest = match.groups()
    comment = ""
    if "#" in rest:
        rest, comment = rest.split("#", 1)
        comment = "  #" + comment
    items = []
    for item in rest.split(","):
        words = item.split()
        if words and re.fullmatch(rf"({PKG})(\.{IDENT})*", words[0]):
            words[0] = new_module(words[0])
        items.append(" ".join(words))
    return f"{indent}import {', '.join(items)}{comment}"


def rewrite_inline_from(root: Path, match: re.Match) -> str:
    """`; from flows import run_lock` inside a one-line string: as rewrite_from, statements joined by `; `."""
    separator = match.group(1)
    statements = rewrite_from(root, FROM_LINE.match(match.group(0)[len(separator):])).split("\n")
    return separator + "; ".join(statements)


def rewrite_text(root: Path, text: str) -> str:
    lines = []
    for line in text.split("\n"):
        if (m := FROM_LINE.match(line)):
            line = rewrite_from(root, m)
        elif (m := IMPORT_LINE.match(line)) and re.search(rf"(^|,)\s*({PKG})(\.|\s|,|$)", m.group(2).split("#")[0]):
            line = rewrite_import(m)
        lines.append(FROM_INLINE.sub(lambda m: rewrite_inline_from(root, m), line))
    text = "\n".join(lines)
    text = CLI_ARGV.sub(lambda m: f"{m.group(1)}-m{m.group(1)}{m.group(2)}{m.group(3)}{TOP}{m.group(3)}", text)
    text = CLI_M.sub(f"-m {TOP}", text)
    text = CLI_LITERAL.sub(lambda m: f"{m.group(1)}{TOP}{m.group(1)}", text)
    text = MOVED_PATH.sub(lambda m: m.group(1) + MODULE_MOVES[f"flows.{m.group(2)}"].replace(".", "/") + ".py", text)
    text = ENTRYPOINT.sub(lambda m: f"{TOP}/{m.group(1)}", text)
    text = DOTTED.sub(lambda m: new_module(m.group(0)) if names_a_module(root, m.group(0)) else m.group(0), text)
    return text


def text_files(root: Path) -> list[str]:
    return [path for path in git(root, "ls-files", "-z").split("\0")
            if path and path != SELF and (Path(path).suffix in TEXT_SUFFIXES or path in TEXT_NAMES)
            and (root / path).is_file()]


def rewrite(root: Path, check: bool) -> list[str]:
    changed = []
    for path in text_files(root):
        old = (root / path).read_text()
        new = rewrite_text(root, old)
        if path == "pyproject.toml":
            new = FIND_INCLUDE.sub(f'include = ["{TOP}*"]', new)
        if new != old:
            changed.append(path)
            if not check:
                (root / path).write_text(new)
    return changed


def name_clashes(root: Path) -> list[str]:
    """Files where `import grpo_pipeline.x` (no `as`) rebinds the name of the flow they also import."""
    plain = re.compile(rf"^\s*import {TOP}\.[\w.]+\s*(#.*)?$", re.M)
    flow = re.compile(rf"^\s*from \S+ import (\([^)]*\b{TOP}\b|[^#\n(]*\b{TOP}\b)", re.M)
    return [path for path in text_files(root) if path.endswith(".py")
            and plain.search(text := (root / path).read_text()) and flow.search(text)]


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
    for path in name_clashes(root):
        print(f"by hand: {path}: a plain `import {TOP}.x` rebinds `{TOP}`, the flow's name there; "
              f"use `from {TOP}.x import y`", file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
