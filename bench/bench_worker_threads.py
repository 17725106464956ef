"""A CPU run's training worker with one torch thread against the default (the cores Ray gave it), side by side,
alone or beside another run of its own kind, as `make test` runs two processes on 2 cores.

    .venv/bin/python bench/bench_worker_threads.py --rounds 2 --beside 0 --beside 1 --out bench/results-cpu-worker-threads.json

Measured (bench/results-cpu-worker-threads.json): alone, no difference; beside one other run, the default's steps 7.1x
and the run 1.30x as long as with one thread.

Each round runs the command line's fetch, checkpoint and train stages on `tiny` twice, in turn: with
OMP_NUM_THREADS=1 (Ray then leaves the worker's setting alone, and the worker takes one thread) and without it
(Ray sets the worker's OMP_NUM_THREADS to its CPUs: all the host's with one worker). `--beside N`: N other runs
of the same command go on in a loop meanwhile, with the same thread setting as the measured one (the suite's other
process is set alike). Figures: the run's wall time and its steps' summed time from metrics.jsonl; the ratio is
taken round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def command(model: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "grpo_pipeline", "--model", model, "--device", "cpu", "--run-dir", str(run_dir),
            "--run-name", "r", "--stages", "fetch_dataset,prepare_checkpoint,train"]


def environment(threads: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "OMP_NUM_THREADS": threads} if threads else env


def beside(model: str, threads: str | None, folder: Path) -> subprocess.Popen:
    """Runs of the same command one after another until stopped (a shell loop in a process group of its own)."""
    line = " ".join(command(model, folder))
    return subprocess.Popen(["bash", "-c", f"while true; do rm -rf {folder}; {line} >/dev/null 2>&1; done"],
                            env=environment(threads), start_new_session=True)


def one_run(model: str, threads: str | None, work: Path) -> dict:
    run_dir = work / "runs"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    done = subprocess.run(command(model, run_dir), env=environment(threads), capture_output=True, text=True,
                          check=False)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"the run failed ({done.returncode}): {done.stderr[-2000:]}")
    steps = [json.loads(line)["step_time_s"] for line in (run_dir / "r" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": round(wall, 1), "steps_s": round(sum(steps), 2), "step_s": [round(s, 2) for s in steps]}


def ratio(rounds: list[dict], key: str) -> float:
    return round(statistics.median(r["default"][key] / r["one_thread"][key] for r in rounds), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--beside", type=int, action="append", help="other runs going on meanwhile (repeatable)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="worker-threads-"))
    results = {"command": " ".join(sys.argv), "model": args.model, "cores": os.cpu_count(), "cells": []}
    for others in args.beside or [0]:
        rounds = []
        for index in range(args.rounds):
            measured = {}
            for name, threads in (("one_thread", "1"), ("default", None)):
                loops = [beside(args.model, threads, work / f"beside-{n}") for n in range(others)]
                try:
                    time.sleep(20 if others else 0)  # the runs beside it past their start
                    measured[name] = one_run(args.model, threads, work)
                finally:
                    for loop in loops:
                        os.killpg(loop.pid, signal.SIGKILL)
                        loop.wait()
                    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, check=False)
            rounds.append(measured)
            print(f"beside {others} round {index + 1}: one thread {measured['one_thread']['wall_s']} s wall, steps "
                  f"{measured['one_thread']['steps_s']} s; default {measured['default']['wall_s']} s wall, steps "
                  f"{measured['default']['steps_s']} s", flush=True)
        results["cells"].append({"runs_beside": others, "rounds": rounds, "default_over_one_thread": {
            "wall": ratio(rounds, "wall_s"), "steps": ratio(rounds, "steps_s")}})
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps([{k: v for k, v in c.items() if k != "rounds"} for c in results["cells"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
