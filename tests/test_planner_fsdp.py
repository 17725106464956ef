"""The planner's FSDP2 model (planner/fsdp.py): each setting moves the part of the plan it should, by
the amount FSDP2 and verl 0.9.1's dp engine make it move; --suggest-layout lists FSDP layouts for a
dense model and never for an MoE one."""

from __future__ import annotations

import pytest

from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.planner.fsdp import backward_working_bytes, hf_layer_bytes
from grpo_pipeline.planner.layouts import candidate_layouts, suggest_layouts, suggestion_table
from grpo_pipeline.planner.memory import GIB, estimate
from grpo_pipeline.profiles.loader import resolve_run_profile
from grpo_pipeline.profiles.model_size import model_size

# A Qwen3-8B-shaped dense model on one node of 8 H200s: big enough that sharding and activations show.
QWEN3_8B = ["model.architecture.num_layers=36", "model.architecture.num_attention_heads=32",
            "model.architecture.num_kv_heads=8", "model.architecture.hidden_size=4096", "model.architecture.head_dim=128",
            "model.architecture.intermediate_size=12288", "model.architecture.vocab_size=151936",
            "model.architecture.tie_word_embeddings=false", "model.architecture.qk_norm=true",
            "model.architecture.model_type=qwen3", "model.architecture.hf_architecture=Qwen3ForCausalLM",
            "cluster.devices_per_node=8", "rollout.tp=2", "platform.accelerator=H200",
            "data.train_batch_size=64", "data.max_prompt_length=1024", "data.max_response_length=3072",
            "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=2", "algorithm.rollout_n=8"]


def fsdp(*extra: str):
    return resolve_profile("smollm2-135m", "gpu", "verl", overrides=[*QWEN3_8B, *extra])


def update(profile):
    return estimate(profile).roles[0]


def test_state_is_sharded_over_the_fsdp_group():
    whole, half = update(fsdp()), update(fsdp("engine.fsdp_size=4"))
    n = model_size(fsdp().model.architecture).total
    assert whole.parts["weights"] == pytest.approx(4 * n / 8) and whole.parts["gradients"] == pytest.approx(4 * n / 8)
    assert whole.parts["optimizer"] == pytest.approx(8 * n / 8)
    for part in ("weights", "gradients", "optimizer"):
        assert half.parts[part] == pytest.approx(2 * whole.parts[part])
    assert half.parts["activations"] == whole.parts["activations"]


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layer():
    on, off = update(fsdp()), update(fsdp("model.enable_gradient_checkpointing=false"))
    p = fsdp()
    tokens = 2 * 4096  # micro batch 2 x (1024 + 3072)
    per_layer = hf_layer_bytes(p, False, False)
    assert off.parts["activations"] == pytest.approx(36 * per_layer * tokens)
    assert "recomputed layer" not in off.parts  # every layer's activations are held at the loss, beside the logits
    assert on.parts["activations"] == pytest.approx(36 * 2 * 4096 * tokens)
    # one recomputed layer (its stored set and its backward's working set: +4f for SwiGLU, +8h for attention)
    # is held after the logits are freed: the peak holds the larger of the two, not both
    recomputed = (per_layer + backward_working_bytes(p, False, False)) * tokens
    assert backward_working_bytes(p, False, False) == 4 * 12288 + 8 * 4096
    assert on.parts["logits"] + on.parts.get("recomputed layer", 0) == pytest.approx(max(recomputed, on.parts["logits"]))
    assert off.total - off.parts["logits"] > 3 * (on.total - on.parts["logits"] - on.parts.get("recomputed layer", 0)
                                                  - on.parts["weights"] - on.parts["gradients"] - on.parts["optimizer"])
    assert "checkpointing on" in on.when and "checkpointing off" in off.when


def test_ulysses_splits_each_sequence_over_its_ranks():
    base = update(fsdp("engine.attn_implementation=flash_attention_2"))
    split = update(fsdp("engine.ulysses_sp=2", "engine.attn_implementation=flash_attention_2", "actor.ppo_micro_batch_size_per_gpu=2"))
    assert split.parts["activations"] == pytest.approx(base.parts["activations"] / 2)
    assert split.parts["logits"] == pytest.approx(base.parts["logits"] / 2)
    assert split.parts["weights"] == base.parts["weights"]  # still sharded over the whole world
    assert "Ulysses 2" in split.when


def test_logits_follow_the_entropy_term_the_temperature_and_the_log_prob_path():
    p = fsdp("algorithm.use_kl_loss=true")
    tokens, vocab = 2 * 4096, 151936
    # flash-attn's cross entropy writes the gradient into the bf16 logits (inplace_backward without entropy)
    assert update(p).parts["logits"] == pytest.approx(tokens * vocab * 2)
    assert update(fsdp("algorithm.entropy_coeff=0.001")).parts["logits"] == pytest.approx(tokens * vocab * 8)
    # a temperature other than 1 divides into a copy
    assert update(fsdp("algorithm.temperature=0.7")).parts["logits"] == pytest.approx(tokens * vocab * 4)
    old_policy = next(r for r in estimate(p).roles if r.when.startswith("log-probs"))
    assert old_policy.parts["logits"] == pytest.approx(4096 * vocab * 6)  # log_prob micro batch 1, entropy always
    assert "gradients" not in old_policy.parts  # freed after each step
    reference = next(r for r in estimate(p).roles if r.role == "reference")
    assert reference.parts["logits"] == pytest.approx(4096 * vocab * 2)  # log-probs only, no entropy


def test_the_reference_lives_on_the_host_and_offload_frees_the_device_for_vllm():
    kept = estimate(fsdp("algorithm.use_kl_loss=true"))
    reference = next(r for r in kept.roles if r.role == "reference")
    assert "weights" not in reference.parts and "CPUOffloadPolicy" in reference.when
    n = model_size(fsdp().model.architecture).total
    host = next(r for r in kept.roles if r.role == "host")
    assert host.total == pytest.approx(8 * 4 * n / 8)  # the reference's fp32 shard, for each of the node's 8 devices
    start = next(r for r in kept.roles if r.when.startswith("vLLM start"))
    assert start.parts["trainer resident"] == pytest.approx(12 * n / 8)
    offloaded = estimate(fsdp("algorithm.use_kl_loss=true", "engine.param_offload=true", "engine.optimizer_offload=true"))
    assert next(r for r in offloaded.roles if r.when.startswith("vLLM start")).parts["trainer resident"] == 0
    # verl loads the offloaded state back for the update: the update's peak does not move
    assert offloaded.roles[0].total == pytest.approx(kept.roles[0].total)


def test_a_layout_that_does_not_fit_is_refused_with_an_fsdp_fix():
    plan = estimate(fsdp("model.enable_gradient_checkpointing=false", "actor.ppo_micro_batch_size_per_gpu=4",
                         "platform.accelerator=H20"))
    assert not plan.fits
    assert "set model.enable_gradient_checkpointing=true" in plan.problems()[0]


def test_suggest_layout_lists_fsdp_for_a_dense_model_and_not_for_moe():
    p = fsdp()
    suggestions, facts = suggest_layouts(p)
    strategies = {s.layout.strategy for s in suggestions}
    assert strategies == {"fsdp", "megatron"}
    fsdp_layouts = [s for s in suggestions if s.layout.strategy == "fsdp"]
    assert all(s.plan.fits and "FSDP2 over" in s.plan.roles[0].when for s in fsdp_layouts)
    lines = suggestion_table(suggestions, facts, p)
    assert any("| fsdp" in line for line in lines) and lines[-1].startswith("best: ")
    moe = resolve_run_profile("qwen3.5-35b-a3b", "gpu", "verl", validate=False)[0]
    assert all(lay.strategy == "megatron" for lay in candidate_layouts(moe))


def test_gib_of_the_update_is_what_the_parts_add_up_to():
    plan = estimate(fsdp())
    assert plan.summary()["roles"][0]["estimate_gib"] == round(plan.roles[0].total / GIB, 1)


def test_the_fsdp_probe_plans_its_layouts_with_this_planner():
    """bench/fsdp_memory_probe.py sets each measured layout up as a profile; every layout it would
    measure on the H200 is planned here (the probe's side of the comparison cannot drift from the planner)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from fsdp_memory_probe import RUNS, SMOKE, full_config, planned

    for config in [*RUNS, *SMOKE]:
        figures = planned(config)
        assert figures["update"] > 0 and figures["log_prob"] > 0, config
        assert {"weights", "gradients", "optimizer", "activations", "logits"} <= set(figures["update_parts"])
        assert figures["update_parts"]["activations"] > 0 and full_config(config)["model"]["vocab_size"] > 0
    on, off = planned({**RUNS[1], "checkpointing": True}), planned({**RUNS[1], "checkpointing": False})
    assert off["update_parts"]["activations"] > 3 * on["update_parts"]["activations"]
