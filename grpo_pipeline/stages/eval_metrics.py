"""The evaluation's metrics, computed from a per-sample file's records alone, so a reader can check them.

    python -m grpo_pipeline --model tiny --device cpu --stages evaluate --set eval.samples_per_prompt=4 \\
        --set eval.temperature=1.0

- avg@n: the mean correctness of the n responses of each prompt, averaged over prompts (the unbiased
  estimate of pass@1).
- pass@k: the chance that at least one of k responses drawn from a prompt's n is correct, estimated without
  bias as 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"),
  averaged over prompts.
- 95% intervals: a percentile bootstrap over prompts (the unit that was sampled), every metric of a model
  from the same resamples; seeded, so a report's numbers can be made again.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 1000


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chance that at least one of k of the n samples is correct (the unbiased estimator)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def bootstrap_intervals(per_prompt: dict[str, list[float]], seed: int,
                        resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, tuple[float, float]]:
    """95% percentile interval of each metric's mean over prompts, all from the same resamples of the prompts."""
    prompts = len(next(iter(per_prompt.values())))
    picks = np.random.default_rng(seed).integers(0, prompts, size=(resamples, prompts))
    intervals = {}
    for name, values in per_prompt.items():
        means = np.asarray(values, dtype=float)[picks].mean(axis=1)
        low, high = np.quantile(means, [0.025, 0.975], method="inverted_cdf")
        intervals[name] = (float(low), float(high))
    return intervals


def metrics_from_samples(samples: list[dict], ks: list[int], seed: int = 0) -> dict[str, Any]:
    """The metrics of a per-sample file: everything a report states is computed from these records."""
    by_prompt: dict[int, list[dict]] = {}
    for sample in samples:
        by_prompt.setdefault(sample["prompt_index"], []).append(sample)
    groups = list(by_prompt.values())
    n = min(len(group) for group in groups)
    per_prompt = {
        "mean_reward": [float(np.mean([s["reward"] for s in group])) for group in groups],
        "avg@n": [float(np.mean([bool(s["correct"]) for s in group])) for group in groups],
    }
    for k in ks:
        per_prompt[f"pass@{k}"] = [pass_at_k(len(group), sum(bool(s["correct"]) for s in group), k) for group in groups]
    means = {name: float(np.mean(values)) for name, values in per_prompt.items()}
    intervals = bootstrap_intervals(per_prompt, seed)
    lengths = sorted(s["response_tokens"] for s in samples)
    return {
        "prompts": len(groups),
        "samples": len(samples),
        "n": n,
        "mean_reward": means["mean_reward"],
        "reward_ci95": intervals["mean_reward"],
        "accuracy": float(np.mean([bool(s["correct"]) for s in samples])),
        "format_rate": float(np.mean([bool(s["formatted"]) for s in samples])),
        "avg_at_n": means["avg@n"],
        "pass_at": {f"pass@{k}": means[f"pass@{k}"] for k in ks},
        "ci95": intervals,
        "pass_at_k": pass_at_k_mean(groups, n),
        "k": n,
        "response_length_mean": float(np.mean(lengths)),
        "response_length_p95": lengths[min(len(lengths) - 1, math.ceil(0.95 * len(lengths)) - 1)],
        "truncation_rate": float(np.mean([bool(s["truncated"]) for s in samples])),
    }


def pass_at_k_mean(groups: list[list[dict]], k: int) -> float:
    return float(np.mean([pass_at_k(len(g), sum(bool(s["correct"]) for s in g), k) for g in groups]))


def metric_value(result: dict, metric: str) -> tuple[float, tuple[float, float]]:
    """A metric of a model's result (`pass@k`, `avg@n`, `mean_reward`; its JSON) and its 95% interval."""
    if metric == "mean_reward":
        return result["mean_reward"], tuple(result["reward_ci95"])
    if metric == "avg@n":
        return result["avg_at_n"], tuple(result["ci95"]["avg@n"])
    return result["pass_at"][metric], tuple(result["ci95"][metric])
