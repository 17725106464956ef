"""File-system errors that no retry can fix, told apart from transient faults, and said in one line.

    python -m grpo_pipeline --model tiny --device cpu --run-name r1   # runs/r1/checkpoints a file: refused at planning

A full disk, a read-only or forbidden folder, a file where the run keeps a folder (or the other way
round) stay as they are however often a stage is retried: each such OSError becomes a `FileFault`
(a UserError: never retried, reported as its one line) naming the file, the cause and the fix,
wherever it is raised: in a stage (tasks/policy.py) or in a training worker, under Ray's
wrappers (backends/local/driver.py). Other OSErrors (a lost NFS server's EIO, a vanished file) stay
retryable.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from grpo_pipeline.errors import UserError

_FIXES = {
    errno.ENOSPC: "free space on that file system (or give --run-dir on another) and run again: training resumes "
                  "from the latest checkpoint",
    errno.EDQUOT: "free space within your quota (or give --run-dir on another file system) and run again",
    errno.EFBIG: "the file system cannot hold a file that large: give --run-dir on another",
    errno.EROFS: "the file system is read-only: give a writable --run-dir",
    errno.EACCES: "make it readable and writable for this user, or give another --run-dir",
    errno.EPERM: "make it readable and writable for this user, or give another --run-dir",
    errno.EISDIR: "a folder is where the run keeps a file: move it away, or choose another --run-name",
    errno.ENOTDIR: "a file is where the run keeps a folder: move it away, or choose another --run-name",
    errno.EEXIST: "a file is where the run keeps a folder: move it away, or choose another --run-name",
    errno.ENAMETOOLONG: "choose a shorter --run-dir or --run-name",
}
PERMANENT_ERRNOS = frozenset(_FIXES)


class FileFault(UserError):
    """An OSError of a file that a retry cannot fix, as one line naming the file, cause and fix."""


def _shown(name: object) -> str:
    text = os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(name)
    return text if len(text) <= 300 else f"{text[:150]}...{text[-150:]}"


# How libraries that are not Python say an errno: Rust's io::Error (safetensors), C's strerror in a message.
_ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")


def file_fault(error: BaseException, folder: Path | None = None) -> FileFault | None:
    """The FileFault `error` is, or was caused by (Ray wraps a worker's exception, sometimes twice;
    `__cause__`, `cause` and `__context__` are followed; an errno only in the text, as safetensors
    says one, counts), or None for any other error. `folder`: where the files of the failed work
    are, named when the error names no file, and looked at for free space (torch's writer says
    only "unexpected pos 5952 vs 5844" when the disk is full)."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        exc = pending.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, FileFault):
            return exc
        number = getattr(exc, "errno", None)
        if isinstance(exc, OSError) and number in PERMANENT_ERRNOS:
            where = f"{_shown(exc.filename)}: " if exc.filename is not None else ""
            cause = f"{os.strerror(number)} ({errno.errorcode.get(number, number)})"
            return FileFault(f"{where}{cause}; {_FIXES[number]}")
        found = _ERRNO_IN_TEXT.search(str(exc))
        if found and int(found.group(1) or found.group(2)) in PERMANENT_ERRNOS:
            number = int(found.group(1) or found.group(2))
            where = f"{_shown(folder)}: " if folder is not None else ""
            return FileFault(f"{where}{os.strerror(number)} ({errno.errorcode.get(number, number)}); {_FIXES[number]}")
        pending += [getattr(exc, "cause", None), exc.__cause__, exc.__context__]
    return full_disk(folder) if folder is not None else None


def full_disk(folder: Path) -> FileFault | None:
    """A FileFault if the file system of `folder` is full (less free than 1% of it, at most 1 GiB):
    the likeliest reason work that wrote there failed, whatever its error said."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    free, size = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    if size and free < min(1 << 30, size // 100):
        return FileFault(f"{_shown(folder)}: {os.strerror(errno.ENOSPC)} (ENOSPC: {free:,} bytes free of {size:,}); "
                         f"{_FIXES[errno.ENOSPC]}")
    return None


def run_folder_problem(run_dir: Path, kept: dict[str, bool]) -> str | None:
    """An entry of the run's folder of the wrong kind (a file named `checkpoints`, a folder named
    `metrics.jsonl`), as the line that names it and its fix; None when each is absent or right.
    `kept`: what the run keeps there, a folder (True) or a file (False) (run/folder.py's `RunFolder.KEPT`)."""
    for name, folder in kept.items():
        path = run_dir / name
        if not os.path.lexists(path):
            continue
        if folder and not path.is_dir():
            return (f"{_shown(path)} is a file, not the folder where the run keeps its {name}; move it away, or "
                    "choose another --run-name")
        if not folder and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            return f"{_shown(path)} is {kind}, where the run writes its {name}; move it away, or choose another --run-name"
    return None
