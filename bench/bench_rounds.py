"""Learning per update and per second at generation.steps_per_generation 1, 2 and 4 (issue 54): the demo's config.

    .venv/bin/python bench/bench_rounds.py [--rounds 1 2 4] [--run-dir /tmp/rounds-runs] [--reuse 1=/tmp/runs/demo]
    .venv/bin/python bench/bench_rounds.py --same-time [--run-dir /tmp/rounds-runs]   # then: the same training time
    .venv/bin/python bench/bench_rounds.py --collect-only   # the finished runs' numbers, nothing run
    .venv/bin/python bench/bench_rounds.py --check          # the collection on synthetic runs

Each setting runs the whole pipeline as `make demo` does (`python -m grpo_pipeline --model smollm2-135m --device cpu`,
a fresh process, one at a time), the same model, data, seed and 12 updates (one a step: the CPU recipe's batch is one
mini batch), only `--set generation.steps_per_generation=N` differing; `--reuse N=<run folder>` takes a finished
run of that setting instead (the demo's own run is the setting 1: the CPU profile's default). Per run: the held-out
accuracy of the base model and of the trained policy with Wilson 95% intervals (eval/<model>.jsonl, one `correct` a
sample), the training time (the steps' own `step_time_s` from metrics.jsonl, summed; and the train stage's from
timings.json, Ray's and the worker's start-up included), the seconds spent generating, and the rewards by step.

A run folder the flow finished (report.md and eval/trained.jsonl there) is collected, not run again, so a second
call adds only what is missing; `--collect-only` runs nothing and collects every folder with steps (one the flow
did not finish, `"finished": false`, has no evaluation; the results file is written after every run).
`--same-time` then gives every setting whose 12 steps took less training time than the slowest setting's as many
steps as fit in that time (12 x slowest / its own, rounded), runs them (`<run-dir>/spg<N>-same-time`) and adds
their accuracy: learning after about the same training time. Results: bench/results-cpu-rounds.json (command,
machine and its load, every number); the table is in docs/local-backend.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from grpo_pipeline.backends.metrics import StepMetrics, append_metrics, read_metrics  # noqa: E402
from bench_pipeline_overhead import timed_run  # noqa: E402
from verl_real import accuracy, wilson  # noqa: E402 - one Wilson interval for every bench

MODEL = "smollm2-135m"
UPDATES = 12  # the demo's: the CPU recipe's trainer.total_training_steps, one update a step
RESULTS = ROOT / "bench" / "results-cpu-rounds.json"


def command(rounds: int, run_dir: Path, name: str, steps: int | None = None) -> list[str]:
    settings = [f"generation.steps_per_generation={rounds}"]
    if steps is not None:
        settings.append(f"trainer.total_training_steps={steps}")
    return [sys.executable, "-m", "grpo_pipeline", "--model", MODEL, "--device", "cpu", "--run-dir", str(run_dir),
            "--run-name", name, *(arg for setting in settings for arg in ("--set", setting))]


def run_flow(argv: list[str]) -> float:
    return round(timed_run(argv), 1)


def finished(run_dir: Path) -> bool:
    """A run folder the flow completed (its report written after the evaluation): collected, not run again."""
    return (run_dir / "report.md").is_file() and (run_dir / "eval" / "trained.jsonl").is_file()


def run_summary(run_dir: Path, rounds: int, flow_wall_s: float | None = None) -> dict:
    """One run folder as the flow writes it: metrics.jsonl, timings.json, eval/{base,trained}.jsonl."""
    steps = read_metrics(run_dir / "metrics.jsonl")
    timings_file = run_dir / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.is_file() else {}
    evaluation = {name: accuracy(run_dir / "eval" / f"{name}.jsonl") for name in ("base", "trained")
                  if (run_dir / "eval" / f"{name}.jsonl").is_file()}
    separated = ("base" in evaluation and "trained" in evaluation
                 and evaluation["trained"]["ci95"][0] > evaluation["base"]["ci95"][1])
    first = steps[:UPDATES]
    train_s = sum(s.step_time_s for s in steps)
    return {"run_dir": str(run_dir), "finished": finished(run_dir), "steps_per_generation": rounds, "steps": len(steps),
            "rounds": sum(1 for s in steps if (s.generation_s or 0) > 0),
            "train_steps_s": round(train_s, 1),
            f"train_steps_s_first_{UPDATES}": round(sum(s.step_time_s for s in first), 1),
            "generation_s": round(sum(s.generation_s or 0 for s in steps), 1),
            "step_time_s": [round(s.step_time_s, 2) for s in steps],
            "train_stage_s": round(timings["train"], 1) if "train" in timings else None,
            "evaluate_stage_s": round(timings["evaluate"], 1) if "evaluate" in timings else None,
            "flow_wall_s": flow_wall_s,
            "reward_curve": [round(s.reward_mean, 4) for s in steps],
            "evaluation": evaluation, "intervals_separate": separated}


def same_time_steps(runs: dict[str, dict]) -> dict[int, int]:
    """Steps each faster setting trains in the slowest setting's time for its 12 (12 x slowest / its own)."""
    key = f"train_steps_s_first_{UPDATES}"
    slowest = max(r[key] for r in runs.values())
    return {r["steps_per_generation"]: round(UPDATES * slowest / r[key]) for r in runs.values()
            if round(UPDATES * slowest / r[key]) > UPDATES}


def table(runs: dict[str, dict], same_time: dict[str, dict]) -> list[dict]:
    rows = []
    for name, run in runs.items():
        trained = run["evaluation"].get("trained", {})
        base = run["evaluation"].get("base", {})
        longer = same_time.get(name)
        rows.append({"steps_per_generation": run["steps_per_generation"], "rounds": run["rounds"],
                     f"accuracy_after_{UPDATES}": trained.get("accuracy"), "ci95": trained.get("ci95"),
                     "base_accuracy": base.get("accuracy"),
                     f"train_steps_s_{UPDATES}": run[f"train_steps_s_first_{UPDATES}"],
                     "generation_s": run["generation_s"], "train_stage_s": run["train_stage_s"],
                     "gain_per_100_train_s": (round(100 * (trained["accuracy"] - base["accuracy"])
                                                    / run[f"train_steps_s_first_{UPDATES}"], 3)
                                              if trained and base else None),
                     "same_time_steps": longer["steps"] if longer else None,
                     "same_time_train_steps_s": longer["train_steps_s"] if longer else None,
                     "same_time_accuracy": longer["evaluation"].get("trained", {}).get("accuracy") if longer else None,
                     "same_time_ci95": longer["evaluation"].get("trained", {}).get("ci95") if longer else None})
    return rows


def machine() -> dict:
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    return {"cores": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def write(result: dict, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def main_run(args: argparse.Namespace) -> int:
    reuse = dict(item.split("=", 1) for item in args.reuse)
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    runs: dict[str, dict] = {}
    commands: dict[str, str] = {}
    loads = [machine()]
    same_time: dict[str, dict] = {}

    def save() -> dict:
        result = {"command": " ".join(sys.argv), "runs_commands": commands,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": {**loads[0], "load_average_after_each_run": loads[1:],
                              "note": "shared 2-core machine: other engineers' test runs beside these "
                                      "(load average above)"},
                  "config": f"{MODEL} recipe on --device cpu (the demo), only generation.steps_per_generation varied",
                  "table": table(runs, same_time), "runs": runs, "same_time_runs": same_time}
        write(result, args.out)
        return result

    for rounds in args.rounds:
        name = f"spg{rounds}"
        folder = Path(reuse[str(rounds)]) if str(rounds) in reuse else args.run_dir / name
        argv = command(rounds, args.run_dir, name)
        wall = previous.get("runs", {}).get(name, {}).get("flow_wall_s")
        if args.collect_only and not (folder / "metrics.jsonl").is_file():
            continue
        if str(rounds) in reuse or finished(folder) or args.collect_only:
            commands[name] = (previous.get("runs_commands", {}).get(name)
                              or f"reused {folder} (the same config as: {' '.join(argv[1:])})")
        else:
            wall = run_flow(argv)
            commands[name] = " ".join([".venv/bin/python", *argv[1:]])
        runs[name] = run_summary(folder, rounds, wall)
        loads.append(machine()["load_average_1_5_15"])
        print(json.dumps({k: v for k, v in runs[name].items() if k not in ("step_time_s", "reward_curve")}), flush=True)
        save()
    if runs and (args.same_time or args.collect_only):
        for rounds, steps in same_time_steps(runs).items():
            name = f"spg{rounds}-same-time"
            argv = command(rounds, args.run_dir, name, steps)
            if args.collect_only and not (args.run_dir / name / "metrics.jsonl").is_file():
                continue
            if finished(args.run_dir / name) or args.collect_only:
                wall = previous.get("same_time_runs", {}).get(f"spg{rounds}", {}).get("flow_wall_s")
                commands[name] = previous.get("runs_commands", {}).get(name) or f"reused {args.run_dir / name}"
            else:
                wall = run_flow(argv)
                commands[name] = " ".join([".venv/bin/python", *argv[1:]])
            same_time[f"spg{rounds}"] = run_summary(args.run_dir / name, rounds, wall)
            loads.append(machine()["load_average_1_5_15"])
            save()
    print(json.dumps(save()["table"], indent=1))
    return 0


def _synthetic_run(folder: Path, steps: int, rounds: int, step_s: float, generation_s: float, right: int) -> None:
    (folder / "eval").mkdir(parents=True)
    for step in range(1, steps + 1):
        generating = (step - 1) % rounds == 0
        append_metrics(folder / "metrics.jsonl", StepMetrics(
            step=step, reward_mean=0.1 + 0.02 * step, step_time_s=step_s + (generation_s if generating else 0.0),
            generation_s=generation_s if generating else 0.0, response_length=15.0, time=time.time()))
    (folder / "report.md").write_text("# report\n")
    (folder / "timings.json").write_text(json.dumps({"train": steps * step_s + 60.0, "evaluate": 90.0}))
    for model, correct in (("base", 22), ("trained", right)):
        (folder / "eval" / f"{model}.jsonl").write_text(
            "".join(json.dumps({"correct": i < correct}) + "\n" for i in range(128)))


def check() -> int:
    """The collection on synthetic run folders shaped as the flow writes them."""
    with tempfile.TemporaryDirectory() as tmp:
        for rounds, right in ((1, 45), (2, 40), (4, 30)):
            _synthetic_run(Path(tmp, f"spg{rounds}"), UPDATES, rounds, 10.0, 4.0, right)
        runs = {f"spg{r}": run_summary(Path(tmp, f"spg{r}"), r) for r in (1, 2, 4)}
        one, four = runs["spg1"], runs["spg4"]
        assert one["rounds"] == 12 and four["rounds"] == 3 and runs["spg2"]["rounds"] == 6
        assert one[f"train_steps_s_first_{UPDATES}"] == 168.0 and four[f"train_steps_s_first_{UPDATES}"] == 132.0
        assert one["generation_s"] == 48.0 and four["generation_s"] == 12.0 and one["train_stage_s"] == 180.0
        assert one["evaluation"]["trained"] == {"accuracy": round(45 / 128, 4), "samples": 128, "ci95": wilson(45, 128)}
        assert one["intervals_separate"] and not four["intervals_separate"] and one["finished"]
        # 168 s for spg1's 12 steps: spg2 (144 s) gets 14 steps, spg4 (132 s) 15; spg1 itself none
        assert same_time_steps(runs) == {2: 14, 4: 15}
        _synthetic_run(Path(tmp, "spg4-same-time"), 15, 4, 10.0, 4.0, 33)
        longer = {"spg4": run_summary(Path(tmp, "spg4-same-time"), 4)}
        assert longer["spg4"]["steps"] == 15 and longer["spg4"]["rounds"] == 4
        rows = {row["steps_per_generation"]: row for row in table(runs, longer)}
        assert rows[1]["same_time_steps"] is None and rows[4]["same_time_steps"] == 15
        assert rows[4]["same_time_accuracy"] == round(33 / 128, 4) and rows[4]["same_time_train_steps_s"] == 166.0
        assert rows[1]["gain_per_100_train_s"] == round(100 * (45 - 22) / 128 / 168.0, 3)
        assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
        out = Path(tmp, "results.json")
        write({"table": table(runs, longer)}, out)
        assert json.loads(out.read_text())["table"][2]["rounds"] == 3
    print("bench_rounds check: three settings' runs collected, the same-time steps derived")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="the collection on synthetic run folders; runs nothing")
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 4],
                        help="the generation.steps_per_generation values, run in this order")
    parser.add_argument("--run-dir", type=Path, default=Path(tempfile.gettempdir()) / "rounds-runs")
    parser.add_argument("--reuse", action="append", default=[], metavar="N=RUN_FOLDER",
                        help="a finished run of setting N with this config (the demo's for 1) instead of a new one")
    parser.add_argument("--same-time", action="store_true",
                        help="also run the faster settings for the slowest one's training time")
    parser.add_argument("--collect-only", action="store_true",
                        help="collect the finished run folders (same-time ones too) and run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.check:
        return check()
    return main_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
