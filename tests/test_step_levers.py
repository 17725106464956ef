"""The GRPO step's levers compute what the plain path computes: TRL's fused LM head (log-probs in
chunks, no full logits) against log_softmax over the whole logits, the packed (padding-free) batch
against TRL's padded one (loss and gradients within tolerance), and the phase timer on a real
GRPOTrainer (no reference pass at KL coefficient 0)."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_pipeline.backends.local.packing import pack, packed_logprobs, padding_free, unpack


def tiny_qwen3(vocab: int = 97, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def padded_batch(vocab: int = 97, seed: int = 1):
    """TRL's training layout: prompts padded on the left, completions on the right, lengths that differ."""
    generator = torch.Generator().manual_seed(seed)
    prompts, completions = [5, 9, 3, 7], [6, 2, 8, 4]
    width_p, width_c = max(prompts), max(completions)
    ids = torch.randint(1, vocab, (len(prompts), width_p + width_c), generator=generator)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        mask[row, width_p - p:width_p + c] = 1
    return ids.masked_fill(mask == 0, 0), mask, width_c


class Scorer:
    """What TRL's log-prob method needs of a trainer, nothing more."""

    class accelerator:  # noqa: N801 - stands where the trainer's Accelerator does
        is_main_process = True

        @staticmethod
        def autocast():
            return torch.autocast("cpu", enabled=False)


class Padded(Scorer):
    from trl import GRPOTrainer

    _get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies


class Packed(Scorer):
    """The log-prob method as backends/local/trl_hooks.py's trainer answers it with packing on."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False):
        return packed_logprobs(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                               self.accelerator.autocast)


def fused(model):
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def loss_and_grads(scorer, model, ids, mask, keep, batch_size):
    model.zero_grad()
    logps, entropy, _ = scorer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=batch_size,
                                                                  compute_entropy=True)
    weights = torch.linspace(-1, 1, logps.numel()).view_as(logps)  # an advantage-like weight per token
    loss = (logps * weights).sum() + 0.1 * entropy.sum()
    loss.backward()
    return logps.detach(), entropy.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_fused_lm_head_equals_log_softmax_over_the_whole_logits():
    plain_model = tiny_qwen3()
    fused_model = fused(copy.deepcopy(plain_model))
    ids, mask, keep = padded_batch()
    completion_mask = mask[:, -keep:].float()
    # The plain path: the full (batch, length, vocab) logits, log_softmax, gather.
    logits = plain_model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1]
    plain = torch.gather(logits.log_softmax(-1), 2, ids[:, -keep:, None]).squeeze(-1) * completion_mask
    logps, _, _ = Padded()._get_per_token_logps_and_entropies(fused_model, ids, mask, keep)
    assert torch.allclose(logps * completion_mask, plain, atol=1e-5)
    weights = torch.linspace(-1, 1, plain.numel()).view_as(plain)
    (plain * weights).sum().backward()
    (logps * completion_mask * weights).sum().backward()
    for (name, a), b in zip(plain_model.named_parameters(), fused_model.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("batch_size", [4, 2])
def test_packed_log_probs_loss_and_gradients_equal_the_padded_ones(batch_size):
    model = fused(tiny_qwen3())
    ids, mask, keep = padded_batch()
    padded = loss_and_grads(Padded(), model, ids, mask, keep, batch_size)
    packed = loss_and_grads(Packed(), model, ids, mask, keep, batch_size)
    completion = mask[:, -keep:].bool()
    assert torch.allclose(packed[0][completion], padded[0][completion], atol=1e-5)
    assert (packed[0][~completion] == 0).all()  # padding scores nothing, as TRL's path
    assert torch.allclose(packed[1][completion], padded[1][completion], atol=1e-5)
    assert torch.allclose(packed[2], padded[2], atol=1e-4)
    for name, grad in padded[3].items():
        assert torch.allclose(packed[3][name], grad, atol=1e-5, rtol=1e-4), name


def test_packing_keeps_only_real_tokens_and_restarts_positions():
    ids, mask, keep = padded_batch()
    row, positions, labels, where = pack(ids, mask, keep)
    assert row.shape[1] == int(mask.sum())
    assert positions[0, :5].tolist() == [0, 1, 2, 3, 4] and positions[0, 11:13].tolist() == [0, 1]  # 2nd sequence
    assert int((labels != -100).sum()) == int(mask[:, -keep:].sum())  # completion tokens only
    values = torch.arange(1.0, row.shape[1])[None]  # token q's value at q - 1
    back = unpack(values, where, keep)
    assert back.shape == (4, keep) and (back[mask[:, -keep:] == 0] == 0).all()


def test_packing_is_chosen_only_with_kernels_that_take_packed_rows():
    assert padding_free(True, "flash_attention_2")
    assert not padding_free(True, "sdpa") and not padding_free(False, "flash_attention_2")


def grpo_phases(model_dir, tmp_path, beta: float, steps_per_generation: int, packed: bool = False):
    """One real GRPOTrainer step on the tiny model, timed by phase."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from grpo_pipeline.backends.local.trl_hooks import grpo_trainer_class

    from grpo_pipeline.backends.local.phases import StepPhases
    from grpo_pipeline.data.rl_data import arith_splits

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in arith_splits(8, 2, seed=0)["train"].to_pylist()])
    args = GRPOConfig(output_dir=str(tmp_path / f"out-{beta}"), max_steps=steps_per_generation, per_device_train_batch_size=4,
                      num_generations=4, generation_batch_size=4 * steps_per_generation, max_completion_length=4,
                      beta=beta, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = grpo_trainer_class()(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                                   args=args, train_dataset=rows, processing_class=tokenizer, packed=packed)
    phases = StepPhases.attach(trainer, tmp_path / "phases.jsonl")
    trainer.train()
    return trainer, phases.records


def test_the_phase_timer_sees_each_pass_of_a_real_trainer(tiny_model_dir, tmp_path):
    # KL coefficient 0, one update per round: TRL builds no reference model and reuses the loss's own
    # forward as the old policy's log-probs: neither pass runs.
    trainer, (record,) = grpo_phases(tiny_model_dir, tmp_path, beta=0.0, steps_per_generation=1)
    assert trainer.ref_model is None
    assert record["ref_logprobs"] == 0 and record["old_logprobs"] == 0
    assert min(record["generation"], record["forward_backward"], record["optimizer"], record["other"]) > 0
    assert abs(sum(v for k, v in record.items() if k not in ("step", "wall_s")) - record["wall_s"]) < 1e-3
    # KL on, two updates per round: the round's first step scores the reference and the old policy.
    trainer, records = grpo_phases(tiny_model_dir, tmp_path, beta=0.1, steps_per_generation=2, packed=True)
    assert trainer.ref_model is not None and trainer.args.optim == "adamw_torch_fused"
    assert records[0]["ref_logprobs"] > 0 and records[0]["old_logprobs"] > 0 and records[0]["generation"] > 0
    assert records[1]["generation"] == 0 and records[1]["ref_logprobs"] == 0  # the round's second step reuses it
