"""The verl backend as the flow sees it (backends/base.py).

Its layout rules (Megatron's TP x PP x CP against the world and the model, EP/ETP against the
experts, vLLM's TP against a node and the heads, batch sizes against Megatron's data-parallel ranks)
are checked whenever a profile is resolved. The flow stages the data and the model and renders the
command; it does not submit verl training as a Ray job yet, and refuses a run that asks it to
before anything is fetched.
"""

from __future__ import annotations

from pathlib import Path

from backends.base import Backend, TrainingInputs, TrainingProgress, TrainingRun, TrainResult
from backends.verl.checkpoint import verl_hf_dir
from backends.verl.command import verl_command
from profiles.errors import UserError
from profiles.schema import RunProfile
from profiles.validation import batch_problems, layout_problems, rollout_problems

NOT_SUBMITTED_YET = (
    "backend verl: the flow does not submit verl training yet; stage the data and model with "
    "--stages fetch_dataset,prepare_checkpoint and launch the rendered command on the cluster "
    "(--dry-run prints it), or train with --backend local"
)


class VerlBackend(Backend):
    name = "verl"

    def profile_problems(self, profile: RunProfile) -> list[str]:
        p = profile
        if not p.platform.accelerated:
            return [f"backend=verl on device {p.platform.kind}: verl needs GPUs or NPUs and vLLM; use --backend local, "
                    "or --device gpu|npu with --dry-run to render the cluster command here"]
        problems = layout_problems(p) + rollout_problems(p)
        model_parallel = p.engine.tp * p.engine.pp * p.engine.cp
        problems += batch_problems(p, data_parallel=p.data_parallel_size if p.world_size % model_parallel == 0 else 0)
        if p.actor.use_dynamic_bsz and not p.engine.use_remove_padding:
            problems.append(
                "actor.use_dynamic_bsz=true: dynamic batch size needs packed sequences, but "
                "engine.use_remove_padding=false; set actor.use_dynamic_bsz=false"
            )
        return problems

    def check_run(self, profile: RunProfile, devices_here: int, stages: list[str], dry_run: bool) -> None:
        if "train" in stages and not dry_run:
            raise UserError(NOT_SUBMITTED_YET)

    def command(self, profile: RunProfile, inputs: TrainingInputs) -> list[str] | None:
        return verl_command(profile, inputs)

    def train(self, profile: RunProfile, run: TrainingRun, progress: TrainingProgress) -> TrainResult:
        raise UserError(NOT_SUBMITTED_YET)

    def stop(self, run_dir: Path) -> bool:
        return False  # nothing is submitted yet

    def policy_dir(self, result: TrainResult) -> Path:
        return verl_hf_dir(Path(result.checkpoint_dir))
