"""The run's tracker runs, open for a stretch of the flow: training's steps, the evaluation, the
report's files, and the run's end.

    python -m grpo_pipeline --model tiny --device cpu --set 'tracking.trackers=[mlflow]'

Each tracker gets every training step once and in order: `tracking.json` keeps, per tracker, the last
step it has (`logged_to`), and the steps after it are read back from metrics.jsonl, where the training
side wrote them. So a tracker that stops answering never holds training up for long: a request gives
up after a few seconds without retries (`Tracker.bounded`, profiles/trackers/), and once one failed,
the tracker is tried again at most every RETRY_S while its steps wait; when it answers, the steps it
missed go first. At the end (and when a rerun starts training) every tracker is filled up to the last
step of metrics.jsonl, which also covers steps trained by workers that outlived a killed flow; the
steps a tracker still lacks then are `missed`, which the report names. Every way a run ends closes
the tracker runs with its status: FINISHED, FAILED, or KILLED (cancelled or stopped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from grpo_pipeline.tracking.trackers import (
    TrackingState,
    one_line,
    read_state,
    write_state,
)
from grpo_pipeline.profiles.trackers import Tracker, tracker_for
from grpo_pipeline.profiles.tracking import TrackingSection

# A tracker that did not answer is asked again after this long, not at every step.
RETRY_S = 30.0
# The steps after one and up to another (both given), each with its tracker values, read from metrics.jsonl.
StepSource = Callable[[int, int], list[tuple[int, dict[str, float]]]]


class TrackingSession:
    """The run's trackers while the flow works with them. A tracker that cannot be opened or reached is
    tried again later (`warn` says so, once per outage); nothing here raises for a tracker's fault."""

    def __init__(self, settings: TrackingSection, run_dir: Path, state: TrackingState, run_name: str,
                 steps: StepSource | None = None, warn: Callable[[str], None] | None = None):
        self.run_dir, self.state, self.run_name = Path(run_dir), state, run_name
        self.steps, self.warn = steps or (lambda after, upto: []), warn or (lambda line: None)
        self.trackers: list[Tracker] = []
        self._opened: set[str] = set()
        self._failed_at: dict[str, float] = {}  # a tracker that did not answer: when it last failed
        for name in state.runs:
            self.trackers.append(tracker_for(name, settings, run_dir))

    def log_step(self, step: int, values: dict[str, float] | None = None, now: bool = False) -> None:
        """Every tracker gets the steps it lacks up to `step` (`values`: step's own, when the file may lag);
        `now`: a tracker that did not answer is asked at once, not after its wait."""
        for tracker in self.trackers:
            done = self.state.logged(tracker.name)
            if done < step:  # else an earlier attempt logged it (a resumed attempt trains it again)
                self._attempt(tracker, lambda t=tracker, d=done: self._send(t, self._backlog(d, step, values)), now)
        self._save()

    def catch_up(self) -> None:
        """Fill every tracker up to the last step of metrics.jsonl (a rerun, the run's end)."""
        if last := self.steps(0, 2**62):
            self.log_step(last[-1][0], now=True)

    def log_evaluation(self, step: int, metrics: dict[str, float]) -> bool:
        """The evaluation of the policy at training step `step`, once."""
        if step in self.state.evaluated_at:
            return False
        if self.log_values(step, metrics):
            self.state.evaluated_at.append(step)
            self._save()
        return True

    def log_values(self, step: int, values: dict[str, float]) -> bool:
        """Values at `step` outside the training steps (the evaluation, a guard that stopped the run), asked
        of every tracker now; True when all of them answered."""
        return all([self._attempt(tracker, lambda t=tracker: t.log_metrics(values, step), now=True)
                    for tracker in self.trackers])

    def log_tags(self, tags: dict[str, str]) -> None:
        """Tags on every tracker's run (the best checkpoint, once chosen)."""
        for tracker in self.trackers:
            self._attempt(tracker, lambda t=tracker: t.log_params({}, tags), now=True)

    def log_files(self, paths: list[Path]) -> None:
        for path in (Path(p) for p in paths):
            if path.is_file():
                for tracker in self.trackers:
                    self._attempt(tracker, lambda t=tracker: t.log_file(path), now=True)

    def missed(self) -> dict[str, list[int]]:
        """Per tracker, the steps of metrics.jsonl it does not have; kept in tracking.json for the report."""
        steps = [step for step, _ in self.steps(0, 2**62)]
        self.state.missed = {t.name: gap for t in self.trackers if (gap := [s for s in steps if s > self.state.logged(t.name)])}
        self._save()
        return self.state.missed

    def close(self, status: str | None = None) -> None:
        """Let go of the trackers; a `status` (FINISHED, FAILED, KILLED) ends their runs with it."""
        for tracker in self.trackers:
            if status is not None or tracker.name in self._opened:  # ending a run opens it first if need be
                self._attempt(tracker, lambda t=tracker: t.close(status), now=True)
        if status is not None:
            self.state.ended = status
            self._save()
        self.trackers = []

    def _backlog(self, done: int, step: int, values: dict[str, float] | None) -> list[tuple[int, dict[str, float]]]:
        """The steps after `done` up to `step`: this one alone when it is the next, else from metrics.jsonl."""
        backlog = [(step, values)] if values is not None and done == step - 1 else self.steps(done, step)
        if values is not None and not any(s == step for s, _ in backlog):
            backlog.append((step, values))
        return backlog

    def _send(self, tracker: Tracker, backlog: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in backlog:
            tracker.log_metrics(values, step)
            self.state.logged_to[tracker.name] = step

    def _attempt(self, tracker: Tracker, work: Callable[[], None], now: bool) -> bool:
        """`work` against one tracker (opened first), each request bounded; False when it did not answer."""
        name = tracker.name
        if not now and name in self._failed_at and time.monotonic() - self._failed_at[name] < RETRY_S:
            return False  # still waiting after a fault: its steps stay in metrics.jsonl until it is asked again
        try:
            with tracker.bounded():
                if name not in self._opened:
                    tracker.open(self.state.runs[name], self.run_name)
                    self._opened.add(name)
                work()
        except Exception as exc:  # each tool raises its own types (connection, auth, timeouts)
            if name not in self._failed_at:
                self.warn(f"tracking: {tracker.label} did not answer ({one_line(exc)}); training goes on, its steps "
                          f"wait in metrics.jsonl and are sent when it answers (asked again every {RETRY_S:.0f} s)")
            self._failed_at[name] = time.monotonic()
            return False
        if self._failed_at.pop(name, None) is not None:
            self.warn(f"tracking: {tracker.label} answers again; it has every step up to {self.state.logged(name)}")
        return True

    def _save(self) -> None:
        if self.state.runs:
            self.state.last_step = min(self.state.logged(name) for name in self.state.runs)
        write_state(self.run_dir, self.state)


@contextmanager
def tracking_session(settings: TrackingSection, run_dir: Path, run_name: str, steps: StepSource | None = None,
                     warn: Callable[[str], None] | None = None) -> Iterator[TrackingSession | None]:
    """The run's trackers for a stretch of work; None when the run has none (or none was reachable)."""
    state = read_state(run_dir)
    if not settings.trackers or state is None or not state.runs:
        yield None
        return
    session = TrackingSession(settings, run_dir, state, run_name, steps, warn)
    try:
        yield session
    finally:
        session.close()
