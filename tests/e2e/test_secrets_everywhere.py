"""Secrets by reference, end to end: no file, database row, Ray log or printed line holds a secret.

    pytest tests/e2e/test_secrets_everywhere.py

A real run of `tiny` on the CPU (its own Prefect API and SQLite database, a local Ray that trains)
and dry runs, with a token exported and referenced under another name (`env.MIRROR_AUTH=${HF_TOKEN}`),
a database URL with a password exported and referenced (`env.MY_DB_URL=${MY_DB_URL}`), and secrets
under names no word list knew (issue 44: `env.GH=${GITHUB_PAT}`, `env.CYR=${MY_AUTH}`, and
`env.ODD=${ODD_VALUE}`, whose names say nothing): the runs folder (the run's files, MLflow's store
and artifacts, W&B's offline run and its debug.log, TensorBoard's events), Prefect's home (database,
result storage), Ray's session and the command's output are searched for every value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Made-up values that no scanner takes for live credentials.
TOKEN = "test-secret-value-7f3a9c"
DB_PASSWORD = "made-up-pass-4b81e2"
DB_URL = f"postgres://user:{DB_PASSWORD}@db/x"
UNKNOWN = {"GITHUB_PAT": "made-up-pat-91c0d2", "MY_AUTH": "made-up-auth-3e77a1", "ODD_VALUE": "made-up-odd-55b20f"}
SECRETS = (TOKEN, DB_PASSWORD, *UNKNOWN.values())
BY_REFERENCE = ["--set", "env.MIRROR_AUTH=${HF_TOKEN}", "--set", "env.MY_DB_URL=${MY_DB_URL}", "--set", "env.GH=${GITHUB_PAT}",
                "--set", "env.CYR=${MY_AUTH}", "--set", "env.ODD=${ODD_VALUE}"]
TRACKERS = ["--set", "tracking.trackers=[mlflow,wandb,tensorboard]", "--set", "tracking.wandb.mode=offline"]


def start_cli(*args: str, tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
           "HF_TOKEN": TOKEN, "MY_DB_URL": DB_URL, **UNKNOWN, "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"),
         "--set", f"data.root={tmp_path / 'data'}", "--set", f"model.root={tmp_path / 'models'}", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def run_cli(*args: str, tmp_path: Path) -> tuple[int, str, str]:
    process = start_cli(*args, tmp_path=tmp_path)
    out, err = process.communicate(timeout=600)
    return process.returncode, out, err


def files_holding_a_secret(*folders: Path) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
            data = path.read_bytes()
            found += [f"{path}: {value}" for value in SECRETS if value.encode() in data]
    return found


def test_a_run_with_secrets_by_reference_leaves_them_in_no_file_database_ray_log_or_output(tmp_path):
    process = start_cli("--run-name", "secrets", "--stages", "train", "--set", "trainer.total_training_steps=2",
                        *BY_REFERENCE, *TRACKERS, tmp_path=tmp_path)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    run_dir, home = tmp_path / "runs" / "secrets", tmp_path / "prefect"
    # The local Ray this run started in its own process: Ray names its session after that process,
    # under RAY_TMPDIR (else /tmp) as Ray's own get_user_temp_dir does on Linux.
    sessions = list((Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray").glob(f"session_*_{process.pid}"))
    assert sessions, "the run started no local Ray session"
    assert not [line for line in (out + err).splitlines() if any(value in line for value in SECRETS)]
    assert files_holding_a_secret(tmp_path / "runs", home, *sessions) == []
    assert not list(ROOT.glob("mlruns")), "MLflow wrote artifacts into the working directory"

    # What was searched is what the run stored: the entries, shown redacted; Prefect's database with
    # the flow's parameters; Ray's log of the runtime_env the workers got.
    env_json = json.loads((run_dir / "env.json").read_text())
    for name in ("MIRROR_AUTH", "GH", "CYR", "ODD"):
        assert env_json[name] == {"value": "***", "source": "user"}
    assert list(run_dir.glob("wandb/offline-run-*/logs/debug.log")) and list(run_dir.glob("tensorboard/events.*"))
    assert (tmp_path / "runs" / "mlflow.db").is_file() and list((tmp_path / "runs").glob("mlflow-artifacts/*/*"))
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
