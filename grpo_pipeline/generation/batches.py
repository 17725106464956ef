"""The transformers engine's two decoders behind generation/protocol.py's `TokenGenerator`, and the
one place a loaded model gets the one its `GenerationPlan` names:

    python -m grpo_pipeline --model tiny --device cpu --stages evaluate --set generation.decoder=native

`GenerateLoop`: transformers' `generate` (left padding, inference mode, the plan's `cache` and
`compile`); the native decoder is generation/decoding.py's `NativeDecoder`. `token_generator` picks by
`plan.decoder`, and falls back to `generate` for a model outside the native decoder's family (the
note says so).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_pipeline.generation.plan import GenerationPlan

if TYPE_CHECKING:
    from grpo_pipeline.generation.decode_step import Sampling
    from grpo_pipeline.generation.decoding import Generated
    from grpo_pipeline.generation.protocol import TokenGenerator


class GenerateLoop:
    """transformers' `generate` as a `TokenGenerator`: each batch left-padded, completions cut after
    the first end-of-sequence."""

    def __init__(self, model, tokenizer, plan: GenerationPlan, stop_ids: list[int]):
        from grpo_pipeline.generation.compiled import compiled_decoding

        self.model, self.tokenizer, self.plan, self.stop_ids = model, tokenizer, plan, set(stop_ids)
        self.options = {"cache_implementation": "static"} if plan.cache == "static" else {}
        if plan.compile:
            compiled_decoding(model.generation_config, plan.torch_device != "cpu")
        else:
            self.options["disable_compile"] = True

    def reserve(self, rows: int, length: int) -> None:
        """`generate` sizes its cache per call."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling) -> Generated:
        import torch

        from grpo_pipeline.generation.decoding import Generated

        # A compiled decode step is specialised to its shapes: prompts padded to a multiple of 64 tokens
        # reuse a few compiled graphs instead of one per batch.
        pad_to = 64 if self.plan.compile else None
        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, pad_to_multiple_of=pad_to,
                                   return_tensors="pt").to(self.plan.torch_device)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=sampling.temperature > 0,
                temperature=sampling.temperature if sampling.temperature > 0 else None,
                top_p=sampling.top_p if sampling.top_p < 1.0 else None, top_k=sampling.top_k or None,
                min_new_tokens=sampling.min_new_tokens or None, pad_token_id=self.tokenizer.pad_token_id,
                **self.options,
            )
        completions, truncated = [], []
        for ids in output[:, batch["input_ids"].shape[1]:].tolist():
            ended = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
            completions.append(ids if ended is None else ids[: ended + 1])
            truncated.append(ended is None)
        return Generated(completions=completions, logprobs=[[] for _ in completions], truncated=truncated,
                         prompt_lengths=[len(p) for p in prompts], prefill_s=0.0,
                         decode_s=time.perf_counter() - started, steps=max(map(len, completions), default=0))


def token_generator(model, tokenizer, plan: GenerationPlan, stop_ids: list[int],
                    compile_cache_dir: str | None = None) -> tuple[TokenGenerator, str | None]:
    """The `TokenGenerator` of the plan for this loaded model, and why it is not the native decoder
    when the plan asked for it (None otherwise)."""
    from grpo_pipeline.generation.decoding import NativeDecoder, unsupported, use_compile_cache

    if plan.native:
        if (refusal := unsupported(model)) is None:
            if plan.compile and compile_cache_dir:
                use_compile_cache(Path(compile_cache_dir))
            return NativeDecoder(model, stop_ids, tokenizer.pad_token_id, compile=plan.compile), None
        return GenerateLoop(model, tokenizer, plan, stop_ids), refusal
    return GenerateLoop(model, tokenizer, plan, stop_ids), None
