"""The profile's `reward` section: the reward functions a team brings, their weights, and a reward server.

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[/path/reward.py:compute_score]' --dry-run

A function is written for verl (`compute_score(data_source, solution_str, ground_truth, extra_info=None)`,
a float or a dict with `score` and extras) or for TRL (`f(prompts, completions, **columns)`, a list of
floats or None, sync or async); the same file runs unchanged on the local backend (TRL's
`reward_funcs`) and on the verl backend (verl's `reward.custom_reward_function`, the file carried by the
Ray job). Empty: each row's `data_source` picks the built-in reward (rewards/builtin.py).
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import Field, field_validator

from grpo_pipeline.profiles.section import Section

# A reward part's name as every tracker takes it inside `rewards/<name>/mean` (no `/`: it would nest).
METRIC_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class RewardFunction(Section):
    path: str = Field(..., min_length=3, description="`/path/to/file.py:function`: a file every node can read (the "
                      "verl backend carries it with its job).")
    weight: float = Field(1.0, description="Weight of this reward in the sum GRPO optimises (TRL's `reward_weights`).")
    name: str | None = Field(None, max_length=64, description="How its values are logged (`rewards/<name>/mean`); "
                             "letters, digits, `_`, `-` and `.` (what every tracker takes in a metric's name); empty: "
                             "the function's name.")

    @field_validator("path")
    @classmethod
    def absolute(cls, path: str) -> str:
        """A relative file is the planning directory's: made absolute here, since Ray's workers run elsewhere (a
        relative path failed in the workers 91 s into training)."""
        file, colon, function = path.rpartition(":")
        if not colon or not file:
            return path  # no `file:function`: refused by the planning check, naming the form
        return f"{os.path.abspath(os.path.expanduser(file))}:{function}"

    @field_validator("name")
    @classmethod
    def a_metric_name_every_tracker_takes(cls, name: str | None) -> str | None:
        """MLflow refuses a metric named `rewards/acc!/mean`, and every training step was lost from it; said here."""
        if name is not None and not METRIC_NAME.fullmatch(name):
            raise ValueError(f"{name!r} names the metric rewards/{name}/mean, which trackers refuse (MLflow takes "
                             "letters, digits, _, -, . and /); use only letters, digits, _, - and .")
        return name


class RewardSection(Section):
    """Rewards that users bring; empty: the dataset's built-in reward."""

    functions: list[RewardFunction] = Field(
        default_factory=list, description="Reward functions, each `/path/file.py:function` (weight 1) or "
        "`{path: ..., weight: 0.5, name: ...}`; verl-style or TRL-style, detected from the signature.")
    url: str | None = Field(
        None, description="A reward server: `http(s)://host:port/path` answering a POST of a JSON batch "
        "(`prompts`, `completions`, `data_source`, `ground_truth`, `extra_info`) with `{\"rewards\": [...]}`, one "
        "number (or null) per completion.")
    token: str | None = Field(
        None, description="The server's bearer token, only as a reference `${NAME}`: the value stays in the "
        "environment of the processes that score (the flow's; on a cluster, each node's).")
    weight: float = Field(1.0, description="Weight of the server's reward in the sum.")
    batch_size: int = Field(64, gt=0, le=65536, description="Completions per request to the server.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Seconds one request may take.")
    retries: int = Field(3, ge=0, le=20, description="Tries after the first for a request that fails (connection "
                         "refused or reset, timeout, HTTP 5xx or 429), with backoff; then the run stops in one line.")
    check_timeout_s: float = Field(120.0, gt=0, le=3600, description="How long the planning check (import, "
                                   "signature, a dry call on two rows) may take.")
    eval_timeout_s: float = Field(1800.0, gt=0, le=86400, description="How long scoring one evaluation's responses "
                                  "with the rewards the run brings may take (in a child process): a reward that hangs "
                                  "fails the run in one line instead of holding it forever.")

    @field_validator("functions", mode="before")
    @classmethod
    def paths_may_stand_alone(cls, value: Any) -> Any:
        """`--set 'reward.functions=[/a.py:f]'`: a bare path is a function of weight 1."""
        if isinstance(value, (str, dict)):
            value = [value]
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @property
    def custom(self) -> bool:
        return bool(self.functions or self.url)
