"""Run by tests/e2e/test_fast_generation.py in a child process (compiling leaves inductor's worker
pools in the process): the native decoder compiled on the CPU (inductor, FlexAttention) against
transformers' eager `generate` on a tiny Qwen3 whose greedy tokens vary (with whole and with split
products), and what inductor's FX graph cache did (TORCHINDUCTOR_CACHE_DIR: a second process hits what
the first compiled). One JSON line.

    TORCHINDUCTOR_CACHE_DIR=/tmp/cache python tests/native_compile_check.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = ["What is 3 + 4?", "What is 12 + 30? Answer with the number only.", "7 * 8 ="]


def main(model_dir: Path) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from grpo_pipeline.generation.decode_step import Splits
    from grpo_pipeline.generation.decoding import NativeDecoder, Sampling

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = Qwen3Config.from_pretrained(model_dir)
    config.initializer_range = 0.3  # the tiny model's own weights repeat one token
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    with torch.no_grad():
        eager = model.generate(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), max_new_tokens=10,
                               do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               disable_compile=True)[:, width:].tolist()
    eos = tokenizer.eos_token_id
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in eager]
    decoder = NativeDecoder(model, [eos], tokenizer.pad_token_id, compile=True)
    runs = [decoder.generate(prompts, 10, Sampling(temperature=0)).completions for _ in range(2)]
    split = NativeDecoder(model, [eos], tokenizer.pad_token_id, compile=True, splits=Splits(o=2, down=2))
    runs.append(split.generate(prompts, 10, Sampling(temperature=0)).completions)  # what a GPU's step splits
    return {"tokens_equal": runs[0] == runs[1] == runs[2] == expected, "rows_differ": len({tuple(r) for r in expected}) > 1,
            "path": decoder.describe(), "fx_graph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_graph_cache_miss": counters["inductor"]["fxgraph_cache_miss"]}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
