"""The `export_checkpoint` stage: the trained policy as a verified HF directory.

    python -m grpo_pipeline --model tiny --device cpu --stages export_checkpoint --run-name try1

The backend that trained says where its policy is (`Backend.policy_dir`: the local backend's
`global_step_N` holds it; verl's step is merged from its Megatron shards when need be; a LoRA run's is the
adapter merged into the base model, written beside the adapter alone: common/lora_export.py). The
directory is checked like a base model (config loads, weights complete, shapes) and every tensor is
scanned for NaN / Inf: a diverged run must not be evaluated or shipped as if fine.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainResult
from grpo_pipeline.common.errors import UserError
from grpo_pipeline.stages.model import ModelFormatError, verify_hf_dir


class ExportedPolicy(BaseModel):
    path: str = Field(..., description="HF directory of the trained policy (a LoRA run's: the adapter merged).")
    adapter: str | None = Field(None, description="A LoRA run's adapter alone, in PEFT's format (adapter_config.json, "
                                "adapter_model.safetensors).")
    step: int
    num_parameters: int


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


def export_checkpoint(train: TrainResult) -> ExportedPolicy:
    if not train.checkpoint_dir or not Path(train.checkpoint_dir).is_dir():
        raise UserError(f"no checkpoint to export at {train.checkpoint_dir!r}: run the train stage first")
    backend = backend_for(train.backend)
    path = backend.policy_dir(train)
    facts = verify_hf_dir(path)
    check_finite(path)
    adapter = backend.adapter_dir(train)
    return ExportedPolicy(path=str(path), adapter=str(adapter) if adapter else None, step=train.steps_done,
                          num_parameters=facts["num_parameters"])
