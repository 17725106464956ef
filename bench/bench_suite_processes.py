"""Where a long command's CPU goes on this host, by kind of process: every process's CPU time read from /proc
each second, the last reading of each process kept, summed by kind (a Ray actor's name, a Ray daemon, pytest, a
command line) once stopped (SIGTERM or Ctrl-C). bench/bench_run_processes.py follows one command's own
processes; this watches the whole host, for a run of the suite (results-cpu-suite-processes.json):

    .venv/bin/python bench/bench_suite_processes.py /tmp/suite-cpu.json & sampler=$!
    make test; kill $sampler

A process that lives under a second is partly missed; the kinds come from keywords of the command line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from bench_run_processes import kind as process_kind

PERIOD_S = 1.0
TICKS = os.sysconf("SC_CLK_TCK")
# What bench_run_processes.kind cannot tell apart on a whole host, by a keyword of the command line, first: a
# test's MLflow server (its arguments name pytest's temporary folder; it runs on uvicorn, as Prefect's server does),
# pytest-xdist's workers (`python -c`), the suite's command lines and stand-ins. A Ray worker renames itself
# `ray::<Actor>` once it has a task or an actor: its kind is taken again while it is still starting or idle.
KEYWORDS = [("mlflow", "mlflow"), ("prefect.server", "Prefect server"), ("exec(eval(sys.stdin", "pytest"),
            ("worker_faults.py", "tests/worker_faults.py"), ("verl_stand_in", "tests/verl_stand_in.py")]
PROVISIONAL = {"default_worker.py", "ray::IDLE"}


def kind(command: list[str]) -> str:
    if not command:
        return "?"  # a kernel thread
    line = " ".join(command)
    return next((name for keyword, name in KEYWORDS if keyword in line and not command[0].startswith("ray::")),
                None) or process_kind(command)


def command_of(pid: str) -> list[str]:
    return [part for part in Path(f"/proc/{pid}/cmdline").read_text().split("\0") if part]


def sample(seen: dict[tuple[str, str], list], first: bool = False) -> None:
    """Each process's kind and CPU seconds since it was first seen: what a process that was already running
    (the host's own, kernel threads) had spent before the first sample is not the watched command's."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            cpu_s, started = (int(fields[11]) + int(fields[12])) / TICKS, fields[19]
            entry = seen.setdefault((pid, started), [kind(command_of(pid)), 0.0, cpu_s if first else 0.0])
            entry[1] = cpu_s - entry[2]
            if entry[0] in PROVISIONAL and (now := kind(command_of(pid))).startswith("ray::"):
                entry[0] = now
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            pass


def main(out: str) -> None:
    stopped = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.append(True))
    seen: dict[tuple[str, str], list] = {}
    sample(seen, first=True)
    while not stopped:
        time.sleep(PERIOD_S)
        sample(seen)
    by_kind: dict[str, list] = {}
    for name, cpu_s, _ in seen.values():
        total = by_kind.setdefault(name, [0.0, 0])
        total[0] += cpu_s
        total[1] += 1
    ranked = sorted(by_kind.items(), key=lambda item: -item[1][0])
    Path(out).write_text(json.dumps({name: {"cpu_s": round(cpu, 1), "processes": count} for name, (cpu, count) in ranked},
                                    indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
