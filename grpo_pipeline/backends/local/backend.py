"""The local backend as the flow sees it (backends/base.py): TRL on Ray Train, in the flow's process."""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.backends.base import Backend, TrainingInputs, TrainingProgress, TrainingRun, TrainResult
from grpo_pipeline.backends.guards import GuardTrip
from grpo_pipeline.backends.local.checkpoints import latest_step
from grpo_pipeline.backends.local.mapping import algorithm_notes, mapping_problems
from grpo_pipeline.backends.local.rollout_memory import rollout_memory_problems
from grpo_pipeline.backends.local.settings import check_prompt_lengths, check_workers_fit, plan_local_training
from grpo_pipeline.backends.local.sizing import micro_batch_note, no_fit_refusal, one_device_table, size_rounds, size_step
from grpo_pipeline.backends.local.train_memory import checkpointing_choice
from grpo_pipeline.backends.local.trl_hooks import check_trl
from grpo_pipeline.errors import DoesNotFit
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.run.folder import RunFolder


class LocalBackend(Backend):
    name = "local"

    def profile_problems(self, profile: RunProfile) -> list[str]:
        return [*mapping_problems(profile), *rollout_memory_problems(profile)]

    def detected_layer(self, profile: RunProfile, devices_here: int, generation: GenerationPlan,
                       detected_names: list[str] | None = None, detected_gib: list[float] | None = None,
                       given: frozenset[str] = frozenset()) -> dict | None:
        # A CPU keeps its one worker (the host's cores are shared by the workers, not counted as devices)
        # and the profile's gradient checkpointing: no layer.
        if not (profile.platform.accelerated and devices_here > 0):
            return None
        layer: dict = {}
        if profile.cluster.nnodes == 1:
            # One training worker per accelerator found: a model directory on a one-GPU host would
            # otherwise take the gpu profile's 8 and be refused. The step is sized for the count the run
            # will have: a recipe's, a profile file's or --set's own count stands (more than the host has
            # is refused by check_run, with its fix).
            layer["cluster"] = {"devices_per_node": devices_here}
            workers = profile.cluster.devices_per_node if "cluster.devices_per_node" in given else devices_here
            profile = profile.model_copy(update={"cluster": profile.cluster.model_copy(update={"devices_per_node": workers})})
        # The micro batch, the recomputation and the rounds' rollouts the step needs (sizing.py), around what is given.
        sizing, rounds = size_rounds(profile, generation, detected_names, detected_gib, given)
        if sizing is not None:
            if not sizing.fits and profile.planner.enforce:
                raise DoesNotFit(no_fit_refusal(sizing))
            layer |= sizing.layer
        if rounds != generation.steps_per_generation:
            layer["generation"] = {"steps_per_generation": rounds}
        return layer or None

    def memory_note(self, profile: RunProfile, generation: GenerationPlan, detected_names: list[str] | None = None,
                    detected_gib: list[float] | None = None) -> str | None:
        choice = checkpointing_choice(profile, generation, detected_names, detected_gib)
        if choice is None:
            return None
        note = choice.describe(profile.model.enable_gradient_checkpointing, counted=bool(detected_gib))
        if detected_gib and (free := size_step(profile, generation, detected_names, detected_gib)):
            note += f"; {micro_batch_note(profile, free)}"
        return note

    def size_table(self, profile: RunProfile, generation: GenerationPlan) -> tuple[dict, list[str]] | None:
        return one_device_table(profile, generation)

    def algorithm_notes(self, profile: RunProfile, generation: GenerationPlan) -> list[str]:
        return algorithm_notes(profile, generation)

    def check_run(self, profile: RunProfile, devices_here: int, stages: list[str], dry_run: bool,
                  ray_address: str | None) -> None:
        if "train" in stages:
            check_workers_fit(profile, devices_here)
            check_trl()  # a TRL whose private methods moved is refused before anything starts

    def command(self, profile: RunProfile, inputs: TrainingInputs) -> list[str] | None:
        return None  # training runs inside the flow, on Ray Train

    def train(self, profile: RunProfile, run: TrainingRun, progress: TrainingProgress) -> TrainResult:
        from grpo_pipeline.backends.local.driver import train_local

        settings = plan_local_training(profile, run.inputs.train_files, run.inputs.model_path, Path(run.run_dir),
                                       run.devices_here, run.generation)
        if warning := check_trl():
            progress.warn(warning)
        if overlong := check_prompt_lengths(settings):
            progress.warn(f"{overlong} prompts longer than data.max_prompt_length={settings.max_prompt_length} are left out")
        rollouts = run.generation.describe()
        progress.note(f"rollouts: {rollouts}")
        for note in algorithm_notes(profile, run.generation):
            progress.note(note)
        progress.note(f"starting Ray and {profile.world_size} training worker(s) (Ray Train); the first step follows "
                      "once they have loaded the model")
        result = train_local(settings, run.runtime_env, run.ray_address, progress.step, run_name=run.run_name,
                             on_start=progress.started)
        result = result.model_copy(update={"rollouts": rollouts})
        if result.already_complete:
            progress.note(f"the run was already complete at step {result.steps_done}: nothing trained")
        return result

    def stop(self, run_dir: Path) -> bool:
        from grpo_pipeline.cluster.ray_cluster import stop_ray_job

        return stop_ray_job()  # the workers are this process's Ray job

    def stop_for_guard(self, run_dir: Path, trip: GuardTrip) -> str:
        # The workers check a step for non-finite values before its checkpoint is written: nothing after
        # the latest is poisoned.
        self.stop(run_dir)
        step = latest_step(Path(run_dir) / RunFolder.CHECKPOINTS)
        return f"checkpoint global_step_{step}, the latest" if step is not None else "no checkpoint (none was saved)"

    def policy_dir(self, result: TrainResult) -> Path:
        from grpo_pipeline.checkpoints.lora_export import export_lora_policy, has_adapter

        checkpoint = Path(result.checkpoint_dir)
        if has_adapter(checkpoint):  # a LoRA run's step holds the adapter: merged into the base model
            return export_lora_policy(checkpoint)[1]
        return checkpoint  # global_step_N holds the HF policy itself

    def adapter_dir(self, result: TrainResult) -> Path | None:
        from grpo_pipeline.checkpoints.lora_export import export_adapter, has_adapter

        checkpoint = Path(result.checkpoint_dir)
        return export_adapter(checkpoint) if has_adapter(checkpoint) else None
