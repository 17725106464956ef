"""Gradient checkpointing on the local backend only where the training step needs it
(backends/local/train_memory.py, `LocalBackend.detected_layer`): decided for the GPUs a host was found to
have, below what a recipe, a profile file or --set says; a CPU keeps the profile's value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.local.train_memory import GIB, checkpointing_choice, step_memory
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.stages.device import detect_device
from grpo_pipeline.stages.plan import check_plan, profile_for, resolve_profile
from grpo_pipeline.run.request import RunRequest

# config.json of Qwen3-0.6B and Qwen3-8B as the hub has them (the fields the planner reads).
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
SHAPES = {
    "qwen3-0.6b": {"num_hidden_layers": 28, "num_attention_heads": 16, "hidden_size": 1024, "intermediate_size": 3072,
                   "tie_word_embeddings": True},
    "qwen3-8b": {"num_hidden_layers": 36, "num_attention_heads": 32, "hidden_size": 4096, "intermediate_size": 12288,
                 "tie_word_embeddings": False},
}
# Few enough rollouts for their KV cache to fit (backends/local/rollout_memory.py), two sequences a micro batch.
LONG_CONTEXT = ["data.max_response_length=16384", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                "actor.ppo_micro_batch_size_per_gpu=2", "generation.steps_per_generation=1"]


def write_configs(root: Path) -> dict[str, Path]:
    """A model directory per shape, holding its config.json (all the planner reads)."""
    for name, shape in SHAPES.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({**QWEN3, **shape}))
    return {name: root / name for name in SHAPES}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_configs(tmp_path_factory.mktemp("configs"))


def host_with(gpus: int, name: str = "NVIDIA H100 80GB HBM3", gib: float = 79.6):
    """The device probe's answer on a host with `gpus` of one kind of GPU."""
    return detect_device("gpu", probe={
        "npu": {"status": "absent", "detail": "torch_npu is not installed"},
        "gpu": {"status": "available", "count": gpus, "names": [name] * gpus, "memory_gib": [gib] * gpus,
                "cuda_version": "13.0", "detail": f"CUDA sees {gpus} GPU(s)"}})


def planned(model: Path | str, device, *overrides: str):
    request = RunRequest(model=str(model), device=device.kind, overrides=list(overrides))
    profile, _, _ = profile_for(request, device)
    check_plan(request, profile, device, dry_run=True)
    return profile


def step(model: Path, checkpointing: bool, *overrides: str) -> float:
    profile = resolve_profile(str(model), "gpu", overrides=["cluster.devices_per_node=1", *overrides])
    return step_memory(profile, plan_generation(profile), checkpointing, 80 * GIB).total


def test_the_step_grows_with_the_micro_batch_and_the_length(models):
    small = models["qwen3-0.6b"]
    one, four = (step(small, False, f"actor.ppo_micro_batch_size_per_gpu={n}") for n in (1, 4))
    short, long = (step(small, False, f"data.max_response_length={n}") for n in (256, 4096))
    assert four > one and long > short
    # Recomputation keeps each layer's input instead of its whole set: the difference grows with the tokens.
    saved = [step(small, False, *o) - step(small, True, *o) for o in (["data.max_response_length=256"],
                                                                      ["data.max_response_length=4096"])]
    assert 0 < saved[0] < saved[1]


def test_a_small_model_on_a_big_gpu_trains_without_recomputation(models):
    for name, gib in (("NVIDIA H100 80GB HBM3", 79.6), ("NVIDIA H200", 139.8)):
        profile = planned(models["qwen3-0.6b"], host_with(1, name, gib))
        assert profile.model.enable_gradient_checkpointing is False
    # ... and TRL is told so.
    from grpo_pipeline.backends.local.mapping import grpo_fields

    fields, _ = grpo_fields(profile, 1, plan_generation(profile))
    assert fields.gradient_checkpointing is False


def test_a_long_context_large_model_keeps_it(models):
    h100 = host_with(1)
    profile = planned(models["qwen3-8b"], h100, *LONG_CONTEXT, "planner.enforce=false")  # fits at no micro batch
    assert profile.model.enable_gradient_checkpointing is True
    note = h100.memory_note(profile, plan_generation(profile))
    assert note.startswith("gradient checkpointing: on (the training step would need ")
    assert "more than the 67.6 GiB usable of the 79.6 GiB H100 (detected on this host)" in note


def test_what_the_user_sets_wins(models):
    h200 = host_with(1, "NVIDIA H200", 139.8)
    kept = planned(models["qwen3-0.6b"], h200, "model.enable_gradient_checkpointing=true")
    assert kept.model.enable_gradient_checkpointing is True
    assert h200.memory_note(kept, plan_generation(kept)).startswith(
        "gradient checkpointing: on, as a recipe, a profile file or --set has it (the training step would need")
    dropped = planned(models["qwen3-8b"], host_with(1), *LONG_CONTEXT, "model.enable_gradient_checkpointing=false",
                      "planner.enforce=false")
    assert dropped.model.enable_gradient_checkpointing is False
    assert "set model.enable_gradient_checkpointing=true if the step runs out of memory" in host_with(1).memory_note(
        dropped, plan_generation(dropped))


def test_the_dry_run_says_which_and_why(models):
    h100 = host_with(1)
    profile = planned(models["qwen3-0.6b"], h100)
    assert h100.memory_note(profile, plan_generation(profile)).startswith("gradient checkpointing: off (the training step needs ")
    # A dry run that counted no GPUs plans with the platform's accelerator and leaves the profile's value.
    unprobed_device = detect_device("gpu", dry_run=True)
    unprobed = planned(models["qwen3-0.6b"], unprobed_device)
    assert unprobed.model.enable_gradient_checkpointing is True
    assert "no devices were counted on this host" in unprobed_device.memory_note(unprobed, plan_generation(unprobed))


def test_a_cpu_host_keeps_the_profiles_value():
    cpu = resolve_profile("tiny", "cpu")
    assert backend_for("local").detected_layer(cpu, 2, plan_generation(cpu)) is None
    device = detect_device("cpu")
    for model, value in (("tiny", True), ("smollm2-135m", False)):  # the demo's recipe turns it off on a CPU itself
        assert planned(model, device).model.enable_gradient_checkpointing is value
    assert checkpointing_choice(cpu, plan_generation(cpu)) is None
