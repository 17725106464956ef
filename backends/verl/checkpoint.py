"""A verl checkpoint step as a Hugging Face directory, for the export stage.

    python -m flows.grpo --model qwen3.5-122b-a10b --device npu --stages export_checkpoint --run-name <run>

verl's Megatron checkpoint (layout v2) keeps the policy under `global_step_N/actor/model/`:
- `huggingface/`: the bridge's HF weights, config and tokenizer (verl's default): used as they are;
- `dist_ckpt/`: a megatron-core dist checkpoint (with `use_dist_checkpointing`), whose HF config and
  tokenizer are in `huggingface/`: converted back to HF safetensors here, streamed, on the CPU, into
  `actor/huggingface-export/` (staged and renamed into place, so a half-written one is never found).
verl's own merger is not used: it needs NCCL/HCCL accelerators and has no Qwen3.5 support.
verl's FSDP checkpoint (`engine.strategy: fsdp`) keeps sharded `model_world_size_*_rank_*.pt` files
under `global_step_N/actor/` and, with `hf_model` in `checkpoint.save_contents` (the rendering adds it
for FSDP), the whole policy as HF safetensors in `actor/huggingface/`: used as it is.
"""

from __future__ import annotations

from pathlib import Path

from common.errors import UserError

EXPORT_DIR = "huggingface-export"


def verl_hf_dir(step_dir: Path) -> Path:
    """The step's policy as an HF directory: verl's own HF weights, else its dist checkpoint converted."""
    from common.megatron_layout import dist_to_hf

    fsdp = step_dir / "actor" / "huggingface"
    if (fsdp / "config.json").is_file() and any(fsdp.glob("*.safetensors")):
        return fsdp
    model = step_dir / "actor" / "model"
    exported = model / "huggingface"
    if (exported / "config.json").is_file() and any(exported.glob("*.safetensors")):
        return exported
    converted = step_dir / "actor" / EXPORT_DIR
    if (converted / "config.json").is_file():
        return converted
    dist = model / "dist_ckpt"
    if not (dist / ".metadata").is_file():
        raise UserError(f"{step_dir}: no policy to export: neither HF weights in actor/model/huggingface nor a complete "
                        "dist checkpoint in actor/model/dist_ckpt (verl writes one of them when "
                        "actor_rollout_ref.actor.checkpoint.save_contents holds 'model'), nor, from FSDP, HF weights "
                        "in actor/huggingface (save_contents must hold 'hf_model')")
    if not (exported / "config.json").is_file():
        raise UserError(f"{exported}: no config.json to name the dist checkpoint's tensors; verl writes the HF config "
                        "there with every checkpoint: copy the base model's config and tokenizer files into it")
    return dist_to_hf(dist, exported, converted)
