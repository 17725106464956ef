"""A fake Hugging Face Hub on 127.0.0.1 for the real `huggingface_hub` client (2.4.0): what it downloads with
`snapshot_download` / `hf_hub_download`, i.e.

    GET  /api/{models|datasets}/{repo_id}[/revision/{rev}]    repo info (id, sha, siblings, ...)
    GET  /api/{models|datasets}/{repo_id}/tree/{rev}[/{dir}]  tree listing (recursive, cursor pagination)
    HEAD/GET /{repo_id}/resolve/{rev}/{path}                  model files (datasets: /datasets/{repo_id}/...)

plus `/api/agent-harnesses` and `/api/telemetry/*`, answered harmlessly. Errors carry the `X-Error-Code` /
`X-Error-Message` headers from which `hf_raise_for_status` builds RepositoryNotFoundError, GatedRepoError,
RevisionNotFoundError and RemoteEntryNotFoundError. `fail()` injects faults (status codes, a reset connection,
a cleanly truncated body) so tests can pin down how the client reacts to a flaky Hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import struct
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

# Files the Hub would keep in LFS. Their ETag is the sha256 of the content, which the client re-checks against
# a file already in local_dir; small files get a git blob sha1, as on the real Hub.
LFS_SUFFIXES = (".safetensors", ".parquet", ".bin", ".arrow", ".pt", ".pth", ".gguf", ".onnx", ".npy", ".h5", ".zip")
LFS_MIN_SIZE = 10 * 1024 * 1024
_STATUS_FAULTS = {"404": 404, "429": 429, "500": 500, "503": 503}
_FAULT_KINDS = set(_STATUS_FAULTS) | {"drop", "truncate"}


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_ENTRY_CACHE: dict[tuple[str, int], tuple[bytes, dict]] = {}


def _tree_entry(path: str, data: bytes) -> dict:
    """The listing entry of a file, hashed once per content object: hashing hundreds of MB on every
    HEAD and tree request would make the server, not the client, the bottleneck of a benchmark."""
    cached = _ENTRY_CACHE.get((path, id(data)))
    if cached is not None and cached[0] is data:
        return cached[1]
    entry = _hash_entry(path, data)
    _ENTRY_CACHE[(path, id(data))] = (data, entry)
    return entry


def _hash_entry(path: str, data: bytes) -> dict:
    entry: dict = {"type": "file", "path": path, "size": len(data), "oid": _git_blob_sha1(data)}
    if path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE:
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
        # On the Hub an LFS file's git oid is that of its pointer file; `size` is the real file's.
        entry["oid"] = _git_blob_sha1(pointer)
        entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}
    return entry


class _Repo:
    def __init__(self, repo_type: str, repo_id: str):
        self.type, self.id, self.gated = repo_type, repo_id, False
        self.commits: dict[str, dict[str, bytes]] = {}  # sha -> {path: content}
        self.refs: dict[str, str] = {}  # branch/tag -> sha
        self.latest = ""
        self.date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    def resolve(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # The client resets pooled connections it gives up on (e.g. after an error status mid-stream): not a bug.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HubServer:
    """with HubServer() as hub: hub.url -> 'http://127.0.0.1:PORT'; pass it as `endpoint=` to the client.

    `requests` lists (method, path with query) of every request received, faulted ones included.
    """

    token = "hf_test_token"
    tree_page_size = 1000  # the Hub's page size; lower it to make the client follow `Link: rel="next"`
    # Bytes per second for all file bodies together (None: as fast as loopback goes), so a benchmark
    # can see what a real link does: the client waits on the network, not on the CPU.
    bandwidth: float | None = None

    def __init__(self, port: int = 0):
        self._lock = threading.Lock()
        self._link = threading.Lock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._faults: list[list] = []  # [path_contains, kind, times_left, method]
        self._conns: set[socket.socket] = set()
        self.requests: list[tuple[str, str]] = []
        self._httpd = _Server(("127.0.0.1", port), _Handler)
        self._httpd.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        # The client pools keep-alive connections; end them so no handler thread outlives the server.
        with self._lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_repo(self, repo_id: str, files: dict[str, bytes], repo_type: str = "dataset", revision: str = "main",
                 gated: bool = False) -> str:
        """Publish `files` at `revision` (also resolvable by the returned sha); gated repos need `token`."""
        assert repo_type in ("model", "dataset"), repo_type
        with self._lock:
            repo = self._repos.setdefault((repo_type, repo_id), _Repo(repo_type, repo_id))
            seed = f"{repo_type}/{repo_id}@{revision}#{len(repo.commits)}".encode()
            sha = hashlib.sha1(seed + b"".join(_git_blob_sha1(files[p]).encode() for p in sorted(files))).hexdigest()
            repo.commits[sha] = dict(files)
            repo.refs[revision] = repo.latest = sha
            repo.gated = gated
            return sha

    def add_raw_tree_entry(self, repo_id: str, path: str, content: bytes, repo_type: str = "dataset") -> None:
        """Add any name, even '../evil.txt', to the latest commit's listing."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            repo.commits[repo.latest][path] = content  # no name check on purpose: the client must do it

    def fail(self, path_contains: str, kind: str, times: int = 1, method: str | None = None) -> None:
        """Fault the next `times` requests whose unquoted path+query contains `path_contains` (and `method`).

        '404'/'429'/'500'/'503' answer that status (429 with Retry-After: 1); 'drop' sends half the body of a GET,
        then resets the connection; 'truncate' sends half the body under the full Content-Length, then closes
        cleanly. For a HEAD, 'drop'/'truncate' reset / close the connection before any response.
        """
        assert kind in _FAULT_KINDS, kind
        with self._lock:
            self._faults.append([path_contains, kind, times, method])

    def reset_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def _record_and_take_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests.append((method, path))
            for fault in self._faults:
                if fault[2] > 0 and fault[0] in unquote(path) and fault[3] in (None, method):
                    fault[2] -= 1
                    return fault[1]
        return None

    def _repo(self, repo_type: str, segments: list[str]) -> tuple[_Repo | None, list[str]]:
        """Split URL segments into a known repo and the rest (repo ids have one or two segments)."""
        with self._lock:
            for n in (2, 1):
                repo = self._repos.get((repo_type, "/".join(segments[:n])))
                if repo is not None and len(segments) >= n:
                    return repo, segments[n:]
        return None, segments


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub: every response must carry Content-Length

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._conns.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._conns.discard(self.connection)
        super().finish()

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:  # telemetry and anything else posted: read and ignore the body
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()

    def do_GET(self) -> None:
        fault = self.hub._record_and_take_fault(self.command, self.path)
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        # Split before unquoting: a revision like `refs%2Fpr%2F1` is a single segment.
        segs = [unquote(s) for s in url.path.split("/")[1:]]
        if fault in _STATUS_FAULTS:
            # An injected 404 reads like the Hub's own: a missing file on /resolve, a missing repo on the API.
            code = ("EntryNotFound" if "resolve" in segs else "RepoNotFound") if fault == "404" else None
            status, headers, body = self._error(_STATUS_FAULTS[fault], code, f"Injected {fault}")
            if fault == "429":
                headers["Retry-After"] = "1"
        else:
            status, headers, body = self._route(segs, query)
        self._send(status, headers, body, fault)

    do_HEAD = do_GET

    def _route(self, segs: list[str], query: dict[str, str]) -> tuple[int, dict, bytes]:
        if segs[:2] == ["api", "agent-harnesses"]:
            return self._json({"standardEnvVars": [], "harnesses": {}})
        if segs[:2] == ["api", "telemetry"]:
            return self._json({})
        if segs[:1] == ["api"] and len(segs) > 2 and segs[1] in ("models", "datasets"):
            repo, rest = self.hub._repo(segs[1][:-1], segs[2:])
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if not rest or rest[0] == "revision":
                return self._repo_info(repo, rest[1] if len(rest) > 1 else "main")
            if rest[0] == "tree" and len(rest) > 1:
                return self._tree(repo, rest[1], "/".join(rest[2:]), query)
        elif "resolve" in segs:
            repo_type, rest = ("dataset", segs[1:]) if segs[0] == "datasets" else ("model", segs)
            repo, rest = self.hub._repo(repo_type, rest)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if len(rest) > 2 and rest[0] == "resolve":
                return self._resolve(repo, rest[1], "/".join(rest[2:]))
        return self._error(404, None, "Not found")

    def _repo_info(self, repo: _Repo, revision: str) -> tuple[int, dict, bytes]:
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]  # sizes and hashes are the tree listing's business (files_metadata is not served)
        return self._json({
            "_id": hashlib.md5(repo.id.encode()).hexdigest()[:24], "id": repo.id, "author": repo.id.split("/")[0],
            "sha": sha, "lastModified": repo.date, "createdAt": repo.date, "private": False,
            "gated": "auto" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(files)], "usedStorage": sum(len(d) for d in files.values()),
        })

    def _tree(self, repo: _Repo, revision: str, folder: str, query: dict[str, str]) -> tuple[int, dict, bytes]:
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files, prefix = repo.commits[sha], folder + "/" if folder else ""
        recursive = query.get("recursive", "").lower() == "true"
        entries: dict[str, dict] = {}
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            # Like the Hub, list the directories too (recursively: every level; otherwise the direct children).
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                d = prefix + "/".join(parts[:depth])
                entries.setdefault(d, {"type": "directory", "path": d, "size": 0, "oid": _git_blob_sha1(d.encode())})
            if recursive or len(parts) == 1:
                entries[path] = _tree_entry(path, files[path])
        if folder and not entries:
            return self._error(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        listing = sorted(entries.values(), key=lambda e: e["path"])
        start, size = int(query.get("cursor", 0)), self.hub.tree_page_size
        status, headers, body = self._json(listing[start:start + size])
        if start + size < len(listing):  # cursor pagination, followed by huggingface_hub via the `Link` header
            query["cursor"] = str(start + size)
            headers["Link"] = f'<{self.hub.url}{urlsplit(self.path).path}?{urlencode(query)}>; rel="next"'
        return status, headers, body

    def _resolve(self, repo: _Repo, revision: str, path: str) -> tuple[int, dict, bytes]:
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if repo.gated:
            auth = self.headers.get("Authorization")
            if auth != f"Bearer {self.hub.token}":
                # The Hub answers 401 to anonymous calls and 403 to a token without access; both say GatedRepo.
                msg = f"Access to {repo.type} {repo.id} is restricted. You must have access to it and be authenticated."
                return self._error(401 if auth is None else 403, "GatedRepo", msg)
        data = repo.commits[sha].get(path)
        if data is None:
            status, headers, body = self._error(404, "EntryNotFound", "Entry not found")
            headers["X-Repo-Commit"] = sha  # the client caches the file's absence under this commit
            return status, headers, body
        entry = _tree_entry(path, data)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", "X-Repo-Commit": sha,
                   "ETag": f'"{etag}"'}
        if "lfs" in entry:  # what the client prefers to ETag/Content-Length for LFS files
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        rng = self.headers.get("Range")
        if rng is None:
            return 200, headers, data
        try:  # `http_get` resumes with `bytes=N-`; also accept `bytes=a-b` and `bytes=-n`
            first, last = rng.removeprefix("bytes=").split("-")
            start = len(data) - int(last) if first == "" else int(first)
            end = len(data) - 1 if first == "" or last == "" else min(int(last), len(data) - 1)
            if not 0 <= start <= end:
                raise ValueError(rng)
        except ValueError:
            return 416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b""
        return 206, {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}, data[start:end + 1]

    @staticmethod
    def _json(obj) -> tuple[int, dict, bytes]:
        return 200, {"Content-Type": "application/json"}, json.dumps(obj).encode()

    @staticmethod
    def _error(status: int, code: str | None, message: str) -> tuple[int, dict, bytes]:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code is not None:
            headers["X-Error-Code"] = code
        return status, headers, json.dumps({"error": message}).encode()

    def _send(self, status: int, headers: dict, body: bytes, fault: str | None) -> None:
        if fault in ("drop", "truncate") and self.command != "GET":
            # Nothing to cut short in a bodiless answer: the connection ends before any response.
            return self._close(reset=fault == "drop")
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault in ("drop", "truncate"):
            self.wfile.write(body[: len(body) // 2])
            return self._close(reset=fault == "drop")
        if self.hub.bandwidth is None or len(body) < 1 << 20:
            self.wfile.write(body)
            return
        for start in range(0, len(body), 1 << 20):
            with self.hub._link:  # one shared link: concurrent downloads split its bandwidth
                chunk = body[start:start + (1 << 20)]
                time.sleep(len(chunk) / self.hub.bandwidth)
            self.wfile.write(chunk)

    def _close(self, reset: bool) -> None:
        self.close_connection = True
        if not reset:
            return  # the server then closes the socket with a FIN: a clean, early end of the body
        time.sleep(0.1)  # let the client take in the partial body first: a RST may discard data not yet read
        # SO_LINGER 0 turns close() into a TCP RST. Close the makefile'd reader first, or close() is deferred and
        # the server's own shutdown(SHUT_WR) would send a clean FIN instead.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.connection.close()
