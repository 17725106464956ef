"""Batched generation (the evaluation engine) vs one prompt at a time, same prompts, same model.

    .venv/bin/python bench/bench_generation.py [--model smollm2-135m] [--prompts 64] [--batch 32]

Greedy decoding of `--max-new-tokens` on the arith validation prompts, through
`stages.evaluate.transformers_generate` with `eval.batch_size` = `--batch` and = 1, alternating
twice; prints prompts/s of each and the speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from profiles.loader import resolve_profile  # noqa: E402
from stages.evaluate import EvalSettings, transformers_generate  # noqa: E402
from stages.model import ModelSpec, prepare_model  # noqa: E402
from common.rl_data import arith_splits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["tiny", "smollm2-135m"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    profile = resolve_profile(args.model, "cpu")
    model_dir = Path(prepare_model(ModelSpec.from_profile(profile.model), log=lambda m: None).path)
    prompts = [row["prompt"] for row in arith_splits(8, args.prompts, seed=0)["test"].to_pylist()]
    timings: dict[int, list[float]] = {args.batch: [], 1: []}
    for round_index in range(args.rounds):
        for batch in (args.batch, 1) if round_index % 2 == 0 else (1, args.batch):
            settings = EvalSettings(max_new_tokens=args.max_new_tokens, batch_size=batch)
            start = time.perf_counter()
            transformers_generate(model_dir, prompts, settings)
            timings[batch].append(time.perf_counter() - start)
    batched, single = statistics.median(timings[args.batch]), statistics.median(timings[1])
    print(f"model {args.model}, {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy, {args.rounds} rounds")
    print(f"batch {args.batch}: {batched:.2f} s ({args.prompts / batched:.1f} prompts/s)")
    print(f"batch 1:  {single:.2f} s ({args.prompts / single:.1f} prompts/s)")
    print(f"speed-up batched / one at a time: {single / batched:.2f}x")


if __name__ == "__main__":
    main()
