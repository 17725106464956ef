"""Which file-system errors a retry cannot fix (store/file_faults.py), however they reach the flow:
raised, wrapped by Ray (the cause chain), or only named in a library's text."""

from __future__ import annotations

import errno

import pytest

from grpo_pipeline.store.file_faults import FileFault, file_fault
from grpo_pipeline.errors import UserError


def _raised_from(outer: Exception, inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except Exception as chained:
        return chained


@pytest.mark.parametrize(("error", "line"), [
    (OSError(errno.ENOSPC, "No space left on device", "/runs/r1/checkpoints/x.pt"),
     "/runs/r1/checkpoints/x.pt: No space left on device (ENOSPC); free space on that file system"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/runs/r1/metrics.jsonl"),
     "/runs/r1/metrics.jsonl: Is a directory (EISDIR); a folder is where the run keeps a file: move it away"),
    (_raised_from(RuntimeError("Training failed due to worker errors:"),
                  FileExistsError(errno.EEXIST, "File exists", "/runs/r1/checkpoints")),
     "/runs/r1/checkpoints: File exists (EEXIST); a file is where the run keeps a folder"),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
     "No space left on device (ENOSPC); free space"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/r1/eval"), "/runs/r1/eval: Permission denied (EACCES)"),
], ids=["enospc", "folder-at-a-file", "wrapped-file-at-a-folder", "errno-in-rusts-text", "forbidden"])
def test_an_error_no_retry_fixes_is_a_user_error_naming_file_cause_and_fix(error, line):
    fault = file_fault(error)
    assert isinstance(fault, FileFault) and isinstance(fault, UserError) and str(fault).startswith(line), fault


@pytest.mark.parametrize("error", [
    OSError(errno.EIO, "Input/output error", "/nfs/runs/r1/metrics.jsonl"),  # a lost NFS server comes back
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/runs/r1/x"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    RuntimeError("a collective timed out"),
], ids=["eio", "enoent", "connection-reset", "not-a-file-error"])
def test_a_transient_error_stays_retryable(error, tmp_path):
    assert file_fault(error) is None and file_fault(error, tmp_path) is None  # tmp_path's disk is not full
