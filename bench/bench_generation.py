"""The evaluation engine, two ways on the same prompts and model: batched vs one prompt at a time
(`--compare batching`), or the eager path vs the fast one (`--compare fast`: static KV cache and a
compiled decode step, the GPU's `generation` defaults).

    .venv/bin/python bench/bench_generation.py [--model smollm2-135m] [--prompts 64] [--batch 32]
    python bench/bench_generation.py --compare fast --model qwen3-0.6b --device gpu --prompts 128 --max-new-tokens 256

Greedy decoding of `--max-new-tokens` on the arith validation prompts, through
`grpo_pipeline.generation.engines.transformers_generate`, the sides alternating for `--rounds`; prints each side's
time, prompts/s and generated tokens/s, and the speed-up. The fast side's first round includes its
compilation and is left out when there is more than one.
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

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_pipeline.stages.plan import resolve_profile  # noqa: E402
from grpo_pipeline.generation.engines import transformers_generate  # noqa: E402
from grpo_pipeline.generation.plan import GenerationPlan  # noqa: E402
from grpo_pipeline.stages.evaluate import EvalSettings  # noqa: E402
from grpo_pipeline.stages.model import ModelSpec, prepare_model  # noqa: E402
from grpo_pipeline.data.rl_data import arith_splits  # noqa: E402


def model_dir_for(name: str) -> Path:
    if name == "qwen3-0.6b":
        from bench_local_backend import make_model

        out = Path(tempfile.mkdtemp(prefix="bench-generation-")) / "model"
        make_model(name, out)
        return out
    profile = resolve_profile(name, "cpu")
    return Path(prepare_model(ModelSpec.from_profile(profile.model), log=lambda m: None).path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=["batching", "fast"], default="batching")
    parser.add_argument("--model", default="smollm2-135m", choices=["tiny", "smollm2-135m", "qwen3-0.6b"])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()
    model_dir = model_dir_for(args.model)
    prompts = [row["prompt"] for row in arith_splits(8, args.prompts, seed=0)["test"].to_pylist()]
    device = "cuda" if args.device == "gpu" else "cpu"
    base = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch, plan=GenerationPlan(torch_device=device),
                dtype="bfloat16" if args.device == "gpu" else "float32")
    if args.compare == "batching":
        sides = {f"batch {args.batch}": EvalSettings(**base), "batch 1": EvalSettings(**{**base, "batch_size": 1})}
    else:
        fast = GenerationPlan(torch_device=device, cache="static", compile=True)
        sides = {"eager": EvalSettings(**base), "fast": EvalSettings(**{**base, "plan": fast})}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    for round_index in range(args.rounds):
        for name in list(sides) if round_index % 2 == 0 else list(sides)[::-1]:
            start = time.perf_counter()
            responses = transformers_generate(model_dir, prompts, sides[name])
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = sum(r.tokens for group in responses for r in group)
    result = {"model": args.model, "device": args.device, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds}
    for name, times in seconds.items():
        kept = times[1:] if args.compare == "fast" and name == "fast" and len(times) > 1 else times
        median = statistics.median(kept)
        result[name] = {"s": round(median, 2), "prompts_per_s": round(args.prompts / median, 1),
                        "tokens_per_s": round(tokens[name] / median, 1), "all_rounds_s": [round(t, 2) for t in times]}
    first, second = list(sides)
    result["speedup"] = round(result[second]["tokens_per_s"] / result[first]["tokens_per_s"], 2) if args.compare == "fast" \
        else round(result[second]["s"] / result[first]["s"], 2)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
