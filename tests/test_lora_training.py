"""A LoRA run of TRL's GRPOTrainer as the local backend makes it (backends/local/lora.py): the reference policy
is the base model with the adapter disabled (no second copy of the weights), and the export writes the adapter
alone and the merged model (checkpoints/lora_export.py), which reload to the trained policy's logits; verl's LoRA
checkpoint (the PEFT model's state dict in actor/huggingface) exports the same way (backends/verl/lora.py)."""

from __future__ import annotations

import json

import pytest
import torch

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 12 + 30?", "42"), ("What is 7 + 8?", "15"), ("What is 9 + 1?", "10")]


def adapter_active(model) -> bool:
    return any(not module.disable_adapters for module in model.modules() if hasattr(module, "lora_A"))


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Two GRPO steps of a rank-8 adapter with a KL term, every log-prob pass recorded with whether the adapter was on."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_pipeline.backends.local.lora import peft_config
    from grpo_pipeline.profiles.lora import LoraSection

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "truth": a} for q, a in QUESTIONS])
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trainer")), max_steps=2, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, learning_rate=5e-2, beta=0.5, save_strategy="no",
                      report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                      generation_kwargs={"min_new_tokens": 6})

    def reward(completions, **_):  # any spread of rewards: the adapter moves
        return [float(len(set(c[-1]["content"]))) for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=rows, processing_class=tokenizer,
                          peft_config=peft_config(LoraSection(rank=8, alpha=16)))
    passes = []
    score = trainer._get_per_token_logps_and_entropies

    def recorded(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = score(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if not torch.is_grad_enabled():
            passes.append((adapter_active(trainer.model), input_ids, attention_mask, logits_to_keep, out[0].detach()))
        return out

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    return trainer, passes


def logprobs(model, input_ids, attention_mask, logits_to_keep):
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]


def test_the_reference_is_the_base_model_with_the_adapter_disabled(trained, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer, passes = trained
    assert trainer.ref_model is None and "ref" not in trainer.model.peft_config  # no second copy of the weights
    base_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    adapter = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert sum(p.numel() for p in trainer.model.parameters()) == base_parameters + adapter
    references = [p for p in passes if not p[0]]
    assert len(references) == 2  # one reference pass per step, each with the adapter off
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    _, ids, mask, keep, reference = references[-1]
    scored = mask[:, -keep:].bool()
    assert torch.allclose(reference[scored], logprobs(base, ids, mask, keep)[scored], atol=1e-4)
    # The adapter had moved by then: the policy's own log-probs of the same tokens are not the reference's.
    trainer.model.eval()
    policy = logprobs(trainer.model, ids, mask, keep)
    assert (policy[scored] - reference[scored]).abs().max() > 1e-3


def test_the_adapter_alone_and_the_merged_model_reload_to_the_trained_policys_logits(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.checkpoints.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_lora_policy
    from grpo_pipeline.stages.model import verify_hf_dir

    trainer, _ = trained
    checkpoint = tmp_path / "global_step_2"
    trainer.save_model(str(checkpoint))  # what the trainer's checkpoint holds: the adapter and the tokenizer
    adapter, merged = export_lora_policy(checkpoint)
    assert sorted(p.name for p in adapter.iterdir() if p.name.startswith("adapter")) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["r"] == 8
    assert verify_hf_dir(merged)["num_parameters"] == verify_hf_dir(tiny_model_dir)["num_parameters"]
    assert not any("lora" in name for name in AutoModelForCausalLM.from_pretrained(merged).state_dict())

    ids = trainer.processing_class(["What is 3 + 4? The answer", "Add 12 and 30"], return_tensors="pt",
                                   padding=True)
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(**ids).logits
        from_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(**ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        from_adapter = PeftModel.from_pretrained(base, adapter)(**ids).logits
        with trainer.model.disable_adapter():
            untrained = trainer.model(**ids).logits
    assert (expected - untrained).abs().max() > 1e-3  # the adapter changes the logits: the comparison means something
    assert torch.allclose(from_merged, expected, atol=1e-4) and torch.allclose(from_adapter, expected, atol=1e-5)
    assert export_lora_policy(checkpoint) == (adapter, merged)  # a second export uses what is there


def test_a_verl_lora_checkpoint_exports_the_same_way(trained, tiny_model_dir, tmp_path):
    """verl 0.9.1's FSDP checkpoint of a LoRA run: lora_train_meta.json, and the PEFT model's full state dict
    (`base_model.model.<module>.lora_A.default.weight`, ...) in actor/huggingface with hf_model saved."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.backends.verl.lora import merged_policy, verl_adapter

    trainer, _ = trained
    actor = tmp_path / "global_step_2" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    state = {name: tensor.detach().clone().contiguous() for name, tensor in trainer.model.state_dict().items()}
    assert any(".lora_A.default.weight" in name for name in state)
    save_file(state, str(actor / "huggingface" / "model.safetensors"))
    (actor / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}))
    assert verl_adapter(tmp_path) is None  # a step without the adapter's meta is not a LoRA step
    merged = merged_policy(actor.parent, tiny_model_dir)
    assert verl_adapter(actor.parent) == actor / "lora_adapter"
    ids = trainer.processing_class(["What is 3 + 4? The answer"], return_tensors="pt")
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(**ids).logits
        exported = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(**ids).logits
    assert torch.allclose(exported, expected, atol=1e-4)
