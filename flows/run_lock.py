"""A run folder belongs to one live run.

    python -m flows.grpo --model tiny --device cpu --run-name try1    # a second one at once is refused

Two runs with the same folder would train into the same checkpoints and interleave their metrics. A
run holds an exclusive lock on `<run folder>/.run.lock` from planning to its end; a second run of the
same folder is refused in one line that names the holder. The lock is a POSIX record lock (`lockf`,
honoured over NFS, where run folders of a cluster live): the kernel drops it when its process ends,
however it ends, so a folder whose run was killed (kill -9, the OOM killer) is free again at once.
The file itself is never deleted (a reader could lock a file about to vanish); it names the holder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from common.errors import UserError

LOCK_FILE = ".run.lock"
# Folders this process holds, and the descriptor that holds each: POSIX locks belong to the process
# and end when any descriptor of the file closes, so each file is opened once, here.
_held: dict[Path, int] = {}


class RunFolderBusy(UserError):
    """Another live run holds the run folder."""


def claim(run_dir: Path) -> None:
    """Hold `run_dir` for this process until `release` or the process's end; again from the same
    process, a no-op. RunFolderBusy names the live run that holds it."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise RunFolderBusy(
            f"--run-name {run_dir.name}: the run folder {run_dir} is in use by another live run ({_holder(run_dir)}); "
            "wait for it to end, or choose another --run-name"
        ) from None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    _held[run_dir] = fd


def release(run_dir: Path) -> None:
    """Let the folder go (the run has ended); the next run of it may start."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def _holder(run_dir: Path) -> str:
    try:
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        return f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is"
