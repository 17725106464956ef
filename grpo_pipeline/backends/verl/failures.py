"""Why a verl job failed, from its own log: a fault the next attempt may get past, or a config error.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --ray-address head:6379

A transient cause (a collective that timed out, a lost node or worker, a raylet that killed a worker
for memory) is retried by the train stage, resuming from the latest checkpoint. A config error
(Hydra composition, a key verl does not have, an assertion in verl's config checks, a layout larger
than the cluster, an entrypoint that cannot start, a cluster image without verl) fails the run at
once, in one line with the job's own message. Anything else is retried like a transient fault: its
line is shown all the same.

A config error is read from the failure that ended the job (its last traceback, or the log's last lines
when it printed none), never from any line of the log: a real verl + vLLM start prints harmless import
failures (vLLM's `Failed to import from vllm._C with ModuleNotFoundError("No module named 'vllm._C'")`)
long before whatever ends it (seen on the H200: they hid `RuntimeError: Failed to infer device type`).
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
    # image lacks, or the image lacks a package): every attempt would fail the same way. Raised, not
    # logged: the exception's own line.
    r"^(\w+\.)*(ModuleNotFoundError|ImportError)\b.*No module named\b", r"^\S*python[\d.]*: No module named\b",
    r"can't open file",
    r"^/bin/sh: \d+: .*: not found", r"command not found",
]
_TRANSIENT = re.compile("|".join(TRANSIENT))
_CONFIG = re.compile("|".join(CONFIG), re.MULTILINE)
# The line worth showing: the last exception line, else the last non-empty line.
_ERROR_LINE = re.compile(r"^(\S+(Error|Exception|Exit)\b.*|.*\b(error|Error)\b.*)$", re.MULTILINE)
_RAISED = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exit|Interrupt)\b(\([\w.]+\))?(:.*)?$")
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')
ENDING_LINES = 40  # a log without a traceback: where its failure is told
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
    lines = [_RAY_PREFIX.sub("", ANSI_CODE.sub("", line)) for line in log.splitlines()]
    status = [_RAY_PREFIX.sub("", ANSI_CODE.sub("", line)) for line in message.splitlines()]
    transient = [line for line in lines + status if _TRANSIENT.search(line)]
    if transient:
        return Diagnosis("transient", _most_specific(transient))
    ending = _without_frame_source(_ending(lines)) + status
    config = [line for line in ending if _CONFIG.search(line)]
    if config:
        return Diagnosis("config", _most_specific(config))
    raised = [line for line in ending if _RAISED.match(line.strip())]
    if raised:
        return Diagnosis("unknown", raised[-1].strip()[:500])
    errors = _ERROR_LINE.findall("\n".join(ending))
    line = errors[-1][0] if errors else next((line for line in reversed(ending) if line.strip()), "")
    return Diagnosis("unknown", line.strip()[:500])


def _ending(lines: list[str]) -> list[str]:
    """The part of the log that tells what ended the job: from its last traceback (with Hydra's header
    and any exceptions chained before it, which Python prints first) to the end; else its last lines."""
    starts = [index for index, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if not starts:
        return lines[-ENDING_LINES:]
    first = starts[-1]
    # `raise ... from cause`: the cause's traceback, printed first, is part of the same failure (an
    # exception raised while handling another is not: the first was being recovered from).
    while any("The above exception was the direct cause" in line for line in lines[max(0, first - 3):first]):
        earlier = [index for index in starts if index < first]
        if not earlier:
            break
        first = earlier[-1]
    if first > 0 and lines[first - 1].startswith(_HYDRA_HEADER):
        first -= 1
    return lines[first:]


def _without_frame_source(lines: list[str]) -> list[str]:
    """A traceback's frames less their source lines (the line after `File "...", line N` and its `^^^` marks):
    `raise ConfigCompositionException(` is code, not what went wrong. Hydra prints whole tracebacks with
    HYDRA_FULL_ERROR=1 (launch scripts for verl often export it) or under any tracer (coverage, a debugger)."""
    kept, in_frame = [], False
    for line in lines:
        frame = _FRAME.match(line)
        if in_frame and not frame and line.strip() and not _RAISED.match(line.strip()):
            continue  # the frame's source line, or its carets (unindented once Ray's prefix is taken off)
        in_frame = bool(frame)
        kept.append(line)
    return kept


def _most_specific(lines: list[str]) -> str:
    """The last two matching lines that say more than Hydra's header (Hydra says "Could not
    override 'trainer.x'." and then why)."""
    useful = [line.strip() for line in lines if not line.startswith(_HYDRA_HEADER)]
    last = list(dict.fromkeys(useful or [line.strip() for line in lines]))[-2:]
    return " ".join(last)[:500]
