"""The local backend as the flow sees it (backends/base.py): TRL on Ray Train, in the flow's process."""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.backends.base import Backend, TrainingInputs, TrainingProgress, TrainingRun, TrainResult
from grpo_pipeline.backends.local.checkpoints import latest_step
from grpo_pipeline.backends.local.mapping import mapping_problems
from grpo_pipeline.backends.local.rollout_memory import rollout_memory_problems
from grpo_pipeline.backends.local.settings import check_prompt_lengths, check_workers_fit, plan_local_training
from grpo_pipeline.profiles.schema import RunProfile


class LocalBackend(Backend):
    name = "local"

    def profile_problems(self, profile: RunProfile) -> list[str]:
        return [*mapping_problems(profile), *rollout_memory_problems(profile)]

    def detected_layer(self, profile: RunProfile, devices_here: int) -> dict | None:
        # One training worker per accelerator found: a model directory on a one-GPU host would
        # otherwise take the gpu profile's 8 and be refused. A CPU keeps its one worker (the host's
        # cores are shared by the workers, not counted as devices).
        if profile.platform.accelerated and profile.cluster.nnodes == 1 and devices_here > 0:
            return {"cluster": {"devices_per_node": devices_here}}
        return None

    def check_run(self, profile: RunProfile, devices_here: int, stages: list[str], dry_run: bool,
                  ray_address: str | None) -> None:
        if "train" in stages:
            check_workers_fit(profile, devices_here)

    def command(self, profile: RunProfile, inputs: TrainingInputs) -> list[str] | None:
        return None  # training runs inside the flow, on Ray Train

    def train(self, profile: RunProfile, run: TrainingRun, progress: TrainingProgress) -> TrainResult:
        from grpo_pipeline.backends.local.driver import train_local

        settings = plan_local_training(profile, run.inputs.train_files, run.inputs.model_path, Path(run.run_dir),
                                       run.devices_here, run.generation)
        if overlong := check_prompt_lengths(settings):
            progress.warn(f"{overlong} prompts longer than data.max_prompt_length={settings.max_prompt_length} are left out")
        rollouts = run.generation.describe()
        progress.note(f"rollouts: {rollouts}")
        progress.started(settings.max_steps, latest_step(settings.checkpoints))
        result = train_local(settings, run.runtime_env, run.ray_address, progress.step, run_name=run.run_name)
        result = result.model_copy(update={"rollouts": rollouts})
        if result.already_complete:
            progress.note(f"the run was already complete at step {result.steps_done}: nothing trained")
        return result

    def stop(self, run_dir: Path) -> bool:
        from grpo_pipeline.common.ray_cluster import stop_ray_job

        return stop_ray_job()  # the workers are this process's Ray job

    def policy_dir(self, result: TrainResult) -> Path:
        return Path(result.checkpoint_dir)  # global_step_N holds the HF policy itself
