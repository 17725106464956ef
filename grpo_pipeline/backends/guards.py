"""Guards: the failures that exit 0 stop the run instead, on both backends.

    python -m grpo_pipeline --model tiny --device cpu --set guards.reward_collapse_steps=off

`StepGuards` reads every training step's record (`StepMetrics`, the same for both engines) as the train
stage passes it on (stages/train.py). The local backend's workers run the same guards themselves
(backends/local/worker.py): `non_finite` before a step's checkpoint is written, the others before the
next step's rollout, so a run stops at the step that tripped however far the stage has read. A tripped guard raises
`GuardTripped`: the stage stops the engine through `Backend.stop_for_guard` (the verl job through Ray's
job API, the local backend's workers), the failure hooks write the report, the trackers are told, and
the train stage's retry never runs it again (the same data and weights would trip it again).

| guard | trips on | likely cause |
|---|---|---|
| rollout_mismatch | rollout vs trainer log-probs (KL per token) above its threshold for N steps | a weight sync that did not reach the rollout engine |
| reward_collapse | every group's rewards constant for N steps, or the mean reward exactly 0 in each of the first N | a reward that returns a constant, or never scores |
| non_finite | a NaN or infinite loss, gradient norm, reward or log-prob | a diverged update, a poisoned value |
| short_run | the engine exits 0 before its last step, or skips or repeats a step | a resume at an epoch boundary (verl #7401) |
| data_position | a checkpoint to resume from without its data position | a resume that would start the data over |

The backends measure what the guards read: the local backend's probe (backends/local/probe.py) and
TRL's `frac_reward_zero_std`, verl's own `rollout_corr/k3_kl` and advantages (backends/verl/follow.py).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

from grpo_pipeline.backends.metrics import StepMetrics
from grpo_pipeline.profiles.guards import GuardsSection

GuardName = Literal["rollout_mismatch", "reward_collapse", "non_finite", "short_run", "data_position"]
# What non_finite reads of a step: a NaN anywhere here means the update (or what it learns from) is poisoned.
# The mismatch is computed from the trainer's and the rollout's log-probs: NaN there is a NaN log-prob.
WATCHED = (("loss", "loss"), ("grad_norm", "grad norm"), ("reward_mean", "reward"), ("mismatch", "log-prob mismatch"),
           ("entropy", "entropy"))


class GuardTrip(BaseModel):
    """A guard that stopped the run: which, at which step, the one line, and what was kept."""

    guard: GuardName
    step: int | None = Field(None, description="The step it stopped at (None: before any step, or at the end).")
    line: str = Field(..., description="Names the step, the numbers and the likely cause.")
    kept: str | None = Field(None, description="What the run kept (its latest good checkpoint), once stopped.")


class GuardTripped(Exception):
    """A guard stopped the run. Not retried: the same data and weights would trip it again."""

    def __init__(self, trip: GuardTrip):
        super().__init__(trip)
        self.trip = trip

    def __str__(self) -> str:
        kept = f"; kept: {self.trip.kept}" if self.trip.kept else ""
        return f"{self.trip.line}{kept}"


def _trip(guard: GuardName, step: int | None, line: str, setting: str) -> GuardTrip:
    return GuardTrip(guard=guard, step=step, line=f"{line} ({setting}=off to run on)")


def non_finite_reward_trip(step: int | None, said: str) -> GuardTrip:
    """A reward that returned NaN or an infinity (`said` names the reward and the row): the step it scored
    would learn from a poisoned advantage, so it stops as a non-finite loss does."""
    where = f"step {step}: " if step is not None else ""
    return _trip("non_finite", step, f"{where}non-finite reward: {said}", "guards.non_finite")


class StepGuards:
    """The per-step guards over a run's records. `history`: the records already passed on (before this
    attempt's first step); `resumed_from`: the checkpoint step this attempt resumed from."""

    def __init__(self, settings: GuardsSection, history: list[StepMetrics] | None = None,
                 resumed_from: int | None = None):
        self.settings, self.records = settings, list(history or [])
        self.resumed_from = resumed_from

    def check(self, record: StepMetrics) -> GuardTrip | None:
        """The first guard this step trips, in order of urgency; the record joins the history."""
        previous = self.records[-1].step if self.records else None
        self.records.append(record)
        return (self.non_finite(record) or self._sequence(record, previous) or self._mismatch(record)
                or self._collapse(record))

    def non_finite(self, record: StepMetrics) -> GuardTrip | None:
        if not self.settings.on("non_finite"):
            return None
        bad = [(label, getattr(record, name)) for name, label in WATCHED
               if getattr(record, name) is not None and not math.isfinite(getattr(record, name))]
        if not bad:
            return None
        said = ", ".join(f"{label} {value}" for label, value in bad)
        return _trip("non_finite", record.step, f"step {record.step}: non-finite {said}: the update diverged or a "
                     "value was poisoned, so this step's weights are not kept", "guards.non_finite")

    def _sequence(self, record: StepMetrics, previous: int | None) -> GuardTrip | None:
        if not self.settings.on("short_run"):
            return None
        expected = (previous if previous is not None else self.resumed_from or 0) + 1
        if record.step == expected:
            return None
        if record.step > expected:
            missing = f"step {expected}" if record.step == expected + 1 else f"steps {expected}-{record.step - 1}"
            said = f"step {record.step} came after step {expected - 1}: the engine skipped {missing}"
        else:
            said = f"step {record.step} came after step {expected - 1}: the engine trained step {record.step} again"
        return _trip("short_run", record.step, f"{said} (a resume that lost its place?)", "guards.short_run")

    def _mismatch(self, record: StepMetrics) -> GuardTrip | None:
        threshold, steps = self.settings.rollout_mismatch, self.settings.rollout_mismatch_steps
        if threshold == "off":
            return None
        last = self.records[-steps:]
        values = [r.mismatch for r in last]
        if len(last) < steps or any(value is None or value <= threshold for value in values):
            return None
        shown = ", ".join(f"{value:.4g}" for value in values)
        return _trip("rollout_mismatch", record.step,
                     f"step {record.step}: rollout vs trainer log-prob mismatch {shown} (KL per token) in steps "
                     f"{last[0].step}-{record.step}, above {threshold}: rollouts are not using the trained weights "
                     "(a weight sync that did not reach the rollout engine?)", "guards.rollout_mismatch")

    def _collapse(self, record: StepMetrics) -> GuardTrip | None:
        steps = self.settings.reward_collapse_steps
        if steps == "off" or len(self.records) < steps:
            return None
        if record.step == steps and all(r.reward_mean == 0 for r in self.records[:steps]):
            return _trip("reward_collapse", record.step,
                         f"step {record.step}: the mean reward was exactly 0 in each of the first {steps} steps: the "
                         "reward never scores a response (its data_source, the answer format, reward.functions?)",
                         "guards.reward_collapse_steps")
        last = self.records[-steps:]
        if all(r.zero_advantage_share == 1.0 for r in last):
            rewards = sorted({round(r.reward_mean, 4) for r in last})
            said = f"mean reward {rewards[0]}" if len(rewards) == 1 else f"mean rewards {rewards[0]}-{rewards[-1]}"
            return _trip("reward_collapse", record.step,
                         f"step {record.step}: every group's rewards were constant in each of the last {steps} steps "
                         f"({said}): zero advantage everywhere, nothing is learned (a reward that returns a constant, "
                         "or a task all too hard or too easy for the model?)", "guards.reward_collapse_steps")
        return None


def check_short_run(settings: GuardsSection, final: int, planned: int, engine: str) -> None:
    """The engine ended without an error at `final`, before its `planned` last step: stop (unless off)."""
    if settings.on("short_run") and final < planned:
        raise GuardTripped(_trip(
            "short_run", final, f"{engine} exited 0 at step {final} of the {planned} it planned: training ended early "
            "and silently (a resume at an epoch boundary that skipped the rest, verl #7401?)", "guards.short_run"))


def check_data_position(settings: GuardsSection, step: int, missing: str | None) -> None:
    """A resume from `step` whose checkpoint lacks `missing` (what holds the data's position): stop (unless off)."""
    if missing is not None and settings.on("data_position"):
        raise GuardTripped(_trip(
            "data_position", step, f"cannot resume from checkpoint global_step_{step}: {missing}, so the resumed run "
            "would start the data over instead of continuing where it stopped", "guards.data_position"))
