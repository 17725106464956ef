"""The fake Hub in hub_server.py, driven by the real huggingface_hub client.

The fault tests pin down how huggingface_hub 2.4.0 reacts to a flaky Hub, as observed against this server
(with the client's sleeps stubbed out so the file stays fast). huggingface_hub 1.x (the image of the
GPU hosts: 1.33) raises httpx's classes instead of httpx2's and does not retry the tree listing; the
table below says so where it differs:

    fault, once    repo info                        HEAD /resolve                 GET /resolve
    404            RepositoryNotFoundError          RemoteEntryNotFoundError      RemoteEntryNotFoundError
    429            LocalEntryNotFoundError          retried, succeeds             retried after Retry-After + 1 s
    500, 503       LocalEntryNotFoundError          retried, succeeds             HfHubHTTPError (no retry)
    drop (RST)     httpx2.ReadError                 httpx2.ReadError              httpx2.ReadError (no retry)
    truncate       httpx2.RemoteProtocolError       httpx2.RemoteProtocolError    retried from byte 0, succeeds

Repo info is never retried: its 429/5xx become LocalEntryNotFoundError (nothing cached), network errors propagate.
On HEAD, drop/truncate mean: connection reset / closed before any response. A truncated GET restarts from byte 0
because httpx buffers the body in 10 MB chunks, so nothing of a small file is written before the error; a body
truncated every time is retried 5 times, then RemoteProtocolError.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
import urllib.request
from collections import Counter

import huggingface_hub
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_server import HubServer

pytestmark = pytest.mark.e2e  # each test starts the fake Hub (a server on 127.0.0.1)

HUB_1X = huggingface_hub.__version__.startswith("1.")
# The HTTP client huggingface_hub raises the transport errors of.
transport = __import__("httpx" if HUB_1X else "httpx2")

DS_FILES = {"data/train-00000.parquet": b"PAR1" + bytes(range(256)) * 8, "data/test-00000.parquet": b"PAR1" + b"t" * 99}
MODEL_FILES = {"config.json": b'{"model_type": "gpt2", "n_layer": 2}', "model.safetensors": bytes(range(256)) * 64}
ENDPOINTS = [
    re.compile(r"^/api/(models|datasets)/[^/]+/[^/]+/revision/[^/]+$"),
    re.compile(r"^/api/(models|datasets)/[^/]+/[^/]+/tree/[0-9a-f]{40}\?recursive=true&expand=false$"),
    re.compile(r"^(/datasets)?/[^/]+/[^/]+/resolve/[0-9a-f]{40}/.+$"),
]


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    """An empty HF_HOME: huggingface_hub reads its paths into `constants` at import, so patch those too."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    paths = {"HF_HOME": "", "HF_HUB_CACHE": "hub", "HF_ASSETS_CACHE": "assets", "HF_TOKEN_PATH": "token",
             "HF_STORED_TOKENS_PATH": "stored_tokens", "AGENT_HARNESSES_PATH": ".agent_harnesses.json",
             "HF_XET_CACHE": "xet"}
    for name, value in paths.items():
        monkeypatch.setattr(constants, name, str(home / value))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return home


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture
def sleeps(monkeypatch):
    """Stub the client's retry sleeps (1 s per retry, Retry-After + 1 s on 429) and record them."""
    import huggingface_hub.file_download as file_download
    import huggingface_hub.utils._http as http

    slept: list[float] = []
    fake_time = types.SimpleNamespace(**{k: getattr(http.time, k) for k in dir(http.time) if not k.startswith("_")})
    fake_time.sleep = slept.append
    monkeypatch.setattr(file_download, "time", fake_time)
    monkeypatch.setattr(http, "time", fake_time)
    return slept


def read_tree(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".cache" not in p.relative_to(root).parts}


def test_dataset_and_model_download(hub, tmp_path, hf_home):
    hub.add_repo("org/ds", DS_FILES)
    sha = hub.add_repo("org/model", MODEL_FILES, repo_type="model")

    path = snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=tmp_path / "ds")
    assert read_tree(tmp_path / "ds") == DS_FILES and path == str((tmp_path / "ds").resolve())
    snapshot_download("org/model", endpoint=hub.url, local_dir=tmp_path / "model")
    assert read_tree(tmp_path / "model") == MODEL_FILES

    # The cache layout names blobs by ETag: sha256 for LFS files, git blob sha1 for the others.
    weights = hf_hub_download("org/model", "model.safetensors", endpoint=hub.url)
    config = hf_hub_download("org/model", "config.json", revision=sha, endpoint=hub.url)
    blobs = hf_home / "hub" / "models--org--model" / "blobs"
    assert sorted(p.name for p in blobs.iterdir()) == sorted([
        hashlib.sha256(MODEL_FILES["model.safetensors"]).hexdigest(),
        hashlib.sha1(b"blob %d\0" % len(MODEL_FILES["config.json"]) + MODEL_FILES["config.json"]).hexdigest(),
    ])
    assert open(weights, "rb").read() == MODEL_FILES["model.safetensors"]
    assert open(config, "rb").read() == MODEL_FILES["config.json"]
    assert f"/snapshots/{sha}/" in weights


def test_request_sequence_of_a_two_file_snapshot(hub, tmp_path):
    sha = hub.add_repo("org/ds", DS_FILES)
    snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=tmp_path / "ds")

    # Repo info resolves `main`, the tree is listed at the commit, then each file gets a HEAD and a GET (files in
    # parallel threads, so only the per-file order is fixed).
    assert len(hub.requests) == 6
    assert all(any(e.match(path) for e in ENDPOINTS) for _, path in hub.requests), hub.requests
    assert hub.requests[:2] == [
        ("GET", "/api/datasets/org/ds/revision/main"),
        ("GET", f"/api/datasets/org/ds/tree/{sha}?recursive=true&expand=false"),
    ]
    files = [f"/datasets/org/ds/resolve/{sha}/{name}" for name in DS_FILES]
    assert Counter(hub.requests[2:]) == Counter((m, f) for f in files for m in ("HEAD", "GET"))
    for f in files:
        assert hub.requests.index(("HEAD", f)) < hub.requests.index(("GET", f))

    # Pinned to the commit, the repo info call is skipped.
    hub.reset_requests()
    snapshot_download("org/ds", repo_type="dataset", revision=sha, endpoint=hub.url, local_dir=tmp_path / "pinned")
    assert Counter(m for m, _ in hub.requests) == Counter({"GET": 3, "HEAD": 2}) and "/tree/" in hub.requests[0][1]

    # Downloading `main` again: the commit is re-resolved, and nothing else is asked (listing and files are current).
    hub.reset_requests()
    snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=tmp_path / "ds")
    assert hub.requests == [("GET", "/api/datasets/org/ds/revision/main")]


def test_tree_pagination_and_revisions(hub, tmp_path):
    hub.tree_page_size = 1
    v1 = hub.add_repo("org/ds", {"a.txt": b"old"}, revision="v1")
    hub.add_repo("org/ds", DS_FILES)
    snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=tmp_path / "main")
    assert read_tree(tmp_path / "main") == DS_FILES
    assert sum("/tree/" in path for _, path in hub.requests) == 3  # two files and the `data` directory
    snapshot_download("org/ds", repo_type="dataset", revision="v1", endpoint=hub.url, local_dir=tmp_path / "v1")
    snapshot_download("org/ds", repo_type="dataset", revision=v1, endpoint=hub.url, local_dir=tmp_path / "sha")
    assert read_tree(tmp_path / "v1") == read_tree(tmp_path / "sha") == {"a.txt": b"old"}


def test_not_found_errors(hub, tmp_path):
    hub.add_repo("org/ds", DS_FILES)
    hub.fail("/api/datasets/org/ds/revision/", "404")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=tmp_path / "a")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/nope", repo_type="dataset", endpoint=hub.url, local_dir=tmp_path / "b")
    with pytest.raises(RepositoryNotFoundError):  # a dataset is not a model
        hf_hub_download("org/ds", "data/test-00000.parquet", endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/ds", repo_type="dataset", revision="v9", endpoint=hub.url, local_dir=tmp_path / "c")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("org/ds", "missing.parquet", repo_type="dataset", endpoint=hub.url)


def test_gated_repo(hub, tmp_path):
    hub.add_repo("org/gated", MODEL_FILES, repo_type="model", gated=True)
    # Like the Hub, info and tree stay public; /resolve answers 401 (anonymous) or 403 (token without access).
    with pytest.raises(GatedRepoError) as anonymous:
        snapshot_download("org/gated", endpoint=hub.url, local_dir=tmp_path / "a", token=False)
    with pytest.raises(GatedRepoError) as wrong_token:
        hf_hub_download("org/gated", "config.json", endpoint=hub.url, local_dir=tmp_path / "b", token="hf_wrong")
    assert (anonymous.value.response.status_code, wrong_token.value.response.status_code) == (401, 403)
    snapshot_download("org/gated", endpoint=hub.url, local_dir=tmp_path / "c", token=hub.token)
    assert read_tree(tmp_path / "c") == MODEL_FILES


ONE_FILE = {"weights.bin": bytes(range(256)) * 40}
# (fault, method, path fragment, times) -> (exception type or None for success, matching requests made)
FAULTS = {
    ("404", "GET", "/revision/", 1): (RepositoryNotFoundError, 1),
    ("429", "GET", "/revision/", 1): (LocalEntryNotFoundError, 1),  # repo info is never retried
    ("500", "GET", "/revision/", 1): (LocalEntryNotFoundError, 1),
    ("503", "GET", "/revision/", 1): (LocalEntryNotFoundError, 1),
    ("drop", "GET", "/revision/", 1): (transport.ReadError, 1),
    ("truncate", "GET", "/revision/", 1): (transport.RemoteProtocolError, 1),
    # 2.x retries the tree listing on 5xx, 429 and network errors; 1.x does not.
    ("503", "GET", "/tree/", 1): (HfHubHTTPError, 1) if HUB_1X else (None, 2),
    ("drop", "GET", "/tree/", 1): (transport.ReadError, 1) if HUB_1X else (None, 2),
    ("404", "HEAD", "weights.bin", 1): (RemoteEntryNotFoundError, 1),
    ("429", "HEAD", "weights.bin", 1): (None, 2),  # a failed HEAD is retried with backoff
    ("500", "HEAD", "weights.bin", 1): (None, 2),
    ("503", "HEAD", "weights.bin", 1): (None, 2),
    ("503", "HEAD", "weights.bin", 100): (LocalEntryNotFoundError, 7),
    ("drop", "HEAD", "weights.bin", 1): (transport.ReadError, 1),  # ... but not on a network error
    ("truncate", "HEAD", "weights.bin", 1): (transport.RemoteProtocolError, 1),
    ("404", "GET", "weights.bin", 1): (RemoteEntryNotFoundError, 1),
    ("429", "GET", "weights.bin", 1): (None, 2),  # the file GET is retried on 408/429 only
    ("429", "GET", "weights.bin", 100): (HfHubHTTPError, 6),
    ("500", "GET", "weights.bin", 1): (HfHubHTTPError, 1),
    ("503", "GET", "weights.bin", 1): (HfHubHTTPError, 1),
    ("drop", "GET", "weights.bin", 1): (transport.ReadError, 1),  # a reset mid-body is not resumed
    ("truncate", "GET", "weights.bin", 1): (None, 2),  # an early clean close is (RemoteProtocolError)
    ("truncate", "GET", "weights.bin", 100): (transport.RemoteProtocolError, 6),
}


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f[0]}-{f[1]}-{f[2].strip('/')}-x{f[3]}")
def test_fault(hub, tmp_path, sleeps, fault):
    kind, method, fragment, times = fault
    expected, count = FAULTS[fault]
    hub.add_repo("org/ds", ONE_FILE)
    hub.fail(fragment, kind, times=times, method=method)
    local_dir = tmp_path / "ds"
    if expected is None:
        snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=local_dir)
        assert read_tree(local_dir) == ONE_FILE
    else:
        with pytest.raises(expected) as raised:
            snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=local_dir)
        assert type(raised.value) is expected
        assert not (local_dir / "weights.bin").exists()
        if expected is LocalEntryNotFoundError:  # wraps the HTTP error that made the client give up
            assert raised.value.__cause__.response.status_code == int(kind)
        if expected is HfHubHTTPError:
            assert raised.value.response.status_code == int(kind)
    assert sum(m == method and fragment in p for m, p in hub.requests) == count
    if (kind, method, fragment) == ("429", "GET", "weights.bin"):
        assert sleeps[0] == 2.0  # Retry-After: 1, plus the client's own extra second


def test_names_escaping_local_dir_are_refused(hub, tmp_path):
    hub.add_repo("org/ds", DS_FILES)
    hub.add_raw_tree_entry("org/ds", "../evil.txt", b"pwned")
    local_dir = tmp_path / "inner" / "ds"
    with pytest.raises(ValueError, match=r"\.\."):
        snapshot_download("org/ds", repo_type="dataset", endpoint=hub.url, local_dir=local_dir)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("evil")]
    assert not any("evil" in path for _, path in hub.requests)  # refused before any request for it


def test_raw_http(hub):
    sha = hub.add_repo("org/model", MODEL_FILES, repo_type="model")
    url = f"{hub.url}/org/model/resolve/main/model.safetensors"
    data = MODEL_FILES["model.safetensors"]
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD")) as r:
        assert r.headers["X-Repo-Commit"] == sha and r.headers["Content-Length"] == str(len(data))
        assert r.headers["X-Linked-Etag"] == r.headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'
        assert r.headers["X-Linked-Size"] == str(len(data))
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=100-"})) as r:
        assert r.status == 206 and r.read() == data[100:]
        assert r.headers["Content-Range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=-10"})) as r:
        assert r.read() == data[-10:]
    with urllib.request.urlopen(f"{hub.url}/org/model/resolve/{sha}/config.json") as r:
        assert "X-Linked-Etag" not in r.headers and r.read() == MODEL_FILES["config.json"]
    with urllib.request.urlopen(f"{hub.url}/api/agent-harnesses") as r:
        assert json.load(r) == {"standardEnvVars": [], "harnesses": {}}
    urllib.request.urlopen(urllib.request.Request(f"{hub.url}/api/telemetry/x", data=b"{}", method="POST")).close()
    api = HfApi(endpoint=hub.url)
    info = api.model_info("org/model")
    assert info.sha == sha and sorted(s.rfilename for s in info.siblings) == sorted(MODEL_FILES)
    tree = {f.path: f for f in api.list_repo_tree("org/model", revision=sha, recursive=True)}
    assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256(data).hexdigest()
    assert tree["model.safetensors"].size == len(data) and tree["config.json"].lfs is None
