"""The backend interface as the flow, the planner and validation use it: found by name, each
refusing at planning what it cannot run, and saying where its trained policy is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_pipeline.backends import backend_for
from grpo_pipeline.profiles.backend_table import BACKEND_NAMES
from grpo_pipeline.backends.base import Backend
from grpo_pipeline.flows.grpo import main
from grpo_pipeline.stages.plan import check_plan
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.errors import ProfileError, UserError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.stages.device import detect_device


def test_every_backend_is_found_by_its_name_and_implements_the_interface():
    for name in BACKEND_NAMES:
        backend = backend_for(name)
        assert isinstance(backend, Backend) and backend.name == name and backend_for(name) is backend


@pytest.mark.parametrize(
    ("override", "fragment"),
    [("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward=true: the local backend (TRL) has no in-reward KL"),
     ("algorithm.loss_agg_mode=token-sum", "algorithm.loss_agg_mode=token-sum: the local backend supports token-mean"),
     # What TRL cannot compute as verl does (tests/test_verl_parity.py): refused, each naming its setting.
     ("algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_agg_mode=seq-mean-token-sum-norm: the local "
      "backend supports token-mean, seq-mean-token-mean (TRL has no aggregation that equals verl's for it)"),
     ("algorithm.use_kl_loss=true,algorithm.kl_loss_type=k1", "algorithm.kl_loss_type=k1: TRL's KL loss is k3 only"),
     ("algorithm.clip_ratio_high=2.5", "algorithm.clip_ratio_high=2.5: above 2 verl's dual clip (ratio 3) cuts below TRL's"),
     ("algorithm.entropy_coeff=0.01,actor.ppo_micro_batch_size_per_gpu=4",
      "algorithm.entropy_coeff=0.01: TRL's entropy bonus equals verl's only with algorithm.loss_agg_mode=token-mean "
      "and the whole update in one micro batch on one worker")],
)
def test_a_local_backend_refusal_happens_when_the_run_is_planned(capsys, override, fragment):
    """A dry run (and the UI form's first stage) refuses it, before anything is fetched."""
    sets = [word for setting in override.split(",") for word in ("--set", setting)]
    assert main(["--model", "tiny", "--device", "cpu", *sets, "--dry-run"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and fragment in lines[0]


def test_verl_training_without_a_cluster_is_refused_at_planning_and_staging_is_not(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    profile, npu = resolve_profile("qwen3.5-122b-a10b", "npu"), detect_device("npu", dry_run=True)
    with pytest.raises(UserError, match=r"backend verl trains as a Ray job on a running cluster, and evaluates there: .* pass --ray-address"):
        check_plan(RunRequest(model="qwen3.5-122b-a10b"), profile, npu, dry_run=False)
    with pytest.raises(UserError, match=r"--ray-address=http://head:8265: backend verl checks the cluster's nodes "
                                        r"through Ray itself; give the head's GCS address"):
        check_plan(RunRequest(model="qwen3.5-122b-a10b", ray_address="http://head:8265"), profile, npu, dry_run=False)
    with pytest.raises(UserError, match="and evaluates there"):  # its policy is scored on the cluster too
        check_plan(RunRequest(model="qwen3.5-122b-a10b", stages=["evaluate"]), profile, npu, dry_run=False)
    staging = RunRequest(model="qwen3.5-122b-a10b", stages=["fetch_dataset", "prepare_checkpoint"])
    check_plan(staging, profile, npu, dry_run=False)
    check_plan(RunRequest(model="qwen3.5-122b-a10b"), profile, npu, dry_run=True)


@pytest.mark.parametrize(
    ("model", "device", "flag", "overrides", "chosen", "reason"),
    [("qwen3.5-122b-a10b", "npu", "auto", [], "verl",
      "model recipe qwen3.5-122b-a10b trains with the verl backend (Megatron + vLLM through verl, as a Ray job on a "
      "GPU or NPU cluster), and device npu has accelerators"),
     ("qwen3.5-35b-a3b", "gpu", "auto", [], "verl",
      "model recipe qwen3.5-35b-a3b trains with the verl backend (Megatron + vLLM through verl, as a Ray job on a "
      "GPU or NPU cluster), and device gpu has accelerators"),
     ("tiny", "gpu", "auto", [], "local", "model recipe tiny trains with the local backend"),
     ("tiny", "npu", "auto", ["backend=verl"], "verl", "backend: verl in --set"),
     ("tiny", "npu", "verl", [], "verl", "--backend verl")],
)
def test_backend_auto_picks_verl_for_megatron_recipes_on_accelerators(model, device, flag, overrides, chosen, reason):
    from grpo_pipeline.profiles.loader import resolve_run_profile

    profile, why = resolve_run_profile(model, device, flag, overrides=overrides)
    assert (profile.backend, why) == (chosen, reason)


def test_backend_auto_gives_a_megatron_recipe_the_local_backend_on_cpus():
    from grpo_pipeline.profiles.loader import choose_backend

    recipe = [("device profile cpu", {}), ("model recipe big (common)", {"backend": "verl"}), ("model recipe big (devices.cpu)", {})]
    assert choose_backend(recipe, "auto", "cpu") == (
        "local", "model recipe big trains with verl, which needs GPUs or NPUs: on device cpu the local backend trains it")
    assert choose_backend(recipe, "auto", "gpu")[0] == "verl"


def test_only_verl_renders_a_command_of_its_own():
    from grpo_pipeline.stages.train import training_inputs

    for model, device in (("qwen3.5-122b-a10b", "npu"), ("tiny", "cpu")):
        profile = resolve_profile(model, device)
        inputs = training_inputs(profile, Path("/runs/r"))
        command = backend_for(profile.backend).command(profile, inputs)
        assert (command is not None) == (profile.backend == "verl")


def test_a_one_gpu_host_plans_one_worker_and_refuses_eight_named_ones(tmp_path):
    """--device gpu with a local HF directory on a 1-GPU host: the run plans one worker (the GPUs
    found, not the gpu platform's 8); 8 named by the user are refused when the run is planned (the
    CLI before anything starts, a deployment in resolve_profile), naming the setting to change."""
    from grpo_pipeline.stages.plan import profile_for

    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "hidden_size": 64, "vocab_size": 512}))
    one_gpu = detect_device("gpu", probe={"gpu": {"status": "available", "count": 1, "names": ["NVIDIA H200"],
                                                  "memory_gib": [139.8], "detail": "CUDA sees 1 GPU(s)"}})
    request = RunRequest(model=str(model), device="gpu")
    planned, _, _ = profile_for(request, one_gpu)
    assert planned.cluster.devices_per_node == 1
    check_plan(request, planned, one_gpu, dry_run=False)
    eight = RunRequest(model=str(model), device="gpu", overrides=["cluster.devices_per_node=8"])
    profile, _, _ = profile_for(eight, one_gpu)
    with pytest.raises(ProfileError, match=r"cluster.devices_per_node=8: 8 training workers but this host has 1 GPUs; "
                                           r"use --set cluster.devices_per_node=1 or fewer"):
        check_plan(eight, profile, one_gpu, dry_run=False)


def test_where_a_run_evaluates_is_the_backends_answer():
    """The evaluation stage asks the backend: a verl run generates on its cluster with the rollout's
    tensor parallel size, a local run on this host's devices with the generation engine it trains with."""
    from grpo_pipeline.generation.engines import engine_label, transformers_generate
    from grpo_pipeline.generation.plan import plan_generation
    from grpo_pipeline.stages.evaluate import EvalSettings

    verl = resolve_profile("qwen3.5-122b-a10b", "gpu")
    settings, engine = backend_for("verl").evaluation(verl, EvalSettings.from_profile(verl, plan_generation(verl)), 0,
                                                      "head:6379", {})
    assert settings.tensor_parallel_size == verl.rollout.tp
    assert settings.plan == plan_generation(verl)  # the nodes follow the run's plan (generation/sharding.py)
    assert engine_label(engine, settings) == f"the cluster's engine ({32 // verl.rollout.tp} Ray tasks on the cluster)"
    local = resolve_profile("tiny", "cpu")
    planned = EvalSettings.from_profile(local, plan_generation(local))
    settings, engine = backend_for("local").evaluation(local, planned, 2, None, {})
    assert settings == planned and engine is transformers_generate  # the plan's engine, here
    assert engine_label(engine, settings) == "transformers generate (dynamic cache, eager decoding, sdpa attention)"


def test_only_a_backend_that_plans_memory_says_why_it_has_no_plan():
    from grpo_pipeline.generation.plan import plan_generation

    def note(backend: str, profile) -> str | None:
        return backend_for(backend).memory_note(profile, plan_generation(profile))

    verl = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides=["model.architecture.moe_intermediate_size=null"])
    assert note("verl", verl).startswith("not estimated, the model's size needs")
    assert note("verl", resolve_profile("qwen3.5-122b-a10b", "gpu")) is None
    assert note("local", resolve_profile("tiny", "cpu")) is None
