"""The local backend across the devices of one host: the same run on 1, 2, 4, 8 training workers (one
per GPU, NCCL; on a CPU host, one per process, gloo), side by side: step time, generated tokens/s,
the scaling ratio against one worker, and the learning curve (seeded, same global batch).

    python3 bench/bench_multi_gpu.py --model qwen3-0.6b --device gpu --workers 1,2,4,8 --out $OUT/multi-gpu.json
    .venv/bin/python bench/bench_multi_gpu.py --workers 1,2 --steps 6            # CPU processes, tiny: a check

Each count runs the pipeline's command line (`--stages train`, its own run folder, the same seed,
data and model), so what is measured is what a user runs: Ray Train workers, checkpoint publishing
from rank 0, the metrics file. The global batch (`data.train_batch_size` prompts x `rollout_n`) is
the same for every count, split over the workers, so the learning curves should agree within noise;
throughput = generated tokens / step time. Steps before `--warmup` (model load, the first round's
compilation) are left out of the times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from grpo_pipeline.backends.metrics import read_metrics  # noqa: E402


def run_once(model: str, device: str, workers: int, steps: int, prompts: int, generations: int, length: int,
             root: Path) -> dict:
    """One pipeline run with `workers` training workers; its step records and wall time."""
    name = f"workers-{workers}"
    command = [sys.executable, "-m", "grpo_pipeline", "--model", model, "--device", device, "--backend", "local",
               "--stages", "train", "--run-dir", str(root / "runs"), "--run-name", name,
               "--set", f"cluster.devices_per_node={workers}", "--set", f"trainer.total_training_steps={steps}",
               "--set", f"trainer.save_freq={steps}", "--set", f"data.train_batch_size={prompts}",
               "--set", f"actor.ppo_mini_batch_size={prompts}", "--set", f"algorithm.rollout_n={generations}",
               "--set", f"data.max_response_length={length}", "--set", f"data.root={root / 'data'}",
               "--set", f"model.root={root / 'models'}"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{workers} workers: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = read_metrics(root / "runs" / name / "metrics.jsonl")
    return {"workers": workers, "wall_s": wall, "records": [r.model_dump() for r in records]}


def summarise(run: dict, warmup: int, completions: int) -> dict:
    timed = [r for r in run["records"] if r["step"] > warmup]
    step_s = statistics.mean(r["step_time_s"] for r in timed)
    tokens = statistics.mean(r["response_length"] * completions for r in timed)
    return {"workers": run["workers"], "mean_step_s": step_s, "tokens_per_s": tokens / step_s,
            "rewards": [r["reward_mean"] for r in run["records"]], "wall_s": run["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, qwen3-0.6b (a Qwen3-0.6B-shape directory is built), or a path")
    parser.add_argument("--device", choices=["cpu", "gpu", "auto"], default="cpu")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare, e.g. 1,2,4,8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step (global; divisible by every count)")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    if bad := [n for n in counts if args.prompts * args.generations % n]:
        raise SystemExit(f"--prompts x --generations = {args.prompts * args.generations} does not split over {bad} workers")
    with tempfile.TemporaryDirectory(prefix="multi-gpu-") as scratch:
        root, model = Path(scratch), args.model
        if model == "qwen3-0.6b":
            from bench_local_backend import make_model

            model = str(root / "qwen3-0.6b-shape")
            make_model("qwen3-0.6b", Path(model))
        runs = [run_once(model, args.device, n, args.steps, args.prompts, args.generations, args.completion_length, root)
                for n in counts]
    summary = [summarise(run, args.warmup, args.prompts * args.generations) for run in runs]
    base = summary[0]
    print("| workers | mean step s | tokens/s | scaling vs 1 | per worker | reward by step |")
    print("|---|---|---|---|---|---|")
    for row in summary:
        row["scaling"] = row["tokens_per_s"] / base["tokens_per_s"]
        curve = " ".join(f"{r:.2f}" for r in row["rewards"])
        print(f"| {row['workers']} | {row['mean_step_s']:.3f} | {row['tokens_per_s']:.0f} | {row['scaling']:.2f} | "
              f"{row['scaling'] / row['workers'] * base['workers']:.2f} | {curve} |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summary},
                                       indent=1, default=str))


if __name__ == "__main__":
    main()
