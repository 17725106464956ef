"""Secrets by reference, end to end: no file, database row, Ray log or printed line holds a secret.

    pytest tests/e2e/test_secrets_everywhere.py

A real run of `tiny` on the CPU (its own Prefect API and SQLite database, a local Ray that trains)
and dry runs, with a token exported and referenced under another name (`env.MIRROR_AUTH=${HF_TOKEN}`),
a database URL with a password exported and referenced (`env.MY_DB_URL=${MY_DB_URL}`), and secrets
under names no word list knew (issue 44: `env.GH=${GITHUB_PAT}`, `env.CYR=${MY_AUTH}`, and
`env.ODD=${ODD_VALUE}`, whose names say nothing), and MLflow's credentials in its tracking URI as MLflow
documents them (`MLFLOW_TRACKING_URI=http://user:pass@host`, a real `mlflow server` on 127.0.0.1): the
runs folder (the run's files, W&B's offline run and its debug.log, TensorBoard's events), the MLflow
server's store and artifacts, Prefect's home (database, result storage), Ray's session and the
command's output are searched for every value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpo_pipeline.tracking.trackers import job_env, read_state
from grpo_pipeline.profiles.tracking import TrackingSection
from mlflow_server import mlflow_server

ROOT = Path(__file__).resolve().parents[2]
# Made-up values that no scanner takes for live credentials.
TOKEN = "test-secret-value-7f3a9c"
DB_PASSWORD = "made-up-pass-4b81e2"
DB_URL = f"postgres://user:{DB_PASSWORD}@db/x"
UNKNOWN = {"GITHUB_PAT": "made-up-pat-91c0d2", "MY_AUTH": "made-up-auth-3e77a1", "ODD_VALUE": "made-up-odd-55b20f"}
MLFLOW_PASSWORD = "made-up-mlflow-pw-8c1f"
SECRETS = (TOKEN, DB_PASSWORD, *UNKNOWN.values(), MLFLOW_PASSWORD)
BY_REFERENCE = ["--set", "env.MIRROR_AUTH=${HF_TOKEN}", "--set", "env.MY_DB_URL=${MY_DB_URL}", "--set", "env.GH=${GITHUB_PAT}",
                "--set", "env.CYR=${MY_AUTH}", "--set", "env.ODD=${ODD_VALUE}"]
TRACKERS = ["--set", "tracking.trackers=[mlflow,wandb,tensorboard]", "--set", "tracking.wandb.mode=offline"]


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """A real MLflow server: its folder (store and artifacts) and its URL with credentials in it."""
    root = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(root) as url:
        yield root, url.replace("http://", f"http://grpo:{MLFLOW_PASSWORD}@")


def start_cli(*args: str, tmp_path: Path, **extra: str) -> subprocess.Popen:
    env = {**extra, **os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
           "HF_TOKEN": TOKEN, "MY_DB_URL": DB_URL, **UNKNOWN, "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def run_cli(*args: str, tmp_path: Path, **extra: str) -> tuple[int, str, str]:
    process = start_cli(*args, tmp_path=tmp_path, **extra)
    out, err = process.communicate(timeout=600)
    return process.returncode, out, err


def files_holding_a_secret(*folders: Path) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
            data = path.read_bytes()
            found += [f"{path}: {value}" for value in SECRETS if value.encode() in data]
    return found


def test_a_run_with_secrets_by_reference_leaves_them_in_no_file_database_ray_log_or_output(tmp_path, mlflow_store):
    server, uri = mlflow_store
    process = start_cli("--run-name", "secrets", "--stages", "train", "--set", "trainer.total_training_steps=2",
                        *BY_REFERENCE, *TRACKERS, tmp_path=tmp_path, MLFLOW_TRACKING_URI=uri)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    run_dir, home = tmp_path / "runs" / "secrets", tmp_path / "prefect"
    # The local Ray this run started in its own process: Ray names its session after that process,
    # under RAY_TMPDIR (else /tmp) as Ray's own get_user_temp_dir does on Linux.
    sessions = list((Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray").glob(f"session_*_{process.pid}"))
    assert sessions, "the run started no local Ray session"
    assert not [line for line in (out + err).splitlines() if any(value in line for value in SECRETS)]
    assert files_holding_a_secret(tmp_path / "runs", home, server, *sessions) == []
    assert "View run" not in out + err  # MLflow's own line, with the URI it was given

    # What was searched is what the run stored: the entries, shown redacted; Prefect's database with
    # the flow's parameters; Ray's log of the runtime_env the workers got.
    env_json = json.loads((run_dir / "env.json").read_text())
    for name in ("MIRROR_AUTH", "GH", "CYR", "ODD"):
        assert env_json[name] == {"value": "***", "source": "user"}
    assert list(run_dir.glob("wandb/offline-run-*/logs/debug.log")) and list(run_dir.glob("tensorboard/events.*"))
    state = read_state(run_dir)  # what was searched: the tracker run, its link, its copy of the report
    public = uri.replace(f"grpo:{MLFLOW_PASSWORD}@", "")
    assert state.runs["mlflow"]["tracking_uri"] == public and state.links["mlflow"].startswith(f"{public}/#/experiments/")
    assert f"]({public}/#/experiments/" in (run_dir / "report.md").read_text()
    client = MlflowClient(uri)  # the server took the credentials (MLflow sends them as basic auth)
    assert "report.md" in {a.path for a in client.list_artifacts(state.runs["mlflow"]["run_id"])}
    # A verl job continuing the run gets the URI without them: a node's MLflow reads its own variables.
    assert job_env(TrackingSection(trackers=["mlflow"]), run_dir)["MLFLOW_TRACKING_URI"] == public
    assert "| `MY_DB_URL` | `***` | user |" in (run_dir / "report.md").read_text()
    assert b"env.MIRROR_AUTH=${HF_TOKEN}" in (home / "prefect.db").read_bytes() + b"".join(
        p.read_bytes() for p in home.glob("prefect.db-*"))
    assert list(home.glob("storage/*")), "no persisted task result was searched"
    runtime_env_logs = [p for session in sessions for p in session.rglob("runtime_env*.log")]
    assert any(b"TOKENIZERS_PARALLELISM" in p.read_bytes() for p in runtime_env_logs)


def test_a_dry_run_shows_secrets_by_reference_as_stars_and_refuses_credentials_in_a_url_without_echoing_them(tmp_path):
    for as_json in ([], ["--json"]):
        code, out, err = run_cli("--dry-run", *as_json, *BY_REFERENCE, tmp_path=tmp_path)
        assert code == 0, err[-2000:]
        assert not any(value in out + err for value in SECRETS)
        if as_json:
            env = json.loads(out)["env"]
            assert {env[name]["value"] for name in ("MIRROR_AUTH", "MY_DB_URL", "GH", "CYR", "ODD")} == {"***"}
        else:
            for name in ("MIRROR_AUTH", "MY_DB_URL", "GH", "CYR", "ODD"):
                assert f"#   {name}=***  [user]" in out
            assert "--set 'env.MIRROR_AUTH=${HF_TOKEN}'" in out  # the command repeats the reference

        code, out, err = run_cli("--dry-run", *as_json, "--set", f"env.MY_DB_URL={DB_URL}", tmp_path=tmp_path)
        assert code == 2 and out == ""
        assert err.startswith("error: --set: env.MY_DB_URL holds credentials in a URL") and err.count("\n") == 1, err
        assert "env.MY_DB_URL=${MY_DB_URL}" in err and DB_PASSWORD not in err


def test_a_secret_value_as_the_run_name_or_in_the_run_folder_is_refused_before_the_dry_run_prints(tmp_path):
    for option, value in (("--run-name", UNKNOWN["GITHUB_PAT"]), ("--run-dir", f"/tmp/{TOKEN}/runs")):
        code, out, err = run_cli("--dry-run", option, value, tmp_path=tmp_path)
        assert code == 2 and out == "", (out, err)
        variable = "GITHUB_PAT" if option == "--run-name" else "HF_TOKEN"
        assert err == f"error: {option} holds the value of {variable}, and it is stored and shown as written (the run's " \
                      "files, trackers, Prefect); choose another\n"
