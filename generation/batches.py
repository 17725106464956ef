"""How the evaluation stage generates with a transformers model, batch by batch (stages/evaluate.py's
`transformers_generate` turns the new tokens into responses):

    python -m flows.grpo --model tiny --device cpu --stages evaluate --set generation.decoder=native

`generate_batches`: transformers' `generate` (left padding, inference mode, `generation.cache` and
`generation.compile`); `native_batches`: the native decoder (generation/decoding.py), the rollouts' own
generator. Each yields, per batch of `eval.batch_size` prompts, the new token ids of every sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.evaluate import EvalSettings


def generate_batches(model, tokenizer, texts: list[str], settings: EvalSettings):
    """transformers' `generate`, left padding, inference mode: each batch's new token ids per sample."""
    import torch

    fast = {"cache_implementation": "static"} if settings.cache == "static" else {}
    if settings.compile:
        from generation.compiled import compiled_decoding

        compiled_decoding(model.generation_config, settings.torch_device != "cpu")
    else:
        fast["disable_compile"] = True
    # A compiled decode step is specialised to its shapes: prompts padded to a multiple of 64 tokens
    # reuse a few compiled graphs instead of one per batch.
    pad_to = 64 if settings.compile else None
    with torch.inference_mode():
        for start in range(0, len(texts), settings.batch_size):
            batch = tokenizer(texts[start : start + settings.batch_size], return_tensors="pt", padding=True,
                              pad_to_multiple_of=pad_to, add_special_tokens=False).to(settings.torch_device)
            output = model.generate(
                **batch,
                max_new_tokens=settings.max_new_tokens,
                do_sample=settings.temperature > 0,
                temperature=settings.temperature if settings.temperature > 0 else None,
                top_p=None, top_k=None,
                num_return_sequences=settings.samples_per_prompt,
                pad_token_id=tokenizer.pad_token_id,
                **fast,
            )
            yield output[:, batch["input_ids"].shape[1] :].tolist()


def native_batches(model, tokenizer, texts: list[str], settings: EvalSettings, stop_ids: list[int]):
    """The native decoder (generation/decoding.py), the rollouts' generator: each batch's new token ids
    per sample; the cache is sized once for the longest prompt expected."""
    from generation.decoding import NativeDecoder, Sampling, use_compile_cache

    if settings.compile and settings.compile_cache_dir:
        use_compile_cache(Path(settings.compile_cache_dir))
    decoder = NativeDecoder(model, stop_ids, tokenizer.pad_token_id, compile=settings.compile)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    rows = settings.batch_size * settings.samples_per_prompt
    longest = max([len(p) for p in prompts] + [settings.max_prompt_length or 0])
    decoder.reserve(min(rows, len(prompts) * settings.samples_per_prompt), longest + settings.max_new_tokens)
    for start in range(0, len(prompts), settings.batch_size):
        batch = [p for p in prompts[start : start + settings.batch_size] for _ in range(settings.samples_per_prompt)]
        yield decoder.generate(batch, settings.max_new_tokens, Sampling(temperature=settings.temperature)).completions
