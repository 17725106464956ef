"""Benchmarks and checkpoints in the evaluation: pass@k / avg@n and their intervals recomputed from the
per-sample files, every saved step ranked and the best one named, `best` evaluating only what choosing needs,
the report's per-benchmark tables and curve, what the trackers get, and refusals at planning."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from datasets_fixtures import math500_rows
from grpo_pipeline.backends.base import TrainResult
from grpo_pipeline.data.math_data import CONVERTERS
from grpo_pipeline.data.rl_data import arith_splits
from grpo_pipeline.generation.protocol import Response
from grpo_pipeline.stages.eval_metrics import metrics_from_samples, pass_at_k
from grpo_pipeline.stages.evaluate import EvalSettings, evaluate
from grpo_pipeline.stages.export import export_checkpoint, mark_best
from grpo_pipeline.stages.report import write_report
from grpo_pipeline.tasks.tracking import evaluation_values


def test_pass_at_k_is_the_chance_over_every_draw_of_k_of_the_n():
    for n, correct in [(5, 0), (5, 1), (5, 2), (6, 3), (8, 7)]:
        outcomes = [True] * correct + [False] * (n - correct)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(outcomes, k))
            assert pass_at_k(n, correct, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_avg_at_n_pass_at_k_and_their_intervals_come_from_the_records():
    rng = np.random.default_rng(3)
    samples = [{"prompt_index": p, "sample": s, "reward": float(c), "correct": bool(c), "formatted": True,
                "response_tokens": 5, "truncated": False}
               for p in range(40) for s, c in enumerate(rng.random(4) < (p % 5) / 5)]
    m = metrics_from_samples(samples, [1, 2, 4], seed=0)
    per_prompt = [[s["correct"] for s in samples if s["prompt_index"] == p] for p in range(40)]
    assert m["n"] == 4 and m["avg_at_n"] == pytest.approx(np.mean([np.mean(g) for g in per_prompt]))
    assert m["pass_at"]["pass@1"] == pytest.approx(m["avg_at_n"])  # the unbiased pass@1 is the mean correctness
    assert m["pass_at"]["pass@4"] == pytest.approx(np.mean([any(g) for g in per_prompt]))
    assert m["pass_at"]["pass@1"] <= m["pass_at"]["pass@2"] <= m["pass_at"]["pass@4"]
    for name in ("avg@n", "pass@2"):
        low, high = m["ci95"][name]
        value = m["avg_at_n"] if name == "avg@n" else m["pass_at"][name]
        spread = np.std([np.mean(g) for g in per_prompt]) / math.sqrt(40)
        assert low < value < high and 2 * spread < high - low < 6 * spread  # about ±1.96 standard errors
    assert metrics_from_samples(samples, [1, 2, 4], seed=0)["ci95"] == m["ci95"]  # seeded: the same again


def rows_file(tmp_path: Path, name: str, table) -> Path:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    return path


def steps_of(tiny_model_dir: Path, tmp_path: Path, steps: list[int]) -> dict[int, Path]:
    """Saved steps laid out as the local backend saves them, each holding the tiny model."""
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in steps:
        shutil.copytree(tiny_model_dir, checkpoints / f"global_step_{step}")
    return {step: checkpoints / f"global_step_{step}" for step in steps}


def graded_engine(right_share: dict[str, float]):
    """A model that answers the first `share` of each benchmark's prompts right (by its directory's name) and
    the rest wrong, so which step is best is known."""

    def generate(model_dir, prompts, settings):
        share = right_share[Path(model_dir).name]
        out = []
        for index, prompt in enumerate(prompts):
            text = prompt[-1]["content"]
            truth = ANSWERS[text]
            answer = truth if index < share * len(prompts) else "-1"
            response = f"So the answer is $\\boxed{{{answer}}}$." if "boxed" in text else answer
            out.append([Response(text=response, tokens=4, truncated=False)] * settings.samples_per_prompt)
        return out

    return generate


ANSWERS: dict[str, str] = {}


@pytest.fixture
def benchmarks(tmp_path):
    arith = arith_splits(4, 10, seed=1)["test"]
    math500 = CONVERTERS["math500"](__import__("pyarrow").Table.from_pylist(math500_rows(8)), "test")
    for table in (arith, math500):
        for row in table.to_pylist():
            ANSWERS[row["prompt"][-1]["content"]] = row["reward_model"]["ground_truth"]
    return {"heldout": rows_file(tmp_path, "arith", arith), "math500": rows_file(tmp_path, "math500", math500)}


SHARES = {"base": 0.0, "global_step_2": 0.25, "global_step_4": 0.75, "global_step_6": 0.5}


def test_every_step_on_every_benchmark_and_the_best_by_the_chosen_metric(tiny_model_dir, tmp_path, benchmarks):
    steps = steps_of(tiny_model_dir, tmp_path, [2, 4, 6])
    seen = []
    report = evaluate({"base": _named(tiny_model_dir, tmp_path, "base")},
                      benchmarks, EvalSettings(samples_per_prompt=2, temperature=1.0, pass_k=[1, 2]), tmp_path / "run" / "eval",
                      graded_engine(SHARES), steps, "all", ("math500", "pass@1"), seen.append)
    assert [(m.benchmark, m.name) for m in report.models] == [
        (b, n) for b in ("heldout", "math500") for n in ("base", "step_2", "step_4", "step_6")]
    assert len(seen) == 8 and seen[0].startswith("evaluating base on heldout (10 prompts x 2)")
    best = report.best
    assert (best.name, best.step, best.benchmark, best.metric) == ("step_4", 4, "math500", "pass@1")
    assert best.ranked == {2: 0.25, 4: 0.75, 6: 0.5} and best.value == 0.75 and best.path == str(steps[4])
    for m in report.models:  # each result is its own file's
        records = [json.loads(line) for line in Path(m.samples_file).read_text().splitlines()]
        assert m.avg_at_n == pytest.approx(np.mean([r["correct"] for r in records]))
        assert Path(m.samples_file).parent.name == ("eval" if m.benchmark == "heldout" else m.benchmark)

    # the run's `best`: a link to its directory and a record of why
    run_dir = tmp_path / "run"
    mark_best(run_dir, best)
    assert (run_dir / "best").resolve() == steps[4].resolve() and not (run_dir / "best").readlink().is_absolute()
    assert json.loads((run_dir / "best.json").read_text())["step"] == 4

    # the report: a table per benchmark (base, best, last side by side), the curve, the best named
    text = write_report(run_dir, evaluation=report.model_dump(mode="json")).read_text()
    assert "### math500" in text and "### heldout" in text
    assert "| metric | base | step_4 (best) | step_6 (last) | step_6 - base |" in text
    assert "| pass@1 | 0.000 [0.000, 0.000] | 0.750 [" in text
    assert "the best by math500 pass@1 is **step_4**" in text and "| 4 **best** |" in text
    for plot in ("eval_comparison.png", "checkpoint_curve.png"):
        assert (run_dir / plot).read_bytes().startswith(b"\x89PNG")

    # the trackers: each step's results at its step (the curve), the fixed models at the run's step
    values = evaluation_values(report.model_dump(mode="json"), step=6)
    assert values[4]["eval/checkpoints/math500/pass_at_1"] == 0.75 and values[2]["eval/step_2/math500/pass_at_1"] == 0.25
    assert values[6]["eval/best_step"] == 4.0 and values[6]["eval/base/pass_at_2_ci95_high"] == 0.0
    assert "eval/base/mean_reward" in values[6] and "eval/base/math500/avg_at_n" in values[6]


def _named(model_dir: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    if not target.exists():
        shutil.copytree(model_dir, target)
    return target


def test_best_evaluates_every_step_on_the_chosen_benchmark_only_then_the_best_everywhere(tiny_model_dir, tmp_path,
                                                                                          benchmarks):
    steps = steps_of(tiny_model_dir, tmp_path, [2, 4, 6])
    report = evaluate({"base": _named(tiny_model_dir, tmp_path, "base")}, benchmarks, EvalSettings(), tmp_path / "eval",
                      graded_engine(SHARES), steps, "best", ("heldout", "avg@n"))
    assert [(m.benchmark, m.name) for m in report.models] == [
        ("heldout", "base"), ("heldout", "step_2"), ("heldout", "step_4"), ("heldout", "step_6"),
        ("math500", "base"), ("math500", "step_4")]
    assert report.best.name == "step_4" and report.checkpoints == "best"


def test_the_export_stage_verifies_every_saved_step_when_asked(tiny_model_dir, tmp_path):
    steps = steps_of(tiny_model_dir, tmp_path, [2, 4, 6])
    (steps[6].parent / ".replaced-global_step_4-1").mkdir()  # a resumed run's older copy: not a saved step
    train = TrainResult(backend="local", checkpoint_dir=str(steps[4]), steps_done=4, max_steps=6,
                        metrics_file=str(tmp_path / "run" / "metrics.jsonl"))
    assert export_checkpoint(train).steps == {}
    policy = export_checkpoint(train, every_step=True)  # step 6 is past the steps this result trained
    assert policy.steps == {2: str(steps[2]), 4: str(steps[4])} and policy.step == 4


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.benchmarks=[heldout,math500]", "eval.checkpoints=all", "eval.best_metric=aime24/pass@1"],
     "eval.best_metric='aime24/pass@1': 'aime24' is not one of eval.benchmarks"),
    (["eval.samples_per_prompt=4", "eval.temperature=1", "eval.checkpoints=best", "eval.best_metric=pass@3"],
     "pass@3 is not computed; the k of pass@k are [1, 2, 4]"),
    (["eval.pass_k=[8]"], "eval.pass_k=[8]: pass@8 needs at least 8 responses per prompt"),
    (["eval.checkpoints=all", "eval.best_metric=accuracy"], "the metric is one of pass@k, avg@n, mean_reward"),
    (["eval.benchmarks=[gsm8k,gsm8k]"], "each benchmark once"),
])
def test_an_evaluation_that_cannot_work_is_refused_at_planning_in_one_line(cli, overrides, message):
    args = [a for o in overrides for a in ("--set", o)]
    result = cli("--model", "tiny", "--device", "cpu", "--dry-run", *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_best_metric_is_checked_only_where_a_best_is_chosen(cli):
    planned = ("--model", "tiny", "--device", "cpu", "--dry-run", "--set", "eval.samples_per_prompt=4", "--set",
               "eval.temperature=1", "--set", "eval.pass_k=[4]")
    assert cli(*planned).returncode == 0  # eval.checkpoints=last: the default pass@1 is never asked for
    assert "pass@1 is not computed" in cli(*planned, "--set", "eval.checkpoints=all").stderr
