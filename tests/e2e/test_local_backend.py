"""The local backend for real: TRL's GRPOTrainer on 2 Ray Train workers (gloo, CPU), learning; a
worker killed after a checkpoint and the Prefect retry resuming from it; a finished run not
trained again."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import psutil
import ray

from grpo_pipeline.backends.local.checkpoints import latest_step
from grpo_pipeline.backends.local.driver import train_local
from grpo_pipeline.backends.local.phases import PHASES
from grpo_pipeline.backends.local.settings import plan_local_training
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
from grpo_pipeline.stages.model import ModelSpec, prepare_model
from grpo_pipeline.run.folder import RunFolder
from prefect_reads import artifacts
from stage_retry import like_the_stage, steps_heard

LEARNABLE = f"{Path(__file__).resolve().parents[1] / 'learnable_reward.py'}:digit_share"


def settings_for(tmp_path: Path, stores: list[str], steps: int, save_freq: int, run: str):
    """2 workers on the session's prepared stores."""
    overrides = [
        "cluster.devices_per_node=2", *stores,
        f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}",
        f"reward.functions=[{LEARNABLE}]", "algorithm.lr=0.005",
    ]
    profile = resolve_profile("tiny", "cpu", overrides=overrides)
    data = fetch_dataset(DataSpec.from_profile(profile.data))
    model = prepare_model(ModelSpec.from_profile(profile.model))
    return overrides, plan_local_training(profile, data.train_files, model.path, tmp_path / run, devices_here=2,
                                           generation=plan_generation(profile))


def test_two_workers_learn_the_reward(tmp_path, stores):
    _, settings = settings_for(tmp_path, stores, steps=30, save_freq=10, run="learn")
    seen = []
    try:
        result = like_the_stage(lambda: train_local(settings, None, None, on_step=seen.append, on_start=steps_heard(seen)))
    finally:
        ray.shutdown()
    assert result.steps_done == 30 and not result.already_complete and result.resumed_from is None
    rewards = [record.reward_mean for record in seen]
    assert [record.step for record in seen] == list(range(1, 31))
    # Windows of 5 steps x 32 completions: the last beats the first by a margin no noise explains.
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert first < 0.15 and last > first + 0.3, rewards
    assert statistics.mean(rewards[10:20]) > first  # rising on the way, not one lucky window
    checkpoints = Path(settings.checkpoints)
    assert sorted(p.name for p in checkpoints.glob("global_step_*")) == ["global_step_10", "global_step_20", "global_step_30"]
    assert latest_step(checkpoints) == 30
    final = checkpoints / "global_step_30"
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in final.iterdir()}
    lines = [json.loads(line) for line in Path(settings.metrics_file).read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 31))
    assert all(line["tokens_per_s"] > 0 and line["step_time_s"] > 0 and line["entropy"] > 0 for line in lines)


def test_the_fast_rollout_path_records_every_step_of_a_generation_round(tmp_path, stores):
    """generation.steps_per_generation=2 with a static cache and compiled decoding (the GPU's path,
    compiled here on the CPU): each round generates on its first step, every step gets its record,
    and the round's second step carries the round's rewards."""
    overrides = ["cluster.devices_per_node=1", *stores, "trainer.total_training_steps=4", "trainer.save_freq=4",
                 "generation.cache=static",
                 "generation.compile=true", "generation.steps_per_generation=2"]
    profile = resolve_profile("tiny", "cpu", overrides=overrides)
    data = fetch_dataset(DataSpec.from_profile(profile.data))
    model = prepare_model(ModelSpec.from_profile(profile.model))
    settings = plan_local_training(profile, data.train_files, model.path, tmp_path / "fast", devices_here=1,
                                  generation=plan_generation(profile)).model_copy(update={"phase_timing": True})
    try:
        result = like_the_stage(lambda: train_local(settings, None, None))
    finally:
        ray.shutdown()
    assert result.steps_done == 4
    records = [json.loads(line) for line in Path(settings.metrics_file).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["generation_s"] > 0 for r in records] == [True, False, True, False]
    assert records[1]["reward_mean"] == records[0]["reward_mean"] and records[3]["reward_mean"] == records[2]["reward_mean"]
    assert all(r["loss"] is not None for r in records)
    # The step's phases (bench/bench_grpo_step.py reads them): every step, exclusive times adding up to the step.
    phases = [json.loads(line) for line in (tmp_path / "fast" / RunFolder.PHASES).read_text().splitlines()]
    assert len(phases) == 4
    for record in phases:
        assert set(PHASES) <= set(record) and record["wall_s"] > 0
        assert min(record[p] for p in PHASES) >= 0 and record["other"] >= -1e-3  # exclusive: none counted twice
    assert [r["generation"] > 0 for r in phases] == [True, False, True, False]


def _kill_a_worker_after_checkpoint(checkpoints: Path, at_least: int, killed: dict) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        step = latest_step(checkpoints)
        if step is not None and step >= at_least:
            # Only this test's own Ray (its raylet is a child of this process): never another run's.
            for process in psutil.Process().children(recursive=True):
                try:
                    is_worker = "RayTrainWorker" in " ".join(process.cmdline())
                except psutil.Error:
                    continue
                if is_worker:
                    killed["after_checkpoint"] = step
                    process.kill()
                    return
        time.sleep(0.05)


def test_a_killed_worker_is_resumed_by_the_prefect_retry_and_a_finished_run_is_not_retrained(
    prefect_api, tmp_path, stores, monkeypatch
):
    import grpo_pipeline.flows.pipeline as pipeline
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    overrides, settings = settings_for(tmp_path, stores, steps=16, save_freq=4, run="resume")
    monkeypatch.setattr(pipeline, "train_task", pipeline.train_task.with_options(retry_delay_seconds=1))
    request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), run_name="resume",
                         stages=["train"], overrides=overrides)
    killed: dict = {}
    killer = threading.Thread(target=_kill_a_worker_after_checkpoint, args=(settings.checkpoints, 4, killed))
    killer.start()
    try:
        state = pipeline.grpo_pipeline(request, return_state=True)
    finally:
        killer.join()
        ray.shutdown()
    assert killed, "no Ray Train worker was found to kill"
    assert state.is_completed(), state
    train = state.result()["train"]
    assert train["steps_done"] == 16 and train["resumed_from"] is not None
    # Resumed from the checkpoint the kill came after (or a later one), losing at most save_freq steps.
    assert killed["after_checkpoint"] <= train["resumed_from"] < 16
    lines = [json.loads(line) for line in Path(train["metrics_file"]).read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 17))  # each step once, numbers continuing
    assert {line["resumed_from"] for line in lines if line["step"] > train["resumed_from"]} == {train["resumed_from"]}

    async def train_runs(flow_run_id):
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return [run for run in runs if run.name.startswith("train-")]

    (train_run,) = asyncio.run(train_runs(state.state_details.flow_run_id))
    assert train_run.run_count == 2 and train_run.state.is_completed()
    # Each attempt has its bar under the key `train`: the killed one says it stopped, the newest is done.
    bars = artifacts(["train"], state.state_details.flow_run_id)
    assert len(bars) == 2 and bars[1].data == 100 and bars[1].description.endswith(": done")
    assert "this attempt stopped (" in bars[0].description and bars[0].data < 100, bars[0]

    metrics_before = Path(train["metrics_file"]).read_text()
    again = pipeline.grpo_pipeline(request)
    assert again["train"]["already_complete"] and again["train"]["steps_done"] == 16
    assert Path(train["metrics_file"]).read_text() == metrics_before
