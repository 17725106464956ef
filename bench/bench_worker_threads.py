"""A CPU run's training worker with one torch thread against the default (the cores Ray gave it), side by side,
idle or beside busy processes that stand for the suite's other pytest process (`make test` runs two on 2 cores).

    .venv/bin/python bench/bench_worker_threads.py --rounds 2 --load 0 --load 2 --out bench/results-cpu-worker-threads.json

Each round runs the command line's fetch, checkpoint and train stages on `tiny` twice, in turn: with
OMP_NUM_THREADS=1 (Ray then leaves the worker's setting alone, and the worker takes one thread) and without it
(Ray sets the worker's OMP_NUM_THREADS to its CPUs: all the host's with one worker). Figures: the run's wall time
and its steps' summed time from metrics.jsonl; the ratio is taken round by round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def busy() -> None:
    while True:
        pass


def one_run(model: str, threads: str | None, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = threads
    run_dir = work / "runs"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "grpo_pipeline", "--model", model, "--device", "cpu", "--run-dir",
                           str(run_dir), "--run-name", "r", "--stages", "fetch_dataset,prepare_checkpoint,train"],
                          env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"the run failed ({done.returncode}): {done.stderr[-2000:]}")
    steps = [json.loads(line)["step_time_s"] for line in (run_dir / "r" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": round(wall, 1), "steps_s": round(sum(steps), 2), "step_s": [round(s, 2) for s in steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--load", type=int, action="append", help="busy processes beside the runs (repeatable)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="worker-threads-"))
    results = {"command": " ".join(sys.argv), "model": args.model, "cores": os.cpu_count(), "cells": []}
    for load in args.load or [0]:
        spinners = [multiprocessing.Process(target=busy, daemon=True) for _ in range(load)]
        for spinner in spinners:
            spinner.start()
        try:
            rounds = []
            for index in range(args.rounds):
                one, default = one_run(args.model, "1", work), one_run(args.model, None, work)
                rounds.append({"one_thread": one, "default": default})
                print(f"load {load} round {index + 1}: one thread {one['wall_s']} s wall, steps {one['steps_s']} s; "
                      f"default {default['wall_s']} s wall, steps {default['steps_s']} s", flush=True)
        finally:
            for spinner in spinners:
                spinner.terminate()
        ratio = lambda key: round(statistics.median(r["default"][key] / r["one_thread"][key] for r in rounds), 2)  # noqa: E731
        results["cells"].append({"busy_processes": load, "rounds": rounds, "default_over_one_thread": {
            "wall": ratio("wall_s"), "steps": ratio("steps_s")}})
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps([{k: v for k, v in c.items() if k != "rounds"} for c in results["cells"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
