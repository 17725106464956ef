"""The `evaluate` stage: base vs trained (or every saved checkpoint) on named benchmarks.

    python -m grpo_pipeline --model tiny --device cpu --stages evaluate --set 'eval.models=[/path/a,/path/b]'
    python -m grpo_pipeline --model smollm2-135m --device cpu --set data.dataset=math500 \\
        --set 'eval.benchmarks=[math500,aime24,gsm8k]' --set eval.checkpoints=all

For each model and each benchmark of `eval.benchmarks` (`heldout`: the run's validation split; a built-in
dataset's test split otherwise): `eval.samples_per_prompt` responses to every prompt, scored by the run's
reward on `heldout` and by the benchmark's own built-in reward elsewhere (rewards/plan.py); per-sample results
go to `<out>/<name>.jsonl` (`<out>/<benchmark>/<name>.jsonl`) and the metrics (avg@n, pass@k, mean reward,
each with a bootstrap 95% interval; format rate, response length mean / p95, truncation rate) are computed
from exactly those records (stages/eval_metrics.py).

With `eval.checkpoints=all|best` the run's saved steps are evaluated too (the export stage made each an HF
directory), and the step that `eval.best_metric` ranks first is the run's best (stages/export.py
`mark_best` names it in the run folder).

Generation is the generation package's (generation/protocol.py): the run's `GenerationPlan`,
resolved once at planning, rides in `EvalSettings`; the backend says where the engine runs
(`Backend.evaluation`: this host's devices, or a verl run's cluster); this stage scores what it gets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.evaluation import HELDOUT, pass_ks
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.store.files import write_text_atomic
from grpo_pipeline.generation.decoding import compile_cache_dir
from grpo_pipeline.generation.engines import engine_label, transformers_generate
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.generation.protocol import Generate, GenerationSettings, Response
from grpo_pipeline.rewards.isolated import score_rows
from grpo_pipeline.rewards.plan import RewardPlan
from grpo_pipeline.stages.eval_metrics import metric_value, metrics_from_samples, pass_at_k
from grpo_pipeline.run.folder import RunFolder

__all__ = ["EvalReport", "EvalSettings", "ModelMetrics", "Response", "evaluate", "pass_at_k"]


class EvalSettings(GenerationSettings):
    """The generation settings of the evaluation, and what it scores with."""

    max_prompts: int | None = None
    pass_k: list[int] = Field(default_factory=list, description="The k of pass@k; empty: eval.pass_k's default.")
    reward: RewardPlan = Field(default_factory=RewardPlan, description="What scores the responses of `heldout` "
                               "(rewards/plan.py); other benchmarks are scored by their built-in reward.")

    @classmethod
    def from_profile(cls, profile: RunProfile, plan: GenerationPlan) -> EvalSettings:
        """`eval.*` with the run's generation plan (generation/plan.py, resolved at planning)."""
        section = profile.eval
        return cls(
            plan=plan, samples_per_prompt=section.samples_per_prompt, temperature=section.temperature,
            max_new_tokens=section.max_new_tokens or profile.data.max_response_length, batch_size=section.batch_size,
            max_prompts=section.max_prompts, seed=section.seed, reward=RewardPlan.from_section(profile.reward),
            pass_k=section.ks(), dtype=profile.platform.run_dtype(profile.engine.dtype),
            max_prompt_length=profile.data.max_prompt_length, compile_cache_dir=str(compile_cache_dir(profile.model.root)),
        )

    def on(self, benchmark: str) -> EvalSettings:
        """The settings for one benchmark: a benchmark of its own is scored by its built-in reward."""
        return self if benchmark == HELDOUT else self.model_copy(update={"reward": RewardPlan()})


class ModelMetrics(BaseModel):
    name: str
    path: str
    benchmark: str = Field(HELDOUT, description="What it was evaluated on (profiles/evaluation.py).")
    step: int | None = Field(None, description="The training step of a checkpoint; empty for the base model and others.")
    prompts: int
    samples: int
    n: int = Field(1, description="Responses per prompt.")
    mean_reward: float
    reward_ci95: tuple[float, float] = Field(..., description="Bootstrap 95% interval of the mean reward (over prompts).")
    accuracy: float
    format_rate: float
    avg_at_n: float = Field(0.0, description="avg@n: mean correctness of the n responses per prompt, over prompts.")
    pass_at: dict[str, float] = Field(default_factory=dict, description="pass@k for each k of eval.pass_k (unbiased).")
    ci95: dict[str, tuple[float, float]] = Field(default_factory=dict, description="Bootstrap 95% interval of avg@n "
                                                 "and of each pass@k (over prompts).")
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
        on = "" if self.benchmark == HELDOUT else f" on {self.benchmark}"
        passes = ", ".join(f"{name} {value:.3f}" for name, value in self.pass_at.items()) or \
            f"pass@{self.k} {self.pass_at_k:.3f}"
        return (f"{self.name}{on}: mean reward {self.mean_reward:.3f} [{self.reward_ci95[0]:.3f}, {self.reward_ci95[1]:.3f}], "
                f"accuracy {self.accuracy:.3f}, format {self.format_rate:.3f}, {passes}, "
                f"length {self.response_length_mean:.1f} (p95 {self.response_length_p95:.0f}), truncated "
                f"{self.truncation_rate:.3f} on {self.prompts} prompts{generated} ({self.samples_file})")

    def tokens_per_s(self) -> float:
        return (self.generated_tokens or 0) / self.generation_s if self.generation_s else 0.0


class BestCheckpoint(BaseModel):
    """The saved step the chosen metric ranks first (eval.checkpoints=all|best): the run's `best`."""

    name: str
    step: int
    path: str = Field(..., description="Its HF directory.")
    benchmark: str
    metric: str
    value: float
    ci95: tuple[float, float]
    ranked: dict[int, float] = Field(..., description="The metric of every saved step that was evaluated.")

    def line(self) -> str:
        return (f"best checkpoint: {self.name} ({self.benchmark} {self.metric} {self.value:.3f} "
                f"[{self.ci95[0]:.3f}, {self.ci95[1]:.3f}]) of steps {sorted(self.ranked)}: {self.path}")


class EvalReport(BaseModel):
    val_file: str
    engine: str
    models: list[ModelMetrics] = Field(..., description="One result per model and benchmark, benchmark by benchmark.")
    benchmarks: dict[str, str] = Field(default_factory=dict, description="Each benchmark's file (its test split).")
    checkpoints: str = Field("last", description="eval.checkpoints: which saved steps were evaluated.")
    best: BestCheckpoint | None = None
    generation: str | None = Field(None, description="Generation time of each model, beside the rollouts' when the "
                                   "run trained (its metrics file).")

    def on(self, benchmark: str) -> list[ModelMetrics]:
        return [m for m in self.models if m.benchmark == benchmark]


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
    generate: Generate = transformers_generate, benchmark: str = HELDOUT, step: int | None = None,
) -> ModelMetrics:
    started = time.perf_counter()
    responses = generate(model_dir, [row["prompt"] for row in rows], settings.model_copy(update={"label": name}))
    generation_s = time.perf_counter() - started
    if len(responses) != len(rows) or any(len(r) != settings.samples_per_prompt for r in responses):
        raise RuntimeError(f"the engine returned {len(responses)} groups for {len(rows)} prompts")
    flat = [(index, sample, row, response) for index, (row, group) in enumerate(zip(rows, responses))
            for sample, response in enumerate(group)]
    # The user's reward runs in a child: an exit there fails the reward, never ends the flow as a success.
    scores = score_rows(settings.reward, [row for _, _, row, _ in flat], [r.text for *_, r in flat])
    samples = []
    for position, (index, sample, row, response) in enumerate(flat):
        samples.append({
            "prompt_index": index, "sample": sample, "data_source": row["data_source"],
            "prompt": row["prompt"][-1]["content"], "response": response.text, "ground_truth": row["ground_truth"],
            "reward": scores.rewards[position], "correct": scores.correct[position],
            "formatted": scores.formatted[position], "response_tokens": response.tokens, "truncated": response.truncated,
        })
    samples_file = (out_dir if benchmark == HELDOUT else out_dir / benchmark) / f"{name}.jsonl"
    write_text_atomic(samples_file, "".join(json.dumps(s) + "\n" for s in samples))
    return ModelMetrics(name=name, path=str(model_dir), benchmark=benchmark, step=step, samples_file=str(samples_file),
                        generation_s=round(generation_s, 2), generated_tokens=sum(s["response_tokens"] for s in samples),
                        **metrics_from_samples(samples, settings.pass_k or pass_ks(settings.samples_per_prompt),
                                               settings.seed))


def choose_best(results: list[ModelMetrics], checkpoints: dict[int, Path], benchmark: str,
                metric: str) -> BestCheckpoint | None:
    """The saved step the metric ranks first on the benchmark; a tie goes to the earlier step."""
    ranked = {m.step: metric_value(m.model_dump(), metric) for m in results if m.benchmark == benchmark and m.step in checkpoints}
    if not ranked:
        return None
    step = max(sorted(ranked), key=lambda s: ranked[s][0])
    value, ci95 = ranked[step]
    return BestCheckpoint(name=checkpoint_name(step), step=step, path=str(checkpoints[step]), benchmark=benchmark,
                          metric=metric, value=value, ci95=ci95, ranked={s: v for s, (v, _) in ranked.items()})


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def evaluate(
    models: dict[str, Path], benchmarks: dict[str, Path] | Path, settings: EvalSettings, out_dir: Path,
    generate: Generate = transformers_generate, checkpoints: dict[int, Path] | None = None, choice: str = "last",
    best_metric: tuple[str, str] | None = None, progress: Callable[[str], None] | None = None,
) -> EvalReport:
    """`models` (base, and the trained policy with eval.checkpoints=last) on every benchmark; with
    `checkpoints` (saved step -> HF directory) and `choice`: `all`, every step on every benchmark, `best`,
    every step on `best_metric`'s benchmark, then the best on the others. `benchmarks`: name -> parquet
    file (a lone file: `heldout`)."""
    from grpo_pipeline.stages.model import verify_hf_dir

    if isinstance(benchmarks, Path):
        benchmarks = {HELDOUT: benchmarks}
    checkpoints = dict(sorted((checkpoints or {}).items()))
    for path in [*models.values(), *checkpoints.values()]:
        verify_hf_dir(path)  # a directory without weights fails here, before any generation
    rows = {name: load_validation(path, settings.max_prompts) for name, path in benchmarks.items()}
    selection = best_metric or (next(iter(benchmarks)), "pass@1")
    steps = {checkpoint_name(step): (path, step) for step, path in checkpoints.items()}
    results: list[ModelMetrics] = []

    def run(benchmark: str, candidates: dict[str, tuple[Path, int | None]]) -> None:
        for name, (path, step) in candidates.items():
            if any(m.benchmark == benchmark and m.name == name for m in results):
                continue  # `best`: its selection benchmark is already done
            if progress:
                progress(f"evaluating {name} on {benchmark} ({len(rows[benchmark])} prompts x "
                         f"{settings.samples_per_prompt})")
            results.append(evaluate_model(name, path, rows[benchmark], settings.on(benchmark), out_dir, generate,
                                          benchmark, step))

    fixed = {name: (path, None) for name, path in models.items()}
    best = None
    if checkpoints and choice == "best":
        run(selection[0], fixed | steps)
        best = choose_best(results, checkpoints, *selection)
        fixed[best.name] = (Path(best.path), best.step)
    elif checkpoints:
        fixed |= steps
    for benchmark in benchmarks:
        run(benchmark, fixed)
    if checkpoints and choice == "all":
        best = choose_best(results, checkpoints, *selection)
    order = list(benchmarks)
    results.sort(key=lambda m: order.index(m.benchmark))  # stable: models keep their order within a benchmark
    # named after generating: an engine on the cluster says then which engine its nodes had
    return EvalReport(val_file=str(next(iter(benchmarks.values()))), engine=engine_label(generate, settings),
                      models=results, benchmarks={name: str(path) for name, path in benchmarks.items()},
                      checkpoints=choice if checkpoints else "last", best=best,
                      generation=generation_summary(results, out_dir.parent / RunFolder.METRICS))


def generation_summary(models: list[ModelMetrics], metrics_file: Path) -> str | None:
    """The evaluation's generation time per model beside the rollouts' (generation_s of the steps in
    the run's metrics file, when it trained), for the log and the report."""
    from grpo_pipeline.backends.metrics import read_metrics

    parts = [f"evaluation of {m.name}{'' if m.benchmark == HELDOUT else ' on ' + m.benchmark} {m.generation_s:.1f} s "
             f"({m.tokens_per_s():,.0f} tokens/s)" for m in models if m.generation_s is not None]
    rounds = [r.generation_s for r in read_metrics(metrics_file) if r.generation_s]
    if rounds:
        parts.insert(0, f"rollouts {sum(rounds):.1f} s in {len(rounds)} generation rounds "
                        f"({sum(rounds) / len(rounds):.1f} s a round)")
    return "; ".join(parts) or None
