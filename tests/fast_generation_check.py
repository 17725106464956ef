"""Run by tests/e2e/test_fast_generation.py in a child process: compiling (torch inductor) leaves
worker pools and threads in the process that compiled, which must not be the test suite's own (its
later tests fork Ray and Prefect servers). Prints one JSON object of what the test asserts on.

    python tests/fast_generation_check.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
           for a, b in ((3, 4), (12, 30), (7, 8), (100, 1))]
TRUTHS = ["7", "42", "15", "101"]


def main(model_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_pipeline.generation.compiled import greedy_with_logprobs
    from grpo_pipeline.rewards.builtin import score
    from grpo_pipeline.generation.engines import transformers_generate
    from grpo_pipeline.generation.plan import GenerationPlan
    from grpo_pipeline.stages.evaluate import EvalSettings

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eager = greedy_with_logprobs(model, tokenizer, PROMPTS, 12, fast=False)
    fast = greedy_with_logprobs(model, tokenizer, PROMPTS, 12, fast=True)
    rewards = [[score("arith", tokenizer.decode(t, skip_special_tokens=True), truth).reward for t, truth in zip(side[0], TRUTHS)]
               for side in (eager, fast)]
    responses = [[[r.model_dump() for r in group] for group in transformers_generate(
        model_dir, PROMPTS, EvalSettings(max_new_tokens=12, plan=GenerationPlan(**settings)))]
        for settings in ({}, {"cache": "static", "compile": True})]
    return {"tokens_equal": bool(torch.equal(eager[0], fast[0])),
            "max_logprob_difference": (eager[1] - fast[1]).abs().max().item(),
            "rewards": rewards, "evaluation_responses_equal": responses[0] == responses[1]}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
