"""The native decoder generates with the current LoRA adapter (generation/adapted.py): its log-probs are the
trainer's own, with the adapter on, after every update; a decoder that read the base weights instead (the
silently ignored adapter) is caught."""

from __future__ import annotations

import torch

from grpo_pipeline.generation.decode_step import Sampling

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 12 + 30?", "42")]


def lora_trainer(model_dir, tmp_path, **lora):
    """TRL's GRPOTrainer with the native decoder, given the profile's adapter (rank 8 on every linear layer)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from grpo_pipeline.backends.local.lora import peft_config
    from grpo_pipeline.backends.local.rollouts import NativeRollouts
    from grpo_pipeline.backends.local.trl_hooks import grpo_trainer_class
    from grpo_pipeline.generation.plan import GenerationPlan
    from grpo_pipeline.profiles.lora import LoraSection

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "truth": a} for q, a in QUESTIONS])
    args = GRPOConfig(output_dir=str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                      disable_tqdm=True, seed=0, beta=0.04, bf16=False)  # float32, as a CPU worker trains
    return grpo_trainer_class()(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                                train_dataset=rows, processing_class=tokenizer,
                                native=NativeRollouts(GenerationPlan(decoder="native"), 64),
                                peft_config=peft_config(LoraSection(rank=8, alpha=16, **lora)))


def nudge_adapter(model, scale: float = 0.5, seed: int = 0) -> None:
    """What optimizer steps do to a fresh adapter (B starts at zero: the policy is then the base model)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def trainer_logprobs(trainer, prompts, completions):
    """The trainer's own log-probs of each completion (TRL's method, through its fused LM head, at the
    trainer's temperature 1), a row at a time (unpadded: positions as the decoder has them)."""
    rows = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids),
                                                                     len(completion))
        rows.append(logps[0])
    return rows


def decode(trainer, prompts):
    torch.manual_seed(3)
    return trainer.native_decoder().generate(prompts, 8, Sampling(temperature=1.0))


def prompt_ids(trainer):
    template = trainer.processing_class.apply_chat_template
    return [template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
            for q, _ in QUESTIONS] * 2


def gap(decoded, expected) -> float:
    return max(float((torch.tensor(mine) - theirs).abs().max()) for mine, theirs in zip(decoded, expected))


def test_the_decoders_logprobs_are_the_trainers_with_the_adapter_on(tiny_model_dir, tmp_path):
    trainer = lora_trainer(tiny_model_dir, tmp_path)
    assert trainer.native_refusal is None and trainer.native_decoder() is not None
    nudge_adapter(trainer.model)
    prompts = prompt_ids(trainer)
    out = decode(trainer, prompts)
    assert gap(out.logprobs, trainer_logprobs(trainer, prompts, out.completions)) < 1e-4
    # The adapter matters here: the base model's log-probs of the same tokens are far off.
    with trainer.model.disable_adapter():
        base = trainer_logprobs(trainer, prompts, out.completions)
    assert gap(out.logprobs, base) > 0.05
    # After an update (the same parameters, new values) the next round decodes with the new adapter.
    nudge_adapter(trainer.model, seed=1)
    again = decode(trainer, prompts)
    assert again.completions != out.completions
    assert gap(again.logprobs, trainer_logprobs(trainer, prompts, again.completions)) < 1e-4


def test_a_decoder_that_reads_the_base_weights_is_caught(tiny_model_dir, tmp_path, monkeypatch):
    """The failure this guards against: the adapter's layers read as plain layers (PEFT's `.weight` is the base)."""
    import grpo_pipeline.generation.adapted as adapted

    trainer = lora_trainer(tiny_model_dir, tmp_path)
    nudge_adapter(trainer.model)
    monkeypatch.setattr(adapted, "is_adapted", lambda linear: False)
    prompts = prompt_ids(trainer)
    out = decode(trainer, prompts)
    assert gap(out.logprobs, trainer_logprobs(trainer, prompts, out.completions)) > 0.05


def test_an_adapter_the_decoder_cannot_merge_is_named(tiny_model_dir):
    """An adapter on the embedding (PEFT allows one; the planner does not) would be ignored by a decoder that
    reads the embedding's weight: the decoder says so, and the trainer keeps transformers' generate."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.generation.decoding import unsupported

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    assert unsupported(adapted) == "a LoRA adapter on the embedding or output layer"
