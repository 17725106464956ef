"""The `export_checkpoint` stage: the trained policy as a verified HF directory.

    python -m grpo_pipeline --model tiny --device cpu --stages export_checkpoint --run-name try1

The backend that trained says where its policy is (`Backend.policy_dir`: the local backend's
`global_step_N` holds it; verl's step is merged from its Megatron shards when need be; a LoRA run's is the
adapter merged into the base model, written beside the adapter alone: checkpoints/lora_export.py). The
directory is checked like a base model (config loads, weights complete, shapes) and every tensor is
scanned for NaN / Inf: a diverged run must not be evaluated or shipped as if fine.

With `eval.checkpoints=all|best` every saved step is exported the same way, for the evaluation to rank;
the one it ranks first is then named the run's best (`mark_best`): `runs/<run>/best.json` and the link
`runs/<run>/best` to its HF directory (`--set 'eval.models=[runs/<run>/best]'` evaluates it again).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainResult
from grpo_pipeline.errors import UserError
from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.stages.model import ModelFormatError, verify_hf_dir
from grpo_pipeline.run.folder import RunFolder

if TYPE_CHECKING:
    from grpo_pipeline.stages.evaluate import BestCheckpoint

_STEP_DIR = re.compile(r"global_step_(\d+)")


class ExportedPolicy(BaseModel):
    path: str = Field(..., description="HF directory of the trained policy (a LoRA run's: the adapter merged).")
    adapter: str | None = Field(None, description="A LoRA run's adapter alone, in PEFT's format (adapter_config.json, "
                                "adapter_model.safetensors).")
    step: int
    num_parameters: int
    steps: dict[int, str] = Field(default_factory=dict, description="Every saved step's HF directory, verified like the "
                                  "last (eval.checkpoints=all|best); empty: the last step only.")


def check_finite(path: Path) -> None:
    from safetensors import safe_open

    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
                    raise ModelFormatError(
                        f"{shard}: tensor {name} has NaN or Inf values: the run diverged; evaluate an earlier "
                        "checkpoint or lower algorithm.lr"
                    )


def saved_steps(train: TrainResult) -> dict[int, Path]:
    """The run's saved steps up to the last one trained (both backends write `global_step_N/`)."""
    last = Path(train.checkpoint_dir)
    found = {int(m[1]): path for path in last.parent.iterdir() if (m := _STEP_DIR.fullmatch(path.name)) and path.is_dir()}
    return dict(sorted((step, path) for step, path in found.items() if step <= train.steps_done))


def export_step(train: TrainResult, step_dir: Path, step: int) -> tuple[Path, int]:
    """One saved step as a verified HF directory, and its parameter count."""
    path = backend_for(train.backend).policy_dir(train.model_copy(update={"checkpoint_dir": str(step_dir),
                                                                          "steps_done": step}))
    facts = verify_hf_dir(path)
    check_finite(path)
    return path, facts["num_parameters"]


def export_checkpoint(train: TrainResult, every_step: bool = False) -> ExportedPolicy:
    if not train.checkpoint_dir or not Path(train.checkpoint_dir).is_dir():
        raise UserError(f"no checkpoint to export at {train.checkpoint_dir!r}: run the train stage first")
    path, parameters = export_step(train, Path(train.checkpoint_dir), train.steps_done)
    adapter = backend_for(train.backend).adapter_dir(train)
    steps = {}
    if every_step:
        steps = {step: str(export_step(train, step_dir, step)[0]) for step, step_dir in saved_steps(train).items()
                 if step != train.steps_done}
        steps[train.steps_done] = str(path)
    return ExportedPolicy(path=str(path), adapter=str(adapter) if adapter else None, step=train.steps_done,
                          num_parameters=parameters, steps=dict(sorted(steps.items())))


def mark_best(run_dir: Path, best: BestCheckpoint) -> Path:
    """Name the run's best checkpoint: `best.json` (step, metric, value, path) and the link `best` to its HF
    directory, each replaced whole (a reader never sees half of either)."""
    link, staged = run_dir / RunFolder.BEST, run_dir / f".{RunFolder.BEST}.{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(os.path.relpath(best.path, run_dir))
    os.replace(staged, link)
    return write_json_atomic(run_dir / RunFolder.BEST_RECORD, best.model_dump(mode="json"))
