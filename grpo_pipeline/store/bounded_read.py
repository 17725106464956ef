"""Reading what a checkpoint or model directory brings, bounded before anything is parsed: only a
regular file (a FIFO would block the reader forever, /dev/zero would fill memory), only up to a
size a file of its kind has, and a pickle only as deep as its reader can hash it.

Used by the converter (checkpoints/hf_shards.py, checkpoints/dist_reader.py) and by the profile's and the
base-model stage's reading of config.json (profiles/hf_config.py, stages/model.py).
"""

from __future__ import annotations

import os
import pickletools
import stat
from pathlib import Path

MAX_JSON_BYTES = 64 * 1024**2  # a config.json is kilobytes; a 1T-parameter model's index a few MB
MAX_NAME_SHOWN = 160  # characters of a name from a file that an error line repeats
# A tuple nested deeper than this cannot come from torch's writers (their deepest is a few levels);
# hashing one ~100,000 deep overflows the C stack (tuple hashing recurses with no guard).
MAX_PICKLE_DEPTH = 100

_KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


class NotARegularFile(OSError):
    """A path whose contents cannot be read in bounded time and memory. An OSError, so the
    `cannot read` branch of each reader reports it with the file's name."""


def short(name: object, limit: int = MAX_NAME_SHOWN) -> str:
    """A name out of a file, as an error line shows it: its start and end, and how long it is."""
    text = str(name)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text):,} characters)"


def read_regular(path: Path, limit: int, follow_links: bool = True) -> bytes:
    """The bytes of `path` (a link is followed unless `follow_links` is False: then OSError ELOOP),
    if it is a regular file of at most `limit` bytes; else NotARegularFile saying what it is. Opened
    without blocking, so a FIFO answers at once."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        kind = next((name for test, name in _KINDS.items() if test(mode)), None)
        if kind is not None or not stat.S_ISREG(mode):
            raise NotARegularFile(f"it is {kind or 'not a regular file'}, not a regular file")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise NotARegularFile(f"it is larger than the {limit:,} bytes a file of its kind holds")
        return b"".join(chunks)
    finally:
        os.close(fd)


# Opcodes that build a new object from what they take off the stack: the object is one level
# deeper than the deepest of them. (A list, dict or set the stack holds is filled in place by
# APPEND(S)/SETITEM(S)/ADDITEMS/BUILD: unhashable, or hashed by Python code whose recursion is
# guarded, so it does not carry depth.)
_BUILDERS = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST", "FROZENSET"}
_FILLERS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}


def pickle_depth(data: bytes, limit: int = MAX_PICKLE_DEPTH) -> int | None:
    """How deep the objects a pickle builds nest, found by walking its opcodes without building
    anything; None once it passes `limit` (the walk stops there). ValueError for a broken stream."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    deepest = 0
    for op, arg, _ in pickletools.genops(data):
        name, before = op.name, op.stack_before
        if name == "MARK":
            marks.append(len(stack))
            continue
        if pickletools.markobject in before:  # what lies below the mark (APPENDS's list), then the slice
            if not marks:
                raise ValueError(f"{name} without a MARK")
            mark = marks.pop()
            start = mark - before.index(pickletools.markobject)
        else:
            start = len(stack) - len(before)
        if start < 0:
            raise ValueError(f"{name} on a stack of {len(stack)}")
        taken = stack[start:]
        del stack[start:]
        if name in _BUILDERS:
            depth = 1 + max(taken, default=0)
        elif name in _FILLERS or name in ("DUP", "MEMOIZE"):
            depth = taken[0]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            depth = stack[-1] if stack else 0
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            depth = memo.get(int(arg), 0)
        else:
            depth = 0
        if depth > limit:
            return None
        deepest = max(deepest, depth)
        if name == "MEMOIZE":
            memo[len(memo)] = depth
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = depth
        stack.extend([depth] * len(op.stack_after))
    return deepest
