"""The memory and layout planner: model sizes from the recorded architectures, per-role estimates,
refusals at planning, and the layout search."""

from __future__ import annotations

import json

import pytest

from grpo_pipeline.planner.layouts import parallel_dims, suggest_layouts
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.profiles.loader import resolve_run_profile
from grpo_pipeline.planner.memory import Layout, estimate
from grpo_pipeline.profiles.model_size import model_size
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.stages.model import verify_hf_dir

# The 122B on one 8-GPU node with nothing offloaded (EP 8 over the node's 8 GPUs).
ONE_NODE_NO_OFFLOAD = ["--set", "cluster.nnodes=1", "--set", "engine.pp=1", "--set", "engine.param_offload=false",
                       "--set", "engine.optimizer_offload=false",
                       "--set", "engine.optimizer_overrides.optimizer_cpu_offload=false"]


@pytest.mark.parametrize("model, total, active", [
    ("qwen3.5-122b-a10b", 122e9, 10e9),
    ("qwen3.5-35b-a3b", 35e9, 3e9),
])
def test_the_recorded_architectures_give_the_published_sizes(model, total, active):
    size = model_size(resolve_profile(model, "gpu").model.architecture)
    assert abs(size.total - total) / total < 0.02
    assert abs(size.active - active) / active < 0.16  # "A10B", "A3B": rounded to whole billions


@pytest.mark.e2e  # converts the real demo model (smollm2_dir: about 30 s)
def test_smollm2_and_tiny_are_counted_exactly_as_their_checkpoints_hold_them(smollm2_dir, tiny_model_dir):
    assert model_size(resolve_profile("smollm2-135m", "cpu").model.architecture).total == 134_515_008
    assert verify_hf_dir(smollm2_dir)["num_parameters"] == 134_515_008
    tiny = model_size(resolve_profile("tiny", "cpu").model.architecture).total
    assert tiny == verify_hf_dir(tiny_model_dir)["num_parameters"]


def test_a_model_directory_gives_what_a_size_needs(tiny_model_dir, tmp_path):
    profile = resolve_profile(str(tiny_model_dir), "cpu")
    assert model_size(profile.model.architecture).total == verify_hf_dir(tiny_model_dir)["num_parameters"]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({
        **config, "model_type": "qwen3_5_moe", "num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 32, "full_attention_interval": 2, "linear_num_key_heads": 4,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}))
    arch = resolve_run_profile(str(moe), "gpu", "verl", validate=False)[0].model.architecture
    assert (arch.attention_output_gate, arch.qk_norm, arch.full_attention_interval, arch.num_experts_per_tok) == (True, True, 2, 2)
    size = model_size(arch)
    assert (size.attention_layers, size.linear_layers) == (1, 1) and size.experts == 8 * 3 * 64 * 32


@pytest.mark.parametrize("model, device", [("qwen3.5-122b-a10b", "gpu"), ("qwen3.5-122b-a10b", "npu"),
                                           ("qwen3.5-35b-a3b", "gpu"), ("qwen3.5-35b-a3b", "npu")])
def test_the_upstream_recipes_fit(model, device):
    plan = estimate(resolve_profile(model, device))
    assert plan.fits, plan.problems()
    roles = {role.role for role in plan.roles}
    assert roles >= {"actor", "rollout", "host"}
    assert ("reference" in roles) == resolve_profile(model, device).uses_reference_model


def test_a_layout_that_cannot_fit_is_refused_at_planning_with_role_numbers_and_fix(cli):
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "gpu", "--dry-run", *ONE_NODE_NO_OFFLOAD)
    assert done.returncode == 2 and done.stdout == ""
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("error: the layout does not fit in memory: actor needs ")
    assert "GiB per device (update, micro batch 1 x 7336 tokens, full recompute) but one H20 device has 91.6 GiB" in line
    assert "--suggest-layout" in line  # the fix
    assert "rollout needs" in line and "set engine.param_offload=true" in line


def test_the_dry_run_shows_the_table_and_json_carries_it(cli):
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "# memory plan" in done.stdout and "| actor | update, micro batch 1 x 7336 tokens" in done.stdout
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run", "--json")
    memory = json.loads(done.stdout)["memory"]
    assert memory["device"] == "Atlas A3" and memory["device_memory_gib"] == 64.0 and memory["fits"]
    actor = memory["roles"][0]
    assert actor["role"] == "actor" and 0 < actor["estimate_gib"] <= actor["capacity_gib"]
    assert set(actor["parts_gib"]) >= {"weights", "gradients", "optimizer", "activations", "logits"}
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--dry-run",
               "--set", "model.architecture.moe_intermediate_size=null")
    assert "# memory plan: not estimated, the model's size needs model.architecture.moe_intermediate_size" in done.stdout


def test_each_setting_moves_its_part_of_the_estimate():
    base = resolve_profile("qwen3.5-122b-a10b", "gpu")
    plan = estimate(base)
    actor = plan.roles[0].parts
    more_pp = estimate(base, Layout.of(base).__class__(**{**Layout.of(base).__dict__, "pp": 4})).roles[0].parts
    assert more_pp["weights"] < actor["weights"] and more_pp["gradients"] < actor["gradients"]
    no_recompute = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides={"engine": {"transformer_overrides": {
        "recompute_granularity": None}}})
    assert estimate(no_recompute).roles[0].parts["activations"] > 5 * actor["activations"]
    interleaved = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides={"engine": {"vpp": 2}})
    assert estimate(interleaved).roles[0].parts["activations"] > actor["activations"]
    kept = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides={"engine": {"param_offload": False}})
    start = next(r for r in estimate(kept).roles if r.role == "rollout")
    assert start.parts["trainer resident"] > 0 and not start.fits
    assert next(r for r in plan.roles if r.role == "rollout").parts["trainer resident"] == 0


def test_a_kv_cache_too_small_for_one_sequence_is_named_with_the_rollout_fix():
    profile = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides={"rollout": {"gpu_memory_utilization": 0.2}})
    problems = estimate(profile).problems()
    assert len(problems) == 1 and problems[0].startswith("rollout needs ")
    assert "KV cache: 0 sequence(s) of 15768 tokens fit" in problems[0] and "lower rollout.max_model_len" in problems[0]


def test_host_memory_is_checked_when_known():
    profile = resolve_profile("qwen3.5-122b-a10b", "gpu", overrides={"platform": {"host_memory_gib": 256}})
    problems = estimate(profile).problems()
    assert len(problems) == 1 and problems[0].startswith("host needs ") and "one node's host memory has 256.0 GiB" in problems[0]


def test_device_memory_comes_from_the_override_then_detection_then_the_accelerator():
    platform = resolve_profile("qwen3.5-122b-a10b", "gpu").platform
    assert platform.device_memory() == ("H20", 95.6, "platform.accelerator H20")
    assert platform.device_memory(["NVIDIA H200"], [139.7])[:2] == ("H200", 139.7)
    assert platform.device_memory(["NVIDIA H20"], [95.0])[0] == "H20"
    fixed = platform.model_copy(update={"device_memory_gib": 80.0})
    assert fixed.device_memory(["NVIDIA H200"], [139.7])[1:] == (80.0, "platform.device_memory_gib")
    # A detected H200 lets a layout an H20 refuses through.
    h200 = DeviceInfo(kind="gpu", count=8, names=["NVIDIA H200"] * 8, memory_gib=[139.7] * 8, decided_by="detected", reason="")
    profile = resolve_run_profile("qwen3.5-122b-a10b", "gpu", validate=False, overrides={
        "engine": {"transformer_overrides": {"recompute_granularity": None}}, "actor": {"ppo_micro_batch_size_per_gpu": 2}})[0]
    assert not estimate(profile).fits and h200.memory_plan(profile).roles[0].fits


@pytest.mark.parametrize("device, nodes", [("gpu", 4), ("npu", 4)])
def test_suggest_layout_finds_the_upstream_layout_and_only_layouts_that_validate_and_fit(device, nodes):
    profile = resolve_profile("qwen3.5-122b-a10b", device)
    suggestions, facts = suggest_layouts(profile)
    assert facts["fit"] == len(suggestions) > 0
    assert parallel_dims(Layout.of(profile)) in {parallel_dims(s.layout) for s in suggestions}
    assert [s.seconds for s in suggestions] == sorted(s.seconds for s in suggestions)
    for suggestion in suggestions[:5]:  # each one, set on the command line, passes validation and fits
        settings = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in suggestion.settings().items()]
        checked = resolve_profile("qwen3.5-122b-a10b", device, overrides=settings)
        assert estimate(checked).fits


def test_suggest_layout_command(cli):
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "npu", "--suggest-layout", "--set", "cluster.nnodes=2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("qwen3.5-122b-a10b on 2 x 16 Atlas A3: ")
    assert "| 1 |" in done.stdout and "best: --set engine.tp=" in done.stdout
    # The recipe's own layout (EP 16 over 32 devices in 4 stages) does not validate on 2 nodes; the search still runs.
    assert "the profile's layout (TP 2 PP 4 CP 1 EP 16 ETP 1): does not fit or does not validate here" in done.stdout
    done = cli("--model", "qwen3.5-122b-a10b", "--device", "gpu", "--suggest-layout", "--json",
                   "--set", "cluster.nnodes=1", "--set", "cluster.devices_per_node=2")
    assert done.returncode == 2 and json.loads(done.stdout)["layouts"] == []
    assert done.stderr.startswith("error: no layout of qwen3.5-122b-a10b fits 1 x 2 H20 devices")
    done = cli("--model", "tiny", "--device", "cpu", "--suggest-layout")
    assert done.returncode == 2 and "pass --device gpu or --device npu" in done.stderr


def test_the_estimates_stay_within_15_percent_of_the_peaks_measured_on_the_h200():
    """bench/results-h200-memory.json: megatron-core training steps measured on an H200
    (`python3 bench/bench_memory.py`); the estimator's formulas must keep agreeing with them."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    from bench_memory import estimated_bytes

    rows = json.loads((bench / "results-h200-memory.json").read_text())["rows"]
    assert len(rows) >= 17 and {r["held_out"] for r in rows} == {True, False}
    for row in rows:
        measured = row["measured"]
        update, log_probs, parameters = estimated_bytes(measured["config"])
        assert parameters == measured["parameters"], row["run"]
        assert 0.85 <= update / measured["peak_step_bytes"] <= 1.15, row["run"]
        assert 0.85 <= log_probs / measured["forward_only_peak_bytes"] <= 1.15, row["run"]


def test_the_report_of_a_verl_run_shows_its_memory_plan(tmp_path):
    from grpo_pipeline.stages.report import write_report

    profile = resolve_profile("qwen3.5-35b-a3b", "gpu").model_dump(mode="json")
    device = {"kind": "gpu", "count": 8, "names": ["NVIDIA H200"] * 8, "memory_gib": [139.8] * 8,
              "decided_by": "detected", "reason": "CUDA sees 8 GPU(s)"}
    text = write_report(tmp_path, profile=profile, device=device).read_text()
    assert "## Memory plan" in text and "device H200: 139.8 GiB" in text and "| reference | log-probs" in text
    local = resolve_profile("tiny", "cpu").model_dump(mode="json")
    assert "## Memory plan" not in write_report(tmp_path / "local", profile=local).read_text()
