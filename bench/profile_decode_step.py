"""Where a native decode step's time goes, per GPU kernel, and what its settings change: for one model
shape and batch, each variant of the compiled step (VARIANTS: inductor options, product splits,
FlexAttention's block and kernel options) is timed over whole runs side by side, and its CUDA graph's
replays are profiled kernel by kernel; `--products` times the step's four products alone, whole and
split; the sampler is checked as the step runs it. Results: bench/results-h200-decode-profile.json.

    python3 bench/profile_decode_step.py --out $OUT/decode-profile.json     # on the GPU (device tool)
    .venv/bin/python bench/profile_decode_step.py --device cpu --quick      # checks the script runs

Prints, per variant and vocabulary: ms per step (two runs), the floor and the ratio, kernels per step,
the kernels' summed time against the replay's wall time (the rest is the gaps between launches), and
the kernels that take the most time.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_floor import PROMPT_ROOM, ceilings, floor, write  # noqa: E402
from decode_models import build_model, chat_prompts  # noqa: E402

from grpo_pipeline.generation.decode_step import Splits  # noqa: E402

COMBO = {"combo_kernels": True}
AUTOTUNE = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON,ATEN", "coordinate_descent_tuning": True}
VARIANTS = {  # NativeDecoder's keyword arguments beside its defaults (what each did: docs/performance.md)
    "default": {},
    "no-combo": {"compile_options": {"combo_kernels": False}},
    "no-split": {"splits": Splits()},
    "block128": {"kv_block": 128},
    "block32": {"kv_block": 32, "flex_options": {"BLOCK_N": 32}},
    "flex-s3w4": {"flex_options": {"num_stages": 3, "num_warps": 4}},
    "flex-split2": {"flex_options": {"SPLIT_KV": 2, "num_stages": 3, "num_warps": 4}},
    "flex-autotune": {"compile_options": {**COMBO, "max_autotune": True, "max_autotune_gemm_backends": "ATEN"}},
    "gemm-autotune": {"compile_options": {**COMBO, **AUTOTUNE}},
    "matmul-attention": {"attention": "matmul"},
    "pointwise-autotune": {"compile_options": {**COMBO, "max_autotune_pointwise": True}},
    "descent-tuning": {"compile_options": {**COMBO, "coordinate_descent_tuning": True}},
    "split-o8-down8": {"splits": Splits(o=8, down=8)},
    "split-o4-down4": {"splits": Splits(o=4, down=4)},
}


def sampler_check(device: str, rows: int = 1024, replays: int = 32) -> dict:
    """The compiled sampler (generation/decode_step.choose_token) captured in a CUDA graph, as the decode
    step runs it: each replay draws anew, and the draws' frequencies match softmax (six logits spread
    over the chunks of a 151,936-entry vocabulary, the rest -inf)."""
    import torch

    from grpo_pipeline.generation.decode_step import Sampling, choose_token

    picked = [0, 1, 4095, 4096, 70000, 151935]
    logits = torch.full((rows, 151936), float("-inf"), device=device)
    logits[:, picked] = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 1.5], device=device)
    mask = torch.zeros_like(logits, dtype=torch.bool)
    draw = torch.compile(choose_token, fullgraph=True, dynamic=False) if device == "cuda" else choose_token
    sampling = Sampling(temperature=1.0)
    for _ in range(2):
        draw(logits, mask, sampling)
    runs = []
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            token, _ = draw(logits, mask, sampling)
        for _ in range(replays):
            graph.replay()
            runs.append(token.clone())
    else:
        runs = [draw(logits, mask, sampling)[0] for _ in range(replays)]
    tokens = torch.cat(runs)
    counts = torch.bincount(tokens, minlength=logits.shape[-1])
    frequency = (counts[picked] / tokens.numel()).tolist()
    expected = torch.softmax(logits[0, picked], -1).tolist()
    return {"draws": tokens.numel(), "replays_differ": not torch.equal(runs[0], runs[1]),
            "outside_support": int(tokens.numel() - counts[picked].sum()),
            "max_frequency_error": round(max(abs(a - b) for a, b in zip(frequency, expected)), 4)}


PRODUCTS = {  # (inner, outer) of the decode step's four products: qkv, o, gate_up, down
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
    "qwen3-1.7b": {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)},
}


def product_bench(rows_list=(16, 64, 256), splits_list=(1, 2, 4, 8), layers: int = 28, replays: int = 20) -> list[dict]:
    """Each product of the decode step alone, as one matmul and split over its inner dimension
    (generation/decode_step.partial_products), over `layers` distinct weights (as a step reads them: from
    memory, not from L2), in a CUDA graph: microseconds per product and the weight's read rate."""
    import torch

    from grpo_pipeline.generation.decode_step import partial_products

    out = []
    for model, products in PRODUCTS.items():
        for name, (inner, outer) in products.items():
            weights = [torch.randn(outer, inner, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            for rows in rows_list:
                x = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16)
                for splits in splits_list:
                    with torch.no_grad():
                        for w in weights[:2]:
                            partial_products(x, w, splits)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            for w in weights:
                                partial_products(x, w, splits)
                    graph.replay()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(replays):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    us = 1e3 * start.elapsed_time(end) / replays / layers
                    out.append({"model": model, "product": name, "rows": rows, "splits": splits, "us": round(us, 2),
                                "weight_tb_s": round(outer * inner * 2 / us / 1e6, 2)})
                    del graph
            del weights
    return out


def kernel_profile(decoder, prompts, new_tokens: int, replays: int = 20) -> dict:
    """Kernels of `replays` graph replays from the middle of a run: count and time per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo_pipeline.generation.decoding import Sampling

    sampling = Sampling(temperature=1.0, min_new_tokens=new_tokens)
    decoder.generate(prompts, 4, sampling)
    width = max(len(p) for p in prompts)
    with torch.no_grad():
        ws, run = decoder._runner(len(prompts), width + new_tokens, sampling)
    ws.state["slot"].fill_(width + new_tokens // 2 - replays // 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(replays):
            run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            us = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0)
            kernels[event.name].append(us)
    total = sum(sum(v) for v in kernels.values()) / replays
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {"replay_ms": round(1e3 * wall / replays, 4), "kernels_per_step": round(sum(map(len, kernels.values())) / replays, 1),
            "kernel_ms": round(total / 1e3, 4),
            "top": [{"name": name[:90], "per_step": round(len(v) / replays, 1), "us_each": round(sum(v) / len(v), 2),
                     "us_per_step": round(sum(v) / replays, 1)} for name, v in top]}


def measure(model, prompts, new_tokens: int, variant: dict, eos: int, pad: int, profile_it: bool) -> dict:
    import torch

    from grpo_pipeline.generation.decoding import NativeDecoder, Sampling

    decoder = NativeDecoder(model, [eos], pad, **variant)
    started = time.perf_counter()
    decoder.reserve(len(prompts), PROMPT_ROOM + 1024)  # as the matrix sizes the 64-sequence cells' cache
    decoder.generate(prompts, 8, Sampling(temperature=1.0, min_new_tokens=8))
    out = {"first_call_s": round(time.perf_counter() - started, 1), "path": decoder.describe(), "decode_ms": []}
    for _ in range(2):
        run = decoder.generate(prompts, new_tokens, Sampling(temperature=1.0, min_new_tokens=new_tokens))
        out["decode_ms"].append(round(1e3 * run.decode_s / run.steps, 4))
    if profile_it and torch.cuda.is_available():
        try:
            out["profile"] = kernel_profile(decoder, prompts, new_tokens)
        except Exception as error:  # noqa: BLE001 - the timing stands without its profile
            out["profile"] = {"error": f"{type(error).__name__}: {error}"[:500]}
    del decoder
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--vocabs", default="8192,151936")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--products", action="store_true", help="first time each product alone, whole and split")
    parser.add_argument("--code", type=Path, help="write inductor's generated code of the steps to this .tgz")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.model, args.vocabs, args.sequences, args.new_tokens, args.variants = "tiny", "512", 4, 16, "default"
    import torch

    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    device = "cuda" if args.device == "gpu" else "cpu"
    begun, tokenizer = time.perf_counter(), train_tiny_tokenizer(512, seed=0)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "ceilings": ceilings(device), "sampler": sampler_check(device, *(() if device == "cuda" else (64, 4))), "cells": []}
    print(f"ceilings {result['ceilings']}, sampler {result['sampler']}", flush=True)
    if args.products and device == "cuda":
        result["products"] = product_bench()
        write(result, args.out)
        for row in result["products"]:
            print(f"{row['model']} {row['product']:8} rows {row['rows']:4} splits {row['splits']}: {row['us']:7.2f} us "
                  f"{row['weight_tb_s']:.2f} TB/s", flush=True)
    prompts = chat_prompts(tokenizer, args.sequences)
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        model = build_model(args.model, vocab, device, tokenizer)
        cell_floor = floor(model, [len(p) for p in prompts], args.new_tokens, result["ceilings"])
        for name in args.variants.split(","):
            got = measure(model, prompts, args.new_tokens, VARIANTS[name], tokenizer.eos_token_id, tokenizer.pad_token_id,
                          not args.no_profile)
            cell = {"variant": name, "settings": repr(VARIANTS[name]), "vocab": vocab, "floor": cell_floor, **got}
            result["cells"].append(cell)
            write(result, args.out)
            prof = got.get("profile", {})
            print(f"[{time.perf_counter() - begun:.0f} s] V={vocab} {name}: {got['decode_ms']} ms/step "
                  f"({min(got['decode_ms']) / cell_floor['floor_ms']:.2f}x floor {cell_floor['floor_ms']}), first call "
                  f"{got['first_call_s']} s; kernels/step {prof.get('kernels_per_step')}, kernel ms {prof.get('kernel_ms')}"
                  f" of replay {prof.get('replay_ms')}", flush=True)
        del model
        gc.collect()
    if args.code:
        import tarfile

        from torch._inductor.runtime.cache_dir_utils import cache_dir

        with tarfile.open(args.code, "w:gz") as tar:
            for path in Path(cache_dir()).rglob("*.py"):
                if "def call(" in path.read_text(errors="replace"):
                    tar.add(path, arcname=path.name)
    for cell in result["cells"]:
        if "top" in cell.get("profile", {}):
            print(f"\n## V={cell['vocab']} {cell['variant']}")
            for k in cell["profile"]["top"][:14]:
                print(f"  {k['us_per_step']:8.1f} us/step  {k['per_step']:5.1f}x {k['us_each']:6.2f} us  {k['name']}")


if __name__ == "__main__":
    main()
