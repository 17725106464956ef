"""The run's reward on the verl backend: verl 0.9.1's own reward keys, and the files a job carries.

    python -m grpo_pipeline --model tiny --device gpu --backend verl --set 'reward.functions=[/r.py:compute_score]' --dry-run

A run whose reward is the pipeline's (rewards a user brings, a reward server, or data whose built-in reward
verl's default scorer does not give: math-verify's grading, arith) renders
`reward.custom_reward_function.path=pkg://grpo_pipeline.rewards.verl_entry` and `.name=compute_score`
(verl's `trainer/config/reward/reward.yaml`, loaded by `verl/trainer/ppo/reward.py` get_custom_reward_fn),
and its job carries, through Ray's `py_modules`, the project's package and `grpo_job_rewards/`: the plan
(plan.json) and a copy of each reward file, so the files every node reads are the ones planned. gsm8k and
geo3k with no reward of the user's keep verl's own scorers, which the built-in rewards equal.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.cluster.ray_cluster import project_modules
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.rewards.builtin import VERL_SAME
from grpo_pipeline.rewards.plan import RewardPlan
from grpo_pipeline.rewards.verl_entry import JOB_PACKAGE, PLAN_FILE

ENTRY = "pkg://grpo_pipeline.rewards.verl_entry"
ENTRY_FUNCTION = "compute_score"


def pipeline_reward(profile: RunProfile) -> bool:
    """Does verl score with the pipeline's reward rather than its own default scorer?"""
    from grpo_pipeline.profiles.datasets import data_source_of

    return profile.reward.custom or data_source_of(profile.data) not in VERL_SAME


def reward_settings(profile: RunProfile) -> dict[str, Any]:
    if not pipeline_reward(profile):
        return {}
    return {"reward.custom_reward_function.path": ENTRY, "reward.custom_reward_function.name": ENTRY_FUNCTION}


def job_reward_package(profile: RunProfile, job_dir: Path) -> Path:
    """`<job_dir>/grpo_job_rewards/`: plan.json with each reward file's copy named relative to it."""
    plan = RewardPlan.from_section(profile.reward)
    package = Path(job_dir) / JOB_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""The run\'s reward plan and files, carried by its verl job."""\n')
    for index, entry in enumerate(plan.functions):
        path, _, function = entry.spec.rpartition(":")
        copy = f"reward_{index}_{Path(path).name}"
        shutil.copyfile(Path(path).expanduser(), package / copy)
        entry.spec = f"{copy}:{function}"
    write_json_atomic(package / PLAN_FILE, plan.model_dump(mode="json"))
    return package


def reward_modules(profile: RunProfile, job_dir: Path, write: bool) -> list[str]:
    """The `py_modules` a job carries for its reward (none with verl's own scorer)."""
    if not pipeline_reward(profile):
        return []
    package = job_reward_package(profile, job_dir) if write else Path(job_dir) / JOB_PACKAGE
    return [*project_modules(), str(package)]
