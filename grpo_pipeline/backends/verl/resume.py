"""What a verl resume needs from its checkpoint, and the checkpoints it must never take.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --ray-address head:6379 --run-name <run>   # a resume

verl 0.9.1 saves its dataloader's position beside each step (`global_step_N/data.pt`, v1
trainer_base._save_checkpoint) and loads it on resume; without it, it only warns ("No dataloader state
found at ..., will start from scratch") and trains the data again from its first batch:
`missing_dataloader_state` says so before a resume is submitted (the `data_position` guard).

verl writes a step's checkpoint before it logs the step's metrics, so a step whose loss or gradient was
NaN may already be saved, and its tracker file pointed at it, when the flow reads the NaN. `set_aside`
moves such steps to `poisoned-global_step_N` (kept, never deleted) and points the tracker back at the
latest step before them, so neither a resume nor the export takes a poisoned policy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from grpo_pipeline.backends.guards import GuardTrip
from grpo_pipeline.backends.verl.follow import TRACKER, tracker_step
from grpo_pipeline.store.files import write_text_atomic

DATALOADER_STATE = "data.pt"
POISONED = "poisoned-"


def missing_dataloader_state(checkpoints: Path, step: int) -> str | None:
    """What global_step_N lacks for verl to continue the data where step N left it (None: nothing)."""
    path = Path(checkpoints) / f"global_step_{step}" / DATALOADER_STATE
    if not path.is_file():
        return f"it has no dataloader state ({DATALOADER_STATE}), which verl only warns about"
    if path.stat().st_size == 0:
        return f"its dataloader state ({DATALOADER_STATE}) is empty"
    return None


def saved_steps(checkpoints: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("global_step_")) for path in Path(checkpoints).glob("global_step_*")
                  if path.name.removeprefix("global_step_").isdigit() and path.is_dir())


def set_aside(checkpoints: Path, from_step: int) -> tuple[int | None, list[str]]:
    """Move every saved step from `from_step` on aside and point verl's tracker at the latest step before
    them (no tracker when there is none: a later run starts fresh). Returns that step and what was moved."""
    checkpoints = Path(checkpoints)
    moved = []
    for step in saved_steps(checkpoints):
        if step >= from_step:
            aside = checkpoints / f"{POISONED}global_step_{step}"
            if aside.exists():  # set aside before, by an earlier attempt that resumed before it
                aside = aside.with_name(f"{aside.name}-{time.time_ns()}")
            os.replace(checkpoints / f"global_step_{step}", aside)
            moved.append(aside.name)
    good = max((step for step in saved_steps(checkpoints) if step < from_step), default=None)
    if moved and good is not None:
        write_text_atomic(checkpoints / TRACKER, str(good))
    elif moved and tracker_step(checkpoints) is None and (checkpoints / TRACKER).is_file():
        os.replace(checkpoints / TRACKER, checkpoints / f"{POISONED}{TRACKER}")
    return good, moved


def keep_good_checkpoint(checkpoints: Path, trip: GuardTrip) -> str:
    """What the run keeps once a guard stopped its job: after a non-finite step, what verl saved from that
    step on is set aside; in words."""
    if trip.guard == "non_finite" and trip.step is not None:
        good, moved = set_aside(checkpoints, trip.step)
        kept = f"checkpoint global_step_{good}" if good is not None else "no checkpoint from before it"
        return f"{kept}; {', '.join(moved)} set aside (saved from the poisoned step on)" if moved else kept
    step = tracker_step(checkpoints)
    return f"checkpoint global_step_{step}, the latest" if step is not None else "no checkpoint (none was saved)"
