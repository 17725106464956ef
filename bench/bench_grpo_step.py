"""A whole GRPO step of the local backend split into its phases, each beside its hardware floor.

    .venv/bin/python bench/bench_grpo_step.py --device cpu --model tiny --steps 3 --warmup 1   # checked on CPU
    python3 bench/bench_grpo_step.py --device gpu --model qwen3-0.6b,qwen3-1.7b,qwen3-4b --out $OUT/step.json
    python3 bench/bench_grpo_step.py --device gpu --model qwen3-1.7b --variant plain=engine.use_remove_padding=false \\
        --variant packed=engine.use_remove_padding=true      # a lever off and on, side by side in one run

The pipeline's own step: `train_local` (a Ray Train worker running TRL's GRPOTrainer with the profile's
generation settings) with `phase_timing` on, which times TRL's methods of that trainer
(backends/local/phases.py): generation, weight sync into the native decoder, old-policy and reference
log-probs, forward+backward, optimizer, and everything else. Random Qwen3-shape weights (only time
matters), arith prompts lengthened to about `--prompt-length` tokens, every completion exactly
`--completion-length` tokens (end-of-sequence ignored), one optimizer step per generation round
(`steps_per_generation=1`, the mini batch = the batch), so one step = one round.

Floors, from the copy bandwidth and bf16 matmul rate measured in the same run (bench_decode_floor's
`ceilings`; on the CPU a quick measurement of its own): forward+backward 6 x params x tokens, a log-prob
pass 2 x params x tokens, the optimizer 16 bytes a parameter read and 16 written (bf16 weight and
gradient, fp32 moments), weight sync the packed q/k/v and gate/up bytes read and written once,
generation the decode floor of bench_decode_floor (per decode step, times the new tokens). `other` has
no floor. Tokens are the real ones (prompts + completions, no padding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from grpo_pipeline.backends.local.phases import PHASES  # noqa: E402
from grpo_pipeline.backends.local.settings import plan_local_training, prompt_length  # noqa: E402
from grpo_pipeline.data.rl_data import arith_splits  # noqa: E402
from grpo_pipeline.generation.plan import plan_generation  # noqa: E402
from grpo_pipeline.profiles.loader import resolve_profile  # noqa: E402
from grpo_pipeline.run.folder import RunFolder

SHAPES = {  # Qwen3 shapes: hidden, MLP, layers, attention heads, KV heads (head_dim 128)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    # Qwen3 up to 4B ties the head to the embedding; 8B does not.
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
MAX_POSITIONS = 8192
LENT_H100_GIB = 79.18  # torch's total_memory of the lent H100 80GB HBM3 (2026-12-07)
FILLER = " Read the problem again and keep every number in mind."


def shape_config(shape: str, vocab: int, tokenizer):
    """The Qwen3 config of a shape, with the bench's vocabulary and context and the tiny tokenizer's ids."""
    from transformers import Qwen3Config

    return Qwen3Config(**{"tie_word_embeddings": True, **SHAPES[shape]}, vocab_size=vocab,
                       max_position_embeddings=MAX_POSITIONS, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)


def make_model(shape: str, vocab: int, out: Path, dtype: str, device: str):
    import torch
    from transformers import Qwen3ForCausalLM

    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(512, seed=0)
    config = shape_config(shape, vocab, tokenizer)
    torch.manual_seed(0)
    with torch.device(device):  # a 4B model's random init takes minutes on the host
        model = Qwen3ForCausalLM._from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def long_prompts(tokenizer, count: int, target: int) -> pa.Table:
    """`count` arith rows whose user message is lengthened with filler to about `target` tokens."""
    table = arith_splits(count, 8, seed=0)["train"]
    rows = table.to_pylist()
    for row in rows:
        message = row["prompt"][-1]
        while prompt_length(tokenizer, row["prompt"]) < target:
            message["content"] += FILLER
    return pa.Table.from_pylist(rows, schema=table.schema)


def rates(device: str) -> dict:
    """Copy bandwidth (bytes read + written per second) and matmul rate, measured here."""
    import torch

    if device == "cuda":
        from bench_decode_floor import ceilings

        return ceilings("cuda")
    src, a = torch.randn(2**24), torch.randn(1024, 1024)
    dst, b = torch.empty_like(src), torch.randn_like(a)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    matmul = min(_timed(lambda: a @ b) for _ in range(3))
    return {"copy_tb_s": round(2 * src.numel() * 4 / copy / 1e12, 4), "bf16_tflop_s": round(2 * 1024**3 / matmul / 1e12, 4),
            "measured": True, "note": "CPU: float32 copy and matmul"}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def floors(model, prompt_lengths: list[int], new_tokens: int, limits: dict) -> dict:
    """Seconds each phase of one step takes at the measured rates."""
    from bench_decode_floor import floor as decode_floor

    params = sum(p.numel() for p in model.parameters())  # tied embeddings once (the head's matmul)
    tokens = sum(prompt_lengths) + len(prompt_lengths) * new_tokens
    flop_s, copy_b_s = limits["bf16_tflop_s"] * 1e12, limits["copy_tb_s"] * 1e12
    element = next(model.parameters()).element_size()
    packed = sum(m.weight.numel() for layer in model.model.layers
                 for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.mlp.gate_proj, layer.mlp.up_proj))
    step = decode_floor(model, prompt_lengths, new_tokens, limits)["floor_ms"] / 1e3
    return {
        "generation": step * new_tokens,
        "weight_sync": 2 * packed * element / copy_b_s,
        "old_logprobs": 2 * params * tokens / flop_s,
        "ref_logprobs": 2 * params * tokens / flop_s,
        "forward_backward": 6 * params * tokens / flop_s,
        "optimizer": 32 * params / copy_b_s,
        "params": params, "tokens": tokens,
    }


def step_overrides(args, variant: list[str]) -> list[str]:
    completions = args.prompts * args.generations
    return [
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        *([f"actor.ppo_micro_batch_size_per_gpu={min(args.micro, completions)}"] if args.micro else []),
        f"algorithm.rollout_n={args.generations}",
        f"data.max_response_length={args.completion_length}", f"data.max_prompt_length={args.prompt_length + 64}",
        f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={args.steps}", "cluster.devices_per_node=1",
        "generation.steps_per_generation=1", *args.set, *variant]


class CellDoesNotFit(Exception):
    """The planner's step for a cell is larger than the device: the cell is recorded as such, not run."""


def step_profile(args, model_dir: Path, overrides: list[str], sized: bool = True):
    """The profile of the model's own directory (its shape, its context length), refused here as the flow
    would refuse it: the first H100 loan lost this bench to the `tiny` recipe's 512-token context. On a
    device of known memory the micro batch and recomputation are the planner's for it, as the flow sizes
    them (backends/local/sizing.py), around what --micro and the overrides give: the second H100 loan lost
    Qwen3-4B to an out-of-memory error at micro batch 16, a step the plan puts at 105 GiB."""
    from grpo_pipeline.backends.local.sizing import size_step
    from grpo_pipeline.profiles.validation import profile_problems, refuse

    profile = resolve_profile(str(model_dir), args.device, overrides=overrides)
    refuse(profile_problems(profile))
    if not sized or args.device_gib is None:
        return profile
    given = frozenset(item.split("=", 1)[0] for item in overrides)
    sizing = size_step(profile, plan_generation(profile), detected_gib=[args.device_gib], given=given)
    if sizing is None:
        return profile
    if not sizing.fits:
        raise CellDoesNotFit(f"micro batch {sizing.micro_batch} needs {sizing.needed / 2**30:.1f} GiB of "
                             f"{sizing.usable / 2**30:.1f} GiB usable")
    layer = [f"actor.ppo_micro_batch_size_per_gpu={sizing.micro_batch}",
             f"model.enable_gradient_checkpointing={str(sizing.checkpointing).lower()}"]
    return resolve_profile(str(model_dir), args.device, overrides=[*overrides, *layer])


def dry_run(args, variants: list[tuple[str, list[str]]], settings: list[tuple[str, int]], work: Path) -> int:
    """Every cell's profile planned from a config-only copy of each shape (no weights): what the GPU
    command would refuse minutes into a lease is refused here, on the CPU."""
    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(512, seed=0)
    cells = 0
    for shape in args.model.split(","):
        model_dir = work / shape
        shape_config(shape, args.vocab, tokenizer).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        for _, new_tokens in settings:
            args.completion_length = new_tokens
            for name, overrides in variants:
                try:
                    profile = step_profile(args, model_dir, step_overrides(args, overrides))
                except CellDoesNotFit as exc:
                    print(f"{shape} {args.prompt_length}+{new_tokens} {name}: does not fit: {exc}")
                    continue
                print(f"{shape} {args.prompt_length}+{new_tokens} {name}: micro batch "
                      f"{profile.actor.ppo_micro_batch_size_per_gpu}, gradient checkpointing "
                      f"{'on' if profile.model.enable_gradient_checkpointing else 'off'}")
                cells += 1
    print(f"dry run: {cells} cells planned")
    return cells


class OutOfMemory(Exception):
    """The device ran out of memory in a cell's step."""


def run_variant(args, shape: str, variant: str, overrides: list[str], model_dir: Path, train_file: Path,
                work: Path, sized: bool = True) -> tuple[list[dict], float | None, object]:
    import ray

    from grpo_pipeline.backends.base import TrainingInterrupted
    from grpo_pipeline.backends.local.driver import train_local

    overrides = step_overrides(args, overrides)
    profile = step_profile(args, model_dir, overrides, sized)
    run_dir = work / f"run-{shape}-{variant}"
    settings = plan_local_training(profile, [str(train_file)], str(model_dir), run_dir, 1, plan_generation(profile))
    full_length = settings.grpo.model_copy(update={"generation_kwargs": {"min_new_tokens": args.completion_length}})
    settings = settings.model_copy(update={"phase_timing": True, "grpo": full_length})  # every completion full length
    try:
        train_local(settings, None, None, run_name="bench-step")
    except TrainingInterrupted as exc:
        if "OutOfMemoryError" not in str(exc):
            raise
        raise OutOfMemory(f"out of memory at micro batch {profile.actor.ppo_micro_batch_size_per_gpu}: {exc}"[:300]) from exc
    finally:
        ray.shutdown()
    records = [json.loads(line) for line in (run_dir / RunFolder.PHASES).read_text().splitlines()]
    return records[args.warmup:], predicted_peak_gib(profile, settings), profile


def probe_larger(args, shape: str, variant: str, overrides: list[str], profile, model_dir: Path, train_file: Path,
                 work: Path) -> dict | None:
    """The planner's next micro batch (the candidates it chose among) run anyway, the planner not asked: does
    the largest it said fits end where the device does? None where the planner's was the largest candidate."""
    from grpo_pipeline.backends.local.sizing import micro_batch_candidates

    micro = profile.actor.ppo_micro_batch_size_per_gpu
    larger = [m for m in micro_batch_candidates(profile) if m > micro]
    if not larger:
        return None
    pinned = [*overrides, f"actor.ppo_micro_batch_size_per_gpu={larger[0]}",
              f"model.enable_gradient_checkpointing={str(profile.model.enable_gradient_checkpointing).lower()}"]
    try:
        records, planned, _ = run_variant(args, shape, f"{variant}-next", pinned, model_dir, train_file, work,
                                          sized=False)
    except OutOfMemory:
        return {"micro_batch": larger[0], "outcome": "out of memory"}
    measured = max((r["peak_gib"] for r in records if "peak_gib" in r), default=None)
    return {"micro_batch": larger[0], "outcome": "fits", "peak_gib": {"measured": measured, "planned": planned}}


def predicted_peak_gib(profile, settings) -> float | None:
    """The memory plan's peak for the step as run (backends/local/train_memory.py) on this device: the
    profile of the model's own directory (its architecture) with the run's settings."""
    import torch

    from grpo_pipeline.backends.local.train_memory import step_memory

    if not torch.cuda.is_available():
        return None
    try:
        checkpointing = settings.grpo.gradient_checkpointing
        plan = step_memory(profile, plan_generation(profile), checkpointing,
                           torch.cuda.get_device_properties(0).total_memory)
    except Exception as exc:  # noqa: BLE001 - a prediction that cannot be made is reported, not fatal
        print(f"memory plan: no prediction ({type(exc).__name__}: {exc})", flush=True)
        return None
    return round(plan.total / 2**30, 3) if plan else None


def table(result: dict) -> str:
    lines = ["| model | setting | variant | phase | ms | floor ms | x floor |", "|---|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        if not cell.get("fits", True):
            lines.append(f"| {cell['model']} | {cell['setting']} | {cell['variant']} | does not fit: {cell['why']} | | | |")
        for phase, row in cell.get("phases", {}).items():
            ratio = f"{row['x_floor']:.2f}" if row.get("x_floor") else ""
            floor = f"{row['floor_ms']:.1f}" if row.get("floor_ms") is not None else ""
            lines.append(f"| {cell['model']} | {cell['setting']} | {cell['variant']} | {phase} | {row['ms']:.1f} | "
                         f"{floor} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--completion-length", type=int, default=1024)
    parser.add_argument("--short", type=int, default=128, help="completion length of the short-response setting "
                        "(0: leave it out)")
    parser.add_argument("--micro", type=int, help="actor.ppo_micro_batch_size_per_gpu (default: the planner's for the device)")
    parser.add_argument("--device-gib", type=float, help="size every cell for a device of this many GiB (default: the "
                        f"GPU's own; the dry run: {LENT_H100_GIB}, the lent H100, the smaller card a loan may bring)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (the first compiles)")
    parser.add_argument("--set", action="append", default=[], help="a profile override for every variant")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=override[,override...]: run each model with these too (default: one run as is)")
    parser.add_argument("--probe-larger", action="store_true", help="after each cell, run the next larger micro batch "
                        "the planner chose among, unsized: out of memory there confirms the planner's largest")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="plan every cell from config-only models and stop")
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.device == "cpu" and args.model == "tiny" and args.prompts == 16 and args.completion_length == 1024:
        # The CPU check's own scale: the tiny model, a few short prompts.
        args.prompts, args.generations, args.prompt_length, args.completion_length, args.short = 2, 4, 64, 16, 8
        args.vocab, args.micro = 512, 8
    variants = [(v.split("=", 1)[0], [o for o in v.split("=", 1)[1].split(",") if o]) for v in args.variant] or [("as-is", [])]
    settings = [("long", args.completion_length)] + ([("short", args.short)] if args.short else [])
    work = Path(tempfile.mkdtemp(prefix="bench-step-"))
    if args.dry_run:
        args.device_gib = args.device_gib or (LENT_H100_GIB if args.device == "gpu" else None)
        dry_run(args, variants, settings, work)
        return
    import torch

    if args.device == "gpu" and args.device_gib is None:
        args.device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30

    torch_device = "cuda" if args.device == "gpu" else "cpu"
    dtype = "bfloat16" if args.device == "gpu" else "float32"
    limits = rates(torch_device)
    result = {"command": " ".join(sys.argv), "device": args.device, "rates": limits, "prompts": args.prompts,
              "generations": args.generations, "prompt_length": args.prompt_length, "micro": args.micro,
              "steps": args.steps, "warmup": args.warmup, "overrides": args.set, "cells": []}
    if torch_device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for shape in args.model.split(","):
        model_dir = work / shape
        model, tokenizer = make_model(shape, args.vocab, model_dir, dtype, torch_device)
        train_file = work / f"train-{shape}.parquet"
        rows = long_prompts(tokenizer, args.prompts * args.steps, args.prompt_length)
        pq.write_table(rows, train_file)
        lengths = [prompt_length(tokenizer, p) for p in rows.column("prompt").to_pylist()[:args.prompts]]
        prompt_lengths = [n for n in lengths for _ in range(args.generations)]
        setting_floors = {setting: floors(model, prompt_lengths, new_tokens, limits) for setting, new_tokens in settings}
        del model  # the trainer loads its own copy
        if torch_device == "cuda":
            torch.cuda.empty_cache()
        for setting, new_tokens in settings:
            args.completion_length = new_tokens
            floor = setting_floors[setting]
            for variant, overrides in variants:
                cell = {"model": shape, "setting": f"{args.prompts}x{args.generations}, {args.prompt_length}+{new_tokens}",
                        "variant": variant, "overrides": overrides}
                try:
                    records, predicted_gib, profile = run_variant(args, shape, f"{setting}-{variant}", overrides,
                                                                  model_dir, train_file, work)
                except (CellDoesNotFit, OutOfMemory) as exc:  # recorded; the other cells still run
                    result["cells"].append({**cell, "fits": False, "why": str(exc)})
                    print(json.dumps(result["cells"][-1]), flush=True)
                    continue
                phases = {}
                for phase in (*PHASES, "other", "wall_s"):
                    ms = 1e3 * statistics.fmean(r[phase] for r in records)
                    row = {"ms": round(ms, 2)}
                    if phase in floor:
                        row["floor_ms"] = round(1e3 * floor[phase], 3)
                        row["x_floor"] = round(ms / row["floor_ms"], 2) if ms > 0 and row["floor_ms"] > 0 else None
                    phases["step" if phase == "wall_s" else phase] = row
                floor_sum = sum(row["floor_ms"] for p, row in phases.items() if "floor_ms" in row and row["ms"] > 0)
                phases["step"]["floor_ms"] = round(floor_sum, 3)
                phases["step"]["x_floor"] = round(phases["step"]["ms"] / floor_sum, 2)
                cell |= {"micro_batch": profile.actor.ppo_micro_batch_size_per_gpu,
                         "gradient_checkpointing": profile.model.enable_gradient_checkpointing,
                         "params": floor["params"], "tokens": floor["tokens"],
                        "tokens_per_s": round(args.prompts * args.generations * new_tokens / phases["step"]["ms"] * 1e3, 1),
                        "phases": phases, "steps_timed": len(records),
                        "peak_gib": {"measured": max((r["peak_gib"] for r in records if "peak_gib" in r), default=None),
                                     "planned": predicted_gib}}
                if args.probe_larger:
                    cell["next_micro_batch"] = probe_larger(args, shape, f"{setting}-{variant}", overrides, profile,
                                                            model_dir, train_file, work)
                result["cells"].append(cell)
                print(json.dumps(cell), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(result, indent=1) + "\n")  # what was measured survives a later failure
    print(table(result))


if __name__ == "__main__":
    main()
