"""The pipeline's own overhead: a whole run's wall time minus its training and evaluation time.

    .venv/bin/python bench/bench_pipeline_overhead.py [--model smollm2-135m] [--rounds 1]

First a warm-up run of the data and model stages fills the stores and Prefect's cache. Then each
round runs the whole pipeline as `make demo` does (`python -m grpo_pipeline ...` in a fresh process,
the Prefect API the CLI starts for the run, a local Ray), timed from process start to exit. The run's
`timings.json` gives the time inside the train and evaluate stages; everything else (process start,
imports, the Prefect API, device detection, profile, environment, the cached data and model stages,
export, report, task orchestration) is overhead. Prints each part and the overhead's share of the run.
With `--started-api` the runs use one Prefect API started beforehand, as runs of a deployment do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK_STAGES = ("train", "evaluate")


def run_pipeline(model: str, run_dir: Path, name: str, stages: str | None = None) -> float:
    command = [sys.executable, "-m", "grpo_pipeline", "--model", model, "--device", "cpu", "--run-dir", str(run_dir),
               "--run-name", name]
    if stages:
        command += ["--stages", stages]
    return timed_run(command)


def timed_run(command: list[str]) -> float:
    """Seconds a pipeline command takes from process start to exit; a failed one ends the bench with its output."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["tiny", "smollm2-135m"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--started-api", action="store_true",
                        help="run against a Prefect API started beforehand (as a deployment's worker does) instead "
                        "of the one each CLI run starts for itself")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    if args.started_api:
        sys.path.insert(0, str(ROOT))
        from grpo_pipeline.flows.local_api import LocalAPI

        api = LocalAPI(run_dir / "prefect-api.log")
        api.wait_ready()
        os.environ["PREFECT_API_URL"] = api.url
    warm = run_pipeline(args.model, run_dir, "warm-up", stages="fetch_dataset,prepare_checkpoint")
    print(f"warm-up (data and model stages): {warm:.1f} s")
    results = []
    for round_ in range(args.rounds):
        name = f"round-{round_}"
        wall = run_pipeline(args.model, run_dir, name)
        timings = json.loads((run_dir / name / "timings.json").read_text())
        work = sum(timings[stage] for stage in WORK_STAGES)
        overhead = wall - work
        outside = wall - sum(timings.values())
        parts = ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in timings.items() if stage not in WORK_STAGES)
        print(f"round {round_}: wall {wall:.1f} s = train {timings['train']:.1f} + evaluate {timings['evaluate']:.1f} "
              f"+ overhead {overhead:.1f} ({overhead / wall:.1%}): outside the stages (process start, imports, "
              f"Prefect API start/stop) {outside:.1f}; other stages: {parts}")
        results.append({"wall_s": wall, "work_s": work, "overhead_s": overhead, "fraction": overhead / wall,
                        "outside_stages_s": outside, "stages_s": timings})
    print(json.dumps({"model": args.model, "started_api": args.started_api, "rounds": results}))
    if args.started_api:
        api.stop()


if __name__ == "__main__":
    main()
