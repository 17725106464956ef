"""The model, prompts and TRL generation config the decode benches share (bench_decode_floor.py,
decode_checks.py, bench_vllm_decode.py, profile_decode_step.py): random-weight Qwen3 shapes (only time
matters), the pipeline's arith prompts with the chat template applied, and TRL 1.16's own rollout config.
"""

from __future__ import annotations

SHAPES = {  # Qwen3 shapes (random weights: only time matters)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
}


def build_model(shape: str, vocab: int, device: str, tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = (4, 2, 16) if shape == "tiny" else (16, 8, 128)
    config = Qwen3Config(vocab_size=vocab, num_attention_heads=heads[0], num_key_value_heads=heads[1],
                         head_dim=heads[2], max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def chat_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """`count` arith prompts (the pipeline's demo task) as token ids, chat template applied."""
    from grpo_pipeline.data.rl_data import arith_splits

    rows = arith_splits(8, count, seed=seed)["test"].to_pylist()
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in rows]


def trl_generation_config(tokenizer, new_tokens: int, fast: bool, dynamic: bool = False):
    """The GenerationConfig TRL 1.16's GRPOTrainer builds for its own `generate` (grpo_trainer.py,
    `generation_kwargs` then `GenerationConfig(**generation_kwargs, disable_compile=True)`) with
    GRPOConfig's defaults (temperature 1, top_p 1, top_k 0, no min_p, repetition_penalty 1); `fast`:
    the current path on top of it (static cache, the decode step compiled: generation/compiled.py);
    `dynamic`: its step compiled with dynamic shapes from the first call, as transformers' default
    (dynamic=None) compiles it from the second shape on."""
    from transformers import CompileConfig, GenerationConfig

    from grpo_pipeline.generation.compiled import compiled_decoding

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=[tokenizer.eos_token_id], temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                              repetition_penalty=1.0, cache_implementation="static" if fast else None,
                              disable_compile=True)
    if fast:
        compiled_decoding(config, accelerated=True)
        if dynamic:
            config.compile_config = CompileConfig(dynamic=True)
    return config
