"""The command line as a user runs it: a real subprocess, exit codes, stdout/stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SECRET = "hf_sEcReT_vAlUe_123"


def cli(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "flows.grpo", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=300)


def test_dry_run_json_plans_for_a_named_device_without_requiring_it(tmp_path):
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run", "--json", "--run-dir", str(tmp_path),
               "--run-name", "plan", env={"HF_TOKEN": SECRET})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert set(plan) == {"device", "profile", "command", "env"}
    assert plan["device"]["kind"] == "npu" and plan["device"]["decided_by"] == "requested"
    assert plan["command"][:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    assert "model_engine=megatron" in plan["command"]
    assert f"trainer.default_local_dir={tmp_path / 'plan' / 'checkpoints'}" in plan["command"]
    assert plan["env"]["HCCL_CONNECT_TIMEOUT"] == {"value": "5400", "source": "profile"}
    assert plan["profile"]["engine"]["pp"] == 4
    assert SECRET not in done.stdout + done.stderr
    assert not (tmp_path / "plan").exists(), "a dry run writes nothing"


def test_dry_run_yaml_shows_profile_and_command():
    done = cli("--model", "qwen3.5-35b-a3b", "--device", "gpu", "--dry-run", "--set", "algorithm.use_kl_loss=false")
    assert done.returncode == 0, done.stderr
    assert "# resolved profile" in done.stdout and "python3 -m verl.trainer.main_ppo \\\n    model_engine=megatron \\\n" in done.stdout
    assert "actor_rollout_ref.actor.use_kl_loss=false" in done.stdout


def test_local_backend_dry_run_on_cpu():
    done = cli("--model", "tiny", "--device", "auto", "--dry-run", "--json", "--set", "trainer.total_training_steps=3")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["device"]["kind"] == "cpu" and plan["device"]["decided_by"] == "detected"
    assert "no accelerator found" in plan["device"]["reason"]
    assert plan["command"][:3] == ["python", "-m", "flows.grpo"] and "trainer.total_training_steps=3" in plan["command"]


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["--model", "nope"], {}, "unknown model 'nope'"),
        (["--device", "tpu"], {}, "--device='tpu'"),
        ([], {"DEVICE": "tpu"}, "unsupported device DEVICE='tpu'"),
        (["--set", "engine.tpp=2"], {}, "unknown setting 'engine.tpp' in --set; did you mean 'engine.tp'?"),
        (["--set", "engine.tp=abc"], {}, "engine.tp='abc'"),
        (["--model", "qwen3.5-122b-a10b", "--device", "gpu", "--set", "engine.tp=3"], {}, "does not divide the world size 32"),
        (["--profile-file", "{profile}"], {}, "is not valid YAML"),
        (["--stages", "detect_device,warp"], {}, "unknown stage(s) warp"),
        (["--bogus-flag"], {}, "unrecognized arguments: --bogus-flag"),
        (["--set", "proxy_policy=sometimes"], {}, "proxy_policy='sometimes': input should be 'clear', 'bypass-cluster' or 'keep'"),
        (["--set", "env.BAD-NAME=1"], {}, "env name 'BAD-NAME' is not a valid variable name"),
        # A secret typed into the request would be stored by Prefect: refused, and not echoed.
        (["--set", "env.HF_TOKEN=hf_typed_in"], {}, "--set: env.HF_TOKEN: a secret's value in the run request"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, env, fragment):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {tp: [1\n")
    args = [a.replace("{profile}", str(bad)) for a in args]
    done = cli("--model", "tiny", *args, "--dry-run", env=env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert fragment in lines[0] and "hf_typed_in" not in done.stderr


def test_real_run_on_a_missing_gpu_fails_clearly_before_the_flow(tmp_path):
    done = cli("--model", "tiny", "--device", "gpu", "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith("error: --device gpu requested but not usable here")
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


def test_help_explains_every_option():
    done = cli("--help")
    assert done.returncode == 0
    for option in ("--model", "--device", "--backend", "--set", "--profile-file", "--stages", "--run-dir",
                   "--ray-address", "--dry-run", "--json"):
        assert option in done.stdout


@pytest.mark.parametrize("policy", ["bypass-cluster", "clear"])
def test_dry_run_json_applies_proxy_policy_to_all_case_forms_and_hides_token(policy):
    proxies = {"http_proxy": "http://proxy:3128", "HTTPS_PROXY": "http://proxy:3128", "ALL_PROXY": "socks5://proxy:1080"}
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run", "--json", "--set",
               f"proxy_policy={policy}", env={**proxies, "HF_TOKEN": SECRET})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    env = plan["env"]
    if policy == "clear":
        for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            assert env[name] == {"value": None, "source": "proxy-policy"}
            assert f'++ray_kwargs.ray_init.runtime_env.env_vars.{name}=""' in plan["command"]
    else:
        for name in ("no_proxy", "NO_PROXY"):
            assert env[name]["value"].split(",")[:2] == ["localhost", "127.0.0.1"]
        assert not any(part.split("=")[0].endswith(("_proxy", "_PROXY")) and "NO_PROXY" not in part.upper()
                       for part in plan["command"])
    assert SECRET not in done.stdout + done.stderr
