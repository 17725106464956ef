"""The run's reward: its parts (the rewards a team brings, a reward server, else the data's built-in
reward), their weights, and the one way every place scores a batch with them.

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[{path: /r.py:compute_score, weight: 0.5}]'

`RewardPlan` is plain data (it travels to Ray Train workers and, as JSON, with a verl job); `RewardParts`
loads what it names in the process that scores. The sum GRPO optimises is TRL's: each part's value times
its weight, a part that gave None for a sample left out of that sample's sum (`nansum`). Each part's values
and a verl reward's numeric extras are kept by name, so training logs them per step and the trackers get them.
"""

from __future__ import annotations

import re

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from grpo_pipeline.rewards.functions import Batch, Scored, UserReward

BUILTIN = "builtin"


class FunctionEntry(BaseModel):
    spec: str = Field(..., description="`/path/file.py:function`.")
    weight: float = 1.0
    name: str | None = None


class RewardPlan(BaseModel):
    """What scores the run's completions, resolved from the profile's `reward` section."""

    functions: list[FunctionEntry] = Field(default_factory=list)
    url: str | None = None
    token: str | None = Field(None, description="`${NAME}` only: the value is read where the scoring runs.")
    weight: float = 1.0
    batch_size: int = 64
    timeout_s: float = 30.0
    retries: int = 3
    eval_timeout_s: float = 1800.0

    @classmethod
    def from_section(cls, section) -> RewardPlan:
        """From the profile's `reward` section (profiles/rewards.py)."""
        return cls(functions=[FunctionEntry(spec=f.path, weight=f.weight, name=f.name) for f in section.functions],
                   url=section.url, token=section.token, weight=section.weight, batch_size=section.batch_size,
                   timeout_s=section.timeout_s, retries=section.retries, eval_timeout_s=section.eval_timeout_s)

    @property
    def custom(self) -> bool:
        return bool(self.functions or self.url)

    def files(self) -> list[str]:
        return [entry.spec.rpartition(":")[0] for entry in self.functions]


@dataclass
class Part:
    name: str
    weight: float
    score: Callable[..., Scored]


@dataclass
class BatchScores:
    """A batch's rewards: the weighted sum, each part's values, the extras, and evaluation's flags."""

    rewards: list[float]
    parts: dict[str, list[float | None]]
    extras: dict[str, list[float | None]] = field(default_factory=dict)
    correct: list[bool] = field(default_factory=list)
    formatted: list[bool] = field(default_factory=list)

    def means(self) -> dict[str, float]:
        """Per-part and per-extra means over the batch's samples that have a value: what a step logs."""
        means = {f"rewards/{name}/mean": _mean(values) for name, values in self.parts.items()}
        means |= {f"reward_extras/{metric_key(name)}/mean": _mean(values) for name, values in self.extras.items()}
        return {key: value for key, value in means.items() if value is not None}


def metric_key(extra: str) -> str:
    """An extra's key (a verl reward's dict, any text) as every tracker takes it in a metric's name: MLflow
    refused `reward_extras/acc!/mean`, and every training step with it was lost from the run."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", str(extra)) or "_"


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


class RewardParts:
    """The plan's parts, loaded here (user files imported, the server's client made)."""

    def __init__(self, plan: RewardPlan):
        from grpo_pipeline.rewards.server import RewardServer

        self.plan = plan
        self.parts: list[Part] = []
        for entry in plan.functions:
            reward = UserReward(entry.spec, entry.name)
            self.parts.append(Part(reward.name, entry.weight, reward))
        if plan.url:
            server = RewardServer(plan.url, plan.token, plan.timeout_s, plan.retries, plan.batch_size)
            self.parts.append(Part(server.name, plan.weight, server))
        if not self.parts:
            self.parts.append(Part(BUILTIN, 1.0, builtin_reward))
        unique_names(self.parts)

    def score(self, batch: Batch, log_metric: Callable[[str, float], None] | None = None) -> BatchScores:
        scored = {part.name: part.score(batch, log_metric) for part in self.parts}
        return self.combine(batch, scored)

    def combine(self, batch: Batch, scored: dict[str, Scored]) -> BatchScores:
        rewards = []
        for i in range(len(batch)):
            terms = [part.weight * scored[part.name].values[i] for part in self.parts if scored[part.name].values[i] is not None]
            rewards.append(sum(terms))
        extras = {key: values for s in scored.values() for key, values in s.extras.items()}
        correct = extras.pop("__correct__", None)
        formatted = extras.pop("__formatted__", None)
        full_marks = sum(part.weight for part in self.parts if part.weight > 0)
        return BatchScores(
            rewards=rewards, parts={name: s.values for name, s in scored.items()}, extras=extras,
            # A reward of the user's says nothing of correctness: full marks count as correct, any reward as formatted.
            correct=[bool(c) for c in correct] if correct else [r >= full_marks for r in rewards],
            formatted=[bool(f) for f in formatted] if formatted else [r > 0 for r in rewards])


def unique_names(parts: list[Part]) -> None:
    """Two rewards of one name are logged and summed apart: each gets the first `<name>_<n>` that no
    other part is named (an index suffix alone clashed with a part named so: `x, x, x_1` became
    `x_0, x_1, x_1`, one part dropped and another counted twice)."""
    given = [part.name for part in parts]
    taken = set(given)
    for part in parts:
        if given.count(part.name) < 2:
            continue
        number = 1
        while f"{part.name}_{number}" in taken:
            number += 1
        taken.add(f"{part.name}_{number}")
        part.name = f"{part.name}_{number}"


def builtin_reward(batch: Batch, log_metric=None) -> Scored:
    """Each row's built-in reward by its data_source (rewards/builtin.py); its flags ride as hidden extras."""
    from grpo_pipeline.rewards.builtin import score

    scores = [score(source, text, truth) for source, text, truth in
              zip(batch.columns["data_source"], batch.completions, batch.columns["ground_truth"])]
    return Scored(values=[s.reward for s in scores],
                  extras={"__correct__": [s.correct for s in scores], "__formatted__": [s.formatted for s in scores]})


def batch_of(rows: list[dict[str, Any]], completions: list[str]) -> Batch:
    """Completions with their rows (verl's RL schema: prompt, data_source, reward_model or ground_truth,
    extra_info): the columns a TRL reward gets, and how an error names each row."""
    columns: dict[str, list[Any]] = {}
    names = [key for key in rows[0] if key != "prompt"] if rows else []
    for key in names:
        columns[key] = [row.get(key) for row in rows]
    if "ground_truth" not in columns:
        columns["ground_truth"] = [str((row.get("reward_model") or {}).get("ground_truth")) for row in rows]
    columns.setdefault("extra_info", [None] * len(rows))
    columns["extra_info"] = [dict(info or {}) for info in columns["extra_info"]]
    for key in sorted({k for info in columns["extra_info"] for k in info} - set(columns)):
        columns[key] = [info.get(key) for info in columns["extra_info"]]
    return Batch(prompts=[row["prompt"] for row in rows], completions=completions, columns=columns,
                 rows=[row_name(row.get("extra_info") or {}, i) for i, row in enumerate(rows)])


def row_name(info: dict, i: int) -> str:
    """How an error names a sample's row: its dataset index and split (extra_info), else its place in the batch."""
    if info.get("index") is not None:
        split = f" of the {info['split']} split" if info.get("split") else ""
        return f"row {info['index']}{split}"
    return f"sample {i}"
