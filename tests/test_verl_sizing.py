"""A verl run sized by the planner for the GPUs found (backends/verl/sizing.py): the update's micro batch and
gradient checkpointing, the log-prob passes' micro batch, offload only where vLLM could not start otherwise,
vLLM's share of the device and its concurrent sequences; what a recipe, a profile file or --set gives wins, the
rest is decided around it, and the dry run's memory plan names every choice and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_pipeline.backends.verl.sizing import HEADROOM, with_settings
from grpo_pipeline.planner.memory import plan_for
from grpo_pipeline.planner.rules import divisors
from test_local_train_memory import QWEN3, host_with, planned, write_configs

# The one-GPU case: 16 prompts x 8 responses, 256-token prompts, 1,024 new tokens, on FSDP.
ONE_GPU = ["backend=verl", "engine.strategy=fsdp", "cluster.devices_per_node=1", "data.train_batch_size=16",
           "actor.ppo_mini_batch_size=16", "algorithm.rollout_n=8", "data.max_prompt_length=256",
           "data.max_response_length=1024"]
QWEN3_14B = {"num_hidden_layers": 40, "num_attention_heads": 40, "hidden_size": 5120, "intermediate_size": 17408,
             "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    found = write_configs(root)
    (root / "qwen3-14b").mkdir()
    (root / "qwen3-14b" / "config.json").write_text(json.dumps({**QWEN3, **QWEN3_14B}))
    return {**found, "qwen3-14b": root / "qwen3-14b"}


def trainer_fits(profile, spare: float = HEADROOM) -> bool:
    """The actor's and reference's rows of `profile`'s plan on one H100 fit with `spare` of the device left."""
    plan = plan_for(profile, ["NVIDIA H100 80GB HBM3"], [79.6])
    room = spare * plan.device_memory
    return all(r.total <= r.capacity - room for r in plan.roles if r.role in ("actor", "reference"))


def notes(device, profile) -> list[str]:
    return device.memory_plan(profile).notes


def test_an_8b_lora_run_on_one_h100_is_sized_and_says_so(models):
    h100 = host_with(1)
    profile = planned(models["qwen3-8b"], h100, *ONE_GPU, "lora.rank=16")
    micro, lp = profile.actor.ppo_micro_batch_size_per_gpu, profile.log_prob.micro_batch_size_per_gpu
    assert profile.model.enable_gradient_checkpointing is False
    assert trainer_fits(profile)  # what was chosen fits, with the spare
    larger = [m for m in divisors(16 * 8) if m > micro]
    assert larger and not trainer_fits(with_settings(profile, {"actor.ppo_micro_batch_size_per_gpu": larger[0]}))
    assert not trainer_fits(with_settings(profile, {"log_prob.micro_batch_size_per_gpu": lp * 2}))
    assert profile.engine.param_offload is False and profile.engine.optimizer_offload is False
    assert 0.05 < profile.rollout.gpu_memory_utilization <= 0.9
    plan = h100.memory_plan(profile)
    assert plan.fits and 1 <= profile.rollout.max_num_seqs == min(128, plan.kv_sequences)
    said = notes(h100, profile)
    for key in ("model.enable_gradient_checkpointing", "actor.ppo_micro_batch_size_per_gpu",
                "log_prob.micro_batch_size_per_gpu", "engine.param_offload", "rollout.gpu_memory_utilization",
                "rollout.max_num_seqs"):
        assert any(line.startswith(f"planner: {key}=") for line in said), (key, said)


def test_what_is_given_wins_and_the_rest_is_decided_around_it(models):
    h100 = host_with(1)
    free = planned(models["qwen3-8b"], h100, *ONE_GPU, "lora.rank=16")
    given = planned(models["qwen3-8b"], h100, *ONE_GPU, "lora.rank=16", "actor.ppo_micro_batch_size_per_gpu=1",
                    "rollout.gpu_memory_utilization=0.3")
    assert given.actor.ppo_micro_batch_size_per_gpu == 1 and given.rollout.gpu_memory_utilization == 0.3
    assert given.log_prob.micro_batch_size_per_gpu == free.log_prob.micro_batch_size_per_gpu  # still sized
    # vLLM's smaller share holds fewer sequences: its concurrency follows what was given
    assert given.rollout.max_num_seqs <= free.rollout.max_num_seqs
    said = " | ".join(notes(h100, given))
    assert ("actor.ppo_micro_batch_size_per_gpu=1, as a recipe, a profile file or --set has it; the planner would "
            f"choose {free.actor.ppo_micro_batch_size_per_gpu}") in said
    assert "rollout.gpu_memory_utilization=0.3, as a recipe, a profile file or --set has it" in said


def test_offload_only_where_vllm_could_not_start_beside_the_trainer(models):
    h100 = host_with(1)
    small = planned(models["qwen3-8b"], h100, *ONE_GPU, "lora.rank=16")
    assert small.engine.param_offload is False
    # A 14B adapter run: the base's fp32 shard leaves vLLM too little to start beside it
    large = planned(models["qwen3-14b"], h100, *ONE_GPU, "lora.rank=16")
    assert large.engine.param_offload is True and large.engine.optimizer_offload is True
    assert h100.memory_plan(large).fits
    kept = with_settings(large, {"engine.param_offload": False, "engine.optimizer_offload": False})
    assert not plan_for(kept, ["NVIDIA H100 80GB HBM3"], [79.6]).fits  # without it the plan would refuse
    assert any(line.startswith("planner: engine.param_offload=true: vLLM cannot start") for line in notes(h100, large))


def test_a_run_that_fits_nowhere_is_still_refused_with_its_fix(models):
    """Issue 55: on one device the fix named sharding over more ranks and offloads the plan already had on; it
    names the one change that fits, an adapter, as the local backend's refusal does."""
    with pytest.raises(Exception, match="the layout does not fit in memory: actor needs") as refused:
        planned(models["qwen3-8b"], host_with(1), *ONE_GPU)  # full training of 8B: 16 bytes a parameter
    assert "train an adapter (lora.rank=16)" in str(refused.value)
    assert "shard over more ranks" not in str(refused.value)



def test_suggest_layout_on_one_gpu_is_verls_table_computed(cli, models):
    """verl's hand-made table of the largest GRPO batch on one H100 (docs/perf/device_tuning.rst), computed from its
    FSDP engine's plan at the model's lengths: the largest update micro batch, full training and LoRA."""
    shape = [arg for item in ONE_GPU[1:] for arg in ("--set", item)] + ["--set", "platform.accelerator=H100"]
    done = cli("--model", str(models["qwen3-8b"]), "--device", "gpu", "--backend", "verl", *shape, "--suggest-layout", "--json")
    assert done.returncode == 0, done.stderr
    rows = {(r["training"], r["gradient_checkpointing"]): r["largest_micro_batch"] for r in json.loads(done.stdout)["rows"]}
    # An 8B's full training state (fp32 weights, gradients and AdamW's moments: 16 bytes a parameter) fills an H100.
    assert rows[("full", False)] == rows[("full", True)] == 0
    assert rows[("LoRA r16", True)] > rows[("LoRA r16", False)] > 0
    profile = planned(models["qwen3-8b"], host_with(1), *ONE_GPU, "lora.rank=16", "log_prob.micro_batch_size_per_gpu=1")
    largest = rows[("LoRA r16", False)]  # the boundary: it fits, one more does not

    def at(micro: int):
        return with_settings(profile, {"actor.ppo_micro_batch_size_per_gpu": micro, "model.enable_gradient_checkpointing": False})

    assert trainer_fits(at(largest)) and not trainer_fits(at(largest + 1))
    text = cli("--model", str(models["qwen3-8b"]), "--device", "gpu", "--backend", "verl", *shape, "--suggest-layout")
    assert "# verl (fsdp): the largest micro batch of 1280-token sequences" in text.stdout
    assert "| full | off | none fits | - |" in text.stdout
    small = cli("--model", str(models["qwen3-8b"]), "--device", "gpu", "--backend", "verl", *shape,
                "--set", "platform.device_memory_gib=8", "--suggest-layout")
    assert small.returncode == 2 and "error: not one sequence of custom fits one" in small.stderr


def test_the_lora_docs_sizing_command_prints_the_docs_output(cli, models, monkeypatch):
    """Issue 55: docs/lora.md's verl sizing command, run as written, planned over the GPU profile's 8 ranks, so its
    printed plan did not come out; run here on a host the probe answers as one H100, it prints the page's lines."""
    import shlex

    from test_docs_commands import bash_lines

    page = Path(__file__).resolve().parents[1] / "docs" / "lora.md"
    (command,) = [line for line in bash_lines(page) if "<qwen3-8b-dir>" in line and "--backend verl" in line and "--dry-run" in line]
    shown = page.read_text().split(command, 1)[1].split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    from test_local_sizing import PROBE_ONE_H100

    monkeypatch.setattr("grpo_pipeline.stages.device.run_probe", lambda *args, **kwargs: PROBE_ONE_H100)
    arguments = shlex.split(command.replace("<qwen3-8b-dir>", str(models["qwen3-8b"])))[3:]
    done = cli(*arguments)
    assert done.returncode == 0, done.stderr
    printed = [line.removeprefix("#   ") for line in done.stdout.splitlines()]  # the plan's lines, as the page shows them
    assert len(shown) == 16 and [line for line in shown if line not in printed] == []
