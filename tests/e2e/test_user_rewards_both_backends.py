"""One verl-style reward file and one TRL-style reward function, used unchanged, training the tiny model on
both backends: the local backend (TRL on a Ray Train worker) and the verl backend at the stand-in's boundary
(a Ray job on a CPU cluster; verl's own `get_custom_reward_fn` loads the rendered reward, from the files the
job carried)."""

from __future__ import annotations

import json

import ray
import pytest

from reward_files import TRL_STYLE, VERL_STYLE, write
from stage_retry import like_the_stage, steps_heard
from verl_cluster import flow_process, steps_in, submissions
from grpo_pipeline.backends.local.driver import train_local
from grpo_pipeline.backends.local.settings import plan_local_training
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.rewards.plan import RewardParts, RewardPlan, batch_of
from grpo_pipeline.run.folder import RunFolder
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
from grpo_pipeline.stages.model import ModelSpec, prepare_model
from grpo_pipeline.stages.plan import resolve_profile

pytestmark = pytest.mark.e2e


def functions(tmp_path) -> str:
    verl_file, trl_file = write(tmp_path, "team_verl.py", VERL_STYLE), write(tmp_path, "team_trl.py", TRL_STYLE)
    return f"reward.functions=[{{path: '{verl_file}:compute_score', weight: 0.5}}, '{trl_file}:digit_share']"


def test_the_local_backend_trains_with_both_and_logs_each_and_the_extras(stores, tmp_path):
    overrides = [*stores, "trainer.total_training_steps=2", "trainer.save_freq=2", functions(tmp_path)]
    profile = resolve_profile("tiny", "cpu", overrides=overrides)
    data = fetch_dataset(DataSpec.from_profile(profile.data))
    model = prepare_model(ModelSpec.from_profile(profile.model))
    settings = plan_local_training(profile, data.train_files, model.path, tmp_path / "run", devices_here=1,
                                   generation=plan_generation(profile))
    seen = []
    try:
        result = like_the_stage(lambda: train_local(settings, None, None, on_step=seen.append, on_start=steps_heard(seen)))
    finally:
        ray.shutdown()
    assert result.steps_done == 2 and [record.step for record in seen] == [1, 2]
    for record in seen:
        assert {"rewards/compute_score/mean", "rewards/digit_share/mean", "reward_extras/acc/mean",
                "reward_extras/length/mean"} <= set(record.rewards), record.rewards
        parts = record.rewards
        # TRL's sum with the weights: 0.5 x the verl reward + 1 x the TRL one (the same digit share here).
        assert record.reward_mean == pytest.approx(0.5 * parts["rewards/compute_score/mean"]
                                                   + parts["rewards/digit_share/mean"], abs=1e-5)


def test_the_verl_backend_renders_verls_keys_and_its_job_scores_with_the_carried_files(world, cluster, jobs, tmp_path):
    api_url, stores = world
    flow = flow_process(cluster.address, tmp_path, "rewards", functions(tmp_path), "trainer.total_training_steps=2",
                        stages="fetch_dataset,prepare_checkpoint,train", stores=stores, api_url=api_url)
    output, _ = flow.communicate(timeout=900)
    assert flow.returncode == 0, output[-3000:]
    run_dir = tmp_path / "rewards"
    assert steps_in(run_dir / "metrics.jsonl") == [1, 2]
    (job,) = submissions(jobs, "rewards")
    assert 'reward.custom_reward_function.path="pkg://grpo_pipeline.rewards.verl_entry"' in job.entrypoint
    assert "reward compute_score (verl style, weight 0.5)" in output  # the check before the submit
    # The job's reward is the plan's on the stand-in's responses (the even ones state the truth).
    import pyarrow.parquet as pq
    from grpo_pipeline.backends.metrics import read_metrics

    (data_file,) = json.loads((run_dir / RunFolder.DATASET).read_text())["train_files"]
    rows = pq.read_table(data_file).to_pylist()[:8]
    texts = [f"The answer is \\boxed{{{row['reward_model']['ground_truth']}}}." if j % 2 == 0 else "I am not sure."
             for row in rows for j in range(4)]
    expected = RewardParts(RewardPlan.model_validate_json((run_dir / "verl" / "grpo_job_rewards" / "plan.json").read_text()
                                                          .replace("reward_0", str(run_dir / "verl/grpo_job_rewards/reward_0"))
                                                          .replace("reward_1", str(run_dir / "verl/grpo_job_rewards/reward_1"))))
    first = expected.score(batch_of([r for r in rows for _ in range(4)], texts)).rewards
    assert read_metrics(run_dir / "metrics.jsonl")[0].reward_mean == pytest.approx(sum(first) / len(first), abs=1e-6)
