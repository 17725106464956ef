"""Atomic writes: a reader (or a retry) sees the old file or the new one, never half of one.

File modes are chosen, not left to `mkstemp` (which makes every file 0600): a run's files (report,
profile, metrics, manifests) are for the team and for Ray nodes that may run as other users, so
they get the usual 0666 less the umask (0644 under the common umask 022); `private=True` makes a
file only its owner can read (the run's lease, the local Prefect API's log).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

SHARED_MODE, PRIVATE_MODE = 0o666, 0o600


def write_text_atomic(path: Path, text: str, mode: int | None = None, private: bool = False) -> Path:
    """`mode`: exact permission bits; else SHARED_MODE less the umask, or PRIVATE_MODE."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE if private else SHARED_MODE)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def current_umask() -> int:
    """This process's umask, read without changing it (Linux: /proc), else by the set-and-restore dance."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_tree(root: Path) -> Path:
    """Give a folder a library wrote (safetensors 0.8 writes every file 0600) the run's modes: files
    SHARED_MODE and folders 0777, each less the umask, so the team and Ray nodes running as other
    users can read the policy as they read the rest of the run."""
    mask = current_umask()
    root = Path(root)
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, SHARED_MODE & ~mask)
    return root


def write_json_atomic(path: Path, data: Any, mode: int | None = None, private: bool = False) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=mode, private=private)
