"""The native decoder's correctness and compile cache, measured (run by bench/bench_decode_floor.py):

    python3 bench/bench_decode_floor.py --device gpu --out $OUT/decode-floor.json
    python3 bench/decode_checks.py --probe qwen3-0.6b 151936 gpu 64     # one process: start to first token

- greedy: native vs transformers' eager `generate` (dynamic cache, no compilation) on the same model
  and prompts; where a sequence differs, the eager path's logit margin between its token and the
  native one at the first differing position (a near-tie in bf16 is a margin of a few hundredths);
- sampled rollouts (temperature 1): |log p(rollout engine) - log p(trainer forward)| over the sampled
  tokens (mean, p99, max) for the native decoder, the current path (static cache + compiled
  `generate`, its processed scores) and bare TRL (eager `generate`); the trainer forward is the
  model on prompt + completion with the attention mask, logits / temperature, as TRL recomputes them;
- compile cache: two fresh processes in turn with one empty TORCHINDUCTOR_CACHE_DIR: seconds from
  process start to the first generated token, the first compiling, the second loading the compiled
  step from the cache.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _left_padded(prompts, pad: int, device):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    return ids, _mask(prompts, width, device)


def _mask(prompts, width, device):
    import torch

    starts = torch.tensor([width - len(p) for p in prompts], device=device)
    return (torch.arange(width, device=device)[None] >= starts[:, None]).long()


def _cut(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def hf_rollouts(model, tokenizer, prompts, new_tokens: int, fast: bool, greedy: bool):
    """transformers' `generate` with TRL's rollout config (decode_models.trl_generation_config):
    completions (cut after end-of-sequence) and per-token log-probs of its processed scores."""
    import torch

    from decode_models import trl_generation_config

    ids, mask = _left_padded(prompts, tokenizer.pad_token_id, model.device)
    config = trl_generation_config(tokenizer, new_tokens, fast)
    config.min_new_tokens, config.return_dict_in_generate, config.output_scores = None, True, True
    if greedy:
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        config.output_logits = True
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    tokens = out.sequences[:, ids.shape[1]:]
    logprobs = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, tokens[:, t, None])[:, 0]
                            for t, s in enumerate(out.scores)], dim=1)
    completions = [_cut(row, tokenizer.eos_token_id) for row in tokens.tolist()]
    return completions, [lp[: len(c)] for lp, c in zip(logprobs.tolist(), completions)], out


def trainer_logprobs(model, prompts, completions, pad: int, temperature: float, chunk: int = 8):
    """Per-token log-probs of the completions as the trainer's forward computes them."""
    import torch

    out = []
    for first in range(0, len(prompts), chunk):
        rows, comps = prompts[first:first + chunk], completions[first:first + chunk]
        width, length = max(len(p) for p in rows), max(len(c) for c in comps)
        ids = torch.tensor([[pad] * (width - len(p)) + p + c + [pad] * (length - len(c)) for p, c in zip(rows, comps)],
                           device=model.device)
        mask = torch.cat([_mask(rows, width, model.device),
                          torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in comps], device=model.device)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=length + 1).logits[:, :-1].float()
        lps = torch.log_softmax(logits / temperature, -1).gather(-1, ids[:, width:, None])[..., 0].tolist()
        out += [lp[: len(c)] for lp, c in zip(lps, comps)]
    return out


def gap_stats(engine: list[list[float]], trainer: list[list[float]]) -> dict:
    import torch

    diffs = torch.tensor([abs(a - b) for e, t in zip(engine, trainer) for a, b in zip(e, t)])
    return {"tokens": diffs.numel(), "mean": round(diffs.mean().item(), 5),
            "p99": round(diffs.quantile(0.99).item(), 5), "max": round(diffs.max().item(), 5)}


def correctness(shape: str, vocab: int, device: str, tokenizer, batch: int, new_tokens: int) -> dict:
    import torch

    from decode_models import build_model, chat_prompts
    from grpo_pipeline.generation.decoding import NativeDecoder, Sampling

    model = build_model(shape, vocab, device, tokenizer)
    prompts = chat_prompts(tokenizer, batch, seed=1)
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    native = decoder.generate(prompts, new_tokens, Sampling(temperature=0))
    eager, _, out = hf_rollouts(model, tokenizer, prompts, new_tokens, fast=False, greedy=True)
    diverged = []
    for row, (mine, theirs) in enumerate(zip(native.completions, eager)):
        if mine == theirs:
            continue
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        margin = None
        if at < min(len(mine), len(theirs)):
            logits = out.logits[at][row].float()
            margin = round((logits[theirs[at]] - logits[mine[at]]).item(), 4)
        diverged.append({"row": row, "position": at, "eager_margin": margin})
    result = {"model": shape, "vocab": vocab, "sequences": batch, "new_tokens": new_tokens,
              "greedy_identical": batch - len(diverged), "greedy_diverged": diverged}
    gaps = {}
    for name in ("native", "current", "bare_trl"):
        if name == "current" and device != "cuda":
            continue
        torch.manual_seed(2)
        if name == "native":
            sampled = decoder.generate(prompts, new_tokens, Sampling(temperature=1.0))
            completions, logprobs = sampled.completions, sampled.logprobs
        else:
            completions, logprobs, _ = hf_rollouts(model, tokenizer, prompts, new_tokens, name == "current", greedy=False)
        gaps[name] = gap_stats(logprobs, trainer_logprobs(model, prompts, completions, tokenizer.pad_token_id, 1.0))
    result["rollout_vs_trainer_logprob"] = gaps
    del decoder, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def compile_cache_probe(shape: str, vocab: int, device: str, batch: int) -> dict:
    """Two processes in turn, one fresh compile cache: start to first token, each."""
    cache = tempfile.mkdtemp(prefix="decode-compile-cache-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    runs = {}
    for attempt in ("first", "second"):
        started = time.time()
        done = subprocess.run([sys.executable, __file__, "--probe", shape, str(vocab), device, str(batch)], env=env,
                              capture_output=True, text=True, timeout=400)
        if done.returncode != 0:
            runs[attempt] = {"error": done.stderr[-1500:]}
            continue
        runs[attempt] = {**json.loads(done.stdout.strip().splitlines()[-1]), "process_wall_s": round(time.time() - started, 2)}
    return {"model": shape, "vocab": vocab, "sequences": batch, "cache_dir": cache, **runs}


def probe(shape: str, vocab: int, device: str, batch: int) -> dict:
    import torch  # noqa: F401

    from decode_models import build_model, chat_prompts
    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer
    from grpo_pipeline.generation.decoding import NativeDecoder, Sampling

    imported = time.time()
    tokenizer = train_tiny_tokenizer(512, seed=0)
    model = build_model(shape, vocab, "cuda" if device == "gpu" else "cpu", tokenizer)
    prompts = chat_prompts(tokenizer, batch)
    ready = time.time()
    decoder = NativeDecoder(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    decoder.generate(prompts, 1, Sampling(temperature=1.0))
    first = time.time()
    return {"import_s": round(imported - PROCESS_START, 2), "model_and_prompts_s": round(ready - imported, 2),
            "compile_capture_prefill_s": round(first - ready, 2), "start_to_first_token_s": round(first - PROCESS_START, 2)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        name, vocab_size, where, sequences = sys.argv[2:6]
        print(json.dumps(probe(name, int(vocab_size), where, int(sequences))))
