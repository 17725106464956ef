"""The memory planner's model, one class at a time (issue 24): MoE activations under TransformerEngine,
dynamic batching, the optimizer step, uneven pipeline stages, model sizes by family, the static part
against Megatron-LM's estimator, and `planner.enforce`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from grpo_pipeline.planner.activations import mlp_bytes
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.profiles.hf_config import architecture_from_hf_config
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.profiles.loader import resolve_run_profile
from grpo_pipeline.planner.memory import GIB, estimate
from grpo_pipeline.profiles.model_size import kv_bytes_per_token, model_size
from grpo_pipeline.planner.parallel import Layout, stages as pipeline_stages
from grpo_pipeline.profiles.schema import ModelArchitecture
from grpo_pipeline.planner.rules import layout_problems

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_megatron_static import DEEPSEEK_V3, QWEN3_235B, QWEN3_30B_A3B, rows  # noqa: E402

UNSET = {name: field.default for name, field in ModelArchitecture.model_fields.items() if not field.is_required()}


def verl_profile(arch: dict, **sections):
    """A verl profile of `arch` (every architecture field set: nothing leaks from the recipe underneath)."""
    overrides = {"model": {"architecture": {**UNSET, **arch}}, **sections}
    return resolve_run_profile("tiny", "gpu", "verl", overrides=overrides, validate=False)[0]


def actor_rows(plan):
    return [r for r in plan.roles if r.role == "actor"]


# --- MoE activations ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, fused, expected", [
    (QWEN3_30B_A3B, False, 104_196), (QWEN3_30B_A3B, True, 79_620),
    (QWEN3_235B, False, 206_596), (QWEN3_235B, True, 157_444),
    ({**QWEN3_30B_A3B, "model_type": "qwen3_5_moe", "num_experts": 256, "moe_intermediate_size": 512,
      "shared_expert_intermediate_size": 512}, True, 72_068),
    (DEEPSEEK_V3, True, 258_404),
])
def test_moe_layers_under_transformer_engine_keep_megatron_cores_per_token_bytes(arch, fused, expected):
    """The per-layer MoE bytes per token at TP = ETP = 1 (norm, router, permute map, dispatcher probs, fc1
    input per routed row, fused or unfused SwiGLU, shared expert), as read from megatron-core 0.16."""
    profile = verl_profile(arch, engine={"transformer_overrides": {"bias_activation_fusion": fused, "moe_permute_fusion": True}})
    assert mlp_bytes(profile, moe=True, etp=1) == expected


def test_the_layer_spec_picks_the_formula_and_the_local_one_keeps_the_h200_calibration():
    te = verl_profile(QWEN3_30B_A3B, engine={"transformer_overrides": {"bias_activation_fusion": True}})
    local = verl_profile(QWEN3_30B_A3B, planner={"layer_spec": "local"})
    # The local spec's calibrated term: 2 x (4E + k (2H + 4F) + 4Fs) elements, with the norm's 4H bytes.
    assert mlp_bytes(local, moe=True, etp=1) == 4 * 2048 + 2 * (4 * 128 + 8 * (2 * 2048 + 4 * 768))
    assert mlp_bytes(te, moe=True, etp=1) < 0.75 * mlp_bytes(local, moe=True, etp=1)
    assert estimate(te).roles[0].parts["activations"] < estimate(local).roles[0].parts["activations"]
    # ETP gathers each routed row's input over the expert-TP ranks while splitting the F-wide tensors.
    assert mlp_bytes(te, moe=True, etp=2) - mlp_bytes(te, moe=True, etp=1) == 8 * (2 * 2048 + 4)


# --- dynamic batching --------------------------------------------------------------------------------

def dynamic_profile(algorithm: dict | None = None, **actor):
    return verl_profile(QWEN3_30B_A3B, cluster={"devices_per_node": 8}, engine={"ep": 8},
                        data={"train_batch_size": 64, "max_prompt_length": 2048, "max_response_length": 8192},
                        algorithm={"rollout_n": 16, **(algorithm or {})},
                        actor={"use_dynamic_bsz": True, "ppo_mini_batch_size": 32, "ppo_max_token_len_per_gpu": 10240,
                               **actor},
                        log_prob={"use_dynamic_bsz": True, "max_token_len_per_gpu": 20480})


def test_dynamic_batching_sizes_each_micro_batch_at_its_token_budget():
    plan = estimate(dynamic_profile())
    update, log_probs = actor_rows(plan)
    vocab = 151936
    assert update.when.startswith("update, token budget 10240 per micro batch (actor.ppo_max_token_len_per_gpu)")
    assert update.parts["logits"] == 6 * 10240 * vocab  # bf16 logits and the loss's fp32 copy
    assert log_probs.when.startswith("log-probs, token budget 20480 per micro batch (log_prob.max_token_len_per_gpu)")
    assert log_probs.parts["logits"] == 8 * 20480 * vocab  # verl computes the old policy's entropy too
    # The micro batch size means nothing under dynamic batching; the budget does.
    assert estimate(dynamic_profile(ppo_micro_batch_size_per_gpu=8)).roles[0].total == update.total
    assert estimate(dynamic_profile(ppo_max_token_len_per_gpu=5120)).roles[0].parts["logits"] == update.parts["logits"] / 2


def test_a_mini_batch_under_the_budget_is_one_micro_batch_of_its_own_tokens():
    small = verl_profile(QWEN3_30B_A3B, data={"train_batch_size": 8, "max_prompt_length": 512, "max_response_length": 512},
                         algorithm={"rollout_n": 2}, actor={"use_dynamic_bsz": True, "ppo_mini_batch_size": 8,
                                                            "ppo_max_token_len_per_gpu": 65536})
    update = estimate(small).roles[0]
    assert update.when.startswith("update, one micro batch of 16384 tokens (under actor.ppo_max_token_len_per_gpu)")


def test_entropy_and_the_reference_pass_have_their_own_logits():
    base = estimate(dynamic_profile()).roles[0].parts["logits"]
    assert estimate(dynamic_profile({"entropy_coeff": 0.001})).roles[0].parts["logits"] == base * 10 / 6
    reference = next(r for r in estimate(dynamic_profile({"use_kl_loss": True})).roles if r.role == "reference")
    assert reference.parts["logits"] == 6 * 20480 * 151936


def test_under_dynamic_batching_the_fix_names_the_token_budget_not_the_micro_batch():
    refused = estimate(dynamic_profile(ppo_max_token_len_per_gpu=65536)).roles[0]
    assert not refused.fits
    assert "actor.ppo_max_token_len_per_gpu" in refused.fix and "ppo_micro_batch_size_per_gpu" not in refused.fix
    assert "token budget 65536 per micro batch" in refused.problem("H20")


# --- the optimizer step ------------------------------------------------------------------------------

def test_torch_adamw_foreach_adds_four_bytes_per_parameter_of_the_shard_at_the_step():
    dense = {"model_type": "qwen2", "num_layers": 64, "hidden_size": 5120, "num_attention_heads": 40, "num_kv_heads": 8,
             "head_dim": 128, "intermediate_size": 27648, "vocab_size": 152064, "attention_bias": True}
    sections = {"cluster": {"devices_per_node": 8}, "engine": {"tp": 8}}
    fused = estimate(verl_profile(dense, **sections))
    assert [r.when.split(",")[0] for r in actor_rows(fused)] == ["update", "log-probs"]  # no step row: no temporaries
    foreach = estimate(verl_profile(dense, planner={"adam": "foreach"}, **sections))
    step = next(r for r in foreach.roles if r.when.startswith("optimizer step"))
    shard = step.parts["weights"] / 2  # parameters of the device's shard; DP 1: the optimizer's shard is all of it
    assert step.parts["optimizer step temporaries"] == 4 * shard
    assert step.total == step.parts["weights"] + step.parts["gradients"] + step.parts["optimizer"] + 4 * shard


@pytest.mark.parametrize("precision_aware, fraction, device_bytes, host_bytes", [
    (False, 1.0, 4, 16), (False, 0.5, 8, 8), (True, 1.0, 0, 16), (True, 0.5, 6, 8), (False, 0.0, 12, 0)])
def test_megatrons_cpu_optimizer_keeps_the_fp32_master_on_the_device_unless_precision_aware(
        precision_aware, fraction, device_bytes, host_bytes):
    profile = verl_profile(QWEN3_30B_A3B, cluster={"devices_per_node": 8}, engine={
        "ep": 8, "optimizer_overrides": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
                                         "use_precision_aware_optimizer": precision_aware}})
    plan = estimate(profile)
    update, host = plan.roles[0], plan.roles[-1]
    params = update.parts["weights"] / 2
    size = model_size(profile.model.architecture)
    experts_share = size.moe_layers * size.experts / 8 / params  # expert shard: DP 1; dense: DP 8
    per_param = device_bytes * (experts_share + (1 - experts_share) / 8)
    assert update.parts.get("optimizer", 0) == pytest.approx(per_param * params)
    assert host.parts["offloaded"] == pytest.approx(8 * host_bytes * (experts_share + (1 - experts_share) / 8) * params)


# --- uneven pipeline stages --------------------------------------------------------------------------

@pytest.mark.parametrize("layers, pp, engine, stages", [
    (94, 8, {"num_layers_in_first_pipeline_stage": 11, "num_layers_in_last_pipeline_stage": 11}, [11] + [12] * 6 + [11]),
    (94, 8, {"num_layers_in_last_pipeline_stage": 10}, [12] * 7 + [10]),
    (61, 12, {"num_layers_in_last_pipeline_stage": 6}, [5] * 11 + [6]),
    (61, 16, {"num_layers_in_first_pipeline_stage": 4, "num_layers_in_last_pipeline_stage": 1}, [4] * 15 + [1]),
    (94, 8, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     [11] + [12] * 6 + [11]),
])
def test_uneven_pipeline_stages_validate_and_split_as_megatron_core_does(layers, pp, engine, stages):
    profile = verl_profile({**QWEN3_235B, "num_layers": layers}, cluster={"nnodes": pp, "devices_per_node": 8},
                           engine={"tp": 4, "pp": pp, "ep": 4, **engine})
    assert layout_problems(profile) == []
    size = model_size(profile.model.architecture)
    assert [len(s.layers) for s in pipeline_stages(profile, size, Layout.of(profile))] == stages


@pytest.mark.parametrize("engine, fragment", [
    ({"num_layers_in_first_pipeline_stage": 11}, "leave 83 for 7 middle stage(s), not an even split"),
    ({"num_layers_in_first_pipeline_stage": 11, "account_for_loss_in_pipeline_split": True},
     "cannot be combined with account_for_embedding/loss_in_pipeline_split"),
    ({"num_layers_in_first_pipeline_stage": 11, "num_layers_in_last_pipeline_stage": 11, "vpp": 2},
     "must divide by engine.vpp=2"),
    ({"account_for_embedding_in_pipeline_split": True}, "the model's 94 layers + the embedding do not split evenly"),
    ({}, "--set engine.num_layers_in_first_pipeline_stage=11 --set engine.num_layers_in_last_pipeline_stage=11"),
    ({"transformer_overrides": {"num_layers_in_last_pipeline_stage": 10}},
     "engine.transformer_overrides.num_layers_in_last_pipeline_stage: set engine.num_layers_in_last_pipeline_stage instead"),
])
def test_a_pipeline_split_megatron_core_refuses_is_refused_with_the_rule(engine, fragment):
    with pytest.raises(ProfileError) as caught:
        resolve_profile("tiny", "gpu", "verl", overrides={
            "model": {"architecture": {**UNSET, **QWEN3_235B}}, "cluster": {"nnodes": 4, "devices_per_node": 8},
            "engine": {"tp": 4, "pp": 8, "ep": 4, **engine}, "data": {"train_batch_size": 32},
            "actor": {"ppo_mini_batch_size": 32, "ppo_micro_batch_size_per_gpu": 1}})
    assert fragment in str(caught.value)


def test_the_estimate_is_the_fullest_stage_of_an_uneven_split():
    sections = {"cluster": {"nnodes": 4, "devices_per_node": 8}, "engine": {"tp": 4, "pp": 8, "ep": 4}}
    uneven = estimate(verl_profile(QWEN3_235B, **{**sections, "engine": {
        **sections["engine"], "num_layers_in_first_pipeline_stage": 11, "num_layers_in_last_pipeline_stage": 11}}))
    full_last = estimate(verl_profile(QWEN3_235B, **{**sections, "engine": {
        **sections["engine"], "num_layers_in_first_pipeline_stage": 10, "num_layers_in_last_pipeline_stage": 12}}))
    size = model_size(ModelArchitecture(**{**UNSET, **QWEN3_235B}))
    # 11 + 6 x 12 + 11: a middle stage of 12 layers, no embedding or output, is the fullest
    expected = 12 * (size.layer(0)[0] / 4 + size.layer(0)[1] + size.experts / 4)
    assert uneven.roles[0].parts["weights"] == pytest.approx(2 * expected)
    assert "pipeline stage" in uneven.roles[0].when and "(12 layers)" in uneven.roles[0].when
    # 10 + 6 x 12 + 12: the last stage holds 12 layers and the output layer
    assert full_last.roles[0].parts["weights"] > uneven.roles[0].parts["weights"]


def test_the_suggested_layouts_split_unevenly_where_the_layers_do_not_divide():
    from grpo_pipeline.planner.layouts import suggest_layouts

    base = {"model": {"architecture": {**UNSET, **QWEN3_235B}}, "cluster": {"nnodes": 4, "devices_per_node": 8},
            "data": {"train_batch_size": 32, "max_prompt_length": 2048, "max_response_length": 8192},
            "algorithm": {"rollout_n": 8}, "actor": {"ppo_mini_batch_size": 16},
            "engine": {"transformer_overrides": {"recompute_granularity": "full", "recompute_num_layers": 1}},
            "rollout": {"gpu_memory_utilization": 0.85}}
    profile = resolve_run_profile("tiny", "gpu", "verl", overrides=base, validate=False)[0]
    suggestions, _ = suggest_layouts(profile)
    eight = [s for s in suggestions if s.layout.pp == 8]  # 94 layers: 11 + 6 x 12 + 11
    assert eight and all((s.layout.first_stage_layers, s.layout.last_stage_layers) == (11, 11) for s in eight)
    # Set back on the command line, the uneven split validates and fits.
    checked = resolve_profile("tiny", "gpu", "verl", overrides={**base, **eight[0].settings()})
    assert checked.engine.num_layers_in_first_pipeline_stage == 11 and estimate(checked).fits


# --- architectures -----------------------------------------------------------------------------------

def _tiny_configs():
    from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    small = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                 intermediate_size=96)
    mla = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1,
               topk_group=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "llama": LlamaConfig(**small, head_dim=16),
        "qwen2": Qwen2Config(**small),
        "qwen3": Qwen3Config(**small, head_dim=16, tie_word_embeddings=False),
        "qwen3_moe": Qwen3MoeConfig(**small, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
        "deepseek_v3": DeepseekV3Config(**{**small, **mla}, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=24),
        "deepseek_v3 without q LoRA": DeepseekV3Config(**{**small, **mla}, n_shared_experts=1, first_k_dense_replace=2,
                                                      q_lora_rank=None),
        "glm4_moe": Glm4MoeConfig(**small, head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  moe_intermediate_size=32, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                                  n_group=1, topk_group=1),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3 without q LoRA",
                                    "glm4_moe"])
def test_each_family_read_from_its_config_json_is_sized_as_transformers_builds_it(family, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()[family]
    config.to_json_file(tmp_path / "config.json")
    arch = ModelArchitecture(**architecture_from_hf_config(tmp_path))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    assert model_size(arch).total == sum(p.numel() for p in built.parameters())


def test_qwen3_5_is_sized_with_its_vision_tower_and_its_mtp_layer_when_trained(tmp_path):
    import torch
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2, mtp_num_hidden_layers=1)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=64)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    config.to_json_file(tmp_path / "config.json")
    arch = ModelArchitecture(**architecture_from_hf_config(tmp_path))
    with torch.device("meta"):
        built = Qwen3_5MoeForConditionalGeneration(config)
    assert arch.model_type == "qwen3_5_moe" and arch.mtp_layers == 1 and arch.vision_parameters > 0
    assert model_size(arch).total == sum(p.numel() for p in built.parameters())  # the vision tower included
    # The recipes' vision towers, as transformers counts them for the published configs.
    assert resolve_profile("qwen3.5-35b-a3b", "gpu").model.architecture.vision_parameters == 446_571_248
    # MTP: held on the last stage only when trained (verl builds none unless asked).
    profile = resolve_profile("qwen3.5-35b-a3b", "gpu")
    trained = resolve_profile("qwen3.5-35b-a3b", "gpu", overrides=["engine.mtp=true"])
    size = model_size(profile.model.architecture)
    added = estimate(trained).roles[0].parts["weights"] - estimate(profile).roles[0].parts["weights"]
    assert added == pytest.approx(2 * ((size.mtp_layer - size.experts) / 2 + size.experts / 8))
    with pytest.raises(ProfileError, match="engine.mtp=true: the model has no multi-token-prediction layers"):
        resolve_profile("qwen3.5-35b-a3b", "gpu", overrides=["engine.mtp=true", "model.architecture.mtp_layers=0"])


@pytest.mark.parametrize("arch, total, active", [
    (DEEPSEEK_V3, 671_026_404_352, 37_552_282_624),
    ({**DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64, "num_kv_heads": 64,
      "num_experts": 384, "first_k_dense_replace": 1}, 1_026_408_209_408, 32_861_477_888),
    (QWEN3_235B, 235_093_634_560, 22_190_763_520),
    ({"model_type": "glm4_moe", "num_layers": 92, "hidden_size": 5120, "vocab_size": 151552, "num_attention_heads": 96,
      "num_kv_heads": 8, "head_dim": 128, "attention_bias": True, "qk_norm": True, "intermediate_size": 12288,
      "moe_intermediate_size": 1536, "num_experts": 160, "shared_expert_intermediate_size": 1536,
      "num_experts_per_tok": 8, "first_k_dense_replace": 3}, 352_797_814_784, 33_632_251_904),
])
def test_published_moe_models_have_transformers_parameter_counts(arch, total, active):
    size = model_size(ModelArchitecture(**{**UNSET, **arch}))
    assert (size.total, size.active) == (total, active)


def test_multi_latent_attention_caches_one_latent_per_layer_on_every_rollout_rank():
    arch = ModelArchitecture(**{**UNSET, **DEEPSEEK_V3})
    assert kv_bytes_per_token(arch, 1) == kv_bytes_per_token(arch, 32) == 61 * (512 + 64) * 2


def test_a_deepseek_v3_config_is_sized_as_deepseek_v3_not_as_a_dense_model(tmp_path):
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
              "num_key_value_heads": 128, "intermediate_size": 18432, "vocab_size": 129280, "n_routed_experts": 256,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
              "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "num_nextn_predict_layers": 1, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = ModelArchitecture(**architecture_from_hf_config(tmp_path))
    assert (arch.num_experts, arch.shared_expert_intermediate_size, arch.mtp_layers) == (256, 2048, 1)
    assert model_size(arch).total == 671_026_404_352


def test_a_model_type_outside_the_size_model_is_not_estimated_and_says_why(cli, tmp_path):
    config = {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "num_local_experts": 128,
              "num_experts_per_tok": 4, "intermediate_size": 2880}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = cli("--model", str(tmp_path), "--device", "gpu", "--backend", "verl", "--dry-run",
               "--set", "cluster.devices_per_node=8", "--set", "engine.ep=8", "--set", "rollout.tp=8",
               "--set", "data.train_batch_size=8", "--set", "actor.ppo_mini_batch_size=8")
    assert done.returncode == 0, done.stderr
    assert "# memory plan: not estimated, model_type gpt_oss is not in the size model (it sizes llama," in done.stdout
    done = cli("--model", str(tmp_path), "--device", "gpu", "--suggest-layout")
    assert done.returncode == 2 and "model_type gpt_oss is not in the size model" in done.stderr


# --- the static part against Megatron-LM ------------------------------------------------------------------

def test_weights_gradients_and_optimizer_agree_with_megatron_lms_estimator():
    """bench/bench_megatron_static.py: Megatron-LM's compute_weight_and_optimizer_memory (main and
    core_v0.16.1, transcribed) on 13 layouts, dense and MoE with EP, MLA included."""
    found = rows()
    assert len(found) >= 12 and any(r["ep"] > 1 for r in found) and any(r["model"] == "DeepSeek-V3" for r in found)
    for r in found:
        assert abs(r["vs_main"] - 1) < 0.001, r
        if r["ep"] == 1:  # 0.16 has no expert parallelism: it agrees only where there is none
            assert abs(r["vs_016"] - 1) < 0.001, r
        else:
            assert r["vs_016"] < 0.7, r


# --- planner.enforce ---------------------------------------------------------------------------------

ONE_NODE_NO_OFFLOAD = ["--set", "cluster.nnodes=1", "--set", "engine.pp=1", "--set", "engine.param_offload=false",
                       "--set", "engine.optimizer_offload=false",
                       "--set", "engine.optimizer_overrides.optimizer_cpu_offload=false"]


def test_planner_enforce_false_turns_the_refusal_into_a_warning_in_the_dry_run_and_its_json(cli):
    refused = cli("--model", "qwen3.5-122b-a10b", "--device", "gpu", "--dry-run", *ONE_NODE_NO_OFFLOAD)
    assert refused.returncode == 2 and refused.stderr.startswith("error: the layout does not fit in memory: ")
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "gpu", "--dry-run", *ONE_NODE_NO_OFFLOAD,
               "--set", "planner.enforce=false")
    assert done.returncode == 0, done.stderr
    assert "#   warning: planner.enforce=false, planning goes on: the layout does not fit in memory: actor needs" in done.stdout
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "gpu", "--dry-run", "--json", *ONE_NODE_NO_OFFLOAD,
               "--set", "planner.enforce=false")
    memory = json.loads(done.stdout)["memory"]
    assert memory["fits"] is False and memory["enforced"] is False
    assert memory["warning"].startswith("planner.enforce=false, planning goes on: the layout does not fit in memory")


def test_the_report_of_a_run_planned_past_a_refusal_shows_the_warning(tmp_path):
    from grpo_pipeline.stages.report import write_report

    profile = resolve_run_profile("qwen3.5-122b-a10b", "gpu", overrides=[
        "cluster.nnodes=1", "engine.pp=1", "engine.param_offload=false", "engine.optimizer_offload=false",
        "engine.optimizer_overrides.optimizer_cpu_offload=false", "planner.enforce=false"])[0]
    text = write_report(tmp_path, profile=profile.model_dump(mode="json")).read_text()
    assert "## Memory plan" in text and "warning: planner.enforce=false, planning goes on: the layout does not fit" in text


def test_a_rollout_engine_may_span_whole_nodes_as_verl_allows():
    profile = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides=["rollout.tp=16"])
    assert profile.rollout.tp == 16
    assert next(r for r in estimate(profile).roles if r.when.startswith("KV cache")).parts["weights"] < 16 * GIB
