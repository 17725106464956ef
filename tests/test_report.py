"""The run report on its own: the comparison table, the verdict on the intervals, a failed run."""

from __future__ import annotations


from grpo_pipeline.backends.metrics import StepMetrics
from grpo_pipeline.stages.report import write_report


def model(name: str, mean: float, low: float, high: float, tmp_path) -> dict:
    samples = tmp_path / "eval" / f"{name}.jsonl"
    samples.parent.mkdir(exist_ok=True)
    samples.write_text("{}\n")
    return {"name": name, "prompts": 10, "k": 1, "mean_reward": mean, "reward_ci95": (low, high), "accuracy": mean,
            "format_rate": 1.0, "pass_at_k": mean, "response_length_mean": 3.0, "truncation_rate": 0.0,
            "samples_file": str(samples)}


def test_the_table_shows_deltas_and_the_verdict_reads_the_intervals(tmp_path):
    base, better = model("base", 0.2, 0.1, 0.3, tmp_path), model("trained", 0.6, 0.5, 0.7, tmp_path)
    report = write_report(tmp_path, evaluation={"models": [base, better]}).read_text()
    assert "| mean reward | 0.200 [0.100, 0.300] | 0.600 [0.500, 0.700] | +0.400 |" in report
    assert "**trained** beats **base**: the 95% intervals of the mean reward do not overlap." in report
    assert (tmp_path / "eval_comparison.png").read_bytes().startswith(b"\x89PNG")
    overlapping = model("trained", 0.25, 0.15, 0.35, tmp_path)
    assert "may be noise" in write_report(tmp_path, evaluation={"models": [base, overlapping]}).read_text()


def test_a_failed_run_still_gets_a_report_with_the_reason_and_the_curve(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(StepMetrics(step=i, reward_mean=i / 10, reward_std=0.1, step_time_s=1.0, time=0.0)
                               .model_dump_json() + "\n" for i in range(1, 6)))
    train = {"steps_done": 4, "max_steps": 8, "resumed_from": None, "already_complete": False,
             "checkpoint_dir": str(tmp_path / "checkpoints" / "global_step_4"), "metrics_file": str(metrics)}
    report = write_report(tmp_path, train=train, timings={"train": 30.0, "evaluate": 10.0},
                          failure="Stage `evaluate`: UserError: no weights").read_text()
    assert report.startswith("# GRPO run") and "> **The run failed.** Stage `evaluate`: UserError: no weights" in report
    assert "4 of 8 steps; policy in [checkpoints/global_step_4]" in report
    assert "| train | 30.0 | 75% |" in report and (tmp_path / "reward_curve.png").stat().st_size > 1000
