"""The engines behind generation/protocol.py's `Generate`: transformers (with the plan's decoder) and
vLLM, and the one place the plan's engine becomes a callable.

    python -m grpo_pipeline --model tiny --device cpu --stages evaluate --set 'eval.models=[/path/a,/path/b]'

`ENGINES[plan.engine]` is the engine of a run's plan (generation/plan.py decided it);
generation/sharding.py spreads one over the host's accelerators or a cluster's nodes.
"""

from __future__ import annotations

from pathlib import Path
from grpo_pipeline.progress import Bar
from grpo_pipeline.generation.protocol import Generate, GenerationSettings, Response

def transformers_generate(model_dir: Path, prompts: list[list[dict]], settings: GenerationSettings) -> list[list[Response]]:
    """Batched generation with the transformers model, `batch_size` prompts at a time, by the plan's
    decoder (generation/batches.py's `token_generator`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_pipeline.generation.batches import token_generator
    from grpo_pipeline.generation.decode_step import Sampling

    plan = settings.plan
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, settings.dtype),
                                                 attn_implementation=plan.attn_implementation)
    model = model.to(plan.torch_device).eval()
    stop_ids = set(_as_list(model.generation_config.eos_token_id) + [tokenizer.eos_token_id]) - {None}
    generator, _ = token_generator(model, tokenizer, plan, sorted(stop_ids), settings.compile_cache_dir)
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    token_prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    n = settings.samples_per_prompt
    longest = max([len(p) for p in token_prompts] + [settings.max_prompt_length or 0])
    generator.reserve(min(settings.batch_size, len(token_prompts)) * n, longest + settings.max_new_tokens)
    sampling = Sampling(temperature=settings.temperature)
    torch.manual_seed(settings.seed)
    responses: list[list[Response]] = []
    with Bar(total=len(texts), desc=f"evaluate {settings.label or model_dir.name}", unit="prompt") as bar:
        for start in range(0, len(token_prompts), settings.batch_size):
            batch = [p for p in token_prompts[start : start + settings.batch_size] for _ in range(n)]
            out = generator.generate(batch, settings.max_new_tokens, sampling)
            for offset in range(0, len(batch), n):
                group = []
                for ids in out.completions[offset : offset + n]:
                    ended = next((i for i, t in enumerate(ids) if t in stop_ids), None)
                    kept = ids if ended is None else ids[:ended]
                    group.append(Response(text=tokenizer.decode(kept, skip_special_tokens=True), tokens=len(kept),
                                          truncated=ended is None))
                responses.append(group)
            bar.update(len(batch) // n)
    return responses


def vllm_generate(model_dir: Path, prompts: list[list[dict]], settings: GenerationSettings) -> list[list[Response]]:
    """vLLM's offline engine: the chat template applied by vLLM, n samples per prompt, results in
    prompt order; a response cut by max_tokens reports finish_reason "length"."""
    from vllm import LLM, SamplingParams

    engine = LLM(model=str(model_dir), seed=settings.seed, tensor_parallel_size=settings.tensor_parallel_size)
    params = SamplingParams(n=settings.samples_per_prompt, temperature=settings.temperature,
                            max_tokens=settings.max_new_tokens, seed=settings.seed)
    outputs = engine.chat(prompts, params, use_tqdm=False)
    return [
        [Response(text=c.text, tokens=len(c.token_ids), truncated=c.finish_reason == "length") for c in output.outputs]
        for output in outputs
    ]


ENGINES: dict[str, Generate] = {"transformers": transformers_generate, "vllm": vllm_generate}


def engine_label(generate: Generate, settings: GenerationSettings) -> str:
    """What generated, for the evaluation's report: an engine that learns it while running (the
    cluster's nodes) says so in `engine`; otherwise the plan's path, and where it ran."""
    where = getattr(generate, "where", None)
    engine = getattr(generate, "engine", None) or settings.plan.path()
    return f"{engine} ({where})" if where else engine


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
