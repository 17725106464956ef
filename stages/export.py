"""The `export_checkpoint` stage: the trained policy as a verified HF directory.

    python -m flows.grpo --model tiny --device cpu --stages export_checkpoint --run-name try1

- local backend: `checkpoints/global_step_N/` already holds the HF policy (config, tokenizer,
  safetensors) next to the trainer state;
- verl: `global_step_N/actor/model/huggingface` when verl wrote one, else verl's own merger turns the
  Megatron shards into one (`python -m verl.model_merger merge --backend megatron ...`).

Either way the directory is checked like a base model (config loads, weights complete, shapes) and
every tensor is scanned for NaN / Inf: a diverged run must not be evaluated or shipped as if fine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, Field

from profiles.errors import UserError
from stages.model import ModelFormatError, verify_hf_dir

MERGE_TIMEOUT_S = 3600


class ExportedPolicy(BaseModel):
    path: str = Field(..., description="HF directory of the trained policy.")
    step: int
    num_parameters: int


def verl_hf_dir(step_dir: Path) -> Path:
    """verl's HF export of a step, merged from the Megatron shards when verl did not write one."""
    exported = step_dir / "actor" / "model" / "huggingface"
    if (exported / "config.json").is_file() and any(exported.glob("*.safetensors")):
        return exported
    merged = step_dir / "actor" / "huggingface-merged"
    if not (merged / "config.json").is_file():
        command = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "megatron",
                   "--local_dir", str(step_dir / "actor"), "--target_dir", str(merged)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=MERGE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"verl's model merger failed on {step_dir}: {done.stderr.strip().splitlines()[-1:]}")
    return merged


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


def export_checkpoint(backend: str, checkpoint_dir: str, step: int) -> ExportedPolicy:
    if not checkpoint_dir or not Path(checkpoint_dir).is_dir():
        raise UserError(f"no checkpoint to export at {checkpoint_dir!r}: run the train stage first")
    step_dir = Path(checkpoint_dir)
    path = verl_hf_dir(step_dir) if backend == "verl" else step_dir
    facts = verify_hf_dir(path)
    check_finite(path)
    return ExportedPolicy(path=str(path), step=step, num_parameters=facts["num_parameters"])
