"""The memory planner's actor estimate (planner/memory.py) against the measured peak of real
megatron-core training steps (bench/megatron_memory_probe.py), side by side, config by config.

    python3 bench/bench_memory.py --out $OUT/memory.json          # one GPU: measures every run, then compares
    .venv/bin/python bench/bench_memory.py --results bench/results-h200-memory.json   # compare stored measurements

Each run is one device (TP = PP = 1, data parallel 1: Adam's state is not sharded), bf16, the
distributed optimizer, fp32 gradients, micro batch x sequence length, with or without full recompute.
The estimate is the actor role's update step for the same settings; the measurement is
`torch.cuda.max_memory_allocated` over training steps 2..n. Then the actor's log-prob pass (a no-grad
forward of the same micro batch, beside the weights, gradients and optimizer state still allocated)
against its measured peak. Prints estimate, measurement and their ratio; the goal is every ratio
within 0.85..1.15. RUNS are the probe's matrix, which the
activation terms were checked against; HELD_OUT were added after the estimator's last change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from megatron_memory_probe import RUNS, SHAPES, full_config, run_name  # noqa: E402

from grpo_pipeline.planner.activations import LOGITS_OLD_POLICY, LOGITS_REFERENCE  # noqa: E402
from grpo_pipeline.profiles.loader import resolve_run_profile  # noqa: E402
from grpo_pipeline.planner.memory import GIB, estimate  # noqa: E402


HELD_OUT = [
    {"shape": "qwen3-4b", "micro_batch": 2, "seq_len": 4096, "recompute": False},
    {"shape": "qwen3-0.6b", "micro_batch": 8, "seq_len": 2048, "recompute": False},
    {"shape": "qwen3-moe-4l", "micro_batch": 2, "seq_len": 4096, "recompute": True},
    {"shape": "qwen3-1.7b", "micro_batch": 4, "seq_len": 4096, "recompute": True},
]


def architecture(shape: dict) -> dict:
    """The probe's megatron-core shape as `model.architecture`."""
    arch = {"num_layers": shape["num_layers"], "num_attention_heads": shape["num_attention_heads"],
            "num_kv_heads": shape["num_query_groups"], "hidden_size": shape["hidden_size"],
            "vocab_size": shape["vocab_size"], "head_dim": shape["kv_channels"],
            "tie_word_embeddings": shape["tied"], "qk_norm": shape["qk_layernorm"]}
    if shape.get("num_experts"):
        arch |= {"num_experts": shape["num_experts"], "moe_intermediate_size": shape["moe_ffn_hidden_size"],
                 "num_experts_per_tok": shape["moe_router_topk"]}
    else:
        arch |= {"intermediate_size": shape["ffn_hidden_size"]}
    return arch


def estimated_bytes(config: dict) -> tuple[float, float, int]:
    """(the actor's update-step estimate, its log-prob pass estimate, the parameter count) for a probe config.
    The probe builds megatron-core's local layers (planner.layer_spec=local) and its optimizer is the
    config's (`optimizer_impl`: fused, or torch AdamW's foreach); its no-grad forward computes a plain
    cross entropy, as verl's reference pass does (logits x 6, not the old policy's x 8 with entropy)."""
    cfg = full_config(config)
    overrides = {
        "planner": {"layer_spec": "local", "adam": cfg.get("optimizer_impl", "fused")},
        "model": {"architecture": architecture(cfg)},
        "cluster": {"nnodes": 1, "devices_per_node": 1},
        "engine": {"transformer_overrides": {"recompute_granularity": "full", "recompute_num_layers": 1}
                   if cfg.get("recompute") else {}},
        "data": {"max_prompt_length": cfg["seq_len"] - 1, "max_response_length": 1},
        "actor": {"ppo_micro_batch_size_per_gpu": cfg["micro_batch"], "ppo_mini_batch_size": 1},
        "log_prob": {"micro_batch_size_per_gpu": cfg["micro_batch"]},
        "algorithm": {"rollout_n": cfg["micro_batch"]},
    }
    profile, _ = resolve_run_profile("tiny", "gpu", "verl", overrides=overrides, validate=False)
    plan = estimate(profile)
    *steps, log_probs = (r for r in plan.roles if r.role == "actor")  # update (and optimizer step), log-probs
    without_entropy = log_probs.total - log_probs.parts["logits"] * (1 - LOGITS_REFERENCE / LOGITS_OLD_POLICY)
    return max(step.total for step in steps), without_entropy, plan.parameters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="a stored list of probe results to compare instead of measuring")
    parser.add_argument("--out", help="write the side-by-side rows here (JSON)")
    args = parser.parse_args(argv)
    if args.results:
        measured = json.loads(Path(args.results).read_text())
        if isinstance(measured, dict):
            measured = measured["rows"]
        measured = [row.get("measured", row) for row in measured]
    else:
        from megatron_memory_probe import measure_in_subprocess

        measured = [measure_in_subprocess(run) for run in RUNS + HELD_OUT]
    rows = []
    print(f"{'run':42} {'params':>14} {'update: estimate':>16} {'measured GiB':>12} {'ratio':>6}"
          f" {'log-probs: estimate':>20} {'measured':>9} {'ratio':>6}")
    for result in measured:
        config = result.get("config") or {}
        if "error" in result or "peak_step_bytes" not in result:
            print(f"{run_name(config) if config else '?':42} failed: {result.get('error')}")
            continue
        update, log_probs, params = estimated_bytes(config)
        held_out = any(all(config.get(k) == v for k, v in run.items()) for run in HELD_OUT)
        row = {"run": run_name(config), "held_out": held_out, "parameters_estimated": params,
               "parameters_measured": result.get("parameters"),
               "estimate_gib": round(update / GIB, 2), "measured_gib": round(result["peak_step_bytes"] / GIB, 2),
               "ratio": round(update / result["peak_step_bytes"], 3),
               "log_probs_estimate_gib": round(log_probs / GIB, 2),
               "log_probs_measured_gib": round(result["forward_only_peak_bytes"] / GIB, 2),
               "log_probs_ratio": round(log_probs / result["forward_only_peak_bytes"], 3), "measured": result}
        rows.append(row)
        print(f"{row['run'] + (' (held out)' if held_out else ''):42} {params:>14,} {row['estimate_gib']:16.2f} "
              f"{row['measured_gib']:12.2f} {row['ratio']:6.3f} {row['log_probs_estimate_gib']:20.2f} "
              f"{row['log_probs_measured_gib']:9.2f} {row['log_probs_ratio']:6.3f}"
              + ("" if params == result.get("parameters") else f"  (model has {result.get('parameters'):,})"))
    for key in ("ratio", "log_probs_ratio"):
        if rows:
            ratios = [r[key] for r in rows]
            print(f"{key}: {len(rows)} runs, {min(ratios):.3f}..{max(ratios):.3f}; within +-15%: "
                  f"{sum(abs(x - 1) <= 0.15 for x in ratios)}/{len(rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "shapes": SHAPES}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
