"""Where one command's CPU goes, by process: the command and everything it starts (Prefect's server, Ray's
daemons and workers), found by a marker in their environment, which every child inherits.

    .venv/bin/python bench/bench_run_processes.py -- .venv/bin/python -m grpo_pipeline --model tiny --device cpu \\
        --run-dir /tmp/cpu-runs --run-name one

The test suite on 2 cores is CPU-bound (each e2e test runs ~3x slower than on an idle machine), so a run's
CPU, not its wall time, is what the suite's length is made of. Sampled every 0.3 s (a process that lives less
than that is missed); a process's CPU is its last sample. Prints the CPU by kind of process, largest first;
--json writes every process's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

SAMPLE_S = 0.3


def kind(cmdline: list[str]) -> str:
    """A process's kind: a Ray actor's class, a Ray worker, a daemon's program or the module a python runs."""
    if titled := next((word for word in cmdline if word.startswith("ray::")), None):
        return titled.split()[0]
    words = [Path(word).name for word in cmdline]
    if program := next((word for word in words if word.endswith((".py", "gcs_server", "raylet"))), None):
        return program
    if "-m" in words:
        return f"python -m {words[words.index('-m') + 1]}"
    return " ".join(words[:3])


def measure(command: list[str]) -> tuple[float, int, dict[int, dict]]:
    marker = f"CPU_BY_PROCESS_{os.getpid()}"
    started = time.monotonic()
    process = subprocess.Popen(command, env={**os.environ, marker: "1"})
    seen: dict[int, dict] = {}
    while process.poll() is None:
        for candidate in psutil.process_iter():
            try:
                if candidate.pid not in seen:
                    if marker not in candidate.environ():
                        continue
                    seen[candidate.pid] = {"from_s": time.monotonic() - started}
                times = candidate.cpu_times()
                # The kind from the latest title: a Ray worker renames itself `ray::<actor>` once it has one.
                seen[candidate.pid].update(kind=kind(candidate.cmdline()), cpu_s=times.user + times.system,
                                           to_s=time.monotonic() - started)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(SAMPLE_S)
    return time.monotonic() - started, process.returncode, seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every process's figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    wall_s, code, seen = measure(command)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for figures in seen.values():
        by_kind[figures["kind"]][0] += figures.get("cpu_s", 0.0)
        by_kind[figures["kind"]][1] += 1
    total = sum(cpu for cpu, _ in by_kind.values())
    print(f"exit {code}, {wall_s:.1f} s wall, {total:.1f} s of CPU in {len(seen)} processes")
    for name, (cpu, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:8.1f} s  {count:3d} x  {name}")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "wall_s": wall_s, "exit": code,
                                         "processes": list(seen.values())}, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
