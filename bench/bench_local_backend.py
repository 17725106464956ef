"""The local backend (the device's generation settings) vs a bare TRL GRPOTrainer script (TRL's own
generation: eager, dynamic cache, one step's prompts at a time), same model, data and reward.

    .venv/bin/python bench/bench_local_backend.py                                   # CPU, tiny
    python bench/bench_local_backend.py --model qwen3-0.6b --device gpu --steps 12 --warmup 4

Both sides train the same model on the same arith prompts with the same GRPOConfig (derived once
from the profile) except for generation, the arith reward, and a fixed completion length (min = max
new tokens), in one process / one Ray Train worker with the same cores. The bare side is what a
person would write: load, GRPOTrainer, train. The local backend side is `train_local` with the
profile's `generation` section (on a GPU: the native decoder, its step compiled and captured in a
CUDA graph, 4 steps' prompts per generation): Ray Train worker, metrics file, checkpoint publishing.
After `--warmup` steps (keep it a multiple of the steps per generation: the first round compiles),
per side: mean step time (a round generates on one step and reuses on the others, so the mean, not
the median), generated tokens/s, and decode time per token (time generating / tokens per sequence);
the ratio of tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402

from grpo_pipeline.backends.local.driver import train_local  # noqa: E402
from grpo_pipeline.backends.metrics import StepMetrics  # noqa: E402
from grpo_pipeline.backends.local.settings import LocalTrainSettings, plan_local_training  # noqa: E402
from grpo_pipeline.generation.plan import plan_generation  # noqa: E402
from grpo_pipeline.backends.local.worker import GenerationTimer, training_rows  # noqa: E402
from grpo_pipeline.stages.plan import resolve_profile  # noqa: E402
from grpo_pipeline.data.builtin_models import build_tiny, train_tiny_tokenizer  # noqa: E402
from grpo_pipeline.data.rl_data import arith_splits  # noqa: E402


def make_model(name: str, out: Path) -> None:
    if name == "tiny":
        build_tiny(out)
        return
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3-0.6B's shape with a small vocabulary (random weights: only the time matters).
    tokenizer = train_tiny_tokenizer(512, seed=0)
    config = Qwen3Config(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def bare_trl(settings: LocalTrainSettings) -> list[float]:
    """The plain script: no Ray, no callbacks of ours, the same GRPOConfig."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig

    from grpo_pipeline.backends.local.trl_hooks import grpo_trainer_class

    from grpo_pipeline.rewards.builtin import arith_score

    set_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=getattr(torch, settings.dtype))
    model = model.to(settings.platform.torch_device)
    rows = training_rows(settings, tokenizer, datasets)

    def reward(prompts, completions, ground_truth, **_):
        return [arith_score(c[-1]["content"], truth).reward for c, truth in zip(completions, ground_truth)]

    times: list[tuple[float, float]] = []
    timer = GenerationTimer()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                times.append((time.perf_counter() - self.started, timer.take()))

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=settings.max_steps, save_strategy="no", logging_steps=1,
                      report_to=[], seed=settings.seed, use_cpu=not settings.platform.accelerated,
                      bf16=settings.dtype == "bfloat16", disable_tqdm=True, **settings.grpo.model_dump())
    # TRL's own rollouts and loss; the pipeline's trainer class only for its generation timer (and its
    # epoch-seeded order, whose first epoch is TRL's).
    trainer = grpo_trainer_class()(model=model, reward_funcs=reward, args=args, train_dataset=rows, processing_class=tokenizer, timer=timer,
                          callbacks=[StepTimer()])
    trainer.train()
    del trainer, model
    if settings.platform.torch_device == "cuda":
        torch.cuda.empty_cache()
    return times


def local_backend(settings: LocalTrainSettings) -> list[tuple[float, float]]:
    import ray

    records: list[StepMetrics] = []
    try:
        train_local(settings, None, None, on_step=records.append, run_name="bench")
    finally:
        ray.shutdown()  # no Ray processes left to compete with the next bare run
    return [(r.step_time_s, r.generation_s or 0.0) for r in sorted(records, key=lambda r: r.step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "qwen3-0.6b"], default="tiny")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (keep it a multiple of the steps per generation)")
    parser.add_argument("--rounds", type=int, default=2, help="bare / local pairs, alternating")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-local-"))
    model_dir, train_file = work / "model", work / "train.parquet"
    make_model(args.model, model_dir)
    pq.write_table(arith_splits(args.prompts * args.steps, 8, seed=0)["train"], train_file)
    completions = args.prompts * args.generations
    overrides = [
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.ppo_micro_batch_size_per_gpu={completions}", f"algorithm.rollout_n={args.generations}",
        f"data.max_response_length={args.completion_length}", "data.max_prompt_length=512",
        f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={args.steps}", "cluster.devices_per_node=1",
    ]
    # TRL's own generation, for the bare script: eager, dynamic cache, each step's prompts on their own.
    plain = ["generation.cache=dynamic", "generation.compile=false", "generation.steps_per_generation=1"]
    devices_here = os.cpu_count() or 1 if args.device == "cpu" else 1
    sides = {}
    for name, extra in (("bare_trl", plain), ("local_backend", [])):
        profile = resolve_profile("tiny", args.device, overrides=overrides + extra)
        sides[name] = plan_local_training(profile, [str(train_file)], str(model_dir), work / "run", devices_here,
                                          plan_generation(profile))
        full_length = sides[name].grpo.model_copy(update={"generation_kwargs": {"min_new_tokens": args.completion_length}})
        sides[name] = sides[name].model_copy(update={"grpo": full_length})  # every completion full length
    fast = sides["local_backend"].generation
    described = fast.describe()
    print(f"local backend generation: {described}", flush=True)

    timed: dict[str, list[tuple[float, float]]] = {"bare_trl": [], "local_backend": []}
    for round_index in range(args.rounds):
        order = ("bare_trl", "local_backend") if round_index % 2 == 0 else ("local_backend", "bare_trl")
        for name in order:
            run = sides[name].model_copy(update={"run_dir": str(work / f"run-{round_index}-{name}")})
            steps = (bare_trl if name == "bare_trl" else local_backend)(run)[args.warmup:]
            timed[name].extend(steps)
            print(f"round {round_index} {name}: mean {statistics.fmean(t for t, _ in steps):.3f} s/step over "
                  f"{len(steps)} steps", flush=True)
    tokens_per_step = completions * args.completion_length
    result = {"model": args.model, "device": args.device, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds, "completions_per_step": completions, "completion_length": args.completion_length,
              "local_generation": described}
    for name, steps in timed.items():
        step_s = statistics.fmean(t for t, _ in steps)
        generating = sum(g for _, g in steps)
        rounds = sum(1 for _, g in steps if g > 0) or 1
        result[name] = {
            "s_per_step": round(step_s, 4), "tokens_per_s": round(tokens_per_step / step_s, 1),
            "generate_share": round(generating / sum(t for t, _ in steps), 3),
            "decode_ms_per_token": round(1000 * generating / rounds / args.completion_length, 3),
            "step_s_min_max": [round(min(t for t, _ in steps), 3), round(max(t for t, _ in steps), 3)],
        }
    result["speedup_tokens_per_s"] = round(result["local_backend"]["tokens_per_s"] / result["bare_trl"]["tokens_per_s"], 2)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
