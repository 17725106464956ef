"""bench/bench_rounds.py (issue 54: learning per update and per second at generation.steps_per_generation 1, 2
and 4), its parts that run nothing: the collection on synthetic run folders, the same-time steps, the commands.

    PYTHONPATH=$PWD python -m pytest -q tests/test_bench_rounds.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_rounds  # noqa: E402


def test_the_runs_are_collected_from_synthetic_run_folders():
    assert bench_rounds.check() == 0


def test_each_setting_runs_the_demo_with_only_its_rounds_and_steps_set(tmp_path):
    argv = bench_rounds.command(4, tmp_path, "spg4")
    assert argv[1:] == ["-m", "grpo_pipeline", "--model", "smollm2-135m", "--device", "cpu", "--run-dir", str(tmp_path),
                        "--run-name", "spg4", "--set", "generation.steps_per_generation=4"]
    assert bench_rounds.command(2, tmp_path, "spg2-same-time", 14)[-2:] == ["--set", "trainer.total_training_steps=14"]


def test_a_finished_run_is_collected_not_run_again_and_an_unfinished_one_is_not(tmp_path):
    assert not bench_rounds.finished(tmp_path)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "trained.jsonl").write_text(json.dumps({"correct": True}) + "\n")
    assert not bench_rounds.finished(tmp_path), "no report: the flow stopped before it ended"
    (tmp_path / "report.md").write_text("# report\n")
    assert bench_rounds.finished(tmp_path)


def test_no_setting_gets_more_steps_when_none_is_faster():
    key = f"train_steps_s_first_{bench_rounds.UPDATES}"
    runs = {"spg1": {"steps_per_generation": 1, key: 100.0}, "spg4": {"steps_per_generation": 4, key: 100.0}}
    assert bench_rounds.same_time_steps(runs) == {}
    runs["spg4"][key] = 60.0
    assert bench_rounds.same_time_steps(runs) == {4: 20}
