"""The run's reward parts as TRL's `reward_funcs` and `reward_weights`, inside a Ray Train worker.

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[/r.py:compute_score,/t.py:digits]'

One TRL reward function per part (rewards/plan.py), each named by its part, so TRL sums them with their
weights and logs `rewards/<name>/mean` itself; a verl reward's numeric extras go through TRL's
`log_metric` as `reward_extras/<key>/mean`, which the metrics writer puts in the step's record.
"""

from __future__ import annotations

from collections.abc import Callable

from grpo_pipeline.backends.guards import GuardTripped, non_finite_reward_trip
from grpo_pipeline.profiles.guards import GuardsSection
from grpo_pipeline.rewards.functions import Batch, NonFiniteReward
from grpo_pipeline.rewards.plan import RewardParts, RewardPlan, metric_key, row_name

# Keyword arguments TRL adds to every call that are not dataset columns.
_NOT_COLUMNS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def trl_rewards(plan: RewardPlan, guards: GuardsSection) -> tuple[list[Callable], list[float]]:
    """A NaN or infinite reward stops the run through the non_finite guard (its record, its panel, the
    trackers told), at the step whose rollouts it scored; with the guard off it is the reward's error."""
    parts = RewardParts(plan)
    functions = []
    for part in parts.parts:
        def reward(prompts, completions, _part=part, **kwargs) -> list[float | None]:
            log_metric = kwargs.get("log_metric")
            columns = {key: value for key, value in kwargs.items() if key not in _NOT_COLUMNS}
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            infos = [dict(info or {}) for info in columns.get("extra_info", [None] * len(texts))]
            batch = Batch(prompts=prompts, completions=texts, columns={**columns, "extra_info": infos},
                          rows=[row_name(info, i) for i, info in enumerate(infos)])
            try:
                scored = _part.score(batch, log_metric)
            except NonFiniteReward as exc:
                if not guards.on("non_finite"):
                    raise
                state = kwargs.get("trainer_state")
                raise GuardTripped(non_finite_reward_trip(state.global_step + 1 if state else None, str(exc))) from None
            if log_metric is not None:
                for key, values in scored.extras.items():
                    present = [v for v in values if v is not None]
                    if present and not key.startswith("__"):
                        log_metric(f"reward_extras/{metric_key(key)}/mean", sum(present) / len(present))
            return scored.values

        reward.__name__ = part.name  # TRL logs rewards/<__name__>/mean
        functions.append(reward)
    return functions, [part.weight for part in parts.parts]
