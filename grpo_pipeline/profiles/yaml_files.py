"""Reading the files and values a person gives: profile files and `--set` values (YAML), and paths.

    python -m grpo_pipeline --model tiny --profile-file my-profile.yaml --dry-run

Whatever is in them, the answer is a mapping or one line naming the problem: a file that is not
there, not UTF-8, too large, not YAML, or whose anchors and aliases would expand without bound (a
"billion laughs" document is a few lines that expand to billions of values); a path the system
refuses to look at (a name too long, no permission).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from grpo_pipeline.errors import ProfileError

# What one profile file may hold: far more than any real profile, far less than a parser bomb.
MAX_PROFILE_BYTES = 1 << 20
MAX_YAML_VALUES = 20_000


def path_kind(path: Path, what: str) -> str | None:
    """"file", "dir" or None (nothing there), for a path the user gave; a path the system refuses to
    look at (a name too long, no permission) is a ProfileError naming it, not a traceback."""
    try:
        if path.is_dir():
            return "dir"
        return "file" if path.exists() else None
    except OSError as exc:
        raise ProfileError(f"{what} {shown(path)}: {exc.strerror or exc}; give a shorter or accessible path") from None


def shown(path: Path | str, limit: int = 120) -> str:
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text)} characters)"


def load_yaml_text(text: str, what: str) -> Any:
    """YAML, refused when its anchors and aliases would expand past MAX_YAML_VALUES values (a
    "billion laughs" document is a few lines that expand to billions), or refer to themselves."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and _expanded_values(node, {}) > MAX_YAML_VALUES:
            raise ProfileError(
                f"{what} expands to more than {MAX_YAML_VALUES:,} values through YAML anchors and aliases (or an "
                "alias refers to itself); a profile is a few hundred settings: write them out"
            )
        return yaml.safe_load(text)
    except RecursionError:
        raise ProfileError(f"{what} is nested too deeply to be a profile") from None


def _expanded_values(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values the node stands for once every alias is expanded (shared nodes counted
    once per use), capped just above the limit."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    sizes[key] = MAX_YAML_VALUES + 1  # met again while being counted: an alias to itself
    total = 1
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
    for child in children:
        total += _expanded_values(child, sizes)
        if total > MAX_YAML_VALUES:
            break
    sizes[key] = min(total, MAX_YAML_VALUES + 1)
    return sizes[key]


def load_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    kind = path_kind(path, what)
    if kind != "file":
        raise ProfileError(f"{what} {shown(path)} {'is a directory' if kind else 'does not exist'}; give the path of a YAML file")
    try:
        # A device (/dev/zero) or a pipe never ends, or blocks: only regular files, and only the bytes the cap allows.
        if not path.is_file():
            raise ProfileError(f"{what} {shown(path)} is not a regular file (a device or a pipe); give the path of a YAML file")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_PROFILE_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"{what} {shown(path)}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"{what} {shown(path)} is larger than {MAX_PROFILE_BYTES >> 10} KiB; a profile is a few hundred settings")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{what} {shown(path)} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                           f"{exc.start}); save it as UTF-8") from None
    try:
        data = load_yaml_text(text, f"{what} {shown(path)}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ProfileError(f"{what} {shown(path)} is not valid YAML{where}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(
            f"{what} {shown(path)} must be a YAML mapping of settings (e.g. `engine: {{tp: 2}}`), "
            f"not a {type(data).__name__}"
        )
    return data
