"""Following a verl job from the flow: its log, its per-step metrics and its checkpoints.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --ray-address head:6379   # the train stage's log

- The job's log comes from Ray's log tail (a websocket). Ray replays the log from its start on every
  (re)connection, so `JobLog` counts what it has passed on and skips that much of a replay.
- Metrics come from verl's `file` logger (JSONL `{"step": N, "data": {...}}`, one file per attempt on
  shared storage), not from console lines, whose format changes between verl releases and prints
  numpy reprs. Each step becomes the run's typed `StepMetrics` record (backends/metrics.py), so the
  report and the progress bar work as for the local backend.
- The last completed step is verl's tracker file, `latest_checkpointed_iteration.txt`, written after
  a `global_step_N/` is complete.
- The run's own records (metrics.jsonl) are what the flow has passed on. A flow that was killed and
  runs again first adds what verl's files hold past them (`steps_missing_from`): the steps its jobs
  trained while no flow followed them, each once, from the attempt that trained it last.
- What the guards read (backends/guards.py) is verl's own: `rollout_corr/k3_kl`, the rollout vs
  trainer KL per token that verl 0.9.1 computes on every step whose rollout kept its log-probs
  (`rollout.calculate_log_probs`, on by default; trainer/ppo/rollout_corr_helper.py
  compute_offpolicy_metrics), `actor/grad_norm`, and the advantages' max and min (all zero: every group's
  rewards were constant). A training step's value that is null was NaN or infinite (orjson writes them so).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections import deque
from pathlib import Path

from grpo_pipeline.backends.metrics import StepMetrics
from grpo_pipeline.backends.verl.failures import ANSI_CODE

TRACKER = "latest_checkpointed_iteration.txt"
REWARD = "critic/score/mean"
# Only a training step's record has it (v1 trainer_base._compute_metrics); a validation record (before
# the first step, or at test_freq merged into a step's) never does. The reward can be null: orjson
# writes NaN as null, and verl logs NaN scores when every sample of a step was aborted (such a step is
# passed on with a NaN reward, which the non_finite guard stops).
TRAINING_STEP = "training/global_step"
RECONNECT_S = 2.0
# verl's own count of its steps, logged once by every attempt at its start (v1 trainer_base: after
# filtering overlong prompts, so it may be fewer than whole batches of the file).
TOTAL_STEPS = re.compile(r"Total training steps: (\d+)\s*$")
# The rollout vs trainer KL per token, and the trainer's log-perplexity of the same tokens (a NaN log-prob).
MISMATCH, TRAINER_LOG_PPL = "rollout_corr/k3_kl", "rollout_corr/training_log_ppl"


def total_steps(line: str) -> int | None:
    """verl's step count, from its `Total training steps: N` line (None for any other line)."""
    found = TOTAL_STEPS.search(line)
    return int(found.group(1)) if found else None


def tracker_step(checkpoint_dir: Path) -> int | None:
    """verl's last completed checkpoint step (its tracker names a `global_step_N/` that exists)."""
    try:
        step = int((Path(checkpoint_dir) / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None
    return step if (Path(checkpoint_dir) / f"global_step_{step}").is_dir() else None


class JobLog:
    """New lines of a Ray job's log, read in a background thread; `lines()` returns what has come.
    `finish(full_log)` passes on whatever the tail missed (the job's whole log, fetched after it ended)."""

    def __init__(self, client, submission_id: str):
        self.client, self.submission_id = client, submission_id
        self.passed = 0  # characters of the log already turned into lines (or a partial line)
        self._partial = ""
        self._lines: deque[str] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name=f"tail-{submission_id}", daemon=True)
        self._thread.start()

    def lines(self) -> list[str]:
        with self._lock:
            taken = list(self._lines)
            self._lines.clear()
        return taken

    def finish(self, full_log: str) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._take(full_log, 0)
            if self._partial:
                self._lines.append(_as_shown(self._partial))
                self._partial = ""
        return self.lines()

    def close(self) -> None:
        self._stop.set()

    def _take(self, chunk: str, received_before: int) -> None:
        """`chunk` starts at offset `received_before` of the log; keep what lies past `passed`."""
        new = chunk[max(0, self.passed - received_before):]
        if not new:
            return
        self.passed += len(new)
        *complete, self._partial = (self._partial + new).split("\n")
        self._lines.extend(map(_as_shown, complete))

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                asyncio.run(self._tail())
            except Exception:  # a dropped connection: reconnect, the replay is skipped
                pass
            if self._stop.wait(RECONNECT_S):
                return

    async def _tail(self) -> None:
        received = 0
        async for chunk in self.client.tail_job_logs(self.submission_id):
            with self._lock:
                self._take(chunk, received)
            received += len(chunk)
            if self._stop.is_set():
                return


def _as_shown(line: str) -> str:
    """A progress bar (tqdm) redraws its line with carriage returns: the line as a terminal shows it last,
    without the colour codes Ray puts around a worker's "(TaskRunnerV1 pid=N)" prefix."""
    return ANSI_CODE.sub("", line.rstrip("\r").rsplit("\r", 1)[-1])


class VerlMetrics:
    """verl's file-logger JSONL of one attempt, read as it grows, as the run's step records after
    `after_step` (the ones the run has already), each marked with the step the attempt resumed from.
    Past them, every training record comes in the file's order, a step logged twice included: the
    guards judge the order (backends/guards.py)."""

    def __init__(self, path: Path, after_step: int | None, responses_per_step: int, resumed_from: int | None):
        self.path, self.offset = Path(path), 0
        self.last_step = after_step or 0
        self.passing = False  # once a step past after_step came, every later one is passed on
        self.resumed_from = resumed_from
        self.responses_per_step = responses_per_step

    def new(self) -> list[StepMetrics]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        records = []
        for line in data[:end].splitlines():
            record = self._step_metrics(line)
            if record is not None and (self.passing or record.step > self.last_step):
                self.passing, self.last_step = True, record.step
                records.append(record)
        return records

    def _step_metrics(self, line: bytes) -> StepMetrics | None:
        try:
            entry = json.loads(line)
            step, data = int(entry["step"]), entry["data"]
        except (ValueError, KeyError, TypeError):
            return None
        return from_verl(step, data, self.responses_per_step, self.resumed_from)


def steps_missing_from(run_records: list[StepMetrics], attempt_files: list[Path], resumed_from: int | None,
                       responses_per_step: int) -> list[StepMetrics]:
    """The training steps in verl's files of a run's attempts (first to last) after the run's own last
    record, in order, each from the last attempt that trained it: an attempt that resumed from step N
    trained the steps after N again. Where an attempt resumed from is its file's first line (verl logs
    its validation at that step, else its first step); the last attempt's file may have none yet: it
    resumed from `resumed_from` (None: from scratch)."""
    chain: dict[int, StepMetrics] = {}
    for path in attempt_files:
        start = _resumed_from(path)
        if start is None and path == attempt_files[-1]:
            start = resumed_from or 0
        if start is not None:
            chain = {step: record for step, record in chain.items() if step <= start}
            trained = VerlMetrics(path, start, responses_per_step, start or None).new()
            chain.update((record.step, record) for record in trained)
    last = max((record.step for record in run_records), default=0)
    return [chain[step] for step in sorted(chain) if step > last]


def _resumed_from(path: Path) -> int | None:
    """The step an attempt's file starts after, from its first line; None while it has none."""
    try:
        with open(path, "rb") as handle:
            entry = json.loads(handle.readline())
        step, trained = int(entry["step"]), TRAINING_STEP in entry["data"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not verl's
        return None
    return step - 1 if trained else step


def _number(data: dict, *keys: str) -> float | None:
    for key in keys:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _measured(data: dict, key: str) -> float | None:
    """A value the guards read: its number, NaN where the record holds null (orjson writes a NaN or an
    infinity so: verl logged it as a number), None where the record has no such key."""
    return math.nan if key in data and data[key] is None else _number(data, key)


def _mismatch(data: dict) -> float | None:
    """verl's rollout vs trainer KL per token; NaN where the trainer's log-probs were (their perplexity null)."""
    mismatch, trainer_log_ppl = _measured(data, MISMATCH), _measured(data, TRAINER_LOG_PPL)
    if mismatch is not None and trainer_log_ppl is not None and math.isnan(trainer_log_ppl):
        return math.nan
    return mismatch


# |advantage| below this is zero: a constant group's (r - mean) / (std + eps), with float rounding.
ZERO_ADVANTAGE = 1e-6


def _zero_advantage_share(data: dict) -> float | None:
    """1.0 when every advantage of the step is zero (every group's rewards constant), from the scores' and
    the advantages' min and max that verl logs; None otherwise: verl logs no count of constant groups."""
    scores = [_number(data, f"critic/score/{end}") for end in ("min", "max")]
    advantages = [_number(data, f"critic/advantages/{end}") for end in ("min", "max")]
    if None not in scores and scores[0] == scores[1]:
        return 1.0
    if None not in advantages and max(abs(value) for value in advantages) < ZERO_ADVANTAGE:
        return 1.0
    return None


def from_verl(step: int, data: dict, responses_per_step: int, resumed_from: int | None) -> StepMetrics | None:
    """One verl step's metrics as a `StepMetrics`; None for a record without a training reward (the
    validation verl logs before the first step of an attempt). A step whose reward is null (every
    sample aborted, or a NaN score) is a step with a NaN reward, for the guards to judge."""
    reward = _measured(data, REWARD)
    if reward is None:
        return None
    step_time = _number(data, "timing_s/step", "perf/time_per_step") or 0.0
    length = _number(data, "response_length/mean") or 0.0
    return StepMetrics(
        step=step,
        reward_mean=reward,
        # KL to the reference: the KL loss, or the in-reward penalty (verl logs neither without KL).
        kl=_number(data, "actor/kl_loss", "actor/reward_kl_penalty"),
        loss=_measured(data, "actor/pg_loss"),
        entropy=_measured(data, "actor/entropy"),
        response_length=length,
        # Generated tokens per second, as the local backend counts them (verl's perf/throughput
        # counts prompt tokens too, per device).
        tokens_per_s=length * responses_per_step / step_time if step_time else None,
        step_time_s=step_time,
        learning_rate=_number(data, "actor/lr"),
        grad_norm=_measured(data, "actor/grad_norm"),
        mismatch=_mismatch(data),
        zero_advantage_share=_zero_advantage_share(data),
        resumed_from=resumed_from,
        time=time.time(),
    )
