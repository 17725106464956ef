"""A run folder belongs to one live run.

    python -m grpo_pipeline --model tiny --device cpu --run-name try1    # a second one at once is refused

Two runs with the same folder would train into the same checkpoints and interleave their metrics. A
run holds its folder from planning to its end; a second run of the same folder is refused in one
line that names the holder. The kernel drops every lock when its process ends, however it ends, so a
folder whose run was killed (kill -9, the OOM killer) is free again at once.

What is locked, and why two locks. A lock on a file only excludes those who lock that same file: a
`.run.lock` that someone deletes or replaces during a run (a clean-up script, a user in a shared
runs folder) would let the next run create a new file, lock it, and train into the same folder. So
the lock that counts is on the run folder itself: `flock` on a descriptor of the directory. Nobody
can swap a directory for another while it holds a run's files (rmdir refuses a folder that is not
empty), and deleting or replacing `.run.lock` does not touch it. `flock` on a directory is not
honoured everywhere (NFS emulates flock with POSIX locks, which need a file open for writing); there
the POSIX record lock (`lockf`) on `.run.lock`, which NFS does honour, is what excludes, as before.
Both are taken, and after taking them the run checks that the folder's path and `.run.lock` still
name what it locked (a swap between open and lock would otherwise go unseen).

`.run.lock` is the holder's record (pid, host, since), written by the holder only. It is opened
relative to the locked folder's descriptor with O_NOFOLLOW and O_NONBLOCK, and must be a regular
file with one link: a symlink or hard link planted there (pointing at someone's file in a shared
runs folder) is refused in one line and never written through, and a directory or a FIFO there is
refused in one line rather than raising or hanging. The file is never deleted (a reader could lock a
file about to vanish).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from grpo_pipeline.errors import UserError
from grpo_pipeline.run.folder import RunFolder

_HOLDER_RECORD_MAX = 4096  # bytes of .run.lock read for the holder's record
# Folders this process holds, and the descriptors that hold each (the folder's, the lock file's): POSIX
# locks belong to the process and end when any descriptor of the file closes, so each is opened once, here.
_held: dict[Path, tuple[int, int]] = {}


class RunFolderBusy(UserError):
    """Another live run holds the run folder."""


def claim(run_dir: Path) -> None:
    """Hold `run_dir` for this process until `release` or the process's end; again from the same
    process, a no-op. RunFolderBusy names the live run that holds it; a `.run.lock` that is not a
    plain file of its own is refused (UserError) and left as it is."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # a folder or lock file swapped while being claimed: claim what is there now
        folder = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        lock_file = -1
        try:
            if not _locked(folder, lambda: fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB), directory=True):
                raise _busy(run_dir)
            lock_file = _open_lock_file(run_dir, folder)
            if not _locked(lock_file, lambda: fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)):
                raise _busy(run_dir)
            if _same_file(os.stat(run_dir), os.fstat(folder)) and _same_file(
                    os.stat(RunFolder.LOCK, dir_fd=folder, follow_symlinks=False), os.fstat(lock_file)):
                break
        except BaseException:
            for fd in (lock_file, folder):
                if fd >= 0:
                    os.close(fd)
            raise
        os.close(lock_file)
        os.close(folder)
    else:
        raise UserError(f"--run-name {run_dir.name}: {run_dir} or its {RunFolder.LOCK} kept being replaced while this run "
                        "claimed it; stop whatever replaces them, or choose another --run-name")
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(lock_file, 0)
    os.pwrite(lock_file, (json.dumps(holder) + "\n").encode(), 0)
    _held[run_dir] = (folder, lock_file)


def release(run_dir: Path) -> None:
    """Let the folder go (the run has ended); the next run of it may start."""
    for fd in _held.pop(Path(run_dir).resolve(), ()):
        os.close(fd)


def _locked(fd: int, lock, directory: bool = False) -> bool:
    """Took the lock (True), or another process holds it (False). A filesystem that does not lock
    directories (flock over NFS) leaves the folder to the lock file's POSIX lock."""
    try:
        lock()
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if directory and exc.errno in (errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            return True
        raise
    return True


def _open_lock_file(run_dir: Path, folder: int) -> int:
    path = run_dir / RunFolder.LOCK
    fix = f"remove it (rm -ri '{path}': runs write their own) and run again"
    try:
        fd = os.open(RunFolder.LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666,
                     dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"--run-name {run_dir.name}: {path} is a symbolic link; a run's lock file is never followed "
                            f"(the run would overwrite what it points to): {fix}") from None
        if exc.errno == errno.EISDIR:
            raise UserError(f"--run-name {run_dir.name}: {path} is a directory, not a run's lock file: {fix}") from None
        raise UserError(f"--run-name {run_dir.name}: cannot open {path} ({os.strerror(exc.errno)}): make the run folder "
                        "writable, or choose another --run-name") from None
    found = os.fstat(fd)
    problem = ("is not a regular file (a FIFO, a socket or a device)" if not stat.S_ISREG(found.st_mode)
               else f"has {found.st_nlink} hard links (the run would overwrite the other names' file)"
               if found.st_nlink != 1 else None)
    if problem:
        os.close(fd)
        raise UserError(f"--run-name {run_dir.name}: {path} {problem}: {fix}")
    return fd


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _busy(run_dir: Path) -> RunFolderBusy:
    return RunFolderBusy(
        f"--run-name {run_dir.name}: the run folder {run_dir} is in use by another live run ({_holder(run_dir)}); "
        "wait for it to end, or choose another --run-name"
    )


def _holder(run_dir: Path) -> str:
    """The holder's record, read without following a link or waiting on a FIFO planted in its place."""
    try:
        fd = os.open(run_dir / RunFolder.LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a record")
            holder = json.loads(os.read(fd, _HOLDER_RECORD_MAX))
        finally:
            os.close(fd)
        host, since = (" ".join("".join(c for c in str(text) if c.isprintable()).split())[:255]
                       for text in (holder["host"], holder["since"]))
        return f"pid {int(holder['pid'])} on {host}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is"
