"""LoRA at planning (planner/lora.py): a target module the model lacks is refused by the dry run in one line;
the adapter the planner counts is the one PEFT builds; the dry run names it, and both backends' memory plans
count the adapter's state instead of the model's and no second copy of the weights for the reference."""

from __future__ import annotations

import json

import pytest

from grpo_pipeline.errors import HEADLINE_CHARS
from grpo_pipeline.stages.plan import resolve_profile


@pytest.mark.parametrize(("targets", "fragment"), [
    ("[q_proj,qkv_proj]", "the model has no module named qkv_proj; its linear modules are q_proj, k_proj, v_proj, o_proj"),
    ("[lm_head]", "lm_head is the output layer; its linear modules are q_proj"),
])
def test_a_target_module_the_model_lacks_is_refused_by_the_dry_run(cli, tiny_model_dir, targets, fragment):
    done = cli("--model", str(tiny_model_dir), "--device", "cpu", "--set", "lora.rank=8",
               "--set", f"lora.target_modules={targets}", "--dry-run")
    assert done.returncode == 2 and done.stdout == "", (done.stdout[-2000:], done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    headline = done.stderr.strip()
    assert headline.startswith("error: ") and len(headline) <= len("error: ") + HEADLINE_CHARS
    assert fragment in headline and "(or use all-linear)" in headline


@pytest.mark.parametrize("targets", ["all-linear", "[q_proj,v_proj]", "[down_proj]"])
def test_the_adapter_the_planner_counts_is_the_one_peft_builds(tiny_model_dir, targets):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.backends.local.lora import peft_config
    from grpo_pipeline.planner.lora import adapter_size

    profile = resolve_profile(str(tiny_model_dir), "cpu", overrides=["lora.rank=8", f"lora.target_modules={targets}"])
    planned = adapter_size(profile)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), peft_config(profile.lora))
    trainable, _ = model.get_nb_trainable_parameters()
    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert (planned.parameters, planned.modules) == (trainable, len(adapted))


def test_the_dry_run_names_the_adapter(cli, tiny_model_dir):
    done = cli("--model", str(tiny_model_dir), "--device", "cpu", "--set", "lora.rank=8", "--set", "lora.alpha=16",
               "--set", "algorithm.use_kl_loss=true", "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["lora"].startswith("LoRA rank 8, alpha 16, on all-linear: 14 modules, ")
    assert "the reference policy is the base model with the adapter disabled" in plan["lora"]
    assert plan["profile"]["lora"]["rank"] == 8 and "lora.rank=8" in plan["command"]
    text = cli("--model", str(tiny_model_dir), "--device", "cpu", "--dry-run")
    assert text.returncode == 0 and "# lora:" not in text.stdout  # full fine-tuning: no line


def test_the_local_step_counts_the_adapters_state_and_no_reference_copy():
    from grpo_pipeline.backends.local.train_memory import step_memory
    from grpo_pipeline.generation.plan import GenerationPlan
    from grpo_pipeline.planner.lora import adapter_size
    from grpo_pipeline.profiles.model_size import model_size

    kl = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01", "cluster.devices_per_node=1"]
    full = resolve_profile("smollm2-135m", "gpu", overrides=kl)
    lora = resolve_profile("smollm2-135m", "gpu", overrides=[*kl, "lora.rank=16"])
    plan, device = GenerationPlan(decoder="native"), 80 * 2**30
    full_parts, lora_parts = (step_memory(p, plan, True, device).parts for p in (full, lora))
    weights = model_size(full.model.architecture).total * 2  # bf16 on a GPU
    assert full_parts["reference model"] == full_parts["gradients"] == full_parts["weights"] == weights
    assert lora_parts["weights"] == weights and not {"gradients", "optimizer", "reference model"} & set(lora_parts)
    adapter = adapter_size(lora).parameters * 4  # PEFT's fp32 adapter
    assert (lora_parts["adapter"], lora_parts["adapter gradients"], lora_parts["adapter optimizer"]) == (
        adapter, adapter, 2 * adapter)
    # The decoder's merged copies of the adapted o_proj and down_proj (q/k/v and gate/up are packed copies anyway).
    arch = full.model.architecture
    merged = arch.num_layers * arch.hidden_size * (arch.num_attention_heads * arch.head_dim + arch.intermediate_size) * 2
    assert lora_parts["rollout packed weights"] - full_parts["rollout packed weights"] == merged
    full_stored, lora_stored = (step_memory(p, plan, False, device).parts["activations"] for p in (full, lora))
    assert lora_stored > full_stored  # without checkpointing every layer's adapters keep B's input, A x


def _layer_saved_bytes_per_token(model, lengths=(32, 64)) -> float:
    """What autograd keeps for backward inside the decoder layers, a token: the slope between two lengths (the
    weights' casts, the same at any length, drop out), under the bf16 autocast the local trainer runs in."""
    import torch

    kept, inside = {}, [False]
    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        if inside[0]:
            storage = tensor.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    totals = []
    for length in lengths:
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            model(input_ids=torch.randint(0, 100, (2, length)))
        totals.append(sum(kept.values()))
    return (totals[1] - totals[0]) / (2 * (lengths[1] - lengths[0]))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_adapters_activations_the_planner_counts_are_what_autograd_keeps(tiny_model_dir, dropout):
    """A frozen base linear keeps no input for its weight's gradient; the adapter's A keeps it instead: LoRA adds
    only B's input (and dropout's mask and copy) over full training. The planner once counted a copy of every
    adapted input besides, planning Qwen3 0.6B's LoRA step 5.5 GiB above the H100's measured peak."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.backends.local.lora import adapter_activation_bytes, peft_config
    from grpo_pipeline.planner.lora import adapter_size

    profile = resolve_profile(str(tiny_model_dir), "cpu", overrides=["lora.rank=16", f"lora.dropout={dropout}"])
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).train()  # dropout on, as training
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                             peft_config(profile.lora)).train()
    layers = profile.model.architecture.num_layers
    measured = (_layer_saved_bytes_per_token(adapted) - _layer_saved_bytes_per_token(full)) / layers
    size = adapter_size(profile)
    planned = adapter_activation_bytes(profile, size)
    inputs = 2 * sum(size.per_layer.values())  # one bf16 copy of every adapted input: what was counted before
    assert abs(measured - planned) < 0.1 * inputs, (measured, planned, inputs)


def test_verls_plan_has_no_reference_role_and_only_the_adapters_gradients():
    from grpo_pipeline.planner.lora import adapter_size
    from grpo_pipeline.planner.memory import plan_for

    overrides = ["backend=verl", "algorithm.use_kl_loss=true", "cluster.devices_per_node=2"]
    full = plan_for(resolve_profile("smollm2-135m", "gpu", overrides=overrides))
    profile = resolve_profile("smollm2-135m", "gpu", overrides=[*overrides, "lora.rank=32"])
    lora = plan_for(profile)
    assert "reference" in {r.role for r in full.roles} and "reference" not in {r.role for r in lora.roles}
    full_update, lora_update = (next(r for r in plan.roles if r.when.startswith("update")) for plan in (full, lora))
    shard = adapter_size(profile).parameters / 2  # FSDP2 over the 2 ranks
    assert lora_update.parts["gradients"] == 4 * shard and lora_update.parts["optimizer"] == 8 * shard
    assert lora_update.parts["weights"] == full_update.parts["weights"] + 4 * shard
    assert lora_update.total < full_update.total / 2


def test_an_adapter_on_a_model_transformers_cannot_build_is_left_to_peft():
    """Numbers transformers cannot build into a model (an unknown model_type): no refusal and no adapter counted
    at planning; PEFT checks the names when the model loads."""
    from grpo_pipeline.planner.lora import adapter_size, lora_problems

    base = resolve_profile("smollm2-135m", "cpu", overrides=["lora.rank=8"])
    architecture = base.model.architecture.model_copy(update={"model_type": "no-such-model"})
    odd = base.model_copy(update={"model": base.model.model_copy(update={"architecture": architecture}),
                                  "lora": base.lora.model_copy(update={"target_modules": ["nope"]})})
    assert adapter_size(odd) is None and lora_problems(odd) == []
