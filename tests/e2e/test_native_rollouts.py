"""TRL's GRPOTrainer takes its rollouts from the native decoder at its generation seam
(backends/local/trl_hooks.py), and hands back to its own `generate` what the decoder does not do."""

from __future__ import annotations

import pytest

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 12 + 30?", "42"), ("What is 7 + 8?", "15"), ("What is 100 + 1?", "101")]


def grpo_trainer(model_dir, tmp_path, **config):
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from grpo_pipeline.backends.local.rollouts import NativeRollouts
    from grpo_pipeline.backends.local.trl_hooks import grpo_trainer_class
    from grpo_pipeline.generation.plan import GenerationPlan

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    calls = {"generate": 0}
    generate = model.generate

    def counted(*args, **kwargs):
        calls["generate"] += 1
        return generate(*args, **kwargs)

    model.generate = counted
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "truth": a} for q, a in QUESTIONS * 2])
    lengths: list[int] = []

    def reward(prompts, completions, completion_ids, truth, **_):
        lengths.extend(len(ids) for ids in completion_ids)
        return [float(c[-1]["content"].strip() == t) for c, t in zip(completions, truth)]

    args = GRPOConfig(output_dir=str(tmp_path / "trainer"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                      use_cpu=True, disable_tqdm=True, seed=0, **config)
    trainer = grpo_trainer_class()(model=model, reward_funcs=reward, args=args, train_dataset=rows,
                                   processing_class=tokenizer, native=NativeRollouts(GenerationPlan(decoder="native"), 64))
    return trainer, calls, lengths


def test_native_rollouts_feed_grpo_through_trls_generation_seam(tiny_model_dir, tmp_path):
    trainer, calls, lengths = grpo_trainer(tiny_model_dir, tmp_path, generation_kwargs={"min_new_tokens": 6})
    assert trainer.native_refusal is None
    trainer.train()
    assert calls["generate"] == 0 and trainer.native_decoder() is not None  # transformers' generate never ran
    assert lengths == [6] * 8  # 2 steps x 4 completions; min_new_tokens reached the decoder: every completion full length
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2 and all(entry["completions/mean_length"] == 6 for entry in logged)


@pytest.mark.parametrize("config, refusal", [({"min_p": 0.1}, "min_p / repetition_penalty"),
                                             ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, "generation_kwargs")])
def test_what_the_decoder_does_not_do_goes_to_trls_own_generate(tiny_model_dir, tmp_path, config, refusal):
    trainer, calls, lengths = grpo_trainer(tiny_model_dir, tmp_path, **config)
    assert trainer.native_refusal.startswith(refusal)
    trainer.train()
    assert calls["generate"] == 2 and len(lengths) == 8
