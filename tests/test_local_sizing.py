"""The local backend's step sized by the planner for the GPUs found (backends/local/sizing.py): the largest micro
batch that fits and gradient checkpointing only where none fits without it, for full training and LoRA; what a
recipe, a profile file or --set gives wins, and the rest is decided around it; the dry run says which and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_pipeline.backends.local.sizing import micro_batch_candidates
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.backends.local.train_memory import HEADROOM, step_memory
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.profiles.loader import given_settings
from test_local_train_memory import SHAPES, host_with, planned, write_configs

H100_USABLE = 79.6 * 2**30 * (1 - HEADROOM)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Model directories of Qwen3-0.6B's and Qwen3-8B's config.json."""
    return write_configs(tmp_path_factory.mktemp("configs"))


def fits(profile, micro: int, checkpointing: bool) -> bool:
    sized = profile.model_copy(update={"actor": profile.actor.model_copy(update={"ppo_micro_batch_size_per_gpu": micro})})
    usable = H100_USABLE - profile.platform.reserved_memory_gib * 2**30
    return step_memory(sized, plan_generation(sized), checkpointing, 79.6 * 2**30).total <= usable


@pytest.mark.parametrize(("model", "lora"), [("qwen3-0.6b", []), ("qwen3-8b", ["lora.rank=16"])])
def test_the_largest_micro_batch_that_fits_without_recomputation(models, model, lora):
    profile = planned(models[model], host_with(1), *lora)
    micro, candidates = profile.actor.ppo_micro_batch_size_per_gpu, micro_batch_candidates(profile)
    assert profile.cluster.devices_per_node == 1 and profile.model.enable_gradient_checkpointing is False
    assert micro in candidates and fits(profile, micro, False)
    larger = [m for m in candidates if m > micro]
    assert not larger or not fits(profile, larger[0], False)  # the next one would not
    if model == "qwen3-8b":  # the base's bf16 weights and the rollouts' cache leave room for a few sequences
        assert 1 <= micro < candidates[-1]


def test_a_full_8b_on_one_h100_is_refused_and_told_to_train_an_adapter(models):
    h100 = host_with(1)
    with pytest.raises(ProfileError, match=r"^the training step does not fit the device: micro batch 1 needs [\d.]+ GiB of "
                       r"67.6 GiB usable; train an adapter \(lora.rank=16\)\n"):
        planned(models["qwen3-8b"], h100)
    profile = planned(models["qwen3-8b"], h100, "planner.enforce=false")  # the dry run still says what would fit
    assert profile.model.enable_gradient_checkpointing is True and not fits(profile, 1, True)
    note = h100.memory_note(profile, plan_generation(profile))
    assert "no micro batch fits even with gradient checkpointing on" in note and "train an adapter (lora.rank=16)" in note


def test_what_is_given_wins_and_the_rest_is_decided_around_it(models):
    h100 = host_with(1)
    free = planned(models["qwen3-8b"], h100, "lora.rank=16")
    larger = [m for m in micro_batch_candidates(free) if m > free.actor.ppo_micro_batch_size_per_gpu][-1]
    given = planned(models["qwen3-8b"], h100, "lora.rank=16", f"actor.ppo_micro_batch_size_per_gpu={larger}")
    assert given.actor.ppo_micro_batch_size_per_gpu == larger
    assert given.model.enable_gradient_checkpointing is True  # the given micro batch needs the recomputation
    note = h100.memory_note(given, plan_generation(given))
    assert f"micro batch {larger}, as a recipe, a profile file or --set has it; " \
           f"{free.actor.ppo_micro_batch_size_per_gpu} is the largest of" in note
    kept = planned(models["qwen3-8b"], h100, "lora.rank=16", "model.enable_gradient_checkpointing=true")
    assert kept.actor.ppo_micro_batch_size_per_gpu > free.actor.ppo_micro_batch_size_per_gpu  # more fits with it


def test_the_settings_given_are_the_recipes_the_profile_files_and_the_command_lines(tmp_path, models):
    profile_file = tmp_path / "p.yaml"
    profile_file.write_text("actor: {ppo_mini_batch_size: 4}\n")
    recipe = given_settings("smollm2-135m", "gpu", profile_file, ["lora.rank=8"])
    assert {"actor.ppo_micro_batch_size_per_gpu", "actor.ppo_mini_batch_size", "lora.rank", "model.name"} <= recipe
    directory = given_settings(str(models["qwen3-8b"]), "gpu")
    assert "actor.ppo_micro_batch_size_per_gpu" not in directory and "model.architecture.hidden_size" in directory


def test_the_dry_run_on_a_one_gpu_host_names_the_planners_choices(cli, models, monkeypatch):
    monkeypatch.setattr("grpo_pipeline.stages.device.run_probe", lambda *args, **kwargs: PROBE_ONE_H100)
    done = cli("--model", str(models["qwen3-8b"]), "--device", "auto", "--set", "lora.rank=16", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = {line.split(":", 1)[0]: line for line in done.stdout.splitlines() if line.startswith("# ")}
    assert "43,646,976 trainable parameters" in lines["# lora"]
    memory = lines["# memory plan"]
    assert "gradient checkpointing: off (the training step needs " in memory and "H100 (detected on this host)" in memory
    assert "that fits" in memory and "micro batch " in memory
    plan = json.loads(cli("--model", str(models["qwen3-8b"]), "--device", "auto", "--set", "lora.rank=16",
                          "--dry-run", "--json").stdout)
    assert plan["profile"]["cluster"]["devices_per_node"] == 1
    assert f"micro batch {plan['profile']['actor']['ppo_micro_batch_size_per_gpu']}: the largest of" in memory
    # Issue 55: the JSON carries the planner's choices and reasons too, the same words as the text line.
    assert plan["memory"] == {"note": memory.removeprefix("# memory plan: ")}
    full = cli("--model", str(models["qwen3-8b"]), "--device", "auto", "--dry-run")  # no adapter: fits nowhere
    assert full.returncode == 2 and full.stdout == ""
    said = full.stderr.strip().splitlines()
    assert said[-3].startswith("error: the training step does not fit the device: micro batch 1 needs "), full.stderr
    assert said[-1] == "  or lower data.max_response_length or data.train_batch_size; planner.enforce=false runs it anyway"


PROBE_ONE_H100 = {"npu": {"status": "absent", "detail": "torch_npu is not installed"},
                  "gpu": {"status": "available", "count": 1, "names": ["NVIDIA H100 80GB HBM3"], "memory_gib": [79.6],
                          "cuda_version": "13.0", "detail": "CUDA sees 1 GPU(s)"}}


def test_suggest_layout_on_one_gpu_is_the_largest_micro_batch_for_full_and_lora(cli, models):
    """A computed version of verl's hand-made table (docs/perf/device_tuning.rst): the largest batch one GPU fits."""
    lengths = ["--set", "data.max_prompt_length=256", "--set", "data.max_response_length=1024",
               "--set", "data.train_batch_size=16", "--set", "algorithm.rollout_n=8", "--set", "platform.accelerator=H100",
               "--set", "generation.steps_per_generation=1"]  # the GPU shape: 16 prompts x 8, 256 + 1,024 tokens
    sized = {}
    for model in SHAPES:
        done = cli("--model", str(models[model]), "--device", "gpu", "--backend", "local", *lengths, "--suggest-layout", "--json")
        assert done.returncode == 0, done.stderr
        sized[model] = {(r["training"], r["gradient_checkpointing"]): r["largest_micro_batch"] for r in json.loads(done.stdout)["rows"]}
    small, large = sized["qwen3-0.6b"], sized["qwen3-8b"]
    # A small model's step is mostly activations, which an adapter does not shrink (A keeps what the frozen base drops):
    # both train there; an 8B's full training state (bf16 weights, gradients, AdamW's moments: 61 GiB) does not fit.
    assert small[("full", True)] > small[("full", False)] > 0 and small[("LoRA r16", True)] > small[("LoRA r16", False)] > 0
    assert large[("full", True)] == large[("full", False)] == 0 and large[("LoRA r16", True)] > large[("LoRA r16", False)] > 0
    # Each number is the boundary: it fits, one more does not.
    profile = planned(models["qwen3-8b"], host_with(1), "lora.rank=16", *lengths[1::2])
    largest = large[("LoRA r16", True)]
    assert fits(profile, largest, True) and not fits(profile, largest + 1, True)
    text = cli("--model", str(models["qwen3-8b"]), "--device", "gpu", "--backend", "local", *lengths, "--suggest-layout")
    assert "| LoRA r16 | on | " in text.stdout and "| full | off | none fits | - |" in text.stdout
    tiny = cli("--model", str(models["qwen3-8b"]), "--device", "gpu", "--backend", "local", "--set",
               "platform.device_memory_gib=8", "--suggest-layout")
    assert tiny.returncode == 2 and "error: not one sequence of custom fits one" in tiny.stderr
    assert "lower generation.steps_per_generation" in tiny.stderr


def test_fewer_rounds_per_generation_where_their_rollouts_leave_no_room(models):
    """The GPU profile generates 4 steps' prompts a round; at 16 x 8 with 1,024 new tokens their KV cache beside the
    step fits no micro batch of Qwen3-0.6B on one H100: the planner halves the rounds until one fits, unless given."""
    shape = ["data.max_prompt_length=256", "data.max_response_length=1024", "data.train_batch_size=16",
             "actor.ppo_mini_batch_size=16", "algorithm.rollout_n=8"]
    h100 = host_with(1)
    profile = planned(models["qwen3-0.6b"], h100, *shape)
    rounds = profile.generation.steps_per_generation
    assert 1 <= rounds < 4 and plan_generation(profile).steps_per_generation == rounds
    assert fits(profile, profile.actor.ppo_micro_batch_size_per_gpu, profile.model.enable_gradient_checkpointing)
    if rounds > 1:  # twice as many would not have fitted
        more = profile.model_copy(update={"generation": profile.generation.model_copy(update={"steps_per_generation": rounds * 2})})
        assert not any(fits(more, m, True) for m in micro_batch_candidates(more))
    with pytest.raises(ProfileError, match="the training step does not fit the device"):  # given: kept, and refused
        planned(models["qwen3-0.6b"], h100, *shape, "generation.steps_per_generation=4")
