"""A content store for datasets and models: built once, verified, never seen half-written.

    python -m grpo_pipeline.store.content ~/data/arith/b19035b198d99ff6 --deep   # check an entry, hashing every file

An entry lives at `<root>/<name>/<key>/`, where the key hashes everything that determines its content
(source, revision, file patterns, preprocessing version), so a second run with the same inputs finds
it no matter which run built it. Each entry holds a `manifest.json` with the size and sha256 of every
file. Building happens under a file lock, in `<root>/.staging/`, and the finished directory is
renamed into place: a reader (another run, another node on shared storage) sees no entry or a
complete one. A failed attempt leaves its scratch files for the retry to resume from and never
touches an existing good entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock
from pydantic import BaseModel, Field

from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.progress import Bar

MANIFEST = "manifest.json"
HASH_CHUNK = 8 << 20
# Hashing every byte of a 244 GB checkpoint on every run would cost minutes. Up to this size a
# cached entry is hashed in full on every use (datasets, small models: milliseconds); above it, a
# file whose size, mtime and ctime are those recorded when it was last hashed is trusted and any
# other file is hashed. Writing to a file changes its mtime, and setting the mtime back changes its
# ctime (which no call can set), so an edited file is always hashed.
DEEP_VERIFY_MAX_BYTES = 256 << 20
# Entries are shared by a team and by Ray nodes that may run as other users: everyone who can reach
# the store reads them (they hold data and weights, never a secret). Nothing rewrites an entry in
# place, so no one needs to write to it.
ENTRY_FILE_MODE, ENTRY_DIR_MODE = 0o644, 0o755
# sha256 runs outside the GIL, so files hash in parallel.
HASH_THREADS = min(8, os.cpu_count() or 1)


class FileRecord(BaseModel):
    size: int = Field(..., ge=0, description="Bytes.")
    sha256: str = Field(..., description="Hex sha256 of the content.")
    mtime_ns: int | None = Field(None, description="Modification time when hashed.")
    ctime_ns: int | None = Field(None, description="Inode change time when hashed.")

    def stat_matches(self, stat: os.stat_result) -> bool:
        return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns) == (self.size, self.mtime_ns, self.ctime_ns)


class Built(BaseModel):
    """What a build function reports: facts for the manifest, and the sha256 of files it already
    hashed (a download checked against the hub's hashes), which are not read a second time."""

    details: dict[str, Any] = Field(default_factory=dict)
    sha256: dict[str, str] = Field(default_factory=dict)


class Manifest(BaseModel):
    """What an entry holds and where it came from."""

    identity: dict[str, Any] = Field(..., description="The inputs the entry's key hashes.")
    files: dict[str, FileRecord] = Field(..., description="Every file of the entry, by relative path.")
    details: dict[str, Any] = Field(default_factory=dict, description="Facts found while building it.")
    created: str = Field(..., description="UTC time the entry was built.")

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files.values())


def entry_key(identity: dict[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def sha256_file(path: Path, bar: Bar | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


def content_files(directory: Path) -> list[Path]:
    """The files an entry is made of: everything but the manifest and hidden bookkeeping."""
    found = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_file() and relative.parts[0] != MANIFEST and not any(p.startswith(".") for p in relative.parts):
            found.append(path)
    return found


def sha256_files(paths: list[Path], desc: str) -> list[str]:
    """sha256 of each file, hashed in parallel, with one progress bar over all their bytes."""
    with Bar(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc=desc, leave=False) as bar:
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            return list(pool.map(lambda p: sha256_file(p, bar), paths))


def hash_tree(directory: Path, desc: str, known: dict[str, str] | None = None) -> dict[str, FileRecord]:
    known = known or {}
    files = {f.relative_to(directory).as_posix(): f for f in content_files(directory)}
    todo = [name for name in files if name not in known]
    hashes = dict(known) | dict(zip(todo, sha256_files([files[n] for n in todo], desc)))
    return {name: _record(path.stat(), hashes[name]) for name, path in files.items()}


def _record(stat: os.stat_result, sha256: str) -> FileRecord:
    return FileRecord(size=stat.st_size, sha256=sha256, mtime_ns=stat.st_mtime_ns, ctime_ns=stat.st_ctime_ns)


def read_manifest(directory: Path) -> Manifest | None:
    try:
        return Manifest.model_validate_json((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def fingerprint(directory: Path) -> str | None:
    """What a directory looks like now, cheaply: each file's name, size and mtime; None when it does
    not exist. A cached result that was read from the directory stands only while this is unchanged."""
    if not directory.is_dir():
        return None
    digest = hashlib.sha256()
    for path in content_files(directory):
        stat = path.stat()
        digest.update(f"{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def verify_entry(directory: Path, deep: bool | None = None) -> list[str]:
    """Problems with an entry (empty when intact). deep=True hashes every file; deep=False only
    compares sizes (a quick look, e.g. from another node); the default hashes every file of a small
    entry, and of a large one each file whose size, mtime or ctime is not the one recorded (and
    records the new times of a file that proves intact, so it is not hashed again)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory / MANIFEST} is missing or unreadable"]
    small = manifest.total_bytes <= DEEP_VERIFY_MAX_BYTES
    problems, to_hash, restamped = [], [], {}
    for name, record in manifest.files.items():
        path = directory / name
        try:
            stat = path.stat()
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if stat.st_size != record.size:
            problems.append(f"{name} has {stat.st_size} bytes, the manifest says {record.size}")
        elif deep or (deep is None and (small or not record.stat_matches(stat))):
            to_hash.append((name, stat))
    hashes = sha256_files([directory / name for name, _ in to_hash], f"verify {directory.parent.name}")
    for (name, stat), digest in zip(to_hash, hashes):
        if digest != manifest.files[name].sha256:
            problems.append(f"{name} does not match its sha256")
        elif not manifest.files[name].stat_matches(stat):
            restamped[name] = _record(stat, digest)
    extra = {f.relative_to(directory).as_posix() for f in content_files(directory)} - set(manifest.files)
    problems += [f"{name} is not in the manifest" for name in sorted(extra)]
    if restamped and not problems:
        _restamp(directory, manifest, restamped)
    return problems


def _restamp(directory: Path, manifest: Manifest, records: dict[str, FileRecord]) -> None:
    """Best effort: a reader without write access to a shared store only hashes those files again."""
    try:
        updated = manifest.model_copy(update={"files": manifest.files | records})
        write_json_atomic(directory / MANIFEST, updated.model_dump(mode="json"), mode=ENTRY_FILE_MODE)
    except OSError:
        pass


def what_is_checked(directory: Path) -> str:
    """What `verify_entry` checks on this entry by default, in words (for the log of a cache hit)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return "no manifest"
    files, size = len(manifest.files), Bar.format_sizeof(manifest.total_bytes, "B", 1000)
    if manifest.total_bytes <= DEEP_VERIFY_MAX_BYTES:
        return f"sha256 of all {files} files ({size})"
    return f"size, mtime and ctime of all {files} files ({size}), sha256 of any that changed"


class Entry(BaseModel):
    path: Path
    manifest: Manifest
    cached: bool = Field(..., description="True when an intact entry was found and nothing was built.")


def make_readable(directory: Path) -> None:
    """Entry modes (ENTRY_FILE_MODE, ENTRY_DIR_MODE), whatever the builder's umask; done before the
    manifest records each file's ctime, which a chmod changes."""
    os.chmod(directory, ENTRY_DIR_MODE)
    for path in directory.rglob("*"):
        os.chmod(path, ENTRY_DIR_MODE if path.is_dir() else ENTRY_FILE_MODE)


class Store:
    """Entries under one root directory (shared by every node on a cluster)."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()

    def path_for(self, name: str, identity: dict[str, Any]) -> Path:
        return self.root / name / entry_key(identity)

    def lookup(self, name: str, identity: dict[str, Any]) -> Entry | None:
        path = self.path_for(name, identity)
        manifest = read_manifest(path)
        if manifest is None or manifest.identity != identity or verify_entry(path):
            return None
        return Entry(path=path, manifest=manifest, cached=True)

    def get_or_build(
        self,
        name: str,
        identity: dict[str, Any],
        build: Callable[[Path, Path], Built],
        log: Callable[[str], None] = print,
    ) -> Entry:
        """Return the intact entry for `identity`, building it first if needed.

        `build(scratch, out)` fills the empty directory `out` and says what it found (`Built`);
        `scratch` survives failed attempts (a retry resumes its downloads) and is removed on success.
        """
        if found := self.lookup(name, identity):
            return found
        final = self.path_for(name, identity)
        with self._locked(name, final.name):
            # Another run may have built it while this one waited for the lock.
            if found := self.lookup(name, identity):
                return found
            if final.exists():
                log(f"{final} is damaged ({'; '.join(verify_entry(final))}); building it again")
            staging = self.root / ".staging" / f"{name}-{final.name}"
            scratch, out = staging / "scratch", staging / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            scratch.mkdir(exist_ok=True)
            built = build(scratch, out)
            make_readable(out)
            manifest = Manifest(
                identity=identity,
                files=hash_tree(out, f"sha256 {name}", built.sha256),
                details=built.details,
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            )
            write_json_atomic(out / MANIFEST, manifest.model_dump(mode="json"), mode=ENTRY_FILE_MODE)
            self._install(out, final)
            shutil.rmtree(staging, ignore_errors=True)
            return Entry(path=final, manifest=manifest, cached=False)

    @contextmanager
    def _locked(self, name: str, key: str) -> Iterator[None]:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(locks / f"{name}-{key}.lock")):
            yield

    def _install(self, built: Path, final: Path) -> None:
        """Rename the finished directory into place; a damaged old entry is moved aside first and
        removed only once the new one is there."""
        final.parent.mkdir(parents=True, exist_ok=True)
        aside = None
        if final.exists():
            aside = self.root / ".trash" / f"{final.parent.name}-{final.name}-{time.time_ns()}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(final, aside)
        os.replace(built, final)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo_pipeline.store.content ENTRY... [--deep]`: check store entries; exit 1 if one is damaged."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo_pipeline.store.content", description="Check content-store entries.")
    parser.add_argument("entries", nargs="+", type=Path, help="entry directories (each holds a manifest.json)")
    parser.add_argument("--deep", action="store_true", help="hash every file, whatever its timestamps say")
    args = parser.parse_args(argv)
    damaged = 0
    for entry in args.entries:
        problems = verify_entry(entry, deep=True if args.deep else None)
        damaged += bool(problems)
        print(f"{entry}: {'; '.join(problems) if problems else 'intact'}")
    return 1 if damaged else 0


if __name__ == "__main__":
    raise SystemExit(main())
