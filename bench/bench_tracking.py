"""What experiment tracking costs: the demo's training with no tracker and with each one, side by side.

    .venv/bin/python bench/bench_tracking.py [--model tiny] [--steps 6] [--rounds 1] [--out bench/results-cpu-tracking.json]

Each variant is a whole command-line run of the data, model and train stages (`python -m flows.grpo`, a
fresh process, its own Prefect API, a local Ray), in the same run of this script, the variants in
turn and alternated across rounds. MLflow logs to a real `mlflow server` (SQLite, HTTP on 127.0.0.1)
that the bench starts; W&B runs offline; TensorBoard writes event files. From each run's files:
- `step_s`: the median training step (metrics.jsonl `step_time_s`, measured by the training worker);
- `train_s_per_step`: the train stage's wall time (timings.json) over the steps: what the run waits;
- `open_s`: opening the tracker run after planning (timings.json `open_tracker_run`).
Ratios are each variant's over `none` of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from backends.metrics import read_metrics  # noqa: E402
from mlflow_server import mlflow_server  # noqa: E402

VARIANTS = {
    "none": [],
    "mlflow": ["tracking.trackers=[mlflow]"],
    "wandb": ["tracking.trackers=[wandb]", "tracking.wandb.mode=offline"],
    "tensorboard": ["tracking.trackers=[tensorboard]"],
}


def run(model: str, root: Path, name: str, steps: int, settings: list[str], env: dict) -> dict:
    overrides = [f"data.root={root / 'data'}", f"model.root={root / 'models'}", f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=-1", *settings]
    command = [sys.executable, "-m", "flows.grpo", "--model", model, "--device", "cpu", "--run-dir", str(root),
               "--run-name", name, "--stages", "fetch_dataset,prepare_checkpoint,train",
               *(arg for item in overrides for arg in ("--set", item))]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    timings = json.loads((root / name / "timings.json").read_text())
    records = read_metrics(root / name / "metrics.jsonl")
    return {"step_s": statistics.median(r.step_time_s for r in records), "train_s_per_step": timings["train"] / steps,
            "open_s": timings.get("open_tracker_run", 0.0), "wall_s": wall, "steps": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    env = {**os.environ, "TQDM_DISABLE": "1", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wandb-config")}
    env.pop("PREFECT_API_URL", None)
    rounds: list[dict[str, dict]] = []
    with mlflow_server(root) as url:
        env["MLFLOW_TRACKING_URI"] = url
        run(args.model, root, "warm-up", 1, [], env)  # fills the data and model stores
        for index in range(args.rounds):
            names = list(VARIANTS) if index % 2 == 0 else list(reversed(VARIANTS))
            measured = {}
            for variant in names:
                measured[variant] = run(args.model, root, f"r{index}-{variant}", args.steps, VARIANTS[variant], env)
                print(f"round {index + 1} {variant}: {json.dumps(measured[variant])}", flush=True)
            rounds.append(measured)
    summary = {}
    for variant in VARIANTS:
        step_ratio = [r[variant]["step_s"] / r["none"]["step_s"] for r in rounds]
        stage_ratio = [r[variant]["train_s_per_step"] / r["none"]["train_s_per_step"] for r in rounds]
        summary[variant] = {
            "step_s": statistics.median(r[variant]["step_s"] for r in rounds),
            "train_s_per_step": statistics.median(r[variant]["train_s_per_step"] for r in rounds),
            "open_s": statistics.median(r[variant]["open_s"] for r in rounds),
            "step_ratio_vs_none": statistics.median(step_ratio),
            "train_stage_ratio_vs_none": statistics.median(stage_ratio),
            "spread_train_stage_ratio": [min(stage_ratio), max(stage_ratio)],
        }
    print(f"{'variant':12} {'step s':>8} {'x none':>7} {'train s/step':>13} {'x none':>7} {'open s':>7}")
    for variant, row in summary.items():
        print(f"{variant:12} {row['step_s']:8.2f} {row['step_ratio_vs_none']:7.2f} {row['train_s_per_step']:13.2f} "
              f"{row['train_stage_ratio_vs_none']:7.2f} {row['open_s']:7.2f}")
    result = {"bench": "tracking", "model": args.model, "steps": args.steps, "rounds": rounds, "summary": summary,
              "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
              "note": "shared 2-core machine, other work running: ratios are side by side in one run"}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
