"""The H200 run of issue 32: the pipeline driving real verl 0.9.1 (FSDP engine, vLLM 0.24 rollouts) on a
one-node Ray started as a user starts it, beside the local backend on the same config, and the
failure paths against the real engine. bench/h200_verl.sh runs it; this module holds what the runs
need besides the flow itself, and the results.

    python3 bench/verl_real.py collect --verl /tmp/runs/verl-h200 --local /tmp/runs/local-h200 \\
        --walls $OUT/walls.json --out $OUT/results-h200-verl-real.json --plot $OUT/reward-curves.png
    python3 bench/verl_real.py steps-once /tmp/runs/kill9 8     # every step 1..8 once in metrics.jsonl
    python3 bench/verl_real.py resumed /tmp/runs/stopped         # the rerun resumed from verl's last checkpoint
    .venv/bin/python bench/verl_real.py --check                   # here: the collection on synthetic runs

Accuracy intervals are Wilson 95% intervals over the evaluation's samples (eval/<model>.jsonl, one
`correct` each); step time is the median of the run's steps after the first (the first compiles and
warms the engines); tokens/s is the responses' tokens of those steps (mean length x prompts x group
size) over their summed step time: one definition for both backends, whatever steps each spends
generating (a mean of per-step rates counted steps that reuse a round's rollouts as if they had made them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_pipeline.backends.metrics import StepMetrics, append_metrics, read_metrics  # noqa: E402

# The config both backends run (bench/h200_verl.sh passes it to each): same model, data, seed, batch,
# lengths and steps; only --backend (and the verl engine) differ.
# The recipe's batch (8 prompts x 4) is sized for two CPU cores; on the H200 32 prompts x 8 at the CPU
# demo's learning rate (5e-5: at 1e-5 its accuracy moved inside the noise), one update a step.
COMMON = ["trainer.total_training_steps=40", "trainer.save_freq=10", "trainer.test_freq=-1",
          "cluster.devices_per_node=1", "data.train_batch_size=32", "algorithm.rollout_n=8", "algorithm.lr=5e-5",
          "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=32", "log_prob.micro_batch_size_per_gpu=32",
          # 512 held-out problems (intervals of about +-0.04) leave arith 674 distinct training ones: 640 are 20
          # whole batches an epoch, so 40 steps are 2 epochs (verl stops at its last epoch)
          "data.arith_train_rows=640", "data.arith_test_rows=512", "trainer.total_epochs=2"]
VERL = ["engine.strategy=fsdp"]
# The failure runs (kill -9 of the flow, `ray job stop`): short, with a checkpoint every 4 steps to resume from.
FAILURES = ["trainer.total_training_steps=12", "trainer.save_freq=4"]


def wilson(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return (0.0, 0.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (round(centre - half, 4), round(centre + half, 4))


def accuracy(samples_file: Path) -> dict:
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
    correct = sum(bool(s["correct"]) for s in samples)
    return {"accuracy": round(correct / len(samples), 4), "ci95": wilson(correct, len(samples)), "samples": len(samples)}


def _setting(key: str) -> int:
    return int(next(item.split("=", 1)[1] for item in COMMON if item.startswith(f"{key}=")))


SEQUENCES_PER_STEP = _setting("data.train_batch_size") * _setting("algorithm.rollout_n")


def run_summary(run_dir: Path, wall_s: float | None) -> dict:
    steps = read_metrics(run_dir / "metrics.jsonl")
    timed = steps[1:] or steps
    later = [s.step_time_s for s in timed]
    tokens = sum(s.response_length * SEQUENCES_PER_STEP for s in timed)
    evaluation = {name: accuracy(run_dir / "eval" / f"{name}.jsonl") for name in ("base", "trained")
                  if (run_dir / "eval" / f"{name}.jsonl").is_file()}
    separated = ("base" in evaluation and "trained" in evaluation
                 and evaluation["trained"]["ci95"][0] > evaluation["base"]["ci95"][1])
    return {"run_dir": str(run_dir), "steps": len(steps), "wall_s": wall_s,
            "step_time_s_median": round(statistics.median(later), 3) if later else None,
            "response_tokens_per_s": round(tokens / sum(later), 1) if later and sum(later) > 0 else None,
            "generation_s_median": _median([s.generation_s for s in timed if s.generation_s is not None]),
            "reward_first": steps[0].reward_mean if steps else None, "reward_last": steps[-1].reward_mean if steps else None,
            "reward_curve": [round(s.reward_mean, 4) for s in steps],
            "elapsed_s": [round(sum(s.step_time_s for s in steps[:n]), 2) for n in range(1, len(steps) + 1)],
            "evaluation": evaluation,
            "intervals_separate": separated}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def plot(runs: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_update, by_time) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for name, summary in runs.items():
        by_update.plot(range(1, len(summary["reward_curve"]) + 1), summary["reward_curve"], label=name)
        by_time.plot(summary["elapsed_s"], summary["reward_curve"], label=name)
    by_update.set_xlabel("update (one a step)")
    by_time.set_xlabel("training time, s (the steps' own, start-up left out)")
    by_update.set_ylabel("mean reward (critic/score/mean; the local backend's reward mean)")
    figure.suptitle(f"SmolLM2-135M-Instruct on arith, GRPO, {_card() or 'no GPU'}")
    by_update.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def _card() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - the card's name is a label; its absence changes no figure
        return None


def collect(verl: Path, local: Path, walls: dict, out: Path, picture: Path) -> dict:
    runs = {"verl (FSDP + vLLM 0.24, Ray job)": run_summary(verl, walls.get("verl")),
            "local (TRL on Ray Train)": run_summary(local, walls.get("local"))}
    plot(runs, picture)
    result = {"command": "bash bench/h200_verl.sh session (issue 52)", "card": _card(), "config": {"common": COMMON, "verl": VERL},
              "runs": runs, "plot": picture.name}
    out.write_text(json.dumps(result, indent=1))
    return result


def steps_once(run_dir: Path, last: int) -> None:
    steps = [s.step for s in read_metrics(run_dir / "metrics.jsonl")]
    if steps != list(range(1, last + 1)):
        raise SystemExit(f"{run_dir}/metrics.jsonl holds steps {steps}, not 1..{last} once each")
    print(f"{run_dir.name}: steps 1..{last} once each")


def resumed(run_dir: Path) -> None:
    record = json.loads((run_dir / "verl" / "job.json").read_text())
    if record["attempt"] < 2 or not record.get("resumed_from"):
        raise SystemExit(f"{run_dir}: attempt {record['attempt']} resumed from {record.get('resumed_from')}: no resume")
    print(f"{run_dir.name}: attempt {record['attempt']} resumed from verl's checkpoint step {record['resumed_from']}")


def check() -> int:
    """The collection on two synthetic runs shaped as the flow writes them."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, rise in (("verl", 0.02), ("local", 0.015)):
            run = Path(tmp, name)
            (run / "eval").mkdir(parents=True)
            for step in range(1, 41):
                append_metrics(run / "metrics.jsonl", StepMetrics(step=step, reward_mean=0.2 + rise * step, step_time_s=2.0,
                                                                  response_length=20.0, tokens_per_s=320.0, time=time.time()))
            for model, right in (("base", 40), ("trained", 120)):
                (run / "eval" / f"{model}.jsonl").write_text(
                    "".join(json.dumps({"correct": i < right}) + "\n" for i in range(200)))
        result = collect(Path(tmp, "verl"), Path(tmp, "local"), {"verl": 300.0, "local": 200.0}, Path(tmp, "r.json"),
                         Path(tmp, "r.png"))
        verl = result["runs"]["verl (FSDP + vLLM 0.24, Ray job)"]
        assert verl["steps"] == 40 and verl["step_time_s_median"] == 2.0 and verl["intervals_separate"]
        assert verl["elapsed_s"][0] == 2.0 and verl["elapsed_s"][-1] == 80.0
        assert verl["response_tokens_per_s"] == 20.0 * SEQUENCES_PER_STEP / 2.0
        assert verl["evaluation"]["base"] == {"accuracy": 0.2, "ci95": wilson(40, 200), "samples": 200}
        assert Path(tmp, "r.png").read_bytes().startswith(b"\x89PNG")
        steps_once(Path(tmp, "verl"), 40)
    print("verl_real check: the results of two runs are collected and plotted")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("collect")
    c.add_argument("--verl", type=Path, required=True)
    c.add_argument("--local", type=Path, required=True)
    c.add_argument("--walls", type=Path, help="JSON {verl: s, local: s}: each flow's wall time")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--plot", type=Path, required=True)
    s = sub.add_parser("steps-once")
    s.add_argument("run_dir", type=Path)
    s.add_argument("last", type=int)
    r = sub.add_parser("resumed")
    r.add_argument("run_dir", type=Path)
    config = sub.add_parser("config", help="print the shared --set arguments (and the verl ones with --verl, the "
                            "failure runs' with --failures)")
    config.add_argument("--verl", action="store_true")
    config.add_argument("--failures", action="store_true")
    args = parser.parse_args()
    if args.check:
        return check()
    if args.command == "collect":
        walls = json.loads(args.walls.read_text()) if args.walls else {}
        print(json.dumps(collect(args.verl, args.local, walls, args.out, args.plot)["runs"], indent=1))
    elif args.command == "steps-once":
        steps_once(args.run_dir, args.last)
    elif args.command == "resumed":
        resumed(args.run_dir)
    elif args.command == "config":
        print(" ".join(f"--set {item}" for item in COMMON + (VERL if args.verl else []) + (FAILURES if args.failures else [])))
    else:
        parser.error("a command, or --check")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
