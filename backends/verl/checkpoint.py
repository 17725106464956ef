"""A verl checkpoint step as a Hugging Face directory, for the export stage.

    python -m flows.grpo --model qwen3.5-122b-a10b --device gpu --stages export_checkpoint --run-name <run>

`global_step_N/actor/model/huggingface` when verl wrote one; else verl's own merger turns the
Megatron shards into one (`python -m verl.model_merger merge --backend megatron ...`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MERGE_TIMEOUT_S = 3600


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
