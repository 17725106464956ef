"""vLLM 0.24's own engine beside the native decoder, on the cells of bench/results-h200-decode-floor.json:
the same Qwen3 shapes and vocabularies (random weights, seed 0), the same arith prompts (chat template,
the tiny tokenizer), batch, lengths (end-of-sequence ignored) and sampling (temperature 1, no top-k/p),
CUDA graphs on (vLLM's default: compiled, graphs captured up to the batch), torch sampling
(VLLM_USE_FLASHINFER_SAMPLER=0: FlashInfer's kernels are not carried, bench/verl_carry.py).

    PYTHONPATH=/tmp/site-verl:$PWD python3 bench/bench_vllm_decode.py --out $OUT/vllm-decode.json   # bash bench/h200_verl.sh decode
    .venv/bin/python bench/bench_vllm_decode.py --check      # here: cells, model folders, prompts, arithmetic; no vLLM

Per cell: prefill = a run with max_tokens=1; a whole run of N tokens; decode ms a step = (whole - prefill)
/ (N - 1); tokens/s = B x N / whole (as the native decoder's cells count them). Each timing is the
median of --rounds runs after one warm-up. The JSON is written after each cell, and --resume FILE
measures only the cells a file lacks (one device call is 10 minutes; an engine's start compiles).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
FLOOR = ROOT / "bench" / "results-h200-decode-floor.json"
PROMPT_ROOM = 128


def cells(floor: dict, models: set[str] | None) -> list[dict]:
    """The floor file's cells (model, vocab, sequences, new tokens) with the native decoder's numbers."""
    return [{"model": c["model"], "vocab": c["vocab"], "sequences": c["sequences"], "new_tokens": c["new_tokens"],
             "native": {k: c["native"][k] for k in ("decode_ms", "prefill_ms", "tokens_per_s")}}
            for c in floor["cells"] if models is None or c["model"] in models]


def model_dir(shape: str, vocab: int, root: Path, tokenizer, device: str) -> Path:
    """The cell's model as an HF folder vLLM loads (decode_models.build_model: same shape, same seed)."""
    from decode_models import build_model

    path = root / f"{shape}-{vocab}"
    if not (path / "config.json").is_file():
        build_model(shape, vocab, device, tokenizer).save_pretrained(path)
    return path


def timing(whole_s: float, prefill_s: float, sequences: int, new_tokens: int) -> dict:
    return {"decode_ms": round((whole_s - prefill_s) / (new_tokens - 1) * 1000, 4), "prefill_ms": round(prefill_s * 1000, 2),
            "tokens_per_s": round(sequences * new_tokens / whole_s, 1)}


def measure(engine, prompts: list[list[int]], new_tokens: int, rounds: int) -> tuple[float, float]:
    """Seconds of a whole run and of its prefill (max_tokens=1), medians after a warm-up of each."""
    from vllm import SamplingParams

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False, seed=0)
        begun = time.perf_counter()
        engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - begun

    run(1), run(new_tokens)
    return (statistics.median(run(new_tokens) for _ in range(rounds)),
            statistics.median(run(1) for _ in range(rounds)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=Path, default=FLOOR)
    parser.add_argument("--models", default=None, help="comma-separated shapes (default: the floor file's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--resume", type=Path, help="a results file of this bench: measure only the cells it lacks")
    parser.add_argument("--check", action="store_true", help="on the CPU: everything but vLLM (tiny shape, fake timings)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from decode_models import chat_prompts
    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(512, seed=0)
    floor = json.loads(args.floor.read_text())
    todo = cells(floor, set(args.models.split(",")) if args.models else None)
    done = json.loads(args.resume.read_text())["cells"] if args.resume else []
    key = lambda c: (c["model"], c["vocab"], c["sequences"], c["new_tokens"])  # noqa: E731
    todo = [c for c in todo if key(c) not in {key(d) for d in done}]
    result = {"engine": "vLLM 0.24.0 (CUDA graphs on, torch sampling)", "floor_file": str(args.floor.name),
              "command": " ".join(sys.argv), "cells": done}
    models_root = Path(tempfile.gettempdir()) / "vllm-decode-models"
    if args.check:
        path = model_dir("tiny", 1024, models_root, tokenizer, "cpu")
        prompts = chat_prompts(tokenizer, 4)
        assert (path / "config.json").is_file() and len(prompts) == 4 and all(len(p) < PROMPT_ROOM for p in prompts)
        assert timing(2.0, 0.1, 4, 20) == {"decode_ms": 100.0, "prefill_ms": 100.0, "tokens_per_s": 40.0}
        print(f"bench_vllm_decode check: {len(todo)} cells to measure from {args.floor.name}; model folder, prompts and "
              "arithmetic are right")
        return 0
    from vllm import LLM

    by_model: dict[tuple[str, int], list[dict]] = {}
    for cell in todo:
        by_model.setdefault((cell["model"], cell["vocab"]), []).append(cell)
    for (shape, vocab), group in by_model.items():
        path = model_dir(shape, vocab, models_root, tokenizer, "cuda")
        engine = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                     max_model_len=PROMPT_ROOM + max(c["new_tokens"] for c in group),
                     max_num_seqs=max(c["sequences"] for c in group), gpu_memory_utilization=0.6)
        for cell in group:
            prompts = chat_prompts(tokenizer, cell["sequences"])
            whole, prefill = measure(engine, prompts, cell["new_tokens"], args.rounds)
            cell["vllm"] = timing(whole, prefill, cell["sequences"], cell["new_tokens"])
            cell["vllm_over_native_ms"] = round(cell["vllm"]["decode_ms"] / cell["native"]["decode_ms"], 3)
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
        del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
