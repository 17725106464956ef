"""The content store: built once, verified on every use, damaged entries rebuilt, failed builds never
seen, concurrent builders serialised by the file lock."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

import grpo_pipeline.store.content
from grpo_pipeline.store.content import MANIFEST, Built, Store, verify_entry

IDENTITY = {"source": "unit", "revision": "r1"}


def build_two_files(calls: list):
    def build(scratch: Path, out: Path) -> Built:
        calls.append(out)
        (out / "a.txt").write_text("alpha")
        (out / "sub").mkdir()
        (out / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)
        return Built(details={"note": "built"})

    return build


def test_built_once_then_found_by_content_key(tmp_path):
    store, calls = Store(tmp_path), []
    first = store.get_or_build("thing", IDENTITY, build_two_files(calls))
    assert not first.cached and first.manifest.details == {"note": "built"}
    assert set(first.manifest.files) == {"a.txt", "sub/b.bin"} and first.manifest.files["a.txt"].size == 5
    again = store.get_or_build("thing", dict(IDENTITY), build_two_files(calls))
    assert again.cached and again.path == first.path and len(calls) == 1
    other = store.get_or_build("thing", {**IDENTITY, "revision": "r2"}, build_two_files(calls))
    assert other.path != first.path and len(calls) == 2
    assert not (tmp_path / ".staging" / f"thing-{first.path.name}").exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / "a.txt").write_text("ALPHA"),  # same size, different bytes
        lambda p: (p / "sub" / "b.bin").write_bytes(b"short"),  # truncated
        lambda p: (p / "a.txt").unlink(),
        lambda p: (p / MANIFEST).write_text("{not json"),
        lambda p: (p / "stray.txt").write_text("x"),
    ],
    ids=["bitflip", "truncated", "missing", "bad-manifest", "extra-file"],
)
def test_a_damaged_entry_is_detected_and_built_again(tmp_path, damage):
    store, calls = Store(tmp_path), []
    entry = store.get_or_build("thing", IDENTITY, build_two_files(calls))
    damage(entry.path)
    assert verify_entry(entry.path)
    rebuilt = store.get_or_build("thing", IDENTITY, build_two_files(calls), log=lambda m: None)
    assert not rebuilt.cached and len(calls) == 2 and verify_entry(rebuilt.path) == []
    assert (rebuilt.path / "a.txt").read_text() == "alpha"


def test_a_failed_build_leaves_no_entry_and_keeps_its_scratch(tmp_path):
    store = Store(tmp_path)

    def half_then_fail(scratch: Path, out: Path) -> Built:
        (scratch / "partial.download").write_bytes(b"12345")
        (out / "a.txt").write_text("half")
        raise ConnectionResetError("mirror went away")

    with pytest.raises(ConnectionResetError):
        store.get_or_build("thing", IDENTITY, half_then_fail)
    final = store.path_for("thing", IDENTITY)
    assert not final.exists()
    assert store.lookup("thing", IDENTITY) is None

    def resume(scratch: Path, out: Path) -> Built:
        assert (scratch / "partial.download").read_bytes() == b"12345"  # the retry can resume
        assert not (out / "a.txt").exists()  # but starts its output afresh
        (out / "a.txt").write_text("alpha")
        return Built()

    assert (store.get_or_build("thing", IDENTITY, resume).path / "a.txt").read_text() == "alpha"


def test_a_failed_rebuild_leaves_the_old_entry_where_it_was(tmp_path):
    store, calls = Store(tmp_path), []
    entry = store.get_or_build("thing", IDENTITY, build_two_files(calls))
    (entry.path / "a.txt").write_text("ALPHA")

    def fail(scratch: Path, out: Path) -> Built:
        (out / "a.txt").write_text("partial")
        raise TimeoutError("read timed out")

    with pytest.raises(TimeoutError):
        store.get_or_build("thing", IDENTITY, fail, log=lambda m: None)
    assert (entry.path / "a.txt").read_text() == "ALPHA" and (entry.path / "sub" / "b.bin").exists()


def _slow_builder(root: str, started: str) -> str:
    def build(scratch: Path, out: Path) -> Built:
        Path(started).joinpath(str(time.time_ns())).touch()
        time.sleep(1.0)
        (out / "a.txt").write_text("alpha")
        return Built()

    return str(Store(root).get_or_build("thing", IDENTITY, build).path)


@pytest.mark.e2e  # builds from several processes at once
def test_concurrent_runs_build_once_and_never_see_half_an_entry(tmp_path):
    started = tmp_path / "started"
    started.mkdir()
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        paths = pool.starmap(_slow_builder, [(str(tmp_path / "root"), str(started))] * 3)
    assert len(set(paths)) == 1 and len(list(started.iterdir())) == 1
    assert verify_entry(Path(paths[0])) == []


def test_a_large_entry_edited_with_its_mtime_set_back_is_still_hashed_and_caught(tmp_path, monkeypatch):
    """Setting the mtime back (touch -r) changes the ctime, which no call can set: the edit is seen."""
    monkeypatch.setattr("grpo_pipeline.store.content.DEEP_VERIFY_MAX_BYTES", 100)
    entry = Store(tmp_path).get_or_build("thing", IDENTITY, build_two_files([]))
    blob = entry.path / "sub" / "b.bin"
    before = blob.stat()
    with open(blob, "r+b") as handle:  # one byte in the middle, same size
        handle.seek(1000)
        handle.write(b"\x00" if handle.read(1) != b"\x00" else b"\x01")
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert blob.stat().st_mtime_ns == before.st_mtime_ns and blob.stat().st_size == before.st_size
    assert verify_entry(entry.path) == ["sub/b.bin does not match its sha256"]


def test_a_large_entry_hashes_only_files_whose_times_changed_and_only_once(tmp_path, monkeypatch):
    """Unchanged files are trusted on their size, mtime and ctime; a file whose times changed but not
    its bytes (a copied store) is hashed, and the manifest then records its new times."""
    monkeypatch.setattr("grpo_pipeline.store.content.DEEP_VERIFY_MAX_BYTES", 100)  # the entry (2.5 kB) counts as large
    entry = Store(tmp_path).get_or_build("thing", IDENTITY, build_two_files([]))
    hashed = []
    real = grpo_pipeline.store.content.sha256_files
    monkeypatch.setattr("grpo_pipeline.store.content.sha256_files", lambda paths, desc: hashed.append(len(paths)) or real(paths, desc))
    assert verify_entry(entry.path) == [] and hashed == [0]
    blob = entry.path / "sub" / "b.bin"
    os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 10**9))
    assert verify_entry(entry.path) == [] and hashed == [0, 1]
    assert verify_entry(entry.path) == [] and hashed == [0, 1, 0]
    assert verify_entry(entry.path, deep=True) == [] and hashed == [0, 1, 0, 2]


def test_entries_are_readable_by_everyone_whatever_the_builders_umask(tmp_path):
    old = os.umask(0o077)
    try:
        entry = Store(tmp_path).get_or_build("thing", IDENTITY, build_two_files([]))
    finally:
        os.umask(old)
    for path in [entry.path, *entry.path.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path
    assert verify_entry(entry.path) == []  # the manifest recorded the times after the modes were set


def test_run_files_follow_the_umask_and_private_ones_are_owner_only(tmp_path):
    from grpo_pipeline.store.files import write_text_atomic

    old = os.umask(0o022)
    try:
        shared = write_text_atomic(tmp_path / "report.md", "# report")
        private = write_text_atomic(tmp_path / "lease.json", "{}", private=True)
    finally:
        os.umask(old)
    assert shared.stat().st_mode & 0o777 == 0o644 and private.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_deep_check_command_reports_each_entry(tmp_path, capsys):
    from grpo_pipeline.store.content import main

    good = Store(tmp_path).get_or_build("thing", IDENTITY, build_two_files([]))
    bad = Store(tmp_path).get_or_build("thing", {**IDENTITY, "revision": "r2"}, build_two_files([]))
    (bad.path / "a.txt").write_text("ALPHA")
    assert main([str(good.path), str(bad.path), "--deep"]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{good.path}: intact", f"{bad.path}: a.txt does not match its sha256"]
