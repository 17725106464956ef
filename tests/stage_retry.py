"""A training attempt retried as the train stage retries it, for the one failure a test does not mean: Ray 2.60's
placement-group cleaner taking a live run's controller for dead.

Ray Train v2's detached `PlacementGroupCleaner` asks the State API every second whether the controller is alive
and takes no answer for "dead" (ray-project/ray#65447's review names it): on a loaded machine it removes a live
run's placement group, and the run ends with `Destroying worker since its placement group was removed`. In the
flow the train stage's retry resumes from the latest checkpoint (seen once in a CI run of 1,315 tests, and again
beside a load of 8). A test that calls `train_local` itself has no stage around it:

    result = like_the_stage(lambda: train_local(settings, None, None, on_step=seen.append, on_start=restarted))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from grpo_pipeline.backends.base import TrainingInterrupted

RAYS_CLEANER_RACE = "placement group was removed"
T = TypeVar("T")


def like_the_stage(attempt: Callable[[], T]) -> T:
    """`attempt()`, and once more where Ray's cleaner race (only) ended it."""
    try:
        return attempt()
    except TrainingInterrupted as exc:
        if RAYS_CLEANER_RACE not in str(exc.__cause__):
            raise
        print(f"retried as the train stage would: {exc}")
        return attempt()


def steps_heard(seen: list) -> Callable[[int, int | None], None]:
    """An `on_start` that cuts `seen` (the records `on_step` heard) back to the step an attempt resumed from, as
    the run's metrics file is cut back."""
    def restarted(max_steps: int, resumed_from: int | None) -> None:
        del seen[resumed_from or 0:]

    return restarted
