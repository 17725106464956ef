"""The fast generation path (`generation.cache: static` + `generation.compile: true`, the GPU
default) gives what the eager path gives: a greedy run on `tiny` (CPU, where transformers compiles
only when asked) produces the same tokens, per-token log-probs within float tolerance and the same
rewards, both with the generation config TRL builds for rollouts and through the evaluation stage."""

from __future__ import annotations

import pytest
import torch

from common.generation import greedy_with_logprobs

PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
           for a, b in ((3, 4), (12, 30), (7, 8), (100, 1))]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def test_compiled_decoding_gives_the_eager_tokens_logprobs_and_rewards(tiny):
    from common.rewards import score

    tokenizer, model = tiny
    eager_tokens, eager_logprobs = greedy_with_logprobs(model, tokenizer, PROMPTS, 12, fast=False)
    fast_tokens, fast_logprobs = greedy_with_logprobs(model, tokenizer, PROMPTS, 12, fast=True)
    assert torch.equal(fast_tokens, eager_tokens)
    assert torch.allclose(fast_logprobs, eager_logprobs, atol=1e-4, rtol=0)
    truths = ["7", "42", "15", "101"]
    rewards = [[score("arith", tokenizer.decode(t, skip_special_tokens=True), truth).reward for t, truth in zip(ts, truths)]
               for ts in (eager_tokens, fast_tokens)]
    assert rewards[0] == rewards[1]


def test_the_evaluation_stage_on_the_fast_path_gives_the_eager_responses(tiny_model_dir):
    from stages.evaluate import EvalSettings, transformers_generate

    eager = transformers_generate(tiny_model_dir, PROMPTS, EvalSettings(max_new_tokens=12))
    fast = transformers_generate(tiny_model_dir, PROMPTS, EvalSettings(max_new_tokens=12, cache="static", compile=True))
    assert [[r.model_dump() for r in g] for g in fast] == [[r.model_dump() for r in g] for g in eager]
