"""The `evaluate` stage: generate on the validation split and score with the training reward.

    python -m grpo_pipeline --model tiny --device cpu --stages evaluate --set 'eval.models=[/path/a,/path/b]'

For each model directory: responses to every validation prompt (`eval.samples_per_prompt` each),
scored by the run's reward as in training (rewards/plan.py); per-sample results go to `<out>/<name>.jsonl` and the
metrics (mean reward with a bootstrap 95% interval, accuracy, format rate, pass@k, response length
mean / p95, truncation rate) are computed from exactly those records.

Generation is the generation package's (generation/protocol.py): the run's `GenerationPlan`,
resolved once at planning, rides in `EvalSettings`; the backend says where the engine runs
(`Backend.evaluation`: this host's devices, or a verl run's cluster); this stage scores what it gets.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from grpo_pipeline.common.errors import UserError
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.backends.metrics import METRICS
from grpo_pipeline.common.files import write_text_atomic
from grpo_pipeline.generation.decoding import compile_cache_dir
from grpo_pipeline.generation.engines import engine_label, transformers_generate
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.generation.protocol import Generate, GenerationSettings, Response
from grpo_pipeline.rewards.plan import RewardParts, RewardPlan, batch_of

BOOTSTRAP_RESAMPLES = 1000


class EvalSettings(GenerationSettings):
    """The generation settings of the evaluation, and what it scores with."""

    max_prompts: int | None = None
    reward: RewardPlan = Field(default_factory=RewardPlan, description="What scores the responses (rewards/plan.py).")

    @classmethod
    def from_profile(cls, profile: RunProfile, plan: GenerationPlan) -> EvalSettings:
        """`eval.*` with the run's generation plan (generation/plan.py, resolved at planning)."""
        section = profile.eval
        if section.samples_per_prompt > 1 and section.temperature == 0:
            raise UserError(
                f"eval.samples_per_prompt={section.samples_per_prompt} with eval.temperature=0: greedy decoding "
                "gives the same response every time; set eval.temperature (e.g. 1.0) or one sample per prompt"
            )
        return cls(
            plan=plan, samples_per_prompt=section.samples_per_prompt, temperature=section.temperature,
            max_new_tokens=section.max_new_tokens or profile.data.max_response_length, batch_size=section.batch_size,
            max_prompts=section.max_prompts, seed=section.seed, reward=RewardPlan.from_section(profile.reward),
            dtype=profile.platform.run_dtype(profile.engine.dtype), max_prompt_length=profile.data.max_prompt_length,
            compile_cache_dir=str(compile_cache_dir(profile.model.root)),
        )


class ModelMetrics(BaseModel):
    name: str
    path: str
    prompts: int
    samples: int
    mean_reward: float
    reward_ci95: tuple[float, float] = Field(..., description="Bootstrap 95% interval of the mean reward (over prompts).")
    accuracy: float
    format_rate: float
    pass_at_k: float
    k: int
    response_length_mean: float
    response_length_p95: float
    truncation_rate: float
    samples_file: str
    generation_s: float | None = Field(None, description="Seconds spent generating the responses (model load included).")
    generated_tokens: int | None = Field(None, description="Tokens generated, end-of-sequence excluded.")

    def summary_line(self) -> str:
        """The model's results in one line, as the flow logs them and the command line prints them."""
        generated = "" if self.generation_s is None else \
            f", generated {self.generated_tokens} tokens in {self.generation_s:.1f} s ({self.tokens_per_s():,.0f} tokens/s)"
        return (f"{self.name}: mean reward {self.mean_reward:.3f} [{self.reward_ci95[0]:.3f}, {self.reward_ci95[1]:.3f}], "
                f"accuracy {self.accuracy:.3f}, format {self.format_rate:.3f}, pass@{self.k} {self.pass_at_k:.3f}, "
                f"length {self.response_length_mean:.1f} (p95 {self.response_length_p95:.0f}), truncated "
                f"{self.truncation_rate:.3f} on {self.prompts} prompts{generated} ({self.samples_file})")

    def tokens_per_s(self) -> float:
        return (self.generated_tokens or 0) / self.generation_s if self.generation_s else 0.0


class EvalReport(BaseModel):
    val_file: str
    engine: str
    models: list[ModelMetrics]
    generation: str | None = Field(None, description="Generation time of each model, beside the rollouts' when the "
                                   "run trained (its metrics file).")


def load_validation(val_file: Path, max_prompts: int | None) -> list[dict]:
    """Validation rows: prompt, data_source, ground truth; a clear error for a file that cannot be scored."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(val_file)
    except (OSError, ValueError) as exc:
        raise UserError(f"{val_file}: not a readable parquet file ({exc})") from exc
    missing = [c for c in ("prompt", "data_source", "reward_model") if c not in table.column_names]
    if missing:
        raise UserError(f"{val_file}: no {', '.join(missing)} column(s): validation rows need prompt, data_source and "
                        "reward_model.ground_truth (verl's RL schema)")
    rows = table.select([c for c in ("prompt", "data_source", "reward_model", "ability", "extra_info")
                         if c in table.column_names]).to_pylist()[: max_prompts or None]
    if not rows:
        raise UserError(f"{val_file}: the validation split is empty")
    for index, row in enumerate(rows):
        truth = (row["reward_model"] or {}).get("ground_truth")
        if truth in (None, ""):
            raise UserError(f"{val_file}: row {index} has no reward_model.ground_truth")
        row["ground_truth"] = str(truth)
    return rows


def evaluate_model(
    name: str, model_dir: Path, rows: list[dict], settings: EvalSettings, out_dir: Path,
    generate: Generate = transformers_generate,
) -> ModelMetrics:
    started = time.perf_counter()
    responses = generate(model_dir, [row["prompt"] for row in rows], settings)
    generation_s = time.perf_counter() - started
    if len(responses) != len(rows) or any(len(r) != settings.samples_per_prompt for r in responses):
        raise RuntimeError(f"the engine returned {len(responses)} groups for {len(rows)} prompts")
    flat = [(index, sample, row, response) for index, (row, group) in enumerate(zip(rows, responses))
            for sample, response in enumerate(group)]
    scores = RewardParts(settings.reward).score(batch_of([row for _, _, row, _ in flat], [r.text for *_, r in flat]))
    samples = []
    for position, (index, sample, row, response) in enumerate(flat):
        samples.append({
            "prompt_index": index, "sample": sample, "data_source": row["data_source"],
            "prompt": row["prompt"][-1]["content"], "response": response.text, "ground_truth": row["ground_truth"],
            "reward": scores.rewards[position], "correct": scores.correct[position],
            "formatted": scores.formatted[position], "response_tokens": response.tokens, "truncated": response.truncated,
        })
    samples_file = out_dir / f"{name}.jsonl"
    write_text_atomic(samples_file, "".join(json.dumps(s) + "\n" for s in samples))
    return ModelMetrics(name=name, path=str(model_dir), samples_file=str(samples_file), generation_s=round(generation_s, 2),
                        generated_tokens=sum(s["response_tokens"] for s in samples),
                        **metrics_from_samples(samples, settings.samples_per_prompt, settings.seed))


def metrics_from_samples(samples: list[dict], k: int, seed: int = 0) -> dict[str, Any]:
    """The metrics of a per-sample file: everything a report states is computed from these records."""
    by_prompt: dict[int, list[dict]] = {}
    for sample in samples:
        by_prompt.setdefault(sample["prompt_index"], []).append(sample)
    prompt_means = [statistics.fmean(s["reward"] for s in group) for group in by_prompt.values()]
    lengths = sorted(s["response_tokens"] for s in samples)
    return {
        "prompts": len(by_prompt),
        "samples": len(samples),
        "mean_reward": statistics.fmean(s["reward"] for s in samples),
        "reward_ci95": bootstrap_ci(prompt_means, seed),
        "accuracy": statistics.fmean(s["correct"] for s in samples),
        "format_rate": statistics.fmean(s["formatted"] for s in samples),
        "pass_at_k": statistics.fmean(pass_at_k(len(g), sum(s["correct"] for s in g), k) for g in by_prompt.values()),
        "k": k,
        "response_length_mean": statistics.fmean(lengths),
        "response_length_p95": lengths[min(len(lengths) - 1, math.ceil(0.95 * len(lengths)) - 1)],
        "truncation_rate": statistics.fmean(s["truncated"] for s in samples),
    }


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chance that at least one of k of the n samples is correct (the unbiased estimator)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def bootstrap_ci(values: list[float], seed: int, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling prompts with replacement."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def evaluate(
    models: dict[str, Path], val_file: Path, settings: EvalSettings, out_dir: Path,
    generate: Generate = transformers_generate,
) -> EvalReport:
    from grpo_pipeline.stages.model import verify_hf_dir

    for name, path in models.items():
        verify_hf_dir(path)  # a directory without weights fails here, before any generation
    rows = load_validation(val_file, settings.max_prompts)
    results = [evaluate_model(name, path, rows, settings, out_dir, generate) for name, path in models.items()]
    # named after generating: an engine on the cluster says then which engine its nodes had
    return EvalReport(val_file=str(val_file), engine=engine_label(generate, settings), models=results,
                      generation=generation_summary(results, out_dir.parent / METRICS))


def generation_summary(models: list[ModelMetrics], metrics_file: Path) -> str | None:
    """The evaluation's generation time per model beside the rollouts' (generation_s of the steps in
    the run's metrics file, when it trained), for the log and the report."""
    from grpo_pipeline.backends.metrics import read_metrics

    parts = [f"evaluation of {m.name} {m.generation_s:.1f} s ({m.tokens_per_s():,.0f} tokens/s)"
             for m in models if m.generation_s is not None]
    rounds = [r.generation_s for r in read_metrics(metrics_file) if r.generation_s]
    if rounds:
        parts.insert(0, f"rollouts {sum(rounds):.1f} s in {len(rounds)} generation rounds "
                        f"({sum(rounds) / len(rounds):.1f} s a round)")
    return "; ".join(parts) or None
