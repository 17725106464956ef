"""Correctness of the fast generation path at a real model size: greedy rollouts on the eager path
(TRL's: dynamic cache, no compilation) vs the fast one (static cache, compiled decode step) of the
same model on the same prompts; bf16 on a GPU, where a near-tie may flip a greedy token.

    python bench/check_fast_generation.py --model qwen3-0.6b --device gpu --out $OUT/check.json

Prints: sequences identical, the first position where tokens differ (if any), the largest per-token
log-prob difference on the tokens before it, and whether the arith rewards are the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_generation import model_dir_for
    from grpo_pipeline.generation.compiled import greedy_with_logprobs
    from grpo_pipeline.rewards.builtin import score
    from grpo_pipeline.data.rl_data import arith_splits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2-135m", "qwen3-0.6b"])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = model_dir_for(args.model)
    gpu = args.device == "gpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32)
    model = model.to("cuda" if gpu else "cpu").eval()
    rows = arith_splits(8, args.prompts, seed=0)["test"].to_pylist()
    prompts = [row["prompt"] for row in rows]
    eager = greedy_with_logprobs(model, tokenizer, prompts, args.max_new_tokens, fast=False)
    greedy_with_logprobs(model, tokenizer, prompts, args.max_new_tokens, fast=True)  # compiles
    fast = greedy_with_logprobs(model, tokenizer, prompts, args.max_new_tokens, fast=True)
    same = (eager[0] == fast[0]).all(dim=1)
    differs = (eager[0] != fast[0]).int().argmax(dim=1).where(~same, args.max_new_tokens)
    prefix = torch.arange(args.max_new_tokens, device=model.device)[None] < differs[:, None]
    logprob_gap = ((eager[1] - fast[1]).abs() * prefix).max().item()
    rewards = [[score(row["data_source"], tokenizer.decode(t, skip_special_tokens=True),
                      str(row["reward_model"]["ground_truth"])).reward for t, row in zip(side[0], rows)]
               for side in (eager, fast)]
    result = {"model": args.model, "device": args.device, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "sequences_identical": int(same.sum()), "first_difference": differs.tolist(),
              "max_logprob_difference_before_it": logprob_gap, "rewards_equal": rewards[0] == rewards[1],
              "mean_reward": [sum(r) / len(r) for r in rewards]}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
