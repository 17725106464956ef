"""The memory planner against runs other people published: each point of
bench/reference/published_runs.yaml (verl docs and example scripts, verl issues with OOMs, Ascend runs,
Megatron-only peaks; sources and assumed fields in the file, how they were found in published_runs.md)
set up as a profile, planned, and set beside its published outcome.

    .venv/bin/python bench/bench_planner_reference.py            # the table (Markdown)
    .venv/bin/python bench/bench_planner_reference.py --json     # the rows

A point's verdict, by its outcome:
- ran: the planner agrees when it does not refuse the layout;
- oom: it agrees when it does not call the layout a fit (the OOM's phase must be one the planner
  models: update, optimizer step, log-probs, rollout start or KV cache; an unknown phase counts as any);
- peak: it agrees when its figure for the published phase is within +-20% of the published peak and,
  for a run that also ran, it does not refuse it. A verl run's peak (`perf/max_memory_allocated_gb`) is
  the trainer process's lifetime peak: the largest of the actor's and the reference's rows, and, up to
  verl 0.6 (rollout mode `sync`, vLLM inside the trainer process), the vLLM start row too.
Not asserted (in the table with the planner's figure): Megatron-only and Megatron-Bridge training steps
(not verl: their loss kernel, gradient dtype and optimizer precision are not published, and the
planner's logits are verl's), and the points in NOT_ASSERTED. Out of scope (no figure): vLLM-only
profiles (the rollout row is the `gpu_memory_utilization` budget by construction), and points whose
settings were not published. FSDP points are planned with planner/fsdp.py (`engine.strategy: fsdp`).
A rollout that uses vLLM's expert or data parallelism (not a profile setting) is judged on the trainer's
rows only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_pipeline.errors import ProfileError  # noqa: E402
from grpo_pipeline.stages.plan import checked_profile  # noqa: E402
from grpo_pipeline.planner.memory import GIB, MemoryPlan, plan_for  # noqa: E402

REFERENCE = ROOT / "bench" / "reference" / "published_runs.yaml"
PEAK_TOLERANCE = 0.2

# Points the planner cannot be held to, and why (the rest of the out-of-scope points follow from
# their strategy or harness).
UNPUBLISHED = {
    "qwen3-30b-a3b-grpo-16gpu-muon-pr7120-adamw": "only the layout is published (batch, sequence, offload and "
    "recompute settings are not), and 'peak optimizer memory' is not defined",
    "qwen3.5-35b-a3b-grpo-62k-16xh20-oom": "the layout and batch settings are in the issue but could not be retrieved",
}
NOT_ASSERTED = {
    "qwen3-30b-a3b-dapo-64xh20-oom": "the same script ran on 1-4 nodes (the 8- and 32-GPU points); with Adam on the "
    "host its per-device memory does not depend on the node count, so no plan of the layout can call both; the "
    "OOM's message is only in a screenshot",
}
# Where the planner and the published outcome still disagree, and why (docs/memory-planner.md).
RECORDED_DISAGREEMENTS = {
    "qwen3-30b-a3b-dapo-8xh20": "no recompute at a 10240-token budget: 60.8 GiB of activations; fits only if they are "
    "<= 0.88x the estimate (TE's attention layers, calibrated here on the local spec only, are the likely excess)",
    "qwen3-30b-a3b-dapo-32xh20": "the same layout and budget per device as the 8-GPU run",
    "qwen3-235b-a22b-dapo-32xh20-norecompute": "no recompute, 8 micro batches in flight on an 11-layer first stage: "
    "fits only if activations are <= 0.84x the estimate; exact: false (no log of this version)",
    "qwen2.5-32b-grpo-8xh20-issue3124": "the same script ran four months earlier (the device-tuning point); with a fused "
    "Adam the step adds nothing and the static state is 68.7 GiB: the OOM is not explained by the layout",
    "qwen3-30b-a3b-gspo-16xa3-nightly": "sized at the 30720-token budget, the bound verl keeps (66.3 GiB on 58.0); it "
    "fits up to about 17k tokens a micro batch, which the CI data's responses (not recorded) may never reach",
    "qwen2.5-7b-grpo-8xh100-tp2-offload-static": "static micro batches sized at max_prompt + max_response (10240 "
    "tokens a sequence); the run's responses were shorter (not recorded); exact: false",
    "qwen2-7b-grpo-2xh800-fsdp": "FSDP2, static micro batches of 16 sized at max_prompt + max_response (2048 "
    "tokens a sequence: 76.7 GiB on 75.6, 56.8 of them the fp32 weights, gradients and Adam state verl "
    "loads back for the update); the refusal holds for that bound, and the plan fits up to about 1,870 tokens a sequence: with remove padding a micro batch holds only its real "
    "tokens, and GSM8K's prompts and responses (not recorded) stay far below that",
}
ACCELERATORS = {"H20": ("gpu", "H20"), "H100": ("gpu", "H100"), "H800": ("gpu", "H800"),
                "Atlas A3": ("npu", "Atlas A3"), "Atlas 910B3 (A2)": ("npu", "Atlas A2")}


@dataclass
class Row:
    id: str
    outcome: str
    published: str
    planner: str
    ratio: float | None
    verdict: str
    agrees: bool | None  # None: not asserted / out of scope
    exact: bool


def load_points(path: Path = REFERENCE) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())


def out_of_scope(point: dict[str, Any]) -> str | None:
    if point["harness"] == "vllm-rollout-only":
        return "vLLM only: the rollout row is the gpu_memory_utilization budget by construction"
    return UNPUBLISHED.get(point["id"])


# --- a point as a profile -------------------------------------------------------------------------

def _config_json(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The point's model numbers as the Hugging Face config.json a user's --model directory holds."""
    out = {"model_type": model_type}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "num_experts_per_tok", "moe_intermediate_size",
                "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_shared_experts", "attention_bias"):
        if config.get(key) is not None:
            out[key] = config[key]
    if config.get("head_dim") is None and "q_lora_rank" not in config:
        out["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if model_type in ("deepseek_v3", "glm4_moe"):
        out["n_routed_experts"] = config["n_routed_experts"]
        out["num_nextn_predict_layers"] = config.get("num_nextn_predict_layers", config.get("mtp_layers", 0))
        out.pop("head_dim", None)
    elif config.get("num_experts"):
        out["num_experts"] = config["num_experts"]
    return out


def _recompute(engine: dict[str, Any]) -> dict[str, Any]:
    recompute = engine.get("recompute")
    if isinstance(recompute, dict) and recompute.get("recompute_granularity") == "full":
        return {"recompute_granularity": "full", "recompute_method": recompute.get("recompute_method", "uniform"),
                "recompute_num_layers": recompute.get("recompute_num_layers", 1)}
    return {"recompute_granularity": None}


def _uneven(engine: dict[str, Any]) -> dict[str, Any]:
    """The point's uneven pipeline stages, as megatron-core's TransformerConfig names them."""
    uneven = engine.get("uneven_pp") or {}
    keys = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
            "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    return {key: uneven[key] for key in keys if uneven.get(key)}


def overrides_for(point: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(device kind, the profile settings) of a point."""
    c, e, r = point["cluster"], point["engine"], point.get("rollout") or {}
    device, accelerator = ACCELERATORS[c["accelerator"]]
    megatron_only = point["harness"] != "verl"
    platform: dict[str, Any] = {"accelerator": accelerator}
    if c.get("memory_gib_torch"):
        platform["device_memory_gib"] = c["memory_gib_torch"]
    transformer = {**_recompute(e), **{k: e[k] for k in ("moe_permute_fusion", "moe_grouped_gemm") if isinstance(e.get(k), bool)}}
    fusion = (e.get("other_overrides") or {}).get("bias_activation_fusion")
    if fusion is not None:
        transformer["bias_activation_fusion"] = fusion
    if e.get("strategy") == "fsdp":
        return device, _fsdp_settings(point, platform)
    engine: dict[str, Any] = {"tp": e["tp"], "pp": e["pp"], "vpp": e.get("vpp"), "cp": e.get("cp", 1),
                              "ep": e.get("ep", 1), "etp": e.get("etp") or 1,
                              "param_offload": bool(e.get("param_offload")),
                              "optimizer_offload": bool(e.get("optimizer_offload")),
                              "use_remove_padding": bool(e.get("use_remove_padding", True)),
                              "transformer_overrides": transformer,
                              "optimizer_overrides": {
                                  "optimizer_cpu_offload": bool(e.get("optimizer_cpu_offload")),
                                  "optimizer_offload_fraction": e.get("optimizer_offload_fraction") or 0,
                                  "use_precision_aware_optimizer": bool(e.get("use_precision_aware_optimizer"))}}
    engine.update(_uneven(e))
    if megatron_only:  # one training step: micro batch x seq_len, global batch over the data-parallel ranks
        sequences, length = e["global_batch_size"], e["seq_len"]
        data = {"train_batch_size": sequences, "max_prompt_length": length - 1, "max_response_length": 1}
        actor = {"ppo_mini_batch_size": sequences, "ppo_micro_batch_size_per_gpu": e["micro_batch_size"],
                 "use_dynamic_bsz": False}
        algorithm = {"rollout_n": 1, "use_kl_loss": False}
        log_prob = {"micro_batch_size_per_gpu": e["micro_batch_size"]}
        rollout = {"tp": min(c["devices_per_node"], 8), "max_model_len": None}
    else:
        dynamic = bool(e.get("use_dynamic_bsz"))
        data = {"train_batch_size": e["train_batch_size"], "max_prompt_length": e["max_prompt_length"],
                "max_response_length": e["max_response_length"]}
        actor = {"ppo_mini_batch_size": e["ppo_mini_batch_size"], "use_dynamic_bsz": dynamic,
                 "ppo_micro_batch_size_per_gpu": e.get("ppo_micro_batch_size_per_gpu") or 1,
                 "ppo_max_token_len_per_gpu": e.get("ppo_max_token_len_per_gpu") or 16384}
        algorithm = {"rollout_n": e["rollout_n"], "use_kl_loss": bool(e.get("reference_model")),
                     "entropy_coeff": e.get("entropy_coeff") or 0}
        log_prob = {"micro_batch_size_per_gpu": e.get("log_prob_micro_batch_size_per_gpu") or 1,
                    "use_dynamic_bsz": dynamic,
                    "max_token_len_per_gpu": e.get("log_prob_max_token_len_per_gpu") or actor["ppo_max_token_len_per_gpu"]}
        rollout = {"tp": r["tp"], "gpu_memory_utilization": r["gpu_memory_utilization"],
                   "max_num_seqs": r.get("max_num_seqs", 256), "max_model_len": r.get("max_model_len")}
    settings = {"backend": "verl", "platform": platform, "cluster": {"nnodes": c["nnodes"],
                "devices_per_node": c["devices_per_node"]}, "engine": engine, "data": data, "actor": actor,
                "algorithm": algorithm, "log_prob": log_prob, "rollout": rollout}
    return device, settings


def _fsdp_settings(point: dict[str, Any], platform: dict[str, Any]) -> dict[str, Any]:
    """An FSDP point's profile settings (verl's FSDP example scripts)."""
    c, e, r = point["cluster"], point["engine"], point.get("rollout") or {}
    dynamic = bool(e.get("use_dynamic_bsz"))
    budget = e.get("ppo_max_token_len_per_gpu") or 16384
    return {"backend": "verl", "platform": platform,
            "cluster": {"nnodes": c["nnodes"], "devices_per_node": c["devices_per_node"]},
            "engine": {"strategy": "fsdp", "param_offload": bool(e.get("param_offload")),
                       "optimizer_offload": bool(e.get("optimizer_offload")),
                       "use_remove_padding": bool(e.get("use_remove_padding", True)),
                       "ulysses_sp": e.get("ulysses_sequence_parallel_size") or 1,
                       **({"attn_implementation": "flash_attention_2"} if (e.get("ulysses_sequence_parallel_size") or 1) > 1 else {})},
            "model": {"enable_gradient_checkpointing": bool(e.get("gradient_checkpointing"))},
            "data": {"train_batch_size": e["train_batch_size"], "max_prompt_length": e["max_prompt_length"],
                     "max_response_length": e["max_response_length"]},
            "actor": {"ppo_mini_batch_size": e["ppo_mini_batch_size"], "use_dynamic_bsz": dynamic,
                      "ppo_micro_batch_size_per_gpu": e.get("ppo_micro_batch_size_per_gpu") or 1,
                      "ppo_max_token_len_per_gpu": budget},
            "algorithm": {"rollout_n": e["rollout_n"], "use_kl_loss": bool(e.get("use_kl_loss")),
                          "entropy_coeff": e.get("entropy_coeff") or 0},
            "log_prob": {"micro_batch_size_per_gpu": e.get("log_prob_micro_batch_size_per_gpu") or 1,
                         "use_dynamic_bsz": dynamic, "max_token_len_per_gpu": e.get("log_prob_max_token_len_per_gpu") or budget},
            "rollout": {"tp": r["tp"], "gpu_memory_utilization": r["gpu_memory_utilization"],
                        "max_num_seqs": r.get("max_num_seqs", 256), "max_model_len": r.get("max_model_len")}}


def profile_for(point: dict[str, Any], scratch: Path):
    """The point's RunProfile (validated as planning validates it), or a ProfileError."""
    device, settings = overrides_for(point)
    model = point["model"]
    if model.get("recipe"):
        name = model["recipe"]
    else:
        name = str(scratch / point["id"])
        Path(name).mkdir(parents=True, exist_ok=True)
        (Path(name) / "config.json").write_text(json.dumps(_config_json(model["config"], model["model_type"])))
    return checked_profile(name, device, "verl", overrides=settings)[0]


# --- the verdict ----------------------------------------------------------------------------------

def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def rollout_in_trainer(point: dict[str, Any]) -> bool:
    """vLLM runs inside the trainer process: rollout mode `sync`, verl's default up to 0.6."""
    if mode := (point.get("rollout") or {}).get("mode"):
        return mode == "sync"
    minor = re.search(r"0\.(\d+)", str(point.get("verl_version")))
    return bool(minor) and int(minor.group(1)) < 7


def rollout_expressible(point: dict[str, Any]) -> bool:
    return not {"ep", "dp"} & set(point.get("rollout") or {})


def compared_rows(point: dict[str, Any], plan: MemoryPlan):
    """The planner's rows for the phase a published peak covers."""
    if point["harness"] != "verl":  # one Megatron training step
        return [r for r in plan.roles if r.role == "actor" and r.when.startswith(("update", "optimizer step"))]
    rows = [r for r in plan.roles if r.role in ("actor", "reference")]
    if rollout_in_trainer(point):
        rows += [r for r in plan.roles if r.role == "rollout" and r.when.startswith("vLLM start")]
    return rows


def judged_rows(point: dict[str, Any], plan: MemoryPlan):
    """The rows whose fit decides the verdict: every row of a verl run (the trainer's alone when its
    rollout cannot be expressed), the update rows of a Megatron-only step."""
    if point["harness"] != "verl":
        return compared_rows(point, plan)
    return [r for r in plan.roles if rollout_expressible(point) or r.role != "rollout"]


def evaluate(point: dict[str, Any], scratch: Path) -> Row:
    outcome = point["outcome"]
    published = {"ran": "ran", "oom": f"OOM ({point.get('oom_where', 'unknown')})"}.get(
        outcome, f"peak {point.get('peak_gib')} GiB")
    base = {"id": point["id"], "outcome": outcome, "published": published, "exact": bool(point.get("exact"))}
    if reason := out_of_scope(point):
        return Row(**base, planner="-", ratio=None, verdict=f"out of scope: {reason}", agrees=None)
    try:
        profile = profile_for(point, scratch)
    except ProfileError as exc:
        refused = str(exc)
        return _judge(point, base, f"refused as invalid: {refused[:160]}", refused=True, ratio=None)
    plan = plan_for(profile)
    if plan is None:
        return _judge(point, base, "not estimated (the size model does not know the model)", refused=False,
                      ratio=None, estimated=False)
    judged = judged_rows(point, plan)
    fits = all(r.fits for r in judged)
    worst = max(judged, key=lambda r: (not r.fits, r.total / r.capacity if r.capacity else 0))
    summary = (f"fits (tightest: {worst.role} {_gib(worst.total)} of {_gib(worst.capacity)} GiB)" if fits
               else f"refused: {worst.role} {_gib(worst.total)} > {_gib(worst.capacity)} GiB ({worst.when})")
    ratio = None
    if outcome == "peak":
        rows = compared_rows(point, plan)
        figure = max(r.total for r in rows)
        ratio = figure / (point["peak_gib"] * GIB)
        summary = f"{_gib(figure)} GiB ({max(rows, key=lambda r: r.total).when}); " + summary
    return _judge(point, base, summary, refused=not fits, ratio=ratio)


def _judge(point, base, planner: str, refused: bool, ratio: float | None, estimated: bool = True) -> Row:
    outcome = point["outcome"]
    if reason := NOT_ASSERTED.get(point["id"]) or (None if point["harness"] == "verl" else
                                                    f"a {point['harness']} training step, not a verl run"):
        return Row(**base, planner=planner, ratio=None if ratio is None else round(ratio, 3),
                   verdict=f"not asserted: {reason}", agrees=None)
    if outcome == "ran":
        agrees = not refused
        verdict = "agrees: not refused" if agrees else "DISAGREES: a documented working run is refused"
    elif outcome == "oom":
        agrees = refused
        verdict = "agrees: not called a fit" if agrees else (
            "DISAGREES: a documented OOM is called a fit" if estimated else "DISAGREES: not estimated")
    else:
        in_range = ratio is not None and abs(ratio - 1) <= PEAK_TOLERANCE
        agrees = in_range and not (refused and point.get("also_ran"))
        verdict = ("agrees: within +-20%" if agrees else
                   "DISAGREES: " + ("refused, but it ran" if in_range else "outside +-20%" if ratio else "no figure"))
    if not agrees and point["id"] in RECORDED_DISAGREEMENTS:
        verdict += f" ({RECORDED_DISAGREEMENTS[point['id']]})"
    return Row(**base, planner=planner, ratio=None if ratio is None else round(ratio, 3), verdict=verdict, agrees=agrees)


def evaluate_all(points: list[dict[str, Any]] | None = None) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="planner-reference-") as scratch:
        return [evaluate(point, Path(scratch)) for point in points or load_points()]


def table(rows: list[Row]) -> list[str]:
    asserted = [r for r in rows if r.agrees is not None]
    lines = [f"{sum(r.agrees for r in asserted)} of {len(asserted)} asserted points agree "
             f"({len(rows) - len(asserted)} out of scope or not asserted)", "",
             "| point | exact | published | planner | ratio | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"| {r.id} | {'yes' if r.exact else 'no'} | {r.published} | {r.planner} | {ratio} | {r.verdict} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    rows = evaluate_all()
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else "\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
