"""The verl command a Ray job submits composes against verl 0.9.1's own Hydra config, with the profile's values.

The argv composed is the submitted job's entrypoint itself (backends/verl/job.py `job_spec`, which the
dry run shows too), split as the job's shell splits it. Composition happens exactly as `main_ppo`
does it (config `ppo_trainer`, the rendered overrides, `model_engine=megatron` among them), through
the real verl YAML files, without importing verl.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from grpo_pipeline.backends.verl.command import ADD_OR_OVERRIDE, entrypoint, verl_settings
from grpo_pipeline.backends.verl.job import FILE_LOGGER_PATH_VAR, job_spec
from grpo_pipeline.stages.train import PLANNED_DIST_CHECKPOINT, training_inputs
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.profiles.loader import PROFILES_DIR
from grpo_pipeline.profiles.yaml_files import load_yaml_mapping
from grpo_pipeline.stages.environment import resolve_environment
from upstream_recipe import upstream_overrides
from verl_config import compose_verl, flatten, select

REPO = Path(__file__).resolve().parents[1]
RUN_DIR = Path("/shared/runs/parity")
ENGINE_KEYS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "param_offload",
    "dtype", "use_mbridge", "vanilla_mbridge", "use_remove_padding", "override_transformer_config",
)


def verl_cases() -> list[tuple[str, str]]:
    cases = []
    for path in sorted((PROFILES_DIR / "models").glob("*.yaml")):
        recipe = load_yaml_mapping(path, "model recipe")
        if recipe["common"].get("backend") == "verl":
            cases += [(path.stem, device) for device in recipe["devices"]]
    return cases


def render(model: str, device: str, overrides: list[str] | None = None):
    """The profile, its environment, the verl settings, and the argv the job submits, split at the
    overrides (what follows `trainer.entrypoint`)."""
    profile = resolve_profile(model, device, overrides=overrides)
    env = resolve_environment(profile, environ={})
    inputs = training_inputs(profile, RUN_DIR)
    spec = job_spec(profile, inputs, RUN_DIR, "parity", env.ray_runtime_env(), "abc123", 1)
    argv = shlex.split(spec.entrypoint)
    assert argv[:len(entrypoint(profile))] == ["python3", "-m", "verl.trainer.main_ppo"]
    return profile, env, verl_settings(profile, inputs), argv[len(entrypoint(profile)):], spec


def test_every_verl_recipe_is_covered():
    assert {("qwen3.5-122b-a10b", "gpu"), ("qwen3.5-122b-a10b", "npu"),
            ("qwen3.5-35b-a3b", "gpu"), ("qwen3.5-35b-a3b", "npu")} <= set(verl_cases())


@pytest.mark.parametrize("use_kl_loss", [False, True], ids=["kl-off", "kl-on"])
@pytest.mark.parametrize(("model", "device"), verl_cases())
def test_rendered_command_composes_with_profile_values(model, device, use_kl_loss):
    profile, env, settings, overrides, spec = render(model, device, [f"algorithm.use_kl_loss={str(use_kl_loss).lower()}"])
    keys = [arg.split("=", 1)[0].removeprefix(ADD_OR_OVERRIDE) for arg in overrides]
    assert len(keys) == len(set(keys)), "a key is rendered twice"
    assert not any(key.endswith("nccl_timeout") for key in keys), "dead setting rendered"

    composed = compose_verl(overrides)
    for key, value in settings.items():
        assert select(composed, key.removeprefix(ADD_OR_OVERRIDE)) == value, key

    # One declaration, every role: the reference runs with exactly the actor's engine settings.
    actor = select(composed, "actor_rollout_ref.actor.megatron")
    ref = select(composed, "actor_rollout_ref.ref.megatron")
    for key in ENGINE_KEYS:
        assert ref[key] == actor[key], key
    assert select(composed, "actor_rollout_ref.actor.use_kl_loss") is use_kl_loss
    assert select(composed, "actor_rollout_ref.model.use_remove_padding") is profile.engine.use_remove_padding

    # The run's env reaches every worker through the job's runtime_env, as strings (Ray rejects other
    # types), and only there: the same keys in main_ppo's ray.init would make Ray refuse to merge them.
    assert spec.runtime_env["env_vars"] == {**env.worker_env, FILE_LOGGER_PATH_VAR: spec.metrics_file}
    assert all(isinstance(v, str) for v in spec.runtime_env["env_vars"].values())
    assert "env_vars" not in select(composed, "ray_kwargs.ray_init.runtime_env")
    # Metrics are followed through verl's file logger, written to the run's folder (shared storage).
    assert select(composed, "trainer.logger")[-1] == "file" and "console" in select(composed, "trainer.logger")
    assert spec.metrics_file.startswith(str(RUN_DIR) + "/verl/")
    assert select(composed, "trainer.default_local_dir") == str(RUN_DIR / "checkpoints")


def test_kl_on_npu_builds_reference_with_npu_engine_values():
    overrides = render("qwen3.5-122b-a10b", "npu", ["algorithm.use_kl_loss=true"])[3]
    ref = select(compose_verl(overrides), "actor_rollout_ref.ref.megatron")
    assert ref["vanilla_mbridge"] is False
    assert ref["use_remove_padding"] is False
    assert (ref["tensor_model_parallel_size"], ref["pipeline_model_parallel_size"], ref["expert_model_parallel_size"]) == (2, 4, 16)
    assert ref["override_transformer_config"]["moe_token_dispatcher_type"] == "alltoall"
    assert ref["override_transformer_config"]["use_naive_l2norm"] is True


def test_npu_env_reaches_workers_and_gpu_visibility_is_left_to_ray():
    job_env = render("qwen3.5-122b-a10b", "npu")[4].runtime_env["env_vars"]
    assert job_env["HCCL_CONNECT_TIMEOUT"] == "5400"
    assert job_env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    # Ray assigns each worker its GPUs: the profile names none (a fixed 0..7 was wrong on smaller hosts).
    _, gpu_env, _, _, gpu_spec = render("qwen3.5-122b-a10b", "gpu")
    assert "CUDA_VISIBLE_DEVICES" not in gpu_env.values
    assert "CUDA_VISIBLE_DEVICES" not in gpu_spec.runtime_env["env_vars"]


def test_visible_devices_set_in_a_profile_stay_on_the_driver():
    _, env, _, _, spec = render("qwen3.5-122b-a10b", "gpu", ["env.CUDA_VISIBLE_DEVICES=0,1"])
    assert env.values["CUDA_VISIBLE_DEVICES"].value == "0,1"
    assert "CUDA_VISIBLE_DEVICES" not in spec.runtime_env["env_vars"]


def test_upstream_recipe_as_written_no_longer_composes():
    with pytest.raises(ConfigCompositionException, match="grad_offload"):
        compose_verl(upstream_overrides("gpu", with_grad_offload=True))


def documented_deviations(device: str) -> list[str]:
    """Keys of the first table of docs/upstream-deviations.md that apply to `device`."""
    text = (REPO / "docs" / "upstream-deviations.md").read_text()
    table = text.split("## Differences in the composed verl config", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for line in table.splitlines():
        match = re.match(r"\| `([^`]+)` \| ([^|]+) \|", line)
        if match and device in [d.strip() for d in match.group(2).split(",")]:
            patterns.append(match.group(1))
    return patterns


@pytest.mark.parametrize("device", ["gpu", "npu"])
def test_parity_with_upstream(device):
    ours = flatten(compose_verl(render("qwen3.5-122b-a10b", device)[3]))
    upstream = flatten(compose_verl(upstream_overrides(device, with_grad_offload=False)))
    differing = sorted(k for k in ours.keys() | upstream.keys() if ours.get(k, "<unset>") != upstream.get(k, "<unset>"))
    patterns = documented_deviations(device)
    assert "actor_rollout_ref.nccl_timeout" in patterns
    undocumented = [k for k in differing if not any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    assert undocumented == [], f"differences from upstream not in docs/upstream-deviations.md: {undocumented}"
    # Each documented deviation of this device really is one (the doc does not list stale rows),
    # except grad_offload, which is gone from the composed config on both sides.
    for pattern in patterns:
        if "grad_offload" not in pattern:
            assert any(fnmatch.fnmatchcase(k, pattern) for k in differing), pattern


def test_a_dist_checkpoint_is_what_actor_and_reference_load(tmp_path):
    overrides = render("tiny", "npu", ["backend=verl", "model.dist_checkpoint=true", f"model.root={tmp_path}"])[3]
    composed = compose_verl(overrides)
    paths = {select(composed, f"actor_rollout_ref.{role}.megatron.dist_checkpointing_path") for role in ("actor", "ref")}
    assert paths == {PLANNED_DIST_CHECKPOINT}  # the plan, made before the base model is in the store
    for role in ("actor", "ref"):
        assert select(composed, f"actor_rollout_ref.{role}.megatron.use_dist_checkpointing") is True
    plain = compose_verl(render("tiny", "npu", ["backend=verl"])[3])
    assert select(plain, "actor_rollout_ref.actor.megatron.use_dist_checkpointing") is False


def test_a_dist_checkpoint_of_a_gated_deltanet_model_is_refused_at_planning():
    with pytest.raises(ProfileError) as raised:
        resolve_profile("qwen3.5-122b-a10b", "npu", overrides=["model.dist_checkpoint=true"])
    assert ("model.dist_checkpoint=true: qwen3.5-122b-a10b has Gated DeltaNet (linear attention) layers, which the "
            "converter does not write yet; set model.dist_checkpoint=false") in str(raised.value)


def test_uneven_pipeline_stages_and_mtp_reach_both_roles_through_verls_config():
    """94-style uneven stages: 48 layers over 5 stages as 9 + 3 x 10 + 9, in override_transformer_config of
    the actor and the reference alike; MTP through actor_rollout_ref.model.mtp.enable."""
    uneven = ["cluster.nnodes=5", "engine.pp=5", "engine.num_layers_in_first_pipeline_stage=9",
              "engine.num_layers_in_last_pipeline_stage=9", "engine.mtp=true", "algorithm.use_kl_loss=true"]
    composed = compose_verl(render("qwen3.5-122b-a10b", "gpu", uneven)[3])
    for role in ("actor", "ref"):
        config = select(composed, f"actor_rollout_ref.{role}.megatron.override_transformer_config")
        assert (config["num_layers_in_first_pipeline_stage"], config["num_layers_in_last_pipeline_stage"]) == (9, 9)
        assert "account_for_embedding_in_pipeline_split" not in config
    assert select(composed, "actor_rollout_ref.model.mtp.enable") is True
    even = compose_verl(render("qwen3.5-122b-a10b", "gpu")[3])
    assert "num_layers_in_first_pipeline_stage" not in select(even, "actor_rollout_ref.actor.megatron.override_transformer_config")
    assert select(even, "actor_rollout_ref.model.mtp.enable") is False


FSDP_KEYS = ("param_offload", "optimizer_offload", "fsdp_size", "dtype", "ulysses_sequence_parallel_size")


@pytest.mark.parametrize("extra", [
    ["algorithm.use_kl_loss=false"],
    ["algorithm.use_kl_loss=true", "engine.param_offload=true", "engine.optimizer_offload=true"],
    ["algorithm.use_kl_loss=true", "engine.ulysses_sp=3", "engine.attn_implementation=flash_attention_2",
     "cluster.devices_per_node=3", "rollout.tp=3", "actor.use_dynamic_bsz=true", "log_prob.use_dynamic_bsz=true"],
], ids=["kl-off", "kl-on-offload", "ulysses-flash-dynamic"])
def test_fsdp_command_composes_with_profile_values(extra):
    """engine.strategy=fsdp: verl's `dp` model engine with FSDP2, every setting where verl reads it, the
    reference built with the actor's engine settings, and no Megatron key rendered."""
    profile, env, settings, overrides, spec = render("smollm2-135m", "gpu", ["backend=verl", *extra])
    assert profile.engine.strategy == "fsdp"  # the dense recipe's engine
    keys = [arg.split("=", 1)[0].removeprefix(ADD_OR_OVERRIDE) for arg in overrides]
    assert len(keys) == len(set(keys)), "a key is rendered twice"
    assert not any(".megatron." in key for key in keys)

    composed = compose_verl(overrides)
    for key, value in settings.items():
        assert select(composed, key.removeprefix(ADD_OR_OVERRIDE)) == value, key
    assert select(composed, "model_engine") == "dp"
    assert select(composed, "actor_rollout_ref.actor.strategy") == select(composed, "actor_rollout_ref.ref.strategy") == "fsdp2"
    actor = select(composed, "actor_rollout_ref.actor.fsdp_config")
    ref = select(composed, "actor_rollout_ref.ref.fsdp_config")
    for key in FSDP_KEYS:
        assert ref[key] == actor[key] == settings[f"actor_rollout_ref.actor.fsdp_config.{key}"], key
    assert actor["ulysses_sequence_parallel_size"] == profile.engine.ulysses_sp
    assert actor["param_offload"] is profile.engine.param_offload
    assert ref["forward_only"] is True and actor["forward_only"] is False
    # verl's default attention is flash_attention_2: the profile's choice is what the model is loaded with.
    assert select(composed, "actor_rollout_ref.model.override_config.attn_implementation") == profile.engine.attn_implementation
    assert select(composed, "actor_rollout_ref.model.enable_gradient_checkpointing") is profile.model.enable_gradient_checkpointing
    assert select(composed, "actor_rollout_ref.actor.use_dynamic_bsz") is profile.actor.use_dynamic_bsz
    assert select(composed, "actor_rollout_ref.actor.use_kl_loss") is profile.algorithm.use_kl_loss
    assert select(composed, "trainer.logger")[-1] == "file"
    # the export stage reads the policy's HF weights, which verl's FSDP checkpoint holds only when asked
    assert select(composed, "actor_rollout_ref.actor.checkpoint.save_contents") == [*profile.actor.checkpoint_save_contents, "hf_model"]


@pytest.mark.parametrize(("extra", "message"), [
    (["engine.tp=2"], "engine.tp=2 is a Megatron setting FSDP does not read"),
    (["engine.ulysses_sp=2"], "Ulysses splits the 9 attention heads"),
    (["engine.ulysses_sp=3", "cluster.devices_per_node=3", "rollout.tp=3", "engine.use_remove_padding=false"],
     "needs packed sequences"),
    (["engine.ulysses_sp=3", "cluster.devices_per_node=3", "rollout.tp=3"], "patches transformers' FlashAttention 2 path only"),
    (["engine.ulysses_sp=3", "cluster.devices_per_node=3", "rollout.tp=3", "engine.attn_implementation=flash_attention_2"],
     "32 sequences must divide over the world's 3 devices"),
    (["cluster.devices_per_node=4", "engine.fsdp_size=3"], "an FSDP group must divide the world size 4"),
    (["model.dist_checkpoint=true"], "a Megatron dist checkpoint is for engine.strategy=megatron"),
    (["engine.strategy=megatron", "engine.fsdp_size=2", "cluster.devices_per_node=2"], "engine.fsdp_size=2 is an FSDP setting"),
])
def test_fsdp_layouts_verl_refuses_are_refused_at_planning(extra, message):
    with pytest.raises(ProfileError, match=re.escape(message)):
        resolve_profile("smollm2-135m", "gpu", "verl", overrides=extra)


@pytest.mark.parametrize("targets", ["all-linear", "[q_proj,k_proj,v_proj,o_proj]"])
def test_lora_command_composes_with_verls_fsdp_lora_keys(targets):
    """A LoRA run on verl's FSDP engine: the adapter's keys where verl 0.9.1 reads them (its HFModelConfig), the
    rollout's load format its adapter sync needs, and no reference worker's settings needed (ref_in_actor)."""
    profile, env, settings, overrides, spec = render(
        "smollm2-135m", "gpu", ["backend=verl", "lora.rank=32", "lora.alpha=64", f"lora.target_modules={targets}",
                                "algorithm.use_kl_loss=true"])
    composed = compose_verl(overrides)
    for key, value in settings.items():
        assert select(composed, key.removeprefix(ADD_OR_OVERRIDE)) == value, key
    assert select(composed, "actor_rollout_ref.model.lora_rank") == 32
    assert select(composed, "actor_rollout_ref.model.lora_alpha") == 64
    assert select(composed, "actor_rollout_ref.model.target_modules") == profile.lora.target_modules
    assert select(composed, "actor_rollout_ref.rollout.load_format") == "safetensors"
    assert select(composed, "actor_rollout_ref.rollout.layered_summon") is True
    full = compose_verl(render("smollm2-135m", "gpu", ["backend=verl"])[3])
    assert select(full, "actor_rollout_ref.model.lora_rank") == 0  # verl's default: no adapter


@pytest.mark.parametrize(("extra", "message"), [
    (["lora.dropout=0.05"], "lora.dropout=0.05: verl 0.9.1's FSDP engine gives PEFT no dropout"),
    (["engine.strategy=megatron"], "lora.rank=16 with engine.strategy=megatron"),
    (["lora.target_modules=[qkv]"], "the model has no module named qkv"),
])
def test_lora_settings_verl_cannot_run_are_refused_at_planning(extra, message):
    with pytest.raises(ProfileError, match=re.escape(message)):
        resolve_profile("smollm2-135m", "gpu", "verl", overrides=["lora.rank=16", *extra])


def test_the_runs_reward_is_verls_own_custom_reward_keys_and_travels_with_the_job(tmp_path):
    """verl 0.9.1's `reward.custom_reward_function.{path,name}` (trainer/config/reward/reward.yaml), composed
    through its Hydra config; the job carries the project's package and the reward files (py_modules)."""
    from reward_files import TRL_STYLE, VERL_STYLE, write

    from grpo_pipeline.backends.verl.rewards import job_reward_package

    verl_file, trl_file = write(tmp_path, "v.py", VERL_STYLE), write(tmp_path, "t.py", TRL_STYLE)
    functions = f"reward.functions=[{{path: '{verl_file}:compute_score', weight: 0.5}}, '{trl_file}:digit_share']"
    profile, _, settings, overrides, spec = render("tiny", "gpu", ["backend=verl", functions])
    composed = compose_verl(overrides)
    assert select(composed, "reward.custom_reward_function") == {
        "path": "pkg://grpo_pipeline.rewards.verl_entry", "name": "compute_score"}
    carried = spec.runtime_env["py_modules"]
    assert carried[0].endswith("grpo_pipeline") and carried[1].endswith("verl/grpo_job_rewards")
    package = job_reward_package(profile, tmp_path / "verl")
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "plan.json", "reward_0_v.py", "reward_1_t.py"]
    assert (package / "reward_0_v.py").read_text() == VERL_STYLE  # the file, unchanged

    # gsm8k with no reward of the user's keeps verl's own scorer (the same as the built-in: test_rewards.py).
    _, _, plain, overrides, spec = render("tiny", "gpu", ["backend=verl", "data.dataset=gsm8k"])
    assert not any(key.startswith("reward.") for key in plain) and "py_modules" not in spec.runtime_env
    assert select(compose_verl(overrides), "reward.custom_reward_function.path") is None
