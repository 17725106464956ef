"""The run report on its own: the comparison table, the verdict on the intervals, a failed run, the steps and
times, the plots' bands and bars, the settings that differ, the trackers' links."""

from __future__ import annotations

import pytest

from grpo_pipeline.backends.metrics import StepMetrics
from grpo_pipeline.stages.report import STEP_ROWS, write_report


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


def steps_file(tmp_path, rewards: list[tuple[float, float]]):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(StepMetrics(step=i, reward_mean=m, reward_std=s, step_time_s=2.0, time=0.0)
                               .model_dump_json() + "\n" for i, (m, s) in enumerate(rewards, 1)))
    return {"steps_done": len(rewards), "max_steps": len(rewards), "resumed_from": None, "already_complete": False,
            "checkpoint_dir": str(tmp_path / "checkpoints" / "global_step_1"), "metrics_file": str(metrics)}


def test_steps_are_a_table_and_training_time_is_split_from_its_start_up(tmp_path):
    train = steps_file(tmp_path, [(0.1, 0.3)] * 45)
    timings = {"detect_device": 0.01, "resolve_profile": 0.02, "train": 100.0, "evaluate": 10.0}
    report = write_report(tmp_path, train=train, timings=timings).read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "0.100 ± 0.300" in line]
    assert len(rows) == STEP_ROWS and rows[0].startswith("| 1 |") and rows[-1].startswith("| 45 |")
    assert f"{STEP_ROWS} of 45 steps shown." in report
    assert "| &nbsp;&nbsp;45 GRPO steps | 90.0 | 82% |" in report
    assert "| &nbsp;&nbsp;start-up (Ray, workers, model load) and checkpoints | 10.0 | 9% |" in report
    assert "| 2 other steps (planning, checks) | 0.0 | |" in report and "| detect_device |" not in report


def test_the_reward_band_stays_in_the_rewards_range_and_only_intervals_get_error_bars(tmp_path, monkeypatch):
    import matplotlib.axes

    bands, error_bars = [], []
    fill, errorbar = matplotlib.axes.Axes.fill_between, matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between",
                        lambda self, x, low, high, **kw: bands.append((list(low), list(high))) or fill(self, x, low, high, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, *a, **kw: error_bars.append(a) or errorbar(self, *a, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", _bar_without_yerr(matplotlib.axes.Axes.bar))
    train = steps_file(tmp_path, [(0.05, 0.3), (0.9, 0.3)])
    write_report(tmp_path, train=train, profile=None,
                 evaluation={"models": [model("base", 0.2, 0.1, 0.3, tmp_path), model("trained", 0.6, 0.5, 0.7, tmp_path)]})
    (low, high), = bands  # 0.05 - 0.3 and 0.9 + 0.3 cut to the rewards' 0..1
    assert low == pytest.approx([0.0, 0.6]) and high == pytest.approx([0.35, 1.0])
    assert len(error_bars) == 2  # the mean reward's interval of each model, nothing on accuracy or format


def _bar_without_yerr(bar):
    def checked(self, *args, **kwargs):
        assert "yerr" not in kwargs  # a bar without an interval gets no (zero-height) error bar
        return bar(self, *args, **kwargs)
    return checked


def test_settings_are_those_that_differ_and_tracker_places_are_links(tmp_path):
    from grpo_pipeline.profiles.loader import resolve_run_profile

    profile, _ = resolve_run_profile("tiny", "cpu", "auto", None, ["trainer.total_training_steps=3"], validate=False)
    link = "http://127.0.0.1:5000/#/experiments/1/runs/abc (once `mlflow ui --backend-store-uri sqlite:///x.db` serves it)"
    report = write_report(tmp_path, profile=profile.model_dump(mode="json"), tracking={"mlflow": link}).read_text()
    assert "```yaml\ntrainer:\n  total_training_steps: 3\n```" in report and "verl" not in report.split("## Settings")[1]
    assert ("Experiment tracking: [mlflow](http://127.0.0.1:5000/#/experiments/1/runs/abc) (once `mlflow ui "
            "--backend-store-uri sqlite:///x.db` serves it).") in report


def test_with_a_users_reward_the_report_says_what_accuracy_and_format_count(tmp_path):
    """Issue 56: a constant 0.37 reward showed accuracy 0.000 and format 1.000 with no word of what they count."""
    from grpo_pipeline.stages.plan import resolve_profile
    from grpo_pipeline.stages.report import USER_REWARD_METRICS

    reward = tmp_path / "r.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.37\n")
    base, trained = model("base", 0.37, 0.37, 0.37, tmp_path), model("trained", 0.37, 0.37, 0.37, tmp_path)
    for functions, said in (([f"{reward}:compute_score"], True), ([], False)):
        overrides = [f"reward.functions=[{functions[0]}]"] if functions else []
        profile = resolve_profile("tiny", "cpu", overrides=overrides).model_dump(mode="json")
        report = write_report(tmp_path, profile=profile, evaluation={"models": [base, trained]}).read_text()
        assert (USER_REWARD_METRICS in report) is said


def test_a_stage_stopped_by_a_signal_says_so_not_a_bare_colon():
    """Issue 56: a SIGTERM'd run's report said `Stage export_checkpoint: TerminationSignal: ` and nothing more."""
    from prefect.exceptions import TerminationSignal

    from grpo_pipeline.tasks.run_record import failure_words

    assert failure_words(TerminationSignal(15)) == "stopped by a signal (15) (TerminationSignal)"
    assert failure_words(RuntimeError()) == "RuntimeError (with no message)"
    assert failure_words(ValueError("bad value")) == "ValueError: bad value"


def test_a_lora_run_says_so_in_its_headline_with_the_adapters_size(tmp_path):
    from grpo_pipeline.profiles.loader import resolve_run_profile

    full, _ = resolve_run_profile("tiny", "cpu", "auto", None, [], validate=False)
    assert "adapter" not in write_report(tmp_path, profile=full.model_dump(mode="json")).read_text().split("## ")[0]
    lora, _ = resolve_run_profile("tiny", "cpu", "auto", None, ["lora.rank=4", "lora.alpha=8"], validate=False)
    headline = write_report(tmp_path, profile=lora.model_dump(mode="json")).read_text().split("## ")[0]
    adapter = next(line for line in headline.splitlines() if line.startswith("Trained as an adapter: "))
    assert adapter.startswith("Trained as an adapter: LoRA rank 4, alpha 8, on ")
    assert "trainable parameters (" in adapter and "% of the model's " in adapter
