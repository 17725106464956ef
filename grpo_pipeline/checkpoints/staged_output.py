"""A conversion's output directory OUT: checked before anything is read, written beside itself in
`<OUT>.partial-<id>`, renamed into place when complete, removed on every failure.

    python -m grpo_pipeline.checkpoints.convert to-dist HF_DIR OUT

- OUT must not exist (the store's empty staging directory is accepted where the caller says so),
  must not be a link, and must be creatable: making its partial, parents included, is the check, so
  a file in the way, a read-only filesystem or /proc fail before a byte is read.
- A partial holds `.writer.lock`, locked (flock) by its writer for its lifetime: a later conversion
  of the same OUT tells a dead writer's partial (kill -9, a lost machine: its lock is free) from a
  live one's, and removes only the dead ones, saying so. The lock is taken before the partial gets
  its name (it is made under a hidden name and renamed), so no live writer's partial is seen unlocked.
- Modes: every file gets what a plain file created here gets (0666 less the umask; safetensors
  writes 0600), every directory 0777 less the umask: run files are for the team (store/files.py).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from grpo_pipeline.store.files import share_tree
from grpo_pipeline.errors import UserError

LOCK = ".writer.lock"


class OutputError(UserError):
    """An OUT that cannot be written: it exists, is a link, or its filesystem refuses."""


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


class StagedOutput:
    """`with StagedOutput(out) as staged:` write into `staged.path`, then `staged.commit()`."""

    def __init__(self, out: Path, log: Callable[[str], None] = note, empty_dir_ok: bool = False):
        self.out, self.empty_dir_ok, self.committed = Path(out), empty_dir_ok, False
        try:
            self._check_out()
        except OSError as exc:
            raise OutputError(f"{self.out}: cannot be checked ({exc.strerror}); give OUT in a directory you can write") from None
        for partial in remove_dead_partials(self.out):
            log(f"removed {partial}, left by a conversion to {self.out} whose writer died")
        self._made: list[Path] = []
        token = uuid.uuid4().hex[:8]
        self.path = self.out.with_name(f"{self.out.name}.partial-{token}")
        birth, self._lock = self.out.with_name(f".{self.out.name}.partial-{token}"), None
        try:
            for parent in reversed([p for p in self.out.parents if not p.exists()]):
                parent.mkdir()
                self._made.append(parent)
            birth.mkdir()
            self._lock = os.open(birth / LOCK, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX)
            except OSError as exc:  # a filesystem without locks (Lustre without `-o flock`): no later run removes it
                if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                    raise
            os.rename(birth, self.path)
        except OSError as exc:
            shutil.rmtree(birth, ignore_errors=True)
            self.abort()
            failed = Path(exc.filename or self.out)
            what = f"write in {failed.parent}" if failed == birth else f"create {failed}"
            raise OutputError(f"{self.out}: cannot {what} ({exc.strerror}); give OUT in a directory you can write, "
                              "on a writable filesystem") from None

    def _check_out(self) -> None:
        out = self.out
        if out.is_symlink():
            target = os.readlink(out)
            raise OutputError(f"{out} is a symbolic link (to {target}{'' if out.exists() else ', which does not exist'}); "
                              "give a new directory, not a link")
        if self._in_the_way():
            raise OutputError(f"{out} exists; give a new directory (nothing is written over)")
        existing = next(p for p in out.parents if p.exists())
        if not existing.is_dir():
            raise OutputError(f"{out}: {existing} is a file, not a directory; give OUT in a directory")

    def _in_the_way(self) -> bool:
        """OUT is there, and is not the empty directory the caller lets this conversion replace."""
        out = self.out
        return os.path.lexists(out) and not (self.empty_dir_ok and out.is_dir() and not out.is_symlink()
                                             and not any(out.iterdir()))

    def __enter__(self) -> StagedOutput:
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if self.committed:
            return False
        self.abort()
        if isinstance(exc, OSError):  # a full disk, an I/O error: one line, and nothing left
            raise OutputError(f"{self.out}: the conversion failed ({exc}); nothing was written") from None
        return False

    def commit(self) -> Path:
        """Rename the complete partial into place; OUT made meanwhile by another process is left as it
        is, and this partial removed."""
        share_tree(self.path)
        try:
            if self._in_the_way():
                raise FileExistsError(errno.EEXIST, "it exists")
            os.rename(self.path, self.out)  # fails on a non-empty directory, a file or a link made since the check
        except OSError as exc:
            self.abort()
            raise OutputError(f"{self.out} was made by another process during the conversion ({exc.strerror}); it is "
                              "left as it is and this conversion removed: give a new directory") from None
        os.unlink(self.out / LOCK)
        os.close(self._lock)
        self.committed = True
        return self.out

    def abort(self) -> None:
        """Remove the partial and the parents this conversion made."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        for parent in reversed(self._made):
            try:
                parent.rmdir()
            except OSError:
                break


def remove_dead_partials(out: Path) -> list[str]:
    """Remove the partials of `out` whose writers are dead (their lock is free); say what went."""
    removed = []
    for partial in Path(out).parent.glob(f"{glob.escape(Path(out).name)}.partial-*"):
        if partial.is_symlink():
            continue
        try:
            lock = os.open(partial / LOCK, os.O_RDWR)  # no lock file: not this converter's partial, left alone
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer is alive (or the filesystem has no locks to tell)
            os.close(lock)
            continue
        size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(partial, ignore_errors=True)
        os.close(lock)
        removed.append(f"{partial} ({size / 1e6:.1f} MB)")
    return removed
