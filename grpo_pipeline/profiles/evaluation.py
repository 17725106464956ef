"""The profile's `eval` section: which models and checkpoints are evaluated, on which benchmarks, with
which metrics, and how the run's best checkpoint is chosen.

    python -m grpo_pipeline --model tiny --device cpu --set 'eval.benchmarks=[heldout,math500,aime24,gsm8k]' \\
        --set eval.checkpoints=all --set eval.samples_per_prompt=4 --set eval.temperature=1.0 --dry-run

A benchmark is a built-in dataset's test split (profiles/datasets.py, fetched like the training data) or
`heldout`, the run's own validation split. Metrics per benchmark and model: avg@n (the mean correctness of
the n responses per prompt), pass@k for each k of `eval.pass_k` (the unbiased estimator of Chen et al.
2021), the mean reward, each with a bootstrap 95% interval over prompts (stages/eval_metrics.py).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from grpo_pipeline.profiles.section import MAX_HEADS, MAX_SEQUENCES, MAX_TOKENS, Section

HELDOUT = "heldout"
# The built-in datasets a benchmark can be: those with a test split of their own (dapo17k has none,
# `mapped` has no fixed source).
BenchmarkName = Literal["heldout", "arith", "gsm8k", "geo3k", "math", "math500", "aime24", "aime25"]
CheckpointChoice = Literal["last", "all", "best"]
# The metrics a checkpoint can be chosen by (all: higher is better).
_METRIC = re.compile(r"^(?:pass@(?P<k>[1-9][0-9]*)|avg@n|mean_reward)$")


class EvalSection(Section):
    models: list[str] = Field(
        default_factory=list,
        description="HF model directories to evaluate with `--stages evaluate`; empty: the base model and "
        "the trained policy of this run.",
    )
    benchmarks: list[BenchmarkName] = Field(
        default_factory=lambda: [HELDOUT],
        description="What the models are evaluated on: `heldout` (the validation split of the training data) and "
        "built-in datasets' test splits (`math500`, `aime24`, `aime25`, `gsm8k`, `math`, `geo3k`, `arith`), each "
        "fetched once into data.root like the training data and scored by its own reward.",
    )
    checkpoints: CheckpointChoice = Field(
        "last", description="Which of the run's saved checkpoints are evaluated beside the base model: `last` (the "
        "trained policy), `all` (every saved step, on every benchmark: a curve over steps; the best by "
        "`eval.best_metric` becomes the run's `best`), `best` (every saved step on the benchmark of "
        "`eval.best_metric` only, to choose the best; then the best on every benchmark).",
    )
    best_metric: str = Field(
        "pass@1", description="How the best checkpoint is chosen: `<benchmark>/<metric>` or `<metric>` (of the first "
        "benchmark), the metric one of `pass@k`, `avg@n`, `mean_reward`; higher is better, ties go to the earlier step.",
    )
    samples_per_prompt: int = Field(
        1, gt=0, le=MAX_HEADS, description="Responses per prompt (n): avg@n is their mean correctness, pass@k "
        "is estimated from them for every k of `eval.pass_k`.",
    )
    pass_k: list[int] = Field(
        default_factory=list, description="The k of pass@k, each at most eval.samples_per_prompt; empty: 1, 2, 4, "
        "... up to eval.samples_per_prompt, and eval.samples_per_prompt itself.",
    )
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature; 0 is greedy (only with one sample per prompt)."
    )
    max_new_tokens: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="Longest response; empty: data.max_response_length."
    )
    batch_size: int = Field(32, gt=0, le=MAX_SEQUENCES, description="Prompts generated together (transformers engine).")
    max_prompts: int | None = Field(
        None, gt=0, description="Evaluate on the first N prompts of each benchmark only; empty: all."
    )
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of sampling and of the bootstrap (numpy takes 0 to 2**32 - 1).")

    def ks(self) -> list[int]:
        return pass_ks(self.samples_per_prompt, self.pass_k)

    def selection(self) -> tuple[str, str]:
        """(benchmark, metric) that chooses the best checkpoint."""
        benchmark, _, metric = self.best_metric.rpartition("/")
        return benchmark or self.benchmarks[0], metric


def pass_ks(n: int, asked: list[int] | None = None) -> list[int]:
    """The k of pass@k, ascending: those asked for, else powers of two up to n, and n."""
    return sorted(set(asked or [*(1 << i for i in range(n.bit_length()) if 1 << i <= n), n]))


def eval_problems(section: EvalSection) -> list[str]:
    """What the evaluation cannot do as asked, found before anything runs."""
    problems = []
    if not section.benchmarks:
        problems.append("eval.benchmarks=[]: name at least one benchmark, e.g. [heldout] (the validation split)")
    if len(set(section.benchmarks)) != len(section.benchmarks):
        problems.append(f"eval.benchmarks={section.benchmarks}: each benchmark once")
    n = section.samples_per_prompt
    if n > 1 and section.temperature == 0:
        problems.append(f"eval.samples_per_prompt={n} with eval.temperature=0: greedy decoding gives the same response "
                        "every time; set eval.temperature (e.g. 1.0) or one sample per prompt")
    if too_big := [k for k in section.pass_k if not 0 < k <= n]:
        problems.append(f"eval.pass_k={section.pass_k}: pass@{too_big[0]} needs at least {too_big[0]} responses per "
                        f"prompt; keep each k between 1 and eval.samples_per_prompt={n}, or raise eval.samples_per_prompt")
    if section.benchmarks and section.checkpoints != "last":  # the best is chosen only among saved steps
        benchmark, metric = section.selection()
        found = _METRIC.match(metric)
        if benchmark not in section.benchmarks:
            problems.append(f"eval.best_metric={section.best_metric!r}: {benchmark!r} is not one of eval.benchmarks="
                            f"{section.benchmarks}; add it there or choose by one of them")
        if found is None:
            problems.append(f"eval.best_metric={section.best_metric!r}: the metric is one of pass@k, avg@n, mean_reward "
                            "(e.g. math500/pass@1)")
        elif found["k"] and int(found["k"]) not in section.ks():
            problems.append(f"eval.best_metric={section.best_metric!r}: pass@{found['k']} is not computed; the k of "
                            f"pass@k are {section.ks()} (eval.pass_k)")
    return problems
