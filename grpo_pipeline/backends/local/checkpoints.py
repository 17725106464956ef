"""The local backend's checkpoint layout, which a retry resumes from and the export stage reads.

    runs/<run>/checkpoints/global_step_N/   HF policy + tokenizer + optimizer, scheduler, RNG, trainer state
    runs/<run>/checkpoints/latest           "N", written (atomically) after global_step_N is complete

Nothing here is ever deleted: a step saved again after a resume moves its older copy aside.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from grpo_pipeline.store.files import share_tree, write_text_atomic
from grpo_pipeline.store.bounded_read import MAX_JSON_BYTES, read_regular

LATEST = "latest"
TRAINER_DIR = ".trainer"  # where TRL writes checkpoint-N before it is published
TRAINER_STATE = "trainer_state.json"  # transformers' step count, from which it finds the data's position


def latest_step(checkpoints: Path) -> int | None:
    """The step of the last complete checkpoint (the `latest` marker is written after it)."""
    try:
        step = int((checkpoints / LATEST).read_text().strip())
    except (OSError, ValueError):
        return None
    return step if (checkpoints / f"global_step_{step}").is_dir() else None


def publish_step(checkpoints: Path, step: int) -> None:
    """Move the trainer's `checkpoint-N` to `global_step_N`, then point `latest` at it (rank 0,
    once every rank has written its part)."""
    written = checkpoints / TRAINER_DIR / f"checkpoint-{step}"
    final = checkpoints / f"global_step_{step}"
    if written.is_dir():
        if final.exists():
            os.replace(final, checkpoints / f".replaced-global_step_{step}-{time.time_ns()}")
        os.replace(share_tree(written), final)
        write_text_atomic(checkpoints / LATEST, f"{step}\n")


def missing_data_position(checkpoints: Path, step: int) -> str | None:
    """What global_step_N lacks for a resume that continues the data where step N left it: transformers
    takes the step (and so how many batches of the epoch to skip) from its trainer_state.json; without
    one it starts from step 0 and the first batch. None when nothing is missing."""
    path = checkpoints / f"global_step_{step}" / TRAINER_STATE
    try:
        state = json.loads(read_regular(path, MAX_JSON_BYTES))
    except FileNotFoundError:
        return f"it has no {TRAINER_STATE}"
    except (OSError, ValueError) as exc:  # not a regular file, too big, not JSON
        return f"its {TRAINER_STATE} cannot be read ({getattr(exc, 'strerror', None) or exc})"
    found = state.get("global_step") if isinstance(state, dict) else None
    return None if found == step else f"its {TRAINER_STATE} says step {found}"
