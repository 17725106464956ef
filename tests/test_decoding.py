"""The native decoder (generation/decoding.py) on the CPU, in float32, against transformers' eager
`generate` on the same tiny random models: the same greedy tokens and log-probs for Llama, Qwen2
(q/k/v biases) and Qwen3 (q/k norms) with left padding; end-of-sequence, max length, min_new_tokens,
left truncation, a smaller batch in a larger cache, weights changed in place, sampling, and models it
cannot run."""

from __future__ import annotations

import pytest
import torch

from grpo_pipeline.generation.decode_step import Splits, product_splits
from grpo_pipeline.generation.decoding import NativeDecoder, Sampling, unsupported

QUESTIONS = ["What is 3 + 4?", "What is 12 + 30? Answer with the number only.", "7 * 8 =", "Add 100 and 1, then 123456."]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")


def random_model(kind: str, tokenizer, **overrides):
    """A 2-layer model with weights large enough that greedy tokens vary (the flow's `tiny` repeats one token)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    config = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.update(overrides)
    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[kind]
    torch.manual_seed(0)
    return model_class(config_class(**config)).eval()


def chat_ids(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]


def eager_generate(model, tokenizer, prompts, new_tokens: int, eos: int, **kwargs):
    """transformers' eager `generate` (dynamic cache), greedy: new tokens cut after end-of-sequence, log-probs."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, output_logits=True,
                             return_dict_in_generate=True, disable_compile=True, **kwargs)
    tokens = out.sequences[:, width:]
    logprobs = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    rows = [row[: row.index(eos) + 1] if eos in row else row for row in tokens.tolist()]
    return rows, [lp[: len(r)] for lp, r in zip(logprobs.tolist(), rows)]


@pytest.mark.parametrize("kind, overrides", [("qwen3", {"head_dim": 16}), ("llama", {}), ("qwen2", {})])
def test_greedy_tokens_and_logprobs_are_generates_with_left_padding(tokenizer, kind, overrides):
    model = random_model(kind, tokenizer, **overrides)
    prompts = chat_ids(tokenizer)
    assert len({len(p) for p in prompts}) > 1  # the batch is left-padded
    expected, expected_logprobs = eager_generate(model, tokenizer, prompts, 20, tokenizer.eos_token_id)
    out = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id).generate(prompts, 20, Sampling(temperature=0))
    assert out.completions == expected
    assert len({tuple(c) for c in expected}) == len(prompts)  # the rows differ: the comparison means something
    assert max(abs(a - b) for mine, theirs in zip(out.logprobs, expected_logprobs) for a, b in zip(mine, theirs)) < 1e-4
    assert out.prompt_lengths == [len(p) for p in prompts] and out.steps == 19


def test_products_split_over_their_inner_dimension_give_generates_tokens(tokenizer):
    model = random_model("qwen3", tokenizer, head_dim=16)
    prompts = chat_ids(tokenizer)
    expected, expected_logprobs = eager_generate(model, tokenizer, prompts, 12, tokenizer.eos_token_id)
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id,
                            splits=Splits(qkv=2, o=4, gate_up=2, down=4))
    out = decoder.generate(prompts, 12, Sampling(temperature=0))
    assert out.completions == expected
    assert max(abs(a - b) for mine, theirs in zip(out.logprobs, expected_logprobs) for a, b in zip(mine, theirs)) < 1e-4


def test_a_step_that_cannot_be_captured_gives_up_one_feature_at_a_time(tokenizer, monkeypatch):
    model = random_model("qwen3", tokenizer, head_dim=16)
    prompts = chat_ids(tokenizer)
    expected, _ = eager_generate(model, tokenizer, prompts, 6, tokenizer.eos_token_id)
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, splits=Splits(o=2, down=2))
    decoder.cuda_graphs = True  # as on a GPU, where a missing feature makes the capture fail (on any host here)
    monkeypatch.setattr(decoder, "_graph", lambda ws, sampling: (_ for _ in ()).throw(RuntimeError("no capture")))
    assert decoder.generate(prompts, 6, Sampling(temperature=0)).completions == expected
    assert [note.split(" (")[0] for note in decoder.notes] == ["split products failed", "CUDA graph capture failed"]
    assert decoder.splits_for(len(prompts)) == Splits() and not decoder.cuda_graphs
    assert "split products failed" in decoder.describe()


def test_only_the_narrowing_products_of_a_small_batch_are_split():
    qwen3_06b, qwen3_17b = (1024, 2048, 2048, 3072), (2048, 2048, 2048, 6144)  # hidden, q, k+v, intermediate
    for dims in (qwen3_06b, qwen3_17b):
        assert product_splits(*dims, batch=64) == Splits(qkv=1, o=4, gate_up=1, down=4)
        assert product_splits(*dims, batch=256) == Splits(qkv=1, o=2, gate_up=1, down=2)
    assert product_splits(64, 64, 32, 128, batch=4) == Splits()  # slices of >= 384 only
    assert product_splits(896, 896, 256, 4864, batch=16) == Splits(o=2, down=4)  # Qwen2.5-0.5B: 896 = 2 x 448


def test_the_sampler_draws_from_softmax_across_vocabulary_chunks():
    from grpo_pipeline.generation.decode_step import VOCAB_CHUNK, choose_token

    vocab = 2 * VOCAB_CHUNK + 5  # three chunks, the last one short
    support = [0, 1, VOCAB_CHUNK - 1, VOCAB_CHUNK, vocab - 1]
    logits = torch.full((20000, vocab), float("-inf"))
    logits[:, support] = torch.tensor([0.0, 1.0, 2.0, -1.0, 1.5])
    forbidden = torch.zeros_like(logits, dtype=torch.bool)
    forbidden[:, 1] = True  # an end-of-sequence id held back this step
    torch.manual_seed(0)
    token, logprob = choose_token(logits, forbidden, Sampling(temperature=1.0))
    allowed = logits.masked_fill(forbidden, float("-inf"))
    expected = torch.softmax(allowed[0, support], -1)
    counts = torch.bincount(token, minlength=vocab)
    assert counts.sum() == counts[support].sum() and counts[1] == 0  # nothing outside the support
    assert torch.allclose(counts[support] / len(token), expected, atol=0.015)
    assert torch.allclose(logprob, allowed.log_softmax(-1).gather(-1, token[:, None])[:, 0], atol=1e-5)
    ties = torch.zeros(2, vocab)
    ties[:, [VOCAB_CHUNK - 1, VOCAB_CHUNK, vocab - 1]] = 3.0  # the first of equal maxima, as torch.argmax
    greedy, _ = choose_token(ties, torch.zeros_like(ties, dtype=torch.bool), Sampling(temperature=0))
    assert greedy.tolist() == [VOCAB_CHUNK - 1] * 2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager FlexAttention: the CPU's
def test_flex_attention_sees_what_matmul_attention_sees(tokenizer):
    model = random_model("qwen3", tokenizer, head_dim=16)
    prompts = chat_ids(tokenizer)
    runs = [NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, attention=attention)
            .generate(prompts, 6, Sampling(temperature=0)) for attention in ("matmul", "flex")]
    assert runs[0].completions == runs[1].completions


def test_end_of_sequence_ends_a_row_which_then_stays_finished(tokenizer):
    model = random_model("llama", tokenizer)
    prompts = chat_ids(tokenizer)
    free, _ = eager_generate(model, tokenizer, prompts, 10, tokenizer.eos_token_id)
    eos = free[1][3]  # a token row 1 emits at its 4th step: declared end-of-sequence
    expected, _ = eager_generate(model, tokenizer, prompts, 10, eos)
    out = NativeDecoder(model, [eos], tokenizer.pad_token_id, check_every=2).generate(prompts, 10, Sampling(temperature=0))
    assert out.completions == expected and out.completions[1][-1] == eos and len(out.completions[1]) <= 4
    assert out.truncated == [eos not in row for row in expected] and not out.truncated[1]
    assert all(len(row) == 10 for row, cut in zip(out.completions, out.truncated) if cut)  # max length


def test_min_new_tokens_holds_end_of_sequence_back(tokenizer):
    model = random_model("llama", tokenizer)
    prompts = chat_ids(tokenizer)
    free, _ = eager_generate(model, tokenizer, prompts, 8, tokenizer.eos_token_id)
    eos = free[0][1]
    expected, _ = eager_generate(model, tokenizer, prompts, 8, eos, min_new_tokens=5)
    out = NativeDecoder(model, [eos], tokenizer.pad_token_id).generate(prompts, 8, Sampling(temperature=0, min_new_tokens=5))
    assert out.completions == expected and all(len(row) >= 5 for row in out.completions)


def test_long_prompts_keep_their_last_tokens(tokenizer):
    model = random_model("qwen2", tokenizer, max_position_embeddings=40)
    prompts = chat_ids(tokenizer)
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    cut = decoder.generate(prompts, 8, Sampling(temperature=0), max_prompt_tokens=10)
    assert cut.prompt_lengths == [min(10, len(p)) for p in prompts]
    assert cut.completions == decoder.generate([p[-10:] for p in prompts], 8, Sampling(temperature=0)).completions
    context = decoder.generate(prompts, 30, Sampling(temperature=0))  # 40 positions: prompts keep their last 10
    assert context.prompt_lengths == [min(10, len(p)) for p in prompts]
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        decoder.generate(prompts, 40)


def test_a_smaller_batch_decodes_in_a_larger_cache_as_alone(tokenizer):
    model = random_model("qwen3", tokenizer, head_dim=16)
    prompts = chat_ids(tokenizer)
    alone = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id).generate(prompts[:2], 10, Sampling(temperature=0))
    shared = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    shared.reserve(8, 300)
    shared.generate(prompts, 10, Sampling(temperature=0))
    assert shared.generate(prompts[:2], 10, Sampling(temperature=0)).completions == alone.completions


def test_a_prefill_in_chunks_of_rows_gives_the_same_tokens(tokenizer, monkeypatch):
    model = random_model("llama", tokenizer)
    prompts = chat_ids(tokenizer)
    whole = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id).generate(prompts, 8, Sampling(temperature=0))
    monkeypatch.setattr("grpo_pipeline.generation.decoding.PREFILL_TOKENS", 2 * max(len(p) for p in prompts))  # two rows at a time
    chunked = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id).generate(prompts, 8, Sampling(temperature=0))
    assert chunked.completions == whole.completions


def test_weights_changed_in_place_reach_the_next_generate(tokenizer):
    model = random_model("qwen2", tokenizer)
    prompts = chat_ids(tokenizer)
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    before = decoder.generate(prompts, 10, Sampling(temperature=0)).completions
    with torch.no_grad():  # what an optimizer step does: the same tensors, new values
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-2.0)
            layer.mlp.up_proj.weight.mul_(1.5)
            layer.self_attn.q_proj.bias.add_(0.5)
    expected, _ = eager_generate(model, tokenizer, prompts, 10, tokenizer.eos_token_id)
    after = decoder.generate(prompts, 10, Sampling(temperature=0)).completions
    assert after == expected and after != before


def test_sampling_draws_from_the_model_and_reports_the_trainers_logprobs(tokenizer):
    model = random_model("qwen3", tokenizer, head_dim=16)
    prompts = chat_ids(tokenizer) * 2
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    torch.manual_seed(1)
    first = decoder.generate(prompts, 10, Sampling(temperature=0.7))
    torch.manual_seed(1)
    assert decoder.generate(prompts, 10, Sampling(temperature=0.7)).completions == first.completions  # seeded
    assert len({tuple(c) for c in first.completions}) > len(chat_ids(tokenizer))  # one prompt, several responses
    # the trainer's forward over prompt + completion, logits / temperature
    for prompt, completion, logprobs in zip(prompts, first.completions, first.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        trainer = (logits / 0.7).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), trainer, atol=1e-4)
    greedy = decoder.generate(prompts, 10, Sampling(temperature=0)).completions
    assert decoder.generate(prompts, 10, Sampling(temperature=1.0, top_k=1)).completions == greedy
    assert decoder.generate(prompts, 10, Sampling(temperature=1.0, top_p=1e-6)).completions == greedy


def test_models_it_cannot_run_are_named(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in unsupported(gpt2)
    assert unsupported(random_model("llama", tokenizer, hidden_act="gelu")) == "an MLP other than SiLU-gated without bias"
    assert unsupported(random_model("qwen3", tokenizer, head_dim=16)) is None
    with pytest.raises(ValueError, match="native decoding cannot run this model: model type 'gpt2'"):
        NativeDecoder(gpt2, [0], 0)


def test_cuda_gpus_decode_natively_by_default_and_the_old_paths_stay_selectable():
    from grpo_pipeline.stages.plan import resolve_profile
    from grpo_pipeline.generation.plan import plan_generation
    from grpo_pipeline.stages.evaluate import EvalSettings

    gpu, cpu, npu = (resolve_profile(model, kind) for model, kind in (("tiny", "gpu"), ("tiny", "cpu"),
                                                                        ("qwen3.5-122b-a10b", "npu")))
    plans = [plan_generation(p) for p in (gpu, cpu, npu)]
    assert [plan.decoder for plan in plans] == ["native", "generate", "generate"]  # no vllm importable here
    assert plans[0].describe() == ("native decoding (static KV cache, compiled step captured in a CUDA "
                                   "graph, sampling on the device; Llama-family models), 4 step(s)' "
                                   "prompts per generation")
    assert EvalSettings.from_profile(gpu, plans[0]).plan.decoder == "native"
    assert EvalSettings.from_profile(cpu, plans[1]).plan.decoder == "generate"
    assert EvalSettings.from_profile(gpu, plans[0]).compile_cache_dir.endswith("torch-compile-cache")
    old = plan_generation(resolve_profile("tiny", "gpu", overrides=["generation.decoder=generate"]))
    assert old.describe().startswith("transformers generate (static cache, compiled decoding")
    native_cpu = plan_generation(resolve_profile("tiny", "cpu", overrides=["generation.decoder=native"]))
    assert native_cpu.describe().startswith("native decoding (static KV cache, eager step,")
