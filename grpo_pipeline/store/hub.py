"""Fetch a pinned snapshot of a Hugging Face repo, verified file by file, with faults sorted into
"retry" and "stop".

huggingface_hub does the transfers (`snapshot_download`, parallel, resumable into a local dir). Around
it this module resolves the revision to a commit once, refuses file names that would escape the
target directory before anything is written, checks every downloaded file against the size and hash
the hub listed (sha256 for LFS files, the git blob id for the rest), and turns the client's
exceptions into `SourceError` (a retry cannot help: 401/403/404, a bad repo id, a bad file name) or
`TransientFetchError` (5xx, 429, reset connections, timeouts, a truncated body), which the Prefect
task retries with backoff.

The hub settings are read from the environment at call time, not at import time as
huggingface_hub does, because the environment stage may set them after the import:
HF_ENDPOINT (a mirror), HF_TOKEN (else the token file under HF_HOME), HF_HUB_OFFLINE.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from pydantic import BaseModel, Field

from grpo_pipeline.errors import UserError
from grpo_pipeline.store.hub_reach import hub_endpoint, hub_offline, reach_problem, unreachable
from grpo_pipeline.progress import Bar
from grpo_pipeline.store.content import HASH_THREADS, sha256_file, sha256_files

# A 429's Retry-After is honoured up to this long inside the attempt; longer waits are left to the
# task's own retry delay.
MAX_RETRY_AFTER_S = 60.0


class SourceError(UserError):
    """The source cannot give what was asked (missing, gated, malformed): retrying will not help."""


class TransientFetchError(Exception):
    """A fault that a later attempt may not meet: the task retries it."""


class HubSettings(BaseModel):
    endpoint: str = Field(..., description="Hub (or mirror) base URL.")
    token: str | None = Field(None, repr=False, exclude=True, description="Access token; never logged.")
    offline: bool = Field(False, description="HF_HUB_OFFLINE: no network at all.")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> HubSettings:
        env = os.environ if environ is None else environ
        token = env.get("HF_TOKEN") or None
        if token is None:
            token_file = Path(env.get("HF_HOME") or "~/.cache/huggingface").expanduser() / "token"
            token = token_file.read_text().strip() if token_file.is_file() else None
        return cls(endpoint=hub_endpoint(env), token=token, offline=hub_offline(env))


class Snapshot(BaseModel):
    repo_id: str
    repo_type: str
    revision: str = Field(..., description="The revision asked for.")
    commit: str = Field(..., description="The commit it resolved to.")
    files: list[str] = Field(..., description="Files fetched, relative to the target directory.")
    sha256: dict[str, str] = Field(..., description="sha256 of the files the hub lists one for (LFS), as checked.")
    bytes: int


def safe_relative_path(name: str) -> PurePosixPath:
    """A repo file name as a path that stays inside the target directory, or SourceError."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or any(part in ("..", "") for part in name.split("/")):
        raise SourceError(
            f"refused file name {name!r} from the hub: it would be written outside the target directory; "
            "check HF_ENDPOINT points at a trustworthy hub"
        )
    return path


def git_blob_id(path: Path) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def classify_hub_error(exc: BaseException, what: str) -> Exception:
    """The project's exception for a huggingface_hub / httpx failure while fetching `what`."""
    if isinstance(exc, GatedRepoError):
        return SourceError(f"{what} is a gated repo: accept its terms on the hub, then set HF_TOKEN")
    if isinstance(exc, RevisionNotFoundError):
        return SourceError(f"{what}: revision not found; check the revision (branch, tag or commit)")
    if isinstance(exc, RepositoryNotFoundError):
        return SourceError(f"{what} not found: check the repo id, or set HF_TOKEN if the repo is private")
    if isinstance(exc, RemoteEntryNotFoundError):
        return SourceError(f"{what}: a listed file is missing on the hub (404)")
    if isinstance(exc, OfflineModeIsEnabled):
        return SourceError(f"{what}: HF_HUB_OFFLINE is set and it is not cached; unset it or fetch it once online")
    if isinstance(exc, HFValidationError):
        return SourceError(f"{what}: {exc}")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status in (401, 403):
            return SourceError(f"{what}: access denied (HTTP {status}); set HF_TOKEN to a token that can read it")
        if status == 429:
            wait = _retry_after(exc.response)
            if wait:
                time.sleep(min(wait, MAX_RETRY_AFTER_S))
            return TransientFetchError(f"{what}: rate limited by the hub (HTTP 429)")
        if status >= 500:
            return TransientFetchError(f"{what}: the hub answered HTTP {status}")
        return SourceError(f"{what}: the hub answered HTTP {status}: {exc}")
    if isinstance(exc, (LocalEntryNotFoundError, ConnectionError, TimeoutError)) or _is_transport_error(exc):
        # LocalEntryNotFoundError is how the client reports a hub it could not reach.
        return TransientFetchError(f"{what}: {type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


# The HTTP client's transport failures (reset, truncated body, timeout), matched by class name:
# huggingface_hub moved from httpx to httpx2, whose classes are distinct but named alike.
_TRANSPORT_ERRORS = {"TransportError", "TimeoutException", "ChunkedEncodingError"}


def _is_transport_error(exc: BaseException) -> bool:
    return any(cls.__name__ in _TRANSPORT_ERRORS for cls in type(exc).__mro__)


def _retry_after(response) -> float:
    try:
        return float(response.headers.get("Retry-After", 0))
    except ValueError:
        return 0.0


def fetch_snapshot(
    repo_id: str,
    repo_type: str,
    revision: str,
    patterns: list[str] | None,
    target: Path,
    settings: HubSettings | None = None,
) -> Snapshot:
    """Download the files of `repo_id@revision` matching `patterns` into `target` and verify them.
    Files already complete in `target` (a previous attempt's) are not fetched again."""
    settings = settings or HubSettings.from_env()
    what = f"{repo_type} {repo_id}@{revision} from {settings.endpoint}"
    if settings.offline:
        raise SourceError(f"{what}: HF_HUB_OFFLINE is set and it is not cached; unset it or fetch it once online")
    api = HfApi(endpoint=settings.endpoint, token=settings.token)
    try:
        commit = api.repo_info(repo_id, repo_type=repo_type, revision=revision).sha
        listed = [
            item
            for item in api.list_repo_tree(repo_id, repo_type=repo_type, revision=commit, recursive=True)
            if isinstance(item, RepoFile)
        ]
    except Exception as exc:
        error = classify_hub_error(exc, what)
        # Not reaching the hub at all (a name that does not resolve, a refused connection) is no fault the
        # task's retries get past: asked again for a few seconds here, then said once.
        if isinstance(error, TransientFetchError) and (problem := reach_problem(settings.endpoint)):
            raise unreachable(f"{repo_type} {repo_id}", problem, settings.endpoint, "a local copy of it",
                              "the store") from None
        raise error from exc
    for item in listed:
        safe_relative_path(item.path)
    wanted = [item for item in listed if _matches(item.path, patterns)]
    if not wanted:
        raise SourceError(f"{what}: no file matches {patterns}; check data.files / the repo layout")
    lfs = [item.path for item in wanted if item.lfs]
    try:
        with HashAsTheyLand(target, lfs) as hasher:
            snapshot_download(
                repo_id,
            repo_type=repo_type,
                revision=commit,
                allow_patterns=[item.path for item in wanted],
                local_dir=target,
                endpoint=settings.endpoint,
                token=settings.token or False,
                tqdm_class=Bar,
            )
    except ValueError as exc:
        # The client's own refusal of a path outside local_dir, if the listing changed under us.
        raise SourceError(f"{what}: {exc}") from exc
    except Exception as exc:
        raise classify_hub_error(exc, what) from exc
    sha256 = _check_downloaded(wanted, target, what, hasher.digests())
    return Snapshot(
        repo_id=repo_id,
        repo_type=repo_type,
        revision=revision,
        commit=commit,
        files=[item.path for item in wanted],
        sha256=sha256,
        bytes=sum(item.size for item in wanted),
    )


def _matches(name: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(PurePosixPath(name).match(p) or name == p for p in patterns)


class HashAsTheyLand:
    """Hashes each file as soon as the client has moved it into place (it downloads to a temporary
    name, then renames), while the other files are still downloading, so checking a 244 GB snapshot
    costs little after its last byte arrives. A file that changed after it was hashed is hashed again."""

    POLL_S = 0.05

    def __init__(self, target: Path, names: list[str]):
        self.target, self.pending = target, set(names)
        self.hashed: dict[str, tuple[tuple[int, int], Future]] = {}
        self.pool = ThreadPoolExecutor(HASH_THREADS)
        self.stop = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> HashAsTheyLand:
        self.watcher.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.watcher.join()
        if exc_info[0] is not None:
            self.pool.shutdown(cancel_futures=True)

    def _watch(self) -> None:
        while not self.stop.wait(self.POLL_S):
            for name in list(self.pending):
                try:
                    stat = (self.target / name).stat()
                except FileNotFoundError:
                    continue
                self.pending.discard(name)
                self.hashed[name] = ((stat.st_size, stat.st_mtime_ns), self.pool.submit(sha256_file, self.target / name))

    def digests(self) -> dict[str, str]:
        """sha256 of every file that is there now."""
        found, stale = {}, []
        for name, (stat_then, future) in self.hashed.items():
            path = self.target / name
            stat = path.stat() if path.is_file() else None
            if stat is not None and (stat.st_size, stat.st_mtime_ns) == stat_then:
                found[name] = future.result()
            else:
                stale.append(name)
        self.pool.shutdown()
        late = [n for n in [*stale, *self.pending] if (self.target / n).is_file()]
        return found | dict(zip(late, sha256_files([self.target / n for n in late], "check against the hub")))


def _check_downloaded(wanted: list[RepoFile], target: Path, what: str, sha256: dict[str, str]) -> dict[str, str]:
    """Every file as the hub listed it (`sha256`: the digests of the LFS files); returns those
    digests. A damaged file is removed, so the retry fetches it again instead of trusting the
    client's record that it is complete."""
    missing = [item.path for item in wanted if not (target / item.path).is_file()]
    present = [item for item in wanted if item.path not in missing]
    damaged = [f"{name} missing" for name in missing]
    for item in present:
        path = target / item.path
        size = path.stat().st_size
        expected, actual = (item.lfs.sha256, sha256[item.path]) if item.lfs else (item.blob_id, git_blob_id(path))
        if size != item.size or actual != expected:
            damaged.append(f"{item.path} ({size} of {item.size} bytes, hash {'ok' if actual == expected else 'wrong'})")
            path.unlink()
    if damaged:
        raise TransientFetchError(f"{what}: damaged download: {', '.join(damaged)}")
    return {item.path: sha256[item.path] for item in present if item.lfs}
