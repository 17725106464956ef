"""What experiment tracking costs: the demo's training with no tracker and with each one, side by side.

    .venv/bin/python bench/bench_tracking.py [--model tiny] [--steps 6] [--rounds 1] [--out bench/results-cpu-tracking.json]

Each variant is a whole command-line run of the data, model and train stages (`python -m grpo_pipeline`, a
fresh process, its own Prefect API, a local Ray), in the same run of this script, the variants in
turn and alternated across rounds. MLflow logs to a real `mlflow server` (SQLite, HTTP on 127.0.0.1)
that the bench starts; W&B runs offline; TensorBoard writes event files. From each run's files:
- `step_s`: the median training step (metrics.jsonl `step_time_s`, measured by the training worker);
- `train_s_per_step`: the train stage's wall time (timings.json) over the steps: what the run waits;
- `open_s`: opening the tracker run after planning (timings.json `open_tracker_run`).
Ratios are each variant's over `none` of the same round.

`--log-calls N` measures instead what one training step's record costs the flow's process in each
tool: N `log_step` calls (the nine `train/*` metrics of a step) into a tracker run opened as a run opens
it, the tools alternated in blocks of 10; it adds `log_step_ms` to the `--out` file when that exists.

`--fault-steps N` measures what MLflow going away costs training (issue 44): N steps through the train
stage's `StepTracking` (metrics.jsonl written first, as the training side does) while the server
answers, then N while its port takes connections and never answers; the ratio of the second's mean
step cost to the first's, and the connections the silent port took (one per 30 s wait at most).
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

from grpo_pipeline.backends.metrics import read_metrics  # noqa: E402
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
    command = [sys.executable, "-m", "grpo_pipeline", "--model", model, "--device", "cpu", "--run-dir", str(root),
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


def log_step_cost(root: Path, url: str, calls: int) -> dict[str, float]:
    """Milliseconds per logged step, per tool (median of the blocks)."""
    from grpo_pipeline.backends.metrics import StepMetrics
    from grpo_pipeline.tracking.session import tracking_session
    from grpo_pipeline.tracking.trackers import start_tracking
    from grpo_pipeline.tasks.tracking import step_values
    from grpo_pipeline.profiles.tracking import TrackingSection

    record = StepMetrics(step=1, reward_mean=0.5, reward_std=0.1, kl=0.01, loss=0.2, entropy=2.0, response_length=12.0,
                         tokens_per_s=100.0, step_time_s=1.0, generation_s=0.5, learning_rate=1e-3, time=time.time())
    sessions, blocks = {}, {}
    for tool in ("mlflow", "wandb", "tensorboard"):
        settings = TrackingSection(trackers=[tool], mlflow={"tracking_uri": url}, wandb={"mode": "offline"})
        run_dir = root / f"log-calls-{tool}"
        run_dir.mkdir()
        start_tracking(settings, run_dir, run_dir.name, {"model.name": "tiny"}, {"backend": "local"}, print)
        context = tracking_session(settings, run_dir, run_dir.name)
        sessions[tool], blocks[tool] = (context, context.__enter__()), []
    step = 0
    for _ in range(max(1, calls // 10)):
        for tool, (_, session) in sessions.items():
            started = time.perf_counter()
            for _ in range(10):
                step += 1
                session.log_step(step, step_values(record))
            blocks[tool].append((time.perf_counter() - started) / 10 * 1000)
    for context, _ in sessions.values():
        context.__exit__(None, None, None)
    return {tool: statistics.median(values) for tool, values in blocks.items()}


def fault_cost(root: Path, steps: int) -> dict[str, float]:
    """Mean seconds a step costs the flow while MLflow answers, then while it is silent."""
    from uuid import uuid4

    from grpo_pipeline.backends.metrics import StepMetrics, append_metrics
    from grpo_pipeline.run.folder import RunFolder
    from grpo_pipeline.profiles.loader import resolve_profile
    from grpo_pipeline.stages.device import DeviceInfo
    from grpo_pipeline.tasks.tracking import StepTracking, open_tracker_run
    from mlflow_server import free_port, silent_server

    port, run_dir = free_port(), root / "fault-run"
    run_dir.mkdir()
    profile = resolve_profile("tiny", "cpu", overrides=["tracking.trackers=[mlflow]",
                                                        f"tracking.mlflow.tracking_uri=http://127.0.0.1:{port}"])
    device = DeviceInfo(kind="cpu", count=1, decided_by="requested", reason="bench")

    def train(tracking: StepTracking, numbers: range) -> float:
        started = time.perf_counter()
        for step in numbers:
            record = StepMetrics(step=step, reward_mean=0.5, step_time_s=1.0, time=time.time())
            append_metrics(run_dir / RunFolder.METRICS, record)
            tracking.step(record)
        return (time.perf_counter() - started) / len(numbers)

    with mlflow_server(root, port):
        open_tracker_run(profile, device, {}, run_dir, uuid4(), warn=print)
        tracking = StepTracking(profile, run_dir, logs_itself=False, warn=lambda line: None)
        answering = train(tracking, range(1, steps + 1))
    with silent_server(port) as taken:
        silent = train(tracking, range(steps + 1, 2 * steps + 1))
        connections = len(taken)
    return {"steps": steps, "answering_s_per_step": answering, "silent_s_per_step": silent,
            "silent_over_answering": silent / answering, "silent_connections": connections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--log-calls", type=int, default=0)
    parser.add_argument("--fault-steps", type=int, default=0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    if args.fault_steps:
        cost = fault_cost(root, args.fault_steps)
        print(json.dumps(cost, indent=2))
        if args.out:
            args.out.write_text(json.dumps({"machine": platform.node(), **cost}, indent=2) + "\n")
        return
    if args.log_calls:
        os.environ.update(WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "wandb-config"))
        with mlflow_server(root) as url:
            cost = log_step_cost(root, url, args.log_calls)
        print("ms per logged step: " + ", ".join(f"{tool} {ms:.2f}" for tool, ms in cost.items()))
        if args.out and args.out.is_file():
            result = json.loads(args.out.read_text())
            result["log_step_ms"] = {"calls": args.log_calls, **cost}
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            print(f"added to {args.out}")
        return
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
