"""Why a verl job failed, from its own log: a fault the next attempt may get past, or a config error.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --ray-address head:6379

A transient cause (a collective that timed out, a lost node or worker, a raylet that killed a worker
for memory) is retried by the train stage, resuming from the latest checkpoint. A config error
(Hydra composition, a key verl does not have, an assertion in verl's config checks, a layout larger
than the cluster, an entrypoint that cannot start, a cluster image without verl) fails the run at
once, in one line with the job's own message. Anything else is retried like a transient fault: its
line is shown all the same.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

# Lines of verl, torch, NCCL/HCCL and Ray that mean "this attempt lost something it needed".
TRANSIENT = [
    r"Watchdog caught collective operation timeout",
    r"ProcessGroupNCCL's watchdog",
    r"Process group watchdog thread terminated",
    r"\bNCCL error\b", r"ncclInternalError", r"ncclSystemError", r"ncclRemoteError",
    r"\bEI0006\b", r"\bEI0002\b", r"\bEE1002\b", r"HCCL function error", r"hcclCommInitRootInfo",
    r"ERR02200 DIST call hccl api failed",
    r"ActorDiedError", r"NodeDiedError", r"RayActorError", r"WorkerCrashedError",
    r"OutOfMemoryError: Task was killed due to the node running low on memory",
    r"NODE_OUT_OF_MEMORY",
    r"has been marked dead because the detector has missed too many heartbeats",
    r"A worker died or was killed while executing a task",
    r"Worker unexpectedly exits",
]
# Lines that mean "the run as configured cannot start": retrying repeats them. Not among them: Hydra's
# "Error executing job with overrides: [...]", which @hydra.main prints before the traceback of ANY
# exception main_ppo raises (a lost worker's too), and "Checkpoint tracker file does not exist", which
# verl prints at every fresh start with resume_mode=auto (verl 0.9.1, checkpoint_manager.py:241).
CONFIG = [
    r"ConfigCompositionException", r"ConfigAttributeError", r"ConfigKeyError", r"ValidationError",
    r"Key '[^']+' is not in struct",
    r"Could not override '",
    r"Total available (GPUs|NPUs|devices) \d+ is less than total desired",
    r"use_mbridge must be True",
    r"^AssertionError",
    # The entrypoint cannot start (trainer.entrypoint names a script, module or command the cluster's
    # image lacks, or the image lacks verl): every attempt would fail the same way.
    r"\bNo module named\b", r"can't open file", r"^/bin/sh: \d+: .*: not found", r"command not found",
]
_TRANSIENT = re.compile("|".join(TRANSIENT))
_CONFIG = re.compile("|".join(CONFIG), re.MULTILINE)
# The line worth showing: the last exception line, else the last non-empty line.
_ERROR_LINE = re.compile(r"^(\S+(Error|Exception|Exit)\b.*|.*\b(error|Error)\b.*)$", re.MULTILINE)
_RAY_PREFIX = re.compile(r"^\([^)]*pid=\d+[^)]*\)\s*")
# Ray colours the "(TaskRunnerV1 pid=N)" prefix of a worker's lines in the job's log (ray/_private/
# worker.py print_worker_logs: ANSI codes unless RAY_COLOR_PREFIX=0), also when nothing reads a terminal.
ANSI_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


_HYDRA_HEADER = "Error executing job with overrides"


class Diagnosis(NamedTuple):
    kind: Literal["transient", "config", "unknown"]
    line: str


def diagnose(log: str, message: str = "") -> Diagnosis:
    """The cause of a failed job, from its log (the end of it is enough) and Ray's status message.
    A transient cause wins over a config-looking line (a node lost mid-run may be reported by an
    assertion in a worker); the line returned is the one that decided."""
    text = "\n".join(_RAY_PREFIX.sub("", ANSI_CODE.sub("", line)) for line in f"{log}\n{message}".splitlines())
    for pattern, kind in ((_TRANSIENT, "transient"), (_CONFIG, "config")):
        matches = [line for line in text.splitlines() if pattern.search(line)]
        if matches:
            return Diagnosis(kind, _most_specific(matches))
    errors = _ERROR_LINE.findall(text)
    line = errors[-1][0] if errors else next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return Diagnosis("unknown", line.strip())


def _most_specific(lines: list[str]) -> str:
    """The last two matching lines that say more than Hydra's header (Hydra says "Could not
    override 'trainer.x'." and then why)."""
    useful = [line.strip() for line in lines if not line.startswith(_HYDRA_HEADER)]
    last = list(dict.fromkeys(useful or [line.strip() for line in lines]))[-2:]
    return " ".join(last)[:500]
