"""Compiled decoding for transformers' `generate`, shared by the local backend's rollouts and the
evaluation stage (the same model doing the same work)."""

from __future__ import annotations


def compiled_decoding(generation_config, accelerated: bool) -> None:
    """Let `generate` compile its decode step (with a static cache: CUDA graphs on a GPU). TRL builds
    its generation config with `disable_compile=True`; transformers compiles by itself only on
    accelerators, so on a CPU the compile config asks for it (where it serves as a correctness check)."""
    from transformers import CompileConfig

    generation_config.disable_compile = False
    if not accelerated:
        generation_config.compile_config = CompileConfig()
        generation_config.compile_config._compile_all_devices = True


def greedy_with_logprobs(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, fast: bool):
    """Greedy responses to chat `prompts` with the generation config TRL's GRPOTrainer builds for
    rollouts (`disable_compile=True`), on the eager path or switched to the fast one (static cache,
    compiled decoding) as the local backend's worker switches it: the generated tokens [batch, new]
    and each token's log-probability under the model [batch, new]. For checking that the two agree."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, cache_implementation="static" if fast else None,
                              disable_compile=True, output_logits=True, return_dict_in_generate=True)
    if fast:
        compiled_decoding(config, accelerated=model.device.type != "cpu")
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    with torch.inference_mode():
        out = model.generate(**batch, generation_config=config)
    tokens = out.sequences[:, batch["input_ids"].shape[1]:]
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    return tokens, logprobs
