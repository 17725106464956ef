"""Decoding against the hardware floor on one GPU: the native decoder (generation/decoding.py), the current
path (transformers `generate`, static cache + compiled decoding) and bare TRL (TRL 1.16's own
`generate` call) side by side, across model shapes, vocabularies, batch sizes and lengths; then
correctness (bench/decode_checks.py) and the compile cache's first vs second process.

    python3 bench/bench_decode_floor.py --device gpu --out $OUT/decode-floor.json   # bash bench/h200.sh decode
    python3 bench/bench_decode_floor.py --resume FILE --out $OUT/decode-floor.json  # the current path's missing cells
    .venv/bin/python bench/bench_decode_floor.py --device cpu --quick --out /tmp/decode-floor.json
    .venv/bin/python bench/bench_decode_floor.py --table bench/results-h200-decode-floor.json

Per cell (model shape x vocabulary x sequences x new tokens): the floor of one decode step (bytes: the
weights once + each sequence's KV cache up to its current length, averaged over the run's steps;
FLOPs: 2 x parameters x sequences + attention; the larger of their times at the measured copy
bandwidth and bf16 matmul rate), the native decoder's measured ms per step (a whole run of N tokens,
end-of-sequence ignored so every sequence runs to N, as the floor counts), the ratio, prefill ms and
generated tokens/s. Bare TRL and the current path are timed over `--baseline-steps` decode steps
(generate K+1 tokens minus generate 1, same prompts) at the run's mean cache length (bare TRL's
dynamic cache: prompts extended by N/2 tokens; the current path's static cache: sized prompt + N, as
its run allocates, which its every step reads whole); their tokens/s are B x N / (prefill + N x step).
The current path compiles per shape (~40-80 s each): it runs last and stops at `--deadline` seconds;
what was measured is kept (the JSON is written after each cell) and `--resume` measures the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from decode_models import build_model, chat_prompts, trl_generation_config  # noqa: E402

PROMPT_ROOM = 128  # cache positions kept for the prompt (the arith prompts take 40-70 tokens)


def ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured here."""
    import torch

    if device != "cuda":
        return {"copy_tb_s": 0.02, "bf16_tflop_s": 0.2, "measured": False}
    src = torch.randn(2**29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst, a = torch.empty_like(src), torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)

    def timed(fn, reps=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    copy = timed(lambda: dst.copy_(src))
    matmul = timed(lambda: a @ b)
    return {"copy_tb_s": round(2 * src.numel() * 2 / copy / 1e12, 3), "bf16_tflop_s": round(2 * 8192**3 / matmul / 1e12, 1),
            "measured": True}


def floor(model, prompt_lengths: list[int], new_tokens: int, limits: dict) -> dict:
    """The step's floor averaged over the run's decode steps s = 1..N-1, where the step reads each
    sequence's cache over its prompt and s tokens."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())  # tied embeddings once (the lm_head's matmul)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    element = next(model.parameters()).element_size()
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element
    positions = sum(prompt_lengths) + len(prompt_lengths) * new_tokens / 2  # mean over s of sum_b (len_b + s)
    bytes_ = weight_bytes + kv_per_token * positions
    flops = 2 * params * len(prompt_lengths) + 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * positions
    ms_bytes, ms_flops = bytes_ / (limits["copy_tb_s"] * 1e12) * 1e3, flops / (limits["bf16_tflop_s"] * 1e12) * 1e3
    return {"bytes_gb": round(bytes_ / 1e9, 3), "weights_gb": round(weight_bytes / 1e9, 3), "gflop": round(flops / 1e9, 1),
            "ms_bytes": round(ms_bytes, 4), "ms_flops": round(ms_flops, 4), "floor_ms": round(max(ms_bytes, ms_flops), 4)}


def native_cells(model, prompts, lengths, decoder_factory) -> tuple[dict, list[dict]]:
    """The native decoder on one model and batch: compile + capture, then one full run per length
    (the cache is sized once for the longest: FlexAttention reads only up to each step's length)."""
    import torch

    from grpo_pipeline.generation.decoding import Sampling

    decoder = decoder_factory(model)
    started = time.perf_counter()
    decoder.reserve(len(prompts), PROMPT_ROOM + max(lengths))
    decoder.generate(prompts, 8, Sampling(temperature=1.0, min_new_tokens=8))
    setup = {"first_call_s": round(time.perf_counter() - started, 2), "path": decoder.describe()}
    runs = []
    for new in lengths:
        out = decoder.generate(prompts, new, Sampling(temperature=1.0, min_new_tokens=new))
        assert all(len(c) == new for c in out.completions), "every sequence runs to max_new_tokens"
        runs.append({"new_tokens": new, "decode_ms": round(1e3 * out.decode_s / out.steps, 4),
                     "prefill_ms": round(1e3 * out.prefill_s, 2),
                     "tokens_per_s": round(len(prompts) * new / (out.prefill_s + out.decode_s), 1)})
    del decoder
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return setup, runs


def baseline_cell(model, tokenizer, prompts, new_tokens: int, steps: int, fast: bool, dynamic: bool = False) -> dict:
    """ms per decode step of bare TRL's `generate` (fast=False) or the current path (fast=True):
    (generate steps+1 tokens - generate 1 token) / steps, at the run's mean cache length."""
    import torch

    device = next(model.parameters()).device
    if fast:  # static cache sized as the real run sizes it; every step reads it whole
        rows, cache_len = prompts, max(len(p) for p in prompts) + new_tokens
    else:  # dynamic cache: start the timed steps half-way through the run
        filler = [tokenizer.pad_token_id + 7] * (new_tokens // 2)
        rows, cache_len = [p + filler for p in prompts], None
    width = max(len(p) for p in rows)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in rows], device=device)
    mask = (torch.arange(width, device=device)[None] >= torch.tensor([width - len(p) for p in rows], device=device)[:, None]).long()

    def run(count: int) -> float:
        config = trl_generation_config(tokenizer, count, fast, dynamic)
        if cache_len:
            config.max_cache_len = cache_len
            model._previous_max_cache_length = -1  # transformers keeps the largest static cache seen
        torch.cuda.synchronize() if device.type == "cuda" else None
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        torch.cuda.synchronize() if device.type == "cuda" else None
        return time.perf_counter() - started

    if fast:
        run(steps + 1)  # compiles and records the CUDA graphs of this shape
    prefill = run(1)
    step = (run(steps + 1) - prefill) / steps
    return {"decode_ms": round(1e3 * step, 3), "prefill_ms": round(1e3 * prefill, 1),
            "tokens_per_s": round(len(prompts) * new_tokens / (prefill + new_tokens * step), 1),
            "measured_steps": steps, "cache_len": cache_len or width + steps, **({"compile": "dynamic"} if dynamic else {})}


def write(result: dict, out: Path | None) -> None:
    if out:
        tmp = out.with_suffix(".partial")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)


def table(result: dict) -> str:
    lines = ["| model | vocab | seqs | new | floor ms (bytes / flops) | native ms | ratio | prefill ms | native tok/s | "
             "current ms | current tok/s | bare TRL ms | bare TRL tok/s | vs current | vs bare |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        cur, bare = c.get("current") or {}, c.get("bare_trl") or {}
        fl = c["floor"]
        ratio = lambda other: f"{other['tokens_per_s'] and c['native']['tokens_per_s'] / other['tokens_per_s']:.1f}x" if other else "-"
        lines.append(
            f"| {c['model']} | {c['vocab']} | {c['sequences']} | {c['new_tokens']} | {fl['floor_ms']:.3f} "
            f"({fl['ms_bytes']:.3f} / {fl['ms_flops']:.3f}) | {c['native']['decode_ms']:.3f} | "
            f"**{c['native']['decode_ms'] / fl['floor_ms']:.2f}** | {c['native']['prefill_ms']:.1f} | "
            f"{c['native']['tokens_per_s']:,.0f} | {cur.get('decode_ms', '-')} | {cur.get('tokens_per_s', '-')} | "
            f"{bare.get('decode_ms', '-')} | {bare.get('tokens_per_s', '-')} | {ratio(cur)} | {ratio(bare)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and one cell: checks the bench runs")
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument("--vocabs", default="151936,8192")
    parser.add_argument("--sequences", default="16,64,256")
    parser.add_argument("--new-tokens", default="256,1024")
    parser.add_argument("--baseline-steps", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=540, help="seconds after which the current path stops")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: bare,current,checks,cache")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    parser.add_argument("--resume", type=Path, help="a results file: measure the current path only where it has none, "
                        "and write the merge to --out")
    parser.add_argument("--current-dynamic", action="store_true",
                        help="compile the current path's step with dynamic shapes from its first call")
    args = parser.parse_args()
    if args.quick:
        args.models, args.vocabs, args.sequences, args.new_tokens, args.baseline_steps = "tiny", "512", "4", "16", 4
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    import torch
    import transformers

    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    begun, tokenizer = time.perf_counter(), train_tiny_tokenizer(512, seed=0)
    log = lambda line: print(f"[{time.perf_counter() - begun:.0f} s] {line}", flush=True)
    if args.resume:
        result = json.loads(args.resume.read_text())
    else:
        device = "cuda" if args.device == "gpu" else "cpu"
        result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                  "transformers": transformers.__version__, "ceilings": ceilings(device),
                  "baseline_steps": args.baseline_steps, "cells": [], "notes": []}
        log(f"ceilings: {result['ceilings']}")
        skip = set(filter(None, args.skip.split(",")))
        matrix(result, args, tokenizer, device, bare="bare" not in skip, log=log)
        checks(result, args, tokenizer, device, skip, log)
        if "current" in skip or device != "cuda":
            print(table(result))
            return
    current_path(result, args, tokenizer, begun, log, dynamic=args.current_dynamic)
    write(result, args.out)
    print(table(result))


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def matrix(result: dict, args, tokenizer, device: str, bare: bool, log) -> None:
    """The native decoder, and bare TRL beside it, on every model x vocabulary x batch x length."""
    import torch

    from grpo_pipeline.generation.decoding import NativeDecoder

    factory = lambda m: NativeDecoder(m, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    for shape in args.models.split(","):
        for vocab in ints(args.vocabs):
            model = build_model(shape, vocab, device, tokenizer)
            for batch in ints(args.sequences):
                prompts = chat_prompts(tokenizer, batch)
                setup, runs = native_cells(model, prompts, ints(args.new_tokens), factory)
                for run in runs:
                    new = run["new_tokens"]
                    cell = {"model": shape, "vocab": vocab, "sequences": batch, "new_tokens": new,
                            "prompt_tokens_mean": round(statistics.fmean(map(len, prompts)), 1),
                            "floor": floor(model, [len(p) for p in prompts], new, result["ceilings"]),
                            "native": {**run, **setup}}
                    if bare:
                        cell["bare_trl"] = baseline_cell(model, tokenizer, prompts, new, args.baseline_steps, False)
                    result["cells"].append(cell)
                    log(f"{shape} V={vocab} B={batch} N={new}: floor {cell['floor']['floor_ms']} ms, native "
                        f"{run['decode_ms']} ms ({run['decode_ms'] / cell['floor']['floor_ms']:.2f}x), bare "
                        f"{cell.get('bare_trl', {}).get('decode_ms')} ms; first call {setup['first_call_s']} s, {setup['path']}")
                    write(result, args.out)
            del model
            gc.collect()
            torch.cuda.empty_cache() if device == "cuda" else None


def checks(result: dict, args, tokenizer, device: str, skip: set[str], log) -> None:
    """Correctness and the compile cache (bench/decode_checks.py), on the first model and vocabulary."""
    from decode_checks import compile_cache_probe, correctness

    shape, vocab = args.models.split(",")[0], ints(args.vocabs)[0]
    if "checks" not in skip:
        result["correctness"] = correctness(shape, vocab, device, tokenizer, batch=4 if args.quick else 64,
                                            new_tokens=12 if args.quick else 128)
        log(f"correctness: {json.dumps(result['correctness'])[:1500]}")
        write(result, args.out)
    if "cache" not in skip:
        result["compile_cache"] = compile_cache_probe(shape, vocab, args.device, batch=4 if args.quick else 64)
        log(f"compile cache: {result['compile_cache']}")
        write(result, args.out)


def current_path(result: dict, args, tokenizer, begun: float, log, dynamic: bool = False) -> None:
    """The current path where a cell has none, in an order that covers every model, vocabulary and
    batch early, until the deadline (each new static-cache shape compiles: ~40 s)."""
    import torch

    order = [(64, 256), (256, 1024), (16, 256), (64, 1024), (256, 256), (16, 1024)]
    for vocab in ints(args.vocabs):
        for shape in args.models.split(","):
            cells = {(c["sequences"], c["new_tokens"]): c for c in result["cells"]
                     if (c["model"], c["vocab"]) == (shape, vocab) and "current" not in c}
            if not cells:
                continue
            model = build_model(shape, vocab, "cuda" if torch.cuda.is_available() else "cpu", tokenizer)
            for key in sorted(cells, key=lambda k: order.index(k) if k in order else len(order)):
                if time.perf_counter() - begun > args.deadline:
                    result["notes"].append(f"current path not measured for {shape} V={vocab} {key}: past the deadline")
                    continue
                prompts = chat_prompts(tokenizer, key[0])
                cells[key]["current"] = baseline_cell(model, tokenizer, prompts, key[1], args.baseline_steps, True, dynamic)
                log(f"current {shape} V={vocab} B={key[0]} N={key[1]}: {cells[key]['current']}")
                write(result, args.out)
            del model
            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
