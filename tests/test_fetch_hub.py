"""The dataset and model stages against a real HTTP server on 127.0.0.1 that speaks the Hub's API,
with faults injected: every case ends in verified files or one clear error, never a partial entry."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from datasets_fixtures import geo3k_repo_files, gsm8k_repo_files
from hub_server import HubServer
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.schema import DataSection, ModelArchitecture, ModelSection
from grpo_pipeline.stages.dataset import DataSpec, dataset_dir, fetch_dataset
from grpo_pipeline.store.hub import SourceError, TransientFetchError
from grpo_pipeline.stages.model import ModelSpec, model_dir, prepare_model
from grpo_pipeline.store.content import verify_entry

pytestmark = pytest.mark.e2e  # each test starts the fake Hub (a server on 127.0.0.1)

ARCH = ModelArchitecture(num_layers=2, num_attention_heads=4, num_kv_heads=2, hidden_size=64, vocab_size=512)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield server


def data_spec(tmp_path, **fields) -> DataSpec:
    return DataSpec.from_profile(DataSection(root=str(tmp_path / "data"), **fields))


def with_retries(stage, attempts: int = 6):
    """What the Prefect task's retries do (tests/e2e runs the real thing): again after a transient
    fault, never after a UserError."""
    faults = []
    for _ in range(attempts):
        try:
            return stage(), faults
        except UserError:
            raise
        except Exception as exc:
            faults.append(exc)
    raise AssertionError(f"still failing after {attempts} attempts: {faults}")


def test_gsm8k_from_the_hub_then_from_the_cache_with_zero_requests(hub, tmp_path):
    commit = hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    spec = data_spec(tmp_path, dataset="gsm8k")
    files = fetch_dataset(spec)
    assert files.commit == commit and files.revision == "main" and not files.cached
    assert files.rows == {"train": 12, "test": 4}  # main/ only: the socratic config is not mixed in
    row = pq.read_table(files.train_files[0]).to_pylist()[0]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["ground_truth"] == "0"
    assert not any("socratic" in path or "README" in path for _, path in hub.requests if "/resolve/" in path)
    assert Path(files.path) == dataset_dir(spec)

    hub.reset_requests()
    again = fetch_dataset(data_spec(tmp_path, dataset="gsm8k"))
    assert again.cached and again.path == files.path and again.sha256 == files.sha256
    assert hub.requests == []


def test_geo3k_from_the_hub_keeps_images_and_validates_on_test(hub, tmp_path):
    hub.add_repo("hiyouga/geometry3k", geo3k_repo_files())
    files = fetch_dataset(data_spec(tmp_path, dataset="geo3k"))
    assert files.rows == {"train": 6, "test": 3}
    row = pq.read_table(files.val_files[0]).to_pylist()[2]
    assert row["images"][0]["bytes"].startswith(b"\x89PNG") and row["prompt"][0]["content"].startswith("<image>")


@pytest.mark.parametrize(
    "kind, fragment, method, times",
    [
        ("503", "/revision/", "GET", 3),  # repo info
        ("503", "train-00000", "GET", 2),  # a file's body
        ("500", "/tree/", "GET", 1),
        ("drop", "train-00000", "GET", 1),  # connection reset mid-file
        ("truncate", "test-00000", "GET", 8),  # a short body, more often than the client retries
        ("429", "/revision/", "GET", 1),  # rate limited, Retry-After: 1
    ],
)
def test_transient_faults_are_retried_to_verified_files(hub, tmp_path, kind, fragment, method, times):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    hub.fail(fragment, kind, times=times, method=method)
    spec = data_spec(tmp_path, dataset="gsm8k")
    files, faults = with_retries(lambda: fetch_dataset(spec))
    # Some faults the client absorbs by itself (it retries a 5xx on the listing); the rest reach
    # the stage as TransientFetchError, which the task retries.
    assert all(isinstance(f, TransientFetchError) for f in faults), faults
    assert any(fragment in path for _, path in hub.requests)
    assert verify_entry(Path(files.path), deep=True) == []
    assert files.rows == {"train": 12, "test": 4}


def test_missing_repo_fails_at_once_with_a_clear_error(hub, tmp_path):
    spec = data_spec(tmp_path, dataset="gsm8k", source="nobody/nothing")
    with pytest.raises(SourceError, match="nobody/nothing@main .* not found: check the repo id"):
        fetch_dataset(spec)
    assert not dataset_dir(spec).exists()


def test_a_file_that_vanished_from_the_hub_is_a_clear_error(hub, tmp_path):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    hub.fail("train-00000", "404", times=10)
    with pytest.raises(SourceError, match="missing on the hub"):
        fetch_dataset(data_spec(tmp_path, dataset="gsm8k"))


def test_gated_repo_needs_hf_token_which_is_never_written(hub, tmp_path, monkeypatch):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files(), gated=True)
    with pytest.raises(SourceError, match="gated repo: accept its terms on the hub, then set HF_TOKEN"):
        fetch_dataset(data_spec(tmp_path, dataset="gsm8k"))
    monkeypatch.setenv("HF_TOKEN", hub.token)
    files = fetch_dataset(data_spec(tmp_path, dataset="gsm8k"))
    assert files.rows["train"] == 12
    for path in (tmp_path / "data").rglob("*"):
        if path.is_file():
            assert hub.token.encode() not in path.read_bytes(), path


def test_file_names_escaping_the_target_are_refused_before_any_download(hub, tmp_path):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    hub.add_raw_tree_entry("openai/gsm8k", "../evil.parquet", b"pwned")
    spec = data_spec(tmp_path, dataset="gsm8k")
    with pytest.raises(SourceError, match="refused file name '../evil.parquet'"):
        fetch_dataset(spec)
    assert not [p for p in tmp_path.rglob("evil*")]
    assert not any("/resolve/" in path for _, path in hub.requests)
    assert not dataset_dir(spec).exists()


def test_a_damaged_cached_file_is_fetched_again(hub, tmp_path):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    files = fetch_dataset(data_spec(tmp_path, dataset="gsm8k"))
    train = Path(files.train_files[0])
    data = bytearray(train.read_bytes())
    data[len(data) // 2] ^= 0xFF
    train.write_bytes(bytes(data))
    hub.reset_requests()
    again = fetch_dataset(data_spec(tmp_path, dataset="gsm8k"), log=lambda m: None)
    assert not again.cached and again.sha256 == files.sha256 and hub.requests


def test_offline_mode_serves_the_cache_and_refuses_the_rest(hub, tmp_path, monkeypatch):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    fetch_dataset(data_spec(tmp_path, dataset="gsm8k"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.reset_requests()
    assert fetch_dataset(data_spec(tmp_path, dataset="gsm8k")).cached
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE is set and it is not cached"):
        fetch_dataset(data_spec(tmp_path, dataset="gsm8k", revision="v2"))
    assert hub.requests == []


@pytest.fixture
def tiny_model_files(tiny_model_dir) -> dict[str, bytes]:
    """The tiny model's files as a hub repo holds them (no store manifest), and two not to fetch."""
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.name != "manifest.json"}
    return files | {"weights.gguf": b"not wanted", "README.md": b"# tiny"}


def model_spec(tmp_path, path: str, **fields) -> ModelSpec:
    return ModelSpec.from_profile(ModelSection(path=path, root=str(tmp_path / "models"), architecture=ARCH, **fields))


def test_a_model_from_the_hub_fetches_only_what_training_needs(hub, tmp_path, tiny_model_files):
    commit = hub.add_repo("org/tiny", tiny_model_files, repo_type="model")
    hub.fail("model.safetensors", "drop", times=1, method="GET")
    spec = model_spec(tmp_path, "org/tiny")
    checkpoint, faults = with_retries(lambda: prepare_model(spec))
    assert len(faults) == 1 and checkpoint.commit == commit and checkpoint.model_type == "qwen3"
    assert Path(checkpoint.path) == model_dir(spec)
    wanted = [n for n in tiny_model_files if n not in ("weights.gguf", "README.md")]
    assert sorted(p.name for p in Path(checkpoint.path).iterdir()) == sorted([*wanted, "manifest.json"])
    hub.reset_requests()
    assert prepare_model(model_spec(tmp_path, "org/tiny")).cached and hub.requests == []


def test_a_hub_model_by_name_is_planned_from_its_own_config_json_kept_in_the_store(hub, tmp_path, tiny_model_files,
                                                                                    monkeypatch):
    """`--model org/name` with no architecture given: the repo's config.json is fetched into the model store
    (only it), and a later plan reads the kept copy with no request, offline too."""
    from grpo_pipeline.errors import ProfileError
    from grpo_pipeline.stages.plan import resolve_profile

    hub.add_repo("org/tiny", tiny_model_files, repo_type="model")
    root = [f"model.root={tmp_path / 'models'}"]
    profile = resolve_profile("org/tiny", "cpu", overrides=root)
    config = json.loads(tiny_model_files["config.json"])
    arch = profile.model.architecture
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size, arch.model_type) == (
        config["num_hidden_layers"], config["hidden_size"], config["vocab_size"], "qwen3")
    assert {path for method, path in hub.requests if "/resolve/" in path} == {"/org/tiny/resolve/main/config.json"}
    hub.reset_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_profile("org/tiny", "cpu", overrides=root).model.architecture == arch and hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")

    with pytest.raises(ProfileError, match=r"^--model org/missing: its config.json \(the model's architecture.*\) not "
                                           r"found: check the repo id.*; give a local copy"):
        resolve_profile("org/missing", "cpu", overrides=root)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ProfileError) as refused:
        resolve_profile("org/other", "cpu", overrides=root)
    assert str(refused.value).startswith("--model org/other: its config.json (the model's architecture, which the plan "
                                         "is checked against) cannot be fetched: 127.0.0.1:9 refuses connections; use a "
                                         "network that reaches http://127.0.0.1:9, a mirror in HF_ENDPOINT, or give a "
                                         "local copy")


def test_a_model_whose_weights_do_not_fit_its_config_is_refused(hub, tmp_path, tiny_model_files):
    config = json.loads(tiny_model_files["config.json"])
    config["hidden_size"] = 128
    hub.add_repo("org/bad", {**tiny_model_files, "config.json": json.dumps(config).encode()}, repo_type="model")
    spec = model_spec(tmp_path, "org/bad")
    with pytest.raises(UserError, match="tensor shapes do not match config.json"):
        prepare_model(spec)
    assert not model_dir(spec).exists()


def test_the_token_file_under_hf_home_is_used_when_hf_token_is_unset(hub, tmp_path, monkeypatch):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files(), gated=True)
    (tmp_path / "hf-home").mkdir(exist_ok=True)
    (tmp_path / "hf-home" / "token").write_text(hub.token + "\n")  # what `hf auth login` leaves
    assert fetch_dataset(data_spec(tmp_path, dataset="gsm8k")).rows["train"] == 12


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"source": "not a/valid repo id!"}, "not a/valid repo id!@main .*Repo id must"),
        ({"revision": "v9"}, "revision not found; check the revision"),
    ],
)
def test_bad_repo_ids_and_revisions_fail_at_once(hub, tmp_path, fields, message):
    hub.add_repo("openai/gsm8k", gsm8k_repo_files())
    with pytest.raises(SourceError, match=message):
        fetch_dataset(data_spec(tmp_path, dataset="gsm8k", **fields))
    assert len(hub.requests) <= 1
