"""The benchmark demo's flow on the tiny model (tools/benchmark_demo.py's data, from the fake hub on 127.0.0.1):
MATH-500-format training data, `eval.benchmarks=[math500,aime24,gsm8k]`, `eval.checkpoints=all`: each benchmark
fetched into the store, every saved step evaluated on each, the best named in the run folder, the report and
the tracker."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_pipeline.tracking.trackers import read_state
from hub_server import HubServer
from tools.benchmark_demo import repos
from tracker_readers import tensorboard_scalars, tensorboard_texts


def test_benchmarks_and_every_checkpoint_through_the_command_line(cli, tmp_path, monkeypatch):
    with HubServer() as hub:
        for repo, files in repos(seed=0).items():
            hub.add_repo(repo, files)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        settings = [f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}", "data.dataset=math500",
                    "trainer.total_training_steps=4", "trainer.save_freq=2", "eval.benchmarks=[math500,aime24,gsm8k]",
                    "eval.checkpoints=all", "eval.samples_per_prompt=2", "eval.temperature=1.0", "eval.max_new_tokens=6",
                    "eval.max_prompts=4", "tracking.trackers=[tensorboard]"]
        done = cli("--model", "tiny", "--device", "cpu", "--run-dir", str(tmp_path), "--run-name", "bench",
                   *(arg for item in settings for arg in ("--set", item)))
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "bench"
    fetched = json.loads((run_dir / "data" / "benchmarks.json").read_text())
    assert {name: files["rows"]["test"] for name, files in fetched.items()} == {"math500": 48, "aime24": 12, "gsm8k": 8}
    evaluation = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert [(m["benchmark"], m["name"]) for m in evaluation["models"]] == [
        (b, n) for b in ("math500", "aime24", "gsm8k") for n in ("base", "step_2", "step_4")]
    assert all(m["prompts"] == 4 and m["n"] == 2 and set(m["pass_at"]) == {"pass@1", "pass@2"}
               for m in evaluation["models"])
    best = json.loads((run_dir / "best.json").read_text())
    assert best["step"] in (2, 4) and (run_dir / "best").resolve() == (run_dir / "checkpoints" / f"global_step_{best['step']}")
    assert f"best checkpoint: step_{best['step']} (math500 pass@1" in done.stdout

    report = (run_dir / "report.md").read_text()
    for name in ("math500", "aime24", "gsm8k"):
        assert f"### {name}" in report and f"[{name}/base](eval/{name}/base.jsonl)" in report
    assert "| avg@2 |" in report and "| pass@2 |" in report and f"is **step_{best['step']}**" in report
    assert "![checkpoints](checkpoint_curve.png)" in report

    log_dir = Path(read_state(run_dir).runs["tensorboard"]["log_dir"])
    scalars = tensorboard_scalars(log_dir)
    assert [step for step, _ in scalars["eval/checkpoints/aime24/pass_at_1"]] == [2, 4]
    assert [step for step, _ in scalars["eval/base/gsm8k/pass_at_2_ci95_high"]] == [4]
    assert any(f"best_checkpoint: step_{best['step']}" in text for text in tensorboard_texts(log_dir)["tags"])
