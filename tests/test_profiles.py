"""Profile layering, unknown keys, types, files and the environment's precedence."""

from __future__ import annotations

import json

import pytest

from grpo_pipeline.errors import ProfileError
from grpo_pipeline.stages.plan import resolve_profile

Q122 = "qwen3.5-122b-a10b"


def test_layers_apply_lowest_to_highest(tmp_path):
    profile_file = tmp_path / "mine.yaml"
    profile_file.write_text("rollout:\n  gpu_memory_utilization: 0.5\n  max_model_len: 9000\nenv:\n  HCCL_BUFFSIZE: '400'\n")
    profile = resolve_profile(Q122, "npu", profile_file=profile_file, overrides=["rollout.gpu_memory_utilization=0.55"])
    assert profile.platform.comm_backend == "hccl"  # device layer
    assert profile.data.train_batch_size == 128  # recipe common
    assert (profile.engine.pp, profile.engine.ep, profile.engine.vanilla_mbridge) == (4, 16, False)  # recipe npu block
    assert profile.engine.transformer_overrides["recompute_granularity"] == "full"  # common map, merged
    assert profile.engine.transformer_overrides["use_naive_l2norm"] is True  # device map, merged
    assert profile.rollout.max_model_len == 9000  # profile file
    assert profile.rollout.gpu_memory_utilization == 0.55  # --set beats the file
    assert profile.env["HCCL_BUFFSIZE"] == "400" and profile.env["HCCL_CONNECT_TIMEOUT"] == "5400"
    assert profile.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # recipe env on top of device env
    assert resolve_profile("tiny", "cpu", backend="local").backend == "local"


def test_per_device_blocks_hold_only_what_differs():
    gpu, npu = resolve_profile(Q122, "gpu"), resolve_profile(Q122, "npu")
    assert (gpu.engine.pp, gpu.rollout.tp, gpu.cluster.devices_per_node) == (2, 8, 8)
    assert (npu.engine.pp, npu.rollout.tp, npu.cluster.devices_per_node) == (4, 16, 16)
    assert gpu.engine.tp == npu.engine.tp == 2
    assert gpu.log_prob.micro_batch_size_per_gpu == 1 and npu.log_prob.micro_batch_size_per_gpu == 4
    assert npu.actor.checkpoint_strict is False and gpu.actor.checkpoint_strict is True


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["engine.tpp=2"], "unknown setting 'engine.tpp' in --set; did you mean 'engine.tp'?"),
        (["bogus=1"], "unknown setting 'bogus' in --set"),
        (["engine.tp=abc"], "engine.tp='abc': input should be a valid integer"),
        (["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization=1.5"),
        (["trainer.logger=console"], "trainer.logger='console': input should be a valid list"),
        (["engine.tp"], "--set 'engine.tp' is not KEY=VALUE"),
    ],
)
def test_bad_overrides_name_the_problem(overrides, fragment):
    with pytest.raises(ProfileError, match=None) as caught:
        resolve_profile("tiny", "cpu", overrides=overrides)
    assert fragment in str(caught.value)


def test_override_values_are_read_as_yaml():
    profile = resolve_profile("tiny", "cpu", overrides=["trainer.logger=[console, wandb]", "algorithm.use_kl_loss=true"])
    assert profile.trainer.logger == ["console", "wandb"] and profile.algorithm.use_kl_loss is True


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("engine: {tp: [1\n", "is not valid YAML (line"),
        ("- a\n- b\n", "must be a YAML mapping"),
        ("engine:\n  tpp: 2\n", "unknown setting 'engine.tpp' in profile file"),
    ],
)
def test_bad_profile_files(tmp_path, content, fragment):
    path = tmp_path / "p.yaml"
    path.write_text(content)
    with pytest.raises(ProfileError) as caught:
        resolve_profile("tiny", "cpu", profile_file=path)
    assert fragment in str(caught.value)


def test_missing_profile_file(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        resolve_profile("tiny", "cpu", profile_file=tmp_path / "nope.yaml")


def test_unknown_model_and_device():
    with pytest.raises(ProfileError, match="unknown model 'nope'.*qwen3.5-122b-a10b"):
        resolve_profile("nope", "cpu")
    with pytest.raises(ProfileError, match="unknown device 'tpu'"):
        resolve_profile("tiny", "tpu")
    with pytest.raises(ProfileError, match="no settings for device 'cpu'.*--device gpu"):
        resolve_profile(Q122, "cpu")


def test_local_hf_directory_gives_architecture(tmp_path):
    config = {"text_config": {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
                              "num_experts": 4, "hidden_size": 128, "vocab_size": 1000}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = resolve_profile(str(tmp_path), "cpu")
    arch = profile.model.architecture
    assert (arch.num_layers, arch.num_attention_heads, arch.num_kv_heads, arch.num_experts) == (6, 8, 2, 4)
    assert profile.model.path == str(tmp_path.resolve())
    with pytest.raises(ProfileError, match=r"engine.tp=4: the model's heads \(kv 2\) do not split 4 ways; use engine.tp in 1, 2"):
        resolve_profile(str(tmp_path), "gpu", backend="verl",
                        overrides=["engine.tp=4", "cluster.devices_per_node=4", "actor.ppo_micro_batch_size_per_gpu=1"])


def test_a_hub_id_takes_its_architecture_from_a_profile_file_or_says_where_its_config_would_come_from(tmp_path,
                                                                                                      monkeypatch):
    """Offline with no stored config.json: one line naming the file, the store and the ways on (the fetch
    itself: tests/test_fetch_hub.py)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ProfileError) as refused:
        resolve_profile("org/some-model", "cpu", overrides=[f"model.root={tmp_path / 'models'}"])
    assert str(refused.value) == (
        "--model org/some-model: its config.json (the model's architecture, which the plan is checked against) is not "
        f"in {tmp_path / 'models' / '.hub-configs'} and HF_HUB_OFFLINE is set: unset it to fetch it, or give a local "
        "copy (--model /path/to/model-dir) or model.architecture.* in a profile file")
    arch = tmp_path / "arch.yaml"
    arch.write_text("model:\n  architecture: {num_layers: 2, num_attention_heads: 2, num_kv_heads: 2, hidden_size: 8, vocab_size: 10}\n")
    assert resolve_profile("org/some-model", "cpu", profile_file=arch).model.path == "org/some-model"
    arch = tmp_path / "arch.yaml"
    arch.write_text("model:\n  architecture: {num_layers: 2, num_attention_heads: 2, num_kv_heads: 2, hidden_size: 8, vocab_size: 10}\n")
    assert resolve_profile("org/some-model", "cpu", profile_file=arch).model.path == "org/some-model"


def test_env_values_become_strings_and_malformed_ones_fail(tmp_path):
    profile = resolve_profile("tiny", "cpu", overrides=["env.HCCL_BUFFSIZE=300", "env.FLAG=true"])
    assert profile.env["HCCL_BUFFSIZE"] == "300" and profile.env["FLAG"] == "true"
    with pytest.raises(ProfileError, match="env name 'BAD-NAME' is not a valid variable name"):
        resolve_profile("tiny", "cpu", overrides=["env.BAD-NAME=1"])
    with pytest.raises(ProfileError, match="env LIST: its value is a list; it must be a single-line string"):
        resolve_profile("tiny", "cpu", overrides=["env.LIST=[1, 2]"])


def test_profile_reference_is_current():
    from pathlib import Path

    from grpo_pipeline.profiles.reference import render

    committed = (Path(__file__).resolve().parents[1] / "docs" / "profiles.md").read_text()
    assert committed == render(), "docs/profiles.md is stale: python -m grpo_pipeline.profiles.reference > docs/profiles.md"
