"""A run folder is the identity of one request: what it trained, read back from its plan.json.

    python -m grpo_pipeline --model tiny --device cpu --run-name demo                  # trains, then
    python -m grpo_pipeline --model smollm2-135m --device cpu --run-name demo --dry-run
    # error: --run-name demo: runs/demo holds a policy trained with model.name='tiny'; this request has ...

A rerun into a folder that holds a trained policy continues that run (a resume, or "already complete"):
with another model, data, algorithm, reward, adapter or backend it would evaluate and report the old
policy as the new request's. Such a rerun is refused before anything starts, naming the first setting
that differs, and nothing in the folder is touched. What only says how long or how a run goes on (its
steps, saves, evaluation, trackers, guards, the cluster) may change: more steps continue the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_pipeline.errors import UserError
from grpo_pipeline.run.folder import RunFolder

# The settings that decide what is trained (prefixes of the resolved profile's dotted keys); `data.root`
# only says where the store is.
TRAINED_BY = ("backend", "model.name", "model.path", "model.revision", "data", "algorithm", "reward", "lora",
              "actor.ppo_mini_batch_size", "engine.strategy")
NOT_TRAINING = ("data.root",)


def trained_identity(profile: dict[str, Any]) -> dict[str, Any]:
    """The dotted settings of a resolved profile (plan.json's `profile`) that decide what is trained."""
    flat = dict(_flatten(profile))
    return {key: value for key, value in flat.items()
            if key.startswith(TRAINED_BY) and not key.startswith(NOT_TRAINING)}


def identity_problem(run_dir: Path, profile: dict[str, Any]) -> str | None:
    """Why this request cannot run in `run_dir`: the folder holds a policy another request trained."""
    stored = run_dir / RunFolder.PLAN
    if not (run_dir / RunFolder.CHECKPOINTS).is_dir() or not any((run_dir / RunFolder.CHECKPOINTS).iterdir()):
        return None  # nothing trained there: the folder is this run's to fill
    try:
        before = trained_identity(json.loads(stored.read_text())["profile"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a folder from before plan.json was kept: nothing to compare with
    now = trained_identity(profile)
    # Keys in both: a setting added to the profile since the folder's run is no difference of the request.
    for key in sorted(set(before) & set(now), key=lambda k: (TRAINED_BY.index(_prefix(k)), k)):
        if before.get(key) != now.get(key):
            return (f"--run-name {run_dir.name}: {run_dir} holds a policy trained with {key}={_shown(before.get(key))}; "
                    f"this request has {key}={_shown(now.get(key))}. A run folder holds one run: choose a new "
                    "--run-name (or remove the folder); only its steps, saves, evaluation and trackers may change "
                    "to continue it")
    return None


def check_identity(run_dir: Path, profile: dict[str, Any]) -> None:
    if problem := identity_problem(run_dir, profile):
        raise UserError(problem)


def _prefix(key: str) -> str:
    return next(p for p in TRAINED_BY if key.startswith(p))


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flatten(value: Any, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix[:-1], value
