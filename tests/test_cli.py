"""The command line as a user runs it: exit codes, stdout and stderr, in this process (`main`),
with the device probe answering as on a host without GPU or NPU; and once as `python -m grpo_pipeline`.
Nothing here starts a flow: every case stops at planning or is a dry run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_pipeline.errors import HEADLINE_CHARS

SECRET = "hf_sEcReT_vAlUe_123"


@pytest.mark.e2e  # runs the command line as a subprocess
def test_the_module_entry_point_exits_2_with_one_line_and_no_traceback():
    done = subprocess.run([sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--set", "engine.tpp=2", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: unknown setting 'engine.tpp' in --set; did you mean 'engine.tp'?\n"


@pytest.mark.e2e  # runs the command line as a subprocess
def test_a_python_without_the_dependencies_gets_one_line_naming_the_venv():
    """`python -S`: no site-packages, as a system Python without the project's dependencies."""
    done = subprocess.run([sys.executable, "-S", "-m", "grpo_pipeline", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: this Python ({sys.executable}) lacks grpo_pipeline's dependencies (no module ")
    assert done.stderr.rstrip().endswith("run .venv/bin/python -m grpo_pipeline (make setup builds it)")


def test_dry_run_json_plans_for_a_named_device_without_requiring_it(cli, tmp_path):
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run", "--json", "--run-dir", str(tmp_path),
               "--run-name", "plan", env={"HF_TOKEN": SECRET})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert set(plan) == {"device", "profile", "backend", "generation", "command", "env", "job", "memory",
                         "node_requirements"}
    assert plan["device"]["kind"] == "npu" and plan["device"]["decided_by"] == "requested"
    assert plan["backend"] == {"name": "verl", "reason": "model recipe qwen3.5-122b-a10b trains with the verl backend "
                               "(Megatron + vLLM through verl, as a Ray job on a GPU or NPU cluster), and device npu has "
                               "accelerators"}
    assert plan["command"][:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    # What the train stage submits: this very command, the run's environment as the job's runtime_env.
    job = plan["job"]
    assert shlex.split(job["entrypoint"]) == plan["command"]
    assert job["submission_id"] == "grpo-plan-<token>-1"
    assert job["runtime_env"]["env_vars"]["HCCL_CONNECT_TIMEOUT"] == "5400"
    assert job["runtime_env"]["env_vars"]["VERL_FILE_LOGGER_PATH"].startswith(str(tmp_path / "plan" / "verl") + "/")
    assert job["metadata"]["run_name"] == "plan" and len(job["metadata"]["profile_hash"]) == 16
    assert "model_engine=megatron" in plan["command"]
    assert f"trainer.default_local_dir={tmp_path / 'plan' / 'checkpoints'}" in plan["command"]
    assert plan["env"]["HCCL_CONNECT_TIMEOUT"] == {"value": "5400", "source": "profile"}
    assert plan["profile"]["engine"]["pp"] == 4
    assert SECRET not in done.stdout + done.stderr
    assert not (tmp_path / "plan").exists(), "a dry run writes nothing"


def test_fsdp_dry_run_of_a_dense_model_shows_command_memory_plan_and_node_requirements(cli, tmp_path):
    """`--set engine.strategy=fsdp` on a dense model: verl's dp engine with FSDP2 in the command (which
    composes against verl 0.9.1's own config), the FSDP memory plan, and nodes that need neither
    megatron-core nor a bridge."""
    from verl_config import compose_verl, select

    args = ("--model", "smollm2-135m", "--device", "gpu", "--backend", "verl", "--set", "engine.strategy=fsdp",
            "--set", "cluster.devices_per_node=2", "--dry-run", "--run-dir", str(tmp_path), "--run-name", "fsdp")
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    command = plan["command"]
    assert "model_engine=dp" in command and "actor_rollout_ref.actor.strategy=fsdp2" in command
    assert not any(".megatron." in arg for arg in command)
    composed = compose_verl(command[3:])
    assert select(composed, "actor_rollout_ref.actor.fsdp_config.fsdp_size") == -1
    assert select(composed, "actor_rollout_ref.model.override_config.attn_implementation") == "sdpa"
    roles = plan["memory"]["roles"]
    assert plan["memory"]["fits"] and roles[0]["when"].startswith("update, FSDP2 over 2 ranks")
    assert {"weights", "gradients", "optimizer", "activations", "logits"} <= set(roles[0]["parts_gib"])
    assert {r["role"] for r in roles} == {"actor", "rollout", "host"}
    train = plan["node_requirements"]["train"]
    assert {"verl", "TransferQueue", "vllm"} <= set(train) and not {"megatron-core", "mbridge", "megatron-bridge",
                                                                       "flash-attn"} & set(train)
    text = cli(*args)
    assert text.returncode == 0, text.stderr
    assert "# memory plan (planner/)" in text.stdout and "| actor | update, FSDP2 over 2 ranks" in text.stdout
    assert "TransferQueue>=0.1.10 (imports transfer_queue)" in text.stdout
    assert "python3 -m verl.trainer.main_ppo \\\n    model_engine=dp \\\n" in text.stdout
    assert not (tmp_path / "fsdp").exists(), "a dry run writes nothing"


def test_dry_run_yaml_shows_profile_and_command(cli):
    done = cli("--model", "qwen3.5-35b-a3b", "--device", "gpu", "--dry-run", "--set", "algorithm.use_kl_loss=false")
    assert done.returncode == 0, done.stderr
    assert "# resolved profile" in done.stdout and "python3 -m verl.trainer.main_ppo \\\n    model_engine=megatron \\\n" in done.stdout
    assert "actor_rollout_ref.actor.use_kl_loss=false" in done.stdout


def test_local_backend_dry_run_on_cpu(cli):
    done = cli("--model", "tiny", "--device", "auto", "--dry-run", "--json", "--set", "trainer.total_training_steps=3")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["device"]["kind"] == "cpu" and plan["device"]["decided_by"] == "detected"
    assert "no accelerator found" in plan["device"]["reason"]
    assert plan["command"][:3] == ["python", "-m", "grpo_pipeline"] and "trainer.total_training_steps=3" in plan["command"]
    # how rollouts and evaluation generate, decided once while planning (generation/plan.py)
    assert plan["generation"] | {"path": None} == {
        "engine": "transformers", "decoder": "generate", "cache": "dynamic", "compile": False,
        "attn_implementation": "sdpa", "torch_device": "cpu", "steps_per_generation": 1, "path": None}
    assert plan["generation"]["path"].startswith("transformers generate (dynamic cache, eager decoding")


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["--model", "nope"], {}, "unknown model 'nope'"),
        (["--device", "tpu"], {}, "--device='tpu'"),
        ([], {"DEVICE": "tpu"}, "unsupported device DEVICE='tpu'"),
        (["--set", "engine.tpp=2"], {}, "unknown setting 'engine.tpp' in --set; did you mean 'engine.tp'?"),
        (["--set", "engine.tp=abc"], {}, "engine.tp='abc'"),
        # A setting of the other training engine: named with the engine it belongs to (profiles/engine.py).
        (["--set", "engine.strategy=fsdp", "--set", "engine.tp=2"], {},
         "engine.strategy=fsdp: engine.tp=2 is a Megatron setting FSDP does not read"),
        (["--set", "engine.ulysses_sp=2"], {}, "engine.strategy=megatron: engine.ulysses_sp=2 is an FSDP setting; set engine.strategy=fsdp"),
        (["--set", "engine.strategy=deepspeed"], {}, "engine.strategy='deepspeed': input should be 'megatron' or 'fsdp'"),
        (["--model", "qwen3.5-122b-a10b", "--device", "gpu", "--set", "engine.tp=3"], {}, "does not divide the world size 32"),
        (["--profile-file", "{profile}"], {}, "is not valid YAML"),
        (["--stages", "detect_device,warp"], {}, "unknown stage(s) warp"),
        (["--bogus-flag"], {}, "unrecognized arguments: --bogus-flag"),
        (["--set", "proxy_policy=sometimes"], {}, "proxy_policy='sometimes': input should be 'clear', 'bypass-cluster' or 'keep'"),
        (["--set", "env.BAD-NAME=1"], {}, "env name 'BAD-NAME' is not a valid variable name"),
        # A secret typed into the request would be stored by Prefect: refused, and not echoed.
        (["--set", "env.HF_TOKEN=hf_typed_in"], {}, "--set: env.HF_TOKEN holds a literal value; a secret is read from the environment"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, tmp_path, args, env, fragment):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {tp: [1\n")
    args = [a.replace("{profile}", str(bad)) for a in args]
    done = cli("--model", "tiny", *args, "--dry-run", env=env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    headline, *details = done.stderr.strip().splitlines()
    # One line: the problem and its fix; the details, if any, indented below it.
    assert headline.startswith("error: ") and len(headline) <= len("error: ") + HEADLINE_CHARS, done.stderr
    assert all(line.startswith("  ") for line in details), done.stderr
    assert fragment in done.stderr and "hf_typed_in" not in done.stderr


def test_real_run_on_a_missing_gpu_fails_clearly_before_the_flow(cli, tmp_path):
    done = cli("--model", "tiny", "--device", "gpu", "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith("error: --device gpu is not usable here")
    if "a build without CUDA" in done.stderr:  # the Makefile's CPU torch: the fix is the GPU set-up
        assert done.stderr.rstrip().endswith("make setup-gpu (docs/install.md)"), done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


def test_help_explains_every_option(cli):
    done = cli("--help")
    assert done.returncode == 0
    for option in ("--model", "--device", "--backend", "--set", "--profile-file", "--stages", "--run-dir",
                   "--ray-address", "--dry-run", "--json"):
        assert option in done.stdout


@pytest.mark.parametrize("policy", ["bypass-cluster", "clear"])
def test_dry_run_json_applies_proxy_policy_to_all_case_forms_and_hides_token(cli, policy):
    proxies = {"http_proxy": "http://proxy:3128", "HTTPS_PROXY": "http://proxy:3128", "ALL_PROXY": "socks5://proxy:1080"}
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run", "--json", "--set",
               f"proxy_policy={policy}", env={**proxies, "HF_TOKEN": SECRET})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    env = plan["env"]
    if policy == "clear":
        for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            assert env[name] == {"value": None, "source": "proxy-policy"}
            assert plan["job"]["runtime_env"]["env_vars"][name] == ""
    else:
        for name in ("no_proxy", "NO_PROXY"):
            assert env[name]["value"].split(",")[:2] == ["localhost", "127.0.0.1"]
        assert not any(part.split("=")[0].endswith(("_proxy", "_PROXY")) and "NO_PROXY" not in part.upper()
                       for part in plan["command"])
    assert SECRET not in done.stdout + done.stderr


# --- Hostile input (issue 12): each is refused by a dry run with one line, exit 2, no traceback,
# and no secret value in the output. `{tmp}` is the test's directory.
SECRET_LIKE = "hf_s3cr3t_never_shown"


def _files(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes(b"engine:\n  tp: \xff\xfe\n")
    (tmp_path / "multiline-token.yaml").write_text(f"env:\n  HF_TOKEN: |\n    {SECRET_LIKE}\n    second line\n")
    (tmp_path / "token.yaml").write_text(f"env:\n  HF_TOKEN: {SECRET_LIKE}\n")
    levels = ["a: &a [" + ", ".join(["lol"] * 9) + "]"]
    for name, below in zip("bcdefghi", "abcdefgh"):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{below}"] * 9) + "]")
    (tmp_path / "bomb.yaml").write_text("engine:\n  transformer_overrides:\n" + "".join(f"    {line}\n" for line in levels))
    (tmp_path / "self.yaml").write_text("engine:\n  transformer_overrides: &me\n    again: *me\n")
    for name, config in (("list-config", b"[1, 2]"), ("string-text-config", b'{"text_config": "qwen"}'),
                         ("binary-config", bytes(range(256))),
                         ("deep-config", b"[" * 200_000 + b"]" * 200_000),
                         ("long-type-config", json.dumps({"model_type": "x" * 5_000_000, "num_hidden_layers": 2,
                                                          "num_attention_heads": 4, "hidden_size": 64,
                                                          "vocab_size": 512}).encode())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(config)
    for name in ("fifo-config", "endless-config"):
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "fifo-config" / "config.json")  # nobody writes: a reader that opens it waits forever
    (tmp_path / "endless-config" / "config.json").symlink_to("/dev/zero")  # read whole: memory runs out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--profile-file", "{tmp}/latin1.yaml"], "is not UTF-8 text (byte 0xff at offset 14); save it as UTF-8"),
        (["--profile-file", "{tmp}/bomb.yaml"], "expands to more than 20,000 values through YAML anchors and aliases"),
        (["--profile-file", "{tmp}/self.yaml"], "(or an alias refers to itself)"),
        (["--model", "{tmp}/list-config"], "config.json holds a JSON list, not the object of a Hugging Face config"),
        (["--model", "{tmp}/string-text-config"], "config.json's text_config is a str, not an object"),
        (["--model", "{tmp}/binary-config"], "config.json is not JSON text"),
        (["--model", "{tmp}/fifo-config"], "cannot read config.json (it is a FIFO, not a regular file)"),
        (["--model", "{tmp}/endless-config"], "cannot read config.json (it is a character device, not a regular file)"),
        (["--model", "{tmp}/deep-config"], "config.json is not JSON text"),
        (["--model", "{tmp}/long-type-config"], "xxx' (5,000,002 characters): string should have at most 64 characters"),
        (["--model", "{tmp}/" + "m" * 300], "File name too long; give a shorter or accessible path"),
        (["--stages", ""], "--stages='' names no stage"),
        (["--stages", " , "], "names no stage"),
        (["--set", "engine.tp=true"], "engine.tp=True: expects a number, not true/false"),
        (["--set", "algorithm.lr=false"], "algorithm.lr=False: expects a number, not true/false"),
        (["--set", "model.path=builtin:nope"], "model.path='builtin:nope': no such built-in model"),
        (["--set", "data.dataset=gsm8k", "--set", "data.source=/nonexistent/dir"], "data.source='/nonexistent/dir' is not a directory"),
        (["--ray-address", "notahost:99999"], "port '99999' is not a number from 1 to 65535"),
        (["--ray-address", "head-node"], "has no port"),
        (["--run-name", "r" * 300], "is 300 bytes, more than the file system's limit of 255"),
    ],
    ids=["non-utf8-profile", "yaml-alias-bomb", "yaml-alias-to-itself", "config-json-list", "config-json-string-text-config",
         "config-json-binary", "config-json-a-fifo", "config-json-a-link-to-dev-zero", "config-json-nested-200000-deep",
         "config-json-model-type-of-5-mb",
         "model-path-too-long", "empty-stages", "blank-stages", "bool-for-int", "bool-for-float",
         "unknown-builtin-model", "missing-data-source", "ray-port-out-of-range", "ray-address-without-port",
         "run-name-too-long"],
)
def test_a_dry_run_refuses_hostile_input_with_one_line(cli, tmp_path, args, fragment):
    _files(tmp_path)
    # A later --model replaces the first (argparse keeps the last value).
    done = cli("--model", "tiny", "--device", "cpu", *[a.replace("{tmp}", str(tmp_path)) for a in args], "--dry-run",
               "--run-dir", str(tmp_path / "runs"))
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert fragment in lines[0] and len(lines[0]) < 2000
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--set", f"env={{WANDB_API_KEY: {SECRET_LIKE}, API_KEY: {SECRET_LIKE}}}"], "env.WANDB_API_KEY holds a literal value"),
        (["--set", f"env.MY_PASSWORD=${{MY_PASSWORD:-{SECRET_LIKE}}}"], "env.MY_PASSWORD holds a default value in its reference"),
        (["--profile-file", "{tmp}/token.yaml"], "token.yaml: env.HF_TOKEN holds a literal value"),
        (["--profile-file", "{tmp}/multiline-token.yaml"], "env.HF_TOKEN holds a literal value"),
        (["--set", f"env.HF_TOKEN=[{SECRET_LIKE}]"], "env.HF_TOKEN holds a literal value"),
        (["--set", f"env.HF_TOKEN:{SECRET_LIKE}"], "--set 'env.HF_TOKEN...' (the rest not shown: it may be a secret) is not KEY=VALUE"),
        (["--set", f"env.LIST_VALUE=[{SECRET_LIKE}]"], "env LIST_VALUE: its value is a list"),
        (["--ray-address", f"ray://user:{SECRET_LIKE}@head:10001"], "a Ray address carries no credentials"),
        (["--ray-address", f"ray://user:{SECRET_LIKE}@bad host"], "a Ray address carries no credentials"),
        # Issue 56: a key no profile has is told as a typo, its value still unshown.
        (["--set", f"nonsense.key={SECRET_LIKE}"], "nonsense.key is no setting of the profile (docs/profiles.md lists them)"),
        (["--set", f"trainer.key={SECRET_LIKE}"], "trainer.key is no setting of the profile"),
        (["--set", f"rollout.vllm_kwargs.hf_token={SECRET_LIKE}"], "rollout.vllm_kwargs.hf_token names a secret"),
    ],
    ids=["env-mapping", "reference-with-literal-default", "profile-file-literal", "profile-file-multiline",
         "list-value-for-secret", "no-equals-sign", "list-value-not-echoed", "ray-address-credentials",
         "ray-address-credentials-bad-host", "unknown-secret-named-key", "unknown-key-in-a-section",
         "free-form-credential"],
)
def test_a_secret_literal_is_refused_and_never_echoed(cli, tmp_path, args, fragment):
    _files(tmp_path)
    done = cli("--model", "tiny", "--device", "cpu", *[a.replace("{tmp}", str(tmp_path)) for a in args], "--dry-run", "--json")
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], done.stderr
    assert SECRET_LIKE not in done.stdout + done.stderr


def test_an_exported_secret_is_named_by_reference_and_never_shown(cli, tmp_path):
    done = cli("--model", "tiny", "--device", "cpu", "--set", "env.HF_TOKEN=${HF_TOKEN}", "--set",
               "env.WANDB_API_KEY=${MY_WANDB_KEY}", "--dry-run", "--json",
               env={"HF_TOKEN": SECRET_LIKE, "MY_WANDB_KEY": SECRET_LIKE + "2"})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["env"]["HF_TOKEN"] == {"value": "***", "source": "user"}
    assert plan["env"]["WANDB_API_KEY"] == {"value": "***", "source": "user"}
    assert plan["profile"]["env"]["HF_TOKEN"] == "${HF_TOKEN}"  # the profile holds the reference only
    assert SECRET_LIKE not in done.stdout + done.stderr


def test_a_run_refuses_a_reference_to_a_secret_that_is_not_exported(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    done = cli("--model", "tiny", "--device", "cpu", "--set", "env.HF_TOKEN=${HF_TOKEN}", "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith("error: env: HF_TOKEN (${HF_TOKEN}) refer(s) to a variable that is not set"), done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("run_dir", "run_name", "fragment"),
    [
        ("/proc/grpo-runs", "r1", "--run-dir: cannot write the run's folder /proc/grpo-runs/r1"),
        ("/etc/hostname/runs", "r1", "(Not a directory); choose a writable --run-dir"),
        ("{tmp}/runs", "r" * 300, "is 300 bytes, more than the file system's limit of 255"),
    ],
    ids=["proc", "under-a-file", "name-too-long"],
)
def test_a_run_whose_folder_cannot_be_written_starts_nothing(cli, tmp_path, run_dir, run_name, fragment):
    done = cli("--model", "tiny", "--device", "cpu", "--run-dir", run_dir.replace("{tmp}", str(tmp_path)),
               "--run-name", run_name, env={"PREFECT_HOME": str(tmp_path / "prefect")})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], done.stderr[-2000:]
    assert not (tmp_path / "prefect").exists()  # no Prefect API, no lease: nothing started


def test_an_unreachable_ray_address_fails_in_seconds_before_anything_starts(cli, tmp_path):
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    for address, fragment in (("notahost.invalid:6379", "cannot reach the Ray cluster at notahost.invalid:6379"),
                              (f"127.0.0.1:{port}", f"cannot reach the Ray cluster at 127.0.0.1:{port} (Connection refused)")):
        done = cli("--model", "tiny", "--device", "cpu", "--ray-address", address, "--run-dir", str(tmp_path / "runs"),
                   env={"PREFECT_HOME": str(tmp_path / "prefect")})
        assert done.returncode == 2 and done.stderr.startswith(f"error: --ray-address: {fragment}"), done.stderr[-2000:]
        assert not (tmp_path / "prefect").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("entry", "folder", "fragment"), [
    ("checkpoints", False, "checkpoints is a file, not the folder where the run keeps its checkpoints; move it away"),
    ("eval", False, "eval is a file, not the folder where the run keeps its eval; move it away"),
    ("metrics.jsonl", True, "metrics.jsonl is a folder, where the run writes its metrics.jsonl; move it away"),
], ids=["file-at-checkpoints", "file-at-eval", "folder-at-metrics"])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_run_folder_entry_of_the_wrong_kind_is_refused_at_planning(cli, tmp_path, entry, folder, fragment, dry_run):
    """Each was retried as if transient and ended in up to 9 tracebacks: what is in the way is known
    before anything starts."""
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / entry).mkdir() if folder else (run_dir / entry).write_text("")
    done = cli("--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path / "runs"), "--run-name", "r1",
               *(["--dry-run"] if dry_run else []), env={"PREFECT_HOME": str(tmp_path / "prefect")})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"error: --run-dir/--run-name: {run_dir}/{fragment}, or choose another " \
        "--run-name", done.stderr[-2000:]
    assert sorted(p.name for p in run_dir.iterdir()) == [entry] and not (tmp_path / "prefect").exists()
